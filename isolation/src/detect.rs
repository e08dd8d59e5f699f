//! Finding a pod from its launcher's socket or a pid, and entering its namespaces.

use std::fmt;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cgroups::ProcessCgroups;
use nix::errno::Errno;
use nix::fcntl::{OFlag, openat, readlinkat};
use nix::sched::{CloneFlags, setns, unshare};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use nix::sys::stat::Mode;
use tracing::debug;

use crate::error::{IsolationError, Result};
use crate::safepath::{MountRoot, SafePath};

/// A kind of Linux namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NsKind {
    Pid,
    Net,
    Mnt,
    Uts,
    Ipc,
}

impl NsKind {
    /// The file name under `/proc/<pid>/ns/`.
    pub fn file_name(self) -> &'static str {
        match self {
            Self::Pid => "pid",
            Self::Net => "net",
            Self::Mnt => "mnt",
            Self::Uts => "uts",
            Self::Ipc => "ipc",
        }
    }

    fn clone_flag(self) -> CloneFlags {
        match self {
            Self::Pid => CloneFlags::CLONE_NEWPID,
            Self::Net => CloneFlags::CLONE_NEWNET,
            Self::Mnt => CloneFlags::CLONE_NEWNS,
            Self::Uts => CloneFlags::CLONE_NEWUTS,
            Self::Ipc => CloneFlags::CLONE_NEWIPC,
        }
    }
}

impl fmt::Display for NsKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.file_name())
    }
}

/// One namespace of a process: its identity (the nsfs inode, equal for every process
/// sharing the namespace) and the path it was found at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    pub kind: NsKind,
    pub inode: u64,
    pub path: PathBuf,
}

/// The namespaces detection reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespaces {
    pub pid: Namespace,
    pub net: Namespace,
    pub mnt: Namespace,
    pub uts: Namespace,
    pub ipc: Namespace,
}

impl Namespaces {
    pub fn get(&self, kind: NsKind) -> &Namespace {
        match kind {
            NsKind::Pid => &self.pid,
            NsKind::Net => &self.net,
            NsKind::Mnt => &self.mnt,
            NsKind::Uts => &self.uts,
            NsKind::Ipc => &self.ipc,
        }
    }
}

/// A process pinned by a descriptor of its `/proc/<pid>` directory. Everything read through
/// it belongs to that very process: once it is gone, reads fail instead of reaching a new
/// process that was handed the same pid.
#[derive(Debug, Clone)]
pub struct Process {
    pid: i32,
    dir: Arc<OwnedFd>,
}

