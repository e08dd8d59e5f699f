//! The VirtualMachinePool controller's decisions as pure functions (KubeVirt's
//! `pkg/virt-controller/watch/pool/pool.go`): VM names `<pool>-<index>`, lowest free index
//! first; scale-in order; the pool's spec snapshotted in a ControllerRevision `<pool>-<generation>`
//! whose name labels each VM and, through the VM's template, its VMI; outdated VMs rewritten
//! from the new template, and their running VMIs restarted (proactive, the default) or left to
//! take it on their next start (opportunistic).

use std::collections::BTreeMap;

use api::common::ConditionStatus;
use api::pool::{
    FINALIZER, REVISION_NAME_LABEL, SortPolicy, VirtualMachinePool, VirtualMachinePoolSpec,
    VirtualMachinePoolStatus,
};
use api::status::VirtualMachineInstanceConditionType;
use api::vm::VirtualMachineConditionType;
use api::{
    VirtualMachine, VirtualMachineInstance, VirtualMachineInstancePhase, VirtualMachineSpec,
};
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kube::Resource as _;

use crate::replicaset::selector_string;

/// Most creates or deletes one sync issues (KubeVirt's `BurstReplicas`).
pub use crate::replicaset::BURST_REPLICAS;

/// KubeVirt's `generateVMName`.
pub fn vm_name(pool: &str, index: u64) -> String {
    format!("{pool}-{index}")
}

/// The index a VM name ends in (KubeVirt's `indexFromName`).
pub fn index_from_name(name: &str) -> Option<u64> {
    name.rsplit('-').next()?.parse().ok()
}

/// `count` names `<pool>-<i>` not `taken`, lowest indexes first (KubeVirt's
/// `calculateNewVMNames`, which checks every VM of the namespace, the pool's or not).
pub fn new_names(pool: &str, count: usize, taken: impl Fn(&str) -> bool) -> Vec<String> {
    (0..)
        .map(|i| vm_name(pool, i))
        .filter(|n| !taken(n))
        .take(count)
        .collect()
}

/// The ControllerRevision of the pool's current spec (KubeVirt's `getRevisionName`).
pub fn revision_name(pool: &VirtualMachinePool) -> String {
    format!(
        "{}-{}",
        pool.metadata.name.as_deref().unwrap_or_default(),
        pool.metadata.generation.unwrap_or_default()
    )
}

/// The snapshot of the pool's spec a revision holds (KubeVirt stores the spec's JSON).
pub fn revision(pool: &VirtualMachinePool) -> ControllerRevision {
    ControllerRevision {
        metadata: ObjectMeta {
            name: Some(revision_name(pool)),
            namespace: pool.metadata.namespace.clone(),
            owner_references: pool.controller_owner_ref(&()).map(|r| vec![r]),
            ..ObjectMeta::default()
        },
        data: RawExtension(serde_json::to_value(&pool.spec).unwrap_or_default()),
        revision: Some(pool.metadata.generation.unwrap_or_default()),
    }
}

/// The pool spec a revision holds; `None` for one that does not decode.
pub fn revision_spec(rev: &ControllerRevision) -> Option<VirtualMachinePoolSpec> {
    serde_json::from_value(rev.data.0.clone()).ok()
}

/// The template's VM spec for the VM of index `idx`: with `nameGeneration`, its config volumes
/// name `<name>-<idx>` (KubeVirt's `indexVMSpec`; data volume templates are refused).
pub fn index_vm_spec(spec: &VirtualMachinePoolSpec, idx: u64) -> VirtualMachineSpec {
    let mut vm = spec.virtual_machine_template.spec.clone();
    let naming = spec.name_generation.clone().unwrap_or_default();
    let config_maps = naming.append_index_to_config_map_refs == Some(true);
    let secrets = naming.append_index_to_secret_refs == Some(true);
    let suffix = format!("-{idx}");
    let append = |name: &mut Option<String>| {
        if let Some(n) = name {
            n.push_str(&suffix);
        }
    };
    for v in vm
        .template
        .spec
        .iter_mut()
        .flat_map(|s| s.volumes.iter_mut())
    {
        if let Some(cm) = v.config_map.as_mut().filter(|_| config_maps) {
            append(&mut cm.name);
        } else if let Some(s) = v.secret.as_mut().filter(|_| secrets) {
            append(&mut s.secret_name);
        } else if secrets {
            let refs = [
                v.cloud_init_no_cloud.as_mut().map(|c| {
                    [
                        c.user_data_secret_ref.as_mut(),
                        c.network_data_secret_ref.as_mut(),
                    ]
                }),
                v.cloud_init_config_drive.as_mut().map(|c| {
                    [
                        c.user_data_secret_ref.as_mut(),
                        c.network_data_secret_ref.as_mut(),
                    ]
                }),
            ];
            for r in refs.into_iter().flatten().flatten().flatten() {
                r.name.push_str(&suffix);
            }
        }
    }
    vm
}

