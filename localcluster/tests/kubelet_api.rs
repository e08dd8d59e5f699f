//! The process kubelet's API through the real kube-apiserver: `nodes/proxy` (healthz), client
//! certificates required, `kubectl exec -it` on a terminal, attach refused, and
//! `kubectl port-forward` to a port the pod listens on only on its own loopback. (`kubectl
//! logs` and plain `kubectl exec` are in `tests/kubelet.rs`.) Needs root, the `kube` binary
//! (`upstream/build.sh`) and the `localcluster` binary (`nsexec`; `$LOCALCLUSTER_BIN` or
//! `target/debug/localcluster`).

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{Cluster, eventually};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use localcluster::kubelet::network::PodCidr;
use localcluster::kubelet::{Kubelet, NodeConfig, Serving};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const IMAGE: &str = common::TOOLS_IMAGE;

/// A serving kubelet on a fresh node rooted in a temp dir.
async fn serving_node(cluster: &Cluster) -> (Kubelet, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let id = uuid::Uuid::new_v4().simple().to_string();
    let name = format!("n-{}", &id[..6]);
    let bytes = id.as_bytes();
    let cidr = PodCidr::parse(&format!(
        "10.{}.{}.0/24",
        200 + u32::from(bytes[8]) % 50,
        u32::from(bytes[9]) * 2 % 250
    ))
    .expect("cidr");
    let mut config = NodeConfig::new(&name, dir.path(), cidr, common::images());
    config.heartbeat = Duration::from_secs(2);
    let (client, creds) = cluster.node_client(&name).await;
    config.serving = Some(Serving {
        port: 0,
        cert_pem: creds.serving.cert_pem,
        key_pem: creds.serving.key_pem,
        client_ca_pem: creds.ca_pem,
    });
    let kubelet = Kubelet::start(client, config)
        .await
        .expect("starting the kubelet");
    (kubelet, dir)
}

async fn running_pod(cluster: &Cluster, node: &str, name: &str, script: &str) -> Value {
    let pods: Api<Pod> = cluster.api();
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": node, "containers": [
            {"name": "main", "image": IMAGE, "command": ["/bin/sh", "-c", script]}
        ]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("creating the pod");
    eventually(120, "the pod Running", || async {
        let p = serde_json::to_value(pods.get(name).await.ok()?).ok()?;
        (p["status"]["phase"] == "Running").then_some(p)
    })
    .await
}

#[tokio::test]
async fn kubelet_api_needs_a_cluster_client_certificate_refuses_attach_and_reports_missing_commands()
 {
    let cluster = Cluster::start().await;
    let (kubelet, _dir) = serving_node(&cluster).await;
    let node = kubelet.node_name().to_string();
    // kube-apiserver's nodes/proxy presents its kubelet client certificate.
    let (ok, out, err) = cluster
        .kubectl(&[
            "get",
            "--raw",
            &format!("/api/v1/nodes/{node}/proxy/healthz"),
        ])
        .await;
    assert!(ok, "{err}");
    assert_eq!(out, "ok");
    // Without a client certificate the handshake fails.
    let url = format!(
        "https://{}:{}/healthz",
        kubelet.config().host_ip,
        kubelet.api_port()
    );
    let curl = tokio::process::Command::new("curl")
        .args(["-sk", "--max-time", "10", &url])
        .output()
        .await
        .expect("curl");
    assert!(!curl.status.success(), "{curl:?}");

    running_pod(&cluster, &node, "quiet", "exec sleep 1000").await;
    let (ok, _, err) = cluster.kubectl(&["attach", "quiet", "-c", "main"]).await;
    assert!(!ok);
    assert!(
        err.contains("attach is not supported by localcluster's kubelet"),
        "{err}"
    );
    // A command that is not there: the shell's code, and why.
    let out = cluster
        .kubectl_output(&["exec", "quiet", "--", "no-such-command"], None)
        .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(127), "{stderr}");
    assert!(stderr.contains("no-such-command"), "{stderr}");
    kubelet.stop().await;
}

