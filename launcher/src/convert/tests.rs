use super::*;
use pretty_assertions::assert_eq;
use proptest::prelude::*;

fn dirs() -> Dirs {
    Dirs {
        share: "/s".into(),
        private: "/p".into(),
        ephemeral: "/e".into(),
        container_disks: "/c".into(),
        hotplug_disks: "/h".into(),
        block_devices: "/dev".into(),
        nvram: "/nvram".into(),
    }
}

fn host() -> Host {
    Host {
        accel: Accel::Tcg,
        ovmf_dir: "/usr/share/OVMF".into(),
        hugepages_dir: "/dev/hugepages".into(),
        block_volumes: BTreeSet::new(),
        network: BTreeMap::new(),
    }
}

fn vmi(spec: serde_json::Value) -> VirtualMachineInstance {
    let mut v = serde_json::json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm1", "namespace": "ns", "uid": "0b3d1c52-5a8e-4d4e-9a61-4b1f8e0c2a11"},
    });
    v["spec"] = spec;
    serde_json::from_value(v).unwrap()
}

type Mutation = Box<dyn Fn(&mut serde_json::Value)>;

fn base_spec() -> serde_json::Value {
    serde_json::json!({
        "domain": {
            "resources": {"requests": {"memory": "128Mi"}},
            "devices": {
                "disks": [
                    {"name": "root", "disk": {"bus": "virtio"}, "bootOrder": 1},
                    {"name": "cd", "cdrom": {}},
                    {"name": "scratch", "disk": {"bus": "sata"}, "cache": "none"},
                    {"name": "ci", "disk": {}},
                ],
            },
        },
        "volumes": [
            {"name": "root", "containerDisk": {"image": "x"}},
            {"name": "cd", "hostDisk": {"path": "/images/a,b.iso", "type": "Disk"}},
            {"name": "scratch", "emptyDisk": {"capacity": "1Gi"}},
            {"name": "ci", "cloudInitNoCloud": {"userData": "#!/bin/sh\necho hi\n"}},
        ],
    })
}

fn conv(spec: serde_json::Value) -> Result<Plan, ConvertError> {
    convert(&vmi(spec), &dirs(), &host())
}

