//! Shared helpers: a real virt-launcher rooted in a temp dir, the test guest's files.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};

/// Boot deadlines are generous: TCG on a loaded two-core machine.
pub const BOOT: Duration = Duration::from_mins(4);

/// The virt-launcher binary: `$VIRT_LAUNCHER_BIN`, else next to this test's target dir
/// (`cargo build -p launcher --bin virt-launcher` with the same `CARGO_TARGET_DIR`).
pub fn launcher_bin() -> PathBuf {
    workspace_bin("virt-launcher", "VIRT_LAUNCHER_BIN", "launcher")
}

/// A binary of another workspace package: `$<env>`, else next to this test's target dir
/// (`cargo build -p <package> --bin <name>` with the same `CARGO_TARGET_DIR`).
pub fn workspace_bin(name: &str, env: &str, package: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test exe path");
    let p = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build -p {package} --bin {name}` with the same \
         CARGO_TARGET_DIR, or set {env}",
        p.display()
    );
    p
}

pub fn guest_file(name: &str) -> PathBuf {
    let p = testguest::dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run hack/guest/build.sh (or set KUBEVIRT_RS_GUEST_DIR)",
        p.display()
    );
    p
}

/// A launcher process whose every directory flag points into its own temp dir. Dropping it
/// kills the launcher (and its QEMU, which dies with it through PR_SET_PDEATHSIG).
#[derive(Debug)]
pub struct Launcher {
    pub root: tempfile::TempDir,
    pub child: Child,
    pub socket: PathBuf,
}

impl Launcher {
    pub fn start(with_kernel: bool) -> Self {
        let root = tempfile::Builder::new()
            .prefix("handler-test")
            .tempdir()
            .expect("tempdir");
        let r = root.path();
        for d in [
            "share",
            "private",
            "ephemeral",
            "container-disks",
            "hotplug",
        ] {
            std::fs::create_dir_all(r.join(d)).expect("mkdir");
        }
        if with_kernel {
            let kb = r.join("container-disks/kernel-boot");
            std::fs::create_dir_all(&kb).expect("mkdir");
            std::fs::copy(guest_file("vmlinuz"), kb.join("vmlinuz")).expect("copy kernel");
            std::fs::copy(guest_file("initrd.img"), kb.join("initrd.img")).expect("copy initrd");
        }
        let log = std::fs::File::create(r.join("launcher.log")).expect("log");
        let arg = |d: &str| r.join(d).display().to_string();
        let child = Command::new(launcher_bin())
            .args(["--kubevirt-share-dir", &arg("share")])
            .args(["--private-dir", &arg("private")])
            .args(["--ephemeral-disk-dir", &arg("ephemeral")])
            .args(["--container-disk-dir", &arg("container-disks")])
            .args(["--hotplug-disk-dir", &arg("hotplug")])
            .args(["--allow-emulation", "--qemu-timeout", "120s"])
            .args(["--grace-period-seconds", "60"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn virt-launcher");
        let socket = r.join("share/sockets/launcher-sock");
        let l = Launcher {
            root,
            child,
            socket,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !l.socket.exists() {
            assert!(
                Instant::now() < deadline,
                "launcher socket never appeared\n{}",
                l.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        l
    }

    pub fn private_dir(&self) -> PathBuf {
        self.root.path().join("private")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.path().join("launcher.log")).unwrap_or_default()
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A VMI that boots the test guest's kernel and initrd (kernelBoot container files).
pub fn kernel_vmi(name: &str, uid: &str) -> api::VirtualMachineInstance {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {
            "domain": {
                "resources": {"requests": {"memory": "256Mi"}},
                "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                    "image": "guest", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}},
                "devices": {},
            },
        },
    }))
    .expect("valid VMI")
}

/// A VMI in `phase` whose `conds` are True, as the console server's lookup sees it.
pub fn vmi_with_conditions(
    name: &str,
    uid: &str,
    phase: api::VirtualMachineInstancePhase,
    conds: &[api::status::VirtualMachineInstanceConditionType],
) -> api::VirtualMachineInstance {
    let mut v = api::VirtualMachineInstance::new(name, api::VirtualMachineInstanceSpec::default());
    v.metadata.namespace = Some("default".into());
    v.metadata.uid = Some(uid.into());
    v.status = Some(api::VirtualMachineInstanceStatus {
        phase: Some(phase),
        conditions: conds
            .iter()
            .map(|c| api::status::Condition {
                type_: c.clone(),
                status: api::ConditionStatus::True,
                last_probe_time: None,
                last_transition_time: None,
                reason: None,
                message: None,
            })
            .collect(),
        ..Default::default()
    });
    v
}

/// What the console server looks up for a Running VMI `name` whose domain `launcher` runs, with
/// `conds` True.
pub fn running_target(
    launcher: &Launcher,
    name: &str,
    uid: &str,
    conds: &[api::status::VirtualMachineInstanceConditionType],
) -> handler::server::Target {
    let vm_dir = launcher.private_dir().join(uid);
    handler::server::Target {
        vmi: std::sync::Arc::new(vmi_with_conditions(
            name,
            uid,
            api::VirtualMachineInstancePhase::Running,
            conds,
        )),
        launcher_socket: launcher.socket.clone(),
        serial_socket: vm_dir.join("virt-serial0"),
        vnc_socket: vm_dir.join("virt-vnc"),
        launcher_pid: None,
    }
}

/// A local control plane (localcluster's upstream etcd, kube-apiserver and
/// kube-controller-manager) with our CRDs and the Node `node` for a `virt-handler` process: its
/// admin kubeconfig is `kubeconfig`; `dir` roots the handler's host paths.
pub struct HandlerCluster {
    pub server: localcluster::controlplane::TestControlPlane,
    pub dir: tempfile::TempDir,
    pub kubeconfig: PathBuf,
    pub client: kube::Client,
}

impl HandlerCluster {
    pub async fn start(node: &str) -> Self {
        let server = localcluster::controlplane::TestControlPlane::start(false).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let kubeconfig = server.kubeconfig_path();
        let client = server.client().await;
        localcluster::controlplane::install_crds(&client).await;
        let mut n = k8s_openapi::api::core::v1::Node::default();
        n.metadata.name = Some(node.into());
        kube::Api::all(client.clone())
            .create(&kube::api::PostParams::default(), &n)
            .await
            .expect("create node");
        Self {
            server,
            dir,
            kubeconfig,
            client,
        }
    }
}

/// Creates the Node `name`, reports it Ready and keeps its Lease fresh.
pub async fn ready_node(
    client: &kube::Client,
    name: &str,
) -> localcluster::controlplane::NodeHeartbeat {
    localcluster::controlplane::ready_node(
        client,
        serde_json::json!({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}),
        serde_json::Value::Null,
    )
    .await
}

/// The kubelet's device-plugin registration endpoint on `<dir>/kubelet.sock`: accepts every
/// plugin and reports its resource name.
pub fn fake_kubelet(
    dir: &Path,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    use handler::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
    use handler::deviceplugin::v1beta1::{Empty, RegisterRequest};

    struct Kubelet(tokio::sync::mpsc::UnboundedSender<String>);

    #[tonic::async_trait]
    impl Registration for Kubelet {
        async fn register(
            &self,
            req: tonic::Request<RegisterRequest>,
        ) -> Result<tonic::Response<Empty>, tonic::Status> {
            let _ = self.0.send(req.into_inner().resource_name);
            Ok(tonic::Response::new(Empty {}))
        }
    }

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let listener =
        tokio::net::UnixListener::bind(dir.join("kubelet.sock")).expect("bind kubelet.sock");
    let incoming = futures::stream::unfold(listener, |l| async move {
        Some((l.accept().await.map(|(s, _)| s), l))
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Kubelet(tx)))
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned()),
    );
    rx
}

pub fn free_port() -> u16 {
    localcluster::ports::free_port(std::net::Ipv4Addr::LOCALHOST.into()).expect("a free port")
}

/// A test CA (rcgen), as virt-operator's self-signed one.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate the CA signed, as PEM (for files) and DER (for rustls).
pub struct Leaf {
    pub cert: CertificateDer<'static>,
    pub cert_pem: String,
    pub key_pem: String,
    pub key: PrivateKeyDer<'static>,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_owned());
        let issuer =
            CertifiedIssuer::self_signed(p, KeyPair::generate().expect("key")).expect("CA");
        Ca { issuer }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    pub fn der(&self) -> CertificateDer<'static> {
        self.issuer.der().clone()
    }

    pub fn leaf(&self, names: &[&str], cn: &str) -> Leaf {
        let mut p =
            CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .expect("params");
        p.distinguished_name
            .push(rcgen::DnType::CommonName, cn.to_owned());
        let key = KeyPair::generate().expect("key");
        let cert = p.signed_by(&key, &self.issuer).expect("signed");
        Leaf {
            cert: cert.der().clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        }
    }
}

/// Writes `path` as a Secret volume update does: whole, by rename.
pub fn write_atomically(path: &Path, data: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// Status code and body of an HTTP/1.0 GET on `s`; 0 when no HTTP answer came.
async fn get_over<S>(mut s: S, path: &str) -> (u16, String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    if s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .await
        .is_err()
    {
        return (0, String::new());
    }
    let mut out = Vec::new();
    // What was read before an error (a TLS server hanging up on plain HTTP) is kept.
    let _ = s.read_to_end(&mut out).await;
    let out = String::from_utf8_lossy(&out);
    let code = out
        .strip_prefix("HTTP/")
        .and_then(|r| r.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

/// A plain HTTP/1.0 GET on loopback: status code and body; 0 when nothing listens or no HTTP
/// answer came.
pub async fn http_get(port: u16, path: &str) -> (u16, String) {
    match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => get_over(s, path).await,
        Err(_) => (0, String::new()),
    }
}

/// An HTTPS GET on loopback as Prometheus scrapes, trusting `ca` for `localhost` and offering
/// no client certificate: status code and body; 0 when nothing listens or the handshake fails.
pub async fn https_get(port: u16, ca: &CertificateDer<'static>, path: &str) -> (u16, String) {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).expect("root");
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let Ok(tcp) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return (0, String::new());
    };
    match tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
    {
        Ok(tls) => get_over(tls, path).await,
        Err(_) => (0, String::new()),
    }
}

/// The virt-handler binary as its own process (its log in `<dir>/handler.log`), killed on drop.
/// It is given certificate files from its own CA, as virt-operator's Secret provides them.
pub struct HandlerProcess {
    pub child: Child,
    /// `/metrics` and `/healthz`.
    pub port: u16,
    pub ca: Ca,
    /// `tls.crt`, `tls.key` and `ca.crt`, as the Secret volume holds them.
    pub certs: PathBuf,
}

impl HandlerProcess {
    /// virt-handler for `node` against `kubeconfig`, with the kubelet root `<dir>/kubelet`,
    /// the kubelet's pods dir `pods`, its certificate files written, and `extra` flags.
    pub fn spawn(node: &str, kubeconfig: &Path, dir: &Path, pods: &Path, extra: &[&str]) -> Self {
        let h = Self::spawn_before_certificates(node, kubeconfig, dir, pods, extra);
        h.write_certificates();
        h
    }

    /// The same, with the certificate flags naming files that do not exist yet (an optional
    /// Secret not yet created): [`Self::write_certificates`] writes them.
    pub fn spawn_before_certificates(
        node: &str,
        kubeconfig: &Path,
        dir: &Path,
        pods: &Path,
        extra: &[&str],
    ) -> Self {
        let port = free_port();
        let certs = dir.join("handler-certs");
        std::fs::create_dir_all(&certs).expect("mkdir");
        let child = Command::new(env!("CARGO_BIN_EXE_virt-handler"))
            .args(["--hostname-override", node, "--kubelet-root"])
            .arg(dir.join("kubelet"))
            .args(["--listen-address", "127.0.0.1", "--port", &port.to_string()])
            .args(["--console-server-port", &free_port().to_string()])
            .arg("--kubelet-pods-dir")
            .arg(pods)
            .arg("--tls-cert-file")
            .arg(certs.join("tls.crt"))
            .arg("--tls-key-file")
            .arg(certs.join("tls.key"))
            .arg("--client-ca-file")
            .arg(certs.join("ca.crt"))
            .args(extra)
            .env("KUBECONFIG", kubeconfig)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("handler.log")).expect("handler log"))
            .spawn()
            .expect("spawn virt-handler");
        HandlerProcess {
            child,
            port,
            ca: Ca::new("virt-handler test CA"),
            certs,
        }
    }

    /// The handler's serving certificate for `localhost` and the CA bundle.
    pub fn write_certificates(&self) {
        let leaf = self.ca.leaf(&["localhost"], "virt-handler");
        write_atomically(&self.certs.join("tls.key"), &leaf.key_pem);
        write_atomically(&self.certs.join("tls.crt"), &leaf.cert_pem);
        write_atomically(&self.certs.join("ca.crt"), &self.ca.pem());
    }

    /// `GET path` on the metrics port over HTTPS.
    pub async fn get(&self, path: &str) -> (u16, String) {
        https_get(self.port, &self.ca.der(), path).await
    }

    pub async fn wait_healthy(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while self.get("/healthz").await.0 != 200 {
            assert!(Instant::now() < deadline, "/healthz never 200");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for HandlerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `/proc/<pid>/status` field in KiB (`VmRSS`, `VmHWM`).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// `samples` readings of the process's VmRSS, 1 s apart, printed with its VmHWM.
pub async fn print_rss(pid: u32, what: &str, samples: usize) {
    let mut kib = Vec::new();
    for _ in 0..samples {
        kib.push(status_kib(pid, "VmRSS"));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    #[allow(clippy::cast_precision_loss)] // KiB counts far below 2^52
    let mib = |k: u64| k as f64 / 1024.0;
    // Anonymous memory is the handler's own; file pages are its binary's code and data,
    // which an unoptimised build has several times more of.
    println!(
        "virt-handler binary (pid {pid}), {what}, {samples} samples 1 s apart: VmRSS min {:.1} MiB \
         max {:.1} MiB, VmHWM {:.1} MiB (goal <= 30 MiB); at the end RssAnon {:.1} MiB, \
         RssFile {:.1} MiB",
        mib(*kib.iter().min().expect("samples")),
        mib(*kib.iter().max().expect("samples")),
        mib(status_kib(pid, "VmHWM")),
        mib(status_kib(pid, "RssAnon")),
        mib(status_kib(pid, "RssFile"))
    );
}
