//! The console server over real TLS on a real port: mTLS, certificate reload, REST errors,
//! websocket splicing to unix sockets, session replacement, oversized frames, stalled clients,
//! port-forward into a real network namespace, and (for `guest_`) a real launcher with a booted
//! guest.

mod common;
#[path = "../../network/tests/common/mod.rs"]
mod netfix;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use api::status::VirtualMachineInstanceConditionType as Cond;
use api::{VirtualMachineInstance, VirtualMachineInstancePhase as Phase};
use bytes::Bytes;
use common::{Ca, Leaf, write_atomically};
use futures::{SinkExt as _, StreamExt as _};
use handler::server::{self, Limits, LookupError, Target, Vmis};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use tlsconfig::{ClientAuth, ReloadingConfig, TlsFiles};
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpStream, UnixListener};
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

#[derive(Default)]
struct StaticVmis {
    here: HashMap<(String, String), Target>,
    elsewhere: HashMap<(String, String), String>,
}

impl Vmis for StaticVmis {
    fn lookup(&self, namespace: &str, name: &str) -> Result<Target, LookupError> {
        let key = (namespace.to_owned(), name.to_owned());
        if let Some(t) = self.here.get(&key) {
            return Ok(t.clone());
        }
        if let Some(node) = self.elsewhere.get(&key) {
            return Err(LookupError::OtherNode {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                node: node.clone(),
            });
        }
        Err(LookupError::NotFound {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

fn target(v: VirtualMachineInstance, dir: &Path) -> Target {
    Target {
        vmi: Arc::new(v),
        launcher_socket: dir.join("launcher-sock"),
        serial_socket: dir.join("virt-serial0"),
        vnc_socket: dir.join("virt-vnc"),
        launcher_pid: None,
    }
}

/// A unix socket that echoes whatever it reads, one task per connection.
fn echo_peer(path: &Path) -> tokio::task::JoinHandle<()> {
    let l = UnixListener::bind(path).expect("bind echo");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    })
}

/// A unix socket that writes as fast as it can (a console spewing output).
fn flood_peer(path: &Path) -> tokio::task::JoinHandle<()> {
    let l = UnixListener::bind(path).expect("bind flood");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let chunk = vec![b'x'; 64 * 1024];
                while s.write_all(&chunk).await.is_ok() {}
            });
        }
    })
}

struct Server {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    ca: Ca,
    client: Leaf,
    files: TlsFiles,
    stop: CancellationToken,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn start(vmis: StaticVmis, limits: Limits) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("handler test CA");
    let srv = ca.leaf(&["localhost"], "virt-handler");
    let client = ca.leaf(&[], "virt-api");
    let files = TlsFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
        client_ca: dir.path().join("ca.crt"),
        client_auth: ClientAuth::Required,
    };
    write_atomically(&files.cert, &srv.cert_pem);
    write_atomically(&files.key, &srv.key_pem);
    write_atomically(&files.client_ca, &ca.pem());
    let tls = Arc::new(ReloadingConfig::new(files.clone()).expect("tls config"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = CancellationToken::new();
    tokio::spawn(server::serve(
        listener,
        tls,
        server::router(Arc::new(vmis), limits),
        stop.clone(),
    ));
    Server {
        addr,
        _dir: dir,
        ca,
        client,
        files,
        stop,
    }
}

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

async fn connect(
    addr: SocketAddr,
    trust: &CertificateDer<'static>,
    me: Option<&Leaf>,
) -> std::io::Result<Tls> {
    connect_with(addr, trust, me, rustls::crypto::ring::default_provider()).await
}

async fn connect_with(
    addr: SocketAddr,
    trust: &CertificateDer<'static>,
    me: Option<&Leaf>,
    provider: rustls::crypto::CryptoProvider,
) -> std::io::Result<Tls> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trust.clone()).expect("root");
    let b = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let config = match me {
        Some(l) => b
            .with_client_auth_cert(vec![l.cert.clone()], l.key.clone_key())
            .expect("client cert"),
        None => b.with_no_client_auth(),
    };
    let tcp = TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
}

/// One HTTP/1.1 request; the status and JSON body, or the error that stopped it.
async fn request(tls: Tls, method: &str, path: &str) -> Result<(u16, serde_json::Value), String> {
    let (status, body) = request_bytes(tls, method, path).await?;
    let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Ok((status, json))
}

