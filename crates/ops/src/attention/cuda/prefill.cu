// Query-tiled causal prefill attention over the paged KV cache (flash-style, CUDA cores,
// online softmax in base 2, f32 math).
//
// Pool layout per side: [num_pages, page_size, num_kv_heads, HEAD_DIM]; the CSR page table
// is FlashInfer's (see attention.cu). One CTA serves one query tile (block_q consecutive
// tokens of ONE request) and one KV head with every query head of its GQA group: the tile's
// BLOCK_ROWS = block_q * group query rows (row = token_in_tile * group + head_in_group) are
// staged in shared memory (pre-scaled by scale_log2), and each K/V tile of BLOCK_KEYS keys
// is read from the pool once and reused by all of them. Key tiles entirely above the causal
// diagonal of the query tile are never visited.
//
// Grid (B + ceil(num_tokens / block_q), num_kv_heads). Slot x belongs to request r when
// base(r) <= x < base(r + 1), base(r) = r + qo_indptr[r] / block_q: request r owns
// ceil(q_len / block_q) <= base(r + 1) - base(r) slots, so the CTA finds its (request, tile)
// by a binary search over qo_indptr and slots past the request's last tile return. Slot x
// also writes zeros for the tokens of [x * block_q, (x + 1) * block_q) that lie outside
// [qo_indptr[0], qo_indptr[B]). Nothing depends on the host beyond the launch arguments, so
// the launch can be captured in a CUDA graph.
//
// Specialisation (from the KernelSpec): PAGODA_HEAD_DIM (multiple of 32, <= 256),
// PAGODA_BLOCK_ROWS (query rows per CTA), PAGODA_BLOCK_KEYS (keys per K/V tile, a power of
// two in 4..64), PAGODA_THREADS (block size). The static_asserts below check the geometry
// and that the static shared memory stays within 48 KiB.
//
// With PAGODA_KV_FP8 (kv_fp8.cu prepended) the pools hold e4m3 bytes and k_scale / v_scale
// ([num_pages * page_size, num_kv_heads] f32) their per-head scales; the tiles are staged
// dequantized (scale * e4m3 value), so everything after the staging is unchanged.
typedef PAGODA_T T;
#if PAGODA_KV_FP8
typedef unsigned char KV_T;
#else
typedef T KV_T;
#endif
#define HEAD_DIM PAGODA_HEAD_DIM
#define BLOCK_ROWS PAGODA_BLOCK_ROWS
#define BLOCK_KEYS PAGODA_BLOCK_KEYS
#define THREADS PAGODA_THREADS
// A chunk is 4 consecutive dims (one float4 in shared memory).
#define CHUNKS (HEAD_DIM / 4)
// Padded f32 pitch of the q/k/v tiles: consecutive rows start 16 bytes apart modulo 128, so
// the float4 reads of 8 consecutive rows hit distinct banks.
#define PITCH (HEAD_DIM + 4)
// Accumulation: thread t owns chunk t % CHUNKS of rows t / CHUNKS + i * ROW_GROUPS.
#define ROW_GROUPS (THREADS / CHUNKS)
#define ROWS_PER_THREAD (BLOCK_ROWS / ROW_GROUPS)
// Softmax: SEGMENT lanes per row, each KEYS_PER_LANE keys; ROWS_PER_WARP rows per warp pass.
#define SEGMENT (BLOCK_KEYS < 32 ? BLOCK_KEYS : 32)
#define KEYS_PER_LANE (BLOCK_KEYS / SEGMENT)
#define ROWS_PER_WARP (32 / SEGMENT)
#define WARPS (THREADS / 32)

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM: multiple of 32, at most 256");
static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS: whole warps");
static_assert(THREADS % CHUNKS == 0, "THREADS must be a multiple of HEAD_DIM / 4");
static_assert(BLOCK_ROWS % ROW_GROUPS == 0, "BLOCK_ROWS must split evenly over row groups");
static_assert(BLOCK_KEYS >= 4 && BLOCK_KEYS <= 64 && (BLOCK_KEYS & (BLOCK_KEYS - 1)) == 0,
              "BLOCK_KEYS: power of two in 4..64");
