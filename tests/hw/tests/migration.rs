//! Live migration through the whole stack on two localcluster nodes, KubeVirt's own shapes:
//! `vmi-migratable` (masquerade, a containerDisk; here the test guest's, plus a cloud-init
//! script that counts on the serial console) and `migration-job` (a VMIM naming it). The guest
//! keeps counting through the move (the target's console goes on from where the source's
//! stopped: no reboot), the VMI ends on the other node with `migrationState.completed`, and the
//! source pod is gone. The VMI keeps persistent EFI variables on a `ReadWriteOnce` claim,
//! which the migration hands over to one made for the target. Then, with
//! `bandwidthPerMigration: 1Mi` so that a migration runs for minutes, a VMIM deleted while it
//! runs is aborted: the VMI stays where it is, Running, and the target's claim goes.
//! Failures (an unschedulable target pod, the target's launcher or the source's virt-handler
//! killed mid-way) leave the VM running on the source with the VMIM saying why, and
//! `kubectl drain` moves a `LiveMigrate` VMI under a MigrationPolicy and completes.

use std::time::Duration;

use e2e::{Stack, kill_in_pod, wait_for};
use serde_json::{Value, json};

const BOOT: Duration = Duration::from_mins(7);
const MIGRATE: Duration = Duration::from_mins(5);

fn vmi_migratable() -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "vmi-migratable", "namespace": "default",
                     "labels": {"special": "vmi-migratable"}},
        "spec": {
            "domain": {
                "devices": {
                    "disks": [
                        {"disk": {"bus": "virtio"}, "name": "containerdisk"},
                        {"disk": {"bus": "virtio"}, "name": "cloudinitdisk"},
                    ],
                    "interfaces": [{"masquerade": {}, "name": "default"}],
                },
                "memory": {"guest": "256Mi"},
                "resources": {},
            },
            "networks": [{"name": "default", "pod": {}}],
            "terminationGracePeriodSeconds": 0,
            "volumes": [
                {"containerDisk": {"image": "kubevirt-rs/test-guest-disk:latest"}, "name": "containerdisk"},
                {"cloudInitNoCloud": {"userData": "#!/bin/sh\n(i=0; while :; do i=$((i+1)); echo \"TICK-$i\" > /dev/ttyS0; sleep 1; done) &\n(nc -ll -p 8080 -e echo vmi-migratable </dev/null >/dev/null 2>&1 &)\n"}, "name": "cloudinitdisk"},
            ],
        },
    })
}

fn migration(name: &str) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"vmiName": "vmi-migratable"},
    })
}

fn vmi(stack: &Stack) -> Result<Value, String> {
    stack
        .get_json("default", "vmi", "vmi-migratable")
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "no VMI".to_owned())
}

fn condition<'a>(v: &'a Value, type_: &str) -> Option<&'a Value> {
    v["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// The counter values on the VMI's current serial console log.
fn ticks(stack: &Stack, v: &Value) -> Vec<u64> {
    let Some(dir) = stack.vmi_private_dir(v) else {
        return Vec::new();
    };
    let log = std::fs::read_to_string(dir.join("virt-serial0-log")).unwrap_or_default();
    log.split("TICK-")
        .skip(1)
        .filter_map(|t| t.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .collect()
}

fn launcher_pods(stack: &Stack, uid: &str) -> Vec<(String, String, String)> {
    let out = stack
        .kubectl(&[
            "-n",
            "default",
            "get",
            "pods",
            "-l",
            &format!("kubevirt.io/created-by={uid}"),
            "-o",
            "jsonpath={range .items[*]}{.metadata.name} {.spec.nodeName} {.status.phase}{\"\\n\"}{end}",
        ])
        .unwrap_or_default();
    out.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().map(str::to_owned);
            Some((f.next()?, f.next()?, f.next()?))
        })
        .collect()
}

fn vmim_phase(stack: &Stack, name: &str) -> Result<Option<String>, String> {
    Ok(stack
        .get_json("default", "vmim", name)
        .map_err(|e| e.to_string())?
        .map(|m| m["status"]["phase"].as_str().unwrap_or_default().to_owned()))
}

