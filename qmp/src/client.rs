//! The QMP client: one connection, one reader task, one writer task.
//!
//! A call registers a waiter under a fresh id and then hands over a complete line without ever
//! awaiting: it is written at once with a non-blocking write when the socket takes it whole, and
//! what the socket does not take is queued for the writer task. So a caller that is cancelled or
//! times out can neither leave half a command on the wire nor steal someone else's reply: the
//! reader routes replies by id and discards those whose waiter is gone. (The direct write saves
//! the hop through the writer task on every call; see `examples/bench_roundtrip.rs`.)

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader, Interest};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, OwnedMutexGuard, broadcast, oneshot, watch};
use tokio::task::AbortHandle;
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::event::{Event, EventStream};
use crate::wire::{self, Failure, Incoming};

/// How to connect and how long calls may take.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// How long to keep retrying while the socket does not exist yet or refuses connections
    /// (QEMU still starting), and then to wait for the greeting.
    pub connect_timeout: Duration,
    /// Default timeout of every command (see [`QmpClient::execute_with_timeout`] to override).
    pub command_timeout: Duration,
    /// How many events a slow subscriber may fall behind before it sees
    /// [`crate::RecvError::Lagged`].
    pub event_capacity: usize,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            command_timeout: Duration::from_secs(30),
            event_capacity: 1024,
        }
    }
}

/// QEMU's version from the greeting, ordered so behaviour can be gated on it:
/// `client.version() >= &QemuVersion::new(8, 0, 0)`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QemuVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
    /// Distribution package string, e.g. `Debian 1:7.2+dfsg-7+deb12u7` (not part of ordering
    /// in practice: it only breaks ties between equal triples).
    pub package: String,
}

impl QemuVersion {
    /// A version with an empty package string, for comparisons.
    pub fn new(major: u32, minor: u32, micro: u32) -> Self {
        Self {
            major,
            minor,
            micro,
            package: String::new(),
        }
    }

    /// True when this version is `major.minor` or newer.
    pub fn at_least(&self, major: u32, minor: u32) -> bool {
        (self.major, self.minor) >= (major, minor)
    }
}

impl std::fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

/// What QEMU said when the connection opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Greeting {
    pub version: QemuVersion,
    /// Capabilities QEMU offered, e.g. `oob`. This client negotiates none of them.
    pub capabilities: Vec<String>,
}

/// A connected, negotiated QMP client. Cheap to clone; all clones share the connection, which
/// closes when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct QmpClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    greeting: Greeting,
    writer: Arc<Writer>,
    next_id: AtomicU64,
    /// Serialises commands that carry file descriptors: QEMU attaches received descriptors to
    /// the connection, not to a command, and a second descriptor arriving before the first
    /// `getfd` is dispatched would replace it.
    fd_lock: Arc<tokio::sync::Mutex<()>>,
    command_timeout: Duration,
    tasks: [AbortHandle; 2],
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        self.shared.close("client dropped");
    }
}

#[derive(Debug)]
struct Shared {
    socket: PathBuf,
    state: Mutex<State>,
    closed: watch::Sender<bool>,
}

#[derive(Debug)]
struct State {
    open: bool,
    pending: HashMap<u64, Waiter>,
    events: Option<broadcast::Sender<Event>>,
}

#[derive(Debug)]
struct Waiter {
    reply: oneshot::Sender<Result<Value, Failure>>,
    /// Held until the reply for an fd-carrying command arrives, even when its caller gave up.
    _fd_guard: Option<OwnedMutexGuard<()>>,
}

#[derive(Debug)]
struct Outgoing {
    line: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the map half-updated in a way that
        // matters: every operation on it is a single insert/remove.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Fail every waiter, end every event stream, resolve `closed()`. Idempotent.
    fn close(&self, reason: &str) {
        let mut state = self.state();
        if !state.open {
            return;
        }
        debug!(socket = %self.socket.display(), reason, "QMP connection closed");
        state.open = false;
        // Dropping the senders wakes every waiter with a receive error -> Disconnected.
        state.pending.clear();
        state.events = None;
        drop(state);
        self.closed.send_replace(true);
    }

