//! The migration controller's decisions as pure functions (`pkg/virt-controller/watch/migration`:
//! `updateStatus`, `processMigrationPhase`, `sync`, `handleTargetPodHandoff`,
//! `garbageCollectFinalizedMigrations`). One [`sync`] of a `VirtualMachineInstanceMigration`
//! takes the migration, its VMI, the VMI's launcher pods, the effective migration configuration
//! and the cluster's other migrations in flight, and returns what to do with the target pod,
//! the migration's new status, what to write into the VMI, the events and whether the
//! finalizer goes.
//!
//! Phases: "" -> Pending (the VMI may migrate) -> Scheduling (target pod created) -> Scheduled
//! (target pod ready on a node) -> handoff: `status.migrationState` and the
//! `kubevirt.io/migrationTargetNodeName` label written into the VMI -> PreparingTarget (the VMI
//! shows the handoff) -> TargetReady (the target virt-handler published
//! `targetNodeAddress`) -> Running (the source handler set `startTimestamp`) -> Succeeded
//! (`completed` and not `failed`). Any guard tripping -> Failed. Several steps may be taken in
//! one sync (each with its phase transition timestamp): one status write instead of one per
//! phase.

use std::time::Duration;

use api::common::{ConditionStatus, Preserved};
use api::labels;
use api::migration::{
    MigrationConfiguration, VirtualMachineInstanceMigration,
    VirtualMachineInstanceMigrationCondition, VirtualMachineInstanceMigrationConditionType,
    VirtualMachineInstanceMigrationPhase as Ph, VirtualMachineInstanceMigrationStatus,
};
use api::migrationpolicy::MigrationPolicy;
use api::status::{
    PhaseTransitionTimestamp, VirtualMachineInstanceConditionType,
    VirtualMachineInstanceMigrationState,
};
use api::{VirtualMachineInstance, VirtualMachineInstancePhase};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::vmi::{compute_terminated, current_pod, launcher_ready, pod_node, pod_phase};

/// `SuccessfulMigration`.
pub const SUCCESSFUL_MIGRATION: &str = "SuccessfulMigration";
/// `FailedMigration`.
pub const FAILED_MIGRATION: &str = "FailedMigration";
/// `SuccessfulHandOver`.
pub const SUCCESSFUL_HAND_OVER: &str = "SuccessfulHandOver";
/// `FailedHandOver`.
pub const FAILED_HAND_OVER: &str = "FailedHandOver";
/// `SuccessfulAbortMigration`.
pub const SUCCESSFUL_ABORT_MIGRATION: &str = "SuccessfulAbortMigration";
/// `FailedAbortMigration`.
pub const FAILED_ABORT_MIGRATION: &str = "FailedAbortMigration";
/// `migrationTargetPodUnschedulable`.
pub const TARGET_POD_UNSCHEDULABLE: &str = "migrationTargetPodUnschedulable";

/// Per-migration override of [`DEFAULT_UNSCHEDULABLE_TIMEOUT`], in seconds.
pub const UNSCHEDULABLE_TIMEOUT_ANNOTATION: &str =
    "kubevirt.io/migrationUnschedulablePodTimeoutSeconds";
/// Per-migration override of [`DEFAULT_PENDING_TIMEOUT`], in seconds.
pub const PENDING_TIMEOUT_ANNOTATION: &str = "kubevirt.io/migrationPendingPodTimeoutSeconds";
/// How long a target pod may stay unschedulable (KubeVirt's
/// `defaultUnschedulablePendingTimeoutSeconds`).
pub const DEFAULT_UNSCHEDULABLE_TIMEOUT: Duration = Duration::from_mins(5);
/// How long a target pod may stay Pending for any reason (`defaultCatchAllPendingTimeoutSeconds`).
pub const DEFAULT_PENDING_TIMEOUT: Duration = Duration::from_mins(15);
/// How soon a migration held back by the parallelism limits looks again (KubeVirt's default
/// re-enqueue delay).
pub const LIMIT_RETRY: Duration = Duration::from_secs(5);
/// Finished migrations kept per VMI (`defaultFinalizedMigrationGarbageCollectionBuffer`).
pub const FINISHED_KEPT_PER_VMI: usize = 5;

