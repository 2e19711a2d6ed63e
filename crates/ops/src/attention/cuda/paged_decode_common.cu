// Shared by the fused paged decode kernels (paged_decode.cu: CUDA cores, paged_decode_mma.cu:
// tensor cores, paged_decode_stream.cu; after tensor_core.cu): the chunk a CTA serves, the log-sum-exp merge and the
// epilogue that turns a CTA's per-warp softmax states into the request's output or a partial.
//
// Pools: [num_pages, page_size, num_kv_heads, HEAD_DIM] per side; page_size a power of two.
// The plan (decode_plan.rs) cuts each request's pages into chunks; one CTA serves one
// (chunk, KV head) pair and all GROUP query heads of that KV head, so every K/V element is
// read once from memory and used GROUP times. Softmax in base 2.
//
// A request with one chunk is written to `out` directly. Otherwise each chunk writes its
// normalised partial and base-2 log-sum-exp, and either the last chunk of the request to
// finish merges them (merge_in_kernel: one launch, partials never leave L2) or
// merge_attention_partials does, afterwards.
typedef PAGODA_T T;
// The pools' element: T, or e4m3 bytes with PAGODA_KV_FP8 (kv_fp8.cu; CUDA-core and streaming kernels).
#if PAGODA_KV_FP8
typedef unsigned char KV_T;
#else
typedef T KV_T;
#endif
#define HEAD_DIM PAGODA_HEAD_DIM
#define GROUP PAGODA_GROUP
#define THREADS 128
#define WARPS (THREADS / 32)
#define PLAN_HEADER 4
// Chunks whose merge weights are staged in shared memory at a time.
#define MERGE_BLOCK 256
#define WEIGHTS_BYTES (GROUP * (MERGE_BLOCK + 3) * 4)
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
#define ELEMS_PER_THREAD ((GROUP * HEAD_DIM + THREADS - 1) / THREADS)

// Base-2 log-sum-exp statistics of partial rows begin..end of `head`, computed by one warp:
// the max LSE and 1 / sum 2^(lse - max) (0 when no partial is finite).
PAGODA_DEVICE void merge_stats(const float* lse, unsigned int begin, unsigned int end,
                               unsigned int num_heads, unsigned int head, float& max_lse,
                               float& inverse_sum) {
    const int lane = threadIdx.x & 31;
    float m = -INFINITY;
    for (unsigned int c = begin + lane; c < end; c += 32) {
        const float value = __ldcg(lse + (size_t)c * num_heads + head);
        if (value > -INFINITY) m = fmaxf(m, value);
    }
    m = warp_max(m);
    float sum = 0.0f;
    if (m > -INFINITY) {
        for (unsigned int c = begin + lane; c < end; c += 32) {
            const float value = __ldcg(lse + (size_t)c * num_heads + head);
            if (value > -INFINITY) sum += exp2f(value - m);
        }
    }
    sum = warp_sum(sum);
    max_lse = m;
    inverse_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
}

