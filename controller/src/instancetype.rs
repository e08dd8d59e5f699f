//! The pure half of the VM controller's instance type step (KubeVirt's
//! `pkg/instancetype/revision` and `controller/vm`): which ControllerRevision a VM's status
//! should point at, the snapshot of an object, and the VM expanded with what it points at.

use std::collections::BTreeMap;

use api::VirtualMachine;
use api::instancetype::{
    REVISION_OBJECT_GENERATION_LABEL, REVISION_OBJECT_KIND_LABEL, REVISION_OBJECT_NAME_LABEL,
    REVISION_OBJECT_UID_LABEL, REVISION_OBJECT_VERSION_LABEL, VERSION, annotation, revision_name,
};
use api::validation::FieldError;
use api::vm::{ControllerRevisionRef, InstancetypeStatusRef, Matcher};
use informer::instancetype::{Found, Target};
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use serde_json::Value;

/// KubeVirt's `syncStatusWithMatcher`: the status reference for a matcher, and whether a
/// snapshot of the live object must be stored to complete it. A changed name or kind drops
/// the old revision; a `revisionName` in the matcher wins.
pub fn next_ref(
    matcher: &Matcher,
    current: Option<&InstancetypeStatusRef>,
) -> (InstancetypeStatusRef, bool) {
    let mut next = current.cloned().unwrap_or_default();
    let mut clear = false;
    for (want, have) in [
        (&matcher.name, &mut next.name),
        (&matcher.kind, &mut next.kind),
    ] {
        if want.as_deref().is_some_and(|w| !w.is_empty()) && want != have {
            have.clone_from(want);
            clear = true;
        }
    }
    if clear {
        next.controller_revision_ref = None;
    }
    if let Some(name) = matcher.revision_name.as_ref().filter(|n| !n.is_empty())
        && next
            .controller_revision_ref
            .as_ref()
            .is_none_or(|r| r.name.as_ref() != Some(name))
    {
        next.controller_revision_ref = Some(ControllerRevisionRef {
            name: Some(name.clone()),
        });
    }
    let missing = next
        .controller_revision_ref
        .as_ref()
        .and_then(|r| r.name.as_deref())
        .is_none_or(str::is_empty);
    (next, missing)
}