    fn dispatch(&self, line: &[u8]) {
        match wire::parse_line(line) {
            Ok(Incoming::Reply { id, result }) => {
                let waiter = id
                    .as_ref()
                    .and_then(Value::as_u64)
                    .and_then(|id| self.state().pending.remove(&id));
                if let Some(waiter) = waiter {
                    // The caller may have timed out between our lookup and now; that is fine.
                    drop(waiter.reply.send(result));
                } else {
                    debug!(
                        socket = %self.socket.display(),
                        ?id,
                        ?result,
                        "discarding a reply nobody waits for (timed out or unsolicited)"
                    );
                }
            }
            Ok(Incoming::Event(event)) => {
                debug!(socket = %self.socket.display(), event = %event.name, "QMP event");
                if let Some(events) = &self.state().events {
                    // No subscriber is not an error.
                    let _ = events.send(event);
                }
            }
            Ok(Incoming::Greeting(_)) => {
                warn!(socket = %self.socket.display(), "ignoring a second QMP greeting");
            }
            Err(err) => warn!(
                socket = %self.socket.display(),
                %err,
                line = %String::from_utf8_lossy(line).trim_end(),
                "skipping a QMP line that is not understood"
            ),
        }
    }
}

/// Removes a waiter when its caller stops waiting (timeout or cancellation), so the map cannot
/// grow with abandoned calls; an fd-carrying call keeps its waiter (see [`Waiter`]).
struct PendingGuard<'a> {
    shared: &'a Shared,
    id: u64,
    remove: bool,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.remove {
            self.shared.state().pending.remove(&self.id);
        }
    }
}

impl QmpClient {
    /// Connect to QEMU's QMP socket, retrying while it does not exist or refuses connections,
    /// read the greeting and leave capabilities negotiation mode (`qmp_capabilities`).
    ///
    /// Events are delivered to streams from [`QmpClient::events`] from the moment they
    /// subscribe; use [`QmpClient::connect_with_events`] to miss none.
    pub async fn connect(socket: impl AsRef<Path>, options: &ConnectOptions) -> Result<Self> {
        Ok(Self::connect_with_events(socket, options).await?.0)
    }

    /// [`QmpClient::connect`], plus an event stream subscribed before negotiation, so that no
    /// event QEMU emits after `qmp_capabilities` can slip by.
    pub async fn connect_with_events(
        socket: impl AsRef<Path>,
        options: &ConnectOptions,
    ) -> Result<(Self, EventStream)> {
        let socket = socket.as_ref().to_path_buf();
        let deadline = Instant::now() + options.connect_timeout;
        let stream = connect_with_retry(&socket, deadline).await?;
        Self::handshake(stream, socket, options, deadline).await
    }

    /// Like [`QmpClient::connect`] over an already connected stream (e.g. one end of a
    /// socketpair, or a socket QEMU was given with `-qmp fd=`).
    pub async fn from_stream(
        stream: UnixStream,
        name: impl Into<PathBuf>,
        options: &ConnectOptions,
    ) -> Result<Self> {
        let deadline = Instant::now() + options.connect_timeout;
        Ok(Self::handshake(stream, name.into(), options, deadline)
            .await?
            .0)
    }

