//! KubeVirt's subresource API (`subresources.kubevirt.io`), shared by virt-api (the server) and
//! virtctl (the client): the group, its versions, the subresource names, the request bodies
//! (`*Options`, KubeVirt's JSON) and the paths, so both ends agree by construction.
//!
//! KubeVirt serves the same subresources under `v1` and `v1alpha3`; virtctl uses `v1`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::vmi::{DataVolumeSource, Disk, PersistentVolumeClaimSource, Volume};

/// The aggregated API group virt-api serves.
pub const GROUP: &str = "subresources.kubevirt.io";
/// The version virtctl talks.
pub const VERSION: &str = "v1";
/// Every version virt-api serves, newest first (KubeVirt's order of preference).
pub const VERSIONS: [&str; 2] = ["v1", "v1alpha3"];
/// The websocket subprotocol of console, VNC and port-forward streams.
pub const PLAIN_STREAM_PROTOCOL: &str = "plain.kubevirt.io";

/// A subresource of `virtualmachineinstances`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VmiSubresource {
    Console,
    Vnc,
    VncScreenshot,
    Pause,
    Unpause,
    Freeze,
    Unfreeze,
    SoftReboot,
    Reset,
    GuestOsInfo,
    UserList,
    FilesystemList,
    AddVolume,
    RemoveVolume,
    PortForward,
}

impl VmiSubresource {
    /// Every VMI subresource, in the order of KubeVirt's discovery document.
    pub const ALL: [VmiSubresource; 15] = [
        VmiSubresource::Console,
        VmiSubresource::Vnc,
        VmiSubresource::VncScreenshot,
        VmiSubresource::Pause,
        VmiSubresource::Unpause,
        VmiSubresource::Freeze,
        VmiSubresource::Unfreeze,
        VmiSubresource::SoftReboot,
        VmiSubresource::Reset,
        VmiSubresource::GuestOsInfo,
        VmiSubresource::UserList,
        VmiSubresource::FilesystemList,
        VmiSubresource::AddVolume,
        VmiSubresource::RemoveVolume,
        VmiSubresource::PortForward,
    ];

    /// The path segment(s) after `virtualmachineinstances/{name}/`, which is also the name RBAC
    /// rules use (`virtualmachineinstances/console`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            VmiSubresource::Console => "console",
            VmiSubresource::Vnc => "vnc",
            VmiSubresource::VncScreenshot => "vnc/screenshot",
            VmiSubresource::Pause => "pause",
            VmiSubresource::Unpause => "unpause",
            VmiSubresource::Freeze => "freeze",
            VmiSubresource::Unfreeze => "unfreeze",
            VmiSubresource::SoftReboot => "softreboot",
            VmiSubresource::Reset => "reset",
            VmiSubresource::GuestOsInfo => "guestosinfo",
            VmiSubresource::UserList => "userlist",
            VmiSubresource::FilesystemList => "filesystemlist",
            VmiSubresource::AddVolume => "addvolume",
            VmiSubresource::RemoveVolume => "removevolume",
            VmiSubresource::PortForward => "portforward",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The HTTP method KubeVirt serves it on: websockets and reads are `GET`, actions `PUT`.
    pub fn method(self) -> &'static str {
        match self {
            VmiSubresource::Console
            | VmiSubresource::Vnc
            | VmiSubresource::VncScreenshot
            | VmiSubresource::GuestOsInfo
            | VmiSubresource::UserList
            | VmiSubresource::FilesystemList
            | VmiSubresource::PortForward => "GET",
            _ => "PUT",
        }
    }

    /// Whether it is a websocket stream.
    pub fn is_stream(self) -> bool {
        matches!(
            self,
            VmiSubresource::Console | VmiSubresource::Vnc | VmiSubresource::PortForward
        )
    }
}

/// A subresource of `virtualmachines`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VmSubresource {
    Start,
    Stop,
    Restart,
    Migrate,
    AddVolume,
    RemoveVolume,
    PortForward,
}

impl VmSubresource {
    pub const ALL: [VmSubresource; 7] = [
        VmSubresource::Start,
        VmSubresource::Stop,
        VmSubresource::Restart,
        VmSubresource::Migrate,
        VmSubresource::AddVolume,
        VmSubresource::RemoveVolume,
        VmSubresource::PortForward,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            VmSubresource::Start => "start",
            VmSubresource::Stop => "stop",
            VmSubresource::Restart => "restart",
            VmSubresource::Migrate => "migrate",
            VmSubresource::AddVolume => "addvolume",
            VmSubresource::RemoveVolume => "removevolume",
            VmSubresource::PortForward => "portforward",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }

    pub fn method(self) -> &'static str {
        match self {
            VmSubresource::PortForward => "GET",
            _ => "PUT",
        }
    }
}

/// `/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/{name}/{sub}`.
pub fn vmi_path(namespace: &str, name: &str, sub: VmiSubresource) -> String {
    format!(
        "/apis/{GROUP}/{VERSION}/namespaces/{namespace}/virtualmachineinstances/{name}/{}",
        sub.as_str()
    )
}

