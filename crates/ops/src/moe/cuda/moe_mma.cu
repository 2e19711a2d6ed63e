// The grouped expert MLP on tensor cores (bf16 only; MoePath::TensorCore, the steps of many
// rows): moe_experts.cu's `moe_gate_up` and `moe_down` as mma.sync m16n8k16 (bf16 operands,
// f32 accumulators) over groups of GROUP_TILES consecutive routing tiles of one expert (up to
// 32 routed entries), the weights as the A operand (16 output columns a warp), the entries as
// B (n8 fragments of 8 entries). moe_experts.cu's `moe_combine` then sums each row's experts.
//
// No shared memory: each lane loads 16 bytes (8 values) of a weight row or an entry's row per
// 32-value step of the dot product, and the fragments take them in a permuted k order (lane
// t's values 8t..8t+7 of the step are the fragment's k 2t, 2t+1, 2t+8, 2t+9 of one mma and
// the same of the next), the same permutation for A and B, so the products pair up exactly.
//
// The CTA of routing tile blockIdx.y runs when that tile starts a group of its expert's tiles
// (its index among them a multiple of GROUP_TILES); others return. Every grid depends on the
// step's row count only, as in moe_experts.cu, so the launches are captured in graphs.
//
// Reproducibility: each output is one mma chain in ascending k, no atomics: the same inputs
// give the same bits on every run. Against the CUDA-core tiles the f32 sums differ in order
// only (the same bf16 products).
//
// Specialisation: PAGODA_T (__nv_bfloat16 only), with moe_common.cu and tensor_core.cu
// prepended.

static_assert(sizeof(T) == 2, "the MoE tensor-core kernels are bf16 only");

namespace moe_mma {
using namespace moe_common;
constexpr int TILE_ROWS = 8;                         // entries per routing tile (moe_route.cu)
constexpr int GROUP_TILES = 4;                       // routing tiles per CTA
constexpr int FRAGS = GROUP_TILES * TILE_ROWS / 8;   // n8 fragments of entries
constexpr int WARPS = 4;                             // warps per CTA
constexpr int WARP_COLS = 16;                        // output columns per warp (mma M)
constexpr int CTA_COLS = WARPS * WARP_COLS;          // output columns per CTA
constexpr int STEP = 32;                             // k per step: 4 lanes x 8 values
constexpr int UNROLL = 4;                            // steps of weights loaded ahead

// The group CTA `tile` leads: its expert, first entry and entry count (0: past the step's
// tiles, or not the first tile of a group).
PAGODA_DEVICE unsigned int group_entries(const unsigned int* tile_offsets,
                                         const unsigned int* tile_experts,
                                         const unsigned int* tile_starts,
                                         const unsigned int* expert_offsets,
                                         unsigned int num_experts, unsigned int tile,
                                         unsigned int& expert, unsigned int& start) {
    if (tile >= tile_offsets[num_experts]) return 0;
    expert = tile_experts[tile];
    if ((tile - tile_offsets[expert]) % GROUP_TILES != 0) return 0;
    start = tile_starts[tile];
    return min((unsigned int)(GROUP_TILES * TILE_ROWS), expert_offsets[expert + 1] - start);
}

// 16 bytes of a weight row at `k`, or zeros past the row (k >= len).
PAGODA_DEVICE uint4 weights_at(const T* row, unsigned int k, unsigned int len) {
    return k < len ? load_stream(row + k) : make_uint4(0, 0, 0, 0);
}

// 16 bytes of an activation row at `k`, or zeros past it or for a padding entry.
PAGODA_DEVICE uint4 values_at(const T* row, unsigned int k, unsigned int len, bool live) {
    return (live && k < len) ? __ldg(reinterpret_cast<const uint4*>(row + k))
                             : make_uint4(0, 0, 0, 0);
}

// acc += W[rows g, g + 8][32 values] . v[32 values]: two mmas over lane t's 8 values.
PAGODA_DEVICE void mma_step(float (&acc)[4], const uint4 w0, const uint4 w1, const uint4 v) {
    mma_bf16(acc, w0.x, w1.x, w0.y, w1.y, v.x, v.y);
    mma_bf16(acc, w0.z, w1.z, w0.w, w1.w, v.z, v.w);
}
}  // namespace moe_mma

// moe_experts.cu's `moe_gate_up` on tensor cores: act[p, j] = silu(x[row_p] . gate_e[j]) *
// (x[row_p] . up_e[j]) for the entries p of the group CTA blockIdx.y leads and the columns j
// of blockIdx.x (CTA_COLS per CTA). x [rows, hidden]; gate, up [num_experts, inter, hidden];
// act [entries, inter] in routed order. hidden and inter multiples of 8, x 16-byte aligned
// (the launcher checks).
extern "C" __global__ void __launch_bounds__(moe_mma::WARPS * 32)
    moe_gate_up_mma(const T* __restrict__ x, const T* __restrict__ gate,
                    const T* __restrict__ up, const unsigned int* __restrict__ expert_offsets,
                    const unsigned int* __restrict__ expert_rows,
                    const unsigned int* __restrict__ tile_offsets,
                    const unsigned int* __restrict__ tile_experts,
                    const unsigned int* __restrict__ tile_starts, T* __restrict__ act,
                    unsigned int num_experts, unsigned int hidden, unsigned int inter) {
    using namespace moe_mma;
    unsigned int expert = 0, start = 0;
    const unsigned int m = group_entries(tile_offsets, tile_experts, tile_starts, expert_offsets,
                                         num_experts, blockIdx.y, expert, start);
    const unsigned int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const unsigned int col0 = blockIdx.x * CTA_COLS + (threadIdx.x / 32) * WARP_COLS;
    if (m == 0 || col0 >= inter) return;  // uniform over the warp
    const unsigned int frags = (m + 7) / 8;
    const size_t w0 = ((size_t)expert * inter + min(col0 + g, inter - 1)) * hidden;
    const size_t w1 = ((size_t)expert * inter + min(col0 + g + 8, inter - 1)) * hidden;
    const T* x_rows[FRAGS];
    bool live[FRAGS];
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
        const unsigned int n = 8 * f + g;
        live[f] = n < m;
        x_rows[f] = x + (size_t)expert_rows[start + min(n, m - 1)] * hidden;
    }
    float acc_g[FRAGS][4], acc_u[FRAGS][4];
