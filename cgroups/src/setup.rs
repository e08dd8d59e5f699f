//! Which cgroup hierarchies this host mounts, and where.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{CgroupError, Result};

/// How the host arranges its cgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Only cgroup v1 hierarchies.
    Legacy,
    /// v1 controllers plus a cgroup2 mount that holds no controller the v1 side uses
    /// (systemd's `/sys/fs/cgroup/unified`). Device programs can still attach there.
    Hybrid,
    /// One cgroup2 hierarchy with every controller.
    Unified,
}

/// One mounted hierarchy: where it is mounted and which of its directories the mount shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub mount_point: PathBuf,
    /// The hierarchy path visible at `mount_point` (`/` unless a subtree was bind-mounted).
    pub root: PathBuf,
}

impl Hierarchy {
    /// The directory of the cgroup `path` (as written in `/proc/<pid>/cgroup`) under this mount.
    pub fn dir_of(&self, path: &Path) -> Option<PathBuf> {
        let rel = path.strip_prefix(&self.root).ok()?;
        Some(self.mount_point.join(rel))
    }
}

/// The host's cgroup mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupSetup {
    pub mode: Mode,
    /// v1 hierarchies by controller name (`devices`, `cpuset`, ...; named hierarchies as
    /// `name=systemd`). A hierarchy that co-mounts several controllers appears once per controller.
    pub v1: BTreeMap<String, Hierarchy>,
    pub unified: Option<Hierarchy>,
}

/// Controllers the kernel can bind to a v1 hierarchy; everything else in a cgroup mount's
/// super options (`rw`, `xattr`, `release_agent=...`) is an option, not a controller.
const V1_CONTROLLERS: &[&str] = &[
    "cpuset",
    "cpu",
    "cpuacct",
    "blkio",
    "io",
    "memory",
    "devices",
    "freezer",
    "net_cls",
    "perf_event",
    "net_prio",
    "hugetlb",
    "pids",
    "rdma",
    "misc",
];

impl CgroupSetup {
    /// Reads this process's view of the mounts.
    pub fn detect() -> Result<Self> {
        let path = Path::new("/proc/self/mountinfo");
        let text = std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_mountinfo(&text, path)
    }

    /// Parses `/proc/<pid>/mountinfo` text; `source` names it in errors.
    pub fn from_mountinfo(text: &str, source: &Path) -> Result<Self> {
        let mut v1 = BTreeMap::new();
        let mut unified = None;
        for (index, line) in text.lines().enumerate() {
            let Some(mount) = parse_mountinfo_line(line) else {
                return Err(CgroupError::Parse {
                    path: source.to_owned(),
                    message: format!("line {}: not a mountinfo line: {line:?}", index + 1),
                });
            };
            let hierarchy = Hierarchy {
                mount_point: mount.mount_point,
                root: mount.root,
            };
            match mount.fs_type {
                "cgroup2" => {
                    unified.get_or_insert(hierarchy);
                }
                "cgroup" => {
                    for option in mount.super_options.split(',') {
                        if option.starts_with("name=") || V1_CONTROLLERS.contains(&option) {
                            v1.entry(option.to_owned())
                                .or_insert_with(|| hierarchy.clone());
                        }
                    }
                }
                _ => {}
            }
        }
        let has_v1_controller = v1.keys().any(|k| !k.starts_with("name="));
        let mode = match (has_v1_controller, unified.is_some()) {
            (true, true) => Mode::Hybrid,
            (true, false) => Mode::Legacy,
            (false, true) => Mode::Unified,
            (false, false) => {
                return Err(CgroupError::NotMounted {
                    mountinfo: source.to_owned(),
                });
            }
        };
        Ok(Self { mode, v1, unified })
    }

    /// The v1 hierarchy a controller is bound to.
    pub fn v1_hierarchy(&self, controller: &str) -> Result<&Hierarchy> {
        self.v1
            .get(controller)
            .ok_or_else(|| CgroupError::ControllerMissing {
                controller: controller.to_owned(),
            })
    }

    /// The cgroup2 mount.
    pub fn unified_hierarchy(&self) -> Result<&Hierarchy> {
        self.unified
            .as_ref()
            .ok_or_else(|| CgroupError::ControllerMissing {
                controller: "cgroup2".to_owned(),
            })
    }
}

struct MountinfoLine<'a> {
    root: PathBuf,
    mount_point: PathBuf,
    fs_type: &'a str,
    super_options: &'a str,
}

