//! rustls configs from the certificate files KubeVirt's components mount from their secrets:
//! servers (virt-handler's console server, virt-api) whose certificate, key and client CA bundle
//! are re-read whenever one of the files changes, so the operator can rotate them without a
//! restart, and the client config virt-api dials virt-handler with.
//!
//! Changes are noticed on the next connection (a `stat` of three files per accept) rather than
//! by a file watcher: rotation happens by replacing mounted secret files, which a stat always
//! sees, and no extra thread or crate is needed.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ServerConfig};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {what} from {path}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path} holds no {what}")]
    Empty { what: &'static str, path: PathBuf },
    #[error("{path} holds a CA certificate that cannot be used")]
    Ca {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the client CA bundle {path} cannot be used")]
    ClientCa {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    #[error("the server certificate {cert} and key {key} do not make a TLS config")]
    Config {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

/// The three files, as KubeVirt mounts them from its secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
    pub client_auth: ClientAuth,
}

/// Whether a client must present a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Every client proves itself (virt-handler's console server: only virt-api and the
    /// operator's tools hold a client certificate).
    Required,
    /// A certificate is verified when one is offered, and the server decides per request what
    /// an unauthenticated client may do (virt-api: kube-apiserver's front proxy presents one,
    /// admission webhook calls come without).
    Optional,
}

type Stamp = Vec<Option<(SystemTime, u64)>>;

fn stamp(files: &TlsFiles) -> Stamp {
    [&files.cert, &files.key, &files.client_ca]
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read_err = |source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read_err)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read_err)?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// ring's suites with AES-128-GCM first, and the server's order winning over the client's.
/// *ring*'s default (and a rustls client's) puts AES-256-GCM first, which costs 14 AES rounds
/// per block against 10 for the same security margin in practice; console and VNC streams are
/// bulk data, and both ends run AES on the CPU's AES-NI / VAES. ChaCha20 stays for clients
/// that offer nothing else.
fn provider() -> CryptoProvider {
    use rustls::crypto::ring::cipher_suite as cs;
    CryptoProvider {
        cipher_suites: vec![
            cs::TLS13_AES_128_GCM_SHA256,
            cs::TLS13_AES_256_GCM_SHA384,
            cs::TLS13_CHACHA20_POLY1305_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ],
        ..rustls::crypto::ring::default_provider()
    }
}

/// Builds the server config from the files as they are now.
pub fn load(files: &TlsFiles) -> Result<ServerConfig, TlsError> {
    let provider = Arc::new(provider());
    let roots = roots(&files.client_ca)?;
    let mut verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
    if files.client_auth == ClientAuth::Optional {
        verifier = verifier.allow_unauthenticated();
    }
    let verifier = verifier.build().map_err(|source| TlsError::ClientCa {
        path: files.client_ca.clone(),
        source,
    })?;
    let chain = certs("certificates", &files.cert)?;
    let key = private_key(&files.key)?;
    let config_err = |source| TlsError::Config {
        cert: files.cert.clone(),
        key: files.key.clone(),
        source,
    };
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(config_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(config_err)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config.ignore_client_order = true;
    Ok(config)
}

fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for ca in certs("CA certificates", path)? {
        roots.add(ca).map_err(|source| TlsError::Ca {
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(roots)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TlsError::Read {
        what: "a private key",
        path: path.to_owned(),
        source,
    })
}

/// A client config that presents `cert`/`key` and trusts servers whose certificate chains to
/// `ca` (virt-api dialling virt-handler's console server).
pub fn client_config(cert: &Path, key: &Path, ca: &Path) -> Result<ClientConfig, TlsError> {
    let provider = Arc::new(provider());
    let config_err = |source| TlsError::Config {
        cert: cert.to_owned(),
        key: key.to_owned(),
        source,
    };
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(config_err)?
        .with_root_certificates(roots(ca)?)
        .with_client_auth_cert(certs("certificates", cert)?, private_key(key)?)
        .map_err(config_err)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The current server config, rebuilt when the files change. A rotation caught half-written
/// (key and certificate not yet matching) keeps the previous config until the files settle.
#[derive(Debug)]
pub struct ReloadingConfig {
    files: TlsFiles,
    current: Mutex<(Stamp, Arc<ServerConfig>)>,
}

impl ReloadingConfig {
    pub fn new(files: TlsFiles) -> Result<Self, TlsError> {
        let s = stamp(&files);
        let config = Arc::new(load(&files)?);
        Ok(ReloadingConfig {
            files,
            current: Mutex::new((s, config)),
        })
    }

    pub fn get(&self) -> Arc<ServerConfig> {
        let now = stamp(&self.files);
        let mut cur = self.current.lock().expect("tls config lock poisoned");
        if cur.0 != now {
            match load(&self.files) {
                Ok(c) => {
                    tracing::info!(cert = %self.files.cert.display(), "TLS files changed; reloaded");
                    *cur = (now, Arc::new(c));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "TLS files changed but cannot be loaded; keeping the previous ones");
                }
            }
        }
        cur.1.clone()
    }
}

/// How long a client may take over its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves HTTP/1.1 over TLS on `listener` until `shutdown`: each connection gets the config
/// current at accept time (so rotated certificates apply to new connections), `TCP_NODELAY`
/// (consoles are interactive: a typed key's echo must not wait for the previous segment's ACK),
/// upgrades (websockets), and the router `app` makes from the client's verified certificate
/// chain, if it presented one.
pub async fn serve_https<F>(
    listener: tokio::net::TcpListener,
    tls: Arc<ReloadingConfig>,
    app: F,
    shutdown: tokio_util::sync::CancellationToken,
) where
    F: Fn(Option<&[CertificateDer<'static>]>) -> axum::Router + Clone + Send + 'static,
{
    loop {
        let (tcp, remote) = tokio::select! {
            () = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%remote, error = %e, "cannot set TCP_NODELAY");
        }
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.get());
        let app = app.clone();
        tokio::spawn(async move {
            let stream =
                match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::info!(%remote, error = %e, "TLS handshake refused");
                        return;
                    }
                    Err(_) => {
                        tracing::info!(%remote, "TLS handshake timed out");
                        return;
                    }
                };
            let router = app(stream.get_ref().1.peer_certificates());
            let service = hyper_util::service::TowerToHyperService::new(router);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .with_upgrades()
                .await
            {
                tracing::debug!(%remote, error = %e, "connection ended with an error");
            }
        });
    }
}
