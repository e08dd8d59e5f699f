//! Printed benchmarks (issue 6): console throughput through the real console server (rustls
//! mTLS + websocket) against reading the serial unix socket directly, and REST pause/unpause
//! latency against a real launcher, and the virt-handler binary's idle RSS. Figures only, never timed asserts. Run with
//! `cargo nextest run -p handler --run-ignored only -E 'test(/^bench_/)' --no-capture`.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use api::VirtualMachineInstancePhase as Phase;
use api::status::VirtualMachineInstanceConditionType as Cond;
use bytes::Bytes;
use futures::StreamExt as _;
use handler::server::{self, Limits, LookupError, Target, Vmis};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tlsconfig::{ClientAuth, ReloadingConfig, TlsFiles};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_util::sync::CancellationToken;

const MIB: usize = 1024 * 1024;
/// How much the fake serial console streams per connection.
const STREAM_MIB: usize = 256;
const ROUNDS: usize = 3;
const PAUSE_ROUNDS: usize = 50;

/// A console server on loopback with its own CA, and one client certificate it trusts.
struct Server {
    addr: SocketAddr,
    ca: CertificateDer<'static>,
    client_cert: CertificateDer<'static>,
    client_key: PrivateKeyDer<'static>,
    stop: CancellationToken,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

struct OneVmi(HashMap<String, Target>);

impl Vmis for OneVmi {
    fn lookup(&self, namespace: &str, name: &str) -> Result<Target, LookupError> {
        self.0
            .get(name)
            .cloned()
            .ok_or_else(|| LookupError::NotFound {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })
    }
}

async fn start(target: Target) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = common::Ca::new("bench CA");
    let srv = ca.leaf(&["localhost"], "virt-handler");
    let client = ca.leaf(&[], "virt-api");
    let files = TlsFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
        client_ca: dir.path().join("ca.crt"),
        client_auth: ClientAuth::Required,
    };
    std::fs::write(&files.cert, &srv.cert_pem).expect("write cert");
    std::fs::write(&files.key, &srv.key_pem).expect("write key");
    std::fs::write(&files.client_ca, ca.pem()).expect("write CA");
    let tls = Arc::new(ReloadingConfig::new(files).expect("tls config"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = CancellationToken::new();
    let name = target.vmi.metadata.name.clone().expect("name");
    let vmis = Arc::new(OneVmi(HashMap::from([(name, target)])));
    tokio::spawn(server::serve(
        listener,
        tls,
        server::router(vmis, Limits::default()),
        stop.clone(),
    ));
    Server {
        addr,
        ca: ca.der(),
        client_cert: client.cert,
        client_key: client.key,
        stop,
        _dir: dir,
    }
}

/// rustls pulls at most 4 KiB from the socket per read: a client streaming a console reads
/// the socket through a large buffer instead, one `recv` per 256 KiB rather than per 4 KiB.
type Tls = tokio_rustls::client::TlsStream<BufReader<TcpStream>>;

impl Server {
    async fn connect(&self) -> Tls {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone()).expect("root");
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![self.client_cert.clone()], self.client_key.clone_key())
        .expect("client cert");
        let tcp = BufReader::with_capacity(
            256 * 1024,
            TcpStream::connect(self.addr).await.expect("tcp connect"),
        );
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("localhost").expect("name"), tcp)
            .await
            .expect("tls handshake")
    }

    /// One REST call on a fresh mTLS connection, as virt-api makes them; it must answer 200.
    async fn put(&self, vmi: &str, what: &str) {
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(self.connect().await))
                .await
                .expect("http handshake");
        tokio::spawn(conn);
        let req = http::Request::builder()
            .method("PUT")
            .uri(url(vmi, what))
            .header("host", "localhost")
            .body(Empty::<Bytes>::new())
            .expect("request");
        let resp = send.send_request(req).await.expect("response");
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
}

fn url(vmi: &str, what: &str) -> String {
    format!("/v1/namespaces/default/virtualmachineinstances/{vmi}/{what}")
}

