//! The AVX-512 VNNI kernels of the interleaved set (the 8-row group tiles); see [`super`].

use super::*;
use pagoda_tensor::quant::repack::SUPER_BLOCKS;
use std::arch::x86_64::*;

/// The dots of group `group` with every token, token `t`'s first `lanes` at `out`'s
/// columns `col..`: four tokens at a time, then one. SAFETY: AVX-512 VNNI, VL and F16C; `group` in
/// range; `starts` empty (zero 0) or one per (token, block).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) unsafe fn group<
    const NIBBLE: bool,
    const FACTORS: u8,
    const Q15: bool,
    const PLANES: usize,
>(
    weights: &Interleaved,
    group: usize,
    activations: &Q8Rows,
    starts: &[i32],
    out: &mut Columns,
    col: usize,
    lanes: usize,
) {
    let tokens = activations.num_rows();
    let mut t = 0;
    while t < tokens {
        let step = if t + 4 <= tokens { 4 } else { 1 };
        // SAFETY: as for this function; the tokens are in range.
        let dots: [[f32; GROUP]; 4] = unsafe {
            if step == 4 {
                tile::<4, NIBBLE, FACTORS, Q15, PLANES>(
                    weights,
                    group,
                    activations,
                    starts,
                    [t, t + 1, t + 2, t + 3],
                )
            } else {
                let one = tile::<1, NIBBLE, FACTORS, Q15, PLANES>(
                    weights,
                    group,
                    activations,
                    starts,
                    [t],
                );
                [one[0]; 4]
            }
        };
        for (i, values) in dots.iter().take(step).enumerate() {
            out.put(t + i, col, &values[..lanes]);
        }
        t += step;
    }
}

/// The 8 dots of group `group` with each of `tokens` (`[token][lane]`). SAFETY: AVX-512
/// VNNI, VL and F16C; `group` and `tokens` in range; `starts` empty (zero 0) or one per
/// (token, block).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn tile<
    const T: usize,
    const NIBBLE: bool,
    const FACTORS: u8,
    const Q15: bool,
    const PLANES: usize,
