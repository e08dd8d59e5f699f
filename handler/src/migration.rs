//! The migration proxy (KubeVirt's `pkg/virt-handler/migration-proxy`): QEMU on both ends only
//! ever sees unix sockets in its pod's `sockets` emptyDir; the handlers carry each stream
//! between nodes over TCP, with TLS unless the cluster's `disableTLS` says otherwise.
//!
//! - Target: one listener per stream ([`launcher_api::migration::STREAMS`]) on the handler's
//!   address, each connection spliced to the target launcher's socket for that stream. Its ports
//!   go into `migrationState.targetDirectMigrationNodePorts` as `{"<port>": <stream key>}`.
//! - Source: for each of those ports, a unix socket where the source's QEMU connects, each
//!   connection spliced to the target's port.
//!
//! Both ends authenticate with the handlers' certificate (server and client usage), checked
//! against the cluster CA, as KubeVirt's `migrationServerTLSConfig` / `migrationClientTLSConfig`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use launcher_api::migration::STREAMS;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

/// The name the handlers' certificate carries (its Service's).
const HANDLER_SERVER_NAME: &str = "virt-handler";

/// How the handlers talk to each other.
#[derive(Clone)]
pub enum Transport {
    Tls {
        server: Arc<tlsconfig::ReloadingConfig>,
        client: Arc<rustls::ClientConfig>,
    },
    /// `migrations.disableTLS: true`.
    Plain,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Tls { .. } => "Tls",
            Transport::Plain => "Plain",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("binding {what} {at}")]
    Bind {
        what: &'static str,
        at: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the target offered port {port} for stream {key:?}, which is not a migration stream")]
    UnknownStream { port: String, key: i32 },
    #[error("the target's port {0:?} is not a port number")]
    BadPort(String),
}

/// A running proxy; dropping it stops its listeners and removes its sockets.
#[derive(Debug)]
pub struct Proxy {
    stop: CancellationToken,
    sockets: Vec<PathBuf>,
    /// Target only: `targetDirectMigrationNodePorts`.
    pub ports: BTreeMap<String, i32>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
        for s in &self.sockets {
            let _ = std::fs::remove_file(s);
        }
    }
}

/// The stream key of a socket path relative to the share dir (`"0"`, `"49153"`).
fn stream_key(relative: &str) -> i32 {
    STREAMS
        .iter()
        .find(|(_, r)| *r == relative)
        .and_then(|(k, _)| k.parse().ok())
        .unwrap_or_default()
}

async fn splice<A, B>(mut a: A, mut b: B)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    if let Err(e) = tokio::io::copy_bidirectional(&mut a, &mut b).await {
        tracing::debug!(error = %e, "a migration stream ended");
    }
}

/// Target: listens on `ip` (port chosen by the kernel) for each stream and splices each
/// connection to the launcher's socket under `share` (the pod's emptyDir as the handler sees it).
pub async fn listen(transport: &Transport, ip: IpAddr, share: &Path) -> Result<Proxy, ProxyError> {
    let stop = CancellationToken::new();
    let mut ports = BTreeMap::new();
    for (_, relative) in STREAMS {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .await
            .map_err(|source| ProxyError::Bind {
                what: "a migration listener on",
                at: ip.to_string(),
                source,
            })?;
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        ports.insert(port.to_string(), stream_key(relative));
        let socket = share.join(relative);
        let transport = transport.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((tcp, peer)) = accepted else { continue };
                let _ = tcp.set_nodelay(true);
                let socket = socket.clone();
                let transport = transport.clone();
                tokio::spawn(async move {
                    // The name is the target pod's: a link it planted there is not followed
                    // to another process's socket.
                    let local = match isolation::open_socket(&socket) {
                        Ok(resolved) => UnixStream::connect(resolved.proc_fd_path()).await,
                        Err(e) => Err(std::io::Error::other(e)),
                    };
                    let local = match local {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(socket = %socket.display(), error = %e, "the target launcher's migration socket");
                            return;
                        }
                    };
                    match transport {
                        Transport::Plain => splice(tcp, local).await,
                        Transport::Tls { server, .. } => {
                            match tokio_rustls::TlsAcceptor::from(server.get())
                                .accept(tcp)
                                .await
                            {
                                Ok(tls) => splice(tls, local).await,
                                Err(e) => {
                                    tracing::warn!(%peer, error = %e, "a migration peer failed TLS");
                                }
                            }
                        }
                    }
                });
            }
        });
    }
    Ok(Proxy {
        stop,
        sockets: Vec::new(),
        ports,
    })
}

