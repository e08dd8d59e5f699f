//! The process kubelet: one simulated node whose pods run as real processes.
//!
//! A client of the API server like the real kubelet: it registers its Node, heartbeats the Node
//! status and a Lease in `kube-node-lease`, watches the pods bound to it, and runs each one in
//! its own network namespace (veth to the node bridge, an address from the node's pod CIDR),
//! mount namespace (an overlay root with the pod's volumes bind-mounted) and cgroups. See
//! `docs/kubelet.md`.

pub mod api;
pub mod cgroup;
mod checkpoint;
pub mod cluster;
pub mod cpumanager;
pub mod deviceplugin;
pub mod network;
pub mod node;
pub mod probe;
pub mod serviceaccount;
pub mod spawn;
pub mod status;
pub mod volumes;
mod worker;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use network::{PodCidr, PodNetwork};

/// Why the kubelet or one of its pods failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("{path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("running `{command}`")]
    Tool {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed: {stderr}")]
    Network { command: String, stderr: String },
    #[error(
        "the container has nothing to run: neither `command`/`args` nor the image's entrypoint/cmd"
    )]
    NoCommand,
    #[error("starting {program}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("volume {volume:?}: {message}")]
    Volume { volume: String, message: String },
    #[error("{what}")]
    Api { what: String, source: kube::Error },
    #[error("image {image:?}")]
    Image {
        image: String,
        source: ociimage::StoreError,
    },
    #[error(
        "image {image:?} runs as user {user:?}: only root is supported (the process kubelet does not switch users)"
    )]
    ImageUser { image: String, user: String },
    #[error("the pod CIDR {cidr} has no free address")]
    AddressesExhausted { cidr: String },
    #[error("device plugin resource {resource}: {message}")]
    Device { resource: String, message: String },
    #[error("the process kubelet needs root (it creates namespaces, mounts and cgroups)")]
    NotRoot,
}

/// One simulated node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub name: String,
    /// The node's root, standing in for `/` of its host paths (`var/lib/kubelet`, ...).
    pub root: PathBuf,
    pub pod_cidr: PodCidr,
    /// The node bridge (at most 15 bytes).
    pub bridge: String,
    /// The images containers run from.
    pub images: std::sync::Arc<ociimage::Store>,
    pub labels: BTreeMap<String, String>,
    /// Extra allocatable resources, e.g. `devices.kubevirt.io/kvm: "1k"`.
    pub extended_resources: BTreeMap<String, String>,
    pub cpu: String,
    pub memory: String,
    pub max_pods: u32,
    pub heartbeat: Duration,
    /// The first crash back-off step; it doubles up to 30 times this.
    pub restart_backoff: Duration,
    /// The address of the node (Node InternalIP, hostNetwork pods' IP).
    pub host_ip: String,
    /// The kubelet API kube-apiserver dials (logs, exec, port-forward); `None` serves none.
    pub serving: Option<Serving>,
    /// `--cpu-manager-policy` and `--reserved-cpus`.
    pub cpu_manager: cpumanager::CpuManagerPolicy,
}