impl Process {
    pub fn open(pid: i32) -> Result<Self> {
        let path = PathBuf::from(format!("/proc/{pid}"));
        let dir = nix::fcntl::open(
            &path,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::ENOENT | Errno::ESRCH => IsolationError::PidGone { pid },
            e => IsolationError::Proc {
                path,
                source: e.into(),
            },
        })?;
        Ok(Self {
            pid,
            dir: Arc::new(dir),
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    fn proc_path(&self, rel: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/{rel}", self.pid))
    }

    /// Maps the errors a vanished process produces to [`IsolationError::PidGone`].
    fn gone_or(&self, e: Errno, other: impl FnOnce(io::Error) -> IsolationError) -> IsolationError {
        match e {
            Errno::ENOENT | Errno::ESRCH => IsolationError::PidGone { pid: self.pid },
            e => other(e.into()),
        }
    }

    fn read(&self, rel: &str) -> Result<String> {
        let fd = openat(
            self.dir.as_fd(),
            rel,
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            self.gone_or(e, |source| IsolationError::Proc {
                path: self.proc_path(rel),
                source,
            })
        })?;
        let mut text = String::new();
        std::fs::File::from(fd)
            .read_to_string(&mut text)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ESRCH) => IsolationError::PidGone { pid: self.pid },
                _ => IsolationError::Proc {
                    path: self.proc_path(rel),
                    source: e,
                },
            })?;
        Ok(text)
    }

    /// The parent pid, or `PidGone` for a zombie: it has released its namespaces and
    /// root, so there is nothing left to act on.
    fn ppid_if_alive(&self) -> Result<i32> {
        let text = self.read("stat")?;
        let stat = parse_stat(&text).ok_or_else(|| IsolationError::Parse {
            path: self.proc_path("stat"),
            message: format!("unexpected format: {text:?}"),
        })?;
        if matches!(stat.state, 'Z' | 'X' | 'x') {
            return Err(IsolationError::PidGone { pid: self.pid });
        }
        Ok(stat.ppid)
    }

    pub fn namespace(&self, kind: NsKind) -> Result<Namespace> {
        let rel = format!("ns/{kind}");
        let target = readlinkat(self.dir.as_fd(), rel.as_str()).map_err(|e| {
            self.gone_or(e, |source| IsolationError::NamespaceInaccessible {
                pid: self.pid,
                kind,
                source,
            })
        })?;
        let inode =
            parse_ns_link(&target.to_string_lossy()).ok_or_else(|| IsolationError::Parse {
                path: self.proc_path(&rel),
                message: format!("unexpected namespace link {}", target.display()),
            })?;
        Ok(Namespace {
            kind,
            inode,
            path: self.proc_path(&rel),
        })
    }

    /// A descriptor of the namespace, for setns(2).
    pub fn namespace_fd(&self, kind: NsKind) -> Result<OwnedFd> {
        openat(
            self.dir.as_fd(),
            format!("ns/{kind}").as_str(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            self.gone_or(e, |source| IsolationError::NamespaceInaccessible {
                pid: self.pid,
                kind,
                source,
            })
        })
    }

    /// The process's root directory (`/proc/<pid>/root`), as a root for safe resolution.
    pub fn mount_root(&self) -> Result<MountRoot> {
        let fd = openat(
            self.dir.as_fd(),
            "root",
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            self.gone_or(e, |source| IsolationError::NamespaceInaccessible {
                pid: self.pid,
                kind: NsKind::Mnt,
                source,
            })
        })?;
        Ok(MountRoot::from_fd(fd, self.proc_path("root")))
    }

    /// Detects everything at once. The process is checked again at the end, so one that
    /// exits half-way is reported as gone, never as a half-filled result.
    pub fn detect(&self) -> Result<PodIsolation> {
        let ppid = self.ppid_if_alive()?;
        let namespaces = Namespaces {
            pid: self.namespace(NsKind::Pid)?,
            net: self.namespace(NsKind::Net)?,
            mnt: self.namespace(NsKind::Mnt)?,
            uts: self.namespace(NsKind::Uts)?,
            ipc: self.namespace(NsKind::Ipc)?,
        };
        // Reading the link proves access (ptrace rules) and that the root still exists.
        readlinkat(self.dir.as_fd(), "root").map_err(|e| {
            self.gone_or(e, |source| IsolationError::NamespaceInaccessible {
                pid: self.pid,
                kind: NsKind::Mnt,
                source,
            })
        })?;
        let cgroups = ProcessCgroups::parse(&self.read("cgroup")?, &self.proc_path("cgroup"))
            .map_err(|source| IsolationError::Cgroups {
                pid: self.pid,
                source,
            })?;
        self.ppid_if_alive()?;
        let pod_cgroup = pod_cgroup_of(&cgroups);
        Ok(PodIsolation {
            pid: self.pid,
            ppid,
            namespaces,
            mount_root: self.proc_path("root"),
            cgroups,
            pod_cgroup,
            process: self.clone(),
        })
    }
}

/// The pod-level cgroup: from the cgroup2 path when the process is in a pod there,
/// otherwise from the first v1 hierarchy that places it in one.
fn pod_cgroup_of(cgroups: &ProcessCgroups) -> Option<PathBuf> {
    cgroups
        .unified
        .iter()
        .chain(cgroups.v1.values())
        .find_map(|p| cgroups::pod_cgroup(p))
        .map(Path::to_owned)
}

