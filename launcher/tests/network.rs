//! Pod networking end to end on the real system: a network namespace with a veth stands in for
//! the pod (and its peer for "another pod"), phase 1 (`network::phase1`, the handler's half)
//! wires it, the launcher runs inside it and boots the test guest, which takes its address by
//! DHCP. Needs root, `ip`, `nft` and the test guest (`hack/guest/build.sh`).

mod common;
#[path = "../../network/tests/common/mod.rs"]
mod netfix;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::{BOOT, Launcher, place_kernel, uid};
use netfix::{Netns, PEER_IP, PEER_IP6, POD_IP, POD_IP6, Pod, in_netns};
use serde_json::{Value, json};
use testguest::Console;

/// A launcher started inside the pod's network namespace (a child inherits the namespace of
/// the thread that forks it). It outlives its domain, so teardown can still find the pod.
fn launcher_in(pod: &Pod) -> Launcher {
    in_netns(&pod.netns, || {
        Launcher::start_with(&["--keep-after-shutdown"], place_kernel)
    })
}

fn guest_vmi(id: &str, iface: &Value) -> Value {
    common::vmi(
        "netvm",
        id,
        json!({
            "domain": {
                "machine": {"type": "q35"},
                "resources": {"requests": {"memory": "256Mi"}},
                "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                    "image": "guest", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}},
                "devices": {"interfaces": [iface]},
            },
            "networks": [{"name": "default", "pod": {}}],
        }),
    )
}

/// Phase 1 for the launcher's pod, as virt-handler does before the first sync.
fn phase1(l: &Launcher, v: &Value) -> Vec<network::CachedInterface> {
    let vmi: api::VirtualMachineInstance = serde_json::from_value(v.clone()).unwrap();
    let iso = isolation::detect_from_pid(i32::try_from(l.pid()).unwrap()).unwrap();
    network::phase1::setup(&vmi, &iso, &l.dir("private")).unwrap()
}

fn teardown(l: &Launcher, v: &Value) {
    let vmi: api::VirtualMachineInstance = serde_json::from_value(v.clone()).unwrap();
    let iso = isolation::detect_from_pid(i32::try_from(l.pid()).unwrap()).unwrap();
    network::phase1::teardown(&vmi, &iso, &l.dir("private")).unwrap();
}

/// Kills the domain and, once it is off, runs phase 1's teardown.
fn kill_and_teardown(l: &Launcher, v: &Value) {
    let killed = l.post("/v1/kill");
    assert!(killed.is_object(), "{killed}");
    l.wait_state("Shutoff", Duration::from_mins(1));
    teardown(l, v);
}

fn boot(l: &Launcher, id: &str, v: &Value) -> Console {
    let (status, d) = l.sync(v);
    assert_eq!(status, 200, "{d}\n{}", l.log());
    l.wait_console(id, "KUBEVIRT-RS-GUEST-READY");
    Console::connect(&l.vm_dir(id).join("virt-serial0"))
}

/// Waits until the guest's eth0 has `addr` (udhcpc runs in the background from boot).
fn wait_address(console: &mut Console, addr: &str) {
    common::wait_until(BOOT, &format!("{addr} on the guest's eth0"), || {
        let out = console.run("ip -4 -o addr show dev eth0", Duration::from_mins(1));
        out.contains(addr).then_some(())
    });
}

/// A TCP server in `ns` on `addr` that greets every client with `greeting`.
fn greeter(ns: &Netns, addr: &str, greeting: &'static str) -> SocketAddr {
    let l = in_netns(ns, || TcpListener::bind(addr).unwrap());
    let at = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut s = s;
            let _ = s.write_all(greeting.as_bytes());
        }
    });
    at
}

fn connect_from(ns: &Netns, to: &str) -> std::io::Result<TcpStream> {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(ns, || {
        TcpStream::connect_timeout(&to, Duration::from_secs(10))
    })
}

