// What the expert sources share (prepended to moe_experts.cu and moe_rows.cu): the element
// type, 16-byte weight loads that skip L1, and their widening to f32.
//
// Specialisation: PAGODA_T (float or __nv_bfloat16), the activations' and weights' type.
typedef PAGODA_T T;

namespace moe_common {
constexpr int PIECE = 16 / (int)sizeof(T);  // elements per 16-byte load

// 16 bytes of weights, read once: no L1 allocation.
PAGODA_DEVICE uint4 load_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// The PIECE values of a 16-byte load as f32 (overloaded on the element type).
PAGODA_DEVICE void widen(const uint4 v, float* f, const float*) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
}
PAGODA_DEVICE void widen(const uint4 v, float* f, const __nv_bfloat16*) {
    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}
}  // namespace moe_common