/// Applies `manifest` (a `vmi-migratable`) and waits until the VMI runs, is live-migratable and
/// its guest has counted to `ticks_at_least` on its console; the VMI, and the count then.
fn boot(stack: &Stack, manifest: &Value, ticks_at_least: u64) -> (Value, u64) {
    stack.apply(manifest);
    let v = wait_for("the VMI Running and live-migratable", BOOT, || {
        let v = vmi(stack)?;
        let migratable = condition(&v, "LiveMigratable").map(|c| c["status"].clone());
        if v["status"]["phase"] == "Running" && migratable == Some(json!("True")) {
            Ok(Some(v))
        } else {
            Err(format!(
                "phase {}, LiveMigratable {migratable:?}",
                v["status"]["phase"]
            ))
        }
    })
    .unwrap();
    let count = wait_for("the guest counting on its console", BOOT, || {
        let t = ticks(stack, &v);
        t.last()
            .copied()
            .filter(|n| *n >= ticks_at_least)
            .map(Some)
            .ok_or_else(|| format!("{t:?}"))
    })
    .unwrap();
    (v, count)
}

/// Waits until the guest's console counter passes `past`; the count then.
fn counts_past(stack: &Stack, v: &Value, past: u64, what: &str) -> u64 {
    wait_for(what, Duration::from_mins(2), || {
        let t = ticks(stack, v);
        t.last()
            .copied()
            .filter(|n| *n > past)
            .map(Some)
            .ok_or_else(|| format!("{t:?}"))
    })
    .unwrap()
}

/// The guest counts on from where it is.
fn still_counting(stack: &Stack, v: &Value) {
    let now = ticks(stack, v).last().copied().unwrap_or_default();
    counts_past(stack, v, now, "the guest still counting");
}

/// On the console of the VMI's new pod the count goes on from `before` (the source's last):
/// it started past half of that, so the guest did not reboot.
fn went_on_after_the_move(stack: &Stack, v: &Value, before: u64) {
    let after = counts_past(
        stack,
        v,
        before,
        "the guest counting on the target's console",
    );
    let first = ticks(stack, v)[0];
    assert!(
        first > before / 2 && first <= after,
        "the count went on ({before} on the source, then {first}..{after} here): no reboot"
    );
}

/// Waits until the VMI's only launcher pod is the one on `node`.
fn only_launcher_pod_on(stack: &Stack, uid: &str, node: &str) {
    wait_for(
        &format!("only the launcher pod on {node} left"),
        Duration::from_mins(2),
        || {
            let pods = launcher_pods(stack, uid);
            (pods.len() == 1 && pods[0].1 == node)
                .then_some(Some(()))
                .ok_or_else(|| format!("{pods:?}"))
        },
    )
    .unwrap();
}

/// `bandwidthPerMigration: 1Mi` in the KubeVirt CR: a migration then runs for minutes.
fn throttle_migrations(stack: &Stack) {
    stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "patch",
            "kv",
            "kubevirt",
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"configuration":{"migrations":{"bandwidthPerMigration":"1Mi"}}}}"#,
        ])
        .unwrap();
}

