//! Controller expectations, as KubeVirt (and Kubernetes' ReplicaSet controller) keep them.
//!
//! A controller that creates or deletes children records how many of each it expects to see
//! in its cache before it may act on that key again. Without this, a reconcile that runs
//! before the cache caught up with the controller's own write would create a second pod or
//! VMI. An expectation is satisfied when every expected add / delete was observed, or when it
//! is older than [`EXPECTATION_TTL`] (a watch can drop events; the controller must not stall
//! forever on one).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long an expectation holds before it counts as satisfied anyway (KubeVirt's
/// `ExpectationsTimeout`, 5 minutes).
pub const EXPECTATION_TTL: Duration = Duration::from_mins(5);

/// The time source; tests replace it to step over the TTL.
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

#[derive(Debug, Clone, Copy)]
struct Pending {
    adds: i64,
    dels: i64,
    since: Instant,
}

impl Pending {
    fn fulfilled(&self) -> bool {
        self.adds <= 0 && self.dels <= 0
    }
}

/// Per-key add / delete expectations (KubeVirt's `ControllerExpectations`).
pub struct Expectations {
    ttl: Duration,
    clock: Clock,
    pending: Mutex<HashMap<String, Pending>>,
}

impl std::fmt::Debug for Expectations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Expectations")
            .field("ttl", &self.ttl)
            .field("keys", &self.lock().len())
            .finish_non_exhaustive()
    }
}

impl Default for Expectations {
    fn default() -> Self {
        Self::with_clock(EXPECTATION_TTL, Arc::new(Instant::now))
    }
}

