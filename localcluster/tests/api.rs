//! Black-box API conformance over HTTPS: create / update / status / generation rules, lists,
//! selectors, patches, server-side apply, deletion, content negotiation, discovery, CRDs.

mod common;

use common::{Cluster, eventually};
use http::Request;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams, Preconditions,
};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

fn status_of(err: kube::Error) -> (u16, String, String) {
    match err {
        kube::Error::Api(s) => (s.code, s.reason.clone(), s.message.clone()),
        other => panic!("expected an API error Status, got {other:?}"),
    }
}

#[allow(clippy::needless_pass_by_value)] // json! literals read best passed by value
fn cm(name: &str, labels: Value) -> ConfigMap {
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}),
    )
    .unwrap()
}

fn deployment(name: &str) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [
                {"name": "main", "image": "img:1", "env": [{"name": "A", "value": "1"}]},
                {"name": "side", "image": "side:1"}
            ]}}}
    }))
    .unwrap()
}

#[tokio::test]
async fn create_rules() {
    let c = Cluster::start().await;
    let api = c.api::<ConfigMap>();
    let created = api
        .create(&PostParams::default(), &cm("a", json!({})))
        .await
        .unwrap();
    assert!(!created.uid().unwrap().is_empty());
    assert!(created.creation_timestamp().is_some());
    assert!(created.resource_version().is_some());
    let (code, reason, message) = status_of(
        api.create(&PostParams::default(), &cm("a", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(message, "configmaps \"a\" already exists");

    let mut generated = cm("", json!({}));
    generated.metadata.name = None;
    generated.metadata.generate_name = Some("gen-".into());
    let g = api
        .create(&PostParams::default(), &generated)
        .await
        .unwrap();
    assert!(g.name_any().starts_with("gen-") && g.name_any().len() == "gen-".len() + 5);

    let missing = Api::<ConfigMap>::namespaced(c.client.clone(), "no-such-namespace");
    let (code, reason, _) = status_of(
        missing
            .create(&PostParams::default(), &cm("a", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (404, "NotFound"));

    let (code, _, _) = status_of(api.get("nope").await.unwrap_err());
    assert_eq!(code, 404);

    // dryRun=All answers as a create would, and stores nothing.
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let answered = api.create(&dry, &cm("dry", json!({}))).await.unwrap();
    assert_eq!(answered.name_any(), "dry");
    assert_eq!(status_of(api.get("dry").await.unwrap_err()).0, 404);

    // Resource versions only grow.
    let b = api
        .create(&PostParams::default(), &cm("b", json!({})))
        .await
        .unwrap();
    let rv = |o: &ConfigMap| o.resource_version().unwrap().parse::<u64>().unwrap();
    assert!(rv(&b) > rv(&created));
}

#[tokio::test]
async fn update_concurrency_generation_and_status() {
    // A custom resource: no controller writes to it behind the test's back.
    let c = Cluster::start().await;
    let api = install_widgets(&c).await;
    let pp = PostParams::default();
    let w: DynamicObject = serde_json::from_value(json!({"apiVersion": "example.com/v1",
        "kind": "Widget", "metadata": {"name": "d"}, "spec": {"replicas": 1}}))
    .unwrap();
    let d = api.create(&pp, &w).await.unwrap();
    assert_eq!(d.metadata.generation, Some(1));

    let mut labelled = d.clone();
    labelled.labels_mut().insert("x".into(), "y".into());
    let labelled = api.replace("d", &pp, &labelled).await.unwrap();
    assert_eq!(
        labelled.metadata.generation,
        Some(1),
        "metadata changes keep the generation"
    );

    // The original object's resourceVersion is stale now.
    let (code, reason, _) = status_of(api.replace("d", &pp, &d).await.unwrap_err());
    assert_eq!((code, reason.as_str()), (409, "Conflict"));

    let mut scaled = labelled.clone();
    scaled.data["spec"]["replicas"] = json!(3);
    scaled.data["status"] = json!({"replicas": 42});
    let scaled = api.replace("d", &pp, &scaled).await.unwrap();
    assert_eq!(scaled.metadata.generation, Some(2));
    assert!(
        scaled.data.get("status").is_none(),
        "status is ignored on the main resource"
    );

    let mut status = scaled.clone();
    status.data["status"] = json!({"replicas": 3});
    status.data["spec"]["replicas"] = json!(9);
    let after = api.replace_status("d", &pp, &status).await.unwrap();
    assert_eq!(after.data["status"]["replicas"], 3);
    assert_eq!(
        after.data["spec"]["replicas"], 3,
        "spec is ignored on the status subresource"
    );
    assert_eq!(
        after.metadata.generation,
        Some(2),
        "status writes keep the generation"
    );

    // A no-op update does not bump the resourceVersion.
    let again = api.replace("d", &pp, &after).await.unwrap();
    assert_eq!(again.resource_version(), after.resource_version());
}

#[tokio::test]
async fn lists_paginate_and_select() {
    let c = Cluster::start().await;
    let api = c.api::<ConfigMap>();
    for i in 0..7 {
        let tier = ["a", "b", "c"][i % 3];
        let mut labels = json!({"tier": tier});
        if i == 0 {
            labels["skip"] = json!("yes");
        }
        api.create(&PostParams::default(), &cm(&format!("cm-{i}"), labels))
            .await
            .unwrap();
    }
    let mut names = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut lp = ListParams::default().limit(3);
        if let Some(t) = &token {
            lp = lp.continue_token(t);
        }
        let page = api.list(&lp).await.unwrap();
        pages += 1;
        if pages == 1 {
            assert_eq!(page.metadata.remaining_item_count, Some(4));
        }
        names.extend(page.items.iter().map(ResourceExt::name_any));
        match page.metadata.continue_ {
            Some(t) if !t.is_empty() => token = Some(t),
            _ => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(names, (0..7).map(|i| format!("cm-{i}")).collect::<Vec<_>>());

    let selected = api
        .list(&ListParams::default().labels("tier in (a,b),!skip"))
        .await
        .unwrap();
    let selected: Vec<String> = selected.items.iter().map(ResourceExt::name_any).collect();
    assert_eq!(selected, vec!["cm-1", "cm-3", "cm-4", "cm-6"]);
    let by_name = api
        .list(&ListParams::default().fields("metadata.name=cm-2"))
        .await
        .unwrap();
    assert_eq!(by_name.items.len(), 1);
    let (code, reason, message) = status_of(
        api.list(&ListParams::default().fields("spec.nodeName=x"))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (400, "BadRequest"));
    assert!(message.contains("spec.nodeName"), "{message}");
    let (code, _, _) = status_of(
        api.list(&ListParams::default().labels("a in b"))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 400);
}

#[tokio::test]
async fn pods_bind_select_and_delete_gracefully() {
    let c = Cluster::start().await;
    let pods = c.api::<Pod>();
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}}))
    .unwrap();
    let created = pods.create(&PostParams::default(), &pod).await.unwrap();
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Pending"));
    pods.create(&PostParams::default(), &{
        let mut other = pod.clone();
        other.metadata.name = Some("q".into());
        other
    })
    .await
    .unwrap();

    let bind = |node: &str| {
        let body = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}});
        Request::post(format!("/api/v1/namespaces/{}/pods/p/binding", c.namespace))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&body).unwrap())
            .unwrap()
    };
    c.client.request::<Value>(bind("node-1")).await.unwrap();
    let (code, _, _) = status_of(c.client.request::<Value>(bind("node-2")).await.unwrap_err());
    assert_eq!(code, 409);

    let on_node = pods
        .list(&ListParams::default().fields("spec.nodeName=node-1"))
        .await
        .unwrap();
    assert_eq!(
        on_node
            .items
            .iter()
            .map(ResourceExt::name_any)
            .collect::<Vec<_>>(),
        vec!["p"]
    );
    let pending = pods
        .list(&ListParams::default().fields("status.phase=Pending,spec.nodeName="))
        .await
        .unwrap();
    assert_eq!(
        pending
            .items
            .iter()
            .map(ResourceExt::name_any)
            .collect::<Vec<_>>(),
        vec!["q"]
    );

    // An assigned pod waits for its kubelet; an unassigned one goes at once.
    pods.delete("p", &DeleteParams::default()).await.unwrap();
    let p = pods.get("p").await.unwrap();
    assert!(p.metadata.deletion_timestamp.is_some());
    assert_eq!(p.metadata.deletion_grace_period_seconds, Some(30));
    pods.delete("q", &DeleteParams::default()).await.unwrap();
    assert_eq!(status_of(pods.get("q").await.unwrap_err()).0, 404);
    pods.delete("p", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    assert_eq!(status_of(pods.get("p").await.unwrap_err()).0, 404);
}

