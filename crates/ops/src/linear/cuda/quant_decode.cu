// The in-register decoder of GGUF weight blocks shared by the quantized kernels (prepended
// to gemv_quant.cu and to the MoE's moe_quant.cu): a format's block geometry (`Fmt<F>`) and
// `decode<F>`, one 32-value group of a block as four-value words of signed bytes with its
// scales and offset (the dot with q8 activations is then integer, see gemv_quant.cu). No
// specialisation of its own: every function takes its format as a template argument.
namespace gemv_quant_detail {
enum Format { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K };
template <int F>
struct Fmt {
    static constexpr bool K_QUANT = F >= Q4_K;
    static constexpr int BLOCK_VALUES = K_QUANT ? 256 : 32;
    static constexpr int BLOCK_BYTES = F == Q4_0   ? 18
                                       : F == Q4_1 ? 20
                                       : F == Q5_0 ? 22
                                       : F == Q5_1 ? 24
                                       : F == Q8_0 ? 34
                                       : F == Q4_K ? 144
                                       : F == Q5_K ? 176
                                                   : 210;
    static constexpr int GROUPS_PER_BLOCK = BLOCK_VALUES / 32;
    static constexpr bool SPLIT16 = F == Q6_K;
};

// One 32-value group of weights: 4 values a word (byte j of word i is value 4i + j), the
// scales of its 16-value halves (dw[0], dw[1]; equal unless SPLIT16) and its offset.
struct Group {
    int q[8];
    float dw[2];
    float mw;
};
PAGODA_DEVICE float half_bits(unsigned int bits) {
    return __half2float(__ushort_as_half((unsigned short)(bits & 0xffffu)));
}

// N little-endian words from a 2-byte aligned address: aligned loads realigned by a funnel
// shift (the word past the end is read only when the address is not 4-byte aligned).
template <int N>
PAGODA_DEVICE void load_words(const unsigned char* p, unsigned int (&w)[N]) {
    const size_t address = reinterpret_cast<size_t>(p);
    const unsigned int* base = reinterpret_cast<const unsigned int*>(address & ~(size_t)3);
    const unsigned int shift = (unsigned int)(address & 3) * 8;
    unsigned int raw[N + 1];
#pragma unroll
    for (int i = 0; i < N; ++i) raw[i] = __ldg(base + i);
    raw[N] = shift != 0 ? __ldg(base + N) : 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], shift);
}

template <int N>
PAGODA_DEVICE void load_aligned(const unsigned char* p, unsigned int (&w)[N]) {
    static_assert(N % 4 == 0, "16-byte pieces");
    const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        const uint4 piece = __ldg(v + i);
        w[4 * i] = piece.x;
        w[4 * i + 1] = piece.y;
        w[4 * i + 2] = piece.z;
        w[4 * i + 3] = piece.w;
    }
}

// Bits 0-3 of h at bit 4 of bytes 0-3 (the fifth bit of four 5-bit values).
PAGODA_DEVICE int spread_bits(unsigned int h) {
    return (int)((((h & 0xfu) * 0x00204081u) & 0x01010101u) << 4);
}

// Nibble `high` of each byte of the four words.
PAGODA_DEVICE void nibbles(const unsigned int (&qs)[4], bool high, int* q) {
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = (int)((high ? qs[i] >> 4 : qs[i]) & 0x0f0f0f0fu);
}

// Byte i (0-11) of the three scale words, by selects (a dynamic index into a register array
// would put the header in local memory).
PAGODA_DEVICE unsigned int byte_of(const unsigned int* words, unsigned int i) {
    const unsigned int word = i < 4 ? words[0] : (i < 8 ? words[1] : words[2]);
    return (word >> (8 * (i % 4))) & 0xffu;
}

// ggml's get_scale_min_k4 over the 12 scale bytes (three words).
PAGODA_DEVICE void scale_min_k4(unsigned int j, const unsigned int* s, float& scale, float& min) {
    unsigned int sc, mn;
    if (j < 4) {
        sc = byte_of(s, j) & 63;
        mn = byte_of(s, j + 4) & 63;
    } else {
        sc = (byte_of(s, j + 4) & 0x0f) | ((byte_of(s, j - 4) >> 6) << 4);
        mn = (byte_of(s, j + 4) >> 4) | ((byte_of(s, j) >> 6) << 4);
    }
    scale = (float)sc;
    min = (float)mn;
}

// The bytes of one group as loaded, before `decode_raw` makes them a Group: a kernel can issue
// the next group's loads (`load_raw`) before it decodes this one. Words are read aligned; an
// unaligned run (the 2-byte aligned formats) keeps one word more and its shift.
template <int F>
struct Raw {
    static constexpr int WORDS = F == Q4_0   ? 6    // 5 words of the block, realigned
                                 : F == Q5_0 ? 7    // 6, realigned
                                 : F == Q4_1 ? 5
                                 : F == Q5_1 ? 6
                                 : F == Q8_0 ? 10   // 9, realigned
                                 : F == Q4_K ? 12   // header 4, bytes 8
                                 : F == Q5_K ? 20   // header 4, bytes 8, high bits 8
                                             : 20;  // Q6_K: low 9, high 9, scales 1, d 1
    unsigned int v[WORDS];
    unsigned int shift;  // bits of realignment (0 or 16) of the unaligned formats
};

