//! Pod networking through the whole stack (docs/network.md): two VMIs applied with kubectl on
//! localcluster, one per binding, next to a plain pod. Phase 1 runs in virt-handler inside the
//! launcher pods' real network namespaces; DHCP comes from virt-launcher; the guests are the test
//! guest, driven by cloud-init user-data whose output lands on the serial console.
//!
//! One test (each e2e test starts its own cluster and they run one at a time):
//! - masquerade: the guest gets 10.0.2.2 by DHCP, reaches the other pod's IP, answers at its pod
//!   IP on a listed port but not on an unlisted one it does listen on, and `status.interfaces`
//!   shows the agent's address;
//! - bridge: the guest gets the pod's IP by DHCP, reaches the other pod and is reachable on that
//!   IP from inside the other pod;
//! - deleting virt-handler's pod (its DaemonSet starts a new one, which redoes phase 1 and syncs)
//!   and a re-sync break no established TCP connection to either guest;
//! - after the VMIs are deleted nothing is left: the pods' network namespaces and host veths are
//!   gone, and the host has no new `k6t-`/`tap` link and no new `kubevirt_nat` table.

use std::collections::BTreeSet;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::{Stack, test_guest_firmware, wait_for};
use serde_json::{Value, json};

const BOOT: Duration = Duration::from_mins(8);
const PEER_PORT: u16 = 9000;

fn vmi_manifest(name: &str, binding: &str, ports: &[u16], peer_ip: &str) -> Value {
    // Every line the test looks for starts with a marker of its own, printed once.
    let user_data = format!(
        "#!/bin/sh\n\
         until ip -4 -o addr show dev eth0 | grep -q inet; do sleep 1; done\n\
         echo \"NET-ADDR $(ip -4 -o addr show dev eth0 | awk '{{print $4}}')\"\n\
         (nc -ll -p 8080 -e echo {name}-listed </dev/null >/dev/null 2>&1 &)\n\
         (nc -ll -p 8081 -e echo {name}-unlisted </dev/null >/dev/null 2>&1 &)\n\
         (nc -ll -p 8082 -e cat </dev/null >/dev/null 2>&1 &)\n\
         for i in $(seq 1 60); do\n\
           a=$(nc -w 10 {peer_ip} {PEER_PORT} </dev/null); [ -n \"$a\" ] && break; sleep 2\n\
         done\n\
         echo \"NET-PEER $a\"\n\
         until b=$(nc -w 5 127.0.0.1 8081 </dev/null) && [ -n \"$b\" ]; do sleep 1; done\n\
         echo \"NET-INSIDE $b\"\n"
    );
    let ports: Vec<Value> = ports.iter().map(|p| json!({"port": p})).collect();
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 10,
            "domain": {
                "cpu": {"cores": 1},
                "memory": {"guest": "256Mi"},
                "firmware": test_guest_firmware(),
                "devices": {
                    "interfaces": [{"name": "default", binding: {}, "ports": ports}],
                    "disks": [{"name": "cloudinitdisk", "disk": {"bus": "virtio"}}],
                },
            },
            "networks": [{"name": "default", "pod": {}}],
            "volumes": [{"name": "cloudinitdisk", "cloudInitNoCloud": {"userData": user_data}}],
        },
    })
}

/// A plain pod (the `test-tools` image: busybox and socat) answering `peer-answer` on
/// [`PEER_PORT`], with socat for connecting out.
fn peer_manifest() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "peer", "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "peer",
                "image": "kubevirt-rs/test-tools:latest",
                "command": ["socat", format!("TCP-LISTEN:{PEER_PORT},fork,reuseaddr"),
                            "SYSTEM:echo peer-answer"],
            }],
        },
    })
}

fn get(stack: &Stack, resource: &str, name: &str) -> Result<Value, String> {
    stack
        .get_json("default", resource, name)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no {resource} default/{name} yet"))
}

/// A running VMI and its launcher pod.
struct Vm {
    name: &'static str,
    pod_ip: String,
    pod_uid: String,
    console: PathBuf,
}