    async fn handshake(
        stream: UnixStream,
        socket: PathBuf,
        options: &ConnectOptions,
        deadline: Instant,
    ) -> Result<(Self, EventStream)> {
        let (read, write) = stream.into_split();
        let mut reader = BufReader::new(read);
        let greeting = read_greeting(&mut reader, &socket, deadline, options).await?;

        let (events, first_subscriber) = broadcast::channel(options.event_capacity.max(1));
        let (closed, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            socket,
            state: Mutex::new(State {
                open: true,
                pending: HashMap::new(),
                events: Some(events),
            }),
            closed,
        });
        let writer = Arc::new(Writer {
            stream: write,
            queue: Mutex::new(WriteQueue::default()),
            wake: Notify::new(),
        });
        let reader_task = tokio::spawn(read_loop(reader, Arc::clone(&shared)));
        let writer_task = tokio::spawn(write_loop(Arc::clone(&writer), Arc::clone(&shared)));
        let client = Self {
            inner: Arc::new(Inner {
                shared,
                greeting,
                writer,
                next_id: AtomicU64::new(1),
                fd_lock: Arc::new(tokio::sync::Mutex::new(())),
                command_timeout: options.command_timeout,
                tasks: [reader_task.abort_handle(), writer_task.abort_handle()],
            }),
        };
        client.execute_raw("qmp_capabilities", Value::Null).await?;
        Ok((
            client,
            EventStream {
                rx: first_subscriber,
            },
        ))
    }

    /// The socket path (or stream name) this client talks to.
    pub fn socket(&self) -> &Path {
        &self.inner.shared.socket
    }

    /// The greeting QEMU sent.
    pub fn greeting(&self) -> &Greeting {
        &self.inner.greeting
    }

    /// QEMU's version, from the greeting.
    pub fn version(&self) -> &QemuVersion {
        &self.inner.greeting.version
    }

    /// The default command timeout.
    pub fn command_timeout(&self) -> Duration {
        self.inner.command_timeout
    }

    /// Run a typed command with the default timeout, e.g.
    /// `client.execute(qapi::qmp::query_status {}).await`.
    pub async fn execute<C: qapi::Command>(&self, command: C) -> Result<C::Ok> {
        self.execute_with_timeout(command, self.inner.command_timeout)
            .await
    }

    /// Run a typed command with an explicit timeout.
    pub async fn execute_with_timeout<C: qapi::Command>(
        &self,
        command: C,
        timeout: Duration,
    ) -> Result<C::Ok> {
        let args = encode_args(C::NAME, &command)?;
        let reply = self.call(C::NAME, args, Vec::new(), timeout).await?;
        self.decode(C::NAME, &reply)
    }

    /// Run a command by name with raw JSON arguments (`Value::Null` or an object) and get the
    /// raw `return` value: for what the `qapi` schema cannot express or decode.
    pub async fn execute_raw(&self, name: &str, arguments: Value) -> Result<Value> {
        self.execute_raw_with_timeout(name, arguments, self.inner.command_timeout)
            .await
    }

    /// [`QmpClient::execute_raw`] with an explicit timeout.
    pub async fn execute_raw_with_timeout(
        &self,
        name: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<Value> {
        let args = wire::arguments(arguments).map_err(|source| Error::Encode {
            command: name.to_owned(),
            source,
        })?;
        self.call(name, args, Vec::new(), timeout).await
    }

    /// Run a typed command with file descriptors attached (SCM_RIGHTS) to the command's own
    /// bytes, e.g. `getfd` or `add-fd`. The descriptors are duplicated; the caller keeps its
    /// own. Such commands are serialised against each other on this connection.
    pub async fn execute_with_fds<C: qapi::Command>(
        &self,
        command: C,
        fds: &[impl AsFd],
        timeout: Duration,
    ) -> Result<C::Ok> {
        let args = encode_args(C::NAME, &command)?;
        let owned = fds
            .iter()
            .map(|fd| fd.as_fd().try_clone_to_owned())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|source| Error::DupFd {
                socket: self.inner.shared.socket.clone(),
                command: C::NAME.to_owned(),
                source,
            })?;
        let reply = self.call(C::NAME, args, owned, timeout).await?;
        self.decode(C::NAME, &reply)
    }

    /// Pass `fd` to QEMU under `name` (`getfd`), for later use as e.g. `netdev_add`'s `fd=name`.
    pub async fn getfd(&self, name: &str, fd: impl AsFd) -> Result<()> {
        self.execute_with_fds(
            qapi::qmp::getfd {
                fdname: name.to_owned(),
            },
            &[fd],
            self.inner.command_timeout,
        )
        .await
        .map(drop)
    }

    /// Subscribe to events from now on. After the connection closed, the stream is empty and
    /// ends at once.
    pub fn events(&self) -> EventStream {
        let state = self.inner.shared.state();
        let rx = match &state.events {
            Some(tx) => tx.subscribe(),
            None => broadcast::channel(1).1,
        };
        EventStream { rx }
    }

    /// True once the connection has closed.
    pub fn is_closed(&self) -> bool {
        *self.inner.shared.closed.borrow()
    }

    /// Resolves when the connection closes (QEMU exited, socket closed, I/O error).
    pub async fn closed(&self) {
        let mut rx = self.inner.shared.closed.subscribe();
        // The sender lives in `Shared`, which we hold, so this cannot fail.
        let _ = rx.wait_for(|closed| *closed).await;
    }

    async fn call(
        &self,
        name: &str,
        args: Option<Value>,
        fds: Vec<OwnedFd>,
        timeout: Duration,
    ) -> Result<Value> {
        let inner = &*self.inner;
        let shared = &*inner.shared;
        let timed_out = || Error::Timeout {
            socket: shared.socket.clone(),
            command: name.to_owned(),
            timeout,
        };
        let disconnected = || Error::Disconnected {
            socket: shared.socket.clone(),
            command: name.to_owned(),
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let fd_guard = if fds.is_empty() {
            None
        } else {
            let lock = Arc::clone(&inner.fd_lock).lock_owned();
            Some(
                tokio::time::timeout_at(deadline, lock)
                    .await
                    .map_err(|_| timed_out())?,
            )
        };
        let carries_fds = fd_guard.is_some();
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply_tx, reply_rx) = oneshot::channel();
        {
            let mut state = shared.state();
            if !state.open {
                return Err(disconnected());
            }
            state.pending.insert(
                id,
                Waiter {
                    reply: reply_tx,
                    _fd_guard: fd_guard,
                },
            );
        }
        let _guard = PendingGuard {
            shared,
            id,
            remove: !carries_fds,
        };
        let line = wire::encode_execute(name, args.as_ref(), Some(id));
        if let Err(err) = inner.writer.send(Outgoing { line, fds }) {
            warn!(socket = %shared.socket.display(), %err, "QMP write failed");
            shared.close("write error");
            return Err(disconnected());
        }
        match tokio::time::timeout_at(deadline, reply_rx).await {
            Ok(Ok(Ok(value))) => Ok(value),
            Ok(Ok(Err(Failure { class, desc }))) => Err(Error::Command {
                socket: shared.socket.clone(),
                command: name.to_owned(),
                class,
                desc,
            }),
            Ok(Err(_)) => Err(disconnected()),
            Err(_) => Err(timed_out()),
        }
    }

    fn decode<T: serde::de::DeserializeOwned>(&self, name: &str, reply: &Value) -> Result<T> {
        T::deserialize(reply).map_err(|source| Error::Decode {
            socket: self.inner.shared.socket.clone(),
            command: name.to_owned(),
            reply: wire::truncate_for_display(&reply.to_string(), 512),
            source,
        })
    }
}

