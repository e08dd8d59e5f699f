//! The node labeller (KubeVirt's `pkg/virt-handler/node-labeller`): labels the node with the
//! CPU models and features its QEMU can give a guest, so that the launcher pod of a VMI that
//! asks for a named model or requires a feature is scheduled only where it can run
//! (`controller::template` puts the matching `nodeSelector` on it).
//!
//! KubeVirt reads libvirt's `domcapabilities` and `hypervisor-cpu-baseline`, written by an init
//! container. kubevirt-rs has no libvirt, so it asks the node's QEMU directly, where libvirt gets
//! them from: QEMU started with no machine (`-machine none`, KVM when it opens, else TCG, as
//! KubeVirt picks the virt type by `/dev/kvm`), `query-cpu-definitions` for the models (usable
//! when none of its features is unavailable) and static `query-cpu-model-expansion`s for the
//! features of the CPU the accelerator gives (`host` under KVM, `max` under TCG) and of each
//! usable model. [`labels`] is the pure part; [`probe`] runs QEMU and [`run`] keeps the node's
//! labels.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use api::kubevirt::KubeVirt;
use api::labels::{
    CPU_FEATURE, CPU_MODEL, CPU_MODEL_VENDOR, HOST_MODEL_CPU, HOST_MODEL_REQUIRED_FEATURES,
    LABELLER_SKIP_NODE, NODE_HOST_MODEL_IS_OBSOLETE, SUPPORTED_HOST_MODEL_MIGRATION_CPU,
    is_label_name,
};
use k8s_openapi::api::core::v1::Node;
use launcher::qemu::Accel;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt as _;
use tokio_util::sync::CancellationToken;

/// KubeVirt relabels every three minutes (with the heartbeat's jitter), and at once when the
/// cluster configuration changes; here the configuration is read each round.
pub const INTERVAL: Duration = Duration::from_mins(3);

/// The label prefixes the labeller owns: a label of the node with one of them that the
/// labeller no longer wants is removed. KubeVirt's list also has the Hyper-V, TSC, machine
/// type, SEV, TDX and realtime labels, which kubevirt-rs does not write.
const OWNED: [&str; 7] = [
    CPU_FEATURE,
    CPU_MODEL,
    SUPPORTED_HOST_MODEL_MIGRATION_CPU,
    CPU_MODEL_VENDOR,
    HOST_MODEL_CPU,
    HOST_MODEL_REQUIRED_FEATURES,
    NODE_HOST_MODEL_IS_OBSOLETE,
];

/// libvirt's spellings of the features whose name in its CPU map differs from QEMU's
/// (libvirt's QEMU feature translation table). KubeVirt's users write libvirt's, which QEMU
/// also accepts on `-cpu` (it reads `_` as `-`, and `pclmuldq` is its alias).
const LIBVIRT_SPELLINGS: [(&str, &str); 11] = [
    ("cmp-legacy", "cmp_legacy"),
    ("ds-cpl", "ds_cpl"),
    ("fxsr-opt", "fxsr_opt"),
    ("kvm-pv-eoi", "kvm_pv_eoi"),
    ("kvm-pv-unhalt", "kvm_pv_unhalt"),
    ("lahf-lm", "lahf_lm"),
    ("nodeid-msr", "nodeid_msr"),
    ("pclmulqdq", "pclmuldq"),
    ("perfctr-core", "perfctr_core"),
    ("perfctr-nb", "perfctr_nb"),
    ("tsc-adjust", "tsc_adjust"),
];

/// Models that are no CPU of their own: what the accelerator gives (`host`, `max`) and QEMU's
/// empty starting point for static expansions (`base`). libvirt does not list them either.
const NOT_NAMED: [&str; 3] = ["host", "max", "base"];

/// One entry of `query-cpu-definitions`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Model {
    pub name: String,
    /// What keeps the model from running on this node; empty when it is usable.
    #[serde(default)]
    pub unavailable_features: Vec<String>,
    /// The versioned model an unversioned name stands for (`Penryn` -> `Penryn-v1`).
    #[serde(default)]
    pub alias_of: Option<String>,
}

impl Model {
    pub fn usable(&self) -> bool {
        self.unavailable_features.is_empty()
    }

    fn named(&self) -> bool {
        !NOT_NAMED.contains(&self.name.as_str())
    }
}

