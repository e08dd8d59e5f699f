//! The scheduler: binds pending pods to nodes, as a client of the API server.
//!
//! Filtering is a pure function of the pod, a node and what the pods already bound there
//! request ([`fits`]); [`schedule`] picks the fitting node with the most free cpu, or explains
//! why none fits the way kube-scheduler does ("0/2 nodes are available: 1 Insufficient cpu,
//! ..."). A pass decides every pending pod at once against watch caches, counting the pods it
//! bound before the caches show them (`decide`, pure). [`run`] is the thin shell: it keeps the
//! caches, binds through `pods/binding` (16 writes in flight) and marks unschedulable pods
//! with `PodScheduled=False` / `Unschedulable`, retrying them on every change and every few
//! seconds.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::{
    Binding, Node, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference, Pod, Taint,
};
use kube::api::{Patch, PatchParams};
use kube::runtime::{reflector, watcher};
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

fn add_requests(total: &mut BTreeMap<String, i128>, requests: &BTreeMap<String, i128>) {
    for (k, v) in requests {
        *total.entry(k.clone()).or_default() += v;
    }
}

/// The cpu kube-scheduler's scoring counts for a pod that requests none (100m), so pods
/// without requests still spread over the nodes.
const DEFAULT_SCORING_CPU: i128 = 100;

/// What the pods on a node take.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Their requests, for the filters.
    pub requests: BTreeMap<String, i128>,
    /// Their cpu for scoring, [`DEFAULT_SCORING_CPU`] for a pod that requests none.
    pub scoring_cpu: i128,
}

impl Usage {
    /// The usage of `pods` together.
    pub fn of<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> Self {
        let mut usage = Self::default();
        for p in pods {
            usage.add(&pod_requests(p));
        }
        usage
    }

    fn add(&mut self, requests: &BTreeMap<String, i128>) {
        add_requests(&mut self.requests, requests);
        self.scoring_cpu += requests
            .get("cpu")
            .copied()
            .filter(|c| *c > 0)
            .unwrap_or(DEFAULT_SCORING_CPU);
    }
}

/// The taint a node that is not Ready carries in a real cluster (the node lifecycle
/// controller's); here it is implied by the Ready condition, so only pods that tolerate it
/// (some DaemonSets') go to such a node.
fn not_ready_taint() -> Taint {
    Taint {
        key: "node.kubernetes.io/not-ready".into(),
        effect: "NoSchedule".into(),
        ..Taint::default()
    }
}

fn untolerated_taint<'a>(pod: &Pod, node: &'a Node) -> Option<&'a Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !tolerates(pod, t))
}

/// Whether a DaemonSet's pod (its template) should run on `node`, by the DaemonSet
/// controller's rules: its node selector and required node affinity match, and it tolerates
/// the node's `NoSchedule` / `NoExecute` taints. Resources and readiness are the scheduler's.
pub fn daemon_should_run(pod: &Pod, node: &Node) -> bool {
    matches_affinity(pod, node) && untolerated_taint(pod, node).is_none()
}