#[tokio::test]
async fn patches() {
    let c = Cluster::start().await;
    let api = c.api::<Deployment>();
    api.create(&PostParams::default(), &deployment("d"))
        .await
        .unwrap();
    let pp = PatchParams::default();

    // JSON patch: a `test` of null on a missing path passes (kube-runtime's finalizer() needs it),
    // and fails once the path exists.
    let add_finalizer: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]}
    ]))
    .unwrap();
    let d = api
        .patch("d", &pp, &Patch::Json::<()>(add_finalizer.clone()))
        .await
        .unwrap();
    assert_eq!(d.finalizers(), ["x/y".to_string()]);
    let (code, _, _) = status_of(
        api.patch("d", &pp, &Patch::Json::<()>(add_finalizer))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 422);

    // Merge patch: null deletes.
    let d = api
        .patch(
            "d",
            &pp,
            &Patch::Merge(json!({"metadata": {"finalizers": null, "labels": {"a": "1"}}})),
        )
        .await
        .unwrap();
    assert!(d.finalizers().is_empty());
    assert_eq!(d.labels().get("a").map(String::as_str), Some("1"));

    // Strategic merge: containers merge by name, env by name, directives honoured.
    let d = api
        .patch(
            "d",
            &pp,
            &Patch::Strategic(json!({"spec": {
            "strategy": {"$retainKeys": ["type"], "type": "Recreate"},
            "template": {"spec": {
                "$setElementOrder/containers": [{"name": "side"}, {"name": "main"}],
                "containers": [
                    {"name": "main", "image": "img:2", "env": [{"name": "B", "value": "2"}]},
                    {"name": "side", "$patch": "delete"}
                ]}}}})),
        )
        .await
        .unwrap();
    let spec = d.spec;
    let containers = spec.template.spec.unwrap().containers;
    assert_eq!(containers.len(), 1);
    assert_eq!(containers[0].image.as_deref(), Some("img:2"));
    let env: Vec<String> = containers[0]
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(env, vec!["A", "B"]);
    assert_eq!(spec.strategy.unwrap().type_.as_deref(), Some("Recreate"));
    assert_eq!(d.metadata.generation, Some(2));
}

