#!/usr/bin/env bash
# Cross-builds pagoda for aarch64-unknown-linux-gnu and runs it under qemu-user: the ops tests,
# then a short greedy generation on the default model in exact mode, compared with the native
# build's text. Installs what it needs (Debian's gcc-aarch64-linux-gnu and qemu-user-static, the
# rustup target). Prints how long each part took. Not part of scripts/test.sh yet (issue 48).
#
# Environment: CARGO_TARGET_DIR as usual; QEMU_CPU (default `max`: every Arm feature qemu
# emulates, dotprod and i8mm included); PAGODA_AARCH64_SKIP_GENERATE=1 skips the generation.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
target=aarch64-unknown-linux-gnu
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

started=$SECONDS
step_start=$SECONDS
step() {
  echo "test-aarch64.sh: $1 took $((SECONDS - step_start)) s" >&2
  step_start=$SECONDS
}

# Tools: the cross linker and the user-mode emulator (apt), the Rust target (rustup).
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user-static
fi
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
step "installing the tools"

# The cross toolchain through the environment only: x86 builds see no change.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export QEMU_CPU="${QEMU_CPU:-max}"
# The tests that re-run their own binary under each CPU configuration go through qemu too.
export PAGODA_TEST_RUNNER="$CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER"

cargo build --target "$target" -p pagoda-cli
cargo test --no-run --target "$target" -p pagoda-ops
step "cross-building (pagoda-cli, the pagoda-ops tests)"

cargo test --target "$target" -p pagoda-ops
step "the pagoda-ops tests under qemu ($QEMU_CPU)"

model=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "${PAGODA_AARCH64_SKIP_GENERATE:-0}" = 1 ]; then
  echo "test-aarch64.sh: generation skipped (PAGODA_AARCH64_SKIP_GENERATE=1)" >&2
elif [ ! -f "$model" ] && ! bash scripts/fetch-model.sh; then
  echo "warning: no default model; skipping the generation" >&2
else
  target_dir="${CARGO_TARGET_DIR:-target}"
  prompt="The capital of France is"
  # Exact mode (f32 weights, activations and KV) and the portable kernels on both sides, so
  # the two builds run the same arithmetic.
  generate() {
    PAGODA_CPU_KERNELS=scalar PAGODA_CPU_ATTENTION=scalar PAGODA_CPU_F32_DECODE=tile \
      "$@" generate -m "$model" --exact --temp 0 -n 16 -t 2 -p "$prompt" 2>/dev/null
  }
  arm_text="$(generate qemu-aarch64-static -L /usr/aarch64-linux-gnu "$target_dir/$target/debug/pagoda")"
  step "16 greedy tokens under qemu"
  cargo build -p pagoda-cli
  x86_text="$(generate "$target_dir/debug/pagoda")"
  step "the native build and its 16 tokens"
  printf 'aarch64: %q\nnative:  %q\n' "$arm_text" "$x86_text" >&2
  if [ "$arm_text" != "$x86_text" ]; then
    echo "test-aarch64.sh: the aarch64 and native generations differ" >&2
    exit 1
  fi
fi
echo "test-aarch64.sh: done in $((SECONDS - started)) s" >&2
