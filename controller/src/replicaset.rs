//! The ReplicaSet controller's decisions as pure functions (KubeVirt's `VMIReplicaSet`:
//! `execute`, `scale`, `updateStatus`).

use std::collections::BTreeMap;

use api::common::ConditionStatus;
use api::status::VirtualMachineInstanceConditionType;
use api::{
    VirtualMachineInstance, VirtualMachineInstancePhase, VirtualMachineInstanceReplicaSet,
    VirtualMachineInstanceReplicaSetStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::Resource;
use kube::core::{Selector, SelectorExt as _};

use crate::vmi::{is_final, phase_of};

/// Most creates or deletes one sync issues (KubeVirt's `BurstReplicas`).
pub const BURST_REPLICAS: usize = 250;

/// What one sync of a ReplicaSet does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scale {
    /// Nothing to create or delete.
    None,
    /// Create this many VMIs.
    Create(usize),
    /// Delete these VMIs (by name), least far along first.
    Delete(Vec<String>),
}

/// The selector as kube's [`Selector`]; one the API server would refuse (an unknown operator,
/// `In` or `NotIn` without values) is `None` and selects nothing.
fn parse_selector(selector: &LabelSelector) -> Option<Selector> {
    Selector::try_from(selector.clone()).ok()
}

fn labels_match(selector: Option<&Selector>, labels: Option<&BTreeMap<String, String>>) -> bool {
    let empty = BTreeMap::new();
    selector.is_some_and(|s| s.matches(labels.unwrap_or(&empty)))
}

/// Whether `labels` satisfy `selector` (matchLabels and matchExpressions).
pub fn selector_matches(
    selector: &LabelSelector,
    labels: Option<&BTreeMap<String, String>>,
) -> bool {
    labels_match(parse_selector(selector).as_ref(), labels)
}

/// The selector in its string form, for the scale subresource (`a=b,c in (d)`); empty for one
/// that does not parse.
pub fn selector_string(selector: &LabelSelector) -> String {
    parse_selector(selector)
        .map(|s| s.to_string())
        .unwrap_or_default()
}

fn controlled_by(meta: &ObjectMeta, owner: &ObjectMeta) -> bool {
    let Some(uid) = owner.uid.as_deref() else {
        return false;
    };
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// The VMIs `rs` manages: controlled by it and matching its selector.
pub fn owned<'a>(
    rs: &VirtualMachineInstanceReplicaSet,
    vmis: &'a [VirtualMachineInstance],
) -> Vec<&'a VirtualMachineInstance> {
    owned_by(&rs.metadata, &rs.spec.selector, vmis)
}

/// The objects the owner with `owner` metadata and `selector` manages: controlled by it and
/// matching the selector (a ReplicaSet's VMIs, a pool's VMs).
pub fn owned_by<'a, K: Resource>(
    owner: &ObjectMeta,
    selector: &LabelSelector,
    objs: &'a [K],
) -> Vec<&'a K> {
    let selector = parse_selector(selector);
    objs.iter()
        .filter(|o| controlled_by(o.meta(), owner))
        .filter(|o| labels_match(selector.as_ref(), o.meta().labels.as_ref()))
        .collect()
}

fn is_ready(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .as_ref()
        .and_then(|s| s.condition(&VirtualMachineInstanceConditionType::Ready))
        .is_some_and(|c| c.status == ConditionStatus::True)
}

fn active(vmi: &VirtualMachineInstance) -> bool {
    vmi.metadata.deletion_timestamp.is_none() && !is_final(vmi)
}

/// Objects whose ownership changes (KubeVirt's controller-ref manager): orphans matching the
/// selector are adopted, controlled ones that no longer match are released.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claims {
    /// Names of orphans to adopt.
    pub adopt: Vec<String>,
    /// Names of objects to release.
    pub release: Vec<String>,
}

