//! The process kubelet against the upstream control plane (kube-apiserver with the Node
//! authorizer and NodeRestriction: each kubelet is `system:node:<name>`), with real namespaces,
//! mounts, cgroups and veths (we are root). Pods are bound by `spec.nodeName` unless a test runs
//! kube-scheduler.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::{Cluster, TestNode, eventually, fresh_node_name, pod, sh, wait_pod};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::{Value, json};

const IMAGE: &str = common::TOOLS_IMAGE;

fn condition(pod: &Value, kind: &str) -> Option<String> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .and_then(|c| c["status"].as_str().map(str::to_string))
}

fn mounts_mention(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .contains(path.to_str().unwrap_or("?"))
}

fn cgroup_dirs(node: &str, uid: &str) -> Vec<PathBuf> {
    ["pids", "memory", "cpu", "unified"]
        .iter()
        .map(|h| {
            Path::new("/sys/fs/cgroup")
                .join(h)
                .join("localcluster")
                .join(node)
                .join(format!("pod{uid}"))
        })
        .filter(|p| p.exists())
        .collect()
}

fn pids_in(dir: &Path) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(t) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(t.lines().filter_map(|l| l.parse::<i32>().ok()));
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            out.extend(pids_in(&e.path()));
        }
    }
    out
}

#[tokio::test]
async fn pod_runs_isolated_with_volumes_is_reachable_and_leaves_nothing_behind() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let node_name = node.name();
    let pods: Api<Pod> = cluster.api();
    let cms: Api<ConfigMap> = cluster.api();
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(
            json!({"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}}),
        )
        .unwrap(),
    )
    .await
    .expect("configmap");

    let mut server = sh(
        "server",
        "ip -o addr show > /data/addrs; hostname > /data/hostname; cat /etc/config/greeting > /data/greet; exec socat TCP-LISTEN:8080,fork,reuseaddr SYSTEM:'cat /etc/config/greeting'",
    );
    server["env"] = json!([
        {"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]);
    server["volumeMounts"] = json!([
        {"name": "data", "mountPath": "/data"},
        {"name": "config", "mountPath": "/etc/config", "readOnly": true},
    ]);
    server["readinessProbe"] =
        json!({"exec": {"command": ["cat", "/data/greet"]}, "periodSeconds": 1});
    let created = pods
        .create(
            &PostParams::default(),
            &pod(
                "server",
                &node_name,
                &json!({"containers": [server], "volumes": [
                    {"name": "data", "emptyDir": {}},
                    {"name": "config", "configMap": {"name": "cfg"}},
                ]}),
            ),
        )
        .await
        .expect("creating the server pod");
    let uid = created.metadata.uid.clone().expect("uid");

    let running = wait_pod(&pods, "server", "server Running and Ready", |p| {
        p["status"]["phase"] == "Running" && condition(p, "Ready").as_deref() == Some("True")
    })
    .await;
    let pod_ip = running["status"]["podIP"]
        .as_str()
        .expect("podIP")
        .to_string();
    assert_eq!(running["status"]["podIPs"][0]["ip"], pod_ip);
    assert_eq!(running["status"]["containerStatuses"][0]["ready"], true);
    assert!(running["status"]["containerStatuses"][0]["state"]["running"]["startedAt"].is_string());

    // The emptyDir lives where the kubelet keeps it, and the container wrote through its mount.
    let empty_dir = node
        .pods_dir()
        .join(&uid)
        .join("volumes/kubernetes.io~empty-dir/data");
    let addrs = std::fs::read_to_string(empty_dir.join("addrs")).expect("addrs in the emptyDir");
    assert!(addrs.contains(&format!("inet {pod_ip}/24")), "{addrs}");
    assert!(
        !addrs.contains("192.0.2.2"),
        "the pod sees the host's addresses: {addrs}"
    );
    let host_ifaces: Vec<String> = std::fs::read_dir("/sys/class/net")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "lo" && n != "eth0")
        .collect();
    for iface in &host_ifaces {
        assert!(
            !addrs.contains(&format!(" {iface} ")),
            "host interface {iface} visible: {addrs}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(empty_dir.join("greet")).unwrap(),
        "hello"
    );
    assert_eq!(
        std::fs::read_to_string(empty_dir.join("hostname")).unwrap(),
        "server\n",
        "the pod has its own host name"
    );
    // The mounts are private to the container: the host has no mount of the pod's volumes.
    assert!(!mounts_mention(&node.pods_dir()));

    // Another pod on the node reaches the server over TCP by pod IP.
    let client = sh(
        "client",
        &format!("echo got $(socat -T10 - TCP:{pod_ip}:8080,connect-timeout=10)"),
    );
    pods.create(
        &PostParams::default(),
        &pod(
            "client",
            &node_name,
            &json!({"restartPolicy": "Never", "containers": [client]}),
        ),
    )
    .await
    .expect("creating the client pod");
    let done = wait_pod(&pods, "client", "client Succeeded", |p| {
        matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
    })
    .await;
    let client_uid = done["metadata"]["uid"].as_str().unwrap().to_string();
    let log = node.kubelet().config().log_dir().join(format!(
        "{}_client_{client_uid}/client/0.log",
        cluster.namespace
    ));
    let log = std::fs::read_to_string(&log).unwrap_or_else(|e| format!("{}: {e}", log.display()));
    assert_eq!(done["status"]["phase"], "Succeeded", "client log: {log}");
    assert_eq!(log.trim(), "got hello");
    assert_eq!(
        done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"],
        0
    );

    // A changed ConfigMap reaches the running container, as the kubelet's pod sync projects
    // it again (the server reads the file anew for each connection).
    cms.patch(
        "cfg",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"data": {"greeting": "hello again"}})),
    )
    .await
    .expect("changing the configmap");
    let addr: std::net::SocketAddr = format!("{pod_ip}:8080").parse().unwrap();
    eventually(40, "the server to serve the changed greeting", || async {
        use tokio::io::AsyncReadExt as _;
        let mut conn = tokio::net::TcpStream::connect(addr).await.ok()?;
        let mut got = String::new();
        tokio::time::timeout(Duration::from_secs(5), conn.read_to_string(&mut got))
            .await
            .ok()?
            .ok()?;
        (got == "hello again").then_some(())
    })
    .await;

    // Delete: the process is killed and nothing the pod held is left.
    let cgroups = cgroup_dirs(&node_name, &uid);
    assert!(!cgroups.is_empty(), "the pod has cgroups");
    let pids: Vec<i32> = cgroups.iter().flat_map(|d| pids_in(d)).collect();
    assert!(!pids.is_empty(), "the server runs in its pod cgroup");
    let netns = format!("/run/netns/lc-{}", uid.replace('-', "").get(..11).unwrap());
    assert!(Path::new(&netns).exists(), "{netns}");
    pods.delete("server", &DeleteParams::default())
        .await
        .expect("deleting the server");
    eventually(60, "the server pod object gone", || async {
        pods.get_opt("server").await.ok()?.is_none().then_some(())
    })
    .await;
    for pid in &pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "pid {pid} survived"
        );
    }
    assert!(cgroup_dirs(&node_name, &uid).is_empty(), "cgroups left");
    assert!(!Path::new(&netns).exists(), "netns left");
    let veth = format!("lcv{}", uid.replace('-', "").get(..11).unwrap());
    assert!(
        !Path::new("/sys/class/net").join(&veth).exists(),
        "veth left"
    );
    assert!(!node.pods_dir().join(&uid).exists(), "pod dir left");

    let bridge = node.kubelet().config().bridge.clone();
    node.stop().await;
    assert!(
        !Path::new("/sys/class/net").join(&bridge).exists(),
        "bridge left"
    );
    assert!(
        !Path::new("/sys/fs/cgroup/pids/localcluster")
            .join(&node_name)
            .exists(),
        "node cgroup left"
    );
}