#[tokio::test]
async fn server_side_apply_owns_fields() {
    let c = Cluster::start().await;
    let api = c.api::<ConfigMap>();
    let alice = PatchParams::apply("alice");
    let obj = |data: Value, labels: Value| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "cfg", "labels": labels}, "data": data})
    };
    let created = api
        .patch(
            "cfg",
            &alice,
            &Patch::Apply(obj(
                json!({"a": "1", "b": "1"}),
                json!({"x": "1", "y": "1"}),
            )),
        )
        .await
        .unwrap();
    let managers: Vec<String> = created
        .metadata
        .managed_fields
        .unwrap()
        .into_iter()
        .map(|m| format!("{}/{}", m.manager.unwrap(), m.operation.unwrap()))
        .collect();
    assert_eq!(managers, vec!["alice/Apply"]);

    // bob agreeing on a value shares it; changing it conflicts.
    let bob = PatchParams::apply("bob");
    api.patch(
        "cfg",
        &bob,
        &Patch::Apply(obj(json!({"a": "1"}), json!({}))),
    )
    .await
    .unwrap();
    let err = api
        .patch(
            "cfg",
            &bob,
            &Patch::Apply(obj(json!({"a": "1", "b": "2"}), json!({}))),
        )
        .await
        .unwrap_err();
    let (code, reason, message) = status_of(err);
    assert_eq!((code, reason.as_str()), (409, "Conflict"));
    assert!(
        message.contains("conflict with \"alice\"") && message.contains(".data.b"),
        "{message}"
    );
    let forced = api
        .patch(
            "cfg",
            &bob.clone().force(),
            &Patch::Apply(obj(json!({"a": "1", "b": "2"}), json!({}))),
        )
        .await
        .unwrap();
    assert_eq!(forced.data.unwrap()["b"], "2");

    // alice stops sending label y and data.a: y goes; a stays because bob still applies it.
    let after = api
        .patch(
            "cfg",
            &alice,
            &Patch::Apply(obj(json!({}), json!({"x": "1"}))),
        )
        .await
        .unwrap();
    assert_eq!(after.labels().len(), 1);
    let data = after.data.unwrap();
    assert_eq!(data.get("a").map(String::as_str), Some("1"));
    assert_eq!(data.get("b").map(String::as_str), Some("2"));

    // A plain update takes ownership without conflicts.
    let updated = api
        .patch(
            "cfg",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"a": "9"}})),
        )
        .await
        .unwrap();
    assert!(
        updated
            .metadata
            .managed_fields
            .unwrap()
            .iter()
            .any(|m| m.operation.as_deref() == Some("Update"))
    );
    let err = api
        .patch(
            "cfg",
            &bob,
            &Patch::Apply(obj(json!({"a": "1", "b": "2"}), json!({}))),
        )
        .await
        .unwrap_err();
    assert_eq!(status_of(err).0, 409);
    let (code, _, _) = status_of(
        api.patch(
            "cfg",
            &PatchParams::default(),
            &Patch::Apply(obj(json!({}), json!({}))),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(code, 400, "apply needs a field manager");
}

#[tokio::test]
async fn deletion_preconditions_and_finalizers() {
    let c = Cluster::start().await;
    let api = c.api::<ConfigMap>();
    let mut obj = cm("f", json!({}));
    obj.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let created = api.create(&PostParams::default(), &obj).await.unwrap();

    let wrong = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("not-the-uid".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    assert_eq!(status_of(api.delete("f", &wrong).await.unwrap_err()).0, 409);

    api.delete("f", &DeleteParams::default()).await.unwrap();
    let deleting = api.get("f").await.unwrap();
    assert!(deleting.metadata.deletion_timestamp.is_some());
    assert_eq!(deleting.uid(), created.uid());

    let (code, reason, message) = status_of(
        api.patch(
            "f",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"finalizers": ["example.com/hold", "example.com/new"]}}),
            ),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (422, "Invalid"));
    assert!(message.contains("no new finalizers"), "{message}");

    api.patch(
        "f",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert_eq!(status_of(api.get("f").await.unwrap_err()).0, 404);
}

