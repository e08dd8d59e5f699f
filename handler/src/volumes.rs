//! `status.volumeStatus` from the launcher's domain disks, as KubeVirt's virt-handler keeps it
//! (`updateVolumeStatusesFromDomain`, `updateHotplugVolumeStatus`,
//! `generateEventsForVolumeStatusChange` in `pkg/virt-handler/vm.go`): every entry gets the
//! guest device its disk has, and a hotplugged volume is `Ready` once its disk is in the domain.
//!
//! virt-controller keeps an entry per volume and moves a hotplugged claim up to
//! `AttachedToNode` (its attachment pod runs); virt-handler moves it to `MountedToPod` once
//! its image is mounted in the launcher, to `Ready` once the guest has the disk, and after an
//! unplug to `UnMountedFromPod`, after which virt-controller deletes the attachment pod and the
//! entry. A disk hotplugged without an attachment pod (a volume the launcher creates itself,
//! such as an emptyDisk) gets its entry here, which goes once it left both spec and domain.
//!
//! Pure: the table tests pin every rule.

use std::collections::{BTreeMap, BTreeSet};

use api::VirtualMachineInstance;
use api::common::Preserved;
use api::status::VolumeStatus;
use launcher_api::domain::DiskStatus;

use crate::events::Event;

/// KubeVirt's reasons (`pkg/virt-handler/controller.go`).
pub const REASON_READY: &str = "VolumeReady";
pub const REASON_UNPLUGGED: &str = "VolumeUnplugged";
pub const PHASE_READY: &str = api::hotplug::PHASE_READY;

/// The device-name prefix of a bus (KubeVirt's `getPrefixFromBus`).
fn prefix(bus: &str) -> &'static str {
    match bus {
        "virtio" => "vd",
        _ => "sd",
    }
}

/// `vda`, ..., `vdz`, `vdaa`, ...: the kernel's disk naming (KubeVirt's `formatDeviceName`).
fn device_name(prefix: &str, index: usize) -> String {
    let mut name = Vec::new();
    let mut i = index + 1;
    while i > 0 {
        i -= 1;
        name.push(b'a' + u8::try_from(i % 26).expect("below 26"));
        i /= 26;
    }
    name.reverse();
    format!(
        "{prefix}{}",
        String::from_utf8(name).expect("ASCII letters")
    )
}

/// The guest device of each domain disk with a source (an empty CD-ROM has none). A target the
/// status already has is kept, so names stay stable across hotplugs; a new disk gets the first
/// free name of its bus, in the domain's disk order (KubeVirt's `makeDeviceName`).
pub fn targets(old: &[VolumeStatus], disks: &[DiskStatus]) -> BTreeMap<String, String> {
    let known: BTreeMap<&str, &str> = old
        .iter()
        .filter(|v| !v.target.is_empty())
        .map(|v| (v.name.as_str(), v.target.as_str()))
        .collect();
    let disks: Vec<&DiskStatus> = disks.iter().filter(|d| !d.source.is_empty()).collect();
    let mut used: BTreeSet<String> = BTreeSet::new();
    let mut out = BTreeMap::new();
    for d in &disks {
        if let Some(t) = known.get(d.name.as_str())
            && t.starts_with(prefix(&d.bus))
            && used.insert((*t).to_owned())
        {
            out.insert(d.name.clone(), (*t).to_owned());
        }
    }
    for d in disks {
        if out.contains_key(&d.name) {
            continue;
        }
        let p = prefix(&d.bus);
        // KubeVirt's bound too: three letters after the prefix.
        let Some(name) = (0..26 * 26 * 26)
            .map(|i| device_name(p, i))
            .find(|n| !used.contains(n))
        else {
            continue;
        };
        used.insert(name.clone());
        out.insert(d.name.clone(), name);
    }
    out
}

fn ready_message(name: &str) -> String {
    format!("Successfully attach hotplugged volume {name} to VM")
}

fn set(v: &mut VolumeStatus, phase: &str, reason: &str, message: String) {
    v.phase = Some(phase.to_owned());
    v.reason = Some(reason.to_owned());
    v.message = Some(message);
}

