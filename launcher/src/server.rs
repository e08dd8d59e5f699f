//! The command API: HTTP/1.1 + JSON on a unix socket, versioned under `/v1`.
//!
//! The socket is bound under a temporary name and renamed into place, so its existence means
//! "ready" (KubeVirt's convention).

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use futures::StreamExt as _;
use tokio::net::UnixListener;

use crate::domain::{ApiError, Info};
use crate::error::Error;
use crate::vm::Launcher;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ApiError {
            code: self.code().to_owned(),
            message: self.to_string(),
        };
        tracing::warn!(code = %body.code, message = %body.message, "request failed");
        (status, axum::Json(body)).into_response()
    }
}

type Reply<T> = Result<axum::Json<T>, Error>;

pub fn router(launcher: Arc<Launcher>) -> Router {
    Router::new()
        .route(
            "/v1/ping",
            get(|| async { axum::Json(serde_json::json!({})) }),
        )
        .route("/v1/info", get(info))
        .route("/v1/sync", put(sync))
        .route("/v1/domain", get(domain))
        .route("/v1/domain/watch", get(watch))
        .route(
            "/v1/domain/blockstats",
            get(|State(l): State<Arc<Launcher>>| async move { l.blockstats().await.map(axum::Json) }),
        )
        .route(
            "/v1/pause",
            post(|State(l): State<Arc<Launcher>>| async move { l.pause().await.map(axum::Json) }),
        )
        .route(
            "/v1/unpause",
            post(|State(l): State<Arc<Launcher>>| async move { l.unpause().await.map(axum::Json) }),
        )
        .route(
            "/v1/shutdown",
            post(|State(l): State<Arc<Launcher>>| async move { l.shutdown().await.map(axum::Json) }),
        )
        .route(
            "/v1/kill",
            post(|State(l): State<Arc<Launcher>>| async move { l.kill().await.map(axum::Json) }),
        )
        .route(
            "/v1/reset",
            post(|State(l): State<Arc<Launcher>>| async move { l.reset().await.map(axum::Json) }),
        )
        .route(
            "/v1/softreboot",
            post(|State(l): State<Arc<Launcher>>| async move { l.soft_reboot().await.map(axum::Json) }),
        )
        .route(
            "/v1/freeze",
            post(|State(l): State<Arc<Launcher>>| async move { l.freeze().await.map(axum::Json) }),
        )
        .route(
            "/v1/unfreeze",
            post(|State(l): State<Arc<Launcher>>| async move { l.unfreeze().await.map(axum::Json) }),
        )
        .route(
            "/v1/guest/info",
            get(|State(l): State<Arc<Launcher>>| async move { l.guest_info().await.map(axum::Json) }),
        )
        .route(
            "/v1/guest/osinfo",
            get(|State(l): State<Arc<Launcher>>| async move { l.guest_osinfo().await.map(axum::Json) }),
        )
        .route(
            "/v1/guest/users",
            get(|State(l): State<Arc<Launcher>>| async move { l.guest_users().await.map(axum::Json) }),
        )
        .route(
            "/v1/guest/filesystems",
            get(|State(l): State<Arc<Launcher>>| async move { l.guest_filesystems().await.map(axum::Json) }),
        )
        .route(
            "/v1/guest/interfaces",
            get(|State(l): State<Arc<Launcher>>| async move { l.guest_interfaces().await.map(axum::Json) }),
        )
        .route("/v1/screendump", get(screendump).post(screendump))
        .fallback(|| async {
            Error::BadRequest("no such endpoint; see docs/launcher.md for the /v1 API".into())
                .into_response()
        })
        .with_state(launcher)
}

async fn info(State(l): State<Arc<Launcher>>) -> axum::Json<Info> {
    axum::Json(Info {
        launcher_version: env!("CARGO_PKG_VERSION").to_owned(),
        qemu_binary: l.config().qemu_binary.display().to_string(),
        qemu_version: l.qemu_version(),
        uid: l.domain().uid,
    })
}

async fn domain(State(l): State<Arc<Launcher>>) -> axum::Json<crate::domain::Domain> {
    axum::Json(l.domain())
}

async fn screendump(State(l): State<Arc<Launcher>>) -> Result<Response, Error> {
    let png = l.screendump().await?;
    Ok(([(header::CONTENT_TYPE, "image/png")], png).into_response())
}

/// The body is taken as bytes and parsed here so that a bad VMI gets our JSON error with
/// serde's own description (line, column, field) rather than axum's plain-text rejection.
async fn sync(State(l): State<Arc<Launcher>>, body: Bytes) -> Reply<crate::domain::Domain> {
    let vmi: api::VirtualMachineInstance =
        serde_json::from_slice(&body).map_err(|e| Error::BadRequest(e.to_string()))?;
    Ok(axum::Json(l.sync(&vmi).await?))
}

/// Newline-delimited JSON: the current state first, then every change. Ends after a final
/// state has been sent.
async fn watch(State(l): State<Arc<Launcher>>) -> Response {
    let rx = l.subscribe();
    let stream = futures::stream::unfold((rx, true, false), |(mut rx, first, done)| async move {
        if done {
            return None;
        }
        if !first && rx.changed().await.is_err() {
            return None;
        }
        let d = rx.borrow_and_update().clone();
        let is_final = d.state.is_final();
        let mut line = serde_json::to_vec(&d).unwrap_or_default();
        line.push(b'\n');
        Some((
            Ok::<_, Infallible>(Bytes::from(line)),
            (rx, false, is_final),
        ))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream.boxed()))
        .expect("static response parts")
}

/// Binds `socket` atomically: a temporary name first, then a rename.
pub fn bind(socket: &Path) -> std::io::Result<UnixListener> {
    let dir = socket.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = socket.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp)?;
    std::fs::rename(&tmp, socket)?;
    Ok(listener)
}
