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

// Visible tokens of request r from its CSR row (0 when it has no pages).
PAGODA_DEVICE long long visible_len(const unsigned int* kv_indptr, const unsigned int* last_page_len,
                                    const unsigned int* first_page_offset, unsigned int r,
                                    unsigned int page_size) {
    const long long pages = (long long)kv_indptr[r + 1] - (long long)kv_indptr[r];
    if (pages <= 0) return 0;
    return (pages - 1) * page_size + (long long)last_page_len[r] - (long long)first_page_offset[r];
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
    const long long seq_len = visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size);
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

// Baseline decode, step 1: copies each request's visible K/V rows into contiguous
// k_out/v_out [num_requests, max_seq_len, num_kv_heads, HEAD_DIM]. Grid (max_seq_len, B).
extern "C" __global__ void paged_kv_gather(
    const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const unsigned int* __restrict__ kv_indptr, const unsigned int* __restrict__ kv_indices,
    const unsigned int* __restrict__ last_page_len, const unsigned int* __restrict__ first_page_offset,
    T* __restrict__ k_out, T* __restrict__ v_out, unsigned int num_kv_heads, unsigned int page_size,
    unsigned int num_pages, unsigned int max_seq_len) {
    const unsigned int key = blockIdx.x;
    const unsigned int r = blockIdx.y;
    const long long seq_len = visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size);
    if ((long long)key >= seq_len) return;
    const long long logical = first_page_offset[r] + (long long)key;
    const unsigned int page = kv_indices[kv_indptr[r] + logical / page_size];
    if (page >= num_pages) return;
    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;
    const size_t src = ((size_t)page * page_size + logical % page_size) * row_elems;
    const size_t dst = ((size_t)r * max_seq_len + key) * row_elems;
    for (unsigned int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        k_out[dst + i] = k_pool[src + i];
        v_out[dst + i] = v_pool[src + i];
    }
}

// Baseline decode, step 2: one query per request (q row r), attending to all of its
// gathered rows. Grid (B, num_kv_heads). A request longer than max_seq_len gets NaN.
extern "C" __global__ void decode_attention_gathered(
    const T* __restrict__ q, const T* __restrict__ k_gathered, const T* __restrict__ v_gathered,
    const unsigned int* __restrict__ kv_indptr, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, T* __restrict__ out,
    unsigned int num_q_heads, unsigned int num_kv_heads, unsigned int page_size,
    unsigned int max_seq_len, unsigned int q_row_stride, float scale_log2) {
    const unsigned int r = blockIdx.x;
    const unsigned int kv_head = blockIdx.y;
    const unsigned int n_rep = blockDim.x / 32;
    const unsigned int q_head = kv_head * n_rep + threadIdx.x / 32;
    GroupState state;
    init_state(state);
    const long long seq_len = visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size);
    float q_values[DIMS_PER_LANE];
    load_query(q + (size_t)r * q_row_stride + (size_t)q_head * HEAD_DIM, scale_log2, q_values);
    const bool bad = seq_len > (long long)max_seq_len;
    auto row_of = [&](long long key) -> long long { return (long long)r * max_seq_len + key; };
    attend_group(q_values, k_gathered, v_gathered, (size_t)num_kv_heads * HEAD_DIM, kv_head,
                 bad ? 0 : seq_len, row_of, state);
    store_output(state, out + ((size_t)r * num_q_heads + q_head) * HEAD_DIM, bad);
}
