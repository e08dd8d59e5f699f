//! One pod's life on the node: sandbox, init containers in order, app containers with their
//! restart policy and readiness probes, status reports, and graceful termination.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use api::quantity::ParsedQuantity;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Probe, Secret};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use nix::mount::MsFlags;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::cgroup::Cgroup;
use super::checkpoint::{ContainerCheckpoint, PodCheckpoint};
use super::network::PodNetwork;
use super::spawn::{Launch, RootPlan, open_proc, spawn};
use super::status::{PodView, Record, State};
use super::volumes::{self, HostVolume};
use super::{Halt, KubeletError, Sandbox, Shared, now};
use super::{deviceplugin, serviceaccount};
use crate::controlplane::error_chain;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long the kubelet waits for containers after SIGKILL before giving up on them.
const KILL_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Init,
    App,
}

#[derive(Debug)]
struct Probing {
    next: Instant,
    failures: i32,
    successes: i32,
}

impl Probing {
    /// Due after the probe's initial delay.
    fn after(probe: Option<&Probe>) -> Self {
        let delay = probe
            .and_then(|p| p.initial_delay_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(0);
        Self {
            next: Instant::now() + Duration::from_secs(delay),
            failures: 0,
            successes: 0,
        }
    }
}

fn period(probe: &Probe) -> Duration {
    Duration::from_secs(
        probe
            .period_seconds
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(10)
            .max(1),
    )
}

#[derive(Debug)]
struct Ctr {
    spec: Container,
    record: Record,
    pid: Option<u32>,
    next_start: Instant,
    backoff: Duration,
    /// When `backoff` was last set.
    backed_off_at: Option<Instant>,
    probe: Probing,
    liveness: Probing,
    started_at: String,
}

impl Ctr {
    /// The container waits before it starts again: its back-off doubles, or starts over at
    /// `base` when the last one is long past.
    fn back_off(&mut self, base: Duration) {
        let now = Instant::now();
        let since = self.backed_off_at.map(|t| now.duration_since(t));
        self.backoff = next_backoff(self.backoff, base, since);
        self.backed_off_at = Some(now);
        self.next_start = now + self.backoff;
    }

    fn new(spec: &Container) -> Self {
        Self {
            record: Record::new(&spec.name, spec.image.as_deref().unwrap_or_default()),
            spec: spec.clone(),
            pid: None,
            next_start: Instant::now(),
            backoff: Duration::ZERO,
            backed_off_at: None,
            probe: Probing::after(None),
            liveness: Probing::after(None),
            started_at: String::new(),
        }
    }
}

struct Worker {
    shared: Arc<Shared>,
    pod: Pod,
    uid: String,
    name: String,
    api: Api<Pod>,
    init: Vec<Ctr>,
    app: Vec<Ctr>,
    sandbox: Option<Sandbox>,
    volumes: BTreeMap<String, HostVolume>,
    /// The `kubernetes` Service, for every container's `KUBERNETES_SERVICE_*` environment.
    kubernetes_service: Option<std::net::SocketAddr>,
    sandbox_error: Option<String>,
    sandbox_retry: Instant,
    /// When configMap and secret volumes are next projected again.
    volume_sync: Instant,
    pod_ip: Option<String>,
    start_time: String,
    /// The pids of this pod's containers that ended (their statuses wait in `shared.exits`).
    exits: mpsc::UnboundedReceiver<u32>,
    terminating: bool,
    /// Why admission rejected the pod (the status message after `Pod was rejected: `).
    rejected: Option<String>,
    published: Value,
    /// The checkpoint last written.
    saved: Option<PodCheckpoint>,
}

/// Runs the pod until it is deleted (then deletes its object) or the kubelet stops; `adopt`
/// is the pod as the previous kubelet of the node left it running.
pub(super) async fn run(
    shared: Arc<Shared>,
    pod: Pod,
    mut updates: watch::Receiver<Option<Pod>>,
    mut halt: watch::Receiver<Halt>,
    adopt: Option<PodCheckpoint>,
) {
    let spec = pod.spec.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let exits = shared.exits.listen(&uid);
    let mut w = Worker {
        api: Api::namespaced(shared.client.clone(), &namespace),
        shared,
        uid,
        name,
        init: spec
            .init_containers
            .iter()
            .flatten()
            .map(Ctr::new)
            .collect(),
        app: spec.containers.iter().map(Ctr::new).collect(),
        pod,
        sandbox: None,
        volumes: BTreeMap::new(),
        kubernetes_service: None,
        sandbox_error: None,
        sandbox_retry: Instant::now(),
        volume_sync: Instant::now() + VOLUME_SYNC,
        pod_ip: None,
        start_time: now(),
        exits,
        terminating: false,
        rejected: None,
        published: Value::Null,
        saved: None,
    };
    tracing::info!(pod = %w.name, %namespace, uid = %w.uid, adopted = adopt.is_some(), "pod worker started");
    if let Some(checkpoint) = adopt {
        w.adopt(checkpoint).await;
    }
    loop {
        if w.pod.metadata.deletion_timestamp.is_some() {
            let grace = w.pod.metadata.deletion_grace_period_seconds.unwrap_or(30);
            w.terminate(Duration::from_secs(u64::try_from(grace).unwrap_or(0)))
                .await;
            // Everything is released before the last status write, so once the object is
            // gone nothing of the pod is left on the node.
            w.teardown().await;
            w.publish().await;
            w.delete_object(&mut halt).await;
            return;
        }
        w.step().await;
        w.publish().await;
        let wake = w.next_wake();
        let action = tokio::select! {
            changed = updates.changed() => {
                if changed.is_ok() { updates.borrow_and_update().clone().map_or(Action::Gone, |p| Action::Update(Box::new(p))) } else { Action::Gone }
            }
            Some(pid) = w.exits.recv() => Action::Exit(pid),
            _ = halt.wait_for(|h| *h == Halt::Stop) => Action::Stop,
            () = tokio::time::sleep_until(wake) => Action::Tick,
        };
        match action {
            Action::Update(p) => w.pod = *p,
            Action::Gone => {
                // The object is gone (deleted with no grace by someone else).
                w.terminate(Duration::ZERO).await;
                w.teardown().await;
                return;
            }
            Action::Exit(pid) => w.reap(pid),
            Action::Stop => {
                w.terminate(Duration::from_secs(2)).await;
                w.teardown().await;
                return;
            }
            Action::Tick => {}
        }
    }
}

/// Runs `attempt` until it succeeds, waiting longer after each failure (up to 5 s), or until
/// the kubelet is told to halt.
async fn until_done<F, Fut, E>(mut attempt: F, halt: &mut watch::Receiver<Halt>)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
{
    let mut wait = Duration::from_millis(200);
    while attempt().await.is_err() {
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = halt.wait_for(|h| *h != Halt::Run) => return,
        }
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

enum Action {
    Update(Box<Pod>),
    Gone,
    Exit(u32),
    Stop,
    Tick,
}

/// How often configMap and secret volumes are projected again (the kubelet's pod sync is a
/// minute plus its cache's TTL; shorter here, so a rotated certificate arrives within seconds).
const VOLUME_SYNC: Duration = Duration::from_secs(10);

fn spec_of(pod: &Pod) -> k8s_openapi::api::core::v1::PodSpec {
    pod.spec.clone().unwrap_or_default()
}

fn exit_state(status: &std::io::Result<ExitStatus>, started_at: &str) -> State {
    use std::os::unix::process::ExitStatusExt as _;
    let (exit_code, signal) = match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(c), _) => (c, None),
            (None, Some(sig)) => (128 + sig, Some(sig)),
            (None, None) => (-1, None),
        },
        Err(_) => (-1, None),
    };
    State::Terminated {
        exit_code,
        signal,
        reason: if exit_code == 0 { "Completed" } else { "Error" }.into(),
        started_at: started_at.into(),
        finished_at: now(),
    }
}

