//! Writes the CRDs of every `kubevirt.io/v1` kind to `manifests/crds/`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;

/// Generate `manifests/crds/*.yaml` from the Rust types.
#[derive(Debug, Parser)]
struct Args {
    /// Directory to write the CRDs to.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/crds"))]
    out_dir: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;
    for crd in api::crds::crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        for version in &crd.spec.versions {
            let schema = version
                .schema
                .as_ref()
                .and_then(|s| s.open_api_v3_schema.as_ref())
                .with_context(|| format!("{name}: no schema"))?;
            let problems = api::crds::structural_problems(schema);
            if !problems.is_empty() {
                bail!(
                    "{name} {}: schema is not structural:\n{}",
                    version.name,
                    problems.join("\n")
                );
            }
        }
        let path = args.out_dir.join(api::crds::file_name(&crd));
        std::fs::write(&path, api::crds::to_yaml(&crd)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
