//! `localcluster up` / `localcluster down`.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use localcluster::{ControlPlane, ControlPlaneConfig};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "The upstream Kubernetes control plane and process kubelets on one machine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the cluster in the foreground; Ctrl-C stops it.
    Up {
        /// State directory: kubeconfig, certificates, etcd data, component logs, pid file.
        #[arg(long, env = "LOCALCLUSTER_DIR", default_value_os_t = default_dir())]
        dir: PathBuf,
        /// Port of kube-apiserver (0 picks a free one).
        #[arg(long, default_value_t = 6443)]
        port: u16,
        /// Address kube-apiserver listens on (`--bind-address`).
        #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
        address: IpAddr,
        /// Where pods and kubelets reach kube-apiserver (`--advertise-address`, the endpoint
        /// of the `kubernetes` Service); default: the machine's address (the source address of
        /// its default route).
        #[arg(long)]
        advertise_address: Option<IpAddr>,
        /// The upstream `kube` binary; default: what `localcluster/upstream/build.sh` builds.
        #[arg(long, env = "LOCALCLUSTER_KUBE")]
        kube: Option<PathBuf>,
        /// Do not run kube-proxy (it owns the machine's `kube-proxy` nftables tables).
        #[arg(long)]
        no_proxy: bool,
        #[command(flatten)]
        nodes: localcluster::kubelet::cluster::NodeArgs,
    },
    /// Load OCI archives or image layouts into the nodes' image store (running or not), as
    /// `kind load image-archive` does for kind: pods may then use the images by name or digest.
    Load {
        #[arg(long, env = "LOCALCLUSTER_DIR", default_value_os_t = default_dir())]
        dir: PathBuf,
        #[arg(required = true)]
        images: Vec<PathBuf>,
    },
    /// Runs a command in a running container (the kubelet's exec, through its streaming helper).
    #[command(hide = true)]
    Nsexec(localcluster::nsexec::Args),
    /// Kill one control-plane component of a running cluster (SIGKILL) and start it again, as
    /// the kubelet restarts a crashed static pod; returns once it runs (kube-apiserver: once
    /// ready). Or restart a node's kubelet, whose pods keep running and are adopted by the new
    /// one, as under a container runtime. For chaos tests: everything else keeps running
    /// through the outage.
    Restart {
        #[arg(long, env = "LOCALCLUSTER_DIR", default_value_os_t = default_dir())]
        dir: PathBuf,
        /// kube-apiserver, etcd, kube-controller-manager, kube-scheduler, kube-proxy, or
        /// kubelet/<node> (`kubelet/node-1`).
        component: String,
    },
    /// Stop a cluster started with `up` in the same state directory.
    Down {
        #[arg(long, env = "LOCALCLUSTER_DIR", default_value_os_t = default_dir())]
        dir: PathBuf,
    },
}

fn default_dir() -> PathBuf {
    std::env::var_os("HOME")
        .map_or_else(|| PathBuf::from("/var/lib"), PathBuf::from)
        .join(".localcluster")
}

fn pid_file(dir: &Path) -> PathBuf {
    dir.join("localcluster.pid")
}

/// Where `restart` leaves `<component>.request` for the running `up`, which answers in
/// `<component>.done` (`pid N` or `error: ...`); a `/` in the component's name is `@` in the
/// file's. Components must be started by `up` itself: they die with the thread that started
/// them.
fn restart_dir(dir: &Path) -> PathBuf {
    dir.join("restart")
}

