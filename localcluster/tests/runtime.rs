//! Watches and the kube-runtime machinery on top of them: raw watch rules, `watcher`,
//! `metadata_watcher`, a `Controller` with `owns` and `finalizer()`, and leader election.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Cluster, eventually};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{
    DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::core::PartialObjectMeta;
use kube::runtime::Controller;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource as _, ResourceExt as _};
use localcluster::Config;
use serde_json::json;

fn cm(name: &str, app: &str) -> ConfigMap {
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": {"app": app}}, "data": {"v": "0"}}),
    )
    .unwrap()
}

async fn next_raw(
    stream: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<ConfigMap>>> + Unpin),
) -> WatchEvent<ConfigMap> {
    tokio::time::timeout(Duration::from_secs(20), stream.next())
        .await
        .expect("a watch event within 20 s")
        .expect("the watch stream to stay open")
        .expect("a decodable watch event")
}

/// The next event that is not a bookmark.
async fn next_event(
    stream: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<ConfigMap>>> + Unpin),
) -> WatchEvent<ConfigMap> {
    loop {
        match next_raw(stream).await {
            WatchEvent::Bookmark(_) => {}
            other => return other,
        }
    }
}

fn describe(ev: &WatchEvent<ConfigMap>) -> String {
    match ev {
        WatchEvent::Added(o) => format!("ADDED {}", o.name_any()),
        WatchEvent::Modified(o) => format!("MODIFIED {}", o.name_any()),
        WatchEvent::Deleted(o) => format!("DELETED {}", o.name_any()),
        WatchEvent::Bookmark(_) => "BOOKMARK".into(),
        WatchEvent::Error(e) => format!("ERROR {}", e.code),
    }
}

#[tokio::test]
async fn watch_from_a_version_is_ordered_and_complete() {
    let c = Cluster::start().await;
    let api = c.api::<ConfigMap>();
    api.create(&PostParams::default(), &cm("before", "a"))
        .await
        .unwrap();
    let list = api.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.unwrap();
    // Changes made before the watch starts are still delivered: the watch resumes from `rv`.
    api.create(&PostParams::default(), &cm("one", "a"))
        .await
        .unwrap();
    api.patch(
        "one",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"v": "1"}})),
    )
    .await
    .unwrap();
    let mut stream = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    api.create(&PostParams::default(), &cm("two", "a"))
        .await
        .unwrap();
    api.delete("one", &DeleteParams::default()).await.unwrap();
    let mut seen = Vec::new();
    let mut last_rv = rv.parse::<u64>().unwrap();
    for _ in 0..4 {
        let ev = next_event(&mut stream).await;
        let obj = match &ev {
            WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => o,
            other => panic!("unexpected {}", describe(other)),
        };
        let this_rv = obj.resource_version().unwrap().parse::<u64>().unwrap();
        assert!(this_rv > last_rv, "events arrive in resourceVersion order");
        last_rv = this_rv;
        seen.push(describe(&ev));
    }
    assert_eq!(
        seen,
        vec!["ADDED one", "MODIFIED one", "ADDED two", "DELETED one"]
    );

    // resourceVersion 0: synthetic ADDED events for what exists.
    let mut fresh = api
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut fresh).await), "ADDED before");
    assert_eq!(describe(&next_event(&mut fresh).await), "ADDED two");
}

#[tokio::test]
async fn expired_versions_get_410_and_a_relist_recovers() {
    let c = Cluster::start_with(Config {
        history_window: 5,
        ..Config::default()
    })
    .await;
    if !c.in_process() {
        return;
    }
    let api = c.api::<ConfigMap>();
    let start = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    for i in 0..10 {
        api.create(&PostParams::default(), &cm(&format!("c{i}"), "a"))
            .await
            .unwrap();
    }
    let mut stream = api
        .watch(&WatchParams::default(), &start)
        .await
        .unwrap()
        .boxed();
    match next_event(&mut stream).await {
        WatchEvent::Error(e) => {
            assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
        }
        other => panic!("expected 410, got {}", describe(&other)),
    }
    // Relist, then watch from the list's version.
    let list = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 10);
    let mut stream = api
        .watch(
            &WatchParams::default(),
            &list.metadata.resource_version.unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    api.create(&PostParams::default(), &cm("after", "a"))
        .await
        .unwrap();
    assert_eq!(describe(&next_event(&mut stream).await), "ADDED after");

    // A continue token from before the window is also expired.
    let page = api.list(&ListParams::default().limit(2)).await.unwrap();
    for i in 0..6 {
        api.create(&PostParams::default(), &cm(&format!("d{i}"), "a"))
            .await
            .unwrap();
    }
    let err = api
        .list(
            &ListParams::default()
                .limit(2)
                .continue_token(&page.metadata.continue_.unwrap()),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 410));

    // kube-runtime's watcher lists and watches on its own.
    let mut events = watcher::watcher(api.clone(), watcher::Config::default()).boxed();
    let mut names = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(20), events.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            Event::InitApply(o) => names.push(o.name_any()),
            Event::InitDone => break,
            Event::Init | Event::Apply(_) | Event::Delete(_) => {}
        }
    }
    assert_eq!(names.len(), 17);
}

