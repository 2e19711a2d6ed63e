// The fused split-KV paged decode on CUDA cores, and the generic log-sum-exp merge of attention
// partials (prepended: paged_decode_common.cu).
//
// K/V tiles stream into shared memory through a STAGES-deep cp.async pipeline. Thread t owns
// VEC head elements (dims (t % TX) * VEC ..) of key slot t / TX; a score is reduced over the TX
// threads of its key. Every dtype (f32, bf16, f16). With PAGODA_KV_FP8 the pools hold e4m3
// bytes (kv_fp8.cu) and their per-(slot, KV head) scales ride along in shared memory: a
// score is scale_k * (q . k8), a value weight p * scale_v.
#define VEC 8
#define TX (HEAD_DIM / VEC)
#define KEYS_PER_PASS (THREADS / TX)
#define ROW_BYTES (HEAD_DIM * (int)sizeof(KV_T))
#define TILE_BYTES 8192
#define TILE_KEYS (ROW_BYTES * KEYS_PER_PASS >= TILE_BYTES ? KEYS_PER_PASS : TILE_BYTES / ROW_BYTES)
#define PASSES (TILE_KEYS / KEYS_PER_PASS)
#define STAGES 4
#define PIPE_BYTES (STAGES * 2 * TILE_KEYS * ROW_BYTES)
#define MERGE_BYTES (WARPS * GROUP * (HEAD_DIM + 2) * 4)
// The dynamic shared memory the partial kernel needs (the launcher computes the same).
#define SMEM_BYTES MAX2(PIPE_BYTES, MAX2(MERGE_BYTES, WEIGHTS_BYTES))

static_assert(TX >= 1 && TX <= 32 && (TX & (TX - 1)) == 0, "HEAD_DIM / 8 must be a power of two <= 32");
static_assert(TILE_KEYS % KEYS_PER_PASS == 0, "tile keys");

#if PAGODA_KV_FP8
// Eight e4m3 bytes widened two at a time (kv_fp8.cu's exact bf16 pairs, then f32 by shifts).
PAGODA_DEVICE void load_vec(const unsigned char* row, float (&out)[VEC]) {
    const uint4 wide = fp8x8_to_bf16x8(*reinterpret_cast<const uint2*>(row));
    const unsigned int pairs[4] = {wide.x, wide.y, wide.z, wide.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 two = bf16x2_to_float2(pairs[j]);
        out[2 * j] = two.x;
        out[2 * j + 1] = two.y;
    }
}
#else
PAGODA_DEVICE void load_vec(const unsigned char* row, float (&out)[VEC]) {
    const T* e = reinterpret_cast<const T*>(row);
#pragma unroll
    for (int c = 0; c < VEC * (int)sizeof(T) / 16; ++c) {
        const uint4 word = reinterpret_cast<const uint4*>(row)[c];
        const T* w = reinterpret_cast<const T*>(&word);
#pragma unroll
        for (int j = 0; j < 16 / (int)sizeof(T); ++j) out[c * (16 / (int)sizeof(T)) + j] = to_f32(w[j]);
    }
    (void)e;
}
#endif

// Grid (max_chunks, num_kv_heads), block THREADS. `plan`: see decode_plan.rs. q row r at
// r * q_row_stride (head h at h * HEAD_DIM); out [B, num_kv_heads * GROUP, HEAD_DIM].
// partial_out [max_chunks, num_q_heads, HEAD_DIM], partial_lse [max_chunks, num_q_heads];
// semaphores [max_requests * num_kv_heads], zero between launches (the merging CTA resets
// its own). Page ids >= num_pages are skipped.
extern "C" __global__ void __launch_bounds__(THREADS) paged_decode_partial(
    const T* __restrict__ q, const KV_T* __restrict__ k_pool, const KV_T* __restrict__ v_pool,
    const unsigned int* __restrict__ kv_indptr, const unsigned int* __restrict__ kv_indices,
    const unsigned int* __restrict__ last_page_len, const unsigned int* __restrict__ first_page_offset,
    const unsigned int* __restrict__ plan, T* __restrict__ out, float* __restrict__ partial_out,
    float* __restrict__ partial_lse, unsigned int* __restrict__ semaphores,
    unsigned int num_requests, unsigned int max_chunks, unsigned int num_kv_heads,
    unsigned int page_shift, unsigned int num_pages, unsigned int q_row_stride, float scale_log2,
    unsigned int merge_in_kernel
#if PAGODA_KV_FP8
    , const float* __restrict__ k_scale, const float* __restrict__ v_scale
#endif
    ) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ unsigned char tile_valid[STAGES][TILE_KEYS];
#if PAGODA_KV_FP8
    __shared__ __align__(16) float tile_scales[2][STAGES][TILE_KEYS];  // [K | V][stage][key]