fn running(stack: &Stack, name: &'static str) -> Vm {
    let vmi = wait_for(&format!("VMI {name} to run"), BOOT, || {
        let vmi = get(stack, "vmi", name)?;
        match vmi["status"]["phase"].as_str() {
            Some("Running") => Ok(Some(vmi)),
            Some(p @ ("Failed" | "Succeeded")) => panic!("VMI {name} ended {p}: {vmi:#}"),
            p => Err(format!("phase {p:?}")),
        }
    })
    .unwrap_or_else(|e| panic!("{e}; localcluster log in {}", stack.dir().display()));
    let uid = vmi["metadata"]["uid"].as_str().expect("uid");
    let pods = stack
        .kubectl(&[
            "get",
            "pods",
            "-l",
            &format!("kubevirt.io/created-by={uid}"),
            "-o",
            "json",
        ])
        .expect("the launcher pod");
    let pods: Value = serde_json::from_str(&pods).expect("pod list JSON");
    let pod = &pods["items"][0];
    let console = stack
        .vmi_private_dir(&vmi)
        .expect("a Running VMI names its node and launcher pod")
        .join("virt-serial0-log");
    Vm {
        name,
        pod_ip: pod["status"]["podIP"].as_str().expect("pod IP").to_owned(),
        pod_uid: pod["metadata"]["uid"].as_str().expect("pod uid").to_owned(),
        console,
    }
}

/// The rest of the console line that starts with `marker`, once the guest has printed it.
fn console_line(vm: &Vm, marker: &str) -> String {
    wait_for(&format!("{marker} on {}'s console", vm.name), BOOT, || {
        let text = std::fs::read_to_string(&vm.console)
            .map_err(|e| format!("{}: {e}", vm.console.display()))?;
        // Whole lines only: the log is read while the guest writes it, and a line read half
        // written ("10.0.2." of "10.0.2.2/24") would be taken for the answer.
        let written = text.rfind('\n').map_or("", |end| &text[..end]);
        Ok(written
            .lines()
            .find_map(|l| l.trim_end_matches('\r').strip_prefix(marker))
            .map(|rest| rest.trim().to_owned()))
    })
    .unwrap_or_else(|e| panic!("{e}; console in {}", vm.console.display()))
}

fn addr(ip: &str, port: u16) -> SocketAddr {
    format!("{ip}:{port}").parse().expect("an IPv4 address")
}

/// What the guest's greeter at `ip:port` says, polled until it answers (its nc may take a
/// moment to listen under TCG).
fn greeting(ip: &str, port: u16) -> String {
    e2e::greeting(addr(ip, port), BOOT).expect("the guest answers")
}

/// An established connection to the guest's echo server (`nc -e cat`).
struct Echo {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Echo {
    fn open(ip: &str) -> Self {
        let to = addr(ip, 8082);
        let mut echo = wait_for(&format!("the echo server at {to}"), BOOT, || {
            let s = TcpStream::connect_timeout(&to, Duration::from_secs(5))
                .map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_mins(1)))
                .map_err(|e| e.to_string())?;
            let writer = s.try_clone().map_err(|e| e.to_string())?;
            Ok(Some(Self {
                reader: BufReader::new(s),
                writer,
            }))
        })
        .expect("the echo server accepts");
        echo.check("hello");
        echo
    }

    fn check(&mut self, line: &str) {
        writeln!(self.writer, "{line}").expect("writing to the guest");
        let mut got = String::new();
        self.reader
            .read_line(&mut got)
            .unwrap_or_else(|e| panic!("reading {line:?} back from the guest: {e}"));
        assert_eq!(
            got.trim_end(),
            line,
            "the guest echoes on the same connection"
        );
    }
}

