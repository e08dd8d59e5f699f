//! The two files users install kubevirt-rs with, as KubeVirt ships them:
//! `kubevirt-operator.yaml` (the namespace, the `kubevirts.kubevirt.io` CRD, virt-operator's
//! RBAC and its Deployment) and `kubevirt-cr.yaml` (the KubeVirt CR that makes the operator
//! install everything else). `hack/release.sh` writes them pinned by digest;
//! `manifests/release/` holds them for the images a development build tags `latest`.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::strategy::{COMPONENTS, Release};

const NAMESPACE: &str = include_str!("../../manifests/install/00-namespace.yaml");

/// The operator's service account, ClusterRole and ClusterRoleBinding, and its Deployment.
pub const OPERATOR: &str = "virt-operator";
const OPERATOR_ACCOUNT: &str = "kubevirt-operator";

/// The environment that tells virt-operator its release: `OPERATOR_IMAGE` (its registry and
/// tag are the CR's defaults), `KUBEVIRT_VERSION`, and KubeVirt's `VIRT_<COMPONENT>_SHASUM`
/// for each component image's digest.
pub const OPERATOR_IMAGE_ENV: &str = "OPERATOR_IMAGE";
pub const VERSION_ENV: &str = "KUBEVIRT_VERSION";

/// `VIRT_API_SHASUM` for `virt-api`, ...
pub fn digest_env(component: &str) -> String {
    format!("{}_SHASUM", component.to_uppercase().replace('-', "_"))
}

/// The release a running operator belongs to, from its environment (`env` reads a variable).
/// An error names what is missing or wrong.
pub fn release_from_env(env: impl Fn(&str) -> Option<String>) -> Result<Release, String> {
    let image = env(OPERATOR_IMAGE_ENV).ok_or_else(|| {
        format!("{OPERATOR_IMAGE_ENV} is not set: virt-operator's image reference gives the CR's default registry and tag")
    })?;
    ociimage::Reference::parse(&image)
        .map_err(|e| format!("{OPERATOR_IMAGE_ENV}={image:?}: {e}"))?;
    // As written, not normalised: `kubevirt-rs/virt-operator:v1` gives registry
    // `kubevirt-rs`, which the CR's status then shows as the user wrote it.
    let name = image.split('@').next().unwrap_or_default();
    let (repository, tag) = match name.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => (r, Some(t)),
        _ => (name, None),
    };
    let registry = repository
        .rsplit_once('/')
        .map_or(String::new(), |(r, _)| r.to_owned());
    let tag = env(VERSION_ENV)
        .or_else(|| tag.map(str::to_owned))
        .unwrap_or_else(|| "latest".into());
    let digests = COMPONENTS
        .iter()
        .filter_map(|c| Some(((*c).to_owned(), env(&digest_env(c))?)))
        .collect();
    Ok(Release {
        registry,
        tag,
        digests,
    })
}

fn kubevirt_crd() -> Value {
    api::crds::crds()
        .into_iter()
        .find(|crd| crd.metadata.name.as_deref() == Some("kubevirts.kubevirt.io"))
        .map(|crd| serde_json::to_value(crd).unwrap_or_default())
        .expect("the api crate defines the KubeVirt CRD")
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> Value {
    json!({"apiGroups": groups, "resources": resources, "verbs": verbs})
}

/// What virt-operator may do: everything on the kinds it installs (with `escalate` and
/// `bind`, so it can grant the components' permissions without holding them), its CR, its
/// Lease and Events, and reading the workloads `BlockUninstallIfWorkloadsExist` looks for.
fn operator_rules() -> Value {
    json!([
        rule(
            &["apiextensions.k8s.io"],
            &["customresourcedefinitions"],
            &["*"]
        ),
        rule(
            &["rbac.authorization.k8s.io"],
            &[
                "clusterroles",
                "clusterrolebindings",
                "roles",
                "rolebindings"
            ],
            &["*", "escalate", "bind"]
        ),
        rule(
            &[""],
            &["serviceaccounts", "services", "secrets", "configmaps"],
            &["*"]
        ),
        rule(&[""], &["namespaces"], &["get", "list", "watch"]),
        rule(
            &["", "events.k8s.io"],
            &["events"],
            &["create", "patch", "update"]
        ),
        rule(&["apps"], &["deployments", "daemonsets"], &["*"]),
        rule(&["policy"], &["poddisruptionbudgets"], &["*"]),
        rule(&["apiregistration.k8s.io"], &["apiservices"], &["*"]),
        rule(
            &["admissionregistration.k8s.io"],
            &[
                "mutatingwebhookconfigurations",
                "validatingwebhookconfigurations"
            ],
            &["*"]
        ),
        rule(&["coordination.k8s.io"], &["leases"], &["*"]),
        rule(
            &["kubevirt.io"],
            &["kubevirts", "kubevirts/status", "kubevirts/finalizers"],
            &["*"]
        ),
        rule(
            &["kubevirt.io"],
            &[
                "virtualmachineinstances",
                "virtualmachines",
                "virtualmachineinstancereplicasets"
            ],
            &["get", "list", "watch"]
        ),
    ])
}

fn operator_deployment(namespace: &str, image: &str, release: &Release) -> Value {
    let mut env = vec![
        json!({"name": OPERATOR_IMAGE_ENV, "value": image}),
        json!({"name": VERSION_ENV, "value": release.tag}),
    ];
    let digests: BTreeMap<&String, &String> = release.digests.iter().collect();
    for (component, digest) in digests {
        env.push(json!({"name": digest_env(component), "value": digest}));
    }
    env.push(json!({"name": "POD_NAMESPACE",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}));
    env.push(json!({"name": "POD_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}));
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": OPERATOR, "namespace": namespace,
            "labels": {api::labels::APP: OPERATOR}},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {api::labels::APP: OPERATOR}},
            "template": {
                "metadata": {"labels": {api::labels::APP: OPERATOR,
                    "prometheus.kubevirt.io": "true"}},
                "spec": {
                    "serviceAccountName": OPERATOR_ACCOUNT,
                    "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
                    "containers": [{
                        "name": OPERATOR,
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "args": ["--port", "8443"],
                        "env": env,
                        "ports": [{"name": "metrics", "containerPort": 8443, "protocol": "TCP"}],
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8443,
                            "scheme": "HTTP"}, "initialDelaySeconds": 1, "periodSeconds": 5},
                        "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8443,
                            "scheme": "HTTP"}, "initialDelaySeconds": 15, "periodSeconds": 10},
                        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                    }],
                },
            },
        },
    })
}

