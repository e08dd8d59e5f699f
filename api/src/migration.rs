//! `VirtualMachineInstanceMigration`: a request to live-migrate one VMI.

// `printcolumn(...)` repeats `type_ = ...`; clippy reads the derive's arguments as duplicated
// attributes, which they are not.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::VirtualMachineInstance;
use crate::common::string_enum;
use crate::status::{Condition, PhaseTransitionTimestamp, VirtualMachineInstanceMigrationState};
use crate::vmi::{DiskTargetKind, InterfaceBinding, NetworkSource, VolumeSource};

/// The `spec` of a `VirtualMachineInstanceMigration`.
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstanceMigration",
    namespaced,
    status = "VirtualMachineInstanceMigrationStatus",
    derive = "PartialEq",
    shortname = "vmim",
    shortname = "vmims",
    category = "all",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachineInstanceMigration requests and tracks the live migration of one VMI to another node.",
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "The current phase of VM instance migration"
    ),
    printcolumn(
        name = "VMI",
        type_ = "string",
        json_path = ".spec.vmiName",
        description = "The name of the VMI to perform the migration on"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceMigrationSpec {
    /// The VMI to migrate.
    pub vmi_name: Option<String>,
    /// Extra node selector for the target pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub added_node_selector: BTreeMap<String, String>,
    /// Decentralized migration: the receiving side.
    pub receive: Option<MigrationTarget>,
    /// Decentralized migration: the sending side.
    pub send_to: Option<MigrationSource>,
    /// system-critical, user-triggered, system-maintenance.
    pub priority: Option<String>,
}

/// Decentralized migration receiver.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MigrationTarget {
    /// Migration id shared by both sides.
    #[serde(rename = "migrationID")]
    pub migration_id: String,
}

/// Decentralized migration sender.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MigrationSource {
    /// Migration id shared by both sides.
    #[serde(rename = "migrationID")]
    pub migration_id: String,
    /// Where to connect.
    #[serde(rename = "connectURL")]
    pub connect_url: String,
}

string_enum! {
    /// Migration phases.
    pub enum VirtualMachineInstanceMigrationPhase {
        Pending = "Pending",
        Scheduling = "Scheduling",
        Scheduled = "Scheduled",
        PreparingTarget = "PreparingTarget",
        TargetReady = "TargetReady",
        Running = "Running",
        Succeeded = "Succeeded",
        Failed = "Failed",
        WaitingForSync = "WaitingForSync",
        Synchronizing = "Synchronizing",
    }
}

string_enum! {
    /// Migration condition types.
    pub enum VirtualMachineInstanceMigrationConditionType {
        AbortRequested = "migrationAbortRequested",
        RejectedByResourceQuota = "migrationRejectedByResourceQuota",
        BlockedByUtilityVolumes = "migrationBlockedByUtilityVolumes",
        DecentralizedMigrationBlocked = "decentralizedMigrationBlocked",
        BlockedByBackup = "migrationBlockedByBackup",
    }
}

/// A migration condition.
pub type VirtualMachineInstanceMigrationCondition =
    Condition<VirtualMachineInstanceMigrationConditionType>;

/// The status of a migration.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceMigrationStatus {
    /// Phase.
    pub phase: Option<VirtualMachineInstanceMigrationPhase>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<VirtualMachineInstanceMigrationCondition>,
    /// When each phase was entered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phase_transition_timestamps:
        Vec<PhaseTransitionTimestamp<VirtualMachineInstanceMigrationPhase>>,
    /// Copy of the VMI's migration state.
    pub migration_state: Option<VirtualMachineInstanceMigrationState>,
    /// Addresses for decentralized migration.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub synchronization_addresses: Vec<String>,
}

