//! The launcher's DHCPv4 server: one per interface, bound to the in-pod bridge, answering only
//! the guest's MAC, with what phase 1 cached (address, gateway, MTU, routes) and the pod's
//! resolv.conf (DNS servers, search domains). Leases are effectively infinite (999 days, as in
//! KubeVirt): the address is the guest's for the life of the pod.
//!
//! Packets are parsed and built by `dhcproto`; [`respond`] and [`answer`] (bytes in, bytes
//! out) are pure, [`serve`] is the socket.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::str::FromStr;

use dhcproto::v4::{DhcpOption, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable as _, Decoder, Encodable as _, Encoder, Name};
use ipnet::Ipv4Net;
use tracing::{debug, info, warn};

use crate::cache::{CachedInterface, Ipv4Cidr, Route};
use crate::error::Result;

/// 999 days, KubeVirt's "infinite" lease.
pub const LEASE_SECONDS: u32 = 999 * 24 * 3600;

/// What the server hands out, and to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DhcpConfig {
    /// The bridge the server listens on.
    pub interface: String,
    /// The only client answered.
    pub mac: [u8; 6],
    pub address: Ipv4Cidr,
    pub gateway: Option<Ipv4Addr>,
    /// Server identifier (the bridge's address).
    pub server: Ipv4Addr,
    pub dns: Vec<Ipv4Addr>,
    pub search: Vec<String>,
    pub mtu: u16,
    pub hostname: String,
    /// Sent as classless static routes (option 121) only when the pod has routes beyond its
    /// default one.
    pub routes: Vec<Route>,
}

/// `nameserver` lines of the family `A` (DHCPv4 hands out IPv4 servers, DHCPv6 IPv6 ones) and
/// `search` / `domain` lines of a resolv.conf.
pub fn parse_resolv_conf<A: FromStr>(text: &str) -> (Vec<A>, Vec<String>) {
    let mut dns = Vec::new();
    let mut search = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(Ok(ip)) = words.next().map(A::from_str) {
                    dns.push(ip);
                }
            }
            // The last search/domain line wins, as in the resolver.
            Some("search" | "domain") => search = words.map(str::to_owned).collect(),
            _ => {}
        }
    }
    (dns, search)
}

/// The server's configuration for one cached interface. `None` when phase 1 left the guest no
/// IPv4 address to give.
pub fn config(
    cached: &CachedInterface,
    mac: [u8; 6],
    hostname: &str,
    resolv_conf: &str,
) -> Option<DhcpConfig> {
    let (dns, search) = parse_resolv_conf(resolv_conf);
    Some(DhcpConfig {
        interface: cached.bridge.clone(),
        mac,
        address: cached.guest_ipv4?,
        gateway: cached.gateway_ipv4,
        server: cached.server_ipv4,
        dns,
        search,
        mtu: u16::try_from(cached.mtu).unwrap_or(u16::MAX),
        hostname: hostname.to_owned(),
        routes: cached.routes.clone(),
    })
}

fn prefix_mask(prefix: u8) -> Ipv4Addr {
    Ipv4Net::new(Ipv4Addr::UNSPECIFIED, prefix.min(32)).map_or(Ipv4Addr::BROADCAST, |n| n.netmask())
}

