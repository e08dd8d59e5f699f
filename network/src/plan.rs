//! VMI -> what phase 1 must build for each interface. Pure.

use std::net::{Ipv4Addr, Ipv6Addr};

use api::VirtualMachineInstance;
use api::vmi::InterfaceBinding;
use ipnet::{Ipv4Net, Ipv6Net};

use crate::cache::{Binding, CachedInterface, Cidr, Ipv4Cidr, Ipv6Cidr};
use crate::error::{NetworkError, Result};

/// KubeVirt's default guest network behind masquerade.
pub const DEFAULT_VM_NETWORK: &str = "10.0.2.0/24";

/// KubeVirt's default IPv6 guest network behind masquerade, used when the pod has IPv6.
pub const DEFAULT_VM_IPV6_NETWORK: &str = "fd10:0:2::/120";

/// The in-pod bridge's MAC under masquerade (KubeVirt's `StaticMasqueradeBridgeMAC`); validation
/// refuses it as a guest MAC.
pub const MASQUERADE_BRIDGE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0];

/// Ports never forwarded to a masqueraded guest when it lists none: KubeVirt's reserved
/// migration ports (libvirt's direct and block migration), kept for the pod's own use.
pub const RESERVED_TCP_PORTS: [u16; 2] = [49152, 49153];

/// A port forwarded from the pod to a masqueraded guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardedPort {
    /// `tcp` or `udp` (nftables' spelling).
    pub protocol: &'static str,
    pub port: u16,
}

/// What phase 1 builds for one VMI interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfacePlan {
    pub index: usize,
    pub name: String,
    pub binding: Binding,
    pub pod_interface: String,
    pub bridge: String,
    pub tap: String,
    /// Queue pairs of the tap ([`api::vmi::VirtualMachineInstanceSpec::network_queues`]): more
    /// than one makes it a multiqueue tap, which QEMU opens once per queue.
    pub queues: u32,
    /// Masquerade only; empty means every port (but [`RESERVED_TCP_PORTS`]).
    pub ports: Vec<ForwardedPort>,
    /// Masquerade: the guest network (`vmNetworkCIDR`, default [`DEFAULT_VM_NETWORK`]).
    pub vm_network: Ipv4Net,
    /// Masquerade on a pod with IPv6: the guest's IPv6 network (`vmIPv6NetworkCIDR`, default
    /// [`DEFAULT_VM_IPV6_NETWORK`]).
    pub vm_ipv6_network: Ipv6Net,
}

impl InterfacePlan {
    /// Masquerade: the bridge's (gateway) address, the first host of the guest network.
    pub fn gateway(&self) -> Ipv4Cidr {
        Ipv4Cidr {
            address: nth_host(self.vm_network, 1),
            prefix: self.vm_network.prefix_len(),
        }
    }

    /// Masquerade: the guest's address, the second host of the guest network.
    pub fn guest(&self) -> Ipv4Cidr {
        Ipv4Cidr {
            address: nth_host(self.vm_network, 2),
            prefix: self.vm_network.prefix_len(),
        }
    }

    /// Masquerade with IPv6: the bridge's (gateway) address, the first host.
    pub fn gateway_ipv6(&self) -> Ipv6Cidr {
        Cidr {
            address: Ipv6Addr::from(u128::from(self.vm_ipv6_network.network()) + 1),
            prefix: self.vm_ipv6_network.prefix_len(),
        }
    }

    /// Masquerade with IPv6: the guest's address, the second host.
    pub fn guest_ipv6(&self) -> Ipv6Cidr {
        Cidr {
            address: Ipv6Addr::from(u128::from(self.vm_ipv6_network.network()) + 2),
            prefix: self.vm_ipv6_network.prefix_len(),
        }
    }

    /// Bridge: a link-local address for the bridge, so the DHCP server has a source address
    /// without taking one from the pod's subnet (KubeVirt's `169.254.75.1<index>/32`).
    pub fn bridge_server_address(&self) -> Ipv4Addr {
        let last = u8::try_from(10 + self.index % 10).unwrap_or(10);
        Ipv4Addr::new(169, 254, 75, last)
    }
}

