#!/usr/bin/env bash
# Installs everything the build and the tests need on a fresh Debian 12 machine (root), then
# checks that every tool answers: installing one package can remove another's tool (on a machine
# of another kind, installing qemu-system-x86 replaced a newer preinstalled qemu-utils and took
# qemu-img away). Idempotent: packages already present are not fetched again.
set -euo pipefail

packages=(
  qemu-system-x86   # QEMU 7.2: the hypervisor the launcher drives; with qemu-system-common's virtiofsd
  qemu-utils        # qemu-img: overlays, empty disks, test images
  ovmf              # EFI firmware for efi VMIs
  nftables          # masquerade binding; kube-proxy's nftables mode
  isc-dhcp-client   # dhclient -6: a real DHCPv6 client against the launcher's server (network tests)
  iproute2          # netns, veth, bridges, taps
  cpio              # packing the test guest's initramfs
  xz-utils zstd     # unpacking kernel modules from Debian packages
  mtools dosfstools syslinux syslinux-common binutils  # the test guest: bootable disk (FAT + syslinux), readelf
  e2fsprogs         # mkfs.ext4: the test guest's freezable data disk (label kvrs-data)
  ca-certificates curl jq yq socat openssl
  tmux              # e2e: `virtctl console` in a real terminal
  openssh-client    # ssh, scp, ssh-keygen: `virtctl ssh`/`virtctl scp` against the test guest's dropbear
  busybox-static    # the test-tools image's shell and tools (one static binary)
  skopeo            # tests read the release's OCI archives as users' tools do
  g++               # fuzz/ (hack/fuzz.sh): libfuzzer-sys compiles libFuzzer, which is C++
  pkg-config libfuse3-dev  # fuzz/: the cdfs ISO reader's FUSE dependency (fuser) links libfuse3
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo-nextest >/dev/null 2>&1; then
  echo "deps: installing cargo-nextest"
  cargo install --locked cargo-nextest
fi
for comp in rustfmt clippy; do
  rustup component list --installed 2>/dev/null | grep -q "^$comp" || rustup component add "$comp"
done

# Go builds the upstream control plane (localcluster/upstream): k8s.io/kubernetes v1.37 needs
# Go 1.26. The machine's Go is used as it is; GOTOOLCHAIN lets the go command fetch a newer
# release from the module proxy if go.mod ever asks for one.
go_version=$(go env GOVERSION 2>/dev/null || true)
if [[ ! $go_version =~ ^go1\.(2[6-9]|[3-9][0-9]) ]]; then
  echo "deps: Go 1.26 or newer is needed to build the upstream control plane (found: ${go_version:-no go on PATH})" >&2
  exit 1
fi

# Every tool the build, the tests and hack/run.sh call, checked after installing: a package
# install can remove a tool another package provided.
missing_tools=()
for tool in qemu-system-x86_64 qemu-img nft ip cpio xz zstd mcopy mkfs.fat \
  mkfs.ext4 readelf dhclient curl jq yq socat openssl tmux ssh ssh-keygen scp busybox skopeo go cargo-nextest \
  g++ pkg-config clippy-driver; do
  command -v "$tool" >/dev/null 2>&1 || missing_tools+=("$tool")
done
if ((${#missing_tools[@]})); then
  echo "deps: still missing after installing: ${missing_tools[*]}" >&2
  exit 1
fi
qemu-img --version >/dev/null || { echo "deps: qemu-img does not run" >&2; exit 1; }
# virtiofsd is not on PATH: Debian 12 ships QEMU's C daemon there (the launcher image carries it).
/usr/lib/qemu/virtiofsd --version >/dev/null || { echo "deps: /usr/lib/qemu/virtiofsd (qemu-system-common) does not run" >&2; exit 1; }
pkg-config --exists fuse3 || { echo "deps: pkg-config does not find fuse3 (libfuse3-dev)" >&2; exit 1; }
