// gemv_quant_units: the small-batch linear layer over GGUF blocks with a warp per few weight
// rows, built for the K-quants (Q4_K, Q5_K, Q6_K) using every loaded byte whole. Same contract
// and numerics as gemv_quant (above, in the same program): out[i, j] = beta * out[i, j] +
// sum_k x[i, k] * w[j, k] for m <= M_TILE rows of q8 activations, each 32-value group's term
// dx * dw * sum(qx * qw) + mw * (dx * sum(qx)) with the same integer dots and the same float
// expression; only the order in which the groups' terms are added differs (so the outputs are
// not bit-identical to gemv_quant's).
//
// Layout: a warp owns WROWS weight rows, its lanes stride over the rows' units. A unit is the
// two 32-value groups that share their quantized bytes (a K-quant packs group 2c in the low
// nibbles and 2c + 1 in the high nibbles of one 32-byte chunk; Q6_K's groups k and k + 2 of a
// 128-value half likewise), so a lane loads its 32 bytes as two 16-byte pieces and uses both
// nibbles of each, with its super-block's header (d, dmin, 12 scale bytes: one 16-byte load)
// read once per unit rather than once per group. A lane's activations of a unit (two groups:
// 64 bytes and two scale pairs per activation row) are loaded once and multiply all WROWS
// weight rows, and the loads of the WROWS rows' units are issued together before any dot.
// The 32-value formats (Q4_0 .. Q8_0) take the same layout with a unit of one block, decoded
// by gemv_quant's decoder: their gain is the activations shared by the warp's rows.
// Warps are independent (no shared memory, no barrier); a warp's sums meet by shuffles.
// Requirements (checked by the launcher): k a multiple of the format's block, m <= M_TILE.
// Weights are read through the read-only path in 16-byte loads; Q6_K's 2-byte aligned blocks
// (210 bytes) by three aligned loads realigned in registers (load_32_realigned).