/// One HTTP/1.1 request; the status and raw body.
async fn request_bytes(tls: Tls, method: &str, path: &str) -> Result<(u16, Bytes), String> {
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .body(Empty::<Bytes>::new())
        .expect("request");
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body))
}

fn url(vmi: &str, what: &str) -> String {
    format!("/v1/namespaces/default/virtualmachineinstances/{vmi}/{what}")
}

impl Server {
    async fn call(&self, method: &str, vmi: &str, what: &str) -> (u16, serde_json::Value) {
        let tls = connect(self.addr, &self.ca.der(), Some(&self.client))
            .await
            .expect("connect");
        request(tls, method, &url(vmi, what))
            .await
            .expect("request")
    }

    async fn ws(
        &self,
        vmi: &str,
        what: &str,
        config: Option<WebSocketConfig>,
    ) -> tokio_tungstenite::WebSocketStream<Tls> {
        let (tls, req) = self.ws_request(vmi, what).await;
        let (ws, resp) = tokio_tungstenite::client_async_with_config(req, tls, config)
            .await
            .expect("websocket upgrade");
        assert_eq!(
            resp.headers()
                .get("sec-websocket-protocol")
                .and_then(|v| v.to_str().ok()),
            Some(server::SUBPROTOCOL)
        );
        ws
    }

    /// A fresh mTLS connection and the upgrade request for `what` of `vmi`.
    async fn ws_request(
        &self,
        vmi: &str,
        what: &str,
    ) -> (
        Tls,
        tokio_tungstenite::tungstenite::handshake::client::Request,
    ) {
        let tls = connect(self.addr, &self.ca.der(), Some(&self.client))
            .await
            .expect("connect");
        let mut req = format!("wss://localhost{}", url(vmi, what))
            .into_client_request()
            .expect("ws request");
        req.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            server::SUBPROTOCOL.parse().expect("header"),
        );
        (tls, req)
    }

    /// A websocket upgrade that may be refused: the HTTP status and body of a refusal.
    async fn try_ws(
        &self,
        vmi: &str,
        what: &str,
    ) -> Result<tokio_tungstenite::WebSocketStream<Tls>, (u16, String)> {
        let (tls, req) = self.ws_request(vmi, what).await;
        match tokio_tungstenite::client_async(req, tls).await {
            Ok((ws, _)) => Ok(ws),
            Err(WsError::Http(resp)) => Err((
                resp.status().as_u16(),
                resp.body()
                    .as_deref()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default(),
            )),
            Err(e) => panic!("websocket to {what}: {e}"),
        }
    }
}

async fn next_binary(ws: &mut tokio_tungstenite::WebSocketStream<Tls>) -> Vec<u8> {
    loop {
        match tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("a message in time")
        {
            Some(Ok(Message::Binary(b))) => return b.to_vec(),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            other => panic!("expected binary data, got {other:?}"),
        }
    }
}

async fn echo_roundtrip(ws: &mut tokio_tungstenite::WebSocketStream<Tls>, data: &[u8]) {
    ws.send(Message::Binary(Bytes::copy_from_slice(data)))
        .await
        .expect("send");
    let mut got = Vec::new();
    while got.len() < data.len() {
        got.extend(next_binary(ws).await);
    }
    assert_eq!(got, data);
}

struct Fixture {
    server: Server,
    _peers: Vec<tokio::task::JoinHandle<()>>,
    _dirs: Vec<tempfile::TempDir>,
}

async fn fixture(limits: Limits) -> Fixture {
    let mut vmis = StaticVmis::default();
    let mut dirs = Vec::new();
    let mut peers = Vec::new();
    let mut add = |name: &str, phase: Phase, conds: &[Cond]| -> PathBuf {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().to_owned();
        vmis.here.insert(
            ("default".into(), name.into()),
            target(
                common::vmi_with_conditions(name, &format!("uid-{name}"), phase, conds),
                &p,
            ),
        );
        dirs.push(d);
        p
    };
    let echo = add("echo", Phase::Running, &[]);
    peers.push(echo_peer(&echo.join("virt-serial0")));
    peers.push(echo_peer(&echo.join("virt-vnc")));
    let flood = add("flood", Phase::Running, &[]);
    peers.push(flood_peer(&flood.join("virt-serial0")));
    add("nolauncher", Phase::Running, &[Cond::AgentConnected]);
    add("paused", Phase::Running, &[Cond::Paused]);
    add("pending", Phase::Scheduled, &[]);
    vmis.elsewhere
        .insert(("default".into(), "remote".into()), "node-b".into());
    Fixture {
        server: start(vmis, limits).await,
        _peers: peers,
        _dirs: dirs,
    }
}

