//! Which device nodes the launcher's container may open: its cgroup's device rules.
//!
//! QEMU needs `/dev/kvm`, `/dev/net/tun` and `/dev/vhost-net`, and every hotplugged block
//! device. The container runtime set the container up with its own defaults (runc's list:
//! `/dev/null`, `/dev/zero`, ptys, ...) plus whatever its spec named. [`plan`] (pure) turns
//! that into the rules to set, [`apply`] sets them through the `cgroups` crate on v1 (the
//! devices controller's files) or cgroup2 (an eBPF program).
//!
//! Never taking away what the container needs:
//! - v1: the kernel reports the current allow list (`devices.list`); the new rules are that
//!   list plus what the VM needs, minus only the block devices the caller says were
//!   unplugged. A container allowed everything (privileged) is left alone.
//! - cgroup2: the kernel keeps no readable copy of the runtime's program, and the new program
//!   replaces it. The rules are runc's defaults, KubeVirt's pty majors, the VM devices and the
//!   block devices: what a launcher container is given. Devices another device plugin
//!   granted the container on a cgroup2 host are not known here and are not kept; the
//!   container's own `/dev` is deliberately not consulted, because a pod that may `mknod`
//!   could plant a node for any host disk there.

use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};

use cgroups::{
    Access, CgroupError, CgroupSetup, DeviceEntry, DeviceKind, DeviceRule, Devices, Manager,
};
use isolation::PodIsolation;

/// A device node QEMU may need, found on the host by its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmDevice {
    pub name: &'static str,
    /// Path under the host's `/dev`.
    pub path: &'static str,
    /// The kernel's fixed numbers (Documentation/admin-guide/devices.txt).
    pub major: u32,
    pub minor: u32,
}

/// kvm (10:232), tun (10:200), vhost-net (10:238).
pub const VM_DEVICES: [VmDevice; 3] = [
    VmDevice {
        name: "kvm",
        path: "kvm",
        major: 10,
        minor: 232,
    },
    VmDevice {
        name: "tun",
        path: "net/tun",
        major: 10,
        minor: 200,
    },
    VmDevice {
        name: "vhost-net",
        path: "vhost-net",
        major: 10,
        minor: 238,
    },
];

/// The first pty slave major and how many there are (KubeVirt allows all 16).
const PTY_MAJORS: std::ops::Range<u32> = 136..152;

/// What the VM needs beyond the container's defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wanted {
    /// Character devices (major, minor): the [`VM_DEVICES`] the host has.
    pub char_devices: Vec<(u32, u32)>,
    /// Block devices (major, minor): the pod's `volumeDevices` the kubelet mapped
    /// ([`mapped_block_devices`]) and the hotplugged ones.
    pub block: Vec<(u32, u32)>,
    /// Block devices hotplugged before and unplugged since: their access is taken away.
    pub unplugged_block: Vec<(u32, u32)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// The cgroup allows every device (a privileged container): nothing to add, and
    /// restricting it would take away what it has.
    LeaveAllowAll,
    Set(Vec<DeviceRule>),
}

/// runc's default allow list (libcontainer's `AllowedDevices`) with every pty slave major,
/// as KubeVirt allows them.
pub fn container_defaults() -> Vec<DeviceRule> {
    let rwm = Access::ALL;
    let c = |major, minor| DeviceRule::allow(DeviceKind::Char, Some(major), minor, rwm);
    let mut rules = vec![
        DeviceRule::allow(DeviceKind::Char, None, None, Access::MKNOD),
        DeviceRule::allow(DeviceKind::Block, None, None, Access::MKNOD),
        c(1, Some(3)),    // null
        c(1, Some(5)),    // zero
        c(1, Some(7)),    // full
        c(1, Some(8)),    // random
        c(1, Some(9)),    // urandom
        c(5, Some(0)),    // tty
        c(5, Some(2)),    // ptmx
        c(10, Some(200)), // net/tun
    ];
    rules.extend(PTY_MAJORS.map(|major| c(major, None)));
    rules
}

