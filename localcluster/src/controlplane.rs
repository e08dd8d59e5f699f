//! The upstream Kubernetes control plane as child processes: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kube-proxy, all from the one `kube` binary that
//! `localcluster/upstream/build.sh` builds from pinned Go modules. This module only chooses
//! their flags, writes their certificates and kubeconfigs, and supervises them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::pki::{self, Credential, Pki, Subject};

/// The Service network (kube-apiserver's `--service-cluster-ip-range`); the `kubernetes`
/// Service gets its first address.
/// kube-apiserver's audit policy: every write (who, verb, object, response code) at the
/// `Metadata` level, nothing else, so `logs/kube-apiserver-audit.log` answers "who wrote
/// this" and the API-economy benchmark counts each component's writes. Pod creates carry their
/// request too: a pod created with `generateName` has no name in its entry, and the
/// start-latency benchmark finds each launcher pod's creation by its `generateName`.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Request
  verbs: [create]
  resources: [{group: '', resources: [pods]}]
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
";
const AUDIT_POLICY_FILE: &str = "audit-policy.yaml";

/// The audit log of the cluster in `dir`: one JSON event per write.
pub fn audit_log(dir: &Path) -> std::path::PathBuf {
    dir.join("logs/kube-apiserver-audit.log")
}

pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The `kubernetes` Service's cluster IP.
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
/// The pod network: node `i` gets `10.244.<i>.0/24`.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// What service-account tokens name as their issuer (kubeadm's default).
pub const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

/// Why the control plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error("certificates")]
    Pki(#[from] pki::PkiError),
    #[error("creating {path}")]
    Dir {
        path: String,
        source: std::io::Error,
    },
    #[error("finding a free port")]
    Port(#[source] std::io::Error),
    #[error("starting {component} ({binary})")]
    Spawn {
        component: &'static str,
        binary: String,
        source: std::io::Error,
    },
    #[error("{component} exited ({status}); the end of its log {log}:\n{tail}")]
    Exited {
        component: &'static str,
        status: std::process::ExitStatus,
        log: String,
        tail: String,
    },
    #[error("no component {name} runs (running: {running})")]
    NoSuchComponent { name: String, running: String },
    #[error("the control plane was not ready within {0:?}; see {1}")]
    NotReady(Duration, String),
    #[error(
        "the upstream binary: `{script}` failed ({status}); run it by hand to see why, or set LOCALCLUSTER_KUBE to a built `kube`"
    )]
    Build {
        script: String,
        status: std::process::ExitStatus,
    },
    #[error("running {script}")]
    BuildSpawn {
        script: String,
        source: std::io::Error,
    },
    #[error("probing kube-apiserver: {0}")]
    Tls(String),
    #[error("the kubeconfig")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("building a client")]
    Client(#[from] kube::Error),
}

/// The Kubernetes release the control plane is built from, as `upstream/go.mod` pins it
/// (`v1.37.2`): what our kubelet reports as its version, so version-skew checks pass.
pub fn upstream_version() -> &'static str {
    include_str!("../upstream/go.mod")
        .lines()
        .find_map(|l| l.trim().strip_prefix("k8s.io/kubernetes "))
        .map_or("v0.0.0", str::trim)
}

/// The `kube` multi-call binary: `$LOCALCLUSTER_KUBE`, else what `upstream/build.sh` builds
/// (cached by its pinned inputs, so this is quick after the first build).
pub fn kube_binary() -> Result<PathBuf, ControlPlaneError> {
    if let Some(path) = std::env::var_os("LOCALCLUSTER_KUBE") {
        return Ok(PathBuf::from(path));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("upstream/build.sh");
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| ControlPlaneError::BuildSpawn {
            script: script.display().to_string(),
            source,
        })?;
    if !out.status.success() {
        return Err(ControlPlaneError::Build {
            script: script.display().to_string(),
            status: out.status,
        });
    }
    Ok(PathBuf::from(
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    ))
}

