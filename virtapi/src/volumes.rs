//! `addvolume` and `removevolume` of VMs and VMIs, as KubeVirt's `pkg/virt-api/rest/volumes.go`
//! decides them with `DeclarativeHotplugVolumes`: the request's checks, the check against the
//! volumes already there (`verifyVolumeOption`) and the JSON patch of the VM's template or the
//! VMI's spec (`generateVolumeRequestPatch` over `ApplyVolumeRequestOnVMISpec`). Pure; the
//! handlers in `subresource` read the object and send the patch.
//!
//! The patch is computed on the object's JSON as read, not on a re-serialized copy: its `test`
//! ops then compare exactly what the API server stores, so only a concurrent change fails them
//! (422, which virtctl retries), and the lists written back keep every field of the other
//! entries.
//!
//! The deprecated `HotplugVolumes` gate's VM path (a request queued in the VM's
//! `status.volumeRequests` for virt-controller) is not implemented: the VM is always patched
//! declaratively. The gate still serves the subresources, and lets a VM's VMI be patched directly,
//! as in KubeVirt.

use api::VirtualMachineInstance;
use api::subresources::{AddVolumeOptions, RemoveVolumeOptions};
use api::vmi::Volume;
use serde_json::{Value, json};

use crate::status::Refusal;

/// KubeVirt's answer when neither hotplug gate is on.
pub const HOTPLUG_NOT_ENABLED: &str =
    "Enable DeclarativeHotplugVolumes or HotplugVolumes feature gate to use this API.";
/// KubeVirt's conflict for a VMI that is not running.
pub const VMI_NOT_RUNNING: &str = "VMI is not running";

/// A checked request.
#[derive(Debug, Clone, PartialEq)]
pub enum VolumeRequest {
    Add(Box<AddVolumeOptions>),
    Remove(RemoveVolumeOptions),
}

impl VolumeRequest {
    /// KubeVirt's checks of an `addvolume` body (400 naming what is missing); the disk takes the
    /// request's name.
    pub fn add(mut o: AddVolumeOptions) -> Result<Self, Refusal> {
        if o.name.is_empty() {
            return Err(Refusal::bad_request(
                "AddVolumeOptions requires name to be set",
            ));
        }
        let Some(disk) = o.disk.as_mut() else {
            return Err(Refusal::bad_request(
                "AddVolumeOptions requires disk to not be nil",
            ));
        };
        disk.name.clone_from(&o.name);
        if o.volume_source.is_none() {
            return Err(Refusal::bad_request(
                "AddVolumeOptions requires VolumeSource to not be nil",
            ));
        }
        Ok(Self::Add(Box::new(o)))
    }

    /// KubeVirt's check of a `removevolume` body.
    pub fn remove(o: RemoveVolumeOptions) -> Result<Self, Refusal> {
        if o.name.is_empty() {
            return Err(Refusal::bad_request(
                "RemoveVolumeOptions requires name to be set",
            ));
        }
        Ok(Self::Remove(o))
    }

    pub fn dry_run(&self) -> &[String] {
        match self {
            Self::Add(o) => &o.dry_run,
            Self::Remove(o) => &o.dry_run,
        }
    }
}

/// KubeVirt's `volumeSourceExists`: the volume is the DataVolume or claim `name`.
fn uses_claim(v: &Volume, name: &str) -> bool {
    v.data_volume.as_ref().is_some_and(|d| d.name == name)
        || v.persistent_volume_claim
            .as_ref()
            .is_some_and(|p| p.claim_name == name)
}

