//! The VMI controller's shell: the VMI and launcher pod watches (which also feed the VM and
//! ReplicaSet controllers' expectations), and a sync that validates the VMI, creates or
//! deletes its launcher pod and writes `vmi::sync`'s status in one compare-and-swap patch.

use std::sync::{Arc, Mutex};

use api::validation::FieldError;
use api::{ClusterConfig, VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceStatus};
use informer::{Seen, controller_owner, controller_ref, key_of, obj_key, split_key, status_patch};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::json;
use workqueue::Queue;

use super::{Shared, cluster_config, event, retry_later};
use crate::cache;
use crate::template::render_launcher_pod;
use crate::vmi::PodAction;
use crate::{events, finalizers, hotplug, vmi};
use informer::packed::PackedStore;
use workqueue::expectations::{EXPECTATION_TTL, UidTrackingExpectations};

/// What the VMI watch feeds.
pub(super) struct VmiWatch {
    pub vmi_q: Arc<Queue>,
    pub vm_q: Arc<Queue>,
    pub rs_q: Arc<Queue>,
    pub vm_exp: Arc<UidTrackingExpectations>,
    pub rs_exp: Arc<UidTrackingExpectations>,
    /// The pools, queued when an instance of one of their VMs changes.
    pub pool_q: Arc<Queue>,
    pub vms: Store<VirtualMachine>,
    pub mig_q: Arc<Queue>,
    pub mig_index: Arc<Mutex<super::migration::MigrationIndex>>,
    pub evac_q: Arc<Queue>,
}

