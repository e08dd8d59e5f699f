//! The work queue of virt-controller's controllers and virt-handler's node loop, with
//! client-go's rate-limiting queue semantics (KubeVirt builds both on
//! `workqueue.DefaultControllerRateLimiter`):
//!
//! - a key waits in the queue at most once, however often it is added;
//! - a key being processed is never handed to a second worker; added meanwhile, it is queued
//!   again when that worker is done with it;
//! - a key that fails is re-added after a per-key exponential backoff (`base * 2^failures`,
//!   capped), reset when it succeeds (`forget`). A failing key therefore only delays itself.
//!
//! Controllers' [`expectations`] live here too: the queue and they are the two halves of
//! KubeVirt's controller loop.

pub mod expectations;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

/// client-go's per-item exponential limiter: 5 ms doubling up to 1000 s.
pub const BACKOFF_BASE: Duration = Duration::from_millis(5);
pub const BACKOFF_MAX: Duration = Duration::from_secs(1000);

/// The delay before the `failures`-th retry (0-based), pure.
pub fn backoff(failures: u32, base: Duration, max: Duration) -> Duration {
    // 2^31 * 5 ms is far beyond any cap; stop doubling long before overflow.
    base.saturating_mul(1u32 << failures.min(31)).min(max)
}

#[derive(Debug)]
pub struct Queue {
    state: Mutex<State>,
    notify: Notify,
    adds: AtomicU64,
    base: Duration,
    max: Duration,
}

#[derive(Debug, Default)]
struct State {
    order: VecDeque<String>,
    dirty: HashSet<String>,
    processing: HashSet<String>,
    failures: HashMap<String, u32>,
    /// When each key with a delayed add is due: one timer per key, the earliest (client-go's
    /// delaying queue), not one sleeping task per request.
    waiting: HashMap<String, tokio::time::Instant>,
    shut_down: bool,
}

impl Default for Queue {
    fn default() -> Self {
        Self::new(BACKOFF_BASE, BACKOFF_MAX)
    }
}

