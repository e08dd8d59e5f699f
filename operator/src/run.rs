//! The thin async shell around [`crate::reconcile`]: informers on the KubeVirt CRs and on every
//! owned kind (selected by virt-operator's labels), one rate-limited queue, expectations per
//! owned kind, the writes, the CR's status and finalizer, and Events on the CR.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use api::kubevirt::KubeVirt;
use futures::StreamExt as _;
use informer::events::{Publisher, Reporter};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, ResourceExt as _};
use serde_json::json;
use tokio::task::JoinSet;
use workqueue::Queue;
use workqueue::expectations::UidTrackingExpectations;

use crate::install::{Action, Live};
use crate::owned::{OWNED_KINDS, ObjectRef, OwnedKind};
use crate::reconcile::{self, BLOCK_UNINSTALL, Context, Finalizer};
use crate::strategy::{COMPONENT_LABEL, COMPONENT_VALUE, MANAGED_BY_LABEL, Release};

/// Who virt-operator is and where it installs.
#[derive(Debug, Clone)]
pub struct Options {
    pub namespace: String,
    pub release: Release,
    /// The identity in the leader Lease and in Events.
    pub identity: String,
    pub health: Arc<Health>,
}

/// What `/metrics`, `/healthz` and `/leader` report.
#[derive(Debug, Default)]
pub struct Health {
    pub leading: AtomicBool,
    /// The caches have synced and the worker runs.
    pub ready: AtomicBool,
}

/// The leader Lease's name, as KubeVirt's.
pub const LEASE_NAME: &str = "virt-operator";

/// Safety net for a CR that waits on something no watch reports (a Lease, a VMI list).
const RESYNC: Duration = Duration::from_secs(30);

/// Why virt-operator stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Leader(#[from] informer::leader::LeaderError),
    #[error("the {0} cache never became ready")]
    CacheNotReady(String),
}

struct Shared {
    client: Client,
    opts: Options,
    kubevirts: Store<KubeVirt>,
    owned: Vec<(&'static OwnedKind, Store<DynamicObject>)>,
    expectations: Arc<UidTrackingExpectations>,
    recorder: Publisher,
}

fn api_resource(k: &OwnedKind) -> ApiResource {
    ApiResource {
        group: k.group.to_owned(),
        version: k.version.to_owned(),
        api_version: k.api_version(),
        kind: k.kind.to_owned(),
        plural: k.plural.to_owned(),
    }
}

fn selector() -> String {
    format!(
        "{MANAGED_BY_LABEL}={},{COMPONENT_LABEL}={COMPONENT_VALUE}",
        api::labels::MANAGED_BY_OPERATOR
    )
}

fn enqueue_all(queue: &Queue, kubevirts: &Store<KubeVirt>) {
    for kv in kubevirts.state() {
        queue.add(&informer::obj_key(kv.as_ref()));
    }
}

/// A reflector of one owned kind; each object first seen or deleted settles that kind's
/// expectations, and any change brings every CR back to the queue.
fn reflect_owned(
    tasks: &mut JoinSet<()>,
    client: &Client,
    kind: &'static OwnedKind,
    expectations: Arc<UidTrackingExpectations>,
    queue: Arc<Queue>,
    kubevirts: Store<KubeVirt>,
) -> Store<DynamicObject> {
    let ar = api_resource(kind);
    let writer = reflector::store::Writer::new(ar.clone());
    let reader = writer.as_reader();
    let api = Api::<DynamicObject>::all_with(client.clone(), &ar);
    let stream = watcher(api, watcher::Config::default().labels(&selector()))
        .modify(|o| o.metadata.managed_fields = None)
        .default_backoff();
    let stream = reflector::reflector(writer, stream);
    tasks.spawn(async move {
        let mut seen = HashSet::new();
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(watcher::Event::Apply(o)) => {
                    if seen.insert(o.uid().unwrap_or_default()) {
                        expectations.creation_observed(kind.kind);
                    }
                }
                // The store swaps a (re-)list's objects in at InitDone: a reconcile before
                // that would read the cache without them.
                Ok(watcher::Event::InitApply(o)) => {
                    if seen.insert(o.uid().unwrap_or_default()) {
                        expectations.creation_observed(kind.kind);
                    }
                    continue;
                }
                Ok(watcher::Event::Delete(o)) => {
                    seen.remove(&o.uid().unwrap_or_default());
                    let r = informer::key_of(o.namespace().as_deref(), &o.name_any());
                    expectations.deletion_observed(kind.kind, &r);
                }
                Ok(watcher::Event::Init) => continue,
                Ok(watcher::Event::InitDone) => {}
                Err(e) => {
                    tracing::warn!(kind = kind.kind, error = %e, "watch failed; retrying");
                    continue;
                }
            }
            enqueue_all(&queue, &kubevirts);
        }
    });
    reader
}

