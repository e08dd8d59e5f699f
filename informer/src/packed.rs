//! A reflector cache that keeps each object as compressed JSON, with indexes, and decodes an
//! object only when it is read.
//!
//! k8s-openapi's structs hold every optional field inline: a `Pod` is 2.3 KB and a
//! `VirtualMachineInstance` 4.4 KB before any of their strings, however little of them is set.
//! For kinds cached by the ten thousand (launcher pods, VMIs) the copy kept is the object's
//! JSON, compressed by zstd against a sibling: the first object the cache stores is the
//! dictionary of every later one. Objects of one kind in one cluster share most of their JSON
//! (keys, defaults, a template's values), so each costs little more than what makes it
//! different (its name, uid, timestamps, node).
//!
//! A walk of the whole cache decodes every object, so readers that look for some of them
//! ask an index instead (client-go's `Indexer`): an [`Indexer`] names values of an object
//! (its node, its claims, its phase), and [`PackedStore::by_index`] decodes only the objects
//! with a value. [`PackedStore::index_counts`] counts them without decoding any.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kube::Resource;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// zstd's level: its default, fast enough for a watch event and within a few percent of the
/// higher levels on objects this small.
const LEVEL: i32 = 3;

/// A named index: the values under which an object is found (none: not in this index).
pub struct Indexer<K> {
    /// What readers ask for, e.g. `"node"`.
    pub name: &'static str,
    /// The object's values in this index.
    pub values: fn(&K) -> Vec<String>,
}

impl<K> std::fmt::Debug for Indexer<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Indexer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<K> Clone for Indexer<K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Indexer<K> {}

/// One cached object: its compressed JSON, and the index values it is filed under (index
/// position, value), kept so that an update or delete unfiles it without decoding.
struct Entry {
    packed: Arc<[u8]>,
    filed: Box<[(u8, Arc<str>)]>,
}

/// Per index, per value, the keys of the objects with it. Values are shared with the
/// entries' `filed`, keys with the object map.
type Index = HashMap<Arc<str>, HashSet<Arc<str>>>;

struct Inner {
    objects: HashMap<Arc<str>, Entry>,
    indexes: Vec<Index>,
}

impl Inner {
    fn new(indexes: usize) -> Self {
        Inner {
            objects: HashMap::new(),
            indexes: vec![Index::new(); indexes],
        }
    }

    /// Unfiles and drops the object `key`; its key, for an update to keep.
    fn remove(&mut self, key: &str) -> Option<Arc<str>> {
        let (key, entry) = self.objects.remove_entry(key)?;
        for (i, value) in &entry.filed {
            let index = &mut self.indexes[usize::from(*i)];
            if let Some(keys) = index.get_mut(value) {
                keys.remove(&key);
                if keys.is_empty() {
                    index.remove(value);
                }
            }
        }
        Some(key)
    }

    fn insert(&mut self, key: &str, packed: Arc<[u8]>, values: Vec<(u8, String)>) {
        let key = self.remove(key).unwrap_or_else(|| key.into());
        let mut filed = Vec::with_capacity(values.len());
        for (i, value) in values {
            let index = &mut self.indexes[usize::from(i)];
            let shared = match index.get_key_value(value.as_str()) {
                Some((v, _)) => v.clone(),
                None => Arc::from(value),
            };
            index.entry(shared.clone()).or_default().insert(key.clone());
            filed.push((i, shared));
        }
        self.objects.insert(
            key,
            Entry {
                packed,
                filed: filed.into(),
            },
        );
    }
}

/// The compression dictionary: the JSON of the first object stored, for the cache's life.
type Dictionary = Arc<OnceLock<Box<[u8]>>>;

/// The cache: `get`, `state` and `wait_until_ready` as kube-runtime's `Store` has them, and
/// its indexes.
pub struct PackedStore<K: Resource<DynamicType = ()>> {
    inner: Arc<RwLock<Inner>>,
    dictionary: Dictionary,
    indexers: Arc<[Indexer<K>]>,
    ready: watch::Receiver<bool>,
}

