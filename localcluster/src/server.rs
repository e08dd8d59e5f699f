//! The HTTP layer: routing of Kubernetes REST paths, content negotiation, authentication and the
//! watch stream. The rules themselves live in `rules`, `patch`, `fields`, `table` and `store`.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, Response, StatusCode, Uri, header};
use base64::Engine as _;
use chrono::{SecondsFormat, Utc};
use futures::SinkExt as _;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use crate::admission;
use crate::discovery::Registry;
use crate::error::ApiError;
use crate::events;
use crate::fields::{self, Writer};
use crate::patch::{self, ListKind};
use crate::resources::{GroupResource, ResourceDef};
use crate::rules::{self, Context, DeleteOptions};
use crate::schema;
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{Event, EventType, Outcome, Store, WatchStart};
use crate::table::{self, IncludeObject};

/// Shared server state.
#[derive(Debug)]
pub struct AppState {
    pub store: Store,
    /// Shared so each request takes a snapshot by cloning an `Arc`.
    pub registry: RwLock<Arc<Registry>>,
    pub token: String,
    pub bookmark_interval: Duration,
    /// Whether Orphan/Foreground deletion adds its finalizer (only when the garbage collector runs).
    pub gc_finalizers: bool,
}

type Query = HashMap<String, String>;

const JSON: &str = "application/json";
const TABLE_CT: &str = "application/json;as=Table;v=v1;g=meta.k8s.io";
const PARTIAL_CT: &str = "application/json;as=PartialObjectMetadata;v=v1;g=meta.k8s.io";
const PARTIAL_LIST_CT: &str = "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io";

/// What representation the client asked for in `Accept`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Object,
    Table,
    Partial,
}

/// The media types of the Accept header, in the client's order of preference, spaces removed.
fn accepted_media(headers: &HeaderMap) -> impl Iterator<Item = String> + '_ {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .split(',')
        .map(|media| media.replace(' ', ""))
}

fn shape(headers: &HeaderMap) -> Shape {
    // The first media type we can serve wins.
    for media in accepted_media(headers) {
        if !media.starts_with("application/json") && !media.starts_with("*/*") {
            continue;
        }
        if media.contains("as=Table") {
            return Shape::Table;
        }
        if media.contains("as=PartialObjectMetadata") {
            return Shape::Partial;
        }
        return Shape::Object;
    }
    Shape::Object
}

fn aggregated_discovery(headers: &HeaderMap) -> Option<&'static str> {
    for media in accepted_media(headers) {
        if media.contains("as=APIGroupDiscoveryList") && media.starts_with("application/json") {
            if media.contains("v=v2beta1") {
                return Some("v2beta1");
            }
            if media.contains("v=v2") {
                return Some("v2");
            }
        }
    }
    None
}

fn respond(code: StatusCode, content_type: &str, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from(body.to_string()))
        .expect("static response parts are valid")
}

pub(crate) fn error_response(err: &ApiError) -> Response<Body> {
    respond(
        StatusCode::from_u16(err.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        JSON,
        &err.status(),
    )
}

fn now() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// A random suffix as Kubernetes makes them for `generateName` (no vowels, no confusables).
fn name_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    uuid::Uuid::new_v4()
        .as_bytes()
        .iter()
        .take(5)
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect()
}

/// A parsed resource path.
#[derive(Debug, Clone)]
struct Target {
    def: ResourceDef,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
    legacy_watch: bool,
    /// `dryRun=All`: compute and answer, store nothing.
    dry_run: bool,
}

enum Route {
    Version,
    Health,
    Api,
    ApiVersion(String, String),
    Apis,
    Group(String),
    OpenApiV3Index,
    OpenApiV3(String, String),
    OpenApiV2,
    Resource(Box<Target>),
}

fn route(registry: &Registry, path: &str) -> Result<Route, ApiError> {
    let segs: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let (group, version, rest) = match segs.as_slice() {
        ["version"] => return Ok(Route::Version),
        ["healthz" | "readyz" | "livez", ..] => return Ok(Route::Health),
        ["openapi", "v2"] => return Ok(Route::OpenApiV2),
        ["openapi", "v3"] => return Ok(Route::OpenApiV3Index),
        ["openapi", "v3", "api", v] => return Ok(Route::OpenApiV3(String::new(), (*v).into())),
        ["openapi", "v3", "apis", g, v] => {
            return Ok(Route::OpenApiV3((*g).into(), (*v).into()));
        }
        ["api"] => return Ok(Route::Api),
        ["apis"] => return Ok(Route::Apis),
        ["api", v] => return Ok(Route::ApiVersion(String::new(), (*v).into())),
        ["apis", g] => return Ok(Route::Group((*g).into())),
        ["apis", g, v] => return Ok(Route::ApiVersion((*g).into(), (*v).into())),
        ["api", v, rest @ ..] => (String::new(), (*v).to_string(), rest),
        ["apis", g, v, rest @ ..] => ((*g).to_string(), (*v).to_string(), rest),
        _ => return Err(ApiError::path_not_found(path)),
    };
    let (legacy_watch, rest) = match rest {
        ["watch", r @ ..] => (true, r),
        r => (false, r),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, r @ ..] if !r.is_empty() && !matches!(r, ["status" | "finalize"]) => {
            (Some((*ns).to_string()), r)
        }
        r => (None, r),
    };
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some((*n).to_string()), None),
        [p, n, s] => (*p, Some((*n).to_string()), Some((*s).to_string())),
        _ => return Err(ApiError::path_not_found(path)),
    };
    let def = registry
        .find(&group, &version, plural)
        .cloned()
        .ok_or_else(|| ApiError::path_not_found(path))?;
    if let Some(s) = &sub
        && !def.subresource_names().contains(s)
    {
        return Err(ApiError::path_not_found(path));
    }
    if namespace.is_some() && !def.namespaced {
        return Err(ApiError::path_not_found(path));
    }
    Ok(Route::Resource(Box::new(Target {
        def,
        namespace,
        name,
        sub,
        legacy_watch,
        dry_run: false,
    })))
}

pub(crate) fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| t.trim() == state.token)
}

/// The one handler: every request goes through here.
pub async fn handle(
    State(state): State<Arc<AppState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    let query: Query = uri
        .query()
        .map(|q| {
            url_pairs(q)
                .into_iter()
                .collect::<HashMap<String, String>>()
        })
        .unwrap_or_default();
    let path = uri.path().to_string();
    let result = dispatch(&state, &method, &path, &query, &headers, &body).await;
    match result {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(%method, %path, code = e.code, message = %e.message, "request failed");
            error_response(&e)
        }
    }
}

