//! The masquerade binding's NAT, as nftables JSON (the `nftables` crate's schema, applied by
//! `nft -j -f -`). The rule set mirrors KubeVirt's (`pkg/network/setup/netpod/masquerade`) but
//! lives in a table of its own per pod interface, so it never touches rules others put in the
//! pod, and is replaced in one `nft` transaction: add (so a first run has something to delete),
//! delete, add again with every chain and rule. A transaction swaps the rules atomically and
//! conntrack keeps the NAT of established connections, so re-running phase 1 breaks no
//! connection.

use std::borrow::Cow;
use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr};

use nftables::batch::Batch;
use nftables::expr::{Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, SetItem};
use nftables::schema::{Chain, NfListObject, Nftables, Rule, Table};
use nftables::stmt::{Counter, JumpTarget, Match, NAT, Operator, Statement};
use nftables::types::{NfChainType, NfFamily, NfHook};

use crate::error::{NetworkError, Result};
use crate::plan::{InterfacePlan, RESERVED_TCP_PORTS};

const PRE_INBOUND: &str = "KUBEVIRT_PREINBOUND";
const POST_INBOUND: &str = "KUBEVIRT_POSTINBOUND";

/// `kubevirt_nat_<pod interface>`; nft identifiers take letters, digits, `_` and `.`.
pub fn table_name(pod_interface: &str) -> String {
    let clean: String = pod_interface
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("kubevirt_nat_{clean}")
}

/// One address family's half of the NAT: the same rules in an `ip` and an `ip6` table.
#[derive(Debug, Clone, Copy)]
struct Family {
    nf: NfFamily,
    /// The payload protocol of the addresses (`ip`, `ip6`).
    proto: &'static str,
    guest: IpAddr,
    gateway: IpAddr,
    /// Where the pod reaches its guest on localhost. IPv4 only: Linux routes a packet to
    /// 127.0.0.1 out of an interface once it is DNATed (with `route_localnet`), but has no such
    /// switch for `::1`, so IPv6 rules for it could never match a packet that leaves.
    loopback: Option<IpAddr>,
}

impl Family {
    fn ipv4(p: &InterfacePlan) -> Self {
        Self {
            nf: NfFamily::IP,
            proto: "ip",
            guest: p.guest().address.into(),
            gateway: p.gateway().address.into(),
            loopback: Some(Ipv4Addr::LOCALHOST.into()),
        }
    }

    fn ipv6(p: &InterfacePlan) -> Self {
        Self {
            nf: NfFamily::IP6,
            proto: "ip6",
            guest: p.guest_ipv6().address.into(),
            gateway: p.gateway_ipv6().address.into(),
            loopback: None,
        }
    }
}

fn table(family: NfFamily, name: &str) -> NfListObject<'static> {
    NfListObject::Table(Table {
        family,
        name: Cow::Owned(name.to_owned()),
        handle: None,
    })
}

fn base_chain(
    family: NfFamily,
    table: &str,
    name: &'static str,
    hook: NfHook,
    prio: i32,
) -> NfListObject<'static> {
    NfListObject::Chain(Chain {
        family,
        table: Cow::Owned(table.to_owned()),
        name: Cow::Borrowed(name),
        _type: Some(NfChainType::NAT),
        hook: Some(hook),
        prio: Some(prio),
        ..Chain::default()
    })
}

fn chain(family: NfFamily, table: &str, name: &'static str) -> NfListObject<'static> {
    NfListObject::Chain(Chain {
        family,
        table: Cow::Owned(table.to_owned()),
        name: Cow::Borrowed(name),
        ..Chain::default()
    })
}

fn rule(
    family: NfFamily,
    table: &str,
    chain: &'static str,
    expr: Vec<Statement<'static>>,
) -> NfListObject<'static> {
    NfListObject::Rule(Rule {
        family,
        table: Cow::Owned(table.to_owned()),
        chain: Cow::Borrowed(chain),
        expr: Cow::Owned(expr),
        ..Rule::default()
    })
}

fn eq(left: Expression<'static>, right: Expression<'static>) -> Statement<'static> {
    Statement::Match(Match {
        left,
        right,
        op: Operator::EQ,
    })
}

fn field(protocol: &'static str, name: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: Cow::Borrowed(protocol),
            field: Cow::Borrowed(name),
        },
    )))
}

fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

fn string(s: &str) -> Expression<'static> {
    Expression::String(Cow::Owned(s.to_owned()))
}