/// Kubernetes' QoS class of a pod.
pub fn qos_class(pod: &Pod) -> &'static str {
    let spec = spec_of(pod);
    let all: Vec<&Container> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .collect();
    let get = |c: &Container, limits: bool, r: &str| {
        c.resources.as_ref().and_then(|res| {
            let m = if limits { &res.limits } else { &res.requests };
            m.as_ref()
                .and_then(|m| m.get(r))
                .and_then(|q| ParsedQuantity::from_quantity(q).ok())
        })
    };
    let any = all.iter().any(|c| {
        ["cpu", "memory"]
            .iter()
            .any(|r| get(c, true, r).is_some() || get(c, false, r).is_some())
    });
    if !any {
        return "BestEffort";
    }
    let guaranteed = all.iter().all(|c| {
        ["cpu", "memory"].iter().all(|r| {
            let limit = get(c, true, r);
            limit.is_some() && get(c, false, r).is_none_or(|req| Some(req) == limit)
        })
    });
    if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

impl Worker {
    fn config(&self) -> &super::NodeConfig {
        &self.shared.config
    }

    fn pod_dir(&self) -> PathBuf {
        self.config().pods_dir().join(&self.uid)
    }

    fn log_dir(&self) -> PathBuf {
        self.config().log_dir().join(format!(
            "{}_{}_{}",
            self.pod.metadata.namespace.as_deref().unwrap_or_default(),
            self.name,
            self.uid
        ))
    }

    fn restart_policy(&self) -> String {
        spec_of(&self.pod)
            .restart_policy
            .unwrap_or_else(|| "Always".into())
    }

    fn next_wake(&self) -> Instant {
        let mut wake = Instant::now() + Duration::from_secs(1);
        for c in self.init.iter().chain(&self.app) {
            if c.pid.is_none() {
                wake = wake.min(c.next_start.max(Instant::now()));
            } else {
                if c.spec.readiness_probe.is_some() {
                    wake = wake.min(c.probe.next.max(Instant::now()));
                }
                if c.spec.liveness_probe.is_some() {
                    wake = wake.min(c.liveness.next.max(Instant::now()));
                }
            }
        }
        wake
    }

    async fn setup_sandbox(&mut self) -> Result<(), KubeletError> {
        let spec = spec_of(&self.pod);
        let pod_dir = self.pod_dir();
        std::fs::create_dir_all(&pod_dir).map_err(|source| KubeletError::Io {
            path: pod_dir.display().to_string(),
            source,
        })?;
        let cgroup = Cgroup::pod(&self.config().name, &self.uid);
        let mut sandbox = Sandbox {
            network: None,
            pause: None,
            cgroup: cgroup.clone(),
            pod_dir: pod_dir.clone(),
            log_dir: self.log_dir(),
        };
        // Registered at once, so a pod deleted while it waits still has its directory removed.
        self.register(&sandbox);
        // What may wait on the API (a claim not bound yet, a config map not created yet) comes
        // first, as the real kubelet mounts volumes before it creates the sandbox: a retry
        // then finds no network namespace or pause process of an earlier try.
        let node_root = self.config().root.clone();
        let mut volumes = BTreeMap::new();
        for v in spec.volumes.iter().flatten() {
            let host =
                volumes::prepare(&self.shared.client, &self.pod, &pod_dir, &node_root, v).await?;
            volumes.insert(v.name.clone(), host);
        }
        let kubernetes_service = serviceaccount::kubernetes_service(&self.shared.client).await?;
        if spec.host_network.unwrap_or(false) {
            self.pod_ip = Some(self.config().host_ip.clone());
        } else {
            let ip =
                {
                    let mut used = self.shared.addresses.lock().map_err(|_| {
                        KubeletError::AddressesExhausted {
                            cidr: self.config().pod_cidr.to_string(),
                        }
                    })?;
                    let ip = self.config().pod_cidr.allocate(&used).ok_or_else(|| {
                        KubeletError::AddressesExhausted {
                            cidr: self.config().pod_cidr.to_string(),
                        }
                    })?;
                    used.insert(ip);
                    ip
                };
            let net = PodNetwork::for_uid(&self.uid, ip);
            sandbox.network = Some(net.clone());
            self.register(&sandbox);
            let (bridge, cidr) = (self.config().bridge.clone(), self.config().pod_cidr);
            let created = tokio::task::spawn_blocking(move || net.create(&bridge, cidr)).await;
            match created {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(e) => {
                    return Err(KubeletError::Io {
                        path: "network setup task".into(),
                        source: std::io::Error::other(e),
                    });
                }
            }
            self.pod_ip = Some(ip.to_string());
        }
        self.register(&sandbox);
        cgroup.create()?;
        if !spec.host_pid.unwrap_or(false) {
            // The pod's PID namespace, held by its pause process in a cgroup of its own (no
            // container can have the name: it is not a DNS label).
            let pause = cgroup.child(super::PAUSE_CGROUP);
            pause.create()?;
            let spawned = super::spawn::spawn_pause(pause.procs_files()?)?;
            let mut waiter = spawned.child;
            tokio::spawn(async move {
                // Reaps the waiter once the pause process is killed at teardown.
                let _ = waiter.wait().await;
            });
            sandbox.pause = Some(spawned.pid);
            self.register(&sandbox);
        }
        self.volumes = volumes;
        self.kubernetes_service = kubernetes_service;
        self.sandbox = Some(sandbox);
        Ok(())
    }

    async fn refresh_volumes(&self) {
        let pod_dir = self.pod_dir();
        for v in spec_of(&self.pod).volumes.iter().flatten() {
            if let Err(e) = volumes::refresh(&self.shared.client, &self.pod, &pod_dir, v).await {
                tracing::warn!(pod = %self.name, volume = %v.name, error = %error_chain(&e), "projecting the volume again");
            }
        }
    }

    fn register(&self, sandbox: &Sandbox) {
        if let Ok(mut s) = self.shared.sandboxes.lock() {
            s.insert(self.uid.clone(), sandbox.clone());
        }
    }

