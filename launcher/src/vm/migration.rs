//! Live migration over QMP, in libvirt's order. The target's QEMU starts with `-incoming defer`,
//! stays paused (`-S`), exports the copied disks over NBD and listens for the state. The source
//! mirrors each copied disk into the target's export (`blockdev-mirror`, `sync: top` over the
//! same base image, `write-blocking` so that once ready every guest write reaches both), sends
//! the memory (`migrate`), and once QEMU reports `completed` closes the mirrors and quits. The
//! target resumes only when told (`FinishMigration`, after the source has reported the end):
//! a stream that breaks at the last moment can then never leave two guests running.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use launcher_api::migration::{
    DISKS_SOCKET, DomainMigration, MEMORY_SOCKET, MigrateRequest, MigrationPhase, Role,
};
use serde_json::{Value as Json, json};

use super::{Domain, DomainState, Error, Launcher, Requested, Vm};
use crate::qemu::Disk;
use std::sync::Arc;
use std::time::Duration;

/// How often the source asks QEMU how the migration goes.
const POLL: Duration = Duration::from_millis(250);
/// QEMU sets a migration `completed` a moment before it fills in `total-time` and `downtime`
/// (another thread), so a `query-migrate` in between reads zeros: ask again, this many times.
const FINAL_FIGURES_POLLS: u32 = 20;
/// How long closing the disks' mirrors may take once the memory is sent.
const MIRROR_CLOSE_WAIT: Duration = Duration::from_secs(30);
/// KubeVirt's `bandwidthPerMigration: 0` means unlimited; QEMU's default is 32 MiB/s, so
/// "unlimited" has to be said as a number.
const UNLIMITED_BANDWIDTH: u64 = 1 << 40;
const GIB: u64 = 1 << 30;

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The disks named in a migration request, refused by name if the VMI has no such disk or it
/// is read-only (nothing to copy: the target opens its own).
pub(super) fn copied<'a>(disks: &'a [Disk], names: &[String]) -> Result<Vec<&'a Disk>, Error> {
    names
        .iter()
        .map(|n| match disks.iter().find(|d| &d.name == n) {
            Some(d) if d.read_only => Err(Error::BadRequest(format!(
                "copyDisks: disk {n} is read-only; only writable disks are copied"
            ))),
            Some(d) => Ok(d),
            None => Err(Error::BadRequest(format!(
                "copyDisks: the VMI has no disk {n}"
            ))),
        })
        .collect()
}

fn mirror_node(d: &Disk) -> String {
    format!("mig-{}", d.node_name())
}

/// Where a migration stream's socket is for this launcher's QEMU.
fn socket(l: &Launcher, relative: &str) -> std::path::PathBuf {
    l.cfg.dirs.share.join(relative)
}

/// Turns QMP capabilities on (`migrate-set-capabilities`).
async fn capabilities(qmp: &qmp::QmpClient, names: &[&str]) -> Result<(), Error> {
    let caps: Vec<Json> = names
        .iter()
        .map(|n| json!({"capability": n, "state": true}))
        .collect();
    qmp.execute_raw("migrate-set-capabilities", json!({ "capabilities": caps }))
        .await?;
    Ok(())
}

/// How the source's migration ended, short of completing.
struct Ended {
    phase: MigrationPhase,
    why: String,
}

impl Ended {
    fn failed(why: impl Into<String>) -> Self {
        Ended {
            phase: MigrationPhase::Failed,
            why: why.into(),
        }
    }
}

impl From<qmp::Error> for Ended {
    fn from(e: qmp::Error) -> Self {
        Ended::failed(format!("QMP: {e}"))
    }
}

/// What the source's driver needs, taken out of the ops lock.
struct Outgoing {
    qmp: qmp::QmpClient,
    req: MigrateRequest,
    mirrors: Vec<String>,
    cancel: tokio::sync::watch::Receiver<Option<String>>,
}

impl Launcher {
    /// Target, while QEMU is starting: serve the copied disks, then wait for the state.
    pub(super) async fn listen_incoming(
        &self,
        qmp: &qmp::QmpClient,
        disks: &[&Disk],
        allow_post_copy: bool,
    ) -> Result<(), Error> {
        let mut caps = vec!["events"];
        if allow_post_copy {
            caps.push("postcopy-ram");
        }
        capabilities(qmp, &caps).await?;
        if !disks.is_empty() {
            let path = socket(self, DISKS_SOCKET);
            let _ = std::fs::remove_file(&path);
            qmp.execute_raw(
                "nbd-server-start",
                json!({"addr": {"type": "unix", "data": {"path": path}}}),
            )
            .await?;
            for d in disks {
                let node = d.node_name();
                qmp.execute_raw(
                    "block-export-add",
                    json!({"type": "nbd", "id": node, "node-name": node, "name": node, "writable": true}),
                )
                .await?;
            }
        }
        let path = socket(self, MEMORY_SOCKET);
        let _ = std::fs::remove_file(&path);
        qmp.execute_raw(
            "migrate-incoming",
            json!({"uri": format!("unix:{}", path.display())}),
        )
        .await?;
        Ok(())
    }

