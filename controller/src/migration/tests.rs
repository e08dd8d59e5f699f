use super::*;
use api::VirtualMachineInstanceStatus;
use api::migration::VirtualMachineInstanceMigrationSpec;
use api::status::VirtualMachineInstanceCondition;
use k8s_openapi::api::core::v1::{
    Affinity, ContainerState, ContainerStateTerminated, ContainerStatus, NodeAffinity,
    PodCondition, PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use pretty_assertions::assert_eq;

fn now() -> Timestamp {
    "2026-01-01T00:10:00Z".parse().unwrap()
}

fn ago(secs: i64) -> Time {
    Time(now() - k8s_openapi::jiff::SignedDuration::from_secs(secs))
}

fn mig(phase: Option<Ph>) -> VirtualMachineInstanceMigration {
    let mut m = VirtualMachineInstanceMigration::new(
        "mig",
        VirtualMachineInstanceMigrationSpec {
            vmi_name: Some("a".into()),
            ..VirtualMachineInstanceMigrationSpec::default()
        },
    );
    m.metadata.namespace = Some("ns".into());
    m.metadata.uid = Some("mig-uid".into());
    m.metadata.finalizers = Some(vec![labels::MIGRATION_FINALIZER.into()]);
    m.status = phase.map(|p| VirtualMachineInstanceMigrationStatus {
        phase: Some(p),
        ..VirtualMachineInstanceMigrationStatus::default()
    });
    m
}

fn migratable(status: ConditionStatus) -> VirtualMachineInstanceCondition {
    VirtualMachineInstanceCondition {
        type_: VirtualMachineInstanceConditionType::LiveMigratable,
        status,
        last_probe_time: None,
        last_transition_time: None,
        reason: None,
        message: None,
    }
}

fn vmi() -> VirtualMachineInstance {
    let mut v = VirtualMachineInstance::new("a", api::VirtualMachineInstanceSpec::default());
    v.metadata.namespace = Some("ns".into());
    v.metadata.uid = Some("vmi-uid".into());
    v.status = Some(VirtualMachineInstanceStatus {
        phase: Some(VirtualMachineInstancePhase::Running),
        node_name: Some("n1".into()),
        conditions: vec![migratable(ConditionStatus::True)],
        active_pods: [("src-uid".to_owned(), "n1".to_owned())].into(),
        ..VirtualMachineInstanceStatus::default()
    });
    v
}

/// The VMI after the handoff of `mig`, with the target node label.
fn handed_off_vmi(
    f: impl FnOnce(&mut VirtualMachineInstanceMigrationState),
) -> VirtualMachineInstance {
    let mut v = vmi();
    v.metadata.labels = Some(
        [(
            labels::MIGRATION_TARGET_NODE_NAME.to_owned(),
            "n2".to_owned(),
        )]
        .into(),
    );
    let mut st = VirtualMachineInstanceMigrationState {
        migration_uid: Some("mig-uid".into()),
        target_node: Some("n2".into()),
        target_pod: Some("virt-launcher-a-tgt".into()),
        source_node: Some("n1".into()),
        source_pod: Some("virt-launcher-a-src".into()),
        ..VirtualMachineInstanceMigrationState::default()
    };
    f(&mut st);
    v.status.as_mut().unwrap().migration_state = Some(st);
    v
}

fn pod(name: &str, uid: &str, phase: &str, node: Option<&str>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            uid: Some(uid.into()),
            owner_references: Some(vec![OwnerReference {
                uid: "vmi-uid".into(),
                controller: Some(true),
                ..OwnerReference::default()
            }]),
            creation_timestamp: Some(ago(10)),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: node.map(Into::into),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some(phase.into()),
            ..PodStatus::default()
        }),
    }
}

fn source() -> Pod {
    pod("virt-launcher-a-src", "src-uid", "Running", Some("n1"))
}

fn target(phase: &str, node: Option<&str>) -> Pod {
    let mut p = pod("virt-launcher-a-tgt", "tgt-uid", phase, node);
    p.metadata.labels = Some([(labels::MIGRATION_JOB_UID.to_owned(), "mig-uid".to_owned())].into());
    p
}

struct Run<'a> {
    running_in_cluster: usize,
    outbound_from_node: usize,
    state_owner_live: bool,
    policy: Option<&'a MigrationPolicy>,
    target_claim: Option<&'a str>,
}

const IDLE: Run<'static> = Run {
    running_in_cluster: 0,
    outbound_from_node: 0,
    state_owner_live: true,
    policy: None,
    target_claim: None,
};