fn parse_mountinfo_line(line: &str) -> Option<MountinfoLine<'_>> {
    // "36 35 98:0 /root /mnt/point rw,noatime shared:1 - ext3 /dev/root rw,errors=continue":
    // a variable number of optional fields ends at the lone "-".
    let (head, tail) = line.split_once(" - ")?;
    let mut head = head.split(' ');
    let root = head.nth(3)?;
    let mount_point = head.next()?;
    let mut tail = tail.split(' ');
    let fs_type = tail.next()?;
    let _source = tail.next()?;
    let super_options = tail.next()?;
    Some(MountinfoLine {
        root: PathBuf::from(unescape_octal(root)),
        mount_point: PathBuf::from(unescape_octal(mount_point)),
        fs_type,
        super_options,
    })
}

/// mountinfo writes space, tab, newline and backslash in paths as `\ooo`.
fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && bytes.len() >= i + 4
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            out.push(u8::try_from(value).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:24 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
27 26 0:25 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
28 26 0:26 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
29 26 0:27 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
30 26 0:28 / /sys/fs/cgroup/net_cls,net_prio rw,relatime - cgroup cgroup rw,net_cls,net_prio
31 26 0:29 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn hybrid_host() {
        let setup = CgroupSetup::from_mountinfo(HYBRID, Path::new("mi")).unwrap();
        assert_eq!(setup.mode, Mode::Hybrid);
        assert_eq!(
            setup.v1_hierarchy("devices").unwrap().mount_point,
            Path::new("/sys/fs/cgroup/devices")
        );
        assert_eq!(
            setup.v1_hierarchy("net_prio").unwrap().mount_point,
            Path::new("/sys/fs/cgroup/net_cls,net_prio")
        );
        assert!(setup.v1.contains_key("name=systemd"));
        assert!(!setup.v1.contains_key("xattr"));
        assert!(!setup.v1.contains_key("rw"));
        assert_eq!(
            setup.unified_hierarchy().unwrap().mount_point,
            Path::new("/sys/fs/cgroup/unified")
        );
    }

    #[test]
    fn unified_host_even_with_a_named_v1_hierarchy() {
        let text = "\
1 0 0:1 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate
2 0 0:2 / /run/systemd/legacy rw - cgroup cgroup rw,name=systemd
";
        let setup = CgroupSetup::from_mountinfo(text, Path::new("mi")).unwrap();
        assert_eq!(setup.mode, Mode::Unified);
        assert!(matches!(
            setup.v1_hierarchy("devices"),
            Err(CgroupError::ControllerMissing { .. })
        ));
    }

    #[test]
    fn legacy_host() {
        let text = "1 0 0:1 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let setup = CgroupSetup::from_mountinfo(text, Path::new("mi")).unwrap();
        assert_eq!(setup.mode, Mode::Legacy);
        assert!(matches!(
            setup.unified_hierarchy(),
            Err(CgroupError::ControllerMissing { .. })
        ));
    }

    #[test]
    fn no_cgroups_and_garbage_are_errors() {
        let err = CgroupSetup::from_mountinfo(
            "1 0 0:1 / / rw - ext4 /dev/sda rw\n",
            Path::new("/x/mountinfo"),
        )
        .unwrap_err();
        assert!(matches!(err, CgroupError::NotMounted { .. }), "{err}");
        let err = CgroupSetup::from_mountinfo("garbage\n", Path::new("/x/mountinfo")).unwrap_err();
        assert!(err.to_string().contains("/x/mountinfo"), "{err}");
        assert!(err.to_string().contains("line 1"), "{err}");
    }

    #[test]
    fn escaped_and_bind_mounted_paths() {
        let text = "1 0 0:1 /kubepods /sys/fs/cgroup\\040x rw - cgroup2 cgroup2 rw\n";
        let setup = CgroupSetup::from_mountinfo(text, Path::new("mi")).unwrap();
        let h = setup.unified_hierarchy().unwrap();
        assert_eq!(h.mount_point, Path::new("/sys/fs/cgroup x"));
        assert_eq!(
            h.dir_of(Path::new("/kubepods/pod1/c1")),
            Some(PathBuf::from("/sys/fs/cgroup x/pod1/c1"))
        );
        assert_eq!(h.dir_of(Path::new("/system.slice")), None);
    }

    #[test]
    fn this_host_has_cgroups() {
        let setup = CgroupSetup::detect().unwrap();
        assert!(setup.v1.contains_key("devices") || setup.unified.is_some());
    }
}
