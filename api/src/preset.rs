//! `VirtualMachineInstancePreset` (`kubevirt.io/v1`, deprecated but still served by KubeVirt):
//! domain settings virt-api's mutating webhook merges into every new VMI whose labels the
//! preset's selector matches (KubeVirt's `pkg/virt-api/webhooks/mutating-webhook/mutators/preset.go`).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube_core::{Selector, SelectorExt as _};
use kube_derive::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::quantity;
use crate::validation::FieldError;
use crate::vmi::{DomainSpec, VirtualMachineInstance};

/// A VMI annotated `"true"` with this is left alone by presets.
pub const EXCLUSION_ANNOTATION: &str =
    "virtualmachineinstancepresets.admission.kubevirt.io/exclude";
/// Prefix of the annotation naming an applied preset: `virtualmachinepreset.kubevirt.io/<name>`,
/// valued `kubevirt.io/v1`.
pub const APPLIED_ANNOTATION_PREFIX: &str = "virtualmachinepreset.kubevirt.io/";
/// The warning of a create that applied a preset, KubeVirt's words.
pub const DEPRECATION_WARNING: &str =
    "kubevirt.io/v1 VirtualMachineInstancePresets is now deprecated and will be removed in v2.";

/// The `spec` of a `VirtualMachineInstancePreset`.
#[skip_serializing_none]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstancePreset",
    namespaced,
    derive = "PartialEq",
    shortname = "vmipreset",
    shortname = "vmipresets",
    category = "all",
    crates(kube_core = "::kube_core"),
    doc = "VirtualMachineInstancePreset defines a VMI spec.domain to be applied to all VMIs that match the provided label selector. Deprecated."
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstancePresetSpec {
    /// Which VMIs the preset applies to.
    pub selector: LabelSelector,
    /// The domain settings to merge in: resource requests, CPU, firmware, clock, features,
    /// watchdog and IOThreads policy (KubeVirt merges nothing else).
    pub domain: Option<DomainSpec>,
}

/// Validate a preset as KubeVirt's `ValidateVMIPresetSpec`: a domain is required.
pub fn validate_preset(preset: &VirtualMachineInstancePreset) -> Vec<FieldError> {
    if preset.spec.domain.is_none() {
        return vec![FieldError {
            path: "spec.domain".into(),
            message: "missing domain.".into(),
        }];
    }
    Vec::new()
}

/// Why presets could not be applied: two matching presets disagree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("VirtualMachinePresets cannot be applied due to conflicts: {}", .0.join(", "))]
pub struct PresetConflict(pub Vec<String>);

/// What [`apply_presets`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Names of the presets applied (and annotated).
    pub presets: Vec<String>,
    /// What was left out, for the log (KubeVirt logs it as a warning): `preset: why`.
    pub skipped: Vec<String>,
}

/// Merges the presets of the VMI's namespace that match its labels into its domain, annotating
/// each applied one, as KubeVirt's `applyPresets`. A VMI marked excluded is left alone; two
/// matching presets that conflict refuse the VMI. Where the VMI already sets a field to
/// another value, the VMI's stays and the rest of the preset is applied.
pub fn apply_presets(
    vmi: &mut VirtualMachineInstance,
    presets: &[VirtualMachineInstancePreset],
) -> Result<Applied, PresetConflict> {
    let excluded = vmi
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(EXCLUSION_ANNOTATION))
        .is_some_and(|v| v == "true");
    if excluded {
        return Ok(Applied::default());
    }
    let empty = BTreeMap::new();
    let labels = vmi.metadata.labels.as_ref().unwrap_or(&empty);
    let matching: Vec<&VirtualMachineInstancePreset> = presets
        .iter()
        .filter(|p| p.metadata.namespace == vmi.metadata.namespace)
        .filter(|p| Selector::try_from(p.spec.selector.clone()).is_ok_and(|s| s.matches(labels)))
        .collect();
    let empty_domain = DomainSpec::default();
    let domain = |p: &VirtualMachineInstancePreset| p.spec.domain.clone().unwrap_or_default();
    let mut conflicts = Vec::new();
    for (i, p) in matching.iter().enumerate() {
        for visited in &matching[..i] {
            let found = merge_conflicts(
                p.spec.domain.as_ref().unwrap_or(&empty_domain),
                visited.spec.domain.as_ref().unwrap_or(&empty_domain),
            );
            if !found.is_empty() {
                conflicts.push(format!(
                    "presets '{}' and '{}' conflict: [{}]",
                    p.metadata.name.as_deref().unwrap_or_default(),
                    visited.metadata.name.as_deref().unwrap_or_default(),
                    found.join(", ")
                ));
            }
        }
    }
    if !conflicts.is_empty() {
        return Err(PresetConflict(conflicts));
    }
    let mut out = Applied::default();
    for p in matching {
        let name = p.metadata.name.clone().unwrap_or_default();
        let preset = domain(p);
        let conflicts = merge_conflicts(&preset, &vmi.spec.domain);
        if merge_domain(&preset, &mut vmi.spec.domain) {
            if !conflicts.is_empty() {
                out.skipped.push(format!(
                    "{name}: some settings were not applied: {}",
                    conflicts.join(", ")
                ));
            }
            vmi.metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .insert(
                    format!("{APPLIED_ANNOTATION_PREFIX}{name}"),
                    format!("{}/{}", crate::GROUP, crate::VERSION),
                );
            out.presets.push(name);
        } else {
            out.skipped
                .push(format!("{name}: unable to apply: {}", conflicts.join(", ")));
        }
    }
    Ok(out)
}

