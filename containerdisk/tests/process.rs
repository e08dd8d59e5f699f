//! The `container-disk` binary as a process, as a container runtime would start it.

use std::os::unix::fs::FileTypeExt as _;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_container-disk");
const LIMIT: Duration = Duration::from_secs(30);

/// Kills the process on drop, whatever the test did.
struct Proc(Option<Child>);

impl Proc {
    fn start(args: &[&str]) -> Self {
        Self(Some(
            Command::new(BIN)
                .args(args)
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        ))
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.0.as_ref().unwrap().id()).unwrap()
    }

    fn signal(&self, s: Signal) {
        kill(Pid::from_raw(self.pid()), s).unwrap();
    }

    fn wait(&mut self) -> (ExitStatus, String) {
        let child = self.0.as_mut().unwrap();
        let deadline = Instant::now() + LIMIT;
        while child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "container-disk did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = self.0.take().unwrap().wait_with_output().unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn wait_for_socket(p: &Path) {
    let deadline = Instant::now() + LIMIT;
    while !std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket()) {
        assert!(Instant::now() < deadline, "{} never appeared", p.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn peer_pid(socket: &Path) -> i32 {
    let s = UnixStream::connect(socket).unwrap();
    getsockopt(&s, PeerCredentials).unwrap().pid()
}

fn copy_path(dir: &tempfile::TempDir) -> (PathBuf, PathBuf) {
    let copy = dir.path().join("uid/disk_0");
    let sock = dir.path().join("uid/disk_0.sock");
    (copy, sock)
}

#[test]
fn no_op_exits_zero_without_a_socket() {
    let out = Command::new(BIN).arg("--no-op").output().unwrap();
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn serves_its_pid_and_stops_on_sigterm_removing_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, sock) = copy_path(&dir);
    let mut p = Proc::start(&["--copy-path", copy.to_str().unwrap()]);
    wait_for_socket(&sock);
    // Many connections, more than the listen backlog: each is accepted and closed, so
    // none is ever refused and the kernel names the server every time.
    for _ in 0..200 {
        assert_eq!(peer_pid(&sock), p.pid());
    }
    p.signal(Signal::SIGTERM);
    let (status, log) = p.wait();
    assert!(status.success(), "{status:?}: {log}");
    assert!(!sock.exists(), "the socket is removed");
    assert!(log.contains("SIGTERM"), "{log}");
}

#[test]
fn stops_when_its_socket_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, sock) = copy_path(&dir);
    let mut p = Proc::start(&["--copy-path", copy.to_str().unwrap()]);
    wait_for_socket(&sock);
    std::fs::remove_file(&sock).unwrap();
    let (status, log) = p.wait();
    assert!(status.success(), "{status:?}: {log}");
    assert!(log.contains("gone"), "{log}");
}

#[test]
fn a_stale_socket_is_replaced_and_a_live_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, sock) = copy_path(&dir);
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    // A predecessor killed with SIGKILL leaves its socket file behind.
    drop(UnixListener::bind(&sock).unwrap());
    let mut first = Proc::start(&["--copy-path", copy.to_str().unwrap()]);
    wait_for_socket(&sock);
    let deadline = Instant::now() + LIMIT;
    while UnixStream::connect(&sock).is_err() {
        assert!(
            Instant::now() < deadline,
            "the stale socket was not replaced"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(peer_pid(&sock), first.pid());

    let mut second = Proc::start(&["--copy-path", copy.to_str().unwrap()]);
    let (status, log) = second.wait();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("already serves"), "{log}");
    // The refused second instance did not take the first one's socket away.
    assert_eq!(peer_pid(&sock), first.pid());
    first.signal(Signal::SIGINT);
    assert!(first.wait().0.success());
}

#[test]
fn bad_arguments_are_refused() {
    let long = format!("/tmp/{}", "x".repeat(120));
    let out = Command::new(BIN)
        .args(["--copy-path", &long])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at most 102"), "{err}");

    let out = Command::new(BIN).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--copy-path"),
        "{out:?}"
    );
}