/// KubeVirt's `MigrationConfiguration` (`spec.configuration.migrations` of the KubeVirt CR, and
/// `status.migrationState.migrationConfiguration` of a migrating VMI, where virt-controller
/// hands the settings in effect to virt-handler). [`MigrationConfiguration::effective`] fills
/// KubeVirt's defaults.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationConfiguration {
    pub parallel_migrations_per_cluster: Option<u32>,
    pub parallel_outbound_migrations_per_node: Option<u32>,
    /// Bytes per second, a quantity; `0Mi`: unlimited.
    pub bandwidth_per_migration: Option<k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    #[serde(rename = "completionTimeoutPerGiB")]
    pub completion_timeout_per_gib: Option<u64>,
    pub progress_timeout: Option<u64>,
    pub unsafe_migration_override: Option<bool>,
    pub allow_auto_converge: Option<bool>,
    pub allow_post_copy: Option<bool>,
    pub allow_workload_disruption: Option<bool>,
    #[serde(rename = "disableTLS")]
    pub disable_tls: Option<bool>,
    /// A dedicated migration network (Multus); not supported by kubevirt-rs.
    pub network: Option<String>,
    pub node_drain_taint_key: Option<String>,
    pub match_selinux_level_on_migration: Option<bool>,
}

/// The drain taint's key when the KubeVirt CR names none (`migrations.nodeDrainTaintKey`).
pub const DEFAULT_NODE_DRAIN_TAINT_KEY: &str = "kubevirt.io/drain";

impl MigrationConfiguration {
    /// Every field set: this configuration's, else KubeVirt's default
    /// (`pkg/virt-config/virt-config.go`).
    #[must_use]
    pub fn effective(&self) -> Self {
        Self {
            parallel_migrations_per_cluster: Some(
                self.parallel_migrations_per_cluster.unwrap_or(5),
            ),
            parallel_outbound_migrations_per_node: Some(
                self.parallel_outbound_migrations_per_node.unwrap_or(2),
            ),
            bandwidth_per_migration: Some(self.bandwidth_per_migration.clone().unwrap_or_else(
                || k8s_openapi::apimachinery::pkg::api::resource::Quantity("0Mi".into()),
            )),
            completion_timeout_per_gib: Some(self.completion_timeout_per_gib.unwrap_or(150)),
            progress_timeout: Some(self.progress_timeout.unwrap_or(150)),
            unsafe_migration_override: Some(self.unsafe_migration_override.unwrap_or(false)),
            allow_auto_converge: Some(self.allow_auto_converge.unwrap_or(false)),
            allow_post_copy: Some(self.allow_post_copy.unwrap_or(false)),
            allow_workload_disruption: Some(
                self.allow_workload_disruption
                    .or(self.allow_post_copy)
                    .unwrap_or(false),
            ),
            disable_tls: Some(self.disable_tls.unwrap_or(false)),
            network: self.network.clone(),
            node_drain_taint_key: Some(
                self.node_drain_taint_key
                    .clone()
                    .unwrap_or_else(|| DEFAULT_NODE_DRAIN_TAINT_KEY.into()),
            ),
            match_selinux_level_on_migration: Some(
                self.match_selinux_level_on_migration.unwrap_or(true),
            ),
        }
    }

    /// `bandwidthPerMigration` in bytes per second; `None` for unlimited or unparsable.
    pub fn bandwidth_bytes(&self) -> Option<u64> {
        self.bandwidth_per_migration
            .as_ref()
            .and_then(|q| crate::quantity::bytes(&q.0).ok())
            .filter(|b| *b > 0)
    }
}

/// Why a VMI cannot be live-migrated: the `LiveMigratable=False` condition's reason and message,
/// KubeVirt's words (`pkg/virt-handler/vm.go`, `calculateLiveMigrationCondition`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotMigratable {
    pub reason: &'static str,
    pub message: String,
}

/// `InterfaceNotLiveMigratable`.
pub const INTERFACE_NOT_LIVE_MIGRATABLE: &str = "InterfaceNotLiveMigratable";
/// `HostDeviceNotLiveMigratable`.
pub const HOST_DEVICE_NOT_LIVE_MIGRATABLE: &str = "HostDeviceNotLiveMigratable";
/// `DisksNotLiveMigratable`.
pub const DISKS_NOT_LIVE_MIGRATABLE: &str = "DisksNotLiveMigratable";
/// KubeVirt's `VirtualMachineInstanceReasonVirtIOFSNotMigratable`.
pub const VIRTIOFS_NOT_LIVE_MIGRATABLE: &str = "VirtIOFSNotLiveMigratable";
/// KubeVirt's `VirtualMachineInstanceReasonHotplugNotMigratable`.
pub const HOTPLUG_NOT_LIVE_MIGRATABLE: &str = "HotplugNotLiveMigratable";

