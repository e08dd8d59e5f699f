//! virt-api: KubeVirt's subresource API (`subresources.kubevirt.io`, served behind
//! kube-apiserver's aggregation layer) and the admission webhooks for KubeVirt's kinds.
//!
//! Pure cores: [`authn`] (who asks for what), [`lifecycle`] (VM start/stop/restart as
//! patches), [`volumes`] (addvolume/removevolume as patches), [`discovery`], [`admission`],
//! [`eviction`]'s decision; I/O shells: [`subresource`] (the API calls and the relay to
//! virt-handler through [`virthandler`]) and [`server`] (TLS and routes); [`daemon`] puts them
//! together as the binary runs them (and as tests run them in-process).

pub mod admission;
pub mod authn;
pub mod daemon;
pub mod discovery;
pub mod eviction;
pub mod lifecycle;
pub mod server;
pub mod status;
pub mod subresource;
pub mod virthandler;
pub mod volumes;
pub mod webhooks;
