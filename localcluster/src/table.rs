//! `meta.k8s.io/v1` Table rendering (what `kubectl get` asks for) and PartialObjectMetadata.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::resources::{PrinterColumn, ResourceDef};

/// How much of each object a Table row carries (`?includeObject=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncludeObject {
    None,
    Metadata,
    Object,
}

impl IncludeObject {
    pub fn parse(s: Option<&str>) -> Self {
        match s {
            Some("None") => Self::None,
            Some("Object") => Self::Object,
            _ => Self::Metadata,
        }
    }
}

fn column(
    name: &str,
    type_: &str,
    format: &str,
    description: &str,
    priority: i64,
) -> PrinterColumn {
    PrinterColumn {
        name: name.into(),
        type_: type_.into(),
        format: format.into(),
        description: description.into(),
        priority,
        json_path: String::new(),
    }
}

/// The columns of a resource's table.
pub fn columns(def: &ResourceDef) -> Vec<PrinterColumn> {
    let name = column(
        "Name",
        "string",
        "name",
        "Name must be unique within a namespace.",
        0,
    );
    if def.custom {
        let mut cols = vec![name];
        if def.printer_columns.is_empty() {
            let mut age = column("Age", "date", "", "CreationTimestamp", 0);
            age.json_path = ".metadata.creationTimestamp".into();
            cols.push(age);
        } else {
            cols.extend(def.printer_columns.iter().cloned());
        }
        return cols;
    }
    match (def.group.as_str(), def.plural.as_str()) {
        ("", "pods") => vec![
            name,
            column(
                "Ready",
                "string",
                "",
                "The aggregate readiness state of this pod for accepting traffic.",
                0,
            ),
            column(
                "Status",
                "string",
                "",
                "The aggregate status of the containers in this pod.",
                0,
            ),
            column(
                "Restarts",
                "string",
                "",
                "The number of times the containers in this pod have been restarted and when the last container in this pod has restarted.",
                0,
            ),
            column("Age", "string", "", "CreationTimestamp", 0),
            column("IP", "string", "", "IP address allocated to the pod.", 1),
            column(
                "Node",
                "string",
                "",
                "Name of the node the pod is assigned to.",
                1,
            ),
            column(
                "Nominated Node",
                "string",
                "",
                "Name of the node nominated for this pod.",
                1,
            ),
            column("Readiness Gates", "string", "", "Pod readiness gates.", 1),
        ],
        ("", "nodes") => vec![
            name,
            column("Status", "string", "", "The status of the node", 0),
            column("Roles", "string", "", "The roles of the node", 0),
            column("Age", "string", "", "CreationTimestamp", 0),
            column(
                "Version",
                "string",
                "",
                "Kubelet Version reported by the node.",
                0,
            ),
            column("Internal-IP", "string", "", "Internal IP of the node", 1),
        ],
        ("" | "events.k8s.io", "events") => vec![
            column(
                "Last Seen",
                "string",
                "",
                "Time since the event was last seen.",
                0,
            ),
            column("Type", "string", "", "Type of this event.", 0),
            column("Reason", "string", "", "Why the event was generated.", 0),
            column("Object", "string", "", "The object this event is about.", 0),
            column(
                "Subobject",
                "string",
                "",
                "The part of the object this event is about.",
                1,
            ),
            column(
                "Source",
                "string",
                "",
                "The component reporting the event.",
                1,
            ),
            column("Message", "string", "", "A description of the event.", 0),
            column(
                "First Seen",
                "string",
                "",
                "Time since the event was first seen.",
                1,
            ),
            column("Count", "string", "", "How often the event occurred.", 1),
            name,
        ],
        ("", "namespaces") => vec![
            name,
            column("Status", "string", "", "The status of the namespace", 0),
            column("Age", "string", "", "CreationTimestamp", 0),
        ],
        _ => vec![
            name,
            column("Created At", "date", "", "CreationTimestamp", 0),
        ],
    }
}