fn run_with(
    m: &VirtualMachineInstanceMigration,
    v: Option<&VirtualMachineInstance>,
    pods: &[Pod],
    r: &Run<'_>,
) -> MigrationSync {
    let config = MigrationConfiguration::default().effective();
    sync(&Input {
        migration: m,
        vmi: v,
        pods,
        config: &config,
        policy: r.policy,
        running_in_cluster: r.running_in_cluster,
        outbound_from_node: r.outbound_from_node,
        state_owner_live: r.state_owner_live,
        target_claim: r.target_claim,
        now: now(),
    })
}

fn run(
    m: &VirtualMachineInstanceMigration,
    v: &VirtualMachineInstance,
    pods: &[Pod],
) -> MigrationSync {
    run_with(m, Some(v), pods, &IDLE)
}

fn phases(out: &MigrationSync) -> Vec<Ph> {
    out.status
        .phase_transition_timestamps
        .iter()
        .filter_map(|t| t.phase.clone())
        .collect()
}

fn reasons(out: &MigrationSync) -> Vec<(&'static str, String)> {
    out.events
        .iter()
        .map(|e| (e.reason, e.message.clone()))
        .collect()
}

#[test]
fn new_migration_goes_pending_and_creates_the_target_pod() {
    let out = run(&mig(None), &vmi(), &[source()]);
    assert_eq!(out.status.phase, Some(Ph::Pending));
    assert_eq!(phases(&out), [Ph::Pending]);
    assert_eq!(out.pod, TargetPodAction::Create);
    let ms = out.status.migration_state.unwrap();
    assert_eq!(ms.source_pod.as_deref(), Some("virt-launcher-a-src"));
    assert_eq!(ms.source_node.as_deref(), Some("n1"));
    assert!(out.vmi.is_none() && out.events.is_empty() && !out.release_finalizer);
}

#[test]
fn ineligible_vmis_fail_the_migration() {
    let not_running = {
        let mut v = vmi();
        v.status.as_mut().unwrap().phase = Some(VirtualMachineInstancePhase::Scheduled);
        v
    };
    let not_migratable = {
        let mut v = vmi();
        v.status.as_mut().unwrap().conditions = vec![VirtualMachineInstanceCondition {
            reason: Some("DisksNotLiveMigratable".into()),
            message: Some("cannot migrate VMI with non-shared HostDisk".into()),
            ..migratable(ConditionStatus::False)
        }];
        v
    };
    let unknown = {
        let mut v = vmi();
        v.status.as_mut().unwrap().conditions.clear();
        v
    };
    let busy = |finished: bool| {
        let mut v = vmi();
        v.status.as_mut().unwrap().migration_state = Some(VirtualMachineInstanceMigrationState {
            migration_uid: Some("other".into()),
            completed: finished.then_some(true),
            ..VirtualMachineInstanceMigrationState::default()
        });
        v
    };
    let cases: Vec<(&str, VirtualMachineInstance, bool, Option<&str>)> = vec![
        (
            "not running",
            not_running,
            true,
            Some(messages::NOT_RUNNING),
        ),
        (
            "not migratable",
            not_migratable,
            true,
            Some(
                "Cannot migrate VMI, Reason: DisksNotLiveMigratable, Message: cannot migrate VMI with non-shared HostDisk",
            ),
        ),
        (
            "no condition yet",
            unknown,
            true,
            Some(
                "Cannot migrate VMI, Reason: NotMigratable, Message: the VMI has no LiveMigratable condition yet",
            ),
        ),
        (
            "another migration in flight",
            busy(false),
            true,
            Some(messages::IN_PROGRESS),
        ),
        ("another migration finished", busy(true), true, None),
        (
            "its migration object is final or gone",
            busy(false),
            false,
            None,
        ),
    ];
    for (name, v, owner_live, want) in cases {
        let out = run_with(
            &mig(None),
            Some(&v),
            &[source()],
            &Run {
                state_owner_live: owner_live,
                ..IDLE
            },
        );
        match want {
            Some(msg) => {
                assert_eq!(out.status.phase, Some(Ph::Failed), "{name}");
                assert_eq!(
                    reasons(&out),
                    [(FAILED_MIGRATION, msg.to_owned())],
                    "{name}"
                );
                assert_eq!(out.pod, TargetPodAction::None, "{name}");
                assert!(out.release_finalizer, "{name}: nothing to clean up");
            }
            None => assert_eq!(
                (out.status.phase, out.pod),
                (Some(Ph::Pending), TargetPodAction::Create),
                "{name}"
            ),
        }
    }
}

