//! The resource table: built-in kinds and the kinds CRDs add.

use serde_json::{Value, json};

/// One printer column of a resource (`additionalPrinterColumns` for CRDs).
#[derive(Debug, Clone, PartialEq)]
pub struct PrinterColumn {
    pub name: String,
    pub type_: String,
    pub format: String,
    pub description: String,
    pub priority: i64,
    pub json_path: String,
}

/// The scale subresource's paths, as a CRD declares them.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleSpec {
    pub spec_replicas_path: String,
    pub status_replicas_path: String,
    pub label_selector_path: Option<String>,
}

/// Everything the server needs to know to serve one resource at one version.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceDef {
    pub group: String,
    pub version: String,
    pub kind: String,
    pub plural: String,
    pub singular: String,
    pub short_names: Vec<String>,
    pub categories: Vec<String>,
    pub namespaced: bool,
    pub verbs: Vec<String>,
    pub status: bool,
    pub scale: Option<ScaleSpec>,
    /// Other subresources the server accepts (pods/binding, namespaces/finalize).
    pub extra_subresources: Vec<String>,
    pub printer_columns: Vec<PrinterColumn>,
    /// The CRD version's `openAPIV3Schema`, when the resource comes from a CRD.
    pub schema: Option<Value>,
    /// Whether the resource is defined by a CRD (custom resources reject strategic merge patches).
    pub custom: bool,
}

impl ResourceDef {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    /// The key objects are stored under: every version of a group/resource shares one store,
    /// as with Kubernetes' `None` conversion strategy. `events.k8s.io` events are the core events
    /// store seen through another version (see `events`), as in kube-apiserver.
    pub fn group_resource(&self) -> GroupResource {
        let group = if self.group == "events.k8s.io" && self.plural == "events" {
            String::new()
        } else {
            self.group.clone()
        };
        GroupResource {
            group,
            resource: self.plural.clone(),
        }
    }

    pub fn subresource_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        if self.status {
            names.push("status".to_string());
        }
        if self.scale.is_some() {
            names.push("scale".to_string());
        }
        names.extend(self.extra_subresources.iter().cloned());
        names
    }
}

/// A group and resource (plural), the identity of a store.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupResource {
    pub group: String,
    pub resource: String,
}

const ALL_VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

/// group, version, kind, plural, short names, namespaced, categories, subresources
type Builtin = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static [&'static str],
    bool,
    &'static [&'static str],
    &'static [&'static str],
);

