//! Real guests under the launcher (TCG here). Each test boots one guest and checks as much as
//! that boot allows, to keep the number of boots small.

#![allow(clippy::many_single_char_names)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{BOOT, Launcher, uid, vmi, wait_until};
use serde_json::{Value, json};
use testguest::Console;

fn serials(console: &mut Console) -> String {
    console.run("cat /sys/block/*/serial 2>/dev/null | tr '\\n' ' '", BOOT)
}

/// q35, kernel boot, every local volume kind, a disk at a PCI address off the root bus, a
/// ConfigMap disk read in the guest, NoCloud user-data from a Secret, the agent, virt-probe, the
/// console, pause / unpause, a refused foreign sync, disk hotplug and unplug, ACPI shutdown.
#[test]
fn guest_q35_kernel_boot_volumes_nocloud_hotplug_shutdown() {
    let mut l = Launcher::start_with(&["--grace-period-seconds", "120"], |root| {
        common::place_kernel(root);
        common::place_container_disk(root, 2);
        // What the pod's kubelet writes for a ConfigMap volume and for the cloud-init Secret's
        // keys (the key it lacks, `userdata`, is an empty directory under `subPath`).
        let cm = root.join("private/config-map/cfg");
        std::fs::create_dir_all(&cm).unwrap();
        std::fs::write(cm.join("app.conf"), "mode=fast\n").unwrap();
        let secret = root.join("private/secret/ci");
        std::fs::create_dir_all(secret.join("userdata")).unwrap();
        std::fs::write(
            secret.join("userData"),
            "#!/bin/sh\necho NOCLOUD-''SECRET-USERDATA-RAN > /dev/ttyS0\n",
        )
        .unwrap();
    });
    let id = uid();
    let host_img = l.dir("hostdisks/host.img");
    let hot_img = l.dir("hostdisks/hot.img");
    let mut spec = json!({
        "domain": {
            "machine": {"type": "q35"},
            "cpu": {"features": [{"name": "pdpe1gb", "policy": "disable"}, {"name": "smep"}],
                    "sockets": 1, "maxSockets": 2},
            "memory": {"guest": "256Mi", "maxGuest": "1Gi"},
            "resources": {"requests": {"memory": "256Mi"}},
            "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                "image": "guest", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}},
            "devices": {"disks": [
                {"name": "scratch", "disk": {"bus": "virtio"}, "serial": "EMPTY1"},
                // Off the root bus: libvirt's root ports 1-3, the disk behind the third.
                {"name": "host", "disk": {"bus": "virtio", "pciAddress": "0000:03:00.0"}, "serial": "HOST1"},
                {"name": "cdisk", "disk": {"bus": "virtio"}, "serial": "CDISK1"},
                {"name": "ci", "disk": {"bus": "virtio"}},
                {"name": "cfg", "disk": {"bus": "virtio"}},
            ]},
        },
        "volumes": [
            {"name": "scratch", "emptyDisk": {"capacity": "64Mi"}},
            {"name": "host", "hostDisk": {"path": host_img, "type": "DiskOrCreate", "capacity": "32Mi"}},
            {"name": "cdisk", "containerDisk": {"image": "guest"}},
            {"name": "ci", "cloudInitNoCloud": {"secretRef": {"name": "userdata"}}},
            {"name": "cfg", "configMap": {"name": "app", "volumeLabel": "appcfg"}},
        ],
    });
    let v = vmi("q35", &id, spec.clone());
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", l.log());
    assert_eq!(d["state"], "Running");
    assert_eq!(d["accelerator"], "tcg");
    let pid = d["qemuPid"].as_i64().unwrap();
    assert!(!d["vcpuThreads"].as_array().unwrap().is_empty());

    // Idempotent: the same VMI again changes nothing.
    let (status, again) = l.sync(&v);
    assert_eq!(status, 200);
    assert_eq!(again["qemuPid"], pid);
    // A different VMI is refused, and the running guest is not touched.
    let (status, e) = l.sync(&vmi("other", &uid(), spec.clone()));
    assert_eq!(status, 409, "{e}");
    assert_eq!(e["code"], "UIDMismatch");
    assert_eq!(l.domain()["state"], "Running");

    // The overlay sits in the ephemeral dir over the container disk.
    assert!(l.dir("ephemeral/disk-data/cdisk/disk.qcow2").exists());
    assert!(host_img.exists(), "DiskOrCreate made the host disk");

    l.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    let log = l.serial_log(&id);
    assert!(
        log.contains("Linux version"),
        "the boot banner is in the log"
    );
    assert!(
        log.contains("NOCLOUD-SECRET-USERDATA-RAN"),
        "user-data from the Secret ran: {log}"
    );

    l.wait_agent();
    let os = l.get("/v1/guest/osinfo");
    assert!(
        os["kernel-release"].as_str().unwrap().contains("amd64"),
        "{os}"
    );
    let info = l.get("/v1/guest/info");
    assert!(info["version"].is_string(), "{info}");
    virt_probe_asks_the_guest(&l.socket);

    let mut console = Console::connect(&l.vm_dir(&id).join("virt-serial0"));
    let s = serials(&mut console);
    for want in ["EMPTY1", "HOST1", "CDISK1"] {
        assert!(s.contains(want), "{want} not in guest serials {s:?}");
    }
    assert_eq!(console.run("echo $((6*7))", BOOT), "42");
    // The pciAddress off the root bus is where the guest finds the disk: a modern virtio-blk
    // (1af4:1042) at 0000:03:00.0, with the host disk's serial.
    let dev = "/sys/bus/pci/devices/0000:03:00.0";
    assert_eq!(
        console.run(
            &format!("echo $(cat {dev}/vendor {dev}/device {dev}/virtio*/block/*/serial)"),
            BOOT
        ),
        "0x1af4 0x1042 HOST1"
    );
    // maxSockets: a second socket the guest may bring online, not present at start.
    assert_eq!(
        console.run(
            "echo $(cat /sys/devices/system/cpu/possible /sys/devices/system/cpu/online)",
            BOOT
        ),
        "0-1 0"
    );
    // maxGuest: the firmware's memory map has the hotplug range, 1Gi - 256Mi above 4 GiB.
    assert_eq!(
        console.run("dmesg | grep -o 'mem [x0-9a-f-]*. hotplug'", BOOT),
        "mem 0x100000000-0x12fffffff] hotplug"
    );
    // cpu.features: the disabled flag is gone from the guest's CPU (TCG's `max` has it), the
    // required one is there.
    let flags = console.run("grep -m1 '^flags' /proc/cpuinfo", BOOT);
    let flags: Vec<&str> = flags.split_whitespace().collect();
    assert!(
        flags.contains(&"smep") && !flags.contains(&"pdpe1gb"),
        "{flags:?}"
    );
    // The ConfigMap's key, from its disk found by the volume's label.
    assert_eq!(
        console.run(
            "mkdir -p /mnt/cfg && mount -o ro $(findfs LABEL=appcfg) /mnt/cfg && cat /mnt/cfg/app.conf",
            BOOT
        ),
        "mode=fast"
    );

    let p = l.post("/v1/pause");
    assert_eq!(p["state"], "Paused");
    assert_eq!(p["reason"], "User");
    let p = l.post("/v1/unpause");
    assert_eq!(p["state"], "Running");
    assert_eq!(console.run("echo alive", BOOT), "alive");

    // Hotplug a disk, see it in the guest, unplug it, see it go.
    spec["domain"]["devices"]["disks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "hot", "disk": {"bus": "virtio"}, "serial": "HOT1"}));
    spec["volumes"].as_array_mut().unwrap().push(
        json!({"name": "hot", "hostDisk": {"path": hot_img, "type": "DiskOrCreate", "capacity": "16Mi"}}),
    );
    let (status, d) = l.sync(&vmi("q35", &id, spec.clone()));
    assert_eq!(status, 200, "{d}\n{}", l.log());
    assert!(
        d["disks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["name"] == "hot" && x["hotplugged"] == true)
    );
    wait_until(BOOT, "HOT1 in the guest", || {
        serials(&mut console).contains("HOT1").then_some(())
    });
    spec["domain"]["devices"]["disks"]
        .as_array_mut()
        .unwrap()
        .pop();
    spec["volumes"].as_array_mut().unwrap().pop();
    let (status, d) = l.sync(&vmi("q35", &id, spec));
    assert_eq!(status, 200, "{d}\n{}", l.log());
    assert!(
        !d["disks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["name"] == "hot")
    );
    wait_until(BOOT, "HOT1 gone from the guest", || {
        (!serials(&mut console).contains("HOT1")).then_some(())
    });

    // ACPI power button: the guest powers off, the domain is Shutoff, the launcher exits.
    // Watched rather than polled: the launcher exits as soon as the domain is final.
    let watch = common::Watch::open(&l.socket, BOOT);
    let watcher =
        std::thread::spawn(move || watch.until(BOOT, |d: &Value| d["state"] == "Shutoff"));
    l.post("/v1/shutdown");
    let lines = watcher.join().unwrap();
    let d = lines.last().unwrap();
    assert_eq!(d["reason"], "Shutdown", "{d}");
    let status = l.wait_exit(Duration::from_secs(30));
    assert!(status.success());
    assert!(!common::process_alive(pid));
}

/// virt-probe as the kubelet runs it for a VMI's `exec` and `guestAgentPing` probes (the pod
/// renders them with `--domainName default_q35`), and the exit codes KubeVirt's has.
fn virt_probe_asks_the_guest(socket: &Path) {
    let probe = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_virt-probe"))
            .arg("--socket")
            .arg(socket)
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let ours = ["--domainName", "default_q35", "--timeoutSeconds", "5"];
    let (code, _, err) = probe(&[&ours[..], &["--guestAgentPing"]].concat());
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = probe(
        &[
            &ours[..],
            &["--command", "/bin/sh", "--", "-c", "echo probed; exit 3"],
        ]
        .concat(),
    );
    assert_eq!((code, out.as_str()), (Some(3), "probed\n\n"), "{err}");
    let (code, _, err) = probe(&[&ours[..], &["--command", "true"]].concat());
    assert_eq!(code, Some(0), "{err}");
    // A command that does not end within the timeout fails the probe as KubeVirt's (-1).
    let (code, _, err) = probe(&[
        "--domainName",
        "default_q35",
        "--timeoutSeconds",
        "1",
        "--command",
        "/bin/sleep",
        "--",
        "30",
    ]);
    assert_eq!(code, Some(255), "{err}");
    assert!(err.contains("did not exit within"), "{err}");
    // A probe rendered for another VMI is refused, not answered for this one.
    let (code, _, err) = probe(&["--domainName", "default_other", "--guestAgentPing"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("this launcher runs \"default_q35\""), "{err}");
}

/// pc (i440fx), BIOS boot from a containerDisk, ConfigDrive user-data, the agent, the
/// console, freeze and thaw of an ext4 data disk; then QEMU is killed behind the launcher's
/// back and the domain is Crashed.
#[test]
fn guest_pc_bios_disk_boot_configdrive_crash() {
    let l = Launcher::start_with(&["--keep-after-shutdown"], |root| {
        common::place_container_disk(root, 0);
        std::fs::create_dir(root.join("hostdisks")).unwrap();
        testguest::freezable_disk(&root.join("hostdisks/data.img"));
    });
    let data_img = l.dir("hostdisks/data.img");
    let id = uid();
    let v = vmi(
        "pc",
        &id,
        json!({
            "domain": {
                "machine": {"type": "pc"},
                "firmware": {"bootloader": {"bios": {"useSerial": true}}},
                "resources": {"requests": {"memory": "256Mi"}},
                "devices": {"disks": [
                    {"name": "root", "disk": {"bus": "virtio"}, "bootOrder": 1},
                    {"name": "ci", "disk": {"bus": "sata"}},
                    {"name": "data", "disk": {"bus": "virtio"}},
                ]},
            },
            "volumes": [
                {"name": "root", "containerDisk": {"image": "guest"}},
                {"name": "ci", "cloudInitConfigDrive": {"userData": "#!/bin/sh\necho CONFIGDRIVE-''USERDATA-RAN > /dev/ttyS0\n"}},
                {"name": "data", "hostDisk": {"path": data_img, "type": "Disk"}},
            ],
        }),
    );
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", l.log());
    let pid = d["qemuPid"].as_i64().unwrap();
    l.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    assert!(l.serial_log(&id).contains("CONFIGDRIVE-USERDATA-RAN"));
    // `bios.useSerial`: SeaBIOS drew its screen on the serial console too.
    assert!(
        l.serial_log(&id).contains("SeaBIOS"),
        "{}",
        l.serial_log(&id)
    );
    // The guest booted from `root`, read its user-data from `ci` and mounted `data`: all
    // three were read.
    let stats = l.get("/v1/domain/blockstats");
    let disks = stats.as_array().unwrap_or_else(|| panic!("{stats}"));
    assert_eq!(
        disks.iter().map(|d| d["name"].as_str()).collect::<Vec<_>>(),
        [Some("root"), Some("ci"), Some("data")],
        "{stats}"
    );
    for d in disks {
        assert!(d["readBytes"].as_u64() > Some(0), "{stats}");
        assert!(d["readOps"].as_u64() > Some(0), "{stats}");
    }
    // The VGA display as a PNG: the signature, then the IHDR chunk with a real size.
    for method in ["GET", "POST"] {
        let (status, png) = common::http_bytes(&l.socket, method, "/v1/screendump", None);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&png));
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[12..16], b"IHDR");
        let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
        let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
        assert!(width >= 320 && height >= 200, "{width}x{height}");
    }
    assert!(!l.vm_dir(&id).join("screendump.png").exists());
    l.wait_agent();
    let users = l.get("/v1/guest/users");
    assert!(users.is_array(), "{users}");
    let fs = l.get("/v1/guest/filesystems");
    assert!(fs.is_array(), "{fs}");
    let mut console = Console::connect(&l.vm_dir(&id).join("virt-serial0"));
    assert!(
        console
            .run("cat /proc/cmdline", BOOT)
            .contains("console=ttyS0")
    );
    assert!(
        console
            .run("grep ' /mnt/data ext4 ' /proc/mounts", BOOT)
            .starts_with("/dev/vd"),
        "the guest mounted its ext4 data disk"
    );
    // The agent poller reports the guest thawed before anyone froze it; a freeze and a thaw
    // show in the domain as soon as they return (polled all the same: TCG is slow).
    wait_until(Duration::from_mins(1), "fsFreezeStatus thawed", || {
        (l.domain()["fsFreezeStatus"] == "thawed").then_some(())
    });
    let f = l.post("/v1/freeze");
    // The ext4 data disk is the guest's one file system that can be frozen.
    assert_eq!(f["frozenFilesystems"], 1, "{f}");
    wait_until(BOOT, "fsFreezeStatus frozen", || {
        (l.domain()["fsFreezeStatus"] == "frozen").then_some(())
    });
    let f = l.post("/v1/unfreeze");
    assert_eq!(f["thawedFilesystems"], 1, "{f}");
    wait_until(BOOT, "fsFreezeStatus thawed after the thaw", || {
        (l.domain()["fsFreezeStatus"] == "thawed").then_some(())
    });
    // Thawed for real: the guest writes to the disk again.
    assert_eq!(
        console.run(
            "echo written > /mnt/data/f && sync && cat /mnt/data/f",
            BOOT
        ),
        "written"
    );

    // Soft reboot through the agent: the guest kernel restarts the machine, in the same QEMU
    // (a second full boot is not waited for; it would double this test's time).
    l.post("/v1/softreboot");
    l.wait_console(&id, "reboot: Restarting system");
    assert_eq!(l.domain()["qemuPid"], pid);
    assert_eq!(l.domain()["state"], "Running");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let d = l.wait_state("Crashed", Duration::from_secs(30));
    assert!(d["message"].as_str().unwrap().contains("SIGKILL"), "{d}");
    assert!(
        d.get("fsFreezeStatus").is_none(),
        "no agent, no freeze status: {d}"
    );
    // A crashed domain stays crashed: lifecycle calls say why they cannot act.
    let (status, e) = l.request("POST", "/v1/pause", None);
    assert_eq!(status, 409, "{e}");
    assert_eq!(e["code"], "WrongState");
    let (status, e) = l.request("GET", "/v1/domain/blockstats", None);
    assert_eq!(status, 409, "{e}");
    assert_eq!(e["code"], "WrongState");
}

/// q35 with EFI (OVMF, secure boot off) booting the containerDisk, started paused
/// (`startStrategy: Paused`): nothing runs, not even the firmware, until the unpause; SIGTERM
/// to the launcher powers the guest down gracefully and leaves no process behind.
/// Dedicated CPUs with an isolated emulator thread: the launcher runs on two CPUs (as the
/// kubelet's static CPU manager would give its container), and before the first instruction
/// the vCPU thread is pinned to the first, every other QEMU thread to the second.
/// Persistent EFI variables (`efi.persistent`): the store is `<nvram dir>/<vmi name>_VARS.fd`,
/// OVMF's writes during the boot are in it, and the next launcher (the VM's next pod, with the
/// same backend-storage claim) hands QEMU that file as it was, not a fresh template copy.
#[test]
fn guest_q35_efi_paused_start_pinned_disk_boot_sigterm() {
    let cpus = common::restrict_to_two_cpus();
    let nvram = tempfile::tempdir().unwrap();
    let nvram_dir = nvram.path().to_str().unwrap();
    let mut l = Launcher::start_with(
        &["--grace-period-seconds", "120", "--nvram-dir", nvram_dir],
        |root| common::place_container_disk(root, 0),
    );
    let id = uid();
    let v = vmi(
        "efi",
        &id,
        json!({
            "domain": {
                "cpu": {"cores": 1, "dedicatedCpuPlacement": true, "isolateEmulatorThread": true},
                // GRUB 2.06 under OVMF runs out of memory loading the guest at 256Mi.
                "resources": {"requests": {"memory": "512Mi"}, "limits": {"memory": "512Mi"}},
                "firmware": {"bootloader": {"efi": {"secureBoot": false, "persistent": true}}},
                "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}, "bootOrder": 1}]},
            },
            "startStrategy": "Paused",
            "volumes": [{"name": "root", "containerDisk": {"image": "guest"}}],
        }),
    );
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", l.log());
    let pid = d["qemuPid"].as_i64().unwrap();
    let vars = nvram.path().join("efi_VARS.fd");
    let template = std::fs::read("/usr/share/OVMF/OVMF_VARS_4M.fd").unwrap();
    assert_eq!(std::fs::read(&vars).unwrap(), template, "a fresh store");
    let vcpu = d["vcpuThreads"][0].as_i64().unwrap();
    let allowed = |tid: &str| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_owned()
    };
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let tid = task.unwrap().file_name().into_string().unwrap();
        let want = if tid == vcpu.to_string() {
            cpus[0]
        } else {
            cpus[1]
        };
        assert_eq!(allowed(&tid), want.to_string(), "QEMU thread {tid}");
    }
    // Paused as the user's pause (the VMI shows PausedByUser), and still so later: QEMU sent
    // no RESUME, which would have made it Running.
    assert_eq!(
        (&d["state"], &d["reason"]),
        (&json!("Paused"), &json!("User")),
        "{d}"
    );
    let d = l.domain();
    assert_eq!(
        (&d["state"], &d["reason"]),
        (&json!("Paused"), &json!("User")),
        "{d}"
    );
    let d = l.post("/v1/unpause");
    assert_eq!(d["state"], "Running", "{d}");
    l.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    l.wait_agent();
    assert!(l.get("/v1/guest/osinfo")["id"].is_string());

    // The watch stream starts with the current state.
    let watch = common::Watch::open(&l.socket, BOOT);
    let watcher =
        std::thread::spawn(move || watch.until(BOOT, |d: &Value| d["state"] == "Shutoff"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(l.pid()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = l.wait_exit(BOOT);
    assert!(status.success(), "{}", l.log());
    let lines = watcher.join().unwrap();
    assert_eq!(lines[0]["state"], "Running", "{lines:?}");
    let last = lines.last().unwrap();
    assert_eq!(
        last["reason"],
        "Shutdown",
        "graceful path: {last}\n{}",
        l.log()
    );
    assert!(!common::process_alive(pid), "QEMU left behind");
    assert!(!l.socket.exists(), "the command socket is removed on exit");

    // OVMF wrote its variables (boot options, its monotonic counter) during the boot.
    let written = std::fs::read(&vars).unwrap();
    assert_ne!(written, template, "OVMF wrote no variable");
    let next = Launcher::start_with(&["--nvram-dir", nvram_dir], |root| {
        common::place_container_disk(root, 0);
    });
    let (status, d) = next.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", next.log());
    assert_eq!(
        std::fs::read(&vars).unwrap(),
        written,
        "the store was replaced"
    );
    let pid = d["qemuPid"].as_i64().unwrap();
    let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        cmdline.contains(&format!("filename={}", vars.display())),
        "{cmdline}"
    );
}

/// After SIGTERM the launcher waits out its grace period for the guest to power down, but a
/// `kill` (virt-handler sends one when the VMI's own, shorter grace period is over) is served
/// at once rather than after that wait. The guest is paused, so it cannot power down by itself.
#[test]
fn guest_kill_is_served_while_sigterm_waits_for_the_guest() {
    let mut l = Launcher::start_with(&["--grace-period-seconds", "600"], |root| {
        common::place_container_disk(root, 0);
    });
    let id = uid();
    let v = vmi(
        "killed",
        &id,
        json!({
            "domain": {
                "resources": {"requests": {"memory": "128Mi"}},
                "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]},
            },
            "volumes": [{"name": "root", "containerDisk": {"image": "guest"}}],
        }),
    );
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", l.log());
    let pid = d["qemuPid"].as_i64().unwrap();
    l.post("/v1/pause");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(l.pid()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    common::wait_until(BOOT, "the launcher to log its power-down", || {
        l.log().contains("powering the guest down").then_some(())
    });
    let socket = l.socket.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(common::http(&socket, "POST", "/v1/kill", None));
    });
    // Far below the 600 s grace period: a kill queued behind it would not be back by then.
    let (status, d) = rx
        .recv_timeout(Duration::from_mins(1))
        .unwrap_or_else(|_| panic!("kill was not served during the grace period\n{}", l.log()));
    assert_eq!(status, 200, "{d}\n{}", l.log());
    let status = l.wait_exit(Duration::from_mins(1));
    assert!(status.success(), "{}", l.log());
    assert!(!common::process_alive(pid), "QEMU left behind");
}

