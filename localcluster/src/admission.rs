//! Admission webhooks: MutatingWebhookConfiguration and ValidatingWebhookConfiguration objects are
//! matched against each create and update, and called with an `admission.k8s.io/v1`
//! AdmissionReview over HTTPS, trusting the webhook's `caBundle`.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::patch;
use crate::resources::{GroupResource, ResourceDef};
use crate::selector::selector_matches;
use crate::store::{Objects, Store};

/// Mutating or validating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Mutating,
    Validating,
}

impl Phase {
    fn resource(self) -> GroupResource {
        GroupResource {
            group: "admissionregistration.k8s.io".into(),
            resource: match self {
                Self::Mutating => "mutatingwebhookconfigurations".into(),
                Self::Validating => "validatingwebhookconfigurations".into(),
            },
        }
    }
}

/// One request being admitted.
#[derive(Debug, Clone)]
pub struct Attributes<'a> {
    pub def: &'a ResourceDef,
    /// CREATE, UPDATE or DELETE.
    pub operation: &'a str,
    pub subresource: Option<&'a str>,
    pub namespace: Option<&'a str>,
    pub name: &'a str,
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// Whether any webhook configuration exists (requests skip admission entirely otherwise).
pub fn any_configured(objects: &Objects) -> bool {
    [Phase::Mutating, Phase::Validating]
        .iter()
        .any(|p| objects.bucket(&p.resource()).is_some_and(|b| !b.is_empty()))
}

/// Whether one of a webhook's `rules` covers the request.
pub fn rule_matches(rule: &Value, attrs: &Attributes<'_>) -> bool {
    let has = |field: &str, want: &str| {
        strings(&rule[field])
            .iter()
            .any(|v| *v == "*" || *v == want)
    };
    if !has("operations", attrs.operation)
        || !has("apiGroups", &attrs.def.group)
        || !has("apiVersions", &attrs.def.version)
    {
        return false;
    }
    let resource_ok = strings(&rule["resources"]).iter().any(|entry| {
        let (res, sub) = entry.split_once('/').unwrap_or((entry, ""));
        let res_ok = res == "*" || res == attrs.def.plural;
        let sub_ok = match (sub, attrs.subresource) {
            ("", None) | ("*", _) => true,
            (want, Some(have)) if !want.is_empty() => want == have,
            _ => false,
        };
        res_ok && sub_ok
    });
    let scope_ok = match rule["scope"].as_str() {
        Some("Cluster") => !attrs.def.namespaced,
        Some("Namespaced") => attrs.def.namespaced,
        _ => true,
    };
    resource_ok && scope_ok
}

/// The webhooks of one phase that apply to a request, with their configuration's name.
pub fn matching(
    objects: &Objects,
    phase: Phase,
    attrs: &Attributes<'_>,
    object: &Value,
) -> Vec<Value> {
    let Some(configs) = objects.bucket(&phase.resource()) else {
        return Vec::new();
    };
    let namespace_labels = attrs.namespace.and_then(|ns| {
        objects
            .get(
                &GroupResource {
                    group: String::new(),
                    resource: "namespaces".into(),
                },
                "",
                ns,
            )
            .map(|n| n["metadata"]["labels"].clone())
    });
    let mut hooks = Vec::new();
    for config in configs.values() {
        for hook in config["webhooks"].as_array().into_iter().flatten() {
            if !hook["rules"]
                .as_array()
                .is_some_and(|rules| rules.iter().any(|r| rule_matches(r, attrs)))
            {
                continue;
            }
            let ns_ok = match (&namespace_labels, hook.get("namespaceSelector")) {
                (Some(labels), Some(sel)) => selector_matches(sel, labels),
                _ => true,
            };
            let obj_ok = hook
                .get("objectSelector")
                .is_none_or(|sel| selector_matches(sel, &object["metadata"]["labels"]));
            if ns_ok && obj_ok {
                hooks.push(hook.clone());
            }
        }
    }
    hooks.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    hooks
}

