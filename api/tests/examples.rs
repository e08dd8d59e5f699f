//! Every example manifest parses, round-trips through the types without losing a field, and
//! defaults and validates clean.

use std::path::PathBuf;

use api::{
    ClusterConfig, KubeVirt, VirtualMachine, VirtualMachineInstance,
    VirtualMachineInstanceMigration, VirtualMachineInstanceReplicaSet, defaults, validation,
};
use pretty_assertions::assert_eq;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// `manifests/examples/` and the release's KubeVirt CR.
fn examples() -> Vec<(String, serde_json::Value)> {
    let manifests = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    let mut out = Vec::new();
    let paths = std::fs::read_dir(manifests.join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .chain([manifests.join("release/kubevirt-cr.yaml")]);
    for path in paths {
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let value: serde_json::Value =
                serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push((
                path.file_name().unwrap().to_string_lossy().into_owned(),
                value,
            ));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn round_trip<T: DeserializeOwned + Serialize>(file: &str, value: &serde_json::Value) -> T {
    let typed: T = serde_json::from_value(value.clone()).unwrap_or_else(|e| panic!("{file}: {e}"));
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(
        &back, value,
        "{file} lost or changed a field on the round trip"
    );
    typed
}

fn clean(file: &str, errors: &[validation::FieldError]) {
    assert!(errors.is_empty(), "{file}: {errors:#?}");
}

#[test]
fn every_example_round_trips_defaults_and_validates() {
    let cfg = ClusterConfig::default();
    let mut kinds = Vec::new();
    for (file, value) in examples() {
        let kind = value["kind"].as_str().unwrap().to_owned();
        match kind.as_str() {
            "VirtualMachineInstance" => {
                let mut vmi: VirtualMachineInstance = round_trip(&file, &value);
                clean(&file, &validation::validate_vmi(&vmi, &cfg));
                defaults::apply_vmi(&mut vmi, &cfg).unwrap();
                clean(&file, &validation::validate_vmi(&vmi, &cfg));
                // A defaulted object still round-trips (what the API server stores).
                let v = serde_json::to_value(&vmi).unwrap();
                round_trip::<VirtualMachineInstance>(&file, &v);
            }
            "VirtualMachine" => {
                let mut vm: VirtualMachine = round_trip(&file, &value);
                clean(&file, &validation::validate_vm(&vm, &cfg));
                defaults::apply_vm(&mut vm, &cfg);
                defaults::apply(vm.spec.template.spec.as_mut().unwrap(), &cfg).unwrap();
                clean(&file, &validation::validate_vm(&vm, &cfg));
            }
            "VirtualMachineInstanceReplicaSet" => {
                let mut rs: VirtualMachineInstanceReplicaSet = round_trip(&file, &value);
                clean(&file, &validation::validate_replicaset(&rs, &cfg));
                defaults::apply(rs.spec.template.spec.as_mut().unwrap(), &cfg).unwrap();
                clean(&file, &validation::validate_replicaset(&rs, &cfg));
            }
            "VirtualMachineInstanceMigration" => {
                let m: VirtualMachineInstanceMigration = round_trip(&file, &value);
                clean(&file, &validation::validate_migration(&m));
            }
            "KubeVirt" => {
                let kv: KubeVirt = round_trip(&file, &value);
                let c = ClusterConfig::from_kubevirt(&kv);
                assert!(c.use_emulation, "{file}: useEmulation");
            }
            other => panic!("{file}: unexpected kind {other}"),
        }
        kinds.push(kind);
    }
    kinds.sort();
    kinds.dedup();
    assert_eq!(
        kinds,
        [
            "KubeVirt",
            "VirtualMachine",
            "VirtualMachineInstance",
            "VirtualMachineInstanceMigration",
            "VirtualMachineInstanceReplicaSet"
        ],
        "every kind has an example"
    );
}

#[test]
fn examples_use_the_test_guest_images() {
    for (file, value) in examples() {
        let text = value.to_string();
        if text.contains("containerDisk") {
            assert!(
                text.contains("kubevirt-rs/test-guest-disk:latest"),
                "{file}"
            );
        }
        if text.contains("kernelBoot") {
            assert!(
                text.contains("kubevirt-rs/test-guest-kernel:latest"),
                "{file}"
            );
            assert!(
                text.contains("/boot/vmlinuz") && text.contains("/boot/initrd.img"),
                "{file}"
            );
        }
    }
}

#[test]
fn status_round_trips() {
    let value = serde_json::json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "x"},
        "spec": {"domain": {"devices": {}}},
        "status": {
            "phase": "Running",
            "nodeName": "node01",
            "phaseTransitionTimestamps": [
                {"phase": "Pending", "phaseTransitionTimestamp": "2026-01-01T00:00:00Z"}
            ],
            "conditions": [
                {"type": "Ready", "status": "True", "lastProbeTime": null,
                 "lastTransitionTime": "2026-01-01T00:00:01Z"},
                {"type": "SomethingNew", "status": "False", "reason": "Future"}
            ],
            "interfaces": [{"ipAddress": "10.0.2.2", "ipAddresses": ["10.0.2.2"], "mac": "02:00:00:00:00:01", "name": "default", "infoSource": "domain, guest-agent"}],
            "guestOSInfo": {"id": "debian", "kernelRelease": "6.1.0"},
            "activePods": {"6b5c0d3a": "node01"},
            "volumeStatus": [{"name": "containerdisk", "target": "vda"}],
            "migrationState": {"completed": true, "targetNode": "node02", "migrationUid": "u"},
            "launcherContainerImageVersion": "kubevirt-rs/virt-launcher:dev",
            "qosClass": "Burstable",
            "runtimeUser": 107,
            "VSOCKCID": 3,
            "currentCPUTopology": {"cores": 1, "sockets": 1, "threads": 1}
        }
    });
    let mut expected = value.clone();
    // Go's zero metav1.Time serialises as null; an absent one is the same thing.
    expected["status"]["conditions"][0]
        .as_object_mut()
        .unwrap()
        .remove("lastProbeTime");
    let vmi: VirtualMachineInstance = serde_json::from_value(value).unwrap();
    assert_eq!(serde_json::to_value(&vmi).unwrap(), expected);
    let status = vmi.status.unwrap();
    assert_eq!(
        status.phase,
        Some(api::VirtualMachineInstancePhase::Running)
    );
    assert!(
        status
            .condition(&api::status::VirtualMachineInstanceConditionType::Ready)
            .is_some()
    );
}

