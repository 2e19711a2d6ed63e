//! The x86 kernels of the per-row integer tiles (VNNI and AVX2); see [`super`].

use super::*;
use std::arch::x86_64::*;

/// Row `row`'s scales and mins as raw pointers (`mins` null when the format has none);
/// the element type is u16 half bits when `HALF`, else f32.
#[inline(always)]
fn factor_ptrs<const HALF: bool>(weights: &RepackedRows, row: usize) -> (*const u8, *const u8) {
    match weights.row_factors(row) {
        RowFactors::Half { scales, mins } => {
            debug_assert!(HALF);
            let mins = if mins.is_empty() {
                std::ptr::null()
            } else {
                mins.as_ptr() as *const u8
            };
            (scales.as_ptr() as *const u8, mins)
        }
        RowFactors::Single { scales, mins } => {
            debug_assert!(!HALF);
            let mins = if mins.is_empty() {
                std::ptr::null()
            } else {
                mins.as_ptr() as *const u8
            };
            (scales.as_ptr() as *const u8, mins)
        }
    }
}

/// Factor `block` of `base` broadcast to 8 lanes. SAFETY (caller): in range, F16C.
#[inline(always)]
unsafe fn broadcast_factor<const HALF: bool>(base: *const u8, block: usize) -> __m256 {
    unsafe {
        if HALF {
            let bits = (base as *const u16).add(block).read_unaligned();
            _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
        } else {
            _mm256_broadcast_ss(&*(base as *const f32).add(block))
        }
    }
}

/// Factors `block` and `block + 1`: lanes 0..4 the first, lanes 4..8 the second.
/// SAFETY (caller): both in range, AVX2 and F16C.
#[inline(always)]
unsafe fn factor_pair<const HALF: bool>(base: *const u8, block: usize) -> __m256 {
    unsafe {
        let spread = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
        let both = if HALF {
            let bits = (base as *const u32).byte_add(block * 2).read_unaligned();
            _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
        } else {
            _mm_castsi128_ps(_mm_loadl_epi64(base.add(block * 4) as *const __m128i))
        };
        _mm256_permutevar8x32_ps(_mm256_castps128_ps256(both), spread)
    }
}

/// The min term `sum_b min_b s_a[b]` of one (row, token) pair, by one recipe for every
/// tile shape: 8 lanes, blocks in order, the lanes summed as [`horizontal_sum`] does,
/// then the leftover blocks in order. SAFETY (caller): `mins` holds `sums.len()`
/// factors; AVX2, FMA, F16C.
#[inline(always)]
unsafe fn min_term<const HALF: bool>(mins: *const u8, sums: &[f32]) -> f32 {
    unsafe {
        let n = sums.len();
        let mut acc = _mm256_setzero_ps();
        let mut b = 0;
        while b + 8 <= n {
            let m = if HALF {
                _mm256_cvtph_ps(_mm_loadu_si128(
                    (mins as *const u16).add(b) as *const __m128i
                ))
            } else {
                _mm256_loadu_ps((mins as *const f32).add(b))
            };
            acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(sums.as_ptr().add(b)), acc);
            b += 8;
        }
        let mut total = horizontal_sum(acc);
        while b < n {
            let m = if HALF {
                pagoda_tensor::quant::blocks::f16_bits_to_f32(
                    (mins as *const u16).add(b).read_unaligned(),
                )
            } else {
                (mins as *const f32).add(b).read_unaligned()
            };
            total = m.mul_add(sums[b], total);
            b += 1;
        }
        total
    }
}

/// 32 weight values of block `b` as unsigned bytes, in value order.
#[inline(always)]
unsafe fn load_weights<const NIBBLE: bool>(base: *const u8, block: usize) -> __m256i {
    // SAFETY (caller): `base` points at a row of whole blocks and `block` is in range.
    unsafe {
        if NIBBLE {
            let packed = _mm_loadu_si128(base.add(block * 16) as *const __m128i);
            let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
        } else {
            _mm256_loadu_si256(base.add(block * 32) as *const __m256i)
        }
    }
}

/// The block's integer lanes (lane `i`: values `4 i .. 4 i + 4`), each times `sub`'s lane
/// with `SUB` (`sub`: the half's sub-scale per lane, [`sub_lanes`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
#[inline]
unsafe fn idot_vnni<const NIBBLE: bool, const SUB: bool>(
    start: __m256i,
    w: __m256i,
    a: __m256i,
    _a16: [__m256i; 2],
    sub: __m256i,
) -> __m256i {
    let dot = _mm256_dpbusd_epi32(start, w, a);
    if SUB {
        _mm256_mullo_epi32(dot, sub)
    } else {
        dot
    }
}

