//! The eight-row kernels of [`super`] in two widths, from one set of block decoders:
//! `wide` puts two rows' 8-lane chains in each 512-bit register (AVX-512), `narrow` one row's
//! chain in each 256-bit register (AVX2). A decoder gives, for 32 values of a block (chunk
//! `c`), four registers of 8 values each: in `wide` row `a` in lanes 0..8 and row `b` in
//! lanes 8..16, in `narrow` row `a` alone (`b` is not read). Each value is computed exactly as
//! `pagoda_tensor::quant::blocks` decodes it: the same operations in the same order, each
//! rounded once.

use pagoda_tensor::quant::blocks::{
    f16_at, scale_min_k4, Q4_0_BYTES, Q4_1_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_0_BYTES,
    QK, QK_K,
};

use super::WIDE_ROWS;
use crate::linear::cpu::f32_tile::reduce_lanes;

/// Values per decoded chunk.
const CHUNK: usize = 32;

/// `[e(0), e(1), e(2), e(3)]` with `$i` bound to each index, written out: closures (as in
/// `array::map`) are not always inlined into the `target_feature` kernels, and a call per
/// register costs more than the decode.
macro_rules! four {
    ($i:ident => $e:expr) => {
        [
            {
                let $i = 0usize;
                $e
            },
            {
                let $i = 1usize;
                $e
            },
            {
                let $i = 2usize;
                $e
            },
            {
                let $i = 3usize;
                $e
            },
        ]
    };
}

/// The lane operations the decoders use, for one width: `F` and `I` are its float and
/// integer registers, the arguments its intrinsics (in the order of the parameters).
macro_rules! lane_ops {
    (
        $features:literal,
        $set1:ident,
        $and:ident,
        $srli:ident,
        $srl:ident,
        $slli:ident,
        $or:ident,
        $sub_i:ident,
        $to_f:ident,
        $mul:ident,
        $add:ident,
        $sub:ident
    ) => {
        /// The low nibble of each lane's byte.
        #[inline]
        #[target_feature(enable = $features)]
        fn low4(v: I) -> I {
            $and(v, $set1(0x0F))
        }
        /// The high nibble of each lane's byte.
        #[inline]
        #[target_feature(enable = $features)]
        fn high4(v: I) -> I {
            $srli::<4>(v)
        }
        /// `(v >> shift) & mask`.
        #[inline]
        #[target_feature(enable = $features)]
        fn bits(v: I, shift: i32, mask: i32) -> I {
            $and($srl(v, _mm_cvtsi32_si128(shift)), $set1(mask))
        }
        #[inline]
        #[target_feature(enable = $features)]
        fn shl4(v: I) -> I {
            $slli::<4>(v)
        }
        #[inline]
        #[target_feature(enable = $features)]
        fn or(a: I, b: I) -> I {
            $or(a, b)
        }
        #[inline]
        #[target_feature(enable = $features)]
        fn sub_i(v: I, k: i32) -> I {
            $sub_i(v, $set1(k))
        }
        #[inline]
        #[target_feature(enable = $features)]
        fn to_f(v: I) -> F {
            $to_f(v)
        }
        #[inline]
        #[target_feature(enable = $features)]
        fn mul(a: F, b: F) -> F {
            $mul(a, b)
        }
        #[inline]
        #[target_feature(enable = $features)]
        fn add(a: F, b: F) -> F {
            $add(a, b)
        }
        #[inline]
        #[target_feature(enable = $features)]
        fn sub(a: F, b: F) -> F {
            $sub(a, b)
        }
    };
}

