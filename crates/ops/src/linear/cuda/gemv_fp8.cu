// FP8 (e4m3) weights with one f32 factor per output row (per-channel; a per-tensor factor is
// repeated), as compressed-tensors and vLLM's fp8 checkpoints ship them, kept on the device
// in their bytes.
//
// gemv_fp8: out[i, j] = beta * out[i, j] + scale[j] * sum_k x[i, k] * code(w[j, k]) for the
// m <= M_TILE rows of x (bf16, [m, k]), w e4m3 ([n, k], one byte a value), f32 accumulation,
// out f32 or bf16 ([m, n]). The layout of gemv_small: each warp owns ROWS weight rows, its
// lanes stride over k in 16-byte pieces (16 e4m3 values; the 32 bytes of the same 16
// activations of each of the m rows come from cache), UNROLL pieces a row in flight,
// streamed past L1, widened in registers and reduced over the warp at the end, where the
// row's factor is applied once.
// Requirements (checked by the launcher): k a multiple of 16, x and w 16-byte aligned.
// Specialisation: PAGODA_T_OUT (float or __nv_bfloat16), PAGODA_M_TILE (1, 2, 4, 8 or 16).
//
// dequant_fp8: out[j, k] = scale[j] * code(w[j, k]) in PAGODA_T (the dense scratch the GEMM
// of more rows reads).
//
// An e4m3 code (1 sign, 4 exponent bits biased by 7, 3 mantissa bits) is, bit for bit, the
// f16 with its sign at bit 15 and its other seven bits at bits 7..13, times 2^8 (the bias
// 15 - 7): subnormals included, as f16 subnormals; the NaN code is not honoured. The 2^8 is
// folded into the row's factor.

namespace gemv_fp8_detail {
constexpr float CODE_UNIT = 256.0f;  // the f16 reading of a code is the code's value / 2^8
constexpr int ROWS = 4;               // weight rows per warp
constexpr int WARPS = 8;              // warps per block
constexpr int UNROLL = 2;             // pieces per row in flight per lane

// 16 bytes that are read once: no L1 allocation.
PAGODA_DEVICE uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Two e4m3 codes (the low 16 bits of `pair`) as two f32, each 2^-8 times its value.
PAGODA_DEVICE float2 widen_pair(unsigned int pair) {
    const unsigned int spread = (pair | (pair << 8)) & 0x00ff00ffu;  // code 1 to bits 16..23
    const unsigned int bits = ((spread & 0x00800080u) << 8) | ((spread & 0x007f007fu) << 7);
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

// The 16 codes of v, each 2^-8 times its value.
PAGODA_DEVICE void widen_codes(const uint4 v, float (&f)[16]) {
    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 lo = widen_pair(words[i] & 0xffffu);
        const float2 hi = widen_pair(words[i] >> 16);
        f[4 * i] = lo.x;
        f[4 * i + 1] = lo.y;
        f[4 * i + 2] = hi.x;
        f[4 * i + 3] = hi.y;
    }
}

// The 8 bf16 of v as f32 (a bf16 is the high half of its f32).
PAGODA_DEVICE void widen_bf16(const uint4 v, float* f) {
    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}
}  // namespace gemv_fp8_detail

#ifdef PAGODA_M_TILE
typedef PAGODA_T_OUT TO;

extern "C" __global__ void __launch_bounds__(gemv_fp8_detail::WARPS * 32)
    gemv_fp8(const __nv_bfloat16* __restrict__ x, const unsigned char* __restrict__ w,
             const float* __restrict__ scales, TO* __restrict__ out, unsigned int m,
             unsigned int n, unsigned int k, float beta) {
    using namespace gemv_fp8_detail;
    constexpr int M_TILE = PAGODA_M_TILE;
    static_assert(M_TILE == 1 || M_TILE == 2 || M_TILE == 4 || M_TILE == 8 || M_TILE == 16,
                  "M_TILE: 1, 2, 4, 8 or 16");
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int row0 = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
    if (row0 >= n) return;
    const unsigned int pieces = k / 16;
    const uint4* w_rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const unsigned int row = min(row0 + r, n - 1);  // rows past n read row n - 1, unused
        w_rows[r] = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    }
    const uint4* x_rows = reinterpret_cast<const uint4*>(x);  // 2 pieces of x per piece of w
    float acc[M_TILE][ROWS];
