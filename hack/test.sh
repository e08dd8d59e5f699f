#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine: installs what it needs, builds the test
# guest (cached by its inputs), checks formatting and lints, and runs every test, including the
# ones that boot real QEMU guests.
set -euo pipefail
cd "$(dirname "$0")/.."

hack/deps.sh
hack/guest/build.sh

# One build per run: incremental caches would double the target dir (4 GiB of 8 measured) and a
# CI machine has run out of disk on them.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== tests"
export KUBEVIRT_RS_GUEST_DIR="${KUBEVIRT_RS_GUEST_DIR:-$PWD/.cache/guest}"
cargo nextest run --workspace --locked --no-fail-fast "$@"