/// Decodes `application/x-www-form-urlencoded` query pairs.
pub(crate) fn url_pairs(q: &str) -> Vec<(String, String)> {
    fn decode(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'+' => out.push(b' '),
                b'%' if i + 2 < bytes.len() => {
                    match std::str::from_utf8(&bytes[i + 1..i + 3])
                        .ok()
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        Some(b) => {
                            out.push(b);
                            i += 2;
                        }
                        None => out.push(b'%'),
                    }
                }
                b => out.push(b),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

async fn dispatch(
    state: &Arc<AppState>,
    method: &Method,
    path: &str,
    query: &Query,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    let registry = state
        .registry
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let route = route(&registry, path)?;
    if !matches!(route, Route::Version | Route::Health) && !authorized(state, headers) {
        return Err(ApiError::unauthorized());
    }
    let ok = |v: &Value| Ok(respond(StatusCode::OK, JSON, v));
    match route {
        Route::Health => Ok(Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/plain")
            .body(Body::from("ok"))
            .expect("static response")),
        Route::Version => ok(&json!({
            "major": "1", "minor": "32", "gitVersion": "v1.32.0-localcluster",
            "gitCommit": "", "gitTreeState": "clean", "buildDate": "2024-12-11T00:00:00Z",
            "goVersion": "go1.23", "compiler": "rustc", "platform": "linux/amd64",
        })),
        Route::Api => match aggregated_discovery(headers) {
            Some(v) => Ok(respond(
                StatusCode::OK,
                &format!("application/json;g=apidiscovery.k8s.io;v={v};as=APIGroupDiscoveryList"),
                &registry.aggregated(true, &format!("apidiscovery.k8s.io/{v}")),
            )),
            None => ok(&json!({"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})),
        },
        Route::Apis => match aggregated_discovery(headers) {
            Some(v) => Ok(respond(
                StatusCode::OK,
                &format!("application/json;g=apidiscovery.k8s.io;v={v};as=APIGroupDiscoveryList"),
                &registry.aggregated(false, &format!("apidiscovery.k8s.io/{v}")),
            )),
            None => ok(&registry.group_list()),
        },
        Route::Group(g) => registry
            .group(&g)
            .map_or_else(|| Err(ApiError::path_not_found(path)), |v| ok(&v)),
        Route::ApiVersion(g, v) => {
            if registry.version_exists(&g, &v) {
                ok(&registry.resource_list(&g, &v))
            } else {
                Err(ApiError::path_not_found(path))
            }
        }
        Route::OpenApiV3Index => ok(&registry.openapi_index(&state.store.current_rv().to_string())),
        Route::OpenApiV3(g, v) => registry
            .openapi_document(&g, &v)
            .map_or_else(|| Err(ApiError::path_not_found(path)), |d| ok(&d)),
        Route::OpenApiV2 => Err(ApiError::path_not_found(path)),
        Route::Resource(target) => {
            resource(state, &registry, method, *target, query, headers, body).await
        }
    }
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    // Kubernetes' protobuf envelope starts with "k8s\0"; there are no protobuf schemas here.
    if body.starts_with(b"k8s\0") {
        return Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            "this server accepts JSON and YAML request bodies only, not protobuf",
        ));
    }
    serde_json::from_slice(body).or_else(|json_err| {
        serde_yaml::from_slice::<Value>(body).map_err(|_| {
            ApiError::bad_request(format!("the request body is not valid JSON: {json_err}"))
        })
    })
}

/// `fieldValidation=Strict` for custom resources: fields the schema does not declare are an error
/// instead of being pruned silently.
fn strict_check(def: &ResourceDef, strict: bool, obj: &Value) -> Result<(), ApiError> {
    let Some(s) = def.schema.as_ref().filter(|_| strict && def.custom) else {
        return Ok(());
    };
    let mut copy = obj.clone();
    let removed = schema::prune(&mut copy, s);
    if removed.is_empty() {
        return Ok(());
    }
    let fields: Vec<String> = removed
        .iter()
        .map(|p| format!("unknown field \"{}\"", p.trim_start_matches('.')))
        .collect();
    Err(ApiError::bad_request(format!(
        "{kind} in version \"{version}\" cannot be handled as a {kind}: strict decoding error: {}",
        fields.join(", "),
        kind = def.kind,
        version = def.version,
    )))
}

fn is_strict(query: &Query) -> bool {
    query.get("fieldValidation").is_some_and(|v| v == "Strict")
}

/// The object as `def`'s version serves it (events are converted between their two versions).
fn with_version(def: &ResourceDef, obj: Value) -> Value {
    events::convert(obj, &def.api_version())
}

fn kinds_for(def: &ResourceDef) -> impl Fn(&[String]) -> ListKind + '_ {
    move |path: &[String]| match &def.schema {
        Some(s) if def.custom => schema::list_kind(s, path),
        _ => patch::builtin_list_kind(path),
    }
}

fn manager(query: &Query, headers: &HeaderMap) -> String {
    query.get("fieldManager").cloned().unwrap_or_else(|| {
        headers
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .and_then(|ua| ua.split('/').next())
            .filter(|s| !s.is_empty())
            .unwrap_or("unknown")
            .chars()
            .take(128)
            .collect()
    })
}

async fn resource(
    state: &Arc<AppState>,
    registry: &Registry,
    method: &Method,
    target: Target,
    query: &Query,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    if target.sub.as_deref() == Some("log") {
        if *method != Method::GET {
            return Err(ApiError::method_not_allowed(format!(
                "the server does not allow this method on the requested resource: {method}"
            )));
        }
        return crate::logs::pod_log(
            state,
            &ns_key(&target),
            target.name.as_deref().unwrap_or_default(),
            query,
        );
    }
    if matches!(*method, Method::POST | Method::PUT) && !body.is_empty() {
        body_media_type(&content_type(headers))?;
    }
    let mut target = target;
    target.dry_run = query.get("dryRun").is_some_and(|d| d == "All");
    let watch = target.legacy_watch || query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let response = match (method.clone(), target.name.is_some()) {
        (Method::GET, false) if watch => return watch_response(state, &target, query, headers),
        (Method::GET, true) if watch => {
            let mut q = query.clone();
            let name = target.name.clone().unwrap_or_default();
            let mut target = target;
            target.name = None;
            q.insert("fieldSelector".into(), format!("metadata.name={name}"));
            return watch_response(state, &target, &q, headers);
        }
        (Method::GET, false) => list(state, &target, query, headers),
        (Method::GET, true) => get(state, &target, headers),
        (Method::POST, false) => create(state, &target, query, headers, body).await,
        (Method::POST, true) if target.sub.as_deref() == Some("binding") => {
            bind(state, &target, body)
        }
        (Method::PUT, true) => update(state, &target, query, headers, body).await,
        (Method::PATCH, true) => patch(state, &target, query, headers, body).await,
        (Method::DELETE, true) => delete(state, &target, query, body),
        (Method::DELETE, false) => delete_collection(state, &target, query, body),
        (m, _) => Err(ApiError::method_not_allowed(format!(
            "the server does not allow this method on the requested resource: {m}"
        ))),
    }?;
    if target.def.group == "apiextensions.k8s.io"
        && target.def.plural == "customresourcedefinitions"
        && *method != Method::GET
    {
        refresh_registry(state, registry);
    }
    Ok(response)
}

/// Rebuilds the served resources from the CRDs in the store, and drops the objects of CRDs
/// that are gone.
fn refresh_registry(state: &AppState, old: &Registry) {
    let crd_gr = GroupResource {
        group: "apiextensions.k8s.io".into(),
        resource: "customresourcedefinitions".into(),
    };
    let (crds, _) = state.store.list(&crd_gr, None);
    let fresh = Registry::with_crds(crds.iter());
    for gone in old
        .defs()
        .iter()
        .filter(|d| d.custom && fresh.any_version(&d.group, &d.plural).is_none())
    {
        let gr = gone.group_resource();
        let (objs, _) = state.store.list(&gr, None);
        for obj in objs {
            let ns = obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let name = obj["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let _ = state.store.mutate(&gr, &ns, &name, |_, cur| {
                Ok(Outcome::Delete(cur.cloned().unwrap_or(obj)))
            });
        }
    }
    *state
        .registry
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(fresh);
}

