//! Test fixtures: a stand-in launcher pod in fresh namespaces, and throwaway cgroups.

use std::ffi::CString;
use std::fs;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::waitpid;
use nix::unistd::{ForkResult, Pid, fork, pipe};

/// What the pod writes into the tmpfs it mounts in its own mount namespace.
pub const POD_FILE_CONTENT: &[u8] = b"written inside the pod\n";

/// A process in new pid, net, mount, uts and ipc namespaces, like a launcher in its pod:
/// it mounts a tmpfs at `<dir>/podfs` (visible only in its mount namespace), writes
/// `podfs/hello` there and listens on `<dir>/launcher.sock`.
///
/// Made with fork + unshare + fork: the first child enters the new namespaces (a new pid
/// namespace applies to children only), the second is pid 1 there. Both run only
/// async-signal-safe calls on data prepared before forking. Dropping the value closes the
/// stop pipe and kills both.
#[derive(Debug)]
pub struct Pod {
    /// The pod process's pid as the host sees it.
    pub pid: i32,
    /// The first child: the pod process's parent.
    pub parent: i32,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    stop: Option<fs::File>,
    acks: fs::File,
}

impl Pod {
    pub fn spawn() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let podfs = dir.path().join("podfs");
        fs::create_dir(&podfs).unwrap();
        let socket = dir.path().join("launcher.sock");
        let podfs_c = CString::new(podfs.as_os_str().as_bytes()).unwrap();
        let hello_c = CString::new(podfs.join("hello").as_os_str().as_bytes()).unwrap();
        // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::sa_family_t::try_from(libc::AF_UNIX).unwrap();
        for (d, s) in addr.sun_path.iter_mut().zip(socket.as_os_str().as_bytes()) {
            *d = libc::c_char::from_ne_bytes([*s]);
        }
        let (pid_r, pid_w) = pipe().unwrap();
        let (ready_r, ready_w) = pipe().unwrap();
        let (stop_r, stop_w) = pipe().unwrap();
        let raw = Raw {
            pid_w: pid_w.as_raw_fd(),
            ready_w: ready_w.as_raw_fd(),
            stop_r: stop_r.as_raw_fd(),
            stop_w: stop_w.as_raw_fd(),
            podfs: podfs_c.as_ptr(),
            hello: hello_c.as_ptr(),
            addr,
        };
        // SAFETY: the children only call async-signal-safe functions on `raw`, which was
        // built before the fork.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => first_child(&raw),
            ForkResult::Parent { child } => {
                drop((pid_w, ready_w, stop_r));
                let mut pid_bytes = [0u8; 4];
                let mut ready = [0u8; 1];
                let mut pid_r = fs::File::from(pid_r);
                let mut ready_r = fs::File::from(ready_r);
                let spawned = pid_r
                    .read_exact(&mut pid_bytes)
                    .and_then(|()| ready_r.read_exact(&mut ready));
                let pod = Self {
                    pid: i32::from_ne_bytes(pid_bytes),
                    parent: child.as_raw(),
                    dir,
                    socket,
                    stop: Some(fs::File::from(stop_w)),
                    acks: ready_r,
                };
                spawned.unwrap_or_else(|e| panic!("the pod did not start: {e}"));
                pod
            }
        }
    }
}

impl Pod {
    /// Makes the pod process move to yet another network namespace, as a process may do
    /// after it was detected.
    pub fn unshare_net(&mut self) {
        std::io::Write::write_all(self.stop.as_mut().unwrap(), b"u").unwrap();
        let mut ack = [0u8; 1];
        self.acks.read_exact(&mut ack).unwrap();
        assert_eq!(ack[0], 1, "unshare failed in the pod");
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.stop.take();
        if self.pid > 0 {
            let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
        }
        let _ = kill(Pid::from_raw(self.parent), Signal::SIGKILL);
        let _ = waitpid(Pid::from_raw(self.parent), None);
    }
}

struct Raw {
    pid_w: i32,
    ready_w: i32,
    stop_r: i32,
    stop_w: i32,
    podfs: *const libc::c_char,
    hello: *const libc::c_char,
    addr: libc::sockaddr_un,
}

fn first_child(raw: &Raw) -> ! {
    // SAFETY: async-signal-safe syscalls only, on data prepared before the fork.
    unsafe {
        libc::close(raw.stop_w);
        let flags = libc::CLONE_NEWPID
            | libc::CLONE_NEWNET
            | libc::CLONE_NEWNS
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWIPC;
        if libc::unshare(flags) != 0 {
            libc::_exit(1);
        }
        let pid = libc::fork();
        if pid == 0 {
            pod_main(raw);
        }
        libc::write(raw.pid_w, (&raw const pid).cast(), 4);
        let mut status = 0;
        libc::waitpid(pid, &raw mut status, 0);
        libc::_exit(0);
    }
}

