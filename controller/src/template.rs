//! The template service: VMI -> launcher pod, as a pure function
//! (`pkg/virt-controller/services/template.go`, `pkg/container-disk`).
//!
//! The pod's shape follows KubeVirt's so kubectl users, admission policies and quota see what
//! they know: `virt-launcher-<vmi>-<random>` names, the same labels, annotations, volumes,
//! device resources and node selector. The memory overhead is ours
//! ([`overhead::memory_overhead`]).

use std::collections::BTreeMap;

use api::ClusterConfig;
use api::VirtualMachineInstance;
use api::configdisk::{self, ConfigKind};
use api::labels;
use api::quantity::{ParsedQuantity, format_binary_si};
use api::vmi::{InterfaceModel, VolumeSource};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, DownwardAPIVolumeSource, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, ExecAction, HostPathVolumeSource, ObjectFieldSelector,
    PersistentVolumeClaim, PersistentVolumeClaimVolumeSource, Pod, PodReadinessGate, PodSpec,
    Probe, ResourceRequirements, SecretVolumeSource, SecurityContext, Volume, VolumeDevice,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

pub use api::labels::{KVM_RESOURCE, TUN_RESOURCE, VHOST_NET_RESOURCE};
/// The launcher image's probe command, on the compute container's `PATH` as KubeVirt's.
const VIRT_PROBE: &str = "virt-probe";
/// KubeVirt's default VMI termination grace period.
pub const DEFAULT_GRACE_PERIOD_SECONDS: i64 = 30;
/// Padding KubeVirt adds so virt-handler, not the kubelet, ends the guest.
const GRACE_PERIOD_PADDING_SECONDS: i64 = 15;
/// Where container-disk containers find the `container-disk` binary (copied there by an init
/// container from the launcher image, as KubeVirt does, since disk images carry no binaries).
const VIRT_BIN_DIR: &str = "/init/usr/bin";
const VIRT_BIN_VOLUME: &str = "virt-bin-share-dir";
/// KubeVirt's `containerdisk.KernelBootName`: the kernel-boot container serves
/// `<container-disk dir>/kernel-boot.sock`, and virt-handler mounts the image's kernel and
/// initrd into `<container-disk dir>/kernel-boot/`, where the launcher looks for them.
pub const KERNEL_BOOT_NAME: &str = "kernel-boot";
/// KubeVirt's `containerdisk.KernelBootVolumeName`; the container is `volumekernel-boot-volume`.
pub const KERNEL_BOOT_VOLUME: &str = "kernel-boot-volume";
/// Where the compute container gets its hugetlbfs mount (KubeVirt's, and virt-launcher's
/// default `--hugepages-dir`).
const HUGEPAGES_DIR: &str = "/dev/hugepages";

/// The overhead constants, shared with virt-launcher (which caps TCG's code cache at its budget).
pub use api::overhead;

/// How the template service renders pods.
#[derive(Debug, Clone)]
pub struct TemplateConfig {
    /// virt-launcher image.
    pub launcher_image: String,
    /// `--qemu-timeout` passed to the launcher.
    pub qemu_timeout: String,
    /// `/var/run/kubevirt`.
    pub share_dir: String,
    /// `/var/run/kubevirt-private`.
    pub private_dir: String,
    /// `/var/run/kubevirt-ephemeral-disks`.
    pub ephemeral_disk_dir: String,
    /// `/var/run/kubevirt/container-disks`.
    pub container_disk_dir: String,
    /// `/var/run/kubevirt/hotplug-disks`.
    pub hotplug_disk_dir: String,
    /// Image pull secret added to every launcher pod.
    pub image_pull_secret: Option<String>,
}

impl Default for TemplateConfig {
    fn default() -> Self {
        Self {
            launcher_image: "virt-launcher".into(),
            qemu_timeout: "5m".into(),
            share_dir: "/var/run/kubevirt".into(),
            private_dir: "/var/run/kubevirt-private".into(),
            ephemeral_disk_dir: "/var/run/kubevirt-ephemeral-disks".into(),
            container_disk_dir: "/var/run/kubevirt/container-disks".into(),
            hotplug_disk_dir: "/var/run/kubevirt/hotplug-disks".into(),
            image_pull_secret: None,
        }
    }
}

/// Why a pod cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The VMI lacks a name, namespace or uid.
    #[error("VMI has no metadata.{0}")]
    MissingMetadata(&'static str),
    /// A memory quantity cannot be read.
    #[error("{path}: {value:?} is not a memory quantity")]
    BadQuantity {
        /// Field path.
        path: &'static str,
        /// Its value.
        value: String,
    },
    /// Neither a memory request nor guest memory is set.
    #[error("spec.domain.resources.requests.memory: the VMI sets no memory")]
    NoMemory,
    /// The VMI needs backend storage and its status names no claim yet (the VMI controller
    /// names it before it renders the pod).
    #[error(
        "{}: no backend-storage PVC in status.volumeStatus yet",
        api::backendstorage::PERSISTENT_EFI_FIELD
    )]
    NoBackendStorage,
    /// A claim the launcher pod would mount does not exist (KubeVirt's `PvcNotFoundError`).
    #[error("{path}: PVC {namespace}/{claim} does not exist")]
    ClaimNotFound {
        /// Field path of the claim's name.
        path: String,
        /// The VMI's namespace.
        namespace: String,
        /// The claim.
        claim: String,
    },
}

/// The claims the launcher pod mounts itself (not hotplugged ones), each with the field path
/// naming it: `persistentVolumeClaim` and `ephemeral` volumes, by volume.
fn pod_claims(vmi: &VirtualMachineInstance) -> Vec<(&api::vmi::Volume, &str, String)> {
    let hotplugged = api::hotplug::hotplug_volumes(vmi);
    vmi.spec
        .volumes
        .iter()
        .enumerate()
        .filter(|(_, v)| !hotplugged.contains(v.name.as_str()))
        .filter_map(|(i, v)| match v.source()? {
            VolumeSource::PersistentVolumeClaim(pvc) => Some((
                v,
                pvc.claim_name.as_str(),
                format!("spec.volumes[{i}].persistentVolumeClaim.claimName"),
            )),
            VolumeSource::Ephemeral(eph) => Some((
                v,
                eph.persistent_volume_claim.as_ref()?.claim_name.as_str(),
                format!("spec.volumes[{i}].ephemeral.persistentVolumeClaim.claimName"),
            )),
            _ => None,
        })
        .collect()
}

