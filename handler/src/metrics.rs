//! `/metrics` (Prometheus text format) and `/healthz` on `--port`, with KubeVirt's metric names
//! for what we can measure: VMI phase counts from the informer cache, and per VMI the QEMU
//! process's resident memory, each vCPU thread's CPU time, and each interface's counters from
//! `/proc`, and each disk's counters from the launcher's `GET /v1/domain/blockstats` (QMP
//! `query-blockstats`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use api::metrics::{self, Exposition, Kind};
use axum::Router;
use axum::extract::State;
use axum::routing::get;
use http::StatusCode;
use launcher_api::client::LauncherClient;
use launcher_api::domain::DiskStats;

use crate::node::Node;

/// `/proc/<pid>/stat` counts CPU time in USER_HZ ticks, which Linux fixes at 100 for the ABI.
const USER_HZ: f64 = 100.0;

/// One vCPU thread's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct Vcpu {
    pub id: usize,
    pub seconds: f64,
    /// `running` or `blocked`, from the thread's scheduler state.
    pub state: &'static str,
}

/// One VMI interface's counters, from the guest's side (what libvirt reports for a tap, and
/// therefore KubeVirt): what the guest receives is what its tap transmits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NetCounters {
    pub rx_bytes: u64,
    pub rx_packets: u64,
    pub rx_errors: u64,
    pub rx_dropped: u64,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub tx_errors: u64,
    pub tx_dropped: u64,
}

/// What `/proc` says about one VMI's QEMU.
#[derive(Debug, Clone, PartialEq)]
pub struct VmiSample {
    pub namespace: String,
    pub name: String,
    pub resident_bytes: Option<u64>,
    pub vcpus: Vec<Vcpu>,
    /// The VMI's interface name and its counters.
    pub interfaces: Vec<(String, NetCounters)>,
    /// Each disk's counters; empty when the launcher did not answer.
    pub disks: Vec<DiskStats>,
    /// The outgoing migration's figures while one runs here.
    pub migration: Option<MigrationSample>,
}

/// An outgoing migration's figures, from the launcher's domain (QMP `query-migrate` and the
/// disks' mirror jobs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationSample {
    /// Guest memory plus the copied disks.
    pub total_bytes: u64,
    pub processed_bytes: u64,
    pub remaining_bytes: u64,
}

/// A metric's name, kind, help text and value.
type Metric<T> = (&'static str, Kind, &'static str, fn(&T) -> u64);

/// A counter's name, help text and value.
type Counter<T, V> = (&'static str, &'static str, fn(&T) -> V);

/// The labelled items of one VMI a counter table is reported for (its interfaces, its drives).
type Items<T> = for<'v> fn(&'v VmiSample) -> Vec<(&'v str, &'v T)>;

/// The network metrics, KubeVirt's names and help texts (`domainstats/network_metrics.go`).
const NET_METRICS: [Counter<NetCounters, u64>; 8] = [
    (
        "kubevirt_vmi_network_receive_bytes_total",
        "Total network traffic received in bytes.",
        |c| c.rx_bytes,
    ),
    (
        "kubevirt_vmi_network_transmit_bytes_total",
        "Total network traffic transmitted in bytes.",
        |c| c.tx_bytes,
    ),
    (
        "kubevirt_vmi_network_receive_packets_total",
        "Total network traffic received packets.",
        |c| c.rx_packets,
    ),
    (
        "kubevirt_vmi_network_transmit_packets_total",
        "Total network traffic transmitted packets.",
        |c| c.tx_packets,
    ),
    (
        "kubevirt_vmi_network_receive_errors_total",
        "Total network received error packets.",
        |c| c.rx_errors,
    ),
    (
        "kubevirt_vmi_network_transmit_errors_total",
        "Total network transmitted error packets.",
        |c| c.tx_errors,
    ),
    (
        "kubevirt_vmi_network_receive_packets_dropped_total",
        "The total number of rx packets dropped on vNIC interfaces.",
        |c| c.rx_dropped,
    ),
    (
        "kubevirt_vmi_network_transmit_packets_dropped_total",
        "The total number of tx packets dropped on vNIC interfaces.",
        |c| c.tx_dropped,
    ),
];

/// Counters as Prometheus floats; they lose precision only beyond 2^53 (bytes: 8 PiB).
#[allow(clippy::cast_precision_loss)]
fn count(n: u64) -> f64 {
    n as f64
}

fn seconds(ns: u64) -> f64 {
    count(ns) / 1e9
}