static_assert(BLOCK_ROWS % ROWS_PER_WARP == 0, "BLOCK_ROWS must fill whole softmax passes");
static_assert(4 * (BLOCK_ROWS * PITCH + 2 * BLOCK_KEYS * PITCH + BLOCK_ROWS * BLOCK_KEYS +
                   3 * BLOCK_ROWS) + 8 * BLOCK_KEYS <= 48 * 1024,
              "static shared memory above 48 KiB");

// Four consecutive elements as f32: one vector load when the address allows it.
PAGODA_DEVICE float4 load_chunk(const float* p) {
    if ((reinterpret_cast<size_t>(p) & 15) == 0) return *reinterpret_cast<const float4*>(p);
    return make_float4(p[0], p[1], p[2], p[3]);
}

PAGODA_DEVICE float4 load_chunk(const __nv_bfloat16* p) {
    if ((reinterpret_cast<size_t>(p) & 7) == 0) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        const float2 low = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 high = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        return make_float4(low.x, low.y, high.x, high.y);
    }
    return make_float4(to_f32(p[0]), to_f32(p[1]), to_f32(p[2]), to_f32(p[3]));
}

// Four consecutive e4m3 bytes (4-byte aligned), dequantized with `scale`.
PAGODA_DEVICE float4 load_chunk_fp8(const unsigned char* p, float scale) {
    const unsigned int word = *reinterpret_cast<const unsigned int*>(p);
    const float2 lo = bf16x2_to_float2(fp8x2_to_bf16x2(__byte_perm(word, 0u, 0x4140)));
    const float2 hi = bf16x2_to_float2(fp8x2_to_bf16x2(__byte_perm(word, 0u, 0x4342)));
    return make_float4(lo.x * scale, lo.y * scale, hi.x * scale, hi.y * scale);
}

