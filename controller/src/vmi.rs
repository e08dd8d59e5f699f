//! The VMI controller's decisions as pure functions: whether a VMI needs a launcher pod, and
//! the phase and conditions its pod implies (`pkg/virt-controller/watch/vmi`: `sync`,
//! `updateStatus`). Pending -> Scheduling (a pod exists) -> Scheduled (the pod runs; from here
//! virt-handler owns the VMI); a pod that fails or vanishes before the guest runs -> Failed.

use api::common::ConditionStatus;
use api::labels;
use api::status::{
    PhaseTransitionTimestamp, VirtualMachineInstanceCondition, VirtualMachineInstanceConditionType,
};
use api::validation::FieldError;
use api::{VirtualMachineInstance, VirtualMachineInstancePhase, VirtualMachineInstanceStatus};
use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::events;

/// Reason of the condition a VMI that failed validation gets.
pub const FAILED_VALIDATION: &str = "FailedValidation";
/// Condition type Kubernetes uses for pod scheduling, mirrored onto the VMI.
pub const POD_SCHEDULED: &str = "PodScheduled";

/// The VMI's phase, `None` when unset.
pub fn phase_of(vmi: &VirtualMachineInstance) -> Option<VirtualMachineInstancePhase> {
    vmi.status.as_ref().and_then(|s| s.phase.clone())
}

/// Succeeded or Failed.
pub fn is_final(vmi: &VirtualMachineInstance) -> bool {
    phase_of(vmi).is_some_and(|p| p.is_final())
}

/// Whether `pod` is a launcher pod of `vmi`: its controller owner reference is the VMI's uid.
pub fn is_launcher_of(pod: &Pod, vmi: &VirtualMachineInstance) -> bool {
    let Some(uid) = vmi.metadata.uid.as_deref() else {
        return false;
    };
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// Whether `pod` was created as the target of a migration (`kubevirt.io/migrationJobUID`).
fn is_migration_target(pod: &Pod) -> bool {
    pod.metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(labels::MIGRATION_JOB_UID))
}

/// The VMI's node, `status.nodeName`, when set.
fn vmi_node(vmi: &VirtualMachineInstance) -> Option<&str> {
    vmi.status
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// The launcher pod that counts for `vmi` among `pods`. Once the VMI has a node
/// (`status.nodeName`), only a pod on that node: during a migration the VMI has two launcher
/// pods, and the guest runs in the one on `status.nodeName` until the target virt-handler
/// moves that to the target node. Before, a pod that is not a migration target. Among those,
/// one not being deleted, else any.
pub fn current_pod<'a>(vmi: &VirtualMachineInstance, pods: &'a [Pod]) -> Option<&'a Pod> {
    let node = vmi_node(vmi);
    let all: Vec<&Pod> = pods
        .iter()
        .filter(|p| is_launcher_of(p, vmi))
        .filter(|p| match node {
            Some(n) => pod_node(p) == Some(n),
            None => !is_migration_target(p),
        })
        .collect();
    all.iter()
        .find(|p| p.metadata.deletion_timestamp.is_none())
        .or_else(|| all.first())
        .copied()
}

/// What to do with the VMI's pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodAction {
    /// Nothing.
    None,
    /// Render and create the launcher pod.
    Create,
    /// Delete these launcher pods (by name).
    Delete(Vec<String>),
}

/// Everything one sync of a VMI decides.
#[derive(Debug, Clone, PartialEq)]
pub struct VmiSync {
    /// What to do with pods.
    pub pods: PodAction,
    /// The status to write (equal to the old one when nothing changed).
    pub status: VirtualMachineInstanceStatus,
    /// Set the `kubevirt.io/nodeName` label to this.
    pub node_label: Option<String>,
    /// The VMI is final and its pods are gone: drop the VMI finalizer.
    pub release_finalizer: bool,
    /// Write this condition into the status of the launcher pod of this name.
    pub pod_condition: Option<(String, PodCondition)>,
}

pub(crate) fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

