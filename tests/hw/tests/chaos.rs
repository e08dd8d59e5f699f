//! The chaos suite (issue 20): a bounded, seeded loop over the whole stack on two nodes. Each
//! round makes one change a user makes (update, pause or unpause, migrate, restart a VM; create
//! or delete a second VM; scale a VMIRS between 0 and 1) and, at a random moment right after
//! it, SIGKILLs one of: the virt-controller leader or its follower, a virt-handler, a
//! virt-launcher, a QEMU, a virt-api replica or the virt-operator leader, or kills and restarts
//! kube-apiserver, or restarts a node's kubelet, whose pods run on and are adopted by the new one
//! (`localcluster restart`). Then it waits for the invariants to hold:
//! - every VM with `runStrategy: Always` has exactly one VMI, `Running`; the VMIRS has as many
//!   Running VMIs as replicas;
//! - every migration has ended (Succeeded or Failed);
//! - each VMI has exactly one live launcher pod and one QEMU, and no QEMU or live launcher pod
//!   belongs to no VMI;
//! - nothing is stuck with a deletion timestamp (finalizers released);
//! - every KubeVirt component pod is Ready again.
//!
//! It also checks at once that no guest was restarted under the same VMI: a VMI that stayed on its
//! node keeps the QEMU process it had at the end of the previous round.
//!
//! At the end everything is deleted and nothing may be left. `CHAOS_ROUNDS` (default 6) and
//! `CHAOS_SEED` (default: from the clock) set the run; the seed is printed first, so a failure
//! replays with `CHAOS_SEED=<seed>`. Guests boot under TCG on two cores: at most two run at once
//! (the pinned VM plus either the second VM or the VMIRS replica).
//!
//! `CHAOS_ROUNDS=100 cargo test -p e2e --test chaos -- --nocapture` (`cargo test`: nextest ends a
//! test after 10 minutes, about 12 rounds)

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use e2e::{Stack, StackError, is_ready, kill_in_pod, processes, test_guest_firmware, wait_for};
use serde_json::{Value, json};

/// The pinned VM: always there, `runStrategy: Always`.
const PINNED: &str = "chaos-a";
/// The VM that rounds create and delete.
const SECOND: &str = "chaos-b";
const REPLICA_SET: &str = "chaos-rs";
/// A round settles within this: a killed launcher or QEMU means a new VMI and a guest start
/// under TCG, a killed component a container restart (10 s back-off, doubling for a pod killed
/// again).
const SETTLE: Duration = Duration::from_mins(6);
/// The kill lands this long after the change, at most.
const MAX_KILL_DELAY_MS: u64 = 5_000;
const DEFAULT_ROUNDS: usize = 6;
/// QEMU's command line names its guest `guest=<namespace>_<vmi>`; every VMI here starts so.
const QEMU_MARKER: &str = "guest=default_chaos-";
const QEMU: &str = "qemu-system-x86_64";

fn template(labels: &Value) -> Value {
    json!({
        "metadata": {"labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "domain": {
                "cpu": {"cores": 1},
                "memory": {"guest": "128Mi"},
                "firmware": test_guest_firmware(),
                "devices": {"interfaces": [{"name": "default", "masquerade": {}}]},
            },
            "networks": [{"name": "default", "pod": {}}],
        },
    })
}

fn vm(name: &str) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": template(&json!({"chaos": name}))},
    })
}

fn replica_set(replicas: u32) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstanceReplicaSet",
        "metadata": {"name": REPLICA_SET, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"chaos": REPLICA_SET}},
            "template": template(&json!({"chaos": REPLICA_SET})),
        },
    })
}

/// What a round changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Update,
    PauseOrUnpause,
    Migrate,
    Restart,
    CreateSecond,
    DeleteSecond,
    ScaleUp,
    ScaleDown,
}

