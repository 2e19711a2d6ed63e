// The fused split-KV paged decode on tensor cores (bf16 KV; prepended: paged_decode_common.cu).
//
// Same plan, grid (max_chunks, num_kv_heads), chunk and epilogue as paged_decode_partial: one
// CTA per (chunk, KV head) with the KV head's GROUP query heads as the rows of a 16-row WMMA
// tile (rows >= GROUP are zeros). K/V tiles of TILE_KEYS = 64 keys stream into shared memory
// through a cp.async pipeline (rows padded by 16 bytes so fragment loads spread over the
// banks); warp w owns keys 16w .. 16w + 15 of every tile and keeps its own online-softmax
// state and O accumulators:
//   1. S = Q K^T (16 x 16, f32) with HEAD_DIM / 16 WMMA steps, stored to the warp's scratch;
//   2. lanes 0 .. GROUP - 1 each own one query head (row): scale, mask, online softmax in base
//      2, write P (bf16) and the row's rescale factor;
//   3. O = O * factor (row-wise, through the accumulator's row map, discovered once as in
//      prefill_mma.cu) + P V.
// The warps' states are combined by finish_chunk. Tensor cores make the per-key work a few
// instructions, so the kernel streams K/V at close to the memory rate.
#include <mma.h>

static_assert(sizeof(T) == 2, "paged_decode_mma is bf16 only");

namespace mma_decode {
using namespace nvcuda;

constexpr int TILE_KEYS = WARPS * 16;
constexpr int DIM_FRAGS = HEAD_DIM / 16;
constexpr int STAGES = PAGODA_STAGES;  // 2 or 3 (the launcher's choice)
// Q fragments stay in registers up to HEAD_DIM 128; beyond, they are reloaded from shared memory.
constexpr bool Q_IN_REGISTERS = HEAD_DIM <= 128;
constexpr int KV_PITCH = HEAD_DIM + 8;  // bf16 elements
constexpr int ROW_CHUNKS = HEAD_DIM / 8;
constexpr int S_PITCH = 16 + 4;         // f32
constexpr int P_PITCH = 16 + 8;         // bf16
constexpr int EPI_PITCH = HEAD_DIM + 4; // f32

__host__ __device__ constexpr int align128(int bytes) { return (bytes + 127) / 128 * 128; }
__host__ __device__ constexpr int max_int(int a, int b) { return a > b ? a : b; }

constexpr int SIDE_BYTES = align128(TILE_KEYS * KV_PITCH * 2);
constexpr int OFF_K = 0;
constexpr int OFF_V = STAGES * SIDE_BYTES;
constexpr int OFF_Q = 2 * STAGES * SIDE_BYTES;
constexpr int OFF_S = OFF_Q + align128(16 * KV_PITCH * 2);
constexpr int OFF_P = OFF_S + WARPS * align128(16 * S_PITCH * 4);
constexpr int OFF_FACTOR = OFF_P + WARPS * align128(16 * P_PITCH * 2);
constexpr int MAIN_BYTES = OFF_FACTOR + WARPS * 16 * 4;
// Epilogue: O [WARPS][16][EPI_PITCH] f32, then the maxima and sums [WARPS][16].
constexpr int EPI_BYTES = WARPS * 16 * EPI_PITCH * 4 + 2 * WARPS * 16 * 4;
// The dynamic shared memory the kernel needs (the launcher computes the same).
constexpr int SMEM_BYTES = max_int(max_int(MAIN_BYTES, EPI_BYTES), WEIGHTS_BYTES);

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM: multiple of 16");
static_assert(GROUP <= 16, "at most 16 query heads per KV head");
static_assert(STAGES >= 2 && STAGES <= 4, "pipeline stages");

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> FragKt;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> FragV;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragAcc;
}  // namespace mma_decode

