//! The kubelet API: what kube-apiserver dials for `kubectl logs`, `exec` and `port-forward`
//! (`pods/log`, `pods/exec`, `pods/portforward`), on the node's address and the port the Node
//! publishes in `status.daemonEndpoints.kubeletEndpoint`.
//!
//! HTTPS (HTTP/1.1) with the node's serving certificate. **Authorization: any client
//! certificate signed by the cluster CA** ([`Serving::client_ca_pem`]; kube-apiserver presents
//! `kube-apiserver-kubelet-client`, group `system:masters`) may use every endpoint. The real
//! kubelet also authenticates with the client CA (and bearer tokens), then asks the API server
//! whether the identity may act on `nodes/<subresource>` with a `SubjectAccessReview`
//! (`--authorization-mode=Webhook`); localcluster's kubelet asks nothing.
//!
//! Endpoints, with the real kubelet's paths and query parameters
//! (`k8s.io/kubernetes/pkg/kubelet/server/server.go`):
//!
//! - `GET /healthz`: `ok`.
//! - `GET /containerLogs/<namespace>/<pod>/<container>`: the container's log file,
//!   `<node root>/var/log/pods/<ns>_<pod>_<uid>/<container>/<restart>.log`. `previous`,
//!   `tailLines` (and the legacy `tail`, `all` meaning every line), `limitBytes` and `follow` are
//!   honoured; `follow` polls the file and ends when the container is gone (its cgroup empty for
//!   a second), restarts, or the pod is torn down. The files carry no timestamps, so
//!   `timestamps` is ignored and `sinceSeconds`/`sinceTime` only go as far as the file's
//!   modification time: a log last written before that time gives nothing (but is followed).
//! - `GET|POST /exec/<namespace>/<pod>[/<uid>]/<container>?command=..&input=1&output=1&error=1&tty=1`
//!   and `/portForward/<namespace>/<pod>[/<uid>]`: SPDY/3.1 (or WebSocket) upgrades. These are
//!   not implemented here: the kubelet finds the container (its main process: the lowest pid of
//!   its cgroup `localcluster/<node>/pod<uid>/<container>`) or the pod's network namespace and
//!   proxies the request, with that in `X-Localcluster-*` headers, to a helper on a unix socket,
//!   `kube kubelet-streaming` (`localcluster/upstream/streaming.go`), which serves it with the
//!   kubelet's own streaming library (`k8s.io/cri-streaming`, as CRI runtimes do). The helper's
//!   `101 Switching Protocols` goes back to kube-apiserver, and the two upgraded connections are
//!   spliced. For exec, the helper runs `localcluster nsexec --pid <pid> --cgroup <cgroup>
//!   [--tty] -- <command>` ([`crate::nsexec`]) on the stream (or a pseudo-terminal, resized as
//!   the client asks), and reports its exit code. Port-forward dials `localhost:<port>` in the
//!   pod's network namespace. The helper starts with the first such request, one per kubelet
//!   (socket `<node root>/var/lib/kubelet/streaming.sock`, log `streaming.log` beside it), and
//!   dies with the kubelet (its standard input closes, `PR_SET_PDEATHSIG`, and it is killed
//!   when [`serve`] stops).
//! - `/attach/...`: 400, attach is not supported (containers' output goes to their log files
//!   and they have no standard input).
//!
//! The `localcluster` binary for `nsexec` ([`localcluster_binary`]): `$LOCALCLUSTER_BIN`, else
//! this process's executable if it is `localcluster`, else `<target dir>/debug/localcluster` (the
//! kubelet also runs inside test binaries).
//!
//! kube-apiserver reaches exec and port-forward over SPDY: it translates kubectl's WebSockets
//! itself unless the Node declares the `ExtendWebSocketsToKubelet` feature, which ours does not.

