//! The supervisor: starts QEMU paused, checks it over QMP, lets it run, follows its events and
//! its exit, and applies what a later sync may change (hotplugged disks).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::os::fd::{AsRawFd as _, RawFd};
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use api::VirtualMachineInstance;
use api::vmi::VolumeSource;
use launcher_api::action::{Empty, Frozen, Thawed};
use launcher_api::domain::{DiskStats, DiskStatus, Domain, DomainState, FsFreeze, InterfaceStatus};
use launcher_api::guest::{
    AgentInterface, GuestExecRequest, GuestExecResult, GuestPingRequest, QgaFilesystem,
    QgaHostName, QgaInfo, QgaOsInfo, QgaTimezone, QgaUser,
};
use launcher_api::migration::{DomainMigration, MigrationPhase, Role, TargetRequest};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value as Json, json};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::Command;
use tokio::sync::{Mutex, OnceCell, watch};

use crate::console::Console;
use crate::convert::{self, Host};
use crate::error::Error;
use crate::paths::Dirs;
use crate::prepare;
use crate::qemu::{Accel, Disk, Frontend, MachineKind, Monitor, Nic};
use crate::state::{LastWords, Requested, final_state};

mod migration;

/// Everything the launcher is told on its command line.
#[derive(Debug, Clone)]
pub struct Config {
    pub dirs: Dirs,
    pub qemu_binary: PathBuf,
    pub qemu_img: PathBuf,
    pub ovmf_dir: PathBuf,
    pub hugepages_dir: PathBuf,
    pub allow_emulation: bool,
    /// How long QEMU may take to come up (process start to QMP ready).
    pub qemu_timeout: Duration,
    /// How long the guest gets to power off after the ACPI button before `quit`.
    pub grace_period: Duration,
    /// How often the guest agent is asked `guest-fsfreeze-status` while it is connected.
    pub fsfreeze_status_interval: Duration,
    /// When set (`--uid`), the only VMI uid this launcher accepts.
    pub uid: Option<String>,
}

const STDERR_TAIL: usize = 20;
const DEVICE_DELETED_TIMEOUT: Duration = Duration::from_mins(2);
const QUIT_WAIT: Duration = Duration::from_secs(10);

/// The launcher: one VMI, at most one QEMU.
#[derive(Debug)]
pub struct Launcher {
    cfg: Config,
    state: watch::Sender<Domain>,
    ops: Mutex<Ops>,
    accel: OnceCell<Result<(Accel, Option<String>), String>>,
    qemu_version: StdMutex<Option<String>>,
}

#[derive(Debug, Default)]
struct Ops {
    uid: Option<String>,
    vm: Option<Vm>,
}

#[derive(Debug)]
struct Vm {
    qmp: qmp::QmpClient,
    agent: qmp::GuestAgent,
    pid: Pid,
    kind: MachineKind,
    disks: Vec<Disk>,
    hotpluggable: BTreeSet<String>,
    hotplug_ports: Vec<String>,
    /// Each NIC's link as the guest sees it now: up (`true`) or down.
    links: BTreeMap<String, bool>,
    requested: Arc<StdMutex<Option<Requested>>>,
    exit: watch::Receiver<Option<ExitStatus>>,
    /// Source: tells the running migration's task to cancel, with the reason.
    cancel_migration: Option<watch::Sender<Option<String>>>,
    /// Target: the copied disks are exported over NBD until the migration finishes.
    serves_disks: bool,
    _console: Option<Console>,
    _dhcp: crate::net::Dhcp,
}

impl Vm {
    fn exited(&self) -> bool {
        self.exit.borrow().is_some()
    }

    async fn wait_exit(&mut self, limit: Duration) -> bool {
        tokio::time::timeout(limit, self.exit.wait_for(Option::is_some))
            .await
            .is_ok()
    }

    fn request(&self, r: Requested) {
        *self.requested.lock().expect("poisoned") = Some(r);
    }
}

fn interface_status(n: &Nic, link_up: bool) -> InterfaceStatus {
    InterfaceStatus {
        name: n.name.clone(),
        tap: n.tap.clone(),
        mac: n.mac.clone(),
        model: format!("{:?}", n.model).to_lowercase(),
        link_state: Some(link_state(link_up).to_owned()),
        queue_count: i32::try_from(n.queues).ok(),
    }
}

fn link_state(up: bool) -> &'static str {
    if up {
        api::vmi::INTERFACE_STATE_UP
    } else {
        api::vmi::INTERFACE_STATE_DOWN
    }
}

/// Sets the link of the NIC named `name` (QMP `set_link` on its device, which takes its
/// backend with it).
async fn set_link(qmp: &qmp::QmpClient, name: &str, up: bool) -> Result<(), Error> {
    qmp.execute(qmp::qapi::qmp::set_link {
        name: crate::qemu::device_id(name),
        up,
    })
    .await
    .map(drop)
    .map_err(Error::from)
}

