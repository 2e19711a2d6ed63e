#!/usr/bin/env bash
# Cross-builds pagoda for aarch64-unknown-linux-gnu and runs it under qemu-user (issue 48).
# Installs what it needs (Debian's gcc-aarch64-linux-gnu and qemu-user-static, the rustup
# target). Prints how long each part took.
#
#   bash scripts/test-aarch64.sh        the full run (about 30 min on 2 cores): every pagoda-ops
#                                       test under `-cpu max`, then a greedy generation on the
#                                       default model in exact mode, compared with the native
#                                       build's text.
#   bash scripts/test-aarch64.sh --ci   the subset scripts/test.sh runs in CI (see `ci_subset`
#                                       below for what and why); exits 0 with a message when the
#                                       tools cannot be installed.
#
# Environment: CARGO_TARGET_DIR as usual; QEMU_CPU (default `max`: every Arm feature qemu
# emulates, dotprod and i8mm included, so `auto` picks the `neon_dotprod` set);
# PAGODA_AARCH64_SKIP_GENERATE=1 skips the generation.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
target=aarch64-unknown-linux-gnu
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
mode=full
[ "${1:-}" = "--ci" ] && mode=ci

started=$SECONDS
step_start=$SECONDS
step() {
  echo "test-aarch64.sh: $1 took $((SECONDS - step_start)) s" >&2
  step_start=$SECONDS
}

# Tools: the cross linker and the user-mode emulator (apt), the Rust target (rustup). In CI
# mode a machine that cannot install them (no apt, no root, no network) skips the step.
cannot_install() {
  if [ "$mode" = ci ]; then
    echo "test-aarch64.sh: SKIPPED the aarch64 step: $1 (install gcc-aarch64-linux-gnu," \
      "qemu-user-static and the rustup target $target to run it)" >&2
    exit 0
  fi
  echo "test-aarch64.sh: $1" >&2
  exit 1
}
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  command -v apt-get >/dev/null || cannot_install "no apt-get to install the cross tools"
  { $sudo apt-get update -qq && $sudo apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user-static; } ||
    cannot_install "apt-get could not install gcc-aarch64-linux-gnu qemu-user-static"
fi
if ! rustup target list --installed | grep -qx "$target"; then
  rustup target add "$target" || cannot_install "rustup could not add $target"
fi
step "installing the tools"

# The cross toolchain through the environment only: x86 builds see no change.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export QEMU_CPU="${QEMU_CPU:-max}"
# The tests that re-run their own binary under each CPU configuration go through qemu too.
export PAGODA_TEST_RUNNER="$CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER"

