#!/usr/bin/env bash
# Packs what a GPU-machine run needs into one ignored folder (default `.devc/`), so that a
# `run` call carries it: the stripped release binary and the named CUDA test binaries,
# xz-compressed into `bundle.tar.xz` (a few MB), plus `run.sh` beside it.
#
#   CARGO_TARGET_DIR=/tmp/cuda-target cargo build --release -p pagoda-cli --features pagoda-cli/cuda
#   CARGO_TARGET_DIR=/tmp/cuda-target cargo test --release --no-run \
#       --features pagoda-ops/cuda,pagoda-models/cuda,pagoda-engine/cuda -p pagoda-ops -p pagoda-engine
#   TESTS="cuda_forward gpu_mla backend_ops" bash scripts/device/pack.sh
#
# Environment: CARGO_TARGET_DIR (default /tmp/cuda-target); PROFILE (release or debug, default
# release: `cargo test --release --no-run` reuses the release build's dependencies); TESTS
# (test target names: the newest executable `<profile>/deps/<name>-<hash>` is taken);
# OUT_DIR (default .devc); EXTRA (more files to copy into the folder as they are).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-/tmp/cuda-target}"
OUT_DIR="${OUT_DIR:-.devc}"
PROFILE="${PROFILE:-release}"
mkdir -p "$OUT_DIR"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/tests"
if [[ -x "$TARGET/release/pagoda" ]]; then
    strip -o "$stage/bin/pagoda" "$TARGET/release/pagoda"
else
    echo "pack: no release binary under $TARGET/release (build it first)" >&2
    exit 1
fi
for name in ${TESTS:-}; do
    found="$(ls -t "$TARGET"/$PROFILE/deps/"$name"-* 2>/dev/null | grep -v '\.d$' | head -1 || true)"
    if [[ -z "$found" || ! -x "$found" ]]; then
        echo "pack: no test binary '$name' under $TARGET/$PROFILE/deps (cargo test --no-run first)" >&2
        exit 1
    fi
    strip -o "$stage/tests/$name" "$found"
done
tar -C "$stage" -cf - bin tests | xz -T2 -6 > "$OUT_DIR/bundle.tar.xz"
cp scripts/device/run.sh "$OUT_DIR/run.sh"
for f in ${EXTRA:-}; do cp -r "$f" "$OUT_DIR/"; done
du -sh "$OUT_DIR" "$OUT_DIR/bundle.tar.xz"