/// A serial socket that streams `STREAM_MIB` MiB to every connection, then closes it.
fn streaming_peer(path: &Path) -> tokio::task::JoinHandle<()> {
    let l = UnixListener::bind(path).expect("bind serial socket");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let chunk = vec![b'x'; 64 * 1024];
                for _ in 0..STREAM_MIB * MIB / chunk.len() {
                    if s.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

fn mib_per_s(bytes: usize, took: Duration) -> f64 {
    #[allow(clippy::cast_precision_loss)] // byte counts far below 2^52
    let mib = bytes as f64 / MIB as f64;
    mib / took.as_secs_f64()
}

/// CPU time (user + system) of this whole process so far: the peer, the console server and
/// the client all run in it, so a round's share is the CPU its path costs, whatever else the
/// machine is doing (which the wall-clock rates are not).
fn cpu_time() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let u = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let tv = |t: nix::sys::time::TimeVal| {
        Duration::new(
            u64::try_from(t.tv_sec()).expect("non-negative"),
            u32::try_from(t.tv_usec()).expect("microseconds") * 1000,
        )
    };
    tv(u.user_time()) + tv(u.system_time())
}

/// Wall-clock and CPU time since a start.
struct Clock {
    wall: Instant,
    cpu: Duration,
}

impl Clock {
    fn start() -> Self {
        Clock {
            wall: Instant::now(),
            cpu: cpu_time(),
        }
    }

    /// MiB/s, and CPU milliseconds per GiB, for `bytes` moved since the start.
    fn rates(&self, bytes: usize) -> (f64, f64) {
        #[allow(clippy::cast_precision_loss)] // byte counts far below 2^52
        let gib = bytes as f64 / (1024.0 * MIB as f64);
        let cpu = cpu_time().saturating_sub(self.cpu);
        (
            mib_per_s(bytes, self.wall.elapsed()),
            cpu.as_secs_f64() * 1e3 / gib,
        )
    }
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: prints figures"]
async fn bench_console_throughput_proxied_vs_direct() {
    let dir = tempfile::tempdir().expect("tempdir");
    let serial = dir.path().join("virt-serial0");
    let _peer = streaming_peer(&serial);
    let server = start(Target {
        vmi: Arc::new(common::vmi_with_conditions(
            "flood",
            "uid-flood",
            Phase::Running,
            &[],
        )),
        launcher_socket: dir.path().join("launcher-sock"),
        serial_socket: serial.clone(),
        vnc_socket: dir.path().join("virt-vnc"),
        launcher_pid: None,
    })
    .await;
    let total = STREAM_MIB * MIB;
    let (mut direct, mut proxied) = (Vec::new(), Vec::new());
    let (mut direct_cpu, mut proxied_cpu) = (Vec::new(), Vec::new());
    let mut suite = None;
    for _ in 0..ROUNDS {
        let clock = Clock::start();
        let mut u = UnixStream::connect(&serial).await.expect("serial socket");
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0;
        while got < total {
            let n = u.read(&mut buf).await.expect("read serial");
            assert_ne!(n, 0, "serial socket closed after {got} bytes");
            got += n;
        }
        let (rate, cpu) = clock.rates(got);
        direct.push(rate);
        direct_cpu.push(cpu);

        // Timed from before the TLS handshake: what a `virtctl console` user waits for.
        let clock = Clock::start();
        let mut req = format!("wss://localhost{}", url("flood", "console"))
            .into_client_request()
            .expect("ws request");
        req.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            server::SUBPROTOCOL.parse().expect("header"),
        );
        let tls = server.connect().await;
        suite = tls.get_ref().1.negotiated_cipher_suite();
        // tungstenite zero-fills its read buffer before each read: a read buffer of one TLS
        // record's plaintext (what a read of the TLS stream returns at most) rather than its
        // 128 KiB default.
        let config = WebSocketConfig::default().read_buffer_size(16 * 1024);
        let (mut ws, _) = tokio_tungstenite::client_async_with_config(req, tls, Some(config))
            .await
            .expect("websocket upgrade");
        let mut got = 0;
        while got < total {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => got += b.len(),
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                other => panic!("after {got} bytes: {other:?}"),
            }
        }
        let (rate, cpu) = clock.rates(got);
        proxied.push(rate);
        proxied_cpu.push(cpu);
    }
    let (d, p) = (best(&direct), best(&proxied));
    println!(
        "console throughput, {STREAM_MIB} MiB x {ROUNDS}, best round: direct unix socket \
         {d:.0} MiB/s, through mTLS websocket {p:.0} MiB/s, ratio {:.2} (goal >= 0.8); \
         all rounds direct {direct:.0?} proxied {proxied:.0?}; cipher suite {:?}",
        p / d,
        suite.map(|s| s.suite())
    );
    let least = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (dc, pc) = (least(&direct_cpu), least(&proxied_cpu));
    println!(
        "console CPU per GiB (peer + server + client, user + system), least round: direct \
         {dc:.0} ms, proxied {pc:.0} ms, {:.1}x; all rounds direct {direct_cpu:.0?} proxied \
         {proxied_cpu:.0?}",
        pc / dc
    );
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

fn summary(what: &str, mut v: Vec<Duration>) -> Duration {
    v.sort();
    let (p50, p95) = (percentile(&v, 50), percentile(&v, 95));
    println!(
        "{what}: n={} p50 {:.1} ms p95 {:.1} ms max {:.1} ms",
        v.len(),
        p50.as_secs_f64() * 1e3,
        p95.as_secs_f64() * 1e3,
        v[v.len() - 1].as_secs_f64() * 1e3
    );
    p50
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: prints figures; runs a real launcher and QEMU"]
async fn bench_rest_pause_unpause_latency() {
    let launcher = common::Launcher::start(true);
    let uid = "44444444-4444-4444-4444-444444444444";
    let c = launcher_api::client::LauncherClient::new(&launcher.socket, Duration::from_mins(1));
    c.sync(&common::kernel_vmi("bench", uid))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", launcher.log()));
    let deadline = Instant::now() + common::BOOT;
    while c.domain().await.expect("domain").state != launcher_api::domain::DomainState::Running {
        assert!(
            Instant::now() < deadline,
            "never Running\n{}",
            launcher.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The server refuses pause on a VMI whose status says Paused and unpause on one that does
    // not: one server per status, as the handler's status would flip between calls.
    let target = |conds: &[Cond]| common::running_target(&launcher, "bench", uid, conds);
    let running = start(target(&[])).await;
    let paused = start(target(&[Cond::Paused])).await;

    let (mut direct_pause, mut direct_unpause) = (Vec::new(), Vec::new());
    let (mut rest_pause, mut rest_unpause) = (Vec::new(), Vec::new());
    for _ in 0..PAUSE_ROUNDS {
        let t = Instant::now();
        c.pause().await.expect("pause");
        direct_pause.push(t.elapsed());
        let t = Instant::now();
        c.unpause().await.expect("unpause");
        direct_unpause.push(t.elapsed());

        let t = Instant::now();
        running.put("bench", "pause").await;
        rest_pause.push(t.elapsed());
        let t = Instant::now();
        paused.put("bench", "unpause").await;
        rest_unpause.push(t.elapsed());
    }
    assert_eq!(
        c.domain().await.expect("domain").state,
        launcher_api::domain::DomainState::Running
    );
    let dp = summary("launcher client pause (baseline)", direct_pause);
    let du = summary("launcher client unpause (baseline)", direct_unpause);
    let rp = summary("REST PUT pause, fresh mTLS connection", rest_pause);
    let ru = summary("REST PUT unpause, fresh mTLS connection", rest_unpause);
    println!(
        "p50 REST / launcher client: pause {:.2}x, unpause {:.2}x",
        rp.as_secs_f64() / dp.as_secs_f64(),
        ru.as_secs_f64() / du.as_secs_f64()
    );
}

#[tokio::test]
#[ignore = "benchmark: prints figures; runs the virt-handler binary against the local API server"]
async fn bench_handler_rss_idle() {
    let cluster = common::HandlerCluster::start("node-a").await;
    let (dir, kubeconfig) = (&cluster.dir, &cluster.kubeconfig);
    // A kubelet that takes the plugins: the handler retries registration until it succeeds,
    // and an idle figure should not include that.
    let plugins = dir.path().join("kubelet/device-plugins");
    std::fs::create_dir_all(&plugins).expect("mkdir");
    let stop = CancellationToken::new();
    let _registered = common::fake_kubelet(&plugins, stop.clone());
    let h = common::HandlerProcess::spawn(
        "node-a",
        kubeconfig,
        dir.path(),
        &dir.path().join("pods"),
        &[],
    );
    h.wait_healthy(Duration::from_mins(1)).await;
    // Idle means after the first resyncs and heartbeats: sample over 30 s, report the range.
    common::print_rss(h.child.id(), "idle, 0 VMIs, after /healthz", 30).await;
    drop(h);
    stop.cancel();
}
