//! The test cluster: an in-process `localcluster` API server on a random port, or, when
//! `LOCALCLUSTER_TEST_KUBECONFIG` names a kubeconfig, the real cluster it points at (so the suite
//! can hold localcluster to Kubernetes' own behaviour).

#![allow(dead_code)] // each test binary uses a different part of this module

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use localcluster::{ApiServer, Config};

pub struct Cluster {
    pub client: kube::Client,
    /// A namespace of this test's own, deleted when the cluster is dropped.
    pub namespace: String,
    /// A kubeconfig file for `kubectl`.
    pub kubeconfig: PathBuf,
    server: Option<ApiServer>,
    dir: tempfile::TempDir,
}

impl Cluster {
    pub async fn start() -> Self {
        Self::start_with(Config::default()).await
    }

    /// Starts with a custom configuration; against a real cluster the configuration is ignored.
    pub async fn start_with(config: Config) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let kubeconfig = dir.path().join("kubeconfig");
        let (client, server) = if let Some(path) = std::env::var_os("LOCALCLUSTER_TEST_KUBECONFIG")
        {
            std::fs::copy(&path, &kubeconfig).expect("copying the external kubeconfig");
            let kc = kube::config::Kubeconfig::read_from(&path).expect("reading kubeconfig");
            let cfg = kube::Config::from_custom_kubeconfig(
                kc,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .expect("kubeconfig");
            (kube::Client::try_from(cfg).expect("client"), None)
        } else {
            let server = ApiServer::start(config)
                .await
                .expect("starting the API server");
            server
                .write_kubeconfig(&kubeconfig)
                .expect("writing kubeconfig");
            (server.client().await.expect("client"), Some(server))
        };
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
        Self {
            client,
            namespace,
            kubeconfig,
            server,
            dir,
        }
    }

    /// How pods reach the in-process server (started with an advertise address).
    pub fn pod_access(&self) -> Option<localcluster::kubelet::ApiAccess> {
        self.server.as_ref().and_then(ApiServer::pod_access)
    }

    /// Whether the cluster is the in-process one (tests of its configuration need that).
    pub fn in_process(&self) -> bool {
        self.server.is_some()
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
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
        use tokio::io::AsyncWriteExt as _;
        let mut cmd = tokio::process::Command::new("kubectl");
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--namespace")
            .arg(&self.namespace)
            .args(args)
            .env("KUBECACHEDIR", self.dir.path().join("cache"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("running kubectl");
        let mut input = child.stdin.take().expect("stdin");
        if let Some(text) = stdin {
            input
                .write_all(text.as_bytes())
                .await
                .expect("writing kubectl stdin");
        }
        drop(input);
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .expect("kubectl finished within 60 s")
            .expect("kubectl output");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.server.is_none() {
            // A real cluster keeps state: remove the test namespace (best effort, in the background).
            let _ = std::process::Command::new("kubectl")
                .arg("--kubeconfig")
                .arg(&self.kubeconfig)
                .args(["delete", "namespace", &self.namespace, "--wait=false"])
                .status();
        }
    }
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
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Deletes the test namespace's content through the API when the test is done with it.
pub async fn delete_namespace(cluster: &Cluster) {
    let _ = Api::<Namespace>::all(cluster.client.clone())
        .delete(&cluster.namespace, &DeleteParams::default())
        .await;
}
