//! localcluster: the whole system on one machine with no cluster. It runs the upstream
//! Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
//! kube-proxy: `controlplane`, built from pinned Go modules in `upstream/`), writes its
//! certificates (`pki`), and runs our process kubelet (`kubelet`), which runs pods from OCI
//! images in its local image store (the `ociimage` crate) in real namespaces and cgroups;
//! `storage` provisions persistent volumes for claims. See `docs/localcluster.md`.

pub mod controlplane;
pub mod kubectl;
pub mod kubelet;
pub mod nsexec;
pub mod pki;
pub mod ports;
pub mod storage;
pub mod tls;

pub use controlplane::{ControlPlane, ControlPlaneConfig, ControlPlaneError};
