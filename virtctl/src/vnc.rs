//! `vnc NAME` and `vnc screenshot NAME`, as KubeVirt's `pkg/virtctl/vnc`: a local TCP port
//! spliced to the VMI's VNC websocket, for a viewer virtctl starts or (`--proxy-only`) for any
//! viewer the user points at the port virtctl prints.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use api::VirtualMachineInstance;
use api::status::VirtualMachineInstanceConditionType;
use api::subresources::{VmiSubresource, vmi_path};
use tokio::net::TcpListener;

use crate::client::Cluster;

/// How long a started viewer gets to connect.
const LISTEN_TIMEOUT: Duration = Duration::from_mins(1);

const REMOTE_VIEWER: &str = "remote-viewer";
const TIGER_VNC: &str = "vncviewer";

#[derive(Debug, Clone, clap::Args)]
pub struct VncArgs {
    /// The VMI to connect to
    pub name: String,
    /// The address the proxy listens on with --proxy-only (e.g. 0.0.0.0 for all interfaces)
    #[arg(long, default_value = "127.0.0.1")]
    pub address: String,
    /// Only run the proxy and print the port VNC viewers can connect to
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub proxy_only: bool,
    /// Keep an existing VNC session instead of dropping it
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub preserve_session: bool,
    /// The port to listen on (0: a random free port)
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// The viewer to start: tiger or remote-viewer (default: whichever is in $PATH)
    #[arg(long)]
    pub vnc_type: Option<String>,
    /// The viewer executable (with --vnc-type)
    #[arg(long)]
    pub vnc_path: Option<PathBuf>,
}

/// `--proxy-only` reports the port as JSON so that scripts can read it.
pub fn port_line(port: u16) -> String {
    serde_json::json!({ "port": port }).to_string()
}

pub fn vnc_path(namespace: &str, name: &str, preserve_session: bool) -> String {
    format!(
        "{}?preserveSession={preserve_session}",
        vmi_path(namespace, name, VmiSubresource::Vnc)
    )
}

/// The viewer to run and its arguments: the one asked for, else remote-viewer, else TigerVNC.
pub fn viewer(
    vnc_type: Option<&str>,
    vnc_path: Option<&Path>,
    port: u16,
    lookup: impl Fn(&str) -> Option<PathBuf>,
) -> anyhow::Result<(PathBuf, Vec<String>)> {
    let args = |kind: &str| match kind {
        "tiger" => Ok(vec![format!("127.0.0.1:{port}")]),
        "remote-viewer" => Ok(vec![format!("vnc://127.0.0.1:{port}")]),
        other => Err(anyhow::anyhow!("unsupported vnc-type for linux: {other}")),
    };
    let Some(kind) = vnc_type else {
        if let Some(path) = lookup(REMOTE_VIEWER) {
            return Ok((path, args("remote-viewer")?));
        }
        if let Some(path) = lookup(TIGER_VNC) {
            return Ok((path, args("tiger")?));
        }
        bail!("could not find {REMOTE_VIEWER} or {TIGER_VNC} binary in $PATH");
    };
    let args = args(kind)?;
    if let Some(path) = vnc_path {
        if !path.exists() {
            bail!("specified VNC path does not exist: {}", path.display());
        }
        return Ok((path.to_owned(), args));
    }
    let bin = if kind == "tiger" {
        TIGER_VNC
    } else {
        REMOTE_VIEWER
    };
    let path = lookup(bin).with_context(|| format!("could not find {bin} in $PATH"))?;
    Ok((path, args))
}

/// An executable named `bin` in `$PATH`.
pub fn find_in_path(bin: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(bin))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

