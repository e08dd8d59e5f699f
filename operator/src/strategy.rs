//! The install strategy: every object virt-operator keeps in the cluster for one KubeVirt CR,
//! rendered by a pure function of the CR's spec and the operator's own release.
//!
//! The objects are those `hack/install.sh` applies from `manifests/install/` (embedded here, so
//! the operator and the manifests cannot drift) and the CRDs of the `api` crate (all but
//! `kubevirts.kubevirt.io`, which the operator's own manifest installs). On them the CR's
//! settings are applied as KubeVirt's operator applies them: the images (`imageRegistry`,
//! `imageTag`, or the release's digests when the CR names neither), `imagePullPolicy`,
//! `imagePullSecrets`, `infra` and `workloads` placement and replicas, `customizeComponents`
//! (json and merge patches, extra flags), the operator's namespace, and virt-operator's
//! labels and install-strategy annotations.

use std::collections::BTreeMap;

use api::kubevirt::{ComponentConfig, KubeVirtSpec, NodePlacement};
use serde_json::{Value, json};

/// The install manifests the strategy starts from, in `hack/install.sh`'s order (the namespace
/// is the operator's own and not part of the strategy).
const MANIFESTS: [(&str, &str); 6] = [
    (
        "10-virt-controller-rbac.yaml",
        include_str!("../../manifests/install/10-virt-controller-rbac.yaml"),
    ),
    (
        "20-virt-handler-rbac.yaml",
        include_str!("../../manifests/install/20-virt-handler-rbac.yaml"),
    ),
    (
        "30-virt-controller.yaml",
        include_str!("../../manifests/install/30-virt-controller.yaml"),
    ),
    (
        "40-virt-handler.yaml",
        include_str!("../../manifests/install/40-virt-handler.yaml"),
    ),
    (
        "50-virt-api-rbac.yaml",
        include_str!("../../manifests/install/50-virt-api-rbac.yaml"),
    ),
    (
        "55-virt-api-webhooks.yaml",
        include_str!("../../manifests/install/55-virt-api-webhooks.yaml"),
    ),
];

/// `60-virt-api.yaml` comes last: its APIServices route to virt-api once it runs.
const VIRT_API: &str = include_str!("../../manifests/install/60-virt-api.yaml");

/// The component images, by the names the manifests give them (`kubevirt-rs/<name>:latest`).
pub const COMPONENTS: [&str; 4] = [
    "virt-api",
    "virt-controller",
    "virt-handler",
    "virt-launcher",
];

/// The namespace the manifests are written for.
const MANIFEST_NAMESPACE: &str = "kubevirt";

/// `app.kubernetes.io/managed-by` and `app.kubernetes.io/component`, as KubeVirt labels what
/// its operator installs.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
pub const COMPONENT_VALUE: &str = "kubevirt";

/// What virt-operator knows of its own release: the defaults of the CR's image settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Release {
    /// Registry of the operator's image (`kubevirt-rs` is `docker.io/kubevirt-rs`).
    pub registry: String,
    /// Tag of the operator's image.
    pub tag: String,
    /// Digests of this release's component images (KubeVirt's `VIRT_API_SHASUM`, ... in the
    /// operator's environment), by component name; used when the CR names neither a registry
    /// nor a tag, so an installed release runs exactly the images it shipped.
    pub digests: BTreeMap<String, String>,
}

/// A setting of the CR the strategy cannot honour, with its field path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Everything one KubeVirt CR installs.
#[derive(Debug, Clone, PartialEq)]
pub struct Strategy {
    /// In the order to create them: CRDs, then the manifests' objects.
    pub objects: Vec<Value>,
    /// `kubevirt.io/install-strategy-version`: the components' tag (or the release's).
    pub version: String,
    /// `kubevirt.io/install-strategy-registry`.
    pub registry: String,
    /// `kubevirt.io/install-strategy-identifier`: a digest of everything rendered, so any
    /// change of the CR that changes an object changes it.
    pub identifier: String,
}