    async fn step(&mut self) {
        if self.terminating || self.rejected.is_some() {
            return;
        }
        if self.sandbox.is_none() {
            if Instant::now() < self.sandbox_retry {
                return;
            }
            // Admission, as the real kubelet's CPU manager admits a pod before anything of it
            // runs; a rejected pod stays Failed and runs nothing.
            if let Err(message) = self.shared.cpus.admit(&self.uid, &self.pod) {
                tracing::warn!(pod = %self.name, %message, "pod rejected");
                self.rejected = Some(message);
                return;
            }
            match self.setup_sandbox().await {
                Ok(()) => {
                    self.sandbox_error = None;
                    self.save();
                }
                Err(e) => {
                    let message = error_chain(&e);
                    tracing::warn!(pod = %self.name, error = %message, "pod sandbox");
                    self.sandbox_error = Some(message);
                    self.sandbox_retry = Instant::now() + Duration::from_secs(2);
                    return;
                }
            }
        }
        if Instant::now() >= self.volume_sync {
            self.volume_sync = Instant::now() + VOLUME_SYNC;
            self.refresh_volumes().await;
        }
        let policy = self.restart_policy();
        if let Some(i) = self.init.iter().position(|c| !c.record.state.succeeded()) {
            let c = &self.init[i];
            let may_start = c.pid.is_none()
                && Instant::now() >= c.next_start
                && !(c.record.state.failed() && policy == "Never");
            if may_start {
                self.start(Kind::Init, i).await;
            }
            return;
        }
        for i in 0..self.app.len() {
            let c = &self.app[i];
            if c.pid.is_some() || Instant::now() < c.next_start {
                continue;
            }
            let again = match (&c.record.state, policy.as_str()) {
                (State::Waiting { .. }, _) | (State::Terminated { .. }, "Always") => true,
                (State::Terminated { exit_code, .. }, "OnFailure") => *exit_code != 0,
                _ => false,
            };
            if again {
                self.start(Kind::App, i).await;
            }
        }
        for i in 0..self.app.len() {
            self.probe(i).await;
            self.liveness(i).await;
        }
    }

    fn ctr(&mut self, kind: Kind, idx: usize) -> &mut Ctr {
        match kind {
            Kind::Init => &mut self.init[idx],
            Kind::App => &mut self.app[idx],
        }
    }

    async fn start(&mut self, kind: Kind, idx: usize) {
        let result = self.launch(kind, idx).await;
        let base = self.config().restart_backoff;
        let c = self.ctr(kind, idx);
        match result {
            Ok(pid) => {
                if c.record.started {
                    c.record.restart_count += 1;
                }
                c.pid = Some(pid);
                c.started_at = now();
                c.record.started = true;
                c.record.state = State::Running {
                    started_at: c.started_at.clone(),
                };
                c.record.ready = false;
                c.probe = Probing::after(c.spec.readiness_probe.as_ref());
                c.liveness = Probing::after(c.spec.liveness_probe.as_ref());
                tracing::info!(container = %c.spec.name, pid, "container started");
            }
            Err(e) => {
                let reason = match e {
                    KubeletError::Image { .. } => "ErrImagePull",
                    _ => "CreateContainerError",
                };
                let message = error_chain(&e);
                tracing::warn!(container = %c.spec.name, error = %message, "starting a container");
                c.record.state = State::Waiting {
                    reason: reason.into(),
                    message: Some(message),
                };
                c.back_off(base);
            }
        }
        self.save();
    }