/// Source: a unix socket under `share` for each of the target's `ports`, each connection
/// carried to `target:<port>`.
pub fn connect(
    transport: &Transport,
    target: IpAddr,
    ports: &BTreeMap<String, i32>,
    share: &Path,
) -> Result<Proxy, ProxyError> {
    let stop = CancellationToken::new();
    let mut sockets = Vec::new();
    for (port, key) in ports {
        let port_no: u16 = port
            .parse()
            .map_err(|_| ProxyError::BadPort(port.clone()))?;
        let relative = STREAMS
            .iter()
            .find(|(k, _)| k.parse::<i32>().ok() == Some(*key))
            .map(|(_, r)| *r)
            .ok_or_else(|| ProxyError::UnknownStream {
                port: port.clone(),
                key: *key,
            })?;
        let path = share.join(relative);
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(|source| ProxyError::Bind {
            what: "a migration socket at",
            at: path.display().to_string(),
            source,
        })?;
        sockets.push(path);
        let addr = SocketAddr::new(target, port_no);
        let transport = transport.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((local, _)) = accepted else { continue };
                let transport = transport.clone();
                tokio::spawn(async move {
                    let tcp = match TcpStream::connect(addr).await {
                        Ok(t) => t,
                        Err(e) => {
                            tracing::warn!(%addr, error = %e, "connecting to the migration target");
                            return;
                        }
                    };
                    let _ = tcp.set_nodelay(true);
                    match transport {
                        Transport::Plain => splice(local, tcp).await,
                        Transport::Tls { client, .. } => {
                            let name = ServerName::try_from(HANDLER_SERVER_NAME)
                                .expect("a valid DNS name");
                            match tokio_rustls::TlsConnector::from(client)
                                .connect(name, tcp)
                                .await
                            {
                                Ok(tls) => splice(local, tls).await,
                                Err(e) => {
                                    tracing::warn!(%addr, error = %e, "TLS to the migration target");
                                }
                            }
                        }
                    }
                });
            }
        });
    }
    Ok(Proxy {
        stop,
        sockets,
        ports: BTreeMap::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// Both proxies, plain: bytes written to the source's socket come out of the target
    /// launcher's socket for the same stream, and back.
    #[tokio::test]
    async fn streams_are_carried_from_the_source_socket_to_the_target_socket() {
        let target_dir = tempfile::tempdir().unwrap();
        let source_dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(target_dir.path().join("sockets")).unwrap();
        std::fs::create_dir_all(source_dir.path().join("sockets")).unwrap();
        let launcher = UnixListener::bind(target_dir.path().join(STREAMS[1].1)).unwrap();
        let t = listen(
            &Transport::Plain,
            IpAddr::from([127, 0, 0, 1]),
            target_dir.path(),
        )
        .await
        .unwrap();
        assert_eq!(t.ports.len(), 2);
        assert_eq!(
            t.ports
                .values()
                .copied()
                .collect::<std::collections::BTreeSet<_>>(),
            [0, 49153].into()
        );
        let s = connect(
            &Transport::Plain,
            IpAddr::from([127, 0, 0, 1]),
            &t.ports,
            source_dir.path(),
        )
        .unwrap();
        let mut qemu = UnixStream::connect(source_dir.path().join(STREAMS[1].1))
            .await
            .unwrap();
        qemu.write_all(b"nbd hello").await.unwrap();
        let (mut served, _) = launcher.accept().await.unwrap();
        let mut buf = [0u8; 9];
        served.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"nbd hello");
        served.write_all(b"ok").await.unwrap();
        let mut back = [0u8; 2];
        qemu.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"ok");

        let sock = source_dir.path().join(STREAMS[1].1);
        drop(s);
        assert!(!sock.exists(), "the source's sockets go with its proxy");
        let bad = BTreeMap::from([("1".to_owned(), 7)]);
        let e = connect(
            &Transport::Plain,
            IpAddr::from([127, 0, 0, 1]),
            &bad,
            source_dir.path(),
        )
        .expect_err("no stream 7");
        assert!(e.to_string().contains("stream 7"), "{e}");
    }

    /// A target pod that replaced its migration socket with a link to a socket of the node gets
    /// its stream hung up rather than spliced there.
    #[tokio::test]
    async fn a_target_socket_planted_as_a_link_out_of_the_pod_is_not_followed() {
        let node = tempfile::tempdir().unwrap();
        let node_socket = node.path().join("runtime.sock");
        let listener = UnixListener::bind(&node_socket).unwrap();
        let target_dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(target_dir.path().join("sockets")).unwrap();
        std::os::unix::fs::symlink(&node_socket, target_dir.path().join(STREAMS[1].1)).unwrap();
        let t = listen(
            &Transport::Plain,
            IpAddr::from([127, 0, 0, 1]),
            target_dir.path(),
        )
        .await
        .unwrap();
        let port = t
            .ports
            .iter()
            .find(|(_, key)| **key == 49153)
            .map(|(p, _)| p.parse::<u16>().unwrap())
            .unwrap();
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        tcp.write_all(b"nbd hello").await.unwrap();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(std::time::Duration::from_secs(10), tcp.read(&mut buf))
            .await
            .expect("hung up, not spliced");
        assert_eq!(read.unwrap_or(0), 0);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(200), listener.accept())
                .await
                .is_err(),
            "the node's socket was reached"
        );
    }
}
