//! Live migration through the whole stack on two localcluster nodes, KubeVirt's own shapes:
//! `vmi-migratable` (masquerade, a containerDisk; here the test guest's, plus a cloud-init
//! script that counts on the serial console) and `migration-job` (a VMIM naming it). The guest
//! keeps counting through the move (the target's console goes on from where the source's
//! stopped: no reboot), the VMI ends on the other node with `migrationState.completed`, and the
//! source pod is gone. Then, with `bandwidthPerMigration: 1Mi` so that a migration runs for
//! minutes, a VMIM deleted while it runs is aborted: the VMI stays where it is, Running.

use std::time::Duration;

use e2e::{Stack, wait_for};
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
                {"cloudInitNoCloud": {"userData": "#!/bin/sh\n(i=0; while :; do i=$((i+1)); echo \"TICK-$i\" > /dev/ttyS0; sleep 1; done) &\n"}, "name": "cloudinitdisk"},
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

#[test]
fn migration_moves_a_running_vmi_to_the_other_node_and_a_deleted_one_aborts() {
    let stack = Stack::up_nodes(2).expect("the stack on two nodes");
    stack.apply(&vmi_migratable());
    let v = wait_for("the VMI Running and live-migratable", BOOT, || {
        let v = vmi(&stack)?;
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
    assert_eq!(
        v["status"]["migrationMethod"], "BlockMigration",
        "{}",
        v["status"]
    );
    let source = v["status"]["nodeName"].as_str().unwrap().to_owned();
    let uid = v["metadata"]["uid"].as_str().unwrap().to_owned();
    let before = wait_for("the guest counting on its console", BOOT, || {
        let t = ticks(&stack, &v);
        t.last()
            .copied()
            .filter(|n| *n >= 5)
            .map(Some)
            .ok_or_else(|| format!("{t:?}"))
    })
    .unwrap();

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

    let after = wait_for(
        "the guest counting on the target's console",
        Duration::from_mins(2),
        || {
            let t = ticks(&stack, &v);
            t.last()
                .copied()
                .filter(|n| *n > before)
                .map(Some)
                .ok_or_else(|| format!("{t:?}"))
        },
    )
    .unwrap();
    let first = ticks(&stack, &v)[0];
    assert!(
        first > before / 2 && first <= after,
        "the count went on ({before} on the source, then {first}..{after} here): no reboot"
    );

    wait_for(
        "only the target's launcher pod left",
        Duration::from_mins(2),
        || {
            let pods = launcher_pods(&stack, &uid);
            (pods.len() == 1 && pods[0].1 == target)
                .then_some(Some(()))
                .ok_or_else(|| format!("{pods:?}"))
        },
    )
    .unwrap();

    // A migration slow enough to be caught running, deleted: aborted, the VM stays.
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
    let v = vmi(&stack).unwrap();
    assert_eq!(v["status"]["nodeName"], target.as_str(), "the VM stayed");
    assert_eq!(v["status"]["phase"], "Running");
    let ms = &v["status"]["migrationState"];
    assert_eq!(ms["failed"], true, "{ms}");
    assert_eq!(ms["abortStatus"], "Succeeded", "{ms}");
    assert_eq!(
        ms["failureReason"], "Live migration has been aborted",
        "{ms}"
    );
    let now = ticks(&stack, &v);
    wait_for("the guest still counting", Duration::from_mins(2), || {
        let t = ticks(&stack, &v);
        (t.last() > now.last())
            .then_some(Some(()))
            .ok_or_else(|| format!("{t:?}"))
    })
    .unwrap();
    wait_for(
        "the aborted target's pod gone",
        Duration::from_mins(2),
        || {
            let pods = launcher_pods(&stack, &uid);
            (pods.len() == 1 && pods[0].1 == target)
                .then_some(Some(()))
                .ok_or_else(|| format!("{pods:?}"))
        },
    )
    .unwrap();
}
