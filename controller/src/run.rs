//! The thin I/O shells: reflectors feeding work queues, a few workers per controller (never
//! two on one key) calling the pure decisions, writes through the API, Events, leader election.
//!
//! kube-runtime's `Controller` is not used: expectations must be observed by the very cache
//! the reconcile reads (KubeVirt's informer handlers), and wiring our own reflectors into a
//! `Controller` needs kube's unstable stream features. A reflector per kind and a client-go
//! style work queue per controller is all the machinery this needs.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use api::validation::FieldError;
use api::{
    ClusterConfig, KubeVirt, VirtualMachine, VirtualMachineInstance,
    VirtualMachineInstanceReplicaSet,
};
use informer::{
    Seen, cas_status_patch, controller_owner, controller_ref, key_of, obj_key, reflect, split_key,
    status_patch,
};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt as _};
use serde_json::json;
use tokio::task::JoinSet;

use crate::cache::{self, OwnerIndex};
use crate::expectations::{EXPECTATION_TTL, UidTrackingExpectations};
use crate::finalizers;
use crate::metrics::{Health, QueueStat, Snapshot};
use crate::template::{TemplateConfig, render_launcher_pod};
use crate::vm::{StatusInputs, VmAction};
use crate::vmi::PodAction;
use crate::{events, node, replicaset, vm, vmi};
use workqueue::Queue;

/// Why the controllers stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Leader election failed.
    #[error("leader election on Lease {namespace}/{name}")]
    Lease {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// Cause.
        source: kube_lease_manager::LeaseManagerError,
    },
    /// Another replica took the lease.
    #[error("lost the lease {0}; another replica leads now")]
    LostLease(String),
    /// A reflector's writer went away before its cache filled.
    #[error("the {0} cache never became ready")]
    CacheNotReady(&'static str),
}

/// What the controllers need to know.
#[derive(Debug, Clone)]
pub struct Options {
    /// How launcher pods are rendered.
    pub template: TemplateConfig,
    /// A handler heartbeat older than this fails the node.
    pub heartbeat_timeout: Duration,
    /// How often nodes are checked.
    pub node_check_interval: Duration,
    /// Namespace of the leader-election Lease.
    pub lease_namespace: String,
    /// Name of the Lease (KubeVirt: `virt-controller`).
    pub lease_name: String,
    /// This replica's identity in the Lease.
    pub identity: String,
    /// Leader status and the controllers' state for `/leader` and `/metrics`.
    pub health: Arc<Health>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            template: TemplateConfig::default(),
            heartbeat_timeout: node::DEFAULT_HEARTBEAT_TIMEOUT,
            node_check_interval: Duration::from_secs(60),
            lease_namespace: "kubevirt".into(),
            lease_name: "virt-controller".into(),
            identity: uuid::Uuid::new_v4().to_string(),
            health: Arc::default(),
        }
    }
}

/// Lease timing as KubeVirt's: 15 s lease; the holder renews 5 s before expiry (10 s renew
/// deadline). kube-lease-manager re-tries a held lease on its own schedule rather than
/// KubeVirt's 2 s retry period; followers take over within one lease duration.
pub const LEASE_DURATION_SECS: u64 = 15;
/// Seconds before expiry the holder renews.
pub const LEASE_GRACE_SECS: u64 = 5;

/// Workers per controller, as KubeVirt's defaults (`--vmi-controller-threads` ...).
const VMI_WORKERS: usize = 10;
const VM_WORKERS: usize = 3;
const RS_WORKERS: usize = 3;
const NODE_WORKERS: usize = 3;
/// How soon a write refused by its compare-and-swap is retried.
const CONFLICT_RETRY: Duration = Duration::from_millis(200);

fn queue_stat(name: &'static str, q: &Queue) -> QueueStat {
    QueueStat {
        name,
        depth: q.depth(),
        adds: q.adds(),
    }
}