// Arguments, grid and outputs as paged_decode_partial (paged_decode.cu); block THREADS.
extern "C" __global__ void __launch_bounds__(THREADS) paged_decode_partial_mma(
    const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const unsigned int* __restrict__ kv_indptr, const unsigned int* __restrict__ kv_indices,
    const unsigned int* __restrict__ last_page_len, const unsigned int* __restrict__ first_page_offset,
    const unsigned int* __restrict__ plan, T* __restrict__ out, float* __restrict__ partial_out,
    float* __restrict__ partial_lse, unsigned int* __restrict__ semaphores,
    unsigned int num_requests, unsigned int max_chunks, unsigned int num_kv_heads,
    unsigned int page_shift, unsigned int num_pages, unsigned int q_row_stride, float scale_log2,
    unsigned int merge_in_kernel) {
    using namespace mma_decode;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ unsigned char tile_valid[STAGES][TILE_KEYS];
    const unsigned int chunk = blockIdx.x;
    const unsigned int kv_head = blockIdx.y;
    DecodeChunk c;
    if (!load_chunk(plan, chunk, max_chunks, num_requests, kv_indptr, last_page_len, first_page_offset,
                    page_shift, c))
        return;
    require_dynamic_smem(SMEM_BYTES);
    const unsigned int tid = threadIdx.x;
    const unsigned int warp = tid / 32;
    const unsigned int lane = tid % 32;
    const long long num_keys = max(0LL, c.key_end - c.key_begin);
    const int num_tiles = (int)((num_keys + TILE_KEYS - 1) / TILE_KEYS);
    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;

    __nv_bfloat16* k_tiles = reinterpret_cast<__nv_bfloat16*>(smem + OFF_K);
    __nv_bfloat16* v_tiles = reinterpret_cast<__nv_bfloat16*>(smem + OFF_V);
    __nv_bfloat16* q_tile = reinterpret_cast<__nv_bfloat16*>(smem + OFF_Q);
    float* s_warp = reinterpret_cast<float*>(smem + OFF_S + warp * align128(16 * S_PITCH * 4));
    __nv_bfloat16* p_warp =
        reinterpret_cast<__nv_bfloat16*>(smem + OFF_P + warp * align128(16 * P_PITCH * 2));
    float* factor_warp = reinterpret_cast<float*>(smem + OFF_FACTOR) + warp * 16;

    auto issue = [&](int t) {
        const int stage = t % STAGES;
        issue_tile(c, kv_indices, k_pool, v_pool, t, TILE_KEYS, page_shift, num_pages, row_elems, kv_head,
                   reinterpret_cast<unsigned char*>(k_tiles) + (size_t)stage * SIDE_BYTES,
                   reinterpret_cast<unsigned char*>(v_tiles) + (size_t)stage * SIDE_BYTES, KV_PITCH * 2,
                   tile_valid[stage]);
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_tiles) issue(s);
        cp_async_commit();
    }

    // Query rows (unscaled bf16): row g is head kv_head * GROUP + g; rows >= GROUP are zeros.
    for (unsigned int i = tid; i < 16 * ROW_CHUNKS; i += THREADS) {
        const unsigned int row = i / ROW_CHUNKS;
        const unsigned int part = i % ROW_CHUNKS;
        uint4 value = make_uint4(0u, 0u, 0u, 0u);
        if (row < GROUP) {
            value = load_bf16x8(q + (size_t)c.r * q_row_stride + (size_t)(kv_head * GROUP + row) * HEAD_DIM +
                                part * 8);
        }
        *reinterpret_cast<uint4*>(&q_tile[row * KV_PITCH + part * 8]) = value;
    }
    // Row map of an accumulator fragment: row_of[i] is the row (0..15) of element i.
    int row_of[FragAcc::num_elements];
    {
        for (int i = lane; i < 256; i += 32) s_warp[i] = (float)(i / 16);
        __syncwarp();
        FragAcc map;
        wmma::load_matrix_sync(map, s_warp, 16, wmma::mem_row_major);
#pragma unroll
        for (int i = 0; i < FragAcc::num_elements; ++i) row_of[i] = (int)map.x[i];
        __syncwarp();
    }
    __syncthreads();
    FragA q_frags[Q_IN_REGISTERS ? DIM_FRAGS : 1];
    if constexpr (Q_IN_REGISTERS) {
#pragma unroll
        for (int k = 0; k < (Q_IN_REGISTERS ? DIM_FRAGS : 1); ++k) wmma::load_matrix_sync(q_frags[k], q_tile + 16 * k, KV_PITCH);
    }
    FragAcc o_frags[DIM_FRAGS];
