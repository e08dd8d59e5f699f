//! virt-handler's client of the command API: a typed call per [`Action`] and the domain watch as a
//! `Stream` of [`Domain`].
//!
//! One connection per call: the socket is local, connecting costs microseconds, and a fresh
//! connection means a launcher restart never leaves a stale pooled one behind.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt as _, TryStreamExt as _};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt as _, BodyStream, Full};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;
use tokio_util::codec::{FramedRead, LinesCodec};
use tokio_util::io::StreamReader;

use crate::action::{
    Action, Body, CancelMigration, FinishMigration, Freeze, Frozen, GetBlockStats, GetDomain,
    GetInfo, GuestExec, GuestFilesystems, GuestHostName, GuestInfo, GuestInterfaces, GuestOsInfo,
    GuestPing, GuestTimezone, GuestUsers, Kill, Migrate, Pause, Ping, PrepareTarget, Reset,
    Screendump, Shutdown, SoftReboot, SyncVmi, Thawed, Unfreeze, Unpause, WatchDomain,
};
use crate::domain::{ApiError, DiskStats, Domain, Info};
use crate::guest::{
    AgentInterface, GuestExecRequest, GuestExecResult, GuestPingRequest, QgaFilesystem,
    QgaHostName, QgaInfo, QgaOsInfo, QgaTimezone, QgaUser,
};

