// GPU sampling, part 2: the row maximum (and, in its last CTA per row, the row's filter
// state) and the Gumbel-max scan of unfiltered rows. Grid of the split kernels:
// (num_splits, rows), blocks of SPLIT_THREADS; each (row, split) CTA covers split_range().

// Bound on |approx_gumbel_noise(w) - gumbel_noise(w)|, with 25x headroom: the fast
// logarithms (__logf: 2^-21.4 absolute on [0.5, 2], 3 ulp elsewhere) keep the approximate
// noise within about 4e-5 of the ported Cephes one over the whole noise range.
#define GUMBEL_APPROX_ERROR 1e-3f

// gumbel_noise(word) through the fast hardware logarithm (two MUFU.LG2, no divergence): only
// used to find the few elements whose exact (ported) noise can decide the argmax.
PAGODA_DEVICE float approx_gumbel_noise(unsigned int word) {
    const bool upper = word >= 0x80000000u;
    const unsigned int small = upper ? ~word : word;
    const float tail = (__int2float_rn((int)small) + 0.5f) * 2.3283064365386963e-10f;  // (0, 0.5)
    float exponential = -__logf(upper ? 1.0f - tail : tail);
    if (upper && tail < 0.015625f) exponential = tail * (1.0f + tail * (0.5f + tail * 0.33333334f));
    return -__logf(exponential);
}

// The exact Gumbel-max score of id i (Philox block i / 4 recomputed).
PAGODA_DEVICE float exact_gumbel_score(const RowParams& p, float tempered, unsigned int i) {
    const uint4 words = philox_block(p, PURPOSE_GUMBEL, i / 4u);
    const unsigned int w[4] = {words.x, words.y, words.z, words.w};
    return __fadd_rn(tempered, gumbel_noise(w[i % 4u]));
}

// Block-wide maximum (the prelude's warp_max over the warps' maxima); every thread gets it.
PAGODA_DEVICE float block_max_f32(float value) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    value = warp_max(value);
    __syncthreads();
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    return warp_max(lane < num_warps ? partial[lane] : -INFINITY);
}

#define GUMBEL_KEPT 4

