//! The migration controller's shell: the migration watch and its index, the sync that feeds
//! `migration::sync` from the caches and carries out its decision (target pod, VMI handoff
//! patch, migration status, events, finalizer), and the garbage collection of finished
//! migrations.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use api::migration::{VirtualMachineInstanceMigration, VirtualMachineInstanceMigrationPhase};
use api::{VirtualMachineInstance, labels};
use informer::{Seen, cas_status_patch, key_of, obj_key, split_key, status_patch};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use serde_json::json;
use workqueue::Queue;
use workqueue::expectations::{EXPECTATION_TTL, UidTrackingExpectations};

use super::{Shared, cluster_config, event, lock, retry_later, set_finalizers};
use crate::migration::{
    self, ClaimAction, EventOn, Input, MigrationSync, TargetLabel, TargetPodAction, VmiChange,
};
use crate::template::render_launcher_pod;
use crate::{cache, events};

/// Which migrations exist for each VMI, and each migration's key by uid, kept by the
/// migration watch: a VMI or pod change queues its VMI's migrations without a walk over all.
#[derive(Debug, Default)]
pub(super) struct MigrationIndex {
    by_vmi: HashMap<String, BTreeSet<String>>,
    vmi_of: HashMap<String, String>,
    by_uid: HashMap<String, String>,
}