/// The VMI watch: the VMI to its queue; its VM's and ReplicaSet's expectations observed and
/// their keys queued.
pub(super) fn on_vmi(w: VmiWatch) -> impl Fn(Seen<'_, VirtualMachineInstance>) + Send + 'static {
    move |s| {
        let (o, added, deleted) = match s {
            Seen::Added(o) => (o, true, false),
            Seen::Changed(o) => (o, false, false),
            Seen::Deleted(o) => (o, false, true),
        };
        let ns = o.namespace();
        let key = obj_key(o);
        w.vmi_q.add(&key);
        super::migration::vmi_changed(&w.mig_q, &w.mig_index, &key);
        super::evacuation::vmi_changed(&w.evac_q, o);
        if let Some(vm) = controller_owner(o, "VirtualMachine") {
            let vm_key = key_of(ns.as_deref(), vm);
            if added {
                w.vm_exp.creation_observed(&vm_key);
            }
            if deleted {
                w.vm_exp.deletion_observed(&vm_key, &key);
            }
            w.vm_q.add(&vm_key);
            // KubeVirt's pool controller follows its VMs' instances (readiness, revisions).
            if let Some(p) = w
                .vms
                .get(&ObjectRef::new(vm).within(ns.as_deref().unwrap_or_default()))
                .as_deref()
                .and_then(|v| controller_owner(v, "VirtualMachinePool"))
            {
                w.pool_q.add(&key_of(ns.as_deref(), p));
            }
        } else if w
            .vms
            .get(&ObjectRef::new(&o.name_any()).within(ns.as_deref().unwrap_or_default()))
            .is_some()
        {
            // An orphan may be adopted by the VM of the same name (KubeVirt too queues only
            // the VMs an orphan matches).
            w.vm_q.add(&key);
        }
        if let Some(rs) = controller_owner(o, "VirtualMachineInstanceReplicaSet") {
            let rs_key = key_of(ns.as_deref(), rs);
            if added {
                w.rs_exp.creation_observed(&rs_key);
            }
            if deleted {
                w.rs_exp.deletion_observed(&rs_key, &key);
            }
            w.rs_q.add(&rs_key);
        }
    }
}

/// The PVC watch: the VMIs using the claim, since a claim binding lets its hotplug go on and
/// a claim appearing lets a launcher pod waiting for it be created; a backend-storage claim's
/// VMI by its label (its creation observed).
pub(super) fn on_claim(
    vmi_q: Arc<Queue>,
    vmis: PackedStore<VirtualMachineInstance>,
    pvc_exp: Arc<workqueue::expectations::Expectations>,
) -> impl Fn(Seen<'_, PersistentVolumeClaim>) + Send + 'static {
    move |s| {
        let c = s.object();
        let ns = c.namespace().unwrap_or_default();
        if let Some(vmi) = c.labels().get(api::backendstorage::PVC_PREFIX) {
            let key = key_of(Some(&ns), vmi);
            if matches!(s, Seen::Added(_)) {
                pvc_exp.creation_observed(&key);
            }
            vmi_q.add(&key);
            return;
        }
        for vmi in vmis.keys_by_index(cache::VMI_BY_CLAIM.name, &obj_key(c)) {
            vmi_q.add(&vmi);
        }
    }
}

/// What the launcher pod watch feeds.
pub(super) struct PodWatch {
    pub vmi_q: Arc<Queue>,
    pub pod_exp: Arc<UidTrackingExpectations>,
    pub mig_q: Arc<Queue>,
    pub mig_pod_exp: Arc<UidTrackingExpectations>,
    pub mig_index: Arc<Mutex<super::migration::MigrationIndex>>,
}

/// The launcher pod watch (the pod cache has indexed the pod by its VMI already, so a sync
/// that finds its expectation satisfied finds the pod too): the VMI's pod expectations
/// observed and its key queued; a migration target pod's migration has its expectation observed, and the
/// VMI's migrations are queued.
pub(super) fn on_pod(w: PodWatch) -> impl Fn(Seen<'_, Pod>) + Send + 'static {
    let PodWatch {
        vmi_q,
        pod_exp,
        mig_q,
        mig_pod_exp,
        mig_index,
    } = w;
    move |s| {
        let (o, added, deleted) = match s {
            Seen::Added(o) => (o, true, false),
            Seen::Changed(o) => (o, false, false),
            Seen::Deleted(o) => (o, false, true),
        };
        let pod_key = obj_key(o);
        if let Some(vmi_key) = cache::attachment_vmi_key(o) {
            if added {
                pod_exp.creation_observed(&vmi_key);
            }
            if deleted || o.metadata.deletion_timestamp.is_some() {
                pod_exp.deletion_observed(&vmi_key, &pod_key);
            }
            vmi_q.add(&vmi_key);
            return;
        }
        let owner = controller_owner(o, "VirtualMachineInstance");
        let vmi_key = owner.map(|owner| key_of(o.namespace().as_deref(), owner));
        super::migration::pod_changed(
            &mig_q,
            &mig_index,
            &mig_pod_exp,
            o,
            added,
            vmi_key.as_deref(),
        );
        let Some(vmi_key) = vmi_key else {
            return;
        };
        if added {
            pod_exp.creation_observed(&vmi_key);
        }
        // A pod marked for deletion counts as deleted (KubeVirt's `updatePod`): its kubelet
        // may take the whole grace period to remove it, or never, if its node is gone.
        if deleted || o.metadata.deletion_timestamp.is_some() {
            pod_exp.deletion_observed(&vmi_key, &pod_key);
        }
        vmi_q.add(&vmi_key);
    }
}

pub(super) async fn sync_vmi(s: &Shared, key: &str) {
    let (ns, name) = split_key(key);
    let pods_api: Api<Pod> = Api::namespaced(s.client.clone(), ns);
    let pods = super::launcher_pods(s, key);
    let Some(vmi) = s.vmis.get(&ObjectRef::new(name).within(ns)) else {
        s.vmi_writes.forget(key);
        // The garbage collector's job too (the pods' owner reference names the VMI); this
        // does not wait for it.
        s.pod_exp.delete(key);
        for p in pods
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            if let Err(e) = pods_api
                .delete(&p.name_any(), &DeleteParams::default())
                .await
            {
                tracing::debug!(pod = %p.name_any(), error = %e, "deleting an orphaned launcher pod");
            }
        }
        return;
    };
    if !s.pod_exp.satisfied(key) {
        s.vmi_q.add_after(key, EXPECTATION_TTL);
        return;
    }
    let cfg = cluster_config(s);
    let mut defaulted = (*vmi).clone();
    let mut problems: Vec<FieldError> = Vec::new();
    if let Err(e) = api::defaults::apply(&mut defaulted.spec, &cfg) {
        problems.push(FieldError {
            path: "spec.domain.devices.interfaces".into(),
            message: e.to_string(),
        });
    }
    problems.extend(api::validation::validate_vmi(&defaulted, &cfg));
    let claim = super::claims_in(s, ns);
    let shared = |name: &str| {
        claim(name).map(|c| {
            c.spec
                .and_then(|s| s.access_modes)
                .is_some_and(|m| m.iter().any(|m| m == "ReadWriteMany"))
        })
    };
    let now = Timestamp::now();
    let mut out = vmi::sync_with(&vmi, &pods, &problems, &shared, now);
    let missing = (out.pods == PodAction::Create)
        .then(|| crate::template::missing_claim(&defaulted, &claim))
        .flatten()
        .map(|e| e.to_string());
    vmi::wait_for_claims(&mut out, missing.clone(), now);
    if out.pods == PodAction::Create && api::backendstorage::needed(&defaulted) {
        let problem = match backend_storage(s, key, &defaulted, &cfg).await {
            Ok(Some(claim)) => {
                let status = defaulted.status.get_or_insert_default();
                api::backendstorage::set_volume_status(
                    status,
                    &claim.name_any(),
                    &crate::backendstorage::access_modes(&claim),
                );
                None
            }
            Ok(None) => {
                out.pods = PodAction::None;
                None
            }
            Err(problem) => {
                // As KubeVirt's sync errors: tried again, backing off; a class made meanwhile
                // is no event the controller sees.
                s.vmi_q.add_rate_limited(key);
                Some(problem)
            }
        };
        let was = old_reason(&vmi);
        if let Some((reason, message)) = problem.as_ref().filter(|p| was != Some(p.0)) {
            event(s, vmi.as_ref(), true, reason, message.clone()).await;
        }
        vmi::wait_for_backend_storage(&mut out, problem, now);
    }
    let old_status = vmi.status.clone().unwrap_or_default();
    let was_waiting = old_status
        .condition(&api::status::VirtualMachineInstanceConditionType::Synchronized)
        .is_some_and(|c| c.reason.as_deref() == Some(events::FAILED_PVC_NOT_FOUND));
    if let Some(message) = missing.filter(|_| !was_waiting) {
        event(
            s,
            vmi.as_ref(),
            false,
            events::FAILED_PVC_NOT_FOUND,
            format!("{message}, waiting for it to appear"),
        )
        .await;
    }
    if let Some(launcher) = hotplug_launcher(&vmi, &out.status, &pods) {
        out.status.volume_status = Box::pin(sync_hotplug(s, key, &vmi, launcher, &claim)).await;
    } else if let Some(launcher) = handed_over_launcher(&vmi, &out.status, &pods) {
        // KubeVirt's `updateVolumeStatus` at the hand-off and while Scheduled: virt-handler's
        // write that makes the VMI Running then fills in the targets of entries that are
        // there, instead of a second write of each side once this controller adds them.
        // Attachment pods come only once the VMI runs, so no hotplug phase moves here and
        // there are no events.
        out.status.volume_status = hotplug::volume_status(&vmi, launcher, &[], &claim).0;
    }
    // As KubeVirt's status update: the backend-storage claim, whenever there is one.
    if api::backendstorage::needed(&vmi)
        && let Some(c) =
            crate::backendstorage::claim_for(&vmi, s.pvcs.state().iter().map(AsRef::as_ref))
    {
        api::backendstorage::set_volume_status(
            &mut out.status,
            &c.name_any(),
            &crate::backendstorage::access_modes(c),
        );
    }

    Box::pin(act_on_pods(
        s, key, &vmi, &defaulted, &cfg, out.pods, &pods_api,
    ))
    .await;

    if let Some((pod_name, condition)) = out.pod_condition {
        // A strategic merge patch merges conditions by type, so the kubelet's stay as they are.
        let patch = json!({"status": {"conditions": [condition]}});
        if let Err(e) = pods_api
            .patch_status(&pod_name, &PatchParams::default(), &Patch::Strategic(patch))
            .await
        {
            retry_later(
                &s.vmi_q,
                key,
                "setting the launcher pod's unpaused condition",
                &e,
            );
        }
    }

    // One Event per field at fault, when the validation condition first appears.
    let was_invalid = old_status
        .condition(&api::status::VirtualMachineInstanceConditionType::Synchronized)
        .is_some_and(|c| c.reason.as_deref() == Some(vmi::FAILED_VALIDATION));
    if !problems.is_empty() && !was_invalid {
        for p in &problems {
            event(
                s,
                vmi.as_ref(),
                true,
                events::FAILED_VALIDATION,
                p.to_string(),
            )
            .await;
        }
    }

    let write = VmiWrite {
        old_status: &old_status,
        status: &out.status,
        node_label: out.node_label,
        release_finalizer: out.release_finalizer,
    };
    write_vmi(s, key, &vmi, write).await;
}

/// The reason of the VMI's `Synchronized` condition as last written.
fn old_reason(vmi: &VirtualMachineInstance) -> Option<&str> {
    vmi.status
        .as_ref()?
        .condition(&api::status::VirtualMachineInstanceConditionType::Synchronized)?
        .reason
        .as_deref()
}

/// KubeVirt's `handleBackendStorage` and `IsPVCReady`, before the launcher pod: the VMI's
/// backend-storage claim from the cache, made if there is none. `Ok(None)`: a claim just made
/// that the cache has not shown yet. `Err`: the reason and message that hold the pod back.
async fn backend_storage(
    s: &Shared,
    key: &str,
    vmi: &VirtualMachineInstance,
    cfg: &ClusterConfig,
) -> Result<Option<PersistentVolumeClaim>, (&'static str, String)> {
    use crate::backendstorage::{FAILED_CREATE, FAILED_PROBE};
    if !s.pvc_exp.satisfied(key) {
        return Ok(None);
    }
    let claims = s.pvcs.state();
    let found = crate::backendstorage::claim_for(vmi, claims.iter().map(AsRef::as_ref)).cloned();
    let bound = found
        .as_ref()
        .and_then(|c| c.status.as_ref()?.phase.as_deref())
        == Some("Bound");
    // No cache of classes: they are read only while such a VMI waits for its pod.
    let classes = if bound {
        Vec::new()
    } else {
        let reason = if found.is_some() {
            FAILED_PROBE
        } else {
            FAILED_CREATE
        };
        super::storage_classes(s).await.map_err(|e| (reason, e))?
    };
    let Some(claim) = found else {
        let configured = cfg.vm_state_storage_class.as_deref();
        let class = crate::backendstorage::storage_class(configured, &classes)
            .map_err(|e| (FAILED_CREATE, e))?;
        let claim = crate::backendstorage::new_claim(vmi, class, configured.is_some());
        let api: Api<PersistentVolumeClaim> =
            Api::namespaced(s.client.clone(), &vmi.namespace().unwrap_or_default());
        s.pvc_exp.expect_creations(key, 1);
        return match api.create(&PostParams::default(), &claim).await {
            Ok(_) => Ok(None),
            Err(e) => {
                s.pvc_exp.creation_observed(key);
                Err((FAILED_CREATE, e.to_string()))
            }
        };
    };
    crate::backendstorage::ready(&claim, &classes)?;
    Ok(Some(claim))
}

/// The launcher pod whose hotplug volumes are looked after: the VMI runs in it, it is not
/// going away, and no migration is moving the VMI (a hotplugged VMI is not live-migratable,
/// but one may have started before the volume was added).
fn hotplug_launcher<'a>(
    vmi: &VirtualMachineInstance,
    status: &VirtualMachineInstanceStatus,
    pods: &'a [Pod],
) -> Option<&'a Pod> {
    let running = status.phase == Some(api::VirtualMachineInstancePhase::Running);
    let migrating = status
        .migration_state
        .as_ref()
        .is_some_and(|m| m.completed != Some(true) && m.failed != Some(true));
    let pod = vmi::current_pod(vmi, pods)?;
    (running && !migrating && pod.metadata.deletion_timestamp.is_none()).then_some(pod)
}

