//! `virt-api`: KubeVirt's subresource API server and admission webhooks. See docs/virt-api.md.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::runtime::watcher;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use virtapi::authn::RequestHeaderConfig;
use virtapi::subresource::App;
use virtapi::virthandler::{HandlerTls, Handlers};
use virtapi::{server, webhooks};

/// Where kube-apiserver publishes how aggregated servers authenticate its front proxy.
const AUTH_CONFIGMAP_NAMESPACE: &str = "kube-system";
const AUTH_CONFIGMAP: &str = "extension-apiserver-authentication";
const REQUEST_HEADER_CA_KEY: &str = "requestheader-client-ca-file";

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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let f = Flags::parse();
    let client = informer::start_component()
        .await
        .context("connecting to the API server (in-cluster config or KUBECONFIG)")?;
    std::fs::create_dir_all(&f.runtime_dir)
        .with_context(|| format!("creating {}", f.runtime_dir.display()))?;
    let request_header_ca = f.runtime_dir.join("requestheader-client-ca.crt");

    let mut tasks = JoinSet::new();
    let (auth_tx, mut auth_rx) = tokio::sync::watch::channel(None::<BTreeMap<String, String>>);
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), AUTH_CONFIGMAP_NAMESPACE);
    let auth_store = informer::reflect(
        &mut tasks,
        configmaps,
        watcher::Config::default().fields(&format!("metadata.name={AUTH_CONFIGMAP}")),
        informer::keep_all,
        move |seen| {
            if let informer::Seen::Added(cm) | informer::Seen::Changed(cm) = seen {
                auth_tx.send_replace(cm.data.clone());
            }
        },
    );
    let kubevirts = informer::reflect(
        &mut tasks,
        Api::<api::KubeVirt>::all(client.clone()),
        watcher::Config::default(),
        informer::keep_all,
        |_| {},
    );
    tracing::info!("waiting for {AUTH_CONFIGMAP_NAMESPACE}/{AUTH_CONFIGMAP}");
    let data = loop {
        if let Some(d) = auth_rx.borrow_and_update().clone() {
            break d;
        }
        auth_rx
            .changed()
            .await
            .context("the ConfigMap watch ended")?;
    };
    drop(auth_store);
    let request_headers = apply_auth_config(&data, &request_header_ca)?;

    let tls = Arc::new(
        tlsconfig::ReloadingConfig::new(tlsconfig::TlsFiles {
            cert: f.tls_cert_file.clone(),
            key: f.tls_key_file.clone(),
            client_ca: request_header_ca.clone(),
            client_auth: tlsconfig::ClientAuth::Optional,
        })
        .context("virt-api's serving TLS")?,
    );
    let app = Arc::new(App {
        client: client.clone(),
        request_headers: RwLock::new(request_headers),
        handlers: Handlers::new(
            client.clone(),
            &f.namespace,
            f.console_server_port,
            HandlerTls {
                cert: f.handler_client_cert_file,
                key: f.handler_client_key_file,
                ca: f.handler_ca_file,
            },
        ),
    });
    {
        // kube-apiserver rotates its front-proxy CA and settings in the ConfigMap.
        let app = app.clone();
        tasks.spawn(async move {
            while auth_rx.changed().await.is_ok() {
                let Some(data) = auth_rx.borrow_and_update().clone() else {
                    continue;
                };
                match apply_auth_config(&data, &request_header_ca) {
                    Ok(c) => {
                        *app.request_headers
                            .write()
                            .expect("request header config lock poisoned") = c;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "keeping the previous front-proxy settings");
                    }
                }
            }
        });
    }
    kubevirts
        .wait_until_ready()
        .await
        .context("the KubeVirt CR watch")?;
    let webhooks = Arc::new(webhooks::Webhooks::new(kubevirts, f.namespace.clone()));

    let addr = SocketAddr::from(([0, 0, 0, 0], f.port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(%addr, "serving subresources.kubevirt.io and the admission webhooks");
    let shutdown = CancellationToken::new();
    let serving = tokio::spawn(server::serve(
        listener,
        tls,
        server::router(app, webhooks),
        shutdown.clone(),
    ));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        r = tokio::signal::ctrl_c() => { r.context("SIGINT handler")?; tracing::info!("SIGINT: stopping"); }
        Some(r) = tasks.join_next() => anyhow::bail!("a watch task ended: {r:?}"),
    }
    shutdown.cancel();
    serving.await.ok();
    Ok(())
}

/// Writes the front proxy's CA where the TLS config reads it, and returns the header settings.
fn apply_auth_config(
    data: &BTreeMap<String, String>,
    ca_file: &std::path::Path,
) -> anyhow::Result<RequestHeaderConfig> {
    let ca = data.get(REQUEST_HEADER_CA_KEY).with_context(|| {
        format!(
            "{AUTH_CONFIGMAP_NAMESPACE}/{AUTH_CONFIGMAP} has no {REQUEST_HEADER_CA_KEY}: kube-apiserver runs without --requestheader-client-ca-file, so no aggregated API can authenticate its requests"
        )
    })?;
    let cfg = RequestHeaderConfig::from_configmap(data).map_err(anyhow::Error::msg)?;
    if std::fs::read_to_string(ca_file).ok().as_deref() != Some(ca.as_str()) {
        let tmp = ca_file.with_extension("tmp");
        std::fs::write(&tmp, ca).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, ca_file).with_context(|| format!("writing {}", ca_file.display()))?;
    }
    Ok(cfg)
}