/// What a server at `to` sends before closing, read from inside `ns`.
fn read_from(ns: &Netns, to: &str) -> std::io::Result<String> {
    let mut s = connect_from(ns, to)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// The guest connects to a TCP server at `peer_ip` in the peer namespace ("another pod") and
/// reads its greeting.
fn guest_reaches_peer(pod: &Pod, console: &mut Console, peer_ip: &str) {
    let at: std::net::IpAddr = peer_ip.parse().unwrap();
    greeter(
        &pod.peer,
        &SocketAddr::new(at, 7000).to_string(),
        "hello-from-peer",
    );
    let got = console.run(
        &format!("nc -w 10 {peer_ip} 7000 </dev/null"),
        Duration::from_secs(90),
    );
    assert!(got.contains("hello-from-peer"), "{got}");
}

/// Starts busybox nc servers in the guest: `guest-<port>` greeters and one echo server.
fn guest_listeners(console: &mut Console, greeters: &[u16], echo: Option<u16>) {
    for p in greeters {
        console.run(
            &format!("(nc -ll -p {p} -e echo guest-{p} </dev/null >/dev/null 2>&1 &)"),
            Duration::from_mins(1),
        );
    }
    if let Some(p) = echo {
        console.run(
            &format!("(nc -ll -p {p} -e cat </dev/null >/dev/null 2>&1 &)"),
            Duration::from_mins(1),
        );
    }
}

/// Polls until the guest's greeter answers (its nc may take a moment to listen under TCG).
fn wait_greeting(ns: &Netns, to: &str, expect: &str) {
    common::wait_until(
        Duration::from_mins(1),
        &format!("{expect} from {to}"),
        || read_from(ns, to).ok().filter(|s| s.contains(expect)),
    );
}

fn echo(s: &mut TcpStream, line: &str) -> String {
    s.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut buf = vec![0u8; line.len() + 1];
    s.read_exact(&mut buf).unwrap();
    String::from_utf8_lossy(&buf).trim().to_owned()
}

fn agent_interfaces(l: &Launcher) -> Vec<launcher_api::guest::AgentInterface> {
    common::wait_until(BOOT, "the agent's interfaces", || {
        let (code, v) = l.request("GET", "/v1/guest/interfaces", None);
        (code == 200).then(|| serde_json::from_value(v).unwrap())
    })
}

fn domain_interfaces(l: &Launcher) -> Vec<network::status::DomainInterface> {
    let d = l.domain();
    d["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| network::status::DomainInterface {
            name: i["name"].as_str().unwrap().to_owned(),
            mac: i["mac"].as_str().map(str::to_owned),
            pod_interface: Some("eth0".into()),
            link_state: i["linkState"].as_str().map(str::to_owned),
            queue_count: i["queueCount"].as_i64().map(|q| i32::try_from(q).unwrap()),
        })
        .collect()
}

#[test]
fn guest_masquerade_dhcp_ports_status_and_resync() {
    let pod = Pod::new("lmasq");
    let l = launcher_in(&pod);
    let id = uid();
    let mut v = guest_vmi(
        &id,
        &json!({"name": "default", "masquerade": {}, "ports": [{"port": 5000}, {"port": 5002}]}),
    );
    // Two vCPUs with networkInterfaceMultiqueue: a two-queue tap and virtio-net device.
    v["spec"]["domain"]["cpu"] = json!({"sockets": 1, "cores": 2, "threads": 1});
    v["spec"]["domain"]["devices"]["networkInterfaceMultiqueue"] = true.into();
    let cached = phase1(&l, &v);
    assert_eq!(cached[0].guest_ipv4.unwrap().to_string(), "10.0.2.2/24");
    let mut console = boot(&l, &id, &v);
    wait_address(&mut console, "10.0.2.2/24");
    let queues = console.run(
        "ls -d /sys/class/net/eth0/queues/rx-* /sys/class/net/eth0/queues/tx-*",
        Duration::from_mins(1),
    );
    let mut queues: Vec<&str> = queues
        .split_whitespace()
        .filter_map(|q| q.strip_prefix("/sys/class/net/eth0/queues/"))
        .collect();
    queues.sort_unstable();
    assert_eq!(
        queues,
        ["rx-0", "rx-1", "tx-0", "tx-1"],
        "the guest's queues"
    );
    let route = console.run("ip route show default", Duration::from_mins(1));
    assert!(route.contains("via 10.0.2.1"), "{route}");

    // Out: another pod answers the guest (masqueraded as the pod's address).
    guest_reaches_peer(&pod, &mut console, PEER_IP);

    // In: a listed port reaches the guest at the pod's address; an unlisted one does not.
    guest_listeners(&mut console, &[5000, 5001], Some(5002));
    wait_greeting(&pod.peer, &format!("{POD_IP}:5000"), "guest-5000");
    // The guest does listen on 5001 (seen from inside), but from outside the pod answers for
    // itself: nothing listens there, so the connection is refused.
    let inside = console.run("nc -w 5 127.0.0.1 5001 </dev/null", Duration::from_mins(1));
    assert!(inside.contains("guest-5001"), "{inside}");
    let unlisted = read_from(&pod.peer, &format!("{POD_IP}:5001"));
    assert_eq!(
        unlisted.as_ref().map_err(std::io::Error::kind).err(),
        Some(std::io::ErrorKind::ConnectionRefused),
        "an unlisted port must not reach the guest: {unlisted:?}"
    );

    // status.interfaces from the domain and the agent.
    let status = network::status::merge(&domain_interfaces(&l), Some(&agent_interfaces(&l)));
    let s = &status[0];
    assert_eq!(s.name.as_deref(), Some("default"));
    assert_eq!(s.ip.as_deref(), Some("10.0.2.2"));
    assert_eq!(s.interface_name.as_deref(), Some("eth0"));
    assert_eq!(s.info_source.as_deref(), Some("domain, guest-agent"));
    assert_eq!(s.queue_count, Some(2), "KubeVirt's queueCount");

    // Re-running phase 1 (a restarted handler, a re-sync) keeps an established connection.
    let mut conn = common::wait_until(Duration::from_mins(1), "the guest's echo server", || {
        let mut c = connect_from(&pod.peer, &format!("{POD_IP}:5002")).ok()?;
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        (echo(&mut c, "one") == "one").then_some(c)
    });
    assert_eq!(phase1(&l, &v), cached);
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}");
    assert_eq!(echo(&mut conn, "two"), "two");

    // Teardown once the VM is gone leaves nothing in the pod but its own interface.
    kill_and_teardown(&l, &v);
    let links = pod.netns.ip(&["-o", "link", "show"]);
    let names: Vec<&str> = links
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n))
        .collect();
    assert_eq!(names, vec!["lo", "eth0"], "{links}");
    let tables = pod.netns.exec(&["nft", "list", "tables"]);
    assert!(String::from_utf8_lossy(&tables.stdout).trim().is_empty());
}

