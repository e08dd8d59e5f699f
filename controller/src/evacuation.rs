//! The evacuation controller's decisions (KubeVirt's `EvacuationController`,
//! `pkg/virt-controller/watch/drain/evacuation/evacuation.go`): per node, which VMIs get a
//! migration away from it, and that migration.
//!
//! A node is evacuated in one of two ways:
//! - it carries the drain taint (`migrations.nodeDrainTaintKey`, default `kubevirt.io/drain`)
//!   with effect `NoSchedule`: every VMI on it is a candidate (KubeVirt marks this path
//!   deprecated, but keeps it);
//! - otherwise, VMIs that virt-api's pod-eviction webhook marked (`status.evacuationNodeName`
//!   = this node, `kubectl drain`) and that still run there, not mid-migration.
//!
//! Candidates are skipped when final or being deleted, when their eviction strategy does not
//! migrate (`LiveMigrate`, or `LiveMigrateIfPossible` when migratable; `External` and `None`
//! never: an external controller acts on `External`'s mark), when not `LiveMigratable=True`,
//! when a migration of theirs is unfinished, or when they have more than one active pod. There
//! is no limit here: the migration controller's parallelism limits apply to these migrations.

use api::migration::VirtualMachineInstanceMigration;
use api::status::VirtualMachineInstanceConditionType;
use api::vmi::EvictionStrategy;
use api::{ClusterConfig, VirtualMachineInstance, labels};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;

/// The evacuation migrations' `generateName`.
pub const GENERATE_NAME: &str = "kubevirt-evacuation-";
/// Priority of an evacuation migration.
pub const PRIORITY_CRITICAL: &str = "system-critical";
/// Priority of a descheduler's evacuation migration.
pub const PRIORITY_MAINTENANCE: &str = "system-maintenance";

/// Event reason: an evacuation migration was created (on the VMI).
pub const SUCCESSFUL_CREATE: &str = "SuccessfulCreate";
/// Event reason: creating an evacuation migration failed (on the VMI).
pub const FAILED_CREATE: &str = "FailedCreate";

/// One VMI on the node, with what the shell knows of it from the other caches.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// The VMI (its `status.nodeName` is the node).
    pub vmi: &'a VirtualMachineInstance,
    /// A migration of this VMI is not Succeeded or Failed.
    pub unfinished_migration: bool,
    /// Its launcher pods that are not Succeeded or Failed.
    pub active_pods: usize,
}

/// Whether `node` carries `key` with effect `NoSchedule`.
pub fn has_drain_taint(node: &Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key && t.effect == "NoSchedule"))
}

/// `LiveMigratable=True`.
pub fn is_migratable(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .as_ref()
        .and_then(|s| s.condition(&VirtualMachineInstanceConditionType::LiveMigratable))
        .is_some_and(|c| c.status == api::common::ConditionStatus::True)
}

/// KubeVirt's `VMIMigratableOnEviction`: the VMI's eviction strategy (else the cluster's) says
/// an eviction moves it.
pub fn migrates_on_eviction(vmi: &VirtualMachineInstance, cluster: &EvictionStrategy) -> bool {
    match vmi.spec.eviction_strategy.as_ref().unwrap_or(cluster) {
        EvictionStrategy::LiveMigrate => true,
        EvictionStrategy::LiveMigrateIfPossible => is_migratable(vmi),
        _ => false,
    }
}

/// Launcher pods that count as active (KubeVirt's `VMIActivePodsCount`): not Succeeded or
/// Failed.
pub fn is_active_pod(pod: &Pod) -> bool {
    !matches!(crate::vmi::pod_phase(pod), "Succeeded" | "Failed")
}

fn node_of(vmi: &VirtualMachineInstance) -> Option<&str> {
    vmi.status.as_ref()?.node_name.as_deref()
}

/// Marked for evacuation from `node` by the eviction webhook, still there, not migrating.
fn marked_for(vmi: &VirtualMachineInstance, node: &str) -> bool {
    let Some(status) = vmi.status.as_ref() else {
        return false;
    };
    let migrating = status
        .migration_state
        .as_ref()
        .is_some_and(|m| !crate::migration::state_finished(m));
    status.evacuation_node_name.as_deref() == Some(node)
        && status.node_name.as_deref() == Some(node)
        && !migrating
}

