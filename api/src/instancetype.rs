//! `instancetype.kubevirt.io/v1beta1`: instance types (CPU, memory and placement a VM gets)
//! and preferences (defaults for what the VM leaves unset), namespaced and cluster-wide, and
//! KubeVirt's expansion of them into a VMI (`pkg/instancetype/apply`,
//! `pkg/instancetype/preference/apply`, `pkg/instancetype/preference/requirements`).
//!
//! A VM points at one of each with `spec.instancetype` / `spec.preference`; virt-controller
//! snapshots what it points at into a ControllerRevision ([`revision_name`]) and records it in
//! `status.instancetypeRef` / `status.preferenceRef`, so a later edit of the instance type does
//! not change that VM.

// `shortname = ...` repeats; clippy reads the derive's arguments as duplicated attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;
use std::ops::Deref;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::Preserved;
use crate::quantity::ParsedQuantity;
use crate::validation::{FieldError, UNSUPPORTED};
use crate::vmi::{
    Bios, Bootloader, Clock, ClockOffsetUtc, Cpu, CpuFeature, DiskBus, DiskCache, DiskIo, Efi,
    FeatureApic, FeatureKvm, FeatureState, Features, Firmware, InterfaceModel, Machine, Memory,
    Timer, VirtualMachineInstanceSpec,
};

/// API group of the four kinds.
pub const GROUP: &str = "instancetype.kubevirt.io";
/// The version served and stored.
pub const VERSION: &str = "v1beta1";

/// VMI annotation naming the namespaced instance type it was expanded from.
pub const INSTANCETYPE_ANNOTATION: &str = "kubevirt.io/instancetype-name";
/// VMI annotation naming the cluster instance type it was expanded from.
pub const CLUSTER_INSTANCETYPE_ANNOTATION: &str = "kubevirt.io/cluster-instancetype-name";
/// VMI annotation naming the namespaced preference it was expanded from.
pub const PREFERENCE_ANNOTATION: &str = "kubevirt.io/preference-name";
/// VMI annotation naming the cluster preference it was expanded from.
pub const CLUSTER_PREFERENCE_ANNOTATION: &str = "kubevirt.io/cluster-preference-name";

/// Label of a ControllerRevision snapshot: the generation of the object it holds.
pub const REVISION_OBJECT_GENERATION_LABEL: &str = "instancetype.kubevirt.io/object-generation";
/// Label of a ControllerRevision snapshot: the kind of the object it holds.
pub const REVISION_OBJECT_KIND_LABEL: &str = "instancetype.kubevirt.io/object-kind";
/// Label of a ControllerRevision snapshot: the name of the object it holds.
pub const REVISION_OBJECT_NAME_LABEL: &str = "instancetype.kubevirt.io/object-name";
/// Label of a ControllerRevision snapshot: the UID of the object it holds.
pub const REVISION_OBJECT_UID_LABEL: &str = "instancetype.kubevirt.io/object-uid";
/// Label of a ControllerRevision snapshot: the API version of the object it holds.
pub const REVISION_OBJECT_VERSION_LABEL: &str = "instancetype.kubevirt.io/object-version";

/// The `spec` of a `VirtualMachineInstancetype` (and of the cluster kind).
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "instancetype.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachineInstancetype",
    plural = "virtualmachineinstancetypes",
    singular = "virtualmachineinstancetype",
    shortname = "vminstancetype",
    shortname = "vminstancetypes",
    shortname = "vmf",
    shortname = "vmfs",
    category = "all",
    namespaced,
    derive = "PartialEq",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachineInstancetype resource contains quantitative and resource related VirtualMachine configuration that can be used by multiple VirtualMachine resources."
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstancetypeSpec {
    /// Copied to the VMI's `spec.nodeSelector`; a VM that sets its own conflicts.
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Copied to the VMI's `spec.schedulerName`.
    pub scheduler_name: Option<String>,
    /// vCPUs and CPU options.
    pub cpu: CpuInstancetype,
    /// Guest memory and memory options.
    pub memory: MemoryInstancetype,
    /// Refused: kubevirt-rs has no GPU passthrough.
    pub gpus: Option<Preserved>,
    /// Refused: kubevirt-rs has no host device passthrough.
    pub host_devices: Option<Preserved>,
    /// Copied to the VMI's `spec.domain.ioThreadsPolicy`.
    pub io_threads_policy: Option<String>,
    /// Refused, as the VMI's `spec.domain.ioThreads`.
    pub io_threads: Option<Preserved>,
    /// Refused: kubevirt-rs has no SEV / TDX.
    pub launch_security: Option<Preserved>,
    /// Added to the VMI's annotations; a different value there conflicts.
    pub annotations: Option<BTreeMap<String, String>>,
}

/// `VirtualMachineClusterInstancetype`: a cluster-wide instance type.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "instancetype.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachineClusterInstancetype",
    plural = "virtualmachineclusterinstancetypes",
    singular = "virtualmachineclusterinstancetype",
    shortname = "vmclusterinstancetype",
    shortname = "vmclusterinstancetypes",
    shortname = "vmcf",
    shortname = "vmcfs",
    derive = "PartialEq",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachineClusterInstancetype is a cluster scoped version of VirtualMachineInstancetype resource."
)]
#[serde(transparent)]
pub struct ClusterInstancetypeSpec(pub VirtualMachineInstancetypeSpec);

