//! The heartbeat loop against localcluster's upstream control plane (kube-apiserver).

use std::time::Duration;

use handler::heartbeat::{self, ANNOTATION_HEARTBEAT, LABEL_SCHEDULABLE, NodePatcher};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::PostParams;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

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

    let (ready_tx, ready_rx) = tokio::sync::watch::channel(false);
    let stop = CancellationToken::new();
    // A long interval: every change below must come from readiness or stop, not the timer.
    let task = tokio::spawn(heartbeat::run(
        NodePatcher::new(client, "node-a"),
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
    label(&nodes, "true").await;

    // SIGTERM: the last word is unschedulable.
    stop.cancel();
    tokio::time::timeout(WAIT, task)
        .await
        .expect("the loop ends")
        .expect("no panic");
    label(&nodes, "false").await;
}
