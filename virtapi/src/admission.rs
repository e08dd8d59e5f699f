//! virt-api's admission webhooks as pure functions: an `admission.k8s.io/v1` AdmissionReview in,
//! the AdmissionReview answer out. The HTTPS server routes a POST on [`WebhookSpec::path`] to
//! [`admit`] through [`Webhook::from_path`].
//!
//! The mutating hooks persist `api::defaults` into the stored object (a JSONPatch diffed between
//! the decoded object and its defaulted copy); the validating hooks run `api::validation` and
//! refuse with every `field.path: problem`, as KubeVirt's admitters
//! (`pkg/virt-api/webhooks/{mutating-webhook,validating-webhook}`) do. [`WEBHOOKS`] lists them with
//! KubeVirt's names, paths, rules and failure policies; `manifests/install/55-virt-api-webhooks.yaml`
//! registers exactly that list.
//!
//! Deliberate differences from KubeVirt:
//! - Only the hooks for the kinds kubevirt-rs serves, `v1` only. KubeVirt's `kubevirt-validate-*`
//!   hooks are virt-operator's, not virt-api's; pools, presets, snapshots, exports, clones,
//!   instancetypes, migration policies, plugins, hotplug-pod eviction and `status-validate`
//!   (which checks VM volume hotplug requests) have nothing to act on here.
//! - The pod-eviction hook ([`Webhook::PodEvictionValidator`]) reads the pod and its VMI and may
//!   patch the VMI: its request is parsed and answered here ([`eviction_request`],
//!   [`eviction_answer`]), its decision and I/O are [`crate::eviction`]'s.
//! - The VMIRS validator defaults a copy of its template before validating it, as KubeVirt's VM
//!   admitter does and its VMIRS admitter does not: `api::validation` is written for defaulted
//!   specs and would otherwise report what defaulting fills in.
//! - A refusal's message reads `field.path: problem, ...`; KubeVirt's joins the problems only
//!   (its causes carry the fields, as ours do).
//! - On a VMI spec change by a KubeVirt service account, volume and disk changes are admitted as
//!   KubeVirt's `AdmitHotplugStorage` admits them (`admission::storage`), except that a new
//!   hotplugged volume must be a PVC or DataVolume: kubevirt-rs has no `memoryDump` volumes, nor
//!   KubeVirt's utility volumes.
//! - The migration validators do not look up the VMI (exists, not final, migratable) or in-flight
//!   migrations of it: that needs the API and is left to the migration controller.
//! - KubeVirt's schema check (`ValidateSchema` against its OpenAPI definitions) is the CRD's
//!   structural schema here; an object that does not decode into the `api` types is refused with
//!   code 400, as KubeVirt refuses undecodable objects.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::sync::Arc;

use api::defaults;
use api::labels;
use api::migration::VirtualMachineInstanceMigrationPhase;
use api::migrationpolicy::MigrationPolicy;
use api::pool::VirtualMachinePool;
use api::preset::{self, VirtualMachineInstancePreset};
use api::validation::{self, FieldError};
use api::{
    ClusterConfig, KubeVirt, VirtualMachine, VirtualMachineInstance,
    VirtualMachineInstanceMigration, VirtualMachineInstancePhase, VirtualMachineInstanceReplicaSet,
};
use informer::instancetype::Found;
use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Name of the MutatingWebhookConfiguration (KubeVirt's `VirtAPIMutatingWebhookName`).
pub const MUTATING_CONFIGURATION: &str = "virt-api-mutator";
/// Name of the ValidatingWebhookConfiguration (KubeVirt's `VirtAPIValidatingWebhookName`).
pub const VALIDATING_CONFIGURATION: &str = "virt-api-validator";
/// The Service the API server calls the webhooks through.
pub const SERVICE_NAME: &str = "virt-api";
/// KubeVirt's install namespace.
pub const DEFAULT_NAMESPACE: &str = "kubevirt";
/// KubeVirt's service accounts; requests from them are KubeVirt's own.
pub const API_SERVICE_ACCOUNT: &str = "kubevirt-apiserver";
/// virt-controller's service account.
pub const CONTROLLER_SERVICE_ACCOUNT: &str = "kubevirt-controller";
/// virt-handler's service account.
pub const HANDLER_SERVICE_ACCOUNT: &str = "kubevirt-handler";
/// The synchronization controller's service account (KubeVirt counts it as its own).
pub const SYNCHRONIZATION_CONTROLLER_SERVICE_ACCOUNT: &str = "kubevirt-synchronization-controller";
const SERVICE_ACCOUNTS: [&str; 4] = [
    API_SERVICE_ACCOUNT,
    CONTROLLER_SERVICE_ACCOUNT,
    HANDLER_SERVICE_ACCOUNT,
    SYNCHRONIZATION_CONTROLLER_SERVICE_ACCOUNT,
];

/// `userInfo.extra` key the API server fills from a pod-bound service account token: the node
/// the calling pod runs on. KubeVirt's node restriction reads it.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// Label the migration mutator sets to `spec.vmiName` (KubeVirt's `MigrationSelectorLabel`).
pub const MIGRATION_SELECTOR_LABEL: &str = "kubevirt.io/vmi-name";
/// KubeVirt's `NodeRestriction` feature gate (Beta: on unless disabled).
const NODE_RESTRICTION_GATE: &str = "NodeRestriction";
/// KubeVirt's `DeclarativeHotplugVolumes` feature gate (Beta: on unless disabled).
const DECLARATIVE_HOTPLUG_VOLUMES_GATE: &str = "DeclarativeHotplugVolumes";
/// KubeVirt's `HotplugVolumes` feature gate (deprecated: on only when listed).
const HOTPLUG_VOLUMES_GATE: &str = "HotplugVolumes";

/// Labels only KubeVirt's service accounts may set or change on a VMI (KubeVirt's
/// `restrictedVmiLabels`): the controllers and the handler route on them.
const RESERVED_VMI_LABELS: [&str; 6] = [
    labels::CREATED_BY,
    labels::MIGRATION_JOB_UID,
    labels::NODE_NAME,
    labels::MIGRATION_TARGET_NODE_NAME,
    labels::NODE_SCHEDULABLE,
    labels::INSTALL_STRATEGY,
];

/// KubeVirt caps the causes of one refusal at ten.
const MAX_CAUSES: usize = 10;

/// One of virt-api's webhooks. The variants are in [`WEBHOOKS`] order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Webhook {
    /// Template architecture and machine type; firmware uuid and serial on create.
    VmMutator,
    /// VMI defaults on create; reverts status changes by anyone but KubeVirt on update.
    VmiMutator,
    /// Selector label and finalizer of a new migration.
    MigrationMutator,
    /// Evictions of virt-launcher pods: KubeVirt's eviction strategies (`crate::eviction`).
    PodEvictionValidator,
    /// Validation of a new VMI; reserved labels.
    VmiCreateValidator,
    /// VMI spec immutability, reserved labels, virt-handler's node restriction.
    VmiUpdateValidator,
    /// Validation of a VM (its template defaulted first).
    VmValidator,
    /// Validation of a VMI ReplicaSet (its template defaulted first).
    ReplicaSetValidator,
    /// Validation of a VirtualMachinePool (its VM template as a VM).
    PoolValidator,
    /// Validation of a VirtualMachineInstancePreset.
    PresetValidator,
    /// Validation of a new migration; only virt-controller sets its priority.
    MigrationCreateValidator,
    /// Migration spec immutability; the selector label of an in-flight migration.
    MigrationUpdateValidator,
    /// MigrationPolicy settings kubevirt-rs can apply (`api::migrationpolicy::validate`).
    MigrationPolicyValidator,
}