/// The launcher pod of a VMI handed over to its node and not running yet.
fn handed_over_launcher<'a>(
    vmi: &VirtualMachineInstance,
    status: &VirtualMachineInstanceStatus,
    pods: &'a [Pod],
) -> Option<&'a Pod> {
    let pod = vmi::current_pod(vmi, pods)?;
    (status.phase == Some(api::VirtualMachineInstancePhase::Scheduled)
        && pod.metadata.deletion_timestamp.is_none())
    .then_some(pod)
}

/// Creates and deletes the attachment pods of `launcher` as `hotplug::plan_attachments`
/// decides, and returns the VMI's new `volumeStatus` (with its events recorded).
async fn sync_hotplug(
    s: &Shared,
    key: &str,
    vmi: &VirtualMachineInstance,
    launcher: &Pod,
    claim: &(dyn Fn(&str) -> Option<PersistentVolumeClaim> + Sync),
) -> Vec<api::status::VolumeStatus> {
    let attachments: Vec<Pod> = s
        .pods
        .by_index(cache::ATTACHMENT_BY_VMI.name, key)
        .iter()
        .filter(|p| hotplug::is_attachment_pod_of(p, launcher))
        .map(|p| (**p).clone())
        .collect();
    let attachments: Vec<&Pod> = attachments.iter().collect();
    let hot = hotplug::hotplug_volumes(vmi, launcher);
    let ready: Vec<&api::vmi::Volume> = hot
        .into_iter()
        .filter(|v| hotplug::claim_ready(api::hotplug::claim_name(v).and_then(claim).as_ref()))
        .collect();
    let plan = hotplug::plan_attachments(vmi, &attachments, &ready);
    let pods_api: Api<Pod> =
        Api::namespaced(s.client.clone(), &vmi.namespace().unwrap_or_default());
    if !plan.create.is_empty() {
        let block = hotplug::block_claims(&ready, claim);
        let pod = hotplug::render_attachment_pod(
            vmi,
            launcher,
            &ready,
            &block,
            &s.opts.template.launcher_image,
        );
        s.pod_exp.expect_creations(key, 1);
        if let Err(e) = pods_api.create(&PostParams::default(), &pod).await {
            s.pod_exp.creation_observed(key);
            event(
                s,
                vmi,
                true,
                events::FAILED_CREATE_POD,
                format!("Error creating attachment pod: {e}"),
            )
            .await;
            retry_later(&s.vmi_q, key, "creating an attachment pod", &e);
        }
    }
    if !plan.delete.is_empty() {
        // KubeVirt deletes attachment pods at once: they only hold mounts.
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        let deletion = PodDeletion {
            params: &now,
            deleted: &|n| format!("Deleted attachment pod {n}"),
            failed: &|n, _| format!("Failed to delete attachment pod {n}"),
            doing: "deleting an attachment pod",
        };
        delete_pods(s, key, vmi, &pods_api, &plan.delete, &deletion).await;
    }
    let (status, volume_events) = hotplug::volume_status(vmi, launcher, &attachments, claim);
    for (reason, message) in volume_events {
        event(s, vmi, false, reason, message).await;
    }
    status
}

