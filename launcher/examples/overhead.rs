//! Per-VM memory overhead, measured (issue 21, item 4); figures are printed, never asserted.
//!
//! ```text
//! cargo build --release -p launcher --bins --examples
//! target/release/examples/overhead            # needs the test guest (hack/guest/build.sh)
//! ```
//!
//! For guests of 128 MiB, 1 GiB and 4 GiB with 1 and 4 vCPUs, boots the test guest (kernel
//! boot) through virt-launcher until its guest agent answers, then reads QEMU's
//! `/proc/<pid>/smaps`: the overhead is QEMU's resident set less the resident part of the
//! guest's RAM block (the pages the guest has touched), next to the launcher's own resident set.
//! Under TCG (this machine) QEMU's translated-code cache is in the figure; under KVM it is not.
//! docs/controller.md sets these against the pod overhead the controller budgets.

use std::path::Path;

use anyhow::{Context as _, bail};
use common::{BOOT, Guest, launcher_bin, rss_kib};

mod common;

const MIB: u64 = 1 << 20;

/// What QEMU has resident, in KiB.
struct QemuMemory {
    total: u64,
    /// The guest's RAM block (`pc.ram`): one private read-write anonymous mapping of the guest's
    /// size (QEMU adds at most a guard page and its alignment).
    guest: u64,
    /// TCG's translated code: private executable anonymous mappings.
    tcg: u64,
}

fn qemu_memory(pid: u32, guest_bytes: u64) -> anyhow::Result<QemuMemory> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut memory = QemuMemory {
        total: 0,
        guest: 0,
        tcg: 0,
    };
    let mut guest_found = false;
    let (mut is_guest_ram, mut is_code_cache) = (false, false);
    for line in smaps.lines() {
        let field = |name: &str| -> Option<u64> {
            line.strip_prefix(name)?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()
        };
        let header: Vec<&str> = line.split_whitespace().collect();
        if header.first().is_some_and(|range| range.contains('-')) && header.len() >= 5 {
            let (perms, anonymous) = (header[1], header.len() == 5);
            is_guest_ram = perms == "rw-p" && anonymous;
            is_code_cache = perms.contains('x') && anonymous;
        } else if let Some(kib) = field("Size:") {
            let size = kib * 1024;
            is_guest_ram &= size >= guest_bytes && size <= guest_bytes + 4 * MIB;
        } else if let Some(kib) = field("Rss:") {
            memory.total += kib;
            if is_guest_ram && !guest_found {
                memory.guest = kib;
                guest_found = true;
            } else if is_code_cache {
                memory.tcg += kib;
            }
        }
    }
    if !guest_found {
        bail!("QEMU {pid} has no read-write mapping of {guest_bytes} bytes (its RAM block)");
    }
    Ok(memory)
}

/// Boots one guest and returns what QEMU has resident and the launcher's RSS in KiB.
fn measure(bin: &Path, memory: &str, guest: u64, vcpus: u32) -> anyhow::Result<(QemuMemory, u64)> {
    let vm = Guest::start(bin, memory, vcpus)?;
    vm.wait_booted(BOOT)?;
    Ok((
        qemu_memory(vm.qemu_pid, guest)?,
        rss_kib(vm.launcher.0.id()),
    ))
}

fn main() -> anyhow::Result<()> {
    let bin = launcher_bin()?;
    println!(
        "{:>6} {:>5} {:>9} {:>12} {:>10} {:>14} {:>9}",
        "guest", "vCPUs", "QEMU RSS", "guest pages", "TCG code", "QEMU overhead", "launcher"
    );
    for (memory, guest) in [
        ("128Mi", 128 * MIB),
        ("1Gi", 1024 * MIB),
        ("4Gi", 4096 * MIB),
    ] {
        for vcpus in [1, 4] {
            let (qemu, launcher) = measure(&bin, memory, guest, vcpus)
                .with_context(|| format!("{memory} with {vcpus} vCPUs"))?;
            // Beyond guest RAM, with the translated code (TCG's cost) and without (KVM's).
            let overhead = qemu.total - qemu.guest;
            println!(
                "{memory:>6} {vcpus:>5} {:>5} MiB {:>8} MiB {:>6} MiB {:>4} MiB ({:>3} MiB) {:>5} MiB",
                qemu.total / 1024,
                qemu.guest / 1024,
                qemu.tcg / 1024,
                overhead / 1024,
                (overhead - qemu.tcg) / 1024,
                launcher / 1024
            );
        }
    }
    Ok(())
}
