//! `status.interfaces`: what the domain says (the VMI's interfaces and their MACs) merged with
//! what the guest agent says (`guest-network-get-interfaces`: names and addresses inside the
//! guest), matched by MAC as KubeVirt does. Pure; the handler calls it with the interfaces of the
//! launcher's [`GetDomain`](launcher_api::action::GetDomain) and
//! [`GuestInterfaces`](launcher_api::action::GuestInterfaces).

use std::net::IpAddr;

use api::status::VirtualMachineInstanceNetworkInterface;
use launcher_api::guest::AgentInterface;
use serde::{Deserialize, Serialize};

pub const INFO_SOURCE_DOMAIN: &str = "domain";
pub const INFO_SOURCE_GUEST_AGENT: &str = "guest-agent";
pub const INFO_SOURCE_DOMAIN_AND_GUEST_AGENT: &str = "domain, guest-agent";

/// One NIC of the domain (the launcher's `domain.interfaces[]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DomainInterface {
    /// The VMI interface name.
    pub name: String,
    pub mac: Option<String>,
    /// The pod interface behind it (`eth0` for the pod network), if known.
    #[serde(default)]
    pub pod_interface: Option<String>,
    /// `up` or `down`, as the guest sees the link.
    #[serde(default)]
    pub link_state: Option<String>,
    /// The NIC's queue pairs (1 unless `networkInterfaceMultiqueue` gave it more).
    #[serde(default)]
    pub queue_count: Option<i32>,
}

fn same_mac(a: &str, b: &str) -> bool {
    a.replace('-', ":")
        .eq_ignore_ascii_case(&b.replace('-', ":"))
}

/// The guest's addresses worth reporting: no IPv6 link-local ones; IPv4 first, as the
/// `ipAddress` field is the first of them.
fn addresses(a: &AgentInterface) -> Vec<String> {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for ip in &a.ip_addresses {
        match ip.ip_address.parse::<IpAddr>() {
            Ok(IpAddr::V4(_)) => v4.push(ip.ip_address.clone()),
            Ok(IpAddr::V6(x)) if (x.segments()[0] & 0xffc0) != 0xfe80 => {
                v6.push(ip.ip_address.clone());
            }
            _ => {}
        }
    }
    v4.extend(v6);
    v4
}

/// Merges the two views. Spec interfaces come first, in domain order; guest interfaces the
/// domain does not know (other than loopback) follow with `infoSource: guest-agent`.
pub fn merge(
    domain: &[DomainInterface],
    agent: Option<&[AgentInterface]>,
) -> Vec<VirtualMachineInstanceNetworkInterface> {
    let agent = agent.unwrap_or_default();
    let mut used = vec![false; agent.len()];
    let mut out = Vec::new();
    for d in domain {
        let found = d.mac.as_deref().and_then(|mac| {
            agent.iter().enumerate().find(|(i, a)| {
                !used[*i]
                    && a.hardware_address
                        .as_deref()
                        .is_some_and(|h| same_mac(h, mac))
            })
        });
        let mut s = VirtualMachineInstanceNetworkInterface {
            name: Some(d.name.clone()),
            mac: d.mac.clone(),
            pod_interface_name: d.pod_interface.clone(),
            link_state: d.link_state.clone(),
            queue_count: d.queue_count,
            info_source: Some(INFO_SOURCE_DOMAIN.to_owned()),
            ..Default::default()
        };
        if let Some((i, a)) = found {
            used[i] = true;
            s.ips = addresses(a);
            s.ip = s.ips.first().cloned();
            s.interface_name = Some(a.name.clone());
            s.info_source = Some(INFO_SOURCE_DOMAIN_AND_GUEST_AGENT.to_owned());
        }
        out.push(s);
    }
    for (i, a) in agent.iter().enumerate() {
        if used[i] || a.name == "lo" {
            continue;
        }
        let ips = addresses(a);
        out.push(VirtualMachineInstanceNetworkInterface {
            ip: ips.first().cloned(),
            ips,
            mac: a.hardware_address.clone(),
            interface_name: Some(a.name.clone()),
            info_source: Some(INFO_SOURCE_GUEST_AGENT.to_owned()),
            ..Default::default()
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn agent() -> Vec<AgentInterface> {
        serde_json::from_value(json!([
            {"name": "lo", "hardware-address": "00:00:00:00:00:00",
             "ip-addresses": [{"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8}]},
            {"name": "eth0", "hardware-address": "52:54:00:AA:BB:CC",
             "ip-addresses": [
                {"ip-address-type": "ipv6", "ip-address": "fe80::5054:ff:feaa:bbcc", "prefix": 64},
                {"ip-address-type": "ipv6", "ip-address": "fd10:0:2::2", "prefix": 120},
                {"ip-address-type": "ipv4", "ip-address": "10.0.2.2", "prefix": 24}]},
            {"name": "eth1", "hardware-address": "02:00:00:00:00:09", "ip-addresses": []}
        ]))
        .unwrap()
    }

    #[test]
    fn merged_by_mac() {
        let d = vec![
            DomainInterface {
                name: "default".into(),
                mac: Some("52:54:00:aa:bb:cc".into()),
                pod_interface: Some("eth0".into()),
                link_state: Some("down".into()),
                queue_count: Some(2),
            },
            DomainInterface {
                name: "other".into(),
                mac: Some("52:54:00:00:00:01".into()),
                pod_interface: None,
                link_state: None,
                queue_count: None,
            },
        ];
        let a = agent();
        let s = merge(&d, Some(&a));
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name.as_deref(), Some("default"));
        assert_eq!(s[0].ip.as_deref(), Some("10.0.2.2"));
        assert_eq!(s[0].ips, vec!["10.0.2.2", "fd10:0:2::2"]);
        assert_eq!(s[0].interface_name.as_deref(), Some("eth0"));
        assert_eq!(s[0].info_source.as_deref(), Some("domain, guest-agent"));
        assert_eq!(s[0].pod_interface_name.as_deref(), Some("eth0"));
        assert_eq!(s[0].link_state.as_deref(), Some("down"));
        assert_eq!(s[0].queue_count, Some(2));
        assert_eq!(s[1].info_source.as_deref(), Some("domain"));
        assert_eq!(s[1].ip, None);
        assert_eq!(s[2].name, None);
        assert_eq!(s[2].interface_name.as_deref(), Some("eth1"));
        assert_eq!(s[2].info_source.as_deref(), Some("guest-agent"));
    }

    #[test]
    fn without_agent_the_domain_alone() {
        let d = vec![DomainInterface {
            name: "default".into(),
            mac: None,
            pod_interface: None,
            link_state: Some("up".into()),
            queue_count: Some(1),
        }];
        let s = merge(&d, None);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].info_source.as_deref(), Some("domain"));
        assert_eq!(s[0].link_state.as_deref(), Some("up"));
    }
}
