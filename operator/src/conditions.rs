//! The KubeVirt CR's conditions, written as KubeVirt's operator writes them
//! (`pkg/virt-operator/util/client.go`): one function per state of an install, with KubeVirt's
//! reasons and messages, and `set_timestamps`, which stamps only what changed.

use api::common::ConditionStatus;
use api::kubevirt::{KubeVirtCondition, KubeVirtConditionType as Type, KubeVirtStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// `ConditionReasonDeploymentFailedExisting`: another KubeVirt CR is already installed.
pub const REASON_FAILED_EXISTING: &str = "ExistingDeployment";
/// `ConditionReasonDeploymentFailedError`.
pub const REASON_FAILED_ERROR: &str = "DeploymentFailed";
/// `ConditionReasonDeletionFailedError`.
pub const REASON_DELETION_FAILED: &str = "DeletionFailed";
/// `ConditionReasonDeploymentCreated`.
pub const REASON_CREATED: &str = "AllResourcesCreated";
/// `ConditionReasonDeploymentReady`.
pub const REASON_READY: &str = "AllComponentsReady";
/// `ConditionReasonDeploying`.
pub const REASON_DEPLOYING: &str = "DeploymentInProgress";
/// `ConditionReasonUpdating`.
pub const REASON_UPDATING: &str = "UpdateInProgress";
/// `ConditionReasonDeleting`.
pub const REASON_DELETING: &str = "DeletionInProgress";

fn update(
    s: &mut KubeVirtStatus,
    type_: Type,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) {
    let at = if let Some(i) = s.conditions.iter().position(|c| c.type_ == type_) {
        i
    } else {
        s.conditions.push(KubeVirtCondition {
            type_,
            status: ConditionStatus::Unknown,
            last_probe_time: None,
            last_transition_time: None,
            reason: None,
            message: None,
        });
        s.conditions.len() - 1
    };
    let c = &mut s.conditions[at];
    c.status = status;
    c.reason = Some(reason.to_owned());
    c.message = Some(message.to_owned());
}

/// Available, Progressing and Degraded, which every state of an install sets together.
fn set_health(
    s: &mut KubeVirtStatus,
    [available, progressing, degraded]: [ConditionStatus; 3],
    reason: &str,
    message: &str,
) {
    update(s, Type::Available, available, reason, message);
    update(s, Type::Progressing, progressing, reason, message);
    update(s, Type::Degraded, degraded, reason, message);
}

fn remove(s: &mut KubeVirtStatus, type_: &Type) {
    s.conditions.retain(|c| c.type_ != *type_);
}

fn text(v: Option<&String>) -> &str {
    v.map_or("", String::as_str)
}

/// `UpdateConditionsDeploying`: installing the target version.
pub fn deploying(s: &mut KubeVirtStatus) {
    remove(s, &Type::Synchronized);
    let msg = format!(
        "Deploying version {} with registry {}",
        text(s.target_kube_virt_version.as_ref()),
        text(s.target_kube_virt_registry.as_ref())
    );
    set_health(
        s,
        [
            ConditionStatus::False,
            ConditionStatus::True,
            ConditionStatus::False,
        ],
        REASON_DEPLOYING,
        &msg,
    );
}

/// `UpdateConditionsUpdating`: moving from the observed version to the target one.
pub fn updating(s: &mut KubeVirtStatus) {
    remove(s, &Type::Created);
    remove(s, &Type::Synchronized);
    let msg = format!(
        "Transitioning from previous version {} with registry {} to target version {} using registry {}",
        text(s.observed_kube_virt_version.as_ref()),
        text(s.observed_kube_virt_registry.as_ref()),
        text(s.target_kube_virt_version.as_ref()),
        text(s.target_kube_virt_registry.as_ref())
    );
    set_health(
        s,
        [
            ConditionStatus::True,
            ConditionStatus::True,
            ConditionStatus::True,
        ],
        REASON_UPDATING,
        &msg,
    );
}

/// `UpdateConditionsCreated`: every object of the strategy exists.
pub fn created(s: &mut KubeVirtStatus) {
    update(
        s,
        Type::Created,
        ConditionStatus::True,
        REASON_CREATED,
        "All resources were created.",
    );
}

/// `UpdateConditionsAvailable`: every component is ready.
pub fn available(s: &mut KubeVirtStatus) {
    let msg = "All components are ready.";
    set_health(
        s,
        [
            ConditionStatus::True,
            ConditionStatus::False,
            ConditionStatus::False,
        ],
        REASON_READY,
        msg,
    );
}

/// `UpdateConditionsFailedExists`: another KubeVirt CR is the active one; nothing else is
/// set, so this CR is left alone.
pub fn failed_exists(s: &mut KubeVirtStatus) {
    update(
        s,
        Type::Synchronized,
        ConditionStatus::False,
        REASON_FAILED_EXISTING,
        "There is an active KubeVirt deployment",
    );
}

/// `UpdateConditionsFailedError`: the install failed with `error`.
pub fn failed_error(s: &mut KubeVirtStatus, error: &str) {
    let msg = format!("An error occurred during deployment: {error}");
    update(
        s,
        Type::Synchronized,
        ConditionStatus::False,
        REASON_FAILED_ERROR,
        &msg,
    );
    set_health(
        s,
        [
            ConditionStatus::False,
            ConditionStatus::False,
            ConditionStatus::True,
        ],
        REASON_FAILED_ERROR,
        &msg,
    );
}

/// `UpdateConditionsDeleting`: the CR is being deleted.
pub fn deleting(s: &mut KubeVirtStatus) {
    remove(s, &Type::Created);
    remove(s, &Type::Synchronized);
    let msg = "Deletion was triggered";
    set_health(
        s,
        [
            ConditionStatus::False,
            ConditionStatus::False,
            ConditionStatus::True,
        ],
        REASON_DELETING,
        msg,
    );
}

/// `UpdateConditionsDeletionFailed`: removing the install failed with `error`.
pub fn deletion_failed(s: &mut KubeVirtStatus, error: &str) {
    update(
        s,
        Type::Synchronized,
        ConditionStatus::False,
        REASON_DELETION_FAILED,
        &format!("An error occurred during deletion: {error}"),
    );
}

/// `SetConditionTimestamps`: a condition whose status, reason or message changed since
/// `before` gets both times set to `now`; a new one only its probe time; an unchanged one
/// keeps its times (stamping every probe would write the CR on every reconcile).
pub fn set_timestamps(before: &KubeVirtStatus, after: &mut KubeVirtStatus, now: &Time) {
    for c in &mut after.conditions {
        match before.conditions.iter().find(|o| o.type_ == c.type_) {
            Some(old) => {
                if old.status != c.status || old.reason != c.reason || old.message != c.message {
                    c.last_probe_time = Some(now.clone());
                    c.last_transition_time = Some(now.clone());
                }
            }
            None => c.last_probe_time = Some(now.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(s: &KubeVirtStatus, t: &Type) -> Option<(String, String)> {
        s.conditions.iter().find(|c| c.type_ == *t).map(|c| {
            (
                c.status.as_str().to_owned(),
                c.reason.clone().unwrap_or_default(),
            )
        })
    }

    fn at(seconds: i64) -> Time {
        Time(jiff::Timestamp::from_second(seconds).unwrap())
    }

    #[test]
    fn an_install_goes_from_deploying_to_available() {
        let mut s = KubeVirtStatus {
            target_kube_virt_version: Some("v0.1.0".into()),
            target_kube_virt_registry: Some("kubevirt-rs".into()),
            ..KubeVirtStatus::default()
        };
        deploying(&mut s);
        assert_eq!(
            find(&s, &Type::Progressing),
            Some(("True".into(), REASON_DEPLOYING.into()))
        );
        assert_eq!(
            s.conditions[0].message.as_deref(),
            Some("Deploying version v0.1.0 with registry kubevirt-rs")
        );
        created(&mut s);
        available(&mut s);
        assert_eq!(
            find(&s, &Type::Available),
            Some(("True".into(), REASON_READY.into()))
        );
        assert_eq!(
            find(&s, &Type::Degraded),
            Some(("False".into(), REASON_READY.into()))
        );
        assert_eq!(
            find(&s, &Type::Created),
            Some(("True".into(), REASON_CREATED.into()))
        );
        let types: Vec<&str> = s.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(
            types,
            ["Available", "Progressing", "Degraded", "Created"],
            "one of each"
        );

        deleting(&mut s);
        assert_eq!(find(&s, &Type::Created), None);
        assert_eq!(
            find(&s, &Type::Degraded),
            Some(("True".into(), REASON_DELETING.into()))
        );
        failed_exists(&mut s);
        assert_eq!(
            find(&s, &Type::Synchronized),
            Some(("False".into(), REASON_FAILED_EXISTING.into()))
        );
    }

    #[test]
    fn timestamps_move_only_with_a_change() {
        let mut before = KubeVirtStatus::default();
        deploying(&mut before);
        set_timestamps(&KubeVirtStatus::default(), &mut before, &at(100));
        let progressing = &before.conditions[1];
        assert_eq!(progressing.last_probe_time, Some(at(100)));
        assert_eq!(
            progressing.last_transition_time, None,
            "new: probe time only"
        );

        let mut same = before.clone();
        deploying(&mut same);
        set_timestamps(&before, &mut same, &at(200));
        assert_eq!(same, before, "unchanged conditions keep their times");

        let mut done = before.clone();
        available(&mut done);
        failed_error(&mut done, "boom");
        set_timestamps(&before, &mut done, &at(300));
        for c in &done.conditions {
            match c.type_ {
                Type::Synchronized => assert_eq!(c.last_transition_time, None),
                _ => assert_eq!(c.last_transition_time, Some(at(300)), "{c:?}"),
            }
        }
        assert_eq!(
            done.conditions[0].message.as_deref(),
            Some("An error occurred during deployment: boom")
        );
    }
}
