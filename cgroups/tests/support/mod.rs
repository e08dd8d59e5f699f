//! Test fixtures: throwaway cgroups and a child process that opens devices on command.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::waitpid;
use nix::unistd::{ForkResult, Pid, fork, pipe};

/// A cgroup directory made for one test; on drop its tasks go back to the hierarchy root and
/// the directory is removed, whatever the test did.
#[derive(Debug)]
pub struct TestCgroup {
    pub path: PathBuf,
    root: PathBuf,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl TestCgroup {
    /// A fresh child of the hierarchy mounted at `root`, with a name no other test uses.
    pub fn new(root: &str) -> Self {
        let name = format!(
            "kvrs-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = Path::new(root).join(name);
        fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Self {
            path,
            root: root.into(),
        }
    }

    /// A v1 cpuset child can hold no task until it has CPUs and memory nodes.
    pub fn new_cpuset() -> Self {
        let cg = Self::new("/sys/fs/cgroup/cpuset");
        for file in ["cpuset.mems", "cpuset.cpus"] {
            let value = fs::read_to_string(Path::new("/sys/fs/cgroup/cpuset").join(file)).unwrap();
            fs::write(cg.path.join(file), value.trim()).unwrap();
        }
        cg
    }

    pub fn add_process(&self, pid: i32) {
        fs::write(self.path.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", self.path.display()));
    }

    fn empty_into_root(dir: &Path, root: &Path) {
        if let Ok(entries) = fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    Self::empty_into_root(&e.path(), root);
                }
            }
        }
        // v1 lists threads in "tasks", cgroup2 in "cgroup.threads" (absent for domain
        // cgroups without threaded children, where "cgroup.procs" does).
        for list in ["tasks", "cgroup.threads", "cgroup.procs"] {
            let dest = root.join(if list == "tasks" {
                "tasks"
            } else {
                "cgroup.procs"
            });
            if let Ok(text) = fs::read_to_string(dir.join(list)) {
                for id in text.lines() {
                    let _ = fs::write(&dest, id);
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while fs::remove_dir(dir).is_err() && dir.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        Self::empty_into_root(&self.path, &self.root);
        assert!(
            !self.path.exists() || std::thread::panicking(),
            "test cgroup {} could not be removed",
            self.path.display()
        );
    }
}

/// A forked child that opens `/dev/null` (c 1:3) or `/dev/zero` (c 1:5) when told to and
/// reports the errno. It runs only async-signal-safe libc calls, as a child forked from a
/// multithreaded process must.
#[derive(Debug)]
pub struct Probe {
    pub pid: i32,
    cmd: fs::File,
    reply: fs::File,
    /// Shared with the child: opens tried, opens refused with EPERM, stop flag.
    shared: &'static [AtomicU64; 3],
}

#[derive(Debug, Clone, Copy)]
pub enum Dev {
    Null,
    Zero,
}

impl Probe {
    pub fn spawn() -> Self {
        let node = std::ffi::CString::new(format!(
            "/tmp/kvrs-probe-node-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ))
        .unwrap();
        let (cmd_r, cmd_w) = pipe().unwrap();
        let (reply_r, reply_w) = pipe().unwrap();
        // SAFETY: a fresh anonymous shared mapping of one page; nothing else uses it.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED, "mmap");
        // SAFETY: the page is zeroed, aligned and lives until the process exits (it is
        // never unmapped: the leak of one page per probe is the price of a 'static view).
        let shared: &'static [AtomicU64; 3] = unsafe { &*page.cast::<[AtomicU64; 3]>() };
        // SAFETY: the child only calls async-signal-safe functions (read, write, open,
        // close, _exit) and atomics on memory prepared before the fork.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => child(cmd_r.as_raw_fd(), reply_w.as_raw_fd(), shared, &node),
            ForkResult::Parent { child } => {
                drop((cmd_r, reply_w));
                Self {
                    pid: child.as_raw(),
                    cmd: fs::File::from(cmd_w),
                    reply: fs::File::from(reply_r),
                    shared,
                }
            }
        }
    }

    /// The errno of opening the device read-only (0: it opened).
    pub fn open(&mut self, dev: Dev) -> i32 {
        self.ask(match dev {
            Dev::Null => b'n',
            Dev::Zero => b'z',
        })
    }

    /// The errno of opening `/dev/null` write-only.
    pub fn open_null_for_writing(&mut self) -> i32 {
        self.ask(b'w')
    }

    /// The errno of creating a device node for /dev/null's numbers (c 1:3); a node made is
    /// removed again at once.
    pub fn mknod_null(&mut self) -> i32 {
        self.ask(b'k')
    }

    fn ask(&mut self, command: u8) -> i32 {
        self.cmd.write_all(&[command]).unwrap();
        let mut buf = [0u8; 4];
        self.reply.read_exact(&mut buf).unwrap();
        i32::from_ne_bytes(buf)
    }

    /// Starts opening `/dev/null` as fast as possible until [`Probe::stop_loop`].
    pub fn start_loop(&mut self) {
        self.shared[2].store(0, Ordering::SeqCst);
        self.cmd.write_all(b"l").unwrap();
        let mut ack = [0u8; 1];
        self.reply.read_exact(&mut ack).unwrap();
    }

    /// Waits until the looping child has opened `/dev/null` `n` more times, so that work
    /// done next overlaps with a child that is really running.
    pub fn wait_for_opens(&self, n: u64) {
        let start = self.shared[0].load(Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.shared[0].load(Ordering::SeqCst) < start + n {
            assert!(Instant::now() < deadline, "the probe stopped opening");
            std::thread::yield_now();
        }
    }

    /// Stops the loop; returns (opens tried, opens refused with EPERM).
    pub fn stop_loop(&mut self) -> (u64, u64) {
        self.shared[2].store(1, Ordering::SeqCst);
        let mut ack = [0u8; 1];
        self.reply.read_exact(&mut ack).unwrap();
        (
            self.shared[0].load(Ordering::SeqCst),
            self.shared[1].load(Ordering::SeqCst),
        )
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.pid);
        let _ = kill(pid, Signal::SIGKILL);
        let _ = waitpid(pid, None);
    }
}

fn child(cmd: i32, reply: i32, shared: &[AtomicU64; 3], node: &std::ffi::CStr) -> ! {
    let null = c"/dev/null".as_ptr();
    let zero = c"/dev/zero".as_ptr();
    // SAFETY: plain syscalls on descriptors this process owns and on static C strings.
    unsafe {
        loop {
            let mut b = 0u8;
            if libc::read(cmd, (&raw mut b).cast(), 1) != 1 {
                libc::_exit(0);
            }
            match b {
                b'n' | b'z' | b'w' => {
                    let fd = match b {
                        b'n' => libc::open(null, libc::O_RDONLY),
                        b'z' => libc::open(zero, libc::O_RDONLY),
                        _ => libc::open(null, libc::O_WRONLY),
                    };
                    let errno = if fd < 0 {
                        *libc::__errno_location()
                    } else {
                        libc::close(fd);
                        0
                    };
                    libc::write(reply, (&raw const errno).cast(), 4);
                }
                b'k' => {
                    let errno =
                        if libc::mknod(node.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3))
                            == 0
                        {
                            libc::unlink(node.as_ptr());
                            0
                        } else {
                            *libc::__errno_location()
                        };
                    libc::write(reply, (&raw const errno).cast(), 4);
                }
                b'l' => {
                    libc::write(reply, (&raw const b).cast(), 1);
                    while shared[2].load(Ordering::SeqCst) == 0 {
                        let fd = libc::open(null, libc::O_RDONLY);
                        if fd < 0 {
                            if *libc::__errno_location() == libc::EPERM {
                                shared[1].fetch_add(1, Ordering::SeqCst);
                            }
                        } else {
                            libc::close(fd);
                        }
                        shared[0].fetch_add(1, Ordering::SeqCst);
                    }
                    libc::write(reply, (&raw const b).cast(), 1);
                }
                _ => libc::_exit(0),
            }
        }
    }
}
