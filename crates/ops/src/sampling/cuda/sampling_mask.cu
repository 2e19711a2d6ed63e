// Token masks of structured output, applied to the logits before the sampler runs: bit
// (v % 32) of word (v / 32) of a mask is set when token v is allowed. Mask m belongs to logits
// row mask_rows[m]; every token its mask does not allow (and every id past the mask's words)
// becomes NaN, which every sampling kernel treats as masked. One thread per token: the 32
// threads of a warp share one mask word, and their writes are coalesced.
extern "C" __global__ void sampling_token_mask(LOGITS_T* __restrict__ logits,
                                               const uint32_t* __restrict__ masks,
                                               const uint32_t* __restrict__ mask_rows,
                                               uint32_t vocab, uint32_t words) {
  const uint32_t v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= vocab) return;
  const uint32_t m = blockIdx.y;
  const uint32_t word = (v >> 5) < words ? masks[(size_t)m * words + (v >> 5)] : 0u;
  if (!((word >> (v & 31u)) & 1u)) {
    logits[(size_t)mask_rows[m] * vocab + v] = (LOGITS_T)__int_as_float(0x7fc00000);
  }
}
