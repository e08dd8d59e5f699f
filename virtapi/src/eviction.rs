//! The pod-eviction webhook, KubeVirt's `virt-launcher-eviction-interceptor.kubevirt.io`
//! (`pkg/virt-api/webhooks/validating-webhook/admitters/pod-eviction-admitter.go`): an eviction
//! of a virt-launcher pod (`kubectl drain`, the descheduler) whose VMI should move rather than
//! stop is refused, and the VMI is marked for evacuation (`status.evacuationNodeName`: the
//! pod's node), which virt-controller's evacuation controller turns into a migration.
//!
//! [`decide`] is the pure decision; [`admit`] reads the pod and its VMI, writes the mark and
//! answers. Every denial is 429 `TooManyRequests`, as KubeVirt's: `kubectl drain` retries those
//! every 5 s, so the drain goes on once the VMI has left and its pod completed or gone.
//!
//! Deliberate differences from KubeVirt:
//! - A pod or VMI that does not exist (anymore) is allowed: nothing is left to protect.
//!   KubeVirt allows a missing pod and denies a missing VMI.
//! - The mark is a JSON patch that first tests `status.nodeName` against the pod's node, so a
//!   VMI that moved in between is not marked for a node it left.

use std::collections::BTreeMap;

use api::status::VirtualMachineInstanceConditionType;
use api::vmi::EvictionStrategy;
use api::{VirtualMachineInstance, labels};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use crate::admission::{self, Context};

/// The Eviction annotation the descheduler sets, and its value.
pub const REQUESTED_BY_ANNOTATION: &str = "requested-by";
/// The descheduler's `requested-by` value.
pub const DESCHEDULER: &str = "sigs.k8s.io/descheduler";
/// The denial for a pod on another node than its VMI (a migration target).
pub const TARGET_POD_MESSAGE: &str = "Eviction request for target Pod";

/// What to do with an eviction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Let the pod be evicted.
    Allow,
    /// Refuse it (429) with this message.
    Deny(String),
    /// Mark the VMI for evacuation from this node, then refuse with [`triggered`].
    Mark {
        /// The pod's node: `status.evacuationNodeName`.
        node: String,
    },
}

/// The denial once the VMI is marked: `Eviction triggered evacuation of VMI "ns/name"`.
pub fn triggered(vmi: &VirtualMachineInstance) -> String {
    format!(
        "Eviction triggered evacuation of VMI \"{}/{}\"",
        vmi.metadata.namespace.as_deref().unwrap_or_default(),
        vmi.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The VMI a pod runs, if the eviction is this hook's business: a virt-launcher pod (label
/// `kubevirt.io=virt-launcher`) that has not completed, naming its VMI in `kubevirt.io/domain`.
pub fn launcher_vmi(pod: &Pod) -> Option<&str> {
    let is_launcher = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::APP))
        .is_some_and(|v| v == "virt-launcher");
    let completed = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    if !is_launcher || completed {
        return None;
    }
    pod.metadata
        .annotations
        .as_ref()?
        .get(labels::DOMAIN)
        .map(String::as_str)
}

/// `LiveMigratable=True`, as the VMI controller reports it.
pub fn is_migratable(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .as_ref()
        .and_then(|s| s.condition(&VirtualMachineInstanceConditionType::LiveMigratable))
        .is_some_and(|c| c.status == api::common::ConditionStatus::True)
}

/// The VMI's eviction strategy, else the cluster's (KubeVirt's `ResolveVMIEvictionStrategy`).
pub fn strategy<'a>(
    vmi: &'a VirtualMachineInstance,
    cluster: &'a EvictionStrategy,
) -> &'a EvictionStrategy {
    vmi.spec.eviction_strategy.as_ref().unwrap_or(cluster)
}

