//! `container-disk`: run by every containerDisk container (see the library docs).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use containerdisk::{Server, Stopped, socket_path, stop_signals};

/// Serves `<copy path>.sock` so that virt-handler can find this container's image.
#[derive(Debug, Parser)]
#[command(name = "container-disk", version)]
struct Args {
    /// Path of the socket without its `.sock` suffix, in the volume shared with the launcher.
    #[arg(long, required_unless_present = "no_op")]
    copy_path: Option<PathBuf>,
    /// Exit at once: the init container that pulls the image before the launcher starts.
    #[arg(long)]
    no_op: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.no_op {
        return Ok(());
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let copy_path = args.copy_path.expect("clap requires it without --no-op");
    let signals = stop_signals()?;
    let server = Server::bind(&socket_path(&copy_path)?)?;
    tracing::info!(socket = %server.path().display(), "serving");
    let stopped = server
        .serve(&signals)
        .with_context(|| format!("serving {}", server.path().display()))?;
    match stopped {
        Stopped::Signal(s) => tracing::info!(signal = %s, "stopping"),
        Stopped::SocketGone => tracing::info!("the socket file is gone; stopping"),
    }
    Ok(())
}
