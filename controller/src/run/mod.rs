//! The thin I/O shells: reflectors feeding work queues, a few workers per controller (never
//! two on one key) calling the pure decisions, writes through the API, Events, leader election.
//! This module holds the wiring the controllers share; each controller's watch handlers and
//! sync are in its own module ([`vm`], [`vmi`], [`replicaset`], [`pool`], [`node`], [`migration`],
//! [`evacuation`], [`disruptionbudget`]).
//!
//! kube-runtime's `Controller` is not used: expectations must be observed by the very cache
//! the reconcile reads (KubeVirt's informer handlers), and wiring our own reflectors into a
//! `Controller` needs kube's unstable stream features. A reflector per kind (the `informer`
//! crate) and a client-go style work queue per controller is all the machinery this needs.

mod disruptionbudget;
mod evacuation;
mod instancetype;
mod migration;
mod node;
mod pool;
mod replicaset;
mod vm;
mod vmi;

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use api::migration::VirtualMachineInstanceMigration;
use api::migrationpolicy::MigrationPolicy;
use api::pool::VirtualMachinePool;
use api::{
    ClusterConfig, KubeVirt, VirtualMachine, VirtualMachineInstance,
    VirtualMachineInstanceReplicaSet,
};
use informer::events::{Publisher, Reporter};
use informer::packed::PackedStore;
use informer::{Seen, obj_key, reflect, reflect_packed};
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::api::core::v1::{Namespace, Node, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt as _};
use serde_json::json;
use tokio::task::JoinSet;
use workqueue::Queue;

use crate::cache;
use crate::metrics::{Health, QueueStat, Snapshot};
use crate::template::TemplateConfig;
use workqueue::expectations::UidTrackingExpectations;

/// Why the controllers stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Leader election failed, or another replica took the Lease.
    #[error(transparent)]
    Leader(#[from] informer::leader::LeaderError),
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
            heartbeat_timeout: crate::node::DEFAULT_HEARTBEAT_TIMEOUT,
            node_check_interval: Duration::from_mins(1),
            lease_namespace: "kubevirt".into(),
            lease_name: "virt-controller".into(),
            identity: uuid::Uuid::new_v4().to_string(),
            health: Arc::default(),
        }
    }
}

/// Workers per controller, as KubeVirt's defaults (`--vmi-controller-threads` ...).
const VMI_WORKERS: usize = 10;
const VM_WORKERS: usize = 3;
const RS_WORKERS: usize = 3;
/// KubeVirt's `--pool-controller-threads` (`defaultControllerThreads`).
const POOL_WORKERS: usize = 3;
const NODE_WORKERS: usize = 3;
/// KubeVirt's `defaultMigrationControllerThreads`.
const MIGRATION_WORKERS: usize = 3;
/// KubeVirt's `defaultEvacuationControllerThreads`.
const EVACUATION_WORKERS: usize = 3;
/// KubeVirt's `defaultDisruptionBudgetControllerThreads`.
const DISRUPTION_BUDGET_WORKERS: usize = 3;
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
    recorder: Publisher,
    vms: Store<VirtualMachine>,
    /// Kept as compressed JSON, indexed (`cache::VMI_INDEXES`): a cached VMI struct took
    /// 4.4 KB of heap before any of its strings.
    vmis: PackedStore<VirtualMachineInstance>,
    /// Kept as compressed JSON (a cached `Pod` took 4.5 KB of heap, its trimmed JSON 1.4 KB),
    /// indexed by VMI (`cache::POD_INDEXES`).
    pods: PackedStore<Pod>,
    pvcs: Store<PersistentVolumeClaim>,
    /// Backend-storage claims being created, keyed by VMI: not made twice before the cache
    /// has the first.
    pvc_exp: Arc<workqueue::expectations::Expectations>,
    replicasets: Store<VirtualMachineInstanceReplicaSet>,
    pools: Store<VirtualMachinePool>,
    /// ControllerRevisions: the pools' snapshots of their spec.
    revisions: Store<ControllerRevision>,
    nodes: Store<Node>,
    kubevirts: Store<KubeVirt>,
    vmims: Store<VirtualMachineInstanceMigration>,
    mig_index: Arc<Mutex<migration::MigrationIndex>>,
    /// Target pod expectations, keyed by migration.
    mig_pod_exp: Arc<UidTrackingExpectations>,
    /// Held while a migration decides whether to start: the limits count the others.
    mig_start_lock: tokio::sync::Mutex<()>,
    pod_exp: Arc<UidTrackingExpectations>,
    vm_exp: Arc<UidTrackingExpectations>,
    rs_exp: Arc<UidTrackingExpectations>,
    pool_exp: Arc<UidTrackingExpectations>,
    vm_q: Arc<Queue>,
    vmi_q: Arc<Queue>,
    rs_q: Arc<Queue>,
    pool_q: Arc<Queue>,
    node_q: Arc<Queue>,
    mig_q: Arc<Queue>,
    /// The evacuation controller's queue: node names.
    evac_q: Arc<Queue>,
    /// Evacuation migrations being created, keyed by node.
    evac_exp: Arc<UidTrackingExpectations>,
    pdbs: Store<PodDisruptionBudget>,
    /// MigrationPolicies and the namespaces' labels their selectors match.
    migration_policies: Store<MigrationPolicy>,
    namespaces: Store<Namespace>,
    /// The disruption-budget controller's queue: PDB keys.
    pdb_q: Arc<Queue>,
    /// VMI status patches the VMI cache has not caught up with: not sent again from it.
    vmi_writes: informer::ownwrites::OwnWrites,
}

