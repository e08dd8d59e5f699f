//! Phase 1 on the real system: a network namespace with a veth stands in for the pod, a
//! process inside it for the launcher. Needs root, `ip` and `nft`.

mod common;

use std::path::Path;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use common::{Netns, PEER_IP, PEER_IP6, POD_IP, POD_IP6, Pod, in_netns, wait_until};
use network::{Binding, CachedInterface, Ipv4Cidr, dhcp6, phase1, ra};
use serde_json::json;

fn vmi(iface: &serde_json::Value) -> api::VirtualMachineInstance {
    serde_json::from_value(common::vmi_json("vm1", "uid-1", iface)).unwrap()
}

fn link(pod: &common::Netns, name: &str) -> Option<serde_json::Value> {
    let o = pod.exec(&["ip", "-j", "-d", "addr", "show", "dev", name]);
    if !o.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v.as_array().and_then(|a| a.first().cloned())
}

fn ipv4(l: &serde_json::Value) -> Vec<String> {
    l["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["family"] == "inet")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]))
        .collect()
}

fn has_table(pod: &common::Netns) -> bool {
    pod.exec(&["nft", "list", "table", "ip", "kubevirt_nat_eth0"])
        .status
        .success()
}

nix::ioctl_write_ptr_bad!(tun_set_iff, 0x4004_54ca, libc::ifreq);

/// Attaches a new file to the existing tap `name` as QEMU attaches each of its queues
/// (TUNSETIFF on /dev/net/tun), from inside `ns`.
fn attach_tap(ns: &Netns, name: &str, multi_queue: bool) -> nix::Result<std::fs::File> {
    in_netns(ns, || {
        let tun = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .unwrap();
        // SAFETY: ifreq is plain old data; all zeroes is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
            *d = s.cast_signed();
        }
        let mq = if multi_queue {
            libc::IFF_MULTI_QUEUE
        } else {
            0
        };
        req.ifr_ifru.ifru_flags =
            libc::c_short::try_from(libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | mq)
                .unwrap();
        // SAFETY: tun is an open /dev/net/tun; req is a valid ifreq that outlives the call.
        unsafe { tun_set_iff(std::os::fd::AsRawFd::as_raw_fd(&tun), &raw const req) }?;
        Ok(tun)
    })
}

fn cache_file(dir: &Path) -> std::path::PathBuf {
    dir.join("vif-cache-eth0.json")
}

