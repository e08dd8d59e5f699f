//! Pod detection, namespace entry and safe paths on this machine's real kernel (root).

mod support;

use std::io::Read;
use std::os::unix::fs::{MetadataExt, symlink};
use std::path::{Path, PathBuf};

use isolation::{
    IsolationError, MountRoot, NsKind, Process, Resolve, detect_from_pid, detect_from_socket,
};
use nix::fcntl::OFlag;
use nix::mount::{MntFlags, umount2};
use support::{OrphanedSocket, POD_FILE_CONTENT, Pod, TestCgroup};

const KINDS: [NsKind; 5] = [
    NsKind::Pid,
    NsKind::Net,
    NsKind::Mnt,
    NsKind::Uts,
    NsKind::Ipc,
];

fn own_ns_inode(kind: NsKind) -> u64 {
    Process::open(i32::try_from(std::process::id()).unwrap())
        .unwrap()
        .namespace(kind)
        .unwrap()
        .inode
}

fn read_all(mut f: std::fs::File) -> Vec<u8> {
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).unwrap();
    buf
}

#[test]
fn detection_through_the_launcher_socket() {
    let v2 = TestCgroup::new("/sys/fs/cgroup/unified", "pod4f1e/launcher");
    let devices = TestCgroup::new("/sys/fs/cgroup/devices", "pod4f1e/launcher");
    let pod = Pod::spawn();
    v2.add_process(pod.pid);
    devices.add_process(pod.pid);

    let found = detect_from_socket(&pod.socket).unwrap();
    assert_eq!(
        found.pid, pod.pid,
        "SO_PEERCRED gives the host's view of the pid"
    );
    assert_eq!(found.ppid, pod.parent);
    for kind in KINDS {
        let ns = found.namespaces.get(kind);
        assert_eq!(ns.kind, kind);
        assert_ne!(
            ns.inode,
            own_ns_inode(kind),
            "{kind} namespace is the host's"
        );
        let link = std::fs::read_link(format!("/proc/{}/ns/{kind}", pod.pid)).unwrap();
        assert_eq!(link, PathBuf::from(format!("{kind}:[{}]", ns.inode)));
        assert_eq!(
            ns.path,
            PathBuf::from(format!("/proc/{}/ns/{kind}", pod.pid))
        );
    }
    assert_eq!(
        found.mount_root,
        PathBuf::from(format!("/proc/{}/root", pod.pid))
    );
    assert_eq!(found.cgroups.unified.as_deref(), Some(v2.name.as_path()));
    assert_eq!(found.cgroups.v1_path("devices").unwrap(), devices.name);
    assert_eq!(
        found.pod_cgroup.as_deref(),
        Some(v2.name.parent().unwrap()),
        "the pod-level cgroup is the launcher's parent"
    );

    let by_pid = detect_from_pid(pod.pid).unwrap();
    assert_eq!(by_pid.namespaces, found.namespaces);
    assert_eq!(by_pid.cgroups, found.cgroups);
}

#[test]
fn files_in_the_pod_mount_namespace_are_reached_through_its_root() {
    let pod = Pod::spawn();
    let found = detect_from_pid(pod.pid).unwrap();
    let inside = pod.dir.path().join("podfs/hello");
    assert!(!inside.exists(), "the pod's tmpfs leaked to the host");

    let root = found.open_mount_root().unwrap();
    for how in [Resolve::InRoot, Resolve::Beneath] {
        let file = root.open_file(&inside, how, OFlag::O_RDONLY).unwrap();
        assert_eq!(read_all(file), POD_FILE_CONTENT);
    }
    let handle = root.resolve(&inside, Resolve::InRoot).unwrap();
    assert_eq!(
        read_all(handle.open(OFlag::O_RDONLY).unwrap()),
        POD_FILE_CONTENT
    );
}

