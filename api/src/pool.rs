//! `VirtualMachinePool` (`pool.kubevirt.io`): N VirtualMachines from one template, named
//! `<pool>-<index>`, as KubeVirt's `staging/src/kubevirt.io/api/pool/v1beta1`. The pool
//! controller is virt-controller's (`controller::pool`).

// `printcolumn(...)` repeats `type_ = ...`; clippy reads the derive's arguments as duplicated
// attributes, which they are not.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::{Selector, SelectorExt as _};
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::common::{Empty, Preserved, embedded_object_meta, string_enum};
use crate::config::ClusterConfig;
use crate::status::Condition;
use crate::validation::{FieldError, UNSUPPORTED, validate_vm};
use crate::vm::{VirtualMachine, VirtualMachineSpec};

/// The API group of pools.
pub const GROUP: &str = "pool.kubevirt.io";
/// The version KubeVirt stores pools in; `v1alpha1` is served too, with the same schema.
pub const VERSION: &str = "v1beta1";
/// The version KubeVirt served first and still serves.
pub const OLD_VERSION: &str = "v1alpha1";
/// On a pool and on each of its VMs while the pool controller owns them (KubeVirt's
/// `VirtualMachinePoolControllerFinalizer`).
pub const FINALIZER: &str = "pool.kubevirt.io/finalizer";
/// The ControllerRevision (`<pool>-<generation>`) a VM, and the VMI it runs, was made from
/// (KubeVirt's `VirtualMachinePoolRevisionName`).
pub const REVISION_NAME_LABEL: &str = "kubevirt.io/vm-pool-revision-name";

/// The `spec` of a `VirtualMachinePool`.
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "pool.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachinePool",
    namespaced,
    status = "VirtualMachinePoolStatus",
    derive = "PartialEq",
    shortname = "vmpool",
    shortname = "vmpools",
    category = "all",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachinePool keeps a number of VirtualMachines made from one template, named <pool>-<index>.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.labelSelector"
    ),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".spec.replicas",
        description = "Number of desired VirtualMachines"
    ),
    printcolumn(
        name = "Current",
        type_ = "integer",
        json_path = ".status.replicas",
        description = "Number of managed and not final or deleted VirtualMachines"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.readyReplicas",
        description = "Number of managed VirtualMachines which are ready to receive traffic"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachinePoolSpec {
    /// Number of VMs; defaults to 1.
    pub replicas: Option<i32>,
    /// Label selector of the pool's VMs; must match the template's labels; immutable.
    pub selector: LabelSelector,
    /// Template of the VMs.
    pub virtual_machine_template: VirtualMachineTemplateSpec,
    /// Stop reconciling (VMs may then be added or removed by hand).
    pub paused: Option<bool>,
    /// Whether config volume names get the VM's index appended.
    pub name_generation: Option<NameGeneration>,
    /// How many VMs a proactive update may take down at once: a number, or a percentage of
    /// `replicas` (default `100%`).
    pub max_unavailable: Option<IntOrString>,
    /// How the pool removes VMs when scaled in.
    pub scale_in_strategy: Option<ScaleInStrategy>,
    /// How the pool brings its VMs to a new template.
    pub update_strategy: Option<UpdateStrategy>,
    /// Replacing VMs that keep failing to start (refused).
    pub autohealing: Option<Preserved>,
}

/// Metadata and spec of the pool's VMs.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineTemplateSpec {
    /// Labels and annotations of the VMs.
    #[schemars(schema_with = "embedded_object_meta")]
    #[serde(default)]
    pub metadata: Option<ObjectMeta>,
    /// Spec of the VMs.
    #[serde(default)]
    pub spec: VirtualMachineSpec,
}

/// KubeVirt's `VirtualMachinePoolNameGeneration`.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NameGeneration {
    /// `configMap` volumes name `<configmap>-<index>`.
    pub append_index_to_config_map_refs: Option<bool>,
    /// `secret` volumes and cloud-init secret references name `<secret>-<index>`.
    pub append_index_to_secret_refs: Option<bool>,
}

string_enum! {
    /// The order in which VMs are picked for scale-in or a proactive update.
    pub enum SortPolicy {
        /// Lowest index first.
        AscendingOrder = "AscendingOrder",
        /// Highest index first.
        DescendingOrder = "DescendingOrder",
        /// Most recently created first.
        Newest = "Newest",
        /// Least recently created first.
        Oldest = "Oldest",
        /// Any order (the default).
        Random = "Random",
    }
}

/// KubeVirt's `VirtualMachinePoolSelectionPolicy`.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SelectionPolicy {
    /// The order; `Random` when not given.
    pub sort_policy: Option<SortPolicy>,
    /// Only VMs whose template labels or node selector match (refused).
    pub selectors: Option<Preserved>,
}

/// KubeVirt's `VirtualMachinePoolScaleInStrategy`: at most one of the three.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScaleInStrategy {
    /// Never delete VMs on scale-in; users do.
    pub unmanaged: Option<Empty>,
    /// Never delete VMs on scale-in, and let go of the ones deleted by others.
    pub opportunistic: Option<StatePreserving>,
    /// Delete VMs on scale-in, picked by the selection policy (the default).
    pub proactive: Option<ProactiveScaleIn>,
}

