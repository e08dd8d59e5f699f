//! `expose vm|vmi|vmirs NAME --name SERVICE`: a Service in front of a VM's pods, after
//! KubeVirt's `pkg/virtctl/expose`.
//!
//! The selector is KubeVirt's current one: a VM or VMI is selected by the launcher pod label
//! `vmi.kubevirt.io/id` (the VMI's name, hashed when longer than 63 characters, see
//! [`api::labels::vmi_id`]), a ReplicaSet by its own `matchLabels`. Without `--port` the ports of the
//! pod-network interface (`spec.domain.devices.interfaces[].ports`) are reused.

use std::collections::BTreeMap;

use anyhow::{Context as _, bail};
use api::vmi::VirtualMachineInstanceSpec;
use api::{VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceReplicaSet};
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Api;
use kube::api::PostParams;

use crate::client::Cluster;
use crate::error::RequestError;

/// The flags of `expose`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExposeArgs {
    /// vmi (virtualmachineinstance), vm (virtualmachine) or vmirs
    /// (virtualmachineinstancereplicaset); singular or plural, any case
    pub kind: String,
    /// The object to expose
    pub object: String,
    /// Name of the service created for the exposure of the VM.
    #[arg(long, required = true)]
    pub name: String,
    /// ClusterIP to be assigned to the service. Leave empty to auto-allocate, or set to 'None'
    /// to create a headless service.
    #[arg(long, default_value = "")]
    pub cluster_ip: String,
    /// Additional external IP address (not managed by the cluster) to accept for the service.
    #[arg(long, default_value = "")]
    pub external_ip: String,
    /// The port that the service should serve on (default: the VM's pod-network ports).
    #[arg(long, default_value_t = 0)]
    pub port: i32,
    /// The network protocol for the service to be created.
    #[arg(long, default_value = "TCP")]
    pub protocol: String,
    /// Name or number for the port on the VM that the service should direct traffic to.
    #[arg(long, default_value = "")]
    pub target_port: String,
    /// Type for this service: ClusterIP, NodePort, or LoadBalancer.
    #[arg(long = "type", default_value = "ClusterIP")]
    pub service_type: String,
    /// Name of the port.
    #[arg(long, default_value = "")]
    pub port_name: String,
    /// IP family over which the service will be exposed: IPv4, IPv6, IPv4,IPv6 or IPv6,IPv4
    #[arg(long, default_value = "")]
    pub ip_family: String,
    /// IP family policy: SingleStack, PreferDualStack or RequireDualStack
    #[arg(long, default_value = "")]
    pub ip_family_policy: String,
    /// Perform a dry run: validate without creating the service (kubevirt-rs only)
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub dry_run: bool,
}

/// The kinds `expose` takes, as KubeVirt spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Vmi,
    Vm,
    Vmirs,
}

pub fn parse_kind(kind: &str) -> anyhow::Result<Kind> {
    Ok(match kind.to_lowercase().as_str() {
        "vmi" | "vmis" | "virtualmachineinstance" | "virtualmachineinstances" => Kind::Vmi,
        "vm" | "vms" | "virtualmachine" | "virtualmachines" => Kind::Vm,
        "vmirs"
        | "vmirss"
        | "virtualmachineinstancereplicaset"
        | "virtualmachineinstancereplicasets" => Kind::Vmirs,
        _ => bail!("unsupported resource type: {kind}"),
    })
}

/// The object being exposed, as read from the API server.
#[derive(Debug, Clone)]
pub enum Target {
    Vmi(Box<VirtualMachineInstance>),
    Vm(Box<VirtualMachine>),
    Vmirs(Box<VirtualMachineInstanceReplicaSet>),
}

/// The service parameters, checked and converted from the flags.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServiceParams {
    pub name: String,
    pub namespace: String,
    pub port: i32,
    pub port_name: String,
    pub protocol: String,
    pub target_port: Option<IntOrString>,
    pub service_type: String,
    pub cluster_ip: String,
    pub external_ip: String,
    pub ip_families: Vec<String>,
    pub ip_family_policy: Option<String>,
}

