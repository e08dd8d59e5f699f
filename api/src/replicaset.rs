//! `VirtualMachineInstanceReplicaSet`: N identical, stateless VMIs.

// `printcolumn(...)` repeats `type_ = ...`; clippy reads the derive's arguments as duplicated
// attributes, which they are not.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::string_enum;
use crate::status::Condition;
use crate::vm::VirtualMachineInstanceTemplateSpec;

/// The `spec` of a `VirtualMachineInstanceReplicaSet`.
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstanceReplicaSet",
    namespaced,
    status = "VirtualMachineInstanceReplicaSetStatus",
    derive = "PartialEq",
    shortname = "vmirs",
    shortname = "vmirss",
    category = "all",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachineInstanceReplicaSet keeps a number of identical VirtualMachineInstances running, like a ReplicaSet does for pods.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.labelSelector"
    ),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".spec.replicas",
        description = "Number of desired VirtualMachineInstances"
    ),
    printcolumn(
        name = "Current",
        type_ = "integer",
        json_path = ".status.replicas",
        description = "Number of managed and not final or deleted VirtualMachineInstances"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.readyReplicas",
        description = "Number of managed VirtualMachineInstances which are ready to receive traffic"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceReplicaSetSpec {
    /// Number of replicas; defaults to 1.
    pub replicas: Option<i32>,
    /// Label selector of the managed VMIs; must match the template's labels.
    pub selector: LabelSelector,
    /// Template of the VMIs.
    pub template: VirtualMachineInstanceTemplateSpec,
    /// Stop reconciling.
    pub paused: Option<bool>,
}

string_enum! {
    /// ReplicaSet condition types.
    pub enum VirtualMachineInstanceReplicaSetConditionType {
        ReplicaFailure = "ReplicaFailure",
        ReplicaPaused = "ReplicaPaused",
    }
}

/// A ReplicaSet condition.
pub type VirtualMachineInstanceReplicaSetCondition =
    Condition<VirtualMachineInstanceReplicaSetConditionType>;

/// The status of a ReplicaSet.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceReplicaSetStatus {
    /// Managed, not final VMIs.
    pub replicas: Option<i32>,
    /// Ready VMIs.
    pub ready_replicas: Option<i32>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<VirtualMachineInstanceReplicaSetCondition>,
    /// Selector in string form, for the scale subresource.
    pub label_selector: Option<String>,
}