/// The two sub-scales at `subs[2 block..]` as lanes: the first in lanes 0..4 (values
/// 0..16 of the block), the second in lanes 4..8. SAFETY (caller): in range, AVX2.
#[inline(always)]
unsafe fn sub_lanes(subs: *const u8, block: usize) -> __m256i {
    unsafe {
        let pair = (subs as *const u16).add(block).read_unaligned();
        let both = _mm256_cvtepi8_epi32(_mm_cvtsi32_si128(pair as i32));
        _mm256_permutevar8x32_epi32(both, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0))
    }
}

/// `-zero * (sum of each 4 activation bytes)` per i32 lane.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
#[inline]
unsafe fn start_vnni(zero: __m256i, a: __m256i) -> __m256i {
    _mm256_sub_epi32(
        _mm256_setzero_si256(),
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), zero, a),
    )
}

/// As [`start_vnni`], with AVX2 (zero <= 128, so the i16 pair sums fit).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn start_avx2(zero: __m256i, a: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(zero, a);
    _mm256_sub_epi32(
        _mm256_setzero_si256(),
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)),
    )
}

/// The block's integer lanes (each product counted once; `start`'s lane `i` covers
/// values `4 i .. 4 i + 4`), with `SUB` each product times its half's sub-scale (`sub`
/// as [`sub_lanes`] gives it).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn idot_avx2<const NIBBLE: bool, const SUB: bool>(
    start: __m256i,
    w: __m256i,
    a: __m256i,
    a16: [__m256i; 2],
    sub: __m256i,
) -> __m256i {
    if SUB {
        // Bytes: the low 16 values (first half) and the high 16 apart.
        let first = _mm256_permutevar8x32_epi32(sub, _mm256_setzero_si256());
        let second = _mm256_permutevar8x32_epi32(sub, _mm256_set1_epi32(4));
        let w_low = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w));
        let w_high = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
        let low = _mm256_mullo_epi32(_mm256_madd_epi16(w_low, a16[0]), first);
        let high = _mm256_mullo_epi32(_mm256_madd_epi16(w_high, a16[1]), second);
        return _mm256_add_epi32(_mm256_mullo_epi32(start, sub), _mm256_add_epi32(low, high));
    }
    let dot = if NIBBLE {
        // u <= 15, so the i16 pair sums of vpmaddubsw cannot saturate.
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1))
    } else {
        // u up to 255: widen to i16 (the activations were widened once per block).
        let w_low = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w));
        let w_high = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
        _mm256_add_epi32(
            _mm256_madd_epi16(w_low, a16[0]),
            _mm256_madd_epi16(w_high, a16[1]),
        )
    };
    _mm256_add_epi32(start, dot)
}

#[target_feature(enable = "avx2")]
#[inline]
unsafe fn widen_avx2(a: __m256i) -> [__m256i; 2] {
    [
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(a)),
        _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a, 1)),
    ]
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn horizontal_sum(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
}