/// KubeVirt's `parseFlags`: protocol, type, IP families and policy, case-insensitive.
pub fn params(args: &ExposeArgs, namespace: &str) -> anyhow::Result<ServiceParams> {
    let ip_families = convert_ip_family(&args.ip_family)?;
    let ip_family_policy = convert_ip_family_policy(&args.ip_family_policy, &ip_families)?;
    Ok(ServiceParams {
        name: args.name.clone(),
        namespace: namespace.to_owned(),
        port: args.port,
        port_name: args.port_name.clone(),
        protocol: convert_protocol(&args.protocol)?.to_owned(),
        target_port: parse_target_port(&args.target_port),
        service_type: convert_service_type(&args.service_type)?.to_owned(),
        cluster_ip: args.cluster_ip.clone(),
        external_ip: args.external_ip.clone(),
        ip_families,
        ip_family_policy,
    })
}

/// `intstr.Parse`: a number is a port number, anything else a port name. Empty means "the
/// same as `port`", which the API server fills in.
pub fn parse_target_port(s: &str) -> Option<IntOrString> {
    if s.is_empty() {
        return None;
    }
    Some(match s.parse::<i32>() {
        Ok(n) => IntOrString::Int(n),
        Err(_) => IntOrString::String(s.to_owned()),
    })
}

/// Picks the spelling among `known` that equals `s` ignoring case.
fn one_of(s: &str, known: &[&'static str]) -> Option<&'static str> {
    known.iter().copied().find(|k| k.eq_ignore_ascii_case(s))
}

pub fn convert_protocol(s: &str) -> anyhow::Result<&'static str> {
    one_of(s, &["TCP", "UDP"]).with_context(|| format!("unknown protocol: {s}"))
}

pub fn convert_service_type(s: &str) -> anyhow::Result<&'static str> {
    if s.eq_ignore_ascii_case("ExternalName") {
        bail!("type: {s} not supported");
    }
    one_of(s, &["ClusterIP", "NodePort", "LoadBalancer"])
        .with_context(|| format!("unknown service type: {s}"))
}

pub fn convert_ip_family(s: &str) -> anyhow::Result<Vec<String>> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    let families = one_of(s, &["IPv4", "IPv6", "IPv4,IPv6", "IPv6,IPv4"])
        .with_context(|| format!("unknown IPFamily/s: {s}"))?;
    Ok(families.split(',').map(str::to_owned).collect())
}

pub fn convert_ip_family_policy(s: &str, families: &[String]) -> anyhow::Result<Option<String>> {
    if s.is_empty() {
        return Ok((families.len() > 1).then(|| "PreferDualStack".to_owned()));
    }
    let policy = one_of(s, &["SingleStack", "PreferDualStack", "RequireDualStack"])
        .with_context(|| format!("unknown IPFamilyPolicy/s: {s}"))?;
    Ok(Some(policy.to_owned()))
}

/// KubeVirt's `podNetworkPorts`: the ports of the interface on the pod network, named
/// `port-1`, `port-2`, ...
pub fn pod_network_ports(spec: &VirtualMachineInstanceSpec) -> Vec<ServicePort> {
    let Some(network) = spec.networks.iter().find(|n| n.pod.is_some()) else {
        return Vec::new();
    };
    let Some(iface) = spec
        .domain
        .devices
        .interfaces
        .iter()
        .find(|i| i.name == network.name)
    else {
        return Vec::new();
    };
    iface
        .ports
        .iter()
        .enumerate()
        .map(|(i, p)| ServicePort {
            name: Some(format!("port-{}", i + 1)),
            protocol: p.protocol.clone().filter(|p| !p.is_empty()),
            port: p.port,
            ..ServicePort::default()
        })
        .collect()
}