/// The storage metrics, KubeVirt's names and help texts (`domainstats/block_metrics.go`); times
/// in seconds, as KubeVirt converts them.
const DISK_METRICS: [Counter<DiskStats, f64>; 8] = [
    (
        "kubevirt_vmi_storage_iops_read_total",
        "Total number of I/O read operations.",
        |d| count(d.read_ops),
    ),
    (
        "kubevirt_vmi_storage_iops_write_total",
        "Total number of I/O write operations.",
        |d| count(d.write_ops),
    ),
    (
        "kubevirt_vmi_storage_read_traffic_bytes_total",
        "Total number of bytes read from storage.",
        |d| count(d.read_bytes),
    ),
    (
        "kubevirt_vmi_storage_write_traffic_bytes_total",
        "Total number of written bytes.",
        |d| count(d.write_bytes),
    ),
    (
        "kubevirt_vmi_storage_read_times_seconds_total",
        "Total time spent on read operations.",
        |d| seconds(d.read_time_ns),
    ),
    (
        "kubevirt_vmi_storage_write_times_seconds_total",
        "Total time spent on write operations.",
        |d| seconds(d.write_time_ns),
    ),
    (
        "kubevirt_vmi_storage_flush_requests_total",
        "Total storage flush requests.",
        |d| count(d.flush_ops),
    ),
    (
        "kubevirt_vmi_storage_flush_times_seconds_total",
        "Total time spent on cache flushing.",
        |d| seconds(d.flush_time_ns),
    ),
];

/// One counter family per table entry, with a line per VMI and per item of it (an interface,
/// a drive) labelled `key`.
fn counters<T, V: std::fmt::Display>(
    text: &mut Exposition,
    node: &str,
    vmis: &[VmiSample],
    table: &[Counter<T, V>],
    key: &str,
    items: Items<T>,
) {
    for (metric, help, value) in table {
        let mut family = text.family(metric, Kind::Counter, help);
        for v in vmis {
            for (item, c) in items(v) {
                family.sample(
                    &[
                        ("namespace", &v.namespace),
                        ("name", &v.name),
                        ("node", node),
                        (key, item),
                    ],
                    value(c),
                );
            }
        }
    }
}

/// The exposition text. `phases`: VMI count per phase (KubeVirt lower-cases the phase).
pub fn render(node: &str, phases: &BTreeMap<String, usize>, vmis: &[VmiSample]) -> String {
    let mut text = Exposition::new();
    metrics::vmi_phase_count(
        &mut text,
        phases.iter().map(|(phase, n)| (node, phase.as_str(), *n)),
    );
    let mut family = text.family(
        "kubevirt_vmi_memory_resident_bytes",
        Kind::Gauge,
        "Resident set size of the process running the domain.",
    );
    for v in vmis {
        if let Some(rss) = v.resident_bytes {
            family.sample(
                &[
                    ("namespace", &v.namespace),
                    ("name", &v.name),
                    ("node", node),
                ],
                rss,
            );
        }
    }
    let mut family = text.family(
        "kubevirt_vmi_vcpu_seconds_total",
        Kind::Counter,
        "Total amount of time spent in each state by each vcpu (cpu_time excluding hypervisor time).",
    );
    for v in vmis {
        for c in &v.vcpus {
            family.sample(
                &[
                    ("namespace", &v.namespace),
                    ("name", &v.name),
                    ("node", node),
                    ("id", &c.id.to_string()),
                    ("state", c.state),
                ],
                c.seconds,
            );
        }
    }
    counters(&mut text, node, vmis, &NET_METRICS, "interface", |v| {
        v.interfaces.iter().map(|(i, c)| (i.as_str(), c)).collect()
    });
    counters(&mut text, node, vmis, &DISK_METRICS, "drive", |v| {
        v.disks.iter().map(|d| (d.name.as_str(), d)).collect()
    });
    let migration_metrics: [Metric<MigrationSample>; 3] = [
        (
            "kubevirt_vmi_migration_data_bytes_total",
            Kind::Counter,
            "The total Guest OS data to be migrated to the new VM.",
            |m| m.total_bytes,
        ),
        (
            "kubevirt_vmi_migration_data_processed_bytes",
            Kind::Gauge,
            "The total Guest OS data processed and migrated to the new VM.",
            |m| m.processed_bytes,
        ),
        (
            "kubevirt_vmi_migration_data_remaining_bytes",
            Kind::Gauge,
            "The remaining guest OS data to be migrated to the new VM.",
            |m| m.remaining_bytes,
        ),
    ];
    for (metric, kind, help, value) in migration_metrics {
        let mut family = text.family(metric, kind, help);
        for v in vmis {
            if let Some(m) = &v.migration {
                family.sample(
                    &[
                        ("namespace", &v.namespace),
                        ("name", &v.name),
                        ("node", node),
                    ],
                    value(m),
                );
            }
        }
    }
    text.finish()
}

