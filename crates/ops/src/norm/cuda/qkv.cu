// In-place fix-ups of the fused Q/K/V GEMM output before RoPE: Qwen2's q/k/v bias and
// Qwen3's per-head q/k RMSNorm. f32 math, PAGODA_T storage. No host synchronisation: both
// kernels are CUDA-graph capturable.
typedef PAGODA_T T;

// x[row * row_stride + i] += bias[i] for i < width and row < num_rows (columns width..row_stride
// are untouched). Grid (ceil(width / blockDim.x), min(num_rows, 65535)); the y blocks stride
// over the rows, so any number of rows works.
extern "C" __global__ void add_bias_rows(T* __restrict__ x, const T* __restrict__ bias,
                                         unsigned int num_rows, unsigned int width,
                                         unsigned int row_stride) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= width) return;
    const float b = to_f32(bias[i]);
    for (unsigned int row = blockIdx.y; row < num_rows; row += gridDim.y) {
        const size_t index = (size_t)row * row_stride + i;
        x[index] = from_f32<T>(to_f32(x[index]) + b);
    }
}

// Per-head RMSNorm in place: for token t < num_tokens and head h < num_heads, the slice
// x[t * row_stride + h * head_dim .. + head_dim] becomes slice / sqrt(mean(slice^2) + eps) * weight.
// One warp per (token, head); blockDim.x a multiple of 32; grid covers num_tokens * num_heads
// warps (surplus warps return). Each lane reads and rewrites only its own elements.
extern "C" __global__ void rms_norm_heads(T* __restrict__ x, const T* __restrict__ weight,
                                          unsigned int num_tokens, unsigned int num_heads,
                                          unsigned int head_dim, unsigned int row_stride,
                                          float eps) {
    const unsigned int warps_per_block = blockDim.x >> 5;
    const unsigned int pair = blockIdx.x * warps_per_block + (threadIdx.x >> 5);
    const unsigned int lane = threadIdx.x & 31;
    if (pair >= num_tokens * num_heads) return;  // whole warp leaves together
    const unsigned int token = pair / num_heads;
    const unsigned int head = pair % num_heads;
    T* slice = x + (size_t)token * row_stride + (size_t)head * head_dim;
    float sum_squares = 0.0f;
    for (unsigned int i = lane; i < head_dim; i += 32) {
        const float v = to_f32(slice[i]);
        sum_squares += v * v;
    }
    const float scale = rsqrtf(warp_sum(sum_squares) / (float)head_dim + eps);
    for (unsigned int i = lane; i < head_dim; i += 32) {
        slice[i] = from_f32<T>(to_f32(slice[i]) * scale * to_f32(weight[i]));
    }
}
