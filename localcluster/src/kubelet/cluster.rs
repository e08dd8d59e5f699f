//! The nodes `localcluster up` starts: N process kubelets, each joining the control plane with
//! its own `system:node:<name>` credentials and serving the kubelet API.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use api::quantity::ParsedQuantity;

use super::network::PodCidr;
use super::{Kubelet, KubeletError, NodeConfig, Serving};
use crate::controlplane::{self, ControlPlane, ControlPlaneError};

/// Node flags of `localcluster up`.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeArgs {
    /// How many simulated nodes to run (0: the API server alone).
    #[arg(long = "nodes", default_value_t = 1)]
    pub nodes: u8,
    /// Where each node gets its root directory (`<root>/<node>/var/lib/kubelet`, ...);
    /// default `<dir>/nodes`.
    #[arg(long = "root")]
    pub root: Option<PathBuf>,
    /// OCI archives or image layouts to load into the nodes' image store (`<dir>/images`)
    /// before they start; `localcluster load` adds images to a running cluster.
    #[arg(long = "image")]
    pub images: Vec<PathBuf>,
    /// Extended resources every node offers, `name=quantity` (stand-ins for device plugins).
    #[arg(long = "extended-resource", value_parser = parse_resource, default_values = [
        "devices.kubevirt.io/kvm=1k", "devices.kubevirt.io/tun=1k", "devices.kubevirt.io/vhost-net=1k",
    ])]
    pub extended_resources: Vec<(String, String)>,
}

fn parse_resource(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not name=quantity"))?;
    if ParsedQuantity::parse(v).is_err() {
        return Err(format!("{v:?} is not a quantity"));
    }
    Ok((k.to_string(), v.to_string()))
}

/// Errors of starting the nodes.
#[derive(Debug, thiserror::Error)]
pub enum NodesError {
    #[error("localcluster needs iproute2's `ip` for pod networks")]
    NoIp(#[source] std::io::Error),
    #[error(
        "the process kubelet needs root (pod network namespaces, mounts, cgroups): run localcluster as root, or with `--nodes 0` for the API server alone"
    )]
    NotRoot,
    #[error("the image store")]
    Images(#[from] ociimage::StoreError),
    #[error("node {node}")]
    Node { node: String, source: KubeletError },
    #[error("the machine's address {0:?} is not an IP address")]
    Address(String),
    #[error("no node {name} (nodes: {nodes})")]
    NoSuchNode { name: String, nodes: String },
    #[error("node {node}: its credentials")]
    Credentials {
        node: String,
        source: ControlPlaneError,
    },
}

/// Running nodes.
#[derive(Debug)]
pub struct LocalNodes {
    kubelets: Vec<Kubelet>,
}

/// The kubelet API port of node `i` (1-based): the real kubelet's 10250 for the first, the
/// next ones above it, as the nodes share the machine's address.
fn kubelet_port(i: u8) -> u16 {
    10250 + u16::from(i) - 1
}

/// The image store of a cluster whose state is in `state_dir`.
pub fn image_store(state_dir: &Path) -> Result<ociimage::Store, NodesError> {
    Ok(ociimage::Store::open(&state_dir.join("images"))?)
}

/// Whether this process can run `args.nodes` nodes: root, and iproute2's `ip`. `up` asks
/// before it starts anything, so a refusal leaves nothing behind.
pub fn preflight(args: &NodeArgs) -> Result<(), NodesError> {
    if args.nodes == 0 {
        return Ok(());
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(NodesError::NotRoot);
    }
    std::process::Command::new("ip")
        .arg("-V")
        .output()
        .map_err(NodesError::NoIp)?;
    Ok(())
}

/// Pods of different nodes reach each other through the host's routes to each node bridge,
/// which takes IPv4 forwarding, as every real cluster's CNI (and kubeadm's preflight) requires.
/// Turned on, never off: other users of the host may rely on it as well.
fn enable_forwarding() {
    const KNOB: &str = "/proc/sys/net/ipv4/ip_forward";
    if std::fs::read_to_string(KNOB).is_ok_and(|v| v.trim() == "1") {
        return;
    }
    match std::fs::write(KNOB, "1") {
        Ok(()) => {
            tracing::info!(
                "net.ipv4.ip_forward set to 1: pods of different nodes reach each other"
            );
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot enable IPv4 forwarding: pods of different nodes will not reach each other");
        }
    }
}