impl Queue {
    pub fn new(base: Duration, max: Duration) -> Self {
        Queue {
            state: Mutex::default(),
            notify: Notify::new(),
            adds: AtomicU64::new(0),
            base,
            max,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `key` now (unless it is already waiting).
    pub fn add(&self, key: &str) {
        self.adds.fetch_add(1, Ordering::Relaxed);
        let mut s = self.lock();
        if s.shut_down || !s.dirty.insert(key.to_owned()) || s.processing.contains(key) {
            return;
        }
        s.order.push_back(key.to_owned());
        drop(s);
        self.notify.notify_one();
    }

    /// Queues `key` after `delay`, unless it is already due as early from an earlier call.
    pub fn add_after(self: &Arc<Self>, key: &str, delay: Duration) {
        if delay.is_zero() {
            self.add(key);
            return;
        }
        let due = tokio::time::Instant::now() + delay;
        {
            let mut s = self.lock();
            if s.shut_down || s.waiting.get(key).is_some_and(|d| *d <= due) {
                return;
            }
            s.waiting.insert(key.to_owned(), due);
        }
        let q = Arc::clone(self);
        let key = key.to_owned();
        tokio::spawn(async move {
            tokio::time::sleep_until(due).await;
            {
                let mut s = q.lock();
                // A timer superseded by an earlier one still adds (harmless), but leaves the
                // earlier one's entry alone.
                if s.waiting.get(&key) == Some(&due) {
                    s.waiting.remove(&key);
                }
            }
            q.add(&key);
        });
    }

    /// Keys with a delayed add still to come.
    pub fn delayed(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Queues `key` after its next backoff delay, and counts the failure. Returns the delay.
    pub fn add_rate_limited(self: &Arc<Self>, key: &str) -> Duration {
        let delay = {
            let mut s = self.lock();
            let n = s.failures.entry(key.to_owned()).or_insert(0);
            let d = backoff(*n, self.base, self.max);
            *n = n.saturating_add(1);
            d
        };
        self.add_after(key, delay);
        delay
    }

    /// `key` succeeded, or is gone: its next failure starts from the base delay again.
    pub fn forget(&self, key: &str) {
        self.lock().failures.remove(key);
    }

    /// How often `key` failed in a row.
    pub fn failures(&self, key: &str) -> u32 {
        self.lock().failures.get(key).copied().unwrap_or(0)
    }

    /// Keys waiting to be handed to a worker (`kubevirt_workqueue_depth`).
    pub fn depth(&self) -> usize {
        self.lock().order.len()
    }

    /// Every `add` so far, including those of keys already waiting
    /// (`kubevirt_workqueue_adds_total`).
    pub fn adds(&self) -> u64 {
        self.adds.load(Ordering::Relaxed)
    }

    /// The next key to process; `None` once the queue is shut down. The caller must call
    /// [`Queue::done`] with it.
    pub async fn pop(&self) -> Option<String> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered as a waiter before looking: an `add` between the look and the wait
            // wakes this worker, rather than leaving Notify's single permit, which a second
            // idle worker would never see.
            notified.as_mut().enable();
            {
                let mut s = self.lock();
                if s.shut_down {
                    return None;
                }
                if let Some(k) = s.order.pop_front() {
                    s.dirty.remove(&k);
                    s.processing.insert(k.clone());
                    return Some(k);
                }
            }
            notified.await;
        }
    }

    /// The worker is done with `key`; if it was added meanwhile it is queued again.
    pub fn done(&self, key: &str) {
        let mut s = self.lock();
        s.processing.remove(key);
        if s.dirty.contains(key) {
            s.order.push_back(key.to_owned());
            drop(s);
            self.notify.notify_one();
        }
    }

    /// Wakes every worker with `None`.
    pub fn shut_down(&self) {
        self.lock().shut_down = true;
        self.notify.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    #[test]
    fn backoff_doubles_from_the_base_up_to_the_cap() {
        let ms = Duration::from_millis;
        let got: Vec<_> = (0..5).map(|n| backoff(n, ms(5), ms(60))).collect();
        assert_eq!(got, vec![ms(5), ms(10), ms(20), ms(40), ms(60)]);
        assert_eq!(backoff(u32::MAX, BACKOFF_BASE, BACKOFF_MAX), BACKOFF_MAX);
    }

    #[tokio::test]
    async fn a_key_waits_once_and_never_runs_on_two_workers() {
        let q = Queue::default();
        q.add("a");
        q.add("b");
        q.add("a");
        assert_eq!((q.depth(), q.adds()), (2, 3));
        assert_eq!(q.pop().await.as_deref(), Some("a"));
        // Re-added while a worker holds it: not handed out until that worker is done.
        q.add("a");
        assert_eq!(q.pop().await.as_deref(), Some("b"));
        q.done("b");
        let next = tokio::time::timeout(Duration::from_millis(50), q.pop()).await;
        assert!(next.is_err(), "a is still being processed: {next:?}");
        q.done("a");
        assert_eq!(q.pop().await.as_deref(), Some("a"));
        assert_eq!(q.depth(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_workers_all_wake_for_keys_added_at_once() {
        let q = Arc::new(Queue::default());
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let q = Arc::clone(&q);
                tokio::spawn(async move { q.pop().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        for k in ["a", "b", "c"] {
            q.add(k);
        }
        let mut got = Vec::new();
        for w in workers {
            let k = tokio::time::timeout(Duration::from_secs(10), w)
                .await
                .expect("a worker slept while keys waited")
                .expect("no panic");
            got.push(k.expect("not shut down"));
        }
        got.sort();
        assert_eq!(got, vec!["a", "b", "c"]);
    }

    #[tokio::test]
    async fn a_failing_key_backs_off_without_delaying_others() {
        let ms = Duration::from_millis;
        let q = Arc::new(Queue::new(ms(200), ms(1600)));
        q.add("bad");
        let k = q.pop().await.expect("bad");
        q.done(&k);
        let start = tokio::time::Instant::now();
        assert_eq!(q.add_rate_limited("bad"), ms(200));
        assert_eq!(q.pop().await.as_deref(), Some("bad"));
        assert!(start.elapsed() >= ms(200), "{:?}", start.elapsed());
        q.done("bad");
        assert_eq!(q.add_rate_limited("bad"), ms(400));
        // While "bad" waits out its backoff, another key added later is served first.
        let start = tokio::time::Instant::now();
        q.add("good");
        assert_eq!(q.pop().await.as_deref(), Some("good"));
        q.done("good");
        assert_eq!(q.pop().await.as_deref(), Some("bad"));
        assert!(start.elapsed() >= ms(400), "{:?}", start.elapsed());
        q.done("bad");
        assert_eq!(q.failures("bad"), 2);
        q.forget("bad");
        assert_eq!(q.add_rate_limited("bad"), ms(200));
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_adds_of_a_key_share_the_earliest_timer() {
        let q = Arc::new(Queue::default());
        let s = Duration::from_secs;
        for delay in [s(300), s(2), s(300), s(5)] {
            q.add_after("k", delay);
        }
        assert_eq!(q.delayed(), 1);
        let start = tokio::time::Instant::now();
        assert_eq!(q.pop().await.as_deref(), Some("k"));
        assert_eq!(start.elapsed(), s(2));
        q.done("k");
        assert_eq!(q.delayed(), 0);
        // The superseded 300 s timer still fires; it only adds the key once more.
        let next = tokio::time::timeout(s(1000), q.pop()).await;
        assert_eq!(next.ok().flatten().as_deref(), Some("k"));
        assert_eq!(q.delayed(), 0);
    }

    #[tokio::test]
    async fn shut_down_releases_waiting_workers() {
        let q = Arc::new(Queue::default());
        let waiter = tokio::spawn({
            let q = Arc::clone(&q);
            async move { q.pop().await }
        });
        tokio::task::yield_now().await;
        q.shut_down();
        assert_eq!(waiter.await.expect("no panic"), None);
        q.add("late");
        assert_eq!(q.pop().await, None);
    }
}