impl Deref for ClusterInstancetypeSpec {
    type Target = VirtualMachineInstancetypeSpec;
    fn deref(&self) -> &VirtualMachineInstancetypeSpec {
        &self.0
    }
}

/// The instance type's CPU.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuInstancetype {
    /// vCPUs, laid out by the preference's `preferredCPUTopology` (sockets by default).
    pub guest: u32,
    pub model: Option<String>,
    #[serde(rename = "dedicatedCPUPlacement")]
    pub dedicated_cpu_placement: Option<bool>,
    /// Refused, as the VMI's `spec.domain.cpu.numa`.
    pub numa: Option<Preserved>,
    pub isolate_emulator_thread: Option<bool>,
    /// Refused, as the VMI's `spec.domain.cpu.realtime`.
    pub realtime: Option<Preserved>,
    pub max_sockets: Option<u32>,
}

/// The instance type's memory.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryInstancetype {
    /// Guest memory; the VMI's `spec.domain.memory.guest`.
    pub guest: Quantity,
    pub hugepages: Option<crate::vmi::Hugepages>,
    /// The pod requests this much less memory than the guest has (percent).
    pub overcommit_percent: Option<i32>,
    pub max_guest: Option<Quantity>,
}

/// The `spec` of a `VirtualMachinePreference` (and of the cluster kind).
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "instancetype.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachinePreference",
    plural = "virtualmachinepreferences",
    singular = "virtualmachinepreference",
    shortname = "vmpref",
    shortname = "vmprefs",
    shortname = "vmp",
    shortname = "vmps",
    category = "all",
    namespaced,
    derive = "PartialEq",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachinePreference resource contains optional preferences related to the VirtualMachine."
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachinePreferenceSpec {
    pub clock: Option<ClockPreferences>,
    pub cpu: Option<CpuPreferences>,
    pub devices: Option<DevicePreferences>,
    pub features: Option<FeaturePreferences>,
    pub firmware: Option<FirmwarePreferences>,
    pub machine: Option<MachinePreferences>,
    /// Refused: kubevirt-rs has no DataVolume templates for a storage class to apply to.
    pub volumes: Option<Preserved>,
    pub preferred_subdomain: Option<String>,
    pub preferred_termination_grace_period_seconds: Option<i64>,
    /// What the VM must provide; checked at admission.
    pub requirements: Option<PreferenceRequirements>,
    /// Added to the VMI's annotations where it has none of that key.
    pub annotations: Option<BTreeMap<String, String>>,
    /// Deprecated form of `cpu.spreadOptions.ratio`.
    pub prefer_spread_socket_to_core_ratio: Option<u32>,
    pub preferred_architecture: Option<String>,
    /// Refused: kubevirt-rs has no SEV / TDX.
    pub preferred_launch_security: Option<Preserved>,
}

/// `VirtualMachineClusterPreference`: a cluster-wide preference.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "instancetype.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachineClusterPreference",
    plural = "virtualmachineclusterpreferences",
    singular = "virtualmachineclusterpreference",
    shortname = "vmcp",
    shortname = "vmcps",
    derive = "PartialEq",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachineClusterPreference is a cluster scoped version of the VirtualMachinePreference resource."
)]
#[serde(transparent)]
pub struct ClusterPreferenceSpec(pub VirtualMachinePreferenceSpec);

impl Deref for ClusterPreferenceSpec {
    type Target = VirtualMachinePreferenceSpec;
    fn deref(&self) -> &VirtualMachinePreferenceSpec {
        &self.0
    }
}

/// Preferred guest clock.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClockPreferences {
    pub preferred_clock_offset: Option<ClockOffset>,
    pub preferred_timer: Option<Timer>,
}

/// KubeVirt's `ClockOffset`: UTC (with an offset) or a time zone.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClockOffset {
    pub utc: Option<ClockOffsetUtc>,
    pub timezone: Option<String>,
}

/// Preferred CPU layout and features.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuPreferences {
    /// `sockets` (the default), `cores`, `threads`, `spread` or `any` (and the deprecated
    /// `prefer*` spellings).
    #[serde(rename = "preferredCPUTopology")]
    pub preferred_cpu_topology: Option<String>,
    pub spread_options: Option<SpreadOptions>,
    #[serde(rename = "preferredCPUFeatures")]
    pub preferred_cpu_features: Option<Vec<CpuFeature>>,
}

/// How `spread` lays vCPUs out.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpreadOptions {
    /// `SocketsCores` (the default), `CoresThreads` or `SocketsCoresThreads`.
    pub across: Option<String>,
    pub ratio: Option<u32>,
}

