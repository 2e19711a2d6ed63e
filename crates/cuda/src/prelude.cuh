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

// Visible tokens of request r from its CSR page-table row (0 when it has no pages).
PAGODA_DEVICE long long paged_visible_len(const unsigned int* kv_indptr,
                                          const unsigned int* last_page_len,
                                          const unsigned int* first_page_offset, unsigned int r,
                                          unsigned int page_size) {
    const long long pages = (long long)kv_indptr[r + 1] - (long long)kv_indptr[r];
    if (pages <= 0) return 0;
    return (pages - 1) * page_size + (long long)last_page_len[r] - (long long)first_page_offset[r];
}

// Query-tiled prefill kernels (grid x = B + ceil(num_tokens / block_q) slots): writes zeros
// for this block's KV-head columns of the tokens of slot `slot`'s window
// [slot * block_q, (slot + 1) * block_q) that lie outside [qo_indptr[0], qo_indptr[B]).
template <typename U>
PAGODA_DEVICE void prefill_zero_window(U* __restrict__ out, const unsigned int* qo_indptr,
                                       unsigned int num_requests, unsigned int num_tokens,
                                       unsigned int slot, unsigned int block_q,
                                       unsigned int kv_head, size_t group_elems,
                                       size_t out_token_elems) {
    const unsigned long long window_start = (unsigned long long)slot * block_q;
    const unsigned long long window_end =
        min(window_start + block_q, (unsigned long long)num_tokens);
    const unsigned long long first_token = qo_indptr[0];
    const unsigned long long end_token = qo_indptr[num_requests];
    if (window_start >= window_end || (window_start >= first_token && window_end <= end_token)) return;
    const unsigned long long count = (window_end - window_start) * group_elems;
    for (unsigned long long i = threadIdx.x; i < count; i += blockDim.x) {
        const unsigned long long token = window_start + i / group_elems;
        if (token < first_token || token >= end_token) {
            out[token * out_token_elems + kv_head * group_elems + i % group_elems] = from_f32<U>(0.0f);
        }
    }
}

// Query-tiled prefill kernels: slot `slot` belongs to request r when base(r) <= slot <
// base(r + 1), base(r) = r + qo_indptr[r] / block_q; its tile is slot - base(r). False when
// the slot has no request (before the first base).
PAGODA_DEVICE bool prefill_slot_tile(const unsigned int* qo_indptr, unsigned int num_requests,
                                     unsigned int slot, unsigned int block_q, unsigned int& r,
                                     long long& tile) {
    unsigned int lo = 0, hi = num_requests;
    while (lo < hi) {
        const unsigned int mid = lo + (hi - lo) / 2;
        const unsigned long long base = (unsigned long long)mid + qo_indptr[mid] / block_q;
        if (base <= slot) lo = mid + 1; else hi = mid;
    }
    if (lo == 0) return false;
    r = lo - 1;
    tile = (long long)slot - ((long long)r + qo_indptr[r] / block_q);
    return true;
}

// 8 bf16 from global memory (16-byte vector load when aligned).
PAGODA_DEVICE uint4 load_bf16x8(const __nv_bfloat16* p) {
    if ((reinterpret_cast<size_t>(p) & 15) == 0) return *reinterpret_cast<const uint4*>(p);
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
    uint4 value;
    value.x = (unsigned int)s[0] | ((unsigned int)s[1] << 16);
    value.y = (unsigned int)s[2] | ((unsigned int)s[3] << 16);
    value.z = (unsigned int)s[4] | ((unsigned int)s[5] << 16);
    value.w = (unsigned int)s[6] | ((unsigned int)s[7] << 16);
    return value;
}