/// Whether a webhook belongs to the mutating or the validating configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// In [`MUTATING_CONFIGURATION`]; may answer with a patch.
    Mutating,
    /// In [`VALIDATING_CONFIGURATION`]; allows or refuses.
    Validating,
}

/// The operations a webhook is registered for. DELETE and CONNECT go to none of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// `CREATE`
    Create,
    /// `UPDATE`
    Update,
}

impl Operation {
    /// The spelling in AdmissionRequests and webhook rules.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "CREATE",
            Self::Update => "UPDATE",
        }
    }
}

/// A CEL condition kube-apiserver checks before calling a webhook (`matchConditions`).
#[derive(Debug)]
pub struct MatchCondition {
    /// The condition's name.
    pub name: &'static str,
    /// The CEL expression.
    pub expression: &'static str,
}

/// One row of the webhook table: how the webhook is registered.
#[derive(Debug)]
pub struct WebhookSpec {
    /// Which webhook.
    pub webhook: Webhook,
    /// The webhook's name in its configuration (KubeVirt's).
    pub name: &'static str,
    /// The path on virt-api's HTTPS server (KubeVirt's).
    pub path: &'static str,
    /// The API group of the resource it is registered for (`kubevirt.io`, or `""`: core).
    pub group: &'static str,
    /// The version of the resource it is registered for.
    pub version: &'static str,
    /// The resource it is registered for, `/subresource` appended for a subresource
    /// (`pods/eviction`).
    pub resource: &'static str,
    /// The operations it is registered for.
    pub operations: &'static [Operation],
    /// Mutating or validating.
    pub admission: Admission,
    /// `Fail`, as KubeVirt: an unreachable virt-api must not let undefaulted or invalid
    /// objects in.
    pub failure_policy: &'static str,
    /// KubeVirt's `defaultTimeoutSeconds`.
    pub timeout_seconds: i32,
    /// `None`, or `NoneOnDryRun` for a hook that writes (it honours dry runs).
    pub side_effects: &'static str,
    /// The one `matchConditions` entry, if any.
    pub match_condition: Option<MatchCondition>,
}

const CREATE: &[Operation] = &[Operation::Create];
const UPDATE: &[Operation] = &[Operation::Update];
const CREATE_UPDATE: &[Operation] = &[Operation::Create, Operation::Update];

