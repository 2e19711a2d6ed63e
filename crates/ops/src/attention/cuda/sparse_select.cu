// Quest sparse decode, the selection: one CTA per request writes its kept page ids into
// out_indices[out_indptr[r] .. out_indptr[r + 1]] (the host computed out_indptr; it depends on
// lengths and settings only), in the request's page order:
//   dense request (requests[4r] == 0xffffffff): every page, copied;
//   sparse request: page 0 (when window_start > 0), then the `keep` (requests[4r + 2]) best
//   middle pages 1 .. window_start (requests[4r + 1]) by descending score, ties to the earlier
//   page (Rust's `total_cmp` order on the scores), in ascending position, then the window
//   pages window_start .. count.
// Thread t holds the contiguous run of middle positions t * per .. (per = ceil(middle /
// SELECT_THREADS) <= SELECT_KEYS) as keys in registers: the scores' order-preserving bits.
// sparse_select_pages finds the keep-th largest key bit by bit from the top (is there room
// for `keep` keys at or above prefix | bit?), each count a few __syncthreads_count (one per
// bit of a thread's count), stopping early once exactly `keep` keys lie at or above the
// prefix. sparse_select_pages_radix (`PAGODA_CUDA_SPARSE_SELECT=radix`) finds it a byte at a
// time (a radix select): each pass counts the keys that share the prefix found so far into a
// 256-bin shared histogram (lanes of a warp with the same byte add once), one warp finds the
// bin where the count from the top reaches the keys still wanted, and the prefix grows by
// that byte; it stops early when that bin is wanted whole. Both keep the same pages. The
// kept middle pages are those above the threshold and the earliest of those equal to it,
// written in order after one block scan of (above, equal) counts. Every write is clamped to
// the request's output range and every scratch read to max_pages, so a plan that does not
// match the table writes garbage, never out of bounds. PAGODA_MAX_PAGES bounds the middle
// pages of one request.

#define SELECT_THREADS 1024
#define SELECT_WARPS (SELECT_THREADS / 32)
#define SELECT_KEYS ((PAGODA_MAX_PAGES + SELECT_THREADS - 1) / SELECT_THREADS)