    /// The container's environment: the image's (`PATH` defaulted), `HOSTNAME`, the
    /// `kubernetes` Service's variables, then the container's `env`, each overriding what came
    /// before.
    async fn env(
        &self,
        c: &Container,
        image: &ociimage::ImageConfig,
    ) -> Result<Vec<(String, String)>, KubeletError> {
        let namespace = self.pod.metadata.namespace.clone().unwrap_or_default();
        let mut env: Vec<(String, String)> = Vec::new();
        let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
            env.retain(|(n, _)| *n != k);
            env.push((k, v));
        };
        set(&mut env, "PATH".into(), DEFAULT_PATH.into());
        for pair in &image.env {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            set(&mut env, k.into(), v.into());
        }
        set(&mut env, "HOSTNAME".into(), self.name.clone());
        if let Some(address) = self.kubernetes_service {
            env.extend(serviceaccount::service_env(address));
        }
        let mut pod = self.pod.clone();
        if let Some(status) = pod.status.as_mut() {
            status.pod_ip.clone_from(&self.pod_ip);
            status.host_ip = Some(self.config().host_ip.clone());
        } else {
            pod.status = Some(k8s_openapi::api::core::v1::PodStatus {
                pod_ip: self.pod_ip.clone(),
                host_ip: Some(self.config().host_ip.clone()),
                ..Default::default()
            });
        }
        for e in c.env.iter().flatten() {
            let value = if let Some(v) = &e.value {
                v.clone()
            } else if let Some(from) = &e.value_from {
                let bad = |m: String| KubeletError::Volume {
                    volume: format!("env {}", e.name),
                    message: m,
                };
                if let Some(f) = &from.field_ref {
                    volumes::field_value(&pod, &f.field_path)
                        .ok_or_else(|| bad(format!("unsupported fieldRef {:?}", f.field_path)))?
                } else if let Some(k) = &from.config_map_key_ref {
                    let cm = Api::<ConfigMap>::namespaced(self.shared.client.clone(), &namespace)
                        .get_opt(&k.name)
                        .await
                        .map_err(|source| KubeletError::Api {
                            what: format!("configmap {namespace}/{}", k.name),
                            source,
                        })?;
                    match cm.and_then(|cm| cm.data?.get(&k.key).cloned()) {
                        Some(v) => v,
                        None if k.optional.unwrap_or(false) => continue,
                        None => {
                            return Err(bad(format!(
                                "configmap key {}/{} not found",
                                k.name, k.key
                            )));
                        }
                    }
                } else if let Some(k) = &from.secret_key_ref {
                    let s = Api::<Secret>::namespaced(self.shared.client.clone(), &namespace)
                        .get_opt(&k.name)
                        .await
                        .map_err(|source| KubeletError::Api {
                            what: format!("secret {namespace}/{}", k.name),
                            source,
                        })?;
                    match s.and_then(|s| s.data?.get(&k.key).cloned()) {
                        Some(v) => String::from_utf8_lossy(&v.0).into_owned(),
                        None if k.optional.unwrap_or(false) => continue,
                        None => {
                            return Err(bad(format!("secret key {}/{} not found", k.name, k.key)));
                        }
                    }
                } else {
                    return Err(bad(
                        "only fieldRef, configMapKeyRef and secretKeyRef are supported".into(),
                    ));
                }
            } else {
                String::new()
            };
            env.retain(|(k, _)| *k != e.name);
            env.push((e.name.clone(), value));
        }
        Ok(env)
    }

    /// Builds the container's root and mounts and starts its process; returns its pid.
    async fn launch(&mut self, kind: Kind, idx: usize) -> Result<u32, KubeletError> {
        let spec = self.ctr(kind, idx).spec.clone();
        let restart = self.ctr(kind, idx).record.restart_count
            + i32::from(self.ctr(kind, idx).record.started);
        let image_name = spec.image.clone().unwrap_or_default();
        let store = self.config().images.clone();
        let wanted = image_name.clone();
        let image = tokio::task::spawn_blocking(move || store.resolve(&wanted))
            .await
            .map_err(|e| KubeletError::Io {
                path: format!("resolving image {image_name}"),
                source: std::io::Error::other(e),
            })?
            .map_err(|source| KubeletError::Image {
                image: image_name.clone(),
                source,
            })?;
        self.ctr(kind, idx).record.image_id.clone_from(&image.id);
        if let Some(user) = image
            .config
            .user
            .as_deref()
            .filter(|u| !matches!(*u, "0" | "root" | "0:0" | "root:root"))
        {
            return Err(KubeletError::ImageUser {
                image: image_name,
                user: user.to_owned(),
            });
        }
        let argv = container_argv(spec.command.as_deref(), spec.args.as_deref(), &image.config);
        if argv.is_empty() {
            return Err(KubeletError::NoCommand);
        }
        let workdir = spec
            .working_dir
            .clone()
            .filter(|w| !w.is_empty())
            .or_else(|| image.config.working_dir.clone())
            .unwrap_or_else(|| "/".into());
        let mut env = self.env(&spec, &image.config).await?;
        let io = |path: &std::path::Path| {
            let path = path.display().to_string();
            move |source| KubeletError::Io { path, source }
        };

        let ctr_dir = self.pod_dir().join("containers").join(&spec.name);
        let (upper, work, root) = (
            ctr_dir.join("upper"),
            ctr_dir.join("work"),
            ctr_dir.join("rootfs"),
        );
        // A restart gets a fresh writable layer, as a container does.
        if upper.exists() {
            std::fs::remove_dir_all(&upper).map_err(io(&upper))?;
        }
        for d in [&upper, &work, &root] {
            std::fs::create_dir_all(d).map_err(io(d))?;
        }
        // The image's layers, read-only, top first as overlayfs stacks them, under the
        // container's own writable layer.
        let lowers: Vec<PathBuf> = image.layers.iter().rev().cloned().collect();
        let lowerdir = lowers
            .iter()
            .map(|l| l.display().to_string())
            .collect::<Vec<_>>()
            .join(":");
        let mut plan = RootPlan {
            lowers,
            ..RootPlan::default()
        };
        plan.mount(
            Some("overlay"),
            &root,
            Some("overlay"),
            MsFlags::empty(),
            Some(&format!(
                "lowerdir={lowerdir},upperdir={},workdir={}",
                upper.display(),
                work.display()
            )),
        );
        let proc_dir = plan.mount_point(&root, std::path::Path::new("/proc"), false);
        plan.mount(
            Some("proc"),
            &proc_dir,
            Some("proc"),
            MsFlags::empty(),
            None,
        );
        let dev = plan.mount_point(&root, Path::new("/dev"), false);
        match dev_layer(&ctr_dir, &spec, &self.volumes)? {
            // The host's /dev under the container's own nodes and mount points, so nothing
            // is created in the host's /dev; its submounts (pts, shm) bound again on top.
            Some(layer) => {
                plan.mount(
                    Some("overlay"),
                    &dev,
                    Some("overlay"),
                    MsFlags::empty(),
                    Some(&format!("lowerdir={}:/dev", layer.display())),
                );
                for sub in host_dev_submounts() {
                    let target = plan.mount_point(&root, &sub, false);
                    plan.bind(&sub, &target, false);
                }
            }
            None => plan.bind(Path::new("/dev"), &dev, false),
        }
        let sys = plan.mount_point(&root, Path::new("/sys"), false);
        plan.bind(Path::new("/sys"), &sys, false);
        let mut propagation = MsFlags::MS_PRIVATE;
        for m in spec.volume_mounts.iter().flatten() {
            let volume = self
                .volumes
                .get(&m.name)
                .ok_or_else(|| KubeletError::Volume {
                    volume: m.name.clone(),
                    message: format!("container {} mounts an undeclared volume", spec.name),
                })?;
            if volume.block {
                return Err(KubeletError::Volume {
                    volume: m.name.clone(),
                    message: "has volumeMode Block, but is specified in volumeMounts".into(),
                });
            }
            let mut source = volume.path.clone();
            if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
                source = source.join(sub);
                if !source.exists() {
                    std::fs::create_dir_all(&source).map_err(io(&source))?;
                }
            }
            let target =
                plan.mount_point(&root, std::path::Path::new(&m.mount_path), source.is_file());
            plan.bind(
                &source,
                &target,
                m.read_only.unwrap_or(false) || volume.read_only,
            );
            match m.mount_propagation.as_deref() {
                Some("Bidirectional") => {
                    propagation = MsFlags::MS_SLAVE;
                    plan.mount(None, &target, None, MsFlags::MS_SHARED, None);
                }
                Some("HostToContainer") => propagation = MsFlags::MS_SLAVE,
                _ => {}
            }
        }
        // Block devices outside /dev (inside it, `dev_layer` made their nodes): the host's
        // device bound onto a file in the container's root.
        for d in spec.volume_devices.iter().flatten() {
            if !Path::new(&d.device_path).starts_with("/dev")
                && let Some(volume) = self.volumes.get(&d.name)
            {
                let target = plan.mount_point(&root, Path::new(&d.device_path), true);
                plan.bind(&volume.path, &target, false);
            }
        }
        let owner = format!("{}/{}", self.uid, spec.name);
        let requests = deviceplugin::device_requests(&spec);
        for response in self.shared.devices.allocate(&owner, &requests).await? {
            apply_allocation(&mut plan, &root, &mut env, response);
        }
        plan.propagation = Some(propagation);
        plan.root =
            Some(std::ffi::CString::new(root.as_os_str().as_encoded_bytes()).unwrap_or_default());

        let cgroup = self
            .sandbox
            .as_ref()
            .map(|s| s.cgroup.child(&spec.name))
            .ok_or(KubeletError::NoCommand)?;
        cgroup.create()?;
        self.shared.cpus.apply(&cgroup, &self.uid, &spec.name)?;
        if let Some(limit) = spec
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("memory"))
            .and_then(|q| api::quantity::bytes(&q.0).ok())
        {
            cgroup.set_memory_limit(limit)?;
        }
        let netns = match self.sandbox.as_ref().and_then(|s| s.network.as_ref()) {
            Some(n) => {
                let path = n.netns_path();
                Some(std::fs::File::open(&path).map_err(io(&path))?)
            }
            None => None,
        };
        let log_dir = self.log_dir().join(&spec.name);
        std::fs::create_dir_all(&log_dir).map_err(io(&log_dir))?;
        let log_path = log_dir.join(format!("{restart}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io(&log_path))?;
        let log2 = log.try_clone().map_err(io(&log_path))?;
        let pidns = match self.sandbox.as_ref().and_then(|s| s.pause) {
            Some(pause) => Some(open_proc(pause, "ns/pid")?),
            None => None,
        };
        let spawned = spawn(Launch {
            argv,
            env,
            workdir: PathBuf::from(workdir),
            netns,
            mntns: None,
            pidns,
            hostname: (!spec_of(&self.pod).host_network.unwrap_or(false))
                .then(|| self.name.clone()),
            cgroups: cgroup.procs_files()?,
            root: Some(plan),
            stdin: Stdio::null(),
            stdout: Stdio::from(log),
            stderr: Stdio::from(log2),
        })?;
        let pid = spawned.pid;
        // The container's waiter, the one part of its life that is not the worker's: it
        // outlives a kubelet restart, as a runtime's shim does.
        let (exits, uid) = (self.shared.exits.clone(), self.uid.clone());
        tokio::spawn(async move {
            let mut child = spawned.child;
            let status = child.wait().await;
            exits.record(&uid, pid, status);
        });
        Ok(pid)
    }

    /// The container whose process is `pid`.
    fn container_of(&self, pid: u32) -> Option<(Kind, usize)> {
        let find = |v: &[Ctr]| v.iter().position(|c| c.pid == Some(pid));
        find(&self.init)
            .map(|i| (Kind::Init, i))
            .or_else(|| find(&self.app).map(|i| (Kind::App, i)))
    }

    /// Takes the exit of `pid`, told by its waiter, if it is one of this pod's containers.
    fn reap(&mut self, pid: u32) {
        if let Some(status) = self.shared.exits.take(pid) {
            self.pid_exited(pid, &status);
        }
    }

    /// The container whose process `pid` was ended, as `status` says.
    fn pid_exited(&mut self, pid: u32, status: &std::io::Result<ExitStatus>) {
        if let Some((kind, idx)) = self.container_of(pid) {
            self.exited(kind, idx, status);
        }
    }

    fn exited(&mut self, kind: Kind, idx: usize, status: &std::io::Result<ExitStatus>) {
        let policy = self.restart_policy();
        let base = self.config().restart_backoff;
        let terminating = self.terminating;
        let pod_name = self.name.clone();
        let ctr_name = self.ctr(kind, idx).spec.name.clone();
        let cgroup = self.sandbox.as_ref().map(|s| s.cgroup.child(&ctr_name));
        let c = self.ctr(kind, idx);
        c.pid = None;
        c.record.ready = false;
        let state = exit_state(status, &c.started_at);
        tracing::info!(container = %c.spec.name, ?status, "container exited");
        let restarts = !terminating
            && match policy.as_str() {
                "Always" => kind == Kind::App || !state.succeeded(),
                "OnFailure" => !state.succeeded(),
                _ => false,
            };
        if restarts {
            c.back_off(base);
            c.record.last = Some(state);
            c.record.state = State::Waiting {
                reason: "CrashLoopBackOff".into(),
                message: Some(format!(
                    "back-off {}s restarting failed container={} pod={}",
                    c.backoff.as_secs(),
                    c.spec.name,
                    pod_name
                )),
            };
        } else {
            c.record.state = state;
        }
        // Whatever the container forked dies with it, as in a container's PID namespace.
        if let Some(cg) = cgroup {
            tokio::task::spawn_blocking(move || cg.destroy());
        }
        self.save();
    }

    /// Writes the pod's checkpoint if anything in it changed. Called with no await between a
    /// change and the write, so a restart in between cannot lose a process.
    fn save(&mut self) {
        let Some(sandbox) = &self.sandbox else {
            return;
        };
        let containers = |v: &[Ctr]| {
            v.iter()
                .map(|c| ContainerCheckpoint {
                    pid: c.pid,
                    started_at: c.started_at.clone(),
                    record: c.record.clone(),
                })
                .collect()
        };
        let checkpoint = PodCheckpoint {
            pod_ip: self.pod_ip.clone(),
            network_ip: sandbox.network.as_ref().map(|n| n.ip),
            pause: sandbox.pause,
            start_time: self.start_time.clone(),
            volumes: self.volumes.clone(),
            init: containers(&self.init),
            app: containers(&self.app),
        };
        if self.saved.as_ref() == Some(&checkpoint) {
            return;
        }
        match checkpoint.write(&sandbox.pod_dir) {
            Ok(()) => self.saved = Some(checkpoint),
            Err(e) => {
                tracing::warn!(pod = %self.name, error = %e, "writing the pod checkpoint");
            }
        }
    }

    /// Takes over the pod as the previous kubelet left it: its sandbox, its volumes and its
    /// containers, running or not; exits that came while no worker ran are taken now.
    async fn adopt(&mut self, checkpoint: PodCheckpoint) {
        let sandbox = Sandbox {
            network: checkpoint
                .network_ip
                .map(|ip| PodNetwork::for_uid(&self.uid, ip)),
            pause: checkpoint.pause,
            cgroup: Cgroup::pod(&self.config().name, &self.uid),
            pod_dir: self.pod_dir(),
            log_dir: self.log_dir(),
        };
        self.register(&sandbox);
        self.sandbox = Some(sandbox);
        self.pod_ip.clone_from(&checkpoint.pod_ip);
        self.start_time.clone_from(&checkpoint.start_time);
        self.volumes.clone_from(&checkpoint.volumes);
        match serviceaccount::kubernetes_service(&self.shared.client).await {
            Ok(service) => self.kubernetes_service = service,
            Err(e) => {
                tracing::warn!(pod = %self.name, error = %error_chain(&e), "looking up the kubernetes Service");
            }
        }
        for (ctrs, saved) in [
            (&mut self.init, &checkpoint.init),
            (&mut self.app, &checkpoint.app),
        ] {
            for c in ctrs.iter_mut() {
                let Some(saved) = saved.iter().find(|s| s.record.name == c.spec.name) else {
                    continue;
                };
                c.record = saved.record.clone();
                c.pid = saved.pid;
                c.started_at.clone_from(&saved.started_at);
            }
        }
        self.saved = Some(checkpoint);
        let pids: Vec<u32> = self
            .init
            .iter()
            .chain(&self.app)
            .filter_map(|c| c.pid)
            .collect();
        for pid in pids {
            let status = self.shared.exits.take(pid).or_else(|| {
                // Gone, with no exit recorded: shown as ended, how is not known.
                kill(Pid::from_raw(i32::try_from(pid).unwrap_or(0)), None)
                    .is_err()
                    .then(|| Err(std::io::Error::other("no exit recorded")))
            });
            if let Some(status) = status {
                self.pid_exited(pid, &status);
            }
        }
        tracing::info!(pod = %self.name, "pod adopted from the previous kubelet");
    }

    async fn probe(&mut self, idx: usize) {
        let c = &self.app[idx];
        let Some(pid) = c.pid else { return };
        let Some(probe) = c.spec.readiness_probe.clone() else {
            self.app[idx].record.ready = true;
            return;
        };
        if Instant::now() < c.probe.next {
            return;
        }
        let ok = self.run_probe(&probe, pid, &c.spec).await;
        let c = &mut self.app[idx];
        c.probe.next = Instant::now() + period(&probe);
        if ok {
            c.probe.failures = 0;
            c.probe.successes += 1;
            if c.probe.successes >= probe.success_threshold.unwrap_or(1) {
                c.record.ready = true;
            }
        } else {
            c.probe.successes = 0;
            c.probe.failures += 1;
            if c.probe.failures >= probe.failure_threshold.unwrap_or(3) || !c.record.ready {
                c.record.ready = false;
            }
        }
    }

    /// Kills the container once its liveness probe failed `failureThreshold` times in a row;
    /// its restart policy then decides. SIGKILL at once: the grace period is not honored here.
    async fn liveness(&mut self, idx: usize) {
        let c = &self.app[idx];
        let (Some(pid), Some(probe)) = (c.pid, c.spec.liveness_probe.clone()) else {
            return;
        };
        if Instant::now() < c.liveness.next {
            return;
        }
        let ok = self.run_probe(&probe, pid, &c.spec).await;
        let c = &mut self.app[idx];
        c.liveness.next = Instant::now() + period(&probe);
        if ok {
            c.liveness.failures = 0;
            return;
        }
        c.liveness.failures += 1;
        if c.liveness.failures >= probe.failure_threshold.unwrap_or(3) {
            tracing::info!(container = %c.spec.name, "liveness probe failed; killing the container");
            c.liveness.failures = 0;
            if let Some(s) = &self.sandbox {
                s.cgroup.child(&c.spec.name).signal_all(Signal::SIGKILL);
            }
        }
    }

    async fn run_probe(&self, probe: &Probe, pid: u32, spec: &Container) -> bool {
        let timeout = Duration::from_secs(
            probe
                .timeout_seconds
                .and_then(|s| u64::try_from(s).ok())
                .unwrap_or(1)
                .max(1),
        );
        if let Some(exec) = &probe.exec {
            let launch = || -> Result<super::spawn::Spawned, KubeletError> {
                spawn(Launch {
                    argv: exec.command.clone().unwrap_or_default(),
                    env: vec![("PATH".into(), DEFAULT_PATH.into())],
                    workdir: PathBuf::from("/"),
                    netns: Some(open_proc(pid, "ns/net")?),
                    mntns: Some(open_proc(pid, "ns/mnt")?),
                    // As a CRI exec: the container's `/proc` shows its own PID namespace, so
                    // a command outside it finds no `/proc/self` there.
                    pidns: Some(open_proc(pid, "ns/pid")?),
                    hostname: None,
                    cgroups: Vec::new(),
                    root: None,
                    stdin: Stdio::null(),
                    stdout: Stdio::null(),
                    stderr: Stdio::null(),
                })
            };
            let mut child = match launch() {
                Ok(c) => c.child,
                Err(e) => {
                    tracing::debug!(error = %error_chain(&e), "exec probe");
                    return false;
                }
            };
            if let Ok(Ok(s)) = tokio::time::timeout(timeout, child.wait()).await {
                return s.success();
            }
            let _ = child.start_kill();
            let _ = child.wait().await;
            return false;
        }
        if let Some(tcp) = &probe.tcp_socket {
            let port = port_number(&tcp.port, spec);
            let host = tcp
                .host
                .clone()
                .or_else(|| self.pod_ip.clone())
                .unwrap_or_default();
            let addr = format!("{host}:{port}");
            return matches!(
                tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&addr)).await,
                Ok(Ok(_))
            );
        }
        if let Some(get) = &probe.http_get {
            let port = port_number(&get.port, spec);
            let host = get
                .host
                .clone()
                .or_else(|| self.pod_ip.clone())
                .unwrap_or_default();
            let headers: Vec<(String, String)> = get
                .http_headers
                .iter()
                .flatten()
                .map(|h| (h.name.clone(), h.value.clone()))
                .collect();
            let https = get.scheme.as_deref() == Some("HTTPS");
            let path = get.path.as_deref().unwrap_or("/");
            return super::probe::http_get(
                &host,
                u16::try_from(port).unwrap_or(0),
                path,
                https,
                &headers,
                timeout,
            )
            .await;
        }
        tracing::warn!(pod = %self.name, "readiness probe kind not supported by the process kubelet (exec, tcpSocket and httpGet are); reporting not ready");
        false
    }

    /// SIGTERM to every running container, SIGKILL to everything left after `grace`.
    async fn terminate(&mut self, grace: Duration) {
        self.terminating = true;
        let running = |w: &Self| {
            w.init
                .iter()
                .chain(&w.app)
                .filter(|c| c.pid.is_some())
                .count()
        };
        for c in self.init.iter().chain(&self.app) {
            if let Some(pid) = c.pid {
                let _ = kill(
                    Pid::from_raw(i32::try_from(pid).unwrap_or(0)),
                    Signal::SIGTERM,
                );
            }
        }
        let deadline = Instant::now() + grace;
        while running(self) > 0 {
            match tokio::time::timeout_at(deadline, self.exits.recv()).await {
                Ok(Some(pid)) => self.reap(pid),
                _ => break,
            }
        }
        if let Some(s) = &self.sandbox {
            s.cgroup.signal_all(Signal::SIGKILL);
        }
        let deadline = Instant::now() + KILL_WAIT;
        while running(self) > 0 {
            match tokio::time::timeout_at(deadline, self.exits.recv()).await {
                Ok(Some(pid)) => self.reap(pid),
                _ => break,
            }
        }
    }

    async fn teardown(&mut self) {
        self.shared.devices.release(&self.uid);
        self.shared.cpus.release(&self.uid);
        let pids = self.init.iter().chain(&self.app).filter_map(|c| c.pid);
        self.shared
            .exits
            .forget(&self.uid, pids.collect::<Vec<_>>());
        let sandbox = self
            .shared
            .sandboxes
            .lock()
            .ok()
            .and_then(|mut s| s.remove(&self.uid));
        if let Some(s) = sandbox {
            let net = s.network.clone();
            let _ = tokio::task::spawn_blocking(move || s.teardown()).await;
            if let (Some(n), Ok(mut used)) = (net, self.shared.addresses.lock()) {
                used.remove(&n.ip);
            }
        }
        self.sandbox = None;
        tracing::info!(pod = %self.name, "pod torn down");
    }

    /// Deletes the pod object once its containers are gone, until kube-apiserver takes it or
    /// the kubelet stops (a restarted kubelet deletes it then). Giving up at the first error
    /// left a deleted pod Terminating for good: kube-apiserver was restarting (chaos round 66),
    /// and a restarted one refuses nodes (403) until its Node authorizer has caught up.
    async fn delete_object(&self, halt: &mut watch::Receiver<Halt>) {
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(self.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let delete = || async {
            match self.api.delete(&self.name, &params).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
                Err(e) => {
                    tracing::warn!(pod = %self.name, error = %e, "deleting the pod object; retrying");
                    Err(e)
                }
            }
        };
        until_done(delete, halt).await;
    }

    async fn publish(&mut self) {
        let records = |v: &[Ctr]| v.iter().map(|c| c.record.clone()).collect::<Vec<_>>();
        let (init, app) = (records(&self.init), records(&self.app));
        let policy = self.restart_policy();
        let host_ip = self.config().host_ip.clone();
        let readiness_gates: Vec<String> = self
            .pod
            .spec
            .iter()
            .flat_map(|s| s.readiness_gates.iter().flatten())
            .map(|g| g.condition_type.clone())
            .collect();
        let current_conditions: Vec<Value> = self
            .pod
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .filter_map(|c| serde_json::to_value(c).ok())
            .collect();
        let view = PodView {
            uid: &self.uid,
            restart_policy: &policy,
            init: &init,
            app: &app,
            pod_ip: self.pod_ip.as_deref(),
            host_ip: &host_ip,
            start_time: &self.start_time,
            sandbox_ready: self.sandbox.is_some(),
            sandbox_error: self.sandbox_error.as_deref(),
            qos_class: qos_class(&self.pod),
            readiness_gates: &readiness_gates,
            current_conditions: &current_conditions,
        };
        let previous: Vec<Value> = self
            .published
            .get("conditions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let status = match &self.rejected {
            Some(message) => super::status::rejected(message, view.qos_class),
            None => super::status::pod_status(&view, &previous, &now()),
        };
        if status == self.published {
            return;
        }
        match self
            .api
            .patch_status(
                &self.name,
                &PatchParams::default(),
                // Strategic, as the real kubelet writes it: conditions merge by type, so the
                // ones other controllers own (readiness gates) stay.
                &Patch::Strategic(json!({ "status": status })),
            )
            .await
        {
            Ok(_) => self.published = status,
            Err(e) => tracing::warn!(pod = %self.name, error = %e, "updating pod status"),
        }
    }
}