#[tokio::test]
async fn mtls_refuses_clients_without_a_valid_certificate() {
    let f = fixture(Limits::default()).await;
    let s = &f.server;
    let path = url("nothere", "guestosinfo");

    // No client certificate: the handshake or the first request fails.
    let refused = match connect(s.addr, &s.ca.der(), None).await {
        Err(_) => true,
        Ok(tls) => request(tls, "GET", &path).await.is_err(),
    };
    assert!(refused, "a client without a certificate got an answer");

    // A certificate from another CA: refused the same way.
    let rogue = Ca::new("rogue CA").leaf(&[], "intruder");
    let refused = match connect(s.addr, &s.ca.der(), Some(&rogue)).await {
        Err(_) => true,
        Ok(tls) => request(tls, "GET", &path).await.is_err(),
    };
    assert!(refused, "a client with a foreign certificate got an answer");

    // A valid one gets an answer (a 404 for this unknown VMI).
    let (status, body) = s.call("GET", "nothere", "guestosinfo").await;
    assert_eq!(status, 404, "{body}");
}

#[tokio::test]
async fn the_server_picks_aes_128_gcm_and_still_serves_chacha_only_clients() {
    use rustls::crypto::ring::cipher_suite as cs;
    let f = fixture(Limits::default()).await;
    let s = &f.server;
    let suite = |tls: &Tls| tls.get_ref().1.negotiated_cipher_suite().map(|c| c.suite());
    // rustls's own client puts AES-256-GCM first; the server's order wins.
    let tls = connect(s.addr, &s.ca.der(), Some(&s.client))
        .await
        .expect("connect");
    assert_eq!(suite(&tls), Some(cs::TLS13_AES_128_GCM_SHA256.suite()));
    let only = |c: rustls::SupportedCipherSuite| rustls::crypto::CryptoProvider {
        cipher_suites: vec![c],
        ..rustls::crypto::ring::default_provider()
    };
    for offered in [
        cs::TLS13_AES_256_GCM_SHA384,
        cs::TLS13_CHACHA20_POLY1305_SHA256,
    ] {
        let tls = connect_with(s.addr, &s.ca.der(), Some(&s.client), only(offered))
            .await
            .expect("connect");
        assert_eq!(suite(&tls), Some(offered.suite()));
        let (status, body) = request(tls, "GET", &url("nothere", "guestosinfo"))
            .await
            .expect("request");
        assert_eq!(status, 404, "{body}");
    }
}

#[tokio::test]
async fn certificate_files_are_reloaded_when_they_change() {
    let f = fixture(Limits::default()).await;
    let s = &f.server;
    // New server certificate from the same CA: new connections see it.
    let newer = s.ca.leaf(&["localhost"], "virt-handler-rotated");
    write_atomically(&s.files.key, &newer.key_pem);
    write_atomically(&s.files.cert, &newer.cert_pem);
    let tls = connect(s.addr, &s.ca.der(), Some(&s.client))
        .await
        .expect("connect");
    let peer = tls
        .get_ref()
        .1
        .peer_certificates()
        .expect("server certificate")[0]
        .clone();
    assert_eq!(peer, newer.cert, "the rotated certificate is served");

    // New client CA: the old CA's clients are refused, the new CA's accepted.
    let ca2 = Ca::new("rotated CA");
    write_atomically(&s.files.client_ca, &ca2.pem());
    let old_refused = match connect(s.addr, &s.ca.der(), Some(&s.client)).await {
        Err(_) => true,
        Ok(tls) => request(tls, "GET", &url("x", "userlist")).await.is_err(),
    };
    assert!(old_refused, "a client of the retired CA got an answer");
    let new_client = ca2.leaf(&[], "virt-api");
    let tls = connect(s.addr, &s.ca.der(), Some(&new_client))
        .await
        .expect("connect");
    let (status, _) = request(tls, "GET", &url("x", "userlist"))
        .await
        .expect("accepted");
    assert_eq!(status, 404);

    // A broken file keeps the previous config rather than taking the server down.
    std::fs::write(&s.files.client_ca, "not a certificate").expect("write");
    let tls = connect(s.addr, &s.ca.der(), Some(&new_client))
        .await
        .expect("connect");
    assert!(request(tls, "GET", &url("x", "userlist")).await.is_ok());
    drop(f);
}

