// The e4m3 KV cache's codec (prepended to the fp8 append, decode and prefill sources).
//
// A cached head of (token slot, KV head) is HEAD_DIM bytes plus one f32 scale in a parallel
// pool [num_pages, page_size, num_kv_heads]: scale = amax / 448 (amax over the head's values;
// 1 when that is 0 or below the smallest normal f32), byte i = e4m3(x_i / scale) rounded to
// nearest even and saturated to +-448, so x_i ~ scale * e4m3(byte i). No calibration, no
// overflow, and 0x7f / 0xff (e4m3's NaN) are never written. The CPU reference is
// `pagoda_ops::attention::fp8` (same rules, by table search).
#ifndef PAGODA_KV_FP8
#define PAGODA_KV_FP8 0
#endif
#define FP8_E4M3_MAX 448.0f

// A 4-byte cp.async (an f32 scale; zero-filled when !valid), through L1 (cp.async.cg takes
// 16-byte copies only).
PAGODA_DEVICE void cp_async4(void* shared_dst, const void* global_src, bool valid) {
    const unsigned int dst = (unsigned int)__cvta_generic_to_shared(shared_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(global_src),
                 "r"(valid ? 4 : 0));
}

// f32 to e4m3, round to nearest even, saturating to +-448 (NaN saturates too).
PAGODA_DEVICE unsigned int f32_to_fp8_e4m3(float x) {
    const unsigned int sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fminf(fabsf(x), FP8_E4M3_MAX);
    if (a < 0.015625f) return sign | (unsigned int)rintf(a * 512.0f);  // subnormal; 8 is 2^-6
    unsigned int bits = __float_as_uint(a);
    bits += 0x7ffffu + ((bits >> 20) & 1u);  // round the 20 dropped mantissa bits to even
    const unsigned int magnitude = (bits >> 20) - (120u << 3);
    return sign | min(magnitude, 0x7eu);
}

// Two e4m3 bytes, in bits 0-7 and 16-23 of x (the rest zero), to a bf16 pair, exactly: e4m3's
// sign, exponent and mantissa bits moved into a bf16's places make a bf16 whose exponent is
// biased by 127 instead of 7 (e4m3's subnormals becoming bf16's), so one multiply by 2^120 gives
// the value (bf16 arithmetic keeps subnormals; every e4m3 value is a bf16 normal or zero).
PAGODA_DEVICE unsigned int fp8x2_to_bf16x2(unsigned int x) {
    const unsigned int bits = ((x & 0x00800080u) << 8) | ((x & 0x007f007fu) << 4);
    const unsigned int two_120 = 0x7b807b80u;  // bf16 2^120, twice
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits),
                                     *reinterpret_cast<const __nv_bfloat162*>(&two_120));
    return *reinterpret_cast<const unsigned int*>(&v);
}

// Eight e4m3 bytes (w, lowest address first) to eight bf16 (16 bytes, same order).
PAGODA_DEVICE uint4 fp8x8_to_bf16x8(uint2 w) {
    return make_uint4(fp8x2_to_bf16x2(__byte_perm(w.x, 0u, 0x4140)), fp8x2_to_bf16x2(__byte_perm(w.x, 0u, 0x4342)),
                      fp8x2_to_bf16x2(__byte_perm(w.y, 0u, 0x4140)), fp8x2_to_bf16x2(__byte_perm(w.y, 0u, 0x4342)));
}

// The two values of a bf16 pair (fp8x2_to_bf16x2's) as f32: the low one first.
PAGODA_DEVICE float2 bf16x2_to_float2(unsigned int pair) {
    return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
}

// The scale of a head whose largest magnitude is amax.
PAGODA_DEVICE float fp8_head_scale(float amax) {
    const float scale = __fdiv_rn(amax, FP8_E4M3_MAX);
    return scale >= 1.17549435e-38f ? scale : 1.0f;
}

// One warp quantises one head of head_dim values: src -> dst bytes and *scale_out.
template <typename S>
PAGODA_DEVICE void fp8_quantize_head(const S* src, unsigned char* dst, float* scale_out,
                                     unsigned int head_dim) {
    const unsigned int lane = threadIdx.x & 31;
    float amax = 0.0f;
    for (unsigned int i = lane; i < head_dim; i += 32) amax = fmaxf(amax, fabsf(to_f32(src[i])));
    const float scale = fp8_head_scale(warp_max(amax));
    for (unsigned int i = lane; i < head_dim; i += 32) {
        dst[i] = (unsigned char)f32_to_fp8_e4m3(__fdiv_rn(to_f32(src[i]), scale));
    }
    if (lane == 0) *scale_out = scale;
}

// Token t's num_kv_heads K and V heads (k_src, v_src) into pool row `slot` of the byte pools
// and their scales, one warp per head (every thread of the block calls it).
template <typename S>
PAGODA_DEVICE void fp8_append_token(const S* k_src, const S* v_src, long long slot,
                                    unsigned char* k_pool, unsigned char* v_pool, float* k_scale,
                                    float* v_scale, unsigned int num_kv_heads,
                                    unsigned int head_dim) {
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int warps = blockDim.x >> 5;
    for (unsigned int job = warp; job < 2 * num_kv_heads; job += warps) {
        const bool is_v = job >= num_kv_heads;
        const unsigned int head = is_v ? job - num_kv_heads : job;
        const size_t row = (size_t)slot * num_kv_heads + head;
        const S* src = (is_v ? v_src : k_src) + (size_t)head * head_dim;
        unsigned char* dst = (is_v ? v_pool : k_pool) + row * head_dim;
        fp8_quantize_head(src, dst, (is_v ? v_scale : k_scale) + row, head_dim);
    }
}
