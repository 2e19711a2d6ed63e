// The quantized linear layer for steps of a few dozen rows (batched decode) on the tensor
// cores: out[i, j] = beta * out[i, j] + sum_k x[i, k] * w[j, k] for m <= M_TILE activation
// rows against GGUF blocks read in place, the arithmetic of gemv_quant.cu (the activations in
// quantize_q8_rows's 32-value q8 blocks, every group's scale and offset once) with the integer
// dots on mma.sync instead of dp4a:
//   sum_k x w = sum_groups dx * dw * (qx . qw) + mw * (dx * sum qx).
// A group (32 values) is exactly the k of one m16n8k32 s8 mma: the weights (16 rows, the mma's
// M) times the activations (8 rows, its N) give each pair's integer dot of that group, then
// scaled in f32. Q6_K scales its 16-value halves apart: two m16n8k16 mmas.
//
// A CTA of WARPS warps owns ROWS (16) weight rows and the groups of its split of k (the
// launcher splits the groups of a matrix of few rows so that the grid fills the GPU; CTA
// (x, y) takes split y); warp w takes its slice of them (groups w * STEP .. w * STEP +
// STEP - 1 of the split, then WARPS * STEP further, ...). Per iteration each lane decodes
// two groups of one row with quant_decode.cu's `decode` (lane l: row l % 16, groups l / 16
// and 2 + l / 16 of the STEP) and stages their bytes and scales in shared memory, from where the warp reads its A fragments
// (a row's 12 words apart: the eight rows a fragment load touches fall in distinct banks);
// the B fragments (the activations' bytes) and their scales come from the L1. The warps' sums
// meet in shared memory in a fixed order; with splits, each CTA writes its sums to `partials`
// and the last CTA of a row tile to finish (a ticket counter, reset by that CTA for the next
// launch) adds the splits' sums in split order: a row's bits depend on neither the other rows,
// the arrival order nor the run.
// Requirements (checked by the launcher): k a multiple of the format's block, m <= M_TILE.
// Specialisation: PAGODA_FORMAT (0-7), PAGODA_M_TILE (8, 16, 32 or 64), PAGODA_T_OUT;
// `gemm_quant_mma_pair` also PAGODA_FORMAT_B, the format of its second part.
typedef PAGODA_T_OUT TO;

