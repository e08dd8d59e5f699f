//! The console server (`--console-server-port`, 8186): mTLS, KubeVirt's routes under
//! `/v1/namespaces/{namespace}/virtualmachineinstances/{name}/`, serial console and VNC as
//! websockets spliced to the launcher's unix sockets, lifecycle and guest-agent calls relayed to
//! the launcher.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use bytes::{Bytes, BytesMut};
use futures::{SinkExt as _, StreamExt as _};
use http::StatusCode;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use launcher_api::client::LauncherClient;
use serde::Serialize;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::guestinfo;
use crate::rest::{self, Action, Refusal};
use tlsconfig::ReloadingConfig;

/// KubeVirt's websocket subprotocol for console and VNC streams.
pub const SUBPROTOCOL: &str = "plain.kubevirt.io";
const CLOSE_REPLACED: u16 = 4000;
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// The most read from a console socket at once, sent as one websocket frame. A read returns
/// what is there, so a typed key still goes out alone and at once; a flood goes out in frames
/// this large, which costs few frames, flushes and TLS writes per MiB.
const READ_CHUNK: usize = 256 * 1024;
/// The websocket's read buffer. Clients send keystrokes and VNC input events, so this need
/// not be large: a bigger client message is read in several calls. It stays small because
/// tungstenite zero-fills it on every read attempt, and the read half is woken (and tries a
/// read) on every readiness event of the connection, writes included: at its default of
/// 128 KiB that was up to a 128 KiB memset per console frame sent. 16 KiB is one TLS record,
/// about the most a read of the TLS stream returns anyway (rustls decrypts a record at a time).
const WS_READ_BUFFER: usize = 16 * 1024;

/// A VMI on this node and where its launcher's sockets are, as the handler sees them (through
/// the pod's mount root in production).
#[derive(Debug, Clone)]
pub struct Target {
    pub vmi: Arc<api::VirtualMachineInstance>,
    pub launcher_socket: PathBuf,
    pub serial_socket: PathBuf,
    pub vnc_socket: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("VMI {namespace}/{name} not found")]
    NotFound { namespace: String, name: String },
    #[error("VMI {namespace}/{name} runs on node {node}, not on this one")]
    OtherNode {
        namespace: String,
        name: String,
        node: String,
    },
}

/// The handler's view of the VMIs on its node (the informer store in production).
pub trait Vmis: Send + Sync + 'static {
    fn lookup(&self, namespace: &str, name: &str) -> Result<Target, LookupError>;
}

/// Settings of the console server.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest websocket message (and frame) a client may send.
    pub max_message: usize,
    /// Bound of each launcher call.
    pub launcher_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_message: 1024 * 1024,
            launcher_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Stream {
    Serial,
    Vnc,
}

/// One live session per VMI and stream; a new one cancels the old.
#[derive(Default, Debug)]
struct Sessions {
    next: AtomicU64,
    live: Mutex<HashMap<(String, Stream), (u64, CancellationToken)>>,
}

impl Sessions {
    fn begin(&self, uid: &str, stream: Stream) -> (u64, CancellationToken) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let token = CancellationToken::new();
        let old = self
            .live
            .lock()
            .expect("sessions lock poisoned")
            .insert((uid.to_owned(), stream), (id, token.clone()));
        if let Some((_, old)) = old {
            old.cancel();
        }
        (id, token)
    }

    fn end(&self, uid: &str, stream: Stream, id: u64) {
        let mut live = self.live.lock().expect("sessions lock poisoned");
        let key = (uid.to_owned(), stream);
        if live.get(&key).is_some_and(|(i, _)| *i == id) {
            live.remove(&key);
        }
    }
}

struct AppState {
    vmis: Arc<dyn Vmis>,
    limits: Limits,
    sessions: Sessions,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: u16,
    message: &'a str,
}

struct Reply(Refusal);

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        let r = self.0;
        tracing::debug!(status = %r.status, message = %r.message, "request refused");
        let body = ErrorBody {
            code: r.status.as_u16(),
            message: &r.message,
        };
        (r.status, axum::Json(body)).into_response()
    }
}

impl From<Refusal> for Reply {
    fn from(r: Refusal) -> Self {
        Reply(r)
    }
}

impl From<launcher_api::client::ClientError> for Reply {
    fn from(e: launcher_api::client::ClientError) -> Self {
        Reply(rest::from_client(&e))
    }
}

type Vmi = Path<(String, String)>;

fn target(s: &AppState, (ns, name): &(String, String), action: Action) -> Result<Target, Reply> {
    let t = s
        .vmis
        .lookup(ns, name)
        .map_err(|e| Refusal::new(StatusCode::NOT_FOUND, e.to_string()))?;
    rest::check(&t.vmi, action)?;
    Ok(t)
}

fn client(s: &AppState, t: &Target) -> LauncherClient {
    LauncherClient::new(&t.launcher_socket, s.limits.launcher_timeout)
}

