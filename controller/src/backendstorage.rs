//! The backend-storage claim of a VMI (KubeVirt's `pkg/storage/backend-storage`): found or
//! made before the launcher pod, which mounts it. Pure decisions; `run::vmi` does the I/O.

use std::collections::BTreeMap;

use api::backendstorage::{PVC_PREFIX, PVC_SIZE};
use api::{VirtualMachineInstance, labels};
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

/// KubeVirt's `FailedBackendStorageCreate`: no class to make the claim with, or its creation
/// failed.
pub const FAILED_CREATE: &str = "FailedBackendStorageCreate";
/// KubeVirt's `FailedBackendStorageProbe`: the claim is lost or its class is gone.
pub const FAILED_PROBE: &str = "FailedBackendStorageProbe";
/// KubeVirt's `BackendStorageNotReady`: the claim waits to be bound.
pub const NOT_READY: &str = "BackendStorageNotReady";

/// The class KubeVirt marks as the default for VMs, which wins over the cluster's default.
const KUBEVIRT_DEFAULT_CLASS: &str = "storageclass.kubevirt.io/is-default-virt-class";
const DEFAULT_CLASS: &str = "storageclass.kubernetes.io/is-default-class";
/// Lets CDI's PVC mutating webhook apply the class's StorageProfile (a minimum size, say).
const APPLY_STORAGE_PROFILE: &str = "cdi.kubevirt.io/applyStorageProfile";

/// KubeVirt's `PVCForVMI`: the live claim labelled for the VMI, else one named as releases
/// before the label named theirs (`persistent-state-for-<vmi name>`).
pub fn claim_for<'a>(
    vmi: &VirtualMachineInstance,
    claims: impl IntoIterator<Item = &'a PersistentVolumeClaim>,
) -> Option<&'a PersistentVolumeClaim> {
    let name = vmi.metadata.name.as_deref()?;
    let ns = vmi.metadata.namespace.as_deref();
    let legacy = format!("{PVC_PREFIX}-{name}");
    let mut found = None;
    for c in claims {
        if c.metadata.namespace.as_deref() != ns || c.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let label = c.metadata.labels.as_ref().and_then(|l| l.get(PVC_PREFIX));
        if label.map(String::as_str) == Some(name) {
            return Some(c);
        }
        if c.metadata.name.as_deref() == Some(legacy.as_str()) {
            found = Some(c);
        }
    }
    found
}

/// KubeVirt's `getStorageClass`: `vmStateStorageClass`, else the class marked KubeVirt's
/// default, else the cluster's default.
pub fn storage_class(configured: Option<&str>, classes: &[StorageClass]) -> Result<String, String> {
    if let Some(c) = configured {
        return Ok(c.to_owned());
    }
    let marked = |key: &str| {
        classes.iter().find_map(|c| {
            let a = c.metadata.annotations.as_ref()?;
            (a.get(key).map(String::as_str) == Some("true")).then(|| c.metadata.name.clone())?
        })
    };
    marked(KUBEVIRT_DEFAULT_CLASS)
        .or_else(|| marked(DEFAULT_CLASS))
        .ok_or_else(|| "no default storage class found".to_owned())
}

/// KubeVirt's `createPVC` without a StorageProfile to ask (no CDI here): `ReadWriteMany` on
/// the class the KubeVirt CR names, `ReadWriteOnce` on the cluster's default; `Filesystem`,
/// 10Mi, named `persistent-state-for-<vmi name>-<random>` and labelled with the VMI's name.
/// Its owners are the VMI's (its VM, so the claim outlives the VMI and goes with the VM); a VMI
/// of no VM owns its claim itself, so nothing is left behind.
pub fn new_claim(
    vmi: &VirtualMachineInstance,
    class: String,
    configured: bool,
) -> PersistentVolumeClaim {
    let name = vmi.metadata.name.clone().unwrap_or_default();
    claim_labelled(vmi, class, configured, (PVC_PREFIX, name))
}

