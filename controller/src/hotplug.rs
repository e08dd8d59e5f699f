//! Volume hotplug in virt-controller (KubeVirt's `watch/vmi/volume-hotplug.go` and
//! `updateVolumeStatus` in `watch/vmi/storage.go`): one attachment pod per launcher pod mounts
//! the VMI's hotplugged claims on its node, and is replaced by a new one when that set
//! changes; `status.volumeStatus` lists every volume, with the claim's facts and the
//! hotplug phases up to `AttachedToNode` (virt-handler takes them on from there).
//!
//! Pure; `run::vmi` reads the caches and carries the decisions out.

use std::collections::{BTreeMap, BTreeSet};

use api::VirtualMachineInstance;
use api::common::Preserved;
use api::hotplug::{
    ATTACHMENT_POD_APP, ATTACHMENT_POD_DIR, ATTACHMENT_POD_PREFIX, ATTACHMENT_SOCKET,
    HOTPLUG_DISKS_VOLUME, OWNER_VMI_NAME_ANNOTATION, OWNER_VMI_UID_ANNOTATION,
    PHASE_ATTACHED_TO_NODE, PHASE_BOUND, PHASE_DETACHING, PHASE_MOUNTED_TO_POD, PHASE_PENDING,
    PHASE_READY, REASON_PVC_NOT_FOUND, REASON_PVC_NOT_READY, REASON_SUCCESSFUL_CREATE,
    REASON_SUCCESSFUL_DELETE, claim_name,
};
use api::labels;
use api::status::VolumeStatus;
use api::vmi::Volume;
use k8s_openapi::api::core::v1::{
    Affinity, Container, EmptyDirVolumeSource, NodeAffinity, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, PersistentVolumeClaim, PersistentVolumeClaimVolumeSource, Pod, PodSpec,
    ResourceRequirements, Toleration, Volume as PodVolume, VolumeDevice, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde_json::json;

/// CDI's default filesystem overhead, which KubeVirt reports when no CDI is installed.
pub const DEFAULT_FILESYSTEM_OVERHEAD: &str = "0.055";

/// KubeVirt's `GetHotplugVolumes`: the VMI's claims that its launcher pod does not mount.
pub fn hotplug_volumes<'a>(vmi: &'a VirtualMachineInstance, launcher: &Pod) -> Vec<&'a Volume> {
    let in_pod: BTreeSet<&str> = launcher
        .spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .map(|v| v.name.as_str())
        .collect();
    vmi.spec
        .volumes
        .iter()
        .filter(|v| claim_name(v).is_some() && !in_pod.contains(v.name.as_str()))
        .collect()
}

fn claim_phase(c: &PersistentVolumeClaim) -> &str {
    c.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

/// KubeVirt's `VolumeReadyToAttachToNode` without CDI: the claim exists and is bound.
pub fn claim_ready(c: Option<&PersistentVolumeClaim>) -> bool {
    c.is_some_and(|c| claim_phase(c) == "Bound")
}

/// The `volumeMode: Block` claims among `volumes`: volume name -> the claim's uid, which
/// names the device in the attachment pod.
pub fn block_claims(
    volumes: &[&Volume],
    claim: impl Fn(&str) -> Option<PersistentVolumeClaim>,
) -> BTreeMap<String, String> {
    volumes
        .iter()
        .filter_map(|v| {
            let c = claim(claim_name(v)?)?;
            crate::template::is_block(&c)
                .then(|| (v.name.clone(), c.metadata.uid.unwrap_or_default()))
        })
        .collect()
}

/// Whether `pod` is an attachment pod of `launcher` (its controller).
pub fn is_attachment_pod_of(pod: &Pod, launcher: &Pod) -> bool {
    let app = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::APP))
        .is_some_and(|a| a == ATTACHMENT_POD_APP);
    app && pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && Some(&o.uid) == launcher.metadata.uid.as_ref())
}

