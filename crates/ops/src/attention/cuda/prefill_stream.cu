// Query-tiled causal prefill attention over the paged KV cache on tensor cores, streaming
// (FlashAttention-2 style with raw MMA; bf16 operands, f32 accumulators, base-2 softmax).
//
// Same contract, grid and slot mapping as prefill_attention_mma (prefill_mma.cu): one CTA of
// four warps per (query tile of ONE request, KV head); the tile's 64 rows are
// token_in_tile * group + head_in_group, warp w owning rows 16w .. 16w + 15. Unlike the WMMA
// kernel, only K and V go through shared memory:
//   - each lane loads its rows' Q A-fragments from global memory once;
//   - S = Q K^T and O += P V are mma.sync.m16n8k16 with ldmatrix (V transposed); the online
//     softmax runs on the S accumulators in registers (a row's values live in the four lanes
//     of a quad), whose layout is the A fragment P needs;
//   - K/V tiles of BLOCK_KEYS keys are double-buffered through cp.async (the next tile's
//     copies fly while this one is computed), unpadded and XOR-swizzled (piece c of key row
//     r at piece c ^ (r % 8)) so ldmatrix's eight rows hit eight bank groups.
// Key tiles above a warp's causal diagonal are skipped by that warp. Edge rules as in
// prefill.cu: a request with more queries than visible tokens writes NaN rows.
//
// Specialisation: PAGODA_T (__nv_bfloat16), PAGODA_HEAD_DIM (64 or 128), PAGODA_BLOCK_KEYS
// (32 or 64). Static shared memory within 48 KiB (asserted). Prepended: tensor_core.cu.
typedef PAGODA_T T;
static_assert(sizeof(T) == 2, "prefill_attention_stream is bf16 only");

namespace stream_prefill {
constexpr int HEAD_DIM = PAGODA_HEAD_DIM;
constexpr int BLOCK_KEYS = PAGODA_BLOCK_KEYS;
constexpr int BLOCK_ROWS = 64;
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int ROW_BYTES = HEAD_DIM * 2;
constexpr int ROW_CHUNKS = HEAD_DIM / 8;  // 16-byte pieces of a key row
constexpr int TILE_BYTES = BLOCK_KEYS * ROW_BYTES;
constexpr int PIECES_PER_THREAD = BLOCK_KEYS * ROW_CHUNKS / THREADS;
constexpr int KEY_STEP = THREADS / ROW_CHUNKS;
constexpr int N_BLOCKS = BLOCK_KEYS / 8;  // 8-key column blocks of S
constexpr int D_BLOCKS = HEAD_DIM / 8;    // 8-wide column blocks of O

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM: 64 or 128");
static_assert(BLOCK_KEYS == 32 || BLOCK_KEYS == 64, "BLOCK_KEYS: 32 or 64");
static_assert(THREADS % ROW_CHUNKS == 0 && BLOCK_KEYS % KEY_STEP == 0, "tile copy layout");
static_assert(4 * TILE_BYTES + 2 * BLOCK_KEYS <= 48 * 1024, "static shared memory above 48 KiB");

PAGODA_DEVICE unsigned int piece_offset(unsigned int row, unsigned int piece) {
    return row * ROW_BYTES + ((piece ^ (row & 7)) << 4);
}
// d += a b (the A fragment's four registers).
PAGODA_DEVICE void mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    mma_bf16(d, a[0], a[1], a[2], a[3], b0, b1);
}
// Two consecutive bf16 of q as one register (no alignment assumed).
PAGODA_DEVICE unsigned int load_pair(const T* p) {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
    return (unsigned int)s[0] | ((unsigned int)s[1] << 16);
}
}  // namespace stream_prefill

