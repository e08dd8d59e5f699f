//! Persistent volumes for localcluster: a dynamic provisioner, as kind's `standard` class
//! (rancher's local-path-provisioner) gives a test cluster, but ours. It runs inside `up` as a
//! client of its own (`localcluster:hostpath-provisioner`, held by RBAC to what it needs),
//! applies the default StorageClass `local`, makes a `hostPath` PersistentVolume for every claim
//! of a class whose provisioner is ours, and deletes released volumes with their data.
//!
//! The volumes live in `<state dir>/volumes/pvc-<claim uid>`, outside every node's root, so
//! all nodes see the same data, as with networked storage: every access mode works on every
//! node. kube-controller-manager's PV controller does the binding, as it does for any external
//! provisioner: it annotates our claims with `volume.kubernetes.io/storage-provisioner`, and
//! binds a claim to the volume whose `claimRef` names it.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{
    HostPathVolumeSource, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeSpec,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Client, Resource as _};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::controlplane::{self, ControlPlane, ControlPlaneError, error_chain};

/// The default StorageClass `up` makes.
pub const STORAGE_CLASS: &str = "local";
/// The provisioner of [`STORAGE_CLASS`]: a class naming it gets volumes from us.
pub const PROVISIONER: &str = "localcluster.kubevirt-rs.io/hostpath";
/// The provisioner's user (its client certificate's CN), and the name of its ClusterRole and
/// ClusterRoleBinding.
pub const PROVISIONER_USER: &str = "localcluster:hostpath-provisioner";
/// The field manager of what the provisioner applies.
const FIELD_MANAGER: &str = "localcluster";

/// Set by kube-controller-manager's PV controller on a claim whose class has an external
/// provisioner: the provisioner that is to make its volume (the beta name is the older one,
/// still set beside it).
const ANN_STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
const ANN_BETA_STORAGE_PROVISIONER: &str = "volume.beta.kubernetes.io/storage-provisioner";
/// Who made a volume; the PV controller leaves the deletion of a volume whose provisioner is
/// not one of its own plugins to that provisioner.
const ANN_PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
const ANN_DEFAULT_CLASS: &str = "storageclass.kubernetes.io/is-default-class";

/// How long RBAC may take to grant the provisioner its new ClusterRoleBinding (kube-apiserver's
/// authorizer reads bindings from a cache).
const RBAC_TIMEOUT: Duration = Duration::from_secs(30);
/// When a failed reconcile is tried again.
const RETRY: Duration = Duration::from_secs(2);

/// Why the provisioner could not start or do its work.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("a client of kube-apiserver")]
    Client(#[from] ControlPlaneError),
    #[error("{what}")]
    Api { what: String, source: kube::Error },
    #[error("{path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("the storage class {class:?} of the claim does not exist")]
    NoClass { class: String },
    #[error("the volume provisioner stopped")]
    Stopped,
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> StorageError {
    let what = what.into();
    move |source| StorageError::Api { what, source }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StorageError + '_ {
    move |source| StorageError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where the volumes of the cluster whose state is in `state_dir` live.
pub fn volumes_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("volumes")
}

/// The StorageClass `local`, as applied.
fn storage_class() -> serde_json::Value {
    json!({
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {ANN_DEFAULT_CLASS: "true"},
        },
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    })
}

/// What the provisioner may do, and nothing more: watch claims, make and delete volumes, read
/// classes and apply its own, and tell users through Events.
fn cluster_role() -> serde_json::Value {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": PROVISIONER_USER},
        "rules": [
            {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["list", "watch"]},
            {"apiGroups": [""], "resources": ["persistentvolumes"],
             "verbs": ["list", "watch", "create", "delete"]},
            // Server-side apply of an object that does not exist is a patch that creates it,
            // which kube-apiserver authorizes as both.
            {"apiGroups": ["storage.k8s.io"], "resources": ["storageclasses"],
             "verbs": ["get", "create", "patch"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    })
}

fn cluster_role_binding() -> serde_json::Value {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": PROVISIONER_USER},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": PROVISIONER_USER},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": PROVISIONER_USER}],
    })
}