/// The ownership changes `rs` makes among `vmis` (all in its namespace). A ReplicaSet being
/// deleted adopts nothing.
pub fn claims(rs: &VirtualMachineInstanceReplicaSet, vmis: &[VirtualMachineInstance]) -> Claims {
    claims_of(&rs.metadata, &rs.spec.selector, vmis, true)
}

/// The ownership changes of the owner with `owner` metadata and `selector` among `objs`;
/// orphans are adopted only when `adopt` (a pool only releases, as KubeVirt's
/// `ReleaseDetachedVirtualMachines`).
pub fn claims_of<K: Resource>(
    owner: &ObjectMeta,
    selector: &LabelSelector,
    objs: &[K],
    adopt: bool,
) -> Claims {
    let mut out = Claims::default();
    let selector = parse_selector(selector);
    for o in objs {
        let meta = o.meta();
        let matches = labels_match(selector.as_ref(), meta.labels.as_ref());
        let has_controller = meta
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.controller == Some(true));
        let name = meta.name.clone().unwrap_or_default();
        if controlled_by(meta, owner) && !matches {
            out.release.push(name);
        } else if adopt
            && !has_controller
            && matches
            && meta.deletion_timestamp.is_none()
            && owner.deletion_timestamp.is_none()
        {
            out.adopt.push(name);
        }
    }
    out
}

