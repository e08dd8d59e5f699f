//! The Node object a kubelet registers and keeps alive, built by pure functions.

use std::collections::BTreeMap;
use std::path::Path;

use api::quantity::format_binary_si;

use serde_json::{Value, json};

/// Facts about the node, for its object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    pub name: String,
    pub host_ip: String,
    pub pod_cidr: String,
    pub cpu: String,
    pub memory: String,
    pub pods: String,
    pub labels: BTreeMap<String, String>,
    pub extended_resources: BTreeMap<String, String>,
    /// Device plugins' resources: (capacity, allocatable); they override `extended_resources`.
    pub device_resources: BTreeMap<String, (usize, usize)>,
    /// Pre-allocated huge pages by resource (`hugepages-2Mi`), in bytes ([`hugepages`]).
    pub hugepages: BTreeMap<String, u64>,
    /// The port of the kubelet API on `host_ip` (`status.daemonEndpoints`), which
    /// kube-apiserver dials for logs, exec and port-forward.
    pub kubelet_port: u16,
}

/// The Node object to create.
pub fn node_object(f: &NodeFacts) -> Value {
    let mut labels = json!({
        "kubernetes.io/hostname": f.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": std::env::consts::ARCH.replace("x86_64", "amd64").replace("aarch64", "arm64"),
        "beta.kubernetes.io/os": "linux",
    });
    for (k, v) in &f.labels {
        labels[k] = json!(v);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": f.name, "labels": labels},
        "spec": {"podCIDR": f.pod_cidr, "podCIDRs": [f.pod_cidr]},
    })
}

/// The node's `status`, with heartbeat times `now`.
pub fn node_status(f: &NodeFacts, now: &str, ready_since: &str) -> Value {
    let mut resources = json!({
        "cpu": f.cpu, "memory": f.memory, "pods": f.pods, "ephemeral-storage": "100Gi",
    });
    for (k, v) in &f.extended_resources {
        resources[k] = json!(v);
    }
    for (k, bytes) in &f.hugepages {
        resources[k] = json!(format_binary_si(i128::from(*bytes)));
    }
    let mut allocatable = resources.clone();
    // As the kubelet: memory held as huge pages is not allocatable as memory.
    if let Ok(memory) = api::quantity::bytes(&f.memory) {
        let pages: u64 = f.hugepages.values().sum();
        allocatable["memory"] = json!(format_binary_si(i128::from(memory.saturating_sub(pages))));
    }
    for (k, (capacity, healthy)) in &f.device_resources {
        resources[k] = json!(capacity.to_string());
        allocatable[k] = json!(healthy.to_string());
    }
    let ok = |kind: &str, reason: &str, message: &str| {
        json!({"type": kind, "status": "False", "reason": reason, "message": message,
               "lastHeartbeatTime": now, "lastTransitionTime": ready_since})
    };
    json!({
        "capacity": resources,
        "allocatable": allocatable,
        "conditions": [
            ok("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ok("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ok("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            {"type": "Ready", "status": "True", "reason": "KubeletReady",
             "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
             "lastTransitionTime": ready_since},
        ],
        "addresses": [
            {"type": "InternalIP", "address": f.host_ip},
            {"type": "Hostname", "address": f.name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": f.kubelet_port}},
        "nodeInfo": {
            "architecture": std::env::consts::ARCH.replace("x86_64", "amd64"),
            "operatingSystem": "linux", "osImage": "localcluster", "kernelVersion": kernel_version(),
            "kubeletVersion": format!("{}-localcluster", crate::controlplane::upstream_version()), "kubeProxyVersion": "",
            "containerRuntimeVersion": "localcluster://process", "machineID": "", "systemUUID": "", "bootID": "",
        },
    })
}

/// The huge pages the host has reserved, as the kubelet reports them: a `hugepages-<size>`
/// resource for every page size under `dir` (`/sys/kernel/mm/hugepages`), of
/// `nr_hugepages` x size bytes (0 for a size with none reserved).
pub fn hugepages(dir: &Path) -> BTreeMap<String, u64> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let kib: u64 = name
                .to_str()?
                .strip_prefix("hugepages-")?
                .strip_suffix("kB")?
                .parse()
                .ok()?;
            let count: u64 = std::fs::read_to_string(e.path().join("nr_hugepages"))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            let size = kib * 1024;
            Some((
                format!("hugepages-{}", format_binary_si(i128::from(size))),
                count * size,
            ))
        })
        .collect()
}