/// Runs the VM, VMI, ReplicaSet and Node controllers until the task is dropped.
pub async fn run_controllers(client: Client, opts: Options) -> Result<(), RunError> {
    let mut tasks = JoinSet::new();
    let shared = Arc::new(start_caches(&mut tasks, client, opts).await?);
    let weak = Arc::downgrade(&shared);
    shared
        .opts
        .health
        .set_source(move || Weak::upgrade(&weak).map(|s| snapshot(&s)));
    spawn_workers(&mut tasks, &shared);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// Starts a reflector per kind, each watch handler marking expectations observed and queueing
/// keys, and returns once every cache has filled.
async fn start_caches(
    tasks: &mut JoinSet<()>,
    client: Client,
    opts: Options,
) -> Result<Shared, RunError> {
    let pod_exp = Arc::new(UidTrackingExpectations::default());
    let vm_exp = Arc::new(UidTrackingExpectations::default());
    let rs_exp = Arc::new(UidTrackingExpectations::default());
    let pool_exp = Arc::new(UidTrackingExpectations::default());
    let pool_q = Arc::new(Queue::default());
    let (vm_q, vmi_q, rs_q, node_q) = (
        Arc::new(Queue::default()),
        Arc::new(Queue::default()),
        Arc::new(Queue::default()),
        Arc::new(Queue::default()),
    );
    let mig_q = Arc::new(Queue::default());
    let mig_pod_exp = Arc::new(UidTrackingExpectations::default());
    let mig_index: Arc<Mutex<migration::MigrationIndex>> = Arc::default();
    let evac_q = Arc::new(Queue::default());
    let evac_exp = Arc::new(UidTrackingExpectations::default());
    let pdb_q = Arc::new(Queue::default());
    let wc = watcher::Config::default;

    let vms = reflect(
        tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        vm::on_vm(
            vm_q.clone(),
            vmi_q.clone(),
            pool_q.clone(),
            pool_exp.clone(),
        ),
    );
    let vmis = reflect_packed(
        tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        &cache::VMI_INDEXES,
        vmi::on_vmi(vmi::VmiWatch {
            vmi_q: vmi_q.clone(),
            vm_q: vm_q.clone(),
            rs_q: rs_q.clone(),
            vm_exp: vm_exp.clone(),
            rs_exp: rs_exp.clone(),
            pool_q: pool_q.clone(),
            vms: vms.clone(),
            mig_q: mig_q.clone(),
            mig_index: mig_index.clone(),
            evac_q: evac_q.clone(),
        }),
    );
    let pods = reflect_packed(
        tasks,
        Api::all(client.clone()),
        wc().labels(&format!(
            "{} in (virt-launcher,{})",
            api::labels::APP,
            api::hotplug::ATTACHMENT_POD_APP
        )),
        cache::trim_pod,
        &cache::POD_INDEXES,
        vmi::on_pod(vmi::PodWatch {
            vmi_q: vmi_q.clone(),
            pod_exp: pod_exp.clone(),
            mig_q: mig_q.clone(),
            mig_pod_exp: mig_pod_exp.clone(),
            mig_index: mig_index.clone(),
        }),
    );
    let pvc_exp = Arc::new(workqueue::expectations::Expectations::default());
    let pvcs = reflect(
        tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        vmi::on_claim(vmi_q.clone(), vmis.clone(), pvc_exp.clone()),
    );
    let q = rs_q.clone();
    let replicasets = reflect(tasks, Api::all(client.clone()), wc(), trim_meta, move |s| {
        q.add(&obj_key(s.object()));
    });
    let q = pool_q.clone();
    let pools = reflect(tasks, Api::all(client.clone()), wc(), trim_meta, move |s| {
        q.add(&obj_key(s.object()));
    });
    let revisions = reflect(
        tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        pool::on_revision(pool_q.clone(), pool_exp.clone()),
    );
    let q = node_q.clone();
    let eq = evac_q.clone();
    let nodes = reflect(
        tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        move |s| match s {
            Seen::Added(o) | Seen::Changed(o) => {
                q.add(&obj_key(o));
                eq.add(&obj_key(o));
            }
            Seen::Deleted(_) => {}
        },
    );
    let kubevirts = reflect(tasks, Api::all(client.clone()), wc(), trim_meta, |_| {});
    let vmims = reflect(
        tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        migration::on_migration(
            mig_q.clone(),
            mig_index.clone(),
            evac_q.clone(),
            evac_exp.clone(),
        ),
    );
    let q = pdb_q.clone();
    let pdbs = reflect(
        tasks,
        Api::all(client.clone()),
        wc(),
        trim_meta,
        move |s| match s {
            Seen::Added(o) | Seen::Changed(o) => q.add(&obj_key(o)),
            Seen::Deleted(_) => {}
        },
    );
    let migration_policies = reflect(tasks, Api::all(client.clone()), wc(), trim_meta, |_| {});
    let namespaces = reflect(
        tasks,
        Api::all(client.clone()),
        wc(),
        |n: &mut Namespace| {
            cache::trim_meta(&mut n.metadata);
            n.spec = None;
            n.status = None;
        },
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
            "PersistentVolumeClaim",
            pvcs.wait_until_ready().await.is_ok(),
        ),
        (
            "VirtualMachineInstanceReplicaSet",
            replicasets.wait_until_ready().await.is_ok(),
        ),
        ("VirtualMachinePool", pools.wait_until_ready().await.is_ok()),
        (
            "ControllerRevision",
            revisions.wait_until_ready().await.is_ok(),
        ),
        ("Node", nodes.wait_until_ready().await.is_ok()),
        ("KubeVirt", kubevirts.wait_until_ready().await.is_ok()),
        (
            "VirtualMachineInstanceMigration",
            vmims.wait_until_ready().await.is_ok(),
        ),
        ("PodDisruptionBudget", pdbs.wait_until_ready().await.is_ok()),
        (
            "MigrationPolicy",
            migration_policies.wait_until_ready().await.is_ok(),
        ),
        ("Namespace", namespaces.wait_until_ready().await.is_ok()),
    ] {
        if !ready {
            return Err(RunError::CacheNotReady(name));
        }
    }
    tracing::info!("caches synced; controllers running");

    let recorder = Publisher::new(
        client.clone(),
        Reporter {
            controller: "virt-controller".into(),
            instance: Some(opts.identity.clone()),
        },
    );
    Ok(Shared {
        client,
        opts,
        recorder,
        vms,
        vmis,
        pods,
        pvcs,
        pvc_exp,
        replicasets,
        pools,
        revisions,
        nodes,
        kubevirts,
        vmims,
        mig_index,
        mig_pod_exp,
        mig_start_lock: tokio::sync::Mutex::new(()),
        pod_exp,
        vm_exp,
        rs_exp,
        pool_exp,
        vm_q,
        vmi_q,
        rs_q,
        pool_q,
        node_q,
        mig_q,
        evac_q,
        evac_exp,
        pdbs,
        migration_policies,
        namespaces,
        pdb_q,
        vmi_writes: informer::ownwrites::OwnWrites::default(),
    })
}