/// Every webhook, in the order of `manifests/install/55-virt-api-webhooks.yaml` (mutating
/// configuration first), which is KubeVirt's order.
pub static WEBHOOKS: [WebhookSpec; 13] = [
    row(
        Webhook::VmMutator,
        "virtualmachines-mutator.kubevirt.io",
        "/virtualmachines-mutate",
        "virtualmachines",
        CREATE_UPDATE,
        Admission::Mutating,
    ),
    row(
        Webhook::VmiMutator,
        "virtualmachineinstances-mutator.kubevirt.io",
        "/virtualmachineinstances-mutate",
        "virtualmachineinstances",
        CREATE_UPDATE,
        Admission::Mutating,
    ),
    row(
        Webhook::MigrationMutator,
        "migrations-mutator.kubevirt.io",
        "/migration-mutate-create",
        "virtualmachineinstancemigrations",
        CREATE,
        Admission::Mutating,
    ),
    WebhookSpec {
        webhook: Webhook::PodEvictionValidator,
        name: "virt-launcher-eviction-interceptor.kubevirt.io",
        path: "/pod-eviction-validate",
        group: "",
        version: "v1",
        resource: "pods/eviction",
        operations: CREATE,
        admission: Admission::Validating,
        failure_policy: "Fail",
        timeout_seconds: 10,
        // It marks the VMI for evacuation, except on a dry run.
        side_effects: "NoneOnDryRun",
        // kube-apiserver asks only about virt-launcher pods (the Eviction's name is the pod's).
        match_condition: Some(MatchCondition {
            name: "virt-launcher-pods-only",
            expression: "object.metadata.name.startsWith(\"virt-launcher\")",
        }),
    },
    row(
        Webhook::VmiCreateValidator,
        "virtualmachineinstances-create-validator.kubevirt.io",
        "/virtualmachineinstances-validate-create",
        "virtualmachineinstances",
        CREATE,
        Admission::Validating,
    ),
    row(
        Webhook::VmiUpdateValidator,
        "virtualmachineinstances-update-validator.kubevirt.io",
        "/virtualmachineinstances-validate-update",
        "virtualmachineinstances",
        UPDATE,
        Admission::Validating,
    ),
    row(
        Webhook::VmValidator,
        "virtualmachine-validator.kubevirt.io",
        "/virtualmachines-validate",
        "virtualmachines",
        CREATE_UPDATE,
        Admission::Validating,
    ),
    row(
        Webhook::ReplicaSetValidator,
        "virtualmachinereplicaset-validator.kubevirt.io",
        "/virtualmachinereplicaset-validate",
        "virtualmachineinstancereplicasets",
        CREATE_UPDATE,
        Admission::Validating,
    ),
    WebhookSpec {
        group: api::pool::GROUP,
        version: api::pool::VERSION,
        ..row(
            Webhook::PoolValidator,
            "virtualmachinepool-validator.kubevirt.io",
            "/virtualmachinepool-validate",
            "virtualmachinepools",
            CREATE_UPDATE,
            Admission::Validating,
        )
    },
    row(
        Webhook::PresetValidator,
        "virtualmachinepreset-validator.kubevirt.io",
        "/vmipreset-validate",
        "virtualmachineinstancepresets",
        CREATE_UPDATE,
        Admission::Validating,
    ),
    row(
        Webhook::MigrationCreateValidator,
        "migration-create-validator.kubevirt.io",
        "/migration-validate-create",
        "virtualmachineinstancemigrations",
        CREATE,
        Admission::Validating,
    ),
    row(
        Webhook::MigrationUpdateValidator,
        "migration-update-validator.kubevirt.io",
        "/migration-validate-update",
        "virtualmachineinstancemigrations",
        UPDATE,
        Admission::Validating,
    ),
    WebhookSpec {
        group: "migrations.kubevirt.io",
        version: "v1alpha1",
        ..row(
            Webhook::MigrationPolicyValidator,
            "migration-policy-validator.kubevirt.io",
            "/migration-policy-validate-create",
            "migrationpolicies",
            CREATE_UPDATE,
            Admission::Validating,
        )
    },
];

const fn row(
    webhook: Webhook,
    name: &'static str,
    path: &'static str,
    resource: &'static str,
    operations: &'static [Operation],
    admission: Admission,
) -> WebhookSpec {
    WebhookSpec {
        webhook,
        name,
        path,
        group: api::GROUP,
        version: api::VERSION,
        resource,
        operations,
        admission,
        failure_policy: "Fail",
        timeout_seconds: 10,
        side_effects: "None",
        match_condition: None,
    }
}

impl Webhook {
    /// Every webhook, in [`WEBHOOKS`] order.
    pub const ALL: [Self; 13] = [
        Self::VmMutator,
        Self::VmiMutator,
        Self::MigrationMutator,
        Self::PodEvictionValidator,
        Self::VmiCreateValidator,
        Self::VmiUpdateValidator,
        Self::VmValidator,
        Self::ReplicaSetValidator,
        Self::PoolValidator,
        Self::PresetValidator,
        Self::MigrationCreateValidator,
        Self::MigrationUpdateValidator,
        Self::MigrationPolicyValidator,
    ];

    /// Its row of [`WEBHOOKS`].
    pub fn spec(self) -> &'static WebhookSpec {
        // Variants are declared in table order; a unit test holds them together.
        &WEBHOOKS[self as usize]
    }

    /// The webhook served at `path`.
    pub fn from_path(path: &str) -> Option<Self> {
        WEBHOOKS.iter().find(|s| s.path == path).map(|s| s.webhook)
    }
}

/// What the webhooks decide with, besides the request.
#[derive(Clone)]
pub struct Context {
    /// The KubeVirt CR's configuration.
    pub cluster: ClusterConfig,
    /// The namespace KubeVirt is installed in, which qualifies its service accounts
    /// (`system:serviceaccount:<namespace>:kubevirt-handler`...).
    pub namespace: String,
    /// KubeVirt's `NodeRestriction`: virt-handler may only update VMIs on its own node.
    pub node_restriction: bool,
    /// The volume hotplug feature gates.
    pub hotplug: HotplugGates,
    /// New ids for VM firmware uuid and serial (uuid v4 in production).
    pub new_id: Arc<dyn Fn() -> String + Send + Sync>,
    /// The clock for the VMI's `Pending` phase transition timestamp.
    pub now: Arc<dyn Fn() -> Timestamp + Send + Sync>,
    /// The VirtualMachineInstancePresets a new VMI may match (KubeVirt's preset informer).
    pub presets: Vec<VirtualMachineInstancePreset>,
    /// The instance type and preference the reviewed VM names, as found for this review
    /// (KubeVirt's VM admitter ignores a lookup that fails: the controller reports it).
    pub instancetypes: Found,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("cluster", &self.cluster)
            .field("namespace", &self.namespace)
            .field("node_restriction", &self.node_restriction)
            .field("hotplug", &self.hotplug)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context with KubeVirt's defaults: node restriction on, random uuids, the system clock.
    pub fn new(cluster: ClusterConfig, namespace: impl Into<String>) -> Self {
        Self {
            cluster,
            namespace: namespace.into(),
            node_restriction: true,
            hotplug: HotplugGates::default(),
            new_id: Arc::new(|| uuid::Uuid::new_v4().to_string()),
            now: Arc::new(Timestamp::now),
            presets: Vec::new(),
            instancetypes: Found::default(),
        }
    }

