//! The defaults KubeVirt's mutating webhook writes into a new VMI (`pkg/defaults`,
//! `SetObjectDefaults_VirtualMachineInstance`, the VMI and VM mutators), as pure functions.
//!
//! Deliberate differences, all documented in `docs/api.md`:
//! - `firmware.uuid`: KubeVirt draws a random UUID; [`apply`] leaves it unset and
//!   [`apply_vmi`] uses the VMI's `metadata.uid`, so the result is a function of its input.
//! - Only amd64 defaults are implemented (the architecture kubevirt-rs runs on).
//! - Hyper-V feature dependencies are not defaulted: Hyper-V features are refused by validation.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::common::{Empty, PullPolicy};
use crate::config::{ClusterConfig, DefaultNetworkInterface};
use crate::quantity::ParsedQuantity;
use crate::status::{CpuTopology, MemoryStatus, VirtualMachineInstancePhase};
use crate::vm::VirtualMachine;
use crate::vmi::{
    Cpu, DiskBus, DiskTarget, FeatureState, Features, Firmware, Interface, Machine, Memory,
    Network, PodNetwork, Probe, VirtualMachineInstance, VirtualMachineInstanceSpec,
};

/// Why a VMI cannot be defaulted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DefaultsError {
    /// The cluster's default interface is bridge, but bridge on the pod network is disabled.
    #[error("bridge interface is not enabled in kubevirt-config")]
    BridgeNotPermitted,
    /// The cluster's default interface is the discontinued slirp binding.
    #[error("slirp interface is deprecated as of v1.3")]
    SlirpDiscontinued,
}

/// Name of the default pod network and interface.
pub const DEFAULT_NETWORK_NAME: &str = "default";
/// The CPU model used when neither the VMI nor the cluster names one.
pub const DEFAULT_CPU_MODEL: &str = "host-model";
/// KubeVirt's `DefaultObsoleteCPUModels`: models the node labeller does not offer unless the
/// KubeVirt CR's `obsoleteCPUModels` says otherwise.
pub const OBSOLETE_CPU_MODELS: [&str; 34] = [
    "486",
    "486-v1",
    "pentium",
    "pentium-v1",
    "pentium2",
    "pentium2-v1",
    "pentium3",
    "pentium3-v1",
    "pentiumpro",
    "pentiumpro-v1",
    "coreduo",
    "coreduo-v1",
    "n270",
    "n270-v1",
    "core2duo",
    "core2duo-v1",
    "Conroe",
    "Conroe-v1",
    "athlon",
    "athlon-v1",
    "phenom",
    "phenom-v1",
    "qemu64",
    "qemu64-v1",
    "qemu32",
    "qemu32-v1",
    "kvm64",
    "kvm64-v1",
    "kvm32",
    "kvm32-v1",
    "Opteron_G1",
    "Opteron_G1-v1",
    "Opteron_G2",
    "Opteron_G2-v1",
];
/// Finalizer KubeVirt puts on every VMI.
pub const VMI_FINALIZER: &str = "kubevirt.io/foregroundDeleteVirtualMachine";
/// Annotation recording the PCI topology a VMI was created with.
pub const PCI_TOPOLOGY_VERSION_ANNOTATION: &str = "kubevirt.io/pci-topology-version";
/// The PCI topology version new VMIs get (PCIe root ports for hotplug).
pub const PCI_TOPOLOGY_VERSION: &str = "v3";
/// UID QEMU runs as when the `Root` feature gate is off.
pub const NON_ROOT_UID: u64 = 107;
/// Upper bound of vCPUs when defaulting `maxSockets`.
const MAX_HOTPLUG_VCPUS: u32 = 512;
/// Memory hotplug needs at least this much guest memory.
const MIN_HOTPLUG_GUEST_MEMORY: i128 = 1 << 30;