#[tokio::test]
async fn rest_errors_say_what_is_wrong() {
    let f = fixture(Limits::default()).await;
    let s = &f.server;
    let cases = [
        ("GET", "nothere", "guestosinfo", 404, "not found"),
        ("PUT", "remote", "pause", 404, "node-b"),
        ("PUT", "pending", "pause", 409, "not running"),
        ("PUT", "paused", "pause", 409, "already paused"),
        ("PUT", "echo", "unpause", 409, "not paused"),
        ("GET", "echo", "guestosinfo", 503, "guest agent"),
        ("GET", "echo", "console", 400, "websocket upgrade"),
        // Running, agent connected, but no launcher behind the socket path.
        ("PUT", "nolauncher", "pause", 503, "launcher-sock"),
        ("GET", "nolauncher", "userlist", 503, "launcher-sock"),
        ("GET", "nolauncher", "vnc/screenshot", 503, "launcher-sock"),
        ("GET", "pending", "vnc/screenshot", 409, "not running"),
        ("GET", "echo", "nosuchthing", 400, "no such endpoint"),
        ("GET", "pending", "vnc", 409, "not running"),
    ];
    for (method, vmi, what, want, mentions) in cases {
        let (status, body) = s.call(method, vmi, what).await;
        assert_eq!(status, want, "{method} {vmi}/{what}: {body}");
        if !mentions.is_empty() {
            let msg = body["message"].as_str().unwrap_or_default();
            assert!(
                msg.contains(mentions),
                "{method} {vmi}/{what}: {msg:?} should mention {mentions:?}"
            );
            assert_eq!(body["code"], want);
        }
    }
}

#[tokio::test]
async fn console_and_vnc_are_spliced_to_the_unix_sockets() {
    let f = fixture(Limits::default()).await;
    let s = &f.server;
    let mut console = s.ws("echo", "console", None).await;
    echo_roundtrip(&mut console, b"hello console\r\n").await;
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    echo_roundtrip(&mut console, &big).await;
    let mut vnc = s.ws("echo", "vnc", None).await;
    echo_roundtrip(&mut vnc, b"RFB 003.008\n").await;
    // Both stay usable side by side: they are different streams.
    echo_roundtrip(&mut console, b"still here").await;
}

#[tokio::test]
async fn a_new_session_replaces_the_old_one() {
    let f = fixture(Limits::default()).await;
    let s = &f.server;
    let mut first = s.ws("echo", "console", None).await;
    echo_roundtrip(&mut first, b"one").await;
    let mut second = s.ws("echo", "console", None).await;
    let closed = tokio::time::timeout(WAIT, async {
        loop {
            match first.next().await {
                Some(Ok(Message::Close(frame))) => return frame.map(|f| u16::from(f.code)),
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return None,
            }
        }
    })
    .await
    .expect("the old session ends");
    assert_eq!(closed, Some(4000));
    echo_roundtrip(&mut second, b"two").await;
}

#[tokio::test]
async fn an_oversized_frame_ends_only_that_session() {
    let f = fixture(Limits {
        max_message: 64 * 1024,
        ..Limits::default()
    })
    .await;
    let s = &f.server;
    let mut other = s.ws("echo", "vnc", None).await;
    let mut ws = s.ws("echo", "console", None).await;
    let _ = ws
        .send(Message::Binary(Bytes::from(vec![0u8; 256 * 1024])))
        .await;
    let ended = tokio::time::timeout(WAIT, async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(frame))) => return frame.map(|f| u16::from(f.code)),
                Some(Ok(_)) => {}
                // The server may drop the connection outright.
                Some(Err(WsError::ConnectionClosed | WsError::AlreadyClosed | WsError::Io(_)))
                | None => {
                    return None;
                }
                Some(Err(e)) => panic!("unexpected client error {e}"),
            }
        }
    })
    .await
    .expect("the oversized session is ended");
    assert!(matches!(ended, None | Some(1009)), "{ended:?}");
    echo_roundtrip(&mut other, b"unaffected").await;
    let mut again = s.ws("echo", "console", None).await;
    echo_roundtrip(&mut again, b"a new session works").await;
}