/// How the kubelet serves its API: HTTPS on the node's address, client certificates from the
/// cluster CA (kube-apiserver's `--kubelet-client-certificate`) required.
#[derive(Clone)]
pub struct Serving {
    /// 0 picks a free one; the Node's `status.daemonEndpoints` names the one bound.
    pub port: u16,
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: String,
}

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serving")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl NodeConfig {
    /// A node named `name` rooted at `<base>/<name>` with the machine's cpus and memory.
    pub fn new(
        name: &str,
        base: &Path,
        pod_cidr: PodCidr,
        images: std::sync::Arc<ociimage::Store>,
    ) -> Self {
        let cpu = std::thread::available_parallelism()
            .map_or(1, std::num::NonZero::get)
            .to_string();
        let memory = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| node::parse_meminfo(&t))
            .unwrap_or_else(|| "1Gi".into());
        Self {
            name: name.into(),
            root: base.join(name),
            pod_cidr,
            bridge: format!("lc-{}", &name[..name.len().min(12)]),
            images,
            labels: BTreeMap::new(),
            extended_resources: BTreeMap::new(),
            cpu,
            memory,
            max_pods: 110,
            heartbeat: Duration::from_secs(10),
            restart_backoff: Duration::from_secs(10),
            host_ip: node::host_ip(),
            serving: None,
            cpu_manager: cpumanager::CpuManagerPolicy::default_for(&cpumanager::online_cpus()),
        }
    }

    /// `<root>/var/lib/kubelet`.
    pub fn kubelet_dir(&self) -> PathBuf {
        self.root.join("var/lib/kubelet")
    }

    /// `<root>/var/lib/kubelet/pods`.
    pub fn pods_dir(&self) -> PathBuf {
        self.kubelet_dir().join("pods")
    }

    /// `<root>/var/log/pods`.
    pub fn log_dir(&self) -> PathBuf {
        self.root.join("var/log/pods")
    }

    fn facts(&self) -> node::NodeFacts {
        node::NodeFacts {
            name: self.name.clone(),
            host_ip: self.host_ip.clone(),
            pod_cidr: self.pod_cidr.to_string(),
            cpu: self.cpu.clone(),
            memory: self.memory.clone(),
            pods: self.max_pods.to_string(),
            labels: self.labels.clone(),
            extended_resources: self.extended_resources.clone(),
            device_resources: BTreeMap::new(),
            hugepages: node::hugepages(Path::new("/sys/kernel/mm/hugepages")),
            kubelet_port: 0,
        }
    }
}

/// The cgroup (below the pod's) of a pod's pause process; not a DNS label, so no container
/// can have it.
pub(crate) const PAUSE_CGROUP: &str = "pod_pause";

/// What a pod holds on the node, so it can be released even if its worker is gone.
#[derive(Debug, Clone)]
pub(crate) struct Sandbox {
    pub network: Option<PodNetwork>,
    /// The pause process holding the pod's PID namespace (none for `hostPID` pods).
    pub pause: Option<u32>,
    pub cgroup: cgroup::Cgroup,
    pub pod_dir: PathBuf,
    pub log_dir: PathBuf,
}

impl Sandbox {
    /// Kills every process of the pod and removes its cgroups, netns, veth and directories.
    /// Blocking.
    pub fn teardown(&self) {
        self.cgroup.destroy();
        if let Some(n) = &self.network {
            n.delete();
        }
        volumes::unmount_below(&self.pod_dir);
        for dir in [&self.pod_dir, &self.log_dir] {
            if dir.exists()
                && let Err(e) = std::fs::remove_dir_all(dir)
            {
                tracing::warn!(dir = %dir.display(), error = %e, "removing a pod directory");
            }
        }
    }
}

pub(crate) struct Shared {
    pub config: NodeConfig,
    pub client: Client,
    pub sandboxes: Mutex<HashMap<String, Sandbox>>,
    pub addresses: Mutex<BTreeSet<Ipv4Addr>>,
    pub devices: Arc<deviceplugin::DeviceManager>,
    /// Where the kubelet API listens (0: it does not).
    pub api_port: u16,
    /// Outlives this kubelet: a restarted one takes it over with the pods.
    pub exits: Arc<checkpoint::ContainerExits>,
    pub cpus: cpumanager::CpuManager,
}

impl Shared {
    /// The node's facts with the device plugins' resources as they are now.
    fn facts(&self) -> node::NodeFacts {
        let mut facts = self.config.facts();
        facts.device_resources = self.devices.counts();
        facts.kubelet_port = self.api_port;
        facts
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("node", &self.config.name)
            .finish_non_exhaustive()
    }
}