/// Preferred devices; each applies only where the VMI leaves the field unset.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DevicePreferences {
    pub preferred_autoattach_graphics_device: Option<bool>,
    pub preferred_autoattach_mem_balloon: Option<bool>,
    pub preferred_autoattach_pod_interface: Option<bool>,
    pub preferred_autoattach_serial_console: Option<bool>,
    pub preferred_autoattach_input_device: Option<bool>,
    pub preferred_disable_hotplug: Option<bool>,
    /// Refused: kubevirt-rs has no vGPUs.
    #[serde(rename = "preferredVirtualGPUOptions")]
    pub preferred_virtual_gpu_options: Option<Preserved>,
    /// Refused: kubevirt-rs has no sound devices.
    pub preferred_sound_model: Option<String>,
    pub preferred_use_virtio_transitional: Option<bool>,
    pub preferred_input_bus: Option<String>,
    pub preferred_input_type: Option<String>,
    pub preferred_disk_bus: Option<DiskBus>,
    pub preferred_lun_bus: Option<DiskBus>,
    pub preferred_cdrom_bus: Option<DiskBus>,
    pub preferred_disk_dedicated_io_thread: Option<bool>,
    pub preferred_disk_cache: Option<DiskCache>,
    #[serde(rename = "preferredDiskIO")]
    pub preferred_disk_io: Option<DiskIo>,
    /// Refused, as the VMI's disk `blockSize`.
    pub preferred_disk_block_size: Option<Preserved>,
    pub preferred_interface_model: Option<InterfaceModel>,
    pub preferred_rng: Option<crate::common::Empty>,
    pub preferred_block_multi_queue: Option<bool>,
    pub preferred_network_interface_multi_queue: Option<bool>,
    /// Refused: kubevirt-rs has no TPM.
    #[serde(rename = "preferredTPM")]
    pub preferred_tpm: Option<Preserved>,
    pub preferred_interface_masquerade: Option<crate::common::Empty>,
    /// Refused: kubevirt-rs has no panic devices.
    pub preferred_panic_device_model: Option<String>,
    pub preferred_video_type: Option<String>,
}

/// Preferred hypervisor features.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FeaturePreferences {
    pub preferred_acpi: Option<FeatureState>,
    pub preferred_apic: Option<FeatureApic>,
    /// Refused, as the VMI's Hyper-V enlightenments.
    pub preferred_hyperv: Option<Preserved>,
    pub preferred_kvm: Option<FeatureKvm>,
    pub preferred_pvspinlock: Option<FeatureState>,
    pub preferred_smm: Option<FeatureState>,
}

/// Preferred firmware.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FirmwarePreferences {
    pub preferred_use_bios: Option<bool>,
    pub preferred_use_bios_serial: Option<bool>,
    /// Deprecated for `preferredEfi`.
    pub preferred_use_efi: Option<bool>,
    /// Deprecated for `preferredEfi.secureBoot`.
    pub preferred_use_secure_boot: Option<bool>,
    pub preferred_efi: Option<Efi>,
}

/// Preferred machine type.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachinePreferences {
    pub preferred_machine_type: Option<String>,
}

/// What a VM using the preference must provide.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreferenceRequirements {
    pub cpu: Option<CpuPreferenceRequirement>,
    pub memory: Option<MemoryPreferenceRequirement>,
    pub architecture: Option<String>,
}

/// At least this many vCPUs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CpuPreferenceRequirement {
    pub guest: u32,
}

/// At least this much guest memory.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryPreferenceRequirement {
    pub guest: Quantity,
}

/// Which of the two kinds a matcher's `kind` names (KubeVirt accepts singular and plural,
/// any case; empty is the cluster kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The namespaced kind, looked up in the VM's namespace.
    Namespaced,
    /// The cluster kind.
    Cluster,
}

/// The singular resource names a matcher's `kind` may spell (KubeVirt's
/// `SingularResourceName` and friends; also the CRDs' `singular`).
pub const INSTANCETYPE_SINGULAR: &str = "virtualmachineinstancetype";
pub const CLUSTER_INSTANCETYPE_SINGULAR: &str = "virtualmachineclusterinstancetype";
pub const PREFERENCE_SINGULAR: &str = "virtualmachinepreference";
pub const CLUSTER_PREFERENCE_SINGULAR: &str = "virtualmachineclusterpreference";

/// The scope of an instance type matcher's `kind`, or KubeVirt's error for another kind.
pub fn instancetype_scope(kind: Option<&str>) -> Result<Scope, String> {
    scope(
        kind,
        INSTANCETYPE_SINGULAR,
        CLUSTER_INSTANCETYPE_SINGULAR,
        "InstancetypeMatcher",
    )
}

/// The scope of a preference matcher's `kind`, or KubeVirt's error for another kind.
pub fn preference_scope(kind: Option<&str>) -> Result<Scope, String> {
    scope(
        kind,
        PREFERENCE_SINGULAR,
        CLUSTER_PREFERENCE_SINGULAR,
        "PreferenceMatcher",
    )
}

fn scope(
    kind: Option<&str>,
    namespaced: &str,
    cluster: &str,
    matcher: &str,
) -> Result<Scope, String> {
    let k = kind.unwrap_or_default().to_lowercase();
    let is = |singular: &str| k == singular || k.strip_suffix('s') == Some(singular);
    if k.is_empty() || is(cluster) {
        Ok(Scope::Cluster)
    } else if is(namespaced) {
        Ok(Scope::Namespaced)
    } else {
        Err(format!(
            "got unexpected kind in {matcher}: {}",
            kind.unwrap_or_default()
        ))
    }
}

