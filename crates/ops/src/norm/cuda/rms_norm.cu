// RMSNorm over rows of `dim` elements: y = x / sqrt(mean(x^2) + eps) * weight, f32 math.
// One block per row; the host sizes the block to about four elements per thread so each
// thread's loads are few and independent (a 4096-wide row in one pass of 1024 threads).
// PAGODA_T: weight and output dtype; PAGODA_X_T: the input's dtype (an f32
// residual stream normalised into bf16 GEMM inputs has X_T = float, T = bf16).
typedef PAGODA_T T;
typedef PAGODA_X_T X_T;

extern "C" __global__ void rms_norm(const X_T* __restrict__ x, const T* __restrict__ weight,
                                    T* __restrict__ out, unsigned int dim, float eps) {
    const size_t base = (size_t)blockIdx.x * dim;
    float sum_squares = 0.0f;
#pragma unroll 4
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(x[base + i]);
        sum_squares += v * v;
    }
    const float scale = rsqrtf(block_sum(sum_squares) / (float)dim + eps);
#pragma unroll 4
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) {
        out[base + i] = from_f32<T>(to_f32(x[base + i]) * scale * to_f32(weight[i]));
    }
}

// Fused residual add + RMSNorm: residual += x (stored rounded to T), then
// out = rms_norm(residual). The norm reads the rounded residual, exactly as the unfused
// add followed by rms_norm would.
extern "C" __global__ void add_rms_norm(T* __restrict__ residual, const T* __restrict__ x,
                                        const T* __restrict__ weight, T* __restrict__ out,
                                        unsigned int dim, float eps) {
    const size_t base = (size_t)blockIdx.x * dim;
    float sum_squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) {
        const T sum = from_f32<T>(to_f32(residual[base + i]) + to_f32(x[base + i]));
        residual[base + i] = sum;
        const float v = to_f32(sum);
        sum_squares += v * v;
    }
    const float scale = rsqrtf(block_sum(sum_squares) / (float)dim + eps);
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) {
        out[base + i] = from_f32<T>(to_f32(residual[base + i]) * scale * to_f32(weight[i]));
    }
}

// rms_norm that also writes its output as the q8_1 activations of the quantized GEMV that
// reads it next (`q8_quantize_block` of the value rounded to T, the bytes quantize_q8_rows
// writes from `out`): one launch instead of two. dim a multiple of 32 (and blockDim, as the
// host sizes it), so each warp's pass holds whole 32-value blocks and reaches the quantizer
// whole.
extern "C" __global__ void rms_norm_q8(const X_T* __restrict__ x, const T* __restrict__ weight,
                                       T* __restrict__ out, signed char* __restrict__ xq,
                                       float2* __restrict__ xds, unsigned int dim, float eps) {
    const size_t base = (size_t)blockIdx.x * dim;
    float sum_squares = 0.0f;
#pragma unroll 4
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(x[base + i]);
        sum_squares += v * v;
    }
    const float scale = rsqrtf(block_sum(sum_squares) / (float)dim + eps);
#pragma unroll 4
    for (unsigned int i = threadIdx.x; i < dim; i += blockDim.x) {
        const T y = from_f32<T>(to_f32(x[base + i]) * scale * to_f32(weight[i]));
        out[base + i] = y;
        q8_quantize_block(to_f32(y), xq, xds, base + i);
    }
}
