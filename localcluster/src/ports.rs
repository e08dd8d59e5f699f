//! Listening ports for components this crate starts (and tests start) as child processes.
//!
//! A port is chosen here and bound later by another process, so the choice can be taken in
//! between. Binding port 0 and releasing it hands out a port from the kernel's ephemeral
//! range, the same range every outgoing connection on the machine draws its local port from:
//! under a busy test suite one of them took kube-apiserver's port first ("bind: address already
//! in use"). Ports below that range are never handed out implicitly, so only another explicit
//! choice can collide, and a random pick among thousands makes that unlikely.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};

/// Where the kernel's ephemeral range starts when `/proc` does not say (Linux's default).
const DEFAULT_EPHEMERAL_START: u16 = 32768;
/// The lowest port chosen: above the well-known and most registered service ports.
const LOWEST: u16 = 10000;
const ATTEMPTS: usize = 200;

/// A port on `ip` that is free now and outside the ephemeral range.
pub fn free_port(ip: IpAddr) -> io::Result<u16> {
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| parse_range_start(&text))
        .unwrap_or(DEFAULT_EPHEMERAL_START);
    let (low, high) = choice_range(ephemeral_start);
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let port = fastrand::u16(low..high);
        match TcpListener::bind(SocketAddr::new(ip, port)) {
            Ok(_) => return Ok(port),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no port tried")))
}

fn parse_range_start(text: &str) -> Option<u16> {
    text.split_whitespace().next()?.parse().ok()
}

/// The ports to choose from: below the ephemeral range, or (on a machine whose range starts
/// very low) the top of the port space.
fn choice_range(ephemeral_start: u16) -> (u16, u16) {
    if ephemeral_start > LOWEST + 1000 {
        (LOWEST, ephemeral_start)
    } else {
        (61000, u16::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn the_range_start_is_read_from_procs_format() {
        assert_eq!(parse_range_start("32768\t60999\n"), Some(32768));
        assert_eq!(parse_range_start(""), None);
    }

    #[test]
    fn ports_are_chosen_below_the_ephemeral_range() {
        assert_eq!(choice_range(32768), (10000, 32768));
        assert_eq!(choice_range(1024), (61000, u16::MAX));
    }

    #[test]
    fn a_chosen_port_is_free_and_outside_the_ephemeral_range() {
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let port = free_port(loopback).expect("a port");
        let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|t| parse_range_start(&t))
            .unwrap_or(DEFAULT_EPHEMERAL_START);
        let (low, high) = choice_range(start);
        assert!((low..high).contains(&port), "{port} not in {low}..{high}");
        TcpListener::bind(SocketAddr::new(loopback, port)).expect("the port is still free");
    }
}