// Merges partial rows begin..end of `heads` (heads[g] for g < num_groups, one warp per
// group) into `values` (ELEMS elements per thread: element e = threadIdx.x + e * blockDim.x of
// the flattened [num_groups, HEAD_DIM] output), given each group's merge_stats in
// stats[2 * g] (max lse) and stats[2 * g + 1] (1 / sum). Weights are staged MERGE_BLOCK chunks
// at a time in `weights` ([num_groups][MERGE_BLOCK]); the loads of a block are independent,
// so they overlap. Every thread of the block must call this.
template <int ELEMS>
PAGODA_DEVICE void merge_partials_into(const float* partial, const float* lse, unsigned int begin,
                                       unsigned int end, unsigned int num_heads,
                                       const unsigned int* heads, unsigned int num_groups,
                                       const float* stats, float* weights, float (&values)[ELEMS]) {
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int lane = threadIdx.x & 31;
    const unsigned int warps = blockDim.x >> 5;
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) values[e] = 0.0f;
    for (unsigned int block = begin; block < end; block += MERGE_BLOCK) {
        const unsigned int count = min((unsigned int)MERGE_BLOCK, end - block);
        __syncthreads();
        for (unsigned int g = warp; g < num_groups; g += warps) {
            const float max_lse = stats[2 * g];
            const float inverse_sum = stats[2 * g + 1];
            for (unsigned int c = lane; c < count; c += 32) {
                const float l = __ldcg(lse + (size_t)(block + c) * num_heads + heads[g]);
                weights[g * MERGE_BLOCK + c] =
                    (l > -INFINITY && max_lse > -INFINITY) ? exp2f(l - max_lse) * inverse_sum : 0.0f;
            }
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) {
            const unsigned int idx = threadIdx.x + e * blockDim.x;
            if (idx >= num_groups * HEAD_DIM) break;
            const unsigned int g = idx / HEAD_DIM;
            const unsigned int d = idx % HEAD_DIM;
            const float* w = weights + g * MERGE_BLOCK;
            const float* p = partial + ((size_t)block * num_heads + heads[g]) * HEAD_DIM + d;
            const size_t stride = (size_t)num_heads * HEAD_DIM;
            float value = 0.0f;
#pragma unroll 8
            for (unsigned int c = 0; c < count; ++c) {
                const float wc = w[c];
                const float x = __ldcg(p + c * stride);
                value += wc != 0.0f ? wc * x : 0.0f;  // skips -inf (and NaN) partials
            }
            values[e] += value;
        }
    }
}

// Traps when the launch gave less dynamic shared memory than the kernel's layout needs (the
// launcher computes the size with the same formula; a mismatch must not corrupt memory).
PAGODA_DEVICE void require_dynamic_smem(unsigned int bytes) {
    unsigned int dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    if (dynamic_smem < bytes) __trap();
}

// The chunk a CTA serves: request r, its visible keys key_begin .. key_end (relative to the
// first visible token, which sits at row fpo of the request's first page), and the request's
// chunk range first .. first + count in the plan's o_indptr.
struct DecodeChunk {
    unsigned int r, first, count, page_begin;
    long long fpo, key_begin, key_end;
};

// Reads chunk `chunk` of the plan; false when the CTA has nothing to do (beyond the plan).
PAGODA_DEVICE bool load_chunk(const unsigned int* plan, unsigned int chunk, unsigned int max_chunks,
                              unsigned int num_requests, const unsigned int* kv_indptr,
                              const unsigned int* last_page_len, const unsigned int* first_page_offset,
                              unsigned int page_shift, DecodeChunk& c) {
    if (chunk >= plan[0]) return false;
    const unsigned int pages_per_chunk = plan[1];
    c.r = plan[PLAN_HEADER + chunk];
    const unsigned int tile = plan[PLAN_HEADER + max_chunks + chunk];
    if (c.r >= num_requests) return false;
    const unsigned int* o_indptr = plan + PLAN_HEADER + 2 * max_chunks;
    c.first = o_indptr[c.r];
    c.count = o_indptr[c.r + 1] - c.first;
    const unsigned int page_size = 1u << page_shift;
    c.page_begin = kv_indptr[c.r];
    const long long pages = (long long)kv_indptr[c.r + 1] - (long long)c.page_begin;
    const long long seq_len =
        max(0LL, paged_visible_len(kv_indptr, last_page_len, first_page_offset, c.r, page_size));
    c.fpo = pages > 0 ? (long long)first_page_offset[c.r] : 0;
    const long long chunk_page = (long long)tile * pages_per_chunk;
    c.key_begin = max(0LL, chunk_page * page_size - c.fpo);
    c.key_end = min(seq_len, (chunk_page + pages_per_chunk) * page_size - c.fpo);
    return true;
}