/// `FailedMigration` messages, KubeVirt's words.
pub mod messages {
    pub const VMI_MISSING: &str = "Migration failed because vmi does not exist.";
    pub const VMI_SHUTDOWN: &str = "Migration failed vmi shutdown during migration.";
    pub const CANCELED: &str = "Migration failed due to being canceled";
    pub const TARGET_POD_SHUTDOWN: &str =
        "Migration failed because target pod shutdown during migration";
    pub const TARGET_POD_REMOVED: &str =
        "Migration target pod was removed during active migration.";
    pub const STATE_CLEARED: &str =
        "VMI's migration state was cleared during the active migration.";
    pub const STATE_TAKEN_OVER: &str =
        "VMI's migration state was taken over by another migration job during active migration.";
    pub const SOURCE_FAILED: &str = "source node reported migration failed";
    pub const IN_PROGRESS: &str =
        "VMI is not eligible for migration because another migration job is in progress.";
    pub const NOT_RUNNING: &str = "Migration failed because vmi is not running.";
    pub const SUCCEEDED: &str = "Source node reported migration succeeded";
    pub const HANDED_OVER: &str = "Migration target pod is ready for preparation by virt-handler.";
    pub const ABORT_SIGNALLED: &str = "Migration is ready to be canceled by virt-handler.";
    /// `failureReason` the controller writes into the VMI when the target pod died before the
    /// migration started (`handleMarkMigrationFailedOnVMI`).
    pub const TARGET_POD_DOWN: &str = "Target pod is down";
}

/// Everything one sync reads.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    /// The migration.
    pub migration: &'a VirtualMachineInstanceMigration,
    /// Its VMI (`spec.vmiName` in the migration's namespace), if it exists.
    pub vmi: Option<&'a VirtualMachineInstance>,
    /// The VMI's launcher pods (source and target).
    pub pods: &'a [Pod],
    /// The effective migration configuration (`ClusterConfig.migrations`).
    pub config: &'a MigrationConfiguration,
    /// The MigrationPolicy matching the VMI ([`api::migrationpolicy::match_policy`]): its
    /// settings override `config` for this migration.
    pub policy: Option<&'a MigrationPolicy>,
    /// Other unfinished migrations counting against `parallelMigrationsPerCluster`
    /// ([`counts_as_running`]).
    pub running_in_cluster: usize,
    /// Of those, the ones whose VMI runs on this VMI's node
    /// (`parallelOutboundMigrationsPerNode`).
    pub outbound_from_node: usize,
    /// The VMI's `migrationState` names another migration that exists and is not final.
    pub state_owner_live: bool,
    /// The backend-storage claim made for this migration's target and not handed over yet
    /// ([`crate::backendstorage::target_claim_for`]).
    pub target_claim: Option<&'a str>,
    /// Now.
    pub now: Timestamp,
}

/// What to do with the target pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPodAction {
    /// Nothing.
    None,
    /// Render and create it ([`target_pod_metadata`] and friends).
    Create,
    /// Delete the pod of this name; the `SuccessfulDelete` event's message.
    Delete { name: String, message: String },
}

/// Where an event goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOn {
    /// The migration.
    Migration,
    /// Its VMI.
    Vmi,
}

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub on: EventOn,
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Event {
    fn warning(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            on: EventOn::Migration,
            warning: true,
            reason,
            message: message.into(),
        }
    }

    fn normal(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            on: EventOn::Migration,
            warning: false,
            reason,
            message: message.into(),
        }
    }
}

/// The `kubevirt.io/migrationTargetNodeName` label of the VMI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetLabel {
    /// Leave it.
    Keep,
    /// Set it to this node.
    Set(String),
    /// Remove it.
    Remove,
}

/// A write into the VMI: one compare-and-swap merge patch (the VMI has no status subresource).
#[derive(Debug, Clone, PartialEq)]
pub struct VmiChange {
    /// `status.migrationState` becomes exactly this.
    pub migration_state: VirtualMachineInstanceMigrationState,
    /// `status.migrationMethod`, when it changes.
    pub migration_method: Option<String>,
    /// The target node label.
    pub target_label: TargetLabel,
    /// Published once the patch went through.
    pub on_success: Option<Event>,
    /// Reason of the warning published on the migration when the patch fails.
    pub failure_reason: &'static str,
}

/// What to do with the backend-storage claims of a VMI whose claim is not shared (KubeVirt's
/// `MigrationHandoff` and `MigrationAbort`). The target's claim is made with the target pod:
/// [`TargetPodAction::Create`] with no `targetPersistentStatePVCName` in the status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimAction {
    None,
    /// The guest runs on the target: the target's claim becomes the VMI's, the source's goes.
    HandOver {
        source: String,
        target: String,
    },
    /// The migration failed: the claim made for the target goes.
    Delete(String),
}

/// Everything one sync decides.
#[derive(Debug, Clone, PartialEq)]
pub struct MigrationSync {
    /// The target pod.
    pub pod: TargetPodAction,
    /// The backend-storage claims; done before the status is written.
    pub claims: ClaimAction,
    /// The migration's status to write (equal to the old one when nothing changed).
    pub status: VirtualMachineInstanceMigrationStatus,
    /// What to write into the VMI.
    pub vmi: Option<VmiChange>,
    /// Published once the status is written (or nothing needed writing).
    pub events: Vec<Event>,
    /// Remove `kubevirt.io/migrationJobFinalize`.
    pub release_finalizer: bool,
    /// Look again after this long.
    pub requeue_after: Option<Duration>,
}

