//! containerDisk and kernelBoot files, made visible read-only inside the launcher.
//!
//! A containerDisk volume is an image whose root filesystem holds a disk file. The launcher
//! pod runs one container per such image (the controller renders them), whose only process is
//! the `container-disk` program serving `<container-disk dir>/disk_<volume index>.sock`; the
//! kernelBoot image's container serves `kernel-boot.sock` the same way. For each socket
//! virt-handler asks the kernel which process listens (SO_PEERCRED), finds the image file in
//! that process's root, and bind-mounts it read-only onto `disk_<index>.img` (or
//! `kernel-boot/<file name>`) in the launcher's mount namespace, where the launcher expects it.
//!
//! [`plan`] is the pure part: which files a VMI needs, from which socket, onto which target.
//! [`prepare`] and [`cleanup`] are the thin shell. Every path inside a pod is resolved with
//! `openat2` through the `isolation` crate, so symlinks planted by a pod cannot lead the
//! handler to a host file; sockets are connected through the descriptor that was resolved,
//! never by walking the path again.
//!
//! The kernel only clones a mount that belongs to the caller's mount namespace and only
//! attaches one inside it, so the image's mount is cloned from within the container-disk
//! process's namespace and attached from within the launcher's. The result lives only in the
//! launcher's mount namespace: nothing appears on the host, and the mounts go away with the
//! pod even if virt-handler is not running then.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use api::VirtualMachineInstance;
use isolation::{IsolationError, MountRoot, NsKind, PodIsolation, Resolve, SafePath};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::MntFlags;
use nix::sys::stat::SFlag;

/// KubeVirt's default `--container-disk-dir` of the launcher.
pub const DEFAULT_CONTAINER_DISK_DIR: &str = "/var/run/kubevirt/container-disks";
/// KubeVirt's `containerdisk.KernelBootName`: the socket's and the target directory's name.
pub const KERNEL_BOOT_NAME: &str = "kernel-boot";
/// Where a containerDisk image keeps its disk when `path` is not set (KubeVirt's
/// `DiskSourceFallbackPath`): the directory must hold exactly one entry.
pub const DISK_SOURCE_FALLBACK_DIR: &str = "/disk";

/// How many stacked mounts [`cleanup`] takes off one target before it gives up.
const MAX_STACKED_MOUNTS: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountConfig {
    /// The launcher's `--container-disk-dir`, as the launcher sees it.
    pub container_disk_dir: PathBuf,
    /// The launcher's `--hotplug-disk-dir`, as the launcher sees it.
    pub hotplug_disk_dir: PathBuf,
}

impl Default for MountConfig {
    fn default() -> Self {
        Self {
            container_disk_dir: PathBuf::from(DEFAULT_CONTAINER_DISK_DIR),
            hotplug_disk_dir: PathBuf::from(crate::hotplug::DEFAULT_HOTPLUG_DISK_DIR),
        }
    }
}

/// Where the file is found inside the image's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// The one entry of [`DISK_SOURCE_FALLBACK_DIR`].
    OnlyFileInDiskDir,
    /// A path in the image (`containerDisk.path`, `kernelPath`, `initrdPath`).
    Path(PathBuf),
}