/// Apply KubeVirt's defaults to a VMI spec (or a VMI template's spec).
pub fn apply(
    spec: &mut VirtualMachineInstanceSpec,
    cfg: &ClusterConfig,
) -> Result<(), DefaultsError> {
    // SetDefaultVirtualMachineInstanceSpec
    if spec.architecture.as_deref().is_none_or(str::is_empty) {
        spec.architecture = Some(cfg.default_architecture.clone());
    }
    set_machine_type(spec, cfg);
    set_resource_requests(spec, cfg);
    set_guest_memory(spec);
    set_cpu_topology(spec);
    set_pull_policies(spec);
    if spec.eviction_strategy.is_none() {
        spec.eviction_strategy = Some(cfg.eviction_strategy.clone());
    }
    set_default_network(spec, cfg)?;
    set_volume_disks(spec);

    // SetObjectDefaults_VirtualMachineInstance
    spec.domain.firmware.get_or_insert_with(Firmware::default);
    set_feature_defaults(spec.domain.features.get_or_insert_with(Features::default));
    set_timer_defaults(spec);
    for disk in &mut spec.domain.devices.disks {
        if disk.targets_set().is_empty() {
            disk.disk = Some(DiskTarget::default());
        }
        if let Some(cdrom) = &mut disk.cdrom {
            cdrom.readonly.get_or_insert(true);
            cdrom.tray.get_or_insert_with(|| "closed".to_owned());
        }
    }
    for input in &mut spec.domain.devices.inputs {
        input.bus.get_or_insert_with(|| "usb".to_owned());
        input.input_type.get_or_insert_with(|| "tablet".to_owned());
    }
    for probe in [&mut spec.liveness_probe, &mut spec.readiness_probe]
        .into_iter()
        .flatten()
    {
        set_probe_defaults(probe);
    }

    // setDefaultCPUArch: amd64
    for disk in &mut spec.domain.devices.disks {
        // SATA, not virtio: KubeVirt picks the bus every x86 guest OS can boot from.
        if let Some(t) = &mut disk.disk {
            t.bus.get_or_insert(DiskBus::Sata);
        }
        if let Some(t) = &mut disk.cdrom {
            t.bus.get_or_insert(DiskBus::Sata);
        }
        if let Some(t) = &mut disk.lun {
            t.bus.get_or_insert(DiskBus::Sata);
        }
    }
    if let Some(w) = &mut spec.domain.devices.watchdog
        && w.diag288.is_none()
    {
        w.i6300esb
            .get_or_insert_with(Default::default)
            .action
            .get_or_insert_with(|| "reset".to_owned());
    }
    let cpu = spec.domain.cpu.get_or_insert_with(Cpu::default);
    if cpu.model.as_deref().is_none_or(str::is_empty) {
        cpu.model = Some(
            cfg.cpu_model
                .clone()
                .unwrap_or_else(|| DEFAULT_CPU_MODEL.to_owned()),
        );
    }

    if cfg.vm_rollout_live_update {
        set_cpu_hotplug(spec, cfg);
        set_memory_hotplug(spec, cfg);
    }
    Ok(())
}

/// Apply [`apply`] to a whole VMI plus the metadata and status KubeVirt's VMI mutator sets on
/// create: finalizer, `Pending` phase, guest memory and CPU topology status, the non-root UID.
pub fn apply_vmi(
    vmi: &mut VirtualMachineInstance,
    cfg: &ClusterConfig,
) -> Result<(), DefaultsError> {
    apply(&mut vmi.spec, cfg)?;
    if let (Some(fw), Some(uid)) = (&mut vmi.spec.domain.firmware, &vmi.metadata.uid)
        && fw.uuid.as_deref().is_none_or(str::is_empty)
    {
        fw.uuid = Some(uid.clone());
    }
    if supports_pcie_hotplug(&vmi.spec) {
        set_pci_topology_version(&mut vmi.metadata);
    }
    let finalizers = vmi.metadata.finalizers.get_or_insert_with(Vec::new);
    if !finalizers.iter().any(|f| f == VMI_FINALIZER) {
        finalizers.push(VMI_FINALIZER.to_owned());
    }
    let spec = &vmi.spec;
    let status = vmi.status.get_or_insert_with(Default::default);
    if let Some(guest) = spec.domain.memory.as_ref().and_then(|m| m.guest.clone()) {
        status.memory = Some(MemoryStatus {
            guest_at_boot: Some(guest.clone()),
            guest_current: Some(guest.clone()),
            guest_requested: Some(guest),
            memory_overhead: None,
        });
    }
    if let (Some(cpu), None) = (&spec.domain.cpu, &status.current_cpu_topology) {
        status.current_cpu_topology = Some(CpuTopology {
            cores: cpu.cores,
            sockets: cpu.sockets,
            threads: cpu.threads,
        });
    }
    if !cfg.has_feature_gate("Root") {
        status.runtime_user = Some(NON_ROOT_UID);
    }
    status
        .phase
        .get_or_insert(VirtualMachineInstancePhase::Pending);
    Ok(())
}