// Arguments and grid as prefill_attention_mma; block 128 threads.
extern "C" __global__ void __launch_bounds__(stream_prefill::THREADS) prefill_attention_stream(
    const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const unsigned int* __restrict__ qo_indptr, const unsigned int* __restrict__ kv_indptr,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, T* __restrict__ out,
    unsigned int num_requests, unsigned int num_tokens, unsigned int num_indices,
    unsigned int num_q_heads, unsigned int num_kv_heads, unsigned int page_size,
    unsigned int num_pages, unsigned int q_row_stride, unsigned int block_q, float scale_log2) {
    using namespace stream_prefill;
    __shared__ __align__(128) unsigned char tiles[4 * TILE_BYTES];  // K stage 0, 1, V stage 0, 1
    __shared__ unsigned char key_ok[2][BLOCK_KEYS];

    const unsigned int tid = threadIdx.x;
    const int warp = (int)(tid / 32);
    const int lane = (int)(tid % 32);
    const unsigned int kv_head = blockIdx.y;
    const unsigned int slot = blockIdx.x;
    const unsigned int group = num_q_heads / num_kv_heads;
    const size_t out_token_elems = (size_t)num_q_heads * HEAD_DIM;
    const size_t group_elems = (size_t)group * HEAD_DIM;

    prefill_zero_window(out, qo_indptr, num_requests, num_tokens, slot, block_q, kv_head,
                        group_elems, out_token_elems);
    unsigned int r;
    long long tile;
    if (!prefill_slot_tile(qo_indptr, num_requests, slot, block_q, r, tile)) return;
    const long long q_len = (long long)qo_indptr[r + 1] - (long long)qo_indptr[r];
    const long long q_first = tile * block_q;
    if (q_first >= q_len) return;
    const int tile_tokens = (int)min((long long)block_q, q_len - q_first);
    const long long token0 = (long long)qo_indptr[r] + q_first;
    const int active_rows = tile_tokens * (int)group;
    const long long seq_len = paged_visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size);
    const bool bad = q_len > seq_len;
    const long long causal_base = seq_len - q_len + q_first;  // row token i sees keys 0 ..= base + i
    const long long kv_end = bad ? 0 : causal_base + tile_tokens;
    const int num_tiles = (int)((kv_end + BLOCK_KEYS - 1) / BLOCK_KEYS);
    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;
    const unsigned long long page_base = kv_indptr[r];
    const long long first_offset = first_page_offset[r];
    const unsigned char* k_bytes = reinterpret_cast<const unsigned char*>(k_pool);
    const unsigned char* v_bytes = reinterpret_cast<const unsigned char*>(v_pool);

    // Thread tid copies piece `part` of keys first_key + i * KEY_STEP of every tile.
    const int part = (int)(tid % ROW_CHUNKS);
    const int first_key = (int)(tid / ROW_CHUNKS);
    auto issue = [&](int t) {
        const int stage = t & 1;
        unsigned char* k_dst = tiles + stage * TILE_BYTES;
        unsigned char* v_dst = tiles + (2 + stage) * TILE_BYTES;
#pragma unroll
        for (int i = 0; i < PIECES_PER_THREAD; ++i) {
            const int key_local = first_key + i * KEY_STEP;
            const long long key = (long long)t * BLOCK_KEYS + key_local;
            bool readable = false;
            size_t offset = 0;
            if (key < kv_end) {
                const long long logical = first_offset + key;
                const unsigned long long index = page_base + (unsigned long long)(logical / page_size);
                if (index < num_indices) {
                    const unsigned int page = kv_indices[index];
                    if (page < num_pages) {
                        const size_t row = (size_t)page * page_size + (size_t)(logical % page_size);
                        offset = (row * row_elems + (size_t)kv_head * HEAD_DIM) * 2 + part * 16;
                        readable = true;
                    }
                }
            }
            const unsigned int dst = piece_offset(key_local, part);
            cp_async16(k_dst + dst, k_bytes + offset, readable);
            cp_async16(v_dst + dst, v_bytes + offset, readable);
            if (part == 0) key_ok[stage][key_local] = readable;
        }
    };
    if (num_tiles > 0) issue(0);
    cp_async_commit();

    // This lane's rows: r0 = lane / 4 and r1 = r0 + 8 of the warp's 16; columns 2 (lane % 4).
    const int quad_col = 2 * (lane % 4);
    int row_of[2], token_of[2];
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_of[h] = warp * 16 + lane / 4 + 8 * h;
        token_of[h] = row_of[h] / (int)group;
        live[h] = row_of[h] < active_rows && token0 + token_of[h] < (long long)num_tokens && !bad;
    }
    unsigned int qa[HEAD_DIM / 16][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const T* q_row = q + (size_t)(token0 + token_of[h]) * q_row_stride +
                         (size_t)(kv_head * group + row_of[h] % group) * HEAD_DIM;
#pragma unroll
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
            qa[k][h] = live[h] ? load_pair(q_row + 16 * k + quad_col) : 0u;
            qa[k][2 + h] = live[h] ? load_pair(q_row + 16 * k + 8 + quad_col) : 0u;
        }
    }
    float o[D_BLOCKS][4];
