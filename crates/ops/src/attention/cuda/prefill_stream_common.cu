// The streaming prefill's geometry and helpers (prepended to prefill_stream.cu; after
// tensor_core.cu and kv_fp8.cu): the specialisation's tile constants and shared-memory
// layout, the swizzle, and the fp8 cache's widening of a staged tile and its P packing.
typedef PAGODA_T T;
static_assert(sizeof(T) == 2, "prefill_attention_stream is bf16 only");
// The pools' element: T, or e4m3 bytes with PAGODA_KV_FP8 (kv_fp8.cu).
#if PAGODA_KV_FP8
typedef unsigned char KV_T;
#else
typedef T KV_T;
#endif

namespace stream_prefill {
constexpr int HEAD_DIM = PAGODA_HEAD_DIM;
constexpr int BLOCK_KEYS = PAGODA_BLOCK_KEYS;
constexpr int ROW_TILES = PAGODA_ROW_TILES;  // 16-row MMA tiles per warp
constexpr int STAGES = PAGODA_STAGES;
constexpr int WARPS = 4;
constexpr int BLOCK_ROWS = WARPS * 16 * ROW_TILES;
constexpr int THREADS = WARPS * 32;
constexpr int ROW_BYTES = HEAD_DIM * 2;   // a bf16 row (Q, and K/V as the MMAs read them)
constexpr int ROW_CHUNKS = HEAD_DIM / 8;  // 16-byte pieces of a row
constexpr int TILE_BYTES = BLOCK_KEYS * ROW_BYTES;
constexpr int Q_BYTES = BLOCK_ROWS * ROW_BYTES;
constexpr int Q_PIECES_PER_THREAD = BLOCK_ROWS * ROW_CHUNKS / THREADS;
constexpr int KEY_STEP = THREADS / ROW_CHUNKS;
// K/V as the ring stages them: pool rows of KV_T (bf16, or e4m3 bytes).
constexpr int KV_ROW_BYTES = HEAD_DIM * (int)sizeof(KV_T);
constexpr int KV_CHUNKS = KV_ROW_BYTES / 16;  // 16-byte pieces of a staged row
constexpr int KV_TILE_BYTES = BLOCK_KEYS * KV_ROW_BYTES;
constexpr int KEYS_PER_THREAD = BLOCK_KEYS * KV_CHUNKS / THREADS;  // pieces a thread copies a tile
constexpr int KV_KEY_STEP = THREADS / KV_CHUNKS;
constexpr int N_BLOCKS = BLOCK_KEYS / 8;  // 8-key column blocks of S
constexpr int D_BLOCKS = HEAD_DIM / 8;    // 8-wide column blocks of O
constexpr int KEY_LIMIT = 0x7fffffff;    // key positions are clamped to int
constexpr float RESCALE_SLACK = 8.0f;    // log2 of the largest unnormalised p
// Q tile, STAGES K tiles, STAGES V tiles, (fp8: the widened bf16 K and V tiles and the
// ring's K and V scales,) STAGES key flags.
constexpr int WIDE_BYTES = PAGODA_KV_FP8 ? 2 * TILE_BYTES : 0;
constexpr int SCALE_BYTES = PAGODA_KV_FP8 ? 2 * STAGES * BLOCK_KEYS * 4 : 0;
constexpr int SHARED_BYTES = Q_BYTES + 2 * STAGES * KV_TILE_BYTES + WIDE_BYTES + SCALE_BYTES + STAGES * BLOCK_KEYS;

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM: 64 or 128");
static_assert(BLOCK_KEYS == 32 || BLOCK_KEYS == 64, "BLOCK_KEYS: 32 or 64");
static_assert(ROW_TILES == 1 || ROW_TILES == 2, "ROW_TILES: 1 or 2");
static_assert(STAGES == 2 || STAGES == 3, "STAGES: 2 or 3");
static_assert(THREADS % KV_CHUNKS == 0 && KV_KEY_STEP * KEYS_PER_THREAD == BLOCK_KEYS, "tile copy layout");

PAGODA_DEVICE unsigned int piece_offset(unsigned int row, unsigned int piece) {
    return row * ROW_BYTES + ((piece ^ (row & 7)) << 4);
}
// Where the ring holds piece `piece` of staged key row `row`: swizzled bf16, or (fp8) plain
// byte rows (a tile is widened by rows of contiguous bytes, conflict-free).
PAGODA_DEVICE unsigned int kv_offset(unsigned int row, unsigned int piece) {
    return PAGODA_KV_FP8 ? row * KV_ROW_BYTES + (piece << 4) : piece_offset(row, piece);
}
// fp8: every thread widens its share of a staged e4m3 tile (`src`, plain rows) into the bf16
// tile `dst` (swizzled as piece_offset): eight bytes in, one 16-byte piece out.
PAGODA_DEVICE void widen_tile(const unsigned char* src, unsigned char* dst) {
    constexpr int PIECES = BLOCK_KEYS * HEAD_DIM / 8;
    static_assert(PIECES % THREADS == 0, "whole passes of the block");
#pragma unroll
    for (int i = threadIdx.x; i < PIECES; i += THREADS) {
        const unsigned int key = i / (HEAD_DIM / 8), piece = i % (HEAD_DIM / 8);
        const uint2 bytes = *reinterpret_cast<const uint2*>(src + key * KV_ROW_BYTES + piece * 8);
        *reinterpret_cast<uint4*>(dst + piece_offset(key, piece)) = fp8x8_to_bf16x8(bytes);
    }
}
// P's A fragment of key block kk (P = S's accumulators, keys 16 kk + quad_col + {0, 1} and
// + 8), each key's column times its V scale when `v_scale` is given (fp8).
PAGODA_DEVICE void pack_p(unsigned int (&pa)[4], const float (&s0)[4], const float (&s1)[4],
                          const float* v_scale) {
    const float a = v_scale ? v_scale[0] : 1.0f, b = v_scale ? v_scale[1] : 1.0f;
    const float c = v_scale ? v_scale[8] : 1.0f, d = v_scale ? v_scale[9] : 1.0f;
    pa[0] = pack_bf16(s0[0] * a, s0[1] * b);
    pa[1] = pack_bf16(s0[2] * a, s0[3] * b);
    pa[2] = pack_bf16(s1[0] * c, s1[1] * d);
    pa[3] = pack_bf16(s1[2] * c, s1[3] * d);
}
// d += a b (the A fragment's four registers).
PAGODA_DEVICE void mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    mma_bf16(d, a[0], a[1], a[2], a[3], b0, b1);
}
// With `mask`, masks the keys past `last` or unreadable (`ok`: the tile's key flags); then runs the online softmax over one accumulator row of a tile's scores (half h of a 16-row
// tile's fragments; a row's values live in the four lanes of a quad): s becomes p, m, l and
// the row's rescale factor move. m and the masking are in raw scores (scale_log2 > 0):
// p = 2^(s scale - m scale), one FFMA and one EX2 an element. Returns whether m moved.
PAGODA_DEVICE bool softmax_row(float (&s)[N_BLOCKS][4], int h, bool mask, int last, const unsigned char* ok,
                               int quad_col, float scale_log2, float& m, float& l, float& factor) {
    if (mask) {
#pragma unroll
        for (int j = 0; j < N_BLOCKS; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = 8 * j + quad_col + e;
                float& v = s[j][2 * h + e];
                v = key <= last && ok[key] ? v : -INFINITY;
            }
        }
    }
    // Tree reductions (short dependency chains).
    float partial[N_BLOCKS];