/// Applies a mutation, or only evaluates it for a dry run.
fn write(
    state: &AppState,
    dry_run: bool,
    gr: &GroupResource,
    namespace: &str,
    name: &str,
    f: impl FnOnce(&crate::store::Objects, Option<&Value>) -> Result<Outcome, ApiError>,
) -> Result<Value, ApiError> {
    // Callers compute in the requested version; the store keeps its own form.
    let f = |objs: &crate::store::Objects, cur: Option<&Value>| {
        Ok(match f(objs, cur)? {
            Outcome::Put(v) => Outcome::Put(events::to_storage(gr, v)),
            Outcome::Delete(v) => Outcome::Delete(events::to_storage(gr, v)),
            Outcome::Unchanged(v) => Outcome::Unchanged(v),
        })
    };
    if dry_run {
        state.store.dry_run(gr, namespace, name, f)
    } else {
        state.store.mutate(gr, namespace, name, f)
    }
}

fn ns_key(target: &Target) -> String {
    target.namespace.clone().unwrap_or_default()
}

fn get(state: &AppState, target: &Target, headers: &HeaderMap) -> Result<Response<Body>, ApiError> {
    let def = &target.def;
    let name = target.name.as_deref().unwrap_or_default();
    let obj = state
        .store
        .get(&def.group_resource(), &ns_key(target), name)
        .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
    let obj = with_version(def, obj);
    if target.sub.as_deref() == Some("scale") {
        return Ok(respond(StatusCode::OK, JSON, &scale_of(def, &obj)));
    }
    Ok(match shape(headers) {
        Shape::Table => respond(
            StatusCode::OK,
            TABLE_CT,
            &table::render(
                def,
                std::slice::from_ref(&obj),
                IncludeObject::Metadata,
                true,
                obj["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap_or_default(),
                Utc::now(),
            ),
        ),
        Shape::Partial => respond(StatusCode::OK, PARTIAL_CT, &table::partial_metadata(&obj)),
        Shape::Object => respond(StatusCode::OK, JSON, &obj),
    })
}

/// A client's filter on a list or watch.
struct Filter {
    labels: LabelSelector,
    fields: FieldSelector,
}

impl Filter {
    fn parse(def: &ResourceDef, query: &Query) -> Result<Self, ApiError> {
        let labels = LabelSelector::parse(query.get("labelSelector").map_or("", String::as_str))
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let fields = FieldSelector::parse(
            query.get("fieldSelector").map_or("", String::as_str),
            &def.group,
            &def.plural,
        )
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok(Self { labels, fields })
    }

    fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }
}

/// The continue token: the list's resourceVersion and the last key returned.
fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(json!({"rv": rv, "ns": ns, "name": name}).to_string())
}

fn decode_continue(token: &str) -> Result<(u64, String, String), ApiError> {
    let bad = || ApiError::bad_request(format!("continue key is not valid: {token}"));
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
    Ok((
        v["rv"].as_u64().ok_or_else(bad)?,
        v["ns"].as_str().ok_or_else(bad)?.to_string(),
        v["name"].as_str().ok_or_else(bad)?.to_string(),
    ))
}

