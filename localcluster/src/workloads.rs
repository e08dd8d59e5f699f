//! Workload controllers, as clients of the API server like kube-controller-manager's: Deployment
//! (one ReplicaSet per pod template, older ones scaled to zero), ReplicaSet (pods to the replica
//! count) and DaemonSet (one pod per matching node, bound to it directly).
//!
//! The decisions are pure functions ([`template_hash`], [`pod_for`], [`replica_changes`],
//! [`deployment_status`]); the reconcilers around them only read and write through the API.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::{Controller, watcher};
use kube::{Api, Client, Resource, ResourceExt as _};
use serde_json::{Value, json};

/// Why a reconcile failed; it is retried.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("API request")]
    Kube(#[from] kube::Error),
    #[error("{0} has no namespace")]
    NoNamespace(String),
    #[error("encoding an object")]
    Json(#[from] serde_json::Error),
}

/// A stable 10-character hash of a pod template (`pod-template-hash`), FNV-1a over its JSON.
pub fn template_hash(template: &Value) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in template.to_string().bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (0..10)
        .map(|i| ALPHABET[usize::try_from((h >> (i * 6)) % 27).unwrap_or(0)] as char)
        .collect()
}

/// A pod from a template, owned (as controller) by `owner`.
pub fn pod_for(template: &Value, owner: &Value, generate_name: &str, node: Option<&str>) -> Value {
    let mut metadata = template["metadata"].clone();
    if !metadata.is_object() {
        metadata = json!({});
    }
    metadata["generateName"] = json!(generate_name);
    metadata["ownerReferences"] = json!([{
        "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"], "controller": true, "blockOwnerDeletion": true,
    }]);
    let mut spec = template["spec"].clone();
    if let Some(node) = node {
        spec["nodeName"] = json!(node);
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
}

fn is_ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

fn is_active(pod: &Value) -> bool {
    pod["metadata"]["deletionTimestamp"].is_null()
        && !matches!(
            pod["status"]["phase"].as_str(),
            Some("Succeeded" | "Failed")
        )
}

/// How many pods to create, and which to delete (unready and newest first), to reach `want`.
pub fn replica_changes(pods: &[Value], want: usize) -> (usize, Vec<String>) {
    let mut active: Vec<&Value> = pods.iter().filter(|p| is_active(p)).collect();
    if active.len() < want {
        return (want - active.len(), Vec::new());
    }
    active.sort_by_key(|p| {
        (
            is_ready(p),
            std::cmp::Reverse(
                p["metadata"]["creationTimestamp"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            ),
        )
    });
    let excess = active.len() - want;
    (
        0,
        active
            .iter()
            .take(excess)
            .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
            .collect(),
    )
}

/// A Deployment's status from its ReplicaSets (`current` is the one for its template).
pub fn deployment_status(generation: i64, want: i64, sets: &[Value], current: &str) -> Value {
    let sum = |field: &str, only_current: bool| -> i64 {
        sets.iter()
            .filter(|rs| !only_current || rs["metadata"]["name"] == current)
            .filter_map(|rs| rs["status"][field].as_i64())
            .sum()
    };
    let replicas = sum("replicas", false);
    let updated = sum("replicas", true);
    let ready = sum("readyReplicas", false);
    let available = sum("availableReplicas", false);
    let condition = |type_: &str, ok: bool, reason: &str| json!({"type": type_, "status": if ok { "True" } else { "False" }, "reason": reason});
    json!({
        "observedGeneration": generation,
        "replicas": replicas,
        "updatedReplicas": updated,
        "readyReplicas": ready,
        "availableReplicas": available,
        "unavailableReplicas": (want - available).max(0),
        "conditions": [
            condition("Available", available >= want, if available >= want { "MinimumReplicasAvailable" } else { "MinimumReplicasUnavailable" }),
            condition("Progressing", true, if updated == want && replicas == want { "NewReplicaSetAvailable" } else { "ReplicaSetUpdated" }),
        ],
    })
}

fn owned_by(obj: &Value, uid: &str) -> bool {
    obj["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| {
            refs.iter()
                .any(|r| r["uid"] == uid && r["controller"] == true)
        })
}

