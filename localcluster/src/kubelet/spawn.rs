//! Starting a container process: the plan is built in the kubelet (allocating freely), and the
//! child runs it between fork and exec with raw system calls only.
//!
//! Why `pre_exec` rather than re-executing a helper binary: the kubelet runs inside the
//! `localcluster` binary and inside test binaries alike, so there is no one helper path to
//! re-exec; and the child's work is a fixed list of `write`/`setns`/`unshare`/`mkdir`/`mount`/
//! `pivot_root`/`chdir` calls on buffers prepared before the fork, all async-signal-safe, which
//! is exactly what `pre_exec` permits.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsFd as _;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;

use super::KubeletError;

/// A mount the child performs, targets already inside the new root.
#[derive(Debug)]
pub enum Step {
    /// `mkdir` (an existing directory is fine).
    Mkdir(CString),
    /// Creates an empty file to bind a file onto.
    Touch(CString),
    Mount {
        source: Option<CString>,
        target: CString,
        fstype: Option<CString>,
        flags: MsFlags,
        data: Option<CString>,
    },
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap_or_default()
}

/// `path` inside a container whose root mirrors `lower` (the host root, every container's lower
/// layer), with the symlinks along it resolved against that root rather than the host's:
/// Debian's `/var/run -> /run` makes `/var/run/secrets` `/run/secrets`. Mount targets are
/// reached from outside the new root, where an absolute link would lead into the host's own
/// directories (and the mount would be invisible in the container). Loops stop after 40 links,
/// like the kernel's.
pub fn resolve_links(lower: &Path, path: &Path) -> PathBuf {
    use std::collections::VecDeque;
    use std::path::Component;
    let mut out = PathBuf::from("/");
    let mut pending: VecDeque<std::ffi::OsString> = path
        .components()
        .filter(|c| !matches!(c, Component::RootDir))
        .map(|c| c.as_os_str().to_owned())
        .collect();
    let mut links = 0;
    while let Some(c) = pending.pop_front() {
        if c == ".." {
            out.pop();
            continue;
        }
        if c == "." {
            continue;
        }
        let candidate = out.join(&c);
        let on_host = lower.join(candidate.strip_prefix("/").unwrap_or(&candidate));
        match std::fs::read_link(&on_host) {
            Ok(link) if links < 40 => {
                links += 1;
                if link.is_absolute() {
                    out = PathBuf::from("/");
                }
                for part in link
                    .components()
                    .filter(|c| !matches!(c, Component::RootDir))
                    .rev()
                {
                    pending.push_front(part.as_os_str().to_owned());
                }
            }
            _ => out = candidate,
        }
    }
    out
}

/// The mount namespace and root a container gets.
#[derive(Debug, Default)]
pub struct RootPlan {
    pub steps: Vec<Step>,
    /// The directory that becomes `/` (a mount point after `steps`).
    pub root: Option<CString>,
    /// Propagation applied to the inherited tree right after `unshare`.
    pub propagation: Option<MsFlags>,
}

impl RootPlan {
    /// Adds `mkdir -p` of `path` below `root`, one step per component.
    pub fn mkdir_p(&mut self, root: &Path, path: &Path) {
        let mut at = root.to_path_buf();
        for c in path
            .components()
            .skip_while(|c| matches!(c, std::path::Component::RootDir))
        {
            at.push(c);
            self.steps.push(Step::Mkdir(cstr(&at)));
        }
    }

    /// The mount point `target` (inside `root`) for `source`: a directory, or a file for a file.
    /// Symlinks along `target` are resolved as the container sees them (see
    /// [`resolve_links`]).
    pub fn mount_point(&mut self, root: &Path, target: &Path, source_is_file: bool) -> PathBuf {
        let target = &resolve_links(Path::new("/"), target);
        let inside = root.join(target.strip_prefix("/").unwrap_or(target));
        if source_is_file {
            if let Some(parent) = target.parent() {
                self.mkdir_p(root, parent);
            }
            self.steps.push(Step::Touch(cstr(&inside)));
        } else {
            self.mkdir_p(root, target);
        }
        inside
    }

    pub fn mount(
        &mut self,
        source: Option<&str>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) {
        let c = |s: &str| CString::new(s).unwrap_or_default();
        self.steps.push(Step::Mount {
            source: source.map(c),
            target: cstr(target),
            fstype: fstype.map(c),
            flags,
            data: data.map(c),
        });
    }

    pub fn bind(&mut self, source: &Path, target: &Path, read_only: bool) {
        self.steps.push(Step::Mount {
            source: Some(cstr(source)),
            target: cstr(target),
            fstype: None,
            flags: MsFlags::MS_BIND | MsFlags::MS_REC,
            data: None,
        });
        if read_only {
            self.steps.push(Step::Mount {
                source: None,
                target: cstr(target),
                fstype: None,
                flags: MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
                data: None,
            });
        }
    }
}

/// Everything needed to start one process.
#[derive(Debug)]
pub struct Launch {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub workdir: PathBuf,
    /// The pod's network namespace; `None` shares the kubelet's.
    pub netns: Option<File>,
    /// A mount namespace to enter (exec probes), instead of building one.
    pub mntns: Option<File>,
    /// `cgroup.procs` files the child joins.
    pub cgroups: Vec<File>,
    /// A new UTS namespace with this host name; `None` shares the kubelet's.
    pub hostname: Option<String>,
    /// A new mount namespace built by this plan; `None` shares the kubelet's.
    pub root: Option<RootPlan>,
    pub stdin: Stdio,
    pub stdout: Stdio,
    pub stderr: Stdio,
}

