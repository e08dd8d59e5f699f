//! Field management for server-side apply: field sets, `managedFields` entries (FieldsV1),
//! ownership transfer on updates, apply conflicts and removal of fields an applier stopped sending.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value, json};

use crate::patch::ListKind;

/// One step into an object: a map field, an associative-list element by its keys, or a set member.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Step {
    Field(String),
    Key(String),
    Value(String),
}

pub type Path = Vec<Step>;
pub type FieldSet = BTreeSet<Path>;

/// Tells how the list at a path of field names merges.
pub trait ListKinds {
    fn list_kind(&self, path: &[String]) -> ListKind;
}

impl<F: Fn(&[String]) -> ListKind> ListKinds for F {
    fn list_kind(&self, path: &[String]) -> ListKind {
        self(path)
    }
}

fn names(path: &Path) -> Vec<String> {
    path.iter()
        .filter_map(|s| match s {
            Step::Field(f) => Some(f.clone()),
            _ => None,
        })
        .collect()
}

fn key_of(item: &Value, keys: &[String]) -> String {
    let map: Map<String, Value> = keys
        .iter()
        .filter_map(|k| item.get(k).map(|v| (k.clone(), v.clone())))
        .collect();
    Value::Object(map).to_string()
}

/// The metadata fields that are owned like any other; the rest of `metadata` is the server's.
const OWNED_METADATA: &[&str] = &["labels", "annotations", "finalizers", "ownerReferences"];

/// The leaf fields an object sets, excluding identity (`apiVersion`, `kind`, name, ...) and,
/// unless `with_status`, `status`.
pub fn field_set(obj: &Value, kinds: &dyn ListKinds, with_status: bool) -> FieldSet {
    let mut set = FieldSet::new();
    let Some(map) = obj.as_object() else {
        return set;
    };
    for (k, v) in map {
        match k.as_str() {
            "apiVersion" | "kind" => {}
            "status" if !with_status => {}
            "metadata" => {
                if let Some(meta) = v.as_object() {
                    for (mk, mv) in meta {
                        if OWNED_METADATA.contains(&mk.as_str()) {
                            let mut path =
                                vec![Step::Field("metadata".into()), Step::Field(mk.clone())];
                            collect(mv, &mut path, kinds, &mut set);
                        }
                    }
                }
            }
            _ => {
                let mut path = vec![Step::Field(k.clone())];
                collect(v, &mut path, kinds, &mut set);
            }
        }
    }
    set
}

fn collect(value: &Value, path: &mut Path, kinds: &dyn ListKinds, set: &mut FieldSet) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                path.push(Step::Field(k.clone()));
                collect(v, path, kinds, set);
                path.pop();
            }
        }
        Value::Array(items) => match kinds.list_kind(&names(path)) {
            ListKind::Atomic => {
                set.insert(path.clone());
            }
            ListKind::Set => {
                for item in items {
                    let mut p = path.clone();
                    p.push(Step::Value(item.to_string()));
                    set.insert(p);
                }
            }
            ListKind::Map(keys) => {
                for item in items {
                    path.push(Step::Key(key_of(item, &keys)));
                    set.insert(path.clone());
                    if let Some(m) = item.as_object() {
                        for (k, v) in m {
                            path.push(Step::Field(k.clone()));
                            collect(v, path, kinds, set);
                            path.pop();
                        }
                    }
                    path.pop();
                }
            }
        },
        _ => {
            set.insert(path.clone());
        }
    }
}

fn element_matches(item: &Value, step: &Step) -> bool {
    match step {
        Step::Key(k) => {
            let Ok(Value::Object(want)) = serde_json::from_str::<Value>(k) else {
                return false;
            };
            want.iter().all(|(f, v)| item.get(f) == Some(v))
        }
        Step::Value(v) => serde_json::from_str::<Value>(v).is_ok_and(|want| *item == want),
        Step::Field(_) => false,
    }
}

/// The value at a path, if the object has it.
pub fn get_at<'a>(obj: &'a Value, path: &[Step]) -> Option<&'a Value> {
    let mut cur = obj;
    for step in path {
        cur = match step {
            Step::Field(f) => cur.get(f)?,
            other => cur.as_array()?.iter().find(|i| element_matches(i, other))?,
        };
    }
    Some(cur)
}

