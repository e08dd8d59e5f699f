//! containerDisk / kernelBoot mounts with real namespaces, real mounts and real processes.
//!
//! Two kinds of stand-in containers, each a process in its own mount namespace, chrooted
//! into a private tmpfs root (the host's `/usr` bound in so programs run):
//! - the launcher: `sleep`, with the "emptyDir" (a host temp dir) bound at KubeVirt's
//!   container-disk dir `/var/run/kubevirt/container-disks`;
//! - an image container: the real `container-disk` program, with its image files in its
//!   root (`/disk/disk.qcow2`, `/boot/vmlinuz`, ...) and the same emptyDir at `/cd`, serving
//!   `/cd/disk_<n>.sock` as the controller's template tells it to.
//!
//! The image files exist only inside the image container's namespace, so a file the test
//! reads through the launcher can only have come through the handler's bind mount.

mod common;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use api::VirtualMachineInstance;
use handler::mounts::{self, MountConfig, MountError, Prepared};
use isolation::{NsKind, PodIsolation};
use serde_json::json;

const LIMIT: Duration = Duration::from_mins(1);
const CD_DIR: &str = "/var/run/kubevirt/container-disks";
const HOTPLUG_DIR: &str = "/var/run/kubevirt/hotplug-disks";

/// Builds the stand-in's root and chroots into it; `$SETUP` adds what the test needs.
const CONTAINER: &str = r#"set -e
R="$1"; shift
mount -t tmpfs -o mode=755 ctr "$R"
mkdir -p "$R/usr" "$R/tmp"
mount --rbind /usr "$R/usr"
ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"; ln -s usr/bin "$R/bin"
eval "$SETUP"
exec chroot "$R" "$@"
"#;

/// A stand-in container process. Dropping it kills it; its mounts go with its namespace.
struct Container {
    child: Option<Child>,
    pid: i32,
}

impl Container {
    fn start(root: &Path, setup: &str, log: &Path, argv: &[&str], comm: &str) -> Self {
        std::fs::create_dir_all(root).unwrap();
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new("unshare")
            .args([
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                CONTAINER,
                "sh",
            ])
            .arg(root)
            .args(argv)
            .env("SETUP", setup)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let c = Self {
            child: Some(child),
            pid,
        };
        // unshare, sh and chroot exec in turn: the pid stays, the name tells when the
        // container's program runs in its final root.
        wait_until(&format!("{comm} to run"), || {
            (std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm))
                .then_some(())
        });
        c
    }

    fn isolation(&self) -> PodIsolation {
        isolation::detect_from_pid(self.pid).unwrap()
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        self.kill();
    }
}

fn wait_until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One test's world: the shared "emptyDir", the launcher, and image containers.
struct World {
    dir: tempfile::TempDir,
    launcher: Container,
}

