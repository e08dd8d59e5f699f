//! The QMP / guest-agent wire format as pure functions: one JSON object per line.
//!
//! Lines are decoded as raw JSON first and classified here, so that an unknown event, an unknown
//! field or a garbage line costs one log line instead of the connection (the `qapi` crate's own
//! stream decodes every line against its schema and dies on the first mismatch).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::event::{Event, Timestamp};

/// An error object from the peer: `{"error": {"class": ..., "desc": ...}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    pub class: String,
    pub desc: String,
}

/// One classified line read from the peer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Incoming {
    /// `{"QMP": {...}}`
    Greeting(Value),
    /// `{"return": ...}` or `{"error": ...}`, with the id we sent if it carried one.
    Reply {
        id: Option<Value>,
        result: Result<Value, Failure>,
    },
    /// `{"event": ..., "data": ..., "timestamp": ...}`
    Event(Event),
}

/// Why a line was not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ParseError {
    #[error("not JSON: {0}")]
    Json(String),
    #[error("not a JSON object")]
    NotObject,
    #[error("an object that is neither a greeting, a reply nor an event")]
    Unknown,
}

/// Classify one line (without or with its trailing newline).
pub(crate) fn parse_line(line: &[u8]) -> Result<Incoming, ParseError> {
    let value: Value = serde_json::from_slice(line).map_err(|e| ParseError::Json(e.to_string()))?;
    let Value::Object(mut obj) = value else {
        return Err(ParseError::NotObject);
    };
    if let Some(greeting) = obj.remove("QMP") {
        return Ok(Incoming::Greeting(greeting));
    }
    if let Some(ret) = obj.remove("return") {
        return Ok(Incoming::Reply {
            id: obj.remove("id"),
            result: Ok(ret),
        });
    }
    if let Some(err) = obj.remove("error") {
        return Ok(Incoming::Reply {
            id: obj.remove("id"),
            result: Err(failure(&err)),
        });
    }
    if let Some(Value::String(name)) = obj.remove("event") {
        let data = obj.remove("data").unwrap_or(Value::Object(Map::new()));
        let timestamp = obj
            .remove("timestamp")
            .and_then(|t| serde_json::from_value::<Timestamp>(t).ok())
            .unwrap_or_default();
        return Ok(Incoming::Event(Event {
            name,
            data,
            timestamp,
        }));
    }
    Err(ParseError::Unknown)
}

/// Decode an error object leniently: QEMU's error classes grow over versions, and a reply we
/// cannot classify is still a failure the caller must see.
fn failure(err: &Value) -> Failure {
    let class = err
        .get("class")
        .and_then(Value::as_str)
        .unwrap_or("GenericError")
        .to_owned();
    let desc = err.get("desc").and_then(Value::as_str).map_or_else(
        || format!("error without description: {err}"),
        str::to_owned,
    );
    Failure { class, desc }
}

#[derive(Serialize)]
#[allow(clippy::struct_field_names)] // the wire's names
struct Execute<'a> {
    execute: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
}

/// Normalise a command's serialized arguments: QMP wants an object or nothing.
pub(crate) fn arguments(value: Value) -> Result<Option<Value>, serde_json::Error> {
    match value {
        Value::Null => Ok(None),
        Value::Object(map) if map.is_empty() => Ok(None),
        Value::Object(map) => Ok(Some(Value::Object(map))),
        other => Err(serde::de::Error::custom(format!(
            "command arguments must be a JSON object, got {other}"
        ))),
    }
}

/// One `execute` line, newline-terminated.
pub(crate) fn encode_execute(name: &str, arguments: Option<&Value>, id: Option<u64>) -> Vec<u8> {
    let mut line = serde_json::to_vec(&Execute {
        execute: name,
        arguments,
        id,
    })
    .expect("a map of JSON values always serializes");
    line.push(b'\n');
    line
}

/// The greeting's payload: `{"version": {...}, "capabilities": [...]}`.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct GreetingWire {
    pub version: VersionWire,
    #[serde(default)]
    pub capabilities: Vec<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct VersionWire {
    pub qemu: TripleWire,
    #[serde(default)]
    pub package: String,
}

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct TripleWire {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
}

