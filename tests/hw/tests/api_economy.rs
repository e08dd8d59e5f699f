//! Benchmark: API writes per VMI on the whole stack, by component, verb and resource, read from
//! kube-apiserver's audit log (localcluster logs every write), next to KubeVirt's published
//! figures (its density CI: about 2.2 pod PATCHes and 5-6.5 VMI UPDATEs per VMI created;
//! thresholds PATCH <= 2x and UPDATE <= 10x the pod creates). Two windows: creation until every
//! guest runs with its agent connected, and deletion until everything is gone. Prints the
//! figures; asserts only what must hold whatever the figures (one launcher pod per VMI).
//!
//! `cargo nextest run -p e2e --test api_economy --run-ignored only --no-capture`

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::audit::{WriteKey, count_writes};
use e2e::{Stack, wait_for};

const VMIS: usize = 4;
/// Guests boot under TCG on two cores: two at a time.
const AT_ONCE: usize = 2;
const BOOT: Duration = Duration::from_mins(7);

fn read_from(path: &std::path::Path, offset: usize) -> (String, usize) {
    let all = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(all.get(offset..).unwrap_or_default()).into_owned();
    (text, all.len())
}

/// The demo VM's template as a VMI named `name`.
fn vmi(stack: &Stack, name: &str) -> serde_json::Value {
    let vm = stack.demo_vm().expect("the demo VM as JSON");
    serde_json::json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default", "labels": {"economy": "bench"}},
        "spec": vm["spec"]["template"]["spec"],
    })
}

fn print_window(title: &str, counts: &BTreeMap<WriteKey, usize>) {
    println!("\n{title}: writes per VMI ({VMIS} VMIs)");
    println!(
        "{:<26} {:<8} {:<40} {:>8}",
        "component", "verb", "resource", "per VMI"
    );
    for ((who, verb, resource), n) in counts {
        #[allow(clippy::cast_precision_loss)]
        let per = *n as f64 / VMIS as f64;
        println!("{who:<26} {verb:<8} {resource:<40} {per:>8.2}");
    }
}

/// Writes per VMI of `verbs` on `resource`, its subresources included (as KubeVirt's figures
/// count `apiserver_request_total` by resource) unless `exact`.
fn total(counts: &BTreeMap<WriteKey, usize>, verbs: &[&str], resource: &str, exact: bool) -> f64 {
    let n: usize = counts
        .iter()
        .filter(|((_, v, r), _)| {
            verbs.contains(&v.as_str())
                && (r == resource || (!exact && r.split('/').next() == Some(resource)))
        })
        .map(|(_, n)| n)
        .sum();
    #[allow(clippy::cast_precision_loss)]
    let per = n as f64 / VMIS as f64;
    per
}

#[test]
#[ignore = "benchmark: prints figures; boots four guests"]
fn bench_api_writes_per_vmi() {
    let stack = Stack::up().expect("the stack comes up");
    let log = localcluster::controlplane::audit_log(stack.dir());
    let (_, mut offset) = read_from(&log, 0);

    let names: Vec<String> = (0..VMIS).map(|i| format!("economy-{i}")).collect();
    for batch in names.chunks(AT_ONCE) {
        for name in batch {
            stack
                .kubectl_with_input(&["create", "-f", "-"], &vmi(&stack, name).to_string())
                .unwrap_or_else(|e| panic!("creating {name}: {e}"));
        }
        for name in batch {
            wait_for(&format!("{name} to run with its agent"), BOOT, || {
                stack.running_with_agent(name).map(|vmi| vmi.map(drop))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let (text, end) = read_from(&log, offset);
    offset = end;
    let created = count_writes(&text);

    stack
        .kubectl(&["delete", "vmi", "-l", "economy=bench", "--timeout=300s"])
        .expect("deleting the VMIs");
    wait_for("the launcher pods to go", Duration::from_mins(3), || {
        let pods = stack.launcher_pods().map_err(|e| e.to_string())?;
        pods.trim().is_empty().then_some(Some(())).ok_or(pods)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let (text, _) = read_from(&log, offset);
    let deleted = count_writes(&text);

    print_window("create -> Running with the guest agent connected", &created);
    print_window("delete -> the launcher pods gone", &deleted);
    println!(
        "\nper VMI created (create window), every component: pod PATCH {:.2} (KubeVirt ~2.2), VMI UPDATE+PATCH {:.2} (KubeVirt UPDATE 5-6.5), pod creates {:.2}",
        total(&created, &["patch"], "pods", false),
        total(
            &created,
            &["update", "patch"],
            "virtualmachineinstances",
            false
        ),
        total(&created, &["create"], "pods", true),
    );
    assert_eq!(
        created.get(&(
            "virt-controller".to_owned(),
            "create".to_owned(),
            "pods".to_owned()
        )),
        Some(&VMIS),
        "one launcher pod per VMI"
    );
}