namespace gemv_units_detail {
using namespace gemv_quant_detail;
// Groups of a unit, and units of a super-block.
constexpr int UNIT_GROUPS = K_QUANT ? 2 : 1;
constexpr int UNITS_PER_BLOCK = GROUPS_PER_BLOCK / UNIT_GROUPS;
// Weight rows per warp (PAGODA_WROWS: 1, 2 or 4; the launcher's rule: four from four activation
// rows on except for Q6_K, whose units take more registers, else two). Activation loads are
// shared by the rows. Programs of gemv_quant's specialisations leave it undefined.
#ifdef PAGODA_WROWS
constexpr int WROWS = PAGODA_WROWS;
#else
constexpr int WROWS = 2;
#endif
static_assert(WROWS == 1 || WROWS == 2 || WROWS == 4, "WROWS: 1, 2 or 4");
constexpr int UWARPS = 4;  // warps per CTA
static_assert(M_TILE * WROWS <= 32, "one lane per output of a warp");

// The loaded bytes of one unit of one weight row, decoded group by group on use.
struct Unit {
    unsigned int qs[8];  // the 32 shared bytes (Q6_K: ql; 32-value formats: the decoded group)
    unsigned int qh[8];  // Q5_K: the super-block's 32 fifth-bit bytes; Q6_K: the half's qh
    float dw[UNIT_GROUPS][2];
    float mw[UNIT_GROUPS];
};

// 32 bytes from a 2-byte aligned address as 8 little-endian words: the 48 bytes from the
// 16-byte boundary below (three aligned loads; 16 bytes past the 32 needed at most, inside a
// Q6_K block for its ql and qh) shifted down by selects of whole words and a funnel shift.
PAGODA_DEVICE void load_32_realigned(const unsigned char* p, unsigned int (&w)[8]) {
    const size_t address = reinterpret_cast<size_t>(p);
    unsigned int raw[12];
    load_aligned(reinterpret_cast<const unsigned char*>(address & ~(size_t)15), raw);
    const unsigned int word = (unsigned int)(address & 15) / 4;
    const unsigned int shift = (unsigned int)(address & 3) * 8;
    unsigned int shifted[9];
#pragma unroll
    for (int j = 0; j < 9; ++j)
        shifted[j] = word == 0   ? raw[j]
                     : word == 1 ? raw[j + 1]
                     : word == 2 ? raw[j + 2]
                                 : raw[j + 3];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = __funnelshift_r(shifted[i], shifted[i + 1], shift);
}

// Group g (0 or 1) of unit c of a super-block: its index among the block's 8 groups.
PAGODA_DEVICE unsigned int group_of(unsigned int c, unsigned int g) {
    if (FORMAT == Q6_K) return 4 * (c / 2) + c % 2 + 2 * g;  // half c / 2, groups k and k + 2
    return UNIT_GROUPS * c + g;
}

// Loads unit c of the super-block at `b` and its groups' scales.
PAGODA_DEVICE void load_unit(const unsigned char* b, unsigned int c, Unit& u) {
    if constexpr (FORMAT == Q4_K || FORMAT == Q5_K) {
        unsigned int head[4];
        load_aligned(b, head);
        load_aligned(b + (FORMAT == Q4_K ? 16 : 48) + 32 * c, u.qs);
        if (FORMAT == Q5_K) load_aligned(b + 16, u.qh);
        const float d = half_bits(head[0]), dmin = half_bits(head[0] >> 16);
#pragma unroll
        for (int g = 0; g < UNIT_GROUPS; ++g) {
            float scale, min;
            scale_min_k4(group_of(c, g), head + 1, scale, min);
            u.dw[g][0] = u.dw[g][1] = d * scale;
            u.mw[g] = -dmin * min;
        }
    } else if constexpr (FORMAT == Q6_K) {
        const unsigned int h = c / 2, k0 = c % 2;
        unsigned int sc[2];
        load_32_realigned(b + 64 * h + 32 * k0, u.qs);
        load_32_realigned(b + 128 + 32 * h, u.qh);
        load_words(b + 192 + 8 * h + 2 * k0, sc);  // bytes 0-1: group k0; 4-5: group k0 + 2
        const float d = __half2float(__ldg(reinterpret_cast<const __half*>(b + 208)));
#pragma unroll
        for (int g = 0; g < UNIT_GROUPS; ++g) {
            u.dw[g][0] = d * (float)(signed char)(sc[g] & 0xff);
            u.dw[g][1] = d * (float)(signed char)((sc[g] >> 8) & 0xff);
            u.mw[g] = 0.0f;
        }
    } else {
        Group group;
        decode<FORMAT>(b, 0, group);
#pragma unroll
        for (int i = 0; i < 8; ++i) u.qs[i] = (unsigned int)group.q[i];
        u.dw[0][0] = group.dw[0];
        u.dw[0][1] = group.dw[1];
        u.mw[0] = group.mw;
    }
}

// Word i (values 4i .. 4i + 3) of group g of unit c, as gemv_quant's decoder writes it.
PAGODA_DEVICE int group_word(const Unit& u, unsigned int c, int g, int i) {
    if (FORMAT == Q6_K) {
        const unsigned int k = c % 2 + 2 * g;
        const unsigned int low = (g ? u.qs[i] >> 4 : u.qs[i]) & 0x0f0f0f0fu;
        const unsigned int value = low | (((u.qh[i] >> (2 * k)) & 0x03030303u) << 4);
        return (int)__vsub4(value, 0x20202020u);
    }
    if (!K_QUANT) return (int)u.qs[i];
    int q = (int)((g ? u.qs[i] >> 4 : u.qs[i]) & 0x0f0f0f0fu);
    if (FORMAT == Q5_K) q |= (int)(((u.qh[i] >> group_of(c, g)) & 0x01010101u) << 4);
    return q;
}
}  // namespace gemv_units_detail

