//! The kubelet's device-plugin manager (API v1beta1): the `Registration` service on
//! `<kubelet dir>/device-plugins/kubelet.sock`; for each registered plugin a `ListAndWatch`
//! stream whose devices become the node's capacity (all) and allocatable (healthy) for the
//! plugin's resource; and `Allocate` (plus `PreStartContainer` when the plugin asks for it)
//! when a container that requests the resource starts, whose device specs, mounts and
//! environment the container then gets.
//!
//! Like the real kubelet, a plugin whose stream ends keeps its resource with every device
//! unhealthy (allocatable 0) until it registers again; a new registration for a resource
//! replaces the old plugin. Allocations are per container, kept across its restarts and freed
//! with its pod; they are checkpointed (as the kubelet's `kubelet_internal_checkpoint`), so a
//! restarted kubelet, whose plugins must register again, still knows which devices its running
//! containers hold.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use api::quantity::ParsedQuantity;
use futures::StreamExt as _;
use hyper_util::rt::TokioIo;
use kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use kubelet_api::v1beta1::registration_server::{Registration, RegistrationServer};
use kubelet_api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse, Empty,
    PreStartContainerRequest, RegisterRequest,
};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::KubeletError;

/// One registered plugin's resource.
#[derive(Debug, Default)]
struct Resource {
    /// The plugin's socket.
    endpoint: PathBuf,
    /// Bumped by every registration, so a replaced plugin's stream no longer counts.
    generation: u64,
    pre_start_required: bool,
    /// Device id -> healthy.
    devices: BTreeMap<String, bool>,
    /// Device id -> the container holding it (`<pod uid>/<container>`).
    allocations: BTreeMap<String, String>,
}

impl Resource {
    /// Capacity (every device) and allocatable (the healthy ones).
    fn counts(&self) -> (usize, usize) {
        (
            self.devices.len(),
            self.devices.values().filter(|h| **h).count(),
        )
    }
}

/// The devices `owner` gets: those it already holds, topped up with free healthy ones in id
/// order; `None` when too few are free.
fn pick(
    devices: &BTreeMap<String, bool>,
    allocations: &BTreeMap<String, String>,
    owner: &str,
    count: usize,
) -> Option<Vec<String>> {
    let mut picked: Vec<String> = allocations
        .iter()
        .filter(|(id, o)| *o == owner && devices.contains_key(*id))
        .map(|(id, _)| id.clone())
        .take(count)
        .collect();
    for (id, healthy) in devices {
        if picked.len() == count {
            break;
        }
        if *healthy && !allocations.contains_key(id) {
            picked.push(id.clone());
        }
    }
    (picked.len() == count).then_some(picked)
}

/// Why a registration is refused (the message goes back to the plugin).
pub fn check_registration(req: &RegisterRequest) -> Result<(), String> {
    if req.version != kubelet_api::API_VERSION {
        return Err(format!(
            "unsupported API version {:?}: this kubelet serves {}",
            req.version,
            kubelet_api::API_VERSION
        ));
    }
    let Some((domain, name)) = req.resource_name.split_once('/') else {
        return Err(format!(
            "resource name {:?} is not an extended resource name (<domain>/<name>)",
            req.resource_name
        ));
    };
    if domain.is_empty() || name.is_empty() || name.contains('/') {
        return Err(format!(
            "resource name {:?} is not an extended resource name (<domain>/<name>)",
            req.resource_name
        ));
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return Err(format!(
            "resource name {:?}: the kubernetes.io domain is reserved",
            req.resource_name
        ));
    }
    if req.endpoint.is_empty() || req.endpoint.contains('/') {
        return Err(format!(
            "endpoint {:?} must be a socket file name in the device-plugins directory",
            req.endpoint
        ));
    }
    Ok(())
}

/// What the kubelet knows of device plugins on its node.
#[derive(Debug)]
pub(crate) struct DeviceManager {
    dir: PathBuf,
    resources: Mutex<BTreeMap<String, Resource>>,
    /// Signalled when capacity or allocatable changed, so the node status is posted at once.
    pub changed: Notify,
    tasks: Mutex<JoinSet<()>>,
}

/// The allocations' checkpoint in the device-plugins directory (the real kubelet's name).
const CHECKPOINT: &str = "kubelet_internal_checkpoint";

/// Resource -> device id -> the container holding it.
type Allocations = BTreeMap<String, BTreeMap<String, String>>;

