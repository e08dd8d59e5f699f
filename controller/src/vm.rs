//! The VM controller's decisions as pure functions: what to do about a VM's instance given
//! its run strategy, queued state-change requests and crash-loop back-off, and the VM status
//! that follows (`pkg/virt-controller/watch/vm/vm.go`: `syncRunStrategy`, `updateStatus`,
//! `setPrintableStatus`, `syncStartFailureStatus`, `syncConditions`).

use std::collections::BTreeMap;
use std::time::Duration;

use api::common::ConditionStatus;
use api::labels;
use api::status::{VirtualMachineInstanceCondition, VirtualMachineInstanceConditionType};
use api::vm::{
    RunStrategy, StateChangeRequestAction, VirtualMachineCondition, VirtualMachineConditionType,
    VirtualMachinePrintableStatus, VirtualMachineStartFailure,
};
use api::{
    VirtualMachine, VirtualMachineInstance, VirtualMachineInstancePhase, VirtualMachineStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::vmi::{is_final, phase_of};

/// Most a crash-looping VM waits before its next start (KubeVirt:
/// `defaultMaxCrashLoopBackoffDelaySeconds`).
pub const MAX_CRASH_LOOP_BACKOFF: Duration = Duration::from_mins(5);
/// The back-off unit: the n-th failure in a row waits `n² x` this (plus jitter).
pub const CRASH_LOOP_BACKOFF_UNIT: Duration = Duration::from_secs(10);

/// What to do about a VM's instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmAction {
    /// Nothing to do now.
    None,
    /// Create the instance.
    Start,
    /// Delete the instance (it is not already being deleted).
    Stop,
    /// Queue a start request for the failed instance's successor (RerunOnFailure); the
    /// instance is deleted on the next sync, once the request is stored.
    RequestStart,
    /// A start request on a Halted VM: switch it to Always (or `running: true`).
    SwitchToAlways,
    /// Wait for the crash-loop back-off, then look again.
    WaitBackoff(Duration),
}

/// The VM cannot be acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VmDecisionError {
    /// A run strategy kubevirt-rs does not implement (e.g. `WaitAsReceiver`) or does not know.
    #[error("spec.runStrategy: {0:?} is not supported")]
    UnsupportedRunStrategy(String),
}

/// The first queued request is a start.
pub fn has_start_request(vm: &VirtualMachine) -> bool {
    first_request(vm).is_some_and(|r| r.action == StateChangeRequestAction::Start)
}

/// The first queued request is a stop of this very instance.
pub fn has_stop_request_for(vm: &VirtualMachine, vmi: &VirtualMachineInstance) -> bool {
    first_request(vm).is_some_and(|r| {
        r.action == StateChangeRequestAction::Stop
            && r.uid.is_some()
            && r.uid.as_deref() == vmi.metadata.uid.as_deref()
    })
}

/// A start request is queued anywhere (kept until an instance runs again).
fn queues_start(vm: &VirtualMachine) -> bool {
    vm.status.as_ref().is_some_and(|s| {
        s.state_change_requests
            .iter()
            .any(|r| r.action == StateChangeRequestAction::Start)
    })
}

fn first_request(vm: &VirtualMachine) -> Option<&api::vm::VirtualMachineStateChangeRequest> {
    vm.status
        .as_ref()
        .and_then(|s| s.state_change_requests.first())
}

fn status_run_strategy(vm: &VirtualMachine) -> Option<&RunStrategy> {
    vm.status.as_ref().and_then(|s| s.run_strategy.as_ref())
}

fn deleting(meta: &ObjectMeta) -> bool {
    meta.deletion_timestamp.is_some()
}

/// Seconds of crash-loop back-off left at `now`.
pub fn backoff_left(vm: &VirtualMachine, now: Timestamp) -> Duration {
    let Some(retry) = vm
        .status
        .as_ref()
        .and_then(|s| s.start_failure.as_ref())
        .and_then(|f| f.retry_after_timestamp.as_ref())
    else {
        return Duration::ZERO;
    };
    Duration::try_from(retry.0.duration_since(now)).unwrap_or(Duration::ZERO)
}

