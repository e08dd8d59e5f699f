//! The controllers against the upstream control plane localcluster runs (etcd, kube-apiserver,
//! kube-controller-manager, each test its own): our CRDs (the `api` crate's, as `manifests/crds/` holds them), the
//! controllers running as they would in a pod. There is no kube-scheduler (but in the benchmark)
//! and no kubelet here, so the tests bind pods and set their phase themselves, and keep the one
//! Node they bind to, `node01`, Ready as its kubelet would.

use std::future::Future;
use std::time::Duration;

use api::{VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceReplicaSet};
use controller::run::{Options, run_controllers, run_with_leader_election};
use k8s_openapi::api::core::v1::{Namespace, Pod, ResourceQuota};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt as _};
use localcluster::controlplane::TestControlPlane;
use serde_json::json;

mod common;

const DEADLINE: Duration = Duration::from_mins(1);

/// Aborts the controller task when the test ends, however it ends.
struct Running(tokio::task::JoinHandle<()>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A control plane for one test, with the Node `node01` kept Ready and its kubelet's part of
/// pod deletion played; dropping it stops all three.
struct Cluster {
    plane: TestControlPlane,
    _node01: localcluster::controlplane::NodeHeartbeat,
    _kubelet: Running,
}

impl std::ops::Deref for Cluster {
    type Target = TestControlPlane;

    fn deref(&self) -> &TestControlPlane {
        &self.plane
    }
}

async fn cluster() -> (Cluster, Client) {
    cluster_with(false).await
}

/// With `scheduler`, kube-scheduler runs too.
async fn cluster_with(scheduler: bool) -> (Cluster, Client) {
    // The controllers' decisions at debug: nextest shows a test's output only when it fails,
    // and a rare failure is only understood from them.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "controller=debug,informer=info".into()),
        )
        .with_test_writer()
        .try_init();
    let plane = TestControlPlane::start(scheduler).await;
    let client = plane.client().await;
    localcluster::controlplane::install_crds(&client).await;
    let ns: Api<Namespace> = Api::all(client.clone());
    ns.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "kubevirt"}})).unwrap(),
    )
    .await
    .unwrap();
    // What `bind_and_run` binds to: it must exist (kube-controller-manager's pod GC deletes
    // pods bound to a missing node) and stay Ready.
    let node01 = localcluster::controlplane::ready_node(
        &client,
        json!({"metadata": {"name": "node01", "labels": {"kubernetes.io/hostname": "node01"}}}),
        serde_json::Value::Null,
    )
    .await;
    let kubelet = kubelet_of_node01_removes_terminating_pods(&client);
    (
        Cluster {
            plane,
            _node01: node01,
            _kubelet: kubelet,
        },
        client,
    )
}

fn start(client: &Client, identity: &str, elect: bool) -> Running {
    let opts = Options {
        identity: identity.into(),
        ..Options::default()
    };
    start_with(client, opts, elect)
}

fn start_with(client: &Client, opts: Options, elect: bool) -> Running {
    let client = client.clone();
    Running(tokio::spawn(async move {
        let r = if elect {
            run_with_leader_election(client, opts).await
        } else {
            run_controllers(client, opts).await
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, "controller stopped");
        }
    }))
}

async fn wait_for<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn vmi_spec() -> serde_json::Value {
    json!({
        "domain": {
            "resources": {"requests": {"memory": "64Mi"}},
            "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}
        },
        "volumes": [{"name": "root", "containerDisk": {"image": "example/disk:1"}}]
    })
}

fn vmi(name: &str) -> VirtualMachineInstance {
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default"},
        "spec": vmi_spec(),
    }))
    .unwrap()
}

async fn launcher_pods(client: &Client) -> Vec<Pod> {
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.list(&ListParams::default().labels("kubevirt.io=virt-launcher"))
        .await
        .unwrap()
        .items
}

async fn pods_of(client: &Client, vmi: &VirtualMachineInstance) -> Vec<Pod> {
    let uid = vmi.uid().unwrap();
    launcher_pods(client)
        .await
        .into_iter()
        .filter(|p| {
            p.owner_references()
                .iter()
                .any(|o| o.uid == uid && o.controller == Some(true))
        })
        .collect()
}

fn phase(v: &VirtualMachineInstance) -> Option<String> {
    v.status
        .as_ref()
        .and_then(|s| s.phase.as_ref())
        .map(|p| p.as_str().to_owned())
}

/// The scheduler's and kubelet's part: bind the pod to `node` and report it running.
async fn bind_and_run(client: &Client, pod: &Pod, node: &str) {
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let name = pod.name_any();
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    });
    pods.create_subresource::<_, serde_json::Value>(
        "binding",
        &name,
        &PostParams::default(),
        &binding,
    )
    .await
    .unwrap();
    pods.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Running"}})),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn vm_gets_a_vmi_with_owner_and_one_pod_that_schedules() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let vm: VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "vm1", "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": {"metadata": {"labels": {"app": "x"}}, "spec": vmi_spec()}},
    }))
    .unwrap();
    let vm = vms.create(&PostParams::default(), &vm).await.unwrap();
    let vmi = wait_for("the VMI", || async { vmis.get_opt("vm1").await.unwrap() }).await;
    let owner = &vmi.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("VirtualMachine", vm.uid().unwrap().as_str(), Some(true))
    );
    assert_eq!(vmi.labels()["app"], "x");
    let pod = wait_for("the launcher pod", || async {
        pods_of(&client, &vmi).await.into_iter().next()
    })
    .await;
    assert!(pod.name_any().starts_with("virt-launcher-vm1-"));
    wait_for("phase Scheduling", || async {
        (phase(&vmis.get("vm1").await.unwrap()).as_deref() == Some("Scheduling")).then_some(())
    })
    .await;
    bind_and_run(&client, &pod, "node01").await;
    let scheduled = wait_for("phase Scheduled", || async {
        let v = vmis.get("vm1").await.unwrap();
        (phase(&v).as_deref() == Some("Scheduled")).then_some(v)
    })
    .await;
    let st = scheduled.status.unwrap();
    assert_eq!(st.node_name.as_deref(), Some("node01"));
    assert_eq!(
        st.active_pods.get(&pod.uid().unwrap()).map(String::as_str),
        Some("node01")
    );
    let labelled = wait_for("the nodeName label", || async {
        let v = vmis.get("vm1").await.unwrap();
        v.labels().get("kubevirt.io/nodeName").cloned()
    })
    .await;
    assert_eq!(labelled, "node01");
    assert_eq!(
        pods_of(&client, &vmis.get("vm1").await.unwrap())
            .await
            .len(),
        1
    );
    let vm_status = wait_for("VM status Starting", || async {
        let s = vms.get("vm1").await.unwrap().status?;
        (s.printable_status.as_ref()?.as_str() == "Starting").then_some(s)
    })
    .await;
    assert_eq!(vm_status.created, Some(true));
}

#[tokio::test]
async fn invalid_vmi_gets_condition_and_events_and_never_a_pod() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let mut bad = vmi("bad");
    bad.spec.domain.devices.disks[0].name = "nosuchvolume".into();
    vmis.create(&PostParams::default(), &bad).await.unwrap();
    let cond = wait_for("the validation condition", || async {
        let v = vmis.get("bad").await.unwrap();
        v.status?
            .conditions
            .into_iter()
            .find(|c| c.reason.as_deref() == Some("FailedValidation"))
    })
    .await;
    let message = cond.message.unwrap();
    assert!(
        message.contains("spec.domain.devices.disks[0]"),
        "{message}"
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::default_namespaced(client.clone());
    let notes = wait_for("validation events", || async {
        let evs = events.list(&ListParams::default()).await.unwrap().items;
        let notes: Vec<String> = evs
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("FailedValidation"))
            .filter_map(|e| e.note)
            .collect();
        (!notes.is_empty()).then_some(notes)
    })
    .await;
    assert!(notes.iter().all(|n| n.starts_with("spec.")), "{notes:?}");
    // A valid VMI created after it gets its pod, so the controller had every chance.
    let good = vmis
        .create(&PostParams::default(), &vmi("good"))
        .await
        .unwrap();
    wait_for("the valid VMI's pod", || async {
        pods_of(&client, &good).await.into_iter().next()
    })
    .await;
    let bad = vmis.get("bad").await.unwrap();
    assert!(pods_of(&client, &bad).await.is_empty());
    assert_eq!(phase(&bad).as_deref(), Some("Pending"));
}

#[tokio::test]
async fn halted_vm_starts_and_stops_on_request() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let vm: VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "vm1", "namespace": "default"},
        "spec": {"runStrategy": "Halted", "template": {"spec": vmi_spec()}},
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    wait_for("printableStatus Stopped", || async {
        let s = vms.get("vm1").await.unwrap().status?;
        (s.printable_status?.as_str() == "Stopped").then_some(())
    })
    .await;
    assert!(vmis.get_opt("vm1").await.unwrap().is_none());

    // virtctl start on a Halted VM: a Start request; the controller switches it to Always.
    vms.patch_status(
        "vm1",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"stateChangeRequests": [{"action": "Start"}]}})),
    )
    .await
    .unwrap();
    let vmi = wait_for("the VMI after start", || async {
        vmis.get_opt("vm1").await.unwrap()
    })
    .await;
    let vm = vms.get("vm1").await.unwrap();
    assert_eq!(
        vm.spec
            .run_strategy
            .as_ref()
            .map(api::vm::RunStrategy::as_str),
        Some("Always")
    );
    wait_for("the pod", || async {
        pods_of(&client, &vmi).await.into_iter().next()
    })
    .await;

    // virtctl stop: back to Halted; the VMI and its pod go.
    vms.patch(
        "vm1",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"runStrategy": "Halted"}})),
    )
    .await
    .unwrap();
    wait_for("the VMI to go", || async {
        vmis.get_opt("vm1").await.unwrap().is_none().then_some(())
    })
    .await;
    wait_for("the pod to go", || async {
        launcher_pods(&client).await.is_empty().then_some(())
    })
    .await;
    wait_for("printableStatus Stopped again", || async {
        let s = vms.get("vm1").await.unwrap().status?;
        (s.printable_status?.as_str() == "Stopped").then_some(())
    })
    .await;
}

/// The condition of type `type_` in the pod's status: (status, reason).
fn pod_condition(p: &Pod, type_: &str) -> Option<(String, Option<String>)> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

#[tokio::test]
async fn launcher_pod_readiness_gate_follows_the_paused_condition() {
    const GATE: &str = "kubevirt.io/virtual-machine-unpaused";
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let v = vmis
        .create(&PostParams::default(), &vmi("gated"))
        .await
        .unwrap();
    let pod = wait_for("the pod's unpaused condition", || async {
        let p = pods_of(&client, &v).await.into_iter().next()?;
        (pod_condition(&p, GATE)?.0 == "True").then_some(p)
    })
    .await;
    let gates = pod.spec.as_ref().unwrap().readiness_gates.clone().unwrap();
    assert_eq!(gates[0].condition_type, GATE);
    assert_eq!(
        pod_condition(&pod, GATE).unwrap().1.as_deref(),
        Some("NotPaused")
    );
    let name = pod.name_any();
    bind_and_run(&client, &pod, "node01").await;
    // The kubelet's own conditions, written as the kubelet writes them.
    pods.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Strategic(json!({"status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
        ]}})),
    )
    .await
    .unwrap();

    // virt-handler reports the guest paused: the pod leaves its Services.
    let set_paused = |status: &'static str| {
        let vmis = vmis.clone();
        async move {
            vmis.patch(
                "gated",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": [
                    {"type": "Paused", "status": status, "reason": "PausedByUser"},
                ]}})),
            )
            .await
            .unwrap();
        }
    };
    set_paused("True").await;
    let p = wait_for("the unpaused condition False", || async {
        let p = pods.get(&name).await.unwrap();
        (pod_condition(&p, GATE)?.0 == "False").then_some(p)
    })
    .await;
    assert_eq!(
        pod_condition(&p, GATE).unwrap().1.as_deref(),
        Some("Paused")
    );
    assert_eq!(
        pod_condition(&p, "Ready").map(|c| c.0).as_deref(),
        Some("False"),
        "the kubelet's conditions stay"
    );
    set_paused("False").await;
    wait_for("the unpaused condition True again", || async {
        let p = pods.get(&name).await.unwrap();
        (pod_condition(&p, GATE)?.0 == "True").then_some(())
    })
    .await;
}

