//! The admission webhooks as served: [`admission`](crate::admission)'s decisions with the
//! cluster configuration of the KubeVirt CR as the reflector last saw it.

use api::KubeVirt;
use kube::runtime::reflector::Store;
use serde_json::Value;

use crate::admission::{self, Context, Webhook};
use crate::server::Admission;

pub struct Webhooks {
    kubevirts: Store<KubeVirt>,
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
    pub fn new(kubevirts: Store<KubeVirt>, namespace: String) -> Self {
        Webhooks {
            kubevirts,
            namespace,
        }
    }

    /// The context of the KubeVirt CR in virt-api's namespace (the active one), else
    /// KubeVirt's defaults.
    fn context(&self) -> Context {
        let kubevirts = self.kubevirts.state();
        kubevirts
            .iter()
            .find(|kv| kv.metadata.namespace.as_deref() == Some(self.namespace.as_str()))
            .or(kubevirts.first())
            .map_or_else(
                || Context::new(api::ClusterConfig::default(), self.namespace.clone()),
                |kv| Context::from_kubevirt(kv, self.namespace.clone()),
            )
    }
}

impl Admission for Webhooks {
    fn admit(&self, path: &str, review: &Value) -> Option<Value> {
        let hook = Webhook::from_path(path)?;
        Some(admission::admit(hook, review, &self.context()))
    }
}
