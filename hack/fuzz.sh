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

# What fuzzing needs beyond hack/deps.sh (not part of the suite: see docs/fuzzing.md).
# The cdfs crate, which reads seed ISO images back, builds a FUSE tool too.
if ! dpkg-query -W -f='${Status}' libfuse3-dev 2>/dev/null | grep -q "ok installed"; then
  apt-get install -y --no-install-recommends libfuse3-dev
fi
# Fuzzing (hack/fuzz.sh): libFuzzer's coverage instrumentation needs a nightly compiler.
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "deps: installing the nightly toolchain"
  rustup toolchain install nightly --profile minimal --component rustfmt,clippy
fi
for comp in rustfmt clippy; do
  rustup component list --toolchain nightly --installed 2>/dev/null | grep -q "^$comp" \
    || rustup component add --toolchain nightly "$comp"
done
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "deps: installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi
rustup run nightly cargo fuzz --version >/dev/null || { echo "fuzz: cargo +nightly fuzz does not run" >&2; exit 1; }

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
