//! How many 128 MiB, 1-vCPU VMs fit on a 24 GiB node (issue 21, item 4): under KubeVirt's
//! overhead formula, under ours, and how many actually boot and idle here. Figures are printed,
//! never asserted; the run fails only if a guest it counted did not really run, or a QEMU
//! outlived it.
//!
//! ```text
//! cargo build --release -p launcher --bins --examples
//! target/release/examples/node_fit [MAX]      # MAX guests at most (40); needs the test guest
//! ```
//!
//! Boots the test guest (kernel boot, as the overhead example) one launcher + QEMU after
//! another, each waited for until its guest agent answers, until MAX have booted, one fails to
//! boot within [`BOOT`], or the next one would not fit in the memory this machine has left
//! (less a reserve for the host). Then it lets them idle, measures their CPU, checks that every
//! agent still answers, and stops them all. Under TCG each boot takes a core for seconds and an
//! idle guest still costs a little CPU (its timer ticks are emulated); the run prints what
//! bounded it and the idle guests' CPU, and docs/controller.md what it found.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use common::{BOOT, Guest, kernel_boot_vmi, launcher_bin, rss_kib};

mod common;

const MIB: u64 = 1 << 20;
/// The node of the question.
const NODE_BYTES: u64 = 24 << 30;
const GUEST_MEMORY: &str = "128Mi";
const GUEST_BYTES: u64 = 128 * MIB;
const MAX_GUESTS: usize = 40;
/// Memory left to the host (its builds, this example) when deciding whether one more fits.
const HOST_RESERVE_BYTES: u64 = 1 << 30;
/// How long the guests idle while their CPU is measured.
const IDLE: Duration = Duration::from_secs(20);

/// KubeVirt's `GetMemoryOverhead` (pkg/hypervisor/kvm/hypervisorbackend.go) for a VMI of
/// `guest_bytes` and `vcpus` with a graphics device (the default) and nothing else that adds
/// to it (no probes, VFIO, TPM, SEV, dedicated CPUs, downward metrics; amd64; no
/// `additionalGuestMemoryOverheadRatio`; no network binding plugin).
fn kubevirt_overhead(guest_bytes: u64, vcpus: u64) -> u64 {
    // VirtLauncherMonitorOverhead 25Mi + VirtLauncherOverhead 100Mi + VirtlogdOverhead 25Mi
    // + VirtqemudOverhead 40Mi + QemuOverhead 50Mi.
    const STATIC_MIB: u64 = 25 + 100 + 25 + 40 + 50;
    // "8 MiB per vCPU", the static IOThread 8Mi, video RAM 32Mi.
    const PER_VCPU_MIB: u64 = 8;
    const IOTHREAD_MIB: u64 = 8;
    const VIDEO_MIB: u64 = 32;
    // Page tables: the request scaled to whole kB (rounding up, as ScaledValue does), / 512.
    let page_tables = guest_bytes.div_ceil(1000) * 1000 / 512;
    page_tables + (STATIC_MIB + PER_VCPU_MIB * vcpus + IOTHREAD_MIB + VIDEO_MIB) * MIB
}

/// KubeVirt's `guest-console-log` container (serialconsolelog.go): a native sidecar requesting
/// 35M, on by default; it adds to the launcher pod's request. Ours has no such container.
const KUBEVIRT_CONSOLE_LOG_BYTES: u64 = 35_000_000;

#[allow(clippy::cast_precision_loss)]
fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

fn print_fit(who: &str, pod_bytes: u64) {
    println!(
        "  {who:<58} pod request {:>7.2} MiB -> {:>3} VMs",
        mib(pod_bytes),
        NODE_BYTES / pod_bytes
    );
}

fn meminfo_kib(field: &str) -> anyhow::Result<u64> {
    std::fs::read_to_string("/proc/meminfo")?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/meminfo"))
}

/// CPU time a process has used (user + system), in clock ticks.
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces; utime and stime are fields 14, 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("no command name")?
        .1
        .split_whitespace()
        .collect();
    let field = |i: usize| -> anyhow::Result<u64> {
        Ok(fields.get(i).context("short /proc/pid/stat")?.parse()?)
    };
    Ok(field(11)? + field(12)?)
}

/// What stopped the boots.
enum Bound {
    Count,
    Memory { available: u64, next: u64 },
    Boot(anyhow::Error),
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Count => write!(f, "the count asked for"),
            Self::Memory { available, next } => write!(
                f,
                "memory: {:.0} MiB available, the next guest needs about {:.0} MiB plus the host's {:.0} MiB reserve",
                mib(*available),
                mib(*next),
                mib(HOST_RESERVE_BYTES)
            ),
            Self::Boot(e) => write!(f, "a guest that did not boot: {e:#}"),
        }
    }
}

/// What one guest has resident: QEMU and its launcher, in bytes.
fn resident(guest: &Guest) -> (u64, u64) {
    (
        rss_kib(guest.qemu_pid) * 1024,
        rss_kib(guest.launcher.0.id()) * 1024,
    )
}