impl MigrationIndex {
    fn set(&mut self, key: &str, vmi_key: &str, uid: Option<&str>) {
        self.remove(key);
        self.by_vmi
            .entry(vmi_key.to_owned())
            .or_default()
            .insert(key.to_owned());
        self.vmi_of.insert(key.to_owned(), vmi_key.to_owned());
        if let Some(uid) = uid {
            self.by_uid.insert(uid.to_owned(), key.to_owned());
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(v) = self.vmi_of.remove(key)
            && let Some(set) = self.by_vmi.get_mut(&v)
        {
            set.remove(key);
            if set.is_empty() {
                self.by_vmi.remove(&v);
            }
        }
        self.by_uid.retain(|_, k| k != key);
    }

    /// The migrations of the VMI with this key.
    pub(super) fn of_vmi(&self, vmi_key: &str) -> Vec<String> {
        self.by_vmi
            .get(vmi_key)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The key of the migration with this uid.
    pub(super) fn by_uid(&self, uid: &str) -> Option<String> {
        self.by_uid.get(uid).cloned()
    }
}

fn vmi_key_of(m: &VirtualMachineInstanceMigration) -> String {
    key_of(
        m.namespace().as_deref(),
        m.spec.vmi_name.as_deref().unwrap_or_default(),
    )
}

/// The migration watch: indexed by VMI and uid, then queued; an evacuation migration's node
/// is queued for the evacuation controller, its creation observed.
pub(super) fn on_migration(
    q: Arc<Queue>,
    index: Arc<Mutex<MigrationIndex>>,
    evac_q: Arc<Queue>,
    evac_exp: Arc<UidTrackingExpectations>,
) -> impl Fn(Seen<'_, VirtualMachineInstanceMigration>) + Send + 'static {
    move |s| {
        let (o, added, deleted) = match s {
            Seen::Added(o) => (o, true, false),
            Seen::Changed(o) => (o, false, false),
            Seen::Deleted(o) => (o, false, true),
        };
        let key = obj_key(o);
        {
            let mut index = lock(&index);
            if deleted {
                index.remove(&key);
            } else {
                index.set(&key, &vmi_key_of(o), o.metadata.uid.as_deref());
            }
        }
        // After the index: a sync the observation lets through sees the migration.
        super::evacuation::migration_changed(&evac_q, &evac_exp, o, added);
        q.add(&key);
    }
}

/// A VMI changed: its migrations are queued.
pub(super) fn vmi_changed(q: &Queue, index: &Mutex<MigrationIndex>, vmi_key: &str) {
    for k in lock(index).of_vmi(vmi_key) {
        q.add(&k);
    }
}

/// A launcher pod changed: a target pod's migration has its creation observed; the
/// migrations of the pod's VMI are queued.
pub(super) fn pod_changed(
    q: &Queue,
    index: &Mutex<MigrationIndex>,
    exp: &UidTrackingExpectations,
    pod: &Pod,
    added: bool,
    vmi_key: Option<&str>,
) {
    let job = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::MIGRATION_JOB_UID));
    let index = lock(index);
    if let Some(key) = job.and_then(|uid| index.by_uid(uid)) {
        if added {
            exp.creation_observed(&key);
        }
        q.add(&key);
    }
    if let Some(v) = vmi_key {
        for k in index.of_vmi(v) {
            q.add(&k);
        }
    }
}

fn has_target_pod(s: &Shared, m: &VirtualMachineInstanceMigration) -> bool {
    let vmi_key = vmi_key_of(m);
    let uid = m.metadata.uid.as_deref().unwrap_or_default();
    s.pods
        .by_index(cache::POD_BY_VMI.name, &vmi_key)
        .iter()
        .any(|p| migration::is_target_pod_of(p, uid))
}

/// What the limits count: other unfinished migrations with a target pod (or one on its way)
/// or past Pending, and of those the ones leaving `node`; and whether the migration `uid`
/// names is alive.
fn counts(
    s: &Shared,
    me: &VirtualMachineInstanceMigration,
    node: Option<&str>,
    state_uid: Option<&str>,
) -> (usize, usize, bool) {
    let (mut cluster, mut outbound, mut owner_live) = (0, 0, false);
    for other in s.vmims.state() {
        if other.metadata.uid.is_some() && other.metadata.uid == state_uid.map(str::to_owned) {
            owner_live = !migration::is_final(&other);
        }
        if other.metadata.uid == me.metadata.uid || migration::is_final(&other) {
            continue;
        }
        let pending_create = !s.mig_pod_exp.satisfied(&obj_key(other.as_ref()));
        let target = pending_create || has_target_pod(s, &other);
        if !migration::counts_as_running(&other, target) {
            continue;
        }
        cluster += 1;
        let other_vmi = vmi_key_of(&other);
        let (ons, oname) = split_key(&other_vmi);
        let other_node = s
            .vmis
            .get(&ObjectRef::new(oname).within(ons))
            .and_then(|v| v.status.as_ref().and_then(|st| st.node_name.clone()));
        if node.is_some() && other_node.as_deref() == node {
            outbound += 1;
        }
    }
    (cluster, outbound, owner_live)
}

pub(super) async fn sync_migration(s: &Shared, key: &str) {
    let (ns, name) = split_key(key);
    let Some(m) = s.vmims.get(&ObjectRef::new(name).within(ns)) else {
        s.mig_pod_exp.delete(key);
        return;
    };
    if !s.mig_pod_exp.satisfied(key) {
        s.mig_q.add_after(key, EXPECTATION_TTL);
        return;
    }
    let vmi_key = vmi_key_of(&m);
    let vmi_name = m.spec.vmi_name.clone().unwrap_or_default();
    let vmi = s.vmis.get(&ObjectRef::new(&vmi_name).within(ns));
    let pods = super::launcher_pods(s, &vmi_key);
    let cfg = cluster_config(s);
    // One decision to start a migration at a time: the limits count the others' target pods.
    let start = s.mig_start_lock.lock().await;
    let node = vmi
        .as_ref()
        .and_then(|v| v.status.as_ref())
        .and_then(|st| st.node_name.clone());
    let state_uid = vmi
        .as_deref()
        .and_then(migration::vmi_state)
        .and_then(|st| st.migration_uid.clone());
    let (running_in_cluster, outbound_from_node, state_owner_live) =
        counts(s, &m, node.as_deref(), state_uid.as_deref());
    let policies = s.migration_policies.state();
    let namespace_labels = s
        .namespaces
        .get(&ObjectRef::new(ns))
        .and_then(|n| n.metadata.labels.clone())
        .unwrap_or_default();
    let policy = vmi.as_deref().and_then(|v| {
        api::migrationpolicy::match_policy(
            policies.iter().map(AsRef::as_ref),
            v.metadata.labels.as_ref(),
            &namespace_labels,
        )
    });
    let target_claim = vmi
        .as_deref()
        .filter(|v| api::backendstorage::needed(v))
        .and_then(|_| {
            crate::backendstorage::target_claim_for(
                Some(ns),
                name,
                s.pvcs.state().iter().map(AsRef::as_ref),
            )
            .map(kube::ResourceExt::name_any)
        });
    let mut out = migration::sync(&Input {
        migration: &m,
        vmi: vmi.as_deref(),
        pods: &pods,
        config: &cfg.migrations,
        policy,
        running_in_cluster,
        outbound_from_node,
        state_owner_live,
        target_claim: target_claim.as_deref(),
        now: Timestamp::now(),
    });
    if out.pod == TargetPodAction::Create
        && let Some(vmi) = vmi.as_deref()
    {
        Box::pin(create_target_pod(s, key, &m, vmi, &cfg, &mut out.status)).await;
    }
    drop(start);
    Box::pin(carry_out(s, key, &m, vmi.as_deref(), out)).await;
}

/// Creates the target pod, and before it the target's backend-storage claim when the VMI
/// needs one and `status` names none yet (the name the API gives it goes into `status`).
async fn create_target_pod(
    s: &Shared,
    key: &str,
    m: &VirtualMachineInstanceMigration,
    vmi: &VirtualMachineInstance,
    cfg: &api::ClusterConfig,
    status: &mut api::migration::VirtualMachineInstanceMigrationStatus,
) {
    let mut defaulted = vmi.clone();
    if api::backendstorage::needed(vmi) {
        let state = status.migration_state.get_or_insert_default();
        let target = match state.target_persistent_state_pvc_name.clone() {
            Some(t) => t,
            None => match create_target_claim(s, m, vmi, cfg).await {
                Ok(name) => {
                    state.target_persistent_state_pvc_name = Some(name.clone());
                    name
                }
                Err(e) => {
                    event(s, m, true, crate::backendstorage::FAILED_CREATE, e).await;
                    s.mig_q.add_after(key, migration::LIMIT_RETRY);
                    return;
                }
            },
        };
        // The target pod mounts the target's claim as the VMI's own.
        api::backendstorage::set_volume_status(
            defaulted.status.get_or_insert_default(),
            &target,
            &[],
        );
    }
    let rendered = api::defaults::apply(&mut defaulted.spec, cfg)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            let ns = vmi.namespace().unwrap_or_default();
            render_launcher_pod(&defaulted, &s.opts.template, cfg, &super::claims_in(s, &ns))
                .map_err(|e| e.to_string())
        });
    let pod = match rendered {
        Ok(p) => migration::make_target_pod(p, m, vmi),
        Err(e) => {
            event(s, m, true, events::FAILED_CREATE_POD, e).await;
            return;
        }
    };
    let pods_api: Api<Pod> =
        Api::namespaced(s.client.clone(), &vmi.namespace().unwrap_or_default());
    s.mig_pod_exp.expect_creations(key, 1);
    match pods_api.create(&PostParams::default(), &pod).await {
        Ok(p) => {
            event(
                s,
                m,
                false,
                events::SUCCESSFUL_CREATE_POD,
                format!("Created migration target pod {}", p.name_any()),
            )
            .await;
        }
        Err(e) => {
            s.mig_pod_exp.creation_observed(key);
            event(
                s,
                m,
                true,
                events::FAILED_CREATE_POD,
                format!("Error creating pod: {e}"),
            )
            .await;
            retry_later(&s.mig_q, key, "creating the migration target pod", &e);
        }
    }
}

