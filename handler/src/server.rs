//! The console server (`--console-server-port`, 8186): mTLS, KubeVirt's routes under
//! `/v1/namespaces/{namespace}/virtualmachineinstances/{name}/`, serial console and VNC as
//! websockets spliced to the launcher's unix sockets, port-forward as a websocket spliced to a
//! TCP connection to the guest, lifecycle and guest-agent calls relayed to the launcher.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api::vmi::InterfaceBinding;
use axum::Router;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use bytes::{Bytes, BytesMut};
use futures::{SinkExt as _, StreamExt as _};
use http::StatusCode;
use launcher_api::client::LauncherClient;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::guestinfo;
use crate::rest::{self, Action, Refusal};
use tlsconfig::ReloadingConfig;

/// KubeVirt's websocket subprotocol for console and VNC streams.
pub const SUBPROTOCOL: &str = "plain.kubevirt.io";
const CLOSE_REPLACED: u16 = 4000;
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
/// How long a port-forward waits for the guest's port to accept the connection.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// A VMI on this node and where its launcher's sockets are, as the handler sees them (through
/// the pod's mount root in production).
#[derive(Debug, Clone)]
pub struct Target {
    pub vmi: Arc<api::VirtualMachineInstance>,
    pub launcher_socket: PathBuf,
    pub serial_socket: PathBuf,
    pub vnc_socket: PathBuf,
    /// The launcher's pid in the handler's pid namespace, when known: port-forward connects
    /// from inside its network namespace.
    pub launcher_pid: Option<i32>,
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
                .route("/filesystemlist", get(filesystem_list))
                .route("/portforward/{port}", get(port_forward))
                .route("/portforward/{port}/{protocol}", get(port_forward)),
        )
        .fallback(|| async {
            Reply(Refusal::new(
                StatusCode::BAD_REQUEST,
                "no such endpoint: expected /v1/namespaces/{namespace}/virtualmachineinstances/{name}/<console|vnc|vnc/screenshot|pause|unpause|softreboot|reset|freeze|unfreeze|guestosinfo|userlist|filesystemlist|portforward/{port}[/{protocol}]>",
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
    let (info, host, timezone, os, users, fs) = tokio::try_join!(
        c.guest_info(),
        c.guest_host_name(),
        c.guest_timezone(),
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
        info, host, timezone, os, users, fs, freeze,
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
    let ws = upgrade(ws)?;
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
    Ok(
        configure(ws, &s.limits).on_upgrade(move |socket| async move {
            let (id, cancel) = s.sessions.begin(&uid, which);
            let (rx, tx) = unix.into_split();
            splice(socket, rx, tx, cancel).await;
            s.sessions.end(&uid, which, id);
        }),
    )
}

/// The websocket upgrade a stream needs, or 400.
fn upgrade(
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<WebSocketUpgrade, Refusal> {
    ws.map_err(|e| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("a websocket upgrade (subprotocol {SUBPROTOCOL}) is required: {e}"),
        )
    })
}

/// KubeVirt's subprotocol and our frame limits on an upgrade.
fn configure(ws: WebSocketUpgrade, limits: &Limits) -> WebSocketUpgrade {
    ws.protocols([SUBPROTOCOL])
        .max_message_size(limits.max_message)
        .max_frame_size(limits.max_message)
        .read_buffer_size(WS_READ_BUFFER)
}

/// `portforward/{port}[/{protocol}]`'s path parameters.
#[derive(Deserialize)]
struct Forward {
    namespace: String,
    name: String,
    port: String,
    protocol: Option<String>,
}

/// A port-forward port: 1 to 65535.
fn forward_port(port: &str) -> Result<u16, Refusal> {
    port.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("invalid port {port:?}: expected a number from 1 to 65535"),
        )
    })
}