/// The rules to set. `current` is the allow list the kernel reports (v1), `None` when the
/// cgroup allows everything; on cgroup2 pass `Some(&[])`: nothing is known.
pub fn plan(current: Option<&[DeviceEntry]>, wanted: &Wanted) -> Plan {
    let Some(current) = current else {
        return Plan::LeaveAllowAll;
    };
    let mut rules: Vec<DeviceRule> = current
        .iter()
        .map(|e| DeviceRule::allow(e.kind, e.major, e.minor, e.access))
        .collect();
    rules.extend(container_defaults());
    let dev = |kind, (major, minor): (u32, u32)| {
        DeviceRule::allow(kind, Some(major), Some(minor), Access::ALL)
    };
    rules.extend(
        wanted
            .char_devices
            .iter()
            .map(|&d| dev(DeviceKind::Char, d)),
    );
    rules.extend(wanted.block.iter().map(|&d| dev(DeviceKind::Block, d)));
    rules.extend(
        wanted
            .unplugged_block
            .iter()
            .filter(|d| !wanted.block.contains(d))
            .map(|&(major, minor)| {
                DeviceRule::deny(DeviceKind::Block, Some(major), Some(minor), Access::ALL)
            }),
    );
    Plan::Set(rules)
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("the cgroups of launcher process {pid}")]
    Cgroups {
        pid: i32,
        #[source]
        source: CgroupError,
    },
}

/// What [`apply`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The rules were written (false: the cgroup already allowed exactly that, or allows
    /// everything).
    pub changed: bool,
    /// The allow list now in force; `None` for a cgroup that allows everything.
    pub allowed: Option<Vec<DeviceEntry>>,
}

/// The [`VM_DEVICES`] the host has, as character devices under `dev_dir` (`/dev`).
pub fn host_vm_devices(dev_dir: &Path) -> Vec<(u32, u32)> {
    VM_DEVICES
        .iter()
        .filter(|d| {
            let p: PathBuf = dev_dir.join(d.path);
            std::fs::metadata(&p).is_ok_and(|m| {
                m.file_type().is_char_device() && numbers(&m) == Some((d.major, d.minor))
            })
        })
        .map(|d| (d.major, d.minor))
        .collect()
}

/// A device node's (major, minor).
fn numbers(node: &std::fs::Metadata) -> Option<(u32, u32)> {
    rdev_numbers(node.rdev())
}

/// The block devices the kubelet mapped for pod `pod_uid`'s `volumeDevices`, from its own
/// record on the host: `<pods_dir>/<uid>/volumeDevices/<plugin>/<volume>`, a link to the
/// device (the kubelet's `MapBlockVolume`). The runtime's device program allowed them, and a
/// cgroup2 program set here replaces that one, so they must be in it. The kubelet's record,
/// not the container's `/dev`, which a pod that may `mknod` could fill with any host disk.
/// Entries that are not block devices (a link whose device is gone) are skipped.
pub fn mapped_block_devices(pods_dir: &Path, pod_uid: &str) -> Vec<(u32, u32)> {
    let mut found: Vec<(u32, u32)> = mapped(pods_dir, pod_uid)
        .filter_map(|(_, device)| numbers(&device))
        .collect();
    found.sort_unstable();
    found.dedup();
    found
}

/// The block device the kubelet mapped for pod `pod_uid`'s volume `volume` (its record, as
/// in [`mapped_block_devices`]) as its `rdev`, if it did.
pub fn mapped_block_device(pods_dir: &Path, pod_uid: &str, volume: &str) -> Option<u64> {
    mapped(pods_dir, pod_uid)
        .find(|(name, _)| name.as_os_str() == volume)
        .map(|(_, device)| device.rdev())
}

/// (volume name, the device's metadata) of each block device in the kubelet's record.
fn mapped(
    pods_dir: &Path,
    pod_uid: &str,
) -> impl Iterator<Item = (std::ffi::OsString, std::fs::Metadata)> {
    let entries = |dir: &Path| {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .collect::<Vec<_>>()
    };
    entries(&pods_dir.join(pod_uid).join("volumeDevices"))
        .into_iter()
        .flat_map(move |plugin| entries(&plugin.path()))
        .filter_map(|link| Some((link.file_name(), std::fs::metadata(link.path()).ok()?)))
        .filter(|(_, m)| m.file_type().is_block_device())
}

/// A device number's (major, minor).
pub fn rdev_numbers(rdev: u64) -> Option<(u32, u32)> {
    Some((
        u32::try_from(nix::sys::stat::major(rdev)).ok()?,
        u32::try_from(nix::sys::stat::minor(rdev)).ok()?,
    ))
}

