//! Launcher device rules on the real kernel: a v1 devices cgroup set up the way a container
//! runtime sets one up, and a cgroup2 directory where the rules become an eBPF program.
//! Access is checked by opening device nodes from processes inside the cgroup.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cgroups::{CgroupSetup, Hierarchy, Mode};
use handler::devices::{self, Wanted};

const V1_DEVICES: &str = "/sys/fs/cgroup/devices";
const UNIFIED: &str = "/sys/fs/cgroup/unified";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A throwaway cgroup with one sleeping process standing in for the launcher. Dropping it
/// kills the process and removes the directory.
struct Launcher {
    dir: PathBuf,
    child: Child,
}

impl Launcher {
    fn in_new_cgroup(root: &str, prepare: impl FnOnce(&Path)) -> Self {
        let dir = Path::new(root).join(format!(
            "kvrs-test-{}-dev{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).unwrap();
        prepare(&dir);
        let child = Command::new("sleep")
            .arg("infinity")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).unwrap();
        Self { dir, child }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    fn isolation(&self) -> isolation::PodIsolation {
        isolation::detect_from_pid(self.pid()).unwrap()
    }

    /// Whether a process in this cgroup may open `dev` for reading.
    fn can_open(&self, dev: &str) -> bool {
        let script = format!(
            "echo $$ > {}/cgroup.procs && exec dd if={dev} of=/dev/null count=0 2>/dev/null",
            self.dir.display()
        );
        Command::new("sh")
            .args(["-c", &script])
            .status()
            .unwrap()
            .success()
    }

    fn list(&self) -> String {
        std::fs::read_to_string(self.dir.join("devices.list")).unwrap()
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The probes have exited; the kernel may take a moment to let go of the cgroup.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::remove_dir(&self.dir).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// runc's defaults plus one device the container's spec asked for (`/dev/ttyS0`, 4:64).
fn runtime_setup(dir: &Path) {
    std::fs::write(dir.join("devices.deny"), "a").unwrap();
    for line in [
        "c *:* m",
        "b *:* m",
        "c 1:3 rwm",
        "c 1:5 rwm",
        "c 1:7 rwm",
        "c 1:8 rwm",
        "c 1:9 rwm",
        "c 5:0 rwm",
        "c 5:2 rwm",
        "c 136:* rwm",
        "c 10:200 rwm",
        "c 4:64 rw",
    ] {
        std::fs::write(dir.join("devices.allow"), line).unwrap();
    }
}

fn kvm() -> bool {
    Path::new("/dev/kvm").exists()
}

#[test]
fn v1_rules_add_the_vm_devices_keep_the_containers_and_drop_only_unplugged_disks() {
    let l = Launcher::in_new_cgroup(V1_DEVICES, runtime_setup);
    let setup = CgroupSetup::detect().unwrap();
    assert_eq!(
        setup.mode,
        Mode::Hybrid,
        "this test expects the test machine's layout"
    );
    assert!(
        !l.can_open("/dev/kvm") || !kvm(),
        "the runtime did not allow kvm"
    );

    let mut wanted = Wanted {
        char_devices: devices::host_vm_devices(Path::new("/dev")),
        block: vec![(7, 0)],
        unplugged_block: vec![],
    };
    let applied = devices::apply(&setup, &l.isolation(), &wanted).unwrap();
    assert!(applied.changed);
    let list = l.list();
    for line in ["c 4:64 rw", "b 7:0 rwm", "c 1:3 rwm", "c 10:200 rwm"] {
        assert!(
            list.lines().any(|l| l == line),
            "{line} missing from\n{list}"
        );
    }
    if kvm() {
        assert!(list.lines().any(|l| l == "c 10:232 rwm"), "{list}");
        assert!(l.can_open("/dev/kvm"));
    }
    assert!(l.can_open("/dev/null"));
    assert!(l.can_open("/dev/loop0"), "the hotplugged disk (7:0)");
    assert!(!l.can_open("/dev/kmsg"), "nothing beyond what is needed");

    // Nothing to change the second time.
    let again = devices::apply(&setup, &l.isolation(), &wanted).unwrap();
    assert!(!again.changed);
    assert_eq!(l.list(), list);

    // The disk is unplugged: only its access goes.
    wanted.block.clear();
    wanted.unplugged_block.push((7, 0));
    assert!(
        devices::apply(&setup, &l.isolation(), &wanted)
            .unwrap()
            .changed
    );
    let list = l.list();
    assert!(!list.contains("b 7:0"), "{list}");
    assert!(list.lines().any(|l| l == "c 4:64 rw"), "{list}");
    assert!(l.can_open("/dev/null"));
    assert!(!l.can_open("/dev/loop0"));
}

#[test]
fn v1_a_cgroup_allowing_everything_is_left_alone() {
    let l = Launcher::in_new_cgroup(V1_DEVICES, |_| {});
    let setup = CgroupSetup::detect().unwrap();
    let wanted = Wanted {
        char_devices: devices::host_vm_devices(Path::new("/dev")),
        ..Wanted::default()
    };
    let applied = devices::apply(&setup, &l.isolation(), &wanted).unwrap();
    assert!(!applied.changed);
    assert_eq!(applied.allowed, None);
    assert_eq!(l.list().trim(), "a *:* rwm");
    assert!(l.can_open("/dev/kmsg"));
}

/// This host is hybrid; its cgroup2 mount is real, so a unified view of it exercises the
/// eBPF backend for real.
#[test]
fn cgroup2_rules_become_a_device_program() {
    let l = Launcher::in_new_cgroup(UNIFIED, |_| {});
    let setup = CgroupSetup {
        mode: Mode::Unified,
        v1: std::collections::BTreeMap::new(),
        unified: Some(Hierarchy {
            mount_point: UNIFIED.into(),
            root: "/".into(),
        }),
    };
    // The kubelet's record of the pod's block claim (7:0), and a dangling one.
    let pods = tempfile::tempdir().unwrap();
    let record = pods
        .path()
        .join("pod-uid/volumeDevices/kubernetes.io~local-volume");
    std::fs::create_dir_all(&record).unwrap();
    std::os::unix::fs::symlink("/dev/loop0", record.join("data")).unwrap();
    std::os::unix::fs::symlink("/dev/no-such-disk", record.join("gone")).unwrap();
    let wanted = Wanted {
        char_devices: devices::host_vm_devices(Path::new("/dev")),
        block: devices::mapped_block_devices(pods.path(), "pod-uid"),
        unplugged_block: vec![],
    };
    assert_eq!(wanted.block, vec![(7, 0)]);
    assert!(l.can_open("/dev/kmsg"), "no program yet");
    let applied = devices::apply(&setup, &l.isolation(), &wanted).unwrap();
    assert!(applied.changed);
    assert!(l.can_open("/dev/null"));
    assert!(l.can_open("/dev/urandom"));
    assert!(l.can_open("/dev/loop0"), "the pod's block claim");
    if kvm() {
        assert!(l.can_open("/dev/kvm"));
    }
    assert!(!l.can_open("/dev/kmsg"));
    assert!(!l.can_open("/dev/loop1"), "a disk the pod was not given");
}