#[tokio::test]
async fn a_client_that_never_reads_stalls_nobody_else() {
    let f = fixture(Limits::default()).await;
    let s = &f.server;
    // The flooding console fills this client's buffers; it never reads.
    let stalled = s
        .ws(
            "flood",
            "console",
            Some(WebSocketConfig::default().read_buffer_size(4096)),
        )
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..5 {
        let mut ws = s.ws("echo", "console", None).await;
        echo_roundtrip(&mut ws, format!("session {i}").as_bytes()).await;
        let (status, _) = s.call("GET", "echo", "guestosinfo").await;
        assert_eq!(status, 503);
    }
    // Replacing the stalled session works too, even though that client never reads its close.
    let mut fresh = s.ws("flood", "console", None).await;
    assert!(!next_binary(&mut fresh).await.is_empty());
    drop(stalled);
}

/// The whole path against a real launcher and guest: console banner and a typed command over
/// the websocket, pause / unpause through REST, guest-agent data in KubeVirt's shapes.
#[tokio::test]
async fn guest_console_rest_and_agent_through_the_server() {
    let launcher = common::Launcher::start(true);
    let uid = "33333333-3333-3333-3333-333333333333";
    let c = launcher_api::client::LauncherClient::new(&launcher.socket, Duration::from_mins(1));
    c.sync(&common::kernel_vmi("real", uid))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", launcher.log()));
    let running = |conds: &[Cond]| common::running_target(&launcher, "real", uid, conds);
    // The status the handler would have written: tests flip it through separate servers.
    let serve = |conds: &[Cond]| {
        let mut v = StaticVmis::default();
        v.here
            .insert(("default".into(), "real".into()), running(conds));
        start(v, Limits::default())
    };
    let s = serve(&[]).await;
    let mut console = s.ws("real", "console", None).await;
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + common::BOOT;
    while !String::from_utf8_lossy(&seen).contains("KUBEVIRT-RS-GUEST-READY") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no banner:\n{}",
            String::from_utf8_lossy(&seen)
        );
        if let Ok(Some(Ok(Message::Binary(b)))) =
            tokio::time::timeout(Duration::from_secs(5), console.next()).await
        {
            seen.extend_from_slice(&b);
        }
    }
    // A shell is on the console: type a command, read its output.
    seen.clear();
    let deadline = tokio::time::Instant::now() + common::BOOT;
    let mut last_typed = tokio::time::Instant::now() - Duration::from_mins(1);
    while !String::from_utf8_lossy(&seen).contains("HANDLER-ECHO-42") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no echo:\n{}",
            String::from_utf8_lossy(&seen)
        );
        if last_typed.elapsed() > Duration::from_secs(10) {
            console
                .send(Message::Binary(Bytes::from_static(
                    b"\recho HANDLER-ECHO-$((40+2))\r",
                )))
                .await
                .expect("type");
            last_typed = tokio::time::Instant::now();
        }
        if let Ok(Some(Ok(Message::Binary(b)))) =
            tokio::time::timeout(Duration::from_secs(2), console.next()).await
        {
            seen.extend_from_slice(&b);
        }
    }

    let mut vnc = s.ws("real", "vnc", None).await;
    let banner = next_binary(&mut vnc).await;
    assert!(
        banner.starts_with(b"RFB "),
        "{:?}",
        String::from_utf8_lossy(&banner)
    );

    // The display as a PNG: the signature, then the IHDR chunk with a real size.
    let tls = connect(s.addr, &s.ca.der(), Some(&s.client))
        .await
        .expect("connect");
    let (status, png) = request_bytes(tls, "GET", &url("real", "vnc/screenshot"))
        .await
        .expect("request");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&png));
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&png[12..16], b"IHDR");
    let width = u32::from_be_bytes(png[16..20].try_into().expect("4 bytes"));
    let height = u32::from_be_bytes(png[20..24].try_into().expect("4 bytes"));
    assert!(width >= 320 && height >= 200, "{width}x{height}");

    let (status, body) = s.call("PUT", "real", "pause").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        c.domain().await.expect("domain").state,
        launcher_api::domain::DomainState::Paused
    );
    let paused = serve(&[Cond::Paused]).await;
    let (status, body) = paused.call("PUT", "real", "unpause").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        c.domain().await.expect("domain").state,
        launcher_api::domain::DomainState::Running
    );

    let deadline = tokio::time::Instant::now() + common::BOOT;
    while !c.domain().await.expect("domain").agent_connected {
        assert!(
            tokio::time::Instant::now() < deadline,
            "agent never connected"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let with_agent = serve(&[Cond::AgentConnected]).await;
    let (status, info) = with_agent.call("GET", "real", "guestosinfo").await;
    assert_eq!(status, 200, "{info}");
    assert!(
        info["guestAgentVersion"]
            .as_str()
            .is_some_and(|v| !v.is_empty()),
        "{info}"
    );
    assert!(info["os"]["kernelRelease"].as_str().is_some(), "{info}");
    let (status, users) = with_agent.call("GET", "real", "userlist").await;
    assert_eq!(status, 200, "{users}");
    assert!(users["items"].is_array(), "{users}");
    let (status, fs) = with_agent.call("GET", "real", "filesystemlist").await;
    assert_eq!(status, 200, "{fs}");
    assert!(fs["items"].is_array(), "{fs}");
    let (status, body) = with_agent.call("PUT", "real", "freeze").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = with_agent.call("PUT", "real", "unfreeze").await;
    assert_eq!(status, 200, "{body}");
    drop((s, paused, with_agent));
}

/// A VMI with one interface on the pod network, bound `binding` (`masquerade`, `bridge`).
fn vmi_on_pod_network(name: &str, binding: &str, conds: &[Cond]) -> VirtualMachineInstance {
    let mut v = common::vmi_with_conditions(name, &format!("uid-{name}"), Phase::Running, conds);
    v.spec.domain.devices.interfaces = vec![
        serde_json::from_value(serde_json::json!({"name": "default", binding: {}}))
            .expect("interface"),
    ];
    v
}

/// A TCP listener on 127.0.0.1 inside `ns`: bound on a thread that entered the namespace (the
/// socket stays in it after the thread ends).
fn listen_in(ns: &netfix::Netns) -> std::net::TcpListener {
    use std::os::fd::AsFd as _;
    let f = ns.file();
    std::thread::spawn(move || {
        nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind in netns");
        l.set_nonblocking(true).expect("nonblocking");
        l
    })
    .join()
    .expect("listener thread")
}

/// Echoes every TCP connection of `l`; each connection's end (the peer closed) is reported.
fn tcp_echo(
    l: std::net::TcpListener,
    ended: tokio::sync::mpsc::UnboundedSender<()>,
) -> tokio::task::JoinHandle<()> {
    let l = tokio::net::TcpListener::from_std(l).expect("tokio listener");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let ended = ended.clone();
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = ended.send(());
            });
        }
    })
}

