// GPU sampling, part 4: the exact filtered sampler and the per-row finish. The exact
// sampler draws a filtered row (top-k / top-p / min-p) by dual-pivot rejection from the
// logits with one CTA of 1024 threads (32 warps) and f64 weights computed on the fly (no
// probability array): pagoda_ops' rejection.rs step for step, the differences only in f64
// summation order (see src/ops/sampling/mod.rs). It runs for the rows the multi-CTA
// pipeline (sampling_fast.cu) did not finish, and is the oracle that pipeline defers to.
//
// Warp w owns the contiguous id range warp_range(w) (lanes read it coalesced), so the
// inverse-CDF walk in id order is: prefix over the 32 per-warp masses, then a scan inside
// the owning warp.

#define REJECTION_THREADS 1024

PAGODA_DEVICE void warp_range(unsigned int vocab, unsigned int warp, unsigned int& begin, unsigned int& end) {
    const unsigned int per_warp = ((vocab + 31u) / 32u + 31u) / 32u * 32u;
    begin = min(warp * per_warp, vocab);
    end = min(begin + per_warp, vocab);
}

// The k-th largest finite logit (ties counted) by a 4-pass radix select over ordered_bits
// (no sort). False when at most k logits are finite (top-k keeps everything). Block-wide.
PAGODA_DEVICE bool kth_largest(const float* z, unsigned int vocab, unsigned int k, float& kth) {
    __shared__ unsigned int histogram[256];
    __shared__ unsigned int s_prefix, s_remaining;
    unsigned int finite = 0;
    for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) finite += sanitize_logit(z[i]) > -INFINITY;
    if (block_sum_u32(finite) <= k) return false;
    if (threadIdx.x == 0) { s_prefix = 0u; s_remaining = k; }
    unsigned int mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (unsigned int d = threadIdx.x; d < 256u; d += blockDim.x) histogram[d] = 0u;
        __syncthreads();
        const unsigned int prefix = s_prefix;
        for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = sanitize_logit(z[i]);
            const unsigned int key = ordered_bits(v);
            if (v > -INFINITY && (key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int remaining = s_remaining;
            for (int d = 255; d >= 0; --d) {
                if (histogram[d] >= remaining) { s_prefix = prefix | ((unsigned int)d << shift); break; }
                remaining -= histogram[d];
            }
            s_remaining = remaining;
        }
        mask |= 255u << shift;
        __syncthreads();
    }
    kth = from_ordered_bits(s_prefix);
    return true;
}

// The draw weights of a row: the rounds' canonical f32 weights (draw_weight), or the f64
// weights of the fallback's draw from the chain's support (weight_of, as the CPU chain).
struct DrawWeights {
    float z_max, scale;
    double z_max64, inverse_temperature;
    bool canonical;
    PAGODA_DEVICE double operator()(float v) const {
        return canonical ? (double)draw_weight(v, z_max, scale) : weight_of(v, z_max64, inverse_temperature);
    }
};

// warp_mass[w] = draw mass of {z > low} in warp w's range. Block-wide.
PAGODA_DEVICE void proposal_masses(const float* z, unsigned int vocab, float low, const DrawWeights& weight_of_draw,
                                   double* warp_mass) {
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    unsigned int begin, end;
    warp_range(vocab, warp, begin, end);
    double mass = 0.0;
    for (unsigned int i = begin + lane; i < end; i += 32u) {
        const float v = sanitize_logit(z[i]);
        if (v > low) mass += weight_of_draw(v);
    }
    mass = warp_sum_f64(mass);
    __syncthreads();
    if (lane == 0) warp_mass[warp] = mass;
    __syncthreads();
}

