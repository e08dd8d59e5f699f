//! `VirtualMachineInstance`: the running-VM kind, and the spec shared by every template.
//!
//! Field names, nesting and optionality follow KubeVirt's `kubevirt.io/api/core/v1`
//! (`types.go`, `schema.go`). Fields a Go `omitempty` scalar would drop are `Option` here so a
//! manifest round-trips exactly; lists and maps are plain collections for convenience (an
//! explicit empty list is the only thing that does not survive a round trip).

// `printcolumn(...)` repeats `type_ = ...`; clippy reads the derive's arguments as duplicated
// attributes, which they are not.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, DownwardAPIVolumeFile, ExecAction, HTTPGetAction, LocalObjectReference,
    PersistentVolumeClaimVolumeSource, PodDNSConfig, TCPSocketAction, Toleration,
    TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::{Empty, Preserved, PullPolicy, string_enum};
use crate::status::VirtualMachineInstanceStatus;

/// The `spec` of a `VirtualMachineInstance` (and of every VMI template).
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstance",
    namespaced,
    status = "VirtualMachineInstanceStatus",
    derive = "PartialEq",
    shortname = "vmi",
    shortname = "vmis",
    category = "all",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachineInstance is one running (or about to run) virtual machine, backed by one launcher pod.",
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "IP",
        type_ = "string",
        json_path = ".status.interfaces[0].ipAddress"
    ),
    printcolumn(name = "NodeName", type_ = "string", json_path = ".status.nodeName"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type=='Ready')].status"
    ),
    printcolumn(
        name = "Live-Migratable",
        type_ = "string",
        json_path = ".status.conditions[?(@.type=='LiveMigratable')].status",
        priority = 1
    ),
    printcolumn(
        name = "Paused",
        type_ = "string",
        json_path = ".status.conditions[?(@.type=='Paused')].status",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceSpec {
    /// Priority class of the launcher pod.
    pub priority_class_name: Option<String>,
    /// Specification of the desired behavior of the VirtualMachineInstance on the host.
    pub domain: DomainSpec,
    /// Node labels the launcher pod must match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Scheduling affinity of the launcher pod.
    pub affinity: Option<Affinity>,
    /// Scheduler that places the launcher pod.
    pub scheduler_name: Option<String>,
    /// Service account the launcher pod runs as.
    pub service_account_name: Option<String>,
    /// Tolerations of the launcher pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Topology spread constraints of the launcher pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// What happens on node drain: None, LiveMigrate, LiveMigrateIfPossible, External.
    pub eviction_strategy: Option<EvictionStrategy>,
    /// `Paused` starts the guest paused.
    pub start_strategy: Option<String>,
    /// Grace period between the stop signal and a forced stop.
    pub termination_grace_period_seconds: Option<i64>,
    /// Volumes the disks refer to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    /// Periodic liveness probe.
    pub liveness_probe: Option<Probe>,
    /// Periodic readiness probe.
    pub readiness_probe: Option<Probe>,
    /// Guest hostname; defaults to the VMI name.
    pub hostname: Option<String>,
    /// DNS subdomain of the VMI.
    pub subdomain: Option<String>,
    /// Networks the interfaces connect to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<Network>,
    /// DNS policy of the launcher pod.
    pub dns_policy: Option<String>,
    /// DNS configuration of the launcher pod.
    pub dns_config: Option<PodDNSConfig>,
    /// SSH keys / passwords to inject (not supported yet).
    pub access_credentials: Option<Preserved>,
    /// Guest architecture; defaults to the cluster's.
    pub architecture: Option<String>,
    /// Dynamic resource allocation claims (not supported yet).
    pub resource_claims: Option<Preserved>,
    /// Utility volumes mounted into the launcher pod (not supported yet).
    pub utility_volumes: Option<Preserved>,
}

string_enum! {
    /// What the cluster does with the VMI when its node is drained.
    pub enum EvictionStrategy {
        None = "None",
        LiveMigrate = "LiveMigrate",
        LiveMigrateIfPossible = "LiveMigrateIfPossible",
        External = "External",
    }
}

/// A VMI probe (KubeVirt's own shape: a pod probe plus `guestAgentPing`).
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Probe {
    /// Run a command in the guest through the guest agent.
    pub exec: Option<ExecAction>,
    /// HTTP GET against the guest.
    pub http_get: Option<HTTPGetAction>,
    /// TCP connect to the guest.
    pub tcp_socket: Option<TCPSocketAction>,
    /// Ping the guest agent.
    pub guest_agent_ping: Option<Empty>,
    /// Seconds after start before the first probe.
    pub initial_delay_seconds: Option<i32>,
    /// Seconds before a probe times out (defaults to 1).
    pub timeout_seconds: Option<i32>,
    /// Seconds between probes (defaults to 10).
    pub period_seconds: Option<i32>,
    /// Successes in a row to count as healthy (defaults to 1).
    pub success_threshold: Option<i32>,
    /// Failures in a row to count as failed (defaults to 3).
    pub failure_threshold: Option<i32>,
}

/// The virtual hardware.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DomainSpec {
    /// Compute resources of the VMI (`memory`, `cpu`).
    #[serde(default, skip_serializing_if = "ResourceRequirements::is_empty")]
    pub resources: ResourceRequirements,
    /// CPU topology and model.
    pub cpu: Option<Cpu>,
    /// Guest memory.
    pub memory: Option<Memory>,
    /// Machine type.
    pub machine: Option<Machine>,
    /// Firmware: BIOS / EFI / kernel boot, UUID, serial.
    pub firmware: Option<Firmware>,
    /// Guest clock and timers.
    pub clock: Option<Clock>,
    /// Platform features (acpi, apic, smm...).
    pub features: Option<Features>,
    /// Devices attached to the guest.
    #[serde(default)]
    pub devices: Devices,
    /// IOThreads policy (`shared`, `auto`, `supplementalPool`).
    pub io_threads_policy: Option<String>,
    /// IOThreads options (not supported yet).
    pub io_threads: Option<Preserved>,
    /// SMBIOS chassis information (not supported yet).
    pub chassis: Option<Preserved>,
    /// SEV / SNP / TDX (not supported).
    pub launch_security: Option<Preserved>,
    /// `Reboot` (default) or `Terminate` on guest reboot.
    pub reboot_policy: Option<String>,
}

