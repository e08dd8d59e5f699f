//! The node loop's two migration roles (KubeVirt's `migration-source.go` and
//! `migration-target.go`), driven by `status.migrationState`, which virt-controller fills at the
//! handoff:
//!
//! - Target (the VMI carries `kubevirt.io/migrationTargetNodeName=<this node>`): prepare the
//!   target pod as for a start, start its launcher as a migration target, open the proxy's
//!   listeners and publish `targetNodeAddress` / `targetDirectMigrationNodePorts`. Once the
//!   source reports its end (`endTimestamp`, not failed) and the state is in, resume the guest
//!   here and take the VMI over: `status.nodeName`, the `kubevirt.io/nodeName` label,
//!   `targetNodeDomainReadyTimestamp`, `completed`.
//! - Source (`migrationState.sourceNode` is this node): once the target is listening, join the
//!   proxy and tell the launcher to migrate (`startTimestamp`, `mode`); relay an abort request;
//!   report the end (`endTimestamp`; `failed`, `failureReason`, `abortStatus` when it failed).
//!
//! The one deliberate difference from KubeVirt: libvirt lets the source and target daemons
//! hand over between themselves; here the handover goes through the VMI (the source's
//! `endTimestamp`, then the target's resume), so the guest's downtime includes one API round trip.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use api::VirtualMachineInstance;
use api::labels;
use api::migration::MigrationConfiguration;
use api::status::VirtualMachineInstanceMigrationState as MigrationState;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams};
use launcher_api::client::ClientError;
use launcher_api::domain::{Domain, DomainState};
use launcher_api::migration::{MigrateRequest, MigrationPhase, Role, TargetRequest};
use serde_json::json;

use super::{
    LauncherClient, LauncherView, NOT_READY_RECHECK, Next, Node, ReconcileError, active_pod_on,
    now, pod_socket,
};
use crate::events::{Event, EventType};
use crate::migration::{self, Transport};

/// KubeVirt's `failureReason` of an aborted migration.
const ABORTED: &str = "Live migration has been aborted";

/// The pod's `sockets` emptyDir root as the handler sees it: what the launcher calls its share
/// dir, where the migration sockets are.
fn pod_share(socket: &Path) -> PathBuf {
    socket
        .parent()
        .and_then(Path::parent)
        .map_or_else(PathBuf::new, Path::to_path_buf)
}

fn time_ms(ms: u64) -> Time {
    let ms = i64::try_from(ms).unwrap_or(i64::MAX);
    Time(k8s_openapi::jiff::Timestamp::from_millisecond(ms).unwrap_or_else(|_| now().0))
}

fn settings(ms: &MigrationState) -> MigrationConfiguration {
    ms.migration_configuration
        .as_ref()
        .and_then(|c| serde_json::from_value::<MigrationConfiguration>(c.0.clone()).ok())
        .unwrap_or_default()
        .effective()
}

fn migration_state(vmi: &VirtualMachineInstance) -> Option<&MigrationState> {
    vmi.status.as_ref()?.migration_state.as_ref()
}

/// This node is the target of the VMI's migration and not (yet) its home.
pub(super) fn is_target(vmi: &VirtualMachineInstance, node: &str) -> bool {
    let labelled = vmi
        .labels()
        .get(labels::MIGRATION_TARGET_NODE_NAME)
        .is_some_and(|n| n == node);
    let home = vmi.status.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node);
    labelled && !home
}

/// What the target writes besides the migration state when it takes the VMI over (KubeVirt's
/// `ackMigrationCompletion`): the node, its label, and the end of an evacuation: the mark
/// virt-api's eviction webhook set and the descheduler's annotation go, so a later drain of
/// this node is a new evacuation.
fn taken_over(vmi: &VirtualMachineInstance, node: &str) -> serde_json::Value {
    let mut patch = json!({
        "metadata": {"labels": {
            labels::NODE_NAME: node,
            labels::MIGRATION_TARGET_NODE_NAME: null,
        }},
        "status": {"nodeName": node, "evacuationNodeName": null},
    });
    if vmi
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(labels::EVICTION_SOURCE))
    {
        patch["metadata"]["annotations"] = json!({labels::EVICTION_SOURCE: null});
    }
    patch
}