/// Scaled with `kubectl scale` (the scale subresource), as a user would.
#[tokio::test]
async fn replicaset_scales_0_3_1() {
    let (server, client) = cluster().await;
    let kubeconfig = server.kubeconfig_path();
    let _c = start(&client, "a", false);
    let rss: Api<VirtualMachineInstanceReplicaSet> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let rs: VirtualMachineInstanceReplicaSet = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceReplicaSet",
        "metadata": {"name": "rs", "namespace": "default"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "rs"}},
            "template": {"metadata": {"labels": {"app": "rs"}}, "spec": vmi_spec()},
        },
    }))
    .unwrap();
    // An orphan matching the selector is adopted, and with 0 replicas wanted, deleted.
    let mut orphan = vmi("orphan");
    orphan.metadata.labels = Some([("app".to_owned(), "rs".to_owned())].into());
    vmis.create(&PostParams::default(), &orphan).await.unwrap();
    rss.create(&PostParams::default(), &rs).await.unwrap();
    let live = || async {
        vmis.list(&ListParams::default().labels("app=rs"))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|v| v.metadata.deletion_timestamp.is_none())
            .collect::<Vec<_>>()
    };
    // Exactly one launcher pod per live VMI, and no other (a deleted VMI's pod goes too).
    let right_pods = || async {
        let live = live().await;
        let mut owners: Vec<String> = launcher_pods(&client)
            .await
            .iter()
            .filter_map(|p| Some(p.owner_references().first()?.uid.clone()))
            .collect();
        owners.sort();
        let mut want: Vec<String> = live.iter().filter_map(kube::ResourceExt::uid).collect();
        want.sort();
        owners == want
    };
    wait_for("the adopted orphan and its pod to be deleted", || async {
        (live().await.is_empty() && right_pods().await).then_some(())
    })
    .await;
    wait_for("status.replicas 0", || async {
        (rss.get("rs").await.unwrap().status?.replicas == Some(0)).then_some(())
    })
    .await;
    for want in [3, 1] {
        common::kubectl(
            &kubeconfig,
            &["scale", "vmirs", "rs", &format!("--replicas={want}")],
        )
        .await;
        wait_for(&format!("{want} VMIs with one pod each"), || async {
            (live().await.len() == want && right_pods().await).then_some(())
        })
        .await;
        wait_for(&format!("status.replicas {want}"), || async {
            let s = rss.get("rs").await.unwrap().status?;
            (s.replicas == Some(i32::try_from(want).unwrap())).then_some(())
        })
        .await;
        // Settled: no overshoot, no stray pod.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(live().await.len(), want);
        assert!(right_pods().await, "one launcher pod per VMI, no other");
    }
    // The scale subresource reads back what the controller reports.
    let scale = rss.get_scale("rs").await.unwrap();
    let status = scale.status.unwrap();
    assert_eq!(
        (status.replicas, status.selector.as_deref()),
        (1, Some("app=rs"))
    );
}

fn memory_of(v: &VirtualMachine) -> Option<String> {
    let spec = v.spec.template.spec.as_ref()?;
    Some(spec.domain.resources.requests.get("memory")?.0.clone())
}

fn revision_of<K: kube::Resource>(o: &K) -> Option<String> {
    o.meta()
        .labels
        .as_ref()?
        .get(api::pool::REVISION_NAME_LABEL)
        .cloned()
}

#[tokio::test]
async fn pool_scales_0_3_1_with_kubevirts_names_and_rolls_out_a_new_template() {
    use api::pool::VirtualMachinePool;
    use k8s_openapi::api::apps::v1::ControllerRevision;
    let (server, client) = cluster().await;
    let kubeconfig = server.kubeconfig_path();
    let _c = start(&client, "a", false);
    let pools: Api<VirtualMachinePool> = Api::default_namespaced(client.clone());
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let revisions: Api<ControllerRevision> = Api::default_namespaced(client.clone());
    let pool: VirtualMachinePool = serde_json::from_value(json!({
        "apiVersion": "pool.kubevirt.io/v1beta1", "kind": "VirtualMachinePool",
        "metadata": {"name": "pool", "namespace": "default"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "pool"}},
            "virtualMachineTemplate": {
                "metadata": {"labels": {"app": "pool"}},
                "spec": {"runStrategy": "Always", "template": {
                    "metadata": {"labels": {"app": "pool"}}, "spec": vmi_spec()}},
            },
        },
    }))
    .unwrap();
    let created = pools.create(&PostParams::default(), &pool).await.unwrap();
    let uid = created.metadata.uid.clone().unwrap();
    let live = || async {
        let mut names: Vec<String> = vms
            .list(&ListParams::default().labels("app=pool"))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|v| v.metadata.deletion_timestamp.is_none())
            .map(|v| v.name_any())
            .collect();
        names.sort();
        names
    };
    wait_for("the pool's finalizer and status.replicas 0", || async {
        let p = pools.get("pool").await.unwrap();
        let fin = p.metadata.finalizers.unwrap_or_default();
        (fin.iter().any(|f| f == api::pool::FINALIZER) && p.status?.replicas == Some(0))
            .then_some(())
    })
    .await;

    common::kubectl(&kubeconfig, &["scale", "vmpool", "pool", "--replicas=3"]).await;
    wait_for("VMs pool-0, pool-1, pool-2 and their VMIs", || async {
        let names = live().await;
        let vmi_count = vmis
            .list(&ListParams::default().labels("app=pool"))
            .await
            .unwrap()
            .items
            .len();
        (names == ["pool-0", "pool-1", "pool-2"] && vmi_count == 3).then_some(())
    })
    .await;
    let first = vms.get("pool-0").await.unwrap();
    let revision = revision_of(&first).expect("the VM's revision label");
    for n in ["pool-0", "pool-1", "pool-2"] {
        let v = vms.get(n).await.unwrap();
        let owner = kube::ResourceExt::owner_references(&v)[0].clone();
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("VirtualMachinePool", uid.as_str(), Some(true)),
            "{n} is controlled by the pool"
        );
        assert_eq!(revision_of(&v).as_ref(), Some(&revision), "{n}'s revision");
        assert!(v.finalizers().iter().any(|f| f == api::pool::FINALIZER));
        assert_eq!(
            revision_of(&vmis.get(n).await.unwrap()).as_ref(),
            Some(&revision)
        );
    }
    let rev = revisions.get(&revision).await.unwrap();
    assert_eq!(kube::ResourceExt::owner_references(&rev)[0].uid, uid);

    // A new template: every VM is rewritten from it, and (proactive, KubeVirt's default) its
    // running instance restarted to take it.
    let old_vmi_uids: Vec<String> = vmis
        .list(&ListParams::default().labels("app=pool"))
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(kube::ResourceExt::uid)
        .collect();
    pools
        .patch(
            "pool",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"virtualMachineTemplate": {"spec": {"template": {"spec":
                {"domain": {"resources": {"requests": {"memory": "128Mi"}}}}}}}}}),
            ),
        )
        .await
        .unwrap();
    let updated = wait_for("VMs and VMIs on the new template", || async {
        let list = vmis
            .list(&ListParams::default().labels("app=pool"))
            .await
            .unwrap()
            .items;
        let restarted = list.len() == 3
            && list.iter().all(|v| {
                !old_vmi_uids.contains(&v.uid().unwrap_or_default())
                    && v.spec
                        .domain
                        .resources
                        .requests
                        .get("memory")
                        .map(|q| q.0.as_str())
                        == Some("128Mi")
            });
        let vm_list = vms
            .list(&ListParams::default().labels("app=pool"))
            .await
            .unwrap()
            .items;
        let rewritten = vm_list.len() == 3
            && vm_list.iter().all(|v| {
                memory_of(v).as_deref() == Some("128Mi") && revision_of(v) != Some(revision.clone())
            });
        let new_revision = revision_of(&vm_list[0])?;
        (restarted
            && rewritten
            && list
                .iter()
                .all(|v| revision_of(v).as_ref() == Some(&new_revision)))
        .then_some(new_revision)
    })
    .await;
    // The old template's revision goes once nothing uses it.
    wait_for("the unused revision pruned", || async {
        revisions
            .get_opt(&revision)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;

    common::kubectl(&kubeconfig, &["scale", "vmpool", "pool", "--replicas=1"]).await;
    wait_for("one VM left, the others gone", || async {
        let all = vms
            .list(&ListParams::default().labels("app=pool"))
            .await
            .unwrap()
            .items;
        (all.len() == 1 && live().await.len() == 1).then_some(())
    })
    .await;
    wait_for("status.replicas 1", || async {
        (pools.get("pool").await.unwrap().status?.replicas == Some(1)).then_some(())
    })
    .await;
    let scale = pools.get_scale("pool").await.unwrap();
    let status = scale.status.unwrap();
    assert_eq!(
        (status.replicas, status.selector.as_deref()),
        (1, Some("app=pool"))
    );

    // A new VM takes the lowest free index, on the new template.
    let kept = live().await;
    common::kubectl(&kubeconfig, &["scale", "vmpool", "pool", "--replicas=2"]).await;
    let lowest = ["pool-0", "pool-1"]
        .into_iter()
        .find(|n| !kept.iter().any(|k| k == n))
        .unwrap();
    let added = wait_for("a second VM", || async {
        let names = live().await;
        (names.len() == 2).then_some(names)
    })
    .await;
    assert!(
        added.iter().any(|n| n == lowest),
        "{added:?} holds {lowest}"
    );
    let v = vms.get(lowest).await.unwrap();
    assert_eq!(memory_of(&v).as_deref(), Some("128Mi"));
    // Scaling changed the pool's generation: a revision of its own, with the same template.
    let new_revision = revision_of(&v).unwrap();
    assert_ne!(new_revision, revision);
    assert!(new_revision == updated || revisions.get_opt(&new_revision).await.unwrap().is_some());
}

#[tokio::test]
async fn leader_failover_creates_no_duplicate_pod() {
    let (_server, client) = cluster().await;
    let a = start(&client, "replica-a", true);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let first = vmis
        .create(&PostParams::default(), &vmi("first"))
        .await
        .unwrap();
    wait_for("the first pod", || async {
        pods_of(&client, &first).await.into_iter().next()
    })
    .await;
    let b = start(&client, "replica-b", true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        pods_of(&client, &first).await.len(),
        1,
        "the follower must not act"
    );
    drop(a);
    let second = vmis
        .create(&PostParams::default(), &vmi("second"))
        .await
        .unwrap();
    wait_for("the new leader to render the second pod", || async {
        pods_of(&client, &second).await.into_iter().next()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(pods_of(&client, &first).await.len(), 1);
    assert_eq!(pods_of(&client, &second).await.len(), 1);
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "kubevirt");
    let holder = leases
        .get("virt-controller")
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity;
    assert_eq!(holder.as_deref(), Some("replica-b"));
    drop(b);
}

/// Serves `/healthz`, `/leader` and `/metrics` for `health` on a free port; returns the port.
async fn serve_health(health: std::sync::Arc<controller::metrics::Health>) -> (u16, Running) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        axum::serve(listener, controller::metrics::router(health))
            .await
            .unwrap();
    });
    (port, Running(task))
}

/// A plain HTTP/1.0 GET: the status code and the body.
async fn get(port: u16, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut resp = String::new();
    conn.read_to_string(&mut resp).await.unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_owned())
}

#[tokio::test]
async fn only_the_leader_is_ready_and_its_metrics_count_vmis() {
    let (_server, client) = cluster().await;
    let leader = Options {
        identity: "replica-a".into(),
        ..Options::default()
    };
    let follower = Options {
        identity: "replica-b".into(),
        ..Options::default()
    };
    let (port_a, _sa) = serve_health(leader.health.clone()).await;
    let (port_b, _sb) = serve_health(follower.health.clone()).await;
    assert_eq!(get(port_a, "/healthz").await.0, 200);
    let _a = start_with(&client, leader, true);
    wait_for("replica-a to lead", || async {
        (get(port_a, "/leader").await.0 == 200).then_some(())
    })
    .await;
    let _b = start_with(&client, follower, true);
    assert_eq!(get(port_b, "/healthz").await.0, 200);
    assert_eq!(
        get(port_b, "/leader").await.0,
        503,
        "a follower is not Ready"
    );
    let (_, text) = get(port_b, "/metrics").await;
    assert!(
        text.contains("\nkubevirt_virt_controller_leading_status 0\n"),
        "{text}"
    );

    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    vmis.create(&PostParams::default(), &vmi("counted"))
        .await
        .unwrap();
    let text = wait_for("the VMI in the leader's metrics", || async {
        let (_, text) = get(port_a, "/metrics").await;
        text.contains("kubevirt_vmi_phase_count{node=\"\",phase=\"scheduling\"} 1")
            .then_some(text)
    })
    .await;
    assert!(
        text.contains("\nkubevirt_virt_controller_leading_status 1\n"),
        "{text}"
    );
    let adds = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("kubevirt_workqueue_adds_total{name=\"virt-controller-vmi\"} ")
        })
        .unwrap();
    assert!(adds.parse::<u64>().unwrap() >= 1, "{text}");
}