fn nth_host(net: Ipv4Net, n: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(net.network()) + n)
}

fn spec_err(field: String, message: impl Into<String>) -> NetworkError {
    NetworkError::Spec {
        field,
        message: message.into(),
    }
}

/// The tap for interface `index`: the launcher renders `-netdev tap,ifname=tap<index>`.
pub fn tap_name(index: usize) -> String {
    format!("tap{index}")
}

/// KubeVirt's in-pod bridge name, `k6t-<pod interface>`.
pub fn bridge_name(pod_interface: &str) -> String {
    format!("k6t-{pod_interface}")
}

/// The pod interface a network lives on: the pod network is the pod's `eth0`.
pub const POD_NETWORK_INTERFACE: &str = "eth0";

/// Plans every interface of the VMI. Errors name the field.
pub fn plan(vmi: &VirtualMachineInstance) -> Result<Vec<InterfacePlan>> {
    let spec = &vmi.spec;
    let mut out = Vec::new();
    for (index, iface) in spec.domain.devices.interfaces.iter().enumerate() {
        let field = format!("spec.domain.devices.interfaces[{index}]");
        let Some(network) = spec.network(&iface.name) else {
            return Err(spec_err(
                format!("{field}.name"),
                format!("no network named {:?} in spec.networks", iface.name),
            ));
        };
        let Some(pod) = network.pod.as_ref() else {
            return Err(spec_err(
                format!("{field}.name"),
                "only the pod network is supported",
            ));
        };
        let binding = match iface.binding_method() {
            Some(InterfaceBinding::Masquerade) => Binding::Masquerade,
            Some(InterfaceBinding::Bridge) => Binding::Bridge,
            _ => {
                return Err(spec_err(field, "needs a bridge or masquerade binding"));
            }
        };
        let cidr = pod.vm_network_cidr.as_deref().unwrap_or(DEFAULT_VM_NETWORK);
        let vm_network: Ipv4Net = cidr.parse().map_err(|_| {
            spec_err(
                format!(
                    "spec.networks[{}].pod.vmNetworkCIDR",
                    network_index(vmi, &iface.name)
                ),
                format!("{cidr:?} is not an IPv4 CIDR"),
            )
        })?;
        if vm_network.prefix_len() > 30 {
            return Err(spec_err(
                format!(
                    "spec.networks[{}].pod.vmNetworkCIDR",
                    network_index(vmi, &iface.name)
                ),
                format!("{cidr:?} is too small: the gateway and the guest need two addresses"),
            ));
        }
        let cidr6 = pod
            .vm_ipv6_network_cidr
            .as_deref()
            .unwrap_or(DEFAULT_VM_IPV6_NETWORK);
        let cidr6_field = || {
            format!(
                "spec.networks[{}].pod.vmIPv6NetworkCIDR",
                network_index(vmi, &iface.name)
            )
        };
        let vm_ipv6_network: Ipv6Net = cidr6
            .parse()
            .map_err(|_| spec_err(cidr6_field(), format!("{cidr6:?} is not an IPv6 CIDR")))?;
        if vm_ipv6_network.prefix_len() > 126 {
            return Err(spec_err(
                cidr6_field(),
                format!("{cidr6:?} is too small: the gateway and the guest need two addresses"),
            ));
        }
        let mut ports = Vec::new();
        for (j, p) in iface.ports.iter().enumerate() {
            let port = u16::try_from(p.port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| {
                    spec_err(
                        format!("{field}.ports[{j}].port"),
                        "must be in range 0 < x < 65536",
                    )
                })?;
            let protocol = match p.protocol.as_deref() {
                None | Some("TCP" | "tcp") => "tcp",
                Some("UDP" | "udp") => "udp",
                Some(other) => {
                    return Err(spec_err(
                        format!("{field}.ports[{j}].protocol"),
                        format!("unknown protocol {other:?}, only TCP or UDP allowed"),
                    ));
                }
            };
            ports.push(ForwardedPort { protocol, port });
        }
        let pod_interface = POD_NETWORK_INTERFACE.to_owned();
        out.push(InterfacePlan {
            index,
            name: iface.name.clone(),
            binding,
            bridge: bridge_name(&pod_interface),
            tap: tap_name(index),
            queues: spec.network_queues(iface),
            pod_interface,
            ports,
            vm_network,
            vm_ipv6_network,
        });
    }
    Ok(out)
}