fn error_policy<K>(_: Arc<K>, error: &WorkloadError, _: Arc<Client>) -> Action {
    tracing::warn!(%error, "workload reconcile failed");
    Action::requeue(Duration::from_secs(1))
}

async fn owned_pods(client: &Client, ns: &str, uid: &str) -> Result<Vec<Value>, WorkloadError> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?;
    let all = pods
        .items
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(all.into_iter().filter(|p| owned_by(p, uid)).collect())
}

async fn sync_pods(
    client: &Client,
    ns: &str,
    owner: &Value,
    template: &Value,
    want: usize,
) -> Result<Vec<Value>, WorkloadError> {
    let uid = owner["metadata"]["uid"].as_str().unwrap_or_default();
    let pods_api = Api::<Pod>::namespaced(client.clone(), ns);
    let pods = owned_pods(client, ns, uid).await?;
    let (create, delete) = replica_changes(&pods, want);
    let prefix = format!(
        "{}-",
        owner["metadata"]["name"].as_str().unwrap_or_default()
    );
    for _ in 0..create {
        let pod: Pod = serde_json::from_value(pod_for(template, owner, &prefix, None))?;
        pods_api.create(&PostParams::default(), &pod).await?;
    }
    for name in delete {
        pods_api.delete(&name, &DeleteParams::default()).await?;
    }
    Ok(pods)
}

fn status_patch(status: &Value) -> Patch<Value> {
    Patch::Merge(json!({ "status": status }))
}

async fn reconcile_replicaset(
    rs: Arc<ReplicaSet>,
    client: Arc<Client>,
) -> Result<Action, WorkloadError> {
    let ns = rs
        .namespace()
        .ok_or_else(|| WorkloadError::NoNamespace(rs.name_any()))?;
    if rs.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let value = serde_json::to_value(rs.as_ref())?;
    let want = usize::try_from(rs.spec.replicas.unwrap_or(1)).unwrap_or(0);
    let template = &value["spec"]["template"];
    let pods = sync_pods(&client, &ns, &value, template, want).await?;
    let active: Vec<&Value> = pods.iter().filter(|p| is_active(p)).collect();
    let ready = i64::try_from(active.iter().filter(|p| is_ready(p)).count()).unwrap_or(0);
    let status = json!({
        "replicas": i64::try_from(active.len()).unwrap_or(0),
        "fullyLabeledReplicas": i64::try_from(active.len()).unwrap_or(0),
        "readyReplicas": ready,
        "availableReplicas": ready,
        "observedGeneration": rs.meta().generation,
    });
    Api::<ReplicaSet>::namespaced((*client).clone(), &ns)
        .patch_status(
            &rs.name_any(),
            &PatchParams::default(),
            &status_patch(&status),
        )
        .await?;
    Ok(Action::requeue(Duration::from_secs(30)))
}

