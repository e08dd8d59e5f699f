//! Which REST actions a VMI's state allows, and the errors the console server answers with.
//! Pure, so the rules have a table test.

use api::status::VirtualMachineInstanceConditionType as Cond;
use api::{ConditionStatus, VirtualMachineInstance, VirtualMachineInstancePhase as Phase};
use http::StatusCode;
use launcher_api::client::ClientError;

/// The calls of `/v1/namespaces/{namespace}/virtualmachineinstances/{name}/...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Console,
    Vnc,
    Screenshot,
    Pause,
    Unpause,
    SoftReboot,
    Reset,
    Freeze,
    Unfreeze,
    GuestOsInfo,
    UserList,
    FilesystemList,
    /// A TCP connection to a port of the guest (`portforward/{port}/{protocol}`).
    PortForward,
}

impl Action {
    fn needs_agent(self) -> bool {
        matches!(
            self,
            Action::SoftReboot
                | Action::Freeze
                | Action::Unfreeze
                | Action::GuestOsInfo
                | Action::UserList
                | Action::FilesystemList
        )
    }
}

/// An error answer: status and a message for a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub status: StatusCode,
    pub message: String,
}

impl Refusal {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Refusal {
            status,
            message: message.into(),
        }
    }
}

fn condition_true(vmi: &VirtualMachineInstance, t: &Cond) -> bool {
    vmi.status
        .as_ref()
        .and_then(|s| s.condition(t))
        .is_some_and(|c| c.status == ConditionStatus::True)
}

/// Whether `action` may be done on `vmi` as its status stands: 409 when the state forbids it,
/// 503 when the guest agent it needs is not connected.
pub fn check(vmi: &VirtualMachineInstance, action: Action) -> Result<(), Refusal> {
    let name = vmi.metadata.name.as_deref().unwrap_or_default();
    let phase = vmi.status.as_ref().and_then(|s| s.phase.as_ref());
    if phase != Some(&Phase::Running) {
        let shown = phase.map_or_else(|| "unset".to_owned(), |p| format!("{p:?}"));
        return Err(Refusal::new(
            StatusCode::CONFLICT,
            format!("VMI {name} is not running (phase {shown})"),
        ));
    }
    let paused = condition_true(vmi, &Cond::Paused);
    match action {
        Action::Pause if paused => {
            return Err(Refusal::new(
                StatusCode::CONFLICT,
                format!("VMI {name} is already paused"),
            ));
        }
        Action::Unpause if !paused => {
            return Err(Refusal::new(
                StatusCode::CONFLICT,
                format!("VMI {name} is not paused"),
            ));
        }
        Action::SoftReboot | Action::Freeze if paused => {
            return Err(Refusal::new(
                StatusCode::CONFLICT,
                format!("VMI {name} is paused; unpause it first"),
            ));
        }
        // KubeVirt's `validateVMIForPortForward`: a paused guest would not answer.
        Action::PortForward if paused => {
            return Err(Refusal::new(
                StatusCode::CONFLICT,
                format!("VMI {name} is paused"),
            ));
        }
        _ => {}
    }
    if action.needs_agent() && !condition_true(vmi, &Cond::AgentConnected) {
        return Err(Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("VMI {name} does not have the guest agent connected"),
        ));
    }
    Ok(())
}