/// `NSpid:` of a host pid: its pid in every namespace from ours inwards.
fn ns_pids(pid: i32) -> Vec<i64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn pods_share_one_pid_namespace_unless_host_pid() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let node_name = node.name();
    let pods: Api<Pod> = cluster.api();
    // Each container records its pid and the pids its /proc shows, then stays.
    let record = |name: &str| {
        let mut c = sh(
            name,
            &format!(
                "echo $$ > /data/{name}.pid; sleep 1; ls /proc | grep -E '^[0-9]+$' > /data/{name}.procs; exec sleep 1000"
            ),
        );
        c["volumeMounts"] = json!([{"name": "data", "mountPath": "/data"}]);
        c
    };
    let volumes = json!([{"name": "data", "emptyDir": {}}]);
    let mut uids = Vec::new();
    for (name, host_pid) in [("shared", false), ("host", true)] {
        let created = pods
            .create(
                &PostParams::default(),
                &pod(
                    name,
                    &node_name,
                    &json!({"hostPID": host_pid, "volumes": volumes,
                        "containers": [record("a"), record("b")]}),
                ),
            )
            .await
            .expect("creating the pod");
        uids.push(created.metadata.uid.expect("uid"));
    }
    let data = |uid: &str, file: &str| {
        node.pods_dir()
            .join(uid)
            .join("volumes/kubernetes.io~empty-dir/data")
            .join(file)
    };
    let read_pid = |uid: &str, c: &str| -> i64 {
        std::fs::read_to_string(data(uid, &format!("{c}.pid")))
            .unwrap_or_default()
            .trim()
            .parse()
            .unwrap_or(0)
    };
    let read_procs = |uid: &str, c: &str| -> Vec<i64> {
        std::fs::read_to_string(data(uid, &format!("{c}.procs")))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect()
    };
    eventually(120, "every container recorded its view", || async {
        uids.iter()
            .all(|u| {
                ["a", "b"]
                    .iter()
                    .all(|c| data(u, &format!("{c}.procs")).exists())
            })
            .then_some(())
    })
    .await;
    // Both files are written by then (the pid first, the list after a second).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let host_pid_of = |uid: &str, c: &str| -> i32 {
        let dir = Path::new("/sys/fs/cgroup/pids/localcluster")
            .join(&node_name)
            .join(format!("pod{uid}"))
            .join(c);
        let dir = if dir.exists() {
            dir
        } else {
            Path::new("/sys/fs/cgroup/localcluster")
                .join(&node_name)
                .join(format!("pod{uid}"))
                .join(c)
        };
        pids_in(&dir)
            .into_iter()
            .min()
            .expect("the container's process")
    };

    // The pod's own namespace: both containers see each other and the pause process (1),
    // and not the host's processes; from the host they have their host pids, with the
    // inner one last in NSpid (what virt-handler reads).
    let shared = &uids[0];
    let (a, b) = (read_pid(shared, "a"), read_pid(shared, "b"));
    let procs = read_procs(shared, "a");
    assert!(procs.contains(&1), "the pause process is pid 1: {procs:?}");
    assert!(
        procs.contains(&a) && procs.contains(&b),
        "{a} {b} in {procs:?}"
    );
    assert!(procs.len() < 10, "host processes visible: {procs:?}");
    let host_a = host_pid_of(shared, "a");
    let nspid = ns_pids(host_a);
    assert_eq!(nspid.len(), 2, "{nspid:?}");
    assert_eq!(nspid[0], i64::from(host_a));
    assert_eq!(nspid[1], a);
    assert!(
        Path::new(&format!("/proc/{host_a}/root/data/a.pid")).exists(),
        "the container's root is reachable through its host pid"
    );

    // hostPID: the host's namespace.
    let host = &uids[1];
    let host_a = host_pid_of(host, "a");
    assert_eq!(read_pid(host, "a"), i64::from(host_a));
    assert_eq!(ns_pids(host_a), vec![i64::from(host_a)]);
    assert!(read_procs(host, "a").contains(&i64::from(std::process::id())));

    // SIGTERM reaches the container (not its waiter) on delete: a trap answers it (and
    // keeps the container running, so the grace period holds the pod and its files).
    let mut trapper = sh(
        "main",
        "trap 'echo term > /data/term' TERM; while true; do sleep 0.1; done",
    );
    trapper["volumeMounts"] = json!([{"name": "data", "mountPath": "/data"}]);
    let created = pods
        .create(
            &PostParams::default(),
            &pod(
                "trap",
                &node_name,
                &json!({"volumes": volumes, "containers": [trapper],
                    "terminationGracePeriodSeconds": 10}),
            ),
        )
        .await
        .expect("creating the pod");
    let trap_uid = created.metadata.uid.expect("uid");
    wait_pod(&pods, "trap", "the trap running", |p| {
        p["status"]["containerStatuses"][0]["state"]["running"].is_object()
    })
    .await;
    let term = data(&trap_uid, "term");
    pods.delete("trap", &DeleteParams::default())
        .await
        .expect("deleting");
    // Well before the grace period ends in SIGKILL (and the pod's files go).
    eventually(8, "the trap ran", || async { term.exists().then_some(()) }).await;
    for name in ["shared", "host"] {
        pods.delete(name, &DeleteParams::default())
            .await
            .expect("deleting");
    }
    eventually(60, "the pods gone", || async {
        let left = pods
            .list(&kube::api::ListParams::default())
            .await
            .ok()?
            .items;
        left.iter()
            .all(|p| p.metadata.name.as_deref() == Some("trap"))
            .then_some(())
    })
    .await;
    for uid in &uids {
        assert!(cgroup_dirs(&node_name, uid).is_empty(), "cgroups left");
    }
    node.stop().await;
}