fn list(
    state: &AppState,
    target: &Target,
    query: &Query,
    headers: &HeaderMap,
) -> Result<Response<Body>, ApiError> {
    let def = &target.def;
    let filter = Filter::parse(def, query)?;
    let (items, current_rv) = state
        .store
        .list(&def.group_resource(), target.namespace.as_deref());
    let mut list_rv = current_rv;
    let mut items: Vec<Value> = items.into_iter().filter(|o| filter.matches(o)).collect();
    if let Some(token) = query.get("continue").filter(|t| !t.is_empty()) {
        let (rv, ns, name) = decode_continue(token)?;
        if rv < state.store.compacted_rv() {
            return Err(ApiError::expired(
                "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
            ));
        }
        list_rv = rv;
        items.retain(|o| {
            let key = (
                o["metadata"]["namespace"].as_str().unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap_or_default(),
            );
            key > (ns.as_str(), name.as_str())
        });
    }
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if let Some(limit) = query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        && items.len() > limit
    {
        let remaining = items.len() - limit;
        items.truncate(limit);
        let last = &items[limit - 1]["metadata"];
        metadata["continue"] = json!(encode_continue(
            list_rv,
            last["namespace"].as_str().unwrap_or_default(),
            last["name"].as_str().unwrap_or_default(),
        ));
        metadata["remainingItemCount"] = json!(remaining);
    }
    let items: Vec<Value> = items.into_iter().map(|o| with_version(def, o)).collect();
    Ok(match shape(headers) {
        Shape::Table => {
            let mut t = table::render(
                def,
                &items,
                IncludeObject::parse(query.get("includeObject").map(String::as_str)),
                true,
                &list_rv.to_string(),
                Utc::now(),
            );
            t["metadata"] = metadata;
            respond(StatusCode::OK, TABLE_CT, &t)
        }
        Shape::Partial => respond(
            StatusCode::OK,
            PARTIAL_LIST_CT,
            &json!({
                "kind": "PartialObjectMetadataList",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": metadata,
                "items": items.iter().map(table::partial_metadata).collect::<Vec<_>>(),
            }),
        ),
        Shape::Object => respond(
            StatusCode::OK,
            JSON,
            &json!({
                "kind": def.list_kind(),
                "apiVersion": def.api_version(),
                "metadata": metadata,
                "items": items,
            }),
        ),
    })
}

fn writer_time() -> String {
    now()
}

async fn create(
    state: &AppState,
    target: &Target,
    query: &Query,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    let def = &target.def;
    if target.sub.is_some() {
        return Err(ApiError::method_not_allowed(
            "create is not allowed on this subresource",
        ));
    }
    let mut obj = parse_body(body)?;
    rules::check_type(def, &mut obj)?;
    strict_check(def, is_strict(query), &obj)?;
    let suffix = name_suffix();
    let name = match obj["metadata"]["name"].as_str().filter(|n| !n.is_empty()) {
        Some(n) => n.to_string(),
        None => format!(
            "{}{suffix}",
            obj["metadata"]["generateName"].as_str().unwrap_or_default()
        ),
    };
    let ns = ns_key(target);
    if state.store.read(admission::any_configured) {
        obj["metadata"]["name"] = json!(name);
        if let Some(ns) = &target.namespace {
            obj["metadata"]["namespace"] = json!(ns);
        }
        let attrs = admission::Attributes {
            def,
            operation: "CREATE",
            subresource: None,
            namespace: target.namespace.as_deref(),
            name: &name,
        };
        obj = admission::admit(&state.store, &attrs, obj, None).await?;
    }
    let time = writer_time();
    let uid = uuid::Uuid::new_v4().to_string();
    let manager = manager(query, headers);
    let api_version = def.api_version();
    let kinds = kinds_for(def);
    let created = write(
        state,
        target.dry_run,
        &def.group_resource(),
        &ns,
        &name,
        |objs, cur| {
            if cur.is_some() {
                return Err(ApiError::already_exists(&def.group, &def.plural, &name));
            }
            let ctx = Context {
                now: &time,
                uid: &uid,
                suffix: &suffix,
            };
            let mut obj = rules::prepare_create(def, obj, target.namespace.as_deref(), objs, &ctx)?;
            if let Some(m) = obj["metadata"].as_object_mut() {
                m.remove("managedFields");
            }
            let w = Writer {
                manager: &manager,
                api_version: &api_version,
                subresource: "",
                time: &time,
                with_status: true,
            };
            fields::record_update(None, &mut obj, &w, &kinds);
            Ok(Outcome::Put(obj))
        },
    )?;
    Ok(respond(
        StatusCode::CREATED,
        JSON,
        &with_version(def, created),
    ))
}

/// Updates an existing object with `change`, which computes the new object from the current one.
/// With admission webhooks configured, the change is computed and admitted outside the store lock
/// and retried when the object changed meanwhile.
async fn modify(
    state: &AppState,
    target: &Target,
    change: impl Fn(&Value) -> Result<Value, ApiError>,
    manager: &str,
) -> Result<Value, ApiError> {
    if !state.store.read(admission::any_configured) {
        return modify_locked(state, target, change, manager);
    }
    let def = &target.def;
    let name = target.name.clone().unwrap_or_default();
    let attrs = admission::Attributes {
        def,
        operation: "UPDATE",
        subresource: target.sub.as_deref(),
        namespace: target.namespace.as_deref(),
        name: &name,
    };
    let mut attempts = 0;
    loop {
        attempts += 1;
        let cur = state
            .store
            .get(&def.group_resource(), &ns_key(target), &name)
            .ok_or_else(|| ApiError::not_found(&def.group, &def.plural, &name))?;
        let cur = with_version(def, cur);
        let wanted = change(&cur)?;
        let admitted = admission::admit(&state.store, &attrs, wanted, Some(&cur)).await?;
        match modify_locked(state, target, |_| Ok(admitted.clone()), manager) {
            Err(e) if e.code == 409 && attempts < 5 => {}
            other => return other,
        }
    }
}

fn modify_locked(
    state: &AppState,
    target: &Target,
    change: impl FnOnce(&Value) -> Result<Value, ApiError>,
    manager: &str,
) -> Result<Value, ApiError> {
    let def = &target.def;
    let name = target.name.clone().unwrap_or_default();
    let time = writer_time();
    let api_version = def.api_version();
    let kinds = kinds_for(def);
    let sub = target.sub.as_deref();
    write(
        state,
        target.dry_run,
        &def.group_resource(),
        &ns_key(target),
        &name,
        |_, cur| {
            let cur = cur.ok_or_else(|| ApiError::not_found(&def.group, &def.plural, &name))?;
            let cur = with_version(def, cur.clone());
            let wanted = change(&cur)?;
            let mut new = match sub {
                Some("finalize") => {
                    let mut out = cur.clone();
                    out["spec"]["finalizers"] = wanted["spec"]["finalizers"].clone();
                    out
                }
                _ => rules::prepare_update(def, &cur, wanted, sub)?,
            };
            let w = Writer {
                manager,
                api_version: &api_version,
                subresource: sub.unwrap_or_default(),
                time: &time,
                with_status: sub == Some("status") || !def.status,
            };
            fields::record_update(Some(&cur), &mut new, &w, &kinds);
            Ok(rules::finish_update(&cur, new))
        },
    )
    .map(|v| with_version(def, v))
}