/// A duration as kubectl prints ages: `42s`, `5m3s`, `3h`, `2d4h`.
pub fn human_duration(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        s if s < 120 => format!("{s}s"),
        s if s < 600 => format!("{}m{}s", s / 60, s % 60),
        s if s < 3 * 3600 => format!("{}m", s / 60),
        s if s < 8 * 3600 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        s if s < 48 * 3600 => format!("{}h", s / 3600),
        s if s < 8 * 86_400 => format!("{}d{}h", s / 86_400, (s % 86_400) / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn age(obj: &Value, now: DateTime<Utc>) -> String {
    obj["metadata"]["creationTimestamp"]
        .as_str()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map_or_else(
            || "<unknown>".into(),
            |t| human_duration((now - t.with_timezone(&Utc)).num_seconds()),
        )
}

/// Evaluates the simple JSONPath expressions printer columns use (`.status.phase`,
/// `.spec.list[0].name`).
pub fn json_path<'a>(obj: &'a Value, path: &str) -> Option<&'a Value> {
    let trimmed = path.trim().trim_start_matches('{').trim_end_matches('}');
    let mut cur = obj;
    for seg in trimmed.trim_start_matches('.').split('.') {
        if seg.is_empty() {
            continue;
        }
        let (field, index) = match seg.split_once('[') {
            Some((f, rest)) => (f, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (seg, None),
        };
        if !field.is_empty() {
            cur = cur.get(field)?;
        }
        if let Some(i) = index {
            cur = cur.get(i)?;
        }
    }
    Some(cur)
}

fn pod_cells(obj: &Value, now: DateTime<Utc>) -> Vec<Value> {
    let spec = &obj["spec"];
    let status = &obj["status"];
    let total = spec["containers"].as_array().map_or(0, Vec::len);
    let statuses = status["containerStatuses"].as_array();
    let ready = statuses.map_or(0, |s| {
        s.iter()
            .filter(|c| c["ready"].as_bool() == Some(true))
            .count()
    });
    let restarts: i64 = statuses.map_or(0, |s| {
        s.iter().filter_map(|c| c["restartCount"].as_i64()).sum()
    });
    let mut reason = status["reason"]
        .as_str()
        .or_else(|| status["phase"].as_str())
        .unwrap_or("Pending")
        .to_string();
    if let Some(s) = statuses {
        for c in s {
            if let Some(r) = c["state"]["waiting"]["reason"].as_str() {
                reason = r.to_string();
            } else if let Some(r) = c["state"]["terminated"]["reason"].as_str() {
                reason = r.to_string();
            }
        }
    }
    if obj["metadata"]["deletionTimestamp"].is_string() {
        reason = "Terminating".into();
    }
    let text = |v: &Value| v.as_str().unwrap_or("<none>").to_string();
    vec![
        obj["metadata"]["name"].clone(),
        json!(format!("{ready}/{total}")),
        json!(reason),
        json!(restarts),
        json!(age(obj, now)),
        json!(text(&status["podIP"])),
        json!(text(&spec["nodeName"])),
        json!(text(&status["nominatedNodeName"])),
        json!("<none>"),
    ]
}

fn node_cells(obj: &Value, now: DateTime<Utc>) -> Vec<Value> {
    let ready = obj["status"]["conditions"].as_array().and_then(|cs| {
        cs.iter()
            .find(|c| c["type"] == "Ready")
            .map(|c| c["status"] == "True")
    });
    let mut status = match ready {
        Some(true) => "Ready".to_string(),
        _ => "NotReady".to_string(),
    };
    if obj["spec"]["unschedulable"].as_bool() == Some(true) {
        status.push_str(",SchedulingDisabled");
    }
    let roles: Vec<&str> = obj["metadata"]["labels"]
        .as_object()
        .map(|l| {
            l.keys()
                .filter_map(|k| k.strip_prefix("node-role.kubernetes.io/"))
                .collect()
        })
        .unwrap_or_default();
    let internal_ip = obj["status"]["addresses"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["type"] == "InternalIP"))
        .and_then(|a| a["address"].as_str())
        .unwrap_or("<none>");
    vec![
        obj["metadata"]["name"].clone(),
        json!(status),
        json!(if roles.is_empty() {
            "<none>".to_string()
        } else {
            roles.join(",")
        }),
        json!(age(obj, now)),
        json!(
            obj["status"]["nodeInfo"]["kubeletVersion"]
                .as_str()
                .unwrap_or("")
        ),
        json!(internal_ip),
    ]
}