/// `/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachines/{name}/{sub}`.
pub fn vm_path(namespace: &str, name: &str, sub: VmSubresource) -> String {
    format!(
        "/apis/{GROUP}/{VERSION}/namespaces/{namespace}/virtualmachines/{name}/{}",
        sub.as_str()
    )
}

/// The port-forward stream to `port` over `protocol` (`tcp` or `udp`), as KubeVirt's
/// `.../portforward/{port}/{protocol}` (the kind is `virtualmachineinstances` or
/// `virtualmachines`).
pub fn portforward_path(
    namespace: &str,
    kind: &str,
    name: &str,
    port: u16,
    protocol: &str,
) -> String {
    format!(
        "/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{kind}/{name}/portforward/{port}/{protocol}"
    )
}

/// `PUT .../virtualmachines/{name}/start`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartOptions {
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dry_run: Vec<String>,
}

/// `PUT .../virtualmachines/{name}/stop`: `gracePeriod` replaces the VMI's
/// `terminationGracePeriodSeconds` for this shutdown (0 with `--force` kills at once).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StopOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_period: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dry_run: Vec<String>,
}

/// `PUT .../virtualmachines/{name}/restart`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestartOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_period_seconds: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dry_run: Vec<String>,
}

/// `PUT .../virtualmachines/{name}/migrate`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrateOptions {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dry_run: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub added_node_selector: BTreeMap<String, String>,
}

/// `PUT .../virtualmachineinstances/{name}/pause` and `unpause`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PauseOptions {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dry_run: Vec<String>,
}

/// `PUT .../virtualmachineinstances/{name}/freeze`: the guest is thawed after `unfreezeTimeout`
/// (a Go duration, KubeVirt's default `5m`) if nobody unfreezes it first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FreezeUnfreezeTimeout {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unfreeze_timeout: Option<String>,
}

/// `GET .../virtualmachineinstances/{name}/vnc/screenshot?moveCursor=...`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScreenshotOptions {
    #[serde(default)]
    pub move_cursor: bool,
}

/// KubeVirt's `HotplugVolumeSource`: the claim a hotplugged volume is backed by.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HotplugVolumeSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<PersistentVolumeClaimSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_volume: Option<DataVolumeSource>,
}

impl HotplugVolumeSource {
    /// The DataVolume's or claim's name, the DataVolume first (KubeVirt's `volumeSourceName`);
    /// empty when neither is set.
    pub fn name(&self) -> &str {
        match (&self.data_volume, &self.persistent_volume_claim) {
            (Some(dv), _) => &dv.name,
            (None, Some(pvc)) => &pvc.claim_name,
            (None, None) => "",
        }
    }
}

/// `PUT .../virtualmachines/{name}/addvolume` (and of a VMI): a hotplug disk and its volume,
/// both named `name`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AddVolumeOptions {
    #[serde(default)]
    pub name: String,
    /// Its name is the request's; a body may leave it out.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "unnamed_disk"
    )]
    pub disk: Option<Disk>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_source: Option<HotplugVolumeSource>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dry_run: Vec<String>,
}

/// A [`Disk`] whose `name` may be missing (it becomes empty).
fn unnamed_disk<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Disk>, D::Error> {
    let Some(mut v) = Option::<serde_json::Value>::deserialize(d)? else {
        return Ok(None);
    };
    if let Some(o) = v.as_object_mut() {
        o.entry("name").or_insert_with(|| "".into());
    }
    serde_json::from_value(v)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

impl AddVolumeOptions {
    /// The volume this adds, as KubeVirt's `ApplyVolumeRequestOnVMISpec` makes it: named as the
    /// request, its claim (the PVC when both are given) marked `hotpluggable`; no source when
    /// the request has none.
    pub fn volume(&self) -> Volume {
        let source = self.volume_source.clone().unwrap_or_default();
        let mut v = Volume {
            name: self.name.clone(),
            ..Volume::default()
        };
        if let Some(mut pvc) = source.persistent_volume_claim {
            pvc.hotpluggable = Some(true);
            v.persistent_volume_claim = Some(pvc);
        } else if let Some(mut dv) = source.data_volume {
            dv.hotpluggable = Some(true);
            v.data_volume = Some(dv);
        }
        v
    }
}

/// `PUT .../virtualmachines/{name}/removevolume` (and of a VMI).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RemoveVolumeOptions {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dry_run: Vec<String>,
}

/// The only dry-run directive Kubernetes knows.
pub const DRY_RUN_ALL: &str = "All";

/// The label naming a migration's VMI (KubeVirt's `MigrationSelectorLabel`): set on every
/// VirtualMachineInstanceMigration, selected on by `virtctl migrate-cancel`.
pub const MIGRATION_SELECTOR_LABEL: &str = "kubevirt.io/vmi-name";

/// `GET /apis/subresources.kubevirt.io/v1/version`.
pub fn version_path() -> String {
    format!("/apis/{GROUP}/{VERSION}/version")
}

