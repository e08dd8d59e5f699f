#!/usr/bin/env bash
# Installs everything the build and the tests need on a fresh Debian 12 machine (root).
# Idempotent: packages already present are not fetched again.
set -euo pipefail

packages=(
  qemu-system-x86   # QEMU 7.2: the hypervisor the launcher drives
  qemu-utils        # qemu-img: overlays, empty disks, test images
  ovmf              # EFI firmware for efi VMIs
  nftables          # masquerade binding
  isc-dhcp-client   # dhclient -6: a real DHCPv6 client against the launcher's server (network tests)
  iproute2          # netns, veth, bridges, taps
  cpio              # packing the test guest's initramfs
  xz-utils zstd     # unpacking kernel modules from Debian packages
  mtools dosfstools syslinux syslinux-common binutils  # the test guest: bootable disk (FAT + syslinux), readelf
  e2fsprogs         # mkfs.ext4: the test guest's freezable data disk (label kvrs-data)
  ca-certificates curl jq yq socat openssl
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