#[test]
fn pending_waits_for_the_parallelism_limits() {
    let two_pods = {
        let mut v = vmi();
        v.status
            .as_mut()
            .unwrap()
            .active_pods
            .insert("old".into(), "n0".into());
        v
    };
    let cases = vec![
        ("room", vmi(), 4, 1, true),
        ("cluster full", vmi(), 5, 0, false),
        ("node full", vmi(), 1, 2, false),
        ("an old pod still active", two_pods, 0, 0, false),
    ];
    for (name, v, cluster, node, creates) in cases {
        let out = run_with(
            &mig(Some(Ph::Pending)),
            Some(&v),
            &[source()],
            &Run {
                running_in_cluster: cluster,
                outbound_from_node: node,
                ..IDLE
            },
        );
        assert_eq!(out.status.phase, Some(Ph::Pending), "{name}");
        if creates {
            assert_eq!(
                (out.pod, out.requeue_after),
                (TargetPodAction::Create, None),
                "{name}"
            );
        } else {
            assert_eq!(
                (out.pod, out.requeue_after),
                (TargetPodAction::None, Some(LIMIT_RETRY)),
                "{name}"
            );
        }
    }
}

#[test]
fn target_pod_moves_pending_to_scheduling_to_scheduled_and_hands_off() {
    let out = run(
        &mig(Some(Ph::Pending)),
        &vmi(),
        &[source(), target("Pending", None)],
    );
    assert_eq!(
        (out.status.phase.clone(), out.pod.clone()),
        (Some(Ph::Scheduling), TargetPodAction::None)
    );

    let waiting = run(
        &mig(Some(Ph::Scheduling)),
        &vmi(),
        &[source(), target("Pending", Some("n2"))],
    );
    assert_eq!(waiting.status.phase, Some(Ph::Scheduling));
    assert!(waiting.vmi.is_none());

    let mut ready = target("Running", Some("n2"));
    ready.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
        name: "compute".into(),
        ready: false,
        ..ContainerStatus::default()
    }]);
    let out = run(&mig(Some(Ph::Scheduling)), &vmi(), &[source(), ready]);
    assert_eq!(out.status.phase, Some(Ph::Scheduled));
    let change = out.vmi.expect("the handoff");
    let config = MigrationConfiguration::default().effective();
    assert_eq!(
        change.migration_state,
        VirtualMachineInstanceMigrationState {
            migration_uid: Some("mig-uid".into()),
            target_node: Some("n2".into()),
            target_pod: Some("virt-launcher-a-tgt".into()),
            source_node: Some("n1".into()),
            source_pod: Some("virt-launcher-a-src".into()),
            migration_configuration: Some(Preserved(serde_json::to_value(&config).unwrap())),
            ..VirtualMachineInstanceMigrationState::default()
        }
    );
    assert_eq!(change.target_label, TargetLabel::Set("n2".into()));
    assert_eq!(change.migration_method.as_deref(), Some("LiveMigration"));
    assert_eq!(
        change.on_success.map(|e| (e.reason, e.message)),
        Some((SUCCESSFUL_HAND_OVER, messages::HANDED_OVER.to_owned()))
    );
    assert_eq!(change.failure_reason, FAILED_HAND_OVER);

    // A matching MigrationPolicy: named in the state, its settings over the cluster's.
    let policy: MigrationPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "migrations.kubevirt.io/v1alpha1", "kind": "MigrationPolicy",
        "metadata": {"name": "fast"},
        "spec": {"selectors": {}, "bandwidthPerMigration": "1Gi", "allowAutoConverge": true},
    }))
    .unwrap();
    let mut ready = target("Running", Some("n2"));
    ready.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
        name: "compute".into(),
        ready: false,
        ..ContainerStatus::default()
    }]);
    let out = run_with(
        &mig(Some(Ph::Scheduling)),
        Some(&vmi()),
        &[source(), ready],
        &Run {
            policy: Some(&policy),
            ..IDLE
        },
    );
    let state = out.vmi.expect("the handoff").migration_state;
    assert_eq!(state.migration_policy_name.as_deref(), Some("fast"));
    let applied: MigrationConfiguration =
        serde_json::from_value(state.migration_configuration.unwrap().0).unwrap();
    assert_eq!(applied.bandwidth_bytes(), Some(1 << 30));
    assert_eq!(applied.allow_auto_converge, Some(true));
    assert_eq!(applied.progress_timeout, Some(150), "the cluster's");
}

#[test]
fn handed_off_migration_follows_the_handlers_to_success() {
    let pods = [source(), target("Running", Some("n2"))];
    let cases: Vec<(&str, Ph, VirtualMachineInstance, Ph)> = vec![
        ("handoff not yet seen", Ph::Scheduled, vmi(), Ph::Scheduled),
        (
            "handoff seen",
            Ph::Scheduled,
            handed_off_vmi(|_| {}),
            Ph::PreparingTarget,
        ),
        (
            "target listening",
            Ph::PreparingTarget,
            handed_off_vmi(|s| s.target_node_address = Some("10.0.0.2".into())),
            Ph::TargetReady,
        ),
        (
            "source started",
            Ph::PreparingTarget,
            handed_off_vmi(|s| {
                s.target_node_address = Some("10.0.0.2".into());
                s.start_timestamp = Some(ago(1));
            }),
            Ph::Running,
        ),
        (
            "started, no completion",
            Ph::Running,
            handed_off_vmi(|s| s.start_timestamp = Some(ago(1))),
            Ph::Running,
        ),
    ];
    for (name, from, v, want) in cases {
        let out = run(&mig(Some(from)), &v, &pods);
        assert_eq!(out.status.phase, Some(want), "{name}");
        assert!(out.events.is_empty(), "{name}");
        assert!(!out.release_finalizer, "{name}");
    }
}

