//! The launcher pod's memory overhead beyond guest RAM, in MiB: virt-controller adds it to the
//! pod's memory request (`controller::template::memory_overhead`), virt-launcher keeps QEMU
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