#[test]
fn a_symlink_planted_in_the_pod_cannot_lead_out() {
    let pod = Pod::spawn();
    let host_secret = pod.dir.path().join("host-secret");
    std::fs::write(&host_secret, "host only").unwrap();
    let podfs = pod.dir.path().join("podfs");
    // The pod plants links in its own filesystem (we write through its root).
    let through_root = |p: &Path| {
        PathBuf::from(format!("/proc/{}/root", pod.pid)).join(p.strip_prefix("/").unwrap())
    };
    symlink(&host_secret, through_root(&podfs.join("abs"))).unwrap();
    symlink(
        "../../../../../../../../..",
        through_root(&podfs.join("up")),
    )
    .unwrap();

    let root = detect_from_pid(pod.pid).unwrap().open_mount_root().unwrap();
    // This stand-in pod shares the host's root filesystem (only its tmpfs is private), so
    // its `/` is the host's and an absolute link legitimately reaches host paths in-root.
    // What must hold: `..` stops at the pod's root, and Beneath refuses both links.
    let up = root
        .resolve(&podfs.join("up"), Resolve::InRoot)
        .unwrap()
        .metadata()
        .unwrap();
    let pod_root = std::fs::metadata(format!("/proc/{}/root/", pod.pid)).unwrap();
    assert_eq!((up.st_dev, up.st_ino), (pod_root.dev(), pod_root.ino()));

    for link in ["abs", "up"] {
        let err = root
            .resolve(&podfs.join(link).join("etc"), Resolve::Beneath)
            .unwrap_err();
        assert!(
            matches!(err, IsolationError::PathEscapesRoot { .. }),
            "{link}: {err}"
        );
    }
}

#[test]
fn a_closure_in_the_pod_network_namespace_sees_its_interfaces() {
    let pod = Pod::spawn();
    let found = detect_from_pid(pod.pid).unwrap();
    let names = |list: nix::net::if_::Interfaces| -> Vec<String> {
        list.iter()
            .map(|i| i.name().to_string_lossy().into_owned())
            .collect()
    };
    let inside = found
        .run_in_namespace(NsKind::Net, || {
            // A child process inherits the namespaces of the thread that starts it. (This
            // kernel has no dummy links; a veth pair serves as well.)
            let status = std::process::Command::new("ip")
                .args([
                    "link",
                    "add",
                    "kvrs-veth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "kvrs-veth1",
                ])
                .status()
                .unwrap();
            assert!(status.success());
            names(nix::net::if_::if_nameindex().unwrap())
        })
        .unwrap();
    let host = names(nix::net::if_::if_nameindex().unwrap());
    let mut sorted = inside.clone();
    sorted.sort();
    assert_eq!(sorted, ["kvrs-veth0", "kvrs-veth1", "lo"]);
    assert!(!host.iter().any(|h| h.starts_with("kvrs-veth")), "{host:?}");
    assert!(
        host.iter().any(|h| h != "lo"),
        "the host has interfaces of its own: {host:?}"
    );
}

#[test]
fn a_closure_in_the_pod_mount_namespace_sees_its_mounts_and_can_bind_mount() {
    let pod = Pod::spawn();
    let found = detect_from_pid(pod.pid).unwrap();
    let podfs = pod.dir.path().join("podfs");
    let target = podfs.join("target");
    std::fs::write(
        PathBuf::from(format!("/proc/{}/root", pod.pid)).join(target.strip_prefix("/").unwrap()),
        "",
    )
    .unwrap();
    let hello = podfs.join("hello");
    let (content, mounted) = found
        .run_in_namespace(NsKind::Mnt, || {
            let content = std::fs::read(&hello).unwrap();
            let root = MountRoot::open(Path::new("/")).unwrap();
            let src = root.resolve(&hello, Resolve::InRoot).unwrap();
            let dst = root.resolve(&target, Resolve::InRoot).unwrap();
            src.bind_mount_onto(&dst).unwrap();
            (content, std::fs::read(&target).unwrap())
        })
        .unwrap();
    assert_eq!(content, POD_FILE_CONTENT);
    assert_eq!(mounted, POD_FILE_CONTENT);
    assert!(
        !hello.exists(),
        "this thread is still in the host mount namespace"
    );
    // The mount lives in the pod's namespace: seen through its root, not on the host.
    let via_root =
        PathBuf::from(format!("/proc/{}/root", pod.pid)).join(target.strip_prefix("/").unwrap());
    assert_eq!(std::fs::read(via_root).unwrap(), POD_FILE_CONTENT);
}

