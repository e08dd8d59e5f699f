//! The launcher client: typed calls to a virt-launcher's command API (HTTP/1.1 + JSON on its
//! unix socket) and its domain watch as a `Stream` of [`Domain`].
//!
//! One connection per call: the socket is local, connecting costs microseconds, and a fresh
//! connection means a launcher restart never leaves a stale pooled one behind.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt as _, TryStreamExt as _};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt as _, BodyStream, Full};
use hyper_util::rt::TokioIo;
use launcher::domain::{ApiError, DiskStats, Domain, Info};
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;
use tokio_util::codec::{FramedRead, LinesCodec};
use tokio_util::io::StreamReader;

use crate::guestinfo::{QgaFilesystem, QgaInfo, QgaOsInfo, QgaUser};

/// A domain line longer than this is not a domain.
const MAX_WATCH_LINE: usize = 4 * 1024 * 1024;

/// Where a pod's launcher socket is, seen from the handler: the kubelet's emptyDir `sockets`
/// volume of that pod (KubeVirt mounts the kubelet pods dir as `/pods` in virt-handler).
pub fn pod_socket(pods_dir: &Path, pod_uid: &str) -> PathBuf {
    pods_dir
        .join(pod_uid)
        .join("volumes/kubernetes.io~empty-dir/sockets/launcher-sock")
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to the launcher at {socket}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP to the launcher at {socket} ({path})")]
    Http {
        socket: PathBuf,
        path: String,
        #[source]
        source: hyper::Error,
    },
    #[error("the launcher at {socket} did not answer {path} within {timeout:?}")]
    Timeout {
        socket: PathBuf,
        path: String,
        timeout: Duration,
    },
    #[error("the launcher at {socket} refused {path} ({status}, {}): {}", error.code, error.message)]
    Api {
        socket: PathBuf,
        path: String,
        status: u16,
        error: ApiError,
    },
    #[error("the launcher at {socket} answered {path} with something unexpected")]
    Decode {
        socket: PathBuf,
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("reading the domain watch from {socket}")]
    Watch {
        socket: PathBuf,
        #[source]
        source: tokio_util::codec::LinesCodecError,
    },
}