/// Every reason `node` cannot take `pod`, given what the pods already bound to it request
/// ([`Usage::requests`]); empty: it fits.
pub fn fits(pod: &Pod, node: &Node, used: &BTreeMap<String, i128>) -> Vec<Unfit> {
    let mut unfit = Vec::new();
    if !node_ready(node) && !tolerates(pod, &not_ready_taint()) {
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
    if let Some(taint) = untolerated_taint(pod, node) {
        let value = taint.value.as_deref().unwrap_or_default();
        unfit.push(Unfit::UntoleratedTaint(format!("{}: {value}", taint.key)));
    }
    if !matches_affinity(pod, node) {
        unfit.push(Unfit::AffinityMismatch);
    }
    let mut free = allocatable(node);
    for (k, v) in used {
        *free.entry(k.clone()).or_default() -= v;
    }
    for (resource, wanted) in pod_requests(pod) {
        if wanted > 0 && free.get(&resource).copied().unwrap_or(0) < wanted {
            unfit.push(Unfit::Insufficient(resource));
        }
    }
    unfit
}

/// Picks a node for `pod` among `nodes` (filters in kube-scheduler's order: readiness,
/// cordon, taints, affinity, resources), where `used` maps node names to what the pods bound
/// there take: the fitting node with the most free cpu by kube-scheduler's scoring (then the
/// first), or kube-scheduler's message.
pub fn schedule<'a, N, S>(
    pod: &Pod,
    nodes: &'a [N],
    used: &HashMap<String, Usage, S>,
) -> Result<&'a Node, String>
where
    N: std::borrow::Borrow<Node>,
    S: std::hash::BuildHasher,
{
    let none = Usage::default();
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut best: Option<(&Node, i128)> = None;
    for node in nodes {
        let node = node.borrow();
        let name = node.metadata.name.as_deref().unwrap_or_default();
        let on_node = used.get(name).unwrap_or(&none);
        let unfit = fits(pod, node, &on_node.requests);
        if unfit.is_empty() {
            let free_cpu = allocatable(node).get("cpu").copied().unwrap_or(0) - on_node.scoring_cpu;
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

fn key(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// What one pass decided for a pending pod.
enum Decision {
    Bind { pod: Arc<Pod>, node: String },
    Unschedulable { pod: Arc<Pod>, message: String },
}

/// Pods bound by this scheduler that the pod cache does not show bound yet (kube-scheduler's
/// "assumed" pods): counted on their node so the next pass neither binds them again nor gives
/// their resources away. Keyed by namespace and name, with the uid bound.
type Assumed = HashMap<(String, String), (String, String)>;

/// Decides every pending pod in one go against the caches: placements are made one after
/// another on the running totals, so a pass never overcommits a node. Pure, so the batching
/// rules are unit tested.
fn decide(
    pods: &[Arc<Pod>],
    nodes: &[Arc<Node>],
    assumed: &mut Assumed,
    scheduler_name: &str,
) -> Vec<Decision> {
    // Forget assumptions the cache has caught up with (bound there, or the pod is gone or
    // replaced by another with the same name).
    let live: HashMap<(String, String), &Pod> = pods.iter().map(|p| (key(p), &**p)).collect();
    assumed.retain(|k, (uid, _)| {
        live.get(k).is_some_and(|p| {
            p.metadata.uid.as_deref() == Some(uid.as_str()) && pending_for_us(p, scheduler_name)
        })
    });
    let mut used: HashMap<String, Usage> = HashMap::new();
    for p in pods {
        let on = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .filter(|n| !n.is_empty())
            .map(str::to_string)
            .or_else(|| assumed.get(&key(p)).map(|(_, n)| n.clone()));
        if let Some(n) = on
            && occupies_node(p)
        {
            used.entry(n).or_default().add(&pod_requests(p));
        }
    }
    let mut pending: Vec<&Arc<Pod>> = pods
        .iter()
        .filter(|p| pending_for_us(p, scheduler_name) && !assumed.contains_key(&key(p)))
        .collect();
    // Oldest first, as kube-scheduler's queue orders pods of equal priority.
    pending.sort_by(|a, b| {
        (&a.metadata.creation_timestamp, key(a)).cmp(&(&b.metadata.creation_timestamp, key(b)))
    });
    let mut out = Vec::new();
    for pod in pending {
        match schedule(pod, nodes, &used) {
            Ok(node) => {
                let node = node.metadata.name.clone().unwrap_or_default();
                used.entry(node.clone())
                    .or_default()
                    .add(&pod_requests(pod));
                assumed.insert(
                    key(pod),
                    (pod.metadata.uid.clone().unwrap_or_default(), node.clone()),
                );
                out.push(Decision::Bind {
                    pod: pod.clone(),
                    node,
                });
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
                if !already {
                    out.push(Decision::Unschedulable {
                        pod: pod.clone(),
                        message,
                    });
                }
            }
        }
    }
    out
}

async fn bind(client: &Client, pod: &Pod, node_name: &str) -> Result<(), kube::Error> {
    let (namespace, name) = key(pod);
    let binding = Binding {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            uid: pod.metadata.uid.clone(),
            ..Default::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node_name.to_string()),
            ..Default::default()
        },
    };
    let body = serde_json::to_vec(&binding).map_err(kube::Error::SerdeError)?;
    let request = http::Request::post(format!(
        "/api/v1/namespaces/{namespace}/pods/{name}/binding"
    ))
    .header(http::header::CONTENT_TYPE, "application/json")
    .body(body)
    .map_err(kube::Error::HttpError)?;
    client.request_text(request).await.map(|_| ())
}

async fn mark_unschedulable(client: &Client, pod: &Pod, message: &str) -> Result<(), kube::Error> {
    let (namespace, name) = key(pod);
    // A strategic merge patch merges conditions by type: other controllers' conditions stay.
    let patch = json!({"status": {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": message,
        "lastTransitionTime": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    }]}});
    Api::<Pod>::namespaced(client.clone(), &namespace)
        .patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch))
        .await
        .map(|_| ())
}

