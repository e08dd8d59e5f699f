//! `pods/exec` over WebSocket (`v5.channel.k8s.io`, `v4.channel.k8s.io`), what kubectl 1.32
//! speaks by default. SPDY is not offered; kubectl falls back to it only when the WebSocket
//! upgrade is refused.
//!
//! kube-apiserver proxies exec to the kubelet; here the kubelets share the machine with the
//! API server, so the server starts the command itself in the container's network and mount
//! namespaces and cgroups (found through the node's cgroup tree), as the process kubelet's exec
//! probes do. Channels: 0 stdin, 1 stdout, 2 stderr, 3 the final `Status`, 255 (v5) closes a
//! stream (the client's stdin). `tty` and resize (channel 4) are not supported.

use std::process::Stdio;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Response, Uri};
use futures::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::error::ApiError;
use crate::kubelet::cgroup::Cgroup;
use crate::kubelet::spawn::{Launch, open_proc, spawn};
use crate::server::{AppState, authorized, error_response};

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const ERROR: u8 = 3;
const CLOSE: u8 = 255;

/// What the request asks to run.
#[derive(Debug, PartialEq, Eq)]
pub struct ExecRequest {
    pub container: Option<String>,
    pub command: Vec<String>,
    pub stdin: bool,
}

/// Parses exec's query: `command` repeats, one per argument.
pub fn parse_query(query: &str) -> Result<ExecRequest, ApiError> {
    let mut req = ExecRequest {
        container: None,
        command: Vec::new(),
        stdin: false,
    };
    for (k, v) in crate::server::url_pairs(query) {
        match k.as_str() {
            "command" => req.command.push(v),
            "container" => req.container = Some(v),
            "stdin" => req.stdin = v == "true" || v == "1",
            "tty" if v == "true" || v == "1" => {
                return Err(ApiError::bad_request(
                    "tty is not supported by localcluster's exec",
                ));
            }
            _ => {}
        }
    }
    if req.command.is_empty() {
        return Err(ApiError::bad_request("you must specify at least 1 command"));
    }
    Ok(req)
}

/// The `Status` sent on channel 3 when the command ends.
pub fn exit_status(command: &[String], code: i32) -> Value {
    if code == 0 {
        return json!({"metadata": {}, "status": "Success"});
    }
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!(
            "command terminated with non-zero exit code: error executing command {command:?}, exit code {code}"
        ),
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
    })
}

/// `GET|POST /api/v1/namespaces/<ns>/pods/<name>/exec`.
pub async fn handle(
    State(state): State<Arc<AppState>>,
    Path((namespace, name)): Path<(String, String)>,
    uri: Uri,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response<Body> {
    match prepare(&state, &namespace, &name, &uri, &headers) {
        Ok((req, pid, cgroup)) => match ws {
            Ok(ws) => ws
                .protocols(["v5.channel.k8s.io", "v4.channel.k8s.io"])
                .on_upgrade(move |socket| run(socket, req, pid, cgroup)),
            Err(_) => error_response(&ApiError::bad_request(
                "exec needs a WebSocket upgrade (v5.channel.k8s.io); SPDY is not supported",
            )),
        },
        Err(e) => error_response(&e),
    }
}

fn prepare(
    state: &AppState,
    namespace: &str,
    name: &str,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<(ExecRequest, u32, Cgroup), ApiError> {
    if !authorized(state, headers) {
        return Err(ApiError::unauthorized());
    }
    let req = parse_query(uri.query().unwrap_or_default())?;
    let pod = crate::logs::stored_pod(state, namespace, name)
        .ok_or_else(|| ApiError::not_found("", "pods", name))?;
    let container = crate::logs::container_name(&pod, req.container.as_deref())?;
    let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
    let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
    let cgroup = Cgroup::node(node)
        .child(&format!("pod{uid}"))
        .child(&container);
    // The lowest pid is the container's main process (it forked the others).
    let pid = cgroup
        .pids()
        .first()
        .and_then(|p| u32::try_from(*p).ok())
        .filter(|_| !node.is_empty())
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "container {container} is not valid for pod {name}: it is not running"
            ))
        })?;
    Ok((req, pid, cgroup))
}

