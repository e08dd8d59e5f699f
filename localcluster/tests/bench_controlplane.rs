//! Benchmark (ignored; run with `cargo nextest run -p localcluster --run-ignored only -E
//! 'test(bench_)' --no-capture`): how long the upstream control plane takes to start and how
//! much memory each component holds once it settled. Prints figures, asserts nothing timed.

use std::time::{Duration, Instant};

use localcluster::controlplane::{ControlPlane, ControlPlaneConfig, kube_binary};

/// A `/proc/<pid>/status` figure (`VmRSS`, `RssAnon`, ...) in MiB.
fn status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kib| kib.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

#[tokio::test]
#[ignore = "benchmark: prints start time and memory of the control plane"]
async fn bench_controlplane_start_and_rss() {
    let kube = kube_binary().expect("the upstream binary");
    for round in 1..=3 {
        let dir = tempfile::tempdir().unwrap();
        let load = testguest::load_average();
        let started = Instant::now();
        let plane = ControlPlane::start(ControlPlaneConfig::new(dir.path(), kube.clone()))
            .await
            .expect("the control plane");
        let ready = started.elapsed();
        tokio::time::sleep(Duration::from_secs(10)).await;
        // The components are one binary: its pages in RssFile are shared between them, so the
        // machine holds them once; RssAnon is each component's own.
        let (mut anon, mut file_max) = (0.0, 0.0_f64);
        let mut parts = Vec::new();
        for c in plane.components() {
            let (rss, own) = (status_mib(c.pid(), "VmRSS"), status_mib(c.pid(), "RssAnon"));
            anon += own;
            file_max = file_max.max(status_mib(c.pid(), "RssFile"));
            parts.push(format!("{} {rss:.0} MiB ({own:.0} anonymous)", c.name()));
        }
        println!(
            "round {round}: etcd + kube-apiserver + kube-controller-manager + kube-scheduler ready (default service account served) in {:.1} s (load average before: {load}); RSS 10 s later: {}; anonymous total {anon:.0} MiB + at most {file_max:.0} MiB of the shared binary",
            ready.as_secs_f64(),
            parts.join(", "),
        );
        plane.stop();
    }
}
