//! Patch application: JSON patch (RFC 6902), JSON merge patch (RFC 7386) and Kubernetes'
//! strategic merge patch for built-in kinds.

use serde_json::{Map, Value};

/// A patch that could not be applied.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PatchError {
    #[error("invalid JSON patch: {0}")]
    InvalidJsonPatch(String),
    #[error("JSON patch failed: {0}")]
    JsonPatch(String),
    #[error("invalid strategic merge patch at {path}: {message}")]
    Strategic { path: String, message: String },
}

/// How a list field merges, from Kubernetes' `patchStrategy` / `x-kubernetes-list-type` markers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListKind {
    /// Replaced as a whole.
    Atomic,
    /// A list of scalars merged as a set.
    Set,
    /// A list of objects identified by these keys.
    Map(Vec<String>),
}

/// The list strategy of a built-in field, by its path of field names (list indices left out).
pub fn builtin_list_kind(path: &[String]) -> ListKind {
    let Some(last) = path.last() else {
        return ListKind::Atomic;
    };
    let parent = path.len().checked_sub(2).map(|i| path[i].as_str());
    let key = |k: &str| ListKind::Map(vec![k.to_string()]);
    match last.as_str() {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "imagePullSecrets"
        | "schedulingGates"
        | "resourceClaims"
        | "webhooks" => key("name"),
        "ports"
            if matches!(
                parent,
                Some("containers" | "initContainers" | "ephemeralContainers")
            ) =>
        {
            ListKind::Map(vec!["containerPort".into(), "protocol".into()])
        }
        "ports" => ListKind::Map(vec!["port".into(), "protocol".into()]),
        "volumeMounts" => key("mountPath"),
        "volumeDevices" => key("devicePath"),
        "conditions" => key("type"),
        "addresses" if parent == Some("status") => key("type"),
        "hostAliases" => key("ip"),
        "ownerReferences" => key("uid"),
        "topologySpreadConstraints" => key("topologyKey"),
        "taints" => key("key"),
        "finalizers" if parent == Some("metadata") => ListKind::Set,
        _ => ListKind::Atomic,
    }
}

/// Applies a JSON patch. A `test` of `null` succeeds on a missing path, as in Kubernetes
/// (kube-runtime's `finalizer()` relies on it to add the first finalizer).
pub fn json_patch(target: &Value, patch: &Value) -> Result<Value, PatchError> {
    let ops = patch
        .as_array()
        .ok_or_else(|| PatchError::InvalidJsonPatch("the patch must be a JSON array".into()))?;
    let mut kept = Vec::with_capacity(ops.len());
    for op in ops {
        let missing_null_test = op["op"] == "test"
            && op["value"].is_null()
            && op["path"]
                .as_str()
                .is_some_and(|p| target.pointer(p).is_none());
        if !missing_null_test {
            kept.push(op.clone());
        }
    }
    let parsed: json_patch::Patch = serde_json::from_value(Value::Array(kept))
        .map_err(|e| PatchError::InvalidJsonPatch(e.to_string()))?;
    let mut doc = target.clone();
    json_patch::patch(&mut doc, &parsed).map_err(|e| PatchError::JsonPatch(e.to_string()))?;
    Ok(doc)
}

/// Applies a JSON merge patch.
pub fn merge_patch(target: &Value, patch: &Value) -> Value {
    let mut doc = target.clone();
    json_patch::merge(&mut doc, patch);
    doc
}

/// Applies a strategic merge patch with the built-in list strategies.
pub fn strategic_merge_patch(target: &Value, patch: &Value) -> Result<Value, PatchError> {
    let mut path = Vec::new();
    match merge_value(Some(target), patch, &mut path)? {
        Some(v) => Ok(v),
        None => Ok(Value::Object(Map::new())),
    }
}

fn err(path: &[String], message: impl Into<String>) -> PatchError {
    PatchError::Strategic {
        path: format!(".{}", path.join(".")),
        message: message.into(),
    }
}

/// Merges `patch` into `original`; `None` means the value is deleted.
fn merge_value(
    original: Option<&Value>,
    patch: &Value,
    path: &mut Vec<String>,
) -> Result<Option<Value>, PatchError> {
    match patch {
        Value::Null => Ok(None),
        Value::Object(p) => {
            match p.get("$patch").and_then(Value::as_str) {
                Some("delete") => return Ok(None),
                Some("replace") => {
                    let mut replaced = p.clone();
                    replaced.remove("$patch");
                    return Ok(Some(strip_directives(&Value::Object(replaced))));
                }
                Some(other) => {
                    return Err(err(path, format!("unknown $patch directive {other:?}")));
                }
                None => {}
            }
            let Some(Value::Object(orig)) = original else {
                return Ok(Some(strip_directives(patch)));
            };
            merge_map(orig, p, path).map(|m| Some(Value::Object(m)))
        }
        other => Ok(Some(other.clone())),
    }
}

