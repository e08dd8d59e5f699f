//! kube-apiserver's audit log (localcluster writes one event per write request) read as the
//! API-economy benchmark needs it: who wrote what, counted by component, verb and resource.

use std::collections::BTreeMap;

/// One counted write: the component that made it, the verb, and `resource[/subresource]`.
pub type WriteKey = (String, String, String);

/// The component behind an authenticated user name, as kubevirt-rs and the control plane run.
pub fn component(username: &str) -> String {
    let name = match username {
        "system:serviceaccount:kubevirt:kubevirt-controller" => "virt-controller",
        "system:serviceaccount:kubevirt:kubevirt-handler" => "virt-handler",
        "system:serviceaccount:kubevirt:kubevirt-apiserver" => "virt-api",
        "system:serviceaccount:kubevirt:kubevirt-operator" => "virt-operator",
        "system:kube-scheduler" => "kube-scheduler",
        "kubernetes-admin" => "kubectl (the test)",
        u if u.starts_with("system:node:") => "kubelet",
        u if u.starts_with("system:serviceaccount:kube-system:")
            || u == "system:kube-controller-manager" =>
        {
            "kube-controller-manager"
        }
        other => other,
    };
    name.to_owned()
}

/// The writes in `log` (JSON lines, as `--audit-log-format=json` writes them) that completed,
/// counted per [`WriteKey`]; lines that are not complete write events are skipped.
pub fn count_writes(log: &str) -> BTreeMap<WriteKey, usize> {
    let mut out = BTreeMap::new();
    for line in log.lines() {
        let Ok(ev) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if ev["stage"] != "ResponseComplete" {
            continue;
        }
        let verb = ev["verb"].as_str().unwrap_or_default();
        if !matches!(
            verb,
            "create" | "update" | "patch" | "delete" | "deletecollection"
        ) {
            continue;
        }
        let object = &ev["objectRef"];
        let mut resource = object["resource"].as_str().unwrap_or_default().to_owned();
        if let Some(sub) = object["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        let who = component(ev["user"]["username"].as_str().unwrap_or_default());
        *out.entry((who, verb.to_owned(), resource)).or_default() += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_counted_by_component_verb_and_resource() {
        let log = [
            r#"{"stage":"ResponseComplete","verb":"patch","user":{"username":"system:serviceaccount:kubevirt:kubevirt-handler"},"objectRef":{"resource":"virtualmachineinstances","subresource":"status"}}"#,
            r#"{"stage":"ResponseComplete","verb":"patch","user":{"username":"system:serviceaccount:kubevirt:kubevirt-handler"},"objectRef":{"resource":"virtualmachineinstances","subresource":"status"}}"#,
            r#"{"stage":"ResponseComplete","verb":"create","user":{"username":"system:node:node-1"},"objectRef":{"resource":"events"}}"#,
            r#"{"stage":"ResponseStarted","verb":"create","user":{"username":"system:node:node-1"},"objectRef":{"resource":"pods"}}"#,
            r#"{"stage":"ResponseComplete","verb":"get","user":{"username":"x"},"objectRef":{"resource":"pods"}}"#,
            "not json",
        ]
        .join("\n");
        let counts = count_writes(&log);
        assert_eq!(
            counts,
            BTreeMap::from([
                (
                    (
                        "kubelet".to_owned(),
                        "create".to_owned(),
                        "events".to_owned()
                    ),
                    1
                ),
                (
                    (
                        "virt-handler".to_owned(),
                        "patch".to_owned(),
                        "virtualmachineinstances/status".to_owned()
                    ),
                    2
                ),
            ])
        );
    }
}
