//! Admission webhooks: a real HTTPS webhook server (its own CA in `caBundle`) mutating and
//! validating through Mutating/ValidatingWebhookConfiguration objects.

mod common;

use axum::Json;
use base64::Engine as _;
use common::Cluster;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::{Api, ResourceExt as _};
use serde_json::{Value, json};

/// Mutating: labels the object `mutated=true`. Validating: refuses a `forbidden` data key.
async fn mutate(Json(review): Json<Value>) -> Json<Value> {
    let req = &review["request"];
    let has_labels = req["object"]["metadata"]["labels"].is_object();
    let patch = if has_labels {
        json!([{"op": "add", "path": "/metadata/labels/mutated", "value": "true"}])
    } else {
        json!([{"op": "add", "path": "/metadata/labels", "value": {"mutated": "true"}}])
    };
    Json(
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {
        "uid": req["uid"], "allowed": true, "patchType": "JSONPatch",
        "patch": base64::engine::general_purpose::STANDARD.encode(patch.to_string())}}),
    )
}

async fn validate(Json(review): Json<Value>) -> Json<Value> {
    let req = &review["request"];
    let forbidden = req["object"]["data"].get("forbidden").is_some();
    let mut response = json!({"uid": req["uid"], "allowed": !forbidden});
    if forbidden {
        response["status"] = json!({"code": 422, "message": format!("{} {} may not hold key forbidden", req["operation"].as_str().unwrap(), req["name"].as_str().unwrap())});
    }
    Json(
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}),
    )
}

/// Serves the webhook over HTTPS on a free port; returns (port, CA PEM, server task).
async fn webhook_server() -> (u16, String, tokio::task::JoinHandle<()>) {
    let certs = localcluster::tls::ServingCerts::generate().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(certs.server_config().unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new()
        .route("/mutate", axum::routing::post(mutate))
        .route("/validate", axum::routing::post(validate));
    let task = tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let acceptor = acceptor.clone();
            let service = hyper_util::service::TowerToHyperService::new(app.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                }
            });
        }
    });
    (port, certs.ca_pem, task)
}

fn configuration(kind: &str, hooks: &Value) -> (ApiResource, DynamicObject) {
    let plural = format!("{}s", kind.to_lowercase());
    let ar = ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: kind.into(),
        plural,
    };
    let obj = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
        "metadata": {"name": format!("test-{}", kind.to_lowercase())}, "webhooks": hooks}))
    .unwrap();
    (ar, obj)
}

fn hook(name: &str, url: &str, ca: &str, policy: &str) -> Value {
    json!({
        "name": name,
        "clientConfig": {"url": url, "caBundle": base64::engine::general_purpose::STANDARD.encode(ca)},
        "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"]}],
        "objectSelector": {"matchLabels": {"webhook": "on"}},
        "failurePolicy": policy,
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 5,
    })
}

fn cm(name: &str, webhook: bool, data: &Value) -> ConfigMap {
    let labels = if webhook {
        json!({"webhook": "on"})
    } else {
        json!({})
    };
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "data": data}))
        .unwrap()
}

#[tokio::test]
async fn webhooks_mutate_and_validate() {
    let c = Cluster::start().await;
    let (port, ca, server) = webhook_server().await;
    let base = format!("https://127.0.0.1:{port}");
    for (kind, path) in [
        ("MutatingWebhookConfiguration", "mutate"),
        ("ValidatingWebhookConfiguration", "validate"),
    ] {
        let (ar, obj) = configuration(
            kind,
            &json!([hook(
                &format!("{path}.example.com"),
                &format!("{base}/{path}"),
                &ca,
                "Fail"
            )]),
        );
        Api::<DynamicObject>::all_with(c.client.clone(), &ar)
            .create(&PostParams::default(), &obj)
            .await
            .unwrap();
    }
    let api = c.api::<ConfigMap>();
    let created = api
        .create(&PostParams::default(), &cm("a", true, &json!({"k": "v"})))
        .await
        .unwrap();
    assert_eq!(
        created.labels().get("mutated").map(String::as_str),
        Some("true")
    );
    let untouched = api
        .create(&PostParams::default(), &cm("b", false, &json!({})))
        .await
        .unwrap();
    assert!(
        !untouched.labels().contains_key("mutated"),
        "the object selector leaves b alone"
    );

    let err = api
        .create(
            &PostParams::default(),
            &cm("c", true, &json!({"forbidden": "x"})),
        )
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("expected a Status")
    };
    assert_eq!(status.code, 422);
    assert_eq!(
        status.message,
        "admission webhook \"validate.example.com\" denied the request: CREATE c may not hold key forbidden"
    );
    let err = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"forbidden": "y"}})),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 422 && s.message.contains("UPDATE a")));

    // Server-side apply is admitted too, as a create and as an update.
    let applied = |data: Value| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "ssa", "labels": {"webhook": "on"}}, "data": data})
    };
    let ssa = PatchParams::apply("tester");
    let created = api
        .patch("ssa", &ssa, &Patch::Apply(applied(json!({"k": "v"}))))
        .await
        .unwrap();
    assert_eq!(
        created.labels().get("mutated").map(String::as_str),
        Some("true")
    );
    let err = api
        .patch(
            "ssa",
            &ssa,
            &Patch::Apply(applied(json!({"forbidden": "v"}))),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(s) if s.code == 422 && s.message.contains("UPDATE ssa"))
    );

    // A webhook that cannot be reached: Ignore lets requests through, Fail refuses them.
    server.abort();
    let (ar, ignore) = configuration(
        "ValidatingWebhookConfiguration",
        &json!([hook(
            "gone.example.com",
            "https://127.0.0.1:1/validate",
            &ca,
            "Ignore"
        )]),
    );
    let validating = Api::<DynamicObject>::all_with(c.client.clone(), &ar);
    validating
        .patch(
            "test-validatingwebhookconfiguration",
            &PatchParams::default(),
            &Patch::Merge(json!({"webhooks": ignore.data["webhooks"]})),
        )
        .await
        .unwrap();
    let (mar, _) = configuration("MutatingWebhookConfiguration", &json!([]));
    Api::<DynamicObject>::all_with(c.client.clone(), &mar)
        .delete(
            "test-mutatingwebhookconfiguration",
            &kube::api::DeleteParams::default(),
        )
        .await
        .unwrap();
    api.create(
        &PostParams::default(),
        &cm("d", true, &json!({"forbidden": "z"})),
    )
    .await
    .unwrap();
    let (_, fail) = configuration(
        "ValidatingWebhookConfiguration",
        &json!([hook(
            "gone.example.com",
            "https://127.0.0.1:1/validate",
            &ca,
            "Fail"
        )]),
    );
    validating
        .patch(
            "test-validatingwebhookconfiguration",
            &PatchParams::default(),
            &Patch::Merge(json!({"webhooks": fail.data["webhooks"]})),
        )
        .await
        .unwrap();
    let err = api
        .create(&PostParams::default(), &cm("e", true, &json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 500 && s.message.contains("failed calling webhook \"gone.example.com\"")),
        "{err:?}"
    );
}
