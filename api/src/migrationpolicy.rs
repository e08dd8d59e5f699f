//! `MigrationPolicy` (`migrations.kubevirt.io/v1alpha1`, cluster-scoped): migration settings
//! for the VMIs its selectors match, over the KubeVirt CR's (KubeVirt's
//! `pkg/virt-controller/watch/migration/migrationpolicy.go`). virt-controller picks one policy
//! per migration at the hand-off and writes its name and the settings in effect into the VMI's
//! `migrationState`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::Preserved;
use crate::migration::MigrationConfiguration;
use crate::quantity::ParsedQuantity;
use crate::validation::FieldError;

/// The `spec` of a `MigrationPolicy`.
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "migrations.kubevirt.io",
    version = "v1alpha1",
    kind = "MigrationPolicy",
    plural = "migrationpolicies",
    status = "MigrationPolicyStatus",
    derive = "PartialEq",
    crates(kube_core = "::kube_core"),
    doc = "MigrationPolicy holds migration settings for the VMIs (and namespaces) its selectors match."
)]
#[serde(rename_all = "camelCase")]
pub struct MigrationPolicySpec {
    /// Which VMIs the policy applies to; a policy without selectors matches none.
    pub selectors: Option<Selectors>,
    pub allow_auto_converge: Option<bool>,
    /// Bytes per second, a quantity; `0`: unlimited.
    pub bandwidth_per_migration: Option<Quantity>,
    #[serde(rename = "completionTimeoutPerGiB")]
    pub completion_timeout_per_gib: Option<i64>,
    /// Refused: KubeVirt lets it change only behind the MigrationStallDetection or
    /// MigrationDowntimeTuning feature gates, which kubevirt-rs does not have.
    pub max_downtime_ms: Option<u64>,
    pub allow_post_copy: Option<bool>,
    pub allow_workload_disruption: Option<bool>,
    /// KubeVirt's alpha `ExperimentalMigrationOptions` (stall detector, downtime tuning,
    /// compression); refused.
    pub experimental: Option<Preserved>,
}

/// The labels a policy matches: every one given must be on the VMI (respectively its
/// namespace).
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Selectors {
    pub namespace_selector: Option<BTreeMap<String, String>>,
    pub virtual_machine_instance_selector: Option<BTreeMap<String, String>>,
}

/// Empty, as KubeVirt's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MigrationPolicyStatus {}

/// How well a policy matches: labels matched on the VMI and on its namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Score {
    vmi: usize,
    namespace: usize,
}

impl Score {
    /// More labels in all wins; on a tie, more VMI labels.
    fn key(self) -> (usize, usize) {
        (self.vmi + self.namespace, self.vmi)
    }
}

/// KubeVirt's `countMatchingLabels`: `None` when the policy does not match. A selector is
/// only looked at when the VMI has labels at all (KubeVirt checks the VMI's labels for the
/// namespace selector too).
fn score(
    policy: &MigrationPolicy,
    vmi_labels: Option<&BTreeMap<String, String>>,
    namespace_labels: &BTreeMap<String, String>,
) -> Option<Score> {
    let selectors = policy.spec.selectors.as_ref()?;
    let count = |wanted: &BTreeMap<String, String>, have: &BTreeMap<String, String>| {
        wanted
            .iter()
            .all(|(k, v)| have.get(k) == Some(v))
            .then_some(wanted.len())
    };
    let Some(vmi_labels) = vmi_labels else {
        return Some(Score {
            vmi: 0,
            namespace: 0,
        });
    };
    let vmi = match &selectors.virtual_machine_instance_selector {
        Some(s) => count(s, vmi_labels)?,
        None => 0,
    };
    let namespace = match &selectors.namespace_selector {
        Some(s) => count(s, namespace_labels)?,
        None => 0,
    };
    Some(Score { vmi, namespace })
}

