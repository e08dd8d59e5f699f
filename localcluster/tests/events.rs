//! Events are one resource at two versions: what kube-rs's `Recorder` writes through
//! `events.k8s.io/v1` is what `kubectl get events` and `kubectl describe` read through core `v1`,
//! and the other way round.

mod common;

use common::{Cluster, eventually};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Event as CoreEvent, ObjectReference};
use k8s_openapi::api::events::v1::Event as NewEvent;
use kube::api::{ListParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use serde_json::json;

async fn config_map(c: &Cluster, name: &str) -> ConfigMap {
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": name}})).expect("config map");
    c.api::<ConfigMap>()
        .create(&PostParams::default(), &cm)
        .await
        .expect("creating the config map")
}

fn reference(cm: &ConfigMap) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("ConfigMap".into()),
        name: cm.metadata.name.clone(),
        namespace: cm.metadata.namespace.clone(),
        uid: cm.metadata.uid.clone(),
        ..ObjectReference::default()
    }
}

#[tokio::test]
async fn recorder_events_show_in_core_views_and_kubectl_describe() {
    let c = Cluster::start().await;
    let cm = config_map(&c, "watched").await;
    let core = c.api::<CoreEvent>();
    let selector = "involvedObject.name=watched,involvedObject.kind=ConfigMap";
    let mut watch = core
        .watch(&WatchParams::default().fields(selector), "0")
        .await
        .expect("watching core events")
        .boxed();

    let recorder = Recorder::new(
        c.client.clone(),
        Reporter {
            controller: "lc-test-controller".into(),
            instance: Some("lc-test-1".into()),
        },
    );
    let event = Event {
        type_: EventType::Normal,
        reason: "Synced".into(),
        note: Some("the gadget was synced".into()),
        action: "Sync".into(),
        secondary: None,
    };
    recorder
        .publish(&event, &reference(&cm))
        .await
        .expect("publishing through events.k8s.io/v1");

    let added = loop {
        match watch.try_next().await.expect("watch stream") {
            Some(WatchEvent::Added(e)) => break e,
            Some(WatchEvent::Bookmark(_)) => {}
            other => panic!("expected ADDED on the core watch, got {other:?}"),
        }
    };
    assert_eq!(added.message.as_deref(), Some("the gadget was synced"));
    assert_eq!(added.involved_object.uid, cm.metadata.uid);
    assert_eq!(
        added.reporting_component.as_deref(),
        Some("lc-test-controller")
    );
    assert_eq!(added.reporting_instance.as_deref(), Some("lc-test-1"));
    assert_eq!(added.action.as_deref(), Some("Sync"));

    // A second publish is a merge patch through events.k8s.io adding `series`.
    recorder
        .publish(&event, &reference(&cm))
        .await
        .expect("publishing the repeat");
    let modified = loop {
        match watch.try_next().await.expect("watch stream") {
            Some(WatchEvent::Modified(e)) => break e,
            Some(WatchEvent::Bookmark(_)) => {}
            other => panic!("expected MODIFIED on the core watch, got {other:?}"),
        }
    };
    assert_eq!(modified.series.map(|s| s.count), Some(Some(2)));

    let listed = core
        .list(&ListParams::default().fields(selector))
        .await
        .expect("listing core events");
    assert_eq!(listed.items.len(), 1);
    let other = core
        .list(&ListParams::default().fields("involvedObject.name=someone-else"))
        .await
        .expect("listing core events of another object");
    assert!(other.items.is_empty());

    let (ok, out, err) = c.kubectl(&["get", "events"]).await;
    assert!(ok, "kubectl get events: {err}");
    assert!(out.contains("the gadget was synced"), "{out}");
    let (ok, out, err) = c.kubectl(&["describe", "configmap", "watched"]).await;
    assert!(ok, "kubectl describe: {err}");
    let events = out
        .split_once("Events:")
        .map(|(_, e)| e)
        .unwrap_or_default();
    assert!(
        events.contains("Synced") && events.contains("the gadget was synced"),
        "describe shows no event:\n{out}"
    );
}

#[tokio::test]
async fn core_events_show_at_events_k8s_io() {
    let c = Cluster::start().await;
    let cm = config_map(&c, "target").await;
    let ev: CoreEvent = serde_json::from_value(json!({
        "metadata": {"name": "target.1"},
        "involvedObject": {"apiVersion": "v1", "kind": "ConfigMap", "name": "target",
                           "namespace": c.namespace, "uid": cm.metadata.uid},
        "reason": "Poked", "message": "poked by a test", "type": "Warning",
        "source": {"component": "lc-test"}, "count": 4,
        "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:01:00Z"
    }))
    .expect("core event");
    c.api::<CoreEvent>()
        .create(&PostParams::default(), &ev)
        .await
        .expect("creating through core v1");

    let new = c.api::<NewEvent>();
    let got = eventually(10, "the event at events.k8s.io/v1", || async {
        new.get_opt("target.1").await.expect("get")
    })
    .await;
    assert_eq!(got.note.as_deref(), Some("poked by a test"));
    assert_eq!(
        got.regarding.as_ref().and_then(|r| r.uid.clone()),
        cm.metadata.uid
    );
    assert_eq!(got.deprecated_count, Some(4));
    assert_eq!(
        got.deprecated_source.and_then(|s| s.component).as_deref(),
        Some("lc-test")
    );
    assert!(got.deprecated_first_timestamp.is_some());
    assert_eq!(got.reason.as_deref(), Some("Poked"));

    let by_regarding = new
        .list(&ListParams::default().fields("regarding.name=target"))
        .await
        .expect("listing by regarding.name");
    assert_eq!(by_regarding.items.len(), 1);
    let none = new
        .list(&ListParams::default().fields("regarding.name=other"))
        .await
        .expect("listing by another regarding.name");
    assert!(none.items.is_empty());
}
