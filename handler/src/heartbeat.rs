//! The node heartbeat: the labels and annotation virt-handler keeps on its node so that the
//! controller only schedules VMIs where a live handler with working device plugins runs
//! (KubeVirt's `pkg/virt-handler/heartbeat`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use api::kubevirt::KubeVirt;
use jiff::Timestamp;
use serde_json::{Value, json};

pub use api::labels::{
    CPU_MANAGER as LABEL_CPU_MANAGER, DEPRECATED_CPU_MANAGER as LABEL_CPU_MANAGER_DEPRECATED,
    NODE_SCHEDULABLE as LABEL_SCHEDULABLE, VIRT_HANDLER_HEARTBEAT as ANNOTATION_HEARTBEAT,
};

/// KubeVirt's heartbeat period and jitter factor (`wait.JitterUntil(…, 1m, 1.2, …)`).
pub const INTERVAL: Duration = Duration::from_mins(1);
pub const JITTER_FACTOR: f64 = 1.2;

/// The merge patch for the node. `schedulable` is false at start, on SIGTERM and while the
/// device plugins are not yet registered.
pub fn node_patch(schedulable: bool, cpu_manager: bool, now: Timestamp) -> Value {
    json!({
        "metadata": {
            "labels": {
                LABEL_SCHEDULABLE: if schedulable { "true" } else { "false" },
                LABEL_CPU_MANAGER_DEPRECATED: cpu_manager.to_string(),
                LABEL_CPU_MANAGER: cpu_manager.to_string(),
            },
            "annotations": {
                // metav1.Time's JSON form: RFC 3339, whole seconds, `Z`.
                ANNOTATION_HEARTBEAT: format!("{now:.0}"),
            },
        }
    })
}

/// The wait before the next heartbeat: the interval plus up to `JITTER_FACTOR` times it, as
/// `wait.Jitter` does; `unit` is a uniform sample from [0, 1).
pub fn next_delay(unit: f64) -> Duration {
    INTERVAL + INTERVAL.mul_f64(JITTER_FACTOR * unit.clamp(0.0, 1.0))
}

/// A cheap uniform sample in [0, 1) for the jitter; it only spreads handlers apart, so the
/// clock's nanoseconds are random enough and no RNG crate is needed.
pub fn jitter_sample() -> f64 {
    let nanos = Timestamp::now().subsec_nanosecond();
    f64::from(nanos) / 1e9
}

/// KubeVirt's feature gate for dedicated CPUs; without it no node is labelled as having a
/// CPU manager, so no VMI with dedicated CPUs schedules.
pub const CPU_MANAGER_GATE: &str = "CPUManager";

/// The kubelet's CPU manager checkpoint in its root dir; KubeVirt also looks at OpenShift 3's
/// `/var/lib/origin/openshift.local.volumes/cpu_manager_state`, which no kubelet of ours writes.
pub const CPU_MANAGER_STATE: &str = "cpu_manager_state";

/// Whether a `cpu_manager_state` file says the static policy runs (KubeVirt's
/// `isCPUManagerEnabled`: its `policyName`); an unreadable file says no.
pub fn cpu_manager_static(state: &str) -> bool {
    serde_json::from_str::<Value>(state).is_ok_and(|v| v["policyName"] == "static")
}

/// Whether `kubelet_root`'s CPU manager runs the static policy.
fn kubelet_cpu_manager_static(kubelet_root: &Path) -> bool {
    let path = kubelet_root.join(CPU_MANAGER_STATE);
    match std::fs::read_to_string(&path) {
        Ok(text) => cpu_manager_static(&text),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "no CPU manager state");
            false
        }
    }
}

/// Writes node patches; the Kubernetes API in production.
#[derive(Debug, Clone)]
pub struct NodePatcher {
    nodes: kube::Api<k8s_openapi::api::core::v1::Node>,
    kubevirts: kube::Api<KubeVirt>,
    node: String,
    kubelet_root: PathBuf,
}

