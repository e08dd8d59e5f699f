//! Pod volumes on the node: each volume becomes a host directory under the pod dir (or the
//! hostPath itself) that containers get bind-mounted at their `mountPath`s.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, HostPathVolumeSource, KeyToPath, PersistentVolume,
    PersistentVolumeClaim, PersistentVolumeClaimVolumeSource, Pod, Secret, ServiceAccount, Volume,
    VolumeProjection,
};
use kube::api::PostParams;
use kube::{Api, Client};

use super::KubeletError;

/// Where a volume lives on the node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostVolume {
    pub path: PathBuf,
    /// Every mount of it is read-only, whatever the mount says (a claim's `readOnly`).
    pub read_only: bool,
    /// `path` is a block device (a claim bound to a `volumeMode: Block` volume): containers
    /// get it through `volumeDevices`, never `volumeMounts`.
    #[serde(default)]
    pub block: bool,
}

impl HostVolume {
    fn writable(path: PathBuf) -> Self {
        Self {
            path,
            read_only: false,
            block: false,
        }
    }
}

/// Host paths that belong to a node rather than the machine, so each simulated node has its
/// own: a hostPath under one of these prefixes is re-rooted in the node's root directory.
pub const NODE_LOCAL_PREFIXES: &[&str] = &[
    "/var/lib/kubelet",
    "/var/lib/kubevirt",
    "/var/run/kubevirt",
    "/run/kubevirt",
    "/var/log/pods",
    "/var/log/kubevirt",
];

/// The node-side path of a pod's hostPath: re-rooted when node-local, else the host's own.
pub fn host_path(node_root: &Path, path: &str) -> PathBuf {
    if NODE_LOCAL_PREFIXES.iter().any(|p| path.starts_with(p)) {
        node_root.join(path.trim_start_matches('/'))
    } else {
        PathBuf::from(path)
    }
}

