//! The VirtualMachinePool controller's shell (KubeVirt's `pool.go` `execute`): releases VMs
//! that left the selector, keeps the pool's finalizer, scales by `pool::scale`, brings VMs
//! and their instances to the current template once the scale is stable, prunes revisions no
//! VM uses, and writes the status.

use std::sync::Arc;

use api::pool::{FINALIZER, VirtualMachinePool};
use api::{VirtualMachine, VirtualMachineInstance};
use informer::{Seen, controller_owner, key_of, obj_key, split_key, status_patch};
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::core::{Selector, SelectorExt as _};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource as _, ResourceExt as _};
use serde_json::json;
use workqueue::Queue;
use workqueue::expectations::{EXPECTATION_TTL, UidTrackingExpectations};

use super::{Shared, event, retry_later, set_finalizers};
use crate::pool::{InstanceUpdate, Scale};
use crate::{events, pool, replicaset};

/// How soon a proactive update held back by `maxUnavailable` looks again (KubeVirt's
/// `defaultRetryDelay`).
const UPDATE_RETRY: std::time::Duration = std::time::Duration::from_secs(3);

/// The revision watch: a pool's revision observed, and the pool queued.
pub(super) fn on_revision(
    pool_q: Arc<Queue>,
    pool_exp: Arc<UidTrackingExpectations>,
) -> impl Fn(Seen<'_, ControllerRevision>) + Send + 'static {
    move |s| {
        let o = s.object();
        let Some(owner) = controller_owner(o, api::pool::VirtualMachinePool::kind(&()).as_ref())
        else {
            return;
        };
        let key = key_of(o.namespace().as_deref(), owner);
        if let Seen::Added(_) = s {
            pool_exp.creation_observed(&key);
        }
        pool_q.add(&key);
    }
}

/// A VM seen: its pool's expectations observed and the pool queued.
pub(super) fn vm_changed(
    pool_q: &Queue,
    pool_exp: &UidTrackingExpectations,
    s: &Seen<'_, VirtualMachine>,
) {
    let o = s.object();
    let Some(owner) = controller_owner(o, api::pool::VirtualMachinePool::kind(&()).as_ref()) else {
        return;
    };
    let key = key_of(o.namespace().as_deref(), owner);
    match s {
        Seen::Added(_) => pool_exp.creation_observed(&key),
        Seen::Deleted(_) => pool_exp.deletion_observed(&key, &obj_key(o)),
        Seen::Changed(_) => {}
    }
    pool_q.add(&key);
}

/// Why a sync did not finish, for the ReplicaFailure condition.
struct SyncError {
    reason: &'static str,
    message: String,
}

pub(super) async fn sync_pool(s: &Shared, key: &str) {
    let (ns, name) = split_key(key);
    let Some(p) = s.pools.get(&ObjectRef::new(name).within(ns)) else {
        s.pool_exp.delete(key);
        return;
    };
    let template_labels = p
        .spec
        .virtual_machine_template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    // Admission refuses both; a pool written before it was installed waits to be fixed.
    match Selector::try_from(p.spec.selector.clone()) {
        Ok(sel) if sel.matches(&template_labels) => {}
        _ => {
            tracing::warn!(
                key,
                "the pool's selector is invalid or does not match its template's labels"
            );
            return;
        }
    }
    let pool_api: Api<VirtualMachinePool> = Api::namespaced(s.client.clone(), ns);
    let vm_api: Api<VirtualMachine> = Api::namespaced(s.client.clone(), ns);
    let mut all: Vec<VirtualMachine> = s
        .vms
        .state()
        .iter()
        .filter(|v| v.namespace().as_deref() == Some(ns))
        .map(|v| (**v).clone())
        .collect();
    let claims = replicaset::claims_of(&p.metadata, &p.spec.selector, &all, false);
    let Some(owner_ref) = p.controller_owner_ref(&()) else {
        return;
    };
    if !super::replicaset::claim(
        &s.pool_q,
        key,
        &p.metadata,
        &owner_ref,
        &claims,
        &mut all,
        &vm_api,
    )
    .await
    {
        return;
    }
    let vms = replicaset::owned_by(&p.metadata, &p.spec.selector, &all);

    let mut p = p;
    if p.metadata.deletion_timestamp.is_none() && !pool::has_finalizer(&p.metadata) {
        let mut next = p.metadata.finalizers.clone().unwrap_or_default();
        next.push(FINALIZER.to_owned());
        match set_finalizers(&pool_api, p.as_ref(), &next).await {
            Ok(written) => p = Arc::new(written),
            Err(e) => {
                retry_later(&s.pool_q, key, "adding the pool's finalizer", &e);
                return;
            }
        }
    }

    let mut error = None;
    if p.metadata.deletion_timestamp.is_some() {
        if let Err(e) = Box::pin(delete_pool(&p, &all, &vm_api, &pool_api)).await {
            retry_later(&s.pool_q, key, "releasing a deleted pool's VMs", &e);
        }
        error = prune(s, &p, &vms).await.err();
    } else if !s.pool_exp.satisfied(key) {
        // Observed creations and deletions queue the pool; this is for those never seen.
        s.pool_q.add_after(key, EXPECTATION_TTL);
    } else if p.spec.paused != Some(true) {
        let (scale_error, scale_stable) = Box::pin(scale(s, key, &p, &vms, &vm_api)).await;
        error = scale_error;
        let mut update_stable = false;
        if s.pool_exp.satisfied(key) && scale_stable && error.is_none() {
            (error, update_stable) = Box::pin(update(s, key, &p, &vms, &vm_api)).await;
        }
        if s.pool_exp.satisfied(key) && scale_stable && update_stable && error.is_none() {
            error = prune(s, &p, &vms).await.err();
        }
    }
    Box::pin(write_status(s, key, &p, &vms, error, &pool_api)).await;
}

/// KubeVirt's `scale`: the error, and whether the count is where it should be.
async fn scale(
    s: &Shared,
    key: &str,
    p: &VirtualMachinePool,
    vms: &[&VirtualMachine],
    vm_api: &Api<VirtualMachine>,
) -> (Option<SyncError>, bool) {
    // VMs deleted by anyone, the pool included, are let go once deleted.
    for n in pool::releasable(p, vms) {
        if let Some(v) = vms.iter().find(|v| v.metadata.name.as_deref() == Some(&n))
            && let Err(e) = release(vm_api, v).await
        {
            return (Some(scale_in_error(&e)), false);
        }
    }
    let rng = &mut fastrand::Rng::new();
    match pool::scale(p, vms, rng) {
        Scale::Stable => (None, true),
        Scale::Waiting => (None, false),
        Scale::Create(n) => (scale_out(s, key, p, n, vm_api).await.err(), false),
        Scale::Delete(names) => (
            Box::pin(scale_in(s, key, p, vms, &names, vm_api))
                .await
                .err(),
            false,
        ),
    }
}

fn scale_in_error(e: &kube::Error) -> SyncError {
    SyncError {
        reason: events::FAILED_SCALE_IN,
        message: format!("error during scale in: {e}"),
    }
}

async fn scale_out(
    s: &Shared,
    key: &str,
    p: &VirtualMachinePool,
    n: usize,
    vm_api: &Api<VirtualMachine>,
) -> Result<(), SyncError> {
    let failed = |e: &kube::Error| SyncError {
        reason: events::FAILED_SCALE_OUT,
        message: format!("error during scale out: {e}"),
    };
    let ns = p.namespace().unwrap_or_default();
    let names = pool::new_names(&p.name_any(), n, |n| {
        s.vms.get(&ObjectRef::new(n).within(&ns)).is_some()
    });
    let revision = ensure_revision(s, key, p).await.map_err(|e| failed(&e))?;
    s.pool_exp
        .counters()
        .raise(key, i64::try_from(names.len()).unwrap_or(i64::MAX), 0);
    let mut first_error = None;
    for name in &names {
        let vm = pool::new_vm(p, name, &revision);
        match vm_api.create(&PostParams::default(), &vm).await {
            Ok(_) => {
                event(
                    s,
                    p,
                    false,
                    events::SUCCESSFUL_CREATE_VMI,
                    format!("Created VM {ns}/{name}"),
                )
                .await;
            }
            Err(e) => {
                s.pool_exp.creation_observed(key);
                tracing::warn!(key, vm = name, error = %e, "creating a pool VM");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        None => Ok(()),
        Some(e) => {
            event(
                s,
                p,
                true,
                events::FAILED_CREATE_VMI,
                format!("Error creating VM: {e}"),
            )
            .await;
            retry_later(&s.pool_q, key, "creating a pool VM", &e);
            Err(failed(&e))
        }
    }
}

async fn scale_in(
    s: &Shared,
    key: &str,
    p: &VirtualMachinePool,
    vms: &[&VirtualMachine],
    names: &[String],
    vm_api: &Api<VirtualMachine>,
) -> Result<(), SyncError> {
    let ns = p.namespace();
    let keys: Vec<String> = names.iter().map(|n| key_of(ns.as_deref(), n)).collect();
    s.pool_exp.expect_deletions(key, &keys);
    let mut first_error = None;
    for (n, k) in names.iter().zip(&keys) {
        let uid = vms
            .iter()
            .find(|v| v.metadata.name.as_deref() == Some(n))
            .and_then(|v| v.metadata.uid.clone())
            .unwrap_or_default();
        match vm_api.delete(n, &DeleteParams::default()).await {
            Ok(deleted) => {
                // The VM stays until the pool lets it go; its copy as deleted carries the
                // finalizers to take ours from.
                if let Some(v) = deleted.left()
                    && let Err(e) = release(vm_api, &v).await
                {
                    event(
                        s,
                        p,
                        true,
                        events::FAILED_UPDATE,
                        format!(
                            "Error removing finalizer for VM {}/{n}: {e}",
                            ns.as_deref().unwrap_or_default()
                        ),
                    )
                    .await;
                    first_error.get_or_insert(e);
                }
                event(
                    s,
                    p,
                    false,
                    events::SUCCESSFUL_DELETE_VMI,
                    format!(
                        "Deleted VM {}/{n} with uid {uid} from pool",
                        ns.as_deref().unwrap_or_default()
                    ),
                )
                .await;
            }
            Err(e) => {
                s.pool_exp.deletion_observed(key, k);
                event(
                    s,
                    p,
                    true,
                    events::FAILED_DELETE_VMI,
                    format!(
                        "Error deleting virtual machine {}/{n}: {e}",
                        ns.as_deref().unwrap_or_default()
                    ),
                )
                .await;
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        None => Ok(()),
        Some(e) => {
            retry_later(&s.pool_q, key, "scaling a pool in", &e);
            Err(scale_in_error(&e))
        }
    }
}

/// Takes the pool's finalizer off `vm` (KubeVirt's `removeFinalizer`): a JSON patch that
/// tests the finalizers it read, so one added since is never dropped.
async fn release(vm_api: &Api<VirtualMachine>, vm: &VirtualMachine) -> Result<(), kube::Error> {
    if !pool::has_finalizer(&vm.metadata) {
        return Ok(());
    }
    let old = vm.metadata.finalizers.clone().unwrap_or_default();
    let new: Vec<&String> = old.iter().filter(|f| *f != FINALIZER).collect();
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers", "value": old},
        {"op": "replace", "path": "/metadata/finalizers", "value": new},
    ]))
    .map_err(kube::Error::SerdeError)?;
    match vm_api
        .patch(
            &vm.name_any(),
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        r => r.map(|_| ()),
    }
}

/// The name of the revision of the pool's current spec, created if the cache does not hold it
/// (KubeVirt's `ensureControllerRevision`).
async fn ensure_revision(
    s: &Shared,
    key: &str,
    p: &VirtualMachinePool,
) -> Result<String, kube::Error> {
    let name = pool::revision_name(p);
    let ns = p.namespace().unwrap_or_default();
    if s.revisions
        .get(&ObjectRef::new(&name).within(&ns))
        .is_some()
    {
        return Ok(name);
    }
    let api: Api<ControllerRevision> = Api::namespaced(s.client.clone(), &ns);
    s.pool_exp.counters().raise(key, 1, 0);
    match api.create(&PostParams::default(), &pool::revision(p)).await {
        Ok(_) => Ok(name),
        // Written by an earlier sync and not in the cache yet.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            s.pool_exp.creation_observed(key);
            Ok(name)
        }
        Err(e) => {
            s.pool_exp.creation_observed(key);
            Err(e)
        }
    }
}

fn revision_lookup<'a>(
    s: &'a Shared,
    ns: &'a str,
) -> impl Fn(&str) -> Option<api::pool::VirtualMachinePoolSpec> + 'a {
    move |name| {
        s.revisions
            .get(&ObjectRef::new(name).within(ns))
            .and_then(|r| pool::revision_spec(&r))
    }
}

