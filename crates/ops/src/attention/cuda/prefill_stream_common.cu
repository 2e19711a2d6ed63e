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
}  // namespace stream_prefill
