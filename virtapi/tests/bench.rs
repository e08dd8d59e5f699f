//! Printed benchmarks of virt-api on the real control plane (see `common`): console throughput
//! through kube-apiserver -> virt-api -> virt-handler against reading the serial socket
//! directly (and against virt-handler's console server alone), and the `virt-api` binary's
//! RSS. Figures only, never timed asserts. Run with
//! `cargo nextest run -p virtapi --test bench --run-ignored only -E 'test(/^bench_/)' --no-capture`.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use api::VirtualMachineInstancePhase as Phase;
use common::{Cluster, Endpoint, KUBEVIRT_NS, subresources, vmi_path};
use futures::StreamExt as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{UnixListener, UnixStream};
use tokio_tungstenite::tungstenite::Message;

const MIB: usize = 1024 * 1024;
/// How much the fake serial console streams per connection.
const STREAM_MIB: usize = 256;
const ROUNDS: usize = 3;
/// KubeVirt's virt-api, as its pods run it (the figure to compare with).
const KUBEVIRT_VIRT_API_RSS: &str = "135-145 MB";

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

fn tv(t: nix::sys::time::TimeVal) -> Duration {
    Duration::new(
        u64::try_from(t.tv_sec()).expect("non-negative"),
        u32::try_from(t.tv_usec()).expect("microseconds") * 1000,
    )
}

/// CPU time (user + system) of this whole process so far: the peer, virt-handler's console
/// server, virt-api and the client all run in it.
fn own_cpu() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let u = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    tv(u.user_time()) + tv(u.system_time())
}

/// CPU time (user + system) of another process, from `/proc/<pid>/stat`.
fn cpu_of(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("proc stat");
    // Fields after the command's closing parenthesis, from the state (field 3) on.
    let rest = &stat[stat.rfind(')').expect("comm") + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|v| u64::try_from(v).ok())
        .unwrap_or(100);
    Duration::from_millis(ticks * 1000 / hz)
}

/// Wall-clock time, and the CPU time of this process and of kube-apiserver, since a start.
struct Clock {
    wall: Instant,
    own: Duration,
    apiserver: Duration,
    apiserver_pid: u32,
}

/// One round's rate and CPU costs.
#[derive(Debug, Clone, Copy)]
struct Round {
    mib_s: f64,
    own_ms_per_gib: f64,
    apiserver_ms_per_gib: f64,
}

impl Clock {
    fn start(apiserver_pid: u32) -> Self {
        Clock {
            wall: Instant::now(),
            own: own_cpu(),
            apiserver: cpu_of(apiserver_pid),
            apiserver_pid,
        }
    }

    fn round(&self, bytes: usize) -> Round {
        #[allow(clippy::cast_precision_loss)] // byte counts far below 2^52
        let (mib, gib) = (
            bytes as f64 / MIB as f64,
            bytes as f64 / (1024.0 * MIB as f64),
        );
        let per_gib = |d: Duration| d.as_secs_f64() * 1e3 / gib;
        Round {
            mib_s: mib / self.wall.elapsed().as_secs_f64(),
            own_ms_per_gib: per_gib(own_cpu().saturating_sub(self.own)),
            apiserver_ms_per_gib: per_gib(
                cpu_of(self.apiserver_pid).saturating_sub(self.apiserver),
            ),
        }
    }
}

/// Reads a console websocket until `total` bytes came.
async fn read_console(endpoint: &Endpoint, path: &str, headers: &[(&str, &str)], total: usize) {
    let mut ws = endpoint
        .websocket(path, headers)
        .await
        .unwrap_or_else(|e| panic!("console websocket: {e:?}"));
    let mut got = 0;
    while got < total {
        match ws.next().await {
            Some(Ok(Message::Binary(b))) => got += b.len(),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            other => panic!("after {got} bytes: {other:?}"),
        }
    }
}

fn best(v: &[Round]) -> f64 {
    v.iter().map(|r| r.mib_s).fold(0.0, f64::max)
}