const BUILTINS: &[Builtin] = &[
    (
        "",
        "v1",
        "Namespace",
        "namespaces",
        &["ns"],
        false,
        &[],
        &["status", "finalize"],
    ),
    (
        "",
        "v1",
        "Pod",
        "pods",
        &["po"],
        true,
        &["all"],
        &["status", "binding", "log", "exec"],
    ),
    ("", "v1", "Node", "nodes", &["no"], false, &[], &["status"]),
    ("", "v1", "Event", "events", &["ev"], true, &[], &[]),
    ("", "v1", "ConfigMap", "configmaps", &["cm"], true, &[], &[]),
    ("", "v1", "Secret", "secrets", &[], true, &[], &[]),
    (
        "",
        "v1",
        "Service",
        "services",
        &["svc"],
        true,
        &["all"],
        &["status"],
    ),
    ("", "v1", "Endpoints", "endpoints", &["ep"], true, &[], &[]),
    (
        "",
        "v1",
        "ServiceAccount",
        "serviceaccounts",
        &["sa"],
        true,
        &[],
        &[],
    ),
    (
        "",
        "v1",
        "PersistentVolumeClaim",
        "persistentvolumeclaims",
        &["pvc"],
        true,
        &[],
        &["status"],
    ),
    (
        "",
        "v1",
        "PersistentVolume",
        "persistentvolumes",
        &["pv"],
        false,
        &[],
        &["status"],
    ),
    (
        "",
        "v1",
        "ResourceQuota",
        "resourcequotas",
        &["quota"],
        true,
        &[],
        &["status"],
    ),
    (
        "",
        "v1",
        "LimitRange",
        "limitranges",
        &["limits"],
        true,
        &[],
        &[],
    ),
    (
        "events.k8s.io",
        "v1",
        "Event",
        "events",
        &["ev"],
        true,
        &[],
        &[],
    ),
    (
        "coordination.k8s.io",
        "v1",
        "Lease",
        "leases",
        &[],
        true,
        &[],
        &[],
    ),
    (
        "apps",
        "v1",
        "Deployment",
        "deployments",
        &["deploy"],
        true,
        &["all"],
        &["status", "scale"],
    ),
    (
        "apps",
        "v1",
        "DaemonSet",
        "daemonsets",
        &["ds"],
        true,
        &["all"],
        &["status"],
    ),
    (
        "apps",
        "v1",
        "ReplicaSet",
        "replicasets",
        &["rs"],
        true,
        &["all"],
        &["status", "scale"],
    ),
    (
        "apps",
        "v1",
        "StatefulSet",
        "statefulsets",
        &["sts"],
        true,
        &["all"],
        &["status", "scale"],
    ),
    (
        "apps",
        "v1",
        "ControllerRevision",
        "controllerrevisions",
        &[],
        true,
        &[],
        &[],
    ),
    (
        "policy",
        "v1",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
        &["pdb"],
        true,
        &[],
        &["status"],
    ),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "Role",
        "roles",
        &[],
        true,
        &[],
        &[],
    ),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "RoleBinding",
        "rolebindings",
        &[],
        true,
        &[],
        &[],
    ),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRole",
        "clusterroles",
        &[],
        false,
        &[],
        &[],
    ),
    (
        "rbac.authorization.k8s.io",
        "v1",
        "ClusterRoleBinding",
        "clusterrolebindings",
        &[],
        false,
        &[],
        &[],
    ),
    (
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        &["crd", "crds"],
        false,
        &["api-extensions"],
        &["status"],
    ),
    (
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingWebhookConfiguration",
        "validatingwebhookconfigurations",
        &[],
        false,
        &["api-extensions"],
        &[],
    ),
    (
        "admissionregistration.k8s.io",
        "v1",
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
        &[],
        false,
        &["api-extensions"],
        &[],
    ),
    (
        "apiregistration.k8s.io",
        "v1",
        "APIService",
        "apiservices",
        &[],
        false,
        &["api-extensions"],
        &["status"],
    ),
    (
        "scheduling.k8s.io",
        "v1",
        "PriorityClass",
        "priorityclasses",
        &["pc"],
        false,
        &[],
        &[],
    ),
    (
        "storage.k8s.io",
        "v1",
        "StorageClass",
        "storageclasses",
        &["sc"],
        false,
        &[],
        &[],
    ),
];

/// The built-in resources this server serves.
pub fn builtins() -> Vec<ResourceDef> {
    BUILTINS
        .iter()
        .map(
            |&(group, version, kind, plural, short, namespaced, categories, subs)| ResourceDef {
                group: group.into(),
                version: version.into(),
                kind: kind.into(),
                plural: plural.into(),
                singular: kind.to_lowercase(),
                short_names: short.iter().map(|s| (*s).to_string()).collect(),
                categories: categories.iter().map(|s| (*s).to_string()).collect(),
                namespaced,
                verbs: ALL_VERBS.iter().map(|s| (*s).to_string()).collect(),
                status: subs.contains(&"status"),
                scale: subs.contains(&"scale").then(|| ScaleSpec {
                    spec_replicas_path: ".spec.replicas".into(),
                    status_replicas_path: ".status.replicas".into(),
                    label_selector_path: None,
                }),
                extra_subresources: subs
                    .iter()
                    .filter(|s| !matches!(**s, "status" | "scale"))
                    .map(|s| (*s).to_string())
                    .collect(),
                printer_columns: Vec::new(),
                schema: None,
                custom: false,
            },
        )
        .collect()
}

/// Errors in a CRD that keep it from being served.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CrdError {
    #[error("spec.{0} is required")]
    Missing(&'static str),
}

