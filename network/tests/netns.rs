//! Phase 1 on the real system: a network namespace with a veth stands in for the pod, a
//! process inside it for the launcher. Needs root, `ip` and `nft`.

mod common;

use std::path::Path;

use common::{PEER_IP, POD_IP, Pod};
use network::{Binding, CachedInterface, Ipv4Cidr, phase1};
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
    let v = vmi(&json!({"name": "default", "bridge": {}}));
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
    assert_eq!(link(&pod.netns, "tap0").unwrap()["master"], "k6t-eth0");
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
