//! What phase 1 found and built, per interface: the contract between the handler (which writes
//! it into the pod) and the launcher (which reads it to render the NIC and serve DHCP). A
//! restarted handler reads it back too: after a bridge binding has taken the pod's address off
//! its interface, the cache is the only place that still knows it.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{NetworkError, Result};

/// The two bindings this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Binding {
    Masquerade,
    Bridge,
}

/// An address with its prefix length (`10.0.2.2/24`, `fd10:0:2::2/120`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cidr<A> {
    pub address: A,
    pub prefix: u8,
}

pub type Ipv4Cidr = Cidr<Ipv4Addr>;
pub type Ipv6Cidr = Cidr<Ipv6Addr>;

impl<A: std::fmt::Display> std::fmt::Display for Cidr<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix)
    }
}

/// An IPv4 route of the pod, handed to a bridged guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    pub destination: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Option<Ipv4Addr>,
}

/// One VMI interface as phase 1 left it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedInterface {
    /// The VMI interface (and network) name.
    pub name: String,
    pub binding: Binding,
    /// The pod's interface for this network (`eth0`).
    pub pod_interface: String,
    /// `k6t-<pod interface>`.
    pub bridge: String,
    /// The tap QEMU opens (`tap<interface index>`, the launcher's naming).
    pub tap: String,
    /// MTU of the pod interface, given to the bridge, the tap and the guest.
    pub mtu: u32,
    /// The pod interface's MAC as phase 1 first found it. A bridged guest takes it over (unless
    /// the spec sets `macAddress`), as in KubeVirt.
    pub pod_mac: String,
    /// The pod interface's IPv4 address as first found (bridge: what the guest gets).
    pub pod_ipv4: Option<Ipv4Cidr>,
    /// The pod's IPv4 routes as first found (bridge: handed to the guest, restored at teardown).
    #[serde(default)]
    pub routes: Vec<Route>,
    /// The address the guest gets by DHCP.
    pub guest_ipv4: Option<Ipv4Cidr>,
    /// The guest's default gateway.
    pub gateway_ipv4: Option<Ipv4Addr>,
    /// The DHCP server's address on the bridge (its source address and server identifier).
    pub server_ipv4: Ipv4Addr,
    /// Masquerade on a pod with IPv6: the address the guest gets by DHCPv6
    /// (`fd10:0:2::2/120` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_ipv6: Option<Ipv6Cidr>,
    /// The bridge's IPv6 address, which router advertisements make the guest's default router.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_ipv6: Option<Ipv6Addr>,
}

/// `vif-cache-<pod interface>.json`, KubeVirt's file name.
pub fn file_name(pod_interface: &str) -> String {
    format!("vif-cache-{pod_interface}.json")
}

pub fn path(dir: &Path, pod_interface: &str) -> PathBuf {
    dir.join(file_name(pod_interface))
}

pub fn decode(path: &Path, bytes: &[u8]) -> Result<CachedInterface> {
    serde_json::from_slice(bytes).map_err(|source| NetworkError::Cache {
        path: path.to_owned(),
        source,
    })
}

pub fn encode(iface: &CachedInterface) -> Vec<u8> {
    serde_json::to_vec_pretty(iface).expect("a CachedInterface always serializes")
}

/// Reads one interface's cache from a directory the caller may trust (the launcher's own
/// private dir). `None` when phase 1 has not written it.
pub fn read(dir: &Path, pod_interface: &str) -> Result<Option<CachedInterface>> {
    let p = path(dir, pod_interface);
    match std::fs::read(&p) {
        Ok(b) => decode(&p, &b).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(NetworkError::io(format!("reading {}", p.display()))(e)),
    }
}