/// KubeVirt's `matchPolicy`: the matching policy with the most matched labels (VMI labels
/// break a tie), then the first by name.
pub fn match_policy<'a>(
    policies: impl IntoIterator<Item = &'a MigrationPolicy>,
    vmi_labels: Option<&BTreeMap<String, String>>,
    namespace_labels: &BTreeMap<String, String>,
) -> Option<&'a MigrationPolicy> {
    policies
        .into_iter()
        .filter_map(|p| Some((score(p, vmi_labels, namespace_labels)?.key(), p)))
        .max_by(|(a, pa), (b, pb)| {
            a.cmp(b)
                .then_with(|| pb.metadata.name.cmp(&pa.metadata.name))
        })
        .map(|(_, p)| p)
}

impl MigrationPolicySpec {
    /// KubeVirt's `applyMigrationPolicySpec`: the policy's settings over the cluster's; a
    /// policy that sets `allowPostCopy` but not `allowWorkloadDisruption` sets both.
    #[must_use]
    pub fn apply(&self, base: &MigrationConfiguration) -> MigrationConfiguration {
        let mut out = base.clone();
        if let Some(v) = self.allow_auto_converge {
            out.allow_auto_converge = Some(v);
        }
        if let Some(v) = &self.bandwidth_per_migration {
            out.bandwidth_per_migration = Some(v.clone());
        }
        if let Some(v) = self.completion_timeout_per_gib {
            out.completion_timeout_per_gib = Some(u64::try_from(v).unwrap_or(0));
        }
        if let Some(v) = self.allow_post_copy {
            out.allow_post_copy = Some(v);
        }
        if let Some(v) = self.allow_workload_disruption.or(self.allow_post_copy) {
            out.allow_workload_disruption = Some(v);
        }
        out
    }
}

fn field_error(path: &str, message: &str) -> FieldError {
    FieldError {
        path: path.to_owned(),
        message: message.to_owned(),
    }
}

