//! The watch plumbing virt-controller and virt-handler share (client-go's informers, as far as
//! they need them): a reflector per kind whose handler sees each object once the cache holds
//! it, as added, changed or deleted; the `namespace/name` keys of the work queues; the
//! controller owner reference; and the merge patch that takes a status from what the cache
//! holds to what a reconcile computed.
//!
//! One behaviour for every component: a failed watch is logged (warn) and retried under
//! kube-runtime's default backoff; a status patch carries only the keys that changed, with
//! `null` for those that went away.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt as _;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Resource, ResourceExt as _};
use serde_json::{Map, Value, json};
use tokio::task::JoinSet;

/// The work-queue key of an object: `namespace/name`, or `name` for a cluster-scoped one.
pub fn key_of(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    }
}

/// [`key_of`] an object.
pub fn obj_key<K: Resource>(o: &K) -> String {
    key_of(o.meta().namespace.as_deref(), &o.name_any())
}

/// A key back into namespace and name; the namespace is `""` for a cluster-scoped key.
pub fn split_key(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or(("", key))
}

/// The object's controller owner reference, whatever its kind.
pub fn controller_ref<K: Resource>(o: &K) -> Option<&OwnerReference> {
    o.meta()
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true))
}

/// The name of the object's controller, if that is of `kind`.
pub fn controller_owner<'a, K: Resource>(o: &'a K, kind: &str) -> Option<&'a str> {
    controller_ref(o)
        .filter(|r| r.kind == kind)
        .map(|r| r.name.as_str())
}

/// What a watch event means to a handler: an object first seen (by uid), one seen before that
/// changed (or was listed again after a re-watch), or one deleted.
#[derive(Debug, Clone, Copy)]
pub enum Seen<'a, K> {
    /// First sighting of this uid.
    Added(&'a K),
    /// A uid seen before.
    Changed(&'a K),
    /// Deleted.
    Deleted(&'a K),
}

impl<'a, K> Seen<'a, K> {
    /// The object, whatever happened to it.
    pub fn object(&self) -> &'a K {
        match *self {
            Seen::Added(o) | Seen::Changed(o) | Seen::Deleted(o) => o,
        }
    }
}

/// Runs a reflector of `api` on `tasks`, caching objects as `trim` leaves them (drop what no
/// reader needs, as kube-runtime suggests); `on` sees each object after the cache holds it.
/// A failed watch is logged and retried under kube-runtime's default backoff.
pub fn reflect<K>(
    tasks: &mut JoinSet<()>,
    api: Api<K>,
    wc: watcher::Config,
    trim: fn(&mut K),
    on: impl Fn(Seen<'_, K>) + Send + 'static,
) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let seen: Mutex<HashSet<String>> = Mutex::new(HashSet::new());
    let objects = watcher(api, wc).modify(trim);
    let stream = reflector::reflector(writer, objects).default_backoff();
    let cached = reader.clone();
    // A re-list (after a failed or expired watch) only lists what exists: what was deleted
    // while no watch ran never comes as a Delete. The cache as it was before the re-list
    // (the store swaps at InitDone) tells which objects those are.
    let mut before_relist: Vec<Arc<K>> = Vec::new();
    let mut relisted: HashSet<String> = HashSet::new();
    tasks.spawn(async move {
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            let ev = match ev {
                Ok(ev) => ev,
                Err(e) => {
                    tracing::warn!(kind = %K::kind(&()), error = %e, "watch failed; retrying");
                    continue;
                }
            };
            let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
            match &ev {
                watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
                    if matches!(ev, watcher::Event::InitApply(_)) {
                        relisted.insert(o.uid().unwrap_or_default());
                    }
                    if seen.insert(o.uid().unwrap_or_default()) {
                        on(Seen::Added(o));
                    } else {
                        on(Seen::Changed(o));
                    }
                }
                watcher::Event::Delete(o) => {
                    seen.remove(&o.uid().unwrap_or_default());
                    on(Seen::Deleted(o));
                }
                watcher::Event::Init => {
                    before_relist = cached.state();
                    relisted.clear();
                }
                watcher::Event::InitDone => {
                    for o in before_relist.drain(..) {
                        let uid = o.uid().unwrap_or_default();
                        if !relisted.contains(&uid) && seen.remove(&uid) {
                            on(Seen::Deleted(o.as_ref()));
                        }
                    }
                    relisted.clear();
                }
            }
        }
    });
    reader
}

/// A trim that keeps everything, for [`reflect`].
pub fn keep_all<K>(_: &mut K) {}