/// A running kubelet. [`Kubelet::stop`] stops it cleanly; dropping it kills its pods and
/// removes what they held (blocking) without touching the API; [`Kubelet::restart`] replaces
/// it with a new one that adopts its pods.
#[derive(Debug)]
pub struct Kubelet {
    shared: Arc<Shared>,
    halt: watch::Sender<Halt>,
    pods: Option<JoinHandle<()>>,
    heartbeat: JoinHandle<()>,
    api: Option<JoinHandle<()>>,
}

/// A node whose kubelet ended with its pods running. Dropped without [`Abandoned::start`],
/// its pods run on unattended until the next [`Kubelet::start`] of the node removes them.
pub struct Abandoned {
    client: Client,
    config: NodeConfig,
    exits: Arc<checkpoint::ContainerExits>,
}

impl std::fmt::Debug for Abandoned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Abandoned")
            .field("node", &self.config.name)
            .finish_non_exhaustive()
    }
}

impl Abandoned {
    /// Starts a new kubelet that adopts every pod from its checkpoint (a pod the API no longer
    /// has is released), reports their status again and goes on. Device plugins register
    /// again, as with the real kubelet.
    pub async fn start(self) -> Result<Kubelet, KubeletError> {
        Kubelet::boot(self.client, self.config, Some(self.exits)).await
    }
}

/// What the pod loop and its workers are told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Halt {
    Run,
    /// Stop every pod and release what it held.
    Stop,
    /// End at once and leave the pods running, for the next kubelet to adopt.
    Abandon,
}

