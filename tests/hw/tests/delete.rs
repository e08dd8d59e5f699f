//! `kubectl delete vm` through the whole stack, in every state a VM can be in: nothing of it is
//! left behind (no VM, no VMI, no launcher pod); deleted with `--cascade=orphan` its instance
//! stays, without an owner and without the VM controller's finalizer; and a virt-controller that
//! is down between the VM's deletion and the end of its instance finishes the job once it is
//! back. One guest runs at a time: they boot under TCG on two cores.

use std::time::{Duration, Instant};

use api::labels::{FUNC_TEST_LAUNCHER_FAIL_FAST, VM_CONTROLLER_FINALIZER};
use e2e::{Stack, test_guest_firmware, wait_for};
use serde_json::{Value, json};

const BOOT: Duration = Duration::from_mins(7);
/// The VMIs' termination grace period; the deletions are timed against it.
const GRACE_SECONDS: u64 = 5;
/// A deletion's bound when nothing has to wait for the guest: the garbage collector of
/// kube-controller-manager and the controllers' queues on a busy two-core machine.
const SETTLE: Duration = Duration::from_mins(2);

fn vm_manifest(name: &str, strategy: &str, fail_fast: bool) -> Value {
    let annotations = if fail_fast {
        // Makes the launcher exit at once: the VM crash-loops.
        json!({FUNC_TEST_LAUNCHER_FAIL_FAST: ""})
    } else {
        json!({})
    };
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "runStrategy": strategy,
            "template": {"metadata": {"annotations": annotations}, "spec": {
                "terminationGracePeriodSeconds": GRACE_SECONDS,
                "domain": {
                    "cpu": {"cores": 1},
                    "memory": {"guest": "128Mi"},
                    "firmware": test_guest_firmware(),
                    "devices": {"interfaces": [{"name": "default", "masquerade": {}}]},
                },
                "networks": [{"name": "default", "pod": {}}],
            }},
        },
    })
}

fn get(stack: &Stack, resource: &str, name: &str) -> Result<Option<Value>, String> {
    stack
        .get_json("default", resource, name)
        .map_err(|e| e.to_string())
}

fn pods_of(stack: &Stack, name: &str) -> Result<String, String> {
    stack
        .kubectl(&[
            "get",
            "pods",
            "-l",
            &format!("vm.kubevirt.io/name={name}"),
            "-o",
            "name",
        ])
        .map(|s| s.trim().to_owned())
        .map_err(|e| e.to_string())
}