/// The VM of index `idx` as the pool's template makes it: the template's labels and
/// annotations, the revision label on the VM and its VMI template, the pool's finalizer and
/// controller reference (KubeVirt's `scaleOut`).
pub fn new_vm(pool: &VirtualMachinePool, name: &str, revision: &str) -> VirtualMachine {
    let idx = index_from_name(name).unwrap_or_default();
    let t = pool
        .spec
        .virtual_machine_template
        .metadata
        .clone()
        .unwrap_or_default();
    let mut vm = VirtualMachine::new(name, index_vm_spec(&pool.spec, idx));
    vm.metadata.namespace.clone_from(&pool.metadata.namespace);
    vm.metadata.labels = t.labels;
    vm.metadata.annotations = t.annotations;
    vm.metadata.finalizers = Some(vec![FINALIZER.to_owned()]);
    vm.metadata.owner_references = pool.controller_owner_ref(&()).map(|r| vec![r]);
    label_revision(&mut vm, revision);
    vm
}

fn label_revision(vm: &mut VirtualMachine, revision: &str) {
    vm.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(REVISION_NAME_LABEL.to_owned(), revision.to_owned());
    vm.spec
        .template
        .metadata
        .get_or_insert_with(ObjectMeta::default)
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(REVISION_NAME_LABEL.to_owned(), revision.to_owned());
}

/// `vm` brought to the pool's template (KubeVirt's `opportunisticUpdate`): labels, annotations
/// and spec from the template, the revision label, and the firmware UUID and serial it was
/// given at creation kept, since they identify the machine to its guest.
pub fn updated_vm(
    pool: &VirtualMachinePool,
    vm: &VirtualMachine,
    revision: &str,
) -> VirtualMachine {
    let fresh = new_vm(
        pool,
        vm.metadata.name.as_deref().unwrap_or_default(),
        revision,
    );
    let mut out = vm.clone();
    out.metadata.labels = fresh.metadata.labels;
    out.metadata.annotations = fresh.metadata.annotations;
    out.spec = fresh.spec;
    let old_fw = vm
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|s| s.domain.firmware.as_ref());
    if let (Some(old_fw), Some(spec)) = (old_fw, out.spec.template.spec.as_mut()) {
        let fw = spec.domain.firmware.get_or_insert_with(Default::default);
        if old_fw.uuid.as_deref().is_some_and(|u| !u.is_empty()) {
            fw.uuid.clone_from(&old_fw.uuid);
        }
        if old_fw.serial.as_deref().is_some_and(|s| !s.is_empty()) {
            fw.serial.clone_from(&old_fw.serial);
        }
    }
    out
}

fn revision_label<K: kube::Resource>(o: &K) -> Option<&str> {
    o.meta()
        .labels
        .as_ref()?
        .get(REVISION_NAME_LABEL)
        .map(String::as_str)
}

/// Whether `vm` needs the pool's current template (KubeVirt's `isOutdatedVM`): no revision
/// label, a revision `revisions` does not know, or a revision whose VM template differs.
pub fn is_outdated_vm(
    pool: &VirtualMachinePool,
    vm: &VirtualMachine,
    revisions: &dyn Fn(&str) -> Option<VirtualMachinePoolSpec>,
) -> bool {
    revision_label(vm)
        .and_then(revisions)
        .is_none_or(|old| old.virtual_machine_template != pool.spec.virtual_machine_template)
}

