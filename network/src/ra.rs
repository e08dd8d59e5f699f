//! Router advertisements for a masqueraded guest with IPv6: the launcher's half of "the bridge
//! is the guest's IPv6 router". DHCPv6 hands out the address but has no default-route option;
//! an RA gives the guest its default route (via the bridge's link-local address), the on-link
//! guest network (`fd10:0:2::/120`, not autonomous: a /120 is no SLAAC prefix) and the MTU, and
//! sets the Managed and Other flags, which tell the guest to ask DHCPv6.
//!
//! Sent to all nodes when the server starts, every [`INTERVAL`], and at once for every router
//! solicitation (the kernel delivers those because phase 1 turns on IPv6 forwarding, which
//! joins the bridge to the all-routers group). NDP is not in `dhcproto` and the message is a
//! few fixed fields, so it is built by hand ([`advertisement`], pure).

use std::net::{Ipv6Addr, SocketAddrV6};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tracing::{debug, info, warn};

use crate::cache::{CachedInterface, Ipv6Cidr};
use crate::error::{NetworkError, Result};
use crate::plan::MASQUERADE_BRIDGE_MAC;

/// How often an unsolicited advertisement is repeated, well inside [`ROUTER_LIFETIME`].
pub const INTERVAL: Duration = Duration::from_secs(10);

/// How long the guest keeps the default route without hearing from us (RFC 4861's default,
/// three times the maximum advertisement interval).
pub const ROUTER_LIFETIME: u16 = 1800;

const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
const ROUTER_SOLICITATION: u8 = 133;
const ROUTER_ADVERTISEMENT: u8 = 134;

/// What the advertisements say, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaConfig {
    /// The bridge they are sent on.
    pub interface: String,
    /// The bridge's MAC (the source link-layer address option).
    pub router_mac: [u8; 6],
    /// The guest network, advertised on-link.
    pub prefix: Ipv6Cidr,
    pub mtu: u32,
}

/// The configuration for one cached interface; `None` when the guest has no IPv6.
pub fn config(cached: &CachedInterface) -> Option<RaConfig> {
    let guest = cached.guest_ipv6?;
    let net = ipnet::Ipv6Net::new(guest.address, guest.prefix).ok()?;
    Some(RaConfig {
        interface: cached.bridge.clone(),
        router_mac: MASQUERADE_BRIDGE_MAC,
        prefix: Ipv6Cidr {
            address: net.network(),
            prefix: guest.prefix,
        },
        mtu: cached.mtu,
    })
}

/// The ICMPv6 router advertisement (RFC 4861 4.2) with source link-layer address, MTU and
/// prefix information options. The checksum is left zero: the kernel fills it in on raw
/// ICMPv6 sockets.
pub fn advertisement(cfg: &RaConfig) -> Vec<u8> {
    const MANAGED: u8 = 0x80;
    const OTHER: u8 = 0x40;
    const ON_LINK: u8 = 0x80;
    let mut p = vec![ROUTER_ADVERTISEMENT, 0, 0, 0, 64, MANAGED | OTHER];
    p.extend_from_slice(&ROUTER_LIFETIME.to_be_bytes());
    p.extend_from_slice(&[0; 8]); // reachable time, retransmission timer: unspecified
    p.extend_from_slice(&[1, 1]); // source link-layer address, 8 bytes
    p.extend_from_slice(&cfg.router_mac);
    p.extend_from_slice(&[5, 1, 0, 0]); // MTU, 8 bytes
    p.extend_from_slice(&cfg.mtu.to_be_bytes());
    p.extend_from_slice(&[3, 4, cfg.prefix.prefix, ON_LINK]); // prefix information, 32 bytes
    p.extend_from_slice(&u32::MAX.to_be_bytes()); // valid lifetime: infinite
    p.extend_from_slice(&u32::MAX.to_be_bytes()); // preferred lifetime: infinite
    p.extend_from_slice(&[0; 4]);
    p.extend_from_slice(&cfg.prefix.address.octets());
    p
}

fn socket(interface: &str) -> Result<(OwnedFd, u32)> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockProtocol, SockType, setsockopt, socket, sockopt,
    };
    let err = |what: &str| {
        let action = format!("router advertisement socket on {interface}: {what}");
        move |e: nix::Error| NetworkError::io(action)(e.into())
    };
    let fd = socket(
        AddressFamily::Inet6,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        SockProtocol::IcmpV6,
    )
    .map_err(err("socket"))?;
    setsockopt(&fd, sockopt::BindToDevice, &interface.into()).map_err(err("SO_BINDTODEVICE"))?;
    // Receivers drop neighbour discovery whose hop limit is not 255 (it proves the sender is
    // on the link).
    setsockopt(&fd, sockopt::Ipv6MulticastHops, &255).map_err(err("IPV6_MULTICAST_HOPS"))?;
    let ifindex = nix::net::if_::if_nametoindex(interface).map_err(err("interface index"))?;
    Ok((fd, ifindex))
}

