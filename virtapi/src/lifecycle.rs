//! VM start, stop and restart, as KubeVirt's `pkg/virt-api/rest/lifecycle.go` decides them: from
//! the VM, its VMI and the request, the JSON patches to send (the VM's `runStrategy`/`running`,
//! the VM status' `stateChangeRequests`, the VMI's `terminationGracePeriodSeconds`) or the
//! refusal. Pure; the handlers in `subresource` send the patches.
//!
//! Every patch begins with a JSON-patch `test` of what it read, so a VM changed between the read
//! and the write is refused by the API server (409) instead of overwritten.

use std::collections::BTreeMap;

use api::subresources::{RestartOptions, StartOptions, StopOptions};
use api::vm::{
    RunStrategy, StateChangeRequestAction, VirtualMachine, VirtualMachineConditionType,
    VirtualMachineStateChangeRequest, VirtualMachineStatus,
};
use api::{ConditionStatus, VirtualMachineInstance};
use serde_json::{Value, json};

use crate::status::Refusal;

/// KubeVirt's messages.
pub const VM_NOT_RUNNING: &str = "VM is not running";
const MANUAL_RECOVERY_REQUIRED: &str = "VM recovery required: Volume migration failed, leaving some volumes pointing to non-consistent targets; manual intervention is needed to reassign them to their original volumes.";

/// One write the request needs, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    /// A JSON patch of the VM (spec).
    PatchVm(Value),
    /// A JSON patch of the VM's status subresource.
    PatchVmStatus(Value),
    /// A JSON patch of the VMI (its grace period), applied first.
    PatchVmi(Value),
}

fn conflict(vm: &VirtualMachine, why: impl std::fmt::Display) -> Refusal {
    Refusal::conflict(
        "virtualmachine",
        vm.metadata.name.as_deref().unwrap_or(""),
        why,
    )
}

fn manual_recovery_required(vm: &VirtualMachine) -> bool {
    vm.status.as_ref().is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == VirtualMachineConditionType::ManualRecoveryRequired
                && c.status == ConditionStatus::True
        })
    })
}

fn vmi_final(vmi: &VirtualMachineInstance) -> bool {
    vmi.is_final()
}

/// `runStrategy` (or the legacy `running`) set to run or halt, after a test of its current
/// value (KubeVirt's `getRunningPatch`).
fn running_patch(vm: &VirtualMachine, running: bool) -> Value {
    if let Some(current) = &vm.spec.run_strategy {
        let to = if running {
            RunStrategy::Always
        } else {
            RunStrategy::Halted
        };
        json!([
            {"op": "test", "path": "/spec/runStrategy", "value": current},
            {"op": "replace", "path": "/spec/runStrategy", "value": to},
        ])
    } else {
        json!([
            {"op": "test", "path": "/spec/running", "value": vm.spec.running},
            {"op": "replace", "path": "/spec/running", "value": running},
        ])
    }
}

/// Queues state change requests on the VM's status (KubeVirt's `getChangeRequestJson`): added
/// when none are queued, a lone stop replaces what is queued, anything else is refused because
/// a start or stop is already underway.
fn change_requests(
    vm: &VirtualMachine,
    changes: &[VirtualMachineStateChangeRequest],
) -> Result<Value, Refusal> {
    let mut ops = Vec::new();
    match &vm.status {
        None => ops.push(
            json!({"op": "add", "path": "/status", "value": {"stateChangeRequests": changes}}),
        ),
        Some(status) if *status == VirtualMachineStatus::default() => ops.push(
            json!({"op": "add", "path": "/status", "value": {"stateChangeRequests": changes}}),
        ),
        Some(status) => {
            let queued = &status.state_change_requests;
            ops.push(json!({"op": "test", "path": "/status/stateChangeRequests", "value": if queued.is_empty() { Value::Null } else { json!(queued) }}));
            if queued.is_empty() {
                ops.push(
                    json!({"op": "add", "path": "/status/stateChangeRequests", "value": changes}),
                );
            } else if changes.len() == 1 && changes[0].action == StateChangeRequestAction::Stop {
                ops.push(json!({"op": "replace", "path": "/status/stateChangeRequests", "value": changes}));
            } else {
                return Err(Refusal::internal(
                    "unable to complete request: stop/start already underway",
                ));
            }
            if status.start_failure.is_some() {
                ops.push(json!({"op": "remove", "path": "/status/startFailure"}));
            }
        }
    }
    Ok(Value::Array(ops))
}