/// The VM mutator: architecture and machine type of the template.
pub fn apply_vm(vm: &mut VirtualMachine, cfg: &ClusterConfig) {
    let Some(spec) = &mut vm.spec.template.spec else {
        return;
    };
    if spec.architecture.as_deref().is_none_or(str::is_empty) {
        spec.architecture = Some(cfg.default_architecture.clone());
    }
    set_machine_type(spec, cfg);
}

/// The VM mutator on create: [`apply_vm`], plus a firmware UUID and serial for the template
/// when it has none (KubeVirt draws random ones; `new_id` supplies them so this stays a pure
/// function of its inputs) and the PCI topology annotation.
pub fn apply_vm_create(
    vm: &mut VirtualMachine,
    cfg: &ClusterConfig,
    new_id: &mut dyn FnMut() -> String,
) {
    apply_vm(vm, cfg);
    let template = &mut vm.spec.template;
    let Some(spec) = &mut template.spec else {
        return;
    };
    let fw = spec.domain.firmware.get_or_insert_with(Firmware::default);
    if fw.uuid.as_deref().is_none_or(str::is_empty) {
        fw.uuid = Some(new_id());
    }
    if fw.serial.as_deref().is_none_or(str::is_empty) {
        fw.serial = Some(new_id());
    }
    if supports_pcie_hotplug(spec) {
        set_pci_topology_version(template.metadata.get_or_insert_with(Default::default));
    }
}

/// KubeVirt's `SupportsPCIeHotplug`: amd64 / arm64 with a PCIe machine type (q35, virt).
pub fn supports_pcie_hotplug(spec: &VirtualMachineInstanceSpec) -> bool {
    if !matches!(
        spec.architecture.as_deref(),
        None | Some("" | "amd64" | "arm64")
    ) {
        return false;
    }
    spec.domain
        .machine
        .as_ref()
        .and_then(|m| m.machine_type.as_deref())
        .is_none_or(|t| t.contains("q35") || t.starts_with("virt"))
}

fn set_pci_topology_version(meta: &mut ObjectMeta) {
    meta.annotations
        .get_or_insert_with(Default::default)
        .entry(PCI_TOPOLOGY_VERSION_ANNOTATION.to_owned())
        .or_insert_with(|| PCI_TOPOLOGY_VERSION.to_owned());
}

fn set_machine_type(spec: &mut VirtualMachineInstanceSpec, cfg: &ClusterConfig) {
    let machine = spec.domain.machine.get_or_insert_with(Machine::default);
    if machine.machine_type.as_deref().is_none_or(str::is_empty) {
        machine.machine_type = Some(cfg.machine_type.clone());
    }
}

fn parsed(q: Option<&Quantity>) -> Option<ParsedQuantity> {
    q.and_then(|q| ParsedQuantity::from_quantity(q).ok())
}

fn nonzero(q: Option<&Quantity>) -> bool {
    parsed(q).is_some_and(|p| !p.is_zero())
}

fn set_resource_requests(spec: &mut VirtualMachineInstanceSpec, cfg: &ClusterConfig) {
    let dedicated = spec
        .domain
        .cpu
        .as_ref()
        .and_then(|c| c.dedicated_cpu_placement)
        .unwrap_or(false);
    let res = &mut spec.domain.resources;
    if nonzero(res.limits.get("cpu")) && !nonzero(res.requests.get("cpu")) {
        let limit = res.limits["cpu"].clone();
        res.requests.insert("cpu".to_owned(), limit);
    }
    // KubeVirt adds the cluster CPU request only when it differs from its built-in 100m (the
    // built-in one is added to the launcher pod, not to the VMI).
    let builtin = ParsedQuantity::parse(crate::config::DEFAULT_CPU_REQUEST).ok();
    if ParsedQuantity::from_quantity(&cfg.cpu_request).ok() != builtin
        && !res.requests.contains_key("cpu")
        && !dedicated
    {
        res.requests
            .insert("cpu".to_owned(), cfg.cpu_request.clone());
    }
}