impl Strategy {
    /// Marks `o` as this install's: virt-operator's labels (which its watches select on) and
    /// the install-strategy annotations.
    pub fn stamp(&self, o: &mut Value) {
        let meta = &mut o["metadata"];
        meta["labels"][MANAGED_BY_LABEL] = json!(api::labels::MANAGED_BY_OPERATOR);
        meta["labels"][COMPONENT_LABEL] = json!(COMPONENT_VALUE);
        meta["annotations"][api::labels::INSTALL_STRATEGY_VERSION] = json!(self.version);
        meta["annotations"][api::labels::INSTALL_STRATEGY_REGISTRY] = json!(self.registry);
        meta["annotations"][api::labels::INSTALL_STRATEGY_IDENTIFIER] = json!(self.identifier);
    }

    /// The objects as one multi-document YAML stream.
    pub fn to_yaml(&self) -> String {
        crate::release::to_yaml(&self.objects)
    }
}

fn manifest_objects() -> Vec<Value> {
    MANIFESTS
        .iter()
        .map(|(_, text)| *text)
        .chain(std::iter::once(VIRT_API))
        .flat_map(|text| {
            serde_saphyr::from_multiple::<Value>(text)
                .unwrap_or_else(|e| panic!("the embedded install manifests parse: {e}"))
        })
        .filter(|o| !o.is_null())
        .collect()
}

fn crd_objects() -> Vec<Value> {
    api::crds::crds()
        .into_iter()
        .filter(|crd| crd.metadata.name.as_deref() != Some("kubevirts.kubevirt.io"))
        .map(|crd| serde_json::to_value(crd).unwrap_or_default())
        .collect()
}

fn kind(o: &Value) -> &str {
    o["kind"].as_str().unwrap_or_default()
}

fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

/// Each component image from `registry` and `tag` (or from the release's digest when the CR
/// names neither).
fn images(
    spec: &KubeVirtSpec,
    release: &Release,
    registry: &str,
    tag: &str,
) -> Result<BTreeMap<String, String>, FieldError> {
    // Docker's reference grammar decides, as the kubelet will when it pulls.
    if let Err(e) = ociimage::Reference::parse(&format!("{registry}/virt-api:latest")) {
        return Err(FieldError::new("spec.imageRegistry", e.to_string()));
    }
    if let Err(e) = ociimage::Reference::parse(&format!("kubevirt-rs/virt-api:{tag}")) {
        return Err(FieldError::new("spec.imageTag", e.to_string()));
    }
    let pinned = spec.image_registry.is_none() && spec.image_tag.is_none();
    Ok(COMPONENTS
        .iter()
        .map(|c| {
            let reference = match release.digests.get(*c).filter(|_| pinned) {
                Some(digest) => format!("{registry}/{c}@{digest}"),
                None => format!("{registry}/{c}:{tag}"),
            };
            ((*c).to_owned(), reference)
        })
        .collect())
}

