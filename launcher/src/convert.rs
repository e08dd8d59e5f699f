//! VMI -> [`QemuConfig`] plus the files that must exist before QEMU starts. Pure: host facts
//! (accelerator, firmware paths, which volumes are block devices) come in as arguments.
//!
//! [`convert`] assembles the pieces, one function per device family, in the order the typed
//! config in `crate::qemu` has them: machine, CPU and memory ([`machine_kind`], `smm`, `cpu`,
//! `memory`, `smbios`), firmware (`firmware`, `kernel_boot`), disks (`disks` places and numbers
//! what [`disk_for`] builds from a disk and its volume, one `Vol` method per volume source),
//! interfaces (`nic`), filesystems (`filesystems`), then the consoles, agent channel, RNG and balloon. File preparations are
//! collected in that order, and the first problem found is the one reported.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use api::VirtualMachineInstance;
use api::configdisk::{self, ConfigKind};
use api::quantity;
use api::vmi::{
    BootloaderKind, CloudInitNoCloudSource, Disk as VmiDisk, DiskBus, DiskCache, DiskIo,
    DiskTargetKind, EmptyDiskSource, FeatureState, Features, HostDisk, HostDiskType, Interface,
    InterfaceBinding, InterfaceModel, PciAddress, VolumeSource,
};

use crate::paths::Dirs;
use crate::prepare::{Prep, Seed, SeedData};
use crate::qemu::{
    Accel, AgentChannel, Aio, CacheMode, Clock, Controllers, Cpu, CpuFeature, Disk, DiskSource,
    ErrorPolicy, Filesystem, Firmware, Frontend, ImageFormat, KernelBoot, Machine, MachineKind,
    Memory, Monitor, Nic, NicModel, QemuConfig, SATA_PORTS, SerialPort, Smbios, Tablet,
    VirtioModel, Vnc, Watchdog, video_device,
};

/// A VMI the launcher cannot run, with the field that says why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConvertError {
    pub field: String,
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConvertError {
    ConvertError {
        field: field.into(),
        message: message.into(),
    }
}

/// A name that can go into QEMU's argv as a device id (`ua-<name>`) or a CPU model. Admission
/// refuses the others (api validation), but the launcher takes VMIs from virt-handler, and a
/// name with a comma would inject options, a NUL could not be passed in the argv at all.
fn qemu_id_name(field: String, name: &str) -> Result<(), ConvertError> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(err(
            field,
            format!("{name:?} is not a name QEMU takes (letters, digits, '-', '_', '.')"),
        ));
    }
    Ok(())
}

/// What the converter needs to know about the host.
#[derive(Debug, Clone)]
pub struct Host {
    pub accel: Accel,
    /// Where Debian's `ovmf` package puts its images (`/usr/share/OVMF`).
    pub ovmf_dir: PathBuf,
    /// A hugetlbfs mount for guests that ask for hugepages.
    pub hugepages_dir: PathBuf,
    /// Volumes whose PVC is a block device (`<block-device-dir>/<volume>` exists as one).
    pub block_volumes: BTreeSet<String>,
    /// What phase 1 (virt-handler) cached per interface name: the guest MAC of a bridge
    /// binding and the pod MTU come from there.
    pub network: BTreeMap<String, network::CachedInterface>,
}

/// How many empty PCIe root ports a q35 machine keeps for hotplugged virtio disks.
pub const SPARE_HOTPLUG_PORTS: usize = 4;

/// How long the boot menu of a guest started paused waits (KubeVirt's `bootMenuTimeoutMS`).
const PAUSED_START_BOOT_MENU_MS: u32 = 10_000;

/// How long a sync waits for a filesystem's virtiofsd to listen: its container starts with the
/// launcher's in the same pod, and a daemon that is not there by then will not come.
pub const VIRTIOFS_SOCKET_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

pub fn hotplug_port(i: usize) -> String {
    format!("hotplug-port{i}")
}

/// The launcher's plan for one VMI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub config: QemuConfig,
    pub preps: Vec<Prep>,
    /// Names of disks placed where they can be unplugged later.
    pub hotpluggable: BTreeSet<String>,
}

pub fn convert(
    vmi: &VirtualMachineInstance,
    dirs: &Dirs,
    host: &Host,
) -> Result<Plan, ConvertError> {
    let uid = vmi
        .metadata
        .uid
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| err("metadata.uid", "is required"))?;
    let name = vmi.metadata.name.clone().unwrap_or_default();
    let namespace = vmi
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    if let Some(field) = serde_json::to_value(&vmi.spec)
        .ok()
        .and_then(|v| api::validation::nul_byte_at(&v, "spec"))
    {
        return Err(err(field, api::validation::NUL_BYTE));
    }
    let kind = machine_kind(vmi)?;
    let mut preps = Vec::new();
    let firmware = firmware(vmi, kind, &uid, dirs, host, &mut preps)?;
    let timers = timers(vmi, host.accel)?;
    if let Some(model) = vmi
        .spec
        .domain
        .cpu
        .as_ref()
        .and_then(|c| c.model.as_deref())
        && !model.is_empty()
    {
        qemu_id_name("spec.domain.cpu.model".to_owned(), model)?;
        if model == api::validation::QEMU_HELP_MODEL {
            return Err(err(
                "spec.domain.cpu.model",
                api::validation::NOT_A_CPU_MODEL,
            ));
        }
    }
    let mut cpu = cpu(vmi, host.accel);
    cpu.kvmclock = timers.kvmclock;
    let features = vmi.spec.domain.features.clone().unwrap_or_default();
    cpu.kvm_hidden = features.kvm.as_ref().and_then(|k| k.hidden) == Some(true);
    cpu.pv_unhalt = pv_unhalt(&features, host.accel)?;
    if let Some(c) = &vmi.spec.domain.cpu {
        cpu.features = cpu_features(c)?;
        // KubeVirt adds KVM's `hint-dedicated` for dedicated CPUs on amd64 (libvirt's
        // `kvm-hint-dedicated=on`); the hint is KVM's, so TCG gets nothing.
        if c.dedicated_cpu_placement == Some(true) && host.accel == Accel::Kvm {
            cpu.features.push(CpuFeature {
                name: "kvm-hint-dedicated".into(),
                enabled: true,
            });
        }
    }
    let machine = Machine {
        kind,
        accel: host.accel,
        smm: smm(vmi, &firmware),
        acpi: features.acpi_enabled(),
        hpet: timers.hpet,
        bios_serial_console: vmi
            .spec
            .domain
            .firmware
            .as_ref()
            .and_then(|f| f.bootloader.as_ref())
            .and_then(api::vmi::Bootloader::kind)
            .is_some_and(|k| matches!(k, BootloaderKind::Bios(b) if b.use_serial == Some(true))),
    };
    let memory = memory(vmi, host, &mut preps)?;
    let smbios = smbios(vmi, &uid)?;
    let kernel_boot = kernel_boot(vmi, dirs, &mut preps)?;
    let Storage {
        mut controllers,
        mut disks,
        hotpluggable,
        iothreads,
    } = disks(vmi, kind, dirs, host, &namespace, &name, &mut preps)?;
    let tablets = tablets(vmi)?;
    controllers.usb = tablets.iter().any(|t| t.usb);
    let virtio = virtio_model(vmi);
    controllers.virtio = virtio;
    let mut nics = Vec::new();
    for (i, iface) in vmi.spec.domain.devices.interfaces.iter().enumerate() {
        nics.push(nic(vmi, i, iface, &uid, host, &mut preps)?);
    }
    place_pinned(vmi, kind, &mut controllers, &mut disks, &mut nics)?;

    let filesystems = filesystems(vmi, dirs, &mut preps)?;

    let devices = &vmi.spec.domain.devices;
    let config = QemuConfig {
        name: format!("{namespace}_{name}"),
        machine,
        cpu,
        memory,
        iothreads,
        clock: timers.clock,
        smbios,
        firmware,
        kernel_boot,
        // KubeVirt's configureBootMenu: whoever starts a guest paused gets time to reach the
        // boot menu on VNC once it is unpaused.
        boot_menu_ms: vmi
            .spec
            .starts_paused()
            .then_some(PAUSED_START_BOOT_MENU_MS),
        controllers,
        disks,
        nics,
        filesystems,
        monitor: Monitor::Socket(dirs.qmp_socket(&uid)),
        serial: devices
            .autoattach_serial_console
            .unwrap_or(true)
            .then(|| SerialPort {
                socket: dirs.serial_backend_socket(&uid),
            }),
        agent: Some(AgentChannel {
            socket: dirs.agent_socket(&uid),
            virtio,
        }),
        vnc: if devices.autoattach_graphics_device.unwrap_or(true) {
            Some(Vnc {
                socket: dirs.vnc_socket(&uid),
                video: video(vmi)?,
            })
        } else {
            None
        },
        rng: devices.rng.is_some(),
        balloon: devices.autoattach_mem_balloon.unwrap_or(true),
        virtio,
        watchdog: watchdog(vmi)?,
        tablets,
        incoming: false,
    };
    Ok(Plan {
        config,
        preps,
        hotpluggable,
    })
}