/// The protocol of a port-forward (tcp when absent): only tcp is served.
fn forward_protocol(protocol: Option<&str>) -> Result<(), Refusal> {
    match protocol {
        None | Some("tcp") => Ok(()),
        Some("udp") => Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "port-forward over udp is not supported by this virt-handler: only tcp",
        )),
        Some(other) => Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("unknown port-forward protocol {other:?}: expected tcp"),
        )),
    }
}

/// KubeVirt's `virtctl port-forward`: a websocket spliced to a TCP connection to a port of the
/// guest. The connection is made before upgrading, so a refused port is an HTTP error rather
/// than a websocket that closes at once. Sessions are independent: any number may be open.
async fn port_forward(
    State(s): State<Arc<AppState>>,
    Path(f): Path<Forward>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, Reply> {
    let port = forward_port(&f.port)?;
    forward_protocol(f.protocol.as_deref())?;
    let t = target(&s, &(f.namespace, f.name), Action::PortForward)?;
    let ws = upgrade(ws)?;
    let tcp = dial(&t, port).await?;
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on a port-forward");
    }
    Ok(
        configure(ws, &s.limits).on_upgrade(move |socket| async move {
            let (rx, tx) = tcp.into_split();
            // Never cancelled: a port-forward is not replaced by the next one.
            splice(socket, rx, tx, CancellationToken::new()).await;
        }),
    )
}

/// Connects to `port` of the guest, where KubeVirt's virt-api reaches it (the VMI's first
/// interface's address) but from the handler's side of the pod: behind masquerade, the pod's
/// localhost inside its network namespace, which the masquerade rules DNAT to the guest for the
/// same ports as the pod's address (the declared `ports`, or all but the reserved ones); with a
/// bridge binding the guest holds the pod's address and the pod itself has no route to it, so
/// the guest's address from `status.interfaces`, from the handler's own network.
async fn dial(t: &Target, port: u16) -> Result<TcpStream, Refusal> {
    let name = t.vmi.metadata.name.as_deref().unwrap_or_default();
    let iface = t
        .vmi
        .spec
        .domain
        .devices
        .interfaces
        .first()
        .ok_or_else(|| {
            Refusal::new(
                StatusCode::BAD_REQUEST,
                format!("VMI {name}: no network interfaces are present"),
            )
        })?;
    match iface.binding_method() {
        Some(InterfaceBinding::Masquerade) => {
            let pid = t.launcher_pid.ok_or_else(|| {
                Refusal::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("VMI {name}: its virt-launcher is not known yet"),
                )
            })?;
            let tcp = tokio::task::spawn_blocking(move || dial_in_pod(pid, port))
                .await
                .map_err(|e| Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
            tcp.set_nonblocking(true)
                .and_then(|()| TcpStream::from_std(tcp))
                .map_err(|e| Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
        }
        Some(InterfaceBinding::Bridge) => {
            let ip = t
                .vmi
                .status
                .as_ref()
                .and_then(|s| {
                    s.interfaces
                        .iter()
                        .find(|i| i.name.as_deref() == Some(iface.name.as_str()))
                })
                .and_then(|i| i.ip.as_deref())
                .and_then(|ip| ip.parse::<IpAddr>().ok())
                .ok_or_else(|| {
                    Refusal::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "VMI {name}: the guest's address on interface {} is not known yet",
                            iface.name
                        ),
                    )
                })?;
            let addr = SocketAddr::new(ip, port);
            match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(addr)).await {
                Ok(r) => r.map_err(|e| dial_refusal(name, addr, &e)),
                Err(_) => Err(dial_refusal(
                    name,
                    addr,
                    &std::io::Error::from(std::io::ErrorKind::TimedOut),
                )),
            }
        }
        _ => Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            format!(
                "VMI {name}: port-forward needs a masquerade or bridge binding on interface {}",
                iface.name
            ),
        )),
    }
}