extern "C" __global__ void __launch_bounds__(gemv_units_detail::UWARPS * 32)
    gemv_quant_units(const unsigned char* __restrict__ w, const int* __restrict__ xq,
                     const float2* __restrict__ xds, TO* __restrict__ out, unsigned int m,
                     unsigned int n, unsigned int k, unsigned int ldo, float beta) {
    using namespace gemv_units_detail;
    {
        const unsigned int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        const unsigned int row0 = (blockIdx.x * UWARPS + warp) * WROWS;
        if (row0 >= n) return;  // the whole warp: nothing below waits for other warps
        const unsigned int groups = k / 32, units = k / 32 / UNIT_GROUPS;
        const size_t row_bytes = (size_t)(k / BLOCK_VALUES) * BLOCK_BYTES;
        const unsigned char* rows[WROWS];
#pragma unroll
        for (int r = 0; r < WROWS; ++r) rows[r] = w + (size_t)min(row0 + r, n - 1) * row_bytes;
        float acc[M_TILE][WROWS];
#pragma unroll
        for (int i = 0; i < M_TILE; ++i)
#pragma unroll
            for (int r = 0; r < WROWS; ++r) acc[i][r] = 0.0f;

        for (unsigned int unit = lane; unit < units; unit += 32) {
            const unsigned int block = unit / UNITS_PER_BLOCK, c = unit % UNITS_PER_BLOCK;
            Unit u[WROWS];
#pragma unroll
            for (int r = 0; r < WROWS; ++r)
                load_unit(rows[r] + (size_t)block * BLOCK_BYTES, c, u[r]);
#pragma unroll
            for (int i = 0; i < M_TILE; ++i) {
                if (i >= (int)m) break;
#pragma unroll
                for (int g = 0; g < UNIT_GROUPS; ++g) {
                    const size_t group =
                        (size_t)i * groups + block * GROUPS_PER_BLOCK + group_of(c, g);
                    const int4* xp = reinterpret_cast<const int4*>(xq + group * 8);
                    const int4 a = __ldg(xp), b = __ldg(xp + 1);
                    const float2 ds = __ldg(xds + group);
#pragma unroll
                    for (int r = 0; r < WROWS; ++r) {
                        int lo = __dp4a(group_word(u[r], c, g, 0), a.x, 0);
                        lo = __dp4a(group_word(u[r], c, g, 1), a.y, lo);
                        lo = __dp4a(group_word(u[r], c, g, 2), a.z, lo);
                        lo = __dp4a(group_word(u[r], c, g, 3), a.w, lo);
                        int hi = __dp4a(group_word(u[r], c, g, 4), b.x, 0);
                        hi = __dp4a(group_word(u[r], c, g, 5), b.y, hi);
                        hi = __dp4a(group_word(u[r], c, g, 6), b.z, hi);
                        hi = __dp4a(group_word(u[r], c, g, 7), b.w, hi);
                        const float dot =
                            SPLIT16 ? u[r].dw[g][0] * (float)lo + u[r].dw[g][1] * (float)hi
                                    : u[r].dw[g][0] * (float)(lo + hi);
                        acc[i][r] += ds.x * dot + u[r].mw[g] * ds.y;
                    }
                }
            }
        }
        // Every lane gets every sum; lane i * WROWS + r writes output (i, r).
#pragma unroll
        for (int i = 0; i < M_TILE; ++i)
#pragma unroll
            for (int r = 0; r < WROWS; ++r) {
                const float v = warp_sum(acc[i][r]);
                const unsigned int row = row0 + r;
                if (lane != (unsigned int)(i * WROWS + r) || i >= (int)m || row >= n) continue;
                TO* o = out + (size_t)i * ldo + row;
                const float previous = beta != 0.0f ? beta * to_f32(*o) : 0.0f;
                *o = from_f32<TO>(previous + v);
            }
    }
}
