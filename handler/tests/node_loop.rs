//! The node loop against localcluster's upstream control plane (our CRDs installed) and real
//! virt-launcher processes laid out the way the kubelet would: each launcher's socket in
//! `<pods dir>/<pod uid>/volumes/kubernetes.io~empty-dir/sockets/launcher-sock`. The test plays
//! virt-controller: it creates the VMI with its node label, the launcher pod, and the VMI's
//! `activePods`, and releases the controller's finalizer. Tests named `guest_` boot the test
//! guest under TCG.

mod common;
#[path = "../../network/tests/common/mod.rs"]
mod netfix;

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use api::VirtualMachineInstance;
use handler::metrics;
use handler::node::pod_socket;
use handler::node::{self, Node};
use handler::server::Vmis as _;
use handler::status::SYNC_FAILED_REASON;
use handler::vmistore::NodeVmis;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt as _};
use launcher_api::client::LauncherClient;
use launcher_api::domain::{Domain, DomainState, FsFreeze};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-a";
const FINALIZER: &str = "kubevirt.io/foregroundDeleteVirtualMachine";
/// Short, so that a failed launcher shows up quickly as unresponsive.
const WATCHDOG: Duration = Duration::from_secs(5);

async fn wait_for<T, F, Fut>(what: &str, deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The control plane with our CRDs and the Ready Nodes `node-a` and `node-b`, a pods dir, and
/// the node loop running in-process.
struct Harness {
    server: localcluster::controlplane::TestControlPlane,
    client: Client,
    /// The kubelets' leases: kube-controller-manager must keep the nodes, and so the pods the
    /// test binds to them, Ready (and must not delete those pods as bound to no node).
    _nodes: Vec<localcluster::controlplane::NodeHeartbeat>,
    /// Also the pods dir: short, because a unix socket path has at most 107 bytes.
    root: tempfile::TempDir,
    stop: CancellationToken,
    running: Option<(Arc<Node>, tokio::task::JoinHandle<()>)>,
}

impl Harness {
    async fn start() -> Self {
        let mut h = Harness::without_loop().await;
        h.start_loop().await;
        h
    }

    /// The control plane and the pods dir, for a handler that runs elsewhere.
    async fn without_loop() -> Self {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "handler=debug".into()),
            )
            .with_test_writer()
            .try_init();
        let server = localcluster::controlplane::TestControlPlane::start(false).await;
        let client = server.client().await;
        localcluster::controlplane::install_crds(&client).await;
        let mut nodes = Vec::new();
        for node in [NODE, "node-b"] {
            nodes.push(common::ready_node(&client, node).await);
        }
        let root = tempfile::Builder::new()
            .prefix("p")
            .tempdir_in("/tmp")
            .expect("tempdir");
        std::fs::create_dir_all(root.path().join("private")).expect("mkdir");
        Harness {
            server,
            client,
            _nodes: nodes,
            root,
            stop: CancellationToken::new(),
            running: None,
        }
    }

    fn config(&self) -> node::Config {
        let mut cfg = node::Config::new(NODE);
        self.root.path().clone_into(&mut cfg.pods_dir);
        cfg.launcher_private_dir = self.root.path().join("private");
        cfg.watchdog_timeout = WATCHDOG;
        cfg
    }

    async fn start_loop(&mut self) {
        self.stop = CancellationToken::new();
        let started = node::start(self.client.clone(), self.config(), self.stop.clone())
            .await
            .expect("node loop");
        self.running = Some(started);
    }

    /// Stops the loop as a killed handler would leave things: launchers keep running.
    async fn stop_loop(&mut self) {
        self.stop.cancel();
        if let Some((_, handle)) = self.running.take() {
            tokio::time::timeout(Duration::from_secs(30), handle)
                .await
                .expect("the loop stops")
                .expect("no panic");
        }
    }

    fn vmis(&self) -> Api<VirtualMachineInstance> {
        Api::default_namespaced(self.client.clone())
    }

    /// The controller's part for one VMI: the VMI (Scheduled, labelled for `node`), its launcher
    /// pod (running and ready), the launcher process in the kubelet's layout, then `activePods`.
    async fn schedule(&self, name: &str, node: &str, grace: i64, kernel: bool) -> Vm {
        self.schedule_in(name, node, grace, kernel, &PodSetup::default())
            .await
    }

    async fn schedule_in(
        &self,
        name: &str,
        node: &str,
        grace: i64,
        kernel: bool,
        pod_setup: &PodSetup<'_>,
    ) -> Vm {
        let vmis = self.vmis();
        let (mut domain, volumes) = if kernel {
            // The files are in the kernelBoot image container's /mnt (see `Launcher::start`).
            // A scratch disk, so /metrics has a drive the guest's kernel has read from.
            let mut domain = json!({
                "resources": {"requests": {"memory": "256Mi"}},
                "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                    "image": "guest", "kernelPath": "/mnt/vmlinuz",
                    "initrdPath": "/mnt/initrd.img"}}},
                "devices": {"disks": [{"name": "scratch", "disk": {"bus": "virtio"}}]},
            });
            let mut volumes = json!([{"name": "scratch", "emptyDisk": {"capacity": "16Mi"}}]);
            if let Some(path) = pod_setup.data_disk {
                let (disk, volume) = data_disk(path);
                domain["devices"]["disks"]
                    .as_array_mut()
                    .expect("disks")
                    .push(disk);
                volumes.as_array_mut().expect("volumes").push(volume);
            }
            (domain, volumes)
        } else {
            // A disk without a volume: the launcher refuses it before starting QEMU.
            let domain = json!({
                "resources": {"requests": {"memory": "256Mi"}},
                "devices": {"disks": [{"name": "root", "disk": {}}]},
            });
            (domain, json!([]))
        };
        let networks = if pod_setup.netns.is_some() {
            domain["devices"]["interfaces"] = json!([{"name": "default", "masquerade": {}}]);
            json!([{"name": "default", "pod": {}}])
        } else {
            json!([])
        };
        let vmi: VirtualMachineInstance = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {
                "name": name,
                "labels": {api::labels::NODE_NAME: node},
                "finalizers": [FINALIZER],
            },
            "spec": {"terminationGracePeriodSeconds": grace, "domain": domain, "volumes": volumes,
                "networks": networks},
            "status": {"phase": "Scheduled", "nodeName": node},
        }))
        .expect("VMI");
        let vmi = vmis
            .create(&PostParams::default(), &vmi)
            .await
            .expect("create VMI");
        let uid = vmi.uid().expect("uid");

        let pods: Api<Pod> = Api::default_namespaced(self.client.clone());
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": format!("virt-launcher-{name}"),
                "labels": {api::labels::APP: "virt-launcher", api::labels::CREATED_BY: uid},
                "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                    "name": name, "uid": uid, "controller": true, "blockOwnerDeletion": true}],
            },
            "spec": {"nodeName": node, "containers": [{"name": "compute", "image": "virt-launcher"}]},
        }))
        .expect("pod");
        let pod = pods
            .create(&PostParams::default(), &pod)
            .await
            .expect("create pod");
        let pod_uid = pod.uid().expect("pod uid");
        pods.patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True"}]}})),
        )
        .await
        .expect("pod status");

        let launcher = Launcher::start(
            self.root.path(),
            name,
            &uid,
            &pod_uid,
            grace,
            kernel,
            pod_setup,
        );
        vmis.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"activePods": {pod_uid.clone(): node}}})),
        )
        .await
        .expect("activePods");
        Vm {
            name: name.to_owned(),
            uid,
            launcher,
        }
    }

    /// A JSON merge patch of the VMI named `name` (`what` names it in a failure).
    async fn merge_patch(&self, name: &str, patch: serde_json::Value, what: &str) {
        self.vmis()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }

    async fn vmi(&self, name: &str) -> Option<VirtualMachineInstance> {
        self.vmis().get_opt(name).await.expect("get VMI")
    }

    /// Waits until the VMI satisfies `ok`; on timeout the launcher log is shown.
    async fn wait_vmi(
        &self,
        vm: &Vm,
        what: &str,
        ok: impl Fn(&VirtualMachineInstance) -> bool,
    ) -> VirtualMachineInstance {
        let end = tokio::time::Instant::now() + common::BOOT;
        loop {
            if let Some(v) = self.vmi(&vm.name).await {
                if ok(&v) {
                    return v;
                }
                assert!(
                    tokio::time::Instant::now() < end,
                    "{}: timed out waiting for {what}; status {:#?}\nlauncher log:\n{}",
                    vm.name,
                    v.status,
                    vm.launcher.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// The reasons of the Events recorded on the VMI named `name`.
    async fn events(&self, name: &str) -> Vec<(String, String, String)> {
        let events: Api<Event> = Api::default_namespaced(self.client.clone());
        events
            .list(&ListParams::default())
            .await
            .expect("events")
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.note.unwrap_or_default(),
                )
            })
            .collect()
    }

    async fn wait_event(&self, name: &str, reason: &str) -> (String, String, String) {
        wait_for(
            &format!("event {reason} on {name}"),
            Duration::from_mins(1),
            || async {
                self.events(name)
                    .await
                    .into_iter()
                    .find(|(_, r, _)| r == reason)
            },
        )
        .await
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// How a scheduled VMI's stand-in pod differs from the plain one.
#[derive(Default)]
struct PodSetup<'a> {
    /// The pod's network namespace: the launcher runs in it and the VMI gets a masquerade
    /// interface on the pod network.
    netns: Option<&'a netfix::Netns>,
    /// The launcher keeps running after its domain ended (`--keep-after-shutdown`), as a pod
    /// that lingers after its VMI.
    keep_after_shutdown: bool,
    /// A kernel-boot VMI also gets this file as the hostDisk `data` (virtio, after `scratch`).
    data_disk: Option<&'a Path>,
}

/// The launcher's container-disk dir inside its "pod", where the handler mounts image files.
const CD_DIR: &str = "/var/run/kubevirt/container-disks";

/// A virt-launcher process as the kubelet would run it for a pod: in a mount namespace of its
/// own with the pod's `container-disks` emptyDir at KubeVirt's path, and, for a kernel-boot
/// VMI, the kernelBoot image container: the real `container-disk` program in a mount namespace
/// whose `/mnt` holds the guest's kernel and initrd, serving `kernel-boot.sock` in the same
/// emptyDir. The kernel reaches the launcher only through the handler's mounts. Dropping it
/// kills both (QEMU dies with the launcher through PR_SET_PDEATHSIG).
struct Launcher {
    child: Child,
    image: Option<Child>,
    socket: PathBuf,
    log: PathBuf,
}

impl Launcher {
    fn start(
        root: &Path,
        name: &str,
        uid: &str,
        pod_uid: &str,
        grace: i64,
        kernel: bool,
        pod_setup: &PodSetup<'_>,
    ) -> Self {
        // The launcher binds `<share>/sockets/launcher-sock.tmp-<pid>` first: too long a path
        // under the pod dir, so its sockets dir lives here and the pod's emptyDir links to it,
        // as the kubelet's emptyDir and the launcher's mount of it are one directory.
        let share = root.join(format!("l-{name}"));
        for d in ["sockets", "ephemeral", "container-disks", "hotplug"] {
            std::fs::create_dir_all(share.join(d)).expect("mkdir");
        }
        let empty_dir = root.join(pod_uid).join("volumes/kubernetes.io~empty-dir");
        std::fs::create_dir_all(&empty_dir).expect("mkdir");
        std::os::unix::fs::symlink(share.join("sockets"), empty_dir.join("sockets"))
            .expect("symlink");
        let log = share.join("launcher.log");
        let image = kernel.then(|| {
            Command::new("unshare")
                .args(["-m", "--propagation", "private", "sh", "-c"])
                .arg(r#"mount -t tmpfs image /mnt && cp "$1" "$2" /mnt/ && exec "$3" --copy-path "$4""#)
                .arg("sh")
                .arg(common::guest_file("vmlinuz"))
                .arg(common::guest_file("initrd.img"))
                .arg(common::workspace_bin(
                    "container-disk",
                    "CONTAINER_DISK_BIN",
                    "containerdisk",
                ))
                .arg(share.join("container-disks/kernel-boot"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(share.join("image.log")).expect("log"))
                .spawn()
                .expect("spawn the image container")
        });
        let arg = |p: PathBuf| p.display().to_string();
        let mut launcher = Command::new("unshare");
        if let Some(netns) = pod_setup.netns {
            netns.enter(&mut launcher);
        }
        let child = launcher
            .args(["-m", "--propagation", "private", "sh", "-c"])
            .arg(r#"mkdir -p "$2" && mount --bind "$1" "$2" && shift 2 && exec "$@""#)
            .arg("sh")
            .arg(share.join("container-disks"))
            .arg(CD_DIR)
            .arg(common::launcher_bin())
            .args(["--name", name, "--namespace", "default", "--uid", uid])
            .args(["--kubevirt-share-dir", &arg(share.clone())])
            .args(["--private-dir", &arg(root.join("private"))])
            .args(["--ephemeral-disk-dir", &arg(share.join("ephemeral"))])
            .args(["--container-disk-dir", CD_DIR])
            .args(["--hotplug-disk-dir", &arg(share.join("hotplug"))])
            .args(["--allow-emulation", "--qemu-timeout", "120s"])
            .args(["--grace-period-seconds", &(grace + 15).to_string()])
            .args(
                pod_setup
                    .keep_after_shutdown
                    .then_some("--keep-after-shutdown"),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn virt-launcher");
        let socket = pod_socket(root, pod_uid);
        let mut l = Launcher {
            child,
            image,
            socket,
            log,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !l.socket.exists() {
            let exited = l.child.try_wait().expect("wait");
            assert!(
                exited.is_none() && std::time::Instant::now() < deadline,
                "launcher socket {} never appeared ({exited:?})\n{}",
                l.socket.display(),
                l.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        l
    }

    fn client(&self) -> LauncherClient {
        LauncherClient::new(&self.socket, Duration::from_secs(30))
    }

    async fn domain(&self) -> Domain {
        self.client().domain().await.expect("domain")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn wait_exit(&mut self) -> std::process::ExitStatus {
        let end = tokio::time::Instant::now() + common::BOOT;
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                return s;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "the launcher did not exit\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        for c in std::iter::once(&mut self.child).chain(self.image.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

struct Vm {
    name: String,
    uid: String,
    launcher: Launcher,
}

fn phase(v: &VirtualMachineInstance) -> Option<api::VirtualMachineInstancePhase> {
    v.status.as_ref().and_then(|s| s.phase.clone())
}

fn is(p: api::VirtualMachineInstancePhase) -> impl Fn(&VirtualMachineInstance) -> bool {
    move |v| phase(v).as_ref() == Some(&p)
}

fn condition<'a>(
    v: &'a VirtualMachineInstance,
    t: &api::status::VirtualMachineInstanceConditionType,
) -> Option<&'a api::status::VirtualMachineInstanceCondition> {
    v.status.as_ref().and_then(|s| s.condition(t))
}

/// `GET /metrics` of the metrics router over `node`.
async fn scrape(node: Arc<Node>) -> String {
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;
    let slot: metrics::NodeSlot = Arc::default();
    slot.set(node).expect("empty slot");
    let resp = metrics::router(slot, metrics::DEFAULT_MAX_REQUESTS)
        .oneshot(
            http::Request::get("/metrics")
                .body(axum::body::Body::empty())
                .expect("request"),
        )
        .await
        .expect("response");
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8(body.to_vec()).expect("UTF-8")
}

/// `PUT <what>` on the console server's router until it answers 200: its VMI cache may lag
/// the status the test waited for by a moment.
async fn rest_put(console: &axum::Router, vmi: &str, what: &str) {
    use tower::ServiceExt as _;
    wait_for(
        &format!("PUT {what} answered 200"),
        Duration::from_mins(1),
        || async {
            let resp = console
                .clone()
                .oneshot(
                    http::Request::put(format!(
                        "/v1/namespaces/default/virtualmachineinstances/{vmi}/{what}"
                    ))
                    .body(axum::body::Body::empty())
                    .expect("request"),
                )
                .await
                .expect("response");
            (resp.status() == 200).then_some(())
        },
    )
    .await;
}

/// The test guest's freezable disk (docs/test-guest.md): a 16 MiB ext4 image labelled
/// `kvrs-data` at `path`, which the guest mounts at `/mnt/data`, and the disk and hostDisk
/// volume `data` that attach it.
fn data_disk(path: &Path) -> (serde_json::Value, serde_json::Value) {
    if !path.exists() {
        testguest::freezable_disk(path);
    }
    (
        json!({"name": "data", "disk": {"bus": "virtio"}}),
        json!({"name": "data", "hostDisk": {"path": path, "type": "Disk"}}),
    )
}

/// A merge patch setting the VMI's disks and volumes.
fn with_disks(disks: &serde_json::Value, volumes: &serde_json::Value) -> serde_json::Value {
    json!({"spec": {"domain": {"devices": {"disks": disks}}, "volumes": volumes}})
}

fn kill(pid: u32) {
    let ok = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {pid}");
}

#[tokio::test]
async fn guest_vmi_runs_survives_a_handler_restart_and_shuts_down_on_delete() {
    use api::VirtualMachineInstancePhase as Ph;
    use api::status::VirtualMachineInstanceConditionType as Cond;
    let mut h = Harness::start().await;
    let data_img = h.root.path().join("data-boot.img");
    let setup = PodSetup {
        data_disk: Some(&data_img),
        ..PodSetup::default()
    };
    let mut vm = h.schedule_in("boot", NODE, 120, true, &setup).await;

    let v = h.wait_vmi(&vm, "Running", is(Ph::Running)).await;
    let st = v.status.as_ref().expect("status");
    assert_eq!(
        st.node_name.as_deref(),
        Some(NODE),
        "the controller's field is kept"
    );
    let ready = condition(&v, &Cond::Ready).expect("Ready");
    assert_eq!(ready.status, api::ConditionStatus::True, "{ready:?}");
    assert!(
        st.phase_transition_timestamps
            .iter()
            .any(|t| t.phase == Some(Ph::Running))
    );
    h.wait_event("boot", "Started").await;

    // The guest boots: its ready marker reaches the serial log.
    let console = h
        .root
        .path()
        .join("private")
        .join(&vm.uid)
        .join("virt-serial0-log");
    wait_for("the guest's ready marker", common::BOOT, || async {
        std::fs::read_to_string(&console)
            .ok()
            .filter(|s| s.contains("KUBEVIRT-RS-GUEST-READY"))
    })
    .await;
    h.wait_vmi(&vm, "AgentConnected", |v| {
        condition(v, &Cond::AgentConnected).is_some()
    })
    .await;
    let before = vm.launcher.domain().await;
    let qemu = before.qemu_pid.expect("QEMU pid");

    // What the console server and /metrics see of it, through the launcher's pid.
    let node = Arc::clone(&h.running.as_ref().expect("loop").0);
    let target = NodeVmis::new(Arc::clone(&node))
        .lookup("default", "boot")
        .expect("known VMI");
    assert!(
        target.serial_socket.starts_with("/proc/") && target.serial_socket.exists(),
        "{}",
        target.serial_socket.display()
    );
    let text = scrape(Arc::clone(&node)).await;
    let labels = r#"namespace="default",name="boot",node="node-a""#;
    assert!(
        text.contains(&format!("kubevirt_vmi_memory_resident_bytes{{{labels}}} ")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "kubevirt_vmi_vcpu_seconds_total{{{labels},id=\"0\",state="
        )),
        "{text}"
    );
    assert!(
        text.contains(r#"kubevirt_vmi_phase_count{node="node-a",phase="running"} 1"#),
        "{text}"
    );
    let scratch_reads =
        format!("kubevirt_vmi_storage_read_traffic_bytes_total{{{labels},drive=\"scratch\"}} ");
    let read_bytes: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(scratch_reads.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {scratch_reads}in {text}"));
    assert!(
        read_bytes > 0,
        "the guest's kernel reads the scratch disk's partition table"
    );

    // A disk hotplugged into the running VM (the spec changed, as virt-api's addvolume does):
    // the loop syncs the new generation, the launcher plugs it, and the volume status says
    // Ready with the guest device; removed again, its entry goes.
    let scratch_disk = json!({"name": "scratch", "disk": {"bus": "virtio"}});
    let scratch_volume = json!({"name": "scratch", "emptyDisk": {"capacity": "16Mi"}});
    let (data, data_volume) = data_disk(&data_img);
    let volume = |v: &VirtualMachineInstance, name: &str| {
        v.status
            .as_ref()
            .and_then(|s| s.volume_status.iter().find(|e| e.name == name).cloned())
    };
    h.merge_patch(
        "boot",
        with_disks(
            &json!([scratch_disk, data, {"name": "hot", "disk": {"bus": "virtio"}}]),
            &json!([scratch_volume, data_volume, {"name": "hot", "emptyDisk": {"capacity": "8Mi"}}]),
        ),
        "hotplug a disk",
    )
    .await;
    let v = h
        .wait_vmi(&vm, "the hotplugged volume Ready", |v| {
            volume(v, "hot").is_some_and(|e| e.phase.as_deref() == Some("Ready"))
        })
        .await;
    let entry = volume(&v, "hot").expect("entry");
    // `scratch` is vda, `data` vdb.
    assert_eq!(
        (entry.target.as_str(), entry.reason.as_deref()),
        ("vdc", Some("VolumeReady")),
        "{entry:?}"
    );
    assert!(entry.hotplug_volume.is_some(), "{entry:?}");
    let (_, _, msg) = h.wait_event("boot", "VolumeReady").await;
    assert_eq!(msg, "Successfully attach hotplugged volume hot to VM");
    assert!(
        vm.launcher
            .domain()
            .await
            .disks
            .iter()
            .any(|d| d.name == "hot" && d.hotplugged)
    );
    h.merge_patch(
        "boot",
        with_disks(
            &json!([scratch_disk, data]),
            &json!([scratch_volume, data_volume]),
        ),
        "unplug the disk",
    )
    .await;
    h.wait_vmi(&vm, "the unplugged volume's entry gone", |v| {
        volume(v, "hot").is_none()
    })
    .await;
    h.wait_event("boot", "VolumeUnplugged").await;

    // A freeze through the console server: qemu-ga freezes the guest's ext4 data disk (its
    // one file system that can be frozen), the launcher relays guest-fsfreeze-status, and the
    // status says frozen.
    let frozen =
        |v: &VirtualMachineInstance| v.status.as_ref().and_then(|s| s.fs_freeze_status.clone());
    let console = handler::server::router(
        Arc::new(NodeVmis::new(node)),
        handler::server::Limits::default(),
    );
    rest_put(&console, "boot", "freeze").await;
    assert_eq!(
        vm.launcher.domain().await.fs_freeze_status,
        Some(FsFreeze::Frozen),
        "the agent's answer"
    );
    h.wait_vmi(&vm, "fsFreezeStatus frozen", |v| {
        frozen(v).as_deref() == Some("frozen")
    })
    .await;

    // The handler goes away; meanwhile the VM is paused behind its back. A new handler takes
    // over the running VM as it is and reconverges the status from the launcher's domain:
    // Paused, and still frozen (the guest is).
    h.stop_loop().await;
    vm.launcher.client().pause().await.expect("pause");
    h.start_loop().await;
    let v = h
        .wait_vmi(
            &vm,
            "the Paused condition, fsFreezeStatus still frozen",
            |v| condition(v, &Cond::Paused).is_some(),
        )
        .await;
    assert_eq!(frozen(&v).as_deref(), Some("frozen"), "after the restart");
    assert_eq!(
        condition(&v, &Cond::Paused).and_then(|c| c.reason.as_deref()),
        Some("PausedByUser")
    );
    let after = vm.launcher.domain().await;
    assert_eq!(after.qemu_pid, Some(qemu), "the same QEMU runs the VM");
    assert_eq!(after.state, DomainState::Paused);
    vm.launcher.client().unpause().await.expect("unpause");
    h.wait_vmi(&vm, "Paused to clear", |v| {
        condition(v, &Cond::Paused).is_none()
    })
    .await;
    h.wait_event("boot", "Resumed").await;

    // A thaw through the new loop's console server: the agent says thawed, the entry goes.
    let node = Arc::clone(&h.running.as_ref().expect("loop").0);
    let console = handler::server::router(
        Arc::new(NodeVmis::new(node)),
        handler::server::Limits::default(),
    );
    rest_put(&console, "boot", "unfreeze").await;
    h.wait_vmi(&vm, "fsFreezeStatus cleared by the thaw", |v| {
        frozen(v).is_none()
    })
    .await;
    assert_eq!(
        vm.launcher.domain().await.fs_freeze_status,
        Some(FsFreeze::Thawed)
    );

    // Deletion: ACPI power-down, the guest powers off, Succeeded.
    h.vmis()
        .delete("boot", &DeleteParams::default())
        .await
        .expect("delete");
    let v = h.wait_vmi(&vm, "Succeeded", is(Ph::Succeeded)).await;
    assert!(v.metadata.deletion_timestamp.is_some());
    assert_eq!(
        v.finalizers(),
        [FINALIZER],
        "the controller's finalizer is the controller's to release"
    );
    h.wait_event("boot", "ShuttingDown").await;
    let (kind, _, msg) = h.wait_event("boot", "Stopped").await;
    assert_eq!(
        (kind.as_str(), msg.as_str()),
        ("Normal", "The VirtualMachineInstance was shut down.")
    );
    let exit = vm.launcher.wait_exit().await;
    assert!(exit.success(), "the launcher ends after the guest: {exit}");

    // Playing the controller: its pod is gone, so it releases the finalizer; the VMI goes.
    h.merge_patch(
        "boot",
        json!({"metadata": {"finalizers": null}}),
        "release finalizer",
    )
    .await;
    wait_for("the VMI to be gone", Duration::from_secs(30), || async {
        h.vmi("boot").await.is_none().then_some(())
    })
    .await;
    h.stop_loop().await;
}

/// A VMI that ends while its launcher pod stays (deleted with no grace, so killed at once; the
/// launcher kept after its domain, as a pod lingers until the controller deletes it): the
/// handler undoes network phase 1 in the pod, as KubeVirt's VMI cleanup does, and leaves the
/// pod's own interface as it found it. Then the same for a VMI that vanishes (its finalizer
/// forced off) while its guest runs: the guest is powered down first.
#[tokio::test]
async fn guest_network_is_torn_down_when_the_vmi_ends_but_its_pod_stays() {
    use api::VirtualMachineInstancePhase as Ph;
    use api::status::VirtualMachineInstanceConditionType as Cond;
    let pod = netfix::Pod::new("hnd");
    let h = Harness::start().await;
    let setup = PodSetup {
        netns: Some(&pod.netns),
        keep_after_shutdown: true,
        data_disk: None,
    };
    let mut vm = h.schedule_in("net", NODE, 0, true, &setup).await;
    h.wait_vmi(&vm, "Running", is(Ph::Running)).await;

    let links = || {
        pod.netns
            .ip(&["-o", "link", "show"])
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_owned())
            .collect::<Vec<_>>()
    };
    let tables = || {
        let out = pod.netns.exec(&["nft", "list", "tables"]);
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let cache = h.root.path().join("private/vif-cache-eth0.json");
    let assert_wired = || {
        let wired = links();
        assert!(
            wired.iter().any(|l| l == "tap0") && wired.iter().any(|l| l == "k6t-eth0"),
            "{wired:?}"
        );
        assert!(!tables().is_empty(), "the masquerade NAT tables");
        assert!(cache.exists(), "{}", cache.display());
    };
    let torn_down = |what: &'static str| {
        wait_for(what, common::BOOT, || async {
            (links() == ["lo", "eth0"] && tables().is_empty() && !cache.exists()).then_some(())
        })
    };
    assert_wired();

    h.vmis()
        .delete("net", &DeleteParams::default())
        .await
        .expect("delete");
    h.wait_vmi(&vm, "Succeeded", is(Ph::Succeeded)).await;
    torn_down("the pod network torn down").await;
    let eth0 = pod.netns.ip(&["-o", "addr", "show", "eth0"]);
    assert!(
        eth0.contains(netfix::POD_IP),
        "the pod keeps its address: {eth0}"
    );
    assert!(
        vm.launcher.child.try_wait().expect("wait").is_none(),
        "the launcher, and so its pod, still runs"
    );
    h.merge_patch(
        "net",
        json!({"metadata": {"finalizers": null}}),
        "release finalizer",
    )
    .await;
    drop(vm);

    // A second VMI in the pod, booted so that it honours the power button, vanishes.
    let vm = h.schedule_in("gone", NODE, 30, true, &setup).await;
    h.wait_vmi(&vm, "AgentConnected", |v| {
        condition(v, &Cond::AgentConnected).is_some()
    })
    .await;
    assert_wired();
    h.merge_patch(
        "gone",
        json!({"metadata": {"finalizers": null}}),
        "force the finalizer off",
    )
    .await;
    h.vmis()
        .delete("gone", &DeleteParams::default())
        .await
        .expect("delete");
    torn_down("the pod network torn down after the VMI vanished").await;
    let d = vm.launcher.domain().await;
    assert_eq!(
        (d.state, d.reason.as_str()),
        (DomainState::Shutoff, "Shutdown"),
        "powered down, not killed"
    );
}

#[tokio::test]
async fn guest_killing_qemu_or_the_launcher_fails_the_vmi() {
    use api::VirtualMachineInstancePhase as Ph;
    let h = Harness::start().await;
    let crash = h.schedule("crash", NODE, 30, true).await;
    let mut gone = h.schedule("gone", NODE, 30, true).await;
    h.wait_vmi(&crash, "Running", is(Ph::Running)).await;
    h.wait_vmi(&gone, "Running", is(Ph::Running)).await;

    let qemu = crash.launcher.domain().await.qemu_pid.expect("QEMU pid");
    kill(qemu);
    h.wait_vmi(&crash, "Failed", is(Ph::Failed)).await;
    let (kind, _, msg) = h.wait_event("crash", "Stopped").await;
    assert_eq!(kind, "Warning");
    assert!(
        msg.starts_with("The VirtualMachineInstance crashed.") && msg.len() > 40,
        "the reason follows: {msg}"
    );

    kill(gone.launcher.child.id());
    gone.launcher.wait_exit().await;
    h.wait_vmi(&gone, "Failed", is(Ph::Failed)).await;
    let (kind, _, msg) = h.wait_event("gone", "Stopped").await;
    assert_eq!(kind, "Warning");
    assert!(msg.contains("virt-launcher is unresponsive"), "{msg}");
}

#[tokio::test]
async fn each_node_runs_only_its_own_vmis_and_a_refused_sync_is_reported() {
    use api::VirtualMachineInstancePhase as Ph;
    use api::status::VirtualMachineInstanceConditionType as Cond;
    let h = Harness::start().await;
    let theirs = h.schedule("elsewhere", "node-b", 30, false).await;
    // The launcher refuses these VMIs (a disk without a volume) before starting QEMU.
    let ours = h.schedule("invalid", NODE, 30, false).await;

    let v = h
        .wait_vmi(&ours, "Synchronized=False", |v| {
            condition(v, &Cond::Synchronized).is_some()
        })
        .await;
    let c = condition(&v, &Cond::Synchronized).expect("condition");
    assert_eq!(c.status, api::ConditionStatus::False);
    assert_eq!(c.reason.as_deref(), Some(SYNC_FAILED_REASON));
    assert!(
        c.message
            .as_deref()
            .is_some_and(|m| m.contains("spec.domain.devices.disks[0]")),
        "{c:?}"
    );
    assert_eq!(phase(&v), Some(Ph::Scheduled));
    let (kind, _, _) = h.wait_event("invalid", "SyncFailed").await;
    assert_eq!(kind, "Warning");

    // node-a's loop has handled its VMI; node-b's was never synced or written.
    let d = theirs.launcher.domain().await;
    assert_eq!((d.state, d.uid), (DomainState::NoState, None));
    let v = h.vmi("elsewhere").await.expect("VMI");
    assert!(
        v.status.iter().all(|s| s.conditions.is_empty()),
        "untouched: {:?}",
        v.status
    );
    assert!(h.events("elsewhere").await.is_empty());

    // A second node with its own handler takes exactly its own VMI.
    let mut cfg = h.config();
    cfg.node = "node-b".into();
    let stop_b = CancellationToken::new();
    let (_node_b, loop_b) = node::start(h.client.clone(), cfg, stop_b.clone())
        .await
        .expect("node-b loop");
    h.wait_vmi(&theirs, "node-b's Synchronized=False", |v| {
        condition(v, &Cond::Synchronized).is_some()
    })
    .await;
    h.wait_event("elsewhere", "SyncFailed").await;
    for (vmi, node) in [("elsewhere", "node-b"), ("invalid", NODE)] {
        let reporters: BTreeSet<String> = reporters(&h.client, vmi).await;
        assert_eq!(reporters, BTreeSet::from([node.to_owned()]), "{vmi}");
    }
    stop_b.cancel();
    loop_b.await.expect("node-b loop stops");
}

/// The handler instances (nodes) that recorded events on `vmi`.
async fn reporters(client: &Client, vmi: &str) -> BTreeSet<String> {
    let events: Api<Event> = Api::default_namespaced(client.clone());
    events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(vmi))
        .filter_map(|e| e.reporting_instance)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: prints figures; boots 10 TCG guests, two at a time"]
async fn bench_handler_rss_with_10_vmis() {
    use api::status::VirtualMachineInstanceConditionType as Cond;
    const VMIS: usize = 10;
    let h = Harness::without_loop().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = h.server.kubeconfig_path();
    let plugins = dir.path().join("kubelet/device-plugins");
    std::fs::create_dir_all(&plugins).expect("mkdir");
    let _registered = common::fake_kubelet(&plugins, h.stop.clone());
    let private = h.root.path().join("private");
    let handler = common::HandlerProcess::spawn(
        NODE,
        &kubeconfig,
        dir.path(),
        h.root.path(),
        &[
            "--kubevirt-private-dir",
            private.to_str().expect("UTF-8 path"),
        ],
    );
    handler.wait_healthy(Duration::from_mins(1)).await;
    let pid = handler.child.id();
    common::print_rss(pid, "0 VMIs, after /healthz", 10).await;

    // Two guests boot at a time (TCG on two shared cores); a pair is done when both agents
    // answer, which is after the guests' boot work.
    let mut vms = Vec::new();
    for pair in 0..VMIS / 2 {
        let mut booting = Vec::new();
        for i in 0..2 {
            booting.push(
                h.schedule(&format!("rss-{}", pair * 2 + i), NODE, 0, true)
                    .await,
            );
        }
        for vm in &booting {
            h.wait_vmi(vm, "AgentConnected", |v| {
                condition(v, &Cond::AgentConnected).is_some()
            })
            .await;
        }
        vms.extend(booting);
    }
    let (code, text) = handler.get("/metrics").await;
    assert_eq!(code, 200, "{text}");
    let resident = text
        .lines()
        .filter(|l| l.starts_with("kubevirt_vmi_memory_resident_bytes{"))
        .count();
    println!(
        "/metrics: {resident} VMIs with resident memory, {} bytes",
        text.len()
    );
    common::print_rss(
        pid,
        &format!("{VMIS} VMIs Running with agents connected"),
        30,
    )
    .await;
    drop(handler);
    drop(vms);
}
