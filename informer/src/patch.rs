//! JSON patches whose `test` operations hold against what kube-apiserver stores.
//!
//! kube-apiserver applies a JSON patch with evanphx/json-patch, whose `test` compares a string
//! by its encoded bytes, not its value, against the stored object as Go encodes it: with `<`,
//! `>` and `&` escaped as `\u003c`, `\u003e` and `\u0026`, and U+2028 / U+2029 as
//! `\u2028` / `\u2029` (`encoding/json`'s HTML-safe output). serde_json writes those
//! characters as they are, so a `test` of a value holding any of them (a cloud-init script's
//! `&` is enough) never matches. The patch sent here is encoded the way Go encodes.

use kube::api::{Api, Patch, PatchParams};

/// `json`, a serialized JSON document, with the characters Go's `encoding/json` escapes
/// escaped the same way. Outside strings JSON has none of them, so the text can be rewritten
/// as it is.
pub fn go_escaped(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

/// `api.patch(name, params, Patch::Json(patch))`, with the body encoded as Go encodes (see
/// the module doc), so its `test` operations compare as KubeVirt's own patches do.
pub async fn json_patch<K>(
    api: &Api<K>,
    name: &str,
    params: &PatchParams,
    patch: json_patch::Patch,
) -> Result<K, kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let request = kube::core::Request::new(api.resource_url())
        .patch(name, params, &Patch::<()>::Json(patch))
        .map_err(kube::Error::BuildRequest)?;
    let (parts, body) = request.into_parts();
    let body = go_escaped(&String::from_utf8_lossy(&body)).into_bytes();
    api.clone()
        .into_client()
        .request(http::Request::from_parts(parts, body))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_characters_are_escaped_as_go_escapes_them() {
        let json = serde_json::json!({"userData": "a && b <x> \u{2028}", "n": 1}).to_string();
        let escaped = go_escaped(&json);
        assert_eq!(
            escaped,
            r#"{"n":1,"userData":"a \u0026\u0026 b \u003cx\u003e \u2028"}"#
        );
        // The same value, as any JSON reader sees it.
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&escaped).unwrap(),
            serde_json::from_str::<serde_json::Value>(&json).unwrap()
        );
    }
}