impl NodePatcher {
    pub fn new(client: kube::Client, node: &str, kubelet_root: &Path) -> Self {
        NodePatcher {
            nodes: kube::Api::all(client.clone()),
            kubevirts: kube::Api::all(client),
            node: node.to_owned(),
            kubelet_root: kubelet_root.to_owned(),
        }
    }

    /// KubeVirt's: the CPUManager gate is on and the kubelet's checkpoint says `static`.
    async fn cpu_manager(&self) -> bool {
        let gate = match self.kubevirts.list(&kube::api::ListParams::default()).await {
            Ok(list) => list
                .items
                .iter()
                .any(|kv| api::ClusterConfig::from_kubevirt(kv).has_feature_gate(CPU_MANAGER_GATE)),
            Err(e) => {
                tracing::debug!(error = %e, "no KubeVirt configuration: CPUManager gate off");
                false
            }
        };
        gate && kubelet_cpu_manager_static(&self.kubelet_root)
    }

    pub async fn patch(&self, schedulable: bool) -> Result<(), kube::Error> {
        let patch = node_patch(schedulable, self.cpu_manager().await, Timestamp::now());
        self.nodes
            .patch(
                &self.node,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .map(drop)
    }
}

/// The heartbeat loop: the node is marked unschedulable at once, then heartbeats every
/// `interval` (plus jitter) with `schedulable` following `ready` (true once the device plugins
/// are registered), right away whenever `ready` changes; when `stop` fires (SIGTERM) the node
/// is marked unschedulable a last time. Failed patches are logged and retried on the next beat.
pub async fn run(
    patcher: NodePatcher,
    mut ready: tokio::sync::watch::Receiver<bool>,
    interval: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    let beat = |schedulable: bool| {
        let p = patcher.clone();
        async move {
            match p.patch(schedulable).await {
                Ok(()) => tracing::debug!(node = %p.node, schedulable, "heartbeat"),
                Err(e) => tracing::warn!(node = %p.node, error = %e, "heartbeat patch failed"),
            }
        }
    };
    beat(false).await;
    let mut source_open = true;
    loop {
        let schedulable = *ready.borrow_and_update();
        beat(schedulable).await;
        let wait = interval + interval.mul_f64(JITTER_FACTOR * jitter_sample());
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(wait) => {}
            // A closed readiness source keeps its last value; the beat goes on.
            r = ready.changed(), if source_open => source_open = r.is_ok(),
        }
    }
    beat(false).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    #[test]
    fn patch_has_kubevirt_keys_and_time_format() {
        // Fractional seconds are cut, not rounded.
        let now: Timestamp = "2026-11-22T04:05:06.9Z".parse().expect("valid");
        assert_eq!(
            node_patch(true, false, now),
            json!({"metadata": {
                "labels": {
                    "kubevirt.io/schedulable": "true",
                    "cpumanager": "false",
                    "kubevirt.io/cpumanager": "false",
                },
                "annotations": {"kubevirt.io/heartbeat": "2026-11-22T04:05:06Z"},
            }})
        );
        assert_eq!(
            node_patch(false, true, now)["metadata"]["labels"]["kubevirt.io/schedulable"],
            "false"
        );
    }

    #[test]
    fn only_the_static_policy_counts_as_a_cpu_manager() {
        // What kubelets write: v2's top-level fields, which later versions keep beside `data`.
        assert!(cpu_manager_static(
            r#"{"policyName":"static","defaultCpuSet":"0,2-3","entries":{"u":{"compute":"1"}},"checksum":1}"#
        ));
        assert!(!cpu_manager_static(
            r#"{"policyName":"none","defaultCpuSet":"","checksum":1}"#
        ));
        assert!(!cpu_manager_static("{\"policyName\":\"stat"));
        assert!(!cpu_manager_static(""));
    }

    #[test]
    fn delay_stays_within_the_jitter_window() {
        assert_eq!(next_delay(0.0), Duration::from_mins(1));
        assert_eq!(next_delay(0.5), Duration::from_secs(96));
        assert_eq!(next_delay(7.0), Duration::from_secs(132), "clamped");
        let s = jitter_sample();
        assert!((0.0..1.0).contains(&s), "{s}");
    }
}
