// Quest sparse decode, the selection: one CTA per request writes its kept page ids into
// out_indices[out_indptr[r] .. out_indptr[r + 1]] (the host computed out_indptr; it depends on
// lengths and settings only), in the request's page order:
//   dense request (requests[4r] == 0xffffffff): every page, copied;
//   sparse request: page 0 (when window_start > 0), then the `keep` (requests[4r + 2]) best
//   middle pages 1 .. window_start (requests[4r + 1]) by descending score, ties to the earlier
//   page (Rust's `total_cmp` order on the scores), in ascending position, then the window
//   pages window_start .. count.
// The keep-th largest score is found by a radix select over the scores' order-preserving
// bits, 8 bits a pass (4 passes; each warp counts into its own 256-bin histogram in shared
// memory, the lanes sharing the leading lane's bin with one increment, then thread `bin` adds
// the warps' counts); the kept middle pages are those above it and the earliest of those equal to
// it, written by an ordered compaction (two block scans). Every write is clamped to the
// request's output range and every scratch read to max_pages, so a plan that does not match
// the table writes garbage, never out of bounds. Block SELECT_THREADS (256: one histogram bin
// a thread); PAGODA_MAX_PAGES bounds the middle pages of one request.

#define SELECT_THREADS 256
#define SELECT_WARPS (SELECT_THREADS / 32)

