//! The VM controller's instance type step (KubeVirt's `instancetype/controller/vm` `Sync`
//! with the `reference` policy): before anything else on a VM that names an instance type or
//! preference, check both exist, snapshot each into a ControllerRevision the VM's status
//! points at, and hand on the VM expanded with the snapshots.

use api::VirtualMachine;
use api::instancetype::Expansion;
use informer::instancetype::{Found, Target, live_object, revision_object};
use k8s_openapi::api::apps::v1::ControllerRevision;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Map, Value};

use super::Shared;
use crate::{events, instancetype};

/// A failed step: the reason and message of the VM's Failure condition.
pub(super) type Failure = (String, String);

fn failure(reason: &str, message: impl std::fmt::Display) -> Failure {
    (reason.to_owned(), message.to_string())
}

fn store_failure(e: impl std::fmt::Display) -> Failure {
    failure(
        events::FAILED_CREATE_VMI,
        format!(
            "error encountered while storing instancetype.kubevirt.io controllerRevisions: {e}"
        ),
    )
}

/// The VM with its status references stored (the copy to carry on from) and the VM expanded
/// for its instances; both are `vm` itself when it names neither.
pub(super) async fn sync(
    s: &Shared,
    vm_api: &Api<VirtualMachine>,
    vm: VirtualMachine,
) -> Result<(VirtualMachine, VirtualMachine), Failure> {
    if vm.spec.instancetype.is_none() && vm.spec.preference.is_none() {
        return Ok((vm.clone(), vm));
    }
    for (target, reason) in [
        (Target::Instancetype, events::FAILED_FIND_INSTANCETYPE),
        (Target::Preference, events::FAILED_FIND_PREFERENCE),
    ] {
        let found = match target {
            Target::Instancetype => informer::instancetype::find_spec::<
                api::instancetype::VirtualMachineInstancetypeSpec,
            >(&s.client, &vm, target)
            .await
            .map(drop),
            Target::Preference => informer::instancetype::find_spec::<
                api::instancetype::VirtualMachinePreferenceSpec,
            >(&s.client, &vm, target)
            .await
            .map(drop),
        };
        found.map_err(|e| failure(reason, e))?;
    }
    let vm = store(s, vm_api, vm).await?;
    let found = Found::of(&s.client, &vm)
        .await
        .map_err(|e| failure(events::FAILED_CREATE_VMI, e))?;
    let expanded = instancetype::expand(&vm, &found).map_err(|errors| {
        let fields: Vec<String> = errors.iter().map(ToString::to_string).collect();
        failure(
            events::FAILED_CREATE_VMI,
            format!(
                "Error creating virtual machine instance: Failed to apply instancetype: {}",
                fields.join(", ")
            ),
        )
    })?;
    Ok((vm, expanded))
}

/// KubeVirt's `Store`: a revision for each matcher whose status reference has none, then one
/// status patch with both references.
async fn store(
    s: &Shared,
    vm_api: &Api<VirtualMachine>,
    vm: VirtualMachine,
) -> Result<VirtualMachine, Failure> {
    let namespace = vm.metadata.namespace.clone().unwrap_or_default();
    let revisions: Api<ControllerRevision> = Api::namespaced(s.client.clone(), &namespace);
    let mut patch = Map::new();
    for (target, field) in [
        (Target::Instancetype, "instancetypeRef"),
        (Target::Preference, "preferenceRef"),
    ] {
        let (Some(matcher), current) = target.of(&vm) else {
            continue;
        };
        let (mut next, missing) = instancetype::next_ref(matcher, current);
        if missing {
            let object = live_object(&s.client, &namespace, target, matcher)
                .await
                .map_err(store_failure)?;
            if target == Target::Instancetype {
                check_conflicts(&vm, &object)?;
            }
            let name = create_revision(&revisions, instancetype::snapshot(&vm, object)).await?;
            next.controller_revision_ref =
                Some(api::vm::ControllerRevisionRef { name: Some(name) });
        }
        if Some(&next) != current {
            let value = serde_json::to_value(&next).map_err(store_failure)?;
            patch.insert(field.to_owned(), value);
        }
    }
    if patch.is_empty() {
        return Ok(vm);
    }
    let body = serde_json::json!({"status": patch});
    vm_api
        .patch_status(
            vm.metadata.name.as_deref().unwrap_or_default(),
            &PatchParams::default(),
            &Patch::Merge(body),
        )
        .await
        .map_err(store_failure)
}

/// The instance type may have changed since admission accepted the VM: apply it once more to
/// the template before keeping it (KubeVirt's `checkForInstancetypeConflicts`).
fn check_conflicts(vm: &VirtualMachine, object: &Value) -> Result<(), Failure> {
    let spec = serde_json::from_value(object.get("spec").cloned().unwrap_or(Value::Null))
        .map_err(store_failure)?;
    let mut template = vm.spec.template.clone();
    Expansion {
        instancetype: Some(&spec),
        preference: None,
    }
    .apply(
        "spec.template.spec",
        template.spec.get_or_insert_default(),
        template.metadata.get_or_insert_default(),
    )
    .map_err(|errors| {
        store_failure(
            errors
                .iter()
                .map(|e| e.message.clone())
                .collect::<Vec<_>>()
                .join(", "),
        )
    })
}

/// Creates the revision, or takes the one already there when it holds the same object
/// (a retry after a lost answer, or a second VM controller).
async fn create_revision(
    revisions: &Api<ControllerRevision>,
    revision: ControllerRevision,
) -> Result<String, Failure> {
    let name = revision.metadata.name.clone().unwrap_or_default();
    match revisions.create(&PostParams::default(), &revision).await {
        Ok(_) => Ok(name),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let existing = revisions.get(&name).await.map_err(store_failure)?;
            let same = revision_object(&existing).get("spec") == revision.data.0.get("spec");
            if same {
                Ok(name)
            } else {
                Err(store_failure(format!(
                    "found existing ControllerRevision with unexpected data: {name}"
                )))
            }
        }
        Err(e) => Err(store_failure(format!(
            "failed to create ControllerRevision: {e}"
        ))),
    }
}