/// The block decoders, written once over the width's helpers (`ubytes`, `ibytes`, `pair`,
/// `pair_f16`, the integer and float lane ops), expanded in each width module.
macro_rules! decoders {
    ($features:literal) => {
        /// A block format decoded 32 values at a time (see the module docs).
        pub(in crate::linear::cpu::f32_decode) trait Block {
            const BYTES: usize;
            /// Values per block: 32, or 256 for the K-quants.
            const VALUES: usize;
            /// SAFETY (caller): the width's features; `a` and `b` each point at `BYTES`
            /// readable bytes; `c < VALUES / 32`.
            unsafe fn decode(a: *const u8, b: *const u8, c: usize) -> [F; 4];
        }

        /// Low and high nibbles of the 16 bytes at `at`: values 0..16 and 16..32.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn nibbles(a: *const u8, b: *const u8, at: usize) -> [I; 4] {
            // SAFETY (caller): 16 readable bytes at a + at and b + at.
            let (first, second) = unsafe { (ubytes(a, b, at), ubytes(a, b, at + 8)) };
            [low4(first), low4(second), high4(first), high4(second)]
        }

        /// `block_q4_0 { f16 d; u8 qs[16]; }`: `(nibble - 8) * d`.
        pub(in crate::linear::cpu::f32_decode) struct Q4_0;
        impl Block for Q4_0 {
            const BYTES: usize = Q4_0_BYTES;
            const VALUES: usize = QK;
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(a: *const u8, b: *const u8, _: usize) -> [F; 4] {
                // SAFETY (caller): BYTES readable bytes at each pointer.
                let (d, q) = unsafe { (pair_f16(a, b, 0), nibbles(a, b, 2)) };
                four!(i => mul(to_f(sub_i(q[i], 8)), d))
            }
        }

        /// `block_q4_1 { f16 d; f16 m; u8 qs[16]; }`: `nibble * d + m` (multiply rounded,
        /// then add).
        pub(in crate::linear::cpu::f32_decode) struct Q4_1;
        impl Block for Q4_1 {
            const BYTES: usize = Q4_1_BYTES;
            const VALUES: usize = QK;
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(a: *const u8, b: *const u8, _: usize) -> [F; 4] {
                // SAFETY (caller): BYTES readable bytes at each pointer.
                let (d, m, q) = unsafe { (pair_f16(a, b, 0), pair_f16(a, b, 2), nibbles(a, b, 4)) };
                four!(i => add(mul(to_f(q[i]), d), m))
            }
        }

        /// `block_q8_0 { f16 d; i8 qs[32]; }`: `q * d`.
        pub(in crate::linear::cpu::f32_decode) struct Q8_0;
        impl Block for Q8_0 {
            const BYTES: usize = Q8_0_BYTES;
            const VALUES: usize = QK;
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(a: *const u8, b: *const u8, _: usize) -> [F; 4] {
                // SAFETY (caller): BYTES readable bytes at each pointer.
                unsafe {
                    let d = pair_f16(a, b, 0);
                    four!(i => mul(to_f(ibytes(a, b, 2 + 8 * i)), d))
                }
            }
        }

        /// `block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }` (with `FIFTH`,
        /// `block_q5_K`, `qh[32]` before `qs`): sub-block `c` is `(d * scale) * q - dmin *
        /// min`, `q` the low (`c` even) or high nibbles of `qs[32 (c / 2)..][..32]`, with bit
        /// `c` of `qh[l]` as its fifth bit for Q5_K.
        pub(in crate::linear::cpu::f32_decode) struct KQuant<const FIFTH: bool>;
        pub(in crate::linear::cpu::f32_decode) type Q4K = KQuant<false>;
        pub(in crate::linear::cpu::f32_decode) type Q5K = KQuant<true>;
        impl<const FIFTH: bool> Block for KQuant<FIFTH> {
            const BYTES: usize = if FIFTH { Q5_K_BYTES } else { Q4_K_BYTES };
            const VALUES: usize = QK_K;
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(a: *const u8, b: *const u8, c: usize) -> [F; 4] {
                // SAFETY (caller): BYTES readable bytes at each pointer, c < 8.
                unsafe {
                    let (block_a, block_b) = (
                        std::slice::from_raw_parts(a, Self::BYTES),
                        std::slice::from_raw_parts(b, Self::BYTES),
                    );
                    let (scale_a, min_a) = k4_factors(block_a, c);
                    let (scale_b, min_b) = k4_factors(block_b, c);
                    let (scales, mins) = (pair(scale_a, scale_b), pair(min_a, min_b));
                    let qs = if FIFTH { 48 } else { 16 } + 32 * (c / 2);
                    four!(i => {
                        let packed = ubytes(a, b, qs + 8 * i);
                        let mut q = if c.is_multiple_of(2) {
                            low4(packed)
                        } else {
                            high4(packed)
                        };
                        if FIFTH {
                            q = or(q, shl4(bits(ubytes(a, b, 16 + 8 * i), c as i32, 1)));
                        }
                        sub(mul(scales, to_f(q)), mins)
                    })
                }
            }
        }

        /// `block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }`: chunk `c` is values
        /// `128 h + 32 k + l` (`h = c / 4`, `k = c % 4`, `l = 0..32`): the low (`k < 2`) or
        /// high nibble of `ql[64 h + 32 (k % 2) + l]`, bits `2k, 2k + 1` of `qh[32 h + l]`
        /// above them, minus 32, times `d * scales[8 h + 2 k + l / 16]` (rounded, then the
        /// product).
        pub(in crate::linear::cpu::f32_decode) struct Q6K;
        impl Block for Q6K {
            const BYTES: usize = Q6_K_BYTES;
            const VALUES: usize = QK_K;
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(a: *const u8, b: *const u8, c: usize) -> [F; 4] {
                // SAFETY (caller): BYTES readable bytes at each pointer, c < 8.
                unsafe {
                    let (h, k) = (c / 4, c % 4);
                    let (block_a, block_b) = (
                        std::slice::from_raw_parts(a, Q6_K_BYTES),
                        std::slice::from_raw_parts(b, Q6_K_BYTES),
                    );
                    let first = 192 + 8 * h + 2 * k;
                    let scales = [
                        pair(q6_scale(block_a, first), q6_scale(block_b, first)),
                        pair(q6_scale(block_a, first + 1), q6_scale(block_b, first + 1)),
                    ];
                    let (ql, qh) = (64 * h + 32 * (k % 2), 128 + 32 * h);
                    four!(i => {
                        let packed = ubytes(a, b, ql + 8 * i);
                        let low = if k < 2 { low4(packed) } else { high4(packed) };
                        let high = bits(ubytes(a, b, qh + 8 * i), 2 * k as i32, 3);
                        let q = sub_i(or(low, shl4(high)), 32);
                        mul(scales[i / 2], to_f(q))
                    })
                }
            }
        }
    };
}