/// Replaces every string that is exactly one of `from`'s keys (images, `--launcher-image`).
fn replace_strings(v: &mut Value, from: &BTreeMap<String, String>) {
    match v {
        Value::String(s) => {
            if let Some(to) = from.get(s.as_str()) {
                *s = to.clone();
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| replace_strings(x, from)),
        Value::Object(m) => m.values_mut().for_each(|x| replace_strings(x, from)),
        _ => {}
    }
}

/// The pod template's spec of a Deployment or DaemonSet.
fn pod_spec(o: &mut Value) -> Option<&mut Value> {
    matches!(kind(o), "Deployment" | "DaemonSet").then(|| &mut o["spec"]["template"]["spec"])
}

fn containers(pod: &mut Value) -> impl Iterator<Item = &mut Value> {
    let mut all = Vec::new();
    if let Value::Object(m) = pod {
        for (k, v) in m.iter_mut() {
            if (k == "containers" || k == "initContainers")
                && let Value::Array(a) = v
            {
                all.extend(a.iter_mut());
            }
        }
    }
    all.into_iter()
}

/// KubeVirt's placement: node selector labels merged, affinity set, tolerations appended.
fn place(pod: &mut Value, placement: &NodePlacement) {
    for (k, v) in &placement.node_selector {
        pod["nodeSelector"][k] = json!(v);
    }
    if let Some(affinity) = &placement.affinity {
        pod["affinity"] = serde_json::to_value(affinity).unwrap_or_default();
    }
    if !placement.tolerations.is_empty() {
        let mut tolerations = pod["tolerations"].as_array().cloned().unwrap_or_default();
        tolerations.extend(
            placement
                .tolerations
                .iter()
                .map(|t| serde_json::to_value(t).unwrap_or_default()),
        );
        pod["tolerations"] = Value::Array(tolerations);
    }
}

fn apply_component_config(
    o: &mut Value,
    config: Option<&ComponentConfig>,
    field: &str,
) -> Result<(), FieldError> {
    let Some(config) = config else {
        return Ok(());
    };
    if let Some(replicas) = config.replicas {
        if replicas == 0 {
            return Err(FieldError::new(
                format!("{field}.replicas"),
                "must be at least 1: the control plane cannot run without replicas",
            ));
        }
        if kind(o) == "Deployment" {
            o["spec"]["replicas"] = json!(replicas);
        }
    }
    if let (Some(placement), Some(pod)) = (&config.node_placement, pod_spec(o)) {
        place(pod, placement);
    }
    Ok(())
}

/// `customizeComponents`: `patches` (json or merge, by resource type and name, `*` for every
/// name) and `flags` (`api`, `controller`, `handler`: extra `--key value` arguments).
fn customize(objects: &mut [Value], customize: &Value) -> Result<(), FieldError> {
    const FIELD: &str = "spec.customizeComponents";
    let Value::Object(m) = customize else {
        return Err(FieldError::new(FIELD, "must be an object"));
    };
    for key in m.keys() {
        if key != "patches" && key != "flags" {
            return Err(FieldError::new(
                format!("{FIELD}.{key}"),
                "not supported (patches and flags are)",
            ));
        }
    }
    for (i, patch) in m
        .get("patches")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let field = format!("{FIELD}.patches[{i}]");
        let text = |k: &str| -> Result<String, FieldError> {
            patch[k]
                .as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| FieldError::new(format!("{field}.{k}"), "required"))
        };
        let (resource_type, resource_name, body) =
            (text("resourceType")?, text("resourceName")?, text("patch")?);
        let kind_of_patch = text("type")?;
        let parsed: Value = serde_json::from_str(&body)
            .map_err(|e| FieldError::new(format!("{field}.patch"), format!("not JSON: {e}")))?;
        let targets = objects.iter_mut().filter(|o| {
            kind(o) == resource_type && (resource_name == "*" || name(o) == resource_name)
        });
        for target in targets {
            match kind_of_patch.as_str() {
                "json" => {
                    let p: json_patch::Patch = serde_json::from_value(parsed.clone())
                        .map_err(|e| FieldError::new(format!("{field}.patch"), e.to_string()))?;
                    json_patch::patch(target, &p).map_err(|e| {
                        FieldError::new(format!("{field}.patch"), format!("does not apply: {e}"))
                    })?;
                }
                "merge" => json_patch::merge(target, &parsed),
                "strategic" => {
                    return Err(FieldError::new(
                        format!("{field}.type"),
                        "strategic merge patches are not supported: use json or merge",
                    ));
                }
                other => {
                    return Err(FieldError::new(
                        format!("{field}.type"),
                        format!("{other:?} is not json, merge or strategic"),
                    ));
                }
            }
        }
    }
    let flags = m.get("flags").cloned().unwrap_or(Value::Null);
    if let Value::Object(flags) = &flags {
        for (component, values) in flags {
            let (kind_name, object) = match component.as_str() {
                "api" => ("Deployment", "virt-api"),
                "controller" => ("Deployment", "virt-controller"),
                "handler" => ("DaemonSet", "virt-handler"),
                other => {
                    return Err(FieldError::new(
                        format!("{FIELD}.flags.{other}"),
                        "not a component (api, controller, handler)",
                    ));
                }
            };
            let values: BTreeMap<String, String> =
                serde_json::from_value(values.clone()).map_err(|e| {
                    FieldError::new(
                        format!("{FIELD}.flags.{component}"),
                        format!("a map of strings: {e}"),
                    )
                })?;
            for o in objects
                .iter_mut()
                .filter(|o| kind(o) == kind_name && name(o) == object)
            {
                let Some(pod) = pod_spec(o) else { continue };
                for c in containers(pod).filter(|c| c["name"] == object) {
                    let mut args = c["args"].as_array().cloned().unwrap_or_default();
                    for (k, v) in &values {
                        args.push(json!(format!("--{k}")));
                        if !v.is_empty() {
                            args.push(json!(v));
                        }
                    }
                    c["args"] = Value::Array(args);
                }
            }
        }
    }
    Ok(())
}