#pragma unroll
    for (int i = 0; i < M_TILE; ++i)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[i][r] = 0.0f;

    for (unsigned int base = lane; base < pieces; base += 32 * UNROLL) {
        uint4 wv[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned int p = base + 32 * u;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                wv[u][r] = p < pieces ? load_stream(w_rows[r] + p) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned int p = base + 32 * u;
            if (p >= pieces) break;
            float wf[ROWS][16];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) widen_codes(wv[u][r], wf[r]);
#pragma unroll
            for (int i = 0; i < M_TILE; ++i) {
                if (i < (int)m) {
                    float xf[16];
                    const uint4* xp = x_rows + (size_t)i * 2 * pieces + 2 * p;
                    widen_bf16(__ldg(xp), xf);
                    widen_bf16(__ldg(xp + 1), xf + 8);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
#pragma unroll
                        for (int e = 0; e < 16; ++e) acc[i][r] = fmaf(xf[e], wf[r][e], acc[i][r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const unsigned int row = row0 + r;
        const float factor = row < n ? scales[row] * CODE_UNIT : 0.0f;
#pragma unroll
        for (int i = 0; i < M_TILE; ++i) {
            float v = acc[i][r];
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
            if (lane == (unsigned int)((i * ROWS + r) % 32) && i < (int)m && row < n) {
                TO* o = out + (size_t)i * n + row;
                const float previous = beta != 0.0f ? beta * to_f32(*o) : 0.0f;
                *o = from_f32<TO>(previous + factor * v);
            }
        }
    }
}
#endif

#ifdef PAGODA_T
// One thread per 4 codes (k a multiple of 4): grid (n, ceil(k / 4 / 256)), the rows on x (an
// LM head's 128K rows exceed y's 65535).
extern "C" __global__ void dequant_fp8(const unsigned char* __restrict__ w,
                                       const float* __restrict__ scales, PAGODA_T* __restrict__ out,
                                       unsigned int n, unsigned int k) {
    using namespace gemv_fp8_detail;
    const unsigned int row = blockIdx.x;
    const unsigned int quad = blockIdx.y * blockDim.x + threadIdx.x;
    if (row >= n || quad * 4 >= k) return;
    const size_t at = (size_t)row * k + quad * 4;
    const unsigned int word = *reinterpret_cast<const unsigned int*>(w + at);
    const float factor = scales[row] * CODE_UNIT;
    const float2 lo = widen_pair(word & 0xffffu);
    const float2 hi = widen_pair(word >> 16);
    out[at] = from_f32<PAGODA_T>(factor * lo.x);
    out[at + 1] = from_f32<PAGODA_T>(factor * lo.y);
    out[at + 2] = from_f32<PAGODA_T>(factor * hi.x);
    out[at + 3] = from_f32<PAGODA_T>(factor * hi.y);
}
#endif

#ifdef PAGODA_T
// quant_rows_fp8: a CTA a row of x ([m, k], PAGODA_T), k a multiple of 4: scales[i] = the row's
// amax / 448 and codes[i, j] = e4m3(x[i, j] / scales[i]), the KV cache's codec (kv_fp8.cu,
// fp8_head_scale and f32_to_fp8_e4m3), so the host oracle is `attention::fp8::quantize_head`.
// The activations of cuBLASLt's FP8 GEMM, one factor per token.
extern "C" __global__ void quant_rows_fp8(const PAGODA_T* __restrict__ x,
                                          unsigned char* __restrict__ codes,
                                          float* __restrict__ scales, unsigned int k) {
    __shared__ unsigned int amax_bits;  // non-negative floats order as their bits
    const PAGODA_T* row = x + (size_t)blockIdx.x * k;
    if (threadIdx.x == 0) amax_bits = 0u;
    __syncthreads();
    float amax = 0.0f;
    for (unsigned int j = 4 * threadIdx.x; j < k; j += 4 * blockDim.x) {
#pragma unroll
        for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(to_f32(row[j + e])));
    }
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) atomicMax(&amax_bits, __float_as_uint(amax));
    __syncthreads();
    const float scale = fp8_head_scale(__uint_as_float(amax_bits));
    unsigned int* out = reinterpret_cast<unsigned int*>(codes + (size_t)blockIdx.x * k);
    for (unsigned int j = 4 * threadIdx.x; j < k; j += 4 * blockDim.x) {
        unsigned int word = 0u;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            word |= f32_to_fp8_e4m3(__fdiv_rn(to_f32(row[j + e]), scale)) << (8 * e);
        }
        out[j / 4] = word;
    }
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
}
#endif
