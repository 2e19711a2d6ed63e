// The grouped expert MLP of a mixture-of-experts layer over experts kept in their GGUF blocks
// (`PAGODA_CUDA_MOE_QUANT`): moe_experts.cu's tiles of an expert's routed entries (the
// routing of moe_route.cu, tiles past the step's list return), with the weights decoded in
// registers by quant_decode.cu's `decode` and multiplied by q8 activations (quantize_q8_rows's
// 32-value blocks) through its `group_dot`, as gemv_quant does for the dense layers.
// `moe_quant_gate_up`: act[p] = silu(x[row_p] . gate_e) * (x[row_p] . up_e), gate and up in
// their own formats (a Q4_K_M file's gate/up are Q4_K, its down Q4_K or Q6_K); then
// `moe_quant_down`: out[p] = act[p] . down_e (f32), over the intermediates quantized to q8
// again; then moe_experts.cu's moe_combine.
//
// A warp owns a few weight rows of one expert for up to ROUTE_TILE_ROWS entries; its lanes
// stride over the rows' 32-value groups (lane l: groups l, l + 32, ...) and the warp's sums
// meet in a fixed butterfly: no atomics, every entry's sums in one order whatever shares its
// tile, so a row's bits do not depend on its batch or the run (deterministic mode may run it).
// Every grid depends on the step's row count only: graph-capturable. Steps of a few rows
// (`moe_quant_gate_up_rows`, `moe_quant_down_rows`) take a CTA row per routed entry instead of
// per tile (no CTAs of empty tiles), through the tiles' instantiation of the entry loop
// (`*_entries<TILE>` with one live entry). Every product and sum is spelled with rounding
// intrinsics (`group_dot<F, true>`, `__fadd_rn`): the compiler may not contract them
// differently in the two kernels, so a row gets the same bits alone and batched. (Plain
// expressions summed the same values but were not bit-equal on the H100, 2026-12-06, with
// either instantiation.)
//
// Specialisation: PAGODA_T (float or __nv_bfloat16), the intermediates' type; PAGODA_FORMAT_A
// (gate's format; down's in moe_quant_down) and PAGODA_FORMAT_B (up's), quant_decode.cu's
// Format numbers.

