//! Byte streams over a `plain.kubevirt.io` websocket: the payload travels in binary frames
//! (text frames are not part of the protocol and are skipped, as KubeVirt's reader does).

use futures::{Sink, SinkExt as _, Stream, StreamExt as _};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message};

/// KubeVirt's websocket message buffer size; a frame per read of at most this much.
pub const CHUNK: usize = 10240;

/// How the far side ended the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// A normal close frame (or none needed: the socket had already said goodbye).
    Closed,
    /// The connection dropped without a close handshake (websocket code 1006).
    Dropped,
    /// A close frame with an error code.
    Refused(String),
}

/// What a received frame means for the byte stream.
pub fn classify(msg: Message) -> Option<Result<tungstenite::Bytes, Ended>> {
    match msg {
        Message::Binary(b) => Some(Ok(b)),
        Message::Close(frame) => Some(Err(close_reason(frame.as_ref()))),
        Message::Text(_) | Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => None,
    }
}

fn close_reason(frame: Option<&CloseFrame>) -> Ended {
    match frame {
        None => Ended::Closed,
        Some(f) if f.code == CloseCode::Normal || f.code == CloseCode::Away => Ended::Closed,
        Some(f) if f.code == CloseCode::Abnormal => Ended::Dropped,
        Some(f) => Ended::Refused(format!(
            "websocket: close {} {}",
            u16::from(f.code),
            f.reason
        )),
    }
}

fn ended_by(err: &tungstenite::Error) -> Ended {
    use tungstenite::error::ProtocolError;
    match err {
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => Ended::Closed,
        tungstenite::Error::Protocol(ProtocolError::ResetWithoutClosingHandshake)
        | tungstenite::Error::Io(_) => Ended::Dropped,
        other => Ended::Refused(other.to_string()),
    }
}

/// Writes the socket's bytes to `out` until the socket ends; errors writing `out` are returned.
pub async fn socket_to_writer<S, W>(socket: &mut S, out: &mut W) -> std::io::Result<Ended>
where
    S: Stream<Item = Result<Message, tungstenite::Error>> + Unpin,
    W: AsyncWrite + Unpin,
{
    while let Some(msg) = socket.next().await {
        let msg = match msg {
            Ok(m) => m,
            Err(e) => return Ok(ended_by(&e)),
        };
        match classify(msg) {
            Some(Ok(bytes)) => {
                out.write_all(&bytes).await?;
                out.flush().await?;
            }
            Some(Err(ended)) => return Ok(ended),
            None => {}
        }
    }
    Ok(Ended::Dropped)
}

/// Sends what `input` yields as binary frames; at its end says goodbye with a close frame.
pub async fn reader_to_socket<R, S>(input: &mut R, socket: &mut S) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    S: Sink<Message, Error = tungstenite::Error> + Unpin,
{
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = input.read(&mut buf).await?;
        if n == 0 {
            // The peer may already be gone; the close is a courtesy.
            let _ = socket.close().await;
            return Ok(());
        }
        socket
            .send(Message::binary(buf[..n].to_vec()))
            .await
            .map_err(std::io::Error::other)?;
    }
}

/// Joins a local byte stream (a TCP client, stdin/stdout) to the socket until either ends.
pub async fn splice<R, W>(
    socket: crate::client::Stream,
    mut input: R,
    mut output: W,
) -> anyhow::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (mut tx, mut rx) = socket.split();
    tokio::select! {
        r = reader_to_socket(&mut input, &mut tx) => r.map_err(anyhow::Error::from),
        r = socket_to_writer(&mut rx, &mut output) => match r? {
            Ended::Closed => Ok(()),
            Ended::Dropped => anyhow::bail!("websocket: close 1006 (abnormal closure): unexpected EOF"),
            Ended::Refused(why) => anyhow::bail!(why),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames() {
        let close = |code: u16, reason: &str| {
            Message::Close(Some(CloseFrame {
                code: CloseCode::from(code),
                reason: reason.into(),
            }))
        };
        assert_eq!(
            classify(Message::binary(b"hi".to_vec())),
            Some(Ok(tungstenite::Bytes::from_static(b"hi")))
        );
        assert_eq!(classify(Message::text("ignored")), None);
        assert_eq!(classify(Message::Close(None)), Some(Err(Ended::Closed)));
        assert_eq!(classify(close(1000, "")), Some(Err(Ended::Closed)));
        assert_eq!(classify(close(1006, "")), Some(Err(Ended::Dropped)));
        assert_eq!(
            classify(close(1011, "handler gone")),
            Some(Err(Ended::Refused(
                "websocket: close 1011 handler gone".into()
            )))
        );
    }

    #[tokio::test]
    async fn socket_bytes_reach_the_writer() {
        let msgs: Vec<Result<Message, tungstenite::Error>> = vec![
            Ok(Message::binary(b"login: ".to_vec())),
            Ok(Message::text("noise")),
            Ok(Message::binary(b"root".to_vec())),
            Ok(Message::Close(None)),
            Ok(Message::binary(b"never".to_vec())),
        ];
        let mut socket = futures::stream::iter(msgs);
        let mut out = Vec::new();
        let ended = socket_to_writer(&mut socket, &mut out).await.unwrap();
        assert_eq!(ended, Ended::Closed);
        assert_eq!(out, b"login: root");

        let dropped: Vec<Result<Message, tungstenite::Error>> =
            vec![Err(tungstenite::Error::Protocol(
                tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
            ))];
        let mut socket = futures::stream::iter(dropped);
        let ended = socket_to_writer(&mut socket, &mut Vec::new())
            .await
            .unwrap();
        assert_eq!(ended, Ended::Dropped);
    }

    #[tokio::test]
    async fn reader_bytes_become_binary_frames() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<Message>();
        let mut sink = tx.sink_map_err(|_| tungstenite::Error::ConnectionClosed);
        let mut input: &[u8] = b"ls\n";
        reader_to_socket(&mut input, &mut sink).await.unwrap();
        let sent: Vec<Message> = rx.collect().await;
        // Closing the sink ended the channel, so nothing follows the one frame.
        assert_eq!(sent, vec![Message::binary(b"ls\n".to_vec())]);
    }
}
