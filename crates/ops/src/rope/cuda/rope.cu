// Rotary position embedding, in place on x [num_tokens, num_heads, head_dim] whose token
// rows are `row_stride` elements apart (so it can run inside a fused QKV buffer).
// Pair i (of rope_dim / 2) rotates by positions[t] * inv_freq[i] (f32 angle, sincosf).
// PAGODA_ROPE_HALVES: 0 pairs (2i, 2i+1) (GGUF llama), 1 pairs (i, i + rope_dim/2) (NeoX/HF).
// Llama-3 scaling lives in inv_freq, which the host precomputes.
typedef PAGODA_T T;

// Thread t of a token's block owns pair i = t % half of heads t / half, t / half + heads_per_pass,
// ...: the angle's sincos is computed once per (token, pair) and reused for every head it
// rotates (q and k heads can run in one launch: k follows q in a fused QKV row).
extern "C" __global__ void rope(T* __restrict__ x, const unsigned int* __restrict__ positions,
                                const float* __restrict__ inv_freq, unsigned int num_heads,
                                unsigned int head_dim, unsigned int rope_dim,
                                unsigned int row_stride) {
    const unsigned int token = blockIdx.x;
    const unsigned int half = rope_dim / 2;
    const unsigned int heads_per_pass = blockDim.x / half;
    const unsigned int i = threadIdx.x % half;
    const unsigned int first_head = threadIdx.x / half;
    if (first_head >= heads_per_pass) return;  // the block's last partial group of pairs
    const float position = (float)positions[token];
    float s, c;
    sincosf(position * inv_freq[i], &s, &c);
#if PAGODA_ROPE_HALVES
    const unsigned int a = i, b = i + half;
#else
    const unsigned int a = 2 * i, b = 2 * i + 1;
#endif
    T* row = x + (size_t)token * row_stride;
#pragma unroll 4
    for (unsigned int head = first_head; head < num_heads; head += heads_per_pass) {
        T* h = row + (size_t)head * head_dim;
        const float x0 = to_f32(h[a]);
        const float x1 = to_f32(h[b]);
        h[a] = from_f32<T>(x0 * c - x1 * s);
        h[b] = from_f32<T>(x0 * s + x1 * c);
    }
}
