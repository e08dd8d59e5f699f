//! Persistent volumes on the upstream control plane: localcluster's provisioner (its own user,
//! held by RBAC) makes the default StorageClass and a hostPath volume per claim, which
//! kube-controller-manager's PV controller binds; the process kubelet mounts claims; deleting a
//! claim deletes its volume and data. kube-scheduler's VolumeBinding plugin holds a pod until
//! its claim is bound.

mod common;

use common::{Cluster, TestNode, eventually, pod, sh, wait_pod};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use localcluster::storage::{PROVISIONER, Provisioner, STORAGE_CLASS};
use serde_json::{Value, json};

fn claim(name: &str, extra: &Value) -> PersistentVolumeClaim {
    let mut c = json!({"metadata": {"name": name}, "spec": {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "1Gi"}},
    }});
    json_patch::merge(&mut c["spec"], extra);
    serde_json::from_value(c).expect("claim")
}

/// A container of the tools image running `script` with the claim's volume at `/data`.
fn with_data(script: &str) -> Value {
    let mut c = sh("c", script);
    c["volumeMounts"] = json!([{"name": "data", "mountPath": "/data"}]);
    c
}

fn claim_volume(claim: &str, read_only: bool) -> Value {
    json!([{"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}])
}

fn condition<'a>(pod: &'a Value, kind: &str) -> Option<&'a Value> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

async fn gone<K>(api: &Api<K>, name: &str, what: &str)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    eventually(120, what, || async {
        api.get_opt(name)
            .await
            .ok()
            .and_then(|o| o.is_none().then_some(()))
    })
    .await;
}

#[tokio::test]
async fn a_claim_gets_a_local_volume_that_pods_on_two_nodes_share_and_that_goes_with_it() {
    let cluster = Cluster::start_with(|c| c.scheduler = true).await;
    let _storage = Provisioner::start(&cluster.plane)
        .await
        .expect("the provisioner");
    let class = Api::<StorageClass>::all(cluster.client.clone())
        .get(STORAGE_CLASS)
        .await
        .expect("the storage class");
    assert_eq!(class.provisioner, PROVISIONER);
    assert_eq!(class.reclaim_policy.as_deref(), Some("Delete"));
    assert_eq!(class.volume_binding_mode.as_deref(), Some("Immediate"));
    assert_eq!(
        class
            .metadata
            .annotations
            .unwrap_or_default()
            .get("storageclass.kubernetes.io/is-default-class")
            .map(String::as_str),
        Some("true")
    );
    let (writer_node, reader_node) = (
        TestNode::start(&cluster).await,
        TestNode::start(&cluster).await,
    );
    let pods: Api<Pod> = cluster.api();
    let claims: Api<PersistentVolumeClaim> = cluster.api();
    let volumes: Api<PersistentVolume> = Api::all(cluster.client.clone());

    // Before its claim exists, kube-scheduler leaves the pod unscheduled.
    let writer: Pod = serde_json::from_value(json!({
        "metadata": {"name": "writer"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": writer_node.name()},
            "containers": [with_data("echo \"written on $(hostname)\" > /data/hello")],
            "volumes": claim_volume("data", false),
        },
    }))
    .expect("the writer");
    pods.create(&PostParams::default(), &writer)
        .await
        .expect("the writer");
    wait_pod(&pods, "writer", "the writer unschedulable", |p| {
        condition(p, "PodScheduled").is_some_and(|c| c["status"] == "False")
    })
    .await;

    // No class named: kube-apiserver's DefaultStorageClass admission gives it `local`.
    let created = claims
        .create(&PostParams::default(), &claim("data", &json!({})))
        .await
        .expect("the claim");
    let spec = created.spec.clone().unwrap_or_default();
    assert_eq!(spec.storage_class_name.as_deref(), Some(STORAGE_CLASS));
    let uid = created.metadata.uid.clone().unwrap_or_default();
    let bound = eventually(120, "the claim bound", || async {
        let c = claims.get("data").await.ok()?;
        (c.status.as_ref()?.phase.as_deref() == Some("Bound")).then_some(c)
    })
    .await;
    let volume_name = format!("pvc-{uid}");
    assert_eq!(
        bound.spec.and_then(|s| s.volume_name).as_deref(),
        Some(volume_name.as_str())
    );
    let volume =
        serde_json::to_value(volumes.get(&volume_name).await.expect("the volume")).expect("json");
    let dir = cluster.plane.dir().join("volumes").join(&volume_name);
    assert_eq!(
        volume["spec"]["hostPath"],
        json!({"path": dir.display().to_string(), "type": "Directory"})
    );
    assert_eq!(volume["spec"]["capacity"], json!({"storage": "1Gi"}));
    assert_eq!(volume["spec"]["accessModes"], json!(["ReadWriteMany"]));
    assert_eq!(volume["spec"]["persistentVolumeReclaimPolicy"], "Delete");
    assert_eq!(volume["spec"]["claimRef"]["uid"], uid.as_str());
    assert_eq!(
        volume["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"],
        PROVISIONER
    );

    // Bound, the claim lets kube-scheduler place the writer, and its kubelet mount it.
    let done = wait_pod(&pods, "writer", "the writer done", |p| {
        matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
    })
    .await;
    assert_eq!(done["status"]["phase"], "Succeeded", "{:#}", done["status"]);
    assert_eq!(done["spec"]["nodeName"], writer_node.name().as_str());
    assert_eq!(
        std::fs::read_to_string(dir.join("hello")).expect("the written file"),
        "written on writer\n"
    );

    // Another node sees the same data; the claim's `readOnly` makes its mount read-only.
    pods.create(
        &PostParams::default(),
        &pod(
            "reader",
            &reader_node.name(),
            &json!({
                "restartPolicy": "Never",
                "containers": [with_data("test \"$(cat /data/hello)\" = 'written on writer' && ! touch /data/other")],
                "volumes": claim_volume("data", true),
            }),
        ),
    )
    .await
    .expect("the reader");
    let read = wait_pod(&pods, "reader", "the reader done", |p| {
        matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
    })
    .await;
    assert_eq!(read["status"]["phase"], "Succeeded", "{:#}", read["status"]);
    assert!(!dir.join("other").exists());

    // Once no pod uses it, deleting the claim deletes its volume and the data.
    for name in ["writer", "reader"] {
        pods.delete(name, &DeleteParams::default())
            .await
            .expect("deleting a pod");
    }
    for name in ["writer", "reader"] {
        gone(&pods, name, "the pods deleted").await;
    }
    claims
        .delete("data", &DeleteParams::default())
        .await
        .expect("deleting the claim");
    gone(&volumes, &volume_name, "the released volume deleted").await;
    assert!(!dir.exists(), "{} left", dir.display());
}

#[tokio::test]
async fn a_block_claim_is_refused_and_a_pod_waits_for_its_claim() {
    let cluster = Cluster::start().await;
    let _storage = Provisioner::start(&cluster.plane)
        .await
        .expect("the provisioner");
    let node = TestNode::start(&cluster).await;
    let claims: Api<PersistentVolumeClaim> = cluster.api();
    let pods: Api<Pod> = cluster.api();
    claims
        .create(
            &PostParams::default(),
            &claim("raw", &json!({"volumeMode": "Block"})),
        )
        .await
        .expect("the claim");
    let events: Api<Event> = cluster.api();
    let refused = eventually(120, "the ProvisioningFailed event", || async {
        events
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("ProvisioningFailed")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("raw")
            })
    })
    .await;
    assert_eq!(refused.type_.as_deref(), Some("Warning"));
    let note = refused.note.unwrap_or_default();
    assert!(
        note.contains("block volumes are not supported by localcluster's provisioner"),
        "{note}"
    );
    assert_eq!(refused.reporting_controller.as_deref(), Some(PROVISIONER));
    let volumes = Api::<PersistentVolume>::all(cluster.client.clone())
        .list(&ListParams::default())
        .await
        .expect("volumes");
    assert!(volumes.items.is_empty(), "{:?}", volumes.items);
    let claim = claims.get("raw").await.expect("the claim");
    assert_eq!(
        claim.status.and_then(|s| s.phase).as_deref(),
        Some("Pending")
    );

    // A pod bound to a node without kube-scheduler: the kubelet waits for the claim, saying why.
    pods.create(
        &PostParams::default(),
        &pod(
            "user",
            &node.name(),
            &json!({"containers": [with_data("sleep 1000")], "volumes": claim_volume("raw", false)}),
        ),
    )
    .await
    .expect("the pod");
    // The first try may read the claim before kube-apiserver's node authorizer has linked the
    // new pod to it (403 for the node, as a real kubelet sees too); the kubelet tries again.
    let waiting = wait_pod(&pods, "user", "the pod waiting for its claim", |p| {
        condition(p, "PodReadyToStartContainers").is_some_and(|c| {
            c["status"] == "False"
                && c["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("is not bound"))
        })
    })
    .await;
    let message =
        condition(&waiting, "PodReadyToStartContainers").expect("the condition")["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
    assert_eq!(
        message,
        "volume \"data\": persistentvolumeclaim \"raw\" is not bound (phase Pending)"
    );
    assert_eq!(waiting["status"]["phase"], "Pending");
    // Nothing of the sandbox is held while it waits: no address, no network namespace.
    assert!(
        waiting["status"]["podIP"].is_null(),
        "{:#}",
        waiting["status"]
    );
}

/// A claim bound to a `local` volume with `volumeMode: Block` (a loop device) reaches the
/// container as a device node at its `devicePath`, written through to the device, with no
/// node left in the host's `/dev` and the mapping recorded in the pod dir; a `HugePages` emptyDir is a hugetlbfs of the size the pod
/// requests, at `/dev/hugepages` as KubeVirt's launcher mounts it, gone with the pod; the
/// node reports the host's huge pages, which are not allocatable as memory.
#[tokio::test]
async fn a_local_block_claim_is_a_device_and_a_hugepages_empty_dir_a_hugetlbfs() {
    let cluster = Cluster::start().await;
    let node = TestNode::start(&cluster).await;
    let device = localcluster::storage::LoopDevice::new(1 << 20).expect("a loop device");
    let claims: Api<PersistentVolumeClaim> = cluster.api();
    let pods: Api<Pod> = cluster.api();
    let volumes: Api<PersistentVolume> = Api::all(cluster.client.clone());
    let volume_name = format!("raw-{}", cluster.namespace);
    let volume = localcluster::storage::local_block_volume(
        &volume_name,
        "raw",
        "1Mi",
        &device.path,
        &node.name(),
    );
    volumes
        .create(&PostParams::default(), &volume)
        .await
        .expect("the volume");
    claims
        .create(
            &PostParams::default(),
            &claim(
                "raw",
                &json!({"volumeMode": "Block", "storageClassName": "raw",
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Mi"}}}),
            ),
        )
        .await
        .expect("the claim");
    eventually(120, "the claim bound to the local volume", || async {
        let c = claims.get("raw").await.ok()?;
        (c.status?.phase.as_deref() == Some("Bound")).then_some(())
    })
    .await;

    let node_object = Api::<k8s_openapi::api::core::v1::Node>::all(cluster.client.clone())
        .get(&node.name())
        .await
        .expect("the node");
    // Other tests on this machine change the host's pool (`nr_hugepages`) at any time, so the
    // figures are checked against each other, not against a reading of their own.
    let status = node_object.status.expect("node status");
    let capacity = status.capacity.expect("capacity");
    let allocatable = status.allocatable.expect("allocatable");
    let bytes = |q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity| {
        api::quantity::bytes(&q.0).expect("a quantity")
    };
    assert!(capacity.contains_key("hugepages-2Mi"), "{capacity:?}");
    let pages: u64 = capacity
        .iter()
        .filter(|(k, _)| k.starts_with("hugepages-"))
        .map(|(k, v)| {
            assert_eq!(allocatable[k], *v);
            bytes(v)
        })
        .sum();
    assert_eq!(
        bytes(&allocatable["memory"]),
        bytes(&capacity["memory"]) - pages
    );

    let mut c = sh(
        "c",
        "printf kubevirt-rs > /dev/xvda; stat -c '%F %t:%T' /dev/xvda; \
         grep ' /dev/hugepages ' /proc/mounts; touch /dev/hugepages/guest-ram && echo created",
    );
    c["volumeDevices"] = json!([{"name": "data", "devicePath": "/dev/xvda"}]);
    c["volumeMounts"] = json!([{"name": "hugepages", "mountPath": "/dev/hugepages"}]);
    let resources = json!({"hugepages-2Mi": "2Mi", "memory": "32Mi", "cpu": "10m"});
    c["resources"] = json!({"requests": resources, "limits": resources});
    let created = pods
        .create(
            &PostParams::default(),
            &pod(
                "user",
                &node.name(),
                &json!({"restartPolicy": "Never", "containers": [c], "volumes": [
                    {"name": "data", "persistentVolumeClaim": {"claimName": "raw"}},
                    {"name": "hugepages", "emptyDir": {"medium": "HugePages"}},
                ]}),
            ),
        )
        .await
        .expect("the pod");
    let uid = created.metadata.uid.expect("uid");
    let done = wait_pod(&pods, "user", "the pod finished", |p| {
        matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
    })
    .await;
    let log_path = node
        .kubelet()
        .config()
        .log_dir()
        .join(format!("{}_user_{uid}/c/0.log", cluster.namespace));
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert_eq!(done["status"]["phase"], "Succeeded", "{log}");
    let rdev = {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(&device.path).expect("the device").rdev()
    };
    let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    let mut lines = log.lines();
    assert_eq!(
        lines.next(),
        Some(&*format!("block special file {major:x}:{minor:x}")),
        "{log}"
    );
    let mount = lines.next().unwrap_or_default();
    assert!(
        mount.contains(" hugetlbfs ") && mount.contains("pagesize=2M"),
        "{log}"
    );
    assert_eq!(lines.next(), Some("created"), "{log}");
    let mut written = vec![0; 11];
    std::io::Read::read_exact(
        &mut std::fs::File::open(&device.path).expect("the device"),
        &mut written,
    )
    .expect("reading the device");
    assert_eq!(written, b"kubevirt-rs");
    assert!(
        !std::path::Path::new("/dev/xvda").exists(),
        "a node in the host's /dev"
    );
    // The host-side record of the mapping, as the kubelet keeps one, which virt-handler reads.
    let record = node
        .pods_dir()
        .join(&uid)
        .join("volumeDevices/kubernetes.io~local-volume/data");
    assert_eq!(
        std::fs::read_link(&record).expect("the volumeDevices record"),
        std::path::Path::new(&device.path)
    );

    pods.delete("user", &DeleteParams::default())
        .await
        .expect("deleting the pod");
    gone(&pods, "user", "the pod gone").await;
    let pod_dir = node.pods_dir().join(&uid);
    eventually(30, "the pod directory removed", || async {
        (!pod_dir.exists()).then_some(())
    })
    .await;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    assert!(!mounts.contains(&*uid), "{mounts}");
    volumes
        .delete(&volume_name, &DeleteParams::default())
        .await
        .expect("deleting the volume");
}