/// KubeVirt's `CreatePVCForMigrationTarget`: a claim like the VMI's, on the class the KubeVirt
/// CR names or else the default one, labelled with the migration's name. Returns its name.
async fn create_target_claim(
    s: &Shared,
    m: &VirtualMachineInstanceMigration,
    vmi: &VirtualMachineInstance,
    cfg: &api::ClusterConfig,
) -> Result<String, String> {
    let configured = cfg.vm_state_storage_class.as_deref();
    let classes = match configured {
        Some(_) => Vec::new(),
        None => super::storage_classes(s).await?,
    };
    let class = crate::backendstorage::storage_class(configured, &classes)?;
    let claim =
        crate::backendstorage::new_target_claim(vmi, class, configured.is_some(), &m.name_any());
    Api::<PersistentVolumeClaim>::namespaced(s.client.clone(), &vmi.namespace().unwrap_or_default())
        .create(&PostParams::default(), &claim)
        .await
        .map(|c| c.name_any())
        .map_err(|e| format!("creating the target's backend-storage PVC: {e}"))
}

/// KubeVirt's `MigrationHandoff` and `MigrationAbort`: the target's claim labelled as the VMI's
/// and the source's deleted, or the target's deleted. Both may be repeated.
async fn act_on_claims(
    s: &Shared,
    m: &VirtualMachineInstanceMigration,
    action: &ClaimAction,
) -> Result<(), kube::Error> {
    let api: Api<PersistentVolumeClaim> =
        Api::namespaced(s.client.clone(), &m.namespace().unwrap_or_default());
    let delete = |name: String| {
        let api = api.clone();
        async move {
            match api.delete(&name, &DeleteParams::default()).await {
                Err(kube::Error::Api(st)) if st.code == 404 => Ok(()),
                other => other.map(drop),
            }
        }
    };
    match action {
        ClaimAction::None => Ok(()),
        ClaimAction::HandOver { source, target } => {
            let vmi = m.spec.vmi_name.as_deref().unwrap_or_default();
            let patch = crate::backendstorage::handed_over(vmi);
            api.patch(target, &PatchParams::default(), &Patch::Merge(patch))
                .await?;
            delete(source.clone()).await
        }
        ClaimAction::Delete(target) => delete(target.clone()).await,
    }
}

