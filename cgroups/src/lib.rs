//! cgroup v1 and v2 control for a pod, as virt-handler needs it: device rules (v1 devices
//! controller, or an eBPF program on cgroup2), pinning a VM's threads with cpusets, and the
//! memory limit.
//!
//! The host may mount cgroups three ways ([`Mode`]); [`CgroupSetup::detect`] finds out which,
//! [`ProcessCgroups`] says where one process sits, and [`Manager`] acts on that process's
//! cgroups. The device backends ([`V1Devices`], [`BpfDevices`]) are usable on their own.

mod bpf;
mod cpuset;
mod devices;
mod error;
mod manager;
mod membership;
mod setup;
mod v1;
mod v2;

pub use bpf::program_by_id;
pub use cpuset::{CpuList, HOUSEKEEPING_CHILD, VCPU_CHILD};
pub use devices::{
    Access, DeviceEntry, DeviceKind, DeviceRule, MAX_MAJOR, MAX_MINOR, effective, permits,
};
pub use error::{CgroupError, Result};
pub use manager::{CgroupDir, Devices, Manager, threads_of};
pub use membership::{ProcessCgroups, pod_cgroup};
pub use setup::{CgroupSetup, Hierarchy, Mode};
pub use v1::{V1Devices, V1State};
pub use v2::BpfDevices;
