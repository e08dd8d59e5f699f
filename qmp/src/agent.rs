//! The QEMU guest agent client (qemu-ga over a virtio-serial port bound to a host unix socket).
//!
//! The agent protocol has no multiplexing: one command, one reply, in order. Its danger is
//! staleness: a reply to a call that timed out (or was written while no host was connected)
//! arrives later and would be taken for the next call's answer. So the channel is synchronised
//! with `guest-sync-delimited` and a fresh random id before first use, after reconnecting and
//! after any call that did not complete; the agent prefixes that reply with a 0xFF byte, which
//! never occurs in its JSON, so everything before it is stale and discarded. A timed-out call
//! only marks the channel for resync; an I/O error or end of stream drops the connection, and the
//! next call reconnects.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize as _;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::wire::{self, Failure, Incoming};
use qapi::qga;

/// The byte qemu-ga puts before the reply to `guest-sync-delimited`, and which resets its JSON
/// parser when the host sends it.
const DELIMITER: u8 = 0xFF;

/// Timeouts of the guest-agent client.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// How long to retry connecting the host side socket (QEMU creates it at start-up).
    pub connect_timeout: Duration,
    /// Default timeout of a command, including a resync it needs first.
    pub command_timeout: Duration,
    /// How long `guest-shutdown` waits for an error before taking silence for success.
    pub shutdown_grace: Duration,
}

impl Default for AgentOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            command_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// A guest-agent client. Cheap to clone; calls are serialised on one connection, which is opened
/// lazily and reopened after failures. Creating one does not touch the socket.
#[derive(Debug, Clone)]
pub struct GuestAgent {
    inner: Arc<AgentInner>,
}

#[derive(Debug)]
struct AgentInner {
    socket: PathBuf,
    options: AgentOptions,
    conn: tokio::sync::Mutex<Option<Conn>>,
}

#[derive(Debug)]
struct Conn {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// False until a sync succeeded, and from the moment a call starts until it completes, so a
    /// call abandoned half-way (timeout, cancellation) forces a resync.
    synced: bool,
}

/// What went wrong inside one exchange, before it is given the command's name.
#[derive(Debug)]
enum Fault {
    Io(&'static str, std::io::Error),
    Closed,
    Failed(Failure),
    Sync(String),
}

impl GuestAgent {
    /// A client for the agent behind `socket` (the host end of the
    /// `org.qemu.guest_agent.0` virtio-serial port).
    pub fn new(socket: impl Into<PathBuf>, options: AgentOptions) -> Self {
        Self {
            inner: Arc::new(AgentInner {
                socket: socket.into(),
                options,
                conn: tokio::sync::Mutex::new(None),
            }),
        }
    }

    /// The host socket path.
    pub fn socket(&self) -> &Path {
        &self.inner.socket
    }

    /// Run a typed agent command with the default timeout, e.g.
    /// `agent.execute(qmp::qapi::qga::guest_get_host_name {}).await`.
    pub async fn execute<C: qapi::Command>(&self, command: C) -> Result<C::Ok> {
        self.execute_with_timeout(command, self.inner.options.command_timeout)
            .await
    }

    /// Run a typed agent command with an explicit timeout.
    pub async fn execute_with_timeout<C: qapi::Command>(
        &self,
        command: C,
        timeout: Duration,
    ) -> Result<C::Ok> {
        let args = serde_json::to_value(&command)
            .and_then(wire::arguments)
            .map_err(|source| Error::Encode {
                command: C::NAME.to_owned(),
                source,
            })?;
        let reply = self.call(C::NAME, args.as_ref(), timeout).await?;
        C::Ok::deserialize(&reply).map_err(|source| Error::Decode {
            socket: self.inner.socket.clone(),
            command: C::NAME.to_owned(),
            reply: wire::truncate_for_display(&reply.to_string(), 512),
            source,
        })
    }

