// Mixture-of-experts routing on the device, one launch (`moe_route`): each row's top-k
// experts and weights (one warp per row, WARPS rows per CTA; DeepSeek's group limits and
// selection bias included), then, in the last CTA to finish, each expert's routed entries in
// row order (a CSR list) and the tiles the expert matmuls of moe_experts.cu run. CPU
// reference: pagoda_ops::moe::route_with (the same choices; weights within an ulp or two of
// f32, expf against Rust's exp, and the full softmax sum in another order; the sigmoid's
// selection scores use expf too, so scores an ulp or two apart may order otherwise).
//
// The grid depends on the row count only: a decode step's routing is captured in its CUDA
// graph. A row's choice reads its own logits only (batch invariance); the lists are a
// function of the choices, whichever CTA finishes last.
//
// Specialisation: PAGODA_T (float or __nv_bfloat16; unused here, named by the registry).
typedef PAGODA_T T;

namespace moe_route_detail {
constexpr int MAX_EXPERTS = 512;    // one word per expert and warp in shared memory
constexpr int WARPS = 8;            // rows routed at once
constexpr int MAX_TOP_K = 32;
constexpr int MAX_GROUPS = 32;      // one lane per group of a group-limited router
constexpr int TILE_ROWS = 8;        // entries per expert-matmul tile (moe_experts.cu's TILE_ROWS)

// f32::total_cmp's order as an unsigned key (larger float, larger key; -0 below +0). Key 0 is
// no float's (it would be a negative NaN, which the router maps to -inf first).
PAGODA_DEVICE unsigned int order_key(float v) {
    const unsigned int bits = __float_as_uint(v);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The float whose order_key is `key` (the inverse of order_key on every non-NaN float).
PAGODA_DEVICE float key_value(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// NaN (v != v) becomes -inf: it ranks below every number.
PAGODA_DEVICE float finite_or_neg_inf(float v) { return v != v ? -INFINITY : v; }

PAGODA_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Warp argmax of (key, index): the larger key, on equal keys the lower index.
PAGODA_DEVICE void warp_best(unsigned int& key, unsigned int& index) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const unsigned int other_key = __shfl_xor_sync(0xffffffffu, key, offset);
        const unsigned int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
        if (other_key > key || (other_key == key && other_index < index)) {
            key = other_key;
            index = other_index;
        }
    }
}

// Group-limited routing of one row on the calling warp (pagoda_ops::moe::limit_groups): the
// experts are cut into num_groups contiguous groups; each group is scored from its experts'
// selection scores (keys, order_key form): group_score 1, the best (the largest by f32's
// total order); 2, the sum of the two best, taken in expert order with f32 `>` and summed in
// f32 (a group of one counts its expert once). The groups_per_row best groups stay (ties: the
// lower group), every expert of the others drops to -inf. One lane per group, num_groups <=
// MAX_GROUPS; group_keys: the warp's shared scratch.
PAGODA_DEVICE void limit_groups(unsigned int* keys, unsigned int num_experts,
                                unsigned int num_groups, unsigned int groups_per_row,
                                unsigned int group_score, unsigned int* group_keys) {
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int group_size = num_experts / num_groups;
    if (lane < num_groups) {
        const unsigned int first = lane * group_size;
        float score;
        if (group_score == 1) {
            unsigned int best = 0;
            for (unsigned int e = first; e < first + group_size; ++e) best = max(best, keys[e]);
            score = key_value(best);
        } else {
            float top = -INFINITY, second = -INFINITY;
            for (unsigned int e = first; e < first + group_size; ++e) {
                const float value = key_value(keys[e]);
                if (value > top) {
                    second = top;
                    top = value;
                } else if (value > second) {
                    second = value;
                }
            }
            score = group_size == 1 ? top : top + second;
        }
        group_keys[lane] = order_key(score);
    }
    __syncwarp();
    // A group's rank: the groups before it in the stable descending order.
    bool kept = false;
    if (lane < num_groups) {
        const unsigned int mine = group_keys[lane];
        unsigned int rank = 0;
        for (unsigned int g = 0; g < num_groups; ++g) {
            const unsigned int other = group_keys[g];
            rank += other > mine || (other == mine && g < lane);
        }
        kept = rank < groups_per_row;
    }
    __syncwarp();
    if (lane < num_groups) group_keys[lane] = kept;
    __syncwarp();
    const unsigned int dropped = order_key(-INFINITY);
    for (unsigned int e = lane; e < num_experts; e += 32) {
        if (group_keys[e / group_size] == 0) keys[e] = dropped;
    }
    __syncwarp();
}

// Routes one row (`logits_row`, num_experts f32) on the calling warp into row_experts /
// row_weights [top_k], best first. scoring 0: softmax (choose by logit, weigh by the softmax
// over every expert, or over the picked when renormalize); 1: sigmoid (choose by sigmoid +
// bias, weigh by the unbiased sigmoid, divided by the picked sum + 1e-20 when renormalize).
// group_score 0: no group limit; else limit_groups first. NaN ranks last; ties go to the
// lower expert. Weights times scale. keys/picks/group_keys: the warp's shared scratch.
PAGODA_DEVICE void route_row(const float* row, const float* bias, unsigned int num_experts,
                             unsigned int top_k, unsigned int scoring, unsigned int renormalize,
                             float scale, unsigned int num_groups, unsigned int groups_per_row,
                             unsigned int group_score, unsigned int* row_experts,
                             float* row_weights, unsigned int* keys, unsigned int* picks,
                             unsigned int* group_keys) {
    const unsigned int lane = threadIdx.x % 32;
    float max_logit = -INFINITY;
    for (unsigned int e = lane; e < num_experts; e += 32) {
        const float l = row[e];
        float choice;
        if (scoring == 0) {
            choice = finite_or_neg_inf(l);
            max_logit = fmaxf(max_logit, choice);
        } else {
            choice = finite_or_neg_inf(sigmoid(l) + (bias != nullptr ? bias[e] : 0.0f));
        }
        keys[e] = order_key(choice);
    }
    max_logit = warp_max(max_logit);
    __syncwarp();
    if (group_score != 0) {
        limit_groups(keys, num_experts, num_groups, groups_per_row, group_score, group_keys);
    }
    for (unsigned int j = 0; j < top_k; ++j) {
        unsigned int key = 0, index = 0xffffffffu;
        for (unsigned int e = lane; e < num_experts; e += 32) {
            if (keys[e] > key) {  // strided: indices increase per lane, ties keep the first
                key = keys[e];
                index = e;
            }
        }
        warp_best(key, index);
        if (lane == 0) {
            picks[j] = index;
            keys[index] = 0;  // below every score: taken
        }
        __syncwarp();
    }
    // The weights, in pick order, on lane 0 (top_k is small); the softmax's full denominator
    // over the warp.
    float denominator = 0.0f;
    if (scoring == 0 && renormalize == 0) {
        for (unsigned int e = lane; e < num_experts; e += 32) {
            const float v = expf(row[e] - max_logit);
            if (v == v) denominator += v;  // not NaN
        }
        denominator = warp_sum(denominator);
    }
    if (lane == 0) {
        float sum = 0.0f;
        for (unsigned int j = 0; j < top_k; ++j) {
            const unsigned int e = picks[j];
            float w;
            if (scoring == 0) {
                w = expf(finite_or_neg_inf(row[e]) - max_logit);
            } else {
                w = sigmoid(row[e]);
                if (w != w) w = 0.0f;  // NaN
            }
            row_experts[j] = e;
            row_weights[j] = w;
            sum += w;
        }
        if (scoring == 0 && renormalize != 0) denominator = sum;
        if (scoring != 0) denominator = renormalize != 0 ? sum + 1e-20f : 1.0f;
        for (unsigned int j = 0; j < top_k; ++j) {
            float w = scoring == 0 || renormalize != 0 ? row_weights[j] / denominator
                                                       : row_weights[j];
            if (scale != 1.0f) w *= scale;
            row_weights[j] = w;
        }
    }
    __syncwarp();  // the warp's keys and picks are reused by its next row
}

// Each expert's routed entries in ascending row order (a counting sort by expert, stable),
// and the tiles of TILE_ROWS entries the expert matmuls run, by the whole CTA. Reads
// experts/weights [num_entries] (num_entries = rows * top_k, row-major; written by this and
// other CTAs of the launch before a fence, so read through L2); writes expert_offsets
// [num_experts + 1], expert_rows/expert_weights [num_entries] (entry i of expert e at
// expert_offsets[e] + i), entry_slots [num_entries] (each routed entry's position in that
// order), tile_offsets [num_experts + 1] (expert e's tiles are tile_offsets[e]..tile_offsets[e
// + 1]) and per tile its expert and first position.
// Parallel throughout: counts by shared atomics (order-free), offsets by a block scan, and the
// scatter a pass of WARPS * 32 entries at a time, each warp's entries ranked among their
// equals by __match_any_sync and the warps taking their turn at the cursors in order, so an
// expert's entries land in entry (so row) order whatever the timing.
PAGODA_DEVICE void expert_rows_of(const unsigned int* experts, const float* weights,
                                  unsigned int num_entries, unsigned int top_k,
                                  unsigned int num_experts, unsigned int* expert_offsets,
                                  unsigned int* expert_rows, float* expert_weights,
                                  unsigned int* entry_slots, unsigned int* tile_offsets,
                                  unsigned int* tile_experts, unsigned int* tile_starts) {
    constexpr int THREADS = WARPS * 32;
    constexpr int PER_THREAD = MAX_EXPERTS / THREADS;  // experts each thread scans
    __shared__ unsigned int counts[MAX_EXPERTS];
    __shared__ unsigned int cursors[MAX_EXPERTS];
    __shared__ unsigned int first_tiles[MAX_EXPERTS];
    __shared__ unsigned int warp_totals[2][WARPS];
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (unsigned int e = threadIdx.x; e < num_experts; e += THREADS) counts[e] = 0;
    __syncthreads();
    for (unsigned int i = threadIdx.x; i < num_entries; i += THREADS) {
        atomicAdd(&counts[__ldcg(experts + i)], 1u);
    }
    __syncthreads();
    // Exclusive scans of the entry and tile counts over the experts, PER_THREAD consecutive
    // experts a thread.
    unsigned int mine[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) {
        const unsigned int e = threadIdx.x * PER_THREAD + k;
        const unsigned int count = e < num_experts ? counts[e] : 0;
        mine[0] += count;
        mine[1] += (count + TILE_ROWS - 1) / TILE_ROWS;
    }
    unsigned int inclusive[2] = {mine[0], mine[1]};
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const unsigned int other = __shfl_up_sync(0xffffffffu, inclusive[q], offset);
            if (lane >= (unsigned int)offset) inclusive[q] += other;
        }
    }
    if (lane == 31) {
        warp_totals[0][warp] = inclusive[0];
        warp_totals[1][warp] = inclusive[1];
    }
    __syncthreads();
    unsigned int before[2] = {inclusive[0] - mine[0], inclusive[1] - mine[1]};
    unsigned int totals[2] = {0, 0};
    for (unsigned int w = 0; w < WARPS; ++w) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            if (w < warp) before[q] += warp_totals[q][w];
            totals[q] += warp_totals[q][w];
        }
    }
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) {
        const unsigned int e = threadIdx.x * PER_THREAD + k;
        if (e >= num_experts) break;
        const unsigned int count = counts[e];
        expert_offsets[e] = cursors[e] = before[0];
        tile_offsets[e] = first_tiles[e] = before[1];
        before[0] += count;
        before[1] += (count + TILE_ROWS - 1) / TILE_ROWS;
    }
    if (threadIdx.x == 0) {
        expert_offsets[num_experts] = totals[0];
        tile_offsets[num_experts] = totals[1];
    }
    __syncthreads();
    for (unsigned int e = threadIdx.x; e < num_experts; e += THREADS) {
        const unsigned int first = first_tiles[e], start = cursors[e];
        const unsigned int tiles = (counts[e] + TILE_ROWS - 1) / TILE_ROWS;
        for (unsigned int t = 0; t < tiles; ++t) {
            tile_experts[first + t] = e;
            tile_starts[first + t] = start + t * TILE_ROWS;
        }
    }
    __syncthreads();
    // The scatter: entry i's slot is its expert's cursor plus the entries of that expert
    // before it in its warp; the warps of a pass take the cursors in order.
    for (unsigned int base = 0; base < num_entries; base += THREADS) {
        const unsigned int entry = base + threadIdx.x;
        const bool valid = entry < num_entries;
        const unsigned int e = valid ? __ldcg(experts + entry) : 0xffffffffu;
        const unsigned int peers = __match_any_sync(0xffffffffu, e);
        const unsigned int rank = __popc(peers & ((1u << lane) - 1u));
        const unsigned int valid_lanes = __ballot_sync(0xffffffffu, valid);
        for (unsigned int w = 0; w < WARPS; ++w) {
            if (warp == w && valid) {
                const unsigned int slot = cursors[e] + rank;
                __syncwarp(valid_lanes);  // every read of a cursor before its update
                if (rank == (unsigned int)__popc(peers) - 1u) cursors[e] = slot + 1;
                expert_rows[slot] = entry / top_k;
                expert_weights[slot] = __ldcg(weights + entry);
                entry_slots[entry] = slot;
            }
            __syncthreads();
        }
    }
}

}  // namespace moe_route_detail

