//! Async clients for QEMU's monitor (QMP) and its guest agent, on tokio and unix sockets.
//!
//! Both protocols are read as raw JSON lines by this crate's own transport and decoded into the
//! [`qapi`] crate's types where they fit: an unknown event, an unknown field or a garbage line is
//! logged and skipped, a timed-out call is forgotten (its late reply discarded) and never poisons
//! the connection.
//!
//! # QMP
//! - [`QmpClient::connect`] retries until the socket accepts (QEMU starting), reads the greeting
//!   ([`QmpClient::version`] for gating behaviour on QEMU's version) and negotiates.
//! - [`QmpClient::execute`] runs any [`qapi::Command`] (`qmp::qapi::qmp::*`, or
//!   [`compat`] types for replies QEMU 7.2 shapes differently from the crate's 9.1 schema) with the
//!   default timeout; [`QmpClient::execute_with_timeout`] with another;
//!   [`QmpClient::execute_raw`] by name with raw JSON.
//! - [`QmpClient::getfd`] / [`QmpClient::execute_with_fds`] pass descriptors with SCM_RIGHTS.
//! - [`QmpClient::events`] subscribes to events ([`Event`]: raw JSON, [`Event::typed`] on
//!   demand); [`QmpClient::connect_with_events`] subscribes before negotiation.
//! - When the connection closes every waiting call fails with [`Error::Disconnected`], event
//!   streams end with [`RecvError::Closed`] and [`QmpClient::closed`] resolves.
//!
//! ```no_run
//! # async fn demo() -> Result<(), qmp::Error> {
//! let options = qmp::ConnectOptions::default();
//! let (client, mut events) = qmp::QmpClient::connect_with_events("/run/vm/qmp.sock", &options).await?;
//! let status = client.execute(qmp::qapi::qmp::query_status {}).await?;
//! println!("QEMU {} is {:?}", client.version(), status.status);
//! client.execute(qmp::qapi::qmp::cont {}).await?;
//! let resumed = events.wait_for(options.command_timeout, |e| e.name == "RESUME").await;
//! # Ok(()) }
//! ```
//!
//! # Guest agent
//! [`GuestAgent`] talks to qemu-ga through the host end of its virtio-serial port. It connects
//! lazily, synchronises with `guest-sync-delimited` and a fresh id before first use and after any
//! call that did not complete, reconnects after I/O errors, and has typed helpers
//! ([`GuestAgent::osinfo`], [`GuestAgent::users`], [`GuestAgent::fsinfo`],
//! [`GuestAgent::shutdown`], ...).
//!
//! ```no_run
//! # async fn demo() -> Result<(), qmp::Error> {
//! let agent = qmp::GuestAgent::new("/run/vm/qga.sock", qmp::AgentOptions::default());
//! agent.sync(std::time::Duration::from_secs(5)).await?;
//! let os = agent.osinfo().await?;
//! # Ok(()) }
//! ```

mod agent;
mod client;
pub mod compat;
mod error;
mod event;
mod wire;

pub use agent::{AgentOptions, GuestAgent};
pub use client::{ConnectOptions, Greeting, QemuVersion, QmpClient};
pub use error::{Error, Result};
pub use event::{Event, EventStream, RecvError, Timestamp};
/// The `qapi` crate, re-exported so users name the same command and result types.
pub use qapi;
