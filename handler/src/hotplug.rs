//! Hotplugged volumes made visible in the launcher (KubeVirt's `hotplug-disk/mount.go`).
//!
//! virt-controller runs an attachment pod on this node that mounts a file-system claim at
//! `/<volume>` (a block claim is a device of the pod) and whose `container-disk` serves
//! `/path/hp.sock` in its `hotplug-disks` emptyDir. Once the VMI's status names that pod's
//! uid, virt-handler makes the volume visible in the launcher's hotplug dir, where the
//! launcher's plan expects it:
//! - a file-system claim: virt-handler finds the pod's process by the socket (SO_PEERCRED),
//!   takes `/<volume>/disk.img` from its root and bind-mounts it, writable, onto
//!   `<hotplug dir>/<volume>.img` in the launcher's mount namespace;
//! - a block claim (`volumeMode: Block` in the status' claim info): a device node
//!   `<hotplug dir>/<volume>` for the device the kubelet mapped for the attachment pod, owned
//!   by qemu, which the launcher's device rules then allow (KubeVirt's
//!   `mountBlockHotplugVolume`). The device is taken from the kubelet's own record of the pod
//!   (`devices::mapped_block_device`); KubeVirt reads the node the runtime made in the pod's
//!   emptyDir, which the pod could replace.
//!
//! A volume that left the spec is unmounted (its node removed, and its device denied) once
//! the launcher has unplugged it.
//!
//! Deliberate difference from KubeVirt: a filesystem claim without `disk.img` gets one here,
//! sparse, of the claim's capacity less the filesystem overhead, as KubeVirt's launcher does
//! for a cold-plugged claim (`hostdisk.ReplacePVCByHostDisk`). KubeVirt expects CDI to have
//! written it for a hotplug; there is no CDI here, and a blank claim is what users plug.
//!
//! [`plan`] and [`image_size`] are pure; [`mount`] and [`unmount_unused`] are the blocking shell.

use std::collections::BTreeSet;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use api::VirtualMachineInstance;
use api::hotplug::{
    ATTACHMENT_SOCKET, DISK_IMAGE, HOTPLUG_DISKS_VOLUME, PHASE_DETACHING, attach_pod_uid,
};
use isolation::{IsolationError, MountRoot, PodIsolation, Resolve};
use nix::fcntl::OFlag;
use nix::sys::stat::SFlag;

use crate::devices;
use crate::mounts::{self, MountError};

/// KubeVirt's default `--hotplug-disk-dir` of the launcher.
pub const DEFAULT_HOTPLUG_DISK_DIR: &str = "/var/run/kubevirt/hotplug-disks";
/// The qemu user and group, which own the disk images QEMU opens.
const QEMU_ID: u32 = 107;
const MIB: u64 = 1 << 20;

/// One hotplugged volume to mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub volume: String,
    /// The attachment pod serving it.
    pub pod_uid: String,
    /// The size of the image to create when the claim has none.
    pub size: Option<u64>,
    /// A `volumeMode: Block` claim: a device, not an image.
    pub block: bool,
}

/// KubeVirt's hostdisk size of a claim: its capacity less the filesystem overhead, aligned
/// down to 1 MiB. `None` without a capacity.
pub fn image_size(claim_info: &serde_json::Value) -> Option<u64> {
    let capacity = api::quantity::bytes(claim_info["capacity"]["storage"].as_str()?).ok()?;
    let overhead: f64 = claim_info["filesystemOverhead"]
        .as_str()
        .and_then(|o| o.parse().ok())
        .unwrap_or(0.0);
    // Exact enough: capacities are far below 2^52 bytes.
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let usable = (capacity as f64 * (1.0 - overhead.clamp(0.0, 1.0))) as u64;
    Some(usable / MIB * MIB)
}

/// The hotplugged volumes of `vmi` to mount now: in the spec, with a ready attachment pod
/// named in the status, and not being detached.
pub fn plan(vmi: &VirtualMachineInstance) -> Vec<Planned> {
    let in_spec: BTreeSet<&str> = vmi.spec.volumes.iter().map(|v| v.name.as_str()).collect();
    vmi.status
        .iter()
        .flat_map(|s| &s.volume_status)
        .filter(|s| in_spec.contains(s.name.as_str()))
        .filter(|s| s.phase.as_deref() != Some(PHASE_DETACHING))
        .filter_map(|s| {
            let info = s.persistent_volume_claim_info.as_ref().map(|i| &i.0);
            Some(Planned {
                volume: s.name.clone(),
                pod_uid: attach_pod_uid(s)?.to_owned(),
                size: info.and_then(image_size),
                block: info.is_some_and(|i| i["volumeMode"] == "Block"),
            })
        })
        .collect()
}