impl<K: Resource<DynamicType = ()>> Clone for PackedStore<K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            dictionary: self.dictionary.clone(),
            indexers: self.indexers.clone(),
            ready: self.ready.clone(),
        }
    }
}

impl<K: Resource<DynamicType = ()>> std::fmt::Debug for PackedStore<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedStore")
            .field("objects", &self.read().objects.len())
            .finish_non_exhaustive()
    }
}

/// The reflector stopped before its first list completed.
#[derive(Debug, thiserror::Error)]
#[error("the reflector stopped before the cache was ready")]
pub struct NeverReady;

/// A cached object as a re-list's snapshot holds it: opened only if the re-list lost it.
pub(crate) struct Snapshot {
    packed: Arc<[u8]>,
    dictionary: Dictionary,
}

impl<K: Resource<DynamicType = ()>> PackedStore<K> {
    fn read(&self) -> RwLockReadGuard<'_, Inner> {
        self.inner
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn index_position(&self, name: &str) -> usize {
        self.indexers
            .iter()
            .position(|i| i.name == name)
            .unwrap_or_else(|| panic!("no index {name:?} on the {} cache", K::kind(&())))
    }

    /// The keys (`namespace/name`) of the objects filed under `value` in index `index`.
    ///
    /// # Panics
    /// The cache has no such index (a programming error).
    pub fn keys_by_index(&self, index: &str, value: &str) -> Vec<String> {
        let i = self.index_position(index);
        self.read().indexes[i]
            .get(value)
            .map(|keys| keys.iter().map(ToString::to_string).collect())
            .unwrap_or_default()
    }

    /// How many objects each value of index `index` has.
    ///
    /// # Panics
    /// The cache has no such index (a programming error).
    pub fn index_counts(&self, index: &str) -> Vec<(String, usize)> {
        let i = self.index_position(index);
        self.read().indexes[i]
            .iter()
            .map(|(v, keys)| (v.to_string(), keys.len()))
            .collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.read().objects.len()
    }

    /// Whether no object is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn snapshot(&self) -> Vec<Snapshot> {
        self.read()
            .objects
            .values()
            .map(|e| Snapshot {
                packed: e.packed.clone(),
                dictionary: self.dictionary.clone(),
            })
            .collect()
    }
}

impl<K: Resource<DynamicType = ()> + DeserializeOwned> PackedStore<K> {
    /// The object `key` names, as last seen.
    pub fn get(&self, key: &ObjectRef<K>) -> Option<Arc<K>> {
        let packed = self
            .read()
            .objects
            .get(crate::key_of(key.namespace.as_deref(), &key.name).as_str())?
            .packed
            .clone();
        decode(&packed, &self.dictionary)
    }

    /// The objects filed under `value` in index `index`.
    ///
    /// # Panics
    /// The cache has no such index (a programming error).
    pub fn by_index(&self, index: &str, value: &str) -> Vec<Arc<K>> {
        let i = self.index_position(index);
        let packed: Vec<Arc<[u8]>> = {
            let inner = self.read();
            inner.indexes[i]
                .get(value)
                .map(|keys| {
                    keys.iter()
                        .filter_map(|k| inner.objects.get(k))
                        .map(|e| e.packed.clone())
                        .collect()
                })
                .unwrap_or_default()
        };
        packed
            .iter()
            .filter_map(|p| decode(p, &self.dictionary))
            .collect()
    }