/// Runs the operator until its informers stop: caches first, then one worker (the install is
/// one cluster-wide object; KubeVirt runs one too).
pub async fn run(client: Client, opts: Options) -> Result<(), RunError> {
    let mut tasks = JoinSet::new();
    let queue = Arc::new(Queue::new(workqueue::BACKOFF_BASE, Duration::from_mins(5)));
    let q = queue.clone();
    let kubevirts = informer::reflect(
        &mut tasks,
        Api::<KubeVirt>::namespaced(client.clone(), &opts.namespace),
        watcher::Config::default(),
        informer::keep_all,
        move |seen| q.add(&informer::obj_key(seen.object())),
    );
    let expectations = Arc::new(UidTrackingExpectations::default());
    let owned: Vec<_> = OWNED_KINDS
        .iter()
        .map(|k| {
            let store = reflect_owned(
                &mut tasks,
                &client,
                k,
                expectations.clone(),
                queue.clone(),
                kubevirts.clone(),
            );
            (k, store)
        })
        .collect();
    kubevirts
        .wait_until_ready()
        .await
        .map_err(|_| RunError::CacheNotReady("KubeVirt".into()))?;
    for (k, s) in &owned {
        s.wait_until_ready()
            .await
            .map_err(|_| RunError::CacheNotReady(k.kind.into()))?;
    }
    let recorder = Publisher::new(
        client.clone(),
        Reporter {
            controller: "virt-operator".into(),
            instance: Some(opts.identity.clone()),
        },
    );
    let shared = Arc::new(Shared {
        client,
        opts,
        kubevirts,
        owned,
        expectations,
        recorder,
    });
    enqueue_all(&queue, &shared.kubevirts);
    shared.opts.health.ready.store(true, Ordering::Relaxed);
    tracing::info!(namespace = %shared.opts.namespace, "caches synced; reconciling");
    loop {
        tokio::select! {
            Some(key) = queue.pop() => {
                match sync(&shared, &key).await {
                    Ok(after) => {
                        queue.forget(&key);
                        if let Some(after) = after {
                            queue.add_after(&key, after);
                        }
                    }
                    Err(e) => {
                        let delay = queue.add_rate_limited(&key);
                        tracing::warn!(key, error = %e, ?delay, "reconcile failed; retrying");
                    }
                }
                queue.done(&key);
            }
            Some(r) = tasks.join_next() => {
                if let Err(e) = r {
                    tracing::error!(error = %e, "an informer task ended");
                }
            }
        }
    }
}