fn request(
    action: StateChangeRequestAction,
    uid: Option<&str>,
    paused: bool,
) -> VirtualMachineStateChangeRequest {
    VirtualMachineStateChangeRequest {
        action,
        data: if paused {
            [(
                api::vm::START_REQUEST_PAUSED_KEY.to_owned(),
                api::vm::START_REQUEST_PAUSED_TRUE.to_owned(),
            )]
            .into()
        } else {
            BTreeMap::new()
        },
        uid: uid.map(str::to_owned),
    }
}

/// Sets the VMI's grace period after a test of its current value; returns the patch and the
/// value it replaced.
fn grace_period_patch(vmi: &VirtualMachineInstance, seconds: i64) -> Value {
    json!([
        {"op": "test", "path": "/spec/terminationGracePeriodSeconds", "value": vmi.spec.termination_grace_period_seconds},
        {"op": "replace", "path": "/spec/terminationGracePeriodSeconds", "value": seconds},
    ])
}

/// `PUT .../virtualmachines/{name}/start`.
pub fn start(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    opts: &StartOptions,
) -> Result<Vec<Call>, Refusal> {
    use api::status::VirtualMachineInstancePhase as P;
    if let Some(vmi) = vmi
        && !vmi_final(vmi)
        && !matches!(vmi.phase(), None | Some(P::Unknown))
    {
        return Err(conflict(vm, "VM is already running"));
    }
    if manual_recovery_required(vm) {
        return Err(conflict(vm, MANUAL_RECOVERY_REQUIRED));
    }
    let strategy = vm.spec.effective_run_strategy();
    match strategy {
        RunStrategy::Halted => {
            let template_paused = vm
                .spec
                .template
                .spec
                .as_ref()
                .is_some_and(api::vmi::VirtualMachineInstanceSpec::starts_paused);
            // A paused start asks the controller, which then moves the run strategy itself.
            if opts.paused && !template_paused {
                Ok(vec![Call::PatchVmStatus(change_requests(
                    vm,
                    &[request(StateChangeRequestAction::Start, None, true)],
                )?)])
            } else {
                Ok(vec![Call::PatchVm(running_patch(vm, true))])
            }
        }
        RunStrategy::RerunOnFailure | RunStrategy::Manual => {
            let phase = vmi.and_then(VirtualMachineInstance::phase);
            if strategy == RunStrategy::RerunOnFailure && phase == Some(&P::Failed) {
                return Err(conflict(
                    vm,
                    "RerunOnFailure does not support starting VM from failed state",
                ));
            }
            let needs_restart = match vmi {
                Some(vmi) if strategy == RunStrategy::RerunOnFailure => {
                    phase == Some(&P::Succeeded) && vmi.metadata.uid.is_some()
                }
                Some(vmi) => vmi_final(vmi),
                None => false,
            };
            let start = request(StateChangeRequestAction::Start, None, opts.paused);
            let changes = if needs_restart {
                let uid = vmi.and_then(|v| v.metadata.uid.as_deref());
                vec![request(StateChangeRequestAction::Stop, uid, false), start]
            } else {
                vec![start]
            };
            Ok(vec![Call::PatchVmStatus(change_requests(vm, &changes)?)])
        }
        other => Err(conflict(
            vm,
            format!("{} does not support manual start requests", other.as_str()),
        )),
    }
}

/// `PUT .../virtualmachines/{name}/stop`.
pub fn stop(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    opts: &StopOptions,
) -> Result<Vec<Call>, Refusal> {
    let live = vmi.filter(|v| !vmi_final(v));
    let mut calls = Vec::new();
    let old_grace = live.and_then(|v| v.spec.termination_grace_period_seconds);
    if let (Some(vmi), Some(g)) = (live, opts.grace_period) {
        calls.push(Call::PatchVmi(grace_period_patch(vmi, g)));
    }
    let stop_request = |vmi: &VirtualMachineInstance| {
        change_requests(
            vm,
            &[request(
                StateChangeRequestAction::Stop,
                vmi.metadata.uid.as_deref(),
                false,
            )],
        )
    };
    match vm.spec.effective_run_strategy() {
        RunStrategy::Halted => {
            let Some(vmi) = live else {
                return Err(conflict(vm, VM_NOT_RUNNING));
            };
            // Already halting: only a shorter grace period is news.
            let shorter = match (opts.grace_period, old_grace) {
                (None, _) => false,
                (Some(g), Some(old)) => g < old,
                (Some(_), None) => true,
            };
            if !shorter {
                return Err(conflict(
                    vm,
                    "Halted only supports manual stop requests with a shorter graceperiod",
                ));
            }
            calls.push(Call::PatchVmStatus(stop_request(vmi)?));
        }
        RunStrategy::RerunOnFailure | RunStrategy::Manual => {
            let Some(vmi) = live else {
                return Err(conflict(vm, VM_NOT_RUNNING));
            };
            calls.push(Call::PatchVmStatus(stop_request(vmi)?));
        }
        _ => calls.push(Call::PatchVm(running_patch(vm, false))),
    }
    Ok(calls)
}

