//! `virt-api`: KubeVirt's subresource API server and admission webhooks. See docs/virt-api.md.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use virtapi::daemon::{Config, VirtApi};
use virtapi::virthandler::HandlerTls;

/// Serves `subresources.kubevirt.io` behind the aggregation layer and KubeVirt's admission
/// webhooks.
#[derive(Debug, Parser)]
#[command(name = "virt-api", version)]
struct Flags {
    /// HTTPS port (KubeVirt's 8443; the Service maps 443 to it).
    #[arg(long, default_value_t = 8443)]
    port: u16,
    /// virt-handler's console server port.
    #[arg(long, default_value_t = 8186)]
    console_server_port: u16,
    /// The serving certificate (KubeVirt mounts the `kubevirt-virt-api-certs` Secret here).
    #[arg(long, default_value = "/etc/virt-api/certificates/tls.crt")]
    tls_cert_file: PathBuf,
    #[arg(long, default_value = "/etc/virt-api/certificates/tls.key")]
    tls_key_file: PathBuf,
    /// The client certificate virt-api presents to virt-handler (`kubevirt-virt-handler-certs`).
    #[arg(long, default_value = "/etc/virt-handler/clientcertificates/tls.crt")]
    handler_client_cert_file: PathBuf,
    #[arg(long, default_value = "/etc/virt-handler/clientcertificates/tls.key")]
    handler_client_key_file: PathBuf,
    /// The CA virt-handler's serving certificate chains to.
    #[arg(long, default_value = "/etc/virt-handler/clientcertificates/ca.crt")]
    handler_ca_file: PathBuf,
    /// Where the front proxy's CA (from the `extension-apiserver-authentication` ConfigMap) is
    /// written for the TLS config to read.
    #[arg(long, default_value = "/var/run/kubevirt-private/virt-api")]
    runtime_dir: PathBuf,
    /// KubeVirt's install namespace (the virt-handler pods, the service accounts).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kubevirt")]
    namespace: String,
    /// How long virt-api keeps serving after SIGTERM (kube-apiserver's
    /// `--shutdown-delay-duration`): a pod being deleted is still some caller's endpoint until
    /// the EndpointSlice change has reached kube-proxy. Without the delay, kube-apiserver's call
    /// of the pod-eviction webhook during `kubectl drain`, which evicts virt-api's own pods at
    /// the same time, met a closed connection and the drain stopped; with 5 s, on a loaded
    /// machine, a call was still routed to the pod once it was gone and timed out. 15 s stays
    /// well inside the pod's 30 s grace period.
    #[arg(long, default_value = "15s", value_parser = api::duration::parse_duration)]
    shutdown_delay: std::time::Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let f = Flags::parse();
    let client = informer::start_component()
        .await
        .context("connecting to the API server (in-cluster config or KUBECONFIG)")?;
    let virt_api = VirtApi::start(
        client,
        Config {
            console_server_port: f.console_server_port,
            tls_cert_file: f.tls_cert_file,
            tls_key_file: f.tls_key_file,
            handler_tls: HandlerTls {
                cert: f.handler_client_cert_file,
                key: f.handler_client_key_file,
                ca: f.handler_ca_file,
            },
            runtime_dir: f.runtime_dir,
            namespace: f.namespace,
        },
    )
    .await?;
    let addr = SocketAddr::from(([0, 0, 0, 0], f.port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let shutdown = CancellationToken::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("SIGTERM handler")?;
    let serving = virt_api.serve(listener, shutdown.clone());
    tokio::pin!(serving);
    tokio::select! {
        r = &mut serving => return r,
        _ = term.recv() => {
            tracing::info!(delay = ?f.shutdown_delay, "SIGTERM: serving until the delay is over, then stopping");
            tokio::select! {
                r = &mut serving => return r,
                () = tokio::time::sleep(f.shutdown_delay) => {}
            }
        }
        r = tokio::signal::ctrl_c() => { r.context("SIGINT handler")?; tracing::info!("SIGINT: stopping"); }
    }
    shutdown.cancel();
    serving.await
}
