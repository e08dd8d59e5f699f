//! A typed QEMU configuration: one struct per device, each rendering its own arguments.
//!
//! [`QemuConfig::argv`] is a pure function but for the start time of a clock with a UTC offset,
//! which (as libvirt's) is taken when the command line is built; nothing here touches the file
//! system. Disks also
//! render the QMP form of their properties so that hotplug uses exactly what a cold boot would.

pub mod opts;

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

pub use opts::{Props, Value, escape};

/// Something that contributes arguments to QEMU's command line.
pub trait Args {
    fn push_args(&self, argv: &mut Vec<String>);
}

fn push(argv: &mut Vec<String>, flag: &str, value: String) {
    argv.push(flag.to_owned());
    argv.push(value);
}

fn path_str(p: &std::path::Path) -> String {
    p.to_string_lossy().into_owned()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MachineKind {
    Q35,
    Pc,
}

impl MachineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MachineKind::Q35 => "q35",
            MachineKind::Pc => "pc",
        }
    }

    /// The bus of the machine's host bridge.
    pub fn root_bus(self) -> &'static str {
        match self {
            MachineKind::Q35 => "pcie.0",
            MachineKind::Pc => "pci.0",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    pub kind: MachineKind,
    pub accel: Accel,
    /// `None` leaves QEMU's default (on where the machine supports it).
    pub smm: Option<bool>,
    /// `false` gives the guest no ACPI tables (`acpi=off`, as libvirt renders a domain without
    /// `<acpi/>`).
    pub acpi: bool,
    /// The HPET: `None` leaves QEMU's default (on).
    pub hpet: Option<bool>,
    /// SeaBIOS writes its screen to the first serial port (`graphics=off`, what libvirt renders
    /// for `<bios useserial='yes'/>` on x86).
    pub bios_serial_console: bool,
}

impl Machine {
    fn props(&self, memory: &Memory, firmware: &Firmware) -> Props {
        let mut p = Props::new()
            .set_opt("smm", self.smm)
            .set_opt("acpi", (!self.acpi).then_some(false))
            .set_opt("hpet", self.hpet)
            .set_opt("graphics", self.bios_serial_console.then_some(false));
        if memory.has_backend() {
            p = p.set("memory-backend", Memory::BACKEND_ID);
        }
        if let Firmware::Efi { .. } = firmware {
            p = p
                .set("pflash0", Firmware::CODE_NODE)
                .set("pflash1", Firmware::VARS_NODE);
        }
        p
    }
}

/// vCPU model, the paravirtual features set on it, and the topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cpu {
    pub model: String,
    /// Hide KVM's signature from the guest (`kvm=off`).
    pub kvm_hidden: bool,
    /// The kvmclock source (`kvmclock=`); `None` leaves the model's default.
    pub kvmclock: Option<bool>,
    /// Paravirtual spinlocks (`kvm-pv-unhalt=`); `None` leaves the model's default.
    pub pv_unhalt: Option<bool>,
    /// The VMI's `cpu.features`, after everything else so that they have the last word.
    pub features: Vec<CpuFeature>,
    pub sockets: u32,
    pub cores: u32,
    pub threads: u32,
    /// Sockets the guest may grow to (KubeVirt's `maxSockets`, libvirt's hotpluggable
    /// `<vcpus>`): the topology QEMU builds, with only `sockets` of them present at start.
    /// Equal to `sockets` when the VMI has no CPU hotplug.
    pub max_sockets: u32,
}

impl Cpu {
    /// Saturating: QEMU refuses `u32::MAX` vCPUs itself, where an overflow would panic.
    pub fn vcpus(&self) -> u32 {
        self.sockets
            .saturating_mul(self.cores)
            .saturating_mul(self.threads)
    }
}

/// A feature on the `-cpu` line, as libvirt renders `<feature name=... policy=...>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuFeature {
    /// QEMU's property name (or libvirt's, which QEMU reads too); validated to letters,
    /// digits, `-`, `_` and `.`, so it cannot break out of its `name=on`.
    pub name: String,
    pub enabled: bool,
}

