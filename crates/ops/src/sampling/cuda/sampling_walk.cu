// GPU sampling, part 1: the pieces of the multi-CTA filtered pipeline that run before and
// between its passes: fast weights, the per-warp segments of a split, the fast inverse-CDF
// walk, the row's filter state set up from the row maximum, and the top-k radix select.
//
// A split CTA has SPLIT_THREADS threads; warp w owns segment w of its split (a contiguous
// id range, read coalesced 4 logits per lane), so the segments of a row in (split, warp)
// order cover its ids in order and per-segment masses locate any cumulative weight.

#define SPLIT_THREADS 256
#define SEGMENTS 8u
// Relative bound used on every filter mass summed from fast f32 weights (f32 expf, or
// draw_exp at T = 1, of an f32 argument, accumulated in f64): their error is below 5e-6 of
// the mass (the exp's 3 ulp plus the argument's three roundings times the weighted mean |x|,
// itself at most ln(vocab) + 0.4 for a set holding the row maximum). A top-p test closer than
// this to its boundary is left to the exact kernel.
#define FAST_MASS_TOLERANCE 2e-5

// exp((v - z_max) * scale) in f32; 0 for masked logits.
PAGODA_DEVICE float fast_weight(float v, float z_max, float scale) {
    return v == -INFINITY ? 0.0f : expf(__fmul_rn(__fsub_rn(v, z_max), scale));
}

// (4 vocab + 64) ulps of `total`: how far apart two f64 sums of up to `vocab` weights (within
// a few ulps of each other) in different orders can be. The exact kernel's top-p test calls
// a mass within it of its target ambiguous.
PAGODA_DEVICE double rounding_margin(unsigned int vocab, double total) {
    return (4.0 * (double)vocab + 64.0) * 2.220446049250313080847e-16 * total;
}

// (2 vocab + 64) ulps of `total`: how far apart `target - cumulative weight` at one id can be
// in two walks that add the same f64 weights (the canonical f32 weights, the same bits in
// every kernel) in different orders. Each order's sum of n <= vocab terms is within (n - 1) u
// of the exact one (u = eps / 2), so two orders' totals, and with them their targets, differ
// by at most (vocab - 1) eps total, and their cumulative weights as much again. A fast walk
// whose target lies that close to the cumulative weight before or after its id leaves the
// row to the exact kernel.
PAGODA_DEVICE double walk_margin(unsigned int vocab, double total) {
    return (2.0 * (double)vocab + 64.0) * 2.220446049250313080847e-16 * total;
}

// Id range [begin, end) of segment `segment` (= split * SEGMENTS + warp) of a row: the
// split's range cut into SEGMENTS spans of a multiple of 4 ids.
PAGODA_DEVICE void segment_range(unsigned int vocab, unsigned int num_splits, unsigned int segment,
                                 unsigned int& begin, unsigned int& end) {
    unsigned int split_begin, split_end;
    split_range(vocab, num_splits, segment / SEGMENTS, split_begin, split_end);
    const unsigned int span = (split_end - split_begin + 4u * SEGMENTS - 1u) / (4u * SEGMENTS) * 4u;
    begin = min(split_begin + (segment % SEGMENTS) * span, split_end);
    end = min(begin + span, split_end);
}

// Four sanitised logits of a row in global memory, ids [i, i + 4) (-inf at and past `end`).
struct GlobalLogits {
    const float* z;
    unsigned int end;
    bool aligned;
    PAGODA_DEVICE float4 operator()(unsigned int i) const { return load4(z, i, end, aligned); }
};

// The walk over ids [begin, end) of a row's proposal {z > low} (`logits` gives four at a
// time, -inf past the end): the first id whose cumulative draw weight, counted from `base`
// (the mass of the ids before `begin`), exceeds `target`; NO_TOKEN when the target lies
// within `margin` of the cumulative weight before or after that id (the exact kernel decides
// then), or when no id crosses it. `begin` is a multiple of 4. Block-wide.
template <typename Logits>
PAGODA_DEVICE unsigned int walk_range(const Logits& logits, unsigned int begin, unsigned int end, double base,
                                      double target, double margin, float low, float z_max, float scale) {
    __shared__ unsigned int s_found, s_unsure;
    if (threadIdx.x == 0) { s_found = NO_TOKEN; s_unsure = 0u; }
    __syncthreads();
    for (unsigned int tile = begin; tile < end; tile += blockDim.x * 4u) {
        const unsigned int i = tile + threadIdx.x * 4u;
        const float4 v = i < end ? logits(i) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        const float values[4] = {v.x, v.y, v.z, v.w};
        double weights[4];
        double sum = 0.0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            weights[j] = values[j] > low ? (double)draw_weight(values[j], z_max, scale) : 0.0;
            sum += weights[j];
        }
        double tile_total;
        double cumulative = base + block_exclusive_scan_f64(sum, tile_total);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (weights[j] > 0.0) {
                const double next = cumulative + weights[j];
                if (cumulative <= target && next > target) {
                    atomicMin(&s_found, i + j);
                    if (cumulative > target - margin || next <= target + margin) s_unsure = 1u;
                }
                cumulative = next;
            }
        }
        base += tile_total;
        __syncthreads();
        if (s_found != NO_TOKEN) break;
    }
    __syncthreads();
    const unsigned int found = s_unsure ? NO_TOKEN : s_found;
    __syncthreads();
    return found;
}

