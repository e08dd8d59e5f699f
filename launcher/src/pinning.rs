//! Dedicated CPUs (`spec.domain.cpu.dedicatedCpuPlacement`, `isolateEmulatorThread`): what
//! KubeVirt's converter writes as libvirt's `<cputune>` (`vcpupin`, `emulatorpin`) and libvirt
//! then applies, done here on QEMU's threads before the guest's first instruction.
//!
//! The CPUs are the launcher's own: the kubelet's static CPU manager gave its container an
//! exclusive cpuset, which every process of the container inherits as its affinity (KubeVirt's
//! launcher reads the same set from its cpuset cgroup). vCPU `i` goes to the `i`-th of them;
//! with `isolateEmulatorThread` every other QEMU thread (the main loop, I/O and worker
//! threads) goes to the one after, and threads QEMU starts later inherit it from their
//! creator. Without it those threads keep the whole set, as libvirt leaves them without an
//! `emulatorpin`.

use cgroups::CpuList;
use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;

use crate::convert::ConvertError;

/// One thread and the single CPU it is pinned to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub thread: i32,
    pub cpu: usize,
}

const DEDICATED: &str = "spec.domain.cpu.dedicatedCpuPlacement";
const ISOLATE: &str = "spec.domain.cpu.isolateEmulatorThread";

/// Where each thread goes: `vcpu_threads` in vCPU order onto `cpus` in order, then, with
/// `isolate`, the `other_threads` onto the next CPU. KubeVirt's messages when the set is too
/// small (`FitCores`, `FormatEmulatorThreadPin`), with the field that asked for the CPUs.
pub fn plan(
    cpus: &[usize],
    vcpu_threads: &[i32],
    other_threads: &[i32],
    isolate: bool,
) -> Result<Vec<Pin>, ConvertError> {
    let listed = || {
        cpus.iter()
            .filter_map(|&c| u32::try_from(c).ok())
            .collect::<CpuList>()
    };
    if vcpu_threads.len() > cpus.len() {
        return Err(ConvertError {
            field: DEDICATED.into(),
            message: format!(
                "not enough exclusive threads provided, could not fit {} core(s): {} vCPUs, and \
                 the pod has CPUs {:?}",
                vcpu_threads.len() - cpus.len(),
                vcpu_threads.len(),
                listed().to_string()
            ),
        });
    }
    let mut pins: Vec<Pin> = vcpu_threads
        .iter()
        .zip(cpus)
        .map(|(&thread, &cpu)| Pin { thread, cpu })
        .collect();
    if isolate {
        let Some(&cpu) = cpus.get(vcpu_threads.len()) else {
            return Err(ConvertError {
                field: ISOLATE.into(),
                message: format!(
                    "no CPU allocated for the emulation thread: the pod's CPUs {:?} all run vCPUs",
                    listed().to_string()
                ),
            });
        };
        pins.extend(other_threads.iter().map(|&thread| Pin { thread, cpu }));
    }
    Ok(pins)
}

/// The CPUs this process may run on, ascending.
fn own_cpus() -> Result<Vec<usize>, ConvertError> {
    let set = sched_getaffinity(Pid::from_raw(0)).map_err(|e| ConvertError {
        field: DEDICATED.into(),
        message: format!("reading the launcher's CPU affinity: {e}"),
    })?;
    Ok((0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect())
}

/// Pins QEMU `pid`'s threads as [`plan`] says, from the launcher's own CPUs. `vcpu_threads`
/// are the thread ids `query-cpus-fast` reports, in vCPU order.
pub fn apply(pid: i32, vcpu_threads: &[i64], isolate: bool) -> Result<Vec<Pin>, ConvertError> {
    let vcpus: Vec<i32> = vcpu_threads
        .iter()
        .filter_map(|&t| i32::try_from(t).ok())
        .collect();
    let others: Vec<i32> = cgroups::threads_of(pid)
        .map_err(|e| ConvertError {
            field: DEDICATED.into(),
            message: format!("listing QEMU's threads: {e}"),
        })?
        .into_iter()
        .filter(|t| !vcpus.contains(t))
        .collect();
    let pins = plan(&own_cpus()?, &vcpus, &others, isolate)?;
    for pin in &pins {
        let mut set = CpuSet::new();
        let pinned = set
            .set(pin.cpu)
            .and_then(|()| sched_setaffinity(Pid::from_raw(pin.thread), &set));
        match pinned {
            Ok(()) => {}
            // A worker thread that ended since the listing needs no pinning; a vCPU must not.
            Err(nix::errno::Errno::ESRCH) if !vcpus.contains(&pin.thread) => {}
            Err(e) => {
                return Err(ConvertError {
                    field: DEDICATED.into(),
                    message: format!("pinning QEMU thread {} to CPU {}: {e}", pin.thread, pin.cpu),
                });
            }
        }
    }
    Ok(pins)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pins(p: &[Pin]) -> Vec<(i32, usize)> {
        p.iter().map(|p| (p.thread, p.cpu)).collect()
    }

    #[test]
    fn vcpus_take_the_cpus_in_order_and_the_emulator_the_next() {
        let got = plan(&[2, 5, 7], &[11, 12], &[10, 13], true).unwrap();
        assert_eq!(pins(&got), [(11, 2), (12, 5), (10, 7), (13, 7)]);
        // Without isolation the other threads keep the whole set: nothing to pin.
        let got = plan(&[2, 5, 7], &[11, 12], &[10, 13], false).unwrap();
        assert_eq!(pins(&got), [(11, 2), (12, 5)]);
    }

    #[test]
    fn too_few_cpus_name_the_field_that_asked() {
        let e = plan(&[1], &[11, 12], &[10], false).unwrap_err();
        assert_eq!(e.field, "spec.domain.cpu.dedicatedCpuPlacement");
        assert!(
            e.message.contains("could not fit 1 core(s)") && e.message.contains("\"1\""),
            "{e}"
        );
        let e = plan(&[0, 1], &[11, 12], &[10], true).unwrap_err();
        assert_eq!(e.field, "spec.domain.cpu.isolateEmulatorThread");
        assert!(e.message.contains("\"0-1\""), "{e}");
    }
}
