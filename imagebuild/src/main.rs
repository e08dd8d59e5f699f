//! `build-images`: writes the project's images into an OCI image layout, and optionally one OCI
//! archive per image and the install manifests pinned to the images' digests.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};

use imagebuild::recipes::{self, Inputs, Naming};
use ociimage::{Compression, Layout};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Set {
    /// virt-api, virt-controller, virt-handler, virt-launcher, container-disk.
    Components,
    /// test-guest-disk, test-guest-kernel, test-tools (needs --guest-dir).
    Tests,
}

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Builds kubevirt-rs's OCI images with no container engine"
)]
struct Cli {
    /// The built programs (a cargo profile directory, e.g. target/release).
    #[arg(long)]
    bin_dir: PathBuf,
    /// The statically linked container-disk; default:
    /// <bin-dir>/../x86_64-unknown-linux-gnu/<profile>/container-disk.
    #[arg(long)]
    container_disk: Option<PathBuf>,
    /// The test guest build (hack/guest/build.sh), for the test images.
    #[arg(long)]
    guest_dir: Option<PathBuf>,
    /// The OCI image layout to write the images into (created if missing).
    #[arg(long)]
    layout: PathBuf,
    /// Also write each image as an OCI archive `<DIR>/<name>.tar`.
    #[arg(long)]
    archives: Option<PathBuf>,
    /// Images are named <registry>/<name>:<tag>.
    #[arg(long, default_value = "kubevirt-rs")]
    registry: String,
    #[arg(long, default_value = "latest")]
    tag: String,
    /// Compress layers with gzip (for images that leave this machine); uncompressed layers
    /// build and unpack faster.
    #[arg(long)]
    gzip: bool,
    /// Which images to build.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["components", "tests"])]
    set: Vec<Set>,
    /// Writes each YAML file of this directory to --manifests-out with our images pinned by
    /// digest.
    #[arg(long, requires = "manifests_out")]
    pin_manifests: Option<PathBuf>,
    #[arg(long)]
    manifests_out: Option<PathBuf>,
}

fn default_container_disk(bin_dir: &Path) -> PathBuf {
    let profile = bin_dir.file_name().unwrap_or_default();
    bin_dir
        .parent()
        .unwrap_or(Path::new("."))
        .join("x86_64-unknown-linux-gnu")
        .join(profile)
        .join("container-disk")
}

fn mib(bytes: u64) -> f64 {
    f64::from(u32::try_from(bytes / 1024).unwrap_or(u32::MAX)) / 1024.0
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let started = Instant::now();
    let inputs = Inputs {
        container_disk: cli
            .container_disk
            .clone()
            .unwrap_or_else(|| default_container_disk(&cli.bin_dir)),
        bin_dir: cli.bin_dir.clone(),
        guest_dir: cli.guest_dir.clone(),
    };
    let naming = Naming {
        registry: cli.registry.clone(),
        tag: cli.tag.clone(),
    };
    let mut specs = Vec::new();
    if cli.set.contains(&Set::Components) {
        specs.extend(recipes::components(&inputs, &naming)?);
    }
    if cli.set.contains(&Set::Tests) {
        specs.extend(recipes::test_images(&inputs, &naming)?);
    }
    let layout = Layout::create(&cli.layout)
        .with_context(|| format!("creating the image layout {}", cli.layout.display()))?;
    let compression = if cli.gzip {
        Compression::Gzip
    } else {
        Compression::None
    };
    if let Some(dir) = &cli.archives {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut pinned = Vec::new();
    for spec in &specs {
        let short = spec
            .name
            .repository()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let t = Instant::now();
        let written = layout
            .write_image(spec, compression)
            .with_context(|| format!("writing image {}", spec.name))?;
        let mut archive_note = String::new();
        if let Some(dir) = &cli.archives {
            let path = dir.join(format!("{short}.tar"));
            layout
                .write_archive(std::slice::from_ref(&written.name), &path)
                .with_context(|| format!("writing {}", path.display()))?;
            archive_note = format!("  -> {}", path.display());
        }
        println!(
            "{:<48} {}  {:>3} layers  {:>7.1} MiB  {:>5.1} s{archive_note}",
            written.name.to_string(),
            written.manifest,
            spec.layers.len(),
            mib(written.size),
            t.elapsed().as_secs_f64(),
        );
        pinned.push((short, written.name.with_digest(&written.manifest)));
    }
    if let (Some(src), Some(out)) = (&cli.pin_manifests, &cli.manifests_out) {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        let pins: Vec<(&str, ociimage::Reference)> = pinned
            .iter()
            .map(|(s, r)| (s.as_str(), r.clone()))
            .collect();
        let mut files: Vec<_> = std::fs::read_dir(src)
            .with_context(|| format!("reading {}", src.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.sort();
        for file in files
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "yaml"))
        {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let pinned = imagebuild::pin(&file.display().to_string(), &text, &pins)?;
            let target = out.join(file.file_name().unwrap_or_default());
            std::fs::write(&target, pinned)
                .with_context(|| format!("writing {}", target.display()))?;
        }
        println!("manifests pinned by digest: {}", out.display());
    }
    println!(
        "{} images in {} ({:.1} s)",
        specs.len(),
        cli.layout.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