/// The AdmissionReview request for a webhook.
pub fn review(attrs: &Attributes<'_>, uid: &str, object: &Value, old: Option<&Value>) -> Value {
    let d = attrs.def;
    let gvk = json!({"group": d.group, "version": d.version, "kind": d.kind});
    let gvr = json!({"group": d.group, "version": d.version, "resource": d.plural});
    let mut request = json!({
        "uid": uid,
        "kind": gvk,
        "resource": gvr,
        "requestKind": gvk,
        "requestResource": gvr,
        "name": attrs.name,
        "operation": attrs.operation,
        "userInfo": {"username": "localcluster-admin", "groups": ["system:masters", "system:authenticated"]},
        "object": object,
        "oldObject": old.cloned().unwrap_or(Value::Null),
        "dryRun": false,
        "options": Value::Null,
    });
    if let Some(ns) = attrs.namespace {
        request["namespace"] = json!(ns);
    }
    if let Some(sub) = attrs.subresource {
        request["subResource"] = json!(sub);
        request["requestSubResource"] = json!(sub);
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
}

/// Applies a webhook's AdmissionReview response: a denial becomes an error, a JSONPatch is
/// applied (mutating webhooks only).
pub fn apply_response(
    hook_name: &str,
    phase: Phase,
    object: &Value,
    response: &Value,
) -> Result<Value, ApiError> {
    let r = &response["response"];
    if r["allowed"].as_bool() != Some(true) {
        let status = &r["status"];
        let code = status["code"]
            .as_u64()
            .and_then(|c| u16::try_from(c).ok())
            .filter(|c| *c >= 400)
            .unwrap_or(400);
        let message = status["message"].as_str().unwrap_or("without explanation");
        return Err(ApiError::new(
            code,
            "Forbidden",
            format!("admission webhook \"{hook_name}\" denied the request: {message}"),
        ));
    }
    let Some(encoded) = r["patch"].as_str() else {
        return Ok(object.clone());
    };
    if phase == Phase::Validating {
        return Ok(object.clone());
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|e| {
            ApiError::internal(format!(
                "webhook \"{hook_name}\" sent a patch that is not base64: {e}"
            ))
        })?;
    let ops: Value = serde_json::from_slice(&raw).map_err(|e| {
        ApiError::internal(format!(
            "webhook \"{hook_name}\" sent a patch that is not JSON: {e}"
        ))
    })?;
    patch::json_patch(object, &ops).map_err(|e| {
        ApiError::internal(format!(
            "webhook \"{hook_name}\" sent a patch that does not apply: {e}"
        ))
    })
}

/// Where a webhook's client config points: (host for TLS, address to connect to, path).
type Endpoint = (String, String, String);

fn endpoint(objects: &Objects, hook: &Value) -> Result<Endpoint, String> {
    let cfg = &hook["clientConfig"];
    if let Some(url) = cfg["url"].as_str() {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| format!("webhook URL {url} is not https"))?;
        let (authority, path) = rest
            .split_once('/')
            .map_or((rest, "/".to_string()), |(a, p)| (a, format!("/{p}")));
        let host = authority
            .rsplit_once(':')
            .map_or(authority, |(h, _)| h)
            .trim_matches(|c| c == '[' || c == ']')
            .to_string();
        let addr = if authority.contains(':') && !authority.ends_with(']') {
            authority.to_string()
        } else {
            format!("{authority}:443")
        };
        return Ok((host, addr, path));
    }
    let svc = &cfg["service"];
    let (ns, name) = (
        svc["namespace"].as_str().unwrap_or_default(),
        svc["name"].as_str().unwrap_or_default(),
    );
    let port = svc["port"].as_u64().unwrap_or(443);
    let path = svc["path"].as_str().unwrap_or("/").to_string();
    let host = format!("{name}.{ns}.svc");
    // No service proxy here: dial the first endpoint address, else the cluster IP.
    let endpoints = objects.get(
        &GroupResource {
            group: String::new(),
            resource: "endpoints".into(),
        },
        ns,
        name,
    );
    let ip = endpoints
        .and_then(|e| {
            e["subsets"][0]["addresses"][0]["ip"]
                .as_str()
                .map(str::to_string)
        })
        .or_else(|| {
            objects
                .get(
                    &GroupResource {
                        group: String::new(),
                        resource: "services".into(),
                    },
                    ns,
                    name,
                )
                .and_then(|s| s["spec"]["clusterIP"].as_str().map(str::to_string))
        })
        .ok_or_else(|| format!("service {ns}/{name} has no endpoints"))?;
    Ok((host, format!("{ip}:{port}"), path))
}

