//! The `kubevirt.io/v1` API as Rust types: KubeVirt-compatible custom resources, the defaults
//! KubeVirt's mutating webhook applies, and validation that names every problem by field path.
//!
//! JSON names, enum values and status shapes are KubeVirt's, so manifests written for KubeVirt
//! deserialize unchanged. Fields kubevirt-rs does not interpret yet are kept as [`Preserved`]
//! subtrees (never pruned by an API server) and refused by [`validation`] when they would change
//! the guest.
//!
//! The admission flow of a new VMI, as KubeVirt's webhooks run it:
//!
//! ```
//! use api::{ClusterConfig, VirtualMachineInstance, defaults, validation};
//!
//! let mut vmi: VirtualMachineInstance = serde_saphyr::from_str(r"
//! apiVersion: kubevirt.io/v1
//! kind: VirtualMachineInstance
//! metadata: {name: demo}
//! spec:
//!   domain:
//!     resources: {requests: {memory: 128Mi}}
//!     devices: {disks: [{name: root, disk: {bus: virtio}}]}
//!   volumes:
//!     - {name: root, containerDisk: {image: kubevirt-rs/test-guest-disk:latest}}
//! ").unwrap();
//! let cfg = ClusterConfig::default();
//! defaults::apply_vmi(&mut vmi, &cfg).unwrap();
//! assert!(validation::validate_vmi(&vmi, &cfg).is_empty());
//! let (disk, volume) = vmi.spec.disks_with_volumes().next().unwrap();
//! assert_eq!(disk.bus(), Some(&api::vmi::DiskBus::Virtio));
//! assert!(matches!(volume.source(), Some(api::vmi::VolumeSource::ContainerDisk(_))));
//! ```

pub mod backendstorage;
pub mod common;
pub mod config;
pub mod configdisk;
pub mod crds;
pub mod defaults;
pub mod duration;
pub mod hotplug;
pub mod instancetype;
pub mod interfaces;
pub mod kubevirt;
pub mod labels;
pub mod metrics;
pub mod migration;
pub mod migrationpolicy;
pub mod overhead;
pub mod pci;
pub mod pool;
pub mod preset;
pub mod quantity;
pub mod replicaset;
pub mod status;
pub mod subresources;
pub mod support;
pub mod validation;
pub mod virtiofs;
pub mod vm;
pub mod vmi;

pub use common::{ConditionStatus, Empty, Preserved, PullPolicy};
pub use config::ClusterConfig;
pub use kubevirt::{KubeVirt, KubeVirtSpec, KubeVirtStatus};
pub use migration::{
    VirtualMachineInstanceMigration, VirtualMachineInstanceMigrationSpec,
    VirtualMachineInstanceMigrationStatus,
};
pub use replicaset::{
    VirtualMachineInstanceReplicaSet, VirtualMachineInstanceReplicaSetSpec,
    VirtualMachineInstanceReplicaSetStatus,
};
pub use status::{VirtualMachineInstancePhase, VirtualMachineInstanceStatus};
pub use vm::{VirtualMachine, VirtualMachineSpec, VirtualMachineStatus};
pub use vmi::{VirtualMachineInstance, VirtualMachineInstanceSpec};

/// API group of every kind here.
pub const GROUP: &str = "kubevirt.io";
/// API version of every kind here.
pub const VERSION: &str = "v1";
