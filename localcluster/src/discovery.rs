//! The set of served resources and the discovery documents (legacy and aggregated v2) and
//! OpenAPI v3 documents built from it.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::resources::{self, ResourceDef};

/// The resources served right now: the built-ins plus those of established CRDs.
#[derive(Debug, Clone)]
pub struct Registry {
    defs: Vec<ResourceDef>,
}

impl Default for Registry {
    fn default() -> Self {
        Self {
            defs: resources::builtins(),
        }
    }
}

/// The groups whose resources are built in, in the order discovery lists them.
const GROUP_ORDER: &[&str] = &[
    "",
    "apiregistration.k8s.io",
    "apps",
    "events.k8s.io",
    "policy",
    "rbac.authorization.k8s.io",
    "storage.k8s.io",
    "admissionregistration.k8s.io",
    "apiextensions.k8s.io",
    "scheduling.k8s.io",
    "coordination.k8s.io",
];

impl Registry {
    /// A registry with the built-ins and the resources of these CRD objects.
    pub fn with_crds<'a>(crds: impl IntoIterator<Item = &'a Value>) -> Self {
        let mut defs = resources::builtins();
        for crd in crds {
            if crd["metadata"]["deletionTimestamp"].is_string() {
                continue;
            }
            if let Ok(more) = resources::from_crd(crd) {
                defs.extend(more);
            }
        }
        Self { defs }
    }

    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<&ResourceDef> {
        self.defs
            .iter()
            .find(|d| d.group == group && d.version == version && d.plural == plural)
    }

    /// Any served version of a group/resource (the stored objects are shared between versions).
    pub fn any_version(&self, group: &str, plural: &str) -> Option<&ResourceDef> {
        self.defs
            .iter()
            .find(|d| d.group == group && d.plural == plural)
    }

    pub fn defs(&self) -> &[ResourceDef] {
        &self.defs
    }

    /// Groups with their versions, preferred version first.
    pub fn groups(&self) -> Vec<(String, Vec<String>)> {
        let mut groups: BTreeMap<(usize, String), Vec<String>> = BTreeMap::new();
        for d in &self.defs {
            let order = GROUP_ORDER
                .iter()
                .position(|g| *g == d.group)
                .unwrap_or(GROUP_ORDER.len());
            let versions = groups.entry((order, d.group.clone())).or_default();
            if !versions.contains(&d.version) {
                versions.push(d.version.clone());
            }
        }
        groups
            .into_iter()
            .map(|((_, g), mut versions)| {
                versions.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
                (g, versions)
            })
            .collect()
    }

    pub fn version_exists(&self, group: &str, version: &str) -> bool {
        self.defs
            .iter()
            .any(|d| d.group == group && d.version == version)
    }

    /// `/api/v1` or `/apis/<group>/<version>`: an APIResourceList.
    pub fn resource_list(&self, group: &str, version: &str) -> Value {
        let mut resources = Vec::new();
        for d in self
            .defs
            .iter()
            .filter(|d| d.group == group && d.version == version)
        {
            let mut r = json!({
                "name": d.plural,
                "singularName": d.singular,
                "namespaced": d.namespaced,
                "kind": d.kind,
                "verbs": d.verbs,
            });
            if !d.short_names.is_empty() {
                r["shortNames"] = json!(d.short_names);
            }
            if !d.categories.is_empty() {
                r["categories"] = json!(d.categories);
            }
            resources.push(r);
            for sub in d.subresource_names() {
                let (kind, verbs, group_version) = subresource_shape(d, &sub);
                let mut r = json!({
                    "name": format!("{}/{sub}", d.plural),
                    "singularName": "",
                    "namespaced": d.namespaced,
                    "kind": kind,
                    "verbs": verbs,
                });
                if let Some((g, v)) = group_version {
                    r["group"] = json!(g);
                    r["version"] = json!(v);
                }
                resources.push(r);
            }
        }
        let group_version = if group.is_empty() {
            version.to_string()
        } else {
            format!("{group}/{version}")
        };
        json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": resources,
        })
    }

    fn group_json(group: &str, versions: &[String]) -> Value {
        let vs: Vec<Value> = versions
            .iter()
            .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
            .collect();
        json!({
            "name": group,
            "versions": vs,
            "preferredVersion": vs.first().cloned().unwrap_or(Value::Null),
        })
    }

    /// `/apis`: an APIGroupList.
    pub fn group_list(&self) -> Value {
        let groups: Vec<Value> = self
            .groups()
            .into_iter()
            .filter(|(g, _)| !g.is_empty())
            .map(|(g, vs)| Self::group_json(&g, &vs))
            .collect();
        json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
    }

    /// `/apis/<group>`: an APIGroup.
    pub fn group(&self, group: &str) -> Option<Value> {
        self.groups()
            .into_iter()
            .find(|(g, _)| g == group)
            .map(|(g, vs)| {
                let mut v = Self::group_json(&g, &vs);
                v["kind"] = json!("APIGroup");
                v["apiVersion"] = json!("v1");
                v
            })
    }

    /// Aggregated discovery (`apidiscovery.k8s.io/v2`) for `/api` (core) or `/apis` (the rest).
    pub fn aggregated(&self, core: bool, api_version: &str) -> Value {
        let items: Vec<Value> = self
            .groups()
            .into_iter()
            .filter(|(g, _)| g.is_empty() == core)
            .map(|(g, versions)| {
                let versions: Vec<Value> = versions
                    .iter()
                    .map(|v| {
                        let resources: Vec<Value> = self
                            .defs
                            .iter()
                            .filter(|d| d.group == g && &d.version == v)
                            .map(aggregated_resource)
                            .collect();
                        json!({"version": v, "resources": resources, "freshness": "Current"})
                    })
                    .collect();
                json!({"metadata": {"name": g, "creationTimestamp": null}, "versions": versions})
            })
            .collect();
        json!({
            "kind": "APIGroupDiscoveryList",
            "apiVersion": api_version,
            "metadata": {},
            "items": items,
        })
    }
}

