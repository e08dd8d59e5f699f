//! `addvolume` and `removevolume`, as KubeVirt's `pkg/virtctl/vm/{add,remove}_volume.go`: the
//! volume looked up as a DataVolume then as a PVC, KubeVirt's flag rules and messages, the VM's
//! subresource first and the VMI's when there is no VM, a request the API server refused
//! because the object changed under it sent again.

use std::hash::{BuildHasher as _, Hasher as _};
use std::time::Duration;

use anyhow::bail;
use api::subresources::{
    AddVolumeOptions, HotplugVolumeSource, RemoveVolumeOptions, VmSubresource, VmiSubresource,
    vm_path, vmi_path,
};
use api::vmi::{
    DataVolumeSource, Disk, DiskBus, DiskCache, DiskTarget, LunTarget, PersistentVolumeClaimSource,
};

use crate::client::Cluster;
use crate::error::RequestError;
use crate::vm::dry_run;

/// What client-go's error says for a 422 without a message of its own: the API server's
/// answer to a JSON patch whose `test` failed, which virt-api passes on.
const CONCURRENT_ERROR: &str = "the server rejected our request due to an error in our request";
/// KubeVirt's retries of a request that met a concurrent change.
const MAX_RETRIES: u32 = 15;
/// `validation.DNS1035LabelMaxLength`: the disk and volume name is a DNS label.
const MAX_NAME_LENGTH: usize = 63;
/// CDI's DataVolume API, where KubeVirt's virtctl looks a volume up first.
const DATA_VOLUMES: &str = "/apis/cdi.kubevirt.io/v1beta1";

#[derive(Debug, clap::Args)]
pub struct AddVolumeArgs {
    /// The VM or VMI
    pub name: String,
    /// name of the volume source, either DV or PVC
    #[arg(long, required = true)]
    pub volume_name: String,
    /// name used in the disk/volume section of spec
    #[arg(long, default_value = "")]
    pub disk_name: String,
    /// serial number you want to assign to the disk
    #[arg(long, default_value = "")]
    pub serial: String,
    /// caching options attribute control the cache mechanism
    #[arg(long, default_value = "")]
    pub cache: String,
    /// [deprecated] this flag has no effect and will be removed in a future release
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub persist: bool,
    /// Perform a dry run: validate without changing anything
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub dry_run: bool,
    /// specifies disk type to be hotplugged (disk/lun). Disk by default.
    #[arg(long, default_value = "disk")]
    pub disk_type: String,
    /// specifies disk bus. scsi by default.
    #[arg(long, default_value = "scsi")]
    pub bus: String,
}

#[derive(Debug, clap::Args)]
pub struct RemoveVolumeArgs {
    /// The VM or VMI
    pub name: String,
    /// name used in volumes section of spec
    #[arg(long, required = true)]
    pub volume_name: String,
    /// [deprecated] this flag has no effect and will be removed in a future release
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub persist: bool,
    /// Perform a dry run: validate without changing anything
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub dry_run: bool,
}

/// The source of a volume found as a DataVolume (`data_volume`) or else a PVC, marked
/// hotpluggable as KubeVirt's virtctl sends it.
fn source(name: &str, data_volume: bool) -> HotplugVolumeSource {
    if data_volume {
        HotplugVolumeSource {
            data_volume: Some(DataVolumeSource {
                name: name.to_owned(),
                hotpluggable: Some(true),
            }),
            ..HotplugVolumeSource::default()
        }
    } else {
        HotplugVolumeSource {
            persistent_volume_claim: Some(PersistentVolumeClaimSource {
                claim_name: name.to_owned(),
                read_only: None,
                hotpluggable: Some(true),
            }),
            ..HotplugVolumeSource::default()
        }
    }
}

