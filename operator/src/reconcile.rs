//! One reconcile of a KubeVirt CR as a pure function: from the CR, the other CRs, what the
//! caches hold and the clock, the writes to make, the status to publish, and what to do with
//! the finalizer (KubeVirt's `KubeVirtController.execute`).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use api::kubevirt::{KubeVirt, KubeVirtPhase, KubeVirtStatus};
use serde_json::{Value, json};

use crate::certs;
use crate::conditions;
use crate::install::{self, Action, Live};
use crate::owned::ObjectRef;
use crate::strategy::{self, Release};

/// `spec.uninstallStrategy` that keeps the install while workloads exist.
pub const BLOCK_UNINSTALL: &str = "BlockUninstallIfWorkloadsExist";

/// What the operator knows beyond the CR.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub release: &'a Release,
    /// The operator's (and the install's) namespace.
    pub namespace: &'a str,
    /// Every KubeVirt CR in the namespace, this one included.
    pub all: &'a [KubeVirt],
    pub live: &'a Live,
    pub now: SystemTime,
    /// Workloads that block an uninstall (`"Virtual Machine Instances"`, ...), looked up only
    /// while the CR is being deleted under [`BLOCK_UNINSTALL`].
    pub workloads: Option<&'a str>,
}

/// What to do with the operator's finalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finalizer {
    Keep,
    /// Before anything is created, so a deletion always comes back to the operator.
    Add,
    /// Everything is gone.
    Remove,
}

/// The outcome of one reconcile.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub actions: Vec<Action>,
    pub status: KubeVirtStatus,
    pub finalizer: Finalizer,
    /// When to look again even if nothing changes (the next certificate renewal).
    pub requeue_after: Option<Duration>,
}

/// Whether `kv` is the CR this cluster's install follows: KubeVirt allows one. The active one
/// is the one that has a phase other than Deleted, else the oldest (then by name), so two CRs
/// created together agree on which one wins without talking to each other.
pub fn is_active(kv: &KubeVirt, all: &[KubeVirt]) -> bool {
    let deleted = |k: &KubeVirt| {
        k.status
            .as_ref()
            .and_then(|s| s.phase.as_ref())
            .is_some_and(|p| *p == KubeVirtPhase::Deleted)
    };
    let started = |k: &KubeVirt| k.status.as_ref().is_some_and(|s| s.phase.is_some());
    let rank = |k: &KubeVirt| {
        (
            !started(k),
            k.metadata.creation_timestamp.clone().map(|t| t.0),
            k.metadata.name.clone(),
        )
    };
    all.iter()
        .filter(|k| !deleted(k))
        .min_by_key(|k| rank(k))
        .is_some_and(|k| k.metadata.uid == kv.metadata.uid)
}

fn has_finalizer(kv: &KubeVirt) -> bool {
    kv.metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == api::labels::OPERATOR_FINALIZER)
}

/// The Secrets' data as text, by name, from the cached Secrets.
fn secrets_of(live: &Live, namespace: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    use base64::Engine as _;
    live.iter()
        .filter(|(r, _)| r.kind == "Secret" && r.namespace == namespace)
        .map(|(r, o)| {
            let data = o["data"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(v.as_str()?)
                        .ok()?;
                    Some((k.clone(), String::from_utf8(bytes).ok()?))
                })
                .collect();
            (r.name.clone(), data)
        })
        .collect()
}

/// Sets the CA bundle on the APIServices and on every webhook's client config.
fn inject_ca_bundle(objects: &mut [Value], bundle: &str) {
    use base64::Engine as _;
    let encoded = json!(base64::engine::general_purpose::STANDARD.encode(bundle));
    for o in objects {
        match o["kind"].as_str() {
            Some("APIService") => o["spec"]["caBundle"] = encoded.clone(),
            Some("MutatingWebhookConfiguration" | "ValidatingWebhookConfiguration") => {
                for hook in o["webhooks"].as_array_mut().into_iter().flatten() {
                    hook["clientConfig"]["caBundle"] = encoded.clone();
                }
            }
            _ => {}
        }
    }
}

