//! What the launcher's examples share: the launcher binary beside them, a launcher started in
//! its own directory with the test guest's kernel in place, its command API, a child killed on
//! drop, and a process's resident set.

// Each example uses its part of this module, and each compiles it on its own.
#![allow(dead_code)]

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// How long a guest may take to boot under TCG on a busy two-core machine.
pub const BOOT: Duration = Duration::from_mins(6);

/// virt-launcher, built with the same profile as the running example; says which one, since
/// debug builds are several times larger and slower.
pub fn launcher_bin() -> anyhow::Result<PathBuf> {
    // Examples live in target/<profile>/examples/; the binary one level up.
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .context("no target dir")?
        .join("virt-launcher");
    if !bin.exists() {
        bail!(
            "{} is missing: build it with the same profile first",
            bin.display()
        );
    }
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    println!("launcher: {} ({profile} build)", bin.display());
    Ok(bin)
}

/// Resident KiB of a process (`VmRSS`).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A child process, killed and reaped when dropped.
pub struct Proc(pub Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts virt-launcher with its directories under `root`; returns it, its command socket and
/// how long exec -> socket took. The kernel SIGKILLs the launcher if the example dies without
/// unwinding (SIGKILL, abort), and the launcher's QEMU dies with it (its own PR_SET_PDEATHSIG),
/// so no guest outlives the example however it ends.
pub fn start_launcher(bin: &Path, root: &Path) -> anyhow::Result<(Proc, PathBuf, Duration)> {
    let socket = root.join("share/sockets/launcher-sock");
    let t0 = Instant::now();
    let mut command = Command::new(bin);
    command
        .args(["--allow-emulation", "--kubevirt-share-dir"])
        .arg(root.join("share"))
        .arg("--private-dir")
        .arg(root.join("private"))
        .arg("--ephemeral-disk-dir")
        .arg(root.join("ephemeral"))
        .arg("--container-disk-dir")
        .arg(root.join("cd"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let proc = Proc(command.spawn()?);
    while !socket.exists() {
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("no launcher socket after 10 s");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok((proc, socket, t0.elapsed()))
}

/// One request to the launcher's command API; the reply's JSON body.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: &[u8],
) -> anyhow::Result<serde_json::Value> {
    let mut s = UnixStream::connect(socket)?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: l\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (_, payload) = out.split_once("\r\n\r\n").context("no HTTP head")?;
    Ok(serde_json::from_str(payload)?)
}

/// Puts the test guest's kernel and initrd where the launcher under `root` looks for a
/// kernel-boot container's files (linked when they share a file system).
pub fn place_kernel(root: &Path) -> anyhow::Result<()> {
    let kernels = root.join("cd/kernel-boot");
    std::fs::create_dir_all(&kernels)?;
    for file in ["vmlinuz", "initrd.img"] {
        let (from, to) = (testguest::dir().join(file), kernels.join(file));
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).with_context(|| from.display().to_string())?;
        }
    }
    Ok(())
}

/// A VMI booting the test guest's kernel (see [`place_kernel`]) on its serial console.
pub fn kernel_boot_vmi(uid: &str, memory: &str, vcpus: u32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "bench", "namespace": "default", "uid": uid},
        "spec": {"domain": {
            "cpu": {"cores": vcpus},
            "resources": {"requests": {"memory": memory}},
            "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                "image": "g", "kernelPath": "/vmlinuz", "initrdPath": "/initrd.img"}}},
            "devices": {},
        }},
    })
}

/// The test guest, run by its own launcher in its own directory.
pub struct Guest {
    /// Declared before `_root` so the launcher (and with it QEMU) stops before its directory
    /// is removed.
    pub launcher: Proc,
    pub socket: PathBuf,
    pub qemu_pid: u32,
    _root: tempfile::TempDir,
}

impl Guest {
    /// Starts a launcher and syncs a VMI of `memory` and `vcpus` to it; returns once QEMU runs.
    pub fn start(bin: &Path, memory: &str, vcpus: u32) -> anyhow::Result<Self> {
        let root = tempfile::tempdir()?;
        place_kernel(root.path())?;
        let (launcher, socket, _) = start_launcher(bin, root.path())?;
        let uid = uuid::Uuid::new_v4().to_string();
        let body = serde_json::to_vec(&kernel_boot_vmi(&uid, memory, vcpus))?;
        let domain = request(&socket, "PUT", "/v1/sync", &body)?;
        if domain["state"] != "Running" {
            bail!("sync failed: {domain}");
        }
        let qemu_pid = domain["qemuPid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
            .context("no QEMU pid")?;
        Ok(Self {
            launcher,
            socket,
            qemu_pid,
            _root: root,
        })
    }

    /// Whether the guest agent (started last by the guest's init) answers the launcher.
    pub fn agent_connected(&self) -> anyhow::Result<bool> {
        Ok(request(&self.socket, "GET", "/v1/domain", &[])?["agentConnected"] == true)
    }

    /// Waits until the guest has booted: its agent answers. Returns how long that took.
    pub fn wait_booted(&self, timeout: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        while !self.agent_connected()? {
            if started.elapsed() > timeout {
                bail!("the guest agent did not connect within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(started.elapsed())
    }
}
