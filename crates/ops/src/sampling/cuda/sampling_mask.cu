
// Token masks of structured output, applied to the logits before the sampler runs: bit
// (v % 32) of word (v / 32) of a mask is set when token v is allowed. Mask m belongs to logits
// row mask_rows[m]; every token its mask does not allow (and every id past the mask's words)
// becomes NaN, which every sampling kernel treats as masked. One thread per token: the 32
// threads of a warp share one mask word, and their writes are coalesced.
extern "C" __global__ void sampling_token_mask(float* __restrict__ logits,
                                               const unsigned int* __restrict__ masks,
                                               const unsigned int* __restrict__ mask_rows,
                                               unsigned int vocab, unsigned int words) {
    const unsigned int v = blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= vocab) return;
    const unsigned int m = blockIdx.y;
    const unsigned int word = (v >> 5) < words ? masks[(size_t)m * words + (v >> 5)] : 0u;
    if (!((word >> (v & 31u)) & 1u)) {
        logits[(size_t)mask_rows[m] * vocab + v] = __int_as_float(0x7fc00000);
    }
}
