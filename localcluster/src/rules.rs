//! The write rules of the API server as pure functions: what create, update and delete do to an
//! object (identity, generation, status isolation, finalizers, graceful deletion).

use serde_json::{Value, json};

use crate::error::ApiError;
use crate::resources::{ResourceDef, crd_status};
use crate::schema;
use crate::store::{Objects, Outcome};

/// Facts from outside the object that the rules need.
#[derive(Debug, Clone)]
pub struct Context<'a> {
    /// RFC 3339 time, seconds precision.
    pub now: &'a str,
    /// A fresh uid for creates.
    pub uid: &'a str,
    /// A fresh 5-character suffix for `generateName`.
    pub suffix: &'a str,
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj["metadata"][field].as_str().filter(|s| !s.is_empty())
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// Checks `apiVersion`/`kind` of a request body against the resource, filling them in when absent.
pub fn check_type(def: &ResourceDef, obj: &mut Value) -> Result<(), ApiError> {
    if !obj.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    let want = def.api_version();
    match obj["apiVersion"].as_str() {
        None | Some("") => obj["apiVersion"] = json!(want),
        Some(v) if v.split('/').next() == want.split('/').next() || v == want => {
            obj["apiVersion"] = json!(want);
        }
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({v}) does not match the expected API version ({want})"
            )));
        }
    }
    match obj["kind"].as_str() {
        None | Some("") => obj["kind"] = json!(def.kind),
        Some(k) if k == def.kind => {}
        Some(k) => {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                def.kind
            )));
        }
    }
    if !obj["metadata"].is_object() {
        obj["metadata"] = json!({});
    }
    Ok(())
}

/// The namespace a namespaced write goes to must exist and not be terminating.
pub fn check_namespace(objects: &Objects, namespace: &str) -> Result<(), ApiError> {
    let gr = crate::resources::GroupResource {
        group: String::new(),
        resource: "namespaces".into(),
    };
    match objects.get(&gr, "", namespace) {
        None => Err(ApiError::not_found("", "namespaces", namespace)),
        Some(ns) if ns["metadata"]["deletionTimestamp"].is_string() => {
            Err(ApiError::forbidden(format!(
                "unable to create new content in namespace {namespace} because it is being terminated"
            ))
            .with_details(json!({"name": namespace, "kind": "namespaces",
                "causes": [{"reason": "NamespaceTerminating", "message": format!("namespace {namespace} is being terminated"), "field": "metadata.namespace"}]})))
        }
        Some(_) => Ok(()),
    }
}

/// Shapes a custom resource by its schema: pruning, then defaults.
pub fn apply_schema(def: &ResourceDef, obj: &mut Value) {
    if let Some(s) = &def.schema {
        schema::prune(obj, s);
        schema::apply_defaults(obj, s);
    }
}

/// Fills in the server-owned parts of a new object.
pub fn prepare_create(
    def: &ResourceDef,
    mut obj: Value,
    namespace: Option<&str>,
    objects: &Objects,
    ctx: &Context<'_>,
) -> Result<Value, ApiError> {
    check_type(def, &mut obj)?;
    let name = match (meta_str(&obj, "name"), meta_str(&obj, "generateName")) {
        (Some(n), _) => n.to_string(),
        (None, Some(prefix)) => format!("{prefix}{}", ctx.suffix),
        (None, None) => {
            return Err(ApiError::invalid(
                &def.kind,
                "",
                &[(
                    "metadata.name".into(),
                    "Required value: name or generateName is required".into(),
                )],
            ));
        }
    };
    if !valid_name(&name) {
        return Err(ApiError::invalid(
            &def.kind,
            &name,
            &[(
                "metadata.name".into(),
                format!(
                    "Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
                ),
            )],
        ));
    }
    if def.namespaced {
        let ns = namespace.ok_or_else(|| {
            ApiError::bad_request(format!(
                "{} is namespaced: a namespace is required",
                def.kind
            ))
        })?;
        if let Some(body_ns) = meta_str(&obj, "namespace")
            && body_ns != ns
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        check_namespace(objects, ns)?;
        obj["metadata"]["namespace"] = json!(ns);
    } else if let Some(m) = obj["metadata"].as_object_mut() {
        m.remove("namespace");
    }
    let meta = obj["metadata"].as_object_mut().expect("checked above");
    meta.insert("name".into(), json!(name));
    meta.insert("uid".into(), json!(ctx.uid));
    meta.insert("creationTimestamp".into(), json!(ctx.now));
    if tracks_generation(def) {
        meta.insert("generation".into(), json!(1));
    } else {
        meta.remove("generation");
    }
    for server_owned in [
        "resourceVersion",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "selfLink",
    ] {
        meta.remove(server_owned);
    }
    if def.status && !(def.group.is_empty() && def.plural == "nodes") {
        if let Some(m) = obj.as_object_mut() {
            m.remove("status");
        }
    }
    match (def.group.as_str(), def.plural.as_str()) {
        ("", "namespaces") => {
            obj["spec"] = json!({"finalizers": ["kubernetes"]});
            obj["status"] = json!({"phase": "Active"});
        }
        ("", "pods") => {
            obj["status"] = json!({"phase": "Pending", "qosClass": qos_class(&obj)});
        }
        ("apiextensions.k8s.io", "customresourcedefinitions") => {
            obj["status"] = crd_status(&obj, ctx.now);
        }
        _ => {}
    }
    apply_schema(def, &mut obj);
    Ok(obj)
}