fn merge_map(
    orig: &Map<String, Value>,
    patch: &Map<String, Value>,
    path: &mut Vec<String>,
) -> Result<Map<String, Value>, PatchError> {
    let mut out = orig.clone();
    let mut orders = Vec::new();
    for (key, value) in patch {
        if key == "$patch" {
            continue;
        }
        if key == "$retainKeys" {
            continue;
        }
        if let Some(field) = key.strip_prefix("$setElementOrder/") {
            orders.push((field.to_string(), value.clone()));
            continue;
        }
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            let remove = value
                .as_array()
                .ok_or_else(|| err(path, format!("{key} must be a list")))?;
            if let Some(Value::Array(items)) = out.get_mut(field) {
                items.retain(|i| !remove.contains(i));
            }
            continue;
        }
        path.push(key.clone());
        let current = out.get(key).cloned();
        let merged = match value {
            Value::Array(items) => merge_list(current.as_ref(), items, path)?,
            _ => merge_value(current.as_ref(), value, path)?,
        };
        path.pop();
        match merged {
            Some(v) => {
                out.insert(key.clone(), v);
            }
            None => {
                out.remove(key);
            }
        }
    }
    for (field, order) in orders {
        path.push(field.clone());
        let kind = builtin_list_kind(path);
        path.pop();
        if let Some(Value::Array(items)) = out.get_mut(&field) {
            reorder(items, &order, &kind);
        }
    }
    if let Some(retain) = patch.get("$retainKeys") {
        let keep: Vec<&str> = retain
            .as_array()
            .ok_or_else(|| err(path, "$retainKeys must be a list"))?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        out.retain(|k, _| keep.contains(&k.as_str()));
    }
    Ok(out)
}

fn element_key(item: &Value, keys: &[String]) -> Vec<Value> {
    keys.iter()
        .map(|k| match (k.as_str(), item.get(k)) {
            // Kubernetes defaults the protocol of ports, so a patch without it names TCP.
            ("protocol", None) => Value::String("TCP".into()),
            (_, v) => v.cloned().unwrap_or(Value::Null),
        })
        .collect()
}

fn merge_list(
    original: Option<&Value>,
    patch: &[Value],
    path: &mut Vec<String>,
) -> Result<Option<Value>, PatchError> {
    let kind = builtin_list_kind(path);
    let orig: Vec<Value> = match original {
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    };
    let replace_all = patch
        .iter()
        .any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace"));
    let patch_items: Vec<&Value> = patch
        .iter()
        .filter(|i| i.get("$patch").and_then(Value::as_str) != Some("replace"))
        .collect();
    match kind {
        ListKind::Atomic => Ok(Some(strip_directives(&Value::Array(patch.to_vec())))),
        _ if replace_all => Ok(Some(strip_directives(&Value::Array(
            patch_items.into_iter().cloned().collect(),
        )))),
        ListKind::Set => {
            let mut out = orig;
            for item in patch_items {
                if !out.contains(item) {
                    out.push(item.clone());
                }
            }
            Ok(Some(Value::Array(out)))
        }
        ListKind::Map(keys) => {
            let mut out = orig;
            for item in patch_items {
                if !item.is_object() {
                    return Err(err(path, "list items must be objects with merge keys"));
                }
                let key = element_key(item, &keys);
                let pos = out.iter().position(|o| element_key(o, &keys) == key);
                if item.get("$patch").and_then(Value::as_str) == Some("delete") {
                    if let Some(i) = pos {
                        out.remove(i);
                    }
                    continue;
                }
                match pos {
                    Some(i) => {
                        if let Some(merged) = merge_value(Some(&out[i]), item, path)? {
                            out[i] = merged;
                        }
                    }
                    None => out.push(strip_directives(item)),
                }
            }
            Ok(Some(Value::Array(out)))
        }
    }
}

