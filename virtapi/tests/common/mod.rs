//! virt-api on the real control plane, without the rest of the stack: localcluster's etcd and
//! kube-apiserver (no controller manager, no scheduler: nothing here needs them) with KubeVirt's
//! CRDs; virt-api run in-process as the binary runs it ([`virtapi::daemon::VirtApi`]) on this
//! host's address, registered with kube-apiserver's aggregation layer by the two APIServices, a
//! selector-less `kubevirt/virt-api` Service and an EndpointSlice naming that address (the
//! control plane runs with `--enable-aggregator-routing`, so kube-apiserver dials the endpoint);
//! a virt-handler console server in-process too (`handler::server`), on another port of this
//! host, found by virt-api through a Running `kubevirt.io=virt-handler` Pod on the VMIs' node
//! whose pod IP is this host. The handler's view of the VMIs is the test's: each VMI's serial
//! socket is a unix socket of the test.
//!
//! Requests go over raw TLS connections ([`Endpoint`]): to kube-apiserver with client
//! certificates from the cluster CA (an administrator in `system:masters`, or any user), or
//! straight to virt-api (with or without the front proxy's certificate).

#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::VirtualMachineInstancePhase as Phase;
use bytes::Bytes;
use handler::server::{Limits, LookupError, Target, Vmis};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use localcluster::controlplane::TestControlPlane;
use localcluster::pki::Subject;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{Value, json};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;

/// The node the test's VMIs run on, and the namespace they live in.
pub const NODE: &str = "node-a";
pub const NS: &str = "default";
/// KubeVirt's install namespace: the virt-api Service and the virt-handler Pod.
pub const KUBEVIRT_NS: &str = "kubevirt";
/// Deadline of every wait for the control plane (generous: two loaded cores).
pub const WAIT: Duration = Duration::from_mins(2);
/// What virt-api's serving certificate names (the APIService's Service), and what
/// kube-apiserver checks it against.
const VIRT_API_NAME: &str = "virt-api.kubevirt.svc";

/// The subresource API's root.
pub fn subresources(version: &str) -> String {
    format!("/apis/{}/{version}", api::subresources::GROUP)
}

/// The path of `what` of the VMI `name` in [`NS`].
pub fn vmi_path(name: &str, what: &str) -> String {
    format!(
        "{}/namespaces/{NS}/virtualmachineinstances/{name}/{what}",
        subresources("v1")
    )
}

/// The path of `what` of the VM `name` in [`NS`].
pub fn vm_path(name: &str, what: &str) -> String {
    format!(
        "{}/namespaces/{NS}/virtualmachines/{name}/{what}",
        subresources("v1")
    )
}

/// The handler's view of the VMIs on its node: what the test registered.
#[derive(Default)]
struct TestVmis(Mutex<HashMap<(String, String), Target>>);

impl Vmis for TestVmis {
    fn lookup(&self, namespace: &str, name: &str) -> Result<Target, LookupError> {
        self.0
            .lock()
            .expect("vmis lock")
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
            .ok_or_else(|| LookupError::NotFound {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })
    }
}

/// One CA for virt-api's serving certificate, virt-handler's, and virt-api's client certificate
/// for virt-handler (as `hack/pki.sh` makes them).
pub struct Certs {
    pub ca_pem: String,
    /// Certificate and key files.
    pub virt_api: (PathBuf, PathBuf),
    pub handler_server: (PathBuf, PathBuf),
    pub handler_client: (PathBuf, PathBuf),
    pub ca_file: PathBuf,
}

impl Certs {
    fn create(dir: &Path) -> Self {
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "kubevirt-rs test CA");
        let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().expect("key")).expect("CA");
        let leaf = |file: &str, names: &[&str], cn: &str| {
            let mut p =
                CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                    .expect("params");
            p.distinguished_name
                .push(rcgen::DnType::CommonName, cn.to_owned());
            let key = KeyPair::generate().expect("key");
            let cert = p.signed_by(&key, &ca).expect("signed");
            let (crt, k) = (
                dir.join(format!("{file}.crt")),
                dir.join(format!("{file}.key")),
            );
            std::fs::write(&crt, cert.pem()).expect("write cert");
            std::fs::write(&k, key.serialize_pem()).expect("write key");
            (crt, k)
        };
        let ca_file = dir.join("ca.crt");
        std::fs::write(&ca_file, ca.pem()).expect("write CA");
        Certs {
            ca_pem: ca.pem(),
            virt_api: leaf(
                "virt-api",
                &[VIRT_API_NAME, "virt-api.kubevirt", "virt-api"],
                "virt-api",
            ),
            handler_server: leaf("virt-handler", &["virt-handler"], "virt-handler"),
            handler_client: leaf("virt-api-client", &[], "virt-api"),
            ca_file,
        }
    }
}

