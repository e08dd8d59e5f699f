//! Which finalizers a VM and a VMI carry, as pure functions (KubeVirt's `addVMFinalizer`,
//! `removeVMFinalizer`, `removeVMIFinalizer` and the VMI controller's release of the VM
//! controller's finalizer when the owner is gone).
//!
//! The VM controller's finalizer sits on the VM, so a deleted VM stays until its instance is
//! gone, and on the VMIs it starts, so the VM can record a final VMI's status before the VMI
//! goes. Either one held by an object nobody reconciles any more hangs a deletion forever, so
//! the rules for releasing them live here, next to each other.

use api::labels::{
    DEPRECATED_VMI_FINALIZER, LEGACY_VM_CONTROLLER_FINALIZER, ORPHAN_DEPENDENTS_FINALIZER,
    VM_CONTROLLER_FINALIZER, VMI_FINALIZER,
};
use api::{VirtualMachine, VirtualMachineInstance};

/// What the VMI's finalizers become, `None` when they stay as they are. `release_vmi`: the VMI
/// is final and its pods are gone, so the VMI controller's own finalizer goes;
/// `release_vm_controller`: the VM controller's finalizer goes (the VM has recorded the final
/// status, or there is no VM left to record it). Old names are renamed on the way.
///
/// A live VMI that lacks the VMI controller's finalizer gets it: virt-api's mutating webhook
/// adds it on create in KubeVirt, and until kubevirt-rs has that webhook nothing else does.
/// Without it a deleted VMI would vanish while its guest still runs, and its VM would start a
/// second guest next to the first.
pub fn vmi(
    vmi: &VirtualMachineInstance,
    release_vmi: bool,
    release_vm_controller: bool,
) -> Option<Vec<String>> {
    let current = vmi.metadata.finalizers.as_deref().unwrap_or_default();
    let live = vmi.metadata.deletion_timestamp.is_none() && !crate::vmi::is_final(vmi);
    let mut next: Vec<String> = Vec::with_capacity(current.len() + 1);
    for f in current {
        let f = match f.as_str() {
            LEGACY_VM_CONTROLLER_FINALIZER => VM_CONTROLLER_FINALIZER,
            DEPRECATED_VMI_FINALIZER => VMI_FINALIZER,
            other => other,
        };
        let released = (release_vmi && f == VMI_FINALIZER)
            || (release_vm_controller && f == VM_CONTROLLER_FINALIZER);
        if !released && !next.iter().any(|n| n == f) {
            next.push(f.to_owned());
        }
    }
    if live && !release_vmi && !next.iter().any(|n| n == VMI_FINALIZER) {
        next.insert(0, VMI_FINALIZER.to_owned());
    }
    (next != current).then_some(next)
}

/// What the VM's finalizers become, `None` when they stay as they are. A live VM carries the
/// VM controller's finalizer; a deleted one keeps it while its instance is still there (the
/// controller stops it first), unless it is deleted with orphaning, when the instance stays
/// and the VM goes at once. `has_instance`: a VMI this VM controls exists.
pub fn vm(vm: &VirtualMachine, has_instance: bool) -> Option<Vec<String>> {
    let current = vm.metadata.finalizers.as_deref().unwrap_or_default();
    let has = |name: &str| current.iter().any(|f| f == name);
    let deleting = vm.metadata.deletion_timestamp.is_some();
    let keep = !deleting || (has_instance && stops_instance_on_delete(vm));
    let present = has(VM_CONTROLLER_FINALIZER);
    if keep && !present && !deleting {
        // Kubernetes refuses new finalizers on an object being deleted.
        let mut next = current.to_vec();
        next.push(VM_CONTROLLER_FINALIZER.to_owned());
        Some(next)
    } else if !keep && present {
        Some(
            current
                .iter()
                .filter(|f| *f != VM_CONTROLLER_FINALIZER)
                .cloned()
                .collect(),
        )
    } else {
        None
    }
}

