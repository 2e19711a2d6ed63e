// The streaming paged decode on tensor cores (bf16 or e4m3 KV; prepended: kv_fp8.cu,
// paged_decode_common.cu).
//
// Same plan, grid (max_chunks, num_kv_heads), chunk and epilogue as paged_decode_partial: one
// CTA of four warps per (chunk, KV head), the KV head's GROUP query heads as the rows of a
// 16-row MMA tile. Unlike paged_decode_mma.cu, nothing but K and V goes through shared memory:
//   - Q's A fragments are read from global memory into registers once (rows >= GROUP and the
//     upper eight rows are the constant zero);
//   - S = Q K^T and O += P V are raw mma.sync.m16n8k16 with ldmatrix (K plain, V transposed),
//     and the online softmax runs on the S accumulators in registers (a row's values live in
//     the four lanes of a quad), whose layout is the A fragment P needs;
//   - K/V tiles of TILE_KEYS = 4 x KEYS_PER_WARP keys stream through a STAGES-deep cp.async
//     ring, unpadded: the 16-byte piece c of key row r sits at piece c ^ (r % 8), so the eight
//     rows an ldmatrix reads hit eight different bank groups. Each warp copies its own keys of
//     a tile and waits for its own copies only (no CTA barrier in the loop: the warps drift
//     apart and keep the memory busy between each other's softmax); a lane's page-table
//     entries for the next tile are loaded right after it queues the current one, so
//     queueing never waits on the table;
//   - the chunk's dependents (the separate merge) may launch once every CTA is past its loop
//     (programmatic dependent launch, compute capability 9.0+).
// The small shared footprint (no S/P/Q scratch, no padding) lets three CTAs of two 64-key
// stages, or two of three, share an SM at head_dim 128; KEYS_PER_WARP, STAGES and the plan's
// CTA target are the autotuner's.
//
// With PAGODA_KV_FP8 the pools hold e4m3 bytes (kv_fp8.cu): the ring stages the bytes (half a
// bf16 tile; unswizzled rows, as eight lanes copy or read one row's contiguous bytes), the
// scales ride along in the same cp.async groups, and each warp widens its own keys of a tile
// into one bf16 tile (swizzled as above) right before its MMAs, which then run unchanged. K's
// scale multiplies the key's score column after Q K^T; V's is folded into P (p * scale_v, in
// f32, before P is packed to bf16), while the softmax sum keeps p.
static_assert(sizeof(T) == 2, "paged_decode_stream is bf16 only");

