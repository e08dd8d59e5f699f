//! The VM controller's shell: the VM watch, and a sync that claims the VM's instance, keeps
//! its finalizers, acts on `vm::decide` and writes `vm::next_status`.

use std::sync::Arc;

use api::{
    VirtualMachine, VirtualMachineInstance, VirtualMachineInstancePhase as Phase,
    VirtualMachineStatus,
};
use informer::{Seen, cas_status_patch, controller_owner, controller_ref, obj_key, split_key};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use serde_json::json;
use workqueue::Queue;
use workqueue::expectations::UidTrackingExpectations;

use super::{Shared, cluster_config, event, retry_later, set_finalizers};
use crate::vm::{StatusInputs, VmAction};
use crate::{events, finalizers, vm, vmi};

/// The VM watch: every VM to the VM queue; a deleted VM's instance (same name) to the VMI queue
/// too, since it may hold the VM controller's finalizer, which only the VMI controller
/// releases once the VM is gone; a pool's VM to its pool.
pub(super) fn on_vm(
    vm_q: Arc<Queue>,
    vmi_q: Arc<Queue>,
    pool_q: Arc<Queue>,
    pool_exp: Arc<UidTrackingExpectations>,
) -> impl Fn(Seen<'_, VirtualMachine>) + Send + 'static {
    move |s| {
        super::pool::vm_changed(&pool_q, &pool_exp, &s);
        match s {
            Seen::Added(o) | Seen::Changed(o) => vm_q.add(&obj_key(o)),
            Seen::Deleted(o) => {
                vm_q.add(&obj_key(o));
                vmi_q.add(&obj_key(o));
            }
        }
    }
}

/// What one sync did that the status records.
#[derive(Default)]
struct Outcome {
    /// Reason and message of a failed action (the Failure condition).
    sync_error: Option<(String, String)>,
    /// The VMI failed and is to be restarted: queue a Start request.
    request_start: bool,
}

pub(super) async fn sync_vm(s: &Shared, key: &str) {
    let (ns, name) = split_key(key);
    let vm_api: Api<VirtualMachine> = Api::namespaced(s.client.clone(), ns);
    let vmi_api: Api<VirtualMachineInstance> = Api::namespaced(s.client.clone(), ns);
    let vmi = s.vmis.get(&ObjectRef::new(name).within(ns));
    // The instance of a VM that is gone is the garbage collector's: with orphaning, this
    // cache may still show the owner reference the collector has already taken off.
    let Some(vm) = s.vms.get(&ObjectRef::new(name).within(ns)) else {
        s.vm_exp.delete(key);
        return;
    };
    let vmi = claim(key, &vm, vmi, &vmi_api).await;
    let now = Timestamp::now();
    let mut outcome = Outcome::default();

    let mut vm = vm;
    if s.vm_exp.satisfied(key)
        && let Some(next) = finalizers::vm(&vm, vmi.is_some())
    {
        match set_finalizers(&vm_api, vm.as_ref(), &next).await {
            Err(e) => {
                retry_later(&s.vm_q, key, "writing the VM's finalizers", &e);
                return;
            }
            // The last finalizer of a deleted VM: it is gone.
            Ok(_) if vm.metadata.deletion_timestamp.is_some() => return,
            // Carry on from the written version, so the status write below does not conflict
            // with this one.
            Ok(written) => vm = Arc::new(written),
        }
    }

    if vm.metadata.deletion_timestamp.is_some() {
        if let Some(v) = vmi.as_ref().filter(|v| {
            v.metadata.deletion_timestamp.is_none() && finalizers::stops_instance_on_delete(&vm)
        }) {
            s.vm_exp.expect_deletions(key, &[key.to_owned()]);
            if let Err(e) = vmi_api
                .delete(&v.name_any(), &DeleteParams::default())
                .await
            {
                s.vm_exp.deletion_observed(key, key);
                retry_later(&s.vm_q, key, "deleting the VMI of a terminating VM", &e);
            }
        }
    } else if s.vm_exp.satisfied(key) {
        match Box::pin(super::instancetype::sync(s, &vm_api, (*vm).clone())).await {
            Ok((stored, expanded)) => {
                vm = Arc::new(stored);
                outcome = Box::pin(act(
                    s,
                    key,
                    &expanded,
                    vmi.as_deref(),
                    now,
                    &vm_api,
                    &vmi_api,
                ))
                .await;
            }
            Err(failure) => {
                tracing::warn!(key, reason = failure.0, error = failure.1, "instance type");
                event(s, vm.as_ref(), true, &failure.0, failure.1.clone()).await;
                s.vm_q.add_after(key, std::time::Duration::from_secs(2));
                outcome.sync_error = Some(failure);
            }
        }
    }

    // The final status is recorded below from this same copy of the VMI; a VMI that changed
    // since fails the compare-and-swap and comes back.
    if let Some((v, next)) = vmi
        .as_ref()
        .filter(|v| vmi::is_final(v))
        .and_then(|v| Some((v, finalizers::vmi(v, false, true)?)))
        && let Err(e) = set_finalizers(&vmi_api, v.as_ref(), &next).await
    {
        retry_later(&s.vm_q, key, "releasing a final VMI", &e);
    }

    write_status(s, key, &vm, vmi.as_deref(), outcome, now, &vm_api).await;
}

/// Claim by name (KubeVirt's `ClaimVirtualMachineByName`): the VM's instance if it is ours, or
/// an orphan it adopts; `None` for another controller's or one it could not adopt.
async fn claim(
    key: &str,
    vm: &VirtualMachine,
    vmi: Option<Arc<VirtualMachineInstance>>,
    vmi_api: &Api<VirtualMachineInstance>,
) -> Option<Arc<VirtualMachineInstance>> {
    let vm_uid = vm.metadata.uid.clone().unwrap_or_default();
    let vmi = vmi.filter(|v| controller_ref(v.as_ref()).is_none_or(|o| o.uid == vm_uid))?;
    if controller_owner(vmi.as_ref(), "VirtualMachine").is_some() {
        return Some(vmi);
    }
    // Never adopt for a VM being deleted: deleted with orphaning, the garbage collector
    // strips the VMI's owner reference while the VM still exists, and adopting it back
    // would have the VMI deleted along with the VM.
    if vmi.metadata.deletion_timestamp.is_some() || vm.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let patch = json!({"metadata": {"ownerReferences": [vm::controller_ref(vm)], "resourceVersion": vmi.metadata.resource_version}});
    match vmi_api
        .patch(
            &vmi.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
    {
        Ok(_) => Some(vmi),
        Err(e) => {
            tracing::debug!(key, error = %e, "adopting an orphan VMI");
            None
        }
    }
}

/// Carries out `vm::decide` for a VM that is not being deleted.
async fn act(
    s: &Shared,
    key: &str,
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    now: Timestamp,
    vm_api: &Api<VirtualMachine>,
    vmi_api: &Api<VirtualMachineInstance>,
) -> Outcome {
    let name = vm.name_any();
    let cfg = cluster_config(s);
    let mut out = Outcome::default();
    let problems = api::validation::validate_vm(vm, &cfg);
    match vm::decide(vm, vmi, now) {
        Err(e) => out.sync_error = Some((events::FAILED_CREATE_VMI.into(), e.to_string())),
        Ok(VmAction::None) => {}
        Ok(VmAction::Start) if !problems.is_empty() => {
            let msg = vmi::validation_message(&problems);
            out.sync_error = Some((events::FAILED_CREATE_VMI.into(), msg));
        }
        Ok(VmAction::Start) => {
            let mut new = vm::vmi_from_vm(vm);
            if let Err(e) = api::defaults::apply(&mut new.spec, &cfg) {
                out.sync_error = Some((events::FAILED_CREATE_VMI.into(), e.to_string()));
            } else {
                s.vm_exp.expect_creations(key, 1);
                match vmi_api.create(&PostParams::default(), &new).await {
                    Ok(created) => event(s, vm, false, events::SUCCESSFUL_CREATE_VMI, format!("Started the virtual machine by creating the new virtual machine instance {}", created.name_any())).await,
                    Err(e) => {
                        s.vm_exp.creation_observed(key);
                        event(s, vm, true, events::FAILED_CREATE_VMI, format!("Error creating virtual machine instance: {e}")).await;
                        out.sync_error = Some((events::FAILED_CREATE_VMI.into(), e.to_string()));
                        retry_later(&s.vm_q, key, "creating the VMI", &e);
                    }
                }
            }
        }
        Ok(VmAction::RequestStart) => out.request_start = true,
        Ok(VmAction::Stop) => {
            s.vm_exp.expect_deletions(key, &[key.to_owned()]);
            match vmi_api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {
                    let uid = vmi.and_then(|v| v.metadata.uid.clone()).unwrap_or_default();
                    event(s, vm, false, events::SUCCESSFUL_DELETE_VMI, format!("Stopped the virtual machine by deleting the virtual machine instance {uid}")).await;
                }
                Err(e) => {
                    s.vm_exp.deletion_observed(key, key);
                    out.sync_error = Some((events::FAILED_DELETE_VMI.into(), e.to_string()));
                    retry_later(&s.vm_q, key, "deleting the VMI", &e);
                }
            }
        }
        Ok(VmAction::SwitchToAlways) => {
            let patch = if vm.spec.run_strategy.is_some() {
                json!({"spec": {"runStrategy": "Always"}})
            } else {
                json!({"spec": {"running": true}})
            };
            if let Err(e) = vm_api
                .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await
            {
                retry_later(&s.vm_q, key, "switching the VM to Always", &e);
            }
        }
        Ok(VmAction::WaitBackoff(d)) => s.vm_q.add_after(key, d),
    }
    if let Some(v) = vmi.filter(|v| {
        v.metadata.deletion_timestamp.is_none() && vmi::phase_of(v) == Some(Phase::Running)
    }) && let Some((volumes, disks)) = api::hotplug::declarative_sync(vm, v)
        && let Err(e) = patch_hotplug_volumes(vmi_api, v, &volumes, &disks).await
    {
        out.sync_error = Some((events::HOTPLUG_VOLUME_ERROR.into(), e.to_string()));
        retry_later(
            &s.vm_q,
            key,
            "hotplugging the VM's volumes into its VMI",
            &e,
        );
    }
    if let Some(v) = vmi.filter(|v| {
        v.metadata.deletion_timestamp.is_none() && vmi::phase_of(v) == Some(Phase::Running)
    }) && let Some(interfaces) = api::interfaces::link_state_sync(vm, v)
        && let Err(e) = patch_interfaces(vmi_api, v, &interfaces).await
    {
        out.sync_error = Some((
            events::HOTPLUG_NETWORK_INTERFACE_ERROR.into(),
            e.to_string(),
        ));
        retry_later(
            &s.vm_q,
            key,
            "copying the VM's interface states into its VMI",
            &e,
        );
    }
    out
}

/// KubeVirt's `vmiInterfacesPatch`: the VMI's interfaces replaced, guarded by a test of the
/// list this was computed from.
async fn patch_interfaces(
    vmi_api: &Api<VirtualMachineInstance>,
    vmi: &VirtualMachineInstance,
    interfaces: &[api::vmi::Interface],
) -> Result<(), kube::Error> {
    let path = "/spec/domain/devices/interfaces";
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": path, "value": vmi.spec.domain.devices.interfaces},
        {"op": "replace", "path": path, "value": interfaces},
    ]))
    .map_err(kube::Error::SerdeError)?;
    informer::patch::json_patch(vmi_api, &vmi.name_any(), &PatchParams::default(), patch)
        .await
        .map(|_| ())
}

