//! The serial console: the launcher is QEMU's only client on the serial socket, keeps what the
//! guest prints in a bounded log (so boot messages survive with nobody attached), and relays
//! the console to one client at a time on the public socket. A new client replaces the old one,
//! as a reconnecting `virtctl console` expects. Neither the log nor the guest ever waits on the
//! client: one that leaves [`CLIENT_BACKLOG_LIMIT`] bytes untaken is disconnected.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinHandle;

/// The log is rotated to `<log>.1` when it reaches this size: at most twice this on disk.
pub const LOG_LIMIT: u64 = 1 << 20;

/// A log file that keeps the newest output within a bound.
#[derive(Debug)]
pub struct BoundedLog {
    path: PathBuf,
    file: File,
    size: u64,
    limit: u64,
}

impl BoundedLog {
    pub fn create(path: &Path, limit: u64) -> std::io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(path)?;
        Ok(Self {
            path: path.to_owned(),
            file,
            size: 0,
            limit,
        })
    }

    pub fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        if self.size + data.len() as u64 > self.limit && self.size > 0 {
            let mut old = self.path.clone().into_os_string();
            old.push(".1");
            std::fs::rename(&self.path, &old)?;
            self.file = File::create(&self.path)?;
            self.size = 0;
        }
        self.file.write_all(data)?;
        self.size += data.len() as u64;
        Ok(())
    }
}

/// Output a console client has not taken yet, in bytes, beyond which it is disconnected.
pub const CLIENT_BACKLOG_LIMIT: usize = 1 << 20;

/// The running relay; dropping it stops every task.
#[derive(Debug)]
pub struct Console {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Console {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The attached client. Its output goes through a queue that its own task drains, so the
/// pump never waits on it: a client that stops reading must not stop the guest. QEMU's serial
/// port writes a byte at a time, and a unix socket holds only about 280 such writes; a pump
/// waiting on an idle client stops reading QEMU, and QEMU's UART, the guest's console and
/// the log stop with it a few hundred bytes later.
#[derive(Debug)]
struct Client {
    queue: mpsc::UnboundedSender<Vec<u8>>,
    pending: Arc<AtomicUsize>,
    tasks: [JoinHandle<()>; 2],
}

impl Drop for Client {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Client {
    fn attach(stream: UnixStream, to_qemu: Arc<Mutex<OwnedWriteHalf>>) -> Self {
        let (mut r, mut w) = stream.into_split();
        let (queue, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let pending = Arc::new(AtomicUsize::new(0));
        let taken = pending.clone();
        let writer = tokio::spawn(async move {
            while let Some(mut batch) = rx.recv().await {
                // Whatever queued meanwhile goes in the same write.
                while let Ok(more) = rx.try_recv() {
                    batch.extend_from_slice(&more);
                }
                if w.write_all(&batch).await.is_err() {
                    break;
                }
                taken.fetch_sub(batch.len(), Ordering::Relaxed);
            }
        });
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 1024];
            while let Ok(n) = r.read(&mut buf).await {
                if n == 0 || to_qemu.lock().await.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        });
        Self {
            queue,
            pending,
            tasks: [writer, reader],
        }
    }

    /// Queues output for the client; false when it is gone or has `limit` bytes untaken.
    fn offer(&self, data: &[u8], limit: usize) -> bool {
        if self.tasks[0].is_finished() || self.pending.load(Ordering::Relaxed) + data.len() > limit
        {
            return false;
        }
        self.pending.fetch_add(data.len(), Ordering::Relaxed);
        self.queue.send(data.to_vec()).is_ok()
    }
}

impl Console {
    /// Connects to QEMU's serial socket and starts serving `public`.
    pub async fn start(backend: &Path, public: &Path, log: &Path) -> std::io::Result<Self> {
        Self::start_with_backlog(backend, public, log, CLIENT_BACKLOG_LIMIT).await
    }