/// The state preservation of an opportunistic scale-in.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StatePreserving {
    /// `Disabled` (default); `Offline` and `Online` keep the VM's volumes (refused).
    pub state_preservation: Option<String>,
}

/// KubeVirt's `VirtualMachinePoolProactiveScaleInStrategy`.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProactiveScaleIn {
    /// Which VMs go first.
    pub selection_policy: Option<SelectionPolicy>,
    /// `Disabled` (default); `Offline` and `Online` keep the VM's volumes (refused).
    pub state_preservation: Option<String>,
}

/// KubeVirt's `VirtualMachinePoolUpdateStrategy`: at most one of the three.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpdateStrategy {
    /// VMs keep the template they were made from.
    pub unmanaged: Option<Empty>,
    /// VMs get the new template; their running instances get it on their next start.
    pub opportunistic: Option<Empty>,
    /// VMs get the new template and their instances are restarted to take it (the default).
    pub proactive: Option<ProactiveUpdate>,
}

/// KubeVirt's `VirtualMachinePoolProactiveUpdateStrategy`.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProactiveUpdate {
    /// Which VMs are restarted first.
    pub selection_policy: Option<SelectionPolicy>,
}

string_enum! {
    /// Pool condition types.
    pub enum VirtualMachinePoolConditionType {
        ReplicaFailure = "ReplicaFailure",
        ReplicaPaused = "ReplicaPaused",
    }
}

/// A pool condition.
pub type VirtualMachinePoolCondition = Condition<VirtualMachinePoolConditionType>;

/// The status of a pool.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachinePoolStatus {
    /// VMs of the pool, including those being deleted.
    pub replicas: Option<i32>,
    /// VMs whose Ready condition is true.
    pub ready_replicas: Option<i32>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<VirtualMachinePoolCondition>,
    /// Selector in string form, for the scale subresource.
    pub label_selector: Option<String>,
}

impl VirtualMachinePoolSpec {
    /// `replicas`, 1 when not given.
    pub fn wanted(&self) -> i32 {
        self.replicas.unwrap_or(1)
    }

    /// The order in which VMs are scaled in (KubeVirt's `resolveScaleInPolicy`).
    pub fn scale_in_order(&self) -> SortPolicy {
        sort_policy(
            self.scale_in_strategy
                .as_ref()
                .and_then(|s| s.proactive.as_ref())
                .and_then(|p| p.selection_policy.as_ref()),
        )
    }

    /// The order in which VMs are proactively updated.
    pub fn update_order(&self) -> SortPolicy {
        sort_policy(
            self.update_strategy
                .as_ref()
                .and_then(|s| s.proactive.as_ref())
                .and_then(|p| p.selection_policy.as_ref()),
        )
    }

    /// Whether scale-in leaves VMs to users (`unmanaged` or `opportunistic`).
    pub fn scales_in_proactively(&self) -> bool {
        self.scale_in_strategy
            .as_ref()
            .is_none_or(|s| s.unmanaged.is_none() && s.opportunistic.is_none())
    }

    /// Whether the pool lets go of VMs deleted by others (every strategy but `unmanaged`).
    pub fn releases_deleted_vms(&self) -> bool {
        self.scale_in_strategy
            .as_ref()
            .is_none_or(|s| s.unmanaged.is_none())
    }

    /// Whether VMs get a new template at all.
    pub fn updates_vms(&self) -> bool {
        self.update_strategy
            .as_ref()
            .is_none_or(|s| s.unmanaged.is_none())
    }

    /// Whether running instances are restarted for a new template.
    pub fn updates_proactively(&self) -> bool {
        self.update_strategy
            .as_ref()
            .is_none_or(|s| s.unmanaged.is_none() && s.opportunistic.is_none())
    }
}

fn sort_policy(selection: Option<&SelectionPolicy>) -> SortPolicy {
    selection
        .and_then(|s| s.sort_policy.clone())
        .unwrap_or(SortPolicy::Random)
}

/// `maxUnavailable` as a number of VMs for `replicas` (at least 1), as KubeVirt's
/// `calculateMaxUnavailableInt`; `None` for a value validation refuses.
pub fn max_unavailable(value: Option<&IntOrString>, replicas: i32) -> Option<i32> {
    let n = match value {
        None => replicas,
        Some(IntOrString::Int(n)) => *n,
        Some(IntOrString::String(s)) => {
            let percent: i64 = s.strip_suffix('%')?.parse().ok()?;
            i32::try_from(i64::from(replicas) * percent / 100).ok()?
        }
    };
    Some(n.max(1))
}

const SORT_POLICIES: &str = "AscendingOrder, DescendingOrder, Newest, Oldest or Random";

