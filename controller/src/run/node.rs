//! The Node controller's shell: a node whose virt-handler stopped heartbeating is marked
//! unschedulable and its VMIs without a running launcher are failed (`node`'s decisions).

use api::VirtualMachineInstance;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use serde_json::json;

use informer::obj_key;

use super::{Shared, event, retry_later};
use crate::{cache, events, node};

pub(super) async fn sync_node(s: &Shared, name: &str) {
    let Some(n) = s.nodes.get(&ObjectRef::new(name)) else {
        return;
    };
    if !node::is_unresponsive(&n, Timestamp::now(), s.opts.heartbeat_timeout) {
        return;
    }
    let nodes: Api<Node> = Api::all(s.client.clone());
    let patch = json!({"metadata": {"labels": {api::labels::NODE_SCHEDULABLE: "false"}}});
    if let Err(e) = nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        retry_later(&s.node_q, name, "marking the node unschedulable", &e);
        return;
    }
    event(
        s,
        n.as_ref(),
        true,
        events::NODE_UNRESPONSIVE,
        "virt-handler stopped heartbeating; node marked unschedulable".into(),
    )
    .await;
    let vmis: Vec<VirtualMachineInstance> = s
        .vmis
        .by_index(cache::VMI_BY_NODE.name, name)
        .iter()
        .map(|v| (**v).clone())
        .collect();
    let pods: Vec<Pod> = vmis
        .iter()
        .flat_map(|v| super::launcher_pods(s, &obj_key(v)))
        .collect();
    for v in node::vmis_to_fail(name, &vmis, &pods) {
        let api: Api<VirtualMachineInstance> =
            Api::namespaced(s.client.clone(), &v.namespace().unwrap_or_default());
        let patch = json!({"status": {"phase": "Failed", "reason": events::NODE_UNRESPONSIVE}});
        match api
            .patch(&v.name_any(), &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => {
                event(
                    s,
                    v,
                    true,
                    events::NODE_UNRESPONSIVE,
                    format!("virt-handler on node {name} is unresponsive; the VMI failed"),
                )
                .await;
            }
            Err(e) => retry_later(&s.node_q, name, "failing a VMI of an unresponsive node", &e),
        }
    }
}