fn set_guest_memory(spec: &mut VirtualMachineInstanceSpec) {
    let res = &spec.domain.resources;
    let from_resources = [res.requests.get("memory"), res.limits.get("memory")]
        .into_iter()
        .find(|q| nonzero(*q))
        .flatten()
        .cloned();
    let memory = spec.domain.memory.get_or_insert_with(Memory::default);
    if memory.guest.is_some() {
        return;
    }
    memory.guest = from_resources.or_else(|| {
        let page = memory.hugepages.as_ref()?.page_size.clone()?;
        ParsedQuantity::parse(&page).ok().map(|_| Quantity(page))
    });
}

fn set_cpu_topology(spec: &mut VirtualMachineInstanceSpec) {
    let unset = spec.domain.cpu.as_ref().is_none_or(|c| {
        c.cores.unwrap_or(0) == 0 && c.sockets.unwrap_or(0) == 0 && c.threads.unwrap_or(0) == 0
    });
    if !unset {
        return;
    }
    // Sockets rather than cores, as KubeVirt: it performs best (rhbz#1653453).
    let res = &spec.domain.resources;
    let sockets = parsed(res.limits.get("cpu"))
        .or_else(|| parsed(res.requests.get("cpu")))
        .map_or(1, |p| u32::try_from(p.value()).unwrap_or(u32::MAX));
    let cpu = spec.domain.cpu.get_or_insert_with(Cpu::default);
    cpu.sockets = Some(sockets);
    cpu.cores = Some(1);
    cpu.threads = Some(1);
}

fn set_pull_policies(spec: &mut VirtualMachineInstanceSpec) {
    for cd in spec
        .volumes
        .iter_mut()
        .filter_map(|v| v.container_disk.as_mut())
    {
        if cd.image_pull_policy.is_none() {
            cd.image_pull_policy = Some(pull_policy_for(&cd.image));
        }
    }
}

/// Kubernetes' rule: `Always` for `:latest` or untagged images, `IfNotPresent` otherwise.
pub fn pull_policy_for(image: &str) -> PullPolicy {
    if image.ends_with(":latest") || !image.contains([':', '@']) {
        PullPolicy::Always
    } else {
        PullPolicy::IfNotPresent
    }
}

fn set_default_network(
    spec: &mut VirtualMachineInstanceSpec,
    cfg: &ClusterConfig,
) -> Result<(), DefaultsError> {
    if spec.domain.devices.autoattach_pod_interface == Some(false) {
        return Ok(());
    }
    if !spec.networks.is_empty() || !spec.domain.devices.interfaces.is_empty() {
        return Ok(());
    }
    let mut iface = Interface {
        name: DEFAULT_NETWORK_NAME.to_owned(),
        ..Interface::default()
    };
    match cfg.default_network_interface {
        DefaultNetworkInterface::Bridge => {
            if !cfg.permit_bridge_interface_on_pod_network {
                return Err(DefaultsError::BridgeNotPermitted);
            }
            iface.bridge = Some(Empty {});
        }
        DefaultNetworkInterface::Masquerade => iface.masquerade = Some(Empty {}),
        DefaultNetworkInterface::Slirp => return Err(DefaultsError::SlirpDiscontinued),
    }
    spec.domain.devices.interfaces = vec![iface];
    spec.networks = vec![Network {
        name: DEFAULT_NETWORK_NAME.to_owned(),
        pod: Some(PodNetwork::default()),
        ..Network::default()
    }];
    Ok(())
}

/// Every volume neither a disk nor a filesystem uses becomes a disk (KubeVirt's
/// `SetDefaultVolumeDisk`).
fn set_volume_disks(spec: &mut VirtualMachineInstanceSpec) {
    let devices = &mut spec.domain.devices;
    for volume in &spec.volumes {
        let used = devices.disks.iter().any(|d| d.name == volume.name)
            || devices.filesystems.iter().any(|f| f.name == volume.name);
        if !used {
            devices.disks.push(crate::vmi::Disk {
                name: volume.name.clone(),
                ..Default::default()
            });
        }
    }
}

fn enable(state: &mut FeatureState) {
    state.enabled.get_or_insert(true);
}

fn set_feature_defaults(features: &mut Features) {
    enable(features.acpi.get_or_insert_with(FeatureState::default));
    if let Some(apic) = &mut features.apic {
        apic.enabled.get_or_insert(true);
    }
    if let Some(smm) = &mut features.smm {
        enable(smm);
    }
    if let Some(p) = &mut features.pvspinlock {
        enable(p);
    }
}

