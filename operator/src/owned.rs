//! The kinds virt-operator installs and watches, and how one object of them is named.

use serde_json::Value;

/// One kind the install strategy (or the certificates) may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnedKind {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    pub namespaced: bool,
}

impl OwnedKind {
    /// `group/version`, or `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

const fn owned(
    group: &'static str,
    version: &'static str,
    kind: &'static str,
    plural: &'static str,
    namespaced: bool,
) -> OwnedKind {
    OwnedKind {
        group,
        version,
        kind,
        plural,
        namespaced,
    }
}

/// Every kind an install holds, each watched (by virt-operator's `managed-by` label) so that a
/// change to any of them brings the CR back to the queue.
pub const OWNED_KINDS: [OwnedKind; 15] = [
    owned(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        false,
    ),
    owned("", "v1", "ServiceAccount", "serviceaccounts", true),
    owned(
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRole",
        "clusterroles",
        false,
    ),
    owned(
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRoleBinding",
        "clusterrolebindings",
        false,
    ),
    owned("rbac.authorization.k8s.io", "v1", "Role", "roles", true),
    owned(
        "rbac.authorization.k8s.io",
        "v1",
        "RoleBinding",
        "rolebindings",
        true,
    ),
    owned("", "v1", "Secret", "secrets", true),
    owned("", "v1", "ConfigMap", "configmaps", true),
    owned("", "v1", "Service", "services", true),
    owned("apps", "v1", "Deployment", "deployments", true),
    owned("apps", "v1", "DaemonSet", "daemonsets", true),
    owned(
        "policy",
        "v1",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
        true,
    ),
    owned(
        "apiregistration.k8s.io",
        "v1",
        "APIService",
        "apiservices",
        false,
    ),
    owned(
        "admissionregistration.k8s.io",
        "v1",
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
        false,
    ),
    owned(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingWebhookConfiguration",
        "validatingwebhookconfigurations",
        false,
    ),
];

/// An object's identity: kind, namespace (empty when cluster-scoped) and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectRef {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl ObjectRef {
    pub fn of(o: &Value) -> Self {
        let text = |p: &str| o.pointer(p).and_then(Value::as_str).unwrap_or_default();
        ObjectRef {
            kind: text("/kind").to_owned(),
            namespace: text("/metadata/namespace").to_owned(),
            name: text("/metadata/name").to_owned(),
        }
    }

    /// Its kind among [`OWNED_KINDS`].
    pub fn owned_kind(&self) -> Option<&'static OwnedKind> {
        OWNED_KINDS.iter().find(|k| k.kind == self.kind)
    }

    /// `namespace/name`, or `name` when cluster-scoped: how expectations track it.
    pub fn key(&self) -> String {
        if self.namespace.is_empty() {
            self.name.clone()
        } else {
            format!("{}/{}", self.namespace, self.name)
        }
    }
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{} {}", self.kind, self.name)
        } else {
            write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
        }
    }
}
