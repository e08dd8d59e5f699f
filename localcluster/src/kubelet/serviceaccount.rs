//! In-cluster configuration for pods, as the real kubelet gives it: the `KUBERNETES_SERVICE_*`
//! environment of the `kubernetes` service and, unless `automountServiceAccountToken` is false,
//! the service account directory with `token`, `ca.crt` and `namespace`, which client-go's and
//! kube-rs's in-cluster configuration read.
//!
//! The API server has a single identity and no authorization, so the token is the cluster's
//! bearer token rather than a per-service-account one (there is no TokenRequest API here).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, Pod, ServiceAccount};

use super::KubeletError;

/// Where every container finds its service account's credentials.
pub const MOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// How pods reach the API server.
#[derive(Clone)]
pub struct ApiAccess {
    /// An address of the API server reachable from pods' network namespaces and from the host
    /// (hostNetwork pods), named by its serving certificate.
    pub address: SocketAddr,
    /// The CA of the serving certificate (`ca.crt`).
    pub ca_pem: String,
    /// The bearer token pods authenticate with.
    pub token: String,
}

impl std::fmt::Debug for ApiAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiAccess")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

/// The `kubernetes` service's environment, as the kubelet gives every container (it does so
/// whatever `enableServiceLinks` says).
pub fn service_env(address: SocketAddr) -> Vec<(String, String)> {
    let (host, port) = (address.ip().to_string(), address.port());
    let url = format!("tcp://{address}");
    let tcp = format!("KUBERNETES_PORT_{port}_TCP");
    vec![
        ("KUBERNETES_SERVICE_HOST".into(), host.clone()),
        ("KUBERNETES_SERVICE_PORT".into(), port.to_string()),
        ("KUBERNETES_SERVICE_PORT_HTTPS".into(), port.to_string()),
        ("KUBERNETES_PORT".into(), url.clone()),
        (tcp.clone(), url),
        (format!("{tcp}_PROTO"), "tcp".into()),
        (format!("{tcp}_PORT"), port.to_string()),
        (format!("{tcp}_ADDR"), host),
    ]
}

/// The service account a pod runs as (`default` when unset).
pub fn account_name(pod: &Pod) -> String {
    let spec = pod.spec.as_ref();
    spec.and_then(|s| s.service_account_name.clone())
        .or_else(|| spec.and_then(|s| s.service_account.clone()))
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "default".into())
}

/// Whether the pod gets the credentials mounted: the pod's `automountServiceAccountToken`,
/// else its service account's, else yes. A missing service account does not stop the mount
/// (kube-apiserver would have refused the pod; nothing creates `default` accounts here).
pub fn automount(pod: &Pod, account: Option<&ServiceAccount>) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.automount_service_account_token)
        .or_else(|| account.and_then(|a| a.automount_service_account_token))
        .unwrap_or(true)
}

/// Whether `container` gets the mount: not when it mounts something at that path itself, as
/// the ServiceAccount admission plugin leaves such containers alone.
pub fn wants_mount(container: &Container) -> bool {
    !container
        .volume_mounts
        .iter()
        .flatten()
        .any(|m| Path::new(&m.mount_path) == Path::new(MOUNT_PATH))
}

/// Writes `token`, `ca.crt` and `namespace` into the pod's projected volume directory
/// (`<pod dir>/volumes/kubernetes.io~projected/kube-api-access`) and returns it.
pub fn write_files(
    pod_dir: &Path,
    access: &ApiAccess,
    namespace: &str,
) -> Result<PathBuf, KubeletError> {
    let dir = pod_dir.join("volumes/kubernetes.io~projected/kube-api-access");
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| KubeletError::Io { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    for (name, content) in [
        ("token", access.token.as_str()),
        ("ca.crt", access.ca_pem.as_str()),
        ("namespace", namespace),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, content).map_err(io(&path))?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: &serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    }

    #[test]
    fn service_env_names_the_address() {
        let env = service_env("192.0.2.2:6443".parse().unwrap());
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("KUBERNETES_SERVICE_HOST"), Some("192.0.2.2"));
        assert_eq!(get("KUBERNETES_SERVICE_PORT"), Some("6443"));
        assert_eq!(get("KUBERNETES_PORT"), Some("tcp://192.0.2.2:6443"));
        assert_eq!(get("KUBERNETES_PORT_6443_TCP_ADDR"), Some("192.0.2.2"));
    }

    #[test]
    fn automount_pod_then_account_then_yes() {
        let account = |v: Option<bool>| -> ServiceAccount {
            serde_json::from_value(json!({"metadata": {"name": "default"},
                "automountServiceAccountToken": v}))
            .unwrap()
        };
        let plain = pod(&json!({"containers": []}));
        assert!(automount(&plain, None));
        assert!(!automount(&plain, Some(&account(Some(false)))));
        assert!(automount(&plain, Some(&account(None))));
        let off = pod(&json!({"containers": [], "automountServiceAccountToken": false}));
        assert!(!automount(&off, None));
        let on = pod(&json!({"containers": [], "automountServiceAccountToken": true}));
        assert!(automount(&on, Some(&account(Some(false)))));
        assert_eq!(account_name(&plain), "default");
        let named = pod(&json!({"containers": [], "serviceAccountName": "kubevirt-handler"}));
        assert_eq!(account_name(&named), "kubevirt-handler");
    }

    #[test]
    fn a_container_mounting_the_path_itself_is_left_alone() {
        let c = |mounts: serde_json::Value| -> Container {
            serde_json::from_value(json!({"name": "c", "volumeMounts": mounts})).unwrap()
        };
        assert!(wants_mount(&c(json!([]))));
        assert!(wants_mount(&c(
            json!([{"name": "v", "mountPath": "/var/run"}])
        )));
        assert!(!wants_mount(&c(
            json!([{"name": "v", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount/"}])
        )));
    }
}
