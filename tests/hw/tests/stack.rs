//! The README's main job as a test: a VM applied with kubectl boots through localcluster,
//! virt-controller, virt-handler and virt-launcher, is reachable on its pod's IP through the
//! masquerade binding, and stops when its run strategy says Halted. Every component runs from
//! its image: virt-handler and the guest's QEMU see their image's layers as `/`, not the host.
//! Then a VM with readiness and liveness probes through the guest agent, and a ConfigMap shared
//! with virtiofs, is Ready, reads the ConfigMap in the guest, and is restarted when its liveness
//! probe fails.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use e2e::{Stack, is_ready, processes, repo_root, wait_for};

const BOOT: Duration = Duration::from_mins(7);

/// The demo VM or VMI as it is now; a missing one is something to wait for.
fn demo(stack: &Stack, resource: &str) -> Result<serde_json::Value, String> {
    stack
        .get_json("default", resource, "demo")
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no {resource} default/demo yet"))
}

/// The process's `/` is an overlay of layers from the stack's image store holding `program`,
/// and none of the host's own files (Debian's `/etc/debian_version`, cargo's home).
fn assert_runs_from_image(stack: &Stack, pid: u32, program: &str) {
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    let root = mountinfo
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/"))
        .expect("a root mount");
    let (_, fs) = root.split_once(" - ").expect("mountinfo's separator");
    let layers = stack.dir().join("images/layers");
    assert!(
        fs.starts_with("overlay ") && fs.contains(&format!("lowerdir={}", layers.display())),
        "pid {pid}'s root is its image's layers in {}: {root}",
        layers.display()
    );
    let inside = |p: &str| Path::new(&format!("/proc/{pid}/root")).join(p.trim_start_matches('/'));
    assert!(inside(program).is_file(), "{program} in pid {pid}'s image");
    for host_only in ["/etc/debian_version", "/root/.cargo", "/usr/bin/apt"] {
        assert!(
            !inside(host_only).exists(),
            "{host_only} of the host is visible to pid {pid}"
        );
    }
}

/// `kubectl auth can-i --list` in a stable order: kube-apiserver merges the rules of several
/// roles in no fixed order, so the verbs of a line and the lines are sorted (the header first).
fn sorted_rules(listing: &str) -> String {
    let mut lines = listing.lines();
    let header = lines.next().unwrap_or_default();
    let mut rules: Vec<String> = lines
        .map(|line| match line.rsplit_once('[') {
            Some((head, verbs)) => {
                let mut verbs: Vec<&str> = verbs.trim_end_matches(']').split(' ').collect();
                verbs.sort_unstable();
                format!("{head}[{}]", verbs.join(" "))
            }
            None => line.to_owned(),
        })
        .collect();
    rules.sort();
    let mut out = format!("{header}\n");
    for r in rules {
        out.push_str(&r);
        out.push('\n');
    }
    out
}

/// What each component's service account may do, as kube-apiserver lists it (`kubectl auth
/// can-i --list`, cluster-wide and in the install namespace), against `tests/hw/tests/rbac/`: any
/// change to a component's permissions shows in review. `UPDATE_GOLDEN=1` rewrites the files.
fn rbac_is_as_checked_in(stack: &Stack) {
    let dir = repo_root().join("tests/hw/tests/rbac");
    for account in [
        "kubevirt-operator",
        "kubevirt-apiserver",
        "kubevirt-controller",
        "kubevirt-handler",
    ] {
        let user = format!("--as=system:serviceaccount:kubevirt:{account}");
        let mut listed = String::new();
        for namespace in ["default", "kubevirt"] {
            listed.push_str("# kubectl auth can-i --list -n ");
            listed.push_str(namespace);
            listed.push('\n');
            listed.push_str(&sorted_rules(
                &stack
                    .kubectl(&["auth", "can-i", "--list", "-n", namespace, &user])
                    .unwrap_or_else(|e| panic!("listing what {account} may do: {e}")),
            ));
        }
        let path = dir.join(format!("{account}.txt"));
        if std::env::var_os("UPDATE_GOLDEN").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &listed).unwrap();
        }
        let want = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            listed == want,
            "{account}'s permissions differ from {}; if intended, rerun with UPDATE_GOLDEN=1 \
             and review the diff:\n{listed}",
            path.display()
        );
    }
}