# The CI subset (scripts/test.sh): 348 s measured after the x86 build, as in CI (79 s
# cross-building the ops tests, 118 s of them under -cpu max, 4 s under the other CPUs, 116 s
# cross-building the greedy_tokens example, 31 s of generation; one cargo job on 2 shared
# cores): every pagoda-ops test binary cross-built, then
#   1. under `-cpu max` (NEON, dotprod, i8mm: `auto` is neon_dotprod+f32_ffn_down, the NEON
#      attention) every pagoda-ops test except two statistical sampling binaries
#      (SLOW_UNDER_QEMU: millions of draws; under qemu sampling_draws took 116 s and
#      sampling_fused_draws more than 240 s, against 31 s for speculative_draws, which stays;
#      they check portable code that the x86 run of scripts/test.sh covers, and the full run
#      here still runs them);
#   2. under `-cpu cortex-a53` (no dotprod: the plain `neon` set) the kernel tests against
#      their scalar oracles (linear_neon_kernels with the NEON activation quantizer,
#      linear_int_kernels, attention_simd_kernels, linear_neon_f32: the NEON f32 tiles),
#      which must find exactly the sets each CPU model has, and under `-cpu neoverse-n1`
#      (dotprod without i8mm) linear_neon_kernels again, for the `SDOT` prefill tiles that
#      `-cpu max` runs on `SMMLA`;
#   3. 16 greedy tokens on the default model (Q4_1 weights, Q8 activations; the model's
#      forward alone, pagoda-models' `greedy_tokens` example, not the CLI) with
#      `neon_dotprod` under `-cpu max` and `neon` under `-cpu cortex-a53`, each equal to the
#      native build's tokens with the `scalar` set (the NEON dots and activation quantizer give
#      the scalar kernels' bits; the attention is the portable one on both sides), and with
#      `neon_dotprod+f32_ffn_down` under `-cpu max` equal to the native
#      `scalar+f32_ffn_down` (`ffn_down` on the NEON f32 tiles there, on the AVX2+FMA tiles
#      natively: the same fused recipe, the same bits). Skipped with a
#      message without the model.
# Not here: the exact-mode generation and the statistical sampling tests (the full run).
SLOW_UNDER_QEMU=(sampling_draws sampling_fused_draws)
ci_subset() {
  cargo test --no-run --target "$target" -p pagoda-ops
  step "cross-building the pagoda-ops tests"
  local binaries=() name test_file
  for test_file in crates/ops/tests/*.rs; do
    name="$(basename "$test_file" .rs)"
    case " ${SLOW_UNDER_QEMU[*]} " in *" $name "*) continue ;; esac
    binaries+=(--test "$name")
  done
  QEMU_CPU=max PAGODA_TEST_EXPECT_INT_ISAS=NeonDot,Neon \
    cargo test --target "$target" -p pagoda-ops --lib "${binaries[@]}"
  step "the pagoda-ops tests under qemu -cpu max (all but ${SLOW_UNDER_QEMU[*]})"
  QEMU_CPU=cortex-a53 PAGODA_TEST_EXPECT_INT_ISAS=Neon \
    cargo test --target "$target" -p pagoda-ops \
    --test linear_neon_kernels --test linear_int_kernels --test attention_simd_kernels \
    --test linear_neon_f32
  step "the kernel tests under qemu -cpu cortex-a53 (no dotprod)"
  QEMU_CPU=neoverse-n1 PAGODA_TEST_EXPECT_INT_ISAS=NeonDot,Neon \
    cargo test --target "$target" -p pagoda-ops --test linear_neon_kernels
  step "the NEON kernel tests under qemu -cpu neoverse-n1 (dotprod without i8mm: SDOT prefill tiles)"
  local model=models/SmolLM2-135M-Instruct.Q4_1.gguf target_dir="${CARGO_TARGET_DIR:-target}"
  if [ ! -f "$model" ]; then
    echo "test-aarch64.sh: no default model; skipping the NEON generation" >&2
    return
  fi
  # The model's forward alone (pagoda-models' greedy_tokens example), not the whole CLI: the
  # CLI's server, grammar and HTTP crates took 209 s of a clean run to cross-build.
  cargo build -p pagoda-models --example greedy_tokens
  cargo build --target "$target" -p pagoda-models --example greedy_tokens
  step "cross-building pagoda-models' greedy_tokens example"
  local native native_f32_down arm cpu_and_set
  native="$(quantized_generate scalar "$target_dir/debug/examples/greedy_tokens")"
  native_f32_down="$(quantized_generate scalar+f32_ffn_down "$target_dir/debug/examples/greedy_tokens")"
  for cpu_and_set in max:neon_dotprod cortex-a53:neon max:neon_dotprod+f32_ffn_down; do
    arm="$(QEMU_CPU="${cpu_and_set%%:*}" quantized_generate "${cpu_and_set#*:}" \
      qemu-aarch64-static -L /usr/aarch64-linux-gnu "$target_dir/$target/debug/examples/greedy_tokens")"
    local want="$native" want_set=scalar
    case "$cpu_and_set" in *+f32_ffn_down) want="$native_f32_down" want_set=scalar+f32_ffn_down ;; esac
    printf '%s: %s\nnative %s: %s\n' "$cpu_and_set" "$arm" "$want_set" "$want" >&2
    if [ -z "$arm" ] || [ "$arm" != "$want" ]; then
      echo "test-aarch64.sh: the $cpu_and_set tokens differ from the native ones" >&2
      exit 1
    fi
  done
  step "16 greedy tokens with neon_dotprod, neon and neon_dotprod+f32_ffn_down under qemu, and natively"
}

# 16 greedy tokens on the default model as stored (Q8 activations) after "The capital of France
# is" with kernel set $1, the portable attention and the two-row f32 tiles, by the
# greedy_tokens example that the command that follows runs (its token ids, one line).
quantized_generate() {
  local set="$1"
  shift
  PAGODA_CPU_KERNELS="$set" PAGODA_CPU_ATTENTION=scalar PAGODA_CPU_F32_DECODE=tile \
    "$@" models/SmolLM2-135M-Instruct.Q4_1.gguf 504,3575,282,4649,314 16 2>/dev/null
}

if [ "$mode" = ci ]; then
  ci_subset
  echo "test-aarch64.sh: done (CI subset) in $((SECONDS - started)) s" >&2
  exit 0
fi

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