/// Orders versions as Kubernetes does: GA over beta over alpha, higher numbers first.
fn version_priority(v: &str) -> (u8, u32, u32) {
    let Some(rest) = v.strip_prefix('v') else {
        return (0, 0, 0);
    };
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let major = digits.parse().unwrap_or(0);
    let tail = &rest[digits.len()..];
    let minor = |t: &str| t.parse().unwrap_or(0);
    if tail.is_empty() {
        (3, major, 0)
    } else if let Some(t) = tail.strip_prefix("beta") {
        (2, major, minor(t))
    } else if let Some(t) = tail.strip_prefix("alpha") {
        (1, major, minor(t))
    } else {
        (0, major, 0)
    }
}

/// Kind, verbs and (when it differs from the parent) group/version a subresource answers with.
fn subresource_shape(
    d: &ResourceDef,
    sub: &str,
) -> (
    String,
    Vec<&'static str>,
    Option<(&'static str, &'static str)>,
) {
    match sub {
        "scale" => (
            "Scale".into(),
            vec!["get", "patch", "update"],
            Some(("autoscaling", "v1")),
        ),
        "binding" => ("Binding".into(), vec!["create"], None),
        "log" => (d.kind.clone(), vec!["get"], None),
        "exec" => ("PodExecOptions".into(), vec!["create", "get"], None),
        "finalize" => (d.kind.clone(), vec!["update"], None),
        _ => (d.kind.clone(), vec!["get", "patch", "update"], None),
    }
}

fn aggregated_resource(d: &ResourceDef) -> Value {
    let subresources: Vec<Value> = d
        .subresource_names()
        .iter()
        .map(|sub| {
            let (kind, verbs, gv) = subresource_shape(d, sub);
            let (g, v) = gv.unwrap_or((d.group.as_str(), d.version.as_str()));
            json!({"subresource": sub, "responseKind": {"group": g, "version": v, "kind": kind}, "verbs": verbs})
        })
        .collect();
    let mut r = json!({
        "resource": d.plural,
        "responseKind": {"group": d.group, "version": d.version, "kind": d.kind},
        "scope": if d.namespaced { "Namespaced" } else { "Cluster" },
        "singularResource": d.singular,
        "verbs": d.verbs,
    });
    if !d.short_names.is_empty() {
        r["shortNames"] = json!(d.short_names);
    }
    if !d.categories.is_empty() {
        r["categories"] = json!(d.categories);
    }
    if !subresources.is_empty() {
        r["subresources"] = json!(subresources);
    }
    r
}