// ---- machine, CPU, memory ----

pub fn machine_kind(vmi: &VirtualMachineInstance) -> Result<MachineKind, ConvertError> {
    let ty = vmi
        .spec
        .domain
        .machine
        .as_ref()
        .and_then(|m| m.machine_type.as_deref())
        .unwrap_or("q35");
    // KubeVirt's defaults name RHEL machine types (pc-q35-rhel9.4.0); upstream QEMU has no such
    // versions, so the family is what counts.
    if ty == "q35" || ty.starts_with("pc-q35") {
        Ok(MachineKind::Q35)
    } else if ty == "pc" || ty.starts_with("pc-i440fx") {
        Ok(MachineKind::Pc)
    } else {
        Err(err(
            "spec.domain.machine.type",
            format!("machine type {ty:?} is not supported: use q35 or pc"),
        ))
    }
}

/// The display adapter: `video.type`, KubeVirt's `vga` when unset.
fn video(vmi: &VirtualMachineInstance) -> Result<&'static str, ConvertError> {
    let ty = vmi
        .spec
        .domain
        .devices
        .video
        .as_ref()
        .map_or("vga", |v| v.video_type.as_deref().unwrap_or_default());
    video_device(ty).ok_or_else(|| {
        err(
            "spec.domain.devices.video.type",
            format!("unknown video type {ty:?}"),
        )
    })
}

/// The virtio devices' model: transitional for `useVirtioTransitional`, else modern only, as
/// KubeVirt's amd64 converter picks it.
fn virtio_model(vmi: &VirtualMachineInstance) -> VirtioModel {
    if vmi.spec.domain.devices.use_virtio_transitional == Some(true) {
        VirtioModel::Transitional
    } else {
        VirtioModel::NonTransitional
    }
}

/// The tablets of `inputs`, on USB (KubeVirt's default bus) or virtio. Without inputs,
/// `autoattachInputDevice` gives the USB tablet `default-0` KubeVirt's VM controller adds.
fn tablets(vmi: &VirtualMachineInstance) -> Result<Vec<Tablet>, ConvertError> {
    let devices = &vmi.spec.domain.devices;
    if devices.inputs.is_empty() && devices.wants_input_device() {
        return Ok(vec![Tablet {
            name: "default-0".to_owned(),
            usb: true,
        }]);
    }
    devices
        .inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            qemu_id_name(format!("spec.domain.devices.inputs[{i}].name"), &input.name)?;
            if input.input_type.as_deref().is_some_and(|t| t != "tablet") {
                return Err(err(
                    format!("spec.domain.devices.inputs[{i}].type"),
                    "only tablets are supported",
                ));
            }
            let usb = match input.bus.as_deref() {
                None | Some("usb") => true,
                Some("virtio") => false,
                Some(other) => {
                    return Err(err(
                        format!("spec.domain.devices.inputs[{i}].bus"),
                        format!("unknown input bus {other:?} (usb, virtio)"),
                    ));
                }
            };
            Ok(Tablet {
                name: input.name.clone(),
                usb,
            })
        })
        .collect()
}

/// The i6300esb watchdog, with KubeVirt's default action (`reset`) when defaulting did not run.
fn watchdog(vmi: &VirtualMachineInstance) -> Result<Option<Watchdog>, ConvertError> {
    let Some(w) = &vmi.spec.domain.devices.watchdog else {
        return Ok(None);
    };
    let Some(i6300esb) = &w.i6300esb else {
        return Err(err(
            "spec.domain.devices.watchdog",
            "only the i6300esb watchdog is supported",
        ));
    };
    qemu_id_name("spec.domain.devices.watchdog.name".to_owned(), &w.name)?;
    let action = i6300esb.action.as_deref().unwrap_or("reset");
    // It goes to `-watchdog-action` as it is (the fuzzer found a NUL there).
    api::vmi::check_watchdog_action(action)
        .map_err(|why| err("spec.domain.devices.watchdog.i6300esb.action", why))?;
    Ok(Some(Watchdog {
        name: w.name.clone(),
        action: action.to_owned(),
    }))
}

/// SMM: on for secure boot (OVMF's secure build needs it), otherwise as `features.smm` says
/// (enabled unless it says `false`), and QEMU's default when the VMI says nothing.
fn smm(vmi: &VirtualMachineInstance, firmware: &Firmware) -> Option<bool> {
    let feature = vmi
        .spec
        .domain
        .features
        .as_ref()
        .and_then(|f| f.smm.as_ref());
    match (firmware, feature) {
        (
            Firmware::Efi {
                secure_boot: true, ..
            },
            _,
        ) => Some(true),
        (_, Some(s)) => Some(s.enabled.unwrap_or(true)),
        _ => None,
    }
}

/// Under TCG there is no host CPU to pass through; `max` enables every feature TCG emulates,
/// which is the closest meaning of "as much of the host as possible".
fn cpu(vmi: &VirtualMachineInstance, accel: Accel) -> Cpu {
    let c = vmi.spec.domain.cpu.clone().unwrap_or_default();
    let model = match (c.model.as_deref(), accel) {
        (None | Some("" | "host-model" | "host-passthrough"), Accel::Kvm) => "host".to_owned(),
        (None | Some("" | "host-model" | "host-passthrough"), Accel::Tcg) => "max".to_owned(),
        (Some(named), _) => named.to_owned(),
    };
    Cpu {
        model,
        kvm_hidden: false,
        kvmclock: None,
        pv_unhalt: None,
        features: Vec::new(),
        sockets: c.sockets.unwrap_or(1).max(1),
        cores: c.cores.unwrap_or(1).max(1),
        threads: c.threads.unwrap_or(1).max(1),
        max_sockets: c.max_sockets.unwrap_or(0),
    }
}