/// Releases what a pod the previous kubelet ran holds, once the API no longer has the pod:
/// kills its processes and removes its network, cgroups, directories and devices.
pub(super) async fn release_orphan(shared: &Arc<Shared>, uid: &str, checkpoint: &PodCheckpoint) {
    tracing::info!(node = %shared.config.name, %uid, "releasing a pod the API no longer has");
    shared.devices.release(uid);
    shared.cpus.release(uid);
    let pids = checkpoint
        .init
        .iter()
        .chain(&checkpoint.app)
        .filter_map(|c| c.pid);
    shared.exits.forget(uid, pids.collect::<Vec<_>>());
    let pod_dir = shared.config.pods_dir().join(uid);
    // The log directory's name holds the namespace and name the checkpoint does not: found by
    // the uid that ends it.
    let log_dir = std::fs::read_dir(shared.config.log_dir())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().ends_with(uid))
        })
        .unwrap_or_else(|| shared.config.log_dir().join(uid));
    let sandbox = Sandbox {
        network: checkpoint.network_ip.map(|ip| PodNetwork::for_uid(uid, ip)),
        pause: checkpoint.pause,
        cgroup: Cgroup::pod(&shared.config.name, uid),
        pod_dir,
        log_dir,
    };
    let _ = tokio::task::spawn_blocking(move || sandbox.teardown()).await;
    if let (Some(ip), Ok(mut used)) = (checkpoint.network_ip, shared.addresses.lock()) {
        used.remove(&ip);
    }
}