#[test]
fn masquerade_setup_is_idempotent_and_teardown_leaves_nothing() {
    let pod = Pod::new("masq");
    let iso = pod.isolation();
    let dir = tempfile::tempdir().unwrap();
    let v = vmi(&json!({"name": "default", "masquerade": {}, "ports": [{"port": 8080}]}));

    let first = phase1::setup(&v, &iso, dir.path()).unwrap();
    assert_eq!(first.len(), 1);
    let c = &first[0];
    assert_eq!(c.binding, Binding::Masquerade);
    assert_eq!(
        (c.tap.as_str(), c.bridge.as_str(), c.mtu),
        ("tap0", "k6t-eth0", 1400)
    );
    assert_eq!(c.guest_ipv4.unwrap().to_string(), "10.0.2.2/24");
    assert_eq!(c.gateway_ipv4.unwrap().to_string(), "10.0.2.1");
    assert_eq!(c.pod_ipv4.unwrap().to_string(), format!("{POD_IP}/24"));

    let bridge = link(&pod.netns, "k6t-eth0").expect("the bridge exists");
    assert_eq!(ipv4(&bridge), vec!["10.0.2.1/24"]);
    assert_eq!(bridge["address"], "02:00:00:00:00:00");
    assert_eq!(bridge["mtu"], 1400);
    let tap = link(&pod.netns, "tap0").expect("the tap exists");
    assert_eq!(tap["master"], "k6t-eth0");
    assert_eq!(tap["mtu"], 1400);
    assert_eq!(tap["linkinfo"]["info_kind"], "tun");
    assert_eq!(tap["linkinfo"]["info_data"]["type"], "tap");
    assert_eq!(tap["linkinfo"]["info_data"]["pi"], false);
    assert_eq!(tap["linkinfo"]["info_data"]["persist"], true);
    assert_eq!(tap["linkinfo"]["info_data"]["user"], "root");
    assert_eq!(tap["linkinfo"]["info_data"]["multi_queue"], false);
    // Without networkInterfaceMultiqueue the tap has one queue: a multiqueue attach, as QEMU
    // makes for each queue, is refused.
    assert_eq!(
        attach_tap(&pod.netns, "tap0", true).err(),
        Some(nix::Error::EINVAL)
    );
    let sysctl = pod.netns.exec(&["cat", "/proc/sys/net/ipv4/ip_forward"]);
    assert_eq!(String::from_utf8_lossy(&sysctl.stdout).trim(), "1");
    let rules = pod
        .netns
        .exec(&["nft", "list", "table", "ip", "kubevirt_nat_eth0"]);
    let rules = String::from_utf8_lossy(&rules.stdout).into_owned();
    assert!(rules.contains("ip saddr 10.0.2.2 counter"), "{rules}");
    assert!(rules.contains("masquerade"), "{rules}");
    assert!(
        rules.contains("tcp dport 8080 counter packets 0 bytes 0 dnat to 10.0.2.2"),
        "{rules}"
    );
    let cached: CachedInterface =
        serde_json::from_slice(&std::fs::read(cache_file(dir.path())).unwrap()).unwrap();
    assert_eq!(&cached, c);

    // Again: the same result, nothing recreated, one table.
    let tap_index = tap["ifindex"].clone();
    let second = phase1::setup(&v, &iso, dir.path()).unwrap();
    assert_eq!(second, first);
    assert_eq!(link(&pod.netns, "tap0").unwrap()["ifindex"], tap_index);
    let tables = pod.netns.exec(&["nft", "list", "tables"]);
    assert_eq!(
        String::from_utf8_lossy(&tables.stdout)
            .matches("kubevirt_nat_eth0")
            .count(),
        1
    );

    phase1::teardown(&v, &iso, dir.path()).unwrap();
    assert!(link(&pod.netns, "k6t-eth0").is_none());
    assert!(link(&pod.netns, "tap0").is_none());
    assert!(!has_table(&pod.netns));
    assert!(!cache_file(dir.path()).exists());
    // The pod keeps its own interface untouched.
    assert_eq!(
        ipv4(&link(&pod.netns, "eth0").unwrap()),
        vec![format!("{POD_IP}/24")]
    );
    // Teardown twice is fine too.
    phase1::teardown(&v, &iso, dir.path()).unwrap();
}