impl Args for Cpu {
    fn push_args(&self, argv: &mut Vec<String>) {
        let features = Props::new()
            .set_opt("kvm", self.kvm_hidden.then_some(false))
            .set_opt("kvmclock", self.kvmclock)
            .set_opt("kvm-pv-unhalt", self.pv_unhalt);
        let cpu = self
            .features
            .iter()
            .fold(features.keyval_with(&self.model), |line, f| {
                format!("{line},{}={}", f.name, if f.enabled { "on" } else { "off" })
            });
        push(argv, "-cpu", cpu);
        let max_sockets = self.max_sockets.max(self.sockets);
        let smp = Props::new()
            .set_opt(
                "maxcpus",
                (max_sockets > self.sockets).then(|| {
                    max_sockets
                        .saturating_mul(self.cores)
                        .saturating_mul(self.threads)
                }),
            )
            .set("sockets", max_sockets)
            .set("cores", self.cores)
            .set("threads", self.threads);
        push(argv, "-smp", format!("{},{}", self.vcpus(), smp.keyval()));
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Memory {
    pub size_mib: u64,
    /// What the guest's memory may grow to (KubeVirt's `maxGuest`, libvirt's `<maxMemory>`):
    /// QEMU reserves the address space for a virtio-mem device. `None` without memory hotplug.
    pub max_mib: Option<u64>,
    /// Back guest RAM with a file on this hugetlbfs mount.
    pub hugepages: Option<PathBuf>,
    /// Guest RAM is mapped shared, so that a vhost-user back end (virtiofsd) can map it too:
    /// libvirt's `<memoryBacking><source type='memfd'/><access mode='shared'/>`, which
    /// KubeVirt asks for whenever a VMI has a filesystem.
    pub shared: bool,
}

impl Memory {
    const BACKEND_ID: &'static str = "guest-ram";

    /// Guest RAM comes from an explicit backend object rather than QEMU's anonymous memory.
    fn has_backend(&self) -> bool {
        self.hugepages.is_some() || self.shared
    }
}

impl Args for Memory {
    fn push_args(&self, argv: &mut Vec<String>) {
        let size = match self.max_mib.filter(|&max| max > self.size_mib) {
            Some(max) => format!("{}M,maxmem={max}M", self.size_mib),
            None => format!("{}M", self.size_mib),
        };
        push(argv, "-m", size);
        if !self.has_backend() {
            return;
        }
        let backend = Props::new()
            .set("id", Self::BACKEND_ID)
            .set("size", format!("{}M", self.size_mib));
        let backend = match &self.hugepages {
            Some(dir) => backend
                .set("mem-path", path_str(dir))
                .set("prealloc", true)
                .set_opt("share", self.shared.then_some(true))
                .keyval_with("memory-backend-file"),
            None => backend
                .set("share", true)
                .keyval_with("memory-backend-memfd"),
        };
        push(argv, "-object", backend);
    }
}

/// A directory shared with the guest through virtiofs: QEMU's vhost-user-fs device, whose
/// file system is served by virtiofsd on `socket`, as libvirt renders KubeVirt's
/// `<filesystem type='mount'><driver type='virtiofs' queue='1024'/>` with an external
/// daemon's socket (chardev `chr-vu-fs<n>`, device `fs<n>`). The device sits on the root bus;
/// the guest mounts it by `tag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filesystem {
    /// The VMI's filesystem name, the tag the guest mounts.
    pub tag: String,
    pub socket: PathBuf,
    /// QEMU's virtqueue size of the request queue (KubeVirt's 1024).
    pub queue_size: u32,
}

impl Filesystem {
    fn push_args(&self, index: usize, argv: &mut Vec<String>) {
        let chardev = format!("chr-vu-fs{index}");
        let socket = Props::new()
            .set("id", &chardev)
            .set("path", path_str(&self.socket));
        push(argv, "-chardev", socket.keyval_with("socket"));
        let device = Props::new()
            .set("id", format!("fs{index}"))
            .set("chardev", chardev)
            .set("queue-size", self.queue_size)
            .set("tag", &self.tag);
        push(argv, "-device", device.keyval_with("vhost-user-fs-pci"));
    }
}

/// Where the guest's real time clock starts, and how it keeps time (`-rtc`), plus the PIT's
/// lost tick policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Clock {
    /// Seconds ahead of UTC (negative: behind) the RTC starts; `None` is UTC.
    pub utc_offset: Option<i64>,
    /// `clock=`: `vm` (guest time, stops with the guest) or `host` (wall time).
    pub rtc_clock: Option<&'static str>,
    /// Missed RTC ticks are delivered faster until the guest catches up (`driftfix=slew`).
    pub rtc_catchup: bool,
    /// `kvm-pit.lost_tick_policy`: `delay` or `discard` (the in-kernel PIT exists under KVM
    /// only).
    pub pit_lost_tick_policy: Option<&'static str>,
}

impl Clock {
    /// The `-rtc` argument at `now`: an offset clock starts at the UTC time that far from now,
    /// as libvirt computes it when it builds the command line.
    pub fn rtc(&self, now: std::time::SystemTime) -> String {
        let base = match self.utc_offset {
            None => "utc".to_owned(),
            Some(offset) => {
                let now = now
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
                utc_datetime(now.saturating_add(offset))
            }
        };
        Props::new()
            .set("base", base)
            .set_opt("clock", self.rtc_clock)
            .set_opt("driftfix", self.rtc_catchup.then_some("slew"))
            .keyval()
    }
}