/// Succeeded or Failed.
pub fn is_final(m: &VirtualMachineInstanceMigration) -> bool {
    phase_final(m.status.as_ref().and_then(|s| s.phase.as_ref()))
}

fn phase_final(p: Option<&Ph>) -> bool {
    matches!(p, Some(Ph::Succeeded | Ph::Failed))
}

/// KubeVirt's `findRunningMigrations` criterion: an unfinished migration past Pending, or one
/// that already has a target pod. These count against `parallelMigrationsPerCluster`.
pub fn counts_as_running(m: &VirtualMachineInstanceMigration, has_target_pod: bool) -> bool {
    let phase = m.status.as_ref().and_then(|s| s.phase.as_ref());
    if phase_final(phase) {
        return false;
    }
    has_target_pod || !matches!(phase, None | Some(Ph::Pending))
}

fn uid_of(m: &VirtualMachineInstanceMigration) -> &str {
    m.metadata.uid.as_deref().unwrap_or_default()
}

/// Whether `pod` is the target pod of the migration with this uid.
pub fn is_target_pod_of(pod: &Pod, migration_uid: &str) -> bool {
    !migration_uid.is_empty()
        && pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(labels::MIGRATION_JOB_UID))
            .is_some_and(|u| u == migration_uid)
}

/// The migration's target pod among `pods`: one not being deleted, else any.
pub fn target_pod<'a>(m: &VirtualMachineInstanceMigration, pods: &'a [Pod]) -> Option<&'a Pod> {
    let uid = uid_of(m);
    let mut all = pods.iter().filter(|p| is_target_pod_of(p, uid));
    let first = all.clone().next();
    all.find(|p| p.metadata.deletion_timestamp.is_none())
        .or(first)
}

/// The VMI's `status.migrationState`.
pub fn vmi_state(vmi: &VirtualMachineInstance) -> Option<&VirtualMachineInstanceMigrationState> {
    vmi.status.as_ref().and_then(|s| s.migration_state.as_ref())
}

fn state_of<'a>(
    vmi: Option<&'a VirtualMachineInstance>,
    uid: &str,
) -> Option<&'a VirtualMachineInstanceMigrationState> {
    vmi.and_then(vmi_state)
        .filter(|s| !uid.is_empty() && s.migration_uid.as_deref() == Some(uid))
}

fn succeeded(s: &VirtualMachineInstanceMigrationState) -> bool {
    s.completed == Some(true) && s.failed != Some(true)
}

fn failed(s: &VirtualMachineInstanceMigrationState) -> bool {
    s.failed == Some(true)
}

/// A migration state that is over: completed or failed.
pub fn state_finished(s: &VirtualMachineInstanceMigrationState) -> bool {
    s.completed == Some(true) || s.failed == Some(true)
}

/// Whether `vmi` may start the migration with this uid; the `FailedMigration` message if not.
/// `state_owner_live`: the migration its `migrationState` names exists and is not final.
pub fn eligible(
    vmi: &VirtualMachineInstance,
    migration_uid: &str,
    state_owner_live: bool,
) -> Result<(), String> {
    let status = vmi.status.as_ref();
    if status.and_then(|s| s.phase.as_ref()) != Some(&VirtualMachineInstancePhase::Running) {
        return Err(messages::NOT_RUNNING.into());
    }
    let migratable =
        status.and_then(|s| s.condition(&VirtualMachineInstanceConditionType::LiveMigratable));
    match migratable {
        Some(c) if c.status == ConditionStatus::True => {}
        Some(c) => {
            return Err(format!(
                "Cannot migrate VMI, Reason: {}, Message: {}",
                c.reason.as_deref().unwrap_or_default(),
                c.message.as_deref().unwrap_or_default()
            ));
        }
        None => {
            return Err(
                "Cannot migrate VMI, Reason: NotMigratable, Message: the VMI has no LiveMigratable condition yet"
                    .into(),
            );
        }
    }
    match vmi_state(vmi) {
        None => Ok(()),
        Some(s) if s.migration_uid.as_deref().is_none_or(str::is_empty) => Ok(()),
        Some(s) if s.migration_uid.as_deref() == Some(migration_uid) => Ok(()),
        Some(s) if state_finished(s) || !state_owner_live => Ok(()),
        Some(_) => Err(messages::IN_PROGRESS.into()),
    }
}

