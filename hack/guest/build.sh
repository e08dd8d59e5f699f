#!/usr/bin/env bash
# Builds the test guest from Debian packages only (see docs/test-guest.md):
#   vmlinuz, initrd.img (busybox + qemu-guest-agent + dropbear + virtio modules), disk.qcow2 (bootable with
#   SeaBIOS through syslinux and with OVMF through shim and GRUB, Secure Boot included),
#   containerdisk/disk/disk.qcow2 and manifest.json, into ${KUBEVIRT_RS_GUEST_DIR:-<repo>/.cache/guest}.
# Cached by a hash of its inputs (this script, rootfs/, the packages' versions): a second run
# with nothing changed returns at once. Needs root (device nodes in the initramfs), apt-get,
# dpkg-deb, cpio, zstd, mtools, syslinux, sfdisk, qemu-img (hack/deps.sh installs them).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${KUBEVIRT_RS_GUEST_DIR:-$repo/.cache/guest}
out=${out%/}
debs=${KUBEVIRT_RS_GUEST_DEBS:-$repo/.cache/guest-debs}

# The generic kernel rather than linux-image-cloud-amd64: the cloud flavour has no AHCI driver
# (CONFIG_SATA_AHCI is not set), so sata disks and CD-ROMs - KubeVirt's default cdrom bus and
# q35's built-in controller - would be invisible. Only the modules listed below are copied. The
# price: the generic vmlinuz (8 MB, XZ) takes about 5 s longer to decompress under TCG than
# the cloud one (14 MB, LZ4).
kernel_meta=linux-image-amd64
# Loaded in this order (their dependencies first, resolved from modules.dep); arguments follow.
# ext4 is there so the guest has a file system qemu-ga can freeze (a disk labelled kvrs-data);
# nls_ascii is vfat's default iocharset in this kernel (CONFIG_FAT_DEFAULT_IOCHARSET): without
# it a VFAT seed does not mount ("IO charset ascii not found"). crc32c_generic comes first
# because ext4 and jbd2 only name it as a softdep, which modules.dep does not list and busybox
# insmod does not resolve, and the metadata checksums mkfs.ext4 turns on by default need it.
# virtiofs (after fuse, its dependency) mounts a VMI's filesystems: `mount -t virtiofs <name> <dir>`.
modules=(
  "scsi_mod scan=sync"
  virtio_pci virtio_console virtio_blk virtio_net virtio_scsi virtio_rng virtio_balloon
  sd_mod sr_mod ahci ata_piix
  isofs vfat nls_cp437 nls_iso8859-1 nls_utf8 nls_ascii
  crc32c_generic ext4
  fuse virtiofs
  button evdev
)
# qemu-ga; the SSH server (dropbear, and OpenSSH's sftp-server, which scp uses: OpenSSH 9's
# scp speaks SFTP); the packages holding the libraries these link (resolved and checked below
# against their ELF NEEDED entries: a library none of them holds fails the build, naming it);
# the signed EFI boot chain (shim signed by Microsoft's UEFI CA, GRUB and the kernel by Debian).
packages=(busybox-static qemu-guest-agent libc6 libglib2.0-0 libpcre2-8-0 libnuma1 libudev1 liburing2
  dropbear-bin openssh-sftp-server libcrypt1 libtomcrypt1 libtommath1 libgmp10 zlib1g
  shim-signed grub-efi-amd64-signed)

log() { echo "guest: $*" >&2; }