#[test]
fn guest_vm_applied_with_kubectl_boots_and_halts() {
    let stack = Stack::up().expect("the stack comes up");
    rbac_is_as_checked_in(&stack);
    let manifest = repo_root().join("manifests/examples/vm-demo.yaml");
    stack
        .kubectl(&["apply", "-f", &manifest.display().to_string()])
        .expect("kubectl apply of the VM");

    let vmi = wait_for("VMI default/demo to run", BOOT, || {
        let vmi = demo(&stack, "vmi")?;
        match vmi["status"]["phase"].as_str() {
            Some("Running") => Ok(Some(vmi)),
            Some(p @ ("Failed" | "Succeeded")) => panic!("VMI ended {p}: {vmi:#}"),
            p => Err(format!("phase {p:?}")),
        }
    })
    .unwrap_or_else(|e| panic!("{e}; localcluster log in {}", stack.dir().display()));
    assert_eq!(
        vmi["metadata"]["ownerReferences"][0]["kind"], "VirtualMachine",
        "the VM controller owns the VMI"
    );

    let log = stack
        .vmi_private_dir(&vmi)
        .expect("a Running VMI names its node and launcher pod")
        .join("virt-serial0-log");
    wait_for("the guest's ready marker on its console", BOOT, || {
        let text = std::fs::read_to_string(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        if text.contains("KUBEVIRT-RS-GUEST-READY") {
            assert!(
                text.contains("hello from cloud-init in the demo VM"),
                "cloud-init user-data ran: {text}"
            );
            Ok(Some(()))
        } else {
            Err(format!("{} bytes of console, no marker", text.len()))
        }
    })
    .expect("the guest boots");
    // QEMU comes from the launcher image (with its libraries and firmware), not the host.
    let qemu = processes("qemu-system-x86_64", "guest=default_demo");
    assert_eq!(qemu.len(), 1, "one QEMU for the demo VM: {qemu:?}");
    assert_runs_from_image(&stack, qemu[0], "/usr/bin/qemu-system-x86_64");
    let handler = processes("/usr/bin/virt-handler", "--console-server-port");
    assert_eq!(handler.len(), 1, "one virt-handler: {handler:?}");
    assert_runs_from_image(&stack, handler[0], "/usr/bin/virt-handler");
    let vmi_uid = vmi["metadata"]["uid"].as_str().expect("uid").to_owned();
    let pod_ip = stack
        .kubectl(&[
            "get",
            "pods",
            "-l",
            &format!("kubevirt.io/created-by={vmi_uid}"),
            "-o",
            "jsonpath={.items[0].status.podIP}",
        ])
        .expect("the launcher pod's IP");
    let guest_port: SocketAddr = format!("{pod_ip}:8080").parse().expect("pod IP");
    // The guest asks for its address in the background and its listener starts with user-data:
    // the pod's port 8080 answers once masquerade's DNAT, DHCP and the listener are all there.
    let greeting = e2e::greeting(guest_port, Duration::from_mins(3))
        .expect("the guest answers through the masquerade binding");
    assert_eq!(greeting, "hello from the demo VM over the pod network");

    wait_for(
        "the guest's address in status.interfaces",
        Duration::from_mins(2),
        || {
            let vmi = demo(&stack, "vmi")?;
            let iface = &vmi["status"]["interfaces"][0];
            (iface["ipAddress"] == "10.0.2.2" && iface["interfaceName"] == "eth0")
                .then_some(())
                .map(Some)
                .ok_or_else(|| format!("interfaces {}", vmi["status"]["interfaces"]))
        },
    )
    .expect("virt-handler reports the address the guest took by DHCP");

    wait_for("VM status ready", Duration::from_mins(2), || {
        let vm = demo(&stack, "vm")?;
        (vm["status"]["printableStatus"] == "Running" && vm["status"]["ready"] == true)
            .then_some(())
            .map(Some)
            .ok_or_else(|| format!("VM status {}", vm["status"]))
    })
    .expect("the VM reports Running and ready");

    stack
        .kubectl(&[
            "patch",
            "vm",
            "demo",
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"runStrategy":"Halted"}}"#,
        ])
        .expect("halting the VM");
    wait_for("the VMI and its pod to go", BOOT, || {
        let vmi = stack
            .get_json("default", "vmi", "demo")
            .map_err(|e| e.to_string())?;
        let pods = stack.launcher_pods().map_err(|e| e.to_string())?;
        if vmi.is_none() && pods.trim().is_empty() {
            Ok(Some(()))
        } else {
            Err(format!(
                "VMI phase {:?}, pods {pods:?}",
                vmi.map(|v| v["status"]["phase"].clone())
            ))
        }
    })
    .expect("a halted VM's VMI is shut down and deleted");
    let vm = stack
        .get_json("default", "vm", "demo")
        .expect("get vm")
        .expect("the VM stays");
    assert_eq!(vm["status"]["printableStatus"], "Stopped");

    probed_vm_reads_its_config_and_restarts_on_liveness_failure(&stack);
}