    /// Run an agent command by name with raw JSON arguments and get the raw `return` value.
    pub async fn execute_raw(
        &self,
        name: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<Value> {
        let args = wire::arguments(arguments).map_err(|source| Error::Encode {
            command: name.to_owned(),
            source,
        })?;
        self.call(name, args.as_ref(), timeout).await
    }

    /// Force a `guest-sync-delimited` handshake now (connecting if needed). Useful as a
    /// readiness probe: it succeeds once the agent in the guest answers.
    pub async fn sync(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut slot = self.lock(deadline, "guest-sync-delimited", timeout).await?;
        let result = tokio::time::timeout_at(deadline.into(), async {
            let conn = self.ensure_connected(&mut slot, deadline).await?;
            conn.synced = false;
            resync(conn).await?;
            conn.synced = true;
            Ok(())
        })
        .await;
        self.settle(&mut slot, "guest-sync-delimited", timeout, result)
    }

    /// `guest-ping`: succeeds when the agent answers.
    pub async fn ping(&self) -> Result<()> {
        self.execute(qga::guest_ping {}).await.map(drop)
    }

    /// `guest-exec` of `path` with `args` and the output captured (as KubeVirt asks it), then
    /// `guest-exec-status` every tenth of `timeout` until the command has exited. A command
    /// still running at `timeout` is [`Error::ExecTimeout`]; the agent has no way to stop it.
    pub async fn exec(
        &self,
        path: &str,
        args: &[String],
        timeout: Duration,
    ) -> Result<qga::GuestExecStatus> {
        const NAME: &str = "guest-exec";
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        // Raw JSON: QEMU 7.2's agent takes `capture-output` as a bool, which the `qapi`
        // crate's 9.1 schema models as an alternate.
        let started = self
            .execute_raw(
                NAME,
                serde_json::json!({"path": path, "arg": args, "capture-output": true}),
                left(),
            )
            .await?;
        let pid = qga::GuestExec::deserialize(&started)
            .map_err(|source| Error::Decode {
                socket: self.inner.socket.clone(),
                command: NAME.to_owned(),
                reply: wire::truncate_for_display(&started.to_string(), 512),
                source,
            })?
            .pid;
        let mut poll = tokio::time::interval((timeout / 10).max(Duration::from_millis(10)));
        loop {
            poll.tick().await;
            if left().is_zero() {
                return Err(Error::ExecTimeout {
                    socket: self.inner.socket.clone(),
                    path: path.to_owned(),
                    pid,
                    timeout,
                });
            }
            let status = self
                .execute_with_timeout(qga::guest_exec_status { pid }, left())
                .await?;
            if status.exited {
                return Ok(status);
            }
        }
    }

    /// `guest-info`: agent version and supported commands.
    pub async fn info(&self) -> Result<qga::GuestAgentInfo> {
        self.execute(qga::guest_info {}).await
    }

    /// `guest-get-osinfo`.
    pub async fn osinfo(&self) -> Result<qga::GuestOSInfo> {
        self.execute(qga::guest_get_osinfo {}).await
    }

    /// `guest-get-users`: logged-in users.
    pub async fn users(&self) -> Result<Vec<qga::GuestUser>> {
        self.execute(qga::guest_get_users {}).await
    }

    /// `guest-get-fsinfo`: mounted file systems.
    pub async fn fsinfo(&self) -> Result<Vec<qga::GuestFilesystemInfo>> {
        self.execute(qga::guest_get_fsinfo {}).await
    }

    /// `guest-get-host-name`.
    pub async fn host_name(&self) -> Result<String> {
        Ok(self.execute(qga::guest_get_host_name {}).await?.host_name)
    }

    /// `guest-network-get-interfaces`.
    pub async fn network_interfaces(&self) -> Result<Vec<qga::GuestNetworkInterface>> {
        self.execute(qga::guest_network_get_interfaces {}).await
    }

    /// `guest-get-time`: the guest clock in nanoseconds since the epoch.
    pub async fn time(&self) -> Result<i64> {
        self.execute(qga::guest_get_time {}).await
    }

    /// `guest-get-timezone`.
    pub async fn timezone(&self) -> Result<qga::GuestTimezone> {
        self.execute(qga::guest_get_timezone {}).await
    }

    /// `guest-fsfreeze-status`.
    pub async fn fsfreeze_status(&self) -> Result<qga::GuestFsfreezeStatus> {
        self.execute(qga::guest_fsfreeze_status {}).await
    }

    /// `guest-fsfreeze-freeze`: the number of file systems frozen.
    pub async fn fsfreeze_freeze(&self) -> Result<i64> {
        self.execute(qga::guest_fsfreeze_freeze {}).await
    }

    /// `guest-fsfreeze-thaw`: the number of file systems thawed.
    pub async fn fsfreeze_thaw(&self) -> Result<i64> {
        self.execute(qga::guest_fsfreeze_thaw {}).await
    }

    /// `guest-shutdown`. The agent sends no reply when the command succeeds (the guest is going
    /// down), only when it fails; so the command is followed by a sync: an error before the sync
    /// reply is the command's failure, the sync reply or silence until `shutdown_grace` (the
    /// agent already gone) is success. The channel is resynchronised on the next call.
    pub async fn shutdown(&self, mode: Option<qga::GuestShutdownMode>) -> Result<()> {
        const NAME: &str = "guest-shutdown";
        let grace = self.inner.options.shutdown_grace;
        let deadline = Instant::now() + self.inner.options.command_timeout;
        let mut slot = self
            .lock(deadline, NAME, self.inner.options.command_timeout)
            .await?;
        let args = serde_json::to_value(qga::guest_shutdown { mode })
            .and_then(wire::arguments)
            .map_err(|source| Error::Encode {
                command: NAME.to_owned(),
                source,
            })?;
        let connected = tokio::time::timeout_at(deadline.into(), async {
            let conn = self.ensure_connected(&mut slot, deadline).await?;
            if !conn.synced {
                resync(conn).await?;
            }
            conn.synced = false;
            write(conn, &wire::encode_execute(NAME, args.as_ref(), None)).await?;
            Ok(())
        })
        .await;
        self.settle(
            &mut slot,
            NAME,
            self.inner.options.command_timeout,
            connected,
        )?;
        if let Some(conn) = slot.as_mut() {
            let outcome = tokio::time::timeout(grace, async {
                // No leading 0xFF here: qemu-ga answers that byte with a parse error, which
                // would be taken for the shutdown's.
                let line = wire::encode_execute(
                    "guest-sync-delimited",
                    Some(&serde_json::json!({ "id": fresh_sync_id() })),
                    None,
                );
                write(conn, &line).await?;
                read_reply(conn).await
            })
            .await;
            // Only an error reply, which the agent sends before it answers the sync, is a
            // failure; the sync's answer, silence and a closed channel mean the guest is going
            // down.
            if let Ok(Err(Fault::Failed(failure))) = outcome {
                conn.synced = false;
                return Err(Error::Command {
                    socket: self.inner.socket.clone(),
                    command: NAME.to_owned(),
                    class: failure.class,
                    desc: failure.desc,
                });
            }
        }
        debug!(socket = %self.inner.socket.display(), "guest-shutdown accepted");
        *slot = None;
        Ok(())
    }

    async fn lock(
        &self,
        deadline: Instant,
        name: &str,
        timeout: Duration,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<Conn>>> {
        tokio::time::timeout_at(deadline.into(), self.inner.conn.lock())
            .await
            .map_err(|_| Error::Timeout {
                socket: self.inner.socket.clone(),
                command: name.to_owned(),
                timeout,
            })
    }

    async fn call(&self, name: &str, args: Option<&Value>, timeout: Duration) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        let mut slot = self.lock(deadline, name, timeout).await?;
        let line = wire::encode_execute(name, args, None);
        let result = tokio::time::timeout_at(deadline.into(), async {
            let conn = self.ensure_connected(&mut slot, deadline).await?;
            if !conn.synced {
                resync(conn).await?;
            }
            conn.synced = false;
            write(conn, &line).await?;
            let reply = read_reply(conn).await?;
            conn.synced = true;
            Ok(reply)
        })
        .await;
        self.settle(&mut slot, name, timeout, result)
    }

    /// Turn an exchange's outcome into the caller's result, and decide the connection's fate:
    /// keep it on success and on command errors, keep it unsynced on timeout, drop it on I/O
    /// failure so the next call reconnects.
    fn settle<T>(
        &self,
        slot: &mut Option<Conn>,
        name: &str,
        timeout: Duration,
        result: Result<std::result::Result<T, Fault>, tokio::time::error::Elapsed>,
    ) -> Result<T> {
        let socket = || self.inner.socket.clone();
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(Fault::Failed(failure))) => {
                if let Some(conn) = slot.as_mut() {
                    conn.synced = true;
                }
                Err(Error::Command {
                    socket: socket(),
                    command: name.to_owned(),
                    class: failure.class,
                    desc: failure.desc,
                })
            }
            Ok(Err(Fault::Sync(detail))) => {
                *slot = None;
                Err(Error::Sync {
                    socket: socket(),
                    detail,
                })
            }
            Ok(Err(Fault::Closed)) => {
                *slot = None;
                Err(Error::Disconnected {
                    socket: socket(),
                    command: name.to_owned(),
                })
            }
            Ok(Err(Fault::Io(context, source))) => {
                warn!(socket = %self.inner.socket.display(), %source, context, "guest agent I/O failed; will reconnect");
                *slot = None;
                Err(Error::Io {
                    socket: socket(),
                    context,
                    source,
                })
            }
            Err(_) => {
                if let Some(conn) = slot.as_mut() {
                    conn.synced = false;
                }
                Err(Error::Timeout {
                    socket: socket(),
                    command: name.to_owned(),
                    timeout,
                })
            }
        }
    }

