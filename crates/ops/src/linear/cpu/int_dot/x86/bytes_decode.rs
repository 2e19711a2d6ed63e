//! The byte-weight (Q8_0, Q5_K) decode kernel: one token, `R` rows, two blocks per 512-bit
//! step, bit for bit the chain of `tile_vnni::<R, 1, false, HALF>` (see [`super::super`]).

use super::*;

/// Rows ahead of the current one whose bytes the kernel prefetches (measured on the EPYC
/// dev machine: 4 to 64 rows all help the 576-wide LM head; 16 was among the best).
const PREFETCH_ROWS: usize = 16;

/// Blocks whose weight factors [`decode_vnni_bytes`] widens to f32 at a time.
const SCALE_CHUNK: usize = 16;

/// Widens factors `start..start + count` of `base` into `out[..count]` (`count` at
/// most [`SCALE_CHUNK`]); f16 to f32 is exact, so every path gives the same bits.
/// SAFETY (caller): the factors are in range; AVX2 and F16C.
#[inline(always)]
unsafe fn widen_factors<const HALF: bool>(
    base: *const u8,
    start: usize,
    count: usize,
    out: &mut [f32; SCALE_CHUNK],
) {
    unsafe {
        if !HALF {
            let from = (base as *const f32).add(start);
            std::ptr::copy_nonoverlapping(from, out.as_mut_ptr(), count);
            return;
        }
        let halves = (base as *const u16).add(start);
        let mut j = 0;
        while j + 8 <= count {
            let bits = _mm_loadu_si128(halves.add(j) as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr().add(j), _mm256_cvtph_ps(bits));
            j += 8;
        }
        while j < count {
            let bits = halves.add(j).read_unaligned();
            out[j] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)));
            j += 1;
        }
    }
}

/// Byte weights, one token: bit for bit `tile_vnni::<R, 1, false, HALF>`, faster.
///
/// Two blocks per step on 512-bit registers: one load of 64 weight bytes per row, one
/// `vpdpbusd`, one conversion and one multiply by the two activation scales cover both
/// blocks (lanes 0..8 block `b`, lanes 8..16 block `b + 1`, each lane the same exact
/// integer as the 256-bit kernel's). The per-row chain is unchanged: the two halves
/// enter the row's 8-lane accumulator one after the other, `fma(integer * s_a, s_w,
/// acc)`, blocks in order. The weight factors are widened to f32 once per
/// [`SCALE_CHUNK`] blocks (8 at a time) instead of once per block, and the zero offset
/// and activation scales are computed once per step for all `R` rows.
/// SAFETY: as [`super::tile`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub(in crate::linear::cpu::int_dot) unsafe fn decode_vnni_bytes<
    const R: usize,
    const HALF: bool,
