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
// A CTA of WARPS warps owns ROWS (64) weight rows, 16 a warp, and the groups of its split of k
// (the launcher splits the groups of a matrix of few row tiles so that the grid fills the GPU;
// CTA (x, y) takes split y). The warps walk the split's groups together, STEP at a time: the
// CTA stages the activations of those groups (all m rows: bytes and scale pairs) in shared
// memory once for its 64 weight rows (read from L2 once per 64 rows, not per 16: at 64 rows
// the activations outweighed the weights' bytes), and each warp decodes its 16 rows' groups
// (lane l: row l % 16, groups l / 16 and 2 + l / 16; quant_decode.cu's `decode_raw`) into its
// own staging, from where it reads its A fragments (a row's 12 words apart: the eight rows a
// fragment load touches fall in distinct banks; the activations likewise). Each iteration
// issues the next one's global loads (weights by `load_raw`, activations into registers)
// before its mmas, so their latency hides behind the math. A warp's sums are its rows' own
// (no reduction across warps); with splits, each CTA writes its sums to `partials` and the
// last CTA of a row tile to finish (a ticket counter, reset by that CTA for the next launch)
// adds the splits' sums in split order: a row's bits depend on neither the other rows, the
// arrival order nor the run.
// Requirements (checked by the launcher): k a multiple of the format's block, m <= M_TILE.
// Specialisation: PAGODA_FORMAT (0-7), PAGODA_M_TILE (8, 16, 32 or 64), PAGODA_T_OUT;
// `gemm_quant_mma_pair` also PAGODA_FORMAT_B, the format of its second part.
typedef PAGODA_T_OUT TO;

namespace quant_mma_detail {
using namespace gemv_quant_detail;
constexpr int FORMAT = PAGODA_FORMAT;
constexpr int M_TILE = PAGODA_M_TILE;
constexpr int TILES = M_TILE / 8;  // the mma's 8-row N tiles of activations
constexpr int WARPS = 4;           // warps of a CTA, 16 weight rows each
constexpr int THREADS = WARPS * 32;
constexpr int ROWS = 16 * WARPS;   // weight rows a CTA owns (the launcher's CTA_ROWS)
constexpr int STEP = 4;            // groups per iteration (a lane decodes two)
constexpr int STRIDE = 12;  // words a staged row of a group: 8 of bytes, 2 of scales, 2 of pad
constexpr int STAGE_WORDS = STEP * 16 * STRIDE;     // a warp's weights
constexpr int ACT_WORDS = STEP * M_TILE * STRIDE;   // the CTA's activations
constexpr int SHARED_WORDS = WARPS * STAGE_WORDS + ACT_WORDS;
// Activation loads of an iteration, per thread: 16-byte pieces (two a row's group) and scale
// pairs (one a row's group).
constexpr int PIECES = (M_TILE * STEP * 2 + THREADS - 1) / THREADS;
constexpr int PAIRS = (M_TILE * STEP + THREADS - 1) / THREADS;
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

// Split-k bookkeeping: the splits' sums ([split][row tile][M_TILE][ROWS] floats) and a ticket
// per row tile (zero between launches).
struct Splits {
    float* partials;
    unsigned int* tickets;
    unsigned int count;  // this part's splits (gridDim.y or fewer: the CTAs past it leave)
};

// The activations of one iteration in registers, between their loads and their staging.
struct Acts {
    uint4 piece[PIECES];
    float2 pair[PAIRS];
};

// Loads the activations of groups g0 .. g0 + STEP - 1 (clamped to the matrix; rows past m
// read as zeros): piece u is row u / (2 STEP), group (u / 2) % STEP, half u % 2.
PAGODA_DEVICE void load_acts(const int* __restrict__ xq, const float2* __restrict__ xds,
                             unsigned int m, unsigned int all_groups, unsigned int g0, Acts& a) {
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
        const unsigned int u = threadIdx.x + i * THREADS, row = u / (2 * STEP);
        const unsigned int group = min(g0 + (u / 2) % STEP, all_groups - 1);
        a.piece[i] = row < m ? __ldg(reinterpret_cast<const uint4*>(
                                   xq + ((size_t)row * all_groups + group) * 8) + u % 2)
                             : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
        const unsigned int u = threadIdx.x + i * THREADS, row = u / STEP;
        const unsigned int group = min(g0 + u % STEP, all_groups - 1);
        a.pair[i] = row < m ? __ldg(xds + (size_t)row * all_groups + group)
                            : make_float2(0.0f, 0.0f);
    }
}

