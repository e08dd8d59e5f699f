//! Pod networking like a bridge CNI: one bridge per node holding the gateway address of the
//! node's pod CIDR, and per pod a network namespace joined to it by a veth pair.
//!
//! The work is done by `ip` (iproute2), the same tool a CNI plugin's shell counterpart uses; its
//! commands are few, readable in logs, and each step can be undone by name.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;

use super::KubeletError;

/// Runs `ip` with `args`; the error carries the command line and what `ip` said.
pub fn ip(args: &[&str]) -> Result<(), KubeletError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|source| KubeletError::Tool {
            command: format!("ip {}", args.join(" ")),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(KubeletError::Network {
            command: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// A node's pod CIDR (IPv4, prefix length 16..=30).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodCidr {
    pub network: Ipv4Addr,
    pub prefix: u8,
}

impl PodCidr {
    /// Parses `a.b.c.d/n`.
    pub fn parse(s: &str) -> Option<Self> {
        let (addr, prefix) = s.split_once('/')?;
        let addr: Ipv4Addr = addr.parse().ok()?;
        let prefix: u8 = prefix.parse().ok()?;
        if !(16..=30).contains(&prefix) {
            return None;
        }
        let mask = u32::MAX << (32 - prefix);
        Some(Self {
            network: Ipv4Addr::from(u32::from(addr) & mask),
            prefix,
        })
    }

    /// The gateway (first host address), held by the node bridge.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 1)
    }

    /// The lowest free pod address (after the gateway, before broadcast).
    pub fn allocate(&self, used: &BTreeSet<Ipv4Addr>) -> Option<Ipv4Addr> {
        let size = 1u32 << (32 - self.prefix);
        (2..size - 1)
            .map(|i| Ipv4Addr::from(u32::from(self.network) + i))
            .find(|a| !used.contains(a))
    }
}

impl std::fmt::Display for PodCidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// Creates the node bridge with the gateway address (idempotent).
pub fn ensure_bridge(bridge: &str, cidr: PodCidr) -> Result<(), KubeletError> {
    if !PathBuf::from("/sys/class/net").join(bridge).exists() {
        ip(&["link", "add", bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/{}", cidr.gateway(), cidr.prefix),
            "dev",
            bridge,
        ])?;
    }
    ip(&["link", "set", bridge, "up"])
}

/// Removes the node bridge, if present.
pub fn delete_bridge(bridge: &str) {
    if PathBuf::from("/sys/class/net").join(bridge).exists()
        && let Err(e) = ip(&["link", "del", bridge])
    {
        tracing::warn!(%bridge, error = %e, "deleting the node bridge");
    }
}

/// The interfaces attached to `bridge` (its ports: the pods' host-side veths).
pub fn bridge_ports(bridge: &str) -> Vec<String> {
    let dir = PathBuf::from("/sys/class/net").join(bridge).join("brif");
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// One pod's network: a named namespace (`/run/netns/<netns>`) and the host end of its veth.
#[derive(Debug, Clone)]
pub struct PodNetwork {
    pub netns: String,
    pub host_veth: String,
    pub ip: Ipv4Addr,
}

impl PodNetwork {
    /// Names derived from the pod uid, short enough for interface names (15 bytes).
    pub fn for_uid(uid: &str, ip: Ipv4Addr) -> Self {
        let short: String = uid
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(11)
            .collect();
        Self {
            netns: format!("lc-{short}"),
            host_veth: format!("lcv{short}"),
            ip,
        }
    }

    /// The namespace's path, for `setns`.
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.netns)
    }

    /// Creates the namespace and wires `eth0` inside it to `bridge`.
    pub fn create(&self, bridge: &str, cidr: PodCidr) -> Result<(), KubeletError> {
        let ns = self.netns.as_str();
        ip(&["netns", "add", ns])?;
        let wired = (|| {
            ip(&[
                "link",
                "add",
                &self.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            ])?;
            ip(&["link", "set", &self.host_veth, "master", bridge, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/{}", self.ip, cidr.prefix),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&[
                "-n",
                ns,
                "route",
                "add",
                "default",
                "via",
                &cidr.gateway().to_string(),
            ])
        })();
        if wired.is_err() {
            self.delete();
        }
        wired
    }

    /// Removes the veth and the namespace; missing pieces are not errors.
    pub fn delete(&self) {
        if PathBuf::from("/sys/class/net")
            .join(&self.host_veth)
            .exists()
            && let Err(e) = ip(&["link", "del", &self.host_veth])
        {
            tracing::warn!(veth = %self.host_veth, error = %e, "deleting a pod veth");
        }
        if self.netns_path().exists()
            && let Err(e) = ip(&["netns", "del", &self.netns])
        {
            tracing::warn!(netns = %self.netns, error = %e, "deleting a pod netns");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_parsing_and_allocation() {
        let c = PodCidr::parse("10.244.7.9/24").unwrap();
        assert_eq!(c.to_string(), "10.244.7.0/24");
        assert_eq!(c.gateway(), Ipv4Addr::new(10, 244, 7, 1));
        let mut used = BTreeSet::new();
        assert_eq!(c.allocate(&used), Some(Ipv4Addr::new(10, 244, 7, 2)));
        used.insert(Ipv4Addr::new(10, 244, 7, 2));
        assert_eq!(c.allocate(&used), Some(Ipv4Addr::new(10, 244, 7, 3)));
        let tiny = PodCidr::parse("10.0.0.0/30").unwrap();
        assert_eq!(
            tiny.allocate(&BTreeSet::new()),
            Some(Ipv4Addr::new(10, 0, 0, 2))
        );
        assert_eq!(tiny.allocate(&[Ipv4Addr::new(10, 0, 0, 2)].into()), None);
        for bad in ["10.0.0.0", "10.0.0.0/8", "x/24", "10.0.0.0/31"] {
            assert_eq!(PodCidr::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn names_fit_interface_limits() {
        let n = PodNetwork::for_uid("0f8e2a4c-1234-5678-9abc-def012345678", Ipv4Addr::LOCALHOST);
        assert_eq!(n.netns, "lc-0f8e2a4c123");
        assert_eq!(n.host_veth, "lcv0f8e2a4c123");
        assert!(n.host_veth.len() <= 15);
    }
}