/// KubeVirt's decision for the eviction of `pod`, a launcher pod of `vmi` (see
/// [`launcher_vmi`]), with the cluster's default eviction strategy.
pub fn decide(pod: &Pod, vmi: &VirtualMachineInstance, cluster: &EvictionStrategy) -> Verdict {
    let migratable = is_migratable(vmi);
    let mark = match strategy(vmi, cluster) {
        EvictionStrategy::LiveMigrate => {
            if !migratable {
                return Verdict::Deny(format!(
                    "VMI {} is configured with an eviction strategy but is not live-migratable",
                    vmi.metadata.name.as_deref().unwrap_or_default()
                ));
            }
            true
        }
        EvictionStrategy::LiveMigrateIfPossible => migratable,
        EvictionStrategy::External => true,
        // `None`, and any strategy this build does not know.
        _ => false,
    };
    if !mark {
        return Verdict::Allow;
    }
    let status = vmi.status.as_ref();
    if status
        .and_then(|s| s.evacuation_node_name.as_deref())
        .is_some_and(|n| !n.is_empty())
    {
        return Verdict::Deny(format!("Evacuation in progress: {}", triggered(vmi)));
    }
    let pod_node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default();
    let vmi_node = status
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default();
    if pod_node != vmi_node {
        return Verdict::Deny(TARGET_POD_MESSAGE.to_owned());
    }
    Verdict::Mark {
        node: pod_node.to_owned(),
    }
}

/// The JSON patch marking `vmi` for evacuation from `node`: a test that it still runs there,
/// `status.evacuationNodeName`, and for the descheduler's evictions the
/// [`labels::EVICTION_SOURCE`].
pub fn mark_patch(
    vmi: &VirtualMachineInstance,
    node: &str,
    eviction_annotations: &BTreeMap<String, String>,
) -> Value {
    let mut ops = vec![
        json!({"op": "test", "path": "/status/nodeName", "value": node}),
        json!({"op": "add", "path": "/status/evacuationNodeName", "value": node}),
    ];
    if eviction_annotations
        .get(REQUESTED_BY_ANNOTATION)
        .is_some_and(|v| v == DESCHEDULER)
    {
        if vmi.metadata.annotations.is_some() {
            ops.push(json!({
                "op": "add",
                "path": format!("/metadata/annotations/{}", labels::EVICTION_SOURCE.replace('/', "~1")),
                "value": "descheduler",
            }));
        } else {
            ops.push(json!({
                "op": "add",
                "path": "/metadata/annotations",
                "value": {labels::EVICTION_SOURCE: "descheduler"},
            }));
        }
    }
    Value::Array(ops)
}