/// What `migration-policy-validator.kubevirt.io` refuses (KubeVirt's `MigrationPolicyAdmitter`,
/// with no migration feature gates enabled), each with its field path.
pub fn validate(policy: &MigrationPolicy) -> Vec<FieldError> {
    let spec = &policy.spec;
    let mut out = Vec::new();
    if spec.completion_timeout_per_gib.is_some_and(|t| t < 0) {
        out.push(field_error(
            "spec.completionTimeoutPerGiB",
            "must not be negative",
        ));
    }
    if let Some(b) = &spec.bandwidth_per_migration {
        match ParsedQuantity::parse(&b.0) {
            Ok(v) if v.is_negative() => out.push(field_error(
                "spec.bandwidthPerMigration",
                "must not be negative",
            )),
            Ok(_) => {}
            Err(e) => out.push(field_error(
                "spec.bandwidthPerMigration",
                &format!("not a quantity: {e}"),
            )),
        }
    }
    if spec.max_downtime_ms.is_some() {
        out.push(field_error(
            "spec.maxDowntimeMs",
            "is not supported: KubeVirt allows it only with the MigrationStallDetection or \
             MigrationDowntimeTuning feature gate, which kubevirt-rs does not implement",
        ));
    }
    if spec.experimental.is_some() {
        out.push(field_error(
            "spec.experimental",
            "is not supported: experimental migration options (stall detector, downtime tuning, \
             compression) are not implemented by kubevirt-rs",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn policy(name: &str, vmi: &[(&str, &str)], ns: &[(&str, &str)]) -> MigrationPolicy {
        let map = |l: &[(&str, &str)]| -> BTreeMap<String, String> {
            l.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        serde_json::from_value(json!({
            "apiVersion": "migrations.kubevirt.io/v1alpha1", "kind": "MigrationPolicy",
            "metadata": {"name": name},
            "spec": {"selectors": {"virtualMachineInstanceSelector": map(vmi), "namespaceSelector": map(ns)}},
        }))
        .unwrap()
    }

    fn labels(l: &[(&str, &str)]) -> BTreeMap<String, String> {
        l.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn name(p: Option<&MigrationPolicy>) -> Option<&str> {
        p.and_then(|p| p.metadata.name.as_deref())
    }

    #[test]
    fn the_most_detailed_matching_policy_wins() {
        let vmi = labels(&[("app", "db"), ("tier", "gold")]);
        let ns = labels(&[("team", "a")]);
        let policies = [
            policy("any", &[], &[]),
            policy("app", &[("app", "db")], &[]),
            policy("app-tier", &[("app", "db"), ("tier", "gold")], &[]),
            policy("wrong-tier", &[("app", "db"), ("tier", "silver")], &[]),
            policy("team", &[], &[("team", "a")]),
        ];
        assert_eq!(
            name(match_policy(&policies, Some(&vmi), &ns)),
            Some("app-tier")
        );
        let tie = [
            policy("b-vmi", &[("app", "db")], &[]),
            policy("a-ns", &[], &[("team", "a"), ("zone", "1")]),
        ];
        let ns2 = labels(&[("team", "a"), ("zone", "1")]);
        assert_eq!(
            name(match_policy(&tie, Some(&vmi), &ns2)),
            Some("a-ns"),
            "2 labels > 1"
        );
        let tie = [
            policy("b", &[("app", "db")], &[]),
            policy("a", &[("tier", "gold")], &[]),
        ];
        assert_eq!(
            name(match_policy(&tie, Some(&vmi), &ns)),
            Some("a"),
            "the first name"
        );
        let tie = [
            policy("a-ns", &[], &[("team", "a")]),
            policy("b-vmi", &[("app", "db")], &[]),
        ];
        assert_eq!(
            name(match_policy(&tie, Some(&vmi), &ns)),
            Some("b-vmi"),
            "VMI labels break the tie"
        );
        assert_eq!(
            name(match_policy(
                &[policy("wrong", &[("app", "web")], &[])],
                Some(&vmi),
                &ns
            )),
            None
        );
        let no_selectors: MigrationPolicy = serde_json::from_value(json!({
            "apiVersion": "migrations.kubevirt.io/v1alpha1", "kind": "MigrationPolicy",
            "metadata": {"name": "none"}, "spec": {},
        }))
        .unwrap();
        assert_eq!(name(match_policy([&no_selectors], Some(&vmi), &ns)), None);
    }

    #[test]
    fn a_policy_overrides_what_it_sets() {
        let base = MigrationConfiguration::default().effective();
        let spec: MigrationPolicySpec = serde_json::from_value(json!({
            "allowPostCopy": true, "bandwidthPerMigration": "64Mi", "completionTimeoutPerGiB": 10,
        }))
        .unwrap();
        let out = spec.apply(&base);
        assert_eq!(out.allow_post_copy, Some(true));
        assert_eq!(
            out.allow_workload_disruption,
            Some(true),
            "follows allowPostCopy"
        );
        assert_eq!(out.bandwidth_bytes(), Some(64 << 20));
        assert_eq!(out.completion_timeout_per_gib, Some(10));
        assert_eq!(out.allow_auto_converge, Some(false), "the cluster's");
        assert_eq!(out.progress_timeout, Some(150));
    }

    #[test]
    fn refusals_name_their_field() {
        let p: MigrationPolicy = serde_json::from_value(json!({
            "apiVersion": "migrations.kubevirt.io/v1alpha1", "kind": "MigrationPolicy",
            "metadata": {"name": "p"},
            "spec": {"completionTimeoutPerGiB": -1, "bandwidthPerMigration": "-1Mi",
                     "maxDowntimeMs": 300, "experimental": {"compression": true}},
        }))
        .unwrap();
        let fields: Vec<String> = validate(&p).into_iter().map(|e| e.path).collect();
        assert_eq!(
            fields,
            [
                "spec.completionTimeoutPerGiB",
                "spec.bandwidthPerMigration",
                "spec.maxDowntimeMs",
                "spec.experimental"
            ]
        );
        assert!(validate(&policy("ok", &[("a", "b")], &[])).is_empty());
    }
}