/// Removes the value at a path; missing paths are left alone.
pub fn remove_at(obj: &mut Value, path: &[Step]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut cur = obj;
    for step in parents {
        let next = match step {
            Step::Field(f) => cur.get_mut(f),
            other => cur
                .as_array_mut()
                .and_then(|a| a.iter_mut().find(|i| element_matches(i, other))),
        };
        match next {
            Some(n) => cur = n,
            None => return,
        }
    }
    match last {
        Step::Field(f) => {
            if let Some(m) = cur.as_object_mut() {
                m.remove(f);
            }
        }
        other => {
            if let Some(a) = cur.as_array_mut() {
                a.retain(|i| !element_matches(i, other));
            }
        }
    }
}

/// Merges an applied configuration into the live object: maps recursively, associative lists by
/// key, sets by union, everything else replaced.
pub fn merge(
    live: &Value,
    applied: &Value,
    kinds: &dyn ListKinds,
    path: &mut Vec<String>,
) -> Value {
    match (live, applied) {
        (Value::Object(l), Value::Object(a)) => {
            let mut out = l.clone();
            for (k, v) in a {
                path.push(k.clone());
                let merged = match l.get(k) {
                    Some(lv) => merge(lv, v, kinds, path),
                    None => v.clone(),
                };
                path.pop();
                out.insert(k.clone(), merged);
            }
            Value::Object(out)
        }
        (Value::Array(l), Value::Array(a)) => match kinds.list_kind(path) {
            ListKind::Atomic => applied.clone(),
            ListKind::Set => {
                let mut out = l.clone();
                for item in a {
                    if !out.contains(item) {
                        out.push(item.clone());
                    }
                }
                Value::Array(out)
            }
            ListKind::Map(keys) => {
                let mut out = l.clone();
                for item in a {
                    let key = key_of(item, &keys);
                    match out.iter().position(|o| key_of(o, &keys) == key) {
                        Some(i) => out[i] = merge(&out[i], item, kinds, path),
                        None => out.push(item.clone()),
                    }
                }
                Value::Array(out)
            }
        },
        _ => applied.clone(),
    }
}

/// Renders a field set as FieldsV1 (`{"f:spec":{"f:replicas":{}}}`).
pub fn to_fields_v1(set: &FieldSet) -> Value {
    // A node that became a parent after it was inserted as a leaf needs its "." marker.
    fn mark(node: &mut Map<String, Value>, set: &FieldSet, path: &mut Path) {
        for (name, child) in node.iter_mut() {
            if name == "." {
                continue;
            }
            let step = match name.split_at(2) {
                ("f:", f) => Step::Field(f.into()),
                ("k:", k) => Step::Key(k.into()),
                (_, v) => Step::Value(v.into()),
            };
            path.push(step);
            if let Some(c) = child.as_object_mut() {
                if !c.is_empty() && set.contains(path) {
                    c.insert(".".into(), json!({}));
                }
                mark(c, set, path);
            }
            path.pop();
        }
    }
    let mut root = Map::new();
    for path in set {
        let mut node = &mut root;
        for step in path {
            let name = match step {
                Step::Field(f) => format!("f:{f}"),
                Step::Key(k) => format!("k:{k}"),
                Step::Value(v) => format!("v:{v}"),
            };
            node = node
                .entry(name)
                .or_insert_with(|| Value::Object(Map::new()))
                .as_object_mut()
                .expect("field set nodes are objects");
        }
        if !node.is_empty() {
            node.insert(".".into(), json!({}));
        }
    }
    mark(&mut root, set, &mut Vec::new());
    Value::Object(root)
}

/// Reads a FieldsV1 value back into a field set.
pub fn from_fields_v1(value: &Value) -> FieldSet {
    fn walk(node: &Map<String, Value>, path: &mut Path, set: &mut FieldSet) {
        for (name, child) in node {
            if name == "." {
                set.insert(path.clone());
                continue;
            }
            let step = match name.split_at_checked(2) {
                Some(("f:", f)) => Step::Field(f.into()),
                Some(("k:", k)) => Step::Key(k.into()),
                Some(("v:", v)) => Step::Value(v.into()),
                _ => continue,
            };
            path.push(step);
            match child.as_object() {
                Some(c) if !c.is_empty() => walk(c, path, set),
                _ => {
                    set.insert(path.clone());
                }
            }
            path.pop();
        }
    }
    let mut set = FieldSet::new();
    if let Some(m) = value.as_object() {
        walk(m, &mut Vec::new(), &mut set);
    }
    set
}

