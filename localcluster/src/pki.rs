//! The cluster's certificates and kubeconfigs, as kubeadm lays them out: a cluster CA that signs
//! kube-apiserver's serving certificate and every client certificate (admin, controller-manager,
//! scheduler, kube-proxy, the apiserver's kubelet client, each kubelet), a front-proxy CA for the
//! aggregation layer, and the service-account signing key pair. Generated with rcgen at `up`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// Why a certificate could not be made or written.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("generating a certificate")]
    Generate(#[from] rcgen::Error),
    #[error("writing {path}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

/// A certificate with its key, both PEM, and where they were written.
#[derive(Clone)]
pub struct Credential {
    pub cert_pem: String,
    pub key_pem: String,
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential")
            .field("cert_path", &self.cert_path)
            .finish_non_exhaustive()
    }
}

/// A certificate authority that can sign.
struct Authority {
    issuer: Issuer<'static, KeyPair>,
    cert: Credential,
}

impl Authority {
    fn create(dir: &Path, name: &str, common_name: &str) -> Result<Self, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        let cert = write_pair(dir, name, &cert.pem(), &key.serialize_pem())?;
        Ok(Self {
            issuer: Issuer::new(params, key),
            cert,
        })
    }

    fn issue(
        &self,
        dir: &Path,
        name: &str,
        subject: &Subject<'_>,
        usage: Usage<'_>,
    ) -> Result<Credential, PkiError> {
        let key = KeyPair::generate()?;
        let names = match usage {
            Usage::Server(names) | Usage::ServerAndClient(names) => names.to_vec(),
            Usage::Client => Vec::new(),
        };
        let mut params = CertificateParams::new(names)?;
        params
            .distinguished_name
            .push(DnType::CommonName, subject.common_name);
        for org in subject.organizations {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *org);
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = match usage {
            Usage::Server(_) => vec![ExtendedKeyUsagePurpose::ServerAuth],
            Usage::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
            Usage::ServerAndClient(_) => vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        };
        let cert = params.signed_by(&key, &self.issuer)?;
        write_pair(dir, name, &cert.pem(), &key.serialize_pem())
    }
}

/// Who a certificate names: the user (CN) and groups (O) Kubernetes authenticates it as.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    pub common_name: &'a str,
    pub organizations: &'a [&'a str],
}

#[derive(Debug, Clone, Copy)]
enum Usage<'a> {
    /// A serving certificate for these DNS names and addresses.
    Server(&'a [String]),
    Client,
    ServerAndClient(&'a [String]),
}

fn write_pair(dir: &Path, name: &str, cert: &str, key: &str) -> Result<Credential, PkiError> {
    let cert_path = dir.join(format!("{name}.crt"));
    let key_path = dir.join(format!("{name}.key"));
    write_file(&cert_path, cert, 0o644)?;
    write_file(&key_path, key, 0o600)?;
    Ok(Credential {
        cert_pem: cert.into(),
        key_pem: key.into(),
        cert_path,
        key_path,
    })
}

/// Writes `content` to `path` with `mode`, creating its directory.
pub fn write_file(path: &Path, content: &str, mode: u32) -> Result<(), PkiError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(path)?;
        f.write_all(content.as_bytes())
    };
    write().map_err(|source| PkiError::Write {
        path: path.display().to_string(),
        source,
    })
}

