//! The console server's view of the VMIs (`server::Vmis`), backed by the node loop's informer
//! cache: a VMI's launcher socket is in the kubelet pods dir, its serial console and VNC sockets
//! are in the launcher's private dir, reached through the launcher's mount root
//! (`/proc/<pid>/root`), since the handler does not share the pod's filesystem.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kube::ResourceExt as _;

use crate::node::{Node, active_pod_on, pod_socket};
use crate::server::{LookupError, Target, Vmis};

/// `server::Vmis` over the node loop.
#[derive(Debug, Clone)]
pub struct NodeVmis {
    node: Arc<Node>,
}

impl NodeVmis {
    pub fn new(node: Arc<Node>) -> Self {
        NodeVmis { node }
    }
}

/// `<mount root of pid>/<private dir>/<vmi uid>/<file>`.
pub fn in_launcher(pid: i32, private_dir: &Path, uid: &str, file: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root"))
        .join(private_dir.strip_prefix("/").unwrap_or(private_dir))
        .join(uid)
        .join(file)
}

impl Vmis for NodeVmis {
    fn lookup(&self, namespace: &str, name: &str) -> Result<Target, LookupError> {
        let cfg = self.node.config();
        let vmi = self
            .node
            .vmi(namespace, name)
            .ok_or_else(|| LookupError::NotFound {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })?;
        let other_node = || LookupError::OtherNode {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            node: vmi
                .status
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_else(|| "(none yet)".to_owned()),
        };
        let pod_uid = active_pod_on(&vmi, &cfg.node).ok_or_else(other_node)?;
        let launcher_socket = pod_socket(&cfg.pods_dir, pod_uid);
        let uid = vmi.uid().unwrap_or_default();
        // The loop detects the pid before it first syncs a VMI; asking the socket covers the
        // moments after a handler restart before its first reconcile.
        let pid = self.node.launcher_pid(namespace, name, &uid).or_else(|| {
            isolation::detect_from_socket(&launcher_socket)
                .ok()
                .map(|i| i.pid)
        });
        let (serial_socket, vnc_socket) = match pid {
            Some(pid) => (
                in_launcher(pid, &cfg.launcher_private_dir, &uid, "virt-serial0"),
                in_launcher(pid, &cfg.launcher_private_dir, &uid, "virt-vnc"),
            ),
            // No launcher answers: the server's connect fails and says 503 with this path.
            None => (
                launcher_socket.with_file_name("virt-serial0"),
                launcher_socket.with_file_name("virt-vnc"),
            ),
        };
        Ok(Target {
            vmi,
            launcher_socket,
            serial_socket,
            vnc_socket,
            launcher_pid: pid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launcher_files_are_reached_through_its_mount_root() {
        assert_eq!(
            in_launcher(
                42,
                Path::new("/var/run/kubevirt-private"),
                "u-1",
                "virt-serial0"
            ),
            Path::new("/proc/42/root/var/run/kubevirt-private/u-1/virt-serial0")
        );
    }
}
