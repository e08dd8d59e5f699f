//! cgroups on this machine's real kernel: device rules enforced on the v1 devices controller
//! and on cgroup2 with the eBPF program, updates without a denial window, cpuset placement,
//! memory limits, cleanup. Needs root and a host with both hierarchies (hybrid mode).

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use cgroups::{
    Access, BpfDevices, CgroupError, CgroupSetup, CpuList, DeviceEntry, DeviceKind, DeviceRule,
    Devices, Manager, Mode, ProcessCgroups, V1Devices, V1State, program_by_id, threads_of,
};
use nix::sched::sched_getaffinity;
use nix::unistd::Pid;
use support::{Dev, Probe, TestCgroup};

const V1_DEVICES: &str = "/sys/fs/cgroup/devices";
const UNIFIED: &str = "/sys/fs/cgroup/unified";

fn null_only() -> Vec<DeviceRule> {
    vec![DeviceRule::allow(
        DeviceKind::Char,
        Some(1),
        Some(3),
        Access::ALL,
    )]
}

fn null_and_zero() -> Vec<DeviceRule> {
    let mut rules = null_only();
    rules.push(DeviceRule::allow(
        DeviceKind::Char,
        Some(1),
        Some(5),
        Access::READ,
    ));
    rules
}

/// Rule sets that all keep /dev/null readable while other entries come and go.
fn churn(i: usize) -> Vec<DeviceRule> {
    let mut rules = match i % 3 {
        0 => null_only(),
        1 => null_and_zero(),
        _ => vec![
            DeviceRule::allow(DeviceKind::Block, None, None, Access::MKNOD),
            DeviceRule::allow(DeviceKind::Char, Some(1), Some(3), Access::READ),
        ],
    };
    if i.is_multiple_of(2) {
        rules.push(DeviceRule::allow(
            DeviceKind::Char,
            Some(136),
            None,
            Access::READ.union(Access::WRITE),
        ));
    }
    rules
}

#[test]
fn host_is_hybrid() {
    let setup = CgroupSetup::detect().unwrap();
    assert_eq!(setup.mode, Mode::Hybrid);
    assert_eq!(
        setup.unified_hierarchy().unwrap().mount_point,
        Path::new(UNIFIED)
    );
}

#[test]
fn v1_device_rules_are_enforced_and_read_back() {
    let cg = TestCgroup::new(V1_DEVICES);
    let devices = V1Devices::new(&cg.path);
    assert_eq!(devices.state().unwrap(), V1State::AllowAll);
    let mut probe = Probe::spawn();
    cg.add_process(probe.pid);
    assert_eq!(
        probe.open(Dev::Zero),
        0,
        "a fresh v1 cgroup allows everything"
    );

    devices.set_rules(&null_only()).unwrap();
    assert_eq!(probe.open(Dev::Null), 0);
    assert_eq!(probe.open(Dev::Zero), libc::EPERM);
    assert_eq!(
        devices.state().unwrap(),
        V1State::Allowed(vec![DeviceEntry {
            kind: DeviceKind::Char,
            major: Some(1),
            minor: Some(3),
            access: Access::ALL
        }])
    );

    devices.set_rules(&null_and_zero()).unwrap();
    assert_eq!(probe.open(Dev::Zero), 0);
    devices.set_rules(&null_only()).unwrap();
    assert_eq!(probe.open(Dev::Zero), libc::EPERM);
    assert_eq!(probe.open(Dev::Null), 0);
}

/// Churns the rules of a cgroup whose process opens /dev/null in a tight loop: no open may
/// be refused. Then takes /dev/null away to show that the loop does see refusals.
fn assert_no_window(cg: &TestCgroup, mut set_rules: impl FnMut(&[DeviceRule])) {
    set_rules(&null_only());
    let mut probe = Probe::spawn();
    cg.add_process(probe.pid);
    probe.start_loop();
    for i in 0..300 {
        set_rules(&churn(i));
        probe.wait_for_opens(20);
    }
    let (opens, denied) = probe.stop_loop();
    assert!(opens >= 6000, "the probe barely ran: {opens} opens");
    assert_eq!(
        denied, 0,
        "{denied} of {opens} opens of /dev/null were refused"
    );

    set_rules(&[DeviceRule::allow(
        DeviceKind::Char,
        Some(1),
        Some(5),
        Access::READ,
    )]);
    probe.start_loop();
    probe.wait_for_opens(100);
    let (_, denied) = probe.stop_loop();
    assert!(denied >= 100, "the probe does not notice refusals");
}

