//! `ssh` and `scp`, as KubeVirt's native local client: run the system `ssh`/`scp` with a
//! ProxyCommand that is this virtctl's `port-forward --stdio=true`, so the connection goes
//! through the API server to the guest's port.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, bail};

use crate::client::{Cluster, KubeFlags};
use crate::portforward::{Target, parse_target};

#[derive(Debug, Clone, clap::Args)]
pub struct SshOptions {
    /// The port on the VM to send SSH traffic to
    #[arg(short, long, default_value_t = 22)]
    pub port: u16,
    /// The user to log in as (default: $USER, $USERNAME or $LOGNAME)
    #[arg(short = 'l', long)]
    pub username: Option<String>,
    /// A private key to authenticate with (default: ssh's own choice or the agent)
    #[arg(short = 'i', long)]
    pub identity_file: Option<PathBuf>,
    /// Additional options for the local ssh client (repeatable), e.g. "-o StrictHostKeyChecking=no"
    #[arg(short = 't', long = "local-ssh-opts", allow_hyphen_values = true)]
    pub local_ssh_opts: Vec<String>,
}

#[derive(Debug, Clone, clap::Args)]
pub struct SshArgs {
    /// [user@]kind/name[/namespace]
    pub target: String,
    /// A command to run in the VM instead of a shell
    #[arg(short, long)]
    pub command: Option<String>,
    #[command(flatten)]
    pub options: SshOptions,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ScpArgs {
    /// Source: a local path or [user@]kind/name[/namespace]:path
    pub source: String,
    /// Destination: a local path or [user@]kind/name[/namespace]:path
    pub destination: String,
    /// Recursively copy entire directories
    #[arg(short, long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub recursive: bool,
    /// Preserve modification times, access times, and modes
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub preserve: bool,
    #[command(flatten)]
    pub options: SshOptions,
}

/// A `[user@]kind/name[/namespace]`.
pub fn parse_user_target(arg: &str) -> anyhow::Result<(Option<String>, Target)> {
    let (user, target) = match arg.split_once('@') {
        Some(("", _)) => bail!("expected username before '@'"),
        Some((user, target)) => (Some(user.to_owned()), target),
        None => (None, arg),
    };
    if target.is_empty() {
        bail!("expected target after '@'");
    }
    Ok((user, parse_target(target)?))
}

fn default_username() -> Option<String> {
    ["USER", "USERNAME", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
}

/// Quotes for the shell ssh runs the ProxyCommand with.
pub fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./=:@%+,".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// `ProxyCommand=<virtctl> [kubeconfig flags] port-forward --stdio=true kind/name/ns port`.
/// The connection flags this virtctl was given go along, so the proxy reaches the same cluster.
pub fn proxy_command(
    virtctl: &str,
    kube: &KubeFlags,
    target: &Target,
    namespace: &str,
    port: u16,
) -> String {
    let mut words = vec![virtctl.to_owned()];
    let flags = [
        (
            "--kubeconfig",
            kube.kubeconfig.as_ref().map(|p| p.display().to_string()),
        ),
        ("--context", kube.context.clone()),
        ("--cluster", kube.cluster.clone()),
        ("--user", kube.user.clone()),
    ];
    for (flag, value) in flags {
        if let Some(v) = value {
            words.push(format!("{flag}={v}"));
        }
    }
    words.push("port-forward".into());
    words.push("--stdio=true".into());
    words.push(format!(
        "{}/{}/{namespace}",
        target.kind.short(),
        target.name
    ));
    words.push(port.to_string());
    let quoted: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
    format!("ProxyCommand={}", quoted.join(" "))
}

/// `user@kind.name.namespace`: a host name ssh never resolves (the proxy carries the traffic)
/// but keys its known_hosts entry on.
pub fn host(user: Option<&str>, target: &Target, namespace: &str) -> String {
    let user = user.map(|u| format!("{u}@")).unwrap_or_default();
    format!("{user}{}.{}.{namespace}", target.kind.short(), target.name)
}

/// The arguments ssh/scp get before their own (target, paths, command).
fn common_args(
    kube: &KubeFlags,
    opts: &SshOptions,
    target: &Target,
    namespace: &str,
) -> anyhow::Result<Vec<OsString>> {
    let exe = std::env::current_exe().context("cannot find this virtctl's path")?;
    let mut args: Vec<OsString> = vec![
        "-o".into(),
        proxy_command(&exe.to_string_lossy(), kube, target, namespace, opts.port).into(),
    ];
    args.extend(opts.local_ssh_opts.iter().map(OsString::from));
    if let Some(key) = &opts.identity_file {
        args.push("-i".into());
        args.push(key.into());
    }
    Ok(args)
}

fn run_client(program: &str, args: Vec<OsString>) -> anyhow::Result<ExitCode> {
    let status = std::process::Command::new(program)
        .args(args)
        .status()
        .with_context(|| format!("cannot run {program}"))?;
    // ssh's own exit status is the remote command's: pass it on.
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => ExitCode::FAILURE,
    })
}

