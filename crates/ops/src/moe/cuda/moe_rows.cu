// The expert MLP of a mixture-of-experts layer for steps of a few rows (decode), a warp per
// (row, expert, column group) instead of moe_experts.cu's tiles of an expert's entries: each
// expert's weights are read once per row routed to it (the tiles: once per 8 entries), and
// nothing waits on a tile's other entries, so the launches are wide at one row
// (`moe_gate_up_rows`: ROWS columns of gate and up a warp; `moe_down_combine`: the down
// projection and the combine in one launch). Each dot product runs as moe_experts.cu's (the
// same lane split, per-lane order and warp reduction) and the combine in moe_combine's order:
// bit for bit moe_gate_up, moe_down and moe_combine's results. CPU reference: the CPU's
// Experts::mix.
//
// Grids (ceil(columns / (col_groups * ROWS)), num_rows): the row count only, so a decode
// step's experts are captured in its CUDA graph; a CTA's warps take its (expert, column
// group) pairs in turn, col_groups <= WARPS (the launcher picks it so top-k pairs fill them).
//
// Specialisation: PAGODA_T (float or __nv_bfloat16), the activations' and weights' type
// (`typedef T`, with the shared loads, in moe_common.cu).

namespace moe_rows_detail {
using namespace moe_common;
constexpr int MAX_TOP_K = 32;
constexpr int WARPS = 8;            // warps per CTA
constexpr int ROWS = 4;             // weight rows (output columns) per warp
// Pieces per weight row in flight per lane: 16 loads of 16 bytes a lane either way (gate
// and up: 2 of 8 rows, keeping two CTAs an SM; down: 4 of 4).
constexpr int GATE_UP_UNROLL = 2;
constexpr int DOWN_UNROLL = 4;

// acc[r] += a . w_rows[r] over `pieces` 16-byte pieces, lane l taking pieces l, l + 32, ...
// in ascending order (moe_experts.cu's order), U pieces of each row loaded before use.
template <int N, int U>
PAGODA_DEVICE void dot_rows(const T* a, const T* const* w_rows, unsigned int pieces,
                            float (&acc)[N]) {
    const unsigned int lane = threadIdx.x % 32;
    for (unsigned int base = lane; base < pieces; base += 32 * U) {
        uint4 wv[U][N];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned int p = base + 32 * u;
#pragma unroll
            for (int r = 0; r < N; ++r)
                wv[u][r] = p < pieces ? load_stream(w_rows[r] + (size_t)p * PIECE)
                                      : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned int p = base + 32 * u;
            if (p >= pieces) break;
            float af[PIECE];
            widen(__ldg(reinterpret_cast<const uint4*>(a + (size_t)p * PIECE)), af,
                  (const T*)nullptr);
#pragma unroll
            for (int r = 0; r < N; ++r) {
                float wf[PIECE];
                widen(wv[u][r], wf, (const T*)nullptr);
#pragma unroll
                for (int e = 0; e < PIECE; ++e) acc[r] = fmaf(af[e], wf[e], acc[r]);
            }
        }
    }
}
}  // namespace moe_rows_detail

// act[slot, j] = silu(x[row] . gate_e[j]) * (x[row] . up_e[j]) for each of row blockIdx.y's
// routed entries (expert e, routed position slot) and this CTA's columns j: moe_gate_up's
// values. x [rows, hidden]; gate, up [num_experts, inter, hidden]; experts/entry_slots
// [rows * top_k] (moe_route.cu's); act [entries, inter]. hidden a multiple of PIECE, buffers
// 16-byte aligned.
extern "C" __global__ void __launch_bounds__(moe_rows_detail::WARPS * 32)
    moe_gate_up_rows(const T* __restrict__ x, const T* __restrict__ gate,
                     const T* __restrict__ up, const unsigned int* __restrict__ experts,
                     const unsigned int* __restrict__ entry_slots, T* __restrict__ act,
                     unsigned int top_k, unsigned int hidden, unsigned int inter,
                     unsigned int col_groups) {
    using namespace moe_rows_detail;
    const size_t row = blockIdx.y;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int first_col = blockIdx.x * col_groups * ROWS;
    for (unsigned int item = threadIdx.x / 32; item < top_k * col_groups; item += WARPS) {
        const unsigned int j = item / col_groups, group = item % col_groups;
        const unsigned int col0 = first_col + group * ROWS;
        if (col0 >= inter) continue;
        const size_t entry = row * top_k + j;
        const unsigned int expert = experts[entry];
        const T* w_rows[2 * ROWS];  // gate rows, then up rows
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const size_t w_row = (size_t)expert * inter + min(col0 + r, inter - 1);
            w_rows[r] = gate + w_row * hidden;
            w_rows[ROWS + r] = up + w_row * hidden;
        }
        float acc[2 * ROWS];
#pragma unroll
        for (int r = 0; r < 2 * ROWS; ++r) acc[r] = 0.0f;
        dot_rows<2 * ROWS, GATE_UP_UNROLL>(x + row * hidden, w_rows, hidden / PIECE, acc);
        const size_t slot = entry_slots[entry];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float g = warp_sum(acc[r]);
            const float u = warp_sum(acc[ROWS + r]);
            const unsigned int col = col0 + r;
            if (lane == (unsigned int)r && col < inter) {
                act[slot * inter + col] = from_f32<T>(g / (1.0f + expf(-g)) * u);
            }
        }
    }
}

