//! virt-probe: the command KubeVirt puts in the launcher pod's `exec` probes for a VMI's `exec`
//! and `guestAgentPing` probes (`pkg/virt-controller/services/rendercontainer.go`). The kubelet
//! runs it in the compute container; it asks the launcher's command API to run the command in
//! the guest, or to ping the guest agent, and exits as KubeVirt's `cmd/virt-probe` does.

use std::path::PathBuf;
use std::time::Duration;

use launcher_api::client::{ClientError, LauncherClient};
use launcher_api::guest::{GuestExecRequest, GuestExecResult, GuestPingRequest};

/// KubeVirt's: added to the client's deadline beyond the probe's own timeout, so that the
/// launcher's answer that the command timed out arrives rather than the client's own timeout.
const CLIENT_MARGIN: Duration = Duration::from_secs(1);

/// What the probe asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    GuestAgentPing,
    Exec { command: String, args: Vec<String> },
}

/// One run of virt-probe.
#[derive(Debug, Clone)]
pub struct Request {
    pub socket: PathBuf,
    pub domain_name: String,
    pub timeout_seconds: u32,
    pub probe: Probe,
}

/// How virt-probe ends: its exit code, what it prints on stdout (the guest command's output)
/// and on stderr (why it failed).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    pub code: u8,
    pub stdout: Option<String>,
    pub error: Option<String>,
}

/// The guest command's exit code as a process's: KubeVirt's virt-probe exits with it, which
/// Go truncates to its low byte.
fn exit_byte(code: i32) -> u8 {
    code.to_le_bytes()[0]
}

/// A ping: 0 when the agent answered, 1 otherwise.
pub fn ping_outcome(answer: Result<(), ClientError>) -> Outcome {
    match answer {
        Ok(()) => Outcome::default(),
        Err(e) => Outcome {
            code: 1,
            error: Some(format!("failed to ping the guest: {}", chain(e))),
            ..Outcome::default()
        },
    }
}

/// An exec: the command's exit code and output when it ran; 255 (KubeVirt's `-1`) when it
/// could not be run or did not exit in time.
pub fn exec_outcome(answer: Result<GuestExecResult, ClientError>) -> Outcome {
    match answer {
        Ok(r) => Outcome {
            code: exit_byte(r.exit_code),
            stdout: (!r.stdout.is_empty()).then_some(r.stdout),
            error: None,
        },
        Err(e) => Outcome {
            code: exit_byte(-1),
            stdout: None,
            error: Some(format!("failed executing the command: {}", chain(e))),
        },
    }
}

/// The error and its causes on one line, `: `-separated (anyhow's alternate form).
fn chain(e: ClientError) -> String {
    format!("{:#}", anyhow::Error::new(e))
}

/// Asks the launcher and says how virt-probe ends.
pub async fn run(req: Request) -> Outcome {
    let client = LauncherClient::new(
        &req.socket,
        Duration::from_secs(req.timeout_seconds.into()) + CLIENT_MARGIN,
    );
    match req.probe {
        Probe::GuestAgentPing => ping_outcome(
            client
                .guest_ping(&GuestPingRequest {
                    domain_name: req.domain_name,
                    timeout_seconds: req.timeout_seconds,
                })
                .await,
        ),
        Probe::Exec { command, args } => exec_outcome(
            client
                .guest_exec(&GuestExecRequest {
                    domain_name: req.domain_name,
                    command,
                    args,
                    timeout_seconds: req.timeout_seconds,
                })
                .await,
        ),
    }
}

#[cfg(test)]
mod tests {
    use pretty_assertions::assert_eq;

    use super::*;

    fn unreachable() -> ClientError {
        ClientError::Connect {
            socket: "/var/run/kubevirt/sockets/launcher-sock".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        }
    }

    #[test]
    fn a_ping_passes_only_when_the_agent_answered() {
        assert_eq!(ping_outcome(Ok(())), Outcome::default());
        let failed = ping_outcome(Err(unreachable()));
        assert_eq!(failed.code, 1);
        let error = failed.error.expect("a reason");
        assert!(error.contains("launcher-sock"), "{error}");
    }

    #[test]
    fn an_exec_exits_with_the_guest_commands_code_and_prints_its_output() {
        let ran = |exit_code, stdout: &str| {
            exec_outcome(Ok(GuestExecResult {
                exit_code,
                stdout: stdout.into(),
            }))
        };
        assert_eq!(ran(0, ""), Outcome::default());
        assert_eq!(
            ran(1, "not yet\n"),
            Outcome {
                code: 1,
                stdout: Some("not yet\n".into()),
                error: None,
            }
        );
        // Go's os.Exit keeps the low byte, as the kernel does.
        assert_eq!(ran(256 + 7, "").code, 7);
        assert_eq!(ran(-1, "").code, 255);
    }

    #[test]
    fn an_exec_that_could_not_run_exits_255() {
        let failed = exec_outcome(Err(unreachable()));
        assert_eq!(failed.code, 255);
        assert!(failed.error.expect("a reason").contains("executing"));
    }
}
