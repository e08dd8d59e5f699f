//! Benchmark (ignored; run with `cargo nextest run -p localcluster --run-ignored only -E
//! 'test(bench_)' --no-capture`): how long the upstream control plane takes to start and how
//! much memory each component holds once it settled. Prints figures, asserts nothing timed.

use std::time::{Duration, Instant};

use localcluster::controlplane::{ControlPlane, ControlPlaneConfig, kube_binary};

/// `VmRSS` of `pid` in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kib| kib.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
#[ignore = "benchmark: prints start time and memory of the control plane"]
async fn bench_controlplane_start_and_rss() {
    let kube = kube_binary().expect("the upstream binary");
    for round in 1..=3 {
        let dir = tempfile::tempdir().unwrap();
        let load = load_average();
        let started = Instant::now();
        let plane = ControlPlane::start(ControlPlaneConfig::new(dir.path(), kube.clone()))
            .await
            .expect("the control plane");
        let ready = started.elapsed();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let mut total = 0.0;
        let mut parts = Vec::new();
        for c in plane.components() {
            let rss = rss_mib(c.pid());
            total += rss;
            parts.push(format!("{} {rss:.0} MiB", c.name()));
        }
        println!(
            "round {round}: etcd + kube-apiserver + kube-controller-manager + kube-scheduler ready (default service account served) in {:.1} s (load average before: {load}); RSS 10 s later: {} = {total:.0} MiB",
            ready.as_secs_f64(),
            parts.join(", "),
        );
        plane.stop();
    }
}