/// KubeVirt's live-migration status of a running VMI: the `LiveMigratable` condition (with
/// the reason and message of the first failing check) and `migrationMethod`. virt-controller
/// keeps them; virt-handler sets them in its write that makes the VMI Running, as KubeVirt's
/// handler does, so they cost no write of their own. `pvc_shared` as for [`live_migratable`].
pub fn set_live_migration_status(
    status: &mut crate::VirtualMachineInstanceStatus,
    vmi: &VirtualMachineInstance,
    pvc_shared: impl Fn(&str) -> Option<bool>,
    now: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) {
    use crate::common::ConditionStatus;
    use crate::status::{VirtualMachineInstanceCondition, VirtualMachineInstanceConditionType};
    let (cond_status, reason, message) = match live_migratable(vmi, pvc_shared) {
        Ok(()) => (ConditionStatus::True, None, None),
        Err(e) => (
            ConditionStatus::False,
            Some(e.reason.to_owned()),
            Some(e.message),
        ),
    };
    let method = migration_method(vmi);
    if status.migration_method.as_deref() != Some(method) {
        status.migration_method = Some(method.to_owned());
    }
    let type_ = VirtualMachineInstanceConditionType::LiveMigratable;
    if let Some(c) = status.conditions.iter_mut().find(|c| c.type_ == type_) {
        if c.status == cond_status && c.reason == reason && c.message == message {
            return;
        }
        if c.status != cond_status {
            c.last_transition_time = Some(now.clone());
        }
        c.status = cond_status;
        c.reason = reason;
        c.message = message;
        return;
    }
    status.conditions.push(VirtualMachineInstanceCondition {
        type_,
        status: cond_status,
        last_probe_time: None,
        last_transition_time: Some(now.clone()),
        reason,
        message,
    });
}

/// Whether `vmi` can be live-migrated, checked in KubeVirt's order (the first failing check
/// names the reason). `pvc_shared` says whether a claim is `ReadWriteMany` (`None`: unknown).
pub fn live_migratable(
    vmi: &VirtualMachineInstance,
    pvc_shared: impl Fn(&str) -> Option<bool>,
) -> Result<(), NotMigratable> {
    let spec = &vmi.spec;
    let bridge_allowed =
        vmi.metadata.annotations.as_ref().is_some_and(|a| {
            a.contains_key(crate::labels::ALLOW_POD_BRIDGE_NETWORK_LIVE_MIGRATION)
        });
    let pod_networks: Vec<&str> = spec
        .networks
        .iter()
        .filter(|n| matches!(n.source(), Some(NetworkSource::Pod(_))))
        .map(|n| n.name.as_str())
        .collect();
    for iface in &spec.domain.devices.interfaces {
        if !pod_networks.contains(&iface.name.as_str()) {
            continue;
        }
        let migratable = match iface.binding_method() {
            Some(
                InterfaceBinding::Masquerade
                | InterfaceBinding::Passt
                | InterfaceBinding::PasstBinding
                | InterfaceBinding::Plugin(_),
            ) => true,
            Some(InterfaceBinding::Bridge) => bridge_allowed,
            _ => false,
        };
        if !migratable {
            return Err(NotMigratable {
                reason: INTERFACE_NOT_LIVE_MIGRATABLE,
                message: "cannot migrate VMI which does not use masquerade or a migratable \
                          plugin to connect to the pod network"
                    .into(),
            });
        }
    }
    // KubeVirt's check before virtiofsd could migrate its state: QEMU 7.2 marks
    // vhost-user-fs unmigratable and Debian 12's virtiofsd has no migration support.
    if crate::virtiofs::enabled(spec) {
        return Err(NotMigratable {
            reason: VIRTIOFS_NOT_LIVE_MIGRATABLE,
            message: "VMI uses virtiofs".into(),
        });
    }
    if spec.domain.devices.host_devices.is_some() {
        return Err(NotMigratable {
            reason: HOST_DEVICE_NOT_LIVE_MIGRATABLE,
            message: "VMI specifies non-migratable generic PCI host device".into(),
        });
    }
    if spec.domain.devices.gpus.is_some() {
        return Err(NotMigratable {
            reason: HOST_DEVICE_NOT_LIVE_MIGRATABLE,
            message: "VMI specifies non-migratable GPU device".into(),
        });
    }
    if !crate::hotplug::hotplug_volumes(vmi).is_empty() {
        // The target would need its own attachment pod before the guest moves; not done yet.
        return Err(NotMigratable {
            reason: HOTPLUG_NOT_LIVE_MIGRATABLE,
            message: "cannot migrate VMI with hotplugged volumes".into(),
        });
    }
    for v in &spec.volumes {
        let claim = match v.source() {
            Some(VolumeSource::PersistentVolumeClaim(c)) => Some(c.claim_name.as_str()),
            Some(VolumeSource::DataVolume(d)) => Some(d.name.as_str()),
            Some(VolumeSource::HostDisk(h)) if !h.shared.unwrap_or(false) => {
                return Err(NotMigratable {
                    reason: DISKS_NOT_LIVE_MIGRATABLE,
                    message: "cannot migrate VMI with non-shared HostDisk".into(),
                });
            }
            _ => None,
        };
        let Some(claim) = claim else { continue };
        let message = match pvc_shared(claim) {
            Some(true) => continue,
            Some(false) => format!(
                "cannot migrate VMI: PVC {claim} is not shared, live migration requires that \
                 all PVCs must be shared (using ReadWriteMany access mode)"
            ),
            None => format!(
                "cannot migrate VMI: Unable to determine if PVC {claim} is shared, live \
                 migration requires that all PVCs must be shared (using ReadWriteMany access mode)"
            ),
        };
        return Err(NotMigratable {
            reason: DISKS_NOT_LIVE_MIGRATABLE,
            message,
        });
    }
    Ok(())
}

