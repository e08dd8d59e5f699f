use pretty_assertions::assert_eq;
use serde_json::{Value, json};

use super::*;

fn vmi(volumes: &[Value], status: &[Value]) -> VirtualMachineInstance {
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm", "namespace": "default", "uid": "vmi-uid"},
        "spec": {"domain": {"devices": {}}, "volumes": volumes},
        "status": {"phase": "Running", "volumeStatus": status},
    }))
    .unwrap()
}

fn root() -> Value {
    json!({"name": "root", "containerDisk": {"image": "guest"}})
}

fn hot(name: &str) -> Value {
    json!({"name": name, "persistentVolumeClaim": {"claimName": format!("{name}-pvc"), "hotpluggable": true}})
}

fn launcher() -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "virt-launcher-vm-abcde", "namespace": "default", "uid": "launcher-uid"},
        "spec": {"nodeName": "node-1", "containers": [], "volumes": [{"name": "root", "emptyDir": {}}],
                 "tolerations": [{"key": "special", "operator": "Exists"}]},
    }))
    .unwrap()
}

fn attachment(name: &str, volumes: &[&str], phase: &str, ready: bool, created: &str) -> Pod {
    let mut vols = vec![json!({"name": "hotplug-disks", "emptyDir": {}})];
    vols.extend(
        volumes.iter().map(
            |v| json!({"name": v, "persistentVolumeClaim": {"claimName": format!("{v}-pvc")}}),
        ),
    );
    serde_json::from_value(json!({
        "metadata": {
            "name": name, "namespace": "default", "uid": format!("{name}-uid"),
            "creationTimestamp": created,
            "labels": {"kubevirt.io": "hotplug-disk"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "virt-launcher-vm-abcde",
                                 "uid": "launcher-uid", "controller": true}],
        },
        "spec": {"containers": [], "volumes": vols},
        "status": {"phase": phase, "containerStatuses": [{"name": "hotplug-disk", "ready": ready,
            "image": "", "imageID": "", "restartCount": 0}]},
    }))
    .unwrap()
}

fn bound(name: &str) -> PersistentVolumeClaim {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Filesystem",
                 "resources": {"requests": {"storage": "64Mi"}}},
        "status": {"phase": "Bound", "capacity": {"storage": "64Mi"}},
    }))
    .unwrap()
}

fn vols<'a>(v: &'a VirtualMachineInstance, names: &[&str]) -> Vec<&'a Volume> {
    v.spec
        .volumes
        .iter()
        .filter(|x| names.contains(&x.name.as_str()))
        .collect()
}

#[test]
fn the_hotplug_volumes_are_the_claims_the_launcher_pod_does_not_mount() {
    let cold = json!({"name": "cold", "persistentVolumeClaim": {"claimName": "cold"}});
    let v = vmi(&[root(), hot("data"), cold], &[]);
    let names: Vec<&str> = hotplug_volumes(&v, &launcher())
        .iter()
        .map(|v| v.name.as_str())
        .collect();
    // `cold` is not in this launcher's volumes either: a claim it does not mount is hotplugged.
    assert_eq!(names, ["data", "cold"]);
}