use std::convert::Infallible;
use std::io::{Read as _, Seek as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tokio::net::{TcpListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::cgroup::Cgroup;
use super::{KubeletError, Serving, Shared};

/// How often a followed log is checked for more.
const FOLLOW_POLL: Duration = Duration::from_millis(200);
/// How long a followed container's cgroup must stay empty before its log ends (the log file is
/// created just before the process starts).
const FOLLOW_GRACE: Duration = Duration::from_secs(1);
/// How long the streaming helper may take to listen.
const HELPER_START: Duration = Duration::from_secs(30);

/// Binds the kubelet API's port on the node's address (`port` 0 picks a free one).
pub async fn bind(host_ip: &str, port: u16) -> Result<TcpListener, KubeletError> {
    let addr = format!("{host_ip}:{port}");
    TcpListener::bind(&addr)
        .await
        .map_err(|source| KubeletError::Io {
            path: format!("binding the kubelet API on {addr}"),
            source,
        })
}

/// Serves the kubelet API on `listener` until aborted (the streaming helper and every
/// connection end with it).
pub(crate) async fn serve(shared: Arc<Shared>, listener: TcpListener, serving: Serving) {
    let node = shared.config.name.clone();
    let tls = match tls_config(&serving) {
        Ok(c) => tokio_rustls::TlsAcceptor::from(c),
        Err(e) => {
            tracing::error!(%node, error = %e, "kubelet API: the TLS configuration");
            return;
        }
    };
    let state = Arc::new(ApiState {
        helper: Helper::new(&shared.config.kubelet_dir()),
        shared,
    });
    // Dropped with this future: every spliced stream ends then.
    let (_shutdown, shutdown_rx) = watch::channel(());
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => {
                    connections.spawn(connection(
                        state.clone(),
                        tls.clone(),
                        tcp,
                        peer,
                        shutdown_rx.clone(),
                    ));
                }
                Err(e) => {
                    tracing::warn!(%node, error = %e, "kubelet API: accepting a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// The server configuration: the serving certificate, client certificates from the client CA
/// required, HTTP/1.1 only (exec and port-forward are HTTP/1.1 upgrades).
fn tls_config(serving: &Serving) -> Result<Arc<rustls::ServerConfig>, crate::tls::TlsError> {
    let config = crate::tls::server_config(
        &serving.cert_pem,
        &serving.key_pem,
        Some(&serving.client_ca_pem),
    )?;
    let mut config = (*config).clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

struct ApiState {
    shared: Arc<Shared>,
    helper: Helper,
}

async fn connection(
    state: Arc<ApiState>,
    tls: tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    shutdown: watch::Receiver<()>,
) {
    let stream = match tls.accept(tcp).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "kubelet API: TLS handshake");
            return;
        }
    };
    let service = hyper::service::service_fn(move |req| {
        let (state, shutdown) = (state.clone(), shutdown.clone());
        async move { Ok::<_, Infallible>(route(&state, req, shutdown).await) }
    });
    if let Err(e) = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades()
        .await
    {
        tracing::debug!(%peer, error = %e, "kubelet API: connection");
    }
}

/// An error answer: plain text, as the kubelet writes them.
fn text(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Body::from(message.into()))
        .expect("static response parts are valid")
}

/// What a request's path names.
#[derive(Debug, PartialEq, Eq)]
pub enum Endpoint {
    Healthz,
    Logs {
        namespace: String,
        pod: String,
        container: String,
    },
    Exec {
        attach: bool,
        namespace: String,
        pod: String,
        uid: Option<String>,
        container: String,
    },
    PortForward {
        namespace: String,
        pod: String,
        uid: Option<String>,
    },
}

/// Parses the path as the kubelet's routes do (`None`: no such endpoint).
pub fn endpoint(path: &str) -> Option<Endpoint> {
    let parts: Vec<String> = path
        .trim_start_matches('/')
        .trim_end_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    if parts.iter().skip(1).any(String::is_empty) {
        return None;
    }
    let p = |i: usize| parts[i].clone();
    match (parts[0].as_str(), parts.len()) {
        ("healthz", 1) => Some(Endpoint::Healthz),
        ("containerLogs", 4) => Some(Endpoint::Logs {
            namespace: p(1),
            pod: p(2),
            container: p(3),
        }),
        (kind @ ("exec" | "attach"), 4 | 5) => Some(Endpoint::Exec {
            attach: kind == "attach",
            namespace: p(1),
            pod: p(2),
            uid: (parts.len() == 5).then(|| p(3)),
            container: p(parts.len() - 1),
        }),
        ("portForward", 3 | 4) => Some(Endpoint::PortForward {
            namespace: p(1),
            pod: p(2),
            uid: (parts.len() == 4).then(|| p(3)),
        }),
        _ => None,
    }
}

async fn route(
    state: &ApiState,
    req: Request<Incoming>,
    shutdown: watch::Receiver<()>,
) -> Response<Body> {
    let Some(endpoint) = endpoint(req.uri().path()) else {
        return text(StatusCode::NOT_FOUND, "404 page not found\n");
    };
    let streaming = matches!(
        endpoint,
        Endpoint::Exec { .. } | Endpoint::PortForward { .. }
    );
    if !streaming && req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed");
    }
    if streaming && req.method() != Method::GET && req.method() != Method::POST {
        return text(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed");
    }
    let query = req.uri().query().unwrap_or_default().to_string();
    let result = match endpoint {
        Endpoint::Healthz => Ok(text(StatusCode::OK, "ok")),
        Endpoint::Logs {
            namespace,
            pod,
            container,
        } => container_logs(state, &namespace, &pod, &container, &query).await,
        Endpoint::Exec { attach: true, .. } => Err(text(
            StatusCode::BAD_REQUEST,
            "attach is not supported by localcluster's kubelet",
        )),
        Endpoint::Exec {
            namespace,
            pod,
            uid,
            container,
            ..
        } => {
            exec(
                state,
                req,
                &namespace,
                &pod,
                uid.as_deref(),
                &container,
                shutdown,
            )
            .await
        }
        Endpoint::PortForward {
            namespace,
            pod,
            uid,
        } => port_forward(state, req, &namespace, &pod, uid.as_deref(), shutdown).await,
    };
    result.unwrap_or_else(|e| e)
}

/// The pod `namespace/name` if it is bound to this node (and has `uid`, when given).
async fn node_pod(
    shared: &Shared,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
) -> Result<Pod, Response<Body>> {
    let pods = Api::<Pod>::namespaced(shared.client.clone(), namespace);
    let pod = pods.get_opt(name).await.map_err(|e| {
        text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("getting pod {namespace}/{name}: {e}"),
        )
    })?;
    let on_node = |p: &Pod| {
        p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(shared.config.name.as_str())
    };
    match pod {
        Some(p) if on_node(&p) => {
            if uid.is_some_and(|u| p.metadata.uid.as_deref() != Some(u)) {
                return Err(text(StatusCode::NOT_FOUND, "pod not found"));
            }
            Ok(p)
        }
        _ => Err(text(
            StatusCode::NOT_FOUND,
            format!("pod {name:?} does not exist"),
        )),
    }
}

/// Whether the pod's spec has the container (app, init or ephemeral).
/// The pod on this node that has `container` (404 when it has none of that name).
async fn node_container(
    shared: &Shared,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
    container: &str,
) -> Result<Pod, Response<Body>> {
    let pod = node_pod(shared, namespace, name, uid).await?;
    if !has_container(&pod, container) {
        return Err(text(
            StatusCode::NOT_FOUND,
            format!("container {container:?} not found in pod {name:?}"),
        ));
    }
    Ok(pod)
}

fn has_container(pod: &Pod, container: &str) -> bool {
    let Some(spec) = &pod.spec else { return false };
    spec.containers.iter().any(|c| c.name == container)
        || spec
            .init_containers
            .iter()
            .flatten()
            .any(|c| c.name == container)
        || spec
            .ephemeral_containers
            .iter()
            .flatten()
            .any(|c| c.name == container)
}

fn pod_uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// containerLogs

/// `containerLogs`' query, as the kubelet decodes it into `PodLogOptions`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LogQuery {
    pub follow: bool,
    pub previous: bool,
    pub tail_lines: Option<usize>,
    pub limit_bytes: Option<usize>,
    pub timestamps: bool,
    /// Only what was written after this (`sinceSeconds` before now, or `sinceTime`).
    pub since: Option<SystemTime>,
}

