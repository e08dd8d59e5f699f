//! The watch plumbing virt-controller and virt-handler share (client-go's informers, as far as
//! they need them): a reflector per kind whose handler sees each object once the cache holds
//! it, as added, changed or deleted; the `namespace/name` keys of the work queues; the
//! controller owner reference; and the merge patch that takes a status from what the cache
//! holds to what a reconcile computed.
//!
//! One behaviour for every component: a failed watch is logged (warn) and retried under
//! kube-runtime's default backoff; a status patch carries only the keys that changed, with
//! `null` for those that went away.

pub mod events;
pub mod instancetype;
pub mod leader;
pub mod ownwrites;
pub mod packed;
pub mod patch;

use std::collections::HashSet;
use std::sync::Arc;

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
    let objects = watcher(api, wc).modify(trim);
    let stream = reflector::reflector(writer, objects).default_backoff();
    dispatch(tasks, stream, reader.clone(), |_| {}, on);
    reader
}

/// [`reflect`] into a [`packed::PackedStore`] with `indexes`, for kinds cached by the
/// thousand and read one object (or one index value) at a time.
pub fn reflect_packed<K>(
    tasks: &mut JoinSet<()>,
    api: Api<K>,
    wc: watcher::Config,
    trim: fn(&mut K),
    indexes: &[packed::Indexer<K>],
    on: impl Fn(Seen<'_, K>) + Send + 'static,
) -> packed::PackedStore<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (mut writer, reader) = packed::PackedWriter::new(indexes);
    let stream = watcher(api, wc).modify(trim).default_backoff();
    dispatch(
        tasks,
        stream,
        reader.clone(),
        move |ev| writer.apply(ev),
        on,
    );
    reader
}

/// Runs `stream` on `tasks`: each event goes to `apply` (the cache's writer, unless the stream
/// wrote it already), then to `on` as [`Seen`]. A failed watch is logged.
fn dispatch<K, C>(
    tasks: &mut JoinSet<()>,
    stream: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    cached: C,
    mut apply: impl FnMut(&watcher::Event<K>) + Send + 'static,
    on: impl Fn(Seen<'_, K>) + Send + 'static,
) where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    C: Cache<K> + Send + 'static,
    C::Entry: Send,
{
    tasks.spawn(async move {
        let mut dispatch = Dispatch::default();
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(ev) => {
                    apply(&ev);
                    dispatch.event(&ev, &cached, &on);
                }
                Err(e) => {
                    tracing::warn!(kind = %K::kind(&()), error = %e, "watch failed; retrying");
                }
            }
        }
    });
}

/// What [`Dispatch`] reads of a cache: its objects by key, and all of them as they were when
/// a re-list began (cheap to take; an entry is opened only for an object the re-list lost).
trait Cache<K: Resource<DynamicType = ()>> {
    type Entry;
    fn get(&self, key: &reflector::ObjectRef<K>) -> Option<Arc<K>>;
    fn entries(&self) -> Vec<Self::Entry>;
    fn open(entry: &Self::Entry) -> Option<Arc<K>>;
}

impl<K: Resource<DynamicType = ()> + Clone> Cache<K> for Store<K> {
    type Entry = Arc<K>;
    fn get(&self, key: &reflector::ObjectRef<K>) -> Option<Arc<K>> {
        Store::get(self, key)
    }
    fn entries(&self) -> Vec<Arc<K>> {
        self.state()
    }
    fn open(entry: &Arc<K>) -> Option<Arc<K>> {
        Some(entry.clone())
    }
}

impl<K> Cache<K> for packed::PackedStore<K>
where
    K: Resource<DynamicType = ()> + serde::de::DeserializeOwned,
{
    type Entry = packed::Snapshot;
    fn get(&self, key: &reflector::ObjectRef<K>) -> Option<Arc<K>> {
        packed::PackedStore::get(self, key)
    }
    fn entries(&self) -> Vec<packed::Snapshot> {
        self.snapshot()
    }
    fn open(entry: &packed::Snapshot) -> Option<Arc<K>> {
        entry.open()
    }
}

/// An object's uid as [`Dispatch`] remembers it. kube-apiserver's uids are UUIDs: 16 bytes
/// kept, against 72 for the string and its allocation, once per cached object.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Uid {
    Uuid(u128),
    Other(Box<str>),
}

impl Uid {
    fn of<K: Resource>(o: &K) -> Self {
        let uid = o.meta().uid.as_deref().unwrap_or_default();
        uuid::Uuid::try_parse(uid)
            .map_or_else(|_| Uid::Other(uid.into()), |u| Uid::Uuid(u.as_u128()))
    }
}

/// Turns watch events, once the reflector's store has applied them, into what a handler sees.
struct Dispatch<K: Resource<DynamicType = ()>, E> {
    /// The uids reported and not deleted since.
    seen: HashSet<Uid>,
    /// The cache as it was when a (re-)list began.
    before: Vec<E>,
    /// The objects a (re-)list in progress has listed, in order.
    listed: Vec<reflector::ObjectRef<K>>,
}

