//! `start`, `stop`, `restart`, `migrate`, `migrate-cancel`: the VirtualMachine actions, worded
//! as KubeVirt's `pkg/virtctl/vm`.

use std::collections::BTreeMap;

use anyhow::{Context as _, bail};
use api::migration::VirtualMachineInstanceMigration;
use api::subresources::{
    DRY_RUN_ALL, MIGRATION_SELECTOR_LABEL, MigrateOptions, RestartOptions, StartOptions,
    StopOptions, VmSubresource, vm_path,
};
use kube::api::{DeleteParams, ListParams};

use crate::client::Cluster;
use crate::error::RequestError;

/// What KubeVirt prints before a dry run, and the directive it sends.
pub fn dry_run(enabled: bool) -> Vec<String> {
    if enabled {
        println!("Dry Run execution");
        vec![DRY_RUN_ALL.to_owned()]
    } else {
        Vec::new()
    }
}

pub fn scheduled(name: &str, command: &str) -> String {
    format!("VM {name} was scheduled to {command}")
}

/// KubeVirt takes a grace period only together with `--force`, and `--force` only with one.
pub fn forced_grace_period(grace_period: Option<i64>, force: bool) -> anyhow::Result<Option<i64>> {
    if grace_period.is_some() != force {
        bail!("Must both use --force=true and set --grace-period.");
    }
    Ok(grace_period)
}

pub fn stop_options(
    grace_period: Option<i64>,
    force: bool,
    dry_run: Vec<String>,
) -> anyhow::Result<StopOptions> {
    Ok(StopOptions {
        grace_period: forced_grace_period(grace_period, force)?,
        dry_run,
    })
}

pub fn restart_options(
    grace_period: Option<i64>,
    force: bool,
    dry_run: Vec<String>,
) -> anyhow::Result<RestartOptions> {
    Ok(RestartOptions {
        grace_period_seconds: forced_grace_period(grace_period, force)?,
        dry_run,
    })
}

/// `--addedNodeSelector=key=value1,key2=value2`, as pflag's `StringToString` reads it (the flag
/// may also repeat).
pub fn parse_node_selector(values: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for pair in values
        .iter()
        .flat_map(|v| v.split(','))
        .filter(|p| !p.is_empty())
    {
        let Some((k, v)) = pair.split_once('=') else {
            bail!("{pair} must be formatted as key=value");
        };
        out.insert(k.to_owned(), v.to_owned());
    }
    Ok(out)
}

pub async fn start(cluster: &Cluster, name: &str, paused: bool, dry: bool) -> anyhow::Result<()> {
    let opts = StartOptions {
        paused,
        dry_run: dry_run(dry),
    };
    put_vm(cluster, name, VmSubresource::Start, &opts)
        .await
        .map_err(|e| anyhow::anyhow!("Error starting VirtualMachine {e}"))?;
    println!("{}", scheduled(name, "start"));
    Ok(())
}

pub async fn stop(
    cluster: &Cluster,
    name: &str,
    grace_period: Option<i64>,
    force: bool,
    dry: bool,
) -> anyhow::Result<()> {
    let opts = stop_options(grace_period, force, dry_run(dry))?;
    put_vm(cluster, name, VmSubresource::Stop, &opts)
        .await
        .map_err(|e| {
            if force {
                anyhow::anyhow!("error force stopping VirtualMachine: {e}")
            } else {
                anyhow::anyhow!("error stopping VirtualMachine {e}")
            }
        })?;
    println!("{}", scheduled(name, "stop"));
    Ok(())
}

pub async fn restart(
    cluster: &Cluster,
    name: &str,
    grace_period: Option<i64>,
    force: bool,
    dry: bool,
) -> anyhow::Result<()> {
    let opts = restart_options(grace_period, force, dry_run(dry))?;
    put_vm(cluster, name, VmSubresource::Restart, &opts)
        .await
        .map_err(|e| {
            if force {
                anyhow::anyhow!("error force restarting VirtualMachine: {e}")
            } else {
                anyhow::anyhow!("error restarting VirtualMachine: {e}")
            }
        })?;
    println!("{}", scheduled(name, "restart"));
    Ok(())
}

pub async fn migrate(
    cluster: &Cluster,
    name: &str,
    node_selector: &[String],
    dry: bool,
) -> anyhow::Result<()> {
    let added_node_selector = parse_node_selector(node_selector)?;
    let opts = MigrateOptions {
        dry_run: dry_run(dry),
        added_node_selector,
    };
    put_vm(cluster, name, VmSubresource::Migrate, &opts)
        .await
        .map_err(|e| anyhow::anyhow!("Error migrating VirtualMachine {e}"))?;
    println!("{}", scheduled(name, "migrate"));
    Ok(())
}

async fn put_vm<B: serde::Serialize>(
    cluster: &Cluster,
    name: &str,
    sub: VmSubresource,
    body: &B,
) -> Result<Vec<u8>, RequestError> {
    cluster
        .put(&vm_path(&cluster.namespace, name, sub), Some(body))
        .await
}

