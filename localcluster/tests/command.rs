//! The `localcluster` command: `up` writes the kubeconfig kubectl uses, refuses a second `up`
//! on the same state and a start without root; `down` stops it and removes its state files.

use std::os::unix::process::CommandExt as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_localcluster");

/// Kills the `up` process if the test ends early.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn localcluster(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running localcluster")
}

#[test]
fn up_serves_kubectl_refuses_a_second_up_and_down_cleans_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path().to_str().expect("utf-8 path");
    let up = Running(
        Command::new(BIN)
            .args(["up", "--dir", d, "--port", "0", "--nodes", "0"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting localcluster up"),
    );
    let (kubeconfig, pid_file) = (
        dir.path().join("kubeconfig"),
        dir.path().join("localcluster.pid"),
    );
    wait_for("the pid file", 60, || pid_file.exists());
    assert!(kubeconfig.exists());
    let get = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["get", "namespace", "default", "-o", "name"])
        .output()
        .expect("running kubectl");
    assert!(
        get.status.success(),
        "{}",
        String::from_utf8_lossy(&get.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&get.stdout).trim(),
        "namespace/default"
    );

    let second = localcluster(&["up", "--dir", d, "--port", "0", "--nodes", "0"]);
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("is already running with state in"), "{err}");

    let down = localcluster(&["down", "--dir", d]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(!kubeconfig.exists(), "kubeconfig left");
    assert!(!pid_file.exists(), "pid file left");
    drop(up);
    let again = localcluster(&["down", "--dir", d]);
    assert!(!again.status.success(), "nothing left to stop");
}

#[test]
fn up_with_nodes_refuses_without_root() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The nobody user must be able to create its state in the directory.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .expect("chmod");
    let state = dir.path().join("state");
    let mut cmd = Command::new(BIN);
    cmd.args(["up", "--port", "0", "--nodes", "1", "--dir"])
        .arg(&state)
        .env("RUST_LOG", "warn")
        .env("HOME", dir.path());
    // SAFETY: setgid/setuid are async-signal-safe system calls on values prepared before the
    // fork.
    unsafe {
        cmd.pre_exec(|| {
            nix::unistd::setgid(nix::unistd::Gid::from_raw(65534))?;
            nix::unistd::setuid(nix::unistd::Uid::from_raw(65534))?;
            Ok(())
        });
    }
    let out = cmd.output().expect("running localcluster as nobody");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the process kubelet needs root") && err.contains("--nodes 0"),
        "{err}"
    );
    assert!(!state.exists(), "a refused start leaves nothing behind");
}