/// KubeVirt's checks and defaults, in its order, turning the flags and the volume's source into
/// the request: the name is `--disk-name` or else the volume's (a DNS label), the bus fits the
/// disk type, the serial defaults to the name, the cache is one QEMU knows.
pub fn add_options(
    a: &AddVolumeArgs,
    source: HotplugVolumeSource,
    dry_run: Vec<String>,
) -> anyhow::Result<AddVolumeOptions> {
    let name = if a.disk_name.is_empty() {
        &a.volume_name
    } else {
        &a.disk_name
    };
    if name.len() > MAX_NAME_LENGTH {
        if a.disk_name.is_empty() {
            bail!(
                "Invalid volume name {}, must not exceed {MAX_NAME_LENGTH} characters. Use in conjunction with --disk-name to specify a shorter name",
                a.volume_name
            );
        }
        bail!(
            "Invalid disk name {}, must not exceed {MAX_NAME_LENGTH} characters",
            a.disk_name
        );
    }
    let bus = DiskBus::from(a.bus.as_str());
    let mut disk = Disk::default();
    match a.disk_type.as_str() {
        "disk" => {
            if !matches!(bus, DiskBus::Scsi | DiskBus::Virtio) {
                bail!(
                    "Invalid bus type '{}' for disk. Only 'scsi' and 'virtio' are supported.",
                    a.bus
                );
            }
            disk.disk = Some(DiskTarget {
                bus: Some(bus),
                ..DiskTarget::default()
            });
        }
        "lun" => {
            if bus != DiskBus::Scsi {
                bail!(
                    "Invalid bus type '{}' for LUN disk. Only 'scsi' bus is supported.",
                    a.bus
                );
            }
            disk.lun = Some(LunTarget {
                bus: Some(bus),
                ..LunTarget::default()
            });
        }
        other => bail!("Invalid disk type '{other}'. Only LUN and Disk are supported."),
    }
    disk.serial = Some(if a.serial.is_empty() {
        name.clone()
    } else {
        a.serial.clone()
    });
    if !a.cache.is_empty() {
        let cache = DiskCache::from(a.cache.as_str());
        if !cache.is_known() {
            bail!("error adding volume, invalid cache value {}", a.cache);
        }
        disk.cache = Some(cache);
    }
    Ok(AddVolumeOptions {
        name: name.clone(),
        disk: Some(disk),
        volume_source: Some(source),
        dry_run,
    })
}

/// KubeVirt's lookup: a DataVolume of that name (any error, a cluster without CDI included,
/// means none), else a PVC.
async fn find_source(cluster: &Cluster, name: &str) -> anyhow::Result<HotplugVolumeSource> {
    let ns = &cluster.namespace;
    if cluster
        .get(&format!(
            "{DATA_VOLUMES}/namespaces/{ns}/datavolumes/{name}"
        ))
        .await
        .is_ok()
    {
        return Ok(source(name, true));
    }
    if cluster
        .get(&format!(
            "/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}"
        ))
        .await
        .is_ok()
    {
        return Ok(source(name, false));
    }
    bail!("error adding volume, Volume {name} is not a DataVolume or PersistentVolumeClaim")
}

/// KubeVirt's pause between retries: up to 4 ms times the retry, at random.
fn backoff(retry: u32) -> Duration {
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    Duration::from_millis(u64::from(retry) * (random % 5))
}

/// Sends `body` to the VM's subresource, or to the VMI's when there is no VM (a VMI of its
/// own), again while the API server answers that the object changed meanwhile. `what` is
/// KubeVirt's verb for the messages (`adding`, `removing`).
async fn submit<B: serde::Serialize>(
    cluster: &Cluster,
    name: &str,
    vm: VmSubresource,
    vmi: VmiSubresource,
    body: &B,
    what: &str,
) -> anyhow::Result<()> {
    let ns = &cluster.namespace;
    for retry in 1..=MAX_RETRIES {
        let mut result = cluster.put(&vm_path(ns, name, vm), Some(body)).await;
        if result.as_ref().is_err_and(RequestError::is_not_found) {
            result = cluster.put(&vmi_path(ns, name, vmi), Some(body)).await;
        }
        match result {
            Ok(_) => return Ok(()),
            Err(RequestError::Api(e)) if e.message == CONCURRENT_ERROR => {
                if retry < MAX_RETRIES {
                    tokio::time::sleep(backoff(retry)).await;
                }
            }
            Err(e) => bail!("error {what} volume, {e}"),
        }
    }
    bail!("error {what} volume after {MAX_RETRIES} retries")
}

pub async fn add(cluster: &Cluster, a: &AddVolumeArgs) -> anyhow::Result<()> {
    let dry = dry_run(a.dry_run);
    let source = find_source(cluster, &a.volume_name).await?;
    let opts = add_options(a, source, dry)?;
    submit(
        cluster,
        &a.name,
        VmSubresource::AddVolume,
        VmiSubresource::AddVolume,
        &opts,
        "adding",
    )
    .await?;
    println!(
        "Successfully submitted add volume request to VM {} for volume {}",
        a.name, a.volume_name
    );
    Ok(())
}