/// A domain line longer than this is not a domain.
const MAX_WATCH_LINE: usize = 4 * 1024 * 1024;

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

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<http::Response<hyper::body::Incoming>, ClientError> {
        let connect_err = |source| ClientError::Connect {
            socket: self.socket.clone(),
            source,
        };
        // The socket's name is the launcher pod's: a link it planted there must not lead
        // virt-handler to another process's socket.
        let resolved = isolation::open_socket(&self.socket).map_err(|e| match e {
            isolation::IsolationError::Connect { source, .. } => connect_err(source),
            e => connect_err(std::io::Error::other(e)),
        })?;
        let stream = UnixStream::connect(resolved.proc_fd_path())
            .await
            .map_err(connect_err)?;
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

    /// One JSON action: its request encoded as both ends encode it, its answer decoded.
    async fn call<A: Action>(&self, request: &A::Request) -> Result<A::Response, ClientError>
    where
        A::Response: DeserializeOwned,
    {
        let body = request.encode().map_err(|source| ClientError::Decode {
            socket: self.socket.clone(),
            path: A::PATH.to_owned(),
            source,
        })?;
        let (status, bytes) = self.exchange(A::METHOD, A::PATH, body).await?;
        self.decode(A::PATH, status, &bytes)
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
        self.call::<Ping>(&()).await.map(drop)
    }

    pub async fn info(&self) -> Result<Info, ClientError> {
        self.call::<GetInfo>(&()).await
    }

    pub async fn domain(&self) -> Result<Domain, ClientError> {
        self.call::<GetDomain>(&()).await
    }

    /// Each disk's I/O counters (QMP `query-blockstats`).
    pub async fn blockstats(&self) -> Result<Vec<DiskStats>, ClientError> {
        self.call::<GetBlockStats>(&()).await
    }

    /// Starts the VMI if it does not run yet, else applies what may change (hotplug).
    pub async fn sync(&self, vmi: &api::VirtualMachineInstance) -> Result<Domain, ClientError> {
        self.call::<SyncVmi>(vmi).await
    }

    /// Starts the VMI as a migration target.
    pub async fn prepare_target(
        &self,
        req: &crate::migration::TargetRequest,
    ) -> Result<Domain, ClientError> {
        self.call::<PrepareTarget>(req).await
    }

    /// Starts sending the VMI to a prepared target.
    pub async fn migrate(
        &self,
        req: &crate::migration::MigrateRequest,
    ) -> Result<Domain, ClientError> {
        self.call::<Migrate>(req).await
    }

    pub async fn cancel_migration(&self) -> Result<Domain, ClientError> {
        self.call::<CancelMigration>(&()).await
    }

    /// Resumes the guest on the target once the source has completed.
    pub async fn finish_migration(&self) -> Result<Domain, ClientError> {
        self.call::<FinishMigration>(&()).await
    }

    pub async fn pause(&self) -> Result<Domain, ClientError> {
        self.call::<Pause>(&()).await
    }

    pub async fn unpause(&self) -> Result<Domain, ClientError> {
        self.call::<Unpause>(&()).await
    }

    /// ACPI power button.
    pub async fn shutdown(&self) -> Result<Domain, ClientError> {
        self.call::<Shutdown>(&()).await
    }

    pub async fn kill(&self) -> Result<Domain, ClientError> {
        self.call::<Kill>(&()).await
    }

    pub async fn reset(&self) -> Result<Domain, ClientError> {
        self.call::<Reset>(&()).await
    }

    pub async fn soft_reboot(&self) -> Result<Domain, ClientError> {
        self.call::<SoftReboot>(&()).await
    }

    pub async fn freeze(&self) -> Result<Frozen, ClientError> {
        self.call::<Freeze>(&()).await
    }

    pub async fn unfreeze(&self) -> Result<Thawed, ClientError> {
        self.call::<Unfreeze>(&()).await
    }

    pub async fn guest_info(&self) -> Result<QgaInfo, ClientError> {
        self.call::<GuestInfo>(&()).await
    }

    pub async fn guest_osinfo(&self) -> Result<QgaOsInfo, ClientError> {
        self.call::<GuestOsInfo>(&()).await
    }

    pub async fn guest_host_name(&self) -> Result<QgaHostName, ClientError> {
        self.call::<GuestHostName>(&()).await
    }

    pub async fn guest_timezone(&self) -> Result<QgaTimezone, ClientError> {
        self.call::<GuestTimezone>(&()).await
    }

    pub async fn guest_interfaces(&self) -> Result<Vec<AgentInterface>, ClientError> {
        self.call::<GuestInterfaces>(&()).await
    }

    /// `guest-ping` through the launcher (virt-probe's `--guestAgentPing`).
    pub async fn guest_ping(&self, req: &GuestPingRequest) -> Result<(), ClientError> {
        self.call::<GuestPing>(req).await.map(drop)
    }

    /// A command run in the guest by its agent (virt-probe's exec probes).
    pub async fn guest_exec(&self, req: &GuestExecRequest) -> Result<GuestExecResult, ClientError> {
        self.call::<GuestExec>(req).await
    }

    pub async fn guest_users(&self) -> Result<Vec<QgaUser>, ClientError> {
        self.call::<GuestUsers>(&()).await
    }

    pub async fn guest_filesystems(&self) -> Result<Vec<QgaFilesystem>, ClientError> {
        self.call::<GuestFilesystems>(&()).await
    }

    /// The guest's display as a PNG (QMP `screendump`).
    pub async fn screendump(&self) -> Result<Bytes, ClientError> {
        match self
            .exchange(Screendump::METHOD, Screendump::PATH, None)
            .await?
        {
            (status, png) if status.is_success() => Ok(png),
            (status, body) => Err(self.api_error(Screendump::PATH, status, &body)),
        }
    }

    /// The domain now, then every change; ends after a final state or when the launcher goes.
    /// Opening the watch is bounded by the call timeout; the stream itself is not.
    pub async fn watch(
        &self,
    ) -> Result<impl Stream<Item = Result<Domain, ClientError>> + Send + 'static, ClientError> {
        const PATH: &str = WatchDomain::PATH;
        let resp = tokio::time::timeout(self.timeout, self.send(WatchDomain::METHOD, PATH, None))
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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::UnixListener;

    use super::*;

    /// A launcher that answers every request with `reply`: the faults a real launcher does not
    /// make (a body that is not its error shape, an answer in the wrong shape).
    fn answering(reply: &'static str) -> (tempfile::TempDir, LauncherClient) {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("launcher-sock");
        let listener = UnixListener::bind(&socket).expect("bind");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(reply.as_bytes()).await;
            }
        });
        (dir, LauncherClient::new(socket, Duration::from_secs(5)))
    }

    #[tokio::test]
    async fn an_error_that_is_not_json_keeps_its_status_and_text() {
        let (_dir, c) = answering(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 5\r\nconnection: close\r\n\r\noops!",
        );
        match c.pause().await.expect_err("refused") {
            ClientError::Api {
                path,
                status,
                error,
                ..
            } => {
                assert_eq!((path.as_str(), status), (Pause::PATH, 500));
                assert_eq!(error.code, "Internal Server Error");
                assert_eq!(error.message, "oops!");
            }
            other => panic!("expected an API error, got {other}"),
        }
    }

    #[tokio::test]
    async fn a_socket_replaced_by_a_link_out_of_its_directory_is_not_followed() {
        // Another process's socket, which answers.
        let (_elsewhere, other) = answering(
            "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 5\r\nconnection: close\r\n\r\nother",
        );
        let reached = other.pause().await.expect_err("a 500");
        assert!(matches!(&reached, ClientError::Api { .. }), "{reached}");
        let pod = tempfile::tempdir().expect("tempdir");
        let planted = pod.path().join("launcher-sock");
        std::os::unix::fs::symlink(&other.socket, &planted).expect("symlink");
        let e = LauncherClient::new(&planted, Duration::from_secs(5))
            .pause()
            .await
            .expect_err("the link is not followed");
        assert!(matches!(&e, ClientError::Connect { .. }), "{e}");
        assert!(e.is_unreachable(), "{e}");
    }

    #[tokio::test]
    async fn an_answer_in_another_shape_names_the_action() {
        let (_dir, c) = answering(
            "HTTP/1.1 200 OK\r\ncontent-length: 12\r\nconnection: close\r\n\r\n{\"nope\": 1}\n",
        );
        let e = c.info().await.expect_err("not an Info");
        assert!(
            matches!(&e, ClientError::Decode { path, .. } if path == GetInfo::PATH),
            "{e}"
        );
        assert!(!e.is_unreachable());
    }
}
