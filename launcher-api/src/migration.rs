//! Live migration between two launchers. The target launcher starts QEMU waiting for the
//! incoming state and serves its writable local disks over NBD; the source mirrors those disks
//! and sends the guest's memory; both listen or connect on unix sockets in their pod's `sockets`
//! emptyDir, which virt-handler's migration proxy joins across nodes (KubeVirt's design, with
//! QEMU's own NBD and migration streams in place of libvirt's).

use api::VirtualMachineInstance;
use serde::{Deserialize, Serialize};

/// The guest state's stream: the target's QEMU listens here (`migrate-incoming`), the source's
/// connects (`migrate`). Relative to the launcher's `--kubevirt-share-dir`, like [`crate::SOCKET`].
pub const MEMORY_SOCKET: &str = "sockets/mig-mem";
/// The copied disks' stream: the target's QEMU serves them over NBD here, the source's mirrors
/// into them.
pub const DISKS_SOCKET: &str = "sockets/mig-nbd";

/// Every stream a migration uses, with the name KubeVirt's proxy keys it by in
/// `migrationState.targetDirectMigrationNodePorts` (`"0"`: the main stream; `"49153"`: the
/// block-migration stream).
pub const STREAMS: [(&str, &str); 2] = [("0", MEMORY_SOCKET), ("49153", DISKS_SOCKET)];

/// [`PrepareTarget`](crate::action::PrepareTarget)'s request: start the VMI as a migration target.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TargetRequest {
    /// The migration's uid (the VirtualMachineInstanceMigration's).
    pub migration_uid: String,
    pub vmi: VirtualMachineInstance,
    /// The VMI's disks whose contents the source sends (block migration); the others are on
    /// shared storage or rebuilt here (cloud-init, read-only images).
    pub copy_disks: Vec<String>,
    /// Post-copy needs QEMU's capability on both ends.
    pub allow_post_copy: bool,
}

/// [`Migrate`](crate::action::Migrate)'s request: send the running VMI to the target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrateRequest {
    pub migration_uid: String,
    /// As in [`TargetRequest::copy_disks`]; the target must export the same set.
    pub copy_disks: Vec<String>,
    /// Bytes per second; `None` or 0: unlimited (KubeVirt's `bandwidthPerMigration: 0`).
    pub bandwidth: Option<u64>,
    /// KubeVirt's `completionTimeoutPerGiB`: the migration may take this many seconds per GiB
    /// of guest memory and copied disk.
    pub completion_timeout_per_gib: u64,
    /// KubeVirt's `progressTimeout`: seconds without the remaining data shrinking.
    pub progress_timeout: u64,
    pub allow_auto_converge: bool,
    /// Switch to post-copy once the completion timeout passes, instead of failing.
    pub allow_post_copy: bool,
}

/// Which end of a migration this launcher is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    Source,
    Target,
}

/// Where a migration stands, as this launcher sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MigrationPhase {
    /// Target: waiting for the source. Source: mirroring the disks before the memory.
    Preparing,
    /// The guest's memory is on its way.
    Running,
    /// Source: everything is sent, the disks' mirrors are closed and QEMU quits. Target: the
    /// state is in; the guest resumes once told (`FinishMigration`).
    Completed,
    Failed,
    /// Cancelled on request; the guest runs on at the source.
    Aborted,
}

impl MigrationPhase {
    pub fn is_final(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Aborted)
    }
}

/// The migration part of a [`Domain`](crate::domain::Domain).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DomainMigration {
    pub uid: String,
    pub role: Role,
    pub phase: MigrationPhase,
    /// `PreCopy` or `PostCopy` (KubeVirt's migration modes).
    pub mode: String,
    /// Unix milliseconds.
    pub started_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<u64>,
    /// Why it failed or was aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// QEMU's `query-migrate` figures (source only): guest memory in bytes, sent, left.
    #[serde(default)]
    pub memory_total: u64,
    #[serde(default)]
    pub memory_transferred: u64,
    #[serde(default)]
    pub memory_remaining: u64,
    /// Bytes of the copied disks.
    #[serde(default)]
    pub disks_total: u64,
    /// QEMU's figures once completed (source only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_time_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_ms: Option<u64>,
}