/// The VMI as the launcher is to run it: without the hotplugged claims whose images are not
/// mounted yet (and their disks), which it plugs in once they are.
pub fn without_unmounted(
    vmi: &VirtualMachineInstance,
    mounted: &BTreeSet<String>,
) -> VirtualMachineInstance {
    let hot = api::hotplug::hotplug_volumes(vmi);
    let absent: BTreeSet<&str> = hot.into_iter().filter(|v| !mounted.contains(*v)).collect();
    let mut out = vmi.clone();
    if absent.is_empty() {
        return out;
    }
    out.spec
        .volumes
        .retain(|v| !absent.contains(v.name.as_str()));
    out.spec
        .domain
        .devices
        .disks
        .retain(|d| !absent.contains(d.name.as_str()));
    out
}

/// Whether any entry of the VMI's `volumeStatus` is a hotplugged volume's.
pub fn has_hotplug_entries(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .iter()
        .flat_map(|s| &s.volume_status)
        .any(|s| s.hotplug_volume.is_some())
}

/// The attachment pod's socket, seen from virt-handler (in the kubelet's directory of its
/// `hotplug-disks` emptyDir).
pub fn attachment_socket(pods_dir: &Path, pod_uid: &str) -> PathBuf {
    pods_dir
        .join(pod_uid)
        .join("volumes/kubernetes.io~empty-dir")
        .join(HOTPLUG_DISKS_VOLUME)
        .join(format!("{ATTACHMENT_SOCKET}.sock"))
}

fn target(dir: &Path, volume: &str) -> PathBuf {
    dir.join(format!("{volume}.img"))
}

/// What [`mount`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Mounted {
    /// Volumes mounted in the launcher (now or before).
    pub ready: BTreeSet<String>,
    /// The block devices of the ready block volumes, (major, minor): the launcher's cgroup
    /// must allow them.
    pub block: Vec<(u32, u32)>,
    /// Volumes whose attachment pod does not serve yet, and why.
    pub waiting: Vec<(String, String)>,
}

/// Mounts every planned volume into the launcher `launcher`. Idempotent.
///
/// Blocking: it starts threads to enter namespaces. Call it from `spawn_blocking`.
pub fn mount(
    vmi: &VirtualMachineInstance,
    launcher: &PodIsolation,
    pods_dir: &Path,
    dir: &Path,
) -> Result<Mounted, MountError> {
    let planned = plan(vmi);
    let mut out = Mounted::default();
    if planned.is_empty() {
        return Ok(out);
    }
    let root = launcher
        .open_mount_root()
        .map_err(MountError::iso("the launcher's root"))?;
    for p in planned {
        let field = format!("hotplug volume {}", p.volume);
        if p.block {
            let Some(rdev) = devices::mapped_block_device(pods_dir, &p.pod_uid, &p.volume) else {
                let why = format!(
                    "the kubelet has not mapped the claim's device for attachment pod {}",
                    p.pod_uid
                );
                out.waiting.push((p.volume, why));
                continue;
            };
            block_node(&root, &dir.join(&p.volume), rdev, &field)?;
            out.block.extend(devices::rdev_numbers(rdev));
            out.ready.insert(p.volume);
            continue;
        }
        let socket = attachment_socket(pods_dir, &p.pod_uid);
        let peer = match isolation::detect_from_socket(&socket) {
            Ok(peer) => peer,
            Err(
                e @ (IsolationError::NoPeer { .. }
                | IsolationError::PidGone { .. }
                | IsolationError::Path { .. }),
            ) => {
                out.waiting.push((p.volume, e.to_string()));
                continue;
            }
            Err(e) => return Err(MountError::iso(&field)(e)),
        };
        let peer_root = peer.open_mount_root().map_err(MountError::iso(&field))?;
        let image = Path::new("/").join(&p.volume).join(DISK_IMAGE);
        let source = find_or_create(&peer_root, &image, p.size, &field)?;
        mounts::attach(
            &source,
            &peer,
            launcher,
            &root,
            &target(dir, &p.volume),
            &field,
            false,
        )?;
        out.ready.insert(p.volume);
    }
    Ok(out)
}

