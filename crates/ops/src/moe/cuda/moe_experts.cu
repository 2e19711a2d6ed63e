// The grouped expert MLP of a mixture-of-experts layer over the routing of moe_route.cu:
// per tile of an expert's routed entries, the SiLU-gated gate/up product (`moe_gate_up`) and
// the down projection (`moe_down`), on CUDA cores (a matrix-vector form: each weight row is
// read once per tile of up to TILE_ROWS entries); then each row's experts summed in ascending
// expert index into the residual stream (`moe_combine`). For steps of a few rows,
// moe_rows.cu runs the same sums a warp per (row, expert). CPU reference: the CPU's
// Experts::mix.
//
// Every grid depends on the step's row count only (tiles past the step's tile list return),
// so a decode step's experts are captured in its CUDA graph. Batch invariance: each routed
// entry's dot products run in one order whatever shares its tile, and the combine's order is
// the expert index, so a row's bits do not depend on its batch.
//
// Specialisation: PAGODA_T (float or __nv_bfloat16), the activations' and weights' type
// (`typedef T`, with the shared loads, in moe_common.cu).

namespace moe_detail {
using namespace moe_common;
constexpr int MAX_TOP_K = 32;
constexpr int TILE_ROWS = 8;        // routed entries per tile (moe_route.cu's TILE_ROWS)
constexpr int WARPS = 8;            // warps per expert-matmul CTA
constexpr int ROWS = 4;             // weight rows per warp
// Pieces per weight row in flight per lane in moe_down (its TILE_ROWS accumulators; 4 took
// 144 registers, one CTA an SM, 2 keep two).
constexpr int TILED_UNROLL = 2;

}  // namespace moe_detail

// The routed entries' gated intermediates: for each tile (blockIdx.y) of an expert's entries,
// act[p, j] = silu(x[row_p] . gate_e[j]) * (x[row_p] . up_e[j]) for its entries p and the
// columns j of this CTA (WARPS * ROWS per CTA, blockIdx.x). x [rows, hidden]; gate, up
// [num_experts, inter, hidden]; act [entries, inter] in routed (CSR) order. hidden a multiple
// of PIECE, buffers 16-byte aligned (the launcher checks).
extern "C" __global__ void __launch_bounds__(moe_detail::WARPS * 32)
    moe_gate_up(const T* __restrict__ x, const T* __restrict__ gate, const T* __restrict__ up,
                const unsigned int* __restrict__ expert_offsets,
                const unsigned int* __restrict__ expert_rows,
                const unsigned int* __restrict__ tile_offsets,
                const unsigned int* __restrict__ tile_experts,
                const unsigned int* __restrict__ tile_starts, T* __restrict__ act,
                unsigned int num_experts, unsigned int hidden, unsigned int inter) {
    using namespace moe_detail;
    unsigned int expert = 0, start = 0;
    const unsigned int m = tile_entries(tile_offsets, tile_experts, tile_starts, expert_offsets,
                                        num_experts, blockIdx.y, expert, start);
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int col0 = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
    if (m == 0 || col0 >= inter) return;
    const unsigned int pieces = hidden / PIECE;
    const T* x_rows[TILE_ROWS];
#pragma unroll
    for (int i = 0; i < TILE_ROWS; ++i) {
        const unsigned int row = expert_rows[start + min((unsigned int)i, m - 1)];
        x_rows[i] = x + (size_t)row * hidden;
    }
    const T* g_rows[ROWS];
    const T* u_rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const size_t row = (size_t)expert * inter + min(col0 + r, inter - 1);
        g_rows[r] = gate + row * hidden;
        u_rows[r] = up + row * hidden;
    }
    float acc_g[TILE_ROWS][ROWS], acc_u[TILE_ROWS][ROWS];
#pragma unroll
    for (int i = 0; i < TILE_ROWS; ++i)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc_g[i][r] = acc_u[i][r] = 0.0f;
    for (unsigned int p = lane; p < pieces; p += 32) {
        float gf[ROWS][PIECE], uf[ROWS][PIECE];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            widen(load_stream(g_rows[r] + (size_t)p * PIECE), gf[r], (const T*)nullptr);
            widen(load_stream(u_rows[r] + (size_t)p * PIECE), uf[r], (const T*)nullptr);
        }
#pragma unroll
        for (int i = 0; i < TILE_ROWS; ++i) {
            if (i >= (int)m) break;
            float xf[PIECE];
            widen(__ldg(reinterpret_cast<const uint4*>(x_rows[i] + (size_t)p * PIECE)), xf,
                  (const T*)nullptr);
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int e = 0; e < PIECE; ++e) {
                    acc_g[i][r] = fmaf(xf[e], gf[r][e], acc_g[i][r]);
                    acc_u[i][r] = fmaf(xf[e], uf[r][e], acc_u[i][r]);
                }
        }
    }
#pragma unroll
    for (int i = 0; i < TILE_ROWS; ++i) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float g = warp_sum(acc_g[i][r]);
            const float u = warp_sum(acc_u[i][r]);
            const unsigned int col = col0 + r;
            if (lane == (unsigned int)((i * ROWS + r) % 32) && i < (int)m && col < inter) {
                act[(size_t)(start + i) * inter + col] = from_f32<T>(g / (1.0f + expf(-g)) * u);
            }
        }
    }
}