impl<K: Resource<DynamicType = ()>, E> Default for Dispatch<K, E> {
    fn default() -> Self {
        Dispatch {
            seen: HashSet::new(),
            before: Vec::new(),
            listed: Vec::new(),
        }
    }
}

impl<K: Resource<DynamicType = ()> + Clone, E> Dispatch<K, E> {
    fn event<C: Cache<K, Entry = E>>(
        &mut self,
        ev: &watcher::Event<K>,
        cached: &C,
        on: &impl Fn(Seen<'_, K>),
    ) {
        match ev {
            watcher::Event::Apply(o) => {
                if self.seen.insert(Uid::of(o)) {
                    on(Seen::Added(o));
                } else {
                    on(Seen::Changed(o));
                }
            }
            watcher::Event::Delete(o) => {
                self.seen.remove(&Uid::of(o));
                on(Seen::Deleted(o));
            }
            watcher::Event::Init => {
                self.before = cached.entries();
                self.listed.clear();
            }
            // The store swaps in a (re-)list's objects only at InitDone: a handler told about
            // one now would look it up in the cache and find it missing (or stale), and
            // nothing would tell it again. They are reported at InitDone.
            watcher::Event::InitApply(o) => self.listed.push(reflector::ObjectRef::from_obj(o)),
            watcher::Event::InitDone => {
                let mut listed = HashSet::with_capacity(self.listed.len());
                for oref in self.listed.drain(..) {
                    let Some(o) = cached.get(&oref) else { continue };
                    let uid = Uid::of(o.as_ref());
                    listed.insert(uid.clone());
                    if self.seen.insert(uid) {
                        on(Seen::Added(o.as_ref()));
                    } else {
                        on(Seen::Changed(o.as_ref()));
                    }
                }
                // A re-list only lists what exists: what was deleted while no watch ran never
                // comes as a Delete. The cache as it was before the re-list tells which.
                for o in self.before.drain(..).filter_map(|e| C::open(&e)) {
                    let uid = Uid::of(o.as_ref());
                    if !listed.contains(&uid) && self.seen.remove(&uid) {
                        on(Seen::Deleted(o.as_ref()));
                    }
                }
            }
        }
    }
}

/// Publishes an Event on `obj` (`reason` is also its action); a failure is logged, never
/// fatal: an Event is a courtesy to the user, not part of the reconcile.
pub async fn publish_event<K: Resource<DynamicType = ()>>(
    recorder: &events::Publisher,
    obj: &K,
    warning: bool,
    reason: &str,
    note: String,
) {
    use events::{Event, EventType};
    let ev = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.into(),
        note: Some(note),
        action: reason.into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&ev, &obj.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "publishing an event");
    }
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

    #[test]
    fn a_relisted_object_is_reported_once_the_cache_holds_it() {
        use k8s_openapi::api::core::v1::ConfigMap;
        use kube::runtime::reflector::store::Writer;
        let cm = |name: &str, uid: &str| {
            let mut c = ConfigMap::default();
            c.metadata.name = Some(name.into());
            c.metadata.namespace = Some("ns".into());
            c.metadata.uid = Some(uid.into());
            c
        };
        let mut writer: Writer<ConfigMap> = Writer::default();
        let store = writer.as_reader();
        let mut dispatch = Dispatch::default();
        let log = std::cell::RefCell::new(Vec::new());
        let on = |s: Seen<'_, ConfigMap>| {
            let o = s.object();
            let cached = store
                .get(&reflector::ObjectRef::from_obj(o))
                .is_some_and(|c| c.metadata.uid == o.metadata.uid);
            let what = match s {
                Seen::Added(_) => "added",
                Seen::Changed(_) => "changed",
                Seen::Deleted(_) => "deleted",
            };
            log.borrow_mut().push(format!(
                "{what} {} cached={cached}",
                o.metadata.name.as_deref().unwrap_or("")
            ));
        };
        let mut feed = |ev: watcher::Event<ConfigMap>| {
            writer.apply_watcher_event(&ev);
            dispatch.event(&ev, &store, &on);
        };
        // The first list, then a watch event.
        feed(watcher::Event::Init);
        feed(watcher::Event::InitApply(cm("a", "1")));
        feed(watcher::Event::InitApply(cm("gone", "2")));
        assert!(
            log.borrow().is_empty(),
            "nothing before the list is in the cache"
        );
        feed(watcher::Event::InitDone);
        feed(watcher::Event::Apply(cm("b", "3")));
        // A re-list (after an expired watch): `gone` was deleted meanwhile, `late` was
        // created and never came as a watch event.
        feed(watcher::Event::Init);
        feed(watcher::Event::InitApply(cm("a", "1")));
        feed(watcher::Event::InitApply(cm("b", "3")));
        feed(watcher::Event::InitApply(cm("late", "4")));
        feed(watcher::Event::InitDone);
        assert_eq!(
            *log.borrow(),
            [
                "added a cached=true",
                "added gone cached=true",
                "added b cached=true",
                "changed a cached=true",
                "changed b cached=true",
                "added late cached=true",
                "deleted gone cached=false",
            ]
        );
    }
}