/// What the run strategy asks for, given the VM's instance (KubeVirt's `syncRunStrategy`).
pub fn decide(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    now: Timestamp,
) -> Result<VmAction, VmDecisionError> {
    let strategy = vm.spec.effective_run_strategy();
    let start_unless_backing_off = || {
        let left = backoff_left(vm, now);
        if left > Duration::ZERO {
            VmAction::WaitBackoff(left)
        } else {
            VmAction::Start
        }
    };
    // Deleting an instance already being deleted is a no-op (KubeVirt's `stopVMI`). An
    // instance that failed to start stays until the VM's status holds its back-off: deleted
    // first, a sync that sees it gone but not the back-off (the write conflicted, or the VMI's
    // deletion arrived before the VM's update) starts the next one at once.
    let stop = |vmi: &VirtualMachineInstance| {
        if deleting(&vmi.metadata) || is_unrecorded_start_failure(vm, vmi) {
            VmAction::None
        } else {
            VmAction::Stop
        }
    };
    Ok(match strategy {
        RunStrategy::Always => match vmi {
            Some(vmi) if has_stop_request_for(vm, vmi) || is_final(vmi) => stop(vmi),
            Some(_) => VmAction::None,
            None => start_unless_backing_off(),
        },
        RunStrategy::RerunOnFailure => match vmi {
            Some(vmi) => {
                let phase = phase_of(vmi);
                let failed = phase == Some(VirtualMachineInstancePhase::Failed);
                let succeeded = phase == Some(VirtualMachineInstancePhase::Succeeded);
                if deleting(&vmi.metadata)
                    || !(has_stop_request_for(vm, vmi) || failed || succeeded)
                {
                    VmAction::None
                } else if failed && !queues_start(vm) {
                    // KubeVirt deletes first and then adds the request; a lost write of the
                    // request (a conflict, a restart) would then leave the VM stopped for
                    // good. Stored first, it outlives both.
                    VmAction::RequestStart
                } else if status_run_strategy(vm) != Some(&strategy) {
                    // This sync's status write records the strategy. Deleted before that,
                    // a sync that saw no instance would take the missing record for a switch
                    // to RerunOnFailure, and start one again.
                    VmAction::None
                } else {
                    stop(vmi)
                }
            }
            // Start on an explicit request, or when the strategy was just switched to this one.
            None if has_start_request(vm) || status_run_strategy(vm) != Some(&strategy) => {
                start_unless_backing_off()
            }
            None => VmAction::None,
        },
        RunStrategy::Manual => match vmi {
            Some(vmi) if has_stop_request_for(vm, vmi) => stop(vmi),
            None if has_start_request(vm) => VmAction::Start,
            Some(_) | None => VmAction::None,
        },
        RunStrategy::Halted => match vmi {
            Some(vmi) => stop(vmi),
            None if has_start_request(vm) => VmAction::SwitchToAlways,
            None => VmAction::None,
        },
        RunStrategy::Once => match vmi {
            Some(_) => VmAction::None,
            None => VmAction::Start,
        },
        other @ (RunStrategy::WaitAsReceiver | RunStrategy::Other(_)) => {
            return Err(VmDecisionError::UnsupportedRunStrategy(
                other.as_str().to_owned(),
            ));
        }
    })
}

/// Whether the VM is meant to be running (KubeVirt's `isSetToStart`).
pub fn is_set_to_start(vm: &VirtualMachine, vmi: Option<&VirtualMachineInstance>) -> bool {
    let strategy = vm.spec.effective_run_strategy();
    match strategy {
        RunStrategy::Always => true,
        RunStrategy::Manual => match vmi {
            Some(vmi) => !has_stop_request_for(vm, vmi),
            None => has_start_request(vm),
        },
        RunStrategy::RerunOnFailure => match vmi {
            Some(vmi) => phase_of(vmi) != Some(VirtualMachineInstancePhase::Succeeded),
            None => has_start_request(vm) || status_run_strategy(vm) != Some(&strategy),
        },
        RunStrategy::Once => vmi.is_none(),
        _ => false,
    }
}

/// The crash-loop delay after `fail_count` failures in a row: `10 s x count²` plus up to half
/// of that again as jitter (`jitter` in `0.0..1.0`, so VMs failing together spread out), at
/// most 300 s (KubeVirt's `calculateStartBackoffTime`).
pub fn start_backoff(fail_count: i32, jitter: f64) -> Duration {
    let count = u64::try_from(fail_count.max(1)).unwrap_or(1);
    let base = CRASH_LOOP_BACKOFF_UNIT
        .as_secs()
        .saturating_mul(count * count);
    let range = base / 2 + 1;
    // `jitter` is clamped to [0, 1), so the product is a small non-negative number of seconds.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let extra = (jitter.clamp(0.0, 0.999_999) * range as f64) as u64;
    Duration::from_secs(
        base.saturating_add(extra)
            .min(MAX_CRASH_LOOP_BACKOFF.as_secs()),
    )
}

/// The VMI this VM starts: template metadata and spec, the VM's name and namespace, a
/// controller owner reference to the VM, the VM controller's finalizer, the generation
/// annotation, a paused start when the first queued request asks for one (`virtctl start
/// --paused`) and, unless the template sets one, the firmware UUID derived from the VM's name
/// (KubeVirt's `SetupVMIFromVM` and `setupStableFirmwareUUID`).
pub fn vmi_from_vm(vm: &VirtualMachine) -> VirtualMachineInstance {
    let template_meta = vm.spec.template.metadata.clone().unwrap_or_default();
    let mut annotations = template_meta.annotations.unwrap_or_default();
    if let Some(generation) = vm.metadata.generation {
        annotations.insert(labels::VM_GENERATION.to_owned(), generation.to_string());
    }
    let metadata = ObjectMeta {
        name: vm.metadata.name.clone(),
        namespace: vm.metadata.namespace.clone(),
        labels: template_meta.labels,
        annotations: Some(annotations),
        owner_references: Some(vec![controller_ref(vm)]),
        finalizers: Some(vec![api::labels::VM_CONTROLLER_FINALIZER.to_owned()]),
        ..ObjectMeta::default()
    };
    let mut spec = vm.spec.template.spec.clone().unwrap_or_default();
    if first_request(vm).is_some_and(api::vm::VirtualMachineStateChangeRequest::starts_paused) {
        spec.start_strategy = Some(api::vmi::START_STRATEGY_PAUSED.to_owned());
    }
    let firmware = spec.domain.firmware.get_or_insert_default();
    if firmware.uuid.is_none() {
        firmware.uuid = Some(api::vm::stable_firmware_uuid(
            vm.metadata.name.as_deref().unwrap_or_default(),
        ));
    }
    VirtualMachineInstance {
        metadata,
        spec,
        status: None,
    }
}