// f32 bits to u32 whose unsigned order is Rust's f32::total_cmp order.
__device__ __forceinline__ unsigned int total_order_bits(float value) {
    const unsigned int bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Exclusive prefix of `value` over the block's threads in order; every thread must call it.
__device__ __forceinline__ unsigned int block_exclusive_scan(unsigned int value,
                                                             unsigned int* s_warp) {
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int warp = threadIdx.x / 32;
    unsigned int inclusive = value;
#pragma unroll
    for (unsigned int offset = 1; offset < 32; offset *= 2) {
        const unsigned int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    if (lane == 31) s_warp[warp] = inclusive;
    __syncthreads();
    unsigned int before = 0;
    for (unsigned int w = 0; w < warp; ++w) before += s_warp[w];
    __syncthreads();
    return before + inclusive - value;
}

extern "C" __global__ void sparse_select_pages(const unsigned int* __restrict__ indptr,
                                               const unsigned int* __restrict__ indices,
                                               const unsigned int* __restrict__ requests,
                                               const float* __restrict__ scores,
                                               unsigned int max_pages,
                                               const unsigned int* __restrict__ out_indptr,
                                               unsigned int* __restrict__ out_indices) {
    __shared__ unsigned int s_ordered[PAGODA_MAX_PAGES];
    __shared__ unsigned int s_warp_hist[SELECT_WARPS][256];
    __shared__ unsigned int s_hist[256];
    __shared__ unsigned int s_warp[SELECT_WARPS];
    __shared__ unsigned int s_digit[2];
    const unsigned int r = blockIdx.x;
    const unsigned int tid = threadIdx.x;
    const unsigned int lane = tid % 32;
    const unsigned int begin = indptr[r];
    const unsigned int count = max(begin, indptr[r + 1]) - begin;
    const unsigned int out_begin = out_indptr[r];
    const unsigned int out_end = max(out_begin, out_indptr[r + 1]);
    const unsigned int* pages = indices + begin;
    if (requests[4 * r] == 0xffffffffu) {
#pragma unroll 8
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
#pragma unroll 8
    for (unsigned int j = tid; j < middle; j += SELECT_THREADS) {
        s_ordered[j] = total_order_bits(request_scores[j + 1]);
    }
    __syncthreads();
    // The keep-th largest key, and how many keys equal to it are kept (the earliest).
    unsigned int threshold = 0;
    unsigned int take_equal = 0;
    const bool all = keep >= middle;
    if (keep > 0 && !all) {
        unsigned int prefix = 0;
        unsigned int mask = 0;
        unsigned int remaining = keep;
        const unsigned int rounds = (middle + SELECT_THREADS - 1) / SELECT_THREADS;
        for (int shift = 24; shift >= 0; shift -= 8) {
#pragma unroll
            for (unsigned int w = 0; w < SELECT_WARPS; ++w) s_warp_hist[w][tid] = 0;
            __syncthreads();
            unsigned int* own = s_warp_hist[tid / 32];
#pragma unroll 4
            for (unsigned int round = 0; round < rounds; ++round) {
                const unsigned int j = round * SELECT_THREADS + tid;
                unsigned int bin = 256;
                if (j < middle) {
                    const unsigned int key = s_ordered[j];
                    if ((key & mask) == prefix) bin = (key >> shift) & 255u;
                }
                // Scores of one request cluster, so many lanes often share a bin (the high
                // digits above all): the lanes of the first counted lane's bin add once.
                const unsigned int counted = __ballot_sync(0xffffffffu, bin < 256);
                if (counted == 0) continue;
                const unsigned int leader = __ffs(counted) - 1;
                const unsigned int common = __shfl_sync(0xffffffffu, bin, leader);
                const unsigned int same = __ballot_sync(0xffffffffu, bin == common);
                if (lane == leader) {
                    atomicAdd(&own[common], __popc(same));
                } else if (bin < 256 && bin != common) {
                    atomicAdd(&own[bin], 1u);
                }
            }
            __syncthreads();
            unsigned int total = 0;
#pragma unroll
            for (unsigned int w = 0; w < SELECT_WARPS; ++w) total += s_warp_hist[w][tid];
            s_hist[tid] = total;
            __syncthreads();
            if (tid < 32) {
                // Lane l holds bins 255 - 8l down to 248 - 8l: the digits in descending order.
                unsigned int sum = 0;
                for (unsigned int k = 0; k < 8; ++k) sum += s_hist[255 - 8 * lane - k];
                unsigned int inclusive = sum;
#pragma unroll
                for (unsigned int offset = 1; offset < 32; offset *= 2) {
                    const unsigned int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
                    if (lane >= offset) inclusive += other;
                }
                unsigned int above = inclusive - sum;
                if (above < remaining && remaining <= inclusive) {
                    for (unsigned int k = 0; k < 8; ++k) {
                        const unsigned int digit = 255 - 8 * lane - k;
                        const unsigned int c = s_hist[digit];
                        if (above + c >= remaining) {
                            s_digit[0] = digit;
                            s_digit[1] = remaining - above;
                            break;
                        }
                        above += c;
                    }
                }
            }
            __syncthreads();
            // Read before the next pass's histogram is complete (two barriers on), so the
            // next write of s_digit comes after every thread has read this one.
            prefix |= s_digit[0] << shift;
            mask |= 255u << shift;
            remaining = s_digit[1];
        }
        threshold = prefix;
        take_equal = remaining;
    }
    // Ordered compaction: each thread owns the contiguous run [lo, hi) of the middle.
    const unsigned int per_thread = (middle + SELECT_THREADS - 1) / SELECT_THREADS;
    const unsigned int lo = min(tid * per_thread, middle);
    const unsigned int hi = min(lo + per_thread, middle);
    unsigned int equal = 0;
    if (keep > 0 && !all) {
        for (unsigned int j = lo; j < hi; ++j) equal += s_ordered[j] == threshold;
    }
    const unsigned int equal_before = block_exclusive_scan(equal, s_warp);
    unsigned int kept = 0;
    if (keep > 0) {
        unsigned int rank = equal_before;
        for (unsigned int j = lo; j < hi; ++j) {
            const unsigned int key = s_ordered[j];
            kept += all || key > threshold || (key == threshold && rank++ < take_equal);
        }
    }
    const unsigned int kept_before = block_exclusive_scan(kept, s_warp);
    const unsigned int head = window_start > 0 ? 1 : 0;
    if (head && tid == 0 && out_begin < out_end) out_indices[out_begin] = pages[0];
    if (keep > 0) {
        unsigned int at = out_begin + head + kept_before;
        unsigned int rank = equal_before;
        for (unsigned int j = lo; j < hi; ++j) {
            const unsigned int key = s_ordered[j];
            if (all || key > threshold || (key == threshold && rank++ < take_equal)) {
                if (at < out_end) out_indices[at] = pages[j + 1];
                ++at;
            }
        }
    }
    const unsigned int window_at = out_begin + head + keep;
    for (unsigned int i = tid; window_start + i < count; i += SELECT_THREADS) {
        if (window_at + i < out_end) out_indices[window_at + i] = pages[window_start + i];
    }
}
