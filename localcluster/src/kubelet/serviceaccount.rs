//! In-cluster configuration for pods, as the real kubelet gives it: the `KUBERNETES_SERVICE_*`
//! environment of the `kubernetes` Service. The credentials come as the `kube-api-access-*`
//! projected volume that kube-apiserver's ServiceAccount admission adds to every pod (unless
//! `automountServiceAccountToken` says no), with a token from the TokenRequest API
//! (`volumes.rs`).

use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::{Api, Client};

use super::KubeletError;

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

/// The `kubernetes` Service's cluster IP and port, as every container's environment names it;
/// `None` while it has none (kube-apiserver creates it at start).
pub async fn kubernetes_service(client: &Client) -> Result<Option<SocketAddr>, KubeletError> {
    let service = Api::<Service>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await
        .map_err(|source| KubeletError::Api {
            what: "service default/kubernetes".into(),
            source,
        })?;
    Ok(service.and_then(|s| {
        let spec = s.spec?;
        let ip: IpAddr = spec.cluster_ip?.parse().ok()?;
        let port = spec.ports?.first()?.port;
        Some(SocketAddr::new(ip, u16::try_from(port).ok()?))
    }))
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
    fn the_account_defaults_to_default() {
        assert_eq!(account_name(&pod(&json!({"containers": []}))), "default");
        let named = pod(&json!({"containers": [], "serviceAccountName": "kubevirt-handler"}));
        assert_eq!(account_name(&named), "kubevirt-handler");
    }
}
