//! `KubeVirt`: the installation of KubeVirt itself, and its cluster-wide configuration.

// `printcolumn(...)` repeats `type_ = ...`; clippy reads the derive's arguments as duplicated
// attributes, which they are not.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, LocalObjectReference, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::{Preserved, PullPolicy, string_enum};
use crate::status::Condition;
use crate::vmi::EvictionStrategy;

/// The `spec` of a `KubeVirt` CR.
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "KubeVirt",
    namespaced,
    status = "KubeVirtStatus",
    derive = "PartialEq",
    shortname = "kv",
    shortname = "kvs",
    category = "all",
    crates(kube_core = "::kube_core"),
    doc = "KubeVirt represents the object deploying all KubeVirt resources",
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase")
)]
#[serde(rename_all = "camelCase")]
pub struct KubeVirtSpec {
    /// Tag of the component images.
    pub image_tag: Option<String>,
    /// Registry the component images come from.
    pub image_registry: Option<String>,
    /// Pull policy of the component images.
    pub image_pull_policy: Option<PullPolicy>,
    /// Pull secrets of the component images.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Namespace of the Prometheus service account.
    pub monitor_namespace: Option<String>,
    /// Namespace of the ServiceMonitor.
    pub service_monitor_namespace: Option<String>,
    /// Prometheus service account.
    pub monitor_account: Option<String>,
    /// How running VMIs are updated to new components.
    pub workload_update_strategy: Option<Preserved>,
    /// `RemoveWorkloads` or `BlockUninstallIfWorkloadsExist`.
    pub uninstall_strategy: Option<String>,
    /// Certificate rotation settings.
    pub certificate_rotate_strategy: Option<Preserved>,
    /// Product name label.
    pub product_name: Option<String>,
    /// Product version label.
    pub product_version: Option<String>,
    /// Product component label.
    pub product_component: Option<String>,
    /// Cluster-wide configuration.
    pub configuration: Option<KubeVirtConfiguration>,
    /// Patches to the generated components.
    pub customize_components: Option<Preserved>,
    /// Placement of the control plane (virt-api, virt-controller).
    pub infra: Option<ComponentConfig>,
    /// Placement of the node components (virt-handler) and VMIs.
    pub workloads: Option<ComponentConfig>,
    /// Port for decentralized migration synchronization.
    pub synchronization_port: Option<String>,
}

/// Placement of a group of components.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComponentConfig {
    /// Where the components run.
    pub node_placement: Option<NodePlacement>,
    /// Replicas of the control-plane deployments.
    pub replicas: Option<u8>,
}

/// Node placement.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePlacement {
    /// Node labels to match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Affinity.
    pub affinity: Option<Affinity>,
    /// Tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
}

