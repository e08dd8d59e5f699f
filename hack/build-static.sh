#!/usr/bin/env bash
# Builds container-disk statically linked (glibc's static-pie), for the given cargo profile
# (default dev): it runs inside container-disk images, which carry a disk and no C library.
# The result is target/x86_64-unknown-linux-gnu/<profile dir>/container-disk, where build-images
# looks for it. Only this crate gets the flag: static glibc would break name lookups in the
# components that use the network.
set -euo pipefail
cd "$(dirname "$0")/.."
# RUSTFLAGS (hack/release.sh sets its path remapping there) is kept. With an explicit --target,
# cargo gives RUSTFLAGS to the target's code only, not to build scripts and proc macros.
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
  cargo build --locked -p containerdisk --bin container-disk --target x86_64-unknown-linux-gnu "$@"
