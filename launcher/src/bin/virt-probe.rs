//! `virt-probe`: a VMI's `exec` or `guestAgentPing` probe, run by the kubelet in the launcher
//! pod's compute container. Flags and exit codes are KubeVirt's. See docs/launcher.md.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use launcher::probe::{Probe, Request};

/// Runs a command in the guest through its agent, or pings the agent, through virt-launcher.
#[derive(Debug, Parser)]
#[command(name = "virt-probe", version)]
struct Flags {
    /// The launcher's command socket.
    #[arg(long, default_value = "/var/run/kubevirt/sockets/launcher-sock")]
    socket: PathBuf,
    /// The VMI the probe is for, `<namespace>_<name>`; the launcher refuses another.
    #[arg(long = "domainName")]
    domain_name: String,
    /// The command to run in the guest; its arguments follow `--`.
    #[arg(long, required_unless_present = "guest_agent_ping")]
    command: Option<String>,
    /// Seconds the guest command (or the ping) may take.
    #[arg(long = "timeoutSeconds", default_value_t = 1)]
    timeout_seconds: u32,
    /// Ping the guest agent instead of running a command.
    #[arg(long = "guestAgentPing", conflicts_with = "command")]
    guest_agent_ping: bool,
    /// The guest command's arguments.
    #[arg(last = true)]
    args: Vec<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let f = Flags::parse();
    let probe = match f.command {
        Some(command) => Probe::Exec {
            command,
            args: f.args,
        },
        None => Probe::GuestAgentPing,
    };
    let outcome = launcher::probe::run(Request {
        socket: f.socket,
        domain_name: f.domain_name,
        timeout_seconds: f.timeout_seconds,
        probe,
    })
    .await;
    if let Some(out) = outcome.stdout {
        let _ = writeln!(std::io::stdout(), "{out}");
    }
    if let Some(e) = outcome.error {
        let _ = writeln!(std::io::stderr(), "virt-probe: {e}");
    }
    ExitCode::from(outcome.code)
}
