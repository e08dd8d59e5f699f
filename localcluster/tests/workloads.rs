//! Deployment, ReplicaSet and DaemonSet controllers, seen from the API.

mod common;

use common::{Cluster, eventually};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt as _};
use serde_json::json;

async fn active_pods(pods: &Api<Pod>, selector: &str) -> Vec<Pod> {
    pods.list(&ListParams::default().labels(selector))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// What a kubelet would do for these pods: report each Running and Ready.
async fn mark_pods_ready(pods: Api<Pod>) {
    loop {
        for p in pods.list(&ListParams::default()).await.unwrap().items {
            if !is_ready(&p) && p.metadata.deletion_timestamp.is_none() {
                let _ = pods
                    .patch_status(
                        &p.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"status": {"phase": "Running",
                            "conditions": [{"type": "Ready", "status": "True"}]}})),
                    )
                    .await;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn deployments_roll_replicasets_and_pods() {
    let c = Cluster::start().await;
    let deployments = c.api::<Deployment>();
    let sets = c.api::<ReplicaSet>();
    let pods = c.api::<Pod>();
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "c", "image": "img:1"}]}}}
    }))
    .unwrap();
    deployments
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let first = eventually(60, "three pods", || {
        let pods = pods.clone();
        async move {
            let ps = active_pods(&pods, "app=web").await;
            (ps.len() == 3).then_some(ps)
        }
    })
    .await;
    let owner = &first[0].owner_references()[0];
    assert_eq!(owner.kind, "ReplicaSet");
    let rs = sets.get(&owner.name).await.unwrap();
    assert_eq!(rs.owner_references()[0].name, "web");
    let hash = rs.labels()["pod-template-hash"].clone();
    assert!(
        first
            .iter()
            .all(|p| p.labels()["pod-template-hash"] == hash)
    );

    // Ready pods show up in the ReplicaSet's and the Deployment's status. A stand-in kubelet
    // marks every pod Ready from now on.
    let kubelet = tokio::spawn(mark_pods_ready(pods.clone()));
    eventually(60, "the deployment to be available", || {
        let deployments = deployments.clone();
        async move {
            let s = deployments.get("web").await.unwrap().status?;
            (s.available_replicas == Some(3) && s.observed_generation == Some(1)).then_some(())
        }
    })
    .await;

    // Scale down.
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await
        .unwrap();
    eventually(60, "one pod", || {
        let pods = pods.clone();
        async move { (active_pods(&pods, "app=web").await.len() == 1).then_some(()) }
    })
    .await;

    // A new template makes a new ReplicaSet; the old one goes to zero once the new pod is
    // available (the default 25% surge rounds up to one pod, 25% unavailable down to none).
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "img:2"}]}}}})),
        )
        .await
        .unwrap();
    let new_hash = eventually(60, "pods of the new template", || {
        let pods = pods.clone();
        let hash = hash.clone();
        async move {
            let ps = active_pods(&pods, "app=web").await;
            (ps.len() == 1 && ps[0].labels()["pod-template-hash"] != hash)
                .then(|| ps[0].labels()["pod-template-hash"].clone())
        }
    })
    .await;
    let old = sets.get(&rs.name_any()).await.unwrap();
    assert_eq!(old.spec.replicas, Some(0));
    assert!(sets.get(&format!("web-{new_hash}")).await.is_ok());

    // A rolling update of four pods with maxSurge 1 and maxUnavailable 0: never more than
    // five pods, never fewer than four ready, until all four run the new template.
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"replicas": 4, "strategy": {"type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}}}),
            ),
        )
        .await
        .unwrap();
    eventually(60, "four available pods", || {
        let deployments = deployments.clone();
        async move {
            let s = deployments.get("web").await.unwrap().status?;
            (s.available_replicas == Some(4) && s.replicas == Some(4)).then_some(())
        }
    })
    .await;
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "img:3"}]}}}})),
        )
        .await
        .unwrap();
    let (mut most, mut fewest_ready) = (0, usize::MAX);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let ps = active_pods(&pods, "app=web").await;
        let ready = ps.iter().filter(|p| is_ready(p)).count();
        most = most.max(ps.len());
        fewest_ready = fewest_ready.min(ready);
        let hashes: std::collections::BTreeSet<&String> = ps
            .iter()
            .map(|p| &p.labels()["pod-template-hash"])
            .collect();
        if ps.len() == 4 && ready == 4 && hashes.len() == 1 && !hashes.contains(&new_hash) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the rolling update did not finish: {} pods, {ready} ready",
            ps.len()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(most <= 5, "maxSurge 1 allows five pods, saw {most}");
    assert!(
        fewest_ready >= 4,
        "maxUnavailable 0 keeps four ready, saw {fewest_ready}"
    );
    kubelet.abort();

    // Deleting the Deployment takes its ReplicaSets and pods along.
    deployments
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    eventually(60, "everything to go", || {
        let (sets, pods) = (sets.clone(), pods.clone());
        async move {
            let no_sets = sets
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .is_empty();
            let no_pods = pods
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .is_empty();
            (no_sets && no_pods).then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn daemonsets_put_one_pod_on_each_matching_node() {
    let c = Cluster::start().await;
    if !c.in_process() {
        return;
    }
    let nodes = Api::<Node>::all(c.client.clone());
    for (name, labels, taints) in [
        ("n1", json!({"role": "worker"}), json!([])),
        ("n2", json!({}), json!([])),
        (
            "n3",
            json!({"role": "worker"}),
            json!([{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]),
        ),
    ] {
        let node: Node = serde_json::from_value(
            json!({"metadata": {"name": name, "labels": labels}, "spec": {"taints": taints}}),
        )
        .unwrap();
        nodes.create(&PostParams::default(), &node).await.unwrap();
        nodes
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "allocatable": {"cpu": "4", "memory": "4Gi", "pods": "110"},
                    "conditions": [{"type": "Ready", "status": "True"}]}})),
            )
            .await
            .unwrap();
    }
    // DaemonSet pods are bound by the scheduler, as in kube-controller-manager since 1.12.
    let scheduler = tokio::spawn(localcluster::scheduler::run(
        c.client.clone(),
        localcluster::scheduler::DEFAULT_SCHEDULER.into(),
        std::time::Duration::from_secs(1),
    ));
    let daemonsets = c.api::<DaemonSet>();
    let pods = c.api::<Pod>();
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "agent"},
        "spec": {"selector": {"matchLabels": {"app": "agent"}},
            "template": {"metadata": {"labels": {"app": "agent"}},
                "spec": {"nodeSelector": {"role": "worker"}, "containers": [{"name": "c", "image": "agent:1"}]}}}
    }))
    .unwrap();
    daemonsets
        .create(&PostParams::default(), &ds)
        .await
        .unwrap();
    let on_nodes = |want: usize| {
        let pods = pods.clone();
        async move {
            let mut placed: Vec<String> = active_pods(&pods, "app=agent")
                .await
                .iter()
                .filter_map(|p| p.spec.as_ref()?.node_name.clone())
                .collect();
            placed.sort();
            (placed.len() == want).then_some(placed)
        }
    };
    assert_eq!(
        eventually(60, "a pod on n1", || on_nodes(1)).await,
        vec!["n1"]
    );
    nodes
        .patch(
            "n2",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"role": "worker"}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        eventually(60, "pods on both nodes", || on_nodes(2)).await,
        vec!["n1", "n2"]
    );
    eventually(60, "the daemonset status", || {
        let daemonsets = daemonsets.clone();
        async move {
            let s = daemonsets.get("agent").await.unwrap().status?;
            (s.desired_number_scheduled == 2 && s.current_number_scheduled == 2).then_some(())
        }
    })
    .await;
    let pod = &active_pods(&pods, "app=agent").await[0];
    let spec = pod.spec.as_ref().unwrap();
    assert!(
        spec.tolerations
            .iter()
            .flatten()
            .any(|t| t.key.as_deref() == Some("node.kubernetes.io/unschedulable")),
        "the DaemonSet controller's tolerations"
    );

    // Tolerating n3's taint puts a pod there too.
    daemonsets
        .patch(
            "agent",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"template": {"spec": {"tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoSchedule"}
            ]}}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        eventually(60, "pods on all three nodes", || on_nodes(3)).await,
        vec!["n1", "n2", "n3"]
    );
    scheduler.abort();
}
