//! virt-api and virtctl through the whole stack: kube-apiserver's aggregation layer, virt-api's
//! authorization (SubjectAccessReview) and admission webhooks, virt-handler's console server and
//! the launcher, driven with the `virtctl` binary as a user would.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use e2e::{Stack, bin_dir, wait_for};

const BOOT: Duration = Duration::from_mins(7);
const CHANGE: Duration = Duration::from_mins(3);

fn get(stack: &Stack, resource: &str) -> Result<serde_json::Value, String> {
    stack
        .get_json("default", resource, "demo")
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no {resource} default/demo"))
}

fn vm_status(stack: &Stack) -> Result<String, String> {
    Ok(get(stack, "vm")?["status"]["printableStatus"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

fn wait_vm_status(stack: &Stack, want: &str) {
    wait_for(&format!("the VM to be {want}"), CHANGE, || {
        let s = vm_status(stack)?;
        (s == want)
            .then_some(Some(()))
            .ok_or(format!("VM is {s:?}"))
    })
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The VMI's uid once it runs and its guest agent is connected.
fn running_vmi(stack: &Stack) -> String {
    let vmi = wait_for("the VMI to run with its agent connected", BOOT, || {
        stack.running_with_agent("demo")
    })
    .unwrap_or_else(|e| panic!("{e}"));
    vmi["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// What the guest writes at the start of a hotplugged disk.
const HOTPLUG_MARK: &str = "kubevirt-rs-hotplug";

/// The guest device of the VMI's volume `name`, once virt-handler reports it `Ready`.
fn wait_volume_ready(stack: &Stack, name: &str) -> String {
    wait_for(
        &format!("the hotplugged volume {name} Ready"),
        CHANGE,
        || {
            let vmi = get(stack, "vmi")?;
            let entry = vmi["status"]["volumeStatus"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|v| v["name"] == name)
                .cloned()
                .unwrap_or_default();
            match (entry["phase"].as_str(), entry["target"].as_str()) {
                (Some("Ready"), Some(t)) if !t.is_empty() => Ok(Some(t.to_owned())),
                _ => Err(format!("{entry}")),
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The disk image in the claim's volume on this machine (localcluster's volumes are host
/// directories).
fn claim_image(stack: &Stack, claim: &str) -> PathBuf {
    let pv = stack
        .kubectl(&["get", "pvc", claim, "-o", "jsonpath={.spec.volumeName}"])
        .unwrap_or_else(|e| panic!("{e}"));
    let dir = stack
        .kubectl(&["get", "pv", &pv, "-o", "jsonpath={.spec.hostPath.path}"])
        .unwrap_or_else(|e| panic!("{e}"));
    PathBuf::from(dir).join("disk.img")
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A kubeconfig for the service account `viewer`, bound to Kubernetes' `view` role only.
fn viewer_kubeconfig(stack: &Stack) -> PathBuf {
    stack
        .kubectl(&["create", "serviceaccount", "viewer"])
        .expect("service account");
    stack
        .kubectl(&[
            "create",
            "rolebinding",
            "viewer",
            "--clusterrole=view",
            "--serviceaccount=default:viewer",
        ])
        .expect("role binding");
    let token = stack
        .kubectl(&["create", "token", "viewer"])
        .expect("a token for viewer");
    let path = stack.dir().join("viewer.kubeconfig");
    std::fs::copy(stack.kubeconfig(), &path).expect("copy the kubeconfig");
    let p = path.display().to_string();
    for args in [
        vec![
            "config",
            "set-credentials",
            "viewer",
            "--token",
            token.trim(),
        ],
        vec!["config", "set-context", "--current", "--user", "viewer"],
    ] {
        let out = Command::new("kubectl")
            .args(["--kubeconfig", &p])
            .args(&args)
            .output()
            .expect("kubectl config");
        assert!(out.status.success(), "{out:?}");
    }
    path
}

fn admission(stack: &Stack) {
    let bad = serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "bad", "namespace": "default"},
        "spec": {"domain": {"devices": {"disks": [{"name": "nope", "disk": {}}]},
                 "memory": {"guest": "64Mi"}}}
    });
    let e = stack
        .kubectl_with_input(&["apply", "-f", "-"], &bad.to_string())
        .expect_err("an invalid VMI is refused");
    let e = e.to_string();
    assert!(
        e.contains("is invalid") && e.contains("spec.domain.devices.disks[0].name"),
        "the refusal names the field: {e}"
    );
    assert!(
        stack.get_json("default", "vmi", "bad").unwrap().is_none(),
        "nothing stored"
    );

    let minimal = serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "minimal", "namespace": "default"},
        "spec": {"domain": {"devices": {"disks": [{"name": "data", "disk": {}}]},
                 "memory": {"guest": "64Mi"}},
                 "volumes": [{"name": "data", "emptyDisk": {"capacity": "16Mi"}}]}
    });
    stack
        .kubectl_with_input(&["create", "-f", "-"], &minimal.to_string())
        .expect("a minimal VMI is accepted");
    let stored = stack
        .get_json("default", "vmi", "minimal")
        .unwrap()
        .expect("stored");
    let spec = &stored["spec"];
    assert_eq!(spec["domain"]["devices"]["disks"][0]["disk"]["bus"], "sata");
    assert_eq!(spec["domain"]["machine"]["type"], "q35");
    assert_eq!(
        spec["domain"]["devices"]["interfaces"][0]["name"],
        "default"
    );
    assert_eq!(spec["networks"][0]["pod"], serde_json::json!({}));
    assert!(
        stored["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f
                .iter()
                .any(|f| f == "kubevirt.io/foregroundDeleteVirtualMachine")),
        "{stored:#}"
    );
    stack
        .kubectl(&["delete", "vmi", "minimal", "--wait=false"])
        .expect("delete");
}

/// `virtctl create vm --instancetype --preference`, as users pipe it to kubectl: virt-api
/// admits the manifest and virt-controller resolves both (snapshots them into revisions). The VM
/// stays halted: what runs from an instance type is the controller's cluster test's part.
fn create_vm_with_an_instancetype(stack: &Stack) {
    stack.apply(&serde_json::json!({
        "apiVersion": "instancetype.kubevirt.io/v1beta1",
        "kind": "VirtualMachineClusterInstancetype",
        "metadata": {"name": "tiny"},
        "spec": {"cpu": {"guest": 1}, "memory": {"guest": "64Mi"}}
    }));
    stack.apply(&serde_json::json!({
        "apiVersion": "instancetype.kubevirt.io/v1beta1",
        "kind": "VirtualMachinePreference",
        "metadata": {"name": "virtio-disks", "namespace": "default"},
        "spec": {"devices": {"preferredDiskBus": "virtio"}}
    }));
    let manifest = stack
        .virtctl(&[
            "create",
            "vm",
            "--name",
            "typed",
            "--run-strategy",
            "Halted",
            "--instancetype",
            "tiny",
            "--preference",
            "virtualmachinepreference/virtio-disks",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    stack
        .kubectl_with_input(&["create", "-f", "-"], &manifest)
        .unwrap_or_else(|e| panic!("kubectl create of\n{manifest}\n{e}"));
    let status = wait_for(
        "the VM's instance type and preference resolved",
        CHANGE,
        || {
            let vm = stack
                .get_json("default", "vm", "typed")
                .map_err(|e| e.to_string())?
                .ok_or("no VM yet")?;
            let status = vm["status"].clone();
            let resolved = |r: &str| status[r]["controllerRevisionRef"]["name"].is_string();
            if resolved("instancetypeRef") && resolved("preferenceRef") {
                Ok(Some(status))
            } else {
                Err(format!("status: {status}"))
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    // The kinds as the matchers spell them: none for the cluster kind, as KubeVirt's status.
    assert_eq!(status["instancetypeRef"]["name"], "tiny", "{status:#}");
    assert!(status["instancetypeRef"]["kind"].is_null(), "{status:#}");
    assert_eq!(
        status["preferenceRef"]["kind"], "virtualmachinepreference",
        "{status:#}"
    );
    stack
        .kubectl(&["delete", "vm", "typed"])
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn guest_virtctl_reaches_the_vm_through_virt_api() {
    let stack = Stack::up().expect("the stack comes up");
    let kubeconfig = stack.kubeconfig();
    admission(&stack);
    create_vm_with_an_instancetype(&stack);

    // The demo VM, with a fresh key authorised for root by its cloud-init user-data and port 22
    // open.
    let key = stack.dir().join("id_ed25519");
    let keygen = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .output()
        .expect("ssh-keygen runs (hack/deps.sh installs openssh-client)");
    assert!(keygen.status.success(), "{keygen:?}");
    let public = std::fs::read_to_string(key.with_extension("pub")).expect("the public key");
    let mut vm = stack.demo_vm().expect("the demo VM as JSON");
    let user_data =
        &mut vm["spec"]["template"]["spec"]["volumes"][0]["cloudInitNoCloud"]["userData"];
    let script = user_data.as_str().expect("the demo's user-data").to_owned();
    let (shebang, rest) = script.split_once('\n').expect("a script");
    *user_data = format!(
        "{shebang}\nmkdir -m 700 -p /root/.ssh\necho '{}' > /root/.ssh/authorized_keys\nchmod 600 /root/.ssh/authorized_keys\n{rest}",
        public.trim()
    )
    .into();
    // Masquerade forwards only the declared ports when any are declared, as KubeVirt's does.
    vm["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"][0]["ports"]
        .as_array_mut()
        .expect("the demo declares its ports")
        .push(serde_json::json!({"port": 22}));
    stack
        .kubectl_with_input(&["apply", "-f", "-"], &vm.to_string())
        .expect("kubectl apply of the VM");
    let first_uid = running_vmi(&stack);

    // The serial console in a terminal: the guest's shell answers a command.
    e2e::console_round_trip(&stack, "demo", "virtctl").unwrap_or_else(|e| panic!("{e}"));

    // A VNC screenshot of the guest's screen.
    let shot = stack.dir().join("screen.png");
    stack
        .virtctl(&[
            "vnc",
            "screenshot",
            "demo",
            "--file",
            &shot.display().to_string(),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&shot).expect("the PNG"),
    ));
    let mut reader = decoder.read_info().expect("a PNG header");
    let mut pixels = vec![0; reader.output_buffer_size().expect("a buffer size")];
    let frame = reader.next_frame(&mut pixels).expect("a decodable frame");
    assert!(frame.width >= 640 && frame.height >= 400, "{frame:?}");
    assert!(
        pixels[..frame.buffer_size()].iter().any(|&b| b != 0),
        "the guest's text console is not a black screen"
    );

    // What the guest agent reports.
    let info: serde_json::Value = serde_json::from_str(
        &stack
            .virtctl(&["guestosinfo", "demo"])
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .unwrap();
    assert_eq!(info["os"]["id"], "kubevirt-rs-guest", "{info:#}");
    assert_eq!(info["hostname"], "demo", "{info:#}");
    assert!(
        info["timezone"]
            .as_str()
            .is_some_and(|t| t.ends_with(", 0")),
        "the guest runs on UTC: {info:#}"
    );

    // Port-forward: a local port reaches the guest's listener through virt-api and virt-handler.
    let loopback = std::net::Ipv4Addr::LOCALHOST.into();
    let local_port = localcluster::ports::free_port(loopback).expect("a free local port");
    let mut forward = KillOnDrop(
        Command::new(bin_dir().join("virtctl"))
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["port-forward", "vm/demo", &format!("{local_port}:8080")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("virtctl port-forward starts"),
    );
    let greeting = e2e::greeting(std::net::SocketAddr::new(loopback, local_port), CHANGE)
        .unwrap_or_else(|e| {
            let exited = forward.0.try_wait().ok().flatten();
            panic!("{e}; virtctl port-forward exited: {exited:?}")
        });
    assert_eq!(greeting, "hello from the demo VM over the pod network");
    drop(forward);

    // ssh and scp through port-forward, with the system's OpenSSH client. The guest's host key
    // is new on every boot.
    let ssh_opts = [
        "-i",
        key.to_str().expect("a UTF-8 path"),
        "-t",
        "-o StrictHostKeyChecking=no",
        "-t",
        "-o UserKnownHostsFile=/dev/null",
    ];
    let mut ssh = vec![
        "ssh",
        "root@vmi/demo",
        "-c",
        "echo ssh-$((6*7)) $(hostname)",
    ];
    ssh.extend(ssh_opts);
    let said = stack.virtctl(&ssh).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(said.trim(), "ssh-42 demo");
    let sent = stack.dir().join("sent.txt");
    std::fs::write(&sent, "through virtctl scp\n").expect("write");
    let back = stack.dir().join("back.txt");
    for (from, to) in [
        (
            sent.display().to_string(),
            "root@vmi/demo:/tmp/copy.txt".to_owned(),
        ),
        (
            "root@vmi/demo:/tmp/copy.txt".to_owned(),
            back.display().to_string(),
        ),
    ] {
        let mut scp = vec!["scp", from.as_str(), to.as_str()];
        scp.extend(ssh_opts);
        stack.virtctl(&scp).unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(
        std::fs::read_to_string(&back).expect("the copy came back"),
        "through virtctl scp\n"
    );

    // Hotplug: a blank claim added to the running VM (and to its spec: KubeVirt's declarative
    // hotplug), seen and written by the guest, its data on the claim's volume.
    // A command over ssh; after a reboot the guest's sshd starts a little after its agent, so
    // the first answer is waited for.
    let guest = |command: &str| {
        let mut args = vec!["ssh", "root@vmi/demo", "-c", command];
        args.extend(ssh_opts);
        wait_for("the guest's sshd to answer", CHANGE, || {
            stack.virtctl(&args).map(Some).map_err(|e| e.to_string())
        })
        .unwrap_or_else(|e| panic!("{e}"))
    };
    stack.apply(&serde_json::json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "64Mi"}}},
    }));
    let said = stack
        .virtctl(&["addvolume", "demo", "--volume-name=data"])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        said.trim(),
        "Successfully submitted add volume request to VM demo for volume data"
    );
    let disk = wait_volume_ready(&stack, "data");
    let template = &get(&stack, "vm").unwrap()["spec"]["template"]["spec"];
    assert!(
        template["volumes"].as_array().unwrap().iter().any(|v| v
            == &serde_json::json!({"name": "data", "persistentVolumeClaim": {"claimName": "data", "hotpluggable": true}})),
        "the volume is in the VM's spec: {template}"
    );
    // 64Mi less CDI's 5.5 % filesystem overhead, in whole MiB: 60 MiB of 512-byte sectors.
    let said = guest(&format!(
        "cat /sys/block/{disk}/size; printf {HOTPLUG_MARK} | dd of=/dev/{disk} conv=fsync 2>/dev/null"
    ));
    assert_eq!(said.trim(), "122880", "the guest sees the disk");
    let image = claim_image(&stack, "data");
    let written = std::fs::read(&image).unwrap_or_else(|e| panic!("{}: {e}", image.display()));
    assert!(
        written.starts_with(HOTPLUG_MARK.as_bytes()),
        "the guest's write reached {}",
        image.display()
    );

    // A block claim hotplugged too: a local volume on a loop device of the VM's node, a
    // device node in the launcher (virt-handler makes it from the kubelet's record of the
    // attachment pod), written by the guest straight to the device.
    let node = get(&stack, "vmi").unwrap()["status"]["nodeName"]
        .as_str()
        .expect("the VMI's node")
        .to_owned();
    let device = localcluster::storage::LoopDevice::new(32 << 20).expect("a loop device");
    let volume =
        localcluster::storage::local_block_volume("raw-demo", "raw", "32Mi", &device.path, &node);
    stack.apply(&serde_json::to_value(volume).unwrap());
    stack.apply(&serde_json::json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "raw", "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block", "storageClassName": "raw",
                 "resources": {"requests": {"storage": "32Mi"}}},
    }));
    stack
        .virtctl(&["addvolume", "demo", "--volume-name=raw"])
        .unwrap_or_else(|e| panic!("{e}"));
    let raw_disk = wait_volume_ready(&stack, "raw");
    let said = guest(&format!(
        "cat /sys/block/{raw_disk}/size; printf {HOTPLUG_MARK} | dd of=/dev/{raw_disk} conv=fsync 2>/dev/null"
    ));
    assert_eq!(said.trim(), "65536", "the guest sees the whole device");
    let written = std::fs::read(device.backing_file()).unwrap();
    assert!(
        written.starts_with(HOTPLUG_MARK.as_bytes()),
        "the guest's write reached {}",
        device.path
    );

    // Authorization is the API server's: `view` may read guest info but not attach.
    let viewer = viewer_kubeconfig(&stack);
    let said = stack
        .virtctl_as(&viewer, &["console", "demo", "--timeout", "0"])
        .expect_err("a view-only user is refused the console")
        .to_string();
    assert!(
        said.contains("403") && said.contains("virtualmachineinstances/console"),
        "{said}"
    );
    stack
        .virtctl_as(&viewer, &["guestosinfo", "demo"])
        .unwrap_or_else(|e| panic!("{e}"));

    // Pause and unpause, as `kubectl get` shows them.
    stack
        .virtctl(&["pause", "vm", "demo"])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_vm_status(&stack, "Paused");
    stack
        .virtctl(&["unpause", "vm", "demo"])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_vm_status(&stack, "Running");

    // Restart replaces the VMI; stop halts the VM; start brings it back.
    stack
        .virtctl(&["restart", "demo"])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for("a new VMI after restart", BOOT, || {
        let vmi = get(&stack, "vmi")?;
        let uid = vmi["metadata"]["uid"].as_str().unwrap_or_default();
        (uid != first_uid && vmi["status"]["phase"] == "Running")
            .then_some(Some(()))
            .ok_or(format!("VMI {uid} {}", vmi["status"]["phase"]))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // The new VMI gets the hotplugged volumes again, with their data; then they are removed.
    let disk = wait_volume_ready(&stack, "data");
    let raw_disk = wait_volume_ready(&stack, "raw");
    running_vmi(&stack);
    for d in [&disk, &raw_disk] {
        assert_eq!(
            guest(&format!("head -c {} /dev/{d}", HOTPLUG_MARK.len())).trim(),
            HOTPLUG_MARK
        );
    }
    let said = stack
        .virtctl(&["removevolume", "demo", "--volume-name=data"])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        said.trim(),
        "Successfully submitted remove volume request to VM demo for volume data"
    );
    stack
        .virtctl(&["removevolume", "demo", "--volume-name=raw"])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for("the volumes and their attachment pods gone", CHANGE, || {
        let vmi = get(&stack, "vmi")?;
        let entries = vmi["status"]["volumeStatus"].to_string();
        let pods = stack
            .kubectl(&[
                "get",
                "pods",
                "-l",
                "kubevirt.io=hotplug-disk",
                "-o",
                "name",
            ])
            .map_err(|e| e.to_string())?;
        (!entries.contains("\"data\"") && !entries.contains("\"raw\"") && pods.trim().is_empty())
            .then_some(Some(()))
            .ok_or(format!("volumeStatus {entries}; attachment pods {pods:?}"))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let left = guest("ls /sys/block");
    assert!(
        !left.split_whitespace().any(|d| d == disk || d == raw_disk),
        "the guest no longer has {disk} and {raw_disk}: {left}"
    );
    stack
        .virtctl(&["stop", "demo"])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_vm_status(&stack, "Stopped");
    assert_eq!(get(&stack, "vm").unwrap()["spec"]["runStrategy"], "Halted");
    let again = stack
        .virtctl(&["stop", "demo"])
        .expect_err("stopping a stopped VM is refused")
        .to_string();
    assert!(again.contains("VM is not running"), "{again}");
    stack
        .virtctl(&["start", "demo"])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_vm_status(&stack, "Running");
}