    /// The context of a KubeVirt CR.
    pub fn from_kubevirt(kv: &KubeVirt, namespace: impl Into<String>) -> Self {
        let dev = kv
            .spec
            .configuration
            .as_ref()
            .and_then(|c| c.developer_configuration.as_ref());
        let listed = |gates: Option<&Vec<String>>, gate: &str| {
            gates.is_some_and(|g| g.iter().any(|g| g == gate))
        };
        let enabled = |gate| listed(dev.and_then(|d| d.feature_gates.as_ref()), gate);
        let disabled = |gate| listed(dev.and_then(|d| d.disabled_feature_gates.as_ref()), gate);
        // KubeVirt's precedence for a Beta gate: enabled > disabled > on by default; a
        // deprecated gate is on only when enabled.
        let beta = |gate| enabled(gate) || !disabled(gate);
        Self {
            node_restriction: beta(NODE_RESTRICTION_GATE),
            hotplug: HotplugGates {
                declarative: beta(DECLARATIVE_HOTPLUG_VOLUMES_GATE),
                legacy: enabled(HOTPLUG_VOLUMES_GATE),
            },
            ..Self::new(ClusterConfig::from_kubevirt(kv), namespace)
        }
    }

    /// The KubeVirt service account `username` is, if it is one.
    fn service_account<'a>(&self, username: &'a str) -> Option<&'a str> {
        let account = username
            .strip_prefix("system:serviceaccount:")?
            .strip_prefix(self.namespace.as_str())?
            .strip_prefix(':')?;
        SERVICE_ACCOUNTS.contains(&account).then_some(account)
    }
}

/// KubeVirt's volume hotplug feature gates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotplugGates {
    /// `DeclarativeHotplugVolumes`: a VM's hotpluggable volumes follow its template.
    pub declarative: bool,
    /// The deprecated `HotplugVolumes`, which also lets a VM's VMI be hotplugged directly.
    pub legacy: bool,
}

impl Default for HotplugGates {
    /// KubeVirt's defaults: the Beta gate on, the deprecated one off.
    fn default() -> Self {
        Self {
            declarative: true,
            legacy: false,
        }
    }
}

impl HotplugGates {
    /// Whether the `addvolume` and `removevolume` subresources are served at all.
    pub fn enabled(self) -> bool {
        self.declarative || self.legacy
    }
}

/// Answer an AdmissionReview sent to `hook`: an AdmissionReview whose `response` echoes the
/// request's uid. Never panics; a review that cannot be read is refused with code 400.
pub fn admit(hook: Webhook, review: &Value, ctx: &Context) -> Value {
    let uid = review
        .pointer("/request/uid")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let outcome = Request::parse(hook, review).and_then(|req| decide(hook, &req, ctx));
    answer(uid, outcome)
}

/// The parts of an AdmissionRequest the webhooks read.
#[derive(Debug)]
struct Request {
    operation: Operation,
    name: String,
    namespace: String,
    dry_run: bool,
    username: String,
    extra: BTreeMap<String, Vec<String>>,
    object: Value,
    old_object: Option<Value>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawRequest {
    resource: Gvr,
    #[serde(default)]
    sub_resource: Option<String>,
    operation: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    dry_run: Option<bool>,
    #[serde(default)]
    user_info: UserInfo,
    #[serde(default)]
    object: Option<Value>,
    #[serde(default)]
    old_object: Option<Value>,
}

#[derive(serde::Deserialize)]
struct Gvr {
    #[serde(default)]
    group: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    resource: String,
}

#[derive(Default, serde::Deserialize)]
struct UserInfo {
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    extra: BTreeMap<String, Vec<String>>,
}

impl Request {
    fn parse(hook: Webhook, review: &Value) -> Result<Self, Refusal> {
        let spec = hook.spec();
        let api_version = review.get("apiVersion").and_then(Value::as_str);
        if api_version != Some("admission.k8s.io/v1")
            || review.get("kind").and_then(Value::as_str) != Some("AdmissionReview")
        {
            return Err(Refusal::bad_request(format!(
                "expected an admission.k8s.io/v1 AdmissionReview, got apiVersion {api_version:?}"
            )));
        }
        let raw = review
            .get("request")
            .filter(|r| r.is_object())
            .ok_or_else(|| Refusal::bad_request("AdmissionReview has no request"))?;
        if raw
            .get("uid")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            return Err(Refusal::bad_request("AdmissionReview request has no uid"));
        }
        let raw: RawRequest = serde_json::from_value(raw.clone())
            .map_err(|e| Refusal::bad_request(format!("cannot read the AdmissionRequest: {e}")))?;
        let gvr = &raw.resource;
        let (resource, sub_resource) = spec.resource.split_once('/').unwrap_or((spec.resource, ""));
        if gvr.group != spec.group
            || gvr.version != spec.version
            || gvr.resource != resource
            || raw.sub_resource.as_deref().unwrap_or_default() != sub_resource
        {
            return Err(Refusal::bad_request(format!(
                "expect resource to be '{}.{}/{}'",
                spec.resource, spec.group, spec.version
            )));
        }
        let operation = spec
            .operations
            .iter()
            .copied()
            .find(|op| op.as_str() == raw.operation)
            .ok_or_else(|| {
                Refusal::bad_request(format!(
                    "operation {} is not admitted by {}",
                    raw.operation, spec.path
                ))
            })?;
        let object = raw
            .object
            .filter(Value::is_object)
            .ok_or_else(|| Refusal::bad_request("AdmissionRequest has no object"))?;
        let old_object = raw.old_object.filter(Value::is_object);
        if operation == Operation::Update && old_object.is_none() {
            return Err(Refusal::bad_request(
                "UPDATE AdmissionRequest has no oldObject",
            ));
        }
        Ok(Self {
            operation,
            name: raw.name,
            namespace: raw.namespace,
            dry_run: raw.dry_run.unwrap_or(false),
            username: raw.user_info.username.unwrap_or_default(),
            extra: raw.user_info.extra,
            object,
            old_object,
        })
    }

    fn object<T: DeserializeOwned>(&self) -> Result<T, Refusal> {
        decode(&self.object, "object")
    }

    /// The old object; [`Request::parse`] made sure an UPDATE has one.
    fn old_object<T: DeserializeOwned>(&self) -> Result<T, Refusal> {
        decode(
            self.old_object.as_ref().unwrap_or(&Value::Null),
            "oldObject",
        )
    }
}