// Inverse-CDF draw in id order over {z > low} weighted by weight_of_draw: the first id whose
// cumulative weight exceeds uniform * total (the last positive-weight id if rounding leaves
// the target uncrossed; `otherwise` if the proposal is empty). Block-wide.
PAGODA_DEVICE unsigned int walk_proposal(const float* z, unsigned int vocab, float low,
                                         const DrawWeights& weight_of_draw, double uniform, const double* warp_mass,
                                         unsigned int otherwise) {
    __shared__ unsigned int s_candidate;
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    double total = 0.0;
    for (int w = 0; w < 32; ++w) total += warp_mass[w];
    const double target = __dmul_rn(uniform, total);
    int owner = -1, last_positive_warp = -1;
    double before = 0.0, prefix = 0.0;
    for (int w = 0; w < 32; ++w) {
        if (warp_mass[w] > 0.0) {
            last_positive_warp = w;
            if (owner < 0 && prefix + warp_mass[w] > target) { owner = w; before = prefix; }
            prefix += warp_mass[w];
        }
    }
    const bool force_last = owner < 0;
    if (force_last) owner = last_positive_warp;
    if (threadIdx.x == 0) s_candidate = otherwise;
    __syncthreads();
    if ((int)warp == owner) {
        unsigned int begin, end;
        warp_range(vocab, warp, begin, end);
        double running = before;
        unsigned int found = NO_TOKEN, last = NO_TOKEN;
        for (unsigned int base = begin; base < end && found == NO_TOKEN; base += 32u) {
            const unsigned int i = base + lane;
            const float v = i < end ? sanitize_logit(z[i]) : -INFINITY;
            const double weight = v > low ? weight_of_draw(v) : 0.0;
            double inclusive = weight;
#pragma unroll
            for (int offset = 1; offset < 32; offset <<= 1) {
                const double other = __shfl_up_sync(0xffffffffu, inclusive, offset);
                if ((int)lane >= offset) inclusive += other;
            }
            const double cumulative = running + inclusive;
            const unsigned int crossing = __ballot_sync(0xffffffffu, !force_last && weight > 0.0 && cumulative > target);
            const unsigned int positive = __ballot_sync(0xffffffffu, weight > 0.0);
            if (crossing) found = base + __ffs(crossing) - 1;
            else if (positive) last = base + 31 - __clz(positive);
            running = __shfl_sync(0xffffffffu, cumulative, 31);
        }
        if (lane == 0 && (found != NO_TOKEN || last != NO_TOKEN)) s_candidate = found != NO_TOKEN ? found : last;
    }
    __syncthreads();
    const unsigned int candidate = s_candidate;
    __syncthreads();
    return candidate;
}

// Block sum of exp(z - z_max) over {z > value} (the untempered mass strictly above value).
PAGODA_DEVICE double mass_above(const float* z, unsigned int vocab, float value, double z_max) {
    double mass = 0.0;
    for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = sanitize_logit(z[i]);
        if (v > value) mass += weight_of(v, z_max, 1.0);
    }
    return block_sum_f64(mass);
}