/// Requests and limits of the VMI, keyed `memory` / `cpu`.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceRequirements {
    /// Initial resources of the VMI.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, Quantity>,
    /// Upper bound of the resources of the VMI.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Quantity>,
    /// Put the launcher overhead only into the limit, not the request.
    pub overcommit_guest_overhead: Option<bool>,
}

impl ResourceRequirements {
    /// Whether nothing at all is set (so the field can be left out when serialising).
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
            && self.limits.is_empty()
            && self.overcommit_guest_overhead.is_none()
    }
}

/// CPU topology, model and placement.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Cpu {
    /// Cores per socket.
    pub cores: Option<u32>,
    /// Sockets.
    pub sockets: Option<u32>,
    /// Maximum sockets for CPU hotplug.
    pub max_sockets: Option<u32>,
    /// Threads per core.
    pub threads: Option<u32>,
    /// CPU model: `host-model`, `host-passthrough` or a named model.
    pub model: Option<String>,
    /// CPU feature flags.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<CpuFeature>,
    /// Pin vCPUs to dedicated host CPUs.
    pub dedicated_cpu_placement: Option<bool>,
    /// Guest NUMA topology (not supported yet).
    pub numa: Option<Preserved>,
    /// One more dedicated pCPU for the emulator thread.
    pub isolate_emulator_thread: Option<bool>,
    /// Realtime tuning (not supported yet).
    pub realtime: Option<Preserved>,
}

impl Cpu {
    /// sockets x cores x threads, each defaulting to 1; `u32::MAX` when the product does not
    /// fit (validation refuses more than 512, so the exact figure does not matter).
    pub fn vcpus(&self) -> u32 {
        self.sockets
            .unwrap_or(1)
            .max(1)
            .saturating_mul(self.cores.unwrap_or(1).max(1))
            .saturating_mul(self.threads.unwrap_or(1).max(1))
    }
}

/// A CPU feature flag and its policy.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuFeature {
    /// Feature name, e.g. `pcid`.
    pub name: String,
    /// force, require (default), optional, disable, forbid.
    pub policy: Option<String>,
}

impl CpuFeature {
    /// Whether the guest may not run without the feature: policy `require`, KubeVirt's default
    /// (none or empty). Such a feature selects labelled nodes and is checked on the vCPU.
    pub fn required(&self) -> bool {
        matches!(self.policy.as_deref(), None | Some("" | "require"))
    }
}

/// Guest memory.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Memory {
    /// Back guest memory with hugepages.
    pub hugepages: Option<Hugepages>,
    /// Memory visible to the guest; defaults to the memory request.
    pub guest: Option<Quantity>,
    /// Upper bound for memory hotplug.
    pub max_guest: Option<Quantity>,
    /// Extra launcher overhead (not supported yet).
    pub reserved_overhead: Option<Preserved>,
}

/// Hugepage backing.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Hugepages {
    /// `2Mi` or `1Gi` on x86_64.
    pub page_size: Option<String>,
}

/// Machine type.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Machine {
    /// QEMU machine type, e.g. `q35`.
    #[serde(rename = "type")]
    pub machine_type: Option<String>,
}

/// Firmware settings.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Firmware {
    /// SMBIOS UUID; defaults to a random one.
    pub uuid: Option<String>,
    /// BIOS or EFI.
    pub bootloader: Option<Bootloader>,
    /// SMBIOS system serial number.
    pub serial: Option<String>,
    /// Direct kernel boot from a container image.
    pub kernel_boot: Option<KernelBoot>,
    /// ACPI SLIC / MSDM tables (not supported yet).
    pub acpi: Option<Preserved>,
}

/// BIOS (the default) or EFI; at most one may be set.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Bootloader {
    /// Legacy BIOS (SeaBIOS).
    pub bios: Option<Bios>,
    /// UEFI (OVMF).
    pub efi: Option<Efi>,
}

/// The bootloader a VMI asks for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BootloaderKind<'a> {
    /// SeaBIOS.
    Bios(&'a Bios),
    /// OVMF.
    Efi(&'a Efi),
}

impl Bootloader {
    /// The selected bootloader: EFI wins when (invalidly) both are set, as in KubeVirt's
    /// converter; validation reports that case.
    pub fn kind(&self) -> Option<BootloaderKind<'_>> {
        match (&self.bios, &self.efi) {
            (_, Some(efi)) => Some(BootloaderKind::Efi(efi)),
            (Some(bios), None) => Some(BootloaderKind::Bios(bios)),
            (None, None) => None,
        }
    }
}

/// BIOS options.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Bios {
    /// Send BIOS output to the serial console.
    pub use_serial: Option<bool>,
}

/// EFI options.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Efi {
    /// Secure Boot; defaults to true and requires the SMM feature.
    pub secure_boot: Option<bool>,
    /// Keep the EFI NVRAM across reboots.
    pub persistent: Option<bool>,
}

impl Efi {
    /// Secure Boot with KubeVirt's default (on).
    pub fn secure_boot_enabled(&self) -> bool {
        self.secure_boot.unwrap_or(true)
    }
}

/// Direct kernel boot.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KernelBoot {
    /// Kernel command line.
    pub kernel_args: Option<String>,
    /// Container image holding the kernel and initrd.
    pub container: Option<KernelBootContainer>,
}

/// The container image a kernel boot takes its kernel and initrd from.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KernelBootContainer {
    /// Image reference.
    pub image: String,
    /// Registry secret name.
    pub image_pull_secret: Option<String>,
    /// Pull policy.
    pub image_pull_policy: Option<PullPolicy>,
    /// Path of the kernel inside the image.
    pub kernel_path: Option<String>,
    /// Path of the initrd inside the image.
    pub initrd_path: Option<String>,
}

/// Guest clock.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Clock {
    /// Guest clock in UTC, with an optional offset.
    pub utc: Option<ClockOffsetUtc>,
    /// Guest clock in this time zone (TZ name).
    pub timezone: Option<String>,
    /// Timers.
    pub timer: Option<Timer>,
}

