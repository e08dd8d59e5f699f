//! Figures for the API server: write throughput, watch fan-out and memory per stored object;
//! then the scheduler's throughput.
//!
//! `cargo run --release -p localcluster --example bench_apiserver [-- OBJECTS WATCHERS PODS]`
//! (defaults 10000, 100 and 1000). Client and server share the process, so the figures include
//! the client's share of the work; memory is the growth of this process's resident set while
//! the objects are created. The scheduler places PODS pods over 10 nodes (created 32 at a
//! time, as fast as the server takes them) and the figure is pods bound per second from the
//! first create to the last binding.

// Counts become f64 only to print rates; precision beyond 2^52 does not matter there.
#![allow(clippy::cast_precision_loss)]

use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let objects: usize = args.next().map_or(Ok(10_000), |a| a.parse())?;
    let watchers: usize = args.next().map_or(Ok(100), |a| a.parse())?;
    let pods: usize = args.next().map_or(Ok(1000), |a| a.parse())?;
    let server = localcluster::ApiServer::start(localcluster::Config {
        history_window: objects * 2,
        ..localcluster::Config::default()
    })
    .await?;
    let client = server.client().await?;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");

    let rss_before = rss_kib();
    let started = Instant::now();
    futures::stream::iter(0..objects)
        .map(|i| {
            let api = api.clone();
            async move {
                let cm: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": format!("bench-{i}"), "labels": {"bench": "yes"}},
                    "data": {"index": i.to_string(), "payload": "x".repeat(200)}
                }))?;
                api.create(&PostParams::default(), &cm).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    let elapsed = started.elapsed();
    let rss_after = rss_kib();
    println!(
        "create: {objects} objects in {:.2} s = {:.0} writes/s (32 concurrent requests)",
        elapsed.as_secs_f64(),
        objects as f64 / elapsed.as_secs_f64()
    );
    println!(
        "memory: resident set grew {} KiB = {:.2} KiB per stored object (~300 B of JSON each, history included)",
        rss_after.saturating_sub(rss_before),
        rss_after.saturating_sub(rss_before) as f64 / objects as f64
    );

    let started = Instant::now();
    let list = api.list(&ListParams::default()).await?;
    println!(
        "list: {} objects in {:.0} ms",
        list.items.len(),
        started.elapsed().as_secs_f64() * 1000.0
    );
    let rv = list.metadata.resource_version.unwrap_or_default();

    let updates = 1000.min(objects);
    let mut tasks = Vec::new();
    for _ in 0..watchers {
        let api = api.clone();
        let rv = rv.clone();
        tasks.push(tokio::spawn(async move {
            let mut stream = api.watch(&WatchParams::default(), &rv).await?.boxed();
            let mut seen = 0;
            while seen < updates {
                match tokio::time::timeout(Duration::from_secs(120), stream.try_next()).await?? {
                    Some(WatchEvent::Modified(_)) => seen += 1,
                    Some(_) => {}
                    None => anyhow::bail!("watch ended early"),
                }
            }
            anyhow::Ok(Instant::now())
        }));
    }
    let started = Instant::now();
    futures::stream::iter(0..updates)
        .map(|i| {
            let api = api.clone();
            async move {
                api.patch(
                    &format!("bench-{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(json!({"data": {"index": "updated"}})),
                )
                .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    let writes_done = started.elapsed();
    let mut last = started;
    for t in tasks {
        last = last.max(t.await??);
    }
    let delivered = updates * watchers;
    let fanout = last - started;
    println!(
        "fan-out: {updates} updates written in {:.2} s; {watchers} watchers received all {delivered} events in {:.2} s = {:.0} events/s",
        writes_done.as_secs_f64(),
        fanout.as_secs_f64(),
        delivered as f64 / fanout.as_secs_f64()
    );
    scheduler_throughput(&client, pods).await?;
    server.shutdown().await;
    Ok(())
}

/// Creates `n` pending pods over 10 Ready nodes and prints how fast the scheduler binds them.
async fn scheduler_throughput(client: &kube::Client, n: usize) -> anyhow::Result<()> {
    const NODES: usize = 10;
    let nodes: Api<Node> = Api::all(client.clone());
    for i in 0..NODES {
        let name = format!("bench-node-{i}");
        nodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": name}}))?,
            )
            .await?;
        nodes
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "10k"},
                    "conditions": [{"type": "Ready", "status": "True"}]}})),
            )
            .await?;
    }
    let scheduler = tokio::spawn(localcluster::scheduler::run(
        client.clone(),
        localcluster::scheduler::DEFAULT_SCHEDULER.into(),
        Duration::from_secs(5),
    ));
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    // Counts bindings as the watch reports them, from before the first create.
    let rv = api
        .list(&ListParams::default().limit(1))
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
    let mut stream = api.watch(&WatchParams::default(), &rv).await?.boxed();
    let bound = tokio::spawn(async move {
        let mut seen = std::collections::HashSet::new();
        while seen.len() < n {
            match tokio::time::timeout(Duration::from_secs(600), stream.try_next()).await?? {
                Some(WatchEvent::Modified(p) | WatchEvent::Added(p))
                    if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() =>
                {
                    seen.insert(p.metadata.name.unwrap_or_default());
                }
                Some(_) => {}
                None => anyhow::bail!("the pod watch ended early"),
            }
        }
        anyhow::Ok(Instant::now())
    });
    let started = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("bench-pod-{i}")},
                    "spec": {"containers": [{"name": "c", "image": "i",
                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]}
                }))?;
                api.create(&PostParams::default(), &pod).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    let created = started.elapsed();
    let done = bound.await?? - started;
    scheduler.abort();
    println!(
        "scheduler: {n} pods over {NODES} nodes created in {:.2} s, all bound after {:.2} s = {:.0} pods/s scheduled",
        created.as_secs_f64(),
        done.as_secs_f64(),
        n as f64 / done.as_secs_f64()
    );
    Ok(())
}