/// Shorten a reply for an error message.
pub(crate) fn truncate_for_display(value: &str, max: usize) -> String {
    if value.len() <= max {
        return value.to_owned();
    }
    let mut cut = max;
    while !value.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}... ({} bytes)", &value[..cut], value.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn classifies_replies_events_and_greeting() {
        assert_eq!(
            parse_line(br#"{"return": {}, "id": 7}"#),
            Ok(Incoming::Reply {
                id: Some(json!(7)),
                result: Ok(json!({}))
            })
        );
        assert_eq!(
            parse_line(br#"{"error": {"class": "CommandNotFound", "desc": "nope"}, "id": 3}"#),
            Ok(Incoming::Reply {
                id: Some(json!(3)),
                result: Err(Failure {
                    class: "CommandNotFound".into(),
                    desc: "nope".into()
                })
            })
        );
        let Ok(Incoming::Event(ev)) =
            parse_line(br#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "STOP"}"#)
        else {
            panic!("not an event");
        };
        assert_eq!(ev.name, "STOP");
        assert_eq!(ev.data, json!({}));
        assert_eq!(
            ev.timestamp,
            Timestamp {
                seconds: 1,
                microseconds: 2
            }
        );
        assert!(matches!(
            parse_line(br#"{"QMP": {"version": {}}}"#),
            Ok(Incoming::Greeting(_))
        ));
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        assert!(matches!(parse_line(b"garbage\n"), Err(ParseError::Json(_))));
        assert_eq!(parse_line(b"[1,2]"), Err(ParseError::NotObject));
        assert_eq!(parse_line(br#"{"x": 1}"#), Err(ParseError::Unknown));
        assert!(parse_line(b"").is_err());
        assert!(parse_line(&[0xff, b'{']).is_err());
    }

    #[test]
    fn error_without_class_or_desc_is_still_a_failure() {
        let Ok(Incoming::Reply { result, .. }) = parse_line(br#"{"error": {}}"#) else {
            panic!("not a reply");
        };
        let failure = result.unwrap_err();
        assert_eq!(failure.class, "GenericError");
        assert!(failure.desc.contains("without description"));
    }

    #[test]
    fn encodes_execute_lines() {
        assert_eq!(
            encode_execute("query-status", None, Some(5)),
            b"{\"execute\":\"query-status\",\"id\":5}\n".to_vec()
        );
        let args = json!({"fdname": "tap0"});
        assert_eq!(
            encode_execute("getfd", Some(&args), None),
            b"{\"execute\":\"getfd\",\"arguments\":{\"fdname\":\"tap0\"}}\n".to_vec()
        );
    }

    #[test]
    fn arguments_must_be_objects() {
        assert_eq!(arguments(json!({})).unwrap(), None);
        assert_eq!(arguments(Value::Null).unwrap(), None);
        assert_eq!(arguments(json!({"a": 1})).unwrap(), Some(json!({"a": 1})));
        assert!(arguments(json!([1])).is_err());
    }

    proptest::proptest! {
        #[test]
        fn parse_line_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = parse_line(&bytes);
        }

        #[test]
        fn any_json_object_with_a_numeric_id_routes_back(id in 0u64..u64::MAX, desc in ".*") {
            let line = serde_json::to_vec(&json!({"error": {"class": "GenericError", "desc": desc}, "id": id})).unwrap();
            let Ok(Incoming::Reply { id: Some(got), result: Err(failure) }) = parse_line(&line) else {
                panic!("not a reply");
            };
            proptest::prop_assert_eq!(got.as_u64(), Some(id));
            proptest::prop_assert_eq!(failure.desc, desc);
        }

        #[test]
        fn truncation_never_panics(s in ".*", max in 0usize..64) {
            let _ = truncate_for_display(&s, max);
        }
    }

    #[test]
    fn truncates_on_char_boundaries() {
        assert_eq!(truncate_for_display("abc", 10), "abc");
        let s = "é".repeat(10);
        let t = truncate_for_display(&s, 3);
        assert!(t.starts_with('é'));
        assert!(t.ends_with("(20 bytes)"));
    }
}
