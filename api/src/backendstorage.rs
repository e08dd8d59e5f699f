//! KubeVirt's backend storage (`pkg/storage/backend-storage`): one small claim per VM that
//! holds the state a VM keeps across restarts outside its disks. Here that is the persistent
//! EFI variable store (`efi.persistent`); KubeVirt also keeps a persistent TPM's state on it,
//! and the TPM is refused by validation.

use crate::VirtualMachineInstance;
use crate::status::{VirtualMachineInstanceStatus, VolumeStatus};

/// The claim's label (`persistent-state-for: <vmi name>`) and its name's prefix
/// (`persistent-state-for-<vmi name>-<random>`).
pub const PVC_PREFIX: &str = "persistent-state-for";
/// KubeVirt's `PVCSize`.
pub const PVC_SIZE: &str = "10Mi";
/// The claim's entry in the VMI's `status.volumeStatus` (KubeVirt's `VolumeName`).
pub const VOLUME_NAME: &str = "persistent-state-for-this-vm";
/// The launcher pod's volume of the claim.
pub const POD_VOLUME: &str = "vm-state";
/// Where the launcher pod mounts the claim's `nvram` directory: libvirt's, for a root
/// launcher (KubeVirt's `PathForNVram`).
pub const NVRAM_DIR: &str = "/var/lib/libvirt/qemu/nvram";
/// The claim's `nvram` directory.
pub const NVRAM_SUBPATH: &str = "nvram";
/// The field that asks for backend storage.
pub const PERSISTENT_EFI_FIELD: &str = "spec.domain.firmware.bootloader.efi.persistent";

/// KubeVirt's `HasPersistentEFI`.
pub fn has_persistent_efi(vmi: &VirtualMachineInstance) -> bool {
    vmi.spec
        .domain
        .firmware
        .as_ref()
        .and_then(|f| f.bootloader.as_ref())
        .and_then(|b| b.efi.as_ref())
        .and_then(|e| e.persistent)
        == Some(true)
}

/// KubeVirt's `IsBackendStorageNeeded`: a persistent TPM (refused here) or persistent EFI.
pub fn needed(vmi: &VirtualMachineInstance) -> bool {
    has_persistent_efi(vmi)
}

/// The claim's entry in `status.volumeStatus` (KubeVirt's `IsBackendStorageVolume`, which
/// matches the prefix for entries older releases named differently).
pub fn volume_status(status: &VirtualMachineInstanceStatus) -> Option<&VolumeStatus> {
    status
        .volume_status
        .iter()
        .find(|v| v.name.starts_with(PVC_PREFIX))
}

/// KubeVirt's `CurrentPVCName`: the claim the VMI's status names.
pub fn current_claim(vmi: &VirtualMachineInstance) -> Option<&str> {
    volume_status(vmi.status.as_ref()?)?
        .persistent_volume_claim_info
        .as_ref()?
        .0
        .get("claimName")?
        .as_str()
}

/// Whether the claim the status names is `ReadWriteMany` (`None`: no claim named yet).
pub fn claim_shared(vmi: &VirtualMachineInstance) -> Option<bool> {
    volume_status(vmi.status.as_ref()?).and_then(read_write_many)
}

/// Whether the claim `name` is `ReadWriteMany`, from the facts virt-controller puts in a VMI's
/// `volumeStatus` (`None`: not there).
pub fn named_claim_shared(volumes: &[VolumeStatus], name: &str) -> Option<bool> {
    volumes
        .iter()
        .find(|v| {
            v.persistent_volume_claim_info
                .as_ref()
                .and_then(|i| i.0.get("claimName"))
                .and_then(serde_json::Value::as_str)
                == Some(name)
        })
        .and_then(read_write_many)
}

fn read_write_many(volume: &VolumeStatus) -> Option<bool> {
    let info = &volume.persistent_volume_claim_info.as_ref()?.0;
    Some(
        info.get("accessModes")
            .and_then(serde_json::Value::as_array)
            .is_some_and(|m| m.iter().any(|m| m == "ReadWriteMany")),
    )
}

/// KubeVirt's `UpdateVolumeStatus`: the entry names the claim and its access modes. The list
/// stays sorted by name, as virt-controller's hotplug and virt-handler write it, so neither
/// rewrites the other's order.
pub fn set_volume_status(
    status: &mut VirtualMachineInstanceStatus,
    claim: &str,
    access_modes: &[String],
) {
    let info = crate::common::Preserved(serde_json::json!({
        "claimName": claim,
        "accessModes": access_modes,
    }));
    if let Some(v) = status
        .volume_status
        .iter_mut()
        .find(|v| v.name.starts_with(PVC_PREFIX))
    {
        v.name = VOLUME_NAME.into();
        v.persistent_volume_claim_info = Some(info);
        return;
    }
    status.volume_status.push(VolumeStatus {
        name: VOLUME_NAME.into(),
        persistent_volume_claim_info: Some(info),
        ..VolumeStatus::default()
    });
    status.volume_status.sort_by(|a, b| a.name.cmp(&b.name));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_entry_names_the_claim_and_whether_it_is_shared() {
        let mut vmi: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "vm1"},
            "spec": {"domain": {"firmware": {"bootloader": {"efi": {"persistent": true}}}}},
        }))
        .unwrap();
        assert!(needed(&vmi));
        assert_eq!((current_claim(&vmi), claim_shared(&vmi)), (None, None));
        let mut status = VirtualMachineInstanceStatus::default();
        status.volume_status.push(VolumeStatus {
            name: "root".into(),
            ..VolumeStatus::default()
        });
        set_volume_status(
            &mut status,
            "persistent-state-for-vm1-x",
            &["ReadWriteOnce".into()],
        );
        set_volume_status(
            &mut status,
            "persistent-state-for-vm1-y",
            &["ReadWriteMany".into()],
        );
        vmi.status = Some(status);
        let status = vmi.status.as_ref().unwrap();
        let names: Vec<&str> = status
            .volume_status
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(names, [VOLUME_NAME, "root"], "one entry, sorted by name");
        assert_eq!(current_claim(&vmi), Some("persistent-state-for-vm1-y"));
        assert_eq!(claim_shared(&vmi), Some(true));
        vmi.spec.domain.firmware = None;
        assert!(!needed(&vmi));
    }
}