/// One reconcile of `kv`.
pub fn reconcile(kv: &KubeVirt, cx: &Context<'_>) -> Outcome {
    let before = kv.status.clone().unwrap_or_default();
    let mut status = before.clone();
    let mut outcome = Outcome {
        actions: Vec::new(),
        status: before.clone(),
        finalizer: Finalizer::Keep,
        requeue_after: None,
    };
    if !is_active(kv, cx.all) {
        conditions::failed_exists(&mut status);
        outcome.status = status;
        if kv.metadata.deletion_timestamp.is_some() && has_finalizer(kv) {
            outcome.finalizer = Finalizer::Remove;
        }
        return outcome;
    }
    if kv.metadata.deletion_timestamp.is_some() {
        return uninstall(kv, cx, status, outcome);
    }
    if !has_finalizer(kv) {
        outcome.finalizer = Finalizer::Add;
        return outcome;
    }
    status.operator_version = Some(cx.release.tag.clone());
    let strategy = certs::rotation(kv.spec.certificate_rotate_strategy.as_ref().map(|p| &p.0))
        .and_then(|rotation| {
            strategy::render(&kv.spec, cx.release, cx.namespace).map(|s| (rotation, s))
        });
    let (rotation, strategy) = match strategy {
        Ok(r) => r,
        Err(e) => {
            conditions::failed_error(&mut status, &e.to_string());
            outcome.status = status;
            return outcome;
        }
    };
    status.target_kube_virt_version = Some(strategy.version.clone());
    status.target_kube_virt_registry = Some(strategy.registry.clone());
    status.target_deployment_id = Some(strategy.identifier.clone());
    let bundle = cx
        .live
        .get(&ObjectRef {
            kind: "ConfigMap".into(),
            namespace: cx.namespace.into(),
            name: certs::CA_BUNDLE_CONFIGMAP.into(),
        })
        .and_then(|o| o["data"][certs::CA_BUNDLE_KEY].as_str());
    let certificates = match certs::certificates(
        &secrets_of(cx.live, cx.namespace),
        bundle,
        cx.namespace,
        &rotation,
        cx.now,
    ) {
        Ok(c) => c,
        Err(e) => {
            conditions::failed_error(&mut status, &e.to_string());
            outcome.status = status;
            return outcome;
        }
    };
    let mut desired = certificates.objects;
    for o in &mut desired {
        strategy.stamp(o);
    }
    desired.extend(strategy.objects.iter().cloned());
    inject_ca_bundle(&mut desired, &certificates.bundle);

    let updating = status
        .observed_deployment_id
        .as_ref()
        .is_some_and(|observed| *observed != strategy.identifier);
    let plan = install::plan(&desired, cx.live, updating);
    let all_exist = desired
        .iter()
        .all(|o| cx.live.contains_key(&ObjectRef::of(o)));
    if plan.complete() {
        status.phase = Some(KubeVirtPhase::Deployed);
        status
            .observed_kube_virt_version
            .clone_from(&status.target_kube_virt_version);
        status
            .observed_kube_virt_registry
            .clone_from(&status.target_kube_virt_registry);
        status
            .observed_deployment_id
            .clone_from(&status.target_deployment_id);
        conditions::available(&mut status);
        conditions::created(&mut status);
    } else {
        status.phase = Some(KubeVirtPhase::Deploying);
        if updating {
            conditions::updating(&mut status);
        } else {
            conditions::deploying(&mut status);
        }
        if all_exist {
            conditions::created(&mut status);
        }
    }
    status.observed_generation = kv.metadata.generation;
    outcome.requeue_after = Some(
        certificates
            .next_renewal
            .duration_since(cx.now)
            .unwrap_or_default(),
    );
    outcome.actions = plan.actions;
    outcome.status = status;
    outcome
}