/// KubeVirt's `verifyVolumeOption` against the volumes there: a new volume's name and claim must
/// be unused; a removed volume (named by itself or by its claim) must exist and be hotpluggable.
/// The error is the conflict's reason.
pub fn verify(volumes: &[Volume], request: &VolumeRequest) -> Result<(), String> {
    match request {
        VolumeRequest::Add(o) => {
            let source = o.volume_source.as_ref().map_or("", |s| s.name());
            for v in volumes {
                if v.name == o.name {
                    return Err(format!(
                        "Unable to add volume [{}] because volume with that name already exists",
                        o.name
                    ));
                }
                if uses_claim(v, source) {
                    return Err(format!(
                        "Unable to add volume source [{source}] because it already exists"
                    ));
                }
            }
            Ok(())
        }
        VolumeRequest::Remove(o) => {
            let found = volumes
                .iter()
                .find(|v| v.name == o.name || uses_claim(v, &o.name));
            match found {
                None => Err(format!(
                    "Unable to remove volume [{}] because it does not exist",
                    o.name
                )),
                Some(v) if !api::hotplug::is_hotpluggable(v) => Err(format!(
                    "Unable to remove volume [{}] because it is not hotpluggable",
                    v.name
                )),
                Some(_) => Ok(()),
            }
        }
    }
}

/// The JSON patch of a VMI spec (`spec`, as read) at `prefix` (`/spec/template` for a VM's
/// template, empty for a VMI): tests of its volumes and disks as read, then the lists with the
/// request applied (KubeVirt's `ApplyVolumeRequestOnVMISpec`: the volume and its disk appended;
/// or the volume and the disk of that name dropped, so a removal that named a claim rather than
/// its volume changes nothing, as in KubeVirt). A list not there is added.
pub fn patch(
    prefix: &str,
    spec: &Value,
    request: &VolumeRequest,
) -> Result<Value, serde_json::Error> {
    let volume_path = format!("{prefix}/spec/volumes");
    let disk_path = format!("{prefix}/spec/domain/devices/disks");
    let volumes = spec.get("volumes");
    let disks = spec.pointer("/domain/devices/disks");
    let list = |v: Option<&Value>| v.and_then(Value::as_array).cloned().unwrap_or_default();
    let (mut new_volumes, mut new_disks) = (list(volumes), list(disks));
    match request {
        VolumeRequest::Add(o) => {
            new_volumes.push(serde_json::to_value(o.volume())?);
            if let Some(disk) = &o.disk {
                new_disks.push(serde_json::to_value(disk)?);
            }
        }
        VolumeRequest::Remove(o) => {
            let other = |e: &Value| e.get("name").and_then(Value::as_str) != Some(o.name.as_str());
            new_volumes.retain(other);
            new_disks.retain(other);
        }
    }
    let write = |current: Option<&Value>| {
        if current
            .and_then(Value::as_array)
            .is_some_and(|l| !l.is_empty())
        {
            "replace"
        } else {
            "add"
        }
    };
    Ok(json!([
        {"op": "test", "path": volume_path, "value": volumes.cloned().unwrap_or(Value::Null)},
        {"op": "test", "path": disk_path, "value": disks.cloned().unwrap_or(Value::Null)},
        {"op": write(volumes), "path": volume_path, "value": new_volumes},
        {"op": write(disks), "path": disk_path, "value": new_disks},
    ]))
}

/// KubeVirt's `ownedByVirtualMachine`: the VMI's controller is a `kubevirt.io/v1` VirtualMachine.
pub fn owned_by_vm(vmi: &VirtualMachineInstance) -> bool {
    vmi.metadata.owner_references.iter().flatten().any(|r| {
        r.controller == Some(true)
            && r.kind == "VirtualMachine"
            && r.api_version == "kubevirt.io/v1"
    })
}

#[cfg(test)]
mod tests {
    use api::subresources::HotplugVolumeSource;
    use api::vmi::{DataVolumeSource, Disk, PersistentVolumeClaimSource};
    use pretty_assertions::assert_eq;

    use super::*;

    fn pvc(name: &str) -> HotplugVolumeSource {
        HotplugVolumeSource {
            persistent_volume_claim: Some(PersistentVolumeClaimSource {
                claim_name: name.into(),
                ..PersistentVolumeClaimSource::default()
            }),
            ..HotplugVolumeSource::default()
        }
    }

    fn add(name: &str, source: HotplugVolumeSource) -> VolumeRequest {
        VolumeRequest::add(AddVolumeOptions {
            name: name.into(),
            disk: Some(
                serde_json::from_value(json!({"name": "ignored", "disk": {"bus": "scsi"}}))
                    .unwrap(),
            ),
            volume_source: Some(source),
            dry_run: vec![],
        })
        .unwrap()
    }