/// KubeVirt's `update`: outdated VMs rewritten from the template, then (proactive) instances
/// restarted or relabelled. The error, and whether every VM is up to date.
async fn update(
    s: &Shared,
    key: &str,
    p: &VirtualMachinePool,
    vms: &[&VirtualMachine],
    vm_api: &Api<VirtualMachine>,
) -> (Option<SyncError>, bool) {
    if !p.spec.updates_vms() {
        return (None, true);
    }
    let failed = |e: &kube::Error| SyncError {
        reason: events::FAILED_UPDATE,
        message: format!("error during VM update: {e}"),
    };
    let ns = p.namespace().unwrap_or_default();
    let revisions = revision_lookup(s, &ns);
    let (outdated, current): (Vec<&VirtualMachine>, Vec<&VirtualMachine>) = vms
        .iter()
        .copied()
        .partition(|v| pool::is_outdated_vm(p, v, &revisions));
    if !outdated.is_empty() {
        let revision = match ensure_revision(s, key, p).await {
            Ok(r) => r,
            Err(e) => return (Some(failed(&e)), false),
        };
        for v in &outdated {
            let n = v.name_any();
            // The cached resourceVersion makes this a compare-and-swap.
            match vm_api
                .replace(
                    &n,
                    &PostParams::default(),
                    &pool::updated_vm(p, v, &revision),
                )
                .await
            {
                Ok(_) => {
                    event(
                        s,
                        p,
                        false,
                        events::SUCCESSFUL_UPDATE_VM,
                        format!("Updated VM {ns}/{n}"),
                    )
                    .await;
                }
                Err(e) => {
                    event(
                        s,
                        p,
                        true,
                        events::FAILED_UPDATE,
                        format!("Error updating virtual machine {ns}/{n}: {e}"),
                    )
                    .await;
                    retry_later(&s.pool_q, key, "updating a pool VM", &e);
                    return (Some(failed(&e)), false);
                }
            }
        }
    }
    if p.spec.updates_proactively()
        && let Err(e) = Box::pin(proactive_update(s, key, p, &current)).await
    {
        retry_later(&s.pool_q, key, "updating a pool VM's instance", &e);
        return (
            Some(SyncError {
                reason: events::FAILED_UPDATE,
                message: format!("error during VMI update: {e}"),
            }),
            false,
        );
    }
    (None, outdated.is_empty())
}