fn claim_volume_names(pod: &Pod) -> BTreeSet<&str> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter(|v| v.persistent_volume_claim.is_some())
        .map(|v| v.name.as_str())
        .collect()
}

/// KubeVirt's `podVolumesMatchesReadyVolumes`.
fn serves_exactly(pod: &Pod, volumes: &[&Volume]) -> bool {
    claim_volume_names(pod) == volumes.iter().map(|v| v.name.as_str()).collect()
}

fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

/// KubeVirt's `getActiveAndOldAttachmentPods`: the live pod serving exactly `volumes`, and
/// every other one, newest first.
fn current_and_old<'a>(volumes: &[&Volume], pods: &[&'a Pod]) -> (Option<&'a Pod>, Vec<&'a Pod>) {
    let mut current = None;
    let mut old = Vec::new();
    for p in pods {
        if !serves_exactly(p, volumes) {
            old.push(*p);
        } else if p.metadata.deletion_timestamp.is_none() {
            current = Some(*p);
        }
    }
    old.sort_by(|a, b| {
        b.metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0)
            .cmp(&a.metadata.creation_timestamp.as_ref().map(|t| t.0))
    });
    (current, old)
}

/// What to do with a launcher's attachment pods.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttachmentPlan {
    /// Create an attachment pod for these volumes (names), when not empty.
    pub create: Vec<String>,
    /// Delete these attachment pods (names).
    pub delete: Vec<String>,
}

/// KubeVirt's `handleHotplugVolumes` and `cleanupAttachmentPods`: a new pod once the ready set
/// changed and no pod is pending; an old pod goes once the volumes only it serves are no
/// longer in use by the launcher, while one running old pod is kept until the new one runs.
pub fn plan_attachments(
    vmi: &VirtualMachineInstance,
    pods: &[&Pod],
    ready: &[&Volume],
) -> AttachmentPlan {
    let mut plan = AttachmentPlan::default();
    let single_match = pods.len() == 1 && serves_exactly(pods[0], ready);
    if single_match || (pods.is_empty() && ready.is_empty()) {
        return plan;
    }
    let (current, old) = current_and_old(ready, pods);
    let pending = old
        .iter()
        .any(|p| !matches!(pod_phase(p), "Running" | "Succeeded" | "Failed"));
    if current.is_none() && !pending && !ready.is_empty() {
        plan.create = ready.iter().map(|v| v.name.clone()).collect();
    }
    // Hotplug entries whose volume left the spec, and the hotplug volumes still in it.
    let in_spec: BTreeSet<&str> = vmi
        .spec
        .volumes
        .iter()
        .filter(|v| api::hotplug::is_hotpluggable(v))
        .map(|v| v.name.as_str())
        .collect();
    let leaving: BTreeMap<&str, &VolumeStatus> = vmi
        .status
        .iter()
        .flat_map(|s| &s.volume_status)
        .filter(|s| s.hotplug_volume.is_some() && !in_spec.contains(s.name.as_str()))
        .map(|s| (s.name.as_str(), s))
        .collect();
    let in_use = |phase: Option<&str>| matches!(phase, Some(PHASE_READY | PHASE_MOUNTED_TO_POD));
    let current_runs = current.is_some_and(|p| pod_phase(p) == "Running");
    let mut kept_running = false;
    for p in old {
        let names = claim_volume_names(p);
        let preserves = names.iter().any(|n| {
            in_spec.contains(n) || leaving.get(n).is_some_and(|s| in_use(s.phase.as_deref()))
        });
        if !kept_running
            && pod_phase(p) == "Running"
            && p.metadata.deletion_timestamp.is_none()
            && !ready.is_empty()
            && !current_runs
            && preserves
        {
            kept_running = true;
            continue;
        }
        let still_used = names
            .iter()
            .any(|n| leaving.get(n).is_some_and(|s| in_use(s.phase.as_deref())));
        if !still_used
            && p.metadata.deletion_timestamp.is_none()
            && let Some(name) = &p.metadata.name
        {
            plan.delete.push(name.clone());
        }
    }
    plan
}