#[tokio::test]
async fn port_forward_connects_inside_the_pods_network_namespace() {
    let ns = netfix::Netns::new("pf");
    let listener = listen_in(&ns);
    let port = listener.local_addr().expect("addr").port();
    let (ended_tx, mut ended) = tokio::sync::mpsc::unbounded_channel();
    let _echo = tcp_echo(listener, ended_tx.clone());
    // The launcher stand-in: any process in the pod's network namespace.
    let launcher = ns.spawn({
        let mut c = std::process::Command::new("sleep");
        c.arg("1000");
        c
    });
    // The bridge case: the guest's address is reached from the handler's own network.
    let here = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .into_std()
        .expect("std listener");
    let here_port = here.local_addr().expect("addr").port();
    let _echo_here = tcp_echo(here, ended_tx);

    let dir = tempfile::tempdir().expect("tempdir");
    let mut vmis = StaticVmis::default();
    let mut add = |name: &str, v: VirtualMachineInstance, pid: Option<i32>| {
        let mut t = target(v, dir.path());
        t.launcher_pid = pid;
        vmis.here.insert(("default".into(), name.into()), t);
    };
    let pid = Some(launcher.pid());
    add("pf", vmi_on_pod_network("pf", "masquerade", &[]), pid);
    add(
        "pf-paused",
        vmi_on_pod_network("pf-paused", "masquerade", &[Cond::Paused]),
        pid,
    );
    add(
        "pf-nopid",
        vmi_on_pod_network("pf-nopid", "masquerade", &[]),
        None,
    );
    add(
        "pf-nonet",
        common::vmi_with_conditions("pf-nonet", "uid-nonet", Phase::Running, &[]),
        pid,
    );
    let mut bridged = vmi_on_pod_network("pf-bridge", "bridge", &[]);
    bridged.status.as_mut().expect("status").interfaces =
        vec![api::status::VirtualMachineInstanceNetworkInterface {
            name: Some("default".into()),
            ip: Some("127.0.0.1".into()),
            ..Default::default()
        }];
    add("pf-bridge", bridged, None);
    let s = start(vmis, Limits::default()).await;

    // Bytes round-trip, and two sessions live side by side.
    let path = format!("portforward/{port}/tcp");
    let mut one = s.ws("pf", &path, None).await;
    echo_roundtrip(&mut one, b"SSH-2.0-test\r\n").await;
    let mut two = s.ws("pf", &format!("portforward/{port}"), None).await;
    echo_roundtrip(&mut two, b"second").await;
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    echo_roundtrip(&mut one, &big).await;
    echo_roundtrip(&mut two, b"both still open").await;

    // A client that closes ends its TCP connection, not the other session.
    one.close(None).await.expect("close");
    tokio::time::timeout(WAIT, ended.recv())
        .await
        .expect("the TCP connection ends with its websocket")
        .expect("echo alive");
    echo_roundtrip(&mut two, b"after the first closed").await;

    // A closed port, a missing launcher, a VMI without a network are HTTP errors, not
    // websockets that close at once.
    let (status, body) = s
        .try_ws("pf", "portforward/1/tcp")
        .await
        .expect_err("refused");
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("127.0.0.1:1"), "{body}");
    let (status, body) = s.try_ws("pf-nopid", &path).await.expect_err("refused");
    assert_eq!(status, 503, "{body}");
    let (status, body) = s.try_ws("pf-nonet", &path).await.expect_err("refused");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("no network interfaces"), "{body}");
    let (status, body) = s.try_ws("pf-paused", &path).await.expect_err("refused");
    assert_eq!(status, 409, "{body}");
    let (status, body) = s.try_ws("nothere", &path).await.expect_err("refused");
    assert_eq!(status, 404, "{body}");

    // Only tcp, and only real ports.
    let cases = [
        (format!("portforward/{port}/udp"), 400, "udp"),
        (format!("portforward/{port}/sctp"), 400, "sctp"),
        ("portforward/0/tcp".to_owned(), 400, "\"0\""),
        ("portforward/70000/tcp".to_owned(), 400, "\"70000\""),
        ("portforward/ssh".to_owned(), 400, "\"ssh\""),
    ];
    for (what, want, needle) in cases {
        let (status, body) = s.call("GET", "pf", &what).await;
        assert_eq!(status, want, "{what}: {body}");
        assert!(
            body["message"].as_str().is_some_and(|m| m.contains(needle)),
            "{what}: {body}"
        );
        let (status, _) = s.try_ws("pf", &what).await.expect_err("refused");
        assert_eq!(status, want, "{what}");
    }

    // Bridge binding: the guest's address from the status, dialled from the handler's network.
    let mut bridge = s
        .ws("pf-bridge", &format!("portforward/{here_port}/tcp"), None)
        .await;
    echo_roundtrip(&mut bridge, b"bridged").await;
    echo_roundtrip(&mut two, b"and the pod one still works").await;
    drop(launcher);
}

#[tokio::test]
async fn port_forward_says_when_the_peer_closes() {
    let ns = netfix::Netns::new("pfc");
    let listener = tokio::net::TcpListener::from_std(listen_in(&ns)).expect("tokio listener");
    let port = listener.local_addr().expect("addr").port();
    // A service that greets and hangs up.
    let _peer = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s.write_all(b"bye\n").await;
        }
    });
    let launcher = ns.spawn({
        let mut c = std::process::Command::new("sleep");
        c.arg("1000");
        c
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let mut vmis = StaticVmis::default();
    let mut t = target(vmi_on_pod_network("pf", "masquerade", &[]), dir.path());
    t.launcher_pid = Some(launcher.pid());
    vmis.here.insert(("default".into(), "pf".into()), t);
    let s = start(vmis, Limits::default()).await;
    let mut ws = s.ws("pf", &format!("portforward/{port}/tcp"), None).await;
    assert_eq!(next_binary(&mut ws).await, b"bye\n");
    let end = tokio::time::timeout(WAIT, ws.next())
        .await
        .expect("the session ends in time");
    match end {
        Some(Ok(Message::Close(Some(f)))) => assert_eq!(u16::from(f.code), 1000),
        other => panic!("expected a normal close, got {other:?}"),
    }
}