/// The first claim of the launcher pod that `claims` (by name, in the VMI's namespace) does
/// not have: KubeVirt creates no pod until it exists.
pub fn missing_claim(
    vmi: &VirtualMachineInstance,
    claims: &dyn Fn(&str) -> Option<PersistentVolumeClaim>,
) -> Option<TemplateError> {
    pod_claims(vmi)
        .into_iter()
        .find(|(_, claim, _)| claims(claim).is_none())
        .map(|(_, claim, path)| TemplateError::ClaimNotFound {
            path,
            namespace: vmi.metadata.namespace.clone().unwrap_or_default(),
            claim: claim.to_owned(),
        })
}

/// KubeVirt's `IsPVCBlock`: the claim asks for `volumeMode: Block` (a claim asking for
/// nothing binds only to a filesystem volume).
pub fn is_block(claim: &PersistentVolumeClaim) -> bool {
    claim.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block")
}

fn bytes_of(q: &Quantity, path: &'static str) -> Result<u64, TemplateError> {
    ParsedQuantity::from_quantity(q)
        .ok()
        .and_then(|p| u64::try_from(p.value()).ok())
        .ok_or_else(|| TemplateError::BadQuantity {
            path,
            value: q.0.clone(),
        })
}

/// Guest RAM of the VMI: `memory.guest`, else the memory request.
pub fn guest_memory(vmi: &VirtualMachineInstance) -> Result<u64, TemplateError> {
    let d = &vmi.spec.domain;
    if let Some(g) = d.memory.as_ref().and_then(|m| m.guest.as_ref()) {
        return bytes_of(g, "spec.domain.memory.guest");
    }
    match d.resources.requests.get("memory") {
        Some(q) => bytes_of(q, "spec.domain.resources.requests.memory"),
        None => d
            .resources
            .limits
            .get("memory")
            .map_or(Err(TemplateError::NoMemory), |q| {
                bytes_of(q, "spec.domain.resources.limits.memory")
            }),
    }
}

fn quantity_bytes(bytes: u64) -> Quantity {
    Quantity(format_binary_si(i128::from(bytes)))
}

fn empty_dir(name: &str) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        ..VolumeMount::default()
    }
}

fn host_to_container(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        mount_propagation: Some("HostToContainer".into()),
        ..mount(name, path)
    }
}

/// KubeVirt's `toContainerName`: `volume` + the volume name, lower-cased.
fn container_disk_container_name(volume: &str) -> String {
    format!("volume{}", volume.to_lowercase())
}

/// Where disk-image containers mount the `container-disks` emptyDir: KubeVirt's
/// `<container-disk-dir>/<vmi uid>`. The launcher mounts the same emptyDir at
/// `<container-disk-dir>` itself, so `--copy-path <this>/disk_<n>` puts the socket at
/// `disk_<n>.sock` in the launcher's container-disk dir.
fn container_disk_mount_dir(cfg: &TemplateConfig, uid: &str) -> String {
    format!("{}/{uid}", cfg.container_disk_dir)
}

/// One image the pod runs only so that virt-handler can reach its files: a containerDisk
/// volume or the kernel-boot container.
struct DiskImage<'a> {
    /// Volume name (`kernel-boot-volume` for the kernel-boot container); names the container.
    volume: &'a str,
    image: &'a str,
    pull_policy: Option<&'a str>,
    /// Base name of the socket in the container-disk dir: `disk_<volume index>` or
    /// `kernel-boot`.
    copy_name: String,
}

/// The two containers KubeVirt renders per disk image.
#[derive(Clone, Copy)]
enum DiskContainerRole {
    /// Init container `<name>-init` running `container-disk --no-op`: pulls the image
    /// before the launcher starts.
    PrePull,
    /// App container serving `<copy path>.sock` for as long as the pod lives.
    Serve,
}

impl DiskImage<'_> {
    fn container(&self, mount_dir: &str, role: DiskContainerRole, dedicated: bool) -> Container {
        let name = container_disk_container_name(self.volume);
        let (name, args) = match role {
            DiskContainerRole::PrePull => (format!("{name}-init"), vec!["--no-op".to_owned()]),
            DiskContainerRole::Serve => (
                name,
                vec![
                    "--copy-path".to_owned(),
                    format!("{mount_dir}/{}", self.copy_name),
                ],
            ),
        };
        Container {
            name,
            image: Some(self.image.to_owned()),
            image_pull_policy: self.pull_policy.map(str::to_owned),
            command: Some(vec!["/usr/bin/container-disk".into()]),
            args: Some(args),
            volume_mounts: Some(vec![
                mount("container-disks", mount_dir),
                mount(VIRT_BIN_VOLUME, "/usr/bin"),
            ]),
            resources: Some(container_disk_resources(dedicated)),
            security_context: Some(non_root_security_context()),
            ..Container::default()
        }
    }
}

/// KubeVirt's pod labels: the VMI's own plus the launcher ones.
fn labels(vmi: &VirtualMachineInstance, uid: &str, host: &str) -> BTreeMap<String, String> {
    let mut l = vmi.metadata.labels.clone().unwrap_or_default();
    l.insert(labels::APP.into(), "virt-launcher".into());
    l.insert(labels::CREATED_BY.into(), uid.into());
    l.insert(labels::VM_NAME.into(), host.into());
    l.insert(
        labels::VMI_ID.into(),
        labels::vmi_id(vmi.metadata.name.as_deref().unwrap_or_default()),
    );
    l
}