/// A controller owner reference pointing at `rs`.
pub fn controller_ref(rs: &VirtualMachineInstanceReplicaSet) -> OwnerReference {
    OwnerReference {
        api_version: "kubevirt.io/v1".into(),
        kind: "VirtualMachineInstanceReplicaSet".into(),
        name: rs.metadata.name.clone().unwrap_or_default(),
        uid: rs.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// Finished VMIs the ReplicaSet removes so they can be replaced (KubeVirt's
/// `cleanFinishedVmis`).
pub fn finished(owned: &[&VirtualMachineInstance]) -> Vec<String> {
    owned
        .iter()
        .filter(|v| v.metadata.deletion_timestamp.is_none() && is_final(v))
        .filter_map(|v| v.metadata.name.clone())
        .collect()
}

/// How far a VMI got: deleting the least advanced first costs the least work.
fn progress(vmi: &VirtualMachineInstance) -> (u8, bool) {
    let p = match phase_of(vmi) {
        None | Some(VirtualMachineInstancePhase::Pending) => 0,
        Some(VirtualMachineInstancePhase::Scheduling) => 1,
        Some(VirtualMachineInstancePhase::Scheduled) => 2,
        _ => 3,
    };
    (p, is_ready(vmi))
}

/// Scale decision for `rs` (unpaused) given the VMIs it owns.
pub fn scale(rs: &VirtualMachineInstanceReplicaSet, owned: &[&VirtualMachineInstance]) -> Scale {
    let want = usize::try_from(rs.spec.replicas.unwrap_or(1).max(0)).unwrap_or(0);
    let mut live: Vec<&VirtualMachineInstance> =
        owned.iter().copied().filter(|v| active(v)).collect();
    match live.len().cmp(&want) {
        std::cmp::Ordering::Equal => Scale::None,
        std::cmp::Ordering::Less => Scale::Create((want - live.len()).min(BURST_REPLICAS)),
        std::cmp::Ordering::Greater => {
            // Least advanced first; among equals, the newest (its name is the tie-break).
            live.sort_by(|a, b| {
                progress(a).cmp(&progress(b)).then_with(|| {
                    b.metadata
                        .creation_timestamp
                        .cmp(&a.metadata.creation_timestamp)
                        .then_with(|| a.metadata.name.cmp(&b.metadata.name))
                })
            });
            let n = (live.len() - want).min(BURST_REPLICAS);
            Scale::Delete(
                live.iter()
                    .take(n)
                    .filter_map(|v| v.metadata.name.clone())
                    .collect(),
            )
        }
    }
}

/// The status after a sync: replicas, ready replicas, selector and the paused condition.
pub fn next_status(
    rs: &VirtualMachineInstanceReplicaSet,
    owned: &[&VirtualMachineInstance],
    now: k8s_openapi::jiff::Timestamp,
) -> VirtualMachineInstanceReplicaSetStatus {
    use api::replicaset::{
        VirtualMachineInstanceReplicaSetCondition as C,
        VirtualMachineInstanceReplicaSetConditionType as T,
    };
    let mut status = rs.status.clone().unwrap_or_default();
    let live: Vec<_> = owned.iter().filter(|v| active(v)).collect();
    status.replicas = Some(i32::try_from(live.len()).unwrap_or(i32::MAX));
    status.ready_replicas =
        Some(i32::try_from(live.iter().filter(|v| is_ready(v)).count()).unwrap_or(i32::MAX));
    status.label_selector = Some(selector_string(&rs.spec.selector));
    let paused = rs.spec.paused == Some(true);
    let has = status
        .conditions
        .iter()
        .any(|c| c.type_ == T::ReplicaPaused);
    if paused && !has {
        status.conditions.push(C {
            type_: T::ReplicaPaused,
            status: ConditionStatus::True,
            last_probe_time: None,
            last_transition_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(now)),
            reason: Some("Paused".into()),
            message: Some("Replica set is paused".into()),
        });
    } else if !paused {
        status.conditions.retain(|c| c.type_ != T::ReplicaPaused);
    }
    status
}

/// A new VMI from the template: `generateName` `<rs>`, the template's labels and
/// annotations, a controller owner reference.
pub fn vmi_from_template(rs: &VirtualMachineInstanceReplicaSet) -> VirtualMachineInstance {
    let t = rs.spec.template.metadata.clone().unwrap_or_default();
    VirtualMachineInstance {
        metadata: ObjectMeta {
            generate_name: rs.metadata.name.clone(),
            namespace: rs.metadata.namespace.clone(),
            labels: t.labels,
            annotations: t.annotations,
            owner_references: Some(vec![controller_ref(rs)]),
            ..ObjectMeta::default()
        },
        spec: rs.spec.template.spec.clone().unwrap_or_default(),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::VirtualMachineInstanceReplicaSetSpec;
    use api::status::VirtualMachineInstanceCondition;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelectorRequirement, Time};
    use k8s_openapi::jiff::Timestamp;
    use pretty_assertions::assert_eq;

    fn rs(replicas: i32) -> VirtualMachineInstanceReplicaSet {
        let mut rs = VirtualMachineInstanceReplicaSet::new(
            "rs",
            VirtualMachineInstanceReplicaSetSpec {
                replicas: Some(replicas),
                selector: LabelSelector {
                    match_labels: Some([("app".to_owned(), "x".to_owned())].into()),
                    ..LabelSelector::default()
                },
                ..Default::default()
            },
        );
        rs.metadata.uid = Some("rs-uid".into());
        rs
    }

    fn vmi(
        name: &str,
        phase: Option<VirtualMachineInstancePhase>,
        ready: bool,
    ) -> VirtualMachineInstance {
        let mut v = vmi_from_template(&rs(1));
        v.metadata.name = Some(name.into());
        v.metadata.labels = Some([("app".to_owned(), "x".to_owned())].into());
        let mut st = api::VirtualMachineInstanceStatus {
            phase,
            ..Default::default()
        };
        if ready {
            st.conditions.push(VirtualMachineInstanceCondition {
                type_: VirtualMachineInstanceConditionType::Ready,
                status: ConditionStatus::True,
                last_probe_time: None,
                last_transition_time: None,
                reason: None,
                message: None,
            });
        }
        v.status = Some(st);
        v
    }

    use VirtualMachineInstancePhase as Ph;

    #[test]
    fn scale_table() {
        let r = rs(2);
        let a = vmi("a", Some(Ph::Running), true);
        let b = vmi("b", Some(Ph::Scheduling), false);
        let c = vmi("c", None, false);
        let done = vmi("d", Some(Ph::Succeeded), false);
        let mut gone = vmi("e", Some(Ph::Running), false);
        gone.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert_eq!(scale(&r, &[]), Scale::Create(2));
        assert_eq!(scale(&r, &[&a]), Scale::Create(1));
        assert_eq!(
            scale(&r, &[&a, &done, &gone]),
            Scale::Create(1),
            "final and deleting do not count"
        );
        assert_eq!(scale(&r, &[&a, &b]), Scale::None);
        assert_eq!(scale(&r, &[&a, &b, &c]), Scale::Delete(vec!["c".into()]));
        assert_eq!(
            scale(&rs(0), &[&a, &b, &c]),
            Scale::Delete(vec!["c".into(), "b".into(), "a".into()])
        );
        assert_eq!(scale(&rs(1000), &[]), Scale::Create(BURST_REPLICAS));
        assert_eq!(finished(&[&a, &done, &gone]), vec!["d".to_owned()]);
    }

    #[test]
    fn owned_needs_controller_ref_and_selector() {
        let r = rs(1);
        let mine = vmi("a", None, false);
        let mut foreign = vmi("b", None, false);
        foreign.metadata.owner_references = None;
        let mut relabelled = vmi("c", None, false);
        relabelled.metadata.labels = Some([("app".to_owned(), "y".to_owned())].into());
        let all = [mine, foreign, relabelled];
        let names: Vec<_> = owned(&r, &all)
            .iter()
            .map(|v| v.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["a"]);
    }

    #[test]
    #[allow(clippy::many_single_char_names)]
    fn status_counts_and_paused_condition() {
        let mut r = rs(3);
        r.spec.paused = Some(true);
        let a = vmi("a", Some(Ph::Running), true);
        let b = vmi("b", Some(Ph::Scheduled), false);
        let d = vmi("d", Some(Ph::Failed), false);
        let s = next_status(&r, &[&a, &b, &d], Timestamp::now());
        assert_eq!((s.replicas, s.ready_replicas), (Some(2), Some(1)));
        assert_eq!(s.label_selector.as_deref(), Some("app=x"));
        assert_eq!(s.conditions.len(), 1);
        r.status = Some(s);
        r.spec.paused = None;
        assert!(next_status(&r, &[], Timestamp::now()).conditions.is_empty());
    }

    #[test]
    fn claims_adopt_matching_orphans_and_release_mismatches() {
        let r = rs(1);
        let mut orphan = vmi("orphan", None, false);
        orphan.metadata.owner_references = None;
        let mut foreign_orphan = vmi("other-app", None, false);
        foreign_orphan.metadata.owner_references = None;
        foreign_orphan.metadata.labels = Some([("app".to_owned(), "y".to_owned())].into());
        let mut relabelled = vmi("relabelled", None, false);
        relabelled.metadata.labels = None;
        let mut someone_elses = vmi("taken", None, false);
        someone_elses.metadata.owner_references.as_mut().unwrap()[0].uid = "other-rs".into();
        let mine = vmi("mine", None, false);
        let all = vec![orphan, foreign_orphan, relabelled, someone_elses, mine];
        let c = claims(&r, &all);
        assert_eq!(c.adopt, ["orphan"]);
        assert_eq!(c.release, ["relabelled"]);
    }

    #[test]
    fn selector_expressions() {
        let sel = LabelSelector {
            match_expressions: Some(vec![
                LabelSelectorRequirement {
                    key: "tier".into(),
                    operator: "In".into(),
                    values: Some(vec!["a".into(), "b".into()]),
                },
                LabelSelectorRequirement {
                    key: "skip".into(),
                    operator: "DoesNotExist".into(),
                    values: None,
                },
            ]),
            ..LabelSelector::default()
        };
        let l = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert!(selector_matches(&sel, Some(&l(&[("tier", "a")]))));
        assert!(!selector_matches(&sel, Some(&l(&[("tier", "c")]))));
        assert!(!selector_matches(
            &sel,
            Some(&l(&[("tier", "a"), ("skip", "")]))
        ));
        assert_eq!(selector_string(&sel), "tier in (a,b),!skip");
    }
}