/// `kubevirt-operator.yaml`'s objects for an operator `image` of `release`.
pub fn operator_manifest(release: &Release, image: &str) -> Vec<Value> {
    let namespace: Value = serde_saphyr::from_str(NAMESPACE).expect("the namespace manifest");
    let ns = namespace["metadata"]["name"]
        .as_str()
        .unwrap_or("kubevirt")
        .to_owned();
    let labels = json!({api::labels::APP: OPERATOR});
    vec![
        namespace,
        kubevirt_crd(),
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": OPERATOR_ACCOUNT, "namespace": ns, "labels": labels}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": OPERATOR_ACCOUNT, "labels": labels}, "rules": operator_rules()}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": OPERATOR_ACCOUNT, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                "name": OPERATOR_ACCOUNT},
            "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_ACCOUNT, "namespace": ns}]}),
        operator_deployment(&ns, image, release),
    ]
}

/// `kubevirt-cr.yaml`: KubeVirt's example CR. Emulation is allowed because the machines this
/// project targets first (CI, localcluster) have no usable KVM.
pub fn kubevirt_cr() -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": "kubevirt"},
        "spec": {
            "certificateRotateStrategy": {},
            "configuration": {"developerConfiguration": {"useEmulation": true,
                "featureGates": []}},
            "customizeComponents": {},
            "imagePullPolicy": "IfNotPresent",
            "workloadUpdateStrategy": {},
        },
    })
}

/// Objects as one multi-document YAML stream.
pub fn to_yaml(objects: &[Value]) -> String {
    objects
        .iter()
        .map(|o| serde_saphyr::to_string(o).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("---\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_comes_from_the_operators_environment() {
        let env = BTreeMap::from([
            (
                OPERATOR_IMAGE_ENV,
                format!("quay.io/kv/virt-operator@sha256:{}", "a".repeat(64)),
            ),
            (VERSION_ENV, "v1.2.3".to_owned()),
            ("VIRT_API_SHASUM", "sha256:bb".to_owned()),
        ]);
        let r = release_from_env(|k| env.get(k).cloned()).unwrap();
        assert_eq!(r.registry, "quay.io/kv");
        assert_eq!(r.tag, "v1.2.3");
        assert_eq!(
            r.digests,
            BTreeMap::from([("virt-api".into(), "sha256:bb".into())])
        );
        let r = release_from_env(|k| {
            (k == OPERATOR_IMAGE_ENV).then(|| "kubevirt-rs/virt-operator:v9".to_owned())
        })
        .unwrap();
        assert_eq!((r.registry.as_str(), r.tag.as_str()), ("kubevirt-rs", "v9"));
        assert!(
            release_from_env(|_| None)
                .unwrap_err()
                .contains(OPERATOR_IMAGE_ENV)
        );
        assert!(
            release_from_env(|_| Some("Not A Reference".into()))
                .unwrap_err()
                .contains("Not A Reference")
        );
    }

    #[test]
    fn the_operator_manifest_carries_its_release() {
        let release = Release {
            registry: "kubevirt-rs".into(),
            tag: "v1".into(),
            digests: BTreeMap::from([("virt-handler".into(), "sha256:cc".into())]),
        };
        let objects = operator_manifest(&release, "kubevirt-rs/virt-operator@sha256:dd");
        let kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
        assert_eq!(
            kinds,
            [
                "Namespace",
                "CustomResourceDefinition",
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Deployment"
            ]
        );
        let env = &objects[5]["spec"]["template"]["spec"]["containers"][0]["env"];
        assert!(
            env.as_array()
                .unwrap()
                .contains(&json!({"name": "VIRT_HANDLER_SHASUM", "value": "sha256:cc"}))
        );
        // Nothing of it is the operator's own install: it would delete itself.
        for o in &objects {
            assert!(
                o["metadata"]["labels"]
                    .get(crate::strategy::MANAGED_BY_LABEL)
                    .is_none()
            );
        }
    }
}
