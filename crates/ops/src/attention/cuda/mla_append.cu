// The MLA latent append: token t's pool row slots[t] becomes [latent row t (latent_dim),
// rotated RoPE key row t (rope_dim)], the layout of the latent pool
// ([num_pages, page_size, 1, latent_dim + rope_dim]). Negative slots and slots >= num_slots
// are skipped (padding rows). A plain copy in the pool's type: the same bits as the host
// writing the rows. One block per token.
typedef PAGODA_T T;

extern "C" __global__ void mla_append(T* __restrict__ pool, const T* __restrict__ latent,
                                      const T* __restrict__ k_rope, const int* __restrict__ slots,
                                      unsigned int latent_dim, unsigned int rope_dim,
                                      unsigned int latent_row_stride, unsigned int rope_row_stride,
                                      long long num_slots) {
    const unsigned int token = blockIdx.x;
    const long long slot = slots[token];
    if (slot < 0 || slot >= num_slots) return;
    const unsigned int row_dim = latent_dim + rope_dim;
    T* dst = pool + (size_t)slot * row_dim;
    const T* latent_src = latent + (size_t)token * latent_row_stride;
    const T* rope_src = k_rope + (size_t)token * rope_row_stride;
    for (unsigned int i = threadIdx.x; i < row_dim; i += blockDim.x) {
        dst[i] = i < latent_dim ? latent_src[i] : rope_src[i - latent_dim];
    }
}