/// `cpu.features` as libvirt renders KubeVirt's `<feature policy=...>` on `-cpu`
/// (`qemuBuildCpuModelArgStr`): `require` (KubeVirt's default, an empty policy) and `force`
/// turn the feature on, `disable` and `forbid` off. libvirt resolves `optional` against the
/// host's CPU before it starts QEMU, leaving the feature on where the host has it; QEMU
/// itself drops a feature the accelerator cannot give (with a warning), so `optional` is
/// rendered on. That QEMU dropped a `require`d one is found after start
/// (`vm::missing_required_features`), as libvirt checks.
fn cpu_features(c: &api::vmi::Cpu) -> Result<Vec<CpuFeature>, ConvertError> {
    c.features
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let field = format!("spec.domain.cpu.features[{i}]");
            if !api::labels::is_label_name(&f.name) {
                return Err(err(
                    format!("{field}.name"),
                    format!("{:?} is not a CPU feature name", f.name),
                ));
            }
            let enabled = match f.policy.as_deref() {
                None | Some("" | "require" | "force" | "optional") => true,
                Some("disable" | "forbid") => false,
                Some(other) => {
                    return Err(err(
                        format!("{field}.policy"),
                        format!(
                            "unknown policy {other:?} (force, require, optional, disable, forbid)"
                        ),
                    ));
                }
            };
            Ok(CpuFeature {
                name: f.name.clone(),
                enabled,
            })
        })
        .collect()
}

/// Paravirtual spinlocks as libvirt renders KubeVirt's `<pvspinlock>`: `kvm-pv-unhalt` on or
/// off. Under TCG the guest sees none of KVM's paravirtual features, so asking for them is
/// refused rather than dropped by QEMU with a warning.
fn pv_unhalt(features: &Features, accel: Accel) -> Result<Option<bool>, ConvertError> {
    let wanted = features.pvspinlock.as_ref().map(FeatureState::is_enabled);
    if wanted == Some(true) && accel == Accel::Tcg {
        return Err(err(
            "spec.domain.features.pvspinlock",
            "paravirtual spinlocks need KVM, and this node runs guests under TCG",
        ));
    }
    Ok(wanted)
}

/// What `clock` makes of the machine, the CPU and `-rtc`.
#[derive(Debug, Default)]
struct Timers {
    clock: Clock,
    hpet: Option<bool>,
    kvmclock: Option<bool>,
}

/// `clock` as libvirt renders KubeVirt's `<clock>` for QEMU: UTC with an optional offset, or a
/// time zone's local time, on `-rtc`, the RTC's track and catch-up there too, the PIT's lost tick policy on KVM's
/// in-kernel PIT, the HPET on the machine, kvmclock on the CPU. What QEMU cannot do on this node
/// is refused by name, and so is the Hyper-V clock, an enlightenment like those of
/// `features.hyperv`, which this launcher does not give.
fn timers(vmi: &VirtualMachineInstance, accel: Accel) -> Result<Timers, ConvertError> {
    let Some(c) = &vmi.spec.domain.clock else {
        return Ok(Timers::default());
    };
    let field = "spec.domain.clock";
    let t = c.timer.clone().unwrap_or_default();
    let present = |p: Option<bool>| p.unwrap_or(true);
    let mut clock = Clock {
        utc_offset: c
            .utc_offset_at(std::time::SystemTime::now())
            .map_err(|message| err(format!("{field}.timezone"), message))?,
        ..Clock::default()
    };
    if let Some(rtc) = &t.rtc {
        let rfield = format!("{field}.timer.rtc");
        if !present(rtc.present) {
            return Err(err(
                format!("{rfield}.present"),
                "a PC's RTC cannot be removed",
            ));
        }
        clock.rtc_clock = match rtc.track.as_deref() {
            None => None,
            Some("guest") => Some("vm"),
            Some("wall") => Some("host"),
            Some(other) => {
                return Err(err(
                    format!("{rfield}.track"),
                    format!("unknown track {other:?} (guest, wall)"),
                ));
            }
        };
        clock.rtc_catchup = match rtc.tick_policy.as_deref() {
            None | Some("delay") => false,
            Some("catchup") => true,
            Some(other) => {
                return Err(err(
                    format!("{rfield}.tickPolicy"),
                    format!("QEMU's RTC has no {other:?} tick policy (delay, catchup)"),
                ));
            }
        };
    }
    if let Some(pit) = &t.pit {
        let pfield = format!("{field}.timer.pit");
        if !present(pit.present) {
            return Err(err(
                format!("{pfield}.present"),
                "removing the PIT is not supported by this launcher",
            ));
        }
        clock.pit_lost_tick_policy = match (accel, pit.tick_policy.as_deref()) {
            // Re-injecting missed ticks (catchup) is what KVM's PIT does by default.
            (Accel::Tcg, None) | (Accel::Kvm, Some("catchup")) => None,
            (Accel::Tcg, Some(_)) => {
                return Err(err(
                    format!("{pfield}.tickPolicy"),
                    "needs KVM's in-kernel PIT; this node runs guests under TCG, whose PIT has \
                     no lost tick policy",
                ));
            }
            (Accel::Kvm, None | Some("delay")) => Some("delay"),
            (Accel::Kvm, Some("discard")) => Some("discard"),
            (Accel::Kvm, Some(other)) => {
                return Err(err(
                    format!("{pfield}.tickPolicy"),
                    format!("QEMU's PIT has no {other:?} tick policy (delay, catchup, discard)"),
                ));
            }
        };
    }
    if let Some(hpet) = &t.hpet
        && hpet.tick_policy.is_some()
    {
        return Err(err(
            format!("{field}.timer.hpet.tickPolicy"),
            "QEMU's HPET has no tick policy",
        ));
    }
    if t.hyperv.as_ref().is_some_and(|h| present(h.present)) {
        return Err(err(
            format!("{field}.timer.hyperv.present"),
            "Hyper-V enlightenments are not supported by this launcher",
        ));
    }
    let kvmclock = t.kvm.as_ref().map(|k| present(k.present));
    if kvmclock == Some(true) && accel == Accel::Tcg {
        return Err(err(
            format!("{field}.timer.kvm.present"),
            "kvmclock needs KVM, and this node runs guests under TCG",
        ));
    }
    Ok(Timers {
        clock,
        hpet: t.hpet.as_ref().map(|h| present(h.present)),
        kvmclock,
    })
}

