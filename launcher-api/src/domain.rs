//! The domain state the launcher reports over its API (what virt-handler turns into VMI status),
//! and the other JSON shapes of its answers.

use serde::{Deserialize, Serialize};

/// Libvirt's state names, which KubeVirt's phase logic is written against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum DomainState {
    /// No sync has been received yet.
    #[default]
    NoState,
    /// QEMU is being prepared or started; not yet running guest code.
    Starting,
    Running,
    Paused,
    Shutoff,
    Crashed,
}

impl DomainState {
    /// Shutoff and Crashed are final: QEMU is gone and the launcher will not start it again.
    pub fn is_final(self) -> bool {
        matches!(self, DomainState::Shutoff | DomainState::Crashed)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskStatus {
    pub name: String,
    pub bus: String,
    pub source: String,
    pub read_only: bool,
    pub hotplugged: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InterfaceStatus {
    pub name: String,
    pub tap: String,
    pub mac: Option<String>,
    pub model: String,
    /// `up` or `down`, as the guest sees the link (absent from a launcher older than the field).
    #[serde(default)]
    pub link_state: Option<String>,
    /// The NIC's queue pairs, KubeVirt's `status.interfaces[].queueCount` (absent from a
    /// launcher older than the field).
    #[serde(default)]
    pub queue_count: Option<i32>,
}

/// `guest-fsfreeze-status`: whether the guest agent holds the guest's filesystems frozen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FsFreeze {
    Thawed,
    Frozen,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Domain {
    /// Increases with every change, so a watcher can tell it has seen a state.
    pub generation: u64,
    pub state: DomainState,
    /// Why the domain is in this state: `Booted`, `Paused`, `Unpaused`, `Shutdown`,
    /// `Destroyed`, `Crashed`, `FailedStart`, ...
    pub reason: String,
    /// Details for a person when something went wrong.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qemu_pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<String>,
    pub vcpu_threads: Vec<i64>,
    pub disks: Vec<DiskStatus>,
    pub interfaces: Vec<InterfaceStatus>,
    pub agent_connected: bool,
    /// What the agent last answered to `guest-fsfreeze-status` (asked every
    /// `--qemu-fsfreeze-status-interval` and after each freeze or thaw, as KubeVirt's agent
    /// poller does); `None` while no agent is connected or before its first answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_freeze_status: Option<FsFreeze>,
    /// The last error from applying a sync (e.g. a hotplug that was rolled back). The domain
    /// keeps running; this says what was not applied and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_error: Option<String>,
    /// The last migration this launcher took part in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<crate::migration::DomainMigration>,
}

/// One VMI disk's I/O counters since QEMU started, from QMP `query-blockstats` (what libvirt's
/// block stats give KubeVirt); [`GetBlockStats`](crate::action::GetBlockStats) answers one per disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskStats {
    /// The VMI's disk name.
    pub name: String,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ops: u64,
    pub write_ops: u64,
    pub flush_ops: u64,
    pub read_time_ns: u64,
    pub write_time_ns: u64,
    pub flush_time_ns: u64,
}

/// The body of every error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    pub code: String,
    pub message: String,
}

/// [`GetInfo`](crate::action::GetInfo)'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Info {
    pub launcher_version: String,
    pub qemu_binary: String,
    pub qemu_version: Option<String>,
    pub uid: Option<String>,
}