/// A lock whose data stays meaningful after a panic elsewhere (plain maps and counters).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The trim of every cached kind but pods: metadata the controllers never read.
fn trim_meta<K: Resource>(o: &mut K) {
    cache::trim_meta(o.meta_mut());
}

struct Shared {
    client: Client,
    opts: Options,
    recorder: Recorder,
    vms: Store<VirtualMachine>,
    vmis: Store<VirtualMachineInstance>,
    pods: Store<Pod>,
    pod_index: Arc<Mutex<OwnerIndex>>,
    replicasets: Store<VirtualMachineInstanceReplicaSet>,
    nodes: Store<Node>,
    kubevirts: Store<KubeVirt>,
    pod_exp: Arc<UidTrackingExpectations>,
    vm_exp: Arc<UidTrackingExpectations>,
    rs_exp: Arc<UidTrackingExpectations>,
    vm_q: Arc<Queue>,
    vmi_q: Arc<Queue>,
    rs_q: Arc<Queue>,
    node_q: Arc<Queue>,
}

/// Runs the VM, VMI, ReplicaSet and Node controllers until the task is dropped.
pub async fn run_controllers(client: Client, opts: Options) -> Result<(), RunError> {
    let mut tasks = JoinSet::new();
    let pod_exp = Arc::new(UidTrackingExpectations::default());
    let vm_exp = Arc::new(UidTrackingExpectations::default());
    let rs_exp = Arc::new(UidTrackingExpectations::default());
    let (vm_q, vmi_q, rs_q, node_q) = (
        Arc::new(Queue::default()),
        Arc::new(Queue::default()),
        Arc::new(Queue::default()),
        Arc::new(Queue::default()),
    );
    let wc = watcher::Config::default;

    let (q, q_vmi) = (vm_q.clone(), vmi_q.clone());
    let vms = reflect(
        &mut tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        move |s| match s {
            Seen::Added(o) | Seen::Changed(o) => q.add(&obj_key(o)),
            Seen::Deleted(o) => {
                q.add(&obj_key(o));
                // Its instance (same name) may hold the VM controller's finalizer, which only
                // the VMI controller releases once the VM is gone.
                q_vmi.add(&obj_key(o));
            }
        },
    );

    let (q_vm, q_vmi, q_rs, e_vm, e_rs, vm_cache) = (
        vm_q.clone(),
        vmi_q.clone(),
        rs_q.clone(),
        vm_exp.clone(),
        rs_exp.clone(),
        vms.clone(),
    );
    let vmis = reflect(
        &mut tasks,
        Api::<VirtualMachineInstance>::all(client.clone()),
        wc(),
        trim_meta,
        move |s| {
            let (o, added, deleted) = match s {
                Seen::Added(o) => (o, true, false),
                Seen::Changed(o) => (o, false, false),
                Seen::Deleted(o) => (o, false, true),
            };
            let ns = o.namespace();
            let key = obj_key(o);
            q_vmi.add(&key);
            if let Some(vm) = controller_owner(o, "VirtualMachine") {
                let vm_key = key_of(ns.as_deref(), vm);
                if added {
                    e_vm.creation_observed(&vm_key);
                }
                if deleted {
                    e_vm.deletion_observed(&vm_key, &key);
                }
                q_vm.add(&vm_key);
            } else if vm_cache
                .get(&ObjectRef::new(&o.name_any()).within(ns.as_deref().unwrap_or_default()))
                .is_some()
            {
                // An orphan may be adopted by the VM of the same name (KubeVirt too queues only
                // the VMs an orphan matches).
                q_vm.add(&key);
            }
            if let Some(rs) = controller_owner(o, "VirtualMachineInstanceReplicaSet") {
                let rs_key = key_of(ns.as_deref(), rs);
                if added {
                    e_rs.creation_observed(&rs_key);
                }
                if deleted {
                    e_rs.deletion_observed(&rs_key, &key);
                }
                q_rs.add(&rs_key);
            }
        },
    );

    let (q_vmi, e_pod) = (vmi_q.clone(), pod_exp.clone());
    let pod_index: Arc<Mutex<OwnerIndex>> = Arc::default();
    let index = pod_index.clone();
    let pods = reflect(
        &mut tasks,
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().labels(&format!("{}=virt-launcher", api::labels::APP)),
        cache::trim_pod,
        move |s| {
            let (o, added, deleted) = match s {
                Seen::Added(o) => (o, true, false),
                Seen::Changed(o) => (o, false, false),
                Seen::Deleted(o) => (o, false, true),
            };
            let pod_key = obj_key(o);
            let owner = controller_owner(o, "VirtualMachineInstance");
            let vmi_key = owner.map(|owner| key_of(o.namespace().as_deref(), owner));
            // Indexed before the expectation is marked observed: a sync that finds its
            // expectation satisfied finds the pod too.
            {
                let mut index = lock(&index);
                if deleted {
                    index.remove(&pod_key);
                } else {
                    index.set(&pod_key, vmi_key.as_deref());
                }
            }
            let Some(vmi_key) = vmi_key else {
                return;
            };
            if added {
                e_pod.creation_observed(&vmi_key);
            }
            if deleted {
                e_pod.deletion_observed(&vmi_key, &pod_key);
            }
            q_vmi.add(&vmi_key);
        },
    );

    let q = rs_q.clone();
    let replicasets = reflect(
        &mut tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        move |s| match s {
            Seen::Added(o) | Seen::Changed(o) | Seen::Deleted(o) => q.add(&obj_key(o)),
        },
    );
    let q = node_q.clone();
    let nodes = reflect(
        &mut tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        move |s| match s {
            Seen::Added(o) | Seen::Changed(o) => q.add(&obj_key(o)),
            Seen::Deleted(_) => {}
        },
    );
    let kubevirts = reflect(
        &mut tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        |_| {},
    );

    for (name, ready) in [
        ("VirtualMachine", vms.wait_until_ready().await.is_ok()),
        (
            "VirtualMachineInstance",
            vmis.wait_until_ready().await.is_ok(),
        ),
        ("Pod", pods.wait_until_ready().await.is_ok()),
        (
            "VirtualMachineInstanceReplicaSet",
            replicasets.wait_until_ready().await.is_ok(),
        ),
        ("Node", nodes.wait_until_ready().await.is_ok()),
        ("KubeVirt", kubevirts.wait_until_ready().await.is_ok()),
    ] {
        if !ready {
            return Err(RunError::CacheNotReady(name));
        }
    }
    tracing::info!("caches synced; controllers running");

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "virt-controller".into(),
            instance: Some(opts.identity.clone()),
        },
    );
    let shared = Arc::new(Shared {
        client,
        opts,
        recorder,
        vms,
        vmis,
        pods,
        pod_index,
        replicasets,
        nodes,
        kubevirts,
        pod_exp,
        vm_exp,
        rs_exp,
        vm_q,
        vmi_q,
        rs_q,
        node_q,
    });

    let weak = Arc::downgrade(&shared);
    shared
        .opts
        .health
        .set_source(move || Weak::upgrade(&weak).map(|s| snapshot(&s)));

    for _ in 0..VMI_WORKERS {
        let s = shared.clone();
        tasks.spawn(async move {
            while let Some(key) = s.vmi_q.pop().await {
                Box::pin(sync_vmi(&s, &key)).await;
                s.vmi_q.done(&key);
            }
        });
    }
    for _ in 0..VM_WORKERS {
        let s = shared.clone();
        tasks.spawn(async move {
            while let Some(key) = s.vm_q.pop().await {
                Box::pin(sync_vm(&s, &key)).await;
                s.vm_q.done(&key);
            }
        });
    }
    for _ in 0..RS_WORKERS {
        let s = shared.clone();
        tasks.spawn(async move {
            while let Some(key) = s.rs_q.pop().await {
                Box::pin(sync_rs(&s, &key)).await;
                s.rs_q.done(&key);
            }
        });
    }
    for _ in 0..NODE_WORKERS {
        let s = shared.clone();
        tasks.spawn(async move {
            while let Some(key) = s.node_q.pop().await {
                sync_node(&s, &key).await;
                s.node_q.done(&key);
            }
        });
    }
    let s = shared;
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(s.opts.node_check_interval);
        loop {
            tick.tick().await;
            for n in s.nodes.state() {
                s.node_q.add(&n.name_any());
            }
        }
    });
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// The controllers' state for `/metrics`, KubeVirt's queue names.
fn snapshot(s: &Shared) -> Snapshot {
    let mut vmi_phases = std::collections::BTreeMap::new();
    for v in s.vmis.state() {
        let st = v.status.as_ref();
        let phase = st
            .and_then(|st| st.phase.as_ref())
            .map_or("", |p| p.as_str())
            .to_owned();
        let node = st.and_then(|st| st.node_name.clone()).unwrap_or_default();
        *vmi_phases.entry((phase, node)).or_insert(0) += 1;
    }
    Snapshot {
        vmi_phases,
        queues: vec![
            queue_stat("virt-controller-vm", &s.vm_q),
            queue_stat("virt-controller-vmi", &s.vmi_q),
            queue_stat("virt-controller-replicaset", &s.rs_q),
            queue_stat("virt-controller-node", &s.node_q),
        ],
    }
}