pub fn ssh(cluster: &Cluster, kube: &KubeFlags, args: &SshArgs) -> anyhow::Result<ExitCode> {
    let (user, target) = parse_user_target(&args.target)?;
    let namespace = target.namespace.as_deref().unwrap_or(&cluster.namespace);
    let user = user
        .or_else(|| args.options.username.clone())
        .or_else(default_username);
    let mut argv = common_args(kube, &args.options, &target, namespace)?;
    argv.push(host(user.as_deref(), &target, namespace).into());
    argv.extend(args.command.iter().map(OsString::from));
    run_client("ssh", argv)
}

/// The local and remote sides of an scp, and which way the copy goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copy {
    pub local: String,
    pub remote_target: String,
    pub remote_path: String,
    pub to_remote: bool,
}

pub fn parse_copy(source: &str, destination: &str) -> anyhow::Result<Copy> {
    match (source.contains(':'), destination.contains(':')) {
        (true, true) => bail!(
            "copying from a remote location to another remote location is not supported: {source:?} to {destination:?}"
        ),
        (false, false) => bail!(
            "none of the two provided locations seems to be a remote location: {source:?} to {destination:?}"
        ),
        _ => {}
    }
    let to_remote = destination.contains(':');
    let (remote, local) = if to_remote {
        (destination, source)
    } else {
        (source, destination)
    };
    let (target, path) = remote
        .split_once(':')
        .with_context(|| format!("invalid remote argument format: {remote:?}"))?;
    Ok(Copy {
        local: local.to_owned(),
        remote_target: target.to_owned(),
        remote_path: path.to_owned(),
        to_remote,
    })
}

pub fn scp(cluster: &Cluster, kube: &KubeFlags, args: &ScpArgs) -> anyhow::Result<ExitCode> {
    let copy = parse_copy(&args.source, &args.destination)?;
    let (user, target) = parse_user_target(&copy.remote_target)?;
    let namespace = target.namespace.as_deref().unwrap_or(&cluster.namespace);
    let user = user
        .or_else(|| args.options.username.clone())
        .or_else(default_username);
    let mut argv = common_args(kube, &args.options, &target, namespace)?;
    if args.recursive {
        argv.push("-r".into());
    }
    if args.preserve {
        argv.push("-p".into());
    }
    let remote = format!(
        "{}:{}",
        host(user.as_deref(), &target, namespace),
        copy.remote_path
    );
    if copy.to_remote {
        argv.extend([OsString::from(&copy.local), remote.into()]);
    } else {
        argv.extend([OsString::from(remote), (&copy.local).into()]);
    }
    run_client("scp", argv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::portforward::Kind;

    #[test]
    fn user_targets() {
        let (user, t) = parse_user_target("jdoe@vmi/demo/team").unwrap();
        assert_eq!(user.as_deref(), Some("jdoe"));
        assert_eq!((t.kind, t.name.as_str()), (Kind::Vmi, "demo"));
        assert_eq!(t.namespace.as_deref(), Some("team"));
        let (user, t) = parse_user_target("vm/demo").unwrap();
        assert_eq!((user, t.kind), (None, Kind::Vm));
        assert_eq!(
            parse_user_target("@vmi/demo").unwrap_err().to_string(),
            "expected username before '@'"
        );
        assert_eq!(
            parse_user_target("jdoe@").unwrap_err().to_string(),
            "expected target after '@'"
        );
    }

    #[test]
    fn proxy_and_host() {
        let t = parse_target("vmi/demo").unwrap();
        let none = KubeFlags::default();
        assert_eq!(
            proxy_command("/usr/bin/virtctl", &none, &t, "ns", 22),
            "ProxyCommand=/usr/bin/virtctl port-forward --stdio=true vmi/demo/ns 22"
        );
        let kube = KubeFlags {
            kubeconfig: Some("/tmp/my config".into()),
            context: Some("kind".into()),
            ..KubeFlags::default()
        };
        assert_eq!(
            proxy_command("/bin/virtctl", &kube, &t, "ns", 2222),
            "ProxyCommand=/bin/virtctl '--kubeconfig=/tmp/my config' --context=kind port-forward --stdio=true vmi/demo/ns 2222"
        );
        assert_eq!(host(Some("root"), &t, "ns"), "root@vmi.demo.ns");
        assert_eq!(host(None, &t, "ns"), "vmi.demo.ns");
    }

    #[test]
    fn quoting() {
        for (input, want) in [
            ("plain", "plain"),
            ("a b", "'a b'"),
            ("it's", r"'it'\''s'"),
            ("", "''"),
        ] {
            assert_eq!(shell_quote(input), want);
        }
    }

    #[test]
    fn copies() {
        let c = parse_copy("file.bin", "jdoe@vmi/demo:/tmp/").unwrap();
        assert_eq!(
            c,
            Copy {
                local: "file.bin".into(),
                remote_target: "jdoe@vmi/demo".into(),
                remote_path: "/tmp/".into(),
                to_remote: true,
            }
        );
        let c = parse_copy("vm/demo/ns:log.txt", "./out").unwrap();
        assert!(!c.to_remote);
        assert_eq!(
            (c.remote_target.as_str(), c.remote_path.as_str()),
            ("vm/demo/ns", "log.txt")
        );
        assert!(parse_copy("a", "b").is_err());
        assert!(parse_copy("vmi/a:x", "vmi/b:y").is_err());
    }
}
