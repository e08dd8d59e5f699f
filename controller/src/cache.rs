//! What the controllers' caches hold: objects trimmed to what the controllers read, the VMI
//! cache's indexes, and an index of launcher pods by their VMI.
//!
//! kube-runtime's `Store` has no indexes (client-go's informers do), and a VMI sync that walked
//! every cached launcher pod to find its own cost O(pods) per sync: with 10,000 VMIs that walk,
//! repeated for every sync of every VMI, was most of the controller's work.

use std::collections::HashMap;

use api::VirtualMachineInstance;
use informer::packed::Indexer;
use k8s_openapi::api::core::v1::{Pod, PodSpec, Volume};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt as _;

/// VMIs by node: the one in their status (where they run) and the one in their
/// `kubevirt.io/nodeName` label (where the VMI controller handed them). The evacuation and
/// node controllers look up a node's VMIs.
pub const VMI_BY_NODE: Indexer<VirtualMachineInstance> = Indexer {
    name: "node",
    values: |v| {
        let label = v.labels().get(api::labels::NODE_NAME).cloned();
        let status = v.status.as_ref().and_then(|s| s.node_name.clone());
        label.into_iter().chain(status).collect()
    },
};

/// VMIs by namespace: a replica set's candidates.
pub const VMI_BY_NAMESPACE: Indexer<VirtualMachineInstance> = Indexer {
    name: "namespace",
    values: |v| v.namespace().into_iter().collect(),
};

/// VMIs by the claims their volumes use (`namespace/claim`): a claim's change wakes them.
pub const VMI_BY_CLAIM: Indexer<VirtualMachineInstance> = Indexer {
    name: "claim",
    values: |v| {
        let ns = v.namespace().unwrap_or_default();
        v.spec
            .volumes
            .iter()
            .filter_map(|vol| {
                let ephemeral = vol
                    .ephemeral
                    .as_ref()
                    .and_then(|e| e.persistent_volume_claim.as_ref())
                    .map(|c| c.claim_name.as_str());
                api::hotplug::claim_name(vol).or(ephemeral)
            })
            .map(|claim| informer::key_of(Some(&ns), claim))
            .collect()
    },
};

/// VMIs by `phase/node` (either may be empty): `/metrics` counts them without decoding one.
pub const VMI_BY_PHASE_AND_NODE: Indexer<VirtualMachineInstance> = Indexer {
    name: "phase-node",
    values: |v| {
        let status = v.status.as_ref();
        let phase = status
            .and_then(|s| s.phase.as_ref())
            .map_or("", |p| p.as_str());
        let node = status.and_then(|s| s.node_name.as_deref()).unwrap_or("");
        vec![format!("{phase}/{node}")]
    },
};

/// Every index of the VMI cache.
pub const VMI_INDEXES: [Indexer<VirtualMachineInstance>; 4] = [
    VMI_BY_NODE,
    VMI_BY_NAMESPACE,
    VMI_BY_CLAIM,
    VMI_BY_PHASE_AND_NODE,
];

/// kubectl's copy of the whole applied object, which `kubectl apply` keeps on every object it
/// writes. No controller reads it, and it can double an object's size.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops what no controller reads from any cached object: `managedFields` (often the largest
/// part of an object) and kubectl's last-applied copy.
pub fn trim_meta(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.remove(LAST_APPLIED);
    }
}

/// A launcher or attachment pod as the controllers read it: metadata, status and, of the
/// spec, `nodeName`, the tolerations (an attachment pod copies its launcher's) and the claim
/// volumes (hotplug compares their names with the VMI's claims). The containers and the
/// other volumes, most of a launcher pod's size, are written by the VMI controller and never
/// read back. A `Volume` holds every source inline (3,280 bytes however few are set): the
/// 8 non-claim volumes of a launcher pod, kept by name only, took 26 KB per cached pod, 70 %
/// of the controller's heap (heaptrack, 2,000 VMIs on kube-apiserver).
pub fn trim_pod(pod: &mut Pod) {
    trim_meta(&mut pod.metadata);
    if let Some(spec) = pod.spec.as_mut() {
        let volumes = spec.volumes.take().map(|vs| {
            vs.into_iter()
                .filter(|v| v.persistent_volume_claim.is_some())
                .map(|v| Volume {
                    name: v.name,
                    persistent_volume_claim: v.persistent_volume_claim,
                    ..Volume::default()
                })
                .collect()
        });
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            tolerations: spec.tolerations.take(),
            volumes,
            ..PodSpec::default()
        };
    }
}

/// Which children (`namespace/name` keys) each owner key controls. A child has at most one
/// controlling owner; an owner with no children left has no entry, so the index holds exactly
/// the children in the cache and nothing of deleted ones. An owner has one child or two (a
/// launcher pod and, briefly, its replacement), so a sorted `Vec` is the set: measured, a
/// `BTreeSet` of one made the index about 1 KB per pod.
#[derive(Debug, Default)]
pub struct OwnerIndex {
    children: HashMap<String, Vec<String>>,
    owner: HashMap<String, String>,
}

