//! `localcluster nsexec --pid P --cgroup C [--tty] -- argv...`: runs a command inside a running
//! container, for `kubectl exec` (the kubelet's streaming helper, `kube kubelet-streaming`,
//! runs it with the exec stream as its standard input and output, or a pseudo-terminal).
//!
//! The command joins what the container's process `P` is in, as a CRI runtime's exec does: its
//! cgroup `C` (relative to each hierarchy's root, `localcluster/<node>/pod<uid>/<container>`),
//! its IPC, UTS, network, PID and mount namespaces, its root and its working directory, and gets
//! its environment (`/proc/P/environ`; `TERM=xterm` added with a terminal, as runtimes do). With
//! `--tty` the command leads a new session whose controlling terminal is its standard input.
//! `nsexec` stays outside as the command's parent and exits with its exit code (128 + the
//! signal if it was killed), which the helper reports to kubectl; if `nsexec` itself is killed
//! (the client went away), so is the command (`PR_SET_PDEATHSIG`).
//!
//! A process enters a PID namespace only by being forked there, so `nsexec` joins the pod's
//! PID namespace for its children (`setns(CLONE_NEWPID)` affects only processes created after
//! it) and joins the rest in the child, between fork and exec, with system calls only.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::PathBuf;

use nix::sched::CloneFlags;

use crate::kubelet::cgroup::Cgroup;

/// The arguments of `localcluster nsexec`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A process of the container (its main process), whose namespaces, root, working
    /// directory and environment the command gets.
    #[arg(long)]
    pub pid: u32,
    /// The container's cgroup relative to each hierarchy's root
    /// (`localcluster/<node>/pod<uid>/<container>`).
    #[arg(long)]
    pub cgroup: PathBuf,
    /// Standard input is a terminal: make it the command's controlling terminal (new session).
    #[arg(long)]
    pub tty: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// The namespaces joined in the child, in order (mount last: it changes the root).
const NAMESPACES: &[(&str, CloneFlags)] = &[
    ("ipc", CloneFlags::CLONE_NEWIPC),
    ("uts", CloneFlags::CLONE_NEWUTS),
    ("net", CloneFlags::CLONE_NEWNET),
    ("mnt", CloneFlags::CLONE_NEWNS),
];

