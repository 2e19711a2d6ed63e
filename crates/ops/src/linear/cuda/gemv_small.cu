// Small-batch linear layer on CUDA cores ("GEMV"): out[i, j] = beta * out[i, j] +
// sum_k x[i, k] * w[j, k] for the m <= M_TILE rows of x, bf16 x and w (row-major [m, k] and
// [n, k]), f32 accumulation, out f32 or bf16 ([m, n]). Decode steps multiply a handful of rows
// by every weight matrix: the weights are read once, at the memory's rate, and each weight
// vector serves all m rows.
//
// Each warp owns ROWS consecutive weight rows; its lanes stride over k in 16-byte pieces (8
// bf16): lane l reads pieces l, l + 32, ... of each of its rows, UNROLL pieces a row issued
// before any is used (the bytes in flight a read at the memory's rate needs), streamed past
// L1; the same pieces of the m activation rows come from cache. Pieces are widened to f32 by
// shifts and the ROWS x m dot products reduced over the warp at the end.
// Requirements (checked by the launcher): k a multiple of 8, x and w 16-byte aligned.
// Specialisation: PAGODA_T_OUT (float or __nv_bfloat16), PAGODA_M_TILE (1, 2, 4 or 8).
typedef PAGODA_T_OUT TO;

namespace gemv_small_detail {
constexpr int M_TILE = PAGODA_M_TILE;
constexpr int ROWS = 4;    // weight rows per warp
constexpr int WARPS = 8;   // warps per block
constexpr int UNROLL = 4;  // pieces per row in flight per lane
static_assert(M_TILE == 1 || M_TILE == 2 || M_TILE == 4 || M_TILE == 8, "M_TILE: 1, 2, 4 or 8");

// 16 bytes that are read once: no L1 allocation.
PAGODA_DEVICE uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
// The 8 bf16 of v as f32 (a bf16 is the high half of its f32).
PAGODA_DEVICE void widen(const uint4 v, float (&f)[8]) {
    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}
}  // namespace gemv_small_detail

extern "C" __global__ void __launch_bounds__(gemv_small_detail::WARPS * 32)
    gemv_small(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
               TO* __restrict__ out, unsigned int m, unsigned int n, unsigned int k, float beta) {
    using namespace gemv_small_detail;
    const unsigned int lane = threadIdx.x % 32;
    const unsigned int row0 = (blockIdx.x * WARPS + threadIdx.x / 32) * ROWS;
    if (row0 >= n) return;
    const unsigned int pieces = k / 8;
    const uint4* w_rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const unsigned int row = min(row0 + r, n - 1);  // rows past n read row n - 1, unused
        w_rows[r] = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    }
    const uint4* x_rows = reinterpret_cast<const uint4*>(x);
    float acc[M_TILE][ROWS];
#pragma unroll
    for (int i = 0; i < M_TILE; ++i)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[i][r] = 0.0f;

    for (unsigned int base = lane; base < pieces; base += 32 * UNROLL) {
        uint4 wv[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned int p = base + 32 * u;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                wv[u][r] = p < pieces ? load_stream(w_rows[r] + p) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned int p = base + 32 * u;
            if (p >= pieces) break;
            float wf[ROWS][8];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) widen(wv[u][r], wf[r]);
#pragma unroll
            for (int i = 0; i < M_TILE; ++i) {
                if (i < (int)m) {
                    float xf[8];
                    widen(__ldg(x_rows + (size_t)i * pieces + p), xf);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[i][r] = fmaf(xf[e], wf[r][e], acc[i][r]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < M_TILE; ++i) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float v = acc[i][r];
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
            const unsigned int row = row0 + r;
            if (lane == (unsigned int)((i * ROWS + r) % 32) && i < (int)m && row < n) {
                TO* o = out + (size_t)i * n + row;
                const float previous = beta != 0.0f ? beta * to_f32(*o) : 0.0f;
                *o = from_f32<TO>(previous + v);
            }
        }
    }
}