// The aligned word holding the 16 bits at the 2-byte aligned p, those bits at the bottom.
PAGODA_DEVICE unsigned int half_word(const unsigned char* p) {
    const size_t address = reinterpret_cast<size_t>(p);
    return __ldg(reinterpret_cast<const unsigned int*>(address & ~(size_t)3)) >>
           ((unsigned int)(address & 3) * 8);
}

// The N + 1 aligned words over the N words at the 2-byte aligned p (the last read only when p
// is not 4-byte aligned: it may lie past the buffer otherwise); realigned by `word`.
template <int N>
PAGODA_DEVICE void load_unaligned(const unsigned char* p, unsigned int* raw, unsigned int& shift) {
    const size_t address = reinterpret_cast<size_t>(p);
    const unsigned int* base = reinterpret_cast<const unsigned int*>(address & ~(size_t)3);
    shift = (unsigned int)(address & 3) * 8;
#pragma unroll
    for (int i = 0; i < N; ++i) raw[i] = __ldg(base + i);
    raw[N] = shift != 0 ? __ldg(base + N) : 0u;
}
PAGODA_DEVICE unsigned int word(const unsigned int* raw, int i, unsigned int shift) {
    return __funnelshift_r(raw[i], raw[i + 1], shift);
}

// Loads what group g (0 .. GROUPS_PER_BLOCK - 1) of the weight block at `b` of format F needs.
template <int F>
PAGODA_DEVICE void load_raw(const unsigned char* b, unsigned int g, Raw<F>& r) {
    if constexpr (F == Q4_1 || F == Q5_1) {  // 4-byte aligned blocks
        const unsigned int* p = reinterpret_cast<const unsigned int*>(b);
#pragma unroll
        for (int i = 0; i < Raw<F>::WORDS; ++i) r.v[i] = __ldg(p + i);
        r.shift = 0;
    } else if constexpr (F == Q4_0 || F == Q5_0 || F == Q8_0) {
        load_unaligned<Raw<F>::WORDS - 1>(b, r.v, r.shift);
    } else if constexpr (F == Q4_K || F == Q5_K) {
        unsigned int head[4], qs[8];
        load_aligned(b, head);
        load_aligned(b + (F == Q4_K ? 16 : 48) + 32 * (g / 2), qs);
#pragma unroll
        for (int i = 0; i < 4; ++i) r.v[i] = head[i];
#pragma unroll
        for (int i = 0; i < 8; ++i) r.v[4 + i] = qs[i];
        if constexpr (F == Q5_K) {
            unsigned int qh[8];
            load_aligned(b + 16, qh);
#pragma unroll
            for (int i = 0; i < 8; ++i) r.v[12 + i] = qh[i];
        }
        r.shift = 0;
    } else {  // Q6_K (2-byte aligned blocks): ql and qh runs share b's shift
        const unsigned int h = g / 4, k = g % 4;
        load_unaligned<8>(b + 64 * h + 32 * (k & 1), r.v, r.shift);
        load_unaligned<8>(b + 128 + 32 * h, r.v + 9, r.shift);
        r.v[18] = half_word(b + 192 + 8 * h + 2 * k);  // the two 16-value scales
        r.v[19] = half_word(b + 208);                  // d
    }
}