/// A path rendered for humans, as in apply conflict messages (`.spec.replicas`).
pub fn display(path: &[Step]) -> String {
    path.iter()
        .map(|s| match s {
            Step::Field(f) => format!(".{f}"),
            Step::Key(k) => format!("[{k}]"),
            Step::Value(v) => format!("[{v}]"),
        })
        .collect()
}

/// One `managedFields` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub manager: String,
    pub operation: String,
    pub api_version: String,
    pub subresource: String,
    pub time: String,
    pub fields: FieldSet,
}

impl Entry {
    fn same_owner(&self, manager: &str, operation: &str, subresource: &str) -> bool {
        self.manager == manager && self.operation == operation && self.subresource == subresource
    }
}

pub fn read_entries(obj: &Value) -> Vec<Entry> {
    obj["metadata"]["managedFields"]
        .as_array()
        .map(|entries| {
            entries
                .iter()
                .map(|e| Entry {
                    manager: e["manager"].as_str().unwrap_or_default().into(),
                    operation: e["operation"].as_str().unwrap_or_default().into(),
                    api_version: e["apiVersion"].as_str().unwrap_or_default().into(),
                    subresource: e["subresource"].as_str().unwrap_or_default().into(),
                    time: e["time"].as_str().unwrap_or_default().into(),
                    fields: from_fields_v1(&e["fieldsV1"]),
                })
                .collect()
        })
        .unwrap_or_default()
}

pub fn write_entries(obj: &mut Value, entries: &[Entry]) {
    let rendered: Vec<Value> = entries
        .iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            let mut v = json!({
                "manager": e.manager,
                "operation": e.operation,
                "apiVersion": e.api_version,
                "time": e.time,
                "fieldsType": "FieldsV1",
                "fieldsV1": to_fields_v1(&e.fields),
            });
            if !e.subresource.is_empty() {
                v["subresource"] = json!(e.subresource);
            }
            v
        })
        .collect();
    if obj.is_object() && !obj["metadata"].is_object() {
        obj["metadata"] = json!({});
    }
    if let Some(meta) = obj["metadata"].as_object_mut() {
        if rendered.is_empty() {
            meta.remove("managedFields");
        } else {
            meta.insert("managedFields".into(), Value::Array(rendered));
        }
    }
}

/// Who is writing and how.
#[derive(Debug, Clone)]
pub struct Writer<'a> {
    pub manager: &'a str,
    pub api_version: &'a str,
    pub subresource: &'a str,
    pub time: &'a str,
    pub with_status: bool,
}

/// Records an update (PUT or non-apply patch): the writer takes the fields it changed or added, and
/// every other manager loses them and any field that was removed.
pub fn record_update(old: Option<&Value>, new: &mut Value, w: &Writer<'_>, kinds: &dyn ListKinds) {
    let mut entries = old.map(read_entries).unwrap_or_default();
    let new_set = field_set(new, kinds, w.with_status);
    let old_set = old
        .map(|o| field_set(o, kinds, w.with_status))
        .unwrap_or_default();
    let changed: FieldSet = new_set
        .iter()
        .filter(|p| old.and_then(|o| get_at(o, p)) != get_at(new, p))
        .cloned()
        .collect();
    let removed: FieldSet = old_set.difference(&new_set).cloned().collect();
    if changed.is_empty() && removed.is_empty() {
        write_entries(new, &entries);
        return;
    }
    for e in &mut entries {
        e.fields
            .retain(|p| !changed.contains(p) && !removed.contains(p));
    }
    match entries
        .iter_mut()
        .find(|e| e.same_owner(w.manager, "Update", w.subresource))
    {
        Some(e) => {
            e.fields.extend(changed);
            e.time = w.time.into();
            e.api_version = w.api_version.into();
        }
        None => entries.push(Entry {
            manager: w.manager.into(),
            operation: "Update".into(),
            api_version: w.api_version.into(),
            subresource: w.subresource.into(),
            time: w.time.into(),
            fields: changed,
        }),
    }
    write_entries(new, &entries);
}

/// A field another manager owns with a different value.
#[derive(Debug, Clone, PartialEq)]
pub struct Conflict {
    pub manager: String,
    pub path: String,
}

