//! Volume hotplug as KubeVirt does it with `DeclarativeHotplugVolumes` (Beta, on by default;
//! the deprecated `HotplugVolumes` path through `status.volumeRequests` is not implemented):
//! a PVC or DataVolume marked `hotpluggable` reaches the launcher through an attachment pod
//! (`hp-volume-*`, label `kubevirt.io=hotplug-disk`) that mounts the claim on the VMI's node
//! (a block claim is its device); virt-handler mounts the claim's disk image, or makes the
//! block device, in the launcher's hotplug dir and the launcher plugs it into the running
//! guest. The volume's entry in `status.volumeStatus` walks KubeVirt's phases.
//!
//! Pure: the names, the phases and the VM-to-VMI sync of hotpluggable volumes
//! (`pkg/storage/hotplug/hotplug.go`).

use std::collections::{BTreeMap, BTreeSet};

use crate::VirtualMachineInstance;
use crate::status::VolumeStatus;
use crate::vm::VirtualMachine;
use crate::vmi::{Disk, Volume};

/// The `kubevirt.io` label of attachment pods and the name of their container.
pub const ATTACHMENT_POD_APP: &str = "hotplug-disk";
/// Attachment pods' `generateName`.
pub const ATTACHMENT_POD_PREFIX: &str = "hp-volume-";
/// The attachment pod's emptyDir (and the launcher's) holding hotplugged disks.
pub const HOTPLUG_DISKS_VOLUME: &str = "hotplug-disks";
/// Where the attachment pod mounts [`HOTPLUG_DISKS_VOLUME`]; its `container-disk` serves
/// `<this>/hp.sock`, by which virt-handler finds the pod's processes.
pub const ATTACHMENT_POD_DIR: &str = "/path";
/// The socket's base name under [`ATTACHMENT_POD_DIR`].
pub const ATTACHMENT_SOCKET: &str = "hp";
/// The VMI an attachment pod serves (its controller is the launcher pod).
pub const OWNER_VMI_NAME_ANNOTATION: &str = "kubevirt.io/owner-vmi-name";
pub const OWNER_VMI_UID_ANNOTATION: &str = "kubevirt.io/owner-vmi-uid";
/// The disk image inside a filesystem claim.
pub const DISK_IMAGE: &str = "disk.img";

/// KubeVirt's `VolumePhase`s of a hotplugged volume.
pub const PHASE_PENDING: &str = "Pending";
pub const PHASE_BOUND: &str = "Bound";
pub const PHASE_ATTACHED_TO_NODE: &str = "AttachedToNode";
pub const PHASE_MOUNTED_TO_POD: &str = "MountedToPod";
pub const PHASE_READY: &str = "Ready";
pub const PHASE_DETACHING: &str = "Detaching";
pub const PHASE_UNMOUNTED_FROM_POD: &str = "UnMountedFromPod";

/// The reasons of those phases (virt-controller's and virt-handler's).
pub const REASON_PVC_NOT_READY: &str = "PVCNotReady";
pub const REASON_PVC_NOT_FOUND: &str = "FailedPvcNotFound";
pub const REASON_SUCCESSFUL_CREATE: &str = "SuccessfulCreate";
pub const REASON_SUCCESSFUL_DELETE: &str = "SuccessfulDelete";
pub const REASON_MOUNTED_TO_POD: &str = "VolumeMountedToPod";
pub const REASON_UNMOUNTED_FROM_POD: &str = "VolumeUnMountedFromPod";

fn attachment_field<'a>(status: &'a VolumeStatus, field: &str) -> Option<&'a str> {
    status
        .hotplug_volume
        .as_ref()
        .and_then(|h| h.0.get(field))
        .and_then(serde_json::Value::as_str)
        .filter(|v| !v.is_empty())
}

/// The attachment pod of a hotplugged volume, once it is ready: virt-handler mounts from it.
pub fn attach_pod_uid(status: &VolumeStatus) -> Option<&str> {
    attachment_field(status, "attachPodUID")
}

/// The attachment pod serving a hotplugged volume.
pub fn attach_pod_name(status: &VolumeStatus) -> Option<&str> {
    attachment_field(status, "attachPodName")
}

/// KubeVirt's `IsDeclarativeHotplugVolume`: a PVC or DataVolume marked `hotpluggable`.
pub fn is_hotpluggable(v: &Volume) -> bool {
    v.persistent_volume_claim
        .as_ref()
        .is_some_and(|p| p.hotpluggable == Some(true))
        || v.data_volume
            .as_ref()
            .is_some_and(|d| d.hotpluggable == Some(true))
}

