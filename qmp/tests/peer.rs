//! Faults QEMU will not produce on demand, against a scripted peer on a unix socket: unknown
//! events, garbage lines, replies after the timeout, disconnects mid-command, missing greetings.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::init_tracing;
use qmp::qapi::qmp as cmd;
use qmp::{ConnectOptions, QmpClient};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};

const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": "Debian 1:7.2+dfsg-7"}, "capabilities": ["oob"]}}"#;

/// The peer side of one connection: read commands, write whatever the test scripts.
struct Peer {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Peer {
    /// Read the next command; returns (name, id).
    async fn command(&mut self) -> (String, Value) {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).await.unwrap();
        assert!(n > 0, "client closed the connection");
        let value: Value = serde_json::from_str(&line).unwrap();
        (
            value["execute"].as_str().unwrap().to_owned(),
            value["id"].clone(),
        )
    }

    async fn send(&mut self, line: &str) {
        self.writer.write_all(line.as_bytes()).await.unwrap();
        self.writer.write_all(b"\n").await.unwrap();
    }

    async fn reply(&mut self, id: &Value, ret: Value) {
        self.send(&json!({"return": ret, "id": id}).to_string())
            .await;
    }

    /// Greet and accept `qmp_capabilities`.
    async fn negotiate(&mut self) {
        self.send(GREETING).await;
        let (name, id) = self.command().await;
        assert_eq!(name, "qmp_capabilities");
        self.reply(&id, json!({})).await;
    }
}

/// A listening socket in a temp dir; `accept` gives the next connection's peer.
struct Listener {
    _dir: tempfile::TempDir,
    path: PathBuf,
    socket: UnixListener,
}

impl Listener {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("peer.sock");
        let listener = UnixListener::bind(&path).unwrap();
        Self {
            _dir: dir,
            path,
            socket: listener,
        }
    }

    async fn accept(&self) -> Peer {
        let (stream, _) = self.socket.accept().await.unwrap();
        let (r, w) = stream.into_split();
        Peer {
            reader: BufReader::new(r),
            writer: w,
        }
    }
}

const FAST: ConnectOptions = ConnectOptions {
    connect_timeout: Duration::from_secs(5),
    command_timeout: Duration::from_secs(5),
    event_capacity: 16,
};

async fn connected(listener: &Listener) -> (QmpClient, Peer) {
    let (client, peer) = tokio::join!(QmpClient::connect(&listener.path, &FAST), async {
        let mut peer = listener.accept().await;
        peer.negotiate().await;
        peer
    });
    (client.unwrap(), peer)
}

#[tokio::test]
async fn greeting_exposes_version_and_capabilities() {
    init_tracing();
    let listener = Listener::new();
    let (client, _peer) = connected(&listener).await;
    assert_eq!(
        client.version(),
        &qmp::QemuVersion {
            major: 7,
            minor: 2,
            micro: 0,
            package: "Debian 1:7.2+dfsg-7".into()
        }
    );
    assert!(client.version() < &qmp::QemuVersion::new(8, 0, 0));
    assert_eq!(client.greeting().capabilities, vec!["oob".to_owned()]);
}