/// The manager name `kubectl apply` (client-side) records its updates under.
pub const CLIENT_SIDE_APPLY_MANAGER: &str = "kubectl-client-side-apply";

/// Whether conflicts may be overridden as kube-apiserver does when a client-side-applied object is
/// first server-side applied: every conflict is with kubectl's client-side apply manager, on a
/// field its `last-applied-configuration` annotation holds.
pub fn client_side_apply_upgrade(
    live: &Value,
    conflicts: &[Conflict],
    kinds: &dyn ListKinds,
) -> bool {
    let Some(last) =
        live["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
            .as_str()
            .and_then(|s| serde_json::from_str::<Value>(s).ok())
    else {
        return false;
    };
    let last_fields: BTreeSet<String> = field_set(&last, kinds, true)
        .iter()
        .map(|p| display(p))
        .collect();
    conflicts
        .iter()
        .all(|c| c.manager == CLIENT_SIDE_APPLY_MANAGER && last_fields.contains(&c.path))
}

/// Server-side apply of `applied` onto `live` (None when creating). Returns the new object with
/// its `managedFields`, or the conflicts when not forced.
pub fn apply(
    live: Option<&Value>,
    applied: &Value,
    w: &Writer<'_>,
    force: bool,
    kinds: &dyn ListKinds,
) -> Result<Value, Vec<Conflict>> {
    let empty = json!({});
    let live_obj = live.unwrap_or(&empty);
    let mut entries = read_entries(live_obj);
    let applied_set = field_set(applied, kinds, w.with_status);
    let mut conflicts = Vec::new();
    let mut forced: BTreeMap<usize, Vec<Path>> = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        if e.same_owner(w.manager, "Apply", w.subresource) {
            continue;
        }
        for p in e.fields.intersection(&applied_set) {
            if get_at(live_obj, p) != get_at(applied, p) {
                conflicts.push(Conflict {
                    manager: e.manager.clone(),
                    path: display(p),
                });
                forced.entry(i).or_default().push(p.clone());
            }
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(conflicts);
    }
    for (i, paths) in forced {
        for p in paths {
            entries[i].fields.remove(&p);
        }
    }
    let previous: FieldSet = entries
        .iter()
        .find(|e| e.same_owner(w.manager, "Apply", w.subresource))
        .map(|e| e.fields.clone())
        .unwrap_or_default();
    let mut result = merge(live_obj, applied, kinds, &mut Vec::new());
    let owned_by_others: FieldSet = entries
        .iter()
        .filter(|e| !e.same_owner(w.manager, "Apply", w.subresource))
        .flat_map(|e| e.fields.iter().cloned())
        .collect();
    // Shallowest paths first: a dropped list element goes while its key fields still name it.
    let mut dropped: Vec<&Path> = previous
        .difference(&applied_set)
        .filter(|p| !owned_by_others.contains(*p))
        .collect();
    dropped.sort_by_key(|p| p.len());
    for p in dropped {
        remove_at(&mut result, p);
    }
    entries.retain(|e| !e.same_owner(w.manager, "Apply", w.subresource));
    entries.push(Entry {
        manager: w.manager.into(),
        operation: "Apply".into(),
        api_version: w.api_version.into(),
        subresource: w.subresource.into(),
        time: w.time.into(),
        fields: applied_set,
    });
    write_entries(&mut result, &entries);
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::patch::builtin_list_kind;
    use pretty_assertions::assert_eq;

    fn kinds() -> impl Fn(&[String]) -> ListKind {
        builtin_list_kind
    }

    fn writer(manager: &str) -> Writer<'_> {
        Writer {
            manager,
            api_version: "apps/v1",
            subresource: "",
            time: "2024-01-01T00:00:00Z",
            with_status: false,
        }
    }

    #[test]
    fn fields_v1_round_trip() {
        let obj = json!({"metadata": {"name": "x", "labels": {"a": "1"}, "finalizers": ["f"]},
            "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}},
            "status": {"ready": 1}});
        let set = field_set(&obj, &kinds(), false);
        let v1 = to_fields_v1(&set);
        assert_eq!(
            v1,
            json!({"f:metadata": {"f:labels": {"f:a": {}}, "f:finalizers": {"v:\"f\"": {}}},
                   "f:spec": {"f:replicas": {}, "f:template": {"f:spec": {"f:containers": {
                       "k:{\"name\":\"c\"}": {".": {}, "f:image": {}, "f:name": {}}}}}}})
        );
        assert_eq!(from_fields_v1(&v1), set);
    }

    #[test]
    fn apply_conflicts_force_and_removal() {
        let a1 = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "labels": {"x": "1", "y": "1"}},
            "spec": {"replicas": 1}});
        let obj = apply(None, &a1, &writer("alice"), false, &kinds()).unwrap();
        assert_eq!(obj["spec"]["replicas"], 1);

        // bob sets the same replicas value: shared ownership, no conflict.
        let b1 = json!({"spec": {"replicas": 1}});
        let obj = apply(Some(&obj), &b1, &writer("bob"), false, &kinds()).unwrap();
        // bob changes it: conflict with alice.
        let b2 = json!({"spec": {"replicas": 3}});
        let err = apply(Some(&obj), &b2, &writer("bob"), false, &kinds()).unwrap_err();
        assert_eq!(
            err,
            vec![Conflict {
                manager: "alice".into(),
                path: ".spec.replicas".into()
            }]
        );
        assert!(!client_side_apply_upgrade(&obj, &err, &kinds()));
        let obj = apply(Some(&obj), &b2, &writer("bob"), true, &kinds()).unwrap();
        assert_eq!(obj["spec"]["replicas"], 3);

        // alice stops sending label y and replicas: y goes, replicas stays (bob owns it).
        let a2 = json!({"metadata": {"name": "d", "labels": {"x": "1"}}});
        let obj = apply(Some(&obj), &a2, &writer("alice"), false, &kinds()).unwrap();
        assert_eq!(obj["metadata"]["labels"], json!({"x": "1"}));
        assert_eq!(obj["spec"]["replicas"], 3);
        let managers: Vec<String> = read_entries(&obj).into_iter().map(|e| e.manager).collect();
        assert_eq!(managers, vec!["bob".to_string(), "alice".to_string()]);
    }

    #[test]
    fn client_side_applied_fields_upgrade_to_server_side_apply() {
        let mut live = json!({"metadata": {"name": "c", "annotations": {
            "kubectl.kubernetes.io/last-applied-configuration": "{\"data\":{\"a\":\"1\"}}"}},
            "data": {"a": "1", "b": "1"}});
        record_update(
            None,
            &mut live,
            &writer(CLIENT_SIDE_APPLY_MANAGER),
            &kinds(),
        );
        let applied = json!({"metadata": {"name": "c"}, "data": {"a": "2", "b": "2"}});
        let conflicts =
            apply(Some(&live), &applied, &writer("kubectl"), false, &kinds()).unwrap_err();
        assert_eq!(conflicts.len(), 2);
        assert!(
            !client_side_apply_upgrade(&live, &conflicts, &kinds()),
            "b was never client-side applied"
        );
        assert!(client_side_apply_upgrade(&live, &conflicts[..1], &kinds()));
    }

    #[test]
    fn updates_take_ownership_without_conflict() {
        let a = json!({"metadata": {"name": "d"}, "spec": {"replicas": 1, "paused": false}});
        let live = apply(None, &a, &writer("alice"), false, &kinds()).unwrap();
        let mut updated = live.clone();
        updated["spec"]["replicas"] = json!(5);
        record_update(Some(&live), &mut updated, &writer("kubectl"), &kinds());
        let entries = read_entries(&updated);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[1].manager, "kubectl");
        assert_eq!(entries[1].operation, "Update");
        assert!(!entries[0].fields.contains(&vec![
            Step::Field("spec".into()),
            Step::Field("replicas".into())
        ]));
        // alice re-applying her old value now conflicts with kubectl.
        let err = apply(Some(&updated), &a, &writer("alice"), false, &kinds()).unwrap_err();
        assert_eq!(err[0].manager, "kubectl");
    }

    #[test]
    fn associative_list_elements_are_removed_by_key() {
        let a1 = json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}}}});
        let live = apply(None, &a1, &writer("m"), false, &kinds()).unwrap();
        let a2 =
            json!({"spec": {"template": {"spec": {"containers": [{"name": "a", "image": "2"}]}}}});
        let out = apply(Some(&live), &a2, &writer("m"), false, &kinds()).unwrap();
        assert_eq!(
            out["spec"]["template"]["spec"]["containers"],
            json!([{"name": "a", "image": "2"}])
        );
    }
}