/// The counters of each device in a `/proc/<pid>/net/dev` table (the network namespace of
/// `<pid>`), swapped to the guest's side: a tap's transmit is its guest's receive.
pub fn parse_net_dev(table: &str) -> BTreeMap<String, NetCounters> {
    table
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.split_once(':')?;
            let n: Vec<u64> = rest
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            // Receive: bytes packets errs drop fifo frame compressed multicast; then
            // transmit: bytes packets errs drop ...
            (n.len() >= 12).then(|| {
                (
                    name.trim().to_owned(),
                    NetCounters {
                        rx_bytes: n[8],
                        rx_packets: n[9],
                        rx_errors: n[10],
                        rx_dropped: n[11],
                        tx_bytes: n[0],
                        tx_packets: n[1],
                        tx_errors: n[2],
                        tx_dropped: n[3],
                    },
                )
            })
        })
        .collect()
}

/// State and CPU seconds from a `/proc/.../stat` line: fields after the `)` that ends the
/// command name (which may itself contain spaces and parentheses).
pub fn parse_stat(stat: &str) -> Option<(char, f64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); utime and stime are fields 14 and 15.
    let state = f.first()?.chars().next()?;
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((state, (utime + stime) / USER_HZ))
}

/// `VmRSS` in bytes from `/proc/<pid>/status`.
pub fn parse_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The innermost pid of `NSpid:` in `/proc/<pid>/status`: the id the process has in its own
/// pid namespace, which is what the launcher reports for QEMU and its vCPU threads.
pub fn parse_nspid(status: &str) -> Option<i64> {
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// QEMU of the launcher `launcher_pid` (our pid namespace): the launcher's child whose
/// innermost pid is `qemu_pid`.
fn find_qemu(proc: &Path, launcher_pid: i32, qemu_pid: u32) -> Option<u32> {
    let tasks = std::fs::read_dir(proc.join(format!("{launcher_pid}/task"))).ok()?;
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .find(|child| {
            std::fs::read_to_string(proc.join(format!("{child}/status")))
                .ok()
                .and_then(|s| parse_nspid(&s))
                == Some(i64::from(qemu_pid))
        })
}

/// Reads one VMI's figures from `/proc`; missing files (QEMU just ended) leave gaps.
fn sample(proc: &Path, l: &crate::node::LauncherInfo) -> Option<VmiSample> {
    let d = l.domain.as_ref().filter(|d| !d.state.is_final())?;
    let qemu = find_qemu(proc, l.pid?, d.qemu_pid?)?;
    let resident_bytes = std::fs::read_to_string(proc.join(format!("{qemu}/status")))
        .ok()
        .and_then(|s| parse_rss(&s));
    let mut by_inner = BTreeMap::new();
    if let Ok(tasks) = std::fs::read_dir(proc.join(format!("{qemu}/task"))) {
        for t in tasks.flatten() {
            let inner = std::fs::read_to_string(t.path().join("status"))
                .ok()
                .and_then(|s| parse_nspid(&s));
            let stat = std::fs::read_to_string(t.path().join("stat"))
                .ok()
                .and_then(|s| parse_stat(&s));
            if let (Some(i), Some(st)) = (inner, stat) {
                by_inner.insert(i, st);
            }
        }
    }
    let vcpus = d
        .vcpu_threads
        .iter()
        .enumerate()
        .filter_map(|(id, tid)| {
            let (state, seconds) = by_inner.get(tid)?;
            Some(Vcpu {
                id,
                seconds: *seconds,
                state: if *state == 'R' { "running" } else { "blocked" },
            })
        })
        .collect();
    // The taps live in the launcher's network namespace, which its /proc entry shows.
    let taps = std::fs::read_to_string(proc.join(format!("{}/net/dev", l.pid?)))
        .map(|t| parse_net_dev(&t))
        .unwrap_or_default();
    let interfaces = d
        .interfaces
        .iter()
        .filter_map(|i| Some((i.name.clone(), *taps.get(&i.tap)?)))
        .collect();
    Some(VmiSample {
        namespace: l.namespace.clone(),
        name: l.name.clone(),
        resident_bytes,
        vcpus,
        interfaces,
        disks: Vec::new(),
        migration: d
            .migration
            .as_ref()
            .filter(|m| m.role == launcher_api::migration::Role::Source && !m.phase.is_final())
            .map(|m| MigrationSample {
                total_bytes: m.memory_total + m.disks_total,
                processed_bytes: m.memory_transferred,
                remaining_bytes: m.memory_remaining,
            }),
    })
}

/// The node loop, once its caches have filled.
pub type NodeSlot = Arc<OnceLock<Arc<Node>>>;

/// KubeVirt's `--max-metric-requests` default.
pub const DEFAULT_MAX_REQUESTS: usize = 3;

#[derive(Clone)]
struct Shared {
    slot: NodeSlot,
    /// Scrapes in flight; one more is refused, as Prometheus' Go handler does with
    /// `MaxRequestsInFlight`, so a scrape storm cannot pile up `/proc` walks.
    scrapes: Arc<tokio::sync::Semaphore>,
    max: usize,
}

async fn metrics(State(s): State<Shared>) -> (StatusCode, String) {
    let Ok(_permit) = s.scrapes.try_acquire() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "Limit of concurrent requests reached ({}), try again later.\n",
                s.max
            ),
        );
    };
    let Some(node) = s.slot.get() else {
        return (StatusCode::OK, render("", &BTreeMap::new(), &[]));
    };
    let mut phases = BTreeMap::new();
    for v in node.vmis() {
        if let Some(p) = v.status.as_ref().and_then(|s| s.phase.as_ref()) {
            *phases.entry(p.as_str().to_owned()).or_insert(0) += 1;
        }
    }
    let launchers = node.launchers();
    let sampled = tokio::task::spawn_blocking(move || {
        launchers
            .into_iter()
            .filter_map(|l| Some((sample(Path::new("/proc"), &l)?, l.socket)))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    // Disk counters need QMP, so each running VMI's launcher is asked, all at once; one that
    // does not answer leaves its VMI without disk metrics rather than failing the scrape.
    let timeout = node.config().call_timeout;
    let samples =
        futures::future::join_all(sampled.into_iter().map(|(mut v, socket)| async move {
            match LauncherClient::new(socket, timeout).blockstats().await {
                Ok(disks) => v.disks = disks,
                Err(e) => tracing::debug!(error = %e, vmi = %v.name, "no disk counters"),
            }
            v
        }))
        .await;
    (
        StatusCode::OK,
        render(&node.config().node, &phases, &samples),
    )
}

/// 200 once the node loop runs (its caches filled), 503 before.
async fn healthz(State(s): State<Shared>) -> (StatusCode, &'static str) {
    if s.slot.get().is_some() {
        (StatusCode::OK, "ok")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the node loop has not started",
        )
    }
}

