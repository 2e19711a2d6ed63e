// pagoda kernel prelude: prepended to every kernel source before NVRTC compiles it.
//
// Specialisation is done with -D defines that the registry derives from the KernelKey:
// PAGODA_T (element type of activations/outputs), other PAGODA_*_T (further input dtypes),
// and PAGODA_<PARAM> template constants. Nothing else reaches the compiler.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define PAGODA_DEVICE __device__ __forceinline__

// NVRTC has no <math.h>: the f32 infinity as a compile-time constant.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

PAGODA_DEVICE float to_f32(float x) { return x; }
PAGODA_DEVICE float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
PAGODA_DEVICE float to_f32(__half x) { return __half2float(x); }

template <typename U> PAGODA_DEVICE U from_f32(float x);
template <> PAGODA_DEVICE float from_f32<float>(float x) { return x; }
template <> PAGODA_DEVICE __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> PAGODA_DEVICE __half from_f32<__half>(float x) { return __float2half_rn(x); }

PAGODA_DEVICE float warp_sum(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    return value;
}

PAGODA_DEVICE float warp_max(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    return value;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
PAGODA_DEVICE float block_sum(float value) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    value = warp_sum(value);
    __syncthreads();
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    float total = lane < num_warps ? partial[lane] : 0.0f;
    return warp_sum(total);
}

PAGODA_DEVICE float quiet_nan() { return __int_as_float(0x7fc00000); }