/// The resources one CRD object serves, one per served version.
pub fn from_crd(crd: &Value) -> Result<Vec<ResourceDef>, CrdError> {
    let spec = &crd["spec"];
    let group = spec["group"].as_str().ok_or(CrdError::Missing("group"))?;
    let names = &spec["names"];
    let plural = names["plural"]
        .as_str()
        .ok_or(CrdError::Missing("names.plural"))?;
    let kind = names["kind"]
        .as_str()
        .ok_or(CrdError::Missing("names.kind"))?;
    let singular = names["singular"]
        .as_str()
        .map_or_else(|| kind.to_lowercase(), str::to_string);
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let namespaced = spec["scope"].as_str() != Some("Cluster");
    let versions = spec["versions"]
        .as_array()
        .ok_or(CrdError::Missing("versions"))?;
    let mut defs = Vec::new();
    for version in versions {
        if version["served"].as_bool() == Some(false) {
            continue;
        }
        let Some(name) = version["name"].as_str() else {
            continue;
        };
        let subresources = &version["subresources"];
        let scale = subresources.get("scale").map(|s| ScaleSpec {
            spec_replicas_path: s["specReplicasPath"]
                .as_str()
                .unwrap_or(".spec.replicas")
                .into(),
            status_replicas_path: s["statusReplicasPath"]
                .as_str()
                .unwrap_or(".status.replicas")
                .into(),
            label_selector_path: s["labelSelectorPath"].as_str().map(str::to_string),
        });
        let printer_columns = version["additionalPrinterColumns"]
            .as_array()
            .map(|cols| {
                cols.iter()
                    .map(|c| PrinterColumn {
                        name: c["name"].as_str().unwrap_or_default().into(),
                        type_: c["type"].as_str().unwrap_or("string").into(),
                        format: c["format"].as_str().unwrap_or_default().into(),
                        description: c["description"].as_str().unwrap_or_default().into(),
                        priority: c["priority"].as_i64().unwrap_or(0),
                        json_path: c["jsonPath"].as_str().unwrap_or_default().into(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        defs.push(ResourceDef {
            group: group.into(),
            version: name.into(),
            kind: kind.into(),
            plural: plural.into(),
            singular: singular.clone(),
            short_names: strings(&names["shortNames"]),
            categories: strings(&names["categories"]),
            namespaced,
            verbs: ALL_VERBS.iter().map(|s| (*s).to_string()).collect(),
            status: subresources.get("status").is_some(),
            scale,
            extra_subresources: Vec::new(),
            printer_columns,
            schema: version["schema"].get("openAPIV3Schema").cloned(),
            custom: true,
        });
    }
    Ok(defs)
}

/// The `status` a CRD gets once its names are accepted and it is served.
pub fn crd_status(crd: &Value, now: &str) -> Value {
    let names = crd["spec"]["names"].clone();
    let stored: Vec<Value> = crd["spec"]["versions"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .filter(|v| v["storage"].as_bool() == Some(true))
                .map(|v| v["name"].clone())
                .collect()
        })
        .unwrap_or_default();
    let condition = |type_: &str, reason: &str, message: &str| {
        json!({
            "type": type_,
            "status": "True",
            "lastTransitionTime": now,
            "reason": reason,
            "message": message,
        })
    };
    json!({
        "acceptedNames": names,
        "storedVersions": stored,
        "conditions": [
            condition("NamesAccepted", "NoConflicts", "no conflicts found"),
            condition("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_have_unique_group_plural() {
        let defs = builtins();
        let mut keys: Vec<_> = defs.iter().map(|d| (&d.group, &d.plural)).collect();
        keys.sort();
        let before = keys.len();
        keys.dedup();
        assert_eq!(before, keys.len());
        let pods = defs.iter().find(|d| d.plural == "pods").unwrap();
        assert!(pods.status && pods.namespaced);
        assert_eq!(
            pods.extra_subresources,
            vec!["binding".to_string(), "log".to_string(), "exec".to_string()]
        );
    }

    #[test]
    fn crd_versions_become_resources() {
        let crd = json!({"spec": {"group": "example.com", "scope": "Namespaced",
        "names": {"plural": "widgets", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [
            {"name": "v1", "served": true, "storage": true,
             "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.size", "statusReplicasPath": ".status.size"}},
             "additionalPrinterColumns": [{"name": "Phase", "type": "string", "jsonPath": ".status.phase"}]},
            {"name": "v0", "served": false, "storage": false}
        ]}});
        let defs = from_crd(&crd).unwrap();
        assert_eq!(defs.len(), 1);
        let d = &defs[0];
        assert_eq!(d.singular, "widget");
        assert!(d.status);
        assert_eq!(d.scale.as_ref().unwrap().spec_replicas_path, ".spec.size");
        assert_eq!(d.printer_columns[0].json_path, ".status.phase");
        assert_eq!(
            from_crd(&json!({"spec": {}})).unwrap_err(),
            CrdError::Missing("group")
        );
    }
}
