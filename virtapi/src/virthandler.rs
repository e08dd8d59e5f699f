//! Reaching the virt-handler of a VMI's node: its pod is found by label and node (KubeVirt's
//! `kubecli.VirtHandlerClient.ForNode`), and every call is a fresh mTLS connection to its
//! console server with virt-api's client certificate, so users never hold the handler's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use crate::status::Refusal;

/// The name virt-handler's serving certificate carries (KubeVirt's handler certificates name
/// the service, not the pod IP the connection goes to).
const HANDLER_SERVER_NAME: &str = "virt-handler";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound of a REST call; the handler bounds its launcher calls at 30 s.
const CALL_TIMEOUT: Duration = Duration::from_secs(40);

/// The client certificate, key and the CA the handler's certificate chains to.
#[derive(Debug, Clone)]
pub struct HandlerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

#[derive(Clone)]
pub struct Handlers {
    pods: Api<Pod>,
    port: u16,
    tls: HandlerTls,
}

/// A handler's answer to a REST call.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub content_type: Option<http::HeaderValue>,
    pub body: Bytes,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handlers")
            .field("port", &self.port)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl Handlers {
    pub fn new(client: kube::Client, namespace: &str, port: u16, tls: HandlerTls) -> Self {
        Handlers {
            pods: Api::namespaced(client, namespace),
            port,
            tls,
        }
    }

    async fn address(&self, node: &str) -> Result<SocketAddr, Refusal> {
        let lp = ListParams::default()
            .labels(&format!("{}=virt-handler", api::labels::APP))
            .fields(&format!("spec.nodeName={node}"));
        let pods = self.pods.list(&lp).await.map_err(Refusal::from_kube)?;
        let ip = pods
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .find_map(|p| {
                let s = p.status.as_ref()?;
                (s.phase.as_deref() == Some("Running"))
                    .then(|| s.pod_ip.clone())
                    .flatten()
            })
            .ok_or_else(|| {
                Refusal::internal(format!("no running virt-handler pod on node {node}"))
            })?;
        let ip = ip
            .parse()
            .map_err(|e| Refusal::internal(format!("virt-handler pod IP {ip:?}: {e}")))?;
        Ok(SocketAddr::new(ip, self.port))
    }

    async fn connect(&self, node: &str) -> Result<TlsStream<TcpStream>, Refusal> {
        let addr = self.address(node).await?;
        // Read per call: the files are small and rotate under us.
        let config = tlsconfig::client_config(&self.tls.cert, &self.tls.key, &self.tls.ca)
            .map_err(|e| Refusal::internal(format!("virt-api's client TLS: {e}")))?;
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| Refusal::internal(format!("connecting to virt-handler {addr} timed out")))?
            .map_err(|e| Refusal::internal(format!("connecting to virt-handler {addr}: {e}")))?;
        tcp.set_nodelay(true).ok();
        let name = ServerName::try_from(HANDLER_SERVER_NAME).expect("a valid DNS name");
        tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp),
        )
        .await
        .map_err(|_| Refusal::internal(format!("TLS to virt-handler {addr} timed out")))?
        .map_err(|e| Refusal::internal(format!("TLS to virt-handler {addr}: {e}")))
    }

    /// One REST call to the handler of `node`.
    pub async fn call(
        &self,
        node: &str,
        method: Method,
        path_and_query: &str,
        body: Bytes,
    ) -> Result<Answer, Refusal> {
        let tls = self.connect(node).await?;
        let call = async {
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                .await
                .map_err(|e| Refusal::internal(format!("virt-handler on {node}: {e}")))?;
            tokio::spawn(conn);
            let req = http::Request::builder()
                .method(method)
                .uri(path_and_query)
                .header(http::header::HOST, HANDLER_SERVER_NAME)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(body))
                .map_err(Refusal::internal)?;
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| Refusal::internal(format!("virt-handler on {node}: {e}")))?;
            let status = resp.status();
            let content_type = resp.headers().get(http::header::CONTENT_TYPE).cloned();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| Refusal::internal(format!("virt-handler on {node}: {e}")))?
                .to_bytes();
            Ok(Answer {
                status,
                content_type,
                body,
            })
        };
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .map_err(|_| Refusal::internal(format!("virt-handler on {node} did not answer")))?
    }

    /// Upgrades a connection to the handler of `node` to a `plain.kubevirt.io` websocket
    /// (console, VNC, port-forward) and returns the raw upgraded stream: virt-api relays its
    /// bytes without decoding frames (see `subresource::stream`).
    pub async fn upgrade(&self, node: &str, path: &str) -> Result<Upgraded, Refusal> {
        let tls = self.connect(node).await?;
        let dial = async {
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                .await
                .map_err(|e| Refusal::internal(format!("virt-handler on {node}: {e}")))?;
            tokio::spawn(conn.with_upgrades());
            let key = generate_key();
            let req = http::Request::builder()
                .method(Method::GET)
                .uri(path)
                .header(http::header::HOST, HANDLER_SERVER_NAME)
                .header(http::header::CONNECTION, "Upgrade")
                .header(http::header::UPGRADE, "websocket")
                .header(http::header::SEC_WEBSOCKET_VERSION, "13")
                .header(http::header::SEC_WEBSOCKET_KEY, &key)
                .header(
                    http::header::SEC_WEBSOCKET_PROTOCOL,
                    api::subresources::PLAIN_STREAM_PROTOCOL,
                )
                .body(Full::new(Bytes::new()))
                .map_err(Refusal::internal)?;
            let mut resp = sender
                .send_request(req)
                .await
                .map_err(|e| Refusal::internal(format!("virt-handler on {node}: {e}")))?;
            if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
                let status = resp.status();
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map(http_body_util::Collected::to_bytes)
                    .unwrap_or_default();
                return Err(Refusal {
                    code: status,
                    reason: if status == StatusCode::CONFLICT {
                        "Conflict"
                    } else {
                        "InternalError"
                    },
                    message: handler_message(&String::from_utf8_lossy(&body)),
                });
            }
            let accept = resp.headers().get(http::header::SEC_WEBSOCKET_ACCEPT);
            if accept.and_then(|v| v.to_str().ok())
                != Some(derive_accept_key(key.as_bytes()).as_str())
            {
                return Err(Refusal::internal(format!(
                    "virt-handler on {node} answered the websocket upgrade with a wrong Sec-WebSocket-Accept"
                )));
            }
            hyper::upgrade::on(&mut resp)
                .await
                .map_err(|e| Refusal::internal(format!("virt-handler on {node}: {e}")))
        };
        tokio::time::timeout(CONNECT_TIMEOUT, dial)
            .await
            .map_err(|_| {
                Refusal::internal(format!("websocket to virt-handler on {node} timed out"))
            })?
    }
}

/// The message of a handler's error body (`{"message": ...}` or plain text).
pub fn handler_message(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
        .unwrap_or_else(|| body.trim().to_owned())
}
