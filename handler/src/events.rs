//! Kubernetes Events the handler records on a VMI, decided by the pure cores and written by the
//! shell.

/// `Normal` or `Warning`, as in `core/v1` Event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// One event to record on the VMI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub type_: EventType,
    /// KubeVirt's event reasons: `Started`, `Stopped`, `ShuttingDown`, `Deleted`, `Paused`,
    /// `Resumed`, `SyncFailed`.
    pub reason: String,
    pub message: String,
}

impl Event {
    pub fn normal(reason: &str, message: &str) -> Self {
        Event {
            type_: EventType::Normal,
            reason: reason.to_owned(),
            message: message.to_owned(),
        }
    }

    pub fn warning(reason: &str, message: &str) -> Self {
        Event {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            message: message.to_owned(),
        }
    }
}