/// What detection found out about a pod's process.
#[derive(Debug, Clone)]
pub struct PodIsolation {
    pub pid: i32,
    pub ppid: i32,
    pub namespaces: Namespaces,
    /// `/proc/<pid>/root`: the process's `/` as seen from here. Use
    /// [`PodIsolation::open_mount_root`] to resolve paths under it safely.
    pub mount_root: PathBuf,
    pub cgroups: ProcessCgroups,
    /// The pod-level parent cgroup (`.../pod<uid>`), if the process is in a pod.
    pub pod_cgroup: Option<PathBuf>,
    process: Process,
}

impl PodIsolation {
    pub fn process(&self) -> &Process {
        &self.process
    }

    pub fn open_mount_root(&self) -> Result<MountRoot> {
        self.process.mount_root()
    }

    /// Runs `f` inside one of the pod's namespaces and returns what it returns. The
    /// namespace must still be the one detected ([`IsolationError::NamespaceChanged`]).
    ///
    /// setns(2) changes only the calling thread, and a thread that has entered a pod's
    /// namespace must never run anything else afterwards: a tokio worker or a pooled thread
    /// would carry the pod's network or filesystem view into unrelated work. So `f` runs on
    /// a new OS thread that ends with it. For the mount namespace the thread first stops
    /// sharing its filesystem attributes (root, cwd) with the rest of the process, which the
    /// kernel requires before a multithreaded process may switch mount namespace. Async
    /// callers can call this from `spawn_blocking`: that pooled thread only waits.
    pub fn run_in_namespace<T, F>(&self, kind: NsKind, f: F) -> Result<T>
    where
        F: FnOnce() -> T + Send,
        T: Send,
    {
        let ns = self.process.namespace_fd(kind)?;
        let pid = self.pid;
        let detected = self.namespaces.get(kind).inode;
        let current = nix::sys::stat::fstat(&ns)
            .map_err(|e| IsolationError::NamespaceInaccessible {
                pid,
                kind,
                source: e.into(),
            })?
            .st_ino;
        if current != detected {
            return Err(IsolationError::NamespaceChanged {
                pid,
                kind,
                detected,
                current,
            });
        }
        std::thread::scope(|scope| {
            let handle = std::thread::Builder::new()
                .name(format!("ns-{kind}-{pid}"))
                .spawn_scoped(scope, move || -> Result<T> {
                    let inaccessible = |e: Errno| IsolationError::NamespaceInaccessible {
                        pid,
                        kind,
                        source: e.into(),
                    };
                    if kind == NsKind::Mnt {
                        unshare(CloneFlags::CLONE_FS).map_err(inaccessible)?;
                    }
                    setns(&ns, kind.clone_flag()).map_err(inaccessible)?;
                    drop(ns);
                    debug!(pid, %kind, "entered namespace");
                    Ok(f())
                })
                .map_err(|source| IsolationError::Spawn { pid, kind, source })?;
            handle.join().map_err(|panic| IsolationError::Panicked {
                pid,
                kind,
                message: panic
                    .downcast_ref::<&str>()
                    .map(ToString::to_string)
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default(),
            })?
        })
    }
}

/// Detects the process `pid`.
pub fn detect_from_pid(pid: i32) -> Result<PodIsolation> {
    Process::open(pid)?.detect()
}

/// Detects the process listening on the unix socket `socket` (the launcher's command
/// socket): the kernel records the listener's credentials, so SO_PEERCRED names the
/// process, translated into our pid namespace. The socket's name is the pod's: it is resolved
/// as [`crate::open_socket`] does, so a pod cannot pass another process off as its own.
pub fn detect_from_socket(socket: &Path) -> Result<PodIsolation> {
    detect_from_resolved_socket(&crate::open_socket(socket)?)
}