/// A controller owner reference pointing at `vm`.
pub fn controller_ref(vm: &VirtualMachine) -> OwnerReference {
    OwnerReference {
        api_version: "kubevirt.io/v1".into(),
        kind: "VirtualMachine".into(),
        name: vm.metadata.name.clone().unwrap_or_default(),
        uid: vm.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// What the status computation needs beyond the VM and its instance.
#[derive(Debug, Clone)]
pub struct StatusInputs {
    /// The controller still expects its VMI creation to show up.
    pub start_expected: bool,
    /// The controller still expects its VMI deletion to show up.
    pub stop_expected: bool,
    /// Why the last sync failed: (reason, message).
    pub sync_error: Option<(String, String)>,
    /// Now.
    pub now: Timestamp,
    /// Back-off jitter in `0.0..1.0`.
    pub jitter: f64,
}

fn vmi_condition<'a>(
    vmi: Option<&'a VirtualMachineInstance>,
    type_: &VirtualMachineInstanceConditionType,
) -> Option<&'a VirtualMachineInstanceCondition> {
    vmi.and_then(|v| v.status.as_ref())
        .and_then(|s| s.condition(type_))
}

fn vmi_condition_is(
    vmi: Option<&VirtualMachineInstance>,
    type_: &VirtualMachineInstanceConditionType,
    status: &ConditionStatus,
    reason: Option<&str>,
) -> bool {
    vmi_condition(vmi, type_).is_some_and(|c| {
        &c.status == status && reason.is_none_or(|r| c.reason.as_deref() == Some(r))
    })
}

fn was_running(vmi: &VirtualMachineInstance) -> bool {
    vmi.status.as_ref().is_some_and(|s| {
        s.phase_transition_timestamps
            .iter()
            .any(|t| t.phase == Some(VirtualMachineInstancePhase::Running))
            || s.phase == Some(VirtualMachineInstancePhase::Running)
    })
}

/// The VM status after a sync (KubeVirt's `updateStatus` minus volume and snapshot parts).
pub fn next_status(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    inputs: &StatusInputs,
) -> VirtualMachineStatus {
    let mut status = vm.status.clone().unwrap_or_default();
    let created = vmi.is_some();
    status.created = Some(created);
    status.ready = Some(vmi_condition_is(
        vmi,
        &VirtualMachineInstanceConditionType::Ready,
        &ConditionStatus::True,
        None,
    ));
    // Recorded from the first start on, so RerunOnFailure can tell a fresh switch to it.
    if status.run_strategy.is_some() || created {
        status.run_strategy = Some(vm.spec.effective_run_strategy());
    }
    if trim_first_request(&status, vmi) {
        status.state_change_requests.remove(0);
    }
    sync_start_failure(vm, vmi, &mut status, inputs);
    sync_conditions(vmi, &mut status, inputs);
    status.printable_status = Some(printable_status(vm, vmi, &status, inputs));
    status
}

/// KubeVirt's `isTrimFirstChangeRequestNeeded`: a request is dropped once it took effect.
fn trim_first_request(status: &VirtualMachineStatus, vmi: Option<&VirtualMachineInstance>) -> bool {
    let Some(first) = status.state_change_requests.first() else {
        return false;
    };
    match first.action {
        StateChangeRequestAction::Stop => match vmi {
            None => true,
            Some(vmi) => first.uid.is_none() || first.uid.as_deref() != vmi.metadata.uid.as_deref(),
        },
        StateChangeRequestAction::Start => {
            vmi.is_some_and(|v| !deleting(&v.metadata) && !is_final(v))
        }
        StateChangeRequestAction::Other(_) => true,
    }
}

fn restarts(vm: &VirtualMachine) -> bool {
    matches!(
        vm.spec.effective_run_strategy(),
        RunStrategy::Always | RunStrategy::RerunOnFailure | RunStrategy::Once
    )
}

/// The instance ended without ever running, and the VM's status does not count it yet.
fn is_unrecorded_start_failure(vm: &VirtualMachine, vmi: &VirtualMachineInstance) -> bool {
    restarts(vm)
        && is_final(vmi)
        && !was_running(vmi)
        && vm
            .status
            .as_ref()
            .and_then(|s| s.start_failure.as_ref())
            .is_none_or(|f| f.last_failed_vmi_uid != vmi.metadata.uid)
}

fn sync_start_failure(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    status: &mut VirtualMachineStatus,
    inputs: &StatusInputs,
) {
    if vmi.is_some_and(was_running) || !restarts(vm) {
        status.start_failure = None;
        return;
    }
    let Some(vmi) = vmi.filter(|v| is_unrecorded_start_failure(vm, v)) else {
        return;
    };
    let uid = vmi.metadata.uid.clone();
    let previous = status.start_failure.as_ref();
    let count = previous.and_then(|f| f.consecutive_fail_count).unwrap_or(0) + 1;
    let delay = start_backoff(count, inputs.jitter);
    let retry = inputs
        .now
        .saturating_add(SignedDuration::try_from(delay).unwrap_or(SignedDuration::ZERO))
        .unwrap_or(inputs.now);
    status.start_failure = Some(VirtualMachineStartFailure {
        last_failed_vmi_uid: uid,
        retry_after_timestamp: Some(Time(retry)),
        consecutive_fail_count: Some(count),
    });
}

fn set_condition(status: &mut VirtualMachineStatus, c: VirtualMachineCondition) {
    match status.conditions.iter_mut().find(|x| x.type_ == c.type_) {
        // Keep the transition time when only the probe or message changed.
        Some(old) if old.status == c.status && old.reason == c.reason => {
            old.message = c.message;
        }
        Some(old) => *old = c,
        None => status.conditions.push(c),
    }
}

