//! Finding what a VM's `spec.instancetype` and `spec.preference` point at, as virt-controller
//! and virt-api both do (KubeVirt's `find` and `preference/find` packages): the snapshot in a
//! ControllerRevision when the VM names one (`revisionName`, else `status.instancetypeRef`
//! when its revision holds the object the matcher names), else the live object.

use api::VirtualMachine;
use api::instancetype::{
    REVISION_OBJECT_NAME_LABEL, Scope, VirtualMachineClusterInstancetype,
    VirtualMachineClusterPreference, VirtualMachineInstancetype, VirtualMachineInstancetypeSpec,
    VirtualMachinePreference, VirtualMachinePreferenceSpec, instancetype_scope, preference_scope,
};
use api::vm::{InstancetypeStatusRef, Matcher};
use k8s_openapi::api::apps::v1::ControllerRevision;
use kube::api::Api;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Why an instance type or preference could not be found.
#[derive(Debug, thiserror::Error)]
pub enum FindError {
    /// The matcher's `kind` is neither kind (KubeVirt's message).
    #[error("{0}")]
    Kind(String),
    /// Reading the object or its revision failed (not found among others).
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// A revision or object whose content is not the kind it should hold.
    #[error("{what}: {source}")]
    Content {
        what: String,
        source: serde_json::Error,
    },
}

/// Which of the two a lookup is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// `spec.instancetype`.
    Instancetype,
    /// `spec.preference`.
    Preference,
}

impl Target {
    /// The VM's matcher and status reference for this target.
    pub fn of(self, vm: &VirtualMachine) -> (Option<&Matcher>, Option<&InstancetypeStatusRef>) {
        let status = vm.status.as_ref();
        match self {
            Target::Instancetype => (
                vm.spec.instancetype.as_ref(),
                status.and_then(|s| s.instancetype_ref.as_ref()),
            ),
            Target::Preference => (
                vm.spec.preference.as_ref(),
                status.and_then(|s| s.preference_ref.as_ref()),
            ),
        }
    }

    /// The scope the matcher's `kind` names.
    pub fn scope(self, matcher: &Matcher) -> Result<Scope, FindError> {
        match self {
            Target::Instancetype => instancetype_scope(matcher.kind.as_deref()),
            Target::Preference => preference_scope(matcher.kind.as_deref()),
        }
        .map_err(FindError::Kind)
    }
}

/// The live object a matcher names, whole (apiVersion, kind, metadata, spec).
pub async fn live_object(
    client: &kube::Client,
    namespace: &str,
    target: Target,
    matcher: &Matcher,
) -> Result<Value, FindError> {
    let name = matcher.name.as_deref().unwrap_or_default();
    let scope = target.scope(matcher)?;
    let object = match (target, scope) {
        (Target::Instancetype, Scope::Namespaced) => to_value(
            Api::<VirtualMachineInstancetype>::namespaced(client.clone(), namespace)
                .get(name)
                .await?,
        ),
        (Target::Instancetype, Scope::Cluster) => to_value(
            Api::<VirtualMachineClusterInstancetype>::all(client.clone())
                .get(name)
                .await?,
        ),
        (Target::Preference, Scope::Namespaced) => to_value(
            Api::<VirtualMachinePreference>::namespaced(client.clone(), namespace)
                .get(name)
                .await?,
        ),
        (Target::Preference, Scope::Cluster) => to_value(
            Api::<VirtualMachineClusterPreference>::all(client.clone())
                .get(name)
                .await?,
        ),
    };
    object.map_err(|source| FindError::Content {
        what: name.to_owned(),
        source,
    })
}

fn to_value<T: serde::Serialize>(o: T) -> Result<Value, serde_json::Error> {
    serde_json::to_value(o)
}

/// The spec a VM's matcher resolves to now (KubeVirt's `Find` / `FindPreference`), or `None`
/// when the VM has no such matcher.
pub async fn find_spec<S: DeserializeOwned>(
    client: &kube::Client,
    vm: &VirtualMachine,
    target: Target,
) -> Result<Option<S>, FindError> {
    let (Some(matcher), status_ref) = target.of(vm) else {
        return Ok(None);
    };
    let namespace = vm.metadata.namespace.as_deref().unwrap_or_default();
    let revisions: Api<ControllerRevision> = Api::namespaced(client.clone(), namespace);
    let from_status = status_ref
        .and_then(|r| r.controller_revision_ref.as_ref()?.name.as_deref())
        .filter(|n| !n.is_empty());
    let object = if let Some(name) = matcher.revision_name.as_deref().filter(|n| !n.is_empty()) {
        revision_object(&revisions.get(name).await?)
    } else if let Some(name) = from_status
        && let revision = revisions.get(name).await?
        && revision
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(REVISION_OBJECT_NAME_LABEL))
            == matcher.name.as_ref()
    {
        revision_object(&revision)
    } else {
        live_object(client, namespace, target, matcher).await?
    };
    let spec = object.get("spec").cloned().unwrap_or(Value::Null);
    serde_json::from_value(spec)
        .map(Some)
        .map_err(|source| FindError::Content {
            what: format!(
                "the spec of {}",
                matcher.name.as_deref().unwrap_or_default()
            ),
            source,
        })
}

/// The object a ControllerRevision snapshot holds.
pub fn revision_object(revision: &ControllerRevision) -> Value {
    revision.data.0.clone()
}

/// Both specs of a VM, as found now.
#[derive(Debug, Clone, Default)]
pub struct Found {
    pub instancetype: Option<VirtualMachineInstancetypeSpec>,
    pub preference: Option<VirtualMachinePreferenceSpec>,
}

impl Found {
    /// KubeVirt's `Find` then `FindPreference`: the first failure ends the lookup.
    pub async fn of(client: &kube::Client, vm: &VirtualMachine) -> Result<Self, FindError> {
        Ok(Found {
            instancetype: find_spec(client, vm, Target::Instancetype).await?,
            preference: find_spec(client, vm, Target::Preference).await?,
        })
    }

    /// The two as an [`api::instancetype::Expansion`].
    pub fn expansion(&self) -> api::instancetype::Expansion<'_> {
        api::instancetype::Expansion {
            instancetype: self.instancetype.as_ref(),
            preference: self.preference.as_ref(),
        }
    }
}
