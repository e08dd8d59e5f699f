//! The launcher's DHCPv4 and DHCPv6 servers on any packet: the first byte picks the protocol
//! (bit 0), the pod's configuration (bits 1-2: what phase 1 cached, the VMI's hostname, the
//! pod's resolv.conf) and for DHCPv6 whether the packet comes from the guest's link-local
//! address (bit 3); the rest is the packet. An answer never panics, and what the server sends
//! decodes as a message of its kind answering the request's transaction.
#![no_main]

use std::fmt::Write as _;

use dhcproto::{Decodable as _, Decoder, v4, v6};
use libfuzzer_sys::fuzz_target;
use network::cache::{Binding, CachedInterface, Cidr, Route};

const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];

/// A pod as phase 1 may find it, a hostname and a resolv.conf, by number.
fn pod(variant: u8) -> (CachedInterface, String, String) {
    let mut cached = kubevirt_rs_fuzz::cached_interface();
    let mut resolv = "nameserver 10.96.0.10\nnameserver fd00::10\n\
        search default.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
        .to_owned();
    let mut hostname = "testvmi".to_owned();
    match variant {
        1 => {
            // A bridged pod with routes beyond its default one, long names, many servers.
            cached.binding = Binding::Bridge;
            cached.mtu = 9000;
            cached.routes = (0..20)
                .map(|i| Route {
                    destination: [10, i, 0, 0].into(),
                    prefix: 8 + i % 25,
                    gateway: (i % 2 == 0).then_some([10, 0, 2, 1].into()),
                })
                .collect();
            hostname = "h".repeat(63);
            resolv.clear();
            for i in 0..40 {
                writeln!(
                    resolv,
                    "nameserver 10.0.0.{i}\nsearch {}.example",
                    "d".repeat(60)
                )
                .expect("a String takes any text");
            }
        }
        2 => {
            // Nothing optional: no gateway, no DNS, extreme numbers.
            cached.gateway_ipv4 = None;
            cached.guest_ipv4 = Some(Cidr {
                address: [192, 168, 0, 1].into(),
                prefix: 32,
            });
            cached.mtu = u32::MAX;
            hostname = String::new();
            resolv = String::new();
        }
        3 => {
            // What a resolv.conf or a hostname should not hold, and prefix 0.
            cached.mtu = 0;
            cached.guest_ipv4 = Some(Cidr {
                address: [10, 0, 2, 2].into(),
                prefix: 0,
            });
            hostname = "é.a..b-".repeat(40);
            resolv = format!(
                "search a..b {} .\ndomain {}\n",
                "x".repeat(300),
                "y.".repeat(200)
            );
        }
        _ => {}
    }
    (cached, hostname, resolv)
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, packet)) = data.split_first() else {
        return;
    };
    let (cached, hostname, resolv) = pod((flags >> 1) & 3);
    if flags & 1 == 0 {
        let Some(cfg) = network::dhcp::config(&cached, MAC, &hostname, &resolv) else {
            return;
        };
        let Some(reply) = network::dhcp::answer(&cfg, packet) else {
            return;
        };
        let request = v4::Message::decode(&mut Decoder::new(packet)).expect("it was answered");
        let reply = v4::Message::decode(&mut Decoder::new(&reply)).expect("the reply decodes");
        assert_eq!(reply.xid(), request.xid());
        assert_eq!(reply.opcode(), v4::Opcode::BootReply);
    } else {
        let Some(cfg) = network::dhcp6::config(&cached, MAC, &resolv) else {
            return;
        };
        let source = if flags & 8 == 0 {
            network::dhcp6::eui64_link_local(MAC)
        } else {
            "fe80::1".parse().expect("an address")
        };
        let Some(reply) = network::dhcp6::answer(&cfg, source, packet) else {
            return;
        };
        let request = v6::Message::decode(&mut Decoder::new(packet)).expect("it was answered");
        let reply = v6::Message::decode(&mut Decoder::new(&reply)).expect("the reply decodes");
        assert_eq!(reply.xid(), request.xid());
    }
});
