//! `pods/log`: container logs, read from the files the process kubelet writes.
//!
//! kube-apiserver proxies this subresource to the kubelet's HTTPS server. Here the kubelets run
//! on the same machine as the API server, so each publishes its pod log directory on its Node
//! ([`LOG_DIR_ANNOTATION`]) and the server reads `<dir>/<ns>_<pod>_<uid>/<container>/<n>.log`
//! (`n` counts restarts) itself. `container`, `previous`, `tailLines`, `limitBytes` and
//! `follow` are honoured; `timestamps` and `sinceSeconds`/`sinceTime` are not (the files carry
//! no timestamps).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Response, StatusCode, header};
use serde_json::Value;

use crate::error::ApiError;
use crate::resources::GroupResource;
use crate::server::AppState;

/// The Node annotation naming the directory of its pods' logs.
pub const LOG_DIR_ANNOTATION: &str = "localcluster.kubevirt-rs.io/pod-log-dir";

/// How often a followed log is checked for more.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// The container whose log is asked for: `requested`, or the pod's only container.
pub fn container_name(pod: &Value, requested: Option<&str>) -> Result<String, ApiError> {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let names = |key: &str| -> Vec<String> {
        pod["spec"][key]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str().map(str::to_string))
            .collect()
    };
    let (app, init) = (names("containers"), names("initContainers"));
    match requested.filter(|r| !r.is_empty()) {
        Some(r) if app.iter().chain(&init).any(|c| c == r) => Ok(r.to_string()),
        Some(r) => Err(ApiError::bad_request(format!(
            "container {r} is not valid for pod {name}"
        ))),
        None if app.len() == 1 => Ok(app[0].clone()),
        None => Err(ApiError::bad_request(format!(
            "a container name must be specified for pod {name}, choose one of: [{}]",
            app.join(" ")
        ))),
    }
}

/// The restart number to read among `restarts`: the newest, or the one before it.
pub fn pick_restart(restarts: &[u32], previous: bool) -> Option<u32> {
    let mut sorted = restarts.to_vec();
    sorted.sort_unstable();
    let n = sorted.len();
    if previous {
        n.checked_sub(2).map(|i| sorted[i])
    } else {
        sorted.last().copied()
    }
}

/// The last `lines` lines of `text` (a final line without a newline counts).
pub fn tail(text: &[u8], lines: usize) -> &[u8] {
    if lines == 0 {
        return &text[text.len()..];
    }
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    let mut seen = 0;
    for (i, b) in body.iter().enumerate().rev() {
        if *b == b'\n' {
            seen += 1;
            if seen == lines {
                return &text[i + 1..];
            }
        }
    }
    text
}

fn restarts_in(dir: &Path) -> Vec<u32> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(".log")?
                .parse::<u32>()
                .ok()
        })
        .collect()
}

/// The stored pod `namespace/name`.
pub(crate) fn stored_pod(state: &AppState, namespace: &str, name: &str) -> Option<Value> {
    let pods = GroupResource {
        group: String::new(),
        resource: "pods".into(),
    };
    state.store.get(&pods, namespace, name)
}