async fn reconcile_deployment(
    d: Arc<Deployment>,
    client: Arc<Client>,
) -> Result<Action, WorkloadError> {
    let ns = d
        .namespace()
        .ok_or_else(|| WorkloadError::NoNamespace(d.name_any()))?;
    if d.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let value = serde_json::to_value(d.as_ref())?;
    let uid = value["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let want = value["spec"]["replicas"].as_i64().unwrap_or(1);
    let hash = template_hash(&value["spec"]["template"]);
    let current = format!("{}-{hash}", d.name_any());
    let sets_api = Api::<ReplicaSet>::namespaced((*client).clone(), &ns);
    let mut template = value["spec"]["template"].clone();
    template["metadata"]["labels"]["pod-template-hash"] = json!(hash);
    let mut selector = value["spec"]["selector"].clone();
    selector["matchLabels"]["pod-template-hash"] = json!(hash);
    let desired: ReplicaSet = serde_json::from_value(json!({
        "metadata": {
            "name": current,
            "labels": template["metadata"]["labels"],
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": d.name_any(),
                "uid": uid, "controller": true, "blockOwnerDeletion": true}],
        },
        "spec": {"replicas": want, "selector": selector, "template": template},
    }))?;
    sets_api
        .patch(
            &current,
            &PatchParams::apply("deployment-controller").force(),
            &Patch::Apply(&desired),
        )
        .await?;
    let mut sets = Vec::new();
    for rs in sets_api.list(&ListParams::default()).await?.items {
        let rs = serde_json::to_value(&rs)?;
        if !owned_by(&rs, &uid) {
            continue;
        }
        let name = rs["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if name != current && rs["spec"]["replicas"].as_i64() != Some(0) {
            sets_api
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": 0}})),
                )
                .await?;
        }
        sets.push(rs);
    }
    let status = deployment_status(
        value["metadata"]["generation"].as_i64().unwrap_or(1),
        want,
        &sets,
        &current,
    );
    Api::<Deployment>::namespaced((*client).clone(), &ns)
        .patch_status(
            &d.name_any(),
            &PatchParams::default(),
            &status_patch(&status),
        )
        .await?;
    Ok(Action::requeue(Duration::from_secs(30)))
}

fn node_selected(template: &Value, node: &Value) -> bool {
    template["spec"]["nodeSelector"]
        .as_object()
        .is_none_or(|sel| sel.iter().all(|(k, v)| node["metadata"]["labels"][k] == *v))
}

