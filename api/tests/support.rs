//! The lists of `api::support` are complete and true: every field of the VMI schema is in
//! exactly one, every refused field is refused by validation, every named test exists.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use api::support::{CONTAINERS, IMPLEMENTED, REFUSED};
use api::{ClusterConfig, VirtualMachineInstance, crds, validation};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    JSONSchemaProps, JSONSchemaPropsOrArray,
};
use serde_json::{Value, json};

fn vmi_spec_schema() -> JSONSchemaProps {
    let crd = crds::crds()
        .into_iter()
        .find(|c| c.spec.names.kind == "VirtualMachineInstance")
        .unwrap();
    let root = crd.spec.versions[0]
        .schema
        .clone()
        .and_then(|s| s.open_api_v3_schema)
        .unwrap();
    root.properties.unwrap()["spec"].clone()
}

fn items_of<'a>(schema: &'a BTreeMap<String, JSONSchemaProps>, path: &str) -> &'a JSONSchemaProps {
    items(&schema[path]).unwrap()
}

fn items(node: &JSONSchemaProps) -> Option<&JSONSchemaProps> {
    match &node.items {
        Some(JSONSchemaPropsOrArray::Schema(s)) => Some(s),
        _ => None,
    }
}

/// Every field below `node`, by path, through objects and list items; maps and preserved
/// subtrees are single fields.
fn fields(node: &JSONSchemaProps, prefix: &str, out: &mut BTreeMap<String, JSONSchemaProps>) {
    for (name, prop) in node.properties.iter().flatten() {
        let mut path = format!("{prefix}.{name}");
        out.insert(path.clone(), prop.clone());
        let mut n = prop;
        while let Some(item) = items(n) {
            path.push_str("[]");
            n = item;
        }
        fields(n, &path, out);
    }
}

/// The fields listed below `path`'s ancestors that take their children with them.
fn covering_ancestor(path: &str) -> Option<String> {
    let whole = REFUSED
        .iter()
        .map(|r| r.path)
        .chain(IMPLEMENTED.iter().filter(|i| i.subtree).map(|i| i.path));
    let whole: Vec<&str> = whole.collect();
    path.match_indices('.')
        .map(|(i, _)| path[..i].trim_end_matches("[]"))
        .find(|a| whole.contains(a))
        .map(str::to_owned)
}

