// GPU sampling, shared part: per-row parameters, Philox-4x32-10, the Gumbel noise and the
// f64 exponential of pagoda_ops::sampling, ported bit-exactly (every f32/f64 operation is an
// explicit round-to-nearest intrinsic, so NVVM cannot contract a multiply-add into an FMA
// that the Rust code does not do), plus block reductions.
//
// This file is concatenated in front of sampling_walk.cu, sampling_gumbel.cu,
// sampling_fast.cu and sampling_rejection.cu into one NVRTC program (see SAMPLING in
// src/ops/mod.rs).

// Per-row parameters: 8 u32 words (SamplingRowParams in src/ops/sampling/params.rs).
#define SAMPLING_PARAM_WORDS 8u
// Largest number of CTAs one row is split into by the Gumbel/max kernels.
#define SAMPLING_MAX_SPLITS 128u
// Row outcome codes written to the per-row stats (RowPath in Rust).
#define PATH_GREEDY 0u
#define PATH_GUMBEL 1u
#define PATH_REJECTION 2u
#define PATH_FALLBACK 3u
// Philox purposes (pagoda_ops::sampling::philox::DrawPurpose).
#define PURPOSE_GUMBEL 1u
#define PURPOSE_REJECTION_ROUND 2u
#define PURPOSE_FALLBACK 3u
#define NO_TOKEN 0xffffffffu
// Launch flags (sample_rows_with): the multi-CTA filtered pipeline runs, its top-k select
// runs, the Gumbel partials are computed by sampling_gumbel, which also finds the row maxima
// (no sampling_row_max launch: only greedy and Gumbel rows).
#define FLAG_FAST 1u
#define FLAG_TOP_K 2u
#define FLAG_GUMBEL 4u
#define FLAG_GUMBEL_MAX 8u
// Per-row filter state (FILTER_STATE_WORDS u32 words in the workspace), written by the last
// CTA of a row in each multi-CTA kernel and read by the next kernel.
#define FILTER_STATE_WORDS 16u
#define FS_STATUS 0
#define FS_ROUNDS 1            // rounds begun (the candidate is round FS_ROUNDS - 1's draw)
#define FS_CANDIDATE 2
#define FS_LOW 3               // f32 bits: the proposal is {z > low}
#define FS_HIGH 4              // f32 bits: the upper pivot (z_max at first)
#define FS_TOP_K_THRESHOLD 5   // f32 bits: the k-th largest logit (-inf: top-k keeps all)
#define FS_Z_MAX 6             // f32 bits
#define FS_ARGMAX 7
#define FS_TOP_K_PREFIX 8      // radix select: ordered bits fixed so far
#define FS_TOP_K_REMAINING 9   // radix select: rank still to find below the prefix
#define FS_TOP_K_PENDING 10    // 1 while the radix select has digits left
#define FS_TOP_K_MASS 12       // f64 in words 12-13: Z_k, the untempered top-k mass
// Row status: not filtered / in the fast pipeline / finished by it / left to the exact kernel.
#define STATUS_IDLE 0u
#define STATUS_ACTIVE 1u
#define STATUS_DONE 2u
#define STATUS_EXACT 3u
#define FLT_MAX_BITS 0x7f7fffff

struct RowParams {
    float temperature;
    unsigned int top_k;
    float top_p;
    float min_p;
    unsigned int key0, key1;
    unsigned int step_low, step_high;
};

PAGODA_DEVICE RowParams load_row_params(const unsigned int* __restrict__ params, unsigned int row) {
    const unsigned int* p = params + (size_t)row * SAMPLING_PARAM_WORDS;
    RowParams r;
    r.temperature = __uint_as_float(p[0]);
    r.top_k = p[1];
    r.top_p = __uint_as_float(p[2]);
    r.min_p = __uint_as_float(p[3]);
    r.key0 = p[4];
    r.key1 = p[5];
    r.step_low = p[6];
    r.step_high = p[7];
    return r;
}