/// Read-only /dev/null, no mknod: writing and creating nodes are refused, reading is not;
/// then write and mknod access are granted.
fn assert_access_kinds_are_enforced(cg: &TestCgroup, mut set_rules: impl FnMut(&[DeviceRule])) {
    set_rules(&[DeviceRule::allow(
        DeviceKind::Char,
        Some(1),
        Some(3),
        Access::READ,
    )]);
    let mut probe = Probe::spawn();
    cg.add_process(probe.pid);
    assert_eq!(probe.open(Dev::Null), 0);
    assert_eq!(probe.open_null_for_writing(), libc::EPERM);
    assert_eq!(probe.mknod_null(), libc::EPERM);
    set_rules(&[
        DeviceRule::allow(DeviceKind::Char, Some(1), Some(3), Access::READ),
        DeviceRule::allow(DeviceKind::Char, Some(1), Some(3), Access::WRITE),
        DeviceRule::allow(DeviceKind::All, None, None, Access::MKNOD),
    ]);
    assert_eq!(probe.open_null_for_writing(), 0);
    assert_eq!(probe.mknod_null(), 0);
    assert_eq!(
        probe.open(Dev::Zero),
        libc::EPERM,
        "mknod does not grant reading"
    );
}

#[test]
fn v1_access_kinds_are_enforced() {
    let cg = TestCgroup::new(V1_DEVICES);
    let devices = V1Devices::new(&cg.path);
    assert_access_kinds_are_enforced(&cg, |rules| devices.set_rules(rules).unwrap());
}

#[test]
fn bpf_access_kinds_are_enforced() {
    let cg = TestCgroup::new(UNIFIED);
    let mut devices = BpfDevices::open(&cg.path).unwrap();
    assert_access_kinds_are_enforced(&cg, |rules| devices.set_rules(rules).unwrap());
}

#[test]
fn v1_rule_updates_never_deny_an_allowed_device() {
    let cg = TestCgroup::new(V1_DEVICES);
    let devices = V1Devices::new(&cg.path);
    assert_no_window(&cg, |rules| devices.set_rules(rules).unwrap());
}

#[test]
fn bpf_device_rules_are_enforced_and_read_back() {
    let cg = TestCgroup::new(UNIFIED);
    let mut devices = BpfDevices::open(&cg.path).unwrap();
    assert!(devices.rules().is_none());
    devices.set_rules(&null_only()).unwrap();
    let mut probe = Probe::spawn();
    cg.add_process(probe.pid);
    assert_eq!(probe.open(Dev::Null), 0);
    assert_eq!(probe.open(Dev::Zero), libc::EPERM);
    assert_eq!(devices.rules().unwrap(), null_only().as_slice());
    let id = devices.program_id().unwrap();
    assert_eq!(devices.attached_programs().unwrap(), vec![id]);

    devices.set_rules(&null_and_zero()).unwrap();
    assert_eq!(probe.open(Dev::Zero), 0);
    assert_eq!(
        devices.attached_programs().unwrap(),
        vec![devices.program_id().unwrap()]
    );
    assert_ne!(devices.program_id(), Some(id));
    devices.set_rules(&[]).unwrap();
    assert_eq!(probe.open(Dev::Null), libc::EPERM);
}

#[test]
fn bpf_rule_updates_never_deny_an_allowed_device() {
    let cg = TestCgroup::new(UNIFIED);
    let mut devices = BpfDevices::open(&cg.path).unwrap();
    assert_no_window(&cg, |rules| devices.set_rules(rules).unwrap());
    assert_eq!(devices.attached_programs().unwrap().len(), 1);
}

#[test]
fn bpf_update_replaces_programs_attached_by_others() {
    let cg = TestCgroup::new(UNIFIED);
    // Stands in for the container runtime's program: only /dev/null.
    let mut runtime = BpfDevices::open(&cg.path).unwrap();
    runtime.set_rules(&null_only()).unwrap();
    let mut probe = Probe::spawn();
    cg.add_process(probe.pid);
    assert_eq!(probe.open(Dev::Zero), libc::EPERM);

    let mut ours = BpfDevices::open(&cg.path).unwrap();
    ours.set_rules(&null_and_zero()).unwrap();
    assert_eq!(
        ours.attached_programs().unwrap(),
        vec![ours.program_id().unwrap()]
    );
    assert_eq!(
        probe.open(Dev::Zero),
        0,
        "the runtime's program still vetoes"
    );
}