fn pod_main(raw: &Raw) -> ! {
    // SAFETY: async-signal-safe syscalls only, on data prepared before the fork.
    unsafe {
        // Keep our mounts from propagating back to the host.
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            libc::_exit(2);
        }
        if libc::mount(
            c"tmpfs".as_ptr(),
            raw.podfs,
            c"tmpfs".as_ptr(),
            0,
            std::ptr::null(),
        ) != 0
        {
            libc::_exit(3);
        }
        let fd = libc::open(raw.hello, libc::O_CREAT | libc::O_WRONLY, 0o644);
        if fd < 0 {
            libc::_exit(4);
        }
        libc::write(fd, POD_FILE_CONTENT.as_ptr().cast(), POD_FILE_CONTENT.len());
        libc::close(fd);
        let sock = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
        let len = libc::socklen_t::try_from(size_of::<libc::sockaddr_un>()).unwrap_or(0);
        if sock < 0
            || libc::bind(sock, (&raw const raw.addr).cast(), len) != 0
            || libc::listen(sock, 64) != 0
        {
            libc::_exit(5);
        }
        let one = 1u8;
        libc::write(raw.ready_w, (&raw const one).cast(), 1);
        let mut b = 0u8;
        // Commands until EOF: the test dropped its end.
        while libc::read(raw.stop_r, (&raw mut b).cast(), 1) == 1 {
            let ok = u8::from(b == b'u' && libc::unshare(libc::CLONE_NEWNET) == 0);
            libc::write(raw.ready_w, (&raw const ok).cast(), 1);
        }
        libc::_exit(0);
    }
}

/// A cgroup directory made for one test, removed on drop after its tasks go back to the
/// hierarchy root.
#[derive(Debug)]
pub struct TestCgroup {
    pub path: PathBuf,
    /// Path as `/proc/<pid>/cgroup` shows it.
    pub name: PathBuf,
    root: PathBuf,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl TestCgroup {
    /// `/<unique>/<sub>` under the hierarchy mounted at `root`.
    pub fn new(root: &str, sub: &str) -> Self {
        let top = format!(
            "kvrs-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let name = Path::new("/").join(top).join(sub);
        let path = Path::new(root).join(name.strip_prefix("/").unwrap());
        fs::create_dir_all(&path).unwrap();
        Self {
            path,
            name,
            root: root.into(),
        }
    }

    pub fn add_process(&self, pid: i32) {
        fs::write(self.path.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", self.path.display()));
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let top = self.root.join(self.name.iter().nth(1).unwrap());
        let mut dirs = vec![self.path.clone()];
        let mut d = self.path.clone();
        while d != top {
            d = d.parent().unwrap().to_owned();
            dirs.push(d.clone());
        }
        for dir in dirs {
            if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
                for id in text.lines() {
                    let _ = fs::write(self.root.join("cgroup.procs"), id);
                }
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while fs::remove_dir(&dir).is_err() && dir.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        assert!(
            !top.exists() || std::thread::panicking(),
            "test cgroup {} could not be removed",
            top.display()
        );
    }
}

/// A socket whose listener has exited while a child of it still holds the listening socket
/// open: connections succeed, and the kernel names the dead listener as the peer.
#[derive(Debug)]
pub struct OrphanedSocket {
    _dir: tempfile::TempDir,
    pub socket: PathBuf,
    /// The process that called listen(2), now gone.
    pub listener: i32,
    holder: i32,
    _stop: fs::File,
}

impl OrphanedSocket {
    pub fn spawn() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("orphan.sock");
        // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::sa_family_t::try_from(libc::AF_UNIX).unwrap();
        for (d, s) in addr.sun_path.iter_mut().zip(socket.as_os_str().as_bytes()) {
            *d = libc::c_char::from_ne_bytes([*s]);
        }
        let (ready_r, ready_w) = pipe().unwrap();
        let (stop_r, stop_w) = pipe().unwrap();
        let (ready_w_raw, stop_r_raw, stop_w_raw) =
            (ready_w.as_raw_fd(), stop_r.as_raw_fd(), stop_w.as_raw_fd());
        // SAFETY: the children only call async-signal-safe functions on data prepared
        // before the fork.
        match unsafe { fork() }.unwrap() {
            // SAFETY: as above: raw syscalls on descriptors and memory set up before.
            ForkResult::Child => unsafe {
                libc::close(stop_w_raw);
                let sock = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let len = libc::socklen_t::try_from(size_of::<libc::sockaddr_un>()).unwrap_or(0);
                if sock < 0
                    || libc::bind(sock, (&raw const addr).cast(), len) != 0
                    || libc::listen(sock, 8) != 0
                {
                    libc::_exit(1);
                }
                if libc::fork() == 0 {
                    let pid = libc::getpid();
                    libc::write(ready_w_raw, (&raw const pid).cast(), 4);
                    let mut b = 0u8;
                    libc::read(stop_r_raw, (&raw mut b).cast(), 1);
                    libc::_exit(0);
                }
                libc::_exit(0);
            },
            ForkResult::Parent { child } => {
                waitpid(child, None).unwrap();
                drop((ready_w, stop_r));
                let mut pid = [0u8; 4];
                fs::File::from(ready_r).read_exact(&mut pid).unwrap();
                Self {
                    _dir: dir,
                    socket,
                    listener: child.as_raw(),
                    holder: i32::from_ne_bytes(pid),
                    _stop: fs::File::from(stop_w),
                }
            }
        }
    }
}

impl Drop for OrphanedSocket {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.holder), Signal::SIGKILL);
    }
}
