// Small-batch linear layer over GGUF-quantized weights, read in their block format:
// out[i, j] = beta * out[i, j] + sum_k x[i, k] * w[j, k] for m <= M_TILE activation rows.
//
// The activations come quantized to 8 bits per 32-value block (`quantize_q8_rows`: q, the
// block's scale d and d * sum(q), as ggml's q8_1), so every product is an integer dot of four
// bytes (dp4a) and each weight group's scale and offset apply once per 32 values:
//   sum_k x w = sum_groups dx * dw * sum(qx * qw) + mw * (dx * sum(qx)),
// where a group's weights are dw * qw + mw (Q4_0: dw = d, mw = -8d; Q4_1: mw = m; K-quants: a
// sub-block's d * scale and -dmin * min). Q6_K's scales change every 16 values: its two
// halves are scaled apart and its values are centred (mw = 0).
//
// A CTA of WARPS warps owns ROWS weight rows; its threads stride over the rows' 32-value groups
// (thread t decodes groups t, t + 32 * WARPS, ...), so a warp reads consecutive bytes and
// every row is spread over the whole CTA: many small CTAs keep the memory busy whatever the
// matrix's shape. Partial sums meet in shared memory. Weights are read through L1 (a K-quant
// group's neighbours share its header and bytes); the quantized activations come from cache.
// Requirements (checked by the launcher): k a multiple of the format's block, m <= M_TILE.
// Specialisation: PAGODA_FORMAT (0-7, below), PAGODA_M_TILE (1, 2, 4 or 8), PAGODA_T_OUT;
// `gemv_quant_pair` also PAGODA_FORMAT_B, the format of its second part.
typedef PAGODA_T_OUT TO;

namespace gemv_quant_detail {
constexpr int FORMAT = PAGODA_FORMAT;
constexpr int M_TILE = PAGODA_M_TILE;
// Weight rows per CTA (the launcher's cta_shape): one for a single activation row (more rows
// raise the registers past 4 CTAs an SM, measured slower on the H200), two otherwise.
constexpr int ROWS = M_TILE == 1 ? 1 : 2;
constexpr int WARPS = 4;                    // warps per CTA
// The format's block geometry (quant_decode.cu's Fmt, a template so that one kernel can hold
// two formats).
constexpr bool K_QUANT = Fmt<FORMAT>::K_QUANT;
constexpr int BLOCK_VALUES = Fmt<FORMAT>::BLOCK_VALUES;
constexpr int BLOCK_BYTES = Fmt<FORMAT>::BLOCK_BYTES;
constexpr int GROUPS_PER_BLOCK = Fmt<FORMAT>::GROUPS_PER_BLOCK;
constexpr bool SPLIT16 = Fmt<FORMAT>::SPLIT16;
static_assert(M_TILE == 1 || M_TILE == 2 || M_TILE == 4 || M_TILE == 8, "M_TILE: 1, 2, 4 or 8");
static_assert(FORMAT >= Q4_0 && FORMAT <= Q6_K, "FORMAT: 0-7");

// The CTA `cta` of the product with the n rows of format F at `w` (the kernels below).
template <int F>
PAGODA_DEVICE void gemv_rows(const unsigned char* __restrict__ w, const int* __restrict__ xq,
                             const float2* __restrict__ xds, TO* __restrict__ out, unsigned int m,
                             unsigned int n, unsigned int k, unsigned int ldo, float beta,
                             unsigned int cta) {
    constexpr int THREADS = WARPS * 32;
    constexpr int GROUPS_PER_BLOCK = Fmt<F>::GROUPS_PER_BLOCK, BLOCK_BYTES = Fmt<F>::BLOCK_BYTES;
    const unsigned int row0 = cta * ROWS;
    const unsigned int groups = k / 32;
    const size_t row_bytes = (size_t)(k / Fmt<F>::BLOCK_VALUES) * BLOCK_BYTES;
    const unsigned char* rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) rows[r] = w + (size_t)min(row0 + r, n - 1) * row_bytes;
    float acc[M_TILE][ROWS];
#pragma unroll
    for (int i = 0; i < M_TILE; ++i)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[i][r] = 0.0f;

    for (unsigned int group = threadIdx.x; group < groups; group += THREADS) {
        const unsigned int block = group / GROUPS_PER_BLOCK, g = group % GROUPS_PER_BLOCK;
        Group u[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) decode<F>(rows[r] + (size_t)block * BLOCK_BYTES, g, u[r]);
#pragma unroll
        for (int i = 0; i < M_TILE; ++i) {
            if (i >= (int)m) break;
            const int4* xp = reinterpret_cast<const int4*>(xq + ((size_t)i * groups + group) * 8);
            const int4 a = __ldg(xp), c = __ldg(xp + 1);
            const float2 ds = __ldg(xds + (size_t)i * groups + group);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[i][r] += group_dot<F>(u[r], a, c, ds);
        }
    }
    // Warp sums, then the warps' partials in shared memory.
    __shared__ float partial[WARPS][M_TILE][ROWS];
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < M_TILE; ++i)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[i][r]);
            if (lane == 0) partial[warp][i][r] = v;
        }
    __syncthreads();
    if (threadIdx.x >= (unsigned int)(M_TILE * ROWS)) return;
    const unsigned int i = threadIdx.x / ROWS, r = threadIdx.x % ROWS, row = row0 + r;
    if (i >= m || row >= n) return;
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < WARPS; ++wi) v += partial[wi][i][r];
    TO* o = out + (size_t)i * ldo + row;
    const float previous = beta != 0.0f ? beta * to_f32(*o) : 0.0f;
    *o = from_f32<TO>(previous + v);
}
}  // namespace gemv_quant_detail