#[test]
fn closures_return_values_and_panics_become_errors() {
    let pod = Pod::spawn();
    let found = detect_from_pid(pod.pid).unwrap();
    let borrowed = String::from("borrowed from the caller");
    let got = found
        .run_in_namespace(NsKind::Uts, || borrowed.len())
        .unwrap();
    assert_eq!(got, borrowed.len());
    let err = found
        .run_in_namespace(NsKind::Net, || -> () { panic!("boom in the pod") })
        .unwrap_err();
    assert!(
        matches!(&err, IsolationError::Panicked { kind: NsKind::Net, message, .. } if message == "boom in the pod"),
        "{err}"
    );
}

#[test]
fn a_namespace_changed_since_detection_is_not_entered() {
    let mut pod = Pod::spawn();
    let found = detect_from_pid(pod.pid).unwrap();
    pod.unshare_net();
    let err = found.run_in_namespace(NsKind::Net, || ()).unwrap_err();
    assert!(
        matches!(err, IsolationError::NamespaceChanged { kind: NsKind::Net, detected, current, .. }
            if detected == found.namespaces.net.inode && current != detected),
        "{err}"
    );
    // The other namespaces are unchanged and still enterable; a fresh detection sees the
    // new one.
    found.run_in_namespace(NsKind::Uts, || ()).unwrap();
    let again = detect_from_pid(pod.pid).unwrap();
    assert_ne!(again.namespaces.net.inode, found.namespaces.net.inode);
    again.run_in_namespace(NsKind::Net, || ()).unwrap();
}

#[test]
fn a_socket_nobody_listens_on_has_no_peer() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let err = detect_from_socket(&socket).unwrap_err();
    assert!(matches!(err, IsolationError::NoPeer { .. }), "{err}");
    assert!(err.to_string().contains("stale.sock"), "{err}");

    let err = detect_from_socket(&dir.path().join("missing.sock")).unwrap_err();
    assert!(
        matches!(&err, IsolationError::Connect { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{err}"
    );
}

#[test]
fn a_pods_socket_planted_as_a_symlink_cannot_name_another_process() {
    // The node's socket, served by this process (as the container runtime's would be).
    let node = tempfile::tempdir().unwrap();
    let node_socket = node.path().join("runtime.sock");
    let _node_listener = std::os::unix::net::UnixListener::bind(&node_socket).unwrap();
    // The pod's emptyDir: the directory is the node's, the names in it the pod's.
    let sockets = node
        .path()
        .join("pods/uid/volumes/kubernetes.io~empty-dir/sockets");
    std::fs::create_dir_all(&sockets).unwrap();
    let launcher = sockets.join("launcher-sock");
    for target in [
        node_socket.clone(),
        PathBuf::from("../../../../../runtime.sock"),
    ] {
        let _ = std::fs::remove_file(&launcher);
        symlink(&target, &launcher).unwrap();
        let err = detect_from_socket(&launcher).unwrap_err();
        assert!(
            matches!(err, IsolationError::PathEscapesRoot { .. }),
            "{} -> {}: {err}",
            launcher.display(),
            target.display()
        );
    }
    // A link within the directory stays the pod's business.
    std::fs::remove_file(&launcher).unwrap();
    let own = sockets.join("own.sock");
    let _own_listener = std::os::unix::net::UnixListener::bind(&own).unwrap();
    symlink("own.sock", &launcher).unwrap();
    let found = detect_from_socket(&launcher).unwrap();
    assert_eq!(found.pid, i32::try_from(std::process::id()).unwrap());
}

#[test]
fn a_socket_whose_listener_exited_names_a_gone_process() {
    let orphan = OrphanedSocket::spawn();
    let err = detect_from_socket(&orphan.socket).unwrap_err();
    assert!(
        matches!(err, IsolationError::PidGone { pid } if pid == orphan.listener),
        "{err}"
    );
}

#[test]
fn a_process_that_is_gone_is_reported_as_gone() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = i32::try_from(child.id()).unwrap();
    child.wait().unwrap();
    let err = detect_from_pid(pid).unwrap_err();
    assert!(
        matches!(err, IsolationError::PidGone { pid: p } if p == pid),
        "{err}"
    );
}