/// The answer to one client packet, or `None` when it is not for us (another MAC, not a
/// request, a release or decline).
pub fn respond(cfg: &DhcpConfig, req: &Message) -> Option<Message> {
    // `chaddr()` slices dhcproto's 16-byte field by the packet's own hlen and panics when a
    // packet claims more (found by fuzzing, `fuzz/`); no Ethernet client does.
    if req.opcode() != Opcode::BootRequest
        || req.hlen() > 16
        || req.chaddr().get(..6) != Some(&cfg.mac[..])
    {
        return None;
    }
    let ours = cfg.address.address;
    let (kind, ok) = match req.opts().msg_type()? {
        MessageType::Discover => (MessageType::Offer, true),
        MessageType::Request => {
            let asked = match req.opts().get(OptionCode::RequestedIpAddress) {
                Some(DhcpOption::RequestedIpAddress(ip)) => Some(*ip),
                _ => (!req.ciaddr().is_unspecified()).then(|| req.ciaddr()),
            };
            let other_server = matches!(
                req.opts().get(OptionCode::ServerIdentifier),
                Some(DhcpOption::ServerIdentifier(s)) if *s != cfg.server
            );
            if other_server {
                return None;
            }
            if asked.is_none_or(|a| a == ours) {
                (MessageType::Ack, true)
            } else {
                (MessageType::Nak, false)
            }
        }
        _ => return None,
    };
    let mut m = Message::default();
    m.set_opcode(Opcode::BootReply)
        .set_xid(req.xid())
        .set_flags(req.flags())
        .set_giaddr(req.giaddr())
        .set_chaddr(&cfg.mac);
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(kind));
    o.insert(DhcpOption::ServerIdentifier(cfg.server));
    if !ok {
        return Some(m);
    }
    m.set_yiaddr(ours).set_siaddr(cfg.server);
    let o = m.opts_mut();
    o.insert(DhcpOption::AddressLeaseTime(LEASE_SECONDS));
    o.insert(DhcpOption::SubnetMask(prefix_mask(cfg.address.prefix)));
    if let Some(gw) = cfg.gateway {
        o.insert(DhcpOption::Router(vec![gw]));
    }
    if !cfg.dns.is_empty() {
        o.insert(DhcpOption::DomainNameServer(cfg.dns.clone()));
    }
    let search: Vec<Name> = cfg
        .search
        .iter()
        .filter_map(|d| Name::from_str(d).ok())
        .collect();
    if !search.is_empty() {
        o.insert(DhcpOption::DomainSearch(search));
    }
    if !cfg.hostname.is_empty() {
        o.insert(DhcpOption::Hostname(cfg.hostname.clone()));
    }
    o.insert(DhcpOption::InterfaceMtu(cfg.mtu));
    if cfg.routes.iter().any(|r| r.prefix != 0) {
        let routes = cfg
            .routes
            .iter()
            .filter_map(|r| {
                Some((
                    Ipv4Net::new(r.destination, r.prefix).ok()?,
                    r.gateway.unwrap_or(Ipv4Addr::UNSPECIFIED),
                ))
            })
            .collect();
        o.insert(DhcpOption::ClasslessStaticRoute(routes));
    }
    Some(m)
}

/// Serves DHCP on the configured bridge until the task is dropped. The socket is bound before
/// this returns the serving future, so errors in binding (no bridge, no privilege for port 67)
/// come back at once.
pub fn serve(cfg: DhcpConfig) -> Result<impl Future<Output = ()>> {
    let sock = crate::udp::bridge_socket(
        "DHCP",
        &cfg.interface,
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 67).into(),
    )?;
    info!(interface = %cfg.interface, address = %cfg.address, "DHCP server listening");
    let interface = cfg.interface.clone();
    Ok(crate::udp::answer_forever(
        "DHCP",
        interface,
        sock,
        move |packet, _| {
            // The client has no address yet: broadcast on the bridge (the socket is bound to it).
            answer(&cfg, packet).map(|out| (out, SocketAddrV4::new(Ipv4Addr::BROADCAST, 68).into()))
        },
    ))
}

/// The encoded answer to one received packet, or `None` for a packet that does not decode, is
/// not for us, or whose answer cannot be encoded.
pub fn answer(cfg: &DhcpConfig, packet: &[u8]) -> Option<Vec<u8>> {
    if let Some(code) = option_dhcproto_asserts_on(packet) {
        debug!(interface = %cfg.interface, code, "DHCP packet with a malformed option ignored");
        return None;
    }
    let Ok(req) = Message::decode(&mut Decoder::new(packet)) else {
        debug!(interface = %cfg.interface, "undecodable DHCP packet ignored");
        return None;
    };
    let reply = respond(cfg, &req)?;
    let mut out = Vec::new();
    if reply.encode(&mut Encoder::new(&mut out)).is_err() {
        warn!(interface = %cfg.interface, "DHCP reply could not be encoded");
        return None;
    }
    debug!(interface = %cfg.interface, kind = ?reply.opts().msg_type(), "DHCP reply");
    Some(out)
}