/// Deletes the target pod, patches the VMI, writes the status, publishes the events, releases
/// the finalizer and collects old migrations, as `out` says.
async fn carry_out(
    s: &Shared,
    key: &str,
    m: &VirtualMachineInstanceMigration,
    vmi: Option<&VirtualMachineInstance>,
    out: MigrationSync,
) {
    let ns = m.namespace().unwrap_or_default();
    if let TargetPodAction::Delete { name, message } = &out.pod {
        let pods_api: Api<Pod> = Api::namespaced(s.client.clone(), &ns);
        match pods_api.delete(name, &DeleteParams::default()).await {
            Ok(_) => event(s, m, false, events::SUCCESSFUL_DELETE_POD, message.clone()).await,
            Err(e) => {
                event(
                    s,
                    m,
                    true,
                    events::FAILED_DELETE_POD,
                    format!("Error deleting pod {name}: {e}"),
                )
                .await;
                retry_later(&s.mig_q, key, "deleting the migration target pod", &e);
            }
        }
    }
    if let (Some(change), Some(vmi)) = (out.vmi.as_ref(), vmi) {
        patch_vmi(s, key, m, vmi, change).await;
    }
    // Before the status: a migration is not Succeeded (or its finalizer released) until the
    // claims are what it says.
    if let Err(e) = act_on_claims(s, m, &out.claims).await {
        retry_later(&s.mig_q, key, "handing over the backend-storage PVC", &e);
        return;
    }

    let old = m.status.clone().unwrap_or_default();
    let mut current = m.clone();
    if out.status != old {
        let api: Api<VirtualMachineInstanceMigration> = Api::namespaced(s.client.clone(), &ns);
        let patch = cas_status_patch(m.metadata.resource_version.as_deref(), &old, &out.status);
        match api
            .patch_status(&m.name_any(), &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(written) => current = written,
            Err(e) => {
                retry_later(&s.mig_q, key, "updating the migration status", &e);
                return;
            }
        }
    }
    for e in &out.events {
        match e.on {
            EventOn::Migration => event(s, m, e.warning, e.reason, e.message.clone()).await,
            EventOn::Vmi => {
                if let Some(v) = vmi {
                    event(s, v, e.warning, e.reason, e.message.clone()).await;
                }
            }
        }
    }
    if out.release_finalizer {
        let api: Api<VirtualMachineInstanceMigration> = Api::namespaced(s.client.clone(), &ns);
        let next: Vec<String> = current
            .metadata
            .finalizers
            .iter()
            .flatten()
            .filter(|f| *f != labels::MIGRATION_FINALIZER)
            .cloned()
            .collect();
        if let Err(e) = set_finalizers(&api, &current, &next).await {
            retry_later(&s.mig_q, key, "removing the migration finalizer", &e);
        }
    }
    if let Some(d) = out.requeue_after {
        s.mig_q.add_after(key, d);
    }
    if out.status.phase.as_ref().is_some_and(|p| {
        matches!(
            p,
            VirtualMachineInstanceMigrationPhase::Succeeded
                | VirtualMachineInstanceMigrationPhase::Failed
        )
    }) {
        collect_garbage(s, m).await;
    }
}

