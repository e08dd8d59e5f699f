//! Volume and disk changes of a VMI by KubeVirt's own components, as KubeVirt's
//! `AdmitHotplugStorage` (`pkg/storage/admitters/storagehotplug.go`) admits them: a volume whose
//! entry in the old status has no `hotplugVolume` is permanent and may neither change nor go (a
//! migrated one may change); any other is a hotplug volume, which may go, may not change, and when
//! new must be a PVC or DataVolume with a disk of a kind that can be hotplugged.
//!
//! KubeVirt also admits `memoryDump` volumes without a disk and checks utility volumes;
//! kubevirt-rs has neither, so a `memoryDump` volume counts as any other here and, being neither
//! PVC nor DataVolume, is refused when new.

use std::collections::{BTreeMap, BTreeSet};

use api::VirtualMachineInstance;
use api::vmi::{Disk, DiskBus, Volume};

use super::{FIELD_VALUE_INVALID, Refusal};

/// The prefix of KubeVirt's messages about a new hotplug disk.
const PREFIX: &str = "Hotplug configuration";

fn invalid(message: &str) -> Refusal {
    Refusal::one(FIELD_VALUE_INVALID, "", message)
}

/// Admits the change of `old`'s volumes and disks into `new`'s. `declarative` is KubeVirt's
/// `DeclarativeHotplugVolumes`, with which a CD-ROM may be left without a volume (ejected).
pub(super) fn admit_hotplug(
    new: &VirtualMachineInstance,
    old: &VirtualMachineInstance,
    declarative: bool,
) -> Result<(), Refusal> {
    expected_disks(new, declarative)?;
    let permanent: BTreeSet<&str> = old
        .status
        .iter()
        .flat_map(|s| &s.volume_status)
        .filter(|s| s.hotplug_volume.is_none())
        .map(|s| s.name.as_str())
        .collect();
    let (new_permanent, new_hotplug) = split(&new.spec.volumes, &permanent);
    let (old_permanent, old_hotplug) = split(&old.spec.volumes, &permanent);
    let disks = Disks {
        new: disk_map(&new.spec.domain.devices.disks),
        old: disk_map(&old.spec.domain.devices.disks),
        migrated: migrated_volumes(new),
    };
    disks.permanent(&new_permanent, &old_permanent)?;
    disks.hotplug(new, &new_hotplug, &old_hotplug)
}

type ByName<'a, T> = BTreeMap<&'a str, &'a T>;

/// The permanent volumes and the hotplug volumes, by name.
fn split<'a>(
    volumes: &'a [Volume],
    permanent: &BTreeSet<&str>,
) -> (ByName<'a, Volume>, ByName<'a, Volume>) {
    let (kept, hotplug): (Vec<&Volume>, Vec<&Volume>) = volumes
        .iter()
        .partition(|v| permanent.contains(v.name.as_str()));
    let by_name = |v: Vec<&'a Volume>| v.into_iter().map(|v| (v.name.as_str(), v)).collect();
    (by_name(kept), by_name(hotplug))
}

fn disk_map(disks: &[Disk]) -> ByName<'_, Disk> {
    disks
        .iter()
        .filter(|d| !d.name.is_empty())
        .map(|d| (d.name.as_str(), d))
        .collect()
}

/// The volumes a storage migration moved (`status.migratedVolumes[].volumeName`).
fn migrated_volumes(vmi: &VirtualMachineInstance) -> BTreeSet<String> {
    vmi.status
        .as_ref()
        .and_then(|s| s.migrated_volumes.as_ref())
        .and_then(|m| m.0.as_array())
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("volumeName")?.as_str().map(str::to_owned))
        .collect()
}

/// KubeVirt's `validateExpectedDisksAndFilesystems`: every volume backs exactly one disk or
/// filesystem.
fn expected_disks(vmi: &VirtualMachineInstance, declarative: bool) -> Result<(), Refusal> {
    let names: BTreeSet<&str> = vmi.spec.volumes.iter().map(|v| v.name.as_str()).collect();
    let devices = &vmi.spec.domain.devices;
    let filesystems = devices.filesystems.len();
    let disks = devices
        .disks
        .iter()
        .filter(|d| names.contains(d.name.as_str()) || d.cdrom.is_none() || !declarative)
        .count();
    let required = filesystems + disks;
    if required != names.len() {
        return Err(invalid(&format!(
            "mismatch between volumes declared ({}) and required ({required})",
            names.len()
        )));
    }
    Ok(())
}