>(
    weights: &Interleaved,
    group: usize,
    activations: &Q8Rows,
    starts: &[i32],
    tokens: [usize; T],
) -> [[f32; GROUP]; T] {
    let blocks = weights.blocks_per_row;
    let stride = weights.stride;
    let weight_bytes = if NIBBLE { 128 + 32 * PLANES } else { 256 };
    let submin = FACTORS == SUBMIN_FACTORS;
    let sub = FACTORS == SUB_FACTORS || submin;
    // Sub-mins: the sub-scales after the scales and mins, and `starts` are the half sums.
    let sub_at = if submin { 32 } else { 16 };
    let base = unsafe { weights.data.as_ptr().add(group * blocks * stride) };
    // K-quants: this group's `d` and `dmin` per super-block.
    let supers = unsafe {
        weights
            .supers
            .as_ptr()
            .add(group * (blocks / SUPER_BLOCKS) * SUPER_BYTES)
    };
    // Plain loops, not `array::from_fn`: a closure would not inherit the target features
    // and stays an out-of-line call per token (3% of a pp512 run on the EPYC).
    let mut aq = [std::ptr::null::<u8>(); T];
    // Q15: the `lo` plane (for Q8 rows the `hi` plane again, unused).
    let mut alo = [std::ptr::null::<u8>(); T];
    let mut ad: [&[f32]; T] = [&[]; T];
    let mut sa: [&[f32]; T] = [&[]; T];
    for i in 0..T {
        aq[i] = activations.row_qs(tokens[i]).as_ptr() as *const u8;
        alo[i] = if Q15 {
            activations.row_lo(tokens[i]).as_ptr() as *const u8
        } else {
            aq[i]
        };
        ad[i] = activations.row_scales(tokens[i]);
        sa[i] = activations.row_sums(tokens[i]);
    }
    let has_zero = !starts.is_empty();
    let mut acc = [_mm256_setzero_ps(); T];
    let low = _mm256_set1_epi8(0x0F);
    let ahead = crate::linear::cpu::prefetch::distance();
    for b in 0..blocks {
        // SAFETY: the (group, block) record holds `stride` bytes; activation rows hold
        // `blocks` blocks of 32 bytes, scales and sums.
        unsafe {
            let record = base.add(b * stride);
            if ahead > 0 {
                crate::linear::cpu::prefetch::lines(record, ahead, stride);
            }
            let mut w = [_mm256_setzero_si256(); 8];
            if NIBBLE {
                for k in 0..4 {
                    let x = _mm256_loadu_si256(record.add(32 * k) as *const __m256i);
                    w[k] = _mm256_and_si256(x, low);
                    w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
                }
                // The planes: 16 (then 32) added to the bytes each register's mask selects.
                for p in 0..PLANES {
                    let add = _mm256_set1_epi8(16 << p);
                    let masks = record.add(128 + 32 * p) as *const u32;
                    for (r, w) in w.iter_mut().enumerate() {
                        let mask = _cvtu32_mask32(masks.add(r).read_unaligned());
                        *w = _mm256_mask_add_epi8(*w, mask, *w, add);
                    }
                }
            } else {
                for (k, slot) in w.iter_mut().enumerate() {
                    *slot = _mm256_loadu_si256(record.add(32 * k) as *const __m256i);
                }
            }
            let factors = record.add(weight_bytes);
            let (d, m) = match FACTORS {
                // No mins: the slot holds the sub-scales.
                SUB_FACTORS => (
                    _mm256_cvtph_ps(_mm_loadu_si128(factors as *const __m128i)),
                    _mm256_setzero_ps(),
                ),
                HALF_FACTORS | SUBMIN_FACTORS => (
                    _mm256_cvtph_ps(_mm_loadu_si128(factors as *const __m128i)),
                    _mm256_cvtph_ps(_mm_loadu_si128(factors.add(16) as *const __m128i)),
                ),
                KQUANT_FACTORS => {
                    // `d * sc` and `-(dmin * m)`: the repacked rows' f32 values.
                    let at = supers.add(b / SUPER_BLOCKS * SUPER_BYTES);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
                    let dmin = _mm256_cvtph_ps(_mm_loadu_si128(at.add(16) as *const __m128i));
                    (
                        _mm256_mul_ps(d, byte_lanes(factors)),
                        _mm256_xor_ps(
                            _mm256_mul_ps(dmin, byte_lanes(factors.add(GROUP))),
                            _mm256_set1_ps(-0.0),
                        ),
                    )
                }
                _ => (
                    _mm256_loadu_ps(factors as *const f32),
                    _mm256_loadu_ps(factors.add(32) as *const f32),
                ),
            };
            let (subs, sub_mins) = if sub {
                let lanes = |at: usize| {
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(factors.add(at) as *const __m128i))
                };
                (
                    [lanes(sub_at), lanes(sub_at + 8)],
                    [lanes(sub_at + 16), lanes(sub_at + 24)],
                )
            } else {
                ([_mm256_setzero_si256(); 2], [_mm256_setzero_si256(); 2])
            };
            for i in 0..T {
                let a = aq[i].add(b * 32) as *const i32;
                if sub {
                    // Each half from its own start; then s0 * first + s1 * second.
                    let at = 2 * (tokens[i] * blocks + b);
                    let mut halves = if has_zero && !submin {
                        [
                            _mm256_set1_epi32(*starts.get_unchecked(at)),
                            _mm256_set1_epi32(*starts.get_unchecked(at + 1)),
                        ]
                    } else {
                        [_mm256_setzero_si256(); 2]
                    };
                    if Q15 {
                        let high = half_dots(&w, a);
                        let low = half_dots(&w, alo[i].add(b * 32) as *const i32);
                        for h in 0..2 {
                            halves[h] = _mm256_add_epi32(
                                _mm256_add_epi32(halves[h], _mm256_slli_epi32::<7>(high[h])),
                                low[h],
                            );
                        }
                    } else {
                        let dots = half_dots(&w, a);
                        for h in 0..2 {
                            halves[h] = _mm256_add_epi32(halves[h], dots[h]);
                        }
                    }
                    let integer = _mm256_add_epi32(
                        _mm256_mullo_epi32(halves[0], subs[0]),
                        _mm256_mullo_epi32(halves[1], subs[1]),
                    );
                    let da = _mm256_set1_ps(*ad[i].get_unchecked(b));
                    let scaled = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(integer));
                    let term = if submin {
                        // `+ (-dmin) * d_a * (m0 sum0 + m1 sum1)`, the sums from `starts`.
                        let min_integer = _mm256_add_epi32(
                            _mm256_mullo_epi32(
                                sub_mins[0],
                                _mm256_set1_epi32(*starts.get_unchecked(at)),
                            ),
                            _mm256_mullo_epi32(
                                sub_mins[1],
                                _mm256_set1_epi32(*starts.get_unchecked(at + 1)),
                            ),
                        );
                        _mm256_add_ps(
                            scaled,
                            _mm256_mul_ps(_mm256_mul_ps(m, da), _mm256_cvtepi32_ps(min_integer)),
                        )
                    } else {
                        _mm256_add_ps(
                            scaled,
                            _mm256_mul_ps(m, _mm256_set1_ps(*sa[i].get_unchecked(b))),
                        )
                    };
                    acc[i] = _mm256_add_ps(acc[i], term);
                    continue;
                }
                let mut integer = if has_zero {
                    _mm256_set1_epi32(*starts.get_unchecked(tokens[i] * blocks + b))
                } else {
                    _mm256_setzero_si256()
                };
                if Q15 {
                    // 128 (u . hi), exact, then the `lo` dots on top.
                    let high = block_dots(_mm256_setzero_si256(), &w, a);
                    integer = _mm256_add_epi32(integer, _mm256_slli_epi32::<7>(high));
                    integer = block_dots(integer, &w, alo[i].add(b * 32) as *const i32);
                } else {
                    integer = block_dots(integer, &w, a);
                }
                // dot_scalar's chain: d * d_a * integer + min * s_a, then the running sum.
                let scaled = _mm256_mul_ps(
                    _mm256_mul_ps(d, _mm256_set1_ps(*ad[i].get_unchecked(b))),
                    _mm256_cvtepi32_ps(integer),
                );
                let term = _mm256_add_ps(
                    scaled,
                    _mm256_mul_ps(m, _mm256_set1_ps(*sa[i].get_unchecked(b))),
                );
                acc[i] = _mm256_add_ps(acc[i], term);
            }
        }
    }
    let mut out = [[0f32; GROUP]; T];
    for i in 0..T {
        // SAFETY: `out[i]` holds 8 f32.
        unsafe { _mm256_storeu_ps(out[i].as_mut_ptr(), acc[i]) };
    }
    out
}

