//! `port-forward kind/name[/namespace] [tcp/]local[:remote]...`, as KubeVirt's
//! `pkg/virtctl/portforward`: one websocket to `.../portforward/{port}/tcp` per accepted local
//! connection, or a single one joined to stdin/stdout with `--stdio` (ssh's ProxyCommand).

use anyhow::{Context as _, bail};
use api::subresources::portforward_path;
use tokio::net::TcpListener;

use crate::client::Cluster;

#[derive(Debug, Clone, clap::Args)]
pub struct PortForwardArgs {
    /// kind/name[/namespace]; kind is vm or vmi
    pub target: String,
    /// [protocol/]localPort[:targetPort]...
    #[arg(required = true)]
    pub ports: Vec<String>,
    /// Forward the tunnel to stdin/stdout (one port only)
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub stdio: bool,
    /// The address the local ports are opened on
    #[arg(long, default_value = "127.0.0.1")]
    pub address: String,
}

/// The two kinds that can be forwarded to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Vm,
    Vmi,
}

impl Kind {
    /// The short name KubeVirt writes in ssh targets (`vmi.name.namespace`).
    pub fn short(self) -> &'static str {
        match self {
            Kind::Vm => "vm",
            Kind::Vmi => "vmi",
        }
    }

    fn resource(self) -> &'static str {
        match self {
            Kind::Vm => "virtualmachines",
            Kind::Vmi => "virtualmachineinstances",
        }
    }
}

/// A parsed `kind/name[/namespace]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub kind: Kind,
    pub name: String,
    pub namespace: Option<String>,
}

pub fn parse_target(target: &str) -> anyhow::Result<Target> {
    if target.is_empty() {
        bail!("target cannot be empty");
    }
    let parts: Vec<&str> = target.split('/').collect();
    let (kind, name, namespace) = match parts[..] {
        [_] => bail!("target must contain type and name separated by '/'"),
        [kind, name] => (kind, name, None),
        [kind, name, ns] => {
            if ns.is_empty() {
                bail!("namespace cannot be empty");
            }
            (kind, name, Some(ns.to_owned()))
        }
        _ => bail!("target is not valid with more than two '/'"),
    };
    let kind = match kind.to_ascii_lowercase().as_str() {
        "vm" | "vms" | "virtualmachine" | "virtualmachines" => Kind::Vm,
        "vmi" | "vmis" | "virtualmachineinstance" | "virtualmachineinstances" => Kind::Vmi,
        _ => bail!("unsupported resource type '{kind}'"),
    };
    if name.is_empty() {
        bail!("name cannot be empty");
    }
    Ok(Target {
        kind,
        name: name.to_owned(),
        namespace,
    })
}

/// A parsed `[protocol/]local[:remote]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardedPort {
    pub local: u16,
    pub remote: u16,
}

pub fn parse_port(arg: &str) -> anyhow::Result<ForwardedPort> {
    let (protocol, ports) = match arg.split_once('/') {
        Some((p, rest)) => (p.to_ascii_lowercase(), rest),
        None => ("tcp".to_owned(), arg),
    };
    match protocol.as_str() {
        "tcp" => {}
        "udp" => bail!("UDP port forwarding is not supported yet: {arg}"),
        other => bail!("unknown protocol: {other}"),
    }
    let mut numbers = ports.split(':').filter(|p| !p.is_empty());
    let number = |s: &str| {
        s.parse::<u16>()
            .with_context(|| format!("invalid port {s:?} in {arg:?}"))
    };
    let Some(local) = numbers.next() else {
        bail!("invalid port, missing local and/or remote port");
    };
    let local = number(local)?;
    let remote = match numbers.next() {
        Some(r) => number(r)?,
        None => local,
    };
    Ok(ForwardedPort { local, remote })
}

pub fn stream_path(namespace: &str, target: &Target, port: u16) -> String {
    portforward_path(namespace, target.kind.resource(), &target.name, port, "tcp")
}

pub async fn run(cluster: &Cluster, args: &PortForwardArgs) -> anyhow::Result<()> {
    let target = parse_target(&args.target)?;
    let ports = args
        .ports
        .iter()
        .map(|p| parse_port(p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let namespace = target
        .namespace
        .clone()
        .unwrap_or_else(|| cluster.namespace.clone());

    if args.stdio {
        let [port] = ports[..] else {
            bail!("only one port supported when forwarding to stdout");
        };
        let socket = cluster
            .websocket(&stream_path(&namespace, &target, port.remote))
            .await?;
        return crate::stream::splice(socket, tokio::io::stdin(), tokio::io::stdout()).await;
    }

    for port in ports {
        let listener = TcpListener::bind((args.address.as_str(), port.local))
            .await
            .with_context(|| format!("can't listen on {}:{}", args.address, port.local))?;
        eprintln!(
            "forwarding tcp {}:{} to {}",
            args.address, port.local, port.remote
        );
        let path = stream_path(&namespace, &target, port.remote);
        let cluster = cluster.clone();
        let label = format!("{}/{}.{namespace}", target.kind.short(), target.name);
        tokio::spawn(async move {
            loop {
                let (conn, _) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("error accepting connection: {e}");
                        return;
                    }
                };
                let cluster = cluster.clone();
                let path = path.clone();
                let label = label.clone();
                tokio::spawn(async move {
                    let socket = match cluster.websocket(&path).await {
                        Ok(s) => s,
                        Err(e) => {
                            eprintln!("can't access {label}: {e}");
                            return;
                        }
                    };
                    let (read, write) = conn.into_split();
                    if let Err(e) = crate::stream::splice(socket, read, write).await {
                        eprintln!("error handling connection for {}: {e:#}", port.local);
                    }
                });
            }
        });
    }
    tokio::signal::ctrl_c().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let ok = [
            ("vmi/demo", Kind::Vmi, "demo", None),
            ("VM/demo/team", Kind::Vm, "demo", Some("team")),
            ("virtualmachineinstances/a.b", Kind::Vmi, "a.b", None),
        ];
        for (input, kind, name, ns) in ok {
            let t = parse_target(input).unwrap();
            assert_eq!(
                (t.kind, t.name.as_str(), t.namespace.as_deref()),
                (kind, name, ns),
                "{input}"
            );
        }
        let bad = [
            ("", "target cannot be empty"),
            ("demo", "target must contain type and name separated by '/'"),
            ("vmi/demo/", "namespace cannot be empty"),
            ("vmi/a/b/c", "target is not valid with more than two '/'"),
            ("pod/demo", "unsupported resource type 'pod'"),
            ("vmi/", "name cannot be empty"),
        ];
        for (input, want) in bad {
            assert_eq!(
                parse_target(input).unwrap_err().to_string(),
                want,
                "{input}"
            );
        }
    }

    #[test]
    fn ports() {
        let ok = [
            ("22", 22, 22),
            ("8080:80", 8080, 80),
            ("tcp/2222:22", 2222, 22),
            ("TCP/5900", 5900, 5900),
        ];
        for (input, local, remote) in ok {
            assert_eq!(
                parse_port(input).unwrap(),
                ForwardedPort { local, remote },
                "{input}"
            );
        }
        for bad in ["", ":", "udp/53", "sctp/1", "x:1", "70000"] {
            assert!(parse_port(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn paths() {
        let t = parse_target("vm/demo").unwrap();
        assert_eq!(
            stream_path("ns", &t, 22),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachines/demo/portforward/22/tcp"
        );
    }
}
