//! `VirtualMachineInstance` status.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::{ConditionStatus, Preserved, string_enum};
use crate::vmi::Machine;

string_enum! {
    /// Where a VMI is in its life.
    pub enum VirtualMachineInstancePhase {
        /// Accepted, no pod yet.
        Pending = "Pending",
        /// A launcher pod exists but is not running yet.
        Scheduling = "Scheduling",
        /// The launcher pod runs; virt-handler takes over.
        Scheduled = "Scheduled",
        /// The guest runs.
        Running = "Running",
        /// The guest stopped voluntarily.
        Succeeded = "Succeeded",
        /// The guest crashed or was lost.
        Failed = "Failed",
        /// Waiting for a migration source (decentralized migration).
        WaitingForSync = "WaitingForSync",
        /// The state cannot be obtained.
        Unknown = "Unknown",
    }
}

impl VirtualMachineInstancePhase {
    /// Succeeded or Failed: the VMI will not run again.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

string_enum! {
    /// VMI condition types.
    pub enum VirtualMachineInstanceConditionType {
        Provisioning = "Provisioning",
        Ready = "Ready",
        Synchronized = "Synchronized",
        Paused = "Paused",
        AgentConnected = "AgentConnected",
        AccessCredentialsSynchronized = "AccessCredentialsSynchronized",
        AgentVersionNotSupported = "AgentVersionNotSupported",
        LiveMigratable = "LiveMigratable",
        StorageLiveMigratable = "StorageLiveMigratable",
        HotVcpuChange = "HotVCPUChange",
        HotMemoryChange = "HotMemoryChange",
        VolumesChange = "VolumesChange",
        DataVolumesReady = "DataVolumesReady",
        MigrationRequired = "MigrationRequired",
        EvictionRequested = "EvictionRequested",
        SoftwareEmulation = "SoftwareEmulation",
    }
}

/// A condition of a VMI (and, with other type enums, of the other kinds).
#[skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition<T> {
    /// Condition type.
    #[serde(rename = "type")]
    pub type_: T,
    /// True, False, Unknown.
    pub status: ConditionStatus,
    /// Last time the condition was probed.
    pub last_probe_time: Option<Time>,
    /// Last time the status changed.
    pub last_transition_time: Option<Time>,
    /// Machine-readable reason.
    pub reason: Option<String>,
    /// Human-readable message.
    pub message: Option<String>,
}

/// A VMI condition.
pub type VirtualMachineInstanceCondition = Condition<VirtualMachineInstanceConditionType>;

/// When a phase was entered.
#[skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PhaseTransitionTimestamp<P> {
    /// The phase.
    pub phase: Option<P>,
    /// When it was entered.
    pub phase_transition_timestamp: Option<Time>,
}

/// The status a VMI reports.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceStatus {
    /// Node the VMI runs on.
    pub node_name: Option<String>,
    /// CamelCase reason for the current state.
    pub reason: Option<String>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<VirtualMachineInstanceCondition>,
    /// Phase.
    pub phase: Option<VirtualMachineInstancePhase>,
    /// When each phase was entered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phase_transition_timestamps: Vec<PhaseTransitionTimestamp<VirtualMachineInstancePhase>>,
    /// Guest network interfaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<VirtualMachineInstanceNetworkInterface>,
    /// Guest OS information from the guest agent.
    #[serde(rename = "guestOSInfo")]
    pub guest_os_info: Option<VirtualMachineInstanceGuestOsInfo>,
    /// Live migration state.
    pub migration_state: Option<VirtualMachineInstanceMigrationState>,
    /// LiveMigration or BlockMigration.
    pub migration_method: Option<String>,
    /// Migration transport (`Unix`).
    pub migration_transport: Option<String>,
    /// Pod QoS class of the launcher.
    pub qos_class: Option<String>,
    /// Launcher image running the VMI.
    pub launcher_container_image_version: Option<String>,
    /// Node being evacuated.
    pub evacuation_node_name: Option<String>,
    /// Launcher pod UID -> node name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub active_pods: BTreeMap<String, String>,
    /// Per-volume status.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_status: Vec<VolumeStatus>,
    /// Kernel boot checksums.
    pub kernel_boot_status: Option<Preserved>,
    /// `frozen` while a freeze was requested.
    #[serde(rename = "fsFreezeStatus")]
    pub fs_freeze_status: Option<String>,
    /// TSC frequency hints.
    pub topology_hints: Option<Preserved>,
    /// VM revision for online snapshots.
    pub virtual_machine_revision_name: Option<String>,
    /// UID the launcher runs QEMU as (107 when non-root).
    pub runtime_user: Option<u64>,
    /// Allocated VSOCK CID.
    #[serde(rename = "VSOCKCID")]
    pub vsock_cid: Option<u32>,
    /// SELinux context of the launcher.
    pub selinux_context: Option<String>,
    /// Machine type in use.
    pub machine: Option<Machine>,
    /// CPU topology in use.
    #[serde(rename = "currentCPUTopology")]
    pub current_cpu_topology: Option<CpuTopology>,
    /// Memory in use.
    pub memory: Option<MemoryStatus>,
    /// Volumes moved by storage migration.
    pub migrated_volumes: Option<Preserved>,
    /// Changed block tracking state.
    pub changed_block_tracking: Option<Preserved>,
}