/// The 20 VMIs exist before the first controller starts, and a ResourceQuota of 5 pods stops
/// it part way, as a crash mid-creation would: 5 pods exist and the other creations failed.
/// The second controller starts without the first's expectations, with the quota gone, and must
/// create the 15 missing pods and no second pod for any VMI.
#[tokio::test]
async fn restart_mid_creation_of_20_vmis_leaves_exactly_20_pods() {
    let (_server, client) = cluster().await;
    let quotas: Api<ResourceQuota> = Api::default_namespaced(client.clone());
    quotas
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "five-pods"},
                "spec": {"hard": {"pods": "5"}},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    // Until kube-controller-manager has counted usage, quota admission refuses every pod.
    wait_for("the quota's usage", || async {
        let quota = quotas.get("five-pods").await.unwrap();
        quota
            .status
            .and_then(|s| s.used)
            .is_some_and(|used| used.contains_key("pods"))
            .then_some(())
    })
    .await;
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    for i in 0..20 {
        vmis.create(&PostParams::default(), &vmi(&format!("vm{i:02}")))
            .await
            .unwrap();
    }
    let first = start(&client, "a", false);
    wait_for("5 pods from the first controller", || async {
        (launcher_pods(&client).await.len() >= 5).then_some(())
    })
    .await;
    drop(first);
    assert_eq!(launcher_pods(&client).await.len(), 5);
    quotas
        .delete("five-pods", &DeleteParams::default())
        .await
        .unwrap();
    let _second = start(&client, "b", false);
    wait_for("20 pods", || async {
        (launcher_pods(&client).await.len() >= 20).then_some(())
    })
    .await;
    for v in vmis.list(&ListParams::default()).await.unwrap().items {
        assert_eq!(pods_of(&client, &v).await.len(), 1, "{}", v.name_any());
    }
    assert_eq!(launcher_pods(&client).await.len(), 20);
    vmis.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn silent_node_is_made_unschedulable_and_its_vmis_fail() {
    let (_server, client) = cluster().await;
    let opts = Options {
        identity: "a".into(),
        heartbeat_timeout: Duration::from_secs(30),
        node_check_interval: Duration::from_secs(1),
        ..Options::default()
    };
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let old =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(120);
    let fresh = k8s_openapi::jiff::Timestamp::now();
    for (name, beat) in [("silent", old), ("alive", fresh)] {
        nodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {
                    "name": name,
                    "labels": {"kubevirt.io/schedulable": "true"},
                    "annotations": {"kubevirt.io/heartbeat": beat.to_string()},
                }}))
                .unwrap(),
            )
            .await
            .unwrap();
    }
    // Two VMIs the handler had taken over, one per node. The silent node's launcher no longer
    // reports Running (the kubelet there is as gone as the handler); the other one runs.
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    for (name, node, pod_phase) in [
        ("on-silent", "silent", "Unknown"),
        ("on-alive", "alive", "Running"),
    ] {
        let mut v = vmi(name);
        v.metadata.labels = Some([("kubevirt.io/nodeName".to_owned(), node.to_owned())].into());
        v.status = Some(api::VirtualMachineInstanceStatus {
            phase: Some(api::VirtualMachineInstancePhase::Running),
            node_name: Some(node.into()),
            ..Default::default()
        });
        let v = vmis.create(&PostParams::default(), &v).await.unwrap();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": format!("virt-launcher-{name}-abcde"),
                "labels": {"kubevirt.io": "virt-launcher"},
                "ownerReferences": [{
                    "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                    "name": name, "uid": v.uid().unwrap(), "controller": true,
                }],
            },
            "spec": {"nodeName": node, "containers": [{"name": "compute", "image": "virt-launcher"}]},
        }))
        .unwrap();
        let pod = pods.create(&PostParams::default(), &pod).await.unwrap();
        pods.patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": pod_phase}})),
        )
        .await
        .unwrap();
    }
    // Started once the scene is set, as after a controller restart.
    let c = client.clone();
    let _c = Running(tokio::spawn(async move {
        let _ = run_controllers(c, opts).await;
    }));
    wait_for("the silent node to be unschedulable", || async {
        let n = nodes.get("silent").await.unwrap();
        (n.labels()
            .get("kubevirt.io/schedulable")
            .map(String::as_str)
            == Some("false"))
        .then_some(())
    })
    .await;
    let failed = wait_for("its VMI to fail", || async {
        let v = vmis.get("on-silent").await.unwrap();
        (phase(&v).as_deref() == Some("Failed")).then_some(v)
    })
    .await;
    assert_eq!(
        failed.status.unwrap().reason.as_deref(),
        Some("NodeUnresponsive")
    );
    assert_eq!(
        nodes.get("alive").await.unwrap().labels()["kubevirt.io/schedulable"],
        "true"
    );
    assert_ne!(
        phase(&vmis.get("on-alive").await.unwrap()).as_deref(),
        Some("Failed")
    );
}

#[tokio::test]
async fn use_emulation_from_the_kubevirt_cr_applies_live() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let kvm_of = |p: &Pod| {
        p.spec.as_ref().unwrap().containers[0]
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_some_and(|l| l.contains_key("devices.kubevirt.io/kvm"))
    };
    let before = vmis
        .create(&PostParams::default(), &vmi("before"))
        .await
        .unwrap();
    let pod = wait_for("the first pod", || async {
        pods_of(&client, &before).await.into_iter().next()
    })
    .await;
    assert!(kvm_of(&pod), "without a KubeVirt CR, KVM is required");

    let kvs: Api<api::KubeVirt> = Api::namespaced(client.clone(), "kubevirt");
    let kv: api::KubeVirt = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"configuration": {"developerConfiguration": {"useEmulation": true}}},
    }))
    .unwrap();
    kvs.create(&PostParams::default(), &kv).await.unwrap();
    // The controller's cache sees the CR shortly; VMIs created from then on run emulated.
    let mut n = 0;
    let pod = loop {
        let v = vmis
            .create(&PostParams::default(), &vmi(&format!("after{n}")))
            .await
            .unwrap();
        let pod = wait_for("a pod", || async {
            pods_of(&client, &v).await.into_iter().next()
        })
        .await;
        if !kvm_of(&pod) {
            break pod;
        }
        n += 1;
        assert!(n < 20, "useEmulation never took effect");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let args = pod.spec.unwrap().containers[0].args.clone().unwrap();
    assert!(args.contains(&"--allow-emulation".to_owned()), "{args:?}");
}

#[tokio::test]
async fn failing_vm_backs_off_before_restarting() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let vm: VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "crashy", "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": {"spec": vmi_spec()}},
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    let first = wait_for("the first VMI", || async {
        vmis.get_opt("crashy").await.unwrap()
    })
    .await;
    // virt-handler's part: the guest failed before it ever ran.
    vmis.patch(
        "crashy",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Failed"}})),
    )
    .await
    .unwrap();
    let failed_at = tokio::time::Instant::now();
    let status = wait_for("CrashLoopBackOff", || async {
        let s = vms.get("crashy").await.unwrap().status?;
        (s.printable_status.as_ref()?.as_str() == "CrashLoopBackOff").then_some(s)
    })
    .await;
    let failure = status.start_failure.unwrap();
    assert_eq!(failure.consecutive_fail_count, Some(1));
    assert_eq!(failure.last_failed_vmi_uid, first.uid());
    let second = wait_for("the restarted VMI", || async {
        vmis.get_opt("crashy")
            .await
            .unwrap()
            .filter(|v| v.uid() != first.uid())
    })
    .await;
    let waited = failed_at.elapsed();
    assert!(
        waited >= Duration::from_secs(9),
        "restarted after {waited:?}, before the 10 s back-off"
    );
    assert_ne!(second.uid(), first.uid());
}

fn vm_with(name: &str, strategy: &str) -> VirtualMachine {
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"runStrategy": strategy, "template": {"spec": vmi_spec()}},
    }))
    .unwrap()
}

async fn printable(vms: &Api<VirtualMachine>, name: &str) -> Option<String> {
    let s = vms.get(name).await.unwrap().status?;
    Some(s.printable_status?.as_str().to_owned())
}

/// Plays the scheduler, kubelet and virt-handler for the VMI `name` (which must be `other`
/// than a previous instance): waits for it and its pod, runs the pod, and once the controller
/// has scheduled the VMI, reports the guest Running; returns when the VM shows Running, so
/// a later failure does not count as a start failure.
async fn run_guest(
    client: &Client,
    name: &str,
    other: Option<&VirtualMachineInstance>,
) -> VirtualMachineInstance {
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let vmi = wait_for("a new VMI", || async {
        vmis.get_opt(name)
            .await
            .unwrap()
            .filter(|v| other.is_none_or(|o| o.uid() != v.uid()))
    })
    .await;
    let pod = wait_for("its launcher pod", || async {
        pods_of(client, &vmi).await.into_iter().next()
    })
    .await;
    bind_and_run(client, &pod, "node01").await;
    wait_for("phase Scheduled", || async {
        (phase(&vmis.get(name).await.unwrap()).as_deref() == Some("Scheduled")).then_some(())
    })
    .await;
    set_phase(&vmis, name, "Running").await;
    wait_for("the VM to show Running", || async {
        (printable(&vms, name).await.as_deref() == Some("Running")).then_some(())
    })
    .await;
    vmi
}

/// virt-handler's part: the guest's phase, with its transition timestamp (which tells the VM
/// controller whether an ended instance had run).
async fn set_phase(vmis: &Api<VirtualMachineInstance>, name: &str, phase: &str) {
    let vmi = vmis.get(name).await.unwrap();
    let mut stamps =
        serde_json::to_value(&vmi.status.unwrap().phase_transition_timestamps).unwrap();
    stamps.as_array_mut().unwrap().push(json!({
        "phase": phase,
        "phaseTransitionTimestamp": k8s_openapi::jiff::Timestamp::now().to_string(),
    }));
    vmis.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": phase, "phaseTransitionTimestamps": stamps}})),
    )
    .await
    .unwrap();
}

async fn request(vms: &Api<VirtualMachine>, name: &str, action: &str, uid: Option<String>) {
    vms.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"stateChangeRequests": [{"action": action, "uid": uid}]}})),
    )
    .await
    .unwrap();
}