/// What QEMU told about this node's CPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostCpu {
    /// Every model QEMU knows.
    pub models: Vec<Model>,
    /// The features of the CPU the accelerator gives a guest, in QEMU's names.
    pub features: BTreeSet<String>,
    /// Its CPUID vendor (`GenuineIntel`, `AuthenticAMD`).
    pub vendor: Option<String>,
    /// The features of each usable model that is no alias.
    pub model_features: BTreeMap<String, BTreeSet<String>>,
}

/// The enabled features (properties set to `true`) and the vendor of a static
/// `query-cpu-model-expansion` answer.
fn expansion(answer: &Value) -> (BTreeSet<String>, Option<String>) {
    let props = &answer["model"]["props"];
    let features = props
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, v)| v.as_bool() == Some(true))
        .map(|(k, _)| k.clone())
        .collect();
    (features, props["vendor"].as_str().map(str::to_owned))
}

/// The models whose features [`HostCpu::new`] needs: the usable named ones, aliases aside
/// (an alias expands as its model).
pub fn to_expand(models: &[Model]) -> impl Iterator<Item = &str> {
    models
        .iter()
        .filter(|m| m.usable() && m.named() && m.alias_of.is_none())
        .map(|m| m.name.as_str())
}

impl HostCpu {
    /// From QEMU's answers: the models, the expansion of the accelerator's CPU, and those of
    /// the models [`to_expand`] names.
    pub fn new(models: Vec<Model>, host: &Value, expansions: &BTreeMap<String, Value>) -> Self {
        let (features, vendor) = expansion(host);
        let model_features = expansions
            .iter()
            .map(|(m, a)| (m.clone(), expansion(a).0))
            .collect();
        HostCpu {
            models,
            features,
            vendor,
            model_features,
        }
    }
}

/// libvirt's host-model: the usable named model closest to the host's CPU, i.e. the one with
/// the most features among those whose every feature the host has (libvirt decodes the host's
/// CPUID against its CPU map the same way). An unversioned name is preferred to the versioned
/// model it stands for, as libvirt names them.
pub fn host_model(cpu: &HostCpu) -> Option<(&str, &BTreeSet<String>)> {
    let best = cpu
        .model_features
        .iter()
        .filter(|(_, f)| f.is_subset(&cpu.features))
        .max_by_key(|(_, f)| f.len())?;
    let alias = cpu
        .models
        .iter()
        .find(|m| m.alias_of.as_deref() == Some(best.0.as_str()))
        .map(|m| m.name.as_str());
    Some((alias.unwrap_or(best.0), best.1))
}

/// The name libvirt (and so KubeVirt's users) would use for a CPUID vendor.
fn vendor_name(vendor: &str) -> &str {
    match vendor {
        "GenuineIntel" => "Intel",
        "AuthenticAMD" => "AMD",
        "HygonGenuine" => "Hygon",
        other => other,
    }
}

/// A feature under QEMU's name and, where it differs, libvirt's.
fn spellings(feature: &str) -> impl Iterator<Item = &str> {
    let libvirt = LIBVIRT_SPELLINGS
        .iter()
        .find(|(qemu, _)| *qemu == feature)
        .map(|(_, l)| *l);
    std::iter::once(feature).chain(libvirt)
}

/// The labels KubeVirt's labeller gives a node with this CPU: every usable model not
/// obsolete (`cpu-model`), every known one not obsolete (`cpu-model-migration`), every
/// feature of the host's CPU (`cpu-feature`), the host model, the features the host has
/// beyond it, its vendor, and whether the host model is obsolete. Names that cannot be a
/// label's are left out.
pub fn labels(cpu: &HostCpu, obsolete: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut set = |prefix: &str, name: &str| {
        if is_label_name(name) {
            out.insert(format!("{prefix}{name}"), "true".to_owned());
        }
    };
    for f in &cpu.features {
        for name in spellings(f) {
            set(CPU_FEATURE, name);
        }
    }
    for m in cpu
        .models
        .iter()
        .filter(|m| m.named() && !obsolete.contains(&m.name))
    {
        if m.usable() {
            set(CPU_MODEL, &m.name);
        }
        set(SUPPORTED_HOST_MODEL_MIGRATION_CPU, &m.name);
    }
    if let Some(v) = &cpu.vendor {
        set(CPU_MODEL_VENDOR, vendor_name(v));
    }
    let host = host_model(cpu);
    if let Some((name, features)) = host {
        for f in cpu.features.difference(features) {
            for name in spellings(f) {
                set(HOST_MODEL_REQUIRED_FEATURES, name);
            }
        }
        set(HOST_MODEL_CPU, name);
    }
    if host.is_some_and(|(name, _)| obsolete.contains(name)) {
        out.insert(NODE_HOST_MODEL_IS_OBSOLETE.to_owned(), "true".to_owned());
    }
    out
}

