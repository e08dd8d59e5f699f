//! What to do next to bring the cluster to an install strategy, as a pure function of what
//! should exist and what the operator's caches hold (KubeVirt's `apply.Reconciler.Sync`).
//!
//! Everything but the workloads is created or put back at once. The workloads roll in
//! KubeVirt's order: a first install starts virt-api and waits for it (so validation runs
//! before any controller acts), then virt-controller and virt-handler; an update rolls
//! virt-handler and virt-controller, waits for virt-controller, then rolls virt-api. Objects
//! the strategy no longer has are deleted once every workload runs the new one.
//!
//! Uninstalling deletes the webhooks, APIServices and CRDs first and waits until they are
//! gone (a CRD goes once its objects have, which needs virt-controller and virt-handler to
//! still run and release their finalizers), then everything else.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::owned::ObjectRef;

/// The owned objects the caches hold, by identity.
pub type Live = BTreeMap<ObjectRef, Value>;

/// One write.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// The object does not exist.
    Create(Value),
    /// The object exists but differs from what the strategy says (a user's edit, or a new
    /// strategy): a JSON merge patch of the whole desired object puts it back.
    Patch(Value),
    /// The object is not (or no longer) part of the install.
    Delete(ObjectRef),
}

impl Action {
    pub fn target(&self) -> ObjectRef {
        match self {
            Action::Create(o) | Action::Patch(o) => ObjectRef::of(o),
            Action::Delete(r) => r.clone(),
        }
    }
}

/// The next writes, and whether the install is complete.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Plan {
    pub actions: Vec<Action>,
    /// What the install waits for before its next step (a rollout, a deletion), if anything.
    pub waiting: Option<String>,
}

impl Plan {
    /// Nothing to write and nothing to wait for.
    pub fn complete(&self) -> bool {
        self.actions.is_empty() && self.waiting.is_none()
    }
}

/// Whether `live` holds everything `desired` sets: each key of an object, each element of a
/// list (same length, same order), each scalar equal. The API server leaves out empty and
/// zero values, so an empty map or list, `null`, `false`, `0` or `""` in `desired` is held by
/// their absence too. What `live` has beyond `desired` (defaults, status, others' labels) does
/// not matter.
pub fn holds(live: Option<&Value>, desired: &Value) -> bool {
    match (live, desired) {
        (None | Some(Value::Null), d) => is_empty(d),
        (Some(Value::Object(l)), Value::Object(d)) => {
            d.iter().all(|(k, dv)| holds(l.get(k.as_str()), dv))
        }
        (Some(Value::Array(l)), Value::Array(d)) => {
            l.len() == d.len() && l.iter().zip(d).all(|(lv, dv)| holds(Some(lv), dv))
        }
        (Some(Value::Number(l)), Value::Number(d)) => l.as_f64() == d.as_f64(),
        (Some(l), d) => l == d || (is_empty(l) && is_empty(d)),
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_empty),
    }
}

fn int(o: &Value, pointer: &str) -> i64 {
    o.pointer(pointer).and_then(Value::as_i64).unwrap_or(0)
}