/// `/metrics` and `/healthz`; at most `max_requests` scrapes at once (`--max-metric-requests`).
pub fn router(slot: NodeSlot, max_requests: usize) -> Router {
    let max = max_requests.max(1);
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(Shared {
            slot,
            scrapes: Arc::new(tokio::sync::Semaphore::new(max)),
            max,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    #[test]
    fn proc_files_parse() {
        let stat = "1234 (qemu-system-x86 (x)) R 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0";
        assert_eq!(parse_stat(stat), Some(('R', 3.0)));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(
            parse_rss("Name:\tqemu\nVmRSS:\t  2048 kB\n"),
            Some(2 * 1024 * 1024)
        );
        assert_eq!(parse_nspid("NSpid:\t4242\t17\n"), Some(17));
        assert_eq!(parse_nspid("Name:\tx\n"), None);
    }

    #[test]
    fn exposition_text() {
        let phases = BTreeMap::from([("Running".to_owned(), 2), ("Scheduled".to_owned(), 1)]);
        let vmis = [VmiSample {
            namespace: "default".into(),
            name: "a\"b".into(),
            resident_bytes: Some(1024),
            vcpus: vec![Vcpu {
                id: 0,
                seconds: 1.5,
                state: "running",
            }],
            interfaces: vec![(
                "default".into(),
                NetCounters {
                    rx_bytes: 7,
                    tx_dropped: 3,
                    ..NetCounters::default()
                },
            )],
            disks: vec![DiskStats {
                name: "root".into(),
                read_bytes: 4096,
                write_bytes: 512,
                read_ops: 8,
                write_ops: 1,
                flush_ops: 2,
                read_time_ns: 1_500_000_000,
                write_time_ns: 0,
                flush_time_ns: 250_000_000,
            }],
            migration: Some(MigrationSample {
                total_bytes: 300,
                processed_bytes: 200,
                remaining_bytes: 100,
            }),
        }];
        let text = render("node-a", &phases, &vmis);
        let vmi = "{namespace=\"default\",name=\"a\\\"b\",node=\"node-a\"}";
        for line in [
            format!("kubevirt_vmi_migration_data_bytes_total{vmi} 300\n"),
            format!("kubevirt_vmi_migration_data_processed_bytes{vmi} 200\n"),
            format!("kubevirt_vmi_migration_data_remaining_bytes{vmi} 100\n"),
            "# TYPE kubevirt_vmi_migration_data_remaining_bytes gauge\n".to_owned(),
        ] {
            assert!(text.contains(&line), "{line} not in {text}");
        }
        assert!(
            text.contains("kubevirt_vmi_phase_count{node=\"node-a\",phase=\"running\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("kubevirt_vmi_phase_count{node=\"node-a\",phase=\"scheduled\"} 1\n"));
        assert!(text.contains(
            "kubevirt_vmi_memory_resident_bytes{namespace=\"default\",name=\"a\\\"b\",node=\"node-a\"} 1024\n"
        ));
        assert!(text.contains(
            "kubevirt_vmi_vcpu_seconds_total{namespace=\"default\",name=\"a\\\"b\",node=\"node-a\",id=\"0\",state=\"running\"} 1.5\n"
        ));
        assert!(text.contains("# TYPE kubevirt_vmi_vcpu_seconds_total counter\n"));
        assert!(text.contains(
            "kubevirt_vmi_network_receive_bytes_total{namespace=\"default\",name=\"a\\\"b\",node=\"node-a\",interface=\"default\"} 7\n"
        ), "{text}");
        assert!(text.contains(
            "kubevirt_vmi_network_transmit_packets_dropped_total{namespace=\"default\",name=\"a\\\"b\",node=\"node-a\",interface=\"default\"} 3\n"
        ));
        assert!(text.contains("# TYPE kubevirt_vmi_network_transmit_bytes_total counter\n"));
        let disk = "{namespace=\"default\",name=\"a\\\"b\",node=\"node-a\",drive=\"root\"}";
        for line in [
            format!("kubevirt_vmi_storage_read_traffic_bytes_total{disk} 4096\n"),
            format!("kubevirt_vmi_storage_write_traffic_bytes_total{disk} 512\n"),
            format!("kubevirt_vmi_storage_iops_read_total{disk} 8\n"),
            format!("kubevirt_vmi_storage_iops_write_total{disk} 1\n"),
            format!("kubevirt_vmi_storage_read_times_seconds_total{disk} 1.5\n"),
            format!("kubevirt_vmi_storage_write_times_seconds_total{disk} 0\n"),
            format!("kubevirt_vmi_storage_flush_requests_total{disk} 2\n"),
            format!("kubevirt_vmi_storage_flush_times_seconds_total{disk} 0.25\n"),
            "# TYPE kubevirt_vmi_storage_flush_times_seconds_total counter\n".to_owned(),
        ] {
            assert!(text.contains(&line), "{line} missing from\n{text}");
        }
    }

    #[tokio::test]
    async fn scrapes_beyond_the_limit_are_refused_until_one_ends() {
        let s = Shared {
            slot: Arc::default(),
            scrapes: Arc::new(tokio::sync::Semaphore::new(2)),
            max: 2,
        };
        let first = s.scrapes.clone().try_acquire_owned().expect("first");
        let _second = s.scrapes.clone().try_acquire_owned().expect("second");
        let (code, body) = metrics(State(s.clone())).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body,
            "Limit of concurrent requests reached (2), try again later.\n"
        );
        drop(first);
        let (code, body) = metrics(State(s)).await;
        assert_eq!(code, StatusCode::OK);
        assert!(
            body.contains("# TYPE kubevirt_vmi_phase_count gauge"),
            "{body}"
        );
    }

    #[test]
    fn net_dev_tables_parse_to_the_guest_side() {
        let table = "Inter-|   Receive                                                |  Transmit\n \
             face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n\
                 lo:     100       2    0    0    0     0          0         0      100       2    0    0    0     0       0          0\n\
             tap0:    5000      40    1    2    0     0          0         0     9000      60    3    4    0     0       0          0\n";
        let t = parse_net_dev(table);
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!(
            t["tap0"],
            NetCounters {
                rx_bytes: 9000,
                rx_packets: 60,
                rx_errors: 3,
                rx_dropped: 4,
                tx_bytes: 5000,
                tx_packets: 40,
                tx_errors: 1,
                tx_dropped: 2,
            }
        );
        // The kernel's own table has this process's loopback.
        let own = std::fs::read_to_string("/proc/self/net/dev").expect("/proc/self/net/dev");
        assert!(parse_net_dev(&own).contains_key("lo"), "{own}");
    }
}
