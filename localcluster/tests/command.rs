//! The `localcluster` command: `up` starts the upstream control plane (from `--kube`) and the
//! volume provisioner, and writes the kubeconfig kubectl uses; it refuses a second `up` on the
//! same state and a start of nodes without root; `restart` kills one component and starts it
//! again while the cluster runs on; `down` stops every component and removes its state files.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use localcluster::kubectl::Kubectl;

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

/// The upstream `kube` binary (`LOCALCLUSTER_KUBE`, else `upstream/build.sh`'s), resolved here
/// so that `up` is given it with `--kube`.
fn kube() -> PathBuf {
    localcluster::controlplane::kube_binary().expect("the upstream kube binary")
}

fn localcluster(args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running localcluster")
}

/// The pids of processes whose command line mentions `dir` (the components `up` started
/// name their state directory in their flags).
fn processes_using(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline)
                .contains(&needle)
                .then_some(pid)
        })
        .collect()
}

#[test]
fn up_serves_kubectl_refuses_a_second_up_and_down_cleans_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path().to_str().expect("utf-8 path");
    let kube = kube();
    let kube = kube.to_str().expect("utf-8 path");
    let log = std::fs::File::create(dir.path().join("up.log")).expect("log file");
    let mut up = Running(
        Command::new(BIN)
            .args([
                "up", "--dir", d, "--port", "0", "--nodes", "0", "--kube", kube,
            ])
            .env("RUST_LOG", "warn")
            .env_remove("LOCALCLUSTER_KUBE")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting localcluster up"),
    );
    let (kubeconfig, pid_file) = (
        dir.path().join("kubeconfig"),
        dir.path().join("localcluster.pid"),
    );
    // The kubeconfig is written once kube-apiserver is ready.
    wait_for("the kubeconfig", 240, || {
        if let Ok(Some(status)) = up.0.try_wait() {
            panic!(
                "localcluster up exited ({status}): {}",
                std::fs::read_to_string(dir.path().join("up.log")).unwrap_or_default()
            );
        }
        kubeconfig.exists()
    });
    assert!(pid_file.exists());
    let runner = Kubectl::new(&kubeconfig).cache_dir(dir.path().join("kubectl-cache"));
    let kubectl = |args: &[&str]| runner.output(args, None).expect("running kubectl");
    let get = kubectl(&["get", "namespace", "default", "-o", "name"]);
    assert!(
        get.status.success(),
        "{}",
        String::from_utf8_lossy(&get.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&get.stdout).trim(),
        "namespace/default"
    );
    // The volume provisioner runs inside `up`, with its default StorageClass.
    let class = kubectl(&[
        "get",
        "storageclass",
        localcluster::storage::STORAGE_CLASS,
        "-o",
        "jsonpath={.provisioner}",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&class.stdout),
        localcluster::storage::PROVISIONER,
        "{}",
        String::from_utf8_lossy(&class.stderr)
    );
    assert!(dir.path().join("volumes").is_dir());
    // The whole upstream control plane, as its own processes: etcd, kube-apiserver,
    // kube-controller-manager and kube-scheduler (no kube-proxy without nodes).
    let components = processes_using(dir.path());
    assert!(components.len() >= 4, "components: {components:?}");
    let logs: Vec<String> = std::fs::read_dir(dir.path().join("logs"))
        .expect("the components' logs")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    for component in [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ] {
        assert!(logs.contains(&format!("{component}.log")), "{logs:?}");
    }
    assert!(!logs.contains(&"kube-proxy.log".to_string()), "{logs:?}");

    // `restart` kills a component and starts it again, the rest running on: a ConfigMap
    // written before is read after kube-apiserver's restart, through the same kubeconfig.
    let made = kubectl(&[
        "create",
        "configmap",
        "before-restart",
        "--from-literal=k=v",
    ]);
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let apiserver_pid = || {
        processes_using(dir.path())
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.split(|b| *b == 0).nth(1) == Some(b"kube-apiserver"))
            })
            .collect::<Vec<_>>()
    };
    let before = apiserver_pid();
    assert_eq!(before.len(), 1, "{before:?}");
    let restarted = localcluster(&["restart", "--dir", d, "kube-apiserver"]);
    assert!(
        restarted.status.success(),
        "{}",
        String::from_utf8_lossy(&restarted.stderr)
    );
    let after = apiserver_pid();
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(before, after, "a new kube-apiserver");
    let read = kubectl(&[
        "get",
        "configmap",
        "before-restart",
        "-o",
        "jsonpath={.data.k}",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&read.stdout),
        "v",
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    assert!(
        up.0.try_wait().expect("up's status").is_none(),
        "up kept running"
    );
    let unknown = localcluster(&["restart", "--dir", d, "kubelet"]);
    assert!(!unknown.status.success());
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        err.contains("no component kubelet runs (running: etcd, kube-apiserver"),
        "{err}"
    );
    let no_node = localcluster(&["restart", "--dir", d, "kubelet/node-1"]);
    assert!(!no_node.status.success());
    let err = String::from_utf8_lossy(&no_node.stderr);
    assert!(err.contains("no node node-1 (nodes: none)"), "{err}");

    let second = localcluster(&[
        "up", "--dir", d, "--port", "0", "--nodes", "0", "--kube", kube,
    ]);
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
    let left = processes_using(dir.path());
    assert!(left.is_empty(), "components left running: {left:?}");
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
    cmd.args(["up", "--port", "0", "--nodes", "1", "--kube"])
        .arg(kube())
        .arg("--dir")
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