#endif
    const unsigned int chunk = blockIdx.x;
    const unsigned int kv_head = blockIdx.y;
    DecodeChunk c;
    if (!load_chunk(plan, chunk, max_chunks, num_requests, kv_indptr, last_page_len, first_page_offset,
                    page_shift, c))
        return;
    require_dynamic_smem(SMEM_BYTES);
    const unsigned int r = c.r;
    const unsigned int tid = threadIdx.x;
    const unsigned int ky = tid / TX;
    const unsigned int tx = tid % TX;
    const long long num_keys = max(0LL, c.key_end - c.key_begin);
    const int num_tiles = (int)((num_keys + TILE_KEYS - 1) / TILE_KEYS);

    float qv[GROUP][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const T* src = q + (size_t)r * q_row_stride + (size_t)(kv_head * GROUP + g) * HEAD_DIM + tx * VEC;
#pragma unroll
        for (int i = 0; i < VEC; ++i) qv[g][i] = to_f32(src[i]) * scale_log2;
    }

    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;
    unsigned char* k_stage = smem;
    unsigned char* v_stage = smem + STAGES * TILE_KEYS * ROW_BYTES;
    auto issue = [&](int t) {
        const int stage = t % STAGES;
        issue_tile(c, kv_indices, k_pool, v_pool, t, TILE_KEYS, page_shift, num_pages, row_elems, kv_head,
                   k_stage + (size_t)stage * TILE_KEYS * ROW_BYTES, v_stage + (size_t)stage * TILE_KEYS * ROW_BYTES,
                   ROW_BYTES, tile_valid[stage]);
#if PAGODA_KV_FP8
        issue_tile_scales(c, kv_indices, k_scale, v_scale, t, TILE_KEYS, page_shift, num_pages, row_elems,
                          kv_head, tile_scales[0][stage], tile_scales[1][stage]);
#endif
    };

    float m[GROUP], l[GROUP], acc[GROUP][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = 0.0f;
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_tiles) issue(s);
        cp_async_commit();
    }
    for (int t = 0; t < num_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (t + STAGES - 1 < num_tiles) issue(t + STAGES - 1);
        cp_async_commit();
        const int stage = t % STAGES;
        float scores[PASSES][GROUP];
        float tile_max[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) tile_max[g] = -INFINITY;
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            const int key_local = p * KEYS_PER_PASS + ky;
            float kv[VEC];
            load_vec(k_stage + ((size_t)stage * TILE_KEYS + key_local) * ROW_BYTES + tx * VEC * sizeof(KV_T), kv);
            const bool valid = tile_valid[stage][key_local];
#if PAGODA_KV_FP8
            const float key_scale = tile_scales[0][stage][key_local];
#else
            const float key_scale = 1.0f;
#endif
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < VEC; ++i) s += qv[g][i] * kv[i];
#pragma unroll
                for (int offset = TX / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
                scores[p][g] = valid ? s * key_scale : -INFINITY;
                tile_max[g] = fmaxf(tile_max[g], scores[p][g]);
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float new_max = fmaxf(m[g], tile_max[g]);
            if (new_max == -INFINITY) continue;
            const float correction = exp2f(m[g] - new_max);
            l[g] *= correction;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[g][i] *= correction;
            m[g] = new_max;
        }
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            const int key_local = p * KEYS_PER_PASS + ky;
            float vv[VEC];
            load_vec(v_stage + ((size_t)stage * TILE_KEYS + key_local) * ROW_BYTES + tx * VEC * sizeof(KV_T), vv);
#if PAGODA_KV_FP8
            const float value_scale = tile_scales[1][stage][key_local];
#else
            const float value_scale = 1.0f;
#endif
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float w = scores[p][g] == -INFINITY ? 0.0f : exp2f(scores[p][g] - m[g]);
                l[g] += w;
                const float wv = w * value_scale;
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[g][i] += wv * vv[i];
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Merge the key slots of each warp (butterfly over lanes TX apart), then the warps.
#pragma unroll
    for (int offset = TX; offset < 32; offset <<= 1) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float m_other = __shfl_xor_sync(0xffffffffu, m[g], offset);
            const float l_other = __shfl_xor_sync(0xffffffffu, l[g], offset);
            const float new_max = fmaxf(m[g], m_other);
            const float a = new_max == -INFINITY ? 0.0f : exp2f(m[g] - new_max);
            const float b = new_max == -INFINITY ? 0.0f : exp2f(m_other - new_max);
            l[g] = l[g] * a + l_other * b;
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                const float other = __shfl_xor_sync(0xffffffffu, acc[g][i], offset);
                acc[g][i] = acc[g][i] * a + other * b;
            }
            m[g] = new_max;
        }
    }
    float* s_acc = reinterpret_cast<float*>(smem);                  // [WARPS][GROUP][HEAD_DIM]
    float* s_m = s_acc + WARPS * GROUP * HEAD_DIM;                   // [WARPS][GROUP]
    float* s_l = s_m + WARPS * GROUP;                                // [WARPS][GROUP]
    const unsigned int warp = tid / 32;
    if ((tid & 31) < TX) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) s_acc[(warp * GROUP + g) * HEAD_DIM + tx * VEC + i] = acc[g][i];
            if (tx == 0) {
                s_m[warp * GROUP + g] = m[g];
                s_l[warp * GROUP + g] = l[g];
            }
        }
    }
    finish_chunk(c, chunk, kv_head, num_kv_heads, s_acc, s_m, s_l, GROUP, HEAD_DIM, s_acc, out,
                 partial_out, partial_lse, semaphores, merge_in_kernel);
}

