//! The virtctl binary against a stand-in API server (plain HTTP, reached through a kubeconfig
//! like any cluster): request paths and bodies, output lines, exit codes, websockets.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const BASE: &str = "/apis/subresources.kubevirt.io/v1/namespaces";

#[derive(Debug, Clone, PartialEq)]
struct Seen {
    method: String,
    uri: String,
    body: String,
}

struct Server {
    dir: tempfile::TempDir,
    seen: Arc<Mutex<Vec<Seen>>>,
    _runtime: tokio::runtime::Runtime,
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": message, "reason": reason, "code": code,
    });
    (
        StatusCode::from_u16(code).unwrap(),
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn record(seen: &Mutex<Vec<Seen>>, method: &Method, uri: &Uri, body: &Bytes) -> Response {
    let earlier = {
        let mut seen = seen.lock().unwrap();
        let earlier = seen.iter().filter(|s| s.uri == uri.to_string()).count();
        seen.push(Seen {
            method: method.to_string(),
            uri: uri.to_string(),
            body: String::from_utf8_lossy(body).into_owned(),
        });
        earlier
    };
    let path = uri.path();
    // Volumes: the DataVolume `dv1` and the claim `pvc1`; a cluster without CDI has no
    // DataVolume API at all.
    if let Some(dv) =
        path.strip_prefix("/apis/cdi.kubevirt.io/v1beta1/namespaces/ctxns/datavolumes/")
    {
        return if dv == "dv1" {
            "{}".into_response()
        } else {
            status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            )
        };
    }
    if let Some(pvc) = path.strip_prefix("/api/v1/namespaces/ctxns/persistentvolumeclaims/") {
        return if pvc == "pvc1" {
            "{}".into_response()
        } else {
            status(
                404,
                "NotFound",
                &format!("persistentvolumeclaims {pvc:?} not found"),
            )
        };
    }
    // A VMI of its own: no VM of that name.
    if path.contains("/virtualmachines/standalone/") {
        return status(
            404,
            "NotFound",
            r#"virtualmachine.kubevirt.io "standalone" not found"#,
        );
    }
    // The object changes under the first two requests (a JSON patch `test` fails).
    if path.contains("/busy/") && earlier < 2 {
        return status(
            422,
            "Invalid",
            "the server rejected our request due to an error in our request",
        );
    }
    if path.contains("/conflict/") {
        return status(
            409,
            "Conflict",
            r#"Operation cannot be fulfilled on virtualmachine.kubevirt.io "conflict": Unable to add volume [pvc1] because volume with that name already exists"#,
        );
    }
    if path.contains("/unavailable/") {
        return status(
            503,
            "InternalError",
            "cannot connect to the launcher's serial socket",
        );
    }
    if path.contains("/missing/") {
        return status(
            404,
            "NotFound",
            r#"virtualmachines.kubevirt.io "missing" not found"#,
        );
    }
    if method == Method::GET && path == "/apis/kubevirt.io/v1/namespaces/ctxns/virtualmachines/demo"
    {
        return r#"{"apiVersion":"kubevirt.io/v1","kind":"VirtualMachine","metadata":{"name":"demo","namespace":"ctxns","uid":"u-1"},"spec":{"template":{"spec":{"domain":{"devices":{}}}}}}"#.into_response();
    }
    if method == Method::POST && path.ends_with("/services") {
        return (StatusCode::CREATED, body.clone()).into_response();
    }
    if path.ends_with("/guestosinfo") {
        return r#"{"guestAgentVersion":"5.2.0","hostname":"demo","os":{"name":"Debian GNU/Linux","id":"debian"}}"#.into_response();
    }
    if path.ends_with("/vnc/screenshot") {
        return b"\x89PNG\r\n".to_vec().into_response();
    }
    if path == "/apis/subresources.kubevirt.io/v1/version" {
        return r#"{"gitVersion":"v1.5.0","gitCommit":"abc","gitTreeState":"clean","buildDate":"2025-01-01T00:00:00Z","goVersion":"go1.23","compiler":"gc","platform":"linux/amd64"}"#.into_response();
    }
    StatusCode::ACCEPTED.into_response()
}

/// Greets, then echoes every binary frame back upper-cased.
async fn echo(mut socket: WebSocket) {
    let _ = socket
        .send(Message::Binary(Bytes::from_static(b"login: ")))
        .await;
    while let Some(Ok(msg)) = socket.recv().await {
        match msg {
            Message::Binary(b) => {
                let up = b.to_ascii_uppercase();
                if socket.send(Message::Binary(up.into())).await.is_err() {
                    return;
                }
            }
            Message::Close(_) => return,
            _ => {}
        }
    }
}

async fn stream(ws: WebSocketUpgrade) -> Response {
    ws.protocols(["plain.kubevirt.io"]).on_upgrade(echo)
}