// NaN -> -inf (masked), +inf -> f32::MAX, as pagoda_ops' sanitize_logit.
// Two min/max instructions (fmaxf returns -inf for a NaN): it runs on every logit every
// sampling kernel loads.
PAGODA_DEVICE float sanitize_logit(float x) { return fminf(fmaxf(x, -INFINITY), __int_as_float(FLT_MAX_BITS)); }

// Greedy when temperature is 0 (or not a positive finite number), top_k == 1 or no finite
// logit; rejection when any filter is active (top_k in 2..vocab-1, top_p < 1, min_p > 0;
// NaN parameters count as off); Gumbel otherwise.
PAGODA_DEVICE unsigned int row_path(const RowParams& p, unsigned int vocab, float z_max) {
    if (!(p.temperature > 0.0f) || p.temperature == INFINITY || p.top_k == 1u || z_max == -INFINITY) {
        return PATH_GREEDY;
    }
    const bool filtered = (p.top_k > 0u && p.top_k < vocab) || p.top_p < 1.0f || p.min_p > 0.0f;
    return filtered ? PATH_REJECTION : PATH_GUMBEL;
}

PAGODA_DEVICE bool top_p_active(const RowParams& p) { return p.top_p < 1.0f; }
PAGODA_DEVICE bool min_p_active(const RowParams& p) { return p.min_p > 0.0f; }

// Philox-4x32-10 (Random123), counter {index, step_low, step_high, purpose}, key = seed words.
PAGODA_DEVICE uint4 philox_block(const RowParams& p, unsigned int purpose, unsigned int index) {
    uint4 c = make_uint4(index, p.step_low, p.step_high, purpose);
    unsigned int k0 = p.key0, k1 = p.key1;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const unsigned int lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// pagoda_ops::sampling::philox::open_uniform_f64_from_u64: top 52 bits, (bits + 0.5) 2^-52.
PAGODA_DEVICE double open_uniform_f64(unsigned int high, unsigned int low) {
    const unsigned long long bits = (((unsigned long long)high << 32) | low) >> 12;
    return __dmul_rn(__dadd_rn(__ull2double_rn(bits), 0.5), 2.220446049250313080847e-16);
}

// pagoda_ops gumbel::ln_f32 (Cephes logf), operation for operation.
PAGODA_DEVICE float ln_f32(float x) {
    const int bits = __float_as_int(x);
    const int exponent_raw = (bits >> 23) - 126;
    const float mantissa = __int_as_float((bits & 0x007FFFFF) | 0x3F000000);
    const bool below = mantissa < __int_as_float(0x3F3504F3);  // FRAC_1_SQRT_2 as f32
    const float exponent = __int2float_rn(exponent_raw - (below ? 1 : 0));
    const float m = below ? __fsub_rn(__fadd_rn(mantissa, mantissa), 1.0f) : __fsub_rn(mantissa, 1.0f);
    const float z = __fmul_rn(m, m);
    float y = 7.0376836e-2f;
    y = __fsub_rn(__fmul_rn(y, m), 1.151461e-1f);
    y = __fadd_rn(__fmul_rn(y, m), 1.16769984e-1f);
    y = __fsub_rn(__fmul_rn(y, m), 1.2420141e-1f);
    y = __fadd_rn(__fmul_rn(y, m), 1.4249323e-1f);
    y = __fsub_rn(__fmul_rn(y, m), 1.6668058e-1f);
    y = __fadd_rn(__fmul_rn(y, m), 2.0000714e-1f);
    y = __fsub_rn(__fmul_rn(y, m), 2.4999994e-1f);
    y = __fadd_rn(__fmul_rn(y, m), 3.333333e-1f);
    y = __fmul_rn(__fmul_rn(y, m), z);
    y = __fadd_rn(y, __fmul_rn(-2.1219444e-4f, exponent));
    y = __fadd_rn(y, __fmul_rn(-0.5f, z));
    const float result = __fadd_rn(m, y);
    return __fadd_rn(result, __fmul_rn(0.6933594f, exponent));
}

// pagoda_ops::sampling::gumbel_noise: finite, in about [-3.13, 22.87].
PAGODA_DEVICE float gumbel_noise(unsigned int word) {
    const float scale = __int_as_float(0x2F800000);  // 2^-32
    const bool upper = word >= 0x80000000u;
    const unsigned int small = upper ? ~word : word;
    const float tail = __fmul_rn(__fadd_rn(__int2float_rn((int)small), 0.5f), scale);
    const float near_one = __fsub_rn(1.0f, tail);
    const float lg = ln_f32(upper ? near_one : tail);
    const float complement = __fsub_rn(1.0f, near_one);
    const float denominator = complement == 0.0f ? 1.0f : complement;
    const float log1p_form = __fdiv_rn(__fmul_rn(-lg, tail), denominator);
    const float exponential = upper ? (complement == 0.0f ? tail : log1p_form) : -lg;
    return -ln_f32(exponential);
}

// pagoda_ops rejection::exp_f64 for x <= 0 (Cody-Waite + degree-13 Taylor, no FMA); below
// -700 CUDA's exp() (libm in Rust: both give the same subnormal-or-zero weights to ~1 ulp).
PAGODA_DEVICE double exp_f64(double x) {
    if (x < -700.0) return exp(x);
    const double log2_e = 1.4426950408889634074;
    const double ln2_high = 0.6931471803691238;
    const double ln2_low = 1.9082149292705877e-10;
    const double rounder = 6755399441055744.0;
    const double shifted = __dadd_rn(__dmul_rn(x, log2_e), rounder);
    const double k = __dsub_rn(shifted, rounder);
    const long long k_integer = __double_as_longlong(shifted) - __double_as_longlong(rounder);
    const double r = __dsub_rn(__dsub_rn(x, __dmul_rn(k, ln2_high)), __dmul_rn(k, ln2_low));
    double p = 1.0 / 6227020800.0;
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 479001600.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 39916800.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 3628800.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 362880.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 40320.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 5040.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 720.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 120.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 24.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0 / 6.0);
    p = __dadd_rn(__dmul_rn(p, r), 0.5);
    p = __dadd_rn(__dmul_rn(p, r), 1.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0);
    const double scale = __longlong_as_double((k_integer + 1023) << 52);
    return __dmul_rn(p, scale);
}

