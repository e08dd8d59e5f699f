#!/usr/bin/env bash
# The release step: release builds of every component, their OCI images with gzip layers (one
# OCI archive each, loadable with skopeo, `ctr images import` and `kind load image-archive`), the
# release manifests with our images pinned by digest, and virtctl, all in _out/:
#   _out/images/<name>.tar   _out/oci/ (the same images as one OCI layout)
#   _out/manifests/kubevirt-operator.yaml, kubevirt-cr.yaml   _out/virtctl
# REGISTRY (default kubevirt-rs, i.e. docker.io/kubevirt-rs) and TAG (default v<workspace
# version>) name the images. Building twice from the same sources gives the same digests.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
registry=${REGISTRY:-kubevirt-rs}
tag=${TAG:-v$version}

hack/deps.sh
# Where the sources lie must not reach the binaries: rustc hashes paths into symbol names
# (`.llvm.<hash>` suffixes) and panic locations, so two checkouts in different directories
# built different binaries, and images of different digests, from the same commit.
export RUSTFLAGS="--remap-path-prefix=$PWD=/kubevirt-rs"
echo "== release build (profile dist: release without debug information): virt-operator, virt-api, virt-controller, virt-handler, virt-launcher, virtctl, build-images"
cargo build --profile dist --locked -p operator -p virtapi -p controller -p handler -p launcher -p virtctl -p imagebuild --bins
echo "== release build: container-disk, statically linked"
hack/build-static.sh --profile dist
built=$SECONDS

target=${CARGO_TARGET_DIR:-target}
rm -rf _out
mkdir -p _out
"$target/dist/build-images" --bin-dir "$target/dist" --set components --gzip \
  --registry "$registry" --tag "$tag" --layout _out/oci --archives _out/images \
  --release-manifests _out/manifests
cp "$target/dist/virtctl" _out/virtctl
echo "== _out/"
du -h _out/images/*.tar _out/virtctl
echo "release step: $((SECONDS - started)) s (builds $((built - started)) s, images $((SECONDS - built)) s)"
