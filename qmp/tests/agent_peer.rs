//! Guest-agent faults against a scripted agent on a unix socket: stale replies, replies after
//! the timeout, disconnects, guest-shutdown's missing reply.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::init_tracing;
use qmp::{AgentOptions, GuestAgent};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

struct Agent {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Agent {
    /// The next command (leading 0xFF parser resets stripped): (name, arguments).
    async fn command(&mut self) -> (String, Value) {
        let mut line = Vec::new();
        let n = self.reader.read_until(b'\n', &mut line).await.unwrap();
        assert!(n > 0, "client closed the connection");
        let start = line.iter().position(|b| *b != 0xFF).unwrap();
        let value: Value = serde_json::from_slice(&line[start..]).unwrap();
        (
            value["execute"].as_str().unwrap().to_owned(),
            value.get("arguments").cloned().unwrap_or(Value::Null),
        )
    }

    async fn raw(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).await.unwrap();
    }

    async fn reply(&mut self, ret: Value) {
        self.raw(format!("{}\n", json!({ "return": ret })).as_bytes())
            .await;
    }

    /// Expect `guest-sync-delimited` and answer it as qemu-ga does (0xFF, then the reply).
    async fn sync(&mut self) -> Value {
        let (name, args) = self.command().await;
        assert_eq!(name, "guest-sync-delimited");
        let id = args["id"].clone();
        self.raw(&[0xFF]).await;
        self.reply(id.clone()).await;
        id
    }
}

struct Socket {
    _dir: tempfile::TempDir,
    path: PathBuf,
    listener: UnixListener,
}

impl Socket {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qga.sock");
        let listener = UnixListener::bind(&path).unwrap();
        Self {
            _dir: dir,
            path,
            listener,
        }
    }

    async fn accept(&self) -> Agent {
        let (stream, _) = self.listener.accept().await.unwrap();
        let (r, w) = stream.into_split();
        Agent {
            reader: BufReader::new(r),
            writer: w,
        }
    }

    fn client(&self) -> GuestAgent {
        GuestAgent::new(
            &self.path,
            AgentOptions {
                connect_timeout: Duration::from_secs(2),
                command_timeout: Duration::from_secs(5),
                shutdown_grace: Duration::from_millis(300),
            },
        )
    }
}

#[tokio::test]
async fn syncs_first_and_discards_stale_output() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let call = tokio::spawn(async move { agent.host_name().await });
    let mut peer = socket.accept().await;
    // Leftovers from an earlier host connection, before the sync's delimiter.
    peer.raw(b"{\"return\": {\"host-name\": \"stale\"}}\n{\"return\": 42}\ngarbage")
        .await;
    // A stale sync reply with another id, then the real one.
    let (name, args) = peer.command().await;
    assert_eq!(name, "guest-sync-delimited");
    peer.raw(&[0xFF]).await;
    peer.reply(json!(12345)).await;
    peer.raw(&[0xFF]).await;
    peer.reply(args["id"].clone()).await;
    let (name, _) = peer.command().await;
    assert_eq!(name, "guest-get-host-name");
    peer.reply(json!({"host-name": "guest0"})).await;
    assert_eq!(call.await.unwrap().unwrap(), "guest0");
}

#[tokio::test]
async fn sync_ids_are_fresh() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let calls = tokio::spawn({
        let agent = agent.clone();
        async move {
            agent.sync(Duration::from_secs(5)).await.unwrap();
            agent.sync(Duration::from_secs(5)).await.unwrap();
        }
    });
    let mut peer = socket.accept().await;
    let first = peer.sync().await;
    let second = peer.sync().await;
    calls.await.unwrap();
    assert_ne!(first, second);
    assert!(first.as_i64().unwrap() > 0);
}

