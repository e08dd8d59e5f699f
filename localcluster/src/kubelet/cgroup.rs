//! Pod and container cgroups, laid out like the kubelet's cgroupfs driver under a
//! `localcluster/<node>/pod<uid>/<container>` parent in every hierarchy we use.
//!
//! Written against the cgroup file system directly rather than with cgroups-rs: the child must
//! join its cgroup itself, between fork and exec (writing `0` to pre-opened `cgroup.procs`
//! files), so nothing it forks can escape; cgroups-rs only moves a pid after the fact. The
//! cpuset files are two writes per directory in the same walk over every hierarchy, which a
//! second library's view of the hierarchies would not make shorter.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::KubeletError;

const ROOT: &str = "/sys/fs/cgroup";
/// The v1 hierarchies a pod is placed in (those mounted), plus the unified one of a hybrid host.
const V1: &[&str] = &[
    "cpu", "cpuacct", "cpuset", "memory", "pids", "devices", "freezer", "blkio", "unified",
];
/// The files a v1 cpuset cgroup takes no process before they are set.
const CPUSET_FILES: [&str; 2] = ["cpuset.mems", "cpuset.cpus"];

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

    /// Creates the cgroup in every hierarchy. A new v1 cpuset directory has no CPUs or memory
    /// nodes, and takes no process until it has: each level gets its parent's.
    pub fn create(&self) -> Result<(), KubeletError> {
        for dir in self.dirs() {
            std::fs::create_dir_all(&dir).map_err(|source| KubeletError::Io {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let cpuset = Path::new(ROOT).join("cpuset");
        if cpuset.join("cgroup.procs").exists() {
            let mut parent = cpuset;
            for part in self.relative.components() {
                let child = parent.join(part);
                for file in CPUSET_FILES {
                    let current = read(&child.join(file))?;
                    if current.trim().is_empty() {
                        write(&child.join(file), &read(&parent.join(file))?)?;
                    }
                }
                parent = child;
            }
        }
        Ok(())
    }

    /// Sets the CPUs the cgroup's processes may run on (`cpuset.cpus`), where a cpuset
    /// hierarchy holds it.
    pub fn set_cpus(&self, cpus: &str) -> Result<(), KubeletError> {
        for dir in self.dirs() {
            let path = dir.join("cpuset.cpus");
            if path.exists() {
                write(&path, cpus)?;
            }
        }
        Ok(())
    }

    /// The containers' cgroups of this node's pods, as (pod uid, container name, cgroup); the
    /// pause process's among them.
    pub fn containers(&self) -> Vec<(String, String, Cgroup)> {
        let mut out = Vec::new();
        let Some(dir) = self.dirs().into_iter().next() else {
            return out;
        };
        for pod in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = pod.file_name().to_string_lossy().into_owned();
            let Some(uid) = name.strip_prefix("pod") else {
                continue;
            };
            for c in std::fs::read_dir(pod.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if c.file_type().is_ok_and(|t| t.is_dir()) {
                    let container = c.file_name().to_string_lossy().into_owned();
                    let cgroup = self.child(&name).child(&container);
                    out.push((uid.to_owned(), container, cgroup));
                }
            }
        }
        out
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

fn read(path: &Path) -> Result<String, KubeletError> {
    std::fs::read_to_string(path).map_err(|source| KubeletError::Io {
        path: path.display().to_string(),
        source,
    })
}

fn write(path: &Path, value: &str) -> Result<(), KubeletError> {
    std::fs::write(path, value).map_err(|source| KubeletError::Io {
        path: path.display().to_string(),
        source,
    })
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