/// Connects to `127.0.0.1:port` inside the network namespace of `pid`. The socket is created
/// on a thread that has entered the namespace and keeps it when handed back.
fn dial_in_pod(pid: i32, port: u16) -> Result<std::net::TcpStream, Refusal> {
    let unavailable = |e: isolation::IsolationError| {
        Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("cannot enter the network namespace of virt-launcher (pid {pid}): {e}"),
        )
    };
    let pod = isolation::detect_from_pid(pid).map_err(unavailable)?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    pod.run_in_namespace(isolation::NsKind::Net, move || {
        std::net::TcpStream::connect_timeout(&addr, DIAL_TIMEOUT)
    })
    .map_err(unavailable)?
    .map_err(|e| dial_refusal(&format!("pid {pid}"), addr, &e))
}

/// A failed connect to the guest: 504 when it timed out, 502 otherwise (refused, unreachable).
fn dial_refusal(what: &str, addr: SocketAddr, e: &std::io::Error) -> Refusal {
    let status = if e.kind() == std::io::ErrorKind::TimedOut {
        StatusCode::GATEWAY_TIMEOUT
    } else {
        StatusCode::BAD_GATEWAY
    };
    Refusal::new(status, format!("dialing {addr} for {what}: {e}"))
}

/// Copies bytes both ways between a websocket and a byte stream (a launcher's unix socket, a
/// TCP connection to the guest) until either side ends, an error, or `cancel` (a newer session
/// replaced this one). Each session is its own task, so a client that stops reading only
/// stalls itself.
async fn splice<R, W>(ws: WebSocket, mut peer_rx: R, mut peer_tx: W, cancel: CancellationToken)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (mut ws_tx, mut ws_rx) = ws.split();
    let to_peer = async {
        while let Some(msg) = ws_rx.next().await {
            let data = match msg {
                Ok(Message::Binary(b)) => b,
                Ok(Message::Text(t)) => Bytes::from(t.as_str().as_bytes().to_vec()),
                Ok(Message::Close(_)) => return "client closed".to_owned(),
                Ok(_) => continue,
                Err(e) => return format!("client stream: {e}"),
            };
            if let Err(e) = peer_tx.write_all(&data).await {
                return format!("peer write: {e}");
            }
        }
        "client gone".to_owned()
    };
    let from_peer = async {
        let mut buf = BytesMut::new();
        loop {
            // Frames share one allocation until little of it is left (a typed key takes one
            // byte of it, not a buffer of its own).
            if buf.capacity() < READ_CHUNK / 4 {
                buf.reserve(READ_CHUNK);
            }
            match peer_rx.read_buf(&mut buf).await {
                Ok(0) => return None,
                Ok(_) => {
                    // The frame takes the bytes as read: no copy into a message.
                    let out = Message::Binary(buf.split().freeze());
                    if let Err(e) = ws_tx.send(out).await {
                        return Some(format!("client write: {e}"));
                    }
                }
                Err(e) => return Some(format!("peer read: {e}")),
            }
        }
    };
    let close = tokio::select! {
        () = cancel.cancelled() => Some(CloseFrame {
            code: CLOSE_REPLACED,
            reason: "replaced by a newer session".into(),
        }),
        why = to_peer => { tracing::debug!(%why, "session ended"); None }
        why = from_peer => match why {
            // The peer closed: say so, as a normal closure.
            None => {
                tracing::debug!("session ended: peer closed");
                Some(CloseFrame { code: 1000, reason: "closed".into() })
            }
            Some(why) => { tracing::debug!(%why, "session ended"); None }
        },
    };
    if let Some(close) = close {
        // A client that does not read would block the close: give it a moment, then drop.
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, ws_tx.send(Message::Close(Some(close)))).await;
    }
}

/// Accepts TLS connections on `listener` until `shutdown` (`tlsconfig::serve_https`).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ReloadingConfig>,
    app: Router,
    shutdown: CancellationToken,
) {
    tlsconfig::serve_https(listener, tls, move |_| app.clone(), shutdown).await;
}
