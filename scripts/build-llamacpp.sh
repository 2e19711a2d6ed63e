#!/usr/bin/env bash
# Builds the llama.cpp peer of the side by sides (`scripts/bench-cpu-vs-llamacpp.sh`): the
# anchor's commit (0c1e570, `vendor/llama.cpp` of the `llama-cpp-python` 0.3.36 source
# package on PyPI), with clang for the CPU, or with CUDA 13.0 for the GPU machine's H200.
#
#   scripts/build-llamacpp.sh [OUT_DIR] [native|amx|cuda]
#
# native (default): -DGGML_NATIVE=ON, for this machine only.
# amx: no -march=native; AVX-512 (VBMI, VNNI, BF16) and AMX (TILE, INT8, BF16) compiled in,
#   OpenMP off, static libstdc++/libgcc, so the binary runs on the GPU machine's Xeon host
#   (a newer glibc, nothing to install there). llama.cpp picks its AMX kernels at run time.
# cuda: llama-bench and llama-batched-bench for the H200 (SASS for sm_90a only, no PTX),
#   built with the CUDA 13.0 nvcc, runtime and cuBLAS from PyPI (a venv in OUT_DIR/cuda-venv;
#   the cu13 wheels lay a toolkit out in site-packages/nvidia/cu13), gcc as the host compiler,
#   static libstdc++/libgcc, OpenMP off, AVX2 host code (every layer runs on the GPU).
#   The binaries need only libcuda.so.1, libcudart.so.13, libcublas.so.13, libcublasLt.so.13
#   and glibc: on the GPU machine, LD_LIBRARY_PATH=/usr/local/cuda/lib64 (CUDA 13.0, driver
#   580). Linked against a stub libcuda.so generated from cuda.h (the wheels ship none).
#   Flash attention stays on with the default K-V type combinations (GGML_CUDA_FA_QUANTS).
#   Built with -j 2 under nice -n 19; a clean build takes about 25 minutes on 2 cores. Checks
#   the sm_90a code with cuobjdump (13.2 from PyPI: there is no 13.0 wheel) and the needed
#   libraries with readelf. Prints the paths of the two stripped binaries.
# native and amx need clang (clang-19 or newer; GCC 12 miscompiles the AMX tile configuration,
# see ../shared/anchors/cpu-anchors.md); all modes need cmake and pip (for the source
# package). Prints the paths of the stripped llama-bench and llama-server (the peer of
# `scripts/bench-serve-vs-llamacpp.sh`). A clean CPU build takes 5-10 minutes
# on 2 cores.
set -euo pipefail
OUT=${1:-/tmp/llamacpp}
MODE=${2:-native}
case "$MODE" in
  native|amx)
    CC=${CC:-$(command -v clang-19 || command -v clang || true)}
    CXX=${CXX:-$(command -v clang++-19 || command -v clang++ || true)}
    [ -n "$CC" ] && [ -n "$CXX" ] || { echo "clang not found: install clang-19 (apt) or set CC/CXX" >&2; exit 1; } ;;
  cuda) CC=${CC:-$(command -v gcc)} CXX=${CXX:-$(command -v g++)} ;;
  *) echo "mode must be native, amx or cuda, not $MODE" >&2; exit 1 ;;
esac
mkdir -p "$OUT"
SRC="$OUT/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ ! -d "$SRC" ]; then
  # Only the package itself from source: `--no-binary :all:` would also build its build
  # dependencies (cmake, ninja) from source to prepare the metadata.
  python3 -m pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "$OUT"
  tar -C "$OUT" -xzf "$OUT/llama_cpp_python-0.3.36.tar.gz"