/// The name of the volume made for a claim (external-provisioner's default, `pvc-<uid>`).
fn volume_name(claim: &PersistentVolumeClaim) -> String {
    format!("pvc-{}", claim.metadata.uid.as_deref().unwrap_or_default())
}

/// Whether the claim waits for a volume from us: unbound, not being deleted, and annotated by
/// the PV controller as ours.
fn wants_volume(claim: &PersistentVolumeClaim) -> bool {
    let annotations = claim.metadata.annotations.as_ref();
    let provisioner = annotations.and_then(|a| {
        a.get(ANN_STORAGE_PROVISIONER)
            .or_else(|| a.get(ANN_BETA_STORAGE_PROVISIONER))
    });
    let bound = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .is_some_and(|v| !v.is_empty());
    provisioner.map(String::as_str) == Some(PROVISIONER)
        && !bound
        && claim.metadata.deletion_timestamp.is_none()
}

/// The volume for `claim` of `class`, its data in `<volumes>/<volume name>`; or why we cannot
/// make it, for the user (a `ProvisioningFailed` Event on the claim).
fn volume_for(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    volumes: &Path,
) -> Result<PersistentVolume, String> {
    let spec = claim.spec.clone().unwrap_or_default();
    if spec.volume_mode.as_deref() == Some("Block") {
        return Err(format!(
            "block volumes are not supported by localcluster's provisioner {PROVISIONER}: it makes directories (volumeMode Filesystem)"
        ));
    }
    if spec.selector.is_some() {
        return Err("claims with a selector are not supported by localcluster's provisioner: it makes a new volume for every claim".into());
    }
    if spec.data_source.is_some() || spec.data_source_ref.is_some() {
        return Err("dataSource is not supported by localcluster's provisioner: it makes empty volumes (no clones, no snapshots)".into());
    }
    let unsupported: Vec<&str> = [
        (
            "parameters",
            class.parameters.as_ref().is_some_and(|p| !p.is_empty()),
        ),
        (
            "mountOptions",
            class.mount_options.as_ref().is_some_and(|m| !m.is_empty()),
        ),
        (
            "allowedTopologies",
            class
                .allowed_topologies
                .as_ref()
                .is_some_and(|t| !t.is_empty()),
        ),
    ]
    .into_iter()
    .filter_map(|(field, set)| set.then_some(field))
    .collect();
    if !unsupported.is_empty() {
        return Err(format!(
            "storage class {:?} sets {}, which localcluster's provisioner does not support",
            class.metadata.name.as_deref().unwrap_or_default(),
            unsupported.join(", ")
        ));
    }
    let Some(size) = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
    else {
        return Err("the claim requests no storage (spec.resources.requests.storage)".into());
    };
    let name = volume_name(claim);
    Ok(PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            annotations: Some(BTreeMap::from([(
                ANN_PROVISIONED_BY.to_owned(),
                PROVISIONER.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeSpec {
            access_modes: spec.access_modes,
            capacity: Some(BTreeMap::from([("storage".to_owned(), size.clone())])),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("PersistentVolumeClaim".into()),
                namespace: claim.metadata.namespace.clone(),
                name: claim.metadata.name.clone(),
                uid: claim.metadata.uid.clone(),
                ..ObjectReference::default()
            }),
            host_path: Some(HostPathVolumeSource {
                path: volumes.join(&name).display().to_string(),
                // Made before the volume: a missing directory is an error, never a new empty
                // one in its place.
                type_: Some("Directory".into()),
            }),
            persistent_volume_reclaim_policy: Some(
                class
                    .reclaim_policy
                    .clone()
                    .unwrap_or_else(|| "Delete".into()),
            ),
            storage_class_name: class.metadata.name.clone(),
            volume_mode: Some("Filesystem".into()),
            ..PersistentVolumeSpec::default()
        }),
        status: None,
    })
}

