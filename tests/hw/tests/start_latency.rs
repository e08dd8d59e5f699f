//! Benchmark: VM created -> guest ready (its agent connected) on the whole stack, split by who
//! spends the time, next to KubeVirt's density figures (create -> Running p50 15-18 s, p95
//! 25-28 s on its CI). VMs start two at a time and each pair is deleted once ready: guests boot
//! under TCG on two cores. Prints p50/p95 per phase; asserts only what must hold whatever the
//! figures (every guest booted, every timestamp was found).
//!
//! `START_LATENCY_VMS=4 flock /tmp/stack.lock cargo nextest run -p e2e --test start_latency
//! --run-ignored only --no-capture` (20 VMs without the variable)
//!
//! Each boundary comes from where it is recorded with sub-second precision, all on this
//! machine's clock:
//! - VM created, VMI created, launcher pod created, pod bound: kube-apiserver's audit log (the
//!   `create` of the VM, of the VMI and of the pod by virt-controller, of the pod's `binding`
//!   by kube-scheduler; localcluster logs pod creates with their request, which names the
//!   launcher pod by its `generateName`);
//! - kernel and disk images mounted into the launcher pod: virt-handler's log line;
//! - launcher ready, QEMU started, QEMU running, serial console up, agent connected:
//!   virt-launcher's log lines (compute container);
//! - the guest kernel's start and its `Run /init`: the kernel's own timestamps in the serial log,
//!   placed on the host clock by the console's first output (which is the kernel's backlog,
//!   flushed when `printk: console [ttyS0] enabled`).
//!
//! KubeVirt's own metric (`kubevirt_vmi_phase_transition_time_from_creation_seconds`, phase
//! Running: VMI creationTimestamp -> Running in `phaseTransitionTimestamps`, whole seconds) is
//! printed next to it; KubeVirt's Running is QEMU running, before the guest boots.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::{Stack, wait_for};
use jiff::Timestamp;

/// Guests boot under TCG on two cores: two at a time.
const AT_ONCE: usize = 2;
const BOOT: Duration = Duration::from_mins(7);
const LABEL: &str = "latency=bench";

/// The demo VM's manifest named `name`, labelled for deletion by [`LABEL`].
fn vm(stack: &Stack, name: &str) -> serde_json::Value {
    let mut vm = stack.demo_vm().expect("the demo VM as JSON");
    vm["metadata"] = serde_json::json!({
        "name": name, "namespace": "default", "labels": {"latency": "bench"},
    });
    vm
}

fn time(text: &str) -> Timestamp {
    text.parse()
        .unwrap_or_else(|e| panic!("timestamp {text:?}: {e}"))
}

fn seconds(from: Timestamp, to: Timestamp) -> f64 {
    to.duration_since(from).as_secs_f64()
}

/// What one VM's start left behind while its launcher pod still existed.
struct Started {
    vmi: serde_json::Value,
    pod: String,
    launcher_log: String,
    serial_log: String,
}

/// `text` without ANSI colour sequences (virt-launcher's log is coloured).
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The time of the first log line (virt-launcher's or virt-handler's) that `matches`; `what`
/// names it for the failure message.
fn logged_when(log: &str, what: &str, matches: impl Fn(&str) -> bool) -> Timestamp {
    let line = log
        .lines()
        .find(|l| matches(l))
        .unwrap_or_else(|| panic!("no log line with {what} in:\n{log}"));
    time(line.split_whitespace().next().unwrap_or_default())
}

/// The time of the first log line containing `what`.
fn logged(log: &str, what: &str) -> Timestamp {
    logged_when(log, &format!("{what:?}"), |l| l.contains(what))
}