/// Where `preset` and `vmi` both set a mergeable field to different values (KubeVirt's
/// `checkMergeConflicts`), each `path: preset's != VMI's`.
fn merge_conflicts(preset: &DomainSpec, vmi: &DomainSpec) -> Vec<String> {
    let mut out = Vec::new();
    for (key, want) in &preset.resources.requests {
        if let Some(have) = vmi.resources.requests.get(key)
            && !quantity::same(want, have)
        {
            out.push(format!(
                "spec.resources.requests[{key}]: {} != {}",
                want.0, have.0
            ));
        }
    }
    let mut differ = |path: &str, a: &dyn erased::Json, b: &dyn erased::Json, same: bool| {
        if !same {
            out.push(format!("{path}: {} != {}", a.json(), b.json()));
        }
    };
    if let (Some(a), Some(b)) = (&preset.cpu, &vmi.cpu) {
        differ("spec.cpu", a, b, a == b);
    }
    if let (Some(a), Some(b)) = (&preset.firmware, &vmi.firmware) {
        differ("spec.firmware", a, b, a == b);
    }
    if let (Some(a), Some(b)) = (&preset.clock, &vmi.clock) {
        let offset = |c: &crate::vmi::Clock| crate::vmi::Clock {
            timer: None,
            ..c.clone()
        };
        let (oa, ob) = (offset(a), offset(b));
        differ("spec.clock.clockoffset", &oa, &ob, oa == ob);
        if let (Some(a), Some(b)) = (&a.timer, &b.timer) {
            differ("spec.clock.timer", a, b, a == b);
        }
    }
    if let (Some(a), Some(b)) = (&preset.features, &vmi.features) {
        differ("spec.features", a, b, a == b);
    }
    if let (Some(a), Some(b)) = (&preset.devices.watchdog, &vmi.devices.watchdog) {
        differ("spec.devices.watchdog", a, b, a == b);
    }
    if let (Some(a), Some(b)) = (&preset.io_threads_policy, &vmi.io_threads_policy) {
        differ("spec.ioThreadsPolicy", a, b, a == b);
    }
    out
}

mod erased {
    /// A value shown in a conflict as its JSON, as a user wrote it.
    pub(super) trait Json {
        fn json(&self) -> String;
    }

    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> String {
            serde_json::to_string(self).unwrap_or_default()
        }
    }
}

/// Copies each of the preset's fields the VMI leaves unset (KubeVirt's `mergeDomainSpec`);
/// true when at least one of the preset's fields now holds in the VMI.
fn merge_domain(preset: &DomainSpec, vmi: &mut DomainSpec) -> bool {
    let mut applied = false;
    if !preset.resources.requests.is_empty() {
        if vmi.resources.requests.is_empty() {
            vmi.resources
                .requests
                .clone_from(&preset.resources.requests);
        }
        applied |= vmi.resources.requests == preset.resources.requests;
    }
    applied |= fill(preset.cpu.as_ref(), &mut vmi.cpu);
    applied |= fill(preset.firmware.as_ref(), &mut vmi.firmware);
    if let Some(clock) = &preset.clock {
        let have = vmi.clock.get_or_insert_with(|| crate::vmi::Clock {
            utc: clock.utc.clone(),
            timezone: clock.timezone.clone(),
            timer: None,
        });
        applied |= have == clock;
        if clock.timer.is_some() {
            applied |= fill(clock.timer.as_ref(), &mut have.timer);
        }
    }
    applied |= fill(preset.features.as_ref(), &mut vmi.features);
    applied |= fill(preset.devices.watchdog.as_ref(), &mut vmi.devices.watchdog);
    applied |= fill(
        preset.io_threads_policy.as_ref(),
        &mut vmi.io_threads_policy,
    );
    applied
}

