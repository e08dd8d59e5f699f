//! The launcher pod's memory overhead beyond guest RAM, in MiB: virt-controller adds it to the
//! pod's memory request ([`memory_overhead`]), virt-launcher keeps QEMU
//! within it where QEMU has a knob (TCG's code cache). Measured by `launcher/examples/overhead.rs`
//! (docs/controller.md has the figures): QEMU 7.2 beyond guest RAM is 64-68 MiB with a video
//! device and 1-4 vCPUs, plus 60-67 MiB of translated code for an idle TCG guest; a vCPU costs
//! QEMU about 1.3 MiB under TCG, but 8 MiB stays budgeted as KubeVirt does (KVM's per-vCPU state
//! could not be measured here). KubeVirt budgets ~240 MiB here for virt-launcher + libvirt +
//! virtqemud + virtlogd; we run none of those.

/// virt-launcher's resident set (benchmark goal).
pub const LAUNCHER_MIB: u64 = 8;
/// QEMU with no guest RAM touched: binary, libraries, heap, device models.
pub const QEMU_BASE_MIB: u64 = 48;
/// Per vCPU: thread stack, vCPU state, KVM/TCG per-CPU structures (KubeVirt uses 8 too).
pub const PER_VCPU_MIB: u64 = 8;
/// The VGA framebuffer and its shadow, when a graphics device is attached.
pub const VIDEO_MIB: u64 = 16;
/// TCG's translated-code cache, when running emulated: virt-launcher passes it as QEMU's
/// `tb-size`, whose default (1 GiB in QEMU 7.2) would let a busy guest's translations grow past
/// any budget.
pub const TCG_MIB: u64 = 128;
/// Guest page tables: 1 byte per 512 bytes of guest RAM (KubeVirt's ratio).
pub const PAGE_TABLE_DIVISOR: u64 = 512;

/// Our launcher overhead for `vmi` with `guest_bytes` of guest RAM, in bytes:
/// `LAUNCHER + QEMU_BASE + PER_VCPU x vCPUs + guest / 512 (+ VIDEO) (+ TCG)`. virt-controller adds
/// it to the launcher pod's memory request; the overhead benchmark sets it against KubeVirt's.
pub fn memory_overhead(
    vmi: &crate::VirtualMachineInstance,
    guest_bytes: u64,
    emulated: bool,
) -> u64 {
    const MIB: u64 = 1 << 20;
    let vcpus = u64::from(
        vmi.spec
            .domain
            .cpu
            .as_ref()
            .map_or(1, crate::vmi::Cpu::vcpus),
    );
    let video = vmi.spec.domain.devices.autoattach_graphics_device != Some(false);
    let mut mib = LAUNCHER_MIB + QEMU_BASE_MIB + PER_VCPU_MIB * vcpus;
    if video {
        mib += VIDEO_MIB;
    }
    if emulated {
        mib += TCG_MIB;
    }
    mib * MIB + guest_bytes.div_ceil(PAGE_TABLE_DIVISOR)
}

#[cfg(test)]
mod tests {
    use super::memory_overhead;

    #[test]
    fn overhead_formula() {
        let v: crate::VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "small"},
            "spec": {"domain": {"resources": {"requests": {"memory": "128Mi"}}, "devices": {}}},
        }))
        .unwrap();
        let mib = 1 << 20;
        let guest = 128 * mib;
        // 8 + 48 + 8 x 1 vCPU + 16 video, plus 128 MiB / 512 of page tables.
        assert_eq!(memory_overhead(&v, guest, false), 80 * mib + 256 * 1024);
        assert_eq!(
            memory_overhead(&v, guest, true),
            (80 + 128) * mib + 256 * 1024
        );
    }
}