/// The pod dir path of a plugin-managed volume (`kubernetes.io~empty-dir` ...).
pub fn plugin_dir(pod_dir: &Path, plugin: &str, name: &str) -> PathBuf {
    pod_dir
        .join("volumes")
        .join(format!("kubernetes.io~{plugin}"))
        .join(name)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> KubeletError + '_ {
    move |source| KubeletError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Files to write for a configMap/secret projection: every key, or only `items`.
pub fn projected_files(
    data: &BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    what: &str,
) -> Result<Vec<(String, Vec<u8>)>, KubeletError> {
    match items {
        None => Ok(data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
        Some(items) => items
            .iter()
            .map(|i| {
                data.get(&i.key)
                    .map(|v| (i.path.clone(), v.clone()))
                    .ok_or_else(|| KubeletError::Volume {
                        volume: what.into(),
                        message: format!("key {:?} not found", i.key),
                    })
            })
            .collect(),
    }
}

/// Writes `files` under `dir`: each one that is new or changed through a temporary file and a
/// rename, so a reader sees the old content or the new, never half of it; files of an earlier
/// projection that `files` no longer has are removed (the kubelet's atomic writer does both).
fn write_files(dir: &Path, files: &[(String, Vec<u8>)]) -> Result<(), KubeletError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut wanted = std::collections::HashSet::new();
    for (rel, content) in files {
        if rel.split('/').any(|c| c == "..") || rel.starts_with('/') {
            return Err(KubeletError::Volume {
                volume: dir.display().to_string(),
                message: format!("path {rel:?} must be relative and must not contain '..'"),
            });
        }
        let path = dir.join(rel);
        wanted.insert(path.clone());
        if std::fs::read(&path).is_ok_and(|old| old == *content) {
            continue;
        }
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let temp = path.with_file_name(format!("..{name}.tmp"));
        std::fs::write(&temp, content).map_err(io(&temp))?;
        std::fs::rename(&temp, &path).map_err(io(&path))?;
    }
    remove_unwanted(dir, &wanted)
}

fn remove_unwanted(
    dir: &Path,
    wanted: &std::collections::HashSet<PathBuf>,
) -> Result<(), KubeletError> {
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.is_dir() {
            remove_unwanted(&path, wanted)?;
        } else if !wanted.contains(&path) {
            std::fs::remove_file(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

/// Projects a configMap or secret volume again from the object as it is now, as the kubelet
/// does on each pod sync (KubeVirt's components see rotated certificates this way, without a
/// restart). Other volumes are left as they are: a projected volume's service account token
/// is not to be requested again.
pub async fn refresh(
    client: &Client,
    pod: &Pod,
    pod_dir: &Path,
    volume: &Volume,
) -> Result<(), KubeletError> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = volume.name.as_str();
    if let Some(cm) = &volume.config_map {
        let path = plugin_dir(pod_dir, "configmap", name);
        let data = config_map_data(client, &namespace, &cm.name, cm.optional, name).await?;
        write_files(&path, &projected_files(&data, cm.items.as_deref(), name)?)?;
    } else if let Some(sec) = &volume.secret {
        let path = plugin_dir(pod_dir, "secret", name);
        let secret_name = sec.secret_name.clone().unwrap_or_default();
        let data = secret_data(client, &namespace, &secret_name, sec.optional, name).await?;
        write_files(&path, &projected_files(&data, sec.items.as_deref(), name)?)?;
    }
    Ok(())
}

/// The downwardAPI value of a `fieldRef` path.
pub fn field_value(pod: &Pod, field: &str) -> Option<String> {
    let labels_or_annotations = |m: Option<&BTreeMap<String, String>>| {
        m.map(|m| {
            m.iter().fold(String::new(), |mut out, (k, v)| {
                use std::fmt::Write as _;
                let _ = writeln!(out, "{k}=\"{v}\"");
                out
            })
        })
        .unwrap_or_default()
    };
    let meta = &pod.metadata;
    Some(match field {
        "metadata.name" => meta.name.clone()?,
        "metadata.namespace" => meta.namespace.clone()?,
        "metadata.uid" => meta.uid.clone()?,
        "metadata.labels" => labels_or_annotations(meta.labels.as_ref()),
        "metadata.annotations" => labels_or_annotations(meta.annotations.as_ref()),
        "spec.nodeName" => pod.spec.as_ref()?.node_name.clone()?,
        "spec.serviceAccountName" => pod.spec.as_ref()?.service_account_name.clone()?,
        "status.podIP" => pod.status.as_ref()?.pod_ip.clone()?,
        "status.hostIP" => pod.status.as_ref()?.host_ip.clone()?,
        other => {
            let key = other
                .strip_prefix("metadata.labels['")
                .or_else(|| other.strip_prefix("metadata.annotations['"))?
                .strip_suffix("']")?;
            let map = if other.starts_with("metadata.labels") {
                meta.labels.as_ref()
            } else {
                meta.annotations.as_ref()
            };
            map?.get(key)?.clone()
        }
    })
}

async fn config_map_data(
    client: &Client,
    namespace: &str,
    config_map: &str,
    optional: Option<bool>,
    volume: &str,
) -> Result<BTreeMap<String, Vec<u8>>, KubeletError> {
    let found = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .get_opt(config_map)
        .await
        .map_err(|source| KubeletError::Api {
            what: format!("configmap {namespace}/{config_map}"),
            source,
        })?;
    match found {
        Some(c) => Ok(c
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.into_bytes()))
            .chain(
                c.binary_data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.0)),
            )
            .collect()),
        None if optional.unwrap_or(false) => Ok(BTreeMap::new()),
        None => Err(KubeletError::Volume {
            volume: volume.into(),
            message: format!("configmap \"{config_map}\" not found"),
        }),
    }
}

async fn secret_data(
    client: &Client,
    namespace: &str,
    secret: &str,
    optional: Option<bool>,
    volume: &str,
) -> Result<BTreeMap<String, Vec<u8>>, KubeletError> {
    let found = Api::<Secret>::namespaced(client.clone(), namespace)
        .get_opt(secret)
        .await
        .map_err(|source| KubeletError::Api {
            what: format!("secret {namespace}/{secret}"),
            source,
        })?;
    match found {
        Some(s) => Ok(s
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .chain(
                s.string_data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes())),
            )
            .collect()),
        None if optional.unwrap_or(false) => Ok(BTreeMap::new()),
        None => Err(KubeletError::Volume {
            volume: volume.into(),
            message: format!("secret \"{secret}\" not found"),
        }),
    }
}

