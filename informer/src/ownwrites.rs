//! A reconciler's own writes the cache has not caught up with. After a compare-and-swap patch
//! succeeds, the cache still holds the copy the patch named, and a sync from that copy would
//! compute the same change again and send it with a resourceVersion that can only conflict
//! (a refused write is still a write kube-apiserver serves). The watch event of the write
//! queues the key again, so such a sync can wait for it.

use std::collections::HashMap;
use std::sync::Mutex;

/// Per key, the resourceVersion a successful patch was made against.
#[derive(Debug, Default)]
pub struct OwnWrites {
    written_over: Mutex<HashMap<String, String>>,
}

impl OwnWrites {
    /// A patch of `key` that named `resource_version` succeeded.
    pub fn wrote(&self, key: &str, resource_version: Option<&str>) {
        if let Some(rv) = resource_version {
            self.lock().insert(key.to_owned(), rv.to_owned());
        }
    }

    /// Whether the cached copy of `key` is still the one the last successful patch replaced.
    /// Forgets the write once the cache has moved on.
    pub fn cache_behind(&self, key: &str, cached: Option<&str>) -> bool {
        let mut written = self.lock();
        match written.get(key) {
            Some(rv) if Some(rv.as_str()) == cached => true,
            Some(_) => {
                written.remove(key);
                false
            }
            None => false,
        }
    }

    /// The object is gone: nothing to wait for.
    pub fn forget(&self, key: &str) {
        self.lock().remove(key);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.written_over
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sync_waits_only_while_the_cache_holds_the_replaced_copy() {
        let w = OwnWrites::default();
        assert!(!w.cache_behind("ns/a", Some("1")), "nothing written");
        w.wrote("ns/a", Some("1"));
        assert!(w.cache_behind("ns/a", Some("1")));
        assert!(w.cache_behind("ns/a", Some("1")), "still behind");
        assert!(!w.cache_behind("ns/b", Some("1")), "another key");
        assert!(!w.cache_behind("ns/a", Some("2")), "caught up");
        assert!(
            !w.cache_behind("ns/a", Some("1")),
            "forgotten once caught up"
        );
        w.wrote("ns/a", Some("2"));
        w.forget("ns/a");
        assert!(!w.cache_behind("ns/a", Some("2")));
    }
}