fn assert_round_trip<T: DeserializeOwned + Serialize>(value: &serde_json::Value) {
    let typed: T = serde_json::from_value(value.clone()).unwrap();
    assert_eq!(&serde_json::to_value(&typed).unwrap(), value);
}

#[test]
fn every_kinds_status_round_trips() {
    assert_round_trip::<VirtualMachine>(&serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "vm"},
        "spec": {"running": false, "template": {"spec": {"domain": {"devices": {}}}}},
        "status": {
            "printableStatus": "Stopped",
            "ready": false,
            "created": false,
            "runStrategy": "Halted",
            "observedGeneration": 2,
            "desiredGeneration": 2,
            "conditions": [{"type": "Failure", "status": "False", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            "stateChangeRequests": [{"action": "Start", "uid": "1234"}],
            "startFailure": {"consecutiveFailCount": 2, "lastFailedVMIUID": "abc", "retryAfterTimestamp": "2026-01-01T00:05:00Z"},
            "volumeSnapshotStatuses": [{"name": "root", "enabled": false, "reason": "containerDisk"}]
        }
    }));
    assert_round_trip::<VirtualMachineInstanceReplicaSet>(&serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceReplicaSet",
        "metadata": {"name": "rs"},
        "spec": {"replicas": 3, "paused": true, "selector": {"matchLabels": {"a": "b"}},
                 "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"domain": {"devices": {}}}}},
        "status": {"replicas": 2, "readyReplicas": 1, "labelSelector": "a=b",
                   "conditions": [{"type": "ReplicaPaused", "status": "True", "reason": "Paused"}]}
    }));
    assert_round_trip::<VirtualMachineInstanceMigration>(&serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": "m"},
        "spec": {"vmiName": "v", "addedNodeSelector": {"zone": "a"}},
        "status": {
            "phase": "Running",
            "phaseTransitionTimestamps": [{"phase": "Pending", "phaseTransitionTimestamp": "2026-01-01T00:00:00Z"}],
            "migrationState": {"sourceNode": "n1", "targetNode": "n2", "mode": "PreCopy",
                               "targetDirectMigrationNodePorts": {"49152": 0}}
        }
    }));
    assert_round_trip::<KubeVirt>(&serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {"imageTag": "v1", "imageRegistry": "quay.io/kubevirt-rs",
                 "infra": {"replicas": 2, "nodePlacement": {"nodeSelector": {"role": "infra"}}},
                 "configuration": {"developerConfiguration": {"useEmulation": true},
                                   "network": {"defaultNetworkInterface": "masquerade"}}},
        "status": {
            "phase": "Deployed",
            "conditions": [{"type": "Available", "status": "True", "reason": "AllComponentsReady", "message": "All components are ready."}],
            "operatorVersion": "v0.1.0",
            "observedKubeVirtVersion": "v0.1.0",
            "targetKubeVirtVersion": "v0.1.0",
            "observedDeploymentID": "abc",
            "generations": [{"group": "apps", "resource": "daemonsets", "namespace": "kubevirt", "name": "virt-handler", "lastGeneration": 1, "hash": "h"}]
        }
    }));
}

#[test]
fn autoattach_and_feature_helpers_apply_kubevirts_defaults() {
    let mut vmi: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "v"},
        "spec": {"domain": {"devices": {"autoattachGraphicsDevice": false}}}
    }))
    .unwrap();
    let d = &vmi.spec.domain.devices;
    assert!(d.wants_pod_interface() && d.wants_serial_console() && d.wants_mem_balloon());
    assert!(!d.wants_graphics() && !d.wants_input_device());
    let f = api::vmi::Features::default();
    assert!(f.acpi_enabled() && !f.smm_enabled());
    assert!(!vmi.is_final() && vmi.node_name().is_none());
    vmi.status = Some(api::VirtualMachineInstanceStatus {
        phase: Some(api::VirtualMachineInstancePhase::Failed),
        node_name: Some("node01".into()),
        ..Default::default()
    });
    assert!(vmi.is_final());
    assert_eq!(vmi.node_name(), Some("node01"));
}