impl Args for Clock {
    fn push_args(&self, argv: &mut Vec<String>) {
        push(argv, "-rtc", self.rtc(std::time::SystemTime::now()));
        if let Some(policy) = self.pit_lost_tick_policy {
            push(
                argv,
                "-global",
                format!("kvm-pit.lost_tick_policy={policy}"),
            );
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SS` in UTC, the form `-rtc base=` takes (the proleptic Gregorian calendar,
/// from the days since 1970-01-01 as in Howard Hinnant's `civil_from_days`).
fn utc_datetime(unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// SMBIOS type 1 (system information), which is where guests read their serial and UUID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Smbios {
    pub uuid: String,
    pub serial: Option<String>,
    pub manufacturer: String,
    pub product: String,
    pub family: String,
}

impl Args for Smbios {
    fn push_args(&self, argv: &mut Vec<String>) {
        push(argv, "-uuid", self.uuid.clone());
        let p = Props::new()
            .set("manufacturer", &self.manufacturer)
            .set("product", &self.product)
            .set("family", &self.family)
            .set_opt("serial", self.serial.as_ref())
            .set("uuid", &self.uuid);
        push(argv, "-smbios", p.keyval_with("type=1"));
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Firmware {
    /// SeaBIOS, QEMU's default.
    Bios,
    /// OVMF: read-only code plus this VM's own copy of the variable store.
    Efi {
        code: PathBuf,
        vars: PathBuf,
        secure_boot: bool,
    },
}

impl Firmware {
    const CODE_NODE: &'static str = "pflash0-code";
    const VARS_NODE: &'static str = "pflash1-vars";
}

impl Args for Firmware {
    fn push_args(&self, argv: &mut Vec<String>) {
        if let Firmware::Efi {
            code,
            vars,
            secure_boot,
        } = self
        {
            let code = Props::new()
                .set("driver", "file")
                .set("filename", path_str(code))
                .set("node-name", Self::CODE_NODE)
                .set("read-only", true);
            let vars = Props::new()
                .set("driver", "file")
                .set("filename", path_str(vars))
                .set("node-name", Self::VARS_NODE);
            push(argv, "-blockdev", code.keyval());
            push(argv, "-blockdev", vars.keyval());
            if *secure_boot {
                // Only SMM code may write the variable store, or the guest could disable
                // secure boot from its own kernel.
                push(
                    argv,
                    "-global",
                    "driver=cfi.pflash01,property=secure,value=on".to_owned(),
                );
            }
        }
    }
}

/// Direct kernel boot. `-kernel`, `-initrd` and `-append` take their argument verbatim (they
/// are not option lists), so nothing is escaped here: escaping would change the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelBoot {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: Option<String>,
}

impl Args for KernelBoot {
    fn push_args(&self, argv: &mut Vec<String>) {
        push(argv, "-kernel", path_str(&self.kernel));
        if let Some(initrd) = &self.initrd {
            push(argv, "-initrd", path_str(initrd));
        }
        if let Some(cmdline) = &self.cmdline {
            push(argv, "-append", cmdline.clone());
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    Qcow2,
    Raw,
}

impl ImageFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Raw => "raw",
        }
    }
}

/// KubeVirt's cache modes, mapped to QEMU's two knobs: host page cache bypass
/// (`cache.direct`) and the guest-visible write cache (`write-cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    None,
    Writethrough,
    Writeback,
}

impl CacheMode {
    fn direct(self) -> bool {
        self == CacheMode::None
    }
    fn write_cache(self) -> bool {
        self != CacheMode::Writethrough
    }
}

/// KubeVirt's virtio model: modern-only devices (`virtio-non-transitional`, its default) or
/// transitional ones, which legacy (virtio 0.9) drivers also find (`useVirtioTransitional`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum VirtioModel {
    #[default]
    NonTransitional,
    Transitional,
}

impl VirtioModel {
    /// QEMU's device in this model for the virtio PCI device `base` (`virtio-blk-pci`).
    pub fn device(self, base: &str) -> String {
        match self {
            VirtioModel::NonTransitional => format!("{base}-non-transitional"),
            VirtioModel::Transitional => format!("{base}-transitional"),
        }
    }
}

/// How QEMU submits a disk's I/O to the host (`aio=`): a thread pool, or Linux native AIO,
/// which needs the host page cache bypassed (cache `none`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Aio {
    #[default]
    Threads,
    Native,
}

/// What the guest's disk does on an I/O error (libvirt's `error_policy`, KubeVirt's
/// `errorPolicy`, `stop` by KubeVirt's default): pause the VM, report the error to the guest,
/// ignore it, or pause only when the host is out of space.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ErrorPolicy {
    #[default]
    Stop,
    Report,
    Ignore,
    Enospace,
}

impl ErrorPolicy {
    /// `werror` and `rerror` as libvirt sets them: the same policy for both, but QEMU spells
    /// `enospace` `enospc` and has it for writes only.
    fn werror_rerror(self) -> (&'static str, Option<&'static str>) {
        match self {
            ErrorPolicy::Stop => ("stop", Some("stop")),
            ErrorPolicy::Report => ("report", Some("report")),
            ErrorPolicy::Ignore => ("ignore", Some("ignore")),
            ErrorPolicy::Enospace => ("enospc", None),
        }
    }
}

/// Where a disk's bytes live on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskSource {
    pub path: PathBuf,
    /// A block device (`host_device`) rather than a regular file.
    pub block_device: bool,
    pub format: ImageFormat,
}

/// The guest-facing side of a disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "bus")]
pub enum Frontend {
    Virtio,
    Sata { unit: u32 },
    Scsi { lun: u32 },
    SataCdrom { unit: u32 },
    ScsiCdrom { lun: u32 },
}

impl Frontend {
    pub fn is_scsi(self) -> bool {
        matches!(self, Frontend::Scsi { .. } | Frontend::ScsiCdrom { .. })
    }
    pub fn is_sata(self) -> bool {
        matches!(self, Frontend::Sata { .. } | Frontend::SataCdrom { .. })
    }
    fn is_cdrom(self) -> bool {
        matches!(
            self,
            Frontend::SataCdrom { .. } | Frontend::ScsiCdrom { .. }
        )
    }
    /// The same device at SATA unit or SCSI LUN `n` (a virtio disk has neither).
    #[must_use]
    pub fn numbered(self, n: u32) -> Self {
        match self {
            Frontend::Virtio => Frontend::Virtio,
            Frontend::Sata { .. } => Frontend::Sata { unit: n },
            Frontend::Scsi { .. } => Frontend::Scsi { lun: n },
            Frontend::SataCdrom { .. } => Frontend::SataCdrom { unit: n },
            Frontend::ScsiCdrom { .. } => Frontend::ScsiCdrom { lun: n },
        }
    }
}

pub const SATA_CONTROLLER: &str = "sata0";
pub const SCSI_CONTROLLER: &str = "scsi0";
/// The xHCI controller USB input devices sit on (its bus is `usb0.0`).
pub const USB_CONTROLLER: &str = "usb0";
/// AHCI has six ports.
pub const SATA_PORTS: u32 = 6;

