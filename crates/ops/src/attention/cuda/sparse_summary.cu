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
#if __CUDA_ARCH__ >= 900
    // The page scores read no page a step writes (the window holds them): launched
    // programmatically after this grid (see SparseSelectWorkspace::set_after_update), they
    // may start at once.
    asm volatile("griddepcontrol.launch_dependents;");
#endif
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

// Page scores: grid (ceil(max_pages / pages_per_cta), B), block SCORE_THREADS, dynamic shared
// memory for one query row (num_kv_heads * n_rep * head_dim T values). CTA (x, r) scores the
// page POSITIONS x * pages_per_cta .. + pages_per_cta of request r's page list, only the
// middle positions 1 .. window_start of a sparse request (requests[4r] = its query row,
// 0xffffffff for a dense request; requests[4r + 1] = window_start), into
// scores[r * max_pages + p]. Each octet (8 lanes) takes one (page, KV head) pair at a time
// (pair i: page position i / num_kv_heads, KV head i % num_kv_heads; octet o the pairs o,
// o + SCORE_OCTETS, ..): lane l reads the contiguous slice l * ceil(head_dim / 8) .. of the
// pair's min and max (16-byte loads where the slices allow), so a pair's 2 * head_dim values
// come in one coalesced sweep (sparse_page_scores_ahead, below, loads them earlier). The
// CTA stages the query row and its page ids in shared memory first. The score is the host's
// exactly: per query head, lane l sums max(q_d * min_d, q_d * max_d) over its slice in order
// from -0.0 and the octet folds by the xor butterfly 4, 2, 1 (the host's `octet_order_sum`);
// the heads of a GQA group summed in order, then (thread t for page t) the groups in order.
// Every product and sum is rounded on its own (no FMA contraction), so ties agree with the
// host. A page id outside the pool scores -inf (its groups are -inf). head_dim <=
// 8 * SCORE_MAX_SLICE, num_kv_heads * pages_per_cta <= SCORE_MAX_PAIRS, pages_per_cta <=
// SCORE_MAX_CTA_PAGES.
#define SCORE_THREADS 256
#define SCORE_OCTETS (SCORE_THREADS / 8)
#define SCORE_MAX_SLICE 32
#define SCORE_MAX_PAIRS 512
#define SCORE_MAX_CTA_PAGES 64
#define SCORE_VEC (16 / sizeof(T))
#define SCORE_MAX_VECS (SCORE_MAX_SLICE / (16 / sizeof(T)))
#define SCORE_CHUNK 2
#define SCORE_MIN_CTAS 3

// A lane's partial sum folded over its octet (`mask`) by the xor butterfly 4, 2, 1.
__device__ __forceinline__ float octet_fold(float part, unsigned int mask) {
    part = __fadd_rn(part, __shfl_xor_sync(mask, part, 4, 8));
    part = __fadd_rn(part, __shfl_xor_sync(mask, part, 2, 8));
    return __fadd_rn(part, __shfl_xor_sync(mask, part, 1, 8));
}

// A lane's `count` (<= N) 16-byte vectors of the pair's min and max.
template <unsigned int N>
__device__ __forceinline__ void octet_load(const T* __restrict__ entry, unsigned int head_dim,
                                           unsigned int d0, unsigned int count, uint4 (&lo)[N],
                                           uint4 (&hi)[N]) {
#pragma unroll
    for (unsigned int v = 0; v < N; ++v) {
        if (v < count) {
            lo[v] = *reinterpret_cast<const uint4*>(entry + d0 + v * SCORE_VEC);
            hi[v] = *reinterpret_cast<const uint4*>(entry + head_dim + d0 + v * SCORE_VEC);
        }
    }
}

// One (page, KV head) pair's group bound from a lane's loaded vectors (`count` <= N of
// them, slices of whole vectors), every lane of the octet (`mask`) taking part.
template <unsigned int N>
__device__ __forceinline__ float octet_vector_bound(const uint4 (&lo)[N], const uint4 (&hi)[N],
                                                    const T* s_qg, unsigned int n_rep,
                                                    unsigned int head_dim, unsigned int d0,
                                                    unsigned int count, unsigned int mask) {
    float group = -0.0f;
    for (unsigned int h = 0; h < n_rep; ++h) {
        const T* qh = s_qg + (size_t)h * head_dim + d0;
        float part = -0.0f;
#pragma unroll
        for (unsigned int v = 0; v < N; ++v) {
            if (v < count) {
                const uint4 qv = *reinterpret_cast<const uint4*>(qh + v * SCORE_VEC);
                const T* qe = reinterpret_cast<const T*>(&qv);
                const T* le = reinterpret_cast<const T*>(&lo[v]);
                const T* he = reinterpret_cast<const T*>(&hi[v]);
#pragma unroll
                for (unsigned int e = 0; e < SCORE_VEC; ++e) {
                    const float qd = to_f32(qe[e]);
                    part = __fadd_rn(part, fmaxf(__fmul_rn(qd, to_f32(le[e])),
                                                 __fmul_rn(qd, to_f32(he[e]))));
                }
            }
        }
        group = __fadd_rn(group, octet_fold(part, mask));
    }
    return group;
}