/// Where the options start: the fixed BOOTP header (236 bytes) and the magic cookie.
const OPTIONS_OFFSET: usize = 240;

/// The code of an option whose length dhcproto 0.15 only checks with a `debug_assert!`, when
/// the packet carries one of another length: decoding it panics in a debug build (the tests and
/// the fuzzer's build) and reads on in a release one. A guest must not be able to stop its own
/// DHCP server in any build, and the server uses none of these options, so such packets are
/// ignored before dhcproto decodes them (found by fuzzing, `fuzz/`). No real client is turned
/// away: the options are well formed in every packet that follows their RFCs, and PXE clients'
/// 94 and Windows' 81 are answered as before.
///
/// The walk follows dhcproto's: options from byte 240 to the first End, Pad skipped, adjacent
/// options of one code concatenated (RFC 3396) and checked as one; a truncated option ends it,
/// with what came before checked, as dhcproto decodes that too.
fn option_dhcproto_asserts_on(packet: &[u8]) -> Option<u8> {
    fn asserts_on(code: u8, len: usize) -> bool {
        match code {
            80 => len != 0,        // Rapid Commit
            81 => len < 3,         // Client FQDN
            94 => len != 3,        // Client Network Interface Identifier
            152..=155 => len != 4, // bulk leasequery times
            _ => false,
        }
    }
    let bad = |run: Option<(u8, usize)>| {
        run.filter(|&(code, len)| asserts_on(code, len))
            .map(|(code, _)| code)
    };
    let mut rest = packet.get(OPTIONS_OFFSET..)?;
    let mut run = None;
    loop {
        match rest {
            [0, tail @ ..] => {
                if let Some(code) = bad(run.take()) {
                    return Some(code);
                }
                rest = tail;
            }
            [code, len, tail @ ..] if *code != 255 && usize::from(*len) <= tail.len() => {
                let len = usize::from(*len);
                run = match run {
                    Some((c, total)) if c == *code => Some((c, total + len)),
                    other => {
                        if let Some(code) = bad(other) {
                            return Some(code);
                        }
                        Some((*code, len))
                    }
                };
                rest = &tail[len..];
            }
            _ => return bad(run),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cache::Binding;

    const MAC: [u8; 6] = [0x52, 0x54, 0, 1, 2, 3];

    fn cfg() -> DhcpConfig {
        let cached = CachedInterface {
            name: "default".into(),
            binding: Binding::Bridge,
            pod_interface: "eth0".into(),
            bridge: "k6t-eth0".into(),
            tap: "tap0".into(),
            mtu: 1400,
            pod_mac: "52:54:00:01:02:03".into(),
            pod_ipv4: None,
            routes: vec![
                Route {
                    destination: Ipv4Addr::UNSPECIFIED,
                    prefix: 0,
                    gateway: Some(Ipv4Addr::new(10, 244, 0, 1)),
                },
                Route {
                    destination: Ipv4Addr::new(10, 96, 0, 0),
                    prefix: 12,
                    gateway: Some(Ipv4Addr::new(10, 244, 0, 1)),
                },
            ],
            guest_ipv4: Some(Ipv4Cidr {
                address: Ipv4Addr::new(10, 244, 0, 7),
                prefix: 24,
            }),
            gateway_ipv4: Some(Ipv4Addr::new(10, 244, 0, 1)),
            server_ipv4: Ipv4Addr::new(169, 254, 75, 10),
            guest_ipv6: None,
            gateway_ipv6: None,
        };
        config(
            &cached,
            MAC,
            "vm1",
            "# comment\nnameserver 10.96.0.10\nnameserver ::1\nsearch default.svc.cluster.local svc.cluster.local\noptions ndots:5\n",
        )
        .unwrap()
    }

    fn request(kind: MessageType, mac: [u8; 6], asked: Option<Ipv4Addr>) -> Message {
        let mut m = Message::default();
        m.set_chaddr(&mac).set_xid(0x1234);
        m.opts_mut().insert(DhcpOption::MessageType(kind));
        if let Some(a) = asked {
            m.opts_mut().insert(DhcpOption::RequestedIpAddress(a));
        }
        // Round-trip through the wire format, as the server sees it.
        let mut b = Vec::new();
        m.encode(&mut Encoder::new(&mut b)).unwrap();
        Message::decode(&mut Decoder::new(&b)).unwrap()
    }

    pub(crate) fn unhex(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The fuzzer's input (less its first byte, which picks DHCPv4 and the pod): a
    /// BOOTREQUEST claiming an 81-byte hardware address, which panicked inside dhcproto.
    #[test]
    fn oversized_hardware_address_length_is_ignored() {
        let hex = "01015151515106003903f326000080000000000000000000000000000000000000000000000000000000\
            00000000000000000000000000000000000000000000000000000000000000003903f326000080000000\
            000000000000000000000000000000000000000000000000000000000000000000000000000000000000\
            000000000000000000000000000000000000000000000000000000000000000000000000000000000000\
            00000000000000000000000000000000000000e40a00000000000000ffffffffffffffffffffffffffff\
            ffffffffffffffffffff0000000000260000800000000000000000000000000000000000000000000000\
            00000077791aff";
        let packet = unhex(hex);
        assert_eq!(packet.len(), 259);
        assert_eq!(answer(&cfg(), &packet), None);
    }

    /// The fuzzer's input (less its first byte): a DHCPv4 packet whose options hold a
    /// bulk-leasequery time (154) of length 0, on which dhcproto's `debug_assert!(len == 4)`
    /// panicked.
    #[test]
    fn bulk_leasequery_option_of_wrong_length_is_ignored() {
        let hex = "010106003903f32600008000000000000000000000000000000000005254001234560000000000000000\
            000000000000000000000000000000000000000000000000000000000000000000000000000000000000\
            000000002300000000000000000000000000000000000000000000000000000000000000000000000000\
            000000000000000000000000000000000000000000000000000000000000000000000000000000000000\
            000000000000000000000000000000000000009a00000000000000000000000000000000000000000000\
            000000000000000000000000000000000000000000000000000000000000000000000000000000000000\
            00000000000000009a00001aff";
        let packet = unhex(hex);
        assert_eq!(packet.len(), 265);
        assert_eq!(answer(&cfg(), &packet), None);
    }

    /// A DISCOVER from the guest with `raw` (options, code and length first) before its End.
    fn discover_with(raw: &[u8]) -> Vec<u8> {
        let mut m = Message::default();
        m.set_chaddr(&MAC).set_xid(0x1234);
        m.opts_mut()
            .insert(DhcpOption::MessageType(MessageType::Discover));
        let mut b = Vec::new();
        m.encode(&mut Encoder::new(&mut b)).unwrap();
        assert_eq!(b.pop(), Some(255));
        b.extend_from_slice(raw);
        b.push(255);
        b
    }

    /// Every option dhcproto only checks with a `debug_assert!` turns the packet away when
    /// malformed, alone, split in two (RFC 3396) or last without an End; well formed, the
    /// guest gets its offer.
    #[test]
    fn options_dhcproto_asserts_on_are_checked() {
        let c = cfg();
        for raw in [
            &[80, 1, 0][..],
            &[81, 2, 0, 0],
            &[94, 2, 1, 2],
            &[94, 2, 1, 2, 94, 2, 0, 0],
            &[152, 0],
            &[153, 3, 0, 0, 0],
            &[154, 5, 0, 0, 0, 0, 0],
            &[155, 2, 0, 0, 155, 1, 0],
        ] {
            assert_eq!(answer(&c, &discover_with(raw)), None, "{raw:?}");
            let mut unterminated = discover_with(raw);
            unterminated.pop();
            assert_eq!(answer(&c, &unterminated), None, "{raw:?} without End");
        }
        for raw in [
            &[80, 0][..],
            &[81, 8, 0, 0, 0, 3, b'v', b'm', b'1', 0],
            &[94, 3, 1, 2, 0],
            &[94, 2, 1, 2, 94, 1, 0],
            &[152, 4, 0, 0, 0, 1, 0, 155, 4, 0, 0, 0, 2],
        ] {
            let out = answer(&c, &discover_with(raw)).expect("an offer");
            let offer = Message::decode(&mut Decoder::new(&out)).unwrap();
            assert_eq!(offer.opts().msg_type(), Some(MessageType::Offer), "{raw:?}");
        }
    }

    #[test]
    fn resolv_conf() {
        let text = "nameserver 1.1.1.1\ndomain a\nsearch b c\nnameserver x\nnameserver fd00::53\n";
        let (dns, search) = parse_resolv_conf::<Ipv4Addr>(text);
        assert_eq!(dns, vec![Ipv4Addr::new(1, 1, 1, 1)]);
        assert_eq!(search, vec!["b", "c"]);
        let (dns6, _) = parse_resolv_conf::<std::net::Ipv6Addr>(text);
        assert_eq!(
            dns6,
            vec!["fd00::53".parse::<std::net::Ipv6Addr>().unwrap()]
        );
    }

    #[test]
    fn offer_carries_everything() {
        let c = cfg();
        let r = respond(&c, &request(MessageType::Discover, MAC, None)).unwrap();
        assert_eq!(r.opcode(), Opcode::BootReply);
        assert_eq!(r.xid(), 0x1234);
        assert_eq!(r.yiaddr(), Ipv4Addr::new(10, 244, 0, 7));
        let o = r.opts();
        assert_eq!(o.msg_type(), Some(MessageType::Offer));
        assert_eq!(
            o.get(OptionCode::SubnetMask),
            Some(&DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)))
        );
        assert_eq!(
            o.get(OptionCode::Router),
            Some(&DhcpOption::Router(vec![Ipv4Addr::new(10, 244, 0, 1)]))
        );
        assert_eq!(
            o.get(OptionCode::DomainNameServer),
            Some(&DhcpOption::DomainNameServer(vec![Ipv4Addr::new(
                10, 96, 0, 10
            )]))
        );
        assert_eq!(
            o.get(OptionCode::InterfaceMtu),
            Some(&DhcpOption::InterfaceMtu(1400))
        );
        assert_eq!(
            o.get(OptionCode::Hostname),
            Some(&DhcpOption::Hostname("vm1".into()))
        );
        assert_eq!(
            o.get(OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(Ipv4Addr::new(
                169, 254, 75, 10
            )))
        );
        assert!(
            matches!(o.get(OptionCode::DomainSearch), Some(DhcpOption::DomainSearch(s)) if s.len() == 2)
        );
        assert!(
            matches!(o.get(OptionCode::ClasslessStaticRoute), Some(DhcpOption::ClasslessStaticRoute(r)) if r.len() == 2)
        );
        // And it encodes.
        let mut b = Vec::new();
        r.encode(&mut Encoder::new(&mut b)).unwrap();
    }

    #[test]
    fn request_ack_nak_and_strangers() {
        let c = cfg();
        let ack = respond(
            &c,
            &request(
                MessageType::Request,
                MAC,
                Some(Ipv4Addr::new(10, 244, 0, 7)),
            ),
        )
        .unwrap();
        assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
        let nak = respond(
            &c,
            &request(MessageType::Request, MAC, Some(Ipv4Addr::new(10, 0, 0, 9))),
        )
        .unwrap();
        assert_eq!(nak.opts().msg_type(), Some(MessageType::Nak));
        assert_eq!(nak.yiaddr(), Ipv4Addr::UNSPECIFIED);
        assert!(
            respond(
                &c,
                &request(MessageType::Discover, [2, 0, 0, 0, 0, 1], None)
            )
            .is_none()
        );
        assert!(respond(&c, &request(MessageType::Release, MAC, None)).is_none());
    }

    #[test]
    fn no_classless_routes_with_only_a_default_route() {
        let mut c = cfg();
        c.routes.truncate(1);
        let r = respond(&c, &request(MessageType::Discover, MAC, None)).unwrap();
        assert!(r.opts().get(OptionCode::ClasslessStaticRoute).is_none());
    }
}