async fn update(
    state: &AppState,
    target: &Target,
    query: &Query,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    let body = parse_body(body)?;
    if let Some(n) = body["metadata"]["name"].as_str()
        && Some(n) != target.name.as_deref()
    {
        return Err(ApiError::bad_request(
            "the name of the object does not match the name on the URL",
        ));
    }
    if target.sub.as_deref() == Some("scale") {
        let obj = set_scale(
            state,
            target,
            &body["spec"]["replicas"],
            &manager(query, headers),
        )
        .await?;
        return Ok(respond(StatusCode::OK, JSON, &scale_of(&target.def, &obj)));
    }
    let strict = is_strict(query);
    let obj = modify(
        state,
        target,
        |_| {
            strict_check(&target.def, strict, &body)?;
            Ok(body.clone())
        },
        &manager(query, headers),
    )
    .await?;
    Ok(respond(StatusCode::OK, JSON, &obj))
}

/// Create and update bodies are JSON or YAML (no protobuf schemas here): anything else, by
/// `Content-Type`, is 415 with kube-apiserver's message listing what is accepted. No header
/// at all is taken as JSON, as kube-apiserver's decoder sniffs it.
fn body_media_type(content_type: &str) -> Result<(), ApiError> {
    match content_type {
        "" | "application/json" | "application/yaml" | "text/yaml" | "*/*" => Ok(()),
        other => Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml; got {other}"
            ),
        )),
    }
}

fn content_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_string()
}

async fn patch(
    state: &AppState,
    target: &Target,
    query: &Query,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    let def = &target.def;
    let ct = content_type(headers);
    if ct == "application/apply-patch+yaml" {
        return server_side_apply(state, target, query, body).await;
    }
    let patch_doc = parse_body(body)?;
    let apply_patch = |cur: &Value| -> Result<Value, ApiError> {
        let bad = |e: patch::PatchError| ApiError::new(422, "Invalid", e.to_string());
        match ct.as_str() {
            "application/json-patch+json" => patch::json_patch(cur, &patch_doc).map_err(bad),
            "application/merge-patch+json" => Ok(patch::merge_patch(cur, &patch_doc)),
            "application/strategic-merge-patch+json" if !def.custom => {
                patch::strategic_merge_patch(cur, &patch_doc).map_err(bad)
            }
            other => Err(ApiError::unsupported_media_type(other)),
        }
    };
    let manager = manager(query, headers);
    if target.sub.as_deref() == Some("scale") {
        let cur = state
            .store
            .get(
                &def.group_resource(),
                &ns_key(target),
                target.name.as_deref().unwrap_or_default(),
            )
            .ok_or_else(|| {
                ApiError::not_found(
                    &def.group,
                    &def.plural,
                    target.name.as_deref().unwrap_or_default(),
                )
            })?;
        let scale = apply_patch(&scale_of(def, &cur))?;
        let obj = set_scale(state, target, &scale["spec"]["replicas"], &manager).await?;
        return Ok(respond(StatusCode::OK, JSON, &scale_of(def, &obj)));
    }
    let strict = is_strict(query);
    let obj = modify(
        state,
        target,
        |cur| {
            let patched = apply_patch(cur)?;
            strict_check(def, strict, &patched)?;
            Ok(patched)
        },
        &manager,
    )
    .await?;
    Ok(respond(StatusCode::OK, JSON, &obj))
}

async fn server_side_apply(
    state: &AppState,
    target: &Target,
    query: &Query,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    let def = &target.def;
    let manager = query
        .get("fieldManager")
        .filter(|m| !m.is_empty())
        .cloned()
        .ok_or_else(|| {
            ApiError::bad_request(
                "PATCH, application/apply-patch+yaml requests require a fieldManager parameter",
            )
        })?;
    let force = query.get("force").is_some_and(|f| f == "true");
    let mut applied: Value = serde_yaml::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
    rules::check_type(def, &mut applied)?;
    strict_check(def, is_strict(query), &applied)?;
    let name = target.name.clone().unwrap_or_default();
    // Like kube-apiserver, an applied configuration may leave the name to the URL.
    if applied["metadata"]["name"]
        .as_str()
        .is_none_or(str::is_empty)
    {
        applied["metadata"]["name"] = json!(name);
    }
    if applied["metadata"]["name"].as_str() != Some(name.as_str()) {
        return Err(ApiError::bad_request(
            "the name of the object does not match the name on the URL",
        ));
    }
    let sub = target.sub.as_deref();
    if sub.is_none()
        && def.status
        && let Some(m) = applied.as_object_mut()
    {
        m.remove("status");
    }
    let ns = ns_key(target);
    let time = writer_time();
    let uid = uuid::Uuid::new_v4().to_string();
    let api_version = def.api_version();
    let kinds = kinds_for(def);
    let w = Writer {
        manager: &manager,
        api_version: &api_version,
        subresource: sub.unwrap_or_default(),
        time: &time,
        with_status: sub == Some("status") || !def.status,
    };
    let conflict = |conflicts: Vec<fields::Conflict>| {
        let text: Vec<String> = conflicts
            .iter()
            .map(|c| format!("conflict with \"{}\": {}", c.manager, c.path))
            .collect();
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|c| json!({"reason": "FieldManagerConflict", "message": format!("conflict with \"{}\"", c.manager), "field": c.path}))
            .collect();
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Apply failed with {} conflict{}: {}",
                conflicts.len(),
                if conflicts.len() == 1 { "" } else { "s" },
                text.join("\n")
            ),
        )
        .with_details(
            json!({"name": name, "group": def.group, "kind": def.plural, "causes": causes}),
        )
    };
    let compute = |objs: &crate::store::Objects,
                   cur: Option<&Value>|
     -> Result<(Outcome, bool), ApiError> {
        match cur {
            None => {
                if sub.is_some() {
                    return Err(ApiError::not_found(&def.group, &def.plural, &name));
                }
                let merged = fields::apply(None, &applied, &w, force, &kinds).map_err(conflict)?;
                let ctx = Context {
                    now: &time,
                    uid: &uid,
                    suffix: "",
                };
                let obj =
                    rules::prepare_create(def, merged, target.namespace.as_deref(), objs, &ctx)?;
                Ok((Outcome::Put(obj), true))
            }
            Some(cur) => {
                let cur = with_version(def, cur.clone());
                let merged = match fields::apply(Some(&cur), &applied, &w, force, &kinds) {
                    Err(conflicts)
                        if fields::client_side_apply_upgrade(&cur, &conflicts, &kinds) =>
                    {
                        fields::apply(Some(&cur), &applied, &w, true, &kinds).map_err(conflict)?
                    }
                    other => other.map_err(conflict)?,
                };
                let managed = merged["metadata"]["managedFields"].clone();
                let mut new = rules::prepare_update(def, &cur, merged, sub)?;
                new["metadata"]["managedFields"] = managed;
                Ok((rules::finish_update(&cur, new), false))
            }
        }
    };
    let gr = def.group_resource();
    let (obj, created) = if state.store.read(admission::any_configured) {
        // Admission runs outside the store lock: compute, admit, then store if nothing changed.
        let mut attempts = 0;
        loop {
            attempts += 1;
            let (outcome, created, cur) = state.store.read(|objs| {
                let cur = objs.get(&gr, &ns, &name).cloned();
                compute(objs, cur.as_ref()).map(|(o, c)| (o, c, cur))
            })?;
            let candidate = match outcome {
                Outcome::Unchanged(v) => break (v, false),
                Outcome::Put(v) | Outcome::Delete(v) => v,
            };
            let attrs = admission::Attributes {
                def,
                operation: if created { "CREATE" } else { "UPDATE" },
                subresource: sub,
                namespace: target.namespace.as_deref(),
                name: &name,
            };
            let admitted = admission::admit(&state.store, &attrs, candidate, cur.as_ref()).await?;
            let expected = cur
                .as_ref()
                .map(|c| c["metadata"]["resourceVersion"].clone());
            let stored = write(state, target.dry_run, &gr, &ns, &name, |_, now| {
                if now.map(|n| n["metadata"]["resourceVersion"].clone()) != expected {
                    return Err(ApiError::conflict(
                        &def.group,
                        &def.plural,
                        &name,
                        "the object has been modified; please apply your changes to the latest version and try again",
                    ));
                }
                Ok(match now {
                    None => Outcome::Put(admitted.clone()),
                    Some(now) => {
                        rules::finish_update(&with_version(def, now.clone()), admitted.clone())
                    }
                })
            });
            match stored {
                Err(e) if e.code == 409 && attempts < 5 => {}
                other => break (other?, created),
            }
        }
    } else {
        let mut created = false;
        let obj = write(state, target.dry_run, &gr, &ns, &name, |objs, cur| {
            let (outcome, c) = compute(objs, cur)?;
            created = c;
            Ok(outcome)
        })?;
        (obj, created)
    };
    let code = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(respond(code, JSON, &with_version(def, obj)))
}

