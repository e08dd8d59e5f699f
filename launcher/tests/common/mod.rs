//! Shared helpers for the launcher's integration tests: a launcher process rooted in a temp
//! dir, a tiny HTTP/1.1 client for its unix socket, the serial console, and the test guest.

#![allow(dead_code)] // each test binary uses a different subset

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Boot deadlines are generous: TCG on a loaded two-core machine.
pub const BOOT: Duration = Duration::from_mins(6);

/// The test guest's files, or a panic that says how to build them.
pub fn guest_file(name: &str) -> PathBuf {
    let p = testguest::dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run hack/guest/build.sh (or set KUBEVIRT_RS_GUEST_DIR)",
        p.display()
    );
    p
}

pub fn uid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A launcher with every directory flag rooted in its own temp dir. Dropping it kills the
/// launcher and, through PR_SET_PDEATHSIG and an explicit kill, its QEMU.
#[derive(Debug)]
pub struct Launcher {
    pub root: tempfile::TempDir,
    pub child: Option<Child>,
    pub socket: PathBuf,
}

impl Launcher {
    pub fn dir(&self, name: &str) -> PathBuf {
        self.root.path().join(name)
    }

    pub fn start(extra: &[&str]) -> Self {
        Self::start_with(extra, |_| {})
    }

    /// `setup` may place files (container disks, kernels) before the launcher starts.
    pub fn start_with(extra: &[&str], setup: impl FnOnce(&Path)) -> Self {
        let root = tempfile::Builder::new()
            .prefix("launcher-test")
            .tempdir()
            .unwrap();
        let r = root.path();
        for d in [
            "share",
            "private",
            "ephemeral",
            "container-disks",
            "hotplug",
            "log",
        ] {
            std::fs::create_dir_all(r.join(d)).unwrap();
        }
        setup(r);
        let log = std::fs::File::create(r.join("log/launcher.log")).unwrap();
        let mut args: Vec<String> = vec![
            "--kubevirt-share-dir".into(),
            r.join("share").display().to_string(),
            "--private-dir".into(),
            r.join("private").display().to_string(),
            "--ephemeral-disk-dir".into(),
            r.join("ephemeral").display().to_string(),
            "--container-disk-dir".into(),
            r.join("container-disks").display().to_string(),
            "--hotplug-disk-dir".into(),
            r.join("hotplug").display().to_string(),
            "--allow-emulation".into(),
            "--qemu-timeout".into(),
            "120s".into(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let child = Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let socket = r.join("share/sockets/launcher-sock");
        let l = Self {
            root,
            child: Some(child),
            socket,
        };
        wait_until(Duration::from_secs(30), "the command socket", || {
            l.socket.exists().then_some(())
        });
        l
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir("log/launcher.log")).unwrap_or_default()
    }

    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        http(&self.socket, method, path, body)
    }

    pub fn get(&self, path: &str) -> Value {
        let (status, v) = self.request("GET", path, None);
        assert_eq!(status, 200, "GET {path}: {v}");
        v
    }

    pub fn post(&self, path: &str) -> Value {
        let (status, v) = self.request("POST", path, None);
        assert_eq!(status, 200, "POST {path}: {v}\n{}", self.log());
        v
    }

    pub fn sync(&self, vmi: &Value) -> (u16, Value) {
        self.request("PUT", "/v1/sync", Some(vmi))
    }

    pub fn domain(&self) -> Value {
        self.get("/v1/domain")
    }

    pub fn wait_state(&self, state: &str, limit: Duration) -> Value {
        wait_until(limit, &format!("domain state {state}"), || {
            let d = self.domain();
            (d["state"] == state).then_some(d)
        })
    }

    pub fn wait_agent(&self) {
        wait_until(BOOT, "the guest agent", || {
            (self.domain()["agentConnected"] == true).then_some(())
        });
    }

    pub fn vm_dir(&self, uid: &str) -> PathBuf {
        self.dir("private").join(uid)
    }

    pub fn serial_log(&self, uid: &str) -> String {
        String::from_utf8_lossy(
            &std::fs::read(self.vm_dir(uid).join("virt-serial0-log")).unwrap_or_default(),
        )
        .into_owned()
    }