fn now() -> String {
    format!("{:.0}", jiff::Timestamp::now())
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> KubeletError {
    let what = what.into();
    move |source| KubeletError::Api { what, source }
}

impl Kubelet {
    /// Prepares the node (directories, bridge, cgroup), registers its Node and starts
    /// heartbeats and the pod loop. Whatever an earlier kubelet of this node left is removed.
    pub async fn start(client: Client, config: NodeConfig) -> Result<Self, KubeletError> {
        Self::boot(client, config, None).await
    }

    /// Restarts the kubelet as a crash and a new start would, except that the pods keep
    /// running (as a container runtime keeps them when the real kubelet restarts): see
    /// [`Kubelet::abandon`] and [`Abandoned::start`].
    pub async fn restart(self) -> Result<Self, KubeletError> {
        self.abandon().await.start().await
    }

    /// Ends the kubelet as a crash would, leaving its pods running: its pod workers, probes,
    /// heartbeats, device-plugin registrations and API server end where they are.
    pub async fn abandon(mut self) -> Abandoned {
        let _ = self.halt.send(Halt::Abandon);
        if let Some(pods) = self.pods.take() {
            let _ = pods.await;
        }
        self.heartbeat.abort();
        if let Some(api) = self.api.take() {
            api.abort();
            let _ = api.await;
        }
        self.shared.devices.stop();
        let mut config = self.shared.config.clone();
        // The Node's daemonEndpoints named the bound port: kube-apiserver dials it again.
        if let Some(serving) = &mut config.serving {
            serving.port = self.shared.api_port;
        }
        let (client, exits) = (self.shared.client.clone(), self.shared.exits.clone());
        tracing::info!(node = %config.name, "kubelet ended; its pods keep running");
        drop(self);
        Abandoned {
            client,
            config,
            exits,
        }
    }

    /// Starts the kubelet: fresh (`adopting` none), or adopting the pods of the one whose
    /// container exits are `adopting`.
    async fn boot(
        client: Client,
        config: NodeConfig,
        adopting: Option<Arc<checkpoint::ContainerExits>>,
    ) -> Result<Self, KubeletError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(KubeletError::NotRoot);
        }
        for dir in [
            config.pods_dir(),
            config.log_dir(),
            config.root.join("var/run/kubevirt"),
            config.kubelet_dir().join("device-plugins"),
        ] {
            std::fs::create_dir_all(&dir).map_err(|source| KubeletError::Io {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let node = config.clone();
        let adopted = if adopting.is_some() {
            tokio::task::spawn_blocking(move || recover(&node))
                .await
                .unwrap_or_default()
        } else {
            let _ = tokio::task::spawn_blocking(move || sweep_stale(&node)).await;
            HashMap::new()
        };
        network::ensure_bridge(&config.bridge, config.pod_cidr)?;
        cgroup::Cgroup::node(&config.name).create()?;
        let listener = match &config.serving {
            Some(serving) => Some(api::bind(&config.host_ip, serving.port).await?),
            None => None,
        };
        let api_port = listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map_or(0, |a| a.port());
        let mut facts = config.facts();
        facts.kubelet_port = api_port;
        register(&client, &config.name, &facts).await?;
        let devices = deviceplugin::DeviceManager::start(
            &config.kubelet_dir().join("device-plugins"),
            adopting.is_some(),
        )?;
        let cpus = cpumanager::CpuManager::start(
            &config.name,
            &config.kubelet_dir(),
            config.cpu_manager.clone(),
            adopting.is_some(),
        )?;
        let shared = Arc::new(Shared {
            cpus,
            config,
            client,
            sandboxes: Mutex::new(HashMap::new()),
            addresses: Mutex::new(
                adopted
                    .values()
                    .filter_map(|c: &checkpoint::PodCheckpoint| c.network_ip)
                    .collect(),
            ),
            devices,
            api_port,
            exits: adopting.unwrap_or_default(),
        });
        let api = match (listener, &shared.config.serving) {
            (Some(listener), Some(serving)) => Some(tokio::spawn(api::serve(
                shared.clone(),
                listener,
                serving.clone(),
            ))),
            _ => None,
        };
        let (halt, halt_rx) = watch::channel(Halt::Run);
        let heartbeat = tokio::spawn(heartbeat_loop(shared.clone()));
        let adopting = adopted.len();
        let pods = tokio::spawn(pod_loop(shared.clone(), halt_rx, adopted));
        tracing::info!(node = %shared.config.name, adopting, "kubelet started");
        Ok(Self {
            shared,
            halt,
            pods: Some(pods),
            heartbeat,
            api,
        })
    }

    pub fn node_name(&self) -> &str {
        &self.shared.config.name
    }

    pub fn config(&self) -> &NodeConfig {
        &self.shared.config
    }

    /// Where the kubelet API listens (0 when it does not).
    pub fn api_port(&self) -> u16 {
        self.shared.api_port
    }

    /// Stops every pod (SIGTERM, then SIGKILL after 2 s), releases what they held and removes
    /// the node bridge and cgroup. The pod objects stay, as when a real kubelet stops.
    pub async fn stop(mut self) {
        let _ = self.halt.send(Halt::Stop);
        if let Some(pods) = self.pods.take() {
            let _ = pods.await;
        }
        self.heartbeat.abort();
        if let Some(api) = self.api.take() {
            api.abort();
        }
        let shared = self.shared.clone();
        let _ = tokio::task::spawn_blocking(move || release_node(&shared)).await;
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.halt.send(Halt::Stop);
        self.heartbeat.abort();
        if let Some(api) = self.api.take() {
            api.abort();
        }
        if let Some(pods) = self.pods.take() {
            pods.abort();
            release_node(&self.shared);
        }
    }
}

/// Removes what the pods of a kubelet of this node that died without stopping left behind;
/// nobody tracks those pods any more. Only this node's own things are touched (its cgroups,
/// its bridge's ports, the pods under its root), so clusters and nodes running beside it are
/// safe. Blocking.
fn sweep_stale(config: &NodeConfig) {
    // Processes first, so nothing holds what is removed next.
    cgroup::Cgroup::node(&config.name).destroy();
    for port in network::bridge_ports(&config.bridge) {
        tracing::info!(node = %config.name, veth = %port, "removing a stale pod veth");
        if let Err(e) = network::ip(&["link", "del", &port]) {
            tracing::warn!(veth = %port, error = %e, "removing a stale pod veth");
        }
    }
    for entry in std::fs::read_dir(config.pods_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let uid = entry.file_name().to_string_lossy().into_owned();
        tracing::info!(node = %config.name, %uid, "removing a stale pod");
        PodNetwork::for_uid(&uid, Ipv4Addr::UNSPECIFIED).delete();
        volumes::unmount_below(&entry.path());
        if let Err(e) = std::fs::remove_dir_all(entry.path()) {
            tracing::warn!(dir = %entry.path().display(), error = %e, "removing a stale pod directory");
        }
    }
    for entry in std::fs::read_dir(config.log_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Err(e) = std::fs::remove_dir_all(entry.path()) {
            tracing::warn!(dir = %entry.path().display(), error = %e, "removing stale pod logs");
        }
    }
}

/// The pods a restarting kubelet adopts: every pod directory with a checkpoint. A directory
/// without one belongs to a pod whose sandbox was being set up when the kubelet went: what it
/// holds is removed, and the pod, if it still exists, starts over. Blocking.
fn recover(config: &NodeConfig) -> HashMap<String, checkpoint::PodCheckpoint> {
    let mut adopted = HashMap::new();
    for entry in std::fs::read_dir(config.pods_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let uid = entry.file_name().to_string_lossy().into_owned();
        if let Some(c) = checkpoint::PodCheckpoint::read(&entry.path()) {
            adopted.insert(uid, c);
            continue;
        }
        tracing::info!(node = %config.name, %uid, "removing a pod caught in its sandbox set-up");
        cgroup::Cgroup::pod(&config.name, &uid).destroy();
        PodNetwork::for_uid(&uid, Ipv4Addr::UNSPECIFIED).delete();
        volumes::unmount_below(&entry.path());
        if let Err(e) = std::fs::remove_dir_all(entry.path()) {
            tracing::warn!(dir = %entry.path().display(), error = %e, "removing a pod directory");
        }
    }
    adopted
}

fn release_node(shared: &Shared) {
    shared.devices.stop();
    let sandboxes: Vec<Sandbox> = shared
        .sandboxes
        .lock()
        .map(|mut s| s.drain().map(|(_, v)| v).collect())
        .unwrap_or_default();
    for s in sandboxes {
        s.teardown();
    }
    cgroup::Cgroup::node(&shared.config.name).destroy();
    cgroup::Cgroup {
        relative: PathBuf::from("localcluster"),
    }
    .remove_if_unused();
    network::delete_bridge(&shared.config.bridge);
}

async fn register(
    client: &Client,
    name: &str,
    facts: &node::NodeFacts,
) -> Result<(), KubeletError> {
    let nodes = Api::<Node>::all(client.clone());
    let object: Node =
        serde_json::from_value(node::node_object(facts)).map_err(|e| KubeletError::Volume {
            volume: "node".into(),
            message: e.to_string(),
        })?;
    let what = format!("registering node {name}");
    match nodes.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {
            // A Node's podCIDR is immutable once set, so only the labels are brought up to date.
            let patch = json!({"metadata": {"labels": object.metadata.labels}});
            nodes
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(api_err(what.clone()))?;
        }
        Err(e) => return Err(api_err(what)(e)),
    }
    let t = now();
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": node::node_status(facts, &t, &t)})),
        )
        .await
        .map_err(api_err(format!("posting node {name} status")))?;
    Ok(())
}