/// The layer a container's `/dev` gets over the host's when the pod puts something there: a
/// device node for each of its `volumeDevices` (the claim's block device, as the container
/// runtime makes them) and the mount points of its volumes under `/dev` (KubeVirt's
/// `/dev/hugepages`). `None` when nothing goes there: the container then sees the host's
/// `/dev` as it is. Remade at every start of the container.
fn dev_layer(
    ctr_dir: &Path,
    spec: &Container,
    volumes: &BTreeMap<String, HostVolume>,
) -> Result<Option<PathBuf>, KubeletError> {
    use std::os::unix::fs::MetadataExt as _;
    let layer = ctr_dir.join("dev");
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| KubeletError::Io { path, source }
    };
    if layer.exists() {
        std::fs::remove_dir_all(&layer).map_err(io(&layer))?;
    }
    let in_dev = |p: &str| {
        Path::new(p)
            .strip_prefix("/dev")
            .ok()
            .filter(|r| !r.as_os_str().is_empty())
            .map(|r| layer.join(r))
    };
    let mut used = false;
    for d in spec.volume_devices.iter().flatten() {
        let refused = |message: String| KubeletError::Volume {
            volume: d.name.clone(),
            message,
        };
        let volume = volumes.get(&d.name).ok_or_else(|| {
            refused(format!(
                "cannot find volume {:?} to pass into container {:?}",
                d.name, spec.name
            ))
        })?;
        if !volume.block {
            return Err(refused(
                "has volumeMode Filesystem, but is specified in volumeDevices".into(),
            ));
        }
        let Some(node) = in_dev(&d.device_path) else {
            continue;
        };
        let rdev = std::fs::metadata(&volume.path)
            .map_err(io(&volume.path))?
            .rdev();
        if let Some(parent) = node.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        nix::sys::stat::mknod(
            &node,
            nix::sys::stat::SFlag::S_IFBLK,
            nix::sys::stat::Mode::from_bits_truncate(0o660),
            rdev,
        )
        .map_err(|e| io(&node)(e.into()))?;
        used = true;
    }
    for m in spec.volume_mounts.iter().flatten() {
        let (Some(point), Some(volume)) = (in_dev(&m.mount_path), volumes.get(&m.name)) else {
            continue;
        };
        if volume.path.is_file() {
            if let Some(parent) = point.parent() {
                std::fs::create_dir_all(parent).map_err(io(parent))?;
            }
            std::fs::write(&point, b"").map_err(io(&point))?;
        } else {
            std::fs::create_dir_all(&point).map_err(io(&point))?;
        }
        used = true;
    }
    Ok(used.then_some(layer))
}