// Inverse-CDF draw over the proposal {z > low} weighted draw_weight(z, z_max, scale), from
// the row's per-segment masses `segment_mass` [num_splits * SEGMENTS] (f64, written by the
// other CTAs of this kernel): the first id whose cumulative weight exceeds uniform * total.
// NO_TOKEN when the target lies within walk_margin of the cumulative weight before or after
// that id (the exact kernel decides then). Block-wide.
PAGODA_DEVICE unsigned int fast_walk(const float* __restrict__ z, unsigned int vocab, unsigned int num_splits,
                                     const double* segment_mass, float low, float z_max, float scale,
                                     double uniform) {
    __shared__ double s_before;
    __shared__ unsigned int s_owner;
    const unsigned int segments = num_splits * SEGMENTS;
    const unsigned int per_thread = (segments + blockDim.x - 1u) / blockDim.x;
    const unsigned int first = threadIdx.x * per_thread;
    double local = 0.0;
    for (unsigned int k = 0; k < per_thread; ++k) {
        if (first + k < segments) local += __ldcg(segment_mass + first + k);
    }
    double total;
    double running = block_exclusive_scan_f64(local, total);
    const double target = __dmul_rn(uniform, total);
    if (threadIdx.x == 0) s_owner = NO_TOKEN;
    __syncthreads();
    const double thread_start = running;
    for (unsigned int k = 0; k < per_thread && first + k < segments; ++k) {
        const double mass = __ldcg(segment_mass + first + k);
        if (mass > 0.0 && running <= target && running + mass > target) atomicMin(&s_owner, first + k);
        running += mass;
    }
    __syncthreads();
    running = thread_start;
    for (unsigned int k = 0; k < per_thread && first + k < segments; ++k) {
        if (first + k == s_owner) s_before = running;
        running += __ldcg(segment_mass + first + k);
    }
    __syncthreads();
    const unsigned int owner = s_owner;
    if (owner == NO_TOKEN) return NO_TOKEN;
    unsigned int begin, end;
    segment_range(vocab, num_splits, owner, begin, end);
    return walk_range(GlobalLogits{z, end, row_aligned(z)}, begin, end, s_before, target, walk_margin(vocab, total),
                      low, z_max, scale);
}

// pagoda_ops rejection::min_p_threshold: the smallest f32 t with exp(t - z_max) >= min_p
// (f64), by ulp steps from z_max + ln(min_p). False when the steps do not settle.
PAGODA_DEVICE bool min_p_passes(float value, double z_max, double min_p) {
    return exp(__dsub_rn((double)value, z_max)) >= min_p;
}
PAGODA_DEVICE bool min_p_threshold(float z_max, float min_p_f32, float& threshold) {
    const double z_max64 = z_max, min_p = min_p_f32;
    float t = __double2float_rn(__dadd_rn(z_max64, log(min_p)));
    t = fminf(fmaxf(t, -__int_as_float(FLT_MAX_BITS)), z_max);
    for (int i = 0; i < 64 && !min_p_passes(t, z_max64, min_p); ++i) t = from_ordered_bits(ordered_bits(t) + 1u);
    if (!min_p_passes(t, z_max64, min_p)) return false;
    for (int i = 0; i < 64; ++i) {
        const float below = next_down(t);
        if (below == -INFINITY || !min_p_passes(below, z_max64, min_p)) { threshold = t; return true; }
        t = below;
    }
    return false;
}

// The row's filter status from its maximum: IDLE unless the row is filtered; EXACT when the
// fast pipeline is off, a stage it needs was not launched, or min-p has no threshold; else
// ACTIVE, with the proposal floor `low` from min-p and `top_k_pending` when the top-k select
// is still to run.
PAGODA_DEVICE unsigned int filter_start(const RowParams& p, unsigned int vocab, float z_max, unsigned int flags,
                                        float& low, bool& top_k_pending) {
    low = -INFINITY;
    top_k_pending = false;
    if (row_path(p, vocab, z_max) != PATH_REJECTION) return STATUS_IDLE;
    bool exact = !(flags & FLAG_FAST);
    if (!exact && min_p_active(p)) {
        float threshold = z_max;
        if (min_p_threshold(z_max, p.min_p, threshold)) low = next_down(threshold); else exact = true;
    }
    if (!exact && p.top_k > 0u && p.top_k < vocab) {
        if (flags & FLAG_TOP_K) top_k_pending = true; else exact = true;
    }
    return exact ? STATUS_EXACT : STATUS_ACTIVE;
}