macro_rules! tile_fn {
    ($name:ident, $features:literal, $idot:ident, $start:ident, $widen:expr, $sum4:ident) => {
        /// See [`super::tile`]. SAFETY: the CPU has the features; indices are in range.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<
            const R: usize,
            const T: usize,
            const NIBBLE: bool,
            const HALF: bool,
            const SUB: bool,
            const SUBMIN: bool,
        >(
            weights: &RepackedRows,
            rows: [usize; R],
            activations: &Q8Rows,
            tokens: [usize; T],
        ) -> [[f32; T]; R] {
            let blocks = weights.blocks_per_row();
            let wq: [*const u8; R] = std::array::from_fn(|r| weights.row_qs(rows[r]).as_ptr());
            let factors: [(*const u8, *const u8); R] =
                std::array::from_fn(|r| factor_ptrs::<HALF>(weights, rows[r]));
            let subs: [*const u8; R] =
                std::array::from_fn(|r| weights.sub_scales(rows[r]).as_ptr() as *const u8);
            let sub_mins: [*const u8; R] =
                std::array::from_fn(|r| weights.sub_mins(rows[r]).as_ptr() as *const u8);
            let aq: [*const i8; T] =
                std::array::from_fn(|t| activations.row_qs(tokens[t]).as_ptr());
            let ad: [*const f32; T] =
                std::array::from_fn(|t| activations.row_scales(tokens[t]).as_ptr());
            let mut acc = [[_mm256_setzero_ps(); T]; R];
            let has_zero = weights.zero() != 0;
            let zero = _mm256_set1_epi8(weights.zero() as u8 as i8);
            // Each row's weights are a stream of `block_bytes` per block: one prefetch
            // per row and 64-byte line (`crate::linear::cpu::prefetch`).
            let ahead = crate::linear::cpu::prefetch::distance();
            let block_bytes = if NIBBLE { 16 } else { 32 };
            for b in 0..blocks {
                // SAFETY: b < blocks, and every row holds `blocks` blocks and scales.
                unsafe {
                    if ahead > 0 && (b * block_bytes) % 64 == 0 {
                        for row in wq {
                            crate::linear::cpu::prefetch::lines(
                                row.add(b * block_bytes),
                                ahead,
                                64,
                            );
                        }
                    }
                    let w: [__m256i; R] = std::array::from_fn(|r| load_weights::<NIBBLE>(wq[r], b));
                    let dw: [__m256; R] =
                        std::array::from_fn(|r| broadcast_factor::<HALF>(factors[r].0, b));
                    let mut sub = [_mm256_setzero_si256(); R];
                    if SUB {
                        for r in 0..R {
                            sub[r] = sub_lanes(subs[r], b);
                        }
                    }
                    // Sub-mins (Q2_K): the halves' mins as lanes, like the sub-scales, and
                    // the block's min factor (`-dmin`).
                    let mut sub_min = [_mm256_setzero_si256(); R];
                    let mut dmin = [_mm256_setzero_ps(); R];
                    if SUBMIN {
                        for r in 0..R {
                            sub_min[r] = sub_lanes(sub_mins[r], b);
                            dmin[r] = broadcast_factor::<HALF>(factors[r].1, b);
                        }
                    }
                    for t in 0..T {
                        let a = _mm256_loadu_si256(aq[t].add(b * 32) as *const __m256i);
                        let a16 = $widen(a);
                        let start = if has_zero {
                            $start(zero, a)
                        } else {
                            _mm256_setzero_si256()
                        };
                        let da = _mm256_broadcast_ss(&*ad[t].add(b));
                        // Sums of each 4 activation bytes (lanes 0..4: the first half).
                        let sums = if SUBMIN {
                            $sum4(a)
                        } else {
                            _mm256_setzero_si256()
                        };
                        for r in 0..R {
                            let integer = _mm256_cvtepi32_ps($idot::<NIBBLE, SUB>(
                                start, w[r], a, a16, sub[r],
                            ));
                            acc[r][t] =
                                _mm256_fmadd_ps(_mm256_mul_ps(integer, da), dw[r], acc[r][t]);
                            if SUBMIN {
                                // The lanes of m_h * (sum of 4 bytes), exact in i32: they add
                                // up to the block's min integer. `vpmaddwd` forms them in one
                                // uop: a sum is within +-508, so its low i16 is the value, and
                                // m_h (0..15) leaves the high i16 of its lane 0.
                                let min_integer =
                                    _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, sub_min[r]));
                                acc[r][t] = _mm256_fmadd_ps(
                                    _mm256_mul_ps(min_integer, da),
                                    dmin[r],
                                    acc[r][t],
                                );
                            }
                        }
                    }
                }
            }
            let mut out = [[0f32; T]; R];
            for r in 0..R {
                let mins = factors[r].1;
                for t in 0..T {
                    // SAFETY: the features are enabled in this function; a non-null
                    // `mins` holds one factor per block, as many as the token's sums.
                    unsafe {
                        // With sub-mins the min factor was applied block by block.
                        let min_term = if mins.is_null() || SUBMIN {
                            0.0
                        } else {
                            min_term::<HALF>(mins, activations.row_sums(tokens[t]))
                        };
                        out[r][t] = horizontal_sum(acc[r][t]) + min_term;
                    }
                }
            }
            out
        }
    };
}

#[target_feature(enable = "avx2")]
#[inline]
unsafe fn no_widen(_a: __m256i) -> [__m256i; 2] {
    [_mm256_setzero_si256(); 2]
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
#[inline]
unsafe fn widen_for_vnni(a: __m256i) -> [__m256i; 2] {
    // SAFETY: avx2 is enabled here.
    unsafe { no_widen(a) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen_for_avx2<const NIBBLE: bool>(a: __m256i) -> [__m256i; 2] {
    // SAFETY: avx2 is enabled here.
    unsafe {
        if NIBBLE {
            no_widen(a)
        } else {
            widen_avx2(a)
        }
    }
}

tile_fn!(
    tile_vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    idot_vnni,
    start_vnni,
    widen_for_vnni,
    sum4_vnni
);
tile_fn!(
    tile_avx2,
    "avx2,fma,f16c",
    idot_avx2,
    start_avx2,
    widen_for_avx2::<NIBBLE>,
    sum4_avx2
);

/// The sums of each 4 activation bytes per i32 lane.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
#[inline]
unsafe fn sum4_vnni(a: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), a)
}

/// As [`sum4_vnni`], with AVX2 (the i16 pair sums of bytes cannot saturate).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sum4_avx2(a: __m256i) -> __m256i {
    _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi8(1), a),
        _mm256_set1_epi16(1),
    )
}

/// Rows ahead of the current one whose bytes and factors [`tile_vnni_pairs`] prefetches
/// at one token (decode); prefetching changes no result bit.
const NIBBLE_PREFETCH_ROWS: usize = 16;