/// KubeVirt's `NewPodDisruptionBudgetForDeployment`: `<name>-pdb` keeps all but one replica
/// of a Deployment available; none for a Deployment of one replica (it would block every
/// drain).
fn disruption_budget(o: &Value) -> Option<Value> {
    if kind(o) != "Deployment" {
        return None;
    }
    let replicas = o
        .pointer("/spec/replicas")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    let pdb = format!("{}-pdb", name(o));
    (replicas > 1).then(|| {
        json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {
                "name": pdb,
                "namespace": o["metadata"]["namespace"],
                "labels": {api::labels::APP: pdb},
            },
            "spec": {"minAvailable": replicas - 1, "selector": o["spec"]["selector"]},
        })
    })
}

/// Moves the manifests' `kubevirt` namespace to `namespace`: namespaced objects, binding
/// subjects, and the Service references of webhooks and APIServices.
fn set_namespace(o: &mut Value, namespace: &str) {
    let fix = |v: Option<&mut Value>| {
        if let Some(v) = v.filter(|v| v.as_str() == Some(MANIFEST_NAMESPACE)) {
            *v = json!(namespace);
        }
    };
    fix(o.pointer_mut("/metadata/namespace"));
    fix(o.pointer_mut("/spec/service/namespace"));
    for list in ["subjects", "webhooks"] {
        let Some(items) = o.get_mut(list).and_then(Value::as_array_mut) else {
            continue;
        };
        for item in items {
            fix(item.get_mut("namespace"));
            fix(item.pointer_mut("/clientConfig/service/namespace"));
        }
    }
}

