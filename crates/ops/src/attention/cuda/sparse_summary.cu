// Quest sparse decode, the typed half: the key summaries' update after a step's KV append
// and the page scores of the selection (sparse_select.cu picks the pages from them).
//
// Summaries: [num_pages, num_kv_heads, 2, head_dim] in the pool's dtype T, per page and KV
// head the elementwise minimum then the maximum of the page's keys. A min or max of T values
// is a T value, so storing them as T loses nothing against the host's f32 summaries.
typedef PAGODA_T T;

// Grid (slots of the step, ceil(num_kv_heads * head_dim / SUMMARY_THREADS)): CTA (t, y)
// serves slots[t] (= page * page_size + row; negative or >= num_slots: padding, skipped) and
// the summary elements y * SUMMARY_THREADS .. (one a thread). The CTAs of the LAST row a step
// writes to a page (the highest row; the first such slot if repeated) recompute the page's
// entry from pool rows 0..=row, so no two slots write one element and a page reused from row 0
// forgets its old bounds. Rows below `row` were written earlier (a page fills from row 0 up),
// which makes this the host's fold; the rows are read SUMMARY_ROWS at a time, all loads in
// flight, and folded in row order. Fast exit when the next slot is the next row of the same
// page (the common run); otherwise the CTA scans the step's slots for a later row of its page.
#define SUMMARY_THREADS 256
#define SUMMARY_ROWS 16
extern "C" __global__ void sparse_summaries_update(const T* __restrict__ k_pool,
                                                   const int* __restrict__ slots,
                                                   unsigned int num_step_slots,
                                                   T* __restrict__ summaries,
                                                   unsigned int page_size, unsigned int num_kv_heads,
                                                   unsigned int head_dim, long long num_slots) {
    const unsigned int t = blockIdx.x;
    const long long slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;
    const long long page = slot / page_size;
    const unsigned int row = (unsigned int)(slot % page_size);
    if (t + 1 < num_step_slots && (long long)slots[t + 1] == slot + 1 && row + 1 < page_size) {
        return;
    }
    int later = 0;
    for (unsigned int i = threadIdx.x; i < num_step_slots; i += blockDim.x) {
        const long long other = slots[i];
        if (other < 0 || other >= num_slots || other / page_size != page) continue;
        const unsigned int other_row = (unsigned int)(other % page_size);
        if (other_row > row || (other_row == row && i < t)) later = 1;
    }
    if (__syncthreads_or(later)) return;
    const unsigned int token_stride = num_kv_heads * head_dim;
    const unsigned int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= token_stride) return;
    const T* column = k_pool + (size_t)page * page_size * token_stride + e;
    float low = INFINITY;
    float high = -INFINITY;
    for (unsigned int base = 0; base <= row; base += SUMMARY_ROWS) {
        float values[SUMMARY_ROWS];
#pragma unroll
        for (unsigned int k = 0; k < SUMMARY_ROWS; ++k) {
            values[k] = base + k <= row ? to_f32(column[(size_t)(base + k) * token_stride]) : 0.0f;
        }
#pragma unroll
        for (unsigned int k = 0; k < SUMMARY_ROWS; ++k) {
            if (base + k <= row) {
                low = fminf(low, values[k]);
                high = fmaxf(high, values[k]);
            }
        }
    }
    const unsigned int kv_head = e / head_dim;
    const unsigned int d = e - kv_head * head_dim;
    T* entry = summaries + ((size_t)page * num_kv_heads + kv_head) * 2 * head_dim;
    entry[d] = from_f32<T>(low);
    entry[head_dim + d] = from_f32<T>(high);
}

