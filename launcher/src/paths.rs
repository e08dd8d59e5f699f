//! Where the launcher finds and puts things. Every root is a flag with KubeVirt's default, so a
//! test or a simulated node can root them in its own directory.

use std::path::PathBuf;

use api::configdisk::{ConfigKind, SERVICE_ACCOUNT_SOURCE_DIR};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirs {
    /// `--kubevirt-share-dir`: the command socket lives in `<share>/sockets/`.
    pub share: PathBuf,
    /// `--private-dir`: per-VM sockets and logs in `<private>/<uid>/`; PVC file systems in
    /// `<private>/vmi-disks/<volume>/disk.img`.
    pub private: PathBuf,
    /// `--ephemeral-disk-dir`: overlays, empty disks, cloud-init seeds, EFI variable stores.
    pub ephemeral: PathBuf,
    /// `--container-disk-dir`: `disk_<volume index>.img`, mounted there by virt-handler.
    pub container_disks: PathBuf,
    /// `--hotplug-disk-dir`: `<volume>.img` (file) or `<volume>` (block), placed by virt-handler.
    pub hotplug_disks: PathBuf,
    /// `--block-device-dir`: block PVCs appear as `<dir>/<volume>`.
    pub block_devices: PathBuf,
    /// `--nvram-dir`: persistent EFI variable stores, where the launcher pod mounts the
    /// backend-storage claim's `nvram` directory (KubeVirt's `/var/lib/libvirt/qemu/nvram`).
    pub nvram: PathBuf,
}

impl Dirs {
    pub fn command_socket(&self) -> PathBuf {
        self.share.join(launcher_api::SOCKET)
    }

    pub fn vm_dir(&self, uid: &str) -> PathBuf {
        self.private.join(uid)
    }

    pub fn qmp_socket(&self, uid: &str) -> PathBuf {
        self.vm_dir(uid).join("qmp.sock")
    }

    pub fn agent_socket(&self, uid: &str) -> PathBuf {
        self.vm_dir(uid).join("qga.sock")
    }

    /// The console socket clients (virt-handler, tests) connect to; served by the launcher.
    pub fn serial_socket(&self, uid: &str) -> PathBuf {
        self.vm_dir(uid).join("virt-serial0")
    }

    /// QEMU's side of the console, which only the launcher connects to.
    pub fn serial_backend_socket(&self, uid: &str) -> PathBuf {
        self.vm_dir(uid).join("serial0-qemu.sock")
    }

    pub fn serial_log(&self, uid: &str) -> PathBuf {
        self.vm_dir(uid).join("virt-serial0-log")
    }

    pub fn vnc_socket(&self, uid: &str) -> PathBuf {
        self.vm_dir(uid).join("virt-vnc")
    }

    pub fn qemu_log(&self, uid: &str) -> PathBuf {
        self.vm_dir(uid).join("qemu.log")
    }

    pub fn container_disk(&self, volume_index: usize) -> PathBuf {
        self.container_disks
            .join(format!("disk_{volume_index}.img"))
    }

    pub fn container_disk_overlay(&self, volume: &str) -> PathBuf {
        self.ephemeral
            .join("disk-data")
            .join(volume)
            .join("disk.qcow2")
    }

    pub fn empty_disk(&self, volume: &str) -> PathBuf {
        self.ephemeral
            .join("empty-disks")
            .join(format!("{volume}.qcow2"))
    }

    pub fn ephemeral_pvc_overlay(&self, volume: &str) -> PathBuf {
        self.ephemeral
            .join("disk-data")
            .join(volume)
            .join("disk.qcow2")
    }

    pub fn pvc_file(&self, volume: &str) -> PathBuf {
        self.private.join("vmi-disks").join(volume).join("disk.img")
    }

    pub fn pvc_block(&self, volume: &str) -> PathBuf {
        self.block_devices.join(volume)
    }

    pub fn hotplug_file(&self, volume: &str) -> PathBuf {
        self.hotplug_disks.join(format!("{volume}.img"))
    }

    pub fn hotplug_block(&self, volume: &str) -> PathBuf {
        self.hotplug_disks.join(volume)
    }

    pub fn cloud_init_seed(&self, namespace: &str, name: &str, config_drive: bool) -> PathBuf {
        self.ephemeral
            .join("cloud-init-data")
            .join(namespace)
            .join(name)
            .join(if config_drive {
                "configdrive.iso"
            } else {
                "noCloud.iso"
            })
    }

    /// Where the launcher pod has a config volume's files: `<private>/config-map/<volume>` and
    /// the like, or the pod's service account mount.
    pub fn config_source(&self, kind: ConfigKind, volume: &str) -> PathBuf {
        kind.source_dir().map_or_else(
            || PathBuf::from(SERVICE_ACCOUNT_SOURCE_DIR),
            |dir| self.private.join(dir).join(volume),
        )
    }

    /// The ISO image of a config volume: `<private>/config-map-disks/<volume>.iso` and the like.
    pub fn config_disk(&self, kind: ConfigKind, volume: &str) -> PathBuf {
        self.private.join(kind.disk_path(volume))
    }

    /// Where the launcher pod has the keys of a cloud-init volume's Secret references: the
    /// Secret kind's directory of that volume, as KubeVirt mounts them.
    pub fn cloud_init_secrets(&self, volume: &str) -> PathBuf {
        self.config_source(ConfigKind::Secret, volume)
    }

    pub fn efi_vars(&self, uid: &str) -> PathBuf {
        self.ephemeral.join("efi").join(format!("{uid}_VARS.fd"))
    }

    /// The variable store of `efi.persistent`: `<nvram>/<vmi name>_VARS.fd`, as libvirt names
    /// it under KubeVirt, so it outlives the pod on the VM's backend-storage claim.
    pub fn persistent_efi_vars(&self, name: &str) -> PathBuf {
        self.nvram.join(format!("{name}_VARS.fd"))
    }
}