impl OwnerIndex {
    /// `child` is in the cache, controlled by `owner` (or by nothing we index).
    pub fn set(&mut self, child: &str, owner: Option<&str>) {
        match owner {
            Some(o) if self.owner.get(child).map(String::as_str) == Some(o) => {}
            Some(o) => {
                self.remove(child);
                self.owner.insert(child.to_owned(), o.to_owned());
                let set = self.children.entry(o.to_owned()).or_default();
                if let Err(at) = set.binary_search_by(|c| c.as_str().cmp(child)) {
                    set.insert(at, child.to_owned());
                }
            }
            None => self.remove(child),
        }
    }

    /// `child` left the cache.
    pub fn remove(&mut self, child: &str) {
        let Some(o) = self.owner.remove(child) else {
            return;
        };
        if let Some(set) = self.children.get_mut(&o) {
            set.retain(|c| c != child);
            if set.is_empty() {
                self.children.remove(&o);
            }
        }
    }

    /// The children `owner` controls, in key order.
    pub fn children(&self, owner: &str) -> Vec<String> {
        self.children.get(owner).cloned().unwrap_or_default()
    }

    /// How many owners and children are indexed: the pruning the tests check.
    #[cfg(test)]
    fn sizes(&self) -> (usize, usize) {
        (self.children.len(), self.owner.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, EmptyDirVolumeSource, PersistentVolumeClaimVolumeSource, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    #[test]
    fn trimmed_pod_keeps_what_the_controllers_read() {
        let claim = Volume {
            name: "data".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: "data-pvc".into(),
                read_only: None,
            }),
            ..Volume::default()
        };
        let mut pod = Pod {
            metadata: ObjectMeta {
                name: Some("virt-launcher-a-x".into()),
                annotations: Some(
                    [
                        (LAST_APPLIED.to_owned(), "{...}".to_owned()),
                        ("kubevirt.io/domain".to_owned(), "a".to_owned()),
                    ]
                    .into(),
                ),
                managed_fields: Some(vec![ManagedFieldsEntry::default()]),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-1".into()),
                containers: vec![Container {
                    name: "compute".into(),
                    ..Container::default()
                }],
                volumes: Some(vec![
                    Volume {
                        name: "private".into(),
                        empty_dir: Some(EmptyDirVolumeSource::default()),
                        ..Volume::default()
                    },
                    claim.clone(),
                ]),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                ..PodStatus::default()
            }),
        };
        let status = pod.status.clone();
        trim_pod(&mut pod);
        assert_eq!(pod.metadata.managed_fields, None);
        assert_eq!(
            pod.metadata.annotations,
            Some([("kubevirt.io/domain".to_owned(), "a".to_owned())].into())
        );
        assert_eq!(
            pod.spec,
            Some(PodSpec {
                node_name: Some("node-1".into()),
                volumes: Some(vec![claim]),
                ..PodSpec::default()
            })
        );
        assert_eq!(pod.status, status);
    }

    #[test]
    fn children_are_listed_by_owner() {
        let mut i = OwnerIndex::default();
        i.set("ns/pod-b", Some("ns/vmi"));
        i.set("ns/pod-a", Some("ns/vmi"));
        i.set("ns/pod-c", Some("ns/other"));
        i.set("ns/pod-a", Some("ns/vmi"));
        assert_eq!(i.children("ns/vmi"), ["ns/pod-a", "ns/pod-b"]);
        assert_eq!(i.children("ns/other"), ["ns/pod-c"]);
        assert!(i.children("ns/none").is_empty());
        assert_eq!(i.sizes(), (2, 3));
    }

    #[test]
    fn deleted_children_and_their_emptied_owners_are_pruned() {
        let mut i = OwnerIndex::default();
        i.set("ns/pod-a", Some("ns/vmi"));
        i.set("ns/pod-b", Some("ns/vmi"));
        i.remove("ns/pod-a");
        assert_eq!(i.children("ns/vmi"), ["ns/pod-b"]);
        i.remove("ns/pod-b");
        i.remove("ns/pod-b");
        i.remove("ns/never-seen");
        assert_eq!(i.sizes(), (0, 0), "no owner entry outlives its last child");
    }

    #[test]
    fn a_child_that_changes_or_loses_its_owner_moves() {
        let mut i = OwnerIndex::default();
        i.set("ns/pod", Some("ns/old"));
        i.set("ns/pod", Some("ns/new"));
        assert!(i.children("ns/old").is_empty());
        assert_eq!(i.children("ns/new"), ["ns/pod"]);
        i.set("ns/pod", None);
        assert!(i.children("ns/new").is_empty());
        assert_eq!(i.sizes(), (0, 0));
    }
}