fn network_index(vmi: &VirtualMachineInstance, name: &str) -> usize {
    vmi.spec
        .networks
        .iter()
        .position(|n| n.name == name)
        .unwrap_or_default()
}

/// Parses `de:ad:00:00:be:af` or `DE-AD-00-00-BE-AF`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let sep = if s.contains('-') { '-' } else { ':' };
    let mut out = [0u8; 6];
    let mut parts = s.split(sep);
    for b in &mut out {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}

pub fn format_mac(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The guest's MAC for an interface: the spec's `macAddress`; for a bridge binding without
/// one, the pod interface's original MAC (the guest takes the pod's place on the wire, as in
/// KubeVirt); otherwise one derived from the VMI uid and the interface name, so it stays the
/// same across launcher restarts. Derived MACs use QEMU/libvirt's `52:54:00` prefix.
pub fn guest_mac(
    vmi_uid: &str,
    iface_name: &str,
    spec_mac: Option<&str>,
    cached: Option<&CachedInterface>,
) -> Option<[u8; 6]> {
    if let Some(m) = spec_mac {
        return parse_mac(m);
    }
    if let Some(c) = cached.filter(|c| c.binding == Binding::Bridge)
        && let Some(m) = parse_mac(&c.pod_mac)
    {
        return Some(m);
    }
    // FNV-1a: small, stable across Rust versions (unlike std's hasher).
    let mut h: u32 = 0x811c_9dc5;
    for b in vmi_uid.bytes().chain([b'/']).chain(iface_name.bytes()) {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    let [_, a, b, c] = h.to_be_bytes();
    Some([0x52, 0x54, 0x00, a, b, c])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(spec: &serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default", "uid": "u"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn masquerade_defaults_and_ports() {
        let v = vmi(&json!({
            "domain": {"devices": {"interfaces": [{"name": "default", "masquerade": {},
                "ports": [{"port": 80}, {"port": 53, "protocol": "UDP"}]}]}},
            "networks": [{"name": "default", "pod": {}}],
        }));
        let p = plan(&v).unwrap();
        assert_eq!(p.len(), 1);
        let p = &p[0];
        assert_eq!(
            (p.tap.as_str(), p.bridge.as_str(), p.pod_interface.as_str()),
            ("tap0", "k6t-eth0", "eth0")
        );
        assert_eq!(p.gateway().to_string(), "10.0.2.1/24");
        assert_eq!(p.guest().to_string(), "10.0.2.2/24");
        assert_eq!(p.queues, 1);
        assert_eq!(
            p.ports,
            vec![
                ForwardedPort {
                    protocol: "tcp",
                    port: 80
                },
                ForwardedPort {
                    protocol: "udp",
                    port: 53
                }
            ]
        );
    }

    #[test]
    fn multiqueue_taps_get_a_queue_per_vcpu_for_virtio_only() {
        let v = vmi(&json!({
            "domain": {"cpu": {"sockets": 1, "cores": 3, "threads": 1},
                "devices": {"networkInterfaceMultiqueue": true, "interfaces": [
                    {"name": "a", "bridge": {}},
                    {"name": "b", "masquerade": {}, "model": "e1000"}]}},
            "networks": [{"name": "a", "pod": {}}, {"name": "b", "pod": {}}],
        }));
        let queues: Vec<u32> = plan(&v).unwrap().iter().map(|p| p.queues).collect();
        assert_eq!(queues, [3, 1]);
    }

    #[test]
    fn vm_network_cidr_is_used_and_checked() {
        let v = vmi(&json!({
            "domain": {"devices": {"interfaces": [{"name": "n", "masquerade": {}}]}},
            "networks": [{"name": "n", "pod": {"vmNetworkCIDR": "192.168.7.0/28"}}],
        }));
        let p = plan(&v).unwrap();
        assert_eq!(p[0].guest().to_string(), "192.168.7.2/28");
        let v = vmi(&json!({
            "domain": {"devices": {"interfaces": [{"name": "n", "masquerade": {}}]}},
            "networks": [{"name": "n", "pod": {"vmNetworkCIDR": "192.168.7.0/31"}}],
        }));
        let e = plan(&v).unwrap_err().to_string();
        assert!(e.starts_with("spec.networks[0].pod.vmNetworkCIDR:"), "{e}");
    }

    #[test]
    fn ipv6_guest_network_defaults_and_is_checked() {
        let v = vmi(&json!({
            "domain": {"devices": {"interfaces": [{"name": "n", "masquerade": {}}]}},
            "networks": [{"name": "n", "pod": {}}],
        }));
        let p = &plan(&v).unwrap()[0];
        assert_eq!(p.gateway_ipv6().to_string(), "fd10:0:2::1/120");
        assert_eq!(p.guest_ipv6().to_string(), "fd10:0:2::2/120");
        let v = vmi(&json!({
            "domain": {"devices": {"interfaces": [{"name": "n", "masquerade": {}}]}},
            "networks": [{"name": "n", "pod": {"vmIPv6NetworkCIDR": "fd00:1::/64"}}],
        }));
        assert_eq!(
            plan(&v).unwrap()[0].guest_ipv6().to_string(),
            "fd00:1::2/64"
        );
        for bad in ["10.0.2.0/24", "fd00::/127"] {
            let v = vmi(&json!({
                "domain": {"devices": {"interfaces": [{"name": "n", "masquerade": {}}]}},
                "networks": [{"name": "n", "pod": {"vmIPv6NetworkCIDR": bad}}],
            }));
            let e = plan(&v).unwrap_err().to_string();
            assert!(
                e.starts_with("spec.networks[0].pod.vmIPv6NetworkCIDR:"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn errors_name_the_field() {
        for (spec, field) in [
            (
                json!({"domain": {"devices": {"interfaces": [{"name": "x", "bridge": {}}]}},
                       "networks": [{"name": "n", "pod": {}}]}),
                "spec.domain.devices.interfaces[0].name",
            ),
            (
                json!({"domain": {"devices": {"interfaces": [{"name": "n", "masquerade": {},
                        "ports": [{"port": 70000}]}]}},
                       "networks": [{"name": "n", "pod": {}}]}),
                "spec.domain.devices.interfaces[0].ports[0].port",
            ),
            (
                json!({"domain": {"devices": {"interfaces": [{"name": "n", "sriov": {}}]}},
                       "networks": [{"name": "n", "pod": {}}]}),
                "spec.domain.devices.interfaces[0]",
            ),
        ] {
            let e = plan(&vmi(&spec)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{field}:")), "{e}");
        }
    }

    #[test]
    fn macs() {
        assert_eq!(
            parse_mac("DE-AD-00-00-BE-AF"),
            Some([0xde, 0xad, 0, 0, 0xbe, 0xaf])
        );
        assert_eq!(parse_mac("de:ad:00:00:be"), None);
        assert_eq!(parse_mac("de:ad:00:00:be:af:01"), None);
        assert_eq!(parse_mac("zz:ad:00:00:be:af"), None);
        let a = guest_mac("uid-1", "default", None, None).unwrap();
        assert_eq!(a, guest_mac("uid-1", "default", None, None).unwrap());
        assert_ne!(a, guest_mac("uid-2", "default", None, None).unwrap());
        assert_eq!(a[..3], [0x52, 0x54, 0x00]);
        assert_eq!(
            guest_mac("u", "n", Some("02:aa:bb:cc:dd:ee"), None),
            Some([2, 0xaa, 0xbb, 0xcc, 0xdd, 0xee])
        );
    }
}
