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

/// The entry at `path` (relative to the image root) as the container sees it: from the
/// topmost of `lowers` (the image's unpacked layers, top first) that has it.
fn lookup(lowers: &[PathBuf], path: &Path) -> Option<PathBuf> {
    lowers
        .iter()
        .map(|l| l.join(path))
        .find(|p| std::fs::symlink_metadata(p).is_ok())
}

/// `path` inside a container whose root stacks `lowers` (top first), with the symlinks along
/// it resolved against that root rather than the host's: Debian's `/var/run -> /run` makes
/// `/var/run/secrets` `/run/secrets`. Mount targets are reached from outside the new root,
/// where an absolute link would lead into the host's own directories (and the mount would be
/// invisible in the container). Loops stop after 40 links, like the kernel's.
pub fn resolve_links(lowers: &[PathBuf], path: &Path) -> PathBuf {
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
        let inside = candidate.strip_prefix("/").unwrap_or(&candidate);
        match lookup(lowers, inside).map(std::fs::read_link) {
            Some(Ok(link)) if links < 40 => {
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
    /// The image's layers, top first: what the root shows before anything is mounted on it.
    pub lowers: Vec<PathBuf>,
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
        let target = &resolve_links(&self.lowers, target);
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
    /// The pod's PID namespace (its pause process's); `None` shares the kubelet's. A process
    /// only enters a PID namespace by being forked there, so the child forks once more after
    /// `setns`: the grandchild becomes the container and the child stays behind as its waiter
    /// (see [`Spawned`]).
    pub pidns: Option<File>,
    /// A new mount namespace built by this plan; `None` shares the kubelet's.
    pub root: Option<RootPlan>,
    pub stdin: Stdio,
    pub stdout: Stdio,
    pub stderr: Stdio,
}

/// A started process.
#[derive(Debug)]
pub struct Spawned {
    /// What to wait on: the process itself, or, in a pod PID namespace, its waiter, which ends
    /// the way the process does (its exit code, or the same signal).
    pub child: tokio::process::Child,
    /// The process's pid (in the kubelet's PID namespace): what to signal and whose
    /// namespaces probes enter.
    pub pid: u32,
}

/// Reads the pid the forked child reported through `read` (its write end closed here first,
/// so a child that died early gives EOF instead of a hang).
fn reported_pid(read: std::os::fd::OwnedFd, write: std::os::fd::OwnedFd) -> std::io::Result<u32> {
    use std::io::Read as _;
    drop(write);
    let mut buf = [0u8; 4];
    File::from(read).read_exact(&mut buf)?;
    Ok(u32::from_ne_bytes(buf))
}

/// Closes every file descriptor of a process that will never `exec`: the standard library's
/// exec-error pipe among them, whose parent reads until every copy is closed.
fn close_all_fds() {
    // SAFETY: close_range(2) only closes descriptors of this (forked, single-threaded)
    // process; nothing here uses them afterwards.
    unsafe {
        nix::libc::close_range(0, u32::MAX, 0);
    }
}

/// Ends a forked process that never execs, running none of the parent's exit handlers.
fn exit_now(code: i32) -> ! {
    // SAFETY: _exit(2) ends this process at once; nothing of it is used afterwards.
    unsafe { nix::libc::_exit(code) }
}

/// In a forked waiter: waits for `child` and ends as it ended, so the kubelet (which waits on
/// the waiter) sees the container's exit code or signal.
fn wait_and_mirror(child: nix::unistd::Pid) -> ! {
    use nix::sys::signal::{SigHandler, Signal, signal};
    use nix::sys::wait::{WaitStatus, waitpid};
    for s in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        // SAFETY: SIG_IGN installs no handler code. Signals meant for the container go to its
        // own pid; a stray one must not end the waiter and orphan the container's status.
        let _ = unsafe { signal(s, SigHandler::SigIgn) };
    }
    loop {
        match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, code)) => exit_now(code),
            Ok(WaitStatus::Signaled(_, sig, _)) => {
                // No core file from the waiter for a container's core-dumping signal.
                let _ =
                    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0);
                // SAFETY: restores the default action, which installs no handler code.
                let _ = unsafe { signal(sig, SigHandler::SigDfl) };
                let _ = nix::sys::signal::raise(sig);
                exit_now(128 + sig as i32)
            }
            Err(nix::errno::Errno::EINTR) | Ok(_) => {}
            Err(_) => exit_now(255),
        }
    }
}

