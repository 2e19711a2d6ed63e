// Query-tiled causal prefill attention over the paged KV cache on tensor cores, streaming
// (FlashAttention-2 style with raw MMA; bf16 operands, f32 accumulators, base-2 softmax).
//
// Same contract and slot mapping as prefill_attention_mma (prefill_mma.cu): one CTA of four
// warps per (query tile of ONE request, KV head); the tile's BLOCK_ROWS rows are
// token_in_tile * group + head_in_group, warp w owning rows ROW_TILES * 16 consecutive rows
// (one or two 16-row MMA tiles: with two, every K/V fragment read from shared memory feeds
// two MMAs). The grid runs its slots in reverse, so a request's last (longest) query tiles
// start first and the short ones fill the tail.
//   - the Q tile is copied once into shared memory (cp.async, swizzled) and read as MMA A
//     fragments with ldmatrix;
//   - S = Q K^T and O += P V are mma.sync.m16n8k16 with ldmatrix (V transposed); the online
//     softmax runs on the S accumulators in registers (a row's values live in the four lanes
//     of a quad), whose layout is the A fragment P needs; p = 2^(s scale - m scale) is one
//     FFMA and one EX2, and the running maximum m only moves (rescaling O) when a tile's
//     exceeds it by 2^RESCALE_SLACK, so later tiles rarely rescale;
//   - K/V tiles of BLOCK_KEYS keys stream through STAGES cp.async stages in dynamic shared
//     memory, unpadded and XOR-swizzled (piece c of row r at piece c ^ (r % 8)) so ldmatrix's
//     eight rows hit eight bank groups;
//   - only tiles that cross a warp's causal diagonal, the end of the keys or an unreadable
//     page are masked; the others skip the per-element tests.
// Key tiles above a warp's causal diagonal are skipped by that warp. Edge rules as in
// prefill.cu: a request with more queries than visible tokens writes NaN rows.
//
// Specialisation: PAGODA_T (__nv_bfloat16), PAGODA_HEAD_DIM (64 or 128), PAGODA_BLOCK_KEYS
// (32 or 64), PAGODA_ROW_TILES (1 or 2), PAGODA_STAGES (2 or 3). Dynamic shared memory:
// SHARED_BYTES (prefill_stream_common.cu; mirrored by PrefillStreamTiling::shared_bytes).
// One barrier per tile.
//
// With PAGODA_KV_FP8 the pools hold e4m3 bytes (kv_fp8.cu): the ring stages the bytes and
// their per-(token, KV head) scales; after each tile's barrier the block widens the tile into
// one bf16 K and V tile (a second barrier), on which the MMAs run unchanged; K's scale
// multiplies the key's score column, V's is folded into P while the row sums keep p.
// Prepended: tensor_core.cu, kv_fp8.cu, prefill_stream_common.cu.

