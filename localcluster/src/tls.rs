//! The serving certificate (a fresh self-signed CA and a server certificate for localhost) and the
//! kubeconfig that trusts it and carries the bearer token.

use std::sync::Arc;

use base64::Engine as _;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Why the certificates or the TLS configuration could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("generating a certificate")]
    Generate(#[from] rcgen::Error),
    #[error("building the TLS server configuration")]
    Rustls(#[from] rustls::Error),
}

/// A CA and the server certificate it signed.
#[derive(Debug, Clone)]
pub struct ServingCerts {
    pub ca_pem: String,
    pub cert_der: Vec<u8>,
    pub key_der: Vec<u8>,
}

impl ServingCerts {
    /// Makes a CA and a server certificate for `localhost`, `127.0.0.1` and `::1`.
    pub fn generate() -> Result<Self, TlsError> {
        Self::generate_for(&[])
    }

    /// Like [`ServingCerts::generate`], the certificate also naming `addresses` (where pods
    /// reach the server).
    pub fn generate_for(addresses: &[std::net::IpAddr]) -> Result<Self, TlsError> {
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "localcluster-ca");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate()?;
        let mut names = vec![
            "localhost".to_string(),
            "127.0.0.1".to_string(),
            "::1".to_string(),
        ];
        names.extend(addresses.iter().map(ToString::to_string));
        let mut params = CertificateParams::new(names)?;
        params
            .distinguished_name
            .push(DnType::CommonName, "localcluster-apiserver");
        let cert = params.signed_by(&key, &issuer)?;
        Ok(Self {
            ca_pem: ca_cert.pem(),
            cert_der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        })
    }

    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from(self.cert_der.clone())],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone())),
            )?;
        // kubectl and client-go prefer HTTP/2; hyper serves both.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// A kubeconfig for `server` that trusts `ca_pem` and authenticates with `token`.
pub fn kubeconfig(server: &str, ca_pem: &str, token: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: localcluster
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: localcluster-admin
  user:
    token: {token}
contexts:
- name: localcluster
  context:
    cluster: localcluster
    user: localcluster-admin
    namespace: default
current-context: localcluster
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_build_a_server_config() {
        let certs = ServingCerts::generate().unwrap();
        assert!(certs.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        certs.server_config().unwrap();
        let kc = kubeconfig("https://127.0.0.1:1", &certs.ca_pem, "t0k");
        let parsed: serde_yaml::Value = serde_yaml::from_str(&kc).unwrap();
        assert_eq!(parsed["users"][0]["user"]["token"], "t0k");
    }
}
