//! The admission webhooks as served: [`admission`](crate::admission)'s decisions with the
//! cluster configuration of the KubeVirt CR as the reflector last saw it; the pod-eviction hook
//! through [`eviction`](crate::eviction), which reads the pod and VMI with virt-api's client.

use api::KubeVirt;
use api::preset::VirtualMachineInstancePreset;
use kube::runtime::reflector::Store;
use serde_json::Value;

use informer::instancetype::{Found, Target, find_spec};

use crate::admission::{self, Context, Webhook};
use crate::eviction;
use crate::server::{Admission, AdmitFuture};

pub struct Webhooks {
    client: kube::Client,
    kubevirts: Store<KubeVirt>,
    presets: Store<VirtualMachineInstancePreset>,
    namespace: String,
}

impl std::fmt::Debug for Webhooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhooks")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Webhooks {
    pub fn new(
        client: kube::Client,
        kubevirts: Store<KubeVirt>,
        presets: Store<VirtualMachineInstancePreset>,
        namespace: String,
    ) -> Self {
        Webhooks {
            client,
            kubevirts,
            presets,
            namespace,
        }
    }

    fn context(&self) -> Context {
        context(&self.kubevirts, &self.namespace)
    }
}

/// The context of the KubeVirt CR in virt-api's namespace (the active one), else KubeVirt's
/// defaults.
pub fn context(kubevirts: &Store<KubeVirt>, namespace: &str) -> Context {
    let kubevirts = kubevirts.state();
    kubevirts
        .iter()
        .find(|kv| kv.metadata.namespace.as_deref() == Some(namespace))
        .or(kubevirts.first())
        .map_or_else(
            || Context::new(api::ClusterConfig::default(), namespace),
            |kv| Context::from_kubevirt(kv, namespace),
        )
}

impl Admission for Webhooks {
    fn admit<'a>(&'a self, path: &'a str, review: &'a Value) -> AdmitFuture<'a> {
        let Some(hook) = Webhook::from_path(path) else {
            return Box::pin(std::future::ready(None));
        };
        let mut ctx = self.context();
        if hook == Webhook::VmiMutator {
            ctx.presets = self.presets.state().iter().map(|p| (**p).clone()).collect();
        }
        // The validator checks the VM with both applied; the mutator takes only the
        // preference's machine type and architecture (KubeVirt's looks up only the preference).
        let targets: &[Target] = match hook {
            Webhook::VmValidator => &[Target::Instancetype, Target::Preference],
            Webhook::VmMutator => &[Target::Preference],
            _ => &[],
        };
        if !targets.is_empty() {
            return Box::pin(async move {
                ctx.instancetypes = instancetypes(&self.client, review, targets).await;
                Some(admission::admit(hook, review, &ctx))
            });
        }
        if hook == Webhook::PodEvictionValidator {
            return Box::pin(
                async move { Some(eviction::admit(&self.client, review, &ctx).await) },
            );
        }
        Box::pin(std::future::ready(Some(admission::admit(
            hook, review, &ctx,
        ))))
    }
}

/// What the reviewed VM's instance type and preference are now. A lookup that fails (the VM
/// cannot be read, the object does not exist yet) finds nothing, as KubeVirt's admitter
/// ignores it: the VM is then validated as it is, and virt-controller reports what is missing.
async fn instancetypes(client: &kube::Client, review: &Value, targets: &[Target]) -> Found {
    let Some(vm) = review
        .pointer("/request/object")
        .and_then(|o| serde_json::from_value::<api::VirtualMachine>(o.clone()).ok())
    else {
        return Found::default();
    };
    let mut found = Found::default();
    if targets.contains(&Target::Instancetype) {
        match find_spec(client, &vm, Target::Instancetype).await {
            Ok(spec) => found.instancetype = spec,
            Err(e) => {
                tracing::warn!(error = %e, "ignoring a failure to find the VM's instance type");
            }
        }
    }
    if targets.contains(&Target::Preference) {
        match find_spec(client, &vm, Target::Preference).await {
            Ok(spec) => found.preference = spec,
            Err(e) => tracing::warn!(error = %e, "ignoring a failure to find the VM's preference"),
        }
    }
    found
}