/// KubeVirt's `CreatePVCForMigrationTarget` when the VMI's claim is not `ReadWriteMany`: a
/// claim made as [`new_claim`] but labelled with the migration's name instead of the VMI's,
/// so that it is not the VMI's claim until the migration hands it over ([`handed_over`]).
pub fn new_target_claim(
    vmi: &VirtualMachineInstance,
    class: String,
    configured: bool,
    migration: &str,
) -> PersistentVolumeClaim {
    claim_labelled(
        vmi,
        class,
        configured,
        (labels::MIGRATION_NAME, migration.to_owned()),
    )
}

/// KubeVirt's `pvcForMigrationTargetFromStore`: the claim labelled with the migration's name.
pub fn target_claim_for<'a>(
    namespace: Option<&str>,
    migration: &str,
    claims: impl IntoIterator<Item = &'a PersistentVolumeClaim>,
) -> Option<&'a PersistentVolumeClaim> {
    claims.into_iter().find(|c| {
        c.metadata.namespace.as_deref() == namespace
            && c.metadata.deletion_timestamp.is_none()
            && c.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(labels::MIGRATION_NAME))
                .is_some_and(|m| m == migration)
    })
}

/// The merge patch of KubeVirt's `MigrationHandoff` on the target claim: labelled as the VMI's
/// claim, no longer the migration's.
pub fn handed_over(vmi_name: &str) -> serde_json::Value {
    serde_json::json!({"metadata": {"labels": {
        PVC_PREFIX: vmi_name,
        labels::MIGRATION_NAME: null,
    }}})
}

fn claim_labelled(
    vmi: &VirtualMachineInstance,
    class: String,
    configured: bool,
    (key, value): (&str, String),
) -> PersistentVolumeClaim {
    let name = vmi.metadata.name.clone().unwrap_or_default();
    let owners = match vmi.metadata.owner_references.as_deref() {
        Some(o) if !o.is_empty() => o.to_vec(),
        _ => vec![OwnerReference {
            api_version: "kubevirt.io/v1".into(),
            kind: "VirtualMachineInstance".into(),
            name: name.clone(),
            uid: vmi.metadata.uid.clone().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }],
    };
    let access = if configured {
        "ReadWriteMany"
    } else {
        "ReadWriteOnce"
    };
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            generate_name: Some(format!("{PVC_PREFIX}-{name}-")),
            namespace: vmi.metadata.namespace.clone(),
            owner_references: Some(owners),
            labels: Some(BTreeMap::from([
                (key.to_owned(), value),
                (APPLY_STORAGE_PROFILE.to_owned(), "true".to_owned()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![access.to_owned()]),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_owned(),
                    Quantity(PVC_SIZE.to_owned()),
                )])),
                ..VolumeResourceRequirements::default()
            }),
            storage_class_name: Some(class),
            volume_mode: Some("Filesystem".to_owned()),
            ..PersistentVolumeClaimSpec::default()
        }),
        status: None,
    }
}

/// KubeVirt's `IsPVCReady`: bound, or pending on a class that binds when the pod is scheduled.
/// `Err` with the reason and message of the `Synchronized` condition otherwise.
pub fn ready(
    claim: &PersistentVolumeClaim,
    classes: &[StorageClass],
) -> Result<(), (&'static str, String)> {
    match claim.status.as_ref().and_then(|s| s.phase.as_deref()) {
        Some("Bound") => return Ok(()),
        Some("Lost") => return Err((FAILED_PROBE, "backend storage PVC lost".into())),
        _ => {}
    }
    let Some(class) = claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.as_deref())
    else {
        return Err((FAILED_PROBE, "no storage class name".into()));
    };
    let Some(sc) = classes
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some(class))
    else {
        return Err((FAILED_PROBE, format!("storage class {class} not found")));
    };
    if sc.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer") {
        Ok(())
    } else {
        Err((NOT_READY, "PVC pending".into()))
    }
}

