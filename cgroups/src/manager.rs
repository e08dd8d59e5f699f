//! The per-pod manager: one value that knows where a pod's cgroups are and changes them.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use tracing::debug;

use crate::cpuset::{self, CpuList, Placement, Step};
use crate::devices::{DeviceEntry, DeviceRule};
use crate::error::{CgroupError, Result};
use crate::membership::ProcessCgroups;
use crate::setup::{CgroupSetup, Mode};
use crate::v1::{V1Devices, V1State};
use crate::v2::BpfDevices;

/// The device backend the host's mode calls for.
#[derive(Debug)]
pub enum Devices {
    V1(V1Devices),
    V2(BpfDevices),
}

/// A cgroup directory and which hierarchy version it lives in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupDir {
    pub path: PathBuf,
    pub v2: bool,
}

/// Device, CPU and memory control over one process's cgroups (in KubeVirt, the launcher
/// container's).
#[derive(Debug)]
pub struct Manager {
    mode: Mode,
    devices: Devices,
    cpuset: CgroupDir,
    memory: CgroupDir,
    /// cpuset children this manager made, to remove again on cleanup.
    children: Vec<CgroupDir>,
}

impl Manager {
    /// The manager for the cgroups `cgroups` names (read from `/proc/<pid>/cgroup`) on a host
    /// set up as `setup`. v1 controllers are used wherever the host mounts them (legacy and
    /// hybrid hosts), cgroup2 otherwise; that is also how container runtimes choose.
    pub fn for_process(setup: &CgroupSetup, cgroups: &ProcessCgroups) -> Result<Self> {
        let dir = |controller: &str| -> Result<CgroupDir> {
            if setup.mode != Mode::Unified
                && let Ok(h) = setup.v1_hierarchy(controller)
            {
                let path = cgroups.v1_path(controller)?;
                return Ok(CgroupDir {
                    path: under(h.dir_of(path), &h.mount_point, path)?,
                    v2: false,
                });
            }
            let h = setup.unified_hierarchy()?;
            let path = cgroups.unified_path()?;
            Ok(CgroupDir {
                path: under(h.dir_of(path), &h.mount_point, path)?,
                v2: true,
            })
        };
        let devices_dir = dir("devices")?;
        let devices = if devices_dir.v2 {
            Devices::V2(BpfDevices::open(&devices_dir.path)?)
        } else {
            Devices::V1(V1Devices::new(&devices_dir.path))
        };
        Ok(Self {
            mode: setup.mode,
            devices,
            cpuset: dir("cpuset")?,
            memory: dir("memory")?,
            children: Vec::new(),
        })
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn devices(&self) -> &Devices {
        &self.devices
    }

    pub fn cpuset_dir(&self) -> &CgroupDir {
        &self.cpuset
    }

    pub fn memory_dir(&self) -> &CgroupDir {
        &self.memory
    }

    /// Sets the device rules; see [`V1Devices::set_rules`] and [`BpfDevices::set_rules`] for
    /// how each backend avoids a window in which a device allowed before and after is denied.
    pub fn set_device_rules(&mut self, rules: &[DeviceRule]) -> Result<()> {
        match &mut self.devices {
            Devices::V1(d) => d.set_rules(rules),
            Devices::V2(d) => d.set_rules(rules),
        }
    }

    /// What the cgroup currently allows: read back from the kernel on v1; on cgroup2, the
    /// rules this manager attached (`None` before it attached any).
    pub fn allowed_devices(&self) -> Result<Option<Vec<DeviceEntry>>> {
        match &self.devices {
            Devices::V1(d) => match d.state()? {
                V1State::AllowAll => Ok(None),
                V1State::Allowed(entries) => Ok(Some(entries)),
            },
            Devices::V2(d) => Ok(d.allowed().map(<[DeviceEntry]>::to_vec)),
        }
    }

    /// Moves `vcpu_threads` of process `pid` into the `vcpus` child pinned to `vcpu_cpus`,
    /// and every other thread of `pid` into the `housekeeping` child pinned to
    /// `housekeeping_cpus`. The kernel updates each thread's affinity as it moves. Threads
    /// started afterwards stay where their creator is; call again to place them.
    pub fn place_threads(
        &mut self,
        pid: i32,
        vcpu_threads: &[i32],
        vcpu_cpus: &CpuList,
        housekeeping_cpus: &CpuList,
    ) -> Result<()> {
        let all = threads_of(pid)?;
        if let Some(&stray) = vcpu_threads.iter().find(|t| !all.contains(t)) {
            return Err(CgroupError::MoveThread {
                tid: stray,
                path: self.cpuset.path.clone(),
                source: io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("thread {stray} is not a thread of process {pid}"),
                ),
            });
        }
        let placement = Placement {
            vcpu_threads: vcpu_threads.to_vec(),
            vcpu_cpus: vcpu_cpus.clone(),
            housekeeping_threads: all
                .into_iter()
                .filter(|t| !vcpu_threads.contains(t))
                .collect(),
            housekeeping_cpus: housekeeping_cpus.clone(),
        };
        let mems = if self.cpuset.v2 {
            String::new()
        } else {
            read(&self.cpuset.path.join("cpuset.mems"))?
        };
        for step in cpuset::plan(self.cpuset.v2, &self.cpuset.path, &mems, &placement) {
            match step {
                Step::Mkdir(path) => match fs::create_dir(&path) {
                    Ok(()) => self.children.push(CgroupDir {
                        path,
                        v2: self.cpuset.v2,
                    }),
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(source) => return Err(CgroupError::Create { path, source }),
                },
                Step::Write(path, value) => write(&path, &value)?,
                Step::Move(path, tid) => match fs::write(&path, tid.to_string()) {
                    Ok(()) => {}
                    // QEMU's worker threads come and go; one that ended since the listing
                    // needs no placing. A vCPU thread must not vanish.
                    Err(e)
                        if e.raw_os_error() == Some(libc::ESRCH)
                            && !vcpu_threads.contains(&tid) => {}
                    Err(source) => return Err(CgroupError::MoveThread { tid, path, source }),
                },
            }
        }
        debug!(pid, cgroup = %self.cpuset.path.display(), "threads placed");
        Ok(())
    }