#[test]
fn attachment_pods_are_created_for_ready_volumes_and_replaced_when_the_set_changes() {
    let v = vmi(&[root(), hot("a"), hot("b")], &[]);
    // Nothing yet: one pod for both.
    let plan = plan_attachments(&v, &[], &vols(&v, &["a", "b"]));
    assert_eq!(plan.create, ["a", "b"]);
    assert!(plan.delete.is_empty());
    // The pod serves exactly the ready set: nothing to do.
    let ab = attachment("hp-1", &["a", "b"], "Running", true, "2026-01-01T00:00:00Z");
    assert_eq!(
        plan_attachments(&v, &[&ab], &vols(&v, &["a", "b"])),
        AttachmentPlan::default()
    );
    // `b` was removed from the spec but the launcher still uses it: a new pod for `a`, and
    // the old one stays while `b` is Ready.
    let v = vmi(
        &[root(), hot("a")],
        &[
            json!({"name": "a", "target": "sda", "phase": "Ready", "hotplugVolume": {}}),
            json!({"name": "b", "target": "sdb", "phase": "Ready", "hotplugVolume": {}}),
        ],
    );
    let plan = plan_attachments(&v, &[&ab], &vols(&v, &["a"]));
    assert_eq!(plan.create, ["a"]);
    assert!(plan.delete.is_empty(), "{plan:?}");
    // The new pod is pending: no second one; the old keeps running.
    let a = attachment("hp-2", &["a"], "Pending", false, "2026-01-01T00:01:00Z");
    assert_eq!(
        plan_attachments(&v, &[&ab, &a], &vols(&v, &["a"])),
        AttachmentPlan::default()
    );
    // virt-handler unmounted `b`, the new pod runs: the old one goes.
    let v = vmi(
        &[root(), hot("a")],
        &[
            json!({"name": "a", "target": "sda", "phase": "Ready", "hotplugVolume": {}}),
            json!({"name": "b", "target": "", "phase": "UnMountedFromPod", "hotplugVolume": {}}),
        ],
    );
    let a = attachment("hp-2", &["a"], "Running", true, "2026-01-01T00:01:00Z");
    let plan = plan_attachments(&v, &[&ab, &a], &vols(&v, &["a"]));
    assert_eq!(plan.delete, ["hp-1"]);
    assert!(plan.create.is_empty());
    // No hotplug volume left at all: the last pod goes.
    let v = vmi(&[root()], &[]);
    assert_eq!(plan_attachments(&v, &[&a], &[]).delete, ["hp-2"]);
}

#[test]
fn the_attachment_pod_mounts_each_claim_on_the_launchers_node() {
    let v = vmi(&[root(), hot("data")], &[]);
    let pod = render_attachment_pod(
        &v,
        &launcher(),
        &vols(&v, &["data"]),
        &BTreeMap::new(),
        "virt-launcher:1",
    );
    let pod = serde_json::to_value(pod).unwrap();
    assert_eq!(pod["metadata"]["generateName"], "hp-volume-");
    assert_eq!(
        pod["metadata"]["labels"],
        json!({"kubevirt.io": "hotplug-disk"})
    );
    assert_eq!(
        pod["metadata"]["annotations"],
        json!({"kubevirt.io/owner-vmi-name": "vm", "kubevirt.io/owner-vmi-uid": "vmi-uid"})
    );
    assert_eq!(pod["metadata"]["ownerReferences"][0]["uid"], "launcher-uid");
    assert_eq!(pod["metadata"]["ownerReferences"][0]["kind"], "Pod");
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["args"], json!(["--copy-path", "/path/hp"]));
    assert_eq!(
        c["volumeMounts"],
        json!([
            {"name": "hotplug-disks", "mountPath": "/path", "mountPropagation": "HostToContainer"},
            {"name": "data", "mountPath": "/data"},
        ])
    );
    assert_eq!(
        pod["spec"]["volumes"][1],
        json!({"name": "data", "persistentVolumeClaim": {"claimName": "data-pvc"}})
    );
    assert_eq!(
        pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["values"],
        json!(["node-1"])
    );
    let keys: Vec<&str> = pod["spec"]["tolerations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["key"].as_str().unwrap())
        .collect();
    assert!(keys.contains(&"special") && keys.contains(&"node.kubernetes.io/unschedulable"));
}

/// A block claim is attached as KubeVirt does: a device of the attachment pod at
/// `/path/<volume>/<claim uid>`, beside the file-system claims it mounts.
#[test]
fn a_block_claim_is_a_device_of_the_attachment_pod() {
    let block = |name: &str| {
        let mut c = bound(name);
        c.spec.as_mut().unwrap().volume_mode = Some("Block".into());
        c.metadata.uid = Some(format!("{name}-uid"));
        c
    };
    assert!(claim_ready(Some(&block("raw-pvc"))));
    let claims = |c: &str| match c {
        "raw-pvc" => Some(block(c)),
        "data-pvc" => Some(bound(c)),
        _ => None,
    };
    let v = vmi(&[root(), hot("raw"), hot("data")], &[]);
    let ready = vols(&v, &["raw", "data"]);
    let blocks = block_claims(&ready, claims);
    assert_eq!(
        blocks,
        BTreeMap::from([("raw".to_owned(), "raw-pvc-uid".to_owned())])
    );
    let pod = render_attachment_pod(&v, &launcher(), &ready, &blocks, "virt-launcher:1");
    let pod = serde_json::to_value(pod).unwrap();
    let c = &pod["spec"]["containers"][0];
    assert_eq!(
        c["volumeDevices"],
        json!([{"name": "raw", "devicePath": "/path/raw/raw-pvc-uid"}])
    );
    let mounted: Vec<&str> = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        mounted,
        ["hotplug-disks", "data"],
        "a device is not mounted"
    );
    assert_eq!(
        pod["spec"]["volumes"][1],
        json!({"name": "raw", "persistentVolumeClaim": {"claimName": "raw-pvc"}})
    );
    let (status, _) = volume_status(&v, &launcher(), &[], &claims);
    let raw = status.iter().find(|s| s.name == "raw").unwrap();
    assert_eq!(
        (raw.phase.as_deref(), raw.reason.as_deref()),
        (Some("Bound"), Some("PVCNotReady"))
    );
    assert_eq!(
        raw.persistent_volume_claim_info.as_ref().unwrap().0["volumeMode"],
        "Block"
    );
}