/// A VMI with `efi.persistent` on a backend-storage claim of these access modes.
fn persistent_efi_vmi(access: &str) -> VirtualMachineInstance {
    let mut v = vmi();
    v.spec.domain.firmware =
        serde_json::from_value(serde_json::json!({"bootloader": {"efi": {"persistent": true}}}))
            .unwrap();
    api::backendstorage::set_volume_status(
        v.status.as_mut().unwrap(),
        "state-src",
        &[access.to_owned()],
    );
    v
}

/// KubeVirt's backend-storage hand-off: the source's claim and the target's are named in the
/// migration (the target's made with the target pod unless a claim of the migration exists;
/// a shared claim serves both), then in the VMI's state at the handoff; success hands the
/// target's claim over, failure deletes it.
#[test]
fn backend_storage_claims_are_named_handed_over_or_deleted() {
    let names = |out: &MigrationSync| {
        let ms = out.status.migration_state.clone().unwrap_or_default();
        (
            ms.source_persistent_state_pvc_name,
            ms.target_persistent_state_pvc_name,
        )
    };
    let rwo = persistent_efi_vmi("ReadWriteOnce");
    let out = run(&mig(None), &rwo, &[source()]);
    assert_eq!(out.pod, TargetPodAction::Create);
    assert_eq!(names(&out), (Some("state-src".into()), None), "to be made");
    let made = Run {
        target_claim: Some("state-tgt"),
        ..IDLE
    };
    let out = run_with(&mig(None), Some(&rwo), &[source()], &made);
    assert_eq!(
        names(&out),
        (Some("state-src".into()), Some("state-tgt".into())),
        "made by an earlier try"
    );
    let mut named = mig(Some(Ph::Pending));
    named.status.as_mut().unwrap().migration_state = Some(VirtualMachineInstanceMigrationState {
        target_persistent_state_pvc_name: Some("state-tgt".into()),
        ..VirtualMachineInstanceMigrationState::default()
    });
    let out = run(&named, &rwo, &[source()]);
    assert_eq!(
        names(&out),
        (Some("state-src".into()), Some("state-tgt".into())),
        "made, named in the status, not in the cache yet: not made again"
    );
    let out = run(
        &mig(None),
        &persistent_efi_vmi("ReadWriteMany"),
        &[source()],
    );
    assert_eq!(
        names(&out),
        (Some("state-src".into()), Some("state-src".into())),
        "shared"
    );
    let mut unnamed = rwo.clone();
    unnamed.status.as_mut().unwrap().volume_status.clear();
    let out = run(&mig(Some(Ph::Pending)), &unnamed, &[source()]);
    assert_eq!(
        (out.pod, out.requeue_after),
        (TargetPodAction::None, Some(LIMIT_RETRY)),
        "no claim in the VMI's status yet"
    );

    // The handoff carries the names into the VMI.
    let mut m = mig(Some(Ph::Scheduling));
    m.status.as_mut().unwrap().migration_state = Some(VirtualMachineInstanceMigrationState {
        source_persistent_state_pvc_name: Some("state-src".into()),
        target_persistent_state_pvc_name: Some("state-tgt".into()),
        ..VirtualMachineInstanceMigrationState::default()
    });
    let out = run(&m, &rwo, &[source(), target("Running", Some("n2"))]);
    let state = out.vmi.expect("the handoff").migration_state;
    assert_eq!(
        (
            state.source_persistent_state_pvc_name.as_deref(),
            state.target_persistent_state_pvc_name.as_deref()
        ),
        (Some("state-src"), Some("state-tgt"))
    );

    // Success hands the target's claim over, in the sync that writes Succeeded.
    let done = |source: &str, target: &str| {
        let mut v = handed_off_vmi(|s| {
            s.start_timestamp = Some(ago(5));
            s.end_timestamp = Some(ago(1));
            s.completed = Some(true);
            s.source_persistent_state_pvc_name = Some(source.into());
            s.target_persistent_state_pvc_name = Some(target.into());
        });
        v.spec = rwo.spec.clone();
        v
    };
    let pods = [source(), target("Running", Some("n2"))];
    let out = run(
        &mig(Some(Ph::Running)),
        &done("state-src", "state-tgt"),
        &pods,
    );
    assert_eq!(out.status.phase, Some(Ph::Succeeded));
    assert_eq!(
        out.claims,
        ClaimAction::HandOver {
            source: "state-src".into(),
            target: "state-tgt".into()
        }
    );
    let out = run(
        &mig(Some(Ph::Running)),
        &done("state-src", "state-src"),
        &pods,
    );
    assert_eq!(out.claims, ClaimAction::None, "a shared claim stays");

    // Failure deletes the claim made for the target, before the finalizer goes.
    let failed = run_with(
        &mig(Some(Ph::Failed)),
        Some(&rwo),
        &[source()],
        &Run {
            target_claim: Some("state-tgt"),
            ..IDLE
        },
    );
    assert_eq!(failed.claims, ClaimAction::Delete("state-tgt".into()));
    assert!(failed.release_finalizer);
    let gone = run(&mig(Some(Ph::Failed)), &rwo, &[source()]);
    assert_eq!(gone.claims, ClaimAction::None);
}

