//! The way to the cluster: kubeconfig resolution as kubectl does it, and the three kinds of call
//! virtctl makes to virt-api through the API server (JSON `PUT`, `GET`, websocket upgrade).

use std::path::PathBuf;

use anyhow::Context as _;
use http::{Request, StatusCode, header};
use http_body_util::BodyExt as _;
use hyper_util::rt::TokioIo;
use kube::client::Body;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

use crate::error::{RequestError, api_error};

/// kubectl's connection flags, accepted before or after the command.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct KubeFlags {
    /// Path to the kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)
    #[arg(long, global = true, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// The namespace scope for this request (default: the context's namespace)
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// The kubeconfig context to use
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// The kubeconfig cluster to use
    #[arg(long, global = true)]
    pub cluster: Option<String>,
    /// The kubeconfig user to use
    #[arg(long, global = true)]
    pub user: Option<String>,
}

/// A websocket to a virt-api stream, over the upgraded API server connection.
pub type Stream = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// A client bound to the namespace the command acts in.
#[derive(Clone)]
pub struct Cluster {
    pub client: kube::Client,
    pub namespace: String,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// `-n` wins over the context's namespace, which wins over `default` (kube fills that in).
pub fn effective_namespace(flag: Option<&str>, from_config: &str) -> String {
    flag.filter(|n| !n.is_empty())
        .unwrap_or(from_config)
        .to_owned()
}

impl Cluster {
    pub async fn connect(flags: &KubeFlags) -> anyhow::Result<Self> {
        let options = KubeConfigOptions {
            context: flags.context.clone(),
            cluster: flags.cluster.clone(),
            user: flags.user.clone(),
        };
        let explicit = flags.context.is_some() || flags.cluster.is_some() || flags.user.is_some();
        let mut config = if let Some(path) = &flags.kubeconfig {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .with_context(|| format!("invalid kubeconfig {}", path.display()))?
        } else {
            match kube::Config::from_kubeconfig(&options).await {
                Ok(c) => c,
                // Inside a pod with no kubeconfig, kubectl uses the service account; so do we,
                // unless the user asked for a particular context, cluster or user.
                Err(e) if !explicit => kube::Config::incluster().map_err(|_| {
                    anyhow::Error::new(e).context("cannot load kubeconfig ($KUBECONFIG or ~/.kube/config) and not running in a pod")
                })?,
                Err(e) => return Err(anyhow::Error::new(e).context("invalid kubeconfig")),
            }
        };
        let namespace = effective_namespace(flags.namespace.as_deref(), &config.default_namespace);
        // kube's client retries 429, 503 and 504 with backoff; a user at a terminal should see
        // virt-api's answer at once (a 503 says the launcher's socket is not there), as
        // KubeVirt's virtctl shows it.
        config.default_retry = false;
        let client = kube::Client::try_from(config).context("cannot build API client")?;
        Ok(Cluster { client, namespace })
    }

    /// `PUT path` with a JSON body (none for the actions KubeVirt sends none with).
    pub async fn put<B: serde::Serialize>(
        &self,
        path: &str,
        body: Option<&B>,
    ) -> Result<Vec<u8>, RequestError> {
        let body = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| RequestError::Protocol(e.to_string()))?,
            None => Vec::new(),
        };
        let req = Request::put(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .map_err(|e| RequestError::Protocol(e.to_string()))?;
        self.call(req).await
    }

    /// `GET path` (with its query), the raw answer.
    pub async fn get(&self, path: &str) -> Result<Vec<u8>, RequestError> {
        let req = Request::get(path)
            .header(header::ACCEPT, "application/json, */*")
            .body(Body::empty())
            .map_err(|e| RequestError::Protocol(e.to_string()))?;
        self.call(req).await
    }

    async fn call(&self, req: Request<Body>) -> Result<Vec<u8>, RequestError> {
        let res = self.client.send(req).await?;
        let status = res.status();
        let body = read_body(res.into_body()).await?;
        if status.is_success() {
            Ok(body)
        } else {
            Err(RequestError::Api(api_error(status.as_u16(), &body)))
        }
    }

    /// Opens a `plain.kubevirt.io` websocket. kube's own `connect` offers only the Kubernetes
    /// channel protocols, so the upgrade is done here on kube's authenticated connection.
    pub async fn websocket(&self, path: &str) -> Result<Stream, RequestError> {
        let key = generate_key();
        let req = Request::get(path)
            .header(header::CONNECTION, "Upgrade")
            .header(header::UPGRADE, "websocket")
            .header(header::SEC_WEBSOCKET_VERSION, "13")
            .header(header::SEC_WEBSOCKET_KEY, &key)
            .header(
                header::SEC_WEBSOCKET_PROTOCOL,
                api::subresources::PLAIN_STREAM_PROTOCOL,
            )
            .body(Body::empty())
            .map_err(|e| RequestError::Protocol(e.to_string()))?;
        let mut res = self.client.send(req).await?;
        let status = res.status();
        if status != StatusCode::SWITCHING_PROTOCOLS {
            let body = read_body(res.into_body()).await?;
            if status.is_success() {
                return Err(RequestError::Protocol(format!(
                    "the server answered {status} instead of upgrading to a websocket"
                )));
            }
            return Err(RequestError::Api(api_error(status.as_u16(), &body)));
        }
        let accept = res
            .headers()
            .get(header::SEC_WEBSOCKET_ACCEPT)
            .and_then(|v| v.to_str().ok());
        if accept != Some(derive_accept_key(key.as_bytes()).as_str()) {
            return Err(RequestError::Protocol(
                "the server's Sec-WebSocket-Accept does not match the key sent".into(),
            ));
        }
        let upgraded = hyper::upgrade::on(&mut res)
            .await
            .map_err(|e| RequestError::Protocol(format!("websocket upgrade failed: {e}")))?;
        Ok(WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, None).await)
    }
}

async fn read_body(body: Body) -> Result<Vec<u8>, RequestError> {
    let bytes = body
        .collect()
        .await
        .map_err(RequestError::Transport)?
        .to_bytes();
    Ok(bytes.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_precedence() {
        let cases = [
            (Some("team"), "dev", "team"),
            (None, "dev", "dev"),
            (Some(""), "default", "default"),
        ];
        for (flag, config, want) in cases {
            assert_eq!(effective_namespace(flag, config), want);
        }
    }
}