fn least(v: &[Round], f: fn(&Round) -> f64) -> f64 {
    v.iter().map(f).fold(f64::INFINITY, f64::min)
}

fn apiserver_pid(c: &Cluster) -> u32 {
    c.plane
        .components()
        .iter()
        .find(|p| p.name() == "kube-apiserver")
        .expect("kube-apiserver runs")
        .pid()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: prints figures"]
async fn bench_console_throughput_through_virt_api_vs_direct() {
    let c = Cluster::start().await;
    c.vmi("flood", Phase::Running).await;
    let serial = c.serial_socket("flood");
    let _peer = streaming_peer(&serial);
    let pid = apiserver_pid(&c);
    let (admin, handler) = (c.admin(), c.handler_direct());
    let handler_path = format!(
        "/v1/namespaces/{}/virtualmachineinstances/flood/console",
        common::NS
    );
    let total = STREAM_MIB * MIB;
    let (mut direct, mut via_handler, mut via_api) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let clock = Clock::start(pid);
        let mut u = UnixStream::connect(&serial).await.expect("serial socket");
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0;
        while got < total {
            let n = u.read(&mut buf).await.expect("read serial");
            assert_ne!(n, 0, "serial socket closed after {got} bytes");
            got += n;
        }
        direct.push(clock.round(got));

        // Each timed from before the TLS handshake: what a `virtctl console` user waits for.
        let clock = Clock::start(pid);
        read_console(&handler, &handler_path, &[], total).await;
        via_handler.push(clock.round(total));

        let clock = Clock::start(pid);
        read_console(&admin, &vmi_path("flood", "console"), &[], total).await;
        via_api.push(clock.round(total));
    }
    let (d, h, a) = (best(&direct), best(&via_handler), best(&via_api));
    let rates = |v: &[Round]| v.iter().map(|r| r.mib_s.round()).collect::<Vec<_>>();
    println!(
        "console throughput, {STREAM_MIB} MiB x {ROUNDS}, best round: direct unix socket {d:.0} \
         MiB/s; virt-handler's console server alone (mTLS websocket) {h:.0} MiB/s, ratio {:.2}; \
         kube-apiserver -> virt-api -> virt-handler {a:.0} MiB/s, ratio {:.2} (to the handler \
         alone {:.2}); all rounds direct {:?} handler {:?} virt-api {:?}",
        h / d,
        a / d,
        a / h,
        rates(&direct),
        rates(&via_handler),
        rates(&via_api),
    );
    let own = |r: &Round| r.own_ms_per_gib;
    let apiserver = |r: &Round| r.apiserver_ms_per_gib;
    println!(
        "console CPU per GiB (user + system), least round: this process (peer, handler, \
         virt-api, client): direct {:.0} ms, handler alone {:.0} ms, through virt-api {:.0} ms; \
         kube-apiserver (its own process, /proc/{pid}/stat, 10 ms ticks): direct {:.0} ms, \
         handler alone {:.0} ms, through virt-api {:.0} ms",
        least(&direct, own),
        least(&via_handler, own),
        least(&via_api, own),
        least(&direct, apiserver),
        least(&via_handler, apiserver),
        least(&via_api, apiserver),
    );
}

/// A `/proc/<pid>/status` field in KiB (`VmRSS`, `VmHWM`, `RssAnon`).
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

#[allow(clippy::cast_precision_loss)] // KiB counts far below 2^52
fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// The `virt-api` binary, killed on drop.
struct VirtApiProcess(std::process::Child);