namespace moe_quant_detail {
using namespace moe_common;
using namespace gemv_quant_detail;
constexpr int FORMAT_A = PAGODA_FORMAT_A;
constexpr int FORMAT_B = PAGODA_FORMAT_B;
static_assert(FORMAT_A >= Q4_0 && FORMAT_A <= Q6_K && FORMAT_B >= Q4_0 && FORMAT_B <= Q6_K,
              "formats: 0-7");
constexpr int TILE = ROUTE_TILE_ROWS;  // entries per routing tile
constexpr int WARPS = 4;               // warps per CTA
constexpr int GATE_UP_COLS = 2;        // columns of gate and of up per warp
constexpr int DOWN_COLS = 4;           // columns of down per warp

// Bytes of a weight row of k values in format F.
template <int F>
PAGODA_DEVICE size_t row_bytes(unsigned int k) {
    return (size_t)(k / Fmt<F>::BLOCK_VALUES) * Fmt<F>::BLOCK_BYTES;
}

// Group `group` (32 values) of the weight row at `row`.
template <int F>
PAGODA_DEVICE void decode_group(const unsigned char* row, unsigned int group, Group& u) {
    constexpr int GPB = Fmt<F>::GROUPS_PER_BLOCK;
    decode<F>(row + (size_t)(group / GPB) * Fmt<F>::BLOCK_BYTES, group % GPB, u);
}

// The q8 block `group` of activation row `row` (`groups` blocks a row).
PAGODA_DEVICE void q8_block(const int* xq, const float2* xds, size_t row, unsigned int groups,
                            unsigned int group, int4& a, int4& c, float2& ds) {
    const int4* p = reinterpret_cast<const int4*>(xq + (row * groups + group) * 8);
    a = __ldg(p);
    c = __ldg(p + 1);
    ds = __ldg(xds + row * groups + group);
}

// gate/up of up to M entries of expert `expert` (q8 rows x_rows[i] of xq, outputs at act rows
// out_rows[i], i < m) for this warp's columns col0 .. col0 + GATE_UP_COLS.
template <int M>
PAGODA_DEVICE void gate_up_entries(const int* xq, const float2* xds, const unsigned char* gate,
                                   const unsigned char* up, unsigned int expert,
                                   const size_t (&x_rows)[M], const size_t (&out_rows)[M],
                                   unsigned int m, unsigned int col0, T* act,
                                   unsigned int hidden, unsigned int inter) {
    constexpr int C = GATE_UP_COLS;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int groups = hidden / 32;
    const unsigned char* g_rows[C];
    const unsigned char* u_rows[C];
#pragma unroll
    for (int r = 0; r < C; ++r) {
        const size_t row = (size_t)expert * inter + min(col0 + r, inter - 1);
        g_rows[r] = gate + row * row_bytes<FORMAT_A>(hidden);
        u_rows[r] = up + row * row_bytes<FORMAT_B>(hidden);
    }
    float acc_g[M][C], acc_u[M][C];
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int r = 0; r < C; ++r) acc_g[i][r] = acc_u[i][r] = 0.0f;
    for (unsigned int group = lane; group < groups; group += 32) {
        Group ug[C], uu[C];
#pragma unroll
        for (int r = 0; r < C; ++r) {
            decode_group<FORMAT_A>(g_rows[r], group, ug[r]);
            decode_group<FORMAT_B>(u_rows[r], group, uu[r]);
        }
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (i >= (int)m) break;
            int4 a, c;
            float2 ds;
            q8_block(xq, xds, x_rows[i], groups, group, a, c, ds);
#pragma unroll
            for (int r = 0; r < C; ++r) {
                acc_g[i][r] = __fadd_rn(acc_g[i][r], group_dot<FORMAT_A, true>(ug[r], a, c, ds));
                acc_u[i][r] = __fadd_rn(acc_u[i][r], group_dot<FORMAT_B, true>(uu[r], a, c, ds));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
        for (int r = 0; r < C; ++r) {
            const float g = warp_sum(acc_g[i][r]);
            const float u = warp_sum(acc_u[i][r]);
            const unsigned int col = col0 + r;
            if (lane == (unsigned int)((i * C + r) % 32) && i < (int)m && col < inter) {
                act[out_rows[i] * inter + col] = from_f32<T>(g / (1.0f + expf(-g)) * u);
            }
        }
    }
}

// down of up to M entries of expert `expert` (q8 rows a_rows[i] of actq, outputs at out rows
// a_rows[i], i < m) for this warp's columns col0 .. col0 + DOWN_COLS.
template <int M>
PAGODA_DEVICE void down_entries(const int* actq, const float2* actds, const unsigned char* down,
                                unsigned int expert, const size_t (&a_rows)[M], unsigned int m,
                                unsigned int col0, float* out, unsigned int hidden,
                                unsigned int inter) {
    constexpr int C = DOWN_COLS;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int groups = inter / 32;
    const unsigned char* w_rows[C];
#pragma unroll
    for (int r = 0; r < C; ++r) {
        const size_t row = (size_t)expert * hidden + min(col0 + r, hidden - 1);
        w_rows[r] = down + row * row_bytes<FORMAT_A>(inter);
    }
    float acc[M][C];
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int r = 0; r < C; ++r) acc[i][r] = 0.0f;
    for (unsigned int group = lane; group < groups; group += 32) {
        Group u[C];
#pragma unroll
        for (int r = 0; r < C; ++r) decode_group<FORMAT_A>(w_rows[r], group, u[r]);
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (i >= (int)m) break;
            int4 a, c;
            float2 ds;
            q8_block(actq, actds, a_rows[i], groups, group, a, c, ds);
#pragma unroll
            for (int r = 0; r < C; ++r)
                acc[i][r] = __fadd_rn(acc[i][r], group_dot<FORMAT_A, true>(u[r], a, c, ds));
        }
    }
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
        for (int r = 0; r < C; ++r) {
            const float v = warp_sum(acc[i][r]);
            const unsigned int col = col0 + r;
            if (lane == (unsigned int)((i * C + r) % 32) && i < (int)m && col < hidden) {
                out[a_rows[i] * hidden + col] = v;
            }
        }
    }
}
}  // namespace moe_quant_detail

// act[p, j] = silu(x[row_p] . gate_e[j]) * (x[row_p] . up_e[j]) for each tile (blockIdx.y) of
// an expert's routed entries p and this CTA's columns j (WARPS * GATE_UP_COLS). x arrives as
// q8 rows (xq, xds: [rows, hidden / 32] blocks); gate and up are [num_experts, inter, hidden]
// in FORMAT_A and FORMAT_B blocks; act [entries, inter] in routed order. hidden a multiple of
// both formats' blocks (the launcher checks).
extern "C" __global__ void __launch_bounds__(moe_quant_detail::WARPS * 32)
    moe_quant_gate_up(const int* __restrict__ xq, const float2* __restrict__ xds,
                      const unsigned char* __restrict__ gate,
                      const unsigned char* __restrict__ up,
                      const unsigned int* __restrict__ expert_offsets,
                      const unsigned int* __restrict__ expert_rows,
                      const unsigned int* __restrict__ tile_offsets,
                      const unsigned int* __restrict__ tile_experts,
                      const unsigned int* __restrict__ tile_starts, T* __restrict__ act,
                      unsigned int num_experts, unsigned int hidden, unsigned int inter) {
    using namespace moe_quant_detail;
    unsigned int expert = 0, start = 0;
    const unsigned int m = tile_entries(tile_offsets, tile_experts, tile_starts, expert_offsets,
                                        num_experts, blockIdx.y, expert, start);
    const unsigned int col0 = (blockIdx.x * WARPS + threadIdx.x / 32) * GATE_UP_COLS;
    if (m == 0 || col0 >= inter) return;
    size_t x_rows[TILE], out_rows[TILE];
#pragma unroll
    for (int i = 0; i < TILE; ++i) {
        x_rows[i] = expert_rows[start + min((unsigned int)i, m - 1)];
        out_rows[i] = start + i;
    }
    gate_up_entries<TILE>(xq, xds, gate, up, expert, x_rows, out_rows, m, col0, act, hidden,
                          inter);
}

