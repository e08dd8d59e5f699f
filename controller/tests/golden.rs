//! The rendered launcher pod of a representative VMI matches the checked-in YAML.
//!
//! After an intended change to the template, regenerate with
//! `UPDATE_GOLDEN=1 cargo nextest run -p controller --test golden` and review the diff.

use std::path::PathBuf;

use api::{ClusterConfig, VirtualMachineInstance};
use controller::template::{TemplateConfig, render_launcher_pod};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PersistentVolumeClaimSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// The claims the golden VMIs name, with their volume modes.
const CLAIMS: &[(&str, &str)] = &[
    ("data-pvc", "Filesystem"),
    ("golden-image", "Filesystem"),
    ("raw-disk", "Block"),
    ("block-image", "Block"),
];

fn claim(name: &str) -> Option<PersistentVolumeClaim> {
    let (_, mode) = CLAIMS.iter().find(|(n, _)| *n == name)?;
    Some(PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            volume_mode: Some((*mode).to_owned()),
            ..PersistentVolumeClaimSpec::default()
        }),
        status: None,
    })
}

fn check(vmi_file: &str, golden_file: &str, cluster: &ClusterConfig) {
    let vmi: VirtualMachineInstance =
        serde_saphyr::from_str(&std::fs::read_to_string(dir().join(vmi_file)).unwrap()).unwrap();
    let cfg = TemplateConfig {
        launcher_image: "registry.example/kubevirt-rs/virt-launcher:v0.1.0".into(),
        ..TemplateConfig::default()
    };
    let pod = render_launcher_pod(&vmi, &cfg, cluster, &claim).unwrap();
    // Long lines stay whole (not folded), as in the checked-in CRDs.
    let options = serde_saphyr::ser_options! { folded_wrap_chars: usize::MAX };
    let rendered = serde_saphyr::to_string_with_options(&pod, options).unwrap();
    let golden = dir().join(golden_file);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, &rendered).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&golden).unwrap_or_default();
    pretty_assertions::assert_eq!(
        want,
        rendered,
        "the launcher pod differs from {}; if the change is intended, regenerate with \
         `UPDATE_GOLDEN=1 cargo nextest run -p controller --test golden` and review the diff",
        golden.display()
    );
}

#[test]
fn launcher_pod_matches_golden() {
    check("vmi.yaml", "launcher-pod.yaml", &ClusterConfig::default());
}

#[test]
fn emulated_launcher_pod_matches_golden() {
    let cluster = ClusterConfig {
        use_emulation: true,
        ..ClusterConfig::default()
    };
    check("vmi.yaml", "launcher-pod-emulated.yaml", &cluster);
}

/// `spec.domain.firmware.kernelBoot.container` gets KubeVirt's `volumekernel-boot-volume`
/// containers serving `kernel-boot.sock`, and the image's pull secret.
#[test]
fn kernel_boot_launcher_pod_matches_golden() {
    check(
        "vmi-kernel-boot.yaml",
        "launcher-pod-kernel-boot.yaml",
        &ClusterConfig::default(),
    );
}

/// Config disks and cloud-init Secret references: KubeVirt's pod volumes, mounted read-only
/// under the private dir (`config-map/`, `secret/`, `downwardapi/`; cloud-init keys by
/// `subPath`), and the service account's token through the pod's automount.
#[test]
fn config_volumes_launcher_pod_matches_golden() {
    check(
        "vmi-config-volumes.yaml",
        "launcher-pod-config-volumes.yaml",
        &ClusterConfig::default(),
    );
}

/// `dedicatedCpuPlacement` with `isolateEmulatorThread` (KubeVirt's `WithCPUPinning`): a
/// Guaranteed pod, every container's requests equal to its limits, three whole CPUs for two
/// vCPUs and the emulator thread, and the `kubevirt.io/cpumanager` node selector.
#[test]
fn dedicated_cpus_launcher_pod_matches_golden() {
    check(
        "vmi-dedicated-cpus.yaml",
        "launcher-pod-dedicated-cpus.yaml",
        &ClusterConfig::default(),
    );
}

/// Block claims (a `persistentVolumeClaim` and an `ephemeral` volume's) as KubeVirt's
/// `volumeDevices` at `/dev/<volume>`, a filesystem claim mounted under `vmi-disks/`, and
/// `memory.hugepages`: guest RAM as `hugepages-2Mi`, the memory request only the overhead, a
/// `HugePages` emptyDir at `/dev/hugepages`.
#[test]
fn block_claims_and_hugepages_launcher_pod_matches_golden() {
    check(
        "vmi-block-hugepages.yaml",
        "launcher-pod-block-hugepages.yaml",
        &ClusterConfig::default(),
    );
}

/// `efi.persistent` (KubeVirt's `withBackendStorage`): the claim named in the VMI's
/// `status.volumeStatus` as the volume `vm-state`, its `nvram` directory mounted at
/// `/var/lib/libvirt/qemu/nvram`.
#[test]
fn persistent_efi_launcher_pod_matches_golden() {
    check(
        "vmi-persistent-efi.yaml",
        "launcher-pod-persistent-efi.yaml",
        &ClusterConfig::default(),
    );
}

/// `filesystems` (KubeVirt's `generateVirtioFSContainers` and `withVirioFS`): a
/// `virtiofs-<volume>` container per filesystem running the launcher image's virtiofsd on the
/// volume's directory (a ConfigMap where the compute container would mount it, the service
/// account's token through the pod's automount, a claim at `/<volume>`), and the
/// `virtiofs-containers` emptyDir of their sockets in both.
#[test]
fn virtiofs_launcher_pod_matches_golden() {
    check(
        "vmi-virtiofs.yaml",
        "launcher-pod-virtiofs.yaml",
        &ClusterConfig::default(),
    );
}