#[tokio::test]
async fn selector_transitions_and_bookmarks() {
    let c = Cluster::start_with(Config {
        bookmark_interval: Duration::from_millis(200),
        ..Config::default()
    })
    .await;
    let api = c.api::<ConfigMap>();
    api.create(&PostParams::default(), &cm("x", "other"))
        .await
        .unwrap();
    let rv = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let wp = WatchParams::default().labels("app=web");
    let mut stream = api.watch(&wp, &rv).await.unwrap().boxed();
    let set_app = |app: &'static str| {
        let api = api.clone();
        async move {
            api.patch(
                "x",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"app": app}}})),
            )
            .await
            .unwrap();
        }
    };
    set_app("web").await;
    assert_eq!(describe(&next_event(&mut stream).await), "ADDED x");
    api.patch(
        "x",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"v": "2"}})),
    )
    .await
    .unwrap();
    assert_eq!(describe(&next_event(&mut stream).await), "MODIFIED x");
    set_app("db").await;
    assert_eq!(describe(&next_event(&mut stream).await), "DELETED x");

    if c.in_process() {
        let mut with_bookmarks = api
            .watch(&WatchParams::default(), &rv)
            .await
            .unwrap()
            .boxed();
        let mut saw_bookmark = false;
        for _ in 0..10 {
            if let WatchEvent::Bookmark(b) = next_raw(&mut with_bookmarks).await {
                assert!(
                    b.metadata.resource_version.parse::<u64>().unwrap()
                        > rv.parse::<u64>().unwrap()
                );
                saw_bookmark = true;
                break;
            }
        }
        assert!(
            saw_bookmark,
            "a bookmark arrives when bookmarks are allowed"
        );
    }
}