impl LocalNodes {
    /// Starts `args.nodes` kubelets named `node-1`, `node-2`, ... with pod CIDRs
    /// `10.244.<i>.0/24`, joined to `plane`; `state_dir` holds their roots unless `--root`
    /// says otherwise.
    pub async fn start(
        plane: &ControlPlane,
        args: &NodeArgs,
        state_dir: &Path,
    ) -> Result<Self, NodesError> {
        let mut nodes = Self {
            kubelets: Vec::new(),
        };
        if args.nodes == 0 {
            return Ok(nodes);
        }
        preflight(args)?;
        if args.nodes > 1 {
            enable_forwarding();
        }
        let store = image_store(state_dir)?;
        for image in &args.images {
            for name in store.import(image)? {
                tracing::info!(%name, from = %image.display(), "image loaded");
            }
        }
        // No container runs from the store yet: what replaced images left behind can go.
        let freed = store.prune()?;
        tracing::info!(mib = freed / (1 << 20), "image store pruned");
        let store = std::sync::Arc::new(store);
        let root = args.root.clone().unwrap_or_else(|| state_dir.join("nodes"));
        for i in 1..=args.nodes {
            let name = format!("node-{i}");
            let cidr = PodCidr::parse(&format!("10.244.{i}.0/24")).expect("a valid CIDR");
            let mut config = NodeConfig::new(&name, &root, cidr, store.clone());
            config.extended_resources = args
                .extended_resources
                .iter()
                .cloned()
                .collect::<BTreeMap<_, _>>();
            let Ok(address) = config.host_ip.parse() else {
                nodes.stop().await;
                return Err(NodesError::Address(config.host_ip));
            };
            let started = async {
                let creds = plane.node_credentials(&name, address)?;
                let client = controlplane::client_for(&creds.kubeconfig).await?;
                config.serving = Some(Serving {
                    port: kubelet_port(i),
                    cert_pem: creds.serving.cert_pem,
                    key_pem: creds.serving.key_pem,
                    client_ca_pem: creds.ca_pem,
                });
                Ok::<_, ControlPlaneError>(client)
            }
            .await;
            let client = match started {
                Ok(c) => c,
                Err(source) => {
                    nodes.stop().await;
                    return Err(NodesError::Credentials { node: name, source });
                }
            };
            match Kubelet::start(client, config).await {
                Ok(k) => nodes.kubelets.push(k),
                Err(source) => {
                    nodes.stop().await;
                    return Err(NodesError::Node { node: name, source });
                }
            }
        }
        Ok(nodes)
    }

    /// The nodes' names and roots.
    pub fn nodes(&self) -> Vec<(String, PathBuf)> {
        self.kubelets
            .iter()
            .map(|k| (k.node_name().to_string(), k.config().root.clone()))
            .collect()
    }

    /// Restarts node `name`'s kubelet: its pods keep running and the new kubelet adopts them
    /// ([`Kubelet::restart`]). Returns once it has registered its Node again.
    pub async fn restart_kubelet(&mut self, name: &str) -> Result<(), NodesError> {
        let index = self
            .kubelets
            .iter()
            .position(|k| k.node_name() == name)
            .ok_or_else(|| NodesError::NoSuchNode {
                name: name.to_owned(),
                nodes: if self.kubelets.is_empty() {
                    "none".to_owned()
                } else {
                    self.kubelets
                        .iter()
                        .map(Kubelet::node_name)
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            })?;
        let restarted = self.kubelets.remove(index).restart().await;
        let kubelet = restarted.map_err(|source| NodesError::Node {
            node: name.to_owned(),
            source,
        })?;
        self.kubelets.insert(index, kubelet);
        Ok(())
    }

    /// Stops every kubelet (killing their pods and removing what they held).
    pub async fn stop(self) {
        for k in self.kubelets {
            k.stop().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        nodes: NodeArgs,
    }

    #[test]
    fn flags() {
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.nodes.nodes, 1);
        assert_eq!(cli.nodes.extended_resources.len(), 3);
        let cli = Cli::try_parse_from([
            "x",
            "--nodes",
            "3",
            "--extended-resource",
            "example.com/gpu=2",
        ])
        .unwrap();
        assert_eq!(cli.nodes.nodes, 3);
        assert_eq!(
            cli.nodes.extended_resources,
            vec![("example.com/gpu".to_string(), "2".to_string())]
        );
        let err = Cli::try_parse_from(["x", "--extended-resource", "gpu=lots"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a quantity"), "{err}");
    }
}