/// What a proactive update does to a VM's running instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstanceUpdate {
    /// Nothing.
    None,
    /// Delete the VMI: its VM starts a new one from the new template.
    Restart,
    /// The VMI already runs what the VM's revision describes: relabel it with that revision.
    Relabel(String),
}

/// KubeVirt's `isOutdatedVMI`: compares the VMI template of the revision the VM was written
/// from with that of the revision the VMI was started from.
pub fn instance_update(
    vm: &VirtualMachine,
    vmi: &VirtualMachineInstance,
    revisions: &dyn Fn(&str) -> Option<VirtualMachinePoolSpec>,
) -> InstanceUpdate {
    // A VM without a revision gets one from the next opportunistic update.
    let Some(vm_rev) = revision_label(vm) else {
        return InstanceUpdate::None;
    };
    let Some(vmi_rev) = revision_label(vmi) else {
        return InstanceUpdate::Restart;
    };
    if vm_rev == vmi_rev {
        return InstanceUpdate::None;
    }
    // The VM's revision may not be in the cache yet: a later sync decides.
    let Some(expected) = revisions(vm_rev) else {
        return InstanceUpdate::None;
    };
    let Some(current) = revisions(vmi_rev) else {
        return InstanceUpdate::Restart;
    };
    if current.virtual_machine_template.spec.template
        == expected.virtual_machine_template.spec.template
    {
        InstanceUpdate::Relabel(vm_rev.to_owned())
    } else {
        InstanceUpdate::Restart
    }
}

/// A VM whose Ready condition is true (KubeVirt's `filterReadyVMs`).
pub fn vm_ready(vm: &VirtualMachine) -> bool {
    vm.status
        .as_ref()
        .and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == VirtualMachineConditionType::Ready)
        })
        .is_some_and(|c| c.status == ConditionStatus::True)
}

/// A VMI that counts as available during an update (KubeVirt's `isVMIReady`).
pub fn vmi_available(vmi: &VirtualMachineInstance) -> bool {
    vmi.metadata.deletion_timestamp.is_none()
        && crate::vmi::phase_of(vmi) == Some(VirtualMachineInstancePhase::Running)
        && vmi
            .status
            .as_ref()
            .and_then(|s| s.condition(&VirtualMachineInstanceConditionType::Ready))
            .is_some_and(|c| c.status == ConditionStatus::True)
}

/// Orders `vms` for scale-in or an update; `rng` draws the `Random` order.
pub fn sort_vms(vms: &mut [&VirtualMachine], policy: &SortPolicy, rng: &mut fastrand::Rng) {
    let created = |v: &&VirtualMachine| v.metadata.creation_timestamp.clone();
    let index = |v: &&VirtualMachine| {
        v.metadata
            .name
            .as_deref()
            .and_then(index_from_name)
            .unwrap_or_default()
    };
    match policy {
        SortPolicy::AscendingOrder => vms.sort_by_key(index),
        SortPolicy::DescendingOrder => vms.sort_by_key(|v| std::cmp::Reverse(index(v))),
        SortPolicy::Newest => vms.sort_by_key(|v| std::cmp::Reverse(created(v))),
        SortPolicy::Oldest => vms.sort_by_key(created),
        // Validation refuses unknown policies; KubeVirt takes any other as Random.
        SortPolicy::Random | SortPolicy::Other(_) => rng.shuffle(vms),
    }
}

/// What one sync's scaling does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scale {
    /// At the wanted count.
    Stable,
    /// Create this many VMs.
    Create(usize),
    /// Delete these VMs (by name).
    Delete(Vec<String>),
    /// Too many VMs, but none to delete now (being deleted already, or scale-in unmanaged).
    Waiting,
}