fi
common=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX")
BUILD="$SRC/build-$MODE"
if [ "$MODE" = cuda ]; then
  VENV="$OUT/cuda-venv"
  [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
  if ! compgen -G "$VENV/lib/python3*/site-packages/nvidia/cu13/bin/nvcc" >/dev/null; then
    # nvcc alone has no cicc (nvvm), crt headers or CCCL (cub, thrust, libcu++).
    "$VENV/bin/pip" install -q 'nvidia-cuda-nvcc==13.0.*' 'nvidia-cuda-crt==13.0.*' \
      'nvidia-nvvm==13.0.*' 'nvidia-cuda-cccl==13.0.*' 'nvidia-cuda-runtime==13.0.*' \
      'nvidia-cublas==13.0.*'
  fi
  [ -x "$OUT/cuobjdump/nvidia/cu13/bin/cuobjdump" ] ||
    "$VENV/bin/pip" install -q --no-deps --target "$OUT/cuobjdump" 'nvidia-cuda-cuobjdump==13.2.*'
  TK=$(echo "$VENV"/lib/python3*/site-packages/nvidia/cu13)
  # What a toolkit has and the wheels lack: nvcc links from lib64, CMake's FindCUDAToolkit
  # looks for the unversioned libcudart.so, libcublas.so, libcublasLt.so and libcuda.so
  # (stubs/). The stub defines every driver function of cuda.h (as the preprocessor names
  # them: cuMemGetInfo_v2, ...) and takes the real library's soname, libcuda.so.1.
  ln -sfn lib "$TK/lib64"
  for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$TK/lib/lib$l.so"; done
  if [ ! -f "$TK/lib/stubs/libcuda.so" ]; then
    mkdir -p "$TK/lib/stubs"
    printf '#include <cuda.h>\n' | "$CC" -E -P -I"$TK/include" -x c - |
      grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' | sort -u |
      sed 's/.*/int &(void) { return 999; }/' >"$TK/lib/stubs/libcuda-stub.c"
    "$CC" -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$TK/lib/stubs/libcuda.so" \
      "$TK/lib/stubs/libcuda-stub.c"
  fi
  # 90a-real: SASS for the H200 and no PTX (the same kernels; only the JIT fallback for
  # other GPUs goes, which halves the size of the binaries). No GGML_CUDA_FA_QUANTS=all.
  # No RPATH: the toolkit's lib directory is on this machine only.
  flags=(-DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_AVX=ON
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_CUDA=ON
    -DCMAKE_CUDA_ARCHITECTURES=90a-real -DGGML_CUDA_FA=ON -DGGML_CUDA_FA_ALL_QUANTS=OFF
    -DGGML_CUDA_NCCL=OFF
    -DCMAKE_CUDA_COMPILER="$TK/bin/nvcc" -DCMAKE_CUDA_HOST_COMPILER="$CXX"
    -DCUDAToolkit_ROOT="$TK" -DCMAKE_SKIP_RPATH=ON
    -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc")
  cmake -S "$SRC" -B "$BUILD" "${common[@]}" "${flags[@]}" >"$OUT/cmake-$MODE.log"
  nice -n 19 cmake --build "$BUILD" --target llama-bench llama-batched-bench -j 2 \
    >"$OUT/build-$MODE.log"
  for b in llama-bench llama-batched-bench; do
    cp "$BUILD/bin/$b" "$OUT/$b-cuda"
    strip "$OUT/$b-cuda"
    elfs=$("$OUT/cuobjdump/nvidia/cu13/bin/cuobjdump" --list-elf "$OUT/$b-cuda")
    grep -q 'sm_90a' <<<"$elfs" || { echo "no sm_90a code in $b-cuda" >&2; exit 1; }
    if grep -v 'sm_90a' <<<"$elfs" | grep -q .; then
      echo "warning: code for other architectures in $b-cuda" >&2
    fi
    needed=$(readelf -d "$OUT/$b-cuda" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
    allowed='lib(cuda\.so\.1|cudart\.so\.13|cublas(Lt)?\.so\.13)'
    allowed+='|lib(c|m)\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|ld-linux-x86-64\.so\.2'
    extra=$(grep -vxE "$allowed" <<<"$needed" || true)
    [ -z "$extra" ] || { echo "$b-cuda needs $extra" >&2; exit 1; }
    echo "$OUT/$b-cuda"
  done
  exit 0
fi
case "$MODE" in
  native) flags=(-DGGML_NATIVE=ON) ;;
  amx) flags=(-DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_AVX=ON
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=ON
    -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON
    -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc") ;;
esac
cmake -S "$SRC" -B "$BUILD" "${common[@]}" "${flags[@]}" >"$OUT/cmake-$MODE.log"
cmake --build "$BUILD" --target llama-bench llama-server -j "$(nproc)" >"$OUT/build-$MODE.log"
cp "$BUILD/bin/llama-bench" "$OUT/llama-bench-$MODE"
strip "$OUT/llama-bench-$MODE"
cp "$BUILD/bin/llama-server" "$OUT/llama-server-$MODE"
strip "$OUT/llama-server-$MODE"
tiles=$(objdump -d "$OUT/llama-bench-$MODE" | grep -c tdpbssd || true)
if [ "$MODE" = amx ] && [ "$tiles" = 0 ]; then
  echo "warning: no AMX instructions in the binary" >&2
fi
echo "$OUT/llama-bench-$MODE"
echo "$OUT/llama-server-$MODE"
