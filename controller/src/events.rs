//! Event and condition reasons, spelled as KubeVirt spells them (`pkg/controller`,
//! `pkg/virt-controller/watch/common`), so tooling that greps for them keeps working.

/// A launcher pod was created.
pub const SUCCESSFUL_CREATE_POD: &str = "SuccessfulCreate";
/// Creating a launcher pod failed.
pub const FAILED_CREATE_POD: &str = "FailedCreate";
/// A launcher pod was deleted.
pub const SUCCESSFUL_DELETE_POD: &str = "SuccessfulDelete";
/// Deleting a launcher pod failed.
pub const FAILED_DELETE_POD: &str = "FailedDelete";
/// A VM or ReplicaSet created a VMI; a pool, a VM.
pub const SUCCESSFUL_CREATE_VMI: &str = "SuccessfulCreate";
/// A VM or ReplicaSet failed to create a VMI; a pool, a VM.
pub const FAILED_CREATE_VMI: &str = "FailedCreate";
/// A VM or ReplicaSet deleted a VMI; a pool, a VM (or a VMI, to restart it).
pub const SUCCESSFUL_DELETE_VMI: &str = "SuccessfulDelete";
/// A VM or ReplicaSet failed to delete a VMI; a pool, a VM.
pub const FAILED_DELETE_VMI: &str = "FailedDelete";
/// A VMI (or a VM's template) failed validation; one event per field at fault.
pub const FAILED_VALIDATION: &str = crate::vmi::FAILED_VALIDATION;
/// A containerDisk image could not be pulled.
pub const ERR_IMAGE_PULL: &str = "ErrImagePull";
/// The kubelet backs off pulling a containerDisk image.
pub const IMAGE_PULL_BACK_OFF: &str = "ImagePullBackOff";
/// KubeVirt's `hotplugVolumeErrorReason` (the VM's Failure condition).
pub const HOTPLUG_VOLUME_ERROR: &str = "HotPlugVolumeError";
/// KubeVirt's `hotPlugNetworkInterfaceErrorReason`: an interface change could not reach the VMI.
pub const HOTPLUG_NETWORK_INTERFACE_ERROR: &str = "HotPlugNetworkInterfaceError";
/// A PVC a volume names does not exist.
pub const FAILED_PVC_NOT_FOUND: &str = "FailedPvcNotFound";
/// A ReplicaSet was paused.
pub const SUCCESSFUL_PAUSED_REPLICA_SET: &str = "SuccessfulPaused";
/// A ReplicaSet was resumed.
pub const SUCCESSFUL_RESUMED_REPLICA_SET: &str = "SuccessfulResumed";
/// A node stopped heartbeating and was marked unschedulable; its VMIs were failed.
pub const NODE_UNRESPONSIVE: &str = "NodeUnresponsive";
/// A pool rewrote a VM from its new template.
pub const SUCCESSFUL_UPDATE_VM: &str = "SuccessfulUpdate";
/// A pool was paused.
pub const SUCCESSFUL_PAUSED_POOL: &str = "SuccessfulPaused";
/// A pool was resumed.
pub const SUCCESSFUL_RESUME_POOL: &str = "SuccessfulResume";
/// A pool's scale-out failed (its ReplicaFailure condition).
pub const FAILED_SCALE_OUT: &str = "FailedScaleOut";
/// A pool's scale-in failed.
pub const FAILED_SCALE_IN: &str = "FailedScaleIn";
/// A pool's update of its VMs failed, or of one VM.
pub const FAILED_UPDATE: &str = "FailedUpdate";
/// A pool could not delete a revision no VM uses.
pub const FAILED_REVISION_PRUNING: &str = "FailedRevisionPruning";
/// The instance type a VM names cannot be found.
pub const FAILED_FIND_INSTANCETYPE: &str = "FailedFindInstancetype";
/// The preference a VM names cannot be found.
pub const FAILED_FIND_PREFERENCE: &str = "FailedFindPreference";