/// The kernel frees a detached program once its last reference goes, after an RCU grace
/// period: poll for that.
fn wait_until_freed(id: u32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match program_by_id(id) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return,
            Err(e) => panic!("looking up program {id}: {e}"),
            Ok(_) if Instant::now() > deadline => panic!("program {id} is still loaded"),
            Ok(fd) => {
                drop(fd);
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[test]
fn bpf_remove_leaves_no_program_behind() {
    let cg = TestCgroup::new(UNIFIED);
    let mut devices = BpfDevices::open(&cg.path).unwrap();
    devices.set_rules(&null_only()).unwrap();
    let first = devices.program_id().unwrap();
    devices.set_rules(&null_and_zero()).unwrap();
    let second = devices.program_id().unwrap();
    wait_until_freed(first);
    devices.remove().unwrap();
    assert!(devices.attached_programs().unwrap().is_empty());
    assert!(devices.rules().is_none());
    drop(devices);
    wait_until_freed(second);
    // Removing twice is harmless.
    let mut again = BpfDevices::open(&cg.path).unwrap();
    again.remove().unwrap();
}

#[test]
fn bpf_errors_name_the_cgroup() {
    let missing = Path::new(UNIFIED).join("kvrs-test-does-not-exist");
    let err = BpfDevices::open(&missing).unwrap_err();
    assert!(matches!(err, CgroupError::Read { .. }), "{err}");
    assert!(
        err.to_string().contains("kvrs-test-does-not-exist"),
        "{err}"
    );

    // A v1 directory is no cgroup2 directory: the kernel refuses the attach.
    let cg = TestCgroup::new(V1_DEVICES);
    let mut devices = BpfDevices::open(&cg.path).unwrap();
    let err = devices.set_rules(&null_only()).unwrap_err();
    assert!(
        matches!(err, CgroupError::Bpf { op: "attach", .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&cg.path.display().to_string()),
        "{err}"
    );

    let bad = [DeviceRule::allow(
        DeviceKind::Char,
        Some(1),
        Some(3),
        Access::NONE,
    )];
    let err = devices.set_rules(&bad).unwrap_err();
    assert!(
        matches!(err, CgroupError::InvalidRule { index: 0, .. }),
        "{err}"
    );
}

#[test]
fn v1_errors_name_the_cgroup() {
    let devices = V1Devices::new(&Path::new(V1_DEVICES).join("kvrs-test-does-not-exist"));
    let err = devices.set_rules(&null_only()).unwrap_err();
    assert!(matches!(err, CgroupError::Read { .. }), "{err:?}");
    assert!(
        err.to_string().contains("kvrs-test-does-not-exist"),
        "{err}"
    );
}

#[test]
fn manager_drives_a_processs_v1_cgroups() {
    let devices_cg = TestCgroup::new(V1_DEVICES);
    let memory_cg = TestCgroup::new("/sys/fs/cgroup/memory");
    let cpuset_cg = TestCgroup::new_cpuset();
    let mut probe = Probe::spawn();
    for cg in [&devices_cg, &memory_cg, &cpuset_cg] {
        cg.add_process(probe.pid);
    }
    let setup = CgroupSetup::detect().unwrap();
    let membership = ProcessCgroups::read(probe.pid).unwrap();
    let mut manager = Manager::for_process(&setup, &membership).unwrap();
    assert_eq!(manager.mode(), Mode::Hybrid);
    assert!(matches!(manager.devices(), Devices::V1(d) if d.dir() == devices_cg.path));
    assert_eq!(manager.memory_dir().path, memory_cg.path);
    assert_eq!(manager.cpuset_dir().path, cpuset_cg.path);

    assert_eq!(manager.allowed_devices().unwrap(), None);
    manager.set_device_rules(&null_only()).unwrap();
    assert_eq!(probe.open(Dev::Zero), libc::EPERM);
    assert_eq!(
        manager.allowed_devices().unwrap().unwrap(),
        cgroups::effective(&null_only()).unwrap()
    );

    assert_eq!(manager.memory_limit().unwrap(), None);
    manager.set_memory_limit(Some(256 << 20)).unwrap();
    assert_eq!(manager.memory_limit().unwrap(), Some(256 << 20));
    manager.set_memory_limit(None).unwrap();
    assert_eq!(manager.memory_limit().unwrap(), None);
    manager.cleanup().unwrap();
}

/// This host is hybrid, but its cgroup2 mount is a real one: described as a unified host,
/// the manager takes the cgroup2 paths for everything and filters devices with eBPF.
#[test]
fn manager_on_a_unified_view_of_this_host() {
    let cg = TestCgroup::new(UNIFIED);
    let mut probe = Probe::spawn();
    cg.add_process(probe.pid);
    let setup = CgroupSetup {
        mode: Mode::Unified,
        v1: std::collections::BTreeMap::new(),
        unified: Some(cgroups::Hierarchy {
            mount_point: UNIFIED.into(),
            root: "/".into(),
        }),
    };
    let membership = ProcessCgroups::read(probe.pid).unwrap();
    let mut manager = Manager::for_process(&setup, &membership).unwrap();
    assert!(matches!(manager.devices(), Devices::V2(d) if d.dir() == cg.path));
    assert!(manager.memory_dir().v2 && manager.memory_dir().path == cg.path);

    assert_eq!(manager.allowed_devices().unwrap(), None);
    manager.set_device_rules(&null_only()).unwrap();
    assert_eq!(probe.open(Dev::Null), 0);
    assert_eq!(probe.open(Dev::Zero), libc::EPERM);
    assert_eq!(
        manager.allowed_devices().unwrap().unwrap(),
        cgroups::effective(&null_only()).unwrap()
    );
    let Devices::V2(bpf) = manager.devices() else {
        unreachable!()
    };
    let id = bpf.program_id().unwrap();

    // The memory and cpuset controllers are bound to v1 here, so cgroup2 lacks their
    // files: the errors say which file.
    let err = manager.memory_limit().unwrap_err();
    assert!(
        matches!(&err, CgroupError::Read { path, .. } if path.ends_with("memory.max")),
        "{err}"
    );
    let one: CpuList = "0".parse().unwrap();
    let err = manager
        .place_threads(probe.pid, &[probe.pid], &one, &one)
        .unwrap_err();
    assert!(
        matches!(&err, CgroupError::Write { path, .. } if path.ends_with("cgroup.subtree_control")),
        "{err}"
    );

    manager.cleanup().unwrap();
    assert_eq!(probe.open(Dev::Zero), 0, "the program is detached");
    wait_until_freed(id);
}

#[test]
fn manager_needs_membership_in_every_hierarchy() {
    let setup = CgroupSetup::detect().unwrap();
    let mut membership = ProcessCgroups::read(i32::try_from(std::process::id()).unwrap()).unwrap();
    membership.v1.remove("cpuset");
    let err = Manager::for_process(&setup, &membership).unwrap_err();
    assert!(
        matches!(&err, CgroupError::NotAMember { controller } if controller == "cpuset"),
        "{err}"
    );
}

fn affinity(tid: i32) -> Vec<usize> {
    let set = sched_getaffinity(Pid::from_raw(tid)).unwrap();
    (0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap())
        .collect()
}

/// Threads that park until the test ends, reporting their ids.
struct Threads {
    tids: Vec<i32>,
    stop: std::sync::mpsc::Sender<()>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Threads {
    fn spawn(n: usize) -> Self {
        let (stop, stop_rx) = std::sync::mpsc::channel::<()>();
        let stop_rx = std::sync::Arc::new(std::sync::Mutex::new(stop_rx));
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let handles = (0..n)
            .map(|_| {
                let (tid_tx, stop_rx) = (tid_tx.clone(), stop_rx.clone());
                std::thread::spawn(move || {
                    tid_tx.send(nix::unistd::gettid().as_raw()).unwrap();
                    let _ = stop_rx.lock().unwrap().recv();
                })
            })
            .collect();
        let tids = (0..n).map(|_| tid_rx.recv().unwrap()).collect();
        Self {
            tids,
            stop,
            handles,
        }
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        drop(std::mem::replace(
            &mut self.stop,
            std::sync::mpsc::channel().0,
        ));
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[test]
fn threads_are_pinned_through_cpuset_children() {
    let cpus: CpuList = std::fs::read_to_string("/sys/fs/cgroup/cpuset/cpuset.cpus")
        .unwrap()
        .parse()
        .unwrap();
    let all: Vec<u32> = cpus.cpus().collect();
    assert!(all.len() >= 2, "needs two CPUs, has {cpus}");
    let (vcpu_cpu, other_cpu) = (all[all.len() - 1], all[0]);

    let cg = TestCgroup::new_cpuset();
    let threads = Threads::spawn(2);
    let pid = i32::try_from(std::process::id()).unwrap();
    cg.add_process(pid);
    let setup = CgroupSetup::detect().unwrap();
    let mut manager = Manager::for_process(&setup, &ProcessCgroups::read(pid).unwrap()).unwrap();
    assert_eq!(manager.cpuset_dir().path, cg.path);

    manager
        .place_threads(
            pid,
            &threads.tids,
            &std::iter::once(vcpu_cpu).collect(),
            &std::iter::once(other_cpu).collect(),
        )
        .unwrap();
    let vcpus = cg.path.join(cgroups::VCPU_CHILD);
    let housekeeping = cg.path.join(cgroups::HOUSEKEEPING_CHILD);
    for tid in threads_of(pid).unwrap() {
        let (want_dir, want_cpu) = if threads.tids.contains(&tid) {
            (&vcpus, vcpu_cpu)
        } else {
            (&housekeeping, other_cpu)
        };
        let tasks = std::fs::read_to_string(want_dir.join("tasks")).unwrap();
        assert!(
            tasks.lines().any(|l| l == tid.to_string()),
            "thread {tid} is not in {}",
            want_dir.display()
        );
        assert_eq!(affinity(tid), vec![want_cpu as usize], "thread {tid}");
    }

    manager.cleanup().unwrap();
    assert!(!vcpus.exists() && !housekeeping.exists());
    for &tid in &threads.tids {
        assert_eq!(affinity(tid).len(), all.len(), "thread {tid} after cleanup");
    }
}

#[test]
fn thread_placement_errors() {
    let cg = TestCgroup::new_cpuset();
    let mut probe = Probe::spawn();
    cg.add_process(probe.pid);
    let setup = CgroupSetup::detect().unwrap();
    let mut manager =
        Manager::for_process(&setup, &ProcessCgroups::read(probe.pid).unwrap()).unwrap();
    let one: CpuList = "0".parse().unwrap();

    // A thread of some other process.
    let own_tid = nix::unistd::gettid().as_raw();
    let err = manager
        .place_threads(probe.pid, &[own_tid], &one, &one)
        .unwrap_err();
    assert!(
        matches!(err, CgroupError::MoveThread { tid, .. } if tid == own_tid),
        "{err}"
    );

    // CPUs the parent cpuset does not have.
    let err = manager
        .place_threads(probe.pid, &[probe.pid], &"4000".parse().unwrap(), &one)
        .unwrap_err();
    assert!(
        matches!(&err, CgroupError::Write { path, .. } if path.ends_with("cpuset.cpus")),
        "{err}"
    );
    assert_eq!(probe.open(Dev::Null), 0, "the probe still runs");
    manager.cleanup().unwrap();
    assert!(!cg.path.join(cgroups::VCPU_CHILD).exists());
}

/// Prints how long a rule update takes on each backend (a hotplug pays this once).
/// Run: `cargo nextest run -p cgroups --run-ignored only bench_`.
#[test]
#[ignore = "benchmark: prints figures"]
fn bench_rule_updates() {
    const ROUNDS: u32 = 100;
    let rules_of = |n: u32, flip: bool| -> Vec<DeviceRule> {
        (0..n)
            .map(|i| {
                DeviceRule::allow(
                    DeviceKind::Block,
                    Some(8),
                    Some(i * 2 + u32::from(flip)),
                    Access::READ.union(Access::WRITE),
                )
            })
            .chain(null_only())
            .collect()
    };
    for n in [1, 16, 256] {
        let cg = TestCgroup::new(V1_DEVICES);
        let v1 = V1Devices::new(&cg.path);
        v1.set_rules(&rules_of(n, false)).unwrap();
        let start = Instant::now();
        for round in 0..ROUNDS {
            v1.set_rules(&rules_of(n, round % 2 == 0)).unwrap();
        }
        let v1_time = start.elapsed() / ROUNDS;

        let cg2 = TestCgroup::new(UNIFIED);
        let mut bpf = BpfDevices::open(&cg2.path).unwrap();
        bpf.set_rules(&rules_of(n, false)).unwrap();
        let start = Instant::now();
        for round in 0..ROUNDS {
            bpf.set_rules(&rules_of(n, round % 2 == 0)).unwrap();
        }
        let bpf_time = start.elapsed() / ROUNDS;
        println!(
            "{n:>4} entries: v1 devices update {v1_time:>10.1?}, cgroup2 eBPF update {bpf_time:>10.1?} \
             (ratio {:.2})",
            bpf_time.as_secs_f64() / v1_time.as_secs_f64()
        );
    }
}
