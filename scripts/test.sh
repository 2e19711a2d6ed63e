#!/usr/bin/env bash
# Runs every test of the workspace. Fetches the default model first (idempotent) so the parity
# tests against llama.cpp's reference outputs run; they skip with a message if it is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if ! bash scripts/fetch-model.sh; then
  echo "warning: the default model could not be fetched; tests that need it will skip" >&2
fi
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --all-targets
