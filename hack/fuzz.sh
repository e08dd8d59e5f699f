#!/usr/bin/env bash
# Runs the fuzz targets in fuzz/ (libFuzzer), each for FUZZ_SECONDS (default 60), FUZZ_JOBS
# (default: one per core) at a time, after checking the fuzz crate's formatting and building it
# with its lints. With target names as arguments, runs only those:
# `FUZZ_SECONDS=600 hack/fuzz.sh qmp_lines`. Prints each target's executions and fails if any
# target crashed, naming the input that crashed it (under fuzz/artifacts/). hack/test.sh (CI)
# runs it as it is; docs/fuzzing.md has the figures.
#
# Built with the stable toolchain and plain cargo, not cargo-fuzz: cargo-fuzz only adds the
# coverage flags below, and needs nightly and its own install (minutes CI does not have).
# Without a sanitizer: the code under test has no `unsafe`, so AddressSanitizer would only
# halve the executions; debug assertions and overflow checks stay on (the `fuzz` profile).
# The committed seed corpus in fuzz/corpus/<target> is only read: what libFuzzer adds goes to
# a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds="${FUZZ_SECONDS:-60}"
jobs="${FUZZ_JOBS:-$(nproc)}"
# Its own target dir, so a fuzz build never waits on (or evicts) the main workspace's.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
# An explicit --target keeps the flags off build scripts and proc macros, which run at build
# time and need no coverage.
triple=$(rustc -vV | sed -n 's/^host: //p')
bin_dir="$CARGO_TARGET_DIR/$triple/fuzz"
# What cargo-fuzz passes (`--sanitizer none`): libFuzzer's inline 8-bit counters, PC table and
# comparison tracing, and `cfg(fuzzing)`.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"

echo "== fuzz: cargo fmt --check, build with clippy -D warnings (fuzz/)"
cargo fmt --check
# clippy-driver compiles the fuzz crate itself (the workspace's only member) and lints it on
# the way: a separate `cargo clippy` would check every dependency once more (330 s cold).
# The crates under test are linted by the main workspace's clippy.
RUSTC_WORKSPACE_WRAPPER=clippy-driver CLIPPY_ARGS="-Dwarnings__CLIPPY_HACKERY__" \
  cargo build --locked --profile fuzz --target "$triple" --bins
echo "fuzz: build took ${SECONDS}s"

targets=("$@")
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(basename -s .rs fuzz_targets/*.rs)
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The VMI schema's field names, for the targets that read VMIs as JSON.
grep -oE '^ *[a-zA-Z][a-zA-Z0-9]*:' ../manifests/crds/virtualmachineinstances.kubevirt.io.yaml \
  | tr -d ' :' | sort -u | sed 's/.*/"\\"&\\""/' >"$work/vmi.dict"

run() {
  local target=$1 extra=()
  mkdir -p "$work/corpus/$target" "artifacts/$target"
  case "$target" in
    api_vmi | qemu_argv | launcher_api) extra+=("-dict=$work/vmi.dict") ;;
  esac
  local status=0
  "$bin_dir/$target" -max_total_time="$seconds" -timeout=30 -print_final_stats=1 \
    -artifact_prefix="artifacts/$target/" "${extra[@]}" "$work/corpus/$target" "corpus/$target" \
    >"$work/$target.log" 2>&1 || status=$?
  echo "$status" >"$work/$target.status"
}

runs_start=$SECONDS
for target in "${targets[@]}"; do
  [[ -x $bin_dir/$target ]] || { echo "fuzz: no target $target" >&2; exit 1; }
  while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
  run "$target" &
done
wait

failed=()
for target in "${targets[@]}"; do
  log="$work/$target.log"
  status=$(cat "$work/$target.status")
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if ((status == 0)); then
    echo "fuzz: $target: ${runs:-?} executions in ${seconds}s, no crash"
  else
    failed+=("$target")
    echo "fuzz: $target: CRASHED after ${runs:-?} executions (exit $status):" >&2
    grep -A 2 -E 'panicked at|ERROR: libFuzzer' "$log" | cut -c -2000 >&2 || tail -n 20 "$log" >&2
    grep -E 'Test unit written to' "$log" >&2 || true
  fi
done

echo "fuzz: ${#targets[@]} targets, $jobs at a time, in $((SECONDS - runs_start))s; the whole step in ${SECONDS}s"
if ((${#failed[@]})); then
  echo "fuzz: crashed: ${failed[*]}; reproduce with: $bin_dir/<target> <crash file>" >&2
  exit 1
fi