/// One disk: a block node (format over protocol) and the device the guest sees.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disk {
    /// The VMI's disk name.
    pub name: String,
    pub source: DiskSource,
    pub frontend: Frontend,
    pub read_only: bool,
    pub cache: CacheMode,
    pub boot_index: Option<u32>,
    pub serial: Option<String>,
    /// PCI bus for the device (a hotplug root port on q35); `None` lets QEMU choose.
    pub pci_bus: Option<String>,
    /// Slot and function on `pci_bus` (`0x5.0x0`); `None` lets QEMU choose.
    #[serde(default)]
    pub pci_addr: Option<String>,
    /// Function 0 of a slot whose other functions other devices use.
    #[serde(default)]
    pub pci_multifunction: bool,
    #[serde(default)]
    pub aio: Aio,
    #[serde(default)]
    pub error_policy: ErrorPolicy,
    /// Other VMs may write the image at the same time (`share-rw=on`).
    #[serde(default)]
    pub share_rw: bool,
    /// The IOThread (`iothread<n>`) a virtio disk runs its I/O in.
    #[serde(default)]
    pub iothread: Option<u32>,
    /// Virtio request queues (`num-queues`); `None` is QEMU's default.
    #[serde(default)]
    pub num_queues: Option<u32>,
    #[serde(default)]
    pub virtio: VirtioModel,
}

impl Disk {
    /// The device id: KubeVirt's user alias convention, `ua-<name>`.
    pub fn device_id(&self) -> String {
        device_id(&self.name)
    }

    /// The format node's name. QEMU limits node names to 31 characters while disk names may be
    /// 63, so the name is hashed (FNV-1a) rather than embedded.
    pub fn node_name(&self) -> String {
        node_name(&self.name)
    }

    /// The block node tree, protocol node inline as `file`.
    pub fn blockdev(&self) -> Props {
        let direct = self.cache.direct();
        Props::new()
            .set("node-name", self.node_name())
            .set("driver", self.source.format.as_str())
            .set("read-only", self.read_only)
            .set("discard", "unmap")
            .set("cache.direct", direct)
            .set("cache.no-flush", false)
            .set(
                "file.driver",
                if self.source.block_device {
                    "host_device"
                } else {
                    "file"
                },
            )
            .set("file.filename", path_str(&self.source.path))
            .set(
                "file.aio",
                match self.aio {
                    Aio::Threads => "threads",
                    Aio::Native => "native",
                },
            )
    }

    /// The guest device, without its driver name (see [`Disk::driver`]).
    pub fn device(&self) -> Props {
        let mut p = Props::new()
            .set("id", self.device_id())
            .set("drive", self.node_name());
        p = match self.frontend {
            Frontend::Virtio => p
                .set_opt("bus", self.pci_bus.as_ref())
                .set_opt("addr", self.pci_addr.as_ref())
                .set_opt("multifunction", self.pci_multifunction.then_some(true))
                .set_opt("iothread", self.iothread.map(iothread_id))
                .set_opt("num-queues", self.num_queues),
            Frontend::Sata { unit } | Frontend::SataCdrom { unit } => {
                p.set("bus", format!("{SATA_CONTROLLER}.{unit}"))
            }
            Frontend::Scsi { lun } | Frontend::ScsiCdrom { lun } => p
                .set("bus", format!("{SCSI_CONTROLLER}.0"))
                .set("channel", 0u32)
                .set("scsi-id", 0u32)
                .set("lun", lun),
        };
        if !self.frontend.is_cdrom() {
            p = p.set("write-cache", self.cache.write_cache());
        }
        let (werror, rerror) = self.error_policy.werror_rerror();
        p.set_opt("serial", self.serial.as_ref())
            .set_opt("bootindex", self.boot_index)
            .set("werror", werror)
            .set_opt("rerror", rerror)
            .set_opt("share-rw", self.share_rw.then_some(true))
    }

    pub fn driver(&self) -> String {
        match self.frontend {
            Frontend::Virtio => return self.virtio.device("virtio-blk-pci"),
            Frontend::Sata { .. } => "ide-hd",
            Frontend::SataCdrom { .. } => "ide-cd",
            Frontend::Scsi { .. } => "scsi-hd",
            Frontend::ScsiCdrom { .. } => "scsi-cd",
        }
        .to_owned()
    }

    /// Arguments for `blockdev-add`.
    pub fn blockdev_json(&self) -> Json {
        self.blockdev().json()
    }

    /// Arguments for `device_add`.
    pub fn device_json(&self) -> Json {
        let mut v = self.device().json();
        v["driver"] = Json::String(self.driver());
        v
    }
}

impl Args for Disk {
    fn push_args(&self, argv: &mut Vec<String>) {
        push(argv, "-blockdev", self.blockdev().keyval());
        push(argv, "-device", self.device().keyval_with(&self.driver()));
    }
}

/// The id of IOThread `n`, numbered from 1 as libvirt numbers them.
pub fn iothread_id(n: u32) -> String {
    format!("iothread{n}")
}

pub fn device_id(name: &str) -> String {
    format!("ua-{name}")
}