/// Cluster-wide configuration (`spec.configuration`).
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KubeVirtConfiguration {
    /// Default CPU model of VMIs that set none.
    #[serde(rename = "cpuModel")]
    pub cpu_model: Option<String>,
    /// Default CPU request of VMIs.
    pub cpu_request: Option<Quantity>,
    /// Developer settings: emulation, feature gates.
    pub developer_configuration: Option<DeveloperConfiguration>,
    /// Emulated machine type patterns (deprecated, see architectureConfiguration).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub emulated_machines: Vec<String>,
    /// Pull policy of container disks.
    pub image_pull_policy: Option<PullPolicy>,
    /// Migration settings.
    pub migrations: Option<Preserved>,
    /// Default machine type (deprecated, see architectureConfiguration).
    pub machine_type: Option<String>,
    /// Network settings.
    pub network: Option<NetworkConfiguration>,
    /// OVMF path (deprecated, see architectureConfiguration).
    pub ovmf_path: Option<String>,
    /// SELinux type of the launcher.
    pub selinux_launcher_type: Option<String>,
    /// Default runtime class of launcher pods.
    pub default_runtime_class: Option<String>,
    /// SMBIOS defaults.
    pub smbios: Option<Preserved>,
    /// Per-architecture settings.
    pub architecture_configuration: Option<ArchConfiguration>,
    /// Minimal CPU model for host-model.
    #[serde(rename = "minCPUModel")]
    pub min_cpu_model: Option<String>,
    /// CPU models not to use.
    #[serde(
        rename = "obsoleteCPUModels",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub obsolete_cpu_models: BTreeMap<String, bool>,
    /// Memory balloon statistics period in seconds.
    pub mem_balloon_stats_period: Option<u32>,
    /// Supported guest agent versions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub supported_guest_agent_versions: Vec<String>,
    /// Devices that may be passed through.
    pub permitted_host_devices: Option<Preserved>,
    /// Mediated devices.
    pub mediated_devices_configuration: Option<Preserved>,
    /// Maximum VMIs per node.
    pub virtual_machine_instances_per_node: Option<i32>,
    /// virt-api client settings.
    pub api_configuration: Option<Preserved>,
    /// Webhook client settings.
    pub webhook_configuration: Option<Preserved>,
    /// virt-controller client settings.
    pub controller_configuration: Option<Preserved>,
    /// virt-handler client settings.
    pub handler_configuration: Option<Preserved>,
    /// TLS settings.
    pub tls_configuration: Option<Preserved>,
    /// Seccomp settings.
    pub seccomp_configuration: Option<Preserved>,
    /// VM options.
    pub virtual_machine_options: Option<Preserved>,
    /// Default eviction strategy of VMIs.
    pub eviction_strategy: Option<EvictionStrategy>,
    /// Extra memory overhead ratio.
    pub additional_guest_memory_overhead_ratio: Option<String>,
    /// Support container resources.
    pub support_container_resources: Option<Preserved>,
    /// Live update limits.
    pub live_update_configuration: Option<LiveUpdateConfiguration>,
    /// Storage class for VM state.
    pub vm_state_storage_class: Option<String>,
    /// `Stage` or `LiveUpdate` for VM spec changes.
    pub vm_rollout_strategy: Option<String>,
    /// Common instance types deployment.
    pub common_instancetypes_deployment: Option<Preserved>,
    /// Instance type settings.
    pub instancetype: Option<Preserved>,
    /// KSM settings.
    pub ksm_configuration: Option<Preserved>,
    /// Persistent reservation settings.
    pub persistent_reservation_configuration: Option<Preserved>,
    /// Namespaces where CPU limits are set automatically.
    #[serde(rename = "autoCPULimitNamespaceLabelSelector")]
    pub auto_cpu_limit_namespace_label_selector: Option<Preserved>,
    /// Role aggregation strategy.
    pub role_aggregation_strategy: Option<String>,
    /// Changed block tracking selectors.
    pub changed_block_tracking_label_selectors: Option<Preserved>,
    /// Confidential compute settings.
    pub confidential_compute: Option<Preserved>,
    /// Hypervisors.
    pub hypervisors: Option<Preserved>,
    /// virt-template deployment.
    pub virt_template_deployment: Option<Preserved>,
}

/// Developer settings.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeveloperConfiguration {
    /// Enabled feature gates (KubeVirt's own CR writes `featureGates: []`, so an empty list is
    /// kept apart from an absent one).
    pub feature_gates: Option<Vec<String>>,
    /// Disabled feature gates.
    pub disabled_feature_gates: Option<Vec<String>>,
    /// Allow software emulation (TCG) when KVM is missing.
    pub use_emulation: Option<bool>,
    /// vCPU to pCPU allocation ratio.
    pub cpu_allocation_ratio: Option<i32>,
    /// Memory overcommit percentage.
    pub memory_overcommit: Option<i32>,
    /// Node selectors for VMIs.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selectors: BTreeMap<String, String>,
    /// PVC space tolerance.
    #[serde(rename = "pvcTolerateLessSpaceUpToPercent")]
    pub pvc_tolerate_less_space_up_to_percent: Option<i32>,
    /// Minimum reserved PVC bytes.
    #[serde(rename = "minimumReservePVCBytes")]
    pub minimum_reserve_pvc_bytes: Option<u64>,
    /// Minimum TSC frequency.
    #[serde(rename = "minimumClusterTSCFrequency")]
    pub minimum_cluster_tsc_frequency: Option<i64>,
    /// Component log verbosity.
    pub log_verbosity: Option<Preserved>,
    /// Enable the cluster profiler.
    pub cluster_profiler: Option<bool>,
    /// Disk verification limits.
    pub disk_verification: Option<Preserved>,
}

