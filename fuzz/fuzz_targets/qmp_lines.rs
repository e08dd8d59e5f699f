//! The QMP and guest-agent clients against a peer that says anything: the first byte picks
//! the protocol, the rest is what QEMU (after a valid greeting) or qemu-ga (after the sync
//! request, with `$ID` standing for the sync id) writes before closing.
//!
//! QMP: three calls wait while the peer writes; each must end (no hang), with exactly what the
//! first reply line carrying its id said, or as disconnected when no line did; the event
//! stream ends. Guest agent: calls end, and a success returns a value some line returned.
#![no_main]

use std::time::Duration;

use kubevirt_rs_fuzz::runtime;
use libfuzzer_sys::fuzz_target;
use qmp::{AgentOptions, ConnectOptions, Error, GuestAgent, QmpClient, RecvError};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

const GREETING: &[u8] = b"{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 0, \"minor\": 2, \
    \"major\": 7}, \"package\": \"\"}, \"capabilities\": [\"oob\"]}}\n";
const CALLS: usize = 3;
const TIMEOUT: Duration = Duration::from_secs(10);

fuzz_target!(|data: &[u8]| {
    let Some((&mode, script)) = data.split_first() else {
        return;
    };
    runtime().block_on(async {
        let run = async {
            if mode & 1 == 0 {
                qmp(script).await;
            } else {
                agent(script).await;
            }
        };
        tokio::time::timeout(TIMEOUT, run)
            .await
            .expect("a client hung on this input");
    });
});

/// The JSON objects among the script's pieces, split at `delimiters`.
fn objects(script: &[u8], delimiters: &[u8]) -> Vec<serde_json::Map<String, Value>> {
    script
        .split(|b| delimiters.contains(b))
        .filter_map(|piece| serde_json::from_slice(piece).ok())
        .collect()
}

/// What QEMU answered call `id`: the first line that is a reply (`return`, else `error`) with
/// that id; `None` when no line is.
fn answer(lines: &[serde_json::Map<String, Value>], id: u64) -> Option<Result<Value, ()>> {
    lines
        .iter()
        .filter(|l| !l.contains_key("QMP") && l.get("id").and_then(Value::as_u64) == Some(id))
        .find_map(|l| match (l.get("return"), l.contains_key("error")) {
            (Some(v), _) => Some(Ok(v.clone())),
            (None, true) => Some(Err(())),
            (None, false) => None,
        })
}

async fn qmp(script: &[u8]) {
    let (client_end, peer) = UnixStream::pair().expect("a socket pair");
    let sent = script.to_vec();
    let peer = tokio::spawn(async move {
        let (read, mut write) = peer.into_split();
        let mut read = BufReader::new(read);
        write.write_all(GREETING).await.expect("greeting");
        let mut line = String::new();
        read.read_line(&mut line).await.expect("qmp_capabilities");
        write
            .write_all(b"{\"return\": {}, \"id\": 1}\n")
            .await
            .expect("capabilities reply");
        // The calls' ids in the order of their commands' names.
        let mut ids = [0u64; CALLS];
        for _ in 0..CALLS {
            line.clear();
            read.read_line(&mut line).await.expect("a call");
            let call: Value = serde_json::from_str(&line).expect("a JSON command");
            let name = call["execute"].as_str().expect("a command name");
            let index: usize = name.trim_start_matches("call-").parse().expect("call-N");
            ids[index] = call["id"].as_u64().expect("an id");
        }
        write.write_all(&sent).await.expect("the script");
        write.shutdown().await.expect("shutdown");
        // Reading on until the client hangs up, so it never writes to a closed socket.
        let _ = read.read_to_end(&mut Vec::new()).await;
        ids
    });
    let options = ConnectOptions {
        connect_timeout: TIMEOUT,
        command_timeout: TIMEOUT,
        event_capacity: 4,
    };
    let client = QmpClient::from_stream(client_end, "fuzz", &options)
        .await
        .expect("the handshake");
    let mut events = client.events();
    let (a, b, c) = tokio::join!(
        client.execute_raw("call-0", Value::Null),
        client.execute_raw("call-1", Value::Null),
        client.execute_raw("call-2", Value::Null),
    );
    client.closed().await;
    while !matches!(events.recv().await, Err(RecvError::Closed)) {}
    drop(client);
    let ids = peer.await.expect("the peer");
    let lines = objects(script, b"\n");
    for (id, got) in ids.into_iter().zip([a, b, c]) {
        match (answer(&lines, id), got) {
            (Some(Ok(want)), Ok(got)) => assert_eq!(got, want, "call {id} got another's reply"),
            (Some(Err(())), Err(Error::Command { .. }))
            | (None, Err(Error::Disconnected { .. })) => {}
            (want, got) => panic!("call {id}: expected {want:?}, got {got:?}"),
        }
    }
}

async fn agent(script: &[u8]) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("qga.sock");
    let listener = UnixListener::bind(&socket).expect("a listener");
    let script = script.to_vec();
    let sent = script.clone();
    let peer = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("the agent connects");
        let (read, mut write) = stream.into_split();
        let mut read = BufReader::new(read);
        let mut sync = Vec::new();
        read.read_until(b'\n', &mut sync).await.expect("the sync");
        let sync: Value = serde_json::from_slice(sync.strip_prefix(&[0xff]).unwrap_or(&sync))
            .expect("a JSON sync request");
        let id = sync["arguments"]["id"].to_string();
        let script = replace(&script, b"$ID", id.as_bytes());
        write.write_all(&script).await.expect("the script");
        write.shutdown().await.expect("shutdown");
        let _ = read.read_to_end(&mut Vec::new()).await;
        script
    });
    let agent = GuestAgent::new(&socket, AgentOptions::default());
    let mut results = Vec::new();
    for command in ["guest-ping", "guest-info"] {
        let result = agent.execute_raw(command, Value::Null, TIMEOUT).await;
        let connection_kept = matches!(result, Ok(_) | Err(Error::Command { .. }));
        results.push(result);
        if !connection_kept {
            break;
        }
    }
    drop(agent);
    let script = peer.await.expect("the peer");
    // The agent reads up to a newline or, while it syncs, up to the 0xFF delimiter.
    let returned: Vec<Value> = objects(&script, b"\n\xff")
        .into_iter()
        .filter_map(|mut l| l.remove("return"))
        .collect();
    for v in results.into_iter().flatten() {
        assert!(returned.contains(&v), "{v} was never returned: {sent:?}");
    }
}

fn replace(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut rest = haystack;
    while !rest.is_empty() {
        if rest.starts_with(from) {
            out.extend_from_slice(to);
            rest = &rest[from.len()..];
        } else {
            out.push(rest[0]);
            rest = &rest[1..];
        }
    }
    out
}
