//! virt-launcher's command API, the seam between virt-handler and virt-launcher: HTTP/1.1 + JSON
//! on a unix socket. Both ends build on this crate, so that a path, a method or a body's shape is
//! written once and a change to it breaks the build of whichever end was not changed, rather than
//! a running node:
//!
//! - [`action`]: one type per endpoint with its method, path, request and answer;
//! - [`domain`] and [`guest`]: the shapes those answers carry;
//! - [`migration`]: the requests and sockets of a live migration;
//! - [`client`]: virt-handler's typed client, over hyper.
//!
//! The launcher's axum server lives in the launcher: it routes by [`action::Action::PATH`].

pub mod action;
pub mod client;
pub mod domain;
pub mod guest;
pub mod migration;

/// The command socket, relative to the launcher's `--kubevirt-share-dir`. Its first component is
/// the launcher pod's `sockets` emptyDir volume, through which virt-handler reaches the socket in
/// the kubelet's pods dir.
pub const SOCKET: &str = "sockets/launcher-sock";