/// KubeVirt's `patchHotplugVolumes`: the VMI's volumes and disks replaced, guarded by tests
/// of the lists this was computed from, so a concurrent change is never overwritten.
async fn patch_hotplug_volumes(
    vmi_api: &Api<VirtualMachineInstance>,
    vmi: &VirtualMachineInstance,
    volumes: &[api::vmi::Volume],
    disks: &[api::vmi::Disk],
) -> Result<(), kube::Error> {
    let mut ops = Vec::new();
    for (path, old, new) in [
        ("/spec/volumes", json!(vmi.spec.volumes), json!(volumes)),
        (
            "/spec/domain/devices/disks",
            json!(vmi.spec.domain.devices.disks),
            json!(disks),
        ),
    ] {
        let present = old.as_array().is_some_and(|a| !a.is_empty());
        if present {
            ops.push(json!({"op": "test", "path": path, "value": old}));
        }
        ops.push(
            json!({"op": if present { "replace" } else { "add" }, "path": path, "value": new}),
        );
    }
    let patch: json_patch::Patch =
        serde_json::from_value(serde_json::Value::Array(ops)).map_err(kube::Error::SerdeError)?;
    informer::patch::json_patch(vmi_api, &vmi.name_any(), &PatchParams::default(), patch)
        .await
        .map(|_| ())
}

