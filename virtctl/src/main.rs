//! virtctl: KubeVirt's command line for VMs, speaking to virt-api's `subresources.kubevirt.io`
//! through the Kubernetes API server with the user's kubeconfig.

mod client;
mod console;
mod create;
mod error;
mod expose;
mod portforward;
mod ssh;
mod stream;
mod terminal;
mod version;
mod vm;
mod vmi;
mod vnc;
mod volume;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::client::{Cluster, KubeFlags};

#[derive(Debug, Parser)]
#[command(
    name = "virtctl",
    about = "virtctl controls virtual machine related operations on your kubernetes cluster."
)]
struct Cli {
    #[command(flatten)]
    kube: KubeFlags,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a virtual machine.
    Start {
        /// The VM
        name: String,
        /// Start the virtual machine in paused state
        #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
        paused: bool,
        /// Perform a dry run: validate without changing anything
        #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
        dry_run: bool,
    },
    /// Stop a virtual machine.
    Stop(ShutdownArgs),
    /// Restart a virtual machine.
    Restart(ShutdownArgs),
    /// Migrate a virtual machine.
    Migrate {
        /// The VM
        name: String,
        /// An additional node selector for this migration (key=value,key2=value2); it can only
        /// narrow the VM's own constraints
        #[arg(long = "addedNodeSelector", value_name = "KEY=VALUE,...")]
        added_node_selector: Vec<String>,
        /// Perform a dry run: validate without changing anything
        #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
        dry_run: bool,
    },
    /// Cancel migration of a virtual machine.
    MigrateCancel {
        /// The VM
        name: String,
        /// Perform a dry run: validate without changing anything
        #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
        dry_run: bool,
    },
    /// add a volume to a running VM
    Addvolume(volume::AddVolumeArgs),
    /// remove a volume from a running VM
    Removevolume(volume::RemoveVolumeArgs),
    /// Pause a virtual machine (vm|vmi NAME).
    Pause(PauseArgs),
    /// Unpause a virtual machine (vm|vmi NAME).
    Unpause(PauseArgs),
    /// Freeze the guest's filesystems through the guest agent.
    Freeze {
        /// The VMI
        name: String,
        /// Thaw the guest after this long if nobody unfreezes it first (30s, 5m, 1h)
        #[arg(long, default_value = "5m", value_parser = api::duration::parse_duration)]
        unfreeze_timeout: Duration,
    },
    /// Thaw the guest's filesystems.
    Unfreeze {
        /// The VMI
        name: String,
    },
    /// Soft reboot a virtual machine instance
    SoftReboot {
        /// The VMI
        name: String,
    },
    /// Return guest agent info about operating system.
    Guestosinfo {
        /// The VMI
        name: String,
    },
    /// Return full list of logged in users on the guest machine.
    Userlist {
        /// The VMI
        name: String,
    },
    /// Return full list of filesystems available on the guest machine.
    Fslist {
        /// The VMI
        name: String,
    },
    /// Connect to a console of a virtual machine instance.
    Console {
        /// The VMI
        name: String,
        /// The number of minutes to wait for the virtual machine instance to be ready
        #[arg(long, default_value_t = 5)]
        timeout: u64,
    },
    /// Open a vnc connection to a virtual machine instance.
    #[command(args_conflicts_with_subcommands = true)]
    Vnc {
        #[command(subcommand)]
        sub: Option<VncCommand>,
        #[command(flatten)]
        args: Option<vnc::VncArgs>,
    },
    /// Forward local ports to a virtualmachine or virtualmachineinstance.
    PortForward(portforward::PortForwardArgs),
    /// Open a SSH connection to a virtual machine instance.
    Ssh(ssh::SshArgs),
    /// SCP files from/to a virtual machine instance.
    Scp(ssh::ScpArgs),
    /// Expose a virtual machine instance, virtual machine, or virtual machine instance replica
    /// set as a new service.
    Expose(expose::ExposeArgs),
    /// Create a manifest for the specified Kind.
    Create {
        #[command(subcommand)]
        sub: CreateCommand,
    },
    /// Print the client and server version information.
    Version {
        /// Client version only (no server required)
        #[arg(short, long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
        client: bool,
    },
}

#[derive(Debug, Subcommand)]
enum CreateCommand {
    /// Create a VirtualMachine manifest.
    Vm(Box<create::CreateVmArgs>),
}

#[derive(Debug, Subcommand)]
enum VncCommand {
    /// Create a VNC screenshot of a virtual machine instance.
    Screenshot(vnc::ScreenshotArgs),
}