[[ $EUID -eq 0 ]] || { log "must run as root: the initramfs needs /dev/console and /dev/null nodes"; exit 1; }
missing=()
for tool in apt-get apt-cache dpkg-deb cpio zstd readelf mkfs.vfat mcopy mmd syslinux qemu-img flock; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
((${#missing[@]} == 0)) || { log "missing tools: ${missing[*]} (run hack/deps.sh)"; exit 1; }

# Several test runs may start at once: one builds, the others wait and find it up to date.
mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9

# The build's own inputs; with the package versions they make the inputs hash.
local_hash=$( {
  cat "$0"
  (cd "$here" && find rootfs -type f -print0 | sort -z | xargs -0 sha256sum)
  (cd "$here" && find rootfs -type f -perm -u+x | sort)
  syslinux --version 2>&1 | head -1
} | sha256sum | cut -d' ' -f1)

complete() { [[ -f "$out/vmlinuz" && -f "$out/initrd.img" && -f "$out/disk.qcow2" && -f "$out/containerdisk/disk/disk.qcow2" ]]; }

# Fast path: nothing of ours changed and apt's package lists are older than the last build, so
# the package versions cannot have changed either (asking apt-cache takes seconds).
lists=/var/lib/apt/lists
if complete && [[ -f "$out/manifest.json" ]] && grep -q "\"local_hash\": \"$local_hash\"" "$out/manifest.json" &&
  [[ -z "$(find "$lists" -maxdepth 1 -newer "$out/manifest.json" -name '*Packages*' 2>/dev/null)" ]]; then
  log "up to date in $out"
  exit 0
fi

candidates() {
  apt-cache policy "$@" 2>/dev/null | awk '/^[^ ]/ {p=$1; sub(/:$/, "", p)} /Candidate:/ && $2 != "(none)" {print p "=" $2}'
}
# Resolves the kernel and every package to the version apt would install, into kernel_pkg and
# versions; unresolved names the packages apt has no version of.
resolve() {
  kernel_pkg=$(apt-cache depends "$kernel_meta" 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')
  wanted=("${packages[@]}" ${kernel_pkg:+"$kernel_pkg"})
  mapfile -t versions < <(candidates "${wanted[@]}")
  unresolved=()
  [[ -n "$kernel_pkg" ]] || unresolved+=("$kernel_meta")
  for p in "${wanted[@]}"; do
    printf '%s\n' "${versions[@]}" | grep -q "^$p=" || unresolved+=("$p")
  done
}
# apt's lists may be missing or partial: a machine image can carry the security suite's list and
# not the main one, and then installed packages and security updates resolve while the rest do
# not (a CI run failed so on dropbear-bin). One refresh, retried while the mirror is mid-sync.
resolve
if ((${#unresolved[@]})); then
  log "apt has no version of ${unresolved[*]}: apt-get update"
  for attempt in 1 2 3; do
    apt-get update -qq && break
    ((attempt < 3)) || { log "apt-get update failed 3 times"; exit 1; }
    log "apt-get update failed (attempt $attempt); retrying in $((attempt * 10)) s"
    sleep $((attempt * 10))
  done
  resolve
fi
((${#unresolved[@]} == 0)) || { log "no installable version of ${unresolved[*]} in apt's sources (apt-cache policy ${unresolved[*]})"; exit 1; }

inputs_hash=$(printf '%s\n' "$local_hash" "${versions[@]}" | sha256sum | cut -d' ' -f1)

if complete && [[ -f "$out/manifest.json" ]] && grep -q "\"inputs_hash\": \"$inputs_hash\"" "$out/manifest.json"; then
  touch "$out/manifest.json"
  log "up to date in $out ($inputs_hash)"
  exit 0
fi

# Download what is not cached yet; a cached .deb is used when its version matches.
mkdir -p "$debs"
want=()
for pv in "${versions[@]}"; do
  p=${pv%%=*} v=${pv#*=}
  have=""
  for f in "$debs/${p}"_*.deb; do
    [[ -f "$f" ]] || continue
    if [[ "$(dpkg-deb -f "$f" Package)" == "$p" && "$(dpkg-deb -f "$f" Version)" == "$v" ]]; then
      have=$f
    else
      rm -f "$f"
    fi
  done
  [[ -n "$have" ]] || want+=("$pv")
done
if ((${#want[@]})); then
  log "downloading ${want[*]}"
  # apt-get download writes into the current directory.
  (cd "$debs" && apt-get download -q "${want[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/kubevirt-rs-guest.XXXXXX")
trap 'rm -rf "$work"' EXIT
x=$work/extract
mkdir -p "$x"
for pv in "${versions[@]}"; do
  p=${pv%%=*}
  f=$(ls "$debs/${p}"_*.deb 2>/dev/null | head -1)
  [[ -n "$f" ]] || { log "download of $p failed"; exit 1; }
  dpkg-deb -x "$f" "$x"
done

kver=$(ls "$x/lib/modules")
moddir=$x/lib/modules/$kver
# The package leaves modules.dep to depmod at install time; the guest's own busybox computes it.
"$x/bin/busybox" depmod -b "$x" "$kver"
root=$work/root
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,run,tmp,root,mnt,var,lib/modules,lib64}
mkdir -p "$root/lib/x86_64-linux-gnu" "$root/usr/share/udhcpc"
ln -s ../run "$root/var/run"

# busybox and its applet links; /init is busybox's init (argv[0] "init").
cp "$x/bin/busybox" "$root/bin/busybox"
"$x/bin/busybox" --list-full | while read -r applet; do
  [[ -e "$root/$applet" ]] || ln -s /bin/busybox "$root/$applet"
done
ln -s /bin/busybox "$root/init"
cp "$x/usr/share/doc/busybox-static/examples/udhcp/simple.script" "$root/usr/share/udhcpc/default.script"
chmod +x "$root/usr/share/udhcpc/default.script"

# qemu-ga, dropbear (server and dropbearkey) and sftp-server, and the shared libraries they
# need, transitively, taken from the extracted packages.
binaries=(usr/sbin/qemu-ga usr/sbin/dropbear usr/bin/dropbearkey usr/lib/openssh/sftp-server)
for b in "${binaries[@]}"; do
  mkdir -p "$root/$(dirname "$b")"
  cp "$x/$b" "$root/$b"
done
# dropbear runs the sftp subsystem as /usr/lib/sftp-server (Debian's build), the package's link.
ln -s openssh/sftp-server "$root/usr/lib/sftp-server"
# dropbear -R writes the host keys it generates here; root's home must not be group- or
# world-writable, or dropbear ignores ~/.ssh/authorized_keys.
mkdir -p "$root/etc/dropbear"
chmod 0700 "$root/root"
libdirs=("$x/lib/x86_64-linux-gnu" "$x/usr/lib/x86_64-linux-gnu")
declare -A copied=()
copy_needed() {
  local lib f d
  for lib in $(readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    [[ -n "${copied[$lib]:-}" ]] && continue
    f=""
    for d in "${libdirs[@]}"; do [[ -e "$d/$lib" ]] && { f=$d/$lib; break; }; done
    [[ -n "$f" ]] || { log "library $lib (needed by ${1##*/}) is in none of the packages"; exit 1; }
    copied[$lib]=1
    cp -L "$f" "$root/lib/x86_64-linux-gnu/$lib"
    copy_needed "$f"
  done
}
for b in "${binaries[@]}"; do copy_needed "$x/$b"; done
cp -L "$x/lib64/ld-linux-x86-64.so.2" "$root/lib64/ld-linux-x86-64.so.2"

# Kernel modules in load order: each module after its dependencies (modules.dep lists them).
declare -A dep_of=() done_mod=() path_of=()
while IFS=: read -r mod deps; do
  dep_of[$mod]=$deps
  base=${mod##*/}
  base=${base%.ko}
  path_of[${base//-/_}]=$mod
done <"$moddir/modules.dep"
order=()
add_module() {
  local m=$1 d
  [[ -n "${done_mod[$m]:-}" ]] && return
  done_mod[$m]=1
  for d in ${dep_of[$m]}; do add_module "$d"; done
  order+=("$m")
}
declare -A args_of=()
for entry in "${modules[@]}"; do
  read -r name args <<<"$entry"
  key=${name//-/_}
  if [[ -n "${path_of[$key]:-}" ]]; then
    args_of[${path_of[$key]}]=$args
    add_module "${path_of[$key]}"
  elif grep -Eq "/${name}\.ko$|/${key}\.ko$" "$moddir/modules.builtin"; then
    log "module $name is built into $kver"
  else
    log "module $name is neither in modules.dep nor built into $kver"
    exit 1
  fi
done
: >"$root/etc/modules.order"
for m in "${order[@]}"; do
  mkdir -p "$root/lib/modules/$(dirname "$m")"
  cp "$moddir/$m" "$root/lib/modules/$m"
  echo "$m ${args_of[$m]:-}" >>"$root/etc/modules.order"
done

cp -a "$here/rootfs/." "$root/"
cat >"$root/etc/os-release" <<EOF
PRETTY_NAME="kubevirt-rs test guest (Debian 12, Linux $kver)"
NAME="kubevirt-rs test guest"
ID=kubevirt-rs-guest
ID_LIKE=debian
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
EOF
mknod -m 600 "$root/dev/console" c 5 1
mknod -m 666 "$root/dev/null" c 1 3

mkdir -p "$out.new"
rm -rf "${out:?}.new"/*
cp "$x/boot/vmlinuz-$kver" "$out.new/vmlinuz"
# zstd: the fastest of the kernel's decompressors, which matters under TCG.
(cd "$root" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --reproducible --quiet) |
  zstd -q -19 -T0 >"$out.new/initrd.img"

# The bootable disk: an MBR with one active FAT partition holding the kernel and initrd,
# syslinux for BIOS, and for OVMF the removable-media path EFI/BOOT/BOOTX64.EFI = shim, which
# starts grubx64.efi from its own directory; Debian's signed GRUB reads /EFI/debian/grub.cfg.
# Every EFI stage and the kernel are signed, so the disk also boots with Secure Boot on
# (OVMF_CODE*.secboot.fd with the Microsoft keys of OVMF_VARS*.ms.fd).
# The partition: what it holds plus 4 MiB for the FAT, syslinux and slack.
payload=$(stat -c %s "$out.new/vmlinuz" "$out.new/initrd.img" "$x/usr/lib/shim/shimx64.efi.signed" \
  "$x/usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed" | awk '{n += $1} END {print n}')
part_mib=$((payload / 1048576 + 4))
img=$work/disk.img
truncate -s $(((part_mib + 1) * 1048576)) "$img"
# The partition entry by hand (no fdisk needed): active, type 0x0e (FAT16 LBA), CHS fields
# marked "use LBA", LBA start 2048, length in sectors; then the boot signature.
le32() { printf '\\x%02x\\x%02x\\x%02x\\x%02x' $(($1 & 255)) $(($1 >> 8 & 255)) $(($1 >> 16 & 255)) $(($1 >> 24 & 255)); }
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$img" bs=440 count=1 conv=notrunc status=none
printf "\\x80\\xfe\\xff\\xff\\x0e\\xfe\\xff\\xff$(le32 2048)$(le32 $((part_mib * 2048)))" |
  dd of="$img" bs=1 seek=446 conv=notrunc status=none
printf '\x55\xaa' | dd of="$img" bs=1 seek=510 conv=notrunc status=none
part="$img@@1M"
mkfs.vfat -F 16 -n GUESTBOOT --offset 2048 "$img" $((part_mib * 1024)) >/dev/null
export MTOOLS_SKIP_CHECK=1
mcopy -i "$part" "$out.new/vmlinuz" ::/vmlinuz
mcopy -i "$part" "$out.new/initrd.img" ::/initrd.img
cat >"$work/syslinux.cfg" <<'EOF'
DEFAULT guest
PROMPT 0
TIMEOUT 0
LABEL guest
  LINUX /vmlinuz
  INITRD /initrd.img
  APPEND console=ttyS0
EOF
mcopy -i "$part" "$work/syslinux.cfg" ::/syslinux.cfg
syslinux --offset 1048576 --install "$img"
mmd -i "$part" ::/EFI ::/EFI/BOOT ::/EFI/debian
mcopy -i "$part" "$x/usr/lib/shim/shimx64.efi.signed" ::/EFI/BOOT/BOOTX64.EFI
mcopy -i "$part" "$x/usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed" ::/EFI/BOOT/grubx64.efi
cat >"$work/grub.cfg" <<'EOF'
set timeout=0
set default=0
menuentry "kubevirt-rs test guest" {
  linux /vmlinuz console=ttyS0
  initrd /initrd.img
}
EOF
mcopy -i "$part" "$work/grub.cfg" ::/EFI/debian/grub.cfg
qemu-img convert -q -f raw -O qcow2 -c "$img" "$out.new/disk.qcow2"
# A hard link, not a copy: it keeps the whole output under 40 MB. Both names are images to
# boot from through an overlay or snapshot=on, never to write (hence read-only modes).
chmod 0444 "$out.new/disk.qcow2"
mkdir -p "$out.new/containerdisk/disk"
ln "$out.new/disk.qcow2" "$out.new/containerdisk/disk/disk.qcow2"

cat >"$out.new/manifest.json" <<EOF
{
  "kernel": "vmlinuz",
  "initrd": "initrd.img",
  "disk": "disk.qcow2",
  "containerdisk": "containerdisk/disk/disk.qcow2",
  "kernel_args": "console=ttyS0",
  "kernel_version": "$kver",
  "packages": [$(printf '"%s",' "${versions[@]}" | sed 's/,$//')],
  "local_hash": "$local_hash",
  "inputs_hash": "$inputs_hash"
}
EOF
rm -rf "$out"
mv "$out.new" "$out"
log "built in $out: $(du -sh "$out" | cut -f1) ($inputs_hash)"