// moe_experts.cu's moe_down and moe_combine in one launch: x[row, h] += sum over the row's
// experts in ascending index of weight * (act[slot] . down_e[h]), plus shared[row, h] where
// given (after them). Each row's expert dot products land in shared memory and are summed in
// moe_combine's order: the two launches' bits without their f32 `out` round trip. The CTA
// owns col_groups * ROWS columns of row blockIdx.y. act [entries, inter], down [num_experts,
// hidden, inter], experts/weights/entry_slots [rows * top_k] (moe_route.cu's), shared/x
// [rows, hidden]; inter a multiple of PIECE, buffers 16-byte aligned.
extern "C" __global__ void __launch_bounds__(moe_rows_detail::WARPS * 32)
    moe_down_combine(const T* __restrict__ act, const T* __restrict__ down,
                     const unsigned int* __restrict__ experts, const float* __restrict__ weights,
                     const unsigned int* __restrict__ entry_slots,
                     const float* __restrict__ shared, float* __restrict__ x,
                     unsigned int top_k, unsigned int hidden, unsigned int inter,
                     unsigned int col_groups) {
    using namespace moe_rows_detail;
    __shared__ unsigned int order_experts[MAX_TOP_K];
    __shared__ unsigned int order_slots[MAX_TOP_K];
    __shared__ float order_weights[MAX_TOP_K];
    __shared__ float partial[MAX_TOP_K][WARPS * ROWS];
    const size_t row = blockIdx.y;
    if (threadIdx.x == 0) {
        // moe_combine's insertion sort by expert index.
        for (unsigned int j = 0; j < top_k; ++j) {
            const size_t entry = row * top_k + j;
            unsigned int at = j;
            while (at > 0 && order_experts[at - 1] > experts[entry]) {
                order_experts[at] = order_experts[at - 1];
                order_slots[at] = order_slots[at - 1];
                order_weights[at] = order_weights[at - 1];
                --at;
            }
            order_experts[at] = experts[entry];
            order_slots[at] = entry_slots[entry];
            order_weights[at] = weights[entry];
        }
    }
    __syncthreads();
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int columns = col_groups * ROWS;
    const unsigned int first_col = blockIdx.x * columns;
    const unsigned int pieces = inter / PIECE;
    for (unsigned int item = threadIdx.x / 32; item < top_k * col_groups; item += WARPS) {
        const unsigned int j = item / col_groups, group = item % col_groups;
        const unsigned int col0 = first_col + group * ROWS;
        if (col0 >= hidden) continue;
        const T* w_rows[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const size_t w_row = (size_t)order_experts[j] * hidden + min(col0 + r, hidden - 1);
            w_rows[r] = down + w_row * inter;
        }
        const T* a_row = act + (size_t)order_slots[j] * inter;
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
        dot_rows<ROWS, DOWN_UNROLL>(a_row, w_rows, pieces, acc);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[r]);
            if (lane == 0) partial[j][group * ROWS + r] = v;
        }
    }
    __syncthreads();
    for (unsigned int c = threadIdx.x; c < columns; c += blockDim.x) {
        const unsigned int h = first_col + c;
        if (h >= hidden) break;
        float sum = 0.0f;
        for (unsigned int j = 0; j < top_k; ++j) {
            sum = __fadd_rn(sum, __fmul_rn(order_weights[j], partial[j][c]));
        }
        if (shared != nullptr) sum = __fadd_rn(sum, shared[row * hidden + h]);
        x[row * hidden + h] = __fadd_rn(x[row * hidden + h], sum);
    }
}