/// The annotation a VMI gets naming its instance type, and the one naming its preference.
pub fn annotation(scope: Scope, preference: bool) -> &'static str {
    match (scope, preference) {
        (Scope::Namespaced, false) => INSTANCETYPE_ANNOTATION,
        (Scope::Cluster, false) => CLUSTER_INSTANCETYPE_ANNOTATION,
        (Scope::Namespaced, true) => PREFERENCE_ANNOTATION,
        (Scope::Cluster, true) => CLUSTER_PREFERENCE_ANNOTATION,
    }
}

/// KubeVirt's ControllerRevision name for a VM's snapshot of an object:
/// `<vm>-<object>-<version>-<uid>-<generation>`.
pub fn revision_name(vm: &str, object: &str, uid: &str, generation: i64) -> String {
    format!("{vm}-{object}-{VERSION}-{uid}-{generation}")
}

/// KubeVirt's conflict message for a VM field the instance type also sets.
fn conflict(path: String) -> FieldError {
    let message = format!("VM field(s) {path} conflicts with selected instance type");
    FieldError { path, message }
}

fn set_bool(preferred: Option<bool>, field: &mut Option<bool>) {
    if field.is_none() {
        *field = preferred;
    }
}

fn set_if_none<T: Clone>(preferred: Option<&T>, field: &mut Option<T>) {
    if field.is_none() {
        field.clone_from(&preferred.cloned());
    }
}

/// The fields of an instance type and preference kubevirt-rs cannot honour, each by its path
/// under `instancetype.spec` / `preference.spec`.
pub fn unsupported(
    instancetype: Option<&VirtualMachineInstancetypeSpec>,
    preference: Option<&VirtualMachinePreferenceSpec>,
) -> Vec<FieldError> {
    let mut out = Vec::new();
    let mut refuse = |path: &str, set: bool| {
        if set {
            out.push(FieldError {
                path: path.to_owned(),
                message: UNSUPPORTED.to_owned(),
            });
        }
    };
    if let Some(it) = instancetype {
        refuse("instancetype.spec.gpus", it.gpus.is_some());
        refuse("instancetype.spec.hostDevices", it.host_devices.is_some());
        refuse("instancetype.spec.ioThreads", it.io_threads.is_some());
        refuse(
            "instancetype.spec.launchSecurity",
            it.launch_security.is_some(),
        );
        refuse("instancetype.spec.cpu.numa", it.cpu.numa.is_some());
        refuse("instancetype.spec.cpu.realtime", it.cpu.realtime.is_some());
    }
    if let Some(p) = preference {
        refuse("preference.spec.volumes", p.volumes.is_some());
        refuse(
            "preference.spec.preferredLaunchSecurity",
            p.preferred_launch_security.is_some(),
        );
        if let Some(d) = &p.devices {
            refuse(
                "preference.spec.devices.preferredVirtualGPUOptions",
                d.preferred_virtual_gpu_options.is_some(),
            );
            refuse(
                "preference.spec.devices.preferredSoundModel",
                d.preferred_sound_model.is_some(),
            );
            refuse(
                "preference.spec.devices.preferredDiskBlockSize",
                d.preferred_disk_block_size.is_some(),
            );
            refuse(
                "preference.spec.devices.preferredTPM",
                d.preferred_tpm.is_some(),
            );
            refuse(
                "preference.spec.devices.preferredPanicDeviceModel",
                d.preferred_panic_device_model.is_some(),
            );
        }
        if let Some(f) = &p.features {
            refuse(
                "preference.spec.features.preferredHyperv",
                f.preferred_hyperv.is_some(),
            );
        }
    }
    out
}

/// The instance type and preference a VM resolved to, to apply to a VMI spec.
#[derive(Clone, Copy, Debug, Default)]
pub struct Expansion<'a> {
    pub instancetype: Option<&'a VirtualMachineInstancetypeSpec>,
    pub preference: Option<&'a VirtualMachinePreferenceSpec>,
}