    /// Every cached object (each decoded: for occasional walks only).
    pub fn state(&self) -> Vec<Arc<K>> {
        self.snapshot().iter().filter_map(Snapshot::open).collect()
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

impl Snapshot {
    pub(crate) fn open<K: DeserializeOwned>(&self) -> Option<Arc<K>> {
        decode(&self.packed, &self.dictionary)
    }
}

thread_local! {
    /// A decompression context per thread: making one allocates about 100 KB.
    static DCTX: RefCell<zstd_safe::DCtx<'static>> = RefCell::new(zstd_safe::DCtx::create());
}

fn decode<K: DeserializeOwned>(packed: &[u8], dictionary: &Dictionary) -> Option<Arc<K>> {
    // Written by `PackedWriter::encode` from the same type: only a bug fails here.
    let fail = |what: &dyn std::fmt::Display| {
        tracing::error!(error = %what, kind = std::any::type_name::<K>(), "a cached object does not decode");
    };
    let dict = dictionary.get().map_or(&[][..], |d| &d[..]);
    let Ok(Some(size)) = zstd_safe::get_frame_content_size(packed) else {
        fail(&"no content size in the zstd frame");
        return None;
    };
    let size = usize::try_from(size).unwrap_or(usize::MAX);
    let mut json = Vec::with_capacity(size);
    let done = DCTX.with_borrow_mut(|dctx| dctx.decompress_using_dict(&mut json, packed, dict));
    if let Err(code) = done {
        fail(&zstd_safe::get_error_name(code));
        return None;
    }
    match serde_json::from_slice(&json) {
        Ok(o) => Some(Arc::new(o)),
        Err(e) => {
            fail(&e);
            None
        }
    }
}

/// An object ready to be stored: its key, its compressed JSON and its index values (index
/// position, value).
type Encoded = (String, Arc<[u8]>, Vec<(u8, String)>);

/// The reflector's side of a [`PackedStore`]: applies watch events as kube-runtime's
/// `Writer` does (a re-list's objects replace the cache at once, when it completes).
pub(crate) struct PackedWriter<K: Resource<DynamicType = ()>> {
    store: PackedStore<K>,
    cctx: zstd_safe::CCtx<'static>,
    /// A re-list in progress.
    buffer: Vec<Encoded>,
    ready: watch::Sender<bool>,
}

impl<K: Resource<DynamicType = ()> + Serialize + DeserializeOwned> PackedWriter<K> {
    pub(crate) fn new(indexers: &[Indexer<K>]) -> (Self, PackedStore<K>) {
        assert!(u8::try_from(indexers.len()).is_ok(), "too many indexes");
        let (ready, ready_rx) = watch::channel(false);
        let store = PackedStore {
            inner: Arc::new(RwLock::new(Inner::new(indexers.len()))),
            dictionary: Arc::default(),
            indexers: indexers.into(),
            ready: ready_rx,
        };
        let writer = PackedWriter {
            store: store.clone(),
            cctx: zstd_safe::CCtx::create(),
            buffer: Vec::new(),
            ready,
        };
        (writer, store)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Inner> {
        self.store
            .inner
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The object's key, compressed JSON and index values; `None` if it does not serialize.
    fn encode(&mut self, o: &K) -> Option<Encoded> {
        let json = match serde_json::to_vec(o) {
            Ok(j) => j,
            Err(e) => {
                tracing::error!(error = %e, kind = %K::kind(&()), "an object does not serialize; not cached");
                return None;
            }
        };
        let dict = self
            .store
            .dictionary
            .get_or_init(|| json.clone().into_boxed_slice());
        let mut packed = Vec::with_capacity(zstd_safe::compress_bound(json.len()));
        if let Err(code) = self
            .cctx
            .compress_using_dict(&mut packed, &json, dict, LEVEL)
        {
            tracing::error!(
                error = zstd_safe::get_error_name(code),
                "zstd failed; not cached"
            );
            return None;
        }
        let values = self
            .store
            .indexers
            .iter()
            .zip(0u8..)
            .flat_map(|(indexer, i)| {
                let mut vs = (indexer.values)(o);
                vs.sort_unstable();
                vs.dedup();
                vs.into_iter().map(move |v| (i, v))
            })
            .collect();
        let meta = o.meta();
        let key = crate::key_of(
            meta.namespace.as_deref(),
            meta.name.as_deref().unwrap_or_default(),
        );
        Some((key, packed.into(), values))
    }

    pub(crate) fn apply(&mut self, ev: &watcher::Event<K>) {
        match ev {
            watcher::Event::Apply(o) => {
                if let Some((key, packed, values)) = self.encode(o) {
                    self.write().insert(&key, packed, values);
                }
            }
            watcher::Event::Delete(o) => {
                let meta = o.meta();
                let key = crate::key_of(
                    meta.namespace.as_deref(),
                    meta.name.as_deref().unwrap_or_default(),
                );
                self.write().remove(&key);
            }
            watcher::Event::Init => self.buffer = Vec::new(),
            watcher::Event::InitApply(o) => {
                if let Some(entry) = self.encode(o) {
                    self.buffer.push(entry);
                }
            }
            watcher::Event::InitDone => {
                let mut listed = Inner::new(self.store.indexers.len());
                for (key, packed, values) in std::mem::take(&mut self.buffer) {
                    listed.insert(&key, packed, values);
                }
                listed.objects.shrink_to_fit();
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

    fn by_data(c: &ConfigMap) -> Vec<String> {
        c.data.iter().flat_map(|d| d.values().cloned()).collect()
    }

    const BY_DATA: Indexer<ConfigMap> = Indexer {
        name: "data",
        values: by_data,
    };

    fn names(objects: &[Arc<ConfigMap>]) -> Vec<String> {
        let mut names: Vec<_> = objects
            .iter()
            .map(|c| c.metadata.name.clone().unwrap_or_default())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn objects_read_back_as_written_and_a_relist_replaces_them_when_done() {
        let (mut w, store) = PackedWriter::new(&[BY_DATA]);
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
        assert_eq!(names(&store.state()), ["c"]);
        assert_eq!(store.keys_by_index("data", "1"), ["ns/c"]);
        assert!(store.keys_by_index("data", "2").is_empty());
    }

    #[test]
    fn indexes_follow_updates_and_deletes_and_count_without_decoding() {
        let (mut w, store) = PackedWriter::new(&[BY_DATA]);
        w.apply(&watcher::Event::Init);
        w.apply(&watcher::Event::InitDone);
        for (name, data) in [("a", "x"), ("b", "x"), ("c", "y")] {
            w.apply(&watcher::Event::Apply(cm(name, data)));
        }
        assert_eq!(names(&store.by_index("data", "x")), ["a", "b"]);
        w.apply(&watcher::Event::Apply(cm("a", "y")));
        assert_eq!(names(&store.by_index("data", "x")), ["b"]);
        assert_eq!(names(&store.by_index("data", "y")), ["a", "c"]);
        w.apply(&watcher::Event::Delete(cm("b", "x")));
        let mut counts = store.index_counts("data");
        counts.sort();
        assert_eq!(counts, [("y".to_owned(), 2)], "an emptied value is dropped");
        assert!(store.by_index("data", "x").is_empty());
    }

    #[test]
    fn siblings_compress_against_the_first_object() {
        let (mut w, store) = PackedWriter::new(&[]);
        let big = |name: &str| {
            let mut c = cm(name, &"the same long value, ".repeat(40));
            c.metadata.uid = Some(format!("uid-of-{name}"));
            c
        };
        w.apply(&watcher::Event::Init);
        w.apply(&watcher::Event::InitDone);
        w.apply(&watcher::Event::Apply(big("first")));
        w.apply(&watcher::Event::Apply(big("second")));
        let json = serde_json::to_vec(&big("second")).unwrap();
        let inner = store.read();
        let packed = inner.objects.get("ns/second").unwrap().packed.len();
        assert!(
            packed * 10 < json.len(),
            "{packed} bytes of {} are not a tenth",
            json.len()
        );
        drop(inner);
        assert_eq!(
            store.get(&ObjectRef::new("second").within("ns")).as_deref(),
            Some(&big("second"))
        );
    }
}