async fn run(mut socket: WebSocket, req: ExecRequest, pid: u32, cgroup: Cgroup) {
    let launched = (|| {
        spawn(Launch {
            argv: req.command.clone(),
            env: vec![(
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            )],
            workdir: "/".into(),
            netns: Some(open_proc(pid, "ns/net")?),
            mntns: Some(open_proc(pid, "ns/mnt")?),
            pidns: Some(open_proc(pid, "ns/pid")?),
            hostname: None,
            cgroups: cgroup.procs_files()?,
            root: None,
            stdin: if req.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            },
            stdout: Stdio::piped(),
            stderr: Stdio::piped(),
        })
    })();
    let mut child = match launched {
        Ok(c) => c.child,
        Err(e) => {
            let status = json!({"metadata": {}, "status": "Failure",
                "message": format!("starting {:?}: {e}", req.command), "reason": "InternalError"});
            let _ = socket
                .send(frame(ERROR, status.to_string().as_bytes()))
                .await;
            let _ = socket.send(normal_close()).await;
            return;
        }
    };
    let mut stdin = child.stdin.take();
    let (mut out, mut err) = (child.stdout.take(), child.stderr.take());
    let (mut out_buf, mut err_buf) = (vec![0u8; 32 * 1024], vec![0u8; 32 * 1024]);
    let (mut sink, mut incoming) = socket.split();
    loop {
        tokio::select! {
            n = read_some(out.as_mut(), &mut out_buf) => match n {
                Some(n) => if sink.send(frame(STDOUT, &out_buf[..n])).await.is_err() { break },
                None => out = None,
            },
            n = read_some(err.as_mut(), &mut err_buf) => match n {
                Some(n) => if sink.send(frame(STDERR, &err_buf[..n])).await.is_err() { break },
                None => err = None,
            },
            msg = incoming.next(), if out.is_some() || err.is_some() => match msg {
                Some(Ok(Message::Binary(data))) => match data.first() {
                    Some(&STDIN) => {
                        if let Some(w) = stdin.as_mut()
                            && w.write_all(&data[1..]).await.is_err()
                        {
                            stdin = None;
                        }
                    }
                    Some(&CLOSE) if data.get(1) == Some(&STDIN) => stdin = None,
                    _ => {}
                },
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                Some(Ok(_)) => {}
            },
            else => break,
        }
        if out.is_none() && err.is_none() {
            break;
        }
    }
    drop(stdin);
    let code = if out.is_none() && err.is_none() {
        match child.wait().await {
            Ok(s) => s
                .code()
                .unwrap_or(128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0)),
            Err(_) => -1,
        }
    } else {
        // The client went away: the command goes too.
        let _ = child.start_kill();
        let _ = child.wait().await;
        return;
    };
    let status = exit_status(&req.command, code);
    let _ = sink.send(frame(ERROR, status.to_string().as_bytes())).await;
    let _ = sink.send(normal_close()).await;
}

/// Reads what is available; `None` at end of stream (or with no stream).
async fn read_some<R: tokio::io::AsyncRead + Unpin>(
    reader: Option<&mut R>,
    buf: &mut [u8],
) -> Option<usize> {
    match reader {
        Some(r) => match r.read(buf).await {
            Ok(0) | Err(_) => None,
            Ok(n) => Some(n),
        },
        None => std::future::pending().await,
    }
}

fn frame(channel: u8, data: &[u8]) -> Message {
    let mut v = Vec::with_capacity(data.len() + 1);
    v.push(channel);
    v.extend_from_slice(data);
    Message::Binary(Bytes::from(v))
}

/// client-go reads its streams to their end only on a normal closure (1000); a close frame
/// without a code (1005) is an error to it.
fn normal_close() -> Message {
    Message::Close(Some(axum::extract::ws::CloseFrame {
        code: axum::extract::ws::close_code::NORMAL,
        reason: "".into(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_and_statuses() {
        let r = parse_query(
            "command=sh&command=-c&command=echo%20hi&container=c&stdin=true&stdout=true",
        )
        .unwrap();
        assert_eq!(
            r,
            ExecRequest {
                container: Some("c".into()),
                command: vec!["sh".into(), "-c".into(), "echo hi".into()],
                stdin: true,
            }
        );
        assert!(parse_query("stdout=true").is_err());
        assert!(parse_query("command=sh&tty=true").is_err());
        assert_eq!(exit_status(&[], 0)["status"], "Success");
        let s = exit_status(&["false".into()], 3);
        assert_eq!(s["details"]["causes"][0]["message"], "3");
        assert_eq!(s["reason"], "NonZeroExitCode");
    }
}