/// A launcher failure as the console server answers it.
pub fn from_client(e: &ClientError) -> Refusal {
    let status = match e {
        _ if e.is_unreachable() => StatusCode::SERVICE_UNAVAILABLE,
        ClientError::Api { status, error, .. } => match (*status, error.code.as_str()) {
            (503, _) | (_, "AgentNotConnected") => StatusCode::SERVICE_UNAVAILABLE,
            (409 | 404, _) => StatusCode::CONFLICT,
            (400, _) => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    Refusal::new(status, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::status::Condition;
    use launcher_api::domain::ApiError;

    fn vmi(phase: Option<Phase>, paused: bool, agent: bool) -> VirtualMachineInstance {
        let mut v = VirtualMachineInstance::new("vm", api::VirtualMachineInstanceSpec::default());
        let cond = |t| Condition {
            type_: t,
            status: ConditionStatus::True,
            last_probe_time: None,
            last_transition_time: None,
            reason: None,
            message: None,
        };
        let mut s = api::VirtualMachineInstanceStatus {
            phase,
            ..Default::default()
        };
        if paused {
            s.conditions.push(cond(Cond::Paused));
        }
        if agent {
            s.conditions.push(cond(Cond::AgentConnected));
        }
        v.status = Some(s);
        v
    }

    #[test]
    fn action_table() {
        use Action as A;
        let running = Some(Phase::Running);
        let ok = None;
        let conflict = Some(StatusCode::CONFLICT);
        let unavailable = Some(StatusCode::SERVICE_UNAVAILABLE);
        let cases = [
            (running.clone(), false, false, A::Console, ok),
            (running.clone(), false, false, A::Vnc, ok),
            (running.clone(), true, false, A::Screenshot, ok),
            (
                Some(Phase::Scheduled),
                false,
                false,
                A::Screenshot,
                conflict,
            ),
            (Some(Phase::Scheduled), false, false, A::Console, conflict),
            (None, false, false, A::Pause, conflict),
            (
                Some(Phase::Succeeded),
                false,
                true,
                A::GuestOsInfo,
                conflict,
            ),
            (running.clone(), false, false, A::Pause, ok),
            (running.clone(), true, false, A::Pause, conflict),
            (running.clone(), true, false, A::Unpause, ok),
            (running.clone(), false, false, A::Unpause, conflict),
            (running.clone(), false, false, A::Reset, ok),
            (running.clone(), true, true, A::SoftReboot, conflict),
            (running.clone(), false, false, A::SoftReboot, unavailable),
            (running.clone(), false, true, A::SoftReboot, ok),
            (running.clone(), true, true, A::Freeze, conflict),
            (running.clone(), false, true, A::Freeze, ok),
            (running.clone(), false, true, A::Unfreeze, ok),
            (running.clone(), false, false, A::GuestOsInfo, unavailable),
            (running.clone(), false, false, A::UserList, unavailable),
            (running.clone(), false, true, A::FilesystemList, ok),
            (running.clone(), true, true, A::GuestOsInfo, ok),
            (running.clone(), false, false, A::PortForward, ok),
            (running.clone(), true, true, A::PortForward, conflict),
            (
                Some(Phase::Scheduled),
                false,
                false,
                A::PortForward,
                conflict,
            ),
        ];
        for (i, (phase, paused, agent, action, want)) in cases.into_iter().enumerate() {
            let got = check(&vmi(phase, paused, agent), action)
                .err()
                .map(|r| r.status);
            assert_eq!(got, want, "case {i}: {action:?}");
        }
    }

    #[test]
    fn launcher_errors_map_to_statuses() {
        let api = |status: u16, code: &str| ClientError::Api {
            socket: "/s".into(),
            path: "/v1/pause".into(),
            status,
            error: ApiError {
                code: code.into(),
                message: "m".into(),
            },
        };
        let cases = [
            (
                ClientError::Connect {
                    socket: "/s".into(),
                    source: std::io::Error::from(std::io::ErrorKind::NotFound),
                },
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            (
                api(503, "AgentNotConnected"),
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            (api(409, "WrongState"), StatusCode::CONFLICT),
            (api(404, "NoDomain"), StatusCode::CONFLICT),
            (api(400, "BadRequest"), StatusCode::BAD_REQUEST),
            (api(502, "QMPError"), StatusCode::INTERNAL_SERVER_ERROR),
        ];
        for (e, want) in cases {
            let r = from_client(&e);
            assert_eq!(r.status, want, "{e}");
            assert!(
                r.message.contains("/v1/pause") || r.message.contains("/s"),
                "{r}"
            );
        }
    }
}
