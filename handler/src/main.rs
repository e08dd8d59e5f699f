//! virt-handler, as far as it goes today: the device plugins and the node heartbeat. The VMI
//! reconcile loop and the console server's VMI store are not wired in yet (docs/handler.md).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use handler::deviceplugin::{self, Config as PluginConfig};
use handler::heartbeat::{self, NodePatcher};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Flags keep KubeVirt's names and defaults.
#[derive(Debug, Parser)]
#[command(name = "virt-handler", version)]
struct Flags {
    /// The node this handler runs on.
    #[arg(long, env = "NODE_NAME")]
    hostname_override: String,
    /// The kubelet's root; device plugins live in `<root>/device-plugins`.
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_root: PathBuf,
    /// How many devices each device plugin advertises.
    #[arg(long, default_value_t = deviceplugin::DEFAULT_COUNT)]
    max_devices: usize,
    /// Seconds between heartbeats (before jitter).
    #[arg(long, default_value_t = heartbeat::INTERVAL.as_secs())]
    heartbeat_interval_seconds: u64,
}

const REGISTER_RETRY: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let flags = Flags::parse();
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes client configuration (in-cluster or KUBECONFIG)")?;
    let stop = CancellationToken::new();
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;

    let cfg = PluginConfig {
        plugins_dir: flags.kubelet_root.join("device-plugins"),
        dev_root: PathBuf::from("/"),
        count: flags.max_devices,
        health_interval: REGISTER_RETRY,
    };
    let (ready_tx, ready_rx) = tokio::sync::watch::channel(false);
    let plugins = {
        let stop = stop.clone();
        tokio::spawn(async move {
            // The kubelet may not be up yet: keep trying until every plugin is registered.
            let mut pending = deviceplugin::kubevirt_devices();
            let mut running = Vec::new();
            while !pending.is_empty() && !stop.is_cancelled() {
                let mut still = Vec::new();
                for dev in pending {
                    match deviceplugin::start(dev.clone(), &cfg, stop.child_token()).await {
                        Ok(r) => running.push(r),
                        Err(e) => {
                            tracing::warn!(error = %e, "device plugin not registered yet");
                            still.push(dev);
                        }
                    }
                }
                pending = still;
                if !pending.is_empty() {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = tokio::time::sleep(REGISTER_RETRY) => {}
                    }
                }
            }
            if pending.is_empty() {
                let _ = ready_tx.send(true);
            }
            // Holding the sender keeps readiness from reading as closed while plugins serve.
            stop.cancelled().await;
            // Wait for the plugins to stop so that their sockets are gone when we exit.
            for r in running {
                let _ = r.task.await;
            }
        })
    };
    let beat = tokio::spawn(heartbeat::run(
        NodePatcher::new(client, &flags.hostname_override),
        ready_rx,
        Duration::from_secs(flags.heartbeat_interval_seconds),
        stop.clone(),
    ));
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: marking the node unschedulable"),
        _ = int.recv() => tracing::info!("SIGINT: marking the node unschedulable"),
    }
    stop.cancel();
    beat.await.context("heartbeat task")?;
    plugins.await.context("device plugin task")?;
    Ok(())
}