/// The new `volumeStatus` and the events of its change; `mounted`: the hotplugged volumes
/// whose images are mounted in the launcher now.
pub fn compute(
    vmi: &VirtualMachineInstance,
    old: &[VolumeStatus],
    disks: &[DiskStatus],
    mounted: &BTreeSet<String>,
) -> (Vec<VolumeStatus>, Vec<Event>) {
    use api::hotplug::{
        PHASE_ATTACHED_TO_NODE, PHASE_BOUND, PHASE_MOUNTED_TO_POD, PHASE_PENDING,
        PHASE_UNMOUNTED_FROM_POD, REASON_MOUNTED_TO_POD, REASON_UNMOUNTED_FROM_POD,
    };
    let targets = targets(old, disks);
    let in_spec: BTreeSet<&str> = vmi.spec.volumes.iter().map(|v| v.name.as_str()).collect();
    let mut events = Vec::new();
    let mut new = Vec::new();
    for v in old {
        let mut v = v.clone();
        v.target = targets.get(&v.name).cloned().unwrap_or_default();
        let spec = in_spec.contains(v.name.as_str());
        if v.hotplug_volume.is_some() {
            let phase = v.phase.as_deref();
            if !v.target.is_empty() {
                let message = ready_message(&v.name);
                set(&mut v, PHASE_READY, REASON_READY, message);
            } else if api::hotplug::attach_pod_name(&v).is_some() {
                // KubeVirt's `updateHotplugVolumeStatus`: virt-controller drops the entry.
                if mounted.contains(&v.name)
                    && spec
                    && matches!(
                        phase,
                        Some(PHASE_BOUND | PHASE_PENDING | PHASE_ATTACHED_TO_NODE)
                    )
                {
                    let message =
                        format!("Volume {} has been mounted in virt-launcher pod", v.name);
                    set(&mut v, PHASE_MOUNTED_TO_POD, REASON_MOUNTED_TO_POD, message);
                } else if !mounted.contains(&v.name)
                    && !spec
                    && matches!(
                        phase,
                        Some(PHASE_READY | PHASE_MOUNTED_TO_POD | PHASE_ATTACHED_TO_NODE)
                    )
                {
                    let message = format!(
                        "Volume {} has been unmounted from virt-launcher pod",
                        v.name
                    );
                    set(
                        &mut v,
                        PHASE_UNMOUNTED_FROM_POD,
                        REASON_UNMOUNTED_FROM_POD,
                        message,
                    );
                }
            } else if !spec {
                events.push(Event::normal(
                    REASON_UNPLUGGED,
                    &format!("Volume {} has been unplugged", v.name),
                ));
                continue;
            }
        }
        new.push(v);
    }
    let listed: BTreeSet<String> = new.iter().map(|v| v.name.clone()).collect();
    for d in disks.iter().filter(|d| d.hotplugged) {
        if listed.contains(&d.name) {
            continue;
        }
        let Some(target) = targets.get(&d.name) else {
            continue;
        };
        new.push(VolumeStatus {
            name: d.name.clone(),
            target: target.clone(),
            phase: Some(PHASE_READY.to_owned()),
            reason: Some(REASON_READY.to_owned()),
            message: Some(ready_message(&d.name)),
            // No attachment pod: the launcher's hotplug dir holds the volume.
            hotplug_volume: Some(Preserved(serde_json::json!({}))),
            ..VolumeStatus::default()
        });
    }
    for v in &new {
        let before = old.iter().find(|o| o.name == v.name);
        if v.phase.is_some() && before.is_none_or(|o| o.phase != v.phase) {
            events.push(Event::normal(
                v.reason.as_deref().unwrap_or_default(),
                v.message.as_deref().unwrap_or_default(),
            ));
        }
    }
    new.sort_by(|a, b| a.name.cmp(&b.name));
    (new, events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    fn disk(name: &str, bus: &str, source: &str, hotplugged: bool) -> DiskStatus {
        DiskStatus {
            name: name.into(),
            bus: bus.into(),
            source: source.into(),
            read_only: false,
            hotplugged,
        }
    }

    fn vmi(volumes: &[&str]) -> VirtualMachineInstance {
        let vols: Vec<_> = volumes
            .iter()
            .map(|v| serde_json::json!({"name": v, "persistentVolumeClaim": {"claimName": v}}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default"},
            "spec": {"domain": {"devices": {}}, "volumes": vols},
        }))
        .expect("vmi")
    }

    fn status(name: &str, target: &str, phase: Option<&str>, hotplug: bool) -> VolumeStatus {
        VolumeStatus {
            name: name.into(),
            target: target.into(),
            phase: phase.map(str::to_owned),
            hotplug_volume: hotplug.then(|| Preserved(serde_json::json!({}))),
            ..VolumeStatus::default()
        }
    }

    #[test]
    fn device_names_follow_the_kernel() {
        let names: Vec<_> = [0, 1, 25, 26, 27, 701, 702]
            .into_iter()
            .map(|i| device_name("sd", i))
            .collect();
        assert_eq!(
            names,
            ["sda", "sdb", "sdz", "sdaa", "sdab", "sdzz", "sdaaa"]
        );
    }

    #[test]
    fn targets_per_bus_in_disk_order_keeping_known_ones_and_skipping_empty_cdroms() {
        let disks = [
            disk("root", "virtio", "/disk.img", false),
            disk("cd", "sata", "", false),
            disk("data", "scsi", "/data", false),
            disk("hot", "scsi", "/hot", true),
            disk("more", "virtio", "/more", false),
        ];
        let fresh = targets(&[], &disks);
        assert_eq!(
            fresh.into_iter().collect::<Vec<_>>(),
            [
                ("data".to_owned(), "sda".to_owned()),
                ("hot".to_owned(), "sdb".to_owned()),
                ("more".to_owned(), "vdb".to_owned()),
                ("root".to_owned(), "vda".to_owned()),
            ]
        );
        // `hot` was plugged first as sda; `data` came later and takes the next free name.
        let kept = targets(&[status("hot", "sda", None, true)], &disks);
        assert_eq!(kept["hot"], "sda");
        assert_eq!(kept["data"], "sdb");
        // A recorded target of the wrong bus is not kept.
        let wrong = targets(&[status("root", "sdc", None, false)], &disks);
        assert_eq!(wrong["root"], "vda");
    }

    #[test]
    fn a_hotplugged_disk_becomes_a_ready_entry_with_its_event() {
        let disks = [
            disk("root", "virtio", "/disk.img", false),
            disk("hot", "scsi", "/hot", true),
        ];
        let (new, events) = compute(&vmi(&["root", "hot"]), &[], &disks, &BTreeSet::new());
        assert_eq!(
            serde_json::to_value(&new).expect("json"),
            serde_json::json!([{
                "name": "hot",
                "target": "sda",
                "phase": "Ready",
                "reason": "VolumeReady",
                "message": "Successfully attach hotplugged volume hot to VM",
                "hotplugVolume": {},
            }])
        );
        assert_eq!(
            events,
            [Event::normal(
                "VolumeReady",
                "Successfully attach hotplugged volume hot to VM"
            )]
        );
        // Unchanged the second time: no event, same status.
        let (again, events) = compute(&vmi(&["root", "hot"]), &new, &disks, &BTreeSet::new());
        assert_eq!(again, new);
        assert!(events.is_empty(), "{events:?}");
    }

    #[test]
    fn controller_entries_get_targets_and_pending_hotplugs_wait() {
        let disks = [
            disk("root", "virtio", "/disk.img", false),
            disk("hot", "scsi", "/hot", true),
        ];
        let old = [
            status("root", "", None, false),
            status("hot", "", Some("MountedToPod"), true),
            status("later", "", Some("Pending"), true),
        ];
        let (new, events) = compute(
            &vmi(&["root", "hot", "later"]),
            &old,
            &disks,
            &BTreeSet::new(),
        );
        let got: Vec<_> = new
            .iter()
            .map(|v| (v.name.as_str(), v.target.as_str(), v.phase.as_deref()))
            .collect();
        assert_eq!(
            got,
            [
                ("hot", "sda", Some("Ready")),
                ("later", "", Some("Pending")),
                ("root", "vda", None),
            ]
        );
        assert_eq!(
            events,
            [Event::normal(
                "VolumeReady",
                "Successfully attach hotplugged volume hot to VM"
            )]
        );
    }

    #[test]
    fn an_unplugged_volume_leaves_the_status_with_an_event() {
        let disks = [disk("root", "virtio", "/disk.img", false)];
        let old = [
            status("hot", "sda", Some("Ready"), true),
            status("root", "vda", None, false),
        ];
        let (new, events) = compute(&vmi(&["root"]), &old, &disks, &BTreeSet::new());
        assert_eq!(new, [status("root", "vda", None, false)]);
        assert_eq!(
            events,
            [Event::normal(
                "VolumeUnplugged",
                "Volume hot has been unplugged"
            )]
        );
        // Still in the spec (being plugged again): kept, without a target.
        let (new, events) = compute(&vmi(&["root", "hot"]), &old, &disks, &BTreeSet::new());
        assert_eq!(new[0], status("hot", "", Some("Ready"), true));
        assert!(events.is_empty(), "{events:?}");
    }

    #[test]
    fn attached_volumes_are_mounted_then_ready_and_unmounted_after_the_unplug() {
        let attached = |phase: &str| VolumeStatus {
            phase: Some(phase.into()),
            hotplug_volume: Some(Preserved(
                serde_json::json!({"attachPodName": "hp-1", "attachPodUID": "u"}),
            )),
            ..status("hot", "", None, true)
        };
        let root = [disk("root", "virtio", "/disk.img", false)];
        let mounted = BTreeSet::from(["hot".to_owned()]);
        let (new, events) = compute(
            &vmi(&["root", "hot"]),
            &[attached("AttachedToNode")],
            &root,
            &mounted,
        );
        assert_eq!(new[0].phase.as_deref(), Some("MountedToPod"));
        assert_eq!(
            events,
            [Event::normal(
                "VolumeMountedToPod",
                "Volume hot has been mounted in virt-launcher pod"
            )]
        );
        // Not mounted yet: it waits.
        let (new, _) = compute(
            &vmi(&["root", "hot"]),
            &[attached("AttachedToNode")],
            &root,
            &BTreeSet::new(),
        );
        assert_eq!(new[0].phase.as_deref(), Some("AttachedToNode"));
        // Removed from the spec and out of the guest: unmounted, and the entry stays for
        // virt-controller to drop with the attachment pod.
        let (new, events) = compute(
            &vmi(&["root"]),
            &[attached("Ready")],
            &root,
            &BTreeSet::new(),
        );
        assert_eq!(new[0].phase.as_deref(), Some("UnMountedFromPod"));
        assert_eq!(events[0].reason, "VolumeUnMountedFromPod");
    }
}
