//! The kubelet's CPU manager with the real kubelet's two policies (`--cpu-manager-policy`).
//!
//! `static`: a container of a Guaranteed pod whose CPU request is a whole number gets that many
//! CPUs for itself (its cpuset cgroup's `cpuset.cpus`); every other container runs on the
//! shared pool, the node's CPUs less those handed out. The reserved CPUs (`--reserved-cpus`)
//! stay in the shared pool and are never handed out. A pod asking for more than is free is
//! rejected at admission as the real kubelet rejects it. `none`: every container runs on every
//! CPU.
//!
//! The assignments are kept in `<kubelet root>/cpu_manager_state`, as the real kubelet's
//! checkpoint, so a restarted kubelet that adopts its pods keeps their CPUs; virt-handler reads
//! its `policyName` for the `cpumanager` node labels. The file has the real checkpoint's v2
//! fields (`policyName`, `defaultCpuSet`, `entries`) without its checksum, a hash of Go's
//! dump of the struct that nothing but the real kubelet checks.
//!
//! Unlike the real kubelet, CPUs are taken lowest first, without regard for cores, sockets or
//! NUMA cells, and on a machine running several simulated nodes each node hands out the same
//! CPUs as if it were alone.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cgroups::CpuList;
use k8s_openapi::api::core::v1::{Container, Pod};
use serde::{Deserialize, Serialize};

use super::KubeletError;
use super::cgroup::Cgroup;

/// The checkpoint's name in the kubelet's root dir.
pub const STATE_FILE: &str = "cpu_manager_state";

/// `--cpu-manager-policy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuManagerPolicy {
    None,
    /// `reserved`: `--reserved-cpus`.
    Static {
        reserved: CpuList,
    },
}

impl CpuManagerPolicy {
    /// The policy's name as the checkpoint writes it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Static { .. } => "static",
        }
    }

    /// `static`, reserving the lowest of `cpus` for everything else on the node (the real
    /// kubelet refuses the static policy without a reservation); `none` on a single CPU, which
    /// leaves nothing to hand out.
    pub fn default_for(cpus: &CpuList) -> Self {
        match cpus.cpus().next() {
            Some(first) if cpus.cpus().nth(1).is_some() => Self::Static {
                reserved: std::iter::once(first).collect(),
            },
            _ => Self::None,
        }
    }
}

/// The checkpoint file's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Checkpoint {
    policy_name: String,
    default_cpu_set: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    entries: BTreeMap<String, BTreeMap<String, String>>,
}

/// The CPUs of a node and who holds which: the policy as a pure state machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuState {
    policy: CpuManagerPolicy,
    all: CpuList,
    /// pod uid -> container name -> its exclusive CPUs.
    assignments: BTreeMap<String, BTreeMap<String, CpuList>>,
}

impl CpuState {
    pub fn new(policy: CpuManagerPolicy, all: CpuList) -> Self {
        Self {
            policy,
            all,
            assignments: BTreeMap::new(),
        }
    }

