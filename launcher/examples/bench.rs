//! Launcher benchmarks; figures are printed, never asserted.
//!
//! ```text
//! cargo run --release -p launcher --example bench            # needs the test guest
//! ```
//!
//! - exec -> command socket ready (median of several starts);
//! - launcher RSS, idle and with one running VM;
//! - `sync` -> Running, against a baseline that runs the same QEMU argv itself and sends `cont`
//!   over a raw QMP socket, as a ratio.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Proc, kernel_boot_vmi, launcher_bin, place_kernel, request, rss_kib, start_launcher};

mod common;

const RUNS: usize = 7;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The baseline: the same argv, run directly, then `cont` over a raw QMP socket.
fn baseline(argv: &[String], qmp: &Path) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    let _qemu = Proc(
        Command::new("qemu-system-x86_64")
            .args(argv)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let stream = loop {
        match UnixStream::connect(qmp) {
            Ok(s) => break s,
            Err(_) if t0.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_micros(500));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let mut r = BufReader::new(stream.try_clone()?);
    let mut w = stream;
    let mut line = String::new();
    r.read_line(&mut line)?; // greeting
    w.write_all(b"{\"execute\":\"qmp_capabilities\"}\n")?;
    line.clear();
    r.read_line(&mut line)?;
    w.write_all(b"{\"execute\":\"cont\"}\n")?;
    loop {
        line.clear();
        r.read_line(&mut line)?;
        if line.contains("\"return\"") {
            break;
        }
    }
    Ok(t0.elapsed())
}

fn main() -> anyhow::Result<()> {
    let bin = launcher_bin()?;

    let mut ready = Vec::new();
    let mut idle_rss = 0;
    for _ in 0..RUNS {
        let root = tempfile::tempdir()?;
        let (p, _, t) = start_launcher(&bin, root.path())?;
        ready.push(t);
        std::thread::sleep(Duration::from_millis(50));
        idle_rss = rss_kib(p.0.id());
    }
    println!(
        "exec -> socket ready: median {:?} of {RUNS} (goal <= 20 ms)",
        median(ready)
    );
    println!("launcher RSS idle: {idle_rss} KiB (goal <= 8192 KiB)");

    let mut syncs = Vec::new();
    let mut bases = Vec::new();
    let mut vm_rss = 0;
    for _ in 0..3 {
        let root = tempfile::tempdir()?;
        place_kernel(root.path())?;
        let (p, socket, _) = start_launcher(&bin, root.path())?;
        // Let the one-time accelerator probe finish; it is not part of a sync's cost.
        std::thread::sleep(Duration::from_secs(4));
        let uid = uuid::Uuid::new_v4().to_string();
        let vmi = kernel_boot_vmi(&uid, "256Mi", 1);
        let body = serde_json::to_vec(&vmi)?;
        let t0 = Instant::now();
        let reply = request(&socket, "PUT", "/v1/sync", &body)?;
        let took = t0.elapsed();
        anyhow::ensure!(reply["state"] == "Running", "sync failed: {reply}");
        syncs.push(took);
        std::thread::sleep(Duration::from_millis(200));
        vm_rss = rss_kib(p.0.id());
        drop(p);

        // Same argv, from the launcher's own converter, in a fresh directory.
        let broot = tempfile::tempdir()?;
        place_kernel(broot.path())?;
        let dirs = launcher::paths::Dirs {
            share: broot.path().join("share"),
            private: broot.path().join("private"),
            ephemeral: broot.path().join("ephemeral"),
            container_disks: broot.path().join("cd"),
            hotplug_disks: broot.path().join("hp"),
            block_devices: "/dev".into(),
            nvram: broot.path().join("nvram"),
        };
        let v: api::VirtualMachineInstance = serde_json::from_value(vmi)?;
        let host = launcher::convert::Host {
            accel: launcher::qemu::Accel::Tcg,
            ovmf_dir: "/usr/share/OVMF".into(),
            hugepages_dir: "/dev/hugepages".into(),
            block_volumes: std::collections::BTreeSet::new(),
            network: std::collections::BTreeMap::new(),
        };
        let plan = launcher::convert::convert(&v, &dirs, &host)?;
        std::fs::create_dir_all(dirs.vm_dir(&uid))?;
        bases.push(baseline(&plan.config.argv(), &dirs.qmp_socket(&uid))?);
    }
    let (s, b) = (median(syncs), median(bases));
    println!("launcher RSS with one running VM: {vm_rss} KiB (goal <= 8192 KiB)");
    println!(
        "sync -> Running: median {s:?}; baseline (same argv + raw cont) {b:?}; ratio {:.2} (goal <= 1.15)",
        s.as_secs_f64() / b.as_secs_f64()
    );
    Ok(())
}
