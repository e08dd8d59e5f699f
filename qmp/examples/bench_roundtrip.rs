//! Benchmark: a `query-status` round trip through this crate against a raw socket exchange with
//! the same QEMU, printed as per-call latencies and their ratio (figures, never asserts).
//!
//! Run: `cargo run --release -p qmp --example bench_roundtrip [calls]`
//! (once on tokio's multi-thread runtime, once on its current-thread runtime)
//!
//! QEMU serves one client per QMP socket, so it gets three: one for the crate, one for the
//! baseline, a blocking write-a-line / read-a-line loop on a std `UnixStream` (the least any
//! client can do), and one for the same loop on tokio in the calling task (what the async
//! runtime alone costs). All run in alternating rounds so that machine noise hits each.

use std::io::{BufRead, BufReader, Write};

use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use qmp::qapi::qmp::query_status;
use qmp::{ConnectOptions, QmpClient};

struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn raw_connect(path: &std::path::Path) -> (BufReader<UnixStream>, UnixStream) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let stream = loop {
        match UnixStream::connect(path) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("connect {}: {e}", path.display()),
        }
    };
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    writer
        .write_all(b"{\"execute\":\"qmp_capabilities\"}\n")
        .unwrap();
    line.clear();
    reader.read_line(&mut line).unwrap();
    (reader, writer)
}

fn stats(mut samples: Vec<Duration>) -> (Duration, Duration, Duration) {
    samples.sort();
    let total: Duration = samples.iter().sum();
    let mean = total / u32::try_from(samples.len()).unwrap();
    (
        mean,
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100],
    )
}

fn main() {
    let calls: usize = std::env::args()
        .nth(1)
        .map_or(2000, |n| n.parse().expect("calls: a number"));
    for (name, mut builder) in [
        ("multi-thread", tokio::runtime::Builder::new_multi_thread()),
        (
            "current-thread",
            tokio::runtime::Builder::new_current_thread(),
        ),
    ] {
        let runtime = builder.enable_all().build().unwrap();
        runtime.block_on(bench(name, calls));
    }
}

async fn bench(runtime: &str, calls: usize) {
    let dir = tempfile::tempdir().unwrap();
    let crate_sock = dir.path().join("crate.sock");
    let raw_sock = dir.path().join("raw.sock");
    let tokio_sock = dir.path().join("tokio.sock");
    let _qemu = Kill(
        Command::new("qemu-system-x86_64")
            .args([
                "-machine",
                "none",
                "-accel",
                "tcg",
                "-nodefaults",
                "-display",
                "none",
            ])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", crate_sock.display()))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", raw_sock.display()))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", tokio_sock.display()))
            .stdin(Stdio::null())
            .spawn()
            .expect("start qemu-system-x86_64"),
    );
    let client = QmpClient::connect(&crate_sock, &ConnectOptions::default())
        .await
        .expect("connect through the crate");
    let (mut reader, mut writer) = raw_connect(&raw_sock);
    let (tokio_reader, tokio_writer) = raw_connect(&tokio_sock);
    let mut tokio_reader = tokio::io::BufReader::new(
        tokio::net::UnixStream::from_std(tokio_reader.into_inner()).unwrap(),
    );
    tokio_writer.set_nonblocking(true).unwrap();
    let mut tokio_writer = tokio::net::UnixStream::from_std(tokio_writer).unwrap();

    let mut ours = Vec::with_capacity(calls);
    let mut untyped = Vec::with_capacity(calls);
    let mut raw = Vec::with_capacity(calls);
    let mut raw_tokio = Vec::with_capacity(calls);
    let mut line = String::new();
    let rounds = 10;
    let per_round = calls.div_ceil(rounds);
    // Warm-up: both paths, discarded.
    for _ in 0..100 {
        client.execute(query_status {}).await.unwrap();
        writer
            .write_all(b"{\"execute\":\"query-status\"}\n")
            .unwrap();
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    for _ in 0..rounds {
        for _ in 0..per_round {
            let start = Instant::now();
            let status = client.execute(query_status {}).await.unwrap();
            ours.push(start.elapsed());
            std::hint::black_box(status);
        }
        for _ in 0..per_round {
            let start = Instant::now();
            let status = client
                .execute_raw("query-status", serde_json::Value::Null)
                .await
                .unwrap();
            untyped.push(start.elapsed());
            std::hint::black_box(status);
        }
        for _ in 0..per_round {
            let start = Instant::now();
            writer
                .write_all(b"{\"execute\":\"query-status\"}\n")
                .unwrap();
            line.clear();
            reader.read_line(&mut line).unwrap();
            raw.push(start.elapsed());
            assert!(line.contains("\"return\""), "unexpected reply {line}");
        }
        for _ in 0..per_round {
            let start = Instant::now();
            tokio_writer
                .write_all(b"{\"execute\":\"query-status\"}\n")
                .await
                .unwrap();
            line.clear();
            tokio_reader.read_line(&mut line).await.unwrap();
            raw_tokio.push(start.elapsed());
            assert!(line.contains("\"return\""), "unexpected reply {line}");
        }
    }
    let (ours_mean, ours_p50, ours_p99) = stats(ours);
    let (untyped_mean, untyped_p50, untyped_p99) = stats(untyped);
    let (raw_mean, raw_p50, raw_p99) = stats(raw);
    let (tokio_mean, tokio_p50, tokio_p99) = stats(raw_tokio);
    println!(
        "query-status round trips, {} calls each, QEMU {}, tokio {runtime} runtime",
        rounds * per_round,
        client.version()
    );
    println!("  qmp crate (typed, tokio): mean {ours_mean:?}  p50 {ours_p50:?}  p99 {ours_p99:?}");
    println!(
        "  qmp crate (execute_raw): mean {untyped_mean:?}  p50 {untyped_p50:?}  p99 {untyped_p99:?}"
    );
    println!("  raw socket (std, blocking): mean {raw_mean:?}  p50 {raw_p50:?}  p99 {raw_p99:?}");
    println!(
        "  raw socket (tokio, one task): mean {tokio_mean:?}  p50 {tokio_p50:?}  p99 {tokio_p99:?}"
    );
    println!(
        "  ratio crate/raw: mean {:.2}  p50 {:.2}",
        ours_mean.as_secs_f64() / raw_mean.as_secs_f64(),
        ours_p50.as_secs_f64() / raw_p50.as_secs_f64()
    );
    println!(
        "  ratio execute_raw/raw: mean {:.2}  p50 {:.2}",
        untyped_mean.as_secs_f64() / raw_mean.as_secs_f64(),
        untyped_p50.as_secs_f64() / raw_p50.as_secs_f64()
    );
    println!(
        "  ratio crate/raw tokio: mean {:.2}  p50 {:.2}",
        ours_mean.as_secs_f64() / tokio_mean.as_secs_f64(),
        ours_p50.as_secs_f64() / tokio_p50.as_secs_f64()
    );
}