#pragma unroll
    for (int j = 0; j < N_BLOCKS; ++j) partial[j] = fmaxf(s[j][2 * h], s[j][2 * h + 1]);
#pragma unroll
    for (int w = N_BLOCKS / 2; w >= 1; w /= 2)
#pragma unroll
        for (int j = 0; j < w; ++j) partial[j] = fmaxf(partial[j], partial[j + w]);
    float tile_max = partial[0];
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    // The running maximum moves only when the tile's exceeds it by more than 2^RESCALE_SLACK
    // (then O and l are rescaled); otherwise p may reach 2^RESCALE_SLACK, harmless in f32 sums
    // and bf16 P, and O keeps its scale.
    const bool grow = tile_max * scale_log2 > m * scale_log2 + RESCALE_SLACK;
    const float new_max = grow ? tile_max : m;
    const float base = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
    factor = grow ? fast_exp2(m * scale_log2 - base) : 1.0f;
#pragma unroll
    for (int j = 0; j < N_BLOCKS; ++j) {
        s[j][2 * h] = fast_exp2(fmaf(s[j][2 * h], scale_log2, -base));
        s[j][2 * h + 1] = fast_exp2(fmaf(s[j][2 * h + 1], scale_log2, -base));
        partial[j] = s[j][2 * h] + s[j][2 * h + 1];
    }
#pragma unroll
    for (int w = N_BLOCKS / 2; w >= 1; w /= 2)
#pragma unroll
        for (int j = 0; j < w; ++j) partial[j] += partial[j + w];
    l = l * factor + partial[0];
    m = new_max;
    return grow;
}
// Stores this lane's two columns of every 8-wide block of one accumulator row (half h of a
// 16-row tile's fragments) times `inverse`, as bf16 pairs from `d` on (NaN where `bad`).
PAGODA_DEVICE void store_bf16_row(const float (&o)[D_BLOCKS][4], int h, float inverse, bool bad, T* d) {
#pragma unroll
    for (int n = 0; n < D_BLOCKS; ++n, d += 8) {
        const float x = bad ? quiet_nan() : o[n][2 * h] * inverse;
        const float y = bad ? quiet_nan() : o[n][2 * h + 1] * inverse;
        if ((reinterpret_cast<size_t>(d) & 3) == 0) {
            *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(x, y);
        } else {
            d[0] = __float2bfloat16_rn(x);
            d[1] = __float2bfloat16_rn(y);
        }
    }
}
// The same row as f32 pairs (cascade's partials: 8-byte aligned, the column is even).
PAGODA_DEVICE void store_partial_row(const float (&o)[D_BLOCKS][4], int h, float inverse, float* d) {
#pragma unroll
    for (int n = 0; n < D_BLOCKS; ++n)
        *reinterpret_cast<float2*>(d + 8 * n) = make_float2(o[n][2 * h] * inverse, o[n][2 * h + 1] * inverse);
}
}  // namespace stream_prefill