/// The VMI `name` keeps `uid` (or stays absent with `None`) for a few seconds of controller
/// activity: what a strategy must not restart, it does not.
async fn stays(vmis: &Api<VirtualMachineInstance>, name: &str, uid: Option<String>, what: &str) {
    let end = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < end {
        let now = vmis.get_opt(name).await.unwrap().and_then(|v| v.uid());
        assert_eq!(now, uid, "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A cluster with a running controller and the VM `name` of `strategy` created.
struct WithVm {
    _server: Cluster,
    _controller: Running,
    client: Client,
    vms: Api<VirtualMachine>,
    vmis: Api<VirtualMachineInstance>,
}

async fn with_vm(name: &str, strategy: &str) -> WithVm {
    let (server, client) = cluster().await;
    let controller = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    vms.create(&PostParams::default(), &vm_with(name, strategy))
        .await
        .unwrap();
    WithVm {
        _server: server,
        _controller: controller,
        vmis: Api::default_namespaced(client.clone()),
        client,
        vms,
    }
}

#[tokio::test]
async fn always_vm_replaces_a_finished_vmi() {
    // Bound by name, so the cluster and controller live until the test ends.
    let WithVm {
        _server,
        _controller,
        client,
        vms,
        vmis,
    } = with_vm("always", "Always").await;
    let first = run_guest(&client, "always", None).await;
    // The guest shut itself down: Always starts it again, at once since it had run.
    set_phase(&vmis, "always", "Succeeded").await;
    let second = run_guest(&client, "always", Some(&first)).await;
    set_phase(&vmis, "always", "Failed").await;
    run_guest(&client, "always", Some(&second)).await;
    let failure = vms
        .get("always")
        .await
        .unwrap()
        .status
        .unwrap()
        .start_failure;
    assert_eq!(failure, None, "instances that ran are no start failures");
}

/// KubeVirt's network VM controller: an interface switched down (and up again) in a VM reaches
/// its running VMI's spec, where virt-handler's next sync has the launcher set the link.
#[tokio::test]
async fn an_interface_state_changed_in_the_vm_reaches_its_running_vmi() {
    let (_server, client) = cluster().await;
    let _controller = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let interfaces = |state: &str| json!([{"name": "default", "masquerade": {}, "state": state}]);
    let mut spec = vmi_spec();
    spec["domain"]["devices"]["interfaces"] = interfaces("up");
    spec["networks"] = json!([{"name": "default", "pod": {}}]);
    let vm: VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "link", "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": {"spec": spec}},
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    let first = run_guest(&client, "link", None).await;
    for state in ["down", "up"] {
        let patch = json!({"spec": {"template": {"spec": {"domain": {"devices": {
            "interfaces": interfaces(state)}}}}}});
        vms.patch("link", &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
        wait_for(&format!("the VMI's link {state}"), || async {
            let vmi = vmis.get("link").await.unwrap();
            let now = vmi.spec.domain.devices.interfaces[0].state.clone();
            (now.as_deref() == Some(state)).then_some(vmi)
        })
        .await;
    }
    let last = vmis.get("link").await.unwrap();
    assert_eq!(last.uid(), first.uid(), "the VMI was changed, not replaced");
}

#[tokio::test]
async fn rerun_on_failure_restarts_after_failure_not_after_success() {
    // Bound by name, so the cluster and controller live until the test ends.
    let WithVm {
        _server,
        _controller,
        client,
        vms,
        vmis,
    } = with_vm("rerun", "RerunOnFailure").await;
    let first = run_guest(&client, "rerun", None).await;
    set_phase(&vmis, "rerun", "Failed").await;
    let second = run_guest(&client, "rerun", Some(&first)).await;
    set_phase(&vmis, "rerun", "Succeeded").await;
    wait_for("the finished VMI to go", || async {
        vmis.get_opt("rerun").await.unwrap().is_none().then_some(())
    })
    .await;
    wait_for("printableStatus Stopped", || async {
        (printable(&vms, "rerun").await.as_deref() == Some("Stopped")).then_some(())
    })
    .await;
    stays(&vmis, "rerun", None, "a VMI that succeeded is not rerun").await;
    // A start request runs it again.
    request(&vms, "rerun", "Start", None).await;
    run_guest(&client, "rerun", Some(&second)).await;
}

#[tokio::test]
async fn manual_vm_runs_only_on_requests() {
    // Bound by name, so the cluster and controller live until the test ends.
    let WithVm {
        _server,
        _controller,
        client,
        vms,
        vmis,
    } = with_vm("manual", "Manual").await;
    wait_for("printableStatus Stopped", || async {
        (printable(&vms, "manual").await.as_deref() == Some("Stopped")).then_some(())
    })
    .await;
    stays(&vmis, "manual", None, "Manual does not start by itself").await;
    request(&vms, "manual", "Start", None).await;
    let vmi = run_guest(&client, "manual", None).await;
    // A failed guest is left as it is.
    set_phase(&vmis, "manual", "Failed").await;
    stays(
        &vmis,
        "manual",
        vmi.uid(),
        "Manual does not restart a failed VMI",
    )
    .await;
    // A stop request naming the instance removes it, and nothing replaces it.
    request(&vms, "manual", "Stop", vmi.uid()).await;
    wait_for("the VMI to go", || async {
        vmis.get_opt("manual")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    stays(&vmis, "manual", None, "Manual does not start after a stop").await;
    let vm = vms.get("manual").await.unwrap();
    assert_eq!(
        vm.spec
            .run_strategy
            .as_ref()
            .map(api::vm::RunStrategy::as_str),
        Some("Manual")
    );
}

/// The deprecated `spec.running`: true runs as Always, false stops; a Start request on a
/// stopped one flips it to `running: true` rather than adding a runStrategy.
#[tokio::test]
async fn deprecated_running_field_starts_and_stops() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let vm: VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "legacy", "namespace": "default"},
        "spec": {"running": true, "template": {"spec": vmi_spec()}},
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    let first = run_guest(&client, "legacy", None).await;
    set_phase(&vmis, "legacy", "Succeeded").await;
    run_guest(&client, "legacy", Some(&first)).await;
    vms.patch(
        "legacy",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"running": false}})),
    )
    .await
    .unwrap();
    // Deleted: marked for deletion, or already gone (its finalizers can all be released within
    // one poll, the launcher pod's deletion being played at once).
    wait_for("the VMI to be deleted", || async {
        match vmis.get_opt("legacy").await.unwrap() {
            Some(v) => v.metadata.deletion_timestamp.map(|_| ()),
            None => Some(()),
        }
    })
    .await;
    wait_for("the VMI to go", || async {
        vmis.get_opt("legacy")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    request(&vms, "legacy", "Start", None).await;
    wait_for("a VMI after the start request", || async {
        vmis.get_opt("legacy").await.unwrap()
    })
    .await;
    let spec = vms.get("legacy").await.unwrap().spec;
    assert_eq!(spec.running, Some(true));
    assert_eq!(spec.run_strategy, None);
}

#[tokio::test]
async fn once_vm_runs_one_time() {
    // Bound by name, so the cluster and controller live until the test ends.
    let WithVm {
        _server,
        _controller,
        client,
        vms: _,
        vmis,
    } = with_vm("once", "Once").await;
    let vmi = run_guest(&client, "once", None).await;
    set_phase(&vmis, "once", "Failed").await;
    stays(
        &vmis,
        "once",
        vmi.uid(),
        "Once never starts a second instance",
    )
    .await;
}

/// A count from the environment variable `var`, else `default`.
fn env_count(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The resident memory of process `pid`: all of it, then its anonymous memory (heap, stacks)
/// and its file pages (the binary's code), in MiB.
fn rss(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let mib = |field: &str| {
        let kib: u32 = status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        f64::from(kib) / 1024.0
    };
    format!(
        "{:.1} MiB (anonymous {:.1}, file {:.1})",
        mib("VmRSS:"),
        mib("RssAnon:"),
        mib("RssFile:")
    )
}

/// CPU seconds (user + system) process `pid` has used.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10).as_secs_f64()
}

/// Control-plane benchmark (prints, asserts nothing about speed). `BENCH_VMIS` VMIs (default
/// 1,000; the issue's second figure is `BENCH_VMIS=10000`) are created 10 ms apart, each create
/// its own request with at most `BENCH_IN_FLIGHT` (32) outstanding, against 10 simulated nodes: Node
/// objects whose virt-handler heartbeat and kubelet lease the test keeps fresh, kube-scheduler
/// (localcluster's upstream control plane) binding the launcher pods, and a kubelet stand-in
/// reporting each bound pod Running (a no-op launcher). The controller runs
/// as its own process (the `virt-controller` binary, this build's profile), so its resident
/// memory can be read. Prints create -> Scheduling (launcher pod created and seen) and
/// create -> pod bound (adds the scheduler's share) and create -> Scheduled (pod bound and
/// running, VMI handed to the node) p50 / p95 / max,
/// VMIs per second, and the controller's RSS once all are Scheduling (every VMI and launcher
/// pod in its caches) and once all are Scheduled.
/// Run: `cargo test -p controller --test cluster bench_create_to_scheduled -- --ignored --nocapture`
/// (`cargo test` rather than nextest, whose 10-minute limit 1,000 VMIs exceed on a loaded
/// machine; `--release` for figures that do not measure the debug build).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; prints figures"]
async fn bench_create_to_scheduled() {
    use futures::StreamExt as _;
    use kube::runtime::{WatchStreamExt as _, watcher};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use tokio::time::Instant;
    const NODES: usize = 10;
    let n = env_count("BENCH_VMIS", 1000);
    // `BENCH_UNTIL=scheduling` stops once every VMI has its launcher pod (no scheduler, no
    // kubelet stand-in): the controller's RSS with all VMIs and pods cached, at counts the
    // scheduler would take hours to bind.
    let full = std::env::var("BENCH_UNTIL").as_deref() != Ok("scheduling");
    // kube-scheduler binds the launcher pods.
    let (server, client) = cluster_with(full).await;
    let kubeconfig = server.kubeconfig_path();

    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let resources = json!({"cpu": "1k", "memory": "64Ti", "pods": "10k",
        "devices.kubevirt.io/kvm": "10k", "devices.kubevirt.io/tun": "10k",
        "devices.kubevirt.io/vhost-net": "10k"});
    // The kubelets' part: Ready, with their leases renewed, so kube-scheduler keeps using them.
    let mut kubelets = Vec::new();
    for i in 0..NODES {
        let name = format!("sim-{i}");
        let node = json!({"metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubevirt.io/schedulable": "true"},
            "annotations": {"kubevirt.io/heartbeat": k8s_openapi::jiff::Timestamp::now().to_string()},
        }});
        kubelets
            .push(localcluster::controlplane::ready_node(&client, node, resources.clone()).await);
    }
    // virt-handler's part: heartbeats, or the node controller fails the nodes after 5 minutes.
    let heartbeat = {
        let nodes = nodes.clone();
        Running(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_mins(1));
            loop {
                tick.tick().await;
                let now = k8s_openapi::jiff::Timestamp::now().to_string();
                for i in 0..NODES {
                    let patch =
                        json!({"metadata": {"annotations": {"kubevirt.io/heartbeat": now}}});
                    let _ = nodes
                        .patch(
                            &format!("sim-{i}"),
                            &PatchParams::default(),
                            &Patch::Merge(patch),
                        )
                        .await;
                }
            }
        }))
    };
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let created: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let bound: Arc<Mutex<HashMap<String, Duration>>> = Arc::default();
    // The kubelet's part: every bound launcher pod reports Running.
    let kubelet = full.then(|| {
        let pods: Api<Pod> = Api::default_namespaced(client.clone());
        let (created, bound) = (created.clone(), bound.clone());
        Running(tokio::spawn(async move {
            let cfg = watcher::Config::default().labels("kubevirt.io=virt-launcher");
            watcher(pods.clone(), cfg)
                .applied_objects()
                .filter_map(|p| async move { p.ok() })
                .filter(|p| {
                    let is_bound = p.spec.as_ref().is_some_and(|s| s.node_name.is_some());
                    let running =
                        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                    let vmi = p.labels().get("vm.kubevirt.io/name").cloned();
                    if let (true, Some(vmi)) = (is_bound, vmi)
                        && let Some(t) = created.lock().unwrap().get(&vmi)
                    {
                        bound.lock().unwrap().entry(vmi).or_insert(t.elapsed());
                    }
                    std::future::ready(is_bound && !running)
                })
                .for_each_concurrent(16, |p| {
                    let pods = pods.clone();
                    async move {
                        let _ = pods
                            .patch_status(
                                &p.name_any(),
                                &PatchParams::default(),
                                &Patch::Merge(json!({"status": {"phase": "Running"}})),
                            )
                            .await;
                    }
                })
                .await;
        }))
    });
    let mut controller = tokio::process::Command::new(env!("CARGO_BIN_EXE_virt-controller"));
    // `BENCH_CONTROLLER_PRELOAD=/usr/lib/heaptrack/libheaptrack_preload.so` (with heaptrack's
    // `DUMP_HEAPTRACK_OUTPUT`) profiles the controller's heap, and only the controller's.
    if let Ok(preload) = std::env::var("BENCH_CONTROLLER_PRELOAD") {
        controller.env("LD_PRELOAD", preload);
    }
    let controller = controller
        .args(["--port", "0", "--identity", "bench"])
        .env("KUBECONFIG", &kubeconfig)
        // `BENCH_CONTROLLER_LOG=kube_client=debug` logs every request the controller makes.
        .env(
            "RUST_LOG",
            std::env::var("BENCH_CONTROLLER_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = controller.id().unwrap();
    // For attaching a profiler (`heaptrack -p <pid>`) while it runs.
    eprintln!("virt-controller pid {pid}");

    // Latencies as this process's watch sees them (late when the machine is overloaded; a
    // watch that falls behind may skip a phase), so completion is decided by listing.
    let scheduling: Arc<Mutex<HashMap<String, Duration>>> = Arc::default();
    let scheduled: Arc<Mutex<HashMap<String, Duration>>> = Arc::default();
    let _seen = {
        let (created, scheduling, scheduled) =
            (created.clone(), scheduling.clone(), scheduled.clone());
        let vmis = vmis.clone();
        Running(tokio::spawn(async move {
            let stream = watcher(vmis, watcher::Config::default())
                .default_backoff()
                .applied_objects();
            futures::pin_mut!(stream);
            while let Some(v) = stream.next().await {
                let Ok(v) = v else { continue };
                let Some(start) = created.lock().unwrap().get(&v.name_any()).copied() else {
                    continue;
                };
                let seen = match phase(&v).as_deref() {
                    Some("Scheduling") => &scheduling,
                    Some("Scheduled") => &scheduled,
                    _ => continue,
                };
                seen.lock()
                    .unwrap()
                    .entry(v.name_any())
                    .or_insert(start.elapsed());
            }
        }))
    };
    let begin = Instant::now();
    // Each create is its own task, at most `in_flight` at a time, so a slow API server answer
    // does not hold back the next VMI (one create at a time gave 5.5/s, not the 100/s wanted).
    let in_flight = Arc::new(tokio::sync::Semaphore::new(env_count(
        "BENCH_IN_FLIGHT",
        32,
    )));
    let mut creates = tokio::task::JoinSet::new();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for i in 0..n {
        tick.tick().await;
        let permit = in_flight.clone().acquire_owned().await.unwrap();
        let name = format!("bench{i:05}");
        created.lock().unwrap().insert(name.clone(), Instant::now());
        let vmis = vmis.clone();
        creates.spawn(async move {
            vmis.create(&PostParams::default(), &vmi(&name))
                .await
                .unwrap();
            drop(permit);
        });
    }
    while let Some(done) = creates.join_next().await {
        done.unwrap();
    }
    let created_in = begin.elapsed();
    // Generous: the scheduler and the kubelet stand-in, not the controller, set the pace.
    let limit = Duration::from_mins(30).max(Duration::from_millis(300) * u32::try_from(n).unwrap());
    let mut rss_scheduling = None;
    loop {
        let phases: Vec<Option<String>> = vmis
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .map(phase)
            .collect();
        let count = |p: &[&str]| {
            phases
                .iter()
                .filter(|x| x.as_deref().is_some_and(|x| p.contains(&x)))
                .count()
        };
        if rss_scheduling.is_none() && count(&["Scheduling", "Scheduled"]) == n {
            rss_scheduling = Some(rss(pid));
        }
        if !full && rss_scheduling.is_some() || count(&["Scheduled"]) == n {
            break;
        }
        assert!(
            begin.elapsed() < limit,
            "not all VMIs got there within {limit:?}"
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    let total = begin.elapsed();
    let rss_scheduled = full.then(|| rss(pid));
    let cpu = (cpu_secs(pid), cpu_secs(std::process::id()));
    let control_plane = server
        .components()
        .iter()
        .map(|c| format!("{} {:.1} s", c.name(), cpu_secs(c.pid())))
        .collect::<Vec<_>>()
        .join(", ");
    let per_node = {
        let pods: Api<Pod> = Api::default_namespaced(client.clone());
        let mut count: HashMap<String, usize> = HashMap::new();
        for p in pods
            .list(&ListParams::default().labels("kubevirt.io=virt-launcher"))
            .await
            .unwrap()
            .items
        {
            *count
                .entry(p.spec.and_then(|s| s.node_name).unwrap_or_default())
                .or_default() += 1;
        }
        let mut c: Vec<usize> = count.into_values().collect();
        c.sort_unstable();
        c
    };
    let summary = |m: &Mutex<HashMap<String, Duration>>| {
        let mut l: Vec<Duration> = std::mem::take(&mut *m.lock().unwrap())
            .into_values()
            .collect();
        l.sort();
        if l.is_empty() {
            return "none seen".to_owned();
        }
        let pct = |p: usize| l[(l.len() * p / 100).min(l.len() - 1)];
        format!(
            "p50 {:.2?}, p95 {:.2?}, max {:.2?} ({} seen)",
            pct(50),
            pct(95),
            l.last().unwrap(),
            l.len()
        )
    };
    let rate = |d: Duration| f64::from(u32::try_from(n).unwrap()) / d.as_secs_f64();
    println!(
        "{n} VMIs created 10 ms apart over {NODES} simulated nodes (creation took {created_in:.1?}, {:.1}/s):\n  \
         create -> Scheduling {}\n  create -> pod bound  {}\n  create -> Scheduled  {}\n  \
         {:.1} VMIs/s reached {} overall; launcher pods per node {per_node:?}\n  \
         virt-controller RSS with {n} VMIs and pods cached: {} once all were Scheduling, \
         {} once all were Scheduled\n  \
         CPU used: virt-controller {:.1} s, this test process (kubelet stand-in, heartbeats, \
         the bench's own clients) {:.1} s; the control plane: {control_plane}",
        rate(created_in),
        summary(&scheduling),
        summary(&bound),
        summary(&scheduled),
        rate(total),
        if full { "Scheduled" } else { "Scheduling" },
        rss_scheduling.as_deref().unwrap_or("-"),
        rss_scheduled.as_deref().unwrap_or("-"),
        cpu.0,
        cpu.1,
    );
    drop((kubelet, heartbeat, kubelets, controller));
}

/// node01's kubelet's part of pod deletion, which these tests have no kubelet for: the guest of
/// a terminating launcher pod on node01 is gone, so the pod object goes.
fn kubelet_of_node01_removes_terminating_pods(client: &Client) -> Running {
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    Running(tokio::spawn(async move {
        loop {
            let list = pods
                .list(&ListParams::default().labels("kubevirt.io=virt-launcher"))
                .await;
            for p in list.into_iter().flat_map(|l| l.items) {
                let on_node01 =
                    p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("node01");
                if on_node01 && p.metadata.deletion_timestamp.is_some() {
                    let _ = pods
                        .delete(&p.name_any(), &DeleteParams::default().grace_period(0))
                        .await;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }))
}

/// Waits until neither the VM `name`, nor its VMI, nor any launcher pod of it is left.
async fn all_gone(client: &Client, name: &str) {
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    wait_for(
        &format!("VM {name}, its VMI and its pods to go"),
        || async {
            let vm = vms.get_opt(name).await.unwrap();
            let vmi = vmis.get_opt(name).await.unwrap();
            let pods = launcher_pods(client)
                .await
                .into_iter()
                .filter(|p| p.labels().get("vm.kubevirt.io/name").map(String::as_str) == Some(name))
                .count();
            (vm.is_none() && vmi.is_none() && pods == 0).then_some(())
        },
    )
    .await;
}

fn finalizers_of(v: &VirtualMachineInstance) -> Vec<String> {
    v.metadata.finalizers.clone().unwrap_or_default()
}

/// `kubectl delete vm` in each state a VM can be in leaves nothing behind: the VM carries the
/// VM controller's finalizer until its instance is gone, and the instance's copy of it is
/// released once the instance is final.
#[tokio::test]
async fn deleting_a_vm_in_any_state_leaves_no_vm_vmi_or_pod() {
    let (_server, client) = cluster().await;
    let _controller = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    for (name, strategy) in [
        ("running", "Always"),
        ("stopped", "Halted"),
        ("starting", "Always"),
        ("final", "Manual"),
    ] {
        vms.create(&PostParams::default(), &vm_with(name, strategy))
            .await
            .unwrap();
    }
    run_guest(&client, "running", None).await;
    request(&vms, "final", "Start", None).await;
    run_guest(&client, "final", None).await;
    set_phase(&vmis, "final", "Succeeded").await;
    wait_for(
        "the VM controller's finalizer off the final VMI",
        || async {
            let v = vmis.get("final").await.unwrap();
            (!finalizers_of(&v).contains(&api::labels::VM_CONTROLLER_FINALIZER.to_owned()))
                .then_some(())
        },
    )
    .await;
    // "starting": its VMI and pod exist, nothing has scheduled the pod yet.
    let starting = wait_for("the starting VMI", || async {
        vmis.get_opt("starting").await.unwrap()
    })
    .await;
    wait_for("its pod", || async {
        pods_of(&client, &starting).await.into_iter().next()
    })
    .await;
    for name in ["running", "stopped", "starting", "final"] {
        let vm = wait_for("the VM's finalizer", || async {
            let vm = vms.get(name).await.unwrap();
            vm.finalizers()
                .contains(&api::labels::VM_CONTROLLER_FINALIZER.to_owned())
                .then_some(vm)
        })
        .await;
        assert_eq!(vm.finalizers(), [api::labels::VM_CONTROLLER_FINALIZER]);
        vms.delete(name, &DeleteParams::default()).await.unwrap();
    }
    for name in ["running", "stopped", "starting", "final"] {
        all_gone(&client, name).await;
    }
}

/// Waits until kube-controller-manager's garbage collector follows VMs as owners and VMIs as
/// dependents. It finds resources by discovery every 30 s, so a CRD created a moment ago is not
/// followed yet; a VM deleted with orphaning before then has its `orphan` finalizer removed with
/// no dependent orphaned, and the VMI is deleted later as the dependent of a missing owner. A
/// cluster whose CRDs are older than that (any real one) never sees this.
async fn garbage_collector_follows_vms_and_vmis(client: &Client) {
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::default_namespaced(client.clone());
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let owner_ref = |kind: &str, api_version: &str, name: &str, uid: Option<String>| json!([{"apiVersion": api_version, "kind": kind, "name": name, "uid": uid}]);
    let map = maps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "gc-probe"}})).unwrap(),
        )
        .await
        .unwrap();
    let mut dependent_vmi = vmi("gc-probe");
    dependent_vmi.metadata.owner_references =
        serde_json::from_value(owner_ref("ConfigMap", "v1", "gc-probe", map.uid())).unwrap();
    vmis.create(&PostParams::default(), &dependent_vmi)
        .await
        .unwrap();
    let owner_vm = vms
        .create(&PostParams::default(), &vm_with("gc-probe", "Halted"))
        .await
        .unwrap();
    maps.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {
            "name": "gc-probe-of-vm",
            "ownerReferences": owner_ref("VirtualMachine", "kubevirt.io/v1", "gc-probe", owner_vm.uid()),
        }}))
        .unwrap(),
    )
    .await
    .unwrap();
    maps.delete("gc-probe", &DeleteParams::default())
        .await
        .unwrap();
    vms.delete("gc-probe", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        "the garbage collector to delete both dependents",
        || async {
            let vmi_gone = vmis.get_opt("gc-probe").await.unwrap().is_none();
            let map_gone = maps.get_opt("gc-probe-of-vm").await.unwrap().is_none();
            (vmi_gone && map_gone).then_some(())
        },
    )
    .await;
}