PAGODA_DEVICE float segment_max(float value) {
#pragma unroll
    for (int offset = SEGMENT / 2; offset > 0; offset >>= 1) {
        value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    return value;
}

PAGODA_DEVICE float segment_sum(float value) {
#pragma unroll
    for (int offset = SEGMENT / 2; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    return value;
}

// q: token t's head h at q[t * q_row_stride + h * HEAD_DIM]; out: [num_tokens, num_q_heads,
// HEAD_DIM]. Query j of request r (q_len queries, seq_len visible tokens, already appended)
// attends to visible tokens 0 ..= seq_len - q_len + j. Tokens outside qo_indptr's range get
// zeros; q_len > seq_len gets NaN; page ids >= num_pages (or indices past num_indices) are
// skipped. block_q * (num_q_heads / num_kv_heads) <= BLOCK_ROWS, block_q >= 1.
extern "C" __global__ void __launch_bounds__(THREADS) prefill_attention_tiled(
    const T* __restrict__ q, const KV_T* __restrict__ k_pool, const KV_T* __restrict__ v_pool,
    const unsigned int* __restrict__ qo_indptr, const unsigned int* __restrict__ kv_indptr,
    const unsigned int* __restrict__ kv_indices, const unsigned int* __restrict__ last_page_len,
    const unsigned int* __restrict__ first_page_offset, T* __restrict__ out,
    unsigned int num_requests, unsigned int num_tokens, unsigned int num_indices,
    unsigned int num_q_heads, unsigned int num_kv_heads, unsigned int page_size,
    unsigned int num_pages, unsigned int q_row_stride, unsigned int block_q, float scale_log2
#if PAGODA_KV_FP8
    , const float* __restrict__ k_scale, const float* __restrict__ v_scale
#endif
    ) {
    __shared__ __align__(16) float q_tile[BLOCK_ROWS][PITCH];
    __shared__ __align__(16) float k_tile[BLOCK_KEYS][PITCH];
    __shared__ __align__(16) float v_tile[BLOCK_KEYS][PITCH];
    __shared__ __align__(16) float p_tile[BLOCK_ROWS][BLOCK_KEYS];
    __shared__ float row_max[BLOCK_ROWS];
    __shared__ float row_sum[BLOCK_ROWS];
    __shared__ float row_rescale[BLOCK_ROWS];
    __shared__ long long key_rows[BLOCK_KEYS];

    const unsigned int tid = threadIdx.x;
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
    const long long seq_len =
        paged_visible_len(kv_indptr, last_page_len, first_page_offset, r, page_size);
    const bool bad = q_len > seq_len;
    // Row with token_in_tile i sees keys 0 ..= causal_base + i.
    const long long causal_base = seq_len - q_len + q_first;
    const long long kv_end = bad ? 0 : causal_base + tile_tokens;
    const size_t row_elems = (size_t)num_kv_heads * HEAD_DIM;

    // Query tile, scaled; inactive rows are zeros.
    for (unsigned int i = tid; i < BLOCK_ROWS * CHUNKS; i += THREADS) {
        const unsigned int row = i / CHUNKS;
        const unsigned int chunk = i % CHUNKS;
        float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const long long token = token0 + row / group;
        if ((int)row < active_rows && token < (long long)num_tokens) {
            const unsigned int q_head = kv_head * group + row % group;
            value = load_chunk(q + (size_t)token * q_row_stride + (size_t)q_head * HEAD_DIM +
                               chunk * 4);
            value.x *= scale_log2;
            value.y *= scale_log2;
            value.z *= scale_log2;
            value.w *= scale_log2;
        }
        *reinterpret_cast<float4*>(&q_tile[row][chunk * 4]) = value;
    }
    for (unsigned int row = tid; row < BLOCK_ROWS; row += THREADS) {
        row_max[row] = -INFINITY;
        row_sum[row] = 0.0f;
    }
    __syncthreads();

    const unsigned int my_chunk = tid % CHUNKS;
    const unsigned int row_group = tid / CHUNKS;
    float acc[ROWS_PER_THREAD][4];
#pragma unroll
    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    }
    const unsigned long long page_base = kv_indptr[r];
    const long long first_offset = first_page_offset[r];
    const unsigned int warp = tid / 32;
    const unsigned int lane = tid % 32;
    const unsigned int sub = lane % SEGMENT;

    for (long long start = 0; start < kv_end; start += BLOCK_KEYS) {
        __syncthreads();  // the previous tile's readers are done with key_rows/k/v/p
        for (unsigned int key = tid; key < BLOCK_KEYS; key += THREADS) {
            long long row = -1;
            if (start + key < kv_end) {
                const long long logical = first_offset + start + key;
                const unsigned long long index = page_base + (unsigned long long)(logical / page_size);
                if (index < num_indices) {
                    const unsigned int page = kv_indices[index];
                    if (page < num_pages) row = (long long)page * page_size + logical % page_size;
                }
            }
            key_rows[key] = row;
        }
        __syncthreads();
        for (unsigned int i = tid; i < BLOCK_KEYS * CHUNKS; i += THREADS) {
            const unsigned int key = i / CHUNKS;
            const unsigned int chunk = i % CHUNKS;
            const long long row = key_rows[key];
            float4 k_value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float4 v_value = k_value;
            if (row >= 0) {
                const size_t offset = (size_t)row * row_elems + (size_t)kv_head * HEAD_DIM + chunk * 4;
#if PAGODA_KV_FP8
                const size_t head_row = (size_t)row * num_kv_heads + kv_head;
                k_value = load_chunk_fp8(k_pool + offset, k_scale[head_row]);
                v_value = load_chunk_fp8(v_pool + offset, v_scale[head_row]);
#else
                k_value = load_chunk(k_pool + offset);
                v_value = load_chunk(v_pool + offset);
#endif
            }
            *reinterpret_cast<float4*>(&k_tile[key][chunk * 4]) = k_value;
            *reinterpret_cast<float4*>(&v_tile[key][chunk * 4]) = v_value;
        }
        __syncthreads();

        // Scores (base-2 logits); masked entries are -inf.
        for (unsigned int i = tid; i < BLOCK_ROWS * BLOCK_KEYS; i += THREADS) {
            const unsigned int row = i / BLOCK_KEYS;
            const unsigned int key = i % BLOCK_KEYS;
            float score = -INFINITY;
            if ((int)row < active_rows && key_rows[key] >= 0 &&
                start + key <= causal_base + row / group) {
                const float4* q_row = reinterpret_cast<const float4*>(&q_tile[row][0]);
                const float4* k_row = reinterpret_cast<const float4*>(&k_tile[key][0]);
                float dot0 = 0.0f, dot1 = 0.0f;
#pragma unroll 8
                for (int c = 0; c < CHUNKS; ++c) {
                    const float4 a = q_row[c];
                    const float4 b = k_row[c];
                    dot0 = fmaf(a.x, b.x, dot0);
                    dot1 = fmaf(a.y, b.y, dot1);
                    dot0 = fmaf(a.z, b.z, dot0);
                    dot1 = fmaf(a.w, b.w, dot1);
                }
                score = dot0 + dot1;
            }
            p_tile[row][key] = score;
        }
        __syncthreads();

        // Online softmax per row: SEGMENT lanes per row; rescale factor into row_rescale.
        for (unsigned int pass = warp * ROWS_PER_WARP; pass < BLOCK_ROWS;
             pass += WARPS * ROWS_PER_WARP) {
            const unsigned int row = pass + lane / SEGMENT;
            float scores[KEYS_PER_LANE];
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < KEYS_PER_LANE; ++j) {
                scores[j] = p_tile[row][sub + j * SEGMENT];
                tile_max = fmaxf(tile_max, scores[j]);
            }
            tile_max = segment_max(tile_max);
            const float old_max = row_max[row];
            const float new_max = fmaxf(old_max, tile_max);
            float rescale = 1.0f;
            float sum = 0.0f;
            if (new_max != -INFINITY) {
                rescale = exp2f(old_max - new_max);
#pragma unroll
                for (int j = 0; j < KEYS_PER_LANE; ++j) {
                    const float weight = exp2f(scores[j] - new_max);
                    p_tile[row][sub + j * SEGMENT] = weight;
                    sum += weight;
                }
            } else {
#pragma unroll
                for (int j = 0; j < KEYS_PER_LANE; ++j) p_tile[row][sub + j * SEGMENT] = 0.0f;
            }
            sum = segment_sum(sum);
            const float old_sum = row_sum[row];
            __syncwarp();
            if (sub == 0) {
                row_max[row] = new_max;
                row_sum[row] = old_sum * rescale + sum;
                row_rescale[row] = rescale;
            }
        }
        __syncthreads();

        // acc = acc * rescale + P V for the thread's rows and chunk.
#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i) {
            const float rescale = row_rescale[row_group + i * ROW_GROUPS];
            acc[i][0] *= rescale;
            acc[i][1] *= rescale;
            acc[i][2] *= rescale;
            acc[i][3] *= rescale;
        }
#pragma unroll 2
        for (int key = 0; key < BLOCK_KEYS; key += 4) {
            float4 v_values[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                v_values[j] = *reinterpret_cast<const float4*>(&v_tile[key + j][my_chunk * 4]);
            }
#pragma unroll
            for (int i = 0; i < ROWS_PER_THREAD; ++i) {
                const float4 p = *reinterpret_cast<const float4*>(
                    &p_tile[row_group + i * ROW_GROUPS][key]);
                const float weights[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[i][0] = fmaf(weights[j], v_values[j].x, acc[i][0]);
                    acc[i][1] = fmaf(weights[j], v_values[j].y, acc[i][1]);
                    acc[i][2] = fmaf(weights[j], v_values[j].z, acc[i][2]);
                    acc[i][3] = fmaf(weights[j], v_values[j].w, acc[i][3]);
                }
            }
        }
    }

    // Normalise and store the thread's rows (row_sum is final: a barrier followed its last write).
#pragma unroll
    for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        const unsigned int row = row_group + i * ROW_GROUPS;
        const long long token = token0 + row / group;
        if ((int)row >= active_rows || token >= (long long)num_tokens) continue;
        const unsigned int q_head = kv_head * group + row % group;
        const float total = row_sum[row];
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        T* destination = out + (size_t)token * out_token_elems + (size_t)q_head * HEAD_DIM +
                         my_chunk * 4;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            destination[j] = from_f32<T>(bad ? quiet_nan() : acc[i][j] * inverse);
        }
    }
}
