//! What the api test binaries share.

use api::{ClusterConfig, VirtualMachineInstance, defaults};
use serde_json::{Value, json};

/// A valid, defaulted VMI to break one field at a time.
pub fn valid() -> Value {
    let vmi: VirtualMachineInstance = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "v"},
        "spec": {
            "domain": {
                "resources": {"requests": {"memory": "256Mi"}, "limits": {"memory": "512Mi"}},
                "devices": {
                    "disks": [
                        {"name": "root", "bootOrder": 1, "disk": {"bus": "virtio"}},
                        {"name": "seed", "disk": {"bus": "virtio"}}
                    ],
                    "interfaces": [{"name": "default", "masquerade": {}, "ports": [{"port": 22}]}]
                }
            },
            "networks": [{"name": "default", "pod": {}}],
            "volumes": [
                {"name": "root", "containerDisk": {"image": "kubevirt-rs/test-guest-disk:latest"}},
                {"name": "seed", "cloudInitNoCloud": {"userData": "#!/bin/sh\n"}}
            ]
        }
    }))
    .unwrap();
    let mut vmi = vmi;
    defaults::apply_vmi(&mut vmi, &ClusterConfig::default()).unwrap();
    serde_json::to_value(vmi).unwrap()
}