extern "C" __global__ void __launch_bounds__(gemv_quant_detail::WARPS * 32)
    gemv_quant(const unsigned char* __restrict__ w, const int* __restrict__ xq,
               const float2* __restrict__ xds, TO* __restrict__ out, unsigned int m,
               unsigned int n, unsigned int k, unsigned int ldo, float beta) {
    using namespace gemv_quant_detail;
    gemv_rows<FORMAT>(w, xq, xds, out, m, n, k, ldo, beta, blockIdx.x);
}

#ifdef PAGODA_FORMAT_B
// Two stacked parts of two formats in one launch (a QKV of Q4_K q and k and a Q6_K v): the
// first ceil(n_a / ROWS) CTAs are gemv_quant's over part A's n_a rows into columns 0..n_a,
// the others over part B's n_b rows into columns n_a..n_a + n_b. The same arithmetic as two
// gemv_quant launches, so the same bits.
extern "C" __global__ void __launch_bounds__(gemv_quant_detail::WARPS * 32)
    gemv_quant_pair(const unsigned char* __restrict__ w_a, const unsigned char* __restrict__ w_b,
                    const int* __restrict__ xq, const float2* __restrict__ xds,
                    TO* __restrict__ out, unsigned int m, unsigned int n_a, unsigned int n_b,
                    unsigned int k, unsigned int ldo, float beta) {
    using namespace gemv_quant_detail;
    static_assert(PAGODA_FORMAT_B >= Q4_0 && PAGODA_FORMAT_B <= Q6_K, "FORMAT_B: 0-7");
    const unsigned int ctas_a = (n_a + ROWS - 1) / ROWS;
    if (blockIdx.x < ctas_a) {
        gemv_rows<FORMAT>(w_a, xq, xds, out, m, n_a, k, ldo, beta, blockIdx.x);
    } else {
        gemv_rows<PAGODA_FORMAT_B>(w_b, xq, xds, out + n_a, m, n_b, k, ldo, beta,
                                   blockIdx.x - ctas_a);
    }
}
#endif

// The dense copy of a quantized matrix for the GEMM of a larger batch: `rows` rows of k
// values from their blocks into `out` [rows, k] (PAGODA_T_OUT), one thread per 32-value group
// through gemv_quant's decoder (values dw * q + mw, rounded once to the output type; the
// load-time `dequant_*` entries are the bit-exact ones).
extern "C" __global__ void dequant_groups(const unsigned char* __restrict__ w, TO* __restrict__ out,
                                          unsigned long long total_groups, unsigned int k) {
    using namespace gemv_quant_detail;
    const unsigned long long id = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    // A warp past the end leaves; a partial warp decodes its last group again (unused).
    if (id - threadIdx.x % 32 >= total_groups) return;
    const unsigned long long group_id = min(id, total_groups - 1);
    const unsigned int groups = k / 32;
    const unsigned long long row = group_id / groups;
    const unsigned int group = (unsigned int)(group_id % groups);
    const unsigned int block = group / GROUPS_PER_BLOCK, g = group % GROUPS_PER_BLOCK;
    Group u;
    decode<FORMAT>(w + row * ((size_t)(k / BLOCK_VALUES) * BLOCK_BYTES) + (size_t)block * BLOCK_BYTES, g, u);
    // Through shared memory, so that each store of the warp writes 512 contiguous bytes (a
    // warp's groups are consecutive: its output is one run of 32 * 32 values).
    constexpr int PIECES = 32 * sizeof(TO) / 16;  // 16-byte pieces of one group's values
    __shared__ uint4 staged[256 / 32][32 * PIECES + 1];
    TO values[32];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            // The byte as a float without I2F (a quarter-rate instruction): 1.5 * 2^23 + x.
            const int x = (int)(signed char)((u.q[i] >> (8 * j)) & 0xff);
            const float q = __int_as_float(0x4B400000 + x) - 12582912.0f;
            values[4 * i + j] = from_f32<TO>(fmaf(u.dw[i / 4], q, u.mw));
        }
    const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint4* v = reinterpret_cast<const uint4*>(values);
#pragma unroll
    for (int p = 0; p < PIECES; ++p) staged[warp][lane * PIECES + p] = v[p];
    __syncwarp();
    const unsigned long long first = id - lane;  // the warp's first group
    const unsigned long long live = min(32ull, total_groups - first);
    uint4* o = reinterpret_cast<uint4*>(out + first * 32);
    for (unsigned int p = lane; p < live * PIECES; p += 32) o[p] = staged[warp][p];
}

// The activations of gemv_quant: rows of x [m, k] (k a multiple of 32) quantized per 32-value
// block as ggml's q8_1 and the CPU's Q8Rows (`q8_quantize_block`, q8_block.cu).
// One warp a block, one value a lane. Specialisation: PAGODA_T_IN (float or __nv_bfloat16).
extern "C" __global__ void quantize_q8_rows(const PAGODA_T_IN* __restrict__ x,
                                            signed char* __restrict__ xq,
                                            float2* __restrict__ xds, unsigned int blocks) {
    const unsigned int block = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (block >= blocks) return;
    const size_t index = (size_t)block * 32 + threadIdx.x % 32;
    q8_quantize_block(to_f32(x[index]), xq, xds, index);
}