/// `PUT .../virtualmachines/{name}/restart`.
pub fn restart(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    opts: &RestartOptions,
) -> Result<Vec<Call>, Refusal> {
    match opts.grace_period_seconds {
        Some(g) if g > 0 => {
            return Err(Refusal::bad_request(
                "For force restart, only gracePeriod=0 is supported for now",
            ));
        }
        Some(g) if g < 0 => {
            return Err(Refusal::bad_request(
                "gracePeriod has to be greater or equal to 0",
            ));
        }
        _ => {}
    }
    if manual_recovery_required(vm) {
        return Err(conflict(vm, MANUAL_RECOVERY_REQUIRED));
    }
    let strategy = vm.spec.effective_run_strategy();
    if matches!(strategy, RunStrategy::Halted | RunStrategy::Once) {
        return Err(conflict(
            vm,
            format!(
                "RunStategy {} does not support manual restart requests",
                strategy.as_str()
            ),
        ));
    }
    let Some(vmi) = vmi else {
        return Err(conflict(vm, "VM is not running: Halted"));
    };
    let mut calls = Vec::new();
    // A forced restart shortens the grace period to 1 s (the shortest safe one) first, so the
    // guest goes down promptly whoever deletes the pod.
    if opts.grace_period_seconds == Some(0) {
        calls.push(Call::PatchVmi(grace_period_patch(vmi, 1)));
    }
    calls.push(Call::PatchVmStatus(change_requests(
        vm,
        &[
            request(
                StateChangeRequestAction::Stop,
                vmi.metadata.uid.as_deref(),
                false,
            ),
            request(StateChangeRequestAction::Start, None, false),
        ],
    )?));
    Ok(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(yaml: &str) -> VirtualMachine {
        serde_saphyr::from_str(yaml).unwrap()
    }

    fn vmi(phase: &str) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "demo", "uid": "u1"},
            "spec": {"domain": {"devices": {}}, "terminationGracePeriodSeconds": 30},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    const ALWAYS: &str = "
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: demo}
spec:
  runStrategy: Always
  template: {spec: {domain: {devices: {}}}}
";
    const HALTED: &str = "
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: demo}
spec:
  runStrategy: Halted
  template: {spec: {domain: {devices: {}}}}
";
    const MANUAL: &str = "
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: demo}
spec:
  runStrategy: Manual
  template: {spec: {domain: {devices: {}}}}
