//! Built-in controllers that run inside the API server process.

use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use crate::resources::GroupResource;
use crate::rules::{self, DeleteOptions};
use crate::server::AppState;
use crate::store::Outcome;

fn namespaces() -> GroupResource {
    GroupResource {
        group: String::new(),
        resource: "namespaces".into(),
    }
}

/// Namespace deletion: once a namespace is terminating, delete everything in it, then remove the
/// `kubernetes` finalizer so the namespace itself goes. Runs after every change, since content can
/// be held up by its own finalizers or by a kubelet.
pub async fn namespace_controller(state: Arc<AppState>) {
    let Ok((_, mut events)) = state.store.watch(&namespaces(), None, None) else {
        return;
    };
    reconcile_namespaces(&state);
    loop {
        match events.recv().await {
            Ok(_) | Err(RecvError::Lagged(_)) => reconcile_namespaces(&state),
            Err(RecvError::Closed) => return,
        }
    }
}

fn reconcile_namespaces(state: &AppState) {
    let (all, _) = state.store.list(&namespaces(), None);
    let terminating: Vec<String> = all
        .iter()
        .filter(|ns| ns["metadata"]["deletionTimestamp"].is_string())
        .filter_map(|ns| ns["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    if terminating.is_empty() {
        return;
    }
    let registry = state
        .registry
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    for ns in terminating {
        let contents: Vec<(GroupResource, String, Value)> = state.store.read(|objs| {
            objs.iter()
                .flat_map(|(gr, bucket)| {
                    bucket
                        .iter()
                        .filter(|((n, _), _)| *n == ns)
                        .map(|((_, name), v)| (gr.clone(), name.clone(), v.clone()))
                        .collect::<Vec<_>>()
                })
                .collect()
        });
        for (gr, name, obj) in &contents {
            if obj["metadata"]["deletionTimestamp"].is_string() {
                continue;
            }
            let Some(def) = registry.any_version(&gr.group, &gr.resource) else {
                continue;
            };
            let result = state.store.mutate(gr, &ns, name, |_, cur| match cur {
                Some(cur) => {
                    rules::prepare_delete(def, cur, &DeleteOptions::default(), &now, false)
                }
                None => Ok(Outcome::Unchanged(Value::Null)),
            });
            if let Err(e) = result {
                tracing::warn!(namespace = %ns, %name, error = %e, "deleting namespace content");
            }
        }
        if contents.is_empty() {
            let result = state.store.mutate(&namespaces(), "", &ns, |_, cur| {
                let Some(cur) = cur else {
                    return Ok(Outcome::Unchanged(Value::Null));
                };
                let mut done = cur.clone();
                done["spec"]["finalizers"] = json!([]);
                Ok(rules::finish_update(cur, done))
            });
            if let Err(e) = result {
                tracing::warn!(namespace = %ns, error = %e, "finalizing namespace");
            }
        }
    }
}
