//! virt-api as a whole, for the binary and for tests that run it in-process: the watches
//! (kube-apiserver's front-proxy settings in `kube-system/extension-apiserver-authentication`,
//! the KubeVirt CR for the webhooks' cluster config), the TLS config, the routes, and the
//! serving loop. [`VirtApi::start`] returns once virt-api can answer; [`VirtApi::serve`] serves
//! until cancelled or a watch ends.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::runtime::watcher;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::authn::RequestHeaderConfig;
use crate::subresource::App;
use crate::virthandler::{HandlerTls, Handlers};
use crate::{server, webhooks};

/// Where kube-apiserver publishes how aggregated servers authenticate its front proxy.
const AUTH_CONFIGMAP_NAMESPACE: &str = "kube-system";
const AUTH_CONFIGMAP: &str = "extension-apiserver-authentication";
const REQUEST_HEADER_CA_KEY: &str = "requestheader-client-ca-file";

/// What the binary's flags set (see `main.rs` for their defaults).
#[derive(Debug, Clone)]
pub struct Config {
    /// virt-handler's console server port.
    pub console_server_port: u16,
    /// The serving certificate and key.
    pub tls_cert_file: PathBuf,
    pub tls_key_file: PathBuf,
    /// The client certificate for virt-handler and the CA its serving certificate chains to.
    pub handler_tls: HandlerTls,
    /// Where the front proxy's CA is written for the TLS config to read.
    pub runtime_dir: PathBuf,
    /// KubeVirt's install namespace (the virt-handler pods, the KubeVirt CR).
    pub namespace: String,
}

/// virt-api, configured and watching, not yet serving.
pub struct VirtApi {
    tasks: JoinSet<()>,
    tls: Arc<tlsconfig::ReloadingConfig>,
    router: axum::Router,
}

impl std::fmt::Debug for VirtApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtApi").finish_non_exhaustive()
    }
}

impl VirtApi {
    /// Waits for the front-proxy settings and the KubeVirt CR watch, then builds the TLS config
    /// and the routes. `client` is virt-api's own identity (its service account in a cluster):
    /// it asks the SubjectAccessReviews and reads VMIs, VMs and the virt-handler pods.
    pub async fn start(client: kube::Client, config: Config) -> anyhow::Result<Self> {
        let f = config;
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
        // KubeVirt's VMI mutator reads presets from an informer too.
        let presets = informer::reflect(
            &mut tasks,
            Api::<api::preset::VirtualMachineInstancePreset>::all(client.clone()),
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
                f.handler_tls,
            ),
            kubevirts: kubevirts.clone(),
            namespace: f.namespace.clone(),
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
        presets
            .wait_until_ready()
            .await
            .context("the VirtualMachineInstancePreset watch")?;
        let webhooks = Arc::new(webhooks::Webhooks::new(
            client.clone(),
            kubevirts,
            presets,
            f.namespace,
        ));
        Ok(VirtApi {
            tasks,
            tls,
            router: server::router(app, webhooks),
        })
    }

    /// Serves on `listener` until `shutdown` (then `Ok`) or until a watch ends (an error).
    pub async fn serve(
        mut self,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "serving subresources.kubevirt.io and the admission webhooks");
        }
        let stop = shutdown.child_token();
        let serving = tokio::spawn(server::serve(listener, self.tls, self.router, stop.clone()));
        let result = tokio::select! {
            () = shutdown.cancelled() => Ok(()),
            Some(r) = self.tasks.join_next() => Err(anyhow::anyhow!("a watch task ended: {r:?}")),
        };
        stop.cancel();
        serving.await.ok();
        result
    }
}

/// Writes the front proxy's CA where the TLS config reads it, and returns the header settings.
fn apply_auth_config(
    data: &BTreeMap<String, String>,
    ca_file: &Path,
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