#[tokio::test]
async fn namespace_deletion_cascades() {
    let c = Cluster::start().await;
    let namespaces = Api::<Namespace>::all(c.client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "doomed"}})).unwrap();
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let cms = Api::<ConfigMap>::namespaced(c.client.clone(), "doomed");
    cms.create(&PostParams::default(), &cm("one", json!({})))
        .await
        .unwrap();
    namespaces
        .delete("doomed", &DeleteParams::default())
        .await
        .unwrap();
    let (code, _, _) = status_of(
        cms.create(&PostParams::default(), &cm("two", json!({})))
            .await
            .unwrap_err(),
    );
    assert!(
        code == 403 || code == 404,
        "creating in a terminating namespace: {code}"
    );
    eventually(60, "the namespace to go", || {
        let namespaces = namespaces.clone();
        async move {
            namespaces
                .get_opt("doomed")
                .await
                .unwrap()
                .is_none()
                .then_some(())
        }
    })
    .await;
    assert!(
        cms.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

async fn raw(c: &Cluster, path: &str, accept: &str) -> (Value, String) {
    let req = Request::get(path)
        .header("accept", accept)
        .body(Vec::new())
        .unwrap();
    let resp = c
        .client
        .send(req.map(kube::client::Body::from))
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{path}: {}", resp.status());
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    (serde_json::from_slice(&body).unwrap(), ct)
}

#[tokio::test]
async fn tables_partial_metadata_and_discovery() {
    let c = Cluster::start().await;
    c.api::<ConfigMap>()
        .create(&PostParams::default(), &cm("t", json!({})))
        .await
        .unwrap();
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "i"}]}}))
    .unwrap();
    c.api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let ns = &c.namespace;
    let table_accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json";
    let (t, ct) = raw(&c, &format!("/api/v1/namespaces/{ns}/pods"), table_accept).await;
    assert_eq!(t["kind"], "Table");
    assert!(ct.contains("as=Table"), "{ct}");
    let cols: Vec<&str> = t["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(&cols[..5], ["Name", "Ready", "Status", "Restarts", "Age"]);
    assert_eq!(t["rows"][0]["cells"][0], "p");
    assert_eq!(t["rows"][0]["cells"][1], "0/1");
    assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
    let (t, _) = raw(
        &c,
        &format!("/api/v1/namespaces/{ns}/configmaps"),
        table_accept,
    )
    .await;
    assert_eq!(t["columnDefinitions"][0]["name"], "Name");
    assert_eq!(t["rows"][0]["cells"][0], "t");

    let partial =
        "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json";
    let (l, _) = raw(&c, &format!("/api/v1/namespaces/{ns}/configmaps"), partial).await;
    assert_eq!(l["kind"], "PartialObjectMetadataList");
    assert_eq!(l["items"][0]["metadata"]["name"], "t");
    assert!(l["items"][0].get("data").is_none());

    let agg =
        "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json";
    let (d, ct) = raw(&c, "/apis", agg).await;
    assert_eq!(d["kind"], "APIGroupDiscoveryList");
    assert!(ct.contains("as=APIGroupDiscoveryList"), "{ct}");
    let (legacy, _) = raw(&c, "/apis", "application/json").await;
    assert_eq!(legacy["kind"], "APIGroupList");
    let (core, _) = raw(&c, "/api/v1", "application/json").await;
    assert!(
        core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "pods/status")
    );
    let (version, _) = raw(&c, "/version", "application/json").await;
    assert_eq!(version["major"], "1");
}