/// How many bindings and status writes one pass has in flight.
const WRITES_IN_FLIGHT: usize = 16;

/// Carries out one pass's decisions concurrently. A failed binding drops its assumption so the
/// next pass retries the pod.
async fn apply(client: &Client, decisions: Vec<Decision>, assumed: &mut Assumed) {
    let failed: Vec<(String, String)> = futures::stream::iter(decisions)
        .map(|d| async move {
            match d {
                Decision::Bind { pod, node } => match bind(client, &pod, &node).await {
                    Ok(()) => {
                        tracing::debug!(pod = ?key(&pod), %node, "bound");
                        None
                    }
                    Err(e) => {
                        tracing::warn!(pod = ?key(&pod), %node, error = %e, "binding");
                        Some(key(&pod))
                    }
                },
                Decision::Unschedulable { pod, message } => {
                    match mark_unschedulable(client, &pod, &message).await {
                        Ok(()) => tracing::info!(pod = ?key(&pod), %message, "unschedulable"),
                        Err(e) => {
                            tracing::warn!(pod = ?key(&pod), error = %e, "marking unschedulable");
                        }
                    }
                    None
                }
            }
        })
        .buffer_unordered(WRITES_IN_FLIGHT)
        .filter_map(std::future::ready)
        .collect()
        .await;
    for k in failed {
        assumed.remove(&k);
    }
}

