//! The scheduler: binds pending pods to nodes, as a client of the API server.
//!
//! Filtering is a pure function of the pod, a node and the pods already bound there
//! ([`fits`]); [`schedule`] picks the fitting node with the most free cpu, or explains why none
//! fits the way kube-scheduler does ("0/2 nodes are available: 1 Insufficient cpu, ...").
//! [`run`] is the thin shell: it watches pods and nodes, binds through `pods/binding`, and
//! marks unschedulable pods with `PodScheduled=False` / `Unschedulable`, retrying them on every
//! change and every few seconds.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures::{FutureExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::{
    Binding, Node, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference, Pod, Taint,
};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::json;

/// The scheduler name pods get when they name none.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// Parses a Kubernetes quantity into thousandths of its unit (`"100m"` -> 100, `"1Ki"` ->
/// 1_024_000). `None` when it is not a quantity.
pub fn parse_quantity(q: &str) -> Option<i128> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let (mantissa, exp10): (&str, i32) = if let Some(e) = suffix
        .strip_prefix('e')
        .or_else(|| suffix.strip_prefix('E'))
        .filter(|e| !e.is_empty())
    {
        (number, e.parse().ok()?)
    } else {
        let exp = match suffix {
            "" => 0,
            "n" => -9,
            "u" => -6,
            "m" => -3,
            "k" => 3,
            "M" => 6,
            "G" => 9,
            "T" => 12,
            "P" => 15,
            "E" => 18,
            binary => {
                let power = match binary {
                    "Ki" => 1,
                    "Mi" => 2,
                    "Gi" => 3,
                    "Ti" => 4,
                    "Pi" => 5,
                    "Ei" => 6,
                    _ => return None,
                };
                let base = scaled(number, 3)?;
                return base.checked_mul(1024_i128.checked_pow(power)?);
            }
        };
        (number, exp)
    };
    scaled(mantissa, exp10 + 3)
}

/// `number` times 10^`exp`, rounded up like Kubernetes rounds quantities.
fn scaled(number: &str, exp: i32) -> Option<i128> {
    let (negative, digits) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number.strip_prefix('+').unwrap_or(number)),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    if !int.chars().chain(frac.chars()).all(|c| c.is_ascii_digit()) {
        return None;
    }
    let all: String = format!("{int}{frac}");
    let mut value: i128 = if all.is_empty() { 0 } else { all.parse().ok()? };
    let mut exp = exp - i32::try_from(frac.len()).ok()?;
    while exp > 0 {
        value = value.checked_mul(10)?;
        exp -= 1;
    }
    while exp < 0 {
        let rest = value % 10;
        value /= 10;
        if rest != 0 {
            value += 1;
        }
        exp += 1;
    }
    Some(if negative { -value } else { value })
}

/// The effective requests of a pod, in thousandths: the larger of the sum over app containers
/// and the largest init container, per resource, plus one `pods`.
pub fn pod_requests(pod: &Pod) -> BTreeMap<String, i128> {
    let mut total: BTreeMap<String, i128> = BTreeMap::new();
    let Some(spec) = &pod.spec else {
        return total;
    };
    let requests = |c: &k8s_openapi::api::core::v1::Container| -> BTreeMap<String, i128> {
        let Some(res) = &c.resources else {
            return BTreeMap::new();
        };
        // Without requests, a container's limits are its requests (API defaulting).
        let map = res
            .requests
            .as_ref()
            .filter(|r| !r.is_empty())
            .or(res.limits.as_ref());
        map.into_iter()
            .flatten()
            .filter_map(|(k, v)| parse_quantity(&v.0).map(|q| (k.clone(), q)))
            .collect()
    };
    for c in &spec.containers {
        for (k, v) in requests(c) {
            *total.entry(k).or_default() += v;
        }
    }
    for c in spec.init_containers.iter().flatten() {
        for (k, v) in requests(c) {
            let e = total.entry(k).or_default();
            *e = (*e).max(v);
        }
    }
    *total.entry("pods".into()).or_default() += 1000;
    total
}

/// Why a node does not fit a pod; `Display` gives kube-scheduler's wording.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Unfit {
    NodeNotReady,
    Unschedulable,
    AffinityMismatch,
    UntoleratedTaint(String),
    Insufficient(String),
}

impl std::fmt::Display for Unfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NodeNotReady => f.write_str("node(s) were not ready"),
            Self::Unschedulable => f.write_str("node(s) were unschedulable"),
            Self::AffinityMismatch => {
                f.write_str("node(s) didn't match Pod's node affinity/selector")
            }
            Self::UntoleratedTaint(t) => write!(f, "node(s) had untolerated taint {{{t}}}"),
            Self::Insufficient(r) => write!(f, "Insufficient {r}"),
        }
    }
}