/// KubeVirt's worker counts per controller, and the periodic node check.
fn spawn_workers(tasks: &mut JoinSet<()>, shared: &Arc<Shared>) {
    spawn_pool(
        tasks,
        VMI_WORKERS,
        shared,
        |s| &s.vmi_q,
        |s, k| async move {
            Box::pin(vmi::sync_vmi(&s, &k)).await;
        },
    );
    spawn_pool(
        tasks,
        VM_WORKERS,
        shared,
        |s| &s.vm_q,
        |s, k| async move {
            Box::pin(vm::sync_vm(&s, &k)).await;
        },
    );
    spawn_pool(
        tasks,
        RS_WORKERS,
        shared,
        |s| &s.rs_q,
        |s, k| async move {
            Box::pin(replicaset::sync_rs(&s, &k)).await;
        },
    );
    spawn_pool(
        tasks,
        POOL_WORKERS,
        shared,
        |s| &s.pool_q,
        |s, k| async move {
            Box::pin(pool::sync_pool(&s, &k)).await;
        },
    );
    spawn_pool(
        tasks,
        NODE_WORKERS,
        shared,
        |s| &s.node_q,
        |s, k| async move {
            node::sync_node(&s, &k).await;
        },
    );
    spawn_pool(
        tasks,
        MIGRATION_WORKERS,
        shared,
        |s| &s.mig_q,
        |s, k| async move {
            Box::pin(migration::sync_migration(&s, &k)).await;
        },
    );
    spawn_pool(
        tasks,
        EVACUATION_WORKERS,
        shared,
        |s| &s.evac_q,
        |s, k| async move {
            Box::pin(evacuation::sync_node(&s, &k)).await;
        },
    );
    spawn_pool(
        tasks,
        DISRUPTION_BUDGET_WORKERS,
        shared,
        |s| &s.pdb_q,
        |s, k| async move {
            Box::pin(disruptionbudget::sync_pdb(&s, &k)).await;
        },
    );
    let s = shared.clone();
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(s.opts.node_check_interval);
        loop {
            tick.tick().await;
            for n in s.nodes.state() {
                s.node_q.add(&n.name_any());
            }
        }
    });
}

