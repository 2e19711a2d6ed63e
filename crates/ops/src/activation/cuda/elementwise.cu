// Elementwise ops of the MLP and the residual stream; f32 math, PAGODA_T storage.
typedef PAGODA_T T;

// out[t, i] = silu(gate[t, i]) * up[t, i] for i < width; gate/up rows are gate_row_stride /
// up_row_stride elements apart (a fused [gate | up] buffer works), out is [num_tokens, width].
// Grid (ceil(width / blockDim.x), num_tokens).
extern "C" __global__ void silu_mul(const T* __restrict__ gate, const T* __restrict__ up,
                                    T* __restrict__ out, unsigned int width,
                                    unsigned int gate_row_stride, unsigned int up_row_stride) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int token = blockIdx.y;
    if (i >= width) return;
    const float g = to_f32(gate[(size_t)token * gate_row_stride + i]);
    const float u = to_f32(up[(size_t)token * up_row_stride + i]);
    out[(size_t)token * width + i] = from_f32<T>(g / (1.0f + expf(-g)) * u);
}

// accumulator[i] += x[i] for i < len (the residual add).
extern "C" __global__ void add_in_place(T* __restrict__ accumulator, const T* __restrict__ x,
                                        unsigned long long len) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    accumulator[i] = from_f32<T>(to_f32(accumulator[i]) + to_f32(x[i]));
}

// Greedy argmax per row of f32 logits [rows, cols] into token_ids[rows]: the first index of
// the largest value; NaN never wins; a row of only -inf/NaN gives 0. One block per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits,
                                       unsigned int* __restrict__ token_ids, unsigned int cols) {
    __shared__ float best_values[32];
    __shared__ unsigned int best_indices[32];
    const float* row = logits + (size_t)blockIdx.x * cols;
    float best = -INFINITY;
    unsigned int best_index = 0xffffffffu;
    for (unsigned int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = row[i];
        if (v > best) { best = v; best_index = i; }  // strided: indices increase per thread
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const unsigned int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
        if (other > best || (other == best && other_index < best_index)) { best = other; best_index = other_index; }
    }
    if (lane == 0) { best_values[warp] = best; best_indices[warp] = best_index; }
    __syncthreads();
    if (warp == 0) {
        const int num_warps = blockDim.x >> 5;
        best = lane < num_warps ? best_values[lane] : -INFINITY;
        best_index = lane < num_warps ? best_indices[lane] : 0xffffffffu;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, best, offset);
            const unsigned int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
            if (other > best || (other == best && other_index < best_index)) { best = other; best_index = other_index; }
        }
        if (lane == 0) token_ids[blockIdx.x] = best_index == 0xffffffffu ? 0u : best_index;
    }
}

// silu_mul that also writes its output as the q8_1 activations of the quantized GEMV that
// reads it next (`q8_quantize_block` of the value rounded to T, the bytes quantize_q8_rows
// writes from `out`): one launch instead of two. width a multiple of 32, so a warp holds one
// whole 32-value block (and leaves together past the end).
extern "C" __global__ void silu_mul_q8(const T* __restrict__ gate, const T* __restrict__ up,
                                       T* __restrict__ out, signed char* __restrict__ xq,
                                       float2* __restrict__ xds, unsigned int width,
                                       unsigned int gate_row_stride, unsigned int up_row_stride) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int token = blockIdx.y;
    if (i >= width) return;
    const float g = to_f32(gate[(size_t)token * gate_row_stride + i]);
    const float u = to_f32(up[(size_t)token * up_row_stride + i]);
    const T y = from_f32<T>(g / (1.0f + expf(-g)) * u);
    const size_t index = (size_t)token * width + i;
    out[index] = y;
    q8_quantize_block(to_f32(y), xq, xds, index);
}
