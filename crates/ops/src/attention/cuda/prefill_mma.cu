// Query-tiled causal prefill attention over the paged KV cache on tensor cores
// (FlashAttention-2 style, bf16 operands, f32 accumulators, online softmax in base 2).
//
// Same contract, grid and slot mapping as prefill_attention_tiled (prefill.cu): pool layout
// per side [num_pages, page_size, num_kv_heads, HEAD_DIM], FlashInfer's CSR page table, one
// CTA per (query tile of ONE request, KV head). The tile's BLOCK_ROWS = block_q * group query
// rows (row = token_in_tile * group + head_in_group) are split over WARPS = BLOCK_ROWS / 16
// warps, warp w owning rows 16w .. 16w + 15. Per K/V tile of BLOCK_KEYS keys (staged in
// shared memory as bf16, rows gathered through the page table):
//   1. S = Q K^T with WMMA 16x16x16 bf16 fragments, f32 accumulators, stored to the warp's
//      f32 scratch S_w [16][BLOCK_KEYS];
//   2. the warp's lanes (4 per row, 8 rows per pass, 2 passes) mask (validity, causal),
//      scale by scale_log2, run the online softmax, write P (bf16) to P_w and the per-row
//      rescale factor exp2(m_old - m_new) to rescale_rows;
//   3. O (WMMA accumulators held in registers) is multiplied row-wise by the factor, then
//      O += P V with WMMA.
// The element -> row mapping of an accumulator fragment is not documented, so each warp
// discovers it once: it loads a 16x16 matrix whose entry (r, c) is r into an accumulator
// fragment and reads back, per lane, the row of each element (load_matrix_sync, mma_sync and
// store_matrix_sync all use that same mapping for the fragment type). The epilogue stores O
// to shared memory and normalises by the row sums with a known layout.
//
// Key tiles above the query tile's causal diagonal are never visited; a warp whose rows are
// all inactive or above the diagonal of a tile skips it. Edge rules as in prefill.cu.
//
// Specialisation: PAGODA_T (__nv_bfloat16 only), PAGODA_HEAD_DIM (multiple of 16),
// PAGODA_BLOCK_ROWS (multiple of 16: rows per CTA, 2 * BLOCK_ROWS threads), PAGODA_BLOCK_KEYS
// (multiple of 16, at most 64). All shared memory is static and within 48 KiB (asserted).
#include <mma.h>

typedef PAGODA_T T;
static_assert(sizeof(T) == 2, "prefill_attention_mma is bf16 only");

namespace mma_prefill {
using namespace nvcuda;

constexpr int HEAD_DIM = PAGODA_HEAD_DIM;
constexpr int BLOCK_ROWS = PAGODA_BLOCK_ROWS;
constexpr int BLOCK_KEYS = PAGODA_BLOCK_KEYS;
constexpr int WARPS = BLOCK_ROWS / 16;
constexpr int THREADS = WARPS * 32;
// Q fragments stay in registers for the whole key loop (and the Q tile's shared memory is
// reused for S and P) up to HEAD_DIM 128; beyond, they are reloaded from shared memory.
constexpr bool Q_IN_REGISTERS = HEAD_DIM <= 128;
constexpr int DIM_FRAGS = HEAD_DIM / 16;
constexpr int KEY_FRAGS = BLOCK_KEYS / 16;
// Pitches (elements): bf16 rows padded by 16 bytes, f32 rows by 16 bytes, so that the rows
// of a fragment start in distinct 16-byte bank groups; every pitch is a multiple of 16 bytes
// (WMMA's ldm rule) and 16 rows of any pitch are a multiple of 32 bytes (fragment pointers
// stay 256-bit aligned).
constexpr int KV_PITCH = HEAD_DIM + 8;
constexpr int Q_PITCH = HEAD_DIM + 8;
constexpr int S_PITCH = BLOCK_KEYS + 4;
constexpr int P_PITCH = BLOCK_KEYS + 8;
constexpr int O_PITCH = HEAD_DIM + 4;
// 16-byte chunks (8 bf16) per head row.
constexpr int ROW_CHUNKS = HEAD_DIM / 8;
constexpr int KV_CHUNKS_PER_THREAD = BLOCK_KEYS * ROW_CHUNKS / THREADS;

__host__ __device__ constexpr int align128(int bytes) { return (bytes + 127) / 128 * 128; }
__host__ __device__ constexpr int max_int(int a, int b) { return a > b ? a : b; }

constexpr int K_BYTES = align128(BLOCK_KEYS * KV_PITCH * 2);
constexpr int Q_BYTES = align128(BLOCK_ROWS * Q_PITCH * 2);
constexpr int S_BYTES = align128(BLOCK_ROWS * S_PITCH * 4);
constexpr int P_BYTES = align128(BLOCK_ROWS * P_PITCH * 2);
constexpr int OFF_K = 0;
constexpr int OFF_V = K_BYTES;
constexpr int OFF_Q = 2 * K_BYTES;
constexpr int OFF_S = Q_IN_REGISTERS ? OFF_Q : OFF_Q + Q_BYTES;
constexpr int OFF_P = OFF_S + S_BYTES;
constexpr int MAIN_BYTES = max_int(OFF_Q + Q_BYTES, OFF_P + P_BYTES);
// Epilogue: O as f32 [BLOCK_ROWS][O_PITCH] over the whole tile area.
constexpr int O_BYTES = BLOCK_ROWS * O_PITCH * 4;
constexpr int TILE_BYTES = max_int(MAIN_BYTES, O_BYTES);
constexpr int SMALL_BYTES = 4 * BLOCK_ROWS * 2 + 8 * BLOCK_KEYS + 8;

static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "HEAD_DIM: multiple of 16, at most 256");
static_assert(BLOCK_ROWS % 16 == 0 && BLOCK_ROWS >= 32 && BLOCK_ROWS <= 128,
              "BLOCK_ROWS: multiple of 16 in 32..128 (warps 0 and 1 build the key mask)");
