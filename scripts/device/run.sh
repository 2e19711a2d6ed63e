#!/usr/bin/env bash
# Runs on the GPU machine from the repository root (see scripts/device/pack.sh): unpacks the
# bundle to /tmp/pg (bin/pagoda, tests/*), runs every packed test binary with
# `--include-ignored` (logs under $OUT/tests-<name>.log, one summary line each), then the
# command given as arguments with `pagoda` on the PATH.
#
#   bash .devc/run.sh                            # the tests only
#   TESTS_ONLY="gpu_mla" bash .devc/run.sh       # a subset of the packed tests
#   SKIP_TESTS=1 bash .devc/run.sh bash .devc/bench.sh
# TEST_TIMEOUT (seconds per test binary, default 300; rc 124 when it ran out), TEST_ARGS
# (more arguments for every test binary, e.g. a name filter).
set -uo pipefail
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/pg
xz -dc "$DIR/bundle.tar.xz" | tar -C /tmp/pg -xf -
export PATH="/tmp/pg/bin:$PATH"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
summary=()
if [[ -z "${SKIP_TESTS:-}" ]]; then
    for t in /tmp/pg/tests/*; do
        [[ -x "$t" ]] || continue
        name="$(basename "$t")"
        if [[ -n "${TESTS_ONLY:-}" && " $TESTS_ONLY " != *" $name "* ]]; then continue; fi
        start=$(date +%s)
        # shellcheck disable=SC2086
        timeout "${TEST_TIMEOUT:-300}" "$t" --include-ignored --test-threads=1 ${TEST_ARGS:-} \
            > "$OUT/tests-$name.log" 2>&1
        rc=$?
        line="$(grep -E '^test result:' "$OUT/tests-$name.log" | tail -1)"
        summary+=("$name rc=$rc $(( $(date +%s) - start ))s ${line:-no result line}")
        if [[ $rc -ne 0 ]]; then
            grep -E -A12 '^---- .* stdout ----|panicked' "$OUT/tests-$name.log" | head -60
        fi
    done
fi
if [[ $# -gt 0 ]]; then
    "$@"
fi
printf '%s\n' "${summary[@]}" | tee "$OUT/test-summary.txt"
