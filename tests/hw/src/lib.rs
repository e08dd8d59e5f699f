//! The whole stack on one machine, for end-to-end tests: `localcluster up` as its own process (the
//! upstream control plane with kube-proxy, and one process kubelet, `node-1`), then KubeVirt
//! installed by `hack/install.sh` with the real `kubectl`, exactly as `hack/run.sh` does: the
//! operator manifest and the KubeVirt CR of `manifests/release/`, after which virt-operator
//! installs the CRDs, RBAC, certificates, virt-api (aggregated API and webhooks),
//! virt-controller and virt-handler. RBAC is enforced: the components run as the service
//! accounts of the install strategy and reach kube-apiserver through the `kubernetes` Service
//! (10.96.0.1, kube-proxy's rules).
//!
//! The binaries come from the cargo target dir the tests were built in (`cargo nextest run
//! --workspace` builds every package's binaries) or from `KUBEVIRT_RS_BIN_DIR`; the upstream
//! `kube` binary from `LOCALCLUSTER_KUBE`, else `localcluster/upstream/build.sh` (cached).

pub mod audit;

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The programs the stack runs; pods find them at `/usr/bin/<name>`.
pub const BINARIES: [&str; 9] = [
    "localcluster",
    "build-images",
    "virtctl",
    "virt-operator",
    "virt-api",
    "virt-controller",
    "virt-handler",
    "virt-launcher",
    "container-disk",
];

/// How long a poll waits between looks.
const POLL: Duration = Duration::from_millis(500);

/// The `kubernetes` Service, which pods reach kube-apiserver through (kube-proxy's DNAT).
const KUBERNETES_SERVICE: (Ipv4Addr, u16) = (Ipv4Addr::new(10, 96, 0, 1), 443);

/// Why the stack could not be brought up or queried.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error(
        "{binary} is not built in {dir}: run `cargo build -p localcluster -p controller -p handler -p launcher -p containerdisk --bins` or set KUBEVIRT_RS_BIN_DIR"
    )]
    MissingBinary { binary: String, dir: PathBuf },
    #[error("starting {command}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("the upstream binary")]
    Kube(#[source] localcluster::ControlPlaneError),
    #[error("localcluster exited ({status}); the end of its log {log}:\n{tail}")]
    ClusterExited {
        status: std::process::ExitStatus,
        log: PathBuf,
        /// Its log goes with the stack's directory: its end is kept here.
        tail: String,
    },
    #[error("timed out after {seconds} s waiting for {what} (last seen: {last})")]
    Timeout {
        what: String,
        seconds: u64,
        last: String,
    },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{error}\n{diagnostics}")]
    Diagnosed {
        error: Box<StackError>,
        diagnostics: String,
    },
}

/// A virt-handler pod: its name and IP (its console and REST server listen there on 8186).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerPod {
    pub name: String,
    pub ip: String,
}

/// A running localcluster with virt-controller and virt-handler deployed; stopped on drop.
pub struct Stack {
    dir: tempfile::TempDir,
    cluster: Child,
    nodes: usize,
    bins: PathBuf,
    repo: PathBuf,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("dir", &self.dir.path())
            .field("bins", &self.bins)
            .finish_non_exhaustive()
    }
}

/// The repository root (this crate lives in `tests/hw/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// Where the binaries are: `KUBEVIRT_RS_BIN_DIR`, else the profile dir of the running test
/// (`target/debug/deps/<test>` -> `target/debug`).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KUBEVIRT_RS_BIN_DIR") {
        return PathBuf::from(dir);
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| repo_root().join("target/debug"))
}