#[derive(Debug, clap::Args)]
struct ShutdownArgs {
    /// The VM
    name: String,
    /// Seconds given to the VMI to terminate gracefully; only with --force (KubeVirt supports 0)
    #[arg(long, allow_negative_numbers = true)]
    grace_period: Option<i64>,
    /// With --grace-period: remove the VMI's pod at once, bypassing graceful deletion
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    force: bool,
    /// Perform a dry run: validate without changing anything
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    dry_run: bool,
}

#[derive(Debug, clap::Args)]
struct PauseArgs {
    /// vm (virtualmachine) or vmi (virtualmachineinstance)
    kind: String,
    /// The VM or VMI
    name: String,
    /// Perform a dry run: validate without changing anything
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    dry_run: bool,
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // Commands that need no cluster come first.
    match &cli.command {
        Command::Version { client } => {
            version::run(&cli.kube, *client).await?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::Create {
            sub: CreateCommand::Vm(a),
        } => {
            create::run(a, cli.kube.namespace.as_deref())?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::Pause(a) | Command::Unpause(a) => {
            vmi::parse_kind(&a.kind)?;
        }
        Command::Expose(a) => {
            expose::parse_kind(&a.kind)?;
            expose::params(a, "")?;
        }
        _ => {}
    }
    let cluster = Cluster::connect(&cli.kube).await?;
    match cli.command {
        Command::Version { .. } | Command::Create { .. } => {}
        Command::Start {
            name,
            paused,
            dry_run,
        } => vm::start(&cluster, &name, paused, dry_run).await?,
        Command::Stop(a) => {
            vm::stop(&cluster, &a.name, a.grace_period, a.force, a.dry_run).await?;
        }
        Command::Restart(a) => {
            vm::restart(&cluster, &a.name, a.grace_period, a.force, a.dry_run).await?;
        }
        Command::Migrate {
            name,
            added_node_selector,
            dry_run,
        } => vm::migrate(&cluster, &name, &added_node_selector, dry_run).await?,
        Command::MigrateCancel { name, dry_run } => {
            vm::migrate_cancel(&cluster, &name, dry_run).await?;
        }
        Command::Addvolume(a) => volume::add(&cluster, &a).await?,
        Command::Removevolume(a) => volume::remove(&cluster, &a).await?,
        Command::Pause(a) => {
            vmi::pause(&cluster, vmi::parse_kind(&a.kind)?, &a.name, a.dry_run).await?;
        }
        Command::Unpause(a) => {
            vmi::unpause(&cluster, vmi::parse_kind(&a.kind)?, &a.name, a.dry_run).await?;
        }
        Command::Freeze {
            name,
            unfreeze_timeout,
        } => vmi::freeze(&cluster, &name, unfreeze_timeout).await?,
        Command::Unfreeze { name } => vmi::unfreeze(&cluster, &name).await?,
        Command::SoftReboot { name } => vmi::soft_reboot(&cluster, &name).await?,
        Command::Guestosinfo { name } => {
            vmi::guest_read(&cluster, vmi::GuestRead::OsInfo, &name).await?;
        }
        Command::Userlist { name } => {
            vmi::guest_read(&cluster, vmi::GuestRead::Users, &name).await?;
        }
        Command::Fslist { name } => {
            vmi::guest_read(&cluster, vmi::GuestRead::Filesystems, &name).await?;
        }
        Command::Console { name, timeout } => console::run(&cluster, &name, timeout).await?,
        Command::Vnc { sub, args } => match (sub, args) {
            (Some(VncCommand::Screenshot(s)), _) => vnc::screenshot(&cluster, &s).await?,
            (None, Some(a)) => vnc::run(&cluster, &a).await?,
            (None, None) => anyhow::bail!("vnc needs a VMI name, or the screenshot command"),
        },
        Command::PortForward(a) => portforward::run(&cluster, &a).await?,
        Command::Expose(a) => expose::run(&cluster, &a).await?,
        Command::Ssh(a) => return ssh::ssh(&cluster, &cli.kube, &a),
        Command::Scp(a) => return ssh::scp(&cluster, &cli.kube, &a),
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // KubeVirt's virtctl (cobra) exits 1 on a usage error, 0 for --help.
            return if e.use_stderr() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(cli));
    // A console's stdin reader may sit in a blocking read; it must not hold the exit.
    runtime.shutdown_background();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("virtctl").chain(args.iter().copied()))
    }