#pragma unroll
    for (int n = 0; n < DIM_FRAGS; ++n) wmma::fill_fragment(o_frags[n], 0.0f);
    // Online-softmax state of row `lane` (lanes < GROUP).
    float m = -INFINITY, l = 0.0f;

    for (int t = 0; t < num_tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (t + STAGES - 1 < num_tiles) issue(t + STAGES - 1);
        cp_async_commit();
        const int stage = t % STAGES;
        const __nv_bfloat16* k_warp = k_tiles + (size_t)stage * SIDE_BYTES / 2 + (size_t)warp * 16 * KV_PITCH;
        const __nv_bfloat16* v_warp = v_tiles + (size_t)stage * SIDE_BYTES / 2 + (size_t)warp * 16 * KV_PITCH;
        // 1. S = Q K^T.
        FragAcc s_frag;
        wmma::fill_fragment(s_frag, 0.0f);
#pragma unroll
        for (int k = 0; k < DIM_FRAGS; ++k) {
            FragKt kt;
            wmma::load_matrix_sync(kt, k_warp + 16 * k, KV_PITCH);
            if constexpr (Q_IN_REGISTERS) {
                wmma::mma_sync(s_frag, q_frags[Q_IN_REGISTERS ? k : 0], kt, s_frag);
            } else {
                FragA qa;
                wmma::load_matrix_sync(qa, q_tile + 16 * k, KV_PITCH);
                wmma::mma_sync(s_frag, qa, kt, s_frag);
            }
        }
        wmma::store_matrix_sync(s_warp, s_frag, S_PITCH, wmma::mem_row_major);
        __syncwarp();
        // 2. Online softmax of the GROUP real rows; P and the rescale factors.
        if (lane < 16) {
            float factor = 1.0f;
            float p[16];
            if (lane < GROUP) {
                float tile_max = -INFINITY;
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const bool valid = tile_valid[stage][warp * 16 + j];
                    p[j] = valid ? s_warp[lane * S_PITCH + j] * scale_log2 : -INFINITY;
                    tile_max = fmaxf(tile_max, p[j]);
                }
                const float new_max = fmaxf(m, tile_max);
                if (new_max == -INFINITY) {
#pragma unroll
                    for (int j = 0; j < 16; ++j) p[j] = 0.0f;
                } else {
                    factor = exp2f(m - new_max);
                    float sum = 0.0f;
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        p[j] = exp2f(p[j] - new_max);
                        sum += p[j];
                    }
                    l = l * factor + sum;
                    m = new_max;
                }
            } else {
#pragma unroll
                for (int j = 0; j < 16; ++j) p[j] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < 16; ++j) p_warp[lane * P_PITCH + j] = __float2bfloat16_rn(p[j]);
            factor_warp[lane] = factor;
        }
        __syncwarp();
        // 3. O = O * factor + P V.
        float factors[FragAcc::num_elements];
#pragma unroll
        for (int i = 0; i < FragAcc::num_elements; ++i) factors[i] = factor_warp[row_of[i]];
        FragA p_frag;
        wmma::load_matrix_sync(p_frag, p_warp, P_PITCH);
#pragma unroll
        for (int n = 0; n < DIM_FRAGS; ++n) {
#pragma unroll
            for (int i = 0; i < FragAcc::num_elements; ++i) o_frags[n].x[i] *= factors[i];
            FragV v;
            wmma::load_matrix_sync(v, v_warp + 16 * n, KV_PITCH);
            wmma::mma_sync(o_frags[n], p_frag, v, o_frags[n]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Publish each warp's state for finish_chunk: O rows, maxima and sums.
    float* s_acc = reinterpret_cast<float*>(smem);
    float* s_m = s_acc + WARPS * 16 * EPI_PITCH;
    float* s_l = s_m + WARPS * 16;
#pragma unroll
    for (int n = 0; n < DIM_FRAGS; ++n) {
        wmma::store_matrix_sync(s_acc + warp * 16 * EPI_PITCH + 16 * n, o_frags[n], EPI_PITCH, wmma::mem_row_major);
    }
    if (lane < 16) {
        s_m[warp * 16 + lane] = m;
        s_l[warp * 16 + lane] = l;
    }
    finish_chunk(c, chunk, kv_head, num_kv_heads, s_acc, s_m, s_l, 16, EPI_PITCH, s_acc, out, partial_out,
                 partial_lse, semaphores, merge_in_kernel);
}