/// Deleted with orphaning, the VM goes at once and its running instance stays, without an
/// owner and without the VM controller's finalizer.
#[tokio::test]
async fn deleting_a_vm_with_orphaning_keeps_its_vmi_running() {
    let (_server, client) = cluster().await;
    garbage_collector_follows_vms_and_vmis(&client).await;
    let _controller = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    vms.create(&PostParams::default(), &vm_with("orphaned", "Always"))
        .await
        .unwrap();
    let vmi = run_guest(&client, "orphaned", None).await;
    vms.delete("orphaned", &DeleteParams::orphan())
        .await
        .unwrap();
    wait_for("the VM to go", || async {
        vms.get_opt("orphaned")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let kept = wait_for("the VMI without owner or VM finalizer", || async {
        let v = vmis.get("orphaned").await.unwrap();
        (v.owner_references().is_empty()
            && !finalizers_of(&v).contains(&api::labels::VM_CONTROLLER_FINALIZER.to_owned()))
        .then_some(v)
    })
    .await;
    assert_eq!(kept.uid(), vmi.uid());
    assert_eq!(kept.metadata.deletion_timestamp, None);
    assert_eq!(phase(&kept).as_deref(), Some("Running"));
    assert_eq!(pods_of(&client, &kept).await.len(), 1);
}

/// The controller is down between the VM's deletion and the end of its instance; the one that
/// starts next finishes the job. A VMI found at start-up holding the old name of the VM
/// controller's finalizer gets KubeVirt's, and one holding it with no VM left gets it released.
#[tokio::test]
async fn a_restarted_controller_finishes_deletions_and_migrates_finalizers() {
    let (_server, client) = cluster().await;
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let first = start(&client, "a", false);
    for name in ["deleted", "legacy"] {
        vms.create(&PostParams::default(), &vm_with(name, "Always"))
            .await
            .unwrap();
        run_guest(&client, name, None).await;
    }
    drop(first);
    vms.delete("deleted", &DeleteParams::default())
        .await
        .unwrap();
    // What an older kubevirt-rs left: its finalizer name on a VM's instance, and on an
    // instance whose VM is long gone.
    let legacy = api::labels::LEGACY_VM_CONTROLLER_FINALIZER;
    vmis.patch(
        "legacy",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": [api::labels::VMI_FINALIZER, legacy]}})),
    )
    .await
    .unwrap();
    let mut stray = vmi("stray");
    stray.metadata.finalizers = Some(vec![legacy.to_owned()]);
    vmis.create(&PostParams::default(), &stray).await.unwrap();

    let _second = start(&client, "b", false);
    all_gone(&client, "deleted").await;
    wait_for("the legacy name renamed", || async {
        (finalizers_of(&vmis.get("legacy").await.unwrap())
            == [
                api::labels::VMI_FINALIZER,
                api::labels::VM_CONTROLLER_FINALIZER,
            ])
        .then_some(())
    })
    .await;
    wait_for("the ownerless VMI's VM finalizer released", || async {
        let v = vmis.get("stray").await.unwrap();
        (!finalizers_of(&v)
            .iter()
            .any(|f| f == legacy || f == api::labels::VM_CONTROLLER_FINALIZER))
        .then_some(())
    })
    .await;
}

/// A VMI running on node01 as virt-handler would report it: Scheduled by the controller, then
/// Running.
async fn running_vmi(client: &Client, name: &str) -> VirtualMachineInstance {
    Box::pin(running_vmi_from(client, vmi(name))).await
}

/// [`running_vmi`] of this VMI.
async fn running_vmi_from(client: &Client, vmi: VirtualMachineInstance) -> VirtualMachineInstance {
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let name = &vmi.name_any();
    let created = vmis.create(&PostParams::default(), &vmi).await.unwrap();
    let pod = wait_for("the launcher pod", || async {
        pods_of(client, &created).await.into_iter().next()
    })
    .await;
    bind_and_run(client, &pod, "node01").await;
    wait_for("phase Scheduled", || async {
        (phase(&vmis.get(name).await.unwrap()).as_deref() == Some("Scheduled")).then_some(())
    })
    .await;
    set_phase(&vmis, name, "Running").await;
    wait_for("LiveMigratable=True", || async {
        let v = vmis.get(name).await.unwrap();
        v.status
            .as_ref()?
            .condition(&api::status::VirtualMachineInstanceConditionType::LiveMigratable)
            .filter(|c| c.status == api::common::ConditionStatus::True)?;
        Some(v)
    })
    .await
}

/// A migration as virt-api's mutating webhook stores it (label and finalizer).
async fn create_migration(
    client: &Client,
    name: &str,
    vmi: &str,
) -> api::migration::VirtualMachineInstanceMigration {
    let migrations: Api<api::migration::VirtualMachineInstanceMigration> =
        Api::default_namespaced(client.clone());
    migrations
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
                "metadata": {
                    "name": name,
                    "labels": {"kubevirt.io/vmi-name": vmi},
                    "finalizers": [api::labels::MIGRATION_FINALIZER],
                },
                "spec": {"vmiName": vmi},
            }))
            .unwrap(),
        )
        .await
        .unwrap()
}