/// One record's nibbles and `planes` bit planes as the byte layout's 8 steps of 32 bytes,
/// into `out[..256]`: the weight registers the kernels build. SAFETY: AVX-512 BW and VL;
/// `record` holds 128 + 32 `planes` bytes, `out` at least 256.
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512bw")]
pub(super) unsafe fn unpack_planes(planes: usize, record: &[u8], out: &mut [u8]) {
    assert!(record.len() >= 128 + 32 * planes && out.len() >= 256);
    let low = _mm256_set1_epi8(0x0F);
    // SAFETY: the lengths are asserted above.
    unsafe {
        let mut w = [_mm256_setzero_si256(); 8];
        for k in 0..4 {
            let x = _mm256_loadu_si256(record.as_ptr().add(32 * k) as *const __m256i);
            w[k] = _mm256_and_si256(x, low);
            w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
        }
        for p in 0..planes {
            let add = _mm256_set1_epi8(16 << p);
            let masks = record.as_ptr().add(128 + 32 * p) as *const u32;
            for (r, w) in w.iter_mut().enumerate() {
                let mask = _cvtu32_mask32(masks.add(r).read_unaligned());
                *w = _mm256_mask_add_epi8(*w, mask, *w, add);
            }
        }
        for (k, w) in w.iter().enumerate() {
            _mm256_storeu_si256(out.as_mut_ptr().add(32 * k) as *mut __m256i, *w);
        }
    }
}

/// The 8 bytes at `p` as f32 lanes (exact). SAFETY: `p` readable for 8 bytes; AVX2.
#[inline(always)]
unsafe fn byte_lanes(p: *const u8) -> __m256 {
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
}

/// One block's dots of the weight steps `w` with the activation dwords at `a`, the two
/// halves apart: steps 0..4 (values 0..16), then 4..8. SAFETY: AVX-512 VNNI and VL; `a`
/// readable for 32 bytes.
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
unsafe fn half_dots(w: &[__m256i; 8], a: *const i32) -> [__m256i; 2] {
    let mut halves = [_mm256_setzero_si256(); 2];
    for (k, weights_k) in w.iter().enumerate() {
        // SAFETY: `a` holds 8 dwords (the caller's contract).
        let dword = unsafe { a.add(k).read_unaligned() };
        halves[k / 4] = _mm256_dpbusd_epi32(halves[k / 4], *weights_k, _mm256_set1_epi32(dword));
    }
    halves
}

/// `acc` plus one block's dots of the eight weight steps `w` with the activation dwords
/// at `a` (32 bytes). SAFETY: AVX-512 VNNI and VL; `a` readable for 32 bytes.
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
unsafe fn block_dots(mut acc: __m256i, w: &[__m256i; 8], a: *const i32) -> __m256i {
    for (k, weights_k) in w.iter().enumerate() {
        // SAFETY: `a` holds 8 dwords (the caller's contract).
        let dword = unsafe { a.add(k).read_unaligned() };
        acc = _mm256_dpbusd_epi32(acc, *weights_k, _mm256_set1_epi32(dword));
    }
    acc
}