/// Every device kind the converter emits, in one machine: QEMU 7.2 must accept the command line
/// (secure-boot EFI with SMM, sata and scsi disks and cdroms, read-only, serials, cache modes,
/// native AIO, error policies, a shared disk, IOThreads, transitional virtio, a transitional
/// virtio disk off the root bus behind libvirt's root port, pcie-to-pci-bridge and pci-bridges,
/// an offset RTC with catch-up, no HPET, a hidden KVM, rng, balloon, VNC) and run it. Whether
/// the guest boots is not waited for: this is about the device model, and QMP shows every
/// device.
#[test]
fn guest_every_device_kind_is_accepted_by_qemu() {
    let l = Launcher::start_with(&["--keep-after-shutdown"], |root| {
        common::place_container_disk(root, 0);
    });
    let id = uid();
    let raw = l.dir("hostdisks/raw.img");
    let v = vmi(
        "devices",
        &id,
        json!({
            "domain": {
                "cpu": {"sockets": 1, "cores": 2, "threads": 1, "model": "host-model"},
                "memory": {"guest": "192Mi"},
                "firmware": {"bootloader": {"efi": {}}, "serial": "SER-1,2", "uuid": uid()},
                "clock": {"utc": {"offsetSeconds": -3600}, "timer": {
                    "hpet": {"present": false}, "rtc": {"tickPolicy": "catchup", "track": "guest"},
                }},
                "features": {"kvm": {"hidden": true}, "pvspinlock": {"enabled": false}},
                "ioThreadsPolicy": "auto",
                "resources": {"requests": {"cpu": "1"}},
                "devices": {
                    "useVirtioTransitional": true,
                    "blockMultiQueue": true,
                    "rng": {},
                    "watchdog": {"name": "wd", "i6300esb": {"action": "poweroff"}},
                    "inputs": [
                        {"name": "tablet-usb", "type": "tablet", "bus": "usb"},
                        {"name": "tablet-virtio", "type": "tablet", "bus": "virtio"},
                    ],
                    "video": {"type": "bochs"},
                    "disks": [
                        {"name": "root", "disk": {"bus": "sata"}, "bootOrder": 1, "cache": "writethrough"},
                        {"name": "data", "disk": {"bus": "scsi", "readonly": true}, "serial": "D,1", "cache": "none",
                         "io": "native", "errorPolicy": "enospace", "shareable": true, "dedicatedIOThread": true},
                        {"name": "cd1", "cdrom": {"bus": "sata"}},
                        {"name": "cd2", "cdrom": {"bus": "scsi"}},
                        // Conventional PCI (transitional): buses 1-4 are a root port, a
                        // pcie-to-pci-bridge and two pci-bridges on it.
                        {"name": "bridged", "disk": {"bus": "virtio", "pciAddress": "0000:04:05.0"}},
                    ],
                },
            },
            "volumes": [
                {"name": "root", "containerDisk": {"image": "g"}},
                {"name": "data", "hostDisk": {"path": raw, "type": "DiskOrCreate", "capacity": "8Mi"}},
                {"name": "cd1", "cloudInitNoCloud": {"userData": "#cloud-config\n"}},
                {"name": "cd2", "emptyDisk": {"capacity": "8Mi"}},
                {"name": "bridged", "emptyDisk": {"capacity": "8Mi"}},
            ],
        }),
    );
    // A required feature TCG cannot give, which QEMU would only warn about and drop: refused
    // by name before the guest's first instruction, as libvirt refuses it.
    let mut lacking = v.clone();
    lacking["spec"]["domain"]["cpu"]["features"] = json!([{"name": "avx512f"}]);
    let (status, e) = l.sync(&lacking);
    assert_eq!(status, 422, "{e}");
    assert_eq!(e["code"], "InvalidVMI", "{e}");
    assert!(e.to_string().contains("spec.domain.cpu.features[0]"), "{e}");
    // Gone before the refusal is answered: the next start's QEMU takes the same image locks.
    let qemus = common::qemus_under(l.root.path());
    assert!(
        qemus.is_empty(),
        "QEMU {qemus:?} outlived the refusal\n{}",
        l.log()
    );
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", l.log());
    assert_eq!(d["state"], "Running");
    assert_eq!(d["vcpuThreads"].as_array().unwrap().len(), 2);
    let buses: Vec<_> = d["disks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["bus"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(buses, ["sata", "scsi", "sata", "scsi", "virtio"]);
    assert!(l.vm_dir(&id).join("virt-vnc").exists(), "VNC socket");
    assert_eq!(
        l.get("/v1/info")["qemuVersion"],
        "7.2.22",
        "QEMU version from the greeting"
    );

    // Hotplug without guest cooperation: SCSI comes and goes at once. A device QEMU refuses
    // (a boot index already in use) is rolled back, so the same disk then plugs cleanly.
    let mut spec = v["spec"].clone();
    spec["domain"]["devices"]["disks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "hot", "disk": {"bus": "scsi"}, "bootOrder": 1}));
    spec["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "hot", "emptyDisk": {"capacity": "8Mi"}}));
    let (status, e) = l.sync(&vmi("devices", &id, spec.clone()));
    assert_eq!(status, 422, "{e}");
    assert_eq!(e["code"], "HotplugFailed");
    let d = l.domain();
    assert_eq!(d["state"], "Running");
    assert!(d["syncError"].as_str().unwrap().contains("hot"), "{d}");
    spec["domain"]["devices"]["disks"][5]
        .as_object_mut()
        .unwrap()
        .remove("bootOrder");
    let (status, d) = l.sync(&vmi("devices", &id, spec.clone()));
    assert_eq!(status, 200, "{d}\n{}", l.log());
    assert!(d.get("syncError").is_none(), "{d}");
    assert_eq!(d["disks"][5]["name"], "hot");
    assert_eq!(d["disks"][5]["bus"], "scsi");
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", l.log());
    assert_eq!(d["disks"].as_array().unwrap().len(), 5);
    // Reset and kill through the API; the kill is ours, so the domain is Shutoff/Destroyed.
    l.post("/v1/reset");
    let d = l.post("/v1/kill");
    assert_eq!(d["state"], "Shutoff", "{d}");
    assert_eq!(d["reason"], "Destroyed");
}

/// The guest's block device (`vda`, ...) whose serial is `serial`.
fn device_with_serial(console: &mut Console, serial: &str) -> String {
    let out = console.run(
        "for d in /sys/block/*; do echo \"${d##*/}=$(cat $d/serial 2>/dev/null)\"; done",
        BOOT,
    );
    out.lines()
        .find_map(|l| l.strip_suffix(&format!("={serial}")))
        .unwrap_or_else(|| panic!("no disk with serial {serial} in {out:?}"))
        .to_owned()
}

/// Persistent volume claims in both volume modes, on a guest whose RAM is hugepages: a
/// filesystem claim (`disk.img` in the claim's directory) that the guest reads, a block
/// claim (a loop device) that the guest writes, and an `ephemeral` volume whose claim the
/// guest's writes never reach (they land in an overlay); QEMU's RAM comes from the hugetlbfs
/// mount.
#[test]
fn guest_q35_pvc_filesystem_and_block_on_hugepages() {
    // 256Mi of 2Mi pages.
    let hugepages = common::Hugepages::reserve(128);
    let backing = tempfile::tempdir().unwrap();
    let block_file = backing.path().join("block.img");
    std::fs::File::create(&block_file)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let lo = common::LoopDevice::attach(&block_file);
    let block_dir = backing.path().join("dev");
    std::fs::create_dir(&block_dir).unwrap();
    std::os::unix::fs::symlink(&lo.path, block_dir.join("blk")).unwrap();
    let hp = hugepages.mount.path().display().to_string();
    let bd = block_dir.display().to_string();
    let l = Launcher::start_with(
        &[
            "--hugepages-dir",
            &hp,
            "--block-device-dir",
            &bd,
            "--keep-after-shutdown",
        ],
        |root| {
            common::place_kernel(root);
            let claim = root.join("private/vmi-disks/fs");
            std::fs::create_dir_all(&claim).unwrap();
            let f = std::fs::File::create(claim.join("disk.img")).unwrap();
            std::io::Write::write_all(&mut &f, b"PVC-FS-DATA").unwrap();
            f.set_len(16 << 20).unwrap();
            let base = root.join("private/vmi-disks/eph");
            std::fs::create_dir_all(&base).unwrap();
            let f = std::fs::File::create(base.join("disk.img")).unwrap();
            std::io::Write::write_all(&mut &f, b"EPH-BASE-DATA").unwrap();
            f.set_len(16 << 20).unwrap();
        },
    );
    let id = uid();
    let v = vmi(
        "pvc",
        &id,
        json!({
            "domain": {
                "machine": {"type": "q35"},
                "memory": {"guest": "256Mi", "hugepages": {"pageSize": "2Mi"}},
                "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                    "image": "guest", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}},
                "devices": {"disks": [
                    {"name": "fs", "disk": {"bus": "virtio"}, "serial": "PVCFS1"},
                    {"name": "blk", "disk": {"bus": "virtio"}, "serial": "PVCBLK1"},
                    {"name": "eph", "disk": {"bus": "virtio"}, "serial": "PVCEPH1"},
                ]},
            },
            "volumes": [
                {"name": "fs", "persistentVolumeClaim": {"claimName": "fs-claim"}},
                {"name": "blk", "persistentVolumeClaim": {"claimName": "blk-claim"}},
                {"name": "eph", "ephemeral": {"persistentVolumeClaim": {"claimName": "golden", "readOnly": true}}},
            ],
        }),
    );
    let before = common::Hugepages::in_use();
    let (status, d) = l.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", l.log());
    let pid = d["qemuPid"].as_i64().unwrap();
    assert_eq!(
        d["disks"][0]["source"],
        l.dir("private/vmi-disks/fs/disk.img").display().to_string()
    );
    let overlay = l.dir("ephemeral/disk-data/eph/disk.qcow2");
    assert_eq!(d["disks"][2]["source"], overlay.display().to_string());
    // prealloc=on: every page of guest RAM is taken before the guest runs.
    let taken = common::Hugepages::in_use() - before;
    assert!(taken >= 128, "QEMU took {taken} hugepages, not 128");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(maps.contains(&hp), "guest RAM is not on {hp}");
    // The block claim is opened as the device itself.
    let opened: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .collect();
    assert!(
        opened.contains(&lo.path),
        "{} not open: {opened:?}",
        lo.path.display()
    );

    l.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    let mut console = Console::connect(&l.vm_dir(&id).join("virt-serial0"));
    let fs = device_with_serial(&mut console, "PVCFS1");
    assert_eq!(
        console.run(&format!("head -c 11 /dev/{fs}"), BOOT),
        "PVC-FS-DATA"
    );
    let blk = device_with_serial(&mut console, "PVCBLK1");
    console.run(
        &format!("printf PVC-BLOCK-WRITTEN > /dev/{blk}; sync"),
        BOOT,
    );
    wait_until(BOOT, "the guest's write on the block device", || {
        let mut head = [0u8; 17];
        let mut f = std::fs::File::open(&lo.path).unwrap();
        std::io::Read::read_exact(&mut f, &mut head).unwrap();
        (&head == b"PVC-BLOCK-WRITTEN").then_some(())
    });
    let eph = device_with_serial(&mut console, "PVCEPH1");
    assert_eq!(
        console.run(&format!("head -c 13 /dev/{eph}"), BOOT),
        "EPH-BASE-DATA"
    );
    console.run(
        &format!("printf EPH-GUEST-DATA > /dev/{eph}; sync; echo 3 > /proc/sys/vm/drop_caches"),
        BOOT,
    );
    assert_eq!(
        console.run(&format!("head -c 14 /dev/{eph}"), BOOT),
        "EPH-GUEST-DATA"
    );
    let mut head = [0u8; 13];
    std::io::Read::read_exact(
        &mut std::fs::File::open(l.dir("private/vmi-disks/eph/disk.img")).unwrap(),
        &mut head,
    )
    .unwrap();
    assert_eq!(
        &head, b"EPH-BASE-DATA",
        "the guest wrote through to the claim"
    );
    let d = l.post("/v1/kill");
    assert_eq!(d["state"], "Shutoff", "{d}");
}

/// Debian's virtiofsd serving `dir` on `socket`, as a launcher pod's `virtiofs-<name>`
/// container runs it; killed, and its pid file (`/run/virtiofsd/<socket path with dots>.pid`,
/// which it leaves behind) removed, when dropped.
struct Virtiofsd {
    child: std::process::Child,
    pid_file: std::path::PathBuf,
}

impl Virtiofsd {
    fn serve(dir: &Path, socket: &Path) -> Self {
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let child = std::process::Command::new(api::virtiofs::VIRTIOFSD)
            .arg(format!("--socket-path={}", socket.display()))
            .args(["-o", &format!("source={}", dir.display())])
            .args([
                "-o",
                "sandbox=chroot",
                "-o",
                "cache=auto",
                "--rlimit-nofile=0",
            ])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e} (hack/deps.sh)", api::virtiofs::VIRTIOFSD));
        let pid_file = Path::new("/run/virtiofsd").join(format!(
            "{}.pid",
            socket.display().to_string().replace('/', ".")
        ));
        Self { child, pid_file }
    }
}

impl Drop for Virtiofsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.pid_file);
    }
}