fn migration_phase(m: &api::migration::VirtualMachineInstanceMigration) -> Option<String> {
    m.status
        .as_ref()
        .and_then(|s| s.phase.as_ref())
        .map(|p| p.as_str().to_owned())
}

async fn target_pod_of(client: &Client, vmi: &VirtualMachineInstance, uid: &str) -> Option<Pod> {
    pods_of(client, vmi).await.into_iter().find(|p| {
        p.labels()
            .get(api::labels::MIGRATION_JOB_UID)
            .map(String::as_str)
            == Some(uid)
    })
}

async fn wait_migration_phase(
    migrations: &Api<api::migration::VirtualMachineInstanceMigration>,
    name: &str,
    want: &str,
) -> api::migration::VirtualMachineInstanceMigration {
    wait_for(&format!("migration phase {want}"), || async {
        migrations
            .get(name)
            .await
            .ok()
            .filter(|m| migration_phase(m).as_deref() == Some(want))
    })
    .await
}

/// A second Ready node, `node02`, a migration's target; kept Ready while the value lives.
async fn node02(client: &Client) -> localcluster::controlplane::NodeHeartbeat {
    localcluster::controlplane::ready_node(
        client,
        json!({"metadata": {"name": "node02", "labels": {"kubernetes.io/hostname": "node02"}}}),
        serde_json::Value::Null,
    )
    .await
}

/// Waits for the Event with this reason and note on the object named `regarding`.
async fn wait_for_event(client: &Client, regarding: &str, reason: &str, note: &str) {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::default_namespaced(client.clone());
    wait_for(&format!("the {reason} event on {regarding}"), || async {
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|ev| {
                ev.reason.as_deref() == Some(reason)
                    && ev.note.as_deref() == Some(note)
                    && ev.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(regarding)
            })
    })
    .await;
}

#[tokio::test]
async fn migration_hands_off_to_the_handlers_and_succeeds() {
    let (_server, client) = cluster().await;
    let _node02 = node02(&client).await;
    let _c = start(&client, "a", false);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let migrations: Api<api::migration::VirtualMachineInstanceMigration> =
        Api::default_namespaced(client.clone());
    let v = Box::pin(running_vmi(&client, "mover")).await;
    let source = pods_of(&client, &v).await.pop().unwrap();
    let m = create_migration(&client, "mig1", "mover").await;
    let uid = m.uid().unwrap();

    // The target pod: the launcher pod plus the migration's label, annotation and
    // anti-affinity to the VMI's other pods.
    let target = wait_for("the target pod", || target_pod_of(&client, &v, &uid)).await;
    assert_eq!(
        target
            .annotations()
            .get(api::labels::MIGRATION_JOB_NAME)
            .map(String::as_str),
        Some("mig1")
    );
    let anti = serde_json::to_value(
        target
            .spec
            .as_ref()
            .unwrap()
            .affinity
            .as_ref()
            .unwrap()
            .pod_anti_affinity
            .as_ref()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"]["matchLabels"]["kubevirt.io/created-by"],
        json!(v.uid().unwrap())
    );
    wait_migration_phase(&migrations, "mig1", "Scheduling").await;

    // The scheduler and kubelet of node02; the controller hands the VMI over.
    bind_and_run(&client, &target, "node02").await;
    wait_migration_phase(&migrations, "mig1", "PreparingTarget").await;
    let handed = vmis.get("mover").await.unwrap();
    assert_eq!(
        handed
            .labels()
            .get(api::labels::MIGRATION_TARGET_NODE_NAME)
            .map(String::as_str),
        Some("node02")
    );
    let st = handed.status.as_ref().unwrap();
    let ms = st.migration_state.as_ref().unwrap();
    assert_eq!(
        (
            ms.migration_uid.as_deref(),
            ms.target_node.as_deref(),
            ms.target_pod.as_deref(),
            ms.source_node.as_deref(),
            ms.source_pod.as_deref()
        ),
        (
            Some(uid.as_str()),
            Some("node02"),
            Some(target.name_any().as_str()),
            Some("node01"),
            Some(source.name_any().as_str())
        )
    );
    assert!(ms.migration_configuration.is_some());
    assert_eq!(st.migration_method.as_deref(), Some("BlockMigration"));
    assert_eq!(
        st.active_pods
            .get(&target.uid().unwrap())
            .map(String::as_str),
        Some("node02"),
        "the target handler finds its pod in activePods"
    );

    // The handlers' part: target address, start, then the target completes and moves the VMI.
    let patch = |p: serde_json::Value| {
        let vmis = vmis.clone();
        async move {
            vmis.patch("mover", &PatchParams::default(), &Patch::Merge(p))
                .await
                .unwrap();
        }
    };
    patch(json!({"status": {"migrationState": {"targetNodeAddress": "10.0.0.2"}}})).await;
    wait_migration_phase(&migrations, "mig1", "TargetReady").await;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    patch(json!({"status": {"migrationState": {"startTimestamp": now}}})).await;
    wait_migration_phase(&migrations, "mig1", "Running").await;
    patch(json!({
        "metadata": {"labels": {
            api::labels::NODE_NAME: "node02",
            api::labels::MIGRATION_TARGET_NODE_NAME: null,
        }},
        "status": {"nodeName": "node02", "migrationState": {"endTimestamp": now, "completed": true}},
    }))
    .await;
    let done = wait_migration_phase(&migrations, "mig1", "Succeeded").await;
    assert_eq!(
        done.status
            .as_ref()
            .unwrap()
            .migration_state
            .as_ref()
            .unwrap()
            .completed,
        Some(true)
    );
    wait_for("the finalizer to go", || async {
        migrations
            .get("mig1")
            .await
            .unwrap()
            .finalizers()
            .is_empty()
            .then_some(())
    })
    .await;

    // The source launcher exits: its pod is deleted, the VMI runs on in the target pod.
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.patch_status(
        &source.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .unwrap();
    wait_for("only the target pod left", || async {
        let left = pods_of(&client, &v).await;
        (left.len() == 1 && left[0].uid() == target.uid()).then_some(())
    })
    .await;
    let after = wait_for("activePods without the source", || async {
        let v = vmis.get("mover").await.unwrap();
        (v.status.as_ref()?.active_pods.len() == 1).then_some(v)
    })
    .await;
    assert_eq!(phase(&after).as_deref(), Some("Running"));
}

#[tokio::test]
async fn migration_deleted_before_the_handoff_is_canceled() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let migrations: Api<api::migration::VirtualMachineInstanceMigration> =
        Api::default_namespaced(client.clone());
    let v = Box::pin(running_vmi(&client, "stayer")).await;
    let m = create_migration(&client, "mig2", "stayer").await;
    let uid = m.uid().unwrap();
    wait_for("the target pod", || target_pod_of(&client, &v, &uid)).await;
    wait_migration_phase(&migrations, "mig2", "Scheduling").await;

    migrations
        .delete("mig2", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the migration to go", || async {
        migrations
            .get_opt("mig2")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    wait_for("the target pod to go", || async {
        target_pod_of(&client, &v, &uid)
            .await
            .is_none()
            .then_some(())
    })
    .await;
    let after = vmis.get("stayer").await.unwrap();
    assert_eq!(phase(&after).as_deref(), Some("Running"));
    assert!(after.status.unwrap().migration_state.is_none());
    assert_eq!(pods_of(&client, &v).await.len(), 1);
}

/// The evacuation migrations of `vmi`: created by the evacuation controller for `node`.
async fn evacuations_of(
    migrations: &Api<api::migration::VirtualMachineInstanceMigration>,
    vmi: &str,
) -> Vec<api::migration::VirtualMachineInstanceMigration> {
    migrations
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|m| m.spec.vmi_name.as_deref() == Some(vmi))
        .collect()
}

#[tokio::test]
async fn marked_vmis_and_a_drain_tainted_node_get_evacuation_migrations() {
    let (_server, client) = cluster().await;
    let _node02 = node02(&client).await;
    let _c = start(&client, "a", false);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let migrations: Api<api::migration::VirtualMachineInstanceMigration> =
        Api::default_namespaced(client.clone());
    let with_strategy = |name: &str, strategy: &str| {
        let mut v = vmi(name);
        v.spec.eviction_strategy = Some(strategy.into());
        v
    };
    // On node01: two LiveMigrate VMIs (one to be marked by virt-api's eviction webhook), one
    // whose strategy is None.
    for (name, strategy) in [
        ("marked", "LiveMigrate"),
        ("evacuee", "LiveMigrate"),
        ("stayer", "None"),
    ] {
        Box::pin(running_vmi_from(&client, with_strategy(name, strategy))).await;
    }

    // The webhook's mark: only that VMI moves.
    vmis.patch(
        "marked",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"evacuationNodeName": "node01"}})),
    )
    .await
    .unwrap();
    let m = wait_for("the marked VMI's evacuation migration", || async {
        evacuations_of(&migrations, "marked")
            .await
            .into_iter()
            .next()
    })
    .await;
    assert!(m.name_any().starts_with("kubevirt-evacuation-"), "{m:?}");
    assert_eq!(
        m.annotations()
            .get("kubevirt.io/evacuationMigration")
            .map(String::as_str),
        Some("node01")
    );
    assert_eq!(m.spec.priority.as_deref(), Some("system-critical"));
    assert!(evacuations_of(&migrations, "evacuee").await.is_empty());

    // The drain taint: every VMI of the node whose strategy migrates.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    nodes
        .patch(
            "node01",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"taints": [{"key": "kubevirt.io/drain", "effect": "NoSchedule"}]}}),
            ),
        )
        .await
        .unwrap();
    let e = wait_for("the evacuee's evacuation migration", || async {
        evacuations_of(&migrations, "evacuee")
            .await
            .into_iter()
            .next()
    })
    .await;
    let want = format!("Created Migration {}", e.name_any());
    wait_for_event(&client, "evacuee", "SuccessfulCreate", &want).await;
    // Queued again and again by the migrations' progress, nothing is created twice, and the
    // VMI whose strategy is None stays.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(evacuations_of(&migrations, "marked").await.len(), 1);
    assert_eq!(evacuations_of(&migrations, "evacuee").await.len(), 1);
    assert!(evacuations_of(&migrations, "stayer").await.is_empty());
}

