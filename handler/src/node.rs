//! The node loop (KubeVirt's `VirtualMachineController` in virt-handler): VMIs labelled
//! `kubevirt.io/nodeName=<node>`, their launcher pods on this node and each launcher's domain
//! watch feed one rate-limited work queue; workers reconcile one VMI at a time.
//!
//! Per VMI: find the launcher of the active pod on this node, detect its isolation, sync the VMI
//! to it, and write the status `status::compute` derives from the domain. A deleted VMI gets
//! `shutdown::decide`'s ACPI power-down, re-sent until its grace period ends, then kill.
//!
//! Everything remembered here is a cache of what the launchers and the API server say, so a
//! restarted handler rebuilds it from their current state and leaves running VMs untouched
//! (a second sync of an unchanged VMI is a no-op in the launcher).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use api::labels;
use api::{VirtualMachineInstance, VirtualMachineInstancePhase as Phase};
use futures::StreamExt as _;
use informer::events::{Publisher, Reporter};
use informer::{Seen, cas_status_patch, controller_owner, keep_all, key_of, reflect, split_key};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource as _, ResourceExt as _};
use launcher_api::client::{ClientError, LauncherClient};
use launcher_api::domain::Domain;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use workqueue::Queue;

use crate::devices::{self, DeviceError};
use crate::events::{Event, EventType};
use crate::guestinfo;
use crate::hotplug;
use crate::mounts::{self, MountConfig, MountError, Prepared};
use crate::shutdown::{self, Action, DomainPresence};
use crate::status::{self, LauncherView, Observed, PodReady, PodView};

mod migrate;

/// Status writes that lost a race with another writer are recomputed this often at most.
const MAX_CONFLICTS: usize = 5;
/// How often a launcher whose socket has not appeared yet is looked for.
const NOT_READY_RECHECK: Duration = Duration::from_secs(1);
/// How often a running VMI's guest agent is asked for its interfaces (KubeVirt polls the agent
/// every 10 s too).
const GUEST_AGENT_POLL: Duration = Duration::from_secs(10);

/// KubeVirt's `--domain-resync-period-seconds` default.
pub const DEFAULT_RESYNC: Duration = Duration::from_mins(5);

/// What the loop needs to know about the node.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's name (`--hostname-override`).
    pub node: String,
    /// The kubelet's pods dir as the handler sees it (`--kubelet-pods-dir`).
    pub pods_dir: PathBuf,
    /// The launcher's private dir inside its pod (virt-controller renders the same path).
    pub launcher_private_dir: PathBuf,
    /// Concurrent reconciles (KubeVirt runs 10).
    pub workers: usize,
    /// Bound of launcher calls but sync.
    pub call_timeout: Duration,
    /// Bound of a sync, which starts QEMU the first time (the launcher's `--qemu-timeout`).
    pub sync_timeout: Duration,
    /// A launcher socket that stays unanswered this long marks the VMI Failed
    /// (KubeVirt's `--watchdog-timeout`).
    pub watchdog_timeout: Duration,
    /// Where containerDisk and kernelBoot files go in the launcher.
    pub mounts: MountConfig,
    /// Every VMI and every launcher the loop knows is reconciled again this often, whatever
    /// changed (KubeVirt's `--domain-resync-period-seconds`, 300), so state no event announced
    /// (a launcher that went quiet, a write lost to an API server hiccup) is caught up with.
    pub resync_period: Duration,
    /// How this handler talks to other handlers for migrations; `None` without certificates.
    pub migration_transport: Option<crate::migration::Transport>,
    /// This handler's pod address, where a migration target listens (`MY_POD_IP`).
    pub pod_ip: Option<std::net::IpAddr>,
}