/// Starts a pod's pause process: PID 1 of a new PID namespace, in `cgroups`, reaping the
/// orphans of the pod's containers as the pause container does, until it is killed. It is a
/// fork of the kubelet that never execs (the reaping loop is a few system calls), so no pause
/// binary has to exist on the node. As for containers, the child that made the namespace
/// stays behind (outside the cgroups) as the pause's waiter, so the pause is reaped the
/// moment it is killed; the caller waits on [`Spawned::child`].
pub fn spawn_pause(cgroups: Vec<File>) -> Result<Spawned, KubeletError> {
    use std::os::fd::AsRawFd as _;
    let io = |source| KubeletError::Io {
        path: "pause process".into(),
        source,
    };
    let (read, write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| io(e.into()))?;
    let write_fd = write.as_raw_fd();
    // Never executed: both sides of the fork below end inside the closure.
    let mut cmd = tokio::process::Command::new("/proc/self/exe");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(false);
    let run = move || -> std::io::Result<()> {
        nix::unistd::setsid()?;
        nix::sched::unshare(CloneFlags::CLONE_NEWPID)?;
        // SAFETY: this forked child is single-threaded; both sides below only make system
        // calls until they exit.
        match unsafe { nix::unistd::fork() }? {
            nix::unistd::ForkResult::Parent { child } => {
                // SAFETY: `write_fd` is the pipe's write end, open in this process.
                let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(write_fd) };
                let _ = nix::unistd::write(fd, &child.as_raw().to_ne_bytes());
                close_all_fds();
                wait_and_mirror(child)
            }
            nix::unistd::ForkResult::Child => {
                for f in &cgroups {
                    if nix::unistd::write(f.as_fd(), b"0").is_err() {
                        exit_now(1);
                    }
                }
                close_all_fds();
                loop {
                    if let Err(nix::errno::Errno::ECHILD) =
                        nix::sys::wait::waitpid(None::<nix::unistd::Pid>, None)
                    {
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                }
            }
        }
    };
    // SAFETY: the closure only makes system calls (write, setsid, unshare, fork, waitpid,
    // close_range, nanosleep, _exit) on descriptors prepared before the fork; it allocates
    // nothing and takes no locks.
    unsafe {
        cmd.pre_exec(run);
    }
    let child = cmd.spawn().map_err(io)?;
    let pid = reported_pid(read, write).map_err(io)?;
    Ok(Spawned { child, pid })
}

/// Spawns the process; it is in its cgroups, namespaces and root before `exec`.
pub fn spawn(launch: Launch) -> Result<Spawned, KubeletError> {
    use std::os::fd::AsRawFd as _;
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
    let pidns = launch.pidns;
    let report = if pidns.is_some() {
        Some(
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| KubeletError::Spawn {
                program: program.clone(),
                source: e.into(),
            })?,
        )
    } else {
        None
    };
    let report_fd = report.as_ref().map(|(_, w)| w.as_raw_fd());
    let run = move || -> std::io::Result<()> {
        if let (Some(ns), Some(report_fd)) = (&pidns, report_fd) {
            nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWPID)?;
            // SAFETY: this forked child is single-threaded; the waiter below only makes
            // system calls until it exits, the grandchild carries on to exec.
            if let nix::unistd::ForkResult::Parent { child } = unsafe { nix::unistd::fork() }? {
                // SAFETY: `report_fd` is the pipe's write end, open in this process.
                let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(report_fd) };
                let _ = nix::unistd::write(fd, &child.as_raw().to_ne_bytes());
                close_all_fds();
                // Out of the terminal's process group, as the container will be.
                let _ = nix::unistd::setsid();
                wait_and_mirror(child);
            }
        }
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
    // SAFETY: the closure only makes system calls (write, setns, fork, waitpid, unshare,
    // sethostname, mount, mkdir, open, chdir, pivot_root, umount2, setsid, close_range, _exit)
    // on files and C strings prepared before the fork; it allocates nothing and takes no
    // locks, so it is safe between fork and exec.
    unsafe {
        cmd.pre_exec(run);
    }
    let child = cmd.spawn().map_err(|source| KubeletError::Spawn {
        program: program.clone(),
        source,
    })?;
    let pid = match report {
        Some((read, write)) => {
            reported_pid(read, write).map_err(|source| KubeletError::Spawn { program, source })?
        }
        None => child.id().unwrap_or_default(),
    };
    Ok(Spawned { child, pid })
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
        // A layer above shadows a lower one's entry: here `lib` is a plain directory.
        let upper = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(upper.path().join("opt/lib")).unwrap();
        std::os::unix::fs::symlink("/run", upper.path().join("opt/run")).unwrap();
        std::fs::create_dir_all(l.join("opt")).unwrap();
        std::os::unix::fs::symlink("/usr", l.join("opt/lib")).unwrap();
        let lowers = [upper.path().to_path_buf(), l.to_path_buf()];
        let r = |p: &str| resolve_links(&lowers, Path::new(p));
        assert_eq!(r("/opt/lib/x"), Path::new("/opt/lib/x"));
        assert_eq!(r("/opt/run/x"), Path::new("/run/x"));
        assert_eq!(r("/var-run/secrets/x"), Path::new("/run/secrets/x"));
        assert_eq!(r("/lib/modules"), Path::new("/usr/lib/modules"));
        assert_eq!(r("/usr/up/a"), Path::new("/run/a"));
        assert_eq!(r("/plain/dir"), Path::new("/plain/dir"));
        assert_eq!(r("/a/../b/./c"), Path::new("/b/c"));
        assert_eq!(r("/loop/x"), Path::new("/loop/x"));
    }
}