/// A pod that is over: Succeeded, Failed, or its launcher exited.
fn pod_down(pod: &Pod) -> bool {
    matches!(pod_phase(pod), "Failed" | "Succeeded") || compute_terminated(pod)
}

fn set_phase(status: &mut VirtualMachineInstanceMigrationStatus, phase: Ph, now: Timestamp) {
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

fn add_abort_condition(status: &mut VirtualMachineInstanceMigrationStatus, now: Timestamp) {
    let t = VirtualMachineInstanceMigrationConditionType::AbortRequested;
    if status.conditions.iter().any(|c| c.type_ == t) {
        return;
    }
    status
        .conditions
        .push(VirtualMachineInstanceMigrationCondition {
            type_: t,
            status: ConditionStatus::True,
            last_probe_time: Some(Time(now)),
            last_transition_time: Some(Time(now)),
            reason: None,
            message: None,
        });
}

fn seconds_annotation(
    m: &VirtualMachineInstanceMigration,
    key: &str,
    default: Duration,
) -> Duration {
    m.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(default, Duration::from_secs)
}

fn elapsed(since: Option<&Time>, now: Timestamp) -> Option<Duration> {
    let since = since?.0;
    let d = now.duration_since(since);
    Some(Duration::try_from(d).unwrap_or(Duration::ZERO))
}

struct Ctx<'a> {
    i: &'a Input<'a>,
    uid: &'a str,
    status: VirtualMachineInstanceMigrationStatus,
    out: MigrationSync,
}

impl Ctx<'_> {
    fn fail(&mut self, message: &str) {
        set_phase(&mut self.status, Ph::Failed, self.i.now);
        self.out
            .events
            .push(Event::warning(FAILED_MIGRATION, message));
    }

    fn ns_name(pod: &Pod) -> String {
        format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default()
        )
    }

    fn delete_pod(&mut self, pod: &Pod, message: String) {
        if pod.metadata.deletion_timestamp.is_some() {
            return;
        }
        if let Some(name) = pod.metadata.name.clone() {
            self.out.pod = TargetPodAction::Delete { name, message };
        }
    }
}

/// Whether the VMI already shows this migration handed off: its `migrationState` names it
/// and a target node (KubeVirt's `IsTargetPreparing`).
fn handed_off(state: Option<&VirtualMachineInstanceMigrationState>) -> bool {
    state.is_some_and(|s| s.target_node.as_deref().is_some_and(|n| !n.is_empty()))
}

fn past_handoff(phase: Option<&Ph>) -> bool {
    matches!(
        phase,
        Some(Ph::PreparingTarget | Ph::TargetReady | Ph::Running)
    )
}

/// One sync of a migration.
pub fn sync(i: &Input<'_>) -> MigrationSync {
    let m = i.migration;
    let mut cx = Ctx {
        i,
        uid: uid_of(m),
        status: m.status.clone().unwrap_or_default(),
        out: MigrationSync {
            pod: TargetPodAction::None,
            claims: ClaimAction::None,
            status: VirtualMachineInstanceMigrationStatus::default(),
            vmi: None,
            events: Vec::new(),
            release_finalizer: false,
            requeue_after: None,
        },
    };
    if !phase_final(cx.status.phase.as_ref()) {
        active(&mut cx);
    }
    if phase_final(cx.status.phase.as_ref()) {
        finished(&mut cx);
    }
    cx.out.status = cx.status;
    cx.out
}

