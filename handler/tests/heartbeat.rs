//! The heartbeat loop against localcluster's upstream control plane (kube-apiserver).

use std::time::Duration;

use handler::heartbeat::{self, ANNOTATION_HEARTBEAT, LABEL_SCHEDULABLE, NodePatcher};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::PostParams;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

/// Waits until the node's schedulable label is `want`, and returns the node.
async fn label(nodes: &Api<Node>, want: &str) -> Node {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let n = nodes.get("node-a").await.expect("get node");
        let got = n
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SCHEDULABLE))
            .cloned();
        if got.as_deref() == Some(want) {
            return n;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{LABEL_SCHEDULABLE} is {got:?}, wanted {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The node's schedulable label follows readiness, and its CPU manager labels say what the
/// kubelet's `cpu_manager_state` says once the KubeVirt CR enables the CPUManager gate.
#[tokio::test]
async fn heartbeat_follows_readiness_and_ends_unschedulable() {
    let plane = localcluster::controlplane::TestControlPlane::start(false).await;
    let client = plane.client().await;
    let nodes: Api<Node> = Api::all(client.clone());
    let mut node = Node::default();
    node.metadata.name = Some("node-a".into());
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
    localcluster::controlplane::install_crds(&client).await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(serde_json::json!({"metadata": {"name": "kubevirt"}}))
        .expect("namespace");
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
    let kv: api::KubeVirt = serde_json::from_value(serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"configuration": {"developerConfiguration": {"featureGates": ["CPUManager"]}}},
    }))
    .expect("KubeVirt CR");
    Api::<api::KubeVirt>::namespaced(client.clone(), "kubevirt")
        .create(&PostParams::default(), &kv)
        .await
        .expect("create KubeVirt");
    let kubelet_root = tempfile::tempdir().expect("kubelet root");
    std::fs::write(
        kubelet_root.path().join(heartbeat::CPU_MANAGER_STATE),
        r#"{"policyName":"static","defaultCpuSet":"0","entries":{},"checksum":0}"#,
    )
    .expect("cpu_manager_state");

    let (ready_tx, ready_rx) = tokio::sync::watch::channel(false);
    let stop = CancellationToken::new();
    // A long interval: every change below must come from readiness or stop, not the timer.
    let task = tokio::spawn(heartbeat::run(
        NodePatcher::new(client, "node-a", kubelet_root.path()),
        ready_rx,
        Duration::from_hours(1),
        stop.clone(),
    ));

    let n = label(&nodes, "false").await;
    let stamp = n
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_HEARTBEAT))
        .cloned()
        .expect("heartbeat annotation");
    assert!(
        stamp.parse::<jiff::Timestamp>().is_ok(),
        "{stamp} is RFC 3339"
    );

    ready_tx.send(true).expect("send");
    let n = label(&nodes, "true").await;
    let labels = n.metadata.labels.unwrap_or_default();
    for key in [
        heartbeat::LABEL_CPU_MANAGER,
        heartbeat::LABEL_CPU_MANAGER_DEPRECATED,
    ] {
        assert_eq!(labels.get(key).map(String::as_str), Some("true"), "{key}");
    }

    // SIGTERM: the last word is unschedulable.
    stop.cancel();
    tokio::time::timeout(WAIT, task)
        .await
        .expect("the loop ends")
        .expect("no panic");
    label(&nodes, "false").await;
}