fn encode_args<C: qapi::Command>(name: &str, command: &C) -> Result<Option<Value>> {
    serde_json::to_value(command)
        .and_then(wire::arguments)
        .map_err(|source| Error::Encode {
            command: name.to_owned(),
            source,
        })
}

/// Connect, retrying the errors that mean "QEMU has not created / is not yet listening on the
/// socket", until the deadline.
pub(crate) async fn connect_with_retry(socket: &Path, deadline: Instant) -> Result<UnixStream> {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(5);
    loop {
        match UnixStream::connect(socket).await {
            Ok(stream) => return Ok(stream),
            Err(err)
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) && Instant::now() + backoff < deadline =>
            {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            Err(source) => {
                return Err(Error::Connect {
                    socket: socket.to_path_buf(),
                    waited: started.elapsed(),
                    source,
                });
            }
        }
    }
}

async fn read_greeting(
    reader: &mut BufReader<OwnedReadHalf>,
    socket: &Path,
    deadline: Instant,
    options: &ConnectOptions,
) -> Result<Greeting> {
    let mut line = Vec::new();
    let read = tokio::time::timeout_at(deadline.into(), reader.read_until(b'\n', &mut line))
        .await
        .map_err(|_| Error::GreetingTimeout {
            socket: socket.to_path_buf(),
            timeout: options.connect_timeout,
        })?;
    let bad = |line: &[u8]| Error::Greeting {
        socket: socket.to_path_buf(),
        line: wire::truncate_for_display(&String::from_utf8_lossy(line), 512),
    };
    match read {
        Ok(0) => return Err(bad(b"(connection closed)")),
        Ok(_) => {}
        Err(source) => {
            return Err(Error::Io {
                socket: socket.to_path_buf(),
                context: "reading the QMP greeting",
                source,
            });
        }
    }
    let Ok(Incoming::Greeting(payload)) = wire::parse_line(&line) else {
        return Err(bad(&line));
    };
    let greeting: wire::GreetingWire = serde_json::from_value(payload).map_err(|_| bad(&line))?;
    Ok(Greeting {
        version: QemuVersion {
            major: greeting.version.qemu.major,
            minor: greeting.version.qemu.minor,
            micro: greeting.version.qemu.micro,
            package: greeting.version.package.trim().to_owned(),
        },
        capabilities: greeting
            .capabilities
            .iter()
            .map(|c| c.as_str().map_or_else(|| c.to_string(), str::to_owned))
            .collect(),
    })
}

