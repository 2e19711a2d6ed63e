// Shared by the MLA (DeepSeek's multi-head latent attention) kernels, prepended after
// tensor_core.cu: the latent row geometry, the chunk a CTA serves and the cp.async tile loader.
//
// The latent pool is [num_pages, page_size, 1, ROW_DIM]: one row per token, the normed
// compressed latent c (LATENT_DIM) then the rotated decoupled RoPE key (ROPE_DIM), addressed
// through the CSR page table of the paged KV cache (page_size a power of two). Queries arrive
// absorbed: per head [W_UK^T q_nope (LATENT_DIM), q_rope (ROPE_DIM)], so a score is one
// ROW_DIM-wide dot with the row and the output is the softmax-weighted sum of c (LATENT_DIM
// per head). Softmax in base 2 (scale_log2 = scale * log2 e), as every decode of pagoda.
//
// Query heads are served in tiles of HEAD_TILE: a CTA serves (chunk, head tile), so every
// latent row it loads is used by HEAD_TILE heads; the head tiles of one chunk are neighbours
// in the grid (blockIdx.x = chunk * head_tiles + tile), so the other tiles find the rows in L2.
typedef PAGODA_T T;
#define LATENT_DIM PAGODA_LATENT_DIM
#define ROPE_DIM PAGODA_ROPE_DIM
#define ROW_DIM (LATENT_DIM + ROPE_DIM)
#define ROW_BYTES (ROW_DIM * (int)sizeof(T))
#define HEAD_TILE 16
#define MLA_PLAN_HEADER 4

static_assert(LATENT_DIM % 64 == 0 && ROPE_DIM % 32 == 0, "latent and rope dims");
static_assert(ROW_BYTES % 16 == 0, "a latent row is whole 16-byte chunks");

// Keys key_begin .. key_end of request r (0 = its first visible token, which sits at row fpo
// of its first page, indices[page_begin]); the request's chunks are first .. first + count
// in the plan's o_indptr.
struct LatentChunk {
    unsigned int r, first, count, page_begin;
    long long fpo, key_begin, key_end;
};

// Chunk `chunk` of the decode plan (decode_plan.rs: header, request_indices, kv_tile_indices,
// o_indptr); false when the CTA has nothing to do.
PAGODA_DEVICE bool load_latent_chunk(const unsigned int* plan, unsigned int chunk,
                                     unsigned int max_chunks, unsigned int num_requests,
                                     const unsigned int* kv_indptr, const unsigned int* last_page_len,
                                     const unsigned int* first_page_offset, unsigned int page_shift,
                                     LatentChunk& c) {
    if (chunk >= plan[0]) return false;
    const unsigned int pages_per_chunk = plan[1];
    c.r = plan[MLA_PLAN_HEADER + chunk];
    const unsigned int tile = plan[MLA_PLAN_HEADER + max_chunks + chunk];
    if (c.r >= num_requests) return false;
    const unsigned int* o_indptr = plan + MLA_PLAN_HEADER + 2 * max_chunks;
    c.first = o_indptr[c.r];
    c.count = o_indptr[c.r + 1] - c.first;
    const unsigned int page_size = 1u << page_shift;
    c.page_begin = kv_indptr[c.r];
    const long long pages = (long long)kv_indptr[c.r + 1] - (long long)c.page_begin;
    const long long seq_len =
        max(0LL, paged_visible_len(kv_indptr, last_page_len, first_page_offset, c.r, page_size));
    c.fpo = pages > 0 ? (long long)first_page_offset[c.r] : 0;
    const long long chunk_page = (long long)tile * pages_per_chunk;
    c.key_begin = max(0LL, chunk_page * page_size - c.fpo);
    c.key_end = min(seq_len, (chunk_page + pages_per_chunk) * page_size - c.fpo);
    return true;
}

// Queues the cp.async copies of keys first_key .. first_key + tile_keys: key i lands at
// dst + i * pitch_bytes, valid[i] says whether it was readable (before key_end, on a page
// < num_pages); unreadable rows are zero-filled. `threads` threads of the CTA take part.
PAGODA_DEVICE void issue_latent_tile(const LatentChunk& c, const unsigned int* kv_indices, const T* pool,
                                     long long first_key, int tile_keys, unsigned int page_shift,
                                     unsigned int num_pages, unsigned char* dst, int pitch_bytes,
                                     unsigned char* valid, int threads) {
    constexpr int ROW_CHUNKS = ROW_BYTES / 16;
    for (int i = threadIdx.x; i < tile_keys * ROW_CHUNKS; i += threads) {
        const int key_local = i / ROW_CHUNKS;
        const int part = i % ROW_CHUNKS;
        const long long key = first_key + key_local;
        bool readable = key < c.key_end;
        size_t offset = 0;
        if (readable) {
            const long long abs = c.fpo + key;
            const unsigned int page = kv_indices[c.page_begin + (unsigned int)(abs >> page_shift)];
            readable = page < num_pages;
            const size_t row = ((size_t)page << page_shift) + (size_t)(abs & ((1ll << page_shift) - 1));
            if (readable) offset = row * ROW_BYTES;
        }
        cp_async16(dst + (size_t)key_local * pitch_bytes + part * 16,
                   reinterpret_cast<const unsigned char*>(pool) + offset + part * 16, readable);
        if (part == 0) valid[key_local] = readable;
    }
}

// Writes one head's normalised output (or partial) element: a request of one chunk gets
// `out` directly, otherwise the chunk's partial and (for d == 0) its base-2 log-sum-exp.
PAGODA_DEVICE void store_latent_output(const LatentChunk& c, unsigned int chunk, unsigned int num_heads,
                                       unsigned int head, unsigned int d, float value, float m, float l,
                                       T* out, float* partial_out, float* partial_lse) {
    const float normalised = l > 0.0f ? value / l : 0.0f;
    if (c.count == 1) {
        out[((size_t)c.r * num_heads + head) * LATENT_DIM + d] = from_f32<T>(normalised);
    } else {
        const size_t row = (size_t)chunk * num_heads + head;
        partial_out[row * LATENT_DIM + d] = normalised;
        if (d == 0) partial_lse[row] = l > 0.0f ? m + __log2f(l) : -INFINITY;
    }
}