/// `k6t-*`/`tap*` links and `kubevirt_nat` tables in the host's namespace.
fn host_network_leftovers() -> BTreeSet<String> {
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip link");
    let tables = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .expect("nft list tables");
    let links = String::from_utf8_lossy(&links.stdout).into_owned();
    let tables = String::from_utf8_lossy(&tables.stdout).into_owned();
    let links = links
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .filter(|n| n.starts_with("k6t-") || n.starts_with("tap"));
    let tables = tables
        .lines()
        .filter(|l| l.contains("kubevirt_nat"))
        .map(str::to_owned);
    links.chain(tables).collect()
}

/// localcluster's names for a pod's network namespace and host veth (`lc-`/`lcv` + 11 hex
/// digits of its uid).
fn pod_netns_and_veth(pod_uid: &str) -> (PathBuf, String) {
    let short: String = pod_uid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(11)
        .collect();
    (
        PathBuf::from(format!("/run/netns/lc-{short}")),
        format!("lcv{short}"),
    )
}

fn in_pod_netns(netns: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(args)
        .output()
        .expect("nsenter");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn guest_masquerade_and_bridge_through_the_stack() {
    let before = host_network_leftovers();
    let stack = Stack::up().expect("the stack comes up");

    stack.apply(&peer_manifest());
    let peer_ip = wait_for("the peer pod's IP", Duration::from_mins(2), || {
        let pod = get(&stack, "pod", "peer")?;
        Ok(pod["status"]["podIP"].as_str().map(str::to_owned))
    })
    .expect("the peer pod runs");

    stack.apply(&vmi_manifest("masq", "masquerade", &[8080, 8082], &peer_ip));
    stack.apply(&vmi_manifest("bridged", "bridge", &[], &peer_ip));
    let masq = running(&stack, "masq");
    let bridged = running(&stack, "bridged");

    // Masquerade: the fixed guest address behind the pod's.
    assert_eq!(console_line(&masq, "NET-ADDR"), "10.0.2.2/24");
    assert_eq!(console_line(&masq, "NET-PEER"), "peer-answer");
    assert_eq!(console_line(&masq, "NET-INSIDE"), "masq-unlisted");
    assert_eq!(greeting(&masq.pod_ip, 8080), "masq-listed");
    let unlisted = TcpStream::connect_timeout(&addr(&masq.pod_ip, 8081), Duration::from_secs(10));
    assert!(
        unlisted.is_err(),
        "port 8081 is not in the interface's ports: the pod must not forward it"
    );
    wait_for(
        "the agent's address in status.interfaces",
        Duration::from_mins(3),
        || {
            let vmi = get(&stack, "vmi", "masq")?;
            let iface = &vmi["status"]["interfaces"][0];
            (iface["ipAddress"] == "10.0.2.2"
                && iface["interfaceName"] == "eth0"
                && iface["infoSource"]
                    .as_str()
                    .is_some_and(|s| s.contains("guest-agent")))
            .then_some(Some(()))
            .ok_or_else(|| format!("interfaces {}", vmi["status"]["interfaces"]))
        },
    )
    .expect("virt-handler reports the address the guest took by DHCP");

    // Bridge: the guest is the pod on the wire, with the pod's address.
    let bridged_addr = console_line(&bridged, "NET-ADDR");
    assert!(
        bridged_addr.starts_with(&format!("{}/", bridged.pod_ip)),
        "the bridged guest has its pod's IP {}: {bridged_addr}",
        bridged.pod_ip
    );
    assert_eq!(console_line(&bridged, "NET-PEER"), "peer-answer");
    let from_peer = wait_for("the bridged guest, from inside the peer pod", BOOT, || {
        let out = stack
            .kubectl(&[
                "exec",
                "peer",
                "--",
                "timeout",
                "30",
                "socat",
                "-T20",
                "-",
                &format!("TCP:{}:8080", bridged.pod_ip),
            ])
            .map_err(|e| e.to_string())?;
        Ok((!out.trim().is_empty()).then(|| out.trim().to_owned()))
    })
    .expect("the peer reaches the bridged guest");
    assert_eq!(from_peer, "bridged-listed");

    let (masq_netns, masq_veth) = pod_netns_and_veth(&masq.pod_uid);
    let (bridged_netns, bridged_veth) = pod_netns_and_veth(&bridged.pod_uid);
    assert!(
        in_pod_netns(&masq_netns, &["nft", "list", "tables"]).contains("kubevirt_nat_eth0"),
        "phase 1 put the NAT table in the launcher pod's namespace"
    );
    assert!(
        in_pod_netns(&bridged_netns, &["ip", "-o", "link", "show"]).contains("eth0-nic"),
        "phase 1 enslaved the bridged pod's interface in its namespace"
    );

    // Established connections survive a new virt-handler (phase 1 again, a new sync) and a
    // re-sync caused by a change to the VMI.
    let mut echoes = [Echo::open(&masq.pod_ip), Echo::open(&bridged.pod_ip)];
    // The node is schedulable as soon as virt-handler runs; its pod is Ready only after the
    // readiness probe's initial delay (15 s).
    let old_handler = wait_for("a ready virt-handler", Duration::from_mins(2), || {
        stack.ready_handler_pod().map(|p| p.map(|p| p.name))
    })
    .expect("a ready virt-handler");
    stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "delete",
            "pod",
            &old_handler,
            "--wait=false",
        ])
        .expect("deleting virt-handler's pod");
    wait_for(
        "a new ready virt-handler",
        Duration::from_mins(3),
        || match stack.ready_handler_pod()?.map(|p| p.name) {
            Some(p) if p != old_handler => Ok(Some(())),
            p => Err(format!("ready handler {p:?}")),
        },
    )
    .expect("the DaemonSet replaces virt-handler");
    for vm in ["masq", "bridged"] {
        stack
            .kubectl(&["label", "vmi", vm, "network-test/resync=1", "--overwrite"])
            .expect("labelling the VMI");
    }
    // The new handler reconciles both VMIs shortly after it is ready; keep talking for a while
    // so the connections are in use while it does.
    let until = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    while Instant::now() < until {
        for e in &mut echoes {
            e.check(&format!("line {n}"));
        }
        n += 1;
        std::thread::sleep(Duration::from_secs(1));
    }
    for vm in ["masq", "bridged"] {
        assert_eq!(
            get(&stack, "vmi", vm).expect("the VMI")["status"]["phase"],
            "Running",
            "{vm} keeps running across the handler restart"
        );
    }
    drop(echoes);

    for vm in [&masq, &bridged] {
        stack
            .kubectl(&["delete", "vmi", vm.name, "--wait=false"])
            .expect("deleting the VMI");
    }
    wait_for("the VMIs and their pods to go", BOOT, || {
        let mut left = Vec::new();
        for vm in [&masq, &bridged] {
            if stack
                .get_json("default", "vmi", vm.name)
                .map_err(|e| e.to_string())?
                .is_some()
            {
                left.push(format!("vmi {}", vm.name));
            }
        }
        let pods = stack.launcher_pods().map_err(|e| e.to_string())?;
        left.extend(pods.lines().map(str::to_owned));
        if left.is_empty() {
            Ok(Some(()))
        } else {
            Err(left.join(", "))
        }
    })
    .expect("deleted VMIs take their pods with them");

    for (netns, veth) in [(&masq_netns, &masq_veth), (&bridged_netns, &bridged_veth)] {
        wait_for(
            "the launcher pod's namespace and veth to go",
            Duration::from_mins(1),
            || {
                let veth_left = Command::new("ip")
                    .args(["link", "show", veth])
                    .output()
                    .map_err(|e| e.to_string())?
                    .status
                    .success();
                if netns.exists() || veth_left {
                    Err(format!(
                        "{} exists: {}, {veth} exists: {veth_left}",
                        netns.display(),
                        netns.exists()
                    ))
                } else {
                    Ok(Some(()))
                }
            },
        )
        .expect("nothing of the pod's network is left");
    }
    let after = host_network_leftovers();
    let new: Vec<&String> = after.difference(&before).collect();
    assert!(
        new.is_empty(),
        "links or NAT tables left on the host: {new:?}"
    );
}
