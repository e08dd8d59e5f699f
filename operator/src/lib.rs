//! virt-operator's logic: what a KubeVirt CR installs (the install strategy, a pure function of
//! the CR and the operator's own images; the certificates and their rotation; the CR's
//! conditions). See
//! `docs/operator.md`.

pub mod certs;
pub mod conditions;
pub mod install;
pub mod owned;
pub mod reconcile;
pub mod release;
pub mod run;
pub mod strategy;