/// Advertises on the configured bridge until the task is dropped. The socket is opened before
/// this returns the future, so errors (no bridge, no `CAP_NET_RAW`) come back at once.
pub fn serve(cfg: RaConfig) -> Result<impl Future<Output = ()>> {
    let (fd, ifindex) = socket(&cfg.interface)?;
    // SAFETY: the AsyncFd takes ownership of the OwnedFd; nothing else closes or replaces the
    // descriptor while it is registered.
    let fd = unsafe { AsyncFd::register(fd) }
        .map_err(std::io::Error::from)
        .map_err(NetworkError::io(format!(
            "router advertisement socket on {}",
            cfg.interface
        )))?;
    let to = nix::sys::socket::SockaddrIn6::from(SocketAddrV6::new(ALL_NODES, 0, 0, ifindex));
    let packet = advertisement(&cfg);
    info!(interface = %cfg.interface, prefix = %cfg.prefix, "router advertisements on");
    Ok(async move {
        let send = || {
            // Fails until the bridge has a link-local address (it gets one with its first
            // port up, QEMU's tap): the next round or solicitation tries again.
            if let Err(e) = nix::sys::socket::sendto(
                fd.get_ref().as_raw_fd(),
                &packet,
                &to,
                nix::sys::socket::MsgFlags::empty(),
            ) {
                debug!(interface = %cfg.interface, error = %e, "router advertisement not sent");
            }
        };
        let mut tick = tokio::time::interval(INTERVAL);
        let mut buf = [0u8; 1500];
        loop {
            tokio::select! {
                _ = tick.tick() => send(),
                ready = fd.readable() => {
                    let Ok(mut guard) = ready else {
                        warn!(interface = %cfg.interface, "router advertisement socket failed");
                        return;
                    };
                    match guard.try_io(|f| {
                        nix::sys::socket::recv(
                            f.get_ref().as_raw_fd(),
                            &mut buf,
                            nix::sys::socket::MsgFlags::empty(),
                        )
                        .map_err(std::io::Error::from)
                    }) {
                        Ok(Ok(n)) if n > 0 && buf[0] == ROUTER_SOLICITATION => send(),
                        Ok(_) | Err(_) => {}
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertisement_layout() {
        let cfg = RaConfig {
            interface: "k6t-eth0".into(),
            router_mac: MASQUERADE_BRIDGE_MAC,
            prefix: Ipv6Cidr {
                address: "fd10:0:2::".parse().unwrap(),
                prefix: 120,
            },
            mtu: 1400,
        };
        let p = advertisement(&cfg);
        assert_eq!(p.len(), 16 + 8 + 8 + 32);
        assert_eq!(&p[..8], &[134, 0, 0, 0, 64, 0xc0, 0x07, 0x08]);
        assert_eq!(&p[16..24], &[1, 1, 2, 0, 0, 0, 0, 0]);
        assert_eq!(&p[24..32], &[5, 1, 0, 0, 0, 0, 0x05, 0x78]);
        assert_eq!(&p[32..36], &[3, 4, 120, 0x80]);
        assert_eq!(
            &p[48..],
            &"fd10:0:2::".parse::<Ipv6Addr>().unwrap().octets()
        );
    }

    #[test]
    fn config_advertises_the_guest_network() {
        let cached: CachedInterface = serde_json::from_value(serde_json::json!({
            "name": "default", "binding": "masquerade", "podInterface": "eth0",
            "bridge": "k6t-eth0", "tap": "tap0", "mtu": 1500, "podMac": "0a:58:0a:f4:00:05",
            "podIpv4": null, "guestIpv4": null, "gatewayIpv4": null, "serverIpv4": "10.0.2.1",
            "guestIpv6": {"address": "fd10:0:2::2", "prefix": 120},
            "gatewayIpv6": "fd10:0:2::1",
        }))
        .unwrap();
        let c = config(&cached).unwrap();
        assert_eq!(c.prefix.to_string(), "fd10:0:2::/120");
        assert_eq!(c.interface, "k6t-eth0");
        assert_eq!(c.mtu, 1500);
    }
}