/// Go's `strconv.ParseBool`, which decodes query booleans.
fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Parses `containerLogs`' query (`now` anchors `sinceSeconds`).
pub fn parse_log_query(query: &str, now: SystemTime) -> Result<LogQuery, String> {
    let bad = || "{\"message\": \"Unable to decode query.\"}".to_string();
    let invalid = || "{\"message\": \"Invalid request.\"}".to_string();
    let mut q = LogQuery::default();
    let mut tail = None;
    for (k, v) in query_pairs(query) {
        match k.as_str() {
            "follow" => q.follow = parse_bool(&v).ok_or_else(bad)?,
            "previous" => q.previous = parse_bool(&v).ok_or_else(bad)?,
            "timestamps" => q.timestamps = parse_bool(&v).ok_or_else(bad)?,
            "tailLines" => {
                let n: i64 = v.parse().map_err(|_| bad())?;
                q.tail_lines = Some(usize::try_from(n).map_err(|_| invalid())?);
            }
            "tail" => tail = Some(v),
            "limitBytes" => {
                let n: i64 = v.parse().map_err(|_| bad())?;
                if n < 1 {
                    return Err(invalid());
                }
                q.limit_bytes = usize::try_from(n).ok();
            }
            "sinceSeconds" => {
                let n: i64 = v.parse().map_err(|_| bad())?;
                let secs = u64::try_from(n)
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or_else(invalid)?;
                q.since = now.checked_sub(Duration::from_secs(secs));
            }
            "sinceTime" => {
                let t: jiff::Timestamp = v.parse().map_err(|_| bad())?;
                q.since = Some(SystemTime::from(t));
            }
            _ => {}
        }
    }
    // The legacy `tail` (`all`: every line) stands for `tailLines`.
    match tail.as_deref() {
        Some("all") => q.tail_lines = None,
        Some(t) => {
            let n: i64 = t.parse().map_err(|_| bad())?;
            q.tail_lines = Some(usize::try_from(n).map_err(|_| invalid())?);
        }
        None => {}
    }
    Ok(q)
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

/// The part of a log file to send first: `tailLines` from the end, nothing when the file was
/// last written before `since`, at most `limitBytes`. Returns `(start, end)`.
pub fn first_range(text: &[u8], q: &LogQuery, modified: Option<SystemTime>) -> (usize, usize) {
    let mut start = match q.tail_lines {
        Some(lines) => text.len() - tail(text, lines).len(),
        None => 0,
    };
    if let (Some(since), Some(modified)) = (q.since, modified)
        && modified < since
    {
        start = text.len();
    }
    let end = q
        .limit_bytes
        .map_or(text.len(), |l| start.saturating_add(l).min(text.len()));
    (start, end)
}

/// The restart numbers with a log file in `dir` (`<n>.log`).
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

async fn container_logs(
    state: &ApiState,
    namespace: &str,
    name: &str,
    container: &str,
    query: &str,
) -> Result<Response<Body>, Response<Body>> {
    let q =
        parse_log_query(query, SystemTime::now()).map_err(|m| text(StatusCode::BAD_REQUEST, m))?;
    let shared = &state.shared;
    let pod = node_container(shared, namespace, name, None, container).await?;
    let uid = pod_uid(&pod);
    let dir = shared
        .config
        .log_dir()
        .join(format!("{namespace}_{name}_{uid}"))
        .join(container);
    let Some(restart) = pick_restart(&restarts_in(&dir), q.previous) else {
        return Err(text(
            StatusCode::BAD_REQUEST,
            if q.previous {
                format!("previous terminated container {container:?} in pod {name:?} not found")
            } else {
                format!(
                    "container {container:?} in pod {name:?} is waiting to start: ContainerCreating"
                )
            },
        ));
    };
    let file = dir.join(format!("{restart}.log"));
    let read_err = |e: std::io::Error| {
        text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading {}: {e}", file.display()),
        )
    };
    let text_now = std::fs::read(&file).map_err(read_err)?;
    let modified = std::fs::metadata(&file).and_then(|m| m.modified()).ok();
    let (start, end) = first_range(&text_now, &q, modified);
    let first = Bytes::from(text_now[start..end].to_vec());
    let remaining = q.limit_bytes.map(|l| l - first.len());
    if !q.follow || q.previous || remaining == Some(0) {
        return Ok(plain(Body::from(first)));
    }
    let follow = Follow {
        shared: state.shared.clone(),
        uid,
        container: container.to_string(),
        dir,
        file,
        restart,
        offset: text_now.len(),
        remaining,
        quiet_since: None,
    };
    let stream = futures::stream::unfold((Some(first), Some(follow)), |(pending, follow)| async {
        if let Some(b) = pending {
            return Some((Ok::<_, Infallible>(b), (None, follow)));
        }
        let mut f = follow?;
        let (chunk, more) = f.next().await;
        chunk.map(|c| (Ok(c), (None, more.then_some(f))))
    });
    Ok(plain(Body::from_stream(stream)))
}

