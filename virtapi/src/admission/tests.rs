use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};

use api::config::DefaultNetworkInterface;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, RuleWithOperations, ValidatingWebhookConfiguration,
    WebhookClientConfig,
};
use pretty_assertions::assert_eq;

use super::*;

const MANIFEST: &str = include_str!("../../../manifests/install/55-virt-api-webhooks.yaml");
const NOW: &str = "2026-01-02T03:04:05Z";
const USER: &str = "alice";

/// A change to a test object.
type Edit = fn(&mut Value);
/// What a hook should answer: allowed, or refused with a message containing this.
type Want = Result<(), &'static str>;

fn ctx() -> Context {
    let counter = Arc::new(AtomicU32::new(0));
    Context {
        cluster: ClusterConfig::default(),
        namespace: DEFAULT_NAMESPACE.to_owned(),
        node_restriction: true,
        hotplug: HotplugGates::default(),
        new_id: Arc::new(move || format!("id-{}", counter.fetch_add(1, Ordering::SeqCst))),
        now: Arc::new(|| NOW.parse().unwrap()),
        presets: Vec::new(),
        instancetypes: Found::default(),
    }
}

fn sa(name: &str) -> String {
    format!("system:serviceaccount:{DEFAULT_NAMESPACE}:{name}")
}

fn review(resource: &str, op: &str, user: &str, object: &Value, old: Option<&Value>) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "kubevirt.io", "version": "v1", "kind": "Whatever"},
            "resource": {"group": "kubevirt.io", "version": "v1", "resource": resource},
            "name": "demo",
            "namespace": "default",
            "operation": op,
            "userInfo": {"username": user, "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": old,
            "dryRun": false,
        }
    })
}

fn with_node(mut review: Value, node: &str) -> Value {
    review["request"]["userInfo"]["extra"] = json!({NODE_NAME_EXTRA: [node]});
    review
}

/// The `response` of `admit`, after checking the envelope and that the uid is echoed.
fn run_with(hook: Webhook, review: &Value, ctx: &Context) -> Value {
    let out = admit(hook, review, ctx);
    assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(out["kind"], "AdmissionReview");
    let uid = review
        .pointer("/request/uid")
        .cloned()
        .filter(Value::is_string)
        .unwrap_or(json!(""));
    assert_eq!(out["response"]["uid"], uid, "uid echoed");
    out["response"].clone()
}

fn run(hook: Webhook, review: &Value) -> Value {
    run_with(hook, review, &ctx())
}

/// `object` with the response's patch applied, as the API server does.
fn patched(object: &Value, response: &Value) -> Value {
    assert_eq!(response["allowed"], true, "{response}");
    let mut doc = object.clone();
    if response.get("patch").is_none() {
        assert!(response.get("patchType").is_none());
        return doc;
    }
    assert_eq!(response["patchType"], "JSONPatch");
    let bytes: ByteString = serde_json::from_value(response["patch"].clone()).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes.0).unwrap();
    json_patch::patch(&mut doc, &patch).unwrap();
    doc
}

/// `Ok(())` when allowed, else the refusal's message (after checking its shape).
fn verdict(response: &Value) -> Result<(), String> {
    if response["allowed"] == true {
        assert!(response.get("status").is_none());
        return Ok(());
    }
    assert_eq!(response["allowed"], false);
    let status = &response["status"];
    let code = status["code"].as_u64().unwrap();
    assert!(code == 400 || code == 422, "{status}");
    if code == 422 {
        assert_eq!(status["reason"], "Invalid");
        assert!(!status["details"]["causes"].as_array().unwrap().is_empty());
    }
    Err(status["message"].as_str().unwrap().to_owned())
}

fn expect(case: &str, got: &Result<(), String>, want: Result<(), &str>) {
    match (got, want) {
        (Ok(()), Ok(())) => {}
        (Err(msg), Err(part)) => assert!(msg.contains(part), "{case}: {msg:?} lacks {part:?}"),
        _ => panic!("{case}: got {got:?}, want {want:?}"),
    }
}

fn vmi() -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "demo", "namespace": "default", "labels": {"app": "demo"}},
        "spec": {
            "domain": {
                "resources": {"requests": {"memory": "128Mi"}},
                "devices": {"disks": [{"name": "root"}]},
            },
            "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/demo/disk:v1"}}],
        },
    })
}

/// `object` as the VMI mutator stores it.
fn defaulted_vmi(object: &Value) -> Value {
    let review = review("virtualmachineinstances", "CREATE", USER, object, None);
    patched(object, &run(Webhook::VmiMutator, &review))
}

#[test]
fn table_and_enum_agree() {
    let mut names = BTreeSet::new();
    let mut paths = BTreeSet::new();
    for (i, hook) in Webhook::ALL.into_iter().enumerate() {
        assert_eq!(WEBHOOKS[i].webhook, hook);
        assert_eq!(hook.spec().webhook, hook);
        assert_eq!(Webhook::from_path(hook.spec().path), Some(hook));
        assert!(names.insert(hook.spec().name), "duplicate name");
        assert!(paths.insert(hook.spec().path), "duplicate path");
    }
    let kinds: Vec<Admission> = WEBHOOKS.iter().map(|s| s.admission).collect();
    assert!(
        kinds.is_sorted_by_key(|a| *a == Admission::Validating),
        "mutating first"
    );
    assert_eq!(Webhook::from_path("/kubevirt-validate-update"), None);
}

/// One webhook as the manifest registers it, mutating or validating.
struct Registered {
    admission: Admission,
    name: String,
    client: WebhookClientConfig,
    rules: Vec<RuleWithOperations>,
    failure_policy: Option<String>,
    side_effects: String,
    timeout_seconds: Option<i32>,
    admission_review_versions: Vec<String>,
    match_conditions: Vec<(String, String)>,
}

fn conditions(
    c: Option<Vec<k8s_openapi::api::admissionregistration::v1::MatchCondition>>,
) -> Vec<(String, String)> {
    c.into_iter()
        .flatten()
        .map(|c| (c.name, c.expression))
        .collect()
}

