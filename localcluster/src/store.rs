//! In-memory object storage with one global resourceVersion and a bounded event history.
//!
//! Every write runs under one lock and gets the next resourceVersion, so the history is a single
//! totally ordered log; a watch takes its backlog and its live subscription under that same lock,
//! which is what makes watches gap-free and ordered.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde_json::Value;
use tokio::sync::broadcast;

use crate::error::ApiError;
use crate::resources::GroupResource;

/// What happened to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One entry of the event history.
#[derive(Debug, Clone)]
pub struct Event {
    pub rv: u64,
    pub gr: GroupResource,
    pub namespace: String,
    pub type_: EventType,
    pub object: Value,
    /// The object before the change, so watches can tell selector transitions.
    pub old: Option<Value>,
    /// `object` serialized once, shared by every watcher that sends it unchanged.
    pub json: OnceLock<String>,
}

impl Event {
    pub fn object_json(&self) -> &str {
        self.json.get_or_init(|| self.object.to_string())
    }
}

/// Objects of one group/resource, keyed by (namespace, name); namespace is "" when cluster-scoped.
pub type Bucket = BTreeMap<(String, String), Value>;

/// What a mutation decided to do with the object it was given.
#[derive(Debug)]
pub enum Outcome {
    /// Store this object (create or replace); the store assigns its resourceVersion.
    Put(Value),
    /// Remove the object; the value is what the DELETED event carries.
    Delete(Value),
    /// Nothing changed; return this object as it is.
    Unchanged(Value),
}

/// The state of every object, readable inside a mutation.
#[derive(Debug, Default)]
pub struct Objects(HashMap<GroupResource, Bucket>);

impl Objects {
    pub fn get(&self, gr: &GroupResource, namespace: &str, name: &str) -> Option<&Value> {
        self.0
            .get(gr)
            .and_then(|b| b.get(&(namespace.to_string(), name.to_string())))
    }

    pub fn bucket(&self, gr: &GroupResource) -> Option<&Bucket> {
        self.0.get(gr)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&GroupResource, &Bucket)> {
        self.0.iter()
    }
}

#[derive(Debug)]
struct Inner {
    rv: u64,
    objects: Objects,
    history: VecDeque<Arc<Event>>,
    /// The highest resourceVersion that has fallen out of the history.
    compacted: u64,
    window: usize,
}

/// Where a watch starts.
#[derive(Debug)]
pub enum WatchStart {
    /// The current objects (for synthetic ADDED events) as of `rv`.
    Snapshot { objects: Vec<Value>, rv: u64 },
    /// The events after the requested resourceVersion.
    Backlog(Vec<Arc<Event>>),
}

/// The object store.
#[derive(Debug)]
pub struct Store {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<Event>>,
}

/// How many events a slow watcher may fall behind before its watch ends with 410 Expired.
const FANOUT_BUFFER: usize = 16_384;

impl Store {
    pub fn new(history_window: usize) -> Self {
        let (tx, _) = broadcast::channel(FANOUT_BUFFER);
        Self {
            inner: Mutex::new(Inner {
                rv: 1,
                objects: Objects::default(),
                history: VecDeque::new(),
                compacted: 0,
                window: history_window.max(1),
            }),
            tx,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn current_rv(&self) -> u64 {
        self.lock().rv
    }

    /// The highest resourceVersion no longer covered by the history.
    pub fn compacted_rv(&self) -> u64 {
        self.lock().compacted
    }

    pub fn get(&self, gr: &GroupResource, namespace: &str, name: &str) -> Option<Value> {
        self.lock().objects.get(gr, namespace, name).cloned()
    }

    /// Every object of a resource (in one namespace, or all), sorted by namespace and name,
    /// with the resourceVersion the list is consistent with.
    pub fn list(&self, gr: &GroupResource, namespace: Option<&str>) -> (Vec<Value>, u64) {
        let inner = self.lock();
        let items = inner
            .objects
            .bucket(gr)
            .map(|b| {
                b.iter()
                    .filter(|((ns, _), _)| namespace.is_none_or(|want| want == ns))
                    .map(|(_, v)| v.clone())
                    .collect()
            })
            .unwrap_or_default();
        (items, inner.rv)
    }

    /// Reads several buckets at once, consistently.
    pub fn read<T>(&self, f: impl FnOnce(&Objects) -> T) -> T {
        f(&self.lock().objects)
    }

    /// Runs `f` on the current object under the store lock and applies its outcome.
    pub fn mutate(
        &self,
        gr: &GroupResource,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&Objects, Option<&Value>) -> Result<Outcome, ApiError>,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let current = inner.objects.get(gr, namespace, name).cloned();
        let outcome = f(&inner.objects, current.as_ref())?;
        let key = (namespace.to_string(), name.to_string());
        let (type_, object) = match outcome {
            Outcome::Unchanged(obj) => return Ok(obj),
            Outcome::Put(mut obj) => {
                inner.rv += 1;
                obj["metadata"]["resourceVersion"] = Value::String(inner.rv.to_string());
                inner
                    .objects
                    .0
                    .entry(gr.clone())
                    .or_default()
                    .insert(key, obj.clone());
                let type_ = if current.is_some() {
                    EventType::Modified
                } else {
                    EventType::Added
                };
                (type_, obj)
            }
            Outcome::Delete(mut obj) => {
                if current.is_none() {
                    return Ok(obj);
                }
                inner.rv += 1;
                obj["metadata"]["resourceVersion"] = Value::String(inner.rv.to_string());
                if let Some(bucket) = inner.objects.0.get_mut(gr) {
                    bucket.remove(&key);
                }
                (EventType::Deleted, obj)
            }
        };
        let event = Arc::new(Event {
            rv: inner.rv,
            gr: gr.clone(),
            namespace: namespace.to_string(),
            type_,
            object: object.clone(),
            old: current,
            json: OnceLock::new(),
        });
        inner.history.push_back(event.clone());
        while inner.history.len() > inner.window {
            if let Some(dropped) = inner.history.pop_front() {
                inner.compacted = dropped.rv;
            }
        }
        // Nobody listening is fine: the history still has the event.
        let _ = self.tx.send(event);
        Ok(object)
    }

    /// Like [`Store::mutate`], but only reports what the outcome would be (`dryRun=All`):
    /// nothing is stored and no event is recorded.
    pub fn dry_run(
        &self,
        gr: &GroupResource,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&Objects, Option<&Value>) -> Result<Outcome, ApiError>,
    ) -> Result<Value, ApiError> {
        let inner = self.lock();
        let current = inner.objects.get(gr, namespace, name).cloned();
        match f(&inner.objects, current.as_ref())? {
            Outcome::Put(v) | Outcome::Delete(v) | Outcome::Unchanged(v) => Ok(v),
        }
    }