/// A followed log file.
struct Follow {
    shared: Arc<Shared>,
    uid: String,
    container: String,
    dir: PathBuf,
    file: PathBuf,
    restart: u32,
    offset: usize,
    remaining: Option<usize>,
    quiet_since: Option<Instant>,
}

impl Follow {
    /// Whether the container may still write: its pod is on the node, no later restart has
    /// begun, and its cgroup has a process (or had one less than [`FOLLOW_GRACE`] ago).
    fn running(&mut self) -> bool {
        let on_node = self
            .shared
            .sandboxes
            .lock()
            .is_ok_and(|s| s.contains_key(&self.uid));
        if !on_node || restarts_in(&self.dir).into_iter().any(|r| r > self.restart) {
            return false;
        }
        let cgroup = Cgroup::pod(&self.shared.config.name, &self.uid).child(&self.container);
        if cgroup.pids().is_empty() {
            let since = *self.quiet_since.get_or_insert_with(Instant::now);
            since.elapsed() < FOLLOW_GRACE
        } else {
            self.quiet_since = None;
            true
        }
    }

    /// The next chunk (`None`: the log ended with nothing more) and whether to go on.
    async fn next(&mut self) -> (Option<Bytes>, bool) {
        loop {
            tokio::time::sleep(FOLLOW_POLL).await;
            // Checked before reading, so what was written before the end is sent.
            let running = self.running();
            let mut more = Vec::new();
            if let Ok(mut f) = std::fs::File::open(&self.file)
                && f.seek(std::io::SeekFrom::Start(self.offset as u64)).is_ok()
            {
                let _ = f.read_to_end(&mut more);
            }
            if !more.is_empty() {
                self.offset += more.len();
                if let Some(r) = self.remaining.as_mut() {
                    more.truncate(*r);
                    *r -= more.len();
                }
                let go_on = running && self.remaining != Some(0);
                return (Some(Bytes::from(more)), go_on);
            }
            if !running {
                return (None, false);
            }
        }
    }
}

