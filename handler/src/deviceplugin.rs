//! Device plugins for `devices.kubevirt.io/kvm`, `tun` and `vhost-net` over the kubelet
//! device-plugin API v1beta1: each plugin serves gRPC on its own unix socket in the kubelet's
//! device-plugins dir and registers with the kubelet there. Like KubeVirt's generic device
//! plugin, a device node is shared: it is advertised as `count` interchangeable devices and
//! every allocation hands out the same node.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

pub use kubelet_api::v1beta1;

use v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use v1beta1::registration_client::RegistrationClient;
use v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions,
    DeviceSpec, Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, RegisterRequest,
};

pub use kubelet_api::{API_VERSION, HEALTHY, KUBELET_SOCKET, UNHEALTHY};
/// KubeVirt's `--max-devices` default.
pub const DEFAULT_COUNT: usize = 1000;

/// A host device node shared by every VMI that asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenericDevice {
    /// The last part of the resource name: `kvm`, `tun`, `vhost-net`.
    pub name: String,
    /// The device node on the host, and where it appears in the container.
    pub path: PathBuf,
}

impl GenericDevice {
    pub fn new(name: &str, path: &str) -> Self {
        GenericDevice {
            name: name.to_owned(),
            path: PathBuf::from(path),
        }
    }

    pub fn resource_name(&self) -> String {
        format!("{}/{}", api::labels::DEVICE_RESOURCE_PREFIX, self.name)
    }

    pub fn socket_name(&self) -> String {
        format!("kubevirt-{}.sock", self.name)
    }
}

/// The devices every virt-handler offers.
pub fn kubevirt_devices() -> Vec<GenericDevice> {
    vec![
        GenericDevice::new("kvm", "/dev/kvm"),
        GenericDevice::new("tun", "/dev/net/tun"),
        GenericDevice::new("vhost-net", "/dev/vhost-net"),
    ]
}

/// What ListAndWatch reports: `count` devices, all of the node's health.
pub fn device_list(dev: &GenericDevice, count: usize, healthy: bool) -> ListAndWatchResponse {
    let health = if healthy { HEALTHY } else { UNHEALTHY };
    ListAndWatchResponse {
        devices: (0..count)
            .map(|i| Device {
                id: format!("{}{i}", dev.name),
                health: health.to_owned(),
                topology: None,
            })
            .collect(),
    }
}