/// The directory to remove before deleting `volume`: one of ours, released (its claim is
/// gone), whose policy is Delete. Only a directory we made, `<volumes>/<volume name>`, is ever
/// removed, whatever path the volume names.
fn released_directory(volume: &PersistentVolume, volumes: &Path) -> Option<PathBuf> {
    let ours = volume
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANN_PROVISIONED_BY))
        .is_some_and(|p| p == PROVISIONER);
    let spec = volume.spec.as_ref()?;
    let released = volume.status.as_ref()?.phase.as_deref() == Some("Released");
    let delete = spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete");
    let dir = volumes.join(volume.metadata.name.as_deref()?);
    let made_by_us = spec
        .host_path
        .as_ref()
        .is_some_and(|h| Path::new(&h.path) == dir);
    (ours && released && delete && made_by_us).then_some(dir)
}

struct Context {
    client: Client,
    volumes: PathBuf,
    recorder: Recorder,
}

/// Makes the claim's volume (nothing when it exists), or tells the user why not.
async fn reconcile_claim(
    claim: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
) -> Result<Action, StorageError> {
    if !wants_volume(&claim) {
        return Ok(Action::await_change());
    }
    let class_name = claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .unwrap_or_default();
    let class = Api::<StorageClass>::all(ctx.client.clone())
        .get_opt(&class_name)
        .await
        .map_err(api_err(format!("reading storage class {class_name:?}")))?
        .ok_or(StorageError::NoClass { class: class_name })?;
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let claim_name = claim.metadata.name.clone().unwrap_or_default();
    let volume = match volume_for(&claim, &class, &ctx.volumes) {
        Ok(v) => v,
        Err(refusal) => {
            tracing::info!(claim = %format!("{namespace}/{claim_name}"), %refusal, "not provisioning");
            publish(
                &ctx,
                &claim,
                EventType::Warning,
                "ProvisioningFailed",
                refusal,
            )
            .await;
            return Ok(Action::await_change());
        }
    };
    let name = volume.metadata.name.clone().unwrap_or_default();
    let dir = ctx.volumes.join(&name);
    make_directory(&dir)?;
    match Api::<PersistentVolume>::all(ctx.client.clone())
        .create(&PostParams::default(), &volume)
        .await
    {
        Ok(_) => {
            tracing::info!(claim = %format!("{namespace}/{claim_name}"), volume = %name, dir = %dir.display(), "provisioned");
            let note = format!("Successfully provisioned volume {name}");
            publish(
                &ctx,
                &claim,
                EventType::Normal,
                "ProvisioningSucceeded",
                note,
            )
            .await;
        }
        // Made before; the PV controller has not bound the claim yet.
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(api_err(format!("creating persistent volume {name}"))(e)),
    }
    Ok(Action::await_change())
}

/// A directory any user a pod runs as may write to, as rancher's local-path-provisioner makes
/// them: a hostPath volume's ownership is never changed for the pod (no `fsGroup`).
fn make_directory(dir: &Path) -> Result<(), StorageError> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).map_err(io_err(dir))
}

/// Removes a released volume of ours: its data first, so nothing is left if the deletion of the
/// object succeeds, and a failure before it is tried again.
async fn reconcile_volume(
    volume: Arc<PersistentVolume>,
    ctx: Arc<Context>,
) -> Result<Action, StorageError> {
    let Some(dir) = released_directory(&volume, &ctx.volumes) else {
        return Ok(Action::await_change());
    };
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&dir)(e)),
    }
    let name = volume.metadata.name.clone().unwrap_or_default();
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: volume.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match Api::<PersistentVolume>::all(ctx.client.clone())
        .delete(&name, &params)
        .await
    {
        Ok(_) => tracing::info!(volume = %name, dir = %dir.display(), "released volume deleted"),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
        Err(e) => return Err(api_err(format!("deleting persistent volume {name}"))(e)),
    }
    Ok(Action::await_change())
}