#pragma unroll
    for (int f = 0; f < FRAGS; ++f)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_g[f][i] = acc_u[f][i] = 0.0f;
    for (unsigned int base = 0; base < hidden; base += STEP * UNROLL) {
        uint4 wg[UNROLL][2], wu[UNROLL][2];
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            const unsigned int k = base + s * STEP + 8 * t;
            wg[s][0] = weights_at(gate + w0, k, hidden);
            wg[s][1] = weights_at(gate + w1, k, hidden);
            wu[s][0] = weights_at(up + w0, k, hidden);
            wu[s][1] = weights_at(up + w1, k, hidden);
        }
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            const unsigned int k = base + s * STEP + 8 * t;
#pragma unroll
            for (int f = 0; f < FRAGS; ++f) {
                if (f >= (int)frags) break;
                const uint4 v = values_at(x_rows[f], k, hidden, live[f]);
                mma_step(acc_g[f], wg[s][0], wg[s][1], v);
                mma_step(acc_u[f], wu[s][0], wu[s][1], v);
            }
        }
    }
    // Lane (g, t) holds columns col0 + g (+ 8) of entries 8f + 2t (+ 1).
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
        if (f >= (int)frags) break;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int col = col0 + g + 8 * (i / 2);
            const unsigned int n = 8 * f + 2 * t + (i % 2);
            if (n < m && col < inter) {
                const float gv = acc_g[f][i];
                act[(size_t)(start + n) * inter + col] =
                    from_f32<T>(gv / (1.0f + expf(-gv)) * acc_u[f][i]);
            }
        }
    }
}

// moe_experts.cu's `moe_down` on tensor cores: out[p, h] = act[p] . down_e[h] (f32) for the
// group's entries p and the columns h of blockIdx.x. act [entries, inter]; down [num_experts,
// hidden, inter]; out [entries, hidden].
extern "C" __global__ void __launch_bounds__(moe_mma::WARPS * 32)
    moe_down_mma(const T* __restrict__ act, const T* __restrict__ down,
                 const unsigned int* __restrict__ expert_offsets,
                 const unsigned int* __restrict__ tile_offsets,
                 const unsigned int* __restrict__ tile_experts,
                 const unsigned int* __restrict__ tile_starts, float* __restrict__ out,
                 unsigned int num_experts, unsigned int hidden, unsigned int inter) {
    using namespace moe_mma;
    unsigned int expert = 0, start = 0;
    const unsigned int m = group_entries(tile_offsets, tile_experts, tile_starts, expert_offsets,
                                         num_experts, blockIdx.y, expert, start);
    const unsigned int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const unsigned int col0 = blockIdx.x * CTA_COLS + (threadIdx.x / 32) * WARP_COLS;
    if (m == 0 || col0 >= hidden) return;  // uniform over the warp
    const unsigned int frags = (m + 7) / 8;
    const T* w0 = down + ((size_t)expert * hidden + min(col0 + g, hidden - 1)) * inter;
    const T* w1 = down + ((size_t)expert * hidden + min(col0 + g + 8, hidden - 1)) * inter;
    const T* a_rows[FRAGS];
    bool live[FRAGS];
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
        const unsigned int n = 8 * f + g;
        live[f] = n < m;
        a_rows[f] = act + (size_t)(start + min(n, m - 1)) * inter;
    }
    float acc[FRAGS][4];
#pragma unroll
    for (int f = 0; f < FRAGS; ++f)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[f][i] = 0.0f;
    for (unsigned int base = 0; base < inter; base += STEP * UNROLL) {
        uint4 w[UNROLL][2];
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            const unsigned int k = base + s * STEP + 8 * t;
            w[s][0] = weights_at(w0, k, inter);
            w[s][1] = weights_at(w1, k, inter);
        }
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            const unsigned int k = base + s * STEP + 8 * t;
#pragma unroll
            for (int f = 0; f < FRAGS; ++f) {
                if (f >= (int)frags) break;
                mma_step(acc[f], w[s][0], w[s][1], values_at(a_rows[f], k, inter, live[f]));
            }
        }
    }
#pragma unroll
    for (int f = 0; f < FRAGS; ++f) {
        if (f >= (int)frags) break;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int col = col0 + g + 8 * (i / 2);
            const unsigned int n = 8 * f + 2 * t + (i % 2);
            if (n < m && col < hidden) out[(size_t)(start + n) * hidden + col] = acc[f][i];
        }
    }
}
