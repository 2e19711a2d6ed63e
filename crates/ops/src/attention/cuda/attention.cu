// Attention over the paged KV cache, flash-style (online softmax, base 2).
//
// Pool layout per side: [num_pages, page_size, num_kv_heads, HEAD_DIM]; the CSR page table
// is FlashInfer's: request r owns pages kv_indices[kv_indptr[r] .. kv_indptr[r+1]], its
// visible tokens start at row first_page_offset[r] of its first page and end after row
// last_page_len[r] - 1 of its last page.
//
// A CTA serves one KV head and all query heads of its group: warp w is
// query head kv_head * n_rep + w (n_rep = blockDim.x / 32). K/V tiles of TILE keys are
// staged in shared memory as f32 and shared by the group's warps. Lane l owns dims
// l, l + 32, ... of its head. PAGODA_HEAD_DIM is a multiple of 32, at most 256.
typedef PAGODA_T T;
#define HEAD_DIM PAGODA_HEAD_DIM
#define DIMS_PER_LANE (HEAD_DIM / 32)
#define TILE 16

struct GroupState {
    float acc[DIMS_PER_LANE];
    float max_score;
    float sum_weights;
};

// Attends the warp's query (q_head, already loaded scaled into q) to keys 0..num_keys, whose
// pool rows row_of(key) returns (negative: skip the key). `row_elems` = num_kv_heads * HEAD_DIM.
template <typename RowFn>
PAGODA_DEVICE void attend_group(const float (&q)[DIMS_PER_LANE], const T* __restrict__ k_rows,
                                const T* __restrict__ v_rows, size_t row_elems,
                                unsigned int kv_head, long long num_keys, RowFn row_of,
                                GroupState& state) {
    __shared__ float k_tile[TILE][HEAD_DIM];
    __shared__ float v_tile[TILE][HEAD_DIM];
    __shared__ long long tile_rows[TILE];
    const int lane = threadIdx.x & 31;
    for (long long start = 0; start < num_keys; start += TILE) {
        const int count = (int)min((long long)TILE, num_keys - start);
        __syncthreads();
        if (threadIdx.x < TILE) {
            tile_rows[threadIdx.x] = (int)threadIdx.x < count ? row_of(start + threadIdx.x) : -1;
        }
        __syncthreads();
        for (unsigned int idx = threadIdx.x; idx < TILE * HEAD_DIM; idx += blockDim.x) {
            const unsigned int key = idx / HEAD_DIM;
            const unsigned int dim = idx % HEAD_DIM;
            const long long row = tile_rows[key];
            float k_value = 0.0f, v_value = 0.0f;
            if (row >= 0) {
                const size_t offset = (size_t)row * row_elems + (size_t)kv_head * HEAD_DIM + dim;
                k_value = to_f32(k_rows[offset]);
                v_value = to_f32(v_rows[offset]);
            }
            k_tile[key][dim] = k_value;
            v_tile[key][dim] = v_value;
        }
        __syncthreads();
        float scores[TILE];
        float tile_max = -INFINITY;
#pragma unroll
        for (int key = 0; key < TILE; ++key) {
            float partial = 0.0f;
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) partial += q[i] * k_tile[key][lane + 32 * i];
            const float score = warp_sum(partial);
            scores[key] = (key < count && tile_rows[key] >= 0) ? score : -INFINITY;
            tile_max = fmaxf(tile_max, scores[key]);
        }
        if (tile_max == -INFINITY) continue;
        const float new_max = fmaxf(state.max_score, tile_max);
        const float correction = exp2f(state.max_score - new_max);
        state.sum_weights *= correction;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) state.acc[i] *= correction;
#pragma unroll
        for (int key = 0; key < TILE; ++key) {
            const float weight = exp2f(scores[key] - new_max);
            state.sum_weights += weight;
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) state.acc[i] += weight * v_tile[key][lane + 32 * i];
        }
        state.max_score = new_max;
    }
}

