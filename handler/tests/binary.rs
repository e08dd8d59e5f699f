//! The virt-handler binary against localcluster's upstream control plane and a kubelet stand-in:
//! unschedulable until its device plugins are registered, schedulable after, `/healthz` and
//! `/metrics` over HTTPS once its certificate is there and its node loop runs (never plain
//! HTTP), unschedulable again on SIGTERM, then a clean exit.

mod common;

use std::process::Command;
use std::time::Duration;

use handler::heartbeat::LABEL_SCHEDULABLE;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_mins(1);

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
    let cluster = common::HandlerCluster::start("node-a").await;
    let (dir, kubeconfig) = (&cluster.dir, &cluster.kubeconfig);
    let nodes: Api<Node> = Api::all(cluster.client.clone());

    // A label a former CPU left: the node labeller removes it.
    let stale = "cpu-model.node.kubevirt.io/Stale";
    nodes
        .patch(
            "node-a",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"metadata": {"labels": {stale: "true"}}})),
        )
        .await
        .expect("label the node");

    let plugins = dir.path().join("kubelet/device-plugins");
    std::fs::create_dir_all(&plugins).expect("mkdir");
    let stop = CancellationToken::new();
    let mut registered = common::fake_kubelet(&plugins, stop.clone());

    // The certificate Secret is optional and may come after the pod: the handler starts without.
    let mut h = common::HandlerProcess::spawn_before_certificates(
        "node-a",
        kubeconfig,
        dir.path(),
        &dir.path().join("pods"),
        &["--max-devices", "2"],
    );
    let port = h.port;

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

    // The node labeller asked this machine's QEMU (`nodelabeller::probe`) and labelled the node.
    let deadline = tokio::time::Instant::now() + WAIT;
    let labels = loop {
        let labels = nodes.get("node-a").await.expect("get node").metadata.labels;
        let labels = labels.unwrap_or_default();
        let has_host_model = labels
            .keys()
            .any(|k| k.starts_with("host-model-cpu.node.kubevirt.io/"));
        if has_host_model && !labels.contains_key(stale) {
            break labels;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not labelled: {labels:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        labels["cpu-feature.node.kubevirt.io/sse2"], "true",
        "{labels:?}"
    );
    // Usable, but obsolete in KubeVirt's default list.
    assert!(
        !labels.contains_key("cpu-model.node.kubevirt.io/qemu64"),
        "{labels:?}"
    );

    // Without its certificate the handler serves no metrics at all, in particular not in clear.
    assert_eq!(common::http_get(port, "/healthz").await.0, 0);
    h.write_certificates();
    h.wait_healthy(WAIT).await;
    let (status, metrics) = h.get("/metrics").await;
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains("# TYPE kubevirt_vmi_phase_count gauge\n"),
        "{metrics}"
    );
    // The same port refuses plain HTTP: the request is no TLS handshake, nothing answers it.
    for path in ["/healthz", "/metrics"] {
        assert_eq!(
            common::http_get(port, path).await,
            (0, String::new()),
            "{path}"
        );
    }

    let pid = h.child.id().to_string();
    let status = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = std::time::Instant::now() + WAIT;
    let exit = loop {
        if let Some(s) = h.child.try_wait().expect("wait") {
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