fn uninstall(
    kv: &KubeVirt,
    cx: &Context<'_>,
    mut status: KubeVirtStatus,
    mut outcome: Outcome,
) -> Outcome {
    if status.phase.as_ref() == Some(&KubeVirtPhase::Deleted) {
        outcome.finalizer = Finalizer::Remove;
        return outcome;
    }
    status.phase = Some(KubeVirtPhase::Deleting);
    conditions::deleting(&mut status);
    let blocking = kv.spec.uninstall_strategy.as_deref() == Some(BLOCK_UNINSTALL);
    if let (true, Some(workloads)) = (blocking, cx.workloads) {
        conditions::deletion_failed(
            &mut status,
            &format!(
                "uninstallStrategy {BLOCK_UNINSTALL}: there are {workloads}; delete them and the uninstall proceeds"
            ),
        );
        outcome.status = status;
        return outcome;
    }
    let plan = install::plan_uninstall(cx.live);
    if plan.complete() {
        status.phase = Some(KubeVirtPhase::Deleted);
    }
    outcome.actions = plan.actions;
    outcome.status = status;
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn kv(name: &str, created: i64, phase: Option<KubeVirtPhase>) -> KubeVirt {
        let mut kv: KubeVirt = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
            "metadata": {"name": name, "namespace": "kubevirt", "uid": name, "generation": 1,
                "finalizers": [api::labels::OPERATOR_FINALIZER]},
            "spec": {},
        }))
        .unwrap();
        kv.metadata.creation_timestamp = Some(Time(
            jiff::Timestamp::from_second(1_700_000_000 + created).unwrap(),
        ));
        kv.status = Some(KubeVirtStatus {
            phase,
            ..KubeVirtStatus::default()
        });
        kv
    }

    fn release() -> Release {
        Release {
            registry: "kubevirt-rs".into(),
            tag: "v1".into(),
            digests: BTreeMap::new(),
        }
    }

    fn cx<'a>(all: &'a [KubeVirt], live: &'a Live, release: &'a Release) -> Context<'a> {
        Context {
            release,
            namespace: "kubevirt",
            all,
            live,
            now: SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000),
            workloads: None,
        }
    }

    fn condition(s: &KubeVirtStatus, type_: &str) -> (String, String) {
        let c = s
            .conditions
            .iter()
            .find(|c| c.type_.as_str() == type_)
            .unwrap_or_else(|| panic!("no {type_} condition in {s:?}"));
        (
            c.status.as_str().to_owned(),
            c.reason.clone().unwrap_or_default(),
        )
    }

    #[test]
    fn only_the_first_cr_is_active() {
        let first = kv("first", 0, None);
        let second = kv("second", 10, None);
        let all = [second.clone(), first.clone()];
        assert!(is_active(&first, &all));
        assert!(!is_active(&second, &all));
        let deployed_later = kv("second", 10, Some(KubeVirtPhase::Deployed));
        assert!(
            is_active(&deployed_later, &[first.clone(), deployed_later.clone()]),
            "a CR that already installs stays the active one"
        );
        let (live, r) = (Live::new(), release());
        let out = reconcile(&second, &cx(&all, &live, &r));
        assert!(out.actions.is_empty());
        assert_eq!(
            condition(&out.status, "Synchronized"),
            ("False".into(), conditions::REASON_FAILED_EXISTING.into())
        );
    }

    #[test]
    fn a_new_cr_gets_the_finalizer_first_then_deploys() {
        let mut fresh = kv("kubevirt", 0, None);
        fresh.metadata.finalizers = None;
        let (live, r) = (Live::new(), release());
        let all = [fresh.clone()];
        let out = reconcile(&fresh, &cx(&all, &live, &r));
        assert_eq!(out.finalizer, Finalizer::Add);
        assert!(out.actions.is_empty());

        let k = kv("kubevirt", 0, None);
        let all = [k.clone()];
        let out = reconcile(&k, &cx(&all, &live, &r));
        assert_eq!(out.status.phase, Some(KubeVirtPhase::Deploying));
        assert_eq!(
            condition(&out.status, "Progressing"),
            ("True".into(), conditions::REASON_DEPLOYING.into())
        );
        assert_eq!(out.status.target_kube_virt_version.as_deref(), Some("v1"));
        assert_eq!(out.status.operator_version.as_deref(), Some("v1"));
        let created: Vec<String> = out.actions.iter().map(|a| a.target().to_string()).collect();
        assert!(created.contains(&"Secret kubevirt/kubevirt-ca".to_owned()));
        assert!(created.contains(&"Deployment kubevirt/virt-api".to_owned()));
        assert!(!created.contains(&"DaemonSet kubevirt/virt-handler".to_owned()));
        let api_service = out
            .actions
            .iter()
            .find_map(|a| match a {
                Action::Create(o) if o["kind"] == "APIService" => Some(o),
                _ => None,
            })
            .unwrap();
        assert!(
            api_service["spec"]["caBundle"]
                .as_str()
                .is_some_and(|b| !b.is_empty())
        );
        assert!(
            out.requeue_after
                .is_some_and(|d| d > Duration::from_hours(1))
        );
    }

    #[test]
    fn a_bad_setting_fails_with_its_field() {
        let mut k = kv("kubevirt", 0, None);
        k.spec.image_tag = Some("not a tag".into());
        let (live, r) = (Live::new(), release());
        let all = [k.clone()];
        let out = reconcile(&k, &cx(&all, &live, &r));
        assert!(out.actions.is_empty());
        let c = out
            .status
            .conditions
            .iter()
            .find(|c| c.type_.as_str() == "Synchronized")
            .unwrap();
        assert!(
            c.message
                .as_deref()
                .is_some_and(|m| m.contains("spec.imageTag")),
            "{c:?}"
        );
    }

    #[test]
    fn uninstall_waits_for_workloads_when_asked_to() {
        let mut k = kv("kubevirt", 0, Some(KubeVirtPhase::Deployed));
        k.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        k.spec.uninstall_strategy = Some(BLOCK_UNINSTALL.into());
        let sa =
            json!({"kind": "ServiceAccount", "metadata": {"name": "a", "namespace": "kubevirt"}});
        let live: Live = [(ObjectRef::of(&sa), sa)].into_iter().collect();
        let r = release();
        let all = [k.clone()];
        let mut c = cx(&all, &live, &r);
        c.workloads = Some("Virtual Machine Instances");
        let out = reconcile(&k, &c);
        assert!(out.actions.is_empty());
        assert_eq!(out.status.phase, Some(KubeVirtPhase::Deleting));
        assert_eq!(
            condition(&out.status, "Synchronized"),
            ("False".into(), conditions::REASON_DELETION_FAILED.into())
        );

        c.workloads = None;
        let out = reconcile(&k, &c);
        assert_eq!(out.actions.len(), 1);
        let empty = Live::new();
        c.live = &empty;
        let out = reconcile(&k, &c);
        assert_eq!(out.status.phase, Some(KubeVirtPhase::Deleted));
        k.status = Some(out.status);
        assert_eq!(reconcile(&k, &c).finalizer, Finalizer::Remove);
    }
}