namespace quant_mma_detail {
using namespace gemv_quant_detail;
constexpr int FORMAT = PAGODA_FORMAT;
constexpr int M_TILE = PAGODA_M_TILE;
constexpr int TILES = M_TILE / 8;  // the mma's 8-row N tiles of activations
constexpr int WARPS = 4;           // warps of a CTA, each a slice of its groups
constexpr int K_SLICES = WARPS;
constexpr int ROWS = 16;           // weight rows a CTA owns (the mma's M)
constexpr int STEP = 4;    // groups a warp decodes per iteration (two a lane)
constexpr int STRIDE = 12;  // words a staged group row: 8 of bytes, dw[0], dw[1], mw, a pad
constexpr int STAGE_WORDS = STEP * 16 * STRIDE;  // a warp's staging
constexpr int SUM_WORDS = K_SLICES * ROWS * M_TILE;  // the slices' sums
constexpr int SHARED_WORDS = WARPS * STAGE_WORDS > SUM_WORDS ? WARPS * STAGE_WORDS : SUM_WORDS;
static_assert(M_TILE == 8 || M_TILE == 16 || M_TILE == 32 || M_TILE == 64,
              "M_TILE: 8, 16, 32 or 64");
static_assert(FORMAT >= Q4_0 && FORMAT <= Q6_K, "FORMAT: 0-7");

// d += a b over one group: m16n8k32, signed bytes, s32 accumulators.
PAGODA_DEVICE void mma_k32(int (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                           unsigned int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b over half a group: m16n8k16, signed bytes.
PAGODA_DEVICE void mma_k16(int (&d)[4], unsigned int a0, unsigned int a1, unsigned int b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(b));
}

// An integer dot as a float without I2F (a quarter-rate instruction): |v| < 2^22 here
// (32 products of at most 128 * 128).
PAGODA_DEVICE float dot_float(int v) { return __int_as_float(0x4B400000 + v) - 12582912.0f; }

// The CTA `cta` of the product with the n rows of format F at `w` into out (m rows of ldo).
// Split-k bookkeeping: the splits' sums ([split][row tile][M_TILE][ROWS] floats) and a ticket
// per row tile (zero between launches).
struct Splits {
    float* partials;
    unsigned int* tickets;
    unsigned int count;  // this part's splits (gridDim.y or fewer: the CTAs past it leave)
};

template <int F>
PAGODA_DEVICE void mma_rows(const unsigned char* __restrict__ w, const int* __restrict__ xq,
                            const float2* __restrict__ xds, TO* __restrict__ out, unsigned int m,
                            unsigned int n, unsigned int k, unsigned int ldo, float beta,
                            unsigned int cta, int* shared, Splits splits) {
    constexpr int GROUPS_PER_BLOCK = Fmt<F>::GROUPS_PER_BLOCK, BLOCK_BYTES = Fmt<F>::BLOCK_BYTES;
    if (blockIdx.y >= splits.count) return;
    const unsigned int lane = threadIdx.x % 32, slice = threadIdx.x / 32;
    const unsigned int gid = lane / 4, tig = lane % 4;
    const unsigned int all_groups = k / 32;
    // This CTA's split of the groups: [begin, end).
    const unsigned int per_split = (all_groups + splits.count - 1) / splits.count;
    const unsigned int begin = min(blockIdx.y * per_split, all_groups);
    const unsigned int end = min(begin + per_split, all_groups);
    const size_t row_bytes = (size_t)(k / Fmt<F>::BLOCK_VALUES) * BLOCK_BYTES;
    // The row this lane decodes (rows past n decode the last one; their sums are not stored).
    const unsigned int row0 = cta * ROWS;
    const unsigned char* wrow = w + (size_t)min(row0 + lane % 16, n - 1) * row_bytes;
    int* stage = shared + slice * STAGE_WORDS;
    float acc[TILES][4];
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;

    for (unsigned int g0 = begin + slice * STEP; g0 < end; g0 += K_SLICES * STEP) {
#pragma unroll
        for (int h = 0; h < STEP / 2; ++h) {
            const unsigned int j = 2 * h + lane / 16, group = g0 + j;
            const unsigned int live = min(group, all_groups - 1);
            Group u;
            decode<F>(wrow + (size_t)(live / GROUPS_PER_BLOCK) * BLOCK_BYTES,
                      live % GROUPS_PER_BLOCK, u);
            int4* s = reinterpret_cast<int4*>(stage + (j * 16 + lane % 16) * STRIDE);
            s[0] = make_int4(u.q[0], u.q[1], u.q[2], u.q[3]);
            s[1] = make_int4(u.q[4], u.q[5], u.q[6], u.q[7]);
            const bool in = group < end;  // a group past the split adds nothing
            s[2] = make_int4(__float_as_int(in ? u.dw[0] : 0.0f),
                             __float_as_int(in ? u.dw[1] : 0.0f),
                             __float_as_int(in ? u.mw : 0.0f), 0);
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < STEP; ++j) {
            const unsigned int group = min(g0 + j, all_groups - 1);
            const int* lo = stage + (j * 16 + gid) * STRIDE;  // weight row gid of the tile
            const int* hi = lo + 8 * STRIDE;                   // and row gid + 8
            const unsigned int a[4] = {(unsigned int)lo[tig], (unsigned int)hi[tig],
                                       (unsigned int)lo[4 + tig], (unsigned int)hi[4 + tig]};
            const float dw_lo[2] = {__int_as_float(lo[8]), __int_as_float(lo[9])};
            const float dw_hi[2] = {__int_as_float(hi[8]), __int_as_float(hi[9])};
            const float mw_lo = __int_as_float(lo[10]), mw_hi = __int_as_float(hi[10]);
#pragma unroll
            for (int t = 0; t < TILES; ++t) {
                // B: activation row t * 8 + gid's words tig and 4 + tig of the group; the
                // C columns t * 8 + 2 tig and + 1 take their (d, d * sum) pairs.
                const unsigned int col = t * 8 + gid, c0 = t * 8 + 2 * tig;
                if (t * 8 >= (int)m) break;
                unsigned int b0 = 0, b1 = 0;
                if (col < m) {
                    const int* x = xq + ((size_t)col * all_groups + group) * 8;
                    b0 = (unsigned int)__ldg(x + tig);
                    b1 = (unsigned int)__ldg(x + 4 + tig);
                }
                const float2 s0 = c0 < m ? __ldg(xds + (size_t)c0 * all_groups + group)
                                         : make_float2(0.0f, 0.0f);
                const float2 s1 = c0 + 1 < m ? __ldg(xds + (size_t)(c0 + 1) * all_groups + group)
                                             : make_float2(0.0f, 0.0f);
                // C element e: weight row gid (e < 2) or gid + 8, column c0 + e % 2.
                float dots[4][2];
                if constexpr (Fmt<F>::SPLIT16) {
                    int d_a[4] = {0, 0, 0, 0}, d_b[4] = {0, 0, 0, 0};
                    mma_k16(d_a, a[0], a[1], b0);
                    mma_k16(d_b, a[2], a[3], b1);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        dots[e][0] = dot_float(d_a[e]);
                        dots[e][1] = dot_float(d_b[e]);
                    }
                } else {
                    int d[4] = {0, 0, 0, 0};
                    mma_k32(d, a, b0, b1);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        dots[e][0] = dot_float(d[e]);
                        dots[e][1] = 0.0f;
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float* dw = e < 2 ? dw_lo : dw_hi;
                    const float mw = e < 2 ? mw_lo : mw_hi;
                    const float2 s = e % 2 ? s1 : s0;
                    const float dot = Fmt<F>::SPLIT16 ? dw[0] * dots[e][0] + dw[1] * dots[e][1]
                                                      : dw[0] * dots[e][0];
                    acc[t][e] += s.x * dot + mw * s.y;
                }
            }
        }
        __syncwarp();
    }
    // The slices' sums: sums[slice][row][column], then summed in slice order.
    __syncthreads();
    float* sums = reinterpret_cast<float*>(shared);
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const unsigned int r = gid + (e < 2 ? 0 : 8), c = t * 8 + 2 * tig + e % 2;
            sums[(slice * ROWS + r) * M_TILE + c] = acc[t][e];
        }
    __syncthreads();
    // Element i of the tile: column i / ROWS, row i % ROWS (a column's rows are contiguous).
    constexpr int ELEMENTS = ROWS * M_TILE;
    float* mine = splits.partials + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * ELEMENTS;
    float v[ELEMENTS / (WARPS * 32)];
#pragma unroll
    for (int u = 0; u < ELEMENTS / (WARPS * 32); ++u) {
        const unsigned int i = threadIdx.x + u * WARPS * 32, c = i / ROWS, r = i % ROWS;
        v[u] = 0.0f;
#pragma unroll
        for (int s = 0; s < K_SLICES; ++s) v[u] += sums[(s * ROWS + r) * M_TILE + c];
        if (splits.count > 1) mine[i] = v[u];
    }
    if (splits.count > 1) {
        // The last CTA of the row tile adds the splits' sums in order.
        __shared__ unsigned int last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            last = atomicAdd(splits.tickets + blockIdx.x, 1u) == splits.count - 1;
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
#pragma unroll
        for (int u = 0; u < ELEMENTS / (WARPS * 32); ++u) {
            const unsigned int i = threadIdx.x + u * WARPS * 32;
            v[u] = 0.0f;
            for (unsigned int s = 0; s < splits.count; ++s)
                v[u] += __ldcg(splits.partials +
                               ((size_t)s * gridDim.x + blockIdx.x) * ELEMENTS + i);
        }
        if (threadIdx.x == 0) splits.tickets[blockIdx.x] = 0;
    }
#pragma unroll
    for (int u = 0; u < ELEMENTS / (WARPS * 32); ++u) {
        const unsigned int i = threadIdx.x + u * WARPS * 32, c = i / ROWS, r = i % ROWS;
        const unsigned int row = cta * ROWS + r;
        if (c >= m || row >= n) continue;
        TO* o = out + (size_t)c * ldo + row;
        const float previous = beta != 0.0f ? beta * to_f32(*o) : 0.0f;
        *o = from_f32<TO>(previous + v[u]);
    }
}
}  // namespace quant_mma_detail