status: {printableStatus: Stopped}
";

    #[test]
    fn start_of_a_halted_vm_flips_its_run_strategy() {
        let calls = start(&vm(HALTED), None, &StartOptions::default()).unwrap();
        assert_eq!(
            calls,
            vec![Call::PatchVm(json!([
                {"op": "test", "path": "/spec/runStrategy", "value": "Halted"},
                {"op": "replace", "path": "/spec/runStrategy", "value": "Always"},
            ]))]
        );
    }

    #[test]
    fn start_of_a_legacy_running_false_vm_patches_running() {
        let v = vm("
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: demo}
spec: {running: false, template: {spec: {domain: {devices: {}}}}}
");
        let calls = start(&v, None, &StartOptions::default()).unwrap();
        assert_eq!(
            calls,
            vec![Call::PatchVm(json!([
                {"op": "test", "path": "/spec/running", "value": false},
                {"op": "replace", "path": "/spec/running", "value": true},
            ]))]
        );
    }

    #[test]
    fn start_refusals_are_kubevirts() {
        let e = start(&vm(ALWAYS), None, &StartOptions::default()).unwrap_err();
        assert_eq!(e.code, http::StatusCode::CONFLICT);
        assert!(
            e.message
                .ends_with("Always does not support manual start requests"),
            "{e}"
        );
        let e = start(&vm(HALTED), Some(&vmi("Running")), &StartOptions::default()).unwrap_err();
        assert!(e.message.ends_with("VM is already running"), "{e}");
        // A final VMI does not count as running.
        assert!(
            start(
                &vm(HALTED),
                Some(&vmi("Succeeded")),
                &StartOptions::default()
            )
            .is_ok()
        );
    }

    #[test]
    fn manual_start_queues_a_request_and_restarts_a_finished_vmi() {
        let calls = start(&vm(MANUAL), None, &StartOptions::default()).unwrap();
        assert_eq!(
            calls,
            vec![Call::PatchVmStatus(json!([
                {"op": "test", "path": "/status/stateChangeRequests", "value": null},
                {"op": "add", "path": "/status/stateChangeRequests", "value": [{"action": "Start"}]},
            ]))]
        );
        let calls = start(
            &vm(MANUAL),
            Some(&vmi("Succeeded")),
            &StartOptions::default(),
        )
        .unwrap();
        let Call::PatchVmStatus(p) = &calls[0] else {
            panic!("{calls:?}")
        };
        assert_eq!(
            p[1]["value"],
            json!([{"action": "Stop", "uid": "u1"}, {"action": "Start"}])
        );
    }

    #[test]
    fn a_second_start_while_one_is_queued_is_refused() {
        let mut v = vm(MANUAL);
        v.status.as_mut().unwrap().state_change_requests =
            vec![request(StateChangeRequestAction::Start, None, false)];
        let e = start(&v, None, &StartOptions::default()).unwrap_err();
        assert!(e.message.contains("stop/start already underway"), "{e}");
    }

    #[test]
    fn stop_of_an_always_vm_halts_it_with_the_grace_period_first() {
        let calls = stop(
            &vm(ALWAYS),
            Some(&vmi("Running")),
            &StopOptions {
                grace_period: Some(0),
                dry_run: vec![],
            },
        )
        .unwrap();
        assert_eq!(
            calls,
            vec![
                Call::PatchVmi(json!([
                    {"op": "test", "path": "/spec/terminationGracePeriodSeconds", "value": 30},
                    {"op": "replace", "path": "/spec/terminationGracePeriodSeconds", "value": 0},
                ])),
                Call::PatchVm(json!([
                    {"op": "test", "path": "/spec/runStrategy", "value": "Always"},
                    {"op": "replace", "path": "/spec/runStrategy", "value": "Halted"},
                ])),
            ]
        );
    }

    #[test]
    fn stop_of_a_halted_vm_needs_a_shorter_grace_period() {
        let e = stop(&vm(HALTED), None, &StopOptions::default()).unwrap_err();
        assert!(e.message.ends_with(VM_NOT_RUNNING), "{e}");
        let e = stop(&vm(HALTED), Some(&vmi("Running")), &StopOptions::default()).unwrap_err();
        assert!(e.message.contains("shorter graceperiod"), "{e}");
        let calls = stop(
            &vm(HALTED),
            Some(&vmi("Running")),
            &StopOptions {
                grace_period: Some(0),
                dry_run: vec![],
            },
        )
        .unwrap();
        assert_eq!(calls.len(), 2);
        assert!(matches!(&calls[1], Call::PatchVmStatus(p) if p.to_string().contains("\"Stop\"")));
    }

    #[test]
    fn restart_queues_stop_then_start() {
        let calls = restart(
            &vm(ALWAYS),
            Some(&vmi("Running")),
            &RestartOptions::default(),
        )
        .unwrap();
        assert_eq!(
            calls,
            vec![Call::PatchVmStatus(json!([
                {"op": "add", "path": "/status", "value": {"stateChangeRequests": [{"action": "Stop", "uid": "u1"}, {"action": "Start"}]}},
            ]))]
        );
        let forced = restart(
            &vm(ALWAYS),
            Some(&vmi("Running")),
            &RestartOptions {
                grace_period_seconds: Some(0),
                dry_run: vec![],
            },
        )
        .unwrap();
        assert!(matches!(&forced[0], Call::PatchVmi(p) if p[1]["value"] == 1));
        for (strategy, g, want) in [
            (HALTED, None, "does not support manual restart requests"),
            (ALWAYS, Some(5), "only gracePeriod=0"),
            (ALWAYS, Some(-1), "greater or equal to 0"),
        ] {
            let e = restart(
                &vm(strategy),
                Some(&vmi("Running")),
                &RestartOptions {
                    grace_period_seconds: g,
                    dry_run: vec![],
                },
            )
            .unwrap_err();
            assert!(e.message.contains(want), "{e}");
        }
        let e = restart(&vm(ALWAYS), None, &RestartOptions::default()).unwrap_err();
        assert!(e.message.ends_with("VM is not running: Halted"), "{e}");
    }
}