    fn remove(name: &str) -> VolumeRequest {
        VolumeRequest::remove(RemoveVolumeOptions {
            name: name.into(),
            dry_run: vec![],
        })
        .unwrap()
    }

    fn volumes(v: &Value) -> Vec<Volume> {
        serde_json::from_value(v.clone()).unwrap()
    }

    #[test]
    fn bodies_are_checked_as_kubevirt_checks_them() {
        let full = AddVolumeOptions {
            name: "data".into(),
            disk: Some(Disk::default()),
            volume_source: Some(pvc("claim")),
            dry_run: vec![],
        };
        let VolumeRequest::Add(o) = VolumeRequest::add(full.clone()).unwrap() else {
            panic!("not an add");
        };
        assert_eq!(
            o.disk.unwrap().name,
            "data",
            "the disk takes the request's name"
        );
        let cases = [
            (
                AddVolumeOptions {
                    name: String::new(),
                    ..full.clone()
                },
                "AddVolumeOptions requires name to be set",
            ),
            (
                AddVolumeOptions {
                    disk: None,
                    ..full.clone()
                },
                "AddVolumeOptions requires disk to not be nil",
            ),
            (
                AddVolumeOptions {
                    volume_source: None,
                    ..full
                },
                "AddVolumeOptions requires VolumeSource to not be nil",
            ),
        ];
        for (o, want) in cases {
            let e = VolumeRequest::add(o).unwrap_err();
            assert_eq!((e.code.as_u16(), e.message.as_str()), (400, want));
        }
        let e = VolumeRequest::remove(RemoveVolumeOptions::default()).unwrap_err();
        assert_eq!(
            (e.code.as_u16(), e.message.as_str()),
            (400, "RemoveVolumeOptions requires name to be set")
        );
    }

    #[test]
    fn requests_are_verified_against_the_volumes_there() {
        let there = volumes(&json!([
            {"name": "root", "containerDisk": {"image": "guest"}},
            {"name": "cold", "persistentVolumeClaim": {"claimName": "cold-claim"}},
            {"name": "hot", "persistentVolumeClaim": {"claimName": "hot-claim", "hotpluggable": true}},
            {"name": "hotdv", "dataVolume": {"name": "dv1", "hotpluggable": true}},
        ]));
        let dv = HotplugVolumeSource {
            data_volume: Some(DataVolumeSource {
                name: "dv1".into(),
                hotpluggable: None,
            }),
            ..HotplugVolumeSource::default()
        };
        let cases = [
            (add("new", pvc("new-claim")), Ok(())),
            (
                add("cold", pvc("other")),
                Err("Unable to add volume [cold] because volume with that name already exists"),
            ),
            (
                add("new", pvc("cold-claim")),
                Err("Unable to add volume source [cold-claim] because it already exists"),
            ),
            (
                add("new", dv),
                Err("Unable to add volume source [dv1] because it already exists"),
            ),
            (remove("hot"), Ok(())),
            (remove("hot-claim"), Ok(())),
            (remove("hotdv"), Ok(())),
            (
                remove("cold"),
                Err("Unable to remove volume [cold] because it is not hotpluggable"),
            ),
            (
                remove("cold-claim"),
                Err("Unable to remove volume [cold] because it is not hotpluggable"),
            ),
            (
                remove("root"),
                Err("Unable to remove volume [root] because it is not hotpluggable"),
            ),
            (
                remove("gone"),
                Err("Unable to remove volume [gone] because it does not exist"),
            ),
        ];
        for (request, want) in cases {
            assert_eq!(
                verify(&there, &request),
                want.map_err(str::to_owned),
                "{request:?}"
            );
        }
        assert_eq!(
            verify(&[], &remove("x")),
            Err("Unable to remove volume [x] because it does not exist".to_owned())
        );
    }