impl World {
    fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("handler-mounts")
            .tempdir()
            .unwrap();
        let shared = dir.path().join("empty-dir");
        std::fs::create_dir(&shared).unwrap();
        let setup = format!(
            "mkdir -p \"$R{CD_DIR}\" \"$R{HOTPLUG_DIR}\" && mount --bind {} \"$R{CD_DIR}\"",
            shared.display()
        );
        let launcher = Container::start(
            &dir.path().join("launcher-root"),
            &setup,
            &dir.path().join("launcher.log"),
            &["/usr/bin/sleep", "infinity"],
            "sleep",
        );
        Self { dir, launcher }
    }

    fn shared(&self) -> PathBuf {
        self.dir.path().join("empty-dir")
    }

    /// An image container serving `<copy_name>.sock`, with `files` (path in the image,
    /// content) in its root.
    fn image(&self, copy_name: &str, files: &[(&str, &[u8])]) -> Container {
        let staging = self.dir.path().join(format!("{copy_name}-files"));
        let mut setup = String::new();
        for (i, (path, content)) in files.iter().enumerate() {
            let src = staging.join(i.to_string());
            std::fs::create_dir_all(&staging).unwrap();
            std::fs::write(&src, content).unwrap();
            writeln!(
                setup,
                "mkdir -p \"$(dirname \"$R{path}\")\" && cp {} \"$R{path}\"",
                src.display()
            )
            .unwrap();
        }
        writeln!(
            setup,
            "mkdir -p \"$R/cd\" && mount --bind {} \"$R/cd\"\ncp {} \"$R/container-disk\"",
            self.shared().display(),
            container_disk_bin().display()
        )
        .unwrap();
        let copy_path = format!("/cd/{copy_name}");
        Container::start(
            &self.dir.path().join(format!("{copy_name}-root")),
            &setup,
            &self.dir.path().join(format!("{copy_name}.log")),
            &["/container-disk", "--copy-path", &copy_path],
            "container-disk",
        )
    }

    fn launcher(&self) -> PodIsolation {
        self.launcher.isolation()
    }

    /// Reads a file as the launcher sees it, and tries to open it for writing. setns(2)
    /// puts the thread at its namespace's root mount, not at the launcher's chroot, so the
    /// path is taken under the launcher's root directory.
    fn read_in_launcher(&self, path: &str) -> (Vec<u8>, Option<i32>) {
        let path = self
            .dir
            .path()
            .join("launcher-root")
            .join(path.trim_start_matches('/'));
        self.launcher()
            .run_in_namespace(NsKind::Mnt, move || {
                let content = std::fs::read(&path).unwrap();
                let write = std::fs::OpenOptions::new()
                    .append(true)
                    .open(&path)
                    .and_then(|mut f| f.write_all(b"x"));
                (content, write.err().and_then(|e| e.raw_os_error()))
            })
            .unwrap()
    }

    /// Mounts on `path` in the launcher's mount table.
    fn mounts_on(&self, path: &str) -> usize {
        std::fs::read_to_string(format!("/proc/{}/mountinfo", self.launcher.pid))
            .unwrap()
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some(path))
            .count()
    }
}

fn container_disk_bin() -> PathBuf {
    common::workspace_bin("container-disk", "CONTAINER_DISK_BIN", "containerdisk")
}

fn vmi(spec: serde_json::Value) -> VirtualMachineInstance {
    let mut v = json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "v", "namespace": "default", "uid": "u1"},
    });
    v["spec"] = spec;
    serde_json::from_value(v).unwrap()
}

fn disk_vmi() -> VirtualMachineInstance {
    vmi(json!({"domain": {"devices": {}}, "volumes": [
        {"name": "ci", "cloudInitNoCloud": {"userData": "x"}},
        {"name": "root", "containerDisk": {"image": "guest"}},
    ]}))
}

fn prepare_until_ready(w: &World, v: &VirtualMachineInstance) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let cfg = MountConfig::default();
    wait_until("prepare to be ready", || {
        match mounts::prepare(v, &w.launcher(), &cfg).unwrap() {
            Prepared::Ready { mounted, present } => Some((mounted, present)),
            Prepared::NotReady { .. } => None,
        }
    })
}

const EROFS: i32 = 30;

#[test]
fn a_container_disk_is_mounted_read_only_in_the_launcher_only_once_and_cleaned_up() {
    let w = World::new();
    let _image = w.image("disk_1", &[("/disk/disk.qcow2", b"QFI\xfb image one")]);
    let v = disk_vmi();
    let target = format!("{CD_DIR}/disk_1.img");

    let (mounted, present) = prepare_until_ready(&w, &v);
    assert_eq!(mounted, [PathBuf::from(&target)]);
    assert!(present.is_empty());
    let (content, write_err) = w.read_in_launcher(&target);
    assert_eq!(content, b"QFI\xfb image one");
    assert_eq!(write_err, Some(EROFS), "the mount is read-only");
    // The host has only the empty mount point the handler created.
    let host = w.shared().join("disk_1.img");
    assert_eq!(std::fs::metadata(&host).unwrap().len(), 0);
    assert_eq!(w.mounts_on(&target), 1);

    // Again: nothing changes.
    let (mounted, present) = prepare_until_ready(&w, &v);
    assert!(mounted.is_empty(), "{mounted:?}");
    assert_eq!(present, [PathBuf::from(&target)]);
    assert_eq!(w.mounts_on(&target), 1);

    let cfg = MountConfig::default();
    assert_eq!(mounts::cleanup(&v, &w.launcher(), &cfg).unwrap(), 1);
    assert_eq!(w.mounts_on(&target), 0);
    assert_eq!(w.read_in_launcher(&target).0, b"");
    assert_eq!(mounts::cleanup(&v, &w.launcher(), &cfg).unwrap(), 0);
}