/// The files of downwardAPI `items` (fieldRef only).
fn downward_files(
    pod: &Pod,
    items: Option<&[DownwardAPIVolumeFile]>,
    volume: &str,
) -> Result<Vec<(String, Vec<u8>)>, KubeletError> {
    let mut files = Vec::new();
    for item in items.into_iter().flatten() {
        let Some(field) = &item.field_ref else {
            return Err(KubeletError::Volume {
                volume: volume.into(),
                message: format!(
                    "item {:?}: only fieldRef is supported by the process kubelet",
                    item.path
                ),
            });
        };
        let value = field_value(pod, &field.field_path).ok_or_else(|| KubeletError::Volume {
            volume: volume.into(),
            message: format!("unsupported fieldRef {:?}", field.field_path),
        })?;
        files.push((item.path.clone(), value.into_bytes()));
    }
    Ok(files)
}

/// The token's lifetime when the projection names none, as the API defaults it.
const DEFAULT_TOKEN_SECONDS: i64 = 3600;

/// The files of one source of a projected volume. A service account token is requested
/// through the TokenRequest API, bound to the pod (so it dies with it), as the kubelet does
/// for the `kube-api-access-*` volume kube-apiserver's ServiceAccount admission adds. It is
/// not refreshed: kube-apiserver extends such tokens to a year
/// (`--service-account-extend-token-expiration`, on by default).
async fn projection(
    client: &Client,
    pod: &Pod,
    namespace: &str,
    source: &VolumeProjection,
    volume: &str,
) -> Result<Vec<(String, Vec<u8>)>, KubeletError> {
    if let Some(cm) = &source.config_map {
        let data = config_map_data(client, namespace, &cm.name, cm.optional, volume).await?;
        return projected_files(&data, cm.items.as_deref(), volume);
    }
    if let Some(sec) = &source.secret {
        let data = secret_data(client, namespace, &sec.name, sec.optional, volume).await?;
        return projected_files(&data, sec.items.as_deref(), volume);
    }
    if let Some(dapi) = &source.downward_api {
        return downward_files(pod, dapi.items.as_deref(), volume);
    }
    if let Some(sat) = &source.service_account_token {
        let account = super::serviceaccount::account_name(pod);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: sat.audience.clone().map(|a| vec![a]),
                expiration_seconds: Some(sat.expiration_seconds.unwrap_or(DEFAULT_TOKEN_SECONDS)),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: pod.metadata.name.clone(),
                    uid: pod.metadata.uid.clone(),
                }),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let token = Api::<ServiceAccount>::namespaced(client.clone(), namespace)
            .create_token_request(&account, &PostParams::default(), &request)
            .await
            .map_err(|source| KubeletError::Api {
                what: format!("a token for service account {namespace}/{account}"),
                source,
            })?;
        let token = token.status.and_then(|s| s.token).unwrap_or_default();
        return Ok(vec![(sat.path.clone(), token.into_bytes())]);
    }
    Err(KubeletError::Volume {
        volume: volume.into(),
        message: "unsupported projected source: the process kubelet projects configMap, secret, downwardAPI and serviceAccountToken".into(),
    })
}

/// The node-side path of a hostPath (a pod's or a persistent volume's), made or checked as its
/// `type` says.
fn host_path_volume(
    node_root: &Path,
    source: &HostPathVolumeSource,
    volume: &str,
) -> Result<PathBuf, KubeletError> {
    let path = host_path(node_root, &source.path);
    match source.type_.as_deref().unwrap_or_default() {
        "" | "DirectoryOrCreate" if !path.exists() => {
            std::fs::create_dir_all(&path).map_err(io(&path))?;
        }
        "FileOrCreate" if !path.exists() => {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io(parent))?;
            }
            std::fs::write(&path, b"").map_err(io(&path))?;
        }
        "Directory" | "File" | "Socket" | "CharDevice" | "BlockDevice" if !path.exists() => {
            return Err(KubeletError::Volume {
                volume: volume.into(),
                message: format!("hostPath {} does not exist", path.display()),
            });
        }
        _ => {}
    }
    Ok(path)
}