impl Clock {
    /// Seconds the guest's clock starts ahead of UTC (negative: behind) at `at`, or `None` for
    /// UTC: `utc.offsetSeconds`, or the offset `timezone` has at that instant. libvirt starts a
    /// time zone clock at the zone's local time (QEMU's `-rtc base=localtime` under `TZ`); from
    /// there the clock runs on, so a daylight saving change later does not move it. Zones come
    /// from the IANA database built into this binary, so neither a node's nor an image's
    /// `/usr/share/zoneinfo` decides which names exist.
    pub fn utc_offset_at(&self, at: std::time::SystemTime) -> Result<Option<i64>, String> {
        if let Some(zone) = &self.timezone {
            let tz = jiff::tz::db().get(zone).map_err(|_| {
                format!("unknown time zone {zone:?} (an IANA name such as Europe/Paris)")
            })?;
            let at = jiff::Timestamp::try_from(at).map_err(|e| e.to_string())?;
            return Ok(Some(i64::from(tz.to_offset(at).seconds())));
        }
        Ok(self
            .utc
            .as_ref()
            .and_then(|u| u.offset_seconds)
            .map(i64::from))
    }
}

/// UTC clock offset.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClockOffsetUtc {
    /// Offset from UTC in seconds.
    pub offset_seconds: Option<i32>,
}

/// Guest timers.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Timer {
    /// High Precision Event Timer.
    pub hpet: Option<TickTimer>,
    /// KVM clock.
    pub kvm: Option<PresenceTimer>,
    /// Programmable Interval Timer.
    pub pit: Option<TickTimer>,
    /// Real Time Clock.
    pub rtc: Option<RtcTimer>,
    /// Hyper-V clock.
    pub hyperv: Option<PresenceTimer>,
}

/// A timer that can only be present or not (kvm, hyperv).
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PresenceTimer {
    /// `false` removes the timer; defaults to true.
    pub present: Option<bool>,
}

/// A ticking timer (hpet, pit).
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TickTimer {
    /// `false` removes the timer; defaults to true.
    pub present: Option<bool>,
    /// delay, catchup, merge (hpet), discard.
    pub tick_policy: Option<String>,
}

/// The real time clock.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RtcTimer {
    /// `false` removes the timer; defaults to true.
    pub present: Option<bool>,
    /// delay or catchup.
    pub tick_policy: Option<String>,
    /// `guest` or `wall`.
    pub track: Option<String>,
}

/// Platform features.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Features {
    /// ACPI; enabled unless `enabled: false`.
    pub acpi: Option<FeatureState>,
    /// APIC.
    pub apic: Option<FeatureApic>,
    /// Pass every Hyper-V enlightenment through (not supported yet).
    pub hyperv_passthrough: Option<Preserved>,
    /// Hyper-V enlightenments (not supported yet).
    pub hyperv: Option<Preserved>,
    /// System Management Mode (required by Secure Boot).
    pub smm: Option<FeatureState>,
    /// Hide KVM from the guest.
    pub kvm: Option<FeatureKvm>,
    /// Paravirtual spinlocks.
    pub pvspinlock: Option<FeatureState>,
}

/// A feature that is on unless `enabled: false`.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FeatureState {
    /// Defaults to true.
    pub enabled: Option<bool>,
}

impl FeatureState {
    /// `enabled` with KubeVirt's default (true).
    pub fn is_enabled(&self) -> bool {
        self.enabled.unwrap_or(true)
    }
}

/// APIC feature.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FeatureApic {
    /// Defaults to true.
    pub enabled: Option<bool>,
    /// End-of-interrupt notification.
    pub end_of_interrupt: Option<bool>,
}

/// KVM feature.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FeatureKvm {
    /// Hide the KVM hypervisor signature.
    pub hidden: Option<bool>,
}

/// Devices attached to the guest.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Devices {
    /// Use transitional (virtio 0.9) devices for old guests.
    pub use_virtio_transitional: Option<bool>,
    /// Disable disk hotplug.
    pub disable_hotplug: Option<bool>,
    /// Disks, CD-ROMs and LUNs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Disk>,
    /// A hardware watchdog.
    pub watchdog: Option<Watchdog>,
    /// Network interfaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<Interface>,
    /// Input devices (tablet, keyboard).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<Input>,
    /// Attach the pod network when no interface is given; defaults to true.
    pub autoattach_pod_interface: Option<bool>,
    /// Attach a VGA device and VNC; defaults to true.
    pub autoattach_graphics_device: Option<bool>,
    /// Attach a serial console; defaults to true.
    pub autoattach_serial_console: Option<bool>,
    /// Log the serial console to a file.
    pub log_serial_console: Option<bool>,
    /// Attach a memory balloon; defaults to true.
    pub autoattach_mem_balloon: Option<bool>,
    /// Attach a tablet input device; defaults to false.
    pub autoattach_input_device: Option<bool>,
    /// Attach a VSOCK device; defaults to false.
    #[serde(rename = "autoattachVSOCK")]
    pub autoattach_vsock: Option<bool>,
    /// A virtio RNG fed from the host.
    pub rng: Option<Empty>,
    /// Multi-queue virtio block devices.
    pub block_multi_queue: Option<bool>,
    /// Multi-queue virtio network devices.
    #[serde(rename = "networkInterfaceMultiqueue")]
    pub network_interface_multiqueue: Option<bool>,
    /// GPUs (not supported yet).
    pub gpus: Option<Preserved>,
    /// Downward metrics serial port (not supported yet).
    pub downward_metrics: Option<Preserved>,
    /// Panic devices (not supported yet).
    pub panic_devices: Option<Preserved>,
    /// Volumes shared with the guest as file systems (virtiofs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filesystems: Vec<Filesystem>,
    /// Host devices (not supported yet).
    pub host_devices: Option<Preserved>,
    /// USB redirection (not supported yet).
    pub client_passthrough: Option<Preserved>,
    /// Sound device (not supported yet).
    pub sound: Option<Preserved>,
    /// vTPM (not supported yet).
    pub tpm: Option<Preserved>,
    /// Video device type.
    pub video: Option<Video>,
}

impl Devices {
    /// Whether the pod network is attached when no interface is given (default true).
    pub fn wants_pod_interface(&self) -> bool {
        self.autoattach_pod_interface.unwrap_or(true)
    }

    /// Whether a VGA device and VNC are attached (default true).
    pub fn wants_graphics(&self) -> bool {
        self.autoattach_graphics_device.unwrap_or(true)
    }

    /// Whether a serial console is attached (default true).
    pub fn wants_serial_console(&self) -> bool {
        self.autoattach_serial_console.unwrap_or(true)
    }

    /// Whether a memory balloon is attached (default true).
    pub fn wants_mem_balloon(&self) -> bool {
        self.autoattach_mem_balloon.unwrap_or(true)
    }