#[test]
fn volume_status_walks_the_controllers_phases() {
    let claims = |c: &str| (c == "data-pvc").then(|| bound(c));
    let v = vmi(&[root(), hot("data"), hot("missing")], &[]);
    let (status, events) = volume_status(&v, &launcher(), &[], &claims);
    let got: Vec<_> = status
        .iter()
        .map(|s| (s.name.as_str(), s.phase.as_deref(), s.reason.as_deref()))
        .collect();
    assert_eq!(
        got,
        [
            ("data", Some("Bound"), Some("PVCNotReady")),
            ("missing", Some("Pending"), Some("FailedPvcNotFound")),
            ("root", None, None),
        ]
    );
    assert!(events.is_empty());
    let info = status[0].persistent_volume_claim_info.as_ref().unwrap();
    assert_eq!(info.0["capacity"]["storage"], "64Mi");
    assert_eq!(info.0["filesystemOverhead"], "0.055");

    // The attachment pod exists, not ready yet: AttachedToNode without the uid.
    let v = vmi(
        &[root(), hot("data")],
        &[serde_json::to_value(&status[0]).unwrap()],
    );
    let pod = attachment("hp-1", &["data"], "Pending", false, "2026-01-01T00:00:00Z");
    let (status, events) = volume_status(&v, &launcher(), &[&pod], &claims);
    assert_eq!(status[0].phase.as_deref(), Some("AttachedToNode"));
    assert_eq!(
        status[0].hotplug_volume.as_ref().unwrap().0,
        json!({"attachPodName": "hp-1"})
    );
    assert_eq!(
        events,
        [(
            "SuccessfulCreate",
            "Created hotplug attachment pod hp-1, for volume data".to_owned()
        )]
    );
    // Ready: the uid is there for virt-handler; no second event.
    let v = vmi(
        &[root(), hot("data")],
        &[serde_json::to_value(&status[0]).unwrap()],
    );
    let pod = attachment("hp-1", &["data"], "Running", true, "2026-01-01T00:00:00Z");
    let (status, events) = volume_status(&v, &launcher(), &[&pod], &claims);
    assert_eq!(
        status[0].hotplug_volume.as_ref().unwrap().0,
        json!({"attachPodName": "hp-1", "attachPodUID": "hp-1-uid"})
    );
    assert!(events.is_empty());

    // Removed from the spec while Ready: kept as it is until virt-handler unmounts it, then
    // Detaching while the pod goes, then gone with the pod.
    let mut ready = status[0].clone();
    ready.phase = Some("Ready".into());
    let v = vmi(&[root()], &[serde_json::to_value(&ready).unwrap()]);
    let (status, _) = volume_status(&v, &launcher(), &[&pod], &claims);
    assert_eq!(status[0].phase.as_deref(), Some("Ready"));
    let mut unmounted = ready.clone();
    unmounted.phase = Some("UnMountedFromPod".into());
    let v = vmi(&[root()], &[serde_json::to_value(&unmounted).unwrap()]);
    let mut deleting = pod.clone();
    deleting.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-01-01T00:05:00Z".parse().unwrap(),
        ));
    let (status, events) = volume_status(&v, &launcher(), &[&deleting], &claims);
    assert_eq!(status[0].phase.as_deref(), Some("Detaching"));
    assert_eq!(events[0].0, "SuccessfulDelete");
    let (status, _) = volume_status(&v, &launcher(), &[], &claims);
    assert_eq!(
        status.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["root"]
    );
}