/// Which components run, and where.
#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    /// State: certificates, kubeconfigs, etcd's data, every component's log.
    pub dir: PathBuf,
    /// The `kube` binary ([`kube_binary`]).
    pub kube: PathBuf,
    /// Where kube-apiserver listens (`--bind-address`).
    pub bind: IpAddr,
    /// Its port; 0 picks a free one.
    pub port: u16,
    /// Where pods and kubelets reach it (`--advertise-address`, the `kubernetes` Service's
    /// endpoint).
    pub advertise: IpAddr,
    pub controller_manager: bool,
    pub scheduler: bool,
    /// Run kube-proxy (nftables mode) as this node, once [`ControlPlane::start_proxy`] is
    /// called. It programs the host's network namespace, which every simulated node shares, so
    /// one is enough, and two control planes on one machine must not both run one.
    pub proxy_node: Option<String>,
}

impl ControlPlaneConfig {
    /// etcd and kube-apiserver (free port, on every address, advertised at the machine's
    /// address) plus kube-controller-manager and kube-scheduler; no kube-proxy.
    pub fn new(dir: &Path, kube: PathBuf) -> Self {
        Self {
            dir: dir.to_path_buf(),
            kube,
            bind: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            port: 0,
            advertise: crate::kubelet::node::host_ip()
                .parse()
                .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            controller_manager: true,
            scheduler: true,
            proxy_node: None,
        }
    }
}

/// One running component, killed when dropped.
#[derive(Debug)]
pub struct Component {
    name: &'static str,
    child: Child,
    log: PathBuf,
    /// What it was started with, to start it again the same way.
    args: Vec<String>,
}

