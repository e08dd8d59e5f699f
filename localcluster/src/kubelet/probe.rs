//! HTTP(S) GET probes, answered like the kubelet's: any status from 200 to 399 is success, and
//! HTTPS certificates are not verified (the kubelet probes with InsecureSkipVerify too).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite};

/// Accepts any server certificate, checking only that handshake signatures are valid.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Sends `request` on `stream` with hyper's HTTP/1 client; the response's status code.
async fn exchange<S>(stream: S, request: http::Request<Empty<Bytes>>) -> Option<u16>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // The kubelet (Go's net/http) sends header names in canonical case; some servers care.
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .title_case_headers(true)
        .handshake(TokioIo::new(stream))
        .await
        .ok()?;
    let connection = tokio::spawn(connection);
    let status = sender
        .send_request(request)
        .await
        .ok()
        .map(|r| r.status().as_u16());
    connection.abort();
    status
}

/// GETs `path` from `host:port`; true when the answer is 2xx or 3xx within `timeout`.
pub async fn http_get(
    host: &str,
    port: u16,
    path: &str,
    https: bool,
    headers: &[(String, String)],
    timeout: Duration,
) -> bool {
    let mut request = http::Request::get(path)
        .header(http::header::HOST, format!("{host}:{port}"))
        .header(http::header::USER_AGENT, "kube-probe/1.32")
        .header(http::header::ACCEPT, "*/*")
        .header(http::header::CONNECTION, "close");
    for (k, v) in headers {
        request = request.header(k.as_str(), v.as_str());
    }
    let Ok(request) = request.body(Empty::<Bytes>::new()) else {
        return false;
    };
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        if https {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .ok()?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth();
            let name = ServerName::try_from(host.to_string()).ok()?;
            let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(name, tcp)
                .await
                .ok()?;
            exchange(tls, request).await
        } else {
            exchange(tcp, request).await
        }
    };
    matches!(
        tokio::time::timeout(timeout, attempt).await,
        Ok(Some(200..=399))
    )
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    #[tokio::test]
    async fn plain_http() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            for answer in [
                "HTTP/1.1 204 No Content\r\n\r\n",
                "HTTP/1.1 500 Oops\r\n\r\n",
            ] {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).await.unwrap();
                assert!(buf[..n].starts_with(b"GET /healthz HTTP/1.1\r\n"));
                s.write_all(answer.as_bytes()).await.unwrap();
            }
        });
        let t = Duration::from_secs(5);
        assert!(http_get("127.0.0.1", port, "/healthz", false, &[], t).await);
        assert!(!http_get("127.0.0.1", port, "/healthz", false, &[], t).await);
    }

    #[tokio::test]
    async fn https_with_an_unverified_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::pki::Pki::create(dir.path(), &[]).unwrap();
        let server = pki
            .server(
                "probed",
                &crate::pki::Subject {
                    common_name: "probed",
                    organizations: &[],
                },
                &["127.0.0.1".to_string()],
            )
            .unwrap();
        let config = crate::tls::server_config(&server.cert_pem, &server.key_pem, None).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut s = acceptor.accept(tcp).await.unwrap();
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.unwrap();
            assert!(buf[..n].windows(8).any(|w| w == b"X-A: b\r\n"));
            s.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
            s.shutdown().await.unwrap();
        });
        let headers = [("X-A".to_string(), "b".to_string())];
        assert!(
            http_get(
                "127.0.0.1",
                port,
                "/",
                true,
                &headers,
                Duration::from_secs(5)
            )
            .await
        );
    }
}