async fn reconcile_daemonset(
    ds: Arc<DaemonSet>,
    client: Arc<Client>,
) -> Result<Action, WorkloadError> {
    let ns = ds
        .namespace()
        .ok_or_else(|| WorkloadError::NoNamespace(ds.name_any()))?;
    if ds.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let value = serde_json::to_value(ds.as_ref())?;
    let uid = value["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let template = &value["spec"]["template"];
    let nodes = Api::<Node>::all((*client).clone())
        .list(&ListParams::default())
        .await?;
    let wanted: Vec<String> = nodes
        .items
        .iter()
        .filter_map(|n| serde_json::to_value(n).ok())
        .filter(|n| node_selected(template, n))
        .filter_map(|n| n["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    let pods = owned_pods(&client, &ns, &uid).await?;
    let mut by_node: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for p in pods.iter().filter(|p| is_active(p)) {
        by_node
            .entry(
                p["spec"]["nodeName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
            .or_default()
            .push(p);
    }
    let pods_api = Api::<Pod>::namespaced((*client).clone(), &ns);
    let prefix = format!("{}-", ds.name_any());
    for node in &wanted {
        if !by_node.contains_key(node) {
            let pod: Pod = serde_json::from_value(pod_for(template, &value, &prefix, Some(node)))?;
            pods_api.create(&PostParams::default(), &pod).await?;
        }
    }
    for (node, pods) in &by_node {
        let keep = usize::from(wanted.contains(node));
        for p in pods.iter().skip(keep) {
            if let Some(name) = p["metadata"]["name"].as_str() {
                pods_api.delete(name, &DeleteParams::default()).await?;
            }
        }
    }
    let scheduled =
        i64::try_from(wanted.iter().filter(|n| by_node.contains_key(*n)).count()).unwrap_or(0);
    let ready = i64::try_from(
        wanted
            .iter()
            .filter(|n| {
                by_node
                    .get(*n)
                    .is_some_and(|ps| ps.iter().any(|p| is_ready(p)))
            })
            .count(),
    )
    .unwrap_or(0);
    let desired = i64::try_from(wanted.len()).unwrap_or(0);
    let status = json!({
        "desiredNumberScheduled": desired,
        "currentNumberScheduled": scheduled,
        "updatedNumberScheduled": scheduled,
        "numberReady": ready,
        "numberAvailable": ready,
        "numberUnavailable": desired - ready,
        "numberMisscheduled": 0,
        "observedGeneration": ds.meta().generation,
    });
    Api::<DaemonSet>::namespaced((*client).clone(), &ns)
        .patch_status(
            &ds.name_any(),
            &PatchParams::default(),
            &status_patch(&status),
        )
        .await?;
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// Runs the three controllers until the client's server goes away.
pub async fn run(client: Client) {
    let cfg = watcher::Config::default;
    let shared = Arc::new(client.clone());
    let replicasets = Controller::new(Api::<ReplicaSet>::all(client.clone()), cfg())
        .owns(Api::<Pod>::all(client.clone()), cfg())
        .run(reconcile_replicaset, error_policy, shared.clone())
        .for_each(|_| async {});
    let deployments = Controller::new(Api::<Deployment>::all(client.clone()), cfg())
        .owns(Api::<ReplicaSet>::all(client.clone()), cfg())
        .run(reconcile_deployment, error_policy, shared.clone())
        .for_each(|_| async {});
    let daemonsets = Controller::new(Api::<DaemonSet>::all(client.clone()), cfg())
        .owns(Api::<Pod>::all(client.clone()), cfg())
        .reconcile_all_on(node_changes(client.clone()))
        .run(reconcile_daemonset, error_policy, shared)
        .for_each(|_| async {});
    tokio::join!(replicasets, deployments, daemonsets);
}

/// A tick for every node event, so DaemonSets are reconciled when nodes come and go.
fn node_changes(client: Client) -> impl futures::Stream<Item = ()> + Send {
    watcher::watcher(Api::<Node>::all(client), watcher::Config::default()).filter_map(
        |e| async move {
            matches!(
                e,
                Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone)
            )
            .then_some(())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, created: &str, ready: bool) -> Value {
        json!({"metadata": {"name": name, "creationTimestamp": created},
               "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
    }

    #[test]
    fn template_hashes_are_stable_and_distinct() {
        let a = json!({"spec": {"containers": [{"name": "c", "image": "a"}]}});
        let b = json!({"spec": {"containers": [{"name": "c", "image": "b"}]}});
        assert_eq!(template_hash(&a), template_hash(&a.clone()));
        assert_ne!(template_hash(&a), template_hash(&b));
        assert_eq!(template_hash(&a).len(), 10);
    }

    #[test]
    fn scaling_creates_or_deletes_unready_and_newest_first() {
        let pods = vec![
            pod("old-ready", "2024-01-01T00:00:00Z", true),
            pod("new-ready", "2024-01-02T00:00:00Z", true),
            pod("unready", "2024-01-01T00:00:00Z", false),
        ];
        assert_eq!(replica_changes(&pods, 5), (2, vec![]));
        assert_eq!(
            replica_changes(&pods, 1),
            (0, vec!["unready".to_string(), "new-ready".to_string()])
        );
        assert_eq!(replica_changes(&pods, 3), (0, vec![]));
    }

    #[test]
    fn pods_carry_their_owner_and_node() {
        let owner = json!({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "ds", "uid": "u"}});
        let template =
            json!({"metadata": {"labels": {"app": "x"}}, "spec": {"containers": [{"name": "c"}]}});
        let p = pod_for(&template, &owner, "ds-", Some("n1"));
        assert_eq!(p["metadata"]["generateName"], "ds-");
        assert_eq!(p["metadata"]["labels"]["app"], "x");
        assert_eq!(p["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(p["spec"]["nodeName"], "n1");
    }

    #[test]
    fn deployment_status_sums_replicasets() {
        let sets = vec![
            json!({"metadata": {"name": "d-new"}, "status": {"replicas": 2, "readyReplicas": 2, "availableReplicas": 2}}),
            json!({"metadata": {"name": "d-old"}, "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}}),
        ];
        let s = deployment_status(3, 2, &sets, "d-new");
        assert_eq!(s["replicas"], 3);
        assert_eq!(s["updatedReplicas"], 2);
        assert_eq!(s["conditions"][0]["status"], "True");
        assert_eq!(s["conditions"][1]["reason"], "ReplicaSetUpdated");
    }
}