pub async fn remove(cluster: &Cluster, a: &RemoveVolumeArgs) -> anyhow::Result<()> {
    let opts = RemoveVolumeOptions {
        name: a.volume_name.clone(),
        dry_run: dry_run(a.dry_run),
    };
    submit(
        cluster,
        &a.name,
        VmSubresource::RemoveVolume,
        VmiSubresource::RemoveVolume,
        &opts,
        "removing",
    )
    .await?;
    println!(
        "Successfully submitted remove volume request to VM {} for volume {}",
        a.name, a.volume_name
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use serde_json::json;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        add: AddVolumeArgs,
    }

    fn args(flags: &[&str]) -> AddVolumeArgs {
        Cli::try_parse_from(["addvolume", "vm1"].iter().chain(flags))
            .unwrap()
            .add
    }

    fn options(flags: &[&str]) -> Result<serde_json::Value, String> {
        add_options(&args(flags), source("pvc1", false), Vec::new())
            .map(|o| serde_json::to_value(o).unwrap())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_kubevirts() {
        assert_eq!(
            options(&["--volume-name=pvc1"]).unwrap(),
            json!({
                "name": "pvc1",
                "disk": {"name": "", "disk": {"bus": "scsi"}, "serial": "pvc1"},
                "volumeSource": {"persistentVolumeClaim": {"claimName": "pvc1", "hotpluggable": true}},
            })
        );
        let o = options(&[
            "--volume-name=pvc1",
            "--disk-name=data",
            "--serial=1234",
            "--cache=writeback",
            "--bus=virtio",
        ])
        .unwrap();
        assert_eq!(o["name"], "data");
        assert_eq!(
            o["disk"],
            json!({"name": "", "disk": {"bus": "virtio"}, "serial": "1234", "cache": "writeback"})
        );
        let lun = options(&["--volume-name=pvc1", "--disk-type=lun"]).unwrap();
        assert_eq!(lun["disk"]["lun"], json!({"bus": "scsi"}));
        let dv = add_options(
            &args(&["--volume-name=dv1", "--dry-run"]),
            source("dv1", true),
            vec!["All".into()],
        )
        .unwrap();
        assert_eq!(
            serde_json::to_value(dv).unwrap()["volumeSource"],
            json!({"dataVolume": {"name": "dv1", "hotpluggable": true}})
        );
    }

    #[test]
    fn invalid_flags_are_refused_with_kubevirts_messages() {
        let long = "v".repeat(64);
        let cases = [
            (
                vec!["--volume-name=pvc1", "--bus=sata"],
                "Invalid bus type 'sata' for disk. Only 'scsi' and 'virtio' are supported.",
            ),
            (
                vec!["--volume-name=pvc1", "--disk-type=lun", "--bus=virtio"],
                "Invalid bus type 'virtio' for LUN disk. Only 'scsi' bus is supported.",
            ),
            (
                vec!["--volume-name=pvc1", "--disk-type=cdrom"],
                "Invalid disk type 'cdrom'. Only LUN and Disk are supported.",
            ),
            (
                vec!["--volume-name=pvc1", "--cache=unsafe"],
                "error adding volume, invalid cache value unsafe",
            ),
        ];
        for (flags, want) in cases {
            assert_eq!(options(&flags).unwrap_err(), want, "{flags:?}");
        }
        let volume = format!("--volume-name={long}");
        assert_eq!(
            options(&[&volume]).unwrap_err(),
            format!(
                "Invalid volume name {long}, must not exceed 63 characters. Use in conjunction with --disk-name to specify a shorter name"
            )
        );
        let disk = format!("--disk-name={long}");
        assert_eq!(
            options(&["--volume-name=pvc1", &disk]).unwrap_err(),
            format!("Invalid disk name {long}, must not exceed 63 characters")
        );
        // 63 characters is a valid name; a long volume is fine under a short disk name.
        assert!(options(&[&format!("--volume-name={}", "v".repeat(63))]).is_ok());
        assert!(options(&[&volume, "--disk-name=short"]).is_ok());
    }

    #[test]
    fn flags_are_kubevirts() {
        assert!(Cli::try_parse_from(["addvolume", "vm1"]).is_err());
        let a = args(&["--volume-name", "pvc1", "--persist", "--dry-run=false"]);
        assert!(a.persist && !a.dry_run);
        assert_eq!((a.disk_type.as_str(), a.bus.as_str()), ("disk", "scsi"));
        assert!(
            Cli::try_parse_from(["addvolume", "vm1", "--volume-name=x", "--invalid=1"]).is_err()
        );
    }
}
