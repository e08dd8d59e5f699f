//! The launcher's DHCPv6 server for a masqueraded guest with IPv6: one per interface, bound to
//! the in-pod bridge, handing out the guest's address (`fd10:0:2::2` by default) in an IA_NA
//! with KubeVirt's 999-day lifetimes, and the pod's IPv6 DNS servers and search domains. The
//! default route comes from router advertisements ([`crate::ra`]), as DHCPv6 has no option
//! for it.
//!
//! DHCPv6 carries no hardware address, so "only the guest" is decided from what a client does
//! show: a DUID-LL or DUID-LLT holding the guest's MAC, or a source address that is the guest
//! MAC's EUI-64 link-local address. A client with neither (a DUID-UUID and a stable-privacy
//! link-local address) is not answered.
//!
//! Packets are parsed and built by `dhcproto`; [`respond`] and [`answer`] (bytes in, bytes
//! out) are pure, [`serve`] is the socket.

use std::net::{Ipv6Addr, SocketAddrV6};
use std::str::FromStr as _;

use dhcproto::v6::{
    DhcpOption, IAAddr, IANA, Message, MessageType, OptionCode, Status, StatusCode,
};
use dhcproto::{Decodable as _, Decoder, Encodable as _, Encoder, Name};
use tracing::{debug, info, warn};

use crate::cache::{CachedInterface, Ipv6Cidr};
use crate::dhcp::{LEASE_SECONDS, parse_resolv_conf};
use crate::error::{NetworkError, Result};
use crate::plan::MASQUERADE_BRIDGE_MAC;

/// All DHCP relay agents and servers (RFC 8415), where clients send.
pub const ALL_SERVERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 1, 2);

/// What the server hands out, and to whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dhcp6Config {
    /// The bridge the server listens on.
    pub interface: String,
    /// The only client answered.
    pub mac: [u8; 6],
    pub address: Ipv6Cidr,
    /// The server's DUID (a DUID-LL of the bridge's MAC, as KubeVirt's).
    pub server_id: Vec<u8>,
    pub dns: Vec<Ipv6Addr>,
    pub search: Vec<String>,
}

/// The server's configuration for one cached interface; `None` when the guest has no IPv6.
pub fn config(cached: &CachedInterface, mac: [u8; 6], resolv_conf: &str) -> Option<Dhcp6Config> {
    let (dns, search) = parse_resolv_conf(resolv_conf);
    Some(Dhcp6Config {
        interface: cached.bridge.clone(),
        mac,
        address: cached.guest_ipv6?,
        server_id: duid_ll(MASQUERADE_BRIDGE_MAC),
        dns,
        search,
    })
}

/// DUID-LL (type 3) of an Ethernet (hardware type 1) address.
pub fn duid_ll(mac: [u8; 6]) -> Vec<u8> {
    [&[0, 3, 0, 1][..], &mac].concat()
}

/// The EUI-64 link-local address of a MAC (what Linux gives an interface by default).
pub fn eui64_link_local(mac: [u8; 6]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    o[0] = 0xfe;
    o[1] = 0x80;
    // The MAC split around ff:fe, with its universal/local bit flipped.
    o[8..11].copy_from_slice(&mac[..3]);
    o[8] ^= 0x02;
    o[11] = 0xff;
    o[12] = 0xfe;
    o[13..].copy_from_slice(&mac[3..]);
    Ipv6Addr::from(o)
}

/// The MAC in a DUID-LLT (type 1: type, hardware type, time, address) or DUID-LL (type 3:
/// type, hardware type, address) of Ethernet.
fn duid_mac(duid: &[u8]) -> Option<&[u8]> {
    match duid {
        [0, 1, 0, 1, _, _, _, _, mac @ ..] | [0, 3, 0, 1, mac @ ..] if mac.len() == 6 => Some(mac),
        _ => None,
    }
}

fn from_guest(cfg: &Dhcp6Config, source: Ipv6Addr, client_id: &[u8]) -> bool {
    duid_mac(client_id) == Some(&cfg.mac[..]) || source == eui64_link_local(cfg.mac)
}

