//! virt-api's HTTPS server: the TLS accept loop (the client certificate, when one is offered,
//! becomes the request's [`Peer`]) and the routes: discovery and health open to all, as
//! KubeVirt's `noAuthEndpoints`; the subresources behind authentication and authorization;
//! the admission webhooks, which kube-apiserver calls without a client certificate.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tlsconfig::ReloadingConfig;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::authn::Peer;
use crate::discovery;
use crate::subresource::{self, App};

/// The largest AdmissionReview read: a VM with a large cloud-init payload stays well below.
const MAX_REVIEW: usize = 8 * 1024 * 1024;

/// An admission answer on its way (most are ready at once; the pod-eviction hook asks the API).
pub type AdmitFuture<'a> =
    std::pin::Pin<Box<dyn Future<Output = Option<serde_json::Value>> + Send + 'a>>;

/// What the admission routes need besides the request.
pub trait Admission: Send + Sync + 'static {
    /// The AdmissionReview answer of the webhook at `path`; `None`: no webhook there.
    fn admit<'a>(&'a self, path: &'a str, review: &'a serde_json::Value) -> AdmitFuture<'a>;
}

#[derive(Clone)]
struct AppState {
    app: Arc<App>,
    admission: Arc<dyn Admission>,
}

pub fn router(app: Arc<App>, admission: Arc<dyn Admission>) -> Router {
    let base = format!("/apis/{}", api::subresources::GROUP);
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/apis",
            get(|| async { axum::Json(discovery::api_group_list()) }),
        )
        .route(&base, get(|| async { axum::Json(discovery::api_group()) }))
        .route(&format!("{base}/{{version}}"), get(resource_list))
        .route(&format!("{base}/{{version}}/"), get(resource_list))
        .route(&format!("{base}/{{version}}/version"), get(version))
        .route(
            &format!("{base}/{{version}}/healthz"),
            get(|| async { "ok" }),
        )
        .route(
            "/{hook}",
            post(admit).layer(axum::extract::DefaultBodyLimit::max(MAX_REVIEW)),
        )
        .fallback(fallback)
        .with_state(AppState { app, admission })
}

fn known_version(v: &str) -> bool {
    api::subresources::VERSIONS.contains(&v)
}

async fn resource_list(Path(version): Path<String>) -> Response {
    if !known_version(&version) {
        return http::StatusCode::NOT_FOUND.into_response();
    }
    axum::Json(discovery::api_resource_list(&version)).into_response()
}

async fn version(Path(version): Path<String>) -> Response {
    if !known_version(&version) {
        return http::StatusCode::NOT_FOUND.into_response();
    }
    axum::Json(discovery::version_info()).into_response()
}

async fn admit(
    State(s): State<AppState>,
    Path(hook): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let path = format!("/{hook}");
    let review: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return (
                http::StatusCode::BAD_REQUEST,
                format!("the body is not an AdmissionReview: {e}"),
            )
                .into_response();
        }
    };
    match s.admission.admit(&path, &review).await {
        Some(answer) => axum::Json(answer).into_response(),
        None => (
            http::StatusCode::NOT_FOUND,
            format!("no admission webhook at {path}"),
        )
            .into_response(),
    }
}

async fn fallback(State(s): State<AppState>, req: http::Request<Body>) -> Response {
    Box::pin(subresource::serve(s.app, req)).await
}

/// The common name of a DER certificate's subject.
fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    cert.subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned)
}

/// Serves `app` on `listener` until `shutdown`; a client certificate, when offered, becomes
/// the request's [`Peer`] (TLS verified its chain; none means an anonymous caller: admission
/// webhooks, health checks).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ReloadingConfig>,
    app: Router,
    shutdown: CancellationToken,
) {
    let per_connection = move |certs: Option<&[rustls::pki_types::CertificateDer<'static>]>| {
        let peer = match certs {
            Some([leaf, ..]) => Peer {
                verified: true,
                common_name: common_name(leaf),
            },
            _ => Peer::default(),
        };
        app.clone().layer(axum::Extension(peer))
    };
    tlsconfig::serve_https(listener, tls, per_connection, shutdown).await;
}
