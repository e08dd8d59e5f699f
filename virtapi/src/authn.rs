//! Who is asking, and for what: the aggregation layer's request headers turned into a user, and
//! a request path turned into the `ResourceAttributes` of a SubjectAccessReview, as KubeVirt's
//! `pkg/virt-api/rest/authorizer.go` does.
//!
//! kube-apiserver authenticates the user, then proxies the request to virt-api over TLS with its
//! front-proxy client certificate and the user in `X-Remote-User`, `X-Remote-Group` and
//! `X-Remote-Extra-*`. Those headers are believed only on a connection whose client certificate
//! chains to the request-header CA (checked by TLS) and, when kube-apiserver names any
//! (`requestheader-allowed-names`), carries one of those common names. KubeVirt checks the chain
//! only; the allowed names are Kubernetes' own rule for request-header authentication.

use std::collections::BTreeMap;

use api::subresources::{GROUP, VERSIONS, VmSubresource, VmiSubresource};
use http::{HeaderMap, Method};

/// The request-header settings kube-apiserver publishes in
/// `kube-system/extension-apiserver-authentication`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHeaderConfig {
    pub username_headers: Vec<String>,
    pub group_headers: Vec<String>,
    pub extra_header_prefixes: Vec<String>,
    /// Common names a front proxy's certificate may carry; empty means any.
    pub allowed_names: Vec<String>,
}

impl Default for RequestHeaderConfig {
    fn default() -> Self {
        RequestHeaderConfig {
            username_headers: vec!["X-Remote-User".into()],
            group_headers: vec!["X-Remote-Group".into()],
            extra_header_prefixes: vec!["X-Remote-Extra-".into()],
            allowed_names: Vec::new(),
        }
    }
}

impl RequestHeaderConfig {
    /// From the ConfigMap's data: each setting is a JSON list of strings; a missing one keeps
    /// Kubernetes' default header names.
    pub fn from_configmap(data: &BTreeMap<String, String>) -> Result<Self, String> {
        let list = |key: &str| -> Result<Option<Vec<String>>, String> {
            data.get(key)
                .map(|v| {
                    serde_json::from_str(v)
                        .map_err(|e| format!("{key} in extension-apiserver-authentication: {e}"))
                })
                .transpose()
        };
        let d = RequestHeaderConfig::default();
        Ok(RequestHeaderConfig {
            username_headers: list("requestheader-username-headers")?.unwrap_or(d.username_headers),
            group_headers: list("requestheader-group-headers")?.unwrap_or(d.group_headers),
            extra_header_prefixes: list("requestheader-extra-headers-prefix")?
                .unwrap_or(d.extra_header_prefixes),
            allowed_names: list("requestheader-allowed-names")?.unwrap_or_default(),
        })
    }
}

/// The user kube-apiserver authenticated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

/// Why a request is not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// 401: not from the aggregation layer.
    #[error("{0}")]
    Unauthenticated(String),
    /// 404-ish requests KubeVirt answers with an error naming the path.
    #[error("{0}")]
    Unknown(String),
}

/// The client certificate the connection presented, as TLS verified it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peer {
    /// Whether a certificate chaining to the request-header CA was presented.
    pub verified: bool,
    pub common_name: Option<String>,
}

/// The user behind a proxied request.
pub fn user(cfg: &RequestHeaderConfig, peer: &Peer, headers: &HeaderMap) -> Result<User, Denied> {
    if !peer.verified {
        return Err(Denied::Unauthenticated(
            "request is not authenticated".into(),
        ));
    }
    if !cfg.allowed_names.is_empty()
        && !peer
            .common_name
            .as_ref()
            .is_some_and(|cn| cfg.allowed_names.contains(cn))
    {
        return Err(Denied::Unauthenticated(format!(
            "client certificate {:?} is not one of the allowed front proxies {:?}",
            peer.common_name.as_deref().unwrap_or(""),
            cfg.allowed_names
        )));
    }
    let values = |name: &str| -> Vec<String> {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::to_owned)
            .collect()
    };
    let name = cfg
        .username_headers
        .iter()
        .find_map(|h| values(h).into_iter().next())
        .ok_or_else(|| {
            Denied::Unauthenticated("a valid user header is required for authorization".into())
        })?;
    let groups = cfg
        .group_headers
        .iter()
        .map(|h| values(h))
        .find(|g| !g.is_empty())
        .ok_or_else(|| {
            Denied::Unauthenticated("a valid group header is required for authorization".into())
        })?;
    let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for prefix in &cfg.extra_header_prefixes {
        let prefix = prefix.to_ascii_lowercase();
        for (k, v) in headers {
            // HeaderMap keys are lower case already.
            if let Some(key) = k.as_str().strip_prefix(&prefix)
                && let Ok(v) = v.to_str()
            {
                extra
                    .entry(percent_decode(key))
                    .or_default()
                    .push(v.to_owned());
            }
        }
    }
    Ok(User {
        name,
        groups,
        extra,
    })
}