/// Creates or deletes launcher pods as `vmi::sync` decided.
async fn act_on_pods(
    s: &Shared,
    key: &str,
    vmi: &VirtualMachineInstance,
    defaulted: &VirtualMachineInstance,
    cfg: &ClusterConfig,
    action: PodAction,
    pods_api: &Api<Pod>,
) {
    match action {
        PodAction::None => {}
        PodAction::Create => match render_launcher_pod(
            defaulted,
            &s.opts.template,
            cfg,
            &super::claims_in(s, &vmi.namespace().unwrap_or_default()),
        ) {
            Err(e) => {
                event(s, vmi, true, events::FAILED_CREATE_POD, e.to_string()).await;
            }
            Ok(pod) => {
                s.pod_exp.expect_creations(key, 1);
                match pods_api.create(&PostParams::default(), &pod).await {
                    Ok(p) => {
                        event(
                            s,
                            vmi,
                            false,
                            events::SUCCESSFUL_CREATE_POD,
                            format!("Created virtual machine pod {}", p.name_any()),
                        )
                        .await;
                    }
                    Err(e) => {
                        s.pod_exp.creation_observed(key);
                        event(
                            s,
                            vmi,
                            true,
                            events::FAILED_CREATE_POD,
                            format!("Error creating pod: {e}"),
                        )
                        .await;
                        retry_later(&s.vmi_q, key, "creating the launcher pod", &e);
                    }
                }
            }
        },
        PodAction::Delete(names) => {
            let deletion = PodDeletion {
                params: &DeleteParams::default(),
                deleted: &|n| format!("Deleted virtual machine pod {n}"),
                failed: &|n, e| format!("Error deleting pod {n}: {e}"),
                doing: "deleting a launcher pod",
            };
            delete_pods(s, key, vmi, pods_api, &names, &deletion).await;
        }
    }
}