fn identifier(o: &Value) -> &str {
    o.pointer("/metadata/annotations")
        .and_then(|a| a.get(api::labels::INSTALL_STRATEGY_IDENTIFIER))
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// Whether a live Deployment or DaemonSet runs `desired`'s strategy everywhere: it carries
/// the strategy's identifier, its controller has seen its latest spec, and every replica (or
/// every node's pod) is updated and available.
pub fn rolled_over(live: &Value, desired: &Value) -> bool {
    if identifier(live) != identifier(desired)
        || int(live, "/status/observedGeneration") < int(live, "/metadata/generation")
    {
        return false;
    }
    match live["kind"].as_str() {
        Some("Deployment") => {
            let want = live
                .pointer("/spec/replicas")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            int(live, "/status/updatedReplicas") == want
                && int(live, "/status/availableReplicas") >= want
                && int(live, "/status/replicas") == want
        }
        Some("DaemonSet") => {
            let want = int(live, "/status/desiredNumberScheduled");
            want > 0
                && int(live, "/status/updatedNumberScheduled") == want
                && int(live, "/status/numberAvailable") == want
        }
        _ => true,
    }
}

fn is_workload(o: &Value) -> bool {
    matches!(o["kind"].as_str(), Some("Deployment" | "DaemonSet"))
}

fn write(desired: &Value, live: &Live) -> Option<Action> {
    match live.get(&ObjectRef::of(desired)) {
        None => Some(Action::Create(desired.clone())),
        Some(l) if !holds(Some(l), desired) => Some(Action::Patch(desired.clone())),
        Some(_) => None,
    }
}

/// The next step towards `desired` (the strategy's objects and the certificates) from `live`.
/// `updating`: an earlier install completed with another strategy, so the workloads roll in
/// the update order.
pub fn plan(desired: &[Value], live: &Live, updating: bool) -> Plan {
    let mut plan = Plan {
        actions: desired
            .iter()
            .filter(|o| !is_workload(o))
            .filter_map(|o| write(o, live))
            .collect(),
        waiting: None,
    };
    let workload = |name: &str| {
        desired
            .iter()
            .find(|o| is_workload(o) && o["metadata"]["name"] == name)
    };
    // Each stage's workloads are written together; the next stage waits until the names in
    // the stage's second list have rolled over.
    let stages: &[(&[&str], &[&str])] = if updating {
        &[
            (&["virt-handler", "virt-controller"], &["virt-controller"]),
            (&["virt-api"], &["virt-api", "virt-handler"]),
        ]
    } else {
        &[
            (&["virt-api"], &["virt-api"]),
            (
                &["virt-controller", "virt-handler"],
                &["virt-controller", "virt-handler"],
            ),
        ]
    };
    for (write_now, wait_for) in stages {
        plan.actions.extend(
            write_now
                .iter()
                .filter_map(|n| workload(n))
                .filter_map(|o| write(o, live)),
        );
        let pending: Vec<&str> = wait_for
            .iter()
            .copied()
            .filter(|n| {
                workload(n).is_some_and(|o| {
                    live.get(&ObjectRef::of(o))
                        .is_none_or(|l| !rolled_over(l, o))
                })
            })
            .collect();
        if !pending.is_empty() {
            plan.waiting = Some(format!("rollout of {}", pending.join(", ")));
            return plan;
        }
    }
    // Workloads the stages do not name (a customised strategy's) go with the last stage.
    plan.actions.extend(
        desired
            .iter()
            .filter(|o| is_workload(o))
            .filter(|o| {
                !matches!(
                    o["metadata"]["name"].as_str(),
                    Some("virt-api" | "virt-controller" | "virt-handler")
                )
            })
            .filter_map(|o| write(o, live)),
    );
    if plan.actions.is_empty() {
        let wanted: Vec<ObjectRef> = desired.iter().map(ObjectRef::of).collect();
        plan.actions.extend(
            live.keys()
                .filter(|r| !wanted.contains(r))
                .map(|r| Action::Delete(r.clone())),
        );
    }
    plan
}

/// Kinds that go first on uninstall: while they exist, deleting the rest would break the API
/// (webhooks and APIServices pointing at a gone virt-api) or strand objects' finalizers.
const FIRST_TO_GO: [&str; 4] = [
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "APIService",
    "CustomResourceDefinition",
];

/// The next step of an uninstall: deletes of what `live` still holds (objects already being
/// deleted are waited for, not deleted again), first webhooks, APIServices and CRDs, then the
/// rest. Complete when nothing is left.
pub fn plan_uninstall(live: &Live) -> Plan {
    let first = |r: &ObjectRef| FIRST_TO_GO.contains(&r.kind.as_str());
    let terminating = |o: &Value| o.pointer("/metadata/deletionTimestamp").is_some();
    let stage: Vec<(&ObjectRef, &Value)> = if live.keys().any(first) {
        live.iter().filter(|(r, _)| first(r)).collect()
    } else {
        live.iter().collect()
    };
    let mut plan = Plan::default();
    for (r, o) in &stage {
        if !terminating(o) {
            plan.actions.push(Action::Delete((*r).clone()));
        }
    }
    if !stage.is_empty() {
        let mut names: Vec<String> = stage.iter().map(|(r, _)| r.to_string()).collect();
        names.truncate(3);
        plan.waiting = Some(format!(
            "deletion of {} object(s): {}{}",
            stage.len(),
            names.join(", "),
            if stage.len() > 3 { ", ..." } else { "" }
        ));
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(kind: &str, name: &str, extra: &Value) -> Value {
        let mut o = json!({
            "kind": kind,
            "metadata": {"name": name, "namespace": "kubevirt",
                "annotations": {api::labels::INSTALL_STRATEGY_IDENTIFIER: "id1"}},
        });
        json_patch::merge(&mut o, extra);
        o
    }

    fn live_of(objects: &[Value]) -> Live {
        objects
            .iter()
            .map(|o| (ObjectRef::of(o), o.clone()))
            .collect()
    }

    fn deployment(name: &str) -> Value {
        obj(
            "Deployment",
            name,
            &json!({"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": name, "args": ["--a"]}]}}}}),
        )
    }

    fn ready(mut o: Value) -> Value {
        json_patch::merge(
            &mut o,
            &json!({"metadata": {"generation": 3}, "status": {"observedGeneration": 3,
                "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2,
                "desiredNumberScheduled": 1, "updatedNumberScheduled": 1, "numberAvailable": 1}}),
        );
        o
    }

    fn daemonset() -> Value {
        obj(
            "DaemonSet",
            "virt-handler",
            &json!({"spec": {"template": {"spec": {"containers": [{"name": "virt-handler", "args": ["--x"]}]}}}}),
        )
    }

    fn desired() -> Vec<Value> {
        vec![
            obj("ServiceAccount", "kubevirt-apiserver", &json!({})),
            deployment("virt-api"),
            deployment("virt-controller"),
            daemonset(),
        ]
    }

    fn names(plan: &Plan) -> Vec<String> {
        plan.actions
            .iter()
            .map(|a| match a {
                Action::Create(o) => format!("create {}", ObjectRef::of(o).name),
                Action::Patch(o) => format!("patch {}", ObjectRef::of(o).name),
                Action::Delete(r) => format!("delete {}", r.name),
            })
            .collect()
    }

    #[test]
    fn holds_ignores_defaults_and_empty_values_but_not_edits() {
        let desired = json!({"spec": {"args": ["--a", "1"], "labels": {}, "flag": false,
            "ports": [{"port": 443}]}});
        let live = json!({"spec": {"args": ["--a", "1"], "ports": [{"port": 443, "protocol": "TCP"}],
            "replicas": 2}, "status": {"x": 1}});
        assert!(holds(Some(&live), &desired));
        let mut edited = live.clone();
        edited["spec"]["args"] = json!(["--a", "2"]);
        assert!(!holds(Some(&edited), &desired));
        let mut extra = live.clone();
        extra["spec"]["args"] = json!(["--a", "1", "--b"]);
        assert!(
            !holds(Some(&extra), &desired),
            "an added list element is drift"
        );
        assert!(holds(Some(&json!({"n": 2.0})), &json!({"n": 2})));
        assert!(!holds(None, &json!({"a": 1})));
    }

    #[test]
    fn a_first_install_creates_everything_but_waits_for_virt_api_before_the_rest() {
        let d = desired();
        let p = plan(&d, &Live::new(), false);
        assert_eq!(
            names(&p),
            ["create kubevirt-apiserver", "create virt-api"],
            "virt-controller and virt-handler wait for virt-api"
        );
        assert_eq!(p.waiting.as_deref(), Some("rollout of virt-api"));

        let live = live_of(&[d[0].clone(), ready(d[1].clone())]);
        let p = plan(&d, &live, false);
        assert_eq!(names(&p), ["create virt-controller", "create virt-handler"]);

        let live = live_of(&[
            d[0].clone(),
            ready(d[1].clone()),
            ready(d[2].clone()),
            ready(d[3].clone()),
        ]);
        assert!(plan(&d, &live, false).complete());
    }

    #[test]
    fn an_edit_is_put_back_and_an_obsolete_object_deleted_once_rolled_over() {
        let d = desired();
        let mut edited = ready(d[3].clone());
        edited["spec"]["template"]["spec"]["containers"][0]["args"] = json!(["--evil"]);
        let stale = obj("ConfigMap", "old", &json!({}));
        let live = live_of(&[
            d[0].clone(),
            ready(d[1].clone()),
            ready(d[2].clone()),
            edited,
            stale.clone(),
        ]);
        let p = plan(&d, &live, false);
        assert_eq!(names(&p), ["patch virt-handler"]);
        assert!(
            p.waiting.is_none(),
            "the patched DaemonSet still reads as rolled over"
        );

        let live = live_of(&[
            d[0].clone(),
            ready(d[1].clone()),
            ready(d[2].clone()),
            ready(d[3].clone()),
            stale,
        ]);
        assert_eq!(names(&plan(&d, &live, false)), ["delete old"]);
    }

    #[test]
    fn an_update_rolls_handler_and_controller_before_virt_api() {
        let old = desired();
        let new: Vec<Value> = old
            .iter()
            .map(|o| {
                let mut o = o.clone();
                o["metadata"]["annotations"][api::labels::INSTALL_STRATEGY_IDENTIFIER] =
                    json!("id2");
                o
            })
            .collect();
        let live = live_of(&[
            new[0].clone(),
            ready(old[1].clone()),
            ready(old[2].clone()),
            ready(old[3].clone()),
        ]);
        let p = plan(&new, &live, true);
        assert_eq!(names(&p), ["patch virt-handler", "patch virt-controller"]);
        assert_eq!(p.waiting.as_deref(), Some("rollout of virt-controller"));

        let live = live_of(&[
            new[0].clone(),
            ready(old[1].clone()),
            ready(new[2].clone()),
            ready(new[3].clone()),
        ]);
        let p = plan(&new, &live, true);
        assert_eq!(names(&p), ["patch virt-api"]);
    }

    #[test]
    fn a_rollout_in_progress_is_not_rolled_over() {
        let d = deployment("virt-api");
        let mut l = ready(d.clone());
        assert!(rolled_over(&l, &d));
        l["status"]["updatedReplicas"] = json!(1);
        assert!(!rolled_over(&l, &d));
        let mut l = ready(d.clone());
        l["metadata"]["generation"] = json!(4);
        assert!(
            !rolled_over(&l, &d),
            "its controller has not seen the latest spec"
        );
        let mut ds = ready(daemonset());
        ds["status"]["desiredNumberScheduled"] = json!(0);
        assert!(!rolled_over(&ds, &daemonset()), "no node runs virt-handler");
    }

    #[test]
    fn uninstall_removes_webhooks_apiservices_and_crds_first() {
        let crd =
            json!({"kind": "CustomResourceDefinition", "metadata": {"name": "vms.kubevirt.io"}});
        let hook = json!({"kind": "ValidatingWebhookConfiguration", "metadata": {"name": "v"}});
        let d = desired();
        let live = live_of(&[crd.clone(), hook, d[0].clone(), d[1].clone()]);
        let p = plan_uninstall(&live);
        assert_eq!(names(&p), ["delete vms.kubevirt.io", "delete v"]);
        let mut terminating = crd;
        terminating["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        let p = plan_uninstall(&live_of(&[terminating, d[0].clone(), d[1].clone()]));
        assert!(p.actions.is_empty(), "a terminating CRD is waited for");
        assert!(
            p.waiting
                .as_deref()
                .is_some_and(|w| w.contains("vms.kubevirt.io"))
        );
        let p = plan_uninstall(&live_of(&[d[0].clone(), d[1].clone()]));
        assert_eq!(names(&p), ["delete virt-api", "delete kubevirt-apiserver"]);
        assert!(plan_uninstall(&Live::new()).complete());
    }
}
