// Fused split-KV paged decode (flash-decoding over the CSR page table), and the generic
// log-sum-exp merge of attention partials.
//
// Pools: [num_pages, page_size, num_kv_heads, HEAD_DIM] per side; page_size a power of two.
// The plan (decode_plan.rs) cuts each request's pages into chunks; one CTA serves one
// (chunk, KV head) pair and all GROUP query heads of that KV head, so every K/V element is
// read once from memory and used GROUP times. K/V tiles stream into shared memory through a
// STAGES-deep cp.async pipeline. Thread t owns VEC head elements (dims (t % TX) * VEC ..) of
// key slot t / TX; a score is reduced over the TX threads of its key. Softmax in base 2.
//
// A request with one chunk is written to `out` directly. Otherwise each chunk writes its
// normalised partial and base-2 log-sum-exp, and either the last chunk of the request to
// finish merges them (merge_in_kernel: one launch, partials never leave L2) or
// merge_attention_partials does, afterwards.
typedef PAGODA_T T;
#define HEAD_DIM PAGODA_HEAD_DIM
#define GROUP PAGODA_GROUP
#define THREADS 128
#define WARPS (THREADS / 32)
#define VEC 8
#define TX (HEAD_DIM / VEC)
#define KEYS_PER_PASS (THREADS / TX)
#define ROW_BYTES (HEAD_DIM * (int)sizeof(T))
#define TILE_BYTES 8192
#define TILE_KEYS (ROW_BYTES * KEYS_PER_PASS >= TILE_BYTES ? KEYS_PER_PASS : TILE_BYTES / ROW_BYTES)
#define PASSES (TILE_KEYS / KEYS_PER_PASS)
#define STAGES 4
#define ROW_COPIES (ROW_BYTES / 16)
#define TILE_COPIES (TILE_KEYS * ROW_COPIES)
#define PIPE_BYTES (STAGES * 2 * TILE_KEYS * ROW_BYTES)
#define MERGE_BYTES (WARPS * GROUP * (HEAD_DIM + 2) * 4)
// Chunks whose merge weights are staged in shared memory at a time.
#define MERGE_BLOCK 256
#define WEIGHTS_BYTES (GROUP * (MERGE_BLOCK + 3) * 4)
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
// The dynamic shared memory the partial kernel needs (the launcher computes the same).
#define SMEM_BYTES MAX2(PIPE_BYTES, MAX2(MERGE_BYTES, WEIGHTS_BYTES))
#define PLAN_HEADER 4
#define ELEMS_PER_THREAD ((GROUP * HEAD_DIM + THREADS - 1) / THREADS)

static_assert(TX >= 1 && TX <= 32 && (TX & (TX - 1)) == 0, "HEAD_DIM / 8 must be a power of two <= 32");
static_assert(TILE_KEYS % KEYS_PER_PASS == 0, "tile keys");

PAGODA_DEVICE void cp_async16(void* shared_dst, const void* global_src, bool valid) {
    const unsigned int dst = (unsigned int)__cvta_generic_to_shared(shared_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src),
                 "r"(valid ? 16 : 0));
}
PAGODA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> PAGODA_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

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