/// The cells kube-apiserver's event printer gives, for either event version (read in core form).
fn event_cells(obj: &Value, now: DateTime<Utc>) -> Vec<Value> {
    let ev = crate::events::convert(obj.clone(), "v1");
    let since = |v: &Value| {
        v.as_str()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| human_duration((now - t.with_timezone(&Utc)).num_seconds()))
    };
    let unknown = || "<unknown>".to_string();
    let first = since(&ev["firstTimestamp"]).or_else(|| since(&ev["eventTime"]));
    let (last, count) = if ev["series"].is_object() {
        (
            since(&ev["series"]["lastObservedTime"]),
            ev["series"]["count"].as_i64().unwrap_or(1),
        )
    } else {
        (
            since(&ev["lastTimestamp"]).or_else(|| first.clone()),
            ev["count"].as_i64().filter(|c| *c != 0).unwrap_or(1),
        )
    };
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let involved = &ev["involvedObject"];
    let kind = text(&involved["kind"]).to_lowercase();
    let target = match involved["name"].as_str().filter(|n| !n.is_empty()) {
        Some(name) => format!("{kind}/{name}"),
        None => kind,
    };
    let non_empty = |a: String, b: String| if a.is_empty() { b } else { a };
    let component = non_empty(
        text(&ev["source"]["component"]),
        text(&ev["reportingComponent"]),
    );
    let instance = non_empty(text(&ev["source"]["host"]), text(&ev["reportingInstance"]));
    let source = if instance.is_empty() {
        component
    } else {
        format!("{component}, {instance}")
    };
    vec![
        json!(last.unwrap_or_else(unknown)),
        ev["type"].clone(),
        ev["reason"].clone(),
        json!(target),
        json!(text(&involved["fieldPath"])),
        json!(source),
        json!(text(&ev["message"]).trim()),
        json!(first.unwrap_or_else(unknown)),
        json!(count),
        ev["metadata"]["name"].clone(),
    ]
}

fn cells(def: &ResourceDef, cols: &[PrinterColumn], obj: &Value, now: DateTime<Utc>) -> Vec<Value> {
    if !def.custom {
        match (def.group.as_str(), def.plural.as_str()) {
            ("", "pods") => return pod_cells(obj, now),
            ("" | "events.k8s.io", "events") => return event_cells(obj, now),
            ("", "nodes") => return node_cells(obj, now),
            ("", "namespaces") => {
                return vec![
                    obj["metadata"]["name"].clone(),
                    obj["status"]["phase"].clone(),
                    json!(age(obj, now)),
                ];
            }
            _ => {
                return vec![
                    obj["metadata"]["name"].clone(),
                    obj["metadata"]["creationTimestamp"].clone(),
                ];
            }
        }
    }
    cols.iter()
        .map(|c| {
            if c.format == "name" && c.json_path.is_empty() {
                return obj["metadata"]["name"].clone();
            }
            match json_path(obj, &c.json_path) {
                None | Some(Value::Null) => Value::Null,
                Some(v) if c.type_ == "date" => v
                    .as_str()
                    .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                    .map_or(Value::Null, |t| {
                        json!(human_duration((now - t.with_timezone(&Utc)).num_seconds()))
                    }),
                Some(v @ (Value::Object(_) | Value::Array(_))) => json!(v.to_string()),
                Some(v) => v.clone(),
            }
        })
        .collect()
}

/// The PartialObjectMetadata of an object.
pub fn partial_metadata(obj: &Value) -> Value {
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj["metadata"],
    })
}