    /// Starts a watch of one resource: the backlog (or snapshot) and the live feed, taken together.
    /// `from` is the resourceVersion the client has seen; `None` asks for a snapshot.
    pub fn watch(
        &self,
        gr: &GroupResource,
        namespace: Option<&str>,
        from: Option<u64>,
    ) -> Result<(WatchStart, broadcast::Receiver<Arc<Event>>), ApiError> {
        let inner = self.lock();
        let rx = self.tx.subscribe();
        let start = match from {
            None => WatchStart::Snapshot {
                objects: inner
                    .objects
                    .bucket(gr)
                    .map(|b| {
                        b.iter()
                            .filter(|((ns, _), _)| namespace.is_none_or(|want| want == ns))
                            .map(|(_, v)| v.clone())
                            .collect()
                    })
                    .unwrap_or_default(),
                rv: inner.rv,
            },
            Some(rv) => {
                if rv < inner.compacted {
                    return Err(ApiError::expired(format!(
                        "too old resource version: {rv} ({})",
                        inner.compacted + 1
                    )));
                }
                WatchStart::Backlog(
                    inner
                        .history
                        .iter()
                        .filter(|e| e.rv > rv && &e.gr == gr)
                        .filter(|e| namespace.is_none_or(|want| want == e.namespace))
                        .cloned()
                        .collect(),
                )
            }
        };
        Ok((start, rx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gr() -> GroupResource {
        GroupResource {
            group: String::new(),
            resource: "configmaps".into(),
        }
    }

    fn put(store: &Store, name: &str) -> Value {
        store
            .mutate(&gr(), "ns", name, |_, _| {
                Ok(Outcome::Put(
                    json!({"metadata": {"name": name, "namespace": "ns"}}),
                ))
            })
            .unwrap()
    }

    #[test]
    fn resource_versions_are_global_and_monotonic() {
        let store = Store::new(10);
        let a = put(&store, "a");
        let b = put(&store, "b");
        let rv = |v: &Value| {
            v["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        };
        assert!(rv(&b) > rv(&a));
        assert_eq!(store.current_rv(), rv(&b));
        let (items, _) = store.list(&gr(), Some("ns"));
        assert_eq!(items.len(), 2);
    }

    #[test]
    fn history_window_expires_old_versions() {
        let store = Store::new(2);
        let first = put(&store, "a");
        let first_rv: u64 = first["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        put(&store, "b");
        put(&store, "c");
        let dry = store
            .dry_run(&gr(), "ns", "z", |_, _| {
                Ok(Outcome::Put(json!({"metadata": {"name": "z"}})))
            })
            .unwrap();
        assert_eq!(dry["metadata"]["name"], "z");
        assert!(
            store.get(&gr(), "ns", "z").is_none(),
            "a dry run stores nothing"
        );
        let err = store.watch(&gr(), None, Some(first_rv - 1)).unwrap_err();
        assert_eq!(err.code, 410);
        let (start, _) = store.watch(&gr(), None, Some(first_rv)).unwrap();
        match start {
            WatchStart::Backlog(events) => assert_eq!(events.len(), 2),
            WatchStart::Snapshot { .. } => panic!("expected a backlog"),
        }
    }
}