/// KubeVirt's `updateStatus` guards, in its order, then the phase steps.
fn active(cx: &mut Ctx<'_>) {
    let i = cx.i;
    let m = i.migration;
    let Some(vmi) = i.vmi else {
        cx.fail(messages::VMI_MISSING);
        return;
    };
    if crate::vmi::is_final(vmi) || vmi.metadata.deletion_timestamp.is_some() {
        cx.fail(messages::VMI_SHUTDOWN);
        return;
    }
    let state = state_of(i.vmi, cx.uid);
    let target = target_pod(m, i.pods);
    let phase = cx.status.phase.clone();
    let deleting = m.metadata.deletion_timestamp.is_some();
    let is_handed_off = handed_off(state) || past_handoff(phase.as_ref());

    if state.is_some_and(succeeded) && is_handed_off {
        // Done, whatever became of the pods since: the guest runs on the target.
        advance(cx, state, target);
        return;
    }
    if deleting && !is_handed_off {
        if let Some(pod) = target {
            cx.delete_pod(
                pod,
                format!(
                    "migration canceled and pod {} is deleted",
                    Ctx::ns_name(pod)
                ),
            );
        }
        add_abort_condition(&mut cx.status, i.now);
        cx.fail(messages::CANCELED);
        return;
    }
    if let Some(pod) = target
        && pod_down(pod)
    {
        cx.fail(messages::TARGET_POD_SHUTDOWN);
        return;
    }
    let target_created = !matches!(phase, None | Some(Ph::Pending));
    if target_created && target.is_none() {
        cx.fail(messages::TARGET_POD_REMOVED);
        return;
    }
    if past_handoff(phase.as_ref()) {
        match i.vmi.and_then(vmi_state) {
            None => {
                cx.fail(messages::STATE_CLEARED);
                return;
            }
            Some(s) if s.migration_uid.as_deref() != Some(cx.uid) => {
                cx.fail(messages::STATE_TAKEN_OVER);
                return;
            }
            Some(_) => {}
        }
    }
    if state.is_some_and(failed) {
        cx.fail(messages::SOURCE_FAILED);
        return;
    }
    if deleting {
        // Handed off: virt-handler on the source cancels; the migration fails once it reports.
        add_abort_condition(&mut cx.status, i.now);
        if let Some(s) = state
            && s.abort_requested != Some(true)
        {
            let mut next = s.clone();
            next.abort_requested = Some(true);
            cx.out.vmi = Some(VmiChange {
                migration_state: next,
                migration_method: None,
                target_label: TargetLabel::Keep,
                on_success: Some(Event::normal(
                    SUCCESSFUL_ABORT_MIGRATION,
                    messages::ABORT_SIGNALLED,
                )),
                failure_reason: FAILED_ABORT_MIGRATION,
            });
        }
    }
    advance(cx, state, target);
}

/// The phase steps, as many as the observed state allows.
fn advance(
    cx: &mut Ctx<'_>,
    state: Option<&VirtualMachineInstanceMigrationState>,
    target: Option<&Pod>,
) {
    let i = cx.i;
    loop {
        let before = cx.status.phase.clone();
        match before {
            None => match eligible(i.vmi.expect("checked"), cx.uid, i.state_owner_live) {
                Ok(()) => set_phase(&mut cx.status, Ph::Pending, i.now),
                Err(message) => {
                    cx.fail(&message);
                    return;
                }
            },
            Some(Ph::Pending) => pending(cx, target),
            Some(Ph::Scheduling) => scheduling(cx, target),
            Some(Ph::Scheduled) => {
                if handed_off(state) {
                    set_phase(&mut cx.status, Ph::PreparingTarget, i.now);
                } else if cx.i.migration.metadata.deletion_timestamp.is_none()
                    && let Some(pod) = target
                {
                    handoff(cx, pod);
                }
            }
            Some(Ph::PreparingTarget) => {
                if state.is_some_and(|s| {
                    s.target_node_address
                        .as_deref()
                        .is_some_and(|a| !a.is_empty())
                        || succeeded(s)
                }) {
                    set_phase(&mut cx.status, Ph::TargetReady, i.now);
                }
            }
            Some(Ph::TargetReady) => {
                if state.is_some_and(|s| s.start_timestamp.is_some() || succeeded(s)) {
                    set_phase(&mut cx.status, Ph::Running, i.now);
                }
            }
            Some(Ph::Running) => {
                if let Some(s) = state.filter(|s| succeeded(s)) {
                    if let (Some(source), Some(target)) = (
                        s.source_persistent_state_pvc_name.clone(),
                        s.target_persistent_state_pvc_name.clone(),
                    ) && source != target
                    {
                        cx.out.claims = ClaimAction::HandOver { source, target };
                    }
                    set_phase(&mut cx.status, Ph::Succeeded, i.now);
                    cx.out
                        .events
                        .push(Event::normal(SUCCESSFUL_MIGRATION, messages::SUCCEEDED));
                }
            }
            // Decentralized migrations are not supported; final phases are not stepped.
            Some(_) => {}
        }
        if cx.status.phase == before || phase_final(cx.status.phase.as_ref()) {
            return;
        }
    }
}