/// The JSON merge patch (RFC 7386) that takes `old` to `new`: the keys that changed, at every
/// depth of nested objects, as they are now, and `null` for keys that went away (an omitted key
/// would be left in place). Lists are replaced whole, as a merge patch does. Nothing changed:
/// an empty object.
pub fn status_patch<T: serde::Serialize>(old: &T, new: &T) -> Value {
    match (serde_json::to_value(old), serde_json::to_value(new)) {
        (Ok(old), Ok(new)) => merge_diff(&old, &new),
        (_, new) => new.unwrap_or_default(),
    }
}

/// [`status_patch`] as a compare-and-swap: `{"metadata": {"resourceVersion": ..}, "status":
/// ..}`, so a write from a stale copy fails with 409 instead of overwriting what another
/// writer set since.
pub fn cas_status_patch<T: serde::Serialize>(
    resource_version: Option<&str>,
    old: &T,
    new: &T,
) -> Value {
    json!({
        "metadata": {"resourceVersion": resource_version},
        "status": status_patch(old, new),
    })
}

fn merge_diff(old: &Value, new: &Value) -> Value {
    let (Value::Object(old), Value::Object(new)) = (old, new) else {
        return new.clone();
    };
    let mut patch = Map::new();
    for (k, v) in new {
        match old.get(k) {
            Some(was) if was == v => {}
            Some(was) => {
                patch.insert(k.clone(), merge_diff(was, v));
            }
            None => {
                patch.insert(k.clone(), v.clone());
            }
        }
    }
    for k in old.keys() {
        if !new.contains_key(k) {
            patch.insert(k.clone(), Value::Null);
        }
    }
    Value::Object(patch)
}

/// What every cluster component does first: logs to stderr at `RUST_LOG`'s levels (`info` when
/// unset), and a client from the in-cluster service account or `KUBECONFIG`.
pub async fn start_component() -> Result<kube::Client, kube::Error> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    kube::Client::try_default().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Node, Pod};
    use pretty_assertions::assert_eq;

    #[test]
    fn keys_round_trip() {
        assert_eq!(key_of(Some("ns"), "a"), "ns/a");
        assert_eq!(key_of(None, "node-1"), "node-1");
        assert_eq!(split_key("ns/a"), ("ns", "a"));
        assert_eq!(split_key("node-1"), ("", "node-1"));
        let pod: Pod =
            serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "ns"}}))
                .expect("pod");
        assert_eq!(obj_key(&pod), "ns/p");
        let node: Node = serde_json::from_value(json!({"metadata": {"name": "n"}})).expect("node");
        assert_eq!(obj_key(&node), "n");
    }

    #[test]
    fn the_controller_owner_is_the_reference_marked_controller() {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "p", "ownerReferences": [
            {"apiVersion": "v1", "kind": "VirtualMachineInstance", "name": "other", "uid": "u0"},
            {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": "a",
             "uid": "u1", "controller": true},
        ]}}))
        .expect("pod");
        assert_eq!(controller_owner(&pod, "VirtualMachineInstance"), Some("a"));
        assert_eq!(controller_owner(&pod, "VirtualMachine"), None);
        assert_eq!(controller_ref(&pod).map(|r| r.uid.as_str()), Some("u1"));
        assert_eq!(controller_ref(&Pod::default()), None);
    }

    #[test]
    fn status_patch_sends_changed_keys_and_nulls_fields_that_went_away() {
        let old = json!({
            "phase": "Scheduled", "nodeName": "node-a", "reason": "x",
            "startFailure": {}, "stateChangeRequests": [{"action": "Start"}],
        });
        let new = json!({"phase": "Running", "nodeName": "node-a"});
        assert_eq!(
            status_patch(&old, &new),
            json!({"phase": "Running", "reason": null, "startFailure": null,
                   "stateChangeRequests": null})
        );
        assert_eq!(status_patch(&new, &new), json!({}));
    }

    #[test]
    fn status_patch_descends_into_objects_and_replaces_lists() {
        let old = json!({"activePods": {"p1": "node-a", "p2": "node-b"}, "conditions": [1, 2]});
        let new = json!({"activePods": {"p2": "node-b", "p3": "node-c"}, "conditions": [2]});
        assert_eq!(
            status_patch(&old, &new),
            json!({"activePods": {"p1": null, "p3": "node-c"}, "conditions": [2]})
        );
    }

    #[test]
    fn a_cas_status_patch_carries_the_resource_version() {
        let old = json!({"phase": "Scheduled", "reason": "x"});
        let new = json!({"phase": "Running"});
        assert_eq!(
            cas_status_patch(Some("42"), &old, &new),
            json!({"metadata": {"resourceVersion": "42"}, "status": {"phase": "Running", "reason": null}})
        );
    }
}