/// Answers a pod-eviction AdmissionReview: reads the pod and its VMI with virt-api's `client`,
/// decides, marks the VMI (a dry run writes nothing: the patch is sent with `dryRun=All`).
pub async fn admit(client: &kube::Client, review: &Value, ctx: &Context) -> Value {
    let req = match admission::eviction_request(review) {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    let denial = judge(client, &req, ctx).await;
    if let Some(d) = &denial {
        tracing::info!(namespace = %req.namespace, pod = %req.pod, dry_run = req.dry_run, "eviction refused: {d}");
    }
    admission::eviction_answer(&req.uid, denial)
}

/// `None` to allow, else the denial's message.
async fn judge(
    client: &kube::Client,
    req: &admission::EvictionRequest,
    ctx: &Context,
) -> Option<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &req.namespace);
    let pod = match pods.get_opt(&req.pod).await {
        Ok(Some(p)) => p,
        Ok(None) => return None,
        Err(e) => return Some(format!("kubevirt failed getting the pod: {e}")),
    };
    let vmi_name = launcher_vmi(&pod)?;
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), &req.namespace);
    let vmi = match vmis.get_opt(vmi_name).await {
        Ok(Some(v)) => v,
        Ok(None) => return None,
        Err(e) => return Some(format!("kubevirt failed getting the vmi: {e}")),
    };
    match decide(&pod, &vmi, &ctx.cluster.eviction_strategy) {
        Verdict::Allow => None,
        Verdict::Deny(message) => Some(message),
        Verdict::Mark { node } => {
            let patch: json_patch::Patch =
                match serde_json::from_value(mark_patch(&vmi, &node, &req.annotations)) {
                    Ok(p) => p,
                    Err(e) => return Some(format!("kubevirt failed marking the vmi: {e}")),
                };
            let params = PatchParams {
                dry_run: req.dry_run,
                ..PatchParams::default()
            };
            match vmis
                .patch(vmi_name, &params, &Patch::Json::<()>(patch))
                .await
            {
                Ok(_) => Some(triggered(&vmi)),
                Err(e) => Some(format!("kubevirt failed marking the vmi: {e}")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use pretty_assertions::assert_eq;

    use super::*;

    fn pod(node: &str, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "virt-launcher-demo-abcde", "namespace": "default",
                "labels": {"kubevirt.io": "virt-launcher"},
                "annotations": {"kubevirt.io/domain": "demo"},
            },
            "spec": {"nodeName": node, "containers": []},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn vmi(
        strategy: Option<&str>,
        migratable: bool,
        evacuating: Option<&str>,
    ) -> VirtualMachineInstance {
        let mut v = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "demo", "namespace": "default"},
            "spec": {"domain": {"devices": {}}},
            "status": {
                "phase": "Running", "nodeName": "node01",
                "conditions": [{"type": "LiveMigratable", "status": if migratable { "True" } else { "False" }}],
            },
        });
        if let Some(s) = strategy {
            v["spec"]["evictionStrategy"] = json!(s);
        }
        if let Some(n) = evacuating {
            v["status"]["evacuationNodeName"] = json!(n);
        }
        serde_json::from_value(v).unwrap()
    }

    const TRIGGERED: &str = "Eviction triggered evacuation of VMI \"default/demo\"";

    #[test]
    fn decisions() {
        let mark = || Verdict::Mark {
            node: "node01".into(),
        };
        let not_migratable =
            "VMI demo is configured with an eviction strategy but is not live-migratable";
        let in_progress = format!("Evacuation in progress: {TRIGGERED}");
        let none = EvictionStrategy::None;
        let live = EvictionStrategy::LiveMigrate;
        #[rustfmt::skip]
        let cases: Vec<(&str, VirtualMachineInstance, Pod, &EvictionStrategy, Verdict)> = vec![
            ("LiveMigrate, migratable: marked", vmi(Some("LiveMigrate"), true, None), pod("node01", "Running"), &none, mark()),
            ("LiveMigrate, not migratable: denied", vmi(Some("LiveMigrate"), false, None), pod("node01", "Running"), &none, Verdict::Deny(not_migratable.into())),
            ("LiveMigrate, already marked", vmi(Some("LiveMigrate"), true, Some("node01")), pod("node01", "Running"), &none, Verdict::Deny(in_progress.clone())),
            ("LiveMigrate, an empty mark is no mark", vmi(Some("LiveMigrate"), true, Some("")), pod("node01", "Running"), &none, mark()),
            ("LiveMigrate, the target pod", vmi(Some("LiveMigrate"), true, None), pod("node02", "Running"), &none, Verdict::Deny(TARGET_POD_MESSAGE.into())),
            ("LiveMigrateIfPossible, migratable: marked", vmi(Some("LiveMigrateIfPossible"), true, None), pod("node01", "Running"), &none, mark()),
            ("LiveMigrateIfPossible, not migratable: allowed", vmi(Some("LiveMigrateIfPossible"), false, None), pod("node01", "Running"), &none, Verdict::Allow),
            ("LiveMigrateIfPossible, already marked", vmi(Some("LiveMigrateIfPossible"), true, Some("node01")), pod("node01", "Running"), &none, Verdict::Deny(in_progress.clone())),
            ("External, not migratable: marked", vmi(Some("External"), false, None), pod("node01", "Running"), &none, mark()),
            ("External, already marked", vmi(Some("External"), false, Some("node01")), pod("node01", "Running"), &none, Verdict::Deny(in_progress.clone())),
            ("External, the target pod", vmi(Some("External"), true, None), pod("node02", "Running"), &none, Verdict::Deny(TARGET_POD_MESSAGE.into())),
            ("None: allowed", vmi(Some("None"), true, None), pod("node01", "Running"), &live, Verdict::Allow),
            ("unset, cluster None: allowed", vmi(None, true, None), pod("node01", "Running"), &none, Verdict::Allow),
            ("unset, cluster LiveMigrate: marked", vmi(None, true, None), pod("node01", "Running"), &live, mark()),
            ("unset, cluster LiveMigrate, not migratable", vmi(None, false, None), pod("node01", "Running"), &live, Verdict::Deny(not_migratable.into())),
        ];
        for (case, v, p, cluster, want) in cases {
            assert_eq!(decide(&p, &v, cluster), want, "{case}");
        }
    }

    #[test]
    fn only_running_launcher_pods_with_a_vmi_are_judged() {
        assert_eq!(launcher_vmi(&pod("node01", "Running")), Some("demo"));
        assert_eq!(launcher_vmi(&pod("node01", "Pending")), Some("demo"));
        assert_eq!(launcher_vmi(&pod("node01", "Succeeded")), None, "completed");
        assert_eq!(launcher_vmi(&pod("node01", "Failed")), None, "completed");
        let mut other = pod("node01", "Running");
        other.metadata.labels = Some([("app".to_owned(), "web".to_owned())].into());
        assert_eq!(launcher_vmi(&other), None, "not a launcher");
        let mut bare = pod("node01", "Running");
        bare.metadata.annotations = None;
        assert_eq!(launcher_vmi(&bare), None, "no VMI named");
    }

    #[test]
    fn mark_patch_tests_the_node_and_notes_the_descheduler() {
        let v = vmi(Some("LiveMigrate"), true, None);
        let mut doc = serde_json::to_value(&v).unwrap();
        let p: json_patch::Patch =
            serde_json::from_value(mark_patch(&v, "node01", &BTreeMap::new())).unwrap();
        json_patch::patch(&mut doc, &p).unwrap();
        assert_eq!(doc["status"]["evacuationNodeName"], "node01");
        assert!(doc["metadata"].get("annotations").is_none());

        // The VMI moved since it was read: the test fails, nothing is marked.
        let mut moved = serde_json::to_value(&v).unwrap();
        moved["status"]["nodeName"] = json!("node02");
        assert!(json_patch::patch(&mut moved, &p).is_err());

        let by_descheduler: BTreeMap<String, String> =
            [(REQUESTED_BY_ANNOTATION.to_owned(), DESCHEDULER.to_owned())].into();
        for annotations in [None, Some(json!({"a": "b"}))] {
            let mut v = v.clone();
            v.metadata.annotations = annotations.map(|a| serde_json::from_value(a).unwrap());
            let mut doc = serde_json::to_value(&v).unwrap();
            let p: json_patch::Patch =
                serde_json::from_value(mark_patch(&v, "node01", &by_descheduler)).unwrap();
            json_patch::patch(&mut doc, &p).unwrap();
            assert_eq!(
                doc["metadata"]["annotations"][labels::EVICTION_SOURCE],
                "descheduler"
            );
        }
    }

    fn eviction_review(dry_run: bool) -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": "policy", "version": "v1", "kind": "Eviction"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "subResource": "eviction",
                "name": "virt-launcher-demo-abcde",
                "namespace": "default",
                "operation": "CREATE",
                "userInfo": {"username": "admin"},
                "object": {
                    "apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {
                        "name": "virt-launcher-demo-abcde", "namespace": "default",
                        "annotations": {"requested-by": "sigs.k8s.io/descheduler"},
                    },
                },
                "dryRun": dry_run,
            }
        })
    }

    #[test]
    fn eviction_request_and_answer() {
        let req = admission::eviction_request(&eviction_review(true)).unwrap();
        assert_eq!(
            req,
            admission::EvictionRequest {
                uid: "u-1".into(),
                namespace: "default".into(),
                pod: "virt-launcher-demo-abcde".into(),
                dry_run: true,
                annotations: [(REQUESTED_BY_ANNOTATION.to_owned(), DESCHEDULER.to_owned())].into(),
            }
        );
        assert!(
            !admission::eviction_request(&eviction_review(false))
                .unwrap()
                .dry_run
        );

        // A review of pods, not their eviction, is not this hook's.
        let mut wrong = eviction_review(false);
        wrong["request"]["subResource"] = json!("");
        let answer = admission::eviction_request(&wrong).unwrap_err();
        assert_eq!(answer["response"]["uid"], "u-1");
        assert_eq!(answer["response"]["allowed"], false);
        assert_eq!(answer["response"]["status"]["code"], 400);

        let allowed = admission::eviction_answer("u-1", None);
        assert_eq!(allowed["response"], json!({"uid": "u-1", "allowed": true}));
        let denied = admission::eviction_answer("u-1", Some(TRIGGERED.to_owned()));
        assert_eq!(denied["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(
            denied["response"],
            json!({"uid": "u-1", "allowed": false, "status": {
                "status": "Failure", "code": 429, "reason": "TooManyRequests", "message": TRIGGERED,
            }})
        );
    }
}