// Grid (max_chunks, num_kv_heads), block THREADS. `plan`: see decode_plan.rs. q row r at
// r * q_row_stride (head h at h * HEAD_DIM); out [B, num_kv_heads * GROUP, HEAD_DIM].
// partial_out [max_chunks, num_q_heads, HEAD_DIM], partial_lse [max_chunks, num_q_heads];
// semaphores [max_requests * num_kv_heads], zero between launches (the merging CTA resets
// its own). Page ids >= num_pages are skipped.
extern "C" __global__ void __launch_bounds__(THREADS) paged_decode_partial(
    const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const unsigned int* __restrict__ kv_indptr, const unsigned int* __restrict__ kv_indices,
    const unsigned int* __restrict__ last_page_len, const unsigned int* __restrict__ first_page_offset,
    const unsigned int* __restrict__ plan, T* __restrict__ out, float* __restrict__ partial_out,
    float* __restrict__ partial_lse, unsigned int* __restrict__ semaphores,
    unsigned int num_requests, unsigned int max_chunks, unsigned int num_kv_heads,
    unsigned int page_shift, unsigned int num_pages, unsigned int q_row_stride, float scale_log2,
    unsigned int merge_in_kernel) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ unsigned char tile_valid[STAGES][TILE_KEYS];
    __shared__ unsigned int s_last;
    const unsigned int chunk = blockIdx.x;
    const unsigned int kv_head = blockIdx.y;
    if (chunk >= plan[0]) return;
    unsigned int dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    if (dynamic_smem < SMEM_BYTES) __trap();  // launched with less than the kernel needs
    const unsigned int pages_per_chunk = plan[1];
    const unsigned int r = plan[PLAN_HEADER + chunk];
    const unsigned int tile = plan[PLAN_HEADER + max_chunks + chunk];
    const unsigned int* o_indptr = plan + PLAN_HEADER + 2 * max_chunks;
    if (r >= num_requests) return;
    const unsigned int num_q_heads = num_kv_heads * GROUP;
    const unsigned int tid = threadIdx.x;
    const unsigned int ky = tid / TX;
    const unsigned int tx = tid % TX;
    const unsigned int page_size = 1u << page_shift;

    const unsigned int page_begin = kv_indptr[r];
    const long long pages = (long long)kv_indptr[r + 1] - (long long)page_begin;
    const long long seq_len =
        max(0LL, paged_visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size));
    const long long fpo = pages > 0 ? (long long)first_page_offset[r] : 0;
    const long long chunk_page = (long long)tile * pages_per_chunk;
    const long long key_begin = max(0LL, chunk_page * page_size - fpo);
    const long long key_end = min(seq_len, (chunk_page + pages_per_chunk) * page_size - fpo);
    const long long num_keys = max(0LL, key_end - key_begin);
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
        for (int c = tid; c < TILE_COPIES; c += THREADS) {
            const int key_local = c / ROW_COPIES;
            const int part = c % ROW_COPIES;
            const long long key = key_begin + (long long)t * TILE_KEYS + key_local;
            const long long abs = fpo + key;
            bool valid = key < key_end;
            unsigned int page = 0;
            if (valid) {
                page = kv_indices[page_begin + (unsigned int)(abs >> page_shift)];
                valid = page < num_pages;
            }
            const size_t row = valid ? (size_t)page * page_size + (size_t)(abs & (page_size - 1)) : 0;
            const size_t offset = (row * row_elems + (size_t)kv_head * HEAD_DIM) * sizeof(T) + part * 16;
            const size_t dst = ((size_t)stage * TILE_KEYS + key_local) * ROW_BYTES + part * 16;
            cp_async16(k_stage + dst, reinterpret_cast<const unsigned char*>(k_pool) + offset, valid);
            cp_async16(v_stage + dst, reinterpret_cast<const unsigned char*>(v_pool) + offset, valid);
            if (part == 0) tile_valid[stage][key_local] = valid;
        }
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
            load_vec(k_stage + ((size_t)stage * TILE_KEYS + key_local) * ROW_BYTES + tx * VEC * sizeof(T), kv);
            const bool valid = tile_valid[stage][key_local];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < VEC; ++i) s += qv[g][i] * kv[i];