/// The claim `status.volumeStatus` names for the VMI's persistent EFI variables.
fn backend_claim(v: &Value) -> String {
    v["status"]["volumeStatus"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == "persistent-state-for-this-vm")
        .and_then(|e| e["persistentVolumeClaimInfo"]["claimName"].as_str())
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn migration_moves_a_running_vmi_to_the_other_node_and_a_deleted_one_aborts() {
    let stack = Stack::up_nodes(2).expect("the stack on two nodes");
    // With persistent EFI variables (OVMF, the guest's signed GRUB: 512Mi) on localcluster's
    // default class, ReadWriteOnce: the migration hands the claim over to one of the target's.
    let mut manifest = vmi_migratable();
    manifest["spec"]["domain"]["firmware"] =
        json!({"bootloader": {"efi": {"secureBoot": false, "persistent": true}}});
    manifest["spec"]["domain"]["memory"] = json!({"guest": "512Mi"});
    let (v, before) = boot(&stack, &manifest, 5);
    let source_claim = backend_claim(&v);
    assert!(
        source_claim.starts_with("persistent-state-for-vmi-migratable-"),
        "{}",
        v["status"]
    );
    assert_eq!(
        v["status"]["migrationMethod"], "BlockMigration",
        "{}",
        v["status"]
    );
    let source = v["status"]["nodeName"].as_str().unwrap().to_owned();
    let uid = v["metadata"]["uid"].as_str().unwrap().to_owned();

    stack.apply(&migration("migration-job"));
    let m = wait_for("migration-job Succeeded", MIGRATE, || {
        let m = stack
            .get_json("default", "vmim", "migration-job")
            .map_err(|e| e.to_string())?
            .ok_or("no VMIM")?;
        match m["status"]["phase"].as_str() {
            Some("Succeeded") => Ok(Some(m)),
            Some("Failed") => panic!("the migration failed: {}", m["status"]),
            p => Err(format!(
                "phase {p:?}; VMI {}",
                vmi(&stack)
                    .map(|v| v["status"]["migrationState"].clone())
                    .unwrap_or_default()
            )),
        }
    })
    .unwrap();
    let phases: Vec<&str> = m["status"]["phaseTransitionTimestamps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["phase"].as_str())
        .collect();
    for want in [
        "Pending",
        "Scheduling",
        "Scheduled",
        "PreparingTarget",
        "TargetReady",
        "Running",
        "Succeeded",
    ] {
        assert!(phases.contains(&want), "{want} missing from {phases:?}");
    }
    let v = vmi(&stack).unwrap();
    let target = v["status"]["nodeName"].as_str().unwrap().to_owned();
    assert_ne!(target, source, "the VMI moved");
    assert_eq!(
        v["metadata"]["labels"]["kubevirt.io/nodeName"],
        target.as_str()
    );
    assert!(
        v["metadata"]["labels"]["kubevirt.io/migrationTargetNodeName"].is_null(),
        "{}",
        v["metadata"]
    );
    assert_eq!(v["status"]["phase"], "Running");
    let ms = &v["status"]["migrationState"];
    assert_eq!(ms["completed"], true, "{ms}");
    assert!(ms["failed"].is_null() || ms["failed"] == false, "{ms}");
    assert_eq!(ms["sourceNode"], source.as_str());
    assert_eq!(ms["targetNode"], target.as_str());
    for t in [
        "startTimestamp",
        "endTimestamp",
        "targetNodeDomainReadyTimestamp",
    ] {
        assert!(ms[t].is_string(), "{t} missing: {ms}");
    }
    assert_eq!(
        m["status"]["migrationState"]["completed"], true,
        "the VMIM carries the state"
    );

    went_on_after_the_move(&stack, &v, before);
    only_launcher_pod_on(&stack, &uid, &target);
    // The target's claim is the VMI's now; the source's goes once its pod is gone.
    let target_claim = wait_for("volumeStatus naming the target's claim", MIGRATE, || {
        let c = backend_claim(&vmi(&stack)?);
        (c != source_claim && !c.is_empty())
            .then_some(Some(c.clone()))
            .ok_or_else(|| format!("claim {c:?}"))
    })
    .unwrap();
    let claim = stack
        .get_json("default", "pvc", &target_claim)
        .unwrap()
        .expect("the target's claim");
    assert_eq!(
        claim["metadata"]["labels"]["persistent-state-for"],
        "vmi-migratable"
    );
    assert!(claim["metadata"]["labels"]["kubevirt.io/migrationName"].is_null());
    assert_eq!(
        m["status"]["migrationState"]["targetPersistentStatePVCName"],
        target_claim.as_str()
    );
    wait_for("the source's claim deleted", MIGRATE, || {
        match stack
            .get_json("default", "pvc", &source_claim)
            .map_err(|e| e.to_string())?
        {
            None => Ok(Some(())),
            Some(c) => Err(format!("{}", c["metadata"])),
        }
    })
    .unwrap();

    // A migration slow enough to be caught running, deleted: aborted, the VM stays.
    throttle_migrations(&stack);
    stack.apply(&migration("migration-slow"));
    wait_for("migration-slow Running", MIGRATE, || {
        match vmim_phase(&stack, "migration-slow")?.as_deref() {
            Some("Running") => Ok(Some(())),
            Some(p @ ("Failed" | "Succeeded")) => {
                panic!("migration-slow ended {p} before it was deleted")
            }
            p => Err(format!("phase {p:?}")),
        }
    })
    .unwrap();
    stack
        .kubectl(&[
            "-n",
            "default",
            "delete",
            "vmim",
            "migration-slow",
            "--wait=false",
        ])
        .unwrap();
    wait_for(
        "migration-slow aborted and gone",
        MIGRATE,
        || match vmim_phase(&stack, "migration-slow")? {
            None => Ok(Some(())),
            Some(p) => Err(format!("phase {p}")),
        },
    )
    .unwrap();
    // The VMIM can go first: its target pod going down fails it, while the source's
    // virt-handler reports the abort on the VMI a moment later.
    let v = wait_for("the abort on the VMI", MIGRATE, || {
        let v = vmi(&stack)?;
        let ms = &v["status"]["migrationState"];
        (ms["abortStatus"] == "Succeeded" && ms["failed"] == true)
            .then_some(Some(v.clone()))
            .ok_or_else(|| format!("migrationState {ms}"))
    })
    .unwrap();
    assert_eq!(v["status"]["nodeName"], target.as_str(), "the VM stayed");
    assert_eq!(v["status"]["phase"], "Running");
    let ms = &v["status"]["migrationState"];
    assert_eq!(ms["failed"], true, "{ms}");
    assert_eq!(ms["abortStatus"], "Succeeded", "{ms}");
    assert_eq!(
        ms["failureReason"], "Live migration has been aborted",
        "{ms}"
    );
    still_counting(&stack, &v);
    only_launcher_pod_on(&stack, &uid, &target);
    // The claim made for the aborted migration's target went with it; the VMI keeps its own.
    wait_for("the aborted target's claim deleted", MIGRATE, || {
        let left = stack
            .kubectl(&[
                "-n",
                "default",
                "get",
                "pvc",
                "-l",
                "kubevirt.io/migrationName=migration-slow",
                "-o",
                "name",
            ])
            .map_err(|e| e.to_string())?;
        left.trim().is_empty().then_some(Some(())).ok_or(left)
    })
    .unwrap();
    assert_eq!(backend_claim(&v), target_claim);
}

/// A migration-job with this name, optionally with extra spec and annotations.
fn migration_with(name: &str, spec: &Value, annotations: Value) -> Value {
    let mut m = migration(name);
    m["metadata"]["annotations"] = annotations;
    if let (Some(into), Some(extra)) = (m["spec"].as_object_mut(), spec.as_object()) {
        into.extend(extra.clone());
    }
    m
}

fn wait_vmim(stack: &Stack, name: &str, phase: &str) -> Value {
    wait_for(&format!("{name} {phase}"), MIGRATE, || {
        let m = stack
            .get_json("default", "vmim", name)
            .map_err(|e| e.to_string())?
            .ok_or("no VMIM")?;
        let p = m["status"]["phase"].as_str().unwrap_or_default();
        if p == phase {
            return Ok(Some(m));
        }
        if matches!(p, "Failed" | "Succeeded") {
            panic!("{name} ended {p}, not {phase}: {}", m["status"]);
        }
        Err(format!("phase {p:?}"))
    })
    .unwrap()
}

/// The messages of the `FailedMigration` events of a VMIM: why it failed.
fn failed_migration_events(stack: &Stack, name: &str) -> String {
    stack
        .kubectl(&[
            "-n",
            "default",
            "get",
            "events",
            "--field-selector",
            &format!("involvedObject.name={name},reason=FailedMigration"),
            "-o",
            "jsonpath={.items[*].message}",
        ])
        .unwrap_or_default()
}

fn pod_uid(stack: &Stack, namespace: &str, name: &str) -> String {
    stack
        .kubectl(&[
            "-n",
            namespace,
            "get",
            "pod",
            name,
            "-o",
            "jsonpath={.metadata.uid}",
        ])
        .unwrap()
}

/// Waits until the VMI's `migrationState` shows the failure, with its reason. The VMIM
/// may fail first: its target pod going down fails it (KubeVirt's guard), while the source's
/// virt-handler, restarted or not, reports what its launcher saw.
fn failed_on_the_vmi(stack: &Stack) {
    wait_for("the failure on the VMI", MIGRATE, || {
        let ms = vmi(stack)?["status"]["migrationState"].clone();
        (ms["failed"] == true && ms["failureReason"].as_str().is_some_and(|r| !r.is_empty()))
            .then_some(Some(()))
            .ok_or_else(|| ms.to_string())
    })
    .unwrap();
}

/// After a failed migration: the VMI Running on `node`, its guest still counting, its only
/// launcher pod there.
fn survived(stack: &Stack, node: &str) {
    let v = vmi(stack).unwrap();
    assert_eq!(v["status"]["nodeName"], node, "the VM stayed");
    assert_eq!(v["status"]["phase"], "Running");
    still_counting(stack, &v);
    only_launcher_pod_on(stack, v["metadata"]["uid"].as_str().unwrap(), node);
}

/// What can go wrong, each time with the VM left running where it was and the VMIM saying why:
/// a target pod that cannot be scheduled (KubeVirt's timeout, shortened by its annotation), the
/// target's launcher killed while the memory is on its way, the source's virt-handler killed
/// (its proxy goes with it) while the memory is on its way.
#[test]
fn migration_failures_leave_the_vm_running_on_the_source() {
    let stack = Stack::up_nodes(2).expect("the stack on two nodes");
    let (v, _) = boot(&stack, &vmi_migratable(), 3);
    let source = v["status"]["nodeName"].as_str().unwrap().to_owned();
    throttle_migrations(&stack);

    stack.apply(&migration_with(
        "mig-unschedulable",
        &json!({"addedNodeSelector": {"kubernetes.io/hostname": "no-such-node"}}),
        json!({"kubevirt.io/migrationUnschedulablePodTimeoutSeconds": "10"}),
    ));
    let m = wait_vmim(&stack, "mig-unschedulable", "Failed");
    assert!(
        m["status"]["migrationState"].is_null()
            || m["status"]["migrationState"]["targetNodeAddress"].is_null(),
        "never handed off: {}",
        m["status"]
    );
    let events = stack
        .kubectl(&[
            "-n",
            "default",
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=mig-unschedulable",
            "-o",
            "jsonpath={.items[*].reason}",
        ])
        .unwrap();
    assert!(
        events.contains("migrationTargetPodUnschedulable"),
        "{events}"
    );
    survived(&stack, &source);

    stack.apply(&migration("mig-target-killed"));
    wait_vmim(&stack, "mig-target-killed", "Running");
    let v = vmi(&stack).unwrap();
    let target_pod = v["status"]["migrationState"]["targetPod"]
        .as_str()
        .unwrap()
        .to_owned();
    let killed = kill_in_pod(&pod_uid(&stack, "default", &target_pod), "virt-launcher");
    assert!(killed > 0, "no launcher in the target pod {target_pod}");
    let m = wait_vmim(&stack, "mig-target-killed", "Failed");
    failed_on_the_vmi(&stack);
    assert_eq!(m["status"]["phase"], "Failed");
    let why = failed_migration_events(&stack, "mig-target-killed");
    assert!(!why.is_empty(), "no FailedMigration event");
    survived(&stack, &source);

    stack.apply(&migration("mig-source-handler"));
    wait_vmim(&stack, "mig-source-handler", "Running");
    let handler_pod = stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "get",
            "pods",
            "-l",
            "kubevirt.io=virt-handler",
            "--field-selector",
            &format!("spec.nodeName={source}"),
            "-o",
            "jsonpath={.items[0].metadata.uid}",
        ])
        .unwrap();
    assert!(
        kill_in_pod(&handler_pod, "virt-handler") > 0,
        "no virt-handler in {handler_pod}"
    );
    wait_vmim(&stack, "mig-source-handler", "Failed");
    assert!(
        !failed_migration_events(&stack, "mig-source-handler").is_empty(),
        "no FailedMigration event"
    );
    failed_on_the_vmi(&stack);
    survived(&stack, &source);
}