/// The Service `expose` creates for `target`: its selector, ports and a controller owner
/// reference to the target (not blocking the owner's deletion).
pub fn service(target: &Target, p: &ServiceParams) -> anyhow::Result<Service> {
    let (selector, mut ports, owner) = match target {
        Target::Vmi(vmi) => {
            let name = vmi.metadata.name.clone().unwrap_or_default();
            (
                BTreeMap::from([(api::labels::VMI_ID.to_owned(), api::labels::vmi_id(&name))]),
                pod_network_ports(&vmi.spec),
                owner_reference(vmi.as_ref()),
            )
        }
        Target::Vm(vm) => {
            let name = vm.metadata.name.clone().unwrap_or_default();
            (
                BTreeMap::from([(api::labels::VMI_ID.to_owned(), api::labels::vmi_id(&name))]),
                vm.spec
                    .template
                    .spec
                    .as_ref()
                    .map(pod_network_ports)
                    .unwrap_or_default(),
                owner_reference(vm.as_ref()),
            )
        }
        Target::Vmirs(rs) => {
            let selector = &rs.spec.selector;
            let labels = selector.match_labels.clone().unwrap_or_default();
            if labels.is_empty() {
                bail!("cannot expose VirtualMachineInstanceReplicaSet without any selector labels");
            }
            if selector
                .match_expressions
                .as_ref()
                .is_some_and(|e| !e.is_empty())
            {
                bail!("cannot expose VirtualMachineInstanceReplicaSet with match expressions");
            }
            (
                labels,
                rs.spec
                    .template
                    .spec
                    .as_ref()
                    .map(pod_network_ports)
                    .unwrap_or_default(),
                owner_reference(rs.as_ref()),
            )
        }
    };
    if p.port != 0 {
        ports = vec![ServicePort {
            name: Some(p.port_name.clone()).filter(|n| !n.is_empty()),
            protocol: Some(p.protocol.clone()),
            port: p.port,
            target_port: p.target_port.clone(),
            ..ServicePort::default()
        }];
    }
    if ports.is_empty() {
        bail!("couldn't find port via --port flag or introspection");
    }
    Ok(Service {
        metadata: ObjectMeta {
            name: Some(p.name.clone()),
            namespace: Some(p.namespace.clone()),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(ports),
            selector: Some(selector),
            cluster_ip: Some(p.cluster_ip.clone()).filter(|s| !s.is_empty()),
            type_: Some(p.service_type.clone()),
            ip_families: Some(p.ip_families.clone()).filter(|f| !f.is_empty()),
            ip_family_policy: p.ip_family_policy.clone(),
            external_ips: Some(vec![p.external_ip.clone()]).filter(|_| !p.external_ip.is_empty()),
            ..ServiceSpec::default()
        }),
        status: None,
    })
}

/// `metav1.NewControllerRef` with `blockOwnerDeletion: false`, as KubeVirt sets it.
fn owner_reference<K: kube::Resource<DynamicType = ()>>(owner: &K) -> OwnerReference {
    OwnerReference {
        api_version: K::api_version(&()).into_owned(),
        kind: K::kind(&()).into_owned(),
        name: owner.meta().name.clone().unwrap_or_default(),
        uid: owner.meta().uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(false),
    }
}

/// KubeVirt's `CalculateVirtualMachineInstanceID`, the value of the launcher pod label
/// `vmi.kubevirt.io/id`: the VMI's name, or for a name longer than a DNS label (63) its first
/// 54 characters, `-` and the first 8 hex digits of its SHA-1. (The same function as the
async fn fetch(cluster: &Cluster, kind: Kind, name: &str) -> anyhow::Result<Target> {
    let client = cluster.client.clone();
    let ns = &cluster.namespace;
    let fail = |what: &str, e: kube::Error| {
        anyhow::anyhow!("error fetching {what}: {}", RequestError::from(e))
    };
    Ok(match kind {
        Kind::Vmi => Target::Vmi(Box::new(
            Api::namespaced(client, ns)
                .get(name)
                .await
                .map_err(|e| fail("VirtualMachineInstance", e))?,
        )),
        Kind::Vm => Target::Vm(Box::new(
            Api::namespaced(client, ns)
                .get(name)
                .await
                .map_err(|e| fail("VirtualMachine", e))?,
        )),
        Kind::Vmirs => Target::Vmirs(Box::new(
            Api::namespaced(client, ns)
                .get(name)
                .await
                .map_err(|e| fail("VirtualMachineInstanceReplicaSet", e))?,
        )),
    })
}

