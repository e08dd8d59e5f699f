//! How virt-handler finds a launcher pod on its node and acts inside it.
//!
//! - [`detect_from_socket`] / [`detect_from_pid`]: the pod's process, its namespaces, its
//!   root and its cgroups ([`PodIsolation`]);
//! - [`PodIsolation::run_in_namespace`]: run a closure in the pod's network or mount
//!   namespace, on a thread of its own;
//! - [`MountRoot`] / [`SafePath`]: reach files inside the pod's filesystem without being
//!   led out of it by symlinks or `..`, then open, create, chown or bind-mount them.
//!
//! `docs/isolation.md` explains the why of each rule.

mod detect;
mod error;
mod safepath;

pub use detect::{
    Namespace, Namespaces, NsKind, PodIsolation, Process, detect_from_pid,
    detect_from_resolved_socket, detect_from_socket,
};
pub use error::{IsolationError, Result};
pub use safepath::{DetachedMount, MountRoot, Resolve, SafePath, open_socket};