/// The control plane with virt-api registered and a virt-handler console server; everything
/// stops when dropped.
pub struct Cluster {
    pub plane: TestControlPlane,
    /// An administrator's kube-rs client.
    pub client: kube::Client,
    pub dir: tempfile::TempDir,
    /// This host's address, where virt-api and the console server listen.
    pub host: IpAddr,
    pub virt_api: SocketAddr,
    pub handler: SocketAddr,
    /// The CA of virt-api's serving certificate (the APIService's caBundle) and of the
    /// handler's, and the files of each.
    pub certs: Certs,
    vmis: Arc<TestVmis>,
    stop: CancellationToken,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A non-loopback address of this host: kube-apiserver refuses loopback endpoints.
pub fn host_ip() -> IpAddr {
    let ip: IpAddr = localcluster::kubelet::node::host_ip()
        .parse()
        .expect("the host's address");
    assert!(
        !ip.is_loopback(),
        "this host has no default route: kube-apiserver refuses loopback endpoints"
    );
    ip
}

/// Polls `ready` every 100 ms until it holds, or panics naming `what` after [`WAIT`].
pub async fn wait_for<F, Fut>(what: &str, mut ready: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT;
    while !ready().await {
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn object<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("a valid object")
}

impl Cluster {
    pub async fn start() -> Self {
        let plane = TestControlPlane::start_with(|c| {
            c.controller_manager = false;
            c.scheduler = false;
        })
        .await;
        let client = plane.client().await;
        localcluster::controlplane::install_crds(&client).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let host = host_ip();
        let stop = CancellationToken::new();
        let certs = Certs::create(dir.path());
        let pp = PostParams::default();

        Api::<Namespace>::all(client.clone())
            .create(&pp, &object(json!({"metadata": {"name": KUBEVIRT_NS}})))
            .await
            .expect("create the kubevirt namespace");
        // No controller manager creates it: the ServiceAccount admission plugin needs it for
        // the virt-handler Pod.
        Api::<ServiceAccount>::namespaced(client.clone(), KUBEVIRT_NS)
            .create(&pp, &object(json!({"metadata": {"name": "default"}})))
            .await
            .expect("create the default service account");

        // virt-handler's console server, mTLS with virt-api's client certificate.
        let vmis = Arc::new(TestVmis::default());
        let handler_tls = Arc::new(
            tlsconfig::ReloadingConfig::new(tlsconfig::TlsFiles {
                cert: certs.handler_server.0.clone(),
                key: certs.handler_server.1.clone(),
                client_ca: certs.ca_file.clone(),
                client_auth: tlsconfig::ClientAuth::Required,
            })
            .expect("the console server's TLS"),
        );
        let listener = tokio::net::TcpListener::bind((host, 0))
            .await
            .expect("bind the console server");
        let handler = listener.local_addr().expect("addr");
        tokio::spawn(handler::server::serve(
            listener,
            handler_tls,
            handler::server::router(vmis.clone(), Limits::default()),
            stop.clone(),
        ));
        handler_pod(&client, host).await;

        // virt-api, as the binary starts it, with the administrator's client as its identity.
        let virt_api = virtapi::daemon::VirtApi::start(
            client.clone(),
            virtapi::daemon::Config {
                console_server_port: handler.port(),
                tls_cert_file: certs.virt_api.0.clone(),
                tls_key_file: certs.virt_api.1.clone(),
                handler_tls: virtapi::virthandler::HandlerTls {
                    cert: certs.handler_client.0.clone(),
                    key: certs.handler_client.1.clone(),
                    ca: certs.ca_file.clone(),
                },
                runtime_dir: dir.path().join("virt-api-runtime"),
                namespace: KUBEVIRT_NS.into(),
            },
        )
        .await
        .expect("virt-api starts");
        let listener = tokio::net::TcpListener::bind((host, 0))
            .await
            .expect("bind virt-api");
        let virt_api_addr = listener.local_addr().expect("addr");
        tokio::spawn({
            let stop = stop.clone();
            async move {
                if let Err(e) = virt_api.serve(listener, stop).await {
                    panic!("virt-api stopped: {e:#}");
                }
            }
        });
        register(&client, virt_api_addr, &certs.ca_pem).await;

        let cluster = Cluster {
            plane,
            client,
            dir,
            host,
            virt_api: virt_api_addr,
            handler,
            certs,
            vmis,
            stop,
        };
        // Available means kube-apiserver's availability check reached virt-api; a request
        // through it is the proof.
        let admin = cluster.admin();
        wait_for("discovery through kube-apiserver", || async {
            admin
                .request("GET", &subresources("v1"), &[], None)
                .await
                .is_ok_and(|r| r.status == 200)
        })
        .await;
        cluster
    }

    /// kube-apiserver's address.
    pub fn apiserver(&self) -> SocketAddr {
        self.plane
            .url()
            .trim_start_matches("https://")
            .parse()
            .expect("https://<ip>:<port>")
    }

    /// A client certificate of the cluster CA: kube-apiserver's user `name` in `groups`.
    fn user_credential(&self, name: &str, groups: &[&str]) -> localcluster::pki::Credential {
        self.plane
            .pki()
            .client(
                &format!("user-{name}"),
                &Subject {
                    common_name: name,
                    organizations: groups,
                },
            )
            .expect("a client certificate")
    }

    /// kube-apiserver as a user whose client certificate the cluster CA signed.
    pub fn user(&self, name: &str, groups: &[&str]) -> Endpoint {
        let cred = self.user_credential(name, groups);
        self.apiserver_endpoint(Some((&cred.cert_pem, &cred.key_pem)))
    }

    /// kube-apiserver with no client certificate: anonymous, or whoever a bearer token names.
    pub fn without_certificate(&self) -> Endpoint {
        self.apiserver_endpoint(None)
    }

    fn apiserver_endpoint(&self, identity: Option<(&str, &str)>) -> Endpoint {
        let addr = self.apiserver();
        Endpoint::new(
            addr,
            ServerName::IpAddress(addr.ip().into()),
            &self.plane.pki().ca().cert_pem,
            identity,
        )
    }

    /// kube-apiserver as a cluster administrator (`system:masters`).
    pub fn admin(&self) -> Endpoint {
        self.user("test-admin", &["system:masters"])
    }

    /// virt-api itself, bypassing kube-apiserver: with the front proxy's client certificate
    /// (as kube-apiserver connects), or with none.
    pub fn virt_api_direct(&self, as_front_proxy: bool) -> Endpoint {
        let fp = &self.plane.pki().front_proxy_client;
        Endpoint::new(
            self.virt_api,
            ServerName::try_from(VIRT_API_NAME).expect("a DNS name"),
            &self.certs.ca_pem,
            as_front_proxy.then_some((fp.cert_pem.as_str(), fp.key_pem.as_str())),
        )
    }

    /// virt-api itself, presenting the client certificate kube-apiserver knows as user `name`
    /// in `groups` (the cluster CA's, not the front proxy's).
    pub fn virt_api_direct_as_user(&self, name: &str, groups: &[&str]) -> Endpoint {
        let cred = self.user_credential(name, groups);
        Endpoint::new(
            self.virt_api,
            ServerName::try_from(VIRT_API_NAME).expect("a DNS name"),
            &self.certs.ca_pem,
            Some((&cred.cert_pem, &cred.key_pem)),
        )
    }

    /// virt-handler's console server itself, with virt-api's client certificate.
    pub fn handler_direct(&self) -> Endpoint {
        let read = |p: &Path| std::fs::read_to_string(p).expect("certificate file");
        let (cert, key) = (
            read(&self.certs.handler_client.0),
            read(&self.certs.handler_client.1),
        );
        Endpoint::new(
            self.handler,
            ServerName::try_from("virt-handler").expect("a DNS name"),
            &self.certs.ca_pem,
            Some((&cert, &key)),
        )
    }

    /// Where the serial socket of the VMI `name` is (the test binds its peer there).
    pub fn serial_socket(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}-serial0"))
    }

    /// Creates the VMI `name` in [`NS`], Running on [`NODE`] as the API sees it, and tells the
    /// console server it is on its node in `handler_phase` (the handler's own view, which may
    /// lag the API's) with its launcher socket absent and its serial socket at
    /// [`serial_socket`](Self::serial_socket).
    pub async fn vmi(&self, name: &str, handler_phase: Phase) -> api::VirtualMachineInstance {
        let vmi: api::VirtualMachineInstance = object(json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"domain": {"devices": {}}},
            // The VMI CRD has no status subresource: the status is written with the object.
            "status": {"phase": "Running", "nodeName": NODE},
        }));
        let created = Api::<api::VirtualMachineInstance>::namespaced(self.client.clone(), NS)
            .create(&PostParams::default(), &vmi)
            .await
            .expect("create the VMI");
        assert_eq!(
            created.status.as_ref().and_then(|s| s.node_name.as_deref()),
            Some(NODE),
            "the VMI's status was not stored"
        );
        let mut seen = created.clone();
        if let Some(s) = seen.status.as_mut() {
            s.phase = Some(handler_phase);
        }
        let target = Target {
            vmi: Arc::new(seen),
            launcher_socket: self.dir.path().join(format!("{name}-launcher-sock")),
            serial_socket: self.serial_socket(name),
            vnc_socket: self.dir.path().join(format!("{name}-vnc")),
            launcher_pid: None,
        };
        self.vmis
            .0
            .lock()
            .expect("vmis lock")
            .insert((NS.to_owned(), name.to_owned()), target);
        created
    }
}