// Page scores: grid (ceil(max_pages / SCORE_TILE), B), block 32 * warps (1..=SCORE_WARPS).
// CTA (x, r) scores the page POSITIONS x * SCORE_TILE .. + SCORE_TILE of request r's page
// list, only the middle positions 1 .. window_start of a sparse request (requests[4r] = its
// query row, 0xffffffff for a dense request; requests[4r + 1] = window_start), into
// scores[r * max_pages + p]. Warp w takes the KV heads w, w + warps, ...: it issues the
// summary loads of all its tile's pages at once (memory parallelism, not a chain of round
// trips), reads each query head once for the tile, and parks each GQA group's sum in shared
// memory; thread t then adds page t's groups in order. The score is the host's exactly: per
// query head sum_d max(q_d * min_d, q_d * max_d), lane l summing d = l, l + 32, ... in order
// and the lanes folding by the xor butterfly (the host's `warp_order_sum`); the heads of each
// GQA group summed in order, then the groups in order. Every sum starts from -0.0 and every
// product and sum is rounded on its own (no FMA contraction), so ties agree with the host. A
// page id outside the pool scores -inf. head_dim <= 32 * SCORE_MAX_CHUNKS, num_kv_heads <=
// SCORE_MAX_KV_HEADS.
#define SCORE_WARPS 8
#define SCORE_TILE 4
#define SCORE_MAX_CHUNKS 8
#define SCORE_MAX_KV_HEADS 256
extern "C" __global__ void sparse_page_scores(const T* __restrict__ q, unsigned int q_row_stride,
                                              const T* __restrict__ summaries,
                                              const unsigned int* __restrict__ indptr,
                                              const unsigned int* __restrict__ indices,
                                              const unsigned int* __restrict__ requests,
                                              float* __restrict__ scores, unsigned int max_pages,
                                              unsigned int num_pages, unsigned int num_kv_heads,
                                              unsigned int n_rep, unsigned int head_dim) {
    __shared__ float s_group[SCORE_TILE][SCORE_MAX_KV_HEADS];
    const unsigned int warp = threadIdx.x / 32;
    const unsigned int warps = blockDim.x / 32;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int r = blockIdx.y;
    const unsigned int first = blockIdx.x * SCORE_TILE;
    // Every exit below depends on the CTA's (x, r) only, so a CTA leaves whole.
    const unsigned int query_row = requests[4 * r];
    const unsigned int window = requests[4 * r + 1];
    const unsigned int begin = indptr[r];
    const unsigned int end = indptr[r + 1];
    if (query_row == 0xffffffffu) return;
    const unsigned int count = max(begin, end) - begin;
    const unsigned int limit = min(min(window, count), max_pages);
    if (first >= limit) return;
    unsigned int page[SCORE_TILE];
    bool scored[SCORE_TILE];
#pragma unroll
    for (unsigned int t = 0; t < SCORE_TILE; ++t) {
        const unsigned int p = first + t;
        const bool middle = p >= 1 && p < limit;
        page[t] = middle ? indices[begin + p] : 0;
        scored[t] = middle && page[t] < num_pages;
    }
    const T* query = q + (size_t)query_row * q_row_stride;
    for (unsigned int kv_head = warp; kv_head < num_kv_heads; kv_head += warps) {
        float lo[SCORE_TILE][SCORE_MAX_CHUNKS];
        float hi[SCORE_TILE][SCORE_MAX_CHUNKS];
#pragma unroll
        for (unsigned int t = 0; t < SCORE_TILE; ++t) {
            const T* low = summaries + ((size_t)page[t] * num_kv_heads + kv_head) * 2 * head_dim;
#pragma unroll
            for (unsigned int i = 0; i < SCORE_MAX_CHUNKS; ++i) {
                const unsigned int d = lane + 32 * i;
                const bool load = scored[t] && d < head_dim;
                lo[t][i] = load ? to_f32(low[d]) : 0.0f;
                hi[t][i] = load ? to_f32(low[head_dim + d]) : 0.0f;
            }
        }
        float group[SCORE_TILE];
#pragma unroll
        for (unsigned int t = 0; t < SCORE_TILE; ++t) group[t] = -0.0f;
        for (unsigned int h = 0; h < n_rep; ++h) {
            const T* qh = query + (size_t)(kv_head * n_rep + h) * head_dim;
            float qd[SCORE_MAX_CHUNKS];
#pragma unroll
            for (unsigned int i = 0; i < SCORE_MAX_CHUNKS; ++i) {
                const unsigned int d = lane + 32 * i;
                qd[i] = d < head_dim ? to_f32(qh[d]) : 0.0f;
            }
#pragma unroll
            for (unsigned int t = 0; t < SCORE_TILE; ++t) {
                float part = -0.0f;
#pragma unroll
                for (unsigned int i = 0; i < SCORE_MAX_CHUNKS; ++i) {
                    if (lane + 32 * i < head_dim) {
                        part = __fadd_rn(part, fmaxf(__fmul_rn(qd[i], lo[t][i]),
                                                     __fmul_rn(qd[i], hi[t][i])));
                    }
                }
#pragma unroll
                for (unsigned int offset = 16; offset > 0; offset /= 2) {
                    part = __fadd_rn(part, __shfl_xor_sync(0xffffffffu, part, offset));
                }
                group[t] = __fadd_rn(group[t], part);
            }
        }
        if (lane == 0) {
#pragma unroll
            for (unsigned int t = 0; t < SCORE_TILE; ++t) s_group[t][kv_head] = group[t];
        }
    }
    __syncthreads();
    if (threadIdx.x < SCORE_TILE) {
        const unsigned int t = threadIdx.x;
        const unsigned int p = first + t;
        if (p >= 1 && p < limit) {
            float score = -INFINITY;
            if (scored[t]) {
                score = -0.0f;
                for (unsigned int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                    score = __fadd_rn(score, s_group[t][kv_head]);
                }
            }
            scores[(size_t)r * max_pages + p] = score;
        }
    }
}
