//! `build-images`: writes the project's images into an OCI image layout, and optionally one OCI
//! archive per image and the release manifests (`kubevirt-operator.yaml`, `kubevirt-cr.yaml`)
//! with every image pinned by digest.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};

use imagebuild::recipes::{self, Inputs, Naming};
use ociimage::{Compression, Layout};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Set {
    /// virt-operator, virt-api, virt-controller, virt-handler, virt-launcher, container-disk.
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
    /// Writes the release manifests into this directory: `kubevirt-operator.yaml` with the
    /// operator's image and the component images' digests pinned, and `kubevirt-cr.yaml`.
    /// Needs the components set.
    #[arg(long)]
    release_manifests: Option<PathBuf>,
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
    if let Some(out) = &cli.release_manifests {
        write_release_manifests(out, &cli, &pinned)?;
        println!(
            "release manifests, images pinned by digest: {}",
            out.display()
        );
    }
    println!(
        "{} images in {} ({:.1} s)",
        specs.len(),
        cli.layout.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `kubevirt-operator.yaml` and `kubevirt-cr.yaml` for the images just built.
fn write_release_manifests(
    out: &Path,
    cli: &Cli,
    pinned: &[(String, ociimage::Reference)],
) -> anyhow::Result<()> {
    let digest_of = |name: &str| {
        pinned
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, r)| r.digest().map(str::to_owned))
            .with_context(|| {
                format!("the release manifests need the {name} image: build the components set")
            })
    };
    let mut digests = std::collections::BTreeMap::new();
    for c in operator::strategy::COMPONENTS {
        digests.insert(c.to_owned(), digest_of(c)?);
    }
    let release = operator::strategy::Release {
        registry: cli.registry.clone(),
        tag: cli.tag.clone(),
        digests,
    };
    let image = format!(
        "{}/{}@{}",
        cli.registry,
        operator::release::OPERATOR,
        digest_of(operator::release::OPERATOR)?
    );
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    for (file, text) in [
        (
            "kubevirt-operator.yaml",
            operator::release::to_yaml(&operator::release::operator_manifest(&release, &image)),
        ),
        (
            "kubevirt-cr.yaml",
            operator::release::to_yaml(&[operator::release::kubevirt_cr()]),
        ),
    ] {
        let path = out.join(file);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