/// One file to bind-mount read-only into the launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedMount {
    /// The VMI field asking for it, for messages: `spec.volumes[2]` or
    /// `spec.domain.firmware.kernelBoot.container.kernelPath`.
    pub field: String,
    /// The socket's file name in the container-disk dir: `disk_<index>.sock` or
    /// `kernel-boot.sock`.
    pub socket: String,
    pub source: ImageSource,
    /// The target relative to the container-disk dir: `disk_<index>.img` or
    /// `kernel-boot/<file name>`.
    pub target: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// Every file is in place. `mounted` lists the targets (launcher view) this call
    /// mounted; files already correctly mounted are left alone and listed in `present`.
    Ready {
        mounted: Vec<PathBuf>,
        present: Vec<PathBuf>,
    },
    /// A container's socket is not there yet, or nobody listens on it (the container is
    /// starting or restarting). Nothing is wrong; try again later.
    NotReady {
        field: String,
        socket: PathBuf,
        reason: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{field}: {message}")]
    Spec { field: String, message: String },
    #[error("{field}: {socket} in the launcher is not a socket")]
    NotASocket { field: String, socket: PathBuf },
    #[error("{field}: the image of container process {pid}: {message}")]
    Image {
        field: String,
        pid: i32,
        message: String,
    },
    #[error("{field}: the target {target} in the launcher is not a regular file")]
    BadTarget { field: String, target: PathBuf },
    #[error("{field}")]
    Isolation {
        field: String,
        #[source]
        source: Box<IsolationError>,
    },
    #[error("{field}: {op} {path}")]
    Sys {
        field: String,
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl MountError {
    pub(crate) fn iso(field: &str) -> impl FnOnce(IsolationError) -> MountError + '_ {
        move |source| MountError::Isolation {
            field: field.to_owned(),
            source: Box::new(source),
        }
    }
}

/// The files `vmi` needs, in volume order, then the kernelBoot files. Pure.
pub fn plan(vmi: &VirtualMachineInstance) -> Result<Vec<PlannedMount>, MountError> {
    let mut out = Vec::new();
    for (index, v) in vmi.spec.volumes.iter().enumerate() {
        let Some(cd) = &v.container_disk else {
            continue;
        };
        let field = format!("spec.volumes[{index}] ({})", v.name);
        let source = match cd.path.as_deref() {
            None | Some("") => ImageSource::OnlyFileInDiskDir,
            Some(p) => ImageSource::Path(image_path(p, &format!("{field}.containerDisk.path"))?),
        };
        out.push(PlannedMount {
            field,
            socket: format!("disk_{index}.sock"),
            source,
            target: PathBuf::from(format!("disk_{index}.img")),
        });
    }
    if let Some(c) = vmi.spec.kernel_boot().and_then(|k| k.container.as_ref()) {
        for (what, p) in [
            ("kernelPath", &c.kernel_path),
            ("initrdPath", &c.initrd_path),
        ] {
            let Some(p) = p.as_deref().filter(|p| !p.is_empty()) else {
                continue;
            };
            let field = format!("spec.domain.firmware.kernelBoot.container.{what}");
            let path = image_path(p, &field)?;
            // The launcher looks for the file's base name (KubeVirt's
            // GetKernelBootArtifactPathFromLauncherView).
            let name = path.file_name().ok_or_else(|| MountError::Spec {
                field: field.clone(),
                message: format!("{p:?} names no file"),
            })?;
            out.push(PlannedMount {
                field,
                socket: format!("{KERNEL_BOOT_NAME}.sock"),
                source: ImageSource::Path(path.clone()),
                target: Path::new(KERNEL_BOOT_NAME).join(name),
            });
        }
    }
    Ok(out)
}

/// A path inside an image: absolute (relative ones are taken from the image's `/`, as
/// KubeVirt does), naming a file.
fn image_path(p: &str, field: &str) -> Result<PathBuf, MountError> {
    let path = Path::new("/").join(p);
    if path.file_name().is_none() {
        return Err(MountError::Spec {
            field: field.to_owned(),
            message: format!("{p:?} names no file"),
        });
    }
    Ok(path)
}

/// Mounts every file `vmi` needs into the launcher `launcher` (detected from its command
/// socket). Idempotent: a target already holding the right file read-only is left alone; a
/// target holding anything else (a restarted image container's old mount) is unmounted
/// and mounted again.
///
/// Blocking: it starts threads to enter namespaces. Call it from `spawn_blocking`.
pub fn prepare(
    vmi: &VirtualMachineInstance,
    launcher: &PodIsolation,
    cfg: &MountConfig,
) -> Result<Prepared, MountError> {
    let planned = plan(vmi)?;
    let mut mounted = Vec::new();
    let mut present = Vec::new();
    if planned.is_empty() {
        return Ok(Prepared::Ready { mounted, present });
    }
    let root = launcher
        .open_mount_root()
        .map_err(MountError::iso("the launcher's root"))?;
    let mut peers: BTreeMap<&str, PodIsolation> = BTreeMap::new();
    for m in &planned {
        let socket = cfg.container_disk_dir.join(&m.socket);
        if !peers.contains_key(m.socket.as_str()) {
            match socket_peer(&root, &socket, &m.field)? {
                Ok(p) => {
                    peers.insert(&m.socket, p);
                }
                Err(reason) => {
                    return Ok(Prepared::NotReady {
                        field: m.field.clone(),
                        socket,
                        reason,
                    });
                }
            }
        }
        let target = cfg.container_disk_dir.join(&m.target);
        if mount_one(m, &peers[m.socket.as_str()], launcher, &root, &target)? {
            mounted.push(target);
        } else {
            present.push(target);
        }
    }
    Ok(Prepared::Ready { mounted, present })
}

/// The process serving `socket` in the launcher, or why there is none yet.
fn socket_peer(
    root: &MountRoot,
    socket: &Path,
    field: &str,
) -> Result<Result<PodIsolation, String>, MountError> {
    let sock = match root.resolve(socket, Resolve::InRoot) {
        Ok(s) => s,
        Err(IsolationError::Path { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            return Ok(Err(format!("{} does not exist yet", socket.display())));
        }
        Err(e) => return Err(MountError::iso(field)(e)),
    };
    let kind = sock.metadata().map_err(MountError::iso(field))?.st_mode & SFlag::S_IFMT.bits();
    if kind != SFlag::S_IFSOCK.bits() {
        return Err(MountError::NotASocket {
            field: field.to_owned(),
            socket: socket.to_owned(),
        });
    }
    // Connecting through the descriptor reaches exactly the resolved socket inode; the path
    // itself could be swapped for a symlink to a host socket.
    match isolation::detect_from_resolved_socket(&sock) {
        Ok(p) => Ok(Ok(p)),
        Err(IsolationError::NoPeer { .. }) => {
            Ok(Err(format!("nobody listens on {} yet", socket.display())))
        }
        Err(IsolationError::PidGone { pid }) => Ok(Err(format!(
            "the process {pid} serving {} exited",
            socket.display()
        ))),
        Err(e) => Err(MountError::iso(field)(e)),
    }
}

/// Mounts one file; `false` when it was already in place.
fn mount_one(
    m: &PlannedMount,
    peer: &PodIsolation,
    launcher: &PodIsolation,
    root: &MountRoot,
    target: &Path,
) -> Result<bool, MountError> {
    let field = m.field.as_str();
    let image_root = peer.open_mount_root().map_err(MountError::iso(field))?;
    let source = find_image(&image_root, &m.source, peer.pid, field)?;
    attach(&source, peer, launcher, root, target, field, true)
}

/// Bind-mounts `source`, a file of `peer`'s mount namespace, onto `target` in the launcher's
/// (read-only if asked); `false` when it was already there. A target holding another mount
/// (a restarted container's old one) has it replaced.
pub(crate) fn attach(
    source: &SafePath,
    peer: &PodIsolation,
    launcher: &PodIsolation,
    root: &MountRoot,
    target: &Path,
    field: &str,
    read_only_mount: bool,
) -> Result<bool, MountError> {
    let dest = ensure_target(root, target, field)?;
    let src_stat = source.metadata().map_err(MountError::iso(field))?;
    let dst_stat = dest.metadata().map_err(MountError::iso(field))?;
    let same = (src_stat.st_dev, src_stat.st_ino) == (dst_stat.st_dev, dst_stat.st_ino);
    if same && read_only(&dest, field)? == read_only_mount {
        return Ok(false);
    }
    if is_mount_root(&dest, field)? {
        tracing::info!(target = %target.display(), "replacing a stale mount");
        unmount_all(launcher, root, target, field)?;
    }
    // Re-resolve: the handle taken before unmounting may name the old mount's file.
    let dest = ensure_target(root, target, field)?;
    let tree = peer
        .run_in_namespace(NsKind::Mnt, || source.clone_mount())
        .and_then(|r| r)
        .map_err(MountError::iso(field))?;
    if read_only_mount {
        tree.make_read_only().map_err(MountError::iso(field))?;
    }
    launcher
        .run_in_namespace(NsKind::Mnt, move || tree.attach_onto(&dest))
        .and_then(|r| r)
        .map_err(MountError::iso(field))?;
    tracing::info!(target = %target.display(), pid = peer.pid, read_only = read_only_mount, "mounted");
    Ok(true)
}

/// The image file inside its container's root, following KubeVirt's rules.
fn find_image(
    root: &MountRoot,
    source: &ImageSource,
    pid: i32,
    field: &str,
) -> Result<SafePath, MountError> {
    let image_err = |message: String| MountError::Image {
        field: field.to_owned(),
        pid,
        message,
    };
    let path = match source {
        ImageSource::Path(p) => p.clone(),
        ImageSource::OnlyFileInDiskDir => {
            let dir = root
                .open_file(
                    Path::new(DISK_SOURCE_FALLBACK_DIR),
                    Resolve::InRoot,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                )
                .map_err(|e| image_err(format!("no {DISK_SOURCE_FALLBACK_DIR} directory: {e}")))?;
            let names = entries(OwnedFd::from(dir))
                .map_err(|e| image_err(format!("reading {DISK_SOURCE_FALLBACK_DIR}: {e}")))?;
            match names.as_slice() {
                [one] => Path::new(DISK_SOURCE_FALLBACK_DIR).join(one),
                [] => {
                    return Err(image_err(format!(
                        "{DISK_SOURCE_FALLBACK_DIR} is empty: no disk present"
                    )));
                }
                _ => {
                    return Err(image_err(format!(
                        "{DISK_SOURCE_FALLBACK_DIR} holds {} entries; only one disk is allowed \
                         (or set containerDisk.path)",
                        names.len()
                    )));
                }
            }
        }
    };
    let file = root
        .resolve(&path, Resolve::InRoot)
        .map_err(|e| image_err(format!("{}: {e}", path.display())))?;
    let mode = file.metadata().map_err(MountError::iso(field))?.st_mode;
    if mode & SFlag::S_IFMT.bits() != SFlag::S_IFREG.bits() {
        return Err(image_err(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    Ok(file)
}

pub(crate) fn entries(dir: OwnedFd) -> nix::Result<Vec<OsString>> {
    let mut d = nix::dir::Dir::from_fd(dir)?;
    let mut out = Vec::new();
    for e in d.iter() {
        let name = e?.file_name().to_bytes().to_owned();
        if name != b"." && name != b".." {
            out.push(std::ffi::OsStr::from_bytes(&name).to_owned());
        }
    }
    Ok(out)
}

/// Creates the target file (and `kernel-boot/`) if missing and returns a handle to it. The
/// last component must be the file itself, not a symlink: its handle is compared with one
/// opened without following links.
fn ensure_target(root: &MountRoot, target: &Path, field: &str) -> Result<SafePath, MountError> {
    if let Some(parent) = target.parent() {
        match root.create_dir(parent, Resolve::InRoot, 0o755) {
            Ok(_) => {}
            Err(IsolationError::Path { source, .. })
                if source.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(MountError::iso(field)(e)),
        }
    }
    match root.create_file(target, Resolve::InRoot, 0o644) {
        Ok(_) => {}
        Err(IsolationError::Path { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {
        }
        Err(e) => return Err(MountError::iso(field)(e)),
    }
    let bad = || MountError::BadTarget {
        field: field.to_owned(),
        target: target.to_owned(),
    };
    let own = root
        .stat_no_follow(target, Resolve::InRoot)
        .map_err(MountError::iso(field))?;
    if own.st_mode & SFlag::S_IFMT.bits() != SFlag::S_IFREG.bits() {
        return Err(bad());
    }
    let dest = root
        .resolve(target, Resolve::InRoot)
        .map_err(MountError::iso(field))?;
    let st = dest.metadata().map_err(MountError::iso(field))?;
    // Swapped for a link between the two opens: not the file just checked.
    if (own.st_dev, own.st_ino) != (st.st_dev, st.st_ino) {
        return Err(bad());
    }
    Ok(dest)
}

fn sys(field: &str, op: &'static str, path: &Path, e: Errno) -> MountError {
    MountError::Sys {
        field: field.to_owned(),
        op,
        path: path.to_owned(),
        source: e.into(),
    }
}

fn read_only(p: &SafePath, field: &str) -> Result<bool, MountError> {
    let st = nix::sys::statvfs::fstatvfs(p.fd()).map_err(|e| sys(field, "statfs", p.path(), e))?;
    Ok(st.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
}

/// Whether a mount sits on this file (statx `STATX_ATTR_MOUNT_ROOT`, Linux 5.8; nix has no
/// statx).
pub(crate) fn is_mount_root(p: &SafePath, field: &str) -> Result<bool, MountError> {
    use std::os::fd::AsRawFd as _;
    let mut stx = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: a descriptor we hold, an empty C string with AT_EMPTY_PATH, and a buffer of
    // the right type that the kernel fills.
    let ret = unsafe {
        libc::statx(
            p.fd().as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BASIC_STATS,
            stx.as_mut_ptr(),
        )
    };
    Errno::result(ret).map_err(|e| sys(field, "statx", p.path(), e))?;
    // SAFETY: statx succeeded, so the kernel initialised the buffer.
    let stx = unsafe { stx.assume_init() };
    let bit = u64::try_from(libc::STATX_ATTR_MOUNT_ROOT).expect("a positive flag");
    Ok(stx.stx_attributes_mask & bit != 0 && stx.stx_attributes & bit != 0)
}

/// Takes every mount off `target` inside the launcher's mount namespace. umount2 wants a
/// path: the thread moves into the target's directory, through a handle, and names only
/// the last component, without following it.
pub(crate) fn unmount_all(
    launcher: &PodIsolation,
    root: &MountRoot,
    target: &Path,
    field: &str,
) -> Result<usize, MountError> {
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Ok(0);
    };
    let mut count = 0;
    for _ in 0..MAX_STACKED_MOUNTS {
        let file = match root.resolve(target, Resolve::InRoot) {
            Ok(f) => f,
            Err(IsolationError::Path { source, .. })
                if source.raw_os_error() == Some(libc::ENOENT) =>
            {
                return Ok(count);
            }
            Err(e) => return Err(MountError::iso(field)(e)),
        };
        if !is_mount_root(&file, field)? {
            return Ok(count);
        }
        let dir = root
            .resolve(parent, Resolve::InRoot)
            .map_err(MountError::iso(field))?;
        launcher
            .run_in_namespace(NsKind::Mnt, || {
                nix::unistd::fchdir(dir.fd())?;
                nix::mount::umount2(name, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW)
            })
            .map_err(MountError::iso(field))?
            .map_err(|e| sys(field, "unmounting", target, e))?;
        count += 1;
    }
    Ok(count)
}

/// Unmounts every file [`prepare`] mounts for `vmi` from the launcher; returns how many
/// mounts it took off. A launcher that is gone needs nothing: its mounts went with its
/// mount namespace.
pub fn cleanup(
    vmi: &VirtualMachineInstance,
    launcher: &PodIsolation,
    cfg: &MountConfig,
) -> Result<usize, MountError> {
    let planned = plan(vmi)?;
    if planned.is_empty() {
        return Ok(0);
    }
    let root = match launcher.open_mount_root() {
        Ok(r) => r,
        Err(IsolationError::PidGone { .. }) => return Ok(0),
        Err(e) => return Err(MountError::iso("the launcher's root")(e)),
    };
    let mut count = 0;
    for m in &planned {
        let target = cfg.container_disk_dir.join(&m.target);
        match unmount_all(launcher, &root, &target, &m.field) {
            Ok(n) => count += n,
            Err(MountError::Isolation { source, .. })
                if matches!(*source, IsolationError::PidGone { .. }) =>
            {
                return Ok(count);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::json;

    fn vmi(spec: serde_json::Value) -> VirtualMachineInstance {
        let mut v = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default", "uid": "u1"},
        });
        v["spec"] = spec;
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn container_disks_by_volume_index_and_kernel_boot_by_base_name() {
        let v = vmi(json!({
            "domain": {
                "devices": {},
                "firmware": {"kernelBoot": {"container": {
                    "image": "k", "kernelPath": "/boot/vmlinuz", "initrdPath": "boot/initrd.img"}}},
            },
            "volumes": [
                {"name": "ci", "cloudInitNoCloud": {"userData": "x"}},
                {"name": "root", "containerDisk": {"image": "a"}},
                {"name": "data", "containerDisk": {"image": "b", "path": "/custom/data.raw"}},
            ],
        }));
        let p = plan(&v).unwrap();
        let got: Vec<_> = p
            .iter()
            .map(|m| (m.socket.as_str(), &m.source, m.target.to_str().unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                ("disk_1.sock", &ImageSource::OnlyFileInDiskDir, "disk_1.img"),
                (
                    "disk_2.sock",
                    &ImageSource::Path("/custom/data.raw".into()),
                    "disk_2.img"
                ),
                (
                    "kernel-boot.sock",
                    &ImageSource::Path("/boot/vmlinuz".into()),
                    "kernel-boot/vmlinuz"
                ),
                (
                    "kernel-boot.sock",
                    &ImageSource::Path("/boot/initrd.img".into()),
                    "kernel-boot/initrd.img"
                ),
            ]
        );
        assert_eq!(p[0].field, "spec.volumes[1] (root)");
        assert_eq!(
            p[3].field,
            "spec.domain.firmware.kernelBoot.container.initrdPath"
        );
    }

    #[test]
    fn nothing_to_mount_without_container_disks() {
        let v = vmi(json!({"domain": {"devices": {}}, "volumes": [
            {"name": "ci", "cloudInitNoCloud": {"userData": "x"}}]}));
        assert_eq!(plan(&v).unwrap(), []);
        // A kernel boot without a container boots nothing from an image.
        let v = vmi(
            json!({"domain": {"devices": {}, "firmware": {"kernelBoot": {"kernelArgs": "x"}}}}),
        );
        assert_eq!(plan(&v).unwrap(), []);
    }

    #[test]
    fn paths_naming_no_file_are_refused_with_their_field() {
        let v = vmi(
            json!({"domain": {"devices": {}, "firmware": {"kernelBoot": {"container": {
            "image": "k", "kernelPath": "/boot/.."}}}}}),
        );
        let e = plan(&v).unwrap_err().to_string();
        assert!(
            e.contains("kernelBoot.container.kernelPath") && e.contains("names no file"),
            "{e}"
        );
        let v = vmi(json!({"domain": {"devices": {}}, "volumes": [
            {"name": "r", "containerDisk": {"image": "a", "path": "/"}}]}));
        let e = plan(&v).unwrap_err().to_string();
        assert!(e.contains("spec.volumes[0] (r).containerDisk.path"), "{e}");
    }
}
