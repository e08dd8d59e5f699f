//! Validation of VMIs, VMs, ReplicaSets and migrations as pure functions that return every
//! problem at once, each with its field path (`spec.domain.devices.disks[1].name: no volume
//! named "x"`).
//!
//! The rules follow KubeVirt's admitters (`pkg/virt-api/webhooks/validating-webhook/admitters`,
//! `pkg/network/admitter`) and are meant to run on a defaulted spec, as KubeVirt runs them after
//! its mutating webhook. On top of them, every KubeVirt feature kubevirt-rs does not implement is
//! refused with [`UNSUPPORTED`], naming the field, instead of being dropped silently.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::common::Preserved;
use crate::config::ClusterConfig;
use crate::migration::VirtualMachineInstanceMigration;
use crate::quantity::ParsedQuantity;
use crate::replicaset::VirtualMachineInstanceReplicaSet;
use crate::vm::VirtualMachine;
use crate::vmi::{
    CloudInitNoCloudSource, DiskBus, DiskCache, DiskIo, Interface, InterfaceBinding, NetworkSource,
    VirtualMachineInstance, VirtualMachineInstanceSpec, VolumeSource,
};

/// The CPU model name that makes QEMU's `-cpu` print its list of models and exit (found by
/// fuzzing the launcher's argv); refused by admission and the launcher.
pub const QEMU_HELP_MODEL: &str = "help";
/// Why [`QEMU_HELP_MODEL`] is refused.
pub const NOT_A_CPU_MODEL: &str =
    "\"help\" asks QEMU for its list of CPU models; it is not a model";

/// The message for a KubeVirt feature kubevirt-rs does not implement.
pub const UNSUPPORTED: &str = "not supported by kubevirt-rs yet";

/// One problem, at one field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted JSON path, e.g. `spec.domain.devices.disks[1].name`.
    pub path: String,
    /// What is wrong there.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem found, in a displayable bundle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct ValidationErrors(pub Vec<FieldError>);

impl ValidationErrors {
    /// `Ok` when there is nothing to report.
    pub fn into_result(errors: Vec<FieldError>) -> Result<(), Self> {
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Self(errors))
        }
    }
}

/// Collects errors under a base path.
struct Errors {
    out: Vec<FieldError>,
}

impl Errors {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(FieldError {
            path: path.into(),
            message: message.into(),
        });
    }

    fn unsupported<T>(&mut self, path: impl Into<String>, value: Option<&T>) {
        if value.is_some() {
            self.add(path, UNSUPPORTED);
        }
    }

    fn unsupported_true(&mut self, path: impl Into<String>, value: Option<bool>) {
        if value == Some(true) {
            self.add(path, UNSUPPORTED);
        }
    }

    fn unsupported_false(&mut self, path: impl Into<String>, value: Option<bool>) {
        if value == Some(false) {
            self.add(path, format!("false: {UNSUPPORTED}"));
        }
    }

    fn quantity(&mut self, path: impl Into<String>, q: &Quantity) -> Option<ParsedQuantity> {
        match ParsedQuantity::from_quantity(q) {
            Ok(p) if p.is_negative() => {
                self.add(path, format!("{:?} must not be negative", q.0));
                None
            }
            Ok(p) => Some(p),
            Err(e) => {
                self.add(path, e.to_string());
                None
            }
        }
    }
}

/// Validate a VMI (its spec at `spec`).
pub fn validate_vmi(vmi: &VirtualMachineInstance, cfg: &ClusterConfig) -> Vec<FieldError> {
    validate_spec(&vmi.spec, cfg, "spec")
}

/// Validate a VMI spec found at `base` (e.g. `spec` or `spec.template.spec`).
pub fn validate_spec(
    spec: &VirtualMachineInstanceSpec,
    cfg: &ClusterConfig,
    base: &str,
) -> Vec<FieldError> {
    let mut e = Errors { out: Vec::new() };
    if let Some(path) = serde_json::to_value(spec)
        .ok()
        .and_then(|v| nul_byte_at(&v, base))
    {
        e.add(path, NUL_BYTE);
    }
    unsupported_fields(spec, base, &mut e);
    scheduling(spec, base, &mut e);
    resources(spec, base, &mut e);
    cpu(spec, base, &mut e);
    firmware(spec, base, &mut e);
    devices(spec, base, &mut e);
    filesystems(spec, cfg, base, &mut e);
    volumes(spec, cfg, base, &mut e);
    networks(spec, cfg, base, &mut e);
    boot_order(spec, base, &mut e);
    pci_placement(spec, base, &mut e);
    e.out
}

/// Validate a VM: run strategy and its template.
pub fn validate_vm(vm: &VirtualMachine, cfg: &ClusterConfig) -> Vec<FieldError> {
    let mut e = Errors { out: Vec::new() };
    let spec = &vm.spec;
    if spec.running.is_some() && spec.run_strategy.is_some() {
        e.add(
            "spec.running",
            "running and runStrategy are mutually exclusive; use runStrategy",
        );
    }
    if let Some(s) = &spec.run_strategy {
        if !s.is_known() {
            e.add(
                "spec.runStrategy",
                format!(
                    "unknown run strategy {:?} (one of {:?})",
                    s.as_str(),
                    crate::vm::RunStrategy::KNOWN
                ),
            );
        } else if *s == crate::vm::RunStrategy::WaitAsReceiver {
            e.add("spec.runStrategy", format!("WaitAsReceiver: {UNSUPPORTED}"));
        }
    }
    for (field, matcher) in [
        ("instancetype", &spec.instancetype),
        ("preference", &spec.preference),
    ] {
        let Some(m) = matcher else { continue };
        let path = format!("spec.{field}");
        let scope = if field == "instancetype" {
            crate::instancetype::instancetype_scope(m.kind.as_deref())
        } else {
            crate::instancetype::preference_scope(m.kind.as_deref())
        };
        if let Err(msg) = scope {
            e.add(format!("{path}.kind"), msg);
        }
        e.unsupported(
            format!("{path}.inferFromVolume"),
            m.infer_from_volume.as_ref(),
        );
        e.unsupported(
            format!("{path}.inferFromVolumeFailurePolicy"),
            m.infer_from_volume_failure_policy.as_ref(),
        );
        if m.name.as_deref().unwrap_or_default().is_empty() && m.infer_from_volume.is_none() {
            let kind = if field == "instancetype" {
                "InstancetypeMatcher"
            } else {
                "PreferenceMatcher"
            };
            e.add(
                path,
                format!("Either Name or InferFromVolume should be provided within the {kind}"),
            );
        }
    }
    if spec.data_volume_templates.as_ref().is_some_and(non_empty) {
        e.add("spec.dataVolumeTemplates", UNSUPPORTED);
    }
    match &spec.template.spec {
        Some(t) => e.out.extend(validate_spec(t, cfg, "spec.template.spec")),
        None => e.add("spec.template.spec", "required"),
    }
    e.out
}

/// Validate a ReplicaSet: replicas, selector against the template's labels, the template.
pub fn validate_replicaset(
    rs: &VirtualMachineInstanceReplicaSet,
    cfg: &ClusterConfig,
) -> Vec<FieldError> {
    let mut e = Errors { out: Vec::new() };
    let spec = &rs.spec;
    if spec.replicas.is_some_and(|r| r < 0) {
        e.add("spec.replicas", "must be greater than or equal to 0");
    }
    let labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    let sel = &spec.selector;
    if sel.match_labels.as_ref().is_none_or(BTreeMap::is_empty)
        && sel.match_expressions.as_ref().is_none_or(Vec::is_empty)
    {
        e.add("spec.selector", "must select at least one label");
    }
    for (k, v) in sel.match_labels.iter().flatten() {
        if labels.get(k) != Some(v) {
            e.add(
                "spec.selector.matchLabels",
                format!(
                    "{k}={v} does not match the template's labels (spec.template.metadata.labels)"
                ),
            );
        }
    }
    if sel
        .match_expressions
        .as_ref()
        .is_some_and(|m| !m.is_empty())
    {
        e.add("spec.selector.matchExpressions", UNSUPPORTED);
    }
    match &spec.template.spec {
        Some(t) => e.out.extend(validate_spec(t, cfg, "spec.template.spec")),
        None => e.add("spec.template.spec", "required"),
    }
    e.out
}