/// `%XX` escapes in extra keys, as kube-apiserver encodes them; a malformed escape is kept as is.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

/// What a request asks to do, in RBAC's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceAttributes {
    pub namespace: String,
    pub verb: String,
    pub group: String,
    pub version: String,
    pub resource: String,
    pub subresource: String,
    pub name: String,
}

/// A subresource request, parsed from its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Vmi {
        namespace: String,
        name: String,
        sub: VmiSubresource,
        /// `portforward/{port}[/{protocol}]`'s rest.
        rest: Vec<String>,
    },
    Vm {
        namespace: String,
        name: String,
        sub: VmSubresource,
        rest: Vec<String>,
    },
}

/// Parses `/apis/subresources.kubevirt.io/{version}/namespaces/{ns}/{resource}/{name}/{sub...}`
/// into its target and the attributes to authorize it with.
pub fn parse(method: &Method, path: &str) -> Result<(Target, ResourceAttributes), Denied> {
    let unknown = || Denied::Unknown(format!("unknown api endpoint: {path}"));
    let parts: Vec<&str> = path.split('/').collect();
    // ["", "apis", group, version, "namespaces", ns, resource, name, sub...]
    if parts.len() < 9
        || !parts[0].is_empty()
        || parts[1] != "apis"
        || parts[2] != GROUP
        || !VERSIONS.contains(&parts[3])
        || parts[4] != "namespaces"
        || parts[5].is_empty()
        || parts[7].is_empty()
    {
        return Err(unknown());
    }
    let (namespace, resource, name) = (parts[5].to_owned(), parts[6], parts[7].to_owned());
    let tail = &parts[8..];
    // RBAC names port-forward `portforward` whatever port follows; others by their full path.
    let (sub_name, rest): (String, Vec<String>) = if tail[0] == "portforward" {
        (
            "portforward".into(),
            tail[1..].iter().map(|s| (*s).to_owned()).collect(),
        )
    } else {
        (tail.join("/"), Vec::new())
    };
    let target = match resource {
        "virtualmachineinstances" => Target::Vmi {
            namespace: namespace.clone(),
            name: name.clone(),
            sub: VmiSubresource::parse(&sub_name).ok_or_else(unknown)?,
            rest,
        },
        "virtualmachines" => Target::Vm {
            namespace: namespace.clone(),
            name: name.clone(),
            sub: VmSubresource::parse(&sub_name).ok_or_else(unknown)?,
            rest,
        },
        other => return Err(Denied::Unknown(format!("unknown resource type {other}"))),
    };
    let verb = match *method {
        Method::POST => "create",
        Method::GET | Method::HEAD => "get",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        ref m => {
            return Err(Denied::Unknown(format!(
                "unknown http verb in request: {m}"
            )));
        }
    };
    let attrs = ResourceAttributes {
        namespace,
        verb: verb.into(),
        group: GROUP.into(),
        version: parts[3].into(),
        resource: resource.into(),
        subresource: sub_name,
        name,
    };
    Ok((target, attrs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn front_proxy() -> Peer {
        Peer {
            verified: true,
            common_name: Some("front-proxy-client".into()),
        }
    }

    #[test]
    fn the_user_comes_from_the_front_proxys_headers() {
        let cfg = RequestHeaderConfig {
            allowed_names: vec!["front-proxy-client".into()],
            ..Default::default()
        };
        let h = headers(&[
            ("X-Remote-User", "alice"),
            ("X-Remote-Group", "devs"),
            ("X-Remote-Group", "system:authenticated"),
            ("X-Remote-Extra-Scopes", "a"),
            ("X-Remote-Extra-Foo%2fbar", "b"),
        ]);
        let u = user(&cfg, &front_proxy(), &h).unwrap();
        assert_eq!(u.name, "alice");
        assert_eq!(u.groups, vec!["devs", "system:authenticated"]);
        assert_eq!(u.extra["scopes"], vec!["a"]);
        assert_eq!(u.extra["foo/bar"], vec!["b"]);
    }

    #[test]
    fn headers_are_not_believed_without_the_front_proxys_certificate() {
        let cfg = RequestHeaderConfig {
            allowed_names: vec!["front-proxy-client".into()],
            ..Default::default()
        };
        let h = headers(&[
            ("X-Remote-User", "admin"),
            ("X-Remote-Group", "system:masters"),
        ]);
        let anonymous = Peer::default();
        assert!(matches!(
            user(&cfg, &anonymous, &h),
            Err(Denied::Unauthenticated(_))
        ));
        let other = Peer {
            verified: true,
            common_name: Some("someone-else".into()),
        };
        let e = user(&cfg, &other, &h).unwrap_err().to_string();
        assert!(e.contains("someone-else"), "{e}");
        let no_group = headers(&[("X-Remote-User", "admin")]);
        assert!(user(&cfg, &front_proxy(), &no_group).is_err());
    }

    #[test]
    fn configmap_lists_are_json() {
        let data = BTreeMap::from([
            (
                "requestheader-allowed-names".to_owned(),
                r#"["front-proxy-client"]"#.to_owned(),
            ),
            (
                "requestheader-username-headers".to_owned(),
                r#"["X-Remote-User"]"#.to_owned(),
            ),
        ]);
        let c = RequestHeaderConfig::from_configmap(&data).unwrap();
        assert_eq!(c.allowed_names, vec!["front-proxy-client"]);
        assert_eq!(c.group_headers, vec!["X-Remote-Group"]);
        let bad = BTreeMap::from([(
            "requestheader-group-headers".to_owned(),
            "X-Remote-Group".to_owned(),
        )]);
        let e = RequestHeaderConfig::from_configmap(&bad).unwrap_err();
        assert!(e.contains("requestheader-group-headers"), "{e}");
    }

    #[test]
    fn paths_become_kubevirts_access_reviews() {
        let (t, a) = parse(
            &Method::GET,
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm1/vnc/screenshot",
        )
        .unwrap();
        assert_eq!(
            t,
            Target::Vmi {
                namespace: "ns".into(),
                name: "vm1".into(),
                sub: VmiSubresource::VncScreenshot,
                rest: vec![]
            }
        );
        assert_eq!(
            (a.verb.as_str(), a.resource.as_str(), a.subresource.as_str()),
            ("get", "virtualmachineinstances", "vnc/screenshot")
        );
        let (t, a) = parse(
            &Method::PUT,
            "/apis/subresources.kubevirt.io/v1alpha3/namespaces/ns/virtualmachines/vm1/stop",
        )
        .unwrap();
        assert!(matches!(
            t,
            Target::Vm {
                sub: VmSubresource::Stop,
                ..
            }
        ));
        assert_eq!(
            (a.verb.as_str(), a.version.as_str()),
            ("update", "v1alpha3")
        );
        let (t, a) = parse(
            &Method::GET,
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm1/portforward/22/tcp",
        )
        .unwrap();
        assert_eq!(a.subresource, "portforward");
        assert!(matches!(t, Target::Vmi { rest, .. } if rest == ["22", "tcp"]));
    }

    #[test]
    fn unknown_paths_are_named() {
        for p in [
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/pods/p/console",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/v/nope",
            "/apis/subresources.kubevirt.io/v2/namespaces/ns/virtualmachineinstances/v/console",
            "/apis/other.io/v1/namespaces/ns/virtualmachineinstances/v/console",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances",
        ] {
            assert!(parse(&Method::GET, p).is_err(), "{p}");
        }
    }
}
