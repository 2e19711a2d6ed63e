// What the expert sources share (prepended to moe_experts.cu, moe_rows.cu, moe_mma.cu and
// moe_quant.cu): the element type, 16-byte weight loads that skip L1, their widening to f32,
// and the routing tiles' lookup.
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

constexpr int ROUTE_TILE_ROWS = 8;  // routed entries per tile (moe_route.cu's TILE_ROWS)

// Tile `tile` of the expert matmuls: its expert, first entry and entry count (0: past the
// step's tiles).
PAGODA_DEVICE unsigned int tile_entries(const unsigned int* tile_offsets,
                                        const unsigned int* tile_experts,
                                        const unsigned int* tile_starts,
                                        const unsigned int* expert_offsets,
                                        unsigned int num_experts, unsigned int tile,
                                        unsigned int& expert, unsigned int& start) {
    if (tile >= tile_offsets[num_experts]) return 0;
    expert = tile_experts[tile];
    start = tile_starts[tile];
    return min((unsigned int)ROUTE_TILE_ROWS, expert_offsets[expert + 1] - start);
}
}  // namespace moe_common