/// What the pod-eviction hook reads of its AdmissionRequest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictionRequest {
    /// The request's uid, echoed in the answer.
    pub uid: String,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// `dryRun`: decide, but write nothing.
    pub dry_run: bool,
    /// The Eviction's annotations (the descheduler marks its own with `requested-by`).
    pub annotations: BTreeMap<String, String>,
}

/// The pod-eviction hook's request, or (`Err`) the AdmissionReview answering one that cannot
/// be read.
pub fn eviction_request(review: &Value) -> Result<EvictionRequest, Value> {
    let hook = Webhook::PodEvictionValidator;
    let uid = review
        .pointer("/request/uid")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let req = Request::parse(hook, review).map_err(|r| answer(uid, Err(r)))?;
    let annotations = req
        .object
        .pointer("/metadata/annotations")
        .and_then(|a| serde_json::from_value(a.clone()).ok())
        .unwrap_or_default();
    Ok(EvictionRequest {
        uid: uid.to_owned(),
        namespace: req.namespace,
        pod: req.name,
        dry_run: req.dry_run,
        annotations,
    })
}

/// The AdmissionReview answering a pod eviction: allowed (`None`), or denied with this message
/// and code 429, as every denial of KubeVirt's pod-eviction admitter.
pub fn eviction_answer(uid: &str, denial: Option<String>) -> Value {
    let outcome = match denial {
        None => Ok(Allowed::default()),
        Some(message) => Err(Refusal::TooManyRequests(message)),
    };
    answer(uid, outcome)
}

fn answer(uid: &str, outcome: Outcome) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response(uid, outcome),
    })
}

fn decode<T: DeserializeOwned>(value: &Value, what: &str) -> Result<T, Refusal> {
    T::deserialize(value).map_err(|e| Refusal::bad_request(format!("cannot decode {what}: {e}")))
}

/// What an allowed request gets back.
#[derive(Debug, Default)]
struct Allowed {
    /// The JSONPatch, base64-encoded as the Go `[]byte` of the response.
    patch: Option<Value>,
    warnings: Vec<String>,
}

/// Why a request is refused.
#[derive(Debug)]
enum Refusal {
    /// The review or its object cannot be read (KubeVirt's `ToAdmissionResponseError`: 400).
    BadRequest(String),
    /// The object breaks a rule (KubeVirt's `ToAdmissionResponse`: 422 `Invalid`).
    Invalid(Vec<Cause>),
    /// The answer cannot be encoded.
    Internal(String),
    /// KubeVirt's pod-eviction answer: 429 `TooManyRequests`, which `kubectl drain` retries.
    TooManyRequests(String),
    /// A 422 with a message and no causes (KubeVirt's answer to conflicting presets).
    Unprocessable(String),
}

impl Refusal {
    fn bad_request(message: impl Into<String>) -> Self {
        Self::BadRequest(message.into())
    }

    fn one(kind: &'static str, field: &str, message: &str) -> Self {
        Self::Invalid(vec![Cause {
            kind,
            field: field.to_owned(),
            message: message.to_owned(),
        }])
    }
}

/// A `metav1.StatusCause`.
#[derive(Debug)]
struct Cause {
    kind: &'static str,
    field: String,
    message: String,
}

const FIELD_VALUE_INVALID: &str = "FieldValueInvalid";
const FIELD_VALUE_NOT_SUPPORTED: &str = "FieldValueNotSupported";
const FIELD_VALUE_FORBIDDEN: &str = "FieldValueForbidden";

impl From<FieldError> for Cause {
    fn from(e: FieldError) -> Self {
        Self {
            kind: FIELD_VALUE_INVALID,
            field: e.path,
            message: e.message,
        }
    }
}

type Outcome = Result<Allowed, Refusal>;

fn refuse_any(causes: Vec<Cause>) -> Outcome {
    if causes.is_empty() {
        Ok(Allowed::default())
    } else {
        Err(Refusal::Invalid(causes))
    }
}

fn response(uid: &str, outcome: Outcome) -> Value {
    let refusal = match outcome {
        Ok(allowed) => return allowed_response(uid, allowed),
        Err(refusal) => refusal,
    };
    let status = match refusal {
        Refusal::BadRequest(message) => {
            json!({"status": "Failure", "code": 400, "reason": "BadRequest", "message": message})
        }
        Refusal::Internal(message) => {
            json!({"status": "Failure", "code": 500, "reason": "InternalError", "message": message})
        }
        Refusal::TooManyRequests(message) => {
            json!({"status": "Failure", "code": 429, "reason": "TooManyRequests", "message": message})
        }
        Refusal::Unprocessable(message) => {
            json!({"status": "Failure", "code": 422, "message": message})
        }
        Refusal::Invalid(mut causes) => {
            let more = causes.len().saturating_sub(MAX_CAUSES);
            causes.truncate(MAX_CAUSES);
            let mut message = causes
                .iter()
                .map(|c| {
                    if c.field.is_empty() {
                        c.message.clone()
                    } else {
                        format!("{}: {}", c.field, c.message)
                    }
                })
                .collect::<Vec<_>>()
                .join(", ");
            if more > 0 {
                let _ = write!(message, ", and {more} more validation errors");
            }
            let causes: Vec<Value> = causes
                .into_iter()
                .map(|c| {
                    let mut cause = json!({"type": c.kind, "message": c.message});
                    if !c.field.is_empty() {
                        cause["field"] = json!(c.field);
                    }
                    cause
                })
                .collect();
            json!({
                "status": "Failure",
                "code": 422,
                "reason": "Invalid",
                "message": message,
                "details": {"causes": causes},
            })
        }
    };
    json!({"uid": uid, "allowed": false, "status": status})
}

fn allowed_response(uid: &str, allowed: Allowed) -> Value {
    let mut out = json!({"uid": uid, "allowed": true});
    if let Some(patch) = allowed.patch {
        out["patchType"] = json!("JSONPatch");
        out["patch"] = patch;
    }
    if !allowed.warnings.is_empty() {
        out["warnings"] = json!(allowed.warnings);
    }
    out
}