#[tokio::test]
async fn requests_need_the_token() {
    let c = Cluster::start().await;
    if !c.in_process() {
        return;
    }
    let kubeconfig = std::fs::read_to_string(&c.kubeconfig).unwrap();
    let token_line = kubeconfig
        .lines()
        .find(|l| l.trim_start().starts_with("token:"))
        .unwrap();
    let bad = kubeconfig.replace(token_line, "    token: wrong");
    let kc = kube::config::Kubeconfig::from_yaml(&bad).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(cfg).unwrap();
    let err = Api::<Namespace>::all(client)
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert_eq!(status_of(err).0, 401);
}

fn widget_crd() -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}},
                "additionalPrinterColumns": [
                    {"name": "Color", "type": "string", "jsonPath": ".spec.color"},
                    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"}],
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "properties": {
                        "color": {"type": "string", "default": "blue"},
                        "replicas": {"type": "integer", "default": 1},
                        "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}},
                    "status": {"type": "object", "properties": {"replicas": {"type": "integer"}, "phase": {"type": "string"}}}}}}}]}
    }))
    .unwrap()
}

async fn install_widgets(c: &Cluster) -> Api<DynamicObject> {
    let crds = Api::<CustomResourceDefinition>::all(c.client.clone());
    crds.create(&PostParams::default(), &widget_crd())
        .await
        .unwrap();
    eventually(30, "the CRD to be established", || {
        let crds = crds.clone();
        async move {
            let crd = crds.get("widgets.example.com").await.ok()?;
            let established = crd
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            established.then_some(())
        }
    })
    .await;
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("example.com", "v1", "Widget"),
        "widgets",
    );
    let api = Api::<DynamicObject>::namespaced_with(c.client.clone(), &c.namespace, &ar);
    eventually(30, "widgets to be served", || {
        let api = api.clone();
        async move { api.list(&ListParams::default()).await.ok().map(|_| ()) }
    })
    .await;
    api
}