static_assert(BLOCK_KEYS % 16 == 0 && BLOCK_KEYS <= 64, "BLOCK_KEYS: multiple of 16, <= 64");
static_assert(BLOCK_KEYS * ROW_CHUNKS % THREADS == 0, "K/V chunks must split over threads");
static_assert(4 * WARPS * 256 <= K_BYTES, "row-map scratch must fit in the K tile");
static_assert(TILE_BYTES + SMALL_BYTES <= 48 * 1024, "static shared memory above 48 KiB");

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> FragKt;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> FragV;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragAcc;

// Is key `key` (0 .. BLOCK_KEYS) of the current tile backed by a readable pool row?
PAGODA_DEVICE bool key_valid(unsigned int mask0, unsigned int mask1, int key) {
    return (((key < 32 ? mask0 : mask1) >> (key & 31)) & 1u) != 0;
}
}  // namespace mma_prefill

// q: token t's head h at q[t * q_row_stride + h * HEAD_DIM]; out: [num_tokens, num_q_heads,
// HEAD_DIM]. Query j of request r (q_len queries, seq_len visible tokens, already appended)
// attends to visible tokens 0 ..= seq_len - q_len + j. block_q = BLOCK_ROWS / group >= 1.
extern "C" __global__ void __launch_bounds__(mma_prefill::THREADS) prefill_attention_mma(
    const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
    const unsigned int* __restrict__ qo_indptr, const unsigned int* __restrict__ kv_indptr,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, T* __restrict__ out,
    unsigned int num_requests, unsigned int num_tokens, unsigned int num_indices,
    unsigned int num_q_heads, unsigned int num_kv_heads, unsigned int page_size,
    unsigned int num_pages, unsigned int q_row_stride, unsigned int block_q, float scale_log2) {
    using namespace mma_prefill;
    __shared__ __align__(128) unsigned char tile_memory[TILE_BYTES];
    __shared__ float rescale_rows[BLOCK_ROWS];
    __shared__ float row_sums[BLOCK_ROWS];
    __shared__ long long key_rows[BLOCK_KEYS];
    __shared__ unsigned int key_mask[2];

    __nv_bfloat16* const k_tile = reinterpret_cast<__nv_bfloat16*>(tile_memory + OFF_K);
    __nv_bfloat16* const v_tile = reinterpret_cast<__nv_bfloat16*>(tile_memory + OFF_V);
    __nv_bfloat16* const q_tile = reinterpret_cast<__nv_bfloat16*>(tile_memory + OFF_Q);

    const unsigned int tid = threadIdx.x;
    const int warp = (int)(tid / 32);
    const int lane = (int)(tid % 32);
    const unsigned int kv_head = blockIdx.y;
    const unsigned int slot = blockIdx.x;
    const unsigned int group = num_q_heads / num_kv_heads;
    const size_t out_token_elems = (size_t)num_q_heads * HEAD_DIM;
    const size_t group_elems = (size_t)group * HEAD_DIM;

    // Zeros for this slot's token window where it lies outside [qo_indptr[0], qo_indptr[B]).
    prefill_zero_window(out, qo_indptr, num_requests, num_tokens, slot, block_q, kv_head,
                        group_elems, out_token_elems);

    // This slot's request and tile (uniform over the CTA).
    unsigned int r;
    long long tile;
    if (!prefill_slot_tile(qo_indptr, num_requests, slot, block_q, r, tile)) return;
    const long long q_len = (long long)qo_indptr[r + 1] - (long long)qo_indptr[r];
    const long long q_first = tile * block_q;  // first query of the tile within the request
    if (q_first >= q_len) return;
    const int tile_tokens = (int)min((long long)block_q, q_len - q_first);
    const long long token0 = (long long)qo_indptr[r] + q_first;
    const int active_rows = tile_tokens * (int)group;
    const long long seq_len = paged_visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size);
    const bool bad = q_len > seq_len;
    // Row with token_in_tile i sees keys 0 ..= causal_base + i.
    const long long causal_base = seq_len - q_len + q_first;
    const long long kv_end = bad ? 0 : causal_base + tile_tokens;
    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;

    // Row map of an accumulator fragment: row_of[i] is the row (0..15) of element i.
    int row_of[FragAcc::num_elements];
    {
        float* scratch = reinterpret_cast<float*>(tile_memory + OFF_K) + warp * 256;
        for (int i = lane; i < 256; i += 32) scratch[i] = (float)(i / 16);
        __syncwarp();
        FragAcc map;
        wmma::load_matrix_sync(map, scratch, 16, wmma::mem_row_major);
#pragma unroll
        for (int i = 0; i < FragAcc::num_elements; ++i) row_of[i] = (int)map.x[i];
    }

    // Query tile as bf16 (unscaled); inactive rows are zeros.
    for (unsigned int i = tid; i < BLOCK_ROWS * ROW_CHUNKS; i += THREADS) {
        const unsigned int row = i / ROW_CHUNKS;
        const unsigned int chunk = i % ROW_CHUNKS;
        uint4 value = make_uint4(0u, 0u, 0u, 0u);
        const long long token = token0 + row / group;
        if ((int)row < active_rows && token < (long long)num_tokens && !bad) {
            const unsigned int q_head = kv_head * group + row % group;
            value = load_bf16x8(q + (size_t)token * q_row_stride + (size_t)q_head * HEAD_DIM + chunk * 8);
        }
        *reinterpret_cast<uint4*>(&q_tile[row * Q_PITCH + chunk * 8]) = value;
    }
    __syncthreads();

    FragA q_frags[Q_IN_REGISTERS ? DIM_FRAGS : 1];
    if constexpr (Q_IN_REGISTERS) {
#pragma unroll
        for (int k = 0; k < DIM_FRAGS; ++k) {
            wmma::load_matrix_sync(q_frags[k], q_tile + warp * 16 * Q_PITCH + k * 16, Q_PITCH);
        }
    }

    FragAcc o_frags[DIM_FRAGS];