fn plain(body: Body) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/plain")
        .body(body)
        .expect("static response parts are valid")
}

// ---------------------------------------------------------------------------------------------
// exec and port-forward: proxied to the streaming helper

#[allow(clippy::too_many_arguments)]
async fn exec(
    state: &ApiState,
    req: Request<Incoming>,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
    container: &str,
    shutdown: watch::Receiver<()>,
) -> Result<Response<Body>, Response<Body>> {
    let shared = &state.shared;
    let pod = node_container(shared, namespace, name, uid, container).await?;
    let uid = pod_uid(&pod);
    let cgroup = Cgroup::pod(&shared.config.name, &uid).child(container);
    // The lowest pid is the container's main process (it forked the others).
    let Some(pid) = cgroup.pids().first().copied() else {
        return Err(text(
            StatusCode::NOT_FOUND,
            format!("container {container:?} in pod {name:?} is not running"),
        ));
    };
    let nsexec = localcluster_binary().map_err(|m| text(StatusCode::INTERNAL_SERVER_ERROR, m))?;
    let headers = vec![
        ("x-localcluster-nsexec", nsexec.display().to_string()),
        ("x-localcluster-pid", pid.to_string()),
        (
            "x-localcluster-cgroup",
            cgroup.relative.display().to_string(),
        ),
        ("x-localcluster-pod", format!("{namespace}/{name}")),
        ("x-localcluster-uid", uid),
        ("x-localcluster-container", container.to_string()),
    ];
    proxy_upgrade(state, req, "/exec", headers, shutdown).await
}