// Best (score, lowest id) of the Gumbel-max scores over ids [begin, end) (begin a multiple of
// 4) of row z: score = (z - z_max) * (f32)(1 / (f64)T) + gumbel_noise(word i % 4 of Philox
// block i / 4 of (seed, step, Gumbel)), all in f32 exactly as pagoda_ops' gumbel_argmax.
// Scan with the approximate noise: a thread keeps the (at most GUMBEL_KEPT) ids whose
// approximate score lies within 2 * GUMBEL_APPROX_ERROR of its warp's best (shared at
// each step: a thread's own best would let most lanes find new bests, each a divergent
// update, 32% more instructions per scan measured at batch 64); the winner has an
// approximate score within that of the block's best approximate score A, so only kept ids
// within 2 * GUMBEL_APPROX_ERROR of A get the exact noise. A thread that would keep more
// scans its ids again exactly (never seen). Block-wide; every thread gets the result.
PAGODA_DEVICE void gumbel_range(const float* __restrict__ z, unsigned int begin, unsigned int end, const RowParams& p,
                                float z_max, float& best, unsigned int& best_id) {
    const float inverse_temperature = __double2float_rn(__ddiv_rn(1.0, (double)p.temperature));
    const float window = 2.0f * GUMBEL_APPROX_ERROR;
    const bool aligned = row_aligned(z);
    float best_approx = -INFINITY;
    float kept_approx[GUMBEL_KEPT];
    unsigned int kept_id[GUMBEL_KEPT];
    int kept = 0;
    bool overflow = false;
    // Whole warps iterate together (a lane past `end` reads -inf) and every lane prunes
    // against the warp's best, as in gumbel_candidates.
    const unsigned int lane_offset = (threadIdx.x & 31u) * 4u;
    for (unsigned int warp_i = begin + (threadIdx.x & ~31u) * 4u; warp_i < end; warp_i += blockDim.x * 4u) {
        best_approx = warp_max(best_approx);
        const unsigned int i = warp_i + lane_offset;
        const float4 v = load4(z, i, end, aligned);
        const float values[4] = {v.x, v.y, v.z, v.w};
        float tempered[4];
        float block_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            tempered[j] = __fmul_rn(__fsub_rn(values[j], z_max), inverse_temperature);
            block_max = fmaxf(block_max, tempered[j]);
        }
        // Noise is below 22.87 (+ the approximation error): such a block cannot reach the window.
        if (block_max == -INFINITY || block_max + 22.91f < best_approx - window) continue;
        const uint4 words = philox_block(p, PURPOSE_GUMBEL, i / 4u);
        const unsigned int w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (tempered[j] == -INFINITY) continue;
            const float approx = tempered[j] + approx_gumbel_noise(w[j]);
            if (approx < best_approx - window) continue;
            best_approx = fmaxf(best_approx, approx);
            if (kept == GUMBEL_KEPT) {
                // Full: drop the ids the best has left behind before giving up.
                int still = 0;
#pragma unroll
                for (int k = 0; k < GUMBEL_KEPT; ++k) {
                    if (kept_approx[k] >= best_approx - window) {
                        kept_approx[still] = kept_approx[k];
                        kept_id[still] = kept_id[k];
                        ++still;
                    }
                }
                kept = still;
            }
            if (kept < GUMBEL_KEPT) {
                kept_approx[kept] = approx;
                kept_id[kept] = i + j;
                ++kept;
            } else {
                overflow = true;
            }
        }
    }
    const float cutoff = block_max_f32(best_approx) - window;
    best = -INFINITY;
    best_id = NO_TOKEN;
    if (overflow) {
        for (unsigned int i = begin + threadIdx.x * 4u; i < end; i += blockDim.x * 4u) {
            const float4 v = load4(z, i, end, aligned);
            const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float tempered = __fmul_rn(__fsub_rn(values[j], z_max), inverse_temperature);
                if (tempered == -INFINITY) continue;
                const float score = exact_gumbel_score(p, tempered, i + j);
                if (score > best) { best = score; best_id = i + j; }
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < GUMBEL_KEPT; ++k) {
            if (k < kept && kept_approx[k] >= cutoff) {
                const unsigned int id = kept_id[k];
                const float tempered = __fmul_rn(__fsub_rn(sanitize_logit(z[id]), z_max), inverse_temperature);
                const float score = exact_gumbel_score(p, tempered, id);
                if (better(score, id, best, best_id)) { best = score; best_id = id; }
            }
        }
    }
    block_argmax(best, best_id);
}

// Candidate ids kept per split by gumbel_candidates (more: the split reports overflow).
#define GUMBEL_SPLIT_KEPT 8u
#define GUMBEL_OVERFLOW 0xffffffffu

// Bound used for logit v on |a - (v / T + g) - c|, the error of gumbel_candidates' approximate
// score a = fl(fl(v / T) + approx noise) against the ideal score shifted by a constant c
// (= z_max / T), plus the rounding of the exact score (v - z_max) / T + g of any element
// that can still win (its |(v - z_max) / T| is below 46): the noise's GUMBEL_APPROX_ERROR,
// 2^-24 (2 |v / T| + 23) for the approximate score's roundings and 2^-24 * 138 for the
// exact one's, all inside 1.1e-3 + 2^-23 |v / T|.
PAGODA_DEVICE float candidate_error(float scaled) { return 1.1e-3f + 1.1920929e-7f * fabsf(scaled); }