/// The claim's access modes, for the VMI's `volumeStatus` entry.
pub fn access_modes(claim: &PersistentVolumeClaim) -> Vec<String> {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.access_modes.clone())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::json;

    fn class(name: &str, annotations: &serde_json::Value, binding: &str) -> StorageClass {
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": annotations},
            "provisioner": "p",
            "volumeBindingMode": binding,
        }))
        .unwrap()
    }

    fn vmi(owners: &serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "metadata": {"name": "vm1", "namespace": "ns", "uid": "u1", "ownerReferences": owners},
            "spec": {"domain": {"firmware": {"bootloader": {"efi": {"persistent": true}}}}},
        }))
        .unwrap()
    }

    #[test]
    fn the_class_is_the_configured_one_then_kubevirts_default_then_the_clusters() {
        let cluster = class("local", &json!({DEFAULT_CLASS: "true"}), "Immediate");
        let virt = class(
            "fast",
            &json!({KUBEVIRT_DEFAULT_CLASS: "true"}),
            "Immediate",
        );
        assert_eq!(
            storage_class(None, &[]),
            Err("no default storage class found".to_owned())
        );
        assert_eq!(
            storage_class(None, std::slice::from_ref(&cluster)),
            Ok("local".to_owned())
        );
        assert_eq!(
            storage_class(None, &[cluster.clone(), virt]),
            Ok("fast".to_owned())
        );
        assert_eq!(
            storage_class(Some("mine"), &[cluster]),
            Ok("mine".to_owned())
        );
    }

    #[test]
    fn the_claim_is_owned_by_the_vm_or_else_the_vmi() {
        let vm = json!([{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "name": "vm1", "uid": "vm-uid", "controller": true, "blockOwnerDeletion": true}]);
        let c = new_claim(&vmi(&vm), "local".into(), false);
        assert_eq!(
            serde_json::to_value(&c).unwrap(),
            json!({
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {
                    "generateName": "persistent-state-for-vm1-",
                    "namespace": "ns",
                    "labels": {"persistent-state-for": "vm1", "cdi.kubevirt.io/applyStorageProfile": "true"},
                    "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                        "name": "vm1", "uid": "vm-uid", "controller": true, "blockOwnerDeletion": true}],
                },
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "10Mi"}},
                    "storageClassName": "local",
                    "volumeMode": "Filesystem",
                },
            })
        );
        let c = new_claim(&vmi(&json!(null)), "shared".into(), true);
        let owner = &c.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("VirtualMachineInstance", "u1")
        );
        assert_eq!(access_modes(&c), ["ReadWriteMany"]);
    }

    #[test]
    fn the_claim_is_found_by_label_then_by_its_old_name_and_must_bind() {
        let claim = |name: &str, labels: serde_json::Value, phase: &str| -> PersistentVolumeClaim {
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns", "labels": labels},
                "spec": {"storageClassName": "local"},
                "status": {"phase": phase},
            }))
            .unwrap()
        };
        let v = vmi(&json!(null));
        let legacy = claim("persistent-state-for-vm1", json!({}), "Bound");
        let labelled = claim(
            "persistent-state-for-vm1-abcde",
            json!({PVC_PREFIX: "vm1"}),
            "Pending",
        );
        let other = claim(
            "persistent-state-for-vm2-abcde",
            json!({PVC_PREFIX: "vm2"}),
            "Bound",
        );
        assert_eq!(claim_for(&v, [&other]), None);
        assert_eq!(claim_for(&v, [&legacy, &other]), Some(&legacy));
        assert_eq!(claim_for(&v, [&legacy, &labelled]), Some(&labelled));

        let immediate = class("local", &json!({}), "Immediate");
        assert_eq!(ready(&legacy, &[]), Ok(()));
        assert_eq!(
            ready(&labelled, std::slice::from_ref(&immediate)),
            Err((NOT_READY, "PVC pending".to_owned()))
        );
        let later = class("local", &json!({}), "WaitForFirstConsumer");
        assert_eq!(ready(&labelled, &[later]), Ok(()));
        assert_eq!(
            ready(&labelled, &[]),
            Err((FAILED_PROBE, "storage class local not found".to_owned()))
        );
        let lost = claim(
            "persistent-state-for-vm1-abcde",
            json!({PVC_PREFIX: "vm1"}),
            "Lost",
        );
        assert_eq!(ready(&lost, &[immediate]).unwrap_err().0, FAILED_PROBE);
    }
}
