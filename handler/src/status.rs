//! VMI status from what the handler observes (the launcher's domain, the launcher pod), as
//! KubeVirt's virt-handler computes it (`pkg/virt-handler/vm.go`: `updateVMIStatus`,
//! `calculateVmPhaseForStatusReason`, the condition updaters) plus the `Ready` condition, which
//! KubeVirt's controller derives from the launcher pod.
//!
//! Pure: the caller passes the clock, so a table test pins every rule.

use std::collections::BTreeSet;

use api::status::{
    Condition, PhaseTransitionTimestamp, VirtualMachineInstanceCondition,
    VirtualMachineInstanceConditionType as Cond, VirtualMachineInstanceGuestOsInfo,
    VirtualMachineInstanceNetworkInterface,
};
use api::{ConditionStatus, VirtualMachineInstance, VirtualMachineInstancePhase as Phase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use launcher_api::domain::{Domain, DomainState, FsFreeze};
use launcher_api::guest::AgentInterface;
use network::status::DomainInterface;

use crate::events::{Event, EventType};

/// KubeVirt's default `terminationGracePeriodSeconds`.
pub const DEFAULT_GRACE_SECONDS: i64 = 180;

/// Event messages, word for word KubeVirt's (`pkg/virt-handler/controller.go`), so tools that
/// match on them keep working.
pub const MSG_STARTED: &str = "VirtualMachineInstance started.";
pub const MSG_SHUTDOWN: &str = "The VirtualMachineInstance was shut down.";
pub const MSG_CRASHED: &str = "The VirtualMachineInstance crashed.";
/// `status.fsFreezeStatus` while the guest's filesystems are frozen (KubeVirt's `FSFrozen`).
pub const FS_FROZEN: &str = "frozen";
/// The (odd, but KubeVirt's) reason of the `Synchronized=False` condition.
pub const SYNC_FAILED_REASON: &str = "Synchronizing with the Domain failed.";

/// What the handler knows about the launcher of the VMI's active pod.
#[derive(Debug, Clone, PartialEq)]
pub enum LauncherView {
    /// The launcher's command socket has not appeared yet: the pod is still starting.
    NotReady,
    /// The socket exists but the launcher has not answered for longer than the handler's
    /// unresponsive timeout (or the socket is gone while the pod is said to run).
    Unresponsive,
    /// The launcher answers; its latest domain.
    Answering(Box<Domain>),
}

/// The launcher pod as the handler sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum PodView {
    /// No active pod (never created, or deleted).
    Absent,
    /// The pod has a deletion timestamp or has ended.
    Terminating,
    /// The pod runs; its `Ready` condition if it has one.
    Running { ready: Option<PodReady> },
}

/// The pod's `Ready` condition, copied into the VMI's.
#[derive(Debug, Clone, PartialEq)]
pub struct PodReady {
    pub ready: bool,
    pub reason: Option<String>,
    pub message: Option<String>,
}

/// Everything `compute` looks at besides the VMI.
#[derive(Debug, Clone)]
pub struct Observed {
    pub launcher: LauncherView,
    pub pod: PodView,
    /// `guest-get-osinfo`, fetched by the shell while the agent is connected.
    pub guest_os: Option<VirtualMachineInstanceGuestOsInfo>,
    /// `guest-network-get-interfaces`, fetched by the shell while the agent is connected.
    pub guest_interfaces: Option<Vec<AgentInterface>>,
    /// The error of the last sync attempt (KubeVirt's `Synchronized` condition).
    pub sync_error: Option<String>,
    /// Hotplugged volumes whose images are mounted in the launcher.
    pub hotplug_mounted: BTreeSet<String>,
    pub now: Time,
}

/// The new status and the events to record for the change.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub status: api::VirtualMachineInstanceStatus,
    pub events: Vec<Event>,
}

impl Outcome {
    /// Whether a status write is needed.
    pub fn changed(&self, vmi: &VirtualMachineInstance) -> bool {
        vmi.status.as_ref() != Some(&self.status)
    }
}

/// ACPI shutdown is tried (and a destroyed domain therefore counts as Failed) unless the VMI
/// asked for no grace at all.
fn acpi_shutdown_expected(vmi: &VirtualMachineInstance) -> bool {
    vmi.spec.termination_grace_period_seconds != Some(0)
}

