//! Commands whose QEMU 7.2 replies the `qapi` crate's 9.1 schema cannot decode, with local types
//! that accept both (fields added after 7.2 are optional here, enums that lost or gained members
//! are strings). They implement [`qapi::Command`], so they go through
//! [`crate::QmpClient::execute`] like any other command:
//! `client.execute(qmp::compat::query_machines {}).await`.
//!
//! Measured against QEMU 7.2: `query-machines` lacks `acpi` (8.0), `query-blockstats` lacks the
//! zone-append counters (8.1), `query-migrate-capabilities` names capabilities 9.1 removed
//! (`compress`, `block`, ...), `query-cpu-model-expansion` lacks `deprecated-props` (9.1).

#![allow(non_camel_case_types)] // command types are named after the command, as in `qapi`

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `query-machines`: the machine types this QEMU offers.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct query_machines {}

impl qapi::Command for query_machines {
    type Ok = Vec<MachineInfo>;
    const NAME: &'static str = "query-machines";
    const ALLOW_OOB: bool = false;
}

/// One machine type from `query-machines`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MachineInfo {
    pub name: String,
    /// E.g. `q35` for the newest `pc-q35-*`.
    #[serde(default)]
    pub alias: Option<String>,
    #[serde(default)]
    pub is_default: Option<bool>,
    pub cpu_max: i64,
    pub hotpluggable_cpus: bool,
    #[serde(default)]
    pub numa_mem_supported: bool,
    #[serde(default)]
    pub deprecated: bool,
    #[serde(default)]
    pub default_cpu_type: Option<String>,
    #[serde(default)]
    pub default_ram_id: Option<String>,
    /// Added in QEMU 8.0.
    #[serde(default)]
    pub acpi: Option<bool>,
}

/// `query-blockstats`: I/O statistics per block device (and node with `query_nodes`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct query_blockstats {
    #[serde(rename = "query-nodes", skip_serializing_if = "Option::is_none")]
    pub query_nodes: Option<bool>,
}

impl qapi::Command for query_blockstats {
    type Ok = Vec<BlockStats>;
    const NAME: &'static str = "query-blockstats";
    const ALLOW_OOB: bool = false;
}

/// Statistics of one device or node, with its parent (protocol) and backing nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockStats {
    /// The legacy drive name (`-drive id=`); absent or empty for `-blockdev` nodes.
    #[serde(default)]
    pub device: Option<String>,
    /// The guest device's qdev id or path.
    #[serde(default)]
    pub qdev: Option<String>,
    #[serde(default)]
    pub node_name: Option<String>,
    pub stats: BlockDeviceStats,
    #[serde(default)]
    pub parent: Option<Box<BlockStats>>,
    #[serde(default)]
    pub backing: Option<Box<BlockStats>>,
}

/// The counters KubeVirt reports (bytes, operations, times); everything else QEMU sends is kept
/// raw in `other`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockDeviceStats {
    pub rd_bytes: u64,
    pub wr_bytes: u64,
    pub rd_operations: u64,
    pub wr_operations: u64,
    pub flush_operations: u64,
    pub rd_total_time_ns: u64,
    pub wr_total_time_ns: u64,
    pub flush_total_time_ns: u64,
    #[serde(default)]
    pub wr_highest_offset: u64,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `query-migrate-capabilities`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct query_migrate_capabilities {}

impl qapi::Command for query_migrate_capabilities {
    type Ok = Vec<MigrationCapabilityStatus>;
    const NAME: &'static str = "query-migrate-capabilities";
    const ALLOW_OOB: bool = false;
}

/// One migration capability; the name is a string because the set differs between versions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationCapabilityStatus {
    pub capability: String,
    pub state: bool,
}

/// `query-cpu-model-expansion`: what a CPU model (e.g. `max`, `host`) expands to.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct query_cpu_model_expansion {
    #[serde(rename = "type")]
    pub type_: qapi::qmp::CpuModelExpansionType,
    pub model: qapi::qmp::CpuModelInfo,
}

impl qapi::Command for query_cpu_model_expansion {
    type Ok = CpuModelExpansionInfo;
    const NAME: &'static str = "query-cpu-model-expansion";
    const ALLOW_OOB: bool = false;
}

/// The expanded model.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct CpuModelExpansionInfo {
    pub model: qapi::qmp::CpuModelInfo,
    /// Added in QEMU 9.1.
    #[serde(default)]
    pub deprecated_props: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn machine_info_without_acpi_decodes() {
        let info: MachineInfo = serde_json::from_value(json!({
            "cpu-max": 288, "default-cpu-type": "qemu64-x86_64-cpu", "default-ram-id": "pc.ram",
            "deprecated": false, "hotpluggable-cpus": true, "name": "pc-q35-7.2",
            "alias": "q35", "numa-mem-supported": false
        }))
        .unwrap();
        assert_eq!(info.alias.as_deref(), Some("q35"));
        assert_eq!(info.acpi, None);
    }

    #[test]
    fn commands_serialize_as_qmp_arguments() {
        assert_eq!(
            serde_json::to_value(query_blockstats {
                query_nodes: Some(true)
            })
            .unwrap(),
            json!({"query-nodes": true})
        );
        assert_eq!(
            serde_json::to_value(query_blockstats::default()).unwrap(),
            json!({})
        );
    }
}