/// KubeVirt's `scale`: VMs being deleted count, so scale-in only deletes what they do not
/// already make up for.
pub fn scale(pool: &VirtualMachinePool, vms: &[&VirtualMachine], rng: &mut fastrand::Rng) -> Scale {
    let want = usize::try_from(pool.spec.wanted().max(0)).unwrap_or(0);
    match vms.len().cmp(&want) {
        std::cmp::Ordering::Equal => Scale::Stable,
        std::cmp::Ordering::Less => Scale::Create((want - vms.len()).min(BURST_REPLICAS)),
        std::cmp::Ordering::Greater if !pool.spec.scales_in_proactively() => Scale::Waiting,
        std::cmp::Ordering::Greater => {
            let mut live: Vec<&VirtualMachine> = vms
                .iter()
                .copied()
                .filter(|v| v.metadata.deletion_timestamp.is_none())
                .collect();
            let deleting = vms.len() - live.len();
            let n = (vms.len() - want)
                .min(BURST_REPLICAS)
                .saturating_sub(deleting)
                .min(live.len());
            if n == 0 {
                return Scale::Waiting;
            }
            sort_vms(&mut live, &pool.spec.scale_in_order(), rng);
            Scale::Delete(
                live.iter()
                    .take(n)
                    .filter_map(|v| v.metadata.name.clone())
                    .collect(),
            )
        }
    }
}

/// VMs being deleted that still hold the pool's finalizer: the pool lets them go (KubeVirt's
/// `opportunisticScaleIn` and the cleanup after a proactive delete).
pub fn releasable(pool: &VirtualMachinePool, vms: &[&VirtualMachine]) -> Vec<String> {
    if !pool.spec.releases_deleted_vms() {
        return Vec::new();
    }
    vms.iter()
        .filter(|v| v.metadata.deletion_timestamp.is_some() && has_finalizer(&v.metadata))
        .filter_map(|v| v.metadata.name.clone())
        .collect()
}

/// Whether the pool's finalizer is on `meta`.
pub fn has_finalizer(meta: &ObjectMeta) -> bool {
    meta.finalizers.iter().flatten().any(|f| f == FINALIZER)
}

/// The status after a sync (KubeVirt's `updateStatus`): every VM of the pool counts,
/// including those being deleted; ready ones by their Ready condition.
pub fn next_status(
    pool: &VirtualMachinePool,
    vms: &[&VirtualMachine],
    sync_error: Option<(&str, &str)>,
    now: k8s_openapi::jiff::Timestamp,
) -> VirtualMachinePoolStatus {
    use api::pool::{VirtualMachinePoolCondition as C, VirtualMachinePoolConditionType as T};
    let mut status = pool.status.clone().unwrap_or_default();
    status.label_selector = Some(selector_string(&pool.spec.selector));
    status.replicas = Some(i32::try_from(vms.len()).unwrap_or(i32::MAX));
    status.ready_replicas =
        Some(i32::try_from(vms.iter().filter(|v| vm_ready(v)).count()).unwrap_or(i32::MAX));
    let has = |s: &VirtualMachinePoolStatus, t: &T| s.conditions.iter().any(|c| c.type_ == *t);
    let condition = |type_, reason: &str, message: &str| C {
        type_,
        status: ConditionStatus::True,
        last_probe_time: None,
        last_transition_time: Some(Time(now)),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
    };
    match sync_error {
        Some((reason, message)) if !has(&status, &T::ReplicaFailure) => status
            .conditions
            .push(condition(T::ReplicaFailure, reason, message)),
        None => status.conditions.retain(|c| c.type_ != T::ReplicaFailure),
        Some(_) => {}
    }
    let paused = pool.spec.paused == Some(true);
    if paused && !has(&status, &T::ReplicaPaused) {
        status.conditions.push(condition(
            T::ReplicaPaused,
            crate::events::SUCCESSFUL_PAUSED_POOL,
            "Pool controller is paused",
        ));
    } else if !paused {
        status.conditions.retain(|c| c.type_ != T::ReplicaPaused);
    }
    status
}