namespace stream_decode {
constexpr int KW = PAGODA_KEYS_PER_WARP;  // 16 or 32 keys per warp per tile
constexpr int TILE_KEYS = WARPS * KW;
constexpr int STAGES = PAGODA_STAGES;     // 2 .. 6
constexpr int ROW_BYTES = HEAD_DIM * 2;   // a bf16 key row, as the MMAs read it
constexpr int SIDE_BYTES = TILE_KEYS * ROW_BYTES;
constexpr int STAGE_ROW_BYTES = HEAD_DIM * (int)sizeof(KV_T);  // a pool row, as staged
constexpr int STAGE_SIDE_BYTES = TILE_KEYS * STAGE_ROW_BYTES;
constexpr int ROW_CHUNKS = STAGE_ROW_BYTES / 16;  // 16-byte pieces of a staged key row
constexpr int KEY_STEP = 32 / ROW_CHUNKS;  // keys between a lane's pieces (a warp copies its keys)
constexpr int KEYS_PER_LANE = KW / KEY_STEP;
constexpr int N_BLOCKS = KW / 8;          // 8-key column blocks of S per warp
constexpr int D_BLOCKS = HEAD_DIM / 8;    // 8-wide column blocks of O
constexpr int EPI_PITCH = HEAD_DIM + 4;   // f32
// The ring, then (fp8) the widened bf16 K and V tiles.
constexpr int MAIN_BYTES = 2 * STAGES * STAGE_SIDE_BYTES + (PAGODA_KV_FP8 ? 2 * SIDE_BYTES : 0);
constexpr int EPI_BYTES = WARPS * GROUP * EPI_PITCH * 4 + 2 * WARPS * GROUP * 4;
constexpr int SMEM_BYTES = MAX2(MAX2(MAIN_BYTES, EPI_BYTES), WEIGHTS_BYTES);
// CTAs an SM can hold by shared memory (228 KB on compute capability 9.0, 1 KB reserved per
// CTA), at most 4: the register budget the compiler gets, so registers never cut occupancy
// below what shared memory allows (nor spill for an occupancy it cannot reach).
constexpr int MIN_BLOCKS = MAX2(1, (228 * 1024 / (SMEM_BYTES + 1024)) < 4 ? (228 * 1024 / (SMEM_BYTES + 1024)) : 4);

static_assert(KW == 16 || KW == 32, "keys per warp: 16 or 32");
static_assert(STAGES >= 2 && STAGES <= 6, "pipeline stages");
static_assert(GROUP <= 8, "the query heads of a KV head fill at most the upper 8 MMA rows");
static_assert(ROW_CHUNKS <= 32 && 32 % ROW_CHUNKS == 0 && KW % KEY_STEP == 0, "tile copy layout");

// Shared-memory byte offset of 16-byte piece `piece` of key row `row` in a tile (swizzled).
PAGODA_DEVICE unsigned int piece_offset(unsigned int row, unsigned int piece) {
    return row * ROW_BYTES + ((piece ^ (row & 7)) << 4);
}
// Where the ring holds piece `piece` of staged key row `row`: a bf16 tile's swizzled layout, or
// (fp8) plain rows.
PAGODA_DEVICE unsigned int stage_offset(unsigned int row, unsigned int piece) {
    return PAGODA_KV_FP8 ? row * STAGE_ROW_BYTES + (piece << 4) : piece_offset(row, piece);
}

// d += a b with the upper eight rows of a zero.
PAGODA_DEVICE void mma_upper(float (&d)[4], unsigned int a0, unsigned int a2, unsigned int b0,
                             unsigned int b1) {
    mma_bf16(d, a0, 0u, a2, 0u, b0, b1);
}
}  // namespace stream_decode

