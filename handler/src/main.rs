//! virt-handler: the device plugins, the node heartbeat, the VMI node loop, the console server
//! (mTLS) and `/metrics` + `/healthz` (HTTPS) (docs/handler.md).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use handler::deviceplugin::{self, Config as PluginConfig};
use handler::heartbeat::{self, NodePatcher};
use handler::{metrics, node, nodelabeller, server, vmistore};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Flags keep KubeVirt's names and defaults.
#[derive(Debug, Parser)]
#[command(name = "virt-handler", version)]
struct Flags {
    /// The node this handler runs on.
    #[arg(long, env = "NODE_NAME")]
    hostname_override: String,
    /// The kubelet's root: device plugins live in `<root>/device-plugins`, the CPU manager's
    /// checkpoint is `<root>/cpu_manager_state`.
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_root: PathBuf,
    /// How many devices each device plugin advertises.
    #[arg(long, default_value_t = deviceplugin::DEFAULT_COUNT)]
    max_devices: usize,
    /// The QEMU the node labeller asks for this node's CPU models and features (the launcher's
    /// flag of the same name).
    #[arg(long, default_value = "qemu-system-x86_64")]
    qemu_binary: PathBuf,
    /// Seconds between heartbeats (before jitter).
    #[arg(long, default_value_t = heartbeat::INTERVAL.as_secs())]
    heartbeat_interval_seconds: u64,
    /// Address the metrics and console servers listen on.
    #[arg(long, default_value = "0.0.0.0")]
    listen_address: IpAddr,
    /// `/metrics` and `/healthz` (HTTPS with the console server's certificate, as KubeVirt).
    #[arg(long, default_value_t = 8443)]
    port: u16,
    /// The console server (mTLS).
    #[arg(long, default_value_t = 8186)]
    console_server_port: u16,
    /// This pod's IP; KubeVirt uses it for migrations, which we do not do yet: only logged.
    #[arg(long, env = "MY_POD_IP")]
    pod_ip_address: Option<String>,
    /// The kubelet's pods dir as mounted in this container.
    #[arg(long, default_value = "/var/lib/kubelet/pods")]
    kubelet_pods_dir: PathBuf,
    /// KubeVirt's share dir; accepted for manifest compatibility, nothing of ours lives there.
    #[arg(long, default_value = "/var/run/kubevirt")]
    kubevirt_share_dir: PathBuf,
    /// The launchers' private dir (console and VNC sockets), inside each launcher's pod.
    #[arg(long, default_value = "/var/run/kubevirt-private")]
    kubevirt_private_dir: PathBuf,
    /// Concurrent `/metrics` scrapes; more are answered 503.
    #[arg(long, default_value_t = metrics::DEFAULT_MAX_REQUESTS)]
    max_metric_requests: usize,
    /// Every VMI is reconciled again this often, whatever changed.
    #[arg(long, default_value_t = node::DEFAULT_RESYNC.as_secs())]
    domain_resync_period_seconds: u64,
    /// A launcher that does not answer this long fails its VMI (`30s`, `1m`, ...).
    #[arg(long, default_value = "30s", value_parser = api::duration::parse_duration)]
    watchdog_timeout: Duration,
    /// The console server's and `/metrics`' certificate (KubeVirt mounts
    /// /etc/virt-handler/servercertificates/tls.crt).
    #[arg(long)]
    tls_cert_file: Option<PathBuf>,
    /// Its key.
    #[arg(long)]
    tls_key_file: Option<PathBuf>,
    /// CA bundle client certificates must chain to (KubeVirt takes it from the `kubevirt-ca`
    /// ConfigMap; mount it as a file).
    #[arg(long)]
    client_ca_file: Option<PathBuf>,
}

/// The certificate files the flags name, if all three are given.
fn tls_files(flags: &Flags, client_auth: tlsconfig::ClientAuth) -> Option<tlsconfig::TlsFiles> {
    Some(tlsconfig::TlsFiles {
        cert: flags.tls_cert_file.clone()?,
        key: flags.tls_key_file.clone()?,
        client_ca: flags.client_ca_file.clone()?,
        client_auth,
    })
}

/// Serves `app` over HTTPS on `addr` until `stop`, with the certificate files re-read when they
/// change. They come from an optional Secret that may appear after the pod starts (KubeVirt's
/// file certificate manager waits for them too), so the server waits for them, then listens.
async fn serve_tls(
    what: &'static str,
    addr: SocketAddr,
    files: Option<tlsconfig::TlsFiles>,
    app: axum::Router,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let Some(files) = files else {
        tracing::warn!(
            "--tls-cert-file, --tls-key-file and --client-ca-file are not all given: {what} not served"
        );
        return Ok(());
    };
    let mut waiting = false;
    let tls = loop {
        match tlsconfig::ReloadingConfig::new(files.clone()) {
            Ok(tls) => break tls,
            Err(e) if !std::mem::replace(&mut waiting, true) => {
                tracing::info!(error = %e, "{what} waits for its certificate");
            }
            Err(_) => {}
        }
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            () = tokio::time::sleep(CERTIFICATE_POLL) => {}
        }
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {what} to {addr}"))?;
    tracing::info!(%addr, "serving {what} over HTTPS");
    tlsconfig::serve_https(listener, Arc::new(tls), move |_| app.clone(), stop).await;
    Ok(())
}