    /// `POST /v1/migration/finish`: the source has completed; the target resumes the guest.
    pub async fn finish_migration(&self) -> Result<Domain, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, "finish the migration")?;
        let m = self.state.borrow().migration.clone();
        let waiting = *vm.requested.lock().expect("poisoned") == Some(Requested::Incoming);
        let ready = m
            .as_ref()
            .is_some_and(|m| m.role == Role::Target && m.phase == MigrationPhase::Completed);
        if ready && !waiting {
            // Finished before: virt-handler asks again when its status write after the first
            // finish failed (a conflict), and must then go on to take the VMI over.
            return Ok(self.domain());
        }
        if !(ready && waiting) {
            return Err(Error::Migration(format!(
                "nothing to finish: this launcher is not a migration target whose state is in \
                 and that waits to resume (migration: {:?}, waiting: {waiting})",
                m.map(|m| (m.role, m.phase))
            )));
        }
        finish(vm).await?;
        self.update(|d| {
            d.state = DomainState::Running;
            d.reason = "Migrated".into();
        });
        Ok(self.domain())
    }

    /// A target's MIGRATION event: the incoming state's progress.
    pub(super) fn incoming_event(self: &Arc<Self>, status: &str) {
        match status {
            "active" => self.set_migration_phase(MigrationPhase::Running, None),
            "completed" => self.set_migration_phase(MigrationPhase::Completed, None),
            // From here the source cannot take the guest back: it runs here, fetching
            // the pages it still lacks (QEMU's post-copy).
            "postcopy-active" => {
                let me = self.clone();
                tokio::spawn(async move {
                    let mut ops = me.ops.lock().await;
                    if let Some(vm) = ops.vm.as_mut().filter(|vm| !vm.exited()) {
                        match vm.qmp.execute(qmp::qapi::qmp::cont {}).await {
                            Ok(_) => me.update(|d| {
                                d.state = DomainState::Running;
                                d.reason = "PostCopy".into();
                                if let Some(m) = d.migration.as_mut() {
                                    "PostCopy".clone_into(&mut m.mode);
                                }
                            }),
                            Err(e) => tracing::warn!(error = %e, "resuming at post-copy"),
                        }
                    }
                });
            }
            "failed" => self.set_migration_phase(
                MigrationPhase::Failed,
                Some("the incoming migration failed".into()),
            ),
            _ => {}
        }
    }

    fn set_migration_phase(&self, phase: MigrationPhase, failure: Option<String>) {
        self.update_if(|d| {
            let Some(m) = d.migration.as_mut() else {
                return false;
            };
            if m.phase == phase || m.phase.is_final() {
                return false;
            }
            m.phase = phase;
            if phase.is_final() {
                m.ended_ms = Some(now_ms());
            }
            if failure.is_some() {
                m.failure = failure;
            }
            true
        });
    }

    /// `POST /v1/migration/start`: mirror the copied disks into the target's exports, then
    /// send the memory; a task follows it to the end.
    pub async fn migrate(self: &Arc<Self>, req: MigrateRequest) -> Result<Domain, Error> {
        let mut ops = self.ops.lock().await;
        let vm = self.live_vm(&mut ops, "migrate")?;
        if let Some(m) = self.state.borrow().migration.as_ref()
            && !m.phase.is_final()
        {
            return Err(Error::Migration(format!(
                "migration {} is still {:?}",
                m.uid, m.phase
            )));
        }
        let disks = copied(&vm.disks, &req.copy_disks)?;
        let qmp = vm.qmp.clone();
        let mut caps = vec!["events"];
        if req.allow_auto_converge {
            caps.push("auto-converge");
        }
        if req.allow_post_copy {
            caps.push("postcopy-ram");
        }
        capabilities(&qmp, &caps).await?;
        let bandwidth = req
            .bandwidth
            .filter(|b| *b > 0)
            .unwrap_or(UNLIMITED_BANDWIDTH);
        qmp.execute_raw(
            "migrate-set-parameters",
            json!({"max-bandwidth": bandwidth}),
        )
        .await?;
        let nbd = socket(self, DISKS_SOCKET);
        let mut mirrors = Vec::new();
        for d in &disks {
            let target = mirror_node(d);
            let added = qmp
                .execute_raw(
                    "blockdev-add",
                    json!({"driver": "nbd", "node-name": target, "export": d.node_name(),
                           "server": {"type": "unix", "path": nbd}}),
                )
                .await;
            let mirrored = match added {
                Ok(_) => {
                    qmp.execute_raw(
                        "blockdev-mirror",
                        json!({"job-id": target, "device": d.node_name(), "target": target,
                               "sync": "top", "copy-mode": "write-blocking"}),
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = mirrored {
                mirrors.push(target);
                close_mirrors(&qmp, &mirrors, true).await;
                return Err(Error::Migration(format!(
                    "mirroring disk {} to the target: {e}",
                    d.name
                )));
            }
            mirrors.push(target);
        }
        let (cancel_tx, cancel) = tokio::sync::watch::channel(None);
        vm.cancel_migration = Some(cancel_tx);
        self.update(|d| {
            d.migration = Some(DomainMigration {
                uid: req.migration_uid.clone(),
                role: Role::Source,
                phase: MigrationPhase::Preparing,
                mode: "PreCopy".into(),
                started_ms: now_ms(),
                ended_ms: None,
                failure: None,
                memory_total: 0,
                memory_transferred: 0,
                memory_remaining: 0,
                disks_total: 0,
                total_time_ms: None,
                downtime_ms: None,
            });
        });
        tracing::info!(migration = %req.migration_uid, disks = ?req.copy_disks, "migration started");
        let me = self.clone();
        tokio::spawn(me.drive(Outgoing {
            qmp,
            req,
            mirrors,
            cancel,
        }));
        Ok(self.domain())
    }

    /// `POST /v1/migration/cancel`.
    pub async fn cancel_migration(&self) -> Result<Domain, Error> {
        let ops = self.ops.lock().await;
        let running = self
            .state
            .borrow()
            .migration
            .as_ref()
            .is_some_and(|m| m.role == Role::Source && !m.phase.is_final());
        let sender = ops.vm.as_ref().and_then(|vm| vm.cancel_migration.as_ref());
        match sender {
            Some(tx) if running => {
                let _ = tx.send(Some("canceled on request".into()));
                Ok(self.domain())
            }
            _ => Err(Error::Migration("no outgoing migration is running".into())),
        }
    }

    /// The source's migration, start to end.
    async fn drive(self: Arc<Self>, mut out: Outgoing) {
        let result = self.send(&mut out).await;
        match result {
            Ok(stats) => {
                close_mirrors(&out.qmp, &out.mirrors, false).await;
                self.update(|d| {
                    if let Some(m) = d.migration.as_mut() {
                        m.phase = MigrationPhase::Completed;
                        m.ended_ms = Some(now_ms());
                        m.memory_total = stats["ram"]["total"].as_u64().unwrap_or(0);
                        m.memory_transferred = stats["ram"]["transferred"].as_u64().unwrap_or(0);
                        m.memory_remaining = 0;
                        m.total_time_ms = stats["total-time"].as_u64();
                        m.downtime_ms = stats["downtime"].as_u64();
                    }
                });
                tracing::info!(migration = %out.req.migration_uid, total_ms = ?stats["total-time"].as_u64(),
                    downtime_ms = ?stats["downtime"].as_u64(), "migration completed; quitting");
                let mut ops = self.ops.lock().await;
                if let Some(vm) = ops.vm.as_mut().filter(|vm| !vm.exited()) {
                    vm.request(Requested::Migrated);
                    let _ = vm.qmp.execute(qmp::qapi::qmp::quit {}).await;
                    vm.wait_exit(super::QUIT_WAIT).await;
                }
            }
            Err(ended) => {
                close_mirrors(&out.qmp, &out.mirrors, true).await;
                // A failed pre-copy leaves the guest running; one that failed in its last
                // step may leave it stopped.
                if let Ok(st) = out.qmp.execute(qmp::qapi::qmp::query_status {}).await
                    && !st.running
                    && self.domain().reason == "Migrating"
                {
                    let _ = out.qmp.execute(qmp::qapi::qmp::cont {}).await;
                }
                tracing::warn!(migration = %out.req.migration_uid, phase = ?ended.phase, why = %ended.why, "migration ended");
                self.set_migration_phase(ended.phase, Some(ended.why));
            }
        }
    }

    /// Waits for the mirrors, sends the memory and follows `query-migrate` to the end: QEMU's
    /// final figures, or why it ended otherwise.
    async fn send(&self, out: &mut Outgoing) -> Result<Json, Ended> {
        let started = Instant::now();
        let progress_timeout = Duration::from_secs(out.req.progress_timeout.max(1));
        let mut best = u64::MAX;
        let mut last_progress = Instant::now();
        let mut disks_total = 0;
        while !out.mirrors.is_empty() {
            let requested = out.cancel.borrow().clone();
            if let Some(why) = requested {
                return Err(Ended {
                    phase: MigrationPhase::Aborted,
                    why,
                });
            }
            let jobs = out.qmp.execute_raw("query-block-jobs", json!({})).await?;
            let ours: Vec<&Json> = jobs
                .as_array()
                .into_iter()
                .flatten()
                .filter(|j| {
                    j["device"]
                        .as_str()
                        .is_some_and(|d| out.mirrors.iter().any(|m| m == d))
                })
                .collect();
            if ours.len() < out.mirrors.len() {
                return Err(Ended::failed(
                    "a disk's mirror to the target ended before it was ready",
                ));
            }
            disks_total = ours.iter().filter_map(|j| j["len"].as_u64()).sum();
            if ours.iter().all(|j| j["ready"].as_bool() == Some(true)) {
                break;
            }
            let left: u64 = ours
                .iter()
                .map(|j| {
                    j["len"]
                        .as_u64()
                        .unwrap_or(0)
                        .saturating_sub(j["offset"].as_u64().unwrap_or(0))
                })
                .sum();
            if left < best {
                best = left;
                last_progress = Instant::now();
            } else if last_progress.elapsed() > progress_timeout {
                return Err(Ended::failed(format!(
                    "no progress mirroring the disks for {}s (progressTimeout)",
                    progress_timeout.as_secs()
                )));
            }
            self.pause_for(&mut out.cancel).await;
        }
        let uri = format!("unix:{}", socket(self, MEMORY_SOCKET).display());
        out.qmp
            .execute_raw("migrate", json!({ "uri": uri }))
            .await?;
        self.update(|d| {
            if let Some(m) = d.migration.as_mut() {
                m.phase = MigrationPhase::Running;
                m.disks_total = disks_total;
            }
        });
        best = u64::MAX;
        last_progress = Instant::now();
        let mut post_copy = false;
        let mut cancelled: Option<Ended> = None;
        let mut final_figures_polls = 0;
        loop {
            let requested = out.cancel.borrow().clone();
            if cancelled.is_none()
                && let Some(why) = requested
            {
                out.qmp.execute_raw("migrate_cancel", json!({})).await?;
                cancelled = Some(Ended {
                    phase: MigrationPhase::Aborted,
                    why,
                });
            }
            let info = out.qmp.execute_raw("query-migrate", json!({})).await?;
            let ram = &info["ram"];
            let (total, transferred, remaining) = (
                ram["total"].as_u64().unwrap_or(0),
                ram["transferred"].as_u64().unwrap_or(0),
                ram["remaining"].as_u64().unwrap_or(0),
            );
            match info["status"].as_str().unwrap_or("") {
                "completed"
                    if info["total-time"].as_u64().unwrap_or(0) > 0
                        || final_figures_polls == FINAL_FIGURES_POLLS =>
                {
                    return Ok(info);
                }
                "completed" => {
                    final_figures_polls += 1;
                    tokio::time::sleep(POLL / 10).await;
                    continue;
                }
                "failed" => {
                    return Err(cancelled.unwrap_or_else(|| {
                        Ended::failed(
                            info["error-desc"]
                                .as_str()
                                .unwrap_or("QEMU reports the migration failed")
                                .to_owned(),
                        )
                    }));
                }
                "cancelled" => {
                    return Err(cancelled.unwrap_or_else(|| Ended {
                        phase: MigrationPhase::Aborted,
                        why: "QEMU cancelled the migration".into(),
                    }));
                }
                _ => {}
            }
            self.update_if(|d| match d.migration.as_mut() {
                Some(m)
                    if (m.memory_total, m.memory_transferred, m.memory_remaining)
                        != (total, transferred, remaining) =>
                {
                    m.memory_total = total;
                    m.memory_transferred = transferred;
                    m.memory_remaining = remaining;
                    true
                }
                _ => false,
            });
            if cancelled.is_none() && !post_copy {
                if remaining < best {
                    best = remaining;
                    last_progress = Instant::now();
                } else if last_progress.elapsed() > progress_timeout {
                    out.qmp.execute_raw("migrate_cancel", json!({})).await?;
                    cancelled = Some(Ended::failed(format!(
                        "no progress for {}s (progressTimeout)",
                        progress_timeout.as_secs()
                    )));
                }
                let data = total + disks_total;
                let allowed = Duration::from_secs(
                    out.req
                        .completion_timeout_per_gib
                        .saturating_mul(data.div_ceil(GIB).max(1)),
                );
                if cancelled.is_none() && started.elapsed() > allowed {
                    if out.req.allow_post_copy {
                        out.qmp
                            .execute_raw("migrate-start-postcopy", json!({}))
                            .await?;
                        post_copy = true;
                        self.update(|d| {
                            if let Some(m) = d.migration.as_mut() {
                                "PostCopy".clone_into(&mut m.mode);
                            }
                        });
                    } else {
                        out.qmp.execute_raw("migrate_cancel", json!({})).await?;
                        cancelled = Some(Ended::failed(format!(
                            "not completed within {}s (completionTimeoutPerGiB {} x {} GiB)",
                            allowed.as_secs(),
                            out.req.completion_timeout_per_gib,
                            data.div_ceil(GIB).max(1)
                        )));
                    }
                }
            }
            self.pause_for(&mut out.cancel).await;
        }
    }

    /// One poll interval, cut short by a cancel request.
    async fn pause_for(&self, cancel: &mut tokio::sync::watch::Receiver<Option<String>>) {
        let _ = tokio::time::timeout(POLL, cancel.changed()).await;
    }
}

/// Target: stop serving the disks and run the guest (unless post-copy already did).
async fn finish(vm: &mut Vm) -> Result<(), Error> {
    if vm.serves_disks {
        vm.qmp.execute_raw("nbd-server-stop", json!({})).await?;
        vm.serves_disks = false;
    }
    *vm.requested.lock().expect("poisoned") = None;
    let status = vm.qmp.execute(qmp::qapi::qmp::query_status {}).await?;
    if !status.running {
        vm.qmp.execute(qmp::qapi::qmp::cont {}).await?;
    }
    Ok(())
}

/// Ends the mirror jobs and removes their NBD nodes. After a completed migration (`force`
/// false) a ready mirror finishes cleanly, the target's copy whole; otherwise the jobs are
/// dropped where they are.
async fn close_mirrors(qmp: &qmp::QmpClient, mirrors: &[String], force: bool) {
    for m in mirrors {
        if let Err(e) = qmp
            .execute_raw("block-job-cancel", json!({"device": m, "force": force}))
            .await
        {
            tracing::debug!(mirror = %m, error = %e, "cancelling a mirror job");
        }
    }
    let deadline = Instant::now() + MIRROR_CLOSE_WAIT;
    while Instant::now() < deadline {
        let Ok(jobs) = qmp.execute_raw("query-block-jobs", json!({})).await else {
            break;
        };
        let busy = jobs.as_array().into_iter().flatten().any(|j| {
            j["device"]
                .as_str()
                .is_some_and(|d| mirrors.iter().any(|m| m == d))
        });
        if !busy {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    for m in mirrors {
        if let Err(e) = qmp
            .execute_raw("blockdev-del", json!({ "node-name": m }))
            .await
        {
            tracing::debug!(mirror = %m, error = %e, "removing a mirror's NBD node");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qemu::{CacheMode, DiskSource, Frontend};

    fn disk(name: &str, read_only: bool) -> Disk {
        Disk {
            name: name.into(),
            source: DiskSource {
                path: format!("/d/{name}").into(),
                format: crate::qemu::ImageFormat::Qcow2,
                block_device: false,
            },
            frontend: Frontend::Virtio,
            read_only,
            cache: CacheMode::None,
            boot_index: None,
            serial: None,
            pci_bus: None,
            pci_addr: None,
            pci_multifunction: false,
            aio: crate::qemu::Aio::Threads,
            error_policy: crate::qemu::ErrorPolicy::Stop,
            share_rw: false,
            iothread: None,
            num_queues: None,
            virtio: crate::qemu::VirtioModel::NonTransitional,
        }
    }

    #[test]
    fn copied_disks_must_exist_and_be_writable() {
        let disks = [disk("root", false), disk("cloudinit", true)];
        let got = copied(&disks, &["root".into()]).expect("copied");
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].name, "root");
        let e = copied(&disks, &["cloudinit".into()]).expect_err("read-only");
        assert!(e.to_string().contains("disk cloudinit is read-only"), "{e}");
        let e = copied(&disks, &["data".into()]).expect_err("unknown");
        assert!(e.to_string().contains("the VMI has no disk data"), "{e}");
        assert!(copied(&disks, &[]).expect("none").is_empty());
    }
}