impl DeviceManager {
    /// Serves `Registration` on `<dir>/kubelet.sock`. As the real kubelet's device manager,
    /// it first removes everything in `dir` but the checkpoint: the plugins' sockets going is
    /// what tells a plugin to register again (a new `kubelet.sock` alone may reuse the old
    /// one's inode, and a plugin watching it would not notice). `restarted`: the allocations of
    /// the previous kubelet's containers stand; otherwise they are dropped.
    pub fn start(dir: &Path, restarted: bool) -> Result<Arc<Self>, KubeletError> {
        let socket = dir.join(kubelet_api::KUBELET_SOCKET);
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_name() != CHECKPOINT && !entry.path().is_dir() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let checkpoint = dir.join(CHECKPOINT);
        let kept: Allocations = if restarted {
            std::fs::read(&checkpoint)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default()
        } else {
            let _ = std::fs::remove_file(&checkpoint);
            Allocations::new()
        };
        let resources = kept
            .into_iter()
            .map(|(name, allocations)| {
                let r = Resource {
                    allocations,
                    ..Resource::default()
                };
                (name, r)
            })
            .collect();
        let listener = UnixListener::bind(&socket).map_err(|source| KubeletError::Io {
            path: socket.display().to_string(),
            source,
        })?;
        let manager = Arc::new(Self {
            dir: dir.to_path_buf(),
            resources: Mutex::new(resources),
            changed: Notify::new(),
            tasks: Mutex::new(JoinSet::new()),
        });
        let incoming = futures::stream::unfold(listener, |l| async move {
            let conn = l.accept().await.map(|(s, _)| s);
            Some((conn, l))
        });
        let service = RegistrationServer::new(Registrar {
            manager: Arc::downgrade(&manager),
        });
        manager.spawn(async move {
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await
            {
                tracing::warn!(socket = %socket.display(), error = %e, "device-plugin registration server ended");
            }
        });
        Ok(manager)
    }

    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        if let Ok(mut tasks) = self.tasks.lock() {
            while tasks.try_join_next().is_some() {}
            tasks.spawn(task);
        }
    }

    /// Stops serving and watching plugins and removes the registration socket.
    pub fn stop(&self) {
        if let Ok(mut tasks) = self.tasks.lock() {
            tasks.abort_all();
        }
        let _ = std::fs::remove_file(self.dir.join(kubelet_api::KUBELET_SOCKET));
    }

    /// Capacity and allocatable of every registered plugin's resource.
    pub fn counts(&self) -> BTreeMap<String, (usize, usize)> {
        self.resources
            .lock()
            .map(|r| {
                r.iter()
                    // Kept from before a restart, its plugin not back yet.
                    .filter(|(_, v)| v.generation > 0)
                    .map(|(k, v)| (k.clone(), v.counts()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Writes the allocations' checkpoint; called with the lock held, after each change.
    fn save(&self, resources: &BTreeMap<String, Resource>) {
        let allocations: Allocations = resources
            .iter()
            .filter(|(_, r)| !r.allocations.is_empty())
            .map(|(k, r)| (k.clone(), r.allocations.clone()))
            .collect();
        let path = self.dir.join(CHECKPOINT);
        let partial = self.dir.join(format!("{CHECKPOINT}.partial"));
        let written = serde_json::to_vec(&allocations)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&partial, b))
            .and_then(|()| std::fs::rename(&partial, &path));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "writing the device checkpoint");
        }
    }

    fn register(self: &Arc<Self>, req: RegisterRequest) {
        let endpoint = self.dir.join(&req.endpoint);
        let generation = {
            let Ok(mut resources) = self.resources.lock() else {
                return;
            };
            let r = resources.entry(req.resource_name.clone()).or_default();
            r.generation += 1;
            r.endpoint.clone_from(&endpoint);
            r.pre_start_required = req.options.as_ref().is_some_and(|o| o.pre_start_required);
            r.generation
        };
        tracing::info!(resource = %req.resource_name, endpoint = %endpoint.display(), "device plugin registered");
        let manager = self.clone();
        let resource = req.resource_name;
        self.spawn(async move {
            let result = manager.list_and_watch(&resource, &endpoint, generation).await;
            if let Err(e) = result {
                tracing::warn!(%resource, endpoint = %endpoint.display(), error = %e, "device plugin ListAndWatch");
            }
            // The plugin is gone: its devices are unhealthy until it registers again.
            manager.update(&resource, generation, |r| {
                r.devices.values_mut().for_each(|h| *h = false);
            });
        });
    }

    /// Applies `f` to the resource if `generation` is still its plugin's, then signals.
    fn update(&self, resource: &str, generation: u64, f: impl FnOnce(&mut Resource)) {
        if let Ok(mut resources) = self.resources.lock()
            && let Some(r) = resources.get_mut(resource)
            && r.generation == generation
        {
            f(r);
        }
        self.changed.notify_one();
    }

    async fn list_and_watch(
        &self,
        resource: &str,
        endpoint: &Path,
        generation: u64,
    ) -> Result<(), Status> {
        let mut client = DevicePluginClient::new(dial(endpoint).await?);
        let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
        while let Some(list) = stream.next().await {
            let list = list?;
            let devices: BTreeMap<String, bool> = list
                .devices
                .into_iter()
                .map(|d| (d.id, d.health == kubelet_api::HEALTHY))
                .collect();
            tracing::debug!(%resource, devices = devices.len(), "device list");
            self.update(resource, generation, |r| {
                r.allocations.retain(|id, _| devices.contains_key(id));
                r.devices = devices;
            });
        }
        Ok(())
    }

    /// Allocates `requests` (resource -> device count) of plugin resources to `owner`
    /// (`<pod uid>/<container>`) and asks each plugin what the container needs. Resources no
    /// plugin registered are skipped (a static `--extended-resource`).
    pub async fn allocate(
        &self,
        owner: &str,
        requests: &BTreeMap<String, usize>,
    ) -> Result<Vec<ContainerAllocateResponse>, KubeletError> {
        let mut responses = Vec::new();
        for (resource, count) in requests {
            let picked = {
                let mut resources = self.resources.lock().map_err(|_| KubeletError::Device {
                    resource: resource.clone(),
                    message: "device state poisoned".into(),
                })?;
                let Some(r) = resources.get_mut(resource) else {
                    continue;
                };
                let ids = pick(&r.devices, &r.allocations, owner, *count).ok_or_else(|| {
                    KubeletError::Device {
                        resource: resource.clone(),
                        message: format!(
                            "{count} requested, {} healthy and free",
                            r.devices
                                .iter()
                                .filter(|(id, h)| **h && !r.allocations.contains_key(*id))
                                .count()
                        ),
                    }
                })?;
                for id in &ids {
                    r.allocations.insert(id.clone(), owner.to_string());
                }
                let picked = (ids, r.endpoint.clone(), r.pre_start_required);
                self.save(&resources);
                picked
            };
            let (ids, endpoint, pre_start) = picked;
            let failed = |status: Status| KubeletError::Device {
                resource: resource.clone(),
                message: format!("plugin at {}: {}", endpoint.display(), status.message()),
            };
            let mut client = DevicePluginClient::new(dial(&endpoint).await.map_err(failed)?);
            let mut response = client
                .allocate(AllocateRequest {
                    container_requests: vec![ContainerAllocateRequest {
                        devices_ids: ids.clone(),
                    }],
                })
                .await
                .map_err(failed)?
                .into_inner();
            if pre_start {
                client
                    .pre_start_container(PreStartContainerRequest { devices_ids: ids })
                    .await
                    .map_err(failed)?;
            }
            if response.container_responses.len() != 1 {
                return Err(KubeletError::Device {
                    resource: resource.clone(),
                    message: format!(
                        "plugin answered {} container responses to one request",
                        response.container_responses.len()
                    ),
                });
            }
            responses.append(&mut response.container_responses);
        }
        Ok(responses)
    }

    /// Frees every device held by containers of the pod `uid`.
    pub fn release(&self, uid: &str) {
        let prefix = format!("{uid}/");
        if let Ok(mut resources) = self.resources.lock() {
            for r in resources.values_mut() {
                r.allocations.retain(|_, owner| !owner.starts_with(&prefix));
            }
            self.save(&resources);
        }
    }
}

