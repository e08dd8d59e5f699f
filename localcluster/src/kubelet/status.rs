//! Pod status from the kubelet's view of its containers: a pure function, so the phase and
//! condition rules (Kubernetes' `getPhase`) have table tests.

use serde_json::{Value, json};

/// A container's state as `ContainerStatus.state` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum State {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running {
        started_at: String,
    },
    Terminated {
        exit_code: i32,
        signal: Option<i32>,
        reason: String,
        started_at: String,
        finished_at: String,
    },
}

impl State {
    pub fn waiting(reason: &str) -> Self {
        Self::Waiting {
            reason: reason.into(),
            message: None,
        }
    }

    fn to_json(&self) -> Value {
        match self {
            Self::Waiting { reason, message } => {
                let mut w = json!({"reason": reason});
                if let Some(m) = message {
                    w["message"] = json!(m);
                }
                json!({"waiting": w})
            }
            Self::Running { started_at } => json!({"running": {"startedAt": started_at}}),
            Self::Terminated {
                exit_code,
                signal,
                reason,
                started_at,
                finished_at,
            } => {
                let mut t = json!({"exitCode": exit_code, "reason": reason,
                    "startedAt": started_at, "finishedAt": finished_at});
                if let Some(s) = signal {
                    t["signal"] = json!(s);
                }
                json!({"terminated": t})
            }
        }
    }

    pub fn is_running(&self) -> bool {
        matches!(self, Self::Running { .. })
    }

    pub fn succeeded(&self) -> bool {
        matches!(self, Self::Terminated { exit_code: 0, .. })
    }

    pub fn failed(&self) -> bool {
        matches!(self, Self::Terminated { exit_code, .. } if *exit_code != 0)
    }
}

/// One container as the kubelet tracks it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    pub name: String,
    pub image: String,
    pub state: State,
    pub last: Option<State>,
    pub restart_count: i32,
    pub ready: bool,
    /// Its process has started at least once.
    pub started: bool,
    /// `repository@manifest-digest` of the image, once resolved.
    pub image_id: String,
}

impl Record {
    pub fn new(name: &str, image: &str) -> Self {
        Self {
            name: name.into(),
            image: image.into(),
            state: State::waiting("PodInitializing"),
            last: None,
            restart_count: 0,
            ready: false,
            started: false,
            image_id: String::new(),
        }
    }

    fn to_json(&self, uid: &str) -> Value {
        let mut v = json!({
            "name": self.name, "image": self.image, "imageID": self.image_id,
            "state": self.state.to_json(), "ready": self.ready,
            "restartCount": self.restart_count, "started": self.state.is_running(),
            "lastState": self.last.as_ref().map_or(json!({}), State::to_json),
        });
        if self.started {
            v["containerID"] = json!(format!("localcluster://{uid}/{}", self.name));
        }
        v
    }
}

/// The pod-level inputs of a status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView<'a> {
    pub uid: &'a str,
    pub restart_policy: &'a str,
    pub init: &'a [Record],
    pub app: &'a [Record],
    pub pod_ip: Option<&'a str>,
    pub host_ip: &'a str,
    pub start_time: &'a str,
    /// Sandbox (network, volumes) set up.
    pub sandbox_ready: bool,
    /// Why the sandbox is not ready, if it failed.
    pub sandbox_error: Option<&'a str>,
    pub qos_class: &'a str,
    /// `spec.readinessGates` condition types.
    pub readiness_gates: &'a [String],
    /// The conditions on the pod object now, where other controllers set the gates'.
    pub current_conditions: &'a [Value],
}