/// Whether `vmi` is asked to leave `node`: it runs there, and the node carries the drain taint
/// or the VMI was marked for evacuation from it. The shell looks up a VMI's migrations and
/// pods only when this holds; most syncs end here.
pub fn asked_to_leave(node: &Node, vmi: &VirtualMachineInstance, cfg: &ClusterConfig) -> bool {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let key = cfg
        .migrations
        .node_drain_taint_key
        .as_deref()
        .unwrap_or(api::migration::DEFAULT_NODE_DRAIN_TAINT_KEY);
    node_of(vmi) == Some(name) && (has_drain_taint(node, key) || marked_for(vmi, name))
}

/// The VMIs of `node` to migrate away now, in the order given.
pub fn select<'a>(
    node: &Node,
    candidates: &[Candidate<'a>],
    cfg: &ClusterConfig,
) -> Vec<&'a VirtualMachineInstance> {
    candidates
        .iter()
        .filter(|c| asked_to_leave(node, c.vmi, cfg))
        .filter(|c| {
            !crate::vmi::is_final(c.vmi)
                && c.vmi.metadata.deletion_timestamp.is_none()
                && migrates_on_eviction(c.vmi, &cfg.eviction_strategy)
                && is_migratable(c.vmi)
                && !c.unfinished_migration
                && c.active_pods <= 1
        })
        .map(|c| c.vmi)
        .collect()
}

/// The migration evacuating `vmi` from `node`.
pub fn evacuation_migration(
    vmi: &VirtualMachineInstance,
    node: &str,
) -> VirtualMachineInstanceMigration {
    let by_descheduler = vmi
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(labels::EVICTION_SOURCE))
        .is_some_and(|s| s == "descheduler");
    let priority = if by_descheduler {
        PRIORITY_MAINTENANCE
    } else {
        PRIORITY_CRITICAL
    };
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstanceMigration",
        "metadata": {
            "generateName": GENERATE_NAME,
            "namespace": vmi.metadata.namespace,
            "annotations": {labels::EVACUATION_MIGRATION: node},
        },
        "spec": {"vmiName": vmi.metadata.name, "priority": priority},
    }))
    .expect("a migration from its own fields")
}