fn main() -> anyhow::Result<()> {
    let max: usize = match std::env::args().nth(1) {
        Some(n) => n.parse().context("MAX: a number of guests")?,
        None => MAX_GUESTS,
    };
    let bin = launcher_bin()?;

    println!(
        "\n128 MiB, 1-vCPU VMs (graphics device attached, as by default) on a {} GiB node, by memory request:",
        NODE_BYTES >> 30
    );
    let kubevirt = GUEST_BYTES + kubevirt_overhead(GUEST_BYTES, 1);
    print_fit("KubeVirt (guest + GetMemoryOverhead)", kubevirt);
    print_fit(
        "KubeVirt, with its guest-console-log sidecar (35M)",
        kubevirt + KUBEVIRT_CONSOLE_LOG_BYTES,
    );
    let vmi: api::VirtualMachineInstance =
        serde_json::from_value(kernel_boot_vmi("fit", GUEST_MEMORY, 1))?;
    for (who, emulated) in [
        ("ours, KVM (api::overhead::memory_overhead)", false),
        (
            "ours, TCG (useEmulation: + the translated-code cache)",
            true,
        ),
    ] {
        print_fit(
            who,
            GUEST_BYTES + api::overhead::memory_overhead(&vmi, GUEST_BYTES, emulated),
        );
    }

    let load_before = testguest::load_average();
    println!(
        "\nbooting up to {max}, one after another (memory: {:.0} MiB total, {:.0} MiB available; load {load_before})",
        mib(meminfo_kib("MemTotal")? * 1024),
        mib(meminfo_kib("MemAvailable")? * 1024),
    );
    println!(
        "{:>3} {:>8} {:>9} {:>9} {:>15}",
        "n", "boot", "QEMU RSS", "launcher", "load average"
    );
    let mut guests: Vec<Guest> = Vec::new();
    // Before the first guest is measured: what our formula budgets for one under TCG.
    let mut next = GUEST_BYTES + api::overhead::memory_overhead(&vmi, GUEST_BYTES, true);
    let bound = loop {
        if guests.len() == max {
            break Bound::Count;
        }
        let available = meminfo_kib("MemAvailable")? * 1024;
        if available < next + HOST_RESERVE_BYTES {
            break Bound::Memory { available, next };
        }
        let booted = Guest::start(&bin, GUEST_MEMORY, 1).and_then(|guest| {
            let took = guest.wait_booted(BOOT)?;
            Ok((guest, took))
        });
        match booted {
            Ok((guest, took)) => {
                let (qemu, launcher) = resident(&guest);
                next = next.max(qemu + launcher);
                println!(
                    "{:>3} {:>7.1}s {:>5.0} MiB {:>5.0} MiB {:>15}",
                    guests.len() + 1,
                    took.as_secs_f64(),
                    mib(qemu),
                    mib(launcher),
                    testguest::load_average()
                );
                guests.push(guest);
            }
            Err(e) => break Bound::Boot(e.context(format!("guest {}", guests.len() + 1))),
        }
    };

    // Idle: every guest's CPU over the window, then every agent must still answer.
    let ticks = |guests: &[Guest]| -> anyhow::Result<u64> {
        guests.iter().map(|g| cpu_ticks(g.qemu_pid)).sum()
    };
    let (t0, before) = (Instant::now(), ticks(&guests)?);
    std::thread::sleep(IDLE);
    let used = ticks(&guests)? - before;
    let window = t0.elapsed().as_secs_f64();
    let idling = guests
        .iter()
        .map(Guest::agent_connected)
        .collect::<anyhow::Result<Vec<bool>>>()?
        .into_iter()
        .filter(|&answered| answered)
        .count();
    let (qemu, launcher) = guests
        .iter()
        .map(resident)
        .fold((0, 0), |(q, l), (dq, dl)| (q + dq, l + dl));
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let n = guests.len().max(1) as u64;
    #[allow(clippy::cast_precision_loss)]
    let (cores, each) = {
        let cores = used as f64 / hz as f64 / window;
        (cores, cores * 100.0 / n as f64)
    };
    println!("\nbooted: {}; bounded by {bound}", guests.len());
    println!(
        "idle {IDLE:?}: {idling} of {} agents still answer; their QEMUs use {cores:.2} cores ({each:.1}% of a core each)",
        guests.len(),
    );
    println!(
        "resident: QEMU {:.0} MiB + launchers {:.0} MiB = {:.0} MiB; per VM {:.0} + {:.1} = {:.0} MiB",
        mib(qemu),
        mib(launcher),
        mib(qemu + launcher),
        mib(qemu / n),
        mib(launcher / n),
        mib((qemu + launcher) / n)
    );
    println!(
        "load average: {load_before} before, {} at the end",
        testguest::load_average()
    );
    if idling != guests.len() {
        bail!(
            "{} guests stopped answering while idle",
            guests.len() - idling
        );
    }

    let pids: Vec<u32> = guests.iter().map(|g| g.qemu_pid).collect();
    drop(guests);
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids
        .iter()
        .any(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
    {
        if Instant::now() > deadline {
            bail!("QEMUs outlived their launchers: {pids:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}
