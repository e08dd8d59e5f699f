//! virt-operator's logic: what a KubeVirt CR installs (the install strategy, a pure function of
//! the CR and the operator's own images; the certificates and their rotation). See
//! `docs/operator.md`.

pub mod certs;
pub mod strategy;