#[test]
fn manifest_registers_exactly_the_table() {
    let docs: Vec<Value> = serde_saphyr::from_multiple(MANIFEST).unwrap();
    assert_eq!(docs.len(), 2);
    let mutating: MutatingWebhookConfiguration = serde_json::from_value(docs[0].clone()).unwrap();
    let validating: ValidatingWebhookConfiguration =
        serde_json::from_value(docs[1].clone()).unwrap();
    assert_eq!(
        mutating.metadata.name.as_deref(),
        Some(MUTATING_CONFIGURATION)
    );
    assert_eq!(
        validating.metadata.name.as_deref(),
        Some(VALIDATING_CONFIGURATION)
    );
    let registered: Vec<Registered> = (mutating.webhooks.into_iter().flatten())
        .map(|w| Registered {
            admission: Admission::Mutating,
            name: w.name,
            client: w.client_config,
            rules: w.rules.unwrap_or_default(),
            failure_policy: w.failure_policy,
            side_effects: w.side_effects,
            timeout_seconds: w.timeout_seconds,
            admission_review_versions: w.admission_review_versions,
            match_conditions: conditions(w.match_conditions),
        })
        .chain(
            validating
                .webhooks
                .into_iter()
                .flatten()
                .map(|w| Registered {
                    admission: Admission::Validating,
                    name: w.name,
                    client: w.client_config,
                    rules: w.rules.unwrap_or_default(),
                    failure_policy: w.failure_policy,
                    side_effects: w.side_effects,
                    timeout_seconds: w.timeout_seconds,
                    admission_review_versions: w.admission_review_versions,
                    match_conditions: conditions(w.match_conditions),
                }),
        )
        .collect();

    let in_yaml: BTreeSet<&str> = registered
        .iter()
        .filter_map(|r| r.client.service.as_ref()?.path.as_deref())
        .collect();
    let in_table: BTreeSet<&str> = WEBHOOKS.iter().map(|s| s.path).collect();
    assert_eq!(in_yaml, in_table, "paths of the YAML and of WEBHOOKS");
    assert_eq!(registered.len(), WEBHOOKS.len());

    let strings = |s: &[&str]| Some(s.iter().map(ToString::to_string).collect::<Vec<_>>());
    for (r, spec) in registered.iter().zip(&WEBHOOKS) {
        let name = &r.name;
        assert_eq!(name, spec.name, "same order as WEBHOOKS");
        assert_eq!(r.admission, spec.admission, "{name}");
        assert_eq!(
            r.client.ca_bundle, None,
            "{name}: the install step adds caBundle"
        );
        assert_eq!(r.client.url, None, "{name}");
        let service = r.client.service.as_ref().unwrap();
        assert_eq!(
            (
                service.namespace.as_str(),
                service.name.as_str(),
                service.port,
                service.path.as_deref()
            ),
            (DEFAULT_NAMESPACE, SERVICE_NAME, Some(443), Some(spec.path)),
            "{name}"
        );
        let [rule] = &r.rules[..] else {
            panic!("{name}: one rule");
        };
        let ops: Vec<&str> = spec.operations.iter().map(|o| o.as_str()).collect();
        assert_eq!(rule.operations, strings(&ops), "{name}");
        assert_eq!(rule.api_groups, strings(&[spec.group]), "{name}");
        assert_eq!(rule.api_versions, strings(&[spec.version]), "{name}");
        assert_eq!(rule.resources, strings(&[spec.resource]), "{name}");
        assert_eq!(
            r.failure_policy.as_deref(),
            Some(spec.failure_policy),
            "{name}"
        );
        assert_eq!(r.side_effects, spec.side_effects, "{name}");
        let want_conditions: Vec<(String, String)> = spec
            .match_condition
            .iter()
            .map(|c| (c.name.to_owned(), c.expression.to_owned()))
            .collect();
        assert_eq!(r.match_conditions, want_conditions, "{name}");
        assert_eq!(r.timeout_seconds, Some(spec.timeout_seconds), "{name}");
        assert_eq!(r.admission_review_versions, ["v1"], "{name}");
    }
}

#[test]
fn vmi_create_persists_the_defaults() {
    let mut masquerade = ctx();
    masquerade.cluster.default_network_interface = DefaultNetworkInterface::Masquerade;
    let cases: [(&str, &Context, &str, Value); 11] = [
        (
            "default interface, KubeVirt's bridge",
            &ctx(),
            "/spec/domain/devices/interfaces",
            json!([{"name": "default", "bridge": {}}]),
        ),
        (
            "default interface, masquerade configured",
            &masquerade,
            "/spec/domain/devices/interfaces",
            json!([{"name": "default", "masquerade": {}}]),
        ),
        (
            "pod network",
            &ctx(),
            "/spec/networks",
            json!([{"name": "default", "pod": {}}]),
        ),
        (
            "disk bus",
            &ctx(),
            "/spec/domain/devices/disks/0/disk/bus",
            json!("sata"),
        ),
        (
            "machine type",
            &ctx(),
            "/spec/domain/machine/type",
            json!("q35"),
        ),
        (
            "cpu model",
            &ctx(),
            "/spec/domain/cpu/model",
            json!("host-model"),
        ),
        (
            "finalizer",
            &ctx(),
            "/metadata/finalizers",
            json!(["kubevirt.io/foregroundDeleteVirtualMachine"]),
        ),
        (
            "pci topology",
            &ctx(),
            "/metadata/annotations/kubevirt.io~1pci-topology-version",
            json!("v3"),
        ),
        ("phase", &ctx(), "/status/phase", json!("Pending")),
        (
            "phase transition",
            &ctx(),
            "/status/phaseTransitionTimestamps",
            json!([{"phase": "Pending", "phaseTransitionTimestamp": NOW}]),
        ),
        ("non-root", &ctx(), "/status/runtimeUser", json!(107)),
    ];
    for (case, ctx, pointer, want) in cases {
        let review = review("virtualmachineinstances", "CREATE", USER, &vmi(), None);
        let stored = patched(&vmi(), &run_with(Webhook::VmiMutator, &review, ctx));
        assert_eq!(stored.pointer(pointer), Some(&want), "{case}");
    }
}

#[test]
fn vmi_patch_applied_to_the_request_gives_the_defaulted_vmi() {
    let mut empty_lists = vmi();
    empty_lists["spec"]["domain"]["devices"]["interfaces"] = json!([]);
    empty_lists["spec"]["networks"] = json!([]);
    let mut null_meta = vmi();
    null_meta["metadata"]["creationTimestamp"] = Value::Null;
    let mut user_status = vmi();
    user_status["status"] = json!({"phase": "Running", "nodeName": "n1"});
    for (case, object) in [
        ("minimal", vmi()),
        ("explicit empty lists", empty_lists),
        ("null creationTimestamp", null_meta),
        ("status written by the creator", user_status),
    ] {
        let stored = defaulted_vmi(&object);
        let mut want: VirtualMachineInstance = serde_json::from_value(object).unwrap();
        defaults::apply_vmi(&mut want, &ClusterConfig::default()).unwrap();
        let status = want.status.as_mut().unwrap();
        status.phase = Some(VirtualMachineInstancePhase::Pending);
        status
            .phase_transition_timestamps
            .push(api::status::PhaseTransitionTimestamp {
                phase: Some(VirtualMachineInstancePhase::Pending),
                phase_transition_timestamp: Some(Time(NOW.parse().unwrap())),
            });
        let got: VirtualMachineInstance = serde_json::from_value(stored).unwrap();
        assert_eq!(got, want, "{case}");
    }
}