/// Validate a pool as KubeVirt's `ValidateVMPoolSpec`: the VM template as a VM (so its VMI
/// template as VMIs are), the selector against the template's labels, `maxUnavailable`, at
/// most one strategy of each kind; and what kubevirt-rs does not implement refused by name.
/// `old` is the pool before an update: the selector is immutable.
pub fn validate_pool(
    pool: &VirtualMachinePool,
    old: Option<&VirtualMachinePool>,
    cfg: &ClusterConfig,
) -> Vec<FieldError> {
    let spec = &pool.spec;
    let mut out = Vec::new();
    let mut add = |path: &str, message: String| {
        out.push(FieldError {
            path: path.to_owned(),
            message,
        });
    };
    if spec.replicas.is_some_and(|r| r < 0) {
        add(
            "spec.replicas",
            "must be greater than or equal to 0".to_owned(),
        );
    }
    let labels = spec
        .virtual_machine_template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    match Selector::try_from(spec.selector.clone()) {
        Err(e) => add("spec.selector", e.to_string()),
        Ok(s) if !s.matches(&labels) => {
            add(
                "spec.selector",
                "selector does not match labels.".to_owned(),
            );
        }
        Ok(_) => {}
    }
    if let Some(old) = old
        && old.spec.selector != spec.selector
    {
        add(
            "spec.selector",
            "selector is immutable after creation.".to_owned(),
        );
    }
    match &spec.max_unavailable {
        Some(IntOrString::Int(n)) if *n <= 0 => add(
            "spec.maxUnavailable",
            "maxUnavailable must be greater than 0".to_owned(),
        ),
        Some(IntOrString::String(s)) => match s.strip_suffix('%') {
            None => add(
                "spec.maxUnavailable",
                "maxUnavailable percentage must end with %".to_owned(),
            ),
            Some(p) => match p.parse::<i64>() {
                Err(e) => add(
                    "spec.maxUnavailable",
                    format!("maxUnavailable percentage value {p:?} is invalid: {e}"),
                ),
                Ok(v) if !(1..=100).contains(&v) => add(
                    "spec.maxUnavailable",
                    format!("maxUnavailable percentage value {v} must be between 1 and 100"),
                ),
                Ok(_) => {}
            },
        },
        _ => {}
    }
    if let Some(s) = &spec.update_strategy {
        only_one_kind(
            [
                s.unmanaged.is_some(),
                s.opportunistic.is_some(),
                s.proactive.is_some(),
            ],
            "spec.updateStrategy",
            &mut add,
        );
        if let Some(p) = &s.proactive {
            selection(
                p.selection_policy.as_ref(),
                "spec.updateStrategy.proactive.selectionPolicy",
                &mut add,
            );
        }
    }
    if let Some(s) = &spec.scale_in_strategy {
        only_one_kind(
            [
                s.unmanaged.is_some(),
                s.opportunistic.is_some(),
                s.proactive.is_some(),
            ],
            "spec.scaleInStrategy",
            &mut add,
        );
        if let Some(p) = &s.proactive {
            selection(
                p.selection_policy.as_ref(),
                "spec.scaleInStrategy.proactive.selectionPolicy",
                &mut add,
            );
            state_preservation(
                p.state_preservation.as_deref(),
                "spec.scaleInStrategy.proactive.statePreservation",
                &mut add,
            );
        }
        if let Some(o) = &s.opportunistic {
            state_preservation(
                o.state_preservation.as_deref(),
                "spec.scaleInStrategy.opportunistic.statePreservation",
                &mut add,
            );
        }
    }
    if spec.autohealing.is_some() {
        add("spec.autohealing", UNSUPPORTED.to_owned());
    }
    let vm = VirtualMachine::new("", spec.virtual_machine_template.spec.clone());
    out.extend(validate_vm(&vm, cfg).into_iter().map(|e| FieldError {
        path: format!("spec.virtualMachineTemplate.{}", e.path),
        message: e.message,
    }));
    out
}

/// KubeVirt's rule for the update and scale-in strategies: at most one of their three kinds.
fn only_one_kind(set: [bool; 3], path: &str, add: &mut impl FnMut(&str, String)) {
    if set.iter().filter(|b| **b).count() > 1 {
        add(
            path,
            "only one of unmanaged, opportunistic, or proactive can be specified".to_owned(),
        );
    }
}

fn selection(policy: Option<&SelectionPolicy>, base: &str, add: &mut impl FnMut(&str, String)) {
    let Some(p) = policy else { return };
    if let Some(s) = p.sort_policy.as_ref().filter(|s| !s.is_known()) {
        add(
            &format!("{base}.sortPolicy"),
            format!(
                "unknown sort policy {:?} (one of {SORT_POLICIES})",
                s.as_str()
            ),
        );
    }
    if p.selectors.is_some() {
        add(&format!("{base}.selectors"), UNSUPPORTED.to_owned());
    }
}

fn state_preservation(value: Option<&str>, path: &str, add: &mut impl FnMut(&str, String)) {
    match value {
        None | Some("Disabled") => {}
        Some(v @ ("Offline" | "Online")) => add(path, format!("{v}: {UNSUPPORTED}")),
        Some(v) => add(
            path,
            format!("unknown state preservation {v:?} (one of Disabled, Offline, Online)"),
        ),
    }
}