struct Disks<'a> {
    new: ByName<'a, Disk>,
    old: ByName<'a, Disk>,
    migrated: BTreeSet<String>,
}

impl Disks<'_> {
    /// KubeVirt's `verifyPermanentVolumes`.
    fn permanent(&self, new: &ByName<'_, Volume>, old: &ByName<'_, Volume>) -> Result<(), Refusal> {
        if new.len() != old.len() {
            return Err(invalid("Number of permanent volumes has changed"));
        }
        for (name, volume) in new {
            let Some(old_volume) = old.get(name) else {
                return Err(invalid(&format!("permanent volume {name}, not found")));
            };
            if self.migrated.contains(*name) {
                continue;
            }
            if volume != old_volume {
                return Err(invalid(&format!("permanent volume {name}, changed")));
            }
            if self.new.get(name) != self.old.get(name) {
                return Err(invalid(&format!("permanent disk {name}, changed")));
            }
        }
        Ok(())
    }

    /// KubeVirt's `verifyHotplugVolumes`.
    fn hotplug(
        &self,
        vmi: &VirtualMachineInstance,
        new: &ByName<'_, Volume>,
        old: &ByName<'_, Volume>,
    ) -> Result<(), Refusal> {
        for (name, volume) in new {
            if let Some(old_volume) = old.get(name) {
                if volume != old_volume && !self.migrated.contains(*name) {
                    return Err(invalid(&format!("hotplug volume {name}, changed")));
                }
                if !self.new.contains_key(name) {
                    return Err(invalid(&format!(
                        "volume {name} doesn't have a matching disk"
                    )));
                }
                if self.new.get(name) != self.old.get(name) {
                    return Err(invalid(&format!("hotplug disk {name}, changed")));
                }
                continue;
            }
            if volume.data_volume.is_none() && volume.persistent_volume_claim.is_none() {
                return Err(invalid(&format!(
                    "volume {name} is not a PVC or DataVolume"
                )));
            }
            let Some(disk) = self.new.get(name) else {
                return Err(invalid(&format!("disk {name} does not exist")));
            };
            if !self.old.contains_key(name) {
                let index = vmi
                    .spec
                    .domain
                    .devices
                    .disks
                    .iter()
                    .position(|d| d.name == *name)
                    .unwrap_or_default();
                hotplug_disk(disk, name, index)?;
            }
        }
        Ok(())
    }
}

/// KubeVirt's `ValidateHotplugDiskConfiguration`: a disk on the scsi or virtio bus or a LUN on
/// scsi, IOThreads only on virtio, a boot order above 0. `index` is the disk's place in the spec
/// (KubeVirt's message always says `disks[1]`).
fn hotplug_disk(disk: &Disk, name: &str, index: usize) -> Result<(), Refusal> {
    let bus = disk
        .disk
        .as_ref()
        .map(|d| d.bus.as_ref())
        .or_else(|| disk.lun.as_ref().map(|l| l.bus.as_ref()))
        .or_else(|| disk.cdrom.as_ref().map(|c| c.bus.as_ref()))
        .flatten();
    let bus_name = bus.map_or("", DiskBus::as_str);
    if disk.disk.is_some() {
        if !matches!(bus, Some(DiskBus::Scsi | DiskBus::Virtio)) {
            return Err(invalid(&format!(
                "{PREFIX} for disk [{name}] requires bus to be 'scsi' or 'virtio'. [{bus_name}] is not permitted."
            )));
        }
    } else if disk.lun.is_some() {
        if bus != Some(&DiskBus::Scsi) {
            return Err(invalid(&format!(
                "{PREFIX} for LUN [{name}] requires bus to be 'scsi'. [{bus_name}] is not permitted."
            )));
        }
    } else {
        return Err(invalid(&format!(
            "{PREFIX} for [{name}] requires diskDevice of type 'disk' or 'lun' to be used."
        )));
    }
    if disk.dedicated_io_thread == Some(true) && bus != Some(&DiskBus::Virtio) {
        return Err(invalid(&format!(
            "{PREFIX} for [{name}] requires virtio bus for IOThreads."
        )));
    }
    if disk.boot_order == Some(0) {
        let field = format!("spec.domain.devices.disks[{index}]");
        return Err(Refusal::one(
            FIELD_VALUE_INVALID,
            &format!("{field}.bootOrder"),
            &format!("{field} must have a boot order > 0, if supplied"),
        ));
    }
    Ok(())
}