/// IPv6 with the real guest: the launcher's router advertisements give the guest's kernel its
/// default route and the on-link `fd10:0:2::/120`. The test guest's busybox has no DHCPv6
/// client (Debian's busybox is built without `udhcpc6`), so the address DHCPv6 would hand out
/// is set by hand; the DHCPv6 server itself is tested against ISC dhclient in
/// `network/tests/netns.rs`. Then the guest reaches another pod's IPv6 address through the
/// `ip6` NAT, and another pod reaches the guest at the pod's IPv6 address on a listed port.
#[test]
fn guest_masquerade_ipv6_router_advertisements_and_nat() {
    let pod = Pod::new("lmasq6");
    pod.with_ipv6();
    let l = launcher_in(&pod);
    let id = uid();
    let v = guest_vmi(
        &id,
        &json!({"name": "default", "masquerade": {}, "ports": [{"port": 5000}]}),
    );
    let cached = phase1(&l, &v);
    assert_eq!(cached[0].guest_ipv6.unwrap().to_string(), "fd10:0:2::2/120");
    let mut console = boot(&l, &id, &v);
    wait_address(&mut console, "10.0.2.2/24");
    common::wait_until(BOOT, "the advertised routes in the guest", || {
        let out = console.run("ip -6 route show", Duration::from_mins(1));
        (out.contains("fd10:0:2::/120 dev eth0") && out.contains("default via fe80::"))
            .then_some(())
    });
    // busybox ip has no `nodad`: wait for duplicate address detection instead.
    let added = console.run(
        "ip -6 addr add fd10:0:2::2/128 dev eth0",
        Duration::from_mins(1),
    );
    assert!(!added.contains("ip:"), "{added}");
    common::wait_until(Duration::from_mins(1), "fd10:0:2::2 past DAD", || {
        let out = console.run("ip -6 addr show dev eth0", Duration::from_mins(1));
        (out.contains("fd10:0:2::2/128") && !out.contains("tentative")).then_some(())
    });

    guest_reaches_peer(&pod, &mut console, PEER_IP6);

    guest_listeners(&mut console, &[5000], None);
    wait_greeting(&pod.peer, &format!("[{POD_IP6}]:5000"), "guest-5000");

    kill_and_teardown(&l, &v);
    let tables = pod.netns.exec(&["nft", "list", "tables"]);
    assert!(String::from_utf8_lossy(&tables.stdout).trim().is_empty());
}

/// The guest's eth0 flags once `wanted` is among them (`NO-CARRIER`: its link is down).
fn wait_link_flags(console: &mut Console, wanted: &str, absent: &str) -> String {
    common::wait_until(BOOT, &format!("{wanted} on the guest's eth0"), || {
        let out = console.run("ip -o link show eth0", Duration::from_mins(1));
        (out.contains(wanted) && !out.contains(absent)).then_some(out)
    })
}