fn delete_options(query: &Query, body: &Bytes) -> Result<DeleteOptions, ApiError> {
    let mut opts = DeleteOptions::from_body(&parse_body(body)?);
    if let Some(g) = query.get("gracePeriodSeconds").and_then(|g| g.parse().ok()) {
        opts.grace_period_seconds = Some(g);
    }
    if let Some(p) = query.get("propagationPolicy") {
        opts.propagation_policy = Some(p.clone());
    }
    Ok(opts)
}

fn delete_one(
    state: &AppState,
    def: &ResourceDef,
    ns: &str,
    name: &str,
    opts: &DeleteOptions,
    dry_run: bool,
) -> Result<Value, ApiError> {
    let time = now();
    write(state, dry_run, &def.group_resource(), ns, name, |_, cur| {
        let cur = cur.ok_or_else(|| ApiError::not_found(&def.group, &def.plural, name))?;
        rules::prepare_delete(def, cur, opts, &time, state.gc_finalizers)
    })
    .map(|v| with_version(def, v))
}

fn delete(
    state: &AppState,
    target: &Target,
    query: &Query,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    if target.sub.is_some() {
        return Err(ApiError::method_not_allowed(
            "delete is not allowed on a subresource",
        ));
    }
    let opts = delete_options(query, body)?;
    let obj = delete_one(
        state,
        &target.def,
        &ns_key(target),
        target.name.as_deref().unwrap_or_default(),
        &opts,
        target.dry_run,
    )?;
    Ok(respond(StatusCode::OK, JSON, &obj))
}

fn delete_collection(
    state: &AppState,
    target: &Target,
    query: &Query,
    body: &Bytes,
) -> Result<Response<Body>, ApiError> {
    let def = &target.def;
    let filter = Filter::parse(def, query)?;
    let opts = delete_options(query, body)?;
    let (items, _) = state
        .store
        .list(&def.group_resource(), target.namespace.as_deref());
    let mut deleted = Vec::new();
    for obj in items.iter().filter(|o| filter.matches(o)) {
        let ns = obj["metadata"]["namespace"].as_str().unwrap_or_default();
        let name = obj["metadata"]["name"].as_str().unwrap_or_default();
        match delete_one(state, def, ns, name, &opts, target.dry_run) {
            Ok(v) => deleted.push(v),
            Err(e) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(respond(
        StatusCode::OK,
        JSON,
        &json!({"kind": def.list_kind(), "apiVersion": def.api_version(),
                "metadata": {"resourceVersion": state.store.current_rv().to_string()}, "items": deleted}),
    ))
}

fn bind(state: &AppState, target: &Target, body: &Bytes) -> Result<Response<Body>, ApiError> {
    let binding = parse_body(body)?;
    let node = binding["target"]["name"]
        .as_str()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            ApiError::invalid(
                "Binding",
                "",
                &[("target.name".into(), "Required value".into())],
            )
        })?
        .to_string();
    let def = &target.def;
    let name = target.name.clone().unwrap_or_default();
    let time = now();
    state
        .store
        .mutate(&def.group_resource(), &ns_key(target), &name, |_, cur| {
            let cur = cur.ok_or_else(|| ApiError::not_found(&def.group, &def.plural, &name))?;
            if let Some(uid) = binding["metadata"]["uid"].as_str()
                && cur["metadata"]["uid"].as_str() != Some(uid)
            {
                return Err(ApiError::conflict(
                    "",
                    "pods",
                    &name,
                    &format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                        cur["metadata"]["uid"].as_str().unwrap_or_default()
                    ),
                ));
            }
            if let Some(existing) = cur["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
                return Err(ApiError::conflict(
                    "",
                    "pods",
                    &name,
                    &format!("pod {name} is already assigned to node \"{existing}\""),
                ));
            }
            if cur["metadata"]["deletionTimestamp"].is_string() {
                return Err(ApiError::conflict(
                    "",
                    "pods",
                    &name,
                    "pod is being deleted, cannot be assigned to a host",
                ));
            }
            let mut pod = cur.clone();
            pod["spec"]["nodeName"] = json!(node);
            let mut conditions = pod["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            conditions.retain(|c| c["type"] != "PodScheduled");
            conditions.push(
                json!({"type": "PodScheduled", "status": "True", "lastTransitionTime": time}),
            );
            pod["status"]["conditions"] = Value::Array(conditions);
            Ok(Outcome::Put(pod))
        })?;
    Ok(respond(
        StatusCode::CREATED,
        JSON,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
    ))
}