// Byte offset in a pool of visible key `key` (0 = the request's first visible token) for
// kv_head, and whether it is readable (before key_end and on a page < num_pages).
PAGODA_DEVICE bool key_offset(const DecodeChunk& c, const unsigned int* kv_indices, long long key,
                              unsigned int page_shift, unsigned int num_pages, size_t row_elems,
                              unsigned int kv_head, size_t& offset) {
    if (key >= c.key_end) return false;
    const long long abs = c.fpo + key;
    const unsigned int page = kv_indices[c.page_begin + (unsigned int)(abs >> page_shift)];
    if (page >= num_pages) return false;
    const size_t row = ((size_t)page << page_shift) + (size_t)(abs & ((1ll << page_shift) - 1));
    offset = (row * row_elems + (size_t)kv_head * HEAD_DIM) * sizeof(KV_T);
    return true;
}

// Queues the cp.async copies of tile t (keys key_begin + t * tile_keys ..) for kv_head: key
// row i lands at k_dst / v_dst + i * pitch_bytes, and valid[i] says whether it was readable
// (unreadable rows are zero-filled). Consecutive threads copy consecutive 16-byte chunks of a
// row (measured faster on the H200 than one page-table lookup per key and thread).
PAGODA_DEVICE void issue_tile(const DecodeChunk& c, const unsigned int* kv_indices, const KV_T* k_pool,
                              const KV_T* v_pool, int t, int tile_keys, unsigned int page_shift,
                              unsigned int num_pages, size_t row_elems, unsigned int kv_head,
                              unsigned char* k_dst, unsigned char* v_dst, int pitch_bytes,
                              unsigned char* valid) {
    constexpr int ROW_CHUNKS = HEAD_DIM * (int)sizeof(KV_T) / 16;
    for (int i = threadIdx.x; i < tile_keys * ROW_CHUNKS; i += THREADS) {
        const int key_local = i / ROW_CHUNKS;
        const int part = i % ROW_CHUNKS;
        size_t offset = 0;
        const bool readable = key_offset(c, kv_indices, c.key_begin + (long long)t * tile_keys + key_local,
                                         page_shift, num_pages, row_elems, kv_head, offset);
        const size_t dst = (size_t)key_local * pitch_bytes + part * 16;
        cp_async16(k_dst + dst, reinterpret_cast<const unsigned char*>(k_pool) + offset + part * 16, readable);
        cp_async16(v_dst + dst, reinterpret_cast<const unsigned char*>(v_pool) + offset + part * 16, readable);
        if (part == 0) valid[key_local] = readable;
    }
}

#if PAGODA_KV_FP8
// The fp8 pools' scales of tile t (keys as issue_tile's): key row i's K and V scales land at
// k_dst[i] / v_dst[i] (zeros where unreadable), in the same cp.async group as the tile.
PAGODA_DEVICE void issue_tile_scales(const DecodeChunk& c, const unsigned int* kv_indices,
                                     const float* k_scale, const float* v_scale, int t, int tile_keys,
                                     unsigned int page_shift, unsigned int num_pages, size_t row_elems,
                                     unsigned int kv_head, float* k_dst, float* v_dst) {
    for (int i = threadIdx.x; i < tile_keys; i += THREADS) {
        size_t offset = 0;
        const bool readable = key_offset(c, kv_indices, c.key_begin + (long long)t * tile_keys + i, page_shift,
                                         num_pages, row_elems, kv_head, offset);
        const size_t head_row = offset / HEAD_DIM;  // (slot * num_kv_heads + kv_head): one byte a value
        cp_async4(k_dst + i, k_scale + head_row, readable);
        cp_async4(v_dst + i, v_scale + head_row, readable);
    }
}
#endif

