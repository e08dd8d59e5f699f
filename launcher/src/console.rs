//! The serial console: the launcher is QEMU's only client on the serial socket, keeps what the
//! guest prints in a bounded log (so boot messages survive with nobody attached), and relays
//! the console to one client at a time on the public socket. A new client replaces the old one,
//! as a reconnecting `virtctl console` expects.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex;
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

impl Console {
    /// Connects to QEMU's serial socket and starts serving `public`.
    pub async fn start(backend: &Path, public: &Path, log: &Path) -> std::io::Result<Self> {
        let qemu = UnixStream::connect(backend).await?;
        let _ = std::fs::remove_file(public);
        let listener = UnixListener::bind(public)?;
        let mut log = BoundedLog::create(log, LOG_LIMIT)?;
        let (mut from_qemu, to_qemu) = qemu.into_split();
        let to_qemu = Arc::new(Mutex::new(to_qemu));
        let client: Arc<Mutex<Option<OwnedWriteHalf>>> = Arc::new(Mutex::new(None));

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
                let mut c = out_client.lock().await;
                if let Some(w) = c.as_mut()
                    && w.write_all(&buf[..n]).await.is_err()
                {
                    *c = None;
                }
            }
        });

        let accept = tokio::spawn(async move {
            let mut reader: Option<JoinHandle<()>> = None;
            while let Ok((stream, _)) = listener.accept().await {
                let (mut r, w) = stream.into_split();
                if let Some(old) = reader.take() {
                    old.abort();
                }
                *client.lock().await = Some(w);
                let to_qemu = to_qemu.clone();
                reader = Some(tokio::spawn(async move {
                    let mut buf = vec![0u8; 1024];
                    while let Ok(n) = r.read(&mut buf).await {
                        if n == 0 || to_qemu.lock().await.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                }));
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
        // The client may be registered just after its first write; retry the reply until seen.
        let mut seen = Vec::new();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !seen.ends_with(b"reply") && tokio::time::Instant::now() < deadline {
            qemu.write_all(b"reply").await.unwrap();
            let mut buf = [0u8; 64];
            if let Ok(Ok(n)) =
                tokio::time::timeout(std::time::Duration::from_millis(200), client.read(&mut buf))
                    .await
            {
                seen.extend_from_slice(&buf[..n]);
            }
        }
        assert!(seen.ends_with(b"reply"));
        drop(console);
    }
}
