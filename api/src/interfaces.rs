//! The interface changes a running VMI takes from its VM, as KubeVirt's network VM controller
//! (`pkg/network/controllers/vm.go`, `applyDynamicIfaceRequestOnVMI`) makes them, for what
//! kubevirt-rs supports: an interface's `state` switched between up and down. Hotplugging an
//! interface (a new bridge interface in the VM) and unplugging one (`state: absent`, refused at
//! admission) are not done.

use crate::VirtualMachineInstance;
use crate::vm::VirtualMachine;
use crate::vmi::Interface;

/// The VMI's interfaces with the `state` of the VM's interface of the same name wherever the
/// two disagree on the link, or `None` when they agree. Only for a running VMI; the caller
/// checks.
pub fn link_state_sync(
    vm: &VirtualMachine,
    vmi: &VirtualMachineInstance,
) -> Option<Vec<Interface>> {
    let wanted = &vm.spec.template.spec.as_ref()?.domain.devices.interfaces;
    let mut interfaces = vmi.spec.domain.devices.interfaces.clone();
    let mut changed = false;
    for iface in &mut interfaces {
        if let Some(w) = wanted.iter().find(|w| w.name == iface.name)
            && w.link_down() != iface.link_down()
        {
            iface.state.clone_from(&w.state);
            changed = true;
        }
    }
    changed.then_some(interfaces)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn interfaces(states: &[Option<&str>]) -> serde_json::Value {
        json!(
            states
                .iter()
                .enumerate()
                .map(|(i, s)| json!({"name": format!("nic{i}"), "bridge": {}, "state": s}))
                .collect::<Vec<_>>()
        )
    }

    fn vm(states: &[Option<&str>]) -> VirtualMachine {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "vm", "namespace": "default"},
            "spec": {"template": {"spec": {
                "domain": {"devices": {"interfaces": interfaces(states)}},
            }}},
        }))
        .unwrap()
    }

    fn vmi(states: &[Option<&str>]) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm", "namespace": "default"},
            "spec": {"domain": {"devices": {"interfaces": interfaces(states)}}},
        }))
        .unwrap()
    }

    #[test]
    fn a_link_switched_in_the_vm_is_switched_in_the_vmi() {
        let out = link_state_sync(&vm(&[None, Some("down")]), &vmi(&[None, None])).unwrap();
        assert_eq!(out[0].state, None);
        assert_eq!(out[1].state.as_deref(), Some("down"));
        let out = link_state_sync(&vm(&[Some("up")]), &vmi(&[Some("down")])).unwrap();
        assert_eq!(out[0].state.as_deref(), Some("up"));
    }

    #[test]
    fn agreeing_links_change_nothing() {
        assert_eq!(link_state_sync(&vm(&[Some("up")]), &vmi(&[None])), None);
        assert_eq!(
            link_state_sync(&vm(&[Some("down")]), &vmi(&[Some("down")])),
            None
        );
        // An interface only the VM has is not hotplugged.
        assert_eq!(
            link_state_sync(&vm(&[None, Some("down")]), &vmi(&[None])),
            None
        );
    }
}