    fn assigned(&self) -> impl Iterator<Item = u32> + '_ {
        self.assignments
            .values()
            .flat_map(BTreeMap::values)
            .flat_map(CpuList::cpus)
    }

    /// The shared pool (the checkpoint's `defaultCpuSet`): every CPU no container holds.
    pub fn shared(&self) -> CpuList {
        let held: Vec<u32> = self.assigned().collect();
        self.all.cpus().filter(|c| !held.contains(c)).collect()
    }

    /// The CPUs container `name` of pod `uid` runs on.
    pub fn cpus_of(&self, uid: &str, name: &str) -> CpuList {
        self.assignments
            .get(uid)
            .and_then(|c| c.get(name))
            .cloned()
            .unwrap_or_else(|| self.shared())
    }

    /// Gives the containers of `pod` (uid `uid`) that qualify their exclusive CPUs, all or
    /// none; those it already holds (a restarted kubelet's pods) are kept. The error is the
    /// real kubelet's admission message.
    pub fn admit(&mut self, uid: &str, pod: &Pod) -> Result<(), String> {
        if self.policy == CpuManagerPolicy::None {
            return Ok(());
        }
        let Some(spec) = &pod.spec else {
            return Ok(());
        };
        if super::worker::qos_class(pod) != "Guaranteed" {
            return Ok(());
        }
        let before = self.assignments.get(uid).cloned();
        for c in spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
        {
            let Some(n) = exclusive_cpus(c) else {
                continue;
            };
            if let Err(e) = self.allocate(uid, &c.name, n) {
                match &before {
                    Some(b) => self.assignments.insert(uid.to_owned(), b.clone()),
                    None => self.assignments.remove(uid),
                };
                return Err(format!("Allocate failed due to {e}, which is unexpected"));
            }
        }
        Ok(())
    }

    fn allocate(&mut self, uid: &str, name: &str, n: usize) -> Result<(), String> {
        if self
            .assignments
            .get(uid)
            .is_some_and(|c| c.contains_key(name))
        {
            return Ok(());
        }
        let reserved = match &self.policy {
            CpuManagerPolicy::Static { reserved } => reserved.clone(),
            CpuManagerPolicy::None => CpuList::default(),
        };
        let free: Vec<u32> = self
            .shared()
            .cpus()
            .filter(|c| !reserved.cpus().any(|r| r == *c))
            .collect();
        if n > free.len() {
            return Err(format!(
                "not enough cpus available to satisfy request: requested={n}, available={}",
                free.len()
            ));
        }
        self.assignments
            .entry(uid.to_owned())
            .or_default()
            .insert(name.to_owned(), free[..n].iter().copied().collect());
        Ok(())
    }

    /// Frees what pod `uid` holds; whether it held anything.
    pub fn release(&mut self, uid: &str) -> bool {
        self.assignments.remove(uid).is_some()
    }

    fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            policy_name: self.policy.name().to_owned(),
            default_cpu_set: match self.policy {
                CpuManagerPolicy::None => String::new(),
                CpuManagerPolicy::Static { .. } => self.shared().to_string(),
            },
            entries: self
                .assignments
                .iter()
                .map(|(uid, c)| {
                    let c = c.iter().map(|(n, l)| (n.clone(), l.to_string())).collect();
                    (uid.clone(), c)
                })
                .collect(),
        }
    }

    /// Takes over the assignments of an earlier kubelet's checkpoint with the same policy; a
    /// policy change starts afresh, as the real kubelet refuses to start over a checkpoint of
    /// another policy until it is removed.
    fn restore(&mut self, checkpoint: &Checkpoint) {
        if checkpoint.policy_name != self.policy.name() {
            return;
        }
        for (uid, containers) in &checkpoint.entries {
            for (name, cpus) in containers {
                if let Ok(cpus) = cpus.parse::<CpuList>() {
                    self.assignments
                        .entry(uid.clone())
                        .or_default()
                        .insert(name.clone(), cpus);
                }
            }
        }
    }
}

/// How many CPUs the static policy gives `c` for itself (in a Guaranteed pod): its CPU
/// request when that is a whole number (`guaranteedCPUs`).
pub fn exclusive_cpus(c: &Container) -> Option<usize> {
    let request = c
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref().or(r.limits.as_ref()))
        .and_then(|m| m.get("cpu"))?;
    let milli = api::quantity::ParsedQuantity::from_quantity(request)
        .ok()?
        .milli_value();
    (milli % 1000 == 0 && milli > 0)
        .then(|| usize::try_from(milli / 1000).ok())
        .flatten()
}

/// The node's CPUs, as the kernel lists the online ones.
pub fn online_cpus() -> CpuList {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| std::iter::once(0).collect())
}

/// The CPU manager of one kubelet: its state, its checkpoint file, and the cpusets it writes.
#[derive(Debug)]
pub struct CpuManager {
    node: String,
    file: PathBuf,
    state: Mutex<CpuState>,
}