#pragma unroll
    for (int n = 0; n < DIM_FRAGS; ++n) wmma::fill_fragment(o_frags[n], 0.0f);

    // Online-softmax state of the two rows this lane serves (passes 0 and 1), replicated
    // over the 4 lanes of the row.
    float running_max[2] = {-INFINITY, -INFINITY};
    float running_sum[2] = {0.0f, 0.0f};
    const int sub = lane & 3;
    float* const s_warp = reinterpret_cast<float*>(tile_memory + OFF_S) + warp * 16 * S_PITCH;
    __nv_bfloat16* const p_warp =
        reinterpret_cast<__nv_bfloat16*>(tile_memory + OFF_P) + warp * 16 * P_PITCH;
    const int warp_first_row = warp * 16;
    const bool warp_active = warp_first_row < active_rows;
    const long long warp_last_token =
        warp_active ? (long long)(min(warp_first_row + 15, active_rows - 1) / (int)group) : 0;

    const unsigned long long page_base = kv_indptr[r];
    const long long first_offset = first_page_offset[r];

    for (long long start = 0; start < kv_end; start += BLOCK_KEYS) {
        __syncthreads();  // previous readers of key_rows / K / V / S / P (and Q) are done
        {
            long long row = -1;
            if (tid < (unsigned int)BLOCK_KEYS && start + tid < kv_end) {
                const long long logical = first_offset + start + tid;
                const unsigned long long index =
                    page_base + (unsigned long long)(logical / page_size);
                if (index < num_indices) {
                    const unsigned int page = kv_indices[index];
                    if (page < num_pages) row = (long long)page * page_size + logical % page_size;
                }
            }
            if (tid < (unsigned int)BLOCK_KEYS) key_rows[tid] = row;
            if (warp < 2) {
                const unsigned int bits = __ballot_sync(0xffffffffu, row >= 0);
                if (lane == 0) key_mask[warp] = bits;
            }
        }
        __syncthreads();
        {
            uint4 k_values[KV_CHUNKS_PER_THREAD];
            uint4 v_values[KV_CHUNKS_PER_THREAD];
#pragma unroll
            for (int c = 0; c < KV_CHUNKS_PER_THREAD; ++c) {
                const int i = (int)tid + c * THREADS;
                const int key = i / ROW_CHUNKS;
                const int chunk = i % ROW_CHUNKS;
                const long long row = key_rows[key];
                k_values[c] = make_uint4(0u, 0u, 0u, 0u);
                v_values[c] = k_values[c];
                if (row >= 0) {
                    const size_t offset =
                        (size_t)row * row_elems + (size_t)kv_head * HEAD_DIM + chunk * 8;
                    k_values[c] = load_bf16x8(k_pool + offset);
                    v_values[c] = load_bf16x8(v_pool + offset);
                }
            }
#pragma unroll
            for (int c = 0; c < KV_CHUNKS_PER_THREAD; ++c) {
                const int i = (int)tid + c * THREADS;
                const int key = i / ROW_CHUNKS;
                const int chunk = i % ROW_CHUNKS;
                *reinterpret_cast<uint4*>(&k_tile[key * KV_PITCH + chunk * 8]) = k_values[c];
                *reinterpret_cast<uint4*>(&v_tile[key * KV_PITCH + chunk * 8]) = v_values[c];
            }
        }
        __syncthreads();
        // Warp-uniform: nothing to do when every row is inactive or above this tile.
        if (!warp_active || start > causal_base + warp_last_token) continue;
        const unsigned int mask0 = key_mask[0];
        const unsigned int mask1 = key_mask[1];

        // 1. S = Q K^T for the warp's 16 rows.
#pragma unroll
        for (int n = 0; n < KEY_FRAGS; ++n) {
            FragAcc s_frag;
            wmma::fill_fragment(s_frag, 0.0f);
#pragma unroll
            for (int k = 0; k < DIM_FRAGS; ++k) {
                FragKt k_frag;
                wmma::load_matrix_sync(k_frag, k_tile + n * 16 * KV_PITCH + k * 16, KV_PITCH);
                if constexpr (Q_IN_REGISTERS) {
                    wmma::mma_sync(s_frag, q_frags[k], k_frag, s_frag);
                } else {
                    FragA q_frag;
                    wmma::load_matrix_sync(q_frag, q_tile + warp * 16 * Q_PITCH + k * 16, Q_PITCH);
                    wmma::mma_sync(s_frag, q_frag, k_frag, s_frag);
                }
            }
            wmma::store_matrix_sync(s_warp + n * 16, s_frag, S_PITCH, wmma::mem_row_major);
        }
        __syncwarp();

        // 2. Masking and online softmax: 4 lanes per row, 8 rows per pass.
#pragma unroll
        for (int pass = 0; pass < 2; ++pass) {
            const int local_row = pass * 8 + lane / 4;
            const int row = warp_first_row + local_row;
            int limit = -1;  // last visible key of the tile for this row
            if (row < active_rows) {
                const long long last = causal_base + row / (int)group - start;
                limit = (int)max(-1LL, min(last, (long long)BLOCK_KEYS - 1));
            }
            float scores[KEY_FRAGS][4];
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < KEY_FRAGS; ++j) {
                const int chunk = sub + 4 * j;  // keys 4 * chunk .. 4 * chunk + 3
                const float4 raw =
                    *reinterpret_cast<const float4*>(s_warp + local_row * S_PITCH + chunk * 4);
                const float values[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = chunk * 4 + e;
                    const bool visible = key <= limit && key_valid(mask0, mask1, key);
                    scores[j][e] = visible ? values[e] * scale_log2 : -INFINITY;
                    tile_max = fmaxf(tile_max, scores[j][e]);
                }
            }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float new_max = fmaxf(running_max[pass], tile_max);
            float factor = 1.0f;
            float sum = 0.0f;
            const bool any = new_max != -INFINITY;
            if (any) factor = exp2f(running_max[pass] - new_max);
#pragma unroll
            for (int j = 0; j < KEY_FRAGS; ++j) {
                const int chunk = sub + 4 * j;
                __nv_bfloat16 weights[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    weights[e] = __float2bfloat16_rn(any ? exp2f(scores[j][e] - new_max) : 0.0f);
                    sum += __bfloat162float(weights[e]);
                }
                __nv_bfloat162 pair0, pair1;
                pair0.x = weights[0];
                pair0.y = weights[1];
                pair1.x = weights[2];
                pair1.y = weights[3];
                uint2 packed;
                packed.x = *reinterpret_cast<const unsigned int*>(&pair0);
                packed.y = *reinterpret_cast<const unsigned int*>(&pair1);
                *reinterpret_cast<uint2*>(p_warp + local_row * P_PITCH + chunk * 4) = packed;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            running_sum[pass] = running_sum[pass] * factor + sum;
            running_max[pass] = new_max;
            if (sub == 0) rescale_rows[row] = factor;
        }
        __syncwarp();

        // 3. O = O * factor (row-wise, through the discovered row map) + P V.
        {
            float factors[FragAcc::num_elements];
#pragma unroll
            for (int i = 0; i < FragAcc::num_elements; ++i) {
                factors[i] = rescale_rows[warp_first_row + row_of[i]];
            }
#pragma unroll
            for (int n = 0; n < DIM_FRAGS; ++n) {
#pragma unroll
                for (int i = 0; i < FragAcc::num_elements; ++i) o_frags[n].x[i] *= factors[i];
            }
            FragA p_frags[KEY_FRAGS];
#pragma unroll
            for (int k = 0; k < KEY_FRAGS; ++k) {
                wmma::load_matrix_sync(p_frags[k], p_warp + k * 16, P_PITCH);
            }
#pragma unroll
            for (int n = 0; n < DIM_FRAGS; ++n) {
#pragma unroll
                for (int k = 0; k < KEY_FRAGS; ++k) {
                    FragV v_frag;
                    wmma::load_matrix_sync(v_frag, v_tile + k * 16 * KV_PITCH + n * 16, KV_PITCH);
                    wmma::mma_sync(o_frags[n], p_frags[k], v_frag, o_frags[n]);
                }
            }
        }
    }

    // Epilogue: O through shared memory (f32), normalised by the row sums, stored as bf16.
    __syncthreads();  // every warp is done with the K / V / S / P areas
    float* const o_tile = reinterpret_cast<float*>(tile_memory);
    if (sub == 0) {
        row_sums[warp_first_row + lane / 4] = running_sum[0];
        row_sums[warp_first_row + 8 + lane / 4] = running_sum[1];
    }