extern "C" __global__ void __launch_bounds__(quant_mma_detail::WARPS * 32)
    gemm_quant_mma(const unsigned char* __restrict__ w, const int* __restrict__ xq,
                   const float2* __restrict__ xds, TO* __restrict__ out, unsigned int m,
                   unsigned int n, unsigned int k, unsigned int ldo, float beta,
                   float* __restrict__ partials, unsigned int* __restrict__ tickets,
                   unsigned int splits) {
    using namespace quant_mma_detail;
    __shared__ __align__(16) int shared[SHARED_WORDS];
    mma_rows<FORMAT>(w, xq, xds, out, m, n, k, ldo, beta, blockIdx.x, shared,
                     Splits{partials, tickets, splits});
}

#ifdef PAGODA_FORMAT_B
// Two stacked parts of two formats in one launch (a QKV of Q4_K q and k and a Q6_K v): the
// first ceil(n_a / ROWS) row tiles over part A into columns 0..n_a, the others over part B into
// columns n_a..n_a + n_b, each part split as its own launch would be (gridDim.y the larger):
// the same bits as two gemm_quant_mma launches.
extern "C" __global__ void __launch_bounds__(quant_mma_detail::WARPS * 32)
    gemm_quant_mma_pair(const unsigned char* __restrict__ w_a,
                        const unsigned char* __restrict__ w_b, const int* __restrict__ xq,
                        const float2* __restrict__ xds, TO* __restrict__ out, unsigned int m,
                        unsigned int n_a, unsigned int n_b, unsigned int k, unsigned int ldo,
                        float beta, float* __restrict__ partials,
                        unsigned int* __restrict__ tickets, unsigned int splits_a,
                        unsigned int splits_b) {
    using namespace quant_mma_detail;
    static_assert(PAGODA_FORMAT_B >= Q4_0 && PAGODA_FORMAT_B <= Q6_K, "FORMAT_B: 0-7");
    __shared__ __align__(16) int shared[SHARED_WORDS];
    const unsigned int ctas_a = (n_a + ROWS - 1) / ROWS;
    if (blockIdx.x < ctas_a) {
        mma_rows<FORMAT>(w_a, xq, xds, out, m, n_a, k, ldo, beta, blockIdx.x, shared,
                         Splits{partials, tickets, splits_a});
    } else {
        mma_rows<PAGODA_FORMAT_B>(w_b, xq, xds, out + n_a, m, n_b, k, ldo, beta,
                                  blockIdx.x - ctas_a, shared, Splits{partials, tickets, splits_b});
    }
}
#endif