/// The VMI write: `status.migrationState` (and `migrationMethod`) and the target node label,
/// one compare-and-swap merge patch.
async fn patch_vmi(
    s: &Shared,
    key: &str,
    m: &VirtualMachineInstanceMigration,
    vmi: &VirtualMachineInstance,
    change: &VmiChange,
) {
    let old = vmi.status.clone().unwrap_or_default();
    let mut new = old.clone();
    new.migration_state = Some(change.migration_state.clone());
    if let Some(method) = &change.migration_method {
        new.migration_method = Some(method.clone());
    }
    let mut metadata = serde_json::Map::new();
    metadata.insert(
        "resourceVersion".into(),
        json!(vmi.metadata.resource_version),
    );
    match &change.target_label {
        TargetLabel::Keep => {}
        TargetLabel::Set(node) => {
            metadata.insert(
                "labels".into(),
                json!({labels::MIGRATION_TARGET_NODE_NAME: node}),
            );
        }
        TargetLabel::Remove => {
            metadata.insert(
                "labels".into(),
                json!({labels::MIGRATION_TARGET_NODE_NAME: null}),
            );
        }
    }
    let patch = json!({"metadata": metadata, "status": status_patch(&old, &new)});
    let api: Api<VirtualMachineInstance> =
        Api::namespaced(s.client.clone(), &vmi.namespace().unwrap_or_default());
    match api
        .patch(
            &vmi.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
    {
        Ok(_) => {
            if let Some(e) = &change.on_success {
                match e.on {
                    EventOn::Migration => event(s, m, e.warning, e.reason, e.message.clone()).await,
                    EventOn::Vmi => event(s, vmi, e.warning, e.reason, e.message.clone()).await,
                }
            }
        }
        Err(e) => {
            // A conflict is only a stale cache; anything else is worth the user's attention.
            if !matches!(&e, kube::Error::Api(st) if st.code == 409) {
                event(
                    s,
                    m,
                    true,
                    change.failure_reason,
                    format!("failed to set MigrationState in VMI status: {e}"),
                )
                .await;
            }
            retry_later(&s.mig_q, key, "patching the VMI's migration state", &e);
        }
    }
}

/// Deletes the finished migrations of `m`'s VMI beyond the newest few.
async fn collect_garbage(s: &Shared, m: &VirtualMachineInstanceMigration) {
    let vmi_key = vmi_key_of(m);
    let keys = lock(&s.mig_index).of_vmi(&vmi_key);
    let all: Vec<_> = keys
        .iter()
        .filter_map(|k| {
            let (ns, name) = split_key(k);
            s.vmims.get(&ObjectRef::new(name).within(ns))
        })
        .collect();
    let refs: Vec<&VirtualMachineInstanceMigration> = all.iter().map(AsRef::as_ref).collect();
    let ns = m.namespace().unwrap_or_default();
    let api: Api<VirtualMachineInstanceMigration> = Api::namespaced(s.client.clone(), &ns);
    for name in migration::garbage(&refs) {
        if let Err(e) = api.delete(&name, &DeleteParams::default()).await {
            tracing::debug!(migration = %name, error = %e, "garbage-collecting a finished migration");
        }
    }
}