/// How [`delete_pods`] deletes and what its Events and retries say.
struct PodDeletion<'a> {
    params: &'a DeleteParams,
    deleted: &'a (dyn Fn(&str) -> String + Sync),
    failed: &'a (dyn Fn(&str, &kube::Error) -> String + Sync),
    doing: &'a str,
}

/// Deletes the VMI's pods `names` (launcher or attachment pods) under its pod expectations,
/// with an Event per pod; a failure is retried later.
async fn delete_pods(
    s: &Shared,
    key: &str,
    vmi: &VirtualMachineInstance,
    pods_api: &Api<Pod>,
    names: &[String],
    how: &PodDeletion<'_>,
) {
    let ns = vmi.namespace();
    let keys: Vec<String> = names.iter().map(|n| key_of(ns.as_deref(), n)).collect();
    s.pod_exp.expect_deletions(key, &keys);
    for (n, k) in names.iter().zip(&keys) {
        match pods_api.delete(n, how.params).await {
            Ok(_) => {
                event(
                    s,
                    vmi,
                    false,
                    events::SUCCESSFUL_DELETE_POD,
                    (how.deleted)(n),
                )
                .await;
            }
            Err(e) => {
                s.pod_exp.deletion_observed(key, k);
                event(s, vmi, true, events::FAILED_DELETE_POD, (how.failed)(n, &e)).await;
                retry_later(&s.vmi_q, key, how.doing, &e);
            }
        }
    }
}