PAGODA_DEVICE void load_query(const T* __restrict__ q_head, float scale_log2, float (&q)[DIMS_PER_LANE]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) q[i] = to_f32(q_head[lane + 32 * i]) * scale_log2;
}

PAGODA_DEVICE void store_output(const GroupState& state, T* __restrict__ out_head, bool poisoned) {
    const int lane = threadIdx.x & 31;
    const float inverse = state.sum_weights > 0.0f ? 1.0f / state.sum_weights : 0.0f;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) {
        out_head[lane + 32 * i] = from_f32<T>(poisoned ? quiet_nan() : state.acc[i] * inverse);
    }
}

PAGODA_DEVICE void init_state(GroupState& state) {
    state.max_score = -INFINITY;
    state.sum_weights = 0.0f;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) state.acc[i] = 0.0f;
}

// Causal ragged prefill (also valid for decode rows) over the paged cache.
// q: token t's head h at q[t * q_row_stride + h * HEAD_DIM]; out: [num_tokens, num_q_heads, HEAD_DIM].
// Grid (num_tokens, num_kv_heads). Query j of request r (q_len queries, seq_len visible
// tokens, already appended) attends to visible tokens 0 ..= seq_len - q_len + j.
// Tokens outside qo_indptr's range get zeros; impossible geometry (q_len > seq_len) gets NaN.
extern "C" __global__ void prefill_attention(
    const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const unsigned int* __restrict__ qo_indptr, const unsigned int* __restrict__ kv_indptr,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, T* __restrict__ out,
    unsigned int num_requests, unsigned int num_q_heads, unsigned int num_kv_heads,
    unsigned int page_size, unsigned int num_pages, unsigned int q_row_stride, float scale_log2) {
    const unsigned int token = blockIdx.x;
    const unsigned int kv_head = blockIdx.y;
    const unsigned int n_rep = blockDim.x / 32;
    const unsigned int q_head = kv_head * n_rep + threadIdx.x / 32;
    T* out_head = out + ((size_t)token * num_q_heads + q_head) * HEAD_DIM;
    GroupState state;
    init_state(state);
    // Request of this token: the last r with qo_indptr[r] <= token.
    unsigned int lo = 0, hi = num_requests;
    while (lo < hi) {
        const unsigned int mid = (lo + hi + 1) / 2;
        if (qo_indptr[mid] <= token) lo = mid; else hi = mid - 1;
    }
    const unsigned int r = lo;
    if (r >= num_requests || token >= qo_indptr[r + 1]) {
        store_output(state, out_head, false);
        return;
    }
    const long long q_len = (long long)qo_indptr[r + 1] - qo_indptr[r];
    const long long seq_len = paged_visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size);
    const long long num_keys = seq_len - q_len + (token - qo_indptr[r]) + 1;
    float q_values[DIMS_PER_LANE];
    load_query(q + (size_t)token * q_row_stride + (size_t)q_head * HEAD_DIM, scale_log2, q_values);
    const unsigned int page_base = kv_indptr[r];
    const unsigned int first = first_page_offset[r];
    auto row_of = [&](long long key) -> long long {
        const long long logical = first + key;
        const unsigned int page = kv_indices[page_base + logical / page_size];
        if (page >= num_pages) return -1;
        return (long long)page * page_size + logical % page_size;
    };
    const bool bad = q_len > seq_len;
    attend_group(q_values, k_pool, v_pool, (size_t)num_kv_heads * HEAD_DIM, kv_head,
                 bad ? 0 : num_keys, row_of, state);
    store_output(state, out_head, bad);
}

