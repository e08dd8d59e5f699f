//! Events are one stored resource served at two versions, as in kube-apiserver: core `v1` (the
//! storage form, what `kubectl get events` and `kubectl describe` read) and `events.k8s.io/v1`
//! (what kube-rs's `Recorder` writes). Objects are renamed field by field on the way in and out,
//! following kube-apiserver's `events/v1` conversion.

use serde_json::Value;

use crate::resources::GroupResource;

const CORE: &str = "v1";
const EVENTS: &str = "events.k8s.io/v1";

/// core `v1` field, `events.k8s.io/v1` field. Every other field has the same name in both.
const RENAMES: &[(&str, &str)] = &[
    ("involvedObject", "regarding"),
    ("message", "note"),
    ("source", "deprecatedSource"),
    ("firstTimestamp", "deprecatedFirstTimestamp"),
    ("lastTimestamp", "deprecatedLastTimestamp"),
    ("count", "deprecatedCount"),
    ("reportingComponent", "reportingController"),
];

/// Whether objects of this group/resource are events, stored in core form.
pub fn is_events(gr: &GroupResource) -> bool {
    gr.group.is_empty() && gr.resource == "events"
}

/// The object at `api_version`, when it is an Event at one of the two event versions; any other
/// object just gets `api_version` set.
pub fn convert(mut obj: Value, api_version: &str) -> Value {
    let from = obj["apiVersion"].as_str().unwrap_or_default().to_string();
    let is_event = obj["kind"] == "Event";
    if let Some(map) = obj.as_object_mut().filter(|_| is_event) {
        let renames: Vec<(&str, &str)> = match (from.as_str(), api_version) {
            (CORE, EVENTS) => RENAMES.to_vec(),
            (EVENTS, CORE) => RENAMES.iter().map(|&(core, ev)| (ev, core)).collect(),
            _ => Vec::new(),
        };
        for (old, new) in renames {
            if let Some(v) = map.remove(old) {
                map.insert(new.to_string(), v);
            }
        }
    }
    obj["apiVersion"] = Value::String(api_version.to_string());
    obj
}

/// The object in the form its store keeps: core `v1` for events, unchanged otherwise.
pub fn to_storage(gr: &GroupResource, obj: Value) -> Value {
    if is_events(gr) {
        convert(obj, CORE)
    } else {
        obj
    }
}

/// The stored (core) field an `events.k8s.io/v1` field selector names; `None` when the
/// field has the same name in both versions.
pub fn core_field(field: &str) -> Option<String> {
    RENAMES.iter().find_map(|&(core, ev)| {
        let rest = field.strip_prefix(ev)?;
        (rest.is_empty() || rest.starts_with('.')).then(|| format!("{core}{rest}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn core() -> Value {
        json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": "e", "namespace": "ns"},
            "involvedObject": {"kind": "Pod", "name": "p", "namespace": "ns", "uid": "u1"},
            "message": "hello", "reason": "Started", "type": "Normal",
            "source": {"component": "c"}, "count": 3,
            "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:01:00Z",
            "reportingComponent": "ctl", "reportingInstance": "ctl-1",
            "eventTime": "2026-01-01T00:00:00.000000Z", "action": "Start",
            "series": {"count": 2, "lastObservedTime": "2026-01-01T00:01:00.000000Z"},
            "related": {"kind": "Node", "name": "n"}
        })
    }

    #[test]
    fn core_to_events_renames_and_round_trips() {
        let ev = convert(core(), EVENTS);
        assert_eq!(ev["apiVersion"], EVENTS);
        assert_eq!(ev["regarding"]["uid"], "u1");
        assert_eq!(ev["note"], "hello");
        assert_eq!(ev["deprecatedSource"]["component"], "c");
        assert_eq!(ev["deprecatedCount"], 3);
        assert_eq!(ev["deprecatedFirstTimestamp"], "2026-01-01T00:00:00Z");
        assert_eq!(ev["deprecatedLastTimestamp"], "2026-01-01T00:01:00Z");
        assert_eq!(ev["reportingController"], "ctl");
        assert_eq!(ev["series"]["count"], 2);
        assert_eq!(ev["related"]["kind"], "Node");
        for (core_name, _) in RENAMES {
            assert!(ev.get(core_name).is_none(), "{core_name} left behind");
        }
        assert_eq!(convert(ev, CORE), core());
    }

    #[test]
    fn same_version_and_other_kinds_only_set_api_version() {
        assert_eq!(convert(core(), CORE), core());
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "message": "m"});
        assert_eq!(convert(cm.clone(), "v1"), cm);
    }

    #[test]
    fn only_events_are_stored_converted() {
        let ev = convert(core(), EVENTS);
        let events = GroupResource {
            group: String::new(),
            resource: "events".into(),
        };
        assert_eq!(to_storage(&events, ev.clone()), core());
        let pods = GroupResource {
            group: String::new(),
            resource: "pods".into(),
        };
        assert_eq!(to_storage(&pods, ev.clone()), ev);
    }

    #[test]
    fn selector_fields_map_to_core() {
        assert_eq!(
            core_field("regarding.name").as_deref(),
            Some("involvedObject.name")
        );
        assert_eq!(
            core_field("reportingController").as_deref(),
            Some("reportingComponent")
        );
        assert_eq!(core_field("reason"), None);
        assert_eq!(core_field("regardingX"), None);
    }
}