/// Waits for the `virt-controller` Lease, runs the controllers while holding it, and
/// returns [`RunError::LostLease`] when another replica takes over (KubeVirt exits then).
pub async fn run_with_leader_election(client: Client, opts: Options) -> Result<(), RunError> {
    let lease_err = |source| RunError::Lease {
        namespace: opts.lease_namespace.clone(),
        name: opts.lease_name.clone(),
        source,
    };
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), &opts.lease_name)
        .with_namespace(&opts.lease_namespace)
        .with_identity(&opts.identity)
        .with_duration(LEASE_DURATION_SECS)
        .with_grace(LEASE_GRACE_SECS)
        .build()
        .await
        .map_err(lease_err)?;
    let (mut leading, lease_task) = manager.watch().await;
    while !*leading.borrow_and_update() {
        if leading.changed().await.is_err() {
            return Err(RunError::LostLease(opts.lease_name.clone()));
        }
    }
    tracing::info!(identity = %opts.identity, "became leader");
    let name = opts.lease_name.clone();
    let health = opts.health.clone();
    health.set_leading(true);
    let result = tokio::select! {
        r = run_controllers(client, opts) => r,
        () = async {
            while leading.changed().await.is_ok() && *leading.borrow() {}
        } => Err(RunError::LostLease(name)),
    };
    health.set_leading(false);
    drop(leading);
    lease_task.abort();
    result
}

