//! What the launcher's examples share: the launcher binary beside them, a child killed on drop,
//! and a process's resident set.

use std::path::{Path, PathBuf};
use std::process::Child;

use anyhow::{Context as _, bail};

/// virt-launcher, built with the same profile as the running example.
pub fn launcher_bin() -> anyhow::Result<PathBuf> {
    // Examples live in target/<profile>/examples/; the binary one level up.
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .context("no target dir")?
        .join("virt-launcher");
    if !bin.exists() {
        bail!(
            "{} is missing: build it with the same profile first",
            bin.display()
        );
    }
    Ok(bin)
}

/// Resident KiB of a process (`VmRSS`).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A child process, killed and reaped when dropped.
pub struct Proc(pub Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
