//! Helpers shared by the integration tests: a QEMU process that is killed on drop.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A QEMU process with its QMP socket in a private temporary directory; killed and reaped on
/// drop, so a failing test leaves nothing behind.
pub struct Qemu {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub qmp: PathBuf,
}

impl Qemu {
    /// `qemu-system-x86_64 -machine none`: boots nothing, answers QMP.
    pub fn machine_none() -> Self {
        Self::spawn(&["-machine", "none", "-accel", "tcg"])
    }

    /// A q35 machine, stopped before the first instruction (`-S`).
    pub fn q35_paused() -> Self {
        Self::spawn(&["-M", "q35", "-accel", "tcg", "-S", "-m", "128"])
    }

    pub fn spawn(args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let qmp = dir.path().join("qmp.sock");
        Self::spawn_in(args, dir, qmp)
    }

    /// Like [`Qemu::spawn`] with the QMP socket at a path chosen by the caller.
    pub fn spawn_with_socket(args: &[&str], qmp: PathBuf) -> Self {
        Self::spawn_in(args, tempfile::tempdir().expect("temp dir"), qmp)
    }

    fn spawn_in(args: &[&str], dir: tempfile::TempDir, qmp: PathBuf) -> Self {
        let child = Command::new("qemu-system-x86_64")
            .args(args)
            .args(["-nodefaults", "-display", "none", "-qmp"])
            .arg(format!("unix:{},server=on,wait=off", qmp.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start qemu-system-x86_64");
        Self { child, dir, qmp }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn qmp(&self) -> &Path {
        &self.qmp
    }
}

/// The test guest's directory (hack/guest/build.sh), or a panic saying how to build it.
pub fn guest_dir() -> PathBuf {
    let dir = testguest::dir();
    assert!(
        dir.join("vmlinuz").is_file() && dir.join("initrd.img").is_file(),
        "the test guest is missing in {}: run hack/guest/build.sh",
        dir.display()
    );
    dir
}

impl Qemu {
    /// Boot the test guest's kernel and initramfs under TCG with the guest agent's
    /// virtio-serial port on `qga.sock` and the serial console in `console.log`.
    pub fn boot_guest(machine: &str) -> Self {
        let guest = guest_dir();
        let dir = tempfile::tempdir().expect("temp dir");
        let qmp = dir.path().join("qmp.sock");
        let qga = dir.path().join("qga.sock");
        let console = dir.path().join("console.log");
        let args = [
            "-M".to_owned(),
            machine.to_owned(),
            "-accel".into(),
            "tcg".into(),
            "-m".into(),
            "256".into(),
            "-kernel".into(),
            guest.join("vmlinuz").display().to_string(),
            "-initrd".into(),
            guest.join("initrd.img").display().to_string(),
            "-append".into(),
            "console=ttyS0".into(),
            "-serial".into(),
            format!("file:{}", console.display()),
            "-chardev".into(),
            format!("socket,path={},server=on,wait=off,id=qga0", qga.display()),
            "-device".into(),
            "virtio-serial".into(),
            "-device".into(),
            "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0".into(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::spawn_in(&args, dir, qmp)
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "qmp=debug".into()),
        )
        .with_test_writer()
        .try_init();
}