#[tokio::test]
async fn unknown_events_and_garbage_lines_are_skipped() {
    init_tracing();
    let listener = Listener::new();
    let (client, mut peer) = connected(&listener).await;
    let mut events = client.events();
    let status = tokio::spawn({
        let client = client.clone();
        async move { client.execute(cmd::query_status {}).await }
    });
    let (name, id) = peer.command().await;
    assert_eq!(name, "query-status");
    peer.send("this is not json").await;
    peer.send("[1, 2, 3]").await;
    peer.send(r#"{"neither": "reply nor event"}"#).await;
    peer.send(r#"{"event": "FROM_THE_FUTURE", "data": {"x": 1}, "timestamp": {"seconds": 1, "microseconds": 2}}"#).await;
    // A known event with a field the schema does not know, and one with a missing field.
    peer.send(r#"{"event": "STOP", "data": {"new-field": true}, "timestamp": {"seconds": 3, "microseconds": 4}}"#).await;
    peer.send(r#"{"event": "DEVICE_DELETED", "data": {}, "timestamp": {"seconds": 5, "microseconds": 6}}"#).await;
    peer.reply(&id, json!({"running": true, "status": "running"}))
        .await;
    let status = status.await.unwrap().unwrap();
    assert_eq!(status.status, cmd::RunState::running);

    let future = events.recv().await.unwrap();
    assert_eq!(future.name, "FROM_THE_FUTURE");
    assert_eq!(future.data, json!({"x": 1}));
    assert!(future.typed().is_none());
    let stop = events.recv().await.unwrap();
    assert!(matches!(stop.typed(), Some(cmd::Event::STOP { .. })));
    let deleted = events.recv().await.unwrap();
    assert_eq!(deleted.name, "DEVICE_DELETED");
    assert!(!client.is_closed());
}

#[tokio::test]
async fn a_reply_after_the_timeout_is_discarded_and_the_next_call_works() {
    init_tracing();
    let listener = Listener::new();
    let (client, mut peer) = connected(&listener).await;
    let slow = client.execute_with_timeout(cmd::query_status {}, Duration::from_millis(100));
    let (slow, (name, slow_id)) = tokio::join!(slow, peer.command());
    assert_eq!(name, "query-status");
    let err = slow.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(err.to_string().contains("query-status"), "{err}");

    let next = tokio::spawn({
        let client = client.clone();
        async move { client.execute(cmd::query_name {}).await }
    });
    let (name, id) = peer.command().await;
    assert_eq!(name, "query-name");
    assert_ne!(id, slow_id);
    // The late reply first: it must not be taken for the second call's answer.
    peer.reply(&slow_id, json!({"running": false, "status": "paused"}))
        .await;
    peer.reply(&id, json!({"name": "vm0"})).await;
    assert_eq!(next.await.unwrap().unwrap().name.as_deref(), Some("vm0"));
}

#[tokio::test]
async fn replies_are_routed_by_id_out_of_order() {
    init_tracing();
    let listener = Listener::new();
    let (client, mut peer) = connected(&listener).await;
    let a = tokio::spawn({
        let client = client.clone();
        async move { client.execute_raw("a", Value::Null).await }
    });
    let (_, id_a) = peer.command().await;
    let b = tokio::spawn({
        let client = client.clone();
        async move { client.execute_raw("b", Value::Null).await }
    });
    let (_, id_b) = peer.command().await;
    peer.reply(&id_b, json!("for b")).await;
    peer.reply(&id_a, json!("for a")).await;
    assert_eq!(a.await.unwrap().unwrap(), json!("for a"));
    assert_eq!(b.await.unwrap().unwrap(), json!("for b"));
}

#[tokio::test]
async fn disconnect_mid_command_fails_waiters_ends_events_and_resolves_closed() {
    init_tracing();
    let listener = Listener::new();
    let (client, mut peer) = connected(&listener).await;
    let mut events = client.events();
    let pending = tokio::spawn({
        let client = client.clone();
        async move { client.execute(cmd::query_status {}).await }
    });
    peer.command().await;
    drop(peer);
    let err = pending.await.unwrap().unwrap_err();
    assert!(err.is_disconnected(), "{err}");
    tokio::time::timeout(Duration::from_secs(5), client.closed())
        .await
        .unwrap();
    assert_eq!(events.recv().await, Err(qmp::RecvError::Closed));
    assert_eq!(client.events().recv().await, Err(qmp::RecvError::Closed));
    let err = client.execute(cmd::query_status {}).await.unwrap_err();
    assert!(err.is_disconnected(), "{err}");
}

#[tokio::test]
async fn undecodable_reply_is_a_decode_error_not_a_dead_connection() {
    init_tracing();
    let listener = Listener::new();
    let (client, mut peer) = connected(&listener).await;
    let call = tokio::spawn({
        let client = client.clone();
        async move { client.execute(cmd::query_status {}).await }
    });
    let (_, id) = peer.command().await;
    peer.reply(&id, json!({"status": "a-state-from-the-future"}))
        .await;
    let err = call.await.unwrap().unwrap_err();
    assert!(matches!(err, qmp::Error::Decode { .. }), "{err}");
    let call = tokio::spawn({
        let client = client.clone();
        async move { client.execute(cmd::query_status {}).await }
    });
    let (_, id) = peer.command().await;
    peer.reply(&id, json!({"running": true, "status": "running"}))
        .await;
    call.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_peer_that_never_greets_times_out() {
    init_tracing();
    let listener = Listener::new();
    let options = ConnectOptions {
        connect_timeout: Duration::from_millis(300),
        ..FAST
    };
    let (client, _peer) = tokio::join!(
        QmpClient::connect(&listener.path, &options),
        listener.accept()
    );
    let err = client.unwrap_err();
    assert!(matches!(err, qmp::Error::GreetingTimeout { .. }), "{err}");
}

#[tokio::test]
async fn a_wrong_greeting_is_rejected_with_the_line() {
    init_tracing();
    let listener = Listener::new();
    let (client, ()) = tokio::join!(QmpClient::connect(&listener.path, &FAST), async {
        let mut peer = listener.accept().await;
        peer.send(r#"{"hello": "world"}"#).await;
        // Keep the connection open until the client decided.
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    let err = client.unwrap_err();
    assert!(matches!(err, qmp::Error::Greeting { .. }), "{err}");
    assert!(err.to_string().contains("hello"), "{err}");
}

#[tokio::test]
async fn a_peer_that_closes_before_greeting_is_an_error() {
    init_tracing();
    let listener = Listener::new();
    let (client, ()) = tokio::join!(QmpClient::connect(&listener.path, &FAST), async {
        drop(listener.accept().await);
    });
    let err = client.unwrap_err();
    assert!(matches!(err, qmp::Error::Greeting { .. }), "{err}");
}

#[tokio::test]
async fn dropping_the_last_client_closes_the_socket() {
    init_tracing();
    let listener = Listener::new();
    let (client, mut peer) = connected(&listener).await;
    drop(client);
    let mut line = String::new();
    let n = tokio::time::timeout(Duration::from_secs(5), peer.reader.read_line(&mut line))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 0, "expected end of stream, got {line:?}");
}

#[tokio::test]
async fn from_stream_works_on_a_socketpair() {
    init_tracing();
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (r, w) = theirs.into_split();
    let mut peer = Peer {
        reader: BufReader::new(r),
        writer: w,
    };
    let (client, ()) = tokio::join!(
        QmpClient::from_stream(ours, "socketpair", &FAST),
        peer.negotiate()
    );
    let client = client.unwrap();
    assert_eq!(client.socket(), std::path::Path::new("socketpair"));
}

#[tokio::test]
async fn commands_larger_than_the_socket_buffer_stay_whole_and_in_order() {
    init_tracing();
    let listener = Listener::new();
    let (client, mut peer) = connected(&listener).await;
    let blob = "x".repeat(4 << 20);
    let big = tokio::spawn({
        let client = client.clone();
        let blob = blob.clone();
        async move { client.execute_raw("big", json!({ "blob": blob })).await }
    });
    // Let the big one fill the socket buffer before the small one is sent.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let small = tokio::spawn({
        let client = client.clone();
        async move { client.execute_raw("small", Value::Null).await }
    });
    let mut line = String::new();
    peer.reader.read_line(&mut line).await.unwrap();
    let first: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(first["execute"], "big");
    assert_eq!(
        first["arguments"]["blob"].as_str().unwrap().len(),
        blob.len()
    );
    let (name, small_id) = peer.command().await;
    assert_eq!(name, "small");
    peer.reply(&first["id"], json!(1)).await;
    peer.reply(&small_id, json!(2)).await;
    assert_eq!(big.await.unwrap().unwrap(), json!(1));
    assert_eq!(small.await.unwrap().unwrap(), json!(2));
}