fn requirement_matches(req: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&req.key);
    let values = req.values.as_deref().unwrap_or_default();
    let as_int = |s: &str| s.parse::<i64>().ok();
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), Some(bound)) = (
                value.and_then(|v| as_int(v)),
                values.first().and_then(|b| as_int(b)),
            ) else {
                return false;
            };
            if req.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

fn term_matches(term: &NodeSelectorTerm, node: &Node) -> bool {
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let name = node.metadata.name.clone().unwrap_or_default();
    let fields = BTreeMap::from([("metadata.name".to_string(), name)]);
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let field_exprs = term.match_fields.as_deref().unwrap_or_default();
    // An empty term matches nothing, as in kube-scheduler.
    (!exprs.is_empty() || !field_exprs.is_empty())
        && exprs.iter().all(|r| requirement_matches(r, &labels))
        && field_exprs.iter().all(|r| requirement_matches(r, &fields))
}

fn matches_affinity(pod: &Pod, node: &Node) -> bool {
    let Some(spec) = &pod.spec else { return true };
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let selector_ok = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    let affinity_ok = required.is_none_or(|sel| {
        sel.node_selector_terms
            .iter()
            .any(|t| term_matches(t, node))
    });
    selector_ok && affinity_ok
}

fn tolerates(pod: &Pod, taint: &Taint) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.tolerations.as_ref())
        .into_iter()
        .flatten()
        .any(|t| {
            let effect_ok = t
                .effect
                .as_deref()
                .is_none_or(|e| e.is_empty() || e == taint.effect);
            let key_ok = match t.key.as_deref() {
                None | Some("") => t.operator.as_deref() == Some("Exists"),
                Some(k) => k == taint.key,
            };
            let value_ok = t.operator.as_deref() == Some("Exists")
                || t.value.as_deref().unwrap_or_default()
                    == taint.value.as_deref().unwrap_or_default();
            effect_ok && key_ok && value_ok
        })
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The node's allocatable resources in thousandths.
pub fn allocatable(node: &Node) -> BTreeMap<String, i128> {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| parse_quantity(&v.0).map(|q| (k.clone(), q)))
        .collect()
}

/// Every reason `node` cannot take `pod`, given the pods already bound to it (empty: it fits).
pub fn fits(pod: &Pod, node: &Node, bound: &[&Pod]) -> Vec<Unfit> {
    let mut unfit = Vec::new();
    if !node_ready(node) {
        unfit.push(Unfit::NodeNotReady);
    }
    if node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
    {
        unfit.push(Unfit::Unschedulable);
    }
    for taint in node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
    {
        if taint.effect != "NoSchedule" && taint.effect != "NoExecute" {
            continue;
        }
        if !tolerates(pod, taint) {
            let value = taint.value.as_deref().unwrap_or_default();
            unfit.push(Unfit::UntoleratedTaint(format!("{}: {value}", taint.key)));
            break;
        }
    }
    if !matches_affinity(pod, node) {
        unfit.push(Unfit::AffinityMismatch);
    }
    let mut free = allocatable(node);
    for other in bound {
        for (k, v) in pod_requests(other) {
            *free.entry(k).or_default() -= v;
        }
    }
    for (resource, wanted) in pod_requests(pod) {
        if wanted > 0 && free.get(&resource).copied().unwrap_or(0) < wanted {
            unfit.push(Unfit::Insufficient(resource));
        }
    }
    unfit
}

/// Picks a node for `pod` among `nodes` (filters in kube-scheduler's order: readiness,
/// cordon, taints, affinity, resources), where `bound` maps node names to the pods bound
/// there: the fitting node with the most free cpu (then name), or kube-scheduler's message.
pub fn schedule<'a, S: std::hash::BuildHasher>(
    pod: &Pod,
    nodes: &'a [Node],
    bound: &HashMap<String, Vec<&Pod>, S>,
) -> Result<&'a Node, String> {
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut best: Option<(&Node, i128)> = None;
    for node in nodes {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let on_node = bound.get(name).map(Vec::as_slice).unwrap_or_default();
        let unfit = fits(pod, node, on_node);
        if unfit.is_empty() {
            let used: i128 = on_node
                .iter()
                .map(|p| pod_requests(p).get("cpu").copied().unwrap_or(0))
                .sum();
            let free_cpu = allocatable(node).get("cpu").copied().unwrap_or(0) - used;
            if best.is_none_or(|(_, f)| free_cpu > f) {
                best = Some((node, free_cpu));
            }
        } else {
            // Like kube-scheduler, a node is counted under the first filter it fails.
            *reasons.entry(unfit[0].to_string()).or_default() += 1;
        }
    }
    if let Some((node, _)) = best {
        return Ok(node);
    }
    let detail: Vec<String> = reasons.iter().map(|(r, n)| format!("{n} {r}")).collect();
    let mut message = format!("0/{} nodes are available", nodes.len());
    if !detail.is_empty() {
        message.push_str(": ");
        message.push_str(&detail.join(", "));
    }
    message.push('.');
    Err(message)
}