/// How often a server looks for its certificate files before they first appear (a Secret
/// created after the pod reaches it within a kubelet sync, 10 s to a minute or two).
const CERTIFICATE_POLL: Duration = Duration::from_secs(2);

/// The handlers' certificate both ways (KubeVirt's migration TLS configs): migration listeners
/// require it of the peer, and dial other handlers with it. `None` without the files.
fn migration_transport(flags: &Flags) -> Option<handler::migration::Transport> {
    let Some(files) = tls_files(flags, tlsconfig::ClientAuth::Required)
        .filter(|f| [&f.cert, &f.key, &f.client_ca].iter().all(|p| p.exists()))
    else {
        tracing::warn!("no certificates: migrations need migrations.disableTLS");
        return None;
    };
    let client = tlsconfig::client_config(&files.cert, &files.key, &files.client_ca)
        .inspect_err(|e| tracing::warn!(error = %e, "migration client TLS"))
        .ok()?;
    let server = tlsconfig::ReloadingConfig::new(files)
        .inspect_err(|e| tracing::warn!(error = %e, "migration server TLS"))
        .ok()?;
    Some(handler::migration::Transport::Tls {
        server: Arc::new(server),
        client: Arc::new(client),
    })
}

const REGISTER_RETRY: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let client = informer::start_component()
        .await
        .context("no Kubernetes client configuration (in-cluster or KUBECONFIG)")?;
    tracing::info!(node = %flags.hostname_override, pod_ip = ?flags.pod_ip_address, share_dir = %flags.kubevirt_share_dir.display(), "virt-handler starting");
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
    // The kubelet may not be up yet, and it may restart: the plugins are kept registered.
    let plugins = tokio::spawn(deviceplugin::run(
        deviceplugin::kubevirt_devices(),
        cfg,
        REGISTER_RETRY,
        ready_tx,
        stop.clone(),
    ));
    let beat = tokio::spawn(heartbeat::run(
        NodePatcher::new(
            client.clone(),
            &flags.hostname_override,
            &flags.kubelet_root,
        ),
        ready_rx,
        Duration::from_secs(flags.heartbeat_interval_seconds),
        stop.clone(),
    ));

    let labeller = tokio::spawn(nodelabeller::run(
        client.clone(),
        flags.hostname_override.clone(),
        flags.qemu_binary.clone(),
        stop.clone(),
    ));

    let slot: metrics::NodeSlot = Arc::new(OnceLock::new());
    // KubeVirt's virt-handler serves its metrics with its server certificate and verifies a
    // client certificate only when one is offered (`SetupPromTLS`): Prometheus and the kubelet's
    // probes come without.
    let metrics_task = tokio::spawn(serve_tls(
        "/metrics and /healthz",
        SocketAddr::new(flags.listen_address, flags.port),
        tls_files(&flags, tlsconfig::ClientAuth::Optional),
        metrics::router(Arc::clone(&slot), flags.max_metric_requests),
        stop.clone(),
    ));
    let mut cfg = node::Config::new(&flags.hostname_override);
    cfg.pods_dir.clone_from(&flags.kubelet_pods_dir);
    cfg.launcher_private_dir
        .clone_from(&flags.kubevirt_private_dir);
    cfg.watchdog_timeout = flags.watchdog_timeout;
    cfg.resync_period = Duration::from_secs(flags.domain_resync_period_seconds.max(1));
    cfg.migration_transport = migration_transport(&flags);
    cfg.pod_ip = flags.pod_ip_address.as_deref().and_then(|ip| {
        ip.parse()
            .inspect_err(|e| tracing::warn!(%ip, error = %e, "MY_POD_IP is not an IP address"))
            .ok()
    });
    // The loop waits for its caches (the VMI CRD may not be installed yet) in the background,
    // so signals are handled meanwhile.
    let mut loop_task = {
        let stop = stop.clone();
        let slot = Arc::clone(&slot);
        tokio::spawn(async move {
            let (node, handle) = node::start(client, cfg, stop.clone()).await?;
            let _ = slot.set(Arc::clone(&node));
            let console = tokio::spawn(serve_tls(
                "the console server (console, VNC, pause, guest info)",
                SocketAddr::new(flags.listen_address, flags.console_server_port),
                tls_files(&flags, tlsconfig::ClientAuth::Required),
                server::router(
                    Arc::new(vmistore::NodeVmis::new(node)),
                    server::Limits::default(),
                ),
                stop,
            ));
            handle.await.context("node loop")?;
            console.await.context("console server")?
        })
    };
    let failed = tokio::select! {
        _ = term.recv() => { tracing::info!("SIGTERM: marking the node unschedulable"); None }
        _ = int.recv() => { tracing::info!("SIGINT: marking the node unschedulable"); None }
        r = &mut loop_task => Some(r),
    };
    stop.cancel();
    beat.await.context("heartbeat task")?;
    labeller.await.context("node labeller task")?;
    plugins.await.context("device plugin task")?;
    if let Some(r) = failed {
        r.context("node loop task")??;
        anyhow::bail!("the node loop ended on its own");
    }
    if let Err(e) = loop_task.await.context("node loop task")? {
        tracing::debug!(error = %e, "node loop ended while stopping");
    }
    metrics_task.await.context("metrics task")??;
    Ok(())
}