/// Two directories shared through virtiofs, as a ConfigMap and a claim reach the guest: guest
/// RAM is a shared memfd, virtiofsd (started after the sync began: the launcher waits for its
/// socket) serves each, and the guest mounts them by name, reads the files and writes one back.
#[test]
fn guest_virtiofs_directories_are_read_in_the_guest() {
    let shared = tempfile::tempdir().unwrap();
    let cfg = shared.path().join("cfg");
    let data = shared.path().join("data");
    std::fs::create_dir_all(&cfg).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(cfg.join("app.conf"), "mode=virtiofs\n").unwrap();
    std::fs::write(data.join("seed.txt"), "CLAIM-DATA\n").unwrap();
    let l = Launcher::start_with(&["--keep-after-shutdown"], common::place_kernel);
    let id = uid();
    let v = vmi(
        "fs",
        &id,
        json!({
            "domain": {
                "machine": {"type": "q35"},
                "memory": {"guest": "256Mi"},
                "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                    "image": "guest", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}},
                "devices": {"filesystems": [
                    {"name": "cfg", "virtiofs": {}},
                    {"name": "data", "virtiofs": {}},
                ]},
            },
            "volumes": [
                {"name": "cfg", "configMap": {"name": "app"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
            ],
        }),
    );
    let sync = std::thread::spawn({
        let socket = l.socket.clone();
        move || common::http(&socket, "PUT", "/v1/sync", Some(&v))
    });
    let share = l.dir("share");
    let _daemons = [
        Virtiofsd::serve(&cfg, &api::virtiofs::socket_path(&share, "cfg")),
        Virtiofsd::serve(&data, &api::virtiofs::socket_path(&share, "data")),
    ];
    let (status, d) = sync.join().unwrap();
    assert_eq!(status, 200, "{d}\n{}", l.log());
    let pid = d["qemuPid"].as_i64().unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    // A shared mapping (`rw-s`) of the backend's memfd, which virtiofsd maps too.
    assert!(
        maps.lines()
            .any(|m| m.contains("/memfd:memory-backend-memfd")
                && m.split_whitespace()
                    .nth(1)
                    .is_some_and(|p| p.ends_with('s'))),
        "guest RAM is not a shared memfd:\n{maps}"
    );

    l.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    let mut console = Console::connect(&l.vm_dir(&id).join("virt-serial0"));
    assert_eq!(
        console.run(
            "mkdir -p /mnt/cfg /mnt/data && mount -t virtiofs cfg /mnt/cfg && \
             mount -t virtiofs data /mnt/data && cat /mnt/cfg/app.conf /mnt/data/seed.txt",
            BOOT
        ),
        "mode=virtiofs\nCLAIM-DATA"
    );
    console.run("echo GUEST-WROTE > /mnt/data/from-guest; sync", BOOT);
    assert_eq!(
        std::fs::read_to_string(data.join("from-guest")).unwrap(),
        "GUEST-WROTE\n"
    );
    let d = l.post("/v1/kill");
    assert_eq!(d["state"], "Shutoff", "{d}");
}

/// Clears a PE image's Authenticode signature: the certificate table entry of the optional
/// header's data directories (PE32+), so firmware sees an unsigned image.
fn strip_signature(pe: &mut [u8]) {
    let at = |o: usize| u32::from_le_bytes(pe[o..o + 4].try_into().unwrap()) as usize;
    let header = at(0x3c);
    assert_eq!(&pe[header..header + 4], b"PE\0\0");
    let optional = header + 24;
    assert_eq!(&pe[optional..optional + 2], &[0x0b, 0x02], "not PE32+");
    let certificates = optional + 112 + 4 * 8;
    assert_ne!(at(certificates + 4), 0, "the image is not signed");
    pe[certificates..certificates + 8].fill(0);
}

/// The guest's disk, raw, with shim (`EFI/BOOT/BOOTX64.EFI`) unsigned: the boot partition
/// starts at 1 MiB (hack/guest/build.sh), mtools edits it in place.
fn unsigned_disk(to: &Path) {
    let status = std::process::Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(common::guest_file("disk.qcow2"))
        .arg(to)
        .status()
        .unwrap();
    assert!(status.success());
    let part = format!("{}@@1048576", to.display());
    let shim = to.with_extension("efi");
    let mcopy = |args: &[&std::ffi::OsStr]| {
        let out = std::process::Command::new("mcopy")
            .args(["-n", "-o", "-i", &part])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    mcopy(&["::/EFI/BOOT/BOOTX64.EFI".as_ref(), shim.as_os_str()]);
    let mut pe = std::fs::read(&shim).unwrap();
    strip_signature(&mut pe);
    std::fs::write(&shim, pe).unwrap();
    mcopy(&[shim.as_os_str(), "::/EFI/BOOT/BOOTX64.EFI".as_ref()]);
    std::fs::remove_file(&shim).unwrap();
}

fn secure_boot_vmi(id: &str) -> Value {
    vmi(
        "secureboot",
        id,
        json!({
            "domain": {
                "machine": {"type": "q35"},
                // GRUB 2.06 under OVMF runs out of memory loading the guest at 256Mi.
                "resources": {"requests": {"memory": "512Mi"}},
                "firmware": {"bootloader": {"efi": {"secureBoot": true}}},
                "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}, "bootOrder": 1}]},
            },
            "volumes": [{"name": "root", "containerDisk": {"image": "guest"}}],
        }),
    )
}

/// EFI Secure Boot with SMM (OVMF's secure-boot build, Microsoft's keys): the guest disk's
/// signed chain (shim -> GRUB -> kernel, all Debian's, shim signed by Microsoft) boots and the
/// kernel sees Secure Boot on; the same disk with shim's signature removed is refused by the
/// firmware ("Access Denied", EFI_SECURITY_VIOLATION).
#[test]
fn guest_q35_secure_boot_runs_signed_and_refuses_unsigned() {
    let l = Launcher::start_with(&["--keep-after-shutdown"], |root| {
        unsigned_disk(&root.join("container-disks/disk_0.img"));
    });
    let id = uid();
    let (status, d) = l.sync(&secure_boot_vmi(&id));
    assert_eq!(status, 200, "{d}\n{}", l.log());
    let pid = d["qemuPid"].as_i64().unwrap();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    for want in [
        "OVMF_CODE_4M.secboot.fd",
        "smm=on",
        "driver=cfi.pflash01,property=secure,value=on",
    ] {
        assert!(cmdline.contains(want), "{want} not in {cmdline}");
    }
    // BdsDxe: failed to load Boot0001 "UEFI Misc Device" from PciRoot(...): Access Denied
    l.wait_console(&id, "BdsDxe: failed to load");
    let line = wait_until(BOOT, "the end of the firmware's line", || {
        let log = l.serial_log(&id);
        let from = log.find("BdsDxe: failed to load")?;
        log[from..]
            .find('\n')
            .map(|end| log[from..from + end].to_owned())
    });
    assert!(
        line.contains("Access Denied") || line.contains("Security Violation"),
        "refused for another reason: {line}"
    );
    let log = l.serial_log(&id);
    assert!(!log.contains("Linux version"), "{log}");
    drop(l);

    let l = Launcher::start_with(&["--keep-after-shutdown"], |root| {
        common::place_container_disk(root, 0);
    });
    let id = uid();
    let (status, d) = l.sync(&secure_boot_vmi(&id));
    assert_eq!(status, 200, "{d}\n{}", l.log());
    l.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    let log = l.serial_log(&id);
    assert!(log.contains("Secure boot enabled"), "{log}");
    let mut console = Console::connect(&l.vm_dir(&id).join("virt-serial0"));
    // The kernel locks itself down under Secure Boot.
    assert!(
        console
            .run(
                "mount -t securityfs none /sys/kernel/security 2>/dev/null; \
                 cat /sys/kernel/security/lockdown",
                BOOT
            )
            .contains("[integrity]"),
    );
}
