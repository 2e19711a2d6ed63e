// Generic merge: output row o (of num_rows) and head h combine partial rows
// o_indptr[o] .. o_indptr[o + 1] by their base-2 log-sum-exps; -inf (or NaN) partials are
// skipped and a row with none finite becomes zeros (lse_out -inf). With skip_single, rows
// of exactly one partial are left alone (the partial kernel wrote them). Associative: the
// merged lse_out (nullable) can be merged again. Grid (num_rows, num_heads), block 128.
// partial [N, num_heads, HEAD_DIM] f32, lse [N, num_heads] f32, out [num_rows, num_heads, HEAD_DIM].
extern "C" __global__ void merge_attention_partials(
    const float* __restrict__ partial, const float* __restrict__ lse,
    const unsigned int* __restrict__ o_indptr, T* __restrict__ out, float* __restrict__ lse_out,
    unsigned int skip_single) {
    __shared__ float s_stats[2];
    __shared__ unsigned int s_head[1];
    __shared__ float s_weights[MERGE_BLOCK];
#if __CUDA_ARCH__ >= 900
    // Launched programmatically after a partial kernel: its partials are complete from here.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const unsigned int o = blockIdx.x;
    const unsigned int head = blockIdx.y;
    const unsigned int num_heads = gridDim.y;
    const unsigned int begin = o_indptr[o];
    const unsigned int end = max(begin, o_indptr[o + 1]);
    if (skip_single && end - begin == 1) return;
    if (threadIdx.x < 32) {
        float max_lse, inverse_sum;
        merge_stats(lse, begin, end, num_heads, head, max_lse, inverse_sum);
        if (threadIdx.x == 0) {
            s_stats[0] = max_lse;
            s_stats[1] = inverse_sum;
            s_head[0] = head;
            if (lse_out != nullptr) {
                lse_out[(size_t)o * num_heads + head] =
                    inverse_sum > 0.0f ? max_lse - __log2f(inverse_sum) : -INFINITY;
            }
        }
    }
    __syncthreads();
    constexpr int ELEMS = (HEAD_DIM + 127) / 128;
    float values[ELEMS];
    merge_partials_into<ELEMS>(partial, lse, begin, end, num_heads, s_head, 1, s_stats, s_weights, values);
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) {
        const unsigned int d = threadIdx.x + e * blockDim.x;
        if (d < HEAD_DIM) out[((size_t)o * num_heads + head) * HEAD_DIM + d] = from_f32<T>(values[e]);
    }
}