fn kernel_version() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The machine's memory in `Ki`, from `/proc/meminfo`'s `MemTotal`.
pub fn parse_meminfo(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.split_whitespace().next())
        .map(|kib| format!("{kib}Ki"))
}

/// The address of the interface holding the default route, from `ip -j route get 1.1.1.1`-like
/// JSON, else loopback.
pub fn host_ip() -> String {
    let out = std::process::Command::new("ip")
        .args(["-j", "route", "get", "192.0.2.123"])
        .output();
    out.ok()
        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
        .and_then(|v| v[0]["prefsrc"].as_str().map(str::to_string))
        .unwrap_or_else(|| "127.0.0.1".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> NodeFacts {
        NodeFacts {
            name: "n1".into(),
            host_ip: "192.0.2.2".into(),
            pod_cidr: "10.244.1.0/24".into(),
            cpu: "2".into(),
            memory: "1000Ki".into(),
            pods: "110".into(),
            labels: BTreeMap::from([("zone".into(), "a".into())]),
            extended_resources: BTreeMap::from([("devices.kubevirt.io/kvm".into(), "1k".into())]),
            device_resources: BTreeMap::from([("example.com/gpu".into(), (3, 2))]),
            hugepages: BTreeMap::from([("hugepages-2Mi".into(), 400 * 1024)]),
            kubelet_port: 10250,
        }
    }

    #[test]
    fn object_and_status() {
        let o = node_object(&facts());
        assert_eq!(o["metadata"]["labels"]["kubernetes.io/hostname"], "n1");
        assert_eq!(o["metadata"]["labels"]["zone"], "a");
        assert_eq!(o["spec"]["podCIDR"], "10.244.1.0/24");
        let s = node_status(&facts(), "now", "then");
        assert_eq!(s["allocatable"]["devices.kubevirt.io/kvm"], "1k");
        assert_eq!(s["allocatable"]["cpu"], "2");
        assert_eq!(s["capacity"]["example.com/gpu"], "3");
        assert_eq!(s["allocatable"]["example.com/gpu"], "2");
        assert_eq!(s["capacity"]["hugepages-2Mi"], "400Ki");
        assert_eq!(s["allocatable"]["hugepages-2Mi"], "400Ki");
        assert_eq!(
            (&s["capacity"]["memory"], &s["allocatable"]["memory"]),
            (&json!("1000Ki"), &json!("600Ki"))
        );
        let ready = &s["conditions"][3];
        assert_eq!(ready["type"], "Ready");
        assert_eq!(ready["status"], "True");
        assert_eq!(ready["lastHeartbeatTime"], "now");
        assert_eq!(ready["lastTransitionTime"], "then");
        assert_eq!(s["addresses"][0]["address"], "192.0.2.2");
        assert_eq!(s["daemonEndpoints"]["kubeletEndpoint"]["Port"], 10250);
        assert_eq!(
            s["nodeInfo"]["kubeletVersion"],
            format!("{}-localcluster", crate::controlplane::upstream_version())
        );
    }

    #[test]
    fn hugepages_by_size_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        for (size, count) in [("2048kB", "256\n"), ("1048576kB", "0\n")] {
            let d = dir.path().join(format!("hugepages-{size}"));
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("nr_hugepages"), count).unwrap();
        }
        assert_eq!(
            hugepages(dir.path()),
            BTreeMap::from([
                ("hugepages-1Gi".to_owned(), 0),
                ("hugepages-2Mi".to_owned(), 256 << 21),
            ])
        );
        assert!(hugepages(&dir.path().join("absent")).is_empty());
    }

    #[test]
    fn meminfo() {
        assert_eq!(
            parse_meminfo("MemFree: 1 kB\nMemTotal:       24682416 kB\n").as_deref(),
            Some("24682416Ki")
        );
        assert_eq!(parse_meminfo("nothing"), None);
    }
}