fn set_timer_defaults(spec: &mut VirtualMachineInstanceSpec) {
    let Some(timer) = spec.domain.clock.as_mut().and_then(|c| c.timer.as_mut()) else {
        return;
    };
    let presences = [
        timer.hpet.as_mut().map(|t| &mut t.present),
        timer.kvm.as_mut().map(|t| &mut t.present),
        timer.pit.as_mut().map(|t| &mut t.present),
        timer.rtc.as_mut().map(|t| &mut t.present),
        timer.hyperv.as_mut().map(|t| &mut t.present),
    ];
    for present in presences.into_iter().flatten() {
        present.get_or_insert(true);
    }
}

/// KubeVirt's `SetDefaults_Probe`, which its pod renderer applies again to the probes it
/// copies onto the launcher pod.
pub fn set_probe_defaults(probe: &mut Probe) {
    let at_least = |v: &mut Option<i32>, d: i32| {
        if v.is_none_or(|x| x < 1) {
            *v = Some(d);
        }
    };
    at_least(&mut probe.timeout_seconds, 1);
    at_least(&mut probe.period_seconds, 10);
    at_least(&mut probe.success_threshold, 1);
    at_least(&mut probe.failure_threshold, 3);
}

fn set_cpu_hotplug(spec: &mut VirtualMachineInstanceSpec, cfg: &ClusterConfig) {
    let cpu = spec.domain.cpu.get_or_insert_with(Cpu::default);
    if cpu.max_sockets.unwrap_or(0) != 0 {
        return;
    }
    let sockets = cpu.sockets.unwrap_or(0);
    let mut max = cfg.max_cpu_sockets.unwrap_or(0);
    if max != 0 && sockets > max {
        max = sockets;
    }
    if max == 0 {
        max = sockets.saturating_mul(cfg.max_hotplug_ratio);
        let per_socket = cpu
            .cores
            .unwrap_or(0)
            .saturating_mul(cpu.threads.unwrap_or(0));
        if per_socket != 0 && max.saturating_mul(per_socket) > MAX_HOTPLUG_VCPUS {
            max = (MAX_HOTPLUG_VCPUS / per_socket).max(sockets);
        }
    }
    // KubeVirt's zero means "no hotplug" and is omitted from the JSON.
    if max != 0 {
        cpu.max_sockets = Some(max);
    }
}

fn set_memory_hotplug(spec: &mut VirtualMachineInstanceSpec, cfg: &ClusterConfig) {
    let Some(memory) = &spec.domain.memory else {
        return;
    };
    if memory.max_guest.is_some() {
        return;
    }
    let guest = parsed(memory.guest.as_ref());
    let max_guest = match (&cfg.max_guest, guest) {
        (Some(q), _) => Some(q.clone()),
        (None, Some(g)) => Some(Quantity(crate::quantity::format_binary_si(
            g.value().saturating_mul(i128::from(cfg.max_hotplug_ratio)),
        ))),
        (None, None) => None,
    };
    if let Some(max) = max_guest
        && memory_hotplug_possible(spec, &max)
        && let Some(memory) = &mut spec.domain.memory
    {
        memory.max_guest = Some(max);
    }
}

/// KubeVirt's `ValidateLiveUpdateMemory`: when memory hotplug is compatible with the VMI.
fn memory_hotplug_possible(spec: &VirtualMachineInstanceSpec, max_guest: &Quantity) -> bool {
    let domain = &spec.domain;
    if domain
        .cpu
        .as_ref()
        .is_some_and(|c| c.realtime.is_some() || c.numa.is_some())
    {
        return false;
    }
    if domain.launch_security.is_some() {
        return false;
    }
    let Some(memory) = &domain.memory else {
        return false;
    };
    let block: i128 = if memory
        .hugepages
        .as_ref()
        .and_then(|h| h.page_size.as_deref())
        == Some("1Gi")
    {
        1 << 30
    } else {
        2 << 20
    };
    let (Some(guest), Some(max)) = (parsed(memory.guest.as_ref()), parsed(Some(max_guest))) else {
        return false;
    };
    guest <= max
        && guest.value() % block == 0
        && max.value() % block == 0
        && spec.architecture.as_deref() == Some("amd64")
        && guest.value() >= MIN_HOTPLUG_GUEST_MEMORY
}