fn owned(label: &str) -> bool {
    OWNED.iter().any(|p| label.starts_with(p))
}

/// The merge patch that gives the node `wanted` and removes the labeller's labels it no
/// longer wants, or `None` when the node has them already or asks to be left alone
/// (KubeVirt's `node-labeller.kubevirt.io/skip-node` annotation). A merge patch touches only
/// these keys, so the heartbeat's labels and anyone else's are not raced.
pub fn label_patch(node: &Node, wanted: &BTreeMap<String, String>) -> Option<Value> {
    let meta = &node.metadata;
    if meta
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(LABELLER_SKIP_NODE))
    {
        return None;
    }
    let current = meta.labels.clone().unwrap_or_default();
    let mut patch = serde_json::Map::new();
    for k in current
        .keys()
        .filter(|k| owned(k) && !wanted.contains_key(*k))
    {
        patch.insert(k.clone(), Value::Null);
    }
    for (k, v) in wanted {
        if current.get(k) != Some(v) {
            patch.insert(k.clone(), Value::String(v.clone()));
        }
    }
    (!patch.is_empty()).then(|| json!({"metadata": {"labels": patch}}))
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("starting {}", qemu.display())]
    Spawn {
        qemu: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("asking QEMU over QMP (QEMU said: {stderr:?})")]
    Qmp {
        stderr: String,
        #[source]
        source: qmp::Error,
    },
    #[error("query-cpu-definitions answered in a shape of its own")]
    Definitions(#[source] serde_json::Error),
}

/// How long QEMU may take to open its monitor and answer: it needs no guest, so milliseconds.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);

/// Starts `qemu` with no machine under `accel`, its monitor on a socket in `dir`, and asks it.
pub async fn probe(qemu: &Path, accel: Accel, dir: &Path) -> Result<HostCpu, ProbeError> {
    let socket = dir.join(format!("node-labeller-{}.qmp", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let mut child = tokio::process::Command::new(qemu)
        .args(["-machine", "none", "-nodefaults", "-nographic", "-S"])
        .arg("-accel")
        .arg(accel.to_string())
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", socket.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| ProbeError::Spawn {
            qemu: qemu.to_owned(),
            source,
        })?;
    let answer = ask(&socket).await;
    let _ = child.kill().await;
    let _ = std::fs::remove_file(&socket);
    match answer {
        Err(ProbeError::Qmp { source, .. }) => {
            let mut stderr = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut stderr).await;
            }
            Err(ProbeError::Qmp {
                stderr: stderr.trim().to_owned(),
                source,
            })
        }
        other => other,
    }
}

async fn ask(socket: &Path) -> Result<HostCpu, ProbeError> {
    let qmp_err = |source| ProbeError::Qmp {
        stderr: String::new(),
        source,
    };
    let opts = qmp::ConnectOptions {
        connect_timeout: QMP_TIMEOUT,
        command_timeout: QMP_TIMEOUT,
        ..qmp::ConnectOptions::default()
    };
    let qmp = qmp::QmpClient::connect(socket, &opts)
        .await
        .map_err(qmp_err)?;
    let ask = |command: &'static str, arguments: Value| {
        let qmp = &qmp;
        async move { qmp.execute_raw(command, arguments).await.map_err(qmp_err) }
    };
    let expand = |model: &str| {
        ask(
            "query-cpu-model-expansion",
            json!({"type": "static", "model": {"name": model}}),
        )
    };
    let kvm = ask("query-kvm", json!({})).await?;
    let models: Vec<Model> = serde_json::from_value(ask("query-cpu-definitions", json!({})).await?)
        .map_err(ProbeError::Definitions)?;
    let host = expand(if kvm["enabled"].as_bool() == Some(true) {
        "host"
    } else {
        "max"
    })
    .await?;
    let mut expansions = BTreeMap::new();
    for m in to_expand(&models) {
        expansions.insert(m.to_owned(), expand(m).await?);
    }
    Ok(HostCpu::new(models, &host, &expansions))
}