// Arguments and grid as prefill_attention_mma; block 128 threads; dynamic shared memory
// stream_prefill::SHARED_BYTES. q must be 16-byte aligned with a row stride of a multiple of
// 8 elements, like the pools (the launcher falls back to the WMMA kernel otherwise).
//
// With PAGODA_CASCADE the same tiles serve the shared level of cascade decode (cascade.rs):
// the entry is cascade_shared_attention, one CTA per (plan item, KV head). An item is a run
// of num_keys keys from page kv_indices[page_begin] on (every page whole, so no first-page
// offset) and `members` decode queries that all see every one of its keys: the "tokens" of
// the tile are the members (row = member * group + head_in_group, as token * group + ... in
// a prefill), nothing is causal, and each row's normalised partial and base-2 log-sum-exp
// go to its member's reserved slot of the fused decode's partials (the decode's merge then
// combines them with the member's own chunks). Plan words: [num_items, 0], then per item
// [page_begin, num_keys, member_begin, members] (max_items of them), then per member
// [q_row, slot].
#if PAGODA_CASCADE
extern "C" __global__ void __launch_bounds__(stream_prefill::THREADS, 2) cascade_shared_attention(
    const T* __restrict__ q, const KV_T* __restrict__ k_pool, const KV_T* __restrict__ v_pool,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ plan,
    float* __restrict__ partial_out, float* __restrict__ partial_lse, unsigned int max_items,
    unsigned int num_indices, unsigned int num_q_heads, unsigned int num_kv_heads, unsigned int page_size,
    unsigned int num_pages, unsigned int q_row_stride, float scale_log2
#else
extern "C" __global__ void __launch_bounds__(stream_prefill::THREADS, 2) prefill_attention_stream(
    const T* __restrict__ q, const KV_T* __restrict__ k_pool, const KV_T* __restrict__ v_pool,
    const unsigned int* __restrict__ qo_indptr, const unsigned int* __restrict__ kv_indptr,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, T* __restrict__ out,
    unsigned int num_requests, unsigned int num_tokens, unsigned int num_indices,
    unsigned int num_q_heads, unsigned int num_kv_heads, unsigned int page_size,
    unsigned int num_pages, unsigned int q_row_stride, unsigned int block_q, float scale_log2
#endif
#if PAGODA_KV_FP8
    , const float* __restrict__ k_scale, const float* __restrict__ v_scale
#endif
    ) {
    using namespace stream_prefill;
    extern __shared__ __align__(128) unsigned char shared[];
    unsigned char* q_tile = shared;
    unsigned char* k_tiles = shared + Q_BYTES;
    unsigned char* v_tiles = k_tiles + STAGES * KV_TILE_BYTES;
    unsigned char *k_wide = v_tiles + STAGES * KV_TILE_BYTES, *v_wide = k_wide + TILE_BYTES;  // fp8
    float* scales = reinterpret_cast<float*>(k_wide + WIDE_BYTES);  // fp8: [2][STAGES][BLOCK_KEYS]
    unsigned char* key_ok = k_wide + WIDE_BYTES + SCALE_BYTES;  // [STAGES][BLOCK_KEYS]

    const unsigned int tid = threadIdx.x;
    const int warp = (int)(tid / 32);
    const int lane = (int)(tid % 32);
    const unsigned int kv_head = blockIdx.y;
    const unsigned int group = num_q_heads / num_kv_heads;
#if PAGODA_CASCADE
#if __CUDA_ARCH__ >= 900
    // The unique level's decode reads nothing this grid writes: it may start beside it.
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    const unsigned int* item = plan + 2 + 4 * (size_t)blockIdx.x;
    if (blockIdx.x >= min(plan[0], max_items)) return;
    const unsigned long long page_base = item[0];
    const long long kv_end = item[1], first_offset = 0, token0 = 0, causal_base = KEY_LIMIT;
    const unsigned int* members = plan + 2 + 4 * (size_t)max_items + 2 * (size_t)item[2];
    const unsigned int num_tokens = item[3];  // the tile's "tokens" are its members
    const int active_rows = (int)(num_tokens * group);
    const bool bad = false;
    auto q_row_of = [&](long long token) -> size_t { return members[2 * token]; };
#else
    const unsigned int slot = gridDim.x - 1 - blockIdx.x;
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
    const unsigned long long page_base = kv_indptr[r];
    const long long first_offset = first_page_offset[r];
    auto q_row_of = [&](long long token) -> size_t { return (size_t)token; };
#endif
    const int num_tiles = (int)((kv_end + BLOCK_KEYS - 1) / BLOCK_KEYS);
    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;
    const unsigned char* k_bytes = reinterpret_cast<const unsigned char*>(k_pool);
    const unsigned char* v_bytes = reinterpret_cast<const unsigned char*>(v_pool);

    // The Q tile (rows past the tile's tokens zero-filled), in the first copy group.
    const int part = (int)(tid % ROW_CHUNKS);
    const int first_key = (int)(tid / ROW_CHUNKS);
#pragma unroll
    for (int i = 0; i < Q_PIECES_PER_THREAD; ++i) {
        const int row = first_key + i * KEY_STEP;
        const long long token = token0 + row / (int)group;
        const bool live = row < active_rows && token < (long long)num_tokens && !bad;
        const T* src = live ? q + q_row_of(token) * q_row_stride +
                                  (size_t)(kv_head * group + row % group) * HEAD_DIM + part * 8
                            : q;
        cp_async16(q_tile + piece_offset(row, part), src, live);
    }

    // Thread tid copies piece `part` of the KEYS_PER_THREAD consecutive keys
    // key_group * KEYS_PER_THREAD + i of every tile. When pages and the first offset are
    // multiples of KEYS_PER_THREAD (pages of 16 or more, the usual case), those keys share one
    // page: one page-table lookup a tile and a fixed stride. Otherwise (pages smaller than that,
    // or an unaligned first offset: rare) one lookup per key.
    const int key_group = (int)(tid / KV_CHUNKS);
    const int kv_part = (int)(tid % KV_CHUNKS);
    const size_t row_bytes = row_elems * sizeof(KV_T);
    const size_t head_bytes = (size_t)kv_head * KV_ROW_BYTES + kv_part * 16;
    const bool one_page = page_size % KEYS_PER_THREAD == 0 && first_offset % KEYS_PER_THREAD == 0;
    const int page_shift = (page_size & (page_size - 1)) == 0 ? __ffs((int)page_size) - 1 : -1;
    auto page_row = [&](unsigned long long index, bool& ok) -> unsigned int {
        ok = false;
        if (index >= num_indices) return 0;
        const unsigned int page = kv_indices[index];
        ok = page < num_pages;
        return page * page_size;
    };
    // fp8: key `key` of stage `stage` (pool byte offset `offset`, its head's first byte as
    // kv_part is 0) gets its K and V scales, (slot, KV head) = offset / HEAD_DIM.
    auto copy_scales = [&](int stage, int key, size_t offset, bool readable) {
#if PAGODA_KV_FP8
        float* dst = scales + stage * BLOCK_KEYS + key;
        cp_async4(dst, k_scale + offset / HEAD_DIM, readable);
        cp_async4(dst + STAGES * BLOCK_KEYS, v_scale + offset / HEAD_DIM, readable);
#endif
    };
    auto issue = [&](int t) {
        const int stage = t % STAGES;
        unsigned char* k_dst = k_tiles + stage * KV_TILE_BYTES;
        unsigned char* v_dst = v_tiles + stage * KV_TILE_BYTES;
        unsigned char* ok_dst = key_ok + stage * BLOCK_KEYS;
        const int key_local0 = key_group * KEYS_PER_THREAD;
        const long long key0 = (long long)t * BLOCK_KEYS + key_local0;
        // This thread's keys before kv_end (0 ..= KEYS_PER_THREAD).
        const int keys = (int)max(0LL, min(kv_end - key0, (long long)KEYS_PER_THREAD));
        const unsigned int logical0 = (unsigned int)(first_offset + key0);
        const unsigned int page_index = page_shift >= 0 ? logical0 >> page_shift : logical0 / page_size;
        const unsigned int offset0 = logical0 - page_index * page_size;
        if (one_page) {
            bool ok = false;
            unsigned int row = 0;
            if (keys > 0) row = page_row(page_base + page_index, ok) + offset0;
            const size_t first = ok ? (size_t)row * row_bytes + head_bytes : 0;
            const size_t step = ok ? row_bytes : 0;
#pragma unroll
            for (int i = 0; i < KEYS_PER_THREAD; ++i) {
                const bool readable = ok && i < keys;
                const unsigned int dst = kv_offset(key_local0 + i, kv_part);
                cp_async16(k_dst + dst, k_bytes + first + i * step, readable);
                cp_async16(v_dst + dst, v_bytes + first + i * step, readable);
                if (kv_part == 0) ok_dst[key_local0 + i] = readable;
                if (PAGODA_KV_FP8 && kv_part == 0) copy_scales(stage, key_local0 + i, first + i * step, readable);
            }
            return;
        }
#pragma unroll
        for (int i = 0; i < KEYS_PER_THREAD; ++i) {
            bool readable = false;
            unsigned int row = 0;
            if (i < keys) {
                const unsigned int logical = logical0 + i;
                const unsigned int index = logical / page_size;
                row = page_row(page_base + index, readable) + (logical - index * page_size);
            }
            const size_t offset = readable ? (size_t)row * row_bytes + head_bytes : 0;
            const unsigned int dst = kv_offset(key_local0 + i, kv_part);
            cp_async16(k_dst + dst, k_bytes + offset, readable);
            cp_async16(v_dst + dst, v_bytes + offset, readable);
            if (kv_part == 0) ok_dst[key_local0 + i] = readable;
            if (PAGODA_KV_FP8 && kv_part == 0) copy_scales(stage, key_local0 + i, offset, readable);
        }
    };
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < num_tiles) issue(t);
        cp_async_commit();
    }

    // This lane's rows: per 16-row MMA tile i, g = lane / 4 and g + 8; columns 2 (lane % 4).
    // diag[i][h]: the last key the row sees (-1 for rows without a query), clamped to int.
    const int quad_col = 2 * (lane % 4);
    const int warp_first_row = warp * 16 * ROW_TILES;
    int diag[ROW_TILES][2];