/// The answer to one client message from `source`, or `None` when it is not for us (another
/// client, another server, a message a server does not answer).
pub fn respond(cfg: &Dhcp6Config, source: Ipv6Addr, req: &Message) -> Option<Message> {
    let Some(DhcpOption::ClientId(client_id)) = req.opts().get(OptionCode::ClientId) else {
        return None;
    };
    if !from_guest(cfg, source, client_id) {
        return None;
    }
    if let Some(DhcpOption::ServerId(s)) = req.opts().get(OptionCode::ServerId)
        && *s != cfg.server_id
    {
        return None;
    }
    let rapid = req.opts().get(OptionCode::RapidCommit).is_some();
    let kind = match req.msg_type() {
        MessageType::Solicit if rapid => MessageType::Reply,
        MessageType::Solicit => MessageType::Advertise,
        MessageType::Request
        | MessageType::Renew
        | MessageType::Rebind
        | MessageType::Confirm
        | MessageType::Release
        | MessageType::Decline
        | MessageType::InformationRequest => MessageType::Reply,
        _ => return None,
    };
    let mut m = Message::new_with_id(kind, req.xid());
    let o = m.opts_mut();
    o.insert(DhcpOption::ClientId(client_id.clone()));
    o.insert(DhcpOption::ServerId(cfg.server_id.clone()));
    if kind == MessageType::Reply && rapid && req.msg_type() == MessageType::Solicit {
        o.insert(DhcpOption::RapidCommit);
    }
    match req.msg_type() {
        MessageType::Release | MessageType::Decline => {
            // The address stays the guest's for the life of the pod; nothing to undo.
            o.insert(DhcpOption::StatusCode(status(Status::Success, "")));
            return Some(m);
        }
        MessageType::Confirm => {
            let ours = requested_addresses(req)
                .into_iter()
                .all(|a| a == cfg.address.address);
            o.insert(DhcpOption::StatusCode(if ours {
                status(Status::Success, "")
            } else {
                status(Status::NotOnLink, "the guest's address is another")
            }));
            return Some(m);
        }
        _ => {}
    }
    if req.msg_type() != MessageType::InformationRequest {
        let id = match req.opts().get(OptionCode::IANA) {
            Some(DhcpOption::IANA(ia)) => ia.id,
            // No IA_NA asked for: nothing to assign, but the other options still apply.
            _ => return Some(with_info(m, cfg)),
        };
        let mut ia_opts = dhcproto::v6::DhcpOptions::new();
        ia_opts.insert(DhcpOption::IAAddr(IAAddr {
            addr: cfg.address.address,
            preferred_life: LEASE_SECONDS,
            valid_life: LEASE_SECONDS,
            opts: dhcproto::v6::DhcpOptions::new(),
        }));
        m.opts_mut().insert(DhcpOption::IANA(IANA {
            id,
            t1: LEASE_SECONDS / 2,
            t2: LEASE_SECONDS / 5 * 4,
            opts: ia_opts,
        }));
    }
    Some(with_info(m, cfg))
}

fn status(status: Status, msg: &str) -> StatusCode {
    StatusCode {
        status,
        msg: msg.to_owned(),
    }
}

fn with_info(mut m: Message, cfg: &Dhcp6Config) -> Message {
    let o = m.opts_mut();
    if !cfg.dns.is_empty() {
        o.insert(DhcpOption::DomainNameServers(cfg.dns.clone()));
    }
    let search: Vec<Name> = cfg
        .search
        .iter()
        .filter_map(|d| Name::from_str(d).ok())
        .collect();
    if !search.is_empty() {
        o.insert(DhcpOption::DomainSearchList(search));
    }
    m
}

fn requested_addresses(req: &Message) -> Vec<Ipv6Addr> {
    let Some(DhcpOption::IANA(ia)) = req.opts().get(OptionCode::IANA) else {
        return Vec::new();
    };
    ia.opts
        .iter()
        .filter_map(|o| match o {
            DhcpOption::IAAddr(a) => Some(a.addr),
            _ => None,
        })
        .collect()
}

/// Serves DHCPv6 on the configured bridge until the task is dropped. The socket is bound
/// before this returns the serving future, so binding errors come back at once.
pub fn serve(cfg: Dhcp6Config) -> Result<impl Future<Output = ()>> {
    let sock = crate::udp::bridge_socket(
        "DHCPv6",
        &cfg.interface,
        SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 547, 0, 0).into(),
    )?;
    let ifindex = nix::net::if_::if_nametoindex(cfg.interface.as_str()).map_err(|e| {
        NetworkError::io(format!(
            "DHCPv6 socket on {}: interface index",
            cfg.interface
        ))(e.into())
    })?;
    sock.join_multicast_v6(&ALL_SERVERS, ifindex)
        .map_err(NetworkError::io(format!(
            "DHCPv6 socket on {}: joining {ALL_SERVERS}",
            cfg.interface
        )))?;
    info!(interface = %cfg.interface, address = %cfg.address, "DHCPv6 server listening");
    let interface = cfg.interface.clone();
    Ok(crate::udp::answer_forever(
        "DHCPv6",
        interface,
        sock,
        move |packet, from| {
            let std::net::SocketAddr::V6(from) = from else {
                return None;
            };
            // Back to the client's link-local address and port, on the bridge.
            answer(&cfg, *from.ip(), packet).map(|out| (out, from.into()))
        },
    ))
}