#[tokio::test]
async fn pdbs_a_vmi_controls_are_deleted() {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    let (_server, client) = cluster().await;
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let v = vmis
        .create(&PostParams::default(), &vmi("legacy"))
        .await
        .unwrap();
    let uid = v.uid().unwrap();
    // As KubeVirt's older releases left them: one per migratable VMI, controlled by it.
    let pdb = |name: &str, controller: bool| -> PodDisruptionBudget {
        serde_json::from_value(json!({
            "metadata": {"name": name, "ownerReferences": [{
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "name": "legacy", "uid": uid, "controller": controller,
            }]},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"kubevirt.io/created-by": uid}}},
        }))
        .unwrap()
    };
    let pdbs: Api<PodDisruptionBudget> = Api::default_namespaced(client.clone());
    for (name, controller) in [
        ("kubevirt-disruption-budget-legacy", true),
        ("owned-not-controlled", false),
    ] {
        pdbs.create(&PostParams::default(), &pdb(name, controller))
            .await
            .unwrap();
    }
    let _c = start(&client, "a", false);
    wait_for("the VMI's PDB deleted", || async {
        pdbs.get_opt("kubevirt-disruption-budget-legacy")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    wait_for_event(
        &client,
        "legacy",
        "SuccessfulDelete",
        "Deleted PodDisruptionBudget kubevirt-disruption-budget-legacy",
    )
    .await;
    assert!(
        pdbs.get_opt("owned-not-controlled")
            .await
            .unwrap()
            .is_some(),
        "a PDB the VMI does not control stays"
    );
}

#[tokio::test]
async fn a_repeated_event_is_counted_and_a_new_message_under_its_reason_is_kept() {
    let (_server, client) = cluster().await;
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let v = vmis
        .create(&PostParams::default(), &vmi("noted"))
        .await
        .unwrap();
    let publisher = informer::events::Publisher::new(
        client.clone(),
        informer::events::Reporter {
            controller: "virt-controller".into(),
            instance: None,
        },
    );
    for note in ["Created pod", "Created pod", "Created Migration"] {
        informer::publish_event(&publisher, &v, false, "SuccessfulCreate", note.into()).await;
    }
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::default_namespaced(client.clone());
    let mut seen: Vec<(String, Option<i32>)> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("noted"))
        .map(|e| (e.note.unwrap_or_default(), e.series.map(|s| s.count)))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("Created Migration".to_owned(), None),
            ("Created pod".to_owned(), Some(2))
        ]
    );
}

/// A VMI whose claim does not exist gets no launcher pod, as KubeVirt's: it stays Pending with
/// `Synchronized=False`, reason `FailedPvcNotFound`, and one such event; once the claim exists
/// (a `Block` one) the pod is created with it as a `volumeDevices` entry at `/dev/<volume>`, and
/// the condition goes.
#[tokio::test]
async fn a_vmi_waits_for_its_claim_then_gets_a_block_claim_as_a_device() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let mut v = vmi("blk");
    v.spec
        .domain
        .devices
        .disks
        .push(serde_json::from_value(json!({"name": "raw", "disk": {"bus": "virtio"}})).unwrap());
    v.spec.volumes.push(
        serde_json::from_value(
            json!({"name": "raw", "persistentVolumeClaim": {"claimName": "raw"}}),
        )
        .unwrap(),
    );
    vmis.create(&PostParams::default(), &v).await.unwrap();
    let message = "spec.volumes[1].persistentVolumeClaim.claimName: PVC default/raw does not \
                   exist, waiting for it to appear";
    let synchronized = |v: &VirtualMachineInstance| {
        v.status.as_ref().and_then(|s| {
            s.condition(&api::status::VirtualMachineInstanceConditionType::Synchronized)
                .cloned()
        })
    };
    let waiting = wait_for("the VMI waiting for its claim", || async {
        synchronized(&vmis.get("blk").await.unwrap())
            .filter(|c| c.reason.as_deref() == Some("FailedPvcNotFound"))
    })
    .await;
    assert_eq!(
        (waiting.status, waiting.message.as_deref()),
        (api::common::ConditionStatus::False, Some(message))
    );
    wait_for_event(&client, "blk", "FailedPvcNotFound", message).await;
    let created = vmis.get("blk").await.unwrap();
    assert_eq!(phase(&created).as_deref(), Some("Pending"));
    assert!(pods_of(&client, &created).await.is_empty());

    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::default_namespaced(client.clone());
    claims
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "raw"},
                "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block",
                         "storageClassName": "", "resources": {"requests": {"storage": "64Mi"}}},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let pod = wait_for("the launcher pod", || async {
        pods_of(&client, &created).await.into_iter().next()
    })
    .await;
    let compute = &pod.spec.unwrap().containers[0];
    assert_eq!(
        serde_json::to_value(&compute.volume_devices).unwrap(),
        json!([{"name": "raw", "devicePath": "/dev/raw"}])
    );
    assert!(
        !compute
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "raw"),
        "a block claim is not mounted"
    );
    wait_for("the condition gone", || async {
        synchronized(&vmis.get("blk").await.unwrap())
            .is_none_or(|c| c.reason.as_deref() != Some("FailedPvcNotFound"))
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_claim_hotplugged_into_a_vm_gets_an_attachment_pod_until_it_is_removed() {
    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    // A claim bound by kube-controller-manager to a volume made for it.
    let pvs: Api<k8s_openapi::api::core::v1::PersistentVolume> = Api::all(client.clone());
    pvs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "pv-data"},
            "spec": {"capacity": {"storage": "64Mi"}, "accessModes": ["ReadWriteOnce"],
                     "hostPath": {"path": "/tmp/pv-data"}, "storageClassName": "",
                     "claimRef": {"namespace": "default", "name": "data"}},
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::default_namespaced(client.clone());
    claims
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "",
                         "volumeName": "pv-data", "resources": {"requests": {"storage": "64Mi"}}},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    vms.create(&PostParams::default(), &vm_with("hp", "Always"))
        .await
        .unwrap();
    let vmi = run_guest(&client, "hp", None).await;
    let launcher = pods_of(&client, &vmi).await.remove(0);

    // virt-api's addvolume on a VM: the volume and its disk in the template.
    let template = |with: bool| {
        let mut spec = vmi_spec();
        if with {
            spec["domain"]["devices"]["disks"]
                .as_array_mut()
                .unwrap()
                .push(json!({"name": "data", "disk": {"bus": "scsi"}}));
            spec["volumes"].as_array_mut().unwrap().push(
                json!({"name": "data", "persistentVolumeClaim": {"claimName": "data", "hotpluggable": true}}),
            );
        }
        json!({"spec": {"template": {"spec": spec}}})
    };
    vms.patch("hp", &PatchParams::default(), &Patch::Merge(template(true)))
        .await
        .unwrap();
    let entry = |v: &VirtualMachineInstance| {
        v.status
            .as_ref()
            .and_then(|s| s.volume_status.iter().find(|e| e.name == "data").cloned())
    };
    let attachment = wait_for("the attachment pod", || async {
        pods.list(&ListParams::default().labels("kubevirt.io=hotplug-disk"))
            .await
            .unwrap()
            .items
            .into_iter()
            .next()
    })
    .await;
    let spec = attachment.spec.clone().unwrap();
    assert_eq!(
        attachment.owner_references()[0].uid,
        launcher.uid().unwrap()
    );
    assert_eq!(
        spec.volumes.unwrap()[1]
            .persistent_volume_claim
            .as_ref()
            .unwrap()
            .claim_name,
        "data"
    );
    let e = wait_for("the volume AttachedToNode", || async {
        entry(&vmis.get("hp").await.unwrap())
            .filter(|e| e.phase.as_deref() == Some("AttachedToNode"))
    })
    .await;
    let claim_info = &e.persistent_volume_claim_info.unwrap().0;
    assert_eq!(claim_info["capacity"]["storage"], "64Mi", "{claim_info}");
    let v = vmis.get("hp").await.unwrap();
    assert!(
        v.spec.volumes.iter().any(|v| v.name == "data"),
        "the VM controller added the volume to the VMI"
    );
    // The attachment pod runs, its container ready: virt-handler may mount from it.
    bind_and_run(&client, &attachment, "node01").await;
    pods.patch_status(
        &attachment.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"containerStatuses": [{
            "name": "hotplug-disk", "ready": true, "image": "", "imageID": "", "restartCount": 0,
        }]}})),
    )
    .await
    .unwrap();
    wait_for("the attachment pod's uid in the status", || async {
        entry(&vmis.get("hp").await.unwrap()).filter(|e| {
            e.hotplug_volume
                .as_ref()
                .is_some_and(|h| h.0["attachPodUID"].as_str() == attachment.uid().as_deref())
        })
    })
    .await;

    // removevolume: out of the template, out of the VMI; not in use by the launcher, so the
    // attachment pod and the entry go.
    vms.patch(
        "hp",
        &PatchParams::default(),
        &Patch::Merge(template(false)),
    )
    .await
    .unwrap();
    wait_for("the attachment pod and the entry gone", || async {
        let left = pods
            .list(&ListParams::default().labels("kubevirt.io=hotplug-disk"))
            .await
            .unwrap()
            .items;
        let v = vmis.get("hp").await.unwrap();
        (left.is_empty() && entry(&v).is_none() && !v.spec.volumes.iter().any(|v| v.name == "data"))
            .then_some(())
    })
    .await;
}

/// A VM using a cluster instance type and preference: virt-controller snapshots both into
/// ControllerRevisions named as KubeVirt names them, records them in the VM's status, and
/// starts the VMI with the snapshot's values expanded, so an edit of the instance type after
/// the snapshot does not reach the VM. A VM whose template clashes with its instance type gets
/// no VMI and a Failure condition naming the field.
#[tokio::test]
async fn instancetype_and_preference_are_snapshotted_and_expanded_into_the_vmi() {
    use api::instancetype::{VirtualMachineClusterInstancetype, VirtualMachineClusterPreference};
    use k8s_openapi::api::apps::v1::ControllerRevision;

    let (_server, client) = cluster().await;
    let _c = start(&client, "a", false);
    let types: Api<VirtualMachineClusterInstancetype> = Api::all(client.clone());
    let prefs: Api<VirtualMachineClusterPreference> = Api::all(client.clone());
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let revisions: Api<ControllerRevision> = Api::default_namespaced(client.clone());
    let it = types
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "instancetype.kubevirt.io/v1beta1",
                "kind": "VirtualMachineClusterInstancetype",
                "metadata": {"name": "u1.small"},
                "spec": {"cpu": {"guest": 2}, "memory": {"guest": "256Mi"}},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let pref = prefs
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "instancetype.kubevirt.io/v1beta1",
                "kind": "VirtualMachineClusterPreference",
                "metadata": {"name": "linux"},
                "spec": {
                    "cpu": {"preferredCPUTopology": "cores"},
                    "devices": {"preferredDiskBus": "virtio"},
                    "preferredTerminationGracePeriodSeconds": 33,
                },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let vm_json = |name: &str, strategy: &str, domain: serde_json::Value| {
        serde_json::from_value::<VirtualMachine>(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "runStrategy": strategy,
                "instancetype": {"name": "u1.small"},
                "preference": {"name": "linux"},
                "template": {"spec": {
                    "domain": domain,
                    "volumes": [{"name": "root", "containerDisk": {"image": "example/disk:1"}}],
                }},
            },
        }))
        .unwrap()
    };
    let vm = vms
        .create(
            &PostParams::default(),
            &vm_json(
                "vm1",
                "Halted",
                json!({"devices": {"disks": [{"name": "root"}]}}),
            ),
        )
        .await
        .unwrap();

    let revision_of = |status: Option<&api::vm::InstancetypeStatusRef>| {
        status?.controller_revision_ref.as_ref()?.name.clone()
    };
    let (it_rev, pref_rev) = wait_for("both revisions in the VM's status", || async {
        let s = vms.get("vm1").await.unwrap().status?;
        Some((
            revision_of(s.instancetype_ref.as_ref())?,
            revision_of(s.preference_ref.as_ref())?,
        ))
    })
    .await;
    assert_eq!(
        it_rev,
        format!("vm1-u1.small-v1beta1-{}-1", it.uid().unwrap())
    );
    assert_eq!(
        pref_rev,
        format!("vm1-linux-v1beta1-{}-1", pref.uid().unwrap())
    );
    let rev = revisions.get(&it_rev).await.unwrap();
    assert_eq!(
        rev.metadata.owner_references.unwrap()[0].uid,
        vm.uid().unwrap()
    );
    assert_eq!(
        rev.metadata.labels.unwrap()["instancetype.kubevirt.io/object-kind"],
        "VirtualMachineClusterInstancetype"
    );

    // The instance type grows after the snapshot: vm1 keeps what it has.
    types
        .patch(
            "u1.small",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cpu": {"guest": 4}}})),
        )
        .await
        .unwrap();
    vms.patch(
        "vm1",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"runStrategy": "Always"}})),
    )
    .await
    .unwrap();
    let vmi = wait_for("the VMI", || async { vmis.get_opt("vm1").await.unwrap() }).await;
    let cpu = vmi.spec.domain.cpu.clone().unwrap();
    assert_eq!(
        (cpu.sockets, cpu.cores, cpu.threads),
        (Some(1), Some(2), Some(1)),
        "2 vCPUs of the snapshot, as cores"
    );
    assert_eq!(
        vmi.spec
            .domain
            .memory
            .as_ref()
            .unwrap()
            .guest
            .as_ref()
            .unwrap()
            .0,
        "256Mi"
    );
    assert_eq!(
        vmi.spec.domain.devices.disks[0].bus(),
        Some(&api::vmi::DiskBus::Virtio)
    );
    assert_eq!(vmi.spec.termination_grace_period_seconds, Some(33));
    let annotations = vmi.metadata.annotations.unwrap();
    assert_eq!(
        annotations["kubevirt.io/cluster-instancetype-name"],
        "u1.small"
    );
    assert_eq!(annotations["kubevirt.io/cluster-preference-name"], "linux");

    // A template that sets what the instance type sets: no snapshot, no VMI, the field named.
    vms.create(
        &PostParams::default(),
        &vm_json(
            "vm2",
            "Always",
            json!({"cpu": {"cores": 1}, "devices": {"disks": [{"name": "root"}]}}),
        ),
    )
    .await
    .unwrap();
    let message = wait_for("vm2's Failure condition", || async {
        let s = vms.get("vm2").await.unwrap().status?;
        s.conditions
            .into_iter()
            .find(|c| c.type_.as_str() == "Failure")
            .and_then(|c| c.message)
    })
    .await;
    assert!(
        message.contains(
            "VM field(s) spec.template.spec.domain.cpu.cores conflicts with selected instance type"
        ),
        "{message}"
    );
    assert!(vmis.get_opt("vm2").await.unwrap().is_none());
}