/// KubeVirt's `proactiveUpdate`: instances of VMs that are not ready first, then the others
/// within `maxUnavailable`, in the update order.
async fn proactive_update(
    s: &Shared,
    key: &str,
    p: &VirtualMachinePool,
    current: &[&VirtualMachine],
) -> Result<(), kube::Error> {
    let ns = p.namespace().unwrap_or_default();
    let revisions = revision_lookup(s, &ns);
    let vmi_of = |vm: &VirtualMachine| s.vmis.get(&ObjectRef::new(&vm.name_any()).within(&ns));
    for vm in current.iter().filter(|v| !pool::vm_ready(v)) {
        if let Some(vmi) = vmi_of(vm).filter(|v| v.metadata.deletion_timestamp.is_none()) {
            apply(s, p, vm, &vmi, pool::instance_update(vm, &vmi, &revisions)).await?;
        }
    }
    let unavailable = current
        .iter()
        .filter(|v| vmi_of(v).is_none_or(|i| !pool::vmi_available(&i)))
        .count();
    let max =
        api::pool::max_unavailable(p.spec.max_unavailable.as_ref(), p.spec.wanted()).unwrap_or(1);
    let mut budget = i64::from(max) - i64::try_from(unavailable).unwrap_or(i64::MAX);
    let mut order = current.to_vec();
    pool::sort_vms(
        &mut order,
        &p.spec.update_order(),
        &mut fastrand::Rng::new(),
    );
    for vm in order {
        if budget <= 0 {
            s.pool_q.add_after(key, UPDATE_RETRY);
            return Ok(());
        }
        let Some(vmi) = vmi_of(vm) else { continue };
        let what = pool::instance_update(vm, &vmi, &revisions);
        if what == InstanceUpdate::None {
            continue;
        }
        apply(s, p, vm, &vmi, what).await?;
        budget -= 1;
    }
    Ok(())
}

