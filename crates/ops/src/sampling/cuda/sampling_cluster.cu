// GPU sampling, part 3c: the filtered rows of a top-p launch without top-k in one kernel, a thread
// block cluster of CLUSTER_CTAS CTAs per row (Hopper, sm_90+). Each CTA reads its slice of the
// row once, keeping the first `held` logits in shared memory (all of them unless the batch
// needs more CTAs per SM than a whole slice allows; the rest are re-read from L2); the cluster
// finds the row maximum, sets up the row's filter state, computes the proposal's segment
// masses and Z, and runs the dual-pivot rounds of sampling_pass / sampling_round (same
// weights, margins, tolerances and Philox draws) on the slices until the row is accepted or
// left to the exact kernel. Cluster barriers and distributed shared memory replace the
// last-CTA reductions and the launch boundaries, so a row pays no launch per round, and a
// finished row frees its SMs at once. CTA rank r holds split r of the row and its warp w
// segment w of the split (ids in (r, w) order), so every CTA gathers the same segment masses,
// sums them in the same order and takes the same decisions. Warp 0 of each CTA (the leader)
// takes them; the other warps only read the outcome from shared memory, so the scalar work of
// a round is not repeated by every warp (ncu: 24.4 M -> 17.7 M instructions at batch 64).

// Grid (CLUSTER_CTAS, rows), clusters of CLUSTER_CTAS along x, CLUSTER_THREADS threads,
// dynamic shared memory for the first `held` logits of each slice (a multiple of 4;
// cluster.rs ClusterShape::held): for every row, the filter state of sampling_row_max (no
// top-k digit: launched only without top-k rows); then, for an ACTIVE filtered row, the whole
// fast pipeline. Writes the token, stats and totals of an accepted row (status DONE); a row
// the fast path cannot decide is left EXACT for sampling_finish, with its argmax. `ahead`: the
// clusters resident at once when the batch has more rows (cluster.rs), else 0; each resident
// row asks L2 for the row that many rows on after its pass (totals counter 10 counts them).
extern "C" __global__ void
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__cluster_dims__(CLUSTER_CTAS, 1, 1)
#endif
__launch_bounds__(CLUSTER_THREADS, PAGODA_CLUSTER_BLOCKS)
sampling_cluster(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
                 unsigned int held, unsigned int ahead, unsigned int flags, unsigned int max_rounds,
                 unsigned int* __restrict__ state,
                 unsigned int* __restrict__ tokens, unsigned int* __restrict__ stats,
                 unsigned int* __restrict__ totals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ float4 slice_storage[];
    float* slice = reinterpret_cast<float*>(slice_storage);
    __shared__ float s_max, s_row[3], s_pivot[2];  // s_row: z_max, low, scale
    __shared__ unsigned int s_argmax, s_candidate, s_owner, s_step, s_left;
    __shared__ double s_draw[3];  // the drawn segment's mass before, the target, the total
    __shared__ double s_segments[2][CLUSTER_WARPS];  // this CTA's segment draw masses (two proposals)
    __shared__ double s_mass[2];                     // this CTA's filter masses
    __shared__ double s_z;                           // the row's top-p mass Z (see cluster_sync)
    __shared__ double all_segments[CLUSTER_SEGMENTS];
    __shared__ double warp_mass[2][CLUSTER_WARPS];
    // The leader's state across the rounds lives in shared memory, not in registers: the
    // round pass needs every register, and spilled values were reloaded from L2 after every
    // cluster barrier (its acquire invalidates L1): 1.5-2 us per call at batch 64.
    __shared__ double s_verdict[3];        // mass target, margin, tolerance
    __shared__ double s_uniform0;          // the first round's uniform
    __shared__ RowParams s_params;         // the Philox key of the later rounds
    __shared__ float s_high;               // the proposal's upper pivot
    __shared__ unsigned int s_outcome[3];  // status, token, rounds
    const unsigned int rank = cluster_rank(), row = blockIdx.y;
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const float* z = logits + (size_t)row * vocab;
    unsigned int* st = state + row * FILTER_STATE_WORDS;
    // The slice into shared memory (its first `held` logits, padded with -inf to a multiple of
    // 4) and its maximum. Ids increase per thread: strict > keeps the lowest id of equal values.
    unsigned int first, end;
    split_range(vocab, CLUSTER_CTAS, rank, first, end);
    const unsigned int length = end - first;
    const bool aligned = row_aligned(z);
    const SliceLogits logits4{slice, z, first, held, end, aligned};
    // Only greedy and Gumbel rows need the argmax now; a filtered row finds it at the end if
    // the exact kernel is to draw it.
    const RowParams p = load_row_params(params, row);
    if (threadIdx.x == 0) {
        // The first round's uniform while the loads are in flight (0.1 us at batch 1).
        const uint4 block = philox_block(p, PURPOSE_REJECTION_ROUND, 0u);
        s_uniform0 = open_uniform_f64(block.x, block.y);
        s_params = p;
        s_outcome[0] = STATUS_EXACT;
        s_outcome[1] = NO_TOKEN;
        s_outcome[2] = 0u;
    }
    const bool track = row_path(p, vocab, 0.0f) != PATH_REJECTION;
    float best = -INFINITY;
    unsigned int best_id = NO_TOKEN;
    const auto take = [&](unsigned int i, float4 v) {
        if (i < held) *reinterpret_cast<float4*>(slice + i) = v;
        if (!track) {
            best = fmaxf(fmaxf(best, v.x), fmaxf(fmaxf(v.y, v.z), v.w));
            return;
        }
        if (v.x > best) { best = v.x; best_id = first + i; }
        if (v.y > best) { best = v.y; best_id = first + i + 1u; }
        if (v.z > best) { best = v.z; best_id = first + i + 2u; }
        if (v.w > best) { best = v.w; best_id = first + i + 3u; }
    };
    if (aligned) {
        // Four 16-byte loads in flight per thread before any is used.
        const unsigned int whole = length & ~3u;
        const float4* z4 = reinterpret_cast<const float4*>(z + first);
        constexpr unsigned int stride = CLUSTER_THREADS * 4u;
        for (unsigned int base = threadIdx.x * 4u; base < whole; base += 4u * stride) {
            float4 v[4];
#pragma unroll
            for (unsigned int k = 0; k < 4u; ++k) {
                const unsigned int i = base + k * stride;
                v[k] = i < whole ? __ldg(z4 + i / 4u) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (unsigned int k = 0; k < 4u; ++k) {
                const unsigned int i = base + k * stride;
                if (i < whole) {
                    take(i, make_float4(sanitize_logit(v[k].x), sanitize_logit(v[k].y), sanitize_logit(v[k].z),
                                        sanitize_logit(v[k].w)));
                }
            }
        }
        if (whole < length && threadIdx.x == 0) take(whole, load4(z, end & ~3u, end, aligned));
    } else {
        for (unsigned int i = threadIdx.x * 4u; i < length; i += CLUSTER_THREADS * 4u) {
            take(i, load4(z, first + i, end, aligned));
        }
    }
    block_argmax(best, best_id);  // ends with a barrier: the slice is in
    if (threadIdx.x == 0) { s_max = best; s_argmax = best == -INFINITY ? NO_TOKEN : best_id; }
    cluster_sync();
    // Warp 0 (the leader) takes every decision of the row, from the same values in every CTA,
    // and the other warps read them from shared memory after a barrier: the row maximum and
    // filter state here; the draws, pivots and verdicts of the rounds below.
    const bool leader = warp == 0u;
    if (leader) {
        float z_max = -INFINITY;
        unsigned int argmax = NO_TOKEN;
        for (unsigned int r = 0; r < CLUSTER_CTAS; ++r) {
            const float v = cluster_load_f32(&s_max, r);
            const unsigned int id = cluster_load_u32(&s_argmax, r);
            if (better(v, id, z_max, argmax)) { z_max = v; argmax = id; }
        }
        if (z_max == -INFINITY) argmax = 0u;  // no finite logit: token 0, as the CPU chain
        if (rank == 0 && lane == 0) init_filter_state(p, vocab, z_max, argmax, flags, st);
        float low;
        bool top_k_pending;
        const bool active = filter_start(p, vocab, z_max, flags, low, top_k_pending) == STATUS_ACTIVE && !top_k_pending;
        if (lane == 0) {
            s_high = z_max;
            s_row[0] = z_max;
            s_row[1] = low;
            s_row[2] = draw_scale(p.temperature);
            s_step = active ? (top_p_active(p) ? 1u : 0u) : STEP_STOP;
        }
    }
    // No cluster barrier here: the maxima stay as they are until the next one (after the pass),
    // and the leader has consumed its loads of them into s_row.
    __syncthreads();
    const float z_max = s_row[0], scale = s_row[2];
    float low = s_row[1];
    if (s_step == STEP_STOP) {
        // Every CTA has read the maxima before one leaves or rewrites its s_argmax.
        cluster_sync();
        // A filtered row the fast path cannot take goes to the exact kernel.
        if (!track && z_max != -INFINITY) publish_argmax(logits4, length, z_max, rank, &s_argmax, st);
        asm volatile("griddepcontrol.launch_dependents;");
        return;
    }
    const bool use_top_p = s_step == 1u;
    // The pass: per segment the proposal's draw mass, per CTA the top-p mass Z (no top-k set:
    // every finite logit). At T = 1 the filter weights are the draw weights: Z is the
    // proposal's draw mass when the proposal is every finite logit, and a round's filter
    // masses are its draw masses.
    const bool same_weights = scale == 1.0f;
    const bool z_is_draw = same_weights && low == -INFINITY;
    unsigned int segment_begin, segment_end;
    slice_segment(length, warp, segment_begin, segment_end);
    double draw = 0.0, filter = 0.0;
    for_segment(logits4, segment_begin, segment_end, [&](float4 v) {
        const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float weight = weight_above(values[j], low, z_max, scale);
            draw += (double)weight;
            if (use_top_p && !z_is_draw) {
                filter += (double)(same_weights && values[j] > low ? weight : fast_weight(values[j], z_max, 1.0f));
            }
        }
    });
    // The row `ahead` rows on starts only when a cluster leaves (ahead = the clusters resident
    // at once; 0 when the whole batch is): while the memory is idle, ask L2 for its slice.
    if (ahead != 0u && row + ahead < gridDim.y && threadIdx.x == 0) {
        prefetch_l2(z + (size_t)ahead * vocab + first, z + (size_t)ahead * vocab + end);
        if (rank == 0u) count_total(totals, 10u, 1ull);
    }
    draw = warp_sum_f64(draw);
    filter = z_is_draw ? draw : warp_sum_f64(filter);
    if (lane == 0) { s_segments[0][warp] = draw; warp_mass[0][warp] = filter; }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (unsigned int w = 0; w < CLUSTER_WARPS; ++w) sum += warp_mass[0][w];
        s_mass[0] = sum;
    }
    cluster_sync();
    gather_segments(s_segments, 0u, all_segments);
    if (leader) {
        const double top_k_mass = cluster_sum_f64(&s_mass[0]);
        if (lane == 0) {
            s_z = top_k_mass;  // consumes the loads before the next cluster_sync
            s_verdict[0] = __dmul_rn((double)p.top_p, top_k_mass);
            s_verdict[1] = rounding_margin(vocab, top_k_mass);
            s_verdict[2] = FAST_MASS_TOLERANCE * top_k_mass;
        }
    }
    // The rounds. The leader draws the segment; the CTA whose slice holds it walks it and
    // publishes the candidate; the leader accepts it or sets the pivots; every warp sums its
    // segment's masses above them; the leader takes the verdicts.
    for (unsigned int round = 0; round < max_rounds; ++round) {
        if (leader) {
            double before = 0.0, total, target, uniform = s_uniform0;
            if (round > 0u) {
                const uint4 block = philox_block(s_params, PURPOSE_REJECTION_ROUND, round);
                uniform = open_uniform_f64(block.x, block.y);
            }
            const unsigned int owner = draw_segment(all_segments, uniform, before, total, target);
            if (lane == 0) {
                s_owner = owner;
                s_draw[0] = before;
                s_draw[1] = target;
                s_draw[2] = total;
            }
        }
        __syncthreads();
        const unsigned int owner = s_owner;
        if (owner == NO_TOKEN) break;
        if (owner / CLUSTER_WARPS == rank) {
            unsigned int walk_begin, walk_end;
            slice_segment(length, owner % CLUSTER_WARPS, walk_begin, walk_end);
            const unsigned int found = walk_range(logits4, first + walk_begin, first + walk_end, s_draw[0], s_draw[1],
                                                  walk_margin(vocab, s_draw[2]), low, z_max, scale);
            if (threadIdx.x == 0) s_candidate = found;
        }
        cluster_sync();
        if (leader) {
            const unsigned int candidate = cluster_load_u32(&s_candidate, owner / CLUSTER_WARPS);
            unsigned int step = STEP_STOP;
            if (candidate != NO_TOKEN) {
                const float pivot0 = sanitize_logit(z[candidate]), high = s_high;
                const bool accept = !use_top_p || pivot0 >= high;
                if (lane == 0) {
                    s_outcome[0] = accept ? STATUS_DONE : STATUS_EXACT;
                    s_outcome[1] = candidate;
                    s_outcome[2] = round + 1u;
                }
                if (!accept) {
                    const unsigned int low_bits = ordered_bits(pivot0), high_bits = ordered_bits(high);
                    step = 1u;
                    if (lane == 0) {
                        s_pivot[0] = pivot0;
                        s_pivot[1] = from_ordered_bits(low_bits + (high_bits - low_bits) / 2u);
                    }
                }
            }
            if (lane == 0) s_step = step;
        }
        __syncthreads();
        if (s_step == STEP_STOP) break;
        // sampling_round: masses above pivot0 and pivot1 (filter per CTA, draw per segment).
        const float pivot0 = s_pivot[0], pivot1 = s_pivot[1];
        double mass0 = 0.0, mass1 = 0.0, draw0 = 0.0, draw1 = 0.0;
        for_segment(logits4, segment_begin, segment_end, [&](float4 v) {
            const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (values[j] > pivot0) {
                    const double weight = draw_weight(values[j], z_max, scale);
                    draw0 += weight;
                    if (values[j] > pivot1) draw1 += weight;
                    if (!same_weights) {
                        const double mass = fast_weight(values[j], z_max, 1.0f);
                        mass0 += mass;
                        if (values[j] > pivot1) mass1 += mass;
                    }
                }
            }
        });
        draw0 = warp_sum_f64(draw0);
        draw1 = warp_sum_f64(draw1);
        mass0 = same_weights ? draw0 : warp_sum_f64(mass0);
        mass1 = same_weights ? draw1 : warp_sum_f64(mass1);
        if (lane == 0) {
            s_segments[0][warp] = draw0;
            s_segments[1][warp] = draw1;
            warp_mass[0][warp] = mass0;
            warp_mass[1][warp] = mass1;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double sum0 = 0.0, sum1 = 0.0;
            for (unsigned int w = 0; w < CLUSTER_WARPS; ++w) { sum0 += warp_mass[0][w]; sum1 += warp_mass[1][w]; }
            s_mass[0] = sum0;
            s_mass[1] = sum1;
        }
        cluster_sync();
        if (leader) {
            const double above0 = cluster_sum_f64(&s_mass[0]), above1 = cluster_sum_f64(&s_mass[1]);
            const double mass_target = s_verdict[0], margin = s_verdict[1], tolerance = s_verdict[2];
            const int verdict0 = fast_verdict(above0, mass_target, margin, tolerance);
            const int verdict1 = fast_verdict(above1, mass_target, margin, tolerance);
            unsigned int step = STEP_STOP;
            if (verdict0 == VERDICT_PASS) {
                if (lane == 0) s_outcome[0] = STATUS_DONE;  // the candidate, in s_outcome[1]
            } else if (verdict0 == VERDICT_FAIL && verdict1 != VERDICT_UNSURE) {
                // The proposal shrinks to the ids above the higher failing pivot.
                if (verdict1 == VERDICT_PASS && lane == 0) s_high = pivot1;
                step = verdict1 == VERDICT_FAIL ? 1u : 0u;
            }
            if (lane == 0) s_step = step;
        }
        __syncthreads();
        const unsigned int step = s_step;
        if (step == STEP_STOP) break;
        low = step == 1u ? pivot1 : pivot0;
        gather_segments(s_segments, step, all_segments);
    }
    // The exact kernel needs the argmax of a row it is left. (s_left, not s_step: a thread may
    // still be reading the last step. Thread 0, lane 0 of the leader, wrote s_outcome.)
    if (threadIdx.x == 0) s_left = s_outcome[0] != STATUS_DONE;
    __syncthreads();
    if (!track && s_left) publish_argmax(logits4, length, z_max, rank, &s_argmax, st);
    if (rank == 0 && threadIdx.x == 0) {
        if (s_outcome[0] == STATUS_DONE) {
            accept_fast(row, s_outcome[1], s_outcome[2], st, tokens, stats, totals);
            count_total(totals, 9u, 1ull);
        } else {
            st[FS_STATUS] = STATUS_EXACT;
        }
    }
    // The finish kernel may be launched now (it waits for this grid to complete).
    asm volatile("griddepcontrol.launch_dependents;");
    cluster_sync();  // no CTA leaves while another may still read its shared memory
#endif
}