#[test]
fn completion_succeeds_copies_the_state_and_releases_the_finalizer() {
    let mut v = handed_off_vmi(|s| {
        s.target_node_address = Some("10.0.0.2".into());
        s.start_timestamp = Some(ago(5));
        s.end_timestamp = Some(ago(1));
        s.completed = Some(true);
    });
    // The target handler switched the VMI to the target node and removed its label.
    v.status.as_mut().unwrap().node_name = Some("n2".into());
    v.metadata.labels = None;
    // In one sync from PreparingTarget: every step, each with its timestamp.
    let out = run(
        &mig(Some(Ph::PreparingTarget)),
        &v,
        &[source(), target("Running", Some("n2"))],
    );
    assert_eq!(out.status.phase, Some(Ph::Succeeded));
    assert_eq!(phases(&out), [Ph::TargetReady, Ph::Running, Ph::Succeeded]);
    assert_eq!(
        reasons(&out),
        [(SUCCESSFUL_MIGRATION, messages::SUCCEEDED.to_owned())]
    );
    assert_eq!(
        out.status.migration_state.as_ref(),
        v.status.as_ref().unwrap().migration_state.as_ref()
    );
    assert_eq!(
        out.pod,
        TargetPodAction::None,
        "the target pod is the VMI's pod now"
    );
    assert!(out.vmi.is_none());
    assert!(out.release_finalizer);

    // Once Succeeded, it stays and has nothing more to do, even with the target pod gone.
    let mut done = mig(Some(Ph::Succeeded));
    done.metadata.finalizers = None;
    done.status = Some(out.status);
    let again = run(&done, &v, &[]);
    assert_eq!(again.status, done.status.clone().unwrap());
    assert!(again.events.is_empty() && again.vmi.is_none() && !again.release_finalizer);
}

#[test]
fn source_failure_fails_and_the_label_goes_before_the_finalizer() {
    let failed = handed_off_vmi(|s| {
        s.start_timestamp = Some(ago(5));
        s.end_timestamp = Some(ago(1));
        s.completed = Some(true);
        s.failed = Some(true);
        s.failure_reason = Some("Live migration failed".into());
    });
    let pods = [source(), target("Running", Some("n2"))];
    let out = run(&mig(Some(Ph::Running)), &failed, &pods);
    assert_eq!(out.status.phase, Some(Ph::Failed));
    assert_eq!(
        reasons(&out),
        [(FAILED_MIGRATION, messages::SOURCE_FAILED.to_owned())]
    );
    assert_eq!(
        out.pod,
        TargetPodAction::Delete {
            name: "virt-launcher-a-tgt".into(),
            message: "Deleted migration target pod ns/virt-launcher-a-tgt".into(),
        }
    );
    let change = out.vmi.clone().expect("the label goes");
    assert_eq!(change.target_label, TargetLabel::Remove);
    assert_eq!(
        Some(&change.migration_state),
        failed.status.as_ref().unwrap().migration_state.as_ref(),
        "the handler's failure is left as it reported it"
    );
    assert!(!out.release_finalizer, "not before the VMI is cleaned up");

    // Next sync: label gone, pod being deleted: the finalizer goes.
    let mut clean = failed.clone();
    clean.metadata.labels = None;
    let mut deleting = target("Running", Some("n2"));
    deleting.metadata.deletion_timestamp = Some(ago(0));
    let mut m = mig(Some(Ph::Failed));
    m.status = Some(out.status);
    let out = run(&m, &clean, &[source(), deleting]);
    assert_eq!(
        (out.pod, out.vmi, out.release_finalizer),
        (TargetPodAction::None, None, true)
    );
}

fn compute_exited(mut p: Pod) -> Pod {
    p.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
        name: "compute".into(),
        state: Some(ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: 1,
                ..ContainerStateTerminated::default()
            }),
            ..ContainerState::default()
        }),
        ..ContainerStatus::default()
    }]);
    p
}