/// The source's domain after a completed migration: the guest runs elsewhere.
pub(super) fn migrated_away(d: &Domain) -> bool {
    d.state == DomainState::Shutoff && d.reason == "Migrated"
}

impl Node {
    fn transport(&self, cfg: &MigrationConfiguration) -> Result<Transport, String> {
        if cfg.disable_tls == Some(true) {
            return Ok(Transport::Plain);
        }
        self.cfg.migration_transport.clone().ok_or_else(|| {
            "virt-handler has no TLS certificates for migrations (and migrations.disableTLS is \
             not set)"
                .to_owned()
        })
    }

    fn drop_proxy(&self, key: &str) {
        self.proxies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(key);
    }

    /// Changes `status.migrationState` (and, with `extra`, other parts of the VMI) in one
    /// compare-and-swap merge patch; nothing is written when nothing changes.
    async fn patch_migration(
        &self,
        vmi: &VirtualMachineInstance,
        change: impl FnOnce(&mut MigrationState),
        extra: Option<serde_json::Value>,
    ) -> Result<(), ReconcileError> {
        let old = migration_state(vmi).cloned().unwrap_or_default();
        let mut new = old.clone();
        change(&mut new);
        if new == old && extra.is_none() {
            return Ok(());
        }
        let mut patch = json!({
            "metadata": {"resourceVersion": vmi.metadata.resource_version},
            "status": {"migrationState": new},
        });
        if let Some(serde_json::Value::Object(extra)) = extra {
            for (k, v) in extra {
                match (patch.get_mut(&k), v) {
                    (Some(serde_json::Value::Object(into)), serde_json::Value::Object(v)) => {
                        into.extend(v);
                    }
                    (_, v) => patch[k] = v,
                }
            }
        }
        let api: Api<VirtualMachineInstance> =
            Api::namespaced(self.client.clone(), &vmi.namespace().unwrap_or_default());
        api.patch(
            &vmi.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
        Ok(())
    }

    /// Marks the migration failed on the VMI, from either end.
    async fn fail_migration(
        &self,
        key: &str,
        vmi: &VirtualMachineInstance,
        reason: String,
        aborted: bool,
    ) -> Result<(), ReconcileError> {
        self.drop_proxy(key);
        let uid = migration_state(vmi)
            .and_then(|m| m.migration_uid.clone())
            .unwrap_or_default();
        tracing::warn!(key, migration = %uid, %reason, "migration failed");
        let message = format!("VirtualMachineInstance migration uid {uid} failed. reason:{reason}");
        self.patch_migration(
            vmi,
            |m| {
                m.failed = Some(true);
                m.completed = Some(true);
                m.end_timestamp.get_or_insert_with(now);
                m.failure_reason = Some(reason);
                if aborted {
                    m.abort_status = Some("Succeeded".into());
                }
            },
            None,
        )
        .await?;
        self.record(
            vmi,
            &[Event {
                type_: EventType::Warning,
                reason: "Migrated".into(),
                message,
            }],
        )
        .await;
        Ok(())
    }

    /// The source's part, on every reconcile of a VMI that runs here.
    pub(super) async fn source_step(
        &self,
        key: &str,
        vmi: &VirtualMachineInstance,
        socket: &Path,
        d: &Domain,
    ) -> Result<(), ReconcileError> {
        let Some(ms) = migration_state(vmi) else {
            return Ok(());
        };
        let ours = ms.source_node.as_deref() == Some(self.cfg.node.as_str());
        let over = ms.completed == Some(true) || ms.failed == Some(true);
        let Some(uid) = ms.migration_uid.clone().filter(|_| ours && !over) else {
            self.drop_proxy(key);
            return Ok(());
        };
        let mine = d
            .migration
            .as_ref()
            .filter(|m| m.uid == uid && m.role == Role::Source);
        let Some(m) = mine else {
            if ms.abort_requested == Some(true) {
                return self.fail_migration(key, vmi, ABORTED.into(), true).await;
            }
            if ms.start_timestamp.is_some() {
                return self
                    .fail_migration(
                        key,
                        vmi,
                        "the source launcher no longer knows the migration".into(),
                        false,
                    )
                    .await;
            }
            return self.start_outgoing(key, vmi, socket, ms, uid).await;
        };
        match m.phase {
            MigrationPhase::Preparing | MigrationPhase::Running => {
                if ms.abort_requested == Some(true) && ms.abort_status.is_none() {
                    tracing::info!(key, migration = %uid, "aborting the migration");
                    self.launcher(socket).cancel_migration().await?;
                    self.record(
                        vmi,
                        &[Event {
                            type_: EventType::Normal,
                            reason: "Migrating".into(),
                            message: "VirtualMachineInstance is aborting migration.".into(),
                        }],
                    )
                    .await;
                    self.patch_migration(vmi, |s| s.abort_status = Some("Aborting".into()), None)
                        .await?;
                } else {
                    let mode = m.mode.clone();
                    self.patch_migration(vmi, |s| s.mode = Some(mode), None)
                        .await?;
                }
            }
            MigrationPhase::Completed => {
                self.drop_proxy(key);
                let end = time_ms(m.ended_ms.unwrap_or(m.started_ms));
                let mode = m.mode.clone();
                self.patch_migration(
                    vmi,
                    |s| {
                        s.end_timestamp.get_or_insert(end);
                        s.mode = Some(mode);
                    },
                    None,
                )
                .await?;
            }
            MigrationPhase::Failed | MigrationPhase::Aborted => {
                let aborted = m.phase == MigrationPhase::Aborted;
                let reason = if aborted && ms.abort_requested == Some(true) {
                    ABORTED.to_owned()
                } else {
                    m.failure.clone().unwrap_or_else(|| "unknown".into())
                };
                self.fail_migration(key, vmi, reason, aborted).await?;
            }
        }
        Ok(())
    }

    async fn start_outgoing(
        &self,
        key: &str,
        vmi: &VirtualMachineInstance,
        socket: &Path,
        ms: &MigrationState,
        uid: String,
    ) -> Result<(), ReconcileError> {
        let (Some(address), false) = (
            ms.target_node_address.as_deref(),
            ms.target_direct_migration_node_ports.is_empty(),
        ) else {
            // The target is not listening yet; its status write queues this VMI again.
            return Ok(());
        };
        let cfg = settings(ms);
        let transport = match self.transport(&cfg) {
            Ok(t) => t,
            Err(why) => return self.fail_migration(key, vmi, why, false).await,
        };
        let Ok(ip) = address.parse() else {
            let why = format!("the target's address {address:?} is not an IP address");
            return self.fail_migration(key, vmi, why, false).await;
        };
        let ports: BTreeMap<String, i32> = ms.target_direct_migration_node_ports.clone();
        let proxy = match migration::connect(&transport, ip, &ports, &pod_share(socket)) {
            Ok(p) => p,
            Err(e) => return self.fail_migration(key, vmi, e.to_string(), false).await,
        };
        self.proxies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key.to_owned(), (uid.clone(), proxy));
        let req = MigrateRequest {
            migration_uid: uid.clone(),
            copy_disks: api::migration::copy_disks(vmi),
            bandwidth: cfg.bandwidth_bytes(),
            completion_timeout_per_gib: cfg.completion_timeout_per_gib.unwrap_or(150),
            progress_timeout: cfg.progress_timeout.unwrap_or(150),
            allow_auto_converge: cfg.allow_auto_converge == Some(true),
            allow_post_copy: cfg.allow_post_copy == Some(true),
        };
        tracing::info!(key, migration = %uid, target = %address, ?ports, "migrating");
        match self.launcher(socket).migrate(&req).await {
            Ok(_) => {}
            Err(ClientError::Api { error, .. }) => {
                return self.fail_migration(key, vmi, error.message, false).await;
            }
            Err(e) => return Err(e.into()),
        }
        self.record(
            vmi,
            &[Event {
                type_: EventType::Normal,
                reason: "Migrating".into(),
                message: "VirtualMachineInstance is migrating.".into(),
            }],
        )
        .await;
        self.patch_migration(
            vmi,
            |s| {
                s.start_timestamp = Some(now());
                s.mode = Some("PreCopy".into());
            },
            None,
        )
        .await
    }

