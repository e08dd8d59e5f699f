//! `manifests/install/` with the real `kubectl` against localcluster's upstream control plane:
//! every object is accepted, the Deployment and DaemonSet produce pods shaped as the components
//! need (command, env, host paths, privileges), and a second apply changes nothing.
//!
//! kube-controller-manager runs the workload controllers, but there is no scheduler or kubelet
//! here, so the pods are checked as objects; running them is the full-stack run's job
//! (`hack/run.sh`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

mod common;
use common::kubectl;

const DEADLINE: Duration = Duration::from_mins(1);

fn manifests(sub: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests")
        .join(sub)
}

async fn pods(client: &kube::Client, app: &str, want: usize) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), "kubevirt");
    let lp = ListParams::default().labels(&format!("kubevirt.io={app}"));
    let end = tokio::time::Instant::now() + DEADLINE;
    loop {
        let items = api.list(&lp).await.unwrap().items;
        if items.len() == want {
            return items;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "{app}: {} pods after {DEADLINE:?}, want {want}",
            items.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn env_field(c: &Container, name: &str) -> Option<String> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.clone())
}

fn host_path_mounts(spec: &PodSpec) -> Vec<(String, String)> {
    let c = &spec.containers[0];
    spec.volumes
        .iter()
        .flatten()
        .filter_map(|v| {
            let host = v.host_path.as_ref()?.path.clone();
            let at = c
                .volume_mounts
                .iter()
                .flatten()
                .find(|m| m.name == v.name)?
                .mount_path
                .clone();
            Some((host, at))
        })
        .collect()
}

fn grants(rules: &[k8s_openapi::api::rbac::v1::PolicyRule], resource: &str, verb: &str) -> bool {
    rules.iter().any(|r| {
        r.resources.iter().flatten().any(|x| x == resource) && r.verbs.iter().any(|v| v == verb)
    })
}

