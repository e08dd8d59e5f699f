//! virt-controller: the cluster-wide controllers of kubevirt-rs (VM, VMI, ReplicaSet, Node,
//! migration, evacuation, disruption budget), as pure decision functions ([`vm`], [`vmi`],
//! [`finalizers`], [`replicaset`], [`pool`], [`node`], [`migration`], [`evacuation`],
//! [`disruptionbudget`], [`template`], [`backendstorage`],
//! [`cache`]) and thin kube-rs shells around them ([`run`], [`metrics`]). See `docs/controller.md`.

pub mod backendstorage;
pub mod cache;
pub mod disruptionbudget;
pub mod evacuation;
pub mod events;
pub mod finalizers;
pub mod hotplug;
pub mod instancetype;
pub mod metrics;
pub mod migration;
pub mod node;
pub mod pool;
pub mod replicaset;
pub mod run;
pub mod template;
pub mod vm;
pub mod vmi;