/// Validate a migration request.
pub fn validate_migration(m: &VirtualMachineInstanceMigration) -> Vec<FieldError> {
    let mut e = Errors { out: Vec::new() };
    if m.spec.vmi_name.as_deref().is_none_or(str::is_empty) {
        e.add("spec.vmiName", "required");
    }
    e.unsupported("spec.receive", m.spec.receive.as_ref());
    e.unsupported("spec.sendTo", m.spec.send_to.as_ref());
    e.out
}

fn list(p: Option<&Preserved>) -> Option<&Preserved> {
    p.filter(|p| non_empty(p))
}

fn non_empty(p: &Preserved) -> bool {
    match &p.0 {
        serde_json::Value::Null => false,
        serde_json::Value::Array(a) => !a.is_empty(),
        serde_json::Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}

fn unsupported_fields(spec: &VirtualMachineInstanceSpec, base: &str, e: &mut Errors) {
    let d = &spec.domain;
    let dev = &d.devices;
    e.unsupported(
        format!("{base}.accessCredentials"),
        list(spec.access_credentials.as_ref()),
    );
    e.unsupported(
        format!("{base}.resourceClaims"),
        list(spec.resource_claims.as_ref()),
    );
    e.unsupported(
        format!("{base}.utilityVolumes"),
        list(spec.utility_volumes.as_ref()),
    );
    e.unsupported(format!("{base}.domain.ioThreads"), d.io_threads.as_ref());
    match d.io_threads_policy.as_deref() {
        None | Some("shared" | "auto") => {}
        // Spreads each disk's queues over a pool: QEMU 7.2 has no iothread-vq-mapping.
        Some("supplementalPool") => e.add(
            format!("{base}.domain.ioThreadsPolicy"),
            format!("supplementalPool: {UNSUPPORTED}"),
        ),
        Some(p) => e.add(
            format!("{base}.domain.ioThreadsPolicy"),
            format!("unknown IOThreads policy {p:?} (shared, auto, supplementalPool)"),
        ),
    }
    e.unsupported(format!("{base}.domain.chassis"), d.chassis.as_ref());
    e.unsupported(
        format!("{base}.domain.launchSecurity"),
        d.launch_security.as_ref(),
    );
    if let Some(p) = d.reboot_policy.as_deref().filter(|p| *p != "Reboot") {
        if p == "Terminate" {
            e.add(
                format!("{base}.domain.rebootPolicy"),
                format!("Terminate: {UNSUPPORTED}"),
            );
        } else {
            e.add(
                format!("{base}.domain.rebootPolicy"),
                format!("unknown reboot policy {p:?} (Reboot or Terminate)"),
            );
        }
    }
    if let Some(cpu) = &d.cpu {
        let path = format!("{base}.domain.cpu");
        e.unsupported(format!("{path}.numa"), cpu.numa.as_ref());
        e.unsupported(format!("{path}.realtime"), cpu.realtime.as_ref());
    }
    if let Some(m) = &d.memory {
        e.unsupported(
            format!("{base}.domain.memory.reservedOverhead"),
            m.reserved_overhead.as_ref(),
        );
    }
    if let Some(f) = &d.firmware {
        let path = format!("{base}.domain.firmware");
        e.unsupported(format!("{path}.acpi"), f.acpi.as_ref());
    }
    if let Some(f) = &d.features {
        let path = format!("{base}.domain.features");
        e.unsupported(format!("{path}.hyperv"), f.hyperv.as_ref());
        e.unsupported(
            format!("{path}.hypervPassthrough"),
            f.hyperv_passthrough.as_ref(),
        );
        // KubeVirt admits these and they do nothing: it drops endOfInterrupt, and libvirt's QEMU
        // driver builds nothing from a missing <apic/>, so the guest keeps its APIC.
        let apic = f.apic.as_ref();
        e.unsupported_false(format!("{path}.apic.enabled"), apic.and_then(|a| a.enabled));
        e.unsupported_true(
            format!("{path}.apic.endOfInterrupt"),
            apic.and_then(|a| a.end_of_interrupt),
        );
    }
    if let Some(c) = &d.clock {
        clock(c, &format!("{base}.domain.clock"), e);
    }
    let devices = format!("{base}.domain.devices");
    e.unsupported(format!("{devices}.gpus"), list(dev.gpus.as_ref()));
    e.unsupported(
        format!("{devices}.hostDevices"),
        list(dev.host_devices.as_ref()),
    );
    e.unsupported(
        format!("{devices}.panicDevices"),
        list(dev.panic_devices.as_ref()),
    );
    e.unsupported(
        format!("{devices}.downwardMetrics"),
        dev.downward_metrics.as_ref(),
    );
    e.unsupported(
        format!("{devices}.clientPassthrough"),
        dev.client_passthrough.as_ref(),
    );
    e.unsupported(format!("{devices}.sound"), dev.sound.as_ref());
    e.unsupported(format!("{devices}.tpm"), dev.tpm.as_ref());
    e.unsupported_true(format!("{devices}.autoattachVSOCK"), dev.autoattach_vsock);
    e.unsupported_true(
        format!("{devices}.logSerialConsole"),
        dev.log_serial_console,
    );
    e.unsupported(
        format!("{devices}.watchdog.diag288"),
        dev.watchdog.as_ref().and_then(|w| w.diag288.as_ref()),
    );
}

/// A KubeVirt PCI address (`PCI_ADDRESS_PATTERN`) with a slot a PCI bus has; where it can
/// go is [`pci_placement`]'s question.
fn pci_address(field: String, a: &str, e: &mut Errors) {
    if crate::vmi::PciAddress::parse(a).is_none_or(|p| p.slot >= 32) {
        e.add(
            field,
            format!("{a:?} is not a PCI address (e.g. 0000:00:05.0)"),
        );
    }
}

/// The clock values QEMU (through libvirt) cannot honour, KubeVirt's tick policies and tracks
/// named where the value is unknown.
fn clock(c: &crate::vmi::Clock, path: &str, e: &mut Errors) {
    if c.timezone.is_some() && c.utc.is_some() {
        e.add(
            format!("{path}.timezone"),
            "only one of utc and timezone may be set",
        );
    }
    if let Err(message) = c.utc_offset_at(std::time::SystemTime::now()) {
        e.add(format!("{path}.timezone"), message);
    }
    let Some(t) = &c.timer else { return };
    let mut policy = |timer: &str, value: Option<&str>, known: &[&str]| {
        if let Some(p) = value
            && !known.contains(&p)
        {
            let message = if p == "merge" || (timer == "rtc" && p == "discard") {
                format!(
                    "QEMU's {timer} has no {p:?} tick policy ({})",
                    known.join(", ")
                )
            } else {
                format!("unknown tick policy {p:?} ({})", known.join(", "))
            };
            e.add(format!("{path}.timer.{timer}.tickPolicy"), message);
        }
    };
    if let Some(pit) = &t.pit {
        policy(
            "pit",
            pit.tick_policy.as_deref(),
            &["delay", "catchup", "discard"],
        );
    }
    if let Some(rtc) = &t.rtc {
        policy("rtc", rtc.tick_policy.as_deref(), &["delay", "catchup"]);
        if let Some(track) = rtc
            .track
            .as_deref()
            .filter(|t| !["guest", "wall"].contains(t))
        {
            e.add(
                format!("{path}.timer.rtc.track"),
                format!("unknown track {track:?} (guest, wall)"),
            );
        }
    }
    e.unsupported(
        format!("{path}.timer.hpet.tickPolicy"),
        t.hpet.as_ref().and_then(|h| h.tick_policy.as_ref()),
    );
    e.unsupported_false(
        format!("{path}.timer.pit.present"),
        t.pit.as_ref().and_then(|p| p.present),
    );
    e.unsupported_false(
        format!("{path}.timer.rtc.present"),
        t.rtc.as_ref().and_then(|r| r.present),
    );
    // A Hyper-V enlightenment, like those of features.hyperv.
    if t.hyperv.as_ref().is_some_and(|h| h.present != Some(false)) {
        e.add(format!("{path}.timer.hyperv.present"), UNSUPPORTED);
    }
}

/// A path naming a file on the node (hostDisk) or in an image (containerDisk, kernelBoot) must
/// be absolute and must not climb. virt-controller mounts a hostDisk's directory into the
/// launcher pod as a hostPath volume, which kube-apiserver refuses with `..` in it: admitted,
/// such a VMI would wait for a pod that can never be created, with an error about a pod volume
/// the user never wrote; a relative path would be refused only by the launcher, once its pod
/// runs.
/// What a string with a NUL byte is told.
pub const NUL_BYTE: &str = "holds a NUL byte, which QEMU cannot be given";

/// The path of the first string (or key) under `v`, a spec as JSON found at `base`, that holds
/// a NUL byte. No such string can reach QEMU: an argv cannot carry one. The fuzzer found them
/// field by field (a watchdog's name and action, the CPU model, a kernelPath, the SMBIOS
/// serial), so every string is checked, and admission and the launcher both check.
pub fn nul_byte_at(v: &serde_json::Value, base: &str) -> Option<String> {
    use serde_json::Value;
    match v {
        Value::String(s) => s.contains('\0').then(|| base.to_owned()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| nul_byte_at(item, &format!("{base}[{i}]"))),
        Value::Object(fields) => fields.iter().find_map(|(k, item)| {
            let path = format!("{base}.{k}");
            if k.contains('\0') {
                Some(path)
            } else {
                nul_byte_at(item, &path)
            }
        }),
        Value::Null | Value::Bool(_) | Value::Number(_) => None,
    }
}

/// Why `p` cannot be a path on the node given to QEMU, if it cannot: it must be absolute and
/// without `..` (a NUL byte is [`nul_byte_at`]'s). Admission and the launcher (which takes
/// VMIs from virt-handler) both check.
pub fn node_path_problem(p: &str) -> Option<String> {
    (!p.starts_with('/') || p.split('/').any(|c| c == ".."))
        .then(|| format!("{p:?} must be an absolute path without '..'"))
}

fn absolute_without_backsteps(field: String, p: &str, e: &mut Errors) {
    if let Some(problem) = node_path_problem(p) {
        e.add(field, problem);
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A name the launcher can give QEMU: a device is `ua-<name>` there (KubeVirt's libvirt user
/// alias), libvirt refuses a user alias with other characters than these, QEMU an id with most
/// of them, and a NUL cannot even be passed in an argv. KubeVirt checks this for interfaces
/// (disks and volumes are DNS labels); for inputs and the watchdog it is ours, where KubeVirt's
/// VMI would be admitted and then fail in libvirt.
fn device_name(field: String, name: &str, e: &mut Errors) {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        e.add(
            field,
            format!(
                "{name:?}: may only contain alphabetical characters, numbers, dashes (-) or underscores (_)"
            ),
        );
    }
}

fn scheduling(spec: &VirtualMachineInstanceSpec, base: &str, e: &mut Errors) {
    if let Some(a) = spec.architecture.as_deref().filter(|a| !a.is_empty())
        && a != "amd64"
    {
        e.add(
            format!("{base}.architecture"),
            format!("unsupported architecture: {a}"),
        );
    }
    if let Some(s) = &spec.eviction_strategy
        && !s.is_known()
    {
        e.add(
            format!("{base}.evictionStrategy"),
            format!("unknown eviction strategy {:?}", s.as_str()),
        );
    }
    if let Some(s) = spec.start_strategy.as_deref() {
        if s == crate::vmi::START_STRATEGY_PAUSED {
            if spec.liveness_probe.is_some() {
                e.add(
                    format!("{base}.startStrategy"),
                    "a VMI started paused cannot have a livenessProbe",
                );
            }
        } else {
            e.add(
                format!("{base}.startStrategy"),
                format!("unknown start strategy {s:?} (only Paused)"),
            );
        }
    }
    if spec.termination_grace_period_seconds.is_some_and(|t| t < 0) {
        e.add(
            format!("{base}.terminationGracePeriodSeconds"),
            "must not be negative",
        );
    }
    for (field, value) in [("hostname", &spec.hostname), ("subdomain", &spec.subdomain)] {
        if let Some(v) = value.as_deref().filter(|v| !is_dns_label(v)) {
            e.add(
                format!("{base}.{field}"),
                format!("{v:?} is not a DNS label"),
            );
        }
    }
    if let Some(p) = spec.dns_policy.as_deref()
        && !["ClusterFirstWithHostNet", "ClusterFirst", "Default", "None"].contains(&p)
    {
        e.add(
            format!("{base}.dnsPolicy"),
            format!(
                "{p:?} is not supported (ClusterFirstWithHostNet, ClusterFirst, Default, None)"
            ),
        );
    }
    if spec.dns_policy.as_deref() == Some("None") && spec.dns_config.is_none() {
        e.add(
            format!("{base}.dnsConfig"),
            "required when dnsPolicy is None",
        );
    }
    for (field, probe) in [
        ("livenessProbe", &spec.liveness_probe),
        ("readinessProbe", &spec.readiness_probe),
    ] {
        let Some(p) = probe else { continue };
        let set = [
            p.exec.is_some(),
            p.http_get.is_some(),
            p.tcp_socket.is_some(),
            p.guest_agent_ping.is_some(),
        ]
        .iter()
        .filter(|s| **s)
        .count();
        if set != 1 {
            e.add(
                format!("{base}.{field}"),
                "must have exactly one of exec, httpGet, tcpSocket, guestAgentPing",
            );
        }
        // KubeVirt's: the kubelet sends these to the pod's IP, which only the pod network
        // connects to the guest.
        if !spec.networks.iter().any(|n| n.pod.is_some()) {
            for (kind, set) in [
                ("httpGet", p.http_get.is_some()),
                ("tcpSocket", p.tcp_socket.is_some()),
            ] {
                if set {
                    e.add(
                        format!("{base}.{field}.{kind}"),
                        "is only allowed if the Pod Network is attached",
                    );
                }
            }
        }
        // What kube-apiserver would refuse on the launcher pod, said here at the VMI's field.
        if p.exec
            .as_ref()
            .is_some_and(|x| x.command.as_ref().is_none_or(Vec::is_empty))
        {
            e.add(format!("{base}.{field}.exec.command"), "must not be empty");
        }
        if field == "livenessProbe" && p.success_threshold.is_some_and(|t| t != 1) {
            e.add(
                format!("{base}.{field}.successThreshold"),
                "must be 1 for a liveness probe",
            );
        }
    }
}

fn resources(spec: &VirtualMachineInstanceSpec, base: &str, e: &mut Errors) {
    let res = &spec.domain.resources;
    let path = format!("{base}.domain.resources");
    let mut parsed = BTreeMap::new();
    for (kind, map) in [("requests", &res.requests), ("limits", &res.limits)] {
        for (name, q) in map {
            if let Some(p) = e.quantity(format!("{path}.{kind}.{name}"), q) {
                parsed.insert((kind, name.as_str()), p);
            }
        }
    }
    let mem_req = parsed.get(&("requests", "memory")).copied();
    let mem_lim = parsed.get(&("limits", "memory")).copied();
    if let (Some(r), Some(l)) = (mem_req, mem_lim)
        && r > l
    {
        e.add(
            format!("{path}.requests.memory"),
            "must not be greater than limits.memory",
        );
    }
    if let (Some(r), Some(l)) = (
        parsed.get(&("requests", "cpu")).copied(),
        parsed.get(&("limits", "cpu")).copied(),
    ) && r > l
    {
        e.add(
            format!("{path}.requests.cpu"),
            "must not be greater than limits.cpu",
        );
    }
    if mem_req.is_some_and(|r| r.value() < 1_000_000) {
        e.add(format!("{path}.requests.memory"), "must be at least 1M");
    }
    let memory = spec.domain.memory.as_ref();
    let mpath = format!("{base}.domain.memory");
    let guest = memory
        .and_then(|m| m.guest.as_ref())
        .and_then(|q| e.quantity(format!("{mpath}.guest"), q));
    let max_guest = memory
        .and_then(|m| m.max_guest.as_ref())
        .and_then(|q| e.quantity(format!("{mpath}.maxGuest"), q));
    if let (Some(g), Some(m)) = (guest, max_guest)
        && g > m
    {
        e.add(
            format!("{mpath}.guest"),
            "must not be greater than maxGuest",
        );
    }
    if let (Some(g), Some(l)) = (guest, mem_lim)
        && g > l
    {
        e.add(
            format!("{mpath}.guest"),
            "must not be greater than the memory limit",
        );
    }
    let hugepages = memory.and_then(|m| m.hugepages.as_ref());
    if let Some(h) = hugepages {
        match h.page_size.as_deref() {
            Some(size @ ("2Mi" | "1Gi")) => {
                let page = if size == "2Mi" { 2 << 20 } else { 1 << 30 };
                let memory = guest.or(mem_req).map(ParsedQuantity::value);
                if let Some(m) = memory {
                    if m < page {
                        e.add(
                            format!("{mpath}.hugepages.pageSize"),
                            format!("{size} is larger than the guest memory"),
                        );
                    } else if m % page != 0 {
                        e.add(
                            format!("{mpath}.hugepages.pageSize"),
                            format!("guest memory is not a multiple of the page size {size}"),
                        );
                    }
                }
            }
            other => e.add(
                format!("{mpath}.hugepages.pageSize"),
                format!(
                    "{:?} is not a supported page size (2Mi or 1Gi)",
                    other.unwrap_or("")
                ),
            ),
        }
    }
    let has_memory = [mem_req, mem_lim, guest]
        .iter()
        .any(|q| q.is_some_and(|q| !q.is_zero()))
        || hugepages.is_some();
    if !has_memory {
        e.add(
            format!("{path}.requests.memory"),
            "no memory requested: set resources.requests.memory, resources.limits.memory or memory.guest",
        );
    }
}

fn cpu(spec: &VirtualMachineInstanceSpec, base: &str, e: &mut Errors) {
    let Some(cpu) = &spec.domain.cpu else { return };
    let path = format!("{base}.domain.cpu");
    for (field, v) in [
        ("cores", cpu.cores),
        ("sockets", cpu.sockets),
        ("threads", cpu.threads),
    ] {
        if v.is_some_and(|v| v > 512) {
            e.add(format!("{path}.{field}"), "must not exceed 512");
        }
    }
    if cpu.vcpus() > 512 {
        e.add(
            path.clone(),
            format!("{} vCPUs requested; at most 512", cpu.vcpus()),
        );
    }
    if let (Some(max), Some(sockets)) = (cpu.max_sockets, cpu.sockets)
        && max != 0
        && sockets > max
    {
        e.add(
            format!("{path}.sockets"),
            "must not be greater than maxSockets",
        );
    }
    if cpu.model.as_deref() == Some("") {
        e.add(format!("{path}.model"), "must not be empty");
    }
    // QEMU's model names (and libvirt's) are these characters; another one would reach the
    // launcher's -cpu, a comma splitting the model (found by fuzzing: a NUL).
    if let Some(m) = cpu.model.as_deref()
        && !m
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        e.add(
            format!("{path}.model"),
            format!("{m:?} is not a CPU model name (letters, digits, '-', '_', '.')"),
        );
    }
    if cpu.model.as_deref() == Some(QEMU_HELP_MODEL) {
        e.add(format!("{path}.model"), NOT_A_CPU_MODEL);
    }
    for (i, f) in cpu.features.iter().enumerate() {
        // The name goes onto QEMU's -cpu and into a node label (`cpu-feature.node.kubevirt.io/`).
        if !crate::labels::is_label_name(&f.name) {
            e.add(
                format!("{path}.features[{i}].name"),
                format!(
                    "{:?} is not a CPU feature name (letters, digits, '-', '_', '.')",
                    f.name
                ),
            );
        }
        if let Some(p) = f.policy.as_deref()
            && !["", "force", "require", "optional", "disable", "forbid"].contains(&p)
        {
            e.add(
                format!("{path}.features[{i}].policy"),
                format!(
                    "CPU feature {} uses policy {p} that is not supported",
                    f.name
                ),
            );
        }
    }
    if cpu.dedicated_cpu_placement == Some(true) {
        dedicated_cpus(spec, cpu, base, e);
    }
    if cpu.isolate_emulator_thread == Some(true) && cpu.dedicated_cpu_placement != Some(true) {
        e.add(
            format!("{path}.isolateEmulatorThread"),
            "IsolateEmulatorThread should be only set in combination with DedicatedCPUPlacement",
        );
    }
}

/// KubeVirt's `validateCpuPinning`: dedicated CPUs need Guaranteed-QoS-shaped resources.
/// KubeVirt's messages, but for its spelling of "integer" and a trailing space.
fn dedicated_cpus(
    spec: &VirtualMachineInstanceSpec,
    cpu: &crate::vmi::Cpu,
    base: &str,
    e: &mut Errors,
) {
    let path = format!("{base}.domain.cpu.dedicatedCpuPlacement");
    let res = &spec.domain.resources;
    let get = |m: &BTreeMap<String, Quantity>, k: &str| {
        m.get(k).and_then(|q| ParsedQuantity::from_quantity(q).ok())
    };
    let (req, lim) = (get(&res.requests, "cpu"), get(&res.limits, "cpu"));
    for (field, q) in [("requests", req), ("limits", lim)] {
        if let Some(q) = q
            && q.value() * 1000 != q.milli_value()
        {
            e.add(
                format!("{base}.domain.resources.{field}.cpu"),
                format!("provided resources CPU {field} must be an integer"),
            );
        }
    }
    if let Some(t) = cpu.threads.filter(|&t| t > 2) {
        e.add(
            path.clone(),
            format!("Not more than two threads must be provided at {base}.domain.cpu.threads (got {t}) when DedicatedCPUPlacement is true"),
        );
    }
    let value = |q: Option<ParsedQuantity>| q.map_or(0, ParsedQuantity::value);
    let vcpus = i128::from(cpu.vcpus());
    let topology_given = cpu.cores.is_some() || cpu.sockets.is_some() || cpu.threads.is_some();
    let (req_path, lim_path) = (
        format!("{base}.domain.resources.requests.cpu"),
        format!("{base}.domain.resources.limits.cpu"),
    );
    if value(req) > 0 && value(lim) > 0 && value(req) != value(lim) {
        e.add(
            path.clone(),
            format!("{req_path} or {lim_path} must be equal when DedicatedCPUPlacement is true"),
        );
    }
    if (value(req) > 0 || value(lim) > 0)
        && topology_given
        && value(req) != vcpus
        && value(lim) != vcpus
    {
        e.add(path.clone(), format!("{req_path} or {lim_path} must not be provided at the same time with {base}.domain.cpu.cores when DedicatedCPUPlacement is true"));
    }
    if value(req) == 0 && value(lim) == 0 && !topology_given {
        e.add(
            path.clone(),
            format!("either {req_path} or {lim_path} or {base}.domain.cpu.cores must be provided when DedicatedCPUPlacement is true"),
        );
    }
    let (mreq, mlim) = (get(&res.requests, "memory"), get(&res.limits, "memory"));
    if value(mreq) > 0 && value(mlim) > 0 && value(mreq) != value(mlim) {
        e.add(
            format!("{base}.domain.resources.requests.memory"),
            format!("{base}.domain.resources.requests.memory must be equal to {base}.domain.resources.limits.memory"),
        );
    }
}

fn machine_type_allowed(machine: &str) -> bool {
    // KubeVirt's amd64 emulatedMachines: "q35*,pc-q35*".
    machine.starts_with("q35") || machine.starts_with("pc-q35")
}

fn firmware(spec: &VirtualMachineInstanceSpec, base: &str, e: &mut Errors) {
    if let Some(m) = spec
        .domain
        .machine
        .as_ref()
        .and_then(|m| m.machine_type.as_deref())
        && !m.is_empty()
        && !machine_type_allowed(m)
    {
        e.add(
            format!("{base}.domain.machine.type"),
            format!("{m} is not supported (allowed: q35*, pc-q35*)"),
        );
    }
    let Some(fw) = &spec.domain.firmware else {
        return;
    };
    let path = format!("{base}.domain.firmware");
    if let Some(bl) = &fw.bootloader {
        if bl.bios.is_some() && bl.efi.is_some() {
            e.add(
                format!("{path}.bootloader"),
                "has both EFI and BIOS configured, but they are mutually exclusive",
            );
        }
        // libvirt refuses a serial BIOS console without a serial port only when the domain
        // starts; the VMI can say so at admission.
        if bl.bios.as_ref().and_then(|b| b.use_serial) == Some(true)
            && !spec.domain.devices.wants_serial_console()
        {
            e.add(
                format!("{path}.bootloader.bios.useSerial"),
                format!(
                    "needs a serial console, but {base}.domain.devices.autoattachSerialConsole is false"
                ),
            );
        }
        if let Some(efi) = &bl.efi {
            let smm = spec
                .domain
                .features
                .as_ref()
                .and_then(|f| f.smm.as_ref())
                .is_some_and(crate::vmi::FeatureState::is_enabled);
            if efi.secure_boot_enabled() && !smm {
                e.add(
                    format!("{path}.bootloader.efi.secureBoot"),
                    "EFI SecureBoot requires SMM (spec.domain.features.smm), which is disabled",
                );
            }
        }
    }
    if let Some(kb) = &fw.kernel_boot {
        let kpath = format!("{path}.kernelBoot");
        match &kb.container {
            None => {
                if kb.kernel_args.as_deref().is_some_and(|a| !a.is_empty()) {
                    e.add(
                        format!("{kpath}.kernelArgs"),
                        "kernel arguments cannot be provided without an external kernel",
                    );
                }
            }
            Some(c) => {
                let cpath = format!("{kpath}.container");
                if c.image.is_empty() {
                    e.add(format!("{cpath}.image"), "required");
                }
                let kernel = c.kernel_path.as_deref().filter(|p| !p.is_empty());
                let initrd = c.initrd_path.as_deref().filter(|p| !p.is_empty());
                if kernel.is_none() && initrd.is_none() {
                    e.add(
                        cpath.clone(),
                        "must be defined with at least one of kernelPath, initrdPath",
                    );
                }
                for (field, p) in [("kernelPath", kernel), ("initrdPath", initrd)] {
                    if let Some(p) = p {
                        absolute_without_backsteps(format!("{cpath}.{field}"), p, e);
                    }
                }
            }
        }
    }
}

fn devices(spec: &VirtualMachineInstanceSpec, base: &str, e: &mut Errors) {
    let dev = &spec.domain.devices;
    let path = format!("{base}.domain.devices");
    let mut seen = BTreeSet::new();
    for (i, disk) in dev.disks.iter().enumerate() {
        let dpath = format!("{path}.disks[{i}]");
        if !seen.insert(disk.name.as_str()) {
            e.add(
                format!("{dpath}.name"),
                format!("duplicate disk name {:?}", disk.name),
            );
        }
        // KubeVirt's validateDiskNameAsContainerName: a disk may become a container's name.
        if !is_dns_label(&disk.name) {
            e.add(
                format!("{dpath}.name"),
                format!("{:?} is not a DNS label", disk.name),
            );
        }
        match spec.volume(&disk.name) {
            None => e.add(
                format!("{dpath}.name"),
                format!("no volume named {:?}", disk.name),
            ),
            Some(v) => {
                if disk.lun.is_some()
                    && !matches!(
                        v.source(),
                        Some(VolumeSource::PersistentVolumeClaim(_) | VolumeSource::DataVolume(_))
                    )
                {
                    e.add(
                        format!("{dpath}.lun"),
                        "can only be mapped to a DataVolume or PersistentVolumeClaim volume",
                    );
                }
            }
        }
        let targets = disk.targets_set();
        if targets.len() > 1 {
            e.add(
                dpath.clone(),
                format!(
                    "must have only one of disk, cdrom, lun (has {})",
                    targets.join(", ")
                ),
            );
        }
        if disk.lun.is_some() {
            e.add(format!("{dpath}.lun"), UNSUPPORTED);
        }
        if let Some(t) = disk.target()
            && let Some(bus) = t.bus()
        {
            let bpath = format!("{dpath}.{}.bus", t.field());
            match bus {
                DiskBus::Virtio | DiskBus::Sata | DiskBus::Scsi => {}
                DiskBus::Usb => e.add(bpath, format!("usb: {UNSUPPORTED}")),
                DiskBus::Other(b) => {
                    e.add(bpath, format!("unknown bus {b:?} (virtio, sata or scsi)"));
                }
            }
        }
        if let Some(c) = &disk.cache
            && !c.is_known()
        {
            e.add(
                format!("{dpath}.cache"),
                format!(
                    "unknown cache mode {:?} (none, writethrough, writeback)",
                    c.as_str()
                ),
            );
        }
        if let Some(io) = disk.io.as_ref().filter(|io| !io.is_known()) {
            e.add(
                format!("{dpath}.io"),
                format!(
                    "unknown io mode {:?} (native, threads, default)",
                    io.as_str()
                ),
            );
        }
        // QEMU's native AIO bypasses the host page cache, and a disk other VMs write must too.
        let cached = disk.cache.as_ref().is_some_and(|c| *c != DiskCache::None);
        if cached && disk.io == Some(DiskIo::Native) {
            e.add(format!("{dpath}.io"), "native needs cache none");
        }
        if cached && disk.shareable == Some(true) {
            e.add(
                format!("{dpath}.cache"),
                "a shareable disk needs cache none",
            );
        }
        e.unsupported(format!("{dpath}.blockSize"), disk.block_size.as_ref());
        e.unsupported_true(
            format!("{dpath}.changedBlockTracking"),
            disk.changed_block_tracking,
        );
        e.unsupported(format!("{dpath}.tag"), disk.tag.as_ref());
        if let Some(t) = &disk.disk
            && let Some(a) = t.pci_address.as_deref()
        {
            pci_address(format!("{dpath}.disk.pciAddress"), a, e);
            if t.bus.as_ref().is_some_and(|b| *b != DiskBus::Virtio) {
                e.add(
                    format!("{dpath}.disk.pciAddress"),
                    "only a disk on the virtio bus has a PCI address",
                );
            }
        }
        if let Some(tray) = disk.cdrom.as_ref().and_then(|c| c.tray.as_deref())
            && tray != "closed"
        {
            e.add(
                format!("{dpath}.cdrom.tray"),
                format!("{tray}: {UNSUPPORTED}"),
            );
        }
        if let Some(p) = disk
            .error_policy
            .as_deref()
            .filter(|p| !["stop", "ignore", "report", "enospace"].contains(p))
        {
            e.add(
                format!("{dpath}.errorPolicy"),
                format!("unknown error policy {p:?} (stop, ignore, report, enospace)"),
            );
        }
    }
    for (i, input) in dev.inputs.iter().enumerate() {
        device_name(format!("{path}.inputs[{i}].name"), &input.name, e);
        if input
            .bus
            .as_deref()
            .is_some_and(|b| b != "usb" && b != "virtio")
        {
            e.add(
                format!("{path}.inputs[{i}].bus"),
                "input device can have only virtio or usb bus",
            );
        }
        if input.input_type.as_deref().is_some_and(|t| t != "tablet") {
            e.add(
                format!("{path}.inputs[{i}].type"),
                "input device can have only tablet type",
            );
        }
    }
    if let Some(w) = &dev.watchdog {
        device_name(format!("{path}.watchdog.name"), &w.name, e);
    }
    if let Some(a) = dev
        .watchdog
        .as_ref()
        .and_then(|w| w.i6300esb.as_ref())
        .and_then(|w| w.action.as_deref())
        && let Err(why) = crate::vmi::check_watchdog_action(a)
    {
        e.add(format!("{path}.watchdog.i6300esb.action"), why);
    }
    if let Some(video) = &dev.video {
        let ty = video.video_type.as_deref().unwrap_or_default();
        if !crate::vmi::VIDEO_TYPES.contains(&ty) {
            e.add(
                format!("{path}.video.type"),
                format!(
                    "unknown video type {ty:?} ({})",
                    crate::vmi::VIDEO_TYPES.join(", ")
                ),
            );
        }
    }
    if dev.video.is_some() && dev.autoattach_graphics_device == Some(false) {
        e.add(
            format!("{path}.video"),
            "not allowed when autoattachGraphicsDevice is false",
        );
    }
}

/// KubeVirt's virtiofs rules (`validateFilesystemsWithVirtIOFSEnabled`: a claim needs the
/// storage gate, config volumes none), and ours for what KubeVirt admits only to fail later:
/// a name matching no volume (no container would serve it), a volume that is also a disk, a
/// source that is not a directory of the launcher pod (a container disk, a cloud-init seed), a
/// hotpluggable claim (the pod's containers are fixed when it starts), a tag longer than QEMU
/// takes.
fn filesystems(spec: &VirtualMachineInstanceSpec, cfg: &ClusterConfig, base: &str, e: &mut Errors) {
    use crate::virtiofs::{STORAGE_VOLUMES_GATE, TAG_MAX};
    let path = format!("{base}.domain.devices.filesystems");
    let mut seen = BTreeSet::new();
    for (i, fs) in spec.domain.devices.filesystems.iter().enumerate() {
        let npath = format!("{path}[{i}].name");
        if !seen.insert(fs.name.as_str()) {
            e.add(
                npath.clone(),
                format!("duplicate filesystem name {:?}", fs.name),
            );
        }
        if fs.name.len() > TAG_MAX {
            e.add(
                npath.clone(),
                format!(
                    "{:?} is longer than the {TAG_MAX} bytes of a virtiofs tag",
                    fs.name
                ),
            );
        }
        if spec.domain.devices.disks.iter().any(|d| d.name == fs.name) {
            e.add(
                npath.clone(),
                format!("volume {:?} is used by a disk as well", fs.name),
            );
        }
        let Some(volume) = spec.volume(&fs.name) else {
            e.add(npath, format!("no volume named {:?}", fs.name));
            continue;
        };
        match volume.source() {
            Some(VolumeSource::PersistentVolumeClaim(_) | VolumeSource::DataVolume(_))
                if !cfg.has_feature_gate(STORAGE_VOLUMES_GATE) =>
            {
                e.add(
                    path.clone(),
                    "virtiofs is not allowed: virtiofs feature gate is not enabled for PVC",
                );
            }
            Some(VolumeSource::PersistentVolumeClaim(p)) if p.hotpluggable == Some(true) => {
                e.add(npath, "a hotpluggable volume cannot be a filesystem");
            }
            Some(
                VolumeSource::PersistentVolumeClaim(_)
                | VolumeSource::DataVolume(_)
                | VolumeSource::ConfigMap(_)
                | VolumeSource::Secret(_)
                | VolumeSource::ServiceAccount(_)
                | VolumeSource::DownwardApi(_),
            )
            | None => {}
            Some(other) => e.add(
                npath,
                format!(
                    "a {} volume cannot be a filesystem (persistentVolumeClaim, dataVolume, \
                     configMap, secret, serviceAccount, downwardAPI)",
                    other.field()
                ),
            ),
        }
    }
}

fn cloud_init(src: &CloudInitNoCloudSource, path: &str, e: &mut Errors) {
    let user = [
        src.user_data.is_some(),
        src.user_data_base64.is_some(),
        src.user_data_secret_ref.is_some(),
    ];
    let network = [
        src.network_data.is_some(),
        src.network_data_base64.is_some(),
        src.network_data_secret_ref.is_some(),
    ];
    for (field, secret) in [
        ("secretRef", &src.user_data_secret_ref),
        ("networkDataSecretRef", &src.network_data_secret_ref),
    ] {
        if secret.as_ref().is_some_and(|s| s.name.is_empty()) {
            e.add(format!("{path}.{field}.name"), "required");
        }
    }
    let count = |s: &[bool]| s.iter().filter(|b| **b).count();
    if count(&user) > 1 {
        e.add(
            path,
            "must have only one of userData, userDataBase64, secretRef",
        );
    }
    if count(&network) > 1 {
        e.add(
            path,
            "must have only one of networkData, networkDataBase64, networkDataSecretRef",
        );
    }
    if count(&user) + count(&network) == 0 {
        e.add(
            path,
            "must have at least one user data or network data source",
        );
    }
    for (field, data) in [
        ("userDataBase64", &src.user_data_base64),
        ("networkDataBase64", &src.network_data_base64),
    ] {
        if let Some(d) = data
            && !is_base64(d)
        {
            e.add(format!("{path}.{field}"), "is not valid base64");
        }
    }
    for (field, data) in [
        (
            "userData",
            src.user_data.as_ref().or(src.user_data_base64.as_ref()),
        ),
        (
            "networkData",
            src.network_data
                .as_ref()
                .or(src.network_data_base64.as_ref()),
        ),
    ] {
        if data.is_some_and(|d| d.len() > 2048) {
            e.add(
                format!("{path}.{field}"),
                "exceeds the 2048 byte limit; use a Secret reference for larger data",
            );
        }
    }
}

fn is_base64(s: &str) -> bool {
    let s: String = s.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let body = s.trim_end_matches('=');
    s.len().is_multiple_of(4)
        && s.len() - body.len() <= 2
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
}

fn volumes(spec: &VirtualMachineInstanceSpec, cfg: &ClusterConfig, base: &str, e: &mut Errors) {
    let mut seen = BTreeSet::new();
    let mut service_accounts = 0;
    for (i, v) in spec.volumes.iter().enumerate() {
        let vpath = format!("{base}.volumes[{i}]");
        if !seen.insert(v.name.as_str()) {
            e.add(
                format!("{vpath}.name"),
                format!("duplicate volume name {:?}", v.name),
            );
        }
        if !is_dns_label(&v.name) {
            e.add(
                format!("{vpath}.name"),
                format!("{:?} is not a DNS label", v.name),
            );
        }
        let sources = v.sources();
        match sources.as_slice() {
            [] => e.add(vpath.clone(), "must have exactly one source set"),
            [_] => {}
            many => e.add(
                vpath.clone(),
                format!(
                    "must have exactly one source set, has {}",
                    many.iter()
                        .map(VolumeSource::field)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
        }
        for source in sources {
            let spath = format!("{vpath}.{}", source.field());
            match source {
                VolumeSource::Unsupported(..) | VolumeSource::DataVolume(_) => {
                    e.add(spath, UNSUPPORTED);
                }
                VolumeSource::Ephemeral(eph) => match &eph.persistent_volume_claim {
                    None => e.add(
                        format!("{spath}.persistentVolumeClaim"),
                        "required: the claim the overlay is based on",
                    ),
                    Some(c) if c.claim_name.is_empty() => e.add(
                        format!("{spath}.persistentVolumeClaim.claimName"),
                        "required",
                    ),
                    Some(_) => {}
                },
                VolumeSource::ConfigMap(c) => {
                    if c.name.as_deref().unwrap_or_default().is_empty() {
                        e.add(format!("{spath}.name"), "required");
                    }
                }
                VolumeSource::Secret(s) => {
                    if s.secret_name.as_deref().unwrap_or_default().is_empty() {
                        e.add(format!("{spath}.secretName"), "required");
                    }
                }
                VolumeSource::DownwardApi(_) => {}
                VolumeSource::ServiceAccount(sa) => {
                    service_account(spec, sa, &spath, base, &mut service_accounts, e);
                }
                VolumeSource::ContainerDisk(cd) => {
                    if cd.image.is_empty() {
                        e.add(format!("{spath}.image"), "required");
                    }
                    if let Some(p) = cd.path.as_deref() {
                        absolute_without_backsteps(format!("{spath}.path"), p, e);
                    }
                    if let Some(pp) = &cd.image_pull_policy
                        && !pp.is_known()
                    {
                        e.add(
                            format!("{spath}.imagePullPolicy"),
                            format!("unknown pull policy {:?}", pp.as_str()),
                        );
                    }
                }
                VolumeSource::CloudInitNoCloud(c) | VolumeSource::CloudInitConfigDrive(c) => {
                    cloud_init(c, &spath, e);
                }
                VolumeSource::EmptyDisk(d) => {
                    if let Some(p) = e.quantity(format!("{spath}.capacity"), &d.capacity)
                        && p.is_zero()
                    {
                        e.add(format!("{spath}.capacity"), "must be greater than zero");
                    }
                }
                VolumeSource::HostDisk(h) => {
                    if !cfg.has_feature_gate("HostDisk") {
                        e.add(spath.clone(), "HostDisk feature gate is not enabled");
                    }
                    if h.path.is_empty() {
                        e.add(format!("{spath}.path"), "required");
                    } else {
                        absolute_without_backsteps(format!("{spath}.path"), &h.path, e);
                    }
                    e.unsupported_true(format!("{spath}.shared"), h.shared);
                    match &h.disk_type {
                        crate::vmi::HostDiskType::Disk => {
                            if h.capacity.is_some() {
                                e.add(
                                    format!("{spath}.capacity"),
                                    "allowed only with type DiskOrCreate",
                                );
                            }
                        }
                        crate::vmi::HostDiskType::DiskOrCreate => {}
                        crate::vmi::HostDiskType::Other(t) => {
                            e.add(
                                format!("{spath}.type"),
                                format!("unknown type {t:?} (Disk or DiskOrCreate)"),
                            );
                        }
                    }
                    if let Some(c) = &h.capacity {
                        e.quantity(format!("{spath}.capacity"), c);
                    }
                }
                VolumeSource::PersistentVolumeClaim(p) => {
                    if p.claim_name.is_empty() {
                        e.add(format!("{spath}.claimName"), "required");
                    }
                }
            }
        }
    }
}

/// KubeVirt's rules for a service account volume: named, one per VMI (its disk has one fixed
/// path, and the pod runs as one account), and the same account as `serviceAccountName`.
fn service_account(
    spec: &VirtualMachineInstanceSpec,
    sa: &crate::vmi::ServiceAccountVolumeSource,
    spath: &str,
    base: &str,
    count: &mut usize,
    e: &mut Errors,
) {
    *count += 1;
    if *count == 2 {
        e.add(
            format!("{base}.volumes"),
            "must have max one serviceAccount volume set",
        );
    }
    let name = sa.service_account_name.as_deref().unwrap_or_default();
    if name.is_empty() {
        e.add(format!("{spath}.serviceAccountName"), "required");
    }
    if let Some(pod_account) = spec.service_account_name.as_deref()
        && !pod_account.is_empty()
        && pod_account != name
    {
        e.add(
            format!("{base}.serviceAccountName"),
            format!(
                "{pod_account:?} and serviceAccount volume {name:?} must reference the same \
                 service account"
            ),
        );
    }
}

/// `de:ad:00:00:be:af` or `DE-AD-00-00-BE-AF`.
fn valid_mac(mac: &str) -> bool {
    let sep = if mac.contains('-') { '-' } else { ':' };
    let parts: Vec<&str> = mac.split(sep).collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn networks(spec: &VirtualMachineInstanceSpec, cfg: &ClusterConfig, base: &str, e: &mut Errors) {
    let mut seen = BTreeSet::new();
    let mut pod_networks = 0;
    for (i, n) in spec.networks.iter().enumerate() {
        let npath = format!("{base}.networks[{i}]");
        if !seen.insert(n.name.as_str()) {
            e.add(
                format!("{npath}.name"),
                format!(
                    "network with name {:?} already exists, every network must have a unique name",
                    n.name
                ),
            );
        }
        if !spec
            .domain
            .devices
            .interfaces
            .iter()
            .any(|i| i.name == n.name)
        {
            e.add(
                format!("{npath}.name"),
                format!("no interface named {:?}", n.name),
            );
        }
        let sources = n.sources();
        if sources.len() != 1 {
            e.add(
                npath.clone(),
                "must have exactly one of pod, multus, resourceClaim",
            );
        }
        for s in sources {
            match s {
                NetworkSource::Pod(p) => {
                    pod_networks += 1;
                    for (field, cidr) in [
                        ("vmNetworkCIDR", &p.vm_network_cidr),
                        ("vmIPv6NetworkCIDR", &p.vm_ipv6_network_cidr),
                    ] {
                        if let Some(c) = cidr.as_deref() {
                            if !valid_cidr(c) {
                                e.add(
                                    format!("{npath}.pod.{field}"),
                                    format!("{c:?} is not a CIDR"),
                                );
                            } else if let Some(problem) = guest_cidr_problem(field, c) {
                                e.add(format!("{npath}.pod.{field}"), format!("{c:?} {problem}"));
                            }
                        }
                    }
                }
                NetworkSource::Multus(_) | NetworkSource::ResourceClaim(_) => {
                    e.add(format!("{npath}.{}", s.field()), UNSUPPORTED);
                }
            }
        }
    }
    if pod_networks > 1 {
        e.add(format!("{base}.networks"), "more than one pod network");
    }
    let mut seen = BTreeSet::new();
    for (i, iface) in spec.domain.devices.interfaces.iter().enumerate() {
        interface(spec, cfg, base, i, iface, &mut seen, e);
    }
}

/// A masquerade guest network needs the right family and room for the gateway (first host)
/// and the guest (second host). Called on a valid CIDR.
fn guest_cidr_problem(field: &str, c: &str) -> Option<&'static str> {
    let (ip, len) = c.split_once('/')?;
    let len: u8 = len.parse().ok()?;
    let v6 = ip.parse::<std::net::IpAddr>().ok()?.is_ipv6();
    match (field, v6) {
        ("vmNetworkCIDR", true) => Some("is not an IPv4 CIDR"),
        ("vmIPv6NetworkCIDR", false) => Some("is not an IPv6 CIDR"),
        (_, false) if len > 30 => Some("has no room for the gateway and the guest (at most /30)"),
        (_, true) if len > 126 => Some("has no room for the gateway and the guest (at most /126)"),
        _ => None,
    }
}

fn valid_cidr(c: &str) -> bool {
    let Some((ip, len)) = c.split_once('/') else {
        return false;
    };
    let Ok(len) = len.parse::<u8>() else {
        return false;
    };
    match ip.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(_)) => len <= 32,
        Ok(std::net::IpAddr::V6(_)) => len <= 128,
        Err(_) => false,
    }
}

fn interface<'a>(
    spec: &VirtualMachineInstanceSpec,
    cfg: &ClusterConfig,
    base: &str,
    i: usize,
    iface: &'a Interface,
    seen: &mut BTreeSet<&'a str>,
    e: &mut Errors,
) {
    let ipath = format!("{base}.domain.devices.interfaces[{i}]");
    if !seen.insert(iface.name.as_str()) {
        e.add(
            format!("{ipath}.name"),
            format!(
                "only one interface can be connected to one specific network ({:?})",
                iface.name
            ),
        );
    }
    device_name(format!("{ipath}.name"), &iface.name, e);
    let network = spec.network(&iface.name);
    if network.is_none() {
        e.add(
            format!("{ipath}.name"),
            format!("no network named {:?}", iface.name),
        );
    }
    let on_pod = network.is_some_and(|n| n.pod.is_some());
    let bindings = iface.bindings();
    if bindings.len() != 1 {
        e.add(
            ipath.clone(),
            "must have exactly one binding method or binding plugin",
        );
    }
    for b in &bindings {
        let bpath = format!("{ipath}.{}", b.field());
        match b {
            InterfaceBinding::Masquerade => {
                if network.is_some() && !on_pod {
                    e.add(bpath, "masquerade is only implemented with the pod network");
                }
                if iface
                    .mac_address
                    .as_deref()
                    .is_some_and(|m| m.eq_ignore_ascii_case("02:00:00:00:00:00"))
                {
                    e.add(
                        format!("{ipath}.macAddress"),
                        "the requested MAC address is reserved for the in-pod bridge",
                    );
                }
            }
            InterfaceBinding::Bridge => {
                if on_pod && !cfg.permit_bridge_interface_on_pod_network {
                    e.add(
                        bpath,
                        "bridge on the pod network is not enabled in the KubeVirt configuration",
                    );
                }
            }
            InterfaceBinding::Slirp | InterfaceBinding::Macvtap | InterfaceBinding::Passt => {
                e.add(
                    bpath,
                    format!(
                        "{} binding has been discontinued since KubeVirt v1.3",
                        b.field()
                    ),
                );
            }
            InterfaceBinding::Sriov
            | InterfaceBinding::PasstBinding
            | InterfaceBinding::Plugin(_) => {
                e.add(bpath, UNSUPPORTED);
            }
        }
    }
    if let Some(m) = &iface.model
        && !m.is_known()
    {
        e.add(
            format!("{ipath}.model"),
            format!("model {:?} is not supported", m.as_str()),
        );
    }
    if let Some(mac) = iface.mac_address.as_deref()
        && !valid_mac(mac)
    {
        e.add(
            format!("{ipath}.macAddress"),
            format!("{mac:?} is not a MAC address (e.g. de:ad:00:00:be:af)"),
        );
    }
    let mut port_names = BTreeSet::new();
    for (j, p) in iface.ports.iter().enumerate() {
        let ppath = format!("{ipath}.ports[{j}]");
        if !(1..=65535).contains(&p.port) {
            e.add(format!("{ppath}.port"), "must be in range 0 < x < 65536");
        }
        if let Some(proto) = p.protocol.as_deref()
            && proto != "TCP"
            && proto != "UDP"
        {
            e.add(
                format!("{ppath}.protocol"),
                "unknown protocol, only TCP or UDP allowed",
            );
        }
        if let Some(name) = p.name.as_deref()
            && !port_names.insert(name)
        {
            e.add(
                format!("{ppath}.name"),
                format!("duplicate port name {name:?}"),
            );
        }
    }
    e.unsupported(format!("{ipath}.portRanges"), iface.port_ranges.as_ref());
    e.unsupported(format!("{ipath}.dhcpOptions"), iface.dhcp_options.as_ref());
    if let Some(a) = iface.pci_address.as_deref() {
        pci_address(format!("{ipath}.pciAddress"), a, e);
    }
    e.unsupported(format!("{ipath}.tag"), iface.tag.as_ref());
    match iface.state.as_deref() {
        None | Some("" | crate::vmi::INTERFACE_STATE_UP | crate::vmi::INTERFACE_STATE_DOWN) => {}
        Some(s @ crate::vmi::INTERFACE_STATE_ABSENT) => {
            e.add(format!("{ipath}.state"), format!("{s}: {UNSUPPORTED}"));
        }
        Some(s) => e.add(
            format!("{ipath}.state"),
            format!("interface state {s:?} is unsupported (up, down, absent)"),
        ),
    }
    if iface
        .acpi_index
        .is_some_and(|a| !(1..16 * 1024).contains(&a))
    {
        e.add(format!("{ipath}.acpiIndex"), "must be between 1 and 16383");
    }
}

fn boot_order(spec: &VirtualMachineInstanceSpec, base: &str, e: &mut Errors) {
    let mut used = BTreeMap::new();
    let disks = spec.domain.devices.disks.iter().enumerate().map(|(i, d)| {
        (
            format!("{base}.domain.devices.disks[{i}].bootOrder"),
            d.boot_order,
        )
    });
    let ifaces = spec
        .domain
        .devices
        .interfaces
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (
                format!("{base}.domain.devices.interfaces[{i}].bootOrder"),
                d.boot_order,
            )
        });
    for (path, order) in disks.chain(ifaces) {
        let Some(order) = order else { continue };
        if order == 0 {
            e.add(path, "must be greater than 0");
        } else {
            once(&mut used, order, path, &format!("boot order {order}"), e);
        }
    }
}

/// Records that `path` uses `key`, or names the field that used it first.
fn once<K: Ord>(used: &mut BTreeMap<K, String>, key: K, path: String, what: &str, e: &mut Errors) {
    if let Some(first) = used.get(&key) {
        e.add(path, format!("{what} is already used by {first}"));
    } else {
        used.insert(key, path);
    }
}

/// Whether libvirt could place the devices with a `pciAddress` (the buses it would add for
/// them, a slot that bus has, no address used twice, see [`crate::pci`]), and QEMU refuses an
/// ACPI index given twice.
fn pci_placement(spec: &VirtualMachineInstanceSpec, base: &str, e: &mut Errors) {
    let devices = &spec.domain.devices;
    // Admission takes q35 machines only.
    if let Err(r) = crate::pci::place(crate::pci::RootBus::Pcie, &crate::pci::pinned(spec, base)) {
        e.add(r.field, r.reason);
    }
    let mut indexes = BTreeMap::new();
    for (i, n) in devices.interfaces.iter().enumerate() {
        if let Some(a) = n.acpi_index {
            let path = format!("{base}.domain.devices.interfaces[{i}].acpiIndex");
            once(&mut indexes, a, path, &format!("ACPI index {a}"), e);
        }
    }
}
