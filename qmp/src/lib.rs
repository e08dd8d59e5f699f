//! Async clients for QEMU's monitor (QMP) and its guest agent, on tokio and unix sockets.
//!
//! Both protocols are read as raw JSON lines by this crate's own transport and decoded into the
//! [`qapi`] crate's types where they fit: an unknown event, an unknown field or a garbage line is
//! logged and skipped, a timed-out call is forgotten (its late reply discarded) and never poisons
//! the connection.
//!
//! ```no_run
//! # async fn demo() -> Result<(), qmp::Error> {
//! let client = qmp::QmpClient::connect("/run/vm/qmp.sock", &qmp::ConnectOptions::default()).await?;
//! let mut events = client.events();
//! let status = client.execute(qmp::qapi::qmp::query_status {}).await?;
//! println!("QEMU {} is {:?}", client.version(), status.status);
//! client.execute(qmp::qapi::qmp::cont {}).await?;
//! let event = events.recv().await;
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