/// The scale and the subtracted minimum of sub-block `c` of a Q4_K or Q5_K block:
/// `(d * scale, dmin * min)`, as `pagoda_tensor::quant::blocks::q4_k` computes them.
#[inline(always)]
fn k4_factors(block: &[u8], c: usize) -> (f32, f32) {
    let (scale, min) = scale_min_k4(c, block[4..16].try_into().unwrap());
    (
        f16_at(block, 0) * scale as f32,
        f16_at(block, 2) * min as f32,
    )
}

/// `d * scales[at - 192]` of a Q6_K block (one rounding), as `quant::blocks::q6_k`.
#[inline(always)]
fn q6_scale(block: &[u8], at: usize) -> f32 {
    f16_at(block, 208) * (block[at] as i8) as f32
}

/// Prefetches the line holding byte `at` of every row in `ahead`.
#[inline(always)]
unsafe fn prefetch(ahead: &[*const u8; WIDE_ROWS], at: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    for r in ahead {
        // SAFETY: a prefetch never faults; `at` lies inside every row (callers).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(at) as *const i8) };
    }
}

/// Two rows per 512-bit register (AVX-512 F/BW/DQ/VL).
pub(super) mod wide {
    use std::arch::x86_64::*;

    use super::*;

    type F = __m512;
    type I = __m512i;

    decoders!("avx512f,avx512bw,avx512dq,avx512vl,f16c");