// The same bound read from memory: whole vectors (`vectors`) or element by element.
__device__ __forceinline__ float octet_group_bound(const T* __restrict__ entry, const T* s_qg,
                                                   unsigned int n_rep, unsigned int head_dim,
                                                   unsigned int d0, unsigned int d1,
                                                   bool vectors, unsigned int mask) {
    if (vectors) {
        uint4 lo[SCORE_MAX_VECS];
        uint4 hi[SCORE_MAX_VECS];
        const unsigned int count = (d1 - d0) / SCORE_VEC;
        octet_load<SCORE_MAX_VECS>(entry, head_dim, d0, count, lo, hi);
        return octet_vector_bound<SCORE_MAX_VECS>(lo, hi, s_qg, n_rep, head_dim, d0, count, mask);
    }
    float group = -0.0f;
    for (unsigned int h = 0; h < n_rep; ++h) {
        const T* qh = s_qg + (size_t)h * head_dim;
        float part = -0.0f;
        for (unsigned int d = d0; d < d1; ++d) {
            const float qd = to_f32(qh[d]);
            part = __fadd_rn(part, fmaxf(__fmul_rn(qd, to_f32(entry[d])),
                                         __fmul_rn(qd, to_f32(entry[head_dim + d]))));
        }
        group = __fadd_rn(group, octet_fold(part, mask));
    }
    return group;
}

// Request r's page positions the scores cover: 1 .. the returned limit (window start,
// page count and grid pages, the least).
__device__ __forceinline__ unsigned int score_limit(const unsigned int* __restrict__ requests,
                                                    const unsigned int* __restrict__ indptr,
                                                    unsigned int r, unsigned int max_pages) {
    const unsigned int window = requests[4 * r + 1];
    const unsigned int begin = indptr[r];
    const unsigned int count = max(begin, indptr[r + 1]) - begin;
    return min(min(window, count), max_pages);
}

// The CTA copies the query row `query` (`elems` T values) into shared memory, in 16-byte
// vectors where it is aligned and whole.
__device__ __forceinline__ void stage_query(const T* __restrict__ query, unsigned int elems,
                                            uint4* s_dynamic) {
    if ((elems % SCORE_VEC) == 0 && (reinterpret_cast<size_t>(query) % 16) == 0) {
        const uint4* source = reinterpret_cast<const uint4*>(query);
        for (unsigned int i = threadIdx.x; i < elems / SCORE_VEC; i += SCORE_THREADS) {
            s_dynamic[i] = source[i];
        }
    } else {
        T* s_q = reinterpret_cast<T*>(s_dynamic);
        for (unsigned int i = threadIdx.x; i < elems; i += SCORE_THREADS) s_q[i] = query[i];
    }
}

// Pair i of a CTA: its summaries entry, or null when the pair is not scored (past the CTA's
// pairs or outside the middle positions); `outside` when its page id lies outside the pool.
struct ScorePair {
    const T* entry;
    bool outside;
};

// Page position p's id is pages[p - offset] (the list from position 0, or a CTA's staged ids
// from its first).
__device__ __forceinline__ ScorePair score_pair(unsigned int i, unsigned int pairs,
                                                unsigned int first, unsigned int limit,
                                                const unsigned int* pages, unsigned int offset,
                                                const T* __restrict__ summaries,
                                                unsigned int num_pages,
                                                unsigned int num_kv_heads,
                                                unsigned int head_dim) {
    ScorePair pair = {nullptr, false};
    if (i >= pairs) return pair;
    const unsigned int local = i / num_kv_heads;
    const unsigned int kv_head = i - local * num_kv_heads;
    const unsigned int p = first + local;
    if (p < 1 || p >= limit) return pair;
    const unsigned int page = pages[p - offset];
    if (page >= num_pages) {
        pair.outside = true;
        return pair;
    }
    pair.entry = summaries + ((size_t)page * num_kv_heads + kv_head) * 2 * head_dim;
    return pair;
}