// Baseline decode, step 1: copies the pages of the batch's CSR table, in table order, into
// contiguous k_out/v_out: table position p (pool page kv_indices[p]) becomes rows
// p * page_size .. (p + 1) * page_size. Whole pages move as 16-byte words (a page row is
// num_kv_heads * HEAD_DIM elements, HEAD_DIM a multiple of 32, so a page is a multiple of
// 16 bytes). Page ids >= num_pages become zero rows. Positions at or beyond capacity_pages
// are not copied (the host routes such batches elsewhere). Any grid; grid-stride over
// positions 0 .. kv_indptr[num_requests], which is read on the device so the launch can be
// replayed from a CUDA graph with a new table.
extern "C" __global__ void paged_kv_gather(
    const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const unsigned int* __restrict__ kv_indptr, const unsigned int* __restrict__ kv_indices,
    T* __restrict__ k_out, T* __restrict__ v_out, unsigned int num_requests,
    unsigned int page_elems, unsigned int num_pages, unsigned int capacity_pages) {
    const unsigned int total = min(kv_indptr[num_requests], capacity_pages);
    const size_t words = (size_t)page_elems * sizeof(T) / 16;
    for (unsigned int position = blockIdx.x; position < total; position += gridDim.x) {
        const unsigned int page = kv_indices[position];
        uint4* k_dst = reinterpret_cast<uint4*>(k_out) + (size_t)position * words;
        uint4* v_dst = reinterpret_cast<uint4*>(v_out) + (size_t)position * words;
        if (page >= num_pages) {
            const uint4 zero = make_uint4(0, 0, 0, 0);
            for (size_t i = threadIdx.x; i < words; i += blockDim.x) {
                k_dst[i] = zero;
                v_dst[i] = zero;
            }
            continue;
        }
        const uint4* k_src = reinterpret_cast<const uint4*>(k_pool) + (size_t)page * words;
        const uint4* v_src = reinterpret_cast<const uint4*>(v_pool) + (size_t)page * words;
        for (size_t i = threadIdx.x; i < words; i += blockDim.x) {
            k_dst[i] = k_src[i];
            v_dst[i] = v_src[i];
        }
    }
}

// Lane l of a warp owns the contiguous dims l * DIMS_PER_LANE .. + DIMS_PER_LANE of a head,
// so one warp-wide load reads a whole head row (coalesced, vectorised where aligned).
#define LANE_BYTES (DIMS_PER_LANE * (int)sizeof(T))
PAGODA_DEVICE void load_lane(const T* __restrict__ row, float (&out)[DIMS_PER_LANE]) {
    const T* src = row + (threadIdx.x & 31) * DIMS_PER_LANE;
    if constexpr (LANE_BYTES % 16 == 0) {
        constexpr int PER = 16 / (int)sizeof(T);
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE / PER; ++c) {
            const uint4 word = reinterpret_cast<const uint4*>(src)[c];
            const T* e = reinterpret_cast<const T*>(&word);
#pragma unroll
            for (int j = 0; j < PER; ++j) out[c * PER + j] = to_f32(e[j]);
        }
    } else if constexpr (LANE_BYTES % 8 == 0) {
        constexpr int PER = 8 / (int)sizeof(T);
#pragma unroll
        for (int c = 0; c < DIMS_PER_LANE / PER; ++c) {
            const uint2 word = reinterpret_cast<const uint2*>(src)[c];
            const T* e = reinterpret_cast<const T*>(&word);
#pragma unroll
            for (int j = 0; j < PER; ++j) out[c * PER + j] = to_f32(e[j]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) out[i] = to_f32(src[i]);
    }
}

#define DECODE_UNROLL 4
#define DECODE_MAX_WARPS 32
// Keys per split are rounded up to a multiple of this (and never fewer).
#define DECODE_MIN_CHUNK 32