fn decide(hook: Webhook, req: &Request, ctx: &Context) -> Outcome {
    match hook {
        Webhook::VmMutator => mutate_vm(req, ctx),
        Webhook::VmiMutator => mutate_vmi(req, ctx),
        Webhook::MigrationMutator => mutate_migration(req),
        // Served by `crate::eviction::admit`, which needs the API.
        Webhook::PodEvictionValidator => Err(Refusal::Internal(
            "the pod eviction webhook is served asynchronously".to_owned(),
        )),
        Webhook::VmiCreateValidator => validate_vmi_create(req, ctx),
        Webhook::VmiUpdateValidator => validate_vmi_update(req, ctx),
        Webhook::VmValidator => validate_vm(req, ctx),
        Webhook::ReplicaSetValidator => validate_replicaset(req, ctx),
        Webhook::PoolValidator => validate_pool(req, ctx),
        Webhook::PresetValidator => validate_preset(req),
        Webhook::MigrationCreateValidator => validate_migration_create(req, ctx),
        Webhook::MigrationUpdateValidator => validate_migration_update(req),
        Webhook::MigrationPolicyValidator => validate_migration_policy(req),
    }
}

/// The patch from `original` to `modified`. Diffing the decoded object rather than the request's
/// JSON confines the patch to what the defaults changed; it still applies to the request's
/// object, since decoding only drops empty values, which `add` operations overwrite.
fn patch_between<T: Serialize>(original: &T, modified: &T) -> Outcome {
    let encode = |o: &T| {
        serde_json::to_value(o).map_err(|e| Refusal::Internal(format!("cannot encode: {e}")))
    };
    patched(&json_patch::diff(&encode(original)?, &encode(modified)?))
}

/// Allowed with `patch`, if it changes anything.
fn patched(patch: &json_patch::Patch) -> Outcome {
    if patch.0.is_empty() {
        return Ok(Allowed::default());
    }
    let internal = |e: serde_json::Error| Refusal::Internal(format!("cannot encode patch: {e}"));
    // A Go []byte is base64 in JSON, which is ByteString's encoding.
    let bytes = serde_json::to_vec(patch).map_err(internal)?;
    Ok(Allowed {
        patch: Some(serde_json::to_value(ByteString(bytes)).map_err(internal)?),
        warnings: Vec::new(),
    })
}

fn defaults_refusal(e: &defaults::DefaultsError) -> Refusal {
    Refusal::bad_request(e.to_string())
}

