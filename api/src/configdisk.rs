//! KubeVirt's config disks (`pkg/config`): a ConfigMap, Secret, Downward API or service account
//! volume reaches the guest as an ISO9660 image of the directory the launcher pod has it
//! mounted at. virt-controller mounts the source (`rendervolumes.go`), the launcher builds the
//! image and attaches it as the volume's disk. The names here are KubeVirt's; the directories
//! are relative to the launcher's private dir (`/var/run/kubevirt-private`), except the service
//! account's, which is where Kubernetes mounts a pod's token.

use crate::vmi::VolumeSource;

/// Where the service account token, CA and namespace are: the mount the ServiceAccount
/// admission plugin gives every container of a pod that automounts its token.
pub const SERVICE_ACCOUNT_SOURCE_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The service account disk's directory under the private dir (only one such volume is allowed).
pub const SERVICE_ACCOUNT_DISK_DIR: &str = "service-account-disk";
/// The service account disk's file name.
pub const SERVICE_ACCOUNT_DISK_NAME: &str = "service-account.iso";
/// The volume label of a config disk whose volume sets none (`xorrisofs -volid cfgdata`).
pub const DEFAULT_VOLUME_LABEL: &str = "cfgdata";

/// The keys of a cloud-init `secretRef`'s Secret that hold user data, the first found wins.
pub const USER_DATA_KEYS: [&str; 2] = ["userdata", "userData"];
/// The keys of a cloud-init `networkDataSecretRef`'s Secret that hold network data.
pub const NETWORK_DATA_KEYS: [&str; 2] = ["networkdata", "networkData"];
/// Suffix of the launcher pod volume of a cloud-init `secretRef` (`<volume>-udata`).
pub const USER_DATA_POD_VOLUME_SUFFIX: &str = "-udata";
/// Suffix of the launcher pod volume of a cloud-init `networkDataSecretRef`.
pub const NETWORK_DATA_POD_VOLUME_SUFFIX: &str = "-ndata";

/// Which kind of config disk a volume is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigKind {
    ConfigMap,
    Secret,
    DownwardApi,
    ServiceAccount,
}

impl ConfigKind {
    /// The kind of `source`, when it is a config disk.
    pub fn of(source: &VolumeSource<'_>) -> Option<Self> {
        Some(match source {
            VolumeSource::ConfigMap(_) => Self::ConfigMap,
            VolumeSource::Secret(_) => Self::Secret,
            VolumeSource::DownwardApi(_) => Self::DownwardApi,
            VolumeSource::ServiceAccount(_) => Self::ServiceAccount,
            _ => return None,
        })
    }

    /// The directory under the private dir where the pod mounts volumes of this kind, one
    /// subdirectory per volume (`config-map/<volume>`); `None` for the service account, whose
    /// source is [`SERVICE_ACCOUNT_SOURCE_DIR`]. Cloud-init secret references are mounted under
    /// the Secret kind's directory too.
    pub fn source_dir(self) -> Option<&'static str> {
        match self {
            Self::ConfigMap => Some("config-map"),
            Self::Secret => Some("secret"),
            Self::DownwardApi => Some("downwardapi"),
            Self::ServiceAccount => None,
        }
    }

    /// The image's path under the private dir: `<kind>-disks/<volume>.iso`, or the one
    /// service account disk.
    pub fn disk_path(self, volume: &str) -> String {
        let dir = match self {
            Self::ConfigMap => "config-map-disks",
            Self::Secret => "secret-disks",
            Self::DownwardApi => "downwardapi-disks",
            Self::ServiceAccount => {
                return format!("{SERVICE_ACCOUNT_DISK_DIR}/{SERVICE_ACCOUNT_DISK_NAME}");
            }
        };
        format!("{dir}/{volume}.iso")
    }
}

/// The volume label of a config disk: the volume's `volumeLabel`, else [`DEFAULT_VOLUME_LABEL`]
/// (always so for a service account, which has no such field).
pub fn volume_label<'a>(source: &VolumeSource<'a>) -> &'a str {
    let label = match source {
        VolumeSource::ConfigMap(c) => c.volume_label.as_deref(),
        VolumeSource::Secret(s) => s.volume_label.as_deref(),
        VolumeSource::DownwardApi(d) => d.volume_label.as_deref(),
        _ => None,
    };
    label
        .filter(|l| !l.is_empty())
        .unwrap_or(DEFAULT_VOLUME_LABEL)
}
