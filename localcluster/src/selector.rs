//! Label and field selectors, as in `?labelSelector=` and `?fieldSelector=`.

use serde_json::Value;

/// A selector string that could not be parsed or names an unsupported field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectorError {
    #[error("unable to parse requirement {0:?}: {1}")]
    Parse(String, &'static str),
    #[error("field label not supported: {0}")]
    UnsupportedField(String),
}

#[derive(Debug, Clone, PartialEq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A parsed set-based label selector; every requirement must hold.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LabelSelector(Vec<Requirement>);

/// Splits at commas that are not inside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn parse_set(raw: &str, text: &str) -> Result<Vec<String>, SelectorError> {
    let inner = raw
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| SelectorError::Parse(text.into(), "expected a parenthesised set"))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for part in split_top_level(s) {
            let text = part.trim();
            let req = if let Some(key) = text.strip_prefix('!') {
                Requirement::DoesNotExist(key.trim().to_string())
            } else if let Some((k, v)) = text.split_once("!=") {
                Requirement::NotEquals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = text.split_once("==") {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = text.split_once('=') {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, set)) = text.split_once(" notin ") {
                Requirement::NotIn(k.trim().into(), parse_set(set, text)?)
            } else if let Some((k, set)) = text.split_once(" in ") {
                Requirement::In(k.trim().into(), parse_set(set, text)?)
            } else {
                Requirement::Exists(text.to_string())
            };
            let key = match &req {
                Requirement::Equals(k, _)
                | Requirement::NotEquals(k, _)
                | Requirement::In(k, _)
                | Requirement::NotIn(k, _)
                | Requirement::Exists(k)
                | Requirement::DoesNotExist(k) => k,
            };
            if !valid_key(key) {
                return Err(SelectorError::Parse(text.into(), "invalid label key"));
            }
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, set) => get(k).is_some_and(|l| set.iter().any(|s| s == l)),
            Requirement::NotIn(k, set) => get(k).is_none_or(|l| !set.iter().any(|s| s == l)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::DoesNotExist(k) => get(k).is_none(),
        })
    }
}

/// Whether labels satisfy a structured `LabelSelector` (`matchLabels`, `matchExpressions`), as
/// webhook `namespaceSelector` / `objectSelector` give them. An empty selector matches everything.
pub fn selector_matches(selector: &Value, labels: &Value) -> bool {
    let get = |k: &str| labels.get(k).and_then(Value::as_str);
    let labels_ok = selector["matchLabels"]
        .as_object()
        .is_none_or(|m| m.iter().all(|(k, v)| get(k) == v.as_str()));
    let exprs_ok = selector["matchExpressions"].as_array().is_none_or(|exprs| {
        exprs.iter().all(|e| {
            let key = e["key"].as_str().unwrap_or_default();
            let values: Vec<&str> = e["values"]
                .as_array()
                .map(|v| v.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            match e["operator"].as_str() {
                Some("In") => get(key).is_some_and(|l| values.contains(&l)),
                Some("NotIn") => get(key).is_none_or(|l| !values.contains(&l)),
                Some("Exists") => get(key).is_some(),
                Some("DoesNotExist") => get(key).is_none(),
                _ => false,
            }
        })
    });
    labels_ok && exprs_ok
}

/// A parsed field selector (`=`, `==` and `!=` on supported fields).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FieldSelector(Vec<(String, bool, String)>);

/// The fields a resource can be selected by, beyond `metadata.name` and `metadata.namespace`.
fn extra_fields(group: &str, plural: &str) -> &'static [&'static str] {
    match (group, plural) {
        ("", "pods") => &[
            "spec.nodeName",
            "status.phase",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "status.podIP",
        ],
        ("", "events") => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ],
        ("events.k8s.io", "events") => &[
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "regarding.apiVersion",
            "regarding.resourceVersion",
            "regarding.fieldPath",
            "reason",
            "reportingController",
            "type",
        ],
        ("", "secrets") => &["type"],
        ("", "namespaces") => &["status.phase"],
        ("", "nodes") => &["spec.unschedulable"],
        _ => &[],
    }
}