/// One device spec per container, whatever IDs it was given: the node is shared.
pub fn allocate(dev: &GenericDevice, req: &AllocateRequest) -> AllocateResponse {
    let path = dev.path.display().to_string();
    AllocateResponse {
        container_responses: req
            .container_requests
            .iter()
            .map(|_| ContainerAllocateResponse {
                devices: vec![DeviceSpec {
                    container_path: path.clone(),
                    host_path: path.clone(),
                    permissions: "rw".to_owned(),
                }],
                ..ContainerAllocateResponse::default()
            })
            .collect(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DevicePluginError {
    #[error("cannot serve the device plugin socket {socket}")]
    Bind {
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot reach the kubelet's registration socket {socket}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the kubelet at {socket} refused to register {resource}")]
    Register {
        socket: PathBuf,
        resource: String,
        #[source]
        source: Status,
    },
}

/// Settings shared by the plugins.
#[derive(Debug, Clone)]
pub struct Config {
    /// The kubelet's device-plugins dir (`/var/lib/kubelet/device-plugins`).
    pub plugins_dir: PathBuf,
    /// Where the device nodes are looked for when checking health (`/`; a test roots it
    /// elsewhere to make a device disappear).
    pub dev_root: PathBuf,
    pub count: usize,
    /// How often a device node's presence is checked. Polling, because device nodes come and
    /// go rarely and a stat every few seconds costs nothing next to a watcher's plumbing.
    pub health_interval: Duration,
}

struct Plugin {
    dev: GenericDevice,
    count: usize,
    health: watch::Receiver<bool>,
    /// Ends open ListAndWatch streams, without which a graceful server shutdown would wait for
    /// the kubelet to hang up.
    stop: CancellationToken,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    type ListAndWatchStream = DeviceStream;

    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let dev = self.dev.clone();
        let count = self.count;
        let rx = self.health.clone();
        let stop = self.stop.clone();
        // The current list first, then a new one on every health change; ends when the plugin
        // stops.
        let stream = futures::stream::unfold((rx, true), move |(mut rx, first)| {
            let dev = dev.clone();
            let stop = stop.clone();
            async move {
                if !first {
                    tokio::select! {
                        () = stop.cancelled() => return None,
                        r = rx.changed() => r.ok()?,
                    }
                }
                let healthy = *rx.borrow_and_update();
                Some((Ok(device_list(&dev, count, healthy)), (rx, false)))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented(
            "GetPreferredAllocation is not offered (GetPreferredAllocationAvailable is false)",
        ))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(resource = %self.dev.resource_name(), containers = req.container_requests.len(), "allocate");
        Ok(Response::new(allocate(&self.dev, &req)))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

fn present(root: &Path, path: &Path) -> bool {
    root.join(path.strip_prefix("/").unwrap_or(path)).exists()
}

/// A registered plugin; it serves until the shutdown token passed to [`start`] is cancelled.
#[derive(Debug)]
pub struct Running {
    pub socket: PathBuf,
    pub task: tokio::task::JoinHandle<()>,
}

/// Serves the plugin on its socket and registers it with the kubelet. Returns once the kubelet
/// accepted the registration.
pub async fn start(
    dev: GenericDevice,
    cfg: &Config,
    shutdown: CancellationToken,
) -> Result<Running, DevicePluginError> {
    let socket = cfg.plugins_dir.join(dev.socket_name());
    // A socket left by a previous handler would make bind fail.
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).map_err(|source| DevicePluginError::Bind {
        socket: socket.clone(),
        source,
    })?;

    let (health_tx, health_rx) = watch::channel(present(&cfg.dev_root, &dev.path));
    let plugin = Plugin {
        dev: dev.clone(),
        count: cfg.count,
        health: health_rx,
        stop: shutdown.clone(),
    };
    let incoming = futures::stream::unfold(listener, |l| async move {
        let conn = l.accept().await.map(|(s, _)| s);
        Some((conn, l))
    });
    let (root, path, every) = (cfg.dev_root.clone(), dev.path.clone(), cfg.health_interval);
    let stop = shutdown.clone();
    let sock = socket.clone();
    let task = tokio::spawn(async move {
        let health = async {
            loop {
                tokio::time::sleep(every).await;
                let now = present(&root, &path);
                health_tx.send_if_modified(|h| std::mem::replace(h, now) != now);
            }
        };
        let serve = tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(plugin))
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned());
        tokio::select! {
            r = serve => if let Err(e) = r {
                tracing::warn!(socket = %sock.display(), error = %e, "device plugin server ended");
            },
            () = health => {}
        }
        let _ = std::fs::remove_file(&sock);
    });

    let kubelet = cfg.plugins_dir.join(KUBELET_SOCKET);
    let result = register(&kubelet, &dev).await;
    if let Err(e) = result {
        shutdown.cancel();
        task.abort();
        let _ = std::fs::remove_file(&socket);
        return Err(e);
    }
    tracing::info!(resource = %dev.resource_name(), socket = %socket.display(), "device plugin registered");
    Ok(Running { socket, task })
}

/// A file's identity (device, inode), `None` while it does not exist: a kubelet that restarts
/// creates a new `kubelet.sock` and removes the plugins' sockets.
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Keeps every plugin of `devs` registered until `stop`, and says on `ready` whether all of
/// them are. A plugin the kubelet refuses or cannot take yet is tried again every `retry`.
/// When the kubelet restarts (its `kubelet.sock` is replaced, or our socket is removed, which
/// the kubelet does to every plugin socket when it starts), the plugin is served afresh and
/// registered again, as KubeVirt's plugins do. Returns when `stop` fires and every plugin has
/// stopped and removed its socket.
pub async fn run(
    devs: Vec<GenericDevice>,
    cfg: Config,
    retry: Duration,
    ready: watch::Sender<bool>,
    stop: CancellationToken,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, dev) in devs.iter().enumerate() {
        let (dev, cfg, stop, tx) = (dev.clone(), cfg.clone(), stop.clone(), tx.clone());
        tasks.spawn(keep_registered(dev, cfg, retry, stop, move |up| {
            let _ = tx.send((i, up));
        }));
    }
    drop(tx);
    let mut up = vec![false; devs.len()];
    while let Some((i, now)) = rx.recv().await {
        up[i] = now;
        ready.send_if_modified(|r| std::mem::replace(r, up.iter().all(|u| *u)) != *r);
    }
    while tasks.join_next().await.is_some() {}
}

/// One plugin's life: start and register, watch for a kubelet restart, start again.
async fn keep_registered(
    dev: GenericDevice,
    cfg: Config,
    retry: Duration,
    stop: CancellationToken,
    report: impl Fn(bool),
) {
    let kubelet = cfg.plugins_dir.join(KUBELET_SOCKET);
    while !stop.is_cancelled() {
        let token = stop.child_token();
        let kubelet_then = identity(&kubelet);
        let running = match start(dev.clone(), &cfg, token.clone()).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "device plugin not registered yet");
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(retry) => {}
                }
                continue;
            }
        };
        report(true);
        let ours = identity(&running.socket);
        // Polled like device health: a kubelet restart is rare, and a few seconds of delay
        // only postpones new allocations.
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(cfg.health_interval) => {}
            }
            if identity(&kubelet) != kubelet_then || identity(&running.socket) != ours {
                tracing::info!(resource = %dev.resource_name(), "the kubelet restarted: registering again");
                report(false);
                break;
            }
        }
        token.cancel();
        let _ = running.task.await;
    }
}

