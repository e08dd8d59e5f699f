//! Which cgroups a process belongs to (`/proc/<pid>/cgroup`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{CgroupError, Result};

/// A process's cgroup paths, relative to each hierarchy's root.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProcessCgroups {
    /// v1 paths by controller (`devices`, `cpuset`, `name=systemd`, ...).
    pub v1: BTreeMap<String, PathBuf>,
    /// The cgroup2 path (`0::/...` line), if a cgroup2 hierarchy exists.
    pub unified: Option<PathBuf>,
}

impl ProcessCgroups {
    /// Parses the text of `/proc/<pid>/cgroup`; `source` names the file in errors.
    pub fn parse(text: &str, source: &Path) -> Result<Self> {
        let mut out = Self::default();
        for (index, line) in text.lines().enumerate() {
            // "hierarchy-id:controller,list:/path"; the path itself may contain ':'.
            let mut fields = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) =
                (fields.next(), fields.next(), fields.next())
            else {
                return Err(CgroupError::Parse {
                    path: source.to_owned(),
                    message: format!("line {}: expected id:controllers:path: {line:?}", index + 1),
                });
            };
            let path = PathBuf::from(path);
            if id == "0" && controllers.is_empty() {
                out.unified = Some(path);
            } else {
                for controller in controllers.split(',').filter(|c| !c.is_empty()) {
                    out.v1.insert(controller.to_owned(), path.clone());
                }
            }
        }
        Ok(out)
    }

    /// Reads `/proc/<pid>/cgroup`.
    pub fn read(pid: i32) -> Result<Self> {
        let path = PathBuf::from(format!("/proc/{pid}/cgroup"));
        let text = std::fs::read_to_string(&path).map_err(|source| CgroupError::Read {
            path: path.clone(),
            source,
        })?;
        Self::parse(&text, &path)
    }

    /// The v1 path of `controller`.
    pub fn v1_path(&self, controller: &str) -> Result<&Path> {
        self.v1
            .get(controller)
            .map(PathBuf::as_path)
            .ok_or_else(|| CgroupError::NotAMember {
                controller: controller.to_owned(),
            })
    }

    /// The cgroup2 path.
    pub fn unified_path(&self) -> Result<&Path> {
        self.unified
            .as_deref()
            .ok_or_else(|| CgroupError::NotAMember {
                controller: "cgroup2".to_owned(),
            })
    }
}

/// The pod-level cgroup holding a container's cgroup `path`: the nearest ancestor (or `path`
/// itself) named like the kubelet names pod cgroups, `pod<uid>` with the cgroupfs driver or
/// `kubepods-<qos>-pod<uid>.slice` with the systemd driver. `None` when `path` is not inside a
/// pod, which is how a process started outside Kubernetes looks.
pub fn pod_cgroup(path: &Path) -> Option<&Path> {
    path.ancestors().find(|p| {
        p.file_name().and_then(|n| n.to_str()).is_some_and(|name| {
            name.starts_with("pod")
                || name
                    .strip_suffix(".slice")
                    .is_some_and(|n| n.starts_with("kubepods") && n.contains("-pod"))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_membership() {
        let text = "\
9:name=systemd:/
5:devices:/kubepods/burstable/pod1234/abcd
4:memory:/process_api/54cb
3:cpu,cpuacct:/a:b
0::/kubepods/burstable/pod1234/abcd
";
        let m = ProcessCgroups::parse(text, Path::new("p")).unwrap();
        assert_eq!(
            m.v1_path("devices").unwrap(),
            Path::new("/kubepods/burstable/pod1234/abcd")
        );
        assert_eq!(m.v1_path("cpuacct").unwrap(), Path::new("/a:b"));
        assert_eq!(m.v1_path("name=systemd").unwrap(), Path::new("/"));
        assert_eq!(
            m.unified_path().unwrap(),
            Path::new("/kubepods/burstable/pod1234/abcd")
        );
        assert!(matches!(
            m.v1_path("pids"),
            Err(CgroupError::NotAMember { .. })
        ));
    }

    #[test]
    fn malformed_line_names_file_and_line() {
        let err =
            ProcessCgroups::parse("0::/\nnonsense\n", Path::new("/proc/7/cgroup")).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("/proc/7/cgroup") && text.contains("line 2"),
            "{text}"
        );
    }

    #[test]
    fn pod_cgroups() {
        let cases = [
            (
                "/kubepods/burstable/pod1234/abcd",
                Some("/kubepods/burstable/pod1234"),
            ),
            ("/kubepods/pod99/c", Some("/kubepods/pod99")),
            (
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12_34.slice/cri-containerd-ab.scope",
                Some("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12_34.slice"),
            ),
            ("/system.slice/sshd.service", None),
            ("/", None),
        ];
        for (path, want) in cases {
            assert_eq!(pod_cgroup(Path::new(path)), want.map(Path::new), "{path}");
        }
    }

    #[test]
    fn reads_own_membership() {
        let m = ProcessCgroups::read(i32::try_from(std::process::id()).unwrap()).unwrap();
        assert!(!m.v1.is_empty() || m.unified.is_some());
    }
}