/// KubeVirt's pod annotations: the domain, the VMI's own (minus kubectl bookkeeping), the
/// default container and the unix migration transport.
fn annotations(vmi: &VirtualMachineInstance, name: &str) -> BTreeMap<String, String> {
    let mut a: BTreeMap<String, String> = vmi
        .metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| {
            !(k.starts_with("kubectl.kubernetes.io")
                || k.starts_with(labels::CONTROLLER_API_STORAGE_VERSION_OBSERVED)
                || k.starts_with(labels::CONTROLLER_API_LATEST_VERSION_OBSERVED))
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    a.insert(labels::DOMAIN.into(), name.into());
    a.insert(
        "kubectl.kubernetes.io/default-container".into(),
        "compute".into(),
    );
    a.insert(labels::MIGRATION_TRANSPORT_UNIX.into(), "true".into());
    a.insert(
        "descheduler.alpha.kubernetes.io/request-evict-only".into(),
        String::new(),
    );
    a
}

/// KubeVirt's `SanitizeHostname`: the spec hostname, else the VMI name, cut to a DNS label.
fn hostname(vmi: &VirtualMachineInstance, name: &str) -> String {
    let h = vmi.spec.hostname.clone().unwrap_or_else(|| name.to_owned());
    let cut: String = h.chars().take(63).collect();
    cut.replace('.', "-")
}

/// Render the launcher pod for `vmi`. The pod has a `generateName`; the API server picks the
/// random suffix. `claims` finds a claim by name in the VMI's namespace: its volume mode
/// decides between a device and a mount.
pub fn render_launcher_pod(
    vmi: &VirtualMachineInstance,
    cfg: &TemplateConfig,
    cluster: &ClusterConfig,
    claims: &dyn Fn(&str) -> Option<PersistentVolumeClaim>,
) -> Result<Pod, TemplateError> {
    let name = vmi
        .metadata
        .name
        .as_deref()
        .ok_or(TemplateError::MissingMetadata("name"))?;
    let namespace = vmi
        .metadata
        .namespace
        .as_deref()
        .ok_or(TemplateError::MissingMetadata("namespace"))?;
    let uid = vmi
        .metadata
        .uid
        .as_deref()
        .ok_or(TemplateError::MissingMetadata("uid"))?;
    let spec = &vmi.spec;
    let host = hostname(vmi, name);
    let domain = api::vmi::domain_name(namespace, name);
    let grace = spec
        .termination_grace_period_seconds
        .unwrap_or(DEFAULT_GRACE_PERIOD_SECONDS)
        + GRACE_PERIOD_PADDING_SECONDS;
    let kill_after = grace + GRACE_PERIOD_PADDING_SECONDS;

    let mut args = vec![
        "--qemu-timeout".to_owned(),
        cfg.qemu_timeout.clone(),
        "--name".into(),
        name.into(),
        "--uid".into(),
        uid.into(),
        "--namespace".into(),
        namespace.into(),
        "--kubevirt-share-dir".into(),
        cfg.share_dir.clone(),
        "--ephemeral-disk-dir".into(),
        cfg.ephemeral_disk_dir.clone(),
        "--container-disk-dir".into(),
        cfg.container_disk_dir.clone(),
        "--hotplug-disk-dir".into(),
        cfg.hotplug_disk_dir.clone(),
        "--private-dir".into(),
        cfg.private_dir.clone(),
        "--grace-period-seconds".into(),
        grace.to_string(),
    ];
    if cluster.use_emulation {
        args.push("--allow-emulation".into());
    }
    if vmi
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(api::labels::FUNC_TEST_LAUNCHER_FAIL_FAST))
    {
        args.push("--simulate-crash".into());
    }

    // Volumes every launcher gets (KubeVirt's volume renderer).
    let mut volumes = vec![
        empty_dir("private"),
        empty_dir("public"),
        empty_dir("sockets"),
        empty_dir("ephemeral-disks"),
        empty_dir("container-disks"),
        empty_dir("hotplug-disks"),
    ];
    let mut compute_mounts = vec![
        mount("private", &cfg.private_dir),
        mount("public", &cfg.share_dir),
        mount("sockets", &format!("{}/sockets", cfg.share_dir)),
        mount("ephemeral-disks", &cfg.ephemeral_disk_dir),
        host_to_container("container-disks", &cfg.container_disk_dir),
        host_to_container("hotplug-disks", &cfg.hotplug_disk_dir),
    ];
    let disk_mount_dir = container_disk_mount_dir(cfg, uid);
    let mut disks: Vec<DiskImage<'_>> = Vec::new();
    let mut pull_secrets: Vec<String> = Vec::new();
    // Hotplugged claims reach the launcher through an attachment pod, never its own volumes:
    // a VM started with one attached keeps it hotplugged.
    let hotplugged = api::hotplug::hotplug_volumes(vmi);
    for (index, v) in spec.volumes.iter().enumerate() {
        match v.source() {
            Some(VolumeSource::ContainerDisk(cd)) => {
                disks.push(DiskImage {
                    volume: &v.name,
                    image: &cd.image,
                    pull_policy: cd
                        .image_pull_policy
                        .as_ref()
                        .map(api::common::PullPolicy::as_str),
                    copy_name: format!("disk_{index}"),
                });
                if let Some(s) = &cd.image_pull_secret {
                    pull_secrets.push(s.clone());
                }
            }
            Some(VolumeSource::PersistentVolumeClaim(pvc))
                if !hotplugged.contains(v.name.as_str()) =>
            {
                volumes.push(Volume {
                    name: v.name.clone(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: pvc.claim_name.clone(),
                        read_only: pvc.read_only,
                    }),
                    ..Volume::default()
                });
            }
            // KubeVirt mounts an ephemeral volume's claim as it is; the launcher writes the
            // guest's changes to an overlay in the ephemeral-disks dir, never to the claim.
            Some(VolumeSource::Ephemeral(eph)) => {
                volumes.push(Volume {
                    name: v.name.clone(),
                    persistent_volume_claim: eph.persistent_volume_claim.clone(),
                    ..Volume::default()
                });
            }
            Some(VolumeSource::HostDisk(hd)) => {
                let dir = std::path::Path::new(&hd.path)
                    .parent()
                    .map_or_else(|| "/".to_owned(), |p| p.display().to_string());
                volumes.push(Volume {
                    name: v.name.clone(),
                    host_path: Some(HostPathVolumeSource {
                        path: dir.clone(),
                        type_: Some("DirectoryOrCreate".into()),
                    }),
                    ..Volume::default()
                });
                compute_mounts.push(host_to_container(&v.name, &dir));
            }
            _ => {}
        }
    }
    // KubeVirt's `addPVCToLaunchManifest`: a block claim is the device `/dev/<volume>`, which
    // the launcher finds there; a filesystem claim holds `disk.img` under `vmi-disks/<volume>`.
    let mut devices = Vec::new();
    for (v, claim_name, path) in pod_claims(vmi) {
        let claim = claims(claim_name).ok_or_else(|| TemplateError::ClaimNotFound {
            path,
            namespace: namespace.to_owned(),
            claim: claim_name.to_owned(),
        })?;
        if is_block(&claim) {
            devices.push(VolumeDevice {
                name: v.name.clone(),
                device_path: format!("/dev/{}", v.name),
            });
        } else {
            compute_mounts.push(mount(
                &v.name,
                &format!("{}/vmi-disks/{}", cfg.private_dir, v.name),
            ));
        }
    }
    // KubeVirt's `withBackendStorage`: the claim the VMI's status names, its `nvram` directory
    // where the launcher keeps persistent EFI variables. KubeVirt also mounts its `meta`
    // directory, where a migration's hand-off marker goes; no hand-off is done here
    // (docs/migration.md).
    if api::backendstorage::needed(vmi) {
        let claim =
            api::backendstorage::current_claim(vmi).ok_or(TemplateError::NoBackendStorage)?;
        volumes.push(Volume {
            name: api::backendstorage::POD_VOLUME.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.to_owned(),
                read_only: None,
            }),
            ..Volume::default()
        });
        compute_mounts.push(VolumeMount {
            sub_path: Some(api::backendstorage::NVRAM_SUBPATH.into()),
            ..mount(
                api::backendstorage::POD_VOLUME,
                api::backendstorage::NVRAM_DIR,
            )
        });
    }
    if spec
        .domain
        .memory
        .as_ref()
        .is_some_and(|m| m.hugepages.is_some())
    {
        // KubeVirt's `withHugepages`: the launcher backs guest RAM with files on it. KubeVirt
        // also mounts `hugetblfs-dir` at `/dev/hugepages/libvirt/qemu`, libvirt's own
        // directory; there is no libvirt here.
        volumes.push(Volume {
            name: "hugepages".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("HugePages".into()),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        });
        compute_mounts.push(mount("hugepages", HUGEPAGES_DIR));
    }
    config_volumes(vmi, cfg, &mut volumes, &mut compute_mounts);
    if api::virtiofs::enabled(spec) {
        // KubeVirt's `withVirioFS`: the sockets' emptyDir, shared with every virtiofs container.
        volumes.push(empty_dir(api::virtiofs::CONTAINERS_VOLUME));
        compute_mounts.push(mount(
            api::virtiofs::CONTAINERS_VOLUME,
            &virtiofs_sockets_dir(cfg),
        ));
    }
    if let Some(kb) = spec.kernel_boot().and_then(|k| k.container.as_ref()) {
        disks.push(DiskImage {
            volume: KERNEL_BOOT_VOLUME,
            image: &kb.image,
            pull_policy: kb
                .image_pull_policy
                .as_ref()
                .map(api::common::PullPolicy::as_str),
            copy_name: KERNEL_BOOT_NAME.to_owned(),
        });
        if let Some(s) = &kb.image_pull_secret {
            pull_secrets.push(s.clone());
        }
    }
    if !disks.is_empty() {
        volumes.push(empty_dir(VIRT_BIN_VOLUME));
    }

    let compute = Container {
        name: "compute".into(),
        image: Some(cfg.launcher_image.clone()),
        image_pull_policy: Some(
            api::defaults::pull_policy_for(&cfg.launcher_image)
                .as_str()
                .to_owned(),
        ),
        command: Some(vec!["/usr/bin/virt-launcher".into()]),
        args: Some(args),
        env: Some(vec![EnvVar {
            name: "POD_NAME".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.name".into(),
                    ..ObjectFieldSelector::default()
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        }]),
        resources: Some(compute_resources(vmi, cluster)?),
        readiness_probe: spec
            .readiness_probe
            .as_ref()
            .map(|p| compute_probe(p, &domain)),
        liveness_probe: spec
            .liveness_probe
            .as_ref()
            .map(|p| compute_probe(p, &domain)),
        volume_mounts: Some(compute_mounts),
        volume_devices: (!devices.is_empty()).then_some(devices),
        security_context: Some(SecurityContext {
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_BIND_SERVICE".into(), "SYS_NICE".into()]),
                drop: None,
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };
    let dedicated = dedicated_cpus(vmi).is_some();
    let mut containers = vec![compute];
    containers.extend(
        disks
            .iter()
            .map(|d| d.container(&disk_mount_dir, DiskContainerRole::Serve, dedicated)),
    );
    containers.extend(virtiofs_containers(vmi, cfg, dedicated));
    let init_containers = (!disks.is_empty()).then(|| {
        let mut init = vec![Container {
            name: "container-disk-binary".into(),
            image: Some(cfg.launcher_image.clone()),
            command: Some(vec!["/usr/bin/cp".into()]),
            args: Some(vec![
                "--preserve=all".into(),
                "/usr/bin/container-disk".into(),
                format!("{VIRT_BIN_DIR}/container-disk"),
            ]),
            volume_mounts: Some(vec![mount(VIRT_BIN_VOLUME, VIRT_BIN_DIR)]),
            resources: Some(container_disk_resources(dedicated)),
            security_context: Some(non_root_security_context()),
            ..Container::default()
        }];
        // As KubeVirt: the images are pulled before the launcher starts.
        init.extend(
            disks
                .iter()
                .map(|d| d.container(&disk_mount_dir, DiskContainerRole::PrePull, dedicated)),
        );
        init
    });

    let mut node_selector = spec.node_selector.clone();
    node_selector.insert(labels::NODE_SCHEDULABLE.into(), "true".into());
    for label in cpu_node_labels(spec) {
        node_selector.insert(label, "true".into());
    }
    if dedicated {
        node_selector.insert(labels::CPU_MANAGER.into(), "true".into());
    }
    if let Some(s) = &cfg.image_pull_secret {
        pull_secrets.push(s.clone());
    }
    pull_secrets.dedup();

    Ok(Pod {
        metadata: ObjectMeta {
            generate_name: Some(format!("virt-launcher-{name}-")),
            namespace: Some(namespace.into()),
            labels: Some(labels(vmi, uid, &host)),
            annotations: Some(annotations(vmi, name)),
            owner_references: Some(vec![OwnerReference {
                api_version: "kubevirt.io/v1".into(),
                kind: "VirtualMachineInstance".into(),
                name: name.into(),
                uid: uid.into(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            hostname: Some(host),
            subdomain: spec.subdomain.clone(),
            termination_grace_period_seconds: Some(kill_after),
            restart_policy: Some("Never".into()),
            containers,
            init_containers,
            node_selector: Some(node_selector),
            affinity: spec.affinity.clone(),
            tolerations: (!spec.tolerations.is_empty()).then(|| spec.tolerations.clone()),
            topology_spread_constraints: (!spec.topology_spread_constraints.is_empty())
                .then(|| spec.topology_spread_constraints.clone()),
            scheduler_name: spec.scheduler_name.clone(),
            priority_class_name: spec.priority_class_name.clone(),
            service_account_name: spec
                .service_account_name
                .clone()
                .or_else(|| service_account_volume(vmi).map(str::to_owned)),
            // The token is the service account disk's content.
            automount_service_account_token: Some(service_account_volume(vmi).is_some()),
            enable_service_links: Some(false),
            dns_policy: spec.dns_policy.clone(),
            dns_config: spec.dns_config.clone(),
            readiness_gates: Some(vec![PodReadinessGate {
                condition_type: labels::VIRTUAL_MACHINE_UNPAUSED.into(),
            }]),
            volumes: Some(volumes),
            image_pull_secrets: (!pull_secrets.is_empty()).then(|| {
                pull_secrets
                    .into_iter()
                    .map(|name| k8s_openapi::api::core::v1::LocalObjectReference { name })
                    .collect()
            }),
            ..PodSpec::default()
        }),
        status: None,
    })
}

/// A VMI probe as the compute container's, as KubeVirt renders it (`copyProbe`,
/// `updateReadinessProbe`, `updateLivenessProbe`): defaulted; HTTP and TCP probes as they are,
/// for the kubelet to send to the pod's IP, which reaches the guest through its masquerade or
/// bridge interface; `exec` and `guestAgentPing` as a `virt-probe` command that asks the
/// launcher to run the command through the guest agent or to ping the agent, with one more
/// second of timeout for that detour. KubeVirt also adds 10 s (`LibvirtStartupDelay`) to every
/// probe's initial delay for libvirt to start; no libvirt starts here (docs/launcher.md).
fn compute_probe(probe: &api::vmi::Probe, domain: &str) -> Probe {
    let mut p = probe.clone();
    api::defaults::set_probe_defaults(&mut p);
    let timeout = p.timeout_seconds.unwrap_or(1);
    let virt_probe = |tail: &[String]| {
        let mut command = vec![
            VIRT_PROBE.to_owned(),
            "--domainName".into(),
            domain.to_owned(),
            "--timeoutSeconds".into(),
            timeout.to_string(),
        ];
        command.extend_from_slice(tail);
        Some(ExecAction {
            command: Some(command),
        })
    };
    let exec = if p.guest_agent_ping.is_some() {
        virt_probe(&["--guestAgentPing".to_owned()])
    } else {
        match p.exec.as_ref().and_then(|e| e.command.as_deref()) {
            Some([first, rest @ ..]) if first != VIRT_PROBE => {
                let mut tail = vec!["--command".to_owned(), first.clone(), "--".into()];
                tail.extend_from_slice(rest);
                virt_probe(&tail)
            }
            _ => p.exec.clone(),
        }
    };
    let detour = exec != p.exec;
    Probe {
        exec,
        http_get: p.http_get,
        tcp_socket: p.tcp_socket,
        initial_delay_seconds: p.initial_delay_seconds,
        timeout_seconds: Some(timeout + i32::from(detour)),
        period_seconds: p.period_seconds,
        success_threshold: p.success_threshold,
        failure_threshold: p.failure_threshold,
        ..Probe::default()
    }
}

/// The service account a `serviceAccount` volume names (KubeVirt allows one).
fn service_account_volume(vmi: &VirtualMachineInstance) -> Option<&str> {
    vmi.spec.volumes.iter().find_map(|v| match v.source() {
        Some(VolumeSource::ServiceAccount(sa)) => sa.service_account_name.as_deref(),
        _ => None,
    })
}

/// The pod volumes behind config disks and cloud-init Secret references, mounted where the
/// launcher builds the images from (KubeVirt's `withVMIConfigVolumes` and cloud-init
/// handlers in `rendervolumes.go`). A config volume is mounted only when a disk uses it, as
/// KubeVirt does; the service account's token comes with the pod's own automount.
fn config_volumes(
    vmi: &VirtualMachineInstance,
    cfg: &TemplateConfig,
    volumes: &mut Vec<Volume>,
    mounts: &mut Vec<VolumeMount>,
) {
    let read_only = |name: &str, path: String, sub_path: Option<&str>| VolumeMount {
        read_only: Some(true),
        sub_path: sub_path.map(str::to_owned),
        ..mount(name, &path)
    };
    let secret = |name: String, secret_name: &str, optional: Option<bool>| Volume {
        name,
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret_name.to_owned()),
            optional,
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    };
    for v in &vmi.spec.volumes {
        let Some(source) = v.source() else { continue };
        let pod_volume = match source {
            VolumeSource::ConfigMap(c) => Volume {
                name: v.name.clone(),
                config_map: Some(ConfigMapVolumeSource {
                    name: c.name.clone().unwrap_or_default(),
                    optional: c.optional,
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            },
            VolumeSource::Secret(s) => secret(
                v.name.clone(),
                s.secret_name.as_deref().unwrap_or_default(),
                s.optional,
            ),
            VolumeSource::DownwardApi(d) => Volume {
                name: v.name.clone(),
                downward_api: Some(DownwardAPIVolumeSource {
                    items: (!d.fields.is_empty()).then(|| d.fields.clone()),
                    ..DownwardAPIVolumeSource::default()
                }),
                ..Volume::default()
            },
            VolumeSource::CloudInitNoCloud(ci) | VolumeSource::CloudInitConfigDrive(ci) => {
                let dir = format!(
                    "{}/{}/{}",
                    cfg.private_dir,
                    ConfigKind::Secret.source_dir().unwrap_or_default(),
                    v.name
                );
                for (reference, suffix, keys) in [
                    (
                        &ci.user_data_secret_ref,
                        configdisk::USER_DATA_POD_VOLUME_SUFFIX,
                        configdisk::USER_DATA_KEYS,
                    ),
                    (
                        &ci.network_data_secret_ref,
                        configdisk::NETWORK_DATA_POD_VOLUME_SUFFIX,
                        configdisk::NETWORK_DATA_KEYS,
                    ),
                ] {
                    let Some(reference) = reference else { continue };
                    let name = format!("{}{suffix}", v.name);
                    // Each key is mounted on its own: the Secret needs only one of them.
                    for key in keys {
                        mounts.push(read_only(&name, format!("{dir}/{key}"), Some(key)));
                    }
                    volumes.push(secret(name, &reference.name, None));
                }
                continue;
            }
            _ => continue,
        };
        volumes.push(pod_volume);
        if vmi
            .spec
            .domain
            .devices
            .disks
            .iter()
            .any(|d| d.name == v.name)
            && let Some(dir) = ConfigKind::of(&source).and_then(ConfigKind::source_dir)
        {
            mounts.push(read_only(
                &v.name,
                format!("{}/{dir}/{}", cfg.private_dir, v.name),
                None,
            ));
        }
    }
}

fn virtiofs_sockets_dir(cfg: &TemplateConfig) -> String {
    format!("{}/{}", cfg.share_dir, api::virtiofs::CONTAINERS_VOLUME)
}

/// KubeVirt's `generateVirtioFSContainers`: a `virtiofs-<volume>` container per filesystem, in
/// the volumes' order, running virtiofsd from the launcher image on the directory the volume
/// is mounted at (a config volume where the compute container would have it, a claim at
/// `/<volume>`, the service account's token where the pod's automount puts it), its socket in
/// the shared `virtiofs-containers` emptyDir. KubeVirt's resources (10m/100m CPU, 1M/80M
/// memory; the request is the limit in a Guaranteed pod).
///
/// Debian 12's virtiofsd is QEMU 7.2's C daemon, not KubeVirt's Rust one, so its arguments
/// are that daemon's spelling of KubeVirt's (`-o source=`, `-o cache=auto`), with the
/// `chroot` sandbox (its mode for containers; KubeVirt's `--sandbox=none` does not exist
/// there) and the open-file limit left as the runtime set it (raising it needs
/// `CAP_SYS_RESOURCE`). It cannot run unprivileged as KubeVirt's user 107 does: it keeps a
/// file server's capabilities for itself and needs `CAP_SYS_CHROOT` for the sandbox, so the
/// container runs as the image's root with exactly those. KubeVirt's migration flags
/// (`--migration-*`) and its service account `--translate-uid` have no counterpart; a VMI
/// with filesystems is not live-migratable (`api::migration`).
fn virtiofs_containers(
    vmi: &VirtualMachineInstance,
    cfg: &TemplateConfig,
    dedicated: bool,
) -> Vec<Container> {
    let filesystems = &vmi.spec.domain.devices.filesystems;
    let sockets = virtiofs_sockets_dir(cfg);
    let resources = support_container_resources(("10m", "1M"), ("100m", "80M"), dedicated);
    vmi.spec
        .volumes
        .iter()
        .filter(|v| filesystems.iter().any(|f| f.name == v.name))
        .map(|v| {
            let kind = v.source().as_ref().and_then(ConfigKind::of);
            let shared_dir = match kind {
                Some(kind) => kind.source_dir().map_or_else(
                    || configdisk::SERVICE_ACCOUNT_SOURCE_DIR.to_owned(),
                    |dir| format!("{}/{dir}/{}", cfg.private_dir, v.name),
                ),
                None => format!("/{}", v.name),
            };
            let mut mounts = vec![mount(api::virtiofs::CONTAINERS_VOLUME, &sockets)];
            // The token comes with the pod's automount, into every container.
            if kind != Some(ConfigKind::ServiceAccount) {
                mounts.push(mount(&v.name, &shared_dir));
            }
            let socket = api::virtiofs::socket_path(std::path::Path::new(&cfg.share_dir), &v.name);
            Container {
                name: api::virtiofs::container_name(&v.name),
                image: Some(cfg.launcher_image.clone()),
                image_pull_policy: Some(
                    api::defaults::pull_policy_for(&cfg.launcher_image)
                        .as_str()
                        .to_owned(),
                ),
                command: Some(vec![api::virtiofs::VIRTIOFSD.into()]),
                args: Some(vec![
                    format!("--socket-path={}", socket.display()),
                    "-o".into(),
                    format!("source={shared_dir}"),
                    "-o".into(),
                    "sandbox=chroot".into(),
                    "-o".into(),
                    "cache=auto".into(),
                    "--rlimit-nofile=0".into(),
                ]),
                volume_mounts: Some(mounts),
                resources: Some(resources.clone()),
                security_context: Some(SecurityContext {
                    allow_privilege_escalation: Some(false),
                    capabilities: Some(Capabilities {
                        add: Some(
                            [
                                "CHOWN",
                                "DAC_OVERRIDE",
                                "FOWNER",
                                "FSETID",
                                "SETGID",
                                "SETUID",
                                "MKNOD",
                                "SETFCAP",
                                "SYS_CHROOT",
                            ]
                            .map(str::to_owned)
                            .to_vec(),
                        ),
                        drop: Some(vec!["ALL".into()]),
                    }),
                    ..SecurityContext::default()
                }),
                ..Container::default()
            }
        })
        .collect()
}

/// KubeVirt's non-root support containers: user 107, no privilege escalation, no capabilities.
pub(crate) fn non_root_security_context() -> SecurityContext {
    SecurityContext {
        run_as_user: Some(107),
        run_as_non_root: Some(true),
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            add: None,
            drop: Some(vec!["ALL".into()]),
        }),
        ..SecurityContext::default()
    }
}

/// KubeVirt's minimal container-disk resources: the containers only serve a file.
fn container_disk_resources(dedicated: bool) -> ResourceRequirements {
    support_container_resources(("1m", "1M"), ("10m", "40M"), dedicated)
}

/// A support container's `(cpu, memory)` request and limit. With dedicated CPUs the request is
/// the limit, as every container of a Guaranteed pod needs
/// (`initContainerDedicatedCPURequiredResources`).
fn support_container_resources(
    request: (&str, &str),
    limit: (&str, &str),
    dedicated: bool,
) -> ResourceRequirements {
    let q = |(cpu, mem): (&str, &str)| {
        BTreeMap::from([
            ("cpu".to_owned(), Quantity(cpu.into())),
            ("memory".to_owned(), Quantity(mem.into())),
        ])
    };
    ResourceRequirements {
        requests: Some(q(if dedicated { limit } else { request })),
        limits: Some(q(limit)),
        ..ResourceRequirements::default()
    }
}

/// The VMI's CPU when it asks for dedicated CPUs (KubeVirt's `IsCPUDedicated`).
fn dedicated_cpus(vmi: &VirtualMachineInstance) -> Option<&api::vmi::Cpu> {
    vmi.spec
        .domain
        .cpu
        .as_ref()
        .filter(|c| c.dedicated_cpu_placement == Some(true))
}

fn compute_resources(
    vmi: &VirtualMachineInstance,
    cluster: &ClusterConfig,
) -> Result<ResourceRequirements, TemplateError> {
    let d = &vmi.spec.domain;
    let guest = guest_memory(vmi)?;
    let overhead = overhead::memory_overhead(vmi, guest, cluster.use_emulation);
    let request_base = match d.resources.requests.get("memory") {
        Some(q) => bytes_of(q, "spec.domain.resources.requests.memory")?,
        None => guest,
    };
    let overcommit = d.resources.overcommit_guest_overhead == Some(true);
    let limit = d
        .resources
        .limits
        .get("memory")
        .map(|q| bytes_of(q, "spec.domain.resources.limits.memory"))
        .transpose()?;
    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    let (memory_request, memory_limit) = match d.memory.as_ref().and_then(|m| m.hugepages.as_ref())
    {
        // KubeVirt's `WithHugePages`: guest RAM is `hugepages-<size>`, requested and limited
        // alike; memory is the overhead and what the request or limit sets beyond guest RAM.
        Some(hugepages) => {
            let pages = quantity_bytes(request_base.min(guest));
            let name = format!(
                "hugepages-{}",
                hugepages.page_size.as_deref().unwrap_or_default()
            );
            requests.insert(name.clone(), pages.clone());
            limits.insert(name, pages);
            (
                overhead + request_base.saturating_sub(guest),
                limit.map(|l| overhead + l.saturating_sub(guest)),
            )
        }
        None if overcommit => (request_base, limit.map(|l| l + overhead)),
        None => (request_base + overhead, limit.map(|l| l + overhead)),
    };
    requests.insert("memory".to_owned(), quantity_bytes(memory_request));
    requests.insert(
        "cpu".to_owned(),
        d.resources
            .requests
            .get("cpu")
            .cloned()
            .unwrap_or_else(|| cluster.cpu_request.clone()),
    );
    if let Some(l) = memory_limit {
        limits.insert("memory".to_owned(), quantity_bytes(l));
    }
    if let Some(q) = d.resources.limits.get("cpu") {
        limits.insert("cpu".to_owned(), q.clone());
    }
    // KubeVirt's `WithCPUPinning`: a Guaranteed pod whose whole CPUs the kubelet's static CPU
    // manager gives the compute container exclusively, one per vCPU and one more for the
    // emulator thread; memory limited to what is requested.
    if let Some(cpu) = dedicated_cpus(vmi) {
        let count = cpu.vcpus() + u32::from(cpu.isolate_emulator_thread == Some(true));
        let count = Quantity(count.to_string());
        requests.insert("cpu".to_owned(), count.clone());
        limits.insert("cpu".to_owned(), count);
        limits.insert("memory".to_owned(), requests["memory"].clone());
    }
    let one = || Quantity("1".into());
    if !cluster.use_emulation {
        limits.insert(KVM_RESOURCE.into(), one());
    }
    limits.insert(TUN_RESOURCE.into(), one());
    let virtio_net = vmi
        .spec
        .domain
        .devices
        .interfaces
        .iter()
        .any(|i| i.model_or_default() == InterfaceModel::Virtio);
    if virtio_net && !cluster.use_emulation {
        limits.insert(VHOST_NET_RESOURCE.into(), one());
    }
    // Device plugin resources must be requested as much as limited.
    for (k, v) in &limits {
        if k.starts_with("devices.kubevirt.io/") {
            requests.insert(k.clone(), v.clone());
        }
    }
    Ok(ResourceRequirements {
        requests: Some(requests),
        limits: Some(limits),
        ..ResourceRequirements::default()
    })
}

/// KubeVirt's CPU node selectors (`NodeSelectorRenderer`): a named model (not `host-model` or
/// `host-passthrough`) needs a node its labeller labelled with it, and each feature the VMI
/// requires (policy `require`, or none) one labelled with that feature. Both only when the
/// VMI names a model, which KubeVirt's defaults always do.
fn cpu_node_labels(spec: &api::vmi::VirtualMachineInstanceSpec) -> Vec<String> {
    let Some(cpu) = &spec.domain.cpu else {
        return Vec::new();
    };
    let Some(model) = cpu.model.as_deref().filter(|m| !m.is_empty()) else {
        return Vec::new();
    };
    let named = !matches!(model, "host-model" | "host-passthrough");
    named
        .then(|| format!("{}{model}", labels::CPU_MODEL))
        .into_iter()
        .chain(
            cpu.features
                .iter()
                .filter(|f| f.required())
                .map(|f| format!("{}{}", labels::CPU_FEATURE, f.name)),
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(yaml: &str) -> VirtualMachineInstance {
        let mut v: VirtualMachineInstance = serde_saphyr::from_str(yaml).unwrap();
        v.metadata.uid = Some("1234-abcd".into());
        v
    }

    /// The launcher pod of `v` in the default configuration, with no claims.
    fn render(v: &VirtualMachineInstance) -> Result<Pod, TemplateError> {
        render_launcher_pod(
            v,
            &TemplateConfig::default(),
            &ClusterConfig::default(),
            &|_| None,
        )
    }

    const SMALL: &str = "
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: testvmi, namespace: default, labels: {app: demo}}
spec:
  domain:
    resources: {requests: {memory: 128Mi}}
    devices: {}
";

    /// A ConfigDrive's Secret references: KubeVirt's `<volume>-udata` / `-ndata` volumes, each
    /// key mounted by `subPath` under the volume's secret dir.
    #[test]
    fn config_drive_secret_references_mount_their_keys() {
        let v = vmi(&format!(
            "{SMALL}  volumes:\n  - name: ci\n    cloudInitConfigDrive:\n      \
             secretRef: {{name: ud}}\n      networkDataSecretRef: {{name: nd}}\n"
        ));
        let pod = render(&v).unwrap();
        let spec = pod.spec.unwrap();
        let secrets: Vec<_> = spec
            .volumes
            .unwrap()
            .into_iter()
            .filter_map(|v| Some((v.name, v.secret?.secret_name?)))
            .collect();
        assert_eq!(
            secrets,
            [
                ("ci-udata".to_owned(), "ud".to_owned()),
                ("ci-ndata".to_owned(), "nd".to_owned())
            ]
        );
        let mounts: Vec<_> = spec.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .filter_map(|m| {
                Some((
                    m.name.as_str(),
                    m.mount_path.as_str(),
                    m.sub_path.as_deref()?,
                ))
            })
            .collect();
        let dir = "/var/run/kubevirt-private/secret/ci";
        assert_eq!(
            mounts,
            [
                ("ci-udata", &*format!("{dir}/userdata"), "userdata"),
                ("ci-udata", &*format!("{dir}/userData"), "userData"),
                ("ci-ndata", &*format!("{dir}/networkdata"), "networkdata"),
                ("ci-ndata", &*format!("{dir}/networkData"), "networkData"),
            ]
        );
    }

    /// Each probe kind as liveness and as readiness probe on the compute container.
    #[test]
    fn probes_become_the_compute_containers() {
        let compute = |probes: &str| {
            let pod = render(&vmi(&format!("{SMALL}  {probes}"))).unwrap();
            let c = pod.spec.unwrap().containers.swap_remove(0);
            assert_eq!(c.name, "compute");
            (
                serde_json::to_value(c.readiness_probe).unwrap(),
                serde_json::to_value(c.liveness_probe).unwrap(),
            )
        };
        let virt_probe = |timeout: &str, tail: &[&str]| -> Vec<String> {
            [
                "virt-probe",
                "--domainName",
                "default_testvmi",
                "--timeoutSeconds",
                timeout,
            ]
            .iter()
            .chain(tail)
            .map(|s| (*s).to_owned())
            .collect()
        };
        let defaults = |mut p: serde_json::Value, timeout: i32| {
            for (k, v) in [
                ("timeoutSeconds", timeout),
                ("periodSeconds", 10),
                ("successThreshold", 1),
                ("failureThreshold", 3),
            ] {
                p[k] = v.into();
            }
            p
        };

        let (readiness, liveness) = compute(
            "readinessProbe: {guestAgentPing: {}, periodSeconds: 2, failureThreshold: 5}
  livenessProbe: {exec: {command: [cat, /tmp/ok]}, initialDelaySeconds: 30}",
        );
        let mut want = defaults(
            serde_json::json!({"exec": {"command": virt_probe("1", &["--guestAgentPing"])}}),
            2,
        );
        want["periodSeconds"] = 2.into();
        want["failureThreshold"] = 5.into();
        assert_eq!(readiness, want);
        let mut want = defaults(
            serde_json::json!({"exec": {"command":
                virt_probe("1", &["--command", "cat", "--", "/tmp/ok"])}}),
            2,
        );
        want["initialDelaySeconds"] = 30.into();
        assert_eq!(liveness, want);

        // HTTP and TCP probes reach the guest through the pod's IP, unchanged; a command
        // that already is virt-probe is not wrapped twice.
        let (readiness, liveness) = compute(
            "readinessProbe: {tcpSocket: {port: 22}}
  livenessProbe: {httpGet: {port: 8080, path: /healthz, httpHeaders: [{name: X-A, value: b}]}}",
        );
        assert_eq!(
            readiness,
            defaults(serde_json::json!({"tcpSocket": {"port": 22}}), 1)
        );
        assert_eq!(
            liveness,
            defaults(
                serde_json::json!({"httpGet": {"port": 8080, "path": "/healthz",
                    "httpHeaders": [{"name": "X-A", "value": "b"}]}}),
                1
            )
        );
        let (readiness, liveness) =
            compute("readinessProbe: {exec: {command: [virt-probe, --guestAgentPing]}}");
        assert_eq!(
            readiness,
            defaults(
                serde_json::json!({"exec": {"command": ["virt-probe", "--guestAgentPing"]}}),
                1
            )
        );
        assert_eq!(liveness, serde_json::Value::Null);
    }

    #[test]
    fn resources_include_overhead_and_devices() {
        let v = vmi(SMALL);
        let pod = render(&v).unwrap();
        let r = pod.spec.unwrap().containers[0].resources.clone().unwrap();
        let req = r.requests.unwrap();
        let lim = r.limits.unwrap();
        assert_eq!(
            req["memory"].0,
            format_binary_si(i128::from(128u64 * (1 << 20) + 80 * (1 << 20) + 256 * 1024))
        );
        assert_eq!(req["cpu"].0, "100m");
        assert_eq!(lim[KVM_RESOURCE].0, "1");
        assert_eq!(lim[TUN_RESOURCE].0, "1");
        let emulated = ClusterConfig {
            use_emulation: true,
            ..ClusterConfig::default()
        };
        let pod =
            render_launcher_pod(&v, &TemplateConfig::default(), &emulated, &|_| None).unwrap();
        let c = &pod.spec.unwrap().containers[0];
        assert!(
            !c.resources
                .as_ref()
                .unwrap()
                .limits
                .as_ref()
                .unwrap()
                .contains_key(KVM_RESOURCE)
        );
        assert!(
            c.args
                .as_ref()
                .unwrap()
                .contains(&"--allow-emulation".to_owned())
        );
    }

    #[test]
    fn the_fail_fast_annotation_makes_the_launcher_crash() {
        let args = |v: &VirtualMachineInstance| {
            render(v).unwrap().spec.unwrap().containers[0]
                .args
                .clone()
                .unwrap()
        };
        let plain = vmi("
metadata: {name: a, namespace: default, uid: u1}
spec: {domain: {memory: {guest: 128Mi}, devices: {}}}
");
        assert!(!args(&plain).contains(&"--simulate-crash".to_owned()));
        let failing = vmi("
metadata:
  name: a
  namespace: default
  uid: u1
  annotations: {kubevirt.io/func-test-virt-launcher-fail-fast: \"\"}
spec: {domain: {memory: {guest: 128Mi}, devices: {}}}
");
        assert!(args(&failing).contains(&"--simulate-crash".to_owned()));
    }

    #[test]
    fn a_missing_claim_is_reported_with_its_field() {
        let v = vmi(&format!(
            "{SMALL}  volumes:\n  - name: base\n    ephemeral:\n      \
             persistentVolumeClaim: {{claimName: gone}}\n"
        ));
        let e = render(&v).unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.volumes[0].ephemeral.persistentVolumeClaim.claimName: PVC default/gone does \
             not exist"
        );
        assert_eq!(missing_claim(&v, &|_| None), Some(e));
        assert_eq!(
            missing_claim(&v, &|_| Some(PersistentVolumeClaim::default())),
            None
        );
    }

    #[test]
    fn missing_memory_is_reported_with_its_field() {
        let v = vmi("
metadata: {name: a, namespace: default}
spec: {domain: {devices: {}}}
");
        let e = render(&v).unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.domain.resources.requests.memory: the VMI sets no memory"
        );
    }

    #[test]
    fn node_selector_adds_schedulable() {
        let v = vmi("
metadata: {name: a, namespace: default}
spec: {nodeSelector: {disk: ssd}, domain: {resources: {requests: {memory: 64Mi}}, devices: {}}}
");
        let pod = render(&v).unwrap();
        let sel = pod.spec.unwrap().node_selector.unwrap();
        assert_eq!(sel.len(), 2);
        assert_eq!(
            (sel["disk"].as_str(), sel[labels::NODE_SCHEDULABLE].as_str()),
            ("ssd", "true")
        );
    }

    #[test]
    fn cpu_models_and_required_features_select_labelled_nodes() {
        let selector = |cpu: &str| {
            let v = vmi(&format!(
                "
metadata: {{name: a, namespace: default}}
spec: {{domain: {{cpu: {cpu}, resources: {{requests: {{memory: 64Mi}}}}, devices: {{}}}}}}
"
            ));
            let pod = render(&v).unwrap();
            let mut keys: Vec<String> = pod
                .spec
                .unwrap()
                .node_selector
                .unwrap()
                .into_keys()
                .collect();
            keys.retain(|k| k != labels::NODE_SCHEDULABLE);
            keys
        };
        let features = "[{name: pcid}, {name: avx, policy: require}, {name: mpx, policy: disable},
            {name: x2apic, policy: force}, {name: ssse3, policy: optional}, {name: tsc, policy: forbid}]";
        assert_eq!(
            selector(&format!(
                "{{model: Skylake-Client-IBRS, features: {features}}}"
            )),
            [
                "cpu-feature.node.kubevirt.io/avx",
                "cpu-feature.node.kubevirt.io/pcid",
                "cpu-model.node.kubevirt.io/Skylake-Client-IBRS",
            ]
        );
        assert_eq!(
            selector(&format!("{{model: host-model, features: {features}}}")),
            [
                "cpu-feature.node.kubevirt.io/avx",
                "cpu-feature.node.kubevirt.io/pcid",
            ]
        );
        assert!(selector("{model: host-passthrough}").is_empty());
        // No model, no selector: KubeVirt's defaults always set one (`host-model`).
        assert!(selector(&format!("{{features: {features}}}")).is_empty());
    }
}