/// The mounts below the host's `/dev` (`/dev/pts`, `/dev/shm`...), outermost only: a
/// recursive bind of each brings what is mounted inside it.
fn host_dev_submounts() -> Vec<PathBuf> {
    let points: std::collections::BTreeSet<PathBuf> =
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(PathBuf::from)
            .filter(|p| p.starts_with("/dev") && p != Path::new("/dev"))
            .collect();
    points
        .iter()
        .filter(|p| {
            !p.ancestors()
                .skip(1)
                .any(|a| a != Path::new("/dev") && points.contains(a))
        })
        .cloned()
        .collect()
}

/// What a device plugin's Allocate answer gives a container: its device nodes and mounts at
/// their container paths, and its environment (over the pod's). A device node already at its
/// path in the container (every container sees the host's `/dev`) needs no bind.
fn apply_allocation(
    plan: &mut RootPlan,
    root: &Path,
    env: &mut Vec<(String, String)>,
    response: kubelet_api::v1beta1::ContainerAllocateResponse,
) {
    for d in &response.devices {
        if d.container_path == d.host_path && d.container_path.starts_with("/dev/") {
            continue;
        }
        let target = plan.mount_point(root, Path::new(&d.container_path), true);
        plan.bind(Path::new(&d.host_path), &target, false);
    }
    for m in &response.mounts {
        let source = Path::new(&m.host_path);
        let target = plan.mount_point(root, Path::new(&m.container_path), source.is_file());
        plan.bind(source, &target, m.read_only);
    }
    for (k, v) in response.envs {
        env.retain(|(name, _)| *name != k);
        env.push((k, v));
    }
}

/// A probe's port: a number, or the name of one of the container's ports.
fn port_number(
    port: &k8s_openapi::apimachinery::pkg::util::intstr::IntOrString,
    spec: &Container,
) -> i32 {
    match port {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => *p,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name) => spec
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .map_or(0, |p| p.container_port),
    }
}