/// Whether the VM controller should stop the instance of this deleted VM: only when the VM is
/// not deleted with orphaning.
pub fn stops_instance_on_delete(vm: &VirtualMachine) -> bool {
    !vm.metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == ORPHAN_DEPENDENTS_FINALIZER)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    use super::*;

    fn vmi_with(finalizers: &[&str]) -> VirtualMachineInstance {
        let mut v = VirtualMachineInstance::new("v", api::VirtualMachineInstanceSpec::default());
        v.metadata.finalizers = Some(finalizers.iter().map(|f| (*f).to_owned()).collect());
        v
    }

    fn vm_with(finalizers: &[&str], deleting: bool) -> VirtualMachine {
        let mut v: VirtualMachine =
            serde_json::from_value(serde_json::json!({"metadata": {}, "spec": {"template": {}}}))
                .unwrap();
        v.metadata.finalizers = Some(finalizers.iter().map(|f| (*f).to_owned()).collect());
        v.metadata.deletion_timestamp = deleting.then(|| Time(Timestamp::now()));
        v
    }

    #[test]
    fn a_vmi_keeps_both_finalizers_until_each_is_released() {
        let v = vmi_with(&[VMI_FINALIZER, VM_CONTROLLER_FINALIZER, "example.com/other"]);
        assert_eq!(vmi(&v, false, false), None);
        assert_eq!(
            vmi(&v, true, false).unwrap(),
            [VM_CONTROLLER_FINALIZER, "example.com/other"]
        );
        assert_eq!(
            vmi(&v, false, true).unwrap(),
            [VMI_FINALIZER, "example.com/other"]
        );
        assert_eq!(vmi(&v, true, true).unwrap(), ["example.com/other"]);
    }

    #[test]
    fn the_deprecated_vmi_finalizer_goes_with_the_current_one() {
        let v = vmi_with(&[DEPRECATED_VMI_FINALIZER, VMI_FINALIZER]);
        assert_eq!(vmi(&v, true, false).unwrap(), Vec::<String>::new());
        assert_eq!(vmi(&v, false, false).unwrap(), [VMI_FINALIZER]);
    }

    #[test]
    fn a_live_vmi_gets_the_vmi_finalizer_and_a_deleted_or_final_one_does_not() {
        let v = vmi_with(&[VM_CONTROLLER_FINALIZER]);
        assert_eq!(
            vmi(&v, false, false).unwrap(),
            [VMI_FINALIZER, VM_CONTROLLER_FINALIZER]
        );
        let mut deleted = v.clone();
        deleted.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert_eq!(vmi(&deleted, false, false), None);
        let mut failed = v;
        failed.status = Some(api::VirtualMachineInstanceStatus {
            phase: Some(api::VirtualMachineInstancePhase::Failed),
            ..Default::default()
        });
        assert_eq!(vmi(&failed, false, false), None);
    }

    #[test]
    fn the_legacy_vm_controller_name_is_renamed_or_released() {
        let v = vmi_with(&[VMI_FINALIZER, LEGACY_VM_CONTROLLER_FINALIZER]);
        assert_eq!(
            vmi(&v, false, false).unwrap(),
            [VMI_FINALIZER, VM_CONTROLLER_FINALIZER]
        );
        assert_eq!(vmi(&v, false, true).unwrap(), [VMI_FINALIZER]);
        let both = vmi_with(&[LEGACY_VM_CONTROLLER_FINALIZER, VM_CONTROLLER_FINALIZER]);
        assert_eq!(
            vmi(&both, false, false).unwrap(),
            [VMI_FINALIZER, VM_CONTROLLER_FINALIZER]
        );
    }

    #[test]
    fn a_live_vm_gets_the_finalizer_once() {
        let v = vm_with(&["example.com/other"], false);
        assert_eq!(
            vm(&v, false).unwrap(),
            ["example.com/other", VM_CONTROLLER_FINALIZER]
        );
        assert_eq!(vm(&vm_with(&[VM_CONTROLLER_FINALIZER], false), true), None);
    }

    #[test]
    fn a_deleted_vm_keeps_the_finalizer_while_its_instance_is_there() {
        let v = vm_with(&[VM_CONTROLLER_FINALIZER], true);
        assert_eq!(vm(&v, true), None);
        assert!(stops_instance_on_delete(&v));
        assert_eq!(vm(&v, false).unwrap(), Vec::<String>::new());
    }

    #[test]
    fn a_vm_deleted_with_orphaning_lets_go_at_once() {
        let v = vm_with(
            &[ORPHAN_DEPENDENTS_FINALIZER, VM_CONTROLLER_FINALIZER],
            true,
        );
        assert!(!stops_instance_on_delete(&v));
        assert_eq!(vm(&v, true).unwrap(), [ORPHAN_DEPENDENTS_FINALIZER]);
    }

    #[test]
    fn a_deleted_vm_is_never_given_the_finalizer() {
        assert_eq!(vm(&vm_with(&[], true), true), None);
        assert_eq!(vm(&vm_with(&[], true), false), None);
    }
}