#[test]
fn bridge_hands_the_pod_address_over_and_teardown_restores_it() {
    let pod = Pod::new("brdg");
    let iso = pod.isolation();
    let dir = tempfile::tempdir().unwrap();
    let mut v = vmi(&json!({"name": "default", "bridge": {}}));
    v.spec.domain.devices.network_interface_multiqueue = Some(true);
    v.spec.domain.cpu = Some(api::vmi::Cpu {
        cores: Some(3),
        ..Default::default()
    });
    let eth0 = link(&pod.netns, "eth0").unwrap();
    let pod_mac = eth0["address"].as_str().unwrap().to_owned();

    let first = phase1::setup(&v, &iso, dir.path()).unwrap();
    let c = &first[0];
    assert_eq!(c.binding, Binding::Bridge);
    assert_eq!(c.pod_mac, pod_mac);
    assert_eq!(
        c.guest_ipv4,
        Some(Ipv4Cidr {
            address: POD_IP.parse().unwrap(),
            prefix: 24
        })
    );
    assert_eq!(c.gateway_ipv4.unwrap().to_string(), PEER_IP);
    assert_eq!(c.server_ipv4.to_string(), "169.254.75.10");

    assert!(
        link(&pod.netns, "eth0").is_none(),
        "the pod interface is renamed"
    );
    let nic = link(&pod.netns, "eth0-nic").unwrap();
    assert_eq!(nic["master"], "k6t-eth0");
    assert!(ipv4(&nic).is_empty(), "the pod address moved to the guest");
    assert_ne!(
        nic["address"].as_str().unwrap(),
        pod_mac,
        "the guest takes the pod's MAC"
    );
    let tap = link(&pod.netns, "tap0").unwrap();
    assert_eq!(tap["master"], "k6t-eth0");
    // networkInterfaceMultiqueue on 3 vCPUs: a multiqueue tap that takes a file per queue.
    assert_eq!(tap["linkinfo"]["info_data"]["multi_queue"], true);
    let queues: Vec<_> = (0..3)
        .map(|_| attach_tap(&pod.netns, "tap0", true).unwrap())
        .collect();
    assert_eq!(
        attach_tap(&pod.netns, "tap0", false).err(),
        Some(nix::Error::EINVAL),
        "a single-queue attach to a multiqueue tap"
    );
    drop(queues);
    assert_eq!(
        ipv4(&link(&pod.netns, "k6t-eth0").unwrap()),
        vec!["169.254.75.10/32"]
    );

    // Idempotent, from the cache (the pod interface no longer has the address to read).
    assert_eq!(phase1::setup(&v, &iso, dir.path()).unwrap(), first);

    phase1::teardown(&v, &iso, dir.path()).unwrap();
    assert!(link(&pod.netns, "k6t-eth0").is_none());
    assert!(link(&pod.netns, "tap0").is_none());
    assert!(link(&pod.netns, "eth0-nic").is_none());
    let eth0 = link(&pod.netns, "eth0").unwrap();
    assert_eq!(eth0["address"].as_str().unwrap(), pod_mac);
    assert_eq!(ipv4(&eth0), vec![format!("{POD_IP}/24")]);
    let routes = pod.netns.ip(&["route", "show", "default"]);
    assert!(routes.contains(&format!("via {PEER_IP}")), "{routes}");
    assert!(!cache_file(dir.path()).exists());
}

