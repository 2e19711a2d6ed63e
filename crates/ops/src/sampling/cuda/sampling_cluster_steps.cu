// GPU sampling, part 3c (helpers): the geometry, the distributed-shared-memory primitives and
// the per-row steps of sampling_cluster (sampling_cluster.cu), one thread-block cluster of
// CLUSTER_CTAS CTAs per top-p row on Hopper (sm_90+).

// The CTA shape is a specialisation (cluster.rs ClusterShape): threads per CTA (a multiple of
// 128, so the segments split evenly over the lanes of the leader warp) and the CTAs per SM
// the register budget is sized for.
#ifndef PAGODA_CLUSTER_THREADS
#define PAGODA_CLUSTER_THREADS 512
#endif
#ifndef PAGODA_CLUSTER_BLOCKS
#define PAGODA_CLUSTER_BLOCKS 3
#endif
#define CLUSTER_CTAS 8u
#define CLUSTER_THREADS PAGODA_CLUSTER_THREADS
#define CLUSTER_WARPS (CLUSTER_THREADS / 32u)
#define CLUSTER_SEGMENTS (CLUSTER_CTAS * CLUSTER_WARPS)
// The leader's word to the other warps: stop; else the next step's proposal slot or top-p.
#define STEP_STOP 0xFFFFFFFFu

// Segment w of a slice of `length` logits: [begin, end), spans a multiple of 4.
PAGODA_DEVICE void slice_segment(unsigned int length, unsigned int w, unsigned int& begin, unsigned int& end) {
    const unsigned int span = (length + 4u * CLUSTER_WARPS - 1u) / (4u * CLUSTER_WARPS) * 4u;
    begin = min(w * span, length);
    end = min(begin + span, length);
}

// Four logits of a CTA's slice by row id (i a multiple of 4; -inf past the slice's end): the
// slice starts at id `first`, a multiple of 4; its first `held` logits (a multiple of 4) are
// in shared memory, the rest are read from the row in global memory (L2 after the first
// pass), so the CTAs of a whole batch fit on the chip at once.
struct SliceLogits {
    const float* slice;
    const float* z;
    unsigned int first, held, end;
    bool aligned;
    PAGODA_DEVICE float4 operator()(unsigned int i) const {
        const unsigned int local = i - first;
        if (local < held) return *reinterpret_cast<const float4*>(slice + local);
        return load4(z, i, end, aligned);
    }
};

