//! A reflector cache that keeps each object as its JSON and decodes it on read.
//!
//! k8s-openapi's structs hold every optional field inline: a `Pod` is 2.3 KB before any of
//! its strings, however little of it is set. A launcher pod trimmed to what the controllers
//! read took 4.5 KB of heap as a struct and takes 1.4 KB as JSON (heaptrack, 2,000 pods), so
//! for kinds cached by the ten thousand and read one at a time (launcher pods, read by name in
//! a VMI's sync) the JSON is the copy kept; a read decodes it. Kinds whose readers walk the
//! whole cache (VMIs: evacuation, replica sets, metrics) keep kube-runtime's `Store`, where a
//! walk decodes nothing.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

type Objects<K> = HashMap<ObjectRef<K>, Arc<[u8]>>;

/// The cache: `get` and `state` as kube-runtime's `Store` has them.
pub struct PackedStore<K: Resource<DynamicType = ()>> {
    objects: Arc<RwLock<Objects<K>>>,
    ready: watch::Receiver<bool>,
}

impl<K: Resource<DynamicType = ()>> Clone for PackedStore<K> {
    fn clone(&self) -> Self {
        Self {
            objects: self.objects.clone(),
            ready: self.ready.clone(),
        }
    }
}

impl<K: Resource<DynamicType = ()>> std::fmt::Debug for PackedStore<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedStore")
            .field("objects", &self.read().len())
            .finish_non_exhaustive()
    }
}

/// The reflector stopped before its first list completed.
#[derive(Debug, thiserror::Error)]
#[error("the reflector stopped before the cache was ready")]
pub struct NeverReady;

impl<K: Resource<DynamicType = ()>> PackedStore<K> {
    fn read(&self) -> RwLockReadGuard<'_, Objects<K>> {
        self.objects
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<K: Resource<DynamicType = ()> + DeserializeOwned> PackedStore<K> {
    /// The object `key` names, as last seen.
    pub fn get(&self, key: &ObjectRef<K>) -> Option<Arc<K>> {
        let json = self.read().get(key).cloned()?;
        decode(&json)
    }

    pub(crate) fn packed_entries(&self) -> Vec<Arc<[u8]>> {
        self.read().values().cloned().collect()
    }

    /// Every cached object (each decoded: for occasional walks only).
    pub fn state(&self) -> Vec<Arc<K>> {
        self.packed_entries()
            .iter()
            .filter_map(|j| decode(j))
            .collect()
    }

    /// Waits for the first list to be in the cache.
    ///
    /// # Errors
    /// The reflector stopped first.
    pub async fn wait_until_ready(&self) -> Result<(), NeverReady> {
        let mut ready = self.ready.clone();
        ready
            .wait_for(|r| *r)
            .await
            .map(|_| ())
            .map_err(|_| NeverReady)
    }
}

pub(crate) fn decode<K: DeserializeOwned>(json: &[u8]) -> Option<Arc<K>> {
    match serde_json::from_slice(json) {
        Ok(o) => Some(Arc::new(o)),
        Err(e) => {
            // Written by `encode` from the same type: only a bug gets here.
            tracing::error!(error = %e, "a cached object does not decode");
            None
        }
    }
}

fn encode<K: Serialize>(o: &K) -> Option<Arc<[u8]>> {
    serde_json::to_vec(o).ok().map(Into::into)
}

/// The reflector's side of a [`PackedStore`]: applies watch events as kube-runtime's
/// `Writer` does (a re-list's objects replace the cache at once, when it completes).
pub(crate) struct PackedWriter<K: Resource<DynamicType = ()>> {
    objects: Arc<RwLock<Objects<K>>>,
    buffer: Objects<K>,
    ready: watch::Sender<bool>,
}

impl<K: Resource<DynamicType = ()> + Serialize + DeserializeOwned> PackedWriter<K> {
    pub(crate) fn new() -> (Self, PackedStore<K>) {
        let objects = Arc::default();
        let (ready, ready_rx) = watch::channel(false);
        let store = PackedStore {
            objects: Arc::clone(&objects),
            ready: ready_rx,
        };
        let writer = PackedWriter {
            objects,
            buffer: HashMap::new(),
            ready,
        };
        (writer, store)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Objects<K>> {
        self.objects
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn apply(&mut self, ev: &watcher::Event<K>) {
        match ev {
            watcher::Event::Apply(o) => {
                if let Some(json) = encode(o) {
                    self.write().insert(ObjectRef::from_obj(o), json);
                }
            }
            watcher::Event::Delete(o) => {
                self.write().remove(&ObjectRef::from_obj(o));
            }
            watcher::Event::Init => self.buffer = HashMap::new(),
            watcher::Event::InitApply(o) => {
                if let Some(json) = encode(o) {
                    self.buffer.insert(ObjectRef::from_obj(o), json);
                }
            }
            watcher::Event::InitDone => {
                let mut listed = std::mem::take(&mut self.buffer);
                listed.shrink_to_fit();
                *self.write() = listed;
                self.ready.send_replace(true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn cm(name: &str, data: &str) -> ConfigMap {
        let mut c = ConfigMap::default();
        c.metadata.name = Some(name.into());
        c.metadata.namespace = Some("ns".into());
        c.data = Some([("k".to_owned(), data.to_owned())].into());
        c
    }

    #[test]
    fn objects_read_back_as_written_and_a_relist_replaces_them_when_done() {
        let (mut w, store) = PackedWriter::new();
        let key = |n: &str| ObjectRef::new(n).within("ns");
        w.apply(&watcher::Event::Init);
        w.apply(&watcher::Event::InitApply(cm("a", "1")));
        assert!(
            store.get(&key("a")).is_none(),
            "not before the list is done"
        );
        w.apply(&watcher::Event::InitDone);
        assert_eq!(store.get(&key("a")).as_deref(), Some(&cm("a", "1")));
        w.apply(&watcher::Event::Apply(cm("a", "2")));
        w.apply(&watcher::Event::Apply(cm("b", "1")));
        assert_eq!(store.get(&key("a")).as_deref(), Some(&cm("a", "2")));
        w.apply(&watcher::Event::Delete(cm("b", "1")));
        assert!(store.get(&key("b")).is_none());
        // A re-list: `a` is gone meanwhile, `c` is new.
        w.apply(&watcher::Event::Init);
        w.apply(&watcher::Event::InitApply(cm("c", "1")));
        assert!(store.get(&key("a")).is_some());
        w.apply(&watcher::Event::InitDone);
        let names: Vec<_> = store
            .state()
            .iter()
            .map(|c| c.metadata.name.clone().unwrap_or_default())
            .collect();
        assert_eq!(names, ["c"]);
    }
}