/// Applies the interface states of a later sync (KubeVirt's VM controller copies a changed
/// `state` from the VM into the running VMI): the links that should change, change.
async fn set_links(vm: &mut Vm, vmi: &VirtualMachineInstance) -> Result<(), Error> {
    for iface in &vmi.spec.domain.devices.interfaces {
        let up = !iface.link_down();
        match vm.links.get_mut(&iface.name) {
            Some(now) if *now != up => {
                set_link(&vm.qmp, &iface.name, up).await?;
                *now = up;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Kills a QEMU that did not start as asked and waits until it is gone: a retry's QEMU would
/// otherwise find its images still locked ("Failed to get \"write\" lock") by one that is
/// dying.
async fn abandon(pid: Pid, exit: &mut watch::Receiver<Option<ExitStatus>>) {
    let _ = kill(pid, Signal::SIGKILL);
    let _ = exit.wait_for(Option::is_some).await;
}

/// A QEMU process just started: its pid, its exit status once it has one, and the last lines
/// of its stderr.
struct Spawned {
    pid: Pid,
    exit: watch::Receiver<Option<ExitStatus>>,
    tail: Arc<StdMutex<VecDeque<String>>>,
}

fn disk_status(d: &Disk, hotpluggable: &BTreeSet<String>) -> DiskStatus {
    let bus = match d.frontend {
        Frontend::Virtio => "virtio",
        Frontend::Sata { .. } | Frontend::SataCdrom { .. } => "sata",
        Frontend::Scsi { .. } | Frontend::ScsiCdrom { .. } => "scsi",
    };
    DiskStatus {
        name: d.name.clone(),
        bus: bus.into(),
        source: d.source.path.display().to_string(),
        read_only: d.read_only,
        hotplugged: hotpluggable.contains(&d.name),
    }
}

/// Which PVC volumes are block devices here (KubeVirt decides the same way: by what the
/// launcher finds at the volume's path).
fn block_volumes(vmi: &VirtualMachineInstance, dirs: &Dirs) -> BTreeSet<String> {
    let is_block = |p: PathBuf| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device());
    vmi.spec
        .volumes
        .iter()
        .filter(|v| {
            matches!(
                v.source(),
                Some(
                    VolumeSource::PersistentVolumeClaim(_)
                        | VolumeSource::DataVolume(_)
                        | VolumeSource::Ephemeral(_)
                )
            )
        })
        .filter(|v| is_block(dirs.pvc_block(&v.name)) || is_block(dirs.hotplug_block(&v.name)))
        .map(|v| v.name.clone())
        .collect()
}

impl Launcher {
    pub fn new(cfg: Config) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            state: watch::Sender::new(Domain::default()),
            ops: Mutex::new(Ops::default()),
            accel: OnceCell::new(),
            qemu_version: StdMutex::new(None),
        })
    }

    /// Starts the accelerator probe now, so that the first sync does not wait for it.
    /// Also learns QEMU's version, so `info` can report it before any VM runs.
    pub fn warm_up(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            let _ = me.accel().await;
        });
        let me = self.clone();
        tokio::spawn(async move {
            let out = Command::new(&me.cfg.qemu_binary)
                .arg("--version")
                .stdin(Stdio::null())
                .output()
                .await;
            // "QEMU emulator version 7.2.22 (Debian ...)"
            let version = out.ok().and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .skip_while(|w| *w != "version")
                    .nth(1)
                    .map(str::to_owned)
            });
            let mut v = me.qemu_version.lock().expect("poisoned");
            if v.is_none() {
                *v = version;
            }
        });
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn domain(&self) -> Domain {
        self.state.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Domain> {
        self.state.subscribe()
    }

    pub fn qemu_version(&self) -> Option<String> {
        self.qemu_version.lock().expect("poisoned").clone()
    }

    fn update(&self, f: impl FnOnce(&mut Domain)) {
        self.update_if(|d| {
            f(d);
            true
        });
    }

    /// Like `update`, for a change `f` may find already made (it returns whether it changed
    /// anything), so watchers are not woken for nothing.
    fn update_if(&self, f: impl FnOnce(&mut Domain) -> bool) {
        self.state.send_if_modified(|d| {
            let changed = f(d);
            if changed {
                d.generation += 1;
            }
            changed
        });
    }

    async fn accel(&self) -> Result<Accel, Error> {
        let r = self
            .accel
            .get_or_init(|| crate::accel::choose(&self.cfg.qemu_binary, self.cfg.allow_emulation))
            .await;
        match r {
            Ok((accel, why)) => {
                if let Some(why) = why {
                    tracing::info!(reason = %why, "KVM unusable; emulating with TCG");
                }
                Ok(*accel)
            }
            Err(why) => Err(Error::NoAccelerator(why.clone())),
        }
    }

    fn host(&self, vmi: &VirtualMachineInstance, accel: Accel) -> Result<Host, Error> {
        Ok(Host {
            accel,
            ovmf_dir: self.cfg.ovmf_dir.clone(),
            hugepages_dir: self.cfg.hugepages_dir.clone(),
            block_volumes: block_volumes(vmi, &self.cfg.dirs),
            network: crate::net::read_caches(vmi, &self.cfg.dirs.private)?,
        })
    }

    /// `PUT /v1/sync`: the first call starts the domain; later ones apply hotplug changes.
    pub async fn sync(self: &Arc<Self>, vmi: &VirtualMachineInstance) -> Result<Domain, Error> {
        let offered = vmi.metadata.uid.clone().unwrap_or_default();
        let mut ops = self.ops.lock().await;
        let running = ops.uid.clone().or_else(|| self.cfg.uid.clone());
        if let Some(running) = running
            && running != offered
        {
            let e = Error::UidMismatch { running, offered };
            // The refusal shows in the domain too, where virt-handler looks; a domain that
            // exists (running or final) keeps its state and only carries the error.
            let message = e.to_string();
            let exists = ops.vm.is_some();
            self.update(|d| {
                if exists {
                    d.sync_error = Some(message);
                } else {
                    d.state = DomainState::NoState;
                    d.reason = "FailedSync".into();
                    d.message = Some(message);
                }
            });
            return Err(e);
        }
        let live = ops.vm.as_ref().is_some_and(|vm| !vm.exited());
        if live {
            let vm = ops.vm.as_mut().expect("checked");
            let mut result = self.hotplug(vm, vmi).await;
            if result.is_ok() {
                result = set_links(vm, vmi).await;
            }
            let disks: Vec<_> = vm
                .disks
                .iter()
                .map(|d| disk_status(d, &vm.hotpluggable))
                .collect();
            let links = vm.links.clone();
            let sync_error = result.as_ref().err().map(ToString::to_string);
            self.update(|d| {
                d.disks = disks;
                for i in &mut d.interfaces {
                    if let Some(up) = links.get(&i.name) {
                        i.link_state = Some(link_state(*up).to_owned());
                    }
                }
                d.sync_error = sync_error;
            });
            result?;
            return Ok(self.domain());
        }
        if ops.vm.is_some() {
            // QEMU has ended: the domain is final and a launcher never restarts it.
            return Ok(self.domain());
        }
        self.update(|d| {
            d.state = DomainState::Starting;
            d.reason = "Starting".into();
            d.message = None;
            d.uid = Some(offered.clone());
            d.name.clone_from(&vmi.metadata.name);
            d.namespace.clone_from(&vmi.metadata.namespace);
        });
        match self.start(vmi, None).await {
            Ok(vm) => {
                ops.vm = Some(vm);
                ops.uid = Some(offered);
                Ok(self.domain())
            }
            Err(e) => {
                let message = e.to_string();
                self.update(|d| {
                    d.state = DomainState::NoState;
                    d.reason = "FailedSync".into();
                    d.message = Some(message);
                    d.qemu_pid = None;
                });
                Err(e)
            }
        }
    }

    /// `PUT /v1/migration/target`: starts the VMI as a migration target. Refused once this
    /// launcher runs a domain (a launcher is the target of one migration, from its start).
    pub async fn prepare_target(self: &Arc<Self>, req: &TargetRequest) -> Result<Domain, Error> {
        let vmi = &req.vmi;
        let offered = vmi.metadata.uid.clone().unwrap_or_default();
        let mut ops = self.ops.lock().await;
        if let Some(running) = ops.uid.clone().or_else(|| self.cfg.uid.clone())
            && running != offered
        {
            return Err(Error::UidMismatch { running, offered });
        }
        if ops.vm.is_some() {
            let d = self.domain();
            let same = d
                .migration
                .as_ref()
                .is_some_and(|m| m.role == Role::Target && m.uid == req.migration_uid);
            if same {
                return Ok(d);
            }
            return Err(Error::WrongState {
                state: format!("{:?}", d.state),
                action: "prepare a migration target",
                needs: "not started",
            });
        }
        self.update(|d| {
            d.state = DomainState::Starting;
            d.reason = "Starting".into();
            d.message = None;
            d.uid = Some(offered.clone());
            d.name.clone_from(&vmi.metadata.name);
            d.namespace.clone_from(&vmi.metadata.namespace);
            d.migration = Some(DomainMigration {
                uid: req.migration_uid.clone(),
                role: Role::Target,
                phase: MigrationPhase::Preparing,
                mode: "PreCopy".into(),
                started_ms: migration::now_ms(),
                ended_ms: None,
                failure: None,
                memory_total: 0,
                memory_transferred: 0,
                memory_remaining: 0,
                disks_total: 0,
                total_time_ms: None,
                downtime_ms: None,
            });
        });
        match self.start(vmi, Some(req)).await {
            Ok(vm) => {
                ops.vm = Some(vm);
                ops.uid = Some(offered);
                Ok(self.domain())
            }
            Err(e) => {
                let message = e.to_string();
                self.update(|d| {
                    d.state = DomainState::NoState;
                    d.reason = "FailedSync".into();
                    d.message = Some(message.clone());
                    d.qemu_pid = None;
                    if let Some(m) = d.migration.as_mut() {
                        m.phase = MigrationPhase::Failed;
                        m.failure = Some(message);
                        m.ended_ms = Some(migration::now_ms());
                    }
                });
                Err(e)
            }
        }
    }

    /// Starts QEMU for `vmi`: booting it, or as the target of `incoming`.
    async fn start(
        self: &Arc<Self>,
        vmi: &VirtualMachineInstance,
        incoming: Option<&TargetRequest>,
    ) -> Result<Vm, Error> {
        let accel = self.accel().await?;
        let host = self.host(vmi, accel)?;
        let plan = convert::convert(vmi, &self.cfg.dirs, &host)?;
        if let Some(req) = incoming {
            migration::copied(&plan.config.disks, &req.copy_disks)?;
        }
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let dirs = &self.cfg.dirs;
        let vm_dir = dirs.vm_dir(&uid);
        std::fs::create_dir_all(&vm_dir).map_err(Error::io(format!(
            "creating the VM directory {}",
            vm_dir.display()
        )))?;
        for stale in [
            dirs.qmp_socket(&uid),
            dirs.agent_socket(&uid),
            dirs.serial_backend_socket(&uid),
            dirs.vnc_socket(&uid),
        ] {
            let _ = std::fs::remove_file(stale);
        }
        prepare::run(&self.cfg.qemu_img, &plan.preps).await?;
        // Before QEMU, so the guest's first DHCP request finds a server.
        let resolv = std::fs::read_to_string(crate::net::RESOLV_CONF).unwrap_or_default();
        let dhcp = crate::net::Dhcp::start(vmi, &plan.config.nics, &host.network, &resolv)?;
        let qmp_socket = dirs.qmp_socket(&uid);
        let monitor = std::os::unix::net::UnixListener::bind(&qmp_socket).map_err(Error::io(
            format!("binding the QMP socket {}", qmp_socket.display()),
        ))?;
        let mut config = plan.config;
        config.monitor = Monitor::ListeningFd(monitor.as_raw_fd());
        config.incoming = incoming.is_some();
        let argv = config.argv();
        tracing::info!(qemu = %self.cfg.qemu_binary.display(), argv = ?argv, "starting QEMU");

        let Spawned {
            pid,
            exit: mut exit_rx,
            tail,
        } = self.spawn_qemu(&argv, monitor.as_raw_fd())?;
        let tail_text = {
            let tail = tail.clone();
            move || {
                tail.lock()
                    .expect("poisoned")
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(" | ")
            }
        };

        // Queued in the listener's backlog at once; QEMU accepts it when its main loop runs.
        let qmp_stream = tokio::net::UnixStream::connect(&qmp_socket).await;
        // QEMU has its own copy; ours would keep the socket alive after QEMU is gone.
        drop(monitor);
        let started = match qmp_stream {
            Ok(stream) => {
                self.connect_and_verify(stream, &qmp_socket, accel, &mut exit_rx, &tail_text)
                    .await
            }
            Err(e) => Err(Error::io(format!(
                "connecting to the QMP socket {}",
                qmp_socket.display()
            ))(e)),
        };
        let (qmp, vcpus) = match started {
            Ok(v) => v,
            Err(e) => {
                abandon(pid, &mut exit_rx).await;
                return Err(e);
            }
        };
        *self.qemu_version.lock().expect("poisoned") = Some(qmp.version().to_string());

        let requested = Arc::new(StdMutex::new(incoming.map(|_| Requested::Incoming)));
        let words = Arc::new(StdMutex::new(LastWords::default()));
        let events_task = self.follow_events(qmp.events(), words.clone());
        let console = match &config.serial {
            None => None,
            Some(s) => {
                match Console::start(&s.socket, &dirs.serial_socket(&uid), &dirs.serial_log(&uid))
                    .await
                {
                    Ok(c) => Some(c),
                    Err(e) => {
                        abandon(pid, &mut exit_rx).await;
                        return Err(Error::io(format!("serial console {}", s.socket.display()))(
                            e,
                        ));
                    }
                }
            }
        };

        let paused = incoming.is_none() && vmi.spec.starts_paused();
        // Before the guest's first instruction (a migration target too: the link is not part
        // of the migrated state), so a guest never sees a `state: down` NIC's link up.
        for nic in config.nics.iter().filter(|n| !n.link_up) {
            if let Err(e) = set_link(&qmp, &nic.name, false).await {
                abandon(pid, &mut exit_rx).await;
                return Err(e);
            }
        }
        if let Err(e) = missing_required_feature(&qmp, vmi).await {
            abandon(pid, &mut exit_rx).await;
            return Err(e);
        }
        if let Some(cpu) = vmi
            .spec
            .domain
            .cpu
            .as_ref()
            .filter(|c| c.dedicated_cpu_placement == Some(true))
        {
            let isolate = cpu.isolate_emulator_thread == Some(true);
            match crate::pinning::apply(pid.as_raw(), &vcpus, isolate) {
                Ok(pins) => tracing::info!(?pins, "QEMU's threads pinned to dedicated CPUs"),
                Err(e) => {
                    abandon(pid, &mut exit_rx).await;
                    return Err(e.into());
                }
            }
        }
        let began = match incoming {
            // QEMU was started with -S: the guest stays before its first instruction until
            // an unpause, as libvirt's VIR_DOMAIN_START_PAUSED leaves it.
            None if paused => Ok(()),
            None => qmp
                .execute(qmp::qapi::qmp::cont {})
                .await
                .map(drop)
                .map_err(Error::from),
            Some(req) => {
                let copied = migration::copied(&config.disks, &req.copy_disks)?;
                self.listen_incoming(&qmp, &copied, req.allow_post_copy)
                    .await
            }
        };
        if let Err(e) = began {
            abandon(pid, &mut exit_rx).await;
            return Err(e);
        }
        let disks: Vec<_> = config
            .disks
            .iter()
            .map(|d| disk_status(d, &plan.hotpluggable))
            .collect();
        let interfaces = config
            .nics
            .iter()
            .map(|n| interface_status(n, n.link_up))
            .collect();
        let links = config
            .nics
            .iter()
            .map(|n| (n.name.clone(), n.link_up))
            .collect();
        let pid_u32 = u32::try_from(pid.as_raw()).unwrap_or_default();
        self.update(|d| {
            // A target stays paused until its migration finishes, as libvirt's does; a paused
            // start is the user's pause (libvirt reports VIR_DOMAIN_PAUSED_USER for it).
            (d.state, d.reason) = if incoming.is_some() {
                (DomainState::Paused, "Migration".into())
            } else if paused {
                (DomainState::Paused, "User".into())
            } else {
                (DomainState::Running, "Booted".into())
            };
            d.message = None;
            d.qemu_pid = Some(pid_u32);
            d.accelerator = Some(accel.to_string());
            d.vcpu_threads = vcpus;
            d.disks = disks;
            d.interfaces = interfaces;
        });
        tracing::info!(pid = pid_u32, "domain running");

        self.watch_exit(exit_rx.clone(), events_task, words, tail, requested.clone());

        let agent = qmp::GuestAgent::new(dirs.agent_socket(&uid), qmp::AgentOptions::default());
        self.poll_fsfreeze(agent.clone(), exit_rx.clone());
        Ok(Vm {
            agent,
            qmp,
            pid,
            kind: config.machine.kind,
            disks: config.disks,
            hotpluggable: plan.hotpluggable,
            hotplug_ports: config.controllers.hotplug_ports,
            links,
            requested,
            exit: exit_rx,
            cancel_migration: None,
            serves_disks: incoming.is_some_and(|r| !r.copy_disks.is_empty()),
            _console: console,
            _dhcp: dhcp,
        })
    }

    /// Starts QEMU with `argv`, handing it the listening QMP socket `monitor`. QEMU dies with
    /// the launcher; its stderr goes to the log, and its last lines are kept for the exit report.
    fn spawn_qemu(&self, argv: &[String], monitor: RawFd) -> Result<Spawned, Error> {
        let mut cmd = Command::new(&self.cfg.qemu_binary);
        cmd.args(argv)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        crate::child::die_with_launcher(&mut cmd);
        crate::child::inherit_fd(&mut cmd, monitor);
        let mut child = cmd.spawn().map_err(|e| Error::QemuStart {
            binary: self.cfg.qemu_binary.display().to_string(),
            message: e.to_string(),
        })?;
        let pid = Pid::from_raw(
            child
                .id()
                .and_then(|p| i32::try_from(p).ok())
                .unwrap_or_default(),
        );
        let tail: Arc<StdMutex<VecDeque<String>>> = Arc::default();
        let stderr = child.stderr.take().expect("piped");
        let stderr_task = {
            let tail = tail.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::info!(target: "qemu", "{line}");
                    let mut t = tail.lock().expect("poisoned");
                    if t.len() == STDERR_TAIL {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            })
        };
        let (exit_tx, exit) = watch::channel(None);
        tokio::spawn(async move {
            let status = child.wait().await;
            // Drain stderr first so the exit is reported with QEMU's last words.
            let _ = tokio::time::timeout(Duration::from_secs(2), stderr_task).await;
            if let Ok(s) = status {
                let _ = exit_tx.send(Some(s));
            }
        });
        Ok(Spawned { pid, exit, tail })
    }

    /// Once QEMU has exited, sets the final state: from its exit status, the last events it
    /// sent, its last stderr lines and what the launcher had asked of it.
    fn watch_exit(
        self: &Arc<Self>,
        mut exit: watch::Receiver<Option<ExitStatus>>,
        events_task: tokio::task::JoinHandle<()>,
        words: Arc<StdMutex<LastWords>>,
        tail: Arc<StdMutex<VecDeque<String>>>,
        requested: Arc<StdMutex<Option<Requested>>>,
    ) {
        let me = self.clone();
        tokio::spawn(async move {
            let _ = exit.wait_for(Option::is_some).await;
            let status = exit.borrow().expect("waited for it");
            // The QMP connection closes with QEMU; its last events (SHUTDOWN) are in by then.
            let _ = tokio::time::timeout(Duration::from_secs(2), events_task).await;
            let mut w = words.lock().expect("poisoned").clone();
            w.stderr_tail = tail.lock().expect("poisoned").iter().cloned().collect();
            let requested = *requested.lock().expect("poisoned");
            let (state, reason, message) = final_state(status, &w, requested);
            tracing::info!(?state, %reason, ?message, %status, "QEMU ended");
            me.update(|d| {
                d.state = state;
                d.reason = reason;
                d.message = message;
                d.agent_connected = false;
                d.fs_freeze_status = None;
                d.vcpu_threads.clear();
            });
        });
    }

    async fn connect_and_verify(
        &self,
        stream: tokio::net::UnixStream,
        socket: &Path,
        accel: Accel,
        exit_rx: &mut watch::Receiver<Option<ExitStatus>>,
        tail: &impl Fn() -> String,
    ) -> Result<(qmp::QmpClient, Vec<i64>), Error> {
        let opts = qmp::ConnectOptions {
            connect_timeout: self.cfg.qemu_timeout,
            ..qmp::ConnectOptions::default()
        };
        let exited = async {
            let _ = exit_rx.wait_for(Option::is_some).await;
        };
        let qmp = tokio::select! {
            r = qmp::QmpClient::from_stream(stream, socket, &opts) => r?,
            () = exited => {
                let status = exit_rx.borrow().map(|s| s.to_string()).unwrap_or_default();
                return Err(Error::QemuExited(format!("{status}: {}", tail())));
            }
        };
        // One round trip for the three checks: the client matches replies by id.
        let (status, kvm, cpus) = tokio::try_join!(
            qmp.execute(qmp::qapi::qmp::query_status {}),
            qmp.execute_raw("query-kvm", json!({})),
            qmp.execute_raw("query-cpus-fast", json!({})),
        )?;
        if status.running {
            return Err(Error::QemuExited(format!(
                "QEMU is running before it was told to ({:?}); refusing to supervise it",
                status.status
            )));
        }
        let kvm_on = kvm["enabled"].as_bool().unwrap_or(false);
        if kvm_on != (accel == Accel::Kvm) {
            return Err(Error::QemuExited(format!(
                "QEMU reports KVM enabled={kvm_on}, but {accel} was chosen"
            )));
        }
        let vcpus = cpus
            .as_array()
            .map(|a| a.iter().filter_map(|c| c["thread-id"].as_i64()).collect())
            .unwrap_or_default();
        Ok((qmp, vcpus))
    }

    fn follow_events(
        self: &Arc<Self>,
        mut events: qmp::EventStream,
        words: Arc<StdMutex<LastWords>>,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let ev = match events.recv().await {
                    Ok(ev) => ev,
                    Err(qmp::RecvError::Lagged(n)) => {
                        tracing::warn!(dropped = n, "QMP events dropped");
                        continue;
                    }
                    Err(_) => break,
                };
                tracing::debug!(event = %ev.name, data = %ev.data, "QMP event");
                match ev.name.as_str() {
                    "STOP" => me.update(|d| {
                        if d.state == DomainState::Running {
                            d.state = DomainState::Paused;
                            // The source stops the guest for the migration's last step
                            // (`Migrating`, not libvirt's `Migration`: that is the reason of a
                            // pause the VMI shows as `PausedByMigrationMonitor`).
                            let migrating = d
                                .migration
                                .as_ref()
                                .is_some_and(|m| m.role == Role::Source && !m.phase.is_final());
                            d.reason = if migrating { "Migrating" } else { "Unknown" }.into();
                        }
                    }),
                    "MIGRATION" => {
                        let target = me
                            .state
                            .borrow()
                            .migration
                            .as_ref()
                            .is_some_and(|m| m.role == Role::Target);
                        if target && let Some(status) = ev.data_str("status") {
                            me.incoming_event(status);
                        }
                    }
                    "RESUME" => me.update(|d| {
                        if d.state == DomainState::Paused {
                            d.state = DomainState::Running;
                            d.reason = "Unpaused".into();
                        }
                    }),
                    "SHUTDOWN" => {
                        words.lock().expect("poisoned").shutdown_reason =
                            ev.data_str("reason").map(str::to_owned);
                    }
                    "GUEST_PANICKED" => words.lock().expect("poisoned").panicked = true,
                    "VSERPORT_CHANGE" if ev.data_str("id") == Some("channel0") => {
                        let open = ev.data.get("open").and_then(Json::as_bool) == Some(true);
                        tracing::info!(connected = open, "guest agent channel");
                        me.update(|d| {
                            d.agent_connected = open;
                            if !open {
                                d.fs_freeze_status = None;
                            }
                        });
                    }
                    _ => {}
                }
            }
        })
    }

    fn live_vm<'a>(&self, ops: &'a mut Ops, action: &'static str) -> Result<&'a mut Vm, Error> {
        match ops.vm.as_mut() {
            None => Err(Error::NoDomain),
            Some(vm) if vm.exited() => Err(Error::WrongState {
                state: format!("{:?}", self.state.borrow().state),
                action,
                needs: "running or paused",
            }),
            Some(vm) => Ok(vm),
        }
    }

    pub async fn pause(&self) -> Result<Domain, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, "pause")?;
        vm.qmp.execute(qmp::qapi::qmp::stop {}).await?;
        self.update(|d| {
            d.state = DomainState::Paused;
            d.reason = "User".into();
        });
        Ok(self.domain())
    }

    pub async fn unpause(&self) -> Result<Domain, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, "unpause")?;
        vm.qmp.execute(qmp::qapi::qmp::cont {}).await?;
        self.update(|d| {
            d.state = DomainState::Running;
            d.reason = "Unpaused".into();
        });
        Ok(self.domain())
    }

    /// ACPI power button; the guest decides what to do with it.
    pub async fn shutdown(&self) -> Result<Domain, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, "shutdown")?;
        vm.request(Requested::Powerdown);
        vm.qmp.execute(qmp::qapi::qmp::system_powerdown {}).await?;
        Ok(self.domain())
    }

    pub async fn kill(&self) -> Result<Domain, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, "kill")?;
        vm.request(Requested::Kill);
        let _ = kill(vm.pid, Signal::SIGKILL);
        vm.wait_exit(QUIT_WAIT).await;
        drop(ops);
        self.settle().await;
        Ok(self.domain())
    }

    pub async fn reset(&self) -> Result<Domain, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, "reset")?;
        vm.qmp.execute(qmp::qapi::qmp::system_reset {}).await?;
        Ok(self.domain())
    }

    /// A PNG of the guest's display (QMP `screendump` with `format: png`, QEMU 7.1+). QEMU
    /// writes the image itself, so it goes to the VM's private dir, which only the launcher and
    /// QEMU use; the ops lock keeps two requests from sharing the file.
    pub async fn screendump(&self) -> Result<Vec<u8>, Error> {
        let mut ops = self.ops.lock().await;
        let uid = ops.uid.clone().ok_or(Error::NoDomain)?;
        let vm = self.live_vm(&mut ops, "screendump")?;
        let file = self.cfg.dirs.vm_dir(&uid).join("screendump.png");
        vm.qmp
            .execute(qmp::qapi::qmp::screendump {
                filename: file.display().to_string(),
                device: None,
                head: None,
                format: Some(qmp::qapi::qmp::ImageFormat::png),
            })
            .await?;
        let png = tokio::fs::read(&file).await.map_err(Error::io(format!(
            "reading the screendump {}",
            file.display()
        )))?;
        let _ = tokio::fs::remove_file(&file).await;
        Ok(png)
    }

    /// Each disk's I/O counters (QMP `query-blockstats`), in the VMI's disk order.
    pub async fn blockstats(&self) -> Result<Vec<DiskStats>, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, "blockstats")?;
        let stats = vm
            .qmp
            .execute(qmp::compat::query_blockstats::default())
            .await?;
        Ok(disk_stats(vm.disks.iter().map(|d| d.name.as_str()), &stats))
    }

    async fn agent(&self, action: &'static str) -> Result<qmp::GuestAgent, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, action)?;
        if !self.state.borrow().agent_connected {
            return Err(Error::AgentNotConnected);
        }
        Ok(vm.agent.clone())
    }

    pub async fn soft_reboot(&self) -> Result<Domain, Error> {
        let agent = self.agent("softreboot").await?;
        agent
            .shutdown(Some(qmp::qapi::qga::GuestShutdownMode::Reboot))
            .await
            .map_err(Error::Agent)?;
        Ok(self.domain())
    }

    /// Asks the agent again afterwards, whatever the answer: a freeze that timed out may still
    /// have frozen the guest, and the domain must say so.
    pub async fn freeze(&self) -> Result<Frozen, Error> {
        let agent = self.agent("freeze").await?;
        let n = agent.fsfreeze_freeze().await;
        self.refresh_fsfreeze(&agent).await;
        Ok(Frozen {
            frozen_filesystems: n.map_err(Error::Agent)?,
        })
    }

    pub async fn unfreeze(&self) -> Result<Thawed, Error> {
        let agent = self.agent("unfreeze").await?;
        let n = agent.fsfreeze_thaw().await;
        self.refresh_fsfreeze(&agent).await;
        Ok(Thawed {
            thawed_filesystems: n.map_err(Error::Agent)?,
        })
    }

    /// KubeVirt's agent poller for `guest-fsfreeze-status`: while the agent is connected, the
    /// domain carries its answer, so the VMI status follows the guest even after a freeze the
    /// handler did not see end (a handler restarted meanwhile, a timed-out call).
    fn poll_fsfreeze(
        self: &Arc<Self>,
        agent: qmp::GuestAgent,
        mut exit: watch::Receiver<Option<ExitStatus>>,
    ) {
        let me = self.clone();
        let every = self.cfg.fsfreeze_status_interval;
        tokio::spawn(async move {
            let mut domain = me.subscribe();
            loop {
                tokio::select! {
                    r = domain.wait_for(|d| d.agent_connected) => {
                        if r.is_err() {
                            return;
                        }
                    }
                    _ = exit.wait_for(Option::is_some) => return,
                }
                me.refresh_fsfreeze(&agent).await;
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    _ = exit.wait_for(Option::is_some) => return,
                }
            }
        });
    }

    async fn refresh_fsfreeze(&self, agent: &qmp::GuestAgent) {
        let status = match agent.fsfreeze_status().await {
            Ok(qmp::qapi::qga::GuestFsfreezeStatus::thawed) => FsFreeze::Thawed,
            Ok(qmp::qapi::qga::GuestFsfreezeStatus::frozen) => FsFreeze::Frozen,
            Err(e) => {
                tracing::debug!(error = %e, "guest-fsfreeze-status");
                return;
            }
        };
        // An answer that arrives after the agent went away says nothing about the next one.
        self.update_if(|d| {
            let changed = d.agent_connected && d.fs_freeze_status != Some(status);
            if changed {
                d.fs_freeze_status = Some(status);
            }
            changed
        });
    }

    pub async fn guest_info(&self) -> Result<QgaInfo, Error> {
        let a = self.agent("guest info").await?;
        relay("guest-info", a.info().await)
    }

    pub async fn guest_osinfo(&self) -> Result<QgaOsInfo, Error> {
        let a = self.agent("guest osinfo").await?;
        relay("guest-get-osinfo", a.osinfo().await)
    }

    pub async fn guest_host_name(&self) -> Result<QgaHostName, Error> {
        let a = self.agent("guest host name").await?;
        let host_name = a.host_name().await.map_err(Error::Agent)?;
        Ok(QgaHostName { host_name })
    }

    pub async fn guest_timezone(&self) -> Result<QgaTimezone, Error> {
        let a = self.agent("guest timezone").await?;
        relay("guest-get-timezone", a.timezone().await)
    }

    /// The agent of this launcher's guest for a probe naming `domain`: a probe rendered for
    /// another VMI is refused rather than answered for this one.
    async fn probe_agent(&self, domain: &str) -> Result<qmp::GuestAgent, Error> {
        let agent = self.agent("guest probe").await?;
        let d = self.state.borrow();
        let ours = api::vmi::domain_name(
            d.namespace.as_deref().unwrap_or_default(),
            d.name.as_deref().unwrap_or_default(),
        );
        if domain != ours {
            return Err(Error::BadRequest(format!(
                "domainName {domain:?}: this launcher runs {ours:?}"
            )));
        }
        Ok(agent)
    }

    /// `guest-ping` (a `guestAgentPing` probe).
    pub async fn guest_ping(&self, req: &GuestPingRequest) -> Result<Empty, Error> {
        let agent = self.probe_agent(&req.domain_name).await?;
        agent
            .execute_with_timeout(
                qmp::qapi::qga::guest_ping {},
                Duration::from_secs(req.timeout_seconds.into()),
            )
            .await
            .map_err(Error::Agent)?;
        Ok(Empty {})
    }

    /// A command run in the guest by its agent (an `exec` probe). A command killed by a
    /// signal answers 128 plus the signal's number, as a shell reports it; KubeVirt reads the
    /// missing exit code as 0 there and so takes a killed probe command for a success.
    pub async fn guest_exec(&self, req: &GuestExecRequest) -> Result<GuestExecResult, Error> {
        let agent = self.probe_agent(&req.domain_name).await?;
        let status = agent
            .exec(
                &req.command,
                &req.args,
                Duration::from_secs(req.timeout_seconds.into()),
            )
            .await
            .map_err(Error::Agent)?;
        let code = status
            .exitcode
            .or(status.signal.map(|s| 128 + s))
            .unwrap_or_default();
        Ok(GuestExecResult {
            exit_code: i32::try_from(code).unwrap_or(-1),
            stdout: String::from_utf8_lossy(&status.out_data.unwrap_or_default()).into_owned(),
        })
    }

    pub async fn guest_users(&self) -> Result<Vec<QgaUser>, Error> {
        let a = self.agent("guest users").await?;
        relay("guest-get-users", a.users().await)
    }

    pub async fn guest_filesystems(&self) -> Result<Vec<QgaFilesystem>, Error> {
        let a = self.agent("guest filesystems").await?;
        relay("guest-get-fsinfo", a.fsinfo().await)
    }

    /// `guest-network-get-interfaces`: names and addresses inside the guest, which virt-handler
    /// merges with the domain's NICs into `status.interfaces` (`network::status::merge`).
    pub async fn guest_interfaces(&self) -> Result<Vec<AgentInterface>, Error> {
        let a = self.agent("guest interfaces").await?;
        relay("guest-network-get-interfaces", a.network_interfaces().await)
    }

    /// Waits (briefly) until the exit handler has published the final state.
    async fn settle(&self) {
        let mut rx = self.state.subscribe();
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            rx.wait_for(|d| d.state.is_final() || d.state == DomainState::NoState),
        )
        .await;
    }

    /// The launcher is being terminated: ACPI power-down, the grace period, `quit`, then
    /// SIGKILL. Returns once QEMU is gone and the final state is published.
    ///
    /// The grace period is waited out without holding the command lock: virt-handler counts
    /// the VMI's own (shorter) grace period and sends `kill` when it is over, which must not
    /// queue behind this wait.
    pub async fn terminate(&self) {
        let mut exit = {
            let mut ops = self.ops.lock().await;
            let Some(vm) = ops.vm.as_mut() else {
                return;
            };
            if !vm.exited() {
                tracing::info!(grace = ?self.cfg.grace_period, "powering the guest down");
                vm.request(Requested::Powerdown);
                let _ = vm.qmp.execute(qmp::qapi::qmp::system_powerdown {}).await;
            }
            vm.exit.clone()
        };
        let powered_down =
            tokio::time::timeout(self.cfg.grace_period, exit.wait_for(Option::is_some)).await;
        if powered_down.is_err() {
            let mut ops = self.ops.lock().await;
            if let Some(vm) = ops.vm.as_mut().filter(|vm| !vm.exited()) {
                tracing::info!("grace period over; quitting QEMU");
                vm.request(Requested::Quit);
                let _ = vm.qmp.execute(qmp::qapi::qmp::quit {}).await;
                if !vm.wait_exit(QUIT_WAIT).await {
                    tracing::warn!("QEMU ignored quit; killing it");
                    vm.request(Requested::Kill);
                    let _ = kill(vm.pid, Signal::SIGKILL);
                    vm.wait_exit(QUIT_WAIT).await;
                }
            }
        }
        self.settle().await;
    }

    /// Applies the disks of a later sync: unplugs what is gone, plugs what is new.
    async fn hotplug(&self, vm: &mut Vm, vmi: &VirtualMachineInstance) -> Result<(), Error> {
        let wanted: BTreeSet<&str> = vmi
            .spec
            .domain
            .devices
            .disks
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        let gone: Vec<Disk> = vm
            .disks
            .iter()
            .filter(|d| !wanted.contains(d.name.as_str()))
            .cloned()
            .collect();
        for d in gone {
            self.unplug(vm, &d).await?;
        }
        let name = vmi.metadata.name.clone().unwrap_or_default();
        let namespace = vmi
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let accel = self.accel().await?;
        let host = self.host(vmi, accel)?;
        for (i, d) in vmi.spec.domain.devices.disks.iter().enumerate() {
            if vm.disks.iter().any(|have| have.name == d.name) {
                continue;
            }
            let field = format!("spec.domain.devices.disks[{i}]");
            let (mut disk, _, preps) =
                convert::disk_for(vmi, d, &field, &self.cfg.dirs, &host, &namespace, &name)?;
            match disk.frontend {
                Frontend::Virtio => {
                    if vm.kind == MachineKind::Q35 {
                        let free = vm
                            .hotplug_ports
                            .iter()
                            .find(|p| !vm.disks.iter().any(|d| d.pci_bus.as_ref() == Some(p)))
                            .cloned()
                            .ok_or_else(|| Error::Hotplug {
                                disk: d.name.clone(),
                                message: format!(
                                    "all {} hotplug ports are in use",
                                    vm.hotplug_ports.len()
                                ),
                            })?;
                        disk.pci_bus = Some(free);
                    }
                }
                Frontend::Scsi { .. } => {
                    // virtio-scsi addresses up to 16384 LUNs per target; 256 is plenty.
                    let lun = (0..256u32)
                        .find(|l| {
                            !vm.disks.iter().any(|d| {
                                matches!(d.frontend, Frontend::Scsi { lun } | Frontend::ScsiCdrom { lun } if lun == *l)
                            })
                        })
                        .ok_or_else(|| Error::Hotplug {
                            disk: d.name.clone(),
                            message: "no free SCSI LUN".into(),
                        })?;
                    disk.frontend = Frontend::Scsi { lun };
                }
                _ => {
                    return Err(Error::Hotplug {
                        disk: d.name.clone(),
                        message: "only virtio and scsi disks can be hotplugged".into(),
                    });
                }
            }
            prepare::run(&self.cfg.qemu_img, &preps).await?;
            self.plug(vm, disk).await?;
        }
        Ok(())
    }

    async fn plug(&self, vm: &mut Vm, disk: Disk) -> Result<(), Error> {
        let fail = |e: qmp::Error| Error::Hotplug {
            disk: disk.name.clone(),
            message: e.to_string(),
        };
        vm.qmp
            .execute_raw("blockdev-add", disk.blockdev_json())
            .await
            .map_err(fail)?;
        if let Err(e) = vm.qmp.execute_raw("device_add", disk.device_json()).await {
            // Roll back: the block node must not outlive a device that never appeared.
            if let Err(undo) = vm
                .qmp
                .execute_raw("blockdev-del", json!({"node-name": disk.node_name()}))
                .await
            {
                tracing::warn!(error = %undo, disk = %disk.name, "rollback of blockdev-add failed");
            }
            return Err(fail(e));
        }
        tracing::info!(disk = %disk.name, "disk hotplugged");
        vm.hotpluggable.insert(disk.name.clone());
        vm.disks.push(disk);
        Ok(())
    }

    async fn unplug(&self, vm: &mut Vm, disk: &Disk) -> Result<(), Error> {
        let fail = |message: String| Error::Hotplug {
            disk: disk.name.clone(),
            message,
        };
        let removable = match disk.frontend {
            Frontend::Virtio => vm.kind == MachineKind::Pc || disk.pci_bus.is_some(),
            Frontend::Scsi { .. } | Frontend::ScsiCdrom { .. } => true,
            _ => false,
        };
        if !removable {
            return Err(fail(
                "this disk was not attached where it can be unplugged (sata, or virtio on q35's \
                 root complex)"
                    .into(),
            ));
        }
        let id = disk.device_id();
        let mut events = vm.qmp.events();
        vm.qmp
            .execute_raw("device_del", json!({ "id": id }))
            .await
            .map_err(|e| fail(e.to_string()))?;
        events
            .wait_for(DEVICE_DELETED_TIMEOUT, |e| {
                e.name == "DEVICE_DELETED" && e.data_str("device") == Some(id.as_str())
            })
            .await
            .map_err(|e| {
                fail(format!(
                    "the guest did not release the device within {DEVICE_DELETED_TIMEOUT:?} ({e})"
                ))
            })?;
        vm.qmp
            .execute_raw("blockdev-del", json!({"node-name": disk.node_name()}))
            .await
            .map_err(|e| fail(e.to_string()))?;
        tracing::info!(disk = %disk.name, "disk unplugged");
        vm.disks.retain(|d| d.name != disk.name);
        vm.hotpluggable.remove(&disk.name);
        Ok(())
    }
}