>(
    weights: &RepackedRows,
    rows: [usize; R],
    activations: &Q8Rows,
    token: usize,
) -> [f32; R] {
    let blocks = weights.blocks_per_row();
    let wq: [*const u8; R] = std::array::from_fn(|r| weights.row_qs(rows[r]).as_ptr());
    let factors: [(*const u8, *const u8); R] =
        std::array::from_fn(|r| factor_ptrs::<HALF>(weights, rows[r]));
    let aq = activations.row_qs(token).as_ptr();
    let ad = activations.row_scales(token).as_ptr();
    let has_zero = weights.zero() != 0;
    let zero_wide = _mm512_set1_epi8(weights.zero() as u8 as i8);
    let zero = _mm256_set1_epi8(weights.zero() as u8 as i8);
    let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    // Rows are contiguous: the same block `PREFETCH_ROWS` rows on
    // (past the last row the address is never read: a prefetch does not fault).
    let ahead = PREFETCH_ROWS * blocks * 32;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut scales = [[0f32; SCALE_CHUNK]; R];
    let mut chunk_start = 0;
    while chunk_start < blocks {
        let count = (blocks - chunk_start).min(SCALE_CHUNK);
        // SAFETY: chunk_start + count <= blocks; every row holds `blocks` blocks and
        // factors; the activation row holds `blocks` blocks and scales.
        unsafe {
            for r in 0..R {
                widen_factors::<HALF>(factors[r].0, chunk_start, count, &mut scales[r]);
            }
            let mut j = 0;
            while j + 2 <= count {
                let b = chunk_start + j;
                let a = _mm512_loadu_si512(aq.add(b * 32) as *const __m512i);
                let start = if has_zero {
                    _mm512_sub_epi32(
                        _mm512_setzero_si512(),
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), zero_wide, a),
                    )
                } else {
                    _mm512_setzero_si512()
                };
                let da_pair = _mm_castsi128_ps(_mm_loadl_epi64(ad.add(b) as *const __m128i));
                let da = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(da_pair));
                for r in 0..R {
                    let at = wq[r].add(b * 32);
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(ahead) as *const i8);
                    let w = _mm512_loadu_si512(at as *const __m512i);
                    let integer = _mm512_dpbusd_epi32(start, w, a);
                    let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(integer), da);
                    let first = _mm512_castps512_ps256(scaled);
                    let second =
                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(scaled), 1));
                    let dw_first = _mm256_broadcast_ss(&scales[r][j]);
                    let dw_second = _mm256_broadcast_ss(&scales[r][j + 1]);
                    acc[r] = _mm256_fmadd_ps(first, dw_first, acc[r]);
                    acc[r] = _mm256_fmadd_ps(second, dw_second, acc[r]);
                }
                j += 2;
            }
            if j < count {
                // The odd last block (SCALE_CHUNK is even), as the 256-bit kernel.
                let b = chunk_start + j;
                let a = _mm256_loadu_si256(aq.add(b * 32) as *const __m256i);
                let start = if has_zero {
                    start_vnni(zero, a)
                } else {
                    _mm256_setzero_si256()
                };
                let da = _mm256_broadcast_ss(&*ad.add(b));
                for r in 0..R {
                    let w = load_weights::<false>(wq[r], b);
                    let integer = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, w, a));
                    let dw = _mm256_broadcast_ss(&scales[r][j]);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(integer, da), dw, acc[r]);
                }
            }
        }
        chunk_start += count;
    }
    let sums = activations.row_sums(token);
    std::array::from_fn(|r| {
        let mins = factors[r].1;
        // SAFETY: the features are enabled in this function; a non-null `mins` holds
        // one factor per block, as many as the token's sums.
        unsafe {
            let min_term = if mins.is_null() {
                0.0
            } else {
                min_term::<HALF>(mins, sums)
            };
            horizontal_sum(acc[r]) + min_term
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_tensor::quant::repack::repack;
    use pagoda_tensor::GgmlType;

    /// A deterministic pseudo-random sequence (no dev-dependency needed).
    fn next(state: &mut u64) -> u64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *state >> 33
    }

    /// `num_rows` Q8_0 rows of `blocks` blocks: f16 scales in (-0.05, 0.05), random bytes.
    fn q8_0_rows(num_rows: usize, blocks: usize, state: &mut u64) -> RepackedRows {
        let mut bytes = Vec::new();
        for _ in 0..num_rows * blocks {
            let scale = (next(state) % 1000) as f32 / 10_000.0 - 0.05;
            bytes.extend(half::f16::from_f32(scale).to_le_bytes());
            bytes.extend((0..32).map(|_| next(state) as u8));
        }
        repack(GgmlType::Q8_0, num_rows, blocks * 32, &bytes).expect("valid Q8_0 rows")
    }

    #[test]
    fn decode_equals_the_256_bit_tile_bit_for_bit_and_the_scalar_dot() {
        if !IntIsa::Vnni.is_supported() {
            println!("skipped: this CPU lacks AVX-512 VNNI");
            return;
        }
        let mut state = 7;
        // Chunk edges (16), odd tails, one block; 9 rows so the prefetch runs past the end.
        for blocks in [1usize, 2, 3, 15, 16, 17, 18, 31, 32, 33, 48] {
            let weights = q8_0_rows(9, blocks, &mut state);
            let x: Vec<f32> = (0..2 * blocks * 32)
                .map(|_| (next(&mut state) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let activations = Q8Rows::quantize(&x, blocks * 32).unwrap();
            for token in 0..2 {
                for first in 0..=5 {
                    let rows = [first, first + 1, first + 2, first + 3];
                    // SAFETY: VNNI checked above; indices are in range.
                    let (fast, reference, single) = unsafe {
                        (
                            decode_vnni_bytes::<4, true>(&weights, rows, &activations, token),
                            tile_vnni::<4, 1, false, true, false, false>(
                                &weights,
                                rows,
                                &activations,
                                [token],
                            ),
                            decode_vnni_bytes::<1, true>(&weights, [first], &activations, token),
                        )
                    };
                    assert_eq!(fast[0].to_bits(), single[0].to_bits(), "blocks {blocks}");
                    for r in 0..4 {
                        let context = format!("blocks {blocks} token {token} row {}", rows[r]);
                        assert_eq!(fast[r].to_bits(), reference[r][0].to_bits(), "{context}");
                        let exact = dot_scalar(&weights, rows[r], &activations, token);
                        let tolerance = 1e-5 * (1.0 + exact.abs());
                        assert!((fast[r] - exact).abs() <= tolerance, "{context}");
                    }
                }
            }
        }
    }
}
