//! Device plugins against a kubelet stand-in: a real gRPC Registration server on the kubelet
//! socket that records registrations, and a real gRPC client that dials the plugin back, as
//! the kubelet does.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use handler::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use handler::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use handler::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, Empty, RegisterRequest,
};
use handler::deviceplugin::{self, Config, GenericDevice, HEALTHY, UNHEALTHY};
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Mutex, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

const WAIT: Duration = Duration::from_secs(20);

struct Kubelet {
    seen: mpsc::UnboundedSender<RegisterRequest>,
    refuse: Arc<Mutex<bool>>,
}

#[tonic::async_trait]
impl Registration for Kubelet {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        if *self.refuse.lock().await {
            return Err(Status::invalid_argument("resource name already registered"));
        }
        let _ = self.seen.send(req.into_inner());
        Ok(Response::new(Empty {}))
    }
}

fn fake_kubelet(
    dir: &Path,
    stop: CancellationToken,
) -> (mpsc::UnboundedReceiver<RegisterRequest>, Arc<Mutex<bool>>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let refuse = Arc::new(Mutex::new(false));
    let listener = UnixListener::bind(dir.join("kubelet.sock")).expect("bind kubelet.sock");
    let incoming = futures::stream::unfold(listener, |l| async move {
        Some((l.accept().await.map(|(s, _)| s), l))
    });
    let svc = RegistrationServer::new(Kubelet {
        seen: tx,
        refuse: refuse.clone(),
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned()),
    );
    (rx, refuse)
}

async fn dial(socket: &Path) -> DevicePluginClient<tonic::transport::Channel> {
    let path = socket.to_owned();
    let channel = tonic::transport::Endpoint::from_static("http://plugin.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .expect("dial the plugin");
    DevicePluginClient::new(channel)
}

#[tokio::test]
async fn plugins_register_list_watch_health_and_allocate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev_root = tempfile::tempdir().expect("dev root");
    std::fs::create_dir_all(dev_root.path().join("dev/net")).expect("mkdir");
    for d in ["dev/kvm", "dev/net/tun", "dev/vhost-net"] {
        std::fs::write(dev_root.path().join(d), "").expect("fake node");
    }
    let stop = CancellationToken::new();
    let (mut registered, _) = fake_kubelet(dir.path(), stop.clone());
    let cfg = Config {
        plugins_dir: dir.path().to_owned(),
        dev_root: dev_root.path().to_owned(),
        count: 4,
        health_interval: Duration::from_millis(100),
    };
    let mut running = Vec::new();
    for dev in deviceplugin::kubevirt_devices() {
        running.push(
            deviceplugin::start(dev, &cfg, stop.clone())
                .await
                .expect("start"),
        );
    }

    let mut got = Vec::new();
    for _ in 0..3 {
        let r = tokio::time::timeout(WAIT, registered.recv())
            .await
            .expect("a registration")
            .expect("kubelet alive");
        got.push((r.version, r.endpoint, r.resource_name));
    }
    got.sort();
    assert_eq!(
        got,
        [
            (
                "v1beta1".into(),
                "kubevirt-kvm.sock".into(),
                "devices.kubevirt.io/kvm".into()
            ),
            (
                "v1beta1".into(),
                "kubevirt-tun.sock".into(),
                "devices.kubevirt.io/tun".into()
            ),
            (
                "v1beta1".into(),
                "kubevirt-vhost-net.sock".into(),
                "devices.kubevirt.io/vhost-net".into()
            ),
        ]
    );

    // The kubelet dials the endpoint it was given.
    let mut kvm = dial(&dir.path().join("kubevirt-kvm.sock")).await;
    let mut watch = kvm
        .list_and_watch(Empty {})
        .await
        .expect("ListAndWatch")
        .into_inner();
    let first = tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("a list")
        .expect("stream open")
        .expect("no error");
    let ids: Vec<_> = first.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["kvm0", "kvm1", "kvm2", "kvm3"]);
    assert!(first.devices.iter().all(|d| d.health == HEALTHY));

    let resp = kvm
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["kvm1".into()],
            }],
        })
        .await
        .expect("Allocate")
        .into_inner();
    let spec = &resp.container_responses[0].devices[0];
    assert_eq!(
        (
            spec.host_path.as_str(),
            spec.container_path.as_str(),
            spec.permissions.as_str()
        ),
        ("/dev/kvm", "/dev/kvm", "rw")
    );

    // The node disappears: the devices turn Unhealthy; it comes back: Healthy again.
    std::fs::remove_file(dev_root.path().join("dev/kvm")).expect("remove");
    let next = tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("an update")
        .expect("open")
        .expect("ok");
    assert!(
        next.devices.iter().all(|d| d.health == UNHEALTHY),
        "{next:?}"
    );
    std::fs::write(dev_root.path().join("dev/kvm"), "").expect("restore");
    let next = tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("an update")
        .expect("open")
        .expect("ok");
    assert!(next.devices.iter().all(|d| d.health == HEALTHY));

    let mut tun = dial(&dir.path().join("kubevirt-tun.sock")).await;
    let resp = tun
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["tun0".into()],
            }],
        })
        .await
        .expect("Allocate")
        .into_inner();
    assert_eq!(
        resp.container_responses[0].devices[0].host_path,
        "/dev/net/tun"
    );

    // Stopping ends the watch and removes the sockets.
    stop.cancel();
    for r in running {
        tokio::time::timeout(WAIT, r.task)
            .await
            .expect("stops")
            .expect("no panic");
        assert!(!r.socket.exists(), "{} left behind", r.socket.display());
    }
    let end = tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("ends");
    assert!(!matches!(end, Some(Ok(_))), "{end:?}");
}