/// KubeVirt's `CreateControllerRevision`: the snapshot of `object` (as read, with apiVersion
/// and kind) a VM keeps, named `<vm>-<object>-<version>-<uid>-<generation>`, owned by the VM,
/// with the object's labels, annotations, finalizers, owners and managed fields dropped.
pub fn snapshot(vm: &VirtualMachine, mut object: Value) -> ControllerRevision {
    let meta = object.get("metadata").cloned().unwrap_or(Value::Null);
    let text = |k: &str| {
        meta.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let (name, uid) = (text("name"), text("uid"));
    let generation = meta.get("generation").and_then(Value::as_i64).unwrap_or(0);
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    if let Some(m) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in [
            "labels",
            "annotations",
            "finalizers",
            "ownerReferences",
            "managedFields",
        ] {
            m.remove(k);
        }
    }
    let vm_name = vm.metadata.name.clone().unwrap_or_default();
    let labels = BTreeMap::from([
        (
            REVISION_OBJECT_GENERATION_LABEL.to_owned(),
            generation.to_string(),
        ),
        (REVISION_OBJECT_KIND_LABEL.to_owned(), kind),
        (REVISION_OBJECT_NAME_LABEL.to_owned(), name.clone()),
        (REVISION_OBJECT_UID_LABEL.to_owned(), uid.clone()),
        (REVISION_OBJECT_VERSION_LABEL.to_owned(), VERSION.to_owned()),
    ]);
    ControllerRevision {
        metadata: ObjectMeta {
            name: Some(revision_name(&vm_name, &name, &uid, generation)),
            namespace: vm.metadata.namespace.clone(),
            owner_references: Some(vec![crate::vm::controller_ref(vm)]),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        data: RawExtension(object),
        revision: Some(0),
    }
}

/// The VM as its instances are made from it (KubeVirt's `ApplyToVMI`, on the template): the
/// instance type and preference applied, and the annotations naming them.
pub fn expand(vm: &VirtualMachine, found: &Found) -> Result<VirtualMachine, Vec<FieldError>> {
    let mut out = vm.clone();
    if found.instancetype.is_none() && found.preference.is_none() {
        return Ok(out);
    }
    let meta = out.spec.template.metadata.get_or_insert_default();
    for target in [Target::Instancetype, Target::Preference] {
        if let (Some(m), _) = target.of(vm)
            && let Ok(scope) = target.scope(m)
        {
            meta.annotations.get_or_insert_default().insert(
                annotation(scope, target == Target::Preference).to_owned(),
                m.name.clone().unwrap_or_default(),
            );
        }
    }
    let spec = out.spec.template.spec.get_or_insert_default();
    found.expansion().apply("spec.template.spec", spec, meta)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(name: &str, revision: Option<&str>) -> Matcher {
        Matcher {
            name: Some(name.to_owned()),
            revision_name: revision.map(str::to_owned),
            ..Matcher::default()
        }
    }

    fn with_revision(name: &str, revision: &str) -> InstancetypeStatusRef {
        InstancetypeStatusRef {
            name: Some(name.to_owned()),
            controller_revision_ref: Some(ControllerRevisionRef {
                name: Some(revision.to_owned()),
            }),
            ..InstancetypeStatusRef::default()
        }
    }

    #[test]
    fn a_stored_revision_is_kept_until_the_matcher_names_another_object() {
        let (next, store) = next_ref(&matcher("u1", None), None);
        assert!(store);
        assert_eq!(next.name.as_deref(), Some("u1"));

        let current = with_revision("u1", "vm-u1-v1beta1-uid-1");
        let (next, store) = next_ref(&matcher("u1", None), Some(&current));
        assert!(
            !store,
            "an edit of u1 does not change a VM that has its revision"
        );
        assert_eq!(next, current);

        let (next, store) = next_ref(&matcher("u2", None), Some(&current));
        assert!(store);
        assert_eq!(next.controller_revision_ref, None);

        let (next, store) = next_ref(&matcher("u1", Some("pinned")), Some(&current));
        assert!(!store);
        assert_eq!(next, with_revision("u1", "pinned"));
    }

    #[test]
    fn a_snapshot_is_named_labelled_and_stripped_as_kubevirt_s() {
        let vm: VirtualMachine = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "vm1", "namespace": "ns", "uid": "vm-uid"},
            "spec": {"template": {}}
        }))
        .unwrap();
        let object = serde_json::json!({
            "apiVersion": "instancetype.kubevirt.io/v1beta1",
            "kind": "VirtualMachineClusterInstancetype",
            "metadata": {"name": "u1", "uid": "it-uid", "generation": 2,
                         "labels": {"a": "b"}, "managedFields": []},
            "spec": {"cpu": {"guest": 1}, "memory": {"guest": "1Gi"}}
        });
        let rev = snapshot(&vm, object);
        assert_eq!(
            rev.metadata.name.as_deref(),
            Some("vm1-u1-v1beta1-it-uid-2")
        );
        let labels = rev.metadata.labels.unwrap();
        assert_eq!(
            labels[REVISION_OBJECT_KIND_LABEL],
            "VirtualMachineClusterInstancetype"
        );
        assert_eq!(labels[REVISION_OBJECT_GENERATION_LABEL], "2");
        let data = rev.data.0;
        assert_eq!(
            data["metadata"],
            serde_json::json!({"name": "u1", "uid": "it-uid", "generation": 2})
        );
        assert_eq!(rev.metadata.owner_references.unwrap()[0].name, "vm1");
    }
}
