//! The guest agent's answers (`launcher_api::guest`, QGA's JSON) in KubeVirt's shapes:
//! `VirtualMachineInstanceGuestAgentInfo`, `VirtualMachineInstanceGuestOSUserList`,
//! `VirtualMachineInstanceFileSystemList` (`kubevirt.io/api/core/v1/types.go`). The api crate
//! does not carry these subresource types, so they live here.

use api::status::VirtualMachineInstanceGuestOsInfo;
use launcher_api::guest::{QgaFilesystem, QgaHostName, QgaInfo, QgaOsInfo, QgaTimezone, QgaUser};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestAgentCommandInfo {
    pub name: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub enabled: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestOsUser {
    pub user_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    pub login_time: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FileSystemDisk {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    pub bus_type: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FileSystem {
    pub disk_name: String,
    pub mount_point: String,
    pub file_system_type: String,
    pub used_bytes: u64,
    pub total_bytes: u64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disk: Vec<FileSystemDisk>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FileSystemInfo {
    pub disks: Vec<FileSystem>,
}

/// `GET …/guestosinfo`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestAgentInfo {
    #[serde(rename = "guestAgentVersion", skip_serializing_if = "String::is_empty")]
    pub ga_version: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub hostname: String,
    /// KubeVirt's `"<zone>, <offset in seconds>"`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub timezone: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub supported_commands: Vec<GuestAgentCommandInfo>,
    pub os: VirtualMachineInstanceGuestOsInfo,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub user_list: Vec<GuestOsUser>,
    pub fs_info: FileSystemInfo,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fs_freeze_status: Option<String>,
}

/// `GET …/userlist`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GuestOsUserList {
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub items: Vec<GuestOsUser>,
}

/// `GET …/filesystemlist`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FileSystemList {
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub items: Vec<FileSystem>,
}

pub fn os_info(q: QgaOsInfo) -> VirtualMachineInstanceGuestOsInfo {
    VirtualMachineInstanceGuestOsInfo {
        name: q.name,
        kernel_release: q.kernel_release,
        version: q.version,
        pretty_name: q.pretty_name,
        version_id: q.version_id,
        kernel_version: q.kernel_version,
        machine: q.machine,
        id: q.id,
    }
}

pub fn users(q: Vec<QgaUser>) -> Vec<GuestOsUser> {
    q.into_iter()
        .map(|u| GuestOsUser {
            user_name: u.user,
            domain: u.domain,
            login_time: u.login_time,
        })
        .collect()
}

pub fn filesystems(q: Vec<QgaFilesystem>) -> Vec<FileSystem> {
    q.into_iter()
        .map(|f| FileSystem {
            disk_name: f.name,
            mount_point: f.mountpoint,
            file_system_type: f.type_,
            used_bytes: f.used_bytes.unwrap_or(0),
            total_bytes: f.total_bytes.unwrap_or(0),
            disk: f
                .disk
                .into_iter()
                .map(|d| FileSystemDisk {
                    serial: d.serial,
                    bus_type: d.bus_type,
                })
                .collect(),
        })
        .collect()
}

pub fn agent_info(
    info: QgaInfo,
    host: QgaHostName,
    timezone: QgaTimezone,
    os: QgaOsInfo,
    user_list: Vec<QgaUser>,
    fs: Vec<QgaFilesystem>,
    fs_freeze_status: Option<String>,
) -> GuestAgentInfo {
    GuestAgentInfo {
        ga_version: info.version,
        hostname: host.host_name,
        timezone: format!("{}, {}", timezone.zone.unwrap_or_default(), timezone.offset),
        supported_commands: info
            .supported_commands
            .into_iter()
            .map(|c| GuestAgentCommandInfo {
                name: c.name,
                enabled: c.enabled,
            })
            .collect(),
        os: os_info(os),
        user_list: users(user_list),
        fs_info: FileSystemInfo {
            disks: filesystems(fs),
        },
        fs_freeze_status,
    }
}

pub fn user_list(q: Vec<QgaUser>) -> GuestOsUserList {
    GuestOsUserList {
        metadata: serde_json::Map::new(),
        items: users(q),
    }
}

pub fn filesystem_list(q: Vec<QgaFilesystem>) -> FileSystemList {
    FileSystemList {
        metadata: serde_json::Map::new(),
        items: filesystems(q),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::json;

    #[test]
    fn qga_answers_become_kubevirt_shapes() {
        let info: QgaInfo = serde_json::from_value(json!({
            "version": "7.2.0",
            "supported_commands": [
                {"name": "guest-ping", "enabled": true, "success-response": true},
                {"name": "guest-exec", "enabled": false, "success-response": true}
            ]
        }))
        .expect("guest-info");
        let os: QgaOsInfo = serde_json::from_value(json!({
            "kernel-release": "6.1.0-13-cloud-amd64", "kernel-version": "#1 SMP",
            "machine": "x86_64", "id": "debian", "name": "Debian GNU/Linux",
            "pretty-name": "Debian GNU/Linux 12 (bookworm)", "version": "12 (bookworm)",
            "version-id": "12"
        }))
        .expect("osinfo");
        let users: Vec<QgaUser> = serde_json::from_value(json!([
            {"user": "root", "login-time": 1_700_000_000.5}
        ]))
        .expect("users");
        let fs: Vec<QgaFilesystem> = serde_json::from_value(json!([
            {"name": "vda1", "mountpoint": "/", "type": "ext4", "used-bytes": 100, "total-bytes": 1000,
             "disk": [{"bus-type": "virtio", "serial": "D1", "bus": 0, "target": 0, "unit": 0,
                       "pci-controller": {"domain": 0, "bus": 0, "slot": 4, "function": 0}}]},
            {"name": "proc", "mountpoint": "/proc", "type": "proc", "disk": []}
        ]))
        .expect("fsinfo");
        let host: QgaHostName =
            serde_json::from_value(json!({"host-name": "demo"})).expect("host name");
        let timezone: QgaTimezone =
            serde_json::from_value(json!({"zone": "CET", "offset": 3600})).expect("timezone");
        let got = serde_json::to_value(agent_info(
            info,
            host,
            timezone,
            os,
            users.clone(),
            fs.clone(),
            None,
        ))
        .expect("serializes");
        assert_eq!(
            got,
            json!({
                "guestAgentVersion": "7.2.0",
                "hostname": "demo",
                "timezone": "CET, 3600",
                "supportedCommands": [{"name": "guest-ping", "enabled": true}, {"name": "guest-exec"}],
                "os": {
                    "name": "Debian GNU/Linux", "kernelRelease": "6.1.0-13-cloud-amd64",
                    "version": "12 (bookworm)", "prettyName": "Debian GNU/Linux 12 (bookworm)",
                    "versionId": "12", "kernelVersion": "#1 SMP", "machine": "x86_64", "id": "debian"
                },
                "userList": [{"userName": "root", "loginTime": 1_700_000_000.5}],
                "fsInfo": {"disks": [
                    {"diskName": "vda1", "mountPoint": "/", "fileSystemType": "ext4",
                     "usedBytes": 100, "totalBytes": 1000, "disk": [{"serial": "D1", "busType": "virtio"}]},
                    {"diskName": "proc", "mountPoint": "/proc", "fileSystemType": "proc",
                     "usedBytes": 0, "totalBytes": 0}
                ]}
            })
        );
        assert_eq!(
            serde_json::to_value(user_list(users)).expect("serializes"),
            json!({"metadata": {}, "items": [{"userName": "root", "loginTime": 1_700_000_000.5}]})
        );
        assert_eq!(
            serde_json::to_value(filesystem_list(fs)).expect("serializes")["items"][1]["diskName"],
            "proc"
        );
    }
}