// Baseline decode, step 2: one query per request (q row r) against its gathered rows.
// Grid (B, num_kv_heads, num_splits); block 32 * n_rep * key_warps: warp w serves query head
// kv_head * n_rep + w % n_rep over every key_warps-th group of DECODE_UNROLL keys of split
// `blockIdx.z`'s key range; the key warps of a head merge in shared memory. Online softmax
// in base 2 (scale_log2 = scale * log2 e).
// num_splits == 1: writes out [B, num_q_heads, HEAD_DIM] directly. Otherwise writes the
// normalised partial [B, num_q_heads, num_splits, HEAD_DIM] (f32) and its base-2
// log-sum-exp [B, num_q_heads, num_splits] (-inf for an empty range) for
// merge_attention_states. Request r's key k is gathered row
// kv_indptr[r] * page_size + first_page_offset[r] + k; a request reaching beyond
// capacity_rows gets NaN.
extern "C" __global__ void decode_attention_gathered(
    const T* __restrict__ q, const T* __restrict__ k_gathered, const T* __restrict__ v_gathered,
    const unsigned int* __restrict__ kv_indptr, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, T* __restrict__ out,
    float* __restrict__ partial_out, float* __restrict__ partial_lse, unsigned int num_q_heads,
    unsigned int num_kv_heads, unsigned int page_size, unsigned long long capacity_rows,
    unsigned int q_row_stride, float scale_log2) {
    __shared__ float s_acc[DECODE_MAX_WARPS][HEAD_DIM];
    __shared__ float s_max[DECODE_MAX_WARPS];
    __shared__ float s_sum[DECODE_MAX_WARPS];
    const unsigned int r = blockIdx.x;
    const unsigned int kv_head = blockIdx.y;
    const unsigned int split = blockIdx.z;
    const unsigned int num_splits = gridDim.z;
    const unsigned int n_rep = num_q_heads / num_kv_heads;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int key_warps = (blockDim.x >> 5) / n_rep;
    const unsigned int group = warp % n_rep;
    const unsigned int key_warp = warp / n_rep;
    const unsigned int q_head = kv_head * n_rep + group;
    const int lane = threadIdx.x & 31;

    const long long seq_len = paged_visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size);
    const long long base_row = (long long)kv_indptr[r] * page_size + first_page_offset[r];
    const bool bad = seq_len > 0 && (unsigned long long)(base_row + seq_len) > capacity_rows;
    long long chunk = (seq_len + num_splits - 1) / num_splits;
    chunk = max((long long)DECODE_MIN_CHUNK,
                (chunk + DECODE_MIN_CHUNK - 1) / DECODE_MIN_CHUNK * DECODE_MIN_CHUNK);
    const long long key_begin = (long long)split * chunk;
    const long long key_end = bad ? key_begin : min(seq_len, key_begin + chunk);

    // The query row's stride need not be a multiple of the vector width: scalar loads.
    float q_values[DIMS_PER_LANE];
    const T* q_lane = q + (size_t)r * q_row_stride + (size_t)q_head * HEAD_DIM + lane * DIMS_PER_LANE;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) q_values[i] = to_f32(q_lane[i]) * scale_log2;

    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;
    const T* k_base = k_gathered + (size_t)kv_head * HEAD_DIM;
    const T* v_base = v_gathered + (size_t)kv_head * HEAD_DIM;
    float max_score = -INFINITY, sum_weights = 0.0f;
    float acc[DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] = 0.0f;

    for (long long key = key_begin + (long long)key_warp * DECODE_UNROLL; key < key_end;
         key += (long long)key_warps * DECODE_UNROLL) {
        float k_values[DECODE_UNROLL][DIMS_PER_LANE];
        float v_values[DECODE_UNROLL][DIMS_PER_LANE];
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            const long long row = base_row + min(key + u, key_end - 1);
            load_lane(k_base + (size_t)row * row_elems, k_values[u]);
            load_lane(v_base + (size_t)row * row_elems, v_values[u]);
        }
        float scores[DECODE_UNROLL];
        float tile_max = -INFINITY;
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            float partial = 0.0f;
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) partial += q_values[i] * k_values[u][i];
            const float score = warp_sum(partial);
            scores[u] = key + u < key_end ? score : -INFINITY;
            tile_max = fmaxf(tile_max, scores[u]);
        }
        const float new_max = fmaxf(max_score, tile_max);
        const float correction = exp2f(max_score - new_max);
        sum_weights *= correction;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] *= correction;