fn pending(cx: &mut Ctx<'_>, target: Option<&Pod>) {
    let i = cx.i;
    let vmi = i.vmi.expect("checked");
    // The source: KubeVirt's `SetSourcePod`.
    let source = current_pod(vmi, i.pods).filter(|p| !is_target_pod_of(p, cx.uid));
    let source_node = vmi.status.as_ref().and_then(|s| s.node_name.clone());
    let ms = cx.status.migration_state.get_or_insert_default();
    if let Some(p) = source {
        ms.source_pod.clone_from(&p.metadata.name);
    }
    if source_node.is_some() {
        ms.source_node = source_node;
    }
    if target.is_some() {
        set_phase(&mut cx.status, Ph::Scheduling, i.now);
        return;
    }
    let cluster_limit = i.config.parallel_migrations_per_cluster.unwrap_or(5) as usize;
    let node_limit = i.config.parallel_outbound_migrations_per_node.unwrap_or(2) as usize;
    let active_pods = vmi.status.as_ref().map_or(0, |s| s.active_pods.len());
    if i.running_in_cluster >= cluster_limit
        || i.outbound_from_node >= node_limit
        || active_pods > 1
    {
        cx.out.requeue_after = Some(LIMIT_RETRY);
        return;
    }
    if api::backendstorage::needed(vmi) {
        let (source, target) = backend_claims(i, cx.status.migration_state.as_ref());
        if source.is_none() {
            cx.out.requeue_after = Some(LIMIT_RETRY);
            return;
        }
        let ms = cx.status.migration_state.get_or_insert_default();
        ms.source_persistent_state_pvc_name = source;
        ms.target_persistent_state_pvc_name = target;
    }
    cx.out.pod = TargetPodAction::Create;
}

/// KubeVirt's `handleBackendStorage`: the source's and the target's backend-storage claims,
/// as the migration's state names them, else the VMI's claim and, for the target, the same
/// claim when it is shared or the one made for this migration (`None`: to be made with the
/// target pod). The state wins, so a claim made but not in the cache yet is not made again.
fn backend_claims(
    i: &Input<'_>,
    own: Option<&VirtualMachineInstanceMigrationState>,
) -> (Option<String>, Option<String>) {
    let Some(vmi) = i.vmi.filter(|v| api::backendstorage::needed(v)) else {
        return (None, None);
    };
    let source = own
        .and_then(|s| s.source_persistent_state_pvc_name.clone())
        .or_else(|| api::backendstorage::current_claim(vmi).map(str::to_owned));
    let target = own
        .and_then(|s| s.target_persistent_state_pvc_name.clone())
        .or_else(|| {
            if api::backendstorage::claim_shared(vmi) == Some(true) {
                source.clone()
            } else {
                i.target_claim.map(str::to_owned)
            }
        });
    (source, target)
}

fn scheduling(cx: &mut Ctx<'_>, target: Option<&Pod>) {
    let i = cx.i;
    let Some(pod) = target else { return };
    if launcher_ready(pod)
        && let Some(_node) = pod_node(pod)
    {
        set_phase(&mut cx.status, Ph::Scheduled, i.now);
        return;
    }
    if pod_phase(pod) != "Pending" {
        return;
    }
    let unschedulable = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| {
            c.type_ == crate::vmi::POD_SCHEDULED
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        });
    let m = i.migration;
    let (limit, since) = match unschedulable {
        Some(c) => (
            seconds_annotation(
                m,
                UNSCHEDULABLE_TIMEOUT_ANNOTATION,
                DEFAULT_UNSCHEDULABLE_TIMEOUT,
            ),
            c.last_transition_time
                .as_ref()
                .or(pod.metadata.creation_timestamp.as_ref()),
        ),
        None => (
            seconds_annotation(m, PENDING_TIMEOUT_ANNOTATION, DEFAULT_PENDING_TIMEOUT),
            pod.metadata.creation_timestamp.as_ref(),
        ),
    };
    let Some(waited) = elapsed(since, i.now) else {
        return;
    };
    if waited >= limit {
        let what = if unschedulable.is_some() {
            "unschedulable"
        } else {
            "pending"
        };
        cx.delete_pod(
            pod,
            format!("{what} pod {} timeout period exceeded", Ctx::ns_name(pod)),
        );
        cx.fail(messages::TARGET_POD_REMOVED);
        return;
    }
    if unschedulable.is_some() {
        let vmi = i.vmi.expect("checked");
        cx.out.events.push(Event::warning(
            TARGET_POD_UNSCHEDULABLE,
            format!(
                "Migration target pod for VMI [{}/{}] is currently unschedulable.",
                vmi.metadata.namespace.as_deref().unwrap_or_default(),
                vmi.metadata.name.as_deref().unwrap_or_default()
            ),
        ));
    }
    cx.out.requeue_after = limit.checked_sub(waited);
}

/// The handoff: the VMI's `migrationState`, `migrationMethod` and target node label.
fn handoff(cx: &mut Ctx<'_>, pod: &Pod) {
    let i = cx.i;
    let vmi = i.vmi.expect("checked");
    let Some(node) = pod_node(pod) else { return };
    cx.out.vmi = Some(VmiChange {
        migration_state: handoff_state(i, cx.uid, pod, node),
        migration_method: Some(api::migration::migration_method(vmi).to_owned()).filter(|m| {
            vmi.status
                .as_ref()
                .and_then(|s| s.migration_method.as_ref())
                != Some(m)
        }),
        target_label: TargetLabel::Set(node.to_owned()),
        on_success: Some(Event::normal(SUCCESSFUL_HAND_OVER, messages::HANDED_OVER)),
        failure_reason: FAILED_HAND_OVER,
    });
}

