//! `virt-controller`: the cluster-wide controllers of kubevirt-rs. See docs/controller.md.

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use controller::run::{Options, run_with_leader_election};
use controller::template::TemplateConfig;

/// Reconciles VirtualMachines, VirtualMachineInstances, ReplicaSets and Nodes; one replica
/// leads through the `virt-controller` Lease.
#[derive(Debug, Parser)]
#[command(name = "virt-controller", version)]
struct Flags {
    /// Image of the virt-launcher container in launcher pods.
    #[arg(long, default_value = "virt-launcher")]
    launcher_image: String,
    /// `--qemu-timeout` of the launchers.
    #[arg(long, default_value = "5m")]
    launcher_qemu_timeout: String,
    /// Image pull secret added to every launcher pod.
    #[arg(long)]
    image_pull_secret: Option<String>,
    #[arg(long, default_value = "/var/run/kubevirt")]
    virt_share_dir: String,
    #[arg(long, default_value = "/var/run/kubevirt-private")]
    virt_private_dir: String,
    #[arg(long, default_value = "/var/run/kubevirt-ephemeral-disks")]
    ephemeral_disk_dir: String,
    #[arg(long, default_value = "/var/run/kubevirt/container-disks")]
    container_disk_dir: String,
    #[arg(long, default_value = "/var/run/kubevirt/hotplug-disks")]
    hotplug_disk_dir: String,
    /// Namespace of the leader-election Lease (KubeVirt's install namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kubevirt")]
    namespace: String,
    /// Identity in the Lease; defaults to the pod name, else a random one.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds after which a node whose virt-handler stopped heartbeating is failed.
    #[arg(long, default_value_t = 300)]
    heartbeat_timeout_seconds: u64,
    /// Port of `/healthz`, `/leader` and `/metrics` (plain HTTP, all addresses).
    #[arg(long, default_value_t = 8443)]
    port: u16,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let f = Flags::parse();
    let client = informer::start_component()
        .await
        .context("connecting to the API server (in-cluster config or KUBECONFIG)")?;
    let defaults = Options::default();
    let addr = std::net::SocketAddr::from(([0, 0, 0, 0], f.port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics port {addr}"))?;
    tracing::info!(%addr, "serving /healthz, /leader and /metrics");
    let server = tokio::spawn(
        axum::serve(
            listener,
            controller::metrics::router(defaults.health.clone()),
        )
        .into_future(),
    );
    let opts = Options {
        template: TemplateConfig {
            launcher_image: f.launcher_image,
            qemu_timeout: f.launcher_qemu_timeout,
            share_dir: f.virt_share_dir,
            private_dir: f.virt_private_dir,
            ephemeral_disk_dir: f.ephemeral_disk_dir,
            container_disk_dir: f.container_disk_dir,
            hotplug_disk_dir: f.hotplug_disk_dir,
            image_pull_secret: f.image_pull_secret,
        },
        heartbeat_timeout: Duration::from_secs(f.heartbeat_timeout_seconds),
        lease_namespace: f.namespace,
        identity: f.identity.unwrap_or(defaults.identity.clone()),
        ..defaults
    };
    tokio::select! {
        r = run_with_leader_election(client, opts) => r.context("virt-controller stopped"),
        r = server => {
            r.context("metrics server task")?.context("metrics server")?;
            anyhow::bail!("the metrics server stopped")
        }
    }
}
