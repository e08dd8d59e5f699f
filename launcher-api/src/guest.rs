//! The guest agent's answers as the launcher relays them: qemu-ga's own JSON (its member names,
//! its optional members left out rather than null), cut to what virt-handler uses. virt-handler
//! turns them into KubeVirt's subresource shapes (`handler::guestinfo`) and into
//! `status.interfaces` (`network::status`).

use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// What virt-probe asks for a `guestAgentPing` probe: `guest-ping` within `timeoutSeconds`.
/// `domainName` is KubeVirt's `<namespace>_<name>` of the VMI the probe was rendered for;
/// the launcher refuses another, so a probe can never pass for a VMI it was not written for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestPingRequest {
    pub domain_name: String,
    pub timeout_seconds: u32,
}

/// What virt-probe asks for an `exec` probe: `command` with `args` run in the guest by the
/// agent (`guest-exec`, output captured), waited for up to `timeoutSeconds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestExecRequest {
    pub domain_name: String,
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    pub timeout_seconds: u32,
}

/// How a command run by [`GuestExecRequest`] ended: its exit code and what it wrote to stdout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestExecResult {
    pub exit_code: i32,
    pub stdout: String,
}

/// `guest-info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QgaInfo {
    pub version: String,
    #[serde(default)]
    pub supported_commands: Vec<QgaCommand>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QgaCommand {
    pub name: String,
    pub enabled: bool,
}

/// `guest-get-osinfo`: every member is optional in QGA's schema.
#[skip_serializing_none]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct QgaOsInfo {
    pub kernel_release: Option<String>,
    pub kernel_version: Option<String>,
    pub machine: Option<String>,
    pub id: Option<String>,
    pub name: Option<String>,
    pub pretty_name: Option<String>,
    pub version: Option<String>,
    pub version_id: Option<String>,
}

/// `guest-get-host-name`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct QgaHostName {
    pub host_name: String,
}

/// `guest-get-timezone`: `offset` in seconds east of UTC.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QgaTimezone {
    pub zone: Option<String>,
    pub offset: i64,
}

/// One of `guest-get-users`.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct QgaUser {
    pub user: String,
    pub domain: Option<String>,
    pub login_time: f64,
}

/// One of `guest-get-fsinfo`.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct QgaFilesystem {
    pub name: String,
    pub mountpoint: String,
    #[serde(rename = "type")]
    pub type_: String,
    pub used_bytes: Option<u64>,
    pub total_bytes: Option<u64>,
    #[serde(default)]
    pub disk: Vec<QgaDisk>,
}

#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct QgaDisk {
    pub bus_type: String,
    pub serial: Option<String>,
}

/// One of `guest-network-get-interfaces`: names and addresses inside the guest.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct AgentInterface {
    pub name: String,
    pub hardware_address: Option<String>,
    #[serde(default)]
    pub ip_addresses: Vec<AgentAddress>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct AgentAddress {
    pub ip_address_type: String,
    pub ip_address: String,
    pub prefix: u8,
}

#[cfg(test)]
mod tests {
    use pretty_assertions::assert_eq;
    use serde::de::DeserializeOwned;
    use serde_json::{Value, json};

    use super::*;

    /// Decodes a whole agent answer, and checks that encoding it again gives back `kept`: the
    /// members the API carries, in the agent's spelling.
    fn relayed<T: Serialize + DeserializeOwned>(agent: Value, kept: &Value) -> T {
        let t: T = serde_json::from_value(agent).expect("decodes");
        assert_eq!(&serde_json::to_value(&t).expect("encodes"), kept);
        t
    }

    #[test]
    fn agent_answers_keep_qgas_spelling_through_the_api() {
        let info: QgaInfo = relayed(
            json!({"version": "7.2.0", "supported_commands": [
                {"name": "guest-ping", "enabled": true, "success-response": true}
            ]}),
            &json!({"version": "7.2.0", "supported_commands": [{"name": "guest-ping", "enabled": true}]}),
        );
        assert_eq!(info.supported_commands[0].name, "guest-ping");

        let os: QgaOsInfo = relayed(
            json!({"kernel-release": "6.1.0", "id": "debian", "variant": "x"}),
            &json!({"kernel-release": "6.1.0", "id": "debian"}),
        );
        assert_eq!(os.kernel_release.as_deref(), Some("6.1.0"));
        assert_eq!(
            relayed::<QgaOsInfo>(json!({}), &json!({})),
            QgaOsInfo::default()
        );

        let users: Vec<QgaUser> = relayed(
            json!([{"user": "root", "login-time": 1_700_000_000.5}]),
            &json!([{"user": "root", "login-time": 1_700_000_000.5}]),
        );
        assert_eq!(users[0].domain, None);

        let fs: Vec<QgaFilesystem> = relayed(
            json!([
                {"name": "vda1", "mountpoint": "/", "type": "ext4", "used-bytes": 100,
                 "total-bytes": 1000, "total-bytes-privileged": 1000,
                 "disk": [{"bus-type": "virtio", "serial": "D1", "bus": 0, "target": 0, "unit": 0,
                           "pci-controller": {"domain": 0, "bus": 0, "slot": 4, "function": 0}}]},
                {"name": "proc", "mountpoint": "/proc", "type": "proc"}
            ]),
            &json!([
                {"name": "vda1", "mountpoint": "/", "type": "ext4", "used-bytes": 100,
                 "total-bytes": 1000, "disk": [{"bus-type": "virtio", "serial": "D1"}]},
                {"name": "proc", "mountpoint": "/proc", "type": "proc", "disk": []}
            ]),
        );
        assert_eq!(fs[1].disk, vec![]);

        let ifaces: Vec<AgentInterface> = relayed(
            json!([
                {"name": "lo", "ip-addresses": [
                    {"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8}
                ], "statistics": {"rx-bytes": 0}},
                {"name": "eth0", "hardware-address": "02:00:00:00:00:01"}
            ]),
            &json!([
                {"name": "lo", "ip-addresses": [
                    {"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8}
                ]},
                {"name": "eth0", "hardware-address": "02:00:00:00:00:01", "ip-addresses": []}
            ]),
        );
        assert_eq!(ifaces[1].ip_addresses, vec![]);
    }
}