/// Why one reconcile stopped short; the key is retried under the queue's backoff.
#[derive(Debug, thiserror::Error)]
enum SyncError {
    #[error("{what}: {source}")]
    Api { what: String, source: kube::Error },
    #[error("{0} cannot be written as an object: {1}")]
    Object(ObjectRef, serde_json::Error),
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> SyncError {
    let what = what.into();
    move |source| SyncError::Api { what, source }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

impl Shared {
    fn live(&self) -> Live {
        let mut live = Live::new();
        for (k, store) in &self.owned {
            for o in store.state() {
                let Ok(mut v) = serde_json::to_value(o.as_ref()) else {
                    continue;
                };
                // A list's items carry no kind; the store knows it.
                v["kind"] = json!(k.kind);
                v["apiVersion"] = json!(k.api_version());
                live.insert(ObjectRef::of(&v), v);
            }
        }
        live
    }

    fn api(&self, r: &ObjectRef) -> Option<Api<DynamicObject>> {
        let k = r.owned_kind()?;
        let ar = api_resource(k);
        Some(if k.namespaced {
            Api::namespaced_with(self.client.clone(), &r.namespace, &ar)
        } else {
            Api::all_with(self.client.clone(), &ar)
        })
    }

    /// Workloads that block an uninstall under `BlockUninstallIfWorkloadsExist`, as KubeVirt's
    /// operator webhook names them.
    async fn workloads(&self) -> Result<Option<&'static str>, SyncError> {
        if self.any::<api::VirtualMachineInstance>().await? {
            return Ok(Some("Virtual Machine Instances"));
        }
        if self.any::<api::VirtualMachine>().await? {
            return Ok(Some("Virtual Machines"));
        }
        if self.any::<api::VirtualMachineInstanceReplicaSet>().await? {
            return Ok(Some("Virtual Machine Instance Replica Sets"));
        }
        Ok(None)
    }

    /// Whether any object of `K` exists in the cluster (none when its CRD is gone).
    async fn any<K>(&self) -> Result<bool, SyncError>
    where
        K: kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
            + Clone
            + k8s_openapi::serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        match Api::<K>::all(self.client.clone())
            .list_metadata(&ListParams::default().limit(1))
            .await
        {
            Ok(l) => Ok(!l.items.is_empty()),
            Err(e) if is_status(&e, 404) => Ok(false),
            Err(e) => Err(api_err(format!("listing {}", K::kind(&())))(e)),
        }
    }

    async fn event(&self, kv: &KubeVirt, warning: bool, reason: &str, note: String) {
        informer::publish_event(&self.recorder, kv, warning, reason, note).await;
    }

