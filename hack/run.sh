#!/usr/bin/env bash
# The main job, as far as the project goes today: build everything and boot the example
# kernel-boot VMI (manifests/examples/vmi-kernel-boot.yaml) through virt-launcher on real QEMU,
# then show the guest's console.
#
# Until virt-handler's node loop lands, this script plays the handler's part itself: it lays out
# the launcher's directories, puts the kernel-boot files where the handler would mount them, and
# PUTs the VMI to the launcher's command socket. The full path (localcluster, virt-controller,
# virt-handler) replaces these steps as those issues land.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
fail() { printf '\nrun.sh: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || fail "run as root (QEMU, namespaces and /var/run paths need it)"

step "installing Debian packages and tools (hack/deps.sh)"
hack/deps.sh
step "building the test guest from Debian packages (hack/guest/build.sh, cached)"
hack/guest/build.sh
guest=${KUBEVIRT_RS_GUEST_DIR:-$repo/.cache/guest}

step "building virt-launcher"
cargo build -p launcher --bin virt-launcher
launcher_bin=${CARGO_TARGET_DIR:-$repo/target}/debug/virt-launcher

run=${KUBEVIRT_RS_RUN_DIR:-/var/tmp/kubevirt-rs/demo}
step "laying out the launcher's directories under $run"
if [[ -S $run/share/sockets/launcher-sock ]] && curl -sf --unix-socket "$run/share/sockets/launcher-sock" http://launcher/v1/ping >/dev/null; then
  fail "a demo launcher is already serving $run/share/sockets/launcher-sock; stop it with: curl -X POST --unix-socket $run/share/sockets/launcher-sock http://launcher/v1/kill"
fi
rm -rf "$run"
mkdir -p "$run"/{share/sockets,private,ephemeral,container-disks/kernel-boot,hotplug}
# virt-handler bind-mounts the kernelBoot container's files here; the demo copies them.
cp "$guest/vmlinuz" "$guest/initrd.img" "$run/container-disks/kernel-boot/"

manifest=manifests/examples/vmi-kernel-boot.yaml
uid=$(cat /proc/sys/kernel/random/uuid)
vmi=$(yq --arg uid "$uid" '.metadata.uid = $uid | .metadata.namespace = "default"' "$manifest")
name=$(jq -r .metadata.name <<<"$vmi")

step "starting virt-launcher for $name (uid $uid)"
"$launcher_bin" --name "$name" --namespace default --uid "$uid" --allow-emulation \
  --kubevirt-share-dir "$run/share" --private-dir "$run/private" \
  --ephemeral-disk-dir "$run/ephemeral" --container-disk-dir "$run/container-disks" \
  --hotplug-disk-dir "$run/hotplug" >"$run/launcher.log" 2>&1 &
launcher_pid=$!
sock=$run/share/sockets/launcher-sock
for _ in $(seq 100); do [[ -S $sock ]] && break; kill -0 $launcher_pid 2>/dev/null || fail "virt-launcher exited; see $run/launcher.log"; sleep 0.1; done
[[ -S $sock ]] || fail "virt-launcher did not open $sock; see $run/launcher.log"
api() { curl -sS --unix-socket "$sock" "$@"; }
api http://launcher/v1/info; echo

step "syncing the VMI ($manifest) to the launcher"
api -X PUT -H 'content-type: application/json' --data-binary "$vmi" http://launcher/v1/sync; echo
for _ in $(seq 300); do
  state=$(api http://launcher/v1/domain | jq -r .state)
  [[ $state == Running ]] && break
  [[ $state == Crashed || $state == Shutoff ]] && fail "domain is $state; see $run/launcher.log and $run/private/$uid/qemu.log"
  sleep 1
done
[[ $state == Running ]] || fail "domain did not reach Running; see $run/launcher.log"
api http://launcher/v1/domain | jq "{state, reason, accelerator, qemuPid, vcpuThreads}"

step "guest console (under TCG a boot takes 15-90 s)"
log=$run/private/$uid/virt-serial0-log
ready=0
for _ in $(seq 240); do
  if grep -q KUBEVIRT-RS-GUEST-READY "$log" 2>/dev/null; then ready=1; break; fi
  sleep 1
done
tail -n 25 "$log" || true
((ready)) || fail "the guest did not print its ready marker within 240 s; full console log: $log"

cat <<MSG

The VM is running under virt-launcher (pid $launcher_pid). Try:
  curl --unix-socket $sock http://launcher/v1/domain
  curl --unix-socket $sock http://launcher/v1/guest/osinfo
  curl -X POST --unix-socket $sock http://launcher/v1/pause     # and /v1/unpause
  socat -,raw,echo=0 UNIX-CONNECT:$run/private/$uid/virt-serial0   # the serial console
Stop it (ACPI shutdown, then the launcher exits):
  curl -X POST --unix-socket $sock http://launcher/v1/shutdown
MSG