#pragma unroll
        for (int u = 0; u < DECODE_UNROLL; ++u) {
            const float weight = exp2f(scores[u] - new_max);
            sum_weights += weight;
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] += weight * v_values[u][i];
        }
        max_score = new_max;
    }

    // Merge the key warps of each query head.
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) s_acc[warp][lane * DIMS_PER_LANE + i] = acc[i];
    if (lane == 0) {
        s_max[warp] = max_score;
        s_sum[warp] = sum_weights;
    }
    __syncthreads();
    if (key_warp != 0) return;
    float total_max = -INFINITY;
    for (unsigned int w = 0; w < key_warps; ++w) total_max = fmaxf(total_max, s_max[w * n_rep + group]);
    float total_sum = 0.0f;
    float merged[DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) merged[i] = 0.0f;
    if (total_max != -INFINITY) {
        for (unsigned int w = 0; w < key_warps; ++w) {
            const unsigned int source = w * n_rep + group;
            const float factor = exp2f(s_max[source] - total_max);
            total_sum += s_sum[source] * factor;
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) merged[i] += s_acc[source][lane * DIMS_PER_LANE + i] * factor;
        }
    }
    const float inverse = total_sum > 0.0f ? 1.0f / total_sum : 0.0f;
    const size_t head_row = (size_t)r * num_q_heads + q_head;
    if (num_splits == 1) {
        T* out_head = out + head_row * HEAD_DIM + lane * DIMS_PER_LANE;
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) out_head[i] = from_f32<T>(bad ? quiet_nan() : merged[i] * inverse);
        return;
    }
    const size_t partial_row = head_row * num_splits + split;
    float* partial_head = partial_out + partial_row * HEAD_DIM + lane * DIMS_PER_LANE;
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; ++i) partial_head[i] = bad ? quiet_nan() : merged[i] * inverse;
    if (lane == 0) {
        // A poisoned request keeps a finite LSE so the NaN partial reaches the output.
        partial_lse[partial_row] = bad ? 0.0f : (total_sum > 0.0f ? total_max + __log2f(total_sum) : -INFINITY);
    }
}

// Merges num_splits normalised partial outputs per (request, query head) by their base-2
// log-sum-exps: out = sum_s 2^(lse_s - M) * partial_s / sum_s 2^(lse_s - M), M = max lse.
// -inf partials contribute nothing; a row whose partials are all -inf becomes zeros.
// Grid (B, num_q_heads); any block size. partial_out [B, num_q_heads, num_splits, HEAD_DIM].
extern "C" __global__ void merge_attention_states(
    const float* __restrict__ partial_out, const float* __restrict__ partial_lse,
    T* __restrict__ out, unsigned int num_splits) {
    // The split weights 2^(lse_s - M) / sum, computed once by warp 0 (num_splits <= 64).
    __shared__ float weights[64];
    __shared__ float total_max;
    const size_t head_row = (size_t)blockIdx.x * gridDim.y + blockIdx.y;
    const float* lse = partial_lse + head_row * num_splits;
    if (threadIdx.x < 32) {
        const unsigned int lane = threadIdx.x;
        const float a = lane < num_splits ? lse[lane] : -INFINITY;
        const float b = lane + 32 < num_splits ? lse[lane + 32] : -INFINITY;
        const float row_max = warp_max(fmaxf(a, b));
        const float wa = row_max == -INFINITY ? 0.0f : exp2f(a - row_max);
        const float wb = row_max == -INFINITY ? 0.0f : exp2f(b - row_max);
        const float total = warp_sum(wa + wb);
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        weights[lane] = wa * inverse;
        weights[lane + 32] = wb * inverse;
        if (lane == 0) total_max = row_max;
    }
    __syncthreads();
    T* out_head = out + head_row * HEAD_DIM;
    if (total_max == -INFINITY) {
        for (unsigned int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) out_head[d] = from_f32<T>(0.0f);
        return;
    }
    const float* partial = partial_out + head_row * num_splits * HEAD_DIM;
    for (unsigned int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float value = 0.0f;
#pragma unroll 8
        for (unsigned int s = 0; s < num_splits; ++s) {
            const float weight = weights[s];
            if (weight > 0.0f) value += weight * partial[(size_t)s * HEAD_DIM + d];
        }
        out_head[d] = from_f32<T>(value);
    }
}