#pragma unroll
                for (int offset = TX / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
                scores[p][g] = valid ? s : -INFINITY;
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
            load_vec(v_stage + ((size_t)stage * TILE_KEYS + key_local) * ROW_BYTES + tx * VEC * sizeof(T), vv);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float w = scores[p][g] == -INFINITY ? 0.0f : exp2f(scores[p][g] - m[g]);
                l[g] += w;
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[g][i] += w * vv[i];
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
    __syncthreads();
    const unsigned int first = o_indptr[r];
    const unsigned int count = o_indptr[r + 1] - first;
    for (unsigned int idx = tid; idx < GROUP * HEAD_DIM; idx += THREADS) {
        const unsigned int g = idx / HEAD_DIM;
        const unsigned int d = idx % HEAD_DIM;
        float total_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total_max = fmaxf(total_max, s_m[w * GROUP + g]);
        float sum = 0.0f, value = 0.0f;
        if (total_max > -INFINITY) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float factor = exp2f(s_m[w * GROUP + g] - total_max);
                sum += s_l[w * GROUP + g] * factor;
                value += s_acc[(w * GROUP + g) * HEAD_DIM + d] * factor;
            }
        }
        const float normalised = sum > 0.0f ? value / sum : 0.0f;
        const unsigned int head = kv_head * GROUP + g;
        if (count == 1) {
            out[((size_t)r * num_q_heads + head) * HEAD_DIM + d] = from_f32<T>(normalised);
        } else {
            const size_t row = (size_t)chunk * num_q_heads + head;
            partial_out[row * HEAD_DIM + d] = normalised;
            if (d == 0) partial_lse[row] = sum > 0.0f ? total_max + __log2f(sum) : -INFINITY;
        }
    }
    if (count == 1 || !merge_in_kernel) return;

    // The last chunk of (request, KV head) to finish merges every chunk's partial.
    __threadfence();
    __syncthreads();
    unsigned int* semaphore = semaphores + (size_t)r * num_kv_heads + kv_head;
    if (tid == 0) s_last = atomicAdd(semaphore, 1u) == count - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    float* s_stats = s_acc;                    // [GROUP][2]
    unsigned int* s_heads = reinterpret_cast<unsigned int*>(s_acc + 2 * GROUP); // [GROUP]
    float* s_weights = s_acc + 3 * GROUP;      // [GROUP][MERGE_BLOCK]
    for (unsigned int g = warp; g < GROUP; g += WARPS) {
        float max_lse, inverse_sum;
        merge_stats(partial_lse, first, first + count, num_q_heads, kv_head * GROUP + g, max_lse, inverse_sum);
        if ((tid & 31) == 0) {
            s_stats[2 * g] = max_lse;
            s_stats[2 * g + 1] = inverse_sum;
            s_heads[g] = kv_head * GROUP + g;
        }
    }
    float merged[ELEMS_PER_THREAD];
    merge_partials_into<ELEMS_PER_THREAD>(partial_out, partial_lse, first, first + count, num_q_heads,
                                          s_heads, GROUP, s_stats, s_weights, merged);
#pragma unroll
    for (int e = 0; e < ELEMS_PER_THREAD; ++e) {
        const unsigned int idx = tid + e * THREADS;
        if (idx >= GROUP * HEAD_DIM) break;
        const unsigned int head = kv_head * GROUP + idx / HEAD_DIM;
        out[((size_t)r * num_q_heads + head) * HEAD_DIM + idx % HEAD_DIM] = from_f32<T>(merged[e]);
    }
    if (tid == 0) *semaphore = 0;
}

// Generic merge: output row o (of num_rows) and head h combine partial rows
// o_indptr[o] .. o_indptr[o + 1] by their base-2 log-sum-exps; -inf (or NaN) partials are
// skipped and a row with none finite becomes zeros (lse_out -inf). With skip_single, rows
// of exactly one partial are left alone (the partial kernel wrote them). Associative: the
// merged lse_out (nullable) can be merged again. Grid (num_rows, num_heads), block 128.
// partial [N, num_heads, HEAD_DIM] f32, lse [N, num_heads] f32, out [num_rows, num_heads, HEAD_DIM].
extern "C" __global__ void merge_attention_partials(
    const float* __restrict__ partial, const float* __restrict__ lse,
    const unsigned int* __restrict__ o_indptr, T* __restrict__ out, float* __restrict__ lse_out,
    unsigned int skip_single) {
    __shared__ float s_stats[2];
    __shared__ unsigned int s_head[1];
    __shared__ float s_weights[MERGE_BLOCK];
    const unsigned int o = blockIdx.x;
    const unsigned int head = blockIdx.y;
    const unsigned int num_heads = gridDim.y;
    const unsigned int begin = o_indptr[o];
    const unsigned int end = max(begin, o_indptr[o + 1]);
    if (skip_single && end - begin == 1) return;
    if (threadIdx.x < 32) {
        float max_lse, inverse_sum;
        merge_stats(lse, begin, end, num_heads, head, max_lse, inverse_sum);
        if (threadIdx.x == 0) {
            s_stats[0] = max_lse;
            s_stats[1] = inverse_sum;
            s_head[0] = head;
            if (lse_out != nullptr) {
                lse_out[(size_t)o * num_heads + head] =
                    inverse_sum > 0.0f ? max_lse - __log2f(inverse_sum) : -INFINITY;
            }
        }
    }
    __syncthreads();
    constexpr int ELEMS = (HEAD_DIM + 127) / 128;
    float values[ELEMS];
    merge_partials_into<ELEMS>(partial, lse, begin, end, num_heads, s_head, 1, s_stats, s_weights, values);
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) {
        const unsigned int d = threadIdx.x + e * blockDim.x;
        if (d < HEAD_DIM) out[((size_t)o * num_heads + head) * HEAD_DIM + d] = from_f32<T>(values[e]);
    }
}