fn sync_conditions(
    vmi: Option<&VirtualMachineInstance>,
    status: &mut VirtualMachineStatus,
    inputs: &StatusInputs,
) {
    let now = Some(Time(inputs.now));
    let ready = match vmi {
        None => VirtualMachineCondition {
            type_: VirtualMachineConditionType::Ready,
            status: ConditionStatus::False,
            reason: Some("VMINotExists".into()),
            message: Some("VMI does not exist".into()),
            last_probe_time: now.clone(),
            last_transition_time: now.clone(),
        },
        Some(v) => match vmi_condition(Some(v), &VirtualMachineInstanceConditionType::Ready) {
            None => VirtualMachineCondition {
                type_: VirtualMachineConditionType::Ready,
                status: ConditionStatus::False,
                reason: Some("VMIConditionMissing".into()),
                message: Some("VMI is missing the Ready condition".into()),
                last_probe_time: now.clone(),
                last_transition_time: now.clone(),
            },
            Some(c) => VirtualMachineCondition {
                type_: VirtualMachineConditionType::Ready,
                status: c.status.clone(),
                reason: c.reason.clone(),
                message: c.message.clone(),
                last_probe_time: c.last_probe_time.clone(),
                last_transition_time: c.last_transition_time.clone(),
            },
        },
    };
    set_condition(status, ready);
    match &inputs.sync_error {
        None => status
            .conditions
            .retain(|c| c.type_ != VirtualMachineConditionType::Failure),
        Some((reason, message)) => set_condition(
            status,
            VirtualMachineCondition {
                type_: VirtualMachineConditionType::Failure,
                status: ConditionStatus::True,
                reason: Some(reason.clone()),
                message: Some(message.clone()),
                last_probe_time: None,
                last_transition_time: now,
            },
        ),
    }
    let Some(vmi) = vmi else {
        return;
    };
    // Every other VMI condition is mirrored onto the VM, and VM conditions the VMI no longer
    // has are dropped; Ready, Failure and RestartRequired are the VM's own.
    let own = |t: &str| {
        matches!(
            VirtualMachineConditionType::from(t),
            VirtualMachineConditionType::Ready
                | VirtualMachineConditionType::Failure
                | VirtualMachineConditionType::RestartRequired
        )
    };
    let mirrored: BTreeMap<String, &VirtualMachineInstanceCondition> = vmi
        .status
        .iter()
        .flat_map(|s| s.conditions.iter())
        .filter(|c| !own(c.type_.as_str()))
        .map(|c| (c.type_.as_str().to_owned(), c))
        .collect();
    status
        .conditions
        .retain(|c| own(c.type_.as_str()) || mirrored.contains_key(c.type_.as_str()));
    for (t, c) in mirrored {
        set_condition(
            status,
            VirtualMachineCondition {
                type_: VirtualMachineConditionType::from(t.as_str()),
                status: c.status.clone(),
                reason: c.reason.clone(),
                message: c.message.clone(),
                last_probe_time: c.last_probe_time.clone(),
                last_transition_time: c.last_transition_time.clone(),
            },
        );
    }
}