/// The node an evacuation migration evacuates, if it is one.
pub fn evacuated_node(m: &VirtualMachineInstanceMigration) -> Option<&str> {
    m.metadata
        .annotations
        .as_ref()?
        .get(labels::EVACUATION_MIGRATION)
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use pretty_assertions::assert_eq;

    use super::*;

    fn node(taints: &serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": "node01"}, "spec": {"taints": taints}}))
            .unwrap()
    }

    struct V {
        name: &'static str,
        strategy: Option<&'static str>,
        migratable: bool,
        node: &'static str,
        evacuation: Option<&'static str>,
        phase: &'static str,
        migrating: bool,
    }

    const BASE: V = V {
        name: "demo",
        strategy: Some("LiveMigrate"),
        migratable: true,
        node: "node01",
        evacuation: None,
        phase: "Running",
        migrating: false,
    };

    fn vmi(v: &V) -> VirtualMachineInstance {
        let mut o = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": v.name, "namespace": "default"},
            "spec": {"domain": {"devices": {}}},
            "status": {
                "phase": v.phase, "nodeName": v.node,
                "conditions": [{"type": "LiveMigratable", "status": if v.migratable { "True" } else { "False" }}],
            },
        });
        if let Some(s) = v.strategy {
            o["spec"]["evictionStrategy"] = json!(s);
        }
        if let Some(n) = v.evacuation {
            o["status"]["evacuationNodeName"] = json!(n);
        }
        if v.migrating {
            o["status"]["migrationState"] = json!({"migrationUid": "m1", "sourceNode": v.node});
        }
        serde_json::from_value(o).unwrap()
    }

    fn taint(key: &str, effect: &str) -> serde_json::Value {
        json!([{"key": key, "effect": effect}])
    }

    #[test]
    fn selection() {
        let drain = || node(&taint("kubevirt.io/drain", "NoSchedule"));
        let plain = || node(&json!([]));
        let marked = Some("node01");
        #[rustfmt::skip]
        let cases: Vec<(&str, Node, V, bool, usize, bool)> = vec![
            // (case, node, vmi, unfinished migration, active pods, selected)
            ("tainted, LiveMigrate", drain(), BASE, false, 1, true),
            ("tainted NoExecute is not the drain taint", node(&taint("kubevirt.io/drain", "NoExecute")), BASE, false, 1, false),
            ("another taint key", node(&taint("example.com/drain", "NoSchedule")), BASE, false, 1, false),
            ("untainted, unmarked", plain(), BASE, false, 1, false),
            ("untainted, marked", plain(), V { evacuation: marked, ..BASE }, false, 1, true),
            ("marked for another node", plain(), V { evacuation: Some("node02"), ..BASE }, false, 1, false),
            ("marked, mid-migration", plain(), V { evacuation: marked, migrating: true, ..BASE }, false, 1, false),
            ("tainted, on another node", drain(), V { node: "node02", ..BASE }, false, 1, false),
            ("tainted, final", drain(), V { phase: "Succeeded", ..BASE }, false, 1, false),
            ("tainted, not migratable", drain(), V { migratable: false, ..BASE }, false, 1, false),
            ("tainted, strategy None", drain(), V { strategy: Some("None"), ..BASE }, false, 1, false),
            ("tainted, strategy External", drain(), V { strategy: Some("External"), ..BASE }, false, 1, false),
            ("marked, strategy External: left to its controller", plain(), V { strategy: Some("External"), evacuation: marked, ..BASE }, false, 1, false),
            ("tainted, LiveMigrateIfPossible migratable", drain(), V { strategy: Some("LiveMigrateIfPossible"), ..BASE }, false, 1, true),
            ("tainted, LiveMigrateIfPossible not migratable", drain(), V { strategy: Some("LiveMigrateIfPossible"), migratable: false, ..BASE }, false, 1, false),
            ("tainted, unset strategy, cluster None", drain(), V { strategy: None, ..BASE }, false, 1, false),
            ("tainted, an unfinished migration", drain(), BASE, true, 1, false),
            ("tainted, two active pods", drain(), BASE, false, 2, false),
        ];
        let cfg = ClusterConfig::default();
        for (case, n, v, unfinished, pods, want) in cases {
            let vmi = vmi(&v);
            let c = [Candidate {
                vmi: &vmi,
                unfinished_migration: unfinished,
                active_pods: pods,
            }];
            assert_eq!(select(&n, &c, &cfg).len() == 1, want, "{case}");
        }
    }

    #[test]
    fn the_cluster_strategy_and_taint_key_apply() {
        let mut cfg = ClusterConfig {
            eviction_strategy: EvictionStrategy::LiveMigrate,
            ..ClusterConfig::default()
        };
        let v = vmi(&V {
            strategy: None,
            ..BASE
        });
        let c = [Candidate {
            vmi: &v,
            unfinished_migration: false,
            active_pods: 1,
        }];
        assert_eq!(
            select(&node(&taint("kubevirt.io/drain", "NoSchedule")), &c, &cfg).len(),
            1
        );
        cfg.migrations.node_drain_taint_key = Some("example.com/maintenance".into());
        assert!(select(&node(&taint("kubevirt.io/drain", "NoSchedule")), &c, &cfg).is_empty());
        assert_eq!(
            select(
                &node(&taint("example.com/maintenance", "NoSchedule")),
                &c,
                &cfg
            )
            .len(),
            1
        );
    }

    #[test]
    fn the_migration() {
        let v = vmi(&BASE);
        let m = evacuation_migration(&v, "node01");
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            json!({
                "apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachineInstanceMigration",
                "metadata": {
                    "generateName": "kubevirt-evacuation-",
                    "namespace": "default",
                    "annotations": {"kubevirt.io/evacuationMigration": "node01"},
                },
                "spec": {"vmiName": "demo", "priority": "system-critical"},
            })
        );
        assert_eq!(evacuated_node(&m), Some("node01"));
        let mut by_descheduler = v.clone();
        by_descheduler.metadata.annotations =
            Some([(labels::EVICTION_SOURCE.to_owned(), "descheduler".to_owned())].into());
        let m = evacuation_migration(&by_descheduler, "node01");
        assert_eq!(m.spec.priority.as_deref(), Some("system-maintenance"));
    }
}