pub(crate) fn pod_node(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// KubeVirt's `isComputeContainerDown`: the launcher has exited, whatever the pod's other
/// containers (the container-disk ones keep running) still do.
pub(crate) fn compute_terminated(pod: &Pod) -> bool {
    pod.status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .find(|c| c.name == "compute")
        .is_some_and(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
}

/// KubeVirt's `IsPodReady`: the pod runs and every container but `compute` is ready; the
/// compute container becomes ready only once virt-handler synced the VMI.
pub fn launcher_ready(pod: &Pod) -> bool {
    if pod_phase(pod) != "Running" {
        return false;
    }
    pod.status
        .as_ref()
        .map(|s| s.container_statuses.iter().flatten())
        .into_iter()
        .flatten()
        .filter(|c| c.name != "compute")
        .all(|c| c.ready)
}

fn set_phase(
    status: &mut VirtualMachineInstanceStatus,
    phase: VirtualMachineInstancePhase,
    now: Timestamp,
) {
    if status.phase.as_ref() == Some(&phase) {
        return;
    }
    status
        .phase_transition_timestamps
        .push(PhaseTransitionTimestamp {
            phase: Some(phase.clone()),
            phase_transition_timestamp: Some(Time(now)),
        });
    status.phase = Some(phase);
}

fn set_condition(
    status: &mut VirtualMachineInstanceStatus,
    type_: VirtualMachineInstanceConditionType,
    cond_status: ConditionStatus,
    reason: &str,
    message: String,
    now: Timestamp,
) {
    if let Some(c) = status.conditions.iter_mut().find(|c| c.type_ == type_) {
        if c.status != cond_status || c.reason.as_deref() != Some(reason) {
            c.last_transition_time = Some(Time(now));
        }
        c.status = cond_status;
        c.reason = Some(reason.to_owned());
        c.message = Some(message);
        return;
    }
    status.conditions.push(VirtualMachineInstanceCondition {
        type_,
        status: cond_status,
        last_probe_time: None,
        last_transition_time: Some(Time(now)),
        reason: Some(reason.to_owned()),
        message: Some(message),
    });
}

fn remove_condition(
    status: &mut VirtualMachineInstanceStatus,
    type_: &VirtualMachineInstanceConditionType,
    reason: Option<&str>,
) {
    status
        .conditions
        .retain(|c| &c.type_ != type_ || reason.is_some_and(|r| c.reason.as_deref() != Some(r)));
}

/// KubeVirt's wait for a missing claim (`FailedPvcNotFound`): while `missing` says which
/// claim of the launcher pod does not exist, the pod is not created and the `Synchronized`
/// condition says why; the condition goes once the claims exist or the pod does.
pub fn wait_for_claims(out: &mut VmiSync, missing: Option<String>, now: Timestamp) {
    let synchronized = VirtualMachineInstanceConditionType::Synchronized;
    match missing {
        Some(message) if out.pods == PodAction::Create => {
            out.pods = PodAction::None;
            set_condition(
                &mut out.status,
                synchronized,
                ConditionStatus::False,
                crate::events::FAILED_PVC_NOT_FOUND,
                format!("{message}, waiting for it to appear"),
                now,
            );
        }
        _ => remove_condition(
            &mut out.status,
            &synchronized,
            Some(crate::events::FAILED_PVC_NOT_FOUND),
        ),
    }
}

/// KubeVirt's backend-storage sync errors (`FailedBackendStorageCreate`,
/// `FailedBackendStorageProbe`, `BackendStorageNotReady`): while `problem` holds one, the
/// launcher pod is not created and the `Synchronized` condition says why; the condition goes
/// with the problem.
pub fn wait_for_backend_storage(
    out: &mut VmiSync,
    problem: Option<(&'static str, String)>,
    now: Timestamp,
) {
    use crate::backendstorage::{FAILED_CREATE, FAILED_PROBE, NOT_READY};
    let synchronized = VirtualMachineInstanceConditionType::Synchronized;
    for reason in [FAILED_CREATE, FAILED_PROBE, NOT_READY] {
        if problem.as_ref().map(|p| p.0) != Some(reason) {
            remove_condition(&mut out.status, &synchronized, Some(reason));
        }
    }
    if let Some((reason, message)) = problem {
        out.pods = PodAction::None;
        set_condition(
            &mut out.status,
            synchronized,
            ConditionStatus::False,
            reason,
            message,
            now,
        );
    }
}

/// The message of the validation condition: every field at fault.
pub fn validation_message(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why a container-disk container cannot start, if it is an image pull problem.
fn image_pull_problem(pod: &Pod) -> Option<(&'static str, String)> {
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    statuses.iter().find_map(|c| {
        let waiting = c.state.as_ref()?.waiting.as_ref()?;
        let reason = match waiting.reason.as_deref()? {
            "ErrImagePull" => events::ERR_IMAGE_PULL,
            "ImagePullBackOff" => events::IMAGE_PULL_BACK_OFF,
            _ => return None,
        };
        Some((
            reason,
            format!(
                "container {}: {}",
                c.name,
                waiting.message.clone().unwrap_or_default()
            ),
        ))
    })
}

/// The condition behind the launcher pod's readiness gate, when the pod's must change
/// (KubeVirt's `syncPausedConditionToPod`): `True` while the guest is not paused, `False` once
/// virt-handler reports it `Paused`, so a paused guest's pod leaves its Services' endpoints.
/// As KubeVirt, a pod that never had the condition `True` is left without it while paused.
pub fn unpaused_condition(
    status: &VirtualMachineInstanceStatus,
    pod: &Pod,
    now: Timestamp,
) -> Option<PodCondition> {
    let paused = status
        .condition(&VirtualMachineInstanceConditionType::Paused)
        .is_some_and(|c| c.status == ConditionStatus::True);
    let unpaused_now = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == labels::VIRTUAL_MACHINE_UNPAUSED && c.status == "True");
    let (cond_status, reason, message) = match (paused, unpaused_now) {
        (true, true) => ("False", "Paused", "the virtual machine is paused"),
        (false, false) => ("True", "NotPaused", "the virtual machine is not paused"),
        _ => return None,
    };
    Some(PodCondition {
        type_: labels::VIRTUAL_MACHINE_UNPAUSED.into(),
        status: cond_status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_probe_time: Some(Time(now)),
        last_transition_time: Some(Time(now)),
        ..PodCondition::default()
    })
}

/// One sync of `vmi`, given its launcher pods and the problems validation found; PVCs count
/// as of unknown access mode for the `LiveMigratable` condition ([`sync_with`]).
pub fn sync(
    vmi: &VirtualMachineInstance,
    pods: &[Pod],
    validation: &[FieldError],
    now: Timestamp,
) -> VmiSync {
    sync_with(vmi, pods, validation, &|_| None, now)
}

/// Launcher pods a finished migration left behind: not the current pod, not on the VMI's
/// node, their launcher exited (the source after a completed migration, a target that
/// failed), and not the target of the migration the VMI is in the middle of. Deleted; never a
/// reason to fail the VMI.
fn leftover_pods(vmi: &VirtualMachineInstance, mine: &[&Pod], current: &Pod) -> Vec<String> {
    let Some(node) = vmi_node(vmi) else {
        return Vec::new();
    };
    let in_flight = vmi
        .status
        .as_ref()
        .and_then(|s| s.migration_state.as_ref())
        .filter(|s| s.completed != Some(true) && s.failed != Some(true))
        .and_then(|s| s.migration_uid.as_deref());
    mine.iter()
        .filter(|p| p.metadata.uid != current.metadata.uid)
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| pod_node(p) != Some(node))
        .filter(|p| matches!(pod_phase(p), "Failed" | "Succeeded") || compute_terminated(p))
        .filter(|p| {
            let job = p
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(labels::MIGRATION_JOB_UID));
            in_flight.is_none() || job.map(String::as_str) != in_flight
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect()
}

/// [`sync`], with `pvc_shared` telling whether a claim is `ReadWriteMany` (`None`: unknown).
pub fn sync_with(
    vmi: &VirtualMachineInstance,
    pods: &[Pod],
    validation: &[FieldError],
    pvc_shared: &dyn Fn(&str) -> Option<bool>,
    now: Timestamp,
) -> VmiSync {
    use VirtualMachineInstancePhase as Ph;
    let mut status = vmi.status.clone().unwrap_or_default();
    let mine: Vec<&Pod> = pods.iter().filter(|p| is_launcher_of(p, vmi)).collect();
    let pod = current_pod(vmi, pods);
    let deleting = vmi.metadata.deletion_timestamp.is_some();
    let mut out = VmiSync {
        pods: PodAction::None,
        status: VirtualMachineInstanceStatus::default(),
        node_label: None,
        release_finalizer: false,
        pod_condition: None,
    };
    let phase = status.phase.clone();
    let final_ = phase
        .as_ref()
        .is_some_and(VirtualMachineInstancePhase::is_final);

    if deleting || final_ {
        let live: Vec<String> = mine
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        if !live.is_empty() {
            out.pods = PodAction::Delete(live);
        }
        if mine.is_empty() {
            if !final_ {
                // No guest can run without its pod: the instance is over.
                set_phase(&mut status, Ph::Failed, now);
            }
            out.release_finalizer = true;
        }
        out.status = status;
        return out;
    }

    let unprocessed = matches!(phase, None | Some(Ph::Pending));
    if unprocessed && pod.is_none() {
        set_phase(&mut status, Ph::Pending, now);
        if validation.is_empty() {
            remove_condition(
                &mut status,
                &VirtualMachineInstanceConditionType::Synchronized,
                Some(FAILED_VALIDATION),
            );
            out.pods = PodAction::Create;
        } else {
            set_condition(
                &mut status,
                VirtualMachineInstanceConditionType::Synchronized,
                ConditionStatus::False,
                FAILED_VALIDATION,
                validation_message(validation),
                now,
            );
        }
        out.status = status;
        return out;
    }

    let Some(pod) = pod else {
        // Scheduling, Scheduled or Running and the pod is gone.
        set_phase(&mut status, Ph::Failed, now);
        status.reason = Some("PodVanished".into());
        out.status = status;
        return out;
    };

    let pod_over = matches!(pod_phase(pod), "Failed" | "Succeeded")
        || compute_terminated(pod)
        || pod.metadata.deletion_timestamp.is_some();
    let before_running = matches!(
        phase,
        None | Some(Ph::Pending | Ph::Scheduling | Ph::Scheduled)
    );
    if pod_over && before_running {
        set_phase(&mut status, Ph::Failed, now);
        status.reason = Some("PodFailed".into());
        out.status = status;
        return out;
    }

    if unprocessed {
        set_phase(&mut status, Ph::Scheduling, now);
    }
    if !pod_over {
        out.pod_condition = unpaused_condition(&status, pod, now)
            .and_then(|c| Some((pod.metadata.name.clone()?, c)));
    }

    // Scheduling problems and image pulls show on the VMI while it waits for its pod.
    let scheduled_cond = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == POD_SCHEDULED));
    let pod_scheduled = VirtualMachineInstanceConditionType::Other(POD_SCHEDULED.into());
    match scheduled_cond {
        Some(c) if c.status == "False" && status.phase == Some(Ph::Scheduling) => set_condition(
            &mut status,
            pod_scheduled,
            ConditionStatus::False,
            c.reason.as_deref().unwrap_or("Unschedulable"),
            c.message.clone().unwrap_or_default(),
            now,
        ),
        _ => remove_condition(&mut status, &pod_scheduled, None),
    }
    if let Some((reason, message)) = image_pull_problem(pod) {
        set_condition(
            &mut status,
            VirtualMachineInstanceConditionType::Synchronized,
            ConditionStatus::False,
            reason,
            message,
            now,
        );
    } else {
        for reason in [events::ERR_IMAGE_PULL, events::IMAGE_PULL_BACK_OFF] {
            remove_condition(
                &mut status,
                &VirtualMachineInstanceConditionType::Synchronized,
                Some(reason),
            );
        }
    }

    if status.phase == Some(Ph::Scheduling)
        && launcher_ready(pod)
        && let Some(node) = pod_node(pod)
    {
        set_phase(&mut status, Ph::Scheduled, now);
        status.node_name = Some(node.to_owned());
        out.node_label = Some(node.to_owned());
    }
    // Every launcher pod with a node: the target virt-handler finds the migration target pod
    // here. Pods gone from the cache go.
    if status.phase != Some(Ph::Scheduling) {
        for p in &mine {
            if let (Some(uid), Some(node)) = (p.metadata.uid.as_deref(), pod_node(p)) {
                status.active_pods.insert(uid.to_owned(), node.to_owned());
            }
        }
    }
    status
        .active_pods
        .retain(|uid, _| mine.iter().any(|p| p.metadata.uid.as_deref() == Some(uid)));
    if status.phase == Some(Ph::Running) {
        api::migration::set_live_migration_status(&mut status, vmi, pvc_shared, &Time(now));
    }
    let leftovers = leftover_pods(vmi, &mine, pod);
    if !leftovers.is_empty() {
        out.pods = PodAction::Delete(leftovers);
    }
    out.status = status;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::VirtualMachineInstanceSpec;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus,
        PodCondition, PodSpec, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
    use pretty_assertions::assert_eq;

    use VirtualMachineInstancePhase as Ph;

    fn now() -> Timestamp {
        "2026-01-01T00:00:00Z".parse().unwrap()
    }

    fn vmi(phase: Option<Ph>) -> VirtualMachineInstance {
        let mut v = VirtualMachineInstance::new("a", VirtualMachineInstanceSpec::default());
        v.metadata.uid = Some("vmi-uid".into());
        v.status = phase.map(|p| VirtualMachineInstanceStatus {
            phase: Some(p),
            ..Default::default()
        });
        v
    }

    fn pod(phase: &str, node: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("virt-launcher-a-xyz12".into()),
                uid: Some("pod-uid".into()),
                owner_references: Some(vec![OwnerReference {
                    uid: "vmi-uid".into(),
                    controller: Some(true),
                    ..OwnerReference::default()
                }]),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(Into::into),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..PodStatus::default()
            }),
        }
    }

    fn phase_after(vmi: &VirtualMachineInstance, pods: &[Pod]) -> Option<Ph> {
        sync(vmi, pods, &[], now()).status.phase
    }

    /// A missing claim holds the pod back with KubeVirt's `FailedPvcNotFound`; once the claim
    /// exists the pod is created and the condition goes.
    #[test]
    fn a_missing_claim_holds_the_launcher_pod_back() {
        let synchronized = VirtualMachineInstanceConditionType::Synchronized;
        let mut out = sync(&vmi(Some(Ph::Pending)), &[], &[], now());
        wait_for_claims(
            &mut out,
            Some(
                "spec.volumes[0].persistentVolumeClaim.claimName: PVC default/d does not exist"
                    .into(),
            ),
            now(),
        );
        assert_eq!(out.pods, PodAction::None);
        assert_eq!(out.status.phase, Some(Ph::Pending));
        let c = out.status.condition(&synchronized).unwrap();
        assert_eq!(
            (c.status.clone(), c.reason.as_deref(), c.message.as_deref()),
            (
                ConditionStatus::False,
                Some("FailedPvcNotFound"),
                Some(
                    "spec.volumes[0].persistentVolumeClaim.claimName: PVC default/d does not \
                     exist, waiting for it to appear"
                )
            )
        );
        let mut waiting = vmi(Some(Ph::Pending));
        waiting.status = Some(out.status);
        let mut out = sync(&waiting, &[], &[], now());
        wait_for_claims(&mut out, None, now());
        assert_eq!(out.pods, PodAction::Create);
        assert!(out.status.condition(&synchronized).is_none());
    }

    /// A backend-storage problem holds the pod back with its reason; another replaces it, and
    /// the condition goes with the last one.
    #[test]
    fn backend_storage_problems_hold_the_launcher_pod_back() {
        let synchronized = VirtualMachineInstanceConditionType::Synchronized;
        let reason = |out: &VmiSync| {
            out.status
                .condition(&synchronized)
                .and_then(|c| c.reason.clone())
        };
        let mut out = sync(&vmi(Some(Ph::Pending)), &[], &[], now());
        let none = (
            "FailedBackendStorageCreate",
            "no default storage class found".into(),
        );
        wait_for_backend_storage(&mut out, Some(none), now());
        assert_eq!(out.pods, PodAction::None);
        assert_eq!(reason(&out).as_deref(), Some("FailedBackendStorageCreate"));
        let mut waiting = vmi(Some(Ph::Pending));
        waiting.status = Some(out.status);
        let mut out = sync(&waiting, &[], &[], now());
        wait_for_backend_storage(
            &mut out,
            Some(("BackendStorageNotReady", "PVC pending".into())),
            now(),
        );
        assert_eq!(reason(&out).as_deref(), Some("BackendStorageNotReady"));
        waiting.status = Some(out.status);
        let mut out = sync(&waiting, &[], &[], now());
        wait_for_backend_storage(&mut out, None, now());
        assert_eq!(out.pods, PodAction::Create);
        assert_eq!(reason(&out), None);
    }

    #[test]
    fn phase_table() {
        let foreign = {
            let mut p = pod("Running", Some("n1"));
            p.metadata.owner_references.as_mut().unwrap()[0].uid = "other".into();
            p
        };
        #[allow(clippy::type_complexity)]
        let cases: Vec<(&str, Option<Ph>, Vec<Pod>, Option<Ph>, PodAction)> = vec![
            (
                "new -> pending, create",
                None,
                vec![],
                Some(Ph::Pending),
                PodAction::Create,
            ),
            (
                "pending -> create",
                Some(Ph::Pending),
                vec![],
                Some(Ph::Pending),
                PodAction::Create,
            ),
            (
                "foreign pod ignored",
                Some(Ph::Pending),
                vec![foreign],
                Some(Ph::Pending),
                PodAction::Create,
            ),
            (
                "pod exists -> scheduling",
                Some(Ph::Pending),
                vec![pod("Pending", None)],
                Some(Ph::Scheduling),
                PodAction::None,
            ),
            (
                "bound, not running",
                Some(Ph::Scheduling),
                vec![pod("Pending", Some("n1"))],
                Some(Ph::Scheduling),
                PodAction::None,
            ),
            (
                "running -> scheduled",
                Some(Ph::Scheduling),
                vec![pod("Running", Some("n1"))],
                Some(Ph::Scheduled),
                PodAction::None,
            ),
            (
                "pod failed early",
                Some(Ph::Scheduling),
                vec![pod("Failed", Some("n1"))],
                Some(Ph::Failed),
                PodAction::None,
            ),
            (
                "pod failed while scheduled",
                Some(Ph::Scheduled),
                vec![pod("Failed", Some("n1"))],
                Some(Ph::Failed),
                PodAction::None,
            ),
            (
                "pod vanished",
                Some(Ph::Scheduling),
                vec![],
                Some(Ph::Failed),
                PodAction::None,
            ),
            (
                "pod vanished while running",
                Some(Ph::Running),
                vec![],
                Some(Ph::Failed),
                PodAction::None,
            ),
            (
                "running stays running",
                Some(Ph::Running),
                vec![pod("Running", Some("n1"))],
                Some(Ph::Running),
                PodAction::None,
            ),
            (
                "final deletes pod",
                Some(Ph::Succeeded),
                vec![pod("Running", Some("n1"))],
                Some(Ph::Succeeded),
                PodAction::Delete(vec!["virt-launcher-a-xyz12".into()]),
            ),
        ];
        for (name, phase, pods, want_phase, want_action) in cases {
            let out = sync(&vmi(phase), &pods, &[], now());
            assert_eq!(
                (out.status.phase, out.pods),
                (want_phase, want_action),
                "{name}"
            );
        }
    }

    #[test]
    fn scheduled_sets_node_label_and_active_pods() {
        let out = sync(
            &vmi(Some(Ph::Scheduling)),
            &[pod("Running", Some("n1"))],
            &[],
            now(),
        );
        assert_eq!(out.status.node_name.as_deref(), Some("n1"));
        assert_eq!(out.node_label.as_deref(), Some("n1"));
        assert_eq!(
            out.status.active_pods.get("pod-uid").map(String::as_str),
            Some("n1")
        );
        let stamps: Vec<_> = out
            .status
            .phase_transition_timestamps
            .iter()
            .map(|t| t.phase.clone())
            .collect();
        assert_eq!(stamps, [Some(Ph::Scheduled)]);
    }

    #[test]
    fn scheduled_waits_for_sidecar_containers() {
        let mut p = pod("Running", Some("n1"));
        p.status.as_mut().unwrap().container_statuses = Some(vec![
            ContainerStatus {
                name: "compute".into(),
                ready: false,
                ..ContainerStatus::default()
            },
            ContainerStatus {
                name: "volumedisk".into(),
                ready: false,
                ..ContainerStatus::default()
            },
        ]);
        assert_eq!(
            phase_after(&vmi(Some(Ph::Scheduling)), std::slice::from_ref(&p)),
            Some(Ph::Scheduling)
        );
        p.status
            .as_mut()
            .unwrap()
            .container_statuses
            .as_mut()
            .unwrap()[1]
            .ready = true;
        assert_eq!(
            phase_after(&vmi(Some(Ph::Scheduling)), &[p]),
            Some(Ph::Scheduled),
            "compute may be unready"
        );
    }

    #[test]
    fn an_exited_launcher_fails_the_vmi_while_the_pod_still_runs() {
        let mut p = pod("Running", Some("n1"));
        p.status.as_mut().unwrap().container_statuses = Some(vec![
            ContainerStatus {
                name: "compute".into(),
                state: Some(ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 1,
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                }),
                ..ContainerStatus::default()
            },
            ContainerStatus {
                name: "volumedisk".into(),
                ready: true,
                ..ContainerStatus::default()
            },
        ]);
        let out = sync(&vmi(Some(Ph::Scheduled)), &[p], &[], now());
        assert_eq!(out.status.phase, Some(Ph::Failed));
        assert_eq!(out.status.reason.as_deref(), Some("PodFailed"));
    }

    #[test]
    fn validation_failure_gets_a_condition_and_no_pod() {
        let errors = vec![
            FieldError {
                path: "spec.domain.devices.disks[0].name".into(),
                message: "no volume named \"x\"".into(),
            },
            FieldError {
                path: "spec.domain.cpu.cores".into(),
                message: "must be positive".into(),
            },
        ];
        let out = sync(&vmi(None), &[], &errors, now());
        assert_eq!(out.pods, PodAction::None);
        assert_eq!(out.status.phase, Some(Ph::Pending));
        let c = out
            .status
            .condition(&VirtualMachineInstanceConditionType::Synchronized)
            .unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_deref()),
            ("False", Some(FAILED_VALIDATION))
        );
        assert_eq!(
            c.message.as_deref(),
            Some(
                "spec.domain.devices.disks[0].name: no volume named \"x\"; spec.domain.cpu.cores: must be positive"
            )
        );
    }

    #[test]
    fn deleting_vmi_deletes_pods_then_fails_and_releases() {
        let mut v = vmi(Some(Ph::Scheduled));
        v.metadata.deletion_timestamp = Some(Time(now()));
        let out = sync(&v, &[pod("Running", Some("n1"))], &[], now());
        assert_eq!(
            out.pods,
            PodAction::Delete(vec!["virt-launcher-a-xyz12".into()])
        );
        assert!(!out.release_finalizer);
        let out = sync(&v, &[], &[], now());
        assert_eq!(
            (out.status.phase, out.release_finalizer),
            (Some(Ph::Failed), true)
        );
    }

    #[test]
    fn unschedulable_and_image_pull_conditions() {
        let mut p = pod("Pending", None);
        let st = p.status.as_mut().unwrap();
        st.conditions = Some(vec![PodCondition {
            type_: POD_SCHEDULED.into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            message: Some("0/1 nodes are available".into()),
            ..PodCondition::default()
        }]);
        st.container_statuses = Some(vec![ContainerStatus {
            name: "volumedisk0".into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("ErrImagePull".into()),
                    message: Some("not found".into()),
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]);
        let out = sync(&vmi(Some(Ph::Scheduling)), &[p], &[], now());
        let sched = out
            .status
            .condition(&VirtualMachineInstanceConditionType::Other(
                POD_SCHEDULED.into(),
            ))
            .unwrap();
        assert_eq!(sched.reason.as_deref(), Some("Unschedulable"));
        let sync_c = out
            .status
            .condition(&VirtualMachineInstanceConditionType::Synchronized)
            .unwrap();
        assert_eq!(sync_c.reason.as_deref(), Some("ErrImagePull"));
        assert_eq!(
            sync_c.message.as_deref(),
            Some("container volumedisk0: not found")
        );
    }

    fn paused(v: &mut VirtualMachineInstance, status: ConditionStatus) {
        v.status
            .get_or_insert_default()
            .conditions
            .push(VirtualMachineInstanceCondition {
                type_: VirtualMachineInstanceConditionType::Paused,
                status,
                last_probe_time: None,
                last_transition_time: None,
                reason: None,
                message: None,
            });
    }

    fn with_unpaused(mut p: Pod, status: &str) -> Pod {
        p.status.get_or_insert_default().conditions = Some(vec![PodCondition {
            type_: labels::VIRTUAL_MACHINE_UNPAUSED.into(),
            status: status.into(),
            ..PodCondition::default()
        }]);
        p
    }

    #[test]
    fn unpaused_pod_condition_follows_the_paused_vmi() {
        let running = pod("Running", Some("n1"));
        let mut is_paused = vmi(Some(Ph::Running));
        paused(&mut is_paused, ConditionStatus::True);
        let mut was_paused = vmi(Some(Ph::Running));
        paused(&mut was_paused, ConditionStatus::False);
        let cases = vec![
            (
                "new pod of a running guest",
                vmi(Some(Ph::Running)),
                running.clone(),
                Some("True"),
            ),
            (
                "new pod while scheduling",
                vmi(Some(Ph::Pending)),
                pod("Pending", None),
                Some("True"),
            ),
            (
                "already True",
                vmi(Some(Ph::Running)),
                with_unpaused(running.clone(), "True"),
                None,
            ),
            (
                "paused: True -> False",
                is_paused.clone(),
                with_unpaused(running.clone(), "True"),
                Some("False"),
            ),
            (
                "paused and already False",
                is_paused.clone(),
                with_unpaused(running.clone(), "False"),
                None,
            ),
            ("paused, never had it", is_paused, running.clone(), None),
            (
                "unpaused again: False -> True",
                was_paused,
                with_unpaused(running.clone(), "False"),
                Some("True"),
            ),
            (
                "failed pod left alone",
                vmi(Some(Ph::Running)),
                pod("Failed", Some("n1")),
                None,
            ),
        ];
        for (name, v, p, want) in cases {
            let out = sync(&v, &[p], &[], now());
            let got = out.pod_condition.map(|(pod_name, c)| {
                assert_eq!(pod_name, "virt-launcher-a-xyz12", "{name}");
                assert_eq!(c.type_, labels::VIRTUAL_MACHINE_UNPAUSED, "{name}");
                assert_eq!(
                    c.reason.as_deref(),
                    Some(if c.status == "True" {
                        "NotPaused"
                    } else {
                        "Paused"
                    }),
                    "{name}"
                );
                c.status
            });
            assert_eq!(got.as_deref(), want, "{name}");
        }
    }

    fn migrating_pods() -> (Pod, Pod) {
        let source = pod("Running", Some("n1"));
        let mut target = pod("Running", Some("n2"));
        target.metadata.name = Some("virt-launcher-a-tgt".into());
        target.metadata.uid = Some("tgt-uid".into());
        target.metadata.labels =
            Some([(labels::MIGRATION_JOB_UID.to_owned(), "mig-uid".to_owned())].into());
        (source, target)
    }

    fn on_node(phase: Ph, node: &str) -> VirtualMachineInstance {
        let mut v = vmi(Some(phase));
        v.status.as_mut().unwrap().node_name = Some(node.into());
        v
    }

    fn exited(mut p: Pod) -> Pod {
        p.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
            name: "compute".into(),
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated::default()),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]);
        p
    }

    #[test]
    fn current_pod_during_and_after_a_migration() {
        let (source, target) = migrating_pods();
        let both = [target.clone(), source.clone()];
        let name = |v: &VirtualMachineInstance, pods: &[Pod]| {
            current_pod(v, pods).and_then(|p| p.metadata.name.clone())
        };
        assert_eq!(
            name(&on_node(Ph::Running, "n1"), &both).as_deref(),
            Some("virt-launcher-a-xyz12"),
            "the source while the guest runs there"
        );
        assert_eq!(
            name(&on_node(Ph::Running, "n2"), &both).as_deref(),
            Some("virt-launcher-a-tgt"),
            "the target once the VMI moved"
        );
        assert_eq!(
            name(&on_node(Ph::Running, "n1"), std::slice::from_ref(&target)),
            None,
            "a target pod off the VMI's node never is"
        );
        assert_eq!(
            name(&vmi(Some(Ph::Pending)), &[target, source]).as_deref(),
            Some("virt-launcher-a-xyz12"),
            "no node yet: not a migration target"
        );
    }

    #[test]
    fn migration_pods_in_active_pods_and_never_failing_the_vmi() {
        let (source, target) = migrating_pods();
        // The target scheduled: both pods active, the VMI runs on.
        let out = sync(
            &on_node(Ph::Running, "n1"),
            &[source.clone(), target.clone()],
            &[],
            now(),
        );
        assert_eq!(out.status.phase, Some(Ph::Running));
        assert_eq!(
            out.status.active_pods,
            [
                ("pod-uid".to_owned(), "n1".to_owned()),
                ("tgt-uid".to_owned(), "n2".to_owned())
            ]
            .into()
        );
        assert_eq!(out.pods, PodAction::None);

        // A failed target: not a reason to fail the VMI; the migration controller deletes it
        // while its migration is in flight.
        let mut migrating = on_node(Ph::Running, "n1");
        migrating.status.as_mut().unwrap().migration_state =
            Some(api::status::VirtualMachineInstanceMigrationState {
                migration_uid: Some("mig-uid".into()),
                ..Default::default()
            });
        let out = sync(
            &migrating,
            &[source.clone(), exited(target.clone())],
            &[],
            now(),
        );
        assert_eq!(
            (out.status.phase, out.pods),
            (Some(Ph::Running), PodAction::None)
        );

        // After the migration: the old source pod, its launcher exited, is deleted; the VMI
        // runs on in the target pod. Pods gone from the cache leave activePods.
        let mut moved = on_node(Ph::Running, "n2");
        moved.status.as_mut().unwrap().active_pods = [("gone".to_owned(), "n0".to_owned())].into();
        let out = sync(
            &moved,
            &[exited(source.clone()), target.clone()],
            &[],
            now(),
        );
        assert_eq!(out.status.phase, Some(Ph::Running));
        assert_eq!(
            out.pods,
            PodAction::Delete(vec!["virt-launcher-a-xyz12".into()])
        );
        assert!(!out.status.active_pods.contains_key("gone"));
        // Still running on the source side: left for virt-handler to stop.
        let out = sync(&moved, &[source, target], &[], now());
        assert_eq!(out.pods, PodAction::None);
    }

    #[test]
    fn live_migratable_condition_and_method_on_running_vmis() {
        let mut v = on_node(Ph::Running, "n1");
        let running = [pod("Running", Some("n1"))];
        let out = sync(&v, &running, &[], now());
        let c = out
            .status
            .condition(&VirtualMachineInstanceConditionType::LiveMigratable)
            .unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_deref()), ("True", None));
        assert_eq!(
            out.status.migration_method.as_deref(),
            Some("LiveMigration")
        );
        // Unchanged: the status is the same, so nothing is written.
        v.status = Some(out.status.clone());
        assert_eq!(sync(&v, &running, &[], now()).status, out.status);

        // A claim of unknown access mode, then a shared one.
        v.spec.volumes = vec![
            serde_json::from_value(serde_json::json!({
                "name": "data", "persistentVolumeClaim": {"claimName": "pvc-1"}
            }))
            .unwrap(),
        ];
        let out = sync(&v, &running, &[], now());
        let c = out
            .status
            .condition(&VirtualMachineInstanceConditionType::LiveMigratable)
            .unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_deref()),
            ("False", Some("DisksNotLiveMigratable"))
        );
        let out = sync_with(&v, &running, &[], &|_| Some(true), now());
        let c = out
            .status
            .condition(&VirtualMachineInstanceConditionType::LiveMigratable)
            .unwrap();
        assert_eq!(c.status.as_str(), "True");

        // Not Running: not computed.
        let out = sync(
            &vmi(Some(Ph::Scheduling)),
            &[pod("Pending", None)],
            &[],
            now(),
        );
        assert!(
            out.status
                .condition(&VirtualMachineInstanceConditionType::LiveMigratable)
                .is_none()
        );
    }
}