/// The install strategy of a KubeVirt CR with `spec`, for an operator of `release` running in
/// `namespace`. Every setting it cannot honour is an error naming its field.
pub fn render(
    spec: &KubeVirtSpec,
    release: &Release,
    namespace: &str,
) -> Result<Strategy, FieldError> {
    let registry = spec
        .image_registry
        .clone()
        .unwrap_or_else(|| release.registry.clone());
    let version = spec
        .image_tag
        .clone()
        .unwrap_or_else(|| release.tag.clone());
    let images = images(spec, release, &registry, &version)?;
    let from: BTreeMap<String, String> = images
        .iter()
        .map(|(c, r)| (format!("kubevirt-rs/{c}:latest"), r.clone()))
        .collect();
    let pull_policy = spec
        .image_pull_policy
        .as_ref()
        .map_or("IfNotPresent", |p| p.as_str())
        .to_owned();
    let mut objects = crd_objects();
    let mut manifests = manifest_objects();
    for o in &mut manifests {
        replace_strings(o, &from);
        set_namespace(o, namespace);
        let infra = matches!(name(o), "virt-api" | "virt-controller");
        match (kind(o), infra) {
            ("Deployment", true) => {
                apply_component_config(o, spec.infra.as_ref(), "spec.infra")?;
            }
            ("DaemonSet", _) => {
                apply_component_config(o, spec.workloads.as_ref(), "spec.workloads")?;
            }
            _ => {}
        }
        if let Some(pod) = pod_spec(o) {
            if !spec.image_pull_secrets.is_empty() {
                pod["imagePullSecrets"] =
                    serde_json::to_value(&spec.image_pull_secrets).unwrap_or_default();
            }
            for c in containers(pod) {
                c["imagePullPolicy"] = json!(pull_policy);
            }
        }
    }
    if let Some(c) = &spec.customize_components {
        customize(&mut manifests, &c.0)?;
    }
    let budgets: Vec<Value> = manifests.iter().filter_map(disruption_budget).collect();
    objects.extend(manifests);
    objects.extend(budgets);
    let identifier = {
        use sha2::Digest as _;
        use std::fmt::Write as _;
        let digest = sha2::Sha256::digest(serde_json::to_vec(&objects).unwrap_or_default());
        digest.iter().take(10).fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    };
    let mut strategy = Strategy {
        objects: Vec::new(),
        version,
        registry,
        identifier,
    };
    for o in &mut objects {
        strategy.stamp(o);
    }
    strategy.objects = objects;
    Ok(strategy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release() -> Release {
        Release {
            registry: "kubevirt-rs".into(),
            tag: "v0.1.0".into(),
            digests: BTreeMap::from([(
                "virt-handler".to_owned(),
                "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                    .to_owned(),
            )]),
        }
    }

    fn spec(v: Value) -> KubeVirtSpec {
        serde_json::from_value(v).unwrap()
    }

    fn find<'a>(s: &'a Strategy, kind_name: &str, object: &str) -> &'a Value {
        s.objects
            .iter()
            .find(|o| kind(o) == kind_name && name(o) == object)
            .unwrap_or_else(|| panic!("{kind_name} {object}"))
    }

    #[test]
    fn release_digests_apply_only_when_the_cr_names_no_images() {
        let s = render(&spec(json!({})), &release(), "kubevirt").unwrap();
        let handler = find(&s, "DaemonSet", "virt-handler");
        assert_eq!(
            handler["spec"]["template"]["spec"]["containers"][0]["image"],
            format!(
                "kubevirt-rs/virt-handler@{}",
                release().digests["virt-handler"]
            )
        );
        let api = find(&s, "Deployment", "virt-api");
        assert_eq!(
            api["spec"]["template"]["spec"]["containers"][0]["image"],
            "kubevirt-rs/virt-api:v0.1.0"
        );
        let s = render(&spec(json!({"imageTag": "v2"})), &release(), "kubevirt").unwrap();
        let handler = find(&s, "DaemonSet", "virt-handler");
        assert_eq!(
            handler["spec"]["template"]["spec"]["containers"][0]["image"],
            "kubevirt-rs/virt-handler:v2"
        );
        let controller = find(&s, "Deployment", "virt-controller");
        let args = controller["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
        assert!(args.contains("kubevirt-rs/virt-launcher:v2"), "{args}");
        assert_eq!(s.version, "v2");
        assert!(
            s.objects.iter().all(|o| o["metadata"]["annotations"]
                [api::labels::INSTALL_STRATEGY_VERSION]
                == "v2")
        );
    }

    #[test]
    fn every_object_is_labelled_and_the_identifier_follows_the_cr() {
        let a = render(&spec(json!({})), &release(), "kubevirt").unwrap();
        let b = render(&spec(json!({})), &release(), "kubevirt").unwrap();
        assert_eq!(a, b, "a pure function");
        let c = render(
            &spec(json!({"imagePullPolicy": "Always"})),
            &release(),
            "kubevirt",
        )
        .unwrap();
        assert_ne!(a.identifier, c.identifier);
        for o in &a.objects {
            assert_eq!(
                o["metadata"]["labels"][MANAGED_BY_LABEL], "virt-operator",
                "{o}"
            );
        }
        let kinds: Vec<&str> = a.objects.iter().map(kind).collect();
        assert_eq!(
            kinds
                .iter()
                .filter(|k| **k == "CustomResourceDefinition")
                .count(),
            11,
            "the five kubevirt.io kinds but KubeVirt (presets included), MigrationPolicy, the pool and the four instancetype.kubevirt.io kinds"
        );
        assert!(!a.objects.iter().any(|o| name(o) == "kubevirts.kubevirt.io"));
        assert!(!kinds.contains(&"Namespace"));
    }

    #[test]
    fn settings_that_cannot_be_honoured_name_their_field() {
        let cases = [
            (
                json!({"imageRegistry": "quay.io/Team"}),
                "spec.imageRegistry",
            ),
            (json!({"imageTag": "-bad"}), "spec.imageTag"),
            (json!({"infra": {"replicas": 0}}), "spec.infra.replicas"),
            (
                json!({"customizeComponents": {"patches": [{"resourceType": "Deployment",
                    "resourceName": "virt-api", "patch": "{}", "type": "strategic"}]}}),
                "spec.customizeComponents.patches[0].type",
            ),
            (
                json!({"customizeComponents": {"patches": [{"resourceType": "Deployment",
                    "resourceName": "virt-api", "type": "json",
                    "patch": "[{\"op\":\"replace\",\"path\":\"/nope/x\",\"value\":1}]"}]}}),
                "spec.customizeComponents.patches[0].patch",
            ),
            (
                json!({"customizeComponents": {"flags": {"launcher": {"v": "2"}}}}),
                "spec.customizeComponents.flags.launcher",
            ),
            (
                json!({"customizeComponents": {"other": {}}}),
                "spec.customizeComponents.other",
            ),
        ];
        for (s, field) in cases {
            match render(&spec(s.clone()), &release(), "kubevirt") {
                Err(err) => assert_eq!(err.field, field, "{s}: {err}"),
                Ok(_) => panic!("{s} rendered"),
            }
        }
    }
}