    /// [`Console::start`], disconnecting a client once `backlog` bytes wait for it.
    async fn start_with_backlog(
        backend: &Path,
        public: &Path,
        log: &Path,
        backlog: usize,
    ) -> std::io::Result<Self> {
        let qemu = UnixStream::connect(backend).await?;
        let _ = std::fs::remove_file(public);
        let listener = UnixListener::bind(public)?;
        let mut log = BoundedLog::create(log, LOG_LIMIT)?;
        let (mut from_qemu, to_qemu) = qemu.into_split();
        let to_qemu = Arc::new(Mutex::new(to_qemu));
        let client: Arc<std::sync::Mutex<Option<Client>>> = Arc::default();

        let out_client = client.clone();
        let pump = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut first = true;
            loop {
                let n = match from_qemu.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if std::mem::take(&mut first) {
                    // When the guest's console came up: the start-latency benchmark splits
                    // firmware from guest boot with it (and the guest's own timestamps).
                    tracing::info!("guest serial console: first output");
                }
                if let Err(e) = log.write(&buf[..n]) {
                    tracing::warn!(error = %e, "cannot write the serial console log");
                }
                let mut c = out_client.lock().unwrap_or_else(PoisonError::into_inner);
                if c.as_ref().is_some_and(|c| !c.offer(&buf[..n], backlog)) {
                    tracing::warn!(
                        backlog,
                        "serial console client disconnected: gone, or not reading its output"
                    );
                    *c = None;
                }
            }
        });

        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let new = Client::attach(stream, to_qemu.clone());
                // The old client, if any, is dropped outside the lock.
                let _old = client
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .replace(new);
            }
        });
        Ok(Self {
            tasks: vec![pump, accept],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_rotates_at_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut log = BoundedLog::create(&path, 10).unwrap();
        log.write(b"12345678").unwrap();
        log.write(b"abcdef").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abcdef");
        assert_eq!(
            std::fs::read(dir.path().join("log.1")).unwrap(),
            b"12345678"
        );
        log.write(b"ghij").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abcdefghij");
    }

    /// A console with a fake QEMU behind it and a client attached: output written until the
    /// client has seen some, so the client is known to be attached.
    async fn attached(backlog: usize) -> (tempfile::TempDir, Console, UnixStream, UnixStream) {
        let dir = tempfile::tempdir().unwrap();
        let backend = dir.path().join("qemu.sock");
        let public = dir.path().join("virt-serial0");
        let qemu_side = UnixListener::bind(&backend).unwrap();
        let console =
            Console::start_with_backlog(&backend, &public, &dir.path().join("log"), backlog)
                .await
                .unwrap();
        let (mut qemu, _) = qemu_side.accept().await.unwrap();
        let mut client = UnixStream::connect(&public).await.unwrap();
        write_until_seen(&mut qemu, &mut client, b".").await;
        (dir, console, qemu, client)
    }

    /// Writes `what` as QEMU until `client` has received it: a client is registered a moment
    /// after it connects, and what comes before goes to the log only.
    async fn write_until_seen(qemu: &mut UnixStream, client: &mut UnixStream, what: &[u8]) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut seen = Vec::new();
        while !seen.ends_with(what) {
            qemu.write_all(what).await.unwrap();
            let mut buf = [0u8; 64];
            if let Ok(Ok(n)) =
                tokio::time::timeout(std::time::Duration::from_millis(100), client.read(&mut buf))
                    .await
            {
                seen.extend_from_slice(&buf[..n]);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the client saw {seen:?}, not {what:?}"
            );
        }
    }

    async fn wait_log(dir: &Path, len: usize) -> Vec<u8> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let log = std::fs::read(dir.join("log")).unwrap();
            if log.len() >= len || tokio::time::Instant::now() > deadline {
                return log;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// QEMU's serial port writes a byte at a time; a client that stopped reading once stalled
    /// the relay (and with it the log and the guest's UART) about 300 bytes later.
    #[tokio::test]
    async fn a_client_that_stops_reading_stalls_neither_the_log_nor_the_guest() {
        let (dir, _console, mut qemu, _idle) = attached(CLIENT_BACKLOG_LIMIT).await;
        let before = std::fs::read(dir.path().join("log")).unwrap().len();
        let mut written = 0;
        let writes = async {
            for _ in 0..4000 {
                // One byte per write, each read on its own by the relay, as the guest prints.
                qemu.write_all(b"x").await.unwrap();
                written += 1;
                tokio::task::yield_now().await;
            }
            qemu.write_all(b"END").await.unwrap();
        };
        let stalled = tokio::time::timeout(std::time::Duration::from_secs(20), writes).await;
        assert!(
            stalled.is_ok(),
            "the relay stopped reading QEMU after {written} bytes"
        );
        let log = wait_log(dir.path(), before + 4003).await;
        assert!(
            log.ends_with(b"END"),
            "the log stopped after {} of 4003 bytes",
            log.len() - before
        );
    }

    /// A client leaving more than the backlog untaken is disconnected (it reads to the end of
    /// what it was sent, then EOF); the log has everything, and the next client is served.
    #[tokio::test]
    async fn a_client_over_its_backlog_is_disconnected_and_the_next_one_served() {
        let (dir, _console, mut qemu, mut idle) = attached(64 << 10).await;
        let chunk = vec![b'y'; 4096];
        // More than the client's socket and the backlog hold together.
        for _ in 0..200 {
            qemu.write_all(&chunk).await.unwrap();
        }
        let log = wait_log(dir.path(), 200 * 4096).await;
        assert!(log.len() >= 200 * 4096, "the log has {} bytes", log.len());
        let mut got = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(20),
            idle.read_to_end(&mut got),
        )
        .await
        .expect("the slow client is disconnected")
        .unwrap();
        assert!(got.len() < 200 * 4096, "{} bytes", got.len());
        let mut next = UnixStream::connect(dir.path().join("virt-serial0"))
            .await
            .unwrap();
        write_until_seen(&mut qemu, &mut next, b"again").await;
    }

    #[tokio::test]
    async fn relays_both_ways_and_logs() {
        let dir = tempfile::tempdir().unwrap();
        let backend = dir.path().join("qemu.sock");
        let public = dir.path().join("virt-serial0");
        let log = dir.path().join("log");
        let qemu_side = UnixListener::bind(&backend).unwrap();
        let console = Console::start(&backend, &public, &log).await.unwrap();
        let (mut qemu, _) = qemu_side.accept().await.unwrap();
        qemu.write_all(b"boot banner\n").await.unwrap();
        let mut client = UnixStream::connect(&public).await.unwrap();
        // Wait until the banner reached the log, so it is known to have been read before the
        // client attached.
        for _ in 0..200 {
            if std::fs::read(&log).unwrap() == b"boot banner\n" {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(std::fs::read(&log).unwrap(), b"boot banner\n");
        client.write_all(b"ls\n").await.unwrap();
        let mut got = [0u8; 3];
        qemu.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ls\n");
        // The client may be registered just after its first write; the reply is retried.
        write_until_seen(&mut qemu, &mut client, b"reply").await;
        drop(console);
    }
}