#pragma unroll
    for (int n = 0; n < D_BLOCKS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const int warp_first_row = warp * 16;
    const bool warp_active = warp_first_row < active_rows && !bad;
    const long long warp_last_key =
        warp_active ? causal_base + min(warp_first_row + 15, active_rows - 1) / (int)group : -1;
    const unsigned int mat = lane / 8, mat_row = lane % 8;

    for (int t = 0; t < num_tiles; ++t) {
        if (t + 1 < num_tiles) issue(t + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int stage = t & 1;
        const long long start = (long long)t * BLOCK_KEYS;
        if (warp_active && start <= warp_last_key) {
            const unsigned int k_base = shared_address(tiles + stage * TILE_BYTES);
            const unsigned int v_base = shared_address(tiles + (2 + stage) * TILE_BYTES);
            // 1. S = Q K^T.
            float s[N_BLOCKS][4];
#pragma unroll
            for (int j = 0; j < N_BLOCKS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int k = 0; k < HEAD_DIM / 16; ++k) {
#pragma unroll
                for (int j = 0; j < N_BLOCKS; j += 2) {
                    unsigned int b[4];
                    const unsigned int key = 8 * j + (mat / 2) * 8 + mat_row;
                    ldmatrix_x4(k_base + piece_offset(key, 2 * k + mat % 2), b);
                    mma(s[j], qa[k], b[0], b[1]);
                    mma(s[j + 1], qa[k], b[2], b[3]);
                }
            }
            // 2. Mask (readable, causal) and online softmax of rows r0 (h = 0) and r1 (h = 1).
            float factor[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long last = live[h] ? causal_base + token_of[h] - start : -1;
                float tile_max = -INFINITY;
#pragma unroll
                for (int j = 0; j < N_BLOCKS; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = 8 * j + quad_col + e;
                        const bool visible = key <= last && key_ok[stage][key];
                        float& v = s[j][2 * h + e];
                        v = visible ? v * scale_log2 : -INFINITY;
                        tile_max = fmaxf(tile_max, v);
                    }
                }
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
                const float new_max = fmaxf(m[h], tile_max);
                const float base = new_max == -INFINITY ? 0.0f : new_max;
                factor[h] = exp2f(m[h] - base);
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < N_BLOCKS; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float& v = s[j][2 * h + e];
                        v = exp2f(v - base);
                        sum += v;
                    }
                }
                l[h] = l[h] * factor[h] + sum;
                m[h] = new_max;
            }
            // 3. O = O * factor + P V.
#pragma unroll
            for (int n = 0; n < D_BLOCKS; ++n) {
                o[n][0] *= factor[0];
                o[n][1] *= factor[0];
                o[n][2] *= factor[1];
                o[n][3] *= factor[1];
            }
#pragma unroll
            for (int kk = 0; kk < BLOCK_KEYS / 16; ++kk) {
                const unsigned int pa[4] = {
                    pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                    pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int n = 0; n < D_BLOCKS; n += 2) {
                    unsigned int b[4];
                    const unsigned int key = 16 * kk + (mat % 2) * 8 + mat_row;
                    ldmatrix_x4_trans(v_base + piece_offset(key, n + mat / 2), b);
                    mma(o[n], pa, b[0], b[1]);
                    mma(o[n + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // stage t & 1 is rewritten by the next iteration's copies
    }
    cp_async_wait<0>();

    // Epilogue: normalise by the row sums (reduced over the quad) and store bf16 pairs.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_of[h];
        const long long token = token0 + token_of[h];
        if (row >= active_rows || token >= (long long)num_tokens) continue;
        const float inverse = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        T* destination = out + (size_t)token * out_token_elems +
                         (size_t)(kv_head * group + row % group) * HEAD_DIM + quad_col;
#pragma unroll
        for (int n = 0; n < D_BLOCKS; ++n) {
            const float x = bad ? quiet_nan() : o[n][2 * h] * inverse;
            const float y = bad ? quiet_nan() : o[n][2 * h + 1] * inverse;
            T* d = destination + 8 * n;
            if ((reinterpret_cast<size_t>(d) & 3) == 0) {
                *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(x, y);
            } else {
                d[0] = __float2bfloat16_rn(x);
                d[1] = __float2bfloat16_rn(y);
            }
        }
    }
}