// f32 bits to u32 whose unsigned order is Rust's f32::total_cmp order.
__device__ __forceinline__ unsigned int total_order_bits(float value) {
    const unsigned int bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The sum over the block of `value` (< 2^bits), every thread calling with the same `bits`.
__device__ __forceinline__ unsigned int block_sum_small(unsigned int value, unsigned int bits) {
    unsigned int total = 0;
    for (unsigned int b = 0; b < bits; ++b) {
        total += (unsigned int)__syncthreads_count((value >> b) & 1u) << b;
    }
    return total;
}

#define RADIX_BINS 256

// One radix pass's choice: the byte, the keys still wanted within it, and whether the whole
// bin is wanted.
struct RadixPick {
    unsigned int digit;
    unsigned int wanted;
    unsigned int whole;
};

// Warp 0: in `hist`, the bin where the count from the top (bin 255 down) reaches `wanted`,
// into `pick` (lane l sums bins 255 - 8l .. 248 - 8l; one lane's run holds the crossing).
__device__ __forceinline__ void radix_pick(const unsigned int* hist, unsigned int wanted,
                                           RadixPick* pick) {
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int top = RADIX_BINS - 1 - lane * 8;
    unsigned int sum = 0;
#pragma unroll
    for (unsigned int j = 0; j < 8; ++j) sum += hist[top - j];
    unsigned int inclusive = sum;
#pragma unroll
    for (unsigned int offset = 1; offset < 32; offset *= 2) {
        const unsigned int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    unsigned int above = inclusive - sum;
    if (above < wanted && wanted <= inclusive) {
        // The crossing lane walks its run down again (shared reads are cheap).
        for (unsigned int j = 0; j < 8; ++j) {
            const unsigned int bin = hist[top - j];
            if (above + bin >= wanted) {
                pick->digit = top - j;
                pick->wanted = wanted - above;
                pick->whole = bin == wanted - above;
                return;
            }
            above += bin;
        }
    }
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
    if (warp == 0) {
        const unsigned int total = s_warp[lane];
        unsigned int running = total;
#pragma unroll
        for (unsigned int offset = 1; offset < 32; offset *= 2) {
            const unsigned int other = __shfl_up_sync(0xffffffffu, running, offset);
            if (lane >= offset) running += other;
        }
        s_warp[lane] = running - total;
    }
    __syncthreads();
    return s_warp[warp] + inclusive - value;
}

// Either selection; RADIX picks the search for the keep-th largest key.
template <bool RADIX>
__device__ __forceinline__ void select_pages(const unsigned int* __restrict__ indptr,
                                             const unsigned int* __restrict__ indices,
                                             const unsigned int* __restrict__ requests,
                                             const float* __restrict__ scores,
                                             unsigned int max_pages,
                                             const unsigned int* __restrict__ out_indptr,
                                             unsigned int* __restrict__ out_indices) {
    __shared__ unsigned int s_warp[SELECT_WARPS];
    const unsigned int r = blockIdx.x;
    const unsigned int tid = threadIdx.x;
    const unsigned int begin = indptr[r];
    const unsigned int count = max(begin, indptr[r + 1]) - begin;
    const unsigned int out_begin = out_indptr[r];
    const unsigned int out_end = max(out_begin, out_indptr[r + 1]);
    const unsigned int* pages = indices + begin;
    if (requests[4 * r] == 0xffffffffu) {
#pragma unroll 4
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
    const bool all = keep >= middle;
    const float* request_scores = scores + (size_t)r * max_pages + 1;
    const unsigned int per = (middle + SELECT_THREADS - 1) / SELECT_THREADS;
    const unsigned int lo = min(tid * per, middle);
    const unsigned int hi = min(lo + per, middle);
    // Keys past the run are 0, below every candidate the bitwise search counts (each has a bit
    // set); the radix search skips them.
    unsigned int keys[SELECT_KEYS];
#if __CUDA_ARCH__ >= 900
    // Launched programmatically after the scores (radix): they are complete from here. Without
    // a programmatic launch the wait returns at once.
    if (RADIX) asm volatile("griddepcontrol.wait;" ::: "memory");
    // The decode over the kept pages may launch (it waits for this grid before it reads them).
    if (RADIX) asm volatile("griddepcontrol.launch_dependents;");
#endif
#pragma unroll
    for (unsigned int k = 0; k < SELECT_KEYS; ++k) {
        keys[k] = lo + k < hi ? total_order_bits(request_scores[lo + k]) : 0u;
    }
    // Kept: key > threshold, or key == threshold among the first take_equal such keys.
    unsigned int threshold = 0;
    unsigned int take_equal = 0;
    if (!RADIX && keep > 0 && !all) {
        const unsigned int bits = 32 - __clz(per);
        unsigned int prefix = 0;
        bool exact = false;
        for (int bit = 31; bit >= 0; --bit) {
            const unsigned int candidate = prefix | (1u << bit);
            unsigned int mine = 0;
#pragma unroll
            for (unsigned int k = 0; k < SELECT_KEYS; ++k) mine += keys[k] >= candidate;
            // Block-uniform, so every thread takes the same branches.
            const unsigned int at_or_above = block_sum_small(mine, bits);
            if (at_or_above >= keep) {
                prefix = candidate;
                if (at_or_above == keep) {
                    exact = true;
                    break;
                }
            }
        }
        if (exact) {
            // Exactly `keep` keys at or above prefix (>= 1): keep them all, no tie to break.
            threshold = prefix - 1;
        } else {
            // prefix is the keep-th largest key: those above it, then the earliest equal.
            unsigned int mine = 0;
#pragma unroll
            for (unsigned int k = 0; k < SELECT_KEYS; ++k) mine += keys[k] > prefix;
            threshold = prefix;
            take_equal = keep - block_sum_small(mine, bits);
        }
    }
    if (RADIX && keep > 0 && !all) {
        __shared__ unsigned int s_hist[2][RADIX_BINS];
        __shared__ RadixPick s_pick[2];
        for (unsigned int i = tid; i < 2 * RADIX_BINS; i += SELECT_THREADS) (&s_hist[0][0])[i] = 0;
        __syncthreads();
        const unsigned int lane = tid % 32;
        unsigned int prefix = 0;
        unsigned int prefix_mask = 0;
        unsigned int wanted = keep;
        bool whole = false;
        for (unsigned int pass = 0; pass < 4; ++pass) {
            const unsigned int shift = 24 - 8 * pass;
            unsigned int* hist = s_hist[pass & 1];
#pragma unroll
            for (unsigned int k = 0; k < SELECT_KEYS; ++k) {
                if (k >= per) break;  // block-uniform: the keys a thread holds
                const bool counted = lo + k < hi && (keys[k] & prefix_mask) == prefix;
                const unsigned int digit = (keys[k] >> shift) & (RADIX_BINS - 1);
                const unsigned int counting = __ballot_sync(0xffffffffu, counted);
                if (counted) {
                    const unsigned int peers = __match_any_sync(counting, digit);
                    if (lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
                }
            }
            __syncthreads();
            if (tid < 32) {
                radix_pick(hist, wanted, &s_pick[pass & 1]);
            } else if (tid < 32 + RADIX_BINS) {
                // The other histogram, read by the last pass's pick, cleared for the next.
                s_hist[(pass + 1) & 1][tid - 32] = 0;
            }
            __syncthreads();
            const RadixPick pick = s_pick[pass & 1];
            prefix |= pick.digit << shift;
            prefix_mask |= (RADIX_BINS - 1) << shift;
            wanted = pick.wanted;
            if (pick.whole) {
                whole = true;
                break;
            }
        }
        // Whole: exactly the keys at or above prefix (its low bytes 0) are wanted, every
        // key equal to prefix among them. Otherwise prefix is the keep-th largest key, and
        // `wanted` of the keys equal to it are kept.
        threshold = prefix;
        take_equal = whole ? 0xffffffffu : wanted;
    }
    // Ordered compaction: one scan of (above, equal) counts packed in 16-bit halves.
    unsigned int above = 0;
    unsigned int equal = 0;
    if (keep > 0) {
#pragma unroll
        for (unsigned int k = 0; k < SELECT_KEYS; ++k) {
            if (lo + k < hi) {
                above += all || keys[k] > threshold;
                equal += !all && keys[k] == threshold;
            }
        }
    }
    const unsigned int before = block_exclusive_scan(above | (equal << 16), s_warp);
    const unsigned int head = window_start > 0 ? 1 : 0;
    if (head && tid == 0 && out_begin < out_end) out_indices[out_begin] = pages[0];
    if (keep > 0) {
        unsigned int rank = before >> 16;
        unsigned int at = out_begin + head + (before & 0xffffu) + min(rank, take_equal);
#pragma unroll
        for (unsigned int k = 0; k < SELECT_KEYS; ++k) {
            if (lo + k < hi) {
                const unsigned int key = keys[k];
                if (all || key > threshold || (key == threshold && rank++ < take_equal)) {
                    if (at < out_end) out_indices[at] = pages[lo + k + 1];
                    ++at;
                }
            }
        }
    }
    const unsigned int window_at = out_begin + head + keep;
    for (unsigned int i = tid; window_start + i < count; i += SELECT_THREADS) {
        if (window_at + i < out_end) out_indices[window_at + i] = pages[window_start + i];
    }
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
    sparse_select_pages(const unsigned int* __restrict__ indptr,
                        const unsigned int* __restrict__ indices,
                        const unsigned int* __restrict__ requests,
                        const float* __restrict__ scores, unsigned int max_pages,
                        const unsigned int* __restrict__ out_indptr,
                        unsigned int* __restrict__ out_indices) {
    select_pages<false>(indptr, indices, requests, scores, max_pages, out_indptr, out_indices);
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
    sparse_select_pages_radix(const unsigned int* __restrict__ indptr,
                              const unsigned int* __restrict__ indices,
                              const unsigned int* __restrict__ requests,
                              const float* __restrict__ scores, unsigned int max_pages,
                              const unsigned int* __restrict__ out_indptr,
                              unsigned int* __restrict__ out_indices) {
    select_pages<true>(indptr, indices, requests, scores, max_pages, out_indptr, out_indices);
}