pub fn node_name(name: &str) -> String {
    let mut hash: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        hash ^= u32::from(b);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    format!("drive-{hash:08x}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NicModel {
    Virtio,
    E1000,
    E1000e,
    Rtl8139,
}

impl NicModel {
    fn driver(self, virtio: VirtioModel) -> String {
        match self {
            NicModel::Virtio => return virtio.device("virtio-net-pci"),
            NicModel::E1000 => "e1000",
            NicModel::E1000e => "e1000e",
            NicModel::Rtl8139 => "rtl8139",
        }
        .to_owned()
    }
}

/// A NIC on a tap device that already exists in the launcher's network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    pub name: String,
    pub model: NicModel,
    pub tap: String,
    pub mac: Option<String>,
    /// The pod interface's MTU, told to a virtio guest (`host_mtu`); the other models have no
    /// way to carry it, and their guests learn it from DHCP.
    pub mtu: Option<u32>,
    pub boot_index: Option<u32>,
    pub virtio: VirtioModel,
    /// The bus of `pci_addr`.
    pub pci_bus: Option<String>,
    /// Slot and function on `pci_bus` (`0x5.0x0`); `None` lets QEMU choose.
    pub pci_addr: Option<String>,
    /// Function 0 of a slot whose other functions other devices use.
    pub pci_multifunction: bool,
    /// The guest names the NIC after this ACPI index (`acpi-index`; `eno<n>` on Linux).
    pub acpi_index: Option<u32>,
    /// `false` for `state: down`. QEMU has no option for it: the launcher sets the link with
    /// QMP's `set_link` before the guest's first instruction, as libvirt does.
    pub link_up: bool,
    /// Queue pairs (`networkInterfaceMultiqueue`, virtio only). Above one, QEMU attaches to
    /// the multiqueue tap once per queue and the device gets libvirt's `mq=on,vectors=2N+2`
    /// (a vector per queue each way, one for config changes, one for the control queue).
    pub queues: u32,
}

impl Args for Nic {
    fn push_args(&self, argv: &mut Vec<String>) {
        let netdev_id = format!("netdev-{}", self.name);
        let netdev = Props::new()
            .set("id", netdev_id.as_str())
            .set("ifname", &self.tap)
            .set("script", "no")
            .set("downscript", "no");
        let multi_queue = self.queues > 1;
        let netdev = netdev.set_opt("queues", multi_queue.then_some(self.queues));
        push(argv, "-netdev", netdev.keyval_with("tap"));
        let dev = Props::new()
            .set("id", device_id(&self.name))
            .set("netdev", netdev_id)
            .set_opt("mq", multi_queue.then_some(true))
            .set_opt(
                "vectors",
                multi_queue.then(|| self.queues.saturating_mul(2).saturating_add(2)),
            )
            .set_opt("mac", self.mac.as_ref())
            .set_opt(
                "host_mtu",
                self.mtu.filter(|_| self.model == NicModel::Virtio),
            )
            .set_opt("bootindex", self.boot_index)
            .set_opt("bus", self.pci_bus.as_ref())
            .set_opt("addr", self.pci_addr.as_ref())
            .set_opt("multifunction", self.pci_multifunction.then_some(true))
            .set_opt("acpi-index", self.acpi_index);
        push(
            argv,
            "-device",
            dev.keyval_with(&self.model.driver(self.virtio)),
        );
    }
}

/// A unix socket server chardev that QEMU listens on without waiting for a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketChardev {
    pub id: &'static str,
    pub path: PathBuf,
}

impl Args for SocketChardev {
    fn push_args(&self, argv: &mut Vec<String>) {
        let p = Props::new()
            .set("id", self.id)
            .set("path", path_str(&self.path))
            .set("server", true)
            .set("wait", false);
        push(argv, "-chardev", p.keyval_with("socket"));
    }
}

/// The first serial port (ttyS0). QEMU serves it on a socket that only the launcher connects
/// to; the launcher keeps a bounded log and relays it to the public console socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SerialPort {
    pub socket: PathBuf,
}

impl Args for SerialPort {
    fn push_args(&self, argv: &mut Vec<String>) {
        SocketChardev {
            id: "charserial0",
            path: self.socket.clone(),
        }
        .push_args(argv);
        push(
            argv,
            "-device",
            "isa-serial,chardev=charserial0,id=serial0".to_owned(),
        );
    }
}

/// The guest agent's virtio-serial port, named as qemu-ga expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentChannel {
    pub socket: PathBuf,
    pub virtio: VirtioModel,
}

impl Args for AgentChannel {
    fn push_args(&self, argv: &mut Vec<String>) {
        SocketChardev {
            id: "charchannel0",
            path: self.socket.clone(),
        }
        .push_args(argv);
        push(
            argv,
            "-device",
            format!(
                "{},id=virtio-serial0",
                self.virtio.device("virtio-serial-pci")
            ),
        );
        push(
            argv,
            "-device",
            "virtserialport,bus=virtio-serial0.0,nr=1,chardev=charchannel0,id=channel0,\
             name=org.qemu.guest_agent.0"
                .to_owned(),
        );
    }
}

/// VNC on a unix socket plus the display adapter it shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vnc {
    pub socket: PathBuf,
    /// QEMU's device for KubeVirt's `video.type` ([`video_device`]).
    pub video: &'static str,
}

impl Args for Vnc {
    fn push_args(&self, argv: &mut Vec<String>) {
        push(
            argv,
            "-vnc",
            format!("unix:{}", escape(&path_str(&self.socket))),
        );
        push(argv, "-device", format!("{},id=video0", self.video));
    }
}

/// QEMU's display device for a KubeVirt `video.type` (libvirt's model names, which KubeVirt
/// passes through), `None` for a type we do not know; KubeVirt's amd64 default is `vga`.
pub fn video_device(video_type: &str) -> Option<&'static str> {
    Some(match video_type {
        "vga" => "VGA",
        "cirrus" => "cirrus-vga",
        "vmvga" => "vmware-svga",
        "virtio" => "virtio-vga",
        "bochs" => "bochs-display",
        "ramfb" => "ramfb",
        _ => return None,
    })
}

