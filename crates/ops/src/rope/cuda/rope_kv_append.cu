// RoPE and the KV append in one launch (the fusion of rope.cu and kv_append.cu for a fused
// QKV buffer): token t's row of x holds num_q_heads q heads, then num_kv_heads k heads, then
// num_kv_heads v heads, each head_dim wide; rows are row_stride elements apart.
//   1. q and k heads rotate in place exactly as `rope` does (the same per-pair sincosf and
//      arithmetic, so the same bits);
//   2. after a block barrier (the rotated k is then visible to every thread of the block),
//      the token's k and v rows are copied to pool row slots[t] as `kv_append` does
//      (negative slots and slots >= num_slots skipped: padding rows).
// PAGODA_ROPE_HALVES as in rope.cu. One block per token. With PAGODA_KV_FP8 (kv_fp8.cu
// prepended) step 2 writes e4m3 bytes and one f32 scale per (slot, KV head) as kv_append_fp8
// does (entry rope_kv_append_fp8, the scale pools last).
typedef PAGODA_T T;
#if PAGODA_KV_FP8
typedef unsigned char POOL_T;
#define ROPE_KV_APPEND rope_kv_append_fp8
#else
typedef T POOL_T;
#define ROPE_KV_APPEND rope_kv_append
#endif

extern "C" __global__ void ROPE_KV_APPEND(T* __restrict__ x, const unsigned int* __restrict__ positions,
                                          const float* __restrict__ inv_freq,
                                          const int* __restrict__ slots, POOL_T* __restrict__ k_pool,
                                          POOL_T* __restrict__ v_pool, unsigned int num_q_heads,
                                          unsigned int num_kv_heads, unsigned int head_dim,
                                          unsigned int rope_dim, unsigned int row_stride,
                                          long long num_slots
#if PAGODA_KV_FP8
                                          , float* __restrict__ k_scale, float* __restrict__ v_scale
#endif
                                          ) {
    const unsigned int token = blockIdx.x;
    const unsigned int half = rope_dim / 2;
    const unsigned int heads_per_pass = blockDim.x / half;
    const unsigned int i = threadIdx.x % half;
    const unsigned int first_head = threadIdx.x / half;
    const unsigned int rotated_heads = num_q_heads + num_kv_heads;
    T* row = x + (size_t)token * row_stride;
    if (first_head < heads_per_pass) {  // not the block's last partial group of pairs
        const float position = (float)positions[token];
        float s, c;
        sincosf(position * inv_freq[i], &s, &c);
#if PAGODA_ROPE_HALVES
        const unsigned int a = i, b = i + half;
#else
        const unsigned int a = 2 * i, b = 2 * i + 1;
#endif
#pragma unroll 4
        for (unsigned int head = first_head; head < rotated_heads; head += heads_per_pass) {
            T* h = row + (size_t)head * head_dim;
            const float x0 = to_f32(h[a]);
            const float x1 = to_f32(h[b]);
            h[a] = from_f32<T>(x0 * c - x1 * s);
            h[b] = from_f32<T>(x0 * s + x1 * c);
        }
    }
    __syncthreads();
    const long long slot = slots[token];
    if (slot < 0 || slot >= num_slots) return;
    const unsigned int token_stride = num_kv_heads * head_dim;
    const T* k_src = row + (size_t)num_q_heads * head_dim;
    const T* v_src = k_src + token_stride;
#if PAGODA_KV_FP8
    fp8_append_token(k_src, v_src, slot, k_pool, v_pool, k_scale, v_scale, num_kv_heads, head_dim);
#else
    T* k_dst = k_pool + (size_t)slot * token_stride;
    T* v_dst = v_pool + (size_t)slot * token_stride;
    for (unsigned int e = threadIdx.x; e < token_stride; e += blockDim.x) {
        k_dst[e] = k_src[e];
        v_dst[e] = v_src[e];
    }
#endif
}
