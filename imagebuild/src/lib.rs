//! The project's OCI images, built from our binaries and this machine's Debian files with no
//! container engine (`build-images`, used by `hack/release.sh`, `hack/run.sh` and the e2e
//! tests). See `docs/images.md`.

pub mod files;
pub mod recipes;

use ociimage::Reference;

/// The name the source manifests give an image of ours (`manifests/install/`).
pub fn source_name(image: &str) -> String {
    format!("kubevirt-rs/{image}:latest")
}

#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}: {text:?} names an image of ours that was not built")]
pub struct PinError {
    pub file: String,
    pub line: usize,
    pub text: String,
}

/// `manifest` with each of our images (by its source name) replaced by `pinned`'s reference;
/// an image of ours left unpinned is an error, so a release never ships a floating tag.
pub fn pin(file: &str, manifest: &str, pinned: &[(&str, Reference)]) -> Result<String, PinError> {
    let mut out = manifest.to_owned();
    for (image, reference) in pinned {
        out = out.replace(&source_name(image), &reference.to_string());
    }
    if let Some((i, line)) = out.lines().enumerate().find(|(_, l)| {
        l.contains("kubevirt-rs/") && !l.contains("@sha256:") && !l.trim_start().starts_with('#')
    }) {
        return Err(PinError {
            file: file.into(),
            line: i + 1,
            text: line.trim().into(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_are_pinned_by_digest() {
        let d = ociimage::Digest::of(b"x");
        let pinned = Reference::parse("quay.io/k/virt-api:v1")
            .unwrap()
            .with_digest(&d);
        let out = pin(
            "m.yaml",
            "# kubevirt-rs/virt-api:latest is pinned\nimage: kubevirt-rs/virt-api:latest\n",
            &[("virt-api", pinned.clone())],
        )
        .unwrap();
        assert!(out.ends_with(&format!("image: {pinned}\n")), "{out}");
        assert!(pinned.to_string().starts_with("quay.io/k/virt-api@sha256:"));
        let err = pin(
            "m.yaml",
            "a: 1\nimage: kubevirt-rs/virt-handler:latest\n",
            &[("virt-api", pinned)],
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "m.yaml:2: \"image: kubevirt-rs/virt-handler:latest\" names an image of ours that was not built"
        );
    }
}