fn pending_for_us(pod: &Pod, scheduler_name: &str) -> bool {
    let Some(spec) = &pod.spec else { return false };
    spec.node_name.as_deref().unwrap_or_default().is_empty()
        && spec.scheduler_name.as_deref().unwrap_or(DEFAULT_SCHEDULER) == scheduler_name
        && pod.metadata.deletion_timestamp.is_none()
        && !matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        )
}

fn occupies_node(pod: &Pod) -> bool {
    !matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Errors of one scheduling pass.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error("listing {what}")]
    List {
        what: &'static str,
        source: kube::Error,
    },
}

/// Schedules every pending pod once; binding failures are logged and retried on the next pass.
pub async fn pass(client: &Client, scheduler_name: &str) -> Result<(), SchedulerError> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| SchedulerError::List {
            what: "nodes",
            source,
        })?
        .items;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|source| SchedulerError::List {
            what: "pods",
            source,
        })?
        .items;
    let mut bound: HashMap<String, Vec<&Pod>> = HashMap::new();
    for p in &pods {
        if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.as_deref())
            && !n.is_empty()
            && occupies_node(p)
        {
            bound.entry(n.to_string()).or_default().push(p);
        }
    }
    let pending: Vec<&Pod> = pods
        .iter()
        .filter(|p| pending_for_us(p, scheduler_name))
        .collect();
    for pod in pending {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let api = Api::<Pod>::namespaced(client.clone(), &namespace);
        match schedule(pod, &nodes, &bound) {
            Ok(node) => {
                let node_name = node.metadata.name.clone().unwrap_or_default();
                let binding = Binding {
                    metadata: kube::api::ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(namespace.clone()),
                        ..Default::default()
                    },
                    target: ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Node".into()),
                        name: Some(node_name.clone()),
                        ..Default::default()
                    },
                };
                let body = serde_json::to_vec(&binding).unwrap_or_default();
                let request = http::Request::post(format!(
                    "/api/v1/namespaces/{namespace}/pods/{name}/binding"
                ))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body);
                let result = match request {
                    Ok(req) => client.request_text(req).await.map(|_| ()),
                    Err(e) => Err(kube::Error::HttpError(e)),
                };
                match result {
                    Ok(()) => {
                        tracing::info!(pod = %name, %namespace, node = %node_name, "bound");
                        bound.entry(node_name).or_default().push(pod);
                    }
                    Err(e) => tracing::warn!(pod = %name, %namespace, error = %e, "binding"),
                }
            }
            Err(message) => {
                let already = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| {
                        cs.iter().any(|c| {
                            c.type_ == "PodScheduled"
                                && c.status == "False"
                                && c.message.as_deref() == Some(message.as_str())
                        })
                    });
                if already {
                    continue;
                }
                let mut conditions: Vec<serde_json::Value> = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .into_iter()
                    .flatten()
                    .filter(|c| c.type_ != "PodScheduled")
                    .filter_map(|c| serde_json::to_value(c).ok())
                    .collect();
                conditions.push(json!({
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": message,
                    "lastTransitionTime": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                }));
                let patch = json!({"status": {"phase": "Pending", "conditions": conditions}});
                if let Err(e) = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    tracing::warn!(pod = %name, %namespace, error = %e, "marking unschedulable");
                } else {
                    tracing::info!(pod = %name, %namespace, %message, "unschedulable");
                }
            }
        }
    }
    Ok(())
}