/// The kernel's timestamp (seconds since it started) on the first serial log line with `what`.
fn kernel_time(serial: &str, what: &str) -> f64 {
    serial
        .lines()
        .find(|l| l.contains(what))
        .and_then(|l| l.strip_prefix('[')?.split(']').next()?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no serial log line with {what:?}"))
}

/// When virt-handler mounted the VM's kernel and disk images into its launcher pod: its log
/// line names the VMI by its key, `default/<name>` (quoted or not, as tracing records it).
fn handler_mounted(handler_log: &str, name: &str) -> Timestamp {
    let keys = [
        format!("key=\"default/{name}\""),
        format!("key=default/{name} "),
    ];
    logged_when(
        handler_log,
        &format!("virt-handler mounting images for {name}"),
        |l| {
            l.contains("image files mounted into the launcher")
                && keys.iter().any(|k| l.contains(k.as_str()))
        },
    )
}

/// Reads what the VM's launcher pod holds (its log, the serial log) before the pod goes.
fn collect(stack: &Stack, vmi: serde_json::Value) -> Started {
    let pod_uid = vmi["status"]["activePods"]
        .as_object()
        .and_then(|pods| pods.keys().next())
        .cloned()
        .expect("the VMI's launcher pod");
    let (dir, _, log) = stack
        .pod_logs("default")
        .into_iter()
        .find(|(dir, container, _)| dir.ends_with(&format!("_{pod_uid}")) && container == "compute")
        .unwrap_or_else(|| panic!("no compute container log for pod {pod_uid}"));
    // The log directory is `<namespace>_<pod>_<uid>`.
    let pod = dir
        .strip_prefix("default_")
        .and_then(|d| d.strip_suffix(&format!("_{pod_uid}")))
        .expect("a pod log directory")
        .to_owned();
    let serial = stack
        .vmi_private_dir(&vmi)
        .expect("the VMI's private dir")
        .join("virt-serial0-log");
    let serial_log =
        std::fs::read_to_string(&serial).unwrap_or_else(|e| panic!("{}: {e}", serial.display()));
    Started {
        vmi,
        pod,
        launcher_log: plain(&log),
        serial_log,
    }
}

/// The audit log's successful writes, keyed by (verb, resource[/subresource], name, or
/// `generateName` when the name was generated): when the first of each completed.
fn audited(log: &str) -> BTreeMap<(String, String, String), Timestamp> {
    let mut out = BTreeMap::new();
    for line in log.lines() {
        let Ok(ev) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if ev["stage"] != "ResponseComplete" || ev["responseStatus"]["code"].as_u64() >= Some(300) {
            continue;
        }
        let object = &ev["objectRef"];
        let mut resource = object["resource"].as_str().unwrap_or_default().to_owned();
        if let Some(sub) = object["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        // Launcher pods are created with `generateName` (their entry carries the request).
        let name = object["name"]
            .as_str()
            .filter(|n| !n.is_empty())
            .or_else(|| ev["requestObject"]["metadata"]["generateName"].as_str())
            .unwrap_or_default();
        let key = (
            ev["verb"].as_str().unwrap_or_default().to_owned(),
            resource,
            name.to_owned(),
        );
        let at = time(ev["stageTimestamp"].as_str().unwrap_or_default());
        out.entry(key).or_insert(at);
    }
    out
}

/// How long virt-launcher's accelerator probe took from the launcher's start, when it found
/// KVM unusable (as on a machine whose /dev/kvm opens but runs no guest): it runs while
/// virt-handler prepares the pod, and the first sync waits for it.
fn kvm_probe(started: &Started) -> Option<f64> {
    let log = &started.launcher_log;
    log.lines()
        .any(|l| l.contains("KVM unusable"))
        .then(|| seconds(logged(log, ": ready "), logged(log, "KVM unusable")))
}

/// The phases of one start, in order, each `(name, seconds)`; and the end-to-end time.
fn phases(
    name: &str,
    started: &Started,
    audit: &BTreeMap<(String, String, String), Timestamp>,
    handler_log: &str,
) -> (Vec<(&'static str, f64)>, f64) {
    let write = |verb: &str, resource: &str, object: &str| {
        *audit
            .get(&(verb.to_owned(), resource.to_owned(), object.to_owned()))
            .unwrap_or_else(|| panic!("no audited {verb} of {resource} {object}"))
    };
    let vm_created = write("create", "virtualmachines", name);
    let vmi_created = write("create", "virtualmachineinstances", name);
    let pod_created = write("create", "pods", &format!("virt-launcher-{name}-"));
    let bound = write("create", "pods/binding", &started.pod);
    let log = &started.launcher_log;
    let ready = logged(log, ": ready ");
    let mounted = handler_mounted(handler_log, name);
    let sync = logged(log, "starting QEMU");
    let running = logged(log, "domain running");
    let console = logged(log, "guest serial console: first output");
    let agent = logged(log, "guest agent channel connected=true");
    let serial = &started.serial_log;
    let since_kernel = |what| {
        jiff::SignedDuration::try_from_secs_f64(kernel_time(serial, what))
            .expect("a kernel timestamp")
    };
    let kernel = console - since_kernel("printk: console [ttyS0] enabled");
    let init = kernel + since_kernel("Run /init as init process");
    let marks = [
        ("controller: VM -> VMI", vm_created, vmi_created),
        ("controller: VMI -> launcher pod", vmi_created, pod_created),
        ("scheduler: pod -> bound", pod_created, bound),
        ("kubelet: bound -> launcher ready", bound, ready),
        ("handler: launcher ready -> images mounted", ready, mounted),
        ("handler sync: images mounted -> QEMU argv", mounted, sync),
        ("launcher: QEMU argv -> QEMU running", sync, running),
        ("firmware (and kernel decompression)", running, kernel),
        ("guest kernel: start -> /init", kernel, init),
        ("guest init -> agent connected", init, agent),
    ];
    (
        marks
            .iter()
            .map(|&(what, from, to)| (what, seconds(from, to)))
            .collect(),
        seconds(vm_created, agent),
    )
}

/// KubeVirt's density metric for one VMI: creationTimestamp -> Running (whole seconds).
fn kubevirt_create_to_running(vmi: &serde_json::Value) -> f64 {
    let created = time(
        vmi["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap_or_default(),
    );
    let running = vmi["status"]["phaseTransitionTimestamps"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["phase"] == "Running")
        .and_then(|t| t["phaseTransitionTimestamp"].as_str())
        .map(time)
        .expect("a Running phase transition");
    seconds(created, running)
}

/// The nearest-rank percentile `p` (0-100) of `values`.
fn percentile(values: &[f64], p: usize) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

#[test]
#[ignore = "benchmark: prints figures; boots START_LATENCY_VMS guests (20)"]
fn bench_start_latency() {
    let vms: usize = std::env::var("START_LATENCY_VMS").map_or(20, |n| {
        n.parse().expect("START_LATENCY_VMS: a number of VMs")
    });
    let stack = Stack::up().expect("the stack comes up");
    let log = localcluster::controlplane::audit_log(stack.dir());
    let offset = std::fs::metadata(&log).map_or(0, |m| m.len());
    let load_before = testguest::load_average();

    let names: Vec<String> = (0..vms).map(|i| format!("latency-{i}")).collect();
    let mut started = Vec::new();
    for batch in names.chunks(AT_ONCE) {
        for name in batch {
            stack
                .kubectl_with_input(&["create", "-f", "-"], &vm(&stack, name).to_string())
                .unwrap_or_else(|e| panic!("creating {name}: {e}"));
        }
        for name in batch {
            let vmi = wait_for(&format!("{name} to run with its agent"), BOOT, || {
                stack.running_with_agent(name)
            })
            .unwrap_or_else(|e| panic!("{}", stack.with_component_logs(e)));
            started.push((name.clone(), collect(&stack, vmi)));
        }
        stack
            .kubectl(&["delete", "vm", "-l", LABEL, "--timeout=300s"])
            .expect("deleting the VMs");
        wait_for("the launcher pods to go", Duration::from_mins(3), || {
            let pods = stack.launcher_pods().map_err(|e| e.to_string())?;
            pods.trim().is_empty().then_some(Some(())).ok_or(pods)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let load_after = testguest::load_average();

    let text = std::fs::read(&log).expect("the audit log");
    let audit = audited(&String::from_utf8_lossy(
        text.get(usize::try_from(offset).unwrap_or(0)..)
            .unwrap_or_default(),
    ));
    let handler_log: String = stack
        .pod_logs("kubevirt")
        .into_iter()
        .filter(|(pod, container, _)| {
            pod.starts_with("kubevirt_virt-handler-") && container == "virt-handler"
        })
        .map(|(_, _, log)| plain(&log))
        .collect();
    let mut by_phase: Vec<(&str, Vec<f64>)> = Vec::new();
    let (mut total, mut kubevirt, mut probes) = (Vec::new(), Vec::new(), Vec::new());
    println!("\nper VM, seconds: the phases in order, then VM created -> agent connected");
    for (name, s) in &started {
        let (split, end_to_end) = phases(name, s, &audit, &handler_log);
        let cells: Vec<String> = split.iter().map(|(_, t)| format!("{t:6.2}")).collect();
        println!("{name:<11} {} | {end_to_end:6.2}", cells.join(" "));
        for (i, (what, t)) in split.into_iter().enumerate() {
            if by_phase.len() == i {
                by_phase.push((what, Vec::new()));
            }
            by_phase[i].1.push(t);
        }
        total.push(end_to_end);
        probes.extend(kvm_probe(s));
        kubevirt.push(kubevirt_create_to_running(&s.vmi));
    }

    println!(
        "\nstart latency over {vms} VMs, {AT_ONCE} at a time (seconds; load average {load_before} at the start, {load_after} at the end)"
    );
    println!("{:<44} {:>7} {:>7}", "phase", "p50", "p95");
    for (what, times) in &by_phase {
        println!(
            "{what:<44} {:>7.2} {:>7.2}",
            percentile(times, 50),
            percentile(times, 95)
        );
    }
    if !probes.is_empty() {
        println!(
            "{:<44} {:>7.2} {:>7.2}   ({} of {vms}; overlaps the handler's phases)",
            "(launcher ready -> KVM probe failed)",
            percentile(&probes, 50),
            percentile(&probes, 95),
            probes.len()
        );
    }
    println!(
        "{:<44} {:>7.2} {:>7.2}",
        "VM created -> guest agent connected",
        percentile(&total, 50),
        percentile(&total, 95)
    );
    println!(
        "{:<44} {:>7.0} {:>7.0}   (KubeVirt's CI: p50 15-18, p95 25-28)",
        "KubeVirt's VMI create -> Running",
        percentile(&kubevirt, 50),
        percentile(&kubevirt, 95)
    );
    assert_eq!(started.len(), vms, "every VM's guest booted");
}