/// Runs the scheduler until the task is dropped. Pods and nodes are cached by watches
/// (reflectors, as kube-scheduler's informers), so a pass reads memory, not the API; a pass
/// runs on changes (batched: everything that arrived while the previous pass ran) and at least
/// every `resync`, so unschedulable pods are retried.
pub async fn run(client: Client, scheduler_name: String, resync: Duration) {
    let (pod_store, pod_writer) = reflector::store::<Pod>();
    let (node_store, node_writer) = reflector::store::<Node>();
    let pods = reflector(
        pod_writer,
        watcher(Api::<Pod>::all(client.clone()), watcher::Config::default()),
    )
    .map(|_| ())
    .boxed();
    let nodes = reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default()),
    )
    .map(|_| ())
    .boxed();
    let mut changes = futures::stream::select(pods, nodes);
    let mut assumed = Assumed::new();
    // Something changed since the last pass began.
    let mut dirty = false;
    loop {
        if !dirty {
            tokio::select! {
                next = changes.next() => if next.is_none() { return },
                () = tokio::time::sleep(resync) => {}
            }
        }
        // Take in everything that piled up, then decide on one consistent view.
        while let Some(Some(())) = changes.next().now_or_never() {}
        dirty = false;
        if pod_store.wait_until_ready().now_or_never().is_none()
            || node_store.wait_until_ready().now_or_never().is_none()
        {
            continue;
        }
        let decisions = decide(
            &pod_store.state(),
            &node_store.state(),
            &mut assumed,
            &scheduler_name,
        );
        if decisions.is_empty() {
            continue;
        }
        // The caches keep filling while the writes are in flight; what arrives meanwhile makes
        // the next pass start at once.
        let writes = apply(&client, decisions, &mut assumed);
        tokio::pin!(writes);
        loop {
            tokio::select! {
                () = &mut writes => break,
                next = changes.next() => match next {
                    None => return,
                    Some(()) => dirty = true,
                },
            }
        }
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
            assert_eq!(fits(&p, &n, &BTreeMap::new()), want, "{what}");
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
        assert!(fits(&wants_kvm, &n, &BTreeMap::new()).is_empty());
        assert_eq!(
            fits(&wants_kvm, &n, &Usage::of([&wants_kvm]).requests),
            vec![Unfit::Insufficient("devices.kubevirt.io/kvm".into())]
        );
        let full = node("n", &json!({"status": {"allocatable": {"pods": "1"}}}));
        assert_eq!(
            fits(
                &pod(&json!({})),
                &full,
                &Usage::of([&pod(&json!({}))]).requests
            ),
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

    fn named(name: &str, v: &serde_json::Value) -> Arc<Pod> {
        let mut p = json!({"metadata": {"name": name, "uid": format!("uid-{name}"),
            "creationTimestamp": format!("2026-01-01T00:00:{:02}Z", name[1..].parse::<u32>().unwrap())}});
        json_patch::merge(&mut p, v);
        Arc::new(pod(&p))
    }

    fn binds(decisions: &[Decision]) -> Vec<(String, String)> {
        decisions
            .iter()
            .filter_map(|d| match d {
                Decision::Bind { pod, node } => Some((key(pod).1, node.clone())),
                Decision::Unschedulable { .. } => None,
            })
            .collect()
    }

    #[test]
    fn one_pass_places_many_pods_without_overcommitting() {
        let two_pods = json!({"status": {"allocatable": {"pods": "2"}}});
        let nodes = vec![
            Arc::new(node("a", &two_pods)),
            Arc::new(node("b", &two_pods)),
        ];
        let pods: Vec<Arc<Pod>> = (0..5)
            .map(|i| named(&format!("p{i}"), &json!({})))
            .collect();
        let mut assumed = Assumed::new();
        let decisions = decide(&pods, &nodes, &mut assumed, DEFAULT_SCHEDULER);
        let placed = binds(&decisions);
        assert_eq!(placed.len(), 4, "two per node: {placed:?}");
        assert_eq!(
            placed.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(),
            ["p0", "p1", "p2", "p3"],
            "oldest first"
        );
        let on = |n: &str| placed.iter().filter(|(_, on)| on == n).count();
        assert_eq!((on("a"), on("b")), (2, 2));
        assert_ne!(placed[0].1, placed[1].1, "pods without requests spread");
        assert!(
            matches!(&decisions[4], Decision::Unschedulable { pod, message }
                if key(pod).1 == "p4" && message == "0/2 nodes are available: 2 Insufficient pods."),
        );

        // The cache has not caught up: the assumed pods still hold their places and are not
        // bound again; the unschedulable pod is not marked a second time.
        let mut again = pods.clone();
        again[4] = named(
            "p4",
            &json!({"status": {"conditions": [{"type": "PodScheduled", "status": "False",
                "message": "0/2 nodes are available: 2 Insufficient pods."}]}}),
        );
        assert!(decide(&again, &nodes, &mut assumed, DEFAULT_SCHEDULER).is_empty());

        // p0 shows up bound and p1 is deleted: p1's assumption goes, freeing a place for p4.
        let on_a = placed.iter().find(|(p, _)| p == "p0").unwrap().1.clone();
        let caught_up = vec![
            named("p0", &json!({"spec": {"nodeName": on_a}})),
            pods[2].clone(),
            pods[3].clone(),
            again[4].clone(),
        ];
        let decisions = decide(&caught_up, &nodes, &mut assumed, DEFAULT_SCHEDULER);
        assert_eq!(binds(&decisions).len(), 1);
        assert_eq!(binds(&decisions)[0].0, "p4");
        assert!(!assumed.contains_key(&("default".into(), "p0".into())));
        assert!(!assumed.contains_key(&("default".into(), "p1".into())));
    }
}