impl Config {
    pub fn new(node: &str) -> Self {
        Config {
            node: node.to_owned(),
            pods_dir: PathBuf::from("/var/lib/kubelet/pods"),
            launcher_private_dir: PathBuf::from("/var/run/kubevirt-private"),
            workers: 10,
            call_timeout: Duration::from_secs(10),
            sync_timeout: Duration::from_mins(5),
            watchdog_timeout: Duration::from_secs(30),
            mounts: MountConfig::default(),
            resync_period: DEFAULT_RESYNC,
            migration_transport: None,
            pod_ip: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("the {0} cache never filled (watch of the API server failed)")]
    CacheNotReady(&'static str),
    #[error("stopped before the caches filled")]
    Stopped,
    #[error("detecting this host's cgroup layout")]
    Cgroups(#[from] cgroups::CgroupError),
}

/// Why one reconcile failed; the key is retried with backoff.
#[derive(Debug, thiserror::Error)]
enum ReconcileError {
    #[error("launcher call")]
    Launcher(#[from] ClientError),
    #[error("Kubernetes API")]
    Kube(#[from] kube::Error),
    #[error("detecting the launcher's isolation")]
    Isolation(#[from] isolation::IsolationError),
    #[error("the isolation detection task panicked")]
    Join(#[from] tokio::task::JoinError),
    #[error("mounting the VMI's containerDisk / kernelBoot files")]
    Mounts(#[from] MountError),
    #[error("setting the launcher's device rules")]
    Devices(#[from] DeviceError),
    #[error("plugging the VMI's interfaces into the pod network")]
    Network(#[from] network::NetworkError),
}

/// What a reconcile wants next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Nothing until something changes.
    Done,
    /// Look again after this long (shutdown re-sends, a launcher not up yet).
    After(Duration),
    /// Try again with the key's backoff (a sync the launcher refused).
    Backoff,
}

/// What the loop knows of one VMI's launcher; rebuilt from the launcher after a restart.
#[derive(Debug, Default)]
struct Entry {
    /// The VMI uid this entry belongs to (a VMI recreated under the same name starts afresh).
    uid: String,
    socket: PathBuf,
    /// The launcher's pid (SO_PEERCRED), for its mount root.
    pid: Option<i32>,
    /// The latest domain, from a call or the domain watch.
    domain: Option<Domain>,
    /// The live domain watch: its id and stop token.
    watch: Option<(u64, CancellationToken)>,
    /// The launcher answered at least once.
    seen: bool,
    unreachable_since: Option<Instant>,
    /// The VMI generation last synced successfully, and the hotplugged volumes it had.
    synced: Option<(i64, BTreeSet<String>)>,
    /// When ACPI power-down was last sent.
    signalled_at: Option<Instant>,
    /// When shutdown of a domain whose VMI is gone began.
    orphaned_at: Option<Instant>,
    /// The VMI as `prepare` last set up the pod for it (mounts, network phase 1), so that it
    /// can be undone after the VMI itself is gone.
    prepared: Option<Arc<VirtualMachineInstance>>,
}

/// A VMI's launcher as the console server and metrics see it.
#[derive(Debug, Clone)]
pub struct LauncherInfo {
    pub namespace: String,
    pub name: String,
    pub socket: PathBuf,
    pub pid: Option<i32>,
    pub domain: Option<Domain>,
}

/// The loop's shared state: caches, queue, API access.
pub struct Node {
    cfg: Config,
    client: kube::Client,
    vmis: Store<VirtualMachineInstance>,
    /// VMIs migrating to this node (`kubevirt.io/migrationTargetNodeName`).
    targets: Store<VirtualMachineInstance>,
    pods: Store<Pod>,
    queue: Arc<Queue>,
    /// The running migration proxies, by VMI key, each with its migration's uid: a proxy
    /// left from a failed migration whose VMI has since left this node's target informer must
    /// not serve the next one (its sockets lead into the old target pod).
    proxies: Mutex<HashMap<String, (String, crate::migration::Proxy)>>,
    recorder: Publisher,
    cgroups: cgroups::CgroupSetup,
    entries: Mutex<HashMap<String, Entry>>,
    next_watch: AtomicU64,
    stop: CancellationToken,
    /// Status patches the VMI cache has not caught up with: not sent again from it.
    vmi_writes: informer::ownwrites::OwnWrites,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("cfg", &self.cfg)
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

/// The VMI key of a launcher pod: its controller owner reference.
fn pod_vmi_key(pod: &Pod) -> Option<String> {
    let ns = pod.metadata.namespace.as_deref()?;
    controller_owner(pod, "VirtualMachineInstance").map(|vmi| key_of(Some(ns), vmi))
}

/// Where a pod's launcher socket is, seen from the handler: in the kubelet's directory of that
/// pod's `sockets` emptyDir (KubeVirt mounts the kubelet pods dir as `/pods` in virt-handler).
pub fn pod_socket(pods_dir: &Path, pod_uid: &str) -> PathBuf {
    pods_dir
        .join(pod_uid)
        .join("volumes/kubernetes.io~empty-dir")
        .join(launcher_api::SOCKET)
}

/// The active pod of `vmi` that runs on `node`.
pub fn active_pod_on<'a>(vmi: &'a VirtualMachineInstance, node: &str) -> Option<&'a str> {
    vmi.status
        .as_ref()?
        .active_pods
        .iter()
        .find(|(_, n)| n.as_str() == node)
        .map(|(uid, _)| uid.as_str())
}

/// How the launcher pod looks to `status::compute`.
pub fn pod_view(pod: Option<&Pod>) -> PodView {
    let Some(pod) = pod else {
        return PodView::Absent;
    };
    let st = pod.status.as_ref();
    let phase = st.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    if pod.metadata.deletion_timestamp.is_some() || matches!(phase, "Succeeded" | "Failed") {
        return PodView::Terminating;
    }
    let ready = st
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .map(|c| PodReady {
            ready: c.status == "True",
            reason: c.reason.clone(),
            message: c.message.clone(),
        });
    PodView::Running { ready }
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn since(t: &Time) -> Duration {
    let d = k8s_openapi::jiff::Timestamp::now().duration_since(t.0);
    Duration::try_from(d).unwrap_or(Duration::ZERO)
}

impl Node {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The VMIs of this node, from the informer cache.
    pub fn vmis(&self) -> Vec<Arc<VirtualMachineInstance>> {
        self.vmis.state()
    }

    /// A VMI of this node, or one migrating to it.
    pub fn vmi(&self, namespace: &str, name: &str) -> Option<Arc<VirtualMachineInstance>> {
        let r = ObjectRef::new(name).within(namespace);
        self.vmis.get(&r).or_else(|| self.targets.get(&r))
    }

    /// What the loop knows of each launcher.
    pub fn launchers(&self) -> Vec<LauncherInfo> {
        self.lock()
            .iter()
            .map(|(k, e)| {
                let (ns, name) = split_key(k);
                LauncherInfo {
                    namespace: ns.to_owned(),
                    name: name.to_owned(),
                    socket: e.socket.clone(),
                    pid: e.pid,
                    domain: e.domain.clone(),
                }
            })
            .collect()
    }

    /// The launcher pid of the VMI with this uid, once detected.
    pub fn launcher_pid(&self, namespace: &str, name: &str, uid: &str) -> Option<i32> {
        self.lock()
            .get(&key_of(Some(namespace), name))
            .filter(|e| e.uid == uid)
            .and_then(|e| e.pid)
    }

    /// Queues every VMI of the cache and every launcher the loop knows (one whose VMI is gone
    /// is shut down by its reconcile).
    fn resync(&self) {
        let keys = resync_keys(
            self.vmis.state().iter().filter_map(|v| vmi_key(v)),
            self.lock().keys().cloned(),
        );
        tracing::debug!(keys = keys.len(), "periodic resync");
        for k in &keys {
            self.queue.add(k);
        }
    }

    fn launcher(&self, socket: &Path) -> LauncherClient {
        LauncherClient::new(socket, self.cfg.call_timeout)
    }

    /// The entry for `key`, reset when it belonged to an earlier VMI of that name.
    fn with_entry<T>(&self, key: &str, uid: &str, f: impl FnOnce(&mut Entry) -> T) -> T {
        let mut m = self.lock();
        let e = m.entry(key.to_owned()).or_default();
        if e.uid != uid {
            if let Some((_, t)) = e.watch.take() {
                t.cancel();
            }
            *e = Entry {
                uid: uid.to_owned(),
                ..Entry::default()
            };
        }
        f(e)
    }

    fn forget_entry(&self, key: &str) {
        self.vmi_writes.forget(key);
        if let Some(e) = self.lock().remove(key)
            && let Some((_, t)) = e.watch
        {
            t.cancel();
        }
    }

    /// Starts the domain watch of this launcher unless one runs: every domain change queues
    /// the VMI, and the end of the stream does too.
    fn ensure_watch(self: &Arc<Self>, key: &str, uid: &str, socket: &Path) {
        let id = self.next_watch.fetch_add(1, Ordering::Relaxed);
        let token = self.stop.child_token();
        let started = self.with_entry(key, uid, |e| {
            if e.watch.is_some() {
                return false;
            }
            e.watch = Some((id, token.clone()));
            true
        });
        if !started {
            return;
        }
        let this = Arc::clone(self);
        let (key, uid, socket) = (key.to_owned(), uid.to_owned(), socket.to_owned());
        tokio::spawn(async move {
            this.watch_domain(&key, &uid, &socket, &token).await;
            this.with_entry(&key, &uid, |e| {
                if e.watch.as_ref().is_some_and(|(i, _)| *i == id) {
                    e.watch = None;
                }
            });
            if !token.is_cancelled() {
                this.queue.add(&key);
            }
        });
    }

    async fn watch_domain(&self, key: &str, uid: &str, socket: &Path, token: &CancellationToken) {
        let stream = match self.launcher(socket).watch().await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(key, error = %e, "cannot watch the domain");
                return;
            }
        };
        futures::pin_mut!(stream);
        loop {
            let item = tokio::select! {
                () = token.cancelled() => return,
                item = stream.next() => item,
            };
            match item {
                Some(Ok(d)) => {
                    self.with_entry(key, uid, |e| {
                        e.domain = Some(d);
                        e.seen = true;
                        e.unreachable_since = None;
                    });
                    self.queue.add(key);
                }
                Some(Err(e)) => {
                    tracing::debug!(key, error = %e, "domain watch ended");
                    return;
                }
                None => return,
            }
        }
    }

    async fn record(&self, vmi: &VirtualMachineInstance, events: &[Event]) {
        let reference = vmi.object_ref(&());
        for ev in events {
            let e = informer::events::Event {
                type_: match ev.type_ {
                    EventType::Normal => informer::events::EventType::Normal,
                    EventType::Warning => informer::events::EventType::Warning,
                },
                reason: ev.reason.clone(),
                note: Some(ev.message.clone()),
                action: ev.reason.clone(),
                secondary: None,
            };
            if let Err(err) = self.recorder.publish(&e, &reference).await {
                tracing::warn!(vmi = %vmi.name_any(), reason = %ev.reason, error = %err, "recording an event");
            }
        }
    }

    /// Computes and writes the status; on a conflict, reads the VMI again and recomputes, so
    /// a concurrent write (virt-controller's) is never lost. Records the events of the change.
    async fn write_status(
        &self,
        key: &str,
        vmi: &VirtualMachineInstance,
        obs: &Observed,
    ) -> Result<(), ReconcileError> {
        if self
            .vmi_writes
            .cache_behind(key, vmi.metadata.resource_version.as_deref())
        {
            return Ok(());
        }
        let ns = vmi.namespace().unwrap_or_default();
        let api: Api<VirtualMachineInstance> = Api::namespaced(self.client.clone(), &ns);
        let mut current = vmi.clone();
        for _ in 0..MAX_CONFLICTS {
            let out = status::compute(&current, obs);
            if !out.changed(&current) {
                return Ok(());
            }
            let old = current.status.clone().unwrap_or_default();
            // The VMI CRD has no status subresource: the main resource is patched, the
            // resourceVersion making it a compare-and-swap.
            let patch = cas_status_patch(
                current.metadata.resource_version.as_deref(),
                &old,
                &out.status,
            );
            match api
                .patch(
                    &current.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
            {
                Ok(_) => {
                    self.vmi_writes
                        .wrote(key, current.metadata.resource_version.as_deref());
                    self.record(&current, &out.events).await;
                    return Ok(());
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    tracing::debug!(vmi = %current.name_any(), "status write conflicted; recomputing");
                    current = api.get(&current.name_any()).await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Still racing: the next event for this VMI retries.
        Ok(())
    }

    /// The pod by uid: the cache first, then the API (a pod the cache has not seen yet must not
    /// read as gone, which would fail the VMI).
    async fn pod(
        &self,
        vmi: &VirtualMachineInstance,
        pod_uid: &str,
    ) -> Result<Option<Pod>, ReconcileError> {
        if let Some(p) = self
            .pods
            .state()
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() == Some(pod_uid))
        {
            return Ok(Some((*p).clone()));
        }
        let api: Api<Pod> =
            Api::namespaced(self.client.clone(), &vmi.namespace().unwrap_or_default());
        let lp = ListParams::default().labels(&format!(
            "{}={}",
            labels::CREATED_BY,
            vmi.metadata.uid.as_deref().unwrap_or_default()
        ));
        Ok(api
            .list(&lp)
            .await?
            .items
            .into_iter()
            .find(|p| p.metadata.uid.as_deref() == Some(pod_uid)))
    }

    /// What the launcher says now. A final domain is the last word (the launcher exits right
    /// after it); a live watch keeps the cached domain current; otherwise the launcher is asked.
    /// Unanswered, it is not ready yet, or unresponsive once the watchdog timeout has passed
    /// since it stopped answering. Returns when to look again, if the view may change by itself.
    async fn observe(
        self: &Arc<Self>,
        key: &str,
        vmi: &VirtualMachineInstance,
        socket: &Path,
    ) -> Result<(LauncherView, Option<Duration>), ReconcileError> {
        let uid = vmi.metadata.uid.as_deref().unwrap_or_default();
        let cached = self.with_entry(key, uid, |e| {
            socket.clone_into(&mut e.socket);
            match &e.domain {
                Some(d) if d.state.is_final() || e.watch.is_some() => Some(d.clone()),
                _ => None,
            }
        });
        if let Some(d) = cached {
            return Ok((LauncherView::Answering(Box::new(d)), None));
        }
        match self.launcher(socket).domain().await {
            Ok(d) => {
                self.with_entry(key, uid, |e| {
                    e.domain = Some(d.clone());
                    e.seen = true;
                    e.unreachable_since = None;
                });
                if !d.state.is_final() {
                    self.ensure_watch(key, uid, socket);
                }
                Ok((LauncherView::Answering(Box::new(d)), None))
            }
            Err(e) if e.is_unreachable() => {
                let was_running = vmi
                    .status
                    .as_ref()
                    .is_some_and(|s| s.phase == Some(Phase::Running));
                let exists = socket.exists();
                let watchdog = self.cfg.watchdog_timeout;
                let elapsed = self.with_entry(key, uid, |en| {
                    if !exists && !en.seen && !was_running {
                        return None;
                    }
                    Some(
                        en.unreachable_since
                            .get_or_insert_with(Instant::now)
                            .elapsed(),
                    )
                });
                match elapsed {
                    None => Ok((LauncherView::NotReady, Some(NOT_READY_RECHECK))),
                    Some(el) if el >= watchdog => {
                        tracing::warn!(key, socket = %socket.display(), error = %e, "virt-launcher is unresponsive");
                        Ok((LauncherView::Unresponsive, None))
                    }
                    Some(el) => {
                        tracing::debug!(key, error = %e, "launcher not answering");
                        let left = watchdog.saturating_sub(el);
                        Ok((LauncherView::NotReady, Some(left.min(NOT_READY_RECHECK))))
                    }
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Detects the launcher's isolation, lets its cgroup open the VM's devices, and makes the
    /// VMI's containerDisk and kernelBoot files and its hotplugged volumes visible in it
    /// (idempotent), unmounting hotplugged volumes the guest (`in_domain`) no longer has and
    /// the spec no longer wants. `Some(reason)`: an image container does not serve yet; and
    /// the hotplugged volumes mounted.
    async fn prepare(
        &self,
        key: &str,
        vmi: &Arc<VirtualMachineInstance>,
        pod_uid: &str,
        in_domain: BTreeSet<String>,
    ) -> Result<(Option<String>, BTreeSet<String>), ReconcileError> {
        let uid = vmi.metadata.uid.as_deref().unwrap_or_default();
        self.with_entry(key, uid, |e| e.prepared = Some(Arc::clone(vmi)));
        let path = pod_socket(&self.cfg.pods_dir, pod_uid);
        let pod_uid = pod_uid.to_owned();
        let v = VirtualMachineInstance::clone(vmi);
        let cfg = self.cfg.mounts.clone();
        let setup = self.cgroups.clone();
        let private_dir = self.cfg.launcher_private_dir.clone();
        let pods_dir = self.cfg.pods_dir.clone();
        // Blocking: detection reads /proc; mounts and network phase 1 enter the pod's
        // namespaces on threads of their own.
        let (pid, prepared, hot) = tokio::task::spawn_blocking(move || {
            let iso = isolation::detect_from_socket(&path)?;
            // Like the mounts, the pod's bridge, tap and NAT must be there before the sync
            // below starts QEMU; phase 1 is idempotent, so every reconcile runs it.
            network::phase1::setup(&v, &iso, &private_dir)?;
            let prepared = mounts::prepare(&v, &iso, &cfg)?;
            let hot = hotplug::mount(&v, &iso, &pods_dir, &cfg.hotplug_disk_dir)?;
            // Only a VMI with hotplug entries can have images to unmount: an unplugged volume
            // keeps its entry until virt-controller sees it unmounted.
            let unplugged = if hotplug::has_hotplug_entries(&v) {
                let keep: BTreeSet<String> =
                    hotplug::plan(&v).into_iter().map(|p| p.volume).collect();
                hotplug::unmount_unused(&iso, &cfg.hotplug_disk_dir, &keep, &in_domain)?.block
            } else {
                Vec::new()
            };
            // QEMU opens /dev/kvm, /dev/net/tun and /dev/vhost-net (those the host has), the
            // pod's block claims and the hotplugged ones; unplugged ones are taken away.
            let mut block = devices::mapped_block_devices(&pods_dir, &pod_uid);
            block.extend(&hot.block);
            let wanted = devices::Wanted {
                char_devices: devices::host_vm_devices(Path::new("/dev")),
                block,
                unplugged_block: unplugged,
            };
            devices::apply(&setup, &iso, &wanted)?;
            Ok::<_, ReconcileError>((iso.pid, prepared, hot))
        })
        .await??;
        self.with_entry(key, uid, |e| e.pid = Some(pid));
        for (volume, why) in &hot.waiting {
            tracing::debug!(key, %volume, %why, "waiting for a hotplug attachment pod");
        }
        let waiting = match prepared {
            Prepared::Ready { mounted, .. } => {
                if !mounted.is_empty() {
                    tracing::info!(key, ?mounted, "image files mounted into the launcher");
                }
                None
            }
            Prepared::NotReady {
                field,
                socket,
                reason,
            } => Some(format!("{field}: {} not ready: {reason}", socket.display())),
        };
        Ok((waiting, hot.ready))
    }

    /// Syncs the VMI unless this generation already was (the launcher treats a repeated sync
    /// as a no-op, so a restarted handler syncing once more leaves the VM as it is). Returns
    /// the launcher's refusal, for the `Synchronized` condition.
    async fn sync(
        &self,
        key: &str,
        vmi: &VirtualMachineInstance,
        socket: &Path,
        domain: &Domain,
        hotplug_mounted: &BTreeSet<String>,
    ) -> Result<Option<String>, ReconcileError> {
        let uid = vmi.metadata.uid.as_deref().unwrap_or_default();
        let generation = vmi.metadata.generation.unwrap_or_default();
        let state = (generation, hotplug_mounted.clone());
        let synced = self.with_entry(key, uid, |e| e.synced.as_ref() == Some(&state));
        if domain.state.is_final()
            || (synced && domain.state != launcher_api::domain::DomainState::NoState)
        {
            return Ok(None);
        }
        let c = LauncherClient::new(socket, self.cfg.sync_timeout);
        match c
            .sync(&hotplug::without_unmounted(vmi, hotplug_mounted))
            .await
        {
            Ok(d) => {
                self.with_entry(key, uid, |e| {
                    e.synced = Some(state);
                    if e.watch.is_none() {
                        e.domain = Some(d);
                    }
                });
                Ok(None)
            }
            Err(ClientError::Api { error, .. }) => Ok(Some(error.message)),
            Err(e) => Err(e.into()),
        }
    }

    async fn guest_os(
        &self,
        vmi: &VirtualMachineInstance,
        socket: &Path,
        domain: &Domain,
    ) -> Option<api::status::VirtualMachineInstanceGuestOsInfo> {
        let known = vmi
            .status
            .as_ref()
            .and_then(|s| s.guest_os_info.as_ref())
            .is_some_and(|g| g.name.is_some());
        if known || !domain.agent_connected {
            return None;
        }
        match self.launcher(socket).guest_osinfo().await {
            Ok(q) => Some(guestinfo::os_info(q)),
            Err(e) => {
                tracing::debug!(vmi = %vmi.name_any(), error = %e, "guest OS info");
                None
            }
        }
    }

    async fn guest_interfaces(
        &self,
        vmi: &VirtualMachineInstance,
        socket: &Path,
    ) -> Option<Vec<launcher_api::guest::AgentInterface>> {
        match self.launcher(socket).guest_interfaces().await {
            Ok(ifaces) => Some(ifaces),
            Err(e) => {
                tracing::debug!(vmi = %vmi.name_any(), error = %e, "guest network interfaces");
                None
            }
        }
    }

    /// One VMI, start to end.
    async fn reconcile(self: &Arc<Self>, key: &str) -> Result<Next, ReconcileError> {
        let (ns, name) = split_key(key);
        let Some(vmi) = self.vmi(ns, name) else {
            return self.orphan(key).await;
        };
        if vmi
            .status
            .as_ref()
            .and_then(|s| s.phase.as_ref())
            .is_some_and(Phase::is_final)
        {
            return self.finished(key, &vmi).await;
        }
        if migrate::is_target(&vmi, &self.cfg.node) {
            return self.reconcile_target(key, &vmi).await;
        }
        // Scheduled elsewhere (or not yet): nothing of ours runs it.
        let Some(pod_uid) = active_pod_on(&vmi, &self.cfg.node).map(str::to_owned) else {
            return Ok(Next::Done);
        };
        let pod = self.pod(&vmi, &pod_uid).await?;
        let socket = pod_socket(&self.cfg.pods_dir, &pod_uid);
        let (mut launcher, mut recheck) = self.observe(key, &vmi, &socket).await?;
        if let LauncherView::Answering(d) = &launcher
            && migrate::migrated_away(d)
        {
            // The guest runs on the target, which writes the status from now on.
            self.source_step(key, &vmi, &socket, d).await?;
            return Ok(Next::Done);
        }
        let mut sync_error = None;
        let mut guest_os = None;
        let mut guest_interfaces = None;
        let mut hotplug_mounted = BTreeSet::new();

        if let Some(deleted) = &vmi.metadata.deletion_timestamp {
            recheck = self
                .shut_down(key, &vmi, &socket, &launcher, since(deleted))
                .await?;
        } else if let LauncherView::Answering(d) = &launcher
            && !d.state.is_final()
        {
            let in_domain = d.disks.iter().map(|disk| disk.name.clone()).collect();
            match self.prepare(key, &vmi, &pod_uid, in_domain).await {
                Ok((None, mounted)) => {
                    sync_error = self.sync(key, &vmi, &socket, d, &mounted).await?;
                    hotplug_mounted = mounted;
                    let (view, again) = self.observe(key, &vmi, &socket).await?;
                    let mut agent_poll = None;
                    if let LauncherView::Answering(d) = &view {
                        guest_os = self.guest_os(&vmi, &socket, d).await;
                        if d.agent_connected && !d.interfaces.is_empty() {
                            guest_interfaces = self.guest_interfaces(&vmi, &socket).await;
                            // Addresses change inside the guest (DHCP after boot) without
                            // a domain event: poll them, as KubeVirt's agent poller does.
                            agent_poll = Some(GUEST_AGENT_POLL);
                        }
                    }
                    if let LauncherView::Answering(d) = &view {
                        self.source_step(key, &vmi, &socket, d).await?;
                    }
                    launcher = view;
                    recheck = again.or(agent_poll);
                }
                Ok((Some(waiting), _)) => {
                    tracing::debug!(key, %waiting, "waiting for an image container");
                    recheck = Some(NOT_READY_RECHECK);
                }
                // A volume the handler cannot provide fails the sync, as in KubeVirt.
                Err(ReconcileError::Mounts(e)) => sync_error = Some(error_chain(&e)),
                Err(e) => return Err(e),
            }
        }
        let sync_error = sync_error.or_else(|| match &launcher {
            LauncherView::Answering(d) => d.sync_error.clone(),
            _ => None,
        });
        let obs = Observed {
            launcher,
            pod: pod_view(pod.as_ref()),
            guest_os,
            guest_interfaces,
            sync_error: sync_error.clone(),
            hotplug_mounted,
            now: now(),
        };
        self.write_status(key, &vmi, &obs).await?;
        Ok(match (sync_error, recheck) {
            (Some(e), _) => {
                tracing::info!(key, error = %e, "the launcher refused the sync");
                Next::Backoff
            }
            (None, Some(d)) => Next::After(d),
            (None, None) => Next::Done,
        })
    }

    /// Graceful deletion: power-down, re-sent until the grace period ends, then kill.
    async fn shut_down(
        &self,
        key: &str,
        vmi: &VirtualMachineInstance,
        socket: &Path,
        launcher: &LauncherView,
        elapsed: Duration,
    ) -> Result<Option<Duration>, ReconcileError> {
        let uid = vmi.metadata.uid.as_deref().unwrap_or_default();
        let presence = match launcher {
            LauncherView::Answering(d) => DomainPresence::Alive(d.state),
            LauncherView::NotReady | LauncherView::Unresponsive => DomainPresence::Gone,
        };
        let last = self.with_entry(key, uid, |e| e.signalled_at.map(|t| t.elapsed()));
        let action = shutdown::decide(
            vmi.spec.termination_grace_period_seconds,
            elapsed,
            last,
            presence,
        );
        self.act(key, uid, socket, action, Some(vmi)).await
    }

    async fn act(
        &self,
        key: &str,
        uid: &str,
        socket: &Path,
        action: Action,
        vmi: Option<&VirtualMachineInstance>,
    ) -> Result<Option<Duration>, ReconcileError> {
        let c = self.launcher(socket);
        let (event, recheck) = match action {
            Action::Done => return Ok(None),
            Action::Wait { recheck } => return Ok(Some(recheck)),
            Action::Shutdown { recheck, event } => {
                tracing::info!(key, "ACPI power-down");
                c.shutdown().await?;
                self.with_entry(key, uid, |e| e.signalled_at = Some(Instant::now()));
                (event, recheck)
            }
            Action::Kill { event } => {
                tracing::info!(key, "grace period over: killing the domain");
                c.kill().await?;
                (Some(event), Duration::from_secs(1))
            }
        };
        if let (Some(ev), Some(vmi)) = (event, vmi) {
            self.record(vmi, &[ev]).await;
        }
        Ok(Some(recheck))
    }

    /// A final VMI: make sure nothing of it still runs, then forget it.
    async fn finished(
        &self,
        key: &str,
        vmi: &VirtualMachineInstance,
    ) -> Result<Next, ReconcileError> {
        let uid = vmi.metadata.uid.as_deref().unwrap_or_default();
        let live = {
            let m = self.lock();
            m.get(key)
                .filter(|e| e.uid == uid)
                .and_then(|e| e.domain.as_ref().map(|d| (e.socket.clone(), d.state)))
                .filter(|(_, s)| !s.is_final())
        };
        if let Some((socket, _)) = live {
            match self.launcher(&socket).kill().await {
                Ok(_) => {}
                Err(e) if e.is_unreachable() => {}
                Err(e) => return Err(e.into()),
            }
        }
        // The loop's own record, else (after a handler restart) the VMI's active pod here.
        let socket = self
            .lock()
            .get(key)
            .filter(|e| e.uid == uid)
            .map(|e| e.socket.clone())
            .or_else(|| {
                active_pod_on(vmi, &self.cfg.node).map(|pod| pod_socket(&self.cfg.pods_dir, pod))
            });
        if let Some(socket) = socket {
            self.release(key, vmi, socket).await;
        }
        self.forget_entry(key);
        Ok(Next::Done)
    }

    /// Undoes in a pod that outlives its VMI what `prepare` did there, as KubeVirt's
    /// `processVmCleanup` does: the image files' mounts and network phase 1 (tap, bridge, NAT
    /// tables and the interface cache go; a bridged pod interface gets its address back). It
    /// goes through the launcher, which must still run; one that is gone took its mounts
    /// along, and its pod's network namespace goes with the pod.
    async fn release(&self, key: &str, vmi: &VirtualMachineInstance, socket: PathBuf) {
        let v = vmi.clone();
        let cfg = self.cfg.mounts.clone();
        let private_dir = self.cfg.launcher_private_dir.clone();
        let done = tokio::task::spawn_blocking(move || {
            let iso = isolation::detect_from_socket(&socket)?;
            Ok::<_, isolation::IsolationError>((
                mounts::cleanup(&v, &iso, &cfg),
                network::phase1::teardown(&v, &iso, &private_dir),
            ))
        })
        .await;
        let (unmounted, network) = match done {
            Ok(Ok(results)) => results,
            Ok(Err(e)) => {
                tracing::debug!(key, error = %e, "no launcher left to clean up in");
                return;
            }
            Err(e) => {
                tracing::warn!(key, error = %e, "the clean-up task panicked");
                return;
            }
        };
        match unmounted {
            Ok(0) => {}
            Ok(n) => tracing::info!(key, unmounted = n, "image files unmounted"),
            Err(e) => tracing::warn!(key, error = %error_chain(&e), "unmounting image files"),
        }
        match network {
            Ok(()) if vmi.spec.domain.devices.interfaces.is_empty() => {}
            Ok(()) => tracing::info!(key, "pod network torn down"),
            Err(e) => tracing::warn!(key, error = %error_chain(&e), "tearing down the pod network"),
        }
    }

    /// The VMI is gone (its finalizer was forced off): stop a domain still running for it,
    /// gracefully with KubeVirt's default grace period, then forget it.
    async fn orphan(&self, key: &str) -> Result<Next, ReconcileError> {
        let state = {
            let mut m = self.lock();
            m.get_mut(key).map(|e| {
                let since = *e.orphaned_at.get_or_insert_with(Instant::now);
                let last = e.signalled_at.map(|t| t.elapsed());
                (e.uid.clone(), e.socket.clone(), last, since.elapsed())
            })
        };
        let Some((uid, socket, last, elapsed)) = state else {
            return Ok(Next::Done);
        };
        // A VMI handed from the target informer to the node's (a migration just ended here)
        // is briefly in neither cache: ask the API before powering anything down.
        let (ns, name) = split_key(key);
        let api: Api<VirtualMachineInstance> = Api::namespaced(self.client.clone(), ns);
        if let Some(v) = api.get_opt(name).await?
            && v.metadata.uid.as_deref() == Some(uid.as_str())
            && [labels::NODE_NAME, labels::MIGRATION_TARGET_NODE_NAME]
                .iter()
                .any(|l| v.labels().get(*l) == Some(&self.cfg.node))
        {
            return Ok(Next::After(NOT_READY_RECHECK));
        }
        let presence = match self.launcher(&socket).domain().await {
            Ok(d) => DomainPresence::Alive(d.state),
            Err(_) => DomainPresence::Gone,
        };
        let action = shutdown::decide(None, elapsed, last, presence);
        if let Some(d) = self.act(key, &uid, &socket, action, None).await? {
            return Ok(Next::After(d));
        }
        let prepared = self.lock().get(key).and_then(|e| e.prepared.clone());
        if let Some(vmi) = prepared {
            self.release(key, &vmi, socket).await;
        }
        self.forget_entry(key);
        Ok(Next::Done)
    }
}

/// `e` and its causes, `: `-separated, for one log line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

async fn worker(node: Arc<Node>) {
    while let Some(key) = node.queue.pop().await {
        let span = tracing::info_span!("reconcile", vmi = %key);
        // Boxed: a reconcile's future is large and lives as long as a launcher call.
        let result = Box::pin(tracing::Instrument::instrument(node.reconcile(&key), span)).await;
        match result {
            Ok(Next::Done) => node.queue.forget(&key),
            Ok(Next::After(d)) => {
                node.queue.forget(&key);
                node.queue.add_after(&key, d);
            }
            Ok(Next::Backoff) => {
                node.queue.add_rate_limited(&key);
            }
            Err(e) => {
                let delay = node.queue.add_rate_limited(&key);
                tracing::warn!(vmi = %key, error = %error_chain(&e), retry_in = ?delay, "reconcile failed");
            }
        }
        node.queue.done(&key);
    }
}

/// A watch handler queueing the key `key_of` gives for each changed object.
fn queue_key<K>(queue: Arc<Queue>, key_of: fn(&K) -> Option<String>) -> impl Fn(Seen<'_, K>) {
    move |seen| {
        if let Some(k) = key_of(seen.object()) {
            queue.add(&k);
        }
    }
}

/// The keys a resync queues: each VMI and each launcher entry, once.
fn resync_keys(
    vmis: impl Iterator<Item = String>,
    entries: impl Iterator<Item = String>,
) -> std::collections::BTreeSet<String> {
    vmis.chain(entries).collect()
}

fn vmi_key(v: &VirtualMachineInstance) -> Option<String> {
    Some(key_of(
        Some(v.metadata.namespace.as_deref()?),
        v.metadata.name.as_deref()?,
    ))
}

/// Starts the loop: the VMI and launcher-pod watches of this node and `cfg.workers` workers.
/// Returns once the caches have filled; the loop runs until `stop`.
pub async fn start(
    client: kube::Client,
    cfg: Config,
    stop: CancellationToken,
) -> Result<(Arc<Node>, tokio::task::JoinHandle<()>), NodeError> {
    let cgroups = cgroups::CgroupSetup::detect()?;
    let queue = Arc::new(Queue::default());
    let mut tasks = JoinSet::new();
    let vmis = reflect(
        &mut tasks,
        Api::<VirtualMachineInstance>::all(client.clone()),
        watcher::Config::default().labels(&format!("{}={}", labels::NODE_NAME, cfg.node)),
        keep_all,
        queue_key(Arc::clone(&queue), vmi_key),
    );
    let targets = reflect(
        &mut tasks,
        Api::<VirtualMachineInstance>::all(client.clone()),
        watcher::Config::default().labels(&format!(
            "{}={}",
            labels::MIGRATION_TARGET_NODE_NAME,
            cfg.node
        )),
        keep_all,
        queue_key(Arc::clone(&queue), vmi_key),
    );
    let pods = reflect(
        &mut tasks,
        Api::<Pod>::all(client.clone()),
        watcher::Config::default()
            .labels(&format!("{}=virt-launcher", labels::APP))
            .fields(&format!("spec.nodeName={}", cfg.node)),
        keep_all,
        queue_key(Arc::clone(&queue), pod_vmi_key),
    );
    let ready = tokio::select! {
        () = stop.cancelled() => None,
        r = async {
            let _ = targets.wait_until_ready().await;
            (vmis.wait_until_ready().await, pods.wait_until_ready().await)
        } => Some(r),
    };
    match ready {
        Some((Ok(()), Ok(()))) => {}
        Some((Err(_), _)) => return Err(NodeError::CacheNotReady("VirtualMachineInstance")),
        Some((_, Err(_))) => return Err(NodeError::CacheNotReady("Pod")),
        None => {
            tasks.shutdown().await;
            return Err(NodeError::Stopped);
        }
    }
    let recorder = Publisher::new(
        client.clone(),
        Reporter {
            controller: "virt-handler".into(),
            instance: Some(cfg.node.clone()),
        },
    );
    let node = Arc::new(Node {
        cfg,
        client,
        vmis,
        targets,
        pods,
        queue,
        proxies: Mutex::default(),
        recorder,
        cgroups,
        entries: Mutex::default(),
        next_watch: AtomicU64::new(0),
        stop: stop.clone(),
        vmi_writes: informer::ownwrites::OwnWrites::default(),
    });
    for _ in 0..node.cfg.workers.max(1) {
        tasks.spawn(worker(Arc::clone(&node)));
    }
    {
        let node = Arc::clone(&node);
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(node.cfg.resync_period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The first tick is immediate, and the caches' initial lists queued everything.
            tick.tick().await;
            loop {
                tick.tick().await;
                node.resync();
            }
        });
    }
    tracing::info!(node = %node.cfg.node, "caches synced; node loop running");
    let n = Arc::clone(&node);
    let handle = tokio::spawn(async move {
        stop.cancelled().await;
        n.queue.shut_down();
        tasks.shutdown().await;
    });
    Ok((node, handle))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::{Value, json};

    #[test]
    fn status_patch_sends_changed_keys_nulls_and_the_resource_version() {
        let old = api::VirtualMachineInstanceStatus {
            phase: Some(Phase::Scheduled),
            node_name: Some("node-a".into()),
            reason: Some("x".into()),
            ..Default::default()
        };
        let new = api::VirtualMachineInstanceStatus {
            phase: Some(Phase::Running),
            node_name: Some("node-a".into()),
            ..Default::default()
        };
        assert_eq!(
            cas_status_patch(Some("42"), &old, &new),
            json!({"metadata": {"resourceVersion": "42"}, "status": {"phase": "Running", "reason": null}})
        );
    }

    #[test]
    fn active_pod_and_pod_view() {
        let vmi: VirtualMachineInstance = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "a", "namespace": "default"},
            "spec": {"domain": {"devices": {}}},
            "status": {"activePods": {"p1": "node-b", "p2": "node-a"}},
        }))
        .expect("vmi");
        assert_eq!(active_pod_on(&vmi, "node-a"), Some("p2"));
        assert_eq!(active_pod_on(&vmi, "node-c"), None);

        assert_eq!(pod_view(None), PodView::Absent);
        let pod = |v: Value| -> Pod { serde_json::from_value(v).expect("pod") };
        assert_eq!(
            pod_view(Some(&pod(json!({"status": {"phase": "Succeeded"}})))),
            PodView::Terminating
        );
        assert_eq!(
            pod_view(Some(&pod(
                json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}, "status": {"phase": "Running"}})
            ))),
            PodView::Terminating
        );
        assert_eq!(
            pod_view(Some(&pod(
                json!({"status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}]}})
            ))),
            PodView::Running {
                ready: Some(PodReady {
                    ready: false,
                    reason: Some("ContainersNotReady".into()),
                    message: None
                })
            }
        );
        assert_eq!(
            pod_view(Some(&pod(json!({"status": {"phase": "Running"}})))),
            PodView::Running { ready: None }
        );
    }

    #[test]
    fn a_resync_queues_every_vmi_and_every_launcher_once() {
        let keys = resync_keys(
            ["default/a".to_owned(), "default/b".to_owned()].into_iter(),
            ["default/b".to_owned(), "gone/c".to_owned()].into_iter(),
        );
        assert_eq!(
            keys.into_iter().collect::<Vec<_>>(),
            ["default/a", "default/b", "gone/c"]
        );
    }

    #[test]
    fn launcher_pods_map_to_their_vmi() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "virt-launcher-a-x", "namespace": "ns", "ownerReferences": [
                {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": "a",
                 "uid": "u", "controller": true}]},
        }))
        .expect("pod");
        assert_eq!(pod_vmi_key(&p).as_deref(), Some("ns/a"));
        assert_eq!(pod_vmi_key(&Pod::default()), None);
    }
}
