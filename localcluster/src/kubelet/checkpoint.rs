//! What outlives a kubelet restart. Under a real kubelet the container runtime owns the
//! containers, so a restarted kubelet finds its pods still running and asks the runtime what
//! they are. Here the node's processes are children of `localcluster up`, which stays; the
//! pieces a restarted kubelet needs are each pod's checkpoint (written by its worker whenever
//! the sandbox or a container changes) and [`ContainerExits`], where every container's waiter
//! leaves its exit for whichever worker runs the pod by then.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::ExitStatus;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::status::Record;
use super::volumes::HostVolume;

/// The checkpoint's file in the pod's directory (`<pods dir>/<uid>/`).
const FILE: &str = "kubelet-checkpoint.json";

/// One pod as its worker last saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PodCheckpoint {
    pub pod_ip: Option<String>,
    /// The address of the pod's own network (none for a hostNetwork pod).
    pub network_ip: Option<Ipv4Addr>,
    /// The pause process holding the pod's PID namespace.
    pub pause: Option<u32>,
    pub start_time: String,
    pub volumes: BTreeMap<String, HostVolume>,
    pub init: Vec<ContainerCheckpoint>,
    pub app: Vec<ContainerCheckpoint>,
}

/// One container: its record and, while it runs, its process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ContainerCheckpoint {
    pub pid: Option<u32>,
    pub started_at: String,
    pub record: Record,
}

impl PodCheckpoint {
    /// Writes the checkpoint into `pod_dir`, replacing the last one whole (a restart never
    /// reads half a file).
    pub fn write(&self, pod_dir: &Path) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        let partial = pod_dir.join(format!("{FILE}.partial"));
        std::fs::write(&partial, bytes)?;
        std::fs::rename(&partial, pod_dir.join(FILE))
    }

    /// The checkpoint in `pod_dir`, if there is a readable one.
    pub fn read(pod_dir: &Path) -> Option<Self> {
        let path = pod_dir.join(FILE);
        let bytes = std::fs::read(&path).ok()?;
        match serde_json::from_slice(&bytes) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "unreadable pod checkpoint");
                None
            }
        }
    }
}

/// Container exits by pid, kept for the node across kubelet restarts.
#[derive(Debug, Default)]
pub(crate) struct ContainerExits {
    inner: Mutex<Exits>,
}

#[derive(Debug, Default)]
struct Exits {
    /// pid -> how it ended; taken by the pod's worker.
    ended: HashMap<u32, std::io::Result<ExitStatus>>,
    /// Pod uid -> its worker, told the pid of each exit.
    workers: HashMap<String, mpsc::UnboundedSender<u32>>,
}

impl ContainerExits {
    /// Called by a container's waiter when its process ended.
    pub fn record(&self, uid: &str, pid: u32, status: std::io::Result<ExitStatus>) {
        if let Ok(mut exits) = self.inner.lock() {
            exits.ended.insert(pid, status);
            if let Some(worker) = exits.workers.get(uid) {
                let _ = worker.send(pid);
            }
        }
    }

    /// Tells the pod's (new) worker of every exit from now on.
    pub fn listen(&self, uid: &str) -> mpsc::UnboundedReceiver<u32> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut exits) = self.inner.lock() {
            exits.workers.insert(uid.to_owned(), tx);
        }
        rx
    }

    /// How `pid` ended, once it has; the exit is handed out once.
    pub fn take(&self, pid: u32) -> Option<std::io::Result<ExitStatus>> {
        self.inner.lock().ok()?.ended.remove(&pid)
    }

    /// The pod is gone: nobody listens for it any more, and exits of its processes that no
    /// worker took are dropped.
    pub fn forget(&self, uid: &str, pids: impl IntoIterator<Item = u32>) {
        if let Ok(mut exits) = self.inner.lock() {
            exits.workers.remove(uid);
            for pid in pids {
                exits.ended.remove(&pid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::status::State;

    #[test]
    fn a_checkpoint_reads_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(PodCheckpoint::read(dir.path()), None);
        let mut record = Record::new("main", "tools");
        record.state = State::Running {
            started_at: "2026-11-27T18:00:00Z".into(),
        };
        record.restart_count = 2;
        let checkpoint = PodCheckpoint {
            pod_ip: Some("10.244.1.7".into()),
            network_ip: Some(Ipv4Addr::new(10, 244, 1, 7)),
            pause: Some(4242),
            start_time: "2026-11-27T17:59:00Z".into(),
            volumes: BTreeMap::from([(
                "data".into(),
                HostVolume {
                    path: dir.path().join("volumes/data"),
                    read_only: true,
                    block: false,
                },
            )]),
            init: Vec::new(),
            app: vec![ContainerCheckpoint {
                pid: Some(4243),
                started_at: "2026-11-27T18:00:00Z".into(),
                record,
            }],
        };
        checkpoint.write(dir.path()).unwrap();
        assert_eq!(PodCheckpoint::read(dir.path()), Some(checkpoint));
        std::fs::write(dir.path().join(FILE), b"{\"podIp\":").unwrap();
        assert_eq!(
            PodCheckpoint::read(dir.path()),
            None,
            "a torn file is no checkpoint"
        );
    }

    #[test]
    fn exits_wait_for_the_worker_that_takes_them() {
        use std::os::unix::process::ExitStatusExt as _;
        let exits = ContainerExits::default();
        // No worker listens (the kubelet is restarting): the exit is kept.
        exits.record("pod-a", 10, Ok(ExitStatus::from_raw(9)));
        let mut worker = exits.listen("pod-a");
        exits.record("pod-a", 11, Err(std::io::Error::other("wait failed")));
        exits.record("pod-b", 12, Ok(ExitStatus::from_raw(0)));
        assert_eq!(worker.try_recv().ok(), Some(11));
        assert!(worker.try_recv().is_err(), "only pod-a's exits are told");
        let signal = exits.take(10).and_then(Result::ok).and_then(|s| s.signal());
        assert_eq!(signal, Some(9));
        assert!(exits.take(10).is_none(), "an exit is handed out once");
        assert!(exits.take(11).is_some_and(|s| s.is_err()));
        exits.forget("pod-b", [12]);
        assert!(exits.take(12).is_none());
    }
}