    pub fn wait_console(&self, uid: &str, marker: &str) {
        let deadline = Instant::now() + BOOT;
        while !self.serial_log(uid).contains(marker) {
            if Instant::now() > deadline {
                let log = self.serial_log(uid);
                let tail: String = log
                    .chars()
                    .rev()
                    .take(1500)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                // From /proc and the log only: a launcher that stalled would not answer.
                let threads: Vec<String> = std::iter::once(i64::from(self.pid()))
                    .chain(qemus_under(self.root.path()))
                    .map(|pid| format!("process {pid}:\n{}", thread_states(pid)))
                    .collect();
                let log = self.log();
                let log_tail = log.lines().rev().take(30).collect::<Vec<_>>();
                panic!(
                    "timed out after {BOOT:?} waiting for {marker:?} on the console; it shows:\n{tail}\n\
                     the launcher's and QEMU's threads (name state wchan):\n{}\n\
                     the launcher's log, newest first:\n{}",
                    threads.join("\n"),
                    log_tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits for the launcher process to exit on its own.
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let child = self.child.as_mut().unwrap();
        let status = wait_until(limit, "the launcher to exit", || child.try_wait().unwrap());
        self.child = None;
        status
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Ok((200, d)) =
                std::panic::catch_unwind(|| http(&self.socket, "GET", "/v1/domain", None))
                && let Some(pid) = d["qemuPid"].as_i64()
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn wait_until<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One HTTP/1.1 request over the unix socket (`Connection: close`, body read to the end).
pub fn http(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let (status, payload) = http_bytes(socket, method, path, body);
    let v = if payload.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&payload)
            .unwrap_or_else(|_| json!({ "raw": String::from_utf8_lossy(&payload).into_owned() }))
    };
    (status, v)
}

/// Like [`http`], with the response body as bytes (a PNG from `/v1/screendump`).
pub fn http_bytes(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> (u16, Vec<u8>) {
    let mut s =
        UnixStream::connect(socket).unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
    s.set_read_timeout(Some(Duration::from_mins(5))).unwrap();
    let body = body
        .map(|b| serde_json::to_vec(b).unwrap())
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: launcher\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(&body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let (head, rest) = split_head(&raw);
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad response {head:?}"));
    let payload = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    (status, payload)
}

fn split_head(raw: &[u8]) -> (String, &[u8]) {
    let i = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("HTTP head");
    (
        String::from_utf8_lossy(&raw[..i]).into_owned(),
        &raw[i + 4..],
    )
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(i) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let n = usize::from_str_radix(std::str::from_utf8(&b[..i]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + n]);
        b = &b[i + 2 + n + 2..];
    }
}

/// Reads the NDJSON watch stream until `done` accepts a line or the limit passes.
pub fn watch_until(socket: &Path, limit: Duration, done: impl FnMut(&Value) -> bool) -> Vec<Value> {
    Watch::open(socket, limit).until(limit, done)
}

/// The launcher's watch stream, open.
pub struct Watch {
    stream: UnixStream,
    raw: Vec<u8>,
}

impl Watch {
    /// Opens the stream and reads its first line, the current state: whatever happens once
    /// this returns is in the stream, even if the launcher exits before a thread reads it.
    pub fn open(socket: &Path, limit: Duration) -> Self {
        let mut stream = UnixStream::connect(socket)
            .unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
        stream
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        write!(
            stream,
            "GET /v1/domain/watch HTTP/1.1\r\nHost: launcher\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut w = Self {
            stream,
            raw: Vec::new(),
        };
        let deadline = Instant::now() + limit;
        while parse_watch(&w.raw).is_empty() {
            assert!(w.read(), "watch: the stream ended before its first line");
            assert!(Instant::now() < deadline, "watch: no first line");
        }
        w
    }

    /// Reads more; false once the stream ended.
    fn read(&mut self) -> bool {
        let mut buf = [0u8; 8192];
        match self.stream.read(&mut buf) {
            Ok(0) => false,
            Ok(n) => {
                self.raw.extend_from_slice(&buf[..n]);
                true
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                true
            }
            Err(e) => panic!("watch: {e}"),
        }
    }

    /// Every line read, once `done` accepts the last one or the stream ends.
    pub fn until(mut self, limit: Duration, mut done: impl FnMut(&Value) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + limit;
        loop {
            let lines = parse_watch(&self.raw);
            if lines.last().is_some_and(&mut done) {
                return lines;
            }
            if !self.read() {
                return parse_watch(&self.raw);
            }
            assert!(
                Instant::now() < deadline,
                "watch: condition not met; got {lines:?}"
            );
        }
    }
}

fn parse_watch(raw: &[u8]) -> Vec<Value> {
    if !raw.windows(4).any(|w| w == b"\r\n\r\n") {
        return Vec::new();
    }
    let (_, rest) = split_head(raw);
    let body = dechunk_partial(rest);
    body.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect()
}

/// Like `dechunk`, tolerating a stream cut in the middle of a chunk.
fn dechunk_partial(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let Ok(n) = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16) else {
            break;
        };
        if n == 0 || b.len() < i + 2 + n {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + n]);
        b = &b[(i + 4 + n).min(b.len())..];
    }
    out
}

/// A VMI with the given spec, as JSON.
pub fn vmi(name: &str, uid: &str, spec: Value) -> Value {
    let mut v = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
    });
    v["spec"] = spec;
    v
}

/// Copies the guest's kernel and initrd where a kernelBoot container's files appear.
pub fn place_kernel(root: &Path) {
    let kb = root.join("container-disks/kernel-boot");
    std::fs::create_dir_all(&kb).unwrap();
    std::fs::copy(guest_file("vmlinuz"), kb.join("vmlinuz")).unwrap();
    std::fs::copy(guest_file("initrd.img"), kb.join("initrd.img")).unwrap();
}

/// Places the guest's bootable disk as container disk number `index`.
pub fn place_container_disk(root: &Path, index: usize) {
    std::fs::copy(
        guest_file("containerdisk/disk/disk.qcow2"),
        root.join(format!("container-disks/disk_{index}.img")),
    )
    .unwrap();
}