/// The VMI's fresh `migrationState` at the handoff.
pub fn handoff_state(
    i: &Input<'_>,
    uid: &str,
    target: &Pod,
    target_node: &str,
) -> VirtualMachineInstanceMigrationState {
    let vmi = i.vmi.expect("a VMI to hand off");
    let own = i
        .migration
        .status
        .as_ref()
        .and_then(|s| s.migration_state.as_ref());
    let (source_claim, target_claim) = backend_claims(i, own);
    let source_pod = current_pod(vmi, i.pods)
        .filter(|p| !is_target_pod_of(p, uid))
        .and_then(|p| p.metadata.name.clone())
        .or_else(|| own.and_then(|s| s.source_pod.clone()));
    VirtualMachineInstanceMigrationState {
        migration_uid: Some(uid.to_owned()),
        target_node: Some(target_node.to_owned()),
        target_pod: target.metadata.name.clone(),
        source_node: vmi.status.as_ref().and_then(|s| s.node_name.clone()),
        source_pod,
        migration_configuration: serde_json::to_value(
            i.policy
                .map_or_else(|| i.config.clone(), |p| p.spec.apply(i.config)),
        )
        .ok()
        .map(Preserved),
        migration_policy_name: i.policy.and_then(|p| p.metadata.name.clone()),
        source_persistent_state_pvc_name: source_claim,
        target_persistent_state_pvc_name: target_claim,
        ..VirtualMachineInstanceMigrationState::default()
    }
}

/// A final migration: its VMI's state copied, the target pod of a failed one deleted, the
/// VMI's handoff undone, and then the finalizer released.
fn finished(cx: &mut Ctx<'_>) {
    let i = cx.i;
    let state = state_of(i.vmi, cx.uid);
    if let Some(s) = state {
        cx.status.migration_state = Some(s.clone());
    }
    if cx.status.phase == Some(Ph::Failed) {
        let vmi_node = i
            .vmi
            .and_then(|v| v.status.as_ref())
            .and_then(|s| s.node_name.as_deref());
        let success = state.is_some_and(succeeded);
        if let Some(pod) = target_pod(i.migration, i.pods)
            && !success
            && pod_node(pod).is_none_or(|n| Some(n) != vmi_node)
            && cx.out.pod == TargetPodAction::None
        {
            let message = format!("Deleted migration target pod {}", Ctx::ns_name(pod));
            cx.delete_pod(pod, message);
        }
        if cx.out.vmi.is_none()
            && let (Some(vmi), Some(s)) = (i.vmi, state)
            && !success
        {
            undo_handoff(cx, vmi, s);
        }
        if let Some(target) = i.target_claim
            && !success
        {
            cx.out.claims = ClaimAction::Delete(target.to_owned());
        }
    }
    let has_finalizer = i
        .migration
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == labels::MIGRATION_FINALIZER);
    // A claim to delete goes before the finalizer in the same sync, or the sync is retried.
    cx.out.release_finalizer =
        has_finalizer && cx.out.pod == TargetPodAction::None && cx.out.vmi.is_none();
}

/// The target node label goes; a migration that never started is marked failed on the VMI
/// as KubeVirt's `handleMarkMigrationFailedOnVMI` does, so the VMI is free to migrate again.
fn undo_handoff(
    cx: &mut Ctx<'_>,
    vmi: &VirtualMachineInstance,
    s: &VirtualMachineInstanceMigrationState,
) {
    let now = Time(cx.i.now);
    let has_label = vmi
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(labels::MIGRATION_TARGET_NODE_NAME));
    let mut next = s.clone();
    let mut event = None;
    if !failed(s) && s.start_timestamp.is_none() && handed_off(Some(s)) {
        next.failed = Some(true);
        next.completed = Some(true);
        next.end_timestamp.get_or_insert(now.clone());
        next.start_timestamp.get_or_insert(now);
        next.failure_reason
            .get_or_insert_with(|| messages::TARGET_POD_DOWN.into());
        event = Some(Event {
            on: EventOn::Vmi,
            warning: true,
            reason: FAILED_MIGRATION,
            message: format!(
                "VirtualMachineInstance migration uid {} failed. reason: {}",
                cx.uid,
                messages::TARGET_POD_DOWN
            ),
        });
    }
    if !has_label && next == *s {
        return;
    }
    cx.out.vmi = Some(VmiChange {
        migration_state: next,
        migration_method: None,
        target_label: if has_label {
            TargetLabel::Remove
        } else {
            TargetLabel::Keep
        },
        on_success: event,
        failure_reason: FAILED_MIGRATION,
    });
}