/// Calls one webhook and returns its AdmissionReview response.
pub async fn call(
    objects_endpoint: Endpoint,
    ca_bundle: Option<&str>,
    review: &Value,
    timeout: Duration,
) -> Result<Value, String> {
    let (host, addr, path) = objects_endpoint;
    let mut roots = rustls::RootCertStore::empty();
    if let Some(b64) = ca_bundle {
        let pem = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| format!("caBundle is not base64: {e}"))?;
        for der in pem_certificates(&String::from_utf8_lossy(&pem)) {
            roots
                .add(CertificateDer::from(der))
                .map_err(|e| format!("caBundle certificate: {e}"))?;
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let server_name =
        ServerName::try_from(host.clone()).map_err(|e| format!("server name {host}: {e}"))?;
    let body = review.to_string();
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(&addr)
            .await
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        let tls = connector
            .connect(server_name, tcp)
            .await
            .map_err(|e| format!("TLS with {host}: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let request = http::Request::post(&path)
            .header(http::header::HOST, &host)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes::Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("{status}: {}", String::from_utf8_lossy(&bytes)));
        }
        serde_json::from_slice::<Value>(&bytes)
            .map_err(|e| format!("response is not an AdmissionReview: {e}"))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

/// The DER certificates of a PEM bundle.
fn pem_certificates(pem: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut inside = false;
    for line in pem.lines() {
        let line = line.trim();
        if line == "-----BEGIN CERTIFICATE-----" {
            inside = true;
            current.clear();
        } else if line == "-----END CERTIFICATE-----" {
            inside = false;
            if let Ok(der) = base64::engine::general_purpose::STANDARD.decode(&current) {
                out.push(der);
            }
        } else if inside {
            current.push_str(line);
        }
    }
    out
}

/// Runs the mutating then the validating webhooks that match; returns the (possibly mutated)
/// object.
pub async fn admit(
    store: &Store,
    attrs: &Attributes<'_>,
    object: Value,
    old: Option<&Value>,
) -> Result<Value, ApiError> {
    let mut object = object;
    for phase in [Phase::Mutating, Phase::Validating] {
        let hooks: Vec<(Value, Result<Endpoint, String>)> = store.read(|objs| {
            matching(objs, phase, attrs, &object)
                .into_iter()
                .map(|h| {
                    let ep = endpoint(objs, &h);
                    (h, ep)
                })
                .collect()
        });
        for (hook, ep) in hooks {
            let name = hook["name"].as_str().unwrap_or_default().to_string();
            let uid = uuid::Uuid::new_v4().to_string();
            let timeout = Duration::from_secs(hook["timeoutSeconds"].as_u64().unwrap_or(10));
            let outcome = match ep {
                Ok(ep) => {
                    call(
                        ep,
                        hook["clientConfig"]["caBundle"].as_str(),
                        &review(attrs, &uid, &object, old),
                        timeout,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            match outcome {
                Ok(response) => object = apply_response(&name, phase, &object, &response)?,
                Err(e) if hook["failurePolicy"].as_str() == Some("Ignore") => {
                    tracing::warn!(webhook = %name, error = %e, "ignoring a failed webhook call");
                }
                Err(e) => {
                    return Err(ApiError::internal(format!(
                        "Internal error occurred: failed calling webhook \"{name}\": {e}"
                    )));
                }
            }
        }
    }
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::builtins;

    fn attrs<'a>(def: &'a ResourceDef, op: &'a str, sub: Option<&'a str>) -> Attributes<'a> {
        Attributes {
            def,
            operation: op,
            subresource: sub,
            namespace: Some("ns"),
            name: "x",
        }
    }

    #[test]
    fn rules_match_operations_resources_and_scope() {
        let pods = builtins().into_iter().find(|d| d.plural == "pods").unwrap();
        let rule = json!({"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]});
        assert!(rule_matches(&rule, &attrs(&pods, "CREATE", None)));
        assert!(!rule_matches(&rule, &attrs(&pods, "UPDATE", None)));
        assert!(!rule_matches(
            &rule,
            &attrs(&pods, "CREATE", Some("status"))
        ));
        let status = json!({"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*/status"], "scope": "Namespaced"});
        assert!(rule_matches(
            &status,
            &attrs(&pods, "UPDATE", Some("status"))
        ));
        assert!(!rule_matches(&status, &attrs(&pods, "UPDATE", None)));
        let cluster = json!({"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*"], "scope": "Cluster"});
        assert!(!rule_matches(&cluster, &attrs(&pods, "CREATE", None)));
    }

    #[test]
    fn responses_deny_or_patch() {
        let obj = json!({"metadata": {"name": "x"}});
        let patch = base64::engine::general_purpose::STANDARD.encode(
            json!([{"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}]).to_string(),
        );
        let allowed = json!({"response": {"uid": "u", "allowed": true, "patchType": "JSONPatch", "patch": patch}});
        let out = apply_response("m", Phase::Mutating, &obj, &allowed).unwrap();
        assert_eq!(out["metadata"]["labels"]["a"], "b");
        assert_eq!(
            apply_response("v", Phase::Validating, &obj, &allowed).unwrap(),
            obj
        );
        let denied = json!({"response": {"uid": "u", "allowed": false, "status": {"message": "no way", "code": 422}}});
        let err = apply_response("v", Phase::Validating, &obj, &denied).unwrap_err();
        assert_eq!(err.code, 422);
        assert_eq!(
            err.message,
            "admission webhook \"v\" denied the request: no way"
        );
    }

    #[test]
    fn webhook_urls_resolve() {
        let objs = Objects::default();
        let hook = json!({"clientConfig": {"url": "https://127.0.0.1:8443/validate"}});
        assert_eq!(
            endpoint(&objs, &hook).unwrap(),
            (
                "127.0.0.1".into(),
                "127.0.0.1:8443".into(),
                "/validate".into()
            )
        );
        let svc = json!({"clientConfig": {"service": {"namespace": "kubevirt", "name": "virt-api", "path": "/x"}}});
        assert!(
            endpoint(&objs, &svc)
                .unwrap_err()
                .contains("kubevirt/virt-api")
        );
    }
}