/// Orders `items` as `$setElementOrder` lists them; items it does not name keep their place after.
fn reorder(items: &mut Vec<Value>, order: &Value, kind: &ListKind) {
    let Some(order) = order.as_array() else {
        return;
    };
    let position = |item: &Value| {
        order.iter().position(|o| match kind {
            ListKind::Map(keys) => element_key(o, keys) == element_key(item, keys),
            _ => o == item,
        })
    };
    let mut indexed: Vec<(usize, usize, Value)> = items
        .drain(..)
        .enumerate()
        .map(|(i, v)| (position(&v).unwrap_or(usize::MAX), i, v))
        .collect();
    indexed.sort_by_key(|(p, i, _)| (*p, *i));
    items.extend(indexed.into_iter().map(|(_, _, v)| v));
}

/// Removes `$`-directives from a value that is inserted as is.
fn strip_directives(value: &Value) -> Value {
    match value {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), strip_directives(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(strip_directives).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::json;

    #[test]
    fn json_patch_null_test_on_missing_path_succeeds() {
        let obj = json!({"metadata": {"name": "a"}});
        let patch = json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}
        ]);
        let out = json_patch(&obj, &patch).unwrap();
        assert_eq!(out["metadata"]["finalizers"], json!(["x"]));
        let failing = json!([{"op": "test", "path": "/metadata/name", "value": "b"}]);
        assert!(matches!(
            json_patch(&obj, &failing),
            Err(PatchError::JsonPatch(_))
        ));
        // Once the finalizers exist, the same null test must fail.
        assert!(json_patch(&out, &patch).is_err());
    }

    #[test]
    fn merge_patch_deletes_with_null() {
        let obj = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        let out = merge_patch(&obj, &json!({"a": {"b": null}, "l": [3]}));
        assert_eq!(out, json!({"a": {"c": 2}, "l": [3]}));
    }

    #[test]
    fn strategic_merge_merges_containers_by_name() {
        let pod = json!({"spec": {"containers": [
            {"name": "a", "image": "a:1", "env": [{"name": "X", "value": "1"}]},
            {"name": "b", "image": "b:1"}
        ], "tolerations": [{"key": "t"}]}});
        let patch = json!({"spec": {
            "$setElementOrder/containers": [{"name": "b"}, {"name": "a"}, {"name": "c"}],
            "containers": [
                {"name": "a", "image": "a:2", "env": [{"name": "Y", "value": "2"}]},
                {"name": "c", "image": "c:1"}
            ],
            "tolerations": [{"key": "u"}]
        }});
        let out = strategic_merge_patch(&pod, &patch).unwrap();
        assert_eq!(
            out,
            json!({"spec": {"containers": [
                {"name": "b", "image": "b:1"},
                {"name": "a", "image": "a:2", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
                {"name": "c", "image": "c:1"}
            ], "tolerations": [{"key": "u"}]}})
        );
    }

    #[test]
    fn strategic_merge_directives() {
        let obj = json!({
            "metadata": {"finalizers": ["a", "b"], "labels": {"x": "1", "y": "2"}},
            "spec": {"containers": [{"name": "a"}, {"name": "b"}],
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}}}
        });
        let patch = json!({
            "metadata": {"$deleteFromPrimitiveList/finalizers": ["a"], "finalizers": ["c"],
                         "labels": {"$patch": "replace", "z": "3"}},
            "spec": {"containers": [{"name": "a", "$patch": "delete"}],
                     "strategy": {"$retainKeys": ["type"], "type": "Recreate"}}
        });
        let out = strategic_merge_patch(&obj, &patch).unwrap();
        assert_eq!(
            out,
            json!({
                "metadata": {"finalizers": ["b", "c"], "labels": {"z": "3"}},
                "spec": {"containers": [{"name": "b"}], "strategy": {"type": "Recreate"}}
            })
        );
        let replace_list = json!({"spec": {"containers": [{"$patch": "replace"}, {"name": "z"}]}});
        let out = strategic_merge_patch(&obj, &replace_list).unwrap();
        assert_eq!(out["spec"]["containers"], json!([{"name": "z"}]));
    }

    #[test]
    fn container_ports_merge_by_port_and_protocol() {
        let obj =
            json!({"spec": {"containers": [{"name": "a", "ports": [{"containerPort": 80}]}]}});
        let patch = json!({"spec": {"containers": [{"name": "a", "ports": [
            {"containerPort": 80, "protocol": "TCP", "name": "http"},
            {"containerPort": 53, "protocol": "UDP"}
        ]}]}});
        let out = strategic_merge_patch(&obj, &patch).unwrap();
        assert_eq!(
            out["spec"]["containers"][0]["ports"],
            json!([{"containerPort": 80, "name": "http", "protocol": "TCP"}, {"containerPort": 53, "protocol": "UDP"}])
        );
    }
}