extern "C" __global__ void __launch_bounds__(SCORE_THREADS)
    sparse_page_scores(const T* __restrict__ q, unsigned int q_row_stride,
                       const T* __restrict__ summaries, const unsigned int* __restrict__ indptr,
                       const unsigned int* __restrict__ indices,
                       const unsigned int* __restrict__ requests, float* __restrict__ scores,
                       unsigned int max_pages, unsigned int num_pages,
                       unsigned int num_kv_heads, unsigned int n_rep, unsigned int head_dim,
                       unsigned int pages_per_cta) {
    extern __shared__ uint4 s_dynamic[];
    T* s_q = reinterpret_cast<T*>(s_dynamic);
    __shared__ float s_group[SCORE_MAX_PAIRS];
    __shared__ unsigned int s_page[SCORE_MAX_CTA_PAGES];
    const unsigned int r = blockIdx.y;
    const unsigned int first = blockIdx.x * pages_per_cta;
    const unsigned int query_row = requests[4 * r];
    const unsigned int begin = indptr[r];
    const unsigned int limit = score_limit(requests, indptr, r, max_pages);
    // Both exits depend on the CTA's (x, r) only, so a CTA leaves whole.
    if (query_row == 0xffffffffu || first >= limit) return;
    // Stage the page ids and the query row.
    for (unsigned int t = threadIdx.x; t < pages_per_cta; t += SCORE_THREADS) {
        const unsigned int p = first + t;
        s_page[t] = p >= 1 && p < limit ? indices[begin + p] : 0u;
    }
    stage_query(q + (size_t)query_row * q_row_stride, num_kv_heads * n_rep * head_dim, s_dynamic);
    __syncthreads();
    const unsigned int lane = threadIdx.x % 8;
    const unsigned int mask = 0xffu << (threadIdx.x % 32 / 8 * 8);
    const unsigned int slice = (head_dim + 7) / 8;
    const unsigned int d0 = min(lane * slice, head_dim);
    const unsigned int d1 = min(d0 + slice, head_dim);
    // 16-byte slices: every slice whole (head_dim a multiple of 8) and a whole number of vectors.
    const bool vectors = head_dim % 8 == 0 && (slice * sizeof(T)) % 16 == 0;
    const unsigned int pairs = pages_per_cta * num_kv_heads;
    for (unsigned int i = threadIdx.x / 8; i < pairs; i += SCORE_OCTETS) {
        const unsigned int local = i / num_kv_heads;
        const unsigned int kv_head = i - local * num_kv_heads;
        const unsigned int p = first + local;
        const unsigned int page = s_page[local];
        // Octet-uniform: the octet's lanes share the pair.
        if (p < 1 || p >= limit || page >= num_pages) continue;
        const T* entry = summaries + ((size_t)page * num_kv_heads + kv_head) * 2 * head_dim;
        const float group = octet_group_bound(entry, s_q + (size_t)kv_head * n_rep * head_dim,
                                              n_rep, head_dim, d0, d1, vectors, mask);
        if (lane == 0) s_group[i] = group;
    }
    __syncthreads();
    for (unsigned int t = threadIdx.x; t < pages_per_cta; t += SCORE_THREADS) {
        const unsigned int p = first + t;
        if (p >= 1 && p < limit) {
            float score = -INFINITY;
            if (s_page[t] < num_pages) {
                score = -0.0f;
                for (unsigned int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                    score = __fadd_rn(score, s_group[t * num_kv_heads + kv_head]);
                }
            }
            scores[(size_t)r * max_pages + p] = score;
        }
    }
}