#[test]
fn vmi_create_validation() {
    let reserved_label: Edit = |v| v["metadata"]["labels"]["kubevirt.io/nodeName"] = json!("n1");
    let cases: [(&str, String, Edit, Want); 5] = [
        ("valid", USER.to_owned(), |_| {}, Ok(())),
        (
            "disk without volume",
            USER.to_owned(),
            |v| v["spec"]["domain"]["devices"]["disks"][0]["name"] = json!("nope"),
            Err("spec.domain.devices.disks[0].name: no volume named \"nope\""),
        ),
        (
            "bad memory",
            USER.to_owned(),
            |v| v["spec"]["domain"]["resources"]["requests"]["memory"] = json!("lots"),
            Err("spec.domain.resources.requests.memory"),
        ),
        (
            "reserved label by a user",
            USER.to_owned(),
            reserved_label,
            Err("metadata.labels: creation of the following reserved kubevirt.io/ labels"),
        ),
        (
            "reserved label by virt-controller",
            sa(CONTROLLER_SERVICE_ACCOUNT),
            reserved_label,
            Ok(()),
        ),
    ];
    for (case, user, edit, want) in cases {
        let mut object = vmi();
        edit(&mut object);
        // The API server validates what the mutator stored.
        let review = review(
            "virtualmachineinstances",
            "CREATE",
            &user,
            &defaulted_vmi(&object),
            None,
        );
        let response = run(Webhook::VmiCreateValidator, &review);
        expect(case, &verdict(&response), want);
        if want.is_err() {
            let causes = response["status"]["details"]["causes"].as_array().unwrap();
            assert!(
                causes.iter().all(|c| c["field"].is_string()),
                "{case}: every cause has a field"
            );
        }
    }
}

#[test]
fn vmi_update() {
    struct Case {
        name: &'static str,
        user: String,
        node: Option<&'static str>,
        node_restriction: bool,
        edit: fn(&mut Value),
        validator: Result<(), &'static str>,
        status_reverted: bool,
    }
    let case = |name, user: String, node, edit, validator, status_reverted| Case {
        name,
        user,
        node,
        node_restriction: true,
        edit,
        validator,
        status_reverted,
    };
    let handler = sa(HANDLER_SERVICE_ACCOUNT);
    let controller = sa(CONTROLLER_SERVICE_ACCOUNT);
    let running = |v: &mut Value| v["status"]["phase"] = json!("Running");
    let cases = [
        case("no change", USER.into(), None, |_| {}, Ok(()), false),
        case(
            "spec change by a user",
            USER.into(),
            None,
            |v| v["spec"]["hostname"] = json!("x"),
            Err("spec: update of VMI object is restricted"),
            false,
        ),
        case(
            "spec change by another namespace's kubevirt-handler",
            "system:serviceaccount:other:kubevirt-handler".into(),
            None,
            |v| v["spec"]["hostname"] = json!("x"),
            Err("update of VMI object is restricted"),
            false,
        ),
        case(
            "own label by a user",
            USER.into(),
            None,
            |v| v["metadata"]["labels"]["app"] = json!("other"),
            Ok(()),
            false,
        ),
        case(
            "reserved label by a user",
            USER.into(),
            None,
            |v| v["metadata"]["labels"]["kubevirt.io/nodeName"] = json!("n2"),
            Err("metadata.labels: modification of the following reserved kubevirt.io/ labels"),
            false,
        ),
        case(
            "reserved label by virt-controller",
            controller.clone(),
            None,
            |v| v["metadata"]["labels"]["kubevirt.io/nodeName"] = json!("n2"),
            Ok(()),
            false,
        ),
        case("status by a user", USER.into(), None, running, Ok(()), true),
        case(
            "status by virt-controller",
            controller.clone(),
            None,
            running,
            Ok(()),
            false,
        ),
        case(
            "status by virt-handler of the VMI's node",
            handler.clone(),
            Some("node-a"),
            running,
            Ok(()),
            false,
        ),
        case(
            "status by virt-handler of the migration target",
            handler.clone(),
            Some("node-b"),
            running,
            Ok(()),
            false,
        ),
        case(
            "status by virt-handler of another node",
            handler.clone(),
            Some("node-c"),
            running,
            Err("virt-handler is only allowed to modify VMIs it owns"),
            false,
        ),
        case(
            "status by virt-handler without node name",
            handler.clone(),
            None,
            running,
            Err("missing node name"),
            false,
        ),
        case(
            "maxSockets by virt-controller",
            controller.clone(),
            None,
            |v| v["spec"]["domain"]["cpu"]["maxSockets"] = json!(8),
            Err("spec.domain.cpu.maxSockets: CPU topology maxSockets changed"),
            false,
        ),
        case(
            "maxGuest by virt-controller",
            controller.clone(),
            None,
            |v| v["spec"]["domain"]["memory"]["maxGuest"] = json!("2Gi"),
            Err("spec.domain.memory.maxGuest: Memory maxGuest changed"),
            false,
        ),
        case(
            "maxGuest respelled by virt-controller",
            controller.clone(),
            None,
            |v| v["spec"]["domain"]["memory"]["maxGuest"] = json!("512Mi"),
            Ok(()),
            false,
        ),
        case(
            "volume hotplug by virt-controller",
            controller.clone(),
            None,
            |v| v["spec"]["volumes"][0]["containerDisk"]["image"] = json!("quay.io/other:v1"),
            Err("hotplug volume root, changed"),
            false,
        ),
        Case {
            node_restriction: false,
            ..case(
                "status by virt-handler without node name, no node restriction",
                handler.clone(),
                None,
                running,
                Ok(()),
                false,
            )
        },
    ];
    let mut object = vmi();
    // Guest memory of 128Mi and maxGuest fixed at 512Mi, so a respelling is no change.
    object["spec"]["domain"]["memory"] = json!({"maxGuest": "0.5Gi"});
    let mut old = defaulted_vmi(&object);
    old["status"]["nodeName"] = json!("node-a");
    old["status"]["phase"] = json!("Scheduled");
    let mut migrating = old.clone();
    migrating["status"]["migrationState"] = json!({"targetNode": "node-b"});

    for c in cases {
        let old = if c.node == Some("node-b") {
            &migrating
        } else {
            &old
        };
        let mut new = old.clone();
        (c.edit)(&mut new);
        let mut ctx = ctx();
        ctx.node_restriction = c.node_restriction;
        let mut review = review(
            "virtualmachineinstances",
            "UPDATE",
            &c.user,
            &new,
            Some(old),
        );
        if let Some(node) = c.node {
            review = with_node(review, node);
        }
        let stored = patched(&new, &run_with(Webhook::VmiMutator, &review, &ctx));
        let want_status = if c.status_reverted {
            &old["status"]
        } else {
            &new["status"]
        };
        assert_eq!(&stored["status"], want_status, "{}: status", c.name);
        assert_eq!(
            stored["spec"], new["spec"],
            "{}: the mutator leaves the spec on update",
            c.name
        );
        expect(
            c.name,
            &verdict(&run_with(Webhook::VmiUpdateValidator, &review, &ctx)),
            c.validator,
        );
    }
}