// Arguments, grid and outputs as paged_decode_partial (paged_decode.cu); block THREADS.
extern "C" __global__ void __launch_bounds__(THREADS, stream_decode::MIN_BLOCKS) paged_decode_partial_stream(
    const T* __restrict__ q, const KV_T* __restrict__ k_pool, const KV_T* __restrict__ v_pool,
    const unsigned int* __restrict__ kv_indptr, const unsigned int* __restrict__ kv_indices,
    const unsigned int* __restrict__ last_page_len, const unsigned int* __restrict__ first_page_offset,
    const unsigned int* __restrict__ plan, T* __restrict__ out, float* __restrict__ partial_out,
    float* __restrict__ partial_lse, unsigned int* __restrict__ semaphores,
    unsigned int num_requests, unsigned int max_chunks, unsigned int num_kv_heads,
    unsigned int page_shift, unsigned int num_pages, unsigned int q_row_stride, float scale_log2,
    unsigned int flags  // bit 0: merge in the kernel; bit 1: wait for the primary first
#if PAGODA_KV_FP8
    , const float* __restrict__ k_scale, const float* __restrict__ v_scale
#endif
    ) {
    using namespace stream_decode;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ unsigned char tile_valid[STAGES][TILE_KEYS];
#if PAGODA_KV_FP8
    __shared__ float tile_scale[2][STAGES][TILE_KEYS];  // K, V scales of each staged key
#endif
    const unsigned int chunk = blockIdx.x;
    const unsigned int kv_head = blockIdx.y;
    DecodeChunk c;
    if (!load_chunk(plan, chunk, max_chunks, num_requests, kv_indptr, last_page_len, first_page_offset,
                    page_shift, c))
        return;
#if __CUDA_ARCH__ >= 900
    // Launched programmatically after the kernel that wrote the page ids (a sparse selection):
    // only the plan and the row pointer, uploaded before the step, are read before it completes.
    if (flags & 2u) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    require_dynamic_smem(SMEM_BYTES);
    const unsigned int tid = threadIdx.x;
    const unsigned int warp = tid / 32;
    const unsigned int lane = tid % 32;
    const long long num_keys = max(0LL, c.key_end - c.key_begin);
    const int num_tiles = (int)((num_keys + TILE_KEYS - 1) / TILE_KEYS);
    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;
    const unsigned char* k_bytes = reinterpret_cast<const unsigned char*>(k_pool);
    const unsigned char* v_bytes = reinterpret_cast<const unsigned char*>(v_pool);

    // Warp w copies keys w * KW .. w * KW + KW - 1 of every tile: this lane piece `part` of keys
    // first_key + i * KEY_STEP; pages[i] holds their page ids for the next tile to queue
    // (~0u: unreadable).
    const int part = (int)(lane % ROW_CHUNKS);
    const int first_key = (int)(warp * KW + lane / ROW_CHUNKS);
    const unsigned long long page_mask = (1ull << page_shift) - 1;
    unsigned int pages[KEYS_PER_LANE];
    auto load_pages = [&](int t) {
#pragma unroll
        for (int i = 0; i < KEYS_PER_LANE; ++i) {
            const long long key = c.key_begin + (long long)t * TILE_KEYS + first_key + i * KEY_STEP;
            unsigned int page = ~0u;
            if (t < num_tiles && key < c.key_end) {
                page = __ldg(kv_indices + c.page_begin + (unsigned int)((c.fpo + key) >> page_shift));
                if (page >= num_pages) page = ~0u;
            }
            pages[i] = page;
        }
    };
    auto issue = [&](int t) {
        const int stage = t % STAGES;
        unsigned char* k_dst = smem + (size_t)stage * STAGE_SIDE_BYTES;
        unsigned char* v_dst = smem + (size_t)(STAGES + stage) * STAGE_SIDE_BYTES;
#pragma unroll
        for (int i = 0; i < KEYS_PER_LANE; ++i) {
            const int key_local = first_key + i * KEY_STEP;
            const long long key = c.key_begin + (long long)t * TILE_KEYS + key_local;
            const bool readable = pages[i] != ~0u;
            size_t offset = 0;
            if (readable) {
                const size_t row = ((size_t)pages[i] << page_shift) + (size_t)((c.fpo + key) & page_mask);
                offset = (row * row_elems + (size_t)kv_head * HEAD_DIM) * sizeof(KV_T) + part * 16;
            }
            const unsigned int dst = stage_offset(key_local, part);
            cp_async16_line(k_dst + dst, k_bytes + offset, readable);
            cp_async16_line(v_dst + dst, v_bytes + offset, readable);
            if (part == 0) {
                tile_valid[stage][key_local] = readable;
#if PAGODA_KV_FP8
                // (slot, kv_head)'s scales: one byte a value, so the byte offset / HEAD_DIM.
                const size_t head_row = offset / HEAD_DIM;
                cp_async4(&tile_scale[0][stage][key_local], k_scale + head_row, readable);
                cp_async4(&tile_scale[1][stage][key_local], v_scale + head_row, readable);
#endif
            }
        }
    };
    load_pages(0);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_tiles) {
            issue(s);
            load_pages(s + 1);
        }
        cp_async_commit();
    }

    // Q's A fragments, row g = lane / 4 (head kv_head * GROUP + g), columns 2 (lane % 4) + {0, 1}
    // and + 8 of each 16-wide step; rows >= GROUP are zeros.
    const unsigned int row = lane / 4;
    const unsigned int quad_col = 2 * (lane % 4);
    unsigned int qa[HEAD_DIM / 16][2];
    {
        const T* q_row = q + (size_t)c.r * q_row_stride + (size_t)(kv_head * GROUP + row) * HEAD_DIM;
#pragma unroll
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
            qa[k][0] = row < GROUP ? __ldg(reinterpret_cast<const unsigned int*>(q_row + 16 * k + quad_col)) : 0u;
            qa[k][1] = row < GROUP ? __ldg(reinterpret_cast<const unsigned int*>(q_row + 16 * k + 8 + quad_col)) : 0u;
        }
    }
    float o[D_BLOCKS][4];