/// The disks whose contents a migration copies (KubeVirt's block migration): the writable
/// disks on node-local storage (containerDisk overlays, emptyDisks, ephemeral overlays). Images
/// the target builds again the same (cloud-init, configMap, secret, service account) and
/// read-only disks are not copied; shared storage never is.
pub fn copy_disks(vmi: &VirtualMachineInstance) -> Vec<String> {
    let spec = &vmi.spec;
    spec.domain
        .devices
        .disks
        .iter()
        .filter(|d| !d.target().is_some_and(DiskTargetKind::readonly))
        .filter(|d| !matches!(d.target(), Some(DiskTargetKind::Cdrom(_))))
        .filter(|d| {
            spec.volumes.iter().any(|v| {
                v.name == d.name
                    && matches!(
                        v.source(),
                        Some(
                            VolumeSource::ContainerDisk(_)
                                | VolumeSource::EmptyDisk(_)
                                | VolumeSource::Ephemeral(_)
                        )
                    )
            })
        })
        .map(|d| d.name.clone())
        .collect()
}

/// KubeVirt's `migrationMethod`: `BlockMigration` when any disk is copied.
pub fn migration_method(vmi: &VirtualMachineInstance) -> &'static str {
    if copy_disks(vmi).is_empty() {
        "LiveMigration"
    } else {
        "BlockMigration"
    }
}