#[test]
fn kernel_boot_files_and_a_custom_disk_path() {
    let w = World::new();
    let _kernel = w.image(
        "kernel-boot",
        &[
            ("/boot/vmlinuz", b"kernel"),
            ("/boot/initrd.img", b"initrd"),
        ],
    );
    let _disk = w.image(
        "disk_0",
        &[
            ("/custom/data.raw", b"raw data"),
            ("/disk/a.qcow2", b"a"),
            ("/disk/b.qcow2", b"b"),
        ],
    );
    let v = vmi(json!({
        "domain": {"devices": {}, "firmware": {"kernelBoot": {"container": {
            "image": "k", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}}},
        "volumes": [{"name": "data", "containerDisk": {"image": "d", "path": "custom/data.raw"}}],
    }));
    let (mounted, _) = prepare_until_ready(&w, &v);
    assert_eq!(mounted.len(), 3, "{mounted:?}");
    assert_eq!(
        w.read_in_launcher(&format!("{CD_DIR}/kernel-boot/vmlinuz")),
        (b"kernel".to_vec(), Some(EROFS))
    );
    assert_eq!(
        w.read_in_launcher(&format!("{CD_DIR}/kernel-boot/initrd.img"))
            .0,
        b"initrd"
    );
    assert_eq!(
        w.read_in_launcher(&format!("{CD_DIR}/disk_0.img")).0,
        b"raw data"
    );
    assert_eq!(
        mounts::cleanup(&v, &w.launcher(), &MountConfig::default()).unwrap(),
        3
    );

    // Without `path`, KubeVirt wants exactly one file in /disk; this image has two.
    let v = vmi(json!({"domain": {"devices": {}}, "volumes": [
        {"name": "data", "containerDisk": {"image": "d"}}]}));
    let e = mounts::prepare(&v, &w.launcher(), &MountConfig::default()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("spec.volumes[0] (data)") && msg.contains("2 entries"),
        "{msg}"
    );
}

#[test]
fn missing_or_dead_sockets_are_not_ready() {
    let w = World::new();
    let v = disk_vmi();
    let cfg = MountConfig::default();
    match mounts::prepare(&v, &w.launcher(), &cfg).unwrap() {
        Prepared::NotReady {
            field,
            socket,
            reason,
        } => {
            assert_eq!(field, "spec.volumes[1] (root)");
            assert_eq!(socket, PathBuf::from(format!("{CD_DIR}/disk_1.sock")));
            assert!(reason.contains("does not exist"), "{reason}");
        }
        ready @ Prepared::Ready { .. } => panic!("{ready:?}"),
    }
    // The image container dies without removing its socket: nobody listens.
    let mut image = w.image("disk_1", &[("/disk/disk.qcow2", b"x")]);
    wait_until("the socket", || {
        w.shared().join("disk_1.sock").exists().then_some(())
    });
    image.kill();
    match mounts::prepare(&v, &w.launcher(), &cfg).unwrap() {
        Prepared::NotReady { reason, .. } => assert!(reason.contains("nobody listens"), "{reason}"),
        ready @ Prepared::Ready { .. } => panic!("{ready:?}"),
    }
    assert_eq!(w.mounts_on(&format!("{CD_DIR}/disk_1.img")), 0);
}

#[test]
fn a_restarted_image_container_replaces_the_stale_mount() {
    let w = World::new();
    let v = disk_vmi();
    let target = format!("{CD_DIR}/disk_1.img");
    let mut first = w.image("disk_1", &[("/disk/disk.qcow2", b"first")]);
    prepare_until_ready(&w, &v);
    assert_eq!(w.read_in_launcher(&target).0, b"first");
    first.kill();
    let _second = w.image("disk_1", &[("/disk/disk.qcow2", b"second")]);
    let (mounted, _) = prepare_until_ready(&w, &v);
    assert_eq!(mounted, [PathBuf::from(&target)]);
    assert_eq!(w.read_in_launcher(&target).0, b"second");
    assert_eq!(w.mounts_on(&target), 1, "the stale mount is gone");
}

#[test]
fn symlinks_cannot_lead_out_of_the_containers() {
    let w = World::new();
    let v = disk_vmi();
    let cfg = MountConfig::default();
    // A host file the pods must never reach.
    let secret = w.dir.path().join("host-secret");
    std::fs::write(&secret, "host secret").unwrap();

    // The image points its disk at the host file: resolved inside the image's root, the
    // link leads nowhere.
    let image = w.image("disk_1", &[]);
    let root = PathBuf::from(format!("/proc/{}/root", image.pid));
    std::fs::create_dir(root.join("disk")).unwrap();
    std::os::unix::fs::symlink(&secret, root.join("disk/disk.qcow2")).unwrap();
    let e = prepare_err(&w, &v, &cfg);
    assert!(matches!(e, MountError::Image { .. }), "{e}");
    // A relative link climbing out is held at the image's root too.
    std::fs::remove_file(root.join("disk/disk.qcow2")).unwrap();
    let up = format!("../../../../../../..{}", secret.display());
    std::os::unix::fs::symlink(&up, root.join("disk/disk.qcow2")).unwrap();
    let e = prepare_err(&w, &v, &cfg);
    assert!(matches!(e, MountError::Image { .. }), "{e}");

    // The launcher plants a symlink where the target should be.
    std::fs::remove_file(root.join("disk/disk.qcow2")).unwrap();
    std::fs::write(root.join("disk/disk.qcow2"), "image").unwrap();
    let planted = w.shared().join("disk_1.img");
    std::os::unix::fs::symlink(&secret, &planted).unwrap();
    let e = prepare_err(&w, &v, &cfg);
    assert!(matches!(e, MountError::BadTarget { .. }), "{e}");
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "host secret");
    std::fs::remove_file(&planted).unwrap();

    // The launcher's socket is a link to a socket served on the host: it resolves inside
    // the launcher's root, where there is none.
    drop(image);
    let host_sock = w.dir.path().join("host.sock");
    let _host = std::os::unix::net::UnixListener::bind(&host_sock).unwrap();
    let sock = w.shared().join("disk_1.sock");
    let _ = std::fs::remove_file(&sock);
    std::os::unix::fs::symlink(&host_sock, &sock).unwrap();
    match mounts::prepare(&v, &w.launcher(), &cfg).unwrap() {
        Prepared::NotReady { reason, .. } => assert!(reason.contains("does not exist"), "{reason}"),
        ready @ Prepared::Ready { .. } => panic!("{ready:?}"),
    }
    assert_eq!(w.mounts_on(&format!("{CD_DIR}/disk_1.img")), 0);
}

