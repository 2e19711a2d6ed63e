#!/usr/bin/env bash
# Builds the llama.cpp peer of the CPU side by sides (`scripts/bench-cpu-vs-llamacpp.sh`): the
# anchor's commit (0c1e570, `vendor/llama.cpp` of the `llama-cpp-python` 0.3.36 source
# package on PyPI) with clang, for the CPU.
#
#   scripts/build-llamacpp.sh [OUT_DIR] [native|amx]
#
# native (default): -DGGML_NATIVE=ON, for this machine only.
# amx: no -march=native; AVX-512 (VBMI, VNNI, BF16) and AMX (TILE, INT8, BF16) compiled in,
#   OpenMP off, static libstdc++/libgcc, so the binary runs on the GPU machine's Xeon host
#   (a newer glibc, nothing to install there). llama.cpp picks its AMX kernels at run time.
# Needs clang (clang-19 or newer; GCC 12 miscompiles the AMX tile configuration, see
# ../shared/anchors/cpu-anchors.md), cmake and pip (for the source package). Prints the path
# of the stripped llama-bench. A clean build takes 5-10 minutes on 2 cores.
set -euo pipefail
OUT=${1:-/tmp/llamacpp}
MODE=${2:-native}
CC=${CC:-$(command -v clang-19 || command -v clang)}
CXX=${CXX:-$(command -v clang++-19 || command -v clang++)}
[ -n "$CC" ] && [ -n "$CXX" ] || { echo "clang not found: install clang-19 (apt) or set CC/CXX" >&2; exit 1; }
mkdir -p "$OUT"
SRC="$OUT/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ ! -d "$SRC" ]; then
  python3 -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$OUT"
  tar -C "$OUT" -xzf "$OUT/llama_cpp_python-0.3.36.tar.gz"
fi
common=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX")
case "$MODE" in
  native) flags=(-DGGML_NATIVE=ON) ;;
  amx) flags=(-DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_AVX=ON
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=ON
    -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON
    -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc") ;;
  *) echo "mode must be native or amx, not $MODE" >&2; exit 1 ;;
esac
BUILD="$SRC/build-$MODE"
cmake -S "$SRC" -B "$BUILD" "${common[@]}" "${flags[@]}" >"$OUT/cmake-$MODE.log"
cmake --build "$BUILD" --target llama-bench -j "$(nproc)" >"$OUT/build-$MODE.log"
cp "$BUILD/bin/llama-bench" "$OUT/llama-bench-$MODE"
strip "$OUT/llama-bench-$MODE"
tiles=$(objdump -d "$OUT/llama-bench-$MODE" | grep -c tdpbssd || true)
if [ "$MODE" = amx ] && [ "$tiles" = 0 ]; then
  echo "warning: no AMX instructions in the binary" >&2
fi
echo "$OUT/llama-bench-$MODE"