#[test]
fn target_pod_dying_before_the_start_marks_the_vmi_failed() {
    let v = handed_off_vmi(|s| s.target_node_address = Some("10.0.0.2".into()));
    for dead in [
        target("Failed", Some("n2")),
        compute_exited(target("Running", Some("n2"))),
    ] {
        let out = run(&mig(Some(Ph::TargetReady)), &v, &[source(), dead]);
        assert_eq!(out.status.phase, Some(Ph::Failed));
        assert_eq!(
            reasons(&out),
            [(FAILED_MIGRATION, messages::TARGET_POD_SHUTDOWN.to_owned())]
        );
        assert!(matches!(out.pod, TargetPodAction::Delete { .. }));
        let change = out.vmi.expect("KubeVirt's handleMarkMigrationFailedOnVMI");
        let st = &change.migration_state;
        assert_eq!(
            (st.failed, st.completed, st.failure_reason.as_deref()),
            (Some(true), Some(true), Some(messages::TARGET_POD_DOWN))
        );
        assert_eq!(st.start_timestamp, Some(Time(now())));
        assert_eq!(st.end_timestamp, Some(Time(now())));
        assert_eq!(change.target_label, TargetLabel::Remove);
        let ev = change.on_success.expect("an event on the VMI");
        assert_eq!(
            (ev.on, ev.reason, ev.message.as_str()),
            (
                EventOn::Vmi,
                FAILED_MIGRATION,
                "VirtualMachineInstance migration uid mig-uid failed. reason: Target pod is down"
            )
        );
    }
}

#[test]
fn target_pod_dying_after_the_start_is_left_to_the_source() {
    let v = handed_off_vmi(|s| s.start_timestamp = Some(ago(3)));
    let out = run(&mig(Some(Ph::Running)), &v, &[source()]);
    assert_eq!(
        reasons(&out),
        [(FAILED_MIGRATION, messages::TARGET_POD_REMOVED.to_owned())]
    );
    let change = out.vmi.expect("the label goes");
    assert_eq!(change.target_label, TargetLabel::Remove);
    assert_eq!(
        change.migration_state.failed, None,
        "the source handler reports the failure"
    );
}

#[test]
fn guards_in_kubevirts_order() {
    let gone_state = {
        let mut v = vmi();
        v.status.as_mut().unwrap().migration_state = None;
        v
    };
    let taken = handed_off_vmi(|s| s.migration_uid = Some("other".into()));
    let final_vmi = {
        let mut v = vmi();
        v.status.as_mut().unwrap().phase = Some(VirtualMachineInstancePhase::Failed);
        v
    };
    let pods = vec![source(), target("Running", Some("n2"))];
    #[allow(clippy::type_complexity)]
    let cases: Vec<(&str, Ph, Option<VirtualMachineInstance>, Vec<Pod>, &str)> = vec![
        (
            "vmi gone",
            Ph::Running,
            None,
            pods.clone(),
            messages::VMI_MISSING,
        ),
        (
            "vmi final",
            Ph::Scheduling,
            Some(final_vmi),
            pods.clone(),
            messages::VMI_SHUTDOWN,
        ),
        (
            "target pod removed while scheduling",
            Ph::Scheduling,
            Some(vmi()),
            vec![source()],
            messages::TARGET_POD_REMOVED,
        ),
        (
            "state cleared",
            Ph::PreparingTarget,
            Some(gone_state),
            pods.clone(),
            messages::STATE_CLEARED,
        ),
        (
            "state taken over",
            Ph::TargetReady,
            Some(taken),
            pods.clone(),
            messages::STATE_TAKEN_OVER,
        ),
    ];
    for (name, from, v, pods, want) in cases {
        let out = run_with(&mig(Some(from)), v.as_ref(), &pods, &IDLE);
        assert_eq!(out.status.phase, Some(Ph::Failed), "{name}");
        assert_eq!(
            reasons(&out),
            [(FAILED_MIGRATION, want.to_owned())],
            "{name}"
        );
    }
}