    /// Applies `actions`, raising each kind's expectations before its writes and lowering
    /// them again for a write that failed (it will never be observed).
    async fn apply(&self, kv: &KubeVirt, actions: &[Action]) -> Result<(), SyncError> {
        let mut creates: BTreeMap<String, i64> = BTreeMap::new();
        let mut deletes: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for a in actions {
            let r = a.target();
            match a {
                Action::Create(_) => *creates.entry(r.kind).or_default() += 1,
                Action::Delete(_) => deletes.entry(r.kind.clone()).or_default().push(r.key()),
                Action::Patch(_) => {}
            }
        }
        for (kind, n) in &creates {
            self.expectations.expect_creations(kind, *n);
        }
        for (kind, children) in &deletes {
            self.expectations.expect_deletions(kind, children);
        }
        let mut first_error = None;
        for a in actions {
            let r = a.target();
            let Some(api) = self.api(&r) else { continue };
            let result = match a {
                Action::Create(o) => {
                    let obj: DynamicObject = serde_json::from_value(o.clone())
                        .map_err(|e| SyncError::Object(r.clone(), e))?;
                    match api.create(&PostParams::default(), &obj).await {
                        Ok(_) => Ok(("SuccessfulCreate", "created")),
                        Err(e) => {
                            self.expectations.creation_observed(&r.kind);
                            // Created by an earlier run whose write the cache has not shown.
                            if is_status(&e, 409) {
                                continue;
                            }
                            Err(e)
                        }
                    }
                }
                Action::Patch(o) => api
                    .patch(&r.name, &PatchParams::default(), &Patch::Merge(o))
                    .await
                    .map(|_| ("SuccessfulUpdate", "put back or updated")),
                Action::Delete(_) => match api.delete(&r.name, &DeleteParams::background()).await {
                    Ok(_) => Ok(("SuccessfulDelete", "deleted")),
                    Err(e) => {
                        self.expectations.deletion_observed(&r.kind, &r.key());
                        if is_status(&e, 404) {
                            continue;
                        }
                        Err(e)
                    }
                },
            };
            match result {
                Ok((reason, verb)) => {
                    tracing::info!(object = %r, "{verb}");
                    self.event(kv, false, reason, format!("{verb} {r}")).await;
                }
                Err(e) => {
                    let reason = match a {
                        Action::Create(_) => "FailedCreate",
                        Action::Patch(_) => "FailedUpdate",
                        Action::Delete(_) => "FailedDelete",
                    };
                    self.event(kv, true, reason, format!("{r}: {e}")).await;
                    first_error.get_or_insert(api_err(r.to_string())(e));
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// One reconcile of the CR under `key`; `Some(delay)` to look again after it.
async fn sync(s: &Shared, key: &str) -> Result<Option<Duration>, SyncError> {
    let (ns, name) = informer::split_key(key);
    let Some(kv) = s.kubevirts.get(&reflector::ObjectRef::new(name).within(ns)) else {
        return Ok(None);
    };
    let kv = kv.as_ref().clone();
    if OWNED_KINDS
        .iter()
        .any(|k| !s.expectations.satisfied(k.kind))
    {
        // The informers' events bring the key back once the writes show.
        return Ok(Some(RESYNC));
    }
    let all: Vec<KubeVirt> = s
        .kubevirts
        .state()
        .iter()
        .map(|k| k.as_ref().clone())
        .collect();
    let blocking = kv.metadata.deletion_timestamp.is_some()
        && kv.spec.uninstall_strategy.as_deref() == Some(BLOCK_UNINSTALL);
    let workloads = if blocking { s.workloads().await? } else { None };
    let live = s.live();
    let now = SystemTime::now();
    let mut out = reconcile::reconcile(
        &kv,
        &Context {
            release: &s.opts.release,
            namespace: &s.opts.namespace,
            all: &all,
            live: &live,
            now,
            workloads,
        },
    );
    let kubevirts = Api::<KubeVirt>::namespaced(s.client.clone(), ns);
    if out.finalizer == Finalizer::Add {
        let mut finalizers = kv.metadata.finalizers.clone().unwrap_or_default();
        finalizers.push(api::labels::OPERATOR_FINALIZER.to_owned());
        set_finalizers(&kubevirts, &kv, &finalizers).await?;
        return Ok(None);
    }
    let applied = s.apply(&kv, &out.actions).await;
    let before = kv.status.clone().unwrap_or_default();
    if let Err(e) = &applied {
        crate::conditions::failed_error(&mut out.status, &e.to_string());
    }
    crate::conditions::set_timestamps(&before, &mut out.status, &Time(jiff::Timestamp::now()));
    if out.status != before {
        let patch = informer::cas_status_patch(
            kv.metadata.resource_version.as_deref(),
            &before,
            &out.status,
        );
        kubevirts
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_err(format!("writing the status of KubeVirt {key}")))?;
    }
    applied?;
    if out.finalizer == Finalizer::Remove {
        let finalizers: Vec<String> = kv
            .metadata
            .finalizers
            .iter()
            .flatten()
            .filter(|f| *f != api::labels::OPERATOR_FINALIZER)
            .cloned()
            .collect();
        set_finalizers(&kubevirts, &kv, &finalizers).await?;
        return Ok(None);
    }
    let waiting =
        !out.actions.is_empty() || out.status.phase != Some(api::kubevirt::KubeVirtPhase::Deployed);
    let next = out
        .requeue_after
        .map_or(RESYNC, |d| d.max(Duration::from_secs(1)));
    Ok(Some(if waiting { next.min(RESYNC) } else { next }))
}

/// Writes `finalizers` onto `kv`, as a compare-and-swap on its resourceVersion.
async fn set_finalizers(
    api: &Api<KubeVirt>,
    kv: &KubeVirt,
    finalizers: &[String],
) -> Result<(), SyncError> {
    let patch = json!({"metadata": {"finalizers": finalizers,
        "resourceVersion": kv.metadata.resource_version}});
    api.patch(
        &kv.name_any(),
        &PatchParams::default(),
        &Patch::Merge(patch),
    )
    .await
    .map_err(api_err(format!(
        "setting the finalizers of KubeVirt {}",
        kv.name_any()
    )))?;
    Ok(())
}

/// Runs [`run`] while holding the `virt-operator` Lease.
pub async fn run_with_leader_election(client: Client, opts: Options) -> Result<(), RunError> {
    let health = opts.health.clone();
    let (namespace, identity) = (opts.namespace.clone(), opts.identity.clone());
    informer::leader::lead(
        client.clone(),
        &namespace,
        LEASE_NAME,
        &identity,
        |leading| health.leading.store(leading, Ordering::Relaxed),
        Box::pin(run(client, opts)),
    )
    .await?
}