/// The images the stack runs, built from these binaries as `hack/release.sh` builds a
/// release's (uncompressed: they never leave the machine). Built once per set of inputs and kept
/// in `<bins>/e2e-images/<key>` for the next stack: about 13 s and 450 MiB of writes per test
/// otherwise. `localcluster up` only reads the layout (its store hard-links the blobs).
fn images(bins: &Path) -> Result<PathBuf, StackError> {
    let cache = bins.join("e2e-images");
    let layout = cache.join(images_key(bins));
    if layout.join("index.json").is_file() {
        return Ok(layout);
    }
    // One layout at a time: an older one belongs to binaries that are gone.
    if let Ok(old) = std::fs::read_dir(&cache) {
        for entry in old.flatten() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let partial = cache.join(format!(".partial-{}", std::process::id()));
    let mut build = Command::new(bins.join("build-images"));
    build
        .arg("--bin-dir")
        .arg(bins)
        .arg("--guest-dir")
        .arg(testguest::dir())
        .arg("--layout")
        .arg(&partial);
    run(&mut build, None)?;
    std::fs::rename(&partial, &layout)?;
    Ok(layout)
}

/// What the images are built from, as names, sizes and modification times: the programs in
/// the binaries' dir (`build-images` among them), the static container-disk next to it, the
/// test guest's files, and the loader's cache, which changes when the host's libraries (copied
/// into the base layer) do.
fn images_key(bins: &Path) -> String {
    use std::hash::{Hash as _, Hasher as _};
    use std::os::unix::fs::PermissionsExt as _;
    let listing = |dir: &Path| {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path())
    };
    let mut files: Vec<PathBuf> = listing(bins)
        .filter(|path| {
            std::fs::metadata(path).is_ok_and(|meta| meta.permissions().mode() & 0o111 != 0)
        })
        .chain(listing(&testguest::dir()))
        .collect();
    files.push(Path::new("/etc/ld.so.cache").to_path_buf());
    if let (Some(target), Some(profile)) = (bins.parent(), bins.file_name()) {
        files.push(
            target
                .join("x86_64-unknown-linux-gnu")
                .join(profile)
                .join("container-disk"),
        );
    }
    files.sort();
    let mut hasher = std::hash::DefaultHasher::new();
    for file in &files {
        let Ok(meta) = std::fs::metadata(file) else {
            continue;
        };
        if meta.is_file() {
            file.hash(&mut hasher);
            meta.len().hash(&mut hasher);
            meta.modified().ok().hash(&mut hasher);
        }
    }
    format!("{:016x}", hasher.finish())
}

