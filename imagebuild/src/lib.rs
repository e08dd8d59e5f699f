//! The project's OCI images, built from our binaries and this machine's Debian files with no
//! container engine (`build-images`, used by `hack/release.sh`, `hack/run.sh` and the e2e
//! tests). See `docs/images.md`.

pub mod files;
pub mod recipes;