/// What a round kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victim {
    ControllerLeader,
    ControllerFollower,
    Handler,
    Launcher,
    Qemu,
    VirtApi,
    Operator,
    /// Not a SIGKILL of ours: `localcluster restart kube-apiserver` kills and restarts it.
    KubeApiserver,
    /// `localcluster restart kubelet/<node>` on a node picked at random.
    Kubelet,
}

const VICTIMS: [Victim; 9] = [
    Victim::ControllerLeader,
    Victim::ControllerFollower,
    Victim::Handler,
    Victim::Launcher,
    Victim::Qemu,
    Victim::VirtApi,
    Victim::Operator,
    Victim::KubeApiserver,
    Victim::Kubelet,
];

/// The stack's nodes, which `Victim::Kubelet` picks from.
const NODES: [&str; 2] = ["node-1", "node-2"];

/// Which second guest runs besides the pinned VM, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Second {
    None,
    Vm,
    ReplicaSet,
}

fn list(stack: &Stack, namespace: &str, resource: &str) -> Result<Vec<Value>, String> {
    let out = stack
        .kubectl(&["-n", namespace, "get", resource, "-o", "json"])
        .map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_str(&out).map_err(|e| e.to_string())?;
    Ok(v["items"].as_array().cloned().unwrap_or_default())
}

fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

fn uid(o: &Value) -> &str {
    o["metadata"]["uid"].as_str().unwrap_or_default()
}

fn being_deleted(o: &Value) -> bool {
    o["metadata"]["deletionTimestamp"].is_string()
}

fn pod_alive(pod: &Value) -> bool {
    !matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    )
}

/// A Running VMI's QEMU: the pids in its live launcher pods whose `argv[0]` is QEMU.
fn qemu_of(pods: &[Value], vmi_uid: &str) -> Vec<u32> {
    pods.iter()
        .filter(|p| p["metadata"]["labels"][api::labels::CREATED_BY] == vmi_uid && pod_alive(p))
        .flat_map(|p| e2e::pod_processes(uid(p)))
        .filter(|(_, argv0)| argv0.ends_with(QEMU))
        .map(|(pid, _)| pid)
        .collect()
}

/// Where each Running VMI was and its QEMU, by VMI uid, once a round has settled.
type Homes = BTreeMap<String, (String, u32)>;

struct Chaos {
    stack: Stack,
    rng: fastrand::Rng,
    second: Second,
    homes: Homes,
    kills: BTreeMap<String, usize>,
    checks: usize,
}

