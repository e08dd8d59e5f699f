//! Pod and container cgroups, laid out like the kubelet's cgroupfs driver under a
//! `localcluster/<node>/pod<uid>/<container>` parent in every hierarchy we use.
//!
//! Written against the cgroup file system directly rather than with cgroups-rs: the child must
//! join its cgroup itself, between fork and exec (writing `0` to pre-opened `cgroup.procs`
//! files), so nothing it forks can escape; cgroups-rs only moves a pid after the fact.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::KubeletError;

const ROOT: &str = "/sys/fs/cgroup";
/// The v1 hierarchies a pod is placed in (those mounted), plus the unified one of a hybrid host.
const V1: &[&str] = &[
    "cpu", "cpuacct", "memory", "pids", "devices", "freezer", "blkio", "unified",
];

/// The hierarchies on this host.
pub fn hierarchies() -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    if root.join("cgroup.controllers").exists() {
        return vec![root.to_path_buf()];
    }
    V1.iter()
        .map(|c| root.join(c))
        .filter(|p| p.join("cgroup.procs").exists())
        .collect()
}

/// One cgroup, by its path relative to each hierarchy's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    pub relative: PathBuf,
}

impl Cgroup {
    pub fn node(node: &str) -> Self {
        Self {
            relative: Path::new("localcluster").join(node),
        }
    }

    /// The cgroup of pod `uid` on `node`; its containers' are its children, by name.
    pub fn pod(node: &str, uid: &str) -> Self {
        Self::node(node).child(&format!("pod{uid}"))
    }

    #[must_use]
    pub fn child(&self, name: &str) -> Self {
        Self {
            relative: self.relative.join(name),
        }
    }

    fn dirs(&self) -> Vec<PathBuf> {
        hierarchies()
            .into_iter()
            .map(|h| h.join(&self.relative))
            .collect()
    }

    /// Removes the cgroup's directories where they are empty (others may still use them).
    pub fn remove_if_unused(&self) {
        for dir in self.dirs() {
            let _ = std::fs::remove_dir(dir);
        }
    }

    /// Creates the cgroup in every hierarchy.
    pub fn create(&self) -> Result<(), KubeletError> {
        for dir in self.dirs() {
            std::fs::create_dir_all(&dir).map_err(|source| KubeletError::Io {
                path: dir.display().to_string(),
                source,
            })?;
        }
        Ok(())
    }

    /// Opens every hierarchy's `cgroup.procs` for writing, so a child can join with `0`.
    pub fn procs_files(&self) -> Result<Vec<File>, KubeletError> {
        self.dirs()
            .into_iter()
            .map(|d| {
                let path = d.join("cgroup.procs");
                OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|source| KubeletError::Io {
                        path: path.display().to_string(),
                        source,
                    })
            })
            .collect()
    }

    /// Sets the memory limit (v1 `memory.limit_in_bytes`, v2 `memory.max`).
    pub fn set_memory_limit(&self, bytes: u64) -> Result<(), KubeletError> {
        for dir in self.dirs() {
            for file in ["memory.limit_in_bytes", "memory.max"] {
                let path = dir.join(file);
                if path.exists() {
                    std::fs::write(&path, bytes.to_string()).map_err(|source| {
                        KubeletError::Io {
                            path: path.display().to_string(),
                            source,
                        }
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Every process in this cgroup or below it, in any hierarchy.
    pub fn pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for dir in self.dirs() {
            collect_pids(&dir, &mut pids);
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Sends `signal` to every process in the cgroup tree.
    pub fn signal_all(&self, signal: Signal) {
        for pid in self.pids() {
            let _ = kill(Pid::from_raw(pid), signal);
        }
    }

    /// SIGKILLs everything in the tree until it is empty (for up to 10 s), then removes the
    /// directories bottom-up. Blocking; call from a blocking context.
    pub fn destroy(&self) {
        for _ in 0..200 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for dir in self.dirs() {
            remove_tree(&dir);
        }
    }
}

fn collect_pids(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_pids(&e.path(), out);
            }
        }
    }
}

fn remove_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    if dir.exists()
        && let Err(e) = std::fs::remove_dir(dir)
    {
        tracing::warn!(cgroup = %dir.display(), error = %e, "removing a cgroup");
    }
}