/// The encoded answer to one packet received from `source`, or `None` for a packet that does
/// not decode, is not for us, or whose answer cannot be encoded.
pub fn answer(cfg: &Dhcp6Config, source: Ipv6Addr, packet: &[u8]) -> Option<Vec<u8>> {
    if let Some(code) = packet.get(4..).and_then(option_dhcproto_overflows_on) {
        debug!(interface = %cfg.interface, code, "DHCPv6 packet with a malformed option ignored");
        return None;
    }
    let Ok(req) = Message::decode(&mut Decoder::new(packet)) else {
        debug!(interface = %cfg.interface, "undecodable DHCPv6 packet ignored");
        return None;
    };
    let reply = respond(cfg, source, &req)?;
    let mut out = Vec::new();
    if reply.encode(&mut Encoder::new(&mut out)).is_err() {
        warn!(interface = %cfg.interface, "DHCPv6 reply could not be encoded");
        return None;
    }
    debug!(interface = %cfg.interface, kind = ?reply.msg_type(), "DHCPv6 reply");
    Some(out)
}

/// The code of an option that dhcproto 0.15 decodes by reading a fixed part past the option
/// when it is shorter, then subtracting that part's size from the option's length: Status Code
/// (13) shorter than 2 bytes, Vendor Class (16) or Vendor-specific Information (17) shorter
/// than 4. The subtraction overflows, which panics in a debug build (the tests and the fuzzer's
/// build) and fails the decoding in a release one. A guest must not be able to stop its own
/// DHCPv6 server in any build, and no client sends these options malformed, so such packets
/// are ignored before dhcproto decodes them (found by fuzzing, `fuzz/`).
///
/// `options` is what follows a message's type and transaction id. The walk is dhcproto's: it
/// reads Preference, Elapsed Time, Server Unicast, Rapid Commit, Reconfigure Message and
/// Reconfigure Accept at their own size whatever their length says (so that the next option
/// may start inside one), and goes into the options that hold options (IA_NA, IA_TA, IA
/// Address, Relay Message, Vendor-specific Information, IA_PD, IA Prefix) past their fixed
/// fields. The nesting is bounded by the 1500-byte receive buffer.
fn option_dhcproto_overflows_on(options: &[u8]) -> Option<u16> {
    let mut rest = options;
    while let [c0, c1, l0, l1, tail @ ..] = rest {
        let code = u16::from_be_bytes([*c0, *c1]);
        let len = usize::from(u16::from_be_bytes([*l0, *l1]));
        let own_size = match code {
            7 | 19 => Some(1),
            8 => Some(2),
            12 => Some(16),
            14 | 20 => Some(0),
            _ => None,
        };
        if let Some(size) = own_size {
            rest = tail.get(size..)?;
            continue;
        }
        let (min, nested_after) = match code {
            13 => (2, None),
            16 => (4, None),
            17 => (4, Some(4)),
            3 | 25 => (0, Some(12)),
            4 => (0, Some(4)),
            5 => (0, Some(24)),
            // A relay message: type, hop count, link and peer addresses.
            9 => (0, Some(34)),
            26 => (0, Some(25)),
            _ => (0, None),
        };
        if len < min {
            return Some(code);
        }
        let body = tail.get(..len)?;
        if let Some(bad) = nested_after
            .and_then(|fixed| body.get(fixed..))
            .and_then(option_dhcproto_overflows_on)
        {
            return Some(bad);
        }
        rest = &tail[len..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x52, 0x54, 0, 1, 2, 3];

    fn cfg() -> Dhcp6Config {
        Dhcp6Config {
            interface: "k6t-eth0".into(),
            mac: MAC,
            address: Ipv6Cidr {
                address: "fd10:0:2::2".parse().unwrap(),
                prefix: 120,
            },
            server_id: duid_ll(MASQUERADE_BRIDGE_MAC),
            dns: vec!["fd00::53".parse().unwrap()],
            search: vec!["svc.cluster.local".into()],
        }
    }

    fn llt(mac: [u8; 6]) -> Vec<u8> {
        [&[0, 1, 0, 1, 0x2a, 0, 0, 1][..], &mac].concat()
    }

    fn msg(kind: MessageType, client_id: Vec<u8>, extra: Vec<DhcpOption>) -> Message {
        let mut m = Message::new_with_id(kind, [1, 2, 3]);
        m.opts_mut().insert(DhcpOption::ClientId(client_id));
        for o in extra {
            m.opts_mut().insert(o);
        }
        // Round-trip through the wire format, as the server sees it.
        let mut b = Vec::new();
        m.encode(&mut Encoder::new(&mut b)).unwrap();
        Message::decode(&mut Decoder::new(&b)).unwrap()
    }

    fn ia(id: u32) -> DhcpOption {
        DhcpOption::IANA(IANA {
            id,
            t1: 0,
            t2: 0,
            opts: dhcproto::v6::DhcpOptions::new(),
        })
    }

    const STRANGER: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 1, 2, 3, 4);

    fn assigned(m: &Message) -> Option<(u32, Ipv6Addr, u32)> {
        let Some(DhcpOption::IANA(ia)) = m.opts().get(OptionCode::IANA) else {
            return None;
        };
        let Some(DhcpOption::IAAddr(a)) = ia.opts.get(OptionCode::IAAddr) else {
            return None;
        };
        Some((ia.id, a.addr, a.valid_life))
    }

    #[test]
    fn solicit_is_advertised_the_address_dns_and_search() {
        let r = respond(
            &cfg(),
            STRANGER,
            &msg(MessageType::Solicit, llt(MAC), vec![ia(7)]),
        )
        .unwrap();
        assert_eq!(r.msg_type(), MessageType::Advertise);
        assert_eq!(r.xid(), [1, 2, 3]);
        assert_eq!(
            assigned(&r),
            Some((7, "fd10:0:2::2".parse().unwrap(), LEASE_SECONDS))
        );
        assert_eq!(
            r.opts().get(OptionCode::ServerId),
            Some(&DhcpOption::ServerId(vec![0, 3, 0, 1, 2, 0, 0, 0, 0, 0]))
        );
        assert_eq!(
            r.opts().get(OptionCode::ClientId),
            Some(&DhcpOption::ClientId(llt(MAC)))
        );
        assert!(matches!(
            r.opts().get(OptionCode::DomainNameServers),
            Some(DhcpOption::DomainNameServers(d)) if d == &cfg().dns
        ));
        assert!(r.opts().get(OptionCode::DomainSearchList).is_some());
    }

    /// A SOLICIT from the guest with `raw` (options, code and length first) after its own.
    fn solicit_with(raw: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        msg(MessageType::Solicit, llt(MAC), vec![ia(7)])
            .encode(&mut Encoder::new(&mut b))
            .unwrap();
        b.extend_from_slice(raw);
        b
    }

    /// dhcproto reads a Status Code's 2-byte code, or a vendor option's 4-byte enterprise
    /// number, past an option too short to hold it, then subtracts: an overflow, a panic in a
    /// debug build. Such packets are ignored, at the top level or inside an IA_NA; well formed,
    /// the same options are answered.
    #[test]
    fn options_dhcproto_overflows_on_are_checked() {
        let c = cfg();
        // Elapsed Time after each, so that dhcproto finds bytes to read past the short option.
        let elapsed = [0, 8, 0, 2, 0, 0];
        let ia_na = |inner: &[u8]| {
            let len = u8::try_from(12 + inner.len()).unwrap();
            [&[0, 3, 0, len, 0, 0, 0, 9][..], &[0; 8], inner].concat()
        };
        for short in [
            vec![0, 13, 0, 0],
            // Rapid Commit's length is not skipped: the short Status Code is the next option.
            vec![0, 14, 0, 4, 0, 13, 0, 0],
            vec![0, 13, 0, 1, 0],
            vec![0, 16, 0, 3, 0, 0, 0],
            vec![0, 17, 0, 0],
            ia_na(&[&[0, 13, 0, 1, 0][..], &elapsed].concat()),
        ] {
            let packet = solicit_with(&[&short[..], &elapsed].concat());
            assert_eq!(answer(&c, STRANGER, &packet), None, "{short:?}");
        }
        for fine in [
            vec![0, 13, 0, 2, 0, 0],
            vec![0, 16, 0, 4, 0, 0, 0, 1],
            vec![0, 17, 0, 4, 0, 0, 0, 1],
            ia_na(&[0, 13, 0, 3, 0, 0, b'x']),
        ] {
            let packet = solicit_with(&[&fine[..], &elapsed].concat());
            let out = answer(&c, STRANGER, &packet).expect("an advertise");
            let reply = Message::decode(&mut Decoder::new(&out)).unwrap();
            assert_eq!(reply.msg_type(), MessageType::Advertise, "{fine:?}");
        }
    }

    /// The fuzzer's input (less its first byte): an Elapsed Time of length 0, read as two
    /// bytes all the same, puts dhcproto on a Status Code of length 0 that the lengths alone
    /// skip.
    #[test]
    fn status_code_found_as_dhcproto_walks_is_checked() {
        let packet = crate::dhcp::tests::unhex(
            "000000000000000000000000000000000000000000000000000000000000000000000000000000000000\
            000000000000000000000000001f00000000000000000000000000000000000000000000000000000000\
            00ffffff7e00000000000000000000000000000008000000000000000000000000000000000000000000\
            400000000000200000000000000000000800000000000000000000000000000000000000000000000d00\
            00000001000000000000000000000000000000000000000000000000000063825363370107370601ffff\
            fffffffffff40000520a54000301001236560003000c000a000000000d00000000010000000000000000",
        );
        assert_eq!(packet.len(), 252);
        assert_eq!(answer(&cfg(), STRANGER, &packet), None);
    }

    #[test]
    fn rapid_commit_and_request_get_replies() {
        let c = cfg();
        let r = respond(
            &c,
            STRANGER,
            &msg(
                MessageType::Solicit,
                llt(MAC),
                vec![ia(1), DhcpOption::RapidCommit],
            ),
        )
        .unwrap();
        assert_eq!(r.msg_type(), MessageType::Reply);
        assert!(r.opts().get(OptionCode::RapidCommit).is_some());
        let r = respond(
            &c,
            STRANGER,
            &msg(
                MessageType::Request,
                duid_ll(MAC),
                vec![ia(2), DhcpOption::ServerId(c.server_id.clone())],
            ),
        )
        .unwrap();
        assert_eq!(r.msg_type(), MessageType::Reply);
        assert_eq!(assigned(&r).map(|a| a.0), Some(2));
    }

    #[test]
    fn only_the_guest_is_answered() {
        let c = cfg();
        let uuid = vec![0, 4, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
        // Another MAC in the DUID, from a stranger's address.
        assert!(
            respond(
                &c,
                STRANGER,
                &msg(MessageType::Solicit, llt([2, 0, 0, 0, 0, 9]), vec![ia(1)])
            )
            .is_none()
        );
        // A DUID without a MAC: only from the guest's EUI-64 link-local address.
        assert!(
            respond(
                &c,
                STRANGER,
                &msg(MessageType::Solicit, uuid.clone(), vec![ia(1)])
            )
            .is_none()
        );
        let guest = eui64_link_local(MAC);
        assert_eq!(guest.to_string(), "fe80::5054:ff:fe01:203");
        assert!(respond(&c, guest, &msg(MessageType::Solicit, uuid, vec![ia(1)])).is_some());
        // Another server's request.
        assert!(
            respond(
                &c,
                guest,
                &msg(
                    MessageType::Request,
                    llt(MAC),
                    vec![
                        ia(1),
                        DhcpOption::ServerId(vec![0, 3, 0, 1, 9, 9, 9, 9, 9, 9])
                    ]
                )
            )
            .is_none()
        );
    }

    #[test]
    fn confirm_says_whether_the_address_is_ours() {
        let c = cfg();
        let confirm = |addr: &str| {
            let mut opts = dhcproto::v6::DhcpOptions::new();
            opts.insert(DhcpOption::IAAddr(IAAddr {
                addr: addr.parse().unwrap(),
                preferred_life: 0,
                valid_life: 0,
                opts: dhcproto::v6::DhcpOptions::new(),
            }));
            let r = respond(
                &c,
                STRANGER,
                &msg(
                    MessageType::Confirm,
                    llt(MAC),
                    vec![DhcpOption::IANA(IANA {
                        id: 1,
                        t1: 0,
                        t2: 0,
                        opts,
                    })],
                ),
            )
            .unwrap();
            match r.opts().get(OptionCode::StatusCode) {
                Some(DhcpOption::StatusCode(s)) => s.status,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(confirm("fd10:0:2::2"), Status::Success);
        assert_eq!(confirm("fd10:0:2::9"), Status::NotOnLink);
    }
}