    /// The target's part: everything of a VMI labelled for this node that does not run here yet.
    pub(super) async fn reconcile_target(
        self: &Arc<Self>,
        key: &str,
        vmi: &Arc<VirtualMachineInstance>,
    ) -> Result<Next, ReconcileError> {
        let node = self.cfg.node.clone();
        let Some(ms) = migration_state(vmi).filter(|m| m.target_node.as_deref() == Some(&node))
        else {
            return Ok(Next::Done);
        };
        if ms.failed == Some(true) || ms.completed == Some(true) {
            self.drop_proxy(key);
            return Ok(Next::Done);
        }
        let Some(uid) = ms.migration_uid.clone() else {
            return Ok(Next::Done);
        };
        let Some(pod_uid) = active_pod_on(vmi, &node).map(str::to_owned) else {
            return Ok(Next::After(NOT_READY_RECHECK));
        };
        let socket = pod_socket(&self.cfg.pods_dir, &pod_uid);
        let (view, recheck) = self.observe(key, vmi, &socket).await?;
        let LauncherView::Answering(d) = view else {
            return Ok(Next::After(recheck.unwrap_or(NOT_READY_RECHECK)));
        };
        let cfg = settings(ms);
        let transport = match self.transport(&cfg) {
            Ok(t) => t,
            Err(why) => {
                self.fail_migration(key, vmi, why, false).await?;
                return Ok(Next::Done);
            }
        };
        let mut d = *d;
        if d.migration.is_none() {
            // A VMI with hotplugged volumes is not migratable: nothing to mount or unmount.
            match self.prepare(key, vmi, &pod_uid, BTreeSet::new()).await {
                Ok((None, _)) => {}
                Ok((Some(_waiting), _)) => return Ok(Next::After(NOT_READY_RECHECK)),
                Err(ReconcileError::Mounts(e)) => {
                    self.fail_migration(key, vmi, super::error_chain(&e), false)
                        .await?;
                    return Ok(Next::Done);
                }
                Err(e) => return Err(e),
            }
            let req = TargetRequest {
                migration_uid: uid.clone(),
                vmi: (**vmi).clone(),
                copy_disks: api::migration::copy_disks(vmi),
                allow_post_copy: cfg.allow_post_copy == Some(true),
            };
            tracing::info!(key, migration = %uid, "preparing the migration target");
            let c = LauncherClient::new(&socket, self.cfg.sync_timeout);
            d = match c.prepare_target(&req).await {
                Ok(d) => d,
                Err(ClientError::Api { error, .. }) => {
                    self.fail_migration(key, vmi, error.message, false).await?;
                    return Ok(Next::Done);
                }
                Err(e) => return Err(e.into()),
            };
            let vmi_uid = vmi.metadata.uid.as_deref().unwrap_or_default();
            self.ensure_watch(key, vmi_uid, &socket);
        }
        let target_failed = d
            .migration
            .as_ref()
            .is_some_and(|m| m.phase == MigrationPhase::Failed)
            || d.state.is_final();
        // Once the source has started, a broken stream fails there too, and the source
        // reports why (an abort it carried out, a timeout): the target's view is only the
        // effect. Before that only the target knows.
        if target_failed && (ms.start_timestamp.is_some() || ms.abort_requested == Some(true)) {
            self.drop_proxy(key);
            return Ok(Next::Done);
        }
        if target_failed {
            let why = d
                .migration
                .as_ref()
                .and_then(|m| m.failure.clone())
                .or_else(|| d.message.clone())
                .unwrap_or_else(|| format!("the target domain is {:?}", d.state));
            self.fail_migration(key, vmi, format!("target: {why}"), false)
                .await?;
            return Ok(Next::Done);
        }
        let Some(ip) = self.cfg.pod_ip else {
            self.fail_migration(
                key,
                vmi,
                "virt-handler does not know its pod IP (MY_POD_IP)".into(),
                false,
            )
            .await?;
            return Ok(Next::Done);
        };
        let ports = {
            let existing = self
                .proxies
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(key)
                .filter(|(of, _)| *of == uid)
                .map(|(_, p)| p.ports.clone());
            if let Some(p) = existing {
                p
            } else {
                let proxy = match migration::listen(&transport, ip, &pod_share(&socket)).await {
                    Ok(p) => p,
                    Err(e) => {
                        self.fail_migration(key, vmi, e.to_string(), false).await?;
                        return Ok(Next::Done);
                    }
                };
                let ports = proxy.ports.clone();
                self.proxies
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(key.to_owned(), (uid.clone(), proxy));
                self.record(
                    vmi,
                    &[Event {
                        type_: EventType::Normal,
                        reason: "PreparingTarget".into(),
                        message: format!(
                            "Migration Target is listening at {ip}, on ports: {}",
                            ports.keys().cloned().collect::<Vec<_>>().join(",")
                        ),
                    }],
                )
                .await;
                ports
            }
        };
        let source_done = ms.end_timestamp.is_some();
        let state_in = d
            .migration
            .as_ref()
            .is_some_and(|m| m.phase == MigrationPhase::Completed);
        if !(source_done && state_in) {
            self.patch_migration(
                vmi,
                |s| {
                    s.target_node_address = Some(ip.to_string());
                    s.target_direct_migration_node_ports = ports;
                    s.target_node_domain_detected = Some(true);
                },
                None,
            )
            .await?;
            return Ok(Next::Done);
        }
        tracing::info!(key, migration = %uid, "the source is done: resuming the guest here");
        self.launcher(&socket).finish_migration().await?;
        self.drop_proxy(key);
        let now = now();
        self.patch_migration(
            vmi,
            |s| {
                s.target_node_domain_detected = Some(true);
                s.target_node_domain_ready_timestamp = Some(now);
                s.completed = Some(true);
            },
            Some(taken_over(vmi, &node)),
        )
        .await?;
        self.record(
            vmi,
            &[Event {
                type_: EventType::Normal,
                reason: "Migrated".into(),
                message: format!("The VirtualMachineInstance migrated to node {node}."),
            }],
        )
        .await;
        Ok(Next::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taking_over_ends_an_evacuation() {
        let mut vmi: VirtualMachineInstance = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "demo", "namespace": "default"},
            "spec": {"domain": {"devices": {}}},
            "status": {"nodeName": "node-1", "evacuationNodeName": "node-1"},
        }))
        .unwrap();
        let patch = taken_over(&vmi, "node-2");
        assert_eq!(
            patch,
            json!({
                "metadata": {"labels": {
                    "kubevirt.io/nodeName": "node-2",
                    "kubevirt.io/migrationTargetNodeName": null,
                }},
                "status": {"nodeName": "node-2", "evacuationNodeName": null},
            })
        );
        vmi.metadata.annotations =
            Some([(labels::EVICTION_SOURCE.to_owned(), "descheduler".to_owned())].into());
        assert_eq!(
            taken_over(&vmi, "node-2")["metadata"]["annotations"],
            json!({"kubevirt.io/eviction-source": null})
        );
    }
}
