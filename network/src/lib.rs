//! Pod networking for VMs, split as KubeVirt splits it (see docs/network.md):
//!
//! - [`phase1`]: the privileged half, run by virt-handler in the pod's network namespace:
//!   bridge, tap, NAT (masquerade) or the pod interface handed over (bridge); the result is
//!   cached in the pod ([`cache`]).
//! - [`dhcp`]: the launcher's DHCPv4 server on that bridge, answering only the guest;
//!   [`dhcp6`] and [`ra`]: DHCPv6 and router advertisements for a guest with IPv6.
//! - [`status`]: `status.interfaces` from the domain and the guest agent.
//! - [`plan`]: the pure VMI -> per-interface plan both halves share (names, addresses, MACs).

pub mod cache;
pub mod dhcp;
pub mod dhcp6;
mod error;
pub mod link;
pub mod nft;
pub mod phase1;
pub mod plan;
pub mod ra;
pub mod status;
mod udp;

pub use cache::{Binding, CachedInterface, Cidr, Ipv4Cidr, Ipv6Cidr, Route};
pub use error::{NetworkError, Result};