// The row's filter state from its maximum (one thread; see filter_start).
PAGODA_DEVICE void init_filter_state(const RowParams& p, unsigned int vocab, float z_max, unsigned int argmax,
                                     unsigned int flags, unsigned int* st) {
    st[FS_Z_MAX] = __float_as_uint(z_max);
    st[FS_ARGMAX] = argmax;
    st[FS_CANDIDATE] = argmax;
    st[FS_ROUNDS] = 0u;
    st[FS_HIGH] = __float_as_uint(z_max);
    st[FS_TOP_K_THRESHOLD] = __float_as_uint(-INFINITY);
    float low;
    bool top_k_pending;
    const unsigned int status = filter_start(p, vocab, z_max, flags, low, top_k_pending);
    st[FS_TOP_K_PENDING] = top_k_pending ? 1u : 0u;
    if (top_k_pending) {
        st[FS_TOP_K_PREFIX] = 0u;
        st[FS_TOP_K_REMAINING] = p.top_k;
    }
    st[FS_LOW] = __float_as_uint(low);
    st[FS_STATUS] = status;
}

// Bins of a top-k digit (8 bits): the digits are bits [24, 32), [16, 24), [8, 16), [0, 8) of
// ordered_bits, most significant first (TOP_K_SHIFTS in src/ops/sampling/mod.rs).
#define TOP_K_BINS 256u

// Thread `t` of the block holds bins [(blockDim.x - 1 - t) * per, ... + per) of a `bins`-bin
// histogram (so thread order is descending bin order): the largest bin d with
// sum(counts[d..]) >= remaining, the count above it and in it, and the total count.
// Block-wide; every thread gets the result (bin NO_TOKEN when the total is below `remaining`).
PAGODA_DEVICE void find_rank_bin(const unsigned int* counts, unsigned int bins, unsigned int remaining,
                                 unsigned int& bin, unsigned int& above, unsigned int& in_bin,
                                 unsigned int& total) {
    __shared__ unsigned int s_bin, s_above, s_in;
    const unsigned int per = bins / blockDim.x;
    const unsigned int first = (blockDim.x - 1u - threadIdx.x) * per;
    unsigned int local = 0u;
    for (unsigned int k = 0; k < per; ++k) local += counts[first + k];
    // Exclusive scan over threads in descending-bin order: the count of every bin above.
    unsigned int before = 0u;
    {
        __shared__ unsigned int totals[32];
        const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
        unsigned int inclusive = local;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const unsigned int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
            if ((int)lane >= offset) inclusive += other;
        }
        if (threadIdx.x == 0) { s_bin = NO_TOKEN; s_above = 0u; s_in = 0u; }
        __syncthreads();
        if (lane == 31u) totals[warp] = inclusive;
        __syncthreads();
        total = 0u;
        for (unsigned int w = 0; w < num_warps; ++w) {
            if (w < warp) before += totals[w];
            total += totals[w];
        }
        before += inclusive - local;
    }
    if (before < remaining && before + local >= remaining) {
        unsigned int running = before;
        for (unsigned int k = per; k-- > 0;) {
            const unsigned int c = counts[first + k];
            if (running + c >= remaining) { s_bin = first + k; s_above = running; s_in = c; break; }
            running += c;
        }
    }
    __syncthreads();
    bin = s_bin;
    above = s_above;
    in_bin = s_in;
    __syncthreads();
}

// Fixes the digit at `shift` of the row's top-k select from its histogram `counts`
// [TOP_K_BINS] (shared; every CTA of the row has added its counts): the next prefix and rank,
// and the threshold when the select ends (see sampling_top_k_digit). After the first digit
// (shift 24, every finite logit counted) a row with at most k finite logits keeps them all.
// Block-wide; thread 0 writes the state.
PAGODA_DEVICE void fix_top_k_digit(const unsigned int* counts, unsigned int shift, const RowParams& p,
                                   unsigned int* st) {
    const unsigned int prefix = st[FS_TOP_K_PREFIX];
    const unsigned int remaining = st[FS_TOP_K_REMAINING];
    unsigned int bin, above, in_bin, counted;
    find_rank_bin(counts, TOP_K_BINS, remaining, bin, above, in_bin, counted);
    if (threadIdx.x != 0) return;
    if (shift == 24u && counted <= p.top_k) { st[FS_TOP_K_PENDING] = 0u; return; }
    if (bin == NO_TOKEN) { st[FS_STATUS] = STATUS_EXACT; return; }  // unreachable: counts add up
    const unsigned int fixed = prefix | (bin << shift);
    st[FS_TOP_K_PREFIX] = fixed;
    st[FS_TOP_K_REMAINING] = remaining - above;
    if (shift == 0u || in_bin == remaining - above) {
        // The bin's lowest value: finite, since the bin holds a finite logit and -FLT_MAX's
        // key is a multiple of every digit's bin width.
        const float kth = from_ordered_bits(fixed);
        st[FS_TOP_K_THRESHOLD] = __float_as_uint(kth);
        st[FS_LOW] = __float_as_uint(fmaxf(__uint_as_float(st[FS_LOW]), next_down(kth)));
        st[FS_TOP_K_PENDING] = 0u;
    }
}

