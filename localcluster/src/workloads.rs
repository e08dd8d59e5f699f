//! Workload controllers, as clients of the API server like kube-controller-manager's: Deployment
//! (one ReplicaSet per pod template, older ones scaled to zero), ReplicaSet (pods to the replica
//! count) and DaemonSet (one pod per node its selector, affinity and tolerations allow, pinned
//! there by node affinity and bound by the scheduler, as kube-controller-manager does).
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
pub fn pod_for(template: &Value, owner: &Value, generate_name: &str) -> Value {
    let mut metadata = template["metadata"].clone();
    if !metadata.is_object() {
        metadata = json!({});
    }
    metadata["generateName"] = json!(generate_name);
    metadata["ownerReferences"] = json!([{
        "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"], "controller": true, "blockOwnerDeletion": true,
    }]);
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})
}

/// A DaemonSet's pod for `node`, as the DaemonSet controller makes it: left to the scheduler,
/// pinned by a required node affinity on the node's name (replacing the template's terms,
/// which the controller has already checked), with the tolerations it adds so the pod stays
/// through node trouble.
pub fn daemon_pod_for(template: &Value, owner: &Value, generate_name: &str, node: &str) -> Value {
    let mut pod = pod_for(template, owner, generate_name);
    pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] = json!({
        "nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}
        ]}]
    });
    let mut tolerations = pod["spec"]["tolerations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut added = vec![
        ("node.kubernetes.io/not-ready", "NoExecute"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
        ("node.kubernetes.io/disk-pressure", "NoSchedule"),
        ("node.kubernetes.io/memory-pressure", "NoSchedule"),
        ("node.kubernetes.io/pid-pressure", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "NoSchedule"),
    ];
    if pod["spec"]["hostNetwork"] == true {
        added.push(("node.kubernetes.io/network-unavailable", "NoSchedule"));
    }
    for (key, effect) in added {
        if !tolerations
            .iter()
            .any(|t| t["key"] == key && t["effect"] == effect)
        {
            tolerations.push(json!({"key": key, "operator": "Exists", "effect": effect}));
        }
    }
    pod["spec"]["tolerations"] = Value::Array(tolerations);
    pod
}

/// The node a DaemonSet pod is for: where it is bound, else the node its affinity pins.
fn daemon_pod_node(pod: &Value) -> Option<&str> {
    pod["spec"]["nodeName"]
        .as_str()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"]
                .as_array()?
                .iter()
                .flat_map(|t| t["matchFields"].as_array().into_iter().flatten())
                .find(|f| f["key"] == "metadata.name" && f["operator"] == "In")?["values"][0]
                .as_str()
        })
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

/// A Deployment's ReplicaSet as the rollout sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetCount {
    pub name: String,
    /// `spec.replicas`.
    pub replicas: i64,
    /// `status.replicas`: its pods that exist.
    pub pods: i64,
    /// `status.availableReplicas`.
    pub available: i64,
}

impl SetCount {
    fn of(rs: &Value) -> Self {
        Self {
            name: rs["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            replicas: rs["spec"]["replicas"].as_i64().unwrap_or(1),
            pods: rs["status"]["replicas"].as_i64().unwrap_or(0),
            available: if rs["status"]["observedGeneration"].as_i64()
                < rs["metadata"]["generation"].as_i64()
            {
                // Its status predates a scale-down: no more than the new count may be relied on.
                rs["status"]["availableReplicas"]
                    .as_i64()
                    .unwrap_or(0)
                    .min(rs["spec"]["replicas"].as_i64().unwrap_or(1))
            } else {
                rs["status"]["availableReplicas"].as_i64().unwrap_or(0)
            },
        }
    }
}

/// A Deployment's `spec.strategy`, resolved against its replica count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Recreate,
    RollingUpdate {
        max_surge: i64,
        max_unavailable: i64,
    },
}