/// Guest memory, and for hugepages the check that the host's mount can back them.
fn memory(
    vmi: &VirtualMachineInstance,
    host: &Host,
    preps: &mut Vec<Prep>,
) -> Result<Memory, ConvertError> {
    let domain = &vmi.spec.domain;
    let (field, q) = if let Some(g) = domain.memory.as_ref().and_then(|m| m.guest.as_ref()) {
        ("spec.domain.memory.guest", g)
    } else if let Some(r) = domain.resources.requests.get("memory") {
        ("spec.domain.resources.requests.memory", r)
    } else if let Some(l) = domain.resources.limits.get("memory") {
        ("spec.domain.resources.limits.memory", l)
    } else {
        return Err(err(
            "spec.domain.memory.guest",
            "no guest memory size: set memory.guest or resources.requests.memory",
        ));
    };
    let bytes = quantity::bytes(&q.0).map_err(|e| err(field, e.to_string()))?;
    let size_mib = bytes.div_ceil(1 << 20);
    if size_mib < 16 {
        return Err(err(field, format!("{} is too little for a guest", q.0)));
    }
    let hugepages = match domain.memory.as_ref().and_then(|m| m.hugepages.as_ref()) {
        None => None,
        Some(h) => {
            let hfield = "spec.domain.memory.hugepages.pageSize";
            let page = quantity::bytes(h.page_size.as_deref().unwrap_or("2Mi"))
                .map_err(|e| err(hfield, e.to_string()))?;
            if page == 0 || bytes % page != 0 {
                return Err(err(
                    field,
                    format!("{} is not a multiple of the hugepage size", q.0),
                ));
            }
            preps.push(Prep::RequireHugetlbfs {
                path: host.hugepages_dir.clone(),
                page_size: page,
                field: "spec.domain.memory.hugepages".into(),
            });
            Some(host.hugepages_dir.clone())
        }
    };
    // KubeVirt gives QEMU a maximum only when it differs from the guest's size.
    let max_mib = match domain.memory.as_ref().and_then(|m| m.max_guest.as_ref()) {
        None => None,
        Some(max) => {
            let mfield = "spec.domain.memory.maxGuest";
            let max_bytes = quantity::bytes(&max.0).map_err(|e| err(mfield, e.to_string()))?;
            if max_bytes < bytes {
                return Err(err(
                    mfield,
                    format!("{} is less than the guest's {}", max.0, q.0),
                ));
            }
            Some(max_bytes.div_ceil(1 << 20)).filter(|&m| m > size_mib)
        }
    };
    Ok(Memory {
        size_mib,
        max_mib,
        hugepages,
        shared: api::virtiofs::enabled(&vmi.spec),
    })
}

/// The VMI's filesystems, each served by virtiofsd in its own container of the pod, which
/// must be listening before QEMU starts: QEMU connects once, at start.
fn filesystems(
    vmi: &VirtualMachineInstance,
    dirs: &Dirs,
    preps: &mut Vec<Prep>,
) -> Result<Vec<Filesystem>, ConvertError> {
    let mut out = Vec::new();
    for (i, fs) in vmi.spec.domain.devices.filesystems.iter().enumerate() {
        let field = format!("spec.domain.devices.filesystems[{i}]");
        // The tag reaches the argv and the socket path; admission holds it to a DNS label.
        qemu_id_name(format!("{field}.name"), &fs.name)?;
        if fs.name.len() > api::virtiofs::TAG_MAX {
            return Err(err(
                format!("{field}.name"),
                format!(
                    "longer than the {} bytes of a virtiofs tag",
                    api::virtiofs::TAG_MAX
                ),
            ));
        }
        let socket = api::virtiofs::socket_path(&dirs.share, &fs.name);
        preps.push(Prep::WaitForSocket {
            path: socket.clone(),
            within: VIRTIOFS_SOCKET_WAIT,
            field,
        });
        out.push(Filesystem {
            tag: fs.name.clone(),
            socket,
            queue_size: 1024,
        });
    }
    Ok(out)
}

/// SMBIOS system information. QEMU wants a real UUID; Kubernetes uids are, and so must
/// firmware.uuid be.
fn smbios(vmi: &VirtualMachineInstance, uid: &str) -> Result<Smbios, ConvertError> {
    let firmware = vmi.spec.domain.firmware.as_ref();
    let (uuid_field, uuid) = match firmware.and_then(|f| f.uuid.clone()) {
        Some(u) => ("spec.domain.firmware.uuid", u),
        None => ("metadata.uid", uid.to_owned()),
    };
    if uuid::Uuid::parse_str(&uuid).is_err() {
        return Err(err(uuid_field, format!("{uuid:?} is not a UUID")));
    }
    Ok(Smbios {
        uuid,
        serial: firmware.and_then(|f| f.serial.clone()),
        manufacturer: "KubeVirt".into(),
        product: "None".into(),
        family: "KubeVirt".into(),
    })
}

// ---- firmware ----

/// BIOS, or OVMF with a per-VM copy of its variable store. Secure boot needs SMM, which OVMF
/// supports on q35 only.
fn firmware(
    vmi: &VirtualMachineInstance,
    kind: MachineKind,
    uid: &str,
    dirs: &Dirs,
    host: &Host,
    preps: &mut Vec<Prep>,
) -> Result<Firmware, ConvertError> {
    let domain = &vmi.spec.domain;
    let efi = match domain
        .firmware
        .as_ref()
        .and_then(|f| f.bootloader.as_ref())
        .and_then(api::vmi::Bootloader::kind)
    {
        None | Some(BootloaderKind::Bios(_)) => return Ok(Firmware::Bios),
        Some(BootloaderKind::Efi(efi)) => efi,
    };
    let secure_boot = efi.secure_boot_enabled();
    if secure_boot && kind == MachineKind::Pc {
        return Err(err(
            "spec.domain.firmware.bootloader.efi.secureBoot",
            "secure boot needs SMM, which OVMF supports on q35 only: use machine type \
             q35 or set secureBoot: false",
        ));
    }
    let smm_off = domain
        .features
        .as_ref()
        .and_then(|f| f.smm.as_ref())
        .is_some_and(|s| s.enabled == Some(false));
    if secure_boot && smm_off {
        return Err(err(
            "spec.domain.features.smm.enabled",
            "secure boot needs SMM: enable it or set secureBoot: false",
        ));
    }
    let (code, vars_template) = if secure_boot {
        ("OVMF_CODE_4M.secboot.fd", "OVMF_VARS_4M.ms.fd")
    } else {
        ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd")
    };
    let code = host.ovmf_dir.join(code);
    // Persistent variables live on the backend-storage claim under the VMI's name, as
    // KubeVirt's; the others are the pod's, gone with it.
    let (vars, vars_field) = if api::backendstorage::has_persistent_efi(vmi) {
        (
            dirs.persistent_efi_vars(vmi.metadata.name.as_deref().unwrap_or_default()),
            api::backendstorage::PERSISTENT_EFI_FIELD,
        )
    } else {
        (dirs.efi_vars(uid), "spec.domain.firmware.bootloader.efi")
    };
    preps.push(Prep::RequireFile {
        path: code.clone(),
        field: "spec.domain.firmware.bootloader.efi".into(),
    });
    preps.push(Prep::CopyFile {
        from: host.ovmf_dir.join(vars_template),
        to: vars.clone(),
        field: vars_field.into(),
    });
    Ok(Firmware::Efi {
        code,
        vars,
        secure_boot,
    })
}