    #[test]
    fn definition_is_consistent() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
    }

    #[test]
    fn kubectl_flags_anywhere() {
        let cli = parse(&["-n", "team", "start", "demo", "--context", "kind"]).unwrap();
        assert_eq!(cli.kube.namespace.as_deref(), Some("team"));
        assert_eq!(cli.kube.context.as_deref(), Some("kind"));
        let cli = parse(&["stop", "demo", "--namespace=x", "--kubeconfig", "/k"]).unwrap();
        assert_eq!(cli.kube.namespace.as_deref(), Some("x"));
        assert_eq!(
            cli.kube.kubeconfig.as_deref(),
            Some(std::path::Path::new("/k"))
        );
    }

    #[test]
    fn go_style_booleans() {
        for (args, paused, dry) in [
            (&["start", "demo"][..], false, false),
            (&["start", "demo", "--paused"][..], true, false),
            (
                &["start", "demo", "--paused=true", "--dry-run=false"][..],
                true,
                false,
            ),
            (&["start", "--dry-run", "demo"][..], false, true),
        ] {
            let Command::Start {
                paused: p,
                dry_run: d,
                ..
            } = parse(args).unwrap().command
            else {
                panic!("not start: {args:?}");
            };
            assert_eq!((p, d), (paused, dry), "{args:?}");
        }
    }

    #[test]
    fn stop_flags() {
        let Command::Stop(a) = parse(&["stop", "demo", "--grace-period", "0", "--force"])
            .unwrap()
            .command
        else {
            panic!("not stop");
        };
        assert_eq!((a.grace_period, a.force), (Some(0), true));
        let Command::Stop(a) = parse(&["stop", "demo", "--grace-period=-1"])
            .unwrap()
            .command
        else {
            panic!("not stop");
        };
        assert_eq!(a.grace_period, Some(-1));
    }

    #[test]
    fn vnc_forms() {
        let Command::Vnc { sub, args } = parse(&["vnc", "demo", "--proxy-only", "--port", "5901"])
            .unwrap()
            .command
        else {
            panic!("not vnc");
        };
        assert!(sub.is_none());
        let a = args.unwrap();
        assert!(a.proxy_only);
        assert_eq!((a.name.as_str(), a.port), ("demo", 5901));

        let Command::Vnc { sub, .. } = parse(&["vnc", "screenshot", "demo", "-f", "out.png"])
            .unwrap()
            .command
        else {
            panic!("not vnc");
        };
        let Some(VncCommand::Screenshot(s)) = sub else {
            panic!("not screenshot");
        };
        assert_eq!((s.name.as_str(), s.file.as_str()), ("demo", "out.png"));
        assert!(parse(&["vnc", "screenshot", "demo"]).is_err());
    }

    #[test]
    fn freeze_timeout() {
        let Command::Freeze {
            unfreeze_timeout, ..
        } = parse(&["freeze", "demo"]).unwrap().command
        else {
            panic!("not freeze");
        };
        assert_eq!(unfreeze_timeout, Duration::from_mins(5));
        assert!(parse(&["freeze", "demo", "--unfreeze-timeout", "soon"]).is_err());
    }

    #[test]
    fn migrate_selector_flag() {
        let Command::Migrate {
            added_node_selector,
            ..
        } = parse(&["migrate", "demo", "--addedNodeSelector", "zone=a,rack=1"])
            .unwrap()
            .command
        else {
            panic!("not migrate");
        };
        assert_eq!(added_node_selector, vec!["zone=a,rack=1"]);
    }

    #[test]
    fn expose_flags() {
        let Command::Expose(a) = parse(&[
            "expose", "vmi", "demo", "--name", "ssh", "--port", "22", "--type", "NodePort",
        ])
        .unwrap()
        .command
        else {
            panic!("not expose");
        };
        assert_eq!(
            (a.kind.as_str(), a.object.as_str(), a.name.as_str(), a.port),
            ("vmi", "demo", "ssh", 22)
        );
        assert_eq!(
            (a.service_type.as_str(), a.protocol.as_str()),
            ("NodePort", "TCP")
        );
        // --name is required, as in KubeVirt.
        assert!(parse(&["expose", "vm", "demo", "--port", "22"]).is_err());
    }

    #[test]
    fn create_vm_user_is_the_cloud_init_user() {
        // KubeVirt's local --user shadows kubectl's global one on `create vm`.
        let Command::Create {
            sub: CreateCommand::Vm(a),
        } = parse(&["create", "vm", "--user", "fedora", "--ssh-key", "k1,k2"])
            .unwrap()
            .command
        else {
            panic!("not create vm");
        };
        assert_eq!(a.user.as_deref(), Some("fedora"));
        assert_eq!(a.ssh_key, ["k1", "k2"]);
        // Elsewhere --user stays the kubeconfig user.
        let cli = parse(&["start", "demo", "--user", "admin"]).unwrap();
        assert_eq!(cli.kube.user.as_deref(), Some("admin"));
        let cli = parse(&["-n", "team", "create", "vm"]).unwrap();
        assert_eq!(cli.kube.namespace.as_deref(), Some("team"));
    }

    #[test]
    fn usage_errors() {
        assert!(parse(&["start"]).is_err());
        assert!(parse(&["pause", "demo"]).is_err());
        assert!(parse(&["nonsense"]).is_err());
    }
}
