//! `/healthz`, `/leader` and `/metrics` on `--port`, as KubeVirt's virt-controller serves them
//! (its liveness probe reads `/healthz`, its readiness probe `/leader`, so only the leader is
//! Ready). Plain HTTP: KubeVirt serves them over TLS with the operator's certificate, which
//! kubevirt-rs has no operator to issue yet.
//!
//! The Prometheus text is written with `api::metrics`, as virt-handler's is.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use api::metrics::{self, Exposition, Kind};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

/// One work queue's figures (KubeVirt exports client-go's `kubevirt_workqueue_*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueStat {
    /// KubeVirt's queue name, e.g. `virt-controller-vmi`.
    pub name: &'static str,
    /// Keys waiting.
    pub depth: usize,
    /// Keys added since start.
    pub adds: u64,
}

/// What the controllers report while they run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// VMIs per (phase, node); the node is empty before scheduling.
    pub vmi_phases: BTreeMap<(String, String), usize>,
    /// Migrations by phase.
    pub migrations: crate::migration::PhaseCounts,
    /// The work queues.
    pub queues: Vec<QueueStat>,
}

type SnapshotFn = Box<dyn Fn() -> Option<Snapshot> + Send + Sync>;

/// Shared between the HTTP server and the controllers: whether this replica leads, and how to
/// read the running controllers' state (`None` while they do not run).
#[derive(Default)]
pub struct Health {
    leading: AtomicBool,
    source: RwLock<Option<SnapshotFn>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("leading", &self.leading.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Health {
    /// Leader election tells whether this replica holds the Lease.
    pub fn set_leading(&self, leading: bool) {
        self.leading.store(leading, Ordering::Relaxed);
    }

    /// Whether this replica holds the Lease.
    pub fn leading(&self) -> bool {
        self.leading.load(Ordering::Relaxed)
    }

    /// The controllers, once their caches synced, register how to read them; the function
    /// returns `None` once they stopped.
    pub fn set_source(&self, f: impl Fn() -> Option<Snapshot> + Send + Sync + 'static) {
        *self
            .source
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Box::new(f));
    }

    /// The running controllers' state, `None` when none run.
    pub fn snapshot(&self) -> Option<Snapshot> {
        self.source
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .and_then(|f| f())
    }
}

/// The exposition text. `snapshot`: the running controllers' state, `None` when they do not
/// run (a follower, or caches not synced yet).
pub fn render(leading: bool, snapshot: Option<&Snapshot>) -> String {
    let mut text = Exposition::new();
    text.family(
        "kubevirt_virt_controller_leading_status",
        Kind::Gauge,
        "Indication for an operating virt-controller (1 when it holds the leader Lease).",
    )
    .sample(&[], u8::from(leading));
    text.family(
        "kubevirt_virt_controller_ready_status",
        Kind::Gauge,
        "Indication for a virt-controller that is ready to take the lead (controllers running on synced caches).",
    )
    .sample(&[], u8::from(snapshot.is_some()));
    let Some(s) = snapshot else {
        return text.finish();
    };
    metrics::vmi_phase_count(
        &mut text,
        s.vmi_phases
            .iter()
            .map(|((phase, node), n)| (node.as_str(), phase.as_str(), *n)),
    );
    migration_metrics(&mut text, &s.migrations);
    let queues = [
        (
            "kubevirt_workqueue_depth",
            Kind::Gauge,
            "Current depth of workqueue.",
            (|q| q.depth.to_string()) as fn(&QueueStat) -> String,
        ),
        (
            "kubevirt_workqueue_adds_total",
            Kind::Counter,
            "Total number of adds handled by workqueue.",
            |q| q.adds.to_string(),
        ),
    ];
    for (name, kind, help, value) in queues {
        let mut family = text.family(name, kind, help);
        for q in &s.queues {
            family.sample(&[("name", q.name)], value(q));
        }
    }
    text.finish()
}

/// KubeVirt's `migrationstats_collector.go`: migrations per phase, and 1 per finished one.
fn migration_metrics(text: &mut Exposition, m: &crate::migration::PhaseCounts) {
    for (name, help, n) in [
        (
            "kubevirt_vmi_migrations_in_pending_phase",
            "Number of current pending migrations.",
            m.pending,
        ),
        (
            "kubevirt_vmi_migrations_in_scheduling_phase",
            "Number of current scheduling migrations.",
            m.scheduling,
        ),
        (
            "kubevirt_vmi_migrations_in_unset_phase",
            "Number of current unset migrations. These are pending items the virt-controller hasn’t processed yet from the queue.",
            m.unset,
        ),
        (
            "kubevirt_vmi_migrations_in_running_phase",
            "Number of current running migrations.",
            m.running,
        ),
    ] {
        text.family(name, Kind::Gauge, help).sample(&[], n);
    }
    for (name, help, list) in [
        (
            "kubevirt_vmi_migration_succeeded",
            "Indicates if the VMI migration succeeded.",
            &m.succeeded,
        ),
        (
            "kubevirt_vmi_migration_failed",
            "Indicates if the VMI migration failed.",
            &m.failed,
        ),
    ] {
        let mut family = text.family(name, Kind::Gauge, help);
        for (namespace, vmi, vmim) in list {
            family.sample(
                &[
                    ("vmi", vmi.as_str()),
                    ("vmim", vmim.as_str()),
                    ("namespace", namespace.as_str()),
                ],
                1,
            );
        }
    }
}

/// `/healthz` (the process serves), `/leader` (200 only on the leader with running
/// controllers, else 503) and `/metrics`.
pub fn router(health: Arc<Health>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/leader",
            get(|State(h): State<Arc<Health>>| async move {
                if h.leading() && h.snapshot().is_some() {
                    (StatusCode::OK, "leader")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not the leader")
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(h): State<Arc<Health>>| async move {
                (
                    [("content-type", metrics::CONTENT_TYPE)],
                    render(h.leading(), h.snapshot().as_ref()),
                )
            }),
        )
        .with_state(health)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follower_reports_only_its_status() {
        let text = render(false, None);
        assert!(text.contains("\nkubevirt_virt_controller_leading_status 0\n"));
        assert!(text.contains("\nkubevirt_virt_controller_ready_status 0\n"));
        assert!(!text.contains("kubevirt_vmi_phase_count"));
    }

    #[test]
    fn leader_reports_phases_and_queues() {
        let s = Snapshot {
            vmi_phases: BTreeMap::from([
                (("Running".into(), "node-0".into()), 2),
                (("Pending".into(), String::new()), 1),
            ]),
            migrations: crate::migration::PhaseCounts::default(),
            queues: vec![QueueStat {
                name: "virt-controller-vmi",
                depth: 3,
                adds: 40,
            }],
        };
        let text = render(true, Some(&s));
        for line in [
            "kubevirt_virt_controller_leading_status 1",
            "kubevirt_virt_controller_ready_status 1",
            "kubevirt_vmi_phase_count{node=\"\",phase=\"pending\"} 1",
            "kubevirt_vmi_phase_count{node=\"node-0\",phase=\"running\"} 2",
            "kubevirt_workqueue_depth{name=\"virt-controller-vmi\"} 3",
            "kubevirt_workqueue_adds_total{name=\"virt-controller-vmi\"} 40",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let s = Snapshot {
            vmi_phases: BTreeMap::from([(("Running".into(), "a\"b\\c".into()), 1)]),
            migrations: crate::migration::PhaseCounts::default(),
            queues: Vec::new(),
        };
        assert!(render(true, Some(&s)).contains("node=\"a\\\"b\\\\c\""));
    }

    #[test]
    fn migration_metrics_as_kubevirt_names_them() {
        let s = Snapshot {
            migrations: crate::migration::PhaseCounts {
                unset: 1,
                pending: 2,
                scheduling: 0,
                running: 3,
                succeeded: vec![("ns".into(), "vm-a".into(), "mig-1".into())],
                failed: vec![("ns".into(), "vm-b".into(), "mig-2".into())],
            },
            ..Snapshot::default()
        };
        let text = render(true, Some(&s));
        for line in [
            "kubevirt_vmi_migrations_in_unset_phase 1",
            "kubevirt_vmi_migrations_in_pending_phase 2",
            "kubevirt_vmi_migrations_in_scheduling_phase 0",
            "kubevirt_vmi_migrations_in_running_phase 3",
            "kubevirt_vmi_migration_succeeded{vmi=\"vm-a\",vmim=\"mig-1\",namespace=\"ns\"} 1",
            "kubevirt_vmi_migration_failed{vmi=\"vm-b\",vmim=\"mig-2\",namespace=\"ns\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
    }
}