/// Makes `node` in the launcher the block device `rdev`, owned by qemu (KubeVirt's
/// `createBlockDeviceFile` and `SetFileOwnership`). Idempotent; anything else at that name is
/// replaced.
fn block_node(root: &MountRoot, node: &Path, rdev: u64, field: &str) -> Result<(), MountError> {
    match root.stat_no_follow(node, Resolve::InRoot) {
        Ok(st) if is_block(&st) && st.st_rdev == rdev => return Ok(()),
        Ok(_) => root
            .remove_file(node, Resolve::InRoot)
            .map_err(MountError::iso(field))?,
        Err(IsolationError::Path { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
        }
        Err(e) => return Err(MountError::iso(field)(e)),
    }
    root.create_block_device(node, Resolve::InRoot, 0o660, rdev)
        .and_then(|n| n.chown(Some(QEMU_ID), Some(QEMU_ID)))
        .map_err(MountError::iso(field))?;
    tracing::info!(node = %node.display(), rdev, "made a hotplugged block device in the launcher");
    Ok(())
}

fn is_block(st: &nix::sys::stat::FileStat) -> bool {
    st.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFBLK.bits()
}

/// The claim's `disk.img`, created sparse at `size` when missing, owned by qemu (KubeVirt's
/// `SetFileOwnership` of a hotplugged image).
fn find_or_create(
    root: &MountRoot,
    image: &Path,
    size: Option<u64>,
    field: &str,
) -> Result<isolation::SafePath, MountError> {
    match root.resolve(image, Resolve::InRoot) {
        Ok(found) => {
            found
                .chown(Some(QEMU_ID), Some(QEMU_ID))
                .map_err(MountError::iso(field))?;
            return Ok(found);
        }
        Err(IsolationError::Path { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
        }
        Err(e) => return Err(MountError::iso(field)(e)),
    }
    let Some(size) = size.filter(|s| *s > 0) else {
        return Err(MountError::Spec {
            field: field.to_owned(),
            message: format!(
                "the claim has no {DISK_IMAGE} and no capacity in the VMI's status to create one of"
            ),
        });
    };
    let file = root
        .create_file(image, Resolve::InRoot, 0o660)
        .map_err(MountError::iso(field))?;
    file.set_len(size).map_err(|e| MountError::Sys {
        field: field.to_owned(),
        op: "sizing",
        path: image.to_owned(),
        source: e,
    })?;
    let created = root
        .resolve(image, Resolve::InRoot)
        .map_err(MountError::iso(field))?;
    created
        .chown(Some(QEMU_ID), Some(QEMU_ID))
        .map_err(MountError::iso(field))?;
    tracing::info!(image = %image.display(), size, "created a disk image in a hotplugged claim");
    Ok(created)
}

/// What [`unmount_unused`] took away.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Unmounted {
    pub volumes: Vec<String>,
    /// The devices of the block nodes removed, (major, minor): their access is taken away.
    pub block: Vec<(u32, u32)>,
}

/// Unmounts every hotplug image, and removes every hotplug block device, in the launcher
/// whose volume is neither to stay mounted (`keep`) nor still in the guest (`in_domain`): the
/// launcher unplugs first. A launcher that is gone needs nothing.
pub fn unmount_unused(
    launcher: &PodIsolation,
    dir: &Path,
    keep: &BTreeSet<String>,
    in_domain: &BTreeSet<String>,
) -> Result<Unmounted, MountError> {
    let mut out = Unmounted::default();
    let root = match launcher.open_mount_root() {
        Ok(r) => r,
        Err(IsolationError::PidGone { .. }) => return Ok(out),
        Err(e) => return Err(MountError::iso("the launcher's root")(e)),
    };
    let listing = match root.open_file(dir, Resolve::InRoot, OFlag::O_RDONLY | OFlag::O_DIRECTORY) {
        Ok(d) => d,
        Err(IsolationError::Path { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            return Ok(out);
        }
        Err(e) => return Err(MountError::iso("the launcher's hotplug dir")(e)),
    };
    for name in mounts::entries(listing.into()).map_err(|e| MountError::Sys {
        field: "the launcher's hotplug dir".into(),
        op: "listing",
        path: dir.to_owned(),
        source: e.into(),
    })? {
        let image = name.as_bytes().strip_suffix(b".img");
        let volume = String::from_utf8_lossy(image.unwrap_or(name.as_bytes())).into_owned();
        if keep.contains(&volume) || in_domain.contains(&volume) {
            continue;
        }
        let field = format!("hotplug volume {volume}");
        if image.is_some() {
            if mounts::unmount_all(launcher, &root, &target(dir, &volume), &field)? > 0 {
                tracing::info!(%volume, "unmounted an unplugged volume from the launcher");
                out.volumes.push(volume);
            }
            continue;
        }
        let node = dir.join(&name);
        let st = match root.stat_no_follow(&node, Resolve::InRoot) {
            Ok(st) => st,
            Err(IsolationError::Path { source, .. })
                if source.raw_os_error() == Some(libc::ENOENT) =>
            {
                continue;
            }
            Err(e) => return Err(MountError::iso(&field)(e)),
        };
        if !is_block(&st) {
            continue;
        }
        root.remove_file(&node, Resolve::InRoot)
            .map_err(MountError::iso(&field))?;
        tracing::info!(%volume, "removed an unplugged block device from the launcher");
        out.block.extend(devices::rdev_numbers(st.st_rdev));
        out.volumes.push(volume);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use pretty_assertions::assert_eq;
    use serde_json::json;

    use super::*;

    #[test]
    fn images_are_the_capacity_less_the_overhead_in_whole_mebibytes() {
        let info = json!({"capacity": {"storage": "64Mi"}, "filesystemOverhead": "0.055"});
        // 64 MiB * 0.945 = 60.48 MiB.
        assert_eq!(image_size(&info), Some(60 * MIB));
        assert_eq!(
            image_size(&json!({"capacity": {"storage": "1Gi"}})),
            Some(1024 * MIB)
        );
        assert_eq!(image_size(&json!({"requests": {"storage": "1Gi"}})), None);
    }

    #[test]
    fn only_volumes_in_the_spec_with_a_ready_attachment_pod_are_mounted_block_claims_as_devices() {
        let vmi: VirtualMachineInstance = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm", "namespace": "default"},
            "spec": {"domain": {"devices": {}}, "volumes": [
                {"name": "ready", "persistentVolumeClaim": {"claimName": "a", "hotpluggable": true}},
                {"name": "starting", "persistentVolumeClaim": {"claimName": "b", "hotpluggable": true}},
                {"name": "raw", "persistentVolumeClaim": {"claimName": "c", "hotpluggable": true}},
                {"name": "root", "containerDisk": {"image": "guest"}},
            ]},
            "status": {"volumeStatus": [
                {"name": "ready", "target": "", "phase": "AttachedToNode",
                 "hotplugVolume": {"attachPodName": "hp-1", "attachPodUID": "uid-1"},
                 "persistentVolumeClaimInfo": {"capacity": {"storage": "16Mi"}}},
                {"name": "starting", "target": "", "phase": "AttachedToNode",
                 "hotplugVolume": {"attachPodName": "hp-1"}},
                {"name": "gone", "target": "sdb", "phase": "Ready",
                 "hotplugVolume": {"attachPodName": "hp-0", "attachPodUID": "uid-0"}},
                {"name": "raw", "target": "", "phase": "AttachedToNode",
                 "hotplugVolume": {"attachPodName": "hp-1", "attachPodUID": "uid-1"},
                 "persistentVolumeClaimInfo": {"capacity": {"storage": "16Mi"}, "volumeMode": "Block"}},
                {"name": "root", "target": "vda"},
            ]},
        }))
        .unwrap();
        assert_eq!(
            plan(&vmi),
            [
                Planned {
                    volume: "ready".into(),
                    pod_uid: "uid-1".into(),
                    size: Some(16 * MIB),
                    block: false,
                },
                Planned {
                    volume: "raw".into(),
                    pod_uid: "uid-1".into(),
                    size: Some(16 * MIB),
                    block: true,
                }
            ]
        );
        let launched = without_unmounted(&vmi, &BTreeSet::from(["ready".to_owned()]));
        let names: Vec<&str> = launched
            .spec
            .volumes
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(names, ["ready", "root"], "raw is not mounted yet");
        assert_eq!(
            attachment_socket(Path::new("/pods"), "uid-1"),
            Path::new("/pods/uid-1/volumes/kubernetes.io~empty-dir/hotplug-disks/hp.sock")
        );
    }
}