/// KubeVirt's `handleResourceUpdate`.
async fn apply(
    s: &Shared,
    p: &VirtualMachinePool,
    vm: &VirtualMachine,
    vmi: &VirtualMachineInstance,
    what: InstanceUpdate,
) -> Result<(), kube::Error> {
    let ns = p.namespace().unwrap_or_default();
    let vmi_api: Api<VirtualMachineInstance> = Api::namespaced(s.client.clone(), &ns);
    let name = vm.name_any();
    let written = match what {
        InstanceUpdate::None => return Ok(()),
        InstanceUpdate::Restart => vmi_api
            .delete(&vmi.name_any(), &DeleteParams::default())
            .await
            .map(|_| ()),
        InstanceUpdate::Relabel(revision) => vmi_api
            .patch(
                &vmi.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {
                    "labels": {api::pool::REVISION_NAME_LABEL: revision},
                    "resourceVersion": vmi.metadata.resource_version,
                }})),
            )
            .await
            .map(|_| ()),
    };
    match &written {
        Ok(()) => {
            event(
                s,
                p,
                false,
                events::SUCCESSFUL_DELETE_VMI,
                format!("Successfully updated resource {ns}/{name}"),
            )
            .await;
        }
        Err(e) => {
            event(
                s,
                p,
                true,
                events::FAILED_UPDATE,
                format!("Error updating resource {ns}/{name}: {e}"),
            )
            .await;
        }
    }
    written
}