#[tokio::test]
async fn a_timed_out_call_forces_a_resync_and_its_late_reply_is_dropped() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let slow = tokio::spawn({
        let agent = agent.clone();
        async move {
            agent
                .execute_with_timeout(
                    qmp::qapi::qga::guest_get_time {},
                    Duration::from_millis(200),
                )
                .await
        }
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    let (name, _) = peer.command().await;
    assert_eq!(name, "guest-get-time");
    let err = slow.await.unwrap().unwrap_err();
    assert!(err.is_timeout(), "{err}");

    let next = tokio::spawn({
        let agent = agent.clone();
        async move { agent.time().await }
    });
    // The late reply arrives while the client resyncs; it must be skipped.
    peer.reply(json!(1)).await;
    peer.sync().await;
    let (name, _) = peer.command().await;
    assert_eq!(name, "guest-get-time");
    peer.reply(json!(2)).await;
    assert_eq!(next.await.unwrap().unwrap(), 2);
}

#[tokio::test]
async fn reconnects_after_the_agent_disconnects() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let call = tokio::spawn({
        let agent = agent.clone();
        async move { agent.time().await }
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    peer.command().await;
    drop(peer);
    let err = call.await.unwrap().unwrap_err();
    assert!(err.is_disconnected(), "{err}");

    let call = tokio::spawn({
        let agent = agent.clone();
        async move { agent.time().await }
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    peer.command().await;
    peer.reply(json!(7)).await;
    assert_eq!(call.await.unwrap().unwrap(), 7);
}

#[tokio::test]
async fn command_errors_keep_the_channel() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let calls = tokio::spawn({
        let agent = agent.clone();
        async move { (agent.fsfreeze_freeze().await, agent.time().await) }
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    peer.command().await;
    peer.raw(b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"freeze failed\"}}\n")
        .await;
    // No resync in between: the error was a complete exchange.
    let (name, _) = peer.command().await;
    assert_eq!(name, "guest-get-time");
    peer.reply(json!(3)).await;
    let (freeze, time) = calls.await.unwrap();
    let err = freeze.unwrap_err();
    assert_eq!(err.command_class(), Some("GenericError"));
    assert!(err.to_string().contains("freeze failed"), "{err}");
    assert_eq!(time.unwrap(), 3);
}

#[tokio::test]
async fn shutdown_without_reply_is_success() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let call = tokio::spawn({
        let agent = agent.clone();
        async move {
            agent
                .shutdown(Some(qmp::qapi::qga::GuestShutdownMode::Powerdown))
                .await
        }
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    let (name, args) = peer.command().await;
    assert_eq!(name, "guest-shutdown");
    assert_eq!(args, json!({"mode": "powerdown"}));
    // The agent answers the follow-up sync, not the shutdown.
    peer.sync().await;
    call.await.unwrap().unwrap();
}

#[tokio::test]
async fn shutdown_with_silence_is_success() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let call = tokio::spawn({
        let agent = agent.clone();
        async move { agent.shutdown(None).await }
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    peer.command().await;
    call.await.unwrap().unwrap();
}

#[tokio::test]
async fn shutdown_error_is_reported() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let call = tokio::spawn({
        let agent = agent.clone();
        async move { agent.shutdown(None).await }
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    peer.command().await;
    peer.raw(b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"child process has failed to shutdown\"}}\n")
        .await;
    let err = call.await.unwrap().unwrap_err();
    assert!(err.to_string().contains("failed to shutdown"), "{err}");
}

#[tokio::test]
async fn no_agent_socket_is_a_connect_error_naming_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let agent = GuestAgent::new(
        dir.path().join("absent.sock"),
        AgentOptions {
            connect_timeout: Duration::from_millis(100),
            ..AgentOptions::default()
        },
    );
    let err = agent.time().await.unwrap_err();
    assert!(err.to_string().contains("absent.sock"), "{err}");
}

#[tokio::test]
async fn exec_captures_output_and_polls_until_the_command_exits() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let call = tokio::spawn(async move {
        agent
            .exec(
                "/bin/cat",
                &["/etc/hostname".into()],
                Duration::from_secs(5),
            )
            .await
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    let (name, args) = peer.command().await;
    assert_eq!(name, "guest-exec");
    assert_eq!(
        args,
        json!({"path": "/bin/cat", "arg": ["/etc/hostname"], "capture-output": true})
    );
    peer.reply(json!({"pid": 42})).await;
    let (name, args) = peer.command().await;
    assert_eq!(
        (name.as_str(), args),
        ("guest-exec-status", json!({"pid": 42}))
    );
    peer.reply(json!({"exited": false})).await;
    peer.command().await;
    peer.reply(json!({"exited": true, "exitcode": 3, "out-data": "Z3Vlc3QwCg=="}))
        .await;
    let status = call.await.unwrap().unwrap();
    assert_eq!(status.exitcode, Some(3));
    assert_eq!(status.out_data.as_deref(), Some(&b"guest0\n"[..]));
}

#[tokio::test]
async fn exec_of_a_command_that_does_not_exit_in_time_names_it() {
    init_tracing();
    let socket = Socket::new();
    let agent = socket.client();
    let call = tokio::spawn(async move {
        agent
            .exec("/bin/sleep", &["60".into()], Duration::from_millis(300))
            .await
    });
    let mut peer = socket.accept().await;
    peer.sync().await;
    peer.command().await;
    peer.reply(json!({"pid": 9})).await;
    let answering = tokio::spawn(async move {
        loop {
            let (name, _) = peer.command().await;
            assert_eq!(name, "guest-exec-status");
            peer.reply(json!({"exited": false})).await;
        }
    });
    let err = call.await.unwrap().unwrap_err();
    answering.abort();
    assert!(
        matches!(&err, qmp::Error::ExecTimeout { pid: 9, path, .. } if path == "/bin/sleep"),
        "{err}"
    );
}