// One split of a row without its maximum (FLAG_GUMBEL_MAX): the split's maximum and lowest
// index (every row), and for a Gumbel row the few ids that can still win the row's
// Gumbel-max. Approximate scores use no maximum (fl(v / T) + fast noise); the winner j and
// any id k satisfy a_j >= a_k - (E_j + E_k) (E: candidate_error), so an id further below
// the best is never the winner. Thread 0 writes the split's maximum to *max_out / *index_out
// and up to GUMBEL_SPLIT_KEPT ids to ids_out with their count (GUMBEL_OVERFLOW when more
// remain) to *count_out; sampling_finish scores them exactly with the row maximum. Block-wide.
PAGODA_DEVICE void gumbel_candidates(const float* __restrict__ z, unsigned int begin, unsigned int end,
                                     const RowParams& p, bool gumbel, float* max_out, unsigned int* index_out,
                                     unsigned int* ids_out, unsigned int* count_out) {
    __shared__ unsigned int s_count, s_overflow;
    __shared__ unsigned int s_ids[GUMBEL_SPLIT_KEPT];
    const float inverse_temperature = gumbel ? __double2float_rn(__ddiv_rn(1.0, (double)p.temperature)) : 0.0f;
    const bool aligned = row_aligned(z);
    float top = -INFINITY, best_approx = -INFINITY, best_error = 0.0f;
    unsigned int top_id = NO_TOKEN;
    float kept_approx[GUMBEL_KEPT], kept_error[GUMBEL_KEPT];
    unsigned int kept_id[GUMBEL_KEPT];
    int kept = 0;
    bool overflow = false;
    if (threadIdx.x == 0) { s_count = 0u; s_overflow = 0u; }
    // Whole warps iterate together (a lane past `end` reads -inf), so that each iteration
    // can begin with the warp's best (and the largest error of any lane's best: a larger E
    // only keeps more ids, so it is a valid bound for the pruning test). Every lane prunes
    // against it: new bests, and the lanes' divergent updates, stay rare after the first
    // blocks.
    const unsigned int lane_offset = (threadIdx.x & 31u) * 4u;
    for (unsigned int warp_i = begin + (threadIdx.x & ~31u) * 4u; warp_i < end; warp_i += blockDim.x * 4u) {
        if (gumbel) {
            best_approx = warp_max(best_approx);
            best_error = warp_max(best_error);
        }
        const unsigned int i = warp_i + lane_offset;
        const float4 v = load4(z, i, end, aligned);
        const float values[4] = {v.x, v.y, v.z, v.w};
        // Ids increase per thread: strict > keeps the lowest id of equal values.
        float scaled[4], reach = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (values[j] > top) { top = values[j]; top_id = i + j; }
            scaled[j] = __fmul_rn(values[j], inverse_temperature);
            reach = fmaxf(reach, scaled[j] + fabsf(scaled[j]) * 2.4e-7f);
        }
        // The noise is below 22.87 (+ its approximation error) and every E above 1.1e-3:
        // no id of such a block can come within reach of the best.
        const bool masked = values[0] == -INFINITY && values[1] == -INFINITY && values[2] == -INFINITY &&
                            values[3] == -INFINITY;
        if (!gumbel || masked || reach + 22.9f < best_approx - best_error - 1.1e-3f) continue;
        const uint4 words = philox_block(p, PURPOSE_GUMBEL, i / 4u);
        const unsigned int w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (values[j] == -INFINITY) continue;
            const float approx = scaled[j] + approx_gumbel_noise(w[j]);
            const float error = candidate_error(scaled[j]);
            if (approx < best_approx - (error + best_error)) continue;
            if (approx > best_approx) {
                best_approx = approx;
                best_error = error;
            }
            if (kept == GUMBEL_KEPT) {
                // Full: drop the ids the best has left behind before giving up.
                int still = 0;
#pragma unroll
                for (int k = 0; k < GUMBEL_KEPT; ++k) {
                    if (kept_approx[k] >= best_approx - (kept_error[k] + best_error)) {
                        kept_approx[still] = kept_approx[k];
                        kept_error[still] = kept_error[k];
                        kept_id[still] = kept_id[k];
                        ++still;
                    }
                }
                kept = still;
            }
            if (kept < GUMBEL_KEPT) {
                kept_approx[kept] = approx;
                kept_error[kept] = error;
                kept_id[kept] = i + j;
                ++kept;
            } else {
                overflow = true;
            }
        }
    }
    block_argmax(top, top_id);
    const float block_best = block_max_f32(best_approx);
    const float block_error = block_max_f32(best_error);  // >= the error of the best's id
    if (overflow) s_overflow = 1u;