pub async fn run(cluster: &Cluster, args: &VncArgs) -> anyhow::Result<()> {
    let name = &args.name;
    let socket = cluster
        .websocket(&vnc_path(&cluster.namespace, name, args.preserve_session))
        .await
        .map_err(|e| anyhow::anyhow!("can't access VMI {name}: {e}"))?;
    // Only a proxy the user asked for may listen beyond this machine.
    let address = if args.proxy_only {
        args.address.as_str()
    } else {
        "127.0.0.1"
    };
    let listener = TcpListener::bind((address, args.port))
        .await
        .with_context(|| format!("can't listen on {address}:{}", args.port))?;
    let port = listener.local_addr()?.port();

    let mut viewer_exit = None;
    if args.proxy_only {
        println!("{}", port_line(port));
    } else {
        let (bin, argv) = viewer(
            args.vnc_type.as_deref(),
            args.vnc_path.as_deref(),
            port,
            find_in_path,
        )?;
        let mut child = tokio::process::Command::new(&bin)
            .args(&argv)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("{} execution failed", bin.display()))?;
        viewer_exit = Some(async move { child.wait().await });
    }

    let session = async {
        let accept = listener.accept();
        let (conn, _) = if args.proxy_only {
            accept.await?
        } else {
            tokio::time::timeout(LISTEN_TIMEOUT, accept)
                .await
                .context("no VNC viewer connected in time")??
        };
        warn_if_paused(cluster, name).await;
        let (read, write) = conn.into_split();
        crate::stream::splice(socket, read, write).await
    };
    let viewer_done = async {
        match viewer_exit {
            Some(wait) => {
                wait.await?;
                Ok(())
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = session => r.context("error encountered"),
        r = viewer_done => r,
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}

/// A paused guest shows a frozen screen; KubeVirt says why rather than leave the user guessing.
async fn warn_if_paused(cluster: &Cluster, name: &str) {
    let vmis: kube::Api<VirtualMachineInstance> =
        kube::Api::namespaced(cluster.client.clone(), &cluster.namespace);
    if let Ok(vmi) = vmis.get(name).await
        && is_paused(&vmi)
    {
        eprintln!("\rWarning: {name} is paused. Console will be active after unpause.");
    }
}

fn is_paused(vmi: &VirtualMachineInstance) -> bool {
    vmi.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == VirtualMachineInstanceConditionType::Paused)
    })
}

/// `vnc screenshot NAME --file F`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScreenshotArgs {
    /// The VMI
    pub name: String,
    /// Where to store the PNG; - for stdout
    #[arg(short, long, required = true)]
    pub file: String,
    /// Move the cursor to wake up the screen in case of screensavers
    #[arg(short, long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub move_cursor: bool,
}

pub fn screenshot_path(namespace: &str, name: &str, move_cursor: bool) -> String {
    format!(
        "{}?moveCursor={move_cursor}",
        vmi_path(namespace, name, VmiSubresource::VncScreenshot)
    )
}

pub async fn screenshot(cluster: &Cluster, args: &ScreenshotArgs) -> anyhow::Result<()> {
    let name = &args.name;
    let png = cluster
        .get(&screenshot_path(&cluster.namespace, name, args.move_cursor))
        .await
        .map_err(|e| anyhow::anyhow!("Can't access VMI {name}: {e}"))?;
    if args.file == "-" {
        use std::io::Write as _;
        std::io::stdout()
            .write_all(&png)
            .context("failed to write image to stdout")?;
    } else {
        write_png(Path::new(&args.file), &png).context("Can't write image to a file")?;
    }
    Ok(())
}

fn write_png(path: &Path, png: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(path)?
        .write_all(png)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        assert_eq!(
            vnc_path("ns", "demo", false),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/demo/vnc?preserveSession=false"
        );
        assert_eq!(
            screenshot_path("ns", "demo", true),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/demo/vnc/screenshot?moveCursor=true"
        );
        assert_eq!(port_line(5901), r#"{"port":5901}"#);
    }

    #[test]
    fn viewer_choice() {
        let both = |b: &str| Some(PathBuf::from(format!("/usr/bin/{b}")));
        let tiger_only = |b: &str| (b == TIGER_VNC).then(|| PathBuf::from("/usr/bin/vncviewer"));
        let none = |_: &str| None;
        let (bin, args) = viewer(None, None, 5900, both).unwrap();
        assert_eq!(bin, PathBuf::from("/usr/bin/remote-viewer"));
        assert_eq!(args, vec!["vnc://127.0.0.1:5900"]);
        let (bin, args) = viewer(None, None, 5900, tiger_only).unwrap();
        assert_eq!(bin, PathBuf::from("/usr/bin/vncviewer"));
        assert_eq!(args, vec!["127.0.0.1:5900"]);
        let (bin, _) = viewer(Some("tiger"), None, 1, both).unwrap();
        assert_eq!(bin, PathBuf::from("/usr/bin/vncviewer"));
        assert!(viewer(None, None, 1, none).is_err());
        assert!(viewer(Some("chicken"), None, 1, both).is_err());
        assert!(
            viewer(
                Some("tiger"),
                Some(Path::new("/nonexistent/viewer")),
                1,
                both
            )
            .is_err()
        );
        let (bin, _) = viewer(Some("tiger"), Some(Path::new("/bin/sh")), 1, none).unwrap();
        assert_eq!(bin, PathBuf::from("/bin/sh"));
    }

    #[test]
    fn screenshot_file_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shot.png");
        write_png(&path, b"\x89PNG").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"\x89PNG");
    }
}