#[tokio::test]
async fn install_manifests_apply_and_render_the_components() {
    let plane = localcluster::controlplane::TestControlPlane::start(false).await;
    let kubeconfig = plane.kubeconfig_path();
    let client = plane.client().await;

    kubectl(
        &kubeconfig,
        &["apply", "-f", manifests("crds").to_str().unwrap()],
    )
    .await;
    let install = manifests("install");
    kubectl(&kubeconfig, &["apply", "-f", install.to_str().unwrap()]).await;

    // RBAC with KubeVirt's names.
    for name in ["kubevirt-controller", "kubevirt-handler"] {
        Api::<ServiceAccount>::namespaced(client.clone(), "kubevirt")
            .get(name)
            .await
            .unwrap();
        let b = Api::<ClusterRoleBinding>::all(client.clone())
            .get(name)
            .await
            .unwrap();
        assert_eq!(b.role_ref.name, name);
        let subject = &b.subjects.as_ref().unwrap()[0];
        assert_eq!(
            (subject.name.as_str(), subject.namespace.as_deref()),
            (name, Some("kubevirt"))
        );
    }
    let controller = Api::<ClusterRole>::all(client.clone())
        .get("kubevirt-controller")
        .await
        .unwrap()
        .rules
        .unwrap();
    assert!(grants(&controller, "pods", "create"));
    assert!(
        grants(&controller, "pods/status", "patch"),
        "the unpaused condition"
    );
    assert!(grants(&controller, "virtualmachineinstances", "create"));
    let handler = Api::<ClusterRole>::all(client.clone())
        .get("kubevirt-handler")
        .await
        .unwrap()
        .rules
        .unwrap();
    assert!(grants(&handler, "virtualmachineinstances", "patch"));
    assert!(
        !grants(&handler, "pods", "create"),
        "the handler never creates pods"
    );
    let leases = Api::<Role>::namespaced(client.clone(), "kubevirt")
        .get("kubevirt-controller")
        .await
        .unwrap()
        .rules
        .unwrap();
    assert!(grants(&leases, "leases", "patch"));
    Api::<RoleBinding>::namespaced(client.clone(), "kubevirt")
        .get("kubevirt-controller")
        .await
        .unwrap();

    // virt-controller: 2 replicas, each told its name and namespace for leader election.
    let d = Api::<Deployment>::namespaced(client.clone(), "kubevirt")
        .get("virt-controller")
        .await
        .unwrap();
    assert_eq!(d.spec.replicas, Some(2));
    for p in pods(&client, "virt-controller", 2).await {
        let spec = p.spec.unwrap();
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("kubevirt-controller")
        );
        let c = &spec.containers[0];
        assert_eq!(
            c.image.as_deref(),
            Some("kubevirt-rs/virt-controller:latest")
        );
        assert_eq!(
            c.command, None,
            "the image's entrypoint (/usr/bin/virt-controller) runs"
        );
        let args = c.args.clone().unwrap();
        let at = args.iter().position(|a| a == "--launcher-image").unwrap();
        assert_eq!(args[at + 1], "kubevirt-rs/virt-launcher:latest");
        let live = c
            .liveness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap();
        assert_eq!(live.path.as_deref(), Some("/healthz"));
        assert_eq!(
            live.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8443),
            "the controller's --port default"
        );
        assert_eq!(env_field(c, "POD_NAME").as_deref(), Some("metadata.name"));
        assert_eq!(
            env_field(c, "POD_NAMESPACE").as_deref(),
            Some("metadata.namespace")
        );
    }

    // virt-handler: one pod per node, privileged, host PID, the host paths it works on.
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "node-a", "labels": {"kubernetes.io/hostname": "node-a"}}
    }))
    .unwrap();
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .unwrap();
    Api::<DaemonSet>::namespaced(client.clone(), "kubevirt")
        .get("virt-handler")
        .await
        .unwrap();
    let p = pods(&client, "virt-handler", 1).await.remove(0);
    let spec = p.spec.unwrap();
    assert_eq!(
        spec.service_account_name.as_deref(),
        Some("kubevirt-handler")
    );
    assert_eq!(spec.host_pid, Some(true));
    let c = &spec.containers[0];
    assert_eq!(c.image.as_deref(), Some("kubevirt-rs/virt-handler:latest"));
    assert_eq!(
        c.command, None,
        "the image's entrypoint (/usr/bin/virt-handler) runs"
    );
    assert_eq!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    assert_eq!(env_field(c, "NODE_NAME").as_deref(), Some("spec.nodeName"));
    let mut mounts = host_path_mounts(&spec);
    mounts.sort();
    assert_eq!(
        mounts,
        [
            // KubeVirt's kubelet volume: device plugins and the CPU manager's checkpoint.
            ("/var/lib/kubelet", "/var/lib/kubelet"),
            ("/var/lib/kubelet/pods", "/pods"),
            ("/var/run/kubevirt", "/var/run/kubevirt"),
            ("/var/run/kubevirt-private", "/var/run/kubevirt-private"),
        ]
        .map(|(h, m)| (h.to_owned(), m.to_owned()))
    );
    let args = c.args.clone().unwrap();
    let at = args.iter().position(|a| a == "--kubelet-pods-dir").unwrap();
    assert_eq!(
        args[at + 1],
        "/pods",
        "the handler must look where the pods dir is mounted"
    );
    let certs = spec
        .volumes
        .iter()
        .flatten()
        .find_map(|v| v.secret.as_ref())
        .unwrap();
    assert_eq!(
        (certs.secret_name.as_deref(), certs.optional),
        (Some("kubevirt-virt-handler-server-certs"), Some(true))
    );

    // Applying again changes nothing.
    let again = kubectl(&kubeconfig, &["apply", "-f", install.to_str().unwrap()]).await;
    for line in again.lines() {
        assert!(line.ends_with(" unchanged"), "second apply changed: {line}");
    }
}
