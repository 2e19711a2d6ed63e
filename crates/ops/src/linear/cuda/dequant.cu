// GGUF dequantization to PAGODA_T (bf16 or f32) at load time, bit-exact with ggml's scalar
// dequantize_row_* before the final rounding to PAGODA_T: every product and sum is rounded
// explicitly (__fmul_rn/__fadd_rn) so no FMA contraction changes the f32 value.
// One thread per output value; `num_values` is a whole number of blocks. Grid 1-D.
typedef PAGODA_T T;

PAGODA_DEVICE float half_at(const unsigned char* bytes, unsigned int offset) {
    const unsigned short bits = (unsigned short)(bytes[offset] | (bytes[offset + 1] << 8));
    return __half2float(__ushort_as_half(bits));
}

PAGODA_DEVICE unsigned long long value_index() {
    return (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
}

extern "C" __global__ void dequant_q4_0(const unsigned char* __restrict__ src, T* __restrict__ out,
                                        unsigned long long num_values) {
    const unsigned long long i = value_index();
    if (i >= num_values) return;
    const unsigned char* block = src + (i / 32) * 18;
    const unsigned int j = i % 32;
    const unsigned char q = block[2 + (j % 16)];
    const int nibble = j < 16 ? (q & 0x0F) : (q >> 4);
    out[i] = from_f32<T>(__fmul_rn((float)(nibble - 8), half_at(block, 0)));
}

extern "C" __global__ void dequant_q4_1(const unsigned char* __restrict__ src, T* __restrict__ out,
                                        unsigned long long num_values) {
    const unsigned long long i = value_index();
    if (i >= num_values) return;
    const unsigned char* block = src + (i / 32) * 20;
    const unsigned int j = i % 32;
    const unsigned char q = block[4 + (j % 16)];
    const int nibble = j < 16 ? (q & 0x0F) : (q >> 4);
    out[i] = from_f32<T>(__fadd_rn(__fmul_rn((float)nibble, half_at(block, 0)), half_at(block, 2)));
}

extern "C" __global__ void dequant_q8_0(const unsigned char* __restrict__ src, T* __restrict__ out,
                                        unsigned long long num_values) {
    const unsigned long long i = value_index();
    if (i >= num_values) return;
    const unsigned char* block = src + (i / 32) * 34;
    const signed char q = (signed char)block[2 + (i % 32)];
    out[i] = from_f32<T>(__fmul_rn((float)q, half_at(block, 0)));
}

// ggml's get_scale_min_k4 over the 12 packed scale bytes.
PAGODA_DEVICE void scale_min_k4(unsigned int j, const unsigned char* scales, unsigned int& scale,
                                unsigned int& min) {
    if (j < 4) {
        scale = scales[j] & 63;
        min = scales[j + 4] & 63;
    } else {
        scale = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

// Q4_K and Q5_K share the layout of scales; Q5_K adds a fifth bit from qh.
template <bool FIVE_BITS>
PAGODA_DEVICE float k_quant_value(const unsigned char* block, unsigned int j) {
    const unsigned int chunk = j / 64;
    const unsigned int within = j % 64;
    const bool high = within >= 32;
    const unsigned int l = within % 32;
    const unsigned int sub = 2 * chunk + (high ? 1 : 0);
    unsigned int scale, min;
    scale_min_k4(sub, block + 4, scale, min);
    const float d = __fmul_rn(half_at(block, 0), (float)scale);
    const float m = __fmul_rn(half_at(block, 2), (float)min);
    const unsigned char* qs = block + (FIVE_BITS ? 48 : 16);
    const unsigned char q = qs[chunk * 32 + l];
    unsigned int value = high ? (q >> 4) : (q & 0x0F);
    if (FIVE_BITS) value |= ((block[16 + l] >> sub) & 1) << 4;
    return __fsub_rn(__fmul_rn(d, (float)value), m);
}

extern "C" __global__ void dequant_q4_k(const unsigned char* __restrict__ src, T* __restrict__ out,
                                        unsigned long long num_values) {
    const unsigned long long i = value_index();
    if (i >= num_values) return;
    out[i] = from_f32<T>(k_quant_value<false>(src + (i / 256) * 144, i % 256));
}

extern "C" __global__ void dequant_q5_k(const unsigned char* __restrict__ src, T* __restrict__ out,
                                        unsigned long long num_values) {
    const unsigned long long i = value_index();
    if (i >= num_values) return;
    out[i] = from_f32<T>(k_quant_value<true>(src + (i / 256) * 176, i % 256));
}

extern "C" __global__ void dequant_q6_k(const unsigned char* __restrict__ src, T* __restrict__ out,
                                        unsigned long long num_values) {
    const unsigned long long i = value_index();
    if (i >= num_values) return;
    const unsigned char* block = src + (i / 256) * 210;
    const unsigned int j = i % 256;
    const unsigned int half = j / 128;
    const unsigned int within = j % 128;
    const unsigned int k = within / 32;
    const unsigned int l = within % 32;
    const unsigned char* ql = block + 64 * half;
    const unsigned char* qh = block + 128 + 32 * half;
    const unsigned char* sc = block + 192 + 8 * half;
    const unsigned int low_source = (k & 1) ? ql[l + 32] : ql[l];
    const unsigned int low = (k & 2) ? (low_source >> 4) : (low_source & 0x0F);
    const unsigned int high = (qh[l] >> (2 * k)) & 3;
    const int q = (int)(low | (high << 4)) - 32;
    const float scale = (float)(signed char)sc[l / 16 + 2 * k];
    out[i] = from_f32<T>(__fmul_rn(__fmul_rn(half_at(block, 208), scale), (float)q));
}