async fn publish(
    ctx: &Context,
    claim: &PersistentVolumeClaim,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: "Provisioning".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &claim.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "publishing an event on a claim");
    }
}

fn retry<K>(_: Arc<K>, error: &StorageError, _: Arc<Context>) -> Action {
    tracing::warn!(error = %error_chain(error), "volume provisioner; trying again");
    Action::requeue(RETRY)
}

/// The running provisioner; dropping it stops it.
#[derive(Debug)]
pub struct Provisioner {
    task: JoinHandle<()>,
}

impl Drop for Provisioner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Provisioner {
    /// Grants the provisioner its ClusterRole (as the administrator), gives it a client
    /// certificate of its own, applies the StorageClass `local` with it, removes volume
    /// directories no PersistentVolume names (a previous cluster's: every `up` is a new one),
    /// then starts reconciling claims and volumes.
    pub async fn start(plane: &ControlPlane) -> Result<Self, StorageError> {
        let admin = plane.client().await?;
        let apply = PatchParams::apply(FIELD_MANAGER).force();
        Api::<ClusterRole>::all(admin.clone())
            .patch(PROVISIONER_USER, &apply, &Patch::Apply(cluster_role()))
            .await
            .map_err(api_err("applying the provisioner's ClusterRole"))?;
        Api::<ClusterRoleBinding>::all(admin)
            .patch(
                PROVISIONER_USER,
                &apply,
                &Patch::Apply(cluster_role_binding()),
            )
            .await
            .map_err(api_err("applying the provisioner's ClusterRoleBinding"))?;
        let kubeconfig = plane.user_kubeconfig("hostpath-provisioner", PROVISIONER_USER)?;
        let client = controlplane::client_for(&kubeconfig).await?;
        let classes = Api::<StorageClass>::all(client.clone());
        let started = Instant::now();
        loop {
            match classes
                .patch(STORAGE_CLASS, &apply, &Patch::Apply(storage_class()))
                .await
            {
                Ok(_) => break,
                Err(kube::Error::Api(e)) if e.code == 403 && started.elapsed() < RBAC_TIMEOUT => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => {
                    return Err(api_err(format!(
                        "applying the storage class {STORAGE_CLASS:?}"
                    ))(e));
                }
            }
        }
        let volumes = volumes_dir(plane.dir());
        std::fs::create_dir_all(&volumes).map_err(io_err(&volumes))?;
        let existing = Api::<PersistentVolume>::all(client.clone())
            .list(&ListParams::default())
            .await
            .map_err(api_err("listing persistent volumes"))?;
        remove_orphans(
            &volumes,
            &existing
                .items
                .iter()
                .filter_map(|v| v.metadata.name.clone())
                .collect(),
        )?;
        let ctx = Arc::new(Context {
            recorder: Recorder::new(
                client.clone(),
                Reporter {
                    controller: PROVISIONER.into(),
                    instance: None,
                },
            ),
            client: client.clone(),
            volumes,
        });
        let claims = Controller::new(
            Api::<PersistentVolumeClaim>::all(client.clone()),
            watcher::Config::default(),
        )
        .run(reconcile_claim, retry, ctx.clone())
        .for_each(log_watch_error);
        let released = Controller::new(
            Api::<PersistentVolume>::all(client),
            watcher::Config::default(),
        )
        .run(reconcile_volume, retry, ctx)
        .for_each(log_watch_error);
        let task = tokio::spawn(async move {
            futures::join!(claims, released);
        });
        tracing::info!(
            class = STORAGE_CLASS,
            provisioner = PROVISIONER,
            "volume provisioner started"
        );
        Ok(Self { task })
    }

    /// An error if it has stopped (it never should: `up` then stops the cluster).
    pub fn check(&self) -> Result<(), StorageError> {
        if self.task.is_finished() {
            Err(StorageError::Stopped)
        } else {
            Ok(())
        }
    }
}

