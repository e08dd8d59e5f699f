//! Pure decisions about the domain's state: how QEMU's end maps to Shutoff or Crashed.

use std::process::ExitStatus;

use launcher_api::domain::DomainState;

/// What the launcher itself asked QEMU to do last, so that the end it causes is not reported
/// as a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requested {
    /// ACPI power button (API shutdown or launcher termination).
    Powerdown,
    /// `quit` over QMP after the grace period.
    Quit,
    /// SIGKILL (API kill, or the last resort on termination).
    Kill,
    /// A migration target waiting for its state: QEMU exits by itself if the incoming
    /// migration fails.
    Incoming,
    /// `quit` once the guest has migrated away.
    Migrated,
}

/// What QEMU told us before it went away.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LastWords {
    /// The `reason` of the last SHUTDOWN event (`guest-shutdown`, `host-qmp-quit`, ...).
    pub shutdown_reason: Option<String>,
    pub panicked: bool,
    /// The last lines QEMU wrote to stderr.
    pub stderr_tail: Vec<String>,
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => {
            let name = nix::sys::signal::Signal::try_from(s)
                .map_or_else(|_| format!("signal {s}"), |s| s.as_str().to_owned());
            format!("was killed by {name}")
        }
        _ => format!("ended ({status})"),
    }
}

/// The final state, reason and message once QEMU has exited.
pub fn final_state(
    status: ExitStatus,
    words: &LastWords,
    requested: Option<Requested>,
) -> (DomainState, String, Option<String>) {
    let tail = || {
        if words.stderr_tail.is_empty() {
            String::new()
        } else {
            format!(": {}", words.stderr_tail.join(" | "))
        }
    };
    if words.panicked {
        return (
            DomainState::Crashed,
            "Panicked".into(),
            Some("the guest kernel panicked".into()),
        );
    }
    match (requested, words.shutdown_reason.as_deref()) {
        (_, Some("guest-shutdown")) => (DomainState::Shutoff, "Shutdown".into(), None),
        (_, Some("guest-reset" | "guest-panic")) => (
            DomainState::Crashed,
            "Crashed".into(),
            Some(format!(
                "the guest ended with {}",
                words.shutdown_reason.clone().unwrap_or_default()
            )),
        ),
        (Some(Requested::Kill), _) => (DomainState::Shutoff, "Destroyed".into(), None),
        (Some(Requested::Migrated), _) => (DomainState::Shutoff, "Migrated".into(), None),
        (Some(Requested::Incoming), _) => (
            DomainState::Shutoff,
            "FailedMigration".into(),
            Some(format!(
                "QEMU {} before the incoming migration completed{}",
                describe(status),
                tail()
            )),
        ),
        (Some(Requested::Quit | Requested::Powerdown), Some("host-qmp-quit")) => {
            (DomainState::Shutoff, "Destroyed".into(), None)
        }
        (None, Some("host-signal")) => (
            DomainState::Crashed,
            "Crashed".into(),
            Some(format!(
                "QEMU was stopped by a signal it did not expect{}",
                tail()
            )),
        ),
        _ if status.success() && requested.is_some() => {
            (DomainState::Shutoff, "Destroyed".into(), None)
        }
        _ => (
            DomainState::Crashed,
            "Crashed".into(),
            Some(format!("QEMU {}{}", describe(status), tail())),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt as _;

    fn exited(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }
    fn signalled(sig: i32) -> ExitStatus {
        ExitStatus::from_raw(sig)
    }
    fn words(reason: Option<&str>) -> LastWords {
        LastWords {
            shutdown_reason: reason.map(str::to_owned),
            ..LastWords::default()
        }
    }

    #[test]
    fn table() {
        let cases = [
            (
                exited(0),
                words(Some("guest-shutdown")),
                None,
                DomainState::Shutoff,
                "Shutdown",
            ),
            (
                exited(0),
                words(Some("guest-shutdown")),
                Some(Requested::Powerdown),
                DomainState::Shutoff,
                "Shutdown",
            ),
            (
                signalled(9),
                words(None),
                None,
                DomainState::Crashed,
                "Crashed",
            ),
            (
                signalled(9),
                words(None),
                Some(Requested::Kill),
                DomainState::Shutoff,
                "Destroyed",
            ),
            (
                exited(0),
                words(Some("host-qmp-quit")),
                Some(Requested::Quit),
                DomainState::Shutoff,
                "Destroyed",
            ),
            (
                exited(0),
                words(Some("host-signal")),
                None,
                DomainState::Crashed,
                "Crashed",
            ),
            (
                exited(0),
                words(Some("host-qmp-quit")),
                Some(Requested::Migrated),
                DomainState::Shutoff,
                "Migrated",
            ),
            (
                exited(1),
                words(None),
                Some(Requested::Incoming),
                DomainState::Shutoff,
                "FailedMigration",
            ),
            (
                exited(1),
                words(None),
                None,
                DomainState::Crashed,
                "Crashed",
            ),
            (
                exited(0),
                words(None),
                None,
                DomainState::Crashed,
                "Crashed",
            ),
        ];
        for (i, (status, w, req, state, reason)) in cases.into_iter().enumerate() {
            let (s, r, _) = final_state(status, &w, req);
            assert_eq!((s, r.as_str()), (state, reason), "case {i}");
        }
    }

    #[test]
    fn crash_message_names_signal_and_stderr() {
        let w = LastWords {
            stderr_tail: vec!["oops".into()],
            ..LastWords::default()
        };
        let (_, _, m) = final_state(signalled(9), &w, None);
        assert_eq!(m.as_deref(), Some("QEMU was killed by SIGKILL: oops"));
        let panicked = LastWords {
            panicked: true,
            ..LastWords::default()
        };
        assert_eq!(final_state(exited(0), &panicked, None).1, "Panicked");
    }
}
