//! Device rules on cgroup2: an eBPF program attached to the cgroup directory.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use tracing::debug;

use crate::bpf;
use crate::devices::{self, DeviceEntry, DeviceRule};
use crate::error::{CgroupError, Result};

/// One cgroup2 directory's device program, owned by this value.
///
/// The kernel keeps no readable copy of the rules (only compiled instructions), so the rules
/// live here next to the program they were compiled to; [`BpfDevices::attached_programs`]
/// asks the kernel what is really attached.
#[derive(Debug)]
pub struct BpfDevices {
    dir: PathBuf,
    dir_fd: OwnedFd,
    installed: Option<Installed>,
}

#[derive(Debug)]
struct Installed {
    prog: OwnedFd,
    id: u32,
    rules: Vec<DeviceRule>,
    entries: Vec<DeviceEntry>,
}

impl BpfDevices {
    /// `dir` is the cgroup's directory in the cgroup2 hierarchy.
    pub fn open(dir: &Path) -> Result<Self> {
        let dir_fd = File::open(dir)
            .map_err(|source| CgroupError::Read {
                path: dir.to_owned(),
                source,
            })?
            .into();
        Ok(Self {
            dir: dir.to_owned(),
            dir_fd,
            installed: None,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Replaces the cgroup's device programs with one granting exactly what `rules` amount to.
    ///
    /// The new program is attached before any old one is detached. With several programs
    /// attached a request must pass every one of them, so during the overlap a device both
    /// rule sets allow stays allowed, a device only the new set allows becomes usable once the
    /// old program is gone, and one only the old set allowed is refused from the attach on.
    /// Programs put there by someone else (the container runtime's) are detached as well:
    /// left in place, they would veto every device they did not know about.
    pub fn set_rules(&mut self, rules: &[DeviceRule]) -> Result<()> {
        let entries = devices::effective(rules)?;
        let prog = bpf::load_device_program(&bpf::device_program(&entries)).map_err(|e| {
            CgroupError::Verifier {
                path: self.dir.clone(),
                log: e.log,
                source: e.error,
            }
        })?;
        let id = bpf::program_id(prog.as_fd()).map_err(|e| self.err("reading program id", e))?;
        bpf::attach(self.dir_fd.as_fd(), prog.as_fd()).map_err(|e| self.err("attach", e))?;
        debug!(cgroup = %self.dir.display(), id, "device program attached");
        let previous = self.installed.replace(Installed {
            prog,
            id,
            rules: rules.to_vec(),
            entries,
        });
        for old in self.attached_programs()? {
            if old == id {
                continue;
            }
            if previous.as_ref().is_some_and(|p| p.id == old) {
                let p = previous.as_ref().expect("checked");
                self.detach(&p.prog, old)?;
                continue;
            }
            match bpf::program_by_id(old) {
                Ok(fd) => self.detach(&fd, old)?,
                // Freed between the query and now: nothing left to detach.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(self.err("opening attached program", e)),
            }
        }
        Ok(())
    }

    fn detach(&self, prog: &OwnedFd, id: u32) -> Result<()> {
        match bpf::detach(self.dir_fd.as_fd(), prog.as_fd()) {
            Ok(()) => {
                debug!(cgroup = %self.dir.display(), id, "device program detached");
                Ok(())
            }
            // Someone else detached it first: the end state is the one wanted.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(self.err("detach", e)),
        }
    }

    /// The rules last set through this value.
    pub fn rules(&self) -> Option<&[DeviceRule]> {
        self.installed.as_ref().map(|i| i.rules.as_slice())
    }

    /// The allow list those rules amount to.
    pub fn allowed(&self) -> Option<&[DeviceEntry]> {
        self.installed.as_ref().map(|i| i.entries.as_slice())
    }

    /// The kernel id of the program this value attached.
    pub fn program_id(&self) -> Option<u32> {
        self.installed.as_ref().map(|i| i.id)
    }

    /// Ids of every device program attached to the directory, as the kernel reports them.
    pub fn attached_programs(&self) -> Result<Vec<u32>> {
        bpf::query(self.dir_fd.as_fd()).map_err(|e| self.err("query", e))
    }

    /// Detaches this value's program; the kernel frees it once nothing refers to it.
    pub fn remove(&mut self) -> Result<()> {
        if let Some(installed) = self.installed.take() {
            self.detach(&installed.prog, installed.id)?;
        }
        Ok(())
    }

    fn err(&self, op: &'static str, source: std::io::Error) -> CgroupError {
        CgroupError::Bpf {
            op,
            path: self.dir.clone(),
            source,
        }
    }
}