async fn register(kubelet: &Path, dev: &GenericDevice) -> Result<(), DevicePluginError> {
    let path = kubelet.to_owned();
    // The URI is a placeholder: the connector below always dials the unix socket.
    let channel = tonic::transport::Endpoint::from_static("http://kubelet.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|source| DevicePluginError::Connect {
            socket: kubelet.to_owned(),
            source,
        })?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: API_VERSION.to_owned(),
            endpoint: dev.socket_name(),
            resource_name: dev.resource_name(),
            options: Some(DevicePluginOptions::default()),
        })
        .await
        .map_err(|source| DevicePluginError::Register {
            socket: kubelet.to_owned(),
            resource: dev.resource_name(),
            source,
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use v1beta1::ContainerAllocateRequest;

    #[test]
    fn names_and_lists_follow_kubevirt() {
        let devs = kubevirt_devices();
        let names: Vec<_> = devs.iter().map(GenericDevice::resource_name).collect();
        assert_eq!(
            names,
            [
                "devices.kubevirt.io/kvm",
                "devices.kubevirt.io/tun",
                "devices.kubevirt.io/vhost-net"
            ]
        );
        assert_eq!(devs[2].socket_name(), "kubevirt-vhost-net.sock");
        let l = device_list(&devs[0], 3, false);
        let ids: Vec<_> = l
            .devices
            .iter()
            .map(|d| (d.id.as_str(), d.health.as_str()))
            .collect();
        assert_eq!(
            ids,
            [
                ("kvm0", UNHEALTHY),
                ("kvm1", UNHEALTHY),
                ("kvm2", UNHEALTHY)
            ]
        );
    }

    #[test]
    fn allocate_gives_each_container_the_node() {
        let tun = GenericDevice::new("tun", "/dev/net/tun");
        let req = AllocateRequest {
            container_requests: vec![
                ContainerAllocateRequest {
                    devices_ids: vec!["tun0".into(), "tun1".into()],
                },
                ContainerAllocateRequest {
                    devices_ids: vec!["tun7".into()],
                },
            ],
        };
        let resp = allocate(&tun, &req);
        assert_eq!(resp.container_responses.len(), 2);
        for c in &resp.container_responses {
            assert_eq!(
                c.devices,
                vec![DeviceSpec {
                    container_path: "/dev/net/tun".into(),
                    host_path: "/dev/net/tun".into(),
                    permissions: "rw".into(),
                }]
            );
        }
    }
}
