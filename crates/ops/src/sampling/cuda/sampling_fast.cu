// GPU sampling, part 3: the multi-CTA filtered passes. sampling_pass computes, for each
// ACTIVE filtered row, the top-k mass Z_k and the proposal's per-segment masses, after which
// the row's last CTA draws round 0's candidate;
// sampling_round (launched a few times) computes the masses above the candidate (pivot0)
// and above the midpoint pivot (pivot1), and the row's last CTA takes the verdicts of
// pagoda_ops' dual-pivot rejection and draws the next candidate. Draw weights are the
// canonical f32 ones (draw_weight, the exact kernel's and the CPU's bits) summed in f64, so
// the walks differ only in summation order; filter masses are f32 weights summed in f64.
// Every decision within its tolerance of a boundary (walk_margin, rounding_margin,
// FAST_MASS_TOLERANCE), and every row still ACTIVE after the last round launch, is left to
// the exact kernel, which redraws the row from the start: the fast path only ever returns the
// exact kernel's token.

#define VERDICT_PASS 0
#define VERDICT_FAIL 1
#define VERDICT_AMBIGUOUS 2
#define VERDICT_UNSURE 3

// The exact kernel's top-p test: mass strictly above the candidate against top_p * Z_k.
PAGODA_DEVICE int top_p_verdict(double mass_above, double mass_target, double margin) {
    if (fabs(mass_above - mass_target) <= margin) return VERDICT_AMBIGUOUS;
    return mass_above >= mass_target ? VERDICT_FAIL : VERDICT_PASS;
}

// top_p_verdict from fast masses: UNSURE when the exact masses could give another verdict.
PAGODA_DEVICE int fast_verdict(double mass_above, double mass_target, double margin, double tolerance) {
    if (fabs(fabs(mass_above - mass_target) - margin) <= tolerance) return VERDICT_UNSURE;
    return top_p_verdict(mass_above, mass_target, margin);
}

// Accepts `candidate` for the row (one thread).
PAGODA_DEVICE void accept_fast(unsigned int row, unsigned int candidate, unsigned int rounds, unsigned int* st,
                               unsigned int* tokens, unsigned int* stats, unsigned int* totals) {
    tokens[row] = candidate;
    stats[2 * row] = PATH_REJECTION;
    stats[2 * row + 1] = rounds;
    st[FS_STATUS] = STATUS_DONE;
    count_total(totals, PATH_REJECTION, 1ull);
    count_total(totals, 4u, (unsigned long long)rounds);
    count_total(totals, 5u, 1ull);
}

// Round `round` of the row: its uniform, the fast walk over the proposal {z > low} whose
// segment masses are `segment_mass`, then the new candidate (accepted at once without top-p
// or when it reaches `high`). Block-wide (the row's last CTA).
PAGODA_DEVICE void begin_round(const RowParams& p, const float* z, unsigned int vocab, unsigned int num_splits,
                               const double* segment_mass, float low, float high, float z_max,
                               unsigned int round, unsigned int max_rounds, unsigned int row, unsigned int* st,
                               unsigned int* tokens, unsigned int* stats, unsigned int* totals) {
    if (round >= max_rounds) {
        if (threadIdx.x == 0) st[FS_STATUS] = STATUS_EXACT;
        return;
    }
    const uint4 block = philox_block(p, PURPOSE_REJECTION_ROUND, round);
    const double uniform = open_uniform_f64(block.x, block.y);
    const unsigned int candidate =
        fast_walk(z, vocab, num_splits, segment_mass, low, z_max, draw_scale(p.temperature), uniform);
    if (threadIdx.x != 0) return;
    if (candidate == NO_TOKEN) { st[FS_STATUS] = STATUS_EXACT; return; }
    st[FS_ROUNDS] = round + 1u;
    st[FS_CANDIDATE] = candidate;
    st[FS_LOW] = __float_as_uint(low);
    st[FS_HIGH] = __float_as_uint(high);
    if (!top_p_active(p) || sanitize_logit(z[candidate]) >= high) accept_fast(row, candidate, round + 1u, st, tokens, stats, totals);
}

// Sum over the row's splits of split_mass[(row * num_splits + s) * 2 + slot] (fixed order).
PAGODA_DEVICE double row_split_sum(const double* split_mass, unsigned int row, unsigned int num_splits, unsigned int slot) {
    double value = 0.0;
    for (unsigned int s = threadIdx.x; s < num_splits; s += blockDim.x) {
        value += __ldcg(split_mass + ((size_t)row * num_splits + s) * 2u + slot);
    }
    return block_sum_f64(value);
}