impl Expansion<'_> {
    /// KubeVirt's `ApplyToVMI`: the instance type first (every field it sets must be unset in
    /// the VMI, else a conflict naming it), then the preference (only where the VMI leaves a
    /// field unset). Nothing of the preference is applied when the instance type conflicts.
    /// `base` is the spec's path (`spec.template.spec` for a VM, `spec` for a VMI), which
    /// conflicts are reported under.
    pub fn apply(
        &self,
        base: &str,
        spec: &mut VirtualMachineInstanceSpec,
        meta: &mut ObjectMeta,
    ) -> Result<(), Vec<FieldError>> {
        let mut problems = unsupported(self.instancetype, self.preference);
        if let Some(it) = self.instancetype {
            problems.extend(self.apply_instancetype(it, base, spec, meta));
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        if let Some(p) = self.preference {
            apply_preference(p, spec, meta);
        }
        Ok(())
    }

    fn apply_instancetype(
        &self,
        it: &VirtualMachineInstancetypeSpec,
        base: &str,
        spec: &mut VirtualMachineInstanceSpec,
        meta: &mut ObjectMeta,
    ) -> Vec<FieldError> {
        let at = |rest: &str| format!("{base}.{rest}");
        let mut out = Vec::new();
        if let Some(selector) = &it.node_selector {
            if spec.node_selector.is_empty() {
                spec.node_selector.clone_from(selector);
            } else {
                out.push(conflict(at("nodeSelector")));
            }
        }
        if let Some(name) = it.scheduler_name.as_ref().filter(|n| !n.is_empty()) {
            if spec
                .scheduler_name
                .as_deref()
                .is_some_and(|s| !s.is_empty())
            {
                out.push(conflict(at("schedulerName")));
            } else {
                spec.scheduler_name = Some(name.clone());
            }
        }
        out.extend(self.apply_cpu(it, &at, spec));
        out.extend(apply_memory(it, &at, spec));
        if let Some(policy) = &it.io_threads_policy {
            if spec.domain.io_threads_policy.is_some() {
                out.push(conflict(at("domain.ioThreadsPolicy")));
            } else {
                spec.domain.io_threads_policy = Some(policy.clone());
            }
        }
        let annotations = meta.annotations.get_or_insert_default();
        for (k, v) in it.annotations.iter().flatten() {
            match annotations.get(k) {
                Some(have) if have != v => out.push(conflict(format!("annotations.{k}"))),
                Some(_) => {}
                None => {
                    annotations.insert(k.clone(), v.clone());
                }
            }
        }
        out
    }

    fn apply_cpu(
        &self,
        it: &VirtualMachineInstancetypeSpec,
        at: &dyn Fn(&str) -> String,
        spec: &mut VirtualMachineInstanceSpec,
    ) -> Vec<FieldError> {
        let mut out = Vec::new();
        for (resources, name) in [
            (&spec.domain.resources.requests, "requests"),
            (&spec.domain.resources.limits, "limits"),
        ] {
            if resources.contains_key("cpu") {
                out.push(conflict(at(&format!("domain.resources.{name}.cpu"))));
            }
        }
        let cpu = spec.domain.cpu.get_or_insert_default();
        for (value, name) in [
            (cpu.sockets, "sockets"),
            (cpu.cores, "cores"),
            (cpu.threads, "threads"),
        ] {
            if value.is_some_and(|v| v != 0) {
                out.push(conflict(at(&format!("domain.cpu.{name}"))));
            }
        }
        let c = &it.cpu;
        if cpu.model.as_deref().is_some_and(|m| !m.is_empty()) && c.model.is_some() {
            out.push(conflict(at("domain.cpu.model")));
        }
        if cpu.dedicated_cpu_placement == Some(true) && c.dedicated_cpu_placement.is_some() {
            out.push(conflict(at("domain.cpu.dedicatedCPUPlacement")));
        }
        if cpu.isolate_emulator_thread == Some(true) && c.isolate_emulator_thread.is_some() {
            out.push(conflict(at("domain.cpu.isolateEmulatorThread")));
        }
        if !out.is_empty() {
            return out;
        }
        if c.model.is_some() {
            cpu.model.clone_from(&c.model);
        }
        if c.dedicated_cpu_placement.is_some() {
            cpu.dedicated_cpu_placement = c.dedicated_cpu_placement;
        }
        if c.isolate_emulator_thread.is_some() {
            cpu.isolate_emulator_thread = c.isolate_emulator_thread;
        }
        if c.max_sockets.is_some() {
            cpu.max_sockets = c.max_sockets;
        }
        self.topology(c.guest, cpu);
        out
    }

    /// KubeVirt's `applyGuestCPUTopology`.
    fn topology(&self, vcpus: u32, cpu: &mut Cpu) {
        let (mut sockets, mut cores, mut threads) = (1, 1, 1);
        if vcpus != 1 {
            match preferred_topology(self.preference) {
                "preferCores" | "cores" => cores = vcpus,
                "preferThreads" | "threads" => threads = vcpus,
                "preferSpread" | "spread" => {
                    let (ratio, across) = spread_options(self.preference);
                    match across {
                        "CoresThreads" => {
                            threads = ratio;
                            cores = vcpus / ratio;
                        }
                        "SocketsCoresThreads" => {
                            threads = 2;
                            cores = ratio;
                            sockets = vcpus / 2 / ratio;
                        }
                        _ => {
                            cores = ratio;
                            sockets = vcpus / ratio;
                        }
                    }
                }
                _ => sockets = vcpus,
            }
        }
        cpu.sockets = Some(sockets);
        cpu.cores = Some(cores);
        cpu.threads = Some(threads);
    }
}

/// KubeVirt's `GetPreferredTopology`: `sockets` unless the preference says otherwise.
fn preferred_topology(p: Option<&VirtualMachinePreferenceSpec>) -> &str {
    p.and_then(|p| p.cpu.as_ref()?.preferred_cpu_topology.as_deref())
        .unwrap_or("sockets")
}

/// KubeVirt's `GetSpreadOptions`: ratio 2 across sockets and cores unless set.
fn spread_options(p: Option<&VirtualMachinePreferenceSpec>) -> (u32, &str) {
    let options = p.and_then(|p| p.cpu.as_ref()?.spread_options.as_ref());
    let ratio = options
        .and_then(|o| o.ratio)
        .or_else(|| p?.prefer_spread_socket_to_core_ratio.filter(|r| *r != 0))
        .unwrap_or(2);
    let across = options
        .and_then(|o| o.across.as_deref())
        .unwrap_or("SocketsCores");
    (ratio, across)
}