/// The claim a PVC or DataVolume volume uses (a DataVolume's PVC has its name).
pub fn claim_name(v: &Volume) -> Option<&str> {
    v.persistent_volume_claim
        .as_ref()
        .map(|p| p.claim_name.as_str())
        .or_else(|| v.data_volume.as_ref().map(|d| d.name.as_str()))
}

/// The volumes of the VMI that reach its launcher through an attachment pod: hotpluggable
/// ones, and any volume whose status says it was hotplugged (KubeVirt's `hotplugVolumes`
/// of the pod renderer, so a hotplugged volume is never rendered into a new launcher pod).
pub fn hotplug_volumes(vmi: &VirtualMachineInstance) -> BTreeSet<&str> {
    let hot_status: BTreeSet<&str> = vmi
        .status
        .iter()
        .flat_map(|s| &s.volume_status)
        .filter(|s| s.hotplug_volume.is_some())
        .map(|s| s.name.as_str())
        .collect();
    vmi.spec
        .volumes
        .iter()
        .filter(|v| {
            claim_name(v).is_some() && (is_hotpluggable(v) || hot_status.contains(v.name.as_str()))
        })
        .map(|v| v.name.as_str())
        .collect()
}

/// KubeVirt's `patchHotplugVolumes`: the VMI's volumes and disks once the VM's hotpluggable
/// volumes are carried over to it (new ones added, removed or changed ones dropped), or `None`
/// when they already match. Only for a running VMI; the caller checks.
pub fn declarative_sync(
    vm: &VirtualMachine,
    vmi: &VirtualMachineInstance,
) -> Option<(Vec<Volume>, Vec<Disk>)> {
    let empty = crate::VirtualMachineInstanceSpec::default();
    let vm_spec = vm.spec.template.spec.as_ref().unwrap_or(&empty);
    let vm_volumes: BTreeMap<&str, &Volume> = vm_spec
        .volumes
        .iter()
        .map(|v| (v.name.as_str(), v))
        .collect();
    let vm_disks: BTreeMap<&str, &Disk> = vm_spec
        .domain
        .devices
        .disks
        .iter()
        .map(|d| (d.name.as_str(), d))
        .collect();

    let mut volumes: Vec<Volume> = vmi
        .spec
        .volumes
        .iter()
        .filter(|v| {
            !is_hotpluggable(v)
                || vm_volumes
                    .get(v.name.as_str())
                    .is_some_and(|vm_v| !is_hotpluggable(vm_v) || *vm_v == *v)
        })
        .cloned()
        .collect();
    let in_vmi: BTreeSet<&str> = vmi.spec.volumes.iter().map(|v| v.name.as_str()).collect();
    // A volume still listed in the status is being unplugged: it comes back only once gone.
    let with_status: BTreeSet<&str> = vmi
        .status
        .iter()
        .flat_map(|s| &s.volume_status)
        .map(|s| s.name.as_str())
        .collect();
    volumes.extend(
        vm_spec
            .volumes
            .iter()
            .filter(|v| {
                is_hotpluggable(v)
                    && !in_vmi.contains(v.name.as_str())
                    && !with_status.contains(v.name.as_str())
            })
            .cloned(),
    );
    let kept: BTreeSet<&str> = volumes.iter().map(|v| v.name.as_str()).collect();

    let mut disks: Vec<Disk> = vmi
        .spec
        .domain
        .devices
        .disks
        .iter()
        .filter(|d| {
            if kept.contains(d.name.as_str()) {
                return true;
            }
            let Some(vm_disk) = vm_disks.get(d.name.as_str()) else {
                return false;
            };
            // A CD-ROM keeps its tray while its volume changes.
            !vm_volumes.contains_key(d.name.as_str())
                || (vm_disk.cdrom.is_some() && d.cdrom.is_some())
        })
        .cloned()
        .collect();
    let vmi_disks: BTreeSet<&str> = vmi
        .spec
        .domain
        .devices
        .disks
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    let new_volumes: BTreeMap<&str, &Volume> =
        volumes.iter().map(|v| (v.name.as_str(), v)).collect();
    disks.extend(
        vm_spec
            .domain
            .devices
            .disks
            .iter()
            .filter(|d| {
                new_volumes
                    .get(d.name.as_str())
                    .is_some_and(|v| is_hotpluggable(v))
                    && !vmi_disks.contains(d.name.as_str())
            })
            .cloned(),
    );
    (volumes != vmi.spec.volumes || disks != vmi.spec.domain.devices.disks)
        .then_some((volumes, disks))
}