/// The live (not zombie) QEMU processes with an argument under `root`: a test's own.
pub fn qemus_under(root: &Path) -> Vec<i64> {
    let root = root.to_string_lossy();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i64>().ok())
        .filter(|pid| {
            let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let mut args = argv.split(|b| *b == 0).map(String::from_utf8_lossy);
            args.next().is_some_and(|a| a.contains("qemu-system"))
                && args.any(|a| a.contains(root.as_ref()))
                && process_alive(*pid)
        })
        .collect()
}

/// Each thread of process `pid`: its name, scheduler state and where in the kernel it waits,
/// to tell a stalled guest (vCPU threads running) from a stalled QEMU (threads asleep).
pub fn thread_states(pid: i64) -> String {
    let read = |p: PathBuf| std::fs::read_to_string(p).unwrap_or_default();
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|t| {
            let stat = read(t.path().join("stat"));
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.split(' ').next())
                .unwrap_or("?")
                .to_owned();
            format!(
                "{} {state} {}",
                read(t.path().join("comm")).trim(),
                read(t.path().join("wchan"))
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn process_alive(pid: i64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// The live QEMU processes whose command line mentions `marker` (a VMI's uid: QEMU's socket
/// paths carry it).
pub fn qemus_with(marker: &str) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            cmdline
                .split('\0')
                .next()
                .is_some_and(|argv0| argv0.contains("qemu-system"))
                && cmdline.contains(marker)
                && process_alive(i64::from(*pid))
        })
        .collect();
    pids.sort_unstable();
    pids
}

fn run_tool(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A loop device over a file: a real block device for a block-mode PVC. Detached on drop
/// (deferred by the kernel until QEMU has closed it).
#[derive(Debug)]
pub struct LoopDevice {
    pub path: PathBuf,
}

impl LoopDevice {
    pub fn attach(file: &Path) -> Self {
        let path = run_tool(
            Command::new("losetup")
                .arg("--find")
                .arg("--show")
                .arg(file),
        );
        Self { path: path.into() }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.path).status();
    }
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

fn meminfo(key: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim_start_matches(':').trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/meminfo"))
}

/// 2 MiB hugepages reserved for the test and a hugetlbfs mount to hand to the launcher. The
/// reservation is restored and the mount detached on drop.
#[derive(Debug)]
pub struct Hugepages {
    pub mount: tempfile::TempDir,
    before: String,
    mounted: bool,
}

impl Hugepages {
    pub fn reserve(pages: u64) -> Self {
        let before = std::fs::read_to_string(NR_HUGEPAGES).unwrap();
        let want = before.trim().parse::<u64>().unwrap() + pages;
        let mut h = Self {
            mount: tempfile::Builder::new()
                .prefix("hugetlbfs")
                .tempdir()
                .unwrap(),
            before,
            mounted: false,
        };
        // The kernel takes what contiguous memory it finds at that moment; with the page cache
        // full of build output it can come up short (68 of 128 after five compactions, on a
        // machine five hours into builds and suites), so drop the clean page cache, compact and
        // ask again.
        for attempt in 1.. {
            std::fs::write(NR_HUGEPAGES, want.to_string()).unwrap();
            let got = meminfo("HugePages_Total");
            if got >= want {
                break;
            }
            assert!(
                attempt < 5,
                "this machine reserved only {got} of {want} 2 MiB hugepages"
            );
            std::fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
            std::fs::write("/proc/sys/vm/compact_memory", "1").unwrap();
        }
        run_tool(
            Command::new("mount")
                .args(["-t", "hugetlbfs", "-o", "pagesize=2M", "hugetlbfs"])
                .arg(h.mount.path()),
        );
        h.mounted = true;
        h
    }

    /// Pages taken (allocated or reserved) by someone.
    pub fn in_use() -> u64 {
        meminfo("HugePages_Total") - meminfo("HugePages_Free") + meminfo("HugePages_Rsvd")
    }
}

impl Drop for Hugepages {
    fn drop(&mut self) {
        if self.mounted {
            // Lazy: the killed QEMU may still hold its backing file for a moment.
            let _ = Command::new("umount")
                .arg("--lazy")
                .arg(self.mount.path())
                .status();
        }
        let _ = std::fs::write(NR_HUGEPAGES, self.before.trim());
    }
}

/// Restricts the calling thread, and so the launcher it starts next, to the first two CPUs it
/// may run on, as the kubelet's static CPU manager gives a Guaranteed container its own CPUs.
/// Returns them.
pub fn restrict_to_two_cpus() -> [usize; 2] {
    use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
    let me = nix::unistd::Pid::from_raw(0);
    let own = sched_getaffinity(me).unwrap();
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| own.is_set(c).unwrap())
        .take(2)
        .collect();
    let [first, second] = cpus[..] else {
        panic!("dedicated CPUs need two CPUs, this test runs on {cpus:?}");
    };
    let mut set = CpuSet::new();
    set.set(first).unwrap();
    set.set(second).unwrap();
    sched_setaffinity(me, &set).unwrap();
    [first, second]
}