impl Component {
    /// Starts it, its output in `<log_dir>/<name>.log` (appended to when `again`: a restart
    /// keeps what the previous run said).
    fn spawn(
        binary: &Path,
        name: &'static str,
        args: &[String],
        log_dir: &Path,
        again: bool,
    ) -> Result<Self, ControlPlaneError> {
        let log = log_dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(again)
            .truncate(!again)
            .open(&log)
            .map_err(|source| ControlPlaneError::Dir {
                path: log.display().to_string(),
                source,
            })?;
        let stderr = file.try_clone().map_err(|source| ControlPlaneError::Dir {
            path: log.display().to_string(),
            source,
        })?;
        let mut command = Command::new(binary);
        command
            .arg(name)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(stderr);
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            use std::os::unix::process::CommandExt as _;
            // The component dies with the thread that started it (a test that panics or is
            // killed leaves no control plane behind). Components are started from the
            // caller's thread, never from a blocking-pool thread that may exit while idle.
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().map_err(|source| ControlPlaneError::Spawn {
            component: name,
            binary: binary.display().to_string(),
            source,
        })?;
        tracing::debug!(component = name, pid = child.id(), log = %log.display(), "started");
        Ok(Self {
            name,
            child,
            log,
            args: args.to_vec(),
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> &Path {
        &self.log
    }

    /// An error if it has exited.
    fn check(&mut self) -> Result<(), ControlPlaneError> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(ControlPlaneError::Exited {
                component: self.name,
                status,
                log: self.log.display().to_string(),
                tail: tail(&self.log, 30),
            }),
            _ => Ok(()),
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(i32::MAX));
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The last `lines` lines of `path`.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn free_port(ip: IpAddr) -> Result<u16, ControlPlaneError> {
    crate::ports::free_port(ip).map_err(ControlPlaneError::Port)
}

/// What a kubelet needs to join: its kubeconfig (a `system:node:<name>` client certificate,
/// which the Node authorizer and NodeRestriction know) and a serving certificate for its API.
#[derive(Debug, Clone)]
pub struct NodeCredentials {
    pub kubeconfig: String,
    pub serving: Credential,
    /// The cluster CA: kube-apiserver's client certificate is signed by it.
    pub ca_pem: String,
}

/// Asks kube-apiserver's `/readyz` (open to anyone, as `system:public-info-viewer` allows) over
/// TLS trusting the cluster CA. Not through kube-rs, which logs every 500 of a server that is
/// still starting as an error.
struct ReadyProbe {
    tls: tokio_rustls::TlsConnector,
    address: SocketAddr,
}

impl ReadyProbe {
    fn new(ca_pem: &str, url: &str) -> Result<Self, ControlPlaneError> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject as _;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()).flatten() {
            roots
                .add(cert)
                .map_err(|e| ControlPlaneError::Tls(e.to_string()))?;
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| ControlPlaneError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let address = url
            .trim_start_matches("https://")
            .parse()
            .map_err(|_| ControlPlaneError::Tls(format!("{url} is not https://<ip>:<port>")))?;
        Ok(Self {
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
            address,
        })
    }

    async fn ready(&self) -> bool {
        let status = async {
            let tcp = tokio::net::TcpStream::connect(self.address).await.ok()?;
            let name = rustls::pki_types::ServerName::IpAddress(self.address.ip().into());
            let tls = self.tls.connect(name, tcp).await.ok()?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                    .await
                    .ok()?;
            let connection = tokio::spawn(connection);
            let request = http::Request::get("/readyz")
                .header(http::header::HOST, self.address.to_string())
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .ok()?;
            let status = sender.send_request(request).await.ok()?.status();
            connection.abort();
            Some(status)
        };
        status.await == Some(http::StatusCode::OK)
    }
}

/// Whether kube-proxy has programmed the `kubernetes` Service into the machine's nftables: until
/// then, `10.96.0.1` is routed like any other address (out of the machine, to whatever answers
/// there).
async fn kubernetes_service_programmed() -> bool {
    let listed = tokio::process::Command::new("nft")
        .args(["list", "map", "ip", "kube-proxy", "service-ips"])
        .stderr(Stdio::null())
        .output()
        .await;
    listed.is_ok_and(|out| {
        String::from_utf8_lossy(&out.stdout)
            .contains(&format!("{KUBERNETES_SERVICE_IP} . tcp . 443"))
    })
}

/// A running control plane; dropping it kills every component (and removes kube-proxy's
/// tables).
#[derive(Debug)]
pub struct ControlPlane {
    config: ControlPlaneConfig,
    pki: Pki,
    url: String,
    admin_kubeconfig: String,
    /// Started in order (etcd first); stopped in reverse.
    components: Vec<Component>,
}

/// How long kube-apiserver may take to answer `/readyz` (about 4 s on an idle 2-core machine;
/// much longer while the machine builds).
const READY_TIMEOUT: Duration = Duration::from_mins(3);

impl ControlPlane {
    /// Writes the certificates and kubeconfigs, starts etcd and kube-apiserver, waits until
    /// the API server is ready (RBAC bootstrapped), then starts the other components. With the
    /// controller manager, it also waits for the `default` namespace's service account, without
    /// which no pod can be created there.
    pub async fn start(config: ControlPlaneConfig) -> Result<Self, ControlPlaneError> {
        let dir = &config.dir;
        let mkdir = |path: &Path| {
            std::fs::create_dir_all(path).map_err(|source| ControlPlaneError::Dir {
                path: path.display().to_string(),
                source,
            })
        };
        let pki_dir = dir.join("pki");
        let logs = dir.join("logs");
        let etcd_dir = dir.join("etcd");
        for d in [dir, &pki_dir, &logs] {
            mkdir(d)?;
        }
        // Every start is a new cluster (as `up` always was): stale etcd data would hold
        // objects signed by a previous CA.
        let _ = std::fs::remove_dir_all(&etcd_dir);
        let mut addresses = vec![
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V4(KUBERNETES_SERVICE_IP),
            config.advertise,
        ];
        if !config.bind.is_unspecified() {
            addresses.push(config.bind);
        }
        let pki = Pki::create(&pki_dir, &addresses)?;
        pki::write_file(&dir.join(AUDIT_POLICY_FILE), AUDIT_POLICY, 0o644)?;
        let port = match config.port {
            0 => free_port(config.bind)?,
            p => p,
        };
        let host = if config.bind.is_unspecified() {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else {
            config.bind
        };
        let url = format!("https://{}", SocketAddr::new(host, port));
        let kubeconfig = |name: &str, common_name: &str, orgs: &[&str]| {
            let client = pki.client(
                name,
                &Subject {
                    common_name,
                    organizations: orgs,
                },
            )?;
            let text = pki::kubeconfig(&url, &pki.ca().cert_pem, common_name, &client);
            let path = dir.join(format!("{name}.conf"));
            pki::write_file(&path, &text, 0o600)?;
            Ok::<_, ControlPlaneError>((text, path))
        };
        let (admin_kubeconfig, _) = kubeconfig("admin", "kubernetes-admin", &["system:masters"])?;

        let (controller_manager_conf, scheduler_conf) = (
            kubeconfig("controller-manager", "system:kube-controller-manager", &[])?.1,
            kubeconfig("scheduler", "system:kube-scheduler", &[])?.1,
        );
        kubeconfig("proxy", "system:kube-proxy", &[])?;
        let mut plane = Self {
            config: config.clone(),
            url: url.clone(),
            admin_kubeconfig,
            components: Vec::new(),
            pki,
        };
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let (client_port, peer_port) = (free_port(loopback)?, free_port(loopback)?);
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        plane.spawn(
            "etcd",
            &[
                "--name=localcluster".into(),
                format!("--data-dir={}", etcd_dir.display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=localcluster={peer_url}"),
                // A throw-away cluster: losing the last writes in a machine crash is fine,
                // an fsync per write is not (it dominates on slow disks).
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ],
        )?;
        let apiserver_args = plane.apiserver_args(port, &etcd_url);
        plane.spawn("kube-apiserver", &apiserver_args)?;
        plane.wait_ready().await?;

        if config.controller_manager {
            let path = &controller_manager_conf;
            let pki = &plane.pki;
            let args = vec![
                format!("--kubeconfig={}", path.display()),
                format!("--authentication-kubeconfig={}", path.display()),
                format!("--authorization-kubeconfig={}", path.display()),
                "--secure-port=0".into(),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=true".into(),
                "--controllers=*,bootstrapsigner,tokencleaner".into(),
                format!(
                    "--service-account-private-key-file={}",
                    pki.service_account_key.display()
                ),
                format!("--root-ca-file={}", pki.ca().cert_path.display()),
                format!(
                    "--cluster-signing-cert-file={}",
                    pki.ca().cert_path.display()
                ),
                format!("--cluster-signing-key-file={}", pki.ca().key_path.display()),
                format!("--cluster-cidr={CLUSTER_CIDR}"),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--cluster-name=localcluster".into(),
            ];
            plane.spawn("kube-controller-manager", &args)?;
        }
        if config.scheduler {
            let path = &scheduler_conf;
            let args = vec![
                format!("--kubeconfig={}", path.display()),
                format!("--authentication-kubeconfig={}", path.display()),
                format!("--authorization-kubeconfig={}", path.display()),
                "--secure-port=0".into(),
                "--leader-elect=false".into(),
            ];
            plane.spawn("kube-scheduler", &args)?;
        }
        if config.controller_manager {
            plane.wait_for_default_service_account().await?;
        }
        Ok(plane)
    }

    /// Starts kube-proxy as `config.proxy_node` (nothing without one) and waits until it has
    /// programmed the `kubernetes` Service. Call it once that node's kubelet has registered:
    /// kube-proxy takes its node's addresses at start (loopback if the Node does not exist
    /// within 30 s) and exits when they change, as it expects its DaemonSet to restart it.
    pub async fn start_proxy(&mut self) -> Result<(), ControlPlaneError> {
        let Some(node) = self.config.proxy_node.clone() else {
            return Ok(());
        };
        let path = self.config.dir.join("proxy.conf");
        let args = vec![
            format!("--kubeconfig={}", path.display()),
            "--proxy-mode=nftables".into(),
            format!("--cluster-cidr={CLUSTER_CIDR}"),
            format!("--hostname-override={node}"),
            "--healthz-bind-address=127.0.0.1:10256".into(),
            "--metrics-bind-address=127.0.0.1:10249".into(),
        ];
        // Tables a kube-proxy killed earlier left would pass the check below too.
        self.clean_up_proxy_tables();
        self.spawn("kube-proxy", &args)?;
        self.wait_for("kube-proxy", kubernetes_service_programmed)
            .await
    }

    fn apiserver_args(&self, port: u16, etcd_url: &str) -> Vec<String> {
        let pki = &self.pki;
        let c = &self.config;
        let p = |path: &Path| path.display().to_string();
        vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={}", c.bind),
            format!("--secure-port={port}"),
            format!("--advertise-address={}", c.advertise),
            format!("--cert-dir={}", p(&pki.dir().join("apiserver-generated"))),
            format!("--tls-cert-file={}", p(&pki.apiserver.cert_path)),
            format!("--tls-private-key-file={}", p(&pki.apiserver.key_path)),
            format!("--client-ca-file={}", p(&pki.ca().cert_path)),
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--allow-privileged=true".into(),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            format!("--service-account-issuer={SERVICE_ACCOUNT_ISSUER}"),
            format!("--service-account-key-file={}", p(&pki.service_account_pub)),
            format!(
                "--service-account-signing-key-file={}",
                p(&pki.service_account_key)
            ),
            format!(
                "--kubelet-client-certificate={}",
                p(&pki.apiserver_kubelet_client.cert_path)
            ),
            format!(
                "--kubelet-client-key={}",
                p(&pki.apiserver_kubelet_client.key_path)
            ),
            format!("--kubelet-certificate-authority={}", p(&pki.ca().cert_path)),
            "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            format!(
                "--proxy-client-cert-file={}",
                p(&pki.front_proxy_client.cert_path)
            ),
            format!(
                "--proxy-client-key-file={}",
                p(&pki.front_proxy_client.key_path)
            ),
            format!(
                "--requestheader-client-ca-file={}",
                p(&pki.front_proxy_ca.cert_path)
            ),
            "--requestheader-allowed-names=front-proxy-client".into(),
            "--requestheader-username-headers=X-Remote-User".into(),
            "--requestheader-group-headers=X-Remote-Group".into(),
            "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
            "--enable-aggregator-routing=true".into(),
            "--profiling=false".into(),
            format!("--audit-policy-file={}", p(&c.dir.join(AUDIT_POLICY_FILE))),
            format!("--audit-log-path={}", p(&audit_log(&c.dir))),
            "--audit-log-format=json".into(),
            "--audit-log-maxsize=100".into(),
            "--audit-log-maxbackup=1".into(),
        ]
    }

    fn spawn(&mut self, name: &'static str, args: &[String]) -> Result<(), ControlPlaneError> {
        let component = Component::spawn(
            &self.config.kube,
            name,
            args,
            &self.config.dir.join("logs"),
            false,
        )?;
        self.components.push(component);
        Ok(())
    }

    /// Kills a component (SIGKILL, as a crash or an OOM kill would) and starts it again with
    /// the same flags, as the kubelet restarts a static pod; for kube-apiserver, returns once
    /// it is ready again. Everything else keeps running: clients and watches meet the outage
    /// and must recover by themselves. Answers the new pid.
    pub async fn restart(&mut self, name: &str) -> Result<u32, ControlPlaneError> {
        let index = self
            .components
            .iter()
            .position(|c| c.name == name)
            .ok_or_else(|| ControlPlaneError::NoSuchComponent {
                name: name.to_owned(),
                running: self
                    .components
                    .iter()
                    .map(|c| c.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        let old = &mut self.components[index];
        let _ = old.child.kill();
        let _ = old.child.wait();
        let (component, args) = (old.name, old.args.clone());
        if component == "kube-proxy" {
            self.clean_up_proxy_tables();
        }
        let new = Component::spawn(
            &self.config.kube,
            component,
            &args,
            &self.config.dir.join("logs"),
            true,
        )?;
        let pid = new.pid();
        self.components[index] = new;
        tracing::info!(component, pid, "restarted");
        match component {
            "kube-apiserver" => self.wait_ready().await?,
            "kube-proxy" => {
                self.wait_for("kube-proxy", kubernetes_service_programmed)
                    .await?;
            }
            _ => {}
        }
        Ok(pid)
    }

    /// An error naming the first component that has exited.
    pub fn check(&mut self) -> Result<(), ControlPlaneError> {
        self.components.iter_mut().try_for_each(Component::check)
    }

    async fn wait_ready(&mut self) -> Result<(), ControlPlaneError> {
        let probe = ReadyProbe::new(&self.pki.ca().cert_pem, &self.url)?;
        let started = Instant::now();
        self.wait_for("kube-apiserver", || probe.ready()).await?;
        tracing::info!(elapsed = ?started.elapsed(), url = %self.url, "kube-apiserver ready");
        Ok(())
    }

    async fn wait_for_default_service_account(&mut self) -> Result<(), ControlPlaneError> {
        let accounts: kube::Api<k8s_openapi::api::core::v1::ServiceAccount> =
            kube::Api::namespaced(self.client().await?, "default");
        self.wait_for("kube-controller-manager", || async {
            accounts.get_opt("default").await.ok().flatten().is_some()
        })
        .await
    }

    /// Polls `ready` until it holds; fails when a component exits or after [`READY_TIMEOUT`],
    /// naming the log of `component`, the one expected to make it hold.
    async fn wait_for<F, Fut>(
        &mut self,
        component: &str,
        mut ready: F,
    ) -> Result<(), ControlPlaneError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let started = Instant::now();
        loop {
            self.check()?;
            if ready().await {
                return Ok(());
            }
            if started.elapsed() > READY_TIMEOUT {
                let log = self.config.dir.join(format!("logs/{component}.log"));
                return Err(ControlPlaneError::NotReady(
                    READY_TIMEOUT,
                    log.display().to_string(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// kube-apiserver's URL (`https://127.0.0.1:<port>`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A kubeconfig (YAML) for the cluster administrator (`system:masters`).
    pub fn kubeconfig(&self) -> &str {
        &self.admin_kubeconfig
    }

    /// Where the administrator's kubeconfig is (`<dir>/admin.conf`).
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.config.dir.join("admin.conf")
    }

    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    pub fn components(&self) -> &[Component] {
        &self.components
    }

    /// A kube-rs client authenticated as the administrator.
    pub async fn client(&self) -> Result<kube::Client, ControlPlaneError> {
        client_for(&self.admin_kubeconfig).await
    }

    /// The state directory (`ControlPlaneConfig::dir`).
    pub fn dir(&self) -> &Path {
        &self.config.dir
    }

    /// A kubeconfig for `user` (no groups) with a new client certificate `pki/<name>.crt`,
    /// also written to `<dir>/<name>.conf`, as the components' are.
    pub fn user_kubeconfig(&self, name: &str, user: &str) -> Result<String, ControlPlaneError> {
        let client = self.pki.client(
            name,
            &Subject {
                common_name: user,
                organizations: &[],
            },
        )?;
        let text = pki::kubeconfig(&self.url, &self.pki.ca().cert_pem, user, &client);
        pki::write_file(&self.config.dir.join(format!("{name}.conf")), &text, 0o600)?;
        Ok(text)
    }

    /// Credentials for a kubelet named `node` serving its API at `address`.
    pub fn node_credentials(
        &self,
        node: &str,
        address: IpAddr,
    ) -> Result<NodeCredentials, ControlPlaneError> {
        let user = format!("system:node:{node}");
        let client = self.pki.client(
            &format!("kubelet-{node}-client"),
            &Subject {
                common_name: &user,
                organizations: &["system:nodes"],
            },
        )?;
        let serving = self.pki.server(
            &format!("kubelet-{node}-server"),
            &Subject {
                common_name: &user,
                organizations: &["system:nodes"],
            },
            &[address.to_string(), node.to_string()],
        )?;
        Ok(NodeCredentials {
            kubeconfig: pki::kubeconfig(&self.url, &self.pki.ca().cert_pem, &user, &client),
            serving,
            ca_pem: self.pki.ca().cert_pem.clone(),
        })
    }

    /// Stops every component, the last started first, each with a grace period.
    pub fn stop(mut self) {
        let proxy = self.runs_proxy();
        while let Some(mut c) = self.components.pop() {
            c.stop(Duration::from_secs(10));
        }
        if proxy {
            self.clean_up_proxy_tables();
        }
    }

    fn runs_proxy(&self) -> bool {
        self.components.iter().any(|c| c.name == "kube-proxy")
    }

    /// Removes kube-proxy's nftables tables, which outlive it and would keep sending Service
    /// addresses such as 10.96.0.1 to this control plane's dead ports.
    fn clean_up_proxy_tables(&self) {
        let cleaned = Command::new(&self.config.kube)
            .args(["kube-proxy", "--cleanup", "--proxy-mode=nftables"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !cleaned.is_ok_and(|s| s.success()) {
            tracing::warn!("kube-proxy --cleanup failed: its nftables tables may remain");
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let proxy = self.runs_proxy();
        // The last started first; each is killed as it is dropped.
        while let Some(c) = self.components.pop() {
            drop(c);
        }
        if proxy {
            self.clean_up_proxy_tables();
        }
    }
}

/// A kube-rs client from a kubeconfig's text.
pub async fn client_for(kubeconfig: &str) -> Result<kube::Client, ControlPlaneError> {
    let kc = kube::config::Kubeconfig::from_yaml(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await?;
    Ok(kube::Client::try_from(config)?)
}

/// A control plane in a temporary directory, for tests: etcd, kube-apiserver,
/// kube-controller-manager and, when asked, kube-scheduler (without it, tests bind pods
/// themselves); no kube-proxy. Killed and removed when dropped.
#[derive(Debug)]
pub struct TestControlPlane {
    plane: ControlPlane,
    dir: tempfile::TempDir,
}

impl TestControlPlane {
    /// Starts one; panics with the reason (and the component's log) if it cannot.
    pub async fn start(scheduler: bool) -> Self {
        Self::start_with(|config| config.scheduler = scheduler).await
    }

    /// Starts one after `adjust` changed the configuration (kube-proxy, ...).
    pub async fn start_with(adjust: impl FnOnce(&mut ControlPlaneConfig)) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("localcluster-test-")
            .tempdir()
            .expect("a temporary directory");
        let kube = kube_binary().unwrap_or_else(|e| panic!("{}", error_chain(&e)));
        let mut config = ControlPlaneConfig::new(dir.path(), kube);
        config.scheduler = false;
        adjust(&mut config);
        let plane = ControlPlane::start(config)
            .await
            .unwrap_or_else(|e| panic!("starting the control plane: {}", error_chain(&e)));
        Self { plane, dir }
    }

    /// An administrator's client.
    pub async fn client(&self) -> kube::Client {
        self.plane.client().await.expect("an admin client")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl std::ops::Deref for TestControlPlane {
    type Target = ControlPlane;

    fn deref(&self) -> &ControlPlane {
        &self.plane
    }
}

impl std::ops::DerefMut for TestControlPlane {
    fn deref_mut(&mut self) -> &mut ControlPlane {
        &mut self.plane
    }
}

/// The kubelet's part of a Node for kube-controller-manager: a Ready condition and its Lease
/// in `kube-node-lease`, renewed every 10 s. Without them, the node-lifecycle controller marks
/// the Node Unknown about 50 s after it appears, taints it (the scheduler then leaves it
/// alone), marks its pods not ready and, 5 minutes later, evicts them. Renewal stops on drop.
#[derive(Debug)]
pub struct NodeHeartbeat(tokio::task::JoinHandle<()>);

impl Drop for NodeHeartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Creates `node` (any status in it is replaced), reports it Ready with `resources` as its
/// capacity and allocatable (none when `Value::Null`), and keeps its Lease fresh.
/// For tests.
pub async fn ready_node(
    client: &kube::Client,
    node: serde_json::Value,
    resources: serde_json::Value,
) -> NodeHeartbeat {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(node).expect("the test node");
    let name = nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("the test node")
        .metadata
        .name
        .expect("the test node");
    let now = Time(Timestamp::now());
    let mut status = json!({"conditions": [{
        "type": "Ready", "status": "True", "reason": "KubeletReady",
        "message": "the test is posting ready status for this node",
        "lastHeartbeatTime": now, "lastTransitionTime": now,
    }]});
    if !resources.is_null() {
        status["capacity"] = resources.clone();
        status["allocatable"] = resources;
    }
    nodes
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .expect("the test node");
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": 40,
            "renewTime": MicroTime(Timestamp::now()),
        },
    }))
    .expect("the test node");
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("the test node");
    NodeHeartbeat(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            let renew = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
            if let Err(e) = leases
                .patch(&name, &PatchParams::default(), &Patch::Merge(renew))
                .await
            {
                tracing::warn!(node = %name, error = %e, "renewing the node's lease");
            }
        }
    }))
}

/// Creates every `kubevirt.io` CRD (the `api` crate's, which `manifests/crds/` holds) and
/// returns once each kind is served: a list of it succeeds. For tests.
pub async fn install_crds(client: &kube::Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut kinds = Vec::new();
    for crd in api::crds::crds() {
        let created = crds
            .create(&PostParams::default(), &crd)
            .await
            .expect("creating a CRD");
        let spec = created.spec;
        for version in spec.versions.iter().filter(|v| v.served) {
            let gvk = GroupVersionKind::gvk(&spec.group, &version.name, &spec.names.kind);
            kinds.push(ApiResource::from_gvk_with_plural(&gvk, &spec.names.plural));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for kind in kinds {
        let all: Api<DynamicObject> = Api::all_with(client.clone(), &kind);
        while all.list(&kube::api::ListParams::default()).await.is_err() {
            assert!(Instant::now() < deadline, "{} is never served", kind.plural);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// An error with its sources, `: `-separated, for logs and panics.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