// The routed entries' expert outputs: out[p, h] = act[p] . down_e[h] (f32) for each tile's
// entries p and this CTA's columns h. act [entries, inter]; down [num_experts, hidden, inter];
// out [entries, hidden]. inter a multiple of PIECE, buffers 16-byte aligned.
extern "C" __global__ void __launch_bounds__(moe_detail::WARPS * 32)
    moe_down(const T* __restrict__ act, const T* __restrict__ down,
             const unsigned int* __restrict__ expert_offsets,
             const unsigned int* __restrict__ tile_offsets,
             const unsigned int* __restrict__ tile_experts,
             const unsigned int* __restrict__ tile_starts, float* __restrict__ out,
             unsigned int num_experts, unsigned int hidden, unsigned int inter) {
    using namespace moe_detail;
    unsigned int expert = 0, start = 0;
    const unsigned int m = tile_entries(tile_offsets, tile_experts, tile_starts, expert_offsets,
                                        num_experts, blockIdx.y, expert, start);
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int col0 = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
    if (m == 0 || col0 >= hidden) return;
    const unsigned int pieces = inter / PIECE;
    const T* w_rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const size_t row = (size_t)expert * hidden + min(col0 + r, hidden - 1);
        w_rows[r] = down + row * inter;
    }
    float acc[TILE_ROWS][ROWS];
#pragma unroll
    for (int i = 0; i < TILE_ROWS; ++i)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[i][r] = 0.0f;
    // TILED_UNROLL pieces of each row issued before any is used (gemv_small.cu's form: inter
    // is short, 96 pieces at 768 bf16, so one piece a row at a time left the lanes waiting on
    // one load each); each lane still sums its pieces in ascending order.
    for (unsigned int base = lane; base < pieces; base += 32 * TILED_UNROLL) {
        uint4 wv[TILED_UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < TILED_UNROLL; ++u) {
            const unsigned int p = base + 32 * u;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                wv[u][r] = p < pieces ? load_stream(w_rows[r] + (size_t)p * PIECE)
                                      : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < TILED_UNROLL; ++u) {
            const unsigned int p = base + 32 * u;
            if (p >= pieces) break;
            float wf[ROWS][PIECE];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) widen(wv[u][r], wf[r], (const T*)nullptr);
#pragma unroll
            for (int i = 0; i < TILE_ROWS; ++i) {
                if (i >= (int)m) break;
                float af[PIECE];
                const T* a_row = act + (size_t)(start + i) * inter;
                widen(__ldg(reinterpret_cast<const uint4*>(a_row + (size_t)p * PIECE)), af,
                      (const T*)nullptr);
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int e = 0; e < PIECE; ++e)
                        acc[i][r] = fmaf(af[e], wf[r][e], acc[i][r]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < TILE_ROWS; ++i) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[i][r]);
            const unsigned int col = col0 + r;
            if (lane == (unsigned int)((i * ROWS + r) % 32) && i < (int)m && col < hidden) {
                out[(size_t)(start + i) * hidden + col] = v;
            }
        }
    }
}

// x[row, h] += sum over the row's experts in ascending index of weight * out[slot, h], plus
// shared[row, h] where given (the shared experts' output, after the routed ones): the CPU's
// summation order. One CTA per row (grid num_rows), any multiple of 32 threads.
extern "C" __global__ void moe_combine(const unsigned int* __restrict__ experts,
                                       const float* __restrict__ weights,
                                       const unsigned int* __restrict__ entry_slots,
                                       const float* __restrict__ out,
                                       const float* __restrict__ shared, float* __restrict__ x,
                                       unsigned int top_k, unsigned int hidden) {
    using namespace moe_detail;
    __shared__ unsigned int order_slots[MAX_TOP_K];
    __shared__ float order_weights[MAX_TOP_K];
    const size_t row = blockIdx.x;
    if (threadIdx.x == 0) {
        unsigned int ids[MAX_TOP_K];
        for (unsigned int j = 0; j < top_k; ++j) {
            const size_t entry = row * top_k + j;
            unsigned int at = j;
            // Insertion sort by expert index (top_k is small).
            while (at > 0 && ids[at - 1] > experts[entry]) {
                ids[at] = ids[at - 1];
                order_slots[at] = order_slots[at - 1];
                order_weights[at] = order_weights[at - 1];
                --at;
            }
            ids[at] = experts[entry];
            order_slots[at] = entry_slots[entry];
            order_weights[at] = weights[entry];
        }
    }
    __syncthreads();
    for (unsigned int h = threadIdx.x; h < hidden; h += blockDim.x) {
        float sum = 0.0f;
        for (unsigned int j = 0; j < top_k; ++j) {
            sum = __fadd_rn(sum, __fmul_rn(order_weights[j], out[(size_t)order_slots[j] * hidden + h]));
        }
        if (shared != nullptr) sum = __fadd_rn(sum, shared[row * hidden + h]);
        x[row * hidden + h] = __fadd_rn(x[row * hidden + h], sum);
    }
}
