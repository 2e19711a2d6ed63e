// MLA absorbed attention on CUDA cores (after tensor_core.cu and mla_common.cu): the split-KV
// decode partial (every dtype; the f32 exact path) and the causal prefill (one CTA per query
// token and head tile, no split).
//
// A CTA of CC_WARPS warps serves HEAD_TILE heads, HEADS_PER_WARP per warp. Latent rows stream
// through shared memory (CC_STAGES tiles of CC_TILE_KEYS rows, cp.async) and every warp reads
// every row: lane l owns dims l + 32 i of the row (conflict-free shared reads), so a score is
// a warp reduction and the lane accumulates the output dims l + 32 i (i < LATENT_DIM / 32).
// The latent dims come first in a row, so x[i] for i < LATENT_DIM / 32 is also the value.
#define CC_THREADS 256
#define CC_WARPS (CC_THREADS / 32)
#define HEADS_PER_WARP (HEAD_TILE / CC_WARPS)
#define LANE_ROW (ROW_DIM / 32)
#define LANE_LATENT (LATENT_DIM / 32)
#define CC_TILE_KEYS 16
#define CC_STAGES 2
// The dynamic shared memory of both kernels (the launcher computes the same).
#define CC_SMEM_BYTES (CC_STAGES * CC_TILE_KEYS * ROW_BYTES)

static_assert(HEAD_TILE % CC_WARPS == 0, "whole heads per warp");

// Runs the keys of `c` for this warp's heads (q_tile: head 0 of the CTA's tile, ROW_DIM per
// head) and leaves their softmax state: max m, sum l and the unnormalised output acc (dims
// lane + 32 i). Every thread of the CTA calls it.
PAGODA_DEVICE void attend_cuda_core(const LatentChunk& c, const T* q_tile, const unsigned int* kv_indices,
                                    const T* pool, unsigned int page_shift, unsigned int num_pages,
                                    float scale_log2, unsigned char* smem,
                                    unsigned char (&valid)[CC_STAGES][CC_TILE_KEYS],
                                    float (&m)[HEADS_PER_WARP], float (&l)[HEADS_PER_WARP],
                                    float (&acc)[HEADS_PER_WARP][LANE_LATENT]) {
    const unsigned int warp = threadIdx.x / 32;
    const unsigned int lane = threadIdx.x % 32;
    float qv[HEADS_PER_WARP][LANE_ROW];
#pragma unroll
    for (int h = 0; h < HEADS_PER_WARP; ++h) {
        const T* src = q_tile + (size_t)(warp * HEADS_PER_WARP + h) * ROW_DIM;
#pragma unroll
        for (int i = 0; i < LANE_ROW; ++i) qv[h][i] = to_f32(src[lane + 32 * i]) * scale_log2;
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < LANE_LATENT; ++i) acc[h][i] = 0.0f;
    }
    const long long num_keys = max(0LL, c.key_end - c.key_begin);
    const int num_tiles = (int)((num_keys + CC_TILE_KEYS - 1) / CC_TILE_KEYS);
    auto issue = [&](int t) {
        const int stage = t % CC_STAGES;
        issue_latent_tile(c, kv_indices, pool, c.key_begin + (long long)t * CC_TILE_KEYS, CC_TILE_KEYS,
                          page_shift, num_pages, smem + (size_t)stage * CC_TILE_KEYS * ROW_BYTES,
                          ROW_BYTES, valid[stage], CC_THREADS);
    };
#pragma unroll
    for (int s = 0; s < CC_STAGES - 1; ++s) {
        if (s < num_tiles) issue(s);
        cp_async_commit();
    }
    for (int t = 0; t < num_tiles; ++t) {
        cp_async_wait<CC_STAGES - 2>();
        __syncthreads();
        if (t + CC_STAGES - 1 < num_tiles) issue(t + CC_STAGES - 1);
        cp_async_commit();
        const int stage = t % CC_STAGES;
        const T* tile = reinterpret_cast<const T*>(smem + (size_t)stage * CC_TILE_KEYS * ROW_BYTES);
        // Key by key (online softmax per key: a rescale only when the maximum moves, and
        // few registers live, so the kernel does not spill).
#pragma unroll 2
        for (int k = 0; k < CC_TILE_KEYS; ++k) {
            if (!valid[stage][k]) continue;  // the same for the whole CTA
            const T* row = tile + k * ROW_DIM;
            float x[LANE_ROW];
#pragma unroll
            for (int i = 0; i < LANE_ROW; ++i) x[i] = to_f32(row[lane + 32 * i]);
#pragma unroll
            for (int h = 0; h < HEADS_PER_WARP; ++h) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < LANE_ROW; ++i) s += qv[h][i] * x[i];
                s = warp_sum(s);
                const float new_max = fmaxf(m[h], s);
                const float correction = exp2f(m[h] - new_max);
                const float w = exp2f(s - new_max);
                l[h] = l[h] * correction + w;
#pragma unroll
                for (int i = 0; i < LANE_LATENT; ++i) acc[h][i] = acc[h][i] * correction + w * x[i];
                m[h] = new_max;
            }
        }
    }
    cp_async_wait<0>();
}