impl FieldSelector {
    pub fn parse(s: &str, group: &str, plural: &str) -> Result<Self, SelectorError> {
        let mut terms = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(terms));
        }
        for part in s.split(',') {
            let text = part.trim();
            let (field, equal, value) = if let Some((f, v)) = text.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = text.split_once("==") {
                (f, true, v)
            } else if let Some((f, v)) = text.split_once('=') {
                (f, true, v)
            } else {
                return Err(SelectorError::Parse(text.into(), "expected an operator"));
            };
            let field = field.trim();
            if !matches!(field, "metadata.name" | "metadata.namespace")
                && !extra_fields(group, plural).contains(&field)
            {
                return Err(SelectorError::UnsupportedField(field.into()));
            }
            // Terms are matched against the stored object, which for events is the core form.
            let stored = match (group, plural) {
                ("events.k8s.io", "events") => crate::events::core_field(field),
                _ => None,
            }
            .unwrap_or_else(|| field.to_string());
            terms.push((stored, equal, value.trim().to_string()));
        }
        Ok(Self(terms))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The name this selector pins, when it says `metadata.name=<name>`.
    pub fn name(&self) -> Option<&str> {
        self.0
            .iter()
            .find(|(f, eq, _)| *eq && f == "metadata.name")
            .map(|(_, _, v)| v.as_str())
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let mut cur = obj;
            for seg in field.split('.') {
                cur = &cur[seg];
            }
            let actual = match cur {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                Value::Bool(b) => b.to_string(),
                other => other.to_string(),
            };
            (actual == *value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: &Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}, "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}})
    }

    #[test]
    fn set_based_label_selectors() {
        let o = obj(&json!({"app": "web", "tier": "front"}));
        for (sel, want) in [
            ("app=web", true),
            ("app==web", true),
            ("app!=web", false),
            ("app in (web, db)", true),
            ("app notin (web)", false),
            ("missing notin (x)", true),
            ("tier", true),
            ("!tier", false),
            ("!missing,app=web", true),
            ("app in (db),tier", false),
            ("", true),
        ] {
            assert_eq!(
                LabelSelector::parse(sel).unwrap().matches(&o),
                want,
                "{sel}"
            );
        }
        assert!(LabelSelector::parse("a in b").is_err());
        assert!(LabelSelector::parse("a b").is_err());
    }

    #[test]
    fn structured_selectors() {
        let labels = json!({"env": "prod", "team": "a"});
        assert!(selector_matches(&json!({}), &labels));
        assert!(selector_matches(
            &json!({"matchLabels": {"env": "prod"}}),
            &labels
        ));
        assert!(!selector_matches(
            &json!({"matchLabels": {"env": "dev"}}),
            &labels
        ));
        let exprs = json!({"matchExpressions": [
            {"key": "team", "operator": "In", "values": ["a", "b"]},
            {"key": "skip", "operator": "DoesNotExist"}]});
        assert!(selector_matches(&exprs, &labels));
        assert!(!selector_matches(&exprs, &json!({"team": "c"})));
        assert!(!selector_matches(
            &json!({"matchExpressions": [{"key": "x", "operator": "Bogus"}]}),
            &labels
        ));
    }

    #[test]
    fn field_selectors() {
        let o = obj(&json!({}));
        let sel = FieldSelector::parse("metadata.name=a,spec.nodeName!=n2", "", "pods").unwrap();
        assert!(sel.matches(&o));
        assert_eq!(sel.name(), Some("a"));
        assert!(
            !FieldSelector::parse("status.phase=Pending", "", "pods")
                .unwrap()
                .matches(&o)
        );
        assert!(
            FieldSelector::parse("spec.nodeName=", "", "pods")
                .unwrap()
                .matches(&json!({}))
        );
        assert_eq!(
            FieldSelector::parse("spec.nodeName=x", "", "configmaps"),
            Err(SelectorError::UnsupportedField("spec.nodeName".into()))
        );
    }
}
