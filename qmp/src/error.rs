//! The crate's error type.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong talking to QEMU's monitor or its guest agent.
///
/// Every variant names the socket, and where a command was involved, the command, so that a
/// message reaching a user says what failed and where.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket could not be connected before the deadline (or failed in a way a retry
    /// cannot fix, such as permission denied).
    #[error("connecting to {socket}: gave up after {waited:?}")]
    Connect {
        socket: PathBuf,
        waited: Duration,
        #[source]
        source: io::Error,
    },
    /// QEMU did not send its `{"QMP": ...}` greeting in time.
    #[error("{socket}: no QMP greeting within {timeout:?}")]
    GreetingTimeout { socket: PathBuf, timeout: Duration },
    /// The first line from the monitor was not a QMP greeting.
    #[error("{socket}: expected a QMP greeting, got {line:?}")]
    Greeting { socket: PathBuf, line: String },
    /// The peer answered the command with an error object.
    #[error("{command} on {socket}: {class}: {desc}")]
    Command {
        socket: PathBuf,
        command: String,
        /// QEMU's error class, e.g. `GenericError`, `CommandNotFound`, `DeviceNotFound`.
        class: String,
        /// QEMU's human-readable description.
        desc: String,
    },
    /// No reply arrived within the call's timeout. The connection stays usable; a late reply is
    /// discarded.
    #[error("{command} on {socket}: no reply within {timeout:?}")]
    Timeout {
        socket: PathBuf,
        command: String,
        timeout: Duration,
    },
    /// A command started by `guest-exec` had not exited when its time was up.
    #[error("{path} (pid {pid} in the guest, agent at {socket}) did not exit within {timeout:?}")]
    ExecTimeout {
        socket: PathBuf,
        path: String,
        pid: i64,
        timeout: Duration,
    },
    /// The connection closed (or was already closed) before the reply arrived.
    #[error("{command} on {socket}: connection closed")]
    Disconnected { socket: PathBuf, command: String },
    /// The reply arrived but does not match the expected type (typically a QEMU 7.2 reply against
    /// the 9.1 schema of the `qapi` crate; use [`crate::compat`] types or `execute_raw`).
    #[error("{command} on {socket}: cannot decode reply {reply}")]
    Decode {
        socket: PathBuf,
        command: String,
        /// The reply, truncated for display.
        reply: String,
        #[source]
        source: serde_json::Error,
    },
    /// The command's arguments could not be serialized, or were not a JSON object.
    #[error("{command}: cannot encode arguments")]
    Encode {
        command: String,
        #[source]
        source: serde_json::Error,
    },
    /// A file descriptor to pass could not be duplicated.
    #[error("{command} on {socket}: cannot duplicate the file descriptor to pass")]
    DupFd {
        socket: PathBuf,
        command: String,
        #[source]
        source: io::Error,
    },
    /// An I/O error on the socket outside of any particular command (guest agent channel).
    #[error("{socket}: {context}")]
    Io {
        socket: PathBuf,
        context: &'static str,
        #[source]
        source: io::Error,
    },
    /// The guest agent replied to `guest-sync` with something else than the id we sent.
    #[error("{socket}: guest-sync handshake failed: {detail}")]
    Sync { socket: PathBuf, detail: String },
}

impl Error {
    /// True for [`Error::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// True for [`Error::Disconnected`].
    pub fn is_disconnected(&self) -> bool {
        matches!(self, Error::Disconnected { .. })
    }

    /// The QEMU error class when the peer rejected the command.
    pub fn command_class(&self) -> Option<&str> {
        match self {
            Error::Command { class, .. } => Some(class),
            _ => None,
        }
    }
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
