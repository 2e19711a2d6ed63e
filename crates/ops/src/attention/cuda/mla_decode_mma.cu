// MLA absorbed decode on tensor cores (bf16 pool; after tensor_core.cu and mla_common.cu).
//
// The heads are the MMA rows: a CTA serves one chunk for a tile of HEAD_TILE = 16 heads (one
// m16 tile), so each latent row, loaded once into shared memory (TK keys per tile, STAGES
// tiles in flight through cp.async), feeds all 16 heads. Per tile, with MMA_WARPS = 8 warps:
//   1. scores S [16 heads, TK keys] = Q [16, ROW_DIM] K^T on mma.sync m16n8k16 (bf16, f32
//      accumulation): warp w computes keys 8 (w % 4) .. + 8 over half w / 4 of the ROW_DIM
//      dims, and the two halves are added in shared memory;
//   2. online softmax in base 2: 16 threads per head row, 2 keys each; the probabilities go
//      to shared memory as bf16 with the row's rescale factor;
//   3. O [16, LATENT_DIM] += P [16, TK] C [TK, LATENT_DIM]: warp w owns latent dims
//      64 w .. 64 w + 63 (8 n8 tiles, 32 f32 accumulators per thread), C being the first
//      LATENT_DIM values of the same rows in shared memory (ldmatrix.trans).
// Shared rows are padded by 8 elements (16 bytes) so ldmatrix's 8 row addresses fall in
// distinct banks.
#define STAGES PAGODA_STAGES
#define MMA_THREADS 256
#define MMA_WARPS (MMA_THREADS / 32)
#define TK 32
#define KV_PITCH (ROW_DIM + 8)
#define PITCH_BYTES (KV_PITCH * 2)
#define P_PITCH (TK + 8)
#define K_STEPS_HALF (ROW_DIM / 32)
#define PIPE_BYTES (STAGES * TK * PITCH_BYTES)
#define Q_BYTES (HEAD_TILE * PITCH_BYTES)
#define SCORE_BYTES (2 * HEAD_TILE * TK * 4)
#define P_BYTES (HEAD_TILE * P_PITCH * 2)
#define ROWS_BYTES (3 * HEAD_TILE * 4)
// The dynamic shared memory of the kernel (the launcher computes the same).
#define SMEM_BYTES (PIPE_BYTES + Q_BYTES + SCORE_BYTES + P_BYTES + ROWS_BYTES)

static_assert(sizeof(T) == 2, "the tensor-core MLA decode reads bf16");
static_assert(LATENT_DIM == 64 * MMA_WARPS, "each warp owns 64 latent dims");
static_assert(K_STEPS_HALF % 2 == 0, "k-steps go in pairs");
static_assert(HEAD_TILE * 16 == MMA_THREADS && TK == 32, "16 threads of 2 keys per head row");

