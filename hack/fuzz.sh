#!/usr/bin/env bash
# Runs the fuzz targets in fuzz/ (cargo-fuzz, libFuzzer), each for FUZZ_SECONDS (default 20),
# after checking the fuzz crate's formatting and lints. With target names as arguments, runs
# only those: `FUZZ_SECONDS=600 hack/fuzz.sh qmp_lines`. Prints each target's executions and
# fails if any target crashed, naming the input that crashed it (under fuzz/artifacts/).
#
# Built without a sanitizer: the code under test has no `unsafe`, so AddressSanitizer would
# only halve the executions; debug assertions and overflow checks stay on. The committed seed
# corpus in fuzz/corpus/<target> is only read: what libFuzzer adds goes to a temporary copy.
# Needs the nightly toolchain and cargo-fuzz (hack/deps.sh installs both).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

# 20 s, not the issue's minute: the cold build already takes most of the step's budget (docs/fuzzing.md).
seconds="${FUZZ_SECONDS:-20}"
# Its own target dir, so a fuzz build never waits on (or evicts) the main workspace's.
export CARGO_TARGET_DIR="$PWD/target"
flags=(--sanitizer none --debug-assertions)

echo "== fuzz: cargo fmt --check, cargo clippy (fuzz/)"
cargo +nightly fmt --check
cargo +nightly clippy --locked --bins -- -D warnings
echo "== fuzz: build"
cargo +nightly fuzz build "${flags[@]}"
echo "fuzz: lints and build took ${SECONDS}s"

targets=("$@")
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The VMI schema's field names, for the targets that read VMIs as JSON.
grep -oE '^ *[a-zA-Z][a-zA-Z0-9]*:' ../manifests/crds/virtualmachineinstances.kubevirt.io.yaml \
  | tr -d ' :' | sort -u | sed 's/.*/"\\"&\\""/' >"$work/vmi.dict"

failed=()
for target in "${targets[@]}"; do
  mkdir -p "$work/corpus/$target"
  extra=()
  case "$target" in
    api_vmi | qemu_argv | launcher_api) extra+=("-dict=$work/vmi.dict") ;;
  esac
  log="$work/$target.log"
  status=0
  cargo +nightly fuzz run "${flags[@]}" "$target" "$work/corpus/$target" "corpus/$target" -- \
    -max_total_time="$seconds" -timeout=30 -print_final_stats=1 "${extra[@]}" >"$log" 2>&1 \
    || status=$?
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

echo "fuzz: ${#targets[@]} targets in ${SECONDS}s"
if ((${#failed[@]})); then
  echo "fuzz: crashed: ${failed[*]}; reproduce with: cd fuzz && cargo +nightly fuzz run ${flags[*]} <target> <crash file>" >&2
  exit 1
fi