/// The fields of a persistent volume's spec that are not its source: what is left is the
/// source, whose name tells the user what the kubelet refused.
const VOLUME_FIELDS: &[&str] = &[
    "accessModes",
    "capacity",
    "claimRef",
    "mountOptions",
    "nodeAffinity",
    "persistentVolumeReclaimPolicy",
    "storageClassName",
    "volumeAttributesClassName",
    "volumeMode",
];

/// The name of the volume a claim is bound to; or why the pod must wait.
pub fn bound_volume(claim: &PersistentVolumeClaim) -> Result<&str, String> {
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    let phase = claim
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending");
    match claim.spec.as_ref().and_then(|s| s.volume_name.as_deref()) {
        Some(volume) if phase == "Bound" && !volume.is_empty() => Ok(volume),
        _ => Err(format!(
            "persistentvolumeclaim {name:?} is not bound (phase {phase})"
        )),
    }
}

/// The source of a persistent volume the process kubelet can give a pod.
#[derive(Debug, PartialEq)]
pub enum ClaimedSource<'a> {
    /// A `hostPath` volume (filesystem only, as upstream's hostPath plugin).
    HostPath(&'a HostPathVolumeSource),
    /// A `local` volume: a directory, or a block device when the volume's `volumeMode` is
    /// `Block` (how upstream serves raw local disks).
    Local { path: &'a str, block: bool },
}

/// The source of a persistent volume: `hostPath` or `local`, the kinds the process kubelet
/// serves; or what kind it is instead.
pub fn claimed_source(volume: &PersistentVolume) -> Result<ClaimedSource<'_>, String> {
    let name = volume.metadata.name.as_deref().unwrap_or_default();
    let spec = volume.spec.as_ref();
    let block = spec.and_then(|s| s.volume_mode.as_deref()) == Some("Block");
    if let Some(local) = spec.and_then(|s| s.local.as_ref()) {
        return Ok(ClaimedSource::Local {
            path: &local.path,
            block,
        });
    }
    if let Some(hp) = spec.and_then(|s| s.host_path.as_ref()) {
        if block {
            return Err(format!(
                "persistentvolume {name:?} is a hostPath volume with volumeMode Block: block volumes must be local volumes whose path is a block device"
            ));
        }
        return Ok(ClaimedSource::HostPath(hp));
    }
    let kind = serde_json::to_value(spec)
        .ok()
        .and_then(|v| {
            v.as_object()?
                .keys()
                .find(|k| !VOLUME_FIELDS.contains(&k.as_str()))
                .cloned()
        })
        .unwrap_or_else(|| "no source".into());
    Err(format!(
        "persistentvolume {name:?} is of type {kind}: the process kubelet serves hostPath and local volumes only"
    ))
}

/// The node path of a `local` volume, checked to be what its mode says: a block device for
/// `Block`, else a directory.
fn local_volume(
    node_root: &Path,
    path: &str,
    block: bool,
    volume: &str,
) -> Result<PathBuf, KubeletError> {
    let node_path = host_path(node_root, path);
    let meta = std::fs::metadata(&node_path).map_err(io(&node_path))?;
    let (ok, want) = if block {
        (meta.file_type().is_block_device(), "a block device")
    } else {
        (meta.is_dir(), "a directory")
    };
    if ok {
        Ok(node_path)
    } else {
        Err(KubeletError::Volume {
            volume: volume.into(),
            message: format!("local volume path {} is not {want}", node_path.display()),
        })
    }
}

/// Records on the host which block device the pod's volume `name` is, as the kubelet's
/// `MapBlockVolume` does: a link `volumeDevices/kubernetes.io~local-volume/<name>` in the pod
/// dir to the device. virt-handler reads it to let the launcher's cgroup open the device,
/// since it cannot trust the container's own `/dev`.
fn map_block_device(pod_dir: &Path, name: &str, device: &Path) -> Result<(), KubeletError> {
    let dir = pod_dir
        .join("volumeDevices")
        .join("kubernetes.io~local-volume");
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let link = dir.join(name);
    match std::fs::remove_file(&link) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&link)(e)),
        _ => {}
    }
    std::os::unix::fs::symlink(device, &link).map_err(io(&link))
}