/// The bridge binding, on a NIC that starts with `state: down`: the guest sees no carrier
/// until a later sync brings the link up, then gets the pod's address.
#[test]
fn guest_bridge_gets_the_pod_address() {
    let pod = Pod::new("lbrdg");
    let l = launcher_in(&pod);
    let id = uid();
    let v = guest_vmi(&id, &json!({"name": "default", "bridge": {}}));
    let down = guest_vmi(
        &id,
        &json!({"name": "default", "bridge": {}, "state": "down"}),
    );
    let pod_mac = pod.netns.ip(&["-o", "link", "show", "eth0"]);
    let cached = phase1(&l, &down);
    assert!(pod_mac.contains(&cached[0].pod_mac), "{pod_mac}");
    let mut console = boot(&l, &id, &down);
    wait_link_flags(&mut console, "NO-CARRIER", "LOWER_UP");
    assert_eq!(l.domain()["interfaces"][0]["linkState"], "down");
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["interfaces"][0]["linkState"], "up", "{d}");
    wait_link_flags(&mut console, "LOWER_UP", "NO-CARRIER");
    wait_address(&mut console, &format!("{POD_IP}/24"));
    let link = console.run("ip -o link show eth0", Duration::from_mins(1));
    assert!(
        link.contains(&cached[0].pod_mac),
        "the guest has the pod's MAC: {link}"
    );
    assert!(link.contains("mtu 1400"), "virtio got the pod MTU: {link}");

    guest_reaches_peer(&pod, &mut console, PEER_IP);
    guest_listeners(&mut console, &[5000], None);
    wait_greeting(&pod.peer, &format!("{POD_IP}:5000"), "guest-5000");

    kill_and_teardown(&l, &v);
    let addr = pod.netns.ip(&["-4", "-o", "addr", "show", "dev", "eth0"]);
    assert!(
        addr.contains(&format!("{POD_IP}/24")),
        "the pod got its address back: {addr}"
    );
}

#[test]
fn a_corrupt_interface_cache_is_named() {
    let l = Launcher::start_with(&[], place_kernel);
    std::fs::write(l.dir("private/vif-cache-eth0.json"), "{not json").unwrap();
    let id = uid();
    let (status, e) = l.sync(&guest_vmi(
        &id,
        &json!({"name": "default", "masquerade": {}}),
    ));
    assert_eq!(status, 500, "{e}");
    assert_eq!(e["code"], "NetworkFailed");
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("vif-cache-eth0.json") && msg.contains("key must be a string"),
        "{msg}"
    );
    // Nothing was started: a later sync may still succeed once the cache is right.
    assert_eq!(l.domain()["state"], "NoState");
}

/// Sends `bytes` to `to` from `ns` and waits for the server to close; MiB/s.
fn throughput(ns: &Netns, to: &str, bytes: usize) -> f64 {
    let mut s = connect_from(ns, to).unwrap();
    let chunk = vec![0x5au8; 64 * 1024];
    let start = Instant::now();
    let mut sent = 0;
    while sent < bytes {
        s.write_all(&chunk).unwrap();
        sent += chunk.len();
    }
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    #[allow(clippy::cast_precision_loss)] // MiB figures, far below 2^52
    let mib = sent as f64 / (1024.0 * 1024.0);
    mib / start.elapsed().as_secs_f64()
}

/// A sink in `ns` that reads each connection to its end.
fn sink(ns: &Netns, addr: &str) {
    let l = in_netns(ns, || TcpListener::bind(addr).unwrap());
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut s = s;
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        }
    });
}

/// `cargo nextest run -p launcher --test network --run-ignored only guest_bench --no-capture`:
/// TCP throughput from another pod to the guest through each binding, against the same
/// transfer to a plain process in the pod (before phase 1). Under TCG the guest dominates.
#[test]
#[ignore = "benchmark: prints figures"]
fn guest_bench_tcp_throughput() {
    const BYTES: usize = 32 * 1024 * 1024;
    for binding in ["masquerade", "bridge"] {
        let pod = Pod::new(&format!("bench{}", &binding[..1]));
        sink(&pod.netns, &format!("{POD_IP}:6000"));
        let plain = throughput(&pod.peer, &format!("{POD_IP}:6000"), BYTES);
        let l = launcher_in(&pod);
        let id = uid();
        let v = guest_vmi(&id, &json!({"name": "default", binding: {}}));
        phase1(&l, &v);
        let mut console = boot(&l, &id, &v);
        let ip = if binding == "masquerade" {
            "10.0.2.2/24".to_owned()
        } else {
            format!("{POD_IP}/24")
        };
        wait_address(&mut console, &ip);
        console.run(
            "(nc -ll -p 5004 -e wc -c </dev/null >/dev/null 2>&1 &)",
            Duration::from_mins(1),
        );
        common::wait_until(Duration::from_mins(1), "the guest sink", || {
            connect_from(&pod.peer, &format!("{POD_IP}:5004")).ok()
        });
        let guest = throughput(&pod.peer, &format!("{POD_IP}:5004"), BYTES);
        println!(
            "{binding}: to the guest {guest:.1} MiB/s, to a plain process in the pod {plain:.1} MiB/s, ratio {:.3}",
            guest / plain
        );
    }
}