/// The migration `migrate-cancel` deletes: the first of the VMI's that has not finished.
pub fn migration_to_cancel(
    migrations: &[VirtualMachineInstanceMigration],
) -> Option<&VirtualMachineInstanceMigration> {
    migrations.iter().find(|m| !migration_is_final(m))
}

fn migration_is_final(m: &VirtualMachineInstanceMigration) -> bool {
    use api::migration::VirtualMachineInstanceMigrationPhase as P;
    matches!(
        m.status.as_ref().and_then(|s| s.phase.as_ref()),
        Some(P::Succeeded | P::Failed)
    )
}

pub async fn migrate_cancel(cluster: &Cluster, name: &str, dry: bool) -> anyhow::Result<()> {
    let migrations: kube::Api<VirtualMachineInstanceMigration> =
        kube::Api::namespaced(cluster.client.clone(), &cluster.namespace);
    let list = migrations
        .list(&ListParams::default().labels(&format!("{MIGRATION_SELECTOR_LABEL}={name}")))
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "Error fetching virtual machine instance migration list {}",
                RequestError::from(e)
            )
        })?;
    let Some(migration) = migration_to_cancel(&list.items) else {
        bail!("Found no migration to cancel for {name}");
    };
    let mig_name = migration
        .metadata
        .name
        .clone()
        .context("the API server listed a migration without a name")?;
    let params = DeleteParams {
        dry_run: !dry_run(dry).is_empty(),
        ..DeleteParams::default()
    };
    migrations.delete(&mig_name, &params).await.map_err(|e| {
        anyhow::anyhow!(
            "Error canceling migration {mig_name} of a VirtualMachine {name}: {}",
            RequestError::from(e)
        )
    })?;
    println!("{}", scheduled(name, "migrate-cancel"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use api::migration::{
        VirtualMachineInstanceMigrationPhase as P, VirtualMachineInstanceMigrationSpec,
        VirtualMachineInstanceMigrationStatus,
    };

    use super::*;

    #[test]
    fn grace_period_needs_force_and_force_needs_grace_period() {
        let cases = [
            (None, false, Ok(None)),
            (Some(0), true, Ok(Some(0))),
            (Some(30), true, Ok(Some(30))),
            (Some(0), false, Err(())),
            (None, true, Err(())),
        ];
        for (grace, force, want) in cases {
            let got = stop_options(grace, force, vec![]);
            match want {
                Ok(g) => assert_eq!(got.unwrap().grace_period, g, "{grace:?} {force}"),
                Err(()) => assert_eq!(
                    got.unwrap_err().to_string(),
                    "Must both use --force=true and set --grace-period."
                ),
            }
            let got = restart_options(grace, force, vec![]);
            assert_eq!(got.is_ok(), want.is_ok());
        }
    }

    #[test]
    fn stop_body_is_kubevirts() {
        let opts = stop_options(Some(0), true, vec![DRY_RUN_ALL.into()]).unwrap();
        assert_eq!(
            serde_json::to_value(opts).unwrap(),
            serde_json::json!({"gracePeriod": 0, "dryRun": ["All"]})
        );
        let opts = restart_options(None, false, vec![]).unwrap();
        assert_eq!(serde_json::to_value(opts).unwrap(), serde_json::json!({}));
    }

    #[test]
    fn node_selectors() {
        let ok = [
            (vec![], vec![]),
            (vec!["a=b"], vec![("a", "b")]),
            (vec!["a=b,c=d=e"], vec![("a", "b"), ("c", "d=e")]),
            (vec!["a=b", "c="], vec![("a", "b"), ("c", "")]),
        ];
        for (input, want) in ok {
            let input: Vec<String> = input.into_iter().map(String::from).collect();
            let want: BTreeMap<String, String> = want
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            assert_eq!(parse_node_selector(&input).unwrap(), want);
        }
        assert_eq!(
            parse_node_selector(&["a=b,zone".into()])
                .unwrap_err()
                .to_string(),
            "zone must be formatted as key=value"
        );
    }

    #[test]
    fn cancels_the_unfinished_migration() {
        let mig = |name: &str, phase: Option<P>| {
            let mut m = VirtualMachineInstanceMigration::new(
                name,
                VirtualMachineInstanceMigrationSpec::default(),
            );
            m.status = phase.map(|phase| VirtualMachineInstanceMigrationStatus {
                phase: Some(phase),
                ..Default::default()
            });
            m
        };
        let list = vec![
            mig("old", Some(P::Succeeded)),
            mig("failed", Some(P::Failed)),
            mig("now", Some(P::Running)),
        ];
        assert_eq!(
            migration_to_cancel(&list).and_then(|m| m.metadata.name.as_deref()),
            Some("now")
        );
        let fresh = vec![mig("new", None)];
        assert!(migration_to_cancel(&fresh).is_some());
        assert!(migration_to_cancel(&list[..2]).is_none());
    }

    #[test]
    fn scheduled_lines() {
        assert_eq!(scheduled("demo", "start"), "VM demo was scheduled to start");
    }
}
