//! What to do with a VMI that is being deleted (or whose pod is going away): KubeVirt's
//! `processVmShutdown` / `hasGracePeriodExpired` / `shutdownVMI`.
//!
//! ACPI power-down is sent, and re-sent every few seconds because a booting guest can miss the
//! button; once the grace period is over the domain is killed. The handler's part ends when the
//! domain is gone; virt-controller then releases the VMI's finalizer once the pod is gone too.

use std::time::Duration;

use launcher_api::domain::DomainState;

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
    /// Power-down was sent less than [`RESEND_EVERY`] ago: look again after `recheck`.
    Wait { recheck: Duration },
    /// The grace period is over (or there is none): kill QEMU.
    Kill { event: Event },
    /// The domain is gone: nothing is left to stop.
    Done,
}

/// `grace`: the VMI's `terminationGracePeriodSeconds` (None: KubeVirt's default).
/// `elapsed`: since the shutdown began. The shell takes it from something that survives handler
/// restarts (the VMI's deletion timestamp), so a restart never starts the grace period again.
/// `last_signal`: how long ago power-down was last sent, if it was (only the first one is
/// announced by an event; a reconcile triggered by some other change does not send it again).
pub fn decide(
    grace: Option<i64>,
    elapsed: Duration,
    last_signal: Option<Duration>,
    domain: DomainPresence,
) -> Action {
    let DomainPresence::Alive(state) = domain else {
        return Action::Done;
    };
    // NoState: the launcher never started QEMU (no sync yet, or a refused one). There is
    // nothing to power down, and the launcher would refuse the call; KubeVirt likewise deletes
    // rather than shuts down a domain that does not exist.
    if state.is_final() || state == DomainState::NoState {
        return Action::Done;
    }
    let grace = Duration::from_secs(grace.unwrap_or(DEFAULT_GRACE_SECONDS).max(0).unsigned_abs());
    if elapsed >= grace {
        return Action::Kill {
            event: Event::normal("Deleted", MSG_STOPPING),
        };
    }
    let left = grace.saturating_sub(elapsed);
    if let Some(ago) = last_signal.filter(|a| *a < RESEND_EVERY) {
        return Action::Wait {
            recheck: RESEND_EVERY.saturating_sub(ago).min(left),
        };
    }
    Action::Shutdown {
        recheck: left.clamp(Duration::from_secs(1), RESEND_EVERY),
        event: last_signal
            .is_none()
            .then(|| Event::normal("ShuttingDown", MSG_GRACEFUL)),
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
        let never = None;
        let ago = |s: u64| Some(secs(s));
        let cases = [
            (None, secs(0), never, alive, shutting(5, true)),
            (Some(3), secs(0), never, alive, shutting(3, true)),
            (Some(30), secs(6), ago(5), alive, shutting(5, false)),
            (Some(30), secs(27), ago(6), alive, shutting(3, false)),
            (
                Some(30),
                Duration::from_millis(29_500),
                ago(5),
                alive,
                shutting(1, false),
            ),
            // Sent a moment ago (another change woke the loop): not again yet.
            (
                Some(30),
                secs(2),
                ago(2),
                alive,
                Action::Wait { recheck: secs(3) },
            ),
            (
                Some(30),
                secs(28),
                ago(1),
                alive,
                Action::Wait { recheck: secs(2) },
            ),
            (Some(30), secs(30), ago(1), alive, kill.clone()),
            // A handler restarted after the grace period: straight to kill, no power button.
            (Some(30), secs(31), never, alive, kill.clone()),
            (None, secs(179), ago(5), alive, shutting(1, false)),
            (None, secs(180), ago(5), alive, kill.clone()),
            (Some(0), secs(0), never, alive, kill.clone()),
            (Some(-5), secs(0), never, alive, kill.clone()),
            (
                Some(30),
                secs(0),
                never,
                DomainPresence::Alive(DomainState::Paused),
                shutting(5, true),
            ),
            (
                None,
                secs(0),
                never,
                DomainPresence::Alive(DomainState::Shutoff),
                Action::Done,
            ),
            (
                None,
                secs(1),
                ago(1),
                DomainPresence::Alive(DomainState::Crashed),
                Action::Done,
            ),
            (Some(0), secs(0), never, DomainPresence::Gone, Action::Done),
            (
                Some(30),
                secs(0),
                never,
                DomainPresence::Alive(DomainState::NoState),
                Action::Done,
            ),
        ];
        for (i, (grace, elapsed, last, dom, want)) in cases.into_iter().enumerate() {
            assert_eq!(decide(grace, elapsed, last, dom), want, "case {i}");
        }
    }
}
