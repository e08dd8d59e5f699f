//! `VirtualMachine`: a stateful VM whose instances the VM controller starts and stops.

// `printcolumn(...)` repeats `type_ = ...`; clippy reads the derive's arguments as duplicated
// attributes, which they are not.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::{Preserved, embedded_object_meta, string_enum};
use crate::status::Condition;
use crate::vmi::VirtualMachineInstanceSpec;

/// A VMI template: metadata and spec of the instances to create.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceTemplateSpec {
    /// Labels and annotations given to the instances.
    // Optional, as in KubeVirt's CRD: with `schema_with`, schemars marks a field required
    // unless it has `serde(default)`.
    #[schemars(schema_with = "embedded_object_meta")]
    #[serde(default)]
    pub metadata: Option<ObjectMeta>,
    /// Spec of the instances.
    pub spec: Option<VirtualMachineInstanceSpec>,
}

/// KubeVirt's `InstancetypeMatcher` / `PreferenceMatcher`: which instance type (preference)
/// a VM uses.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Matcher {
    /// Name of the object.
    pub name: Option<String>,
    /// Its kind: the cluster kind when empty.
    pub kind: Option<String>,
    /// A ControllerRevision to take the object from instead of the live one.
    pub revision_name: Option<String>,
    /// Refused: kubevirt-rs does not infer instance types from volumes.
    pub infer_from_volume: Option<String>,
    /// `Reject` or `Ignore`; refused with `inferFromVolume`.
    pub infer_from_volume_failure_policy: Option<String>,
}

/// KubeVirt's `InstancetypeStatusRef`: the object a VM's instance type (preference) was
/// resolved to and the ControllerRevision holding the snapshot in use.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstancetypeStatusRef {
    pub name: Option<String>,
    pub kind: Option<String>,
    pub controller_revision_ref: Option<ControllerRevisionRef>,
    pub infer_from_volume: Option<String>,
    pub infer_from_volume_failure_policy: Option<String>,
}

/// The name of a ControllerRevision.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ControllerRevisionRef {
    pub name: Option<String>,
}

string_enum! {
    /// When the VM controller runs an instance.
    pub enum RunStrategy {
        /// Always keep an instance running.
        Always = "Always",
        /// Restart the instance when it fails, not when it succeeds.
        RerunOnFailure = "RerunOnFailure",
        /// Only start/stop on request.
        Manual = "Manual",
        /// Never run an instance.
        Halted = "Halted",
        /// Run once to completion.
        Once = "Once",
        /// Wait to receive a decentralized migration.
        WaitAsReceiver = "WaitAsReceiver",
    }
}

/// The `spec` of a `VirtualMachine`.
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachine",
    namespaced,
    status = "VirtualMachineStatus",
    derive = "PartialEq",
    shortname = "vm",
    shortname = "vms",
    category = "all",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachine is a stateful virtual machine: a VMI template plus a run strategy deciding when an instance of it runs.",
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Status",
        type_ = "string",
        description = "Human Readable Status",
        json_path = ".status.printableStatus"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type=='Ready')].status"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineSpec {
    /// Deprecated switch; mutually exclusive with `runStrategy`.
    pub running: Option<bool>,
    /// When to run an instance.
    pub run_strategy: Option<RunStrategy>,
    /// The instance type the instances get their CPU and memory from.
    pub instancetype: Option<Matcher>,
    /// The preference the instances take defaults from.
    pub preference: Option<Matcher>,
    /// Template of the instances.
    pub template: VirtualMachineInstanceTemplateSpec,
    /// CDI DataVolume templates (not supported yet).
    pub data_volume_templates: Option<Preserved>,
    /// `Replacement` or `Migration` on volume updates.
    pub update_volumes_strategy: Option<String>,
}

impl VirtualMachineSpec {
    /// The run strategy in effect: `runStrategy`, else `running` (true: Always, false: Halted),
    /// else Halted, as KubeVirt resolves it.
    pub fn effective_run_strategy(&self) -> RunStrategy {
        match (&self.run_strategy, self.running) {
            (Some(s), _) => s.clone(),
            (None, Some(true)) => RunStrategy::Always,
            (None, _) => RunStrategy::Halted,
        }
    }
}

