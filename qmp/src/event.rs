//! QMP events: raw JSON for everyone, typed where the `qapi` schema decodes.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::broadcast;

/// When QEMU emitted an event (host wall clock, as QEMU reports it).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Timestamp {
    pub seconds: i64,
    pub microseconds: i64,
}

/// One QMP event as received: `{"event": name, "data": {...}, "timestamp": {...}}`.
///
/// `data` is kept raw so that events this crate's schema does not know (or knows differently)
/// still reach subscribers; [`Event::typed`] decodes with the `qapi` schema on demand.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The event name, e.g. `SHUTDOWN`, `STOP`, `DEVICE_DELETED`.
    pub name: String,
    /// The event's `data` member (an empty object when QEMU sent none).
    pub data: Value,
    pub timestamp: Timestamp,
}

impl Event {
    /// Decode with the `qapi` crate's (QEMU 9.1) schema; `None` when it does not match.
    pub fn typed(&self) -> Option<qapi::qmp::Event> {
        let value = serde_json::json!({
            "event": self.name,
            "data": self.data,
            "timestamp": self.timestamp,
        });
        serde_json::from_value(value).ok()
    }

    /// A string member of `data`, e.g. `event.data_str("device")` for `DEVICE_DELETED`.
    pub fn data_str(&self, key: &str) -> Option<&str> {
        self.data.get(key).and_then(Value::as_str)
    }
}

/// Why [`EventStream::recv`] returned no event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RecvError {
    /// The connection closed; no more events will come.
    #[error("the QMP connection closed")]
    Closed,
    /// The subscriber fell behind and this many events were dropped for it. The stream stays
    /// usable; a subscriber that must not miss state changes should re-query state now.
    #[error("{0} events were dropped because the subscriber fell behind")]
    Lagged(u64),
    /// [`EventStream::wait_for`] ran out of time.
    #[error("no matching event within the timeout")]
    Timeout,
}

/// A subscription to a connection's events, from the moment of subscribing on.
#[derive(Debug)]
pub struct EventStream {
    pub(crate) rx: broadcast::Receiver<Event>,
}

impl EventStream {
    /// The next event. Cancel-safe.
    pub async fn recv(&mut self) -> Result<Event, RecvError> {
        match self.rx.recv().await {
            Ok(event) => Ok(event),
            Err(broadcast::error::RecvError::Closed) => Err(RecvError::Closed),
            Err(broadcast::error::RecvError::Lagged(n)) => Err(RecvError::Lagged(n)),
        }
    }

    /// The next event for which `matches` is true, skipping others, within `timeout`.
    /// A lag is reported (not skipped), since the awaited event may have been dropped.
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        mut matches: impl FnMut(&Event) -> bool,
    ) -> Result<Event, RecvError> {
        let wait = async {
            loop {
                let event = self.recv().await?;
                if matches(&event) {
                    return Ok(event);
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .unwrap_or(Err(RecvError::Timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn typed_decodes_known_events_and_not_unknown_ones() {
        let stop = Event {
            name: "STOP".into(),
            data: json!({}),
            timestamp: Timestamp::default(),
        };
        assert!(matches!(stop.typed(), Some(qapi::qmp::Event::STOP { .. })));
        let unknown = Event {
            name: "NOT_A_QEMU_EVENT".into(),
            data: json!({"x": 1}),
            timestamp: Timestamp::default(),
        };
        assert!(unknown.typed().is_none());
    }

    #[tokio::test]
    async fn wait_for_skips_and_times_out() {
        let (tx, rx) = broadcast::channel(8);
        let mut stream = EventStream { rx };
        for name in ["A", "B"] {
            tx.send(Event {
                name: name.into(),
                data: json!({"device": name}),
                timestamp: Timestamp::default(),
            })
            .unwrap();
        }
        let got = stream
            .wait_for(Duration::from_secs(5), |e| e.name == "B")
            .await
            .unwrap();
        assert_eq!(got.data_str("device"), Some("B"));
        assert_eq!(
            stream.wait_for(Duration::from_millis(20), |_| true).await,
            Err(RecvError::Timeout)
        );
        drop(tx);
        assert_eq!(stream.recv().await, Err(RecvError::Closed));
    }
}