#[test]
fn vmi_volume_hotplug_by_kubevirt() {
    fn hot(name: &str) -> Value {
        json!({"name": name, "persistentVolumeClaim": {"claimName": name, "hotpluggable": true}})
    }
    fn scsi(name: &str) -> Value {
        json!({"name": name, "disk": {"bus": "scsi"}})
    }
    fn plug(v: &mut Value, volume: Value, disk: Value) {
        v["spec"]["volumes"].as_array_mut().unwrap().push(volume);
        v["spec"]["domain"]["devices"]["disks"]
            .as_array_mut()
            .unwrap()
            .push(disk);
    }
    fn unplug(v: &mut Value, name: &str) {
        for list in ["/spec/volumes", "/spec/domain/devices/disks"] {
            v.pointer_mut(list)
                .and_then(Value::as_array_mut)
                .unwrap()
                .retain(|e| e["name"] != name);
        }
    }
    let cases: [(&str, Edit, Want); 19] = [
        (
            "add a PVC on scsi",
            |v| plug(v, hot("new"), scsi("new")),
            Ok(()),
        ),
        (
            "add a DataVolume on virtio",
            |v| {
                plug(
                    v,
                    json!({"name": "new", "dataVolume": {"name": "dv", "hotpluggable": true}}),
                    json!({"name": "new", "disk": {"bus": "virtio"}, "dedicatedIOThread": true}),
                );
            },
            Ok(()),
        ),
        (
            "add a LUN",
            |v| {
                plug(
                    v,
                    hot("new"),
                    json!({"name": "new", "lun": {"bus": "scsi"}}),
                );
            },
            Ok(()),
        ),
        ("remove a hotplugged volume", |v| unplug(v, "hot"), Ok(())),
        (
            "eject a hotplugged CD-ROM's volume",
            |v| {
                v["spec"]["volumes"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|e| e["name"] != "cd");
            },
            Ok(()),
        ),
        (
            "a volume without a disk",
            |v| {
                v["spec"]["volumes"]
                    .as_array_mut()
                    .unwrap()
                    .push(hot("new"));
            },
            Err("mismatch between volumes declared (4) and required (3)"),
        ),
        (
            "a disk without a volume",
            |v| {
                v["spec"]["domain"]["devices"]["disks"]
                    .as_array_mut()
                    .unwrap()
                    .push(scsi("new"));
            },
            Err("mismatch between volumes declared (3) and required (4)"),
        ),
        (
            "an emptyDisk",
            |v| {
                plug(
                    v,
                    json!({"name": "new", "emptyDisk": {"capacity": "1Gi"}}),
                    scsi("new"),
                );
            },
            Err("volume new is not a PVC or DataVolume"),
        ),
        (
            "a disk on sata",
            |v| {
                plug(
                    v,
                    hot("new"),
                    json!({"name": "new", "disk": {"bus": "sata"}}),
                );
            },
            Err(
                "Hotplug configuration for disk [new] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted.",
            ),
        ),
        (
            "a disk with no bus",
            |v| plug(v, hot("new"), json!({"name": "new", "disk": {}})),
            Err(
                "Hotplug configuration for disk [new] requires bus to be 'scsi' or 'virtio'. [] is not permitted.",
            ),
        ),
        (
            "a LUN on virtio",
            |v| {
                plug(
                    v,
                    hot("new"),
                    json!({"name": "new", "lun": {"bus": "virtio"}}),
                );
            },
            Err(
                "Hotplug configuration for LUN [new] requires bus to be 'scsi'. [virtio] is not permitted.",
            ),
        ),
        (
            "a CD-ROM",
            |v| {
                plug(
                    v,
                    hot("new"),
                    json!({"name": "new", "cdrom": {"bus": "scsi"}}),
                );
            },
            Err(
                "Hotplug configuration for [new] requires diskDevice of type 'disk' or 'lun' to be used.",
            ),
        ),
        (
            "an IOThread on scsi",
            |v| {
                plug(
                    v,
                    hot("new"),
                    json!({"name": "new", "disk": {"bus": "scsi"}, "dedicatedIOThread": true}),
                );
            },
            Err("Hotplug configuration for [new] requires virtio bus for IOThreads."),
        ),
        (
            "boot order 0",
            |v| {
                plug(
                    v,
                    hot("new"),
                    json!({"name": "new", "disk": {"bus": "scsi"}, "bootOrder": 0}),
                );
            },
            Err(
                "spec.domain.devices.disks[3].bootOrder: spec.domain.devices.disks[3] must have a boot order > 0, if supplied",
            ),
        ),
        (
            "remove the permanent volume",
            |v| unplug(v, "root"),
            Err("Number of permanent volumes has changed"),
        ),
        (
            "change the permanent volume",
            |v| v["spec"]["volumes"][0]["containerDisk"]["image"] = json!("other"),
            Err("permanent volume root, changed"),
        ),
        (
            "change the permanent disk",
            |v| v["spec"]["domain"]["devices"]["disks"][0]["serial"] = json!("x"),
            Err("permanent disk root, changed"),
        ),
        (
            "change a hotplugged volume",
            |v| v["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"] = json!("other"),
            Err("hotplug volume hot, changed"),
        ),
        (
            "change a hotplugged disk",
            |v| v["spec"]["domain"]["devices"]["disks"][1]["disk"]["bus"] = json!("virtio"),
            Err("hotplug disk hot, changed"),
        ),
    ];
    let mut old = defaulted_vmi(&vmi());
    plug(&mut old, hot("hot"), scsi("hot"));
    plug(
        &mut old,
        hot("cd"),
        json!({"name": "cd", "cdrom": {"bus": "scsi"}}),
    );
    old["status"]["phase"] = json!("Running");
    old["status"]["volumeStatus"] = json!([
        {"name": "root", "target": "vda"},
        {"name": "hot", "target": "sda", "hotplugVolume": {}},
        {"name": "cd", "target": "sdb", "hotplugVolume": {}},
    ]);
    for account in [API_SERVICE_ACCOUNT, CONTROLLER_SERVICE_ACCOUNT] {
        for (case, edit, want) in &cases {
            let mut new = old.clone();
            edit(&mut new);
            let review = review(
                "virtualmachineinstances",
                "UPDATE",
                &sa(account),
                &new,
                Some(&old),
            );
            let got = verdict(&run(Webhook::VmiUpdateValidator, &review));
            expect(&format!("{account}: {case}"), &got, *want);
        }
    }

    // Only KubeVirt's components go through the subresource.
    let mut new = old.clone();
    plug(&mut new, hot("new"), scsi("new"));
    let by_user = review("virtualmachineinstances", "UPDATE", USER, &new, Some(&old));
    expect(
        "a user's hotplug",
        &verdict(&run(Webhook::VmiUpdateValidator, &by_user)),
        Err("spec: update of VMI object is restricted"),
    );
    // Without DeclarativeHotplugVolumes a CD-ROM needs its volume.
    let mut new = old.clone();
    new["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .retain(|e| e["name"] != "cd");
    let review = review(
        "virtualmachineinstances",
        "UPDATE",
        &sa(CONTROLLER_SERVICE_ACCOUNT),
        &new,
        Some(&old),
    );
    let mut legacy = ctx();
    legacy.hotplug = HotplugGates {
        declarative: false,
        legacy: true,
    };
    expect(
        "eject without DeclarativeHotplugVolumes",
        &verdict(&run_with(Webhook::VmiUpdateValidator, &review, &legacy)),
        Err("mismatch between volumes declared (2) and required (3)"),
    );
}

#[test]
fn virt_handler_may_not_make_itself_migration_target() {
    let mut old = defaulted_vmi(&vmi());
    old["status"]["nodeName"] = json!("node-a");
    let mut new = old.clone();
    new["status"]["migrationState"] = json!({"targetNode": "node-a"});
    let review = with_node(
        review(
            "virtualmachineinstances",
            "UPDATE",
            &sa(HANDLER_SERVICE_ACCOUNT),
            &new,
            Some(&old),
        ),
        "node-a",
    );
    let got = verdict(&run(Webhook::VmiUpdateValidator, &review));
    expect(
        "set target",
        &got,
        Err(
            "status.migrationState.targetNode: Node restriction, virt-handler is not allowed to set target node",
        ),
    );
}

fn vm() -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": {
            "runStrategy": "Always",
            "template": {
                "metadata": {"labels": {"app": "demo"}},
                "spec": vmi()["spec"].clone(),
            },
        },
    })
}

