use std::io;
use std::path::PathBuf;

use crate::NsKind;

/// Everything that can go wrong while finding, entering or reaching into a pod.
#[derive(Debug, thiserror::Error)]
pub enum IsolationError {
    /// The process exited (or exited and its pid was taken by another) before or during
    /// detection; a zombie counts as gone, it has no namespaces left.
    #[error("process {pid} is gone")]
    PidGone { pid: i32 },
    #[error("connecting to {socket}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The socket file exists but no process listens on it (a launcher that died and left
    /// its socket behind), or the kernel reports no peer.
    #[error("no process listens on {socket}")]
    NoPeer { socket: PathBuf },
    #[error("the {kind} namespace of process {pid} is not accessible")]
    NamespaceInaccessible {
        pid: i32,
        kind: NsKind,
        #[source]
        source: io::Error,
    },
    /// Resolution would leave the root: through `..`, an absolute symlink (with
    /// [`crate::Resolve::Beneath`]) or a mount crossing out of it.
    #[error("{path} escapes the root {root}")]
    PathEscapesRoot { root: PathBuf, path: PathBuf },
    #[error("openat2(2) is not available on this kernel (Linux 5.6 or newer is required)")]
    Openat2Unavailable,
    #[error("reading {path}")]
    Proc {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("cgroups of process {pid}")]
    Cgroups {
        pid: i32,
        #[source]
        source: cgroups::CgroupError,
    },
    #[error("{op} {path} under {root}")]
    Path {
        op: &'static str,
        root: PathBuf,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("bind-mounting {source_path} onto {target}")]
    Mount {
        source_path: PathBuf,
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The process has moved to another namespace since it was detected; entering what
    /// it has now would act on something never checked. Detect again.
    #[error("process {pid} left its detected {kind} namespace (inode {detected}, now {current})")]
    NamespaceChanged {
        pid: i32,
        kind: NsKind,
        detected: u64,
        current: u64,
    },
    #[error("starting a thread for the {kind} namespace of process {pid}")]
    Spawn {
        pid: i32,
        kind: NsKind,
        #[source]
        source: io::Error,
    },
    #[error("the closure run in the {kind} namespace of process {pid} panicked: {message}")]
    Panicked {
        pid: i32,
        kind: NsKind,
        message: String,
    },
}

pub type Result<T, E = IsolationError> = std::result::Result<T, E>;