async fn port_forward(
    state: &ApiState,
    req: Request<Incoming>,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
    shutdown: watch::Receiver<()>,
) -> Result<Response<Body>, Response<Body>> {
    let shared = &state.shared;
    let pod = node_pod(shared, namespace, name, uid).await?;
    let uid = pod_uid(&pod);
    let sandbox = shared
        .sandboxes
        .lock()
        .ok()
        .and_then(|s| s.get(&uid).cloned());
    let Some(sandbox) = sandbox else {
        return Err(text(
            StatusCode::BAD_REQUEST,
            format!("pod {name:?} has no sandbox on this node yet"),
        ));
    };
    // A hostNetwork pod is in the node's (the kubelet's) network namespace.
    let netns = sandbox.network.as_ref().map_or_else(
        || PathBuf::from(format!("/proc/{}/ns/net", std::process::id())),
        super::network::PodNetwork::netns_path,
    );
    let headers = vec![
        ("x-localcluster-netns", netns.display().to_string()),
        ("x-localcluster-pod", format!("{namespace}/{name}")),
        ("x-localcluster-uid", uid),
    ];
    proxy_upgrade(state, req, "/portForward", headers, shutdown).await
}

/// Forwards an upgrade request to the streaming helper at `path` (same method, query and
/// headers, plus `extra`) and, when it switches protocols, answers with its `101` and splices
/// the two upgraded connections; any other answer of the helper is passed on.
async fn proxy_upgrade(
    state: &ApiState,
    mut req: Request<Incoming>,
    path: &str,
    extra: Vec<(&'static str, String)>,
    mut shutdown: watch::Receiver<()>,
) -> Result<Response<Body>, Response<Body>> {
    let unavailable = |m: String| text(StatusCode::INTERNAL_SERVER_ERROR, m);
    let socket = state.helper.ensure().await.map_err(unavailable)?;
    let stream = UnixStream::connect(&socket)
        .await
        .map_err(|e| unavailable(format!("connecting to {}: {e}", socket.display())))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unavailable(format!("the streaming helper: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "kubelet API: streaming helper connection");
        }
    });
    let uri = match req.uri().query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let mut forwarded = Request::builder()
        .method(req.method().clone())
        .uri(uri)
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| unavailable(e.to_string()))?;
    for (k, v) in req.headers() {
        if k != header::CONTENT_LENGTH && k != header::TRANSFER_ENCODING {
            forwarded.headers_mut().append(k.clone(), v.clone());
        }
    }
    for (k, v) in extra {
        let v = HeaderValue::from_str(&v).map_err(|e| unavailable(format!("{k}: {e}")))?;
        forwarded.headers_mut().insert(k, v);
    }
    let client_upgrade = hyper::upgrade::on(&mut req);
    let mut answer = sender
        .send_request(forwarded)
        .await
        .map_err(|e| unavailable(format!("the streaming helper: {e}")))?;
    let mut response = Response::builder().status(answer.status());
    for (k, v) in answer.headers() {
        response = response.header(k, v);
    }
    if answer.status() != StatusCode::SWITCHING_PROTOCOLS {
        let body = answer
            .into_body()
            .collect()
            .await
            .map(http_body_util::Collected::to_bytes)
            .unwrap_or_default();
        return response
            .body(Body::from(body))
            .map_err(|e| unavailable(e.to_string()));
    }
    let helper_upgrade = hyper::upgrade::on(&mut answer);
    tokio::spawn(async move {
        let (client, helper) = tokio::join!(client_upgrade, helper_upgrade);
        let (mut client, mut helper) = match (client, helper) {
            (Ok(c), Ok(h)) => (TokioIo::new(c), TokioIo::new(h)),
            (c, h) => {
                tracing::warn!(client = ?c.err(), helper = ?h.err(), "kubelet API: upgrading a stream");
                return;
            }
        };
        tokio::select! {
            r = tokio::io::copy_bidirectional(&mut client, &mut helper) => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "kubelet API: a spliced stream");
                }
            }
            _ = shutdown.changed() => {}
        }
    });
    response
        .body(Body::empty())
        .map_err(|e| unavailable(e.to_string()))
}

// ---------------------------------------------------------------------------------------------
// The streaming helper

/// `kube kubelet-streaming` on a unix socket, started on first use.
struct Helper {
    socket: PathBuf,
    log: PathBuf,
    process: tokio::sync::Mutex<Option<HelperProcess>>,
}

struct HelperProcess {
    /// Killed when dropped (`kill_on_drop`).
    child: tokio::process::Child,
    /// The helper exits when this closes (`--exit-with-stdin`).
    _stdin: Option<tokio::process::ChildStdin>,
}

/// Unix socket paths are limited to 108 bytes.
const SOCKET_PATH_MAX: usize = 100;