fn apply_memory(
    it: &VirtualMachineInstancetypeSpec,
    at: &dyn Fn(&str) -> String,
    spec: &mut VirtualMachineInstanceSpec,
) -> Vec<FieldError> {
    let memory = spec.domain.memory.get_or_insert_with(Memory::default);
    let m = &it.memory;
    let resources = &spec.domain.resources;
    let clash = if memory.guest.is_some() {
        Some("domain.memory.guest")
    } else if memory.hugepages.is_some() && m.hugepages.is_some() {
        Some("domain.memory.hugepages")
    } else if memory.max_guest.is_some() && m.max_guest.is_some() {
        Some("domain.memory.maxGuest")
    } else if resources.requests.contains_key("memory") {
        Some("domain.resources.requests.memory")
    } else if resources.limits.contains_key("memory") {
        Some("domain.resources.limits.memory")
    } else {
        None
    };
    if let Some(path) = clash {
        return vec![conflict(at(path))];
    }
    memory.guest = Some(m.guest.clone());
    if m.hugepages.is_some() {
        memory.hugepages.clone_from(&m.hugepages);
    }
    if m.max_guest.is_some() {
        memory.max_guest.clone_from(&m.max_guest);
    }
    if let Some(percent) = m.overcommit_percent.filter(|p| *p > 0) {
        let Ok(guest) = ParsedQuantity::from_quantity(&m.guest) else {
            return vec![FieldError {
                path: "instancetype.spec.memory.guest".into(),
                message: format!("not a quantity: {:?}", m.guest.0),
            }];
        };
        // KubeVirt computes this in float32; integer arithmetic gives the same bytes for
        // every size an instance type uses, without its rounding.
        let request = guest.value() * i128::from(100 - percent) / 100;
        spec.domain
            .resources
            .requests
            .insert("memory".into(), Quantity(request.to_string()));
    }
    Vec::new()
}

/// KubeVirt's preference appliers, in its order; each touches only what the VMI leaves unset.
fn apply_preference(
    p: &VirtualMachinePreferenceSpec,
    spec: &mut VirtualMachineInstanceSpec,
    meta: &mut ObjectMeta,
) {
    if let Some(features) = p
        .cpu
        .as_ref()
        .and_then(|c| c.preferred_cpu_features.as_ref())
    {
        let cpu = spec.domain.cpu.get_or_insert_default();
        for f in features {
            if !cpu.features.iter().any(|have| have.name == f.name) {
                cpu.features.push(f.clone());
            }
        }
    }
    if let Some(d) = &p.devices {
        apply_devices(d, spec);
    }
    if let Some(f) = &p.features {
        let features = spec.domain.features.get_or_insert_with(Features::default);
        if f.preferred_acpi.is_some() {
            features.acpi.clone_from(&f.preferred_acpi);
        }
        set_if_none(f.preferred_apic.as_ref(), &mut features.apic);
        set_if_none(f.preferred_kvm.as_ref(), &mut features.kvm);
        set_if_none(f.preferred_pvspinlock.as_ref(), &mut features.pvspinlock);
        set_if_none(f.preferred_smm.as_ref(), &mut features.smm);
    }
    if let Some(f) = &p.firmware {
        apply_firmware(
            f,
            spec.domain.firmware.get_or_insert_with(Firmware::default),
        );
    }
    apply_machine_type(p, spec);
    if let Some(c) = &p.clock {
        let clock = spec.domain.clock.get_or_insert_with(Clock::default);
        if let Some(offset) = &c.preferred_clock_offset
            && clock.utc.is_none()
            && clock.timezone.is_none()
        {
            clock.utc.clone_from(&offset.utc);
            clock.timezone.clone_from(&offset.timezone);
        }
        set_if_none(c.preferred_timer.as_ref(), &mut clock.timer);
    }
    if spec.subdomain.as_deref().unwrap_or_default().is_empty() && p.preferred_subdomain.is_some() {
        spec.subdomain.clone_from(&p.preferred_subdomain);
    }
    set_if_none(
        p.preferred_termination_grace_period_seconds.as_ref(),
        &mut spec.termination_grace_period_seconds,
    );
    apply_architecture(p, spec);
    let annotations = meta.annotations.get_or_insert_default();
    for (k, v) in p.annotations.iter().flatten() {
        annotations.entry(k.clone()).or_insert_with(|| v.clone());
    }
}

/// What KubeVirt's VM mutating webhook takes from the preference into the VM's own template,
/// before the VM defaults run (its `mutateArch` and `mutateMachineType`): the machine type must
/// be there before the default one would be written, and stays with the VM from then on.
pub fn apply_to_vm_template(
    p: &VirtualMachinePreferenceSpec,
    spec: &mut VirtualMachineInstanceSpec,
) {
    apply_architecture(p, spec);
    apply_machine_type(p, spec);
}

fn apply_machine_type(p: &VirtualMachinePreferenceSpec, spec: &mut VirtualMachineInstanceSpec) {
    if let Some(t) = p
        .machine
        .as_ref()
        .and_then(|m| m.preferred_machine_type.as_ref())
    {
        let machine = spec.domain.machine.get_or_insert_with(Machine::default);
        if machine
            .machine_type
            .as_deref()
            .unwrap_or_default()
            .is_empty()
        {
            machine.machine_type = Some(t.clone());
        }
    }
}

