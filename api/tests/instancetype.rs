//! KubeVirt's expansion of instance types and preferences into a VMI spec: what the instance
//! type sets, conflicts with what the VM sets, preferences only where the VM leaves a field
//! unset, CPU layouts and requirements.

use api::instancetype::{
    Expansion, VirtualMachineInstancetypeSpec, VirtualMachinePreferenceSpec, check_requirements,
    check_spread, instancetype_scope, preference_scope, revision_name,
};
use api::vmi::{DiskBus, VirtualMachineInstanceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

fn instancetype(yaml: &str) -> VirtualMachineInstancetypeSpec {
    serde_saphyr::from_str(yaml).unwrap()
}

fn preference(yaml: &str) -> VirtualMachinePreferenceSpec {
    serde_saphyr::from_str(yaml).unwrap()
}

fn vmi(yaml: &str) -> VirtualMachineInstanceSpec {
    serde_saphyr::from_str(yaml).unwrap()
}

fn expand(
    it: Option<&VirtualMachineInstancetypeSpec>,
    p: Option<&VirtualMachinePreferenceSpec>,
    spec: &mut VirtualMachineInstanceSpec,
) -> Result<ObjectMeta, Vec<String>> {
    let mut meta = ObjectMeta::default();
    Expansion {
        instancetype: it,
        preference: p,
    }
    .apply("spec.template.spec", spec, &mut meta)
    .map(|()| meta)
    .map_err(|e| e.iter().map(ToString::to_string).collect())
}

const U1_MEDIUM: &str = "
cpu: {guest: 4, model: Haswell}
memory: {guest: 4Gi, overcommitPercent: 25}
nodeSelector: {size: medium}
schedulerName: custom
ioThreadsPolicy: shared
annotations: {from-instancetype: 'yes'}
";

#[test]
fn instancetype_sets_cpu_memory_placement_and_annotations() {
    let it = instancetype(U1_MEDIUM);
    let mut spec = vmi("domain: {devices: {}}");
    let meta = expand(Some(&it), None, &mut spec).unwrap();
    let cpu = spec.domain.cpu.as_ref().unwrap();
    assert_eq!(
        (cpu.sockets, cpu.cores, cpu.threads),
        (Some(4), Some(1), Some(1))
    );
    assert_eq!(cpu.model.as_deref(), Some("Haswell"));
    let memory = spec.domain.memory.as_ref().unwrap();
    assert_eq!(memory.guest.as_ref().unwrap().0, "4Gi");
    // 4 GiB less 25 %: the pod asks for 3 GiB.
    assert_eq!(spec.domain.resources.requests["memory"].0, "3221225472");
    assert_eq!(spec.node_selector["size"], "medium");
    assert_eq!(spec.scheduler_name.as_deref(), Some("custom"));
    assert_eq!(spec.domain.io_threads_policy.as_deref(), Some("shared"));
    assert_eq!(meta.annotations.unwrap()["from-instancetype"], "yes");
}

#[test]
fn fields_the_instancetype_sets_conflict_with_the_vm_s_own() {
    let it = instancetype(U1_MEDIUM);
    let mut spec = vmi("
nodeSelector: {a: b}
domain:
  cpu: {cores: 2, model: host-passthrough}
  resources: {requests: {cpu: '1'}}
  devices: {}
");
    let errors = expand(Some(&it), None, &mut spec).unwrap_err();
    assert_eq!(
        errors,
        [
            "spec.template.spec.nodeSelector: VM field(s) spec.template.spec.nodeSelector conflicts with selected instance type",
            "spec.template.spec.domain.resources.requests.cpu: VM field(s) spec.template.spec.domain.resources.requests.cpu conflicts with selected instance type",
            "spec.template.spec.domain.cpu.cores: VM field(s) spec.template.spec.domain.cpu.cores conflicts with selected instance type",
            "spec.template.spec.domain.cpu.model: VM field(s) spec.template.spec.domain.cpu.model conflicts with selected instance type",
        ]
    );
    let mut spec = vmi("domain: {memory: {guest: 1Gi}, devices: {}}");
    assert_eq!(
        expand(Some(&it), None, &mut spec).unwrap_err(),
        [
            "spec.template.spec.domain.memory.guest: VM field(s) spec.template.spec.domain.memory.guest conflicts with selected instance type"
        ]
    );
}

#[test]
fn preferences_fill_only_what_the_vm_leaves_unset() {
    let p = preference("
devices:
  preferredDiskBus: virtio
  preferredCdromBus: scsi
  preferredInterfaceModel: e1000
  preferredInterfaceMasquerade: {}
  preferredAutoattachGraphicsDevice: false
  preferredRng: {}
features: {preferredSmm: {enabled: true}}
firmware: {preferredUseEfi: true, preferredUseSecureBoot: false}
machine: {preferredMachineType: pc-q35-7.2}
clock: {preferredClockOffset: {utc: {offsetSeconds: 30}}, preferredTimer: {rtc: {tickPolicy: catchup}}}
cpu: {preferredCPUFeatures: [{name: vmx, policy: require}, {name: pcid}]}
preferredTerminationGracePeriodSeconds: 17
preferredSubdomain: sub
annotations: {from-preference: 'yes', kept: preference}
");
    let mut spec = vmi("
domain:
  cpu: {features: [{name: pcid, policy: disable}]}
  devices:
    autoattachGraphicsDevice: true
    disks: [{name: a}, {name: b, disk: {bus: sata}}, {name: c, cdrom: {}}]
    interfaces: [{name: default}, {name: other, bridge: {}, model: virtio}]
networks: [{name: default, pod: {}}, {name: other, multus: {networkName: n}}]
");
    let mut meta = ObjectMeta {
        annotations: Some([("kept".to_owned(), "vm".to_owned())].into()),
        ..ObjectMeta::default()
    };
    Expansion {
        instancetype: None,
        preference: Some(&p),
    }
    .apply("spec.template.spec", &mut spec, &mut meta)
    .unwrap();
    let d = &spec.domain.devices;
    let buses: Vec<_> = d.disks.iter().map(|d| d.bus().cloned()).collect();
    assert_eq!(
        buses,
        [
            Some(DiskBus::Virtio),
            Some(DiskBus::Sata),
            Some(DiskBus::Scsi)
        ]
    );
    assert_eq!(d.interfaces[0].model.as_ref().unwrap().as_str(), "e1000");
    assert!(d.interfaces[0].masquerade.is_some());
    assert!(
        d.interfaces[1].masquerade.is_none(),
        "bound and not on the pod network"
    );
    assert_eq!(d.interfaces[1].model.as_ref().unwrap().as_str(), "virtio");
    assert_eq!(
        d.autoattach_graphics_device,
        Some(true),
        "the VM's own value wins"
    );
    assert!(d.rng.is_some());
    let features = spec.domain.features.as_ref().unwrap();
    assert_eq!(features.smm.as_ref().unwrap().enabled, Some(true));
    let efi = spec
        .domain
        .firmware
        .as_ref()
        .unwrap()
        .bootloader
        .as_ref()
        .unwrap()
        .efi
        .as_ref()
        .unwrap();
    assert_eq!(efi.secure_boot, Some(false));
    assert_eq!(
        spec.domain
            .machine
            .as_ref()
            .unwrap()
            .machine_type
            .as_deref(),
        Some("pc-q35-7.2")
    );
    let clock = spec.domain.clock.as_ref().unwrap();
    assert_eq!(clock.utc.as_ref().unwrap().offset_seconds, Some(30));
    assert!(clock.timer.as_ref().unwrap().rtc.is_some());
    let cpu_features: Vec<_> = spec
        .domain
        .cpu
        .as_ref()
        .unwrap()
        .features
        .iter()
        .map(|f| (f.name.as_str(), f.policy.as_deref()))
        .collect();
    assert_eq!(
        cpu_features,
        [("pcid", Some("disable")), ("vmx", Some("require"))]
    );
    assert_eq!(spec.termination_grace_period_seconds, Some(17));
    assert_eq!(spec.subdomain.as_deref(), Some("sub"));
    let annotations = meta.annotations.unwrap();
    assert_eq!(annotations["kept"], "vm");
    assert_eq!(annotations["from-preference"], "yes");
}

#[test]
fn preferred_topology_lays_out_the_instancetype_s_vcpus() {
    let it = instancetype("{cpu: {guest: 8}, memory: {guest: 1Gi}}");
    for (pref, want) in [
        ("{}", (8, 1, 1)),
        ("{cpu: {preferredCPUTopology: cores}}", (1, 8, 1)),
        ("{cpu: {preferredCPUTopology: preferThreads}}", (1, 1, 8)),
        ("{cpu: {preferredCPUTopology: spread}}", (4, 2, 1)),
        (
            "{cpu: {preferredCPUTopology: spread, spreadOptions: {across: CoresThreads}}}",
            (1, 4, 2),
        ),
        (
            "{cpu: {preferredCPUTopology: spread, spreadOptions: {across: SocketsCoresThreads, ratio: 2}}}",
            (2, 2, 2),
        ),
        (
            "{cpu: {preferredCPUTopology: spread}, preferSpreadSocketToCoreRatio: 4}",
            (2, 4, 1),
        ),
    ] {
        let p = preference(pref);
        let mut spec = vmi("domain: {devices: {}}");
        expand(Some(&it), Some(&p), &mut spec).unwrap();
        let cpu = spec.domain.cpu.unwrap();
        assert_eq!(
            (
                cpu.sockets.unwrap(),
                cpu.cores.unwrap(),
                cpu.threads.unwrap()
            ),
            want,
            "{pref}"
        );
    }
    let odd = instancetype("{cpu: {guest: 3}, memory: {guest: 1Gi}}");
    let spread = preference("{cpu: {preferredCPUTopology: spread}}");
    assert_eq!(
        check_spread(Some(&odd), Some(&spread)).unwrap().to_string(),
        "instancetype.spec.cpu.guest: 3 vCPUs provided by the instance type are not divisible by the Spec.PreferSpreadSocketToCoreRatio or Spec.CPU.PreferSpreadOptions.Ratio of 2 provided by the preference"
    );
    assert!(check_spread(Some(&it), Some(&spread)).is_none());
}

#[test]
fn requirements_are_checked_against_the_instancetype_or_the_vm() {
    let p = preference("requirements: {cpu: {guest: 2}, memory: {guest: 2Gi}}");
    let small = instancetype("{cpu: {guest: 1}, memory: {guest: 4Gi}}");
    let spec = vmi("domain: {devices: {}}");
    assert_eq!(
        check_requirements(Some(&small), Some(&p), &spec)
            .unwrap()
            .to_string(),
        "spec.instancetype: failure checking preference requirements: insufficient CPU resources of 1 vCPU provided by instance type, preference requires 2 vCPU"
    );
    let spec =
        vmi("domain: {cpu: {sockets: 2, cores: 1, threads: 1}, memory: {guest: 1Gi}, devices: {}}");
    assert_eq!(
        check_requirements(None, Some(&p), &spec)
            .unwrap()
            .to_string(),
        "spec.template.spec.domain.memory: failure checking preference requirements: insufficient Memory resources of 1Gi provided by VirtualMachine, preference requires 2Gi"
    );
    let spec = vmi("domain: {cpu: {sockets: 2}, memory: {guest: 2Gi}, devices: {}}");
    assert!(check_requirements(None, Some(&p), &spec).is_none());
}

#[test]
fn fields_kubevirt_rs_cannot_honour_are_refused_by_name() {
    let it = instancetype(
        "{cpu: {guest: 1, numa: {guestMappingPassthrough: {}}}, memory: {guest: 1Gi}, gpus: [{name: g, deviceName: x}]}",
    );
    let p = preference("{devices: {preferredTPM: {}}, features: {preferredHyperv: {relaxed: {}}}}");
    let mut spec = vmi("domain: {devices: {}}");
    assert_eq!(
        expand(Some(&it), Some(&p), &mut spec).unwrap_err(),
        [
            "instancetype.spec.gpus: not supported by kubevirt-rs yet",
            "instancetype.spec.cpu.numa: not supported by kubevirt-rs yet",
            "preference.spec.devices.preferredTPM: not supported by kubevirt-rs yet",
            "preference.spec.features.preferredHyperv: not supported by kubevirt-rs yet",
        ]
    );
}

#[test]
fn kinds_and_revision_names_are_kubevirt_s() {
    use api::instancetype::Scope;
    assert_eq!(instancetype_scope(None), Ok(Scope::Cluster));
    assert_eq!(
        instancetype_scope(Some("VirtualMachineInstancetype")),
        Ok(Scope::Namespaced)
    );
    assert_eq!(
        instancetype_scope(Some("virtualmachineclusterinstancetypes")),
        Ok(Scope::Cluster)
    );
    assert_eq!(
        preference_scope(Some("VirtualMachineInstancetype")),
        Err("got unexpected kind in PreferenceMatcher: VirtualMachineInstancetype".to_owned())
    );
    assert_eq!(
        revision_name("vm1", "u1.medium", "0c1e", 3),
        "vm1-u1.medium-v1beta1-0c1e-3"
    );
}