/// Direct kernel boot: the kernel and initrd virt-handler copied out of the kernelBoot
/// container into `<container-disk-dir>/kernel-boot/`.
fn kernel_boot(
    vmi: &VirtualMachineInstance,
    dirs: &Dirs,
    preps: &mut Vec<Prep>,
) -> Result<Option<KernelBoot>, ConvertError> {
    let Some(kb) = vmi.spec.kernel_boot() else {
        return Ok(None);
    };
    let field = "spec.domain.firmware.kernelBoot.container";
    let c = kb.container.as_ref().ok_or_else(|| {
        err(
            field,
            "kernelBoot needs a container with kernelPath and/or initrdPath",
        )
    })?;
    let artifact = |p: &Option<String>, what: &str| -> Result<Option<PathBuf>, _> {
        match p.as_deref() {
            None | Some("") => Ok(None),
            Some(p) => {
                if let Some(problem) = api::validation::node_path_problem(p) {
                    return Err(err(format!("{field}.{what}"), problem));
                }
                let base = Path::new(p).file_name().ok_or_else(|| {
                    err(format!("{field}.{what}"), format!("{p:?} names no file"))
                })?;
                Ok(Some(dirs.container_disks.join("kernel-boot").join(base)))
            }
        }
    };
    let kernel = artifact(&c.kernel_path, "kernelPath")?
        .ok_or_else(|| err(format!("{field}.kernelPath"), "is required"))?;
    let initrd = artifact(&c.initrd_path, "initrdPath")?;
    preps.push(Prep::RequireFile {
        path: kernel.clone(),
        field: format!("{field}.kernelPath"),
    });
    if let Some(i) = &initrd {
        preps.push(Prep::RequireFile {
            path: i.clone(),
            field: format!("{field}.initrdPath"),
        });
    }
    Ok(Some(KernelBoot {
        kernel,
        initrd,
        cmdline: kb.kernel_args.clone(),
    }))
}

// ---- disks ----

/// The VMI's disks in spec order, numbered on their buses, and the controllers they need.
struct Storage {
    controllers: Controllers,
    disks: Vec<Disk>,
    hotpluggable: BTreeSet<String>,
    iothreads: u32,
}

/// Converts every disk and places it: SATA units and SCSI LUNs in spec order, a root port of
/// its own for each hotpluggable virtio disk on q35, and spare ports for disks plugged later.
fn disks(
    vmi: &VirtualMachineInstance,
    kind: MachineKind,
    dirs: &Dirs,
    host: &Host,
    namespace: &str,
    name: &str,
    preps: &mut Vec<Prep>,
) -> Result<Storage, ConvertError> {
    let devices = &vmi.spec.domain.devices;
    let mut controllers = Controllers::default();
    let mut disks = Vec::new();
    let mut hotpluggable = BTreeSet::new();
    let mut sata_units = 0u32;
    let mut scsi_luns = 0u32;
    let mut ports_used = 0usize;
    let mut threads = IoThreads::of(vmi)?;
    for (i, d) in devices.disks.iter().enumerate() {
        let field = format!("spec.domain.devices.disks[{i}]");
        let (mut disk, plug, prep) = disk_for(vmi, d, &field, dirs, host, namespace, name)?;
        preps.extend(prep);
        if disk.frontend == Frontend::Virtio {
            disk.iothread = threads.next(d.dedicated_io_thread == Some(true));
        }
        if let Some(a) = d.disk.as_ref().and_then(|t| t.pci_address.as_deref()) {
            let afield = format!("{field}.disk.pciAddress");
            if disk.frontend != Frontend::Virtio {
                return Err(err(
                    afield,
                    "only a disk on the virtio bus has a PCI address",
                ));
            }
            if plug {
                return Err(err(
                    afield,
                    "a hotpluggable disk sits on a PCIe root port of its own",
                ));
            }
            if PciAddress::parse(a).is_none() {
                return Err(err(afield, NOT_A_PCI_ADDRESS));
            }
        }
        match disk.frontend {
            Frontend::Sata { .. } | Frontend::SataCdrom { .. } => {
                if sata_units >= SATA_PORTS {
                    return Err(err(
                        format!("{field}.bus"),
                        format!("at most {SATA_PORTS} disks fit on the sata bus"),
                    ));
                }
                disk.frontend = disk.frontend.numbered(sata_units);
                sata_units += 1;
                controllers.sata = true;
            }
            Frontend::Scsi { .. } | Frontend::ScsiCdrom { .. } => {
                disk.frontend = disk.frontend.numbered(scsi_luns);
                scsi_luns += 1;
                controllers.scsi = true;
            }
            Frontend::Virtio => {
                // Devices on q35's root complex cannot be unplugged; those that may be get a
                // root port of their own.
                if plug && kind == MachineKind::Q35 {
                    disk.pci_bus = Some(hotplug_port(ports_used));
                    ports_used += 1;
                }
            }
        }
        if plug {
            hotpluggable.insert(disk.name.clone());
        }
        disks.push(disk);
    }
    // A SCSI controller is always there (unless hotplug is disabled) so that SCSI disks can be
    // hotplugged later, as in KubeVirt.
    if !devices.disable_hotplug.unwrap_or(false) {
        controllers.scsi = true;
    }
    let scsi_dedicated = devices.disks.iter().any(|d| {
        d.dedicated_io_thread == Some(true)
            && d.target().and_then(|t| t.bus().cloned()) == Some(DiskBus::Scsi)
    });
    if scsi_dedicated && threads.shared > 0 {
        controllers.scsi_iothread = Some((threads.next_shared, cpu(vmi, host.accel).vcpus()));
    }
    if kind == MachineKind::Q35 {
        controllers.hotplug_ports = (0..ports_used + SPARE_HOTPLUG_PORTS)
            .map(hotplug_port)
            .collect();
    }
    Ok(Storage {
        controllers,
        disks,
        hotpluggable,
        iothreads: threads.total,
    })
}

/// KubeVirt's IOThreads (`GetIOThreadsCountType`, `assignDiskIOThread`): with a policy or a
/// disk asking for a dedicated one, every disk counts a thread, shared ones up to the policy's
/// limit (one for `shared`, two per requested CPU for `auto`) but at least one; virtio disks
/// take the dedicated threads after the shared ones in turn, numbered from 1.
#[derive(Debug, Default)]
struct IoThreads {
    /// How many there are; `0` when the VMI has none.
    total: u32,
    /// How many are shared.
    shared: u32,
    /// The shared thread the next disk without a dedicated one takes.
    next_shared: u32,
    next_dedicated: u32,
}

impl IoThreads {
    fn of(vmi: &VirtualMachineInstance) -> Result<Self, ConvertError> {
        let domain = &vmi.spec.domain;
        let disks = &domain.devices.disks;
        let dedicated = disks
            .iter()
            .filter(|d| d.dedicated_io_thread == Some(true))
            .count();
        let limit = match domain.io_threads_policy.as_deref() {
            None if dedicated == 0 => return Ok(Self::default()),
            None | Some("shared") => 1,
            Some("auto") => {
                let resources = &domain.resources;
                let cpus = [&resources.requests, &resources.limits]
                    .iter()
                    .find_map(|m| m.get("cpu"))
                    .and_then(|q| api::quantity::ParsedQuantity::from_quantity(q).ok());
                usize::try_from(cpus.map_or(1, api::quantity::ParsedQuantity::value))
                    .unwrap_or(1)
                    .saturating_mul(2)
            }
            Some(other) => {
                return Err(err(
                    "spec.domain.ioThreadsPolicy",
                    format!("{other:?} is not supported by this launcher (shared, auto)"),
                ));
            }
        };
        let mut shared = disks.len() - dedicated;
        if shared + dedicated > limit {
            shared = limit.saturating_sub(dedicated).max(1);
        }
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Ok(Self {
            total: count(shared + dedicated),
            shared: count(shared),
            next_shared: 1,
            next_dedicated: count(shared) + 1,
        })
    }