#[test]
fn a_zombie_is_gone() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = i32::try_from(child.id()).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap()
        .contains(") Z")
    {
        assert!(std::time::Instant::now() < deadline, "child never exited");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let err = detect_from_pid(pid).unwrap_err();
    assert!(matches!(err, IsolationError::PidGone { .. }), "{err}");
    child.wait().unwrap();
}

#[test]
fn a_process_exiting_after_it_was_opened_is_gone() {
    let mut child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let process = Process::open(i32::try_from(child.id()).unwrap()).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    // The pid may even be handed to a new process by now: the handle still refers to the
    // old one, so nothing is read from a stranger.
    for result in [
        process.detect().map(drop),
        process.namespace(NsKind::Net).map(drop),
        process.mount_root().map(drop),
    ] {
        assert!(
            matches!(result, Err(IsolationError::PidGone { .. })),
            "{result:?}"
        );
    }
}

#[test]
fn processes_exiting_during_detection_are_gone_never_half_detected() {
    for i in 0..40u64 {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let killer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_micros(i * 25));
            child.kill().unwrap();
            child.wait().unwrap();
        });
        match detect_from_pid(pid) {
            Ok(found) => assert_eq!(found.pid, pid),
            Err(IsolationError::PidGone { .. }) => {}
            Err(e) => panic!("iteration {i}: {e:?}"),
        }
        killer.join().unwrap();
    }
}

/// Runs `f` on a thread whose own credentials are an unprivileged user's (raw setresuid
/// changes only the calling thread, unlike libc's, which changes them all).
fn as_nobody<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: changes this thread's credentials only; the thread ends after `f`.
            let ret = unsafe { libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534) };
            assert_eq!(ret, 0, "setresuid: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap()
    })
}

#[test]
fn namespaces_of_a_process_we_may_not_trace_are_inaccessible() {
    let pod = Pod::spawn();
    let found = detect_from_pid(pod.pid).unwrap();
    let err = as_nobody(|| detect_from_pid(pod.pid)).unwrap_err();
    assert!(
        matches!(
            err,
            IsolationError::NamespaceInaccessible {
                kind: NsKind::Pid,
                ..
            }
        ),
        "{err}"
    );
    let err = as_nobody(|| found.run_in_namespace(NsKind::Net, || ())).unwrap_err();
    assert!(
        matches!(
            err,
            IsolationError::NamespaceInaccessible {
                kind: NsKind::Net,
                ..
            }
        ),
        "{err}"
    );
}

/// A root directory with a file in it and a host file next to it that must stay out of
/// reach.
struct Sandbox {
    _outer: tempfile::TempDir,
    root: PathBuf,
    secret: PathBuf,
}

impl Sandbox {
    fn new() -> Self {
        let outer = tempfile::tempdir().unwrap();
        let root = outer.path().join("root");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/file"), "inside").unwrap();
        let secret = outer.path().join("secret");
        std::fs::write(&secret, "outside").unwrap();
        Self {
            _outer: outer,
            root,
            secret,
        }
    }

    fn mount_root(&self) -> MountRoot {
        MountRoot::open(&self.root).unwrap()
    }
}