fn prepare_err(w: &World, v: &VirtualMachineInstance, cfg: &MountConfig) -> MountError {
    wait_until("prepare to fail", || {
        match mounts::prepare(v, &w.launcher(), cfg) {
            Ok(Prepared::NotReady { .. }) => None,
            Ok(ready) => panic!("prepare succeeded: {ready:?}"),
            Err(e) => Some(e),
        }
    })
}

/// A hotplugged block claim: virt-handler makes the device the kubelet mapped for the
/// attachment pod a node in the launcher's hotplug dir, owned by qemu, whatever the launcher
/// had put at that name; once the guest no longer has it and the spec does not want it, the
/// node goes and its device is reported for denying.
#[test]
fn a_hotplugged_block_claim_is_a_device_node_in_the_launcher_until_unplugged() {
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
    let w = World::new();
    // The kubelet's record of the attachment pod's volumeDevices: a link to the device.
    // /dev/loop7's numbers; a node needs no device behind it.
    let rdev = nix::sys::stat::makedev(7, 7);
    let pods = w.dir.path().join("pods");
    let record = pods.join("hp-uid/volumeDevices/kubernetes.io~local-volume");
    std::fs::create_dir_all(&record).unwrap();
    let device = w.dir.path().join("loop7");
    nix::sys::stat::mknod(
        &device,
        nix::sys::stat::SFlag::S_IFBLK,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        rdev,
    )
    .unwrap();
    std::os::unix::fs::symlink(&device, record.join("raw")).unwrap();
    let secret = w.dir.path().join("secret");
    std::fs::write(&secret, "host").unwrap();
    let in_launcher = PathBuf::from(format!("/proc/{}/root{HOTPLUG_DIR}", w.launcher.pid));
    // What the launcher planted where the device goes.
    std::os::unix::fs::symlink(&secret, in_launcher.join("raw")).unwrap();
    let v: VirtualMachineInstance = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "v", "namespace": "default", "uid": "u1"},
        "spec": {"domain": {"devices": {}}, "volumes": [
            {"name": "raw", "persistentVolumeClaim": {"claimName": "raw", "hotpluggable": true}},
        ]},
        "status": {"volumeStatus": [
            {"name": "raw", "target": "", "phase": "AttachedToNode",
             "hotplugVolume": {"attachPodName": "hp", "attachPodUID": "hp-uid"},
             "persistentVolumeClaimInfo": {"volumeMode": "Block"}},
        ]},
    }))
    .unwrap();
    let dir = Path::new(HOTPLUG_DIR);
    for _ in 0..2 {
        let hot = handler::hotplug::mount(&v, &w.launcher(), &pods, dir).unwrap();
        assert_eq!(hot.ready, ["raw".to_owned()].into());
        assert_eq!(hot.block, [(7, 7)]);
        let node = std::fs::symlink_metadata(in_launcher.join("raw")).unwrap();
        assert!(node.file_type().is_block_device());
        assert_eq!((node.rdev(), node.uid(), node.gid()), (rdev, 107, 107));
    }
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "host");

    // Not mapped by the kubelet (yet): waiting, nothing made.
    let mut other = v.clone();
    other.status.as_mut().unwrap().volume_status[0].hotplug_volume = Some(api::common::Preserved(
        json!({"attachPodName": "hp-2", "attachPodUID": "hp-2-uid"}),
    ));
    let hot = handler::hotplug::mount(&other, &w.launcher(), &pods, dir).unwrap();
    assert!(hot.ready.is_empty() && hot.block.is_empty());
    assert!(hot.waiting[0].1.contains("hp-2-uid"), "{:?}", hot.waiting);

    // Out of the spec but still in the guest: kept; out of both: removed, device reported.
    let none = std::collections::BTreeSet::new();
    let in_domain = ["raw".to_owned()].into();
    let gone = handler::hotplug::unmount_unused(&w.launcher(), dir, &none, &in_domain).unwrap();
    assert_eq!(gone, handler::hotplug::Unmounted::default());
    let gone = handler::hotplug::unmount_unused(&w.launcher(), dir, &none, &none).unwrap();
    assert_eq!(gone.volumes, ["raw"]);
    assert_eq!(gone.block, [(7, 7)]);
    assert!(!in_launcher.join("raw").exists());
}