// One filtered row, exactly (block-wide, REJECTION_THREADS): dual-pivot rejection with at
// most max_rounds rounds, round r drawing its uniform from Philox block r of (seed, step,
// RejectionRound); on an ambiguous top-p test or the round cap, the counted exact fallback:
// the chain's support threshold by bit bisection, then an inverse-CDF draw with the
// (seed, step, Fallback) uniform. Writes tokens[row], stats[row] = {path, rounds}, bumps the
// totals.
PAGODA_DEVICE void exact_filtered_row(const float* __restrict__ z, const RowParams& p, unsigned int vocab,
                                      unsigned int row, float z_max, unsigned int argmax, unsigned int max_rounds,
                                      unsigned int* __restrict__ tokens, unsigned int* __restrict__ stats,
                                      unsigned int* __restrict__ totals) {
    __shared__ double warp_mass[32], warp_draw0[32], warp_draw1[32];
    __shared__ float s_threshold;
    __shared__ int s_ok;
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const double z_max64 = z_max;
    const DrawWeights rounds_weight{z_max, draw_scale(p.temperature), z_max64, 0.0, true};
    const DrawWeights fallback_weight{z_max, 0.0f, z_max64, __ddiv_rn(1.0, (double)p.temperature), false};
    const bool use_top_p = top_p_active(p);
    const bool use_top_k = p.top_k > 0u && p.top_k < vocab;
    bool fallback = false;
    float low = -INFINITY;
    float min_p_floor = -INFINITY;  // smallest passing f32 of min-p (z_max if none passes)
    if (min_p_active(p)) {
        if (threadIdx.x == 0) {
            float threshold = z_max;
            s_ok = min_p_threshold(z_max, p.min_p, threshold);
            s_threshold = threshold;
        }
        __syncthreads();
        min_p_floor = s_threshold;
        if (s_ok) low = next_down(min_p_floor); else fallback = true;
        __syncthreads();
    }
    float top_k_threshold = -INFINITY;
    if (use_top_k) {
        float kth;
        if (kth_largest(z, vocab, p.top_k, kth)) {
            top_k_threshold = kth;
            low = fmaxf(low, next_down(kth));
        }
    }
    // Z_k: the untempered mass of the top-k set (every finite token without top-k).
    double top_k_mass = 0.0;
    if (use_top_p) {
        for (unsigned int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = sanitize_logit(z[i]);
            if (v >= top_k_threshold && v > -INFINITY) top_k_mass += weight_of(v, z_max64, 1.0);
        }
        top_k_mass = block_sum_f64(top_k_mass);
    }
    const double mass_target = __dmul_rn((double)p.top_p, top_k_mass);
    const double margin = rounding_margin(vocab, top_k_mass);
    unsigned int rounds = 0, token = argmax;
    if (!fallback) {
        proposal_masses(z, vocab, low, rounds_weight, warp_mass);
        float high = z_max;
        bool accepted = false;
        for (unsigned int round = 0; round < max_rounds && !accepted && !fallback; ++round) {
            const uint4 block = philox_block(p, PURPOSE_REJECTION_ROUND, round);
            const double uniform = open_uniform_f64(block.x, block.y);
            const unsigned int candidate =
                walk_proposal(z, vocab, low, rounds_weight, uniform, warp_mass, argmax);
            rounds = round + 1;
            const float pivot0 = sanitize_logit(z[candidate]);
            if (!use_top_p || pivot0 >= high) { token = candidate; accepted = true; break; }
            const unsigned int low_bits = ordered_bits(pivot0), high_bits = ordered_bits(high);
            const float pivot1 = from_ordered_bits(low_bits + (high_bits - low_bits) / 2u);
            unsigned int begin, end;
            warp_range(vocab, warp, begin, end);
            double mass0 = 0.0, mass1 = 0.0, draw0 = 0.0, draw1 = 0.0;
            for (unsigned int i = begin + lane; i < end; i += 32u) {
                const float v = sanitize_logit(z[i]);
                if (v > pivot0) {
                    const double filter_weight = weight_of(v, z_max64, 1.0);
                    const double weight = rounds_weight(v);
                    mass0 += filter_weight;
                    draw0 += weight;
                    if (v > pivot1) { mass1 += filter_weight; draw1 += weight; }
                }
            }
            draw0 = warp_sum_f64(draw0);
            draw1 = warp_sum_f64(draw1);
            if (lane == 0) { warp_draw0[warp] = draw0; warp_draw1[warp] = draw1; }
            mass0 = block_sum_f64(mass0);  // its barriers publish warp_draw0/1
            mass1 = block_sum_f64(mass1);
            const int verdict0 = top_p_verdict(mass0, mass_target, margin);
            if (verdict0 == VERDICT_PASS) { token = candidate; accepted = true; break; }
            if (verdict0 == VERDICT_AMBIGUOUS) { fallback = true; break; }
            const int verdict1 = top_p_verdict(mass1, mass_target, margin);
            if (verdict1 == VERDICT_FAIL) {
                low = pivot1;
                if (threadIdx.x < 32) warp_mass[threadIdx.x] = warp_draw1[threadIdx.x];
            } else {
                low = pivot0;
                if (verdict1 == VERDICT_PASS) high = pivot1;
                if (threadIdx.x < 32) warp_mass[threadIdx.x] = warp_draw0[threadIdx.x];
            }
            __syncthreads();
        }
        if (!accepted) fallback = true;
    }
    if (fallback) {
        // Exact support {z >= threshold}: top-k and min-p floors, then the smallest f32 v
        // with mass(z > v) < top_p * Z_k by bisection of the ordered bits.
        float threshold = fmaxf(top_k_threshold, min_p_floor);
        if (use_top_p) {
            unsigned int lo = ordered_bits(threshold), hi = ordered_bits(z_max);
            while (lo < hi) {
                const unsigned int mid = lo + (hi - lo) / 2u;
                if (mass_above(z, vocab, from_ordered_bits(mid), z_max64) < mass_target) hi = mid; else lo = mid + 1u;
            }
            threshold = fmaxf(threshold, from_ordered_bits(lo));
        }
        const float fallback_low = threshold == -INFINITY ? -INFINITY : next_down(threshold);
        proposal_masses(z, vocab, fallback_low, fallback_weight, warp_mass);
        const uint4 block = philox_block(p, PURPOSE_FALLBACK, 0u);
        const double uniform = open_uniform_f64(block.x, block.y);
        token = walk_proposal(z, vocab, fallback_low, fallback_weight, uniform, warp_mass, argmax);
    }
    if (threadIdx.x == 0) {
        const unsigned int path = fallback ? PATH_FALLBACK : PATH_REJECTION;
        tokens[row] = token;
        stats[2 * row] = path;
        stats[2 * row + 1] = rounds;
        count_total(totals, path, 1ull);
        count_total(totals, 4u, (unsigned long long)rounds);
        count_total(totals, 6u, 1ull);
    }
}