impl CpuManager {
    /// Starts with `policy` over the machine's CPUs; `adopting` (a restarted kubelet taking
    /// over its pods) keeps the assignments of the checkpoint in `kubelet_dir`.
    pub fn start(
        node: &str,
        kubelet_dir: &Path,
        policy: CpuManagerPolicy,
        adopting: bool,
    ) -> Result<Self, KubeletError> {
        let file = kubelet_dir.join(STATE_FILE);
        let mut state = CpuState::new(policy, online_cpus());
        if adopting
            && let Some(checkpoint) = std::fs::read(&file)
                .ok()
                .and_then(|b| serde_json::from_slice::<Checkpoint>(&b).ok())
        {
            state.restore(&checkpoint);
        }
        let manager = Self {
            node: node.to_owned(),
            file,
            state: Mutex::new(state),
        };
        manager.save()?;
        Ok(manager)
    }

    fn with<T>(&self, f: impl FnOnce(&mut CpuState) -> T) -> T {
        f(&mut self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Writes the checkpoint whole (a reader never sees half a file).
    fn save(&self) -> Result<(), KubeletError> {
        let bytes = self
            .with(|s| serde_json::to_vec(&s.checkpoint()))
            .map_err(|e| KubeletError::Io {
                path: self.file.display().to_string(),
                source: std::io::Error::other(e),
            })?;
        let partial = self.file.with_extension("partial");
        std::fs::write(&partial, bytes)
            .and_then(|()| std::fs::rename(&partial, &self.file))
            .map_err(|source| KubeletError::Io {
                path: self.file.display().to_string(),
                source,
            })
    }

    /// Admits `pod`: its qualifying containers' CPUs are taken from the shared pool, which
    /// every other container of the node then shrinks to. The error is why the pod is
    /// rejected.
    pub fn admit(&self, uid: &str, pod: &Pod) -> Result<(), String> {
        let before = self.with(|s| s.shared());
        self.with(|s| s.admit(uid, pod))?;
        if self.with(|s| s.shared()) != before {
            if let Err(e) = self.save() {
                tracing::warn!(error = %e, "writing the CPU manager checkpoint");
            }
            self.reconcile();
        }
        Ok(())
    }

    /// Frees pod `uid`'s CPUs back to the shared pool.
    pub fn release(&self, uid: &str) {
        if self.with(|s| s.release(uid)) {
            if let Err(e) = self.save() {
                tracing::warn!(error = %e, "writing the CPU manager checkpoint");
            }
            self.reconcile();
        }
    }

    /// Sets the cpuset of container `name` of pod `uid`, before it starts.
    pub fn apply(&self, cgroup: &Cgroup, uid: &str, name: &str) -> Result<(), KubeletError> {
        cgroup.set_cpus(&self.with(|s| s.cpus_of(uid, name)).to_string())
    }

    /// Sets every container's cpuset on the node to what the state says (the real kubelet's
    /// `reconcileState`), right after the shared pool changed.
    fn reconcile(&self) {
        let node = Cgroup::node(&self.node);
        for (uid, name, cgroup) in node.containers() {
            if let Err(e) = self.apply(&cgroup, &uid, &name) {
                tracing::warn!(%uid, container = %name, error = %e, "updating a cpuset");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(containers: &serde_json::Value) -> Pod {
        serde_json::from_value(json!({"spec": {"containers": containers}})).unwrap()
    }

    fn container(
        name: &str,
        requests: &serde_json::Value,
        limits: &serde_json::Value,
    ) -> serde_json::Value {
        json!({"name": name, "resources": {"requests": requests, "limits": limits}})
    }

    fn guaranteed(name: &str, cpu: &str) -> serde_json::Value {
        let r = json!({"cpu": cpu, "memory": "64Mi"});
        container(name, &r, &r)
    }

    fn state(cpus: &str, reserved: &str) -> CpuState {
        CpuState::new(
            CpuManagerPolicy::Static {
                reserved: reserved.parse().unwrap(),
            },
            cpus.parse().unwrap(),
        )
    }

    #[test]
    fn whole_cpus_of_guaranteed_pods_are_exclusive_and_the_rest_share() {
        let mut s = state("0-3", "0");
        // Two whole CPUs for `a`, a fraction for `b`: only `a`'s are its own.
        s.admit(
            "p1",
            &pod(&json!([guaranteed("a", "2"), guaranteed("b", "500m")])),
        )
        .unwrap();
        assert_eq!(s.cpus_of("p1", "a").to_string(), "1-2");
        assert_eq!(s.cpus_of("p1", "b").to_string(), "0,3");
        // Burstable: shared, whatever its request.
        let burstable = pod(&json!([container(
            "c",
            &json!({"cpu": "1"}),
            &json!({"cpu": "2"})
        )]));
        s.admit("p2", &burstable).unwrap();
        assert_eq!(s.cpus_of("p2", "c").to_string(), "0,3");
        assert_eq!(s.checkpoint().default_cpu_set, "0,3");
        // Admitting again (a restarted kubelet's pod) takes nothing more.
        s.admit("p1", &pod(&json!([guaranteed("a", "2")]))).unwrap();
        assert_eq!(s.shared().to_string(), "0,3");
        assert!(s.release("p1"));
        assert_eq!(s.shared().to_string(), "0-3");
        assert!(!s.release("p1"));
    }

    #[test]
    fn the_reserved_cpus_are_never_handed_out_and_a_short_pod_is_rejected_whole() {
        let mut s = state("0-1", "0");
        let e = s
            .admit(
                "p",
                &pod(&json!([guaranteed("a", "1"), guaranteed("b", "1")])),
            )
            .unwrap_err();
        assert_eq!(
            e,
            "Allocate failed due to not enough cpus available to satisfy request: \
             requested=1, available=0, which is unexpected"
        );
        // `a`'s CPU went back with the rejection.
        assert_eq!(s.shared().to_string(), "0-1");
        s.admit("q", &pod(&json!([guaranteed("a", "1")]))).unwrap();
        assert_eq!(s.cpus_of("q", "a").to_string(), "1");
    }

    #[test]
    fn the_none_policy_shares_everything() {
        let mut s = CpuState::new(CpuManagerPolicy::None, "0-1".parse().unwrap());
        s.admit("p", &pod(&json!([guaranteed("a", "1")]))).unwrap();
        assert_eq!(s.cpus_of("p", "a").to_string(), "0-1");
        assert_eq!(s.checkpoint().policy_name, "none");
        assert_eq!(s.checkpoint().default_cpu_set, "");
    }

    #[test]
    fn a_checkpoint_of_the_same_policy_restores_the_assignments() {
        let mut s = state("0-3", "0");
        s.admit("p", &pod(&json!([guaranteed("a", "2")]))).unwrap();
        let text = serde_json::to_string(&s.checkpoint()).unwrap();
        assert_eq!(
            text,
            r#"{"policyName":"static","defaultCpuSet":"0,3","entries":{"p":{"a":"1-2"}}}"#
        );
        let mut again = state("0-3", "0");
        again.restore(&serde_json::from_str(&text).unwrap());
        assert_eq!(again, s);
        let mut other = CpuState::new(CpuManagerPolicy::None, "0-3".parse().unwrap());
        other.restore(&serde_json::from_str(&text).unwrap());
        assert_eq!(other.shared().to_string(), "0-3");
    }

    #[test]
    fn the_default_reserves_the_first_cpu_when_there_are_two() {
        let two: CpuList = "2-3".parse().unwrap();
        assert_eq!(
            CpuManagerPolicy::default_for(&two),
            CpuManagerPolicy::Static {
                reserved: "2".parse().unwrap()
            }
        );
        assert_eq!(
            CpuManagerPolicy::default_for(&"0".parse().unwrap()),
            CpuManagerPolicy::None
        );
    }
}