#[test]
fn vm_mutator() {
    let create = review("virtualmachines", "CREATE", USER, &vm(), None);
    let stored = patched(&vm(), &run(Webhook::VmMutator, &create));
    let template = &stored["spec"]["template"];
    assert_eq!(
        template["spec"]["domain"]["firmware"],
        json!({"uuid": "id-0", "serial": "id-1"})
    );
    assert_eq!(
        template["spec"]["domain"]["machine"],
        json!({"type": "q35"})
    );
    assert_eq!(template["spec"]["architecture"], "amd64");
    assert_eq!(
        template["metadata"]["annotations"]["kubevirt.io/pci-topology-version"],
        "v3"
    );
    // The VMI defaults are the VMI mutator's business, when the VM controller creates the VMI.
    assert_eq!(
        template["spec"]["domain"]["devices"],
        vm()["spec"]["template"]["spec"]["domain"]["devices"]
    );

    let update = review("virtualmachines", "UPDATE", USER, &vm(), Some(&vm()));
    let stored = patched(&vm(), &run(Webhook::VmMutator, &update));
    assert_eq!(
        stored["spec"]["template"]["spec"]["domain"].get("firmware"),
        None,
        "ids only on create"
    );
    assert_eq!(
        stored["spec"]["template"]["spec"]["domain"]["machine"],
        json!({"type": "q35"})
    );

    let mut deleting = vm();
    deleting["metadata"]["deletionTimestamp"] = json!(NOW);
    let update = review(
        "virtualmachines",
        "UPDATE",
        USER,
        &deleting,
        Some(&deleting),
    );
    assert_eq!(
        patched(&deleting, &run(Webhook::VmMutator, &update)),
        deleting
    );
}

/// KubeVirt's instancetype mutator: the preference's machine type goes into a VM whose template
/// names none, ahead of the default; one the template names stays.
#[test]
fn vm_mutator_takes_the_preferred_machine_type() {
    let mut c = ctx();
    c.instancetypes = Found {
        instancetype: None,
        preference: serde_json::from_value(
            json!({"machine": {"preferredMachineType": "pc-q35-7.2"}}),
        )
        .unwrap(),
    };
    let mut with_pref = vm();
    with_pref["spec"]["preference"] = json!({"name": "q35-7.2"});
    let create = review("virtualmachines", "CREATE", USER, &with_pref, None);
    let stored = patched(&with_pref, &run_with(Webhook::VmMutator, &create, &c));
    assert_eq!(
        stored["spec"]["template"]["spec"]["domain"]["machine"],
        json!({"type": "pc-q35-7.2"})
    );

    with_pref["spec"]["template"]["spec"]["domain"]["machine"] = json!({"type": "q35"});
    let update = review(
        "virtualmachines",
        "UPDATE",
        USER,
        &with_pref,
        Some(&with_pref),
    );
    let stored = patched(&with_pref, &run_with(Webhook::VmMutator, &update, &c));
    assert_eq!(
        stored["spec"]["template"]["spec"]["domain"]["machine"],
        json!({"type": "q35"})
    );
}

#[test]
fn vm_validator() {
    let cases: [(&str, &str, Edit, Want); 6] = [
        ("valid", USER, |_| {}, Ok(())),
        (
            "unknown run strategy",
            USER,
            |v| v["spec"]["runStrategy"] = json!("Sometimes"),
            Err("spec.runStrategy: unknown run strategy"),
        ),
        (
            "running and runStrategy",
            USER,
            |v| v["spec"]["running"] = json!(true),
            Err("spec.running: running and runStrategy are mutually exclusive"),
        ),
        (
            "bad template",
            USER,
            |v| {
                v["spec"]["template"]["spec"]["domain"]["devices"]["disks"][0]["name"] =
                    json!("nope");
            },
            Err("spec.template.spec.domain.devices.disks[0].name"),
        ),
        (
            "reserved template label",
            USER,
            |v| v["spec"]["template"]["metadata"]["labels"]["kubevirt.io/created-by"] = json!("x"),
            Err("spec.template.metadata.labels: creation of the following reserved"),
        ),
        (
            "being deleted",
            USER,
            |v| {
                v["metadata"]["deletionTimestamp"] = json!(NOW);
                v["spec"]["runStrategy"] = json!("Sometimes");
            },
            Ok(()),
        ),
    ];
    for (case, user, edit, want) in cases {
        let mut object = vm();
        edit(&mut object);
        for op in ["CREATE", "UPDATE"] {
            let review = review(
                "virtualmachines",
                op,
                user,
                &object,
                (op == "UPDATE").then_some(&object),
            );
            expect(case, &verdict(&run(Webhook::VmValidator, &review)), want);
        }
    }

    let mut running = vm();
    running["spec"]
        .as_object_mut()
        .unwrap()
        .remove("runStrategy");
    running["spec"]["running"] = json!(true);
    let review = review("virtualmachines", "CREATE", USER, &running, None);
    let response = run(Webhook::VmValidator, &review);
    assert_eq!(
        response["warnings"],
        json!(["spec.running is deprecated, please use spec.runStrategy instead."])
    );
}

#[test]
fn replicaset_validator() {
    let rs = |selector: Value| {
        json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstanceReplicaSet",
            "metadata": {"name": "demo", "namespace": "default"},
            "spec": {
                "replicas": 2,
                "selector": selector,
                "template": {"metadata": {"labels": {"app": "demo"}}, "spec": vmi()["spec"].clone()},
            },
        })
    };
    let cases = [
        (
            "matching selector",
            rs(json!({"matchLabels": {"app": "demo"}})),
            Ok(()),
        ),
        (
            "selector not matching the template",
            rs(json!({"matchLabels": {"app": "other"}})),
            Err("spec.selector.matchLabels: app=other does not match"),
        ),
        (
            "empty selector",
            rs(json!({})),
            Err("spec.selector: must select at least one label"),
        ),
    ];
    for (case, object, want) in cases {
        let review = review(
            "virtualmachineinstancereplicasets",
            "CREATE",
            USER,
            &object,
            None,
        );
        expect(
            case,
            &verdict(&run(Webhook::ReplicaSetValidator, &review)),
            want,
        );
    }
}