// Last in every CTA of a grid launched beside the summaries update: the grid then completes
// after the update, so a kernel waiting on any later link of the chain sees its writes.
PAGODA_DEVICE void wait_for_prerequisites() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The scores with the loads ahead (`PAGODA_CUDA_SPARSE_SELECT=radix`), for slices of one or
// two whole vectors (SCORE_CHUNK; head_dim 64 or 128 in bf16), at most SCORE_MAX_PAIRS pairs
// and SCORE_MAX_CTA_PAGES pages a CTA (the host checks all three and sizes pages_per_cta so
// the grid fills the GPU's CTA slots once, SCORE_MIN_CTAS an SM). Each octet holds two pairs
// in flight: its first two are loaded before the page ids and the query row are staged, and
// each later pair (i + 2 * SCORE_OCTETS) is loaded as soon as its slot's pair is folded, so
// a CTA of many pages pays its prologue once. The same arguments and scores as
// sparse_page_scores.
extern "C" __global__ void __launch_bounds__(SCORE_THREADS, SCORE_MIN_CTAS)
    sparse_page_scores_ahead(const T* __restrict__ q, unsigned int q_row_stride,
                             const T* __restrict__ summaries,
                             const unsigned int* __restrict__ indptr,
                             const unsigned int* __restrict__ indices,
                             const unsigned int* __restrict__ requests,
                             float* __restrict__ scores, unsigned int max_pages,
                             unsigned int num_pages, unsigned int num_kv_heads,
                             unsigned int n_rep, unsigned int head_dim,
                             unsigned int pages_per_cta) {
    extern __shared__ uint4 s_dynamic[];
    T* s_q = reinterpret_cast<T*>(s_dynamic);
    __shared__ float s_group[SCORE_MAX_PAIRS];
    __shared__ unsigned int s_page[SCORE_MAX_CTA_PAGES];
    const unsigned int r = blockIdx.y;
    const unsigned int first = blockIdx.x * pages_per_cta;
    const unsigned int query_row = requests[4 * r];
    const unsigned int begin = indptr[r];
    const unsigned int limit = score_limit(requests, indptr, r, max_pages);
    // Both exits depend on the CTA's (x, r) only, so a CTA leaves whole.
    if (query_row == 0xffffffffu || first >= limit) return wait_for_prerequisites();
    const unsigned int* pages = indices + begin;
    const unsigned int lane = threadIdx.x % 8;
    const unsigned int mask = 0xffu << (threadIdx.x % 32 / 8 * 8);
    const unsigned int slice = (head_dim + 7) / 8;
    const unsigned int d0 = min(lane * slice, head_dim);
    const unsigned int d1 = min(d0 + slice, head_dim);
    // 16-byte slices (checked by the host): every slice whole, 1 or 2 vectors.
    const unsigned int vecs = (d1 - d0) / SCORE_VEC;
    const unsigned int pairs = pages_per_cta * num_kv_heads;
    const unsigned int i0 = threadIdx.x / 8;
    ScorePair pair[2];
    uint4 lo[2][SCORE_CHUNK], hi[2][SCORE_CHUNK];
#pragma unroll
    for (unsigned int k = 0; k < 2; ++k) {
        pair[k] = score_pair(i0 + k * SCORE_OCTETS, pairs, first, limit, pages, 0, summaries,
                             num_pages, num_kv_heads, head_dim);
        if (pair[k].entry) octet_load<SCORE_CHUNK>(pair[k].entry, head_dim, d0, vecs, lo[k], hi[k]);
    }
    for (unsigned int t = threadIdx.x; t < pages_per_cta; t += SCORE_THREADS) {
        const unsigned int p = first + t;
        s_page[t] = p >= 1 && p < limit ? pages[p] : 0u;
    }
    stage_query(q + (size_t)query_row * q_row_stride, num_kv_heads * n_rep * head_dim, s_dynamic);
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    // The selection, launched programmatically, may start its prologue (it waits for this
    // grid before it reads the scores).
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    // Octet-uniform below: the octet's lanes share the pair.
    const size_t group_elems = (size_t)n_rep * head_dim;
    for (unsigned int i = i0; i < pairs; i += 2 * SCORE_OCTETS) {
#pragma unroll
        for (unsigned int k = 0; k < 2; ++k) {
            const unsigned int ik = i + k * SCORE_OCTETS;
            if (pair[k].entry) {
                const float group = octet_vector_bound<SCORE_CHUNK>(
                    lo[k], hi[k], s_q + (ik % num_kv_heads) * group_elems, n_rep, head_dim, d0,
                    vecs, mask);
                if (lane == 0) s_group[ik] = group;
            } else if (pair[k].outside && lane == 0) {
                s_group[ik] = -INFINITY;
            }
            pair[k] = score_pair(ik + 2 * SCORE_OCTETS, pairs, first, limit, s_page, first,
                                 summaries, num_pages, num_kv_heads, head_dim);
            if (pair[k].entry) {
                octet_load<SCORE_CHUNK>(pair[k].entry, head_dim, d0, vecs, lo[k], hi[k]);
            }
        }
    }
    __syncthreads();
    for (unsigned int t = threadIdx.x; t < pages_per_cta; t += SCORE_THREADS) {
        const unsigned int p = first + t;
        if (p >= 1 && p < limit) {
            float score = -0.0f;
            for (unsigned int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
                score = __fadd_rn(score, s_group[t * num_kv_heads + kv_head]);
            }
            scores[(size_t)r * max_pages + p] = score;
        }
    }
    wait_for_prerequisites();
}