/// The router, for serving over TLS with [`serve`] (or in-process in tests).
pub fn router(vmis: Arc<dyn Vmis>, limits: Limits) -> Router {
    let state = Arc::new(AppState {
        vmis,
        limits,
        sessions: Sessions::default(),
    });
    let lifecycle = |action: Action| {
        put(
            move |State(s): State<Arc<AppState>>, Path(vmi): Vmi| async move {
                let t = target(&s, &vmi, action)?;
                let c = client(&s, &t);
                match action {
                    Action::Pause => c.pause().await.map(drop),
                    Action::Unpause => c.unpause().await.map(drop),
                    Action::SoftReboot => c.soft_reboot().await.map(drop),
                    Action::Reset => c.reset().await.map(drop),
                    Action::Freeze => c.freeze().await.map(drop),
                    _ => c.unfreeze().await.map(drop),
                }?;
                Ok::<_, Reply>(StatusCode::OK)
            },
        )
    };
    Router::new()
        .nest(
            "/v1/namespaces/{namespace}/virtualmachineinstances/{name}",
            Router::new()
                .route("/console", get(console))
                .route("/vnc", get(vnc))
                .route("/vnc/screenshot", get(screenshot))
                .route("/pause", lifecycle(Action::Pause))
                .route("/unpause", lifecycle(Action::Unpause))
                .route("/softreboot", lifecycle(Action::SoftReboot))
                .route("/reset", lifecycle(Action::Reset))
                .route("/freeze", lifecycle(Action::Freeze))
                .route("/unfreeze", lifecycle(Action::Unfreeze))
                .route("/guestosinfo", get(guest_os_info))
                .route("/userlist", get(user_list))
                .route("/filesystemlist", get(filesystem_list)),
        )
        .fallback(|| async {
            Reply(Refusal::new(
                StatusCode::BAD_REQUEST,
                "no such endpoint: expected /v1/namespaces/{namespace}/virtualmachineinstances/{name}/<console|vnc|vnc/screenshot|pause|unpause|softreboot|reset|freeze|unfreeze|guestosinfo|userlist|filesystemlist>",
            ))
        })
        .with_state(state)
}

async fn guest_os_info(
    State(s): State<Arc<AppState>>,
    Path(vmi): Vmi,
) -> Result<axum::Json<guestinfo::GuestAgentInfo>, Reply> {
    let t = target(&s, &vmi, Action::GuestOsInfo)?;
    let c = client(&s, &t);
    let (info, os, users, fs) = tokio::try_join!(
        c.guest_info(),
        c.guest_osinfo(),
        c.guest_users(),
        c.guest_filesystems()
    )?;
    let freeze = t
        .vmi
        .status
        .as_ref()
        .and_then(|s| s.fs_freeze_status.clone());
    Ok(axum::Json(guestinfo::agent_info(
        info, os, users, fs, freeze,
    )))
}

async fn user_list(
    State(s): State<Arc<AppState>>,
    Path(vmi): Vmi,
) -> Result<axum::Json<guestinfo::GuestOsUserList>, Reply> {
    let t = target(&s, &vmi, Action::UserList)?;
    Ok(axum::Json(guestinfo::user_list(
        client(&s, &t).guest_users().await?,
    )))
}

async fn filesystem_list(
    State(s): State<Arc<AppState>>,
    Path(vmi): Vmi,
) -> Result<axum::Json<guestinfo::FileSystemList>, Reply> {
    let t = target(&s, &vmi, Action::FilesystemList)?;
    Ok(axum::Json(guestinfo::filesystem_list(
        client(&s, &t).guest_filesystems().await?,
    )))
}