/// What [`write_vmi`] writes.
struct VmiWrite<'a> {
    old_status: &'a VirtualMachineInstanceStatus,
    status: &'a VirtualMachineInstanceStatus,
    node_label: Option<String>,
    release_finalizer: bool,
}

/// Writes the status, the node label and the finalizers in one patch, if any changed.
async fn write_vmi(s: &Shared, key: &str, vmi: &VirtualMachineInstance, w: VmiWrite<'_>) {
    // KubeVirt's VMI CRD has no status subresource: the status is part of the object, so the
    // node label handing the VMI to its node goes in the same patch.
    let mut patch = serde_json::Map::new();
    let mut metadata = serde_json::Map::new();
    if w.status != w.old_status {
        patch.insert("status".into(), status_patch(w.old_status, w.status));
    }
    if let Some(node) = w.node_label {
        metadata.insert("labels".into(), json!({api::labels::NODE_NAME: node}));
    }
    // Without a live VM owning it nothing else would ever release the VM controller's
    // finalizer (KubeVirt's `hasOwnerVM`); KubeVirt waits for the VMI to be final, but with
    // no VM to record the final status there is nothing to wait for.
    if let Some(next) = finalizers::vmi(vmi, w.release_finalizer, !owner_vm_live(s, vmi)) {
        metadata.insert("finalizers".into(), json!(next));
    }
    if !metadata.is_empty() {
        patch.insert("metadata".into(), metadata.into());
    }
    if patch.is_empty()
        || s.vmi_writes
            .cache_behind(key, vmi.metadata.resource_version.as_deref())
    {
        return;
    }
    // The resourceVersion makes this a compare-and-swap: the whole status computed from
    // this (possibly stale) copy must not overwrite what another writer set since, such
    // as the node controller failing the VMI, nor drop a finalizer someone added since;
    // on a conflict the next sync sees both.
    let metadata = patch.entry("metadata").or_insert_with(|| json!({}));
    metadata["resourceVersion"] = json!(vmi.metadata.resource_version);
    let vmi_api: Api<VirtualMachineInstance> =
        Api::namespaced(s.client.clone(), &vmi.namespace().unwrap_or_default());
    match vmi_api
        .patch(
            &vmi.name_any(),
            &PatchParams::default(),
            &Patch::Merge(serde_json::Value::Object(patch)),
        )
        .await
    {
        Ok(_) => s
            .vmi_writes
            .wrote(key, vmi.metadata.resource_version.as_deref()),
        Err(e) => retry_later(&s.vmi_q, key, "updating the VMI status", &e),
    }
}

/// The VMI's controller is a VM that is still in the cache, with the uid the reference names.
fn owner_vm_live(s: &Shared, vmi: &VirtualMachineInstance) -> bool {
    let Some(owner) = controller_ref(vmi).filter(|r| r.kind == "VirtualMachine") else {
        return false;
    };
    let ns = vmi.namespace().unwrap_or_default();
    s.vms
        .get(&ObjectRef::new(&owner.name).within(&ns))
        .is_some_and(|vm| vm.metadata.uid.as_deref() == Some(owner.uid.as_str()))
}