    /// Whether a tablet is attached for the VNC pointer (default false).
    pub fn wants_input_device(&self) -> bool {
        self.autoattach_input_device.unwrap_or(false)
    }
}

impl Features {
    /// ACPI, on unless `acpi.enabled: false`.
    pub fn acpi_enabled(&self) -> bool {
        self.acpi.as_ref().is_none_or(FeatureState::is_enabled)
    }

    /// SMM, on only when `smm` is given and not disabled.
    pub fn smm_enabled(&self) -> bool {
        self.smm.as_ref().is_some_and(FeatureState::is_enabled)
    }
}

/// Video device.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Video {
    /// virtio, vga, bochs, ramfb.
    #[serde(rename = "type")]
    pub video_type: Option<String>,
}

/// A guest PCI address as KubeVirt writes one (`pciAddress` of disks and interfaces):
/// `<domain>:<bus>:<slot>.<function>` in hex, `0000:00:05.0` (KubeVirt's `PCI_ADDRESS_PATTERN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PciAddress {
    pub domain: u16,
    pub bus: u8,
    pub slot: u8,
    pub function: u8,
}

impl PciAddress {
    /// `None` for anything but four, two and two hex digits and a function 0-7.
    pub fn parse(s: &str) -> Option<Self> {
        let (domain, rest) = s.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (slot, function) = rest.split_once('.')?;
        let hex = |part: &str, digits: usize| {
            (part.len() == digits && part.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| u16::from_str_radix(part, 16).ok())
                .flatten()
        };
        let byte = |part: &str| hex(part, 2).and_then(|v| u8::try_from(v).ok());
        Some(Self {
            domain: hex(domain, 4)?,
            bus: byte(bus)?,
            slot: byte(slot)?,
            function: hex(function, 1)
                .and_then(|v| u8::try_from(v).ok())
                .filter(|f| *f < 8)?,
        })
    }
}

impl std::fmt::Display for PciAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.slot, self.function
        )
    }
}

/// The `video.type`s kubevirt-rs runs: libvirt's model names, which KubeVirt passes through
/// (`vga` is its amd64 default).
pub const VIDEO_TYPES: [&str; 6] = ["vga", "cirrus", "vmvga", "virtio", "bochs", "ramfb"];

/// KubeVirt's i6300esb watchdog actions (`WatchdogAction`).
pub const WATCHDOG_ACTIONS: [&str; 3] = ["poweroff", "reset", "shutdown"];

/// Whether `action` is one of [`WATCHDOG_ACTIONS`]; the refusal's message if not.
pub fn check_watchdog_action(action: &str) -> Result<(), String> {
    if WATCHDOG_ACTIONS.contains(&action) {
        Ok(())
    } else {
        Err(format!(
            "unknown action {action:?} ({})",
            WATCHDOG_ACTIONS.join(", ")
        ))
    }
}

/// A named watchdog device.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Watchdog {
    /// Name of the watchdog.
    pub name: String,
    /// Intel 6300ESB watchdog.
    pub i6300esb: Option<WatchdogI6300Esb>,
    /// s390x diag288 watchdog (not supported).
    pub diag288: Option<Preserved>,
}

/// i6300esb watchdog.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WatchdogI6300Esb {
    /// poweroff, reset (default), shutdown.
    pub action: Option<String>,
}

/// A volume's files shared with the guest through virtiofs; the guest mounts it by its name
/// (`mount -t virtiofs <name> <dir>`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Filesystem {
    /// Name; must match a volume, and is the tag the guest mounts.
    pub name: String,
    /// Shared through virtiofs, the only kind KubeVirt has.
    pub virtiofs: Empty,
}

/// An input device.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Input {
    /// usb (default) or virtio.
    pub bus: Option<String>,
    /// tablet (default) or keyboard.
    #[serde(rename = "type")]
    pub input_type: Option<String>,
    /// Device name.
    pub name: String,
}

string_enum! {
    /// Bus a disk is attached to.
    pub enum DiskBus {
        Virtio = "virtio",
        Sata = "sata",
        Scsi = "scsi",
        Usb = "usb",
    }
}

string_enum! {
    /// Host cache mode of a disk.
    pub enum DiskCache {
        None = "none",
        WriteThrough = "writethrough",
        WriteBack = "writeback",
    }
}

string_enum! {
    /// QEMU AIO mode of a disk.
    pub enum DiskIo {
        Native = "native",
        Threads = "threads",
        Default = "default",
    }
}

/// A disk, CD-ROM or LUN backed by the volume of the same name.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Disk {
    /// Name; must match a volume.
    pub name: String,
    /// Attach as a disk.
    pub disk: Option<DiskTarget>,
    /// Attach as a LUN.
    pub lun: Option<LunTarget>,
    /// Attach as a CD-ROM.
    pub cdrom: Option<CdromTarget>,
    /// Boot order (> 0, unique across disks and interfaces).
    pub boot_order: Option<u32>,
    /// Serial number shown to the guest.
    pub serial: Option<String>,
    /// Give this disk its own IOThread.
    #[serde(rename = "dedicatedIOThread")]
    pub dedicated_io_thread: Option<bool>,
    /// Host cache mode.
    pub cache: Option<DiskCache>,
    /// AIO mode.
    pub io: Option<DiskIo>,
    /// Tag exposed in the config drive metadata.
    pub tag: Option<String>,
    /// Custom block sizes (not supported yet).
    pub block_size: Option<Preserved>,
    /// Shareable between VMs.
    pub shareable: Option<bool>,
    /// Error policy: stop, ignore, report, enospace.
    pub error_policy: Option<String>,
    /// Changed block tracking (not supported yet).
    pub changed_block_tracking: Option<bool>,
}

/// How a disk appears to the guest.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DiskTargetKind<'a> {
    /// A hard disk.
    Disk(&'a DiskTarget),
    /// A CD-ROM.
    Cdrom(&'a CdromTarget),
    /// A SCSI LUN.
    Lun(&'a LunTarget),
}

impl<'a> DiskTargetKind<'a> {
    /// The requested bus, if any.
    pub fn bus(self) -> Option<&'a DiskBus> {
        match self {
            Self::Disk(t) => t.bus.as_ref(),
            Self::Cdrom(t) => t.bus.as_ref(),
            Self::Lun(t) => t.bus.as_ref(),
        }
    }

    /// Read-only with KubeVirt's defaults (CD-ROMs are read-only unless told otherwise).
    pub fn readonly(self) -> bool {
        match self {
            Self::Disk(t) => t.readonly.unwrap_or(false),
            Self::Cdrom(t) => t.readonly.unwrap_or(true),
            Self::Lun(t) => t.readonly.unwrap_or(false),
        }
    }

    /// `disk`, `cdrom` or `lun`: the field name, for messages.
    pub fn field(self) -> &'static str {
        match self {
            Self::Disk(_) => "disk",
            Self::Cdrom(_) => "cdrom",
            Self::Lun(_) => "lun",
        }
    }
}