fn cluster_config(s: &Shared) -> ClusterConfig {
    s.kubevirts
        .state()
        .first()
        .map_or_else(ClusterConfig::default, |kv| {
            ClusterConfig::from_kubevirt(kv)
        })
}

async fn event<K: Resource<DynamicType = ()>>(
    s: &Shared,
    obj: &K,
    warning: bool,
    reason: &str,
    note: String,
) {
    let ev = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.into(),
        note: Some(note),
        action: reason.into(),
        secondary: None,
    };
    if let Err(e) = s.recorder.publish(&ev, &obj.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "publishing an event");
    }
}

fn retry_later(q: &Arc<Queue>, key: &str, what: &str, e: &kube::Error) {
    // A conflict is the compare-and-swap of a write from a stale copy doing its job: the newer
    // version is already on its way to the cache, so the retry need not wait long.
    if matches!(e, kube::Error::Api(s) if s.code == 409) {
        tracing::debug!(key, error = %e, "{what}; retrying");
        q.add_after(key, CONFLICT_RETRY);
    } else {
        tracing::warn!(key, error = %e, "{what}; retrying");
        q.add_after(key, Duration::from_secs(2));
    }
}

async fn sync_vmi(s: &Shared, key: &str) {
    let (ns, name) = split_key(key);
    let pods_api: Api<Pod> = Api::namespaced(s.client.clone(), ns);
    let vmi_api: Api<VirtualMachineInstance> = Api::namespaced(s.client.clone(), ns);
    let pod_keys = lock(&s.pod_index).children(key);
    let pods: Vec<Pod> = pod_keys
        .iter()
        .filter_map(|k| {
            let (ns, name) = split_key(k);
            s.pods.get(&ObjectRef::new(name).within(ns))
        })
        .map(|p| (*p).clone())
        .collect();
    let Some(vmi) = s.vmis.get(&ObjectRef::new(name).within(ns)) else {
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
    let out = vmi::sync(&vmi, &pods, &problems, Timestamp::now());
    let old_status = vmi.status.clone().unwrap_or_default();
    let status = out.status;

    match out.pods {
        PodAction::None => {}
        PodAction::Create => match render_launcher_pod(&defaulted, &s.opts.template, &cfg) {
            Err(e) => {
                event(
                    s,
                    vmi.as_ref(),
                    true,
                    events::FAILED_CREATE_POD,
                    e.to_string(),
                )
                .await;
            }
            Ok(pod) => {
                s.pod_exp.expect_creations(key, 1);
                match pods_api.create(&PostParams::default(), &pod).await {
                    Ok(p) => {
                        event(
                            s,
                            vmi.as_ref(),
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
                            vmi.as_ref(),
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
            let keys: Vec<String> = names.iter().map(|n| key_of(Some(ns), n)).collect();
            s.pod_exp.expect_deletions(key, &keys);
            for (n, k) in names.iter().zip(&keys) {
                match pods_api.delete(n, &DeleteParams::default()).await {
                    Ok(_) => {
                        event(
                            s,
                            vmi.as_ref(),
                            false,
                            events::SUCCESSFUL_DELETE_POD,
                            format!("Deleted virtual machine pod {n}"),
                        )
                        .await;
                    }
                    Err(e) => {
                        s.pod_exp.deletion_observed(key, k);
                        event(
                            s,
                            vmi.as_ref(),
                            true,
                            events::FAILED_DELETE_POD,
                            format!("Error deleting pod {n}: {e}"),
                        )
                        .await;
                        retry_later(&s.vmi_q, key, "deleting a launcher pod", &e);
                    }
                }
            }
        }
    }

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

    // KubeVirt's VMI CRD has no status subresource: the status is part of the object, so the
    // node label handing the VMI to its node goes in the same patch.
    let mut patch = serde_json::Map::new();
    let mut metadata = serde_json::Map::new();
    if status != old_status {
        patch.insert("status".into(), status_patch(&old_status, &status));
    }
    if let Some(node) = out.node_label {
        metadata.insert("labels".into(), json!({api::labels::NODE_NAME: node}));
    }
    // Without a live VM owning it nothing else would ever release the VM controller's
    // finalizer (KubeVirt's `hasOwnerVM`); KubeVirt waits for the VMI to be final, but with
    // no VM to record the final status there is nothing to wait for.
    if let Some(next) = finalizers::vmi(&vmi, out.release_finalizer, !owner_vm_live(s, &vmi)) {
        metadata.insert("finalizers".into(), json!(next));
    }
    if !metadata.is_empty() {
        patch.insert("metadata".into(), metadata.into());
    }
    if !patch.is_empty() {
        // The resourceVersion makes this a compare-and-swap: the whole status computed from
        // this (possibly stale) copy must not overwrite what another writer set since, such
        // as the node controller failing the VMI, nor drop a finalizer someone added since;
        // on a conflict the next sync sees both.
        let metadata = patch.entry("metadata").or_insert_with(|| json!({}));
        metadata["resourceVersion"] = json!(vmi.metadata.resource_version);
        if let Err(e) = vmi_api
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::Value::Object(patch)),
            )
            .await
        {
            retry_later(&s.vmi_q, key, "updating the VMI status", &e);
        }
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

/// Writes `finalizers` onto `obj`. The resourceVersion makes this a compare-and-swap: never
/// drop a finalizer someone added since.
async fn set_finalizers<K>(api: &Api<K>, obj: &K, finalizers: &[String]) -> Result<K, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": obj.meta().resource_version}});
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(patch),
    )
    .await
}

async fn sync_vm(s: &Shared, key: &str) {
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
    // Claim by name (KubeVirt's `ClaimVirtualMachineByName`): ours, or an orphan we adopt.
    let vm_uid = vm.metadata.uid.clone().unwrap_or_default();
    let mut vmi = vmi.filter(|v| controller_ref(v.as_ref()).is_none_or(|o| o.uid == vm_uid));
    if let Some(v) = vmi
        .as_ref()
        .filter(|v| controller_owner(v.as_ref(), "VirtualMachine").is_none())
    {
        // Never adopt for a VM being deleted: deleted with orphaning, the garbage collector
        // strips the VMI's owner reference while the VM still exists, and adopting it back
        // would have the VMI deleted along with the VM.
        if v.metadata.deletion_timestamp.is_none() && vm.metadata.deletion_timestamp.is_none() {
            let patch = json!({"metadata": {"ownerReferences": [vm::controller_ref(&vm)], "resourceVersion": v.metadata.resource_version}});
            if let Err(e) = vmi_api
                .patch(name, &PatchParams::default(), &Patch::Merge(patch))
                .await
            {
                tracing::debug!(key, error = %e, "adopting an orphan VMI");
                vmi = None;
            }
        } else {
            vmi = None;
        }
    }
    let cfg = cluster_config(s);
    let now = Timestamp::now();
    let mut sync_error: Option<(String, String)> = None;
    let mut request_start = false;

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
        let problems = api::validation::validate_vm(&vm, &cfg);
        match vm::decide(&vm, vmi.as_deref(), now) {
            Err(e) => sync_error = Some((events::FAILED_CREATE_VMI.into(), e.to_string())),
            Ok(VmAction::None) => {}
            Ok(VmAction::Start) if !problems.is_empty() => {
                let msg = vmi::validation_message(&problems);
                sync_error = Some((events::FAILED_CREATE_VMI.into(), msg));
            }
            Ok(VmAction::Start) => {
                let mut new = vm::vmi_from_vm(&vm);
                if let Err(e) = api::defaults::apply(&mut new.spec, &cfg) {
                    sync_error = Some((events::FAILED_CREATE_VMI.into(), e.to_string()));
                } else {
                    s.vm_exp.expect_creations(key, 1);
                    match vmi_api.create(&PostParams::default(), &new).await {
                        Ok(created) => event(s, vm.as_ref(), false, events::SUCCESSFUL_CREATE_VMI, format!("Started the virtual machine by creating the new virtual machine instance {}", created.name_any())).await,
                        Err(e) => {
                            s.vm_exp.creation_observed(key);
                            event(s, vm.as_ref(), true, events::FAILED_CREATE_VMI, format!("Error creating virtual machine instance: {e}")).await;
                            sync_error = Some((events::FAILED_CREATE_VMI.into(), e.to_string()));
                            retry_later(&s.vm_q, key, "creating the VMI", &e);
                        }
                    }
                }
            }
            Ok(action @ (VmAction::Stop | VmAction::StopAndRequestStart)) => {
                s.vm_exp.expect_deletions(key, &[key.to_owned()]);
                match vmi_api.delete(name, &DeleteParams::default()).await {
                    Ok(_) => {
                        request_start = action == VmAction::StopAndRequestStart;
                        let uid = vmi
                            .as_ref()
                            .and_then(|v| v.metadata.uid.clone())
                            .unwrap_or_default();
                        event(s, vm.as_ref(), false, events::SUCCESSFUL_DELETE_VMI, format!("Stopped the virtual machine by deleting the virtual machine instance {uid}")).await;
                    }
                    Err(e) => {
                        s.vm_exp.deletion_observed(key, key);
                        sync_error = Some((events::FAILED_DELETE_VMI.into(), e.to_string()));
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
                    .patch(name, &PatchParams::default(), &Patch::Merge(patch))
                    .await
                {
                    retry_later(&s.vm_q, key, "switching the VM to Always", &e);
                }
            }
            Ok(VmAction::WaitBackoff(d)) => s.vm_q.add_after(key, d),
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

    let pending = s.vm_exp.counters().pending(key).unwrap_or((0, 0));
    let inputs = StatusInputs {
        start_expected: pending.0 > 0,
        stop_expected: pending.1 > 0,
        sync_error,
        now,
        jitter: jitter(),
    };
    let mut status = vm::next_status(&vm, vmi.as_deref(), &inputs);
    if request_start {
        status
            .state_change_requests
            .push(api::vm::VirtualMachineStateChangeRequest {
                action: api::vm::StateChangeRequestAction::Start,
                data: std::collections::BTreeMap::new(),
                uid: None,
            });
    }
    if Some(&status) != vm.status.as_ref() {
        let old = vm.status.clone().unwrap_or_default();
        // The resourceVersion makes it a compare-and-swap, so a request someone queued in
        // stateChangeRequests since this copy is never dropped.
        let patch = cas_status_patch(vm.metadata.resource_version.as_deref(), &old, &status);
        if let Err(e) = vm_api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
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

async fn sync_rs(s: &Shared, key: &str) {
    let (ns, name) = split_key(key);
    let Some(rs) = s.replicasets.get(&ObjectRef::new(name).within(ns)) else {
        s.rs_exp.delete(key);
        return;
    };
    if !s.rs_exp.satisfied(key) {
        s.rs_q.add_after(key, EXPECTATION_TTL);
        return;
    }
    let rs_api: Api<VirtualMachineInstanceReplicaSet> = Api::namespaced(s.client.clone(), ns);
    let vmi_api: Api<VirtualMachineInstance> = Api::namespaced(s.client.clone(), ns);
    let mut all: Vec<VirtualMachineInstance> = s
        .vmis
        .state()
        .iter()
        .filter(|v| v.namespace().as_deref() == Some(ns))
        .map(|v| (**v).clone())
        .collect();
    let claims = replicaset::claims(&rs, &all);
    let mut claimed_all = true;
    for (vmi_name, adopt) in claims
        .adopt
        .iter()
        .map(|n| (n, true))
        .chain(claims.release.iter().map(|n| (n, false)))
    {
        let Some(v) = all
            .iter()
            .find(|v| v.metadata.name.as_deref() == Some(vmi_name))
        else {
            continue;
        };
        let mut refs: Vec<_> = v
            .metadata
            .owner_references
            .clone()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| Some(&r.uid) != rs.metadata.uid.as_ref())
            .collect();
        if adopt {
            refs.push(replicaset::controller_ref(&rs));
        }
        // The resourceVersion makes this a compare-and-swap against a concurrent claim.
        let patch = json!({"metadata": {"ownerReferences": refs, "resourceVersion": v.metadata.resource_version}});
        match vmi_api
            .patch(vmi_name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(updated) => {
                if let Some(slot) = all
                    .iter_mut()
                    .find(|x| x.metadata.name.as_deref() == Some(vmi_name))
                {
                    *slot = updated;
                }
            }
            Err(e) => {
                claimed_all = false;
                retry_later(
                    &s.rs_q,
                    key,
                    if adopt {
                        "adopting a VMI"
                    } else {
                        "releasing a VMI"
                    },
                    &e,
                );
            }
        }
    }
    let owned = replicaset::owned(&rs, &all);
    // Scaling on a cache that may still show a VMI we failed to claim could overshoot.
    if claimed_all && rs.spec.paused != Some(true) && rs.metadata.deletion_timestamp.is_none() {
        let mut delete = replicaset::finished(&owned);
        match replicaset::scale(&rs, &owned) {
            replicaset::Scale::None => {}
            replicaset::Scale::Delete(names) => delete.extend(names),
            replicaset::Scale::Create(n) => {
                s.rs_exp
                    .expect_creations(key, i64::try_from(n).unwrap_or(i64::MAX));
                let template = replicaset::vmi_from_template(&rs);
                for _ in 0..n {
                    match vmi_api.create(&PostParams::default(), &template).await {
                        Ok(v) => {
                            event(
                                s,
                                rs.as_ref(),
                                false,
                                events::SUCCESSFUL_CREATE_VMI,
                                format!("Created virtual machine instance: {}", v.name_any()),
                            )
                            .await;
                        }
                        Err(e) => {
                            s.rs_exp.creation_observed(key);
                            event(
                                s,
                                rs.as_ref(),
                                true,
                                events::FAILED_CREATE_VMI,
                                format!("Error creating VMI: {e}"),
                            )
                            .await;
                            retry_later(&s.rs_q, key, "creating a VMI", &e);
                        }
                    }
                }
            }
        }
        if !delete.is_empty() {
            let keys: Vec<String> = delete.iter().map(|n| key_of(Some(ns), n)).collect();
            s.rs_exp.expect_deletions(key, &keys);
            for (n, k) in delete.iter().zip(&keys) {
                match vmi_api.delete(n, &DeleteParams::default()).await {
                    Ok(_) => {
                        event(
                            s,
                            rs.as_ref(),
                            false,
                            events::SUCCESSFUL_DELETE_VMI,
                            format!("Deleted virtual machine instance: {n}"),
                        )
                        .await;
                    }
                    Err(e) => {
                        s.rs_exp.deletion_observed(key, k);
                        retry_later(&s.rs_q, key, "deleting a VMI", &e);
                    }
                }
            }
        }
    }
    let status = replicaset::next_status(&rs, &owned, Timestamp::now());
    if Some(&status) != rs.status.as_ref() {
        let old = rs.status.clone().unwrap_or_default();
        if let Err(e) = rs_api
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status_patch(&old, &status) })),
            )
            .await
        {
            retry_later(&s.rs_q, key, "updating the ReplicaSet status", &e);
        }
    }
}

async fn sync_node(s: &Shared, name: &str) {
    let Some(n) = s.nodes.get(&ObjectRef::new(name)) else {
        return;
    };
    if !node::is_unresponsive(&n, Timestamp::now(), s.opts.heartbeat_timeout) {
        return;
    }
    let nodes: Api<Node> = Api::all(s.client.clone());
    let patch = json!({"metadata": {"labels": {api::labels::NODE_SCHEDULABLE: "false"}}});
    if let Err(e) = nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        retry_later(&s.node_q, name, "marking the node unschedulable", &e);
        return;
    }
    event(
        s,
        n.as_ref(),
        true,
        events::NODE_UNRESPONSIVE,
        "virt-handler stopped heartbeating; node marked unschedulable".into(),
    )
    .await;
    let vmis: Vec<VirtualMachineInstance> = s.vmis.state().iter().map(|v| (**v).clone()).collect();
    let pods: Vec<Pod> = s.pods.state().iter().map(|p| (**p).clone()).collect();
    for v in node::vmis_to_fail(name, &vmis, &pods) {
        let api: Api<VirtualMachineInstance> =
            Api::namespaced(s.client.clone(), &v.namespace().unwrap_or_default());
        let patch = json!({"status": {"phase": "Failed", "reason": events::NODE_UNRESPONSIVE}});
        match api
            .patch(&v.name_any(), &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => {
                event(
                    s,
                    v,
                    true,
                    events::NODE_UNRESPONSIVE,
                    format!("virt-handler on node {name} is unresponsive; the VMI failed"),
                )
                .await;
            }
            Err(e) => retry_later(&s.node_q, name, "failing a VMI of an unresponsive node", &e),
        }
    }
}