/// Connects to a plugin's unix socket.
async fn dial(socket: &Path) -> Result<Channel, Status> {
    let path = socket.to_path_buf();
    // The URI is a placeholder: the connector always dials the socket.
    tonic::transport::Endpoint::from_static("http://device-plugin.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|e| Status::unavailable(format!("dialling {}: {e}", socket.display())))
}

struct Registrar {
    /// Weak, so the server task does not keep the manager alive.
    manager: std::sync::Weak<DeviceManager>,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = req.into_inner();
        check_registration(&req).map_err(Status::invalid_argument)?;
        let manager = self
            .manager
            .upgrade()
            .ok_or_else(|| Status::unavailable("the kubelet is stopping"))?;
        manager.register(req);
        Ok(Response::new(Empty {}))
    }
}

/// The device counts a container requests of each extended resource: its limits (where
/// Kubernetes requires extended resources), else its requests. Whole units only.
pub fn device_requests(
    container: &k8s_openapi::api::core::v1::Container,
) -> BTreeMap<String, usize> {
    let Some(resources) = &container.resources else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for map in [&resources.requests, &resources.limits]
        .into_iter()
        .flatten()
    {
        for (name, q) in map {
            if !name.contains('/') || name.starts_with("kubernetes.io/") {
                continue;
            }
            if let Some(n) = ParsedQuantity::from_quantity(q)
                .ok()
                .and_then(|p| usize::try_from(p.value()).ok())
                .filter(|n| *n > 0)
            {
                out.insert(name.clone(), n);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubelet_api::v1beta1::DevicePluginOptions;
    use serde_json::json;

    #[tokio::test]
    async fn allocations_outlive_a_restart_and_only_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let manager = DeviceManager::start(dir.path(), false).unwrap();
        {
            let mut resources = manager.resources.lock().unwrap();
            let kvm = resources
                .entry("devices.kubevirt.io/kvm".into())
                .or_default();
            kvm.generation = 1;
            kvm.devices.insert("kvm0".into(), true);
            kvm.allocations
                .insert("kvm0".into(), "uid-1/compute".into());
            manager.save(&resources);
        }
        manager.stop();
        let plugin = dir.path().join("kubevirt-kvm.sock");
        std::fs::write(&plugin, b"").unwrap();
        let restarted = DeviceManager::start(dir.path(), true).unwrap();
        assert!(!plugin.exists(), "plugins are told to register again");
        let kept = restarted.resources.lock().unwrap()["devices.kubevirt.io/kvm"]
            .allocations
            .clone();
        assert_eq!(
            kept,
            BTreeMap::from([("kvm0".into(), "uid-1/compute".into())])
        );
        assert!(
            restarted.counts().is_empty(),
            "no capacity is reported before the plugin registers again"
        );
        restarted.release("uid-1");
        restarted.stop();
        let again = DeviceManager::start(dir.path(), true).unwrap();
        assert!(
            again.resources.lock().unwrap().is_empty(),
            "released for good"
        );
        again.stop();
        let manager = DeviceManager::start(dir.path(), false).unwrap();
        {
            let mut resources = manager.resources.lock().unwrap();
            resources
                .entry("r/x".into())
                .or_default()
                .allocations
                .insert("a".into(), "o".into());
            manager.save(&resources);
        }
        manager.stop();
        let fresh = DeviceManager::start(dir.path(), false).unwrap();
        assert!(
            fresh.resources.lock().unwrap().is_empty(),
            "a fresh start drops them"
        );
        fresh.stop();
    }

    fn request(version: &str, resource: &str, endpoint: &str) -> RegisterRequest {
        RegisterRequest {
            version: version.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: Some(DevicePluginOptions::default()),
        }
    }

    #[test]
    fn registrations_are_checked() {
        assert!(
            check_registration(&request("v1beta1", "devices.kubevirt.io/kvm", "kvm.sock")).is_ok()
        );
        let err = |r| check_registration(&r).unwrap_err();
        assert!(err(request("v1alpha", "a.io/x", "x.sock")).contains("unsupported API version"));
        assert!(err(request("v1beta1", "kvm", "x.sock")).contains("not an extended resource"));
        assert!(err(request("v1beta1", "kubernetes.io/x", "x.sock")).contains("reserved"));
        assert!(err(request("v1beta1", "a.io/x", "../x.sock")).contains("socket file name"));
    }

    #[test]
    fn picking_reuses_then_takes_free_healthy_devices() {
        let devices: BTreeMap<String, bool> = [("a", true), ("b", false), ("c", true), ("d", true)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let mut held = BTreeMap::from([("c".to_string(), "p/one".to_string())]);
        assert_eq!(pick(&devices, &held, "p/one", 2).unwrap(), ["c", "a"]);
        assert_eq!(pick(&devices, &held, "p/two", 2).unwrap(), ["a", "d"]);
        assert_eq!(pick(&devices, &held, "p/two", 3), None);
        held.insert("zz".into(), "p/one".into());
        assert_eq!(pick(&devices, &held, "p/one", 1).unwrap(), ["c"]);
        let r = Resource {
            devices,
            ..Resource::default()
        };
        assert_eq!(r.counts(), (4, 3));
    }

    #[test]
    fn device_requests_are_whole_extended_resources() {
        let c: k8s_openapi::api::core::v1::Container = serde_json::from_value(json!({
            "name": "c",
            "resources": {
                "limits": {"cpu": "1", "devices.kubevirt.io/kvm": "1", "example.com/gpu": "2"},
                "requests": {"memory": "1Gi", "example.com/nic": "1"},
            }
        }))
        .unwrap();
        let got = device_requests(&c);
        assert_eq!(
            got,
            BTreeMap::from([
                ("devices.kubevirt.io/kvm".to_string(), 1),
                ("example.com/gpu".to_string(), 2),
                ("example.com/nic".to_string(), 1),
            ])
        );
    }
}