/// The watches' failures (kube-runtime retries them with backoff). Reconcile failures are
/// logged by [`retry`], and an object gone before its turn came needs nothing.
async fn log_watch_error<T, E>(result: Result<T, controller::Error<StorageError, E>>)
where
    E: std::error::Error,
{
    if let Err(e @ (controller::Error::QueueError(_) | controller::Error::RunnerError(_))) = result
    {
        tracing::warn!(error = %error_chain(&e), "volume provisioner watch");
    }
}

/// Removes every directory in `volumes` that no volume in `names` is made of.
fn remove_orphans(volumes: &Path, names: &HashSet<String>) -> Result<(), StorageError> {
    for entry in std::fs::read_dir(volumes).map_err(io_err(volumes))? {
        let path = entry.map_err(io_err(volumes))?.path();
        let named = path
            .file_name()
            .is_some_and(|n| names.contains(n.to_string_lossy().as_ref()));
        if !named {
            tracing::info!(dir = %path.display(), "removing the data of a volume that no longer exists");
            std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
        }
    }
    Ok(())
}

/// A loop device over a sparse file: a raw disk of this node, for a `local` PersistentVolume
/// with `volumeMode: Block` ([`local_block_volume`]; the provisioner makes no block volumes).
/// Detached when dropped (the kernel defers that until its last user closes it).
#[derive(Debug)]
pub struct LoopDevice {
    pub path: String,
    backing: tempfile::NamedTempFile,
}

impl LoopDevice {
    /// A new device of `bytes`, reading zeroes.
    pub fn new(bytes: u64) -> std::io::Result<Self> {
        let backing = tempfile::NamedTempFile::new()?;
        backing.as_file().set_len(bytes)?;
        let out = std::process::Command::new("losetup")
            .args(["--find", "--show"])
            .arg(backing.path())
            .output()?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "losetup --find --show {}: {}",
                backing.path().display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(Self {
            path: String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            backing,
        })
    }

    /// The file behind the device, on the host.
    pub fn backing_file(&self) -> &Path {
        self.backing.path()
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["--detach", &self.path])
            .status();
    }
}