fn path_fields(path: &str) -> Vec<&str> {
    path.trim_start_matches('.')
        .split('.')
        .filter(|s| !s.is_empty())
        .collect()
}

/// The autoscaling/v1 Scale view of an object with a scale subresource.
fn scale_of(def: &ResourceDef, obj: &Value) -> Value {
    let scale = def
        .scale
        .clone()
        .unwrap_or_else(|| crate::resources::ScaleSpec {
            spec_replicas_path: ".spec.replicas".into(),
            status_replicas_path: ".status.replicas".into(),
            label_selector_path: None,
        });
    let spec = table::json_path(obj, &scale.spec_replicas_path)
        .cloned()
        .unwrap_or(json!(0));
    let status = table::json_path(obj, &scale.status_replicas_path)
        .cloned()
        .unwrap_or(json!(0));
    let mut status_obj = json!({"replicas": status});
    if let Some(sel) = scale
        .label_selector_path
        .as_deref()
        .and_then(|p| table::json_path(obj, p))
    {
        status_obj["selector"] = sel.clone();
    }
    json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": obj["metadata"]["name"],
            "namespace": obj["metadata"]["namespace"],
            "uid": obj["metadata"]["uid"],
            "resourceVersion": obj["metadata"]["resourceVersion"],
            "creationTimestamp": obj["metadata"]["creationTimestamp"],
        },
        "spec": {"replicas": spec},
        "status": status_obj,
    })
}

async fn set_scale(
    state: &AppState,
    target: &Target,
    replicas: &Value,
    manager: &str,
) -> Result<Value, ApiError> {
    let def = &target.def;
    let replicas = replicas.as_i64().ok_or_else(|| {
        ApiError::invalid(
            "Scale",
            target.name.as_deref().unwrap_or_default(),
            &[("spec.replicas".into(), "Required value".into())],
        )
    })?;
    let spec_path = def
        .scale
        .as_ref()
        .map_or(".spec.replicas".to_string(), |s| {
            s.spec_replicas_path.clone()
        });
    let mut main = target.clone();
    main.sub = None;
    modify(
        state,
        &main,
        |cur| {
            let mut obj = cur.clone();
            let fields = path_fields(&spec_path);
            let mut node = &mut obj;
            for f in &fields {
                node = &mut node[*f];
            }
            *node = json!(replicas);
            Ok(obj)
        },
        manager,
    )
    .await
}

/// How a watch presents objects.
struct WatchView {
    def: ResourceDef,
    shape: Shape,
    include: IncludeObject,
}

impl WatchView {
    /// One watch event line. Plain objects in the requested version are serialized once per
    /// event and shared by all watchers.
    fn event_line(&self, ev: &Event, t: EventType, first: &mut bool) -> Bytes {
        if self.shape == Shape::Object && ev.object["apiVersion"] == self.def.api_version().as_str()
        {
            return Bytes::from(format!(
                "{{\"type\":\"{}\",\"object\":{}}}\n",
                t.as_str(),
                ev.object_json()
            ));
        }
        line(&json!({"type": t.as_str(), "object": self.object(&ev.object, first)}))
    }

    fn object(&self, obj: &Value, first: &mut bool) -> Value {
        let obj = with_version(&self.def, obj.clone());
        match self.shape {
            Shape::Object => obj,
            Shape::Partial => table::partial_metadata(&obj),
            Shape::Table => {
                let t = table::render(
                    &self.def,
                    std::slice::from_ref(&obj),
                    self.include,
                    *first,
                    obj["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap_or_default(),
                    Utc::now(),
                );
                *first = false;
                t
            }
        }
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Value {
        let (kind, api_version) = match self.shape {
            Shape::Partial => (
                "PartialObjectMetadata".to_string(),
                "meta.k8s.io/v1".to_string(),
            ),
            _ => (self.def.kind.clone(), self.def.api_version()),
        };
        let mut meta = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version, "metadata": meta}})
    }
}