// Stages them: act[(group * M_TILE + row) * STRIDE ..]: 8 words of bytes, then (d, d * sum).
PAGODA_DEVICE void stage_acts(const Acts& a, int* act) {
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
        const unsigned int u = threadIdx.x + i * THREADS;
        if (u >= (unsigned int)(M_TILE * STEP * 2)) break;
        const unsigned int row = u / (2 * STEP), j = (u / 2) % STEP;
        reinterpret_cast<uint4*>(act + (j * M_TILE + row) * STRIDE)[u % 2] = a.piece[i];
    }
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
        const unsigned int u = threadIdx.x + i * THREADS;
        if (u >= (unsigned int)(M_TILE * STEP)) break;
        const unsigned int row = u / STEP, j = u % STEP;
        *reinterpret_cast<float2*>(act + (j * M_TILE + row) * STRIDE + 8) = a.pair[i];
    }
}

// The CTA `cta` of the product with the n rows of format F at `w` into out (m rows of ldo).
template <int F>
PAGODA_DEVICE void mma_rows(const unsigned char* __restrict__ w, const int* __restrict__ xq,
                            const float2* __restrict__ xds, TO* __restrict__ out, unsigned int m,
                            unsigned int n, unsigned int k, unsigned int ldo, float beta,
                            unsigned int cta, int* shared, Splits splits) {
    constexpr int GROUPS_PER_BLOCK = Fmt<F>::GROUPS_PER_BLOCK, BLOCK_BYTES = Fmt<F>::BLOCK_BYTES;
    if (blockIdx.y >= splits.count) return;
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned int gid = lane / 4, tig = lane % 4;
    const unsigned int all_groups = k / 32;
    // This CTA's split of the groups: [begin, end).
    const unsigned int per_split = (all_groups + splits.count - 1) / splits.count;
    const unsigned int begin = min(blockIdx.y * per_split, all_groups);
    const unsigned int end = min(begin + per_split, all_groups);
    const size_t row_bytes = (size_t)(k / Fmt<F>::BLOCK_VALUES) * BLOCK_BYTES;
    // The warp's 16 rows; the row this lane decodes (rows past n decode the last one; their
    // sums are not stored).
    const unsigned int row0 = cta * ROWS + warp * 16;
    const unsigned char* wrow = w + (size_t)min(row0 + lane % 16, n - 1) * row_bytes;
    int* stage = shared + warp * STAGE_WORDS;
    int* act = shared + WARPS * STAGE_WORDS;
    float acc[TILES][4];
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;

    // Lane l's groups of an iteration at g0: 2h + l / 16 (h < STEP / 2), clamped to the matrix
    // (a group past the split adds nothing: its scales are staged as zeros).
    Raw<F> raw[STEP / 2];
    Acts acts;
    const auto load = [&](unsigned int g0) {
#pragma unroll
        for (int h = 0; h < STEP / 2; ++h) {
            const unsigned int live = min(g0 + 2 * h + lane / 16, all_groups - 1);
            load_raw<F>(wrow + (size_t)(live / GROUPS_PER_BLOCK) * BLOCK_BYTES,
                        live % GROUPS_PER_BLOCK, raw[h]);
        }
        load_acts(xq, xds, m, all_groups, g0, acts);
    };
    if (begin < end) load(begin);
    for (unsigned int g0 = begin; g0 < end; g0 += STEP) {
        stage_acts(acts, act);
#pragma unroll
        for (int h = 0; h < STEP / 2; ++h) {
            const unsigned int j = 2 * h + lane / 16, group = g0 + j;
            const unsigned int live = min(group, all_groups - 1);
            Group u;
            decode_raw<F>(raw[h], live % GROUPS_PER_BLOCK, u);
            int4* s = reinterpret_cast<int4*>(stage + (j * 16 + lane % 16) * STRIDE);
            s[0] = make_int4(u.q[0], u.q[1], u.q[2], u.q[3]);
            s[1] = make_int4(u.q[4], u.q[5], u.q[6], u.q[7]);
            const bool in = group < end;
            s[2] = make_int4(__float_as_int(in ? u.dw[0] : 0.0f),
                             __float_as_int(in ? u.dw[1] : 0.0f),
                             __float_as_int(in ? u.mw : 0.0f), 0);
        }
        __syncthreads();
        if (g0 + STEP < end) load(g0 + STEP);
#pragma unroll
        for (int j = 0; j < STEP; ++j) {
            const int* lo = stage + (j * 16 + gid) * STRIDE;  // weight row gid of the warp
            const int* hi = lo + 8 * STRIDE;                   // and row gid + 8
            const unsigned int a[4] = {(unsigned int)lo[tig], (unsigned int)hi[tig],
                                       (unsigned int)lo[4 + tig], (unsigned int)hi[4 + tig]};
            const float dw_lo[2] = {__int_as_float(lo[8]), __int_as_float(lo[9])};
            const float dw_hi[2] = {__int_as_float(hi[8]), __int_as_float(hi[9])};
            const float mw_lo = __int_as_float(lo[10]), mw_hi = __int_as_float(hi[10]);
            const int* xj = act + j * M_TILE * STRIDE;
#pragma unroll
            for (int t = 0; t < TILES; ++t) {
                if (t * 8 >= (int)m) break;
                // B: activation row t * 8 + gid's words tig and 4 + tig of the group; the C
                // columns t * 8 + 2 tig and + 1 take their (d, d * sum) pairs (zeros past m).
                const int* x = xj + (t * 8 + gid) * STRIDE;
                const unsigned int b0 = (unsigned int)x[tig], b1 = (unsigned int)x[4 + tig];
                const float2 s0 = *reinterpret_cast<const float2*>(
                    xj + (t * 8 + 2 * tig) * STRIDE + 8);
                const float2 s1 = *reinterpret_cast<const float2*>(
                    xj + (t * 8 + 2 * tig + 1) * STRIDE + 8);
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
        __syncthreads();
    }
    // Element (column c, row r) of the tile at c * ROWS + r: a lane's own sums, written and
    // (by the last CTA) read back at the same places.
    constexpr int ELEMENTS = ROWS * M_TILE;
    if (splits.count > 1) {
        float* mine = splits.partials + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * ELEMENTS;
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int r = warp * 16 + gid + (e < 2 ? 0 : 8), c = t * 8 + 2 * tig + e % 2;
                mine[c * ROWS + r] = acc[t][e];
            }
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
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int r = warp * 16 + gid + (e < 2 ? 0 : 8), c = t * 8 + 2 * tig + e % 2;
                float v = 0.0f;
                for (unsigned int s = 0; s < splits.count; ++s)
                    v += __ldcg(splits.partials + ((size_t)s * gridDim.x + blockIdx.x) * ELEMENTS +
                                c * ROWS + r);
                acc[t][e] = v;
            }
        if (threadIdx.x == 0) splits.tickets[blockIdx.x] = 0;
    }
#pragma unroll
    for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const unsigned int row = row0 + gid + (e < 2 ? 0 : 8), c = t * 8 + 2 * tig + e % 2;
            if (c >= m || row >= n) continue;
            TO* o = out + (size_t)c * ldo + row;
            const float previous = beta != 0.0f ? beta * to_f32(*o) : 0.0f;
            *o = from_f32<TO>(previous + acc[t][e]);
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