fn port_set(ports: &[u16]) -> Expression<'static> {
    Expression::Named(NamedExpression::Set(
        ports
            .iter()
            .map(|p| SetItem::Element(Expression::Number(u32::from(*p))))
            .collect(),
    ))
}

fn counter() -> Statement<'static> {
    Statement::Counter(Counter::Anonymous(None))
}

fn nat_to(addr: IpAddr) -> NAT<'static> {
    NAT {
        addr: Some(string(&addr.to_string())),
        family: None,
        port: None,
        flags: None::<HashSet<_>>,
    }
}

/// The whole masquerade NAT for one interface, as one transaction that replaces any earlier
/// version of it: an `ip` table, and an `ip6` table too when the guest has IPv6 (otherwise
/// an `ip6` table left by an earlier run is removed).
pub fn masquerade_ruleset(p: &InterfacePlan, ipv6: bool) -> Nftables<'static> {
    let t = table_name(&p.pod_interface);
    let mut b = Batch::new();
    family_tables(&mut b, &t, p, Family::ipv4(p));
    let v6 = Family::ipv6(p);
    if ipv6 {
        family_tables(&mut b, &t, p, v6);
    } else {
        b.add(table(v6.nf, &t));
        b.delete(table(v6.nf, &t));
    }
    b.to_nftables()
}

fn family_tables(b: &mut Batch<'static>, t: &str, p: &InterfacePlan, f: Family) {
    let nf = f.nf;
    b.add(table(nf, t));
    b.delete(table(nf, t));
    b.add(table(nf, t));
    b.add(base_chain(nf, t, "prerouting", NfHook::Prerouting, -100));
    b.add(base_chain(nf, t, "output", NfHook::Output, -100));
    b.add(base_chain(nf, t, "postrouting", NfHook::Postrouting, 100));
    b.add(chain(nf, t, PRE_INBOUND));
    b.add(chain(nf, t, POST_INBOUND));
    // Guest -> world: leaves with the pod's address.
    b.add(rule(
        nf,
        t,
        "postrouting",
        vec![
            eq(field(f.proto, "saddr"), string(&f.guest.to_string())),
            counter(),
            Statement::Masquerade(None),
        ],
    ));
    // World -> pod interface: into the inbound chain, which forwards to the guest.
    b.add(rule(
        nf,
        t,
        "prerouting",
        vec![
            eq(meta(MetaKey::Iifname), string(&p.pod_interface)),
            counter(),
            Statement::Jump(JumpTarget {
                target: Cow::Borrowed(PRE_INBOUND),
            }),
        ],
    ));
    b.add(rule(
        nf,
        t,
        "postrouting",
        vec![
            eq(meta(MetaKey::Oifname), string(&p.bridge)),
            counter(),
            Statement::Jump(JumpTarget {
                target: Cow::Borrowed(POST_INBOUND),
            }),
        ],
    ));
    if p.ports.is_empty() {
        // Every port, but the ones the pod keeps for itself.
        let reserved = || eq(field("tcp", "dport"), port_set(&RESERVED_TCP_PORTS));
        b.add(rule(
            nf,
            t,
            PRE_INBOUND,
            vec![reserved(), counter(), Statement::Return(None)],
        ));
        if let Some(lo) = f.loopback {
            b.add(rule(
                nf,
                t,
                "output",
                vec![
                    reserved(),
                    eq(field(f.proto, "saddr"), string(&lo.to_string())),
                    counter(),
                    Statement::Return(None),
                ],
            ));
        }
        inbound(b, t, None, f);
    } else {
        for port in &p.ports {
            let dport = eq(field(port.protocol, "dport"), port_set(&[port.port]));
            inbound(b, t, Some(&dport), f);
        }
    }
}

/// Inbound forwarding to the guest for one port match (`None`: every port): DNAT from the pod
/// interface and, where the family has a loopback, SNAT of what the pod itself sends from
/// localhost (so the guest can answer) and DNAT of the pod's own connections to localhost.
fn inbound(b: &mut Batch<'static>, t: &str, port: Option<&Statement<'static>>, f: Family) {
    let with_port = |mut v: Vec<Statement<'static>>| {
        if let Some(p) = port {
            v.insert(0, p.clone());
        }
        v
    };
    b.add(rule(
        f.nf,
        t,
        PRE_INBOUND,
        with_port(vec![counter(), Statement::DNAT(Some(nat_to(f.guest)))]),
    ));
    let Some(lo) = f.loopback else { return };
    b.add(rule(
        f.nf,
        t,
        POST_INBOUND,
        with_port(vec![
            eq(field(f.proto, "saddr"), string(&lo.to_string())),
            counter(),
            Statement::SNAT(Some(nat_to(f.gateway))),
        ]),
    ));
    b.add(rule(
        f.nf,
        t,
        "output",
        [
            vec![eq(field(f.proto, "daddr"), string(&lo.to_string()))],
            with_port(vec![counter(), Statement::DNAT(Some(nat_to(f.guest)))]),
        ]
        .concat(),
    ));
}