/// Nibble weights, two blocks per step: one 256-bit load holds both blocks' 16 packed
/// bytes, its low nibbles (values 0..16 of each block) meet the activations' first
/// halves and its high nibbles the second halves, so one `vpdpbusd` pair, one
/// conversion and one FMA cover 64 values (lanes 0..4 block `b`, lanes 4..8 block
/// `b + 1`). SAFETY: as [`super::tile`]; `blocks_per_row` is even.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub(super) unsafe fn tile_vnni_pairs<const R: usize, const T: usize, const HALF: bool>(
    weights: &RepackedRows,
    rows: [usize; R],
    activations: &Q8Rows,
    tokens: [usize; T],
) -> [[f32; T]; R] {
    let blocks = weights.blocks_per_row();
    let wq: [*const u8; R] = std::array::from_fn(|r| weights.row_qs(rows[r]).as_ptr());
    let factors: [(*const u8, *const u8); R] =
        std::array::from_fn(|r| factor_ptrs::<HALF>(weights, rows[r]));
    let aq: [*const i8; T] = std::array::from_fn(|t| activations.row_qs(tokens[t]).as_ptr());
    let ad: [*const f32; T] = std::array::from_fn(|t| activations.row_scales(tokens[t]).as_ptr());
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let has_zero = weights.zero() != 0;
    let zero = _mm256_set1_epi8(weights.zero() as u8 as i8);
    let mask = _mm256_set1_epi8(0x0F);
    // Decode streams each weight byte once: fetch the same bytes of the row
    // `NIBBLE_PREFETCH_ROWS` rows on (rows are contiguous; past the last row the
    // address is never read: a prefetch does not fault), and that row's factors.
    let ahead = NIBBLE_PREFETCH_ROWS * blocks * 16;
    if T == 1 {
        for factor in factors {
            let factor_ahead = NIBBLE_PREFETCH_ROWS * blocks * if HALF { 2 } else { 4 };
            _mm_prefetch::<_MM_HINT_T0>(factor.0.wrapping_add(factor_ahead) as *const i8);
            if !factor.1.is_null() {
                _mm_prefetch::<_MM_HINT_T0>(factor.1.wrapping_add(factor_ahead) as *const i8);
            }
        }
    }
    for b in (0..blocks).step_by(2) {
        // SAFETY: b + 1 < blocks; every row holds `blocks` blocks and scales.
        unsafe {
            let (w_low, w_high): ([__m256i; R], [__m256i; R]) = {
                let packed: [__m256i; R] = std::array::from_fn(|r| {
                    let at = wq[r].add(b * 16);
                    if T == 1 {
                        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead) as *const i8);
                    }
                    _mm256_loadu_si256(at as *const __m256i)
                });
                (
                    std::array::from_fn(|r| _mm256_and_si256(packed[r], mask)),
                    std::array::from_fn(|r| {
                        _mm256_and_si256(_mm256_srli_epi16(packed[r], 4), mask)
                    }),
                )
            };
            let dw: [__m256; R] = std::array::from_fn(|r| factor_pair::<HALF>(factors[r].0, b));
            for t in 0..T {
                let a0 = _mm256_loadu_si256(aq[t].add(b * 32) as *const __m256i);
                let a1 = _mm256_loadu_si256(aq[t].add(b * 32 + 32) as *const __m256i);
                let a_low = _mm256_permute2x128_si256(a0, a1, 0x20);
                let a_high = _mm256_permute2x128_si256(a0, a1, 0x31);
                let start = if has_zero {
                    let both = _mm256_dpbusd_epi32(
                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), zero, a_low),
                        zero,
                        a_high,
                    );
                    _mm256_sub_epi32(_mm256_setzero_si256(), both)
                } else {
                    _mm256_setzero_si256()
                };
                let da = factor_pair::<false>(ad[t] as *const u8, b);
                for r in 0..R {
                    let integer = _mm256_dpbusd_epi32(
                        _mm256_dpbusd_epi32(start, w_low[r], a_low),
                        w_high[r],
                        a_high,
                    );
                    let scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(integer), da);
                    acc[r][t] = _mm256_fmadd_ps(scaled, dw[r], acc[r][t]);
                }
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        let mins = factors[r].1;
        for t in 0..T {
            // SAFETY: the features are enabled in this function; a non-null `mins`
            // holds one factor per block, as many as the token's sums.
            unsafe {
                let min_term = if mins.is_null() {
                    0.0
                } else {
                    min_term::<HALF>(mins, activations.row_sums(tokens[t]))
                };
                out[r][t] = horizontal_sum(acc[r][t]) + min_term;
            }
        }
    }
    out
}

mod bytes_decode;
pub(super) use bytes_decode::decode_vnni_bytes;
