// GPU sampling, part 3c: the filtered rows of a top-p launch without top-k in one kernel, a thread
// block cluster of CLUSTER_CTAS CTAs per row (Hopper, sm_90+). Each CTA reads its slice of the
// row once into shared memory; the cluster finds the row maximum, sets up the row's filter
// state, computes the proposal's segment masses and Z, and runs the dual-pivot rounds of
// sampling_pass / sampling_round (same weights, margins, tolerances and Philox draws) on the
// slices until the row is accepted or left to the exact kernel. Cluster barriers and
// distributed shared memory replace the last-CTA reductions and the launch boundaries, so a
// row pays no launch and no global read per round, and a finished row frees its SMs at once.
// CTA rank r holds split r of the row and its warp w segment w of the split (ids in (r, w)
// order), so every CTA gathers the same segment masses, sums them in the same order and takes
// the same decisions.

#define CLUSTER_CTAS 8u
#define CLUSTER_THREADS 512
#define CLUSTER_WARPS 16u
#define CLUSTER_SEGMENTS (CLUSTER_CTAS * CLUSTER_WARPS)

// Segment w of a slice of `length` logits: [begin, end), spans a multiple of 4.
PAGODA_DEVICE void slice_segment(unsigned int length, unsigned int w, unsigned int& begin, unsigned int& end) {
    const unsigned int span = (length + 4u * CLUSTER_WARPS - 1u) / (4u * CLUSTER_WARPS) * 4u;
    begin = min(w * span, length);
    end = min(begin + span, length);
}