/// Removes the interface's tables, both families, where they exist (add-then-delete in one
/// transaction).
pub fn delete_ruleset(pod_interface: &str) -> Nftables<'static> {
    let t = table_name(pod_interface);
    let mut b = Batch::new();
    for nf in [NfFamily::IP, NfFamily::IP6] {
        b.add(table(nf, &t));
        b.delete(table(nf, &t));
    }
    b.to_nftables()
}

/// Runs `nft -j -f -` with the rule set, in the calling thread's network namespace.
pub fn apply(rules: &Nftables<'_>, action: &str) -> Result<()> {
    nftables::helper::apply_ruleset(rules).map_err(|source| NetworkError::Nft {
        action: action.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Binding;
    use crate::plan::ForwardedPort;

    fn plan(ports: Vec<ForwardedPort>) -> InterfacePlan {
        InterfacePlan {
            index: 0,
            name: "default".into(),
            binding: Binding::Masquerade,
            pod_interface: "eth0".into(),
            bridge: "k6t-eth0".into(),
            tap: "tap0".into(),
            queues: 1,
            ports,
            vm_network: "10.0.2.0/24".parse().unwrap(),
            vm_ipv6_network: "fd10:0:2::/120".parse().unwrap(),
        }
    }

    fn text(n: &Nftables<'_>) -> String {
        serde_json::to_string(n).unwrap()
    }

    #[test]
    fn all_ports_but_the_reserved_ones() {
        let j = text(&masquerade_ruleset(&plan(vec![]), false));
        assert!(
            j.contains(r#"{"delete":{"table":{"family":"ip","name":"kubevirt_nat_eth0"}}}"#),
            "{j}"
        );
        assert!(j.contains(r#""masquerade":null"#), "{j}");
        assert!(j.contains(r#"{"dnat":{"addr":"10.0.2.2"}}"#), "{j}");
        assert!(j.contains(r#"{"snat":{"addr":"10.0.2.1"}}"#), "{j}");
        assert!(j.contains(r#"{"set":[49152,49153]}"#), "{j}");
        assert!(j.contains(r#"{"meta":{"key":"iifname"}}"#), "{j}");
        // No IPv6 for the guest: any ip6 table of an earlier run goes.
        assert!(
            j.ends_with(r#"{"delete":{"table":{"family":"ip6","name":"kubevirt_nat_eth0"}}}]}"#),
            "{j}"
        );
        assert!(!j.contains("fd10"), "{j}");
    }

    #[test]
    fn ipv6_gets_its_own_table_without_loopback_rules() {
        let j = text(&masquerade_ruleset(&plan(vec![]), true));
        assert!(
            j.contains(r#"{"add":{"table":{"family":"ip6","name":"kubevirt_nat_eth0"}}}"#),
            "{j}"
        );
        assert!(
            j.contains(r#"{"payload":{"protocol":"ip6","field":"saddr"}},"right":"fd10:0:2::2""#),
            "{j}"
        );
        assert!(j.contains(r#"{"dnat":{"addr":"fd10:0:2::2"}}"#), "{j}");
        assert!(!j.contains(r#""ip6","field":"daddr""#), "{j}");
    }

    #[test]
    fn listed_ports_only() {
        let j = text(&masquerade_ruleset(
            &plan(vec![
                ForwardedPort {
                    protocol: "tcp",
                    port: 80,
                },
                ForwardedPort {
                    protocol: "udp",
                    port: 53,
                },
            ]),
            false,
        ));
        assert!(
            j.contains(r#"{"payload":{"protocol":"tcp","field":"dport"}},"right":{"set":[80]}"#),
            "{j}"
        );
        assert!(
            j.contains(r#"{"payload":{"protocol":"udp","field":"dport"}},"right":{"set":[53]}"#),
            "{j}"
        );
        assert!(!j.contains("49152"), "{j}");
    }
}
