#!/usr/bin/env bash
# CI (no GPU): compiles every CUDA kernel specialisation pagoda can request through NVRTC
# for compute_90a, and for compute_80 those that can differ (every one of the sources with arch
# conditionals, the first of each other entry; PAGODA_NVRTC_ALL_ARCHS=1: all), and fails on
# any error.
#
# Installs the NVRTC, runtime-headers, CCCL and CRT (crt/mma.h for the tensor-core kernels)
# wheels (CUDA 13.0) into a private venv,
# points the loader and the include search at them, then runs the Rust check.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${PAGODA_NVRTC_VENV:-$root/target/nvrtc-venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
    "nvidia-cuda-nvrtc==13.0.88" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" \
    "nvidia-cuda-crt==13.0.88"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cu13="$site/nvidia/cu13"
if [ ! -f "$cu13/include/cuda_bf16.h" ]; then
    echo "nvrtc-check: cuda_bf16.h not found under $cu13/include" >&2
    exit 1
fi
export LD_LIBRARY_PATH="$cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PAGODA_CUDA_INCLUDE="$cu13/include"
export PAGODA_NVRTC_CHECK=1
cd "$root"
cargo test -p pagoda-ops --features cuda --test nvrtc_check -- --nocapture
