//! The evacuation controller's shell: keyed by node; a node change, a change of a VMI on the
//! node, or of a migration of such a VMI queues the node; the sync feeds
//! `evacuation::select` from the caches and creates the migrations it picks. Expectations,
//! keyed by node, are observed when a migration annotated for the node appears in the
//! migration cache, so a sync from a stale cache never creates a second migration.

use api::VirtualMachineInstance;
use api::migration::VirtualMachineInstanceMigration;
use informer::{key_of, split_key};
use kube::ResourceExt as _;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::ObjectRef;
use workqueue::Queue;
use workqueue::expectations::{EXPECTATION_TTL, UidTrackingExpectations};

use super::{Shared, cluster_config, event, lock, retry_later};
use crate::cache;
use crate::evacuation::{self, Candidate};

/// A VMI changed: its node is looked at.
pub(super) fn vmi_changed(q: &Queue, vmi: &VirtualMachineInstance) {
    if let Some(node) = vmi
        .status
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
    {
        q.add(node);
    }
}

/// A migration appeared or changed: an evacuation migration's creation is observed for its
/// node, which is queued (a failed one is retried).
pub(super) fn migration_changed(
    q: &Queue,
    exp: &UidTrackingExpectations,
    m: &VirtualMachineInstanceMigration,
    added: bool,
) {
    if let Some(node) = evacuation::evacuated_node(m) {
        if added {
            exp.creation_observed(node);
        }
        q.add(node);
    }
}

pub(super) async fn sync_node(s: &Shared, name: &str) {
    let Some(node) = s.nodes.get(&ObjectRef::new(name)) else {
        s.evac_exp.delete(name);
        return;
    };
    if !s.evac_exp.satisfied(name) {
        s.evac_q.add_after(name, EXPECTATION_TTL);
        return;
    }
    let cfg = cluster_config(s);
    let leaving: Vec<_> = s
        .vmis
        .by_index(cache::VMI_BY_NODE.name, name)
        .into_iter()
        .filter(|v| evacuation::asked_to_leave(&node, v, &cfg))
        .collect();
    if leaving.is_empty() {
        return;
    }
    let candidates: Vec<Candidate<'_>> = leaving
        .iter()
        .map(|v| Candidate {
            vmi: v,
            unfinished_migration: has_unfinished_migration(s, v),
            active_pods: active_pods(s, v),
        })
        .collect();
    let chosen = evacuation::select(&node, &candidates, &cfg);
    if chosen.is_empty() {
        return;
    }
    tracing::info!(node = name, vmis = chosen.len(), "evacuating");
    s.evac_exp.expect_creations(
        name,
        i64::try_from(chosen.len()).expect("fewer VMIs than i64::MAX"),
    );
    for vmi in chosen {
        let m = evacuation::evacuation_migration(vmi, name);
        let api: Api<VirtualMachineInstanceMigration> =
            Api::namespaced(s.client.clone(), &vmi.namespace().unwrap_or_default());
        match api.create(&PostParams::default(), &m).await {
            Ok(created) => {
                event(
                    s,
                    vmi,
                    false,
                    evacuation::SUCCESSFUL_CREATE,
                    format!("Created Migration {}", created.name_any()),
                )
                .await;
            }
            Err(e) => {
                s.evac_exp.creation_observed(name);
                event(
                    s,
                    vmi,
                    true,
                    evacuation::FAILED_CREATE,
                    format!("Error creating a Migration: {e}"),
                )
                .await;
                retry_later(&s.evac_q, name, "creating an evacuation migration", &e);
            }
        }
    }
}

/// A migration of `vmi` (the migration controller's index) that is not Succeeded or Failed.
fn has_unfinished_migration(s: &Shared, vmi: &VirtualMachineInstance) -> bool {
    let key = key_of(vmi.namespace().as_deref(), &vmi.name_any());
    lock(&s.mig_index).of_vmi(&key).iter().any(|k| {
        let (ns, name) = split_key(k);
        s.vmims
            .get(&ObjectRef::new(name).within(ns))
            .is_some_and(|m| !crate::migration::is_final(&m))
    })
}

/// The VMI's launcher pods (its controller owner) that are not Succeeded or Failed.
fn active_pods(s: &Shared, vmi: &VirtualMachineInstance) -> usize {
    let key = key_of(vmi.namespace().as_deref(), &vmi.name_any());
    s.pods
        .by_index(cache::POD_BY_VMI.name, &key)
        .iter()
        .filter(|p| evacuation::is_active_pod(p))
        .count()
}