#[test]
fn every_vmi_spec_field_is_in_exactly_one_list() {
    let mut schema = BTreeMap::new();
    fields(&vmi_spec_schema(), "spec", &mut schema);
    assert!(schema.len() > 400, "only {} fields walked", schema.len());

    let mut listed: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let lists = [
        (
            "IMPLEMENTED",
            IMPLEMENTED.iter().map(|i| i.path).collect::<Vec<_>>(),
        ),
        ("REFUSED", REFUSED.iter().map(|r| r.path).collect()),
        ("CONTAINERS", CONTAINERS.to_vec()),
    ];
    for (list, paths) in &lists {
        for path in paths {
            listed.entry(path).or_default().push(list);
        }
    }

    let mut problems = Vec::new();
    for (path, lists) in &listed {
        if !schema.contains_key(*path) {
            problems.push(format!("{path}: listed in {lists:?} but not in the schema"));
        }
        if lists.len() > 1 {
            problems.push(format!("{path}: in more than one list: {lists:?}"));
        }
    }
    for path in schema.keys() {
        match (covering_ancestor(path), listed.get(path.as_str())) {
            (Some(a), Some(lists)) => problems.push(format!(
                "{path}: listed in {lists:?}, but {a} already covers it"
            )),
            (None, None) => problems.push(format!(
                "{path}: in no list (implement it with a test, or refuse it in validation)"
            )),
            _ => {}
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems with api::support's lists:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// KubeVirt's own list of fields says which preserved (untyped) fields are lists.
fn kubevirt_list(path: &str) -> bool {
    let prefix = format!("VirtualMachineInstance {path}[]");
    include_str!("data/kubevirt-v1-fields.txt")
        .lines()
        .any(|l| l.starts_with(&prefix))
}

/// A value of the field's schema type; an object has its required fields.
fn example(node: &JSONSchemaProps, path: &str) -> Value {
    if node.x_kubernetes_preserve_unknown_fields == Some(true) {
        return if kubevirt_list(path) {
            json!([{}])
        } else {
            json!({})
        };
    }
    if node.x_kubernetes_int_or_string == Some(true) {
        return json!("1");
    }
    match node.type_.as_deref() {
        Some("object") => {
            let mut object = serde_json::Map::new();
            for name in node.required.iter().flatten() {
                let field = &node.properties.as_ref().unwrap()[name];
                object.insert(name.clone(), example(field, &format!("{path}.{name}")));
            }
            Value::Object(object)
        }
        Some("array") => json!([example(items(node).unwrap(), &format!("{path}[]"))]),
        Some("string") => json!("x"),
        Some("boolean") => json!(true),
        Some("integer") => json!(1),
        other => panic!("{path}: no example for type {other:?}"),
    }
}

/// Sets `path` in a VMI, creating what leads there from the schema; `[]` is the first item.
fn set_path(vmi: &mut Value, path: &str, value: Value, schema: &BTreeMap<String, JSONSchemaProps>) {
    let segments: Vec<&str> = path.split('.').collect();
    let (last, leading) = segments.split_last().unwrap();
    let mut node = vmi;
    let mut here = String::new();
    for segment in leading {
        let name = segment.trim_end_matches("[]");
        if !here.is_empty() {
            here.push('.');
        }
        here.push_str(name);
        let object = node
            .as_object_mut()
            .unwrap_or_else(|| panic!("{path}: {name}'s parent is not an object"));
        if !object.contains_key(name) {
            let created = schema.get(&here).map_or(json!({}), |s| example(s, &here));
            object.insert(name.to_owned(), created);
        }
        node = object.get_mut(name).unwrap();
        if name.len() != segment.len() {
            let items = node.as_array_mut().unwrap();
            if items.is_empty() {
                let item = example(items_of(schema, &here), &format!("{here}[]"));
                items.push(item);
            }
            node = &mut items[0];
            here.push_str("[]");
        }
    }
    node.as_object_mut()
        .unwrap_or_else(|| panic!("{path}: the parent is not an object"))
        .insert((*last).to_owned(), value);
}

#[test]
fn every_refused_field_is_refused_by_validation() {
    let mut schema = BTreeMap::new();
    fields(&vmi_spec_schema(), "spec", &mut schema);
    let cfg = ClusterConfig::default();
    let mut failures = Vec::new();
    for r in REFUSED {
        let Some(node) = schema.get(r.path) else {
            failures.push(format!("{}: not in the schema", r.path));
            continue;
        };
        let value = match r.example {
            Some(e) => serde_json::from_str(e).unwrap(),
            None => example(node, r.path),
        };
        let mut v = common::valid();
        set_path(&mut v, r.path, value.clone(), &schema);
        let vmi: VirtualMachineInstance = match serde_json::from_value(v) {
            Ok(vmi) => vmi,
            Err(e) => {
                failures.push(format!("{} = {value}: does not deserialize: {e}", r.path));
                continue;
            }
        };
        let want = r.path.replace("[]", "[0]");
        let errors = validation::validate_vmi(&vmi, &cfg);
        if !errors
            .iter()
            .any(|e| e.path == want && e.message.contains(r.message))
        {
            failures.push(format!(
                "{want} = {value}: want ...{}..., got {:?}",
                r.message,
                errors.iter().map(ToString::to_string).collect::<Vec<_>>()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Finds `fn <name>` in `<file>::<name>`; `Ok(true)` when an attribute naming a test is on it.
fn find_function(shown_by: &str) -> Result<bool, String> {
    let (file, name) = shown_by
        .rsplit_once("::")
        .ok_or_else(|| format!("{shown_by}: not <file>::<function>"))?;
    let text = std::fs::read_to_string(workspace().join(file))
        .map_err(|e| format!("{shown_by}: {file}: {e}"))?;
    let lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l.strip_prefix("async ").unwrap_or(l);
            l.strip_prefix("fn ")
                .and_then(|l| l.strip_prefix(name))
                .is_some_and(|rest| rest.starts_with(['(', '<']))
        })
        .ok_or_else(|| format!("{shown_by}: no fn {name} in {file}"))?;
    let attributes = lines[..at]
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|l| l.starts_with("#[") || l.starts_with("//"));
    Ok(attributes
        .filter(|l| l.starts_with("#["))
        .any(|l| l.contains("test")))
}

#[test]
fn every_named_test_and_function_exists() {
    let mut problems = Vec::new();
    for i in IMPLEMENTED {
        match find_function(i.shown_by) {
            Ok(true) => {}
            Ok(false) => problems.push(format!("{}: {} is not a test", i.path, i.shown_by)),
            Err(e) => problems.push(format!("{}: {e}", i.path)),
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