// One CTA per row, after every other sampling kernel; the row maximum comes from the filter
// state sampling_row_max wrote, or with FLAG_GUMBEL_MAX from sampling_gumbel's per-split
// maxima (the state is then not used: no row is in the filtered pipeline). Greedy rows take
// the argmax (lowest id on ties, 0 without a finite logit); Gumbel rows the best partial of
// sampling_gumbel (with FLAG_GUMBEL_MAX: its candidates scored exactly here, or the whole
// row when a split kept too many; without FLAG_GUMBEL, a scan of the whole row); filtered
// rows the multi-CTA pipeline did not finish (status not DONE) are drawn by
// exact_filtered_row. Writes tokens[row] and stats[row] = {path, rounds} and bumps the totals
// for every row not already DONE.
extern "C" __global__ void __launch_bounds__(REJECTION_THREADS)
sampling_finish(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
                unsigned int num_splits, unsigned int flags, unsigned int max_rounds,
                const float* __restrict__ partial_score, const unsigned int* __restrict__ partial_id,
                const float* __restrict__ partial_max, const unsigned int* __restrict__ partial_index,
                const unsigned int* __restrict__ gumbel_ids, const unsigned int* __restrict__ gumbel_count,
                const unsigned int* __restrict__ state, unsigned int* __restrict__ tokens,
                unsigned int* __restrict__ stats, unsigned int* __restrict__ totals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Launched programmatically after sampling_cluster: wait for it (a no-op otherwise).
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const unsigned int row = blockIdx.x;
    const bool gumbel_max = flags & FLAG_GUMBEL_MAX;
    const unsigned int* st = state + row * FILTER_STATE_WORDS;
    if (!gumbel_max && st[FS_STATUS] == STATUS_DONE) return;
    const RowParams p = load_row_params(params, row);
    float z_max;
    unsigned int argmax;
    if (gumbel_max) {
        reduce_row_max(partial_max, partial_index, row, num_splits, z_max, argmax);
    } else {
        z_max = __uint_as_float(st[FS_Z_MAX]);
        argmax = st[FS_ARGMAX];
    }
    const float* z = logits + (size_t)row * vocab;
    const unsigned int path = row_path(p, vocab, z_max);
    if (path == PATH_REJECTION) {
        exact_filtered_row(z, p, vocab, row, z_max, argmax, max_rounds, tokens, stats, totals);
        if (gumbel_max && threadIdx.x == 0) count_total(totals, 7u, 1ull);
        return;
    }
    unsigned int token = argmax;
    if (path == PATH_GUMBEL) {
        float best = -INFINITY;
        unsigned int best_id = NO_TOKEN;
        if (gumbel_max) {
            __shared__ unsigned int s_overflow;
            if (threadIdx.x == 0) s_overflow = 0u;
            __syncthreads();
            const float inverse_temperature = __double2float_rn(__ddiv_rn(1.0, (double)p.temperature));
            for (unsigned int c = threadIdx.x; c < num_splits * GUMBEL_SPLIT_KEPT; c += blockDim.x) {
                const unsigned int split = c / GUMBEL_SPLIT_KEPT, k = c % GUMBEL_SPLIT_KEPT;
                const unsigned int count = gumbel_count[row * num_splits + split];
                if (count == GUMBEL_OVERFLOW) { s_overflow = 1u; continue; }
                if (k >= count) continue;
                const unsigned int id = gumbel_ids[((size_t)row * num_splits + split) * GUMBEL_SPLIT_KEPT + k];
                const float tempered = __fmul_rn(__fsub_rn(sanitize_logit(z[id]), z_max), inverse_temperature);
                const float score = exact_gumbel_score(p, tempered, id);
                if (better(score, id, best, best_id)) { best = score; best_id = id; }
            }
            __syncthreads();
            if (s_overflow) {
                gumbel_range(z, 0u, vocab, p, z_max, best, best_id);
            } else {
                block_argmax(best, best_id);
            }
        } else if (flags & FLAG_GUMBEL) {
            for (unsigned int s = threadIdx.x; s < num_splits; s += blockDim.x) {
                const float score = partial_score[row * num_splits + s];
                const unsigned int id = partial_id[row * num_splits + s];
                if (better(score, id, best, best_id)) { best = score; best_id = id; }
            }
            block_argmax(best, best_id);
        } else {
            gumbel_range(z, 0u, vocab, p, z_max, best, best_id);
        }
        // Unreachable (the argmax element has a finite score): keep the argmax then.
        if (best_id != NO_TOKEN) token = best_id;
    }
    if (threadIdx.x == 0) {
        tokens[row] = token;
        stats[2 * row] = path;
        stats[2 * row + 1] = 0u;
        count_total(totals, path, 1ull);
        if (gumbel_max) count_total(totals, 7u, 1ull);
    }
}