// Four logits of a CTA's slice in shared memory, by row id (the slice starts at id `first`,
// a multiple of 4, and holds `length` logits, padded with -inf to a multiple of 4).
struct SliceLogits {
    const float* slice;
    unsigned int first;
    PAGODA_DEVICE float4 operator()(unsigned int i) const {
        return *reinterpret_cast<const float4*>(slice + (i - first));
    }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
PAGODA_DEVICE unsigned int cluster_rank() {
    unsigned int rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// Every thread of every CTA of the cluster: shared-memory writes before it are visible to the
// cluster's reads after it.
PAGODA_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The address of `local` (this CTA's shared memory) in the shared memory of CTA `rank`.
PAGODA_DEVICE unsigned int cluster_address(const void* local, unsigned int rank) {
    const unsigned int address = (unsigned int)__cvta_generic_to_shared(local);
    unsigned int remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
    return remote;
}
PAGODA_DEVICE double cluster_load_f64(const double* local, unsigned int rank) {
    double value;
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(value) : "r"(cluster_address(local, rank)) : "memory");
    return value;
}
PAGODA_DEVICE unsigned int cluster_load_u32(const unsigned int* local, unsigned int rank) {
    unsigned int value;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(value) : "r"(cluster_address(local, rank)) : "memory");
    return value;
}
PAGODA_DEVICE float cluster_load_f32(const float* local, unsigned int rank) {
    return __uint_as_float(cluster_load_u32(reinterpret_cast<const unsigned int*>(local), rank));
}

// Sum over the cluster's CTAs of `local` (rank order: the same value in every thread).
PAGODA_DEVICE double cluster_sum_f64(const double* local) {
    double sum = 0.0;
    for (unsigned int rank = 0; rank < CLUSTER_CTAS; ++rank) sum += cluster_load_f64(local, rank);
    return sum;
}

// Gathers the row's segment masses (slot `slot` of every CTA's `segments`
// [2][CLUSTER_WARPS]) into this CTA's `all` [CLUSTER_SEGMENTS]. Block-wide.
PAGODA_DEVICE void gather_segments(const double (*segments)[CLUSTER_WARPS], unsigned int slot, double* all) {
    for (unsigned int s = threadIdx.x; s < CLUSTER_SEGMENTS; s += blockDim.x) {
        all[s] = cluster_load_f64(&segments[slot][s % CLUSTER_WARPS], s / CLUSTER_WARPS);
    }
    __syncthreads();
}

// The inverse-CDF draw's segment: the first segment of positive mass whose cumulative mass
// exceeds uniform * total (NO_TOKEN if none), the mass before it, the total. Block-wide.
PAGODA_DEVICE unsigned int draw_segment(const double* all, double uniform, double& before, double& total) {
    __shared__ unsigned int s_owner;
    __shared__ double s_before;
    const double mass = threadIdx.x < CLUSTER_SEGMENTS ? all[threadIdx.x] : 0.0;
    const double prefix = block_exclusive_scan_f64(mass, total);
    const double target = __dmul_rn(uniform, total);
    if (threadIdx.x == 0) s_owner = NO_TOKEN;
    __syncthreads();
    if (mass > 0.0 && prefix <= target && prefix + mass > target) atomicMin(&s_owner, threadIdx.x);
    __syncthreads();
    if (threadIdx.x == s_owner) s_before = prefix;
    __syncthreads();
    before = s_before;
    const unsigned int owner = s_owner;
    __syncthreads();
    return owner;
}
#endif

// Grid (CLUSTER_CTAS, rows), clusters of CLUSTER_CTAS along x, CLUSTER_THREADS threads,
// dynamic shared memory for one slice (cluster_slice_floats): for every row, the filter state
// of sampling_row_max (no top-k digit: launched only without top-k rows); then, for an ACTIVE
// filtered row, the whole fast pipeline. Writes the token, stats and totals of an accepted row
// (status DONE); a row the fast path cannot decide is left EXACT for sampling_finish.
extern "C" __global__ void
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__cluster_dims__(CLUSTER_CTAS, 1, 1)
#endif
__launch_bounds__(CLUSTER_THREADS, 3)
sampling_cluster(const float* __restrict__ logits, const unsigned int* __restrict__ params, unsigned int vocab,
                 unsigned int flags, unsigned int max_rounds, unsigned int* __restrict__ state,
                 unsigned int* __restrict__ tokens, unsigned int* __restrict__ stats,
                 unsigned int* __restrict__ totals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ float4 slice_storage[];
    float* slice = reinterpret_cast<float*>(slice_storage);
    __shared__ float s_max;
    __shared__ unsigned int s_argmax, s_candidate;
    __shared__ double s_segments[2][CLUSTER_WARPS];  // this CTA's segment draw masses (two proposals)
    __shared__ double s_mass[2];                     // this CTA's filter masses
    __shared__ double all_segments[CLUSTER_SEGMENTS];
    __shared__ double warp_mass[2][CLUSTER_WARPS];
    const unsigned int rank = cluster_rank(), row = blockIdx.y;
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const float* z = logits + (size_t)row * vocab;
    unsigned int* st = state + row * FILTER_STATE_WORDS;
    // The slice into shared memory (padded with -inf to a multiple of 4) and its maximum.
    unsigned int first, end;
    split_range(vocab, CLUSTER_CTAS, rank, first, end);
    const unsigned int length = end - first;
    const bool aligned = row_aligned(z);
    float best = -INFINITY;
    unsigned int best_id = NO_TOKEN;
#pragma unroll 4
    for (unsigned int i = threadIdx.x * 4u; i < length; i += CLUSTER_THREADS * 4u) {
        const float4 v = load4(z, first + i, end, aligned);
        *reinterpret_cast<float4*>(slice + i) = v;
        // Ids increase per thread: strict > keeps the lowest id of equal values.
        if (v.x > best) { best = v.x; best_id = first + i; }
        if (v.y > best) { best = v.y; best_id = first + i + 1u; }
        if (v.z > best) { best = v.z; best_id = first + i + 2u; }
        if (v.w > best) { best = v.w; best_id = first + i + 3u; }
    }
    block_argmax(best, best_id);  // ends with a barrier: the slice is in
    if (threadIdx.x == 0) { s_max = best; s_argmax = best == -INFINITY ? NO_TOKEN : best_id; }
    cluster_sync();
    float z_max = -INFINITY;
    unsigned int argmax = NO_TOKEN;
    for (unsigned int r = 0; r < CLUSTER_CTAS; ++r) {
        const float v = cluster_load_f32(&s_max, r);
        const unsigned int id = cluster_load_u32(&s_argmax, r);
        if (better(v, id, z_max, argmax)) { z_max = v; argmax = id; }
    }
    if (z_max == -INFINITY) argmax = 0u;  // no finite logit: token 0, as the CPU chain
    const RowParams p = load_row_params(params, row);
    if (rank == 0 && threadIdx.x == 0) init_filter_state(p, vocab, z_max, argmax, flags, st);
    float low;
    bool top_k_pending;
    const bool active = filter_start(p, vocab, z_max, flags, low, top_k_pending) == STATUS_ACTIVE && !top_k_pending;
    cluster_sync();  // every CTA has read the maxima (a CTA's shared memory lives until it exits)
    if (!active) return;
    // The pass: per segment the proposal's draw mass, per CTA the top-p mass Z (no top-k set:
    // every finite logit).
    const float scale = draw_scale(p.temperature);
    const bool use_top_p = top_p_active(p);
    // At T = 1 the filter weights are the draw weights: Z is the proposal's draw mass when
    // the proposal is every finite logit, and a round's filter masses are its draw masses.
    const bool same_weights = scale == 1.0f;
    const bool z_is_draw = same_weights && low == -INFINITY;
    unsigned int segment_begin, segment_end;
    slice_segment(length, warp, segment_begin, segment_end);
    double draw = 0.0, filter = 0.0;
    for (unsigned int i = segment_begin + lane * 4u; i < segment_end; i += 128u) {
        const float4 v = *reinterpret_cast<const float4*>(slice + i);
        const float values[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float weight = values[j] > low ? draw_weight(values[j], z_max, scale) : 0.0f;
            draw += (double)weight;
            if (use_top_p && !z_is_draw) {
                filter += (double)(same_weights && values[j] > low ? weight : fast_weight(values[j], z_max, 1.0f));
            }
        }
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
    const double top_k_mass = cluster_sum_f64(&s_mass[0]);
    const double mass_target = __dmul_rn((double)p.top_p, top_k_mass);
    const double margin = rounding_margin(vocab, top_k_mass), tolerance = FAST_MASS_TOLERANCE * top_k_mass;
    // The rounds. Every value below is the same in every CTA; the CTA whose slice holds the
    // chosen segment walks it and publishes the candidate.
    float high = z_max;
    unsigned int outcome = STATUS_EXACT, token = NO_TOKEN, rounds = 0u;
    for (unsigned int round = 0; round < max_rounds; ++round) {
        const uint4 block = philox_block(p, PURPOSE_REJECTION_ROUND, round);
        double before, total;
        const unsigned int owner = draw_segment(all_segments, open_uniform_f64(block.x, block.y), before, total);
        if (owner == NO_TOKEN) break;
        if (owner / CLUSTER_WARPS == rank) {
            unsigned int walk_begin, walk_end;
            slice_segment(length, owner % CLUSTER_WARPS, walk_begin, walk_end);
            const double target = __dmul_rn(open_uniform_f64(block.x, block.y), total);
            const unsigned int found = walk_range(SliceLogits{slice, first}, first + walk_begin, first + walk_end,
                                                  before, target, walk_margin(vocab, total), low, z_max, scale);
            if (threadIdx.x == 0) s_candidate = found;
        }
        cluster_sync();
        const unsigned int candidate = cluster_load_u32(&s_candidate, owner / CLUSTER_WARPS);
        if (candidate == NO_TOKEN) break;
        rounds = round + 1u;
        const float pivot0 = sanitize_logit(z[candidate]);
        if (!use_top_p || pivot0 >= high) { outcome = STATUS_DONE; token = candidate; break; }
        // sampling_round: masses above pivot0 and pivot1 (filter per CTA, draw per segment).
        const unsigned int low_bits = ordered_bits(pivot0), high_bits = ordered_bits(high);
        const float pivot1 = from_ordered_bits(low_bits + (high_bits - low_bits) / 2u);
        double mass0 = 0.0, mass1 = 0.0, draw0 = 0.0, draw1 = 0.0;
        for (unsigned int i = segment_begin + lane * 4u; i < segment_end; i += 128u) {
            const float4 v = *reinterpret_cast<const float4*>(slice + i);
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
        }
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
        const double above0 = cluster_sum_f64(&s_mass[0]), above1 = cluster_sum_f64(&s_mass[1]);
        const int verdict0 = fast_verdict(above0, mass_target, margin, tolerance);
        const int verdict1 = fast_verdict(above1, mass_target, margin, tolerance);
        if (verdict0 == VERDICT_PASS) { outcome = STATUS_DONE; token = candidate; break; }
        if (verdict0 != VERDICT_FAIL || verdict1 == VERDICT_UNSURE) break;
        const bool above_pivot1 = verdict1 == VERDICT_FAIL;
        low = above_pivot1 ? pivot1 : pivot0;
        if (verdict1 == VERDICT_PASS) high = pivot1;
        gather_segments(s_segments, above_pivot1 ? 1u : 0u, all_segments);
    }
    if (rank == 0 && threadIdx.x == 0) {
        if (outcome == STATUS_DONE) {
            accept_fast(row, token, rounds, st, tokens, stats, totals);
            count_total(totals, 9u, 1ull);
        } else {
            st[FS_STATUS] = STATUS_EXACT;
        }
    }
    cluster_sync();  // no CTA leaves while another may still read its shared memory
#endif
}