fn mutate_vmi(req: &Request, ctx: &Context) -> Outcome {
    let original: VirtualMachineInstance = req.object()?;
    match req.operation {
        Operation::Create => {
            let mut vmi = original.clone();
            let applied = preset::apply_presets(&mut vmi, &ctx.presets)
                .map_err(|e| Refusal::Unprocessable(e.to_string()))?;
            for skipped in &applied.skipped {
                tracing::warn!(vmi = ?vmi.metadata.name, "VirtualMachineInstancePreset {skipped}");
            }
            defaults::apply_vmi(&mut vmi, &ctx.cluster).map_err(|e| defaults_refusal(&e))?;
            let status = vmi.status.get_or_insert_with(Default::default);
            // KubeVirt sets Pending whatever the creator wrote, and records the transition.
            status.phase = Some(VirtualMachineInstancePhase::Pending);
            status
                .phase_transition_timestamps
                .push(api::status::PhaseTransitionTimestamp {
                    phase: Some(VirtualMachineInstancePhase::Pending),
                    phase_transition_timestamp: Some(Time((ctx.now)())),
                });
            let mut allowed = patch_between(&original, &vmi)?;
            let annotated = vmi
                .metadata
                .annotations
                .iter()
                .flatten()
                .any(|(k, _)| k.contains("virtualmachinepreset"));
            if annotated {
                allowed
                    .warnings
                    .push(preset::DEPRECATION_WARNING.to_owned());
            }
            Ok(allowed)
        }
        Operation::Update => {
            // The VMI has no status subresource (as KubeVirt), so users could write its status;
            // KubeVirt silently puts back the old one unless its own components wrote it.
            let old: VirtualMachineInstance = req.old_object()?;
            if original.status == old.status || ctx.service_account(&req.username).is_some() {
                return Ok(Allowed::default());
            }
            let mut restored = req.object.clone();
            match req.old_object.as_ref().and_then(|o| o.get("status")) {
                Some(status) => restored["status"] = status.clone(),
                None => {
                    if let Some(o) = restored.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
            patched(&json_patch::diff(&req.object, &restored))
        }
    }
}

fn mutate_vm(req: &Request, ctx: &Context) -> Outcome {
    let original: VirtualMachine = req.object()?;
    // KubeVirt leaves a VM being deleted alone, not to race the deletion of its dependents.
    if original.metadata.deletion_timestamp.is_some() {
        return Ok(Allowed::default());
    }
    let mut vm = original.clone();
    // The preference's machine type and architecture go into the VM itself, ahead of the
    // defaults that would otherwise fill them (KubeVirt's instancetype mutator).
    if let (Some(preference), Some(spec)) = (
        ctx.instancetypes.preference.as_ref(),
        vm.spec.template.spec.as_mut(),
    ) {
        api::instancetype::apply_to_vm_template(preference, spec);
    }
    match req.operation {
        // Only on create: on update the VM controller may be writing the uuid itself.
        Operation::Create => {
            defaults::apply_vm_create(&mut vm, &ctx.cluster, &mut || (ctx.new_id)());
        }
        Operation::Update => defaults::apply_vm(&mut vm, &ctx.cluster),
    }
    patch_between(&original, &vm)
}

fn mutate_migration(req: &Request) -> Outcome {
    let original: VirtualMachineInstanceMigration = req.object()?;
    let mut migration = original.clone();
    let meta = &mut migration.metadata;
    // KubeVirt finds a VMI's migrations by this label (the in-flight check, its controllers).
    meta.labels.get_or_insert_with(Default::default).insert(
        MIGRATION_SELECTOR_LABEL.to_owned(),
        original.spec.vmi_name.clone().unwrap_or_default(),
    );
    // The migration controller removes it once the migration is Succeeded or Failed, so a
    // migration deleted mid-flight stays until its abort is through. KubeVirt appends it
    // whatever is there; a client that already set it does not get it twice here.
    let finalizers = meta.finalizers.get_or_insert_with(Default::default);
    if !finalizers.iter().any(|f| f == labels::MIGRATION_FINALIZER) {
        finalizers.push(labels::MIGRATION_FINALIZER.to_owned());
    }
    patch_between(&original, &migration)
}

/// The reserved labels among `labels`.
fn reserved_labels(labels: Option<&BTreeMap<String, String>>) -> BTreeMap<&str, &str> {
    labels
        .into_iter()
        .flatten()
        .filter(|(k, _)| RESERVED_VMI_LABELS.contains(&k.as_str()))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// KubeVirt's `ValidateVirtualMachineInstanceMetadata`: only KubeVirt sets reserved labels.
fn reserved_labels_on_create(
    labels: Option<&BTreeMap<String, String>>,
    field: &str,
) -> Option<Cause> {
    (!reserved_labels(labels).is_empty()).then(|| Cause {
        kind: FIELD_VALUE_NOT_SUPPORTED,
        field: field.to_owned(),
        message: "creation of the following reserved kubevirt.io/ labels on a VMI object is \
                  prohibited"
            .to_owned(),
    })
}

fn validate_vmi_create(req: &Request, ctx: &Context) -> Outcome {
    let vmi: VirtualMachineInstance = req.object()?;
    let mut causes: Vec<Cause> = validation::validate_vmi(&vmi, &ctx.cluster)
        .into_iter()
        .map(Cause::from)
        .collect();
    if ctx.service_account(&req.username).is_none() {
        causes.extend(reserved_labels_on_create(
            vmi.metadata.labels.as_ref(),
            "metadata.labels",
        ));
    }
    refuse_any(causes)
}

fn validate_vmi_update(req: &Request, ctx: &Context) -> Outcome {
    let new: VirtualMachineInstance = req.object()?;
    let old: VirtualMachineInstance = req.old_object()?;
    let account = ctx.service_account(&req.username);
    if ctx.node_restriction && account == Some(HANDLER_SERVICE_ACCOUNT) {
        node_restriction(req, &new, &old)?;
    }
    if new.spec != old.spec {
        // KubeVirt's components change a VMI spec only for hotplug, through virt-api's
        // subresources; nobody else may.
        if account.is_none() {
            return Err(Refusal::one(
                FIELD_VALUE_NOT_SUPPORTED,
                "spec",
                "update of VMI object is restricted",
            ));
        }
        hotplug(&new, &old, ctx.hotplug)?;
    }
    if account.is_none()
        && reserved_labels(new.metadata.labels.as_ref())
            != reserved_labels(old.metadata.labels.as_ref())
    {
        return Err(Refusal::one(
            FIELD_VALUE_NOT_SUPPORTED,
            "metadata.labels",
            "modification of the following reserved kubevirt.io/ labels on a VMI object is \
             prohibited",
        ));
    }
    Ok(Allowed::default())
}

/// KubeVirt's node restriction: a virt-handler may only update the VMIs of its node (source or
/// migration target) and may not make itself a migration target.
fn node_restriction(
    req: &Request,
    new: &VirtualMachineInstance,
    old: &VirtualMachineInstance,
) -> Result<(), Refusal> {
    let Some(node) = req.extra.get(NODE_NAME_EXTRA).and_then(|v| v.first()) else {
        return Err(Refusal::one(
            FIELD_VALUE_INVALID,
            "",
            "Node restriction failed, virt-handler service account is missing node name",
        ));
    };
    let status = old.status.as_ref();
    let source = status
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default();
    let target = status
        .and_then(|s| s.migration_state.as_ref())
        .and_then(|m| m.target_node.as_deref())
        .unwrap_or_default();
    if node != source && (target.is_empty() || node != target) {
        return Err(Refusal::one(
            FIELD_VALUE_INVALID,
            "",
            "Node restriction, virt-handler is only allowed to modify VMIs it owns",
        ));
    }
    let new_target = new
        .status
        .as_ref()
        .and_then(|s| s.migration_state.as_ref())
        .map(|m| m.target_node.as_deref().unwrap_or_default());
    if target.is_empty() && new_target.is_some_and(|t| t != target) {
        return Err(Refusal::one(
            FIELD_VALUE_INVALID,
            "status.migrationState.targetNode",
            "Node restriction, virt-handler is not allowed to set target node",
        ));
    }
    Ok(())
}

/// The spec changes KubeVirt's components may make: not the hotplug bounds fixed at start, and
/// volumes and disks only as hotplug changes them.
fn hotplug(
    new: &VirtualMachineInstance,
    old: &VirtualMachineInstance,
    gates: HotplugGates,
) -> Result<(), Refusal> {
    let max_sockets = |v: &VirtualMachineInstance| v.spec.domain.cpu.as_ref()?.max_sockets;
    if max_sockets(new) != max_sockets(old) {
        return Err(Refusal::one(
            FIELD_VALUE_INVALID,
            "spec.domain.cpu.maxSockets",
            "CPU topology maxSockets changed",
        ));
    }
    let max_guest = |v: &VirtualMachineInstance| v.spec.domain.memory.as_ref()?.max_guest.clone();
    if let (Some(new_max), Some(old_max)) = (max_guest(new), max_guest(old))
        && !api::quantity::same(&new_max, &old_max)
    {
        return Err(Refusal::one(
            FIELD_VALUE_INVALID,
            "spec.domain.memory.maxGuest",
            "Memory maxGuest changed",
        ));
    }
    storage::admit_hotplug(new, old, gates.declarative)
}

fn validate_vm(req: &Request, ctx: &Context) -> Outcome {
    let vm: VirtualMachine = req.object()?;
    if vm.metadata.deletion_timestamp.is_some() {
        return Ok(Allowed::default());
    }
    // Validated with its instance type and preference applied and defaulted, as the VMIs it
    // creates will be (KubeVirt's VM admitter); none of it is persisted.
    let found = &ctx.instancetypes;
    let (it, pref) = (found.instancetype.as_ref(), found.preference.as_ref());
    if let Some(e) = api::instancetype::check_spread(it, pref) {
        return Err(Refusal::Invalid(vec![Cause::from(e)]));
    }
    let mut defaulted = vm.clone();
    if let Some(spec) = &mut defaulted.spec.template.spec {
        if it.is_some() || pref.is_some() {
            let meta = defaulted.spec.template.metadata.get_or_insert_default();
            found
                .expansion()
                .apply("spec.template.spec", spec, meta)
                .map_err(|e| Refusal::Invalid(e.into_iter().map(Cause::from).collect()))?;
        }
        defaults::apply(spec, &ctx.cluster).map_err(|e| defaults_refusal(&e))?;
        if let Some(e) = api::instancetype::check_requirements(it, pref, spec) {
            return Err(Refusal::Invalid(vec![Cause::from(e)]));
        }
    }
    let mut causes: Vec<Cause> = validation::validate_vm(&defaulted, &ctx.cluster)
        .into_iter()
        .map(Cause::from)
        .collect();
    if ctx.service_account(&req.username).is_none() {
        let template_labels = vm
            .spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref());
        causes.extend(reserved_labels_on_create(
            template_labels,
            "spec.template.metadata.labels",
        ));
    }
    let mut allowed = refuse_any(causes)?;
    if vm.spec.running.is_some() {
        allowed
            .warnings
            .push("spec.running is deprecated, please use spec.runStrategy instead.".to_owned());
    }
    Ok(allowed)
}

fn validate_replicaset(req: &Request, ctx: &Context) -> Outcome {
    let mut rs: VirtualMachineInstanceReplicaSet = req.object()?;
    if let Some(spec) = &mut rs.spec.template.spec {
        defaults::apply(spec, &ctx.cluster).map_err(|e| defaults_refusal(&e))?;
    }
    refuse_any(
        validation::validate_replicaset(&rs, &ctx.cluster)
            .into_iter()
            .map(Cause::from)
            .collect(),
    )
}

fn validate_pool(req: &Request, ctx: &Context) -> Outcome {
    let pool: VirtualMachinePool = req.object()?;
    let old: Option<VirtualMachinePool> = match req.operation {
        Operation::Update => Some(req.old_object()?),
        Operation::Create => None,
    };
    // Its VMs' templates are validated defaulted, as their VMIs will be.
    let mut defaulted = pool.clone();
    if let Some(spec) = &mut defaulted.spec.virtual_machine_template.spec.template.spec {
        defaults::apply(spec, &ctx.cluster).map_err(|e| defaults_refusal(&e))?;
    }
    refuse_any(
        api::pool::validate_pool(&defaulted, old.as_ref(), &ctx.cluster)
            .into_iter()
            .map(Cause::from)
            .collect(),
    )
}

fn validate_preset(req: &Request) -> Outcome {
    let p: VirtualMachineInstancePreset = req.object()?;
    refuse_any(
        preset::validate_preset(&p)
            .into_iter()
            .map(Cause::from)
            .collect(),
    )
}

fn validate_migration_create(req: &Request, ctx: &Context) -> Outcome {
    let migration: VirtualMachineInstanceMigration = req.object()?;
    let mut causes: Vec<Cause> = validation::validate_migration(&migration)
        .into_iter()
        .map(Cause::from)
        .collect();
    // The priority orders virt-controller's own migration queue (evacuations before
    // user requests); users must not jump it.
    if migration.spec.priority.is_some()
        && ctx.service_account(&req.username) != Some(CONTROLLER_SERVICE_ACCOUNT)
    {
        causes.push(Cause {
            kind: FIELD_VALUE_FORBIDDEN,
            field: "spec.priority".to_owned(),
            message: "Migration priority queue, only virt-controller is allowed to set priority \
                      field"
                .to_owned(),
        });
    }
    refuse_any(causes)
}

fn validate_migration_policy(req: &Request) -> Outcome {
    let policy: MigrationPolicy = req.object()?;
    refuse_any(
        api::migrationpolicy::validate(&policy)
            .into_iter()
            .map(Cause::from)
            .collect(),
    )
}

fn validate_migration_update(req: &Request) -> Outcome {
    let new: VirtualMachineInstanceMigration = req.object()?;
    let old: VirtualMachineInstanceMigration = req.old_object()?;
    if new.spec != old.spec {
        return Err(Refusal::one(
            FIELD_VALUE_NOT_SUPPORTED,
            "spec",
            "update of Migration object's spec is restricted",
        ));
    }
    let finished = new
        .status
        .as_ref()
        .and_then(|s| s.phase.as_ref())
        .is_some_and(|p| {
            matches!(
                p,
                VirtualMachineInstanceMigrationPhase::Succeeded
                    | VirtualMachineInstanceMigrationPhase::Failed
            )
        });
    let selector = |m: &VirtualMachineInstanceMigration| {
        m.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(MIGRATION_SELECTOR_LABEL))
            .cloned()
    };
    // The in-flight check of new migrations finds this one by the label.
    if let (false, Some(old_label)) = (finished, selector(&old)) {
        let message = match selector(&new) {
            None => "selector label can't be removed from an in-flight migration",
            Some(l) if l != old_label => {
                "selector label can't be modified on an in-flight migration"
            }
            Some(_) => return Ok(Allowed::default()),
        };
        return Err(Refusal::one(
            FIELD_VALUE_NOT_SUPPORTED,
            "metadata.labels",
            message,
        ));
    }
    Ok(Allowed::default())
}

mod storage;
#[cfg(test)]
mod tests;