impl Drop for VirtApiProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: prints figures; runs the virt-api binary against the local API server"]
async fn bench_virt_api_rss() {
    let c = Cluster::start().await;
    let port = localcluster::ports::free_port(c.host).expect("a free port");
    let dir = c.dir.path();
    let log = dir.join("virt-api.log");
    let child = Command::new(env!("CARGO_BIN_EXE_virt-api"))
        .args(["--port", &port.to_string()])
        .args(["--console-server-port", &c.handler.port().to_string()])
        .arg("--tls-cert-file")
        .arg(&c.certs.virt_api.0)
        .arg("--tls-key-file")
        .arg(&c.certs.virt_api.1)
        .arg("--handler-client-cert-file")
        .arg(&c.certs.handler_client.0)
        .arg("--handler-client-key-file")
        .arg(&c.certs.handler_client.1)
        .arg("--handler-ca-file")
        .arg(&c.certs.ca_file)
        .arg("--runtime-dir")
        .arg(dir.join("virt-api-binary"))
        .args(["--namespace", KUBEVIRT_NS])
        .env("KUBECONFIG", c.plane.kubeconfig_path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("virt-api log"))
        .spawn()
        .expect("spawn virt-api");
    let p = VirtApiProcess(child);
    let pid = p.0.id();
    let anonymous = Endpoint::new(
        std::net::SocketAddr::new(c.host, port),
        rustls::pki_types::ServerName::try_from("virt-api.kubevirt.svc").expect("a DNS name"),
        &c.certs.ca_pem,
        None,
    );
    let healthz = format!("{}/healthz", subresources("v1"));
    common::wait_for("the virt-api binary's healthz", || async {
        anonymous
            .request("GET", &healthz, &[], None)
            .await
            .is_ok_and(|r| r.status == 200)
    })
    .await;

    // Idle means after its watches' first lists: sample over 30 s, report the range.
    let samples = 30;
    let mut kib = Vec::new();
    for _ in 0..samples {
        kib.push(status_kib(pid, "VmRSS"));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    println!(
        "virt-api binary (pid {pid}), idle after healthz, {samples} samples 1 s apart: VmRSS min \
         {:.1} MiB max {:.1} MiB, VmHWM {:.1} MiB; at the end RssAnon {:.1} MiB, RssFile {:.1} \
         MiB. KubeVirt's virt-api: {KUBEVIRT_VIRT_API_RSS}",
        mib(*kib.iter().min().expect("samples")),
        mib(*kib.iter().max().expect("samples")),
        mib(status_kib(pid, "VmHWM")),
        mib(status_kib(pid, "RssAnon")),
        mib(status_kib(pid, "RssFile")),
    );

    // Some work: a console of 256 MiB relayed by the binary (reached as the front proxy
    // reaches it), then the same figures.
    c.vmi("flood", Phase::Running).await;
    let _peer = streaming_peer(&c.serial_socket("flood"));
    let front_proxy = {
        let fp = &c.plane.pki().front_proxy_client;
        Endpoint::new(
            std::net::SocketAddr::new(c.host, port),
            rustls::pki_types::ServerName::try_from("virt-api.kubevirt.svc").expect("a DNS name"),
            &c.certs.ca_pem,
            Some((&fp.cert_pem, &fp.key_pem)),
        )
    };
    let started = Instant::now();
    read_console(
        &front_proxy,
        &vmi_path("flood", "console"),
        &[
            ("X-Remote-User", "test-admin"),
            ("X-Remote-Group", "system:masters"),
        ],
        STREAM_MIB * MIB,
    )
    .await;
    #[allow(clippy::cast_precision_loss)]
    let rate = STREAM_MIB as f64 / started.elapsed().as_secs_f64();
    println!(
        "virt-api binary after relaying a {STREAM_MIB} MiB console ({rate:.0} MiB/s, straight \
         to it as the front proxy): VmRSS {:.1} MiB, VmHWM {:.1} MiB, RssAnon {:.1} MiB, \
         RssFile {:.1} MiB",
        mib(status_kib(pid, "VmRSS")),
        mib(status_kib(pid, "VmHWM")),
        mib(status_kib(pid, "RssAnon")),
        mib(status_kib(pid, "RssFile")),
    );
    drop(p);
}