// Grid (max_chunks * head_tiles), block CC_THREADS, CC_SMEM_BYTES of dynamic shared memory.
// q row r (of B) at r * q_row_stride, head h at h * ROW_DIM; out [B, num_heads, LATENT_DIM];
// partial_out [max_chunks, num_heads, LATENT_DIM] f32, partial_lse [max_chunks, num_heads]
// (merged afterwards by merge_attention_partials at HEAD_DIM = LATENT_DIM).
extern "C" __global__ void __launch_bounds__(CC_THREADS) mla_decode_partial(
    const T* __restrict__ q, const T* __restrict__ pool, const unsigned int* __restrict__ kv_indptr,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, const unsigned int* __restrict__ plan,
    T* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_lse,
    unsigned int num_requests, unsigned int max_chunks, unsigned int num_heads, unsigned int page_shift,
    unsigned int num_pages, unsigned int q_row_stride, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ unsigned char valid[CC_STAGES][CC_TILE_KEYS];
    const unsigned int head_tiles = num_heads / HEAD_TILE;
    const unsigned int chunk = blockIdx.x / head_tiles;
    const unsigned int head0 = (blockIdx.x % head_tiles) * HEAD_TILE;
    LatentChunk c;
    if (!load_latent_chunk(plan, chunk, max_chunks, num_requests, kv_indptr, last_page_len,
                           first_page_offset, page_shift, c))
        return;
    float m[HEADS_PER_WARP], l[HEADS_PER_WARP], acc[HEADS_PER_WARP][LANE_LATENT];
    attend_cuda_core(c, q + (size_t)c.r * q_row_stride + (size_t)head0 * ROW_DIM, kv_indices, pool,
                     page_shift, num_pages, scale_log2, smem, valid, m, l, acc);
    const unsigned int lane = threadIdx.x % 32;
#pragma unroll
    for (int h = 0; h < HEADS_PER_WARP; ++h) {
        const unsigned int head = head0 + (threadIdx.x / 32) * HEADS_PER_WARP + h;
#pragma unroll
        for (int i = 0; i < LANE_LATENT; ++i)
            store_latent_output(c, chunk, num_heads, head, lane + 32 * i, acc[h][i], m[h], l[h], out,
                                partial_out, partial_lse);
    }
}

// Causal ragged prefill: grid (num_tokens, head_tiles), block CC_THREADS, CC_SMEM_BYTES.
// Token t of request r (qo_indptr [B + 1]; q_len queries, seq_len visible tokens, queries
// already appended) is query j = t - qo_indptr[r] and attends to visible tokens
// 0 ..= seq_len - q_len + j. q rows q_row_stride apart; out [num_tokens, num_heads,
// LATENT_DIM]; tokens outside qo_indptr (or with nothing visible) get zeros.
extern "C" __global__ void __launch_bounds__(CC_THREADS) mla_prefill(
    const T* __restrict__ q, const T* __restrict__ pool, const unsigned int* __restrict__ kv_indptr,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, const unsigned int* __restrict__ qo_indptr,
    T* __restrict__ out, unsigned int num_requests, unsigned int num_heads, unsigned int page_shift,
    unsigned int num_pages, unsigned int q_row_stride, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ unsigned char valid[CC_STAGES][CC_TILE_KEYS];
    const unsigned int token = blockIdx.x;
    const unsigned int head0 = blockIdx.y * HEAD_TILE;
    // The request of this token: the last r with qo_indptr[r] <= token (binary search).
    unsigned int lo = 0, hi = num_requests;
    while (hi - lo > 1) {
        const unsigned int mid = (lo + hi) / 2;
        if (qo_indptr[mid] <= token) lo = mid; else hi = mid;
    }
    const unsigned int r = lo;
    LatentChunk c;
    c.r = token;  // the output row
    c.first = 0;
    c.count = 1;
    c.page_begin = kv_indptr[r];
    c.fpo = kv_indptr[r + 1] > kv_indptr[r] ? (long long)first_page_offset[r] : 0;
    c.key_begin = 0;
    c.key_end = 0;
    if (token >= qo_indptr[0] && token < qo_indptr[num_requests]) {
        const long long q_len = (long long)qo_indptr[r + 1] - (long long)qo_indptr[r];
        const long long seq_len = paged_visible_len(kv_indptr, last_page_len, first_page_offset, r,
                                                    1u << page_shift);
        c.key_end = max(0LL, seq_len - q_len + (long long)(token - qo_indptr[r]) + 1);
    }
    float m[HEADS_PER_WARP], l[HEADS_PER_WARP], acc[HEADS_PER_WARP][LANE_LATENT];
    attend_cuda_core(c, q + (size_t)token * q_row_stride + (size_t)head0 * ROW_DIM, kv_indices, pool,
                     page_shift, num_pages, scale_log2, smem, valid, m, l, acc);
    const unsigned int lane = threadIdx.x % 32;
#pragma unroll
    for (int h = 0; h < HEADS_PER_WARP; ++h) {
        const unsigned int head = head0 + (threadIdx.x / 32) * HEADS_PER_WARP + h;
#pragma unroll
        for (int i = 0; i < LANE_LATENT; ++i)
            store_latent_output(c, 0, num_heads, head, lane + 32 * i, acc[h][i], m[h], l[h], out,
                                nullptr, nullptr);
    }
}
