//! Structural schema handling for custom resources: pruning of unknown fields and `default:` values,
//! following the CRD `openAPIV3Schema` (`x-kubernetes-preserve-unknown-fields`,
//! `x-kubernetes-embedded-resource`, `nullable`).

use serde_json::{Map, Value};

use crate::patch::ListKind;

fn is_true(schema: &Value, key: &str) -> bool {
    schema.get(key).and_then(Value::as_bool) == Some(true)
}

/// Removes the fields the schema does not know, as the API server does on every write.
/// The top-level `apiVersion`, `kind` and `metadata` always stay. Returns the paths removed
/// (`.spec.bogus`, `.spec.list[0].x`), which strict field validation reports.
pub fn prune(obj: &mut Value, schema: &Value) -> Vec<String> {
    let mut removed = Vec::new();
    prune_at(obj, schema, true, "", &mut removed);
    removed
}

fn prune_at(value: &mut Value, schema: &Value, root: bool, at: &str, removed: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            let preserve = is_true(schema, "x-kubernetes-preserve-unknown-fields");
            let embedded = root || is_true(schema, "x-kubernetes-embedded-resource");
            let properties = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            let keys: Vec<String> = map.keys().cloned().collect();
            for key in keys {
                if embedded && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                    continue;
                }
                let sub = properties.and_then(|p| p.get(&key)).or(additional);
                match sub {
                    Some(sub) => {
                        if let Some(v) = map.get_mut(&key) {
                            prune_at(v, sub, false, &format!("{at}.{key}"), removed);
                        }
                    }
                    None if preserve => {}
                    None => {
                        map.remove(&key);
                        removed.push(format!("{at}.{key}"));
                    }
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    prune_at(item, item_schema, false, &format!("{at}[{i}]"), removed);
                }
            }
        }
        _ => {}
    }
}

/// Fills in `default:` values for missing (or null, when not nullable) fields, recursively.
pub fn apply_defaults(value: &mut Value, schema: &Value) {
    match value {
        Value::Object(map) => {
            if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
                default_properties(map, properties);
            }
            if let Some(additional) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for v in map.values_mut() {
                    apply_defaults(v, additional);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    apply_defaults(item, item_schema);
                }
            }
        }
        _ => {}
    }
}

fn default_properties(map: &mut Map<String, Value>, properties: &Map<String, Value>) {
    for (key, sub) in properties {
        let nullable = is_true(sub, "nullable");
        match map.get(key) {
            None => {
                if let Some(default) = sub.get("default") {
                    map.insert(key.clone(), default.clone());
                }
            }
            Some(Value::Null) if !nullable => match sub.get("default") {
                Some(default) => {
                    map.insert(key.clone(), default.clone());
                }
                None => {
                    map.remove(key);
                }
            },
            Some(_) => {}
        }
        if let Some(v) = map.get_mut(key) {
            apply_defaults(v, sub);
        }
    }
}

/// The schema of the field at `path` (field names, list items implied).
pub fn schema_at<'a>(schema: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut cur = schema;
    for field in path {
        while cur.get("type").and_then(Value::as_str) == Some("array") {
            cur = cur.get("items")?;
        }
        cur = cur
            .get("properties")
            .and_then(|p| p.get(field))
            .or_else(|| cur.get("additionalProperties").filter(|a| a.is_object()))?;
    }
    Some(cur)
}

/// The list strategy a custom resource's schema declares for the list at `path`.
pub fn list_kind(schema: &Value, path: &[String]) -> ListKind {
    let Some(list) = schema_at(schema, path) else {
        return ListKind::Atomic;
    };
    match list.get("x-kubernetes-list-type").and_then(Value::as_str) {
        Some("set") => ListKind::Set,
        Some("map") => ListKind::Map(
            list.get("x-kubernetes-list-map-keys")
                .and_then(Value::as_array)
                .map(|keys| {
                    keys.iter()
                        .filter_map(|k| k.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
        ),
        _ => ListKind::Atomic,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "spec": {"type": "object", "properties": {
                "size": {"type": "integer", "default": 3},
                "mode": {"type": "string", "default": "fast"},
                "opt": {"type": "string", "nullable": true, "default": "x"},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true,
                         "properties": {"known": {"type": "object", "properties": {"a": {"type": "string"}}}}},
                "items": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                          "items": {"type": "object", "properties": {
                              "name": {"type": "string"}, "weight": {"type": "integer", "default": 1}}}},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}}
            }},
            "status": {"type": "object", "properties": {"phase": {"type": "string"}}}
        }})
    }

    #[test]
    fn prunes_unknown_fields_but_keeps_preserved_ones() {
        let mut obj = json!({"apiVersion": "x/v1", "kind": "W", "metadata": {"name": "a"},
            "junk": 1,
            "spec": {"size": 1, "bogus": true,
                     "free": {"anything": [1], "known": {"a": "1", "b": "2"}},
                     "items": [{"name": "n", "extra": 1}],
                     "labels": {"k": "v"}},
            "status": {"phase": "Ok", "other": 1}});
        let removed = prune(&mut obj, &schema());
        assert_eq!(
            removed,
            vec![
                ".junk",
                ".spec.bogus",
                ".spec.free.known.b",
                ".spec.items[0].extra",
                ".status.other"
            ]
        );
        assert_eq!(
            obj,
            json!({"apiVersion": "x/v1", "kind": "W", "metadata": {"name": "a"},
                "spec": {"size": 1, "free": {"anything": [1], "known": {"a": "1"}},
                         "items": [{"name": "n"}], "labels": {"k": "v"}},
                "status": {"phase": "Ok"}})
        );
    }

    #[test]
    fn applies_defaults_recursively() {
        let mut obj = json!({"spec": {"mode": null, "opt": null, "items": [{"name": "n"}]}});
        apply_defaults(&mut obj, &schema());
        assert_eq!(
            obj,
            json!({"spec": {"size": 3, "mode": "fast", "opt": null, "items": [{"name": "n", "weight": 1}]}})
        );
    }

    #[test]
    fn list_kinds_from_schema() {
        assert_eq!(
            list_kind(&schema(), &["spec".into(), "items".into()]),
            ListKind::Map(vec!["name".into()])
        );
        assert_eq!(
            list_kind(&schema(), &["spec".into(), "free".into()]),
            ListKind::Atomic
        );
    }
}
