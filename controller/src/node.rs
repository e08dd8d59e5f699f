//! The node controller's decisions (KubeVirt's `NodeController`): a node whose virt-handler
//! stopped heartbeating is marked unschedulable, and its VMIs that have no running launcher
//! pod are failed, so their VMs and ReplicaSets can replace them elsewhere.

use std::time::Duration;

use api::labels;
use api::{VirtualMachineInstance, VirtualMachineInstancePhase};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;

use crate::vmi::{is_final, is_launcher_of};

/// How old a heartbeat may get (KubeVirt's default).
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_mins(5);

/// The node's last heartbeat, if it has a readable one.
pub fn last_heartbeat(node: &Node) -> Option<Timestamp> {
    let raw = node
        .metadata
        .annotations
        .as_ref()?
        .get(labels::VIRT_HANDLER_HEARTBEAT)?;
    raw.parse().ok()
}

/// Whether the node's handler counts as gone: the node is marked schedulable and its
/// heartbeat is missing or older than `timeout`.
pub fn is_unresponsive(node: &Node, now: Timestamp, timeout: Duration) -> bool {
    let schedulable = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::NODE_SCHEDULABLE))
        .is_some_and(|v| v == "true");
    if !schedulable {
        return false;
    }
    last_heartbeat(node)
        .is_none_or(|t| Duration::try_from(now.duration_since(t)).is_ok_and(|age| age > timeout))
}

/// The VMIs on `node` to fail: not final, and with no running launcher pod on that node.
pub fn vmis_to_fail<'a>(
    node: &str,
    vmis: &'a [VirtualMachineInstance],
    pods: &[Pod],
) -> Vec<&'a VirtualMachineInstance> {
    vmis.iter()
        .filter(|v| {
            v.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(labels::NODE_NAME))
                .is_some_and(|n| n == node)
        })
        .filter(|v| {
            !is_final(v)
                && v.status.as_ref().and_then(|s| s.phase.as_ref())
                    != Some(&VirtualMachineInstancePhase::Pending)
        })
        .filter(|v| {
            !pods.iter().any(|p| {
                is_launcher_of(p, v)
                    && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::VirtualMachineInstanceSpec;
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    fn node(schedulable: &str, heartbeat: Option<&str>) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                labels: Some(
                    [(labels::NODE_SCHEDULABLE.to_owned(), schedulable.to_owned())].into(),
                ),
                annotations: heartbeat
                    .map(|h| [(labels::VIRT_HANDLER_HEARTBEAT.to_owned(), h.to_owned())].into()),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn heartbeat_table() {
        let now = at("2026-01-01T00:10:00Z");
        let t = DEFAULT_HEARTBEAT_TIMEOUT;
        assert!(!is_unresponsive(
            &node("true", Some("2026-01-01T00:09:00Z")),
            now,
            t
        ));
        assert!(
            !is_unresponsive(&node("true", Some("2026-01-01T00:05:00Z")), now, t),
            "exactly at the timeout"
        );
        assert!(is_unresponsive(
            &node("true", Some("2026-01-01T00:04:59Z")),
            now,
            t
        ));
        assert!(is_unresponsive(&node("true", None), now, t));
        assert!(is_unresponsive(&node("true", Some("garbage")), now, t));
        assert!(
            !is_unresponsive(&node("false", None), now, t),
            "already unschedulable"
        );
    }

    #[test]
    fn only_vmis_without_a_running_launcher_fail() {
        use VirtualMachineInstancePhase as Ph;
        let vmi = |name: &str, uid: &str, node: &str, phase: VirtualMachineInstancePhase| {
            let mut v = VirtualMachineInstance::new(name, VirtualMachineInstanceSpec::default());
            v.metadata.uid = Some(uid.into());
            v.metadata.labels = Some([(labels::NODE_NAME.to_owned(), node.to_owned())].into());
            v.status = Some(api::VirtualMachineInstanceStatus {
                phase: Some(phase),
                ..Default::default()
            });
            v
        };
        let pod = |owner: &str, phase: &str| Pod {
            metadata: ObjectMeta {
                owner_references: Some(vec![OwnerReference {
                    uid: owner.into(),
                    controller: Some(true),
                    ..OwnerReference::default()
                }]),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("n1".into()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..PodStatus::default()
            }),
        };
        let vmis = vec![
            vmi("alive", "u1", "n1", Ph::Running),
            vmi("orphaned", "u2", "n1", Ph::Running),
            vmi("done", "u3", "n1", Ph::Succeeded),
            vmi("elsewhere", "u4", "n2", Ph::Running),
            vmi("pod-failed", "u5", "n1", Ph::Scheduled),
        ];
        let pods = vec![pod("u1", "Running"), pod("u5", "Failed")];
        let names: Vec<_> = vmis_to_fail("n1", &vmis, &pods)
            .iter()
            .map(|v| v.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["orphaned", "pod-failed"]);
    }
}