/// A Running virt-handler Pod on [`NODE`] whose pod IP is `host` (status through the
/// `pods/status` subresource, as a kubelet writes it).
async fn handler_pod(client: &kube::Client, host: IpAddr) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), KUBEVIRT_NS);
    let name = format!("virt-handler-{NODE}");
    pods.create(
        &PostParams::default(),
        &object(json!({
            "metadata": {"name": name, "labels": {(api::labels::APP): "virt-handler"}},
            "spec": {
                "nodeName": NODE,
                "automountServiceAccountToken": false,
                "containers": [{"name": "virt-handler", "image": "virt-handler"}],
            },
        })),
    )
    .await
    .expect("create the virt-handler pod");
    pods.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Running",
            "podIP": host.to_string(),
            "podIPs": [{"ip": host.to_string()}],
            "hostIP": host.to_string(),
            "hostIPs": [{"ip": host.to_string()}],
        }})),
    )
    .await
    .expect("the virt-handler pod's status");
}

/// The `kubevirt/virt-api` Service (no selector), its EndpointSlice naming `addr`, and the two
/// APIServices of `subresources.kubevirt.io` trusting `ca_pem`; waits until both are Available.
async fn register(client: &kube::Client, addr: SocketAddr, ca_pem: &str) {
    let pp = PostParams::default();
    Api::<Service>::namespaced(client.clone(), KUBEVIRT_NS)
        .create(
            &pp,
            &object(json!({
                "metadata": {"name": "virt-api", "labels": {(api::labels::APP): "virt-api"}},
                "spec": {"ports": [{"name": "https", "port": 443, "targetPort": addr.port(), "protocol": "TCP"}]},
            })),
        )
        .await
        .expect("create the virt-api Service");
    Api::<EndpointSlice>::namespaced(client.clone(), KUBEVIRT_NS)
        .create(
            &pp,
            &object(json!({
                "metadata": {"name": "virt-api-test", "labels": {
                    "kubernetes.io/service-name": "virt-api",
                    "endpointslice.kubernetes.io/managed-by": "virtapi-tests",
                }},
                "addressType": if addr.is_ipv4() { "IPv4" } else { "IPv6" },
                "endpoints": [{"addresses": [addr.ip().to_string()], "conditions": {"ready": true}}],
                "ports": [{"name": "https", "port": addr.port(), "protocol": "TCP"}],
            })),
        )
        .await
        .expect("create the virt-api EndpointSlice");
    let apiservices: Api<APIService> = Api::all(client.clone());
    for version in api::subresources::VERSIONS {
        let mut s: APIService = object(json!({
            "metadata": {"name": format!("{version}.{}", api::subresources::GROUP)},
            "spec": {
                "group": api::subresources::GROUP,
                "version": version,
                "groupPriorityMinimum": 1000,
                "versionPriority": 15,
                "service": {"name": "virt-api", "namespace": KUBEVIRT_NS, "port": 443},
            },
        }));
        if let Some(spec) = s.spec.as_mut() {
            spec.ca_bundle = Some(ByteString(ca_pem.as_bytes().to_vec()));
        }
        apiservices
            .create(&pp, &s)
            .await
            .expect("create the APIService");
    }
    wait_for("the APIServices Available", || async {
        let mut all = true;
        for version in api::subresources::VERSIONS {
            let name = format!("{version}.{}", api::subresources::GROUP);
            let available = apiservices
                .get_opt(&name)
                .await
                .ok()
                .flatten()
                .is_some_and(|s| {
                    s.status
                        .and_then(|st| st.conditions)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Available" && c.status == "True")
                });
            all &= available;
        }
        all
    })
    .await;
}