fn main() -> anyhow::Result<()> {
    let command = Cli::parse().command;
    // Joining a mount namespace needs a process that shares its file-system attributes with no
    // other thread: nsexec runs before any runtime thread exists.
    if let Command::Nsexec(args) = &command {
        std::process::exit(localcluster::nsexec::run(args));
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    tokio::runtime::Runtime::new()
        .context("starting the async runtime")?
        .block_on(run(command))
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Up {
            dir,
            port,
            address,
            advertise_address,
            kube,
            no_proxy,
            nodes,
        } => {
            // Refused before anything is built or started.
            localcluster::kubelet::cluster::preflight(&nodes)?;
            let kube = match kube {
                Some(k) => k,
                None => localcluster::controlplane::kube_binary()?,
            };
            let mut config = ControlPlaneConfig::new(&dir, kube);
            config.bind = address;
            config.port = port;
            if let Some(a) = advertise_address {
                config.advertise = a;
            }
            if !no_proxy && nodes.nodes > 0 {
                config.proxy_node = Some("node-1".into());
            }
            up(config, &nodes).await
        }
        Command::Down { dir } => down(&dir).await,
        Command::Restart { dir, component } => restart(&dir, &component).await,
        Command::Load { dir, images } => {
            let store = localcluster::kubelet::cluster::image_store(&dir)?;
            for image in images {
                for name in store
                    .import(&image)
                    .with_context(|| format!("loading {}", image.display()))?
                {
                    println!("{name}");
                }
            }
            Ok(())
        }
        Command::Nsexec(_) => unreachable!("nsexec runs before the runtime starts"),
    }
}

async fn up(
    config: ControlPlaneConfig,
    node_args: &localcluster::kubelet::cluster::NodeArgs,
) -> anyhow::Result<()> {
    let dir = config.dir.clone();
    let pid_path = pid_file(&dir);
    if let Ok(pid) = std::fs::read_to_string(&pid_path)
        && let Ok(pid) = pid.trim().parse::<i32>()
        && running(Pid::from_raw(pid))
    {
        bail!(
            "a localcluster (pid {pid}) is already running with state in {}; run `localcluster down --dir {}` first",
            dir.display(),
            dir.display()
        );
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(&pid_path, std::process::id().to_string())
        .with_context(|| format!("writing {}", pid_path.display()))?;
    let started = std::time::Instant::now();
    let mut plane = ControlPlane::start(config).await?;
    // Before the kubeconfig is written: a claim made as soon as it is there gets the default
    // class.
    let storage = localcluster::storage::Provisioner::start(&plane).await?;
    let kubeconfig = dir.join("kubeconfig");
    localcluster::pki::write_file(&kubeconfig, plane.kubeconfig(), 0o600)?;
    println!(
        "control plane ready in {:.1} s: {}",
        started.elapsed().as_secs_f64(),
        plane.url()
    );
    println!(
        "storage class {} (default): volumes in {}",
        localcluster::storage::STORAGE_CLASS,
        localcluster::storage::volumes_dir(&dir).display()
    );
    let mut nodes =
        localcluster::kubelet::cluster::LocalNodes::start(&plane, node_args, &dir).await?;
    for (name, root) in nodes.nodes() {
        println!("node {name} ready, host paths under {}", root.display());
    }
    // After the nodes: kube-proxy reads its node's addresses at start.
    if let Err(e) = plane.start_proxy().await {
        nodes.stop().await;
        return Err(e.into());
    }
    for c in plane.components() {
        println!(
            "  {} (pid {}), log {}",
            c.name(),
            c.pid(),
            c.log().display()
        );
    }
    println!("kubeconfig written to {}", kubeconfig.display());
    println!("  export KUBECONFIG={}", kubeconfig.display());
    println!("  kubectl get nodes");
    println!("Ctrl-C (or `localcluster down`) stops it.");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    // A component that exits leaves a cluster that only looks alive: say which, and stop.
    let mut watch = tokio::time::interval(Duration::from_secs(1));
    let exited = loop {
        tokio::select! {
            r = tokio::signal::ctrl_c() => { r.context("waiting for Ctrl-C")?; break None }
            _ = term.recv() => break None,
            _ = watch.tick() => {
                serve_restarts(&dir, &mut plane, &mut nodes).await;
                if let Err(e) = plane.check() {
                    break Some(anyhow::Error::from(e));
                }
                if let Err(e) = storage.check() {
                    break Some(e.into());
                }
            }
        }
    };
    if let Some(e) = &exited {
        eprintln!("localcluster: {e:#}");
    }
    println!("stopping");
    nodes.stop().await;
    drop(storage);
    plane.stop();
    for path in [&kubeconfig, &pid_path] {
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!(path = %path.display(), error = %e, "removing state file");
        }
    }
    match exited {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Restarts the components asked for by `localcluster restart`.
async fn serve_restarts(
    dir: &Path,
    plane: &mut ControlPlane,
    nodes: &mut localcluster::kubelet::cluster::LocalNodes,
) {
    let requests = restart_dir(dir);
    let Ok(entries) = std::fs::read_dir(&requests) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "request") {
            continue;
        }
        let _ = std::fs::remove_file(&path);
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let component = stem.replace('@', "/");
        let answer = if let Some(node) = component.strip_prefix("kubelet/") {
            match nodes.restart_kubelet(node).await {
                Ok(()) => {
                    println!("{component} restarted; its pods kept running");
                    "its pods kept running".to_owned()
                }
                Err(e) => format!("error: {:#}", anyhow::Error::from(e)),
            }
        } else {
            match plane.restart(&component).await {
                Ok(pid) => {
                    println!("{component} restarted (pid {pid})");
                    format!("pid {pid}")
                }
                Err(e) => format!("error: {:#}", anyhow::Error::from(e)),
            }
        };
        if let Err(e) = std::fs::write(requests.join(format!("{stem}.done")), answer) {
            tracing::warn!(component, error = %e, "answering a restart request");
        }
    }
}