async fn heartbeat_loop(shared: Arc<Shared>) {
    let config = &shared.config;
    let nodes = Api::<Node>::all(shared.client.clone());
    let leases = Api::<Lease>::namespaced(shared.client.clone(), "kube-node-lease");
    let ready_since = now();
    loop {
        let t = now();
        let status = node::node_status(&shared.facts(), &t, &ready_since);
        if let Err(e) = nodes
            .patch_status(
                &config.name,
                &PatchParams::default(),
                &Patch::Merge(&json!({ "status": status })),
            )
            .await
        {
            tracing::warn!(node = %config.name, error = %e, "node status heartbeat");
        }
        let micro = format!("{:.6}", jiff::Timestamp::now());
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": config.name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": config.name, "leaseDurationSeconds": 40, "renewTime": micro},
        });
        if let Err(e) = leases
            .patch(
                &config.name,
                &PatchParams::apply("kubelet").force(),
                &Patch::Apply(&lease),
            )
            .await
        {
            tracing::warn!(node = %config.name, error = %e, "node lease heartbeat");
        }
        // A device plugin's change is posted at once, as the kubelet's device manager does.
        tokio::select! {
            () = tokio::time::sleep(config.heartbeat) => {}
            () = shared.devices.changed.notified() => {}
        }
    }
}