// body(v) for the float4 groups of a warp segment [begin, end) of the slice (local indices),
// lane-strided: those below `held` from shared memory, the rest from global memory.
template <typename Body>
PAGODA_DEVICE void for_segment(const SliceLogits& s, unsigned int begin, unsigned int end, Body body) {
    const unsigned int split = min(max(s.held, begin), end);
    unsigned int i = begin + (threadIdx.x & 31u) * 4u;
    for (; i < split; i += 128u) body(*reinterpret_cast<const float4*>(s.slice + i));
    for (; i < end; i += 128u) body(load4(s.z, s.first + i, s.end, s.aligned));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
PAGODA_DEVICE unsigned int cluster_rank() {
    unsigned int rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// Every thread of every CTA of the cluster: this CTA's shared-memory writes before it are
// visible to the cluster's reads after it. The release is restricted to shared memory: a
// CTA-level MEMBAR in SASS, where `barrier.cluster.arrive.release` is a GPU-wide one (the
// sampler call took 1.4-3 us less with this form on the H200: report
// gpu-sampling-barriers-h200-2026-11-30.md). It does not order the loads before it, so every
// distributed-shared-memory load before a cluster_sync must be consumed first (its value
// stored to shared memory, or deciding a word that is, before a __syncthreads): no CTA may
// overwrite a word another CTA has not finished reading. cluster_sync_all orders everything.
PAGODA_DEVICE void cluster_sync() {
    asm volatile(
        "fence.release.sync_restrict::shared::cta.cluster;\n\tbarrier.cluster.arrive.relaxed.aligned;\n\t"
        "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
PAGODA_DEVICE void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Asks L2 for the global memory [begin, end), rounded inward to 16 bytes (a hint: one bulk
// prefetch, no data returned, nothing to wait for).
PAGODA_DEVICE void prefetch_l2(const float* begin, const float* end) {
    const size_t from = (__cvta_generic_to_global(begin) + 15u) & ~(size_t)15u;
    const size_t to = __cvta_generic_to_global(end) & ~(size_t)15u;
    if (to > from) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(from), "r"((unsigned int)(to - from))
                     : "memory");
    }
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

// Warp 0 (the leader): the inverse-CDF draw's segment over the gathered segment masses `all`:
// the first segment of positive mass whose cumulative mass exceeds target = uniform * total
// (NO_TOKEN if none), the mass before it, the total and the target, in every lane. Lane l
// holds segments [l * n, (l + 1) * n); a fixed order, the same in every CTA.
PAGODA_DEVICE unsigned int draw_segment(const double* all, double uniform, double& before, double& total,
                                        double& target) {
    constexpr unsigned int per_lane = CLUSTER_SEGMENTS / 32u;
    const unsigned int lane = threadIdx.x & 31u;
    double mass[per_lane];
    double sum = 0.0;
#pragma unroll
    for (unsigned int k = 0; k < per_lane; ++k) {
        mass[k] = all[lane * per_lane + k];
        sum += mass[k];
    }
    double inclusive = sum;
#pragma unroll
    for (unsigned int offset = 1; offset < 32u; offset <<= 1) {
        const double other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    total = __shfl_sync(0xffffffffu, inclusive, 31);
    double prefix = __shfl_up_sync(0xffffffffu, inclusive, 1);
    if (lane == 0) prefix = 0.0;
    target = __dmul_rn(uniform, total);
    unsigned int found = NO_TOKEN;
    double found_before = 0.0;
#pragma unroll
    for (unsigned int k = 0; k < per_lane; ++k) {
        if (found == NO_TOKEN && mass[k] > 0.0 && prefix <= target && prefix + mass[k] > target) {
            found = lane * per_lane + k;
            found_before = prefix;
        }
        prefix += mass[k];
    }
    const unsigned int hits = __ballot_sync(0xffffffffu, found != NO_TOKEN);
    if (hits == 0u) return NO_TOKEN;
    const int source = __ffs(hits) - 1;
    before = __shfl_sync(0xffffffffu, found_before, source);
    return __shfl_sync(0xffffffffu, found, source);
}

// For a row the exact kernel is to draw (its argmax not tracked on the way in): the lowest id
// holding z_max, the cluster's minimum written to the row's filter state by rank 0. `slot` is
// a word of this CTA's shared memory. Block- and cluster-wide.
PAGODA_DEVICE void publish_argmax(const SliceLogits& logits4, unsigned int length, float z_max, unsigned int rank,
                                  unsigned int* slot, unsigned int* st) {
    unsigned int id = NO_TOKEN;
    for (unsigned int i = threadIdx.x * 4u; i < length && id == NO_TOKEN; i += blockDim.x * 4u) {
        const float4 v = logits4(logits4.first + i);
        id = v.x == z_max   ? logits4.first + i
             : v.y == z_max ? logits4.first + i + 1u
             : v.z == z_max ? logits4.first + i + 2u
             : v.w == z_max ? logits4.first + i + 3u
                            : NO_TOKEN;
    }
    float found = id == NO_TOKEN ? -INFINITY : z_max;
    block_argmax(found, id);
    if (threadIdx.x == 0) *slot = id;
    cluster_sync_all();
    if (rank == 0 && threadIdx.x == 0) {
        unsigned int argmax = NO_TOKEN;
        for (unsigned int r = 0; r < CLUSTER_CTAS; ++r) argmax = min(argmax, cluster_load_u32(slot, r));
        st[FS_ARGMAX] = argmax;
    }
    cluster_sync_all();  // no CTA leaves while rank 0 reads its slot
}

// draw_weight(v, z_max, scale) when v > low, else 0, as a mask rather than a branch (the
// pass over the slice stays free of divergent branches).
PAGODA_DEVICE float weight_above(float v, float low, float z_max, float scale) {
    const unsigned int keep = v > low ? 0xFFFFFFFFu : 0u;
    return __uint_as_float(__float_as_uint(draw_weight(v, z_max, scale)) & keep);
}
#endif

