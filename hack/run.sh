#!/usr/bin/env bash
# The main job: on a fresh Debian 12 machine (root, Rust and Go toolchains), install what is
# needed, build, start localcluster (the upstream Kubernetes control plane built from pinned Go
# modules, plus our process kubelet), install KubeVirt on it as KubeVirt users do
# (hack/install.sh: the operator manifest and the KubeVirt CR of manifests/release/), apply the
# example VM, wait until its guest has booted, show the guest's console, and leave everything
# running with the next commands to try.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
fail() { printf '\nrun.sh: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || fail "run as root (namespaces, cgroups, mounts and QEMU need it)"

vm_manifest=${1:-manifests/examples/vm-demo.yaml}
[[ -f $vm_manifest ]] || fail "no such manifest: $vm_manifest"

step "installing Debian packages and tools (hack/deps.sh)"
hack/deps.sh
step "building the test guest from Debian packages (hack/guest/build.sh, cached)"
hack/guest/build.sh
guest=${KUBEVIRT_RS_GUEST_DIR:-$repo/.cache/guest}

step "building the upstream control plane and kubectl from pinned Go modules (localcluster/upstream/build.sh, cached; about 5 minutes the first time)"
kube=$(localcluster/upstream/build.sh)
export PATH="$(dirname "$kube"):$PATH"
kubectl version --client

step "building localcluster, virt-operator, virt-api, virt-controller, virt-handler, virt-launcher, container-disk, virtctl, build-images"
CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}" cargo build --locked -p localcluster -p operator -p virtapi -p controller -p handler -p launcher -p containerdisk -p virtctl -p imagebuild --bins
CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}" hack/build-static.sh
bins=${CARGO_TARGET_DIR:-$repo/target}/debug

state=${LOCALCLUSTER_DIR:-$HOME/.localcluster}
export LOCALCLUSTER_DIR=$state
export KUBECONFIG=$state/kubeconfig
if [[ -f $state/localcluster.pid ]] && kill -0 "$(cat "$state/localcluster.pid")" 2>/dev/null; then
  fail "localcluster is already running (pid $(cat "$state/localcluster.pid")); stop it first: $bins/localcluster down"
fi

step "building the images: virt-operator, virt-api, virt-controller, virt-handler, virt-launcher (with QEMU), container-disk, the test guest's"
mkdir -p "$state"
# A fresh layout each run (about 3 s): blobs of earlier builds would pile up in it.
rm -rf "$state/images-build"
"$bins/build-images" --bin-dir "$bins" --guest-dir "$guest" --layout "$state/images-build"

step "starting localcluster: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy and one node running those images (log: $state/localcluster.log)"
rm -f "$KUBECONFIG"
setsid "$bins/localcluster" up --nodes 1 --kube "$kube" --image "$state/images-build" \
  >"$state/localcluster.log" 2>&1 </dev/null &
lc_pid=$!
# The kubeconfig is written once the control plane is ready; the node follows.
for _ in $(seq 360); do
  [[ -f $KUBECONFIG ]] && [[ $(kubectl get nodes -o name 2>/dev/null | wc -l) -ge 1 ]] && break
  kill -0 $lc_pid 2>/dev/null || fail "localcluster exited; see $state/localcluster.log and $state/logs/"
  sleep 0.5
done
kubectl get --raw /readyz >/dev/null || fail "kube-apiserver did not become ready; see $state/localcluster.log and $state/logs/kube-apiserver.log"
kubectl version
kubectl get nodes -o wide

step "installing KubeVirt (hack/install.sh): the operator manifest, then the KubeVirt CR; virt-operator installs the rest"
hack/install.sh
kubectl -n kubevirt get kv kubevirt -o wide
kubectl get nodes -L kubevirt.io/schedulable

step "applying $vm_manifest"
kubectl apply -f "$vm_manifest"
vm=$(yq -r .metadata.name "$vm_manifest")
ns=$(yq -r '.metadata.namespace // "default"' "$vm_manifest")
echo "waiting for VMI $ns/$vm to run (under TCG a boot takes 15-90 s)"
phase=
for _ in $(seq 300); do
  phase=$(kubectl -n "$ns" get vmi "$vm" -o jsonpath='{.status.phase}' 2>/dev/null || true)
  [[ $phase == Running || $phase == Failed || $phase == Succeeded ]] && break
  sleep 1
done
kubectl -n "$ns" get vm,vmi,pods -o wide
[[ $phase == Running ]] || fail "VMI $vm is '${phase:-not created}'; see: kubectl -n $ns describe vmi $vm; kubectl -n $ns get events"

fields=$(kubectl -n "$ns" get vmi "$vm" -o jsonpath='{.metadata.uid} {.status.nodeName}')
read -r vmi_uid node <<<"$fields"
fields=$(kubectl -n "$ns" get pods -l "kubevirt.io/created-by=$vmi_uid" -o jsonpath='{.items[0].metadata.uid} {.items[0].status.podIP}')
read -r pod pod_ip <<<"$fields"
private=$state/nodes/$node/var/lib/kubelet/pods/$pod/volumes/kubernetes.io~empty-dir/private/$vmi_uid
log=$private/virt-serial0-log

step "guest console ($log)"
ready=0
for _ in $(seq 300); do
  if grep -q KUBEVIRT-RS-GUEST-READY "$log" 2>/dev/null; then ready=1; break; fi
  sleep 1
done
tail -n 25 "$log" || true
((ready)) || fail "the guest did not print its ready marker within 300 s; full console log: $log"

cat <<MSG

The VM runs on localcluster, through virt-api, virt-controller, virt-handler and virt-launcher. Try:
  export KUBECONFIG=$KUBECONFIG PATH=$bins:\$PATH
  kubectl get vms,vmis,pods -A
  virtctl console $vm -n $ns                      # the guest's serial console (Ctrl+] leaves)
  virtctl vnc screenshot $vm -n $ns --file screen.png
  virtctl guestosinfo $vm -n $ns                  # what the guest agent reports
  virtctl pause vm $vm -n $ns; virtctl unpause vm $vm -n $ns
  virtctl restart $vm -n $ns; virtctl stop $vm -n $ns; virtctl start $vm -n $ns
  kubectl -n $ns create -f - <<<'{"apiVersion":"v1","kind":"PersistentVolumeClaim","metadata":{"name":"data"},"spec":{"accessModes":["ReadWriteOnce"],"resources":{"requests":{"storage":"1Gi"}}}}'
  virtctl addvolume $vm -n $ns --volume-name=data # a blank claim, hotplugged (removevolume unplugs it)
  nc $pod_ip 8080      # the demo guest's listener, through the masquerade binding (pod IP $pod_ip)
Stop everything:
  $bins/localcluster down
MSG