#pragma unroll
    for (int n = 0; n < D_BLOCKS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    // Online-softmax state of row `row`: the running max (the same in the quad's four lanes)
    // and this lane's share of the running sum.
    float m = -INFINITY, l = 0.0f;
    // ldmatrix row addresses: lane supplies row lane % 8 of matrix lane / 8.
    const unsigned int mat = lane / 8, mat_row = lane % 8;

    for (int t = 0; t < num_tiles; ++t) {
        // This warp's copies of tile t are done (and the slot of tile t - 1, which the next
        // copies overwrite, is no longer read by any of its lanes).
        cp_async_wait<STAGES - 2>();
        __syncwarp();
        if (t + STAGES - 1 < num_tiles) {
            issue(t + STAGES - 1);
            load_pages(t + STAGES);
        }
        cp_async_commit();
        const int stage = t % STAGES;
#if PAGODA_KV_FP8
        // Widen this warp's keys of the tile into the bf16 tiles: eight bytes a lane at a time
        // (a row's contiguous bytes across lanes), one 16-byte swizzled bf16 piece out. The
        // __syncwarp above also ordered the previous tile's ldmatrix before these stores.
        unsigned char* k_wide = smem + (size_t)2 * STAGES * STAGE_SIDE_BYTES;
        unsigned char* v_wide = k_wide + SIDE_BYTES;
        {
            const unsigned char* k_src = smem + (size_t)stage * STAGE_SIDE_BYTES;
            const unsigned char* v_src = smem + (size_t)(STAGES + stage) * STAGE_SIDE_BYTES;
            constexpr int PIECES = KW * HEAD_DIM / 8;
            static_assert(PIECES % 32 == 0, "whole passes of the warp");
#pragma unroll
            for (int i = lane; i < PIECES; i += 32) {
                const unsigned int key = warp * KW + i / (HEAD_DIM / 8);
                const unsigned int piece = i % (HEAD_DIM / 8);
                const unsigned int src = key * STAGE_ROW_BYTES + piece * 8;
                const unsigned int dst = piece_offset(key, piece);
                *reinterpret_cast<uint4*>(k_wide + dst) = fp8x8_to_bf16x8(*reinterpret_cast<const uint2*>(k_src + src));
                *reinterpret_cast<uint4*>(v_wide + dst) = fp8x8_to_bf16x8(*reinterpret_cast<const uint2*>(v_src + src));
            }
        }
        __syncwarp();
        const unsigned int k_base = shared_address(k_wide);
        const unsigned int v_base = shared_address(v_wide);
        const float* k_scales = tile_scale[0][stage] + warp * KW;
        const float* v_scales = tile_scale[1][stage] + warp * KW;
#else
        const unsigned int k_base = shared_address(smem + (size_t)stage * SIDE_BYTES);
        const unsigned int v_base = shared_address(smem + (size_t)(STAGES + stage) * SIDE_BYTES);
#endif
        // 1. S = Q K^T: s[j] is key block j (keys 8j .. 8j + 7 of the warp's KW), summed from
        // two accumulators (even and odd 16-wide steps) to halve the MMA dependency chain.
        float s[N_BLOCKS][4], s_odd[N_BLOCKS][4];
#pragma unroll
        for (int j = 0; j < N_BLOCKS; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            s_odd[j][0] = s_odd[j][1] = s_odd[j][2] = s_odd[j][3] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < HEAD_DIM / 16; ++k) {
#pragma unroll
            for (int j = 0; j < N_BLOCKS; j += 2) {
                // Matrices: (keys 8j, dims 16k), (8j, 16k + 8), (8j + 8, 16k), (8j + 8, 16k + 8).
                unsigned int b[4];
                const unsigned int key = warp * KW + 8 * j + (mat / 2) * 8 + mat_row;
                ldmatrix_x4(k_base + piece_offset(key, 2 * k + mat % 2), b);
                float(&acc0)[4] = k % 2 ? s_odd[j] : s[j];
                float(&acc1)[4] = k % 2 ? s_odd[j + 1] : s[j + 1];
                mma_upper(acc0, qa[k][0], qa[k][1], b[0], b[1]);
                mma_upper(acc1, qa[k][0], qa[k][1], b[2], b[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < N_BLOCKS; ++j) {
            s[j][0] += s_odd[j][0];
            s[j][1] += s_odd[j][1];
        }
        // 2. Online softmax of row `row` over the tile (masked keys: -inf).
        const unsigned char* valid = tile_valid[stage] + warp * KW;
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < N_BLOCKS; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
#if PAGODA_KV_FP8
                const float key_scale = k_scales[8 * j + quad_col + e] * scale_log2;
#else
                const float key_scale = scale_log2;
#endif
                s[j][e] = valid[8 * j + quad_col + e] ? s[j][e] * key_scale : -INFINITY;
                tile_max = fmaxf(tile_max, s[j][e]);
            }
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(m, tile_max);
        const float base = new_max == -INFINITY ? 0.0f : new_max;
        const float factor = exp2f(m - base);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < N_BLOCKS; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[j][e] = exp2f(s[j][e] - base);
                sum += s[j][e];
            }
        }
        l = l * factor + sum;
        m = new_max;
        // 3. O = O * factor + P V, P's A fragments straight from the S accumulators.
#pragma unroll
        for (int n = 0; n < D_BLOCKS; ++n) {
            o[n][0] *= factor;
            o[n][1] *= factor;
        }
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk) {
#if PAGODA_KV_FP8
            // P's columns are keys 16 kk + quad_col + {0, 1} and + 8: each times its V scale.
            const float* vs = v_scales + 16 * kk + quad_col;
            const unsigned int p0 = pack_bf16(s[2 * kk][0] * vs[0], s[2 * kk][1] * vs[1]);
            const unsigned int p2 = pack_bf16(s[2 * kk + 1][0] * vs[8], s[2 * kk + 1][1] * vs[9]);
#else
            const unsigned int p0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            const unsigned int p2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
#endif
#pragma unroll
            for (int n = 0; n < D_BLOCKS; n += 2) {
                // Transposed matrices: (keys 16kk, dims 8n), (16kk + 8, 8n), (16kk, 8n + 8), (16kk + 8, 8n + 8).
                unsigned int b[4];
                const unsigned int key = warp * KW + 16 * kk + (mat % 2) * 8 + mat_row;
                ldmatrix_x4_trans(v_base + piece_offset(key, n + mat / 2), b);
                mma_upper(o[n], p0, p2, b[0], b[1]);
                mma_upper(o[n + 1], p0, p2, b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>();
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    __syncthreads();

    // Publish each warp's state for finish_chunk: rows (warp, g) for g < GROUP.
    float* s_acc = reinterpret_cast<float*>(smem);
    float* s_m = s_acc + WARPS * GROUP * EPI_PITCH;
    float* s_l = s_m + WARPS * GROUP;
    if (row < GROUP) {
        float* acc_row = s_acc + (warp * GROUP + row) * EPI_PITCH + quad_col;
#pragma unroll
        for (int n = 0; n < D_BLOCKS; ++n) {
            acc_row[8 * n] = o[n][0];
            acc_row[8 * n + 1] = o[n][1];
        }
        if (lane % 4 == 0) {
            s_m[warp * GROUP + row] = m;
            s_l[warp * GROUP + row] = l;
        }
    }
    finish_chunk(c, chunk, kv_head, num_kv_heads, s_acc, s_m, s_l, GROUP, EPI_PITCH, s_acc, out, partial_out,
                 partial_lse, semaphores, flags & 1u);
#if __CUDA_ARCH__ >= 900
    // Launched programmatically beside cascade's shared level (whose partials it does not
    // read): this grid does not complete before that one, so the merge, which waits for this
    // grid, reads both levels. Without a programmatic launch the wait returns at once.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