/// Writes `vm::next_status` when it differs from the cached one.
async fn write_status(
    s: &Shared,
    key: &str,
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    outcome: Outcome,
    now: Timestamp,
    vm_api: &Api<VirtualMachine>,
) {
    let pending = s.vm_exp.counters().pending(key).unwrap_or((0, 0));
    let inputs = StatusInputs {
        start_expected: pending.0 > 0,
        stop_expected: pending.1 > 0,
        sync_error: outcome.sync_error,
        now,
        jitter: jitter(),
    };
    let mut status = vm::next_status(vm, vmi, &inputs);
    if outcome.request_start {
        status
            .state_change_requests
            .push(api::vm::VirtualMachineStateChangeRequest {
                action: api::vm::StateChangeRequestAction::Start,
                data: std::collections::BTreeMap::new(),
                uid: None,
            });
    }
    if Some(&status) != vm.status.as_ref() {
        let old: VirtualMachineStatus = vm.status.clone().unwrap_or_default();
        // The resourceVersion makes it a compare-and-swap, so a request someone queued in
        // stateChangeRequests since this copy is never dropped.
        let patch = cas_status_patch(vm.metadata.resource_version.as_deref(), &old, &status);
        if let Err(e) = vm_api
            .patch_status(
                &vm.name_any(),
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await
        {
            retry_later(&s.vm_q, key, "updating the VM status", &e);
        }
    }
}

/// Jitter for the crash-loop back-off; any spread will do, so the clock's nanoseconds serve.
fn jitter() -> f64 {
    f64::from(Timestamp::now().subsec_nanosecond().unsigned_abs() % 1000) / 1000.0
}