impl Server {
    fn start() -> Server {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let s = seen.clone();
        let app = Router::new()
            .route(
                &format!("{BASE}/{{ns}}/virtualmachineinstances/{{name}}/console"),
                get(stream),
            )
            .route(
                &format!("{BASE}/{{ns}}/virtualmachineinstances/{{name}}/vnc"),
                get(stream),
            )
            .route(
                &format!("{BASE}/{{ns}}/virtualmachines/{{name}}/portforward/{{port}}/tcp"),
                get(stream),
            )
            .fallback(move |m: Method, u: Uri, b: Bytes| {
                let s = s.clone();
                async move { record(&s, &m, &u, &b) }
            });
        runtime.spawn(async move { axum::serve(listener, app).await });

        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = format!(
            "apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: http://127.0.0.1:{port}
users:
- name: someone
  user:
    token: abc
contexts:
- name: fake
  context:
    cluster: fake
    user: someone
    namespace: ctxns
current-context: fake
"
        );
        std::fs::write(dir.path().join("config"), kubeconfig).unwrap();
        Server {
            dir,
            seen,
            _runtime: runtime,
        }
    }

    fn virtctl(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_virtctl"));
        cmd.env("KUBECONFIG", self.dir.path().join("config"))
            .env_remove("KUBERNETES_SERVICE_HOST");
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.virtctl().args(args).output().unwrap()
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn start_goes_to_the_contexts_namespace_or_the_flags() {
    let server = Server::start();
    let out = server.run(&["start", "demo"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "VM demo was scheduled to start\n");
    let out = server.run(&["start", "demo", "-n", "team", "--paused", "--dry-run"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "Dry Run execution\nVM demo was scheduled to start\n"
    );
    let seen = server.seen();
    assert_eq!(seen[0].method, "PUT");
    assert_eq!(
        seen[0].uri,
        format!("{BASE}/ctxns/virtualmachines/demo/start")
    );
    assert_eq!(seen[0].body, "{}");
    assert_eq!(
        seen[1].uri,
        format!("{BASE}/team/virtualmachines/demo/start")
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&seen[1].body).unwrap(),
        serde_json::json!({"paused": true, "dryRun": ["All"]})
    );
}

#[test]
fn stop_rules_and_errors() {
    let server = Server::start();
    let out = server.run(&["stop", "demo", "--force"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "Must both use --force=true and set --grace-period.\n"
    );
    assert!(server.seen().is_empty());

    let out = server.run(&["stop", "demo", "--force", "--grace-period=0"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "VM demo was scheduled to stop\n");
    assert_eq!(server.seen()[0].body, r#"{"gracePeriod":0}"#);

    let out = server.run(&["stop", "missing"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "error stopping VirtualMachine virtualmachines.kubevirt.io \"missing\" not found (HTTP 404 Not Found)\n"
    );
}

#[test]
fn a_503_is_reported_at_once_not_retried() {
    let server = Server::start();
    let out = server.run(&["pause", "vmi", "unavailable"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot connect to the launcher's serial socket"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(server.seen().len(), 1, "one request, no retries");
}

#[test]
fn vmi_actions_and_guest_info() {
    let server = Server::start();
    let out = server.run(&["pause", "vmi", "demo"]);
    assert_eq!(text(&out.stdout), "VMI demo was scheduled to pause\n");
    let out = server.run(&["freeze", "demo", "--unfreeze-timeout", "90s"]);
    assert_eq!(text(&out.stdout), "VMI demo was scheduled to freeze\n");
    let out = server.run(&["soft-reboot", "demo"]);
    assert_eq!(text(&out.stdout), "VMI demo was scheduled to soft-reboot\n");
    let seen = server.seen();
    assert_eq!(
        seen[0].uri,
        format!("{BASE}/ctxns/virtualmachineinstances/demo/pause")
    );
    assert_eq!(seen[1].body, r#"{"unfreezeTimeout":"1m30s"}"#);
    assert_eq!(
        seen[2].uri,
        format!("{BASE}/ctxns/virtualmachineinstances/demo/softreboot")
    );

    let out = server.run(&["guestosinfo", "demo"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "{\n  \"guestAgentVersion\": \"5.2.0\",\n  \"hostname\": \"demo\",\n  \"os\": {\n    \"name\": \"Debian GNU/Linux\",\n    \"id\": \"debian\"\n  }\n}\n"
    );

    let out = server.run(&["pause", "pod", "demo"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn screenshot_and_version() {
    let server = Server::start();
    let png = server.dir.path().join("shot.png");
    let out = server.run(&["vnc", "screenshot", "demo", "-f", png.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(std::fs::read(&png).unwrap(), b"\x89PNG\r\n");
    assert_eq!(
        server.seen()[0].uri,
        format!("{BASE}/ctxns/virtualmachineinstances/demo/vnc/screenshot?moveCursor=false")
    );

    let out = server.run(&["version"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("Client Version: version.Info{GitVersion:\"v"));
    assert_eq!(
        lines[1],
        r#"Server Version: version.Info{GitVersion:"v1.5.0", GitCommit:"abc", GitTreeState:"clean", BuildDate:"2025-01-01T00:00:00Z", GoVersion:"go1.23", Compiler:"gc", Platform:"linux/amd64"}"#
    );
}

#[test]
fn console_without_a_tty_copies_both_ways_until_the_escape() {
    let server = Server::start();
    let mut child = server
        .virtctl()
        .args(["console", "demo"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut greeting = [0u8; 7];
    stdout.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting, b"login: ");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"root\n").unwrap();
    let mut echoed = [0u8; 5];
    stdout.read_exact(&mut echoed).unwrap();
    assert_eq!(&echoed, b"ROOT\n");
    stdin.write_all(b"\x1d").unwrap();
    let status = child.wait().unwrap();
    assert!(status.success());
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(
        stderr,
        "Successfully connected to demo console. Press Ctrl+] or Ctrl+5 to exit console.\n"
    );
}

#[test]
fn vnc_proxy_prints_its_port_and_splices_one_client() {
    let server = Server::start();
    let mut child = server
        .virtctl()
        .args(["vnc", "demo", "--proxy-only"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: serde_json::Value = serde_json::from_str(&line).unwrap();
    let port = u16::try_from(port["port"].as_u64().unwrap()).unwrap();
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut greeting = [0u8; 7];
    conn.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting, b"login: ");
    conn.write_all(b"rfb").unwrap();
    let mut echoed = [0u8; 3];
    conn.read_exact(&mut echoed).unwrap();
    assert_eq!(&echoed, b"RFB");
    drop(conn);
    let status = child.wait().unwrap();
    assert!(status.success());
    // Once a viewer is connected virtctl looks the VMI up to warn if it is paused.
    let seen = server.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].uri,
        "/apis/kubevirt.io/v1/namespaces/ctxns/virtualmachineinstances/demo"
    );
}

#[test]
fn port_forward_stdio_is_sshs_proxy() {
    let server = Server::start();
    let mut child = server
        .virtctl()
        .args(["port-forward", "--stdio=true", "vm/demo/team", "22"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut greeting = [0u8; 7];
    stdout.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting, b"login: ");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"ssh-2.0").unwrap();
    let mut echoed = [0u8; 7];
    stdout.read_exact(&mut echoed).unwrap();
    assert_eq!(&echoed, b"SSH-2.0");
    drop(stdin);
    assert!(child.wait().unwrap().success());
}

#[test]
fn expose_creates_a_service_for_the_vms_pods() {
    let server = Server::start();
    let out = server.run(&[
        "expose", "vm", "demo", "--name", "demo-ssh", "--port", "22", "--type", "NodePort",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "Service demo-ssh successfully created for vm demo\n"
    );
    let seen = server.seen();
    assert_eq!(
        (seen[0].method.as_str(), seen[0].uri.as_str()),
        (
            "GET",
            "/apis/kubevirt.io/v1/namespaces/ctxns/virtualmachines/demo"
        )
    );
    assert_eq!(
        (seen[1].method.as_str(), seen[1].uri.as_str()),
        ("POST", "/api/v1/namespaces/ctxns/services?")
    );
    let svc: serde_json::Value = serde_json::from_str(&seen[1].body).unwrap();
    assert_eq!(
        svc,
        serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {
                "name": "demo-ssh", "namespace": "ctxns",
                "ownerReferences": [{
                    "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": "demo",
                    "uid": "u-1", "controller": true, "blockOwnerDeletion": false,
                }],
            },
            "spec": {
                "ports": [{"port": 22, "protocol": "TCP"}],
                "selector": {"vmi.kubevirt.io/id": "demo"},
                "type": "NodePort",
            },
        })
    );

    // No ports on the VM's pod network and no --port: nothing is created.
    let out = server.run(&["expose", "vm", "demo", "--name", "s"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "couldn't find port via --port flag or introspection\n"
    );
    let out = server.run(&["expose", "vm", "missing", "--name", "s", "--port", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).starts_with("error fetching VirtualMachine: "),
        "{}",
        text(&out.stderr)
    );
    // Bad flags fail before the cluster is asked.
    let before = server.seen().len();
    let out = server.run(&["expose", "pod", "demo", "--name", "s"]);
    assert_eq!(text(&out.stderr), "unsupported resource type: pod\n");
    let out = server.run(&["expose", "vm", "demo", "--name", "s", "--protocol", "sctp"]);
    assert_eq!(text(&out.stderr), "unknown protocol: sctp\n");
    assert_eq!(server.seen().len(), before);
}

#[test]
fn create_vm_prints_a_manifest_without_a_cluster() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_virtctl"))
        .args([
            "create",
            "vm",
            "--name",
            "demo",
            "--volume-containerdisk",
            "src:img",
        ])
        .env("KUBECONFIG", "/nonexistent")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let vm: serde_json::Value = serde_saphyr::from_str(&text(&out.stdout)).unwrap();
    assert_eq!(vm["metadata"]["name"], "demo");
    assert_eq!(
        vm["spec"]["template"]["spec"]["volumes"][0]["containerDisk"]["image"],
        "img"
    );
}

#[test]
fn addvolume_finds_the_source_and_falls_back_to_the_vmi() {
    let server = Server::start();
    let out = server.run(&["addvolume", "demo", "--volume-name=pvc1", "--serial=s1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "Successfully submitted add volume request to VM demo for volume pvc1\n"
    );
    let seen = server.seen();
    let uris: Vec<&str> = seen.iter().map(|s| s.uri.as_str()).collect();
    assert_eq!(
        uris,
        [
            "/apis/cdi.kubevirt.io/v1beta1/namespaces/ctxns/datavolumes/pvc1",
            "/api/v1/namespaces/ctxns/persistentvolumeclaims/pvc1",
            &format!("{BASE}/ctxns/virtualmachines/demo/addvolume"),
        ]
    );
    assert_eq!(seen[2].method, "PUT");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&seen[2].body).unwrap(),
        serde_json::json!({
            "name": "pvc1",
            "disk": {"name": "", "disk": {"bus": "scsi"}, "serial": "s1"},
            "volumeSource": {"persistentVolumeClaim": {"claimName": "pvc1", "hotpluggable": true}},
        })
    );

    // A DataVolume, a VMI without a VM, a dry run.
    let out = server.run(&[
        "addvolume",
        "standalone",
        "--volume-name=dv1",
        "--disk-name=data",
        "--dry-run",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "Dry Run execution\nSuccessfully submitted add volume request to VM standalone for volume dv1\n"
    );
    let seen = &server.seen()[3..];
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(
        seen[2].uri,
        format!("{BASE}/ctxns/virtualmachineinstances/standalone/addvolume")
    );
    let body: serde_json::Value = serde_json::from_str(&seen[2].body).unwrap();
    assert_eq!(body["name"], "data");
    assert_eq!(body["dryRun"], serde_json::json!(["All"]));
    assert_eq!(
        body["volumeSource"],
        serde_json::json!({"dataVolume": {"name": "dv1", "hotpluggable": true}})
    );
}

#[test]
fn addvolume_errors_are_kubevirts() {
    let server = Server::start();
    let out = server.run(&["addvolume", "demo", "--volume-name=nothing"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "error adding volume, Volume nothing is not a DataVolume or PersistentVolumeClaim\n"
    );
    let out = server.run(&["addvolume", "demo", "--volume-name=pvc1", "--bus=sata"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "Invalid bus type 'sata' for disk. Only 'scsi' and 'virtio' are supported.\n"
    );
    let out = server.run(&["addvolume", "conflict", "--volume-name=pvc1"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "error adding volume, Operation cannot be fulfilled on virtualmachine.kubevirt.io \"conflict\": Unable to add volume [pvc1] because volume with that name already exists (HTTP 409 Conflict)\n"
    );
    assert!(
        !server
            .seen()
            .iter()
            .any(|s| s.uri.contains("virtualmachineinstances")),
        "a VM's refusal is final"
    );
    let out = server.run(&["addvolume", "demo"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("--volume-name"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn removevolume_retries_a_concurrent_change() {
    let server = Server::start();
    let out = server.run(&["removevolume", "busy", "--volume-name=pvc1", "--persist"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "Successfully submitted remove volume request to VM busy for volume pvc1\n"
    );
    let seen = server.seen();
    assert_eq!(
        seen.len(),
        3,
        "two refusals, then the request went through: {seen:?}"
    );
    for s in &seen {
        assert_eq!(
            s.uri,
            format!("{BASE}/ctxns/virtualmachines/busy/removevolume")
        );
        assert_eq!(s.body, r#"{"name":"pvc1"}"#);
    }
    let out = server.run(&[
        "removevolume",
        "standalone",
        "--volume-name=pvc1",
        "--dry-run",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let seen = server.seen();
    assert_eq!(
        seen[4].uri,
        format!("{BASE}/ctxns/virtualmachineinstances/standalone/removevolume")
    );
    assert_eq!(seen[4].body, r#"{"name":"pvc1","dryRun":["All"]}"#);
    let out = server.run(&["removevolume", "missing", "--volume-name=pvc1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).starts_with("error removing volume, "),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn usage_errors_exit_1() {
    let server = Server::start();
    let out = server.run(&["start"]);
    assert_eq!(out.status.code(), Some(1));
    let out = server.run(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
}
