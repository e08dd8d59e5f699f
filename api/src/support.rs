//! What kubevirt-rs does with every field of a VMI spec: the rule that nothing is accepted and
//! ignored, as lists that tests hold to the schema and to the code.
//!
//! Every field of the VMI CRD's schema under `spec` is in exactly one list:
//!
//! - [`IMPLEMENTED`]: it does what KubeVirt does, and the named test shows the effect (on QEMU's
//!   command line, the launcher pod, the guest, or the defaults and admission KubeVirt applies).
//! - [`REFUSED`]: validation (and so virt-api's admission webhook) refuses it with
//!   `<path>: ... not supported by kubevirt-rs yet`. A field refused this way may still take
//!   KubeVirt's default value, which is what kubevirt-rs does anyway (`autoattachVSOCK: false`,
//!   `cdrom.tray: closed`, `interfaces[].state: up`).
//! - [`ACCEPTED_BUT_IGNORED`]: known gaps that cannot be refused yet, each with the reason
//!   (KubeVirt's defaults write them into every VMI, so refusing them would refuse every VMI).
//!   Open work of issue 19; no field may be added here to silence the test.
//! - [`CONTAINERS`]: objects with no effect of their own (`spec.domain`, `spec.domain.devices`),
//!   whose fields are each listed.
//!
//! Paths are written as validation writes field paths, with `[]` for "any item of this list":
//! `spec.domain.devices.disks[].disk.bus`. A list item is not a field of its own: the list
//! (`spec.volumes`) and the item's fields (`spec.volumes[].name`) are. A map
//! (`resources.requests`, `nodeSelector`) and a preserved subtree (`x-kubernetes-preserve-unknown-fields`)
//! are single fields: their keys are the user's, not the schema's.
//!
//! A field below a [`REFUSED`] field is not listed: refusing the parent refuses it. Nor is a
//! field below an entry whose `subtree` is true: a Kubernetes type (affinity, tolerations...)
//! handed to the launcher pod unchanged, which Kubernetes then honours field by field.
//!
//! Tests in `api/tests/support.rs` walk the schema against these lists, set every refused field
//! on a valid VMI to see validation refuse it, and look up every named test and function.
//! Tests and functions are named `<file from the workspace root>::<function>`.

use crate::validation::UNSUPPORTED;

/// A field kubevirt-rs honours, and where that is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Implemented {
    pub path: &'static str,
    /// `<file>::<function>`: the test that shows the effect.
    pub shown_by: &'static str,
    /// The field is a Kubernetes type copied whole into the launcher pod: its fields are not
    /// listed.
    pub subtree: bool,
}

const fn field(path: &'static str, shown_by: &'static str) -> Implemented {
    Implemented {
        path,
        shown_by,
        subtree: false,
    }
}

const fn subtree(path: &'static str, shown_by: &'static str) -> Implemented {
    Implemented {
        path,
        shown_by,
        subtree: true,
    }
}

/// A field validation refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub path: &'static str,
    /// A value that is refused, as JSON, where a value of the field's schema type (`{}`,
    /// `true`, `1`, `"x"`, a list of one) would be KubeVirt's default or is not a value
    /// KubeVirt knows.
    pub example: Option<&'static str>,
    /// What the refusal says.
    pub message: &'static str,
}

const fn refused(path: &'static str) -> Refused {
    Refused {
        path,
        example: None,
        message: UNSUPPORTED,
    }
}

const fn refused_value(path: &'static str, example: &'static str) -> Refused {
    Refused {
        path,
        example: Some(example),
        message: UNSUPPORTED,
    }
}

/// KubeVirt refuses these itself since v1.3, with its own message.
const fn discontinued(path: &'static str) -> Refused {
    Refused {
        path,
        example: None,
        message: "discontinued",
    }
}

/// A field accepted and not honoured, and why it cannot be refused yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    pub path: &'static str,
    pub why: &'static str,
}