    /// Bytes `at..at + 8` of `a` (lanes 0..8) and of `b` (lanes 8..16), zero-extended.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    unsafe fn ubytes(a: *const u8, b: *const u8, at: usize) -> I {
        // SAFETY (caller): 8 readable bytes at a + at and b + at.
        unsafe {
            let qa = _mm_loadl_epi64(a.add(at) as *const __m128i);
            let qb = _mm_loadl_epi64(b.add(at) as *const __m128i);
            _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(qa, qb))
        }
    }
    /// As [`ubytes`], sign-extended.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    unsafe fn ibytes(a: *const u8, b: *const u8, at: usize) -> I {
        // SAFETY (caller): 8 readable bytes at a + at and b + at.
        unsafe {
            let qa = _mm_loadl_epi64(a.add(at) as *const __m128i);
            let qb = _mm_loadl_epi64(b.add(at) as *const __m128i);
            _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(qa, qb))
        }
    }
    /// Lanes 0..8 hold `a`, lanes 8..16 hold `b`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    fn pair(a: f32, b: f32) -> F {
        _mm512_insertf32x8::<1>(_mm512_set1_ps(a), _mm256_set1_ps(b))
    }
    /// The f16 at `a + at` in lanes 0..8 and the one at `b + at` in lanes 8..16 (exact).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    unsafe fn pair_f16(a: *const u8, b: *const u8, at: usize) -> F {
        // SAFETY (caller): two readable bytes at a + at and b + at.
        let (a, b) = unsafe {
            (
                std::ptr::read_unaligned(a.add(at) as *const u16) as u32,
                std::ptr::read_unaligned(b.add(at) as *const u16) as u32,
            )
        };
        let both = _mm_cvtph_ps(_mm_cvtsi32_si128((a | (b << 16)) as i32));
        let index = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        _mm512_permutexvar_ps(index, _mm512_zextps128_ps512(both))
    }
    lane_ops!(
        "avx512f,avx512bw,avx512dq,avx512vl,f16c",
        _mm512_set1_epi32,
        _mm512_and_si512,
        _mm512_srli_epi32,
        _mm512_srl_epi32,
        _mm512_slli_epi32,
        _mm512_or_si512,
        _mm512_sub_epi32,
        _mm512_cvtepi32_ps,
        _mm512_mul_ps,
        _mm512_add_ps,
        _mm512_sub_ps
    );

    /// See [`super::super::rows8`]. SAFETY (caller): AVX-512 F/BW/DQ/VL, AVX2, FMA, F16C;
    /// every row (and every row of `ahead`) holds `k / B::VALUES` blocks of `B::BYTES`
    /// bytes, every activation row holds `k` values, and `k % B::VALUES == 0`.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    pub(in super::super) unsafe fn rows8<B: Block, const T: usize>(
        rows: [&[u8]; WIDE_ROWS],
        ahead: [&[u8]; WIDE_ROWS],
        x: [&[f32]; T],
    ) -> [[f32; T]; WIDE_ROWS] {
        const PAIRS: usize = WIDE_ROWS / 2;
        let k = x[0].len();
        let mut acc = [[_mm512_setzero_ps(); T]; PAIRS];
        let row: [*const u8; WIDE_ROWS] = std::array::from_fn(|r| rows[r].as_ptr());
        let ahead: [*const u8; WIDE_ROWS] = std::array::from_fn(|r| ahead[r].as_ptr());
        for block in 0..k / B::VALUES {
            let offset = block * B::BYTES;
            for c in 0..B::VALUES / CHUNK {
                // SAFETY: the chunk lies inside every x, and every row holds this block.
                unsafe {
                    prefetch(&ahead, offset + c * B::BYTES * CHUNK / B::VALUES);
                    let at = block * B::VALUES + c * CHUNK;
                    if T == 1 {
                        let xs = x[0].as_ptr().add(at);
                        let xv = four!(i => _mm512_broadcast_f32x8(_mm256_loadu_ps(xs.add(8 * i))));
                        for p in 0..PAIRS {
                            let w =
                                B::decode(row[2 * p].add(offset), row[2 * p + 1].add(offset), c);
                            for i in 0..4 {
                                acc[p][0] = _mm512_fmadd_ps(w[i], xv[i], acc[p][0]);
                            }
                        }
                    } else {
                        // The activations are loaded again per pair: 4 T registers would
                        // not fit beside the accumulators.
                        for p in 0..PAIRS {
                            let w =
                                B::decode(row[2 * p].add(offset), row[2 * p + 1].add(offset), c);
                            for i in 0..4 {
                                for t in 0..T {
                                    let xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(
                                        x[t].as_ptr().add(at + 8 * i),
                                    ));
                                    acc[p][t] = _mm512_fmadd_ps(w[i], xv, acc[p][t]);
                                }
                            }
                        }
                    }
                }
            }
        }
        let mut out = [[0f32; T]; WIDE_ROWS];
        for p in 0..PAIRS {
            for t in 0..T {
                let mut lanes = [0f32; 16];
                // SAFETY: lanes has room for 16 floats.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc[p][t]) };
                out[2 * p][t] = reduce_lanes(lanes[..8].try_into().unwrap());
                out[2 * p + 1][t] = reduce_lanes(lanes[8..].try_into().unwrap());
            }
        }
        out
    }
}

/// One row per 256-bit register (AVX2 + FMA + F16C).
pub(super) mod narrow {
    use std::arch::x86_64::*;

    use super::*;

    type F = __m256;
    type I = __m256i;

    decoders!("avx2,fma,f16c");