type WorkerHandle = (watch::Sender<Option<Pod>>, JoinHandle<()>);

async fn pod_loop(
    shared: Arc<Shared>,
    halt: watch::Receiver<Halt>,
    mut adopted: HashMap<String, checkpoint::PodCheckpoint>,
) {
    let api = Api::<Pod>::all(shared.client.clone());
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={}", shared.config.name));
    let mut events = watcher(api, cfg).boxed();
    let mut workers: HashMap<String, WorkerHandle> = HashMap::new();
    let mut finished: HashSet<String> = HashSet::new();
    let mut listed: HashSet<String> = HashSet::new();
    let mut halt_wait = halt.clone();
    loop {
        let event = tokio::select! {
            e = events.next() => e,
            _ = halt_wait.wait_for(|h| *h != Halt::Run) => None,
        };
        let Some(event) = event else { break };
        workers.retain(|uid, (_, h)| {
            if h.is_finished() {
                finished.insert(uid.clone());
                false
            } else {
                true
            }
        });
        let mut gone = Vec::new();
        let mut seen = Vec::new();
        match event {
            Ok(watcher::Event::Init) => listed.clear(),
            Ok(watcher::Event::InitApply(pod)) => {
                listed.insert(pod.metadata.uid.clone().unwrap_or_default());
                seen.push(pod);
            }
            Ok(watcher::Event::InitDone) => {
                gone.extend(workers.keys().filter(|u| !listed.contains(*u)).cloned());
                // Pods deleted while no kubelet ran: nobody will delete their objects again.
                for (uid, orphan) in adopted.drain() {
                    worker::release_orphan(&shared, &uid, &orphan).await;
                }
            }
            Ok(watcher::Event::Apply(pod)) => seen.push(pod),
            Ok(watcher::Event::Delete(pod)) => {
                gone.push(pod.metadata.uid.clone().unwrap_or_default());
            }
            Err(e) => {
                tracing::warn!(node = %shared.config.name, error = %e, "pod watch");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        for uid in gone {
            if let Some((tx, _)) = workers.get(&uid) {
                let _ = tx.send(None);
            }
        }
        for pod in seen {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            if finished.contains(&uid) {
                continue;
            }
            if let Some((tx, _)) = workers.get(&uid) {
                let _ = tx.send(Some(pod));
            } else {
                let (tx, rx) = watch::channel(Some(pod.clone()));
                let adopt = adopted.remove(&uid);
                let handle =
                    tokio::spawn(worker::run(shared.clone(), pod, rx, halt.clone(), adopt));
                workers.insert(uid, (tx, handle));
            }
        }
    }
    if *halt.borrow() == Halt::Abandon {
        // Each worker ends where it is; awaited, so none writes a checkpoint after the next
        // kubelet has read it.
        for (_, handle) in workers.values() {
            handle.abort();
        }
    }
    for (_, (_, handle)) in workers {
        let _ = handle.await;
    }
}