async fn read_loop(mut reader: BufReader<OwnedReadHalf>, shared: Arc<Shared>) {
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) => return shared.close("end of stream"),
            Ok(_) => shared.dispatch(&line),
            Err(err) => {
                warn!(socket = %shared.socket.display(), %err, "QMP read failed");
                return shared.close("read error");
            }
        }
    }
}

/// The write side: a non-blocking direct path for callers, a queue for the writer task.
#[derive(Debug)]
struct Writer {
    stream: OwnedWriteHalf,
    queue: Mutex<WriteQueue>,
    wake: Notify,
}

#[derive(Debug, Default)]
struct WriteQueue {
    items: VecDeque<Outgoing>,
    /// The writer task owns the socket's byte order: set while anything is queued or being
    /// written by it, and callers must queue behind it.
    busy: bool,
}

impl Writer {
    /// Hand over one complete message. Never awaits, so it cannot be cancelled half-way.
    fn send(&self, mut message: Outgoing) -> std::io::Result<()> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if queue.busy {
            queue.items.push_back(message);
            return Ok(());
        }
        match try_send(self.stream.as_ref(), &message.line, &message.fds) {
            Ok(sent) if sent == message.line.len() => return Ok(()),
            Ok(sent) => {
                message.line.drain(..sent);
                if sent > 0 {
                    // Descriptors travel with the first byte sent.
                    message.fds.clear();
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(err) => return Err(err),
        }
        queue.busy = true;
        queue.items.push_back(message);
        drop(queue);
        self.wake.notify_one();
        Ok(())
    }

    fn next(&self) -> Option<Outgoing> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let next = queue.items.pop_front();
        if next.is_none() {
            queue.busy = false;
        }
        next
    }
}

/// One non-blocking attempt; descriptors go in a single `sendmsg` with the line (tokio has no
/// ancillary-data API, hence nix).
fn try_send(stream: &UnixStream, line: &[u8], fds: &[OwnedFd]) -> std::io::Result<usize> {
    if fds.is_empty() {
        return stream.try_write(line);
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    stream.try_io(Interest::WRITABLE, || {
        nix::sys::socket::sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(line)],
            &[nix::sys::socket::ControlMessage::ScmRights(&raw)],
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(std::io::Error::from)
    })
}

async fn write_loop(writer: Arc<Writer>, shared: Arc<Shared>) {
    loop {
        let Some(Outgoing { mut line, mut fds }) = writer.next() else {
            writer.wake.notified().await;
            continue;
        };
        let stream: &UnixStream = writer.stream.as_ref();
        while !line.is_empty() {
            let written = match stream.writable().await {
                Ok(()) => try_send(stream, &line, &fds),
                Err(err) => Err(err),
            };
            match written {
                Ok(sent) => {
                    line.drain(..sent);
                    if sent > 0 {
                        fds.clear();
                    }
                }
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(err) => {
                    warn!(socket = %shared.socket.display(), %err, "QMP write failed");
                    return shared.close("write error");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::QemuVersion;

    #[test]
    fn versions_order_for_gating() {
        let v72 = QemuVersion {
            package: "Debian 1:7.2+dfsg-7".into(),
            ..QemuVersion::new(7, 2, 22)
        };
        assert!(v72 < QemuVersion::new(8, 0, 0));
        assert!(v72 > QemuVersion::new(7, 2, 0));
        assert!(v72.at_least(7, 2));
        assert!(v72.at_least(6, 9));
        assert!(!v72.at_least(7, 3));
        assert_eq!(v72.to_string(), "7.2.22");
    }
}