#[cfg(test)]
mod tests {
    use pretty_assertions::assert_eq;
    use serde_json::{Value, json};

    use super::*;

    const ROOT_DISK: &str = r#"{"name": "root", "disk": {"bus": "virtio"}}"#;
    const ROOT_VOLUME: &str = r#"{"name": "root", "containerDisk": {"image": "guest"}}"#;

    fn disk(name: &str) -> Value {
        json!({"name": name, "disk": {"bus": "scsi"}})
    }

    fn hot(name: &str) -> Value {
        json!({"name": name, "persistentVolumeClaim": {"claimName": name, "hotpluggable": true}})
    }

    fn spec(disks: &[Value], volumes: &[Value]) -> Value {
        let root_disk: Value = serde_json::from_str(ROOT_DISK).unwrap();
        let root_volume: Value = serde_json::from_str(ROOT_VOLUME).unwrap();
        let disks: Vec<&Value> = [&root_disk].into_iter().chain(disks).collect();
        let volumes: Vec<&Value> = [&root_volume].into_iter().chain(volumes).collect();
        json!({"domain": {"devices": {"disks": disks}}, "volumes": volumes})
    }

    fn vm(disks: &[Value], volumes: &[Value]) -> VirtualMachine {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "vm", "namespace": "default"},
            "spec": {"runStrategy": "Always", "template": {"spec": spec(disks, volumes)}},
        }))
        .unwrap()
    }

    fn vmi(disks: &[Value], volumes: &[Value], status_names: &[&str]) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm", "namespace": "default"},
            "spec": spec(disks, volumes),
            "status": {
                "phase": "Running",
                "volumeStatus": status_names.iter()
                    .map(|n| json!({"name": n, "target": "", "hotplugVolume": {}}))
                    .collect::<Vec<_>>(),
            },
        }))
        .unwrap()
    }

    fn names<T>(items: &[T], name: impl Fn(&T) -> &str) -> Vec<&str> {
        items.iter().map(name).collect()
    }

    #[test]
    fn a_volume_added_to_the_vm_is_added_to_the_vmi() {
        let vm = vm(&[disk("data")], &[hot("data")]);
        let (volumes, disks) = declarative_sync(&vm, &vmi(&[], &[], &[])).expect("a change");
        assert_eq!(names(&volumes, |v| &v.name), ["root", "data"]);
        assert_eq!(names(&disks, |d| &d.name), ["root", "data"]);
    }

    #[test]
    fn a_volume_removed_from_the_vm_is_removed_from_the_vmi() {
        let vm = vm(&[], &[]);
        let (volumes, disks) =
            declarative_sync(&vm, &vmi(&[disk("data")], &[hot("data")], &["data"]))
                .expect("a change");
        assert_eq!(names(&volumes, |v| &v.name), ["root"]);
        assert_eq!(names(&disks, |d| &d.name), ["root"]);
    }

    #[test]
    fn matching_specs_need_nothing_and_unplugging_volumes_wait() {
        let vm_with = vm(&[disk("data")], &[hot("data")]);
        assert_eq!(
            declarative_sync(&vm_with, &vmi(&[disk("data")], &[hot("data")], &["data"])),
            None
        );
        // Removed from the VMI, still in its status: not re-added until the entry is gone.
        assert_eq!(declarative_sync(&vm_with, &vmi(&[], &[], &["data"])), None);
    }

    #[test]
    fn volumes_that_are_not_hotpluggable_are_never_touched() {
        let cold = json!({"name": "cold", "persistentVolumeClaim": {"claimName": "cold"}});
        // In the VM, not the VMI: a restart brings it, not a hotplug.
        let vm = vm(&[disk("cold")], std::slice::from_ref(&cold));
        assert_eq!(declarative_sync(&vm, &vmi(&[], &[], &[])), None);
        let vm = self::vm(&[], &[]);
        assert_eq!(
            declarative_sync(&vm, &vmi(&[disk("cold")], &[cold], &[])),
            None
        );
    }

    #[test]
    fn hotplug_volumes_are_the_hotpluggable_claims_and_those_hotplugged() {
        let cold = json!({"name": "cold", "persistentVolumeClaim": {"claimName": "cold"}});
        let v = vmi(&[], &[hot("data"), cold.clone()], &[]);
        assert_eq!(hotplug_volumes(&v), BTreeSet::from(["data"]));
        let v = vmi(&[], &[hot("data"), cold], &["cold"]);
        assert_eq!(hotplug_volumes(&v), BTreeSet::from(["cold", "data"]));
    }
}