/// The answer of [`version_path`], KubeVirt's `version.Info` (what `virtctl version` prints).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VersionInfo {
    #[serde(default)]
    pub git_version: String,
    #[serde(default)]
    pub git_commit: String,
    #[serde(default)]
    pub git_tree_state: String,
    #[serde(default)]
    pub build_date: String,
    #[serde(default)]
    pub go_version: String,
    #[serde(default)]
    pub compiler: String,
    #[serde(default)]
    pub platform: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_kubevirts() {
        assert_eq!(
            vmi_path("default", "demo", VmiSubresource::VncScreenshot),
            "/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachineinstances/demo/vnc/screenshot"
        );
        assert_eq!(
            vm_path("ns", "vm", VmSubresource::Stop),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachines/vm/stop"
        );
        assert_eq!(
            portforward_path("ns", "virtualmachineinstances", "vmi", 22, "tcp"),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vmi/portforward/22/tcp"
        );
    }

    #[test]
    fn names_round_trip() {
        for s in VmiSubresource::ALL {
            assert_eq!(VmiSubresource::parse(s.as_str()), Some(s));
        }
        for s in VmSubresource::ALL {
            assert_eq!(VmSubresource::parse(s.as_str()), Some(s));
        }
        assert_eq!(VmiSubresource::parse("nope"), None);
    }

    #[test]
    fn options_speak_kubevirts_json() {
        let stop = StopOptions {
            grace_period: Some(0),
            dry_run: vec![],
        };
        assert_eq!(
            serde_json::to_value(&stop).unwrap(),
            serde_json::json!({"gracePeriod": 0})
        );
        let restart: RestartOptions =
            serde_json::from_str(r#"{"gracePeriodSeconds":0,"dryRun":["All"]}"#).unwrap();
        assert_eq!(restart.grace_period_seconds, Some(0));
        assert_eq!(restart.dry_run, vec![DRY_RUN_ALL]);
        let freeze: FreezeUnfreezeTimeout =
            serde_json::from_str(r#"{"unfreezeTimeout":"5m0s"}"#).unwrap();
        assert_eq!(freeze.unfreeze_timeout.as_deref(), Some("5m0s"));
    }

    #[test]
    fn version_speaks_kubevirts_json() {
        assert_eq!(version_path(), "/apis/subresources.kubevirt.io/v1/version");
        let v: VersionInfo =
            serde_json::from_str(r#"{"gitVersion":"v1.5.0","platform":"linux/amd64"}"#).unwrap();
        assert_eq!(
            (v.git_version.as_str(), v.platform.as_str()),
            ("v1.5.0", "linux/amd64")
        );
        assert!(v.git_commit.is_empty());
    }

    #[test]
    fn add_volume_speaks_kubevirts_json() {
        let o: AddVolumeOptions = serde_json::from_value(serde_json::json!({
            "name": "extra",
            "disk": {"name": "extra", "disk": {"bus": "scsi"}, "serial": "extra"},
            "volumeSource": {"persistentVolumeClaim": {"claimName": "pvc1"}},
            "dryRun": ["All"]
        }))
        .unwrap();
        assert_eq!(o.volume_source.as_ref().unwrap().name(), "pvc1");
        assert_eq!(
            serde_json::to_value(o.volume()).unwrap(),
            serde_json::json!({"name": "extra", "persistentVolumeClaim": {"claimName": "pvc1", "hotpluggable": true}})
        );
        let dv = AddVolumeOptions {
            name: "d".into(),
            volume_source: Some(HotplugVolumeSource {
                data_volume: Some(DataVolumeSource {
                    name: "dv1".into(),
                    hotpluggable: None,
                }),
                ..HotplugVolumeSource::default()
            }),
            ..AddVolumeOptions::default()
        };
        assert_eq!(
            serde_json::to_value(&dv).unwrap(),
            serde_json::json!({"name": "d", "volumeSource": {"dataVolume": {"name": "dv1"}}})
        );
        assert_eq!(
            serde_json::to_value(dv.volume()).unwrap(),
            serde_json::json!({"name": "d", "dataVolume": {"name": "dv1", "hotpluggable": true}})
        );
        let unnamed: AddVolumeOptions =
            serde_json::from_str(r#"{"name": "x", "disk": {"disk": {"bus": "virtio"}}}"#).unwrap();
        assert_eq!(unnamed.disk.unwrap().name, "");
        // An empty body decodes, so virt-api can name what is missing.
        let empty: AddVolumeOptions = serde_json::from_str("{}").unwrap();
        assert_eq!(empty, AddVolumeOptions::default());
        let empty: RemoveVolumeOptions = serde_json::from_str("{}").unwrap();
        assert!(empty.name.is_empty());
    }

    #[test]
    fn the_data_volume_names_a_source_first() {
        let both = HotplugVolumeSource {
            persistent_volume_claim: Some(PersistentVolumeClaimSource {
                claim_name: "pvc".into(),
                ..PersistentVolumeClaimSource::default()
            }),
            data_volume: Some(DataVolumeSource {
                name: "dv".into(),
                hotpluggable: None,
            }),
        };
        assert_eq!(both.name(), "dv");
        assert_eq!(HotplugVolumeSource::default().name(), "");
    }
}