/// The volume bound to a pod's claim (in the pod's namespace): the persistent volume's
/// hostPath or local path, read-only when the pod's volume says so. The Node authorizer lets the node read
/// the claims of its pods and the volumes bound to them.
async fn claimed_volume(
    client: &Client,
    namespace: &str,
    node_root: &Path,
    source: &PersistentVolumeClaimVolumeSource,
    volume: &str,
) -> Result<HostVolume, KubeletError> {
    let claim_name = &source.claim_name;
    let refused = |message: String| KubeletError::Volume {
        volume: volume.into(),
        message,
    };
    let claim = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace)
        .get_opt(claim_name)
        .await
        .map_err(|source| KubeletError::Api {
            what: format!("persistentvolumeclaim {namespace}/{claim_name}"),
            source,
        })?
        .ok_or_else(|| refused(format!("persistentvolumeclaim {claim_name:?} not found")))?;
    let bound = bound_volume(&claim).map_err(refused)?;
    let pv = Api::<PersistentVolume>::all(client.clone())
        .get(bound)
        .await
        .map_err(|source| KubeletError::Api {
            what: format!("persistentvolume {bound} (bound to claim {namespace}/{claim_name})"),
            source,
        })?;
    let read_only = source.read_only.unwrap_or(false);
    Ok(match claimed_source(&pv).map_err(refused)? {
        ClaimedSource::HostPath(hp) => HostVolume {
            path: host_path_volume(node_root, hp, volume)?,
            read_only,
            block: false,
        },
        ClaimedSource::Local { path, block } => HostVolume {
            path: local_volume(node_root, path, block, volume)?,
            read_only,
            block,
        },
    })
}

/// The `pagesize=` option of a `HugePages` emptyDir's hugetlbfs, as the kubelet's emptyDir
/// plugin chooses it: the size `HugePages-<size>` names, which a container must request; for
/// plain `HugePages`, the one size the pod's containers request.
pub fn hugepages_mount_option(medium: &str, pod: &Pod) -> Result<String, String> {
    let named = medium.strip_prefix("HugePages-");
    let spec = pod.spec.as_ref();
    let requested: BTreeSet<&str> = spec
        .into_iter()
        .flat_map(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
        })
        .filter_map(|c| c.resources.as_ref()?.requests.as_ref())
        .flat_map(|r| r.keys())
        .filter_map(|k| k.strip_prefix("hugepages-"))
        .collect();
    let size = match named {
        Some(size) => requested.contains(size).then_some(size),
        None if requested.len() > 1 => {
            return Err(format!(
                "medium: {medium} can't be used if container requests multiple huge page sizes"
            ));
        }
        None => requested.first().copied(),
    };
    size.map(|s| format!("pagesize={s}")).ok_or_else(|| {
        format!(
            "medium {medium}: hugePages storage requested, but there is no resource request for huge pages"
        )
    })
}

/// Mounts a hugetlbfs at `path` on the node (the kubelet's namespace): containers bind it, so
/// they share its files as they share any emptyDir. Unmounted with the pod's directory.
fn mount_hugetlbfs(path: &Path, option: &str) -> Result<(), KubeletError> {
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(&*path.to_string_lossy()));
    if mounted {
        return Ok(());
    }
    nix::mount::mount(
        Some("nodev"),
        path,
        Some("hugetlbfs"),
        nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOSUID,
        Some(option),
    )
    .map_err(|e| KubeletError::Io {
        path: path.display().to_string(),
        source: e.into(),
    })
}

/// Detaches every mount on the node at or below `dir` (a pod's hugetlbfs emptyDirs), deepest
/// first, so the directory can be removed.
pub fn unmount_below(dir: &Path) {
    let mut points: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        if let Err(e) = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(mount = %p.display(), error = %e, "unmounting a pod volume");
        }
    }
}

