//! What the controllers' caches hold: objects trimmed to what the controllers read, and the
//! indexes of the VMI and pod caches (`informer::packed`).

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

/// Launcher pods by their VMI (`namespace/name` of their controlling owner): a VMI's sync,
/// its migrations and its evacuation read its pods. kube-runtime's `Store` has no indexes,
/// and a VMI sync that walked every cached launcher pod to find its own cost O(pods) per sync:
/// with 10,000 VMIs that walk was most of the controller's work.
pub const POD_BY_VMI: Indexer<Pod> = Indexer {
    name: "vmi",
    values: |p| {
        informer::controller_owner(p, "VirtualMachineInstance")
            .map(|vmi| informer::key_of(p.namespace().as_deref(), vmi))
            .into_iter()
            .collect()
    },
};

/// Hotplug attachment pods by the VMI they serve (their controller is the launcher pod).
pub const ATTACHMENT_BY_VMI: Indexer<Pod> = Indexer {
    name: "attachment-vmi",
    values: |p| attachment_vmi_key(p).into_iter().collect(),
};

/// Every index of the launcher and attachment pod cache.
pub const POD_INDEXES: [Indexer<Pod>; 2] = [POD_BY_VMI, ATTACHMENT_BY_VMI];

/// The VMI an attachment pod serves (`namespace/name`), by its annotation.
pub fn attachment_vmi_key(pod: &Pod) -> Option<String> {
    let app = pod.metadata.labels.as_ref()?.get(api::labels::APP)?;
    if app != api::hotplug::ATTACHMENT_POD_APP {
        return None;
    }
    let vmi = pod
        .metadata
        .annotations
        .as_ref()?
        .get(api::hotplug::OWNER_VMI_NAME_ANNOTATION)?;
    Some(informer::key_of(pod.namespace().as_deref(), vmi))
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, EmptyDirVolumeSource, PersistentVolumeClaimVolumeSource, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, OwnerReference};

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

    fn pod(
        labels: &[(&str, &str)],
        annotations: &[(&str, &str)],
        owner: Option<(&str, &str)>,
    ) -> Pod {
        let map = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            )
        };
        let mut p = Pod::default();
        p.metadata.namespace = Some("ns".into());
        p.metadata.labels = map(labels);
        p.metadata.annotations = map(annotations);
        p.metadata.owner_references = owner.map(|(kind, name)| {
            vec![OwnerReference {
                kind: kind.into(),
                name: name.into(),
                controller: Some(true),
                ..OwnerReference::default()
            }]
        });
        p
    }

    #[test]
    fn launcher_pods_are_indexed_by_their_vmi_and_attachment_pods_by_the_vmi_they_serve() {
        let launcher = pod(
            &[(api::labels::APP, "virt-launcher")],
            &[],
            Some(("VirtualMachineInstance", "vmi")),
        );
        assert_eq!((POD_BY_VMI.values)(&launcher), ["ns/vmi"]);
        assert!((ATTACHMENT_BY_VMI.values)(&launcher).is_empty());
        let attachment = pod(
            &[(api::labels::APP, api::hotplug::ATTACHMENT_POD_APP)],
            &[(api::hotplug::OWNER_VMI_NAME_ANNOTATION, "vmi")],
            Some(("Pod", "virt-launcher-vmi-abcde")),
        );
        assert!((POD_BY_VMI.values)(&attachment).is_empty());
        assert_eq!((ATTACHMENT_BY_VMI.values)(&attachment), ["ns/vmi"]);
        let orphan = pod(&[(api::labels::APP, "virt-launcher")], &[], None);
        assert!((POD_BY_VMI.values)(&orphan).is_empty());
    }
}