/// Network settings.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfiguration {
    /// Binding of the default pod interface: bridge (KubeVirt's default) or masquerade.
    #[serde(rename = "defaultNetworkInterface")]
    pub default_network_interface: Option<String>,
    /// Deprecated slirp permission.
    pub permit_slirp_interface: Option<bool>,
    /// Allow bridge binding on the pod network (default true).
    pub permit_bridge_interface_on_pod_network: Option<bool>,
    /// Network binding plugins.
    pub binding: Option<Preserved>,
}

/// Per-architecture settings.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArchConfiguration {
    /// x86_64.
    pub amd64: Option<ArchSpecificConfiguration>,
    /// aarch64.
    pub arm64: Option<ArchSpecificConfiguration>,
    /// ppc64le.
    pub ppc64le: Option<ArchSpecificConfiguration>,
    /// s390x.
    pub s390x: Option<ArchSpecificConfiguration>,
    /// Default architecture of VMIs.
    pub default_architecture: Option<String>,
}

/// Settings of one architecture.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArchSpecificConfiguration {
    /// OVMF directory.
    pub ovmf_path: Option<String>,
    /// Allowed machine type patterns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub emulated_machines: Vec<String>,
    /// Default machine type.
    pub machine_type: Option<String>,
}

/// Live update limits.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LiveUpdateConfiguration {
    /// Maximum hotplug sockets.
    pub max_cpu_sockets: Option<u32>,
    /// Maximum hotplug memory.
    pub max_guest: Option<Quantity>,
    /// Ratio of maximum to initial resources.
    pub max_hotplug_ratio: Option<u32>,
}

string_enum! {
    /// Install phases.
    pub enum KubeVirtPhase {
        Deploying = "Deploying",
        Deployed = "Deployed",
        Deleting = "Deleting",
        Deleted = "Deleted",
    }
}

string_enum! {
    /// KubeVirt CR condition types.
    pub enum KubeVirtConditionType {
        Available = "Available",
        Progressing = "Progressing",
        Degraded = "Degraded",
        Created = "Created",
        Synchronized = "Synchronized",
    }
}

/// A KubeVirt CR condition.
pub type KubeVirtCondition = Condition<KubeVirtConditionType>;

/// One generated resource and the generation last applied.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GenerationStatus {
    /// API group.
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// Namespace.
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
    /// Last generation applied.
    pub last_generation: i64,
    /// Hash of the applied object.
    pub hash: Option<String>,
}

/// The status of the installation.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KubeVirtStatus {
    /// Phase.
    pub phase: Option<KubeVirtPhase>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<KubeVirtCondition>,
    /// Version of the operator.
    pub operator_version: Option<String>,
    /// Version being installed.
    pub target_kube_virt_version: Option<String>,
    /// Registry being installed from.
    pub target_kube_virt_registry: Option<String>,
    /// Deployment config being installed.
    pub target_deployment_config: Option<String>,
    /// Id of the deployment being installed.
    #[serde(rename = "targetDeploymentID")]
    pub target_deployment_id: Option<String>,
    /// Version installed.
    pub observed_kube_virt_version: Option<String>,
    /// Registry installed from.
    pub observed_kube_virt_registry: Option<String>,
    /// Deployment config installed.
    pub observed_deployment_config: Option<String>,
    /// Id of the deployment installed.
    #[serde(rename = "observedDeploymentID")]
    pub observed_deployment_id: Option<String>,
    /// VMIs running on outdated components.
    pub outdated_virtual_machine_instance_workloads: Option<i32>,
    /// Generations of the generated resources.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub generations: Vec<GenerationStatus>,
    /// Generation of the CR last reconciled.
    pub observed_generation: Option<i64>,
    /// Default architecture of the cluster.
    pub default_architecture: Option<String>,
    /// Addresses for decentralized migration.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub synchronization_addresses: Vec<String>,
}
