// GPU sampling, part 3b: the dual-pivot rounds of a filtered row whose proposal is short, in
// one CTA over a list of its ids instead of round launches over the whole row.
//
// A row with a top-k of at most LIST_CAPACITY has its proposal {z > low} inside the top-k
// set once the select is done, and every later proposal and every mass a round tests lies
// above the candidate, so inside it too. sampling_pass appends those ids to the row's list;
// sampling_list_rounds sorts them (the walk is in id order) and runs sampling_round's
// verdicts and begin_round's draws on them, with the same weights, margins and tolerances
// and the same Philox draws, until the row is accepted or left to the exact kernel. Only the
// f64 summation order differs from the round launches, which the margins cover: the tokens
// are the exact kernel's. The round launches then find the row finished.

// Inverse-CDF draw over the sorted list restricted to {z > low}, as fast_walk: thread t holds
// list element t (`value`, `weight` = its draw weight, 0 when absent). NO_TOKEN when the
// target lies within walk_margin of the cumulative weight before or after the chosen id.
// Block-wide.
PAGODA_DEVICE unsigned int list_walk(const unsigned int* ids, float value, double weight, float low,
                                     unsigned int vocab, double uniform) {
    __shared__ unsigned int s_found, s_unsure;
    const double w = value > low ? weight : 0.0;
    double total;
    const double before = block_exclusive_scan_f64(w, total);
    const double target = __dmul_rn(uniform, total);
    const double margin = walk_margin(vocab, total);
    if (threadIdx.x == 0) { s_found = NO_TOKEN; s_unsure = 0u; }
    __syncthreads();
    const double next = before + w;
    if (w > 0.0 && before <= target && next > target) {
        atomicMin(&s_found, threadIdx.x);
        if (before > target - margin || next <= target + margin) s_unsure = 1u;
    }
    __syncthreads();
    const unsigned int found = s_unsure || s_found == NO_TOKEN ? NO_TOKEN : ids[s_found];
    __syncthreads();
    return found;
}

// Grid (rows); LIST_THREADS threads. ACTIVE rows whose list holds all their proposal (count
// at most LIST_CAPACITY; sampling_pass filled it): sampling_round's rounds on the list. Every
// row's list count is zeroed for the next launch.
extern "C" __global__ void __launch_bounds__(LIST_THREADS)
sampling_list_rounds(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
                     unsigned int max_rounds, unsigned int* __restrict__ state, const unsigned int* __restrict__ list_ids,
                     unsigned int* __restrict__ list_count, unsigned int* __restrict__ tokens,
                     unsigned int* __restrict__ stats, unsigned int* __restrict__ totals) {
    __shared__ unsigned int ids[LIST_CAPACITY];
    const unsigned int row = blockIdx.x, t = threadIdx.x;
    unsigned int* st = state + row * FILTER_STATE_WORDS;
    const unsigned int count = list_count[row];
    const unsigned int status = st[FS_STATUS];
    __syncthreads();  // every thread has read the count before it is zeroed
    if (t == 0) list_count[row] = 0u;
    if (status != STATUS_ACTIVE || count == 0u || count > LIST_CAPACITY) return;
    // Ascending ids (bitonic sort; NO_TOKEN pads sort last).
    ids[t] = t < count ? __ldcg(list_ids + (size_t)row * LIST_CAPACITY + t) : NO_TOKEN;
    __syncthreads();
    for (unsigned int k = 2u; k <= LIST_CAPACITY; k <<= 1) {
        for (unsigned int j = k >> 1; j > 0u; j >>= 1) {
            const unsigned int partner = t ^ j;
            if (partner > t) {
                const unsigned int a = ids[t], b = ids[partner];
                if ((a > b) == ((t & k) == 0u)) { ids[t] = b; ids[partner] = a; }
            }
            __syncthreads();
        }
    }
    const RowParams p = load_row_params(params, row);
    const float* z = logits + (size_t)row * vocab;
    const float z_max = __uint_as_float(st[FS_Z_MAX]);
    const float scale = draw_scale(p.temperature);
    const float value = t < count ? sanitize_logit(z[ids[t]]) : -INFINITY;
    const double weight = value > -INFINITY ? (double)draw_weight(value, z_max, scale) : 0.0;
    const double filter = scale == 1.0f ? weight : value > -INFINITY ? (double)fast_weight(value, z_max, 1.0f) : 0.0;
    const double top_k_mass = state_f64(st, FS_TOP_K_MASS);
    const double mass_target = __dmul_rn((double)p.top_p, top_k_mass);
    const double margin = rounding_margin(vocab, top_k_mass), tolerance = FAST_MASS_TOLERANCE * top_k_mass;
    unsigned int rounds = st[FS_ROUNDS], candidate = st[FS_CANDIDATE];
    float high = __uint_as_float(st[FS_HIGH]);
    __syncthreads();  // every thread has read the state before thread 0 changes it
    for (;;) {
        // sampling_round: the verdicts at pivot0 (the candidate) and pivot1.
        const float pivot0 = sanitize_logit(z[candidate]);
        const unsigned int low_bits = ordered_bits(pivot0), high_bits = ordered_bits(high);
        const float pivot1 = from_ordered_bits(low_bits + (high_bits - low_bits) / 2u);
        const double above0 = block_sum_f64(value > pivot0 ? filter : 0.0);
        const double above1 = block_sum_f64(value > pivot1 ? filter : 0.0);
        const int verdict0 = fast_verdict(above0, mass_target, margin, tolerance);
        const int verdict1 = fast_verdict(above1, mass_target, margin, tolerance);
        if (verdict0 == VERDICT_PASS) {
            if (t == 0) { accept_fast(row, candidate, rounds, st, tokens, stats, totals); count_total(totals, 8u, 1ull); }
            return;
        }
        if (verdict0 != VERDICT_FAIL || verdict1 == VERDICT_UNSURE || rounds >= max_rounds) {
            if (t == 0) st[FS_STATUS] = STATUS_EXACT;
            return;
        }
        const float low = verdict1 == VERDICT_FAIL ? pivot1 : pivot0;
        if (verdict1 == VERDICT_PASS) high = pivot1;
        // begin_round: the next candidate over {z > low}.
        const uint4 block = philox_block(p, PURPOSE_REJECTION_ROUND, rounds);
        const unsigned int next = list_walk(ids, value, weight, low, vocab, open_uniform_f64(block.x, block.y));
        if (next == NO_TOKEN) {
            if (t == 0) st[FS_STATUS] = STATUS_EXACT;
            return;
        }
        rounds += 1u;
        candidate = next;
        if (sanitize_logit(z[candidate]) >= high) {
            if (t == 0) { accept_fast(row, candidate, rounds, st, tokens, stats, totals); count_total(totals, 8u, 1ull); }
            return;
        }
    }
}
