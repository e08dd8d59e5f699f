//! The test cluster: the upstream control plane (`TestControlPlane`: etcd, kube-apiserver,
//! kube-controller-manager, optionally kube-scheduler and kube-proxy) in a temporary directory,
//! with a namespace of the test's own, and process kubelets as test nodes.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use kube::Api;
use kube::api::PostParams;
use localcluster::ControlPlaneConfig;
use localcluster::controlplane::TestControlPlane;
use localcluster::kubelet::network::PodCidr;
use localcluster::kubelet::{Kubelet, NodeConfig, Serving};
use serde_json::{Value, json};

pub struct Cluster {
    /// The administrator's client (`system:masters`).
    pub client: kube::Client,
    /// A namespace of this test's own, with its `default` service account (pods need it).
    pub namespace: String,
    /// The administrator's kubeconfig file, for `kubectl`.
    pub kubeconfig: PathBuf,
    /// Dropped last: kills every component.
    pub plane: TestControlPlane,
}

impl Cluster {
    /// etcd, kube-apiserver and kube-controller-manager; no scheduler (tests bind pods by
    /// `spec.nodeName`) and no kube-proxy.
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// Starts after `adjust` changed the control plane's configuration (`scheduler`,
    /// `proxy_node`, ...).
    pub async fn start_with(adjust: impl FnOnce(&mut ControlPlaneConfig)) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("localcluster=info")
            .with_test_writer()
            .try_init();
        let plane = TestControlPlane::start_with(adjust).await;
        let client = plane.client().await;
        let namespace = format!(
            "lc-test-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"name": namespace}
        }))
        .expect("namespace");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("creating the test namespace");
        // kube-apiserver's ServiceAccount admission refuses pods until kube-controller-manager
        // has made the namespace's `default` service account.
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &namespace);
        eventually(
            120,
            "the test namespace's default service account",
            || async { accounts.get_opt("default").await.ok().flatten() },
        )
        .await;
        // The CA of the pods' projected `kube-api-access-*` volumes, published in every
        // namespace by kube-controller-manager.
        let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
        eventually(120, "the test namespace's kube-root-ca.crt", || async {
            config_maps.get_opt("kube-root-ca.crt").await.ok().flatten()
        })
        .await;
        Self {
            client,
            namespace,
            kubeconfig: plane.kubeconfig_path(),
            plane,
        }
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// A kubelet's client for `node`: its `system:node:<node>` certificate, with the machine's
    /// address in its serving certificate.
    pub async fn node_client(&self, node: &str) -> (kube::Client, NodeCredentials) {
        let address = localcluster::kubelet::node::host_ip()
            .parse()
            .expect("the machine's address");
        let creds = self
            .plane
            .node_credentials(node, address)
            .expect("node credentials");
        let client = localcluster::controlplane::client_for(&creds.kubeconfig)
            .await
            .expect("the node's client");
        (client, creds)
    }

    /// Runs kubectl against the cluster in the test namespace; returns (success, stdout, stderr).
    pub async fn kubectl(&self, args: &[&str]) -> (bool, String, String) {
        self.kubectl_stdin(args, None).await
    }

    pub async fn kubectl_stdin(
        &self,
        args: &[&str],
        stdin: Option<&str>,
    ) -> (bool, String, String) {
        let out = self.kubectl_output(args, stdin).await;
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs kubectl (the test namespace, the administrator's kubeconfig); its whole output.
    pub async fn kubectl_output(&self, args: &[&str], stdin: Option<&str>) -> std::process::Output {
        tokio::time::timeout(
            Duration::from_mins(2),
            self.kubectl_runner().output_async(args, stdin),
        )
        .await
        .expect("kubectl finished within 120 s")
        .expect("running kubectl")
    }

    /// `kubectl --kubeconfig <admin> --namespace <test namespace> <args>`, not started.
    pub fn kubectl_command(&self, args: &[&str]) -> tokio::process::Command {
        self.kubectl_runner().async_command(args)
    }

    fn kubectl_runner(&self) -> localcluster::kubectl::Kubectl {
        localcluster::kubectl::Kubectl::new(&self.kubeconfig)
            .namespace(&self.namespace)
            .cache_dir(self.plane.dir().join("kubectl-cache"))
    }
}

pub use localcluster::controlplane::NodeCredentials;

/// A node with a unique name, bridge and pod CIDR, rooted in a temp dir, so tests can run in
/// parallel. Dropping it kills its pods and removes what they held.
pub struct TestNode {
    kubelet: Option<Kubelet>,
    _dir: tempfile::TempDir,
}

/// A node name no other test uses.
pub fn fresh_node_name() -> String {
    format!("n-{}", &uuid::Uuid::new_v4().simple().to_string()[..6])
}

impl TestNode {
    pub async fn start(cluster: &Cluster) -> Self {
        Self::start_config(cluster, |_| {}).await
    }

    /// Starts a node whose configuration `adjust` changes last.
    pub async fn start_config(cluster: &Cluster, adjust: impl FnOnce(&mut NodeConfig)) -> Self {
        Self::start_named(cluster, &fresh_node_name(), false, adjust).await
    }

    /// A node serving the kubelet API (on a free port, with the serving certificate of its
    /// credentials), which kube-apiserver dials for logs and exec.
    pub async fn start_serving(cluster: &Cluster) -> Self {
        Self::start_named(cluster, &fresh_node_name(), true, |_| {}).await
    }

    /// Starts node `name` as `system:node:<name>`, serving the kubelet API if `serve`.
    pub async fn start_named(
        cluster: &Cluster,
        name: &str,
        serve: bool,
        adjust: impl FnOnce(&mut NodeConfig),
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let id = uuid::Uuid::new_v4().simple().to_string();
        let bytes = id.as_bytes();
        let cidr = PodCidr::parse(&format!(
            "10.{}.{}.0/24",
            200 + u32::from(bytes[6]) % 50,
            u32::from(bytes[7]) * 2 % 250
        ))
        .expect("cidr");
        let mut config = NodeConfig::new(name, dir.path(), cidr, images());
        config.restart_backoff = Duration::from_millis(500);
        config.heartbeat = Duration::from_secs(2);
        let (client, creds) = cluster.node_client(name).await;
        if serve {
            config.serving = Some(Serving {
                port: 0,
                cert_pem: creds.serving.cert_pem,
                key_pem: creds.serving.key_pem,
                client_ca_pem: creds.ca_pem,
            });
        }
        adjust(&mut config);
        let kubelet = Kubelet::start(client, config)
            .await
            .expect("starting the kubelet");
        Self {
            kubelet: Some(kubelet),
            _dir: dir,
        }
    }

    pub fn kubelet(&self) -> &Kubelet {
        self.kubelet.as_ref().expect("running")
    }

    pub fn name(&self) -> String {
        self.kubelet().node_name().to_string()
    }

    pub fn pods_dir(&self) -> PathBuf {
        self.kubelet().config().pods_dir()
    }

    /// Ends the kubelet as a crash would, its pods left running.
    pub async fn abandon(&mut self) -> localcluster::kubelet::Abandoned {
        self.kubelet.take().expect("running").abandon().await
    }

    /// Starts the node's kubelet again, adopting what `abandoned` left.
    pub async fn adopt(&mut self, abandoned: localcluster::kubelet::Abandoned) {
        self.kubelet = Some(abandoned.start().await.expect("restarting the kubelet"));
    }

    pub async fn stop(mut self) {
        if let Some(k) = self.kubelet.take() {
            k.stop().await;
        }
    }
}

/// A pod bound to `node` whose spec is `spec` merged over `nodeName`.
pub fn pod(name: &str, node: &str, spec: &Value) -> Pod {
    let mut p = json!({"metadata": {"name": name}, "spec": {"nodeName": node}});
    json_patch::merge(&mut p["spec"], spec);
    serde_json::from_value(p).expect("pod")
}

/// A container of the tools image running `script` with `/bin/sh -c`.
pub fn sh(name: &str, script: &str) -> Value {
    json!({"name": name, "image": TOOLS_IMAGE, "command": ["/bin/sh", "-c", script]})
}

/// Polls the pod until `f` holds for its JSON.
pub async fn wait_pod(api: &Api<Pod>, name: &str, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    eventually(120, what, || async {
        let p = api.get(name).await.ok()?;
        let v = serde_json::to_value(&p).ok()?;
        f(&v).then_some(v)
    })
    .await
}

/// Polls `f` until it returns `Some`, for up to `secs` seconds.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The image plain test pods run: busybox's shell and tools, and socat.
pub const TOOLS_IMAGE: &str = "kubevirt-rs/test-tools:latest";
/// An image with a shell whose entrypoint, cmd, environment and working directory are set:
/// `/bin/sh /app/run.sh from-cmd` in `/app`, `GREETING=image`, `PATH=/app/bin:/bin`.
pub const ENTRY_IMAGE: &str = "example.com/entry:1";
/// A container-disk-like image: `/disk/disk.qcow2` and nothing else (no shell, no libc).
pub const DISK_IMAGE: &str = "example.com/container-disk:1";

/// One image store for every node of a test binary, holding the images above (built once, as
/// `build-images` builds them, into an OCI layout that the store imports).
///
/// A static is never dropped, so the store cannot live in a `TempDir`: it lives in
/// `images-<pid>` under Cargo's test scratch directory, and the directories of test processes
/// that have ended are removed when the next one starts.
pub fn images() -> std::sync::Arc<ociimage::Store> {
    use ociimage::{Compression, ImageSpec, Layout, Reference, Source, Tree};
    static STORE: std::sync::OnceLock<std::sync::Arc<ociimage::Store>> = std::sync::OnceLock::new();
    STORE
        .get_or_init(|| {
            let scratch = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
            remove_image_dirs_of_ended_processes(scratch);
            let dir = tempfile::TempDir::with_prefix_in(
                format!("images-{}-", std::process::id()),
                scratch,
            )
            .expect("image dir")
            .keep();
            let layout = Layout::create(&dir.join("build")).expect("layout");
            let tools = imagebuild::recipes::test_tools_layer().expect("test-tools layer");
            let mut spec = ImageSpec::new(Reference::parse(TOOLS_IMAGE).unwrap());
            spec.layers = vec![tools.clone()];
            spec.cmd = vec!["/bin/sh".into()];
            layout
                .write_image(&spec, Compression::None)
                .expect("test-tools");

            let mut app = Tree::new();
            app.file(
                "/app/run.sh",
                Source::Bytes(b"echo \"$* $GREETING $(pwd) $PATH\" > /out/$NAME\n".to_vec()),
                0o755,
            );
            let mut spec = ImageSpec::new(Reference::parse(ENTRY_IMAGE).unwrap());
            spec.layers = vec![tools, app];
            spec.entrypoint = vec!["/bin/sh".into(), "/app/run.sh".into()];
            spec.cmd = vec!["from-cmd".into()];
            spec.env = vec!["GREETING=image".into(), "PATH=/app/bin:/bin".into()];
            spec.working_dir = Some("/app".into());
            layout
                .write_image(&spec, Compression::Gzip)
                .expect("entry image");

            let mut disk = Tree::new();
            disk.file(
                "/disk/disk.qcow2",
                Source::Bytes(b"not really qcow2".to_vec()),
                0o444,
            );
            let mut spec = ImageSpec::new(Reference::parse(DISK_IMAGE).unwrap());
            spec.layers = vec![disk];
            spec.env.clear();
            layout
                .write_image(&spec, Compression::None)
                .expect("disk image");

            let store = ociimage::Store::open(&dir.join("store")).expect("store");
            store
                .import(layout.dir())
                .expect("importing the test images");
            std::sync::Arc::new(store)
        })
        .clone()
}

/// Removes the `images-<pid>-*` directories of processes that no longer run.
fn remove_image_dirs_of_ended_processes(scratch: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(scratch) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("images-"))
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
