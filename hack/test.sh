#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine: installs what it needs, builds the test
# guest (cached by its inputs), checks formatting and lints, and runs every test, including the
# ones that boot real QEMU guests.
set -euo pipefail
cd "$(dirname "$0")/.."

hack/deps.sh
hack/guest/build.sh
# The upstream control plane every cluster test runs on, and a kubectl of the same release
# first on PATH (cached by the pinned versions; about 5 minutes cold on 2 cores).
LOCALCLUSTER_KUBE=$(localcluster/upstream/build.sh)
export LOCALCLUSTER_KUBE
export PATH="$(dirname "$LOCALCLUSTER_KUBE"):$PATH"

# One build per run: incremental caches would double the target dir (4 GiB of 8 measured) and a
# CI machine has run out of disk on them.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== gofmt, go vet (localcluster/upstream)"
unformatted=$(cd localcluster/upstream && gofmt -l .)
[[ -z $unformatted ]] || { echo "gofmt: $unformatted" >&2; exit 1; }
# The build's flags, so vet can reuse what build.sh compiled; it still analyses every
# dependency for facts (about 2 minutes on a cold cache, seconds after that).
(cd localcluster/upstream && CGO_ENABLED=0 go vet -trimpath ./...)
# clippy-driver compiles the workspace's crates for the tests and lints them on the way, with
# the lints of `cargo clippy --all-targets -- -D warnings`: a separate `cargo clippy` would check
# every dependency once more, minutes of a cold CI run. The tests below build with the same
# wrapper, so they reuse this build.
export RUSTC_WORKSPACE_WRAPPER=clippy-driver CLIPPY_ARGS="-Dwarnings__CLIPPY_HACKERY__"
echo "== cargo clippy (clippy-driver builds every target)"
cargo build --workspace --all-targets --locked
# Every fuzz target for a minute, two at a time, built cold (about 7 minutes: docs/fuzzing.md).
echo "== fuzz"
hack/fuzz.sh
echo "== static container-disk (it runs in container-disk images, which have no C library)"
hack/build-static.sh
echo "== tests"
export KUBEVIRT_RS_GUEST_DIR="${KUBEVIRT_RS_GUEST_DIR:-$PWD/.cache/guest}"
cargo nextest run --workspace --locked --no-fail-fast "$@"
