// Quest sparse decode, the selection: one CTA per request writes its kept page ids into
// out_indices[out_indptr[r] .. out_indptr[r + 1]] (the host computed out_indptr; it depends on
// lengths and settings only), in the request's page order:
//   dense request (requests[4r] == 0xffffffff): every page, copied;
//   sparse request: page 0 (when window_start > 0), then the `keep` (requests[4r + 2]) best
//   middle pages 1 .. window_start (requests[4r + 1]) by descending score, ties to the earlier
//   page (Rust's `total_cmp` order on the scores), in ascending position, then the window
//   pages window_start .. count.
// The best `keep` are found by a bitwise search for the keep-th largest of the distinct
// 45-bit keys (ordered score bits << 13 | (8191 - position)): 45 block-wide counts over the
// keys in shared memory. Every write is clamped to the request's output range and every scratch read
// to max_pages, so a plan that does not match the table writes garbage, never out of bounds.
// Block SELECT_THREADS; PAGODA_MAX_PAGES bounds the middle pages of one request.

#define SELECT_THREADS 256
#define INDEX_BITS 13
#define KEY_BITS (32 + INDEX_BITS)
static_assert(PAGODA_MAX_PAGES <= (1 << INDEX_BITS), "middle positions must fit the key's index bits");

// f32 bits to u32 whose unsigned order is Rust's f32::total_cmp order.
__device__ __forceinline__ unsigned int total_order_bits(float value) {
    const unsigned int bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ unsigned long long select_key(const unsigned int* ordered,
                                                         unsigned int j) {
    return ((unsigned long long)ordered[j] << INDEX_BITS) |
           (unsigned long long)(((1u << INDEX_BITS) - 1) - j);
}

extern "C" __global__ void sparse_select_pages(const unsigned int* __restrict__ indptr,
                                               const unsigned int* __restrict__ indices,
                                               const unsigned int* __restrict__ requests,
                                               const float* __restrict__ scores,
                                               unsigned int max_pages,
                                               const unsigned int* __restrict__ out_indptr,
                                               unsigned int* __restrict__ out_indices) {
    __shared__ unsigned int s_ordered[PAGODA_MAX_PAGES];
    __shared__ unsigned int s_count[3];
    __shared__ unsigned int s_offsets[SELECT_THREADS];
    const unsigned int r = blockIdx.x;
    const unsigned int tid = threadIdx.x;
    const unsigned int begin = indptr[r];
    const unsigned int count = max(begin, indptr[r + 1]) - begin;
    const unsigned int out_begin = out_indptr[r];
    const unsigned int out_end = max(out_begin, out_indptr[r + 1]);
    const unsigned int* pages = indices + begin;
    if (requests[4 * r] == 0xffffffffu) {
        for (unsigned int i = tid; i < count && out_begin + i < out_end; i += SELECT_THREADS) {
            out_indices[out_begin + i] = pages[i];
        }
        return;
    }
    const unsigned int window_start = min(requests[4 * r + 1], count);
    // Middle positions 1 .. window_start, as j = position - 1 in 0 .. middle.
    unsigned int middle = window_start > 1 ? window_start - 1 : 0;
    middle = min(middle, min(max_pages > 0 ? max_pages - 1 : 0, (unsigned int)PAGODA_MAX_PAGES));
    const unsigned int keep = min(requests[4 * r + 2], middle);
    const float* request_scores = scores + (size_t)r * max_pages;
    for (unsigned int j = tid; j < middle; j += SELECT_THREADS) {
        s_ordered[j] = total_order_bits(request_scores[j + 1]);
    }
    if (tid < 3) s_count[tid] = 0;
    __syncthreads();
    // Each thread owns the contiguous run [lo, hi) of the middle positions.
    const unsigned int per_thread = (middle + SELECT_THREADS - 1) / SELECT_THREADS;
    const unsigned int lo = min(tid * per_thread, middle);
    const unsigned int hi = min(lo + per_thread, middle);
    unsigned long long threshold = 0;
    if (keep > 0 && keep < middle) {
        unsigned long long prefix = 0;
        for (int bit = KEY_BITS - 1; bit >= 0; --bit) {
            const unsigned int buffer = (unsigned int)(KEY_BITS - 1 - bit) % 3;
            const unsigned long long candidate = prefix | (1ull << bit);
            unsigned int local = 0;
            for (unsigned int j = lo; j < hi; ++j) local += select_key(s_ordered, j) >= candidate;
            if (local) atomicAdd(&s_count[buffer], local);
            __syncthreads();
            if (s_count[buffer] >= keep) prefix = candidate;
            // The buffer of two iterations on: every thread has read the previous one.
            if (tid == 0) s_count[(buffer + 2) % 3] = 0;
        }
        threshold = prefix;
    }
    // Ordered compaction of the kept middle positions.
    unsigned int kept = 0;
    if (keep > 0) {
        for (unsigned int j = lo; j < hi; ++j) kept += select_key(s_ordered, j) >= threshold;
    }
    s_offsets[tid] = kept;
    __syncthreads();
    if (tid == 0) {
        unsigned int running = 0;
        for (unsigned int i = 0; i < SELECT_THREADS; ++i) {
            const unsigned int c = s_offsets[i];
            s_offsets[i] = running;
            running += c;
        }
    }
    __syncthreads();
    const unsigned int head = window_start > 0 ? 1 : 0;
    if (head && tid == 0 && out_begin < out_end) out_indices[out_begin] = pages[0];
    unsigned int at = out_begin + head + s_offsets[tid];
    for (unsigned int j = lo; j < hi; ++j) {
        if (keep > 0 && select_key(s_ordered, j) >= threshold) {
            if (at < out_end) out_indices[at] = pages[j + 1];
            ++at;
        }
    }
    const unsigned int window_at = out_begin + head + keep;
    for (unsigned int i = tid; window_start + i < count; i += SELECT_THREADS) {
        if (window_at + i < out_end) out_indices[window_at + i] = pages[window_start + i];
    }
}
