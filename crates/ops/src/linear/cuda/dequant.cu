// GGUF dequantization to PAGODA_T (bf16 or f32), bit-exact with ggml's scalar
// dequantize_row_* before the final rounding to PAGODA_T: every product and sum is rounded
// explicitly (__fmul_rn/__fadd_rn) so no FMA contraction changes the f32 value.
// Per format, two entries over one `value_<format>(block, j)`: dequant_<format> decodes a
// whole tensor (one thread per value; `num_values` a whole number of blocks; grid 1-D), and
// gather_<format> decodes the rows `ids` of a [num_rows, width] table (an embedding lookup on
// weights kept quantized; grid (width / 256, tokens); an id >= num_rows gives a NaN row).
typedef PAGODA_T T;

PAGODA_DEVICE float half_at(const unsigned char* bytes, unsigned int offset) {
    const unsigned short bits = (unsigned short)(bytes[offset] | (bytes[offset + 1] << 8));
    return __half2float(__ushort_as_half(bits));
}

PAGODA_DEVICE float value_q4_0(const unsigned char* block, unsigned int j) {
    const unsigned char q = block[2 + (j % 16)];
    const int nibble = j < 16 ? (q & 0x0F) : (q >> 4);
    return __fmul_rn((float)(nibble - 8), half_at(block, 0));
}

PAGODA_DEVICE float value_q4_1(const unsigned char* block, unsigned int j) {
    const unsigned char q = block[4 + (j % 16)];
    const int nibble = j < 16 ? (q & 0x0F) : (q >> 4);
    return __fadd_rn(__fmul_rn((float)nibble, half_at(block, 0)), half_at(block, 2));
}

// Q5_0 and Q5_1: the fifth bit of value j is bit j of the 32-bit qh.
template <bool WITH_MIN>
PAGODA_DEVICE float five_bit_value(const unsigned char* block, unsigned int j) {
    const unsigned char* qh = block + (WITH_MIN ? 4 : 2);
    const unsigned int high = (qh[j / 8] >> (j % 8)) & 1;
    const unsigned char q = block[(WITH_MIN ? 8 : 6) + (j % 16)];
    const int value = (int)((j < 16 ? (q & 0x0F) : (q >> 4)) | (high << 4));
    if (WITH_MIN) return __fadd_rn(__fmul_rn((float)value, half_at(block, 0)), half_at(block, 2));
    return __fmul_rn((float)(value - 16), half_at(block, 0));
}

PAGODA_DEVICE float value_q5_0(const unsigned char* block, unsigned int j) {
    return five_bit_value<false>(block, j);
}

PAGODA_DEVICE float value_q5_1(const unsigned char* block, unsigned int j) {
    return five_bit_value<true>(block, j);
}

PAGODA_DEVICE float value_q8_0(const unsigned char* block, unsigned int j) {
    return __fmul_rn((float)(signed char)block[2 + j], half_at(block, 0));
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

PAGODA_DEVICE float value_q4_k(const unsigned char* block, unsigned int j) {
    return k_quant_value<false>(block, j);
}

PAGODA_DEVICE float value_q5_k(const unsigned char* block, unsigned int j) {
    return k_quant_value<true>(block, j);
}

PAGODA_DEVICE float value_q6_k(const unsigned char* block, unsigned int j) {
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
    return __fmul_rn(__fmul_rn(half_at(block, 208), scale), (float)q);
}

// The two entries of one format.
#define DEQUANT_ENTRIES(NAME, BLOCK_VALUES, BLOCK_BYTES)                                          \
    extern "C" __global__ void dequant_##NAME(const unsigned char* __restrict__ src,             \
                                              T* __restrict__ out, unsigned long long num_values) { \
        const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;  \
        if (i >= num_values) return;                                                              \
        out[i] = from_f32<T>(value_##NAME(src + (i / BLOCK_VALUES) * BLOCK_BYTES, i % BLOCK_VALUES)); \
    }                                                                                             \
    extern "C" __global__ void gather_##NAME(const unsigned char* __restrict__ table,            \
                                             const unsigned int* __restrict__ ids,                \
                                             T* __restrict__ out, unsigned int width,             \
                                             unsigned int num_rows) {                             \
        const unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;                             \
        if (j >= width) return;                                                                   \
        const unsigned int id = ids[blockIdx.y];                                                  \
        T* o = out + (size_t)blockIdx.y * width + j;                                              \
        if (id >= num_rows) {                                                                     \
            *o = from_f32<T>(quiet_nan());                                                        \
            return;                                                                               \
        }                                                                                         \
        const unsigned char* row = table + (size_t)id * (width / BLOCK_VALUES) * BLOCK_BYTES;     \
        *o = from_f32<T>(value_##NAME(row + (j / BLOCK_VALUES) * BLOCK_BYTES, j % BLOCK_VALUES)); \
    }

DEQUANT_ENTRIES(q4_0, 32, 18)
DEQUANT_ENTRIES(q4_1, 32, 20)
DEQUANT_ENTRIES(q5_0, 32, 22)
DEQUANT_ENTRIES(q5_1, 32, 24)
DEQUANT_ENTRIES(q8_0, 32, 34)
DEQUANT_ENTRIES(q4_k, 256, 144)
DEQUANT_ENTRIES(q5_k, 256, 176)
DEQUANT_ENTRIES(q6_k, 256, 210)