    async fn ensure_connected<'a>(
        &self,
        slot: &'a mut Option<Conn>,
        deadline: Instant,
    ) -> std::result::Result<&'a mut Conn, Fault> {
        if slot.is_none() {
            let connect_deadline =
                deadline.min(Instant::now() + self.inner.options.connect_timeout);
            let stream = crate::client::connect_with_retry(&self.inner.socket, connect_deadline)
                .await
                .map_err(|err| match err {
                    Error::Connect { source, .. } => Fault::Io("connecting", source),
                    other => Fault::Io("connecting", std::io::Error::other(other.to_string())),
                })?;
            let (read, writer) = stream.into_split();
            debug!(socket = %self.inner.socket.display(), "guest agent connected");
            *slot = Some(Conn {
                reader: BufReader::new(read),
                writer,
                synced: false,
            });
        }
        Ok(slot.as_mut().expect("just connected"))
    }
}

/// A random positive id that fits JSON's exact integer range.
fn fresh_sync_id() -> i64 {
    let (high, _) = uuid::Uuid::new_v4().as_u64_pair();
    i64::try_from(high >> 12).expect("52 bits fit") + 1
}

async fn write(conn: &mut Conn, bytes: &[u8]) -> std::result::Result<(), Fault> {
    conn.writer
        .write_all(bytes)
        .await
        .map_err(|e| Fault::Io("writing to the guest agent", e))
}