    /// The thread of the next virtio disk, `None` when the VMI has no IOThreads.
    fn next(&mut self, dedicated: bool) -> Option<u32> {
        if self.total == 0 {
            None
        } else if dedicated {
            self.next_dedicated += 1;
            Some(self.next_dedicated - 1)
        } else {
            let t = self.next_shared;
            self.next_shared = t % self.shared.max(1) + 1;
            Some(t)
        }
    }
}

const NOT_A_PCI_ADDRESS: &str = "is not a PCI address (e.g. 0000:00:05.0)";

/// Puts the disks and NICs with a `pciAddress` where libvirt would ([`api::pci::place`]) and
/// gives the controllers it would add for them.
fn place_pinned(
    vmi: &VirtualMachineInstance,
    kind: MachineKind,
    controllers: &mut Controllers,
    disks: &mut [Disk],
    nics: &mut [Nic],
) -> Result<(), ConvertError> {
    let root = match kind {
        MachineKind::Q35 => api::pci::RootBus::Pcie,
        MachineKind::Pc => api::pci::RootBus::Pci,
    };
    let placement = api::pci::place(root, &api::pci::pinned(&vmi.spec, "spec"))
        .map_err(|r| err(r.field, r.reason))?;
    for p in &placement.devices {
        let bus = Some(crate::qemu::pci_bus_id(kind, p.address.bus));
        let addr = Some(crate::qemu::pci_slot_function(
            p.address.slot,
            p.address.function,
        ));
        let (pci_bus, pci_addr, multifunction) = match p.device {
            api::pci::Device::Disk(i) => {
                let d = &mut disks[i];
                (&mut d.pci_bus, &mut d.pci_addr, &mut d.pci_multifunction)
            }
            api::pci::Device::Interface(i) => {
                let n = &mut nics[i];
                (&mut n.pci_bus, &mut n.pci_addr, &mut n.pci_multifunction)
            }
        };
        (*pci_bus, *pci_addr, *multifunction) = (bus, addr, p.multifunction);
    }
    controllers.pci_buses = placement.controllers;
    Ok(())
}

/// The host cache mode and AIO of a disk. Unset, the cache is write-back through the host page
/// cache: KubeVirt picks `none` where the file system supports O_DIRECT, and tmpfs (common in
/// tests and emptyDir) does not. A shareable disk and native AIO need the cache bypassed, so
/// for them unset means `none`, as KubeVirt makes it for a shareable one. With the cache
/// bypassed a block device gets native AIO unless `io` says otherwise (KubeVirt's
/// `SetOptimalIOMode`, which also picks it for preallocated images: those are not examined).
fn cache_and_aio(
    d: &VmiDisk,
    field: &str,
    block_device: bool,
) -> Result<(CacheMode, Aio), ConvertError> {
    let native = d.io.as_ref() == Some(&DiskIo::Native);
    let shared = d.shareable == Some(true);
    let cache = match &d.cache {
        None if native || shared => CacheMode::None,
        Some(DiskCache::None) => CacheMode::None,
        Some(DiskCache::WriteThrough) => CacheMode::Writethrough,
        _ => CacheMode::Writeback,
    };
    if cache != CacheMode::None {
        if shared {
            return Err(err(
                format!("{field}.cache"),
                "a shareable disk needs cache none",
            ));
        }
        if native {
            return Err(err(
                format!("{field}.io"),
                "native needs cache none: QEMU's native AIO bypasses the host page cache",
            ));
        }
    }
    let aio = match d.io {
        Some(DiskIo::Native) => Aio::Native,
        None if cache == CacheMode::None && block_device => Aio::Native,
        _ => Aio::Threads,
    };
    Ok((cache, aio))
}

/// `errorPolicy`, KubeVirt's `stop` when unset.
fn error_policy(d: &VmiDisk, field: &str) -> Result<ErrorPolicy, ConvertError> {
    Ok(match d.error_policy.as_deref() {
        None | Some("stop") => ErrorPolicy::Stop,
        Some("report") => ErrorPolicy::Report,
        Some("ignore") => ErrorPolicy::Ignore,
        Some("enospace") => ErrorPolicy::Enospace,
        Some(other) => {
            return Err(err(
                format!("{field}.errorPolicy"),
                format!("unknown error policy {other:?} (stop, report, ignore, enospace)"),
            ));
        }
    })
}