impl Helper {
    fn new(kubelet_dir: &Path) -> Self {
        let mut socket = kubelet_dir.join("streaming.sock");
        if socket.as_os_str().len() > SOCKET_PATH_MAX {
            socket = std::env::temp_dir().join(format!(
                "localcluster-streaming-{}-{:x}.sock",
                std::process::id(),
                hash(kubelet_dir)
            ));
        }
        Self {
            socket,
            log: kubelet_dir.join("streaming.log"),
            process: tokio::sync::Mutex::new(None),
        }
    }

    /// The helper's socket, starting the helper if it is not running.
    async fn ensure(&self) -> Result<PathBuf, String> {
        let mut process = self.process.lock().await;
        if let Some(p) = process.as_mut() {
            match p.child.try_wait() {
                Ok(None) => return Ok(self.socket.clone()),
                status => {
                    tracing::warn!(?status, log = %self.log.display(), "the kubelet streaming helper exited; restarting it");
                }
            }
        }
        *process = None;
        let kube = tokio::task::spawn_blocking(crate::controlplane::kube_binary)
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("finding the kube binary for kubelet-streaming: {e}"))?;
        let _ = std::fs::remove_file(&self.socket);
        let log = std::fs::File::create(&self.log)
            .map_err(|e| format!("creating {}: {e}", self.log.display()))?;
        let mut cmd = tokio::process::Command::new(&kube);
        cmd.arg("kubelet-streaming")
            .arg("--socket")
            .arg(&self.socket)
            .arg("--exit-with-stdin")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        // SAFETY: prctl(2) only; nothing allocates or locks between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {} kubelet-streaming: {e}", kube.display()))?;
        let stdin = child.stdin.take();
        let deadline = Instant::now() + HELPER_START;
        loop {
            if UnixStream::connect(&self.socket).await.is_ok() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                return Err(format!(
                    "{} kubelet-streaming exited ({status}): {}",
                    kube.display(),
                    log.trim()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} kubelet-streaming did not listen on {} within {HELPER_START:?}",
                    kube.display(),
                    self.socket.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::info!(socket = %self.socket.display(), "kubelet streaming helper started");
        *process = Some(HelperProcess {
            child,
            _stdin: stdin,
        });
        Ok(self.socket.clone())
    }
}

fn hash(path: &Path) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    path.hash(&mut h);
    h.finish()
}

/// The `localcluster` binary whose `nsexec` runs exec'd commands: `$LOCALCLUSTER_BIN`, else this
/// executable if it is `localcluster`, else `<$CARGO_TARGET_DIR or the workspace's
/// target>/debug/localcluster` (the kubelet also runs in test binaries).
pub fn localcluster_binary() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("LOCALCLUSTER_BIN") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "LOCALCLUSTER_BIN={} is not a file (exec runs its `nsexec` subcommand)",
                path.display()
            ))
        };
    }
    if let Ok(exe) = std::env::current_exe()
        && exe.file_name().is_some_and(|n| n == "localcluster")
    {
        return Ok(exe);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    );
    let path = target.join("debug/localcluster");
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "exec needs the localcluster binary (its `nsexec` subcommand runs the command in the \
             container): build it with `cargo build -p localcluster`, or set LOCALCLUSTER_BIN \
             (looked for {})",
            path.display()
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Query strings

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decodes `%XX` escapes (and nothing else).
fn percent_decode(s: &str) -> String {
    decode(s, false)
}

fn decode(text: &str, plus_is_space: bool) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        match bytes[at] {
            b'%' if at + 2 < bytes.len() => {
                if let (Some(high), Some(low)) = (hex(bytes[at + 1]), hex(bytes[at + 2])) {
                    out.push(high * 16 + low);
                    at += 3;
                    continue;
                }
                out.push(b'%');
            }
            b'+' if plus_is_space => out.push(b' '),
            other => out.push(other),
        }
        at += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `key=value` pairs of a query string, decoded as forms are.