/// The cluster's default StorageClass, `local`; it binds when the pod is scheduled, so a claim
/// on it is ready for the pod at once.
async fn default_class(client: &Client) {
    let class: k8s_openapi::api::storage::v1::StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "local",
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
        "provisioner": "example.com/none",
        "volumeBindingMode": "WaitForFirstConsumer",
    }))
    .unwrap();
    Api::all(client.clone())
        .create(&PostParams::default(), &class)
        .await
        .unwrap();
}

/// `efi.persistent` (KubeVirt's backend storage): with no default StorageClass the VMI stays
/// Pending, its `Synchronized` condition `FailedBackendStorageCreate`; once there is one, the
/// VMI controller makes the VM's claim (KubeVirt's name, labels, size, access mode and owner)
/// before the launcher pod, which mounts its `nvram` directory, and the VM's next instance
/// mounts the same claim.
#[tokio::test]
async fn persistent_efi_gets_the_vms_backend_storage_claim_before_its_pod() {
    use api::status::VirtualMachineInstanceConditionType::Synchronized;
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;

    let (_server, client) = cluster().await;
    let _controller = start(&client, "a", false);
    let vms: Api<VirtualMachine> = Api::default_namespaced(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::default_namespaced(client.clone());
    let mut spec = vmi_spec();
    spec["domain"]["firmware"] =
        json!({"bootloader": {"efi": {"secureBoot": false, "persistent": true}}});
    let vm: VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "efi", "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": {"spec": spec}},
    }))
    .unwrap();
    let vm = vms.create(&PostParams::default(), &vm).await.unwrap();

    let first = wait_for("FailedBackendStorageCreate", || async {
        let v = vmis.get_opt("efi").await.unwrap()?;
        let c = v.status.as_ref()?.condition(&Synchronized)?;
        (c.reason.as_deref() == Some("FailedBackendStorageCreate")).then(|| v.clone())
    })
    .await;
    let status = first.status.as_ref().unwrap();
    assert_eq!(
        status.condition(&Synchronized).unwrap().message.as_deref(),
        Some("no default storage class found")
    );
    assert_eq!(phase(&first).as_deref(), Some("Pending"));
    assert!(pods_of(&client, &first).await.is_empty());

    default_class(&client).await;
    let pod = wait_for("the launcher pod", || async {
        pods_of(&client, &first).await.into_iter().next()
    })
    .await;
    let list = claims
        .list(&ListParams::default().labels("persistent-state-for=efi"))
        .await
        .unwrap()
        .items;
    assert_eq!(list.len(), 1, "one claim");
    let claim = &list[0];
    let name = claim.name_any();
    assert!(name.starts_with("persistent-state-for-efi-"), "{name}");
    assert_eq!(
        claim.labels().get("cdi.kubevirt.io/applyStorageProfile"),
        Some(&"true".to_owned())
    );
    let owner = &claim.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
        ("VirtualMachine", vm.uid().unwrap().as_str(), Some(true))
    );
    let cs = claim.spec.as_ref().unwrap();
    assert_eq!(
        (
            cs.access_modes.as_deref(),
            cs.storage_class_name.as_deref(),
            cs.volume_mode.as_deref()
        ),
        (
            Some(&["ReadWriteOnce".to_owned()][..]),
            Some("local"),
            Some("Filesystem")
        )
    );
    assert_eq!(
        cs.resources.as_ref().unwrap().requests.as_ref().unwrap()["storage"].0,
        "10Mi"
    );
    let mounted = |pod: &Pod| {
        let spec = pod.spec.as_ref().unwrap();
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "vm-state")
            .and_then(|v| v.persistent_volume_claim.as_ref())
            .map(|c| c.claim_name.clone());
        let mount = spec.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == "vm-state")
            .map(|m| (m.mount_path.clone(), m.sub_path.clone()));
        (volume, mount)
    };
    let nvram = Some((
        "/var/lib/libvirt/qemu/nvram".to_owned(),
        Some("nvram".to_owned()),
    ));
    assert_eq!(mounted(&pod), (Some(name.clone()), nvram.clone()));
    let entry = wait_for("the claim in volumeStatus", || async {
        let v = vmis.get("efi").await.unwrap();
        let s = v.status?;
        let e = s
            .volume_status
            .into_iter()
            .find(|e| e.name == "persistent-state-for-this-vm")?;
        Some(e.persistent_volume_claim_info?.0)
    })
    .await;
    assert_eq!(
        entry,
        json!({"claimName": name, "accessModes": ["ReadWriteOnce"]})
    );

    // The guest ends; the VM's next instance gets the same claim.
    bind_and_run(&client, &pod, "node01").await;
    set_phase(&vmis, "efi", "Succeeded").await;
    let second = wait_for("a new VMI", || async {
        vmis.get_opt("efi")
            .await
            .unwrap()
            .filter(|v| v.uid() != first.uid())
    })
    .await;
    let pod = wait_for("its launcher pod", || async {
        pods_of(&client, &second).await.into_iter().next()
    })
    .await;
    assert_eq!(mounted(&pod), (Some(name), nvram));
    let list = claims
        .list(&ListParams::default().labels("persistent-state-for=efi"))
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1, "the claim is reused, not made again");
}

/// KubeVirt's backend-storage hand-off: a VMI keeping its EFI variables on a `ReadWriteOnce`
/// claim is live-migratable; the migration makes a claim for the target (labelled with its
/// name, named in its status and then in the VMI's state), which the target pod mounts; on
/// success that claim becomes the VMI's, the source's is deleted, and the VMI's
/// `volumeStatus` names the new one.
#[tokio::test]
async fn persistent_efi_on_a_node_local_claim_migrates_and_hands_the_claim_over() {
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;

    let (_server, client) = cluster().await;
    let _node02 = node02(&client).await;
    let _c = start(&client, "a", false);
    let vmis: Api<VirtualMachineInstance> = Api::default_namespaced(client.clone());
    let migrations: Api<api::migration::VirtualMachineInstanceMigration> =
        Api::default_namespaced(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::default_namespaced(client.clone());
    default_class(&client).await;
    let mut efi = vmi("efi");
    efi.spec.domain.firmware = serde_json::from_value(
        json!({"bootloader": {"efi": {"secureBoot": false, "persistent": true}}}),
    )
    .unwrap();
    let v = Box::pin(running_vmi_from(&client, efi)).await;
    let source_claim = api::backendstorage::current_claim(&v)
        .expect("the VMI's claim in volumeStatus")
        .to_owned();
    let claim_of = |pod: &Pod| {
        pod.spec
            .as_ref()
            .unwrap()
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == api::backendstorage::POD_VOLUME)
            .and_then(|v| v.persistent_volume_claim.as_ref())
            .map(|c| c.claim_name.clone())
    };

    let m = create_migration(&client, "mig-efi", "efi").await;
    let uid = m.uid().unwrap();
    let target = wait_for("the target pod", || target_pod_of(&client, &v, &uid)).await;
    let made = claims
        .list(&ListParams::default().labels("kubevirt.io/migrationName=mig-efi"))
        .await
        .unwrap()
        .items;
    assert_eq!(made.len(), 1, "one claim for the target");
    let target_claim = made[0].name_any();
    assert!(
        target_claim.starts_with("persistent-state-for-efi-") && target_claim != source_claim,
        "{target_claim}"
    );
    assert!(!made[0].labels().contains_key("persistent-state-for"));
    assert_eq!(
        made[0].spec.as_ref().unwrap().access_modes.as_deref(),
        Some(&["ReadWriteOnce".to_owned()][..])
    );
    assert_eq!(claim_of(&target), Some(target_claim.clone()));
    let scheduling = wait_migration_phase(&migrations, "mig-efi", "Scheduling").await;
    let ms = scheduling.status.unwrap().migration_state.unwrap();
    assert_eq!(
        (
            ms.source_persistent_state_pvc_name.as_deref(),
            ms.target_persistent_state_pvc_name.as_deref()
        ),
        (Some(source_claim.as_str()), Some(target_claim.as_str()))
    );

    bind_and_run(&client, &target, "node02").await;
    wait_migration_phase(&migrations, "mig-efi", "PreparingTarget").await;
    let handed = vmis.get("efi").await.unwrap();
    let vs = handed.status.unwrap().migration_state.unwrap();
    assert_eq!(
        vs.target_persistent_state_pvc_name.as_deref(),
        Some(target_claim.as_str())
    );
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    for p in [
        json!({"status": {"migrationState": {"targetNodeAddress": "10.0.0.2"}}}),
        json!({"status": {"migrationState": {"startTimestamp": now}}}),
        json!({
            "metadata": {"labels": {
                api::labels::NODE_NAME: "node02",
                api::labels::MIGRATION_TARGET_NODE_NAME: null,
            }},
            "status": {"nodeName": "node02",
                "migrationState": {"endTimestamp": now, "completed": true}},
        }),
    ] {
        vmis.patch("efi", &PatchParams::default(), &Patch::Merge(p))
            .await
            .unwrap();
    }
    wait_migration_phase(&migrations, "mig-efi", "Succeeded").await;
    let kept = claims.get(&target_claim).await.unwrap();
    assert_eq!(
        kept.labels()
            .get("persistent-state-for")
            .map(String::as_str),
        Some("efi")
    );
    assert!(!kept.labels().contains_key("kubevirt.io/migrationName"));
    // kube-apiserver's pvc-protection finalizer holds the source's claim until a controller
    // sees no pod using it; none runs here, so it is only marked deleted.
    let source = claims.get_opt(&source_claim).await.unwrap();
    assert!(
        source.is_none_or(|c| c.metadata.deletion_timestamp.is_some()),
        "the source's claim deleted"
    );
    wait_for("volumeStatus naming the target's claim", || async {
        let v = vmis.get("efi").await.unwrap();
        (api::backendstorage::current_claim(&v) == Some(target_claim.as_str())).then_some(())
    })
    .await;
}