#[cfg(test)]
#[allow(clippy::needless_pass_by_value)] // json! temporaries read best passed in
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(spec: serde_json::Value, annotations: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "ns", "annotations": annotations},
            "spec": spec,
        }))
        .expect("a VMI")
    }

    fn with(iface: serde_json::Value, volumes: serde_json::Value) -> serde_json::Value {
        json!({
            "domain": {"devices": {
                "interfaces": [iface],
                "disks": [
                    {"name": "root", "disk": {}},
                    {"name": "scratch", "disk": {}},
                    {"name": "ci", "disk": {}},
                    {"name": "iso", "cdrom": {}},
                ]}},
            "networks": [{"name": "default", "pod": {}}],
            "volumes": volumes,
        })
    }

    fn local() -> serde_json::Value {
        json!([
            {"name": "root", "containerDisk": {"image": "x"}},
            {"name": "scratch", "emptyDisk": {"capacity": "1Gi"}},
            {"name": "ci", "cloudInitNoCloud": {"userData": "#!/bin/sh"}},
            {"name": "iso", "containerDisk": {"image": "y"}},
        ])
    }

    #[test]
    fn live_migratable_follows_kubevirts_checks_in_order() {
        let masq = json!({"name": "default", "masquerade": {}});
        let bridge = json!({"name": "default", "bridge": {}});
        let no = |_: &str| None;
        assert_eq!(
            live_migratable(&vmi(with(masq.clone(), local()), json!({})), no),
            Ok(())
        );
        let e = live_migratable(&vmi(with(bridge.clone(), local()), json!({})), no)
            .expect_err("bridge on the pod network");
        assert_eq!(e.reason, "InterfaceNotLiveMigratable");
        assert!(
            e.message
                .starts_with("cannot migrate VMI which does not use masquerade")
        );
        let allowed = json!({"kubevirt.io/allow-pod-bridge-network-live-migration": ""});
        assert_eq!(
            live_migratable(&vmi(with(bridge, local()), allowed), no),
            Ok(())
        );

        let mut spec = with(masq.clone(), local());
        spec["domain"]["devices"]["gpus"] = json!([{"name": "g", "deviceName": "nvidia"}]);
        let e = live_migratable(&vmi(spec.clone(), json!({})), no).expect_err("a GPU");
        assert_eq!(e.reason, "HostDeviceNotLiveMigratable");
        spec["domain"]["devices"]["filesystems"] = json!([{"name": "scratch", "virtiofs": {}}]);
        let e = live_migratable(&vmi(spec, json!({})), no).expect_err("virtiofs");
        assert_eq!(
            (e.reason, e.message.as_str()),
            ("VirtIOFSNotLiveMigratable", "VMI uses virtiofs")
        );

        let host = json!([{"name": "root", "hostDisk": {"path": "/d", "type": "Disk"}}]);
        let e =
            live_migratable(&vmi(with(masq.clone(), host), json!({})), no).expect_err("a hostDisk");
        assert_eq!(
            (e.reason, e.message.as_str()),
            (
                "DisksNotLiveMigratable",
                "cannot migrate VMI with non-shared HostDisk"
            )
        );
        let shared =
            json!([{"name": "root", "hostDisk": {"path": "/d", "type": "Disk", "shared": true}}]);
        assert_eq!(
            live_migratable(&vmi(with(masq.clone(), shared), json!({})), no),
            Ok(())
        );

        let pvc = json!([{"name": "root", "persistentVolumeClaim": {"claimName": "data"}}]);
        let e = live_migratable(&vmi(with(masq.clone(), pvc.clone()), json!({})), no)
            .expect_err("unknown claim");
        assert!(
            e.message
                .contains("Unable to determine if PVC data is shared"),
            "{}",
            e.message
        );
        let e = live_migratable(&vmi(with(masq.clone(), pvc.clone()), json!({})), |_| {
            Some(false)
        })
        .expect_err("RWO claim");
        assert!(
            e.message.contains("PVC data is not shared"),
            "{}",
            e.message
        );
        assert_eq!(
            live_migratable(&vmi(with(masq.clone(), pvc), json!({})), |_| Some(true)),
            Ok(())
        );

        // Persistent EFI migrates on any backend-storage claim: a claim that is not shared is
        // handed over to one made for the target (virt-controller's migration controller).
        let mut spec = with(masq, local());
        spec["domain"]["firmware"] = json!({"bootloader": {"efi": {"persistent": true}}});
        let mut efi = vmi(spec, json!({}));
        let mut status = crate::status::VirtualMachineInstanceStatus::default();
        crate::backendstorage::set_volume_status(
            &mut status,
            "persistent-state-for-vm1-abcde",
            &["ReadWriteOnce".into()],
        );
        efi.status = Some(status);
        assert_eq!(live_migratable(&efi, no), Ok(()));
    }

    #[test]
    fn copied_disks_are_the_writable_local_ones() {
        let v = vmi(
            with(json!({"name": "default", "masquerade": {}}), local()),
            json!({}),
        );
        assert_eq!(copy_disks(&v), ["root", "scratch"]);
        assert_eq!(migration_method(&v), "BlockMigration");
        let pvc = json!([{"name": "root", "persistentVolumeClaim": {"claimName": "data"}}]);
        let v = vmi(
            with(json!({"name": "default", "masquerade": {}}), pvc),
            json!({}),
        );
        assert!(copy_disks(&v).is_empty());
        assert_eq!(migration_method(&v), "LiveMigration");
    }
}