#[test]
fn deleted_before_the_handoff_is_canceled() {
    for (from, pods) in [
        (None, vec![source()]),
        (Some(Ph::Pending), vec![source()]),
        (
            Some(Ph::Scheduling),
            vec![source(), target("Pending", None)],
        ),
        (
            Some(Ph::Scheduled),
            vec![source(), target("Running", Some("n2"))],
        ),
    ] {
        let mut m = mig(from.clone());
        m.metadata.deletion_timestamp = Some(ago(0));
        let out = run(&m, &vmi(), &pods);
        assert_eq!(out.status.phase, Some(Ph::Failed), "{from:?}");
        assert_eq!(
            reasons(&out),
            [(FAILED_MIGRATION, messages::CANCELED.to_owned())],
            "{from:?}"
        );
        assert_eq!(
            out.status
                .conditions
                .iter()
                .map(|c| (c.type_.clone(), c.status.clone()))
                .collect::<Vec<_>>(),
            [(
                VirtualMachineInstanceMigrationConditionType::AbortRequested,
                ConditionStatus::True
            )],
            "{from:?}"
        );
        assert!(out.vmi.is_none(), "{from:?}: no handoff after the deletion");
        if pods.len() == 2 {
            assert_eq!(
                out.pod,
                TargetPodAction::Delete {
                    name: "virt-launcher-a-tgt".into(),
                    message: "migration canceled and pod ns/virt-launcher-a-tgt is deleted".into(),
                },
                "{from:?}"
            );
            assert!(!out.release_finalizer, "{from:?}: after the pod delete");
        } else {
            assert_eq!(out.pod, TargetPodAction::None, "{from:?}");
            assert!(out.release_finalizer, "{from:?}");
        }
    }
}

#[test]
fn deleted_after_the_handoff_asks_the_source_to_abort() {
    let pods = [source(), target("Running", Some("n2"))];
    let mut m = mig(Some(Ph::Running));
    m.metadata.deletion_timestamp = Some(ago(0));
    let v = handed_off_vmi(|s| s.start_timestamp = Some(ago(2)));
    let out = run(&m, &v, &pods);
    assert_eq!(out.status.phase, Some(Ph::Running));
    assert_eq!(out.status.conditions.len(), 1);
    assert_eq!(out.pod, TargetPodAction::None);
    let change = out.vmi.expect("abortRequested");
    assert_eq!(change.migration_state.abort_requested, Some(true));
    assert_eq!(change.target_label, TargetLabel::Keep);
    assert_eq!(
        change.on_success.map(|e| e.reason),
        Some(SUCCESSFUL_ABORT_MIGRATION)
    );
    assert_eq!(change.failure_reason, FAILED_ABORT_MIGRATION);
    assert!(!out.release_finalizer);

    // Requested already: nothing more until the source reports.
    m.status = Some(out.status.clone());
    let asked = handed_off_vmi(|s| {
        s.start_timestamp = Some(ago(2));
        s.abort_requested = Some(true);
    });
    let out = run(&m, &asked, &pods);
    assert_eq!(out.status, m.status.clone().unwrap());
    assert!(out.vmi.is_none());

    // The source aborted: Failed, the label goes, then the finalizer.
    let aborted = handed_off_vmi(|s| {
        s.start_timestamp = Some(ago(2));
        s.abort_requested = Some(true);
        s.abort_status = Some("Succeeded".into());
        s.failed = Some(true);
        s.completed = Some(true);
        s.failure_reason = Some("Live migration has been aborted".into());
    });
    let out = run(&m, &aborted, &pods);
    assert_eq!(out.status.phase, Some(Ph::Failed));
    assert_eq!(out.vmi.map(|c| c.target_label), Some(TargetLabel::Remove));
}

fn unschedulable(since: i64) -> Pod {
    let mut p = target("Pending", None);
    p.status.as_mut().unwrap().conditions = Some(vec![PodCondition {
        type_: "PodScheduled".into(),
        status: "False".into(),
        reason: Some("Unschedulable".into()),
        last_transition_time: Some(ago(since)),
        ..PodCondition::default()
    }]);
    p
}

#[test]
fn unschedulable_target_pod_times_out() {
    let out = run(
        &mig(Some(Ph::Scheduling)),
        &vmi(),
        &[source(), unschedulable(100)],
    );
    assert_eq!(out.status.phase, Some(Ph::Scheduling));
    assert_eq!(
        reasons(&out),
        [(
            TARGET_POD_UNSCHEDULABLE,
            "Migration target pod for VMI [ns/a] is currently unschedulable.".to_owned()
        )]
    );
    assert_eq!(out.requeue_after, Some(Duration::from_secs(200)));

    let out = run(
        &mig(Some(Ph::Scheduling)),
        &vmi(),
        &[source(), unschedulable(300)],
    );
    assert_eq!(out.status.phase, Some(Ph::Failed));
    assert_eq!(
        out.pod,
        TargetPodAction::Delete {
            name: "virt-launcher-a-tgt".into(),
            message: "unschedulable pod ns/virt-launcher-a-tgt timeout period exceeded".into(),
        }
    );

    let mut short = mig(Some(Ph::Scheduling));
    short.metadata.annotations =
        Some([(UNSCHEDULABLE_TIMEOUT_ANNOTATION.to_owned(), "60".to_owned())].into());
    let out = run(&short, &vmi(), &[source(), unschedulable(100)]);
    assert_eq!(out.status.phase, Some(Ph::Failed));

    // Pending for another reason: the catch-all 15 minutes, from the pod's creation.
    let mut slow = target("Pending", Some("n2"));
    slow.metadata.creation_timestamp = Some(ago(899));
    let out = run(
        &mig(Some(Ph::Scheduling)),
        &vmi(),
        &[source(), slow.clone()],
    );
    assert_eq!(
        (out.status.phase, out.requeue_after),
        (Some(Ph::Scheduling), Some(Duration::from_secs(1)))
    );
    slow.metadata.creation_timestamp = Some(ago(900));
    let out = run(&mig(Some(Ph::Scheduling)), &vmi(), &[source(), slow]);
    assert_eq!(out.status.phase, Some(Ph::Failed));
}