#[tokio::test]
async fn kubectl_exec_with_a_terminal_runs_a_session_in_the_container() {
    let cluster = Cluster::start().await;
    let (kubelet, _dir) = serving_node(&cluster).await;
    let node = kubelet.node_name().to_string();
    running_pod(
        &cluster,
        &node,
        "shell",
        "echo hi > /tmp/mark; exec sleep 1000",
    )
    .await;

    // kubectl needs a terminal of its own to ask for one.
    let pty = nix::pty::openpty(None, None).expect("openpty");
    let slave = std::fs::File::from(pty.slave);
    let mut cmd = cluster.kubectl_command(&["exec", "-it", "shell", "--", "/bin/sh"]);
    cmd.stdin(Stdio::from(slave.try_clone().expect("tty")))
        .stdout(Stdio::from(slave.try_clone().expect("tty")))
        .stderr(Stdio::from(slave))
        .kill_on_drop(true);
    // SAFETY: setsid(2) only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            nix::unistd::setsid()?;
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("kubectl exec -it");
    // Our copies of the terminal go, so reading it ends when kubectl does.
    drop(cmd);
    let mut master = tokio::fs::File::from_std(std::fs::File::from(pty.master));
    let script = "stty size; tty; echo term=$TERM; cat /tmp/mark; \
                  [ -t 0 ] && echo inter''active; exit 5\n";
    master.write_all(script.as_bytes()).await.expect("typing");
    let mut output = Vec::new();
    let read = tokio::time::timeout(Duration::from_mins(1), async {
        let mut buf = [0u8; 4096];
        loop {
            match master.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    output.extend_from_slice(&buf[..n]);
                    if String::from_utf8_lossy(&output).contains("interactive") {
                        // Let the exit come through.
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
        }
    })
    .await;
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("kubectl ends")
        .expect("kubectl status");
    let text = String::from_utf8_lossy(&output);
    assert!(read.is_ok(), "kubectl's terminal output: {text}");
    assert!(text.contains("/dev/pts/"), "{text}");
    assert!(text.contains("term=xterm"), "{text}");
    assert!(text.contains("hi\r\n"), "{text}");
    assert!(text.contains("interactive"), "{text}");
    assert_eq!(status.code(), Some(5), "{text}");
    kubelet.stop().await;
}

#[tokio::test]
async fn kubectl_port_forward_reaches_the_pods_loopback() {
    let cluster = Cluster::start().await;
    let (kubelet, _dir) = serving_node(&cluster).await;
    let node = kubelet.node_name().to_string();
    // Only on the pod's own 127.0.0.1: reachable through its network namespace only.
    running_pod(
        &cluster,
        &node,
        "server",
        "exec socat TCP-LISTEN:8080,bind=127.0.0.1,fork,reuseaddr SYSTEM:'echo hello from $(hostname); cat'",
    )
    .await;
    let mut child = cluster
        .kubectl_command(&["port-forward", "pod/server", ":8080"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl port-forward");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut seen = Vec::new();
    let port: u16 = tokio::time::timeout(Duration::from_mins(1), async {
        let mut buf = [0u8; 1024];
        loop {
            let n = stdout.read(&mut buf).await.expect("reading kubectl");
            assert!(
                n > 0,
                "kubectl port-forward ended: {}",
                String::from_utf8_lossy(&seen)
            );
            seen.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&seen);
            // "Forwarding from 127.0.0.1:41234 -> 8080"
            if let Some(port) = text
                .lines()
                .filter_map(|l| l.strip_prefix("Forwarding from 127.0.0.1:"))
                .find_map(|rest| rest.split(' ').next()?.parse().ok())
            {
                return port;
            }
        }
    })
    .await
    .expect("kubectl names its local port");
    // Two connections in a row, each a fresh stream to the pod.
    for round in 0..2 {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connecting to the forwarded port");
        conn.write_all(format!("ping {round}\n").as_bytes())
            .await
            .expect("writing");
        conn.shutdown().await.expect("closing our side");
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(30), conn.read_to_string(&mut answer))
            .await
            .expect("an answer within 30 s")
            .expect("reading");
        assert_eq!(answer, format!("hello from server\nping {round}\n"));
    }
    let _ = child.start_kill();
    kubelet.stop().await;
}