/// An int-or-percent of `total`: percentages round up for surge, down for unavailable, as in
/// kube-controller-manager. `None` when it is neither.
fn int_or_percent(v: &Value, total: i64, default: &str, round_up: bool) -> Option<i64> {
    let v = if v.is_null() { &json!(default) } else { v };
    if let Some(n) = v.as_i64() {
        return Some(n.max(0));
    }
    let pct: i64 = v.as_str()?.strip_suffix('%')?.parse().ok()?;
    let scaled = total.checked_mul(pct)?;
    Some(if round_up {
        (scaled + 99).div_euclid(100)
    } else {
        scaled.div_euclid(100)
    })
}

/// The strategy of a Deployment `spec` wanting `want` pods (defaults: RollingUpdate, 25% /
/// 25%; when both resolve to zero, one pod may be unavailable, like kube-controller-manager).
pub fn strategy(spec: &Value, want: i64) -> Strategy {
    if spec["strategy"]["type"] == "Recreate" {
        return Strategy::Recreate;
    }
    let ru = &spec["strategy"]["rollingUpdate"];
    let max_surge = int_or_percent(&ru["maxSurge"], want, "25%", true).unwrap_or(0);
    let mut max_unavailable =
        int_or_percent(&ru["maxUnavailable"], want, "25%", false).unwrap_or(0);
    if max_surge == 0 && max_unavailable == 0 {
        max_unavailable = 1;
    }
    Strategy::RollingUpdate {
        max_surge,
        max_unavailable,
    }
}