/// The metadata the target pod adds to the rendered launcher pod: the migration's label and
/// annotation, `spec.addedNodeSelector`, and the anti-affinity that keeps it off the nodes
/// where a launcher pod of the VMI runs (`createMigrationPodAntiAffinityRule`).
pub fn make_target_pod(
    mut pod: Pod,
    migration: &VirtualMachineInstanceMigration,
    vmi: &VirtualMachineInstance,
) -> Pod {
    use k8s_openapi::api::core::v1::{Affinity, PodAffinityTerm, PodAntiAffinity};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    pod.metadata.labels.get_or_insert_default().insert(
        labels::MIGRATION_JOB_UID.into(),
        uid_of(migration).to_owned(),
    );
    pod.metadata.annotations.get_or_insert_default().insert(
        labels::MIGRATION_JOB_NAME.into(),
        migration.metadata.name.clone().unwrap_or_default(),
    );
    let spec = pod.spec.get_or_insert_default();
    if !migration.spec.added_node_selector.is_empty() {
        let sel = spec.node_selector.get_or_insert_default();
        for (k, v) in &migration.spec.added_node_selector {
            sel.insert(k.clone(), v.clone());
        }
    }
    let term = PodAffinityTerm {
        label_selector: Some(LabelSelector {
            match_labels: Some(
                [(
                    labels::CREATED_BY.to_owned(),
                    vmi.metadata.uid.clone().unwrap_or_default(),
                )]
                .into(),
            ),
            ..LabelSelector::default()
        }),
        topology_key: "kubernetes.io/hostname".into(),
        ..PodAffinityTerm::default()
    };
    spec.affinity
        .get_or_insert_with(Affinity::default)
        .pod_anti_affinity
        .get_or_insert_with(PodAntiAffinity::default)
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_default()
        .push(term);
    pod
}

/// Which finished migrations of one VMI to delete: all but the [`FINISHED_KEPT_PER_VMI`]
/// newest by creation time (KubeVirt's `garbageCollectFinalizedMigrations`). `migrations`:
/// every migration of the VMI. Returns names.
pub fn garbage(migrations: &[&VirtualMachineInstanceMigration]) -> Vec<String> {
    let mut done: Vec<&VirtualMachineInstanceMigration> = migrations
        .iter()
        .copied()
        .filter(|m| is_final(m) && m.metadata.deletion_timestamp.is_none())
        .collect();
    if done.len() <= FINISHED_KEPT_PER_VMI {
        return Vec::new();
    }
    done.sort_by(|a, b| {
        let t = |m: &VirtualMachineInstanceMigration| {
            m.metadata.creation_timestamp.as_ref().map(|t| t.0)
        };
        t(a).cmp(&t(b))
            .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    let excess = done.len() - FINISHED_KEPT_PER_VMI;
    done.into_iter()
        .take(excess)
        .filter_map(|m| m.metadata.name.clone())
        .collect()
}

/// Migrations per phase for the `kubevirt_vmi_migrations_in_*_phase` gauges, and the final
/// ones for `kubevirt_vmi_migration_succeeded` / `_failed`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PhaseCounts {
    pub unset: usize,
    pub pending: usize,
    pub scheduling: usize,
    /// Scheduled, PreparingTarget, TargetReady, Running (and the decentralized sync phases).
    pub running: usize,
    /// (namespace, vmi, vmim) of each Succeeded migration.
    pub succeeded: Vec<(String, String, String)>,
    /// (namespace, vmi, vmim) of each Failed migration.
    pub failed: Vec<(String, String, String)>,
}

/// Counts `migrations` by phase (`migrationstats_collector.go`).
pub fn phase_counts<'a>(
    migrations: impl IntoIterator<Item = &'a VirtualMachineInstanceMigration>,
) -> PhaseCounts {
    let mut c = PhaseCounts::default();
    for m in migrations {
        let id = || {
            (
                m.metadata.namespace.clone().unwrap_or_default(),
                m.spec.vmi_name.clone().unwrap_or_default(),
                m.metadata.name.clone().unwrap_or_default(),
            )
        };
        match m.status.as_ref().and_then(|s| s.phase.as_ref()) {
            None => c.unset += 1,
            Some(Ph::Pending) => c.pending += 1,
            Some(Ph::Scheduling) => c.scheduling += 1,
            Some(Ph::Succeeded) => c.succeeded.push(id()),
            Some(Ph::Failed) => c.failed.push(id()),
            Some(_) => c.running += 1,
        }
    }
    c.succeeded.sort();
    c.failed.sort();
    c
}

#[cfg(test)]
mod tests;