impl Chaos {
    fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        self.stack.kubectl(args).map_err(|e| e.to_string())
    }

    fn virtctl(&self, args: &[&str]) -> Result<String, String> {
        self.stack.virtctl(args).map_err(|e| e.to_string())
    }

    fn patch(&self, resource: &str, name: &str, patch: &Value) -> Result<String, String> {
        self.kubectl(&[
            "patch",
            resource,
            name,
            "--type",
            "merge",
            "-p",
            &patch.to_string(),
        ])
    }

    fn changes(&self) -> Vec<Change> {
        let mut all = vec![
            Change::Update,
            Change::PauseOrUnpause,
            Change::Migrate,
            Change::Restart,
        ];
        match self.second {
            Second::None => all.extend([Change::CreateSecond, Change::ScaleUp]),
            Second::Vm => all.push(Change::DeleteSecond),
            Second::ReplicaSet => all.push(Change::ScaleDown),
        }
        all
    }

    /// Makes the change; a refusal (a VM paused cannot migrate, virt-api just killed...) is
    /// part of the game and only printed: the invariants judge the outcome.
    fn change(&mut self, change: Change, round: usize) -> Result<String, String> {
        match change {
            Change::Update => self.patch(
                "vm",
                PINNED,
                &json!({"spec": {"template": {"metadata": {"annotations": {"chaos/round": round.to_string()}}}}}),
            ),
            Change::PauseOrUnpause => {
                let paused = self
                    .stack
                    .get_json("default", "vmi", PINNED)
                    .map_err(|e| e.to_string())?
                    .is_some_and(|v| {
                        v["status"]["conditions"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .any(|c| c["type"] == "Paused" && c["status"] == "True")
                    });
                let verb = if paused { "unpause" } else { "pause" };
                self.virtctl(&[verb, "vm", PINNED])
            }
            Change::Migrate => self.virtctl(&["migrate", PINNED]),
            Change::Restart => self.virtctl(&["restart", PINNED]),
            Change::CreateSecond => {
                self.stack.apply(&vm(SECOND));
                self.second = Second::Vm;
                Ok("created".into())
            }
            Change::DeleteSecond => {
                self.second = Second::None;
                self.kubectl(&["delete", "vm", SECOND, "--wait=false"])
            }
            Change::ScaleUp => {
                self.second = Second::ReplicaSet;
                self.patch("vmirs", REPLICA_SET, &json!({"spec": {"replicas": 1}}))
            }
            Change::ScaleDown => {
                self.second = Second::None;
                self.patch("vmirs", REPLICA_SET, &json!({"spec": {"replicas": 0}}))
            }
        }
    }

    /// SIGKILLs the victim's process; what was killed (or why nothing was).
    fn kill(&mut self, victim: Victim) -> String {
        if victim == Victim::KubeApiserver {
            *self.kills.entry(format!("{victim:?}")).or_default() += 1;
            return match self.stack.restart("kube-apiserver") {
                Ok(out) => out.trim().to_owned(),
                Err(e) => panic!("restarting kube-apiserver: {e}"),
            };
        }
        if victim == Victim::Kubelet {
            let node = NODES[self.rng.usize(..NODES.len())];
            *self.kills.entry(format!("{victim:?}")).or_default() += 1;
            return match self.stack.restart(&format!("kubelet/{node}")) {
                Ok(out) => out.trim().to_owned(),
                Err(e) => panic!("restarting the kubelet of {node}: {e}"),
            };
        }
        let pods = |label: &str, namespace: &str| {
            list(&self.stack, namespace, "pods").map(|pods| {
                pods.into_iter()
                    .filter(|p| p["metadata"]["labels"]["kubevirt.io"] == label && pod_alive(p))
                    .collect::<Vec<_>>()
            })
        };
        let lease_holder = |lease: &str| {
            self.kubectl(&[
                "-n",
                "kubevirt",
                "get",
                "lease",
                lease,
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ])
            .unwrap_or_default()
        };
        let (namespace, label, program) = match victim {
            Victim::ControllerLeader | Victim::ControllerFollower => {
                ("kubevirt", "virt-controller", "virt-controller")
            }
            Victim::Handler => ("kubevirt", "virt-handler", "virt-handler"),
            Victim::Launcher => ("default", "virt-launcher", "virt-launcher"),
            Victim::Qemu => ("default", "virt-launcher", QEMU),
            Victim::VirtApi => ("kubevirt", "virt-api", "virt-api"),
            Victim::Operator => ("kubevirt", "virt-operator", "virt-operator"),
            Victim::KubeApiserver | Victim::Kubelet => unreachable!("restarted above"),
        };
        let candidates = match pods(label, namespace) {
            Ok(p) => p,
            Err(e) => return format!("nothing: listing pods failed: {e}"),
        };
        let chosen: Vec<&Value> = match victim {
            Victim::ControllerLeader | Victim::Operator => {
                let holder = lease_holder(label);
                candidates
                    .iter()
                    .filter(|p| holder.starts_with(name(p)))
                    .collect()
            }
            Victim::ControllerFollower => {
                let holder = lease_holder(label);
                candidates
                    .iter()
                    .filter(|p| !holder.starts_with(name(p)))
                    .collect()
            }
            _ => candidates.iter().collect(),
        };
        let Some(pod) = (!chosen.is_empty()).then(|| chosen[self.rng.usize(..chosen.len())]) else {
            return format!("nothing: no {victim:?} pod");
        };
        let killed = kill_in_pod(uid(pod), program);
        if killed > 0 {
            *self.kills.entry(format!("{victim:?}")).or_default() += 1;
        }
        format!("{program} in {} ({killed} processes)", name(pod))
    }

    /// The VMs and how many VMIRS replicas should run.
    fn expected(&self) -> (Vec<&'static str>, usize) {
        match self.second {
            Second::None => (vec![PINNED], 0),
            Second::Vm => (vec![PINNED, SECOND], 0),
            Second::ReplicaSet => (vec![PINNED], 1),
        }
    }

    /// Every polled invariant, or what does not hold yet. Answers the Running VMIs' homes.
    fn settled(&self) -> Result<Option<Homes>, String> {
        let mut wrong = Vec::new();
        let vmis = list(&self.stack, "default", "vmis")?;
        let pods = list(&self.stack, "default", "pods")?;
        let (vms, replicas) = self.expected();
        let running = |v: &&Value| v["status"]["phase"] == "Running" && !being_deleted(v);
        for vm in &vms {
            let mine: Vec<&Value> = vmis.iter().filter(|v| name(v) == *vm).collect();
            if mine.len() != 1 || !mine.iter().all(running) {
                wrong.push(format!("VM {vm}: its VMI is not one and Running"));
            }
        }
        let from_rs = vmis
            .iter()
            .filter(|v| v["metadata"]["labels"]["chaos"] == REPLICA_SET)
            .filter(running)
            .count();
        if from_rs != replicas {
            wrong.push(format!(
                "VMIRS: {from_rs} Running VMIs, {replicas} replicas"
            ));
        }
        for m in list(&self.stack, "default", "vmim")? {
            if !matches!(m["status"]["phase"].as_str(), Some("Succeeded" | "Failed")) {
                wrong.push(format!(
                    "migration {} is {}",
                    name(&m),
                    m["status"]["phase"]
                ));
            }
        }
        let mut homes = Homes::new();
        let mut owned_qemus = BTreeSet::new();
        for v in vmis.iter().filter(running) {
            let launchers: Vec<&Value> = pods
                .iter()
                .filter(|p| p["metadata"]["labels"][api::labels::CREATED_BY] == uid(v))
                .filter(|p| pod_alive(p))
                .collect();
            let qemus = qemu_of(&pods, uid(v));
            if launchers.len() != 1 || qemus.len() != 1 {
                wrong.push(format!(
                    "VMI {}: {} live launcher pods, QEMU pids {qemus:?}",
                    name(v),
                    launchers.len()
                ));
            }
            // The node of the pod the QEMU runs in, from the same listing: the VMI's
            // `nodeName`, listed a moment before, may still name a migration's source.
            if let ([pod], [pid]) = (&launchers[..], &qemus[..]) {
                let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
                homes.insert(uid(v).to_owned(), (node.to_owned(), *pid));
            }
            owned_qemus.extend(qemus);
        }
        let vmi_uids: BTreeSet<&str> = vmis.iter().map(uid).collect();
        for p in pods
            .iter()
            .filter(|p| p["metadata"]["labels"]["kubevirt.io"] == "virt-launcher" && pod_alive(p))
        {
            let owner = p["metadata"]["labels"][api::labels::CREATED_BY]
                .as_str()
                .unwrap_or_default();
            if !vmi_uids.contains(owner) {
                wrong.push(format!("launcher pod {} has no VMI", name(p)));
            }
        }
        let stray: Vec<u32> = processes(QEMU, QEMU_MARKER)
            .into_iter()
            .filter(|pid| !owned_qemus.contains(pid))
            .collect();
        if !stray.is_empty() {
            wrong.push(format!("QEMU processes of no Running VMI: {stray:?}"));
        }
        for resource in ["vm", "vmi", "vmirs", "vmim", "pods"] {
            for o in list(&self.stack, "default", resource)? {
                if being_deleted(&o) {
                    wrong.push(format!("{resource} {} is being deleted", name(&o)));
                }
            }
        }
        for p in list(&self.stack, "kubevirt", "pods")? {
            if !is_ready(&p) || being_deleted(&p) {
                wrong.push(format!("component pod {} is not Ready", name(&p)));
            }
        }
        if wrong.is_empty() {
            Ok(Some(homes))
        } else {
            Err(wrong.join("; "))
        }
    }

    /// A VMI that stayed on its node keeps its QEMU: its guest was not restarted.
    fn no_guest_restarted(&self, now: &Homes) -> Result<(), String> {
        for (vmi, (node, pid)) in now {
            if let Some((was_node, was_pid)) = self.homes.get(vmi)
                && was_node == node
                && was_pid != pid
            {
                return Err(format!(
                    "VMI {vmi} on {node}: QEMU {was_pid} was replaced by {pid} under the same VMI"
                ));
            }
        }
        Ok(())
    }

    fn settle(&mut self, what: &str) -> Result<(), StackError> {
        let homes = wait_for(what, SETTLE, || self.settled())
            .map_err(|e| self.stack.with_component_logs(e))?;
        self.no_guest_restarted(&homes).map_err(|e| {
            self.stack
                .with_component_logs(StackError::Io(std::io::Error::other(e)))
        })?;
        self.homes = homes;
        self.checks += 1;
        Ok(())
    }
}