impl ClientError {
    /// The launcher is not there or not answering (as opposed to refusing the call).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            ClientError::Connect { .. } | ClientError::Http { .. } | ClientError::Timeout { .. }
        )
    }

    /// The launcher's error code when it refused the call.
    pub fn api_code(&self) -> Option<&str> {
        match self {
            ClientError::Api { error, .. } => Some(&error.code),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct LauncherClient {
    socket: PathBuf,
    timeout: Duration,
}

impl LauncherClient {
    /// `timeout` bounds each call (not a watch, which lasts as long as the domain).
    pub fn new(socket: impl Into<PathBuf>, timeout: Duration) -> Self {
        LauncherClient {
            socket: socket.into(),
            timeout,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<http::Response<hyper::body::Incoming>, ClientError> {
        let stream =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| ClientError::Connect {
                    socket: self.socket.clone(),
                    source,
                })?;
        let http_err = |source| ClientError::Http {
            socket: self.socket.clone(),
            path: path.to_owned(),
            source,
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(http_err)?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "launcher connection ended");
            }
        });
        let has_body = body.is_some();
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, "launcher");
        if has_body {
            req = req.header(http::header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .expect("static request parts");
        sender.send_request(req).await.map_err(http_err)
    }

    /// One call's status and whole body, bounded by the call timeout.
    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let work = async {
            let resp = self.send(method, path, body).await?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|source| ClientError::Http {
                    socket: self.socket.clone(),
                    path: path.to_owned(),
                    source,
                })?
                .to_bytes();
            Ok((status, bytes))
        };
        tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| ClientError::Timeout {
                socket: self.socket.clone(),
                path: path.to_owned(),
                timeout: self.timeout,
            })?
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ClientError> {
        let (status, bytes) = self.exchange(method, path, body).await?;
        self.decode(path, status, &bytes)
    }

    fn decode<T: DeserializeOwned>(
        &self,
        path: &str,
        status: StatusCode,
        bytes: &[u8],
    ) -> Result<T, ClientError> {
        let decode_err = |source| ClientError::Decode {
            socket: self.socket.clone(),
            path: path.to_owned(),
            source,
        };
        if status.is_success() {
            serde_json::from_slice(bytes).map_err(decode_err)
        } else {
            Err(self.api_error(path, status, bytes))
        }
    }

    fn api_error(&self, path: &str, status: StatusCode, bytes: &[u8]) -> ClientError {
        let error = serde_json::from_slice::<ApiError>(bytes).unwrap_or_else(|_| ApiError {
            code: status.canonical_reason().unwrap_or("Error").to_owned(),
            message: String::from_utf8_lossy(bytes).into_owned(),
        });
        ClientError::Api {
            socket: self.socket.clone(),
            path: path.to_owned(),
            status: status.as_u16(),
            error,
        }
    }

    pub async fn ping(&self) -> Result<(), ClientError> {
        self.call::<serde_json::Value>(Method::GET, "/v1/ping", None)
            .await
            .map(drop)
    }

    pub async fn info(&self) -> Result<Info, ClientError> {
        self.call(Method::GET, "/v1/info", None).await
    }

    pub async fn domain(&self) -> Result<Domain, ClientError> {
        self.call(Method::GET, "/v1/domain", None).await
    }

    /// Each disk's I/O counters (QMP `query-blockstats`).
    pub async fn blockstats(&self) -> Result<Vec<DiskStats>, ClientError> {
        self.call(Method::GET, "/v1/domain/blockstats", None).await
    }

    /// Starts the VMI if it does not run yet, else applies what may change (hotplug).
    pub async fn sync(&self, vmi: &api::VirtualMachineInstance) -> Result<Domain, ClientError> {
        let body = serde_json::to_vec(vmi).map_err(|source| ClientError::Decode {
            socket: self.socket.clone(),
            path: "/v1/sync".to_owned(),
            source,
        })?;
        self.call(Method::PUT, "/v1/sync", Some(body)).await
    }

    pub async fn pause(&self) -> Result<Domain, ClientError> {
        self.call(Method::POST, "/v1/pause", None).await
    }

    pub async fn unpause(&self) -> Result<Domain, ClientError> {
        self.call(Method::POST, "/v1/unpause", None).await
    }

    /// ACPI power button.
    pub async fn shutdown(&self) -> Result<Domain, ClientError> {
        self.call(Method::POST, "/v1/shutdown", None).await
    }

    pub async fn kill(&self) -> Result<Domain, ClientError> {
        self.call(Method::POST, "/v1/kill", None).await
    }

    pub async fn reset(&self) -> Result<Domain, ClientError> {
        self.call(Method::POST, "/v1/reset", None).await
    }

    pub async fn soft_reboot(&self) -> Result<Domain, ClientError> {
        self.call(Method::POST, "/v1/softreboot", None).await
    }

    pub async fn freeze(&self) -> Result<serde_json::Value, ClientError> {
        self.call(Method::POST, "/v1/freeze", None).await
    }

    pub async fn unfreeze(&self) -> Result<serde_json::Value, ClientError> {
        self.call(Method::POST, "/v1/unfreeze", None).await
    }

    pub async fn guest_info(&self) -> Result<QgaInfo, ClientError> {
        self.call(Method::GET, "/v1/guest/info", None).await
    }

    pub async fn guest_osinfo(&self) -> Result<QgaOsInfo, ClientError> {
        self.call(Method::GET, "/v1/guest/osinfo", None).await
    }

    pub async fn guest_interfaces(
        &self,
    ) -> Result<Vec<network::status::AgentInterface>, ClientError> {
        self.call(Method::GET, "/v1/guest/interfaces", None).await
    }

    pub async fn guest_users(&self) -> Result<Vec<QgaUser>, ClientError> {
        self.call(Method::GET, "/v1/guest/users", None).await
    }

    pub async fn guest_filesystems(&self) -> Result<Vec<QgaFilesystem>, ClientError> {
        self.call(Method::GET, "/v1/guest/filesystems", None).await
    }

    /// The guest's display as a PNG (QMP `screendump`).
    pub async fn screendump(&self) -> Result<Bytes, ClientError> {
        const PATH: &str = "/v1/screendump";
        match self.exchange(Method::GET, PATH, None).await? {
            (status, png) if status.is_success() => Ok(png),
            (status, body) => Err(self.api_error(PATH, status, &body)),
        }
    }

    /// The domain now, then every change; ends after a final state or when the launcher goes.
    /// Opening the watch is bounded by the call timeout; the stream itself is not.
    pub async fn watch(
        &self,
    ) -> Result<impl Stream<Item = Result<Domain, ClientError>> + Send + 'static, ClientError> {
        const PATH: &str = "/v1/domain/watch";
        let resp = tokio::time::timeout(self.timeout, self.send(Method::GET, PATH, None))
            .await
            .map_err(|_| ClientError::Timeout {
                socket: self.socket.clone(),
                path: PATH.to_owned(),
                timeout: self.timeout,
            })??;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map(http_body_util::Collected::to_bytes)
                .unwrap_or_default();
            return Err(self.api_error(PATH, status, &bytes));
        }
        let data = BodyStream::new(resp.into_body())
            .try_filter_map(|frame| async move { Ok(frame.into_data().ok()) })
            .map_err(std::io::Error::other);
        let lines = FramedRead::new(
            StreamReader::new(data),
            LinesCodec::new_with_max_length(MAX_WATCH_LINE),
        );
        let socket = self.socket.clone();
        Ok(lines.map(move |line| {
            let line = line.map_err(|source| ClientError::Watch {
                socket: socket.clone(),
                source,
            })?;
            serde_json::from_str(&line).map_err(|source| ClientError::Decode {
                socket: socket.clone(),
                path: PATH.to_owned(),
                source,
            })
        }))
    }
}