/// rustls reads at most a TLS record from the socket per call: a large buffer under it makes
/// a stream of console output one `recv` per 256 KiB rather than per record.
pub type Tls = tokio_rustls::client::TlsStream<BufReader<TcpStream>>;

/// An HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A Kubernetes `Status`'s message (or the whole body).
    pub fn message(&self) -> String {
        self.json()
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| self.text(), str::to_owned)
    }
}

/// A TLS server and who the client is: every request is a fresh connection.
#[derive(Clone)]
pub struct Endpoint {
    addr: SocketAddr,
    name: ServerName<'static>,
    config: Arc<rustls::ClientConfig>,
}

impl Endpoint {
    pub fn new(
        addr: SocketAddr,
        name: ServerName<'static>,
        ca_pem: &str,
        identity: Option<(&str, &str)>,
    ) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert.expect("CA PEM")).expect("root");
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
        let config = match identity {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    CertificateDer::pem_slice_iter(cert.as_bytes())
                        .collect::<Result<Vec<_>, _>>()
                        .expect("cert PEM"),
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("key PEM"),
                )
                .expect("client certificate"),
            None => builder.with_no_client_auth(),
        };
        Endpoint {
            addr,
            name,
            config: Arc::new(config),
        }
    }

    pub async fn connect(&self) -> std::io::Result<Tls> {
        let tcp = TcpStream::connect(self.addr).await?;
        tcp.set_nodelay(true)?;
        tokio_rustls::TlsConnector::from(self.config.clone())
            .connect(self.name.clone(), BufReader::with_capacity(256 * 1024, tcp))
            .await
    }

    /// One HTTP/1.1 request with `headers` and a JSON `body`.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> Result<Answer, String> {
        let tls = self.connect().await.map_err(|e| e.to_string())?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut req = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, self.addr.to_string());
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let body = match body {
            Some(v) => {
                req = req.header(http::header::CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(&v).expect("JSON"))
            }
            None => Bytes::new(),
        };
        let resp = send
            .send_request(req.body(Full::new(body)).expect("request"))
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok(Answer { status, body })
    }

    /// A websocket (subprotocol `plain.kubevirt.io`) on `path`, or the refusal's code and body.
    pub async fn websocket(
        &self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<WebSocketStream<Tls>, (u16, String)> {
        use tokio_tungstenite::tungstenite::Error;
        let mut req = format!("wss://{}{path}", self.addr)
            .into_client_request()
            .expect("ws request");
        req.headers_mut().insert(
            http::header::SEC_WEBSOCKET_PROTOCOL,
            http::HeaderValue::from_static(api::subresources::PLAIN_STREAM_PROTOCOL),
        );
        for (k, v) in headers {
            req.headers_mut().insert(
                http::HeaderName::from_bytes(k.as_bytes()).expect("header name"),
                http::HeaderValue::from_str(v).expect("header value"),
            );
        }
        let tls = self.connect().await.map_err(|e| (0, e.to_string()))?;
        // tungstenite zero-fills its read buffer before each read: one TLS record's plaintext
        // (what a read of the TLS stream returns at most) rather than its 128 KiB default.
        let config = WebSocketConfig::default().read_buffer_size(16 * 1024);
        match tokio_tungstenite::client_async_with_config(req, tls, Some(config)).await {
            Ok((ws, _)) => Ok(ws),
            Err(Error::Http(resp)) => Err((
                resp.status().as_u16(),
                resp.body()
                    .as_deref()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default(),
            )),
            Err(e) => Err((0, e.to_string())),
        }
    }
}