string_enum! {
    /// Human-readable VM state shown by `kubectl get vm`.
    pub enum VirtualMachinePrintableStatus {
        Stopped = "Stopped",
        Provisioning = "Provisioning",
        Starting = "Starting",
        Running = "Running",
        Paused = "Paused",
        Stopping = "Stopping",
        Terminating = "Terminating",
        CrashLoopBackOff = "CrashLoopBackOff",
        Migrating = "Migrating",
        Unknown = "Unknown",
        ErrorUnschedulable = "ErrorUnschedulable",
        ErrImagePull = "ErrImagePull",
        ImagePullBackOff = "ImagePullBackOff",
        ErrorPvcNotFound = "ErrorPvcNotFound",
        DataVolumeError = "DataVolumeError",
        WaitingForVolumeBinding = "WaitingForVolumeBinding",
        WaitingForReceiver = "WaitingForReceiver",
    }
}

string_enum! {
    /// VM condition types.
    pub enum VirtualMachineConditionType {
        Failure = "Failure",
        Ready = "Ready",
        Paused = "Paused",
        RestartRequired = "RestartRequired",
        ManualRecoveryRequired = "ManualRecoveryRequired",
    }
}

/// A VM condition.
pub type VirtualMachineCondition = Condition<VirtualMachineConditionType>;

string_enum! {
    /// A start or stop request queued on the VM.
    pub enum StateChangeRequestAction {
        Start = "Start",
        Stop = "Stop",
    }
}

/// A queued start/stop request.
#[skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineStateChangeRequest {
    /// Start or Stop.
    pub action: StateChangeRequestAction,
    /// Extra data.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub data: std::collections::BTreeMap<String, String>,
    /// UID of the VMI the request is about.
    pub uid: Option<String>,
}

/// The `data` key of a start request asking for a paused start, and its value (KubeVirt's
/// `StartRequestDataPausedKey` / `StartRequestDataPausedTrue`: `virtctl start --paused`).
pub const START_REQUEST_PAUSED_KEY: &str = "paused";
pub const START_REQUEST_PAUSED_TRUE: &str = "true";

impl VirtualMachineStateChangeRequest {
    /// A start request asking for a paused start.
    pub fn starts_paused(&self) -> bool {
        self.action == StateChangeRequestAction::Start
            && self.data.get(START_REQUEST_PAUSED_KEY).map(String::as_str)
                == Some(START_REQUEST_PAUSED_TRUE)
    }
}

/// Crash-loop bookkeeping.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineStartFailure {
    /// UID of the last failed VMI.
    #[serde(rename = "lastFailedVMIUID")]
    pub last_failed_vmi_uid: Option<String>,
    /// Do not start before this time.
    pub retry_after_timestamp: Option<Time>,
    /// Failures in a row.
    pub consecutive_fail_count: Option<i32>,
}

/// The status of a VM.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineStatus {
    /// Snapshot in progress.
    pub snapshot_in_progress: Option<String>,
    /// Restore in progress.
    pub restore_in_progress: Option<String>,
    /// An instance exists.
    pub created: Option<bool>,
    /// The instance is ready.
    pub ready: Option<bool>,
    /// Human-readable state.
    pub printable_status: Option<VirtualMachinePrintableStatus>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<VirtualMachineCondition>,
    /// Crash-loop state.
    pub start_failure: Option<VirtualMachineStartFailure>,
    /// Queued start/stop requests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_change_requests: Vec<VirtualMachineStateChangeRequest>,
    /// Volume hotplug requests.
    pub volume_requests: Option<Preserved>,
    /// Snapshot support per volume.
    pub volume_snapshot_statuses: Option<Preserved>,
    /// Memory dump request.
    pub memory_dump_request: Option<Preserved>,
    /// Generation observed by the controller.
    pub observed_generation: Option<i64>,
    /// Generation the controller wants.
    pub desired_generation: Option<i64>,
    /// Run strategy in effect.
    pub run_strategy: Option<RunStrategy>,
    /// Volume update state.
    pub volume_update_state: Option<Preserved>,
    /// Instance type revision in use.
    pub instancetype_ref: Option<InstancetypeStatusRef>,
    /// Preference revision in use.
    pub preference_ref: Option<InstancetypeStatusRef>,
    /// Changed block tracking state.
    pub changed_block_tracking: Option<Preserved>,
}

/// The namespace of the firmware UUIDs KubeVirt's VM controller derives from a VM's name.
const FIRMWARE_UUID_NAMESPACE: uuid::Uuid = uuid::uuid!("6a1a24a1-4061-4607-8bf4-a3963d0c5895");

/// The firmware (SMBIOS) UUID of a VM's instances when its template sets none: a SHA-1 UUID of
/// the VM's name (KubeVirt's `CalculateLegacyUUID`), so the guest sees the same machine on every
/// start.
pub fn stable_firmware_uuid(vm_name: &str) -> String {
    uuid::Uuid::new_v5(&FIRMWARE_UUID_NAMESPACE, vm_name.as_bytes()).to_string()
}
