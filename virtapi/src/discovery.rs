//! The discovery documents kube-apiserver's aggregator and kubectl read from virt-api: the group
//! and, per version, the list of subresources (KubeVirt's `getAPISubResources`), and the
//! version endpoint virtctl prints.

use api::subresources::{GROUP, VERSIONS, VmSubresource, VmiSubresource};
use serde_json::{Value, json};

/// `GET /apis` and `GET /apis/subresources.kubevirt.io`: the group with its versions.
pub fn api_group() -> Value {
    let versions: Vec<Value> = VERSIONS
        .iter()
        .map(|v| json!({"groupVersion": format!("{GROUP}/{v}"), "version": v}))
        .collect();
    json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": GROUP,
        "versions": versions,
        "preferredVersion": versions[0],
    })
}

pub fn api_group_list() -> Value {
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group()]})
}

/// `GET /apis/subresources.kubevirt.io/{version}`: every subresource served, namespaced, with
/// no verbs (as KubeVirt's: they are reached by path, not listed).
pub fn api_resource_list(version: &str) -> Value {
    let resources: Vec<Value> = VmiSubresource::ALL
        .iter()
        .map(|s| format!("virtualmachineinstances/{}", s.as_str()))
        .chain(
            VmSubresource::ALL
                .iter()
                .map(|s| format!("virtualmachines/{}", s.as_str())),
        )
        .map(|name| {
            json!({"name": name, "singularName": "", "namespaced": true, "kind": "", "verbs": []})
        })
        .collect();
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": format!("{GROUP}/{version}"),
        "resources": resources,
    })
}

/// `GET /apis/subresources.kubevirt.io/{version}/version`: KubeVirt's `version.Info`.
pub fn version_info() -> Value {
    json!({
        "gitVersion": concat!("v", env!("CARGO_PKG_VERSION")),
        "gitCommit": option_env!("KUBEVIRT_RS_GIT_COMMIT").unwrap_or(""),
        "gitTreeState": "",
        "buildDate": "",
        "goVersion": "",
        "compiler": "rustc",
        "platform": format!("{}/{}", std::env::consts::OS, go_arch()),
    })
}

fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resource_list_names_every_subresource_once() {
        let l = api_resource_list("v1");
        let names: Vec<&str> = l["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert!(names.contains(&"virtualmachineinstances/console"));
        assert!(names.contains(&"virtualmachineinstances/vnc/screenshot"));
        assert!(names.contains(&"virtualmachines/restart"));
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
        assert_eq!(l["groupVersion"], "subresources.kubevirt.io/v1");
        assert_eq!(api_group()["preferredVersion"]["version"], "v1");
    }
}