fn apply_architecture(p: &VirtualMachinePreferenceSpec, spec: &mut VirtualMachineInstanceSpec) {
    if let Some(arch) = p.preferred_architecture.as_ref().filter(|a| !a.is_empty())
        && spec.architecture.as_deref().unwrap_or_default().is_empty()
    {
        spec.architecture = Some(arch.clone());
    }
}

fn apply_devices(d: &DevicePreferences, spec: &mut VirtualMachineInstanceSpec) {
    let devices = &mut spec.domain.devices;
    set_bool(
        d.preferred_use_virtio_transitional,
        &mut devices.use_virtio_transitional,
    );
    set_bool(
        d.preferred_block_multi_queue,
        &mut devices.block_multi_queue,
    );
    set_bool(
        d.preferred_network_interface_multi_queue,
        &mut devices.network_interface_multiqueue,
    );
    if d.preferred_disable_hotplug.is_some() {
        devices.disable_hotplug = d.preferred_disable_hotplug;
    }
    set_if_none(d.preferred_rng.as_ref(), &mut devices.rng);
    if let Some(t) = &d.preferred_video_type {
        let video = devices.video.get_or_insert_default();
        if video.video_type.as_deref().unwrap_or_default().is_empty() {
            video.video_type = Some(t.clone());
        }
    }
    apply_auto_attach(d, spec);
    let devices = &mut spec.domain.devices;
    for disk in &mut devices.disks {
        if disk.disk.is_none() && disk.cdrom.is_none() && disk.lun.is_none() {
            disk.disk = Some(crate::vmi::DiskTarget::default());
        }
        if let Some(target) = &mut disk.disk {
            set_if_none(d.preferred_disk_bus.as_ref(), &mut target.bus);
            set_if_none(d.preferred_disk_cache.as_ref(), &mut disk.cache);
            set_if_none(d.preferred_disk_io.as_ref(), &mut disk.io);
            if target.bus == Some(DiskBus::Virtio) {
                set_bool(
                    d.preferred_disk_dedicated_io_thread,
                    &mut disk.dedicated_io_thread,
                );
            }
        } else if let Some(target) = &mut disk.cdrom {
            set_if_none(d.preferred_cdrom_bus.as_ref(), &mut target.bus);
        } else if let Some(target) = &mut disk.lun {
            set_if_none(d.preferred_lun_bus.as_ref(), &mut target.bus);
        }
    }
    let pod_networks: Vec<String> = spec
        .networks
        .iter()
        .filter(|n| n.pod.is_some())
        .map(|n| n.name.clone())
        .collect();
    for iface in &mut spec.domain.devices.interfaces {
        set_if_none(d.preferred_interface_model.as_ref(), &mut iface.model);
        let unbound = [
            &iface.bridge,
            &iface.slirp,
            &iface.masquerade,
            &iface.sriov,
            &iface.macvtap,
            &iface.passt,
        ]
        .iter()
        .all(|b| b.is_none())
            && iface.passt_binding.is_none()
            && iface.binding.is_none();
        if d.preferred_interface_masquerade.is_some()
            && unbound
            && pod_networks.contains(&iface.name)
        {
            iface
                .masquerade
                .clone_from(&d.preferred_interface_masquerade);
        }
    }
    for input in &mut spec.domain.devices.inputs {
        set_if_none(d.preferred_input_bus.as_ref(), &mut input.bus);
        set_if_none(d.preferred_input_type.as_ref(), &mut input.input_type);
    }
}

/// KubeVirt's `ApplyAutoAttachPreferences`.
fn apply_auto_attach(d: &DevicePreferences, spec: &mut VirtualMachineInstanceSpec) {
    let devices = &mut spec.domain.devices;
    set_bool(
        d.preferred_autoattach_graphics_device,
        &mut devices.autoattach_graphics_device,
    );
    set_bool(
        d.preferred_autoattach_mem_balloon,
        &mut devices.autoattach_mem_balloon,
    );
    set_bool(
        d.preferred_autoattach_pod_interface,
        &mut devices.autoattach_pod_interface,
    );
    set_bool(
        d.preferred_autoattach_serial_console,
        &mut devices.autoattach_serial_console,
    );
    set_bool(
        d.preferred_autoattach_input_device,
        &mut devices.autoattach_input_device,
    );
}

fn apply_firmware(f: &FirmwarePreferences, firmware: &mut Firmware) {
    let bootloader = firmware.bootloader.get_or_insert_with(Bootloader::default);
    if f.preferred_use_bios == Some(true) && bootloader.bios.is_none() && bootloader.efi.is_none() {
        bootloader.bios = Some(Bios::default());
    }
    if let Some(bios) = &mut bootloader.bios {
        set_bool(f.preferred_use_bios_serial, &mut bios.use_serial);
    }
    if bootloader.efi.is_none() && bootloader.bios.is_none() && f.preferred_efi.is_some() {
        bootloader.efi.clone_from(&f.preferred_efi);
        return;
    }
    if f.preferred_use_efi == Some(true) && bootloader.efi.is_none() && bootloader.bios.is_none() {
        bootloader.efi = Some(Efi::default());
    }
    if let Some(efi) = &mut bootloader.efi {
        set_bool(f.preferred_use_secure_boot, &mut efi.secure_boot);
    }
}