async fn console(
    State(s): State<Arc<AppState>>,
    Path(vmi): Vmi,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, Reply> {
    let t = target(&s, &vmi, Action::Console)?;
    stream(s, &t, Stream::Serial, ws)
}

async fn vnc(
    State(s): State<Arc<AppState>>,
    Path(vmi): Vmi,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, Reply> {
    let t = target(&s, &vmi, Action::Vnc)?;
    stream(s, &t, Stream::Vnc, ws)
}

async fn screenshot(State(s): State<Arc<AppState>>, Path(vmi): Vmi) -> Result<Response, Reply> {
    let t = target(&s, &vmi, Action::Screenshot)?;
    let png = client(&s, &t).screendump().await?;
    Ok(([(http::header::CONTENT_TYPE, "image/png")], png).into_response())
}

/// Connects to a launcher's socket. A path under `/proc/<pid>/root/` is resolved inside that
/// root: the pod's absolute symlinks (a Debian root's `/var/run -> /run`) mean the pod's `/`,
/// which the kernel's plain walk of `/proc/<pid>/root` would take as the handler's. The socket
/// is then reached through the resolved descriptor's `/proc/self/fd` name.
fn connect_in_root(path: &std::path::Path) -> std::io::Result<UnixStream> {
    let pod = path.strip_prefix("/proc").ok().and_then(|rest| {
        let mut c = rest.components();
        let pid = c.next()?.as_os_str().to_str()?.parse::<u32>().ok()?;
        (c.next()?.as_os_str() == "root").then(|| (pid, c.as_path().to_owned()))
    });
    let stream = match pod {
        Some((pid, inside)) => {
            let root =
                isolation::MountRoot::open(std::path::Path::new(&format!("/proc/{pid}/root")))
                    .map_err(std::io::Error::other)?;
            let socket = root
                .resolve(&inside, isolation::Resolve::InRoot)
                .map_err(std::io::Error::other)?;
            std::os::unix::net::UnixStream::connect(socket.proc_fd_path())?
        }
        None => std::os::unix::net::UnixStream::connect(path)?,
    };
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

/// Connects to the unix socket before upgrading, so a missing socket is a 503 rather than a
/// websocket that closes at once.
fn stream(
    s: Arc<AppState>,
    t: &Target,
    which: Stream,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, Reply> {
    // Checked after the VMI so that a wrong VMI or state gets its 404 / 409 either way.
    let ws = ws.map_err(|e| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("a websocket upgrade (subprotocol {SUBPROTOCOL}) is required: {e}"),
        )
    })?;
    let path = match which {
        Stream::Serial => &t.serial_socket,
        Stream::Vnc => &t.vnc_socket,
    };
    let unix = connect_in_root(path).map_err(|e| {
        Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot connect to {}: {e}", path.display()),
        )
    })?;
    let uid = t.vmi.metadata.uid.clone().unwrap_or_default();
    let max = s.limits.max_message;
    Ok(ws
        .protocols([SUBPROTOCOL])
        .max_message_size(max)
        .max_frame_size(max)
        .read_buffer_size(WS_READ_BUFFER)
        .on_upgrade(move |socket| async move {
            let (id, cancel) = s.sessions.begin(&uid, which);
            splice(socket, unix, cancel).await;
            s.sessions.end(&uid, which, id);
        }))
}

/// Copies bytes both ways until either side ends, an error, or a newer session cancels this
/// one. Each session is its own task, so a client that stops reading only stalls itself.
async fn splice(ws: WebSocket, unix: UnixStream, cancel: CancellationToken) {
    let (mut ws_tx, mut ws_rx) = ws.split();
    let (mut unix_rx, mut unix_tx) = unix.into_split();
    let to_unix = async {
        while let Some(msg) = ws_rx.next().await {
            let data = match msg {
                Ok(Message::Binary(b)) => b,
                Ok(Message::Text(t)) => Bytes::from(t.as_str().as_bytes().to_vec()),
                Ok(Message::Close(_)) => return "client closed".to_owned(),
                Ok(_) => continue,
                Err(e) => return format!("client stream: {e}"),
            };
            if let Err(e) = unix_tx.write_all(&data).await {
                return format!("unix socket write: {e}");
            }
        }
        "client gone".to_owned()
    };
    let from_unix = async {
        let mut buf = BytesMut::new();
        loop {
            // Frames share one allocation until little of it is left (a typed key takes one
            // byte of it, not a buffer of its own).
            if buf.capacity() < READ_CHUNK / 4 {
                buf.reserve(READ_CHUNK);
            }
            match unix_rx.read_buf(&mut buf).await {
                Ok(0) => return "unix socket closed".to_owned(),
                Ok(_) => {
                    // The frame takes the bytes as read: no copy into a message.
                    let out = Message::Binary(buf.split().freeze());
                    if let Err(e) = ws_tx.send(out).await {
                        return format!("client write: {e}");
                    }
                }
                Err(e) => return format!("unix socket read: {e}"),
            }
        }
    };
    let replaced = tokio::select! {
        () = cancel.cancelled() => true,
        why = to_unix => { tracing::debug!(%why, "session ended"); false }
        why = from_unix => { tracing::debug!(%why, "session ended"); false }
    };
    if replaced {
        let close = Message::Close(Some(CloseFrame {
            code: CLOSE_REPLACED,
            reason: "replaced by a newer session".into(),
        }));
        // A client that does not read would block the close: give it a moment, then drop.
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, ws_tx.send(close)).await;
    }
}

/// Accepts TLS connections on `listener` until `shutdown`, each with the config current at
/// accept time (so rotated certificates apply to new connections).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ReloadingConfig>,
    app: Router,
    shutdown: CancellationToken,
) {
    loop {
        let (tcp, peer) = tokio::select! {
            () = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        // A console is interactive: a typed key's echo is a small write that must not wait for
        // the ACK of the previous one (Nagle), which with delayed ACKs costs up to 40 ms. Bulk
        // output goes in frames of up to READ_CHUNK, full segments either way.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.get());
        let app = app.clone();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::info!(%peer, error = %e, "TLS handshake refused");
                    return;
                }
                Err(_) => {
                    tracing::info!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = TowerToHyperService::new(app);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), service)
                .with_upgrades()
                .await
            {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}