/// A tablet (absolute pointer, so the VNC cursor and the guest's agree): on the USB
/// controller or virtio.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tablet {
    pub name: String,
    pub usb: bool,
}

impl Args for Tablet {
    fn push_args(&self, argv: &mut Vec<String>) {
        let p = Props::new().set("id", device_id(&self.name));
        let p = if self.usb {
            p.set("bus", format!("{USB_CONTROLLER}.0"))
                .keyval_with("usb-tablet")
        } else {
            p.keyval_with("virtio-tablet-pci")
        };
        push(argv, "-device", p);
    }
}

/// An Intel 6300ESB watchdog and what QEMU does when the guest stops feeding it
/// (`-watchdog-action`: KubeVirt's `poweroff`, `reset` or `shutdown`, the last an ACPI power
/// button press, as libvirt maps them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watchdog {
    pub name: String,
    pub action: String,
}

impl Args for Watchdog {
    fn push_args(&self, argv: &mut Vec<String>) {
        let p = Props::new().set("id", device_id(&self.name));
        push(argv, "-device", p.keyval_with("i6300esb"));
        push(argv, "-watchdog-action", self.action.clone());
    }
}

/// Where QEMU serves QMP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Monitor {
    /// QEMU creates the socket and listens on it.
    Socket(PathBuf),
    /// A socket the launcher has already bound and listens on, inherited as this descriptor.
    /// The launcher can connect at once and wait for the greeting, instead of polling for a
    /// socket QEMU has not created yet (libvirt passes its monitor socket the same way).
    ListeningFd(i32),
}

impl Args for Monitor {
    fn push_args(&self, argv: &mut Vec<String>) {
        match self {
            Monitor::Socket(path) => SocketChardev {
                id: "charmonitor",
                path: path.clone(),
            }
            .push_args(argv),
            Monitor::ListeningFd(fd) => {
                let p = Props::new()
                    .set("id", "charmonitor")
                    .set("fd", fd.to_string())
                    .set("server", true)
                    .set("wait", false);
                push(argv, "-chardev", p.keyval_with("socket"));
            }
        }
    }
}

/// Controllers that exist only when something needs them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Controllers {
    pub sata: bool,
    pub scsi: bool,
    /// The IOThread the SCSI controller runs in and its request queues (one per vCPU), as
    /// KubeVirt asks when a SCSI disk wants a dedicated IOThread.
    pub scsi_iothread: Option<(u32, u32)>,
    pub virtio: VirtioModel,
    pub usb: bool,
    /// Empty PCIe root ports kept free for hotplugging virtio disks (q35 only: on pc the root
    /// bus itself takes hotplugged devices).
    pub hotplug_ports: Vec<String>,
    /// The buses libvirt would add for devices with a `pciAddress` off the root bus.
    pub pci_buses: Vec<api::pci::Controller>,
}

/// The QEMU id of the bus of libvirt's PCI controller `index`: libvirt's alias (`pci.<index>`),
/// the machine's own bus for 0.
pub fn pci_bus_id(kind: MachineKind, index: u8) -> String {
    if index == 0 {
        kind.root_bus().to_owned()
    } else {
        format!("pci.{index}")
    }
}

/// A slot and function as QEMU's `addr` takes them: `0x5`, `0x5.0x1`.
pub fn pci_slot_function(slot: u8, function: u8) -> String {
    if function == 0 {
        format!("{slot:#x}")
    } else {
        format!("{slot:#x}.{function:#x}")
    }
}

impl Controllers {
    /// The buses of [`Controllers::pci_buses`], parents first; they come before every device,
    /// so that their places on the root bus are the lowest (firmware numbers buses in slot
    /// order) and the devices pinned to them find them.
    fn push_buses(&self, kind: MachineKind, argv: &mut Vec<String>) {
        for c in &self.pci_buses {
            let p = Props::new()
                .set("id", pci_bus_id(kind, c.index))
                .set("bus", pci_bus_id(kind, c.bus))
                .set("addr", pci_slot_function(c.slot, c.function))
                .set_opt("multifunction", c.multifunction.then_some(true));
            let dev = match c.model {
                // libvirt's chassis for a root port is its index; hotplug ports count on.
                api::pci::Model::PcieRootPort => p
                    .set("chassis", u32::from(c.index))
                    .keyval_with("pcie-root-port"),
                api::pci::Model::PcieToPciBridge => p.keyval_with("pcie-pci-bridge"),
                api::pci::Model::PciBridge => p
                    .set("chassis_nr", u32::from(c.index))
                    .keyval_with("pci-bridge"),
            };
            push(argv, "-device", dev);
        }
    }
}

impl Args for Controllers {
    fn push_args(&self, argv: &mut Vec<String>) {
        if self.sata {
            push(argv, "-device", format!("ahci,id={SATA_CONTROLLER}"));
        }
        if self.scsi {
            let p = Props::new()
                .set("id", SCSI_CONTROLLER)
                .set_opt("iothread", self.scsi_iothread.map(|(t, _)| iothread_id(t)))
                .set_opt("num_queues", self.scsi_iothread.map(|(_, q)| q));
            push(
                argv,
                "-device",
                p.keyval_with(&self.virtio.device("virtio-scsi-pci")),
            );
        }
        if self.usb {
            push(argv, "-device", format!("qemu-xhci,id={USB_CONTROLLER}"));
        }
        // Chassis numbers after the root ports of `pci_buses`, which take their indexes.
        let chassis = self
            .pci_buses
            .iter()
            .map(|c| usize::from(c.index))
            .max()
            .unwrap_or(0);
        for (i, port) in self.hotplug_ports.iter().enumerate() {
            let p = Props::new().set("id", port).set("bus", "pcie.0").set(
                "chassis",
                u32::try_from(chassis + i + 1).unwrap_or(u32::MAX),
            );
            push(argv, "-device", p.keyval_with("pcie-root-port"));
        }
    }
}