/// Sets the device rules of the launcher's container cgroup (the cgroups of process
/// `launcher.pid`) on a host set up as `setup`.
pub fn apply(
    setup: &CgroupSetup,
    launcher: &PodIsolation,
    wanted: &Wanted,
) -> Result<Applied, DeviceError> {
    let pid = launcher.pid;
    let err = |source| DeviceError::Cgroups { pid, source };
    let mut manager = Manager::for_process(setup, &launcher.cgroups).map_err(err)?;
    let current = match manager.devices() {
        Devices::V1(_) => manager.allowed_devices().map_err(err)?,
        Devices::V2(_) => Some(Vec::new()),
    };
    let rules = match plan(current.as_deref(), wanted) {
        Plan::LeaveAllowAll => {
            return Ok(Applied {
                changed: false,
                allowed: None,
            });
        }
        Plan::Set(rules) => rules,
    };
    let target = cgroups::effective(&rules).map_err(err)?;
    if matches!(manager.devices(), Devices::V1(_))
        && current.as_ref().is_some_and(|c| same_entries(c, &target))
    {
        return Ok(Applied {
            changed: false,
            allowed: current,
        });
    }
    manager.set_device_rules(&rules).map_err(err)?;
    tracing::info!(pid, entries = target.len(), "device rules set");
    Ok(Applied {
        changed: true,
        allowed: Some(target),
    })
}

fn same_entries(a: &[DeviceEntry], b: &[DeviceEntry]) -> bool {
    let mut a = a.to_vec();
    let mut b = b.to_vec();
    a.sort();
    b.sort();
    a == b
}

#[cfg(test)]
mod tests {
    use super::*;
    use cgroups::permits;

    fn allowed(plan: &Plan) -> Vec<DeviceEntry> {
        match plan {
            Plan::Set(rules) => cgroups::effective(rules).unwrap(),
            Plan::LeaveAllowAll => panic!("allow-all"),
        }
    }

    #[test]
    fn defaults_vm_devices_and_block_devices_are_allowed() {
        let wanted = Wanted {
            char_devices: vec![(10, 232), (10, 238)],
            block: vec![(7, 0)],
            unplugged_block: vec![],
        };
        let e = allowed(&plan(Some(&[]), &wanted));
        for (major, minor) in [
            (1, 3),
            (1, 9),
            (5, 2),
            (136, 4),
            (151, 0),
            (10, 200),
            (10, 232),
            (10, 238),
        ] {
            assert!(
                permits(&e, DeviceKind::Char, major, minor, Access::ALL),
                "c {major}:{minor}"
            );
        }
        assert!(permits(&e, DeviceKind::Block, 7, 0, Access::ALL));
        assert!(permits(&e, DeviceKind::Block, 8, 0, Access::MKNOD));
        // Nothing else: not /dev/mem, not another disk.
        assert!(!permits(&e, DeviceKind::Char, 1, 1, Access::READ));
        assert!(!permits(&e, DeviceKind::Block, 8, 0, Access::READ));
        assert!(!permits(&e, DeviceKind::Char, 152, 0, Access::READ));
    }

    #[test]
    fn what_the_container_had_is_kept_and_only_unplugged_disks_are_taken_away() {
        let had = [
            DeviceEntry {
                kind: DeviceKind::Char,
                major: Some(4),
                minor: Some(64),
                access: Access::READ.union(Access::WRITE),
            },
            DeviceEntry {
                kind: DeviceKind::Block,
                major: Some(7),
                minor: Some(1),
                access: Access::ALL,
            },
            DeviceEntry {
                kind: DeviceKind::Block,
                major: Some(7),
                minor: Some(2),
                access: Access::ALL,
            },
        ];
        let wanted = Wanted {
            char_devices: vec![],
            block: vec![(7, 2)],
            unplugged_block: vec![(7, 1), (7, 2)],
        };
        let e = allowed(&plan(Some(&had), &wanted));
        assert!(permits(&e, DeviceKind::Char, 4, 64, Access::WRITE));
        assert!(
            !permits(&e, DeviceKind::Block, 7, 1, Access::READ),
            "unplugged"
        );
        // Unplugged earlier and plugged again: the current list wins.
        assert!(permits(&e, DeviceKind::Block, 7, 2, Access::READ));
    }

    #[test]
    fn an_allow_all_cgroup_is_left_alone() {
        assert_eq!(plan(None, &Wanted::default()), Plan::LeaveAllowAll);
    }

    #[test]
    fn this_hosts_vm_devices_are_found_by_their_numbers() {
        let found = host_vm_devices(Path::new("/dev"));
        if Path::new("/dev/kvm").exists() {
            assert!(found.contains(&(10, 232)), "{found:?}");
        }
        assert!(host_vm_devices(Path::new("/nonexistent")).is_empty());
        // A file that is not the device is not taken for it.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kvm"), "").unwrap();
        assert!(host_vm_devices(dir.path()).is_empty());
    }
}