impl Disk {
    /// The target the disk asks for. `None` means "disk" by default (see `defaults`); when
    /// several are (invalidly) set the first of disk, cdrom, lun wins and validation reports it.
    pub fn target(&self) -> Option<DiskTargetKind<'_>> {
        if let Some(t) = &self.disk {
            Some(DiskTargetKind::Disk(t))
        } else if let Some(t) = &self.cdrom {
            Some(DiskTargetKind::Cdrom(t))
        } else {
            self.lun.as_ref().map(DiskTargetKind::Lun)
        }
    }

    /// Names of every target field that is set.
    pub fn targets_set(&self) -> Vec<&'static str> {
        let mut set = Vec::new();
        if self.disk.is_some() {
            set.push("disk");
        }
        if self.lun.is_some() {
            set.push("lun");
        }
        if self.cdrom.is_some() {
            set.push("cdrom");
        }
        set
    }

    /// The bus of whichever target is set.
    pub fn bus(&self) -> Option<&DiskBus> {
        self.target().and_then(DiskTargetKind::bus)
    }
}

/// Disk target options.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskTarget {
    /// virtio, sata, scsi (usb is KubeVirt-only).
    pub bus: Option<DiskBus>,
    /// Read-only; defaults to false.
    pub readonly: Option<bool>,
    /// Guest PCI address.
    pub pci_address: Option<String>,
}

/// LUN target options.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LunTarget {
    /// Bus.
    pub bus: Option<DiskBus>,
    /// Read-only; defaults to false.
    pub readonly: Option<bool>,
    /// SCSI persistent reservation.
    pub reservation: Option<bool>,
}

/// CD-ROM target options.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CdromTarget {
    /// Bus.
    pub bus: Option<DiskBus>,
    /// Read-only; defaults to true.
    pub readonly: Option<bool>,
    /// `open` or `closed` (default).
    pub tray: Option<String>,
}

/// A named volume.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    /// Volume name (DNS label), unique within the VMI.
    pub name: String,
    /// A disk image file on the node.
    pub host_disk: Option<HostDisk>,
    /// A PVC in the VMI's namespace.
    pub persistent_volume_claim: Option<PersistentVolumeClaimSource>,
    /// cloud-init NoCloud data.
    pub cloud_init_no_cloud: Option<CloudInitNoCloudSource>,
    /// cloud-init ConfigDrive data.
    pub cloud_init_config_drive: Option<CloudInitConfigDriveSource>,
    /// Windows sysprep answer file (not supported yet).
    pub sysprep: Option<Preserved>,
    /// A disk image inside a container image.
    pub container_disk: Option<ContainerDiskSource>,
    /// A copy-on-write overlay over a PVC.
    pub ephemeral: Option<EphemeralVolumeSource>,
    /// A sparse scratch disk living as long as the VMI.
    pub empty_disk: Option<EmptyDiskSource>,
    /// A CDI DataVolume (not supported yet).
    pub data_volume: Option<DataVolumeSource>,
    /// A ConfigMap as a disk.
    pub config_map: Option<ConfigMapVolumeSource>,
    /// A Secret as a disk.
    pub secret: Option<SecretVolumeSource>,
    /// Fields of the launcher pod (Downward API) as a disk.
    #[serde(rename = "downwardAPI")]
    pub downward_api: Option<DownwardApiVolumeSource>,
    /// A service account token as a disk.
    pub service_account: Option<ServiceAccountVolumeSource>,
    /// Downward metrics disk (not supported yet).
    pub downward_metrics: Option<Preserved>,
    /// Memory dump target (not supported yet).
    pub memory_dump: Option<Preserved>,
    /// Launcher container path through virtiofs (not supported yet).
    pub container_path: Option<Preserved>,
}

