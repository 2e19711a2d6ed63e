// KV append: token t's K and V rows (num_kv_heads * head_dim = token_stride elements,
// source rows k_row_stride / v_row_stride apart) go to pool row slots[t], where the pool is
// [num_pages, page_size, num_kv_heads, head_dim] and slot = page * page_size + offset.
// Negative slots and slots >= num_slots are skipped (padding rows of a captured batch).
// With PAGODA_KV_FP8 (kv_fp8.cu prepended) the pools are e4m3 bytes with one f32 scale per
// (slot, KV head) in k_scale / v_scale ([num_slots, num_kv_heads]); blockDim whole warps.
typedef PAGODA_T T;

#if PAGODA_KV_FP8
extern "C" __global__ void kv_append_fp8(unsigned char* __restrict__ k_pool,
                                         unsigned char* __restrict__ v_pool,
                                         const T* __restrict__ k_new, const T* __restrict__ v_new,
                                         const int* __restrict__ slots, unsigned int num_kv_heads,
                                         unsigned int head_dim, unsigned int k_row_stride,
                                         unsigned int v_row_stride, long long num_slots,
                                         float* __restrict__ k_scale, float* __restrict__ v_scale) {
    const unsigned int token = blockIdx.x;
    const long long slot = slots[token];
    if (slot < 0 || slot >= num_slots) return;
    fp8_append_token(k_new + (size_t)token * k_row_stride, v_new + (size_t)token * v_row_stride, slot,
                     k_pool, v_pool, k_scale, v_scale, num_kv_heads, head_dim);
}
#else
extern "C" __global__ void kv_append(T* __restrict__ k_pool, T* __restrict__ v_pool,
                                     const T* __restrict__ k_new, const T* __restrict__ v_new,
                                     const int* __restrict__ slots, unsigned int token_stride,
                                     unsigned int k_row_stride, unsigned int v_row_stride,
                                     long long num_slots) {
    const unsigned int token = blockIdx.x;
    const long long slot = slots[token];
    if (slot < 0 || slot >= num_slots) return;
    T* k_dst = k_pool + (size_t)slot * token_stride;
    T* v_dst = v_pool + (size_t)slot * token_stride;
    const T* k_src = k_new + (size_t)token * k_row_stride;
    const T* v_src = v_new + (size_t)token * v_row_stride;
    for (unsigned int i = threadIdx.x; i < token_stride; i += blockDim.x) {
        k_dst[i] = k_src[i];
        v_dst[i] = v_src[i];
    }
}
#endif