/// Sets `vmi` to `preset` when unset; whether they are now equal (false when the preset has
/// nothing there).
fn fill<T: Clone + PartialEq>(preset: Option<&T>, vmi: &mut Option<T>) -> bool {
    let Some(p) = preset else { return false };
    vmi.get_or_insert_with(|| p.clone()) == p
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    fn preset(
        name: &str,
        labels: &[(&str, &str)],
        domain: &serde_json::Value,
    ) -> VirtualMachineInstancePreset {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstancePreset",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "selector": {"matchLabels": labels.iter().copied().collect::<BTreeMap<_, _>>()},
                "domain": domain,
            },
        }))
        .unwrap()
    }

    fn vmi(labels: &[(&str, &str)], domain: &serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default",
                "labels": labels.iter().copied().collect::<BTreeMap<_, _>>()},
            "spec": {"domain": domain},
        }))
        .unwrap()
    }

    fn annotations(v: &VirtualMachineInstance) -> Vec<(String, String)> {
        v.metadata
            .annotations
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect()
    }

    #[test]
    fn matching_presets_fill_unset_fields_and_are_annotated() {
        let presets = [
            preset(
                "small",
                &[("flavor", "small")],
                &serde_json::json!({"resources": {"requests": {"memory": "128Mi"}},
                    "cpu": {"cores": 2}, "devices": {}}),
            ),
            preset(
                "other",
                &[("flavor", "big")],
                &serde_json::json!({"cpu": {"cores": 8}, "devices": {}}),
            ),
        ];
        let mut v = vmi(
            &[("flavor", "small")],
            &serde_json::json!({"devices": {}, "features": {"acpi": {}}}),
        );
        assert_eq!(apply_presets(&mut v, &presets).unwrap().presets, ["small"]);
        assert_eq!(
            v.spec.domain.resources.requests["memory"].0,
            "128Mi".to_owned()
        );
        assert_eq!(v.spec.domain.cpu.as_ref().and_then(|c| c.cores), Some(2));
        assert!(
            v.spec.domain.features.is_some(),
            "the VMI's own fields stay"
        );
        assert_eq!(
            annotations(&v),
            [(
                "virtualmachinepreset.kubevirt.io/small".to_owned(),
                "kubevirt.io/v1".to_owned()
            )]
        );
    }

    #[test]
    fn the_vmis_own_value_wins_and_a_preset_with_nothing_applicable_is_not_annotated() {
        let presets = [preset(
            "cpu",
            &[("a", "b")],
            &serde_json::json!({"cpu": {"cores": 2}, "devices": {}}),
        )];
        let mut v = vmi(
            &[("a", "b")],
            &serde_json::json!({"cpu": {"cores": 4}, "devices": {}}),
        );
        let applied = apply_presets(&mut v, &presets).unwrap();
        assert!(applied.presets.is_empty());
        assert_eq!(
            applied.skipped,
            [r#"cpu: unable to apply: spec.cpu: {"cores":2} != {"cores":4}"#]
        );
        assert_eq!(v.spec.domain.cpu.as_ref().and_then(|c| c.cores), Some(4));
        assert!(annotations(&v).is_empty());
    }

    #[test]
    fn conflicting_presets_refuse_the_vmi_and_excluded_vmis_are_left_alone() {
        let presets = [
            preset(
                "one",
                &[("a", "b")],
                &serde_json::json!({"resources": {"requests": {"memory": "1Gi"}}, "devices": {}}),
            ),
            preset(
                "two",
                &[("a", "b")],
                &serde_json::json!({"resources": {"requests": {"memory": "2Gi"}}, "devices": {}}),
            ),
            // Equal by value: no conflict.
            preset(
                "three",
                &[("a", "b")],
                &serde_json::json!({"resources": {"requests": {"memory": "1024Mi"}}, "devices": {}}),
            ),
        ];
        let mut v = vmi(&[("a", "b")], &serde_json::json!({"devices": {}}));
        let err = apply_presets(&mut v, &presets).unwrap_err();
        assert_eq!(
            err.to_string(),
            "VirtualMachinePresets cannot be applied due to conflicts: presets 'two' and 'one' conflict: \
             [spec.resources.requests[memory]: 2Gi != 1Gi], presets 'three' and 'two' conflict: \
             [spec.resources.requests[memory]: 1024Mi != 2Gi]"
        );
        v.metadata.annotations =
            Some([(EXCLUSION_ANNOTATION.to_owned(), "true".to_owned())].into());
        assert_eq!(apply_presets(&mut v, &presets).unwrap(), Applied::default());
        assert!(v.spec.domain.resources.requests.is_empty());
    }

    #[test]
    fn a_preset_without_a_domain_is_refused() {
        let mut p = preset("p", &[], &serde_json::json!({}));
        assert!(validate_preset(&p).is_empty());
        p.spec.domain = None;
        assert_eq!(
            validate_preset(&p)
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["spec.domain: missing domain."]
        );
    }
}