/// The pod phase by Kubernetes' rules.
pub fn phase(v: &PodView<'_>) -> &'static str {
    let inits_done = v.init.iter().all(|c| c.state.succeeded());
    if !inits_done {
        let failed_init = v.init.iter().any(|c| c.state.failed());
        return if failed_init && v.restart_policy == "Never" {
            "Failed"
        } else {
            "Pending"
        };
    }
    let running = v.app.iter().filter(|c| c.state.is_running()).count();
    let succeeded = v.app.iter().filter(|c| c.state.succeeded()).count();
    let failed = v.app.iter().filter(|c| c.state.failed()).count();
    let terminated = succeeded + failed;
    let never_started = v.app.iter().filter(|c| !c.started).count();
    if never_started > 0 && running == 0 && terminated == 0 {
        return "Pending";
    }
    if running > 0 {
        return "Running";
    }
    if terminated == v.app.len() && !v.app.is_empty() {
        return match v.restart_policy {
            "Always" => "Running",
            "OnFailure" if failed > 0 => "Running",
            _ if failed > 0 => "Failed",
            _ => "Succeeded",
        };
    }
    // Some waiting to restart after having run: still Running, like the kubelet.
    if v.app.iter().any(|c| c.started) {
        "Running"
    } else {
        "Pending"
    }
}

/// A condition the kubelet owns. `reason` and `message` are always present (null when unset)
/// because the status is written as a strategic merge patch, which merges conditions by type:
/// a null removes what an earlier write set.
fn condition(kind: &str, ok: bool, why: Option<(&str, String)>, now: &str) -> Value {
    let (reason, message) = why.filter(|_| !ok).unzip();
    json!({"type": kind, "status": if ok { "True" } else { "False" },
        "lastProbeTime": null, "lastTransitionTime": now,
        "reason": reason, "message": message})
}

/// The kubelet's `Ready`: `ContainersReady` and then every readiness gate's condition `True`,
/// with the real kubelet's reasons and messages (`GeneratePodReadyCondition`).
fn ready_condition(v: &PodView<'_>, containers: &Value, now: &str) -> Value {
    if containers["status"] != "True" {
        let mut c = containers.clone();
        c["type"] = json!("Ready");
        return c;
    }
    let unready: Vec<String> = v
        .readiness_gates
        .iter()
        .filter_map(|gate| {
            match v
                .current_conditions
                .iter()
                .find(|c| c["type"] == gate.as_str())
            {
                None => Some(format!(
                    "corresponding condition of pod readiness gate {gate:?} does not exist."
                )),
                Some(c) if c["status"] != "True" => Some(format!(
                    "the status of pod readiness gate {gate:?} is not \"True\", but {}",
                    c["status"].as_str().unwrap_or_default()
                )),
                Some(_) => None,
            }
        })
        .collect();
    if unready.is_empty() {
        condition("Ready", true, None, now)
    } else {
        condition(
            "Ready",
            false,
            Some(("ReadinessGatesNotReady", unready.join(", "))),
            now,
        )
    }
}

fn names(records: &[Record], pick: impl Fn(&Record) -> bool) -> String {
    let picked: Vec<&str> = records
        .iter()
        .filter(|r| pick(r))
        .map(|r| r.name.as_str())
        .collect();
    picked.join(" ")
}

/// The status of a pod the kubelet rejected at admission (the real kubelet's `rejectPod`):
/// Failed, with `UnexpectedAdmissionError`, as a resource manager's refusal is reported.
pub fn rejected(message: &str, qos_class: &str) -> Value {
    json!({
        "phase": "Failed",
        "reason": "UnexpectedAdmissionError",
        "message": format!("Pod was rejected: {message}"),
        "qosClass": qos_class,
    })
}

/// The `status` object the kubelet writes. `previous` conditions keep their transition times.
/// It holds only the conditions the kubelet owns; others on the pod (readiness gates set by
/// controllers, `DisruptionTarget`) are left alone by the strategic merge patch that writes it.
pub fn pod_status(v: &PodView<'_>, previous: &[Value], now: &str) -> Value {
    let phase = phase(v);
    let initialized = v.init.iter().all(|c| c.state.succeeded());
    let all_ready = !v.app.is_empty() && v.app.iter().all(|c| c.ready);
    let containers_ready = condition(
        "ContainersReady",
        all_ready,
        Some((
            "ContainersNotReady",
            format!(
                "containers with unready status: [{}]",
                names(v.app, |r| !r.ready)
            ),
        )),
        now,
    );
    let mut conditions = vec![
        condition(
            "PodReadyToStartContainers",
            v.sandbox_ready,
            v.sandbox_error
                .map(|m| ("SandboxSetupFailed", m.to_string())),
            now,
        ),
        condition(
            "Initialized",
            initialized,
            Some((
                "ContainersNotInitialized",
                format!(
                    "containers with incomplete status: [{}]",
                    names(v.init, |r| !r.state.succeeded())
                ),
            )),
            now,
        ),
        ready_condition(v, &containers_ready, now),
        containers_ready,
        condition("PodScheduled", true, None, now),
    ];
    for c in &mut conditions {
        if let Some(old) = previous.iter().find(|o| o["type"] == c["type"])
            && old["status"] == c["status"]
            && old["lastTransitionTime"].is_string()
        {
            c["lastTransitionTime"] = old["lastTransitionTime"].clone();
        }
    }
    let mut status = json!({
        "phase": phase,
        "conditions": conditions,
        "hostIP": v.host_ip,
        "hostIPs": [{"ip": v.host_ip}],
        "startTime": v.start_time,
        "qosClass": v.qos_class,
        "initContainerStatuses": v.init.iter().map(|c| c.to_json(v.uid)).collect::<Vec<_>>(),
        "containerStatuses": v.app.iter().map(|c| c.to_json(v.uid)).collect::<Vec<_>>(),
    });
    if let Some(ip) = v.pod_ip {
        status["podIP"] = json!(ip);
        status["podIPs"] = json!([{"ip": ip}]);
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(state: State, started: bool) -> Record {
        Record {
            started,
            ready: state.is_running(),
            state,
            ..Record::new("c", "i")
        }
    }

    fn running() -> Record {
        rec(
            State::Running {
                started_at: "t".into(),
            },
            true,
        )
    }

    fn exited(code: i32) -> Record {
        rec(
            State::Terminated {
                exit_code: code,
                signal: None,
                reason: if code == 0 { "Completed" } else { "Error" }.into(),
                started_at: "t".into(),
                finished_at: "t".into(),
            },
            true,
        )
    }

    fn waiting() -> Record {
        rec(State::waiting("ContainerCreating"), false)
    }

    fn view<'a>(policy: &'a str, init: &'a [Record], app: &'a [Record]) -> PodView<'a> {
        PodView {
            uid: "u",
            restart_policy: policy,
            init,
            app,
            pod_ip: Some("10.0.0.2"),
            host_ip: "192.0.2.2",
            start_time: "t",
            sandbox_ready: true,
            sandbox_error: None,
            qos_class: "BestEffort",
            readiness_gates: &[],
            current_conditions: &[],
        }
    }

    type Case = (
        &'static str,
        &'static str,
        Vec<Record>,
        Vec<Record>,
        &'static str,
    );

    #[test]
    fn phases() {
        let cases: Vec<Case> = vec![
            ("not started", "Always", vec![], vec![waiting()], "Pending"),
            (
                "init running",
                "Always",
                vec![running()],
                vec![waiting()],
                "Pending",
            ),
            (
                "init failed, Never",
                "Never",
                vec![exited(1)],
                vec![waiting()],
                "Failed",
            ),
            (
                "init failed, OnFailure",
                "OnFailure",
                vec![exited(1)],
                vec![waiting()],
                "Pending",
            ),
            (
                "running",
                "Always",
                vec![exited(0)],
                vec![running()],
                "Running",
            ),
            (
                "one of two running",
                "Never",
                vec![],
                vec![running(), exited(1)],
                "Running",
            ),
            (
                "all succeeded, Never",
                "Never",
                vec![],
                vec![exited(0)],
                "Succeeded",
            ),
            (
                "all succeeded, OnFailure",
                "OnFailure",
                vec![],
                vec![exited(0)],
                "Succeeded",
            ),
            (
                "all succeeded, Always",
                "Always",
                vec![],
                vec![exited(0)],
                "Running",
            ),
            (
                "failed, Never",
                "Never",
                vec![],
                vec![exited(0), exited(2)],
                "Failed",
            ),
            (
                "failed, OnFailure",
                "OnFailure",
                vec![],
                vec![exited(2)],
                "Running",
            ),
        ];
        for (what, policy, init, app, want) in cases {
            assert_eq!(phase(&view(policy, &init, &app)), want, "{what}");
        }
    }

    #[test]
    fn conditions_and_statuses() {
        let app = [running()];
        let s = pod_status(&view("Always", &[], &app), &[], "now");
        let cond = |t: &str| {
            s["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == t)
                .unwrap()["status"]
                .clone()
        };
        assert_eq!(cond("Ready"), "True");
        assert_eq!(cond("Initialized"), "True");
        assert_eq!(s["podIP"], "10.0.0.2");
        assert_eq!(
            s["containerStatuses"][0]["state"]["running"]["startedAt"],
            "t"
        );
        assert_eq!(
            s["containerStatuses"][0]["containerID"],
            "localcluster://u/c"
        );

        let not_ready = [Record {
            ready: false,
            ..running()
        }];
        let previous = s["conditions"].as_array().unwrap().clone();
        let s2 = pod_status(&view("Always", &[], &not_ready), &previous, "later");
        let ready = s2["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap();
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["reason"], "ContainersNotReady");
        assert_eq!(ready["lastTransitionTime"], "later");
        let scheduled = s2["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "PodScheduled")
            .unwrap();
        assert_eq!(
            scheduled["lastTransitionTime"], "now",
            "unchanged keeps its time"
        );
    }

    fn cond<'a>(status: &'a Value, kind: &str) -> &'a Value {
        status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == kind)
            .unwrap()
    }

    #[test]
    fn readiness_gates_hold_ready_until_their_conditions_are_true() {
        const GATE: &str = "kubevirt.io/virtual-machine-unpaused";
        let app = [running()];
        let gates = [GATE.to_string()];
        let gated = |current: &[Value]| {
            let v = PodView {
                readiness_gates: &gates,
                current_conditions: current,
                ..view("Always", &[], &app)
            };
            pod_status(&v, &[], "now")
        };

        let missing = gated(&[]);
        let ready = cond(&missing, "Ready");
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["reason"], "ReadinessGatesNotReady");
        assert_eq!(
            ready["message"],
            "corresponding condition of pod readiness gate \"kubevirt.io/virtual-machine-unpaused\" does not exist."
        );
        assert_eq!(cond(&missing, "ContainersReady")["status"], "True");

        let ready = cond(&gated(&[json!({"type": GATE, "status": "False"})]), "Ready").clone();
        assert_eq!(ready["status"], "False");
        assert_eq!(
            ready["message"],
            "the status of pod readiness gate \"kubevirt.io/virtual-machine-unpaused\" is not \"True\", but False"
        );

        let status = gated(&[json!({"type": GATE, "status": "True"})]);
        let ready = cond(&status, "Ready");
        assert_eq!(ready["status"], "True");
        assert!(ready["reason"].is_null(), "a null clears an earlier reason");
        assert!(
            status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["type"] != GATE),
            "the kubelet does not write conditions it does not own"
        );
    }

    #[test]
    fn unready_containers_are_named_and_gates_wait_for_them() {
        let app = [
            running(),
            Record {
                name: "slow".into(),
                ready: false,
                ..running()
            },
        ];
        let gates = ["g".to_string()];
        let v = PodView {
            readiness_gates: &gates,
            ..view("Always", &[], &app)
        };
        let status = pod_status(&v, &[], "now");
        let ready = cond(&status, "Ready");
        assert_eq!(ready["reason"], "ContainersNotReady");
        assert_eq!(ready["message"], "containers with unready status: [slow]");
    }
}