/// An agent's answer in the API's shape. qapi's types and the API's are both qemu-ga's JSON, so
/// the answer goes through that JSON rather than being copied member by member.
fn relay<T: serde::de::DeserializeOwned>(
    command: &'static str,
    answer: Result<impl serde::Serialize, qmp::Error>,
) -> Result<T, Error> {
    serde_json::to_value(answer.map_err(Error::Agent)?)
        .and_then(serde_json::from_value)
        .map_err(|source| Error::AgentAnswer { command, source })
}

/// Removes the per-VM sockets a finished QEMU leaves behind.
pub fn cleanup_sockets(dirs: &Dirs, uid: &str) {
    for p in [
        dirs.qmp_socket(uid),
        dirs.agent_socket(uid),
        dirs.serial_backend_socket(uid),
        dirs.serial_socket(uid),
        dirs.vnc_socket(uid),
    ] {
        let _ = std::fs::remove_file(p);
    }
}

/// Maps QEMU's block backends to the VMI's disks. A backend is a disk's when its root node is
/// the disk's node or its device is the disk's (`qdev` is the device's QOM path, which for
/// virtio-blk ends in `/virtio-backend`). A disk QEMU does not list (a CD-ROM without medium
/// once ejected) is left out rather than reported as zeros.
fn disk_stats<'a>(
    names: impl IntoIterator<Item = &'a str>,
    stats: &[qmp::compat::BlockStats],
) -> Vec<DiskStats> {
    names
        .into_iter()
        .filter_map(|name| {
            let node = crate::qemu::node_name(name);
            let qdev = format!("/machine/peripheral/{}", crate::qemu::device_id(name));
            let s = stats.iter().find(|s| {
                s.node_name.as_deref() == Some(node.as_str())
                    || s.qdev.as_deref().is_some_and(|q| {
                        q.strip_prefix(qdev.as_str())
                            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
                    })
            })?;
            let c = &s.stats;
            Some(DiskStats {
                name: name.to_owned(),
                read_bytes: c.rd_bytes,
                write_bytes: c.wr_bytes,
                read_ops: c.rd_operations,
                write_ops: c.wr_operations,
                flush_ops: c.flush_operations,
                read_time_ns: c.rd_total_time_ns,
                write_time_ns: c.wr_total_time_ns,
                flush_time_ns: c.flush_total_time_ns,
            })
        })
        .collect()
}

