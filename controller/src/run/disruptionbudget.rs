//! The disruption-budget controller's shell: PodDisruptionBudgets are watched in every
//! namespace; one a VMI controls is deleted, with KubeVirt's Event on the VMI.
//!
//! Keyed by the PDB rather than by its VMI (KubeVirt's key): the decision reads nothing but
//! the PDB, so no VMI or pod change can alter it. A delete from a stale cache that finds the
//! PDB gone already is the outcome wanted, not an error; no expectations are needed.

use api::{VirtualMachineInstance, VirtualMachineInstanceSpec};
use informer::split_key;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams};
use kube::runtime::reflector::ObjectRef;

use super::{Shared, event, retry_later};
use crate::disruptionbudget::{self, FAILED_DELETE, SUCCESSFUL_DELETE};

pub(super) async fn sync_pdb(s: &Shared, key: &str) {
    let (ns, name) = split_key(key);
    let Some(pdb) = s.pdbs.get(&ObjectRef::new(name).within(ns)) else {
        return;
    };
    let Some(vmi_name) = disruptionbudget::vmi_to_release(&pdb) else {
        return;
    };
    // The Event's object: the VMI as the cache has it, else its name (a VMI deleted long
    // ago can still control a leftover PDB).
    let vmi = s
        .vmis
        .get(&ObjectRef::new(vmi_name).within(ns))
        .map_or_else(
            || {
                let mut v =
                    VirtualMachineInstance::new(vmi_name, VirtualMachineInstanceSpec::default());
                v.metadata.namespace = Some(ns.to_owned());
                v
            },
            |v| (*v).clone(),
        );
    let api: Api<PodDisruptionBudget> = Api::namespaced(s.client.clone(), ns);
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {
            tracing::info!(
                pdb = key,
                vmi = vmi_name,
                "deleted a VMI's PodDisruptionBudget"
            );
            event(
                s,
                &vmi,
                false,
                SUCCESSFUL_DELETE,
                format!("Deleted PodDisruptionBudget {name}"),
            )
            .await;
        }
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => {
            event(
                s,
                &vmi,
                true,
                FAILED_DELETE,
                format!("Error deleting the PodDisruptionBudget {name}: {e}"),
            )
            .await;
            retry_later(&s.pdb_q, key, "deleting a VMI's PodDisruptionBudget", &e);
        }
    }
}
