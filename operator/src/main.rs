//! `virt-operator`: installs, updates and removes kubevirt-rs as the KubeVirt CR says. See
//! docs/operator.md.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use anyhow::Context as _;
use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use clap::Parser;
use operator::run::{Health, Options, run_with_leader_election};

/// Reconciles the KubeVirt CR of its namespace; one replica leads through the
/// `virt-operator` Lease.
#[derive(Debug, Parser)]
#[command(name = "virt-operator", version)]
struct Flags {
    /// The namespace of the KubeVirt CR and of everything it installs.
    #[arg(long, env = "POD_NAMESPACE", default_value = "kubevirt")]
    namespace: String,
    /// Identity in the Lease and in Events; defaults to the pod name, else a random one.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Port of `/healthz`, `/leader` and `/metrics` (plain HTTP, all addresses).
    #[arg(long, default_value_t = 8443)]
    port: u16,
}

/// KubeVirt's virt-operator gauges.
fn metrics(health: &Health) -> String {
    let mut text = api::metrics::Exposition::new();
    text.family(
        "kubevirt_virt_operator_leading_status",
        api::metrics::Kind::Gauge,
        "Indication for an operating virt-operator (1 when it holds the leader Lease).",
    )
    .sample(&[], u8::from(health.leading.load(Ordering::Relaxed)));
    text.family(
        "kubevirt_virt_operator_ready_status",
        api::metrics::Kind::Gauge,
        "Indication for a virt-operator that is ready to operate (leading, caches synced).",
    )
    .sample(&[], u8::from(health.ready.load(Ordering::Relaxed)));
    text.finish()
}

fn router(health: Arc<Health>) -> Router {
    let leader = health.clone();
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/leader",
            get(move || async move {
                if leader.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "leading")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not leading")
                }
            }),
        )
        .route("/metrics", get(move || async move { metrics(&health) }))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let f = Flags::parse();
    let release = operator::release::release_from_env(|k| std::env::var(k).ok())
        .map_err(anyhow::Error::msg)
        .context("virt-operator's release")?;
    let client = informer::start_component()
        .await
        .context("connecting to the API server (in-cluster config or KUBECONFIG)")?;
    let health = Arc::new(Health::default());
    let addr = std::net::SocketAddr::from(([0, 0, 0, 0], f.port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics port {addr}"))?;
    tracing::info!(%addr, registry = %release.registry, tag = %release.tag, "serving /healthz, /leader and /metrics");
    let server = tokio::spawn(axum::serve(listener, router(health.clone())).into_future());
    let identity = f
        .identity
        .unwrap_or_else(|| format!("virt-operator-{}", std::process::id()));
    let opts = Options {
        namespace: f.namespace,
        release,
        identity,
        health,
    };
    tokio::select! {
        r = run_with_leader_election(client, opts) => r.context("virt-operator stopped"),
        r = server => {
            r.context("metrics server task")?.context("metrics server")?;
            anyhow::bail!("the metrics server stopped")
        }
    }
}