/// The phase the domain implies; `None` keeps the current one.
fn phase_for(
    vmi: &VirtualMachineInstance,
    current: Option<&Phase>,
    obs: &Observed,
) -> (Option<Phase>, Option<String>) {
    let scheduled_or_running = matches!(current, Some(Phase::Scheduled | Phase::Running));
    let domain = match &obs.launcher {
        LauncherView::Answering(d) if d.state != DomainState::NoState => Some(d),
        _ => None,
    };
    let Some(domain) = domain else {
        if scheduled_or_running {
            if obs.pod == PodView::Absent {
                return (
                    Some(Phase::Failed),
                    Some("the virt-launcher pod is gone".to_owned()),
                );
            }
            if obs.launcher == LauncherView::Unresponsive {
                return (
                    Some(Phase::Failed),
                    Some("virt-launcher is unresponsive".to_owned()),
                );
            }
            return (None, None);
        }
        return match obs.launcher {
            LauncherView::NotReady | LauncherView::Unresponsive => (None, None),
            LauncherView::Answering(_) => (Some(Phase::Scheduled), None),
        };
    };
    match domain.state {
        DomainState::Shutoff | DomainState::Crashed => match domain.reason.as_str() {
            "Crashed" | "Panicked" => (Some(Phase::Failed), domain.message.clone()),
            "Destroyed" if acpi_shutdown_expected(vmi) => (
                Some(Phase::Failed),
                Some("the domain was destroyed (killed after the grace period)".to_owned()),
            ),
            "Destroyed" | "Shutdown" | "Saved" | "FromSnapshot" => (Some(Phase::Succeeded), None),
            _ if domain.state == DomainState::Crashed => {
                (Some(Phase::Failed), domain.message.clone())
            }
            _ => (None, None),
        },
        DomainState::Paused | DomainState::Running => (Some(Phase::Running), None),
        DomainState::Starting | DomainState::NoState => {
            if scheduled_or_running {
                (None, None)
            } else {
                (Some(Phase::Scheduled), None)
            }
        }
    }
}

/// The `Paused` condition KubeVirt sets for a pause reason; `None` for reasons it sets none for
/// (a pause QEMU made on its own).
fn paused_condition(reason: &str, now: &Time) -> Option<VirtualMachineInstanceCondition> {
    let (reason, message) = match reason {
        "User" => ("PausedByUser", "VMI was paused by user"),
        "IOError" => (
            "PausedIOError",
            "VMI was paused, low-level IO error detected",
        ),
        "Migration" => (
            "PausedByMigrationMonitor",
            "VMI was paused by the migration monitor",
        ),
        _ => return None,
    };
    Some(Condition {
        type_: Cond::Paused,
        status: ConditionStatus::True,
        last_probe_time: Some(now.clone()),
        last_transition_time: Some(now.clone()),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
    })
}

fn has(conds: &[VirtualMachineInstanceCondition], t: &Cond) -> bool {
    conds.iter().any(|c| &c.type_ == t)
}

fn remove(conds: &mut Vec<VirtualMachineInstanceCondition>, t: &Cond) -> bool {
    let before = conds.len();
    conds.retain(|c| &c.type_ != t);
    before != conds.len()
}

/// Replaces the condition of that type unless status, reason and message are already the same
/// (so an unchanged status keeps its timestamps and causes no write).
fn upsert(conds: &mut Vec<VirtualMachineInstanceCondition>, new: VirtualMachineInstanceCondition) {
    if let Some(old) = conds.iter_mut().find(|c| c.type_ == new.type_) {
        if old.status != new.status || old.reason != new.reason || old.message != new.message {
            *old = new;
        }
    } else {
        conds.push(new);
    }
}

fn ready_condition(pod: &PodView, running: bool, now: &Time) -> VirtualMachineInstanceCondition {
    let not_ready = |reason: &str, message: &str| Condition {
        type_: Cond::Ready,
        status: ConditionStatus::False,
        last_probe_time: Some(now.clone()),
        last_transition_time: Some(now.clone()),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
    };
    match pod {
        PodView::Absent => not_ready(
            "PodNotExists",
            "virt-launcher pod has not yet been scheduled",
        ),
        PodView::Terminating => not_ready("PodTerminating", "virt-launcher pod is terminating"),
        PodView::Running { .. } if !running => {
            not_ready("GuestNotRunning", "Guest VM is not reported as running")
        }
        PodView::Running { ready: Some(r) } => Condition {
            type_: Cond::Ready,
            status: if r.ready {
                ConditionStatus::True
            } else {
                ConditionStatus::False
            },
            last_probe_time: Some(now.clone()),
            last_transition_time: Some(now.clone()),
            reason: r.reason.clone(),
            message: r.message.clone(),
        },
        PodView::Running { ready: None } => Condition {
            type_: Cond::Ready,
            status: ConditionStatus::False,
            last_probe_time: Some(now.clone()),
            last_transition_time: Some(now.clone()),
            reason: Some("PodConditionMissing".to_owned()),
            message: Some("virt-launcher pod is missing the Ready condition".to_owned()),
        },
    }
}