fn resources(cpu: &str, memory: &str) -> BTreeMap<String, Quantity> {
    BTreeMap::from([
        ("cpu".to_owned(), Quantity(cpu.into())),
        ("memory".to_owned(), Quantity(memory.into())),
    ])
}

/// KubeVirt's `RenderHotplugAttachmentPodTemplate`: the launcher image's `container-disk`
/// serving `/path/hp.sock` (by which virt-handler finds the pod's mounts), each file-system
/// claim mounted at `/<volume>` and each block claim (`block`: volume -> claim uid) a device
/// at `/path/<volume>/<claim uid>`, pinned to the launcher's node and controlled by the
/// launcher pod. KubeVirt runs `container-disk` through `/bin/sh -c`; the launcher image here
/// has no shell.
pub fn render_attachment_pod(
    vmi: &VirtualMachineInstance,
    launcher: &Pod,
    volumes: &[&Volume],
    block: &BTreeMap<String, String>,
    launcher_image: &str,
) -> Pod {
    let node = launcher
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let mut pod_volumes = vec![PodVolume {
        name: HOTPLUG_DISKS_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..PodVolume::default()
    }];
    let mut mounts = vec![VolumeMount {
        name: HOTPLUG_DISKS_VOLUME.into(),
        mount_path: ATTACHMENT_POD_DIR.into(),
        mount_propagation: Some("HostToContainer".into()),
        ..VolumeMount::default()
    }];
    let mut devices = Vec::new();
    for v in volumes {
        let Some(claim) = claim_name(v) else { continue };
        pod_volumes.push(PodVolume {
            name: v.name.clone(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.to_owned(),
                read_only: None,
            }),
            ..PodVolume::default()
        });
        if let Some(claim_uid) = block.get(&v.name) {
            devices.push(VolumeDevice {
                name: v.name.clone(),
                device_path: format!("{ATTACHMENT_POD_DIR}/{}/{claim_uid}", v.name),
            });
        } else {
            mounts.push(VolumeMount {
                name: v.name.clone(),
                mount_path: format!("/{}", v.name),
                ..VolumeMount::default()
            });
        }
    }
    // KubeVirt's `hotplugPodTolerations`, then the launcher's own.
    let mut tolerations: Vec<Toleration> = [
        "node.kubernetes.io/unschedulable",
        "node.kubernetes.io/network-unavailable",
        "node.kubernetes.io/disk-pressure",
        "node.kubernetes.io/memory-pressure",
        "node.kubernetes.io/pid-pressure",
    ]
    .into_iter()
    .map(|key| Toleration {
        key: Some(key.into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Toleration::default()
    })
    .collect();
    tolerations.extend(
        launcher
            .spec
            .iter()
            .flat_map(|s| s.tolerations.iter().flatten())
            .cloned(),
    );
    tolerations.sort_by(|a, b| a.key.cmp(&b.key));
    tolerations.dedup();
    Pod {
        metadata: ObjectMeta {
            generate_name: Some(ATTACHMENT_POD_PREFIX.into()),
            namespace: launcher.metadata.namespace.clone(),
            labels: Some(BTreeMap::from([(
                labels::APP.to_owned(),
                ATTACHMENT_POD_APP.to_owned(),
            )])),
            annotations: Some(BTreeMap::from([
                (
                    OWNER_VMI_NAME_ANNOTATION.to_owned(),
                    vmi.metadata.name.clone().unwrap_or_default(),
                ),
                (
                    OWNER_VMI_UID_ANNOTATION.to_owned(),
                    vmi.metadata.uid.clone().unwrap_or_default(),
                ),
            ])),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: launcher.metadata.name.clone().unwrap_or_default(),
                uid: launcher.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: ATTACHMENT_POD_APP.into(),
                image: Some(launcher_image.to_owned()),
                image_pull_policy: Some(
                    api::defaults::pull_policy_for(launcher_image)
                        .as_str()
                        .to_owned(),
                ),
                command: Some(vec!["/usr/bin/container-disk".into()]),
                args: Some(vec![
                    "--copy-path".into(),
                    format!("{ATTACHMENT_POD_DIR}/{ATTACHMENT_SOCKET}"),
                ]),
                resources: Some(ResourceRequirements {
                    requests: Some(resources("10m", "2M")),
                    limits: Some(resources("100m", "80M")),
                    ..ResourceRequirements::default()
                }),
                security_context: Some(crate::template::non_root_security_context()),
                volume_mounts: Some(mounts),
                volume_devices: (!devices.is_empty()).then_some(devices),
                ..Container::default()
            }],
            affinity: Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_expressions: Some(vec![NodeSelectorRequirement {
                                key: "kubernetes.io/hostname".into(),
                                operator: "In".into(),
                                values: Some(vec![node]),
                            }]),
                            match_fields: None,
                        }],
                    }),
                    ..NodeAffinity::default()
                }),
                ..Affinity::default()
            }),
            tolerations: Some(tolerations),
            volumes: Some(pod_volumes),
            termination_grace_period_seconds: Some(0),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// An event for the VMI: reason and message.