    /// The memory limit in bytes; `None` when unlimited.
    pub fn memory_limit(&self) -> Result<Option<u64>> {
        let file = if self.memory.v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        let path = self.memory.path.join(file);
        let text = read(&path)?;
        let text = text.trim();
        if text == "max" {
            return Ok(None);
        }
        let bytes: u64 = text.parse().map_err(|_| CgroupError::Parse {
            path: path.clone(),
            message: format!("{text:?} is not a byte count"),
        })?;
        // v1 reports "unlimited" as the largest page-aligned i64.
        Ok((bytes < 1 << 62).then_some(bytes))
    }

    /// Sets the memory limit; `None` lifts it (`max` on cgroup2, `-1` on v1).
    pub fn set_memory_limit(&self, bytes: Option<u64>) -> Result<()> {
        let (file, value) = match (self.memory.v2, bytes) {
            (true, None) => ("memory.max", "max".to_owned()),
            (false, None) => ("memory.limit_in_bytes", "-1".to_owned()),
            (v2, Some(b)) => {
                if i64::try_from(b).is_err() {
                    return Err(CgroupError::Parse {
                        path: self.memory.path.clone(),
                        message: format!("memory limit {b} is out of range"),
                    });
                }
                let file = if v2 {
                    "memory.max"
                } else {
                    "memory.limit_in_bytes"
                };
                (file, b.to_string())
            }
        };
        write(&self.memory.path.join(file), &value)
    }

    /// Undoes what this manager added: threads go back to the pod's cpuset cgroup, the
    /// children it made are removed, its device program is detached. The pod's own cgroups
    /// belong to the container runtime and stay.
    pub fn cleanup(mut self) -> Result<()> {
        for child in self.children.drain(..).rev() {
            remove_child(&child, &self.cpuset.path)?;
        }
        if let Devices::V2(d) = &mut self.devices {
            d.remove()?;
        }
        Ok(())
    }
}

fn under(dir: Option<PathBuf>, mount: &Path, path: &Path) -> Result<PathBuf> {
    dir.ok_or_else(|| CgroupError::Parse {
        path: mount.to_owned(),
        message: format!("cgroup {} lies outside this mount", path.display()),
    })
}

/// Thread ids of a process.
pub fn threads_of(pid: i32) -> Result<Vec<i32>> {
    let dir = PathBuf::from(format!("/proc/{pid}/task"));
    let entries = fs::read_dir(&dir).map_err(|source| CgroupError::Read {
        path: dir.clone(),
        source,
    })?;
    let mut tids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| CgroupError::Read {
            path: dir.clone(),
            source,
        })?;
        if let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
            tids.push(tid);
        }
    }
    tids.sort_unstable();
    Ok(tids)
}

fn remove_child(child: &CgroupDir, parent: &Path) -> Result<()> {
    let (list, dest) = if child.v2 {
        ("cgroup.threads", parent.join("cgroup.threads"))
    } else {
        ("tasks", parent.join("tasks"))
    };
    for tid in read(&child.path.join(list))?.lines() {
        match fs::write(&dest, tid) {
            // Exited since the listing: nothing to move.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(source) => {
                return Err(CgroupError::MoveThread {
                    tid: tid.parse().unwrap_or(-1),
                    path: dest,
                    source,
                });
            }
            Ok(()) => {}
        }
    }
    fs::remove_dir(&child.path).map_err(|source| CgroupError::Remove {
        path: child.path.clone(),
        source,
    })
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_owned(),
        source,
    })
}

fn write(path: &Path, value: &str) -> Result<()> {
    fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_owned(),
        value: value.to_owned(),
        source,
    })
}