// pagoda_ops weights::draw_exp, the canonical draw weight exp(x) in f32 for x <= 0 (0 below
// -86): the same f32 operations and fused multiply-adds in the same order, so the same bits
// as the CPU.
PAGODA_DEVICE float draw_exp(float x) {
    const float rounder = 12582912.0f;  // 1.5 * 2^23
    const unsigned int keep = x < -86.0f ? 0u : 0xFFFFFFFFu;  // a mask, not a branch
    x = fmaxf(x, -86.0f);
    const float shifted = __fmaf_rn(x, __int_as_float(0x3FB8AA3B), rounder);  // log2(e)
    const float k = __fsub_rn(shifted, rounder);
    const int k_integer = __float_as_int(shifted) - __float_as_int(rounder);
    float r = __fmaf_rn(-k, __int_as_float(0x3F317200), x);  // ln 2, high part
    r = __fmaf_rn(-k, __int_as_float(0x35BFBE8E), r);        // ln 2, low part
    float p = __fmaf_rn(__int_as_float(0x39500D01), r, __int_as_float(0x3AB60B61));  // 1/7!, 1/6!
    p = __fmaf_rn(p, r, __int_as_float(0x3C088889));  // 1/5!
    p = __fmaf_rn(p, r, __int_as_float(0x3D2AAAAB));  // 1/4!
    p = __fmaf_rn(p, r, __int_as_float(0x3E2AAAAB));  // 1/3!
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    return __uint_as_float(__float_as_uint(__fmul_rn(p, __int_as_float((k_integer + 127) << 23))) & keep);
}