/// The exit code for a command that could not be started (as shells use: 127 not found,
/// 126 otherwise).
fn start_failure(e: &std::io::Error) -> i32 {
    if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

/// `KEY=value` entries of a `/proc/<pid>/environ` text, with `TERM` added for a terminal when
/// the container has none.
pub fn environment(environ: &[u8], tty: bool) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = environ
        .split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .filter_map(|e| {
            let e = String::from_utf8_lossy(e);
            let (k, v) = e.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect();
    if tty && !env.iter().any(|(k, _)| k == "TERM") {
        env.push(("TERM".into(), "xterm".into()));
    }
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push((
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        ));
    }
    env
}

/// A namespace of `pid` that differs from ours (joining our own would be a no-op, and for the
/// mount namespace it would reset our root).
fn foreign_ns(pid: u32, name: &str) -> Result<Option<File>, String> {
    let theirs = format!("/proc/{pid}/ns/{name}");
    let ino = |p: &str| std::fs::metadata(p).map(|m| (m.dev(), m.ino()));
    let other = ino(&theirs).map_err(|e| format!("{theirs}: {e}"))?;
    if ino(&format!("/proc/self/ns/{name}")).is_ok_and(|mine| mine == other) {
        return Ok(None);
    }
    File::open(&theirs)
        .map(Some)
        .map_err(|e| format!("{theirs}: {e}"))
}

/// Runs `localcluster nsexec`; returns the process's exit code.
pub fn run(args: &Args) -> i32 {
    match prepare_and_run(args) {
        Ok(code) => code,
        Err((code, message)) => {
            eprintln!("nsexec: {message}");
            code
        }
    }
}

fn prepare_and_run(args: &Args) -> Result<i32, (i32, String)> {
    let setup = |m: String| (126, m);
    let pid = args.pid;
    let environ = std::fs::read(format!("/proc/{pid}/environ"))
        .map_err(|e| setup(format!("container process {pid}: {e}")))?;
    let env = environment(&environ, args.tty);
    let mut namespaces = Vec::new();
    for (name, flag) in NAMESPACES {
        if let Some(f) = foreign_ns(pid, name).map_err(setup)? {
            namespaces.push((f, *flag));
        }
    }
    let open = |what: &str| {
        let path = format!("/proc/{pid}/{what}");
        File::open(&path).map_err(|e| setup(format!("{path}: {e}")))
    };
    let root = open("root")?;
    let cwd = open("cwd")?;
    let cgroups = Cgroup {
        relative: args.cgroup.clone(),
    }
    .procs_files()
    .map_err(|e| {
        setup(format!(
            "{e}: {}",
            std::error::Error::source(&e).map_or(String::new(), ToString::to_string)
        ))
    })?;
    // Our children are forked into the pod's PID namespace (we stay outside, as their parent).
    if let Some(pidns) = foreign_ns(pid, "pid").map_err(setup)? {
        nix::sched::setns(pidns.as_fd(), CloneFlags::CLONE_NEWPID)
            .map_err(|e| setup(format!("joining the PID namespace of {pid}: {e}")))?;
    }
    let dot = CString::new(".").unwrap_or_default();
    let tty = args.tty;
    let mut cmd = std::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let child_setup = move || -> std::io::Result<()> {
        nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
        for f in &cgroups {
            nix::unistd::write(f.as_fd(), b"0")?;
        }
        for (ns, flag) in &namespaces {
            nix::sched::setns(ns.as_fd(), *flag)?;
        }
        nix::unistd::fchdir(root.as_fd())?;
        nix::unistd::chroot(dot.as_c_str())?;
        nix::unistd::fchdir(cwd.as_fd())?;
        if tty {
            nix::unistd::setsid()?;
            // SAFETY: TIOCSCTTY takes an integer argument (0: do not steal the terminal from
            // another session); fd 0 is the terminal the helper gave us.
            if unsafe { nix::libc::ioctl(0, nix::libc::TIOCSCTTY, 0) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    };
    // SAFETY: the closure only makes system calls (prctl, write, setns, fchdir, chroot, setsid,
    // ioctl) on files and C strings prepared before the fork; it allocates nothing and takes no
    // locks.
    unsafe {
        cmd.pre_exec(child_setup);
    }
    let mut child = cmd.spawn().map_err(|e| {
        (
            start_failure(&e),
            format!("starting {:?}: {e}", args.command[0]),
        )
    })?;
    let status = child
        .wait()
        .map_err(|e| (126, format!("waiting for {:?}: {e}", args.command[0])))?;
    Ok(status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[test]
    fn arguments_and_environment() {
        let cli = Cli::try_parse_from([
            "nsexec",
            "--pid",
            "42",
            "--cgroup",
            "localcluster/n/podu/c",
            "--tty",
            "--",
            "sh",
            "-c",
            "echo --pid",
        ])
        .unwrap();
        assert_eq!(cli.args.pid, 42);
        assert!(cli.args.tty);
        assert_eq!(cli.args.command, ["sh", "-c", "echo --pid"]);
        assert!(Cli::try_parse_from(["nsexec", "--pid", "1", "--cgroup", "c"]).is_err());

        let env = environment(b"A=1\0PATH=/x\0B=x=y\0\0", true);
        assert_eq!(
            env,
            [
                ("A".into(), "1".into()),
                ("PATH".into(), "/x".into()),
                ("B".into(), "x=y".into()),
                ("TERM".into(), "xterm".into()),
            ]
        );
        let env = environment(b"TERM=vt100\0", false);
        assert_eq!(env[0], ("TERM".into(), "vt100".into()));
        assert_eq!(env[1].0, "PATH");
    }

    #[test]
    fn start_failures_have_shell_codes() {
        assert_eq!(start_failure(&std::io::ErrorKind::NotFound.into()), 127);
        assert_eq!(
            start_failure(&std::io::ErrorKind::PermissionDenied.into()),
            126
        );
    }
}