// Grid (num_splits, rows); ACTIVE filtered rows only: per split the fast top-k mass
// (split_mass slot 0) and per segment the proposal's f64 draw mass (segment_draw0); the last
// CTA of the row stores Z_k and begins round 0. `split_mass` and the segment arrays are f64.
// LISTED: also fill the id lists of sampling_list_rounds (sampling_pass_listed); the other
// instance is the pass of launches without top-k rows, free of the append.
template <bool LISTED>
PAGODA_DEVICE void pass_body(const float* __restrict__ logits, const unsigned int* __restrict__ params,
                             unsigned int vocab, unsigned int num_splits, unsigned int max_rounds,
                             unsigned int* __restrict__ state, double* __restrict__ split_mass,
                             double* __restrict__ segment_draw0, unsigned int* __restrict__ arrive,
                             unsigned int* __restrict__ tokens, unsigned int* __restrict__ stats,
                             unsigned int* __restrict__ totals, unsigned int* __restrict__ list_ids,
                             unsigned int* __restrict__ list_count) {
    __shared__ double warp_mass[SEGMENTS];
    const unsigned int row = blockIdx.y, split = blockIdx.x, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    unsigned int* st = state + row * FILTER_STATE_WORDS;
    if (st[FS_STATUS] != STATUS_ACTIVE) return;
    const RowParams p = load_row_params(params, row);
    const float* z = logits + (size_t)row * vocab;
    const float z_max = __uint_as_float(st[FS_Z_MAX]);
    const float low = __uint_as_float(st[FS_LOW]), threshold = __uint_as_float(st[FS_TOP_K_THRESHOLD]);
    const float scale = draw_scale(p.temperature);
    const bool use_top_p = top_p_active(p), aligned = row_aligned(z);
    // A top-p row with its top-k threshold set and k <= LIST_CAPACITY lists its proposal for
    // sampling_list_rounds (launched whenever a top-k threshold can be set).
    const bool listed = LISTED && use_top_p && threshold > -INFINITY && p.top_k <= LIST_CAPACITY;
    unsigned int* row_list = LISTED ? list_ids + (size_t)row * LIST_CAPACITY : nullptr;
    unsigned int begin, end;
    segment_range(vocab, num_splits, split * SEGMENTS + warp, begin, end);
    double top_k_mass = 0.0, draw = 0.0;
    for (unsigned int i = begin + lane * 4u; i < end; i += 128u) {
        const float4 v = load4(z, i, end, aligned);
        const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float weight = values[j] > low ? draw_weight(values[j], z_max, scale) : 0.0f;
            draw += (double)weight;
            if (use_top_p && values[j] >= threshold) {
                top_k_mass += (double)(scale == 1.0f && values[j] > low ? weight : fast_weight(values[j], z_max, 1.0f));
            }
            if (listed) list_append(values[j] > low, i + j, row_list, list_count + row);
        }
    }
    top_k_mass = warp_sum_f64(top_k_mass);
    draw = warp_sum_f64(draw);
    const unsigned int segments = num_splits * SEGMENTS;
    if (lane == 0) {
        segment_draw0[(size_t)row * segments + split * SEGMENTS + warp] = draw;
        warp_mass[warp] = top_k_mass;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (unsigned int w = 0; w < SEGMENTS; ++w) sum += warp_mass[w];
        split_mass[((size_t)row * num_splits + split) * 2u] = sum;
    }
    if (!last_to_arrive(arrive, row, num_splits)) return;
    const double total = row_split_sum(split_mass, row, num_splits, 0u);
    if (threadIdx.x == 0) set_state_f64(st, FS_TOP_K_MASS, total);
    begin_round(p, z, vocab, num_splits, segment_draw0 + (size_t)row * segments, low, z_max, z_max, 0u, max_rounds,
                row, st, tokens, stats, totals);
}

extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
sampling_pass(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
              unsigned int num_splits, unsigned int max_rounds, unsigned int* __restrict__ state,
              double* __restrict__ split_mass, double* __restrict__ segment_draw0, unsigned int* __restrict__ arrive,
              unsigned int* __restrict__ tokens, unsigned int* __restrict__ stats, unsigned int* __restrict__ totals) {
    pass_body<false>(logits, params, vocab, num_splits, max_rounds, state, split_mass, segment_draw0, arrive, tokens,
                     stats, totals, nullptr, nullptr);
}

// sampling_pass that also appends the proposal of every top-p row with a top-k threshold and
// k <= LIST_CAPACITY to its list [rows, LIST_CAPACITY] (count in list_count [rows], zeroed by
// sampling_list_rounds, which must follow).
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
sampling_pass_listed(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
                     unsigned int num_splits, unsigned int max_rounds, unsigned int* __restrict__ state,
                     double* __restrict__ split_mass, double* __restrict__ segment_draw0,
                     unsigned int* __restrict__ arrive, unsigned int* __restrict__ tokens,
                     unsigned int* __restrict__ stats, unsigned int* __restrict__ totals,
                     unsigned int* __restrict__ list_ids, unsigned int* __restrict__ list_count) {
    pass_body<true>(logits, params, vocab, num_splits, max_rounds, state, split_mass, segment_draw0, arrive, tokens,
                    stats, totals, list_ids, list_count);
}

