//! The install strategy against golden files: KubeVirt's example CR, and one with every setting
//! the strategy applies. After an intended change, regenerate with
//! `UPDATE_GOLDEN=1 cargo nextest run -p operator --test golden` and review the diff.

use std::collections::BTreeMap;
use std::path::PathBuf;

use operator::strategy::{Release, render};

fn check(spec: serde_json::Value, golden_file: &str, namespace: &str) {
    let release = Release {
        registry: "kubevirt-rs".into(),
        tag: "v0.1.0".into(),
        digests: BTreeMap::new(),
    };
    let spec = serde_json::from_value(spec).expect("a KubeVirt spec");
    let mut strategy = render(&spec, &release, namespace).expect("the strategy renders");
    // The CRDs' schemas are `crdgen`'s (manifests/crds/, with its own drift test): here only
    // which CRDs the strategy holds and how they are labelled.
    for o in &mut strategy.objects {
        if o["kind"] == "CustomResourceDefinition" {
            *o = serde_json::json!({"apiVersion": o["apiVersion"], "kind": o["kind"],
                                    "metadata": o["metadata"]});
        }
    }
    let rendered = strategy.to_yaml();
    let golden = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(golden_file);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, &rendered).unwrap();
    }
    let want = std::fs::read_to_string(&golden).unwrap_or_default();
    assert!(
        rendered == want,
        "{} differs from the rendered strategy; if intended, regenerate with \
         `UPDATE_GOLDEN=1 cargo nextest run -p operator --test golden` and review the diff",
        golden.display()
    );
}

#[test]
fn example_cr_strategy_matches_golden() {
    let cr: serde_json::Value =
        serde_saphyr::from_str(include_str!("../../manifests/examples/kubevirt-cr.yaml"))
            .expect("the example CR");
    check(cr["spec"].clone(), "example-cr.yaml", "kubevirt");
}

#[test]
fn customized_cr_strategy_matches_golden() {
    let spec = serde_json::json!({
        "imageRegistry": "quay.io/example",
        "imageTag": "v1.2.3",
        "imagePullPolicy": "Always",
        "imagePullSecrets": [{"name": "pull"}],
        "infra": {
            "replicas": 3,
            "nodePlacement": {
                "nodeSelector": {"node-role.kubernetes.io/infra": ""},
                "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
            },
        },
        "workloads": {"nodePlacement": {"nodeSelector": {"kubevirt.io/workloads": "true"}}},
        "customizeComponents": {
            "patches": [
                {"resourceType": "Deployment", "resourceName": "virt-controller", "type": "json",
                 "patch": "[{\"op\":\"add\",\"path\":\"/spec/template/metadata/labels/example\",\"value\":\"patched\"}]"},
                {"resourceType": "Deployment", "resourceName": "*", "type": "merge",
                 "patch": "{\"spec\":{\"revisionHistoryLimit\":3}}"},
            ],
            "flags": {"handler": {"v": "4"}, "api": {"verbose": ""}},
        },
    });
    check(spec, "customized-cr.yaml", "virtualization");
}
