//! `console NAME`: the serial console, as KubeVirt's `pkg/virtctl/console`. Connecting retries
//! while virt-api answers 400 (the VMI exists but is not running yet) until `--timeout` minutes
//! pass; `Ctrl+]` leaves; a dropped connection ends the session with KubeVirt's explanation.

use std::io::{IsTerminal as _, Read as _};
use std::time::Duration;

use anyhow::bail;
use api::subresources::{VmiSubresource, vmi_path};
use futures::{SinkExt as _, StreamExt as _};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use crate::client::{Cluster, Stream};
use crate::error::RequestError;
use crate::stream::{CHUNK, Ended, socket_to_writer};
use crate::terminal::RawMode;

/// `Ctrl+]` (and `Ctrl+5` on most terminals).
pub const ESCAPE: u8 = 0x1d;

pub const DISCONNECTED: &str = "\nYou were disconnected from the console. This could be caused by one of the following:\n - the target VM was powered off\n - another user connected to the console of the target VM\n - network issues\n";

pub fn banner(name: &str) -> String {
    format!("Successfully connected to {name} console. Press Ctrl+] or Ctrl+5 to exit console.")
}

/// The bytes to send from one read of stdin, and whether the user asked to leave.
pub fn split_escape(chunk: &[u8]) -> (&[u8], bool) {
    match chunk.iter().position(|&b| b == ESCAPE) {
        Some(i) => (&chunk[..i], true),
        None => (chunk, false),
    }
}

/// Whether a failed connect means "not yet": virt-api's 400 for a VMI that is not running.
pub fn retryable(err: &RequestError) -> bool {
    err.status() == Some(400)
}

async fn connect(cluster: &Cluster, name: &str, timeout: Duration) -> anyhow::Result<Stream> {
    let path = vmi_path(&cluster.namespace, name, VmiSubresource::Console);
    if timeout.is_zero() {
        return Ok(cluster.websocket(&path).await?);
    }
    let attempts = async {
        loop {
            match cluster.websocket(&path).await {
                Err(e) if retryable(&e) => tokio::time::sleep(Duration::from_secs(1)).await,
                other => return other,
            }
        }
    };
    match tokio::time::timeout(timeout, attempts).await {
        Ok(r) => Ok(r?),
        Err(_) => bail!("Timeout trying to connect to the virtual machine instance"),
    }
}

enum Input {
    Data(Vec<u8>),
    Leave,
    Failed(std::io::Error),
}

/// Reads stdin on a plain thread: a blocking read cannot be cancelled, and a tokio blocking
/// task would hold the runtime open at exit until the user pressed a key.
fn read_stdin() -> mpsc::Receiver<Input> {
    let (tx, rx) = mpsc::channel(4);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; CHUNK];
        loop {
            let msg = match stdin.read(&mut buf) {
                Ok(0) => Input::Leave,
                Ok(n) => {
                    let (data, leave) = split_escape(&buf[..n]);
                    if !data.is_empty() && tx.blocking_send(Input::Data(data.to_vec())).is_err() {
                        return;
                    }
                    if !leave {
                        continue;
                    }
                    Input::Leave
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Input::Failed(e),
            };
            let _ = tx.blocking_send(msg);
            return;
        }
    });
    rx
}

pub async fn run(cluster: &Cluster, name: &str, timeout_minutes: u64) -> anyhow::Result<()> {
    let socket = connect(cluster, name, Duration::from_secs(timeout_minutes * 60)).await?;
    let tty = std::io::stdin().is_terminal();
    let raw = RawMode::enter()?;
    // Raw mode turns off the terminal's newline translation, so the banner brings its own.
    eprint!("{}{}", banner(name), if tty { "\r\n" } else { "\n" });

    let (mut tx, mut rx) = socket.split();
    let mut input = read_stdin();
    let mut stdout = tokio::io::stdout();
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut hangup = signal(SignalKind::hangup())?;

    let keys = async {
        while let Some(msg) = input.recv().await {
            match msg {
                Input::Data(d) => tx.send(Message::binary(d)).await?,
                Input::Leave => break,
                Input::Failed(e) => return Err(anyhow::Error::from(e)),
            }
        }
        let _ = tx.close().await;
        Ok(())
    };
    let result = tokio::select! {
        r = keys => r,
        r = socket_to_writer(&mut rx, &mut stdout) => match r? {
            Ended::Closed => Ok(()),
            Ended::Dropped => Err(Dropped.into()),
            Ended::Refused(why) => Err(anyhow::anyhow!(why)),
        },
        _ = interrupt.recv() => Ok(()),
        _ = terminate.recv() => Ok(()),
        _ = hangup.recv() => Ok(()),
    };
    drop(raw);
    if result.as_ref().is_err_and(anyhow::Error::is::<Dropped>) {
        eprint!("{DISCONNECTED}");
    }
    result
}

/// The console connection ended without a close handshake.
#[derive(Debug, thiserror::Error)]
#[error("websocket: close 1006 (abnormal closure): unexpected EOF")]
struct Dropped;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ApiError;

    #[test]
    fn escape_splits_the_read() {
        let cases: [(&[u8], &[u8], bool); 5] = [
            (b"ls\r", b"ls\r", false),
            (b"\x1d", b"", true),
            (b"exit\r\x1d", b"exit\r", true),
            (b"a\x1db", b"a", true),
            (b"", b"", false),
        ];
        for (chunk, send, leave) in cases {
            assert_eq!(split_escape(chunk), (send, leave), "{chunk:?}");
        }
    }

    #[test]
    fn only_400_is_worth_waiting_for() {
        let api = |code| {
            RequestError::Api(ApiError {
                code,
                message: String::new(),
            })
        };
        assert!(retryable(&api(400)));
        assert!(!retryable(&api(404)));
        assert!(!retryable(&api(403)));
        assert!(!retryable(&RequestError::Protocol("x".into())));
    }

    #[test]
    fn banner_is_kubevirts() {
        assert_eq!(
            banner("demo"),
            "Successfully connected to demo console. Press Ctrl+] or Ctrl+5 to exit console."
        );
    }
}