/// The event a watcher with this filter sees for a change, if any: objects moving into the
/// selection are ADDED, those moving out DELETED.
fn visible(event: &Event, filter: &Filter) -> Option<EventType> {
    let now_in = filter.matches(&event.object);
    let was_in = event.old.as_ref().is_some_and(|o| filter.matches(o));
    match (event.type_, was_in, now_in) {
        (EventType::Added | EventType::Modified, false, true) => Some(EventType::Added),
        (EventType::Modified, true, true) => Some(EventType::Modified),
        (EventType::Modified, true, false)
        | (EventType::Deleted, true, _)
        | (EventType::Deleted, _, true) => Some(EventType::Deleted),
        _ => None,
    }
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn watch_response(
    state: &Arc<AppState>,
    target: &Target,
    query: &Query,
    headers: &HeaderMap,
) -> Result<Response<Body>, ApiError> {
    let def = target.def.clone();
    let filter = Filter::parse(&def, query)?;
    let shape = shape(headers);
    let view = WatchView {
        def: def.clone(),
        shape,
        include: IncludeObject::parse(query.get("includeObject").map(String::as_str)),
    };
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|b| b == "true");
    let initial = query.get("sendInitialEvents").is_some_and(|b| b == "true");
    let rv = query
        .get("resourceVersion")
        .filter(|r| !r.is_empty() && *r != "0");
    let from = match (initial, rv) {
        (true, _) | (false, None) => None,
        (false, Some(r)) => Some(
            r.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {r}")))?,
        ),
    };
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let gr = def.group_resource();
    let namespace = target.namespace.clone();
    let (tx, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    let started = state.store.watch(&gr, namespace.as_deref(), from);
    let interval = state.bookmark_interval;
    tokio::spawn(async move {
        let mut tx = tx;
        let (start, mut live) = match started {
            Ok(s) => s,
            Err(e) => {
                let _ = tx
                    .send(Ok(line(&json!({"type": "ERROR", "object": e.status()}))))
                    .await;
                return;
            }
        };
        let mut first = true;
        let mut seen = from.unwrap_or(0);
        match start {
            WatchStart::Snapshot { objects, rv } => {
                seen = rv;
                for obj in objects.iter().filter(|o| filter.matches(o)) {
                    let ev = json!({"type": "ADDED", "object": view.object(obj, &mut first)});
                    if tx.send(Ok(line(&ev))).await.is_err() {
                        return;
                    }
                }
                if initial
                    && bookmarks
                    && tx.send(Ok(line(&view.bookmark(rv, true)))).await.is_err()
                {
                    return;
                }
            }
            WatchStart::Backlog(events) => {
                for ev in events {
                    seen = seen.max(ev.rv);
                    if let Some(t) = visible(&ev, &filter) {
                        let out = view.event_line(&ev, t, &mut first);
                        if tx.send(Ok(out)).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut ticker = tokio::time::interval(interval);
        ticker.tick().await;
        loop {
            tokio::select! {
                () = &mut deadline => return,
                _ = ticker.tick(), if bookmarks => {
                    if tx.send(Ok(line(&view.bookmark(seen, false)))).await.is_err() {
                        return;
                    }
                }
                received = live.recv() => match received {
                    Ok(ev) => {
                        if ev.rv <= seen {
                            continue;
                        }
                        seen = ev.rv;
                        if ev.gr != gr || namespace.as_deref().is_some_and(|ns| ns != ev.namespace) {
                            continue;
                        }
                        if let Some(t) = visible(&ev, &filter) {
                            let out = view.event_line(&ev, t, &mut first);
                            if tx.send(Ok(out)).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(RecvError::Lagged(_)) => {
                        let e = ApiError::expired("the watch fell behind the event history; relist");
                        let _ = tx.send(Ok(line(&json!({"type": "ERROR", "object": e.status()})))).await;
                        return;
                    }
                    Err(RecvError::Closed) => return,
                },
            }
        }
    });
    let ct = match shape {
        Shape::Table => TABLE_CT,
        _ => JSON,
    };
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, ct)
        .header(header::CACHE_CONTROL, "no-cache, private")
        .body(Body::from_stream(rx))
        .expect("static response parts are valid"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_decode() {
        let pairs = url_pairs("labelSelector=app%20in%20(a%2Cb)&watch=true&x");
        assert_eq!(
            pairs,
            vec![
                ("labelSelector".into(), "app in (a,b)".into()),
                ("watch".into(), "true".into()),
                ("x".into(), String::new()),
            ]
        );
    }

    #[test]
    fn routes_resolve() {
        let reg = Registry::default();
        let Ok(Route::Resource(t)) = route(&reg, "/api/v1/namespaces/default/pods/p/status") else {
            panic!("pod status route");
        };
        assert_eq!(
            (t.namespace.as_deref(), t.name.as_deref(), t.sub.as_deref()),
            (Some("default"), Some("p"), Some("status"))
        );
        let Ok(Route::Resource(t)) = route(&reg, "/api/v1/namespaces/default/status") else {
            panic!("namespace status route");
        };
        assert_eq!(
            (t.def.plural.as_str(), t.name.as_deref()),
            ("namespaces", Some("default"))
        );
        assert!(route(&reg, "/apis/apps/v1/namespaces/x/nodes").is_err());
        assert!(route(&reg, "/api/v1/pods/p/bogus").is_err());
        let Ok(Route::Resource(t)) = route(&reg, "/apis/apps/v1/watch/namespaces/d/deployments")
        else {
            panic!("legacy watch route");
        };
        assert!(t.legacy_watch);
    }

    #[test]
    fn selector_transitions() {
        let filter = Filter {
            labels: LabelSelector::parse("app=a").unwrap(),
            fields: FieldSelector::default(),
        };
        let gr = GroupResource {
            group: String::new(),
            resource: "pods".into(),
        };
        let mk = |type_, old: Option<Value>, new: Value| Event {
            rv: 1,
            gr: gr.clone(),
            namespace: String::new(),
            type_,
            object: new,
            old,
            json: std::sync::OnceLock::new(),
        };
        let a = json!({"metadata": {"labels": {"app": "a"}}});
        let b = json!({"metadata": {"labels": {"app": "b"}}});
        assert_eq!(
            visible(
                &mk(EventType::Modified, Some(b.clone()), a.clone()),
                &filter
            ),
            Some(EventType::Added)
        );
        assert_eq!(
            visible(
                &mk(EventType::Modified, Some(a.clone()), b.clone()),
                &filter
            ),
            Some(EventType::Deleted)
        );
        assert_eq!(
            visible(
                &mk(EventType::Modified, Some(b.clone()), b.clone()),
                &filter
            ),
            None
        );
        assert_eq!(
            visible(&mk(EventType::Deleted, Some(a.clone()), a), &filter),
            Some(EventType::Deleted)
        );
    }

    #[test]
    fn bodies_are_json_or_yaml_never_protobuf() {
        assert_eq!(
            parse_body(&Bytes::from_static(b"{\"a\": 1}")).unwrap(),
            json!({"a": 1})
        );
        assert_eq!(
            parse_body(&Bytes::from_static(b"a: 1\n")).unwrap(),
            json!({"a": 1})
        );
        let err = parse_body(&Bytes::from_static(b"k8s\0\n\x0b\n\x07apps/v1")).unwrap_err();
        assert_eq!(err.code, 415);
        for ok in ["", "application/json", "application/yaml"] {
            assert!(body_media_type(ok).is_ok(), "{ok}");
        }
        let err = body_media_type("application/vnd.kubernetes.protobuf").unwrap_err();
        assert_eq!((err.code, err.reason), (415, "UnsupportedMediaType"));
        assert!(
            err.message.contains("application/json, application/yaml"),
            "{}",
            err.message
        );
        assert_eq!(parse_body(&Bytes::from_static(b"{")).unwrap_err().code, 400);
    }

    #[test]
    fn continue_tokens_round_trip() {
        let t = encode_continue(42, "ns", "n");
        assert_eq!(decode_continue(&t).unwrap(), (42, "ns".into(), "n".into()));
        assert_eq!(decode_continue("!!").unwrap_err().code, 400);
    }
}