/// The obsolete models of the cluster's configuration (`obsoleteCPUModels`), or KubeVirt's
/// default list when it names none or cannot be read.
async fn obsolete_models(kubevirts: &kube::Api<KubeVirt>) -> BTreeSet<String> {
    let configured = match kubevirts.list(&kube::api::ListParams::default()).await {
        Ok(list) => list.items.into_iter().find_map(|kv| {
            kv.spec
                .configuration
                .map(|c| c.obsolete_cpu_models)
                .filter(|m| !m.is_empty())
        }),
        Err(e) => {
            tracing::debug!(error = %e, "no KubeVirt configuration: default obsolete CPU models");
            None
        }
    };
    configured.map_or_else(
        || {
            api::defaults::OBSOLETE_CPU_MODELS
                .iter()
                .map(|&m| m.to_owned())
                .collect()
        },
        |m| m.into_keys().collect(),
    )
}

/// Asks the node's QEMU once (again after [`INTERVAL`] while it fails), then keeps the node's
/// labels until `stop`.
pub async fn run(client: kube::Client, node: String, qemu: PathBuf, stop: CancellationToken) {
    // The accelerator a launcher on this node would choose: a node whose /dev/kvm opens but
    // runs no guest gets TCG's models, which its VMIs then run with, not KVM's.
    let accel = match launcher::accel::choose(&qemu, true).await {
        Ok((accel, _)) => accel,
        Err(_) => Accel::Tcg,
    };
    let cpu = loop {
        match probe(&qemu, accel, &std::env::temp_dir()).await {
            Ok(cpu) => break cpu,
            Err(e) => {
                tracing::warn!(error = %e, "node labeller: no CPU models and features from QEMU");
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(INTERVAL) => {}
        }
    };
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let kubevirts: kube::Api<KubeVirt> = kube::Api::all(client);
    loop {
        let wanted = labels(&cpu, &obsolete_models(&kubevirts).await);
        match nodes.get(&node).await {
            Ok(n) => {
                if let Some(patch) = label_patch(&n, &wanted)
                    && let Err(e) = nodes
                        .patch(
                            &node,
                            &kube::api::PatchParams::default(),
                            &kube::api::Patch::Merge(&patch),
                        )
                        .await
                {
                    tracing::warn!(%node, error = %e, "node labeller: patching the node failed");
                }
            }
            Err(e) => tracing::warn!(%node, error = %e, "node labeller: reading the node failed"),
        }
        let wait = INTERVAL
            + INTERVAL.mul_f64(crate::heartbeat::JITTER_FACTOR * crate::heartbeat::jitter_sample());
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    /// This machine's QEMU 7.2 under TCG, recorded: `query-kvm`, part of
    /// `query-cpu-definitions`, and the static expansions `probe` asks for (properties that
    /// are `false` left out).
    const TCG: &str = include_str!("nodelabeller/tcg.json");

    fn tcg() -> HostCpu {
        let answers: Value = serde_json::from_str(TCG).unwrap();
        let models: Vec<Model> =
            serde_json::from_value(answers["query-cpu-definitions"].clone()).unwrap();
        let expansions = to_expand(&models)
            .map(|m| {
                let a = &answers[format!("query-cpu-model-expansion {m}")];
                assert!(a.is_object(), "no recorded expansion of {m}");
                (m.to_owned(), a.clone())
            })
            .collect();
        let host = &answers["query-cpu-model-expansion max"];
        HostCpu::new(models, host, &expansions)
    }

    fn default_obsolete() -> BTreeSet<String> {
        api::defaults::OBSOLETE_CPU_MODELS
            .iter()
            .map(|&m| m.to_owned())
            .collect()
    }

    #[test]
    fn tcg_answers_give_kubevirts_labels() {
        let labels = labels(&tcg(), &default_obsolete());
        let has = |k: &str| labels.get(k).map(String::as_str) == Some("true");
        for present in [
            "cpu-model.node.kubevirt.io/Penryn",
            "cpu-model.node.kubevirt.io/Penryn-v1",
            "cpu-model.node.kubevirt.io/Westmere",
            "cpu-model.node.kubevirt.io/Nehalem-v1",
            // Known but not usable under TCG: a migration target, not a model to run.
            "cpu-model-migration.node.kubevirt.io/Skylake-Client",
            "cpu-model-migration.node.kubevirt.io/Westmere",
            "cpu-feature.node.kubevirt.io/sse4.1",
            "cpu-feature.node.kubevirt.io/avx2",
            // QEMU's name and libvirt's.
            "cpu-feature.node.kubevirt.io/lahf-lm",
            "cpu-feature.node.kubevirt.io/lahf_lm",
            "cpu-feature.node.kubevirt.io/pclmulqdq",
            "cpu-feature.node.kubevirt.io/pclmuldq",
            "host-model-cpu.node.kubevirt.io/Westmere",
            "host-model-required-features.node.kubevirt.io/avx2",
            "cpu-vendor.node.kubevirt.io/AMD",
        ] {
            assert!(has(present), "{present} missing from {labels:#?}");
        }
        for absent in [
            "cpu-model.node.kubevirt.io/Skylake-Client",
            "cpu-model.node.kubevirt.io/qemu64",
            "cpu-model-migration.node.kubevirt.io/qemu64-v1",
            "cpu-model.node.kubevirt.io/max",
            "cpu-model.node.kubevirt.io/host",
            "cpu-model.node.kubevirt.io/base",
            "cpu-feature.node.kubevirt.io/vmx",
            // Westmere has it: not required beyond the host model.
            "host-model-required-features.node.kubevirt.io/sse2",
            NODE_HOST_MODEL_IS_OBSOLETE,
        ] {
            assert!(!labels.contains_key(absent), "{absent} in {labels:#?}");
        }
    }

    #[test]
    fn the_clusters_obsolete_models_replace_kubevirts_list() {
        let obsolete = BTreeSet::from(["Westmere".to_owned(), "Penryn".to_owned()]);
        let labels = labels(&tcg(), &obsolete);
        assert_eq!(labels[NODE_HOST_MODEL_IS_OBSOLETE], "true");
        assert_eq!(labels["host-model-cpu.node.kubevirt.io/Westmere"], "true");
        assert!(!labels.contains_key("cpu-model.node.kubevirt.io/Westmere"));
        assert!(!labels.contains_key("cpu-model.node.kubevirt.io/Penryn"));
        assert_eq!(labels["cpu-model.node.kubevirt.io/Penryn-v1"], "true");
        assert_eq!(labels["cpu-model.node.kubevirt.io/qemu64"], "true");
    }

    fn node(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Node {
        let map = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            )
        };
        Node {
            metadata: ObjectMeta {
                labels: map(labels),
                annotations: map(annotations),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    #[test]
    fn the_patch_adds_what_is_missing_and_removes_only_stale_labeller_labels() {
        let wanted: BTreeMap<String, String> = [
            ("cpu-model.node.kubevirt.io/Penryn", "true"),
            ("cpu-feature.node.kubevirt.io/sse2", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let n = node(
            &[
                ("kubevirt.io/schedulable", "true"),
                ("cpu-model.node.kubevirt.io/Penryn", "true"),
                ("cpu-model.node.kubevirt.io/Haswell", "true"),
                ("host-model-cpu.node.kubevirt.io/Haswell", "true"),
                ("disk", "ssd"),
            ],
            &[],
        );
        assert_eq!(
            label_patch(&n, &wanted),
            Some(json!({"metadata": {"labels": {
                "cpu-model.node.kubevirt.io/Haswell": null,
                "host-model-cpu.node.kubevirt.io/Haswell": null,
                "cpu-feature.node.kubevirt.io/sse2": "true",
            }}}))
        );
        let done = node(
            &[
                ("cpu-model.node.kubevirt.io/Penryn", "true"),
                ("cpu-feature.node.kubevirt.io/sse2", "true"),
            ],
            &[],
        );
        assert_eq!(label_patch(&done, &wanted), None);
        let skipped = node(&[], &[(LABELLER_SKIP_NODE, "")]);
        assert_eq!(label_patch(&skipped, &wanted), None);
    }

    /// This node's QEMU, asked as virt-handler asks it.
    #[tokio::test]
    async fn probe_asks_this_nodes_qemu() {
        let dir = tempfile::tempdir().unwrap();
        let cpu = probe(Path::new("qemu-system-x86_64"), Accel::Tcg, dir.path())
            .await
            .unwrap();
        // Whether Penryn is usable depends on the accelerator (this machine's nested KVM gives
        // a CPU that runs only the pentiums): known it is.
        assert!(cpu.models.iter().any(|m| m.name == "Penryn"));
        assert!(cpu.features.contains("sse2"), "{:?}", cpu.features);
        assert!(host_model(&cpu).is_some(), "{cpu:?}");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
        let err = probe(Path::new("/nonexistent/qemu"), Accel::Tcg, dir.path())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/qemu"), "{err}");
    }
}
