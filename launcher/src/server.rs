//! The command API: HTTP/1.1 + JSON on a unix socket, versioned under `/v1`.
//!
//! The socket is bound under a temporary name and renamed into place, so its existence means
//! "ready" (KubeVirt's convention).

use std::convert::Infallible;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, on};
use futures::StreamExt as _;
use launcher_api::action::{
    self, Action, CancelMigration, Empty, FinishMigration, Freeze, GetBlockStats, GetDomain,
    GetInfo, GuestExec, GuestFilesystems, GuestHostName, GuestInfo, GuestInterfaces, GuestOsInfo,
    GuestPing, GuestTimezone, GuestUsers, Kill, Migrate, Pause, Ping, PrepareTarget, Reset,
    Screendump, Shutdown, SoftReboot, SyncVmi, Unfreeze, Unpause, WatchDomain,
};
use launcher_api::domain::{ApiError, Info};
use serde::Serialize;
use tokio::net::UnixListener;

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

fn method<A: Action>() -> MethodFilter {
    MethodFilter::try_from(A::METHOD).expect("every action's method is one axum routes")
}

/// The router as it is built: by action, so that the launcher's method for one has to return
/// that action's answer.
struct Routes(Router<Arc<Launcher>>);

impl Routes {
    fn serve<A, F, Fut>(self, _: A, f: F) -> Self
    where
        A: Action + 'static,
        A::Request: Send,
        A::Response: Serialize + Send + 'static,
        F: Fn(Arc<Launcher>, A::Request) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<A::Response, Error>> + Send + 'static,
    {
        // The body is taken as bytes and decoded here so that a bad VMI gets our JSON error with
        // serde's own description (line, column, field) rather than axum's plain-text rejection.
        let handler = move |State(l): State<Arc<Launcher>>, body: Bytes| async move {
            let request = <A::Request as action::Body>::decode(&body)
                .map_err(|e| Error::BadRequest(e.to_string()))?;
            // An action runs to its end in its own task: hyper drops a request's future when
            // the client's connection closes, and a sync dropped between starting QEMU and
            // recording it left a QEMU nobody owned; the next sync (a restarted virt-handler's)
            // then started a second one beside it.
            match tokio::spawn(f(l, request)).await {
                Ok(answer) => answer.map(axum::Json),
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        };
        Routes(self.0.route(A::PATH, on(method::<A>(), handler)))
    }
}

pub fn router(launcher: Arc<Launcher>) -> Router {
    Routes(Router::new())
        .serve(Ping, |_, ()| async { Ok(Empty {}) })
        .serve(GetInfo, |l, ()| async move { Ok(info(&l)) })
        .serve(SyncVmi, |l, vmi| async move { l.sync(&vmi).await })
        .serve(GetDomain, |l, ()| async move { Ok(l.domain()) })
        .serve(GetBlockStats, |l, ()| async move { l.blockstats().await })
        .serve(Pause, |l, ()| async move { l.pause().await })
        .serve(Unpause, |l, ()| async move { l.unpause().await })
        .serve(Shutdown, |l, ()| async move { l.shutdown().await })
        .serve(Kill, |l, ()| async move { l.kill().await })
        .serve(Reset, |l, ()| async move { l.reset().await })
        .serve(SoftReboot, |l, ()| async move { l.soft_reboot().await })
        .serve(Freeze, |l, ()| async move { l.freeze().await })
        .serve(Unfreeze, |l, ()| async move { l.unfreeze().await })
        .serve(GuestInfo, |l, ()| async move { l.guest_info().await })
        .serve(GuestOsInfo, |l, ()| async move { l.guest_osinfo().await })
        .serve(
            GuestHostName,
            |l, ()| async move { l.guest_host_name().await },
        )
        .serve(
            GuestTimezone,
            |l, ()| async move { l.guest_timezone().await },
        )
        .serve(GuestUsers, |l, ()| async move { l.guest_users().await })
        .serve(GuestFilesystems, |l, ()| async move {
            l.guest_filesystems().await
        })
        .serve(GuestInterfaces, |l, ()| async move {
            l.guest_interfaces().await
        })
        .serve(GuestPing, |l, req| async move { l.guest_ping(&req).await })
        .serve(GuestExec, |l, req| async move { l.guest_exec(&req).await })
        .serve(PrepareTarget, |l, req| async move {
            l.prepare_target(&req).await
        })
        .serve(Migrate, |l, req| async move { l.migrate(req).await })
        .serve(CancelMigration, |l, ()| async move {
            l.cancel_migration().await
        })
        .serve(FinishMigration, |l, ()| async move {
            l.finish_migration().await
        })
        .0
        .route(WatchDomain::PATH, on(method::<WatchDomain>(), watch))
        .route(
            Screendump::PATH,
            on(method::<Screendump>().or(MethodFilter::POST), screendump),
        )
        .fallback(|| async {
            Error::BadRequest("no such endpoint; see docs/launcher.md for the /v1 API".into())
                .into_response()
        })
        .with_state(launcher)
}

fn info(l: &Launcher) -> Info {
    Info {
        launcher_version: env!("CARGO_PKG_VERSION").to_owned(),
        qemu_binary: l.config().qemu_binary.display().to_string(),
        qemu_version: l.qemu_version(),
        uid: l.domain().uid,
    }
}

async fn screendump(State(l): State<Arc<Launcher>>) -> Result<Response, Error> {
    let png = l.screendump().await?;
    Ok(([(header::CONTENT_TYPE, "image/png")], png).into_response())
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::http::Request;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;
    use crate::paths::Dirs;
    use crate::vm::Config;

    fn launcher() -> Arc<Launcher> {
        let dir = |d: &str| std::path::PathBuf::from("/nonexistent").join(d);
        Launcher::new(Config {
            dirs: Dirs {
                share: dir("share"),
                private: dir("private"),
                ephemeral: dir("ephemeral"),
                container_disks: dir("container-disks"),
                hotplug_disks: dir("hotplug"),
                block_devices: dir("dev"),
                nvram: dir("nvram"),
            },
            qemu_binary: dir("qemu"),
            qemu_img: dir("qemu-img"),
            ovmf_dir: dir("ovmf"),
            hugepages_dir: dir("hugepages"),
            allow_emulation: true,
            qemu_timeout: Duration::from_secs(1),
            grace_period: Duration::from_secs(1),
            fsfreeze_status_interval: Duration::from_secs(1),
            uid: None,
        })
    }

    /// Without a domain every action answers at once (most with `NoDomain`); what matters is that
    /// none falls through to the fallback or is refused its method.
    #[tokio::test]
    async fn every_action_of_the_api_is_served() {
        let router = router(launcher());
        for (method, path) in action::ALL {
            let req = Request::builder()
                .method(method)
                .uri(*path)
                .body(Body::empty())
                .expect("request");
            let resp = router.clone().oneshot(req).await.expect("infallible");
            let status = resp.status();
            assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            if status.is_success() {
                continue;
            }
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            let e: ApiError = serde_json::from_slice(&body).expect("an API error");
            assert!(
                !e.message.contains("no such endpoint"),
                "{method} {path}: {e:?}"
            );
        }
    }
}