// pagoda_ops weights::draw_weight: the canonical draw weight of v, draw_exp((v - z_max) *
// scale) in f32 with scale = 1 / T in f32 (0 for -inf).
PAGODA_DEVICE float draw_weight(float v, float z_max, float scale) {
    return draw_exp(__fmul_rn(__fsub_rn(v, z_max), scale));
}

// The f32 inverse temperature of the draw weights (pagoda_ops: 1.0 / temperature in f32).
PAGODA_DEVICE float draw_scale(float temperature) { return __fdiv_rn(1.0f, temperature); }

// Weight exp((z - z_max) * scale) in f64, exactly as pagoda_ops' exp_weights (the filters'
// masses and the fallback's draw).
PAGODA_DEVICE double weight_of(float z, double z_max, double scale) {
    return exp_f64(__dmul_rn(__dsub_rn((double)z, z_max), scale));
}

// Monotone f32 -> u32 (unsigned order = float order, -0.0 == +0.0) and back.
PAGODA_DEVICE unsigned int ordered_bits(float v) {
    const unsigned int bits = __float_as_uint(__fadd_rn(v, 0.0f));
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
PAGODA_DEVICE float from_ordered_bits(unsigned int o) {
    return (o & 0x80000000u) ? __uint_as_float(o & 0x7FFFFFFFu) : __uint_as_float(~o);
}
PAGODA_DEVICE float next_down(float v) { return from_ordered_bits(ordered_bits(v) - 1u); }

// (score, id) order of every argmax here: larger score wins, lower id on equal scores.
PAGODA_DEVICE bool better(float score, unsigned int id, float best, unsigned int best_id) {
    return score > best || (score == best && id < best_id);
}

PAGODA_DEVICE void warp_argmax(float& best, unsigned int& best_id) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const unsigned int other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
        if (better(other, other_id, best, best_id)) { best = other; best_id = other_id; }
    }
}