async fn restart(dir: &Path, component: &str) -> anyhow::Result<()> {
    let pid_path = pid_file(dir);
    let pid = std::fs::read_to_string(&pid_path)
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok())
        .filter(|p| running(Pid::from_raw(*p)))
        .with_context(|| format!("no running localcluster in {}", dir.display()))?;
    let requests = restart_dir(dir);
    std::fs::create_dir_all(&requests)
        .with_context(|| format!("creating {}", requests.display()))?;
    let stem = component.replace('/', "@");
    let done = requests.join(format!("{stem}.done"));
    let _ = std::fs::remove_file(&done);
    std::fs::write(requests.join(format!("{stem}.request")), "")
        .with_context(|| format!("writing a request in {}", requests.display()))?;
    // kube-apiserver's start on a busy machine, and one tick of `up`'s loop.
    for _ in 0..2400 {
        if let Ok(answer) = std::fs::read_to_string(&done) {
            let _ = std::fs::remove_file(&done);
            if let Some(why) = answer.strip_prefix("error: ") {
                bail!("restarting {component}: {why}");
            }
            println!("{component} restarted ({answer})");
            return Ok(());
        }
        if !running(Pid::from_raw(pid)) {
            bail!("localcluster (pid {pid}) stopped before restarting {component}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("localcluster (pid {pid}) did not restart {component} within 240 s")
}

/// Whether `pid` is a live process: one that has exited but not been reaped by its parent
/// (a zombie) has stopped.
fn running(pid: Pid) -> bool {
    kill(pid, None).is_ok()
        && std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses and may hold any
            // character, so it is read after the last `)`.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state != "Z")
        })
}

async fn down(dir: &Path) -> anyhow::Result<()> {
    let pid_path = pid_file(dir);
    let raw = std::fs::read_to_string(&pid_path).with_context(|| {
        format!(
            "no running localcluster: cannot read {}",
            pid_path.display()
        )
    })?;
    let pid: i32 = raw
        .trim()
        .parse()
        .with_context(|| format!("{} does not hold a pid", pid_path.display()))?;
    let pid = Pid::from_raw(pid);
    kill(pid, Signal::SIGTERM).with_context(|| format!("signalling localcluster pid {pid}"))?;
    for _ in 0..300 {
        if !running(pid) {
            println!("localcluster (pid {pid}) stopped");
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("localcluster pid {pid} did not stop within 30 s after SIGTERM")
}