/// The whole machine. `argv()` is what the launcher executes (after the binary name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuConfig {
    /// `<namespace>_<name>`, shown in process listings and thread names.
    pub name: String,
    pub machine: Machine,
    pub cpu: Cpu,
    pub memory: Memory,
    /// IOThreads `iothread1`..`iothread<n>`.
    pub iothreads: u32,
    pub clock: Clock,
    pub smbios: Smbios,
    pub firmware: Firmware,
    pub kernel_boot: Option<KernelBoot>,
    /// Milliseconds the firmware's boot menu waits for a choice, if it is shown.
    pub boot_menu_ms: Option<u32>,
    pub controllers: Controllers,
    pub disks: Vec<Disk>,
    pub nics: Vec<Nic>,
    pub filesystems: Vec<Filesystem>,
    pub monitor: Monitor,
    pub serial: Option<SerialPort>,
    pub agent: Option<AgentChannel>,
    pub vnc: Option<Vnc>,
    pub rng: bool,
    pub balloon: bool,
    /// The model of the RNG and the balloon.
    pub virtio: VirtioModel,
    pub watchdog: Option<Watchdog>,
    pub tablets: Vec<Tablet>,
    /// A migration target: QEMU waits for the guest's state (`-incoming defer`, then
    /// `migrate-incoming` over QMP) instead of booting it.
    pub incoming: bool,
}

