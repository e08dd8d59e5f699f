//! Helpers the integration test files share.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

/// Runs the real `kubectl` against `kubeconfig`; panics with its output when it fails.
/// Async, so that the test's own tasks (controllers, heartbeats) keep running meanwhile.
pub async fn kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let out = tokio::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .await
        .expect("running kubectl (is it on PATH?)");
    assert!(
        out.status.success(),
        "kubectl {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The kubelet's part of a Node for kube-controller-manager: a Ready condition and its Lease
/// in `kube-node-lease`, renewed every 10 s. Without them, the node-lifecycle controller marks
/// the Node Unknown about 50 s after it appears, taints it (the scheduler then leaves it
/// alone), marks its pods not ready and, 5 minutes later, evicts them. Renewal stops on drop.
pub struct NodeHeartbeat(tokio::task::JoinHandle<()>);

impl Drop for NodeHeartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Creates `node` (any status in it is replaced), reports it Ready with `resources` as its
/// capacity and allocatable (none when `Value::Null`), and keeps its Lease fresh.
pub async fn ready_node(
    client: &kube::Client,
    node: serde_json::Value,
    resources: serde_json::Value,
) -> NodeHeartbeat {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(node).unwrap();
    let name = nodes
        .create(&PostParams::default(), &node)
        .await
        .unwrap()
        .metadata
        .name
        .unwrap();
    let now = Time(Timestamp::now());
    let mut status = json!({"conditions": [{
        "type": "Ready", "status": "True", "reason": "KubeletReady",
        "message": "the test's stand-in kubelet is posting ready status",
        "lastHeartbeatTime": now, "lastTransitionTime": now,
    }]});
    if !resources.is_null() {
        status["capacity"] = resources.clone();
        status["allocatable"] = resources;
    }
    nodes
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .unwrap();
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": 40,
            "renewTime": MicroTime(Timestamp::now()),
        },
    }))
    .unwrap();
    leases.create(&PostParams::default(), &lease).await.unwrap();
    NodeHeartbeat(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            let renew = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
            if let Err(e) = leases
                .patch(&name, &PatchParams::default(), &Patch::Merge(renew))
                .await
            {
                tracing::warn!(node = %name, error = %e, "renewing the node's lease");
            }
        }
    }))
}