pub type VolumeEvent = (&'static str, String);

fn set(status: &mut VolumeStatus, phase: &str, reason: &str, message: String) {
    status.phase = Some(phase.to_owned());
    status.reason = Some(reason.to_owned());
    status.message = Some(message);
}

/// KubeVirt's `getVolumePhaseMessageReason`: the phase a hotplug volume has from its claim.
fn phase_from_claim(status: &mut VolumeStatus, claim: &str, c: Option<&PersistentVolumeClaim>) {
    match c.map(claim_phase) {
        None => set(
            status,
            PHASE_PENDING,
            REASON_PVC_NOT_FOUND,
            format!("PVC {claim} not found"),
        ),
        Some("Pending") => set(
            status,
            PHASE_PENDING,
            REASON_PVC_NOT_READY,
            "PVC is in phase ClaimPending".into(),
        ),
        Some("Bound") => set(
            status,
            PHASE_BOUND,
            REASON_PVC_NOT_READY,
            "PVC is in phase Bound".into(),
        ),
        Some(_) => set(
            status,
            PHASE_PENDING,
            REASON_PVC_NOT_READY,
            "PVC is in phase Lost".into(),
        ),
    }
}

/// KubeVirt's `PersistentVolumeClaimInfo` of a claim.
fn claim_info(c: &PersistentVolumeClaim) -> Preserved {
    let spec = c.spec.as_ref();
    let mut info = json!({
        "claimName": c.metadata.name,
        "accessModes": spec.and_then(|s| s.access_modes.clone()).unwrap_or_default(),
        "volumeMode": spec.and_then(|s| s.volume_mode.clone()).unwrap_or_else(|| "Filesystem".into()),
        "filesystemOverhead": DEFAULT_FILESYSTEM_OVERHEAD,
    });
    if let Some(capacity) = c.status.as_ref().and_then(|s| s.capacity.as_ref()) {
        info["capacity"] = json!(capacity);
    }
    if let Some(requests) = spec
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
    {
        info["requests"] = json!(requests);
    }
    Preserved(info)
}

fn attachment(pod: &Pod, ready: bool) -> Preserved {
    let mut h = json!({"attachPodName": pod.metadata.name});
    // The uid only once the pod is ready: virt-handler mounts from the pod it names.
    if ready && let Some(uid) = &pod.metadata.uid {
        h["attachPodUID"] = json!(uid);
    }
    Preserved(h)
}

fn container_ready(pod: &Pod) -> bool {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_deref())
        .unwrap_or_default();
    statuses.len() == 1 && statuses[0].ready
}