/// Send 0xFF (resetting the agent's parser after any half-written command; qemu-ga answers it
/// with a parse error, which lands before the delimiter and is skipped) and
/// `guest-sync-delimited` with a fresh id; skip everything up to the delimiter that precedes a
/// reply carrying that id.
async fn resync(conn: &mut Conn) -> std::result::Result<(), Fault> {
    let id = fresh_sync_id();
    let mut line = vec![DELIMITER];
    line.extend(wire::encode_execute(
        "guest-sync-delimited",
        Some(&serde_json::json!({ "id": id })),
        None,
    ));
    write(conn, &line).await?;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = conn
            .reader
            .read_until(DELIMITER, &mut buf)
            .await
            .map_err(|e| Fault::Io("reading from the guest agent", e))?;
        if n == 0 {
            return Err(Fault::Closed);
        }
        if buf.last() != Some(&DELIMITER) {
            return Err(Fault::Closed);
        }
        if buf.len() > 1 {
            debug!(
                stale = %String::from_utf8_lossy(&buf[..buf.len() - 1]).trim_end(),
                "discarding stale guest agent output"
            );
        }
        buf.clear();
        let n = conn
            .reader
            .read_until(b'\n', &mut buf)
            .await
            .map_err(|e| Fault::Io("reading from the guest agent", e))?;
        if n == 0 {
            return Err(Fault::Closed);
        }
        match wire::parse_line(&buf) {
            Ok(Incoming::Reply {
                result: Ok(Value::Number(n)),
                ..
            }) if n.as_i64() == Some(id) => return Ok(()),
            Ok(Incoming::Reply {
                result: Err(failure),
                ..
            }) if failure.class == "CommandNotFound" => {
                return Err(Fault::Sync(format!(
                    "the agent does not support guest-sync-delimited: {}",
                    failure.desc
                )));
            }
            other => debug!(?other, "skipping a stale sync reply"),
        }
    }
}

/// Read lines until a reply. Lines that are not replies (garbage, a stray delimiter) are skipped.
async fn read_reply(conn: &mut Conn) -> std::result::Result<Value, Fault> {
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = conn
            .reader
            .read_until(b'\n', &mut buf)
            .await
            .map_err(|e| Fault::Io("reading from the guest agent", e))?;
        if n == 0 {
            return Err(Fault::Closed);
        }
        let line = buf.strip_prefix(&[DELIMITER]).unwrap_or(&buf);
        match wire::parse_line(line) {
            Ok(Incoming::Reply { result, .. }) => return result.map_err(Fault::Failed),
            other => warn!(
                ?other,
                line = %String::from_utf8_lossy(line).trim_end(),
                "skipping a guest agent line that is not a reply"
            ),
        }
    }
}