// Group g of a block from its loaded bytes: values 32g .. 32g + 31.
template <int F>
PAGODA_DEVICE void decode_raw(const Raw<F>& r, unsigned int g, Group& u) {
    if constexpr (F == Q4_0 || F == Q4_1 || F == Q5_0 || F == Q5_1) {
        // d [, m] [, qh: 4 bytes] and 16 bytes of nibbles (values j and j + 16 share byte j).
        constexpr bool MIN = F == Q4_1 || F == Q5_1;
        constexpr bool FIFTH = F == Q5_0 || F == Q5_1;
        unsigned int qs[4], qh = 0, dm;
        if constexpr (F == Q4_1 || F == Q5_1) {
            dm = r.v[0];
            if (FIFTH) qh = r.v[1];
#pragma unroll
            for (int i = 0; i < 4; ++i) qs[i] = r.v[(FIFTH ? 2 : 1) + i];
        } else {  // the words after the f16 scale, realigned
            unsigned int w[Raw<F>::WORDS - 1];
#pragma unroll
            for (int i = 0; i < Raw<F>::WORDS - 1; ++i) w[i] = word(r.v, i, r.shift);
            dm = w[0];
            if (FIFTH) qh = __funnelshift_r(w[0], w[1], 16);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                qs[i] = __funnelshift_r(w[(FIFTH ? 1 : 0) + i], w[(FIFTH ? 2 : 1) + i], 16);
        }
        nibbles(qs, false, u.q);
        nibbles(qs, true, u.q + 4);
        if (FIFTH) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u.q[i] |= spread_bits(qh >> (4 * i));
                u.q[4 + i] |= spread_bits(qh >> (16 + 4 * i));
            }
        }
        const float d = half_bits(dm);
        u.dw[0] = u.dw[1] = d;
        u.mw = MIN ? half_bits(dm >> 16) : (FIFTH ? -16.0f : -8.0f) * d;
    } else if constexpr (F == Q8_0) {
        unsigned int w[9];
#pragma unroll
        for (int i = 0; i < 9; ++i) w[i] = word(r.v, i, r.shift);
#pragma unroll
        for (int i = 0; i < 8; ++i) u.q[i] = (int)__funnelshift_r(w[i], w[i + 1], 16);
        u.dw[0] = u.dw[1] = half_bits(w[0]);
        u.mw = 0.0f;
    } else if constexpr (F == Q4_K || F == Q5_K) {
        // Groups 2c and 2c + 1 are the low and high nibbles of the 32 bytes of chunk c.
        const unsigned int* head = r.v;
        const bool high = g % 2;
        nibbles(*reinterpret_cast<const unsigned int(*)[4]>(r.v + 4), high, u.q);
        nibbles(*reinterpret_cast<const unsigned int(*)[4]>(r.v + 8), high, u.q + 4);
        if constexpr (F == Q5_K) {  // the fifth bit of value l of group g: bit g of qh[l]
#pragma unroll
            for (int i = 0; i < 8; ++i) u.q[i] |= (int)(((r.v[12 + i] >> g) & 0x01010101u) << 4);
        }
        float scale, min;
        scale_min_k4(g, head + 1, scale, min);
        u.dw[0] = u.dw[1] = half_bits(head[0]) * scale;
        u.mw = -half_bits(head[0] >> 16) * min;
    } else {  // Q6_K: group g = (half h, k): low nibbles of ql[32 (k & 1)..] when k < 2,
              // high ones when k >= 2; two high bits from qh[l] >> 2k; 16-value scales.
        const unsigned int k = g % 4;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned int ql = word(r.v, i, r.shift), qh = word(r.v + 9, i, r.shift);
            const unsigned int low = (k >= 2 ? ql >> 4 : ql) & 0x0f0f0f0fu;
            const unsigned int value = low | (((qh >> (2 * k)) & 0x03030303u) << 4);
            u.q[i] = (int)__vsub4(value, 0x20202020u);
        }
        const float d = half_bits(r.v[19]);
        u.dw[0] = d * (float)(signed char)(r.v[18] & 0xff);
        u.dw[1] = d * (float)(signed char)((r.v[18] >> 8) & 0xff);
        u.mw = 0.0f;
    }
}

// Decodes group g (0 .. GROUPS_PER_BLOCK - 1) of the weight block at `b` of format F.
template <int F>
PAGODA_DEVICE void decode(const unsigned char* b, unsigned int g, Group& u) {
    Raw<F> r;
    load_raw<F>(b, g, r);
    decode_raw<F>(r, g, u);
}

// A decoded group's dot with one 32-value block of q8 activations (32 bytes as two int4 `a`,
// `c`, the pair `ds` = (d, d * sum q)): four-byte integer dots, the group's scales once.
// FIXED: the float arithmetic spelled out with rounding intrinsics, so the compiler cannot
// contract a product into a sum differently where the function is inlined (the MoE kernels'
// per-entry and tiled launches must give a row the same bits).
template <int F, bool FIXED = false>
PAGODA_DEVICE float group_dot(const Group& u, const int4 a, const int4 c, const float2 ds) {
    const int* q = u.q;
    int lo = __dp4a(q[0], a.x, 0);
    lo = __dp4a(q[1], a.y, lo);
    lo = __dp4a(q[2], a.z, lo);
    lo = __dp4a(q[3], a.w, lo);
    int hi = __dp4a(q[4], c.x, 0);
    hi = __dp4a(q[5], c.y, hi);
    hi = __dp4a(q[6], c.z, hi);
    hi = __dp4a(q[7], c.w, hi);
    if (FIXED) {
        const float dot = Fmt<F>::SPLIT16
                              ? __fmaf_rn(u.dw[0], (float)lo, __fmul_rn(u.dw[1], (float)hi))
                              : __fmul_rn(u.dw[0], (float)(lo + hi));
        return __fmaf_rn(ds.x, dot, __fmul_rn(u.mw, ds.y));
    }
    const float dot = Fmt<F>::SPLIT16 ? u.dw[0] * (float)lo + u.dw[1] * (float)hi
                                      : u.dw[0] * (float)(lo + hi);
    return ds.x * dot + u.mw * ds.y;
}
}  // namespace gemv_quant_detail

