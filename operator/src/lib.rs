//! virt-operator's logic: what a KubeVirt CR installs (the install strategy, a pure function of
//! the CR and the operator's own images). See `docs/operator.md`.

pub mod strategy;
