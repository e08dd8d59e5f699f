//! `ClusterConfig`: the parts of the KubeVirt CR's `spec.configuration` that defaulting and
//! validation depend on, with KubeVirt's defaults filled in (`pkg/virt-config`).

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::kubevirt::{KubeVirt, KubeVirtConfiguration};
use crate::vmi::EvictionStrategy;

/// Binding of the interface KubeVirt adds when a VMI names no network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultNetworkInterface {
    /// KubeVirt's default: a linux bridge in the pod.
    Bridge,
    /// NAT in the pod.
    Masquerade,
    /// Discontinued; defaulting a VMI fails.
    Slirp,
}

/// Cluster-wide settings with KubeVirt's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    /// `developerConfiguration.useEmulation`: run with TCG when KVM is missing.
    pub use_emulation: bool,
    /// Enabled feature gates.
    pub feature_gates: Vec<String>,
    /// Default CPU model; `None` means KubeVirt's `host-model`.
    pub cpu_model: Option<String>,
    /// Default CPU request added to VMIs that request none (KubeVirt: 100m, which it does not
    /// write into the spec).
    pub cpu_request: Quantity,
    /// Default machine type for amd64 (`q35`).
    pub machine_type: String,
    /// Default architecture of VMIs.
    pub default_architecture: String,
    /// Binding of the default pod interface.
    pub default_network_interface: DefaultNetworkInterface,
    /// Whether bridge binding may be used on the pod network.
    pub permit_bridge_interface_on_pod_network: bool,
    /// Default eviction strategy (KubeVirt: `None`).
    pub eviction_strategy: EvictionStrategy,
    /// `LiveUpdate` (KubeVirt's default) lets CPU and memory be hotplugged, so defaulting
    /// sets `maxSockets` and `maxGuest`.
    pub vm_rollout_live_update: bool,
    /// `liveUpdateConfiguration.maxCpuSockets`.
    pub max_cpu_sockets: Option<u32>,
    /// `liveUpdateConfiguration.maxGuest`.
    pub max_guest: Option<Quantity>,
    /// `liveUpdateConfiguration.maxHotplugRatio` (KubeVirt: 4).
    pub max_hotplug_ratio: u32,
    /// `migrations`, KubeVirt's defaults filled in.
    pub migrations: crate::migration::MigrationConfiguration,
    /// `vmStateStorageClass`: the class of backend-storage claims (`None`: the cluster's
    /// default class, and the claims `ReadWriteOnce`).
    pub vm_state_storage_class: Option<String>,
}

/// KubeVirt's default CPU request, which `defaults` never writes into a spec.
pub const DEFAULT_CPU_REQUEST: &str = "100m";

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            use_emulation: false,
            feature_gates: Vec::new(),
            cpu_model: None,
            cpu_request: Quantity(DEFAULT_CPU_REQUEST.to_owned()),
            machine_type: "q35".to_owned(),
            default_architecture: "amd64".to_owned(),
            default_network_interface: DefaultNetworkInterface::Bridge,
            permit_bridge_interface_on_pod_network: true,
            eviction_strategy: EvictionStrategy::None,
            vm_rollout_live_update: true,
            max_cpu_sockets: None,
            max_guest: None,
            max_hotplug_ratio: 4,
            migrations: crate::migration::MigrationConfiguration::default().effective(),
            vm_state_storage_class: None,
        }
    }
}

impl ClusterConfig {
    /// The configuration of a KubeVirt CR (KubeVirt's defaults where it sets nothing).
    pub fn from_kubevirt(kv: &KubeVirt) -> Self {
        kv.spec
            .configuration
            .as_ref()
            .map(Self::from_configuration)
            .unwrap_or_default()
    }

    /// The configuration of a `spec.configuration` block.
    pub fn from_configuration(c: &KubeVirtConfiguration) -> Self {
        let mut out = Self::default();
        if let Some(dev) = &c.developer_configuration {
            out.use_emulation = dev.use_emulation.unwrap_or(false);
            out.feature_gates = dev.feature_gates.clone().unwrap_or_default();
            if let Some(disabled) = &dev.disabled_feature_gates {
                out.feature_gates.retain(|g| !disabled.contains(g));
            }
        }
        out.cpu_model = c.cpu_model.clone().filter(|m| !m.is_empty());
        if let Some(q) = &c.cpu_request {
            out.cpu_request = q.clone();
        }
        let arch = c.architecture_configuration.as_ref();
        if let Some(a) = arch.and_then(|a| a.default_architecture.clone()) {
            out.default_architecture = a;
        }
        // The per-architecture machine type wins over the deprecated top-level one.
        if let Some(m) = arch
            .and_then(|a| a.amd64.as_ref())
            .and_then(|a| a.machine_type.clone())
            .or_else(|| c.machine_type.clone())
            .filter(|m| !m.is_empty())
        {
            out.machine_type = m;
        }
        if let Some(net) = &c.network {
            out.default_network_interface = match net.default_network_interface.as_deref() {
                Some("masquerade") => DefaultNetworkInterface::Masquerade,
                Some("slirp") => DefaultNetworkInterface::Slirp,
                _ => DefaultNetworkInterface::Bridge,
            };
            out.permit_bridge_interface_on_pod_network =
                net.permit_bridge_interface_on_pod_network.unwrap_or(true);
        }
        if let Some(e) = &c.eviction_strategy {
            out.eviction_strategy = e.clone();
        }
        if let Some(s) = &c.vm_rollout_strategy {
            out.vm_rollout_live_update = s == "LiveUpdate";
        }
        if let Some(lu) = &c.live_update_configuration {
            out.max_cpu_sockets = lu.max_cpu_sockets;
            out.max_guest.clone_from(&lu.max_guest);
            if let Some(r) = lu.max_hotplug_ratio {
                out.max_hotplug_ratio = r;
            }
        }
        if let Some(m) = c.migrations.as_ref().and_then(|m| {
            serde_json::from_value::<crate::migration::MigrationConfiguration>(m.0.clone()).ok()
        }) {
            out.migrations = m.effective();
        }
        out.vm_state_storage_class = c.vm_state_storage_class.clone().filter(|s| !s.is_empty());
        out
    }

    /// Whether a feature gate is enabled.
    pub fn has_feature_gate(&self, gate: &str) -> bool {
        self.feature_gates.iter().any(|g| g == gate)
    }
}