/// Answers `GET .../pods/<name>/log`.
pub(crate) fn pod_log(
    state: &Arc<AppState>,
    namespace: &str,
    name: &str,
    query: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    let pod =
        stored_pod(state, namespace, name).ok_or_else(|| ApiError::not_found("", "pods", name))?;
    let container = container_name(&pod, query.get("container").map(String::as_str))?;
    let waiting = || {
        ApiError::bad_request(format!(
            "container \"{container}\" in pod \"{name}\" is waiting to start: ContainerCreating"
        ))
    };
    let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
    if node.is_empty() {
        return Err(waiting());
    }
    let nodes = GroupResource {
        group: String::new(),
        resource: "nodes".into(),
    };
    let log_dir = state
        .store
        .get(&nodes, "", node)
        .and_then(|n| {
            n["metadata"]["annotations"][LOG_DIR_ANNOTATION]
                .as_str()
                .map(PathBuf::from)
        })
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "node {node} publishes no pod log directory (annotation {LOG_DIR_ANNOTATION})"
            ))
        })?;
    let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
    let dir = log_dir
        .join(format!("{namespace}_{name}_{uid}"))
        .join(&container);
    let previous = query.get("previous").is_some_and(|p| p == "true");
    let Some(restart) = pick_restart(&restarts_in(&dir), previous) else {
        return Err(if previous {
            ApiError::bad_request(format!(
                "previous terminated container \"{container}\" in pod \"{name}\" not found"
            ))
        } else {
            waiting()
        });
    };
    let file = dir.join(format!("{restart}.log"));
    let text = std::fs::read(&file).map_err(|e| {
        ApiError::new(
            500,
            "InternalError",
            format!("reading {}: {e}", file.display()),
        )
    })?;
    let start = match query.get("tailLines").and_then(|t| t.parse::<usize>().ok()) {
        Some(lines) => text.len() - tail(&text, lines).len(),
        None => 0,
    };
    let limit = query
        .get("limitBytes")
        .and_then(|l| l.parse::<usize>().ok());
    if let Some(limit) = limit {
        let end = (start + limit).min(text.len());
        return Ok(plain(Body::from(text[start..end].to_vec())));
    }
    let first = Bytes::from(text[start..].to_vec());
    let follow = query.get("follow").is_some_and(|f| f == "true") && !previous;
    if !follow {
        return Ok(plain(Body::from(first)));
    }
    let offset = text.len();
    let state = state.clone();
    let (namespace, name, uid) = (namespace.to_string(), name.to_string(), uid.to_string());
    let stream = futures::stream::unfold(
        (Some(first), offset, false),
        move |(pending, offset, done)| {
            let (state, file, dir) = (state.clone(), file.clone(), dir.clone());
            let (namespace, name, uid, container) = (
                namespace.clone(),
                name.clone(),
                uid.clone(),
                container.clone(),
            );
            async move {
                if let Some(b) = pending {
                    return Some((Ok::<_, std::convert::Infallible>(b), (None, offset, false)));
                }
                if done {
                    return None;
                }
                loop {
                    tokio::time::sleep(FOLLOW_POLL).await;
                    // Checked before reading, so what was written before the end is sent.
                    let ended = !running(&state, &namespace, &name, &uid, &container)
                        || restarts_in(&dir).into_iter().any(|r| r > restart);
                    let more = std::fs::read(&file).unwrap_or_default();
                    if more.len() > offset {
                        let chunk = Bytes::from(more[offset..].to_vec());
                        return Some((Ok(chunk), (None, more.len(), ended)));
                    }
                    if ended {
                        return None;
                    }
                }
            }
        },
    );
    Ok(plain(Body::from_stream(stream)))
}

/// Whether the container of the pod `uid` may still write to its log: the pod exists and the
/// container is not terminated.
fn running(state: &AppState, namespace: &str, name: &str, uid: &str, container: &str) -> bool {
    let Some(pod) = stored_pod(state, namespace, name) else {
        return false;
    };
    if pod["metadata"]["uid"] != uid {
        return false;
    }
    let statuses = ["containerStatuses", "initContainerStatuses"];
    !statuses.iter().any(|key| {
        pod["status"][key]
            .as_array()
            .into_iter()
            .flatten()
            .any(|s| s["name"] == container && s["state"]["terminated"].is_object())
    })
}

fn plain(body: Body) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/plain")
        .body(body)
        .expect("static response parts are valid")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_container_is_named_or_the_only_one() {
        let one = json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "a"}],
            "initContainers": [{"name": "i"}]}});
        assert_eq!(container_name(&one, None).unwrap(), "a");
        assert_eq!(container_name(&one, Some("i")).unwrap(), "i");
        assert!(
            container_name(&one, Some("zz"))
                .unwrap_err()
                .message
                .contains("container zz is not valid for pod p")
        );
        let two = json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        assert_eq!(
            container_name(&two, None).unwrap_err().message,
            "a container name must be specified for pod p, choose one of: [a b]"
        );
    }

    #[test]
    fn restarts_and_tails() {
        assert_eq!(pick_restart(&[0, 2, 1], false), Some(2));
        assert_eq!(pick_restart(&[0, 2, 1], true), Some(1));
        assert_eq!(pick_restart(&[0], true), None);
        assert_eq!(pick_restart(&[], false), None);
        assert_eq!(tail(b"a\nb\nc\n", 2), b"b\nc\n");
        assert_eq!(tail(b"a\nb\nc", 1), b"c");
        assert_eq!(tail(b"a\nb\n", 5), b"a\nb\n");
        assert_eq!(tail(b"a\nb\n", 0), b"");
    }
}