/// One step of a rollout: the new ReplicaSet's replica count and the old ones' (oldest first,
/// only those that change), by kube-controller-manager's rules. Rolling: the new set grows
/// while all pods stay within `want + maxSurge`; old sets shrink, unavailable pods first,
/// while at least `want - maxUnavailable` stay available. Recreate: old sets go to zero, and
/// the new one grows only once their pods are gone.
pub fn rollout(
    want: i64,
    strategy: Strategy,
    new: &SetCount,
    old: &[SetCount],
) -> (i64, Vec<(String, i64)>) {
    let old_total: i64 = old.iter().map(|s| s.replicas).sum();
    let mut targets: Vec<(String, i64)> =
        old.iter().map(|s| (s.name.clone(), s.replicas)).collect();
    let new_replicas = match strategy {
        _ if old_total == 0 && old.iter().all(|s| s.pods == 0) => want,
        Strategy::Recreate => {
            for t in &mut targets {
                t.1 = 0;
            }
            new.replicas.min(want)
        }
        Strategy::RollingUpdate {
            max_surge,
            max_unavailable,
        } => {
            let mut new_replicas = new.replicas.min(want);
            let room = want + max_surge - (new.replicas + old_total);
            if room > 0 {
                new_replicas = (new.replicas + room).min(want);
            }
            let min_available = want - max_unavailable;
            let new_unavailable = new_replicas - new.available;
            let mut budget = new_replicas + old_total - min_available - new_unavailable;
            // Unavailable old pods go first: removing them costs no availability.
            for (t, s) in targets.iter_mut().zip(old) {
                let unhealthy = (s.replicas - s.available).max(0).min(budget.max(0));
                t.1 -= unhealthy;
                budget -= unhealthy;
            }
            let available: i64 = new.available + old.iter().map(|s| s.available).sum::<i64>();
            let mut room_down = (available - min_available).max(0);
            for t in &mut targets {
                let down = t.1.min(room_down);
                t.1 -= down;
                room_down -= down;
            }
            new_replicas
        }
    };
    let changed = targets
        .into_iter()
        .zip(old)
        .filter(|(t, s)| t.1 != s.replicas)
        .map(|(t, _)| t)
        .collect();
    (new_replicas, changed)
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
        let pod: Pod = serde_json::from_value(pod_for(template, owner, &prefix))?;
        pods_api.create(&PostParams::default(), &pod).await?;
    }
    for name in &delete {
        pods_api.delete(name, &DeleteParams::default()).await?;
    }
    // The status reports what is left: a deleted pod no longer counts as available (the
    // Deployment's rollout relies on it).
    Ok(pods
        .into_iter()
        .filter(|p| !delete.iter().any(|d| p["metadata"]["name"] == d.as_str()))
        .collect())
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
    let mut sets: Vec<Value> = Vec::new();
    for rs in sets_api.list(&ListParams::default()).await?.items {
        let rs = serde_json::to_value(&rs)?;
        if owned_by(&rs, &uid) && rs["metadata"]["deletionTimestamp"].is_null() {
            sets.push(rs);
        }
    }
    sets.sort_by(|a, b| {
        let created = |rs: &Value| {
            rs["metadata"]["creationTimestamp"]
                .as_str()
                .map(str::to_string)
        };
        created(a).cmp(&created(b))
    });
    let new_set = sets
        .iter()
        .find(|rs| rs["metadata"]["name"] == current.as_str())
        .map_or_else(
            || SetCount {
                name: current.clone(),
                replicas: 0,
                pods: 0,
                available: 0,
            },
            SetCount::of,
        );
    let old_sets: Vec<SetCount> = sets
        .iter()
        .filter(|rs| rs["metadata"]["name"] != current.as_str())
        .map(SetCount::of)
        .collect();
    let (new_replicas, old_targets) =
        rollout(want, strategy(&value["spec"], want), &new_set, &old_sets);
    let desired: ReplicaSet = serde_json::from_value(json!({
        "metadata": {
            "name": current,
            "labels": template["metadata"]["labels"],
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": d.name_any(),
                "uid": uid, "controller": true, "blockOwnerDeletion": true}],
        },
        "spec": {"replicas": new_replicas, "selector": selector, "template": template},
    }))?;
    let applied = sets_api
        .patch(
            &current,
            &PatchParams::apply("deployment-controller").force(),
            &Patch::Apply(&desired),
        )
        .await?;
    for (name, replicas) in old_targets {
        sets_api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": replicas}})),
            )
            .await?;
    }
    if !sets
        .iter()
        .any(|rs| rs["metadata"]["name"] == current.as_str())
    {
        sets.push(serde_json::to_value(&applied)?);
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
    let template_pod: Pod = serde_json::from_value(json!({"spec": template["spec"]}))?;
    let nodes = Api::<Node>::all((*client).clone())
        .list(&ListParams::default())
        .await?;
    let wanted: Vec<String> = nodes
        .items
        .iter()
        .filter(|n| crate::scheduler::daemon_should_run(&template_pod, n))
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    let pods = owned_pods(&client, &ns, &uid).await?;
    let mut by_node: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for p in pods.iter().filter(|p| is_active(p)) {
        by_node
            .entry(daemon_pod_node(p).unwrap_or_default().to_string())
            .or_default()
            .push(p);
    }
    let pods_api = Api::<Pod>::namespaced((*client).clone(), &ns);
    let prefix = format!("{}-", ds.name_any());
    for node in &wanted {
        if !by_node.contains_key(node) {
            let pod: Pod = serde_json::from_value(daemon_pod_for(template, &value, &prefix, node))?;
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
    // Scheduled: bound to the node (a pod the scheduler has not placed yet does not count).
    let bound_on = |n: &String| -> Vec<&Value> {
        by_node
            .get(n)
            .into_iter()
            .flatten()
            .copied()
            .filter(|p| p["spec"]["nodeName"].as_str() == Some(n.as_str()))
            .collect()
    };
    let scheduled =
        i64::try_from(wanted.iter().filter(|n| !bound_on(n).is_empty()).count()).unwrap_or(0);
    let ready = i64::try_from(
        wanted
            .iter()
            .filter(|n| bound_on(n).iter().any(|p| is_ready(p)))
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
        let p = daemon_pod_for(&template, &owner, "ds-", "n1");
        assert_eq!(p["metadata"]["generateName"], "ds-");
        assert_eq!(p["metadata"]["labels"]["app"], "x");
        assert_eq!(p["metadata"]["ownerReferences"][0]["controller"], true);
        assert!(p["spec"]["nodeName"].is_null(), "the scheduler binds it");
        assert_eq!(daemon_pod_node(&p), Some("n1"));
        let tolerations = p["spec"]["tolerations"].as_array().unwrap();
        assert_eq!(tolerations.len(), 6);
        assert!(
            tolerations.contains(&json!({"key": "node.kubernetes.io/unschedulable",
            "operator": "Exists", "effect": "NoSchedule"}))
        );
        let pod: Pod = serde_json::from_value(p).unwrap();
        let node = |name: &str| -> Node {
            serde_json::from_value(json!({"metadata": {"name": name}})).unwrap()
        };
        assert!(crate::scheduler::daemon_should_run(&pod, &node("n1")));
        assert!(!crate::scheduler::daemon_should_run(&pod, &node("n2")));
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

    fn set(name: &str, replicas: i64, available: i64) -> SetCount {
        SetCount {
            name: name.into(),
            replicas,
            pods: replicas,
            available,
        }
    }

    #[test]
    fn strategies_resolve_percentages_like_kube_controller_manager() {
        let rolling = |surge: i64, unavailable: i64| Strategy::RollingUpdate {
            max_surge: surge,
            max_unavailable: unavailable,
        };
        assert_eq!(strategy(&json!({}), 10), rolling(3, 2), "25% up, 25% down");
        assert_eq!(
            strategy(
                &json!({"strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": "0%"}}}),
                4
            ),
            rolling(0, 1),
            "never both zero"
        );
        assert_eq!(
            strategy(
                &json!({"strategy": {"rollingUpdate": {"maxSurge": "50%"}}}),
                3
            ),
            rolling(2, 0)
        );
        assert_eq!(
            strategy(&json!({"strategy": {"type": "Recreate"}}), 3),
            Strategy::Recreate
        );
    }

    #[test]
    fn rolling_updates_stay_within_surge_and_availability() {
        let s = Strategy::RollingUpdate {
            max_surge: 1,
            max_unavailable: 0,
        };
        // A fresh template: one surge pod, nothing removed until it is available.
        assert_eq!(
            rollout(4, s, &set("new", 0, 0), &[set("old", 4, 4)]),
            (1, vec![])
        );
        assert_eq!(
            rollout(4, s, &set("new", 1, 0), &[set("old", 4, 4)]),
            (1, vec![])
        );
        // It became available: one old pod goes, and the next surge pod comes after it.
        assert_eq!(
            rollout(4, s, &set("new", 1, 1), &[set("old", 4, 4)]),
            (1, vec![("old".into(), 3)])
        );
        assert_eq!(
            rollout(4, s, &set("new", 1, 1), &[set("old", 3, 3)]),
            (2, vec![])
        );
        // Unavailable old pods are removed first.
        assert_eq!(
            rollout(4, s, &set("new", 2, 2), &[set("a", 1, 0), set("b", 2, 2)]),
            (2, vec![("a".into(), 0)])
        );
        // Done: the new set has all pods.
        assert_eq!(
            rollout(4, s, &set("new", 4, 4), &[set("old", 0, 0)]),
            (4, vec![])
        );

        let quick = Strategy::RollingUpdate {
            max_surge: 0,
            max_unavailable: 2,
        };
        assert_eq!(
            rollout(4, quick, &set("new", 0, 0), &[set("old", 4, 4)]),
            (0, vec![("old".into(), 2)])
        );
        assert_eq!(
            rollout(4, quick, &set("new", 0, 0), &[set("old", 2, 2)]),
            (2, vec![])
        );
    }

    #[test]
    fn recreate_waits_for_the_old_pods_to_go() {
        let old = SetCount {
            pods: 2,
            ..set("old", 0, 0)
        };
        assert_eq!(
            rollout(
                3,
                Strategy::Recreate,
                &set("new", 0, 0),
                &[set("old", 3, 3)]
            ),
            (0, vec![("old".into(), 0)])
        );
        assert_eq!(
            rollout(
                3,
                Strategy::Recreate,
                &set("new", 0, 0),
                std::slice::from_ref(&old)
            ),
            (0, vec![])
        );
        assert_eq!(
            rollout(
                3,
                Strategy::Recreate,
                &set("new", 0, 0),
                &[SetCount { pods: 0, ..old }]
            ),
            (3, vec![])
        );
    }
}