pub async fn run(cluster: &Cluster, args: &ExposeArgs) -> anyhow::Result<()> {
    let kind = parse_kind(&args.kind)?;
    let p = params(args, &cluster.namespace)?;
    let target = fetch(cluster, kind, &args.object).await?;
    let svc = service(&target, &p)?;
    let dry = !crate::vm::dry_run(args.dry_run).is_empty();
    let services: Api<Service> = Api::namespaced(cluster.client.clone(), &cluster.namespace);
    let params = PostParams {
        dry_run: dry,
        ..PostParams::default()
    };
    services
        .create(&params, &svc)
        .await
        .map_err(|e| anyhow::anyhow!("service creation failed: {}", RequestError::from(e)))?;
    println!(
        "Service {} successfully created for {} {}",
        args.name,
        args.kind.to_lowercase(),
        args.object
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    fn spec_with_ports(yaml: &str) -> VirtualMachineInstanceSpec {
        serde_saphyr::from_str(yaml).unwrap()
    }

    const PORTS: &str = r"
domain:
  devices:
    interfaces:
      - {name: sec, bridge: {}, ports: [{port: 9}]}
      - {name: default, masquerade: {}, ports: [{port: 22}, {port: 53, protocol: UDP}]}
networks:
  - {name: sec, multus: {networkName: x}}
  - {name: default, pod: {}}
";

    fn vm(name: &str, spec: Option<VirtualMachineInstanceSpec>) -> Target {
        let mut vm = VirtualMachine::new(name, api::VirtualMachineSpec::default());
        vm.metadata.uid = Some("vm-uid".into());
        vm.spec.template.spec = spec;
        Target::Vm(Box::new(vm))
    }

    fn vmi(name: &str, spec: VirtualMachineInstanceSpec) -> Target {
        let mut vmi = VirtualMachineInstance::new(name, spec);
        vmi.metadata.uid = Some("vmi-uid".into());
        Target::Vmi(Box::new(vmi))
    }

    fn vmirs(labels: &[(&str, &str)], exprs: bool) -> Target {
        let mut rs = VirtualMachineInstanceReplicaSet::new(
            "rs",
            api::VirtualMachineInstanceReplicaSetSpec::default(),
        );
        rs.metadata.uid = Some("rs-uid".into());
        rs.spec.selector = LabelSelector {
            match_labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            match_expressions: exprs.then(|| {
                vec![LabelSelectorRequirement {
                    key: "a".into(),
                    operator: "Exists".into(),
                    values: None,
                }]
            }),
        };
        rs.spec.template.spec = Some(spec_with_ports(PORTS));
        Target::Vmirs(Box::new(rs))
    }

    fn args(extra: &[&str]) -> ExposeArgs {
        #[derive(Debug, clap::Parser)]
        struct P {
            #[command(flatten)]
            a: ExposeArgs,
        }
        use clap::Parser as _;
        P::try_parse_from(
            ["expose", "vm", "demo", "--name", "svc"]
                .into_iter()
                .chain(extra.iter().copied()),
        )
        .unwrap()
        .a
    }

    fn port(name: Option<&str>, protocol: Option<&str>, port: i32) -> ServicePort {
        ServicePort {
            name: name.map(str::to_owned),
            protocol: protocol.map(str::to_owned),
            port,
            ..ServicePort::default()
        }
    }

    #[test]
    fn kinds_as_kubevirt_spells_them() {
        for (s, k) in [
            ("vm", Kind::Vm),
            ("VMs", Kind::Vm),
            ("VirtualMachine", Kind::Vm),
            ("vmi", Kind::Vmi),
            ("virtualmachineinstances", Kind::Vmi),
            ("vmirs", Kind::Vmirs),
            ("VirtualMachineInstanceReplicaSet", Kind::Vmirs),
        ] {
            assert_eq!(parse_kind(s).unwrap(), k, "{s}");
        }
        assert_eq!(
            parse_kind("pod").unwrap_err().to_string(),
            "unsupported resource type: pod"
        );
    }

    #[test]
    fn flag_conversions() {
        assert_eq!(convert_protocol("udp").unwrap(), "UDP");
        assert_eq!(
            convert_protocol("sctp").unwrap_err().to_string(),
            "unknown protocol: sctp"
        );
        assert_eq!(convert_service_type("nodeport").unwrap(), "NodePort");
        assert_eq!(
            convert_service_type("externalname")
                .unwrap_err()
                .to_string(),
            "type: externalname not supported"
        );
        assert_eq!(
            convert_service_type("x").unwrap_err().to_string(),
            "unknown service type: x"
        );
        assert_eq!(convert_ip_family("").unwrap(), Vec::<String>::new());
        assert_eq!(convert_ip_family("ipv6,ipv4").unwrap(), ["IPv6", "IPv4"]);
        assert!(convert_ip_family("IPv5").is_err());
        let dual = convert_ip_family("IPv4,IPv6").unwrap();
        assert_eq!(
            convert_ip_family_policy("", &dual).unwrap().as_deref(),
            Some("PreferDualStack")
        );
        assert_eq!(convert_ip_family_policy("", &[]).unwrap(), None);
        assert_eq!(
            convert_ip_family_policy("requiredualstack", &[])
                .unwrap()
                .as_deref(),
            Some("RequireDualStack")
        );
        assert_eq!(
            convert_ip_family_policy("x", &[]).unwrap_err().to_string(),
            "unknown IPFamilyPolicy/s: x"
        );
        assert_eq!(parse_target_port(""), None);
        assert_eq!(parse_target_port("8080"), Some(IntOrString::Int(8080)));
        assert_eq!(
            parse_target_port("http"),
            Some(IntOrString::String("http".into()))
        );
    }

    #[test]
    fn selectors_and_ports_per_kind() {
        type Want = Result<(BTreeMap<String, String>, Vec<ServicePort>), &'static str>;
        let long = "a".repeat(70);
        let cases: Vec<(&str, Target, &[&str], Want)> = vec![
            (
                "vm with --port",
                vm("demo", None),
                &[
                    "--port",
                    "22",
                    "--target-port",
                    "2222",
                    "--port-name",
                    "ssh",
                ],
                Ok((
                    BTreeMap::from([("vmi.kubevirt.io/id".into(), "demo".into())]),
                    vec![ServicePort {
                        target_port: Some(IntOrString::Int(2222)),
                        ..port(Some("ssh"), Some("TCP"), 22)
                    }],
                )),
            ),
            (
                "vm ports from the pod network",
                vm("demo", Some(spec_with_ports(PORTS))),
                &[],
                Ok((
                    BTreeMap::from([("vmi.kubevirt.io/id".into(), "demo".into())]),
                    vec![
                        port(Some("port-1"), None, 22),
                        port(Some("port-2"), Some("UDP"), 53),
                    ],
                )),
            ),
            (
                "vm without template or port",
                vm("demo", None),
                &[],
                Err("couldn't find port via --port flag or introspection"),
            ),
            (
                "vm without pod network",
                vm(
                    "demo",
                    Some(spec_with_ports(
                        "{domain: {devices: {interfaces: [{name: x, ports: [{port: 1}]}]}}}",
                    )),
                ),
                &[],
                Err("couldn't find port via --port flag or introspection"),
            ),
            (
                "vmi with a long name, --port wins over introspection",
                vmi(&long, spec_with_ports(PORTS)),
                &["--port", "80", "--protocol", "udp"],
                Ok((
                    BTreeMap::from([("vmi.kubevirt.io/id".into(), api::labels::vmi_id(&long))]),
                    vec![port(None, Some("UDP"), 80)],
                )),
            ),
            (
                "vmirs uses its matchLabels",
                vmirs(&[("app", "web")], false),
                &[],
                Ok((
                    BTreeMap::from([("app".into(), "web".into())]),
                    vec![
                        port(Some("port-1"), None, 22),
                        port(Some("port-2"), Some("UDP"), 53),
                    ],
                )),
            ),
            (
                "vmirs without labels",
                vmirs(&[], false),
                &[],
                Err("cannot expose VirtualMachineInstanceReplicaSet without any selector labels"),
            ),
            (
                "vmirs with expressions",
                vmirs(&[("app", "web")], true),
                &[],
                Err("cannot expose VirtualMachineInstanceReplicaSet with match expressions"),
            ),
        ];
        for (what, target, extra, want) in cases {
            let p = params(&args(extra), "ns").unwrap();
            let got = service(&target, &p).map(|s| {
                let spec = s.spec.unwrap();
                (spec.selector.unwrap(), spec.ports.unwrap())
            });
            match (got, want) {
                (Ok(g), Ok(w)) => assert_eq!(g, w, "{what}"),
                (Err(g), Err(w)) => assert_eq!(g.to_string(), w, "{what}"),
                (g, w) => panic!("{what}: got {g:?}, want {w:?}"),
            }
        }
    }

    #[test]
    fn service_metadata_and_spec() {
        let p = params(
            &args(&[
                "--port",
                "22",
                "--type",
                "loadbalancer",
                "--cluster-ip",
                "None",
                "--external-ip",
                "192.0.2.1",
                "--ip-family",
                "IPv4,IPv6",
            ]),
            "team",
        )
        .unwrap();
        let svc = service(&vm("demo", None), &p).unwrap();
        assert_eq!(svc.metadata.name.as_deref(), Some("svc"));
        assert_eq!(svc.metadata.namespace.as_deref(), Some("team"));
        assert_eq!(
            svc.metadata.owner_references.unwrap(),
            [OwnerReference {
                api_version: "kubevirt.io/v1".into(),
                kind: "VirtualMachine".into(),
                name: "demo".into(),
                uid: "vm-uid".into(),
                controller: Some(true),
                block_owner_deletion: Some(false),
            }]
        );
        let spec = svc.spec.unwrap();
        assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
        assert_eq!(spec.external_ips.unwrap(), ["192.0.2.1"]);
        assert_eq!(spec.ip_families.unwrap(), ["IPv4", "IPv6"]);
        assert_eq!(spec.ip_family_policy.as_deref(), Some("PreferDualStack"));

        // Defaults: nothing optional is set.
        let p = params(&args(&["--port", "22"]), "team").unwrap();
        let spec = service(&vmirs(&[("a", "b")], false), &p)
            .unwrap()
            .spec
            .unwrap();
        assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
        assert_eq!(
            (
                spec.cluster_ip,
                spec.external_ips,
                spec.ip_families,
                spec.ip_family_policy
            ),
            (None, None, None, None)
        );
        assert_eq!(
            service(&vmirs(&[("a", "b")], false), &p)
                .unwrap()
                .metadata
                .owner_references
                .unwrap()[0]
                .kind,
            "VirtualMachineInstanceReplicaSet"
        );
        assert_eq!(
            service(&vmi("v", VirtualMachineInstanceSpec::default()), &p)
                .unwrap()
                .metadata
                .owner_references
                .unwrap()[0]
                .kind,
            "VirtualMachineInstance"
        );
    }
}