#[test]
fn target_pod_is_the_launcher_pod_with_the_migration_and_anti_affinity() {
    let mut m = mig(Some(Ph::Pending));
    m.spec.added_node_selector = [("zone".to_owned(), "b".to_owned())].into();
    let mut rendered = pod("", "", "Pending", None);
    rendered.metadata.labels = Some([(labels::APP.to_owned(), "virt-launcher".to_owned())].into());
    let spec = rendered.spec.as_mut().unwrap();
    spec.node_selector = Some([("kubevirt.io/schedulable".to_owned(), "true".to_owned())].into());
    spec.affinity = Some(Affinity {
        node_affinity: Some(NodeAffinity::default()),
        ..Affinity::default()
    });
    let p = make_target_pod(rendered, &m, &vmi());
    let l = p.metadata.labels.unwrap();
    assert_eq!(l[labels::MIGRATION_JOB_UID], "mig-uid");
    assert_eq!(l[labels::APP], "virt-launcher");
    assert_eq!(
        p.metadata.annotations.unwrap()[labels::MIGRATION_JOB_NAME],
        "mig"
    );
    let spec = p.spec.unwrap();
    assert_eq!(
        spec.node_selector.unwrap(),
        [
            ("kubevirt.io/schedulable".to_owned(), "true".to_owned()),
            ("zone".to_owned(), "b".to_owned())
        ]
        .into()
    );
    let affinity = spec.affinity.unwrap();
    assert!(affinity.node_affinity.is_some(), "kept");
    let terms = affinity
        .pod_anti_affinity
        .unwrap()
        .required_during_scheduling_ignored_during_execution
        .unwrap();
    assert_eq!(
        serde_json::to_value(&terms).unwrap(),
        serde_json::json!([{
            "labelSelector": {"matchLabels": {"kubevirt.io/created-by": "vmi-uid"}},
            "topologyKey": "kubernetes.io/hostname",
        }])
    );
}

#[test]
fn the_five_newest_finished_migrations_are_kept() {
    let at = |i: i64, phase: Option<Ph>| {
        let mut m = mig(phase);
        m.metadata.name = Some(format!("m{i}"));
        m.metadata.creation_timestamp = Some(ago(100 - i));
        m
    };
    let mut all: Vec<VirtualMachineInstanceMigration> = (0..7)
        .map(|i| {
            at(
                i,
                Some(if i % 2 == 0 {
                    Ph::Succeeded
                } else {
                    Ph::Failed
                }),
            )
        })
        .collect();
    all.push(at(7, Some(Ph::Running)));
    all.reverse();
    let refs: Vec<&VirtualMachineInstanceMigration> = all.iter().collect();
    assert_eq!(garbage(&refs), ["m0", "m1"]);
    assert!(garbage(&refs[..6]).is_empty());
}

#[test]
fn running_migrations_for_the_limits() {
    let cases = [
        (None, false, false),
        (None, true, true),
        (Some(Ph::Pending), false, false),
        (Some(Ph::Pending), true, true),
        (Some(Ph::Scheduling), false, true),
        (Some(Ph::Running), false, true),
        (Some(Ph::Succeeded), true, false),
        (Some(Ph::Failed), false, false),
    ];
    for (phase, has_pod, want) in cases {
        assert_eq!(
            counts_as_running(&mig(phase.clone()), has_pod),
            want,
            "{phase:?} {has_pod}"
        );
    }
}

#[test]
fn phase_counts_for_the_metrics() {
    let ms = [
        mig(None),
        mig(Some(Ph::Pending)),
        mig(Some(Ph::Scheduling)),
        mig(Some(Ph::Scheduled)),
        mig(Some(Ph::TargetReady)),
        mig(Some(Ph::Running)),
        mig(Some(Ph::Succeeded)),
        mig(Some(Ph::Failed)),
    ];
    let c = phase_counts(&ms);
    let id = ("ns".to_owned(), "a".to_owned(), "mig".to_owned());
    assert_eq!(
        c,
        PhaseCounts {
            unset: 1,
            pending: 1,
            scheduling: 1,
            running: 3,
            succeeded: vec![id.clone()],
            failed: vec![id],
        }
    );
}