impl Expectations {
    /// Expectations with a TTL and a clock of the caller's choosing.
    pub fn with_clock(ttl: Duration, clock: Clock) -> Self {
        Self {
            ttl,
            clock,
            pending: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        // A panic while holding the lock leaves plain counters behind, still meaningful.
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the controller may act on `key`: nothing pending, all observed, or expired.
    /// A satisfied entry is dropped (it means no more than no entry), so the map holds only
    /// keys with writes in flight rather than one entry per object ever synced.
    pub fn satisfied(&self, key: &str) -> bool {
        let now = (self.clock)();
        let mut map = self.lock();
        let ok = map
            .get(key)
            .is_none_or(|p| p.fulfilled() || now.duration_since(p.since) > self.ttl);
        if ok {
            map.remove(key);
        }
        ok
    }

    /// Replace the expectations of `key` (KubeVirt's `SetExpectations`).
    pub fn set(&self, key: &str, adds: i64, dels: i64) {
        let since = (self.clock)();
        self.lock()
            .insert(key.to_owned(), Pending { adds, dels, since });
    }

    /// Expect `n` creations for `key`.
    pub fn expect_creations(&self, key: &str, n: i64) {
        self.set(key, n, 0);
    }

    /// Expect `n` deletions for `key`.
    pub fn expect_deletions(&self, key: &str, n: i64) {
        self.set(key, 0, n);
    }

    /// Add to what is pending for `key`, keeping its age (KubeVirt's `RaiseExpectations`).
    pub fn raise(&self, key: &str, adds: i64, dels: i64) {
        let since = (self.clock)();
        let mut map = self.lock();
        let p = map.entry(key.to_owned()).or_insert(Pending {
            adds: 0,
            dels: 0,
            since,
        });
        p.adds += adds;
        p.dels += dels;
    }

    /// A child of `key` was seen created (or a create failed and will never be seen).
    pub fn creation_observed(&self, key: &str) {
        if let Some(p) = self.lock().get_mut(key) {
            p.adds -= 1;
        }
    }

    /// A child of `key` was seen deleted (or a delete failed and will never be seen).
    pub fn deletion_observed(&self, key: &str) {
        if let Some(p) = self.lock().get_mut(key) {
            p.dels -= 1;
        }
    }

    /// Outstanding (adds, deletes) of `key`, if it has an entry.
    pub fn pending(&self, key: &str) -> Option<(i64, i64)> {
        self.lock().get(key).map(|p| (p.adds, p.dels))
    }

    /// Forget `key` (its owner is gone).
    pub fn delete(&self, key: &str) {
        self.lock().remove(key);
    }
}

/// Expectations that remember which children are being deleted, so a deletion is counted
/// once, and only for a child this controller deleted (KubeVirt's
/// `UIDTrackingControllerExpectations`; the tracked keys are `namespace/name` of children).
#[derive(Debug, Default)]
pub struct UidTrackingExpectations {
    inner: Expectations,
    deleting: Mutex<HashMap<String, HashSet<String>>>,
}

impl UidTrackingExpectations {
    /// With a TTL and clock of the caller's choosing.
    pub fn with_clock(ttl: Duration, clock: Clock) -> Self {
        Self {
            inner: Expectations::with_clock(ttl, clock),
            deleting: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashSet<String>>> {
        self.deleting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The plain add/delete counters.
    pub fn counters(&self) -> &Expectations {
        &self.inner
    }

    /// Whether `key` may be acted on. Once satisfied, the remembered deletions are dropped.
    pub fn satisfied(&self, key: &str) -> bool {
        let ok = self.inner.satisfied(key);
        if ok {
            self.lock().remove(key);
        }
        ok
    }

    /// Expect the deletion of exactly these children of `key`.
    pub fn expect_deletions(&self, key: &str, children: &[String]) {
        let n = i64::try_from(children.len()).unwrap_or(i64::MAX);
        self.lock()
            .insert(key.to_owned(), children.iter().cloned().collect());
        self.inner.expect_deletions(key, n);
    }

    /// Expect `n` creations for `key`.
    pub fn expect_creations(&self, key: &str, n: i64) {
        self.inner.expect_creations(key, n);
    }

    /// A child of `key` was seen created.
    pub fn creation_observed(&self, key: &str) {
        self.inner.creation_observed(key);
    }

    /// `child` of `key` was seen deleted: counted only if this controller deleted it, and only
    /// the first time.
    pub fn deletion_observed(&self, key: &str, child: &str) {
        let removed = self
            .lock()
            .get_mut(key)
            .is_some_and(|set| set.remove(child));
        if removed {
            self.inner.deletion_observed(key);
        }
    }

    /// Forget `key`.
    pub fn delete(&self, key: &str) {
        self.lock().remove(key);
        self.inner.delete(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clock the test moves by hand.
    fn manual_clock() -> (Clock, Arc<Mutex<Instant>>) {
        let now = Arc::new(Mutex::new(Instant::now()));
        let c = now.clone();
        (Arc::new(move || *c.lock().unwrap()), now)
    }

    #[test]
    fn unknown_key_is_satisfied() {
        assert!(Expectations::default().satisfied("ns/a"));
    }

    #[test]
    fn creations_are_satisfied_when_all_observed() {
        let e = Expectations::default();
        e.expect_creations("ns/a", 2);
        assert!(!e.satisfied("ns/a"));
        e.creation_observed("ns/a");
        assert!(!e.satisfied("ns/a"));
        e.creation_observed("ns/a");
        assert!(e.satisfied("ns/a"));
        assert!(e.satisfied("ns/b"), "keys are independent");
    }

    #[test]
    fn deletions_are_satisfied_when_all_observed() {
        let e = Expectations::default();
        e.expect_deletions("ns/a", 1);
        assert!(!e.satisfied("ns/a"));
        e.deletion_observed("ns/a");
        assert!(e.satisfied("ns/a"));
    }

    #[test]
    fn satisfied_expectations_leave_no_entry_behind() {
        let (clock, now) = manual_clock();
        let e = Expectations::with_clock(EXPECTATION_TTL, clock);
        e.expect_creations("ns/a", 1);
        e.expect_deletions("ns/b", 1);
        assert!(!e.satisfied("ns/a"));
        assert_eq!(
            e.pending("ns/a"),
            Some((1, 0)),
            "kept while a write is in flight"
        );
        e.creation_observed("ns/a");
        assert!(e.satisfied("ns/a"));
        assert_eq!(e.pending("ns/a"), None);
        // A late observation of a dropped key is ignored; new expectations start afresh.
        e.creation_observed("ns/a");
        e.expect_creations("ns/a", 1);
        assert!(!e.satisfied("ns/a"));
        *now.lock().unwrap() += EXPECTATION_TTL + Duration::from_secs(1);
        assert!(e.satisfied("ns/b"), "expired");
        assert_eq!(e.pending("ns/b"), None);
        assert!(e.lock().keys().eq(["ns/a"]));
    }

    #[test]
    fn expectations_expire_after_the_ttl() {
        let (clock, now) = manual_clock();
        let e = Expectations::with_clock(EXPECTATION_TTL, clock);
        e.expect_creations("ns/a", 1);
        *now.lock().unwrap() += EXPECTATION_TTL;
        assert!(!e.satisfied("ns/a"), "exactly at the TTL it still holds");
        *now.lock().unwrap() += Duration::from_secs(1);
        assert!(e.satisfied("ns/a"));
    }

    #[test]
    fn raise_adds_to_pending_and_set_replaces() {
        let e = Expectations::default();
        e.raise("k", 1, 0);
        e.raise("k", 2, 1);
        assert_eq!(e.pending("k"), Some((3, 1)));
        e.set("k", 0, 0);
        assert_eq!(e.pending("k"), Some((0, 0)));
        assert!(e.satisfied("k"));
        e.delete("k");
        assert_eq!(e.pending("k"), None);
    }

    #[test]
    fn uid_tracking_counts_only_own_deletions_once() {
        let e = UidTrackingExpectations::default();
        e.expect_deletions("ns/rs", &["ns/a".into(), "ns/b".into()]);
        assert!(!e.satisfied("ns/rs"));
        e.deletion_observed("ns/rs", "ns/other");
        e.deletion_observed("ns/rs", "ns/a");
        e.deletion_observed("ns/rs", "ns/a");
        assert_eq!(e.counters().pending("ns/rs"), Some((0, 1)));
        assert!(!e.satisfied("ns/rs"));
        e.deletion_observed("ns/rs", "ns/b");
        assert!(e.satisfied("ns/rs"));
    }

    #[test]
    fn uid_tracking_expires_too() {
        let (clock, now) = manual_clock();
        let e = UidTrackingExpectations::with_clock(Duration::from_secs(10), clock);
        e.expect_deletions("k", &["ns/a".into()]);
        *now.lock().unwrap() += Duration::from_secs(11);
        assert!(e.satisfied("k"));
        // The remembered deletion was dropped with the satisfied expectation: a late
        // observation counts for nothing and brings no entry back.
        e.deletion_observed("k", "ns/a");
        assert_eq!(e.counters().pending("k"), None);
        assert!(e.lock().is_empty());
    }
}