#[test]
fn full_vmi_converts() {
    let plan = conv(base_spec()).unwrap();
    let c = &plan.config;
    assert_eq!(c.machine.kind, MachineKind::Q35);
    assert_eq!(c.cpu.model, "max");
    assert_eq!(c.memory.size_mib, 128);
    assert_eq!(c.smbios.uuid, "0b3d1c52-5a8e-4d4e-9a61-4b1f8e0c2a11");
    let fronts: Vec<_> = c.disks.iter().map(|d| d.frontend).collect();
    assert_eq!(
        fronts,
        vec![
            Frontend::Virtio,
            Frontend::SataCdrom { unit: 0 },
            Frontend::Sata { unit: 1 },
            Frontend::Virtio,
        ]
    );
    assert!(c.disks[1].read_only, "cdroms default to read-only");
    assert_eq!(c.disks[2].cache, CacheMode::None);
    assert_eq!(
        c.disks[0].source.path,
        PathBuf::from("/e/disk-data/root/disk.qcow2")
    );
    assert!(plan.preps.contains(&Prep::Overlay {
        path: "/e/disk-data/root/disk.qcow2".into(),
        backing: "/c/disk_0.img".into(),
        backing_format: None,
        field: "spec.volumes[0].containerDisk".into(),
    }));
    assert!(plan.preps.contains(&Prep::EmptyDisk {
        path: "/e/empty-disks/scratch.qcow2".into(),
        size: 1 << 30,
        field: "spec.volumes[2].emptyDisk".into(),
    }));
    let seed = plan
        .preps
        .iter()
        .find_map(|p| match p {
            Prep::CloudInit { path, seed, .. } => Some((path, seed)),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        seed.0,
        &PathBuf::from("/e/cloud-init-data/ns/vm1/noCloud.iso")
    );
    assert_eq!(
        seed.1.user_data,
        SeedData::Inline(b"#!/bin/sh\necho hi\n".to_vec())
    );

    let argv = c.argv();
    let joined = argv.join(" ");
    assert!(
        joined.contains("file.filename=/images/a,,b.iso"),
        "{joined}"
    );
    assert!(joined.contains("-device ahci,id=sata0"));
    assert!(joined.contains("-machine q35"));
    assert!(joined.contains("-accel tcg,tb-size=128"), "{joined}");
    assert!(argv.contains(&"-S".to_owned()));
    assert!(joined.contains("pcie-root-port,id=hotplug-port0"));
    assert!(joined.contains("path=/p/0b3d1c52-5a8e-4d4e-9a61-4b1f8e0c2a11/qmp.sock"));
}

#[test]
fn host_cpu_models_map_to_max_under_tcg_and_host_under_kvm() {
    let mut s = base_spec();
    s["domain"]["cpu"] = serde_json::json!({"model": "host-passthrough", "sockets": 2, "cores": 2});
    let p = conv(s.clone()).unwrap();
    assert_eq!(p.config.cpu.model, "max");
    assert_eq!(p.config.cpu.vcpus(), 4);
    let mut kvm = host();
    kvm.accel = Accel::Kvm;
    let p = convert(&vmi(s), &dirs(), &kvm).unwrap();
    assert_eq!(p.config.cpu.model, "host");
}

/// Dedicated CPUs give the guest KVM's `hint-dedicated` under KVM, as KubeVirt asks libvirt to;
/// TCG has no such hint.
#[test]
fn dedicated_cpus_hint_the_guest_under_kvm_only() {
    let mut s = base_spec();
    s["domain"]["cpu"] = serde_json::json!({"cores": 1, "dedicatedCpuPlacement": true});
    let cpu_line = |p: &Plan| {
        let argv = p.config.argv();
        argv[argv.iter().position(|a| a == "-cpu").unwrap() + 1].clone()
    };
    assert_eq!(cpu_line(&conv(s.clone()).unwrap()), "max");
    let mut kvm = host();
    kvm.accel = Accel::Kvm;
    let p = convert(&vmi(s), &dirs(), &kvm).unwrap();
    assert_eq!(cpu_line(&p), "host,kvm-hint-dedicated=on");
}

/// `cpu.features` on `-cpu` as libvirt renders them, after the CPU's other switches so that
/// they have the last word; a policy or a name QEMU cannot take is named at its field.
#[test]
fn cpu_features_render_on_the_cpu_as_libvirt_renders_them() {
    let mut s = base_spec();
    s["domain"]["cpu"] = serde_json::json!({"model": "Penryn", "features": [
        {"name": "pcid"},
        {"name": "x2apic", "policy": "require"},
        {"name": "avx", "policy": "force"},
        {"name": "lahf_lm", "policy": "optional"},
        {"name": "mpx", "policy": "disable"},
        {"name": "pdpe1gb", "policy": "forbid"},
    ]});
    s["domain"]["features"] = serde_json::json!({"kvm": {"hidden": true}});
    let argv = conv(s.clone()).unwrap().config.argv();
    let cpu = &argv[argv.iter().position(|a| a == "-cpu").unwrap() + 1];
    assert_eq!(
        cpu,
        "Penryn,kvm=off,pcid=on,x2apic=on,avx=on,lahf_lm=on,mpx=off,pdpe1gb=off"
    );
    s["domain"]["cpu"]["features"][1]["policy"] = "demand".into();
    assert_eq!(
        conv(s.clone()).unwrap_err().field,
        "spec.domain.cpu.features[1].policy"
    );
    s["domain"]["cpu"]["features"][1] = serde_json::json!({"name": "x2apic,kvm=on"});
    assert_eq!(
        conv(s).unwrap_err().field,
        "spec.domain.cpu.features[1].name"
    );
}

#[test]
fn efi_secure_boot_uses_secboot_code_and_smm() {
    let mut s = base_spec();
    s["domain"]["firmware"] = serde_json::json!({"bootloader": {"efi": {}}, "serial": "S1"});
    let p = conv(s.clone()).unwrap();
    assert_eq!(
        p.config.firmware,
        Firmware::Efi {
            code: "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd".into(),
            vars: "/e/efi/0b3d1c52-5a8e-4d4e-9a61-4b1f8e0c2a11_VARS.fd".into(),
            secure_boot: true
        }
    );
    assert_eq!(p.config.machine.smm, Some(true));
    let joined = p.config.argv().join(" ");
    assert!(joined.contains("smm=on"), "{joined}");
    assert!(joined.contains("pflash0=pflash0-code,pflash1=pflash1-vars"));
    assert!(joined.contains("property=secure,value=on"));
    assert!(joined.contains("serial=S1"));

    s["domain"]["machine"] = serde_json::json!({"type": "pc"});
    let e = conv(s.clone()).unwrap_err();
    assert_eq!(e.field, "spec.domain.firmware.bootloader.efi.secureBoot");
    s["domain"]["firmware"]["bootloader"]["efi"]["secureBoot"] = false.into();
    let p = conv(s).unwrap();
    assert_eq!(p.config.machine.kind, MachineKind::Pc);
    assert!(p.config.controllers.hotplug_ports.is_empty());
}

/// `efi.persistent`: the variable store is KubeVirt's `<nvram dir>/<vmi name>_VARS.fd` (on the
/// backend-storage claim), copied from the template only when absent, and a store of the wrong
/// size is reported at that field.
#[test]
fn efi_persistent_vars_live_in_the_nvram_dir_under_the_vmi_name() {
    let mut s = base_spec();
    s["domain"]["firmware"] =
        serde_json::json!({"bootloader": {"efi": {"secureBoot": false, "persistent": true}}});
    let p = conv(s).unwrap();
    let vars = PathBuf::from("/nvram/vm1_VARS.fd");
    assert_eq!(
        p.config.firmware,
        Firmware::Efi {
            code: "/usr/share/OVMF/OVMF_CODE_4M.fd".into(),
            vars: vars.clone(),
            secure_boot: false
        }
    );
    assert!(p.preps.contains(&Prep::CopyFile {
        from: "/usr/share/OVMF/OVMF_VARS_4M.fd".into(),
        to: vars,
        field: "spec.domain.firmware.bootloader.efi.persistent".into(),
    }));
    let joined = p.config.argv().join(" ");
    assert!(joined.contains("filename=/nvram/vm1_VARS.fd"), "{joined}");
}

#[test]
fn kernel_boot_paths_come_from_the_container_disk_dir() {
    let mut s = base_spec();
    s["domain"]["firmware"] = serde_json::json!({"kernelBoot": {
        "kernelArgs": "console=ttyS0",
        "container": {"image": "k", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}
    }});
    let p = conv(s).unwrap();
    let k = p.config.kernel_boot.unwrap();
    assert_eq!(k.kernel, PathBuf::from("/c/kernel-boot/vmlinuz"));
    assert_eq!(k.initrd, Some(PathBuf::from("/c/kernel-boot/initrd.img")));
    assert_eq!(k.cmdline.as_deref(), Some("console=ttyS0"));
}

#[test]
fn a_watchdog_is_an_i6300esb_with_its_action() {
    let mut s = base_spec();
    s["domain"]["devices"]["watchdog"] =
        serde_json::json!({"name": "wd", "i6300esb": {"action": "poweroff"}});
    let argv = conv(s.clone()).unwrap().config.argv();
    for pair in [
        ["-device", "i6300esb,id=ua-wd"],
        ["-watchdog-action", "poweroff"],
    ] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    s["domain"]["devices"]["watchdog"] = serde_json::json!({"name": "wd", "i6300esb": {}});
    let argv = conv(s.clone()).unwrap().config.argv();
    assert!(
        argv.windows(2).any(|w| w == ["-watchdog-action", "reset"]),
        "KubeVirt's default action: {argv:?}"
    );
    s["domain"]["devices"]["watchdog"] = serde_json::json!({"name": "wd", "diag288": {}});
    let e = conv(s).unwrap_err();
    assert_eq!(e.field, "spec.domain.devices.watchdog");
    assert!(
        !conv(base_spec())
            .unwrap()
            .config
            .argv()
            .iter()
            .any(|a| a.contains("i6300esb") || a == "-watchdog-action")
    );
}

/// Found by fuzzing (fuzz/, qemu_argv): a NUL in a watchdog's name reached QEMU's argv.
/// Admission refuses such names; the launcher does too, whatever reaches it.
#[test]
fn device_names_that_cannot_be_qemu_ids_are_refused() {
    let mut s = base_spec();
    s["domain"]["devices"]["watchdog"] = serde_json::json!({"name": "w\u{0}", "i6300esb": {}});
    assert_eq!(
        conv(s).unwrap_err().field,
        "spec.domain.devices.watchdog.name"
    );
    let mut s = base_spec();
    s["domain"]["devices"]["inputs"] = serde_json::json!([{"name": "t,x", "type": "tablet"}]);
    assert_eq!(
        conv(s).unwrap_err().field,
        "spec.domain.devices.inputs[0].name"
    );
    // Found the same way: a NUL for the CPU model.
    let mut s = base_spec();
    s["domain"]["cpu"] = serde_json::json!({"model": "\u{0}"});
    assert_eq!(conv(s).unwrap_err().field, "spec.domain.cpu.model");
    // A watchdog action QEMU would take verbatim (the fuzzer's had NUL bytes).
    let mut s = base_spec();
    s["domain"]["devices"]["watchdog"] =
        serde_json::json!({"name": "w", "i6300esb": {"action": "\u{0}"}});
    assert_eq!(
        conv(s).unwrap_err().field,
        "spec.domain.devices.watchdog.i6300esb.action"
    );
    // And "help", which makes -cpu print QEMU's list and exit.
    let mut s = base_spec();
    s["domain"]["cpu"] = serde_json::json!({"model": "help"});
    assert_eq!(conv(s).unwrap_err().field, "spec.domain.cpu.model");
}

/// Found by fuzzing (fuzz/, qemu_argv): a kernelPath whose file name was NUL bytes reached
/// `-kernel`, then the SMBIOS serial `-smbios`. Every string of the spec is checked, not only
/// the fields the fuzzer has found so far, as admission checks them.
#[test]
fn any_string_with_a_nul_byte_is_refused_at_its_path() {
    let mut s = base_spec();
    s["domain"]["firmware"] = serde_json::json!({"kernelBoot": {
        "container": {"image": "k", "kernelPath": "/boot/\u{0}\u{0}"}
    }});
    let e = conv(s).unwrap_err();
    assert_eq!(
        e.field, "spec.domain.firmware.kernelBoot.container.kernelPath",
        "{e:?}"
    );
    assert_eq!(e.message, api::validation::NUL_BYTE);
    let mut s = base_spec();
    s["domain"]["firmware"] = serde_json::json!({"serial": "a\u{0}b"});
    assert_eq!(conv(s).unwrap_err().field, "spec.domain.firmware.serial");
    let mut s = base_spec();
    s["domain"]["devices"]["disks"] = serde_json::json!([{"name": "h", "disk": {}}]);
    s["volumes"] =
        serde_json::json!([{"name": "h", "hostDisk": {"path": "/d/\u{0}.img", "type": "Disk"}}]);
    assert_eq!(conv(s).unwrap_err().field, "spec.volumes[0].hostDisk.path");
}

#[test]
fn inputs_are_tablets_on_usb_or_virtio() {
    let mut s = base_spec();
    s["domain"]["devices"]["inputs"] = serde_json::json!([
        {"name": "t1", "type": "tablet", "bus": "usb"},
        {"name": "t2", "type": "tablet", "bus": "virtio"},
    ]);
    let argv = conv(s.clone()).unwrap().config.argv();
    for pair in [
        ["-device", "qemu-xhci,id=usb0"],
        ["-device", "usb-tablet,id=ua-t1,bus=usb0.0"],
        ["-device", "virtio-tablet-pci,id=ua-t2"],
    ] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    s["domain"]["devices"]["inputs"] =
        serde_json::json!([{"name": "t2", "type": "tablet", "bus": "virtio"}]);
    let argv = conv(s.clone()).unwrap().config.argv();
    assert!(
        !argv.iter().any(|a| a.contains("xhci")),
        "no USB controller without a USB device: {argv:?}"
    );
    s["domain"]["devices"]["inputs"] = serde_json::json!([{"name": "k", "type": "keyboard"}]);
    assert_eq!(
        conv(s).unwrap_err().field,
        "spec.domain.devices.inputs[0].type"
    );
}

#[test]
fn video_types_map_to_qemus_display_devices() {
    let device = |video: Option<serde_json::Value>| {
        let mut s = base_spec();
        if let Some(v) = video {
            s["domain"]["devices"]["video"] = v;
        }
        conv(s).map(|p| {
            let argv = p.config.argv();
            argv.iter()
                .find(|a| a.ends_with(",id=video0"))
                .cloned()
                .unwrap_or_default()
        })
    };
    assert_eq!(device(None).unwrap(), "VGA,id=video0", "KubeVirt's default");
    for (ty, qemu) in [
        ("vga", "VGA"),
        ("cirrus", "cirrus-vga"),
        ("vmvga", "vmware-svga"),
        ("virtio", "virtio-vga"),
        ("bochs", "bochs-display"),
        ("ramfb", "ramfb"),
    ] {
        assert_eq!(
            device(Some(serde_json::json!({"type": ty}))).unwrap(),
            format!("{qemu},id=video0")
        );
    }
    assert_eq!(
        device(Some(serde_json::json!({"type": "qxl"})))
            .unwrap_err()
            .field,
        "spec.domain.devices.video.type"
    );
}

#[test]
fn hugepages_need_whole_pages() {
    let mut s = base_spec();
    s["domain"]["memory"] = serde_json::json!({"guest": "129Mi", "hugepages": {"pageSize": "2Mi"}});
    assert_eq!(
        conv(s.clone()).unwrap_err().field,
        "spec.domain.memory.guest"
    );
    s["domain"]["memory"]["guest"] = "128Mi".into();
    let p = conv(s).unwrap();
    assert_eq!(p.config.memory.hugepages, Some("/dev/hugepages".into()));
    assert!(
        p.config
            .argv()
            .join(" ")
            .contains("memory-backend=guest-ram")
    );
}

/// As libvirt renders KubeVirt's domain with filesystems: guest RAM from a shared memfd (or
/// shared hugepages), each filesystem a vhost-user-fs device on virtiofsd's socket in the
/// share dir, tagged with its name, after waiting for that socket.
#[test]
fn filesystems_share_guest_memory_with_virtiofsd() {
    let args = |s: serde_json::Value| {
        let argv = conv(s).unwrap().config.argv();
        argv.windows(2)
            .filter(|w| {
                w[0] == "-machine"
                    || (["-object", "-chardev", "-device"].contains(&w[0].as_str())
                        && (w[1].contains("guest-ram") || w[1].contains("-fs")))
            })
            .map(|w| format!("{} {}", w[0], w[1]))
            .collect::<Vec<_>>()
    };
    let mut s = base_spec();
    s["volumes"].as_array_mut().unwrap().extend([
        serde_json::json!({"name": "cfg", "configMap": {"name": "app"}}),
        serde_json::json!({"name": "data", "persistentVolumeClaim": {"claimName": "d"}}),
    ]);
    s["domain"]["devices"]["filesystems"] = serde_json::json!([
        {"name": "cfg", "virtiofs": {}},
        {"name": "data", "virtiofs": {}},
    ]);
    let plan = conv(s.clone()).unwrap();
    assert_eq!(
        plan.preps
            .iter()
            .filter_map(|p| match p {
                Prep::WaitForSocket {
                    path,
                    within,
                    field,
                } => Some((path.display().to_string(), *within, field.as_str())),
                _ => None,
            })
            .collect::<Vec<_>>(),
        [
            (
                "/s/virtiofs-containers/cfg.sock".to_owned(),
                VIRTIOFS_SOCKET_WAIT,
                "spec.domain.devices.filesystems[0]"
            ),
            (
                "/s/virtiofs-containers/data.sock".to_owned(),
                VIRTIOFS_SOCKET_WAIT,
                "spec.domain.devices.filesystems[1]"
            ),
        ]
    );
    assert_eq!(
        args(s.clone()),
        [
            "-machine q35,memory-backend=guest-ram",
            "-object memory-backend-memfd,id=guest-ram,size=128M,share=on",
            "-chardev socket,id=chr-vu-fs0,path=/s/virtiofs-containers/cfg.sock",
            "-device vhost-user-fs-pci,id=fs0,chardev=chr-vu-fs0,queue-size=1024,tag=cfg",
            "-chardev socket,id=chr-vu-fs1,path=/s/virtiofs-containers/data.sock",
            "-device vhost-user-fs-pci,id=fs1,chardev=chr-vu-fs1,queue-size=1024,tag=data",
        ]
    );
    s["domain"]["memory"] = serde_json::json!({"guest": "128Mi", "hugepages": {"pageSize": "2Mi"}});
    assert_eq!(
        args(s.clone())[..2],
        [
            "-machine q35,memory-backend=guest-ram",
            "-object memory-backend-file,id=guest-ram,size=128M,mem-path=/dev/hugepages,\
             prealloc=on,share=on",
        ]
    );
    // Without filesystems guest RAM stays QEMU's own, unshared.
    s["domain"]["devices"]["filesystems"] = serde_json::json!([]);
    s["domain"]["memory"] = serde_json::json!({"guest": "128Mi"});
    assert_eq!(args(s), ["-machine q35"]);
    // The launcher takes VMIs from virt-handler: a name QEMU cannot take is refused there too.
    let mut s = base_spec();
    s["domain"]["devices"]["filesystems"] = serde_json::json!([{"name": "a,b", "virtiofs": {}}]);
    assert_eq!(
        conv(s).unwrap_err().field,
        "spec.domain.devices.filesystems[0].name"
    );
}

#[test]
fn pvcs_are_files_or_block_devices_and_hotpluggable_ones_get_a_port() {
    let mut s = base_spec();
    s["domain"]["devices"]["disks"] = serde_json::json!([
        {"name": "fs", "disk": {}}, {"name": "blk", "disk": {}}, {"name": "hot", "disk": {}}
    ]);
    s["volumes"] = serde_json::json!([
        {"name": "fs", "persistentVolumeClaim": {"claimName": "a"}},
        {"name": "blk", "persistentVolumeClaim": {"claimName": "b", "readOnly": true}},
        {"name": "hot", "persistentVolumeClaim": {"claimName": "c", "hotpluggable": true}},
    ]);
    let mut h = host();
    h.block_volumes.insert("blk".into());
    let p = convert(&vmi(s), &dirs(), &h).unwrap();
    let d = &p.config.disks;
    assert_eq!(d[0].source.path, PathBuf::from("/p/vmi-disks/fs/disk.img"));
    assert!(!d[0].source.block_device);
    assert_eq!(d[1].source.path, PathBuf::from("/dev/blk"));
    assert!(d[1].source.block_device && d[1].read_only);
    assert_eq!(d[2].source.path, PathBuf::from("/h/hot.img"));
    assert_eq!(d[2].pci_bus.as_deref(), Some("hotplug-port0"));
    assert!(p.hotpluggable.contains("hot"));
    assert_eq!(
        p.config.controllers.hotplug_ports.len(),
        1 + SPARE_HOTPLUG_PORTS
    );
}

#[test]
fn bad_input_names_the_field() {
    let cases: Vec<(Mutation, &str)> = vec![
        (
            Box::new(|s| {
                s["volumes"].as_array_mut().unwrap().remove(0);
            }),
            "spec.domain.devices.disks[0].name",
        ),
        (
            Box::new(|s| s["domain"]["devices"]["disks"][0]["disk"]["bus"] = "usb".into()),
            "spec.domain.devices.disks[0].disk.bus",
        ),
        (
            Box::new(|s| s["domain"]["devices"]["disks"][0]["disk"]["bus"] = "ide".into()),
            "spec.domain.devices.disks[0].disk.bus",
        ),
        (
            Box::new(|s| s["domain"]["devices"]["disks"][1]["cdrom"]["bus"] = "virtio".into()),
            "spec.domain.devices.disks[1].cdrom.bus",
        ),
        (
            Box::new(|s| s["domain"]["machine"] = serde_json::json!({"type": "virt"})),
            "spec.domain.machine.type",
        ),
        (
            Box::new(|s| s["domain"]["resources"] = serde_json::json!({})),
            "spec.domain.memory.guest",
        ),
        (
            Box::new(|s| s["domain"]["resources"]["requests"]["memory"] = "lots".into()),
            "spec.domain.resources.requests.memory",
        ),
        (
            Box::new(|s| s["volumes"][2]["emptyDisk"]["capacity"] = "1Qi".into()),
            "spec.volumes[2].emptyDisk.capacity",
        ),
        (
            Box::new(|s| s["volumes"][1]["hostDisk"]["path"] = "relative.img".into()),
            "spec.volumes[1].hostDisk.path",
        ),
        (
            Box::new(|s| {
                s["volumes"][1]["hostDisk"] =
                    serde_json::json!({"path": "/x.img", "type": "DiskOrCreate"});
            }),
            "spec.volumes[1].hostDisk.capacity",
        ),
        (
            Box::new(|s| {
                s["volumes"][3]["cloudInitNoCloud"] = serde_json::json!({"userDataBase64": "!!!"});
            }),
            "spec.volumes[3].cloudInitNoCloud.userDataBase64",
        ),
        (
            Box::new(|s| {
                s["volumes"][1] = serde_json::json!({"name": "cd", "sysprep": {}});
            }),
            "spec.volumes[1].sysprep",
        ),
        (
            Box::new(|s| {
                s["domain"]["devices"]["disks"][1] = serde_json::json!({"name": "cd", "lun": {}});
            }),
            "spec.domain.devices.disks[1].lun",
        ),
        (
            Box::new(|s| {
                s["domain"]["devices"]["interfaces"] =
                    serde_json::json!([{"name": "default", "masquerade": {}}]);
            }),
            "spec.domain.devices.interfaces[0].name",
        ),
        (
            Box::new(|s| {
                s["domain"]["devices"]["interfaces"] =
                    serde_json::json!([{"name": "default", "sriov": {}}]);
                s["networks"] = serde_json::json!([{"name": "default", "pod": {}}]);
            }),
            "spec.domain.devices.interfaces[0].sriov",
        ),
        (
            Box::new(|s| s["domain"]["devices"]["disks"][0]["name"] = "a b".into()),
            "spec.domain.devices.disks[0].name",
        ),
    ];
    for (i, (mutate, field)) in cases.into_iter().enumerate() {
        let mut s = base_spec();
        mutate(&mut s);
        let e = conv(s).expect_err(&format!("case {i} should fail"));
        assert_eq!(e.field, field, "case {i}: {e}");
        assert!(!e.message.is_empty());
    }
}

#[test]
fn interfaces_use_taps_by_position() {
    let mut s = base_spec();
    s["domain"]["devices"]["interfaces"] = serde_json::json!([
        {"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:01"},
        {"name": "second", "bridge": {}, "model": "e1000"},
    ]);
    s["networks"] = serde_json::json!([
        {"name": "default", "pod": {}},
        {"name": "second", "multus": {"networkName": "n"}},
    ]);
    let p = conv(s).unwrap();
    assert_eq!(p.config.nics[0].tap, "tap0");
    assert_eq!(p.config.nics[1].tap, "tap1");
    assert_eq!(p.config.nics[1].model, NicModel::E1000);
    let joined = p.config.argv().join(" ");
    assert!(joined.contains("-netdev tap,id=netdev-default,ifname=tap0,script=no,downscript=no"));
    assert!(joined.contains(
        "virtio-net-pci-non-transitional,id=ua-default,netdev=netdev-default,\
             mac=02:00:00:00:00:01"
    ));
}

/// KubeVirt's converter tests ("virtio-net multi-queue") as libvirt renders `<driver
/// queues='N'/>`: the tap opened once per queue, the device with `mq` and `2N+2` vectors; a
/// non-virtio NIC of the same VMI keeps its single queue.
#[test]
fn network_multiqueue_gives_virtio_nics_a_queue_per_vcpu() {
    let mut s = base_spec();
    s["domain"]["cpu"] = serde_json::json!({"sockets": 1, "cores": 2, "threads": 2});
    s["domain"]["devices"]["networkInterfaceMultiqueue"] = true.into();
    s["domain"]["devices"]["interfaces"] = serde_json::json!([
        {"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:01"},
        {"name": "other", "bridge": {}, "model": "e1000", "macAddress": "02:00:00:00:00:02"},
    ]);
    s["networks"] =
        serde_json::json!([{"name": "default", "pod": {}}, {"name": "other", "pod": {}}]);
    let joined = conv(s.clone()).unwrap().config.argv().join(" ");
    assert!(
        joined.contains(
            "-netdev tap,id=netdev-default,ifname=tap0,script=no,downscript=no,queues=4 \
             -device virtio-net-pci-non-transitional,id=ua-default,netdev=netdev-default,\
             mq=on,vectors=10,mac=02:00:00:00:00:01"
        ),
        "{joined}"
    );
    assert!(
        joined.contains(
            "-netdev tap,id=netdev-other,ifname=tap1,script=no,downscript=no \
             -device e1000,id=ua-other,netdev=netdev-other,mac=02:00:00:00:00:02"
        ),
        "{joined}"
    );
    // One vCPU: one queue, rendered as without multiqueue (libvirt adds nothing for 1).
    s["domain"]["cpu"] = serde_json::json!({"sockets": 1, "cores": 1, "threads": 1});
    let joined = conv(s).unwrap().config.argv().join(" ");
    assert!(
        joined.contains(
            "ifname=tap0,script=no,downscript=no -device virtio-net-pci-non-transitional,\
             id=ua-default,netdev=netdev-default,mac=02:00:00:00:00:01"
        ),
        "{joined}"
    );
}

proptest! {
    /// Whatever strings a VMI carries, conversion returns (never panics), and every value that
    /// reaches an option list comes back intact when the list is split.
    #[test]
    fn never_panics_and_escapes(
        path in "/[ -~]{0,40}",
        serial in "[ -~]{0,20}",
        args in "[ -~]{0,40}",
        name in "[a-z0-9]{1,10}",
        mem in "[0-9]{0,6}[KMG]?i?",
    ) {
        let mut s = base_spec();
        s["volumes"][1]["hostDisk"]["path"] = path.clone().into();
        s["domain"]["devices"]["disks"][1]["serial"] = serial.clone().into();
        s["domain"]["firmware"] = serde_json::json!({"serial": serial.clone(),
            "kernelBoot": {"kernelArgs": args.clone(),
            "container": {"image": "k", "kernelPath": "/k"}}});
        s["domain"]["resources"]["requests"]["memory"] = mem.into();
        let mut v = vmi(s);
        v.metadata.name = Some(name);
        if let Ok(plan) = convert(&v, &dirs(), &host()) {
            let argv = plan.config.argv();
            let mut found_path = false;
            for pair in argv.windows(2) {
                if pair[0] == "-blockdev" || pair[0] == "-device" || pair[0] == "-smbios" {
                    let parts = crate::qemu::opts::split_keyval(&pair[1]);
                    let want_path = format!("file.filename={path}");
                    if parts.contains(&want_path) {
                        found_path = true;
                    }
                    if pair[0] == "-smbios" && !serial.is_empty() {
                        let want = format!("serial={serial}");
                        prop_assert!(parts.contains(&want));
                    }
                }
                if pair[0] == "-append" {
                    prop_assert_eq!(&pair[1], &args);
                }
            }
            prop_assert!(found_path, "{:?}", argv);
        }
    }
}

#[test]
fn interfaces_take_mac_and_mtu_from_phase_one() {
    let mut s = base_spec();
    s["domain"]["devices"]["interfaces"] = serde_json::json!([
        {"name": "default", "bridge": {}},
        {"name": "other", "masquerade": {}, "model": "e1000"},
    ]);
    s["networks"] =
        serde_json::json!([{"name": "default", "pod": {}}, {"name": "other", "pod": {}}]);
    let cached = network::CachedInterface {
        name: "default".into(),
        binding: network::Binding::Bridge,
        pod_interface: "eth0".into(),
        bridge: "k6t-eth0".into(),
        tap: "tap0".into(),
        mtu: 1400,
        pod_mac: "0a:58:0a:f4:00:05".into(),
        pod_ipv4: None,
        routes: vec![],
        guest_ipv4: None,
        gateway_ipv4: None,
        server_ipv4: std::net::Ipv4Addr::new(169, 254, 75, 10),
        guest_ipv6: None,
        gateway_ipv6: None,
    };
    let mut h = host();
    h.network.insert("default".into(), cached);
    let p = convert(&vmi(s.clone()), &dirs(), &h).unwrap();
    let joined = p.config.argv().join(" ");
    // A bridged guest takes the pod's MAC; virtio is told the pod's MTU.
    assert!(
        joined.contains(
            "virtio-net-pci-non-transitional,id=ua-default,netdev=netdev-default,\
             mac=0a:58:0a:f4:00:05,host_mtu=1400"
        ),
        "{joined}"
    );
    // No cache: a MAC derived from the uid and the name, the same on every conversion.
    let mac = p.config.nics[1].mac.clone().unwrap();
    assert!(mac.starts_with("52:54:00:"), "{mac}");
    assert!(
        joined.contains(&format!("e1000,id=ua-other,netdev=netdev-other,mac={mac}")),
        "{joined}"
    );
    assert_eq!(
        convert(&vmi(s), &dirs(), &h).unwrap().config.nics[1].mac,
        Some(mac)
    );
}

/// The `-rtc`, `-global` and `-machine` arguments of a spec.
fn clock_args(s: serde_json::Value, accel: Accel) -> Result<Vec<[String; 2]>, ConvertError> {
    let mut h = host();
    h.accel = accel;
    let argv = convert(&vmi(s), &dirs(), &h)?.config.argv();
    Ok(argv
        .windows(2)
        .filter(|w| ["-rtc", "-global", "-machine", "-cpu"].contains(&w[0].as_str()))
        .map(|w| [w[0].clone(), w[1].clone()])
        .collect())
}

fn arg(flag: &str, value: &str) -> [String; 2] {
    [flag.to_owned(), value.to_owned()]
}

#[test]
fn clock_and_timers_render_as_libvirt_renders_them() {
    let with_clock = |clock: serde_json::Value| {
        let mut s = base_spec();
        s["domain"]["clock"] = clock;
        s
    };
    let args = clock_args(base_spec(), Accel::Tcg).unwrap();
    assert!(args.contains(&arg("-rtc", "base=utc")), "{args:?}");
    assert!(args.contains(&arg("-machine", "q35")), "{args:?}");

    let args = clock_args(
        with_clock(serde_json::json!({"utc": {}, "timer": {
            "hpet": {"present": false},
            "rtc": {"present": true, "tickPolicy": "catchup", "track": "guest"},
        }})),
        Accel::Tcg,
    )
    .unwrap();
    assert!(
        args.contains(&arg("-rtc", "base=utc,clock=vm,driftfix=slew")),
        "{args:?}"
    );
    assert!(args.contains(&arg("-machine", "q35,hpet=off")), "{args:?}");
    let args = clock_args(
        with_clock(serde_json::json!({"timer": {
            "hpet": {"present": true}, "rtc": {"tickPolicy": "delay", "track": "wall"},
        }})),
        Accel::Tcg,
    )
    .unwrap();
    assert!(
        args.contains(&arg("-rtc", "base=utc,clock=host")),
        "{args:?}"
    );
    assert!(args.contains(&arg("-machine", "q35,hpet=on")), "{args:?}");

    // An offset clock starts at the UTC time that far from now, which the argv carries as a
    // date: an hour ahead of the time around the conversion. A time zone clock starts at the
    // zone's local time: India has kept +05:30 all year since 1945, so the offset does not
    // depend on the day this runs.
    for (clock, offset) in [
        (serde_json::json!({"utc": {"offsetSeconds": 3600}}), 3600),
        (
            serde_json::json!({"timezone": "Asia/Kolkata"}),
            5 * 3600 + 1800,
        ),
    ] {
        let fmt = |t: std::time::SystemTime| {
            crate::qemu::Clock {
                utc_offset: Some(offset),
                ..crate::qemu::Clock::default()
            }
            .rtc(t)
        };
        let before = fmt(std::time::SystemTime::now());
        let args = clock_args(with_clock(clock), Accel::Tcg).unwrap();
        let after = fmt(std::time::SystemTime::now());
        let rtc = &args.iter().find(|a| a[0] == "-rtc").unwrap()[1];
        assert!(
            before.as_str() <= rtc.as_str() && rtc.as_str() <= after.as_str(),
            "{before} <= {rtc} <= {after}"
        );
    }

    for (clock, field) in [
        (
            serde_json::json!({"timezone": "Mars/Olympus_Mons"}),
            "spec.domain.clock.timezone",
        ),
        (
            serde_json::json!({"timer": {"rtc": {"present": false}}}),
            "spec.domain.clock.timer.rtc.present",
        ),
        (
            serde_json::json!({"timer": {"rtc": {"tickPolicy": "merge"}}}),
            "spec.domain.clock.timer.rtc.tickPolicy",
        ),
        (
            serde_json::json!({"timer": {"pit": {"present": false}}}),
            "spec.domain.clock.timer.pit.present",
        ),
        (
            serde_json::json!({"timer": {"hpet": {"tickPolicy": "merge"}}}),
            "spec.domain.clock.timer.hpet.tickPolicy",
        ),
    ] {
        assert_eq!(
            clock_args(with_clock(clock), Accel::Kvm).unwrap_err().field,
            field
        );
    }
}

#[test]
fn timers_only_kvm_has_are_refused_under_tcg() {
    let with_timer = |timer: serde_json::Value| {
        let mut s = base_spec();
        s["domain"]["clock"] = serde_json::json!({"timer": timer});
        s
    };
    // The PIT's lost tick policy is a property of KVM's in-kernel PIT; libvirt sets `delay`
    // when none is given, and catch-up is that PIT's own behaviour.
    for (pit, global) in [
        (
            serde_json::json!({}),
            Some("kvm-pit.lost_tick_policy=delay"),
        ),
        (
            serde_json::json!({"tickPolicy": "delay"}),
            Some("kvm-pit.lost_tick_policy=delay"),
        ),
        (
            serde_json::json!({"tickPolicy": "discard"}),
            Some("kvm-pit.lost_tick_policy=discard"),
        ),
        (serde_json::json!({"tickPolicy": "catchup"}), None),
    ] {
        let args = clock_args(with_timer(serde_json::json!({"pit": pit})), Accel::Kvm).unwrap();
        let globals: Vec<_> = args.iter().filter(|a| a[0] == "-global").collect();
        assert_eq!(
            globals,
            global.map(|g| arg("-global", g)).iter().collect::<Vec<_>>(),
            "{pit}"
        );
    }
    let args = clock_args(with_timer(serde_json::json!({"pit": {}})), Accel::Tcg).unwrap();
    assert!(!args.iter().any(|a| a[0] == "-global"), "{args:?}");
    let args = clock_args(with_timer(serde_json::json!({"kvm": {}})), Accel::Kvm).unwrap();
    assert!(args.contains(&arg("-cpu", "host,kvmclock=on")), "{args:?}");
    let args = clock_args(
        with_timer(serde_json::json!({"kvm": {"present": false}, "hyperv": {"present": false}})),
        Accel::Tcg,
    )
    .unwrap();
    assert!(args.contains(&arg("-cpu", "max,kvmclock=off")), "{args:?}");
    for (timer, field) in [
        (
            serde_json::json!({"pit": {"tickPolicy": "delay"}}),
            "spec.domain.clock.timer.pit.tickPolicy",
        ),
        (
            serde_json::json!({"kvm": {"present": true}}),
            "spec.domain.clock.timer.kvm.present",
        ),
    ] {
        let e = clock_args(with_timer(timer), Accel::Tcg).unwrap_err();
        assert_eq!(e.field, field);
        assert!(e.message.contains("TCG"), "{e}");
    }
    // The Hyper-V clock is a Hyper-V enlightenment, as unsupported as `features.hyperv`.
    let e = clock_args(with_timer(serde_json::json!({"hyperv": {}})), Accel::Kvm).unwrap_err();
    assert_eq!(e.field, "spec.domain.clock.timer.hyperv.present");
}

#[test]
fn features_render_on_the_machine_and_the_cpu() {
    let with_features = |features: serde_json::Value| {
        let mut s = base_spec();
        s["domain"]["features"] = features;
        s
    };
    let args = clock_args(
        with_features(serde_json::json!({
            "acpi": {"enabled": false}, "kvm": {"hidden": true}, "pvspinlock": {"enabled": true},
        })),
        Accel::Kvm,
    )
    .unwrap();
    assert!(args.contains(&arg("-machine", "q35,acpi=off")), "{args:?}");
    assert!(
        args.contains(&arg("-cpu", "host,kvm=off,kvm-pv-unhalt=on")),
        "{args:?}"
    );
    let args = clock_args(
        with_features(serde_json::json!({
            "acpi": {"enabled": true}, "kvm": {"hidden": false}, "pvspinlock": {"enabled": false},
        })),
        Accel::Tcg,
    )
    .unwrap();
    assert!(args.contains(&arg("-machine", "q35")), "{args:?}");
    assert!(
        args.contains(&arg("-cpu", "max,kvm-pv-unhalt=off")),
        "{args:?}"
    );
    let args = clock_args(
        with_features(serde_json::json!({"kvm": {"hidden": true}})),
        Accel::Tcg,
    )
    .unwrap();
    assert!(args.contains(&arg("-cpu", "max,kvm=off")), "{args:?}");
    let e = clock_args(
        with_features(serde_json::json!({"pvspinlock": {}})),
        Accel::Tcg,
    )
    .unwrap_err();
    assert_eq!(e.field, "spec.domain.features.pvspinlock");
}

/// The `-blockdev` and `-device` arguments of disk `name`.
fn disk_args(argv: &[String], name: &str) -> (String, String) {
    let node = format!("node-name={}", crate::qemu::node_name(name));
    let id = format!(",id=ua-{name},");
    let find = |flag: &str, needle: &str| {
        argv.windows(2)
            .find(|w| w[0] == flag && w[1].contains(needle))
            .map_or_else(
                || panic!("no {flag} with {needle} in {argv:?}"),
                |w| w[1].clone(),
            )
    };
    (find("-blockdev", &node), find("-device", &id))
}

#[test]
fn disk_io_error_policy_and_sharing() {
    let mut s = base_spec();
    let disks = &mut s["domain"]["devices"]["disks"];
    disks[0]["io"] = "native".into();
    disks[0]["errorPolicy"] = "report".into();
    disks[2]["errorPolicy"] = "enospace".into();
    disks[2]["io"] = "threads".into();
    disks[3]["shareable"] = true.into();
    disks[3]["errorPolicy"] = "ignore".into();
    let argv = conv(s.clone()).unwrap().config.argv();
    // Native AIO bypasses the host page cache, so an unset cache is none.
    let (blockdev, device) = disk_args(&argv, "root");
    assert!(
        blockdev.contains("cache.direct=on") && blockdev.ends_with("file.aio=native"),
        "{blockdev}"
    );
    assert!(device.contains(",werror=report,rerror=report"), "{device}");
    // enospace is QEMU's enospc, for writes only.
    let (blockdev, device) = disk_args(&argv, "scratch");
    assert!(blockdev.ends_with("file.aio=threads"), "{blockdev}");
    assert!(device.ends_with(",werror=enospc"), "{device}");
    // A shareable disk is opened for other writers, and bypasses the cache as KubeVirt makes it.
    let (blockdev, device) = disk_args(&argv, "ci");
    assert!(blockdev.contains("cache.direct=on"), "{blockdev}");
    assert!(
        device.ends_with(",werror=ignore,rerror=ignore,share-rw=on"),
        "{device}"
    );
    // KubeVirt's default error policy is stop, on every disk.
    let (_, device) = disk_args(&argv, "cd");
    assert!(device.ends_with(",werror=stop,rerror=stop"), "{device}");

    let cases: Vec<(Mutation, &str)> = vec![
        (
            Box::new(|s| s["domain"]["devices"]["disks"][0]["cache"] = "writeback".into()),
            "spec.domain.devices.disks[0].io",
        ),
        (
            Box::new(|s| s["domain"]["devices"]["disks"][3]["cache"] = "writethrough".into()),
            "spec.domain.devices.disks[3].cache",
        ),
        (
            Box::new(|s| s["domain"]["devices"]["disks"][1]["shareable"] = true.into()),
            "spec.domain.devices.disks[1].shareable",
        ),
        (
            Box::new(|s| s["domain"]["devices"]["disks"][2]["errorPolicy"] = "retry".into()),
            "spec.domain.devices.disks[2].errorPolicy",
        ),
    ];
    for (mutate, field) in cases {
        let mut bad = s.clone();
        mutate(&mut bad);
        assert_eq!(conv(bad).unwrap_err().field, field);
    }

    // KubeVirt gives a block device whose cache is bypassed native AIO unless io says otherwise.
    let mut s = base_spec();
    s["domain"]["devices"]["disks"] = serde_json::json!([
        {"name": "blk", "disk": {}, "cache": "none"},
        {"name": "threads", "disk": {}, "cache": "none", "io": "threads"},
    ]);
    s["volumes"] = serde_json::json!([
        {"name": "blk", "persistentVolumeClaim": {"claimName": "b"}},
        {"name": "threads", "persistentVolumeClaim": {"claimName": "t"}},
    ]);
    let mut h = host();
    h.block_volumes.extend(["blk".into(), "threads".into()]);
    let argv = convert(&vmi(s), &dirs(), &h).unwrap().config.argv();
    assert!(disk_args(&argv, "blk").0.ends_with("file.aio=native"));
    assert!(disk_args(&argv, "threads").0.ends_with("file.aio=threads"));
}

#[test]
fn block_multi_queue_gives_virtio_disks_a_queue_per_vcpu() {
    let mut s = base_spec();
    s["domain"]["cpu"] = serde_json::json!({"sockets": 2, "cores": 2, "threads": 1});
    s["domain"]["devices"]["blockMultiQueue"] = true.into();
    let argv = conv(s).unwrap().config.argv();
    assert!(disk_args(&argv, "root").1.contains(",num-queues=4"));
    assert!(!disk_args(&argv, "scratch").1.contains("num-queues"));
    let argv = conv(base_spec()).unwrap().config.argv();
    assert!(!disk_args(&argv, "root").1.contains("num-queues"));
}

#[test]
fn io_threads_are_shared_or_dedicated_as_kubevirt_assigns_them() {
    let objects = |argv: &[String]| {
        argv.windows(2)
            .filter(|w| w[0] == "-object" && w[1].starts_with("iothread,"))
            .map(|w| w[1].clone())
            .collect::<Vec<_>>()
    };
    let iothread = |argv: &[String], name: &str| {
        let device = disk_args(argv, name).1;
        device
            .split(',')
            .find_map(|p| p.strip_prefix("iothread=").map(str::to_owned))
    };
    // No policy and no dedicated disk: no IOThreads.
    let argv = conv(base_spec()).unwrap().config.argv();
    assert!(objects(&argv).is_empty());
    assert_eq!(iothread(&argv, "root"), None);

    // One dedicated disk: every other disk shares thread 1 (the shared policy's limit), the
    // dedicated one takes the next; sata and cdrom disks count but take none.
    let mut s = base_spec();
    s["domain"]["devices"]["disks"][3]["dedicatedIOThread"] = true.into();
    let argv = conv(s.clone()).unwrap().config.argv();
    assert_eq!(
        objects(&argv),
        ["iothread,id=iothread1", "iothread,id=iothread2"]
    );
    assert_eq!(iothread(&argv, "root").as_deref(), Some("iothread1"));
    assert_eq!(iothread(&argv, "ci").as_deref(), Some("iothread2"));
    assert_eq!(iothread(&argv, "scratch"), None);

    // auto: two threads per requested CPU, handed out in turn.
    s["domain"]["ioThreadsPolicy"] = "auto".into();
    s["domain"]["resources"]["requests"]["cpu"] = "1".into();
    s["domain"]["devices"]["disks"] = serde_json::json!([
        {"name": "root", "disk": {}}, {"name": "cd", "disk": {}},
        {"name": "scratch", "disk": {}}, {"name": "ci", "disk": {}},
    ]);
    let argv = conv(s.clone()).unwrap().config.argv();
    assert_eq!(objects(&argv).len(), 2);
    let threads: Vec<_> = ["root", "cd", "scratch", "ci"]
        .iter()
        .map(|d| iothread(&argv, d).unwrap())
        .collect();
    assert_eq!(
        threads,
        ["iothread1", "iothread2", "iothread1", "iothread2"]
    );

    // A SCSI disk with a dedicated thread puts the SCSI controller on the shared thread after
    // those the virtio disks took (2 CPUs: 3 shared threads, the 4th dedicated), with a queue
    // per vCPU.
    s["domain"]["resources"]["requests"]["cpu"] = "2".into();
    s["domain"]["devices"]["disks"][1] =
        serde_json::json!({"name": "cd", "disk": {"bus": "scsi"}, "dedicatedIOThread": true});
    s["domain"]["devices"]["disks"][3]["disk"]["bus"] = "sata".into();
    let argv = conv(s.clone()).unwrap().config.argv();
    assert_eq!(objects(&argv).len(), 4);
    assert_eq!(iothread(&argv, "scratch").as_deref(), Some("iothread2"));
    assert!(
        argv.iter()
            .any(|a| a
                == "virtio-scsi-pci-non-transitional,id=scsi0,iothread=iothread3,num_queues=1"),
        "{argv:?}"
    );
    s["domain"]["ioThreadsPolicy"] = "supplementalPool".into();
    assert_eq!(conv(s).unwrap_err().field, "spec.domain.ioThreadsPolicy");
}

#[test]
fn disk_pci_addresses_are_on_the_root_bus_before_other_devices() {
    let mut s = base_spec();
    s["domain"]["devices"]["disks"][3]["disk"]["pciAddress"] = "0000:00:0a.0".into();
    s["domain"]["devices"]["disks"][0]["disk"]["pciAddress"] = "0000:00:0a.3".into();
    let argv = conv(s.clone()).unwrap().config.argv();
    assert!(disk_args(&argv, "ci").1.contains(",bus=pcie.0,addr=0xa,"));
    assert!(
        disk_args(&argv, "root")
            .1
            .contains(",bus=pcie.0,addr=0xa.0x3,")
    );
    // Placed before the controllers, whose slots QEMU picks around them.
    let position = |needle: &str| argv.iter().position(|a| a.contains(needle)).unwrap();
    assert!(position("addr=0xa") < position("ahci,id=sata0"));
    s["domain"]["machine"] = serde_json::json!({"type": "pc"});
    let argv = conv(s.clone()).unwrap().config.argv();
    assert!(disk_args(&argv, "ci").1.contains(",bus=pci.0,addr=0xa,"));

    // A root port has slot 0 only.
    for (address, bus) in [("0000:01:05.0", "virtio"), ("0000:00:03.0", "sata")] {
        let mut bad = base_spec();
        bad["domain"]["devices"]["disks"][3]["disk"] =
            serde_json::json!({"bus": bus, "pciAddress": address});
        assert_eq!(
            conv(bad).unwrap_err().field,
            "spec.domain.devices.disks[3].disk.pciAddress"
        );
    }
}

#[test]
fn pci_addresses_off_the_root_bus_get_the_controllers_libvirt_adds() {
    let mut s = base_spec();
    // A disk and a NIC sharing the slot of root port 2 (libvirt's bus 2), root port 1 empty.
    s["domain"]["devices"]["disks"][3]["disk"]["pciAddress"] = "0000:02:00.0".into();
    s["domain"]["devices"]["interfaces"] = serde_json::json!([
        {"name": "default", "masquerade": {}, "pciAddress": "0000:02:00.1"},
    ]);
    s["networks"] = serde_json::json!([{"name": "default", "pod": {}}]);
    let argv = conv(s.clone()).unwrap().config.argv();
    let device = |prefix: &str| {
        argv.iter()
            .position(|a| a.starts_with(prefix))
            .unwrap_or_else(|| panic!("{prefix} in {argv:?}"))
    };
    let port1 = device("pcie-root-port,id=pci.1,bus=pcie.0,addr=0x1,multifunction=on,chassis=1");
    let port2 = device("pcie-root-port,id=pci.2,bus=pcie.0,addr=0x1.0x1,chassis=2");
    let disk = disk_args(&argv, "ci").1;
    assert!(
        disk.contains(",bus=pci.2,addr=0x0,multifunction=on,"),
        "{disk}"
    );
    let nic = device("virtio-net-pci-non-transitional,id=ua-default,");
    assert!(
        argv[nic].contains(",bus=pci.2,addr=0x0.0x1"),
        "{}",
        argv[nic]
    );
    // The buses first, so that they are the lowest on the root bus and firmware numbers them
    // 1 and 2; the hotplug ports' chassis come after theirs.
    assert!(port1 < port2 && port2 < nic);
    assert!(argv[device("pcie-root-port,id=hotplug-port0,")].ends_with(",chassis=3"));
    // A conventional PCI NIC: libvirt's root port holding a pcie-to-pci-bridge, onto which
    // the NIC moves (bus 1 asked, bus 2 given: the bridge is the first bus that takes it).
    s["domain"]["devices"]["disks"][3]["disk"]
        .as_object_mut()
        .unwrap()
        .remove("pciAddress");
    s["domain"]["devices"]["interfaces"] = serde_json::json!([
        {"name": "default", "masquerade": {}, "model": "e1000", "pciAddress": "0000:01:03.0"},
    ]);
    let argv = conv(s.clone()).unwrap().config.argv();
    for pair in [
        [
            "-device",
            "pcie-root-port,id=pci.1,bus=pcie.0,addr=0x1,chassis=1",
        ],
        ["-device", "pcie-pci-bridge,id=pci.2,bus=pci.1,addr=0x0"],
    ] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    assert!(
        argv.iter()
            .any(|a| a.starts_with("e1000,id=ua-default,") && a.contains(",bus=pci.2,addr=0x3")),
        "{argv:?}"
    );
    // Slot 0 of the bridge is its hotplug controller's.
    s["domain"]["devices"]["interfaces"][0]["pciAddress"] = "0000:01:00.0".into();
    let e = conv(s).unwrap_err();
    assert_eq!(e.field, "spec.domain.devices.interfaces[0].pciAddress");
    assert!(e.message.contains("slot must be 01-1f"), "{e}");
}

/// The devices (QEMU's driver names) a spec's command line has.
fn drivers(s: serde_json::Value) -> BTreeSet<String> {
    conv(s)
        .unwrap()
        .config
        .argv()
        .windows(2)
        .filter(|w| w[0] == "-device")
        .map(|w| w[1].split(',').next().unwrap().to_owned())
        .collect()
}

#[test]
fn virtio_devices_are_modern_only_unless_transitional_is_asked_for() {
    let mut s = base_spec();
    s["domain"]["devices"]["rng"] = serde_json::json!({});
    s["domain"]["devices"]["interfaces"] =
        serde_json::json!([{"name": "default", "masquerade": {}}]);
    s["networks"] = serde_json::json!([{"name": "default", "pod": {}}]);
    let virtio = [
        "virtio-blk-pci",
        "virtio-scsi-pci",
        "virtio-serial-pci",
        "virtio-net-pci",
        "virtio-rng-pci",
        "virtio-balloon-pci",
    ];
    // KubeVirt's default model is virtio-non-transitional.
    let found = drivers(s.clone());
    for device in virtio {
        assert!(
            found.contains(&format!("{device}-non-transitional")),
            "{device}: {found:?}"
        );
    }
    s["domain"]["devices"]["useVirtioTransitional"] = true.into();
    let found = drivers(s);
    for device in virtio {
        assert!(
            found.contains(&format!("{device}-transitional")),
            "{device}: {found:?}"
        );
        assert!(!found.contains(device), "{device}: {found:?}");
    }
}

#[test]
fn interfaces_take_pci_addresses_and_acpi_indexes() {
    let mut s = base_spec();
    s["domain"]["devices"]["interfaces"] = serde_json::json!([
        {"name": "default", "masquerade": {}, "pciAddress": "0000:00:0b.0", "acpiIndex": 3},
        {"name": "second", "bridge": {}, "model": "e1000", "acpiIndex": 16383},
    ]);
    s["networks"] = serde_json::json!([
        {"name": "default", "pod": {}},
        {"name": "second", "multus": {"networkName": "n"}},
    ]);
    let argv = conv(s.clone()).unwrap().config.argv();
    let device = |id: &str| {
        argv.iter()
            .position(|a| a.contains(&format!(",id=ua-{id},")))
            .unwrap()
    };
    assert!(
        argv[device("default")].ends_with(",bus=pcie.0,addr=0xb,acpi-index=3"),
        "{argv:?}"
    );
    assert!(
        argv[device("second")].ends_with(",acpi-index=16383"),
        "{argv:?}"
    );
    // Placed before the devices QEMU places.
    let controller = argv.iter().position(|a| a.starts_with("ahci,")).unwrap();
    assert!(device("default") < controller && controller < device("second"));
    for (iface, field) in [
        (
            serde_json::json!({"name": "default", "masquerade": {}, "pciAddress": "0000:02:01.0"}),
            "spec.domain.devices.interfaces[0].pciAddress",
        ),
        (
            serde_json::json!({"name": "default", "masquerade": {}, "acpiIndex": 0}),
            "spec.domain.devices.interfaces[0].acpiIndex",
        ),
    ] {
        let mut bad = s.clone();
        bad["domain"]["devices"]["interfaces"] = serde_json::json!([iface]);
        assert_eq!(conv(bad).unwrap_err().field, field);
    }
}

#[test]
fn autoattach_input_device_adds_kubevirts_usb_tablet() {
    let mut s = base_spec();
    s["domain"]["devices"]["autoattachInputDevice"] = true.into();
    let argv = conv(s.clone()).unwrap().config.argv();
    for pair in [
        ["-device", "qemu-xhci,id=usb0"],
        ["-device", "usb-tablet,id=ua-default-0,bus=usb0.0"],
    ] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    // Inputs given are all there is, as KubeVirt adds its tablet only to a VMI without any.
    s["domain"]["devices"]["inputs"] =
        serde_json::json!([{"name": "t", "type": "tablet", "bus": "virtio"}]);
    let argv = conv(s.clone()).unwrap().config.argv();
    assert!(
        !argv
            .iter()
            .any(|a| a.contains("default-0") || a.contains("xhci"))
    );
    s["domain"]["devices"]["inputs"] = serde_json::json!([]);
    s["domain"]["devices"]["autoattachInputDevice"] = false.into();
    let argv = conv(s).unwrap().config.argv();
    assert!(!argv.iter().any(|a| a.contains("tablet")));
}

/// KubeVirt's CPU and memory hotplug bounds (`maxSockets`, `maxGuest`, which its defaults set
/// under the LiveUpdate rollout): QEMU's topology has every socket, only `sockets` of them
/// present, and its memory map room up to `maxGuest`. Equal bounds give neither.
#[test]
fn hotplug_bounds_become_maxcpus_and_maxmem() {
    let mut s = base_spec();
    s["domain"]["cpu"] =
        serde_json::json!({"sockets": 2, "cores": 1, "threads": 2, "maxSockets": 8});
    s["domain"]["memory"] = serde_json::json!({"guest": "1Gi", "maxGuest": "4Gi"});
    let argv = conv(s.clone()).unwrap().config.argv();
    for pair in [
        ["-smp", "4,maxcpus=16,sockets=8,cores=1,threads=2"],
        ["-m", "1024M,maxmem=4096M"],
    ] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    s["domain"]["cpu"]["maxSockets"] = serde_json::json!(2);
    s["domain"]["memory"]["maxGuest"] = serde_json::json!("1Gi");
    let argv = conv(s.clone()).unwrap().config.argv();
    for pair in [["-smp", "4,sockets=2,cores=1,threads=2"], ["-m", "1024M"]] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    s["domain"]["memory"]["maxGuest"] = serde_json::json!("512Mi");
    let e = conv(s).unwrap_err().to_string();
    assert!(
        e.contains("spec.domain.memory.maxGuest") && e.contains("less than"),
        "{e}"
    );
}

#[test]
fn topology_smm_and_firmware_render_as_asked() {
    let mut s = base_spec();
    s["domain"]["cpu"] = serde_json::json!({"sockets": 1, "cores": 2, "threads": 2});
    s["domain"]["features"] = serde_json::json!({"smm": {"enabled": false}});
    s["domain"]["firmware"] = serde_json::json!({
        "bootloader": {"bios": {}}, "uuid": "5d307ca9-b3ef-428c-8861-06e72d69f223",
    });
    let argv = conv(s.clone()).unwrap().config.argv();
    for pair in [
        ["-smp", "4,sockets=1,cores=2,threads=2"],
        ["-machine", "q35,smm=off"],
        ["-uuid", "5d307ca9-b3ef-428c-8861-06e72d69f223"],
    ] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    // BIOS: SeaBIOS, QEMU's own, with no flash drives.
    assert!(!argv.iter().any(|a| a.contains("pflash")), "{argv:?}");
    s["domain"]["features"] = serde_json::json!({"smm": {}});
    let argv = conv(s.clone()).unwrap().config.argv();
    assert!(argv.windows(2).any(|w| w == ["-machine", "q35,smm=on"]));
    // SeaBIOS on the serial console, as libvirt renders `<bios useserial='yes'/>`.
    s["domain"]["firmware"]["bootloader"]["bios"]["useSerial"] = true.into();
    let argv = conv(s.clone()).unwrap().config.argv();
    assert!(
        argv.windows(2)
            .any(|w| w == ["-machine", "q35,smm=on,graphics=off"]),
        "{argv:?}"
    );
    s["domain"]["firmware"]["uuid"] = "not-a-uuid".into();
    assert_eq!(conv(s).unwrap_err().field, "spec.domain.firmware.uuid");
}

#[test]
fn autoattached_devices_and_hotplug_can_be_turned_off() {
    let mut s = base_spec();
    s["domain"]["devices"]["disks"] = serde_json::json!([{"name": "root", "disk": {}}]);
    s["volumes"] = serde_json::json!([{"name": "root", "containerDisk": {"image": "x"}}]);
    let all = drivers(s.clone());
    for device in [
        "isa-serial",
        "virtio-balloon-pci-non-transitional",
        "virtio-scsi-pci-non-transitional",
    ] {
        assert!(all.iter().any(|d| d == device), "{device}: {all:?}");
    }
    s["domain"]["devices"]["autoattachSerialConsole"] = false.into();
    s["domain"]["devices"]["autoattachMemBalloon"] = false.into();
    // Without hotplug there is no SCSI controller kept for disks plugged later.
    s["domain"]["devices"]["disableHotplug"] = true.into();
    let fewer = drivers(s);
    for device in ["isa-serial", "virtio-balloon", "virtio-scsi"] {
        assert!(
            !fewer.iter().any(|d| d.starts_with(device)),
            "{device}: {fewer:?}"
        );
    }
}

#[test]
fn readonly_disks_and_interface_boot_order_reach_the_devices() {
    let mut s = base_spec();
    s["domain"]["devices"]["disks"][0]["disk"]["readonly"] = true.into();
    s["domain"]["devices"]["disks"][0]
        .as_object_mut()
        .unwrap()
        .remove("bootOrder");
    s["domain"]["devices"]["interfaces"] =
        serde_json::json!([{"name": "default", "masquerade": {}, "bootOrder": 1}]);
    s["networks"] = serde_json::json!([{"name": "default", "pod": {}}]);
    let argv = conv(s).unwrap().config.argv();
    assert!(disk_args(&argv, "root").0.contains(",read-only=on,"));
    assert!(!disk_args(&argv, "ci").0.contains(",read-only=on,"));
    assert!(
        argv.iter()
            .any(|a| a.contains("id=ua-default,") && a.ends_with(",bootindex=1")),
        "{argv:?}"
    );
}

#[test]
fn cloud_init_network_data_and_base64_forms_reach_the_seed() {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let seed = |source: &str, data: serde_json::Value| {
        let mut s = base_spec();
        s["volumes"][3] = serde_json::json!({"name": "ci", source: data});
        conv(s)
            .unwrap()
            .preps
            .into_iter()
            .find_map(|p| match p {
                Prep::CloudInit { seed, .. } => Some(seed),
                _ => None,
            })
            .unwrap()
    };
    for source in ["cloudInitNoCloud", "cloudInitConfigDrive"] {
        let inline = seed(
            source,
            serde_json::json!({"userData": "#cloud-config\n", "networkData": "version: 2\n"}),
        );
        let encoded = seed(
            source,
            serde_json::json!({
                "userDataBase64": b64("#cloud-config\n"), "networkDataBase64": b64("version: 2\n"),
            }),
        );
        for s in [&inline, &encoded] {
            assert_eq!(
                s.user_data,
                SeedData::Inline(b"#cloud-config\n".to_vec()),
                "{source}"
            );
            assert_eq!(
                s.network_data,
                Some(SeedData::Inline(b"version: 2\n".to_vec())),
                "{source}"
            );
        }
        // Secret references: read at start from where the pod mounts them, KubeVirt's keys.
        let referenced = seed(
            source,
            serde_json::json!({
                "secretRef": {"name": "ud"}, "networkDataSecretRef": {"name": "nd"},
            }),
        );
        let path = format!("spec.volumes[3].{source}");
        assert_eq!(
            referenced.user_data,
            SeedData::Secret {
                dir: "/p/secret/ci".into(),
                keys: ["userdata", "userData"],
                field: format!("{path}.secretRef"),
            }
        );
        assert_eq!(
            referenced.network_data,
            Some(SeedData::Secret {
                dir: "/p/secret/ci".into(),
                keys: ["networkdata", "networkData"],
                field: format!("{path}.networkDataSecretRef"),
            })
        );
    }
}

/// ConfigMap, Secret, Downward API and service account volumes become raw images at KubeVirt's
/// paths, built from the directories the pod mounts them at, with the volume's label or
/// `cfgdata`; the disk target decides the device and whether it is read-only.
#[test]
fn config_volumes_become_iso_disks_at_kubevirts_paths() {
    let mut s = base_spec();
    let disks = s["domain"]["devices"]["disks"].as_array_mut().unwrap();
    disks.extend([
        serde_json::json!({"name": "cm", "disk": {"bus": "virtio"}}),
        serde_json::json!({"name": "sec", "cdrom": {"bus": "sata"}}),
        serde_json::json!({"name": "dapi", "disk": {"bus": "virtio"}}),
        serde_json::json!({"name": "sa", "disk": {"bus": "virtio"}}),
    ]);
    s["volumes"].as_array_mut().unwrap().extend([
        serde_json::json!({"name": "cm", "configMap": {"name": "app"}}),
        serde_json::json!({"name": "sec", "secret": {"secretName": "creds", "volumeLabel": "creds"}}),
        serde_json::json!({"name": "dapi", "downwardAPI": {"volumeLabel": "podinfo", "fields": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}),
        serde_json::json!({"name": "sa", "serviceAccount": {"serviceAccountName": "robot"}}),
    ]);
    let plan = conv(s).unwrap();
    let want = [
        (
            "cm",
            "/p/config-map",
            "/p/config-map-disks/cm.iso",
            "cfgdata",
            4,
            "configMap",
        ),
        (
            "sec",
            "/p/secret",
            "/p/secret-disks/sec.iso",
            "creds",
            5,
            "secret",
        ),
        (
            "dapi",
            "/p/downwardapi",
            "/p/downwardapi-disks/dapi.iso",
            "podinfo",
            6,
            "downwardAPI",
        ),
        (
            "sa",
            "",
            "/p/service-account-disk/service-account.iso",
            "cfgdata",
            7,
            "serviceAccount",
        ),
    ];
    for (name, source_dir, iso, label, index, field) in want {
        let source = if source_dir.is_empty() {
            PathBuf::from("/var/run/secrets/kubernetes.io/serviceaccount")
        } else {
            Path::new(source_dir).join(name)
        };
        assert!(
            plan.preps.contains(&Prep::ConfigDisk {
                source,
                path: iso.into(),
                label: label.into(),
                field: format!("spec.volumes[{index}].{field}"),
            }),
            "{name}: {:#?}",
            plan.preps
        );
        let disk = plan.config.disks.iter().find(|d| d.name == name).unwrap();
        assert_eq!(disk.source.path, PathBuf::from(iso));
        assert_eq!(disk.source.format, ImageFormat::Raw);
    }
    let read_only: Vec<_> = plan.config.disks[4..]
        .iter()
        .map(|d| (d.name.as_str(), d.read_only))
        .collect();
    assert_eq!(
        read_only,
        [("cm", false), ("sec", true), ("dapi", false), ("sa", false)]
    );
    let argv = plan.config.argv().join(" ");
    assert!(
        argv.contains("/p/config-map-disks/cm.iso"),
        "the image reaches QEMU: {argv}"
    );
}

#[test]
fn a_paused_start_gets_kubevirts_boot_menu() {
    let boot = |s: serde_json::Value| {
        let argv = conv(s).unwrap().config.argv();
        argv.windows(2)
            .find(|w| w[0] == "-boot")
            .map(|w| w[1].clone())
    };
    assert_eq!(boot(base_spec()), None);
    let mut s = base_spec();
    s["startStrategy"] = serde_json::json!("Paused");
    assert_eq!(boot(s).as_deref(), Some("menu=on,splash-time=10000"));
}