/// KubeVirt's `pruneUnusedRevisions`.
async fn prune(
    s: &Shared,
    p: &VirtualMachinePool,
    vms: &[&VirtualMachine],
) -> Result<(), SyncError> {
    let ns = p.namespace().unwrap_or_default();
    let uid = p.metadata.uid.as_deref();
    let owned: Vec<String> = s
        .revisions
        .state()
        .iter()
        .filter(|r| r.namespace().as_deref() == Some(ns.as_str()))
        .filter(|r| {
            informer::controller_ref(r.as_ref()).is_some_and(|o| Some(o.uid.as_str()) == uid)
        })
        .map(|r| r.name_any())
        .collect();
    let vmis: Vec<Arc<VirtualMachineInstance>> = vms
        .iter()
        .filter_map(|v| s.vmis.get(&ObjectRef::new(&v.name_any()).within(&ns)))
        .collect();
    let vmi_refs: Vec<&VirtualMachineInstance> = vmis.iter().map(AsRef::as_ref).collect();
    let api: Api<ControllerRevision> = Api::namespaced(s.client.clone(), &ns);
    for name in pool::unused_revisions(owned.iter().map(String::as_str), vms, &vmi_refs) {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(SyncError {
                    reason: events::FAILED_REVISION_PRUNING,
                    message: format!("error while pruning vmpool revisions: {e}"),
                });
            }
        }
    }
    Ok(())
}

/// KubeVirt's `handlePoolDeletion`: every VM the selector matches lets go of the pool's
/// finalizer, then the pool does.
async fn delete_pool(
    p: &VirtualMachinePool,
    all: &[VirtualMachine],
    vm_api: &Api<VirtualMachine>,
    pool_api: &Api<VirtualMachinePool>,
) -> Result<(), kube::Error> {
    for v in all {
        if replicaset::selector_matches(&p.spec.selector, v.metadata.labels.as_ref()) {
            release(vm_api, v).await?;
        }
    }
    if pool::has_finalizer(&p.metadata) {
        let next: Vec<String> = p
            .metadata
            .finalizers
            .iter()
            .flatten()
            .filter(|f| *f != FINALIZER)
            .cloned()
            .collect();
        match set_finalizers(pool_api, p, &next).await {
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            r => {
                r?;
            }
        }
    }
    Ok(())
}

async fn write_status(
    s: &Shared,
    key: &str,
    p: &VirtualMachinePool,
    vms: &[&VirtualMachine],
    error: Option<SyncError>,
    pool_api: &Api<VirtualMachinePool>,
) {
    use api::pool::VirtualMachinePoolConditionType as T;
    let old = p.status.clone().unwrap_or_default();
    let has = |st: &api::pool::VirtualMachinePoolStatus, t: &T| {
        st.conditions.iter().any(|c| c.type_ == *t)
    };
    let status = pool::next_status(
        p,
        vms,
        error.as_ref().map(|e| (e.reason, e.message.as_str())),
        Timestamp::now(),
    );
    if let Some(e) = error.as_ref().filter(|_| !has(&old, &T::ReplicaFailure)) {
        event(s, p, true, e.reason, e.message.clone()).await;
    }
    match (
        has(&old, &T::ReplicaPaused),
        has(&status, &T::ReplicaPaused),
    ) {
        (false, true) => {
            event(
                s,
                p,
                false,
                events::SUCCESSFUL_PAUSED_POOL,
                "Pool is paused".into(),
            )
            .await;
        }
        (true, false) => {
            event(
                s,
                p,
                false,
                events::SUCCESSFUL_RESUME_POOL,
                "Pool is unpaused".into(),
            )
            .await;
        }
        _ => {}
    }
    if status == old {
        return;
    }
    if let Err(e) = pool_api
        .patch_status(
            &p.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status_patch(&old, &status) })),
        )
        .await
    {
        retry_later(&s.pool_q, key, "updating the pool's status", &e);
    }
}