/// What a volume is backed by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum VolumeSource<'a> {
    /// Host disk image.
    HostDisk(&'a HostDisk),
    /// PVC.
    PersistentVolumeClaim(&'a PersistentVolumeClaimSource),
    /// cloud-init NoCloud.
    CloudInitNoCloud(&'a CloudInitNoCloudSource),
    /// cloud-init ConfigDrive.
    CloudInitConfigDrive(&'a CloudInitConfigDriveSource),
    /// Container disk.
    ContainerDisk(&'a ContainerDiskSource),
    /// Ephemeral overlay over a PVC.
    Ephemeral(&'a EphemeralVolumeSource),
    /// Empty scratch disk.
    EmptyDisk(&'a EmptyDiskSource),
    /// CDI DataVolume.
    DataVolume(&'a DataVolumeSource),
    /// ConfigMap.
    ConfigMap(&'a ConfigMapVolumeSource),
    /// Secret.
    Secret(&'a SecretVolumeSource),
    /// Service account.
    ServiceAccount(&'a ServiceAccountVolumeSource),
    /// Downward API.
    DownwardApi(&'a DownwardApiVolumeSource),
    /// A source kubevirt-rs keeps but does not implement; the field name says which.
    Unsupported(&'static str, &'a Preserved),
}

impl VolumeSource<'_> {
    /// The JSON field name of this source.
    pub fn field(&self) -> &'static str {
        match self {
            Self::HostDisk(_) => "hostDisk",
            Self::PersistentVolumeClaim(_) => "persistentVolumeClaim",
            Self::CloudInitNoCloud(_) => "cloudInitNoCloud",
            Self::CloudInitConfigDrive(_) => "cloudInitConfigDrive",
            Self::ContainerDisk(_) => "containerDisk",
            Self::Ephemeral(_) => "ephemeral",
            Self::EmptyDisk(_) => "emptyDisk",
            Self::DataVolume(_) => "dataVolume",
            Self::ConfigMap(_) => "configMap",
            Self::Secret(_) => "secret",
            Self::ServiceAccount(_) => "serviceAccount",
            Self::DownwardApi(_) => "downwardAPI",
            Self::Unsupported(field, _) => field,
        }
    }
}

impl Volume {
    /// Every source that is set, in declaration order. Exactly one is valid.
    pub fn sources(&self) -> Vec<VolumeSource<'_>> {
        let mut out = Vec::new();
        if let Some(s) = &self.host_disk {
            out.push(VolumeSource::HostDisk(s));
        }
        if let Some(s) = &self.persistent_volume_claim {
            out.push(VolumeSource::PersistentVolumeClaim(s));
        }
        if let Some(s) = &self.cloud_init_no_cloud {
            out.push(VolumeSource::CloudInitNoCloud(s));
        }
        if let Some(s) = &self.cloud_init_config_drive {
            out.push(VolumeSource::CloudInitConfigDrive(s));
        }
        if let Some(s) = &self.sysprep {
            out.push(VolumeSource::Unsupported("sysprep", s));
        }
        if let Some(s) = &self.container_disk {
            out.push(VolumeSource::ContainerDisk(s));
        }
        if let Some(s) = &self.ephemeral {
            out.push(VolumeSource::Ephemeral(s));
        }
        if let Some(s) = &self.empty_disk {
            out.push(VolumeSource::EmptyDisk(s));
        }
        if let Some(s) = &self.data_volume {
            out.push(VolumeSource::DataVolume(s));
        }
        if let Some(s) = &self.config_map {
            out.push(VolumeSource::ConfigMap(s));
        }
        if let Some(s) = &self.secret {
            out.push(VolumeSource::Secret(s));
        }
        if let Some(s) = &self.downward_api {
            out.push(VolumeSource::DownwardApi(s));
        }
        if let Some(s) = &self.service_account {
            out.push(VolumeSource::ServiceAccount(s));
        }
        if let Some(s) = &self.downward_metrics {
            out.push(VolumeSource::Unsupported("downwardMetrics", s));
        }
        if let Some(s) = &self.memory_dump {
            out.push(VolumeSource::Unsupported("memoryDump", s));
        }
        if let Some(s) = &self.container_path {
            out.push(VolumeSource::Unsupported("containerPath", s));
        }
        out
    }

    /// The volume's source when exactly one is set.
    pub fn source(&self) -> Option<VolumeSource<'_>> {
        match self.sources().as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    }
}

string_enum! {
    /// Whether a host disk must exist or may be created.
    #[derive(Default)]
    pub enum HostDiskType {
        #[default]
        Disk = "Disk",
        DiskOrCreate = "DiskOrCreate",
    }
}

/// A disk image file on the node.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostDisk {
    /// Path of the image on the node.
    pub path: String,
    /// `Disk` (must exist) or `DiskOrCreate`.
    #[serde(rename = "type")]
    pub disk_type: HostDiskType,
    /// Size of the sparse image to create.
    pub capacity: Option<Quantity>,
    /// Whether the path is shared between nodes.
    pub shared: Option<bool>,
}

/// A PVC reference.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PersistentVolumeClaimSource {
    /// Claim name.
    pub claim_name: String,
    /// Attach read-only.
    pub read_only: Option<bool>,
    /// Hotpluggable volume.
    pub hotpluggable: Option<bool>,
}

/// cloud-init NoCloud data source.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloudInitNoCloudSource {
    /// Secret holding `userdata` (or `userData`) and optionally `networkdata`.
    #[serde(rename = "secretRef")]
    pub user_data_secret_ref: Option<LocalObjectReference>,
    /// Base64 user data.
    pub user_data_base64: Option<String>,
    /// Inline user data.
    pub user_data: Option<String>,
    /// Secret holding network data.
    pub network_data_secret_ref: Option<LocalObjectReference>,
    /// Base64 network data.
    pub network_data_base64: Option<String>,
    /// Inline network data.
    pub network_data: Option<String>,
}

/// cloud-init ConfigDrive data source (same shape as NoCloud).
pub type CloudInitConfigDriveSource = CloudInitNoCloudSource;

/// A disk image in a container image.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDiskSource {
    /// Image reference.
    pub image: String,
    /// Registry secret name.
    pub image_pull_secret: Option<String>,
    /// Path of the disk image inside the container; defaults to the single file in `/disk`.
    pub path: Option<String>,
    /// Pull policy.
    pub image_pull_policy: Option<PullPolicy>,
}

/// Copy-on-write overlay over a PVC.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EphemeralVolumeSource {
    /// The read-only base.
    pub persistent_volume_claim: Option<PersistentVolumeClaimVolumeSource>,
}

/// A sparse scratch disk.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EmptyDiskSource {
    /// Size of the disk.
    pub capacity: Quantity,
}

/// A CDI DataVolume reference.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeSource {
    /// DataVolume (and PVC) name.
    pub name: String,
    /// Hotpluggable volume.
    pub hotpluggable: Option<bool>,
}

/// A ConfigMap presented as a disk.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapVolumeSource {
    /// ConfigMap name.
    pub name: Option<String>,
    /// Whether the ConfigMap may be missing.
    pub optional: Option<bool>,
    /// Filesystem label of the disk.
    pub volume_label: Option<String>,
}

/// A Secret presented as a disk.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretVolumeSource {
    /// Secret name.
    pub secret_name: Option<String>,
    /// Whether the Secret may be missing.
    pub optional: Option<bool>,
    /// Filesystem label of the disk.
    pub volume_label: Option<String>,
}

/// Fields of the launcher pod presented as a disk (KubeVirt's `DownwardAPIVolumeSource`).
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DownwardApiVolumeSource {
    /// The files to write, each a pod field or a container resource (Kubernetes' own type,
    /// handed to the launcher pod's `downwardAPI` volume as its `items`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<DownwardAPIVolumeFile>,
    /// Filesystem label of the disk.
    pub volume_label: Option<String>,
}

/// A service account token presented as a disk.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountVolumeSource {
    /// Service account name.
    pub service_account_name: Option<String>,
}

/// A network the VMI's interfaces connect to.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    /// Network name; interfaces refer to it.
    pub name: String,
    /// The pod network.
    pub pod: Option<PodNetwork>,
    /// A Multus secondary network (not supported yet).
    pub multus: Option<MultusNetwork>,
    /// A DRA network claim (not supported yet).
    pub resource_claim: Option<Preserved>,
}