// moe_quant_gate_up's values for steps of a few rows: a CTA row (blockIdx.y) per routed entry
// (row entry / top_k, expert experts[entry], routed position entry_slots[entry]; moe_route's
// lists), no empty tiles.
extern "C" __global__ void __launch_bounds__(moe_quant_detail::WARPS * 32)
    moe_quant_gate_up_rows(const int* __restrict__ xq, const float2* __restrict__ xds,
                           const unsigned char* __restrict__ gate,
                           const unsigned char* __restrict__ up,
                           const unsigned int* __restrict__ experts,
                           const unsigned int* __restrict__ entry_slots, T* __restrict__ act,
                           unsigned int top_k, unsigned int hidden, unsigned int inter) {
    using namespace moe_quant_detail;
    const unsigned int entry = blockIdx.y;
    const unsigned int col0 = (blockIdx.x * WARPS + threadIdx.x / 32) * GATE_UP_COLS;
    if (col0 >= inter) return;
    size_t x_rows[TILE], out_rows[TILE];
#pragma unroll
    for (int i = 0; i < TILE; ++i) {
        x_rows[i] = entry / top_k;
        out_rows[i] = entry_slots[entry];
    }
    gate_up_entries<TILE>(xq, xds, gate, up, experts[entry], x_rows, out_rows, 1, col0, act,
                          hidden, inter);
}

// out[p, h] = act[p] . down_e[h] (f32) for each tile's entries p and this CTA's columns h
// (WARPS * DOWN_COLS). act arrives as q8 rows in routed order (actq, actds: [entries, inter /
// 32] blocks); down is [num_experts, hidden, inter] in FORMAT_A blocks; out [entries, hidden].
// inter a multiple of the format's block (the launcher checks).
extern "C" __global__ void __launch_bounds__(moe_quant_detail::WARPS * 32)
    moe_quant_down(const int* __restrict__ actq, const float2* __restrict__ actds,
                   const unsigned char* __restrict__ down,
                   const unsigned int* __restrict__ expert_offsets,
                   const unsigned int* __restrict__ tile_offsets,
                   const unsigned int* __restrict__ tile_experts,
                   const unsigned int* __restrict__ tile_starts, float* __restrict__ out,
                   unsigned int num_experts, unsigned int hidden, unsigned int inter) {
    using namespace moe_quant_detail;
    unsigned int expert = 0, start = 0;
    const unsigned int m = tile_entries(tile_offsets, tile_experts, tile_starts, expert_offsets,
                                        num_experts, blockIdx.y, expert, start);
    const unsigned int col0 = (blockIdx.x * WARPS + threadIdx.x / 32) * DOWN_COLS;
    if (m == 0 || col0 >= hidden) return;
    size_t a_rows[TILE];
#pragma unroll
    for (int i = 0; i < TILE; ++i) a_rows[i] = start + i;
    down_entries<TILE>(actq, actds, down, expert, a_rows, m, col0, out, hidden, inter);
}

// moe_quant_down's values for steps of a few rows: a CTA row (blockIdx.y) per routed entry.
extern "C" __global__ void __launch_bounds__(moe_quant_detail::WARPS * 32)
    moe_quant_down_rows(const int* __restrict__ actq, const float2* __restrict__ actds,
                        const unsigned char* __restrict__ down,
                        const unsigned int* __restrict__ experts,
                        const unsigned int* __restrict__ entry_slots, float* __restrict__ out,
                        unsigned int top_k, unsigned int hidden, unsigned int inter) {
    using namespace moe_quant_detail;
    (void)top_k;
    const unsigned int entry = blockIdx.y;
    const unsigned int col0 = (blockIdx.x * WARPS + threadIdx.x / 32) * DOWN_COLS;
    if (col0 >= hidden) return;
    size_t a_rows[TILE];
#pragma unroll
    for (int i = 0; i < TILE; ++i) a_rows[i] = entry_slots[entry];
    down_entries<TILE>(actq, actds, down, experts[entry], a_rows, 1, col0, out, hidden, inter);
}