/// Runs the scheduler until the task is dropped: a pass on every pod or node change, and at
/// least every `resync` so unschedulable pods are retried.
pub async fn run(client: Client, scheduler_name: String, resync: Duration) {
    let pods = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default())
        .map(|_| ())
        .boxed();
    let nodes = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .map(|_| ())
        .boxed();
    let mut changes = futures::stream::select(pods, nodes);
    loop {
        if let Err(e) = pass(&client, &scheduler_name).await {
            tracing::warn!(error = %e, "scheduling pass");
        }
        // Drain what piled up during the pass, then wait for the next change or the resync.
        tokio::select! {
            next = changes.next() => if next.is_none() { return },
            () = tokio::time::sleep(resync) => {}
        }
        while let Some(Some(())) = changes.next().now_or_never() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, v: &serde_json::Value) -> Node {
        let mut base = json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {
                "allocatable": {"cpu": "2", "memory": "4Gi", "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        });
        json_patch::merge(&mut base, v);
        serde_json::from_value(base).unwrap()
    }

    fn pod(v: &serde_json::Value) -> Pod {
        let mut base = json!({
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        });
        json_patch::merge(&mut base, v);
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn quantities() {
        let cases = [
            ("1", Some(1000)),
            ("100m", Some(100)),
            ("0.5", Some(500)),
            ("1Ki", Some(1_024_000)),
            ("2Gi", Some(2 * 1024 * 1024 * 1024 * 1000)),
            ("1M", Some(1_000_000_000)),
            ("1e3", Some(1_000_000)),
            ("1.5k", Some(1_500_000)),
            ("1n", Some(1)),
            ("", None),
            ("abc", None),
            ("1Xi", None),
        ];
        for (q, want) in cases {
            assert_eq!(parse_quantity(q), want, "{q}");
        }
    }

    #[test]
    fn requests_take_the_larger_of_init_and_app_containers() {
        let p = pod(&json!({"spec": {
            "containers": [
                {"name": "a", "image": "i", "resources": {"requests": {"cpu": "100m"}}},
                {"name": "b", "image": "i", "resources": {"limits": {"cpu": "200m", "devices.kubevirt.io/kvm": "1"}}},
            ],
            "initContainers": [{"name": "i", "image": "i", "resources": {"requests": {"cpu": "500m", "memory": "1Mi"}}}],
        }}));
        let r = pod_requests(&p);
        assert_eq!(r["cpu"], 500);
        assert_eq!(r["memory"], 1024 * 1024 * 1000);
        assert_eq!(r["devices.kubevirt.io/kvm"], 1000);
        assert_eq!(r["pods"], 1000);
    }

    #[test]
    fn filters() {
        let kvm_node = node(
            "n",
            &json!({"metadata": {"labels": {"zone": "a", "rank": "5"}},
                   "status": {"allocatable": {"devices.kubevirt.io/kvm": "1"}}}),
        );
        let cases: Vec<(&str, Pod, Node, Vec<Unfit>)> = vec![
            ("plain", pod(&json!({})), node("n", &json!({})), vec![]),
            (
                "nodeSelector match",
                pod(&json!({"spec": {"nodeSelector": {"zone": "a"}}})),
                kvm_node.clone(),
                vec![],
            ),
            (
                "nodeSelector mismatch",
                pod(&json!({"spec": {"nodeSelector": {"zone": "b"}}})),
                kvm_node.clone(),
                vec![Unfit::AffinityMismatch],
            ),
            (
                "affinity In/NotIn/Exists/DoesNotExist/Gt",
                pod(
                    &json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [
                        {"key": "zone", "operator": "In", "values": ["a", "b"]},
                        {"key": "zone", "operator": "NotIn", "values": ["c"]},
                        {"key": "rank", "operator": "Exists"},
                        {"key": "gpu", "operator": "DoesNotExist"},
                        {"key": "rank", "operator": "Gt", "values": ["4"]},
                    ]}]}}}}}),
                ),
                kvm_node.clone(),
                vec![],
            ),
            (
                "affinity: second term matches",
                pod(
                    &json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}]},
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]},
                    ]}}}}}),
                ),
                kvm_node.clone(),
                vec![],
            ),
            (
                "affinity: DoesNotExist fails",
                pod(
                    &json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}]}}}}}),
                ),
                kvm_node.clone(),
                vec![Unfit::AffinityMismatch],
            ),
            (
                "untolerated taint",
                pod(&json!({})),
                node(
                    "n",
                    &json!({"spec": {"taints": [{"key": "dedicated", "value": "vm", "effect": "NoSchedule"}]}}),
                ),
                vec![Unfit::UntoleratedTaint("dedicated: vm".into())],
            ),
            (
                "tolerated taint (Equal)",
                pod(
                    &json!({"spec": {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "vm", "effect": "NoSchedule"}]}}),
                ),
                node(
                    "n",
                    &json!({"spec": {"taints": [{"key": "dedicated", "value": "vm", "effect": "NoSchedule"}]}}),
                ),
                vec![],
            ),
            (
                "tolerate everything",
                pod(&json!({"spec": {"tolerations": [{"operator": "Exists"}]}})),
                node(
                    "n",
                    &json!({"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}),
                ),
                vec![],
            ),
            (
                "PreferNoSchedule is no filter",
                pod(&json!({})),
                node(
                    "n",
                    &json!({"spec": {"taints": [{"key": "x", "effect": "PreferNoSchedule"}]}}),
                ),
                vec![],
            ),
            (
                "too much cpu",
                pod(
                    &json!({"spec": {"containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": "3"}}}]}}),
                ),
                node("n", &json!({})),
                vec![Unfit::Insufficient("cpu".into())],
            ),
            (
                "extended resource present",
                pod(
                    &json!({"spec": {"containers": [{"name": "c", "image": "i", "resources": {"limits": {"devices.kubevirt.io/kvm": "1"}}}]}}),
                ),
                kvm_node.clone(),
                vec![],
            ),
            (
                "extended resource missing",
                pod(
                    &json!({"spec": {"containers": [{"name": "c", "image": "i", "resources": {"limits": {"devices.kubevirt.io/kvm": "1"}}}]}}),
                ),
                node("n", &json!({})),
                vec![Unfit::Insufficient("devices.kubevirt.io/kvm".into())],
            ),
            (
                "not ready and cordoned",
                pod(&json!({})),
                node(
                    "n",
                    &json!({"spec": {"unschedulable": true}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
                ),
                vec![Unfit::NodeNotReady, Unfit::Unschedulable],
            ),
        ];
        for (what, p, n, want) in cases {
            assert_eq!(fits(&p, &n, &[]), want, "{what}");
        }
    }

    #[test]
    fn bound_pods_use_up_resources() {
        let n = node(
            "n",
            &json!({"status": {"allocatable": {"devices.kubevirt.io/kvm": "1"}}}),
        );
        let wants_kvm = pod(
            &json!({"spec": {"containers": [{"name": "c", "image": "i", "resources": {"limits": {"devices.kubevirt.io/kvm": "1"}}}]}}),
        );
        assert!(fits(&wants_kvm, &n, &[]).is_empty());
        assert_eq!(
            fits(&wants_kvm, &n, &[&wants_kvm]),
            vec![Unfit::Insufficient("devices.kubevirt.io/kvm".into())]
        );
        let full = node("n", &json!({"status": {"allocatable": {"pods": "1"}}}));
        assert_eq!(
            fits(&pod(&json!({})), &full, &[&pod(&json!({}))]),
            vec![Unfit::Insufficient("pods".into())]
        );
    }

    #[test]
    fn schedule_picks_a_fitting_node_or_explains() {
        let nodes = vec![
            node("a", &json!({"metadata": {"labels": {"zone": "x"}}})),
            node(
                "b",
                &json!({"metadata": {"labels": {"zone": "y"}}, "status": {"allocatable": {"cpu": "4"}}}),
            ),
            node("c", &json!({"status": {"allocatable": {"cpu": "8"}}})),
        ];
        let none = HashMap::new();
        let any = pod(&json!({}));
        assert_eq!(
            schedule(&any, &nodes, &none)
                .unwrap()
                .metadata
                .name
                .as_deref(),
            Some("c"),
            "most free cpu"
        );
        let x = pod(&json!({"spec": {"nodeSelector": {"zone": "x"}}}));
        assert_eq!(
            schedule(&x, &nodes, &none)
                .unwrap()
                .metadata
                .name
                .as_deref(),
            Some("a")
        );
        let impossible = pod(
            &json!({"spec": {"nodeSelector": {"zone": "y"}, "containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": "5"}}}]}}),
        );
        assert_eq!(
            schedule(&impossible, &nodes, &none).unwrap_err(),
            "0/3 nodes are available: 1 Insufficient cpu, 2 node(s) didn't match Pod's node affinity/selector."
        );
    }

    #[test]
    fn only_our_pending_pods() {
        assert!(pending_for_us(&pod(&json!({})), DEFAULT_SCHEDULER));
        assert!(!pending_for_us(
            &pod(&json!({"spec": {"schedulerName": "other"}})),
            DEFAULT_SCHEDULER
        ));
        assert!(!pending_for_us(
            &pod(&json!({"spec": {"nodeName": "n"}})),
            DEFAULT_SCHEDULER
        ));
        assert!(!pending_for_us(
            &pod(&json!({"status": {"phase": "Failed"}})),
            DEFAULT_SCHEDULER
        ));
    }
}