/// Renders objects as a Table; `with_columns` is false for watch events after the first.
pub fn render(
    def: &ResourceDef,
    objects: &[Value],
    include: IncludeObject,
    with_columns: bool,
    resource_version: &str,
    now: DateTime<Utc>,
) -> Value {
    let cols = columns(def);
    let rows: Vec<Value> = objects
        .iter()
        .map(|obj| {
            let mut row = json!({"cells": cells(def, &cols, obj, now)});
            match include {
                IncludeObject::None => {}
                IncludeObject::Metadata => row["object"] = partial_metadata(obj),
                IncludeObject::Object => row["object"] = obj.clone(),
            }
            row
        })
        .collect();
    let mut table = json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "rows": rows,
    });
    if with_columns {
        table["columnDefinitions"] = cols
            .iter()
            .map(|c| {
                json!({"name": c.name, "type": c.type_, "format": c.format,
                       "description": c.description, "priority": c.priority})
            })
            .collect();
    } else {
        table["columnDefinitions"] = Value::Null;
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{builtins, from_crd};

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2024-01-01T00:10:00Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn durations_read_like_kubectl() {
        assert_eq!(human_duration(5), "5s");
        assert_eq!(human_duration(185), "3m5s");
        assert_eq!(human_duration(3600), "60m");
        assert_eq!(human_duration(4 * 3600 + 120), "4h2m");
        assert_eq!(human_duration(30 * 3600), "30h");
        assert_eq!(human_duration(3 * 86_400 + 3600), "3d1h");
    }

    #[test]
    fn pod_rows() {
        let pods = builtins().into_iter().find(|d| d.plural == "pods").unwrap();
        let pod = json!({"metadata": {"name": "p", "creationTimestamp": "2024-01-01T00:00:00Z"},
            "spec": {"containers": [{"name": "a"}, {"name": "b"}], "nodeName": "n1"},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "a", "ready": true, "restartCount": 1, "state": {"running": {}}},
                {"name": "b", "ready": false, "restartCount": 0, "state": {"running": {}}}]}});
        let t = render(&pods, &[pod], IncludeObject::Metadata, true, "7", now());
        assert_eq!(
            t["rows"][0]["cells"],
            json!([
                "p", "1/2", "Running", 1, "10m", "<none>", "n1", "<none>", "<none>"
            ])
        );
        assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
        assert_eq!(t["columnDefinitions"][1]["name"], "Ready");
    }

    #[test]
    fn event_rows_read_either_version() {
        let defs = builtins();
        let core = defs
            .iter()
            .find(|d| d.group.is_empty() && d.plural == "events")
            .unwrap();
        let new = defs
            .iter()
            .find(|d| d.group == "events.k8s.io" && d.plural == "events")
            .unwrap();
        let recorded = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": "p.1"}, "eventTime": "2024-01-01T00:09:00.000000Z",
            "regarding": {"kind": "Pod", "name": "p", "fieldPath": "spec.containers{a}"},
            "reason": "Started", "type": "Normal", "note": " started ",
            "reportingController": "ctl", "reportingInstance": "ctl-1"});
        let row = json!([
            "60s",
            "Normal",
            "Started",
            "pod/p",
            "spec.containers{a}",
            "ctl, ctl-1",
            "started",
            "60s",
            1,
            "p.1"
        ]);
        let t = render(
            new,
            std::slice::from_ref(&recorded),
            IncludeObject::None,
            true,
            "1",
            now(),
        );
        assert_eq!(t["rows"][0]["cells"], row);
        let stored = crate::events::convert(recorded, "v1");
        let t = render(core, &[stored], IncludeObject::None, true, "1", now());
        assert_eq!(t["rows"][0]["cells"], row);
        assert_eq!(t["columnDefinitions"][0]["name"], "Last Seen");
    }

    #[test]
    fn crd_printer_columns() {
        let crd = json!({"spec": {"group": "x.io", "names": {"plural": "ws", "kind": "W"},
            "versions": [{"name": "v1", "served": true, "additionalPrinterColumns": [
                {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                {"name": "First", "type": "string", "jsonPath": ".spec.items[0].name"},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]}]}});
        let def = from_crd(&crd).unwrap().remove(0);
        let obj = json!({"metadata": {"name": "w", "creationTimestamp": "2024-01-01T00:09:00Z"},
            "spec": {"items": [{"name": "i0"}]}, "status": {"phase": "Ready"}});
        let t = render(&def, &[obj], IncludeObject::None, true, "1", now());
        assert_eq!(t["rows"][0]["cells"], json!(["w", "Ready", "i0", "60s"]));
        assert!(t["rows"][0].get("object").is_none());
    }
}