/// One VMI disk to a QEMU disk, whether it is cold-plugged or hotplugged. Returns whether the
/// volume is hotpluggable and the file preparations it needs. SATA units and SCSI LUNs are
/// placeholders (0) that the caller numbers.
#[allow(clippy::too_many_arguments)]
pub fn disk_for(
    vmi: &VirtualMachineInstance,
    d: &VmiDisk,
    field: &str,
    dirs: &Dirs,
    host: &Host,
    namespace: &str,
    name: &str,
) -> Result<(Disk, bool, Vec<Prep>), ConvertError> {
    qemu_id_name(format!("{field}.name"), &d.name)?;
    let (vol_index, volume) = vmi
        .spec
        .volumes
        .iter()
        .enumerate()
        .find(|(_, v)| v.name == d.name)
        .ok_or_else(|| {
            err(
                format!("{field}.name"),
                format!("no volume named {:?} in spec.volumes", d.name),
            )
        })?;
    let (frontend, mut read_only) = frontend(d, field)?;
    let vol = Vol {
        dirs,
        host,
        name: &volume.name,
        index: vol_index,
        field: format!("spec.volumes[{vol_index}]"),
    };
    let source = volume.source().ok_or_else(|| {
        err(
            vol.field.clone(),
            format!(
                "needs exactly one source, has {}",
                volume
                    .sources()
                    .iter()
                    .map(VolumeSource::field)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })?;
    let mut preps = Vec::new();
    let mut hotplug = false;
    let source = match source {
        VolumeSource::ContainerDisk(_) => vol.container_disk(&mut preps),
        VolumeSource::EmptyDisk(e) => vol.empty_disk(e, &mut preps)?,
        VolumeSource::HostDisk(h) => vol.host_disk(h, &mut preps)?,
        VolumeSource::PersistentVolumeClaim(p) => {
            hotplug = p.hotpluggable.unwrap_or(false);
            read_only |= p.read_only.unwrap_or(false);
            vol.claim(hotplug, "persistentVolumeClaim", &mut preps)
        }
        VolumeSource::DataVolume(dv) => {
            hotplug = dv.hotpluggable.unwrap_or(false);
            vol.claim(hotplug, "dataVolume", &mut preps)
        }
        VolumeSource::Ephemeral(_) => vol.ephemeral(&mut preps),
        VolumeSource::CloudInitNoCloud(src) | VolumeSource::CloudInitConfigDrive(src) => {
            let config_drive = matches!(source, VolumeSource::CloudInitConfigDrive(_));
            let sfield = format!("{}.{}", vol.field, source.field());
            let secrets = dirs.cloud_init_secrets(vol.name);
            let seed = cloud_init_seed(vmi, src, config_drive, &sfield, &secrets, name, namespace)?;
            vol.cloud_init(seed, sfield, namespace, name, &mut preps)
        }
        other => match ConfigKind::of(&other) {
            Some(kind) => vol.config_disk(kind, &other, &mut preps),
            None => {
                return Err(err(
                    format!("{}.{}", vol.field, other.field()),
                    "this volume source is not supported by this launcher",
                ));
            }
        },
    };
    let (cache, aio) = cache_and_aio(d, field, source.block_device)?;
    let share_rw = d.shareable == Some(true);
    if share_rw && d.disk.is_none() {
        return Err(err(
            format!("{field}.shareable"),
            "only a disk target can be shared",
        ));
    }
    let multi_queue = vmi.spec.domain.devices.block_multi_queue == Some(true);
    Ok((
        Disk {
            name: d.name.clone(),
            source,
            frontend,
            read_only,
            cache,
            boot_index: d.boot_order,
            serial: d.serial.clone(),
            pci_bus: None,
            pci_addr: None,
            pci_multifunction: false,
            aio,
            error_policy: error_policy(d, field)?,
            share_rw,
            iothread: None,
            num_queues: (multi_queue && frontend == Frontend::Virtio)
                .then(|| cpu(vmi, host.accel).vcpus()),
            virtio: virtio_model(vmi),
        },
        hotplug,
        preps,
    ))
}

/// The device the guest sees (SATA units and SCSI LUNs 0, numbered by the caller) and whether
/// the target makes it read-only. A cdrom defaults to sata, a disk to virtio.
fn frontend(d: &VmiDisk, field: &str) -> Result<(Frontend, bool), ConvertError> {
    let default_target = api::vmi::DiskTarget::default();
    let target = d.target().unwrap_or(DiskTargetKind::Disk(&default_target));
    let cdrom = match target {
        DiskTargetKind::Disk(_) => false,
        DiskTargetKind::Cdrom(_) => true,
        DiskTargetKind::Lun(_) => {
            return Err(err(
                format!("{field}.lun"),
                "LUN passthrough is not supported by this launcher: use disk",
            ));
        }
    };
    let bus_field = format!("{field}.{}.bus", target.field());
    let bus = target.bus().cloned().unwrap_or(if cdrom {
        DiskBus::Sata
    } else {
        DiskBus::Virtio
    });
    let frontend = match (bus, cdrom) {
        (DiskBus::Virtio, false) => Frontend::Virtio,
        (DiskBus::Sata, false) => Frontend::Sata { unit: 0 },
        (DiskBus::Scsi, false) => Frontend::Scsi { lun: 0 },
        (DiskBus::Sata, true) => Frontend::SataCdrom { unit: 0 },
        (DiskBus::Scsi, true) => Frontend::ScsiCdrom { lun: 0 },
        (DiskBus::Virtio, true) => {
            return Err(err(
                bus_field,
                "a cdrom cannot use the virtio bus: use sata or scsi",
            ));
        }
        (other, _) => {
            return Err(err(
                bus_field,
                format!(
                    "bus {:?} is not supported: use virtio, sata or scsi",
                    other.as_str()
                ),
            ));
        }
    };
    Ok((frontend, target.readonly()))
}

/// One volume on its way to a [`DiskSource`]: where its files go and the field that names it.
/// Each method is one volume source and adds the preparations that source needs.
struct Vol<'a> {
    dirs: &'a Dirs,
    host: &'a Host,
    /// The volume's name: its files are named after it.
    name: &'a str,
    /// Its index in `spec.volumes`: container disks are numbered by it.
    index: usize,
    /// `spec.volumes[<index>]`.
    field: String,
}

impl Vol<'_> {
    /// A container disk: a qcow2 overlay over the image virt-handler mounted, which stays as
    /// it is.
    fn container_disk(&self, preps: &mut Vec<Prep>) -> DiskSource {
        let overlay = self.dirs.container_disk_overlay(self.name);
        preps.push(Prep::Overlay {
            path: overlay.clone(),
            backing: self.dirs.container_disk(self.index),
            backing_format: None,
            field: format!("{}.containerDisk", self.field),
        });
        DiskSource {
            path: overlay,
            block_device: false,
            format: ImageFormat::Qcow2,
        }
    }

    /// An empty disk: a new qcow2 image of the capacity asked for.
    fn empty_disk(
        &self,
        e: &EmptyDiskSource,
        preps: &mut Vec<Prep>,
    ) -> Result<DiskSource, ConvertError> {
        let size = quantity::bytes(&e.capacity.0)
            .map_err(|e| err(format!("{}.emptyDisk.capacity", self.field), e.to_string()))?;
        let path = self.dirs.empty_disk(self.name);
        preps.push(Prep::EmptyDisk {
            path: path.clone(),
            size,
            field: format!("{}.emptyDisk", self.field),
        });
        Ok(DiskSource {
            path,
            block_device: false,
            format: ImageFormat::Qcow2,
        })
    }

    /// A raw image on the node, which must exist (`Disk`) or is created sparse when it does
    /// not (`DiskOrCreate`).
    fn host_disk(&self, h: &HostDisk, preps: &mut Vec<Prep>) -> Result<DiskSource, ConvertError> {
        let hfield = format!("{}.hostDisk", self.field);
        if let Some(problem) = api::validation::node_path_problem(&h.path) {
            return Err(err(format!("{hfield}.path"), problem));
        }
        match &h.disk_type {
            HostDiskType::Disk => preps.push(Prep::RequireFile {
                path: h.path.clone().into(),
                field: format!("{hfield}.path"),
            }),
            HostDiskType::DiskOrCreate => {
                let cap = h.capacity.as_ref().ok_or_else(|| {
                    err(format!("{hfield}.capacity"), "is required for DiskOrCreate")
                })?;
                let size = quantity::bytes(&cap.0)
                    .map_err(|e| err(format!("{hfield}.capacity"), e.to_string()))?;
                preps.push(Prep::RawIfMissing {
                    path: h.path.clone().into(),
                    size,
                    field: hfield.clone(),
                });
            }
            HostDiskType::Other(t) => {
                return Err(err(
                    format!("{hfield}.type"),
                    format!("{t:?} is not a host disk type: use Disk or DiskOrCreate"),
                ));
            }
        }
        Ok(DiskSource {
            path: h.path.clone().into(),
            block_device: false,
            format: ImageFormat::Raw,
        })
    }

    /// Where a claimed volume (PVC or DataVolume) appears: a block device or the image in its
    /// file system, under the hotplug dir when virt-handler plugs it in later.
    fn claim_source(&self, hot: bool) -> DiskSource {
        let block = self.host.block_volumes.contains(self.name);
        let path = match (hot, block) {
            (true, true) => self.dirs.hotplug_block(self.name),
            (true, false) => self.dirs.hotplug_file(self.name),
            (false, true) => self.dirs.pvc_block(self.name),
            (false, false) => self.dirs.pvc_file(self.name),
        };
        DiskSource {
            path,
            block_device: block,
            format: ImageFormat::Raw,
        }
    }

    /// A PVC or DataVolume (`source` names which), used in place; it must be there.
    fn claim(&self, hot: bool, source: &str, preps: &mut Vec<Prep>) -> DiskSource {
        let s = self.claim_source(hot);
        preps.push(Prep::RequireFile {
            path: s.path.clone(),
            field: format!("{}.{source}", self.field),
        });
        s
    }

    /// An ephemeral volume: a qcow2 overlay over the PVC, which the guest never writes.
    fn ephemeral(&self, preps: &mut Vec<Prep>) -> DiskSource {
        let base = self.claim_source(false);
        let overlay = self.dirs.ephemeral_pvc_overlay(self.name);
        preps.push(Prep::Overlay {
            path: overlay.clone(),
            backing: base.path,
            backing_format: Some(ImageFormat::Raw),
            field: format!("{}.ephemeral", self.field),
        });
        DiskSource {
            path: overlay,
            block_device: false,
            format: ImageFormat::Qcow2,
        }
    }

    /// A config disk (ConfigMap, Secret, Downward API, service account): an ISO image of the
    /// directory the launcher pod has the volume mounted at, with KubeVirt's paths and label.
    fn config_disk(
        &self,
        kind: ConfigKind,
        source: &VolumeSource<'_>,
        preps: &mut Vec<Prep>,
    ) -> DiskSource {
        let path = self.dirs.config_disk(kind, self.name);
        preps.push(Prep::ConfigDisk {
            source: self.dirs.config_source(kind, self.name),
            path: path.clone(),
            label: configdisk::volume_label(source).to_owned(),
            field: format!("{}.{}", self.field, source.field()),
        });
        DiskSource {
            path,
            block_device: false,
            format: ImageFormat::Raw,
        }
    }

    /// A cloud-init NoCloud or ConfigDrive seed image, written before QEMU starts.
    fn cloud_init(
        &self,
        seed: Seed,
        field: String,
        namespace: &str,
        name: &str,
        preps: &mut Vec<Prep>,
    ) -> DiskSource {
        let path = self
            .dirs
            .cloud_init_seed(namespace, name, seed.config_drive);
        preps.push(Prep::CloudInit {
            path: path.clone(),
            seed,
            field,
        });
        DiskSource {
            path,
            block_device: false,
            format: ImageFormat::Raw,
        }
    }
}