#[tokio::test]
async fn init_containers_run_in_order_and_restart_policy_applies() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let node_name = node.name();
    let pods: Api<Pod> = cluster.api();
    let mount = json!([{"name": "w", "mountPath": "/w"}]);
    let with_mount = |mut c: Value| {
        c["volumeMounts"] = mount.clone();
        c
    };
    pods.create(
        &PostParams::default(),
        &pod(
            "ordered",
            &node_name,
            &json!({
                "restartPolicy": "OnFailure",
                "volumes": [{"name": "w", "emptyDir": {}}],
                "initContainers": [
                    with_mount(sh("first", "sleep 0.3; echo first >> /w/order")),
                    with_mount(sh("second", "echo second >> /w/order")),
                ],
                "containers": [with_mount(sh("main", "cat /w/order; exit 3"))],
            }),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "ordered", "main restarted twice", |p| {
        p["status"]["containerStatuses"][0]["restartCount"]
            .as_i64()
            .is_some_and(|n| n >= 2)
    })
    .await;
    let status = &p["status"];
    assert_eq!(status["phase"], "Running", "OnFailure keeps restarting");
    for (i, name) in ["first", "second"].iter().enumerate() {
        let s = &status["initContainerStatuses"][i];
        assert_eq!(s["name"], *name);
        assert_eq!(s["state"]["terminated"]["reason"], "Completed");
        assert_eq!(s["restartCount"], 0);
    }
    assert_eq!(condition(&p, "Initialized").as_deref(), Some("True"));
    assert_eq!(
        status["containerStatuses"][0]["lastState"]["terminated"]["exitCode"],
        3
    );
    let uid = p["metadata"]["uid"].as_str().unwrap();
    let log = node
        .kubelet()
        .config()
        .log_dir()
        .join(format!("{}_ordered_{uid}/main/0.log", cluster.namespace));
    assert_eq!(std::fs::read_to_string(log).unwrap(), "first\nsecond\n");

    // Never: a failing init container fails the pod and the app container never starts.
    pods.create(
        &PostParams::default(),
        &pod(
            "init-fails",
            &node_name,
            &json!({"restartPolicy": "Never",
                   "initContainers": [sh("boom", "exit 7")],
                   "containers": [sh("main", "sleep 100")]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "init-fails", "pod Failed", |p| {
        p["status"]["phase"] == "Failed"
    })
    .await;
    assert_eq!(
        p["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"],
        7
    );
    assert!(p["status"]["containerStatuses"][0]["state"]["waiting"].is_object());
    assert_eq!(condition(&p, "Initialized").as_deref(), Some("False"));

    // Never with a failing app container: Failed, no restart.
    pods.create(
        &PostParams::default(),
        &pod(
            "fails",
            &node_name,
            &json!({"restartPolicy": "Never", "containers": [sh("main", "exit 1")]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "fails", "pod Failed", |p| {
        p["status"]["phase"] == "Failed"
    })
    .await;
    assert_eq!(p["status"]["containerStatuses"][0]["restartCount"], 0);

    // An image missing from the store: the container waits with ErrImagePull, saying so.
    let mut unknown = sh("main", "true");
    unknown["image"] = json!("nginx:1");
    pods.create(
        &PostParams::default(),
        &pod("no-image", &node_name, &json!({"containers": [unknown]})),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "no-image", "ErrImagePull", |p| {
        p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "ErrImagePull"
    })
    .await;
    assert_eq!(p["status"]["phase"], "Pending");
    let message = p["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("docker.io/library/nginx:1 is not in the local image store")
            && message.contains("localcluster load"),
        "{message}"
    );

    // An image with neither entrypoint nor cmd, and no command: nothing to run.
    let bare = json!({"name": "main", "image": common::DISK_IMAGE});
    pods.create(
        &PostParams::default(),
        &pod("no-command", &node_name, &json!({"containers": [bare]})),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "no-command", "CreateContainerError", |p| {
        p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "CreateContainerError"
    })
    .await;
    let message = p["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("nothing to run"), "{message}");
    node.stop().await;
}

#[tokio::test]
async fn grace_period_ends_with_sigkill_and_node_heartbeats() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let node_name = node.name();
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(cluster.client.clone());
    let n = nodes.get(&node_name).await.expect("the node is registered");
    let n = serde_json::to_value(&n).unwrap();
    assert_eq!(n["metadata"]["labels"]["kubernetes.io/hostname"], node_name);
    assert_eq!(condition(&n, "Ready").as_deref(), Some("True"));
    assert!(n["status"]["allocatable"]["pods"].is_string());
    assert!(n["spec"]["podCIDR"].is_string());
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(cluster.client.clone(), "kube-node-lease");
    eventually(30, "the node lease", || async {
        leases.get_opt(&node_name).await.ok().flatten()
    })
    .await;

    let pods: Api<Pod> = cluster.api();
    // Ignores SIGTERM: only SIGKILL after the 2 s grace period ends it.
    pods.create(
        &PostParams::default(),
        &pod(
            "stubborn",
            &node_name,
            &json!({"terminationGracePeriodSeconds": 2, "containers": [sh("main", "trap '' TERM; while true; do sleep 0.2; done")]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "stubborn", "Running", |p| {
        p["status"]["phase"] == "Running"
    })
    .await;
    let uid = p["metadata"]["uid"].as_str().unwrap().to_string();
    let started = tokio::time::Instant::now();
    pods.delete("stubborn", &DeleteParams::default())
        .await
        .expect("deleting");
    let p = pods
        .get("stubborn")
        .await
        .expect("still there while terminating");
    assert!(p.metadata.deletion_timestamp.is_some());
    eventually(60, "the pod object gone", || async {
        pods.get_opt("stubborn").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "it waited out the grace period"
    );
    assert!(cgroup_dirs(&node_name, &uid).is_empty());
    node.stop().await;
}

/// A container's root is its image's layers (read-only, stacked by overlayfs) under its own
/// writable layer: nothing of the host's root shows, writes never reach the image store, and
/// KubeVirt's container-disk pattern works: an init container copies a static program out of
/// one image into an emptyDir that a container of a bare disk image (no shell, no libc) mounts
/// over `/usr/bin`.
#[tokio::test]
async fn containers_run_on_their_image_layers_only() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let pods: Api<Pod> = cluster.api();
    let copy = json!({"name": "copy", "image": IMAGE,
        "command": ["/bin/cp", "/bin/busybox", "/init/usr/bin/busybox"],
        "volumeMounts": [{"name": "bin", "mountPath": "/init/usr/bin"}]});
    // The host has /etc/debian_version and cargo; the image has busybox and socat only.
    let mut alone = sh(
        "alone",
        "test ! -e /etc/debian_version && test ! -e /root/.cargo && test ! -e /disk \
         && test -x /bin/busybox && test -x /usr/bin/socat \
         && echo changed > /usr/bin/socat && echo alone",
    );
    alone["volumeMounts"] = json!([{"name": "out", "mountPath": "/out"}]);
    let disk = json!({"name": "disk", "image": common::DISK_IMAGE,
        "command": ["/usr/bin/busybox", "sh", "-c",
                    "/usr/bin/busybox cat /disk/disk.qcow2; echo changed > /disk/disk.qcow2"],
        "volumeMounts": [{"name": "bin", "mountPath": "/usr/bin"}]});
    pods.create(
        &PostParams::default(),
        &pod(
            "layers",
            &node.name(),
            &json!({"restartPolicy": "Never",
                    "volumes": [{"name": "bin", "emptyDir": {}}, {"name": "out", "emptyDir": {}}],
                    "initContainers": [copy], "containers": [alone, disk]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "layers", "pod finished", |p| {
        matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
    })
    .await;
    assert_eq!(p["status"]["phase"], "Succeeded", "{p}");
    assert_eq!(
        container_log(&node, &cluster.namespace, &p, "alone"),
        "alone\n"
    );
    assert_eq!(
        container_log(&node, &cluster.namespace, &p, "disk"),
        "not really qcow2"
    );
    // Each container wrote into its own upper layer; the store's layers are untouched.
    let store = common::images();
    let disk_image = store.resolve(common::DISK_IMAGE).unwrap();
    assert_eq!(
        std::fs::read_to_string(disk_image.layers[0].join("disk/disk.qcow2")).unwrap(),
        "not really qcow2"
    );
    let tools = store.resolve(IMAGE).unwrap();
    assert_eq!(
        std::fs::read(tools.layers[0].join("usr/bin/socat")).unwrap(),
        std::fs::read("/usr/bin/socat").unwrap()
    );
    let statuses = p["status"]["containerStatuses"].as_array().unwrap();
    let ids: Vec<&str> = statuses
        .iter()
        .filter_map(|c| c["imageID"].as_str())
        .collect();
    assert!(
        ids.contains(&tools.id.as_str()) && ids.contains(&disk_image.id.as_str()),
        "imageID is repository@digest: {ids:?}"
    );
    node.stop().await;
}

#[tokio::test]
async fn http_and_tcp_readiness_probes() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let pods: Api<Pod> = cluster.api();
    let mut web = sh(
        "web",
        "mkdir /www && echo up > /www/index.html && exec httpd -f -p 8080 -h /www",
    );
    web["ports"] = json!([{"name": "http", "containerPort": 8080}]);
    web["readinessProbe"] = json!({"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1});
    let mut tcp = sh(
        "tcp",
        "exec socat TCP-LISTEN:8081,fork,reuseaddr SYSTEM:true",
    );
    tcp["readinessProbe"] = json!({"tcpSocket": {"port": 8081}, "periodSeconds": 1});
    let mut never = sh("never", "exec sleep 1000");
    never["readinessProbe"] = json!({"httpGet": {"path": "/", "port": 9999}, "periodSeconds": 1});
    pods.create(
        &PostParams::default(),
        &pod(
            "probed",
            &node.name(),
            &json!({"containers": [web, tcp, never]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "probed", "web and tcp ready", |p| {
        let s = &p["status"]["containerStatuses"];
        s[0]["ready"] == true && s[1]["ready"] == true
    })
    .await;
    assert_eq!(p["status"]["containerStatuses"][2]["ready"], false);
    assert_eq!(condition(&p, "Ready").as_deref(), Some("False"));
    node.stop().await;
}

/// A condition's `(status, reason, message)`.
fn condition_detail(pod: &Value, kind: &str) -> Option<(String, String, String)> {
    let c = pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)?;
    let text = |k: &str| c[k].as_str().unwrap_or_default().to_string();
    Some((text("status"), text("reason"), text("message")))
}

#[tokio::test]
async fn readiness_gates_are_kept_and_hold_ready_until_true() {
    const GATE: &str = "kubevirt.io/virtual-machine-unpaused";
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let pods: Api<Pod> = cluster.api();
    let mut c = sh("main", "exec sleep 1000");
    c["volumeMounts"] = json!([{"name": "flags", "mountPath": "/flags"}]);
    // The probe runs in the container's PID namespace, as a CRI exec: `/proc/self` (which
    // virt-probe connects through) resolves only there.
    c["readinessProbe"] = json!({"exec": {"command": ["sh", "-c",
        "test -f /flags/ready && test -d /proc/self/fd"]}, "periodSeconds": 1});
    let created = pods
        .create(
            &PostParams::default(),
            &pod(
                "gated",
                &node.name(),
                &json!({"containers": [c], "readinessGates": [{"conditionType": GATE}],
                    "volumes": [{"name": "flags", "emptyDir": {}}]}),
            ),
        )
        .await
        .expect("creating the pod");
    let uid = created.metadata.uid.expect("uid");
    let flag = node
        .pods_dir()
        .join(&uid)
        .join("volumes/kubernetes.io~empty-dir/flags/ready");
    wait_pod(&pods, "gated", "the container running", |p| {
        p["status"]["containerStatuses"][0]["state"]["running"].is_object()
    })
    .await;
    std::fs::write(&flag, "").expect("writing the readiness flag");

    let p = wait_pod(&pods, "gated", "containers ready", |p| {
        condition(p, "ContainersReady").as_deref() == Some("True")
    })
    .await;
    let held_by_gate = |p: &Value, why: String| {
        assert_eq!(
            condition_detail(p, "Ready"),
            Some(("False".into(), "ReadinessGatesNotReady".into(), why))
        );
    };
    held_by_gate(
        &p,
        format!("corresponding condition of pod readiness gate \"{GATE}\" does not exist."),
    );

    // Set as virt-controller does: a JSON patch on the status subresource.
    let add_gate: json_patch::Patch = serde_json::from_value(json!([{"op": "add",
        "path": "/status/conditions/-", "value": {"type": GATE, "status": "True"}}]))
    .expect("patch");
    pods.patch_status(
        "gated",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Json::<()>(add_gate),
    )
    .await
    .expect("setting the gate");
    wait_pod(&pods, "gated", "Ready once the gate is True", |p| {
        condition(p, "Ready").as_deref() == Some("True")
    })
    .await;

    // The kubelet's next writes (the container turning unready, then ready) keep the gate.
    std::fs::remove_file(&flag).expect("removing the readiness flag");
    let p = wait_pod(&pods, "gated", "containers unready", |p| {
        condition(p, "ContainersReady").as_deref() == Some("False")
    })
    .await;
    assert_eq!(condition(&p, GATE).as_deref(), Some("True"), "{p:#}");
    assert_eq!(condition(&p, "Ready").as_deref(), Some("False"));
    std::fs::write(&flag, "").expect("writing the readiness flag");
    let p = wait_pod(&pods, "gated", "ready again", |p| {
        condition(p, "Ready").as_deref() == Some("True")
    })
    .await;
    assert_eq!(condition(&p, GATE).as_deref(), Some("True"));

    pods.patch_status(
        "gated",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Strategic(
            json!({"status": {"conditions": [{"type": GATE, "status": "False"}]}}),
        ),
    )
    .await
    .expect("clearing the gate");
    let p = wait_pod(&pods, "gated", "unready once the gate is False", |p| {
        condition(p, "Ready").as_deref() == Some("False")
    })
    .await;
    held_by_gate(
        &p,
        format!("the status of pod readiness gate \"{GATE}\" is not \"True\", but False"),
    );
    assert_eq!(condition(&p, "ContainersReady").as_deref(), Some("True"));
    node.stop().await;
}

#[tokio::test]
async fn failing_liveness_probe_restarts_the_container() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let pods: Api<Pod> = cluster.api();
    let mut c = sh(
        "main",
        "touch /tmp/alive; sleep 1; rm /tmp/alive; exec sleep 1000",
    );
    c["livenessProbe"] = json!({"exec": {"command": ["test", "-f", "/tmp/alive"]},
        "periodSeconds": 1, "failureThreshold": 2});
    pods.create(
        &PostParams::default(),
        &pod("live", &node.name(), &json!({"containers": [c]})),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "live", "a liveness restart", |p| {
        p["status"]["containerStatuses"][0]["restartCount"]
            .as_i64()
            .is_some_and(|n| n >= 1)
    })
    .await;
    assert_eq!(
        p["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"], 137,
        "killed by SIGKILL"
    );
    node.stop().await;
}

/// The log of a finished container, read from the node's log dir.
fn container_log(node: &TestNode, namespace: &str, pod: &Value, container: &str) -> String {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
    let path = node
        .kubelet()
        .config()
        .log_dir()
        .join(format!("{namespace}_{name}_{uid}/{container}/0.log"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| format!("{}: {e}", path.display()))
}

/// The image's entrypoint, cmd, environment and working directory, with Kubernetes' rules for
/// `command`, `args`, `env` and `workingDir` over them.
#[tokio::test]
async fn image_entrypoint_cmd_env_and_workdir_apply() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let pods: Api<Pod> = cluster.api();
    let out = json!([{"name": "out", "mountPath": "/out"}]);
    let c = |name: &str, extra: Value| {
        let mut c = json!({"name": name, "image": common::ENTRY_IMAGE, "volumeMounts": out,
                           "env": [{"name": "NAME", "value": name}]});
        json_patch::merge(&mut c, &extra);
        c
    };
    let containers = json!([
        c("image", json!({})),
        c(
            "args",
            json!({"args": ["x", "y"],
                         "env": [{"name": "NAME", "value": "args"}, {"name": "GREETING", "value": "pod"}]})
        ),
        c(
            "command",
            json!({"command": ["/bin/sh", "-c", "echo \"$0 $GREETING $(pwd) $PATH\" > /out/command"],
                            "workingDir": "/tmp"})
        ),
    ]);
    pods.create(
        &PostParams::default(),
        &pod(
            "entry",
            &node.name(),
            &json!({"restartPolicy": "Never", "containers": containers,
                    "volumes": [{"name": "out", "emptyDir": {}}]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "entry", "pod finished", |p| {
        matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
    })
    .await;
    assert_eq!(p["status"]["phase"], "Succeeded", "{p}");
    let uid = p["metadata"]["uid"].as_str().unwrap();
    let read = |name: &str| {
        std::fs::read_to_string(
            node.pods_dir()
                .join(uid)
                .join("volumes/kubernetes.io~empty-dir/out")
                .join(name),
        )
        .unwrap()
    };
    assert_eq!(read("image"), "from-cmd image /app /app/bin:/bin\n");
    assert_eq!(read("args"), "x y pod /app /app/bin:/bin\n");
    assert_eq!(read("command"), "/bin/sh image /tmp /app/bin:/bin\n");
    node.stop().await;
}

/// The in-cluster configuration through the real path: kube-apiserver's ServiceAccount
/// admission adds the `kube-api-access-*` projected volume, the kubelet fills it with a token
/// from TokenRequest, the `kubernetes` Service's cluster IP (10.96.0.1) in
/// `KUBERNETES_SERVICE_HOST` reaches kube-apiserver through kube-proxy's nftables rules (from a
/// pod network namespace and from the host's), and the token authenticates as the pod's
/// service account, which RBAC then holds to what it was granted. kube-scheduler binds the pods.
/// kube-proxy owns the host's `kube-proxy` nftables tables, so this test is in nextest's `e2e`
/// group (one at a time on the machine).
#[tokio::test]
async fn kube_proxy_serves_the_kubernetes_service_to_pods_with_their_own_tokens() {
    let node_name = fresh_node_name();
    let proxy_node = node_name.clone();
    let mut cluster = Cluster::start_with(|c| {
        c.scheduler = true;
        c.proxy_node = Some(proxy_node);
    })
    .await;
    let node = TestNode::start_named(&cluster, &node_name, false, |_| {}).await;
    // Once the node exists: kube-proxy reads its addresses at start.
    cluster.plane.start_proxy().await.expect("kube-proxy");
    let ns = cluster.namespace.clone();
    // The namespace's default service account may read (not secrets), and nothing more.
    let (ok, _, err) = cluster
        .kubectl(&[
            "create",
            "rolebinding",
            "default-view",
            "--clusterrole=view",
            &format!("--serviceaccount={ns}:default"),
        ])
        .await;
    assert!(ok, "{err}");
    // kube-proxy has programmed the Service once the host reaches it.
    let service =
        std::net::SocketAddr::from((localcluster::controlplane::KUBERNETES_SERVICE_IP, 443));
    eventually(120, "10.96.0.1:443 through kube-proxy", || async {
        tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::TcpStream::connect(service),
        )
        .await
        .ok()?
        .ok()
    })
    .await;

    let pods: Api<Pod> = cluster.api();
    // With the projected token: a request RBAC refuses (403, naming the service account, so
    // the token authenticated), then kubectl with no kubeconfig (in-cluster configuration)
    // listing the pods, which `view` allows. The token file is read-only.
    let script = "set -e; d=/var/run/secrets/kubernetes.io/serviceaccount; \
        test \"$(cat $d/namespace)\" = \"$NS\"; test -s $d/ca.crt; \
        echo \"$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT\"; \
        curl -sS --max-time 20 --cacert $d/ca.crt -H \"Authorization: Bearer $(cat $d/token)\" \
          -o /tmp/body -w 'status %{http_code}\\n' \
          https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/api/v1/namespaces/$NS/secrets; \
        cat /tmp/body; echo; \
        /opt/kube/kubectl get pods -o name; \
        if echo x > $d/token; then exit 9; fi";
    // kubectl is the control plane's multi-call binary (static), from the host.
    let kube_dir = localcluster::controlplane::kube_binary()
        .expect("the kube binary")
        .parent()
        .expect("its directory")
        .to_path_buf();
    let with_ns = |mut c: Value| {
        c["env"] =
            json!([{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]);
        c["volumeMounts"] = json!([{"name": "kube", "mountPath": "/opt/kube", "readOnly": true}]);
        c
    };
    let kube_volume = json!([{"name": "kube", "hostPath": {"path": kube_dir}}]);
    let no_token = sh(
        "main",
        "test \"$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT\" = 10.96.0.1:443 \
         && test ! -e /var/run/secrets/kubernetes.io/serviceaccount",
    );
    let names = ["incluster", "incluster-host", "no-token"];
    for (name, spec) in names.iter().zip([
        json!({"containers": [with_ns(sh("main", script))], "volumes": kube_volume}),
        json!({"hostNetwork": true, "containers": [with_ns(sh("main", script))],
               "volumes": kube_volume}),
        json!({"automountServiceAccountToken": false, "containers": [no_token]}),
    ]) {
        let mut p = json!({"metadata": {"name": name}, "spec": spec});
        p["spec"]["restartPolicy"] = json!("Never");
        pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap())
            .await
            .expect("creating the pod");
    }
    let user = format!("system:serviceaccount:{ns}:default");
    for name in names {
        let p = wait_pod(&pods, name, "pod finished", |p| {
            matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
        })
        .await;
        assert_eq!(
            p["spec"]["nodeName"],
            node_name.as_str(),
            "kube-scheduler bound it"
        );
        let log = container_log(&node, &ns, &p, "main");
        assert_eq!(p["status"]["phase"], "Succeeded", "{name}: {log}");
        let has_token_volume = p["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|v| {
                v["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("kube-api-access-"))
            });
        assert_eq!(has_token_volume, name != "no-token", "{name}: {p:#}");
        if name != "no-token" {
            assert!(
                log.starts_with("10.96.0.1:443\nstatus 403\n"),
                "{name} was told the Service and refused the secrets: {log}"
            );
            assert!(
                log.contains(&format!(
                    "User \\\"{user}\\\" cannot list resource \\\"secrets\\\""
                )),
                "{name} authenticated as its service account: {log}"
            );
            assert!(
                log.contains(&format!("pod/{name}\n")),
                "{name} listed itself: {log}"
            );
        }
    }
    node.stop().await;
}

/// A device plugin for `example.com/widget`: devices from a watch channel, and an Allocate
/// answer with an env var naming the ids, a mount and a device node.
struct Widgets {
    devices: tokio::sync::watch::Receiver<Vec<(&'static str, bool)>>,
    mount: PathBuf,
}

type WidgetStream = std::pin::Pin<
    Box<
        dyn futures::Stream<
                Item = Result<kubelet_api::v1beta1::ListAndWatchResponse, tonic::Status>,
            > + Send,
    >,
>;

#[tonic::async_trait]
impl kubelet_api::v1beta1::device_plugin_server::DevicePlugin for Widgets {
    type ListAndWatchStream = WidgetStream;

    async fn get_device_plugin_options(
        &self,
        _: tonic::Request<kubelet_api::v1beta1::Empty>,
    ) -> Result<tonic::Response<kubelet_api::v1beta1::DevicePluginOptions>, tonic::Status> {
        Ok(tonic::Response::new(
            kubelet_api::v1beta1::DevicePluginOptions::default(),
        ))
    }

    async fn list_and_watch(
        &self,
        _: tonic::Request<kubelet_api::v1beta1::Empty>,
    ) -> Result<tonic::Response<WidgetStream>, tonic::Status> {
        let rx = self.devices.clone();
        let stream = futures::stream::unfold((rx, true), |(mut rx, first)| async move {
            if !first {
                rx.changed().await.ok()?;
            }
            let devices = rx
                .borrow_and_update()
                .iter()
                .map(|(id, healthy)| kubelet_api::v1beta1::Device {
                    id: (*id).to_string(),
                    health: if *healthy {
                        kubelet_api::HEALTHY
                    } else {
                        kubelet_api::UNHEALTHY
                    }
                    .into(),
                    topology: None,
                })
                .collect();
            Some((
                Ok(kubelet_api::v1beta1::ListAndWatchResponse { devices }),
                (rx, false),
            ))
        });
        Ok(tonic::Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: tonic::Request<kubelet_api::v1beta1::PreferredAllocationRequest>,
    ) -> Result<tonic::Response<kubelet_api::v1beta1::PreferredAllocationResponse>, tonic::Status>
    {
        Err(tonic::Status::unimplemented("not offered"))
    }

    async fn allocate(
        &self,
        req: tonic::Request<kubelet_api::v1beta1::AllocateRequest>,
    ) -> Result<tonic::Response<kubelet_api::v1beta1::AllocateResponse>, tonic::Status> {
        let container_responses = req
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| kubelet_api::v1beta1::ContainerAllocateResponse {
                envs: [("WIDGET_IDS".to_string(), c.devices_ids.join(","))].into(),
                mounts: vec![kubelet_api::v1beta1::Mount {
                    container_path: "/widget".into(),
                    host_path: self.mount.display().to_string(),
                    read_only: true,
                }],
                devices: vec![kubelet_api::v1beta1::DeviceSpec {
                    container_path: "/dev/lc-widget".into(),
                    host_path: "/dev/null".into(),
                    permissions: "rw".into(),
                }],
                ..Default::default()
            })
            .collect();
        Ok(tonic::Response::new(
            kubelet_api::v1beta1::AllocateResponse {
                container_responses,
            },
        ))
    }

    async fn pre_start_container(
        &self,
        _: tonic::Request<kubelet_api::v1beta1::PreStartContainerRequest>,
    ) -> Result<tonic::Response<kubelet_api::v1beta1::PreStartContainerResponse>, tonic::Status>
    {
        Ok(tonic::Response::new(
            kubelet_api::v1beta1::PreStartContainerResponse {},
        ))
    }
}

async fn node_resource(
    cluster: &Cluster,
    node: &str,
    which: &str,
    resource: &str,
) -> Option<String> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(cluster.client.clone());
    let n = serde_json::to_value(nodes.get(node).await.ok()?).ok()?;
    n["status"][which][resource].as_str().map(str::to_string)
}

#[tokio::test]
async fn device_plugins_register_report_devices_and_allocate_to_containers() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let node_name = node.name();
    let plugins_dir = node.kubelet().config().kubelet_dir().join("device-plugins");
    let kubelet_sock = plugins_dir.join(kubelet_api::KUBELET_SOCKET);
    assert!(kubelet_sock.exists(), "{} served", kubelet_sock.display());

    let mount = tempfile::tempdir().expect("mount dir");
    std::fs::write(mount.path().join("hello"), "hi\n").unwrap();
    let (devices_tx, devices_rx) =
        tokio::sync::watch::channel(vec![("w0", true), ("w1", false), ("w2", true)]);
    let socket = plugins_dir.join("widget.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("plugin socket");
    let incoming = futures::stream::unfold(listener, |l| async move {
        Some((l.accept().await.map(|(s, _)| s), l))
    });
    let plugin = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                kubelet_api::v1beta1::device_plugin_server::DevicePluginServer::new(Widgets {
                    devices: devices_rx,
                    mount: mount.path().to_path_buf(),
                }),
            )
            .serve_with_incoming(incoming),
    );
    let sock = kubelet_sock.clone();
    let channel = tonic::transport::Endpoint::from_static("http://kubelet.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let sock = sock.clone();
            async move {
                tokio::net::UnixStream::connect(sock)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
        .expect("dialling kubelet.sock");
    let mut registration =
        kubelet_api::v1beta1::registration_client::RegistrationClient::new(channel);
    let refused = registration
        .register(kubelet_api::v1beta1::RegisterRequest {
            version: "v1alpha1".into(),
            endpoint: "widget.sock".into(),
            resource_name: "example.com/widget".into(),
            options: None,
        })
        .await
        .expect_err("an old API version is refused");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    registration
        .register(kubelet_api::v1beta1::RegisterRequest {
            version: kubelet_api::API_VERSION.into(),
            endpoint: "widget.sock".into(),
            resource_name: "example.com/widget".into(),
            options: None,
        })
        .await
        .expect("registering");

    // Capacity counts every device, allocatable the healthy ones.
    eventually(30, "widgets on the node", || async {
        let capacity =
            node_resource(&cluster, &node_name, "capacity", "example.com/widget").await?;
        let allocatable =
            node_resource(&cluster, &node_name, "allocatable", "example.com/widget").await?;
        (capacity == "3" && allocatable == "2").then_some(())
    })
    .await;

    let mut c = sh(
        "main",
        "echo $WIDGET_IDS; cat /widget/hello; test -c /dev/lc-widget && echo x > /dev/lc-widget",
    );
    c["resources"] = json!({"limits": {"example.com/widget": "2"}});
    let pods: Api<Pod> = cluster.api();
    pods.create(
        &PostParams::default(),
        &pod(
            "widgets",
            &node_name,
            &json!({"restartPolicy": "Never", "containers": [c]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "widgets", "pod finished", |p| {
        matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
    })
    .await;
    let log = container_log(&node, &cluster.namespace, &p, "main");
    assert_eq!(p["status"]["phase"], "Succeeded", "{log}");
    assert_eq!(
        log, "w0,w2\nhi\n",
        "the healthy devices, their mount and device"
    );

    // A health change reaches the node status; so does the plugin going away.
    devices_tx.send_replace(vec![("w0", false), ("w1", false), ("w2", true)]);
    eventually(30, "one healthy widget", || async {
        (node_resource(&cluster, &node_name, "allocatable", "example.com/widget").await? == "1")
            .then_some(())
    })
    .await;
    plugin.abort();
    drop(devices_tx);
    eventually(
        30,
        "no allocatable widget once the plugin is gone",
        || async {
            (node_resource(&cluster, &node_name, "allocatable", "example.com/widget").await? == "0")
                .then_some(())
        },
    )
    .await;
    node.stop().await;
    assert!(!kubelet_sock.exists(), "kubelet.sock removed on stop");
}

#[tokio::test]
async fn a_starting_kubelet_sweeps_what_a_killed_one_left() {
    let cluster = Cluster::start().await;
    let stale_uid = uuid::Uuid::new_v4().to_string();
    let stray = format!("lcv{}", &uuid::Uuid::new_v4().simple().to_string()[..11]);
    let mut stale = None;
    let node = TestNode::start_config(&cluster, |c| {
        // What a kubelet killed with SIGKILL leaves: the bridge with a pod's veth, the pod's
        // netns and directories, and a veth whose pod directory is already gone.
        localcluster::kubelet::network::ensure_bridge(&c.bridge, c.pod_cidr).expect("bridge");
        let net = localcluster::kubelet::network::PodNetwork::for_uid(
            &stale_uid,
            c.pod_cidr
                .allocate(&std::collections::BTreeSet::new())
                .expect("an address"),
        );
        net.create(&c.bridge, c.pod_cidr)
            .expect("a stale pod network");
        let ip = localcluster::kubelet::network::ip;
        ip(&[
            "link",
            "add",
            &stray,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{stray}p"),
        ])
        .expect("a stray veth");
        ip(&["link", "set", &stray, "master", &c.bridge]).expect("on the bridge");
        let pod_dir = c.pods_dir().join(&stale_uid);
        std::fs::create_dir_all(pod_dir.join("volumes/kubernetes.io~empty-dir/data")).unwrap();
        let log_dir = c.log_dir().join(format!("ns_p_{stale_uid}"));
        std::fs::create_dir_all(&log_dir).unwrap();
        stale = Some((net, pod_dir, log_dir));
    })
    .await;
    let (net, pod_dir, log_dir) = stale.expect("stale state made");
    assert!(!net.netns_path().exists(), "stale netns left");
    for veth in [&net.host_veth, &stray] {
        assert!(
            !Path::new("/sys/class/net").join(veth).exists(),
            "stale veth {veth} left"
        );
    }
    assert!(!pod_dir.exists(), "stale pod dir left");
    assert!(!log_dir.exists(), "stale log dir left");
    // The node works as before.
    let pods: Api<Pod> = cluster.api();
    pods.create(
        &PostParams::default(),
        &pod(
            "after",
            &node.name(),
            &json!({"restartPolicy": "Never", "containers": [sh("main", "true")]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "after", "pod finished", |p| {
        matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
    })
    .await;
    assert_eq!(p["status"]["phase"], "Succeeded");
    node.stop().await;
}

/// Runs kubectl in the test namespace; its output.
async fn kubectl(cluster: &Cluster, args: &[&str]) -> std::process::Output {
    cluster.kubectl_output(args, None).await
}

/// kube-apiserver reads `pods/log` from the node's kubelet API (its client certificate, the
/// node's serving certificate).
#[tokio::test]
async fn kubectl_logs_reads_containers_previous_runs_and_follows() {
    use futures::{AsyncBufReadExt as _, StreamExt as _};
    let cluster = Cluster::start().await;
    let node = TestNode::start_serving(&cluster).await;
    let pods: Api<Pod> = cluster.api();
    let mut a = sh("a", "printf 'a1\\na2\\na3\\n'; exec sleep 1000");
    a["volumeMounts"] = json!([{"name": "w", "mountPath": "/w"}]);
    // The first run of b fails; the second ticks until deleted.
    let mut b = sh(
        "b",
        "if [ ! -e /w/ran ]; then touch /w/ran; echo first; exit 1; fi; \
         i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done",
    );
    b["volumeMounts"] = json!([{"name": "w", "mountPath": "/w"}]);
    pods.create(
        &PostParams::default(),
        &pod(
            "talker",
            &node.name(),
            &json!({"restartPolicy": "OnFailure", "volumes": [{"name": "w", "emptyDir": {}}],
                    "containers": [a, b]}),
        ),
    )
    .await
    .expect("creating the pod");
    wait_pod(&pods, "talker", "b restarted", |p| {
        p["status"]["containerStatuses"][1]["restartCount"] == 1
            && p["status"]["containerStatuses"][1]["state"]["running"].is_object()
    })
    .await;

    // kubectl picks the first container itself; the API wants one named.
    let out = kubectl(&cluster, &["logs", "talker"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "a1\na2\na3\n");
    let err = pods
        .logs("talker", &kube::api::LogParams::default())
        .await
        .expect_err("two containers and none named")
        .to_string();
    assert!(
        err.contains("a container name must be specified for pod talker, choose one of: [a b]"),
        "{err}"
    );
    let out = kubectl(&cluster, &["logs", "talker", "-c", "a", "--tail", "2"]).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "a2\na3\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = kubectl(&cluster, &["logs", "talker", "-c", "b", "--previous"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "first\n");

    // Following streams what is written after the request.
    let params = kube::api::LogParams {
        container: Some("b".into()),
        follow: true,
        tail_lines: Some(1),
        ..kube::api::LogParams::default()
    };
    let mut lines = pods
        .log_stream("talker", &params)
        .await
        .expect("following")
        .lines();
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next())
            .await
            .expect("a line within 30 s")
            .expect("the stream goes on")
            .expect("a line");
        seen.push(line);
    }
    let ticks: Vec<u32> = seen
        .iter()
        .map(|l| {
            l.strip_prefix("tick ")
                .and_then(|n| n.parse().ok())
                .expect("a tick line")
        })
        .collect();
    assert!(
        ticks.windows(2).all(|w| w[1] == w[0] + 1),
        "consecutive ticks: {seen:?}"
    );
    // Deleting the pod ends the stream.
    pods.delete("talker", &DeleteParams::default())
        .await
        .expect("deleting");
    let ended = tokio::time::timeout(Duration::from_mins(1), async {
        while let Some(Ok(_)) = lines.next().await {}
    })
    .await;
    assert!(ended.is_ok(), "the followed log ended with the pod");
    node.stop().await;
}

/// kube-apiserver proxies `pods/exec` to the node's kubelet API.
#[tokio::test]
async fn kubectl_exec_runs_in_the_container_with_streams_and_exit_code() {
    let cluster = Cluster::start().await;
    let node = TestNode::start_serving(&cluster).await;
    let pods: Api<Pod> = cluster.api();
    let mut c = sh("main", "echo inside > /tmp/mark; exec sleep 1000");
    c["volumeMounts"] = json!([{"name": "data", "mountPath": "/data"}]);
    pods.create(
        &PostParams::default(),
        &pod(
            "target",
            &node.name(),
            &json!({"volumes": [{"name": "data", "emptyDir": {}}], "containers": [c]}),
        ),
    )
    .await
    .expect("creating the pod");
    let p = wait_pod(&pods, "target", "Running", |p| {
        p["status"]["phase"] == "Running"
    })
    .await;
    let pod_ip = p["status"]["podIP"].as_str().expect("podIP").to_string();
    // The command sees the container's files, mounts and network; streams are kept apart
    // and the exit code comes back.
    let out = kubectl(
        &cluster,
        &[
            "exec",
            "target",
            "--",
            "sh",
            "-c",
            "cat /tmp/mark; test -d /data && ip -o -4 addr show eth0; echo oops >&2; exit 3",
        ],
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stdout} {stderr}");
    assert!(stdout.starts_with("inside\n"), "{stdout}");
    assert!(stdout.contains(&format!("inet {pod_ip}/")), "{stdout}");
    assert!(stderr.contains("oops"), "{stderr}");
    // stdin reaches the command and its end closes it.
    let mut child = cluster
        .kubectl_command(&["exec", "-i", "target", "--", "tr", "a-z", "A-Z"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("kubectl exec -i");
    {
        use tokio::io::AsyncWriteExt as _;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(b"hello\n").await.expect("writing stdin");
    }
    let out = tokio::time::timeout(Duration::from_mins(1), child.wait_with_output())
        .await
        .expect("kubectl exec -i ends")
        .expect("kubectl output");
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HELLO\n");
    node.stop().await;
}

/// The pids in container `ctr`'s cgroup of pod `uid`.
fn container_pids(node: &str, uid: &str, ctr: &str) -> Vec<i32> {
    let mut pids: Vec<i32> = cgroup_dirs(node, uid)
        .iter()
        .flat_map(|d| pids_in(&d.join(ctr)))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// A restarted kubelet adopts its pods as the real one finds them under its container
/// runtime: a container that ran through the restart keeps its process, address and restart
/// count; one that died while no kubelet ran is restarted (its exit recorded); a pod deleted
/// meanwhile is terminated and its object removed; one whose object went meanwhile is released.
#[tokio::test]
async fn a_restarted_kubelet_adopts_the_pods_of_the_one_before() {
    let cluster = Cluster::start().await;
    let mut node = TestNode::start(&cluster).await;
    let node_name = node.name();
    let pods: Api<Pod> = cluster.api();
    // One process per container, so its pid tells whether it was restarted.
    let forever = "exec sleep 100000";
    for name in ["keep", "crash", "deleted", "forgotten"] {
        pods.create(
            &PostParams::default(),
            &pod(
                name,
                &node_name,
                &json!({"terminationGracePeriodSeconds": 2, "containers": [sh("main", forever)]}),
            ),
        )
        .await
        .expect("creating the pod");
    }
    let mut before = std::collections::BTreeMap::new();
    for name in ["keep", "crash", "deleted", "forgotten"] {
        let p = wait_pod(&pods, name, "Running", |p| {
            p["status"]["phase"] == "Running"
        })
        .await;
        let uid = p["metadata"]["uid"].as_str().unwrap().to_string();
        let pids = eventually(30, "the container's process", || async {
            let pids = container_pids(&node_name, &uid, "main");
            (!pids.is_empty()).then_some(pids)
        })
        .await;
        before.insert(name, (uid, pids, p["status"]["podIP"].clone()));
    }

    let abandoned = node.abandon().await;
    // While no kubelet runs: a container dies, a pod is deleted (it waits for its kubelet),
    // another's object is removed outright.
    for pid in &before["crash"].1 {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    pods.delete("deleted", &DeleteParams::default())
        .await
        .expect("deleting");
    pods.delete("forgotten", &DeleteParams::default().grace_period(0))
        .await
        .expect("deleting outright");
    let (uid, pids, _) = &before["keep"];
    assert_eq!(
        &container_pids(&node_name, uid, "main"),
        pids,
        "pods run on"
    );
    node.adopt(abandoned).await;

    let crash = wait_pod(&pods, "crash", "the crashed container restarted", |p| {
        p["status"]["containerStatuses"][0]["restartCount"] == 1
            && p["status"]["containerStatuses"][0]["state"]["running"].is_object()
    })
    .await;
    let last = &crash["status"]["containerStatuses"][0]["lastState"]["terminated"];
    assert_eq!(last["exitCode"], 137, "{last}");
    assert_eq!(last["signal"], 9, "{last}");
    eventually(
        60,
        "the deleted pod terminated and its object removed",
        || async { pods.get_opt("deleted").await.ok()?.is_none().then_some(()) },
    )
    .await;
    for gone in ["deleted", "forgotten"] {
        let uid = &before[gone].0;
        eventually(30, "what the pod held released", || async {
            (cgroup_dirs(&node_name, uid).is_empty() && !node.pods_dir().join(uid).exists())
                .then_some(())
        })
        .await;
    }
    let keep = pods.get("keep").await.expect("keep");
    let keep = serde_json::to_value(&keep).unwrap();
    let (uid, pids, ip) = &before["keep"];
    assert_eq!(
        &container_pids(&node_name, uid, "main"),
        pids,
        "the same process"
    );
    assert_eq!(&keep["status"]["podIP"], ip);
    assert_eq!(keep["status"]["phase"], "Running");
    assert_eq!(keep["status"]["containerStatuses"][0]["restartCount"], 0);
    // A new pod gets an address no adopted pod holds.
    pods.create(
        &PostParams::default(),
        &pod(
            "after",
            &node_name,
            &json!({"containers": [sh("main", forever)]}),
        ),
    )
    .await
    .expect("creating the pod");
    let after = wait_pod(&pods, "after", "Running", |p| {
        p["status"]["phase"] == "Running"
    })
    .await;
    for (uid, _, ip) in [&before["keep"], &before["crash"]] {
        assert_ne!(&after["status"]["podIP"], ip, "{uid}'s address given again");
    }
    // Adopted pods are the kubelet's own: deleting one ends it.
    pods.delete("keep", &DeleteParams::default())
        .await
        .expect("deleting");
    eventually(60, "the adopted pod deleted", || async {
        pods.get_opt("keep").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(cgroup_dirs(&node_name, uid).is_empty());
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "the adopted container's process {pid} ended"
        );
    }
    node.stop().await;
}

/// What the kernel lets `pid` run on (`Cpus_allowed_list`).
fn allowed_cpus(pid: i32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The static CPU manager (the default, reserving the first CPU): a Guaranteed pod's whole CPU
/// is its container's alone, a Burstable pod's container runs on the rest; the checkpoint
/// records it for virt-handler and for a restarted kubelet, which keeps the assignment: a pod
/// asking for more than is then free is rejected as the real kubelet rejects it. A deleted
/// pod's CPU goes back to the shared pool.
#[tokio::test]
async fn the_static_cpu_manager_gives_guaranteed_pods_their_own_cpus() {
    use localcluster::kubelet::cpumanager;
    let all = cpumanager::online_cpus();
    let cpus: Vec<u32> = all.cpus().collect();
    assert!(cpus.len() >= 2, "the static policy needs two CPUs: {all}");
    let cluster = Cluster::start().await;
    let mut node = TestNode::start(&cluster).await;
    let node_name = node.name();
    let pods: Api<Pod> = cluster.api();
    let whole = json!({"cpu": "1", "memory": "64Mi"});
    let mut pinned = sh("main", "exec sleep 100000");
    pinned["resources"] = json!({"requests": whole, "limits": whole});
    let mut shared = sh("main", "exec sleep 100000");
    shared["resources"] = json!({"requests": {"cpu": "1"}});
    for (name, c) in [("pinned", pinned), ("shared", shared)] {
        pods.create(
            &PostParams::default(),
            &pod(
                name,
                &node_name,
                &json!({"terminationGracePeriodSeconds": 1, "containers": [c]}),
            ),
        )
        .await
        .expect("creating the pod");
    }
    let mut main = std::collections::BTreeMap::new();
    for name in ["pinned", "shared"] {
        let p = wait_pod(&pods, name, "Running", |p| {
            p["status"]["phase"] == "Running"
        })
        .await;
        let uid = p["metadata"]["uid"].as_str().unwrap().to_owned();
        let pid = eventually(30, "the container's process", || async {
            container_pids(&node_name, &uid, "main").first().copied()
        })
        .await;
        main.insert(name, (uid, pid));
    }
    let rest: cgroups::CpuList = cpus.iter().copied().filter(|&c| c != cpus[1]).collect();
    assert_eq!(allowed_cpus(main["pinned"].1), cpus[1].to_string());
    assert_eq!(allowed_cpus(main["shared"].1), rest.to_string());
    let state = node
        .kubelet()
        .config()
        .kubelet_dir()
        .join(cpumanager::STATE_FILE);
    let checkpoint: Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    assert_eq!(checkpoint["policyName"], "static", "{checkpoint}");
    assert_eq!(
        checkpoint["defaultCpuSet"],
        rest.to_string(),
        "{checkpoint}"
    );
    assert_eq!(
        checkpoint["entries"][&main["pinned"].0]["main"],
        cpus[1].to_string(),
        "{checkpoint}"
    );

    let abandoned = node.abandon().await;
    node.adopt(abandoned).await;
    // Every CPU but the reserved one: free only had the restart forgotten `pinned`'s.
    let n = cpus.len() - 1;
    let want = json!({"cpu": n.to_string(), "memory": "64Mi"});
    let mut greedy = sh("main", "exec sleep 100000");
    greedy["resources"] = json!({"requests": want, "limits": want});
    pods.create(
        &PostParams::default(),
        &pod("greedy", &node_name, &json!({"containers": [greedy]})),
    )
    .await
    .expect("creating the pod");
    let rejected = wait_pod(&pods, "greedy", "rejected", |p| {
        p["status"]["phase"] == "Failed"
    })
    .await;
    assert_eq!(rejected["status"]["reason"], "UnexpectedAdmissionError");
    assert_eq!(
        rejected["status"]["message"],
        format!(
            "Pod was rejected: Allocate failed due to not enough cpus available to satisfy \
             request: requested={n}, available={}, which is unexpected",
            n - 1
        )
    );
    assert_eq!(allowed_cpus(main["pinned"].1), cpus[1].to_string());

    pods.delete("pinned", &DeleteParams::default())
        .await
        .expect("deleting");
    eventually(30, "the shared pool grown back", || async {
        (allowed_cpus(main["shared"].1) == all.to_string()).then_some(())
    })
    .await;
    node.stop().await;
}
