//! The disruption-budget controller's decision (KubeVirt's `DisruptionBudgetController`,
//! `pkg/virt-controller/watch/drain/disruptionbudget/disruptionbudget.go`).
//!
//! KubeVirt once kept a PodDisruptionBudget per migratable VMI (`kubevirt-disruption-budget-*`,
//! controlled by the VMI, `minAvailable` 1, 2 during a migration) so that `kubectl drain` could
//! not evict its launcher pod. The pod-eviction webhook (`virtapi::eviction`) replaced that
//! mechanism, and KubeVirt's controller now only deletes the PDBs its older releases left
//! behind: every PDB whose controller is a VMI goes, whatever the VMI's state. A leftover
//! PDB with `minAvailable` 1 over a single launcher pod would otherwise block every drain of its
//! node for good. kubevirt-rs never creates such PDBs; it removes them for clusters upgraded
//! from KubeVirt.

use informer::controller_owner;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;

/// Event reason (on the VMI): a PDB was deleted (KubeVirt's
/// `SuccessfulDeletePodDisruptionBudgetReason`).
pub const SUCCESSFUL_DELETE: &str = "SuccessfulDelete";
/// Event reason (on the VMI): deleting a PDB failed (`FailedDeletePodDisruptionBudgetReason`).
pub const FAILED_DELETE: &str = "FailedDelete";

/// The VMI whose PDB this is, if it is to be deleted: its controller is a
/// VirtualMachineInstance and it is not being deleted already.
pub fn vmi_to_release(pdb: &PodDisruptionBudget) -> Option<&str> {
    if pdb.metadata.deletion_timestamp.is_some() {
        return None;
    }
    controller_owner(pdb, "VirtualMachineInstance")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pdb(owner: &serde_json::Value, deleting: bool) -> PodDisruptionBudget {
        let mut o = json!({
            "metadata": {"name": "kubevirt-disruption-budget-x7k2p", "namespace": "default",
                         "ownerReferences": owner},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"kubevirt.io/created-by": "u1"}}},
        });
        if deleting {
            o["metadata"]["deletionTimestamp"] = json!("2026-11-27T08:00:00Z");
        }
        serde_json::from_value(o).unwrap()
    }

    fn owner(kind: &str, controller: bool) -> serde_json::Value {
        json!([{"apiVersion": "kubevirt.io/v1", "kind": kind, "name": "demo", "uid": "u1",
                "controller": controller}])
    }

    #[test]
    fn only_live_pdbs_a_vmi_controls_are_deleted() {
        let cases = [
            (
                "controlled by a VMI",
                pdb(&owner("VirtualMachineInstance", true), false),
                Some("demo"),
            ),
            (
                "already being deleted",
                pdb(&owner("VirtualMachineInstance", true), true),
                None,
            ),
            (
                "a VMI owner that is not its controller",
                pdb(&owner("VirtualMachineInstance", false), false),
                None,
            ),
            (
                "controlled by something else",
                pdb(&owner("Deployment", true), false),
                None,
            ),
            ("no owner", pdb(&json!([]), false), None),
        ];
        for (case, p, want) in &cases {
            assert_eq!(vmi_to_release(p), *want, "{case}");
        }
    }
}