#pragma unroll
    for (int i = 0; i < ROW_TILES; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_first_row + 16 * i + lane / 4 + 8 * h;
            const long long token = row / (int)group;
            const bool live = row < active_rows && token0 + token < (long long)num_tokens && !bad;
            diag[i][h] = live ? (int)min(causal_base + token, (long long)KEY_LIMIT) : -1;
        }
    }
    float o[ROW_TILES][D_BLOCKS][4];
#pragma unroll
    for (int i = 0; i < ROW_TILES; ++i)
#pragma unroll
        for (int n = 0; n < D_BLOCKS; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.0f;
    float m[ROW_TILES][2], l[ROW_TILES][2];
#pragma unroll
    for (int i = 0; i < ROW_TILES; ++i) m[i][0] = m[i][1] = -INFINITY, l[i][0] = l[i][1] = 0.0f;
    const bool warp_active = warp_first_row < active_rows && !bad;
    // Tiles every row of the warp sees whole (below its first row's diagonal), and the last
    // tile any of its rows sees.
    const long long warp_first_key = causal_base + warp_first_row / (int)group;
    const int full_tiles = warp_active ? (int)min((warp_first_key + 1) / BLOCK_KEYS, (long long)KEY_LIMIT) : 0;
    const int warp_tiles =
        warp_active ? (int)((causal_base + min(warp_first_row + 16 * ROW_TILES - 1, active_rows - 1) / (int)group) /
                                BLOCK_KEYS + 1)
                    : 0;
    const unsigned int mat = lane / 8, mat_row = lane % 8;
    const unsigned int q_base = shared_address(q_tile);

    // One barrier a tile: after it, tile t has landed for every thread and every warp is done
    // with tile t - 1, whose stage the copies of tile t + STAGES - 1 then refill.
    for (int t = 0; t < num_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (t + STAGES - 1 < num_tiles) issue(t + STAGES - 1);
        cp_async_commit();
        const int stage = t % STAGES;
#if PAGODA_KV_FP8
        // Widen tile t (every warp: the barrier above also ended tile t - 1's reads of the
        // wide tiles), then the MMAs read the wide tiles.
        widen_tile(k_tiles + stage * KV_TILE_BYTES, k_wide);
        widen_tile(v_tiles + stage * KV_TILE_BYTES, v_wide);
        __syncthreads();
        const float* k_scales = scales + stage * BLOCK_KEYS;
        const float* v_scales = k_scales + STAGES * BLOCK_KEYS;
        const unsigned char *k_read = k_wide, *v_read = v_wide;
#else
        const unsigned char *k_read = k_tiles + stage * KV_TILE_BYTES, *v_read = v_tiles + stage * KV_TILE_BYTES;
        const float* v_scales = nullptr;
#endif
        if (t < warp_tiles) {
            const unsigned int k_base = shared_address(k_read), v_base = shared_address(v_read);
            // 1. S = Q K^T.
            float s[ROW_TILES][N_BLOCKS][4];
#pragma unroll
            for (int i = 0; i < ROW_TILES; ++i)
#pragma unroll
                for (int j = 0; j < N_BLOCKS; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.0f;
#pragma unroll
            for (int k = 0; k < HEAD_DIM / 16; ++k) {
                unsigned int qa[ROW_TILES][4];
#pragma unroll
                for (int i = 0; i < ROW_TILES; ++i) {
                    const unsigned int row = warp_first_row + 16 * i + (mat % 2) * 8 + mat_row;
                    ldmatrix_x4(q_base + piece_offset(row, 2 * k + mat / 2), qa[i]);
                }
#pragma unroll
                for (int j = 0; j < N_BLOCKS; j += 2) {
                    unsigned int b[4];
                    const unsigned int key = 8 * j + (mat / 2) * 8 + mat_row;
                    ldmatrix_x4(k_base + piece_offset(key, 2 * k + mat % 2), b);
#pragma unroll
                    for (int i = 0; i < ROW_TILES; ++i) {
                        mma(s[i][j], qa[i], b[0], b[1]);
                        mma(s[i][j + 1], qa[i], b[2], b[3]);
                    }
                }
            }
#if PAGODA_KV_FP8
            // K's scales on the score columns (keys 8 j + quad_col + e).
#pragma unroll
            for (int i = 0; i < ROW_TILES; ++i)
#pragma unroll
                for (int j = 0; j < N_BLOCKS; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[i][j][e] *= k_scales[8 * j + quad_col + e % 2];
#endif
            // 2. Mask where needed, online softmax of each lane's rows.
            const unsigned int ok_word =
                reinterpret_cast<const unsigned int*>(key_ok + stage * BLOCK_KEYS)[lane % (BLOCK_KEYS / 4)];
            const bool full = __all_sync(0xffffffffu, ok_word == 0x01010101u) && t < full_tiles;
            float factor[ROW_TILES][2];
            bool rescale = false;
#pragma unroll
            for (int i = 0; i < ROW_TILES; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    rescale |= softmax_row(s[i], h, !full, diag[i][h] - t * BLOCK_KEYS, key_ok + stage * BLOCK_KEYS,
                                           quad_col, scale_log2, m[i][h], l[i][h], factor[i][h]);
                }
            }
            // 3. O = O * factor (skipped while no row of the warp moved its maximum) + P V.
            if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
                for (int i = 0; i < ROW_TILES; ++i) {
#pragma unroll
                    for (int n = 0; n < D_BLOCKS; ++n) {
                        o[i][n][0] *= factor[i][0];
                        o[i][n][1] *= factor[i][0];
                        o[i][n][2] *= factor[i][1];
                        o[i][n][3] *= factor[i][1];
                    }
                }
            }
#pragma unroll
            for (int kk = 0; kk < BLOCK_KEYS / 16; ++kk) {
                unsigned int pa[ROW_TILES][4];
#pragma unroll
                for (int i = 0; i < ROW_TILES; ++i)
                    pack_p(pa[i], s[i][2 * kk], s[i][2 * kk + 1], v_scales ? v_scales + 16 * kk + quad_col : nullptr);
#pragma unroll
                for (int n = 0; n < D_BLOCKS; n += 2) {
                    unsigned int b[4];
                    const unsigned int key = 16 * kk + (mat % 2) * 8 + mat_row;
                    ldmatrix_x4_trans(v_base + piece_offset(key, n + mat / 2), b);
#pragma unroll
                    for (int i = 0; i < ROW_TILES; ++i) {
                        mma(o[i][n], pa[i], b[0], b[1]);
                        mma(o[i][n + 1], pa[i], b[2], b[3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: normalise by the row sums (reduced over the quad) and store bf16 pairs (a
    // prefill) or f32 pairs and the row's log-sum-exp (cascade).
#pragma unroll
    for (int i = 0; i < ROW_TILES; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[i][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = warp_first_row + 16 * i + lane / 4 + 8 * h;
            const long long token = token0 + row / (int)group;
            if (row >= active_rows || token >= (long long)num_tokens) continue;
            const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
            const unsigned int head = kv_head * group + row % group;
#if PAGODA_CASCADE
            const size_t slot_row = (size_t)members[2 * token + 1] * num_q_heads + head;
            store_partial_row(o[i], h, inverse, partial_out + slot_row * HEAD_DIM + quad_col);
            if (lane % 4 == 0)
                partial_lse[slot_row] = sum > 0.0f ? m[i][h] * scale_log2 + __log2f(sum) : -INFINITY;
#else
            store_bf16_row(o[i], h, inverse, bad,
                           out + (size_t)token * out_token_elems + (size_t)head * HEAD_DIM + quad_col);
#endif
        }
    }
}
