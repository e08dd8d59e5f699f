//! `VirtualMachineInstanceMigration`: a request to live-migrate one VMI.

// `printcolumn(...)` repeats `type_ = ...`; clippy reads the derive's arguments as duplicated
// attributes, which they are not.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::string_enum;
use crate::status::{Condition, PhaseTransitionTimestamp, VirtualMachineInstanceMigrationState};

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