/// Where a network comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NetworkSource<'a> {
    /// The pod network.
    Pod(&'a PodNetwork),
    /// Multus.
    Multus(&'a MultusNetwork),
    /// DRA claim.
    ResourceClaim(&'a Preserved),
}

impl NetworkSource<'_> {
    /// JSON field name of the source.
    pub fn field(&self) -> &'static str {
        match self {
            Self::Pod(_) => "pod",
            Self::Multus(_) => "multus",
            Self::ResourceClaim(_) => "resourceClaim",
        }
    }
}

impl Network {
    /// Every source that is set.
    pub fn sources(&self) -> Vec<NetworkSource<'_>> {
        let mut out = Vec::new();
        if let Some(p) = &self.pod {
            out.push(NetworkSource::Pod(p));
        }
        if let Some(m) = &self.multus {
            out.push(NetworkSource::Multus(m));
        }
        if let Some(r) = &self.resource_claim {
            out.push(NetworkSource::ResourceClaim(r));
        }
        out
    }

    /// The source when exactly one is set.
    pub fn source(&self) -> Option<NetworkSource<'_>> {
        match self.sources().as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    }
}

/// The pod network.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodNetwork {
    /// IPv4 CIDR of the guest network behind masquerade; defaults to 10.0.2.0/24.
    #[serde(rename = "vmNetworkCIDR")]
    pub vm_network_cidr: Option<String>,
    /// IPv6 CIDR of the guest network; defaults to fd10:0:2::/120.
    #[serde(rename = "vmIPv6NetworkCIDR")]
    pub vm_ipv6_network_cidr: Option<String>,
}

/// A Multus network.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MultusNetwork {
    /// NetworkAttachmentDefinition, `name` or `namespace/name`.
    pub network_name: String,
    /// Use it as the pod's default network.
    pub default: Option<bool>,
}

string_enum! {
    /// Emulated NIC model.
    pub enum InterfaceModel {
        Virtio = "virtio",
        E1000 = "e1000",
        E1000e = "e1000e",
        Igb = "igb",
        Ne2kPci = "ne2k_pci",
        Pcnet = "pcnet",
        Rtl8139 = "rtl8139",
    }
}

/// A guest network interface.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    /// Interface name; must match a network.
    pub name: String,
    /// NIC model; defaults to virtio.
    pub model: Option<InterfaceModel>,
    /// Bridge binding: the guest gets the pod IP over a linux bridge.
    pub bridge: Option<Empty>,
    /// Deprecated slirp binding (removed in KubeVirt 1.3).
    pub slirp: Option<Empty>,
    /// Masquerade binding: NAT from the pod IP to the guest.
    pub masquerade: Option<Empty>,
    /// SR-IOV VF passthrough (not supported).
    pub sriov: Option<Empty>,
    /// Deprecated macvtap binding.
    pub macvtap: Option<Empty>,
    /// Deprecated passt binding.
    pub passt: Option<Empty>,
    /// passt user-mode binding (not supported yet).
    pub passt_binding: Option<Empty>,
    /// A network binding plugin (not supported).
    pub binding: Option<PluginBinding>,
    /// Ports forwarded to the guest (masquerade).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<Port>,
    /// Port ranges forwarded to the guest (not supported yet).
    pub port_ranges: Option<Preserved>,
    /// MAC address, `de:ad:00:00:be:af` or `DE-AD-00-00-BE-AF`.
    pub mac_address: Option<String>,
    /// Boot order (> 0, unique across disks and interfaces).
    pub boot_order: Option<u32>,
    /// Guest PCI address.
    pub pci_address: Option<String>,
    /// Extra DHCP options (not supported yet).
    pub dhcp_options: Option<Preserved>,
    /// Tag exposed in config drive metadata.
    pub tag: Option<String>,
    /// ACPI index for stable NIC naming.
    pub acpi_index: Option<i32>,
    /// `up`, `down` or `absent`.
    pub state: Option<String>,
}

/// A binding plugin reference.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginBinding {
    /// Plugin name from the KubeVirt CR.
    pub name: String,
}

/// How an interface is connected to its network.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InterfaceBinding<'a> {
    /// Linux bridge in the pod.
    Bridge,
    /// NAT in the pod.
    Masquerade,
    /// Deprecated slirp.
    Slirp,
    /// SR-IOV.
    Sriov,
    /// Deprecated macvtap.
    Macvtap,
    /// Deprecated passt.
    Passt,
    /// passt binding.
    PasstBinding,
    /// Binding plugin.
    Plugin(&'a PluginBinding),
}

impl InterfaceBinding<'_> {
    /// JSON field name of the binding.
    pub fn field(&self) -> &'static str {
        match self {
            Self::Bridge => "bridge",
            Self::Masquerade => "masquerade",
            Self::Slirp => "slirp",
            Self::Sriov => "sriov",
            Self::Macvtap => "macvtap",
            Self::Passt => "passt",
            Self::PasstBinding => "passtBinding",
            Self::Plugin(_) => "binding",
        }
    }
}

/// `state` values (KubeVirt's `InterfaceStateLinkUp`, `...LinkDown`, `...Absent`).
pub const INTERFACE_STATE_UP: &str = "up";
pub const INTERFACE_STATE_DOWN: &str = "down";
pub const INTERFACE_STATE_ABSENT: &str = "absent";

impl Interface {
    /// Whether the guest sees this NIC's link down (`state: down`): the NIC is there, its cable
    /// is out.
    pub fn link_down(&self) -> bool {
        self.state.as_deref() == Some(INTERFACE_STATE_DOWN)
    }

    /// Every binding that is set.
    pub fn bindings(&self) -> Vec<InterfaceBinding<'_>> {
        let mut out = Vec::new();
        let flags = [
            (self.bridge.is_some(), InterfaceBinding::Bridge),
            (self.slirp.is_some(), InterfaceBinding::Slirp),
            (self.masquerade.is_some(), InterfaceBinding::Masquerade),
            (self.sriov.is_some(), InterfaceBinding::Sriov),
            (self.macvtap.is_some(), InterfaceBinding::Macvtap),
            (self.passt.is_some(), InterfaceBinding::Passt),
            (self.passt_binding.is_some(), InterfaceBinding::PasstBinding),
        ];
        for (set, binding) in flags {
            if set {
                out.push(binding);
            }
        }
        if let Some(p) = &self.binding {
            out.push(InterfaceBinding::Plugin(p));
        }
        out
    }

    /// The binding when exactly one is set.
    pub fn binding_method(&self) -> Option<InterfaceBinding<'_>> {
        match self.bindings().as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    }

    /// The NIC model with KubeVirt's default (virtio).
    pub fn model_or_default(&self) -> InterfaceModel {
        self.model.clone().unwrap_or(InterfaceModel::Virtio)
    }
}