// One 8-bit digit (at `shift`) of the k-th largest finite logit of each ACTIVE row with a
// pending top-k: every CTA counts its split's logits that match the digits fixed so far into
// histogram[row] [TOP_K_BINS] (zeroed again by the last CTA, which fixes the digit; the first
// digit, bits 24-31, is counted by sampling_row_max). The select ends early when the k-th
// largest is the smallest logit of its bin (the bin's count is the rank still to find): then
// every logit at or above the bin's lowest value is in the top k and none between, so that
// value is the threshold (same set, same masses). Else it ends after the last digit with the
// exact k-th largest value.
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
sampling_top_k_digit(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
                     unsigned int num_splits, unsigned int shift, unsigned int* __restrict__ state, unsigned int* __restrict__ histogram,
                     unsigned int* __restrict__ arrive) {
    __shared__ unsigned int counts[TOP_K_BINS];
    const unsigned int row = blockIdx.y, split = blockIdx.x;
    unsigned int* st = state + row * FILTER_STATE_WORDS;
    if (st[FS_STATUS] != STATUS_ACTIVE || st[FS_TOP_K_PENDING] == 0u) return;
    const unsigned int prefix = st[FS_TOP_K_PREFIX];
    const unsigned int bins = TOP_K_BINS;
    const unsigned int mask = shift >= 24u ? 0u : (0xffffffffu << (shift + 8u));
    for (unsigned int d = threadIdx.x; d < bins; d += blockDim.x) counts[d] = 0u;
    __syncthreads();
    unsigned int begin, end;
    split_range(vocab, num_splits, split, begin, end);
    const float* z = logits + (size_t)row * vocab;
    const bool aligned = row_aligned(z);
    for (unsigned int i = begin + threadIdx.x * 4u; i < end; i += blockDim.x * 4u) {
        const float4 v = load4(z, i, end, aligned);
        const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned int key = ordered_bits(values[j]);
            if (values[j] > -INFINITY && (key & mask) == prefix) atomicAdd(&counts[(key >> shift) & (bins - 1u)], 1u);
        }
    }
    __syncthreads();
    unsigned int* h = histogram + (size_t)row * TOP_K_BINS;
    for (unsigned int d = threadIdx.x; d < bins; d += blockDim.x) {
        if (counts[d]) atomicAdd(&h[d], counts[d]);
    }
    if (!last_to_arrive(arrive, row, num_splits)) return;
    // Every CTA of the row has added its counts: plain loads (pipelined; an atomic exchange
    // per bin waited for each in turn), then zero for the next digit.
    for (unsigned int d = threadIdx.x; d < bins; d += blockDim.x) {
        counts[d] = __ldcg(&h[d]);
        h[d] = 0u;
    }
    __syncthreads();
    fix_top_k_digit(counts, shift, load_row_params(params, row), st);
}

// The id lists of rows whose proposal is short (sampling_list.cu): sampling_pass fills them.
#define LIST_CAPACITY 512u  // ids per row list, and threads of sampling_list_rounds
#define LIST_THREADS 512

// Appends id `i` to the row's list when `append` (the lanes of a warp that call it at once
// share one atomic). Ids past LIST_CAPACITY only count: the row then takes the round launches.
PAGODA_DEVICE void list_append(bool append, unsigned int i, unsigned int* list_ids, unsigned int* list_count) {
    const unsigned int active = __activemask();
    const unsigned int ballot = __ballot_sync(active, append);
    if (ballot == 0u) return;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int leader = __ffs(ballot) - 1u;
    unsigned int base = 0u;
    if (lane == leader) base = atomicAdd(list_count, (unsigned int)__popc(ballot));
    base = __shfl_sync(active, base, leader);
    const unsigned int slot = base + __popc(ballot & ((1u << lane) - 1u));
    if (append && slot < LIST_CAPACITY) list_ids[slot] = i;
}