fn migration() -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": "mig", "namespace": "default"},
        "spec": {"vmiName": "demo"},
    })
}

#[test]
fn migration_mutator() {
    let first = review(
        "virtualmachineinstancemigrations",
        "CREATE",
        USER,
        &migration(),
        None,
    );
    let stored = patched(&migration(), &run(Webhook::MigrationMutator, &first));
    assert_eq!(
        stored["metadata"]["labels"],
        json!({MIGRATION_SELECTOR_LABEL: "demo"})
    );
    assert_eq!(
        stored["metadata"]["finalizers"],
        json!([labels::MIGRATION_FINALIZER]),
        "the migration controller removes it once the migration is final"
    );
    assert_eq!(stored["spec"], migration()["spec"]);
    // A client that set the finalizer itself does not get it twice.
    let mut own = migration();
    own["metadata"]["finalizers"] = json!([labels::MIGRATION_FINALIZER]);
    let again = review(
        "virtualmachineinstancemigrations",
        "CREATE",
        USER,
        &own,
        None,
    );
    let stored = patched(&own, &run(Webhook::MigrationMutator, &again));
    assert_eq!(
        stored["metadata"]["finalizers"],
        json!([labels::MIGRATION_FINALIZER])
    );
}

#[test]
fn migration_validators() {
    let controller = sa(CONTROLLER_SERVICE_ACCOUNT);
    let create: [(&str, &str, Edit, Want); 5] = [
        ("valid", USER, |_| {}, Ok(())),
        (
            "no vmiName",
            USER,
            |v| v["spec"] = json!({}),
            Err("spec.vmiName: required"),
        ),
        (
            "priority by a user",
            USER,
            |v| v["spec"]["priority"] = json!("system-critical"),
            Err("spec.priority: Migration priority queue, only virt-controller"),
        ),
        (
            "priority by virt-controller",
            &controller,
            |v| v["spec"]["priority"] = json!("system-critical"),
            Ok(()),
        ),
        (
            "decentralized",
            USER,
            |v| v["spec"]["receive"] = json!({"migrationID": "m"}),
            Err("spec.receive: not supported by kubevirt-rs yet"),
        ),
    ];
    for (case, user, edit, want) in create {
        let mut object = migration();
        edit(&mut object);
        let review = review(
            "virtualmachineinstancemigrations",
            "CREATE",
            user,
            &object,
            None,
        );
        expect(
            case,
            &verdict(&run(Webhook::MigrationCreateValidator, &review)),
            want,
        );
    }

    let mut old = migration();
    old["metadata"]["labels"] = json!({MIGRATION_SELECTOR_LABEL: "demo"});
    let update: [(&str, Edit, Want); 6] = [
        (
            "status change",
            |v| v["status"] = json!({"phase": "Running"}),
            Ok(()),
        ),
        (
            "spec change",
            |v| v["spec"]["vmiName"] = json!("other"),
            Err("spec: update of Migration object's spec is restricted"),
        ),
        (
            "selector label removed in flight",
            |v| v["metadata"]["labels"] = json!({}),
            Err("selector label can't be removed from an in-flight migration"),
        ),
        (
            "selector label changed in flight",
            |v| v["metadata"]["labels"][MIGRATION_SELECTOR_LABEL] = json!("x"),
            Err("selector label can't be modified on an in-flight migration"),
        ),
        (
            "selector label removed when succeeded",
            |v| {
                v["metadata"]["labels"] = json!({});
                v["status"] = json!({"phase": "Succeeded"});
            },
            Ok(()),
        ),
        (
            "other label changed",
            |v| v["metadata"]["labels"]["app"] = json!("x"),
            Ok(()),
        ),
    ];
    for (case, edit, want) in update {
        let mut new = old.clone();
        edit(&mut new);
        let review = review(
            "virtualmachineinstancemigrations",
            "UPDATE",
            USER,
            &new,
            Some(&old),
        );
        expect(
            case,
            &verdict(&run(Webhook::MigrationUpdateValidator, &review)),
            want,
        );
    }
}

#[test]
fn malformed_reviews_are_refused_not_panicked_on() {
    let good = review("virtualmachineinstances", "CREATE", USER, &vmi(), None);
    let edit = |f: fn(&mut Value)| {
        let mut r = good.clone();
        f(&mut r);
        r
    };
    let cases = [
        (
            "not an object",
            json!("hello"),
            "expected an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            "v1beta1",
            edit(|r| r["apiVersion"] = json!("admission.k8s.io/v1beta1")),
            "expected an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            "null request",
            edit(|r| r["request"] = Value::Null),
            "AdmissionReview has no request",
        ),
        (
            "request missing",
            edit(|r| {
                r.as_object_mut().unwrap().remove("request");
            }),
            "AdmissionReview has no request",
        ),
        (
            "no uid",
            edit(|r| {
                r["request"].as_object_mut().unwrap().remove("uid");
            }),
            "request has no uid",
        ),
        (
            "uid not a string",
            edit(|r| r["request"]["uid"] = json!(7)),
            "request has no uid",
        ),
        (
            "no resource",
            edit(|r| {
                r["request"].as_object_mut().unwrap().remove("resource");
            }),
            "cannot read the AdmissionRequest",
        ),
        (
            "another resource",
            edit(|r| r["request"]["resource"]["resource"] = json!("pods")),
            "expect resource to be 'virtualmachineinstances.kubevirt.io/v1'",
        ),
        (
            "another group",
            edit(|r| r["request"]["resource"]["group"] = json!("")),
            "expect resource to be",
        ),
        (
            "a subresource",
            edit(|r| r["request"]["subResource"] = json!("status")),
            "expect resource to be",
        ),
        (
            "DELETE",
            edit(|r| r["request"]["operation"] = json!("DELETE")),
            "operation DELETE is not admitted by /virtualmachineinstances-validate-create",
        ),
        (
            "UPDATE to a create hook",
            edit(|r| r["request"]["operation"] = json!("UPDATE")),
            "operation UPDATE is not admitted",
        ),
        (
            "no object",
            edit(|r| r["request"]["object"] = Value::Null),
            "AdmissionRequest has no object",
        ),
        (
            "object not an object",
            edit(|r| r["request"]["object"] = json!([1, 2])),
            "AdmissionRequest has no object",
        ),
        (
            "undecodable object",
            edit(|r| r["request"]["object"]["spec"] = json!("nope")),
            "cannot decode object",
        ),
        (
            "undecodable field",
            edit(|r| {
                r["request"]["object"]["spec"]["domain"]["devices"]["disks"] = json!({"a": 1});
            }),
            "cannot decode object",
        ),
    ];
    for (case, review, want) in cases {
        let response = run(Webhook::VmiCreateValidator, &review);
        assert_eq!(response["status"]["code"], 400, "{case}");
        expect(case, &verdict(&response), Err(want));
    }

    let update = review("virtualmachineinstances", "UPDATE", USER, &vmi(), None);
    let response = run(Webhook::VmiUpdateValidator, &update);
    expect(
        "UPDATE without oldObject",
        &verdict(&response),
        Err("UPDATE AdmissionRequest has no oldObject"),
    );
    let mut bad_old = review(
        "virtualmachineinstances",
        "UPDATE",
        USER,
        &vmi(),
        Some(&vmi()),
    );
    bad_old["request"]["oldObject"]["spec"] = json!(1);
    let response = run(Webhook::VmiUpdateValidator, &bad_old);
    expect(
        "undecodable oldObject",
        &verdict(&response),
        Err("cannot decode oldObject"),
    );
}

