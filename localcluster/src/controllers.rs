//! Built-in controllers that run inside the API server process.

use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use crate::discovery::Registry;
use crate::resources::GroupResource;
use crate::rules::{self, DeleteOptions};
use crate::server::AppState;
use crate::store::Outcome;

fn namespaces() -> GroupResource {
    GroupResource {
        group: String::new(),
        resource: "namespaces".into(),
    }
}

/// Namespace deletion: once a namespace is terminating, delete everything in it, then remove the
/// `kubernetes` finalizer so the namespace itself goes. Runs after every change, since content can
/// be held up by its own finalizers or by a kubelet.
pub async fn namespace_controller(state: Arc<AppState>) {
    let Ok((_, mut events)) = state.store.watch(&namespaces(), None, None) else {
        return;
    };
    reconcile_namespaces(&state);
    loop {
        match events.recv().await {
            Ok(_) | Err(RecvError::Lagged(_)) => reconcile_namespaces(&state),
            Err(RecvError::Closed) => return,
        }
    }
}

fn reconcile_namespaces(state: &AppState) {
    let (all, _) = state.store.list(&namespaces(), None);
    let terminating: Vec<String> = all
        .iter()
        .filter(|ns| ns["metadata"]["deletionTimestamp"].is_string())
        .filter_map(|ns| ns["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    if terminating.is_empty() {
        return;
    }
    let registry = state
        .registry
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    for ns in terminating {
        let contents: Vec<(GroupResource, String, Value)> = state.store.read(|objs| {
            objs.iter()
                .flat_map(|(gr, bucket)| {
                    bucket
                        .iter()
                        .filter(|((n, _), _)| *n == ns)
                        .map(|((_, name), v)| (gr.clone(), name.clone(), v.clone()))
                        .collect::<Vec<_>>()
                })
                .collect()
        });
        for (gr, name, obj) in &contents {
            if obj["metadata"]["deletionTimestamp"].is_string() {
                continue;
            }
            let Some(def) = registry.any_version(&gr.group, &gr.resource) else {
                continue;
            };
            let result = state.store.mutate(gr, &ns, name, |_, cur| match cur {
                Some(cur) => {
                    rules::prepare_delete(def, cur, &DeleteOptions::default(), &now, false)
                }
                None => Ok(Outcome::Unchanged(Value::Null)),
            });
            if let Err(e) = result {
                tracing::warn!(namespace = %ns, %name, error = %e, "deleting namespace content");
            }
        }
        if contents.is_empty() {
            let result = state.store.mutate(&namespaces(), "", &ns, |_, cur| {
                let Some(cur) = cur else {
                    return Ok(Outcome::Unchanged(Value::Null));
                };
                let mut done = cur.clone();
                done["spec"]["finalizers"] = json!([]);
                Ok(rules::finish_update(cur, done))
            });
            if let Err(e) = result {
                tracing::warn!(namespace = %ns, error = %e, "finalizing namespace");
            }
        }
    }
}

/// The owner references of an object.
fn owner_refs(obj: &Value) -> Vec<Value> {
    obj["metadata"]["ownerReferences"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn uid(obj: &Value) -> &str {
    obj["metadata"]["uid"].as_str().unwrap_or_default()
}

fn has_finalizer(obj: &Value, name: &str) -> bool {
    obj["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == name))
}

/// Whether the owner an owner reference names still exists (same uid). Owners of kinds this
/// server does not serve count as present, as the garbage collector cannot judge them.
fn owner_exists(state: &AppState, registry: &Registry, namespace: &str, oref: &Value) -> bool {
    let api_version = oref["apiVersion"].as_str().unwrap_or_default();
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    let kind = oref["kind"].as_str().unwrap_or_default();
    let Some(def) = registry
        .defs()
        .iter()
        .find(|d| d.group == group && d.kind == kind)
    else {
        return true;
    };
    let ns = if def.namespaced { namespace } else { "" };
    state
        .store
        .get(
            &def.group_resource(),
            ns,
            oref["name"].as_str().unwrap_or_default(),
        )
        .is_some_and(|o| uid(&o) == oref["uid"].as_str().unwrap_or_default())
}

/// Objects with an owner reference to `owner_uid`: (group/resource, namespace, name, object).
fn dependents_of(state: &AppState, owner_uid: &str) -> Vec<(GroupResource, String, String, Value)> {
    state.store.read(|objs| {
        objs.iter()
            .flat_map(|(gr, bucket)| {
                bucket
                    .iter()
                    .filter(|(_, o)| owner_refs(o).iter().any(|r| r["uid"] == owner_uid))
                    .map(|((ns, name), o)| (gr.clone(), ns.clone(), name.clone(), o.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    })
}

fn gc_delete(state: &AppState, registry: &Registry, gr: &GroupResource, ns: &str, name: &str) {
    let Some(def) = registry.any_version(&gr.group, &gr.resource) else {
        return;
    };
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let result = state.store.mutate(gr, ns, name, |_, cur| match cur {
        Some(cur) if !cur["metadata"]["deletionTimestamp"].is_string() => {
            rules::prepare_delete(def, cur, &DeleteOptions::default(), &now, true)
        }
        _ => Ok(Outcome::Unchanged(Value::Null)),
    });
    if let Err(e) = result {
        tracing::warn!(resource = %gr.resource, namespace = ns, name, error = %e, "garbage collecting");
    }
}

/// Changes an object in place (removing owner references or finalizers); an object being deleted
/// whose last finalizer goes is removed.
fn gc_update(
    state: &AppState,
    gr: &GroupResource,
    ns: &str,
    name: &str,
    f: impl FnOnce(&mut Value),
) {
    let result = state.store.mutate(gr, ns, name, |_, cur| {
        let Some(cur) = cur else {
            return Ok(Outcome::Unchanged(Value::Null));
        };
        let mut new = cur.clone();
        f(&mut new);
        Ok(rules::finish_update(cur, new))
    });
    if let Err(e) = result {
        tracing::warn!(resource = %gr.resource, namespace = ns, name, error = %e, "garbage collector update");
    }
}

fn remove_finalizer(obj: &mut Value, name: &str) {
    if let Some(f) = obj["metadata"]["finalizers"].as_array_mut() {
        f.retain(|x| x != name);
    }
}

/// A dependent one of whose owners is gone: deleted when no owner is left, otherwise the dangling
/// references are dropped.
fn collect_dependent(
    state: &AppState,
    registry: &Registry,
    gr: &GroupResource,
    ns: &str,
    name: &str,
    obj: &Value,
) {
    let refs = owner_refs(obj);
    if refs.is_empty() {
        return;
    }
    let alive: Vec<Value> = refs
        .iter()
        .filter(|r| owner_exists(state, registry, ns, r))
        .cloned()
        .collect();
    if alive.is_empty() {
        gc_delete(state, registry, gr, ns, name);
    } else if alive.len() < refs.len() {
        gc_update(state, gr, ns, name, |o| {
            o["metadata"]["ownerReferences"] = Value::Array(alive);
        });
    }
}

/// An owner being deleted with the `orphan` or `foregroundDeletion` finalizer.
fn finish_owner(
    state: &AppState,
    registry: &Registry,
    gr: &GroupResource,
    ns: &str,
    name: &str,
    owner: &Value,
) {
    let owner_uid = uid(owner).to_string();
    if has_finalizer(owner, "orphan") {
        for (dgr, dns, dname, _) in dependents_of(state, &owner_uid) {
            gc_update(state, &dgr, &dns, &dname, |o| {
                if let Some(refs) = o["metadata"]["ownerReferences"].as_array_mut() {
                    refs.retain(|r| r["uid"] != owner_uid.as_str());
                }
            });
        }
        gc_update(state, gr, ns, name, |o| remove_finalizer(o, "orphan"));
        return;
    }
    if has_finalizer(owner, "foregroundDeletion") {
        let mut blocking = false;
        for (dgr, dns, dname, dep) in dependents_of(state, &owner_uid) {
            let blocks = owner_refs(&dep)
                .iter()
                .any(|r| r["uid"] == owner_uid.as_str() && r["blockOwnerDeletion"] == true);
            blocking |= blocks;
            gc_delete(state, registry, &dgr, &dns, &dname);
        }
        if !blocking {
            gc_update(state, gr, ns, name, |o| {
                remove_finalizer(o, "foregroundDeletion");
            });
        }
    }
}

fn gc_event(state: &AppState, registry: &Registry, event: &crate::store::Event) {
    let obj = &event.object;
    let ns = event.namespace.as_str();
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    match event.type_ {
        crate::store::EventType::Deleted => {
            for (dgr, dns, dname, dep) in dependents_of(state, uid(obj)) {
                collect_dependent(state, registry, &dgr, &dns, &dname, &dep);
            }
            // A dependent going may unblock an owner waiting in foreground deletion.
            for oref in owner_refs(obj) {
                let api_version = oref["apiVersion"].as_str().unwrap_or_default();
                let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
                let Some(def) = registry
                    .defs()
                    .iter()
                    .find(|d| d.group == group && d.kind == oref["kind"])
                else {
                    continue;
                };
                let ons = if def.namespaced { ns } else { "" };
                let oname = oref["name"].as_str().unwrap_or_default();
                if let Some(owner) = state.store.get(&def.group_resource(), ons, oname)
                    && owner["metadata"]["deletionTimestamp"].is_string()
                {
                    finish_owner(state, registry, &def.group_resource(), ons, oname, &owner);
                }
            }
        }
        crate::store::EventType::Added | crate::store::EventType::Modified => {
            if obj["metadata"]["deletionTimestamp"].is_string() {
                finish_owner(state, registry, &event.gr, ns, name, obj);
            }
            if event.type_ == crate::store::EventType::Added {
                collect_dependent(state, registry, &event.gr, ns, name, obj);
            }
        }
    }
}

/// Checks every object, for when events were missed.
fn gc_sweep(state: &AppState) {
    let registry = state
        .registry
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let all: Vec<(GroupResource, String, String, Value)> = state.store.read(|objs| {
        objs.iter()
            .flat_map(|(gr, bucket)| {
                bucket
                    .iter()
                    .map(|((ns, name), o)| (gr.clone(), ns.clone(), name.clone(), o.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    });
    for (gr, ns, name, obj) in &all {
        if obj["metadata"]["deletionTimestamp"].is_string() {
            finish_owner(state, &registry, gr, ns, name, obj);
        }
        collect_dependent(state, &registry, gr, ns, name, obj);
    }
}

/// Garbage collection by owner references: dependents of a deleted owner are deleted
/// (Background), orphaned (`orphan` finalizer) or deleted before their owner (`foregroundDeletion`
/// finalizer, waiting for dependents with `blockOwnerDeletion`); dependents created for an owner that
/// does not exist are deleted too.
pub async fn garbage_collector(state: Arc<AppState>) {
    let Ok((_, mut events)) = state.store.watch(&namespaces(), None, None) else {
        return;
    };
    gc_sweep(&state);
    loop {
        match events.recv().await {
            Ok(event) => {
                let registry = state
                    .registry
                    .read()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone();
                gc_event(&state, &registry, &event);
            }
            Err(RecvError::Lagged(n)) => {
                tracing::warn!(
                    missed = n,
                    "garbage collector fell behind; sweeping everything"
                );
                gc_sweep(&state);
            }
            Err(RecvError::Closed) => return,
        }
    }
}
