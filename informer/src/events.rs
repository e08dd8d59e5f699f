//! Events (`events.k8s.io/v1`) as client-go's recorder correlates them: the same event again
//! (same object, type, reason, action and note) within [`SERIES_WINDOW`] bumps the `series` of
//! the Event already written; a different note is an Event of its own.
//!
//! kube-runtime's `Recorder` correlates on everything but the note, so a second, different
//! message under one reason on one object within its window only raised the first Event's
//! count and was lost: a VMI whose launcher pod was created (`SuccessfulCreate`) never showed
//! its evacuation migration's `SuccessfulCreate` "Created Migration ...". KubeVirt's messages
//! are what users read in `kubectl describe`, so they must all arrive.

use std::collections::HashMap;
use std::hash::{BuildHasher as _, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
pub use kube::runtime::events::{Event, EventType, Reporter};
use serde_json::json;

/// How long a repeat counts into the series of the Event before it (kube-runtime's and
/// client-go's window).
pub const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// How many series are remembered at most (client-go's `maxLruCacheEntries`): bounded by
/// time alone, a controller that creates 10,000 launcher pods within the window kept one
/// entry (about 650 bytes) for each. Past the bound the least recently written is forgotten,
/// and its next repeat is an Event of its own, as in client-go.
pub const SERIES_LIMIT: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    regarding: (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    ),
    warning: bool,
    reason: String,
    action: String,
    note: Option<String>,
}

#[derive(Debug, Clone)]
struct Written {
    namespace: String,
    name: String,
    count: i32,
    last: Timestamp,
}

/// The Events written lately, by what makes a repeat: within [`SERIES_WINDOW`], at most
/// [`SERIES_LIMIT`]. A key is remembered as a 128-bit digest (two SipHashes under random
/// keys): 16 bytes instead of its seven strings, about 450 bytes per series. Two keys with one
/// digest are as likely as guessing a random 128-bit number.
#[derive(Debug, Default)]
struct Series {
    written: HashMap<u128, Written>,
    digest: (RandomState, RandomState),
}

impl Series {
    fn digest(&self, key: &Key) -> u128 {
        (u128::from(self.digest.0.hash_one(key)) << 64) | u128::from(self.digest.1.hash_one(key))
    }

    /// The Event `key` repeats, its count raised, if one is remembered.
    fn repeat(&mut self, key: &Key, now: Timestamp) -> Option<Written> {
        self.written.retain(|_, w| w.last + SERIES_WINDOW > now);
        let digest = self.digest(key);
        self.written.get_mut(&digest).map(|w| {
            w.count += 1;
            w.last = now;
            w.clone()
        })
    }

    /// A new Event was written.
    fn record(&mut self, key: &Key, written: Written) {
        let digest = self.digest(key);
        if self.written.len() >= SERIES_LIMIT
            && !self.written.contains_key(&digest)
            && let Some(oldest) = self
                .written
                .iter()
                .min_by_key(|(_, w)| w.last)
                .map(|(k, _)| *k)
        {
            self.written.remove(&oldest);
        }
        self.written.insert(digest, written);
    }
}

/// Writes Events for one component (`reportingController`, `reportingInstance`).
pub struct Publisher {
    client: kube::Client,
    reporter: Reporter,
    written: std::sync::Mutex<Series>,
    sequence: AtomicU64,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("reporter", &self.reporter)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    pub fn new(client: kube::Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            written: std::sync::Mutex::default(),
            sequence: AtomicU64::default(),
        }
    }

    fn written(&self) -> std::sync::MutexGuard<'_, Series> {
        self.written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes `ev` about `regarding`: a new Event, or the next count of the same one.
    ///
    /// # Errors
    /// The API server's refusal of the create or patch.
    pub async fn publish(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = Key {
            regarding: (
                regarding.kind.clone(),
                regarding.namespace.clone(),
                regarding.name.clone(),
                regarding.uid.clone(),
            ),
            warning: matches!(ev.type_, EventType::Warning),
            reason: ev.reason.clone(),
            action: ev.action.clone(),
            note: ev.note.clone(),
        };
        let repeat = self.written().repeat(&key, now);
        if let Some(w) = repeat {
            let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &w.namespace);
            let series = EventSeries {
                count: w.count,
                last_observed_time: MicroTime(now),
            };
            match api
                .patch(
                    &w.name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "series": series })),
                )
                .await
            {
                Ok(_) => return Ok(()),
                // Expired or deleted: the repeat starts an Event of its own.
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        let namespace = regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned());
        let event = K8sEvent {
            metadata: ObjectMeta {
                // kube-runtime's and client-go's form, `<object>.<hex time>`; the sequence
                // keeps two Events of one instant apart.
                name: Some(format!(
                    "{}.{:x}{:x}",
                    regarding
                        .name
                        .as_deref()
                        .unwrap_or(&self.reporter.controller),
                    now.as_nanosecond(),
                    self.sequence.fetch_add(1, Ordering::Relaxed)
                )),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            action: Some(ev.action.clone()),
            reason: Some(ev.reason.clone()),
            note: ev.note.clone(),
            type_: Some(if key.warning { "Warning" } else { "Normal" }.to_owned()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            related: ev.secondary.clone(),
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            ..K8sEvent::default()
        };
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &namespace);
        let created = api.create(&PostParams::default(), &event).await?;
        if let Some(name) = created.metadata.name {
            self.written().record(
                &key,
                Written {
                    namespace,
                    name,
                    count: 1,
                    last: now,
                },
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> Key {
        Key {
            regarding: (None, Some("ns".into()), Some(name.into()), None),
            warning: false,
            reason: "SuccessfulCreate".into(),
            action: "SuccessfulCreate".into(),
            note: None,
        }
    }

    fn written(last: Timestamp) -> Written {
        Written {
            namespace: "ns".into(),
            name: "e".into(),
            count: 1,
            last,
        }
    }

    #[test]
    fn a_repeat_within_the_window_counts_into_its_series() {
        let t0 = Timestamp::UNIX_EPOCH;
        let mut s = Series::default();
        s.record(&key("a"), written(t0));
        let again = s.repeat(&key("a"), t0 + SignedDuration::from_mins(1));
        assert_eq!(again.map(|w| w.count), Some(2));
        assert!(s.repeat(&key("b"), t0).is_none());
        assert!(
            s.repeat(&key("a"), t0 + SERIES_WINDOW + SignedDuration::from_mins(1))
                .is_none(),
            "a series ends a window after its last repeat"
        );
    }

    #[test]
    fn past_the_limit_the_least_recently_written_series_is_forgotten() {
        let t0 = Timestamp::UNIX_EPOCH;
        let mut s = Series::default();
        for i in 0..SERIES_LIMIT {
            let at = t0 + SignedDuration::from_millis(i64::try_from(i).expect("small"));
            s.record(&key(&i.to_string()), written(at));
        }
        // `0` repeated lately: `1` is now the least recently written.
        let now = t0 + SignedDuration::from_secs(10);
        assert!(s.repeat(&key("0"), now).is_some());
        s.record(&key("new"), written(now));
        assert_eq!(s.written.len(), SERIES_LIMIT);
        assert!(s.repeat(&key("1"), now).is_none());
        assert!(s.repeat(&key("0"), now).is_some());
        assert!(s.repeat(&key("new"), now).is_some());
    }
}