/// Materializes one volume for the pod in `pod_dir`.
pub async fn prepare(
    client: &Client,
    pod: &Pod,
    pod_dir: &Path,
    node_root: &Path,
    volume: &Volume,
) -> Result<HostVolume, KubeletError> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = volume.name.as_str();
    if let Some(ed) = &volume.empty_dir {
        let path = plugin_dir(pod_dir, "empty-dir", name);
        std::fs::create_dir_all(&path).map_err(io(&path))?;
        if let Some(medium) = ed.medium.as_deref().filter(|m| m.starts_with("HugePages")) {
            let option =
                hugepages_mount_option(medium, pod).map_err(|message| KubeletError::Volume {
                    volume: name.into(),
                    message,
                })?;
            mount_hugetlbfs(&path, &option)?;
        }
        return Ok(HostVolume::writable(path));
    }
    if let Some(hp) = &volume.host_path {
        return Ok(HostVolume::writable(host_path_volume(node_root, hp, name)?));
    }
    if let Some(claim) = &volume.persistent_volume_claim {
        let host = claimed_volume(client, &namespace, node_root, claim, name).await?;
        if host.block {
            map_block_device(pod_dir, name, &host.path)?;
        }
        return Ok(host);
    }
    if let Some(cm) = &volume.config_map {
        let path = plugin_dir(pod_dir, "configmap", name);
        let data = config_map_data(client, &namespace, &cm.name, cm.optional, name).await?;
        write_files(&path, &projected_files(&data, cm.items.as_deref(), name)?)?;
        return Ok(HostVolume::writable(path));
    }
    if let Some(sec) = &volume.secret {
        let path = plugin_dir(pod_dir, "secret", name);
        let secret_name = sec.secret_name.clone().unwrap_or_default();
        let data = secret_data(client, &namespace, &secret_name, sec.optional, name).await?;
        write_files(&path, &projected_files(&data, sec.items.as_deref(), name)?)?;
        return Ok(HostVolume::writable(path));
    }
    if let Some(dapi) = &volume.downward_api {
        let path = plugin_dir(pod_dir, "downward-api", name);
        write_files(&path, &downward_files(pod, dapi.items.as_deref(), name)?)?;
        return Ok(HostVolume::writable(path));
    }
    if let Some(projected) = &volume.projected {
        let path = plugin_dir(pod_dir, "projected", name);
        let mut files = Vec::new();
        for source in projected.sources.iter().flatten() {
            files.extend(projection(client, pod, &namespace, source, name).await?);
        }
        write_files(&path, &files)?;
        return Ok(HostVolume::writable(path));
    }
    Err(KubeletError::Volume {
        volume: name.into(),
        message: "unsupported volume type: the process kubelet handles emptyDir, hostPath, configMap, secret, downwardAPI, projected and persistentVolumeClaim".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn node_local_host_paths_are_rerooted() {
        let root = Path::new("/nodes/n1");
        assert_eq!(
            host_path(root, "/var/run/kubevirt-private"),
            PathBuf::from("/nodes/n1/var/run/kubevirt-private")
        );
        assert_eq!(
            host_path(root, "/var/lib/kubelet/pods"),
            PathBuf::from("/nodes/n1/var/lib/kubelet/pods")
        );
        assert_eq!(host_path(root, "/dev/kvm"), PathBuf::from("/dev/kvm"));
    }

    #[test]
    fn projections() {
        let data = BTreeMap::from([
            ("a".to_string(), b"1".to_vec()),
            ("b".into(), b"2".to_vec()),
        ]);
        assert_eq!(projected_files(&data, None, "v").unwrap().len(), 2);
        let items = [KeyToPath {
            key: "b".into(),
            path: "sub/b.txt".into(),
            ..KeyToPath::default()
        }];
        assert_eq!(
            projected_files(&data, Some(&items), "v").unwrap(),
            vec![("sub/b.txt".to_string(), b"2".to_vec())]
        );
        let missing = [KeyToPath {
            key: "c".into(),
            path: "c".into(),
            ..KeyToPath::default()
        }];
        assert!(projected_files(&data, Some(&missing), "v").is_err());
    }

    #[test]
    fn a_claim_must_be_bound_and_its_volume_a_host_path() {
        let claim = |spec: serde_json::Value, phase: &str| -> PersistentVolumeClaim {
            serde_json::from_value(json!({"metadata": {"name": "data"}, "spec": spec,
                                          "status": {"phase": phase}}))
            .unwrap()
        };
        assert_eq!(
            bound_volume(&claim(json!({"volumeName": "pvc-1"}), "Bound")),
            Ok("pvc-1")
        );
        assert_eq!(
            bound_volume(&claim(json!({}), "Pending")),
            Err("persistentvolumeclaim \"data\" is not bound (phase Pending)".into())
        );
        let volume = |spec: serde_json::Value| -> PersistentVolume {
            serde_json::from_value(json!({"metadata": {"name": "pv"}, "spec": spec})).unwrap()
        };
        let common = json!({"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"},
                            "claimRef": {"name": "data"}, "storageClassName": "local",
                            "persistentVolumeReclaimPolicy": "Delete"});
        let mut host = common.clone();
        host["hostPath"] = json!({"path": "/v/pv", "type": "Directory"});
        let v = volume(host.clone());
        let Ok(ClaimedSource::HostPath(hp)) = claimed_source(&v) else {
            panic!("{:?}", claimed_source(&v))
        };
        assert_eq!(hp.path, "/v/pv");
        let mut nfs = common.clone();
        nfs["nfs"] = json!({"server": "nfs.example.com", "path": "/export"});
        assert_eq!(
            claimed_source(&volume(nfs)).unwrap_err(),
            "persistentvolume \"pv\" is of type nfs: the process kubelet serves hostPath and local volumes only"
        );
        host["volumeMode"] = json!("Block");
        assert!(
            claimed_source(&volume(host))
                .unwrap_err()
                .contains("block volumes must be local volumes")
        );
        let mut local = common.clone();
        local["local"] = json!({"path": "/dev/loop3"});
        local["volumeMode"] = json!("Block");
        assert_eq!(
            claimed_source(&volume(local)),
            Ok(ClaimedSource::Local {
                path: "/dev/loop3",
                block: true
            })
        );
    }

    #[test]
    fn hugepages_mount_options_follow_the_pods_requests() {
        let pod = |requests: &[serde_json::Value]| -> Pod {
            let containers: Vec<_> = requests
                .iter()
                .map(|r| json!({"name": "c", "resources": {"requests": r, "limits": r}}))
                .collect();
            serde_json::from_value(json!({"spec": {"containers": containers}})).unwrap()
        };
        let two = json!({"hugepages-2Mi": "4Mi", "memory": "1Mi"});
        let giga = json!({"hugepages-1Gi": "1Gi"});
        assert_eq!(
            hugepages_mount_option("HugePages", &pod(std::slice::from_ref(&two))),
            Ok("pagesize=2Mi".into())
        );
        assert_eq!(
            hugepages_mount_option("HugePages-1Gi", &pod(&[two.clone(), giga.clone()])),
            Ok("pagesize=1Gi".into())
        );
        assert_eq!(
            hugepages_mount_option("HugePages", &pod(&[two.clone(), giga])).unwrap_err(),
            "medium: HugePages can't be used if container requests multiple huge page sizes"
        );
        assert_eq!(
            hugepages_mount_option("HugePages-1Gi", &pod(&[two])).unwrap_err(),
            "medium HugePages-1Gi: hugePages storage requested, but there is no resource \
             request for huge pages"
        );
    }

    #[test]
    fn downward_fields() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"app": "x", "tier": "web"}},
            "spec": {"nodeName": "n1", "containers": []},
        }))
        .unwrap();
        assert_eq!(field_value(&pod, "metadata.name").as_deref(), Some("p"));
        assert_eq!(field_value(&pod, "spec.nodeName").as_deref(), Some("n1"));
        assert_eq!(
            field_value(&pod, "metadata.labels").as_deref(),
            Some("app=\"x\"\ntier=\"web\"\n")
        );
        assert_eq!(
            field_value(&pod, "metadata.labels['tier']").as_deref(),
            Some("web")
        );
        assert_eq!(field_value(&pod, "status.podIP"), None);
        assert_eq!(field_value(&pod, "spec.bogus"), None);
    }
}
