//! Stand-ins for pods on the real system: network namespaces joined by a veth, processes
//! started inside them, and guards that delete all of it even when a test fails. Shared with
//! the launcher's network tests (`#[path]`), which boot real guests behind them.

#![allow(dead_code)] // each test binary uses a different subset

use std::os::fd::AsFd as _;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The stand-in pod's address and its peer's ("another pod", also the pod's gateway).
pub const POD_IP: &str = "10.99.0.2";
pub const PEER_IP: &str = "10.99.0.1";
pub const PREFIX: u8 = 24;
/// The same two, for a pod with IPv6 ([`Pod::with_ipv6`]).
pub const POD_IP6: &str = "fd99::2";
pub const PEER_IP6: &str = "fd99::1";

/// A named network namespace (`ip netns add`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "kvrs-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        run("ip", &["netns", "add", &name]);
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `ip -n <ns> ...`, which must succeed.
    pub fn ip(&self, args: &[&str]) -> String {
        let mut a = vec!["-n", self.name.as_str()];
        a.extend_from_slice(args);
        run("ip", &a)
    }

    /// `ip netns exec <ns> <cmd...>`; the output, whatever the exit status.
    pub fn exec(&self, cmd: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(cmd)
            .output()
            .unwrap()
    }

    pub fn file(&self) -> std::fs::File {
        std::fs::File::open(format!("/run/netns/{}", self.name)).unwrap()
    }

    /// Makes `cmd` start inside this namespace (setns in the child before exec).
    pub fn enter(&self, cmd: &mut Command) {
        let f = self.file();
        // SAFETY: the closure only calls setns(2), which is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(std::io::Error::from)
            });
        }
    }

    /// Starts a process inside the namespace; killed on drop.
    pub fn spawn(&self, mut cmd: Command) -> Proc {
        self.enter(&mut cmd);
        Proc(cmd.stdin(Stdio::null()).spawn().unwrap())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// A child process killed and reaped on drop.
#[derive(Debug)]
pub struct Proc(pub Child);

impl Proc {
    pub fn pid(&self) -> i32 {
        i32::try_from(self.0.id()).unwrap()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run(cmd: &str, args: &[&str]) -> String {
    let o = Command::new(cmd).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A stand-in pod: its netns with `eth0` (POD_IP/24, default route via the peer), a peer
/// netns ("another pod") on the other end of the veth, and a long-running process in the pod
/// (what detection finds, like the launcher).
#[derive(Debug)]
pub struct Pod {
    pub process: Proc,
    pub netns: Netns,
    pub peer: Netns,
}

impl Pod {
    pub fn new(tag: &str) -> Self {
        let pod = Netns::new(&format!("{tag}-pod"));
        let peer = Netns::new(&format!("{tag}-peer"));
        pod.ip(&[
            "link", "add", "eth0", "mtu", "1400", "type", "veth", "peer", "name", "peer0", "netns",
            &peer.name,
        ]);
        pod.ip(&["addr", "add", &format!("{POD_IP}/{PREFIX}"), "dev", "eth0"]);
        pod.ip(&["link", "set", "eth0", "up"]);
        pod.ip(&["route", "add", "default", "via", PEER_IP]);
        peer.ip(&["link", "set", "peer0", "mtu", "1400"]);
        peer.ip(&[
            "addr",
            "add",
            &format!("{PEER_IP}/{PREFIX}"),
            "dev",
            "peer0",
        ]);
        peer.ip(&["link", "set", "peer0", "up"]);
        let mut sleep = Command::new("sleep");
        sleep.arg("100000");
        let process = pod.spawn(sleep);
        Self {
            process,
            netns: pod,
            peer,
        }
    }

    /// Gives the pod and its peer IPv6 addresses (`/64`) and the pod a default IPv6 route via
    /// the peer, as a dual-stack pod network would. No duplicate address detection, so the
    /// addresses are usable at once.
    pub fn with_ipv6(&self) {
        self.netns.ip(&[
            "addr",
            "add",
            &format!("{POD_IP6}/64"),
            "dev",
            "eth0",
            "nodad",
        ]);
        self.netns
            .ip(&["-6", "route", "add", "default", "via", PEER_IP6]);
        self.peer.ip(&[
            "addr",
            "add",
            &format!("{PEER_IP6}/64"),
            "dev",
            "peer0",
            "nodad",
        ]);
    }

    pub fn isolation(&self) -> isolation::PodIsolation {
        isolation::detect_from_pid(self.process.pid()).unwrap()
    }
}

/// Runs `f` on a thread inside `ns` (sockets it opens stay in that namespace).
pub fn in_netns<T: Send>(ns: &Netns, f: impl FnOnce() -> T + Send) -> T {
    let file = ns.file();
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        })
        .join()
        .unwrap()
    })
}

/// Polls `f` until it returns `Some`, or panics naming `what` after `limit`.
pub fn wait_until<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A VMI with one interface on the pod network, as JSON.
pub fn vmi_json(name: &str, uid: &str, iface: &serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {
            "domain": {"devices": {"interfaces": [iface]}},
            "networks": [{"name": "default", "pod": {}}],
        },
    })
}