/// KubeVirt's `updateVolumeStatus` for a VMI with its launcher pod: an entry per volume (kept
/// from the old status, so virt-handler's targets stay), claim facts for claims, the hotplug
/// phases of hotplugged volumes, and the entries of unplugged volumes while an attachment pod
/// still serves them. Sorted by name; the events of the change.
pub fn volume_status(
    vmi: &VirtualMachineInstance,
    launcher: &Pod,
    attachment_pods: &[&Pod],
    claims: &dyn Fn(&str) -> Option<PersistentVolumeClaim>,
) -> (Vec<VolumeStatus>, Vec<VolumeEvent>) {
    let mut old: BTreeMap<&str, &VolumeStatus> = vmi
        .status
        .iter()
        .flat_map(|s| &s.volume_status)
        .map(|s| (s.name.as_str(), s))
        .collect();
    let hot = hotplug_volumes(vmi, launcher);
    let hot_names: BTreeSet<&str> = hot.iter().map(|v| v.name.as_str()).collect();
    let (current, _) = current_and_old(&hot, attachment_pods);
    let mut events = Vec::new();
    let mut out = Vec::new();
    for v in &vmi.spec.volumes {
        let mut status = old
            .remove(v.name.as_str())
            .cloned()
            .unwrap_or_else(|| VolumeStatus {
                name: v.name.clone(),
                ..VolumeStatus::default()
            });
        let claim = claim_name(v).map(|c| (c, claims(c)));
        if hot_names.contains(v.name.as_str())
            && let Some((claim, c)) = &claim
        {
            let mut use_claim = false;
            match current {
                None => {
                    if status.phase.as_deref() != Some(PHASE_READY) {
                        if let Some(h) = status
                            .hotplug_volume
                            .as_mut()
                            .and_then(|h| h.0.as_object_mut())
                        {
                            h.remove("attachPodUID");
                        }
                        use_claim = true;
                    }
                }
                Some(pod) => {
                    status.hotplug_volume = Some(attachment(pod, container_ready(pod)));
                    if matches!(
                        status.phase.as_deref(),
                        None | Some(PHASE_BOUND | PHASE_PENDING)
                    ) {
                        let message = format!(
                            "Created hotplug attachment pod {}, for volume {}",
                            pod.metadata.name.as_deref().unwrap_or_default(),
                            v.name
                        );
                        set(
                            &mut status,
                            PHASE_ATTACHED_TO_NODE,
                            REASON_SUCCESSFUL_CREATE,
                            message.clone(),
                        );
                        events.push((REASON_SUCCESSFUL_CREATE, message));
                    }
                    use_claim = status.phase.as_deref() == Some(PHASE_DETACHING);
                }
            }
            if status.hotplug_volume.is_none() {
                status.hotplug_volume = Some(Preserved(json!({})));
            }
            if use_claim {
                phase_from_claim(&mut status, claim, c.as_ref());
            }
        }
        if let Some((_, Some(c))) = &claim {
            status.persistent_volume_claim_info = Some(claim_info(c));
        }
        out.push(status);
    }
    // Left the spec: kept while an attachment pod still serves the volume.
    for (name, status) in old {
        let Some(pod) = attachment_pods
            .iter()
            .find(|p| claim_volume_names(p).contains(name))
        else {
            continue;
        };
        let mut status = status.clone();
        status.hotplug_volume = Some(attachment(pod, true));
        if !matches!(
            status.phase.as_deref(),
            Some(PHASE_READY | PHASE_MOUNTED_TO_POD)
        ) {
            status.phase = Some(PHASE_DETACHING.to_owned());
            if pod.metadata.deletion_timestamp.is_some() {
                let message = format!(
                    "Deleted hotplug attachment pod {}, for volume {name}",
                    pod.metadata.name.as_deref().unwrap_or_default()
                );
                status.reason = Some(REASON_SUCCESSFUL_DELETE.to_owned());
                if status.message.as_deref() != Some(message.as_str()) {
                    events.push((REASON_SUCCESSFUL_DELETE, message.clone()));
                }
                status.message = Some(message);
            }
        }
        out.push(status);
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    (out, events)
}

#[cfg(test)]
mod tests;