#[test]
fn resolution_stays_inside_the_root() {
    let sb = Sandbox::new();
    symlink(&sb.secret, sb.root.join("abs")).unwrap();
    symlink("../secret", sb.root.join("rel")).unwrap();
    symlink("/a/b/file", sb.root.join("abs-inside")).unwrap();
    let root = sb.mount_root();

    for path in ["a/b/file", "/a/b/file", "a/../a/b/file"] {
        for how in [Resolve::InRoot, Resolve::Beneath] {
            let f = root
                .open_file(Path::new(path), how, OFlag::O_RDONLY)
                .unwrap();
            assert_eq!(read_all(f), b"inside", "{path} {how:?}");
        }
    }
    // Absolute links inside the root mean the root's own paths when taken as a chroot...
    let f = root
        .open_file(Path::new("abs-inside"), Resolve::InRoot, OFlag::O_RDONLY)
        .unwrap();
    assert_eq!(read_all(f), b"inside");

    for path in ["abs", "rel", "../secret", "a/../../secret", "abs-inside"] {
        // ...and are refused outright with Beneath.
        let err = root.resolve(Path::new(path), Resolve::Beneath).unwrap_err();
        assert!(
            matches!(&err, IsolationError::PathEscapesRoot { path: p, .. } if p == Path::new(path)),
            "{path}: {err}"
        );
        if path == "abs-inside" {
            continue;
        }
        // In-root, the same walks end inside the root, where there is no secret.
        let err = root.resolve(Path::new(path), Resolve::InRoot).unwrap_err();
        assert!(
            matches!(&err, IsolationError::Path { source, .. } if source.raw_os_error() == Some(libc::ENOENT)),
            "{path}: {err}"
        );
    }
    // Planting a decoy inside makes the clamped `..` walks land on it, never on the host
    // file; the absolute link still means <root>/<host path>, which does not exist.
    std::fs::write(sb.root.join("secret"), "decoy").unwrap();
    for path in ["rel", "../secret", "a/../../secret"] {
        let f = root.open_file(Path::new(path), Resolve::InRoot, OFlag::O_RDONLY);
        assert_eq!(read_all(f.unwrap()), b"decoy", "{path}");
    }
    assert!(root.resolve(Path::new("abs"), Resolve::InRoot).is_err());
    assert_eq!(root.path(), sb.root);
}

#[test]
fn magic_links_are_refused() {
    let root = MountRoot::open(Path::new("/")).unwrap();
    let err = root
        .resolve(Path::new("/proc/self/root/etc"), Resolve::InRoot)
        .unwrap_err();
    assert!(
        matches!(&err, IsolationError::Path { source, .. } if source.raw_os_error() == Some(libc::ELOOP)),
        "{err}"
    );
}

#[test]
fn create_open_chown_through_handles() {
    let sb = Sandbox::new();
    symlink("../created-outside", sb.root.join("dangling")).unwrap();
    let root = sb.mount_root();

    // A dangling symlink at the last component is not followed into creating a file
    // outside.
    let err = root
        .create_file(Path::new("dangling"), Resolve::InRoot, 0o600)
        .unwrap_err();
    assert!(
        matches!(&err, IsolationError::Path { source, .. } if source.raw_os_error() == Some(libc::EEXIST)),
        "{err}"
    );
    assert!(!sb.root.parent().unwrap().join("created-outside").exists());

    let mut f = root
        .create_file(Path::new("/a/new"), Resolve::Beneath, 0o640)
        .unwrap();
    std::io::Write::write_all(&mut f, b"fresh").unwrap();
    assert_eq!(std::fs::read(sb.root.join("a/new")).unwrap(), b"fresh");

    let dir = root
        .create_dir(Path::new("a/dir"), Resolve::InRoot, 0o750)
        .unwrap();
    dir.chown(Some(107), Some(108)).unwrap();
    let meta = dir.metadata().unwrap();
    assert_eq!((meta.st_uid, meta.st_gid), (107, 108));
    assert_eq!(meta.st_mode & 0o7777, 0o750 & !current_umask());
    assert_eq!(dir.path(), Path::new("a/dir"));

    let err = root
        .create_dir(Path::new("a/.."), Resolve::InRoot, 0o750)
        .unwrap_err();
    assert!(matches!(err, IsolationError::Path { .. }), "{err}");
    let err = root
        .create_dir(Path::new("abs-missing/x"), Resolve::InRoot, 0o750)
        .unwrap_err();
    assert!(err.to_string().contains("abs-missing/x"), "{err}");
}