/// `workers` tasks taking keys from one controller's queue (never one key on two at a time)
/// and syncing each.
fn spawn_pool<F>(
    tasks: &mut JoinSet<()>,
    workers: usize,
    shared: &Arc<Shared>,
    queue: fn(&Shared) -> &Arc<Queue>,
    sync: fn(Arc<Shared>, String) -> F,
) where
    F: Future<Output = ()> + Send + 'static,
{
    for _ in 0..workers {
        let s = shared.clone();
        tasks.spawn(async move {
            let q = queue(&s).clone();
            while let Some(key) = q.pop().await {
                sync(s.clone(), key.clone()).await;
                q.done(&key);
            }
        });
    }
}

/// The controllers' state for `/metrics`, KubeVirt's queue names.
fn snapshot(s: &Shared) -> Snapshot {
    let vmi_phases = s
        .vmis
        .index_counts(cache::VMI_BY_PHASE_AND_NODE.name)
        .into_iter()
        .map(|(phase_node, n)| {
            let (phase, node) = phase_node.split_once('/').unwrap_or((&phase_node, ""));
            ((phase.to_owned(), node.to_owned()), n)
        })
        .collect();
    let vmims = s.vmims.state();
    Snapshot {
        vmi_phases,
        migrations: crate::migration::phase_counts(vmims.iter().map(AsRef::as_ref)),
        queues: vec![
            queue_stat("virt-controller-vm", &s.vm_q),
            queue_stat("virt-controller-vmi", &s.vmi_q),
            queue_stat("virt-controller-replicaset", &s.rs_q),
            queue_stat("virt-controller-pool", &s.pool_q),
            queue_stat("virt-controller-node", &s.node_q),
            queue_stat("virt-controller-migration", &s.mig_q),
            queue_stat("virt-controller-evacuation", &s.evac_q),
            queue_stat("virt-controller-disruption-budget", &s.pdb_q),
        ],
    }
}

/// Waits for the `virt-controller` Lease, runs the controllers while holding it, and
/// returns [`informer::leader::LeaderError::LostLease`] when another replica takes over (KubeVirt exits then).
pub async fn run_with_leader_election(client: Client, opts: Options) -> Result<(), RunError> {
    let health = opts.health.clone();
    let (namespace, name, identity) = (
        opts.lease_namespace.clone(),
        opts.lease_name.clone(),
        opts.identity.clone(),
    );
    informer::leader::lead(
        client.clone(),
        &namespace,
        &name,
        &identity,
        |leading| health.set_leading(leading),
        run_controllers(client, opts),
    )
    .await?
}

/// The launcher pods of the VMI `vmi_key` (`namespace/name`) as the pod cache has them, as
/// the pure decisions take them.
fn launcher_pods(s: &Shared, vmi_key: &str) -> Vec<Pod> {
    s.pods
        .by_index(cache::POD_BY_VMI.name, vmi_key)
        .iter()
        .map(|p| (**p).clone())
        .collect()
}

/// The cluster's storage classes, read from the API (no cache: they are needed only while a
/// backend-storage claim is made or waited for).
async fn storage_classes(s: &Shared) -> Result<Vec<StorageClass>, String> {
    Api::<StorageClass>::all(s.client.clone())
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|e| format!("listing storage classes: {e}"))
}

/// The claims of namespace `ns` as the PVC cache has them, by name.
fn claims_in<'a>(
    s: &'a Shared,
    ns: &'a str,
) -> impl Fn(&str) -> Option<PersistentVolumeClaim> + Sync + 'a {
    move |name| {
        s.pvcs
            .get(&kube::runtime::reflector::ObjectRef::new(name).within(ns))
            .map(|c| (*c).clone())
    }
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
    informer::publish_event(&s.recorder, obj, warning, reason, note).await;
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