/// What a container runs, by Kubernetes' rule: `command` replaces the image's entrypoint and
/// its cmd (then `args` alone are the arguments); without `command`, the entrypoint runs with
/// `args` if given, else with the image's cmd.
fn container_argv(
    command: Option<&[String]>,
    args: Option<&[String]>,
    image: &ociimage::ImageConfig,
) -> Vec<String> {
    let args = args.filter(|a| !a.is_empty());
    match command.filter(|c| !c.is_empty()) {
        Some(c) => c.iter().chain(args.unwrap_or_default()).cloned().collect(),
        None => image
            .entrypoint
            .iter()
            .chain(args.unwrap_or(&image.cmd))
            .cloned()
            .collect(),
    }
}

/// The next crash back-off: `base`, doubling up to 30 times `base` (the kubelet's 10 s to
/// 300 s), and `base` again once the last back-off is more than twice the cap ago, as the
/// kubelet's back-off entries expire (`flowcontrol.Backoff`): a container that crashes now and
/// then is not held for five minutes forever.
fn next_backoff(current: Duration, base: Duration, since_last: Option<Duration>) -> Duration {
    let cap = base * 30;
    if current.is_zero() || since_last.is_some_and(|s| s > cap * 2) {
        base
    } else {
        (current * 2).min(cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block volume's node in the container's /dev layer has the device's numbers; the
    /// mount points of volumes under /dev are there too; a filesystem volume in
    /// `volumeDevices` is refused with the kubelet's words; no layer when nothing goes in /dev.
    #[test]
    fn dev_layer_holds_block_devices_and_mount_points() {
        use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
        let dir = tempfile::tempdir().unwrap();
        let volumes = BTreeMap::from([
            (
                "disk".to_owned(),
                HostVolume {
                    path: "/dev/null".into(),
                    read_only: false,
                    block: true,
                },
            ),
            (
                "hp".to_owned(),
                HostVolume {
                    path: dir.path().to_owned(),
                    read_only: false,
                    block: false,
                },
            ),
        ]);
        let container = |spec: Value| -> Container {
            let mut c = json!({"name": "c"});
            json_patch::merge(&mut c, &spec);
            serde_json::from_value(c).unwrap()
        };
        let spec = container(json!({
            "volumeDevices": [{"name": "disk", "devicePath": "/dev/disks/xvda"}],
            "volumeMounts": [{"name": "hp", "mountPath": "/dev/hugepages"}],
        }));
        let layer = dev_layer(dir.path(), &spec, &volumes).unwrap().unwrap();
        let node = std::fs::metadata(layer.join("disks/xvda")).unwrap();
        assert!(node.file_type().is_block_device());
        assert_eq!(node.rdev(), std::fs::metadata("/dev/null").unwrap().rdev());
        assert!(layer.join("hugepages").is_dir());

        let plain = container(json!({"volumeMounts": [{"name": "hp", "mountPath": "/data"}]}));
        assert_eq!(dev_layer(dir.path(), &plain, &volumes).unwrap(), None);
        assert!(!layer.exists(), "an earlier start's layer is left");

        let wrong = container(json!({"volumeDevices": [{"name": "hp", "devicePath": "/dev/x"}]}));
        assert_eq!(
            dev_layer(dir.path(), &wrong, &volumes)
                .unwrap_err()
                .to_string(),
            "volume \"hp\": has volumeMode Filesystem, but is specified in volumeDevices"
        );
    }

    /// The pod object's deletion is tried again until kube-apiserver takes it, and given up
    /// only when the kubelet halts.
    #[tokio::test]
    async fn failed_attempts_are_retried_until_done_or_halted() {
        let (tx, mut halt) = watch::channel(Halt::Run);
        let tries = std::cell::Cell::new(0);
        let attempt = || async {
            tries.set(tries.get() + 1);
            if tries.get() < 4 { Err(()) } else { Ok(()) }
        };
        until_done(attempt, &mut halt).await;
        assert_eq!(tries.get(), 4);

        tries.set(0);
        tx.send(Halt::Stop).unwrap();
        let never = || async {
            tries.set(tries.get() + 1);
            Err::<(), ()>(())
        };
        until_done(never, &mut halt).await;
        assert_eq!(tries.get(), 1);
    }

    #[test]
    fn commands_follow_kubernetes_over_the_image() {
        let v = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        let image = ociimage::ImageConfig {
            entrypoint: v(&["/entry"]),
            cmd: v(&["default"]),
            ..ociimage::ImageConfig::default()
        };
        let run = |c: Option<&[&str]>, a: Option<&[&str]>| {
            let c = c.map(v);
            let a = a.map(v);
            container_argv(c.as_deref(), a.as_deref(), &image)
        };
        assert_eq!(run(None, None), ["/entry", "default"]);
        assert_eq!(run(None, Some(&["x"])), ["/entry", "x"]);
        assert_eq!(run(Some(&["/bin/sh"]), None), ["/bin/sh"]);
        assert_eq!(
            run(Some(&["/bin/sh"]), Some(&["-c", "true"])),
            ["/bin/sh", "-c", "true"]
        );
        assert_eq!(run(Some(&[]), Some(&[])), ["/entry", "default"]);
        assert!(container_argv(None, None, &ociimage::ImageConfig::default()).is_empty());
    }

    #[test]
    fn qos_classes() {
        let pod = |resources: Value| -> Pod {
            serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {"containers": [
                {"name": "c", "image": "i", "resources": resources}]}}))
            .unwrap()
        };
        assert_eq!(qos_class(&pod(json!({}))), "BestEffort");
        assert_eq!(
            qos_class(&pod(json!({"limits": {"cpu": "1", "memory": "1Gi"}}))),
            "Guaranteed"
        );
        assert_eq!(
            qos_class(&pod(json!({"requests": {"cpu": "1"}}))),
            "Burstable"
        );
    }

    #[test]
    fn backoff_doubles_up_to_a_cap_and_expires() {
        let base = Duration::from_secs(10);
        let mut b = Duration::ZERO;
        let mut seen = Vec::new();
        for _ in 0..8 {
            b = next_backoff(b, base, Some(Duration::from_secs(1)));
            seen.push(b.as_secs());
        }
        assert_eq!(seen, vec![10, 20, 40, 80, 160, 300, 300, 300]);
        let minutes = |m: u64| Some(Duration::from_secs(m * 60));
        assert_eq!(next_backoff(b, base, minutes(10)).as_secs(), 300);
        assert_eq!(next_backoff(b, base, minutes(11)).as_secs(), 10, "expired");
    }

    #[test]
    fn exit_states() {
        use std::os::unix::process::ExitStatusExt as _;
        let ok = exit_state(&Ok(ExitStatus::from_raw(0)), "t");
        assert!(ok.succeeded());
        let killed = exit_state(&Ok(ExitStatus::from_raw(9)), "t");
        assert!(matches!(
            killed,
            State::Terminated {
                exit_code: 137,
                signal: Some(9),
                ..
            }
        ));
    }
}