// The epilogue, after every warp published its softmax state for the GROUP heads: unnormalised
// accumulators s_acc[(w * rows_per_warp + g) * acc_pitch + d], maxima s_m[w * rows_per_warp + g]
// and sums s_l[...]. Combines the warps, writes `out` (one chunk) or the partial, and with
// merge_in_kernel lets the request's last chunk to finish merge them all. Every thread calls it.
PAGODA_DEVICE void finish_chunk(const DecodeChunk& c, unsigned int chunk, unsigned int kv_head,
                                unsigned int num_kv_heads, const float* s_acc, const float* s_m,
                                const float* s_l, int rows_per_warp, int acc_pitch, float* scratch,
                                T* out, float* partial_out, float* partial_lse,
                                unsigned int* semaphores, unsigned int merge_in_kernel) {
    __shared__ unsigned int s_last;
    const unsigned int tid = threadIdx.x;
    const unsigned int num_q_heads = num_kv_heads * GROUP;
    __syncthreads();
    for (unsigned int idx = tid; idx < GROUP * HEAD_DIM; idx += THREADS) {
        const unsigned int g = idx / HEAD_DIM;
        const unsigned int d = idx % HEAD_DIM;
        float total_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total_max = fmaxf(total_max, s_m[w * rows_per_warp + g]);
        float sum = 0.0f, value = 0.0f;
        if (total_max > -INFINITY) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float factor = exp2f(s_m[w * rows_per_warp + g] - total_max);
                sum += s_l[w * rows_per_warp + g] * factor;
                value += s_acc[(w * rows_per_warp + g) * acc_pitch + d] * factor;
            }
        }
        const float normalised = sum > 0.0f ? value / sum : 0.0f;
        const unsigned int head = kv_head * GROUP + g;
        if (c.count == 1) {
            out[((size_t)c.r * num_q_heads + head) * HEAD_DIM + d] = from_f32<T>(normalised);
        } else {
            const size_t row = (size_t)chunk * num_q_heads + head;
            partial_out[row * HEAD_DIM + d] = normalised;
            if (d == 0) partial_lse[row] = sum > 0.0f ? total_max + __log2f(sum) : -INFINITY;
        }
    }
    if (c.count == 1 || !merge_in_kernel) return;

    // The last chunk of (request, KV head) to finish merges every chunk's partial.
    __threadfence();
    __syncthreads();
    unsigned int* semaphore = semaphores + (size_t)c.r * num_kv_heads + kv_head;
    if (tid == 0) s_last = atomicAdd(semaphore, 1u) == c.count - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const unsigned int warp = tid / 32;
    float* s_stats = scratch;                    // [GROUP][2]
    unsigned int* s_heads = reinterpret_cast<unsigned int*>(scratch + 2 * GROUP); // [GROUP]
    float* s_weights = scratch + 3 * GROUP;      // [GROUP][MERGE_BLOCK]
    for (unsigned int g = warp; g < GROUP; g += WARPS) {
        float max_lse, inverse_sum;
        merge_stats(partial_lse, c.first, c.first + c.count, num_q_heads, kv_head * GROUP + g, max_lse,
                    inverse_sum);
        if ((tid & 31) == 0) {
            s_stats[2 * g] = max_lse;
            s_stats[2 * g + 1] = inverse_sum;
            s_heads[g] = kv_head * GROUP + g;
        }
    }
    float merged[ELEMS_PER_THREAD];
    merge_partials_into<ELEMS_PER_THREAD>(partial_out, partial_lse, c.first, c.first + c.count,
                                          num_q_heads, s_heads, GROUP, s_stats, s_weights, merged);
#pragma unroll
    for (int e = 0; e < ELEMS_PER_THREAD; ++e) {
        const unsigned int idx = tid + e * THREADS;
        if (idx >= GROUP * HEAD_DIM) break;
        const unsigned int head = kv_head * GROUP + idx / HEAD_DIM;
        out[((size_t)c.r * num_q_heads + head) * HEAD_DIM + idx % HEAD_DIM] = from_f32<T>(merged[e]);
    }
    if (tid == 0) *semaphore = 0;
}
