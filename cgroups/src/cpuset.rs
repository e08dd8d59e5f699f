//! CPU lists and the plan for pinning a VM's threads.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::CgroupError;

/// A set of CPUs in the kernel's list syntax (`0-3,8`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CpuList(BTreeSet<u32>);

impl CpuList {
    pub fn cpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl FromIterator<u32> for CpuList {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        Self(iter.into_iter().collect())
    }
}

impl FromStr for CpuList {
    type Err = CgroupError;

    fn from_str(s: &str) -> Result<Self, CgroupError> {
        let err = |message: String| CgroupError::InvalidCpuList {
            input: s.to_owned(),
            message,
        };
        let mut set = BTreeSet::new();
        for part in s.trim().split(',').filter(|p| !p.is_empty()) {
            let number = |n: &str| {
                n.parse::<u32>()
                    .map_err(|_| err(format!("{n:?} is not a CPU number")))
            };
            match part.split_once('-') {
                Some((lo, hi)) => {
                    let (lo, hi) = (number(lo)?, number(hi)?);
                    if lo > hi {
                        return Err(err(format!("range {part:?} runs backwards")));
                    }
                    set.extend(lo..=hi);
                }
                None => {
                    set.insert(number(part)?);
                }
            }
        }
        Ok(Self(set))
    }
}

impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut iter = self.0.iter().copied().peekable();
        while let Some(lo) = iter.next() {
            let mut hi = lo;
            while iter.peek() == Some(&(hi + 1)) {
                hi += 1;
                iter.next();
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if lo == hi {
                write!(f, "{lo}")?;
            } else {
                write!(f, "{lo}-{hi}")?;
            }
        }
        Ok(())
    }
}

/// Names of the child cgroups a VM's threads are split into.
pub const VCPU_CHILD: &str = "vcpus";
pub const HOUSEKEEPING_CHILD: &str = "housekeeping";

/// One filesystem action of a placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Mkdir(PathBuf),
    Write(PathBuf, String),
    /// Write a thread id into this `tasks` / `cgroup.threads` file.
    Move(PathBuf, i32),
}

/// Who goes where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub vcpu_threads: Vec<i32>,
    pub vcpu_cpus: CpuList,
    pub housekeeping_threads: Vec<i32>,
    pub housekeeping_cpus: CpuList,
}

/// The steps that split threads into the two children of `parent` (a cpuset cgroup).
///
/// v1: a cpuset child accepts no task before both `cpuset.mems` and `cpuset.cpus` are set,
/// so the parent's memory nodes are copied first; threads move through `tasks`.
/// v2: moving single threads needs threaded children (`cgroup.type`), the cpuset controller
/// enabled for the parent's children, and `cgroup.threads`.
pub fn plan(v2: bool, parent: &Path, parent_mems: &str, placement: &Placement) -> Vec<Step> {
    let mut steps = Vec::new();
    if v2 {
        steps.push(Step::Write(
            parent.join("cgroup.subtree_control"),
            "+cpuset".to_owned(),
        ));
    }
    for (name, cpus, threads) in [
        (VCPU_CHILD, &placement.vcpu_cpus, &placement.vcpu_threads),
        (
            HOUSEKEEPING_CHILD,
            &placement.housekeeping_cpus,
            &placement.housekeeping_threads,
        ),
    ] {
        let child = parent.join(name);
        steps.push(Step::Mkdir(child.clone()));
        if v2 {
            steps.push(Step::Write(
                child.join("cgroup.type"),
                "threaded".to_owned(),
            ));
        } else {
            steps.push(Step::Write(
                child.join("cpuset.mems"),
                parent_mems.trim().to_owned(),
            ));
        }
        steps.push(Step::Write(child.join("cpuset.cpus"), cpus.to_string()));
        let tasks = child.join(if v2 { "cgroup.threads" } else { "tasks" });
        steps.extend(threads.iter().map(|&tid| Step::Move(tasks.clone(), tid)));
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_round_trip() {
        for (text, canonical) in [("0-3,8", "0-3,8"), ("3,1,2", "1-3"), ("", ""), ("5", "5")] {
            let list: CpuList = text.parse().unwrap();
            assert_eq!(list.to_string(), canonical, "{text}");
        }
        assert!(matches!(
            "3-1".parse::<CpuList>(),
            Err(CgroupError::InvalidCpuList { .. })
        ));
        let err = "0,x".parse::<CpuList>().unwrap_err().to_string();
        assert!(err.contains("\"0,x\""), "{err}");
    }

    fn placement() -> Placement {
        Placement {
            vcpu_threads: vec![11, 12],
            vcpu_cpus: "1".parse().unwrap(),
            housekeeping_threads: vec![10],
            housekeeping_cpus: "0".parse().unwrap(),
        }
    }

    #[test]
    fn v1_plan_sets_mems_before_tasks() {
        let p = Path::new("/c");
        let steps = plan(false, p, "0\n", &placement());
        assert_eq!(
            steps,
            vec![
                Step::Mkdir(p.join("vcpus")),
                Step::Write(p.join("vcpus/cpuset.mems"), "0".into()),
                Step::Write(p.join("vcpus/cpuset.cpus"), "1".into()),
                Step::Move(p.join("vcpus/tasks"), 11),
                Step::Move(p.join("vcpus/tasks"), 12),
                Step::Mkdir(p.join("housekeeping")),
                Step::Write(p.join("housekeeping/cpuset.mems"), "0".into()),
                Step::Write(p.join("housekeeping/cpuset.cpus"), "0".into()),
                Step::Move(p.join("housekeeping/tasks"), 10),
            ]
        );
    }

    #[test]
    fn v2_plan_uses_threaded_children() {
        let p = Path::new("/c");
        let steps = plan(true, p, "", &placement());
        assert_eq!(
            steps[..4],
            [
                Step::Write(p.join("cgroup.subtree_control"), "+cpuset".into()),
                Step::Mkdir(p.join("vcpus")),
                Step::Write(p.join("vcpus/cgroup.type"), "threaded".into()),
                Step::Write(p.join("vcpus/cpuset.cpus"), "1".into()),
            ]
        );
        assert!(steps.contains(&Step::Move(p.join("housekeeping/cgroup.threads"), 10)));
    }
}