#[test]
fn every_hook_answers_every_kind_without_panicking() {
    let objects = [
        vmi(),
        vm(),
        migration(),
        json!({}),
        json!({"spec": null, "status": 3}),
    ];
    for hook in Webhook::ALL {
        for object in &objects {
            for op in ["CREATE", "UPDATE", "DELETE", "CONNECT"] {
                let review = review(hook.spec().resource, op, USER, object, Some(object));
                let response = run(hook, &review);
                assert!(response["allowed"].is_boolean(), "{hook:?} {op}");
            }
        }
    }
}

#[test]
fn dry_run_is_answered_the_same() {
    let mut dry = review("virtualmachineinstances", "CREATE", USER, &vmi(), None);
    let wet = run(Webhook::VmiMutator, &dry);
    dry["request"]["dryRun"] = json!(true);
    assert_eq!(run(Webhook::VmiMutator, &dry), wet);
}

#[test]
fn refusals_are_capped_at_ten_causes_as_kubevirt() {
    let mut object = vmi();
    let disks: Vec<Value> = (0..12).map(|i| json!({"name": format!("d{i}")})).collect();
    object["spec"]["domain"]["devices"]["disks"] = json!(disks);
    object["spec"]["volumes"] = json!([]);
    let review = review("virtualmachineinstances", "CREATE", USER, &object, None);
    let response = run(Webhook::VmiCreateValidator, &review);
    let causes = response["status"]["details"]["causes"].as_array().unwrap();
    assert_eq!(causes.len(), 10);
    let message = verdict(&response).unwrap_err();
    assert!(
        message.starts_with("spec.domain.devices.disks[0].name: "),
        "{message}"
    );
    assert!(
        message.ends_with(", and 2 more validation errors"),
        "{message}"
    );
}

#[test]
fn context_from_kubevirt() {
    let kv = |dev: Value| -> KubeVirt {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "KubeVirt",
            "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
            "spec": {"configuration": {"developerConfiguration": dev, "network": {"defaultNetworkInterface": "masquerade"}}},
        }))
        .unwrap()
    };
    let cases = [
        ("Beta gate on by default", json!({}), true),
        (
            "disabled",
            json!({"disabledFeatureGates": ["NodeRestriction"]}),
            false,
        ),
        (
            "enabled wins over disabled",
            json!({"featureGates": ["NodeRestriction"], "disabledFeatureGates": ["NodeRestriction"]}),
            true,
        ),
    ];
    for (case, dev, want) in cases {
        let ctx = Context::from_kubevirt(&kv(dev), "kubevirt");
        assert_eq!(ctx.node_restriction, want, "{case}");
        assert_eq!(ctx.hotplug, HotplugGates::default(), "{case}");
        assert_eq!(
            ctx.cluster.default_network_interface,
            DefaultNetworkInterface::Masquerade
        );
        assert_ne!((ctx.new_id)(), (ctx.new_id)(), "{case}: fresh ids");
    }
    let hotplug = |dev: Value| Context::from_kubevirt(&kv(dev), "kubevirt").hotplug;
    let gates = |declarative, legacy| HotplugGates {
        declarative,
        legacy,
    };
    assert_eq!(
        hotplug(json!({"disabledFeatureGates": ["DeclarativeHotplugVolumes"]})),
        gates(false, false)
    );
    assert!(!gates(false, false).enabled());
    assert_eq!(
        hotplug(
            json!({"featureGates": ["HotplugVolumes"], "disabledFeatureGates": ["DeclarativeHotplugVolumes"]})
        ),
        gates(false, true)
    );
    assert_eq!(
        hotplug(json!({"featureGates": ["HotplugVolumes"]})),
        gates(true, true)
    );
    assert!(gates(false, true).enabled());
    let ctx = ctx();
    assert_eq!(
        ctx.service_account(&sa(HANDLER_SERVICE_ACCOUNT)),
        Some(HANDLER_SERVICE_ACCOUNT)
    );
    assert_eq!(
        ctx.service_account("system:serviceaccount:kubevirt:default"),
        None
    );
    assert_eq!(
        ctx.service_account("system:serviceaccount:kubevirtx:kubevirt-handler"),
        None
    );
    assert_eq!(ctx.service_account("kubevirt-handler"), None);
}

/// KubeVirt's VM admitter applies the VM's instance type and preference before validating:
/// a template without memory passes with an instance type giving it, a field both set is
/// refused with KubeVirt's message, and a preference's requirements are checked.
#[test]
fn vm_validator_applies_instancetype_and_preference() {
    let found = |it: Value, pref: Value| {
        let mut c = ctx();
        c.instancetypes = Found {
            instancetype: serde_json::from_value(it).unwrap(),
            preference: serde_json::from_value(pref).unwrap(),
        };
        c
    };
    let mut with_type = vm();
    with_type["spec"]["instancetype"] = json!({"name": "u1.small"});
    let template = &mut with_type["spec"]["template"]["spec"]["domain"];
    template.as_object_mut().unwrap().remove("resources");
    let it = json!({"cpu": {"guest": 2}, "memory": {"guest": "256Mi"}});
    let cases = [
        (
            "instance type gives the memory",
            with_type.clone(),
            found(it.clone(), Value::Null),
            Ok(()),
        ),
        (
            "instance type not found",
            with_type.clone(),
            ctx(),
            Err("spec.template.spec.domain"),
        ),
        (
            "template sets the vCPUs too",
            {
                let mut v = with_type.clone();
                v["spec"]["template"]["spec"]["domain"]["cpu"] = json!({"sockets": 2});
                v
            },
            found(it.clone(), Value::Null),
            Err(
                "VM field(s) spec.template.spec.domain.cpu.sockets conflicts with selected instance type",
            ),
        ),
        (
            "preference requires more memory",
            with_type.clone(),
            found(
                it.clone(),
                json!({"requirements": {"memory": {"guest": "1Gi"}}}),
            ),
            Err(
                "failure checking preference requirements: insufficient Memory resources of 256Mi provided by instance type, preference requires 1Gi",
            ),
        ),
        (
            "spread the vCPUs cannot take",
            with_type.clone(),
            found(
                json!({"cpu": {"guest": 3}, "memory": {"guest": "256Mi"}}),
                json!({"cpu": {"preferredCPUTopology": "spread"}}),
            ),
            Err("3 vCPUs provided by the instance type are not divisible"),
        ),
        (
            "a preference field kubevirt-rs cannot honour",
            with_type.clone(),
            found(it.clone(), json!({"devices": {"preferredTPM": {}}})),
            Err("preference.spec.devices.preferredTPM: not supported"),
        ),
        (
            "a kind of neither",
            {
                let mut v = with_type.clone();
                v["spec"]["instancetype"]["kind"] = json!("VirtualMachinePreference");
                v
            },
            found(it, Value::Null),
            Err("got unexpected kind in InstancetypeMatcher: VirtualMachinePreference"),
        ),
    ];
    for (case, object, ctx, want) in cases {
        let review = review("virtualmachines", "CREATE", USER, &object, None);
        expect(
            case,
            &verdict(&run_with(Webhook::VmValidator, &review, &ctx)),
            want,
        );
    }
}