impl QemuConfig {
    pub fn argv(&self) -> Vec<String> {
        let mut a = Vec::with_capacity(96);
        let name = Props::new()
            .set("guest", &self.name)
            .set("debug-threads", true);
        push(&mut a, "-name", name.keyval());
        // Paused until the launcher has checked the machine over QMP; no defaults or user
        // config files, so the command line is the whole truth about the device model.
        for flag in ["-S", "-nodefaults", "-no-user-config"] {
            a.push(flag.to_owned());
        }
        push(&mut a, "-display", "none".to_owned());
        push(&mut a, "-vga", "none".to_owned());
        push(&mut a, "-msg", "timestamp=on".to_owned());
        let accel = match self.machine.accel {
            Accel::Kvm => "kvm".to_owned(),
            // The translated code within what the pod's memory budgets for it: QEMU's default
            // cache (1 GiB in 7.2) grows with a busy guest past any budget.
            Accel::Tcg => format!("tcg,tb-size={}", api::overhead::TCG_MIB),
        };
        push(&mut a, "-accel", accel);
        push(
            &mut a,
            "-machine",
            self.machine
                .props(&self.memory, &self.firmware)
                .keyval_with(self.machine.kind.as_str()),
        );
        self.cpu.push_args(&mut a);
        self.memory.push_args(&mut a);
        for n in 1..=self.iothreads {
            push(&mut a, "-object", format!("iothread,id={}", iothread_id(n)));
        }
        self.clock.push_args(&mut a);
        self.smbios.push_args(&mut a);
        self.firmware.push_args(&mut a);
        if let Some(k) = &self.kernel_boot {
            k.push_args(&mut a);
        }
        if let Some(ms) = self.boot_menu_ms {
            push(&mut a, "-boot", format!("menu=on,splash-time={ms}"));
        }
        self.monitor.push_args(&mut a);
        push(
            &mut a,
            "-mon",
            "chardev=charmonitor,id=monitor,mode=control".to_owned(),
        );
        self.controllers.push_buses(self.machine.kind, &mut a);
        // Devices at a fixed PCI address come before any QEMU places, which then places those
        // around them instead of taking their slots first.
        let (pinned, placed): (Vec<&Disk>, Vec<&Disk>) =
            self.disks.iter().partition(|d| d.pci_addr.is_some());
        let (pinned_nics, placed_nics): (Vec<&Nic>, Vec<&Nic>) =
            self.nics.iter().partition(|n| n.pci_addr.is_some());
        for d in pinned {
            d.push_args(&mut a);
        }
        for n in pinned_nics {
            n.push_args(&mut a);
        }
        self.controllers.push_args(&mut a);
        for d in placed {
            d.push_args(&mut a);
        }
        for n in placed_nics {
            n.push_args(&mut a);
        }
        for (i, f) in self.filesystems.iter().enumerate() {
            f.push_args(i, &mut a);
        }
        if let Some(s) = &self.serial {
            s.push_args(&mut a);
        }
        if let Some(c) = &self.agent {
            c.push_args(&mut a);
        }
        if let Some(v) = &self.vnc {
            v.push_args(&mut a);
        }
        if self.rng {
            push(
                &mut a,
                "-object",
                "rng-random,id=rng0,filename=/dev/urandom".to_owned(),
            );
            push(
                &mut a,
                "-device",
                format!(
                    "{},rng=rng0,id=rng0-dev",
                    self.virtio.device("virtio-rng-pci")
                ),
            );
        }
        if self.balloon {
            push(
                &mut a,
                "-device",
                format!("{},id=balloon0", self.virtio.device("virtio-balloon-pci")),
            );
        }
        if let Some(w) = &self.watchdog {
            w.push_args(&mut a);
        }
        for t in &self.tablets {
            t.push_args(&mut a);
        }
        // A panicking guest kernel reports it (GUEST_PANICKED) instead of hanging silently.
        push(&mut a, "-device", "pvpanic".to_owned());
        if self.incoming {
            push(&mut a, "-incoming", "defer".to_owned());
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The topology the fuzzer found overflowing the api crate's product (`fuzz/`): the
    /// launcher's own product saturates too, and QEMU refuses the figure itself.
    #[test]
    fn vcpus_of_an_oversized_topology_saturate() {
        let cpu = Cpu {
            model: "host".into(),
            kvm_hidden: false,
            kvmclock: None,
            pv_unhalt: None,
            features: Vec::new(),
            sockets: 65536,
            cores: 65536,
            threads: 2,
            max_sockets: 65536,
        };
        assert_eq!(cpu.vcpus(), u32::MAX);
    }

    fn disk(name: &str, frontend: Frontend) -> Disk {
        Disk {
            name: name.to_owned(),
            source: DiskSource {
                path: "/var/run/kubevirt-private/vmi-disks/x,y/disk.img".into(),
                block_device: false,
                format: ImageFormat::Raw,
            },
            frontend,
            read_only: true,
            cache: CacheMode::Writethrough,
            boot_index: Some(1),
            serial: Some("SER,1".to_owned()),
            pci_bus: None,
            pci_addr: None,
            pci_multifunction: false,
            aio: Aio::Threads,
            error_policy: ErrorPolicy::Stop,
            share_rw: false,
            iothread: None,
            num_queues: None,
            virtio: VirtioModel::NonTransitional,
        }
    }

    #[test]
    fn virtio_disk_renders_blockdev_and_device() {
        let mut argv = Vec::new();
        disk("root", Frontend::Virtio).push_args(&mut argv);
        let node = node_name("root");
        assert_eq!(
            argv,
            vec![
                "-blockdev".to_owned(),
                format!(
                    "node-name={node},driver=raw,read-only=on,discard=unmap,cache.direct=off,\
                     cache.no-flush=off,file.driver=file,\
                     file.filename=/var/run/kubevirt-private/vmi-disks/x,,y/disk.img,\
                     file.aio=threads"
                ),
                "-device".to_owned(),
                format!(
                    "virtio-blk-pci-non-transitional,id=ua-root,drive={node},write-cache=off,serial=SER,,1,\
                     bootindex=1,werror=stop,rerror=stop"
                ),
            ]
        );
    }

    #[test]
    fn device_json_is_typed() {
        let d = disk("data", Frontend::Scsi { lun: 2 });
        let j = d.device_json();
        assert_eq!(j["driver"], "scsi-hd");
        assert_eq!(j["lun"], 2);
        assert_eq!(j["bootindex"], 1);
        assert_eq!(j["bus"], "scsi0.0");
        let b = d.blockdev_json();
        assert_eq!(
            b["file"]["filename"],
            "/var/run/kubevirt-private/vmi-disks/x,y/disk.img"
        );
        assert_eq!(b["read-only"], true);
    }

    #[test]
    fn node_names_fit_qemu_limit() {
        let long = "a".repeat(63);
        assert!(node_name(&long).len() <= 31);
        assert_ne!(node_name("a"), node_name("b"));
    }

    #[test]
    fn cdrom_has_no_write_cache() {
        let d = disk("cd", Frontend::SataCdrom { unit: 3 });
        let rendered = d.device().keyval_with(&d.driver());
        assert!(rendered.starts_with("ide-cd,id=ua-cd,drive="));
        assert!(rendered.contains("bus=sata0.3"));
        assert!(!rendered.contains("write-cache"));
    }

    #[test]
    fn monitor_is_a_socket_path_or_an_inherited_listener() {
        let mut argv = Vec::new();
        Monitor::ListeningFd(7).push_args(&mut argv);
        assert_eq!(
            argv,
            ["-chardev", "socket,id=charmonitor,fd=7,server=on,wait=off"]
        );
        argv.clear();
        Monitor::Socket("/run/a,b/qmp.sock".into()).push_args(&mut argv);
        assert_eq!(
            argv,
            [
                "-chardev",
                "socket,id=charmonitor,path=/run/a,,b/qmp.sock,server=on,wait=off"
            ]
        );
    }

    #[test]
    fn an_offset_clock_starts_that_far_from_now_in_utc() {
        let at = |secs| std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        let clock = |utc_offset| Clock {
            utc_offset,
            rtc_clock: None,
            rtc_catchup: false,
            pit_lost_tick_policy: None,
        };
        assert_eq!(clock(None).rtc(at(0)), "base=utc");
        assert_eq!(clock(Some(0)).rtc(at(0)), "base=1970-01-01T00:00:00");
        // 2024-02-29T23:59:59 UTC, a leap day, and an hour later.
        assert_eq!(
            clock(Some(3600)).rtc(at(1_709_251_199)),
            "base=2024-03-01T00:59:59"
        );
        assert_eq!(
            clock(Some(-86_400 * 366)).rtc(at(1_709_251_199)),
            "base=2023-02-28T23:59:59"
        );
        assert_eq!(utc_datetime(-1), "1969-12-31T23:59:59");
        assert_eq!(utc_datetime(951_782_400), "2000-02-29T00:00:00");
    }

    #[test]
    fn kernel_args_are_verbatim() {
        let mut argv = Vec::new();
        KernelBoot {
            kernel: "/k,1".into(),
            initrd: None,
            cmdline: Some("console=ttyS0,115200".into()),
        }
        .push_args(&mut argv);
        assert_eq!(argv, ["-kernel", "/k,1", "-append", "console=ttyS0,115200"]);
    }
}