fn migration_policy(name: &str, spec: &Value) -> Value {
    json!({
        "apiVersion": "migrations.kubevirt.io/v1alpha1",
        "kind": "MigrationPolicy",
        "metadata": {"name": name},
        "spec": spec,
    })
}

/// `kubectl drain` of the node a `LiveMigrate` VMI runs on, as an operator drains a node for
/// maintenance: every pod on it is evicted (virt-api's and virt-controller's replicas too); the
/// launcher pod's eviction is refused and becomes an evacuation migration, which a
/// MigrationPolicy matching the VMI's label governs; once the VMI has moved the drain
/// completes. The guest keeps counting throughout and answers through a Service before and
/// after (new connections: with masquerade the pod IP changes, so an open one cannot survive,
/// in KubeVirt either).
#[test]
fn kubectl_drain_migrates_a_live_migrate_vmi_and_completes() {
    let stack = Stack::up_nodes(2).expect("the stack on two nodes");
    let refused = stack
        .kubectl_with_input(
            &["apply", "-f", "-"],
            &migration_policy("refused", &json!({"selectors": {}, "maxDowntimeMs": 300}))
                .to_string(),
        )
        .expect_err("maxDowntimeMs is refused");
    assert!(
        refused.to_string().contains("spec.maxDowntimeMs"),
        "{refused}"
    );
    stack.apply(&migration_policy(
        "vmi-migratable-policy",
        &json!({
            "selectors": {"virtualMachineInstanceSelector": {"special": "vmi-migratable"}},
            "allowAutoConverge": true,
            "bandwidthPerMigration": "256Mi",
        }),
    ));
    let mut manifest = vmi_migratable();
    manifest["spec"]["evictionStrategy"] = json!("LiveMigrate");
    let (v, before) = boot(&stack, &manifest, 3);
    let source = v["status"]["nodeName"].as_str().unwrap().to_owned();
    // KubeVirt's conformance check: the guest is reached through a Service before and after.
    stack.apply(&json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "vmi-migratable", "namespace": "default"},
        "spec": {"selector": {"special": "vmi-migratable"}, "ports": [{"port": 8080}]},
    }));
    let cluster_ip = stack
        .kubectl(&[
            "-n",
            "default",
            "get",
            "service",
            "vmi-migratable",
            "-o",
            "jsonpath={.spec.clusterIP}",
        ])
        .unwrap();
    let service: std::net::SocketAddr = format!("{cluster_ip}:8080").parse().unwrap();
    assert_eq!(
        e2e::greeting(service, BOOT).unwrap(),
        "vmi-migratable",
        "through the Service before the drain"
    );

    stack
        .kubectl(&[
            "drain",
            &source,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=420s",
        ])
        .map_err(|e| stack.with_component_logs(e))
        .expect("kubectl drain completes");

    let v = vmi(&stack).unwrap();
    let target = v["status"]["nodeName"].as_str().unwrap().to_owned();
    assert_ne!(target, source, "the VMI moved off the drained node");
    assert_eq!(v["status"]["phase"], "Running");
    let ms = &v["status"]["migrationState"];
    assert_eq!(ms["completed"], true, "{ms}");
    assert_eq!(ms["sourceNode"], source.as_str(), "{ms}");
    assert_eq!(ms["migrationPolicyName"], "vmi-migratable-policy", "{ms}");
    assert!(
        v["status"]["evacuationNodeName"].is_null(),
        "the evacuation is over: {}",
        v["status"]
    );
    assert_eq!(
        ms["migrationConfiguration"]["allowAutoConverge"], true,
        "{ms}"
    );
    let evacuations = stack
        .kubectl(&[
            "-n",
            "default",
            "get",
            "vmim",
            "-o",
            "jsonpath={range .items[*]}{.metadata.annotations.kubevirt\\.io/evacuationMigration} {.status.phase}{\"\\n\"}{end}",
        ])
        .unwrap();
    assert_eq!(
        evacuations.trim(),
        format!("{source} Succeeded"),
        "one evacuation migration, succeeded"
    );
    let uid = v["metadata"]["uid"].as_str().unwrap();
    let pods = launcher_pods(&stack, uid);
    assert!(
        pods.len() == 1 && pods[0].1 == target,
        "only the target's launcher pod: {pods:?}"
    );
    went_on_after_the_move(&stack, &v, before);
    assert_eq!(
        e2e::greeting(service, MIGRATE).unwrap(),
        "vmi-migratable",
        "through the Service after the drain"
    );
    stack.kubectl(&["uncordon", &source]).unwrap();
}
