//! The scheduler against the in-process API server: binds through pods/binding to the node
//! that fits, and marks a pod no node fits as Unschedulable.

mod common;

use std::time::Duration;

use common::{Cluster, eventually};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;

async fn make_node(
    cluster: &Cluster,
    name: &str,
    labels: serde_json::Value,
    allocatable: serde_json::Value,
) {
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap(),
        )
        .await
        .expect("creating a node");
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {
                "allocatable": allocatable, "capacity": allocatable,
                "conditions": [{"type": "Ready", "status": "True"}],
            }})),
        )
        .await
        .expect("node status");
}

#[tokio::test]
async fn binds_to_the_fitting_node_and_reports_unschedulable() {
    let cluster = Cluster::start().await;
    let suffix = &cluster.namespace[8..];
    let (plain, kvm) = (format!("plain-{suffix}"), format!("kvm-{suffix}"));
    make_node(
        &cluster,
        &plain,
        json!({"suffix": suffix}),
        json!({"cpu": "8", "memory": "8Gi", "pods": "110"}),
    )
    .await;
    make_node(
        &cluster,
        &kvm,
        json!({"suffix": suffix}),
        json!({"cpu": "2", "memory": "8Gi", "pods": "110", "devices.kubevirt.io/kvm": "1"}),
    )
    .await;
    let scheduler = tokio::spawn(localcluster::scheduler::run(
        cluster.client.clone(),
        localcluster::scheduler::DEFAULT_SCHEDULER.into(),
        Duration::from_millis(500),
    ));

    let pods: Api<Pod> = cluster.api();
    let wants_kvm = |name: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"nodeSelector": {"suffix": suffix}, "containers": [{"name": "c", "image": "i",
                "resources": {"limits": {"devices.kubevirt.io/kvm": "1"}}}]},
        }))
        .unwrap()
    };
    pods.create(&PostParams::default(), &wants_kvm("vm-1"))
        .await
        .expect("creating a pod");
    let bound = eventually(60, "vm-1 bound", || async {
        let p = pods.get("vm-1").await.ok()?;
        p.spec?.node_name
    })
    .await;
    assert_eq!(bound, kvm, "only the kvm node has the device");
    let p = serde_json::to_value(pods.get("vm-1").await.unwrap()).unwrap();
    let scheduled = p["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "PodScheduled")
        .unwrap()
        .clone();
    assert_eq!(scheduled["status"], "True");

    // The one device is taken: a second such pod fits nowhere.
    pods.create(&PostParams::default(), &wants_kvm("vm-2"))
        .await
        .expect("creating a pod");
    let message = eventually(60, "vm-2 unschedulable", || async {
        let p = serde_json::to_value(pods.get("vm-2").await.ok()?).ok()?;
        let c = p["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "PodScheduled")?
            .clone();
        (c["status"] == "False" && c["reason"] == "Unschedulable")
            .then(|| c["message"].as_str().unwrap_or_default().to_string())
    })
    .await;
    assert!(
        message.contains("Insufficient devices.kubevirt.io/kvm"),
        "{message}"
    );
    assert!(message.starts_with("0/"), "{message}");
    assert!(
        pods.get("vm-2")
            .await
            .unwrap()
            .spec
            .unwrap()
            .node_name
            .is_none()
    );

    // Freeing the device lets the retry bind it.
    pods.delete(
        "vm-1",
        &kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await
    .expect("deleting vm-1");
    let bound = eventually(60, "vm-2 bound after the retry", || async {
        pods.get("vm-2").await.ok()?.spec?.node_name
    })
    .await;
    assert_eq!(bound, kvm);
    scheduler.abort();
}
