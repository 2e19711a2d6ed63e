#!/usr/bin/env bash
# Runs every test of the workspace. Fetches the default model first (idempotent) so the parity
# tests against llama.cpp's reference outputs run; they skip with a message if it is missing.
# Then: the live-server tests with the official `openai` client, the NVRTC compile check of
# every CUDA kernel specialisation (no GPU needed), and the aarch64 subset under qemu. GPU
# tests print SKIP here; they run on the GPU machine (see docs/internals.md, "Tests and their oracles").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# A clean run gains nothing from incremental caches, and they cost disk (about 1.6 GB).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# Each step's wall time, so that CI's budget (30 minutes on 2 cores) can be watched step by step.
began=$SECONDS
step() {
  local start=$SECONDS
  "$@"
  echo "test.sh: '$*' took $((SECONDS - start)) s"
}
if ! bash scripts/fetch-model.sh; then
  echo "warning: the default model could not be fetched; tests that need it will skip" >&2
fi
step cargo fmt --all -- --check
step cargo clippy --workspace --all-targets -- -D warnings
# The CUDA backend's real code (cudarc, loaded at run time) must lint clean too.
step cargo clippy --workspace --all-targets --features pagoda-cli/cuda,pagoda-cuda/cuda,pagoda-models/cuda -- -D warnings
step cargo test --workspace --all-targets
if [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  step env PAGODA_BIN=target/debug/pagoda bash scripts/test-server.sh
else
  echo "warning: no default model; skipping the live-server tests" >&2
fi
step bash scripts/nvrtc-check.sh
# aarch64 (issue 48): the pagoda-ops tests cross-built and run under qemu-aarch64, `-cpu max`
# (the `neon_dotprod` set) without the statistical sampling tests, the kernel tests under
# `-cpu neoverse-n1` and `-cpu cortex-a53` (the plain `neon` set), and a short greedy
# generation per NEON set against the native text: the subset that fits CI's budget (about
# 8 minutes after the x86 build); scripts/test-aarch64.sh says what and why, and without
# `--ci` runs every ops test (about 30 minutes). Installs the cross tools if missing; skips
# with a message where it cannot.
step bash scripts/test-aarch64.sh --ci
echo "test.sh: done in $((SECONDS - began)) s; target/ holds $(du -sh target 2>/dev/null | cut -f1)"
