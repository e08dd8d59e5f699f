//! The ReplicaSet controller's shell: claims (adopt / release), scaling by `replicaset::scale`,
//! and the status.

use std::sync::Arc;

use api::{VirtualMachineInstance, VirtualMachineInstanceReplicaSet};
use informer::{key_of, split_key, status_patch};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use serde_json::json;

use super::{Shared, event, retry_later};
use crate::{cache, events, replicaset};
use workqueue::Queue;
use workqueue::expectations::EXPECTATION_TTL;

pub(super) async fn sync_rs(s: &Shared, key: &str) {
    let (ns, name) = split_key(key);
    let Some(rs) = s.replicasets.get(&ObjectRef::new(name).within(ns)) else {
        s.rs_exp.delete(key);
        return;
    };
    if !s.rs_exp.satisfied(key) {
        s.rs_q.add_after(key, EXPECTATION_TTL);
        return;
    }
    let rs_api: Api<VirtualMachineInstanceReplicaSet> = Api::namespaced(s.client.clone(), ns);
    let vmi_api: Api<VirtualMachineInstance> = Api::namespaced(s.client.clone(), ns);
    let mut all: Vec<VirtualMachineInstance> = s
        .vmis
        .by_index(cache::VMI_BY_NAMESPACE.name, ns)
        .iter()
        .map(|v| (**v).clone())
        .collect();
    let claims = replicaset::claims(&rs, &all);
    let owner_ref = replicaset::controller_ref(&rs);
    let claimed_all = claim(
        &s.rs_q,
        key,
        &rs.metadata,
        &owner_ref,
        &claims,
        &mut all,
        &vmi_api,
    )
    .await;
    let owned = replicaset::owned(&rs, &all);
    // Scaling on a cache that may still show a VMI we failed to claim could overshoot.
    if claimed_all && rs.spec.paused != Some(true) && rs.metadata.deletion_timestamp.is_none() {
        Box::pin(scale(s, key, &rs, &owned, &vmi_api)).await;
    }
    let status = replicaset::next_status(&rs, &owned, Timestamp::now());
    if Some(&status) != rs.status.as_ref() {
        let old = rs.status.clone().unwrap_or_default();
        if let Err(e) = rs_api
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status_patch(&old, &status) })),
            )
            .await
        {
            retry_later(&s.rs_q, key, "updating the ReplicaSet status", &e);
        }
    }
}

/// Adopts and releases objects as `claims` says for the owner with metadata `owner` (its
/// controller reference `owner_ref`), updating `all` with what was written; false when a claim
/// failed, and the owner's `key` is queued again on `q`.
pub(super) async fn claim<K>(
    q: &Arc<Queue>,
    key: &str,
    owner: &ObjectMeta,
    owner_ref: &OwnerReference,
    claims: &replicaset::Claims,
    all: &mut [K],
    api: &Api<K>,
) -> bool
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut claimed_all = true;
    for (name, adopt) in claims
        .adopt
        .iter()
        .map(|n| (n, true))
        .chain(claims.release.iter().map(|n| (n, false)))
    {
        let Some(o) = all.iter().find(|o| o.meta().name.as_deref() == Some(name)) else {
            continue;
        };
        let mut refs: Vec<_> = o
            .meta()
            .owner_references
            .clone()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| Some(&r.uid) != owner.uid.as_ref())
            .collect();
        if adopt {
            refs.push(owner_ref.clone());
        }
        // The resourceVersion makes this a compare-and-swap against a concurrent claim.
        let patch = json!({"metadata": {"ownerReferences": refs, "resourceVersion": o.meta().resource_version}});
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(updated) => {
                if let Some(slot) = all
                    .iter_mut()
                    .find(|x| x.meta().name.as_deref() == Some(name))
                {
                    *slot = updated;
                }
            }
            Err(e) => {
                claimed_all = false;
                let what = if adopt { "adopting" } else { "releasing" };
                retry_later(q, key, what, &e);
            }
        }
    }
    claimed_all
}

/// Creates or deletes VMIs as `replicaset::scale` says, and deletes finished ones.
async fn scale(
    s: &Shared,
    key: &str,
    rs: &VirtualMachineInstanceReplicaSet,
    owned: &[&VirtualMachineInstance],
    vmi_api: &Api<VirtualMachineInstance>,
) {
    let mut delete = replicaset::finished(owned);
    match replicaset::scale(rs, owned) {
        replicaset::Scale::None => {}
        replicaset::Scale::Delete(names) => delete.extend(names),
        replicaset::Scale::Create(n) => {
            s.rs_exp
                .expect_creations(key, i64::try_from(n).unwrap_or(i64::MAX));
            let template = replicaset::vmi_from_template(rs);
            for _ in 0..n {
                match vmi_api.create(&PostParams::default(), &template).await {
                    Ok(v) => {
                        event(
                            s,
                            rs,
                            false,
                            events::SUCCESSFUL_CREATE_VMI,
                            format!("Created virtual machine instance: {}", v.name_any()),
                        )
                        .await;
                    }
                    Err(e) => {
                        s.rs_exp.creation_observed(key);
                        event(
                            s,
                            rs,
                            true,
                            events::FAILED_CREATE_VMI,
                            format!("Error creating VMI: {e}"),
                        )
                        .await;
                        retry_later(&s.rs_q, key, "creating a VMI", &e);
                    }
                }
            }
        }
    }
    if delete.is_empty() {
        return;
    }
    let ns = rs.namespace();
    let keys: Vec<String> = delete.iter().map(|n| key_of(ns.as_deref(), n)).collect();
    s.rs_exp.expect_deletions(key, &keys);
    for (n, k) in delete.iter().zip(&keys) {
        match vmi_api.delete(n, &DeleteParams::default()).await {
            Ok(_) => {
                event(
                    s,
                    rs,
                    false,
                    events::SUCCESSFUL_DELETE_VMI,
                    format!("Deleted virtual machine instance: {n}"),
                )
                .await;
            }
            Err(e) => {
                s.rs_exp.deletion_observed(key, k);
                retry_later(&s.rs_q, key, "deleting a VMI", &e);
            }
        }
    }
}