// Block-wide (score, id) argmax; every thread gets the result. blockDim.x multiple of 32.
PAGODA_DEVICE void block_argmax(float& best, unsigned int& best_id) {
    __shared__ float scores[32];
    __shared__ unsigned int ids[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    warp_argmax(best, best_id);
    __syncthreads();
    if (lane == 0) { scores[warp] = best; ids[warp] = best_id; }
    __syncthreads();
    best = lane < num_warps ? scores[lane] : -INFINITY;
    best_id = lane < num_warps ? ids[lane] : NO_TOKEN;
    warp_argmax(best, best_id);
}

PAGODA_DEVICE double warp_sum_f64(double value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// Block sum of an f64 (fixed reduction tree); every thread gets it.
PAGODA_DEVICE double block_sum_f64(double value) {
    __shared__ double partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    value = warp_sum_f64(value);
    __syncthreads();
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    return warp_sum_f64(lane < num_warps ? partial[lane] : 0.0);
}

PAGODA_DEVICE unsigned int block_sum_u32(unsigned int value) {
    __shared__ unsigned int partial_u[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    __syncthreads();
    if (lane == 0) partial_u[warp] = value;
    __syncthreads();
    value = lane < num_warps ? partial_u[lane] : 0u;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// Element range [begin, end) of split `split` of a row: splits cover whole Philox blocks
// (4 elements), span = ceil(ceil(vocab / 4) / num_splits) blocks each.
PAGODA_DEVICE void split_range(unsigned int vocab, unsigned int num_splits, unsigned int split,
                               unsigned int& begin, unsigned int& end) {
    const unsigned int blocks = (vocab + 3u) / 4u;
    const unsigned int span = (blocks + num_splits - 1u) / num_splits;
    const unsigned long long b = (unsigned long long)split * span * 4u;
    const unsigned long long e = b + (unsigned long long)span * 4u;
    begin = (unsigned int)min(b, (unsigned long long)vocab);
    end = (unsigned int)min(e, (unsigned long long)vocab);
}

// Row maximum and its lowest index from the per-split partials of sampling_row_max, read in
// parallel (one split per thread) and reduced block-wide; every thread gets the result.
PAGODA_DEVICE void reduce_row_max(const float* partial_max, const unsigned int* partial_index,
                                  unsigned int row, unsigned int num_splits, float& z_max,
                                  unsigned int& argmax) {
    z_max = -INFINITY;
    argmax = NO_TOKEN;
    for (unsigned int s = threadIdx.x; s < num_splits; s += blockDim.x) {
        const float v = __ldcg(partial_max + row * num_splits + s);
        const unsigned int id = __ldcg(partial_index + row * num_splits + s);
        if (better(v, id, z_max, argmax)) { z_max = v; argmax = id; }
    }
    block_argmax(z_max, argmax);
    if (z_max == -INFINITY) argmax = 0u;  // no finite logit: token 0, as the CPU chain
}

// Totals (u64 counters as u32 pairs): 0 greedy, 1 gumbel, 2 rejection, 3 fallback, 4 rounds,
// 5 filtered rows finished by the multi-CTA pipeline, 6 filtered rows the exact kernel drew,
// 7 rows whose maximum sampling_gumbel found (FLAG_GUMBEL_MAX), 8 filtered rows
// sampling_list_rounds accepted, 9 filtered rows sampling_cluster finished.
PAGODA_DEVICE void count_total(unsigned int* totals, unsigned int counter, unsigned long long amount) {
    atomicAdd(reinterpret_cast<unsigned long long*>(totals) + counter, amount);
}

// Four sanitised logits z[i..i+4) (i a multiple of 4); -inf at and past `end`. One 16-byte
// load when the row is 16-byte aligned and the four are in range.
PAGODA_DEVICE float4 load4(const float* __restrict__ z, unsigned int i, unsigned int end, bool aligned) {
    float4 v;
    if (aligned && i + 4u <= end) {
        v = __ldg(reinterpret_cast<const float4*>(z + i));
    } else {
        v.x = i < end ? z[i] : -INFINITY;
        v.y = i + 1u < end ? z[i + 1u] : -INFINITY;
        v.z = i + 2u < end ? z[i + 2u] : -INFINITY;
        v.w = i + 3u < end ? z[i + 3u] : -INFINITY;
    }
    return make_float4(sanitize_logit(v.x), sanitize_logit(v.y), sanitize_logit(v.z), sanitize_logit(v.w));
}

PAGODA_DEVICE bool row_aligned(const float* z) { return (reinterpret_cast<size_t>(z) & 15u) == 0u; }

// Exclusive prefix sum of `value` over the block in thread order (fixed order: the result
// does not depend on timing); `total` gets the block's sum. Block-wide.
PAGODA_DEVICE double block_exclusive_scan_f64(double value, double& total) {
    __shared__ double warp_totals[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    double inclusive = value;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const double other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    double exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
    if (lane == 0) exclusive = 0.0;
    __syncthreads();
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    double before = 0.0, sum = 0.0;
    for (int w = 0; w < num_warps; ++w) {
        const double t = warp_totals[w];
        if (w < warp) before += t;
        sum += t;
    }
    total = sum;
    __syncthreads();
    return before + exclusive;
}

// Called by every thread of a CTA once its partials are written: true in exactly one CTA of
// the row (the last of the row's `num_splits` to arrive), which then sees every partial of
// the row (read them with __ldcg); the counter is left at zero for the next kernel.
PAGODA_DEVICE bool last_to_arrive(unsigned int* arrive, unsigned int row, unsigned int num_splits) {
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int ticket = atomicAdd(&arrive[row], 1u);
        s_last = ticket == num_splits - 1u;
        if (s_last) arrive[row] = 0u;
    }
    __syncthreads();
    const bool last = s_last;
    if (last) __threadfence();
    return last;
}

PAGODA_DEVICE double state_f64(const unsigned int* st, int word) {
    return __hiloint2double((int)st[word + 1], (int)st[word]);
}
PAGODA_DEVICE void set_state_f64(unsigned int* st, int word, double value) {
    st[word] = (unsigned int)__double2loint(value);
    st[word + 1] = (unsigned int)__double2hiint(value);
}