/// A `local` PersistentVolume with `volumeMode: Block` on `device` of node `node`, of class
/// `class` (one no provisioner serves), kept when its claim goes (`Retain`).
pub fn local_block_volume(
    name: &str,
    class: &str,
    capacity: &str,
    device: &str,
    node: &str,
) -> PersistentVolume {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": capacity},
            "accessModes": ["ReadWriteOnce"],
            "volumeMode": "Block",
            "storageClassName": class,
            "persistentVolumeReclaimPolicy": "Retain",
            "local": {"path": device},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}},
        },
    }))
    .expect("a PersistentVolume")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(spec: &serde_json::Value, annotated: bool) -> PersistentVolumeClaim {
        let annotations = if annotated {
            json!({ANN_STORAGE_PROVISIONER: PROVISIONER})
        } else {
            json!({})
        };
        serde_json::from_value(json!({
            "metadata": {"name": "data", "namespace": "ns", "uid": "1234", "annotations": annotations},
            "spec": spec,
        }))
        .unwrap()
    }

    fn class() -> StorageClass {
        serde_json::from_value(storage_class()).unwrap()
    }

    fn filesystem() -> serde_json::Value {
        json!({"accessModes": ["ReadWriteMany"], "storageClassName": "local",
               "resources": {"requests": {"storage": "2Gi"}}})
    }

    #[test]
    fn the_volume_of_a_claim_is_a_directory_of_its_own_bound_to_it() {
        let volume = volume_for(
            &claim(&filesystem(), true),
            &class(),
            Path::new("/s/volumes"),
        )
        .expect("a volume");
        assert_eq!(
            serde_json::to_value(&volume).unwrap(),
            json!({
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": "pvc-1234",
                             "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER}},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "capacity": {"storage": "2Gi"},
                    "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                 "namespace": "ns", "name": "data", "uid": "1234"},
                    "hostPath": {"path": "/s/volumes/pvc-1234", "type": "Directory"},
                    "persistentVolumeReclaimPolicy": "Delete",
                    "storageClassName": "local",
                    "volumeMode": "Filesystem",
                },
            })
        );
        let mut retained = class();
        retained.reclaim_policy = Some("Retain".into());
        let volume = volume_for(&claim(&filesystem(), true), &retained, Path::new("/v")).unwrap();
        assert_eq!(
            volume.spec.unwrap().persistent_volume_reclaim_policy,
            Some("Retain".into())
        );
    }

    #[test]
    fn what_the_provisioner_cannot_make_is_refused_by_name() {
        let refused = |spec: serde_json::Value, class: &StorageClass| {
            volume_for(&claim(&spec, true), class, Path::new("/v")).unwrap_err()
        };
        let mut block = filesystem();
        block["volumeMode"] = json!("Block");
        assert!(refused(block, &class()).contains("block volumes are not supported"));
        let mut selector = filesystem();
        selector["selector"] = json!({"matchLabels": {"a": "b"}});
        assert!(refused(selector, &class()).contains("selector"));
        let mut clone = filesystem();
        clone["dataSource"] = json!({"kind": "PersistentVolumeClaim", "name": "other"});
        assert!(refused(clone, &class()).contains("dataSource"));
        let mut with_parameters = class();
        with_parameters.parameters = Some(BTreeMap::from([("type".into(), "ssd".into())]));
        with_parameters.mount_options = Some(vec!["ro".into()]);
        assert_eq!(
            refused(filesystem(), &with_parameters),
            "storage class \"local\" sets parameters, mountOptions, which localcluster's provisioner does not support"
        );
    }

    #[test]
    fn only_unbound_claims_annotated_for_us_want_a_volume() {
        assert!(wants_volume(&claim(&filesystem(), true)));
        assert!(!wants_volume(&claim(&filesystem(), false)));
        let mut bound = filesystem();
        bound["volumeName"] = json!("pvc-1234");
        assert!(!wants_volume(&claim(&bound, true)));
        let mut other = claim(&filesystem(), false);
        other.metadata.annotations = Some(BTreeMap::from([(
            ANN_BETA_STORAGE_PROVISIONER.into(),
            "example.com/nfs".into(),
        )]));
        assert!(!wants_volume(&other));
    }

    #[test]
    fn only_our_released_volumes_with_delete_lose_their_directory() {
        let dir = Path::new("/s/volumes");
        let mut volume = volume_for(&claim(&filesystem(), true), &class(), dir).unwrap();
        assert_eq!(released_directory(&volume, dir), None, "no phase yet");
        volume.status = Some(k8s_openapi::api::core::v1::PersistentVolumeStatus {
            phase: Some("Released".into()),
            ..Default::default()
        });
        assert_eq!(
            released_directory(&volume, dir),
            Some(PathBuf::from("/s/volumes/pvc-1234"))
        );
        let mut elsewhere = volume.clone();
        if let Some(h) = elsewhere.spec.as_mut().and_then(|s| s.host_path.as_mut()) {
            h.path = "/".into();
        }
        assert_eq!(
            released_directory(&elsewhere, dir),
            None,
            "not our directory"
        );
        let mut retained = volume.clone();
        if let Some(s) = retained.spec.as_mut() {
            s.persistent_volume_reclaim_policy = Some("Retain".into());
        }
        assert_eq!(released_directory(&retained, dir), None, "Retain");
        let mut foreign = volume;
        foreign.metadata.annotations = None;
        assert_eq!(
            released_directory(&foreign, dir),
            None,
            "not provisioned by us"
        );
    }

    #[test]
    fn orphaned_directories_go_and_named_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["pvc-a", "pvc-b"] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
            std::fs::write(dir.path().join(name).join("f"), b"x").unwrap();
        }
        remove_orphans(dir.path(), &HashSet::from(["pvc-a".to_owned()])).unwrap();
        assert!(dir.path().join("pvc-a/f").exists());
        assert!(!dir.path().join("pvc-b").exists());
    }
}
