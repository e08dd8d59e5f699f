//! The virt-handler binary against the local cluster's API server and a kubelet stand-in:
//! unschedulable until its device plugins are registered, schedulable after, unschedulable
//! again on SIGTERM, then a clean exit.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use handler::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use handler::deviceplugin::v1beta1::{Empty, RegisterRequest};
use handler::heartbeat::LABEL_SCHEDULABLE;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::PostParams;
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

const WAIT: Duration = Duration::from_secs(60);

struct Kubelet(mpsc::UnboundedSender<String>);

#[tonic::async_trait]
impl Registration for Kubelet {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let _ = self.0.send(req.into_inner().resource_name);
        Ok(Response::new(Empty {}))
    }
}

fn fake_kubelet(dir: &Path, stop: CancellationToken) -> mpsc::UnboundedReceiver<String> {
    let (tx, rx) = mpsc::unbounded_channel();
    let listener = UnixListener::bind(dir.join("kubelet.sock")).expect("bind kubelet.sock");
    let incoming = futures::stream::unfold(listener, |l| async move {
        Some((l.accept().await.map(|(s, _)| s), l))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Kubelet(tx)))
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned()),
    );
    rx
}

struct Handler(Child);

impl Drop for Handler {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn schedulable(nodes: &Api<Node>) -> Option<String> {
    nodes
        .get("node-a")
        .await
        .expect("get node")
        .metadata
        .labels
        .and_then(|l| l.get(LABEL_SCHEDULABLE).cloned())
}

async fn wait_label(nodes: &Api<Node>, want: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while schedulable(nodes).await.as_deref() != Some(want) {
        assert!(tokio::time::Instant::now() < deadline, "never {want}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn binary_registers_plugins_heartbeats_and_leaves_unschedulable_on_sigterm() {
    let server = localcluster::ApiServer::start(localcluster::Config::default())
        .await
        .expect("API server");
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig).expect("kubeconfig");
    let nodes: Api<Node> = Api::all(server.client().await.expect("client"));
    let mut node = Node::default();
    node.metadata.name = Some("node-a".into());
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");

    let plugins = dir.path().join("kubelet/device-plugins");
    std::fs::create_dir_all(&plugins).expect("mkdir");
    let stop = CancellationToken::new();
    let mut registered = fake_kubelet(&plugins, stop.clone());

    let mut h = Handler(
        Command::new(env!("CARGO_BIN_EXE_virt-handler"))
            .args(["--hostname-override", "node-a", "--kubelet-root"])
            .arg(dir.path().join("kubelet"))
            .args(["--max-devices", "2"])
            .env("KUBECONFIG", &kubeconfig)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn virt-handler"),
    );

    let mut names = Vec::new();
    for _ in 0..3 {
        names.push(
            tokio::time::timeout(WAIT, registered.recv())
                .await
                .expect("a registration")
                .expect("kubelet alive"),
        );
    }
    names.sort();
    assert_eq!(
        names,
        [
            "devices.kubevirt.io/kvm",
            "devices.kubevirt.io/tun",
            "devices.kubevirt.io/vhost-net"
        ]
    );
    wait_label(&nodes, "true").await;

    let pid = h.0.id().to_string();
    let status = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = std::time::Instant::now() + WAIT;
    let exit = loop {
        if let Some(s) = h.0.try_wait().expect("wait") {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "virt-handler did not exit on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(exit.success(), "{exit}");
    assert_eq!(schedulable(&nodes).await.as_deref(), Some("false"));
    for s in [
        "kubevirt-kvm.sock",
        "kubevirt-tun.sock",
        "kubevirt-vhost-net.sock",
    ] {
        assert!(!plugins.join(s).exists(), "{s} left behind");
    }
    stop.cancel();
}