/// A port forwarded to the guest.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    /// IANA service name.
    pub name: Option<String>,
    /// TCP (default) or UDP.
    pub protocol: Option<String>,
    /// Port number, 1..=65535.
    pub port: i32,
}

impl VirtualMachineInstance {
    /// The phase, if any has been reported.
    pub fn phase(&self) -> Option<&crate::status::VirtualMachineInstancePhase> {
        self.status.as_ref().and_then(|s| s.phase.as_ref())
    }

    /// Succeeded or Failed: the VMI will not run again.
    pub fn is_final(&self) -> bool {
        self.phase()
            .is_some_and(crate::status::VirtualMachineInstancePhase::is_final)
    }

    /// The node the VMI was placed on.
    pub fn node_name(&self) -> Option<&str> {
        self.status.as_ref().and_then(|s| s.node_name.as_deref())
    }
}

/// A VMI's domain name, `<namespace>_<name>` (KubeVirt's `VMINamespaceKeyFunc`): how
/// virt-probe names the VMI its probe was rendered for.
pub fn domain_name(namespace: &str, name: &str) -> String {
    format!("{namespace}_{name}")
}

/// `spec.startStrategy` that starts the guest paused (KubeVirt's `StartStrategyPaused`), the
/// only one there is.
pub const START_STRATEGY_PAUSED: &str = "Paused";

/// The most queues a tap device takes (the kernel's `MAX_TAP_QUEUES`), KubeVirt's
/// `MultiQueueMaxQueues`.
pub const MULTI_QUEUE_MAX_QUEUES: u32 = 256;

impl VirtualMachineInstanceSpec {
    /// The guest starts paused and waits for an unpause (KubeVirt's `ShouldStartPaused`).
    pub fn starts_paused(&self) -> bool {
        self.start_strategy.as_deref() == Some(START_STRATEGY_PAUSED)
    }

    /// The volume with this name.
    pub fn volume(&self, name: &str) -> Option<&Volume> {
        self.volumes.iter().find(|v| v.name == name)
    }

    /// The network with this name.
    pub fn network(&self, name: &str) -> Option<&Network> {
        self.networks.iter().find(|n| n.name == name)
    }

    /// Disks paired with their volumes, in disk order; a disk without a volume is skipped
    /// (validation reports it).
    pub fn disks_with_volumes(&self) -> impl Iterator<Item = (&Disk, &Volume)> {
        self.domain
            .devices
            .disks
            .iter()
            .filter_map(|d| self.volume(&d.name).map(|v| (d, v)))
    }

    /// Interfaces paired with their networks.
    pub fn interfaces_with_networks(&self) -> impl Iterator<Item = (&Interface, &Network)> {
        self.domain
            .devices
            .interfaces
            .iter()
            .filter_map(|i| self.network(&i.name).map(|n| (i, n)))
    }

    /// The queue pairs of this interface's virtio-net device and tap, KubeVirt's
    /// `NetworkQueuesCapacity`: with `networkInterfaceMultiqueue`, one per vCPU up to
    /// [`MULTI_QUEUE_MAX_QUEUES`], for virtio NICs only (other models have a single queue, and
    /// KubeVirt admits them with multiqueue set). 1 means a single-queue tap and device.
    pub fn network_queues(&self, iface: &Interface) -> u32 {
        if self.domain.devices.network_interface_multiqueue != Some(true)
            || iface.model_or_default() != InterfaceModel::Virtio
        {
            return 1;
        }
        self.domain
            .cpu
            .as_ref()
            .map_or(1, Cpu::vcpus)
            .min(MULTI_QUEUE_MAX_QUEUES)
    }

    /// The bootloader in use (BIOS when nothing is set).
    pub fn uses_efi(&self) -> bool {
        matches!(
            self.domain
                .firmware
                .as_ref()
                .and_then(|f| f.bootloader.as_ref())
                .and_then(Bootloader::kind),
            Some(BootloaderKind::Efi(_))
        )
    }

    /// The kernel boot settings, when the VMI boots a kernel directly.
    pub fn kernel_boot(&self) -> Option<&KernelBoot> {
        self.domain
            .firmware
            .as_ref()
            .and_then(|f| f.kernel_boot.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing (`fuzz/`, target api_vmi): a topology whose product does not fit a
    /// u32 made validation (and defaults) panic on the multiplication.
    #[test]
    fn vcpus_of_an_oversized_topology_saturate() {
        let cpu = Cpu {
            sockets: Some(65536),
            cores: Some(65536),
            threads: Some(2),
            ..Cpu::default()
        };
        assert_eq!(cpu.vcpus(), u32::MAX);
        let mut spec = VirtualMachineInstanceSpec::default();
        spec.domain.cpu = Some(cpu);
        let errors =
            crate::validation::validate_spec(&spec, &crate::ClusterConfig::default(), "spec");
        assert!(
            errors.iter().any(|e| e.path == "spec.domain.cpu"),
            "{errors:?}"
        );
    }

    /// KubeVirt's converter tests ("virtio-net multi-queue"): a queue per vCPU, capped as a
    /// tap's queues are, and none for other models or without the field.
    #[test]
    fn network_queues_follow_the_vcpus_of_virtio_nics() {
        let spec = |multiqueue: Option<bool>, cores, threads| {
            let mut s = VirtualMachineInstanceSpec::default();
            s.domain.devices.network_interface_multiqueue = multiqueue;
            s.domain.cpu = Some(Cpu {
                sockets: Some(1),
                cores: Some(cores),
                threads: Some(threads),
                ..Cpu::default()
            });
            s
        };
        let virtio = Interface::default();
        let e1000 = Interface {
            model: Some(InterfaceModel::E1000),
            ..Interface::default()
        };
        assert_eq!(spec(Some(true), 2, 1).network_queues(&virtio), 2);
        assert_eq!(spec(Some(true), 2, 2).network_queues(&virtio), 4);
        assert_eq!(spec(Some(true), 512, 2).network_queues(&virtio), 256);
        assert_eq!(spec(Some(true), 2, 1).network_queues(&e1000), 1);
        assert_eq!(spec(Some(false), 2, 1).network_queues(&virtio), 1);
        assert_eq!(spec(None, 2, 1).network_queues(&virtio), 1);
    }
}