// Grid (num_splits, rows); ACTIVE rows only (launch it a few times). Masses above pivot0 (the
// candidate's logit) and pivot1 (the ordered-bits midpoint of pivot0 and high): untempered
// per split (split_mass slots 0 and 1), tempered per segment (segment_draw0 / 1). The last
// CTA of the row takes the verdicts and begins the next round over {z > pivot1} or
// {z > pivot0}, as pagoda_ops' rejection loop does.
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
sampling_round(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
               unsigned int num_splits, unsigned int max_rounds, unsigned int* __restrict__ state,
               double* __restrict__ split_mass, double* __restrict__ segment_draw0,
               double* __restrict__ segment_draw1, unsigned int* __restrict__ arrive,
               unsigned int* __restrict__ tokens, unsigned int* __restrict__ stats,
               unsigned int* __restrict__ totals) {
    __shared__ double warp_mass0[SEGMENTS], warp_mass1[SEGMENTS];
    const unsigned int row = blockIdx.y, split = blockIdx.x, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    unsigned int* st = state + row * FILTER_STATE_WORDS;
    if (st[FS_STATUS] != STATUS_ACTIVE) return;
    const RowParams p = load_row_params(params, row);
    const float* z = logits + (size_t)row * vocab;
    const float z_max = __uint_as_float(st[FS_Z_MAX]), high = __uint_as_float(st[FS_HIGH]);
    const float pivot0 = sanitize_logit(z[st[FS_CANDIDATE]]);
    const unsigned int low_bits = ordered_bits(pivot0), high_bits = ordered_bits(high);
    const float pivot1 = from_ordered_bits(low_bits + (high_bits - low_bits) / 2u);
    const float scale = draw_scale(p.temperature);
    const bool aligned = row_aligned(z);
    unsigned int begin, end;
    segment_range(vocab, num_splits, split * SEGMENTS + warp, begin, end);
    double mass0 = 0.0, mass1 = 0.0, draw0 = 0.0, draw1 = 0.0;
    for (unsigned int i = begin + lane * 4u; i < end; i += 128u) {
        const float4 v = load4(z, i, end, aligned);
        const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (values[j] > pivot0) {
                const double weight = draw_weight(values[j], z_max, scale);
                const double filter = scale == 1.0f ? weight : (double)fast_weight(values[j], z_max, 1.0f);
                mass0 += filter;
                draw0 += weight;
                if (values[j] > pivot1) { mass1 += filter; draw1 += weight; }
            }
        }
    }
    mass0 = warp_sum_f64(mass0);
    mass1 = warp_sum_f64(mass1);
    draw0 = warp_sum_f64(draw0);
    draw1 = warp_sum_f64(draw1);
    const unsigned int segments = num_splits * SEGMENTS;
    if (lane == 0) {
        segment_draw0[(size_t)row * segments + split * SEGMENTS + warp] = draw0;
        segment_draw1[(size_t)row * segments + split * SEGMENTS + warp] = draw1;
        warp_mass0[warp] = mass0;
        warp_mass1[warp] = mass1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum0 = 0.0, sum1 = 0.0;
        for (unsigned int w = 0; w < SEGMENTS; ++w) { sum0 += warp_mass0[w]; sum1 += warp_mass1[w]; }
        split_mass[((size_t)row * num_splits + split) * 2u] = sum0;
        split_mass[((size_t)row * num_splits + split) * 2u + 1u] = sum1;
    }
    if (!last_to_arrive(arrive, row, num_splits)) return;
    const double above0 = row_split_sum(split_mass, row, num_splits, 0u);
    const double above1 = row_split_sum(split_mass, row, num_splits, 1u);
    const double top_k_mass = state_f64(st, FS_TOP_K_MASS);
    const double mass_target = __dmul_rn((double)p.top_p, top_k_mass);
    const double margin = rounding_margin(vocab, top_k_mass), tolerance = FAST_MASS_TOLERANCE * top_k_mass;
    const unsigned int rounds = st[FS_ROUNDS], candidate = st[FS_CANDIDATE];
    const int verdict0 = fast_verdict(above0, mass_target, margin, tolerance);
    const int verdict1 = fast_verdict(above1, mass_target, margin, tolerance);
    __syncthreads();  // every thread has read the state before thread 0 changes it
    if (verdict0 == VERDICT_PASS) {
        if (threadIdx.x == 0) accept_fast(row, candidate, rounds, st, tokens, stats, totals);
        return;
    }
    if (verdict0 != VERDICT_FAIL || verdict1 == VERDICT_UNSURE) {
        if (threadIdx.x == 0) st[FS_STATUS] = STATUS_EXACT;
        return;
    }
    const bool above_pivot1 = verdict1 == VERDICT_FAIL;
    const float low = above_pivot1 ? pivot1 : pivot0;
    const float next_high = verdict1 == VERDICT_PASS ? pivot1 : high;
    const double* proposal = (above_pivot1 ? segment_draw1 : segment_draw0) + (size_t)row * segments;
    begin_round(p, z, vocab, num_splits, proposal, low, next_high, z_max, rounds, max_rounds, row, st, tokens,
                stats, totals);
}