#[tokio::test]
async fn custom_resources_are_pruned_defaulted_and_printed() {
    let c = Cluster::start().await;
    let widgets = install_widgets(&c).await;
    let w: DynamicObject =
        serde_json::from_value(json!({"apiVersion": "example.com/v1", "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {"bogus": 1, "extra": {"anything": {"goes": true}}},
        "status": {"replicas": 5}}))
        .unwrap();
    let created = widgets.create(&PostParams::default(), &w).await.unwrap();
    let spec = &created.data["spec"];
    assert!(
        spec.get("bogus").is_none(),
        "unknown fields are pruned: {spec}"
    );
    assert_eq!(spec["extra"]["anything"]["goes"], true);
    assert_eq!(spec["color"], "blue");
    assert_eq!(spec["replicas"], 1);
    assert!(
        created.data.get("status").is_none(),
        "status is dropped on create"
    );
    assert_eq!(created.metadata.generation, Some(1));

    let strict = PostParams::default();
    let mut strict_w = w.clone();
    strict_w.metadata.name = Some("strict".into());
    let path = format!(
        "/apis/example.com/v1/namespaces/{}/widgets?fieldValidation=Strict",
        c.namespace
    );
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&strict_w).unwrap())
        .unwrap();
    let (code, _, message) = status_of(c.client.request::<Value>(req).await.unwrap_err());
    assert_eq!(code, 400);
    assert!(
        message.contains("unknown field \"spec.bogus\""),
        "{message}"
    );
    let _ = strict;

    // Status subresource and scale subresource.
    let st = widgets
        .patch_status(
            "w",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"replicas": 2, "phase": "Ready"}, "spec": {"color": "red"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"]["replicas"], 2);
    assert_eq!(st.data["spec"]["color"], "blue");
    let scale = widgets.get_scale("w").await.unwrap();
    assert_eq!(scale.spec.unwrap().replicas, Some(1));
    assert_eq!(scale.status.unwrap().replicas, 2);
    widgets
        .patch_scale(
            "w",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 4}})),
        )
        .await
        .unwrap();
    let w = widgets.get("w").await.unwrap();
    assert_eq!(w.data["spec"]["replicas"], 4);
    assert_eq!(w.metadata.generation, Some(2));

    // Strategic merge patches are for built-ins only.
    let (code, reason, _) = status_of(
        widgets
            .patch(
                "w",
                &PatchParams::default(),
                &Patch::Strategic(json!({"spec": {"color": "x"}})),
            )
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (415, "UnsupportedMediaType"));

    let (t, _) = raw(
        &c,
        &format!("/apis/example.com/v1/namespaces/{}/widgets", c.namespace),
        "application/json;as=Table;v=v1;g=meta.k8s.io",
    )
    .await;
    let cols: Vec<&str> = t["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(cols, vec!["Name", "Color", "Replicas"]);
    assert_eq!(t["rows"][0]["cells"], json!(["w", "blue", 4]));

    // Deleting the CRD removes its objects and stops serving them.
    Api::<CustomResourceDefinition>::all(c.client.clone())
        .delete("widgets.example.com", &DeleteParams::default())
        .await
        .unwrap();
    eventually(60, "widgets to stop being served", || {
        let widgets = widgets.clone();
        async move {
            widgets
                .list(&ListParams::default())
                .await
                .is_err()
                .then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn garbage_collection_by_owner_references() {
    use k8s_openapi::api::core::v1::Secret;
    let c = Cluster::start().await;
    let owners = c.api::<ConfigMap>();
    let secrets = c.api::<Secret>();
    let owned = |name: &str, owner: &ConfigMap, block: bool, finalizer: bool| -> Secret {
        let mut s = json!({"metadata": {"name": name, "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": owner.name_any(),
            "uid": owner.uid().unwrap(), "blockOwnerDeletion": block}]}});
        if finalizer {
            s["metadata"]["finalizers"] = json!(["example.com/hold"]);
        }
        serde_json::from_value(s).unwrap()
    };
    let gone = |name: &'static str| {
        let secrets = secrets.clone();
        async move {
            eventually(30, name, || {
                let secrets = secrets.clone();
                async move { secrets.get_opt(name).await.unwrap().is_none().then_some(()) }
            })
            .await;
        }
    };

    // Background: the owner goes at once, then its dependents.
    let o1 = owners
        .create(&PostParams::default(), &cm("o1", json!({})))
        .await
        .unwrap();
    secrets
        .create(&PostParams::default(), &owned("d1", &o1, false, false))
        .await
        .unwrap();
    owners
        .delete("o1", &DeleteParams::background())
        .await
        .unwrap();
    gone("d1").await;

    // Foreground: the owner waits for its blocking dependents.
    let o2 = owners
        .create(&PostParams::default(), &cm("o2", json!({})))
        .await
        .unwrap();
    secrets
        .create(&PostParams::default(), &owned("d2", &o2, true, true))
        .await
        .unwrap();
    owners
        .delete("o2", &DeleteParams::foreground())
        .await
        .unwrap();
    let waiting = owners.get("o2").await.unwrap();
    assert!(waiting.metadata.deletion_timestamp.is_some());
    assert!(
        waiting
            .finalizers()
            .contains(&"foregroundDeletion".to_string())
    );
    eventually(30, "d2 to be marked for deletion", || {
        let secrets = secrets.clone();
        async move {
            secrets
                .get("d2")
                .await
                .unwrap()
                .metadata
                .deletion_timestamp
                .map(|_| ())
        }
    })
    .await;
    assert!(
        owners.get_opt("o2").await.unwrap().is_some(),
        "the owner waits for d2"
    );
    secrets
        .patch(
            "d2",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    gone("d2").await;
    eventually(30, "o2 to go after its dependent", || {
        let owners = owners.clone();
        async move { owners.get_opt("o2").await.unwrap().is_none().then_some(()) }
    })
    .await;

    // Orphan: dependents stay, without the owner reference.
    let o3 = owners
        .create(&PostParams::default(), &cm("o3", json!({})))
        .await
        .unwrap();
    secrets
        .create(&PostParams::default(), &owned("d3", &o3, false, false))
        .await
        .unwrap();
    owners.delete("o3", &DeleteParams::orphan()).await.unwrap();
    eventually(30, "o3 to go", || {
        let owners = owners.clone();
        async move { owners.get_opt("o3").await.unwrap().is_none().then_some(()) }
    })
    .await;
    let d3 = secrets.get("d3").await.unwrap();
    assert!(
        d3.owner_references().is_empty(),
        "{:?}",
        d3.owner_references()
    );

    // A dependent whose owner never existed (or is gone) is collected.
    let mut ghost = cm("ghost", json!({}));
    ghost.metadata.uid = Some("00000000-0000-0000-0000-000000000000".into());
    secrets
        .create(&PostParams::default(), &owned("d4", &ghost, false, false))
        .await
        .unwrap();
    gone("d4").await;
}
