//! The checked-in CRDs are what the types generate, structural, and named as KubeVirt's.

use std::path::PathBuf;

use api::crds;

fn crd_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests/crds")
}

#[test]
fn checked_in_crds_match_the_types() {
    let dir = crd_dir();
    let mut expected_files = Vec::new();
    for crd in crds::crds() {
        let name = crds::file_name(&crd);
        let want = crds::to_yaml(&crd).unwrap();
        let have = std::fs::read_to_string(dir.join(&name)).unwrap_or_default();
        assert!(
            have == want,
            "manifests/crds/{name} is stale or missing: run `cargo run -p api --bin crdgen`"
        );
        expected_files.push(name);
    }
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    expected_files.sort();
    assert_eq!(
        on_disk, expected_files,
        "manifests/crds holds files crdgen does not write: run `cargo run -p api --bin crdgen` and remove the rest"
    );
}

#[test]
fn schemas_are_structural() {
    for crd in crds::crds() {
        for v in &crd.spec.versions {
            let schema = v
                .schema
                .as_ref()
                .unwrap()
                .open_api_v3_schema
                .as_ref()
                .unwrap();
            let problems = crds::structural_problems(schema);
            assert!(
                problems.is_empty(),
                "{}: {problems:#?}",
                crd.spec.names.kind
            );
        }
    }
}

#[test]
fn structural_check_catches_untyped_nodes() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps;
    let bad = JSONSchemaProps {
        type_: Some("object".into()),
        properties: Some(
            [
                ("untyped".to_owned(), JSONSchemaProps::default()),
                (
                    "choice".to_owned(),
                    JSONSchemaProps {
                        type_: Some("object".into()),
                        one_of: Some(vec![JSONSchemaProps::default()]),
                        ..Default::default()
                    },
                ),
            ]
            .into(),
        ),
        ..Default::default()
    };
    let problems = crds::structural_problems(&bad);
    assert_eq!(problems, vec![".choice: oneOf", ".untyped: no type"]);
}

struct Expect {
    kind: &'static str,
    plural: &'static str,
    short: &'static [&'static str],
    columns: &'static [&'static str],
    status: bool,
    scale: bool,
}