/// libvirt refuses to run a guest whose CPU lacks a feature the domain requires (policy
/// `require`, KubeVirt's default); QEMU only warns when it drops a feature the accelerator
/// cannot give. So the launcher asks the first vCPU, before the guest's first instruction,
/// whether it got each required feature, and names the first it did not get.
async fn missing_required_feature(
    qmp: &qmp::QmpClient,
    vmi: &VirtualMachineInstance,
) -> Result<(), Error> {
    let required: Vec<(usize, &str)> = vmi
        .spec
        .domain
        .cpu
        .iter()
        .flat_map(|c| c.features.iter().enumerate())
        .filter(|(_, f)| f.required())
        .map(|(i, f)| (i, f.name.as_str()))
        .collect();
    if required.is_empty() {
        return Ok(());
    }
    let cpus = qmp.execute_raw("query-cpus-fast", json!({})).await?;
    let Some(path) = cpus[0]["qom-path"].as_str() else {
        return Err(Error::QemuExited(format!(
            "query-cpus-fast named no vCPU: {cpus}"
        )));
    };
    for (i, name) in required {
        let got = qmp
            .execute_raw("qom-get", json!({"path": path, "property": name}))
            .await?;
        if got.as_bool() != Some(true) {
            return Err(Error::InvalidVmi(convert::ConvertError {
                field: format!("spec.domain.cpu.features[{i}]"),
                message: format!(
                    "{name} is required, and this node's CPU cannot give it to the guest"
                ),
            }));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(node: Option<&str>, qdev: &str, rd_bytes: u64) -> qmp::compat::BlockStats {
        serde_json::from_value(json!({
            "device": "",
            "qdev": qdev,
            "node-name": node,
            "stats": {
                "rd_bytes": rd_bytes, "wr_bytes": 2, "rd_operations": 3, "wr_operations": 4,
                "flush_operations": 5, "rd_total_time_ns": 6, "wr_total_time_ns": 7,
                "flush_total_time_ns": 8, "idle_time_ns": 9
            }
        }))
        .unwrap()
    }

    #[test]
    fn blockstats_map_to_vmi_disks_by_node_or_device() {
        let stats = [
            // A device whose node QEMU names: found by node, whatever the qdev says.
            backend(
                Some(&crate::qemu::node_name("root")),
                "/machine/peripheral/ua-root/virtio-backend",
                100,
            ),
            // No node (a CD-ROM's backend): found by its device path.
            backend(None, "/machine/peripheral/ua-cd", 200),
            // `ua-c` is a prefix of `ua-cd` but another device.
            backend(None, "/machine/peripheral/ua-cdx", 300),
            // Not one of the VMI's disks (QEMU's own pflash, say).
            backend(Some("pflash0"), "", 400),
        ];
        let got = disk_stats(["cd", "root", "c", "gone"], &stats);
        assert_eq!(
            got.iter()
                .map(|d| (d.name.as_str(), d.read_bytes))
                .collect::<Vec<_>>(),
            [("cd", 200), ("root", 100)]
        );
        assert_eq!(
            got[1],
            DiskStats {
                name: "root".into(),
                read_bytes: 100,
                write_bytes: 2,
                read_ops: 3,
                write_ops: 4,
                flush_ops: 5,
                read_time_ns: 6,
                write_time_ns: 7,
                flush_time_ns: 8,
            }
        );
    }
}