/// KubeVirt's `CheckSpreadCPUTopology`: with `spread`, the instance type's vCPUs must divide
/// by the layout.
pub fn check_spread(
    it: Option<&VirtualMachineInstancetypeSpec>,
    p: Option<&VirtualMachinePreferenceSpec>,
) -> Option<FieldError> {
    let it = it?;
    if !matches!(preferred_topology(p), "spread" | "preferSpread") {
        return None;
    }
    let (ratio, across) = spread_options(p);
    let guest = it.cpu.guest;
    let message = match across {
        "SocketsCores" if ratio == 0 || guest % ratio > 0 => format!(
            "{guest} vCPUs provided by the instance type are not divisible by the Spec.PreferSpreadSocketToCoreRatio or Spec.CPU.PreferSpreadOptions.Ratio of {ratio} provided by the preference"
        ),
        "CoresThreads" if ratio == 0 || guest % ratio > 0 => format!(
            "{guest} vCPUs provided by the instance type are not divisible by the number of threads per core {ratio}"
        ),
        "SocketsCoresThreads" if ratio == 0 || guest % 2 > 0 || (guest / 2) % ratio > 0 => {
            format!(
                "{guest} vCPUs provided by the instance type are not divisible by the number of threads per core 2 and Spec.PreferSpreadSocketToCoreRatio or Spec.CPU.PreferSpreadOptions.Ratio of {ratio}"
            )
        }
        _ => return None,
    };
    Some(FieldError {
        path: "instancetype.spec.cpu.guest".into(),
        message,
    })
}

/// KubeVirt's preference requirements check, on the defaulted VMI spec of a VM: the error
/// carries KubeVirt's message, prefixed as its admission webhook does.
pub fn check_requirements(
    it: Option<&VirtualMachineInstancetypeSpec>,
    p: Option<&VirtualMachinePreferenceSpec>,
    spec: &VirtualMachineInstanceSpec,
) -> Option<FieldError> {
    let req = p?.requirements.as_ref()?;
    let fail = |path: &str, why: String| FieldError {
        path: path.to_owned(),
        message: format!("failure checking preference requirements: {why}"),
    };
    if let Some(cpu) = &req.cpu {
        if let Some(it) = it {
            if it.cpu.guest < cpu.guest {
                return Some(fail(
                    "spec.instancetype",
                    format!(
                        "insufficient CPU resources of {} vCPU provided by instance type, preference requires {} vCPU",
                        it.cpu.guest, cpu.guest
                    ),
                ));
            }
        } else {
            let c = spec.domain.cpu.clone().unwrap_or_default();
            let (s, co, t) = (
                c.sockets.unwrap_or(0),
                c.cores.unwrap_or(0),
                c.threads.unwrap_or(0),
            );
            let (have, what) = match preferred_topology(p) {
                "preferThreads" | "threads" => (t, "threads".to_owned()),
                "preferCores" | "cores" => (co, "cores".to_owned()),
                "preferSpread" | "spread" => match spread_options(p).1 {
                    "CoresThreads" => (co * t, "CoresThreads".to_owned()),
                    "SocketsCoresThreads" => (s * co * t, "SocketsCoresThreads".to_owned()),
                    _ => (s * co, "SocketsCores".to_owned()),
                },
                "preferAny" | "any" => (s * co * t, "cores, sockets and threads".to_owned()),
                _ => (s, "sockets".to_owned()),
            };
            if have < cpu.guest {
                return Some(fail(
                    "spec.template.spec.domain.cpu",
                    format!(
                        "insufficient CPU resources of {have} vCPU provided by VirtualMachine, preference requires {} vCPU provided as {what}",
                        cpu.guest
                    ),
                ));
            }
        }
    }
    if let Some(mem) = &req.memory {
        let provided = spec
            .domain
            .memory
            .as_ref()
            .and_then(|m| m.guest.clone())
            .or_else(|| it.map(|it| it.memory.guest.clone()))
            .unwrap_or_else(|| Quantity("0Mi".into()));
        let bytes = |q: &Quantity| ParsedQuantity::from_quantity(q).map(ParsedQuantity::value);
        if let (Ok(have), Ok(want)) = (bytes(&provided), bytes(&mem.guest))
            && have < want
        {
            let (path, by) = if it.is_some() {
                ("spec.instancetype", "instance type")
            } else {
                ("spec.template.spec.domain.memory", "VirtualMachine")
            };
            return Some(fail(
                path,
                format!(
                    "insufficient Memory resources of {} provided by {by}, preference requires {}",
                    provided.0, mem.guest.0
                ),
            ));
        }
    }
    if let Some(arch) = &req.architecture
        && spec.architecture.as_deref().unwrap_or_default() != arch
    {
        return Some(fail(
            "spec.template.spec.architecture",
            format!(
                "preference requires architecture {arch} but {} is being requested",
                spec.architecture.as_deref().unwrap_or_default()
            ),
        ));
    }
    None
}
