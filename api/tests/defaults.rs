//! Table tests: `defaults::apply` writes what KubeVirt's mutating webhook writes.

use api::config::DefaultNetworkInterface;
use api::vmi::VirtualMachineInstanceSpec;
use api::{ClusterConfig, VirtualMachineInstance, defaults};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};

struct Case {
    name: &'static str,
    cfg: fn() -> ClusterConfig,
    spec: Value,
    /// JSON pointers into the defaulted spec and the value expected there (`null`: absent).
    expect: &'static [(&'static str, &'static str)],
}

fn base() -> ClusterConfig {
    ClusterConfig::default()
}

fn spec(extra: Value) -> Value {
    let mut s = json!({
        "domain": {
            "resources": {"requests": {"memory": "256Mi"}},
            "devices": {}
        }
    });
    merge(&mut s, extra);
    s
}

fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "machine type defaults to q35",
            cfg: base,
            spec: spec(json!({})),
            expect: &[("/domain/machine/type", r#""q35""#)],
        },
        Case {
            name: "a machine type given is kept",
            cfg: base,
            spec: spec(json!({"domain": {"machine": {"type": "pc-q35-rhel9.2.0"}}})),
            expect: &[("/domain/machine/type", r#""pc-q35-rhel9.2.0""#)],
        },
        Case {
            name: "the cluster's machine type is used",
            cfg: || ClusterConfig {
                machine_type: "pc-q35-7.2".into(),
                ..base()
            },
            spec: spec(json!({})),
            expect: &[("/domain/machine/type", r#""pc-q35-7.2""#)],
        },
        Case {
            name: "cpu model defaults to host-model, also under emulation",
            cfg: || ClusterConfig {
                use_emulation: true,
                ..base()
            },
            spec: spec(json!({})),
            expect: &[("/domain/cpu/model", r#""host-model""#)],
        },
        Case {
            name: "the cluster's cpu model is used",
            cfg: || ClusterConfig {
                cpu_model: Some("Skylake-Client".into()),
                ..base()
            },
            spec: spec(json!({})),
            expect: &[("/domain/cpu/model", r#""Skylake-Client""#)],
        },
        Case {
            name: "a cpu model given is kept",
            cfg: base,
            spec: spec(json!({"domain": {"cpu": {"model": "host-passthrough"}}})),
            expect: &[("/domain/cpu/model", r#""host-passthrough""#)],
        },
        Case {
            name: "topology: one socket, core and thread when nothing is asked",
            cfg: base,
            spec: spec(json!({})),
            expect: &[
                ("/domain/cpu/sockets", "1"),
                ("/domain/cpu/cores", "1"),
                ("/domain/cpu/threads", "1"),
                ("/domain/cpu/maxSockets", "4"),
            ],
        },
        Case {
            name: "topology: sockets from the cpu limit",
            cfg: base,
            spec: spec(json!({"domain": {"resources": {"limits": {"cpu": "2"}}}})),
            expect: &[
                ("/domain/cpu/sockets", "2"),
                ("/domain/cpu/cores", "1"),
                ("/domain/resources/requests/cpu", r#""2""#),
                ("/domain/cpu/maxSockets", "8"),
            ],
        },
        Case {
            name: "topology: sockets from the cpu request, rounded up",
            cfg: base,
            spec: spec(json!({"domain": {"resources": {"requests": {"cpu": "1500m"}}}})),
            expect: &[("/domain/cpu/sockets", "2")],
        },
        Case {
            name: "topology given in part is left alone",
            cfg: base,
            spec: spec(json!({"domain": {"cpu": {"cores": 2}}})),
            expect: &[
                ("/domain/cpu/cores", "2"),
                ("/domain/cpu/sockets", "null"),
                ("/domain/cpu/maxSockets", "null"),
            ],
        },
        Case {
            name: "guest memory from the memory request",
            cfg: base,
            spec: spec(json!({})),
            expect: &[
                ("/domain/memory/guest", r#""256Mi""#),
                ("/domain/memory/maxGuest", "null"),
            ],
        },
        Case {
            name: "guest memory from the memory limit when nothing is requested",
            cfg: base,
            spec: json!({"domain": {"resources": {"limits": {"memory": "512Mi"}}, "devices": {}}}),
            expect: &[("/domain/memory/guest", r#""512Mi""#)],
        },
        Case {
            name: "guest memory from the hugepage size",
            cfg: base,
            spec: json!({"domain": {"memory": {"hugepages": {"pageSize": "2Mi"}}, "devices": {}}}),
            expect: &[("/domain/memory/guest", r#""2Mi""#)],
        },
        Case {
            name: "memory hotplug headroom for a 1Gi guest",
            cfg: base,
            spec: json!({"domain": {"resources": {"requests": {"memory": "1Gi"}}, "devices": {}}}),
            expect: &[
                ("/domain/memory/guest", r#""1Gi""#),
                ("/domain/memory/maxGuest", r#""4Gi""#),
            ],
        },
        Case {
            name: "no hotplug headroom with the Stage rollout strategy",
            cfg: || ClusterConfig {
                vm_rollout_live_update: false,
                ..base()
            },
            spec: json!({"domain": {"resources": {"requests": {"memory": "1Gi"}}, "devices": {}}}),
            expect: &[
                ("/domain/memory/maxGuest", "null"),
                ("/domain/cpu/maxSockets", "null"),
            ],
        },
        Case {
            name: "a non-default cluster cpu request is added",
            cfg: || ClusterConfig {
                cpu_request: Quantity("250m".into()),
                ..base()
            },
            spec: spec(json!({})),
            expect: &[("/domain/resources/requests/cpu", r#""250m""#)],
        },
        Case {
            name: "KubeVirt's built-in cpu request is not written into the spec",
            cfg: base,
            spec: spec(json!({})),
            expect: &[("/domain/resources/requests/cpu", "null")],
        },
        Case {
            name: "default pod network with KubeVirt's default bridge binding",
            cfg: base,
            spec: spec(json!({})),
            expect: &[
                ("/networks", r#"[{"name":"default","pod":{}}]"#),
                (
                    "/domain/devices/interfaces",
                    r#"[{"name":"default","bridge":{}}]"#,
                ),
            ],
        },
        Case {
            name: "default interface is masquerade when the cluster says so",
            cfg: || ClusterConfig {
                default_network_interface: DefaultNetworkInterface::Masquerade,
                ..base()
            },
            spec: spec(json!({})),
            expect: &[(
                "/domain/devices/interfaces",
                r#"[{"name":"default","masquerade":{}}]"#,
            )],
        },
        Case {
            name: "no default network when autoattachPodInterface is false",
            cfg: base,
            spec: spec(json!({"domain": {"devices": {"autoattachPodInterface": false}}})),
            expect: &[
                ("/networks", "null"),
                ("/domain/devices/interfaces", "null"),
            ],
        },
        Case {
            name: "networks given are left alone",
            cfg: base,
            spec: spec(json!({
                "networks": [{"name": "n", "pod": {}}],
                "domain": {"devices": {"interfaces": [{"name": "n", "masquerade": {}}]}}
            })),
            expect: &[("/networks", r#"[{"name":"n","pod":{}}]"#)],
        },
        Case {
            name: "every volume without a disk gets one, on KubeVirt's amd64 bus (sata)",
            cfg: base,
            spec: spec(json!({"volumes": [{"name": "cd", "containerDisk": {"image": "i:1"}}]})),
            expect: &[(
                "/domain/devices/disks",
                r#"[{"name":"cd","disk":{"bus":"sata"}}]"#,
            )],
        },
        Case {
            name: "a volume shared as a filesystem gets no disk (KubeVirt's SetDefaultVolumeDisk)",
            cfg: base,
            spec: spec(json!({
                "volumes": [{"name": "cfg", "configMap": {"name": "app"}},
                            {"name": "cd", "containerDisk": {"image": "i:1"}}],
                "domain": {"devices": {"filesystems": [{"name": "cfg", "virtiofs": {}}]}}
            })),
            expect: &[(
                "/domain/devices/disks",
                r#"[{"name":"cd","disk":{"bus":"sata"}}]"#,
            )],
        },
        Case {
            name: "a disk without a target becomes a disk; an explicit bus is kept",
            cfg: base,
            spec: spec(json!({
                "volumes": [{"name": "a", "emptyDisk": {"capacity": "1Gi"}},
                            {"name": "b", "emptyDisk": {"capacity": "1Gi"}}],
                "domain": {"devices": {"disks": [{"name": "a"}, {"name": "b", "disk": {"bus": "virtio"}}]}}
            })),
            expect: &[
                ("/domain/devices/disks/0/disk/bus", r#""sata""#),
                ("/domain/devices/disks/1/disk/bus", r#""virtio""#),
            ],
        },
        Case {
            name: "cdroms are read-only with the tray closed",
            cfg: base,
            spec: spec(json!({
                "volumes": [{"name": "c", "containerDisk": {"image": "i:1"}}],
                "domain": {"devices": {"disks": [{"name": "c", "cdrom": {}}]}}
            })),
            expect: &[(
                "/domain/devices/disks/0/cdrom",
                r#"{"bus":"sata","readonly":true,"tray":"closed"}"#,
            )],
        },
        Case {
            name: "container disk pull policies follow the image reference",
            cfg: base,
            spec: spec(json!({"volumes": [
                {"name": "a", "containerDisk": {"image": "reg/img:latest"}},
                {"name": "b", "containerDisk": {"image": "reg/img:1.0"}},
                {"name": "c", "containerDisk": {"image": "reg/img"}},
                {"name": "d", "containerDisk": {"image": "reg/img@sha256:abcd"}},
                {"name": "e", "containerDisk": {"image": "reg/img:1.0", "imagePullPolicy": "Always"}}
            ]})),
            expect: &[
                ("/volumes/0/containerDisk/imagePullPolicy", r#""Always""#),
                (
                    "/volumes/1/containerDisk/imagePullPolicy",
                    r#""IfNotPresent""#,
                ),
                ("/volumes/2/containerDisk/imagePullPolicy", r#""Always""#),
                (
                    "/volumes/3/containerDisk/imagePullPolicy",
                    r#""IfNotPresent""#,
                ),
                ("/volumes/4/containerDisk/imagePullPolicy", r#""Always""#),
            ],
        },
        Case {
            name: "eviction strategy, architecture, firmware and ACPI",
            cfg: base,
            spec: spec(json!({})),
            expect: &[
                ("/evictionStrategy", r#""None""#),
                ("/architecture", r#""amd64""#),
                ("/domain/firmware", "{}"),
                ("/domain/features", r#"{"acpi":{"enabled":true}}"#),
            ],
        },
        Case {
            name: "features given are enabled unless disabled",
            cfg: base,
            spec: spec(
                json!({"domain": {"features": {"smm": {}, "apic": {}, "pvspinlock": {"enabled": false}}}}),
            ),
            expect: &[
                ("/domain/features/smm/enabled", "true"),
                ("/domain/features/apic/enabled", "true"),
                ("/domain/features/pvspinlock/enabled", "false"),
            ],
        },
        Case {
            name: "probe thresholds and periods",
            cfg: base,
            spec: spec(json!({"readinessProbe": {"guestAgentPing": {}, "periodSeconds": 0}})),
            expect: &[(
                "/readinessProbe",
                r#"{"guestAgentPing":{},"timeoutSeconds":1,"periodSeconds":10,"successThreshold":1,"failureThreshold":3}"#,
            )],
        },
        Case {
            name: "inputs are usb tablets, watchdogs reset",
            cfg: base,
            spec: spec(json!({"domain": {"devices": {
                "inputs": [{"name": "t"}],
                "watchdog": {"name": "w"}
            }}})),
            expect: &[
                (
                    "/domain/devices/inputs/0",
                    r#"{"name":"t","bus":"usb","type":"tablet"}"#,
                ),
                ("/domain/devices/watchdog/i6300esb/action", r#""reset""#),
            ],
        },
        Case {
            name: "timers given are present",
            cfg: base,
            spec: spec(
                json!({"domain": {"clock": {"utc": {}, "timer": {"hpet": {"present": false}, "rtc": {}}}}}),
            ),
            expect: &[
                ("/domain/clock/timer/hpet/present", "false"),
                ("/domain/clock/timer/rtc/present", "true"),
            ],
        },
    ]
}

#[test]
fn defaults_match_kubevirts() {
    let cases = cases();
    assert!(cases.len() >= 15);
    let mut failures = Vec::new();
    for case in cases {
        let mut spec: VirtualMachineInstanceSpec = serde_json::from_value(case.spec.clone())
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        defaults::apply(&mut spec, &(case.cfg)()).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let out = serde_json::to_value(&spec).unwrap();
        for (pointer, want) in case.expect {
            let want: Value = serde_json::from_str(want).unwrap();
            let have = out.pointer(pointer).cloned().unwrap_or(Value::Null);
            if have != want {
                failures.push(format!("{}: {pointer} = {have}, want {want}", case.name));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn defaults_are_idempotent() {
    for case in cases() {
        let cfg = (case.cfg)();
        let mut once: VirtualMachineInstanceSpec = serde_json::from_value(case.spec).unwrap();
        defaults::apply(&mut once, &cfg).unwrap();
        let mut twice = once.clone();
        defaults::apply(&mut twice, &cfg).unwrap();
        assert_eq!(once, twice, "{}", case.name);
    }
}

#[test]
fn bridge_refused_when_the_cluster_forbids_it_on_the_pod_network() {
    let cfg = ClusterConfig {
        permit_bridge_interface_on_pod_network: false,
        ..ClusterConfig::default()
    };
    let mut s: VirtualMachineInstanceSpec = serde_json::from_value(spec(json!({}))).unwrap();
    assert_eq!(
        defaults::apply(&mut s, &cfg).unwrap_err().to_string(),
        "bridge interface is not enabled in kubevirt-config"
    );
}

#[test]
fn vmi_metadata_and_status_on_create() {
    let mut vmi: VirtualMachineInstance = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "v", "uid": "0b5bd4a4-5d7e-4c1a-9d57-0fd5e0b1c001"},
        "spec": spec(json!({}))
    }))
    .unwrap();
    defaults::apply_vmi(&mut vmi, &ClusterConfig::default()).unwrap();
    let v = serde_json::to_value(&vmi).unwrap();
    assert_eq!(
        v["metadata"]["finalizers"],
        json!(["kubevirt.io/foregroundDeleteVirtualMachine"])
    );
    assert_eq!(
        v["metadata"]["annotations"],
        json!({"kubevirt.io/pci-topology-version": "v3"})
    );
    assert_eq!(
        v["spec"]["domain"]["firmware"]["uuid"],
        json!("0b5bd4a4-5d7e-4c1a-9d57-0fd5e0b1c001")
    );
    assert_eq!(v["status"]["phase"], json!("Pending"));
    assert_eq!(v["status"]["runtimeUser"], json!(107));
    assert_eq!(
        v["status"]["memory"],
        json!({"guestAtBoot": "256Mi", "guestCurrent": "256Mi", "guestRequested": "256Mi"})
    );
    assert_eq!(
        v["status"]["currentCPUTopology"],
        json!({"cores": 1, "sockets": 1, "threads": 1})
    );

    let root = ClusterConfig {
        feature_gates: vec!["Root".into()],
        ..ClusterConfig::default()
    };
    let mut vmi2: VirtualMachineInstance = serde_json::from_value(v).unwrap();
    vmi2.status = None;
    defaults::apply_vmi(&mut vmi2, &root).unwrap();
    assert_eq!(vmi2.status.unwrap().runtime_user, None);
    assert_eq!(
        vmi2.metadata.finalizers.unwrap().len(),
        1,
        "finalizer added once"
    );
}

#[test]
fn cluster_config_reads_the_kubevirt_cr() {
    let kv: api::KubeVirt = serde_saphyr::from_str(
        r"
apiVersion: kubevirt.io/v1
kind: KubeVirt
metadata: {name: kubevirt, namespace: kubevirt}
spec:
  configuration:
    cpuModel: Haswell
    developerConfiguration:
      useEmulation: true
      featureGates: [HostDisk, Snapshot]
      disabledFeatureGates: [Snapshot]
    architectureConfiguration:
      amd64: {machineType: pc-q35-7.2}
    network:
      defaultNetworkInterface: masquerade
    vmRolloutStrategy: Stage
",
    )
    .unwrap();
    let c = ClusterConfig::from_kubevirt(&kv);
    assert!(c.use_emulation);
    assert_eq!(c.feature_gates, ["HostDisk"]);
    assert!(c.has_feature_gate("HostDisk") && !c.has_feature_gate("Snapshot"));
    assert_eq!(c.cpu_model.as_deref(), Some("Haswell"));
    assert_eq!(c.machine_type, "pc-q35-7.2");
    assert_eq!(
        c.default_network_interface,
        DefaultNetworkInterface::Masquerade
    );
    assert!(!c.vm_rollout_live_update);
    assert_eq!(
        ClusterConfig::from_kubevirt(&api::KubeVirt::new("kv", api::KubeVirtSpec::default())),
        ClusterConfig::default()
    );
}

#[test]
fn vm_create_gets_firmware_ids_and_the_pci_topology() {
    let mut vm: api::VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": "vm"},
        "spec": {"runStrategy": "Always", "template": {"spec": spec(json!({}))}}
    }))
    .unwrap();
    let mut n = 0;
    let mut ids = || {
        n += 1;
        format!("id-{n}")
    };
    defaults::apply_vm_create(&mut vm, &ClusterConfig::default(), &mut ids);
    let v = serde_json::to_value(&vm).unwrap();
    let t = &v["spec"]["template"];
    assert_eq!(
        t["spec"]["domain"]["firmware"],
        json!({"uuid": "id-1", "serial": "id-2"})
    );
    assert_eq!(t["spec"]["domain"]["machine"], json!({"type": "q35"}));
    assert_eq!(t["spec"]["architecture"], json!("amd64"));
    assert_eq!(
        t["metadata"]["annotations"],
        json!({"kubevirt.io/pci-topology-version": "v3"})
    );
    // Given ids are kept.
    let before = vm.clone();
    defaults::apply_vm_create(&mut vm, &ClusterConfig::default(), &mut || unreachable!());
    assert_eq!(vm, before);
}