    #[test]
    fn add_tests_what_was_read_and_appends_the_volume_and_disk() {
        // An entry's fields unknown to the typed API are kept as read.
        let spec = json!({
            "domain": {"devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}, "future": 1}]}},
            "volumes": [{"name": "root", "containerDisk": {"image": "guest"}}],
        });
        let p = patch("/spec/template", &spec, &add("data", pvc("claim"))).unwrap();
        assert_eq!(
            p,
            json!([
                {"op": "test", "path": "/spec/template/spec/volumes", "value": spec["volumes"]},
                {"op": "test", "path": "/spec/template/spec/domain/devices/disks", "value": spec["domain"]["devices"]["disks"]},
                {"op": "replace", "path": "/spec/template/spec/volumes", "value": [
                    {"name": "root", "containerDisk": {"image": "guest"}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "claim", "hotpluggable": true}},
                ]},
                {"op": "replace", "path": "/spec/template/spec/domain/devices/disks", "value": [
                    {"name": "root", "disk": {"bus": "virtio"}, "future": 1},
                    {"name": "data", "disk": {"bus": "scsi"}},
                ]},
            ])
        );
        // The patch applies to the object it was made from.
        let mut vmi = json!({"spec": spec});
        let p: json_patch::Patch =
            serde_json::from_value(patch("", &vmi["spec"], &add("data", pvc("claim"))).unwrap())
                .unwrap();
        json_patch::patch(&mut vmi, &p).unwrap();
        assert_eq!(vmi["spec"]["volumes"][1]["name"], "data");
    }

    #[test]
    fn lists_not_there_are_added_after_a_test_of_null() {
        let spec = json!({"domain": {"devices": {}}});
        let p = patch("", &spec, &add("data", pvc("claim"))).unwrap();
        assert_eq!(
            p[0],
            json!({"op": "test", "path": "/spec/volumes", "value": null})
        );
        assert_eq!(
            p[1],
            json!({"op": "test", "path": "/spec/domain/devices/disks", "value": null})
        );
        assert_eq!(p[2]["op"], "add");
        assert_eq!(p[3]["op"], "add");
        assert_eq!(
            p[3]["value"],
            json!([{"name": "data", "disk": {"bus": "scsi"}}])
        );
    }

    #[test]
    fn remove_drops_the_volume_and_its_disk() {
        let spec = json!({
            "domain": {"devices": {"disks": [{"name": "root"}, {"name": "hot", "disk": {"bus": "scsi"}}]}},
            "volumes": [
                {"name": "root", "containerDisk": {"image": "guest"}},
                {"name": "hot", "persistentVolumeClaim": {"claimName": "c", "hotpluggable": true}},
            ],
        });
        let p = patch("", &spec, &remove("hot")).unwrap();
        assert_eq!(
            (&p[2]["op"], &p[2]["value"]),
            (
                &json!("replace"),
                &json!([{"name": "root", "containerDisk": {"image": "guest"}}])
            )
        );
        assert_eq!(p[3]["value"], json!([{"name": "root"}]));
    }

    #[test]
    fn a_vmi_is_a_vms_when_a_v1_vm_controls_it() {
        let vmi = |owner: Value| -> VirtualMachineInstance {
            serde_json::from_value(json!({
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "metadata": {"name": "demo", "ownerReferences": [owner]},
                "spec": {"domain": {"devices": {}}},
            }))
            .unwrap()
        };
        let owner = |api_version: &str, kind: &str, controller: bool| json!({"apiVersion": api_version, "kind": kind, "name": "demo", "uid": "u", "controller": controller});
        assert!(owned_by_vm(&vmi(owner(
            "kubevirt.io/v1",
            "VirtualMachine",
            true
        ))));
        assert!(!owned_by_vm(&vmi(owner(
            "kubevirt.io/v1",
            "VirtualMachine",
            false
        ))));
        assert!(!owned_by_vm(&vmi(owner(
            "kubevirt.io/v1",
            "VirtualMachineInstanceReplicaSet",
            true
        ))));
        assert!(!owned_by_vm(&vmi(owner(
            "kubevirt.io/v1alpha3",
            "VirtualMachine",
            true
        ))));
    }
}