/// The pool's revisions no VM or VMI of it is labelled with (KubeVirt's
/// `pruneUnusedRevisions`).
pub fn unused_revisions<'a>(
    revisions: impl IntoIterator<Item = &'a str>,
    vms: &[&VirtualMachine],
    vmis: &[&VirtualMachineInstance],
) -> Vec<String> {
    let used: Vec<&str> = vms
        .iter()
        .filter_map(|v| revision_label(*v))
        .chain(vmis.iter().filter_map(|v| revision_label(*v)))
        .collect();
    revisions
        .into_iter()
        .filter(|r| !used.contains(r))
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::pool::SortPolicy;
    use k8s_openapi::jiff::Timestamp;
    use pretty_assertions::assert_eq;
    use serde_json::json;

    fn pool(replicas: i32, extra: &serde_json::Value) -> VirtualMachinePool {
        let mut spec = json!({
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "p"}},
            "virtualMachineTemplate": {
                "metadata": {"labels": {"app": "p"}, "annotations": {"a": "b"}},
                "spec": {"runStrategy": "Always", "template": {
                    "metadata": {"labels": {"app": "p"}},
                    "spec": {"domain": {"devices": {}}, "volumes": [
                        {"name": "cm", "configMap": {"name": "conf"}},
                        {"name": "s", "secret": {"secretName": "sec"}},
                        {"name": "ci", "cloudInitNoCloud": {"secretRef": {"name": "ud"}}}
                    ]}}},
            },
        });
        if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
            s.extend(e.clone());
        }
        let mut p: VirtualMachinePool = serde_json::from_value(json!({
            "apiVersion": "pool.kubevirt.io/v1beta1", "kind": "VirtualMachinePool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "pool-uid", "generation": 2},
            "spec": spec,
        }))
        .unwrap();
        p.metadata.uid = Some("pool-uid".into());
        p
    }

    fn vm(p: &VirtualMachinePool, name: &str, created: i64) -> VirtualMachine {
        let mut v = new_vm(p, name, &revision_name(p));
        v.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created).unwrap()));
        v
    }

    fn names(s: &Scale) -> Vec<String> {
        match s {
            Scale::Delete(n) => n.clone(),
            other => panic!("not a delete: {other:?}"),
        }
    }

    #[test]
    fn names_take_the_lowest_free_index() {
        let taken = ["p-0", "p-2", "other-1"];
        assert_eq!(
            new_names("p", 3, |n| taken.contains(&n)),
            ["p-1", "p-3", "p-4"]
        );
        assert_eq!(index_from_name("my-pool-12"), Some(12));
        assert_eq!(index_from_name("nope"), None);
    }

    #[test]
    fn a_new_vm_carries_labels_revision_finalizer_owner_and_indexed_names() {
        let mut p = pool(
            1,
            &json!({"nameGeneration": {
            "appendIndexToConfigMapRefs": true, "appendIndexToSecretRefs": true}}),
        );
        let v = new_vm(&p, "p-7", &revision_name(&p));
        assert_eq!(revision_name(&p), "p-2");
        let labels = v.metadata.labels.clone().unwrap();
        assert_eq!(labels[REVISION_NAME_LABEL], "p-2");
        assert_eq!(labels["app"], "p");
        assert_eq!(v.metadata.annotations.clone().unwrap()["a"], "b");
        let tl = v.spec.template.metadata.clone().unwrap().labels.unwrap();
        assert_eq!(tl[REVISION_NAME_LABEL], "p-2");
        assert_eq!(v.metadata.finalizers.clone().unwrap(), [FINALIZER]);
        let owner = &v.metadata.owner_references.clone().unwrap()[0];
        assert_eq!(
            (
                owner.api_version.as_str(),
                owner.kind.as_str(),
                owner.uid.as_str(),
                owner.controller
            ),
            (
                "pool.kubevirt.io/v1beta1",
                "VirtualMachinePool",
                "pool-uid",
                Some(true)
            )
        );
        let vols = &v.spec.template.spec.as_ref().unwrap().volumes;
        assert_eq!(
            vols[0].config_map.as_ref().unwrap().name.as_deref(),
            Some("conf-7")
        );
        assert_eq!(
            vols[1].secret.as_ref().unwrap().secret_name.as_deref(),
            Some("sec-7")
        );
        assert_eq!(
            vols[2]
                .cloud_init_no_cloud
                .as_ref()
                .unwrap()
                .user_data_secret_ref
                .as_ref()
                .unwrap()
                .name,
            "ud-7"
        );
        p.spec.name_generation = None;
        let plain = new_vm(&p, "p-7", "r");
        let vols = &plain.spec.template.spec.as_ref().unwrap().volumes;
        assert_eq!(
            vols[0].config_map.as_ref().unwrap().name.as_deref(),
            Some("conf")
        );
    }

    #[test]
    fn scale_counts_deleting_vms_and_follows_the_sort_policy() {
        let mut rng = fastrand::Rng::with_seed(1);
        let p = pool(
            1,
            &json!({"scaleInStrategy": {"proactive": {"selectionPolicy": {"sortPolicy": "DescendingOrder"}}}}),
        );
        let (a, b, c) = (vm(&p, "p-0", 3), vm(&p, "p-1", 1), vm(&p, "p-2", 2));
        assert_eq!(scale(&p, &[&a], &mut rng), Scale::Stable);
        assert_eq!(
            scale(&pool(3, &json!({})), &[&a], &mut rng),
            Scale::Create(2)
        );
        assert_eq!(names(&scale(&p, &[&a, &b, &c], &mut rng)), ["p-2", "p-1"]);
        let mut gone = c.clone();
        gone.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert_eq!(names(&scale(&p, &[&a, &b, &gone], &mut rng)), ["p-1"]);
        assert_eq!(scale(&p, &[&a, &gone], &mut rng), Scale::Waiting);
        let oldest = pool(
            1,
            &json!({"scaleInStrategy": {"proactive": {"selectionPolicy": {"sortPolicy": "Oldest"}}}}),
        );
        assert_eq!(
            names(&scale(&oldest, &[&a, &b, &c], &mut rng)),
            ["p-1", "p-2"]
        );
        let unmanaged = pool(0, &json!({"scaleInStrategy": {"unmanaged": {}}}));
        assert_eq!(scale(&unmanaged, &[&a], &mut rng), Scale::Waiting);
        assert!(releasable(&unmanaged, &[&gone]).is_empty());
        assert_eq!(releasable(&p, &[&a, &gone]), ["p-2"]);
        // Random by default: every VM can go first.
        let random = pool(2, &json!({}));
        let mut first = std::collections::BTreeSet::new();
        for _ in 0..64 {
            first.extend(names(&scale(&random, &[&a, &b, &c], &mut rng)));
        }
        assert_eq!(first.len(), 3);
    }

    #[test]
    fn template_changes_make_vms_outdated_and_restart_their_instances() {
        let old = pool(1, &json!({}));
        let mut new = old.clone();
        new.metadata.generation = Some(3);
        new.spec
            .virtual_machine_template
            .spec
            .template
            .spec
            .as_mut()
            .unwrap()
            .domain
            .cpu = Some(api::vmi::Cpu {
            cores: Some(2),
            ..Default::default()
        });
        let revs: BTreeMap<String, VirtualMachinePoolSpec> = [
            (revision_name(&old), old.spec.clone()),
            (revision_name(&new), new.spec.clone()),
        ]
        .into();
        let lookup = |n: &str| revs.get(n).cloned();
        let v = vm(&old, "p-0", 1);
        assert!(!is_outdated_vm(&old, &v, &lookup));
        assert!(is_outdated_vm(&new, &v, &lookup));
        let mut unlabelled = v.clone();
        unlabelled.metadata.labels = None;
        assert!(is_outdated_vm(&old, &unlabelled, &lookup));

        let mut vmi =
            VirtualMachineInstance::new("p-0", api::VirtualMachineInstanceSpec::default());
        vmi.metadata.labels = Some([(REVISION_NAME_LABEL.to_owned(), "p-2".to_owned())].into());
        let mut updated = updated_vm(&new, &v, &revision_name(&new));
        assert_eq!(instance_update(&v, &vmi, &lookup), InstanceUpdate::None);
        assert_eq!(
            instance_update(&updated, &vmi, &lookup),
            InstanceUpdate::Restart
        );
        assert_eq!(
            instance_update(
                &updated,
                &VirtualMachineInstance::new("p-0", api::VirtualMachineInstanceSpec::default()),
                &lookup
            ),
            InstanceUpdate::Restart
        );
        // Only the VM template's metadata changed: the VMI already runs the new spec.
        let mut relabelled = new.clone();
        relabelled.metadata.generation = Some(4);
        relabelled.spec = old.spec.clone();
        relabelled
            .spec
            .virtual_machine_template
            .metadata
            .as_mut()
            .unwrap()
            .annotations = None;
        let revs2: BTreeMap<String, VirtualMachinePoolSpec> = [
            (revision_name(&old), old.spec.clone()),
            (revision_name(&relabelled), relabelled.spec.clone()),
        ]
        .into();
        updated = updated_vm(&relabelled, &v, &revision_name(&relabelled));
        assert_eq!(
            instance_update(&updated, &vmi, &|n: &str| revs2.get(n).cloned()),
            InstanceUpdate::Relabel("p-4".into())
        );
    }

    #[test]
    fn an_update_keeps_the_firmware_identity() {
        let p = pool(1, &json!({}));
        let mut v = vm(&p, "p-0", 1);
        let fw = &mut v.spec.template.spec.as_mut().unwrap().domain.firmware;
        *fw = Some(api::vmi::Firmware {
            uuid: Some("u".into()),
            serial: Some("s".into()),
            ..Default::default()
        });
        let u = updated_vm(&p, &v, "p-9");
        let fw = u.spec.template.spec.unwrap().domain.firmware.unwrap();
        assert_eq!(
            (fw.uuid.as_deref(), fw.serial.as_deref()),
            (Some("u"), Some("s"))
        );
        assert_eq!(u.metadata.labels.unwrap()[REVISION_NAME_LABEL], "p-9");
    }

    #[test]
    fn status_counts_every_vm_and_prunes_unused_revisions() {
        let mut p = pool(3, &json!({"paused": true}));
        let mut ready = vm(&p, "p-0", 1);
        ready.status =
            serde_json::from_value(json!({"conditions": [{"type": "Ready", "status": "True"}]}))
                .unwrap();
        let mut gone = vm(&p, "p-1", 1);
        gone.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        let s = next_status(
            &p,
            &[&ready, &gone],
            Some(("FailedScaleOut", "boom")),
            Timestamp::now(),
        );
        assert_eq!((s.replicas, s.ready_replicas), (Some(2), Some(1)));
        assert_eq!(s.label_selector.as_deref(), Some("app=p"));
        assert_eq!(s.conditions.len(), 2);
        p.status = Some(s);
        p.spec.paused = None;
        assert!(
            next_status(&p, &[], None, Timestamp::now())
                .conditions
                .is_empty()
        );
        let vmi_labelled = {
            let mut v =
                VirtualMachineInstance::new("p-0", api::VirtualMachineInstanceSpec::default());
            v.metadata.labels = Some([(REVISION_NAME_LABEL.to_owned(), "p-1".to_owned())].into());
            v
        };
        assert_eq!(
            unused_revisions(["p-1", "p-2", "p-3"], &[&ready], &[&vmi_labelled]),
            ["p-3"]
        );
    }

    #[test]
    fn sort_policies_order_as_kubevirt() {
        let p = pool(1, &json!({}));
        let vms = [vm(&p, "p-10", 2), vm(&p, "p-2", 3), vm(&p, "p-3", 1)];
        let mut rng = fastrand::Rng::with_seed(7);
        let order = |policy: SortPolicy, rng: &mut fastrand::Rng| {
            let mut sorted: Vec<&VirtualMachine> = vms.iter().collect();
            sort_vms(&mut sorted, &policy, rng);
            sorted
                .iter()
                .map(|v| v.metadata.name.clone().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            order(SortPolicy::AscendingOrder, &mut rng),
            ["p-2", "p-3", "p-10"]
        );
        assert_eq!(
            order(SortPolicy::DescendingOrder, &mut rng),
            ["p-10", "p-3", "p-2"]
        );
        assert_eq!(order(SortPolicy::Newest, &mut rng), ["p-2", "p-10", "p-3"]);
        assert_eq!(order(SortPolicy::Oldest, &mut rng), ["p-3", "p-10", "p-2"]);
    }
}