fn preset(
    name: &str,
    selector: &Value,
    domain: &Value,
) -> api::preset::VirtualMachineInstancePreset {
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstancePreset",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"selector": selector, "domain": domain},
    }))
    .unwrap()
}

#[test]
fn vmi_create_applies_matching_presets_and_warns_they_are_deprecated() {
    let mut ctx = ctx();
    ctx.presets = vec![
        preset(
            "cores",
            &json!({"matchLabels": {"app": "demo"}}),
            &json!({"cpu": {"cores": 3}, "devices": {}}),
        ),
        preset(
            "elsewhere",
            &json!({"matchLabels": {"app": "other"}}),
            &json!({"cpu": {"cores": 5}, "devices": {}}),
        ),
    ];
    let object = vmi();
    let create = |object: &Value| review("virtualmachineinstances", "CREATE", USER, object, None);
    let response = run_with(Webhook::VmiMutator, &create(&object), &ctx);
    assert_eq!(
        response["warnings"],
        json!([api::preset::DEPRECATION_WARNING])
    );
    let stored = patched(&object, &response);
    assert_eq!(stored["spec"]["domain"]["cpu"]["cores"], 3);
    assert_eq!(
        stored["metadata"]["annotations"]["virtualmachinepreset.kubevirt.io/cores"],
        "kubevirt.io/v1"
    );
    assert!(
        stored["metadata"]["annotations"]
            .get("virtualmachinepreset.kubevirt.io/elsewhere")
            .is_none()
    );

    // Excluded: nothing applied, no warning.
    let mut excluded = vmi();
    excluded["metadata"]["annotations"] = json!({api::preset::EXCLUSION_ANNOTATION: "true"});
    let response = run_with(Webhook::VmiMutator, &create(&excluded), &ctx);
    assert!(response.get("warnings").is_none());
    assert!(
        patched(&excluded, &response)["metadata"]["annotations"]
            .get("virtualmachinepreset.kubevirt.io/cores")
            .is_none()
    );

    // Two matching presets that disagree refuse the VMI, with KubeVirt's 422.
    ctx.presets.push(preset(
        "more-cores",
        &json!({"matchLabels": {"app": "demo"}}),
        &json!({"cpu": {"cores": 4}, "devices": {}}),
    ));
    let response = run_with(Webhook::VmiMutator, &create(&object), &ctx);
    assert_eq!(response["allowed"], false);
    assert_eq!(response["status"]["code"], 422);
    assert_eq!(
        response["status"]["message"],
        r#"VirtualMachinePresets cannot be applied due to conflicts: presets 'more-cores' and 'cores' conflict: [spec.cpu: {"cores":4} != {"cores":3}]"#
    );
}

#[test]
fn preset_validator_requires_a_domain() {
    for (case, domain, want) in [
        ("with a domain", json!({"devices": {}}), Ok(())),
        ("without", Value::Null, Err("spec.domain: missing domain.")),
    ] {
        let mut object = serde_json::to_value(preset("p", &json!({}), &json!({}))).unwrap();
        object["spec"]["domain"] = domain;
        let review = review(
            "virtualmachineinstancepresets",
            "CREATE",
            USER,
            &object,
            None,
        );
        expect(
            case,
            &verdict(&run(Webhook::PresetValidator, &review)),
            want,
        );
    }
}

#[test]
fn pool_validator() {
    let pool = |edit: Edit| {
        let mut p = json!({
            "apiVersion": "pool.kubevirt.io/v1beta1",
            "kind": "VirtualMachinePool",
            "metadata": {"name": "demo", "namespace": "default"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "demo"}},
                "virtualMachineTemplate": {
                    "metadata": {"labels": {"app": "demo"}},
                    "spec": {"runStrategy": "Always", "template": {"spec": vmi()["spec"].clone()}},
                },
            },
        });
        edit(&mut p);
        p
    };
    let pool_review = |op: &str, object: &Value, old: Option<&Value>| {
        let mut r = review("virtualmachinepools", op, USER, object, old);
        r["request"]["resource"]["group"] = json!("pool.kubevirt.io");
        r["request"]["resource"]["version"] = json!("v1beta1");
        r
    };
    let cases: [(&str, Edit, Want); 7] = [
        ("valid", |_| {}, Ok(())),
        (
            "selector not matching the template",
            |p| p["spec"]["selector"] = json!({"matchLabels": {"app": "other"}}),
            Err("spec.selector: selector does not match labels."),
        ),
        (
            "VM template validated as a VM's",
            |p| {
                p["spec"]["virtualMachineTemplate"]["spec"]["template"]["spec"]["domain"]["devices"]
                    ["gpus"] = json!([{"name": "g", "deviceName": "x"}]);
            },
            Err(
                "spec.virtualMachineTemplate.spec.template.spec.domain.devices.gpus: not supported by kubevirt-rs yet",
            ),
        ),
        (
            "maxUnavailable percentage",
            |p| p["spec"]["maxUnavailable"] = json!("0%"),
            Err("spec.maxUnavailable: maxUnavailable percentage value 0 must be between 1 and 100"),
        ),
        (
            "two update strategies",
            |p| p["spec"]["updateStrategy"] = json!({"unmanaged": {}, "opportunistic": {}}),
            Err(
                "spec.updateStrategy: only one of unmanaged, opportunistic, or proactive can be specified",
            ),
        ),
        (
            "state preservation",
            |p| {
                p["spec"]["scaleInStrategy"] =
                    json!({"proactive": {"statePreservation": "Offline"}});
            },
            Err(
                "spec.scaleInStrategy.proactive.statePreservation: Offline: not supported by kubevirt-rs yet",
            ),
        ),
        (
            "autohealing",
            |p| p["spec"]["autohealing"] = json!({"startUpFailureThreshold": 2}),
            Err("spec.autohealing: not supported by kubevirt-rs yet"),
        ),
    ];
    for (case, edit, want) in cases {
        let object = pool(edit);
        let response = run(
            Webhook::PoolValidator,
            &pool_review("CREATE", &object, None),
        );
        expect(case, &verdict(&response), want);
    }
    let old = pool(|_| {});
    let moved = pool(|p| {
        p["spec"]["selector"] = json!({"matchLabels": {"app": "demo", "tier": "x"}});
        p["spec"]["virtualMachineTemplate"]["metadata"]["labels"]["tier"] = json!("x");
    });
    expect(
        "selector changed",
        &verdict(&run(
            Webhook::PoolValidator,
            &pool_review("UPDATE", &moved, Some(&old)),
        )),
        Err("spec.selector: selector is immutable after creation."),
    );
}