#[test]
fn errors_name_what_is_missing() {
    let pod = Pod::new("errs");
    let iso = pod.isolation();
    let dir = tempfile::tempdir().unwrap();
    pod.netns.ip(&["link", "del", "eth0"]);
    let v = vmi(&json!({"name": "default", "masquerade": {}}));
    let e = phase1::setup(&v, &iso, dir.path()).unwrap_err().to_string();
    assert!(e.contains("pod interface eth0 does not exist"), "{e}");
    let e = phase1::setup(&v, &iso, Path::new("/nonexistent-kvrs-dir"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nonexistent-kvrs-dir"), "{e}");
}

/// The stand-in guest's MAC (a veth in its own namespace, plugged into the bridge where QEMU's
/// tap would be).
const GUEST_MAC: &str = "52:54:00:aa:bb:cc";

/// A namespace standing in for the guest: `eth0` (MAC [`GUEST_MAC`]) whose other end is a
/// port of the pod's bridge. Its kernel takes router advertisements (forwarding is off there).
fn stand_in_guest(pod: &Pod) -> Netns {
    let guest = Netns::new("v6-guest");
    pod.netns.ip(&[
        "link",
        "add",
        "gport",
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        &guest.name,
    ]);
    pod.netns
        .ip(&["link", "set", "gport", "master", "k6t-eth0", "up"]);
    guest.ip(&["link", "set", "eth0", "address", GUEST_MAC, "up"]);
    guest
}

/// The pod's DHCPv6 server and router advertisements, as the launcher runs them: sockets
/// opened inside the pod's namespace, served on `rt` until it is dropped.
fn serve_ipv6(pod: &Pod, rt: &tokio::runtime::Runtime, cached: &CachedInterface) {
    let mac = network::plan::parse_mac(GUEST_MAC).unwrap();
    let d6 = dhcp6::config(cached, mac, "nameserver fd00::53\nsearch example.test\n").unwrap();
    let r = ra::config(cached).unwrap();
    let handle = rt.handle().clone();
    let (d6, r) = in_netns(&pod.netns, move || {
        let _in_rt = handle.enter();
        (dhcp6::serve(d6).unwrap(), ra::serve(r).unwrap())
    });
    rt.spawn(d6);
    rt.spawn(r);
}

#[test]
fn masquerade_ipv6_dhcpv6_router_advertisements_and_nat() {
    let pod = Pod::new("v6");
    pod.with_ipv6();
    let iso = pod.isolation();
    let dir = tempfile::tempdir().unwrap();
    let v = vmi(&json!({"name": "default", "masquerade": {}, "ports": [{"port": 8080}]}));

    let c = phase1::setup(&v, &iso, dir.path()).unwrap().remove(0);
    assert_eq!(c.guest_ipv6.unwrap().to_string(), "fd10:0:2::2/120");
    assert_eq!(c.gateway_ipv6.unwrap().to_string(), "fd10:0:2::1");
    let bridge = pod.netns.ip(&["-6", "addr", "show", "dev", "k6t-eth0"]);
    assert!(bridge.contains("inet6 fd10:0:2::1/120"), "{bridge}");
    let rules = pod
        .netns
        .exec(&["nft", "list", "table", "ip6", "kubevirt_nat_eth0"]);
    let rules = String::from_utf8_lossy(&rules.stdout).into_owned();
    assert!(rules.contains("ip6 saddr fd10:0:2::2"), "{rules}");
    assert!(rules.contains("dnat to fd10:0:2::2"), "{rules}");
    assert_eq!(phase1::setup(&v, &iso, dir.path()).unwrap()[0], c);

    let guest = stand_in_guest(&pod);
    let rt = tokio::runtime::Runtime::new().unwrap();
    serve_ipv6(&pod, &rt, &c);

    // A real client (ISC dhclient) takes the address; its script only applies it, so nothing
    // outside the namespace (resolv.conf) is touched.
    let files = tempfile::tempdir().unwrap();
    let script = files.path().join("apply");
    std::fs::write(
        &script,
        "#!/bin/sh\ncase \"$reason\" in BOUND6|REBOOT6|RENEW6|REBIND6)\n\
         ip -6 addr replace \"$new_ip6_address/$new_ip6_prefixlen\" dev \"$interface\" nodad\n\
         echo \"$new_dhcp6_name_servers\" > \"$(dirname \"$0\")/dns\";;\nesac\n",
    )
    .unwrap();
    let mut perm = std::fs::metadata(&script).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&script, perm).unwrap();
    std::fs::write(files.path().join("dhclient.conf"), "").unwrap();
    let path = |n: &str| files.path().join(n).display().to_string();
    let mut dhclient = Command::new("dhclient");
    dhclient.args([
        "-6",
        "-d",
        "-cf",
        &path("dhclient.conf"),
        "-lf",
        &path("leases"),
        "-pf",
        &path("pid"),
        "-sf",
        &path("apply"),
        "eth0",
    ]);
    dhclient.stdout(std::process::Stdio::null());
    dhclient.stderr(std::process::Stdio::null());
    // dhclient binds to the link-local address, which must have passed duplicate address
    // detection.
    wait_until(
        Duration::from_secs(30),
        "the guest's link-local address",
        || {
            let a = guest.ip(&["-6", "addr", "show", "dev", "eth0", "scope", "link"]);
            (a.contains("inet6 fe80::") && !a.contains("tentative")).then_some(())
        },
    );
    let _client = guest.spawn(dhclient);

    // The script applies the address, then writes the DNS servers: both, or wait.
    let dns = wait_until(Duration::from_mins(1), "the guest's DHCPv6 address", || {
        let addr = guest.ip(&["-6", "addr", "show", "dev", "eth0"]);
        let dns = std::fs::read_to_string(files.path().join("dns")).ok()?;
        (addr.contains("inet6 fd10:0:2::2/128") && dns.ends_with('\n')).then_some(dns)
    });
    assert_eq!(dns.trim(), "fd00::53");
    let routes = wait_until(
        Duration::from_mins(1),
        "routes from the advertisement",
        || {
            let r = guest.ip(&["-6", "route", "show"]);
            (r.contains("fd10:0:2::/120 dev eth0") && r.contains("default via fe80::")).then_some(r)
        },
    );
    assert!(routes.contains("proto ra"), "{routes}");

    // Guest -> another pod: leaves with the pod's IPv6 address.
    let listener = in_netns(&pod.peer, || {
        TcpListener::bind(format!("[{PEER_IP6}]:7000")).unwrap()
    });
    let seen = std::thread::spawn(move || listener.accept().unwrap().1);
    in_netns(&guest, || {
        TcpStream::connect_timeout(
            &format!("[{PEER_IP6}]:7000").parse().unwrap(),
            Duration::from_secs(10),
        )
        .unwrap()
    });
    assert_eq!(seen.join().unwrap().ip().to_string(), POD_IP6);

    // Another pod -> the pod's IPv6 address on a listed port: the guest; an unlisted one: not.
    let server = in_netns(&guest, || TcpListener::bind("[::]:8080").unwrap());
    let echo = std::thread::spawn(move || {
        let (mut s, from) = server.accept().unwrap();
        let mut b = [0u8; 5];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
        from
    });
    let to: SocketAddr = format!("[{POD_IP6}]:8080").parse().unwrap();
    in_netns(&pod.peer, || {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(10)).unwrap();
        s.write_all(b"hello").unwrap();
        let mut b = [0u8; 5];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hello");
    });
    assert_eq!(echo.join().unwrap().ip().to_string(), PEER_IP6);
    let unlisted: SocketAddr = format!("[{POD_IP6}]:8081").parse().unwrap();
    let refused = in_netns(&pod.peer, || {
        TcpStream::connect_timeout(&unlisted, Duration::from_secs(10))
    });
    assert!(refused.is_err(), "port 8081 is not forwarded");

    drop(rt);
    pod.netns.ip(&["link", "del", "gport"]);
    phase1::teardown(&v, &iso, dir.path()).unwrap();
    assert!(
        !pod.netns
            .exec(&["nft", "list", "table", "ip6", "kubevirt_nat_eth0"])
            .status
            .success()
    );
    assert!(link(&pod.netns, "k6t-eth0").is_none());
}

#[test]
fn a_pod_without_ipv6_gets_no_ipv6_guest_network() {
    let pod = Pod::new("v4only");
    let iso = pod.isolation();
    let dir = tempfile::tempdir().unwrap();
    let v = vmi(&json!({"name": "default", "masquerade": {}}));
    let c = phase1::setup(&v, &iso, dir.path()).unwrap().remove(0);
    assert_eq!((c.guest_ipv6, c.gateway_ipv6), (None, None));
    assert!(dhcp6::config(&c, [2, 0, 0, 0, 0, 1], "").is_none());
    assert!(ra::config(&c).is_none());
    let v6 = pod.netns.ip(&["-6", "addr", "show", "dev", "k6t-eth0"]);
    assert!(!v6.contains("fd10"), "{v6}");
    assert!(
        !pod.netns
            .exec(&["nft", "list", "table", "ip6", "kubevirt_nat_eth0"])
            .status
            .success()
    );
    phase1::teardown(&v, &iso, dir.path()).unwrap();
}
