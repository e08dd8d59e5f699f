//! QEMU's option syntax: `driver,key=value,...` on the command line and the same properties as
//! JSON objects for QMP (`blockdev-add`, `device_add`, `object-add`).
//!
//! Every device builds one [`Props`] list; both renderings come from it, so a hotplugged disk and
//! a cold-plugged one cannot drift apart.

use serde_json::{Map, Value as Json};

/// Escapes a value for QEMU's option parsers (QemuOpts and keyval): a comma ends a value unless
/// it is doubled, so every comma in a value is doubled. Nothing else is special inside a value.
pub fn escape(value: &str) -> String {
    value.replace(',', ",,")
}

/// One property value, typed because QMP's JSON input visitor is strict: `"bootindex": "1"` is
/// rejected where `1` is accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Str(String),
    Int(u64),
    Bool(bool),
}

impl Value {
    fn keyval(&self) -> String {
        match self {
            Value::Str(s) => escape(s),
            Value::Int(i) => i.to_string(),
            Value::Bool(b) => if *b { "on" } else { "off" }.to_owned(),
        }
    }

    fn json(&self) -> Json {
        match self {
            Value::Str(s) => Json::String(s.clone()),
            Value::Int(i) => Json::from(*i),
            Value::Bool(b) => Json::Bool(*b),
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_owned())
    }
}
impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}
impl From<&String> for Value {
    fn from(s: &String) -> Self {
        Value::Str(s.clone())
    }
}
impl From<u64> for Value {
    fn from(i: u64) -> Self {
        Value::Int(i)
    }
}
impl From<u32> for Value {
    fn from(i: u32) -> Self {
        Value::Int(u64::from(i))
    }
}
impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

/// An ordered property list. Keys are fixed strings chosen by this crate (dotted for nested
/// objects, as in `file.filename`); only values come from the VMI, and those are escaped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Props {
    pairs: Vec<(&'static str, Value)>,
}

impl Props {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `key=value`.
    #[must_use]
    pub fn set(mut self, key: &'static str, value: impl Into<Value>) -> Self {
        self.pairs.push((key, value.into()));
        self
    }

    /// Adds `key=value` when a value is present.
    #[must_use]
    pub fn set_opt<V: Into<Value>>(self, key: &'static str, value: Option<V>) -> Self {
        match value {
            Some(v) => self.set(key, v),
            None => self,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.pairs.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// `key=value,key=value` with every value escaped.
    pub fn keyval(&self) -> String {
        self.pairs
            .iter()
            .map(|(k, v)| format!("{k}={}", v.keyval()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `first,key=value,...` where `first` is the positional part (a driver or backend name).
    pub fn keyval_with(&self, first: &str) -> String {
        if self.pairs.is_empty() {
            escape(first)
        } else {
            format!("{},{}", escape(first), self.keyval())
        }
    }

    /// The same properties as a JSON object, dotted keys becoming nested objects.
    pub fn json(&self) -> Json {
        let mut root = Map::new();
        for (key, value) in &self.pairs {
            let mut parts: Vec<&str> = key.split('.').collect();
            let leaf = parts.pop().unwrap_or(key);
            let mut node = &mut root;
            for part in parts {
                let entry = node
                    .entry(part.to_owned())
                    .or_insert_with(|| Json::Object(Map::new()));
                if !entry.is_object() {
                    *entry = Json::Object(Map::new());
                }
                node = entry.as_object_mut().expect("just made an object");
            }
            node.insert(leaf.to_owned(), value.json());
        }
        Json::Object(root)
    }
}

/// Splits a rendered option string back into its parts, undoing the comma doubling: the inverse
/// of [`Props::keyval_with`], used by the tests to prove that nothing a value contains can inject
/// another property.
#[cfg(test)]
pub fn split_keyval(s: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                parts.last_mut().expect("never empty").push(',');
            } else {
                parts.push(String::new());
            }
        } else {
            parts.last_mut().expect("never empty").push(c);
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn commas_are_doubled() {
        let p = Props::new()
            .set("filename", "/a,b/c")
            .set("read-only", true);
        assert_eq!(p.keyval_with("file"), "file,filename=/a,,b/c,read-only=on");
    }

    #[test]
    fn dotted_keys_nest_in_json() {
        let p = Props::new()
            .set("driver", "qcow2")
            .set("file.driver", "file")
            .set("file.filename", "/x")
            .set("cache.direct", false);
        assert_eq!(
            p.json(),
            serde_json::json!({"driver": "qcow2", "file": {"driver": "file", "filename": "/x"},
                "cache": {"direct": false}})
        );
    }

    proptest! {
        #[test]
        fn escaping_round_trips(first in ".*", a in ".*", b in ".*") {
            let p = Props::new().set("a", a.as_str()).set("b", b.as_str());
            let parts = split_keyval(&p.keyval_with(&first));
            prop_assert_eq!(parts, vec![first, format!("a={a}"), format!("b={b}")]);
        }
    }
}