/// The same for a socket already resolved (inside a pod's root, say), reached through its
/// descriptor's `/proc/self/fd` name: exactly the socket resolved, whatever its path holds now.
pub fn detect_from_resolved_socket(resolved: &SafePath) -> Result<PodIsolation> {
    let path = resolved.path();
    let socket = &resolved.root().join(path.strip_prefix("/").unwrap_or(path));
    let stream = UnixStream::connect(resolved.proc_fd_path()).map_err(|source| {
        if source.raw_os_error() == Some(libc::ECONNREFUSED) {
            IsolationError::NoPeer {
                socket: socket.to_owned(),
            }
        } else {
            IsolationError::Connect {
                socket: socket.to_owned(),
                source,
            }
        }
    })?;
    let cred = getsockopt(&stream, PeerCredentials).map_err(|e| IsolationError::Connect {
        socket: socket.to_owned(),
        source: e.into(),
    })?;
    // pid 0: the peer lives in a pid namespace we cannot see, or there is none.
    if cred.pid() <= 0 {
        return Err(IsolationError::NoPeer {
            socket: socket.to_owned(),
        });
    }
    let pid = cred.pid();
    let peer = peer_pidfd(&stream);
    let process = Process::open(pid)?;
    // The pidfd names the listener itself; if it is still alive after /proc/<pid> was
    // opened, that directory cannot belong to a successor that reused the pid.
    if let Some(pidfd) = peer
        && !pidfd_alive(&pidfd)
    {
        return Err(IsolationError::PidGone { pid });
    }
    debug!(socket = %socket.display(), pid, "peer found");
    process.detect()
}

/// SO_PEERPIDFD (Linux 6.5): a pidfd for the peer. Not in the libc crate yet; the value
/// is asm-generic's, which x86 and arm use.
const SO_PEERPIDFD: libc::c_int = 77;

fn peer_pidfd(stream: &UnixStream) -> Option<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = libc::socklen_t::try_from(size_of::<libc::c_int>()).ok()?;
    // SAFETY: `fd` and `len` are valid for writes of the sizes passed.
    let ret = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&raw mut fd).cast(),
            &raw mut len,
        )
    };
    // SAFETY: on success the kernel installed a new descriptor that nothing else owns.
    (ret == 0 && fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

fn pidfd_alive(pidfd: &OwnedFd) -> bool {
    // SAFETY: signal 0 only checks that the process exists; all pointers are null.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    ret == 0
}

struct Stat {
    state: char,
    ppid: i32,
}

/// `/proc/<pid>/stat`: "pid (comm) state ppid ..."; comm may itself contain ") ".
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some(Stat { state, ppid })
}

/// "net:[4026531840]" -> 4026531840.
fn parse_ns_link(link: &str) -> Option<u64> {
    link.split_once(":[")?.1.strip_suffix(']')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_awkward_comm() {
        let s = parse_stat("42 (a) b) (c) S 7 42 42 0 -1").unwrap();
        assert_eq!((s.state, s.ppid), ('S', 7));
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S notanumber").is_none());
    }

    #[test]
    fn namespace_links() {
        assert_eq!(parse_ns_link("net:[4026531840]"), Some(4_026_531_840));
        assert_eq!(parse_ns_link("net:4026531840"), None);
        assert_eq!(parse_ns_link("mnt:[x]"), None);
    }

    #[test]
    fn pod_cgroup_prefers_cgroup2() {
        let cgroups = ProcessCgroups::parse(
            "5:devices:/kubepods/podA/c\n0::/kubepods/podB/c\n",
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(
            pod_cgroup_of(&cgroups),
            Some(PathBuf::from("/kubepods/podB"))
        );
        let cgroups =
            ProcessCgroups::parse("5:devices:/kubepods/podA/c\n0::/\n", Path::new("x")).unwrap();
        assert_eq!(
            pod_cgroup_of(&cgroups),
            Some(PathBuf::from("/kubepods/podA"))
        );
    }
}