impl VirtualMachineInstanceStatus {
    /// The condition of this type, if present.
    pub fn condition(
        &self,
        type_: &VirtualMachineInstanceConditionType,
    ) -> Option<&VirtualMachineInstanceCondition> {
        self.conditions.iter().find(|c| &c.type_ == type_)
    }
}

/// CPU topology in use.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuTopology {
    /// Cores per socket.
    pub cores: Option<u32>,
    /// Sockets.
    pub sockets: Option<u32>,
    /// Threads per core.
    pub threads: Option<u32>,
}

/// Memory in use.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryStatus {
    /// Memory at boot.
    pub guest_at_boot: Option<Quantity>,
    /// Memory now.
    pub guest_current: Option<Quantity>,
    /// Memory requested by hotplug.
    pub guest_requested: Option<Quantity>,
    /// Launcher overhead.
    pub memory_overhead: Option<Quantity>,
}

/// A guest network interface as reported.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceNetworkInterface {
    /// First IP address.
    #[serde(rename = "ipAddress")]
    pub ip: Option<String>,
    /// MAC address.
    pub mac: Option<String>,
    /// Name of the spec interface / network.
    pub name: Option<String>,
    /// All IP addresses.
    #[serde(rename = "ipAddresses", default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<String>,
    /// Pod-side interface name.
    pub pod_interface_name: Option<String>,
    /// Interface name inside the guest.
    pub interface_name: Option<String>,
    /// Where the data came from: domain, guest-agent, multus-status.
    pub info_source: Option<String>,
    /// Number of queues.
    pub queue_count: Option<i32>,
    /// `up` or `down`.
    pub link_state: Option<String>,
}

/// Guest OS information.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceGuestOsInfo {
    /// OS name.
    pub name: Option<String>,
    /// Kernel release.
    pub kernel_release: Option<String>,
    /// OS version.
    pub version: Option<String>,
    /// Pretty name.
    pub pretty_name: Option<String>,
    /// Version id.
    pub version_id: Option<String>,
    /// Kernel version.
    pub kernel_version: Option<String>,
    /// Machine (architecture).
    pub machine: Option<String>,
    /// OS id.
    pub id: Option<String>,
}

/// State of a volume.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeStatus {
    /// Volume name.
    pub name: String,
    /// Guest device target, e.g. `vda`.
    pub target: String,
    /// Volume phase.
    pub phase: Option<String>,
    /// Reason of the phase.
    pub reason: Option<String>,
    /// Message.
    pub message: Option<String>,
    /// PVC information.
    pub persistent_volume_claim_info: Option<Preserved>,
    /// Hotplug information.
    pub hotplug_volume: Option<Preserved>,
    /// Size in bytes.
    pub size: Option<i64>,
    /// Memory dump information.
    pub memory_dump_volume: Option<Preserved>,
    /// Container disk checksum.
    pub container_disk_volume: Option<Preserved>,
}

/// Live migration state of a VMI.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceMigrationState {
    /// When the migration started.
    pub start_timestamp: Option<Time>,
    /// When it ended.
    pub end_timestamp: Option<Time>,
    /// When the target saw the domain active.
    pub target_node_domain_ready_timestamp: Option<Time>,
    /// The target saw the domain start.
    pub target_node_domain_detected: Option<bool>,
    /// Target node address.
    pub target_node_address: Option<String>,
    /// Ports opened on the target node.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub target_direct_migration_node_ports: BTreeMap<String, i32>,
    /// Target node.
    pub target_node: Option<String>,
    /// Target pod.
    pub target_pod: Option<String>,
    /// Target attachment pod UID.
    #[serde(rename = "targetAttachmentPodUID")]
    pub target_attachment_pod_uid: Option<String>,
    /// Source node.
    pub source_node: Option<String>,
    /// Source pod.
    pub source_pod: Option<String>,
    /// The migration completed.
    pub completed: Option<bool>,
    /// The migration failed.
    pub failed: Option<bool>,
    /// An abort was requested.
    pub abort_requested: Option<bool>,
    /// Succeeded, Failed, Aborting.
    pub abort_status: Option<String>,
    /// Why it failed.
    pub failure_reason: Option<String>,
    /// UID of the migration object.
    #[serde(rename = "migrationUid")]
    pub migration_uid: Option<String>,
    /// PreCopy, PostCopy, Paused.
    pub mode: Option<String>,
    /// Matched migration policy.
    pub migration_policy_name: Option<String>,
    /// Migration configuration in effect.
    pub migration_configuration: Option<Preserved>,
    /// Dedicated CPUs on the target.
    #[serde(
        rename = "targetCPUSet",
        default,
        skip_serializing_if = "Vec::is_empty"
    )]
    pub target_cpu_set: Vec<i32>,
    /// NUMA topology on the target.
    pub target_node_topology: Option<String>,
    /// Source backend-storage PVC.
    #[serde(rename = "sourcePersistentStatePVCName")]
    pub source_persistent_state_pvc_name: Option<String>,
    /// Target backend-storage PVC.
    #[serde(rename = "targetPersistentStatePVCName")]
    pub target_persistent_state_pvc_name: Option<String>,
    /// State kept by the source handler.
    pub source_state: Option<Preserved>,
    /// State kept by the target handler.
    pub target_state: Option<Preserved>,
    /// `Pod` or `Migration`.
    pub migration_network_type: Option<String>,
    /// Memory overhead of the target launcher.
    pub target_memory_overhead: Option<Quantity>,
}