pub fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k, true), decode(v, true))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_the_kubelet_endpoints() {
        assert_eq!(endpoint("/healthz"), Some(Endpoint::Healthz));
        assert_eq!(
            endpoint("/containerLogs/ns/p/c"),
            Some(Endpoint::Logs {
                namespace: "ns".into(),
                pod: "p".into(),
                container: "c".into()
            })
        );
        assert_eq!(
            endpoint("/exec/ns/p/c"),
            Some(Endpoint::Exec {
                attach: false,
                namespace: "ns".into(),
                pod: "p".into(),
                uid: None,
                container: "c".into()
            })
        );
        assert_eq!(
            endpoint("/attach/ns/p/u-1/c"),
            Some(Endpoint::Exec {
                attach: true,
                namespace: "ns".into(),
                pod: "p".into(),
                uid: Some("u-1".into()),
                container: "c".into()
            })
        );
        assert_eq!(
            endpoint("/portForward/ns/p"),
            Some(Endpoint::PortForward {
                namespace: "ns".into(),
                pod: "p".into(),
                uid: None
            })
        );
        assert_eq!(endpoint("/containerLogs/ns/p"), None);
        assert_eq!(endpoint("/containerLogs/ns//c"), None);
        assert_eq!(endpoint("/pods"), None);
        assert_eq!(endpoint("/"), None);
    }

    #[test]
    fn log_queries() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let q = parse_log_query(
            "follow=true&previous=1&tailLines=5&limitBytes=10&timestamps=false&sinceSeconds=60",
            now,
        )
        .unwrap();
        assert_eq!(
            q,
            LogQuery {
                follow: true,
                previous: true,
                tail_lines: Some(5),
                limit_bytes: Some(10),
                timestamps: false,
                since: Some(now - Duration::from_mins(1)),
            }
        );
        assert_eq!(parse_log_query("", now).unwrap(), LogQuery::default());
        assert_eq!(parse_log_query("tail=3", now).unwrap().tail_lines, Some(3));
        assert_eq!(
            parse_log_query("tailLines=3&tail=all", now)
                .unwrap()
                .tail_lines,
            None
        );
        let t = parse_log_query("sinceTime=1970-01-12T13%3A46%3A40Z", now).unwrap();
        assert_eq!(t.since, Some(now));
        assert!(parse_log_query("follow=yes", now).is_err());
        assert!(parse_log_query("tailLines=x", now).is_err());
        assert!(parse_log_query("limitBytes=0", now).is_err());
        assert!(parse_log_query("tailLines=-1", now).is_err());
    }

    #[test]
    fn restarts_tails_and_ranges() {
        assert_eq!(pick_restart(&[0, 2, 1], false), Some(2));
        assert_eq!(pick_restart(&[0, 2, 1], true), Some(1));
        assert_eq!(pick_restart(&[0], true), None);
        assert_eq!(pick_restart(&[], false), None);
        assert_eq!(tail(b"a\nb\nc\n", 2), b"b\nc\n");
        assert_eq!(tail(b"a\nb\nc", 1), b"c");
        assert_eq!(tail(b"a\nb\n", 5), b"a\nb\n");
        assert_eq!(tail(b"a\nb\n", 0), b"");

        let text = b"one\ntwo\nthree\n";
        let all = LogQuery::default();
        assert_eq!(first_range(text, &all, None), (0, text.len()));
        let q = LogQuery {
            tail_lines: Some(2),
            limit_bytes: Some(5),
            ..LogQuery::default()
        };
        assert_eq!(
            &text[first_range(text, &q, None).0..first_range(text, &q, None).1],
            b"two\nt"
        );
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let since = LogQuery {
            since: Some(t0),
            ..LogQuery::default()
        };
        let older = t0 - Duration::from_secs(1);
        assert_eq!(
            first_range(text, &since, Some(older)),
            (text.len(), text.len())
        );
        assert_eq!(
            first_range(text, &since, Some(t0 + Duration::from_secs(1))),
            (0, text.len())
        );
    }

    #[test]
    fn queries_decode() {
        let commands: Vec<String> =
            query_pairs("command=sh&command=-c&command=echo+hi%21%20x&input=1")
                .into_iter()
                .filter(|(k, _)| k == "command")
                .map(|(_, v)| v)
                .collect();
        assert_eq!(commands, ["sh", "-c", "echo hi! x"]);
        assert_eq!(
            query_pairs("a&b=%zz&c=%4"),
            [
                ("a".to_string(), String::new()),
                ("b".to_string(), "%zz".to_string()),
                ("c".to_string(), "%4".to_string()),
            ]
        );
        assert_eq!(percent_decode("a+b%2Fc"), "a+b/c");
    }
}
