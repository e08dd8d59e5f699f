//! localcluster: an embedded single-machine Kubernetes API server for development and tests.
//!
//! It speaks the Kubernetes REST protocol over HTTPS (JSON only), so `kubectl` and kube-rs work
//! against it unchanged. See `docs/localcluster.md` for what it implements.

pub mod admission;
pub mod controllers;
pub mod discovery;
pub mod error;
pub mod events;
pub mod exec;
pub mod fields;
pub mod images;
pub mod kubelet;
pub mod logs;
pub mod patch;
pub mod resources;
pub mod rules;
pub mod scheduler;
pub mod schema;
pub mod selector;
pub mod server;
pub mod store;
pub mod table;
pub mod tls;
pub mod workloads;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tokio::task::JoinSet;

use crate::discovery::Registry;
use crate::server::AppState;
use crate::store::{Outcome, Store};

/// Why the server could not start or a client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("TLS setup")]
    Tls(#[from] tls::TlsError),
    #[error("binding the API server to {addr}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("writing {path}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("reading the generated kubeconfig")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("building a client")]
    Client(#[from] kube::Error),
}

/// How to run the API server.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen; port 0 picks a free port.
    pub listen: SocketAddr,
    /// How many events the watch history keeps; older resourceVersions get 410 Expired.
    pub history_window: usize,
    /// How often watches that allow bookmarks get one.
    pub bookmark_interval: Duration,
    /// The bearer token clients must present; a random one when `None`.
    pub token: Option<String>,
    /// Where pods reach the server (kube-apiserver's `--advertise-address`): the serving
    /// certificate names it and the server listens there too, on the same port. Pods are
    /// told this address ([`ApiServer::pod_access`]).
    pub advertise_address: Option<IpAddr>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            history_window: 10_000,
            bookmark_interval: Duration::from_secs(30),
            token: None,
            advertise_address: None,
        }
    }
}

/// A running API server. Dropping it stops the server.
#[derive(Debug)]
pub struct ApiServer {
    url: String,
    kubeconfig: String,
    token: String,
    ca_pem: String,
    /// The advertise address and port, when pods are to reach the server.
    advertised: Option<SocketAddr>,
    tasks: JoinSet<()>,
}

const DEFAULT_NAMESPACES: &[&str] = &["default", "kube-system", "kube-public", "kube-node-lease"];

impl ApiServer {
    /// Starts serving on `config.listen`, with the default namespaces in place.
    pub async fn start(config: Config) -> Result<Self, Error> {
        let certs = tls::ServingCerts::generate_for(config.advertise_address.as_slice())?;
        let acceptor = tokio_rustls::TlsAcceptor::from(certs.server_config()?);
        let listener = bind(config.listen).await?;
        let local = listener.local_addr().map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
        let advertised = config
            .advertise_address
            .map(|ip| SocketAddr::new(ip, local.port()));
        let mut listeners = vec![listener];
        if let Some(addr) = advertised
            && !local.ip().is_unspecified()
            && local.ip() != addr.ip()
        {
            listeners.push(bind(addr).await?);
        }
        let host = if local.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else if local.is_ipv6() {
            format!("[{}]", local.ip())
        } else {
            local.ip().to_string()
        };
        let url = format!("https://{host}:{}", local.port());
        let token = config
            .token
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
        let state = Arc::new(AppState {
            store: Store::new(config.history_window),
            registry: RwLock::new(Arc::new(Registry::default())),
            token: token.clone(),
            bookmark_interval: config.bookmark_interval,
            gc_finalizers: true,
        });
        create_default_namespaces(&state);
        let app = axum::Router::new()
            .route(
                "/api/v1/namespaces/{namespace}/pods/{name}/exec",
                axum::routing::any(exec::handle),
            )
            .fallback(server::handle)
            .with_state(state.clone());
        let mut tasks = JoinSet::new();
        tasks.spawn(controllers::namespace_controller(state.clone()));
        tasks.spawn(controllers::garbage_collector(state.clone()));
        for listener in listeners {
            tasks.spawn(serve(listener, acceptor.clone(), app.clone()));
        }
        let kubeconfig = tls::kubeconfig(&url, &certs.ca_pem, &token);
        tasks.spawn(workloads::run(client_for(&kubeconfig).await?));
        tracing::info!(%url, "API server listening");
        Ok(Self {
            url,
            kubeconfig,
            token,
            ca_pem: certs.ca_pem,
            advertised,
            tasks,
        })
    }

    /// How pods reach this server: its advertise address, the CA and the token for their
    /// service account mounts. `None` without an advertise address.
    pub fn pod_access(&self) -> Option<kubelet::ApiAccess> {
        self.advertised.map(|address| kubelet::ApiAccess {
            address,
            ca_pem: self.ca_pem.clone(),
            token: self.token.clone(),
        })
    }

    /// The server's base URL (`https://127.0.0.1:<port>`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A kubeconfig (YAML) that reaches this server.
    pub fn kubeconfig(&self) -> &str {
        &self.kubeconfig
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    /// Writes the kubeconfig to `path`, readable by its owner only.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<(), Error> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(path)?;
            f.write_all(self.kubeconfig.as_bytes())
        };
        write().map_err(|source| Error::Write {
            path: path.display().to_string(),
            source,
        })
    }

    /// A kube-rs client for this server, authenticated like `kubectl` with the kubeconfig.
    pub async fn client(&self) -> Result<kube::Client, Error> {
        client_for(&self.kubeconfig).await
    }
    /// Stops serving; open connections are closed.
    pub async fn shutdown(mut self) {
        self.tasks.shutdown().await;
    }
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, Error> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

/// Accepts TLS connections on `listener` and serves `app` on each, until aborted.
async fn serve(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    app: axum::Router,
) {
    let mut connections = JoinSet::new();
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a connection");
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(app.clone());
        connections.spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let served = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection_with_upgrades(TokioIo::new(tls), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "connection ended");
            }
        });
        while connections.try_join_next().is_some() {}
    }
}

async fn client_for(kubeconfig: &str) -> Result<kube::Client, Error> {
    let kc = kube::config::Kubeconfig::from_yaml(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await?;
    Ok(kube::Client::try_from(config)?)
}

fn create_default_namespaces(state: &AppState) {
    let registry = Registry::default();
    let def = registry
        .find("", "v1", "namespaces")
        .expect("namespaces are built in")
        .clone();
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    for name in DEFAULT_NAMESPACES {
        let uid = uuid::Uuid::new_v4().to_string();
        let ctx = rules::Context {
            now: &now,
            uid: &uid,
            suffix: "",
        };
        let created = state
            .store
            .mutate(&def.group_resource(), "", name, |objs, _| {
                rules::prepare_create(&def, json!({"metadata": {"name": name}}), None, objs, &ctx)
                    .map(Outcome::Put)
            });
        if let Err(e) = created {
            tracing::error!(namespace = name, error = %e, "creating a default namespace");
        }
    }
}