#[tokio::test]
async fn streaming_lists_end_with_the_initial_events_bookmark() {
    let c = Cluster::start().await;
    let api = c.api::<ConfigMap>();
    for name in ["s1", "s2", "s3"] {
        api.create(&PostParams::default(), &cm(name, "a"))
            .await
            .unwrap();
    }
    let mut events =
        watcher::watcher(api.clone(), watcher::Config::default().streaming_lists()).boxed();
    let mut names = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(20), events.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            Event::InitApply(o) => names.push(o.name_any()),
            Event::InitDone => break,
            Event::Init | Event::Apply(_) | Event::Delete(_) => {}
        }
    }
    assert_eq!(names, vec!["s1", "s2", "s3"]);
    api.delete("s2", &DeleteParams::default()).await.unwrap();
    match tokio::time::timeout(Duration::from_secs(20), events.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        Event::Delete(o) => assert_eq!(o.name_any(), "s2"),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn metadata_watcher_sees_partial_objects() {
    let c = Cluster::start().await;
    let api = c.api::<ConfigMap>();
    api.create(&PostParams::default(), &cm("m", "a"))
        .await
        .unwrap();
    let meta = Api::<PartialObjectMeta<ConfigMap>>::namespaced(c.client.clone(), &c.namespace);
    let mut events = watcher::watcher(meta, watcher::Config::default()).boxed();
    loop {
        match tokio::time::timeout(Duration::from_secs(20), events.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            Event::InitApply(o) => assert_eq!(o.name_any(), "m"),
            Event::InitDone => break,
            Event::Init | Event::Apply(_) | Event::Delete(_) => {}
        }
    }
    api.patch(
        "m",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"z": "1"}}})),
    )
    .await
    .unwrap();
    match tokio::time::timeout(Duration::from_secs(20), events.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        Event::Apply(o) => assert_eq!(o.labels().get("z").map(String::as_str), Some("1")),
        other => panic!("unexpected {other:?}"),
    }
}

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct ReconcileError(#[from] kube::Error);

struct Ctx {
    client: kube::Client,
    cleanups: AtomicUsize,
}

const FINALIZER: &str = "localcluster.test/cleanup";

async fn reconcile(
    cm: Arc<ConfigMap>,
    ctx: Arc<Ctx>,
) -> Result<Action, kube::runtime::finalizer::Error<ReconcileError>> {
    let ns = cm.namespace().unwrap();
    let configmaps = Api::<ConfigMap>::namespaced(ctx.client.clone(), &ns);
    let secrets = Api::<Secret>::namespaced(ctx.client.clone(), &ns);
    finalizer(&configmaps, FINALIZER, cm, |event| async {
        match event {
            Finalizer::Apply(cm) => {
                let owner = cm.controller_owner_ref(&()).unwrap();
                let secret: Secret = serde_json::from_value(json!({
                    "metadata": {"name": format!("{}-secret", cm.name_any()), "ownerReferences": [owner]},
                    "stringData": {"v": "1"}
                }))
                .unwrap();
                secrets
                    .patch(&secret.name_any(), &PatchParams::apply("test-controller").force(), &Patch::Apply(&secret))
                    .await?;
                Ok(Action::await_change())
            }
            Finalizer::Cleanup(cm) => {
                ctx.cleanups.fetch_add(1, Ordering::SeqCst);
                match secrets.delete(&format!("{}-secret", cm.name_any()), &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
                Ok(Action::await_change())
            }
        }
    })
    .await
}

fn error_policy(
    _: Arc<ConfigMap>,
    _: &kube::runtime::finalizer::Error<ReconcileError>,
    _: Arc<Ctx>,
) -> Action {
    Action::requeue(Duration::from_millis(200))
}

#[tokio::test]
async fn controller_owns_and_finalizes() {
    let c = Cluster::start().await;
    let configmaps = c.api::<ConfigMap>();
    let secrets = c.api::<Secret>();
    let ctx = Arc::new(Ctx {
        client: c.client.clone(),
        cleanups: AtomicUsize::new(0),
    });
    let controller = tokio::spawn(
        Controller::new(configmaps.clone(), watcher::Config::default())
            .owns(secrets.clone(), watcher::Config::default())
            .run(reconcile, error_policy, ctx.clone())
            .for_each(|_| async {}),
    );
    configmaps
        .create(&PostParams::default(), &cm("owner", "a"))
        .await
        .unwrap();
    let secret = eventually(30, "the owned secret", || {
        let secrets = secrets.clone();
        async move { secrets.get_opt("owner-secret").await.unwrap() }
    })
    .await;
    let owner = configmaps.get("owner").await.unwrap();
    assert_eq!(owner.finalizers(), [FINALIZER.to_string()]);
    assert_eq!(secret.owner_references()[0].uid, owner.uid().unwrap());

    // Deleting the owned secret triggers a reconcile of the owner (through the metadata watch).
    secrets
        .delete("owner-secret", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "the secret to be recreated", || {
        let secrets = secrets.clone();
        let old_uid = secret.uid();
        async move {
            let s = secrets.get_opt("owner-secret").await.unwrap()?;
            (s.uid() != old_uid).then_some(())
        }
    })
    .await;

    // Deleting the owner runs the cleanup, then the finalizer goes and so does the object.
    configmaps
        .delete("owner", &DeleteParams::default())
        .await
        .unwrap();
    eventually(30, "the owner to be finalized away", || {
        let configmaps = configmaps.clone();
        async move {
            configmaps
                .get_opt("owner")
                .await
                .unwrap()
                .is_none()
                .then_some(())
        }
    })
    .await;
    assert!(secrets.get_opt("owner-secret").await.unwrap().is_none());
    assert!(ctx.cleanups.load(Ordering::SeqCst) >= 1);
    controller.abort();
}

#[tokio::test]
async fn two_lease_candidates_elect_one_leader() {
    let c = Cluster::start().await;
    let build = |identity: &str| {
        kube_lease_manager::LeaseManagerBuilder::new(c.client.clone(), "test-lock")
            .with_namespace(c.namespace.clone())
            .with_identity(identity)
            .with_duration(3)
            .with_grace(1)
            .build()
    };
    let first = build("candidate-a").await.unwrap();
    let second = build("candidate-b").await.unwrap();
    let (mut a, task_a) = first.watch().await;
    let (mut b, task_b) = second.watch().await;
    let leaders = eventually(30, "a leader", || {
        let (la, lb) = (*a.borrow_and_update(), *b.borrow_and_update());
        async move { (la || lb).then_some((la, lb)) }
    })
    .await;
    assert!(leaders.0 != leaders.1, "exactly one leader: {leaders:?}");
    // Hold for a few lease durations: leadership must stay with one candidate.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (la, lb) = (*a.borrow(), *b.borrow());
    assert!(la != lb, "still exactly one leader: ({la}, {lb})");
    let lease = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
        c.client.clone(),
        &c.namespace,
    )
    .get("test-lock")
    .await
    .unwrap();
    let holder = lease.spec.unwrap().holder_identity.unwrap();
    assert_eq!(holder, if la { "candidate-a" } else { "candidate-b" });
    drop(a);
    drop(b);
    let _ = task_a.await;
    let _ = task_b.await;
}