/// Fields whose effect a test shows.
pub const IMPLEMENTED: &[Implemented] = &[
    subtree(
        "spec.affinity",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    // amd64 is the only architecture admitted, and the one the launcher runs.
    field(
        "spec.architecture",
        "api/tests/validation.rs::each_mistake_is_reported_at_its_path",
    ),
    field(
        "spec.domain.clock",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.clock.timer.hpet",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.clock.timer.hpet.present",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.clock.timer.hyperv",
        "launcher/src/convert/tests.rs::timers_only_kvm_has_are_refused_under_tcg",
    ),
    field(
        "spec.domain.clock.timer.kvm",
        "launcher/src/convert/tests.rs::timers_only_kvm_has_are_refused_under_tcg",
    ),
    field(
        "spec.domain.clock.timer.kvm.present",
        "launcher/src/convert/tests.rs::timers_only_kvm_has_are_refused_under_tcg",
    ),
    field(
        "spec.domain.clock.timer.pit",
        "launcher/src/convert/tests.rs::timers_only_kvm_has_are_refused_under_tcg",
    ),
    field(
        "spec.domain.clock.timer.pit.tickPolicy",
        "launcher/src/convert/tests.rs::timers_only_kvm_has_are_refused_under_tcg",
    ),
    field(
        "spec.domain.clock.timer.rtc",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.clock.timer.rtc.tickPolicy",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.clock.timer.rtc.track",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.clock.timezone",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.clock.utc",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.clock.utc.offsetSeconds",
        "launcher/src/convert/tests.rs::clock_and_timers_render_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.cpu.cores",
        "launcher/src/convert/tests.rs::host_cpu_models_map_to_max_under_tcg_and_host_under_kvm",
    ),
    field(
        "spec.domain.cpu.dedicatedCpuPlacement",
        "launcher/tests/guest.rs::guest_q35_efi_paused_start_pinned_disk_boot_sigterm",
    ),
    field(
        "spec.domain.cpu.features",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.domain.cpu.features[].name",
        "launcher/src/convert/tests.rs::cpu_features_render_on_the_cpu_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.cpu.features[].policy",
        "launcher/src/convert/tests.rs::cpu_features_render_on_the_cpu_as_libvirt_renders_them",
    ),
    field(
        "spec.domain.cpu.isolateEmulatorThread",
        "launcher/tests/guest.rs::guest_q35_efi_paused_start_pinned_disk_boot_sigterm",
    ),
    field(
        "spec.domain.cpu.model",
        "launcher/src/convert/tests.rs::host_cpu_models_map_to_max_under_tcg_and_host_under_kvm",
    ),
    field(
        "spec.domain.cpu.sockets",
        "launcher/src/convert/tests.rs::host_cpu_models_map_to_max_under_tcg_and_host_under_kvm",
    ),
    field(
        "spec.domain.cpu.threads",
        "launcher/src/convert/tests.rs::topology_smm_and_firmware_render_as_asked",
    ),
    field(
        "spec.domain.devices.filesystems",
        "launcher/tests/guest.rs::guest_virtiofs_directories_are_read_in_the_guest",
    ),
    field(
        "spec.domain.devices.filesystems[].name",
        "launcher/src/convert/tests.rs::filesystems_share_guest_memory_with_virtiofsd",
    ),
    field(
        "spec.domain.devices.filesystems[].virtiofs",
        "launcher/tests/guest.rs::guest_virtiofs_directories_are_read_in_the_guest",
    ),
    field(
        "spec.domain.devices.autoattachGraphicsDevice",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.domain.devices.autoattachInputDevice",
        "launcher/src/convert/tests.rs::autoattach_input_device_adds_kubevirts_usb_tablet",
    ),
    field(
        "spec.domain.devices.autoattachMemBalloon",
        "launcher/src/convert/tests.rs::autoattached_devices_and_hotplug_can_be_turned_off",
    ),
    field(
        "spec.domain.devices.autoattachPodInterface",
        "api/tests/defaults.rs::defaults_match_kubevirts",
    ),
    field(
        "spec.domain.devices.autoattachSerialConsole",
        "launcher/src/convert/tests.rs::autoattached_devices_and_hotplug_can_be_turned_off",
    ),
    field(
        "spec.domain.devices.blockMultiQueue",
        "launcher/src/convert/tests.rs::block_multi_queue_gives_virtio_disks_a_queue_per_vcpu",
    ),
    field(
        "spec.domain.devices.disableHotplug",
        "launcher/src/convert/tests.rs::autoattached_devices_and_hotplug_can_be_turned_off",
    ),
    field(
        "spec.domain.devices.disks",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.domain.devices.disks[].bootOrder",
        "launcher/tests/guest.rs::guest_every_device_kind_is_accepted_by_qemu",
    ),
    field(
        "spec.domain.devices.disks[].cache",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.domain.devices.disks[].cdrom",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.domain.devices.disks[].cdrom.bus",
        "launcher/tests/guest.rs::guest_every_device_kind_is_accepted_by_qemu",
    ),
    field(
        "spec.domain.devices.disks[].cdrom.readonly",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.domain.devices.disks[].dedicatedIOThread",
        "launcher/src/convert/tests.rs::io_threads_are_shared_or_dedicated_as_kubevirt_assigns_them",
    ),
    field(
        "spec.domain.devices.disks[].disk",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.domain.devices.disks[].disk.bus",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.domain.devices.disks[].disk.pciAddress",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.domain.devices.disks[].disk.readonly",
        "launcher/src/convert/tests.rs::readonly_disks_and_interface_boot_order_reach_the_devices",
    ),
    field(
        "spec.domain.devices.disks[].errorPolicy",
        "launcher/src/convert/tests.rs::disk_io_error_policy_and_sharing",
    ),
    field(
        "spec.domain.devices.disks[].io",
        "launcher/src/convert/tests.rs::disk_io_error_policy_and_sharing",
    ),
    field(
        "spec.domain.devices.disks[].name",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.domain.devices.disks[].serial",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.domain.devices.disks[].shareable",
        "launcher/src/convert/tests.rs::disk_io_error_policy_and_sharing",
    ),
    field(
        "spec.domain.devices.interfaces",
        "launcher/src/convert/tests.rs::interfaces_use_taps_by_position",
    ),
    field(
        "spec.domain.devices.interfaces[].acpiIndex",
        "launcher/src/convert/tests.rs::interfaces_take_pci_addresses_and_acpi_indexes",
    ),
    field(
        "spec.domain.devices.interfaces[].bootOrder",
        "launcher/src/convert/tests.rs::readonly_disks_and_interface_boot_order_reach_the_devices",
    ),
    field(
        "spec.domain.devices.interfaces[].bridge",
        "launcher/tests/network.rs::guest_bridge_gets_the_pod_address",
    ),
    field(
        "spec.domain.devices.interfaces[].macAddress",
        "launcher/src/convert/tests.rs::interfaces_use_taps_by_position",
    ),
    field(
        "spec.domain.devices.interfaces[].masquerade",
        "launcher/tests/network.rs::guest_masquerade_dhcp_ports_status_and_resync",
    ),
    field(
        "spec.domain.devices.interfaces[].model",
        "launcher/src/convert/tests.rs::interfaces_use_taps_by_position",
    ),
    field(
        "spec.domain.devices.interfaces[].name",
        "launcher/src/convert/tests.rs::interfaces_use_taps_by_position",
    ),
    field(
        "spec.domain.devices.interfaces[].pciAddress",
        "launcher/src/convert/tests.rs::pci_addresses_off_the_root_bus_get_the_controllers_libvirt_adds",
    ),
    field(
        "spec.domain.devices.interfaces[].ports",
        "network/src/plan.rs::masquerade_defaults_and_ports",
    ),
    field(
        "spec.domain.devices.interfaces[].ports[].port",
        "network/src/plan.rs::masquerade_defaults_and_ports",
    ),
    field(
        "spec.domain.devices.interfaces[].ports[].protocol",
        "network/src/plan.rs::masquerade_defaults_and_ports",
    ),
    field(
        "spec.domain.devices.networkInterfaceMultiqueue",
        "launcher/tests/network.rs::guest_masquerade_dhcp_ports_status_and_resync",
    ),
    field(
        "spec.domain.devices.rng",
        "launcher/tests/guest.rs::guest_every_device_kind_is_accepted_by_qemu",
    ),
    field(
        "spec.domain.devices.inputs",
        "launcher/src/convert/tests.rs::inputs_are_tablets_on_usb_or_virtio",
    ),
    field(
        "spec.domain.devices.inputs[].name",
        "launcher/src/convert/tests.rs::inputs_are_tablets_on_usb_or_virtio",
    ),
    field(
        "spec.domain.devices.inputs[].bus",
        "launcher/src/convert/tests.rs::inputs_are_tablets_on_usb_or_virtio",
    ),
    field(
        "spec.domain.devices.inputs[].type",
        "launcher/tests/guest.rs::guest_every_device_kind_is_accepted_by_qemu",
    ),
    field(
        "spec.domain.devices.useVirtioTransitional",
        "launcher/src/convert/tests.rs::virtio_devices_are_modern_only_unless_transitional_is_asked_for",
    ),
    field(
        "spec.domain.devices.video",
        "launcher/tests/guest.rs::guest_every_device_kind_is_accepted_by_qemu",
    ),
    field(
        "spec.domain.devices.video.type",
        "launcher/src/convert/tests.rs::video_types_map_to_qemus_display_devices",
    ),
    field(
        "spec.domain.devices.watchdog",
        "launcher/src/convert/tests.rs::a_watchdog_is_an_i6300esb_with_its_action",
    ),
    field(
        "spec.domain.devices.watchdog.name",
        "launcher/src/convert/tests.rs::a_watchdog_is_an_i6300esb_with_its_action",
    ),
    field(
        "spec.domain.devices.watchdog.i6300esb",
        "launcher/tests/guest.rs::guest_every_device_kind_is_accepted_by_qemu",
    ),
    field(
        "spec.domain.devices.watchdog.i6300esb.action",
        "launcher/src/convert/tests.rs::a_watchdog_is_an_i6300esb_with_its_action",
    ),
    field(
        "spec.domain.features.acpi.enabled",
        "launcher/src/convert/tests.rs::features_render_on_the_machine_and_the_cpu",
    ),
    field(
        "spec.domain.features.kvm.hidden",
        "launcher/src/convert/tests.rs::features_render_on_the_machine_and_the_cpu",
    ),
    field(
        "spec.domain.features.pvspinlock",
        "launcher/src/convert/tests.rs::features_render_on_the_machine_and_the_cpu",
    ),
    field(
        "spec.domain.features.pvspinlock.enabled",
        "launcher/src/convert/tests.rs::features_render_on_the_machine_and_the_cpu",
    ),
    field(
        "spec.domain.features.smm",
        "launcher/src/convert/tests.rs::topology_smm_and_firmware_render_as_asked",
    ),
    field(
        "spec.domain.features.smm.enabled",
        "launcher/src/convert/tests.rs::topology_smm_and_firmware_render_as_asked",
    ),
    field(
        "spec.domain.firmware.bootloader.bios",
        "launcher/src/convert/tests.rs::topology_smm_and_firmware_render_as_asked",
    ),
    field(
        "spec.domain.firmware.bootloader.bios.useSerial",
        "launcher/tests/guest.rs::guest_pc_bios_disk_boot_configdrive_crash",
    ),
    field(
        "spec.domain.firmware.bootloader.efi",
        "launcher/src/convert/tests.rs::efi_secure_boot_uses_secboot_code_and_smm",
    ),
    field(
        "spec.domain.firmware.bootloader.efi.persistent",
        "launcher/tests/guest.rs::guest_q35_efi_paused_start_pinned_disk_boot_sigterm",
    ),
    field(
        "spec.domain.firmware.bootloader.efi.secureBoot",
        "launcher/src/convert/tests.rs::efi_secure_boot_uses_secboot_code_and_smm",
    ),
    field(
        "spec.domain.firmware.kernelBoot.container",
        "launcher/src/convert/tests.rs::kernel_boot_paths_come_from_the_container_disk_dir",
    ),
    field(
        "spec.domain.firmware.kernelBoot.container.image",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.domain.firmware.kernelBoot.container.imagePullPolicy",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.domain.firmware.kernelBoot.container.imagePullSecret",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.domain.firmware.kernelBoot.container.initrdPath",
        "launcher/src/convert/tests.rs::kernel_boot_paths_come_from_the_container_disk_dir",
    ),
    field(
        "spec.domain.firmware.kernelBoot.container.kernelPath",
        "launcher/src/convert/tests.rs::kernel_boot_paths_come_from_the_container_disk_dir",
    ),
    field(
        "spec.domain.firmware.kernelBoot.kernelArgs",
        "launcher/src/convert/tests.rs::kernel_boot_paths_come_from_the_container_disk_dir",
    ),
    field(
        "spec.domain.firmware.serial",
        "launcher/src/convert/tests.rs::efi_secure_boot_uses_secboot_code_and_smm",
    ),
    field(
        "spec.domain.firmware.uuid",
        "launcher/src/convert/tests.rs::topology_smm_and_firmware_render_as_asked",
    ),
    field(
        "spec.domain.ioThreadsPolicy",
        "launcher/src/convert/tests.rs::io_threads_are_shared_or_dedicated_as_kubevirt_assigns_them",
    ),
    field(
        "spec.domain.machine.type",
        "launcher/src/convert/tests.rs::efi_secure_boot_uses_secboot_code_and_smm",
    ),
    field(
        "spec.domain.memory.guest",
        "launcher/src/convert/tests.rs::hugepages_need_whole_pages",
    ),
    field(
        "spec.domain.memory.hugepages",
        "launcher/src/convert/tests.rs::hugepages_need_whole_pages",
    ),
    field(
        "spec.domain.memory.hugepages.pageSize",
        "launcher/src/convert/tests.rs::hugepages_need_whole_pages",
    ),
    field(
        "spec.domain.resources.limits",
        "controller/src/template.rs::resources_include_overhead_and_devices",
    ),
    field(
        "spec.domain.resources.requests",
        "controller/src/template.rs::resources_include_overhead_and_devices",
    ),
    field(
        "spec.evictionStrategy",
        "controller/tests/cluster.rs::marked_vmis_and_a_drain_tainted_node_get_evacuation_migrations",
    ),
    field(
        "spec.networks",
        "launcher/src/convert/tests.rs::interfaces_use_taps_by_position",
    ),
    field(
        "spec.networks[].name",
        "launcher/src/convert/tests.rs::interfaces_use_taps_by_position",
    ),
    field(
        "spec.networks[].pod",
        "launcher/tests/network.rs::guest_masquerade_dhcp_ports_status_and_resync",
    ),
    field(
        "spec.networks[].pod.vmIPv6NetworkCIDR",
        "network/src/plan.rs::ipv6_guest_network_defaults_and_is_checked",
    ),
    field(
        "spec.networks[].pod.vmNetworkCIDR",
        "network/src/plan.rs::vm_network_cidr_is_used_and_checked",
    ),
    field(
        "spec.livenessProbe",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.livenessProbe.exec",
        "controller/src/template.rs::probes_become_the_compute_containers",
    ),
    field(
        "spec.livenessProbe.exec.command",
        "controller/src/template.rs::probes_become_the_compute_containers",
    ),
    field(
        "spec.livenessProbe.failureThreshold",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.livenessProbe.guestAgentPing",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    subtree(
        "spec.livenessProbe.httpGet",
        "controller/src/template.rs::probes_become_the_compute_containers",
    ),
    field(
        "spec.livenessProbe.initialDelaySeconds",
        "controller/src/template.rs::probes_become_the_compute_containers",
    ),
    field(
        "spec.livenessProbe.periodSeconds",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.livenessProbe.successThreshold",
        "api/tests/validation.rs::each_mistake_is_reported_at_its_path",
    ),
    subtree(
        "spec.livenessProbe.tcpSocket",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.livenessProbe.timeoutSeconds",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.readinessProbe",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.readinessProbe.exec",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.readinessProbe.exec.command",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.readinessProbe.failureThreshold",
        "controller/src/template.rs::probes_become_the_compute_containers",
    ),
    field(
        "spec.readinessProbe.guestAgentPing",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    subtree(
        "spec.readinessProbe.httpGet",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.readinessProbe.initialDelaySeconds",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.readinessProbe.periodSeconds",
        "controller/src/template.rs::probes_become_the_compute_containers",
    ),
    field(
        "spec.readinessProbe.successThreshold",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    subtree(
        "spec.readinessProbe.tcpSocket",
        "controller/src/template.rs::probes_become_the_compute_containers",
    ),
    field(
        "spec.readinessProbe.timeoutSeconds",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.nodeSelector",
        "controller/src/template.rs::node_selector_adds_schedulable",
    ),
    field(
        "spec.startStrategy",
        "launcher/tests/guest.rs::guest_q35_efi_paused_start_pinned_disk_boot_sigterm",
    ),
    field(
        "spec.terminationGracePeriodSeconds",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    subtree(
        "spec.tolerations",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive",
        "launcher/tests/guest.rs::guest_pc_bios_disk_boot_configdrive_crash",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive.networkData",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive.networkDataBase64",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive.userData",
        "launcher/tests/guest.rs::guest_pc_bios_disk_boot_configdrive_crash",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive.userDataBase64",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud.networkData",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud.networkDataBase64",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud.userData",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud.userDataBase64",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive.networkDataSecretRef",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive.networkDataSecretRef.name",
        "controller/src/template.rs::config_drive_secret_references_mount_their_keys",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive.secretRef",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitConfigDrive.secretRef.name",
        "controller/src/template.rs::config_drive_secret_references_mount_their_keys",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud.networkDataSecretRef",
        "launcher/src/convert/tests.rs::cloud_init_network_data_and_base64_forms_reach_the_seed",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud.networkDataSecretRef.name",
        "controller/tests/golden.rs::config_volumes_launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud.secretRef",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.volumes[].cloudInitNoCloud.secretRef.name",
        "controller/tests/golden.rs::config_volumes_launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].configMap",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.volumes[].configMap.name",
        "controller/tests/golden.rs::config_volumes_launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].configMap.optional",
        "controller/tests/golden.rs::config_volumes_launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].configMap.volumeLabel",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.volumes[].downwardAPI",
        "launcher/src/convert/tests.rs::config_volumes_become_iso_disks_at_kubevirts_paths",
    ),
    field(
        "spec.volumes[].downwardAPI.volumeLabel",
        "launcher/src/convert/tests.rs::config_volumes_become_iso_disks_at_kubevirts_paths",
    ),
    field(
        "spec.volumes[].secret",
        "launcher/src/convert/tests.rs::config_volumes_become_iso_disks_at_kubevirts_paths",
    ),
    field(
        "spec.volumes[].secret.optional",
        "controller/tests/golden.rs::config_volumes_launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].secret.secretName",
        "controller/tests/golden.rs::config_volumes_launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].secret.volumeLabel",
        "launcher/src/convert/tests.rs::config_volumes_become_iso_disks_at_kubevirts_paths",
    ),
    field(
        "spec.volumes[].serviceAccount",
        "launcher/src/convert/tests.rs::config_volumes_become_iso_disks_at_kubevirts_paths",
    ),
    field(
        "spec.volumes[].serviceAccount.serviceAccountName",
        "controller/tests/golden.rs::config_volumes_launcher_pod_matches_golden",
    ),
    subtree(
        "spec.volumes[].downwardAPI.fields",
        "controller/tests/golden.rs::config_volumes_launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].containerDisk",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.volumes[].containerDisk.image",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].containerDisk.path",
        "handler/tests/mounts.rs::kernel_boot_files_and_a_custom_disk_path",
    ),
    field(
        "spec.volumes[].emptyDisk",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.volumes[].emptyDisk.capacity",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.volumes[].hostDisk",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.volumes[].hostDisk.capacity",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.volumes[].hostDisk.path",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.volumes[].hostDisk.type",
        "launcher/tests/guest.rs::guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown",
    ),
    field(
        "spec.volumes[].name",
        "launcher/src/convert/tests.rs::full_vmi_converts",
    ),
    field(
        "spec.volumes[].ephemeral",
        "launcher/tests/guest.rs::guest_q35_pvc_filesystem_and_block_on_hugepages",
    ),
    field(
        "spec.volumes[].ephemeral.persistentVolumeClaim.claimName",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].ephemeral.persistentVolumeClaim.readOnly",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].persistentVolumeClaim",
        "launcher/src/convert/tests.rs::pvcs_are_files_or_block_devices_and_hotpluggable_ones_get_a_port",
    ),
    field(
        "spec.volumes[].persistentVolumeClaim.claimName",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].persistentVolumeClaim.hotpluggable",
        "launcher/src/convert/tests.rs::pvcs_are_files_or_block_devices_and_hotpluggable_ones_get_a_port",
    ),
    field(
        "spec.volumes[].persistentVolumeClaim.readOnly",
        "launcher/src/convert/tests.rs::pvcs_are_files_or_block_devices_and_hotpluggable_ones_get_a_port",
    ),
    subtree(
        "spec.dnsConfig",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.dnsPolicy",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    // KubeVirt gives port names no meaning beyond being unique, which validation checks.
    field(
        "spec.domain.devices.interfaces[].ports[].name",
        "api/tests/validation.rs::each_mistake_is_reported_at_its_path",
    ),
    field(
        "spec.domain.resources.overcommitGuestOverhead",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.hostname",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.priorityClassName",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.schedulerName",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.serviceAccountName",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.subdomain",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    subtree(
        "spec.topologySpreadConstraints",
        "controller/tests/golden.rs::kernel_boot_launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].containerDisk.imagePullPolicy",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
    field(
        "spec.volumes[].containerDisk.imagePullSecret",
        "controller/tests/golden.rs::launcher_pod_matches_golden",
    ),
];

/// Fields validation refuses by name.
pub const REFUSED: &[Refused] = &[
    refused("spec.accessCredentials"),
    refused("spec.domain.chassis"),
    refused("spec.domain.clock.timer.hpet.tickPolicy"),
    refused("spec.domain.clock.timer.hyperv.present"),
    refused_value("spec.domain.clock.timer.pit.present", "false"),
    refused_value("spec.domain.clock.timer.rtc.present", "false"),
    refused("spec.domain.cpu.numa"),
    refused("spec.domain.cpu.realtime"),
    refused("spec.domain.devices.autoattachVSOCK"),
    refused("spec.domain.devices.clientPassthrough"),
    refused("spec.domain.devices.disks[].blockSize"),
    refused_value("spec.domain.devices.disks[].cdrom.tray", r#""open""#),
    refused("spec.domain.devices.disks[].changedBlockTracking"),
    refused("spec.domain.devices.disks[].lun"),
    refused("spec.domain.devices.disks[].tag"),
    refused("spec.domain.devices.downwardMetrics"),
    refused("spec.domain.devices.gpus"),
    refused("spec.domain.devices.hostDevices"),
    refused("spec.domain.devices.interfaces[].binding"),
    refused("spec.domain.devices.interfaces[].dhcpOptions"),
    discontinued("spec.domain.devices.interfaces[].macvtap"),
    discontinued("spec.domain.devices.interfaces[].passt"),
    refused("spec.domain.devices.interfaces[].passtBinding"),
    refused("spec.domain.devices.interfaces[].portRanges"),
    discontinued("spec.domain.devices.interfaces[].slirp"),
    refused("spec.domain.devices.interfaces[].sriov"),
    refused_value("spec.domain.devices.interfaces[].state", r#""absent""#),
    refused("spec.domain.devices.interfaces[].tag"),
    refused("spec.domain.devices.logSerialConsole"),
    refused("spec.domain.devices.panicDevices"),
    refused("spec.domain.devices.sound"),
    refused("spec.domain.devices.tpm"),
    refused("spec.domain.devices.watchdog.diag288"),
    refused_value("spec.domain.features.apic.enabled", "false"),
    refused("spec.domain.features.apic.endOfInterrupt"),
    refused("spec.domain.features.hyperv"),
    refused("spec.domain.features.hypervPassthrough"),
    refused("spec.domain.firmware.acpi"),
    refused("spec.domain.ioThreads"),
    refused("spec.domain.launchSecurity"),
    refused("spec.domain.memory.reservedOverhead"),
    refused_value("spec.domain.rebootPolicy", r#""Terminate""#),
    refused("spec.networks[].multus"),
    refused("spec.networks[].resourceClaim"),
    refused("spec.resourceClaims"),
    refused("spec.utilityVolumes"),
    refused("spec.volumes[].containerPath"),
    refused("spec.volumes[].dataVolume"),
    refused("spec.volumes[].downwardMetrics"),
    refused("spec.volumes[].hostDisk.shared"),
    refused("spec.volumes[].memoryDump"),
    refused("spec.volumes[].sysprep"),
];

/// Known gaps: accepted, not honoured, and not refusable yet.
pub const ACCEPTED_BUT_IGNORED: &[Gap] = &[
    Gap {
        path: "spec.domain.cpu.maxSockets",
        why: "KubeVirt's defaults (LiveUpdate rollout) set it on every VMI; the launcher \
              starts the vCPUs of sockets x cores x threads and has no CPU hotplug",
    },
    Gap {
        path: "spec.domain.memory.maxGuest",
        why: "KubeVirt's defaults (LiveUpdate rollout) set it on every VMI of 1Gi or more; the \
              launcher has no memory hotplug",
    },
];

/// Objects with no effect of their own; each of their fields is listed.
pub const CONTAINERS: &[&str] = &[
    "spec.domain",
    "spec.domain.clock.timer",
    "spec.domain.cpu",
    "spec.domain.devices",
    "spec.domain.features",
    "spec.domain.features.acpi",
    "spec.domain.features.apic",
    "spec.domain.features.kvm",
    "spec.domain.firmware",
    "spec.domain.firmware.bootloader",
    "spec.domain.firmware.kernelBoot",
    "spec.domain.machine",
    "spec.domain.memory",
    "spec.domain.resources",
    "spec.volumes[].ephemeral.persistentVolumeClaim",
];