#pragma unroll
    for (int k = 0; k < GUMBEL_KEPT; ++k) {
        if (k < kept && kept_approx[k] >= block_best - (kept_error[k] + block_error)) {
            const unsigned int slot = atomicAdd(&s_count, 1u);
            if (slot < GUMBEL_SPLIT_KEPT) s_ids[slot] = kept_id[k];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        *max_out = top;
        *index_out = top == -INFINITY ? NO_TOKEN : top_id;
        const unsigned int count = s_overflow || s_count > GUMBEL_SPLIT_KEPT ? GUMBEL_OVERFLOW : s_count;
        *count_out = gumbel ? count : 0u;
        for (unsigned int k = 0; k < GUMBEL_SPLIT_KEPT && k < s_count; ++k) ids_out[k] = s_ids[k];
    }
}

// Gumbel-max partials. With FLAG_GUMBEL_MAX (no sampling_row_max in this launch; no
// filtered rows): every row's split maximum and lowest index into partial_max /
// partial_index [rows, num_splits], and a Gumbel row's candidates into gumbel_ids
// [rows, num_splits, GUMBEL_SPLIT_KEPT] / gumbel_count [rows, num_splits]
// (gumbel_candidates). Without it: the unfiltered rows' best (score, lowest id) per split,
// scored exactly with the row maximum of the filter state, into partial_score / partial_id
// [rows, num_splits] (other rows return at once).
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
sampling_gumbel(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
                unsigned int num_splits, unsigned int flags, const unsigned int* __restrict__ state,
                float* __restrict__ partial_score, unsigned int* __restrict__ partial_id,
                float* __restrict__ partial_max, unsigned int* __restrict__ partial_index,
                unsigned int* __restrict__ gumbel_ids, unsigned int* __restrict__ gumbel_count) {
    const unsigned int row = blockIdx.y, split = blockIdx.x;
    const RowParams p = load_row_params(params, row);
    unsigned int begin, end;
    split_range(vocab, num_splits, split, begin, end);
    const size_t slot = (size_t)row * num_splits + split;
    if (flags & FLAG_GUMBEL_MAX) {
        // Greedy unless the parameters sample (a row without a finite logit is greedy too:
        // it keeps no candidate).
        const bool gumbel = row_path(p, vocab, 0.0f) == PATH_GUMBEL;
        gumbel_candidates(logits + (size_t)row * vocab, begin, end, p, gumbel, partial_max + slot,
                          partial_index + slot, gumbel_ids + slot * GUMBEL_SPLIT_KEPT, gumbel_count + slot);
        return;
    }
    const float z_max = __uint_as_float(state[row * FILTER_STATE_WORDS + FS_Z_MAX]);
    if (row_path(p, vocab, z_max) != PATH_GUMBEL) return;
    float best;
    unsigned int best_id;
    gumbel_range(logits + (size_t)row * vocab, begin, end, p, z_max, best, best_id);
    if (threadIdx.x == 0) {
        partial_score[slot] = best;
        partial_id[slot] = best == -INFINITY ? NO_TOKEN : best_id;
    }
}