fn finalizers(object: &Value) -> Vec<&str> {
    object["metadata"]["finalizers"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// Waits for the VMI `name` to reach `phase`.
fn vmi_phase(stack: &Stack, name: &str, phase: &str) -> Value {
    wait_for(&format!("VMI {name} to be {phase}"), BOOT, || {
        let vmi = get(stack, "vmi", name)?.ok_or("no VMI yet")?;
        let now = vmi["status"]["phase"].as_str().unwrap_or_default();
        if now == phase {
            Ok(Some(vmi))
        } else {
            Err(format!("phase {now:?}"))
        }
    })
    .unwrap_or_else(|e| panic!("{e}; localcluster log in {}", stack.dir().display()))
}

/// Waits for the VM to carry the VM controller's finalizer, then `kubectl delete vm`, which
/// itself waits for the VM to be gone; then nothing of it may be left. Returns how long the
/// whole deletion took.
fn delete_and_check(stack: &Stack, name: &str) -> Duration {
    wait_for(&format!("VM {name} to carry the finalizer"), SETTLE, || {
        let vm = get(stack, "vm", name)?.ok_or("no VM")?;
        Ok(finalizers(&vm)
            .contains(&VM_CONTROLLER_FINALIZER)
            .then_some(()))
    })
    .expect("the VM controller adds its finalizer");
    let start = Instant::now();
    stack
        .kubectl(&["delete", "vm", name, "--timeout=180s"])
        .unwrap_or_else(|e| panic!("kubectl delete vm {name}: {e}"));
    all_gone(stack, name);
    start.elapsed()
}

fn all_gone(stack: &Stack, name: &str) {
    wait_for(&format!("VM {name}'s VMI and pods to go"), SETTLE, || {
        let vm = get(stack, "vm", name)?;
        let vmi = get(stack, "vmi", name)?;
        let pods = pods_of(stack, name)?;
        if vm.is_none() && vmi.is_none() && pods.is_empty() {
            Ok(Some(()))
        } else {
            Err(format!(
                "VM {}, VMI {:?}, pods {pods:?}",
                vm.is_some(),
                vmi.map(|v| (v["status"]["phase"].clone(), finalizers(&v).join(",")))
            ))
        }
    })
    .unwrap_or_else(|e| panic!("{e}; localcluster log in {}", stack.dir().display()));
}

/// Pauses the VMI with `virtctl pause vmi` (virt-api, then virt-handler's REST API).
fn pause(stack: &Stack, name: &str) {
    stack
        .virtctl(&["pause", "vmi", name])
        .unwrap_or_else(|e| panic!("pause: {e}"));
    wait_for(&format!("VMI {name} to be Paused"), SETTLE, || {
        let vmi = get(stack, "vmi", name)?.ok_or("no VMI")?;
        let paused = vmi["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Paused" && c["status"] == "True");
        Ok(paused.then_some(()))
    })
    .expect("virt-handler reports the pause");
}

fn printable(stack: &Stack, name: &str, status: &str) {
    wait_for(&format!("VM {name} to show {status}"), BOOT, || {
        let vm = get(stack, "vm", name)?.ok_or("no VM")?;
        let now = vm["status"]["printableStatus"].as_str().unwrap_or_default();
        if now == status {
            Ok(Some(()))
        } else {
            Err(format!("printableStatus {now:?}"))
        }
    })
    .unwrap_or_else(|e| panic!("{e}; localcluster log in {}", stack.dir().display()));
}

#[test]
fn kubectl_delete_vm_in_every_state_leaves_nothing_behind() {
    let stack = Stack::up().expect("the stack comes up");
    let mut took = Vec::new();

    // No guest runs in these.
    stack.apply(&vm_manifest("stopped", "Halted", false));
    printable(&stack, "stopped", "Stopped");
    took.push(("Stopped", delete_and_check(&stack, "stopped")));

    stack.apply(&vm_manifest("crashloop", "Always", true));
    printable(&stack, "crashloop", "CrashLoopBackOff");
    took.push(("CrashLoopBackOff", delete_and_check(&stack, "crashloop")));

    stack.apply(&vm_manifest("final", "Once", true));
    vmi_phase(&stack, "final", "Failed");
    took.push(("final VMI", delete_and_check(&stack, "final")));

    stack.apply(&vm_manifest("starting", "Always", false));
    wait_for("the starting VM's VMI", SETTLE, || {
        Ok(get(&stack, "vmi", "starting")?.map(drop))
    })
    .expect("a VMI for the starting VM");
    took.push(("Starting", delete_and_check(&stack, "starting")));

    // One guest at a time from here.
    stack.apply(&vm_manifest("running", "Always", false));
    vmi_phase(&stack, "running", "Running");
    took.push(("Running", delete_and_check(&stack, "running")));

    stack.apply(&vm_manifest("paused", "Always", false));
    vmi_phase(&stack, "paused", "Running");
    pause(&stack, "paused");
    took.push(("Paused", delete_and_check(&stack, "paused")));

    stack.apply(&vm_manifest("orphan", "Always", false));
    let vmi = vmi_phase(&stack, "orphan", "Running");
    stack
        .kubectl(&[
            "delete",
            "vm",
            "orphan",
            "--cascade=orphan",
            "--timeout=180s",
        ])
        .expect("kubectl delete vm --cascade=orphan");
    let kept = wait_for(
        "the orphaned VMI without owner or VM finalizer",
        SETTLE,
        || {
            let v = get(&stack, "vmi", "orphan")?.ok_or("the VMI is gone")?;
            let owned = v["metadata"]["ownerReferences"]
                .as_array()
                .is_some_and(|a| !a.is_empty());
            if owned || finalizers(&v).contains(&VM_CONTROLLER_FINALIZER) {
                Err(format!("metadata {}", v["metadata"]))
            } else {
                Ok(Some(v))
            }
        },
    )
    .expect("the orphaned VMI keeps running");
    assert_eq!(kept["metadata"]["uid"], vmi["metadata"]["uid"]);
    assert_eq!(kept["status"]["phase"], "Running");
    assert_eq!(get(&stack, "vm", "orphan").expect("get vm"), None);
    assert_eq!(pods_of(&stack, "orphan").expect("pods").lines().count(), 1);
    stack
        .kubectl(&["delete", "vmi", "orphan", "--timeout=180s"])
        .expect("kubectl delete vmi");
    all_gone(&stack, "orphan");

    // virt-controller is down from just before the VM's deletion until after it.
    stack.apply(&vm_manifest("restart", "Always", false));
    vmi_phase(&stack, "restart", "Running");
    // virt-operator puts an edited Deployment back, so it goes first (as KubeVirt's own tests
    // stop virt-controller); scaled up again, it brings virt-controller back.
    let scale_to_zero = |deployment: &str| {
        stack
            .kubectl(&[
                "-n",
                "kubevirt",
                "scale",
                &format!("deployment/{deployment}"),
                "--replicas",
                "0",
            ])
            .unwrap_or_else(|e| panic!("kubectl scale {deployment}: {e}"));
        wait_for(&format!("{deployment}'s pods to go"), SETTLE, || {
            let pods = stack
                .kubectl(&[
                    "-n",
                    "kubevirt",
                    "get",
                    "pods",
                    "-l",
                    &format!("kubevirt.io={deployment}"),
                    "-o",
                    "name",
                ])
                .map_err(|e| e.to_string())?;
            pods.trim()
                .is_empty()
                .then_some(Some(()))
                .ok_or(format!("pods {pods:?}"))
        })
        .unwrap_or_else(|e| panic!("{deployment} scaled to 0: {e}"));
    };
    scale_to_zero("virt-operator");
    scale_to_zero("virt-controller");
    stack
        .kubectl(&["delete", "vm", "restart", "--wait=false"])
        .expect("kubectl delete vm --wait=false");
    let vm = get(&stack, "vm", "restart")
        .expect("get vm")
        .expect("the VM waits for its finalizer");
    assert!(vm["metadata"]["deletionTimestamp"].is_string());
    stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "scale",
            "deployment/virt-operator",
            "--replicas",
            "2",
        ])
        .expect("kubectl scale virt-operator");
    all_gone(&stack, "restart");

    for (state, elapsed) in took {
        println!(
            "kubectl delete vm of a {state} VM: {:.1} s (grace period {GRACE_SECONDS} s)",
            elapsed.as_secs_f64()
        );
    }
}