#[tokio::test]
async fn a_refused_or_missing_kubelet_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = Config {
        plugins_dir: dir.path().to_owned(),
        dev_root: "/".into(),
        count: 1,
        health_interval: Duration::from_secs(5),
    };
    let kvm = GenericDevice::new("kvm", "/dev/kvm");
    let e = deviceplugin::start(kvm.clone(), &cfg, CancellationToken::new())
        .await
        .expect_err("no kubelet");
    assert!(e.to_string().contains("kubelet.sock"), "{e}");
    assert!(
        !dir.path().join("kubevirt-kvm.sock").exists(),
        "socket cleaned up"
    );

    let stop = CancellationToken::new();
    let (_rx, refuse) = fake_kubelet(dir.path(), stop.clone());
    *refuse.lock().await = true;
    let e = deviceplugin::start(kvm, &cfg, stop.clone())
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("devices.kubevirt.io/kvm"), "{e}");
    stop.cancel();
}

async fn registrations(rx: &mut mpsc::UnboundedReceiver<RegisterRequest>) -> Vec<String> {
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("a registration")
            .expect("kubelet alive");
        got.push(r.resource_name);
    }
    got.sort();
    got
}

#[tokio::test]
async fn plugins_register_again_when_the_kubelet_restarts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev_root = tempfile::tempdir().expect("dev root");
    std::fs::write(dev_root.path().join("kvm"), "").expect("fake node");
    let cfg = Config {
        plugins_dir: dir.path().to_owned(),
        dev_root: dev_root.path().to_owned(),
        count: 2,
        health_interval: Duration::from_millis(100),
    };
    let devs = vec![
        GenericDevice::new("kvm", "/kvm"),
        GenericDevice::new("tun", "/tun"),
        GenericDevice::new("vhost-net", "/vhost-net"),
    ];
    let names = [
        "devices.kubevirt.io/kvm",
        "devices.kubevirt.io/tun",
        "devices.kubevirt.io/vhost-net",
    ];
    let stop = CancellationToken::new();
    let first = CancellationToken::new();
    let (mut seen, _) = fake_kubelet(dir.path(), first.clone());
    let (ready_tx, mut ready) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(deviceplugin::run(
        devs,
        cfg,
        Duration::from_millis(200),
        ready_tx,
        stop.clone(),
    ));
    assert_eq!(registrations(&mut seen).await, names);
    tokio::time::timeout(WAIT, ready.wait_for(|r| *r))
        .await
        .expect("ready after registering")
        .expect("sender alive");

    // The kubelet restarts: it goes away, and when it starts it removes every socket in the
    // device-plugins dir and serves a new kubelet.sock.
    first.cancel();
    for entry in std::fs::read_dir(dir.path()).expect("read dir") {
        std::fs::remove_file(entry.expect("entry").path()).expect("remove socket");
    }
    tokio::time::timeout(WAIT, ready.wait_for(|r| !*r))
        .await
        .expect("not ready once the kubelet is gone")
        .expect("sender alive");
    let second = CancellationToken::new();
    let (mut seen, _) = fake_kubelet(dir.path(), second.clone());
    assert_eq!(registrations(&mut seen).await, names);
    tokio::time::timeout(WAIT, ready.wait_for(|r| *r))
        .await
        .expect("ready again")
        .expect("sender alive");

    // The new kubelet reaches the plugin on its new socket.
    let mut kvm = dial(&dir.path().join("kubevirt-kvm.sock")).await;
    let list = tokio::time::timeout(WAIT, async {
        kvm.list_and_watch(Empty {})
            .await
            .expect("ListAndWatch")
            .into_inner()
            .next()
            .await
    })
    .await
    .expect("a list")
    .expect("stream open")
    .expect("no error");
    let ids: Vec<_> = list.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["kvm0", "kvm1"]);
    assert!(list.devices.iter().all(|d| d.health == HEALTHY));

    stop.cancel();
    tokio::time::timeout(WAIT, task)
        .await
        .expect("stops")
        .expect("no panic");
    second.cancel();
    for name in [
        "kubevirt-kvm.sock",
        "kubevirt-tun.sock",
        "kubevirt-vhost-net.sock",
    ] {
        assert!(!dir.path().join(name).exists(), "{name} left behind");
    }
}