// Routes num_rows rows of f32 logits [num_rows, num_experts] (route_row, one warp per row,
// WARPS rows per CTA; group_score 0 for no group limit, 1 Max, 2 TopTwoSum over num_groups
// groups, keeping groups_per_row), then the last CTA to finish lists each expert's entries and
// the matmul tiles (expert_rows_of). Grid ceil(num_rows / WARPS) CTAs of WARPS * 32 threads;
// done [1], zero before the launch, counts the CTAs that have routed their rows and is zero
// again after it, so a captured graph replays.
extern "C" __global__ void __launch_bounds__(moe_route_detail::WARPS * 32)
    moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
              unsigned int num_rows, unsigned int num_experts, unsigned int top_k,
              unsigned int scoring, unsigned int renormalize, float scale,
              unsigned int num_groups, unsigned int groups_per_row, unsigned int group_score,
              unsigned int* experts, float* weights, unsigned int* expert_offsets,
              unsigned int* expert_rows, float* expert_weights, unsigned int* entry_slots,
              unsigned int* tile_offsets, unsigned int* tile_experts,
              unsigned int* tile_starts, unsigned int* done) {
    using namespace moe_route_detail;
    __shared__ unsigned int keys[WARPS][MAX_EXPERTS];
    __shared__ unsigned int picks[WARPS][MAX_TOP_K];
    __shared__ unsigned int group_keys[WARPS][MAX_GROUPS];
    __shared__ bool last;
    const unsigned int warp = threadIdx.x / 32;
    const unsigned int row = blockIdx.x * WARPS + warp;
    if (row < num_rows) {
        route_row(logits + (size_t)row * num_experts, bias, num_experts, top_k, scoring,
                  renormalize, scale, num_groups, groups_per_row, group_score,
                  experts + (size_t)row * top_k, weights + (size_t)row * top_k, keys[warp],
                  picks[warp], group_keys[warp]);
    }
    // The last CTA to get here sees every CTA's rows (each fenced its writes before counting).
    __threadfence();
    __syncthreads();
    // atomicInc wraps to zero at the last CTA: the counter is zero again for the next launch.
    if (threadIdx.x == 0) last = atomicInc(done, gridDim.x - 1) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    expert_rows_of(experts, weights, num_rows * top_k, top_k, num_experts, expert_offsets,
                   expert_rows, expert_weights, entry_slots, tile_offsets, tile_experts,
                   tile_starts);
}
