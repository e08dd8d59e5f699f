//! Shared helpers: a real virt-launcher rooted in a temp dir, the test guest's files.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Boot deadlines are generous: TCG on a loaded two-core machine.
pub const BOOT: Duration = Duration::from_secs(240);

/// The virt-launcher binary: `$VIRT_LAUNCHER_BIN`, else next to this test's target dir
/// (`cargo build -p launcher --bin virt-launcher` with the same `CARGO_TARGET_DIR`).
pub fn launcher_bin() -> PathBuf {
    workspace_bin("virt-launcher", "VIRT_LAUNCHER_BIN", "launcher")
}

/// A binary of another workspace package: `$<env>`, else next to this test's target dir
/// (`cargo build -p <package> --bin <name>` with the same `CARGO_TARGET_DIR`).
pub fn workspace_bin(name: &str, env: &str, package: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test exe path");
    let p = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build -p {package} --bin {name}` with the same \
         CARGO_TARGET_DIR, or set {env}",
        p.display()
    );
    p
}

pub fn guest_file(name: &str) -> PathBuf {
    let dir = std::env::var_os("KUBEVIRT_RS_GUEST_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/guest"),
        PathBuf::from,
    );
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: run hack/guest/build.sh (or set KUBEVIRT_RS_GUEST_DIR)",
        p.display()
    );
    p
}

/// A launcher process whose every directory flag points into its own temp dir. Dropping it
/// kills the launcher (and its QEMU, which dies with it through PR_SET_PDEATHSIG).
#[derive(Debug)]
pub struct Launcher {
    pub root: tempfile::TempDir,
    pub child: Child,
    pub socket: PathBuf,
}

impl Launcher {
    pub fn start(with_kernel: bool) -> Self {
        let root = tempfile::Builder::new()
            .prefix("handler-test")
            .tempdir()
            .expect("tempdir");
        let r = root.path();
        for d in [
            "share",
            "private",
            "ephemeral",
            "container-disks",
            "hotplug",
        ] {
            std::fs::create_dir_all(r.join(d)).expect("mkdir");
        }
        if with_kernel {
            let kb = r.join("container-disks/kernel-boot");
            std::fs::create_dir_all(&kb).expect("mkdir");
            std::fs::copy(guest_file("vmlinuz"), kb.join("vmlinuz")).expect("copy kernel");
            std::fs::copy(guest_file("initrd.img"), kb.join("initrd.img")).expect("copy initrd");
        }
        let log = std::fs::File::create(r.join("launcher.log")).expect("log");
        let arg = |d: &str| r.join(d).display().to_string();
        let child = Command::new(launcher_bin())
            .args(["--kubevirt-share-dir", &arg("share")])
            .args(["--private-dir", &arg("private")])
            .args(["--ephemeral-disk-dir", &arg("ephemeral")])
            .args(["--container-disk-dir", &arg("container-disks")])
            .args(["--hotplug-disk-dir", &arg("hotplug")])
            .args(["--allow-emulation", "--qemu-timeout", "120s"])
            .args(["--grace-period-seconds", "60"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn virt-launcher");
        let socket = r.join("share/sockets/launcher-sock");
        let l = Launcher {
            root,
            child,
            socket,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !l.socket.exists() {
            assert!(
                Instant::now() < deadline,
                "launcher socket never appeared\n{}",
                l.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        l
    }

    pub fn private_dir(&self) -> PathBuf {
        self.root.path().join("private")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.path().join("launcher.log")).unwrap_or_default()
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A VMI that boots the test guest's kernel and initrd (kernelBoot container files).
pub fn kernel_vmi(name: &str, uid: &str) -> api::VirtualMachineInstance {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {
            "domain": {
                "resources": {"requests": {"memory": "256Mi"}},
                "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                    "image": "guest", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}},
                "devices": {},
            },
        },
    }))
    .expect("valid VMI")
}

/// Installs our CRDs (`manifests/crds/`) and waits until VMIs are served.
/// A VMI in `phase` whose `conds` are True, as the console server's lookup sees it.
pub fn vmi_with_conditions(
    name: &str,
    uid: &str,
    phase: api::VirtualMachineInstancePhase,
    conds: &[api::status::VirtualMachineInstanceConditionType],
) -> api::VirtualMachineInstance {
    let mut v = api::VirtualMachineInstance::new(name, api::VirtualMachineInstanceSpec::default());
    v.metadata.namespace = Some("default".into());
    v.metadata.uid = Some(uid.into());
    v.status = Some(api::VirtualMachineInstanceStatus {
        phase: Some(phase),
        conditions: conds
            .iter()
            .map(|c| api::status::Condition {
                type_: c.clone(),
                status: api::ConditionStatus::True,
                last_probe_time: None,
                last_transition_time: None,
                reason: None,
                message: None,
            })
            .collect(),
        ..Default::default()
    });
    v
}

pub async fn install_crds(client: &kube::Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Api, ListParams, PostParams};
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/crds");
    for entry in std::fs::read_dir(&dir).expect("manifests/crds") {
        let path = entry.expect("entry").path();
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&std::fs::read_to_string(&path).expect("read")).expect("CRD yaml");
        crds.create(&PostParams::default(), &crd)
            .await
            .expect("create CRD");
    }
    let vmis: Api<api::VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    while vmis.list(&ListParams::default()).await.is_err() {
        assert!(Instant::now() < deadline, "the VMI CRD is never served");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