#pragma unroll
    for (int n = 0; n < DIM_FRAGS; ++n) {
        wmma::store_matrix_sync(o_tile + warp_first_row * O_PITCH + n * 16, o_frags[n], O_PITCH,
                                wmma::mem_row_major);
    }
    __syncwarp();
    for (int i = lane; i < 16 * (HEAD_DIM / 2); i += 32) {
        const int local_row = i / (HEAD_DIM / 2);
        const int column = (i % (HEAD_DIM / 2)) * 2;
        const int row = warp_first_row + local_row;
        const long long token = token0 + row / (int)group;
        if (row >= active_rows || token >= (long long)num_tokens) continue;
        const unsigned int q_head = kv_head * group + row % group;
        const float total = row_sums[row];
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        const float2 value = *reinterpret_cast<const float2*>(o_tile + row * O_PITCH + column);
        const float x = bad ? quiet_nan() : value.x * inverse;
        const float y = bad ? quiet_nan() : value.y * inverse;
        T* destination =
            out + (size_t)token * out_token_elems + (size_t)q_head * HEAD_DIM + column;
        if ((reinterpret_cast<size_t>(destination) & 3) == 0) {
            *reinterpret_cast<__nv_bfloat162*>(destination) = __floats2bfloat162_rn(x, y);
        } else {
            destination[0] = __float2bfloat16_rn(x);
            destination[1] = __float2bfloat16_rn(y);
        }
    }
}