// Partial (max, lowest index) of the sanitised logits of each (row, split) into
// partial_max / partial_index [rows, num_splits] (-inf / NO_TOKEN when the split has no value
// above -inf). The last CTA of each row sets up its filter state (init_filter_state). With
// FLAG_TOP_K, a row with a top-k also gets the first digit (bits 24-31) of its radix select
// here: every CTA counts its logits into histogram[row] [TOP_K_BINS], and the last CTA fixes
// the digit (fix_top_k_digit) and zeroes the histogram, so the digit launches start at
// bits 16-23 (a whole launch fewer).
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
sampling_row_max(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
                 unsigned int num_splits, unsigned int flags, float* __restrict__ partial_max,
                 unsigned int* __restrict__ partial_index, unsigned int* __restrict__ state,
                 unsigned int* __restrict__ arrive, unsigned int* __restrict__ histogram) {
    __shared__ unsigned int counts[TOP_K_BINS];
    const unsigned int row = blockIdx.y, split = blockIdx.x;
    // Every row whose filter state may get a pending top-k (init_filter_state); counting a
    // row that turns out greedy only costs the count. Without FLAG_TOP_K the parameters are
    // read after the pass, off the loads' critical path (measured: top-p 1-3% slower when
    // every launch waited for them).
    RowParams p;
    bool first_digit = false;
    if (flags & FLAG_TOP_K) {
        p = load_row_params(params, row);
        first_digit = p.top_k > 1u && p.top_k < vocab;
    }
    if (first_digit) {
        for (unsigned int d = threadIdx.x; d < TOP_K_BINS; d += blockDim.x) counts[d] = 0u;
        __syncthreads();
    }
    unsigned int begin, end;
    split_range(vocab, num_splits, split, begin, end);
    const float* z = logits + (size_t)row * vocab;
    const bool aligned = row_aligned(z);
    float best = -INFINITY;
    unsigned int best_id = NO_TOKEN;
#pragma unroll 2
    for (unsigned int i = begin + threadIdx.x * 4u; i < end; i += blockDim.x * 4u) {
        const float4 v = load4(z, i, end, aligned);
        // Ids increase per thread: strict > keeps the lowest id of equal values.
        if (v.x > best) { best = v.x; best_id = i; }
        if (v.y > best) { best = v.y; best_id = i + 1u; }
        if (v.z > best) { best = v.z; best_id = i + 2u; }
        if (v.w > best) { best = v.w; best_id = i + 3u; }
        if (first_digit) {
            const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (values[j] > -INFINITY) atomicAdd(&counts[ordered_bits(values[j]) >> 24], 1u);
            }
        }
    }
    block_argmax(best, best_id);
    unsigned int* h = histogram + (size_t)row * TOP_K_BINS;
    if (first_digit) {
        // block_argmax ended with a barrier: every count is in.
        for (unsigned int d = threadIdx.x; d < TOP_K_BINS; d += blockDim.x) {
            if (counts[d]) atomicAdd(&h[d], counts[d]);
        }
    }
    if (threadIdx.x == 0) {
        partial_max[row * num_splits + split] = best;
        partial_index[row * num_splits + split] = best == -INFINITY ? NO_TOKEN : best_id;
    }
    if (!last_to_arrive(arrive, row, num_splits)) return;
    float z_max;
    unsigned int argmax;
    reduce_row_max(partial_max, partial_index, row, num_splits, z_max, argmax);
    unsigned int* st = state + row * FILTER_STATE_WORDS;
    if (!(flags & FLAG_TOP_K)) p = load_row_params(params, row);
    if (threadIdx.x == 0) init_filter_state(p, vocab, z_max, argmax, flags, st);
    if (!first_digit) return;
    // Every CTA of the row has added its counts: read them and zero the row's histogram.
    for (unsigned int d = threadIdx.x; d < TOP_K_BINS; d += blockDim.x) {
        counts[d] = __ldcg(&h[d]);
        h[d] = 0u;
    }
    __syncthreads();  // also publishes thread 0's filter state to the block
    if (st[FS_STATUS] != STATUS_ACTIVE || st[FS_TOP_K_PENDING] == 0u) return;
    fix_top_k_digit(counts, 24u, p, st);
}