#[test]
fn names_columns_and_subresources_are_kubevirts() {
    let expect = [
        Expect {
            kind: "VirtualMachineInstance",
            plural: "virtualmachineinstances",
            short: &["vmi", "vmis"],
            columns: &[
                "Age",
                "Phase",
                "IP",
                "NodeName",
                "Ready",
                "Live-Migratable",
                "Paused",
            ],
            status: false,
            scale: false,
        },
        Expect {
            kind: "VirtualMachine",
            plural: "virtualmachines",
            short: &["vm", "vms"],
            columns: &["Age", "Status", "Ready"],
            status: true,
            scale: false,
        },
        Expect {
            kind: "VirtualMachineInstanceReplicaSet",
            plural: "virtualmachineinstancereplicasets",
            short: &["vmirs", "vmirss"],
            columns: &["Desired", "Current", "Ready", "Age"],
            status: true,
            scale: true,
        },
        Expect {
            kind: "VirtualMachineInstanceMigration",
            plural: "virtualmachineinstancemigrations",
            short: &["vmim", "vmims"],
            columns: &["Phase", "VMI"],
            status: true,
            scale: false,
        },
        Expect {
            kind: "VirtualMachineInstancePreset",
            plural: "virtualmachineinstancepresets",
            short: &["vmipreset", "vmipresets"],
            columns: &[],
            status: false,
            scale: false,
        },
        Expect {
            kind: "KubeVirt",
            plural: "kubevirts",
            short: &["kv", "kvs"],
            columns: &["Age", "Phase"],
            status: true,
            scale: false,
        },
    ];
    let all = crds::crds();
    let (core, others): (Vec<_>, Vec<_>) = all.iter().partition(|c| c.spec.group == "kubevirt.io");
    assert_eq!(core.len(), expect.len());
    let policy = others
        .iter()
        .find(|c| c.spec.group == "migrations.kubevirt.io")
        .expect("the MigrationPolicy CRD");
    let instancetypes: Vec<_> = others
        .iter()
        .filter(|c| c.spec.group == "instancetype.kubevirt.io")
        .map(|c| {
            let n = &c.spec.names;
            let v: Vec<&str> = c.spec.versions.iter().map(|v| v.name.as_str()).collect();
            (
                n.kind.as_str(),
                c.spec.scope.as_str(),
                n.short_names.clone().unwrap_or_default().join(","),
                n.categories.clone().unwrap_or_default().join(","),
                v,
            )
        })
        .collect();
    assert_eq!(
        instancetypes,
        [
            (
                "VirtualMachineInstancetype",
                "Namespaced",
                "vminstancetype,vminstancetypes,vmf,vmfs".into(),
                "all".into(),
                vec!["v1beta1"]
            ),
            (
                "VirtualMachineClusterInstancetype",
                "Cluster",
                "vmclusterinstancetype,vmclusterinstancetypes,vmcf,vmcfs".into(),
                String::new(),
                vec!["v1beta1"]
            ),
            (
                "VirtualMachinePreference",
                "Namespaced",
                "vmpref,vmprefs,vmp,vmps".into(),
                "all".into(),
                vec!["v1beta1"]
            ),
            (
                "VirtualMachineClusterPreference",
                "Cluster",
                "vmcp,vmcps".into(),
                String::new(),
                vec!["v1beta1"]
            ),
        ]
    );
    assert_eq!(
        (
            policy.spec.group.as_str(),
            policy.spec.names.plural.as_str(),
            policy.spec.scope.as_str()
        ),
        ("migrations.kubevirt.io", "migrationpolicies", "Cluster")
    );
    assert_eq!(policy.spec.versions[0].name, "v1alpha1");
    let pool = others
        .iter()
        .find(|c| c.spec.group == "pool.kubevirt.io")
        .expect("the VirtualMachinePool CRD");
    let n = &pool.spec.names;
    assert_eq!(
        (
            n.plural.as_str(),
            n.short_names.clone(),
            pool.spec.scope.as_str()
        ),
        (
            "virtualmachinepools",
            Some(vec!["vmpool".to_owned(), "vmpools".to_owned()]),
            "Namespaced"
        )
    );
    // KubeVirt serves v1alpha1 and stores v1beta1, with one schema.
    let versions: Vec<_> = pool
        .spec
        .versions
        .iter()
        .map(|v| (v.name.as_str(), v.served, v.storage))
        .collect();
    assert_eq!(
        versions,
        [("v1alpha1", true, false), ("v1beta1", true, true)]
    );
    assert_eq!(pool.spec.versions[0].schema, pool.spec.versions[1].schema);
    let scale = pool.spec.versions[1]
        .subresources
        .as_ref()
        .and_then(|s| s.scale.as_ref())
        .expect("the scale subresource");
    assert_eq!(
        scale.label_selector_path.as_deref(),
        Some(".status.labelSelector")
    );
    let preset = core
        .iter()
        .find(|c| c.spec.names.kind == "VirtualMachineInstancePreset")
        .unwrap();
    assert_eq!(preset.spec.versions[0].deprecated, Some(true));
    for (crd, want) in core.into_iter().zip(expect) {
        let names = &crd.spec.names;
        assert_eq!(names.kind, want.kind);
        assert_eq!(names.plural, want.plural);
        assert_eq!(crd.spec.group, "kubevirt.io");
        assert_eq!(crd.spec.scope, "Namespaced");
        assert_eq!(
            names.short_names.as_deref().unwrap(),
            want.short,
            "{}",
            want.kind
        );
        assert_eq!(
            names.categories.as_deref().unwrap(),
            ["all"],
            "{}",
            want.kind
        );
        let [version] = crd.spec.versions.as_slice() else {
            panic!("one version")
        };
        assert_eq!(version.name, "v1");
        assert!(version.served && version.storage);
        let columns: Vec<&str> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(columns, want.columns, "{}", want.kind);
        let sub = version.subresources.as_ref();
        assert_eq!(
            sub.and_then(|s| s.status.as_ref()).is_some(),
            want.status,
            "{}",
            want.kind
        );
        let scale = sub.and_then(|s| s.scale.as_ref());
        assert_eq!(scale.is_some(), want.scale, "{}", want.kind);
        if let Some(scale) = scale {
            assert_eq!(scale.spec_replicas_path, ".spec.replicas");
            assert_eq!(scale.status_replicas_path, ".status.replicas");
            assert_eq!(
                scale.label_selector_path.as_deref(),
                Some(".status.labelSelector")
            );
        }
    }
}

#[test]
fn unmodelled_kubevirt_fields_are_preserved_not_pruned() {
    let vmi = crds::crds().into_iter().next().unwrap();
    let schema = serde_json::to_value(&vmi.spec.versions[0].schema).unwrap();
    let devices = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["domain"]["properties"]
        ["devices"]["properties"];
    for field in ["gpus", "hostDevices", "tpm", "sound"] {
        assert_eq!(
            devices[field]["x-kubernetes-preserve-unknown-fields"],
            serde_json::Value::Bool(true),
            "devices.{field}"
        );
    }
}