fn run(cmd: &mut Command, input: Option<&str>) -> Result<String, StackError> {
    let command = format!("{cmd:?}");
    let mut child = cmd
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| StackError::Spawn {
            command: command.clone(),
            source,
        })?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(text.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(StackError::Failed {
            command,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// What a guest's greeting listener (the demo guest's port 8080, the network test's ports) says
/// on a new connection, trimmed, once it says something: the listener starts late in a boot
/// under TCG, so refused, reset and empty connections are retried until `timeout`.
pub fn greeting(to: SocketAddr, timeout: Duration) -> Result<String, StackError> {
    wait_for(&format!("a greeting from {to}"), timeout, || {
        let mut conn = TcpStream::connect_timeout(&to, Duration::from_secs(5))
            .map_err(|e| format!("{to}: {e}"))?;
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        let mut text = String::new();
        conn.read_to_string(&mut text)
            .map_err(|e| format!("{to}: {e}"))?;
        Ok((!text.is_empty()).then(|| text.trim().to_owned()))
    })
}

/// `spec.domain.firmware` booting the test guest's kernel and initrd straight from
/// localcluster's `kubevirt-rs/test-guest-kernel` image (kernelBoot), on the serial console.
pub fn test_guest_firmware() -> serde_json::Value {
    serde_json::json!({"kernelBoot": {
        "kernelArgs": "console=ttyS0",
        "container": {
            "image": "kubevirt-rs/test-guest-kernel:latest",
            "kernelPath": "/boot/vmlinuz",
            "initrdPath": "/boot/initrd.img",
            "imagePullPolicy": "IfNotPresent",
        },
    }})
}

/// Polls `probe` until it gives a value or `timeout` passes; `probe` also describes what it saw
/// last, for the timeout's message.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, StackError> {
    let deadline = Instant::now() + timeout;
    let mut last = String::from("nothing yet");
    loop {
        match probe() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(seen) => last = seen,
        }
        if Instant::now() >= deadline {
            return Err(StackError::Timeout {
                what: what.to_owned(),
                seconds: timeout.as_secs(),
                last,
            });
        }
        std::thread::sleep(POLL);
    }
}

impl Stack {
    /// Starts localcluster with one node and deploys the control plane on it; returns once
    /// virt-controller is available and virt-handler has made the node schedulable.
    pub fn up() -> Result<Self, StackError> {
        Self::up_nodes(1)
    }

    /// [`Stack::up`] with `nodes` nodes (`node-1`, ...), each schedulable before it returns.
    pub fn up_nodes(nodes: usize) -> Result<Self, StackError> {
        let bins = bin_dir();
        for binary in BINARIES {
            if !bins.join(binary).is_file() {
                return Err(StackError::MissingBinary {
                    binary: binary.to_owned(),
                    dir: bins,
                });
            }
        }
        let kube = localcluster::controlplane::kube_binary().map_err(StackError::Kube)?;
        let dir = tempfile::Builder::new()
            .prefix("kubevirt-rs-e2e")
            .tempdir()?;
        let images = images(&bins)?;
        let log = std::fs::File::create(dir.path().join("localcluster.log"))?;
        let cluster = Command::new(bins.join("localcluster"))
            .arg("up")
            .arg("--dir")
            .arg(dir.path())
            .args(["--port", "0", "--nodes", &nodes.to_string()])
            .arg("--kube")
            .arg(&kube)
            .arg("--image")
            .arg(&images)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|source| StackError::Spawn {
                command: "localcluster up".into(),
                source,
            })?;
        let mut stack = Self {
            dir,
            cluster,
            nodes,
            bins,
            repo: repo_root(),
        };
        stack.deploy()?;
        Ok(stack)
    }

    fn deploy(&mut self) -> Result<(), StackError> {
        let kubeconfig = self.kubeconfig();
        // `up` writes the kubeconfig once kube-apiserver is ready (up to its 180 s start
        // timeout on a busy machine), then starts the node.
        wait_for("localcluster's API server", Duration::from_mins(4), || {
            self.check_cluster()?;
            if !kubeconfig.exists() {
                return Err("no kubeconfig yet".into());
            }
            self.kubectl(&["get", "--raw", "/readyz"])
                .map(|_| Some(()))
                .map_err(|e| e.to_string())
        })
        .map_err(|e| self.exited_or(e))?;
        for node in self.node_names() {
            wait_for(
                &format!("{node} to be Ready"),
                Duration::from_mins(2),
                || {
                    self.check_cluster()?;
                    let ready = self
                        .kubectl(&[
                            "get",
                            "node",
                            &node,
                            "-o",
                            "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                        ])
                        .map_err(|e| e.to_string())?;
                    (ready == "True")
                        .then_some(Some(()))
                        .ok_or_else(|| format!("Ready={ready:?}"))
                },
            )
            .map_err(|e| self.exited_or(e))?;
        }
        // Pods reach the API only once kube-proxy has programmed the `kubernetes` Service; its
        // rules cover the host's own connections too.
        let service = SocketAddr::from(KUBERNETES_SERVICE);
        wait_for(
            "kube-proxy to serve the kubernetes Service (10.96.0.1:443)",
            Duration::from_mins(2),
            || {
                self.check_cluster()?;
                TcpStream::connect_timeout(&service, Duration::from_secs(2))
                    .map(|_| Some(()))
                    .map_err(|e| format!("{service}: {e}"))
            },
        )
        .map_err(|e| self.exited_or(e))?;
        let mut install = Command::new(self.repo.join("hack/install.sh"));
        install.env("KUBECONFIG", &kubeconfig);
        run(&mut install, None).map_err(|e| self.with_component_logs(e))?;
        for node in self.node_names() {
            wait_for(
                &format!("virt-handler to make {node} schedulable"),
                Duration::from_mins(3),
                || {
                    self.check_cluster()?;
                    let label = self
                        .kubectl(&[
                            "get",
                            "node",
                            &node,
                            "-o",
                            "jsonpath={.metadata.labels.kubevirt\\.io/schedulable}",
                        ])
                        .map_err(|e| e.to_string())?;
                    (label == "true")
                        .then_some(Some(()))
                        .ok_or_else(|| format!("kubevirt.io/schedulable={label:?}"))
                },
            )
            .map_err(|e| self.with_component_logs(e))?;
        }
        Ok(())
    }

    /// The nodes' names: `node-1`, `node-2`, ...
    pub fn node_names(&self) -> Vec<String> {
        (1..=self.nodes).map(|i| format!("node-{i}")).collect()
    }

    /// An error if `localcluster up` has exited.
    fn check_cluster(&mut self) -> Result<(), String> {
        match self.cluster.try_wait() {
            Ok(Some(status)) => Err(format!(
                "localcluster exited ({status}); see {}",
                self.dir.path().join("localcluster.log").display()
            )),
            _ => Ok(()),
        }
    }

    /// `e`, or that localcluster exited if it has.
    fn exited_or(&mut self, e: StackError) -> StackError {
        match self.cluster.try_wait() {
            Ok(Some(status)) => {
                let log = self.dir.path().join("localcluster.log");
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                StackError::ClusterExited { status, log, tail }
            }
            _ => e,
        }
    }

    /// `error` with what a reader needs to tell why: the VMIs, migrations and pods of every
    /// namespace, why a container waits, the newest events, and the end of every KubeVirt
    /// component's log (read from the nodes' log directories, so it works without the kubelet
    /// API).
    pub fn with_component_logs(&self, error: StackError) -> StackError {
        use std::fmt::Write as _;
        let mut diagnostics = String::new();
        for (what, args) in [
            (
                "VMIs, migrations and pods",
                &["get", "vmi,vmim,pods", "-A", "-o", "wide"][..],
            ),
            (
                "waiting containers",
                &[
                    "get",
                    "pods",
                    "-A",
                    "-o",
                    r#"jsonpath={range .items[*]}{.metadata.name}: {.status.containerStatuses[*].state.waiting.message}{"\n"}{end}"#,
                ][..],
            ),
            (
                "newest events",
                &["get", "events", "-A", "--sort-by=.lastTimestamp"][..],
            ),
        ] {
            if let Ok(out) = self.kubectl(args) {
                let lines: Vec<&str> = out.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                let _ = write!(diagnostics, "\n--- {what}:\n{tail}");
            }
        }
        for (pod, container, log) in self.pod_logs("kubevirt") {
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(25)..].join("\n");
            let _ = write!(diagnostics, "\n--- {pod}/{container}:\n{tail}");
        }
        StackError::Diagnosed {
            error: Box::new(error),
            diagnostics,
        }
    }

    /// Every container log of the pods in `namespace` on the node:
    /// `(pod, container, text)`, all restarts concatenated in order.
    pub fn pod_logs(&self, namespace: &str) -> Vec<(String, String, String)> {
        let roots: Vec<PathBuf> = self
            .node_names()
            .iter()
            .map(|n| self.dir.path().join("nodes").join(n).join("var/log/pods"))
            .collect();
        let mut out = Vec::new();
        let mut pods: Vec<PathBuf> = roots
            .iter()
            .flat_map(std::fs::read_dir)
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{namespace}_")))
            })
            .collect();
        pods.sort();
        for pod_dir in pods {
            let pod = pod_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let mut containers: Vec<PathBuf> = std::fs::read_dir(&pod_dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect();
            containers.sort();
            for container_dir in containers {
                let mut runs: Vec<(u32, PathBuf)> = std::fs::read_dir(&container_dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter_map(|e| {
                        let n = e.file_name().to_str()?.strip_suffix(".log")?.parse().ok()?;
                        Some((n, e.path()))
                    })
                    .collect();
                runs.sort();
                let text: String = runs
                    .iter()
                    .filter_map(|(_, p)| std::fs::read_to_string(p).ok())
                    .collect();
                let container = container_dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                out.push((pod.clone(), container, text));
            }
        }
        out
    }

    /// The kubeconfig `localcluster up` wrote.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// The state directory (kubeconfig, log, node roots).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs kubectl against the stack; its stdout.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, StackError> {
        self.run_kubectl(args, None)
    }

    /// Builds the component images again under `tag` (the same content, so the same layers)
    /// and loads them into the node's image store, as a user loads a new release before
    /// setting the KubeVirt CR's `imageTag`.
    pub fn load_components_tagged(&self, tag: &str) -> Result<(), StackError> {
        let bins = bin_dir();
        let layout = self.dir.path().join(format!("images-{tag}"));
        run(
            Command::new(bins.join("build-images"))
                .arg("--bin-dir")
                .arg(&bins)
                .args(["--set", "components", "--tag", tag])
                .arg("--layout")
                .arg(&layout),
            None,
        )?;
        run(
            Command::new(bins.join("localcluster"))
                .arg("load")
                .arg("--dir")
                .arg(self.dir.path())
                .arg(&layout),
            None,
        )?;
        Ok(())
    }

    /// `virtctl` as the cluster admin.
    pub fn virtctl(&self, args: &[&str]) -> Result<String, StackError> {
        self.virtctl_as(&self.kubeconfig(), args)
    }

    /// `virtctl` with another kubeconfig (another user).
    pub fn virtctl_as(&self, kubeconfig: &Path, args: &[&str]) -> Result<String, StackError> {
        run(
            Command::new(bin_dir().join("virtctl"))
                .arg("--kubeconfig")
                .arg(kubeconfig)
                .args(args),
            None,
        )
    }

    /// `localcluster restart`: SIGKILLs a control-plane component (`kube-apiserver`, ...) and
    /// starts it again, or restarts a node's kubelet (`kubelet/node-1`, its pods running on);
    /// returns once it runs (kube-apiserver: once ready).
    pub fn restart(&self, component: &str) -> Result<String, StackError> {
        run(
            Command::new(self.bins.join("localcluster"))
                .arg("restart")
                .arg("--dir")
                .arg(self.dir.path())
                .arg(component),
            None,
        )
    }

    /// `manifests/examples/vm-demo.yaml` as JSON (kubectl reads the YAML), for a test to adapt.
    pub fn demo_vm(&self) -> Result<serde_json::Value, StackError> {
        let manifest = repo_root().join("manifests/examples/vm-demo.yaml");
        let json = self.kubectl(&[
            "create",
            "--dry-run=client",
            "-o",
            "json",
            "-f",
            &manifest.display().to_string(),
        ])?;
        Ok(serde_json::from_str(&json).map_err(std::io::Error::other)?)
    }

    /// The launcher pods in the default namespace, one `pod/<name>` per line.
    pub fn launcher_pods(&self) -> Result<String, StackError> {
        self.kubectl(&[
            "get",
            "pods",
            "-l",
            "kubevirt.io=virt-launcher",
            "-o",
            "name",
        ])
    }

    /// The virt-handler pod that is Ready and not being deleted, if there is one.
    pub fn ready_handler_pod(&self) -> Result<Option<HandlerPod>, String> {
        let out = self
            .kubectl(&[
                "-n",
                "kubevirt",
                "get",
                "pods",
                "-l",
                "kubevirt.io=virt-handler",
                "-o",
                "json",
            ])
            .map_err(|e| e.to_string())?;
        let pods: serde_json::Value = serde_json::from_str(&out).map_err(|e| e.to_string())?;
        let ready = pods["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["metadata"]["deletionTimestamp"].is_null() && is_ready(p));
        Ok(ready.and_then(|p| {
            Some(HandlerPod {
                name: p["metadata"]["name"].as_str()?.to_owned(),
                ip: p["status"]["podIP"].as_str()?.to_owned(),
            })
        }))
    }

    /// `kubectl apply` of one object; panics naming it if kubectl refuses.
    pub fn apply(&self, manifest: &serde_json::Value) {
        self.kubectl_with_input(&["apply", "-f", "-"], &manifest.to_string())
            .unwrap_or_else(|e| panic!("kubectl apply {}: {e}", manifest["metadata"]["name"]));
    }

    /// Runs kubectl with `input` on its stdin.
    pub fn kubectl_with_input(&self, args: &[&str], input: &str) -> Result<String, StackError> {
        self.run_kubectl(args, Some(input))
    }

    fn run_kubectl(&self, args: &[&str], input: Option<&str>) -> Result<String, StackError> {
        let kubectl = localcluster::kubectl::Kubectl::new(self.kubeconfig())
            .cache_dir(self.dir.path().join("kubectl-cache"));
        run(&mut kubectl.command(args), input)
    }

    /// An object as JSON, or `None` when it does not exist.
    pub fn get_json(
        &self,
        namespace: &str,
        resource: &str,
        name: &str,
    ) -> Result<Option<serde_json::Value>, StackError> {
        match self.kubectl(&["-n", namespace, "get", resource, name, "-o", "json"]) {
            Ok(out) => Ok(Some(
                serde_json::from_str(&out).map_err(std::io::Error::other)?,
            )),
            Err(StackError::Failed { stderr, .. }) if stderr.contains("NotFound") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The VMI `default/<name>` once it runs with its guest agent connected; until then what
    /// it is, for [`wait_for`]'s message.
    pub fn running_with_agent(&self, name: &str) -> Result<Option<serde_json::Value>, String> {
        let vmi = self
            .get_json("default", "vmi", name)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no VMI {name}"))?;
        let agent = vmi["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "AgentConnected" && c["status"] == "True");
        if vmi["status"]["phase"] == "Running" && agent {
            Ok(Some(vmi))
        } else {
            Err(format!(
                "{name}: phase {}, agent {agent}",
                vmi["status"]["phase"]
            ))
        }
    }

    /// The launcher's private dir for a VMI, as seen from the node:
    /// `<node root>/var/lib/kubelet/pods/<pod uid>/volumes/kubernetes.io~empty-dir/private/<vmi uid>`.
    pub fn vmi_private_dir(&self, vmi: &serde_json::Value) -> Option<PathBuf> {
        let status = &vmi["status"];
        let node = status["nodeName"].as_str()?;
        // During and after a migration the VMI has a pod on each node.
        let pod = status["activePods"]
            .as_object()?
            .iter()
            .find(|(_, n)| n.as_str() == Some(node))
            .map(|(p, _)| p)?;
        let uid = vmi["metadata"]["uid"].as_str()?;
        Some(
            self.dir
                .path()
                .join("nodes")
                .join(node)
                .join("var/lib/kubelet/pods")
                .join(pod)
                .join("volumes/kubernetes.io~empty-dir/private")
                .join(uid),
        )
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // A failed test names this directory in its message: keep the logs it points to.
        if std::thread::panicking() {
            self.dir.disable_cleanup(true);
        }
        // `localcluster up` tears its pods down (SIGTERM, then SIGKILL) on SIGTERM.
        if let Ok(pid) = i32::try_from(self.cluster.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_mins(1);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.cluster.try_wait() {
                return;
            }
            std::thread::sleep(POLL);
        }
        let _ = self.cluster.kill();
        let _ = self.cluster.wait();
    }
}

/// `virtctl console` in a real terminal (tmux, on its own server socket).
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    fn start(dir: &Path, command: &str) -> Result<Self, String> {
        let t = Tmux {
            socket: dir.join("tmux.sock"),
        };
        t.run(&[
            "new-session",
            "-d",
            "-s",
            "console",
            "-x",
            "160",
            "-y",
            "40",
            command,
        ])?;
        Ok(t)
    }

    fn run(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .map_err(|e| format!("running tmux (hack/deps.sh installs it): {e}"))?;
        if !out.status.success() {
            return Err(format!("tmux {args:?}: {out:?}"));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "console"])
            .unwrap_or_default()
    }

    fn wait_for_text(&self, what: &str, text: &str) -> Result<(), String> {
        wait_for(what, Duration::from_mins(2), || {
            Ok(self.screen().contains(text).then_some(()))
        })
        .map_err(|e| format!("{e}; screen:\n{}", self.screen()))
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .output();
    }
}

/// Whether an object's (a pod's, a VMI's) `Ready` condition is `True`.
pub fn is_ready(object: &serde_json::Value) -> bool {
    object["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

/// A whole serial console session through kube-apiserver, virt-api, virt-handler's console
/// server and the launcher: `virtctl console <vm>` in a terminal, the guest shell's prompt,
/// `echo <word>-$((6*7))` answered with `<word>-42`, and Ctrl+] leaving virtctl. The test
/// guest's shell prompt is `<vm>:~#`.
pub fn console_round_trip(stack: &Stack, vm: &str, word: &str) -> Result<(), String> {
    let tmux = Tmux::start(
        stack.dir(),
        &format!(
            "{} --kubeconfig {} console {vm}",
            bin_dir().join("virtctl").display(),
            stack.kubeconfig().display()
        ),
    )?;
    tmux.wait_for_text(
        "the console banner",
        &format!("Successfully connected to {vm} console"),
    )?;
    wait_for("the guest's shell prompt", Duration::from_mins(2), || {
        tmux.run(&["send-keys", "-t", "console", "", "Enter"])?;
        Ok(tmux.screen().contains(&format!("{vm}:~#")).then_some(()))
    })
    .map_err(|e| format!("{e}; screen:\n{}", tmux.screen()))?;
    tmux.run(&[
        "send-keys",
        "-t",
        "console",
        &format!("echo {word}-$((6*7))"),
        "Enter",
    ])?;
    tmux.wait_for_text("the command's output", &format!("{word}-42"))?;
    // Ctrl+] leaves.
    tmux.run(&["send-keys", "-t", "console", "C-]"])?;
    wait_for("virtctl console to exit", Duration::from_secs(30), || {
        let panes = Command::new("tmux")
            .arg("-S")
            .arg(&tmux.socket)
            .args(["list-panes", "-a"])
            .output()
            .map_err(|e| e.to_string())?;
        (!panes.status.success())
            .then_some(Some(()))
            .ok_or_else(|| "still running".to_owned())
    })
    .map_err(|e| format!("{e}; screen:\n{}", tmux.screen()))?;
    Ok(())
}

/// The processes of the pod with this uid (their cgroup names it, as the kubelet lays cgroups
/// out): each pid with its `argv[0]`.
pub fn pod_processes(pod_uid: &str) -> Vec<(u32, String)> {
    let needle = format!("pod{pod_uid}");
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        let in_pod =
            std::fs::read_to_string(entry.path().join("cgroup")).is_ok_and(|c| c.contains(&needle));
        let argv0 = std::fs::read(entry.path().join("cmdline"))
            .ok()
            .and_then(|c| {
                c.split(|b| *b == 0)
                    .next()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
            })
            .unwrap_or_default();
        if in_pod {
            out.push((pid, argv0));
        }
    }
    out
}

/// SIGKILLs the processes of a pod whose `argv[0]` ends with `program`; how many.
pub fn kill_in_pod(pod_uid: &str, program: &str) -> usize {
    let pids: Vec<u32> = pod_processes(pod_uid)
        .into_iter()
        .filter(|(_, argv0)| argv0.ends_with(program))
        .map(|(pid, _)| pid)
        .collect();
    for pid in &pids {
        let _ = kill(
            Pid::from_raw(i32::try_from(*pid).unwrap_or(i32::MAX)),
            Signal::SIGKILL,
        );
    }
    pids.len()
}

/// The pids whose command line starts with `argv0` and contains `marker`.
pub fn processes(argv0: &str, marker: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.first().is_some_and(|a| a == argv0) && args.iter().any(|a| a.contains(marker)) {
            out.push(pid);
        }
    }
    out
}