/// The domain's interfaces, keeping what the guest agent added to an interface of the same name
/// (IPs, the guest's interface name).
fn interfaces(
    old: &[VirtualMachineInstanceNetworkInterface],
    domain: &Domain,
) -> Vec<VirtualMachineInstanceNetworkInterface> {
    domain
        .interfaces
        .iter()
        .map(|i| {
            let prev = old.iter().find(|o| o.name.as_deref() == Some(&i.name));
            VirtualMachineInstanceNetworkInterface {
                name: Some(i.name.clone()),
                mac: i.mac.clone(),
                info_source: Some(
                    prev.and_then(|p| p.info_source.clone())
                        .unwrap_or_else(|| "domain".to_owned()),
                ),
                ip: prev.and_then(|p| p.ip.clone()),
                ips: prev.map(|p| p.ips.clone()).unwrap_or_default(),
                interface_name: prev.and_then(|p| p.interface_name.clone()),
                pod_interface_name: prev.and_then(|p| p.pod_interface_name.clone()),
                queue_count: i.queue_count.or_else(|| prev.and_then(|p| p.queue_count)),
                link_state: i
                    .link_state
                    .clone()
                    .or_else(|| prev.and_then(|p| p.link_state.clone())),
            }
        })
        .collect()
}

fn domain_interfaces(domain: &Domain) -> Vec<DomainInterface> {
    domain
        .interfaces
        .iter()
        .map(|i| DomainInterface {
            name: i.name.clone(),
            mac: i.mac.clone(),
            pod_interface: None,
            link_state: i.link_state.clone(),
            queue_count: i.queue_count,
        })
        .collect()
}

/// The status the VMI should have now, and the events for the change.
pub fn compute(vmi: &VirtualMachineInstance, obs: &Observed) -> Outcome {
    let old = vmi.status.clone().unwrap_or_default();
    if old.phase.as_ref().is_some_and(Phase::is_final) {
        return Outcome {
            status: old,
            events: Vec::new(),
        };
    }
    let mut status = old.clone();
    let mut events = Vec::new();

    let domain = match &obs.launcher {
        LauncherView::Answering(d) => Some(d),
        _ => None,
    };

    if let Some(d) = domain
        && !d.interfaces.is_empty()
    {
        status.interfaces = match &obs.guest_interfaces {
            Some(agent) => network::status::merge(&domain_interfaces(d), Some(agent)),
            None => interfaces(&old.interfaces, d),
        };
    }
    if let Some(d) = domain {
        let (volumes, volume_events) =
            crate::volumes::compute(vmi, &old.volume_status, &d.disks, &obs.hotplug_mounted);
        status.volume_status = volumes;
        events.extend(volume_events);
        // KubeVirt's `updateFSFreezeStatus`: the agent's answer as the launcher relays it, kept
        // while there is none yet. A freeze ends with the agent's connection (the guest
        // rebooted or stopped).
        match (d.agent_connected, d.fs_freeze_status) {
            (true, Some(FsFreeze::Frozen)) => status.fs_freeze_status = Some(FS_FROZEN.to_owned()),
            (true, Some(FsFreeze::Thawed)) | (false, _) => status.fs_freeze_status = None,
            (true, None) => {}
        }
    }
    if let Some(os) = &obs.guest_os {
        let name_differs =
            status.guest_os_info.as_ref().and_then(|g| g.name.as_ref()) != os.name.as_ref();
        if os.name.as_deref().is_some_and(|n| !n.is_empty()) && name_differs {
            status.guest_os_info = Some(os.clone());
        }
    }

    let (phase, why) = phase_for(vmi, old.phase.as_ref(), obs);
    if let Some(p) = phase {
        status.phase = Some(p);
    }

    // AgentConnected: added once (its probe time is when it was first seen), removed when the
    // channel drops.
    let agent = domain.is_some_and(|d| d.agent_connected);
    if agent && !has(&status.conditions, &Cond::AgentConnected) {
        status.conditions.push(Condition {
            type_: Cond::AgentConnected,
            status: ConditionStatus::True,
            last_probe_time: Some(obs.now.clone()),
            last_transition_time: None,
            reason: None,
            message: None,
        });
    } else if !agent {
        remove(&mut status.conditions, &Cond::AgentConnected);
    }

    let paused = domain.filter(|d| d.state == DomainState::Paused);
    if let Some(d) = paused {
        if !has(&status.conditions, &Cond::Paused)
            && let Some(c) = paused_condition(&d.reason, &obs.now)
        {
            events.push(Event::normal(
                "Paused",
                c.message.as_deref().unwrap_or_default(),
            ));
            status.conditions.push(c);
        }
    } else if remove(&mut status.conditions, &Cond::Paused) {
        events.push(Event::normal("Resumed", "VMI was unpaused"));
    }

    match &obs.sync_error {
        Some(e) => {
            if status
                .condition(&Cond::Synchronized)
                .is_none_or(|c| c.message.as_deref() != Some(e))
            {
                events.push(Event::warning("SyncFailed", e));
            }
            upsert(
                &mut status.conditions,
                Condition {
                    type_: Cond::Synchronized,
                    status: ConditionStatus::False,
                    last_probe_time: Some(obs.now.clone()),
                    last_transition_time: Some(obs.now.clone()),
                    reason: Some(SYNC_FAILED_REASON.to_owned()),
                    message: Some(e.clone()),
                },
            );
        }
        None => {
            // Only ours: virt-controller also reports on Synchronized (validation, image pulls).
            status.conditions.retain(|c| {
                c.type_ != Cond::Synchronized || c.reason.as_deref() != Some(SYNC_FAILED_REASON)
            });
        }
    }

    let running = status.phase == Some(Phase::Running);
    upsert(
        &mut status.conditions,
        ready_condition(&obs.pod, running, &obs.now),
    );
    // Set once, with the Running phase; virt-controller keeps it from then on, so the two
    // never write it back and forth should they judge a claim differently.
    if running && !has(&status.conditions, &Cond::LiveMigratable) {
        let claims = status.volume_status.clone();
        api::migration::set_live_migration_status(
            &mut status,
            vmi,
            |name| api::backendstorage::named_claim_shared(&claims, name),
            &obs.now,
        );
    }

    if status.phase != old.phase
        && let Some(p) = &status.phase
    {
        if !status
            .phase_transition_timestamps
            .iter()
            .any(|t| t.phase.as_ref() == Some(p))
        {
            status
                .phase_transition_timestamps
                .push(PhaseTransitionTimestamp {
                    phase: Some(p.clone()),
                    phase_transition_timestamp: Some(obs.now.clone()),
                });
        }
        match p {
            Phase::Running => events.push(Event::normal("Started", MSG_STARTED)),
            Phase::Succeeded => events.push(Event::normal("Stopped", MSG_SHUTDOWN)),
            Phase::Failed => {
                let msg = match &why {
                    Some(w) => format!("{MSG_CRASHED} {w}"),
                    None => MSG_CRASHED.to_owned(),
                };
                events.push(Event {
                    type_: EventType::Warning,
                    reason: "Stopped".to_owned(),
                    message: msg,
                });
            }
            _ => {}
        }
    }

    Outcome { status, events }
}