/// Spawns the process; it is in its cgroups, namespaces and root before `exec`.
pub fn spawn(launch: Launch) -> Result<tokio::process::Child, KubeletError> {
    let Some(program) = launch.argv.first().cloned() else {
        return Err(KubeletError::NoCommand);
    };
    let mut cmd = tokio::process::Command::new(&program);
    cmd.args(&launch.argv[1..])
        .env_clear()
        .envs(launch.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(launch.stdin)
        .stdout(launch.stdout)
        .stderr(launch.stderr)
        .kill_on_drop(false);
    let workdir = cstr(&launch.workdir);
    let netns = launch.netns;
    let mntns = launch.mntns;
    let cgroups = launch.cgroups;
    let root = launch.root;
    let hostname = launch.hostname;
    let run = move || -> std::io::Result<()> {
        for f in &cgroups {
            nix::unistd::write(f.as_fd(), b"0")?;
        }
        if let Some(ns) = &netns {
            nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNET)?;
        }
        if let Some(name) = &hostname {
            nix::sched::unshare(CloneFlags::CLONE_NEWUTS)?;
            nix::unistd::sethostname(name)?;
        }
        if let Some(ns) = &mntns {
            nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNS)?;
        }
        if let Some(plan) = &root {
            nix::sched::unshare(CloneFlags::CLONE_NEWNS)?;
            let propagation = plan.propagation.unwrap_or(MsFlags::MS_PRIVATE);
            nix::mount::mount(
                None::<&str>,
                c"/",
                None::<&str>,
                MsFlags::MS_REC | propagation,
                None::<&str>,
            )?;
            for step in &plan.steps {
                match step {
                    Step::Mkdir(p) => match nix::unistd::mkdir(
                        p.as_c_str(),
                        nix::sys::stat::Mode::from_bits_truncate(0o755),
                    ) {
                        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
                        Err(e) => return Err(e.into()),
                    },
                    // O_EXCL: an existing file (perhaps a device node, whose open could
                    // act on the device) is used as it is, never opened.
                    Step::Touch(p) => match nix::fcntl::open(
                        p.as_c_str(),
                        nix::fcntl::OFlag::O_CREAT
                            | nix::fcntl::OFlag::O_EXCL
                            | nix::fcntl::OFlag::O_WRONLY
                            | nix::fcntl::OFlag::O_CLOEXEC,
                        nix::sys::stat::Mode::from_bits_truncate(0o644),
                    ) {
                        Ok(fd) => drop(fd),
                        Err(nix::errno::Errno::EEXIST) => {}
                        Err(e) => return Err(e.into()),
                    },
                    Step::Mount {
                        source,
                        target,
                        fstype,
                        flags,
                        data,
                    } => nix::mount::mount(
                        source.as_deref(),
                        target.as_c_str(),
                        fstype.as_deref(),
                        *flags,
                        data.as_deref(),
                    )?,
                }
            }
            if let Some(new_root) = &plan.root {
                nix::unistd::chdir(new_root.as_c_str())?;
                nix::unistd::pivot_root(c".", c".")?;
                nix::mount::umount2(c".", MntFlags::MNT_DETACH)?;
            }
        }
        nix::unistd::chdir(workdir.as_c_str())?;
        nix::unistd::setsid()?;
        Ok(())
    };
    // SAFETY: the closure only makes system calls (write, setns, unshare, sethostname, mount, mkdir, open,
    // chdir, pivot_root, umount2, setsid) on files and C strings prepared before the fork; it
    // allocates nothing and takes no locks, so it is safe between fork and exec.
    unsafe {
        cmd.pre_exec(run);
    }
    cmd.spawn()
        .map_err(|source| KubeletError::Spawn { program, source })
}

/// Opens a namespace or root of a running process, for exec probes.
pub fn open_proc(pid: u32, what: &str) -> Result<File, KubeletError> {
    let path = format!("/proc/{pid}/{what}");
    File::open(&path).map_err(|source| KubeletError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_resolve_inside_the_container_root() {
        let lower = tempfile::tempdir().unwrap();
        let l = lower.path();
        std::fs::create_dir_all(l.join("run")).unwrap();
        std::fs::create_dir_all(l.join("usr/lib")).unwrap();
        std::os::unix::fs::symlink("/run", l.join("var-run")).unwrap();
        std::os::unix::fs::symlink("usr/lib", l.join("lib")).unwrap();
        std::os::unix::fs::symlink("../run", l.join("usr/up")).unwrap();
        std::os::unix::fs::symlink("loop", l.join("loop")).unwrap();
        let r = |p: &str| resolve_links(l, Path::new(p));
        assert_eq!(r("/var-run/secrets/x"), Path::new("/run/secrets/x"));
        assert_eq!(r("/lib/modules"), Path::new("/usr/lib/modules"));
        assert_eq!(r("/usr/up/a"), Path::new("/run/a"));
        assert_eq!(r("/plain/dir"), Path::new("/plain/dir"));
        assert_eq!(r("/a/../b/./c"), Path::new("/b/c"));
        assert_eq!(r("/loop/x"), Path::new("/loop/x"));
    }
}