/// A VM with KubeVirt's agent probes and a ConfigMap shared through virtiofs: its
/// `guestAgentPing` readiness probe, run by the kubelet as `virt-probe` in the launcher pod,
/// makes the VMI Ready; the guest mounts the ConfigMap by its filesystem's name, served by the
/// pod's `virtiofs-<name>` container; once the guest makes its `exec` liveness probe (run in the
/// guest by the agent) fail, the kubelet kills the compute container, the VMI fails and the VM
/// controller creates a new one (`runStrategy: Always`).
fn probed_vm_reads_its_config_and_restarts_on_liveness_failure(stack: &Stack) {
    stack.apply(&serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "probed-config", "namespace": "default"},
        "data": {"app.conf": "mode=virtiofs-on-the-stack"},
    }));
    let mut vm = stack.demo_vm().expect("the demo VM as JSON");
    vm["metadata"]["name"] = "probed".into();
    vm["metadata"]["labels"]["kubevirt.io/vm"] = "probed".into();
    vm["spec"]["template"]["metadata"]["labels"]["kubevirt.io/vm"] = "probed".into();
    let spec = &mut vm["spec"]["template"]["spec"];
    spec["domain"]["devices"]["filesystems"] =
        serde_json::json!([{"name": "app-config", "virtiofs": {}}]);
    spec["volumes"]
        .as_array_mut()
        .expect("the demo VM's volumes")
        .push(serde_json::json!({"name": "app-config", "configMap": {"name": "probed-config"}}));
    spec["readinessProbe"] = serde_json::json!({"guestAgentPing": {}, "periodSeconds": 2});
    spec["livenessProbe"] = serde_json::json!({
        "exec": {"command": ["/bin/sh", "-c", "test ! -e /tmp/unhealthy"]},
        // The probe runs through the guest agent, which answers only once the guest has
        // booted; KubeVirt's own probe tests give a TCG boot the same two minutes.
        "initialDelaySeconds": 120,
        "periodSeconds": 2,
        "failureThreshold": 2,
    });
    stack.apply(&vm);
    let probed = |stack: &Stack| -> Result<serde_json::Value, String> {
        stack
            .get_json("default", "vmi", "probed")
            .map_err(|e| e.to_string())?
            .ok_or_else(|| {
                let vm = stack.get_json("default", "vm", "probed");
                format!("no VMI yet; the VM: {vm:?}")
            })
    };
    let first = wait_for("the probed VMI to be Ready", BOOT, || {
        let vmi = probed(stack)?;
        if is_ready(&vmi) {
            Ok(Some(vmi))
        } else {
            Err(format!("status {}", vmi["status"]))
        }
    })
    .unwrap_or_else(|e| panic!("{e}; localcluster log in {}", stack.dir().display()));
    let pod = stack
        .kubectl(&[
            "get",
            "pods",
            "-l",
            &format!(
                "kubevirt.io/created-by={}",
                first["metadata"]["uid"].as_str().expect("uid")
            ),
            "-o",
            "jsonpath={.items[0].spec.containers[0].readinessProbe.exec.command}",
        ])
        .expect("the launcher pod");
    assert_eq!(
        pod,
        r#"["virt-probe","--domainName","default_probed","--timeoutSeconds","1","--guestAgentPing"]"#
    );

    // `Console::run` resends a command until the shell answers: bytes written right after the
    // guest's ready marker reach a console whose login shell is not yet started, and are lost.
    let private = stack
        .vmi_private_dir(&first)
        .expect("a Running VMI names its node and launcher pod");
    // The socket's path is longer than a socket address holds: reach it through its directory.
    let socket = isolation::open_socket(&private.join("virt-serial0"))
        .expect("the probed guest's serial console");
    let mut console = testguest::Console::connect(&socket.proc_fd_path());
    assert_eq!(
        console.run(
            "mkdir -p /mnt/cfg && mount -t virtiofs app-config /mnt/cfg && cat /mnt/cfg/app.conf",
            BOOT
        ),
        "mode=virtiofs-on-the-stack"
    );
    // The guest's shell makes the liveness probe fail.
    console.run("touch /tmp/unhealthy", BOOT);

    let first_uid = first["metadata"]["uid"].clone();
    wait_for("a new VMI after the liveness probe failed", BOOT, || {
        let vmi = probed(stack)?;
        if vmi["metadata"]["uid"] == first_uid {
            Err(format!("the first VMI, phase {}", vmi["status"]["phase"]))
        } else {
            Ok(Some(()))
        }
    })
    .unwrap_or_else(|e| panic!("{e}; localcluster log in {}", stack.dir().display()));
}