#[test]
fn device_nodes_are_made_and_files_removed_through_handles() {
    let sb = Sandbox::new();
    let outside = sb.root.parent().unwrap().join("outside-dir");
    std::fs::create_dir(&outside).unwrap();
    symlink(&outside, sb.root.join("escape")).unwrap();
    symlink(&sb.secret, sb.root.join("link-to-secret")).unwrap();
    let root = sb.mount_root();
    // /dev/loop0's numbers: a node needs no device behind it.
    let rdev = nix::sys::stat::makedev(7, 0);

    let node = root
        .create_block_device(Path::new("a/disk"), Resolve::InRoot, 0o660, rdev)
        .unwrap();
    node.chown(Some(107), Some(107)).unwrap();
    let st = root
        .stat_no_follow(Path::new("a/disk"), Resolve::InRoot)
        .unwrap();
    assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFBLK);
    assert_eq!((st.st_rdev, st.st_uid, st.st_gid), (rdev, 107, 107));
    // An existing name is not overwritten.
    let err = root
        .create_block_device(Path::new("a/disk"), Resolve::InRoot, 0o660, rdev)
        .unwrap_err();
    assert!(
        matches!(&err, IsolationError::Path { source, .. } if source.raw_os_error() == Some(libc::EEXIST)),
        "{err}"
    );
    // A parent that is a symlink out of the root is followed in the root, where the
    // directory does not exist: nothing is made outside.
    let err = root
        .create_block_device(Path::new("escape/disk"), Resolve::InRoot, 0o660, rdev)
        .unwrap_err();
    assert!(err.to_string().contains("escape/disk"), "{err}");
    assert!(std::fs::read_dir(&outside).unwrap().next().is_none());

    // A symlink is stat'ed and removed itself; its target stays.
    let st = root
        .stat_no_follow(Path::new("link-to-secret"), Resolve::InRoot)
        .unwrap();
    assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFLNK);
    root.remove_file(Path::new("link-to-secret"), Resolve::InRoot)
        .unwrap();
    assert_eq!(std::fs::read(&sb.secret).unwrap(), b"outside");
    root.remove_file(Path::new("a/disk"), Resolve::InRoot)
        .unwrap();
    assert!(!sb.root.join("a/disk").exists());
    let err = root
        .remove_file(Path::new("a/b"), Resolve::InRoot)
        .unwrap_err();
    assert!(
        matches!(&err, IsolationError::Path { source, .. } if source.raw_os_error() == Some(libc::EISDIR)),
        "{err}"
    );
}

fn current_umask() -> u32 {
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    nix::sys::stat::umask(old);
    old.bits()
}

/// Unmounts on drop, whatever the test did.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = umount2(&self.0, MntFlags::MNT_DETACH);
    }
}

#[test]
fn bind_mount_through_handles() {
    let sb = Sandbox::new();
    std::fs::write(sb.root.join("target"), "").unwrap();
    std::fs::create_dir(sb.root.join("target-dir")).unwrap();
    let root = sb.mount_root();
    let src = root
        .resolve(Path::new("a/b/file"), Resolve::Beneath)
        .unwrap();
    let dst = root.resolve(Path::new("target"), Resolve::Beneath).unwrap();
    src.bind_mount_onto(&dst).unwrap();
    let _guard = Unmount(sb.root.join("target"));
    assert_eq!(std::fs::read(sb.root.join("target")).unwrap(), b"inside");

    let src_dir = root.resolve(Path::new("a"), Resolve::Beneath).unwrap();
    let dst_dir = root
        .resolve(Path::new("target-dir"), Resolve::Beneath)
        .unwrap();
    src_dir.bind_mount_onto(&dst_dir).unwrap();
    let _guard_dir = Unmount(sb.root.join("target-dir"));
    assert_eq!(
        std::fs::read(sb.root.join("target-dir/b/file")).unwrap(),
        b"inside"
    );

    // A directory cannot be mounted onto a file: the error names both ends.
    let err = src_dir.bind_mount_onto(&src).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, IsolationError::Mount { .. }), "{text}");
    assert!(
        text.contains("a/b/file") && text.contains("root/a"),
        "{text}"
    );
}