#[cfg(test)]
mod tests {
    use super::*;
    use launcher_api::domain::InterfaceStatus;
    use pretty_assertions::assert_eq;

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + s).expect("valid"))
    }

    fn vmi(phase: Option<Phase>, grace: Option<i64>) -> VirtualMachineInstance {
        let mut v = VirtualMachineInstance::new("vm", api::VirtualMachineInstanceSpec::default());
        v.spec.termination_grace_period_seconds = grace;
        v.status = Some(api::VirtualMachineInstanceStatus {
            phase,
            ..Default::default()
        });
        v
    }

    fn dom(state: DomainState, reason: &str) -> LauncherView {
        LauncherView::Answering(Box::new(Domain {
            state,
            reason: reason.to_owned(),
            ..Domain::default()
        }))
    }

    fn running_pod() -> PodView {
        PodView::Running {
            ready: Some(PodReady {
                ready: true,
                reason: None,
                message: None,
            }),
        }
    }

    fn obs(launcher: LauncherView, pod: PodView) -> Observed {
        Observed {
            launcher,
            pod,
            guest_os: None,
            guest_interfaces: None,
            sync_error: None,
            hotplug_mounted: BTreeSet::new(),
            now: t(10),
        }
    }

    #[test]
    fn phase_table() {
        use DomainState as D;
        use Phase as P;
        type Case = (
            Option<P>,
            Option<i64>,
            LauncherView,
            PodView,
            Option<P>,
            &'static [&'static str],
        );
        let cases: Vec<Case> = vec![
            // A fresh VMI whose launcher answers without a domain is Scheduled.
            (
                Some(P::Scheduling),
                None,
                dom(D::NoState, ""),
                running_pod(),
                Some(P::Scheduled),
                &[],
            ),
            (
                None,
                None,
                dom(D::Starting, "Starting"),
                running_pod(),
                Some(P::Scheduled),
                &[],
            ),
            // The socket is not there yet: keep waiting.
            (
                Some(P::Scheduling),
                None,
                LauncherView::NotReady,
                running_pod(),
                Some(P::Scheduling),
                &[],
            ),
            (
                Some(P::Scheduled),
                None,
                dom(D::Starting, "Starting"),
                running_pod(),
                Some(P::Scheduled),
                &[],
            ),
            (
                Some(P::Scheduled),
                None,
                dom(D::Running, "Booted"),
                running_pod(),
                Some(P::Running),
                &["Started"],
            ),
            (
                Some(P::Running),
                None,
                dom(D::Running, "Unpaused"),
                running_pod(),
                Some(P::Running),
                &[],
            ),
            (
                Some(P::Running),
                None,
                dom(D::Paused, "User"),
                running_pod(),
                Some(P::Running),
                &["Paused"],
            ),
            (
                Some(P::Running),
                None,
                dom(D::Shutoff, "Shutdown"),
                running_pod(),
                Some(P::Succeeded),
                &["Stopped"],
            ),
            (
                Some(P::Running),
                None,
                dom(D::Crashed, "Crashed"),
                running_pod(),
                Some(P::Failed),
                &["Stopped"],
            ),
            (
                Some(P::Running),
                None,
                dom(D::Crashed, "Panicked"),
                running_pod(),
                Some(P::Failed),
                &["Stopped"],
            ),
            // Killed after the grace period: Failed while ACPI was expected...
            (
                Some(P::Running),
                None,
                dom(D::Shutoff, "Destroyed"),
                running_pod(),
                Some(P::Failed),
                &["Stopped"],
            ),
            (
                Some(P::Running),
                Some(30),
                dom(D::Shutoff, "Destroyed"),
                running_pod(),
                Some(P::Failed),
                &["Stopped"],
            ),
            // ...but a VMI that asked for no grace is simply done.
            (
                Some(P::Running),
                Some(0),
                dom(D::Shutoff, "Destroyed"),
                running_pod(),
                Some(P::Succeeded),
                &["Stopped"],
            ),
            // Launcher lost or pod gone while running.
            (
                Some(P::Running),
                None,
                LauncherView::Unresponsive,
                running_pod(),
                Some(P::Failed),
                &["Stopped"],
            ),
            (
                Some(P::Scheduled),
                None,
                LauncherView::Unresponsive,
                PodView::Terminating,
                Some(P::Failed),
                &["Stopped"],
            ),
            (
                Some(P::Running),
                None,
                LauncherView::NotReady,
                PodView::Absent,
                Some(P::Failed),
                &["Stopped"],
            ),
            (
                Some(P::Running),
                None,
                LauncherView::NotReady,
                running_pod(),
                Some(P::Running),
                &[],
            ),
            // Final phases never change.
            (
                Some(P::Succeeded),
                None,
                dom(D::Running, "Booted"),
                running_pod(),
                Some(P::Succeeded),
                &[],
            ),
            (
                Some(P::Failed),
                None,
                dom(D::Running, "Booted"),
                running_pod(),
                Some(P::Failed),
                &[],
            ),
        ];
        for (i, (phase, grace, launcher, pod, want, want_events)) in cases.into_iter().enumerate() {
            let v = vmi(phase, grace);
            let out = compute(&v, &obs(launcher, pod));
            assert_eq!(out.status.phase, want, "case {i}");
            let reasons: Vec<&str> = out.events.iter().map(|e| e.reason.as_str()).collect();
            assert_eq!(reasons, want_events, "case {i}");
        }
    }

    #[test]
    fn live_migratable_is_set_with_running_from_the_claims_in_the_volume_status() {
        let scheduled = |modes: &str| {
            let mut v = vmi(Some(Phase::Scheduled), None);
            v.spec.volumes.push(
                serde_json::from_value(serde_json::json!(
                    {"name": "data", "persistentVolumeClaim": {"claimName": "c"}}
                ))
                .expect("a claim volume"),
            );
            let status = v.status.as_mut().expect("a status");
            status.volume_status = vec![
                serde_json::from_value(serde_json::json!({"name": "data", "target": "",
                    "persistentVolumeClaimInfo": {"claimName": "c", "accessModes": [modes]}}))
                .expect("a volume status"),
            ];
            v
        };
        let condition = |out: &Outcome| {
            out.status
                .conditions
                .iter()
                .find(|c| c.type_ == Cond::LiveMigratable)
                .map(|c| (c.status.clone(), c.reason.clone()))
        };
        let booted = || obs(dom(DomainState::Running, "Booted"), running_pod());
        let shared = compute(&scheduled("ReadWriteMany"), &booted());
        assert_eq!(condition(&shared), Some((ConditionStatus::True, None)));
        assert_eq!(
            shared.status.migration_method.as_deref(),
            Some("LiveMigration")
        );
        let own = compute(&scheduled("ReadWriteOnce"), &booted());
        assert_eq!(
            condition(&own),
            Some((
                ConditionStatus::False,
                Some(api::migration::DISKS_NOT_LIVE_MIGRATABLE.to_owned())
            ))
        );
        // virt-controller's answer stays once there, whatever the handler would say.
        let mut running = scheduled("ReadWriteOnce");
        running.status.as_mut().expect("a status").phase = Some(Phase::Running);
        running.status.as_mut().expect("a status").conditions = shared.status.conditions;
        assert_eq!(
            condition(&compute(&running, &booted())),
            Some((ConditionStatus::True, None))
        );
        // Not before the guest runs.
        let starting = obs(dom(DomainState::Starting, "Starting"), running_pod());
        assert_eq!(
            condition(&compute(&scheduled("ReadWriteMany"), &starting)),
            None
        );
    }

    #[test]
    fn failed_event_carries_the_domain_message() {
        let v = vmi(Some(Phase::Running), None);
        let mut d = Domain {
            state: DomainState::Crashed,
            reason: "Crashed".into(),
            message: Some("QEMU was killed by signal 9".into()),
            ..Domain::default()
        };
        d.generation = 3;
        let out = compute(
            &v,
            &obs(LauncherView::Answering(Box::new(d)), running_pod()),
        );
        assert_eq!(out.events[0].type_, EventType::Warning);
        assert_eq!(
            out.events[0].message,
            "The VirtualMachineInstance crashed. QEMU was killed by signal 9"
        );
    }

    #[test]
    fn phase_transition_timestamps_are_appended_once_per_phase() {
        let v = vmi(Some(Phase::Scheduled), None);
        let out = compute(&v, &obs(dom(DomainState::Running, "Booted"), running_pod()));
        assert_eq!(
            out.status.phase_transition_timestamps,
            vec![PhaseTransitionTimestamp {
                phase: Some(Phase::Running),
                phase_transition_timestamp: Some(t(10)),
            }]
        );
        // Same phase again: nothing new, no write needed.
        let mut v2 = v.clone();
        v2.status = Some(out.status.clone());
        let mut o = obs(dom(DomainState::Running, "Booted"), running_pod());
        o.now = t(99);
        let again = compute(&v2, &o);
        assert!(!again.changed(&v2), "{:#?}", again.status);
        assert!(again.events.is_empty());
    }

    #[test]
    fn paused_condition_follows_the_domain_with_kubevirt_reasons() {
        let cases = [
            ("User", Some(("PausedByUser", "VMI was paused by user"))),
            (
                "IOError",
                Some((
                    "PausedIOError",
                    "VMI was paused, low-level IO error detected",
                )),
            ),
            (
                "Migration",
                Some((
                    "PausedByMigrationMonitor",
                    "VMI was paused by the migration monitor",
                )),
            ),
            ("Unknown", None),
        ];
        for (reason, want) in cases {
            let v = vmi(Some(Phase::Running), None);
            let out = compute(&v, &obs(dom(DomainState::Paused, reason), running_pod()));
            let got = out.status.condition(&Cond::Paused).map(|c| {
                (
                    c.reason.clone().unwrap_or_default(),
                    c.message.clone().unwrap_or_default(),
                )
            });
            assert_eq!(
                got,
                want.map(|(r, m)| (r.to_owned(), m.to_owned())),
                "{reason}"
            );
            if let Some(c) = out.status.condition(&Cond::Paused) {
                assert_eq!(c.status, ConditionStatus::True);
            }
        }
        // Resuming removes it and says so.
        let mut v = vmi(Some(Phase::Running), None);
        let paused = compute(&v, &obs(dom(DomainState::Paused, "User"), running_pod()));
        v.status = Some(paused.status);
        let resumed = compute(
            &v,
            &obs(dom(DomainState::Running, "Unpaused"), running_pod()),
        );
        assert!(resumed.status.condition(&Cond::Paused).is_none());
        assert_eq!(
            resumed.events,
            vec![Event::normal("Resumed", "VMI was unpaused")]
        );
    }

    #[test]
    fn agent_connected_is_added_once_and_removed_on_disconnect() {
        let mut v = vmi(Some(Phase::Running), None);
        let d = |agent| {
            LauncherView::Answering(Box::new(Domain {
                state: DomainState::Running,
                reason: "Booted".into(),
                agent_connected: agent,
                ..Domain::default()
            }))
        };
        let out = compute(&v, &obs(d(true), running_pod()));
        let c = out.status.condition(&Cond::AgentConnected).expect("added");
        assert_eq!(c.status, ConditionStatus::True);
        assert_eq!(c.last_probe_time, Some(t(10)));
        v.status = Some(out.status);
        let mut later = obs(d(true), running_pod());
        later.now = t(50);
        let out = compute(&v, &later);
        assert_eq!(
            out.status
                .condition(&Cond::AgentConnected)
                .and_then(|c| c.last_probe_time.clone()),
            Some(t(10)),
            "kept, not re-probed"
        );
        v.status = Some(out.status);
        let out = compute(&v, &obs(d(false), running_pod()));
        assert!(out.status.condition(&Cond::AgentConnected).is_none());
    }

    #[test]
    fn ready_condition_table() {
        let pod_ready = |ready: bool| PodView::Running {
            ready: Some(PodReady {
                ready,
                reason: (!ready).then(|| "ContainersNotReady".to_owned()),
                message: None,
            }),
        };
        let cases = [
            (
                dom(DomainState::Running, "Booted"),
                pod_ready(true),
                ConditionStatus::True,
                None,
            ),
            (
                dom(DomainState::Running, "Booted"),
                pod_ready(false),
                ConditionStatus::False,
                Some("ContainersNotReady"),
            ),
            (
                dom(DomainState::Starting, "Starting"),
                pod_ready(true),
                ConditionStatus::False,
                Some("GuestNotRunning"),
            ),
            (
                dom(DomainState::Running, "Booted"),
                PodView::Terminating,
                ConditionStatus::False,
                Some("PodTerminating"),
            ),
            (
                LauncherView::NotReady,
                PodView::Absent,
                ConditionStatus::False,
                Some("PodNotExists"),
            ),
            (
                dom(DomainState::Running, "Booted"),
                PodView::Running { ready: None },
                ConditionStatus::False,
                Some("PodConditionMissing"),
            ),
        ];
        for (i, (launcher, pod, status, reason)) in cases.into_iter().enumerate() {
            let out = compute(&vmi(Some(Phase::Scheduled), None), &obs(launcher, pod));
            let c = out.status.condition(&Cond::Ready).expect("always set");
            assert_eq!(
                (&c.status, c.reason.as_deref()),
                (&status, reason),
                "case {i}"
            );
        }
    }

    #[test]
    fn sync_error_sets_synchronized_false_once_and_clears() {
        let mut v = vmi(Some(Phase::Scheduled), None);
        let mut o = obs(dom(DomainState::NoState, "FailedSync"), running_pod());
        o.sync_error = Some("cannot start QEMU: no such file".into());
        let out = compute(&v, &o);
        let c = out.status.condition(&Cond::Synchronized).expect("set");
        assert_eq!(c.status, ConditionStatus::False);
        assert_eq!(c.reason.as_deref(), Some(SYNC_FAILED_REASON));
        assert_eq!(
            out.events,
            vec![Event::warning(
                "SyncFailed",
                "cannot start QEMU: no such file"
            )]
        );
        v.status = Some(out.status);
        let again = compute(&v, &o);
        assert!(again.events.is_empty(), "same error, no new event");
        o.sync_error = None;
        let cleared = compute(&v, &o);
        assert!(cleared.status.condition(&Cond::Synchronized).is_none());
    }

    fn two_nics() -> Vec<InterfaceStatus> {
        vec![
            InterfaceStatus {
                name: "default".into(),
                tap: "tap0".into(),
                mac: Some("52:54:00:00:00:01".into()),
                model: "virtio-net-pci".into(),
                link_state: Some("up".into()),
                queue_count: Some(4),
            },
            InterfaceStatus {
                name: "second".into(),
                tap: "tap1".into(),
                mac: Some("52:54:00:00:00:02".into()),
                model: "e1000".into(),
                link_state: Some("down".into()),
                queue_count: Some(1),
            },
        ]
    }

    #[test]
    fn the_agent_adds_the_guest_addresses_and_names_to_the_domain_interfaces() {
        let v = vmi(Some(Phase::Running), None);
        let d = Domain {
            state: DomainState::Running,
            reason: "Booted".into(),
            agent_connected: true,
            interfaces: two_nics(),
            ..Domain::default()
        };
        let mut o = obs(LauncherView::Answering(Box::new(d)), running_pod());
        o.guest_interfaces = Some(
            serde_json::from_value(serde_json::json!([
                {"name": "lo", "hardware-address": "00:00:00:00:00:00",
                 "ip-addresses": [{"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8}]},
                {"name": "eth0", "hardware-address": "52:54:00:00:00:01",
                 "ip-addresses": [
                    {"ip-address-type": "ipv6", "ip-address": "fe80::5054:ff:fe00:1", "prefix": 64},
                    {"ip-address-type": "ipv4", "ip-address": "10.0.2.2", "prefix": 24}]}
            ]))
            .expect("qemu-ga's shape"),
        );
        let ifs = compute(&v, &o).status.interfaces;
        assert_eq!(ifs.len(), 2, "loopback is not reported: {ifs:?}");
        assert_eq!(ifs[0].name.as_deref(), Some("default"));
        assert_eq!(ifs[0].ip.as_deref(), Some("10.0.2.2"));
        assert_eq!(ifs[0].ips, vec!["10.0.2.2".to_owned()], "no link-local");
        assert_eq!(ifs[0].interface_name.as_deref(), Some("eth0"));
        assert_eq!(ifs[0].info_source.as_deref(), Some("domain, guest-agent"));
        assert_eq!(ifs[0].queue_count, Some(4));
        assert_eq!(ifs[1].info_source.as_deref(), Some("domain"));
        assert_eq!(ifs[1].ip, None);
    }

    #[test]
    fn interfaces_come_from_the_domain_and_keep_agent_data() {
        let mut v = vmi(Some(Phase::Running), None);
        v.status.as_mut().expect("status").interfaces =
            vec![VirtualMachineInstanceNetworkInterface {
                name: Some("default".into()),
                ip: Some("10.0.2.2".into()),
                ips: vec!["10.0.2.2".into()],
                info_source: Some("domain, guest-agent".into()),
                interface_name: Some("eth0".into()),
                ..Default::default()
            }];
        let d = Domain {
            state: DomainState::Running,
            reason: "Booted".into(),
            interfaces: two_nics(),
            ..Domain::default()
        };
        let out = compute(
            &v,
            &obs(LauncherView::Answering(Box::new(d)), running_pod()),
        );
        let ifs = &out.status.interfaces;
        assert_eq!(ifs.len(), 2);
        assert_eq!(ifs[0].mac.as_deref(), Some("52:54:00:00:00:01"));
        assert_eq!(ifs[0].ip.as_deref(), Some("10.0.2.2"));
        assert_eq!(ifs[0].interface_name.as_deref(), Some("eth0"));
        assert_eq!(ifs[1].info_source.as_deref(), Some("domain"));
        assert_eq!(ifs[1].ip, None);
        assert_eq!(ifs[0].link_state.as_deref(), Some("up"));
        assert_eq!(ifs[1].link_state.as_deref(), Some("down"));
    }

    #[test]
    fn guest_os_info_is_taken_when_the_name_is_known_and_differs() {
        let v = vmi(Some(Phase::Running), None);
        let mut o = obs(dom(DomainState::Running, "Booted"), running_pod());
        o.guest_os = Some(VirtualMachineInstanceGuestOsInfo {
            name: Some("Debian GNU/Linux".into()),
            kernel_release: Some("6.1.0-13-cloud-amd64".into()),
            ..Default::default()
        });
        let out = compute(&v, &o);
        assert_eq!(out.status.guest_os_info, o.guest_os);
        o.guest_os = Some(VirtualMachineInstanceGuestOsInfo::default());
        let out = compute(&v, &o);
        assert_eq!(out.status.guest_os_info, None, "an empty name is ignored");
    }

    #[test]
    fn fs_freeze_status_follows_the_agent_as_the_launcher_relays_it() {
        let agent = |connected: bool, fs: Option<FsFreeze>| {
            LauncherView::Answering(Box::new(Domain {
                state: DomainState::Running,
                reason: "Booted".into(),
                agent_connected: connected,
                fs_freeze_status: fs,
                ..Domain::default()
            }))
        };
        let mut v = vmi(Some(Phase::Running), None);
        let out = compute(&v, &obs(agent(true, Some(FsFreeze::Frozen)), running_pod()));
        assert_eq!(out.status.fs_freeze_status.as_deref(), Some(FS_FROZEN));
        // No answer yet (a launcher that just connected to the agent): the status keeps it.
        v.status = Some(out.status);
        let o = obs(agent(true, None), running_pod());
        assert_eq!(
            compute(&v, &o).status.fs_freeze_status.as_deref(),
            Some("frozen")
        );
        let o = obs(agent(true, Some(FsFreeze::Thawed)), running_pod());
        assert_eq!(compute(&v, &o).status.fs_freeze_status, None);
        // The agent went away (the guest rebooted): no freeze survives that.
        let o = obs(agent(false, Some(FsFreeze::Frozen)), running_pod());
        assert_eq!(compute(&v, &o).status.fs_freeze_status, None);
    }

    #[test]
    fn hotplugged_disks_reach_the_volume_status_with_their_events() {
        let v = vmi(Some(Phase::Running), None);
        let d = LauncherView::Answering(Box::new(Domain {
            state: DomainState::Running,
            reason: "Booted".into(),
            disks: vec![launcher_api::domain::DiskStatus {
                name: "hot".into(),
                bus: "scsi".into(),
                source: "/var/run/kubevirt/hotplug-disks/hot".into(),
                read_only: false,
                hotplugged: true,
            }],
            ..Domain::default()
        }));
        let out = compute(&v, &obs(d, running_pod()));
        let vs: Vec<_> = out
            .status
            .volume_status
            .iter()
            .map(|s| (s.name.as_str(), s.target.as_str(), s.phase.as_deref()))
            .collect();
        assert_eq!(vs, [("hot", "sda", Some("Ready"))]);
        assert!(
            out.events.iter().any(|e| e.reason == "VolumeReady"),
            "{:?}",
            out.events
        );
    }
}