// Grid (max_chunks * head_tiles), block MMA_THREADS, SMEM_BYTES of dynamic shared memory.
// Arguments and outputs as mla_decode_partial (mla_decode.cu).
extern "C" __global__ void __launch_bounds__(MMA_THREADS) mla_decode_partial_mma(
    const T* __restrict__ q, const T* __restrict__ pool, const unsigned int* __restrict__ kv_indptr,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, const unsigned int* __restrict__ plan,
    T* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_lse,
    unsigned int num_requests, unsigned int max_chunks, unsigned int num_heads, unsigned int page_shift,
    unsigned int num_pages, unsigned int q_row_stride, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ unsigned char valid[STAGES][TK];
    const unsigned int head_tiles = num_heads / HEAD_TILE;
    const unsigned int chunk = blockIdx.x / head_tiles;
    const unsigned int head0 = (blockIdx.x % head_tiles) * HEAD_TILE;
    LatentChunk c;
    if (!load_latent_chunk(plan, chunk, max_chunks, num_requests, kv_indptr, last_page_len,
                           first_page_offset, page_shift, c))
        return;
    unsigned int dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    if (dynamic_smem < SMEM_BYTES) __trap();

    unsigned char* s_kv = smem;
    unsigned char* s_q = smem + PIPE_BYTES;
    float* s_scores = reinterpret_cast<float*>(s_q + Q_BYTES);            // [2][HEAD_TILE][TK]
    T* s_p = reinterpret_cast<T*>(smem + PIPE_BYTES + Q_BYTES + SCORE_BYTES);  // [HEAD_TILE][P_PITCH]
    float* s_factor = reinterpret_cast<float*>(smem + PIPE_BYTES + Q_BYTES + SCORE_BYTES + P_BYTES);
    float* s_m = s_factor + HEAD_TILE;
    float* s_l = s_m + HEAD_TILE;

    const unsigned int tid = threadIdx.x;
    const unsigned int warp = tid / 32;
    const unsigned int lane = tid % 32;
    const long long num_keys = max(0LL, c.key_end - c.key_begin);
    const int num_tiles = (int)((num_keys + TK - 1) / TK);
    auto issue = [&](int t) {
        const int stage = t % STAGES;
        issue_latent_tile(c, kv_indices, pool, c.key_begin + (long long)t * TK, TK, page_shift, num_pages,
                          s_kv + (size_t)stage * TK * PITCH_BYTES, PITCH_BYTES, valid[stage], MMA_THREADS);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_tiles) issue(s);
        cp_async_commit();
    }
    // The head tile's queries, [HEAD_TILE][KV_PITCH].
    const T* q_tile = q + (size_t)c.r * q_row_stride + (size_t)head0 * ROW_DIM;
    for (unsigned int i = tid; i < HEAD_TILE * ROW_DIM; i += MMA_THREADS) {
        const unsigned int h = i / ROW_DIM, d = i % ROW_DIM;
        reinterpret_cast<T*>(s_q)[h * KV_PITCH + d] = q_tile[(size_t)h * ROW_DIM + d];
    }

    // Softmax ownership: head row `row`, keys 2 sub, 2 sub + 1 of each tile.
    const unsigned int row = tid / 16, sub = tid % 16;
    float m_run = -INFINITY, l_run = 0.0f;
    // P V ownership: rows g, g + 8 and dims 64 warp + 8 j + 2 (lane % 4) + {0, 1}.
    const unsigned int g = lane / 4;
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    for (int t = 0; t < num_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (t + STAGES - 1 < num_tiles) issue(t + STAGES - 1);
        cp_async_commit();
        const int stage = t % STAGES;
        const unsigned char* kv = s_kv + (size_t)stage * TK * PITCH_BYTES;

        // 1. Scores of keys 8 (warp % 4) .. over dims half (warp / 4).
        {
            const unsigned int n0 = (warp % 4) * 8;
            const unsigned int half = warp / 4;
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const unsigned int mi = lane / 8;
            const unsigned int b_addr = shared_address(kv + (n0 + lane % 8) * PITCH_BYTES + mi * 16);
            const unsigned int a_addr =
                shared_address(s_q + ((mi & 1) * 8 + lane % 8) * PITCH_BYTES + (mi >> 1) * 16);
#pragma unroll
            for (int ks = 0; ks < K_STEPS_HALF; ks += 2) {
                const unsigned int k_bytes = (half * K_STEPS_HALF + ks) * 32;
                unsigned int b[4], a[4], a_next[4];
                ldmatrix_x4(b_addr + k_bytes, b);
                ldmatrix_x4(a_addr + k_bytes, a);
                ldmatrix_x4(a_addr + k_bytes + 32, a_next);
                mma_bf16(s, a[0], a[1], a[2], a[3], b[0], b[1]);
                mma_bf16(s, a_next[0], a_next[1], a_next[2], a_next[3], b[2], b[3]);
            }
            float* dst = s_scores + half * HEAD_TILE * TK;
            const unsigned int key = n0 + 2 * (lane % 4);
            dst[g * TK + key] = s[0];
            dst[g * TK + key + 1] = s[1];
            dst[(g + 8) * TK + key] = s[2];
            dst[(g + 8) * TK + key + 1] = s[3];
        }
        __syncthreads();

        // 2. Online softmax of row `row`, keys 2 sub, 2 sub + 1.
        {
            float x[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const unsigned int key = 2 * sub + e;
                const float s = s_scores[row * TK + key] + s_scores[(HEAD_TILE + row) * TK + key];
                x[e] = valid[stage][key] ? s * scale_log2 : -INFINITY;
            }
            float tile_max = fmaxf(x[0], x[1]);
#pragma unroll
            for (int offset = 8; offset > 0; offset >>= 1)
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
            const float new_max = fmaxf(m_run, tile_max);
            float p[2] = {0.0f, 0.0f};
            float factor = 1.0f;
            if (new_max > -INFINITY) {
                factor = exp2f(m_run - new_max);
#pragma unroll
                for (int e = 0; e < 2; ++e) p[e] = x[e] == -INFINITY ? 0.0f : exp2f(x[e] - new_max);
                m_run = new_max;
            }
            // The sum counts the probabilities as P V will use them (rounded to bf16).
            const __nv_bfloat162 packed = __floats2bfloat162_rn(p[0], p[1]);
            float sum = __low2float(packed) + __high2float(packed);
#pragma unroll
            for (int offset = 8; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            l_run = l_run * factor + sum;
            *reinterpret_cast<__nv_bfloat162*>(s_p + row * P_PITCH + 2 * sub) = packed;
            if (sub == 0) s_factor[row] = factor;
        }
        __syncthreads();

        // 3. O = O * factor + P C over this warp's 64 latent dims.
        {
            const float f_lo = s_factor[g], f_hi = s_factor[g + 8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[j][0] *= f_lo;
                acc[j][1] *= f_lo;
                acc[j][2] *= f_hi;
                acc[j][3] *= f_hi;
            }
            const unsigned int mi = lane / 8;
#pragma unroll
            for (int ks = 0; ks < TK / 16; ++ks) {
                unsigned int a[4];
                ldmatrix_x4(shared_address(s_p + ((mi & 1) * 8 + lane % 8) * P_PITCH + ks * 16 + (mi >> 1) * 8), a);
                const unsigned char* rows = kv + (ks * 16 + (mi & 1) * 8 + lane % 8) * PITCH_BYTES;
#pragma unroll
                for (int jp = 0; jp < 4; ++jp) {
                    unsigned int b[4];
                    const unsigned int dim = warp * 64 + jp * 16 + (mi >> 1) * 8;
                    ldmatrix_x4_trans(shared_address(rows + dim * 2), b);
                    mma_bf16(acc[2 * jp], a[0], a[1], a[2], a[3], b[0], b[1]);
                    mma_bf16(acc[2 * jp + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    if (sub == 0) {
        s_m[row] = m_run;
        s_l[row] = l_run;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const unsigned int d = warp * 64 + j * 8 + 2 * (lane % 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const unsigned int r = g + (e / 2) * 8;
            store_latent_output(c, chunk, num_heads, head0 + r, d + (e % 2), acc[j][e], s_m[r], s_l[r], out,
                                partial_out, partial_lse);
        }
    }
}