impl Registry {
    /// The PATCH operation of every kind, declaring the `fieldValidation` parameter: kubectl reads
    /// it to decide that the server validates fields itself (and skips client-side validation).
    fn openapi_paths(&self, group: &str, version: &str) -> Value {
        let mut paths = serde_json::Map::new();
        for d in self
            .defs
            .iter()
            .filter(|d| d.group == group && d.version == version)
        {
            let ns = if d.namespaced {
                "namespaces/{namespace}/"
            } else {
                ""
            };
            let path = format!(
                "/{}/{ns}{}/{{name}}",
                openapi_path(group, version),
                d.plural
            );
            let query =
                |name: &str| json!({"name": name, "in": "query", "schema": {"type": "string"}});
            paths.insert(
                path,
                json!({"patch": {
                    "operationId": format!("patch{}", d.kind),
                    "x-kubernetes-action": "patch",
                    "x-kubernetes-group-version-kind": {"group": d.group, "version": d.version, "kind": d.kind},
                    "parameters": [query("fieldValidation"), query("fieldManager"), query("force"), query("dryRun")],
                    "responses": {"200": {"description": "OK"}},
                }}),
            );
        }
        Value::Object(paths)
    }
}

/// The OpenAPI v3 path of a group/version (`api/v1`, `apis/apps/v1`).
pub fn openapi_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

impl Registry {
    /// `/openapi/v3`: the index of per-group-version documents.
    pub fn openapi_index(&self, hash: &str) -> Value {
        let mut paths = serde_json::Map::new();
        for (g, versions) in self.groups() {
            for v in versions {
                let p = openapi_path(&g, &v);
                paths.insert(
                    p.clone(),
                    json!({"serverRelativeURL": format!("/openapi/v3/{p}?hash={hash}")}),
                );
            }
        }
        json!({"paths": paths})
    }

    /// `/openapi/v3/<path>`: one schema per kind. Built-ins get an open schema (the server does not
    /// carry Kubernetes' full schemas); custom resources get their CRD schema.
    pub fn openapi_document(&self, group: &str, version: &str) -> Option<Value> {
        if !self.version_exists(group, version) {
            return None;
        }
        let mut schemas = serde_json::Map::new();
        for d in self
            .defs
            .iter()
            .filter(|d| d.group == group && d.version == version)
        {
            let gvk = json!([{"group": d.group, "version": d.version, "kind": d.kind}]);
            let mut schema = match &d.schema {
                Some(s) => s.clone(),
                None => json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
            };
            if !schema.is_object() {
                schema = json!({"type": "object"});
            }
            let props = schema["properties"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            let mut props = props;
            props.insert("apiVersion".into(), json!({"type": "string"}));
            props.insert("kind".into(), json!({"type": "string"}));
            props.insert(
                "metadata".into(),
                json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
            );
            schema["properties"] = Value::Object(props);
            schema["x-kubernetes-group-version-kind"] = gvk;
            let prefix = if d.custom {
                let mut parts: Vec<&str> = d.group.split('.').collect();
                parts.reverse();
                parts.join(".")
            } else if d.group.is_empty() {
                "io.k8s.api.core".to_string()
            } else {
                format!(
                    "io.k8s.api.{}",
                    d.group.split('.').next().unwrap_or_default()
                )
            };
            schemas.insert(format!("{prefix}.{}.{}", d.version, d.kind), schema);
        }
        Some(json!({
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "v1.32.0"},
            "paths": self.openapi_paths(group, version),
            "components": {"schemas": schemas},
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_like_kubernetes() {
        let mut vs = vec!["v1alpha1", "v2", "v1beta2", "v1", "v1beta1", "v10"];
        vs.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
        assert_eq!(
            vs,
            vec!["v10", "v2", "v1", "v1beta2", "v1beta1", "v1alpha1"]
        );
    }

    #[test]
    fn discovery_documents() {
        let reg = Registry::default();
        let core = reg.resource_list("", "v1");
        let names: Vec<&str> = core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert!(names.contains(&"pods/status") && names.contains(&"pods/binding"));
        let groups = reg.group_list();
        assert_eq!(groups["groups"][0]["name"], "apiregistration.k8s.io");
        let agg = reg.aggregated(false, "apidiscovery.k8s.io/v2");
        let apps = agg["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["metadata"]["name"] == "apps")
            .unwrap();
        let deploy = &apps["versions"][0]["resources"][0];
        assert_eq!(deploy["resource"], "deployments");
        assert_eq!(
            deploy["subresources"][1]["responseKind"]["group"],
            "autoscaling"
        );
        let doc = reg.openapi_document("apps", "v1").unwrap();
        assert_eq!(
            doc["components"]["schemas"]["io.k8s.api.apps.v1.Deployment"]["x-kubernetes-group-version-kind"]
                [0]["kind"],
            "Deployment"
        );
    }
}
