//! Every field a KubeVirt manifest may carry has a place in our CRD schemas (typed, or inside a
//! preserved subtree), so a real API server never prunes what a user wrote.

use std::collections::BTreeMap;

use api::crds;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};

/// Follows one path; `Ok` when it ends in the schema or inside a preserved subtree.
fn resolve(root: &JSONSchemaProps, path: &str) -> Result<(), String> {
    let mut node = root;
    for segment in path.split('.') {
        if node.x_kubernetes_preserve_unknown_fields == Some(true) {
            return Ok(());
        }
        let name = segment.trim_end_matches(['[', ']', '{', '}']);
        node = node
            .properties
            .as_ref()
            .and_then(|p| p.get(name))
            .ok_or_else(|| format!("no field {name:?}"))?;
        let mut rest = &segment[name.len()..];
        while !rest.is_empty() {
            if node.x_kubernetes_preserve_unknown_fields == Some(true) {
                return Ok(());
            }
            if let Some(r) = rest.strip_prefix("[]") {
                node = match &node.items {
                    Some(JSONSchemaPropsOrArray::Schema(s)) => s,
                    _ => return Err(format!("{name} is not a list")),
                };
                rest = r;
            } else if let Some(r) = rest.strip_prefix("{}") {
                node = match &node.additional_properties {
                    Some(JSONSchemaPropsOrBool::Schema(s)) => s,
                    _ => return Err(format!("{name} is not a map")),
                };
                rest = r;
            } else {
                return Err(format!("bad segment {segment}"));
            }
        }
    }
    Ok(())
}

#[test]
fn every_kubevirt_field_has_a_place_in_our_schemas() {
    let schemas: BTreeMap<String, JSONSchemaProps> = crds::crds()
        .into_iter()
        .map(|c| {
            let schema = c.spec.versions[0]
                .schema
                .clone()
                .and_then(|s| s.open_api_v3_schema)
                .unwrap();
            (c.spec.names.kind, schema)
        })
        .collect();
    let list = include_str!("data/kubevirt-v1-fields.txt");
    let mut missing = Vec::new();
    let mut checked = 0;
    for line in list
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (kind, path) = line.split_once(' ').unwrap();
        let schema = schemas
            .get(kind)
            .unwrap_or_else(|| panic!("no CRD for {kind}"));
        if let Err(why) = resolve(schema, path) {
            missing.push(format!("{kind} {path}: {why}"));
        }
        checked += 1;
    }
    assert!(checked > 1000, "only {checked} fields listed");
    assert!(
        missing.is_empty(),
        "{} KubeVirt fields would be pruned:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

/// Every property path of our schema below `prefix`, in the list's notation.
fn paths(node: &JSONSchemaProps, prefix: &str, out: &mut Vec<String>) {
    for (name, prop) in node.properties.iter().flatten() {
        let mut path = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        out.push(path.clone());
        let mut n = prop;
        loop {
            match (&n.items, &n.additional_properties) {
                (Some(JSONSchemaPropsOrArray::Schema(s)), _) => {
                    path.push_str("[]");
                    n = s;
                }
                (_, Some(JSONSchemaPropsOrBool::Schema(s))) => {
                    path.push_str("{}");
                    n = s;
                }
                _ => break,
            }
        }
        paths(n, &path, out);
    }
}

#[test]
fn we_invent_no_fields_kubevirt_does_not_have() {
    let list = include_str!("data/kubevirt-v1-fields.txt");
    let known: std::collections::BTreeSet<&str> = list
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect();
    let mut invented = Vec::new();
    for crd in crds::crds() {
        let kind = crd.spec.names.kind.clone();
        let schema = crd.spec.versions[0]
            .schema
            .clone()
            .and_then(|s| s.open_api_v3_schema)
            .unwrap();
        let mut ours = Vec::new();
        paths(&schema, "", &mut ours);
        for path in ours {
            if ["apiVersion", "kind", "metadata"].contains(&path.as_str()) {
                continue;
            }
            let line = format!("{kind} {path}");
            if known.contains(line.as_str()) {
                continue;
            }
            // Below a field KubeVirt types with a Kubernetes type (no children in the list):
            // those subtrees are k8s-openapi's and complete by construction.
            let mut ancestor = line.as_str();
            let covered = loop {
                let Some((head, _)) = ancestor.rsplit_once('.') else {
                    break false;
                };
                ancestor = head;
                let bare = ancestor.trim_end_matches(['[', ']', '{', '}']);
                if known.contains(ancestor) || known.contains(bare) {
                    let has_children = known.iter().any(|k| {
                        k.len() > ancestor.len()
                            && k.starts_with(ancestor)
                            && k[ancestor.len()..].starts_with(['.', '[', '{'])
                    });
                    break !has_children;
                }
            };
            if !covered {
                invented.push(line);
            }
        }
    }
    assert!(
        invented.is_empty(),
        "fields KubeVirt does not have:\n{}",
        invented.join("\n")
    );
}