/// Whether a kind counts spec changes in `metadata.generation`: custom resources always; among
/// the built-ins, the workload-like kinds whose controllers report `observedGeneration`.
pub fn tracks_generation(def: &ResourceDef) -> bool {
    def.custom
        || (def.group == "policy" && def.plural == "poddisruptionbudgets")
        || matches!(
            def.group.as_str(),
            "apps" | "apiextensions.k8s.io" | "admissionregistration.k8s.io" | "scheduling.k8s.io"
        )
}

/// The QoS class of a pod from its containers' requests and limits.
fn qos_class(pod: &Value) -> &'static str {
    let containers = pod["spec"]["containers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut any = false;
    let mut guaranteed = !containers.is_empty();
    for c in &containers {
        let res = &c["resources"];
        let requests = res["requests"].as_object();
        let limits = res["limits"].as_object();
        if requests.is_some_and(|r| !r.is_empty()) || limits.is_some_and(|l| !l.is_empty()) {
            any = true;
        }
        let complete = limits.is_some_and(|l| {
            ["cpu", "memory"].iter().all(|k| {
                l.contains_key(*k)
                    && requests.is_none_or(|r| r.get(*k).is_none_or(|v| Some(v) == l.get(*k)))
            })
        });
        guaranteed &= complete;
    }
    if guaranteed {
        "Guaranteed"
    } else if any {
        "Burstable"
    } else {
        "BestEffort"
    }
}

/// Everything but metadata and status: what a generation counts changes of.
fn spec_part(obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
        m.remove("apiVersion");
        m.remove("kind");
    }
    v
}

fn without_volatile(obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Some(m) = v["metadata"].as_object_mut() {
        m.remove("resourceVersion");
        m.remove("managedFields");
    }
    v
}

