//! The virt-handler binary against the local cluster's API server and a kubelet stand-in:
//! unschedulable until its device plugins are registered, schedulable after, `/healthz` and
//! `/metrics` once its node loop runs, unschedulable again on SIGTERM, then a clean exit.

mod common;

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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Status code and body of a plain HTTP/1.0 GET.
async fn http_get(port: u16, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return (0, String::new());
    };
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
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
    let client = server.client().await.expect("client");
    common::install_crds(&client).await;
    let nodes: Api<Node> = Api::all(client);
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

    let port = free_port();
    let mut h = Handler(
        Command::new(env!("CARGO_BIN_EXE_virt-handler"))
            .args(["--hostname-override", "node-a", "--kubelet-root"])
            .arg(dir.path().join("kubelet"))
            .args(["--max-devices", "2"])
            .args(["--listen-address", "127.0.0.1", "--port", &port.to_string()])
            .args(["--console-server-port", &free_port().to_string()])
            .arg("--kubelet-pods-dir")
            .arg(dir.path().join("pods"))
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

    let deadline = tokio::time::Instant::now() + WAIT;
    while http_get(port, "/healthz").await.0 != 200 {
        assert!(tokio::time::Instant::now() < deadline, "/healthz never 200");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, metrics) = http_get(port, "/metrics").await;
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains("# TYPE kubevirt_vmi_phase_count gauge\n"),
        "{metrics}"
    );

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