/// KubeVirt's `setPrintableStatus`: the first matching state, in KubeVirt's order.
pub fn printable_status(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    status: &VirtualMachineStatus,
    inputs: &StatusInputs,
) -> VirtualMachinePrintableStatus {
    use VirtualMachinePrintableStatus as P;
    let phase = vmi.and_then(phase_of);
    let final_ = vmi.is_some_and(is_final);
    let paused = vmi_condition_is(
        vmi,
        &VirtualMachineInstanceConditionType::Paused,
        &ConditionStatus::True,
        None,
    );
    let running = phase == Some(VirtualMachineInstancePhase::Running);
    let synchronized_false = |reason| {
        vmi_condition_is(
            vmi,
            &VirtualMachineInstanceConditionType::Synchronized,
            &ConditionStatus::False,
            Some(reason),
        )
    };
    let migrating = vmi
        .and_then(|v| v.status.as_ref())
        .and_then(|s| s.migration_state.as_ref())
        .is_some_and(|m| {
            m.start_timestamp.is_some() && m.completed != Some(true) && m.failed != Some(true)
        });
    let crash_looping = !inputs.start_expected
        && (vmi.is_none() || final_)
        && status
            .start_failure
            .as_ref()
            .and_then(|f| f.consecutive_fail_count)
            .is_some_and(|n| n > 0)
        && matches!(
            vm.spec.effective_run_strategy(),
            RunStrategy::Always | RunStrategy::RerunOnFailure | RunStrategy::Once
        );
    if deleting(&vm.metadata) {
        P::Terminating
    } else if vmi.is_some_and(|v| !final_ && (deleting(&v.metadata) || inputs.stop_expected)) {
        P::Stopping
    } else if migrating {
        P::Migrating
    } else if running && paused {
        P::Paused
    } else if running {
        P::Running
    } else if synchronized_false(crate::events::FAILED_PVC_NOT_FOUND) {
        P::ErrorPvcNotFound
    } else if vmi_condition_is(
        vmi,
        &VirtualMachineInstanceConditionType::Other("PodScheduled".into()),
        &ConditionStatus::False,
        Some("Unschedulable"),
    ) {
        P::ErrorUnschedulable
    } else if synchronized_false(crate::events::ERR_IMAGE_PULL) {
        P::ErrImagePull
    } else if synchronized_false(crate::events::IMAGE_PULL_BACK_OFF) {
        P::ImagePullBackOff
    } else if match vmi {
        None => inputs.start_expected,
        Some(_) => matches!(
            phase,
            None | Some(
                VirtualMachineInstancePhase::Pending
                    | VirtualMachineInstancePhase::Scheduling
                    | VirtualMachineInstancePhase::Scheduled
            )
        ),
    } {
        P::Starting
    } else if crash_looping {
        P::CrashLoopBackOff
    } else if vmi.map_or(!inputs.start_expected, |_| final_) {
        P::Stopped
    } else {
        P::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::vm::{VirtualMachineSpec, VirtualMachineStateChangeRequest};
    use api::{VirtualMachineInstanceSpec, VirtualMachineInstanceStatus};
    use pretty_assertions::assert_eq;

    fn now() -> Timestamp {
        "2026-01-01T00:00:00Z".parse().unwrap()
    }

    fn vm(strategy: Option<&str>, running: Option<bool>) -> VirtualMachine {
        let mut vm = VirtualMachine::new(
            "vm1",
            VirtualMachineSpec {
                run_strategy: strategy.map(RunStrategy::from),
                running,
                ..VirtualMachineSpec::default()
            },
        );
        vm.metadata.namespace = Some("ns".into());
        vm.metadata.uid = Some("vm-uid".into());
        vm.metadata.generation = Some(3);
        vm
    }

    fn with_request(mut vm: VirtualMachine, action: &str, uid: Option<&str>) -> VirtualMachine {
        vm.status
            .get_or_insert_with(Default::default)
            .state_change_requests
            .push(VirtualMachineStateChangeRequest {
                action: action.into(),
                data: BTreeMap::new(),
                uid: uid.map(Into::into),
            });
        vm
    }

    fn vmi(phase: Option<VirtualMachineInstancePhase>) -> VirtualMachineInstance {
        let mut v = VirtualMachineInstance::new("vm1", VirtualMachineInstanceSpec::default());
        v.metadata.uid = Some("vmi-uid".into());
        v.status = Some(VirtualMachineInstanceStatus {
            phase,
            ..Default::default()
        });
        v
    }

    fn deleting_vmi(phase: Option<VirtualMachineInstancePhase>) -> VirtualMachineInstance {
        let mut v = vmi(phase);
        v.metadata.deletion_timestamp = Some(Time(now()));
        v
    }

    fn inputs() -> StatusInputs {
        StatusInputs {
            start_expected: false,
            stop_expected: false,
            sync_error: None,
            now: now(),
            jitter: 0.0,
        }
    }

    use VirtualMachineInstancePhase as Ph;
    use VmAction as A;

    #[test]
    fn run_strategy_table() {
        let running = || Some(vmi(Some(Ph::Running)));
        // Ended after it ran: no start failure to record first.
        let ended = |phase| {
            let mut v = vmi(Some(phase));
            v.status.get_or_insert_default().phase_transition_timestamps =
                vec![serde_json::from_value(serde_json::json!({"phase": "Running"})).unwrap()];
            Some(v)
        };
        let counted = |mut vm: VirtualMachine| {
            vm.status.get_or_insert_default().start_failure = Some(VirtualMachineStartFailure {
                last_failed_vmi_uid: Some("vmi-uid".into()),
                retry_after_timestamp: None,
                consecutive_fail_count: Some(1),
            });
            vm
        };
        // The strategy is in the status from the first start on.
        let rerun = || {
            let mut vm = vm(Some("RerunOnFailure"), None);
            vm.status.get_or_insert_default().run_strategy = Some(RunStrategy::RerunOnFailure);
            vm
        };
        let cases: Vec<(
            &str,
            VirtualMachine,
            Option<VirtualMachineInstance>,
            VmAction,
        )> = vec![
            ("always, none", vm(Some("Always"), None), None, A::Start),
            (
                "always, running",
                vm(Some("Always"), None),
                running(),
                A::None,
            ),
            (
                "always, failed",
                vm(Some("Always"), None),
                ended(Ph::Failed),
                A::Stop,
            ),
            (
                "always, succeeded",
                vm(Some("Always"), None),
                ended(Ph::Succeeded),
                A::Stop,
            ),
            (
                "always, failed to start, not yet counted",
                vm(Some("Always"), None),
                Some(vmi(Some(Ph::Failed))),
                A::None,
            ),
            (
                "always, failed to start, counted",
                counted(vm(Some("Always"), None)),
                Some(vmi(Some(Ph::Failed))),
                A::Stop,
            ),
            (
                "always, failed+deleting",
                vm(Some("Always"), None),
                Some(deleting_vmi(Some(Ph::Failed))),
                A::None,
            ),
            (
                "always, restart request",
                with_request(vm(Some("Always"), None), "Stop", Some("vmi-uid")),
                running(),
                A::Stop,
            ),
            (
                "always, stop for other uid",
                with_request(vm(Some("Always"), None), "Stop", Some("old")),
                running(),
                A::None,
            ),
            ("running=true", vm(None, Some(true)), None, A::Start),
            ("running=false", vm(None, Some(false)), running(), A::Stop),
            ("neither set", vm(None, None), None, A::None),
            ("halted, none", vm(Some("Halted"), None), None, A::None),
            (
                "halted, running",
                vm(Some("Halted"), None),
                running(),
                A::Stop,
            ),
            (
                "halted, deleting",
                vm(Some("Halted"), None),
                Some(deleting_vmi(Some(Ph::Running))),
                A::None,
            ),
            (
                "halted, start request",
                with_request(vm(Some("Halted"), None), "Start", None),
                None,
                A::SwitchToAlways,
            ),
            ("manual, none", vm(Some("Manual"), None), None, A::None),
            (
                "manual, start request",
                with_request(vm(Some("Manual"), None), "Start", None),
                None,
                A::Start,
            ),
            (
                "manual, running",
                vm(Some("Manual"), None),
                running(),
                A::None,
            ),
            (
                "manual, failed stays",
                vm(Some("Manual"), None),
                Some(vmi(Some(Ph::Failed))),
                A::None,
            ),
            (
                "manual, stop request",
                with_request(vm(Some("Manual"), None), "Stop", Some("vmi-uid")),
                running(),
                A::Stop,
            ),
            ("once, none", vm(Some("Once"), None), None, A::Start),
            (
                "once, succeeded stays",
                vm(Some("Once"), None),
                Some(vmi(Some(Ph::Succeeded))),
                A::None,
            ),
            (
                "once, failed stays",
                vm(Some("Once"), None),
                Some(vmi(Some(Ph::Failed))),
                A::None,
            ),
            (
                "rerun, first start",
                vm(Some("RerunOnFailure"), None),
                None,
                A::Start,
            ),
            (
                "rerun, running",
                vm(Some("RerunOnFailure"), None),
                running(),
                A::None,
            ),
            (
                "rerun, failed",
                vm(Some("RerunOnFailure"), None),
                Some(vmi(Some(Ph::Failed))),
                A::RequestStart,
            ),
            (
                "rerun, failed and stopped",
                with_request(vm(Some("RerunOnFailure"), None), "Stop", Some("vmi-uid")),
                Some(vmi(Some(Ph::Failed))),
                A::RequestStart,
            ),
            (
                "rerun, failed and going",
                with_request(vm(Some("RerunOnFailure"), None), "Start", None),
                Some(deleting_vmi(Some(Ph::Failed))),
                A::None,
            ),
            (
                "rerun, failed, its successor requested",
                with_request(rerun(), "Start", None),
                ended(Ph::Failed),
                A::Stop,
            ),
            (
                "rerun, failed to start, its successor requested, not yet counted",
                with_request(vm(Some("RerunOnFailure"), None), "Start", None),
                Some(vmi(Some(Ph::Failed))),
                A::None,
            ),
            (
                "rerun, failed and stopped, its successor requested",
                with_request(
                    with_request(rerun(), "Stop", Some("vmi-uid")),
                    "Start",
                    None,
                ),
                ended(Ph::Failed),
                A::Stop,
            ),
            ("rerun, succeeded", rerun(), ended(Ph::Succeeded), A::Stop),
            (
                "rerun, succeeded without running, counted",
                counted(rerun()),
                Some(vmi(Some(Ph::Succeeded))),
                A::Stop,
            ),
            (
                "rerun, succeeded, the strategy not yet recorded",
                vm(Some("RerunOnFailure"), None),
                ended(Ph::Succeeded),
                A::None,
            ),
            (
                "rerun, stop request",
                with_request(rerun(), "Stop", Some("vmi-uid")),
                running(),
                A::Stop,
            ),
        ];
        for (name, vm, vmi, want) in cases {
            assert_eq!(decide(&vm, vmi.as_ref(), now()).unwrap(), want, "{name}");
        }
    }

    #[test]
    fn rerun_does_not_restart_after_success() {
        let mut v = vm(Some("RerunOnFailure"), None);
        v.status = Some(VirtualMachineStatus {
            run_strategy: Some(RunStrategy::RerunOnFailure),
            ..Default::default()
        });
        assert_eq!(decide(&v, None, now()).unwrap(), A::None);
        let v = with_request(v, "Start", None);
        assert_eq!(decide(&v, None, now()).unwrap(), A::Start);
    }

    #[test]
    fn unsupported_strategy_names_the_field() {
        let e = decide(&vm(Some("WaitAsReceiver"), None), None, now()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.runStrategy: \"WaitAsReceiver\" is not supported"
        );
    }

    #[test]
    fn backoff_delays_start() {
        let mut v = vm(Some("Always"), None);
        v.status = Some(VirtualMachineStatus {
            start_failure: Some(VirtualMachineStartFailure {
                last_failed_vmi_uid: Some("x".into()),
                retry_after_timestamp: Some(Time(now() + SignedDuration::from_secs(40))),
                consecutive_fail_count: Some(2),
            }),
            ..Default::default()
        });
        assert_eq!(
            decide(&v, None, now()).unwrap(),
            A::WaitBackoff(Duration::from_secs(40))
        );
        let later = now() + SignedDuration::from_secs(41);
        assert_eq!(decide(&v, None, later).unwrap(), A::Start);
    }

    #[test]
    fn backoff_grows_with_the_square_and_caps() {
        let secs = |n, j| start_backoff(n, j).as_secs();
        assert_eq!(secs(0, 0.0), 10);
        assert_eq!(secs(1, 0.0), 10);
        assert_eq!(secs(2, 0.0), 40);
        assert_eq!(secs(3, 0.0), 90);
        assert_eq!(secs(5, 0.0), 250);
        assert_eq!(secs(6, 0.0), 300);
        assert_eq!(secs(100, 0.0), 300);
        // Jitter adds at most half the delay (plus one second).
        assert_eq!(secs(2, 0.99), 40 + 20);
        assert_eq!(secs(5, 0.99), 300);
    }

    #[test]
    fn early_failure_counts_once_and_running_clears() {
        let v = vm(Some("Always"), None);
        let failed = vmi(Some(Ph::Failed));
        let s = next_status(&v, Some(&failed), &inputs());
        let f = s.start_failure.clone().unwrap();
        assert_eq!(f.consecutive_fail_count, Some(1));
        assert_eq!(
            f.retry_after_timestamp,
            Some(Time(now() + SignedDuration::from_secs(10)))
        );
        let mut v2 = v.clone();
        v2.status = Some(s);
        let again = next_status(&v2, Some(&failed), &inputs());
        assert_eq!(
            again.start_failure.unwrap().consecutive_fail_count,
            Some(1),
            "same VMI"
        );
        let mut other = vmi(Some(Ph::Failed));
        other.metadata.uid = Some("second".into());
        let s2 = next_status(&v2, Some(&other), &inputs());
        assert_eq!(
            s2.start_failure.as_ref().unwrap().consecutive_fail_count,
            Some(2)
        );
        assert_eq!(
            printable_status(&v2, None, &s2, &inputs()),
            VirtualMachinePrintableStatus::CrashLoopBackOff
        );
        let mut v3 = v2.clone();
        v3.status = Some(s2);
        let mut ran = vmi(Some(Ph::Running));
        ran.metadata.uid = Some("third".into());
        assert_eq!(next_status(&v3, Some(&ran), &inputs()).start_failure, None);
    }

    #[test]
    fn manual_strategy_never_tracks_start_failures() {
        let s = next_status(
            &vm(Some("Manual"), None),
            Some(&vmi(Some(Ph::Failed))),
            &inputs(),
        );
        assert_eq!(s.start_failure, None);
    }

    #[test]
    fn state_change_requests_are_trimmed_once_effective() {
        // A start request stays until a live VMI exists.
        let v = with_request(vm(Some("Manual"), None), "Start", None);
        assert_eq!(
            next_status(&v, None, &inputs()).state_change_requests.len(),
            1
        );
        let s = next_status(&v, Some(&vmi(Some(Ph::Pending))), &inputs());
        assert!(s.state_change_requests.is_empty());
        // A stop request stays while its VMI exists, and goes once it is gone or replaced.
        let v = with_request(vm(Some("Always"), None), "Stop", Some("vmi-uid"));
        let running = vmi(Some(Ph::Running));
        assert_eq!(
            next_status(&v, Some(&running), &inputs())
                .state_change_requests
                .len(),
            1
        );
        assert!(
            next_status(&v, None, &inputs())
                .state_change_requests
                .is_empty()
        );
        let mut replaced = vmi(Some(Ph::Pending));
        replaced.metadata.uid = Some("new".into());
        assert!(
            next_status(&v, Some(&replaced), &inputs())
                .state_change_requests
                .is_empty()
        );
    }

    #[test]
    fn printable_status_table() {
        use VirtualMachinePrintableStatus as P;
        let cond = |t: &str, s: ConditionStatus, r: &str| VirtualMachineInstanceCondition {
            type_: t.into(),
            status: s,
            reason: Some(r.into()),
            message: None,
            last_probe_time: None,
            last_transition_time: None,
        };
        let with_cond = |phase, c| {
            let mut v = vmi(phase);
            v.status.as_mut().unwrap().conditions.push(c);
            v
        };
        let mut terminating = vm(Some("Always"), None);
        terminating.metadata.deletion_timestamp = Some(Time(now()));
        let expecting = StatusInputs {
            start_expected: true,
            ..inputs()
        };
        let stopping = StatusInputs {
            stop_expected: true,
            ..inputs()
        };
        let always = vm(Some("Always"), None);
        let plain = inputs();
        let cases: Vec<(
            &str,
            &VirtualMachine,
            Option<VirtualMachineInstance>,
            &StatusInputs,
            P,
        )> = vec![
            ("no vmi", &always, None, &plain, P::Stopped),
            ("creating", &always, None, &expecting, P::Starting),
            (
                "terminating",
                &terminating,
                Some(vmi(Some(Ph::Running))),
                &plain,
                P::Terminating,
            ),
            (
                "deleting vmi",
                &always,
                Some(deleting_vmi(Some(Ph::Running))),
                &plain,
                P::Stopping,
            ),
            (
                "stop expected",
                &always,
                Some(vmi(Some(Ph::Running))),
                &stopping,
                P::Stopping,
            ),
            (
                "pending",
                &always,
                Some(vmi(Some(Ph::Pending))),
                &plain,
                P::Starting,
            ),
            ("unset phase", &always, Some(vmi(None)), &plain, P::Starting),
            (
                "scheduling",
                &always,
                Some(vmi(Some(Ph::Scheduling))),
                &plain,
                P::Starting,
            ),
            (
                "scheduled",
                &always,
                Some(vmi(Some(Ph::Scheduled))),
                &plain,
                P::Starting,
            ),
            (
                "running",
                &always,
                Some(vmi(Some(Ph::Running))),
                &plain,
                P::Running,
            ),
            (
                "paused",
                &always,
                Some(with_cond(
                    Some(Ph::Running),
                    cond("Paused", ConditionStatus::True, "PausedByUser"),
                )),
                &plain,
                P::Paused,
            ),
            (
                "unschedulable",
                &always,
                Some(with_cond(
                    Some(Ph::Scheduling),
                    cond("PodScheduled", ConditionStatus::False, "Unschedulable"),
                )),
                &plain,
                P::ErrorUnschedulable,
            ),
            (
                "image pull",
                &always,
                Some(with_cond(
                    Some(Ph::Scheduling),
                    cond("Synchronized", ConditionStatus::False, "ErrImagePull"),
                )),
                &plain,
                P::ErrImagePull,
            ),
            (
                "image backoff",
                &always,
                Some(with_cond(
                    Some(Ph::Scheduling),
                    cond("Synchronized", ConditionStatus::False, "ImagePullBackOff"),
                )),
                &plain,
                P::ImagePullBackOff,
            ),
            (
                "succeeded",
                &always,
                Some(vmi(Some(Ph::Succeeded))),
                &plain,
                P::Stopped,
            ),
            (
                "failed, no count",
                &always,
                Some(vmi(Some(Ph::Failed))),
                &plain,
                P::Stopped,
            ),
        ];
        for (name, vm, vmi, inp, want) in cases {
            let status = vm.status.clone().unwrap_or_default();
            assert_eq!(
                printable_status(vm, vmi.as_ref(), &status, inp),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn ready_created_and_conditions_follow_the_vmi() {
        let v = vm(Some("Always"), None);
        let s = next_status(&v, None, &inputs());
        assert_eq!((s.created, s.ready), (Some(false), Some(false)));
        assert_eq!(s.conditions[0].reason.as_deref(), Some("VMINotExists"));
        assert_eq!(s.run_strategy, None, "not recorded before the first start");

        let mut running = vmi(Some(Ph::Running));
        let st = running.status.as_mut().unwrap();
        for (t, status) in [
            ("Ready", ConditionStatus::True),
            ("AgentConnected", ConditionStatus::True),
        ] {
            st.conditions.push(VirtualMachineInstanceCondition {
                type_: t.into(),
                status,
                reason: None,
                message: None,
                last_probe_time: None,
                last_transition_time: None,
            });
        }
        let s = next_status(&v, Some(&running), &inputs());
        assert_eq!((s.created, s.ready), (Some(true), Some(true)));
        assert_eq!(s.run_strategy, Some(RunStrategy::Always));
        let types: Vec<_> = s
            .conditions
            .iter()
            .map(|c| c.type_.as_str().to_owned())
            .collect();
        assert_eq!(types, ["Ready", "AgentConnected"]);

        // A VM condition the VMI dropped goes too; a sync error becomes Failure.
        let mut v2 = v.clone();
        v2.status = Some(s);
        let failing = StatusInputs {
            sync_error: Some(("FailedCreate".into(), "boom".into())),
            ..inputs()
        };
        let s = next_status(&v2, Some(&vmi(Some(Ph::Running))), &failing);
        let types: Vec<_> = s
            .conditions
            .iter()
            .map(|c| c.type_.as_str().to_owned())
            .collect();
        assert_eq!(types, ["Ready", "Failure"]);
    }

    #[test]
    fn vmi_from_vm_carries_template_and_owner() {
        let mut v = vm(Some("Always"), None);
        v.spec.template.metadata = Some(ObjectMeta {
            labels: Some([("app".to_owned(), "x".to_owned())].into()),
            ..ObjectMeta::default()
        });
        let i = vmi_from_vm(&v);
        assert_eq!(i.metadata.name.as_deref(), Some("vm1"));
        assert_eq!(i.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(i.metadata.labels.unwrap()["app"], "x");
        assert_eq!(i.metadata.annotations.unwrap()[labels::VM_GENERATION], "3");
        let owner = &i.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("VirtualMachine", "vm-uid", Some(true))
        );
    }

    #[test]
    fn vmi_from_vm_keeps_the_firmware_uuid_stable_across_starts() {
        let mut v = vm(Some("Always"), None);
        v.metadata.name = Some("testvmi".into());
        let uuid = |v: &VirtualMachine| vmi_from_vm(v).spec.domain.firmware.unwrap().uuid;
        // KubeVirt's CalculateLegacyUUID("testvmi"): a SHA-1 UUID in its namespace.
        assert_eq!(
            uuid(&v).as_deref(),
            Some("f8918e71-270a-598e-a2a4-1afac39e1394")
        );
        assert_eq!(uuid(&v), uuid(&v));
        v.spec
            .template
            .spec
            .get_or_insert_default()
            .domain
            .firmware
            .get_or_insert_default()
            .uuid = Some("0f8fad5b-d9cb-469f-a165-70867728950e".into());
        assert_eq!(
            uuid(&v).as_deref(),
            Some("0f8fad5b-d9cb-469f-a165-70867728950e"),
            "the template's own UUID wins"
        );
    }

    #[test]
    fn a_paused_start_request_starts_the_vmi_paused() {
        use api::vm::{StateChangeRequestAction, VirtualMachineStateChangeRequest};
        let mut v = vm(Some("Manual"), None);
        assert_eq!(vmi_from_vm(&v).spec.start_strategy, None);
        let request = |paused: &str| VirtualMachineStateChangeRequest {
            action: StateChangeRequestAction::Start,
            data: [(
                api::vm::START_REQUEST_PAUSED_KEY.to_owned(),
                paused.to_owned(),
            )]
            .into(),
            uid: None,
        };
        v.status.get_or_insert_default().state_change_requests = vec![request("false")];
        assert_eq!(vmi_from_vm(&v).spec.start_strategy, None);
        v.status.get_or_insert_default().state_change_requests = vec![request("true")];
        let i = vmi_from_vm(&v);
        assert_eq!(i.spec.start_strategy.as_deref(), Some("Paused"));
        assert!(i.spec.starts_paused());
    }

    #[test]
    fn is_set_to_start_table() {
        assert!(is_set_to_start(&vm(Some("Always"), None), None));
        assert!(!is_set_to_start(&vm(Some("Halted"), None), None));
        assert!(!is_set_to_start(&vm(Some("Manual"), None), None));
        assert!(is_set_to_start(
            &with_request(vm(Some("Manual"), None), "Start", None),
            None
        ));
        assert!(is_set_to_start(&vm(Some("Once"), None), None));
        assert!(!is_set_to_start(
            &vm(Some("Once"), None),
            Some(&vmi(Some(Ph::Running)))
        ));
        assert!(!is_set_to_start(
            &vm(Some("RerunOnFailure"), None),
            Some(&vmi(Some(Ph::Succeeded)))
        ));
    }
}
