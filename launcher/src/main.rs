//! `virt-launcher`: one VMI, one QEMU, a command socket. See docs/launcher.md.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use api::duration::parse_duration;
use clap::Parser;
use launcher::paths::Dirs;
use launcher::vm::{Config, Launcher};
use tokio::signal::unix::{SignalKind, signal};

/// Runs one VirtualMachineInstance on QEMU and serves its command API.
#[derive(Debug, Parser)]
#[command(name = "virt-launcher", version)]
struct Flags {
    /// Name of the VirtualMachineInstance.
    #[arg(long, default_value = "")]
    name: String,
    /// Namespace of the VirtualMachineInstance.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// UID of the VirtualMachineInstance; a sync for any other uid is refused.
    #[arg(long)]
    uid: Option<String>,
    /// How long QEMU may take to start (e.g. 5m, 30s, 500ms).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    qemu_timeout: Duration,
    /// Seconds the guest gets to power off when the launcher is terminated.
    #[arg(long, default_value_t = 30)]
    grace_period_seconds: u64,
    #[arg(long, default_value = "/var/run/kubevirt")]
    kubevirt_share_dir: PathBuf,
    #[arg(long, default_value = "/var/run/kubevirt-ephemeral-disks")]
    ephemeral_disk_dir: PathBuf,
    #[arg(long, default_value = "/var/run/kubevirt/container-disks")]
    container_disk_dir: PathBuf,
    #[arg(long, default_value = "/var/run/kubevirt/hotplug-disks")]
    hotplug_disk_dir: PathBuf,
    /// Per-VM sockets and logs (`<dir>/<uid>/`), PVC file systems (`<dir>/vmi-disks/`).
    #[arg(long, default_value = "/var/run/kubevirt-private")]
    private_dir: PathBuf,
    /// Where block-mode PVCs appear (`<dir>/<volume>`).
    #[arg(long, default_value = "/dev")]
    block_device_dir: PathBuf,
    /// Persistent EFI variable stores (`efi.persistent`): the backend-storage claim's `nvram`
    /// directory in the launcher pod, where KubeVirt's libvirt keeps them.
    #[arg(long, default_value = "/var/lib/libvirt/qemu/nvram")]
    nvram_dir: PathBuf,
    /// Use TCG when KVM cannot run guests (KubeVirt's developerConfiguration.useEmulation).
    #[arg(long)]
    allow_emulation: bool,
    #[arg(long, default_value = "qemu-system-x86_64")]
    qemu_binary: PathBuf,
    #[arg(long, default_value = "qemu-img")]
    qemu_img: PathBuf,
    /// Directory holding OVMF_CODE_4M*.fd and OVMF_VARS_4M*.fd (Debian's `ovmf`).
    #[arg(long, default_value = "/usr/share/OVMF")]
    ovmf_path: PathBuf,
    /// hugetlbfs mount for guests that ask for hugepages.
    #[arg(long, default_value = "/dev/hugepages")]
    hugepages_dir: PathBuf,
    /// How often the guest agent is asked `guest-fsfreeze-status` (KubeVirt's flag and default).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    qemu_fsfreeze_status_interval: Duration,
    /// Keep serving the API after QEMU has ended (until SIGTERM), instead of exiting.
    #[arg(long)]
    keep_after_shutdown: bool,
    /// Exit with an error at once: KubeVirt's flag, set for VMIs annotated
    /// `kubevirt.io/func-test-virt-launcher-fail-fast`, how tests make a VM crash-loop.
    #[arg(long)]
    simulate_crash: bool,
}

// One thread is plenty for one VM, keeps the launcher small, and makes PR_SET_PDEATHSIG (which
// fires when the *thread* that forked QEMU exits) follow the life of the process itself.
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let f = Flags::parse();
    anyhow::ensure!(
        !f.simulate_crash,
        "simulated virt-launcher crash (--simulate-crash)"
    );
    let dirs = Dirs {
        share: f.kubevirt_share_dir,
        private: f.private_dir,
        ephemeral: f.ephemeral_disk_dir,
        container_disks: f.container_disk_dir,
        hotplug_disks: f.hotplug_disk_dir,
        block_devices: f.block_device_dir,
        nvram: f.nvram_dir,
    };
    let socket = dirs.command_socket();
    let launcher = Launcher::new(Config {
        dirs,
        qemu_binary: f.qemu_binary,
        qemu_img: f.qemu_img,
        ovmf_dir: f.ovmf_path,
        hugepages_dir: f.hugepages_dir,
        allow_emulation: f.allow_emulation,
        qemu_timeout: f.qemu_timeout,
        grace_period: Duration::from_secs(f.grace_period_seconds),
        fsfreeze_status_interval: f.qemu_fsfreeze_status_interval,
        uid: f.uid,
    });
    launcher.warm_up();
    let span = tracing::info_span!("launcher", vmi = %format!("{}/{}", f.namespace, f.name));
    let _enter = span.enter();

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let listener = launcher::server::bind(&socket)
        .with_context(|| format!("cannot create the command socket {}", socket.display()))?;
    tracing::info!(socket = %socket.display(), "ready");

    let mut states = launcher.subscribe();
    let keep = f.keep_after_shutdown;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        axum::serve(listener, launcher::server::router(launcher.clone()))
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .into_future(),
    );

    let ended_by_guest = async {
        loop {
            if states.changed().await.is_err() {
                return;
            }
            if !keep && states.borrow().state.is_final() {
                return;
            }
        }
    };
    tokio::select! {
        _ = term.recv() => {
            tracing::info!("SIGTERM: shutting the domain down");
            launcher.terminate().await;
        }
        _ = int.recv() => {
            tracing::info!("SIGINT: shutting the domain down");
            launcher.terminate().await;
        }
        () = ended_by_guest => {}
    }
    let last = launcher.domain();
    tracing::info!(state = ?last.state, reason = %last.reason, "final state");
    // Watchers get the final state and their streams end; give them a moment to read it.
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    let _ = std::fs::remove_file(&socket);
    if let Some(uid) = &last.uid {
        launcher::vm::cleanup_sockets(&launcher.config().dirs, uid);
    }
    Ok(())
}