/// What a cloud-init seed holds: KubeVirt's instance id (the VMI's uid for ConfigDrive,
/// `<name>.<namespace>` for NoCloud), the hostname, and the user and network data, inline or
/// from the Secrets the pod has mounted in `secrets`.
fn cloud_init_seed(
    vmi: &VirtualMachineInstance,
    src: &CloudInitNoCloudSource,
    config_drive: bool,
    field: &str,
    secrets: &Path,
    name: &str,
    namespace: &str,
) -> Result<Seed, ConvertError> {
    let (user_data, network_data) = cloud_init_data(src, field, secrets)?;
    let hostname = vmi.spec.hostname.clone().unwrap_or_else(|| name.to_owned());
    let instance_id = if config_drive {
        vmi.metadata.uid.clone().unwrap_or_default()
    } else {
        format!("{name}.{namespace}")
    };
    Ok(Seed {
        config_drive,
        instance_id,
        hostname,
        user_data,
        network_data,
    })
}

fn cloud_init_data(
    src: &CloudInitNoCloudSource,
    field: &str,
    secrets: &Path,
) -> Result<(SeedData, Option<SeedData>), ConvertError> {
    use base64::Engine as _;
    let b64 = |s: &str, f: &str| {
        base64::engine::general_purpose::STANDARD
            .decode(s.trim())
            .map(SeedData::Inline)
            .map_err(|e| err(format!("{field}.{f}"), format!("is not valid base64: {e}")))
    };
    let secret = |keys, f: &str| SeedData::Secret {
        dir: secrets.to_owned(),
        keys,
        field: format!("{field}.{f}"),
    };
    let user = match (
        &src.user_data,
        &src.user_data_base64,
        &src.user_data_secret_ref,
    ) {
        (Some(u), _, _) => SeedData::Inline(u.clone().into_bytes()),
        (None, Some(b), _) => b64(b, "userDataBase64")?,
        (None, None, Some(_)) => secret(configdisk::USER_DATA_KEYS, "secretRef"),
        (None, None, None) => SeedData::Inline(Vec::new()),
    };
    let network = match (
        &src.network_data,
        &src.network_data_base64,
        &src.network_data_secret_ref,
    ) {
        (Some(n), _, _) => Some(SeedData::Inline(n.clone().into_bytes())),
        (None, Some(b), _) => Some(b64(b, "networkDataBase64")?),
        (None, None, Some(_)) => Some(secret(
            configdisk::NETWORK_DATA_KEYS,
            "networkDataSecretRef",
        )),
        (None, None, None) => None,
    };
    Ok((user, network))
}

// ---- interfaces ----

/// One interface to a NIC on the tap phase 1 made for it (`tap<i>`, by position), with the
/// MAC and MTU phase 1 cached.
fn nic(
    vmi: &VirtualMachineInstance,
    i: usize,
    iface: &Interface,
    uid: &str,
    host: &Host,
    preps: &mut Vec<Prep>,
) -> Result<Nic, ConvertError> {
    let field = format!("spec.domain.devices.interfaces[{i}]");
    qemu_id_name(format!("{field}.name"), &iface.name)?;
    if vmi.spec.network(&iface.name).is_none() {
        return Err(err(
            format!("{field}.name"),
            format!("no network named {:?} in spec.networks", iface.name),
        ));
    }
    match iface.binding_method() {
        Some(InterfaceBinding::Bridge | InterfaceBinding::Masquerade) => {}
        Some(other) => {
            return Err(err(
                format!("{field}.{}", other.field()),
                "binding is not supported by this launcher: use bridge or masquerade",
            ));
        }
        None => {
            return Err(err(
                field,
                "needs exactly one binding (bridge or masquerade)",
            ));
        }
    }
    let model = match iface.model_or_default() {
        InterfaceModel::Virtio => NicModel::Virtio,
        InterfaceModel::E1000 => NicModel::E1000,
        InterfaceModel::E1000e => NicModel::E1000e,
        InterfaceModel::Rtl8139 => NicModel::Rtl8139,
        other => {
            return Err(err(
                format!("{field}.model"),
                format!("model {other} is not supported: use virtio, e1000, e1000e or rtl8139"),
            ));
        }
    };
    let tap = format!("tap{i}");
    preps.push(Prep::RequireTap {
        name: tap.clone(),
        field: field.clone(),
    });
    let cached = host.network.get(&iface.name);
    let mac = network::plan::guest_mac(uid, &iface.name, iface.mac_address.as_deref(), cached)
        .ok_or_else(|| {
            err(
                format!("{field}.macAddress"),
                "is not a MAC address (e.g. de:ad:00:00:be:af)",
            )
        })?;
    if iface
        .pci_address
        .as_deref()
        .is_some_and(|a| PciAddress::parse(a).is_none())
    {
        return Err(err(format!("{field}.pciAddress"), NOT_A_PCI_ADDRESS));
    }
    let acpi_index = iface
        .acpi_index
        .map(|a| {
            u32::try_from(a)
                .ok()
                .filter(|a| (1..16 * 1024).contains(a))
                .ok_or_else(|| err(format!("{field}.acpiIndex"), "must be between 1 and 16383"))
        })
        .transpose()?;
    Ok(Nic {
        name: iface.name.clone(),
        model,
        tap,
        mac: Some(network::plan::format_mac(mac)),
        mtu: cached.map(|c| c.mtu),
        boot_index: iface.boot_order,
        virtio: virtio_model(vmi),
        pci_bus: None,
        pci_addr: None,
        pci_multifunction: false,
        acpi_index,
        link_up: !iface.link_down(),
        queues: vmi.spec.network_queues(iface),
    })
}

#[cfg(test)]
mod tests;
