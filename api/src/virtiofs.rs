//! KubeVirt's virtiofs (`pkg/virtiofs`, `pkg/virt-controller/services/virtiofs.go`): a volume
//! named by `spec.domain.devices.filesystems` is served by virtiofsd in a container of its own
//! in the launcher pod (`virtiofs-<volume>`), which listens on
//! `<share dir>/virtiofs-containers/<volume>.sock` in an emptyDir both that container and the
//! compute container mount; QEMU connects its `vhost-user-fs-pci` device there, and the guest
//! mounts the file system by the volume's name.

use std::path::{Path, PathBuf};

use crate::vmi::VirtualMachineInstanceSpec;

/// virtiofsd as Debian 12 ships it (QEMU 7.2's C daemon, in `qemu-system-common`): the launcher
/// image carries it where the package puts it. KubeVirt runs the Rust virtiofsd from
/// `/usr/libexec/virtiofsd`, which Debian 12 does not package.
pub const VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";

/// KubeVirt's `VirtioFSContainers`: the emptyDir of the sockets, and its directory under the
/// share dir (`/var/run/kubevirt/virtiofs-containers`).
pub const CONTAINERS_VOLUME: &str = "virtiofs-containers";

/// KubeVirt's `EnableVirtioFsStorageVolumes` feature gate (alpha): PVCs and DataVolumes shared
/// through virtiofs. Config volumes need none (`EnableVirtioFsConfigVolumes` is GA).
pub const STORAGE_VOLUMES_GATE: &str = "EnableVirtioFsStorageVolumes";

/// The longest tag a virtio-fs device has (`struct virtio_fs_config`'s 36 bytes): QEMU refuses
/// a longer one, so the guest could never see the file system.
pub const TAG_MAX: usize = 36;

/// KubeVirt's `VirtioFSSocketPath`: where virtiofsd serves `volume`.
pub fn socket_path(share_dir: &Path, volume: &str) -> PathBuf {
    share_dir
        .join(CONTAINERS_VOLUME)
        .join(format!("{volume}.sock"))
}

/// The launcher pod's container serving `volume`.
pub fn container_name(volume: &str) -> String {
    format!("virtiofs-{volume}")
}

/// KubeVirt's `IsVMIVirtiofsEnabled`: guest memory must then be shared with virtiofsd.
pub fn enabled(spec: &VirtualMachineInstanceSpec) -> bool {
    !spec.domain.devices.filesystems.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_kubevirts() {
        assert_eq!(
            socket_path(Path::new("/var/run/kubevirt"), "cfg"),
            Path::new("/var/run/kubevirt/virtiofs-containers/cfg.sock")
        );
        assert_eq!(container_name("cfg"), "virtiofs-cfg");
    }
}