#[test]
fn chaos_vms_survive_components_killed_at_random() {
    let rounds: usize = std::env::var("CHAOS_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(DEFAULT_ROUNDS);
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        });
    println!("chaos: seed {seed} (replay with CHAOS_SEED={seed}), {rounds} rounds");
    let started = Instant::now();
    let stack = Stack::up_nodes(2).expect("the stack on two nodes");
    stack.apply(&vm(PINNED));
    stack.apply(&replica_set(0));
    let mut chaos = Chaos {
        stack,
        rng: fastrand::Rng::with_seed(seed),
        second: Second::None,
        homes: Homes::new(),
        kills: BTreeMap::new(),
        checks: 0,
    };
    chaos.settle("the pinned VM to run").unwrap();
    for round in 1..=rounds {
        let round_started = Instant::now();
        let changes = chaos.changes();
        let change = changes[chaos.rng.usize(..changes.len())];
        let victim = VICTIMS[chaos.rng.usize(..VICTIMS.len())];
        let delay = Duration::from_millis(chaos.rng.u64(..MAX_KILL_DELAY_MS));
        let answer = chaos.change(change, round);
        // The kill's moment is the point of the round, not a wait for a state.
        std::thread::sleep(delay);
        let killed = chaos.kill(victim);
        chaos
            .settle(&format!("round {round} to settle"))
            .unwrap_or_else(|e| {
                panic!("round {round}: {change:?} ({answer:?}), killed {killed}: {e}")
            });
        println!(
            "chaos: round {round}/{rounds}: {change:?} ({}), after {} ms killed {killed}; settled in {} s",
            answer.map_or_else(
                |e| format!("refused: {}", e.lines().next().unwrap_or_default()),
                |_| "done".into()
            ),
            delay.as_millis(),
            round_started.elapsed().as_secs()
        );
    }
    chaos
        .kubectl(&["delete", "vm,vmirs", "--all", "--wait=false"])
        .unwrap();
    wait_for("everything to be gone", SETTLE, || {
        let left: Vec<String> = ["vm", "vmi", "vmirs", "pods"]
            .iter()
            .flat_map(|r| {
                list(&chaos.stack, "default", r)
                    .unwrap_or_default()
                    .into_iter()
                    .map(move |o| format!("{r}/{}", name(&o)))
            })
            .chain(
                processes(QEMU, QEMU_MARKER)
                    .into_iter()
                    .map(|pid| format!("QEMU {pid}")),
            )
            .collect();
        left.is_empty()
            .then_some(Some(()))
            .ok_or_else(|| left.join(", "))
    })
    .map_err(|e| chaos.stack.with_component_logs(e))
    .unwrap();
    println!(
        "chaos: seed {seed}: {rounds} rounds, kills {:?}, {} invariant checks passed, everything deleted; {} s",
        chaos.kills,
        chaos.checks,
        started.elapsed().as_secs()
    );
}