    /// Bytes `at..at + 8` of `a`, zero-extended (`b` is not read).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn ubytes(a: *const u8, _: *const u8, at: usize) -> I {
        // SAFETY (caller): 8 readable bytes at a + at.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(a.add(at) as *const __m128i)) }
    }
    /// As [`ubytes`], sign-extended.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn ibytes(a: *const u8, _: *const u8, at: usize) -> I {
        // SAFETY (caller): 8 readable bytes at a + at.
        unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(a.add(at) as *const __m128i)) }
    }
    /// Every lane holds `a`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn pair(a: f32, _: f32) -> F {
        _mm256_set1_ps(a)
    }
    /// The f16 at `a + at` in every lane (exact).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair_f16(a: *const u8, _: *const u8, at: usize) -> F {
        // SAFETY (caller): two readable bytes at a + at.
        let bits = unsafe { std::ptr::read_unaligned(a.add(at) as *const u16) };
        _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
    }
    lane_ops!(
        "avx2,fma,f16c",
        _mm256_set1_epi32,
        _mm256_and_si256,
        _mm256_srli_epi32,
        _mm256_srl_epi32,
        _mm256_slli_epi32,
        _mm256_or_si256,
        _mm256_sub_epi32,
        _mm256_cvtepi32_ps,
        _mm256_mul_ps,
        _mm256_add_ps,
        _mm256_sub_ps
    );

    /// See [`super::super::decode_row`]. SAFETY (caller): AVX2, FMA, F16C; `row` holds
    /// `out.len() / B::VALUES` blocks of `B::BYTES` bytes and `out.len() % B::VALUES == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn decode_row<B: Block>(row: &[u8], out: &mut [f32]) {
        for block in 0..out.len() / B::VALUES {
            for c in 0..B::VALUES / CHUNK {
                // SAFETY: the block lies inside `row` and the chunk inside `out`.
                unsafe {
                    let at = row.as_ptr().add(block * B::BYTES);
                    let values = B::decode(at, at, c);
                    let to = out.as_mut_ptr().add(block * B::VALUES + c * CHUNK);
                    for (i, value) in values.iter().enumerate() {
                        _mm256_storeu_ps(to.add(8 * i), *value);
                    }
                }
            }
        }
    }

    /// See [`super::super::rows8`]. SAFETY (caller): AVX2, FMA, F16C; every row (and every
    /// row of `ahead`) holds `k / B::VALUES` blocks of `B::BYTES` bytes, every activation
    /// row holds `k` values, and `k % B::VALUES == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn rows8<B: Block, const T: usize>(
        rows: [&[u8]; WIDE_ROWS],
        ahead: [&[u8]; WIDE_ROWS],
        x: [&[f32]; T],
    ) -> [[f32; T]; WIDE_ROWS] {
        let k = x[0].len();
        let mut acc = [[_mm256_setzero_ps(); T]; WIDE_ROWS];
        let row: [*const u8; WIDE_ROWS] = std::array::from_fn(|r| rows[r].as_ptr());
        let ahead: [*const u8; WIDE_ROWS] = std::array::from_fn(|r| ahead[r].as_ptr());
        for block in 0..k / B::VALUES {
            let offset = block * B::BYTES;
            for c in 0..B::VALUES / CHUNK {
                // SAFETY: the chunk lies inside every x, and every row holds this block.
                unsafe {
                    prefetch(&ahead, offset + c * B::BYTES * CHUNK / B::VALUES);
                    let at = block * B::VALUES + c * CHUNK;
                    if T == 1 {
                        let xs = x[0].as_ptr().add(at);
                        let xv = four!(i => _mm256_loadu_ps(xs.add(8 * i)));
                        for r in 0..WIDE_ROWS {
                            let w = B::decode(row[r].add(offset), row[r].add(offset), c);
                            for i in 0..4 {
                                acc[r][0] = _mm256_fmadd_ps(w[i], xv[i], acc[r][0]);
                            }
                        }
                    } else {
                        for r in 0..WIDE_ROWS {
                            let w = B::decode(row[r].add(offset), row[r].add(offset), c);
                            for i in 0..4 {
                                for t in 0..T {
                                    let xv = _mm256_loadu_ps(x[t].as_ptr().add(at + 8 * i));
                                    acc[r][t] = _mm256_fmadd_ps(w[i], xv, acc[r][t]);
                                }
                            }
                        }
                    }
                }
            }
        }
        let mut out = [[0f32; T]; WIDE_ROWS];
        for r in 0..WIDE_ROWS {
            for t in 0..T {
                let mut lanes = [0f32; 8];
                // SAFETY: lanes has room for 8 floats.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][t]) };
                out[r][t] = reduce_lanes(&lanes);
            }
        }
        out
    }
}