/// The cluster's certificates, under one directory.
pub struct Pki {
    dir: PathBuf,
    ca: Authority,
    pub front_proxy_ca: Credential,
    /// kube-apiserver's serving certificate.
    pub apiserver: Credential,
    /// What kube-apiserver presents to kubelets (`system:masters`, as kubeadm's).
    pub apiserver_kubelet_client: Credential,
    /// What kube-apiserver presents to aggregated API servers.
    pub front_proxy_client: Credential,
    /// The service-account token signing key (`sa.key`) and its public half (`sa.pub`).
    pub service_account_key: PathBuf,
    pub service_account_pub: PathBuf,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// The names kube-apiserver's serving certificate carries besides the addresses it is given:
/// the `kubernetes` Service's, as pods dial it.
const APISERVER_NAMES: &[&str] = &[
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];

impl Pki {
    /// Creates every certificate under `dir`; `apiserver_addresses` are the addresses the
    /// serving certificate names (loopback, the advertise address, the `kubernetes` Service's
    /// cluster IP).
    pub fn create(dir: &Path, apiserver_addresses: &[IpAddr]) -> Result<Self, PkiError> {
        let ca = Authority::create(dir, "ca", "localcluster-ca")?;
        let front_proxy = Authority::create(dir, "front-proxy-ca", "localcluster-front-proxy-ca")?;
        let mut names: Vec<String> = APISERVER_NAMES.iter().map(ToString::to_string).collect();
        names.extend(apiserver_addresses.iter().map(ToString::to_string));
        let apiserver = ca.issue(
            dir,
            "apiserver",
            &Subject {
                common_name: "kube-apiserver",
                organizations: &[],
            },
            Usage::Server(&names),
        )?;
        let apiserver_kubelet_client = ca.issue(
            dir,
            "apiserver-kubelet-client",
            &Subject {
                common_name: "kube-apiserver-kubelet-client",
                organizations: &["system:masters"],
            },
            Usage::Client,
        )?;
        let front_proxy_client = front_proxy.issue(
            dir,
            "front-proxy-client",
            &Subject {
                common_name: "front-proxy-client",
                organizations: &[],
            },
            Usage::Client,
        )?;
        let sa = KeyPair::generate()?;
        let service_account_key = dir.join("sa.key");
        let service_account_pub = dir.join("sa.pub");
        write_file(&service_account_key, &sa.serialize_pem(), 0o600)?;
        write_file(&service_account_pub, &sa.public_key_pem(), 0o644)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            ca,
            front_proxy_ca: front_proxy.cert,
            apiserver,
            apiserver_kubelet_client,
            front_proxy_client,
            service_account_key,
            service_account_pub,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cluster CA (`ca.crt`, `ca.key`).
    pub fn ca(&self) -> &Credential {
        &self.ca.cert
    }

    /// A client certificate `<name>.crt` for `subject`, signed by the cluster CA.
    pub fn client(&self, name: &str, subject: &Subject<'_>) -> Result<Credential, PkiError> {
        self.ca.issue(&self.dir, name, subject, Usage::Client)
    }

    /// A serving certificate `<name>.crt` for `names` (DNS names or addresses), signed by the
    /// cluster CA.
    pub fn server(
        &self,
        name: &str,
        subject: &Subject<'_>,
        names: &[String],
    ) -> Result<Credential, PkiError> {
        self.ca
            .issue(&self.dir, name, subject, Usage::ServerAndClient(names))
    }
}

/// A kubeconfig for `server` that trusts `ca_pem` and authenticates with `client`'s
/// certificate, as kubeadm writes them (`admin.conf`, `kubelet.conf`, ...).
pub fn kubeconfig(server: &str, ca_pem: &str, user: &str, client: &Credential) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: localcluster
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: {user}
  user:
    client-certificate-data: {cert}
    client-key-data: {key}
contexts:
- name: {user}@localcluster
  context:
    cluster: localcluster
    user: {user}
    namespace: default
current-context: {user}@localcluster
",
        ca = b64(ca_pem),
        cert = b64(&client.cert_pem),
        key = b64(&client.key_pem),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_and_a_kubeconfig() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::create(dir.path(), &["127.0.0.1".parse().unwrap()]).unwrap();
        for file in [
            "ca.crt",
            "ca.key",
            "front-proxy-ca.crt",
            "apiserver.crt",
            "apiserver-kubelet-client.key",
            "front-proxy-client.crt",
            "sa.key",
            "sa.pub",
        ] {
            assert!(dir.path().join(file).exists(), "{file}");
        }
        let mode = |f: &str| {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::metadata(dir.path().join(f))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("ca.key"), 0o600);
        assert_eq!(mode("ca.crt"), 0o644);
        let admin = pki
            .client(
                "admin",
                &Subject {
                    common_name: "kubernetes-admin",
                    organizations: &["system:masters"],
                },
            )
            .unwrap();
        let kc = kubeconfig("https://127.0.0.1:1", &pki.ca().cert_pem, "admin", &admin);
        let parsed: serde_json::Value = serde_saphyr::from_str(&kc).unwrap();
        assert_eq!(parsed["users"][0]["name"], "admin");
        assert!(
            parsed["users"][0]["user"]["client-key-data"]
                .as_str()
                .is_some()
        );
    }
}
