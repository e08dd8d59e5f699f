//! What to do with a VMI that is being deleted (or whose pod is going away): KubeVirt's
//! `processVmShutdown` / `hasGracePeriodExpired` / `shutdownVMI`.
//!
//! ACPI power-down is sent, and re-sent every few seconds because a booting guest can miss the
//! button; once the grace period is over the domain is killed. The finalizer is released only
//! when the domain is gone.

use std::time::Duration;

use launcher::domain::DomainState;

use crate::events::Event;
use crate::status::DEFAULT_GRACE_SECONDS;

/// KubeVirt re-sends the power button at most this often.
pub const RESEND_EVERY: Duration = Duration::from_secs(5);
pub const MSG_GRACEFUL: &str = "Signaled Graceful Shutdown";
pub const MSG_STOPPING: &str = "VirtualMachineInstance stopping";

/// The domain as far as shutdown cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DomainPresence {
    /// The launcher answers and QEMU has not ended.
    Alive(DomainState),
    /// QEMU has ended, or the launcher (and its pod) is gone: nothing left to stop.
    Gone,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send ACPI power-down, then look again after `recheck`.
    Shutdown {
        recheck: Duration,
        event: Option<Event>,
    },
    /// The grace period is over (or there is none): kill QEMU.
    Kill { event: Event },
    /// The domain is gone: release the finalizer.
    ReleaseFinalizer,
}

/// `grace`: the VMI's `terminationGracePeriodSeconds` (None: KubeVirt's default).
/// `elapsed`: since the first power-down was sent; None if none was sent yet (the shell records
/// the start so it survives handler restarts, e.g. the VMI's deletion timestamp).
pub fn decide(grace: Option<i64>, elapsed: Option<Duration>, domain: DomainPresence) -> Action {
    let DomainPresence::Alive(state) = domain else {
        return Action::ReleaseFinalizer;
    };
    if state.is_final() {
        return Action::ReleaseFinalizer;
    }
    let grace = Duration::from_secs(grace.unwrap_or(DEFAULT_GRACE_SECONDS).max(0).unsigned_abs());
    let kill = Action::Kill {
        event: Event::normal("Deleted", MSG_STOPPING),
    };
    if grace.is_zero() {
        return kill;
    }
    match elapsed {
        None => Action::Shutdown {
            recheck: grace.min(RESEND_EVERY),
            event: Some(Event::normal("ShuttingDown", MSG_GRACEFUL)),
        },
        Some(e) if e >= grace => kill,
        Some(e) => Action::Shutdown {
            recheck: grace
                .saturating_sub(e)
                .clamp(Duration::from_secs(1), RESEND_EVERY),
            event: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn decision_table() {
        let alive = DomainPresence::Alive(DomainState::Running);
        let shutting = |recheck: u64, first: bool| Action::Shutdown {
            recheck: secs(recheck),
            event: first.then(|| Event::normal("ShuttingDown", MSG_GRACEFUL)),
        };
        let kill = Action::Kill {
            event: Event::normal("Deleted", MSG_STOPPING),
        };
        let cases = [
            (None, None, alive, shutting(5, true)),
            (Some(3), None, alive, shutting(3, true)),
            (Some(30), Some(secs(4)), alive, shutting(5, false)),
            (Some(30), Some(secs(27)), alive, shutting(3, false)),
            (
                Some(30),
                Some(Duration::from_millis(29_500)),
                alive,
                shutting(1, false),
            ),
            (Some(30), Some(secs(30)), alive, kill.clone()),
            (None, Some(secs(179)), alive, shutting(1, false)),
            (None, Some(secs(180)), alive, kill.clone()),
            (Some(0), None, alive, kill.clone()),
            (Some(-5), None, alive, kill.clone()),
            (
                Some(30),
                None,
                DomainPresence::Alive(DomainState::Paused),
                shutting(5, true),
            ),
            (
                None,
                None,
                DomainPresence::Alive(DomainState::Shutoff),
                Action::ReleaseFinalizer,
            ),
            (
                None,
                Some(secs(1)),
                DomainPresence::Alive(DomainState::Crashed),
                Action::ReleaseFinalizer,
            ),
            (
                Some(0),
                None,
                DomainPresence::Gone,
                Action::ReleaseFinalizer,
            ),
        ];
        for (i, (grace, elapsed, dom, want)) in cases.into_iter().enumerate() {
            assert_eq!(decide(grace, elapsed, dom), want, "case {i}");
        }
    }
}