/// Merges an update into the stored object. `subresource` is `Some("status")` for status writes.
/// The result still needs its managed fields recorded and [`finish_update`] applied.
pub fn prepare_update(
    def: &ResourceDef,
    old: &Value,
    mut new: Value,
    subresource: Option<&str>,
) -> Result<Value, ApiError> {
    check_type(def, &mut new)?;
    let name = old["metadata"]["name"].as_str().unwrap_or_default();
    if let Some(rv) = meta_str(&new, "resourceVersion")
        && Some(rv) != meta_str(old, "resourceVersion")
    {
        return Err(ApiError::conflict(
            &def.group,
            &def.plural,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        ));
    }
    if let Some(uid) = meta_str(&new, "uid")
        && Some(uid) != meta_str(old, "uid")
    {
        return Err(ApiError::conflict(
            &def.group,
            &def.plural,
            name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                meta_str(old, "uid").unwrap_or_default()
            ),
        ));
    }
    let mut out = if subresource == Some("status") {
        let mut out = old.clone();
        out["status"] = new["status"].clone();
        if out["status"].is_null()
            && let Some(m) = out.as_object_mut()
        {
            m.remove("status");
        }
        out
    } else {
        let mut out = new;
        if def.status {
            match old.get("status") {
                Some(s) => out["status"] = s.clone(),
                None => {
                    if let Some(m) = out.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
        }
        for field in [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "managedFields",
        ] {
            match old["metadata"].get(field) {
                Some(v) => out["metadata"][field] = v.clone(),
                None => {
                    if let Some(m) = out["metadata"].as_object_mut() {
                        m.remove(field);
                    }
                }
            }
        }
        out
    };
    out["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
    if old["metadata"]["deletionTimestamp"].is_string() {
        let old_f = old["metadata"]["finalizers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let added = out["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| !old_f.contains(x)));
        if added {
            return Err(ApiError::invalid(
                &def.kind,
                name,
                &[(
                    "metadata.finalizers".into(),
                    "Forbidden: no new finalizers can be added if the object is being deleted"
                        .into(),
                )],
            ));
        }
    }
    apply_schema(def, &mut out);
    if def.group == "apiextensions.k8s.io" && def.plural == "customresourcedefinitions" {
        let now = old["status"]["conditions"][0]["lastTransitionTime"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        out["status"] = crd_status(&out, &now);
    }
    if tracks_generation(def) && spec_part(&out) != spec_part(old) {
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
        out["metadata"]["generation"] = json!(generation + 1);
    }
    Ok(out)
}

/// Decides how an updated object is stored: unchanged, replaced, or gone. An update deletes the
/// object only when it takes away the last finalizer of an object whose deletion grace period is
/// over, as kube-apiserver's `ShouldDeleteDuringUpdate`: a pod in graceful deletion stays, however
/// often its status is written, until its kubelet deletes it.
pub fn finish_update(old: &Value, new: Value) -> Outcome {
    if without_volatile(old) == without_volatile(&new)
        && old["metadata"]["managedFields"] == new["metadata"]["managedFields"]
    {
        return Outcome::Unchanged(old.clone());
    }
    if new["metadata"]["deletionTimestamp"].is_string()
        && !has_finalizers(&new)
        && has_finalizers(old)
        && old["metadata"]["deletionGracePeriodSeconds"]
            .as_i64()
            .unwrap_or(0)
            == 0
    {
        return Outcome::Delete(new);
    }
    Outcome::Put(new)
}

fn has_finalizers(obj: &Value) -> bool {
    obj["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| !f.is_empty())
        || obj["spec"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty())
            && obj["kind"] == "Namespace"
}

/// The parts of `DeleteOptions` the server honours.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeleteOptions {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    pub grace_period_seconds: Option<i64>,
    pub propagation_policy: Option<String>,
}

impl DeleteOptions {
    pub fn from_body(body: &Value) -> Self {
        Self {
            uid: body["preconditions"]["uid"].as_str().map(str::to_string),
            resource_version: body["preconditions"]["resourceVersion"]
                .as_str()
                .map(str::to_string),
            grace_period_seconds: body["gracePeriodSeconds"].as_i64(),
            propagation_policy: body["propagationPolicy"].as_str().map(str::to_string),
        }
    }
}

/// What a delete does: check preconditions, then remove the object, or mark it deleted and wait
/// for its finalizers (or, for a pod on a node, for its kubelet).
pub fn prepare_delete(
    def: &ResourceDef,
    current: &Value,
    opts: &DeleteOptions,
    now: &str,
    gc_finalizers: bool,
) -> Result<Outcome, ApiError> {
    let name = current["metadata"]["name"].as_str().unwrap_or_default();
    if let Some(uid) = &opts.uid
        && Some(uid.as_str()) != meta_str(current, "uid")
    {
        return Err(ApiError::conflict(
            &def.group,
            &def.plural,
            name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                meta_str(current, "uid").unwrap_or_default()
            ),
        ));
    }
    if let Some(rv) = &opts.resource_version
        && Some(rv.as_str()) != meta_str(current, "resourceVersion")
    {
        return Err(ApiError::conflict(
            &def.group,
            &def.plural,
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                meta_str(current, "resourceVersion").unwrap_or_default()
            ),
        ));
    }
    let mut obj = current.clone();
    let deleting = obj["metadata"]["deletionTimestamp"].is_string();
    if gc_finalizers && !deleting {
        let finalizer = match opts.propagation_policy.as_deref() {
            Some("Orphan") => Some("orphan"),
            Some("Foreground") => Some("foregroundDeletion"),
            _ => None,
        };
        if let Some(f) = finalizer {
            let list = obj["metadata"]["finalizers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if !list.contains(&json!(f)) {
                let mut list = list;
                list.push(json!(f));
                obj["metadata"]["finalizers"] = Value::Array(list);
            }
        }
    }
    let is_pod = def.group.is_empty() && def.plural == "pods";
    let assigned = is_pod
        && obj["spec"]["nodeName"]
            .as_str()
            .is_some_and(|n| !n.is_empty());
    let grace = opts.grace_period_seconds.unwrap_or_else(|| {
        obj["spec"]["terminationGracePeriodSeconds"]
            .as_i64()
            .unwrap_or(30)
    });
    let graceful = assigned && grace > 0;
    if is_pod && deleting && grace == 0 && !has_finalizers(&obj) {
        return Ok(Outcome::Delete(obj));
    }
    let is_namespace = def.group.is_empty() && def.plural == "namespaces";
    if has_finalizers(&obj) || graceful || is_namespace {
        if deleting {
            return Ok(if obj == *current {
                Outcome::Unchanged(obj)
            } else {
                Outcome::Put(obj)
            });
        }
        obj["metadata"]["deletionTimestamp"] = json!(now);
        obj["metadata"]["deletionGracePeriodSeconds"] = json!(if graceful { grace } else { 0 });
        if is_namespace {
            obj["status"]["phase"] = json!("Terminating");
        }
        return Ok(Outcome::Put(obj));
    }
    Ok(Outcome::Delete(obj))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::builtins;
    use crate::store::Store;

    fn def(plural: &str) -> ResourceDef {
        builtins().into_iter().find(|d| d.plural == plural).unwrap()
    }

    fn ctx() -> Context<'static> {
        Context {
            now: "2024-01-01T00:00:00Z",
            uid: "u-1",
            suffix: "abcde",
        }
    }

    fn with_namespace() -> Store {
        let store = Store::new(10);
        let ns_def = def("namespaces");
        store
            .mutate(&ns_def.group_resource(), "", "default", |objs, _| {
                let ns = prepare_create(
                    &ns_def,
                    json!({"metadata": {"name": "default"}}),
                    None,
                    objs,
                    &ctx(),
                )?;
                Ok(Outcome::Put(ns))
            })
            .unwrap();
        store
    }

    #[test]
    fn create_fills_identity_and_needs_namespace() {
        let store = with_namespace();
        let cm = def("configmaps");
        let obj = store.read(|objs| {
            prepare_create(
                &cm,
                json!({"metadata": {"generateName": "x-"}, "data": {}}),
                Some("default"),
                objs,
                &ctx(),
            )
        });
        let obj = obj.unwrap();
        assert_eq!(obj["metadata"]["name"], "x-abcde");
        assert!(obj["metadata"].get("generation").is_none());
        assert_eq!(obj["metadata"]["uid"], "u-1");
        assert_eq!(obj["kind"], "ConfigMap");
        let missing = store.read(|objs| {
            prepare_create(
                &cm,
                json!({"metadata": {"name": "a"}}),
                Some("nope"),
                objs,
                &ctx(),
            )
        });
        assert_eq!(missing.unwrap_err().code, 404);
        let invalid = store.read(|objs| {
            prepare_create(
                &cm,
                json!({"metadata": {"name": "A_b"}}),
                Some("default"),
                objs,
                &ctx(),
            )
        });
        assert_eq!(invalid.unwrap_err().code, 422);
    }

    #[test]
    fn update_rules() {
        let deploy = def("deployments");
        let old = json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "resourceVersion": "5", "uid": "u", "generation": 1},
            "spec": {"replicas": 1}, "status": {"replicas": 1}});
        // Stale resourceVersion.
        let mut stale = old.clone();
        stale["metadata"]["resourceVersion"] = json!("4");
        assert_eq!(
            prepare_update(&deploy, &old, stale, None).unwrap_err().code,
            409
        );
        // Status is ignored on the main resource; spec changes bump generation.
        let mut new = old.clone();
        new["spec"]["replicas"] = json!(2);
        new["status"]["replicas"] = json!(9);
        let out = prepare_update(&deploy, &old, new, None).unwrap();
        assert_eq!(out["metadata"]["generation"], 2);
        assert_eq!(out["status"]["replicas"], 1);
        // Spec is ignored on status writes, and they do not bump generation.
        let mut new = old.clone();
        new["spec"]["replicas"] = json!(7);
        new["status"]["replicas"] = json!(3);
        let out = prepare_update(&deploy, &old, new, Some("status")).unwrap();
        assert_eq!(out["spec"]["replicas"], 1);
        assert_eq!(out["status"]["replicas"], 3);
        assert_eq!(out["metadata"]["generation"], 1);
        // Label-only change: no generation bump.
        let mut new = old.clone();
        new["metadata"]["labels"] = json!({"a": "b"});
        let out = prepare_update(&deploy, &old, new, None).unwrap();
        assert_eq!(out["metadata"]["generation"], 1);
        assert!(matches!(finish_update(&old, out), Outcome::Put(_)));
        assert!(matches!(
            finish_update(&old, old.clone()),
            Outcome::Unchanged(_)
        ));
    }

    #[test]
    fn finalizers_block_deletion_and_cannot_be_added_while_deleting() {
        let cm = def("configmaps");
        let obj = json!({"kind": "ConfigMap", "metadata": {"name": "c", "uid": "u", "resourceVersion": "3", "finalizers": ["a"]}});
        let Outcome::Put(deleting) =
            prepare_delete(&cm, &obj, &DeleteOptions::default(), "now", false).unwrap()
        else {
            panic!("expected the object to be marked");
        };
        assert_eq!(deleting["metadata"]["deletionTimestamp"], "now");
        let mut more = deleting.clone();
        more["metadata"]["finalizers"] = json!(["a", "b"]);
        assert_eq!(
            prepare_update(&cm, &deleting, more, None).unwrap_err().code,
            422
        );
        let mut done = deleting.clone();
        done["metadata"]["finalizers"] = json!([]);
        let out = prepare_update(&cm, &deleting, done, None).unwrap();
        assert!(matches!(finish_update(&deleting, out), Outcome::Delete(_)));
        let mut pod = json!({"kind": "Pod", "metadata": {"name": "p", "uid": "u", "resourceVersion": "3"},
            "spec": {"nodeName": "n1", "terminationGracePeriodSeconds": 30}});
        pod["metadata"]["deletionTimestamp"] = json!("now");
        pod["metadata"]["deletionGracePeriodSeconds"] = json!(30);
        let mut status_write = pod.clone();
        status_write["status"]["phase"] = json!("Succeeded");
        assert!(
            matches!(finish_update(&pod, status_write), Outcome::Put(_)),
            "a pod in graceful deletion must wait for its kubelet's final delete"
        );
        let wrong_uid = DeleteOptions {
            uid: Some("other".into()),
            ..DeleteOptions::default()
        };
        assert_eq!(
            prepare_delete(&cm, &obj, &wrong_uid, "now", false)
                .unwrap_err()
                .code,
            409
        );
    }

    #[test]
    fn assigned_pods_wait_for_their_kubelet() {
        let pods = def("pods");
        let pod = json!({"kind": "Pod", "metadata": {"name": "p", "uid": "u"}, "spec": {"nodeName": "n1"}});
        let Outcome::Put(marked) =
            prepare_delete(&pods, &pod, &DeleteOptions::default(), "now", false).unwrap()
        else {
            panic!("an assigned pod is deleted gracefully");
        };
        assert_eq!(marked["metadata"]["deletionGracePeriodSeconds"], 30);
        let force = DeleteOptions {
            grace_period_seconds: Some(0),
            ..DeleteOptions::default()
        };
        assert!(matches!(
            prepare_delete(&pods, &marked, &force, "now", false).unwrap(),
            Outcome::Delete(_)
        ));
        let unassigned = json!({"kind": "Pod", "metadata": {"name": "p"}, "spec": {}});
        assert!(matches!(
            prepare_delete(&pods, &unassigned, &DeleteOptions::default(), "now", false).unwrap(),
            Outcome::Delete(_)
        ));
    }

    #[test]
    fn qos_classes() {
        let best = json!({"spec": {"containers": [{"name": "a"}]}});
        let burst = json!({"spec": {"containers": [{"name": "a", "resources": {"requests": {"cpu": "1"}}}]}});
        let guaranteed = json!({"spec": {"containers": [{"name": "a", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}]}});
        assert_eq!(qos_class(&best), "BestEffort");
        assert_eq!(qos_class(&burst), "Burstable");
        assert_eq!(qos_class(&guaranteed), "Guaranteed");
    }
}
