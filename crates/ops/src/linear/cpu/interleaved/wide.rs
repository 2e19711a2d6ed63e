//! The `vnni8` kernel with 512-bit registers: two interleaved groups, 16 weight rows, per
//! vector, for decode and for prefill tiles of up to 4 tokens. The layout does not change:
//! each step loads the two groups' 32-byte records into the halves of one register, so every
//! `vpdpbusd`, unpack and float operation serves 16 rows instead of 8. Each lane runs exactly
//! the 8-row kernel's operations (the exact integer dot, then `d * d_a * integer + min * s_a`,
//! then the running sum), so the result is the same bits. Chosen by [`super::width`].

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::{
        Interleaved, GROUP, HALF_FACTORS, KQUANT_FACTORS, SUBMIN_FACTORS, SUB_FACTORS, SUPER_BYTES,
    };
    use pagoda_tensor::quant::q8::Q8Rows;
    use pagoda_tensor::quant::repack::SUPER_BLOCKS;
    use std::arch::x86_64::*;

    /// The 16 dots of groups `group` and `group + 1` with token 0 of `activations`
    /// (`[lane]`: the first group's 8 rows, then the second's), each lane the 8-row kernel's
    /// chain. SAFETY: AVX-512 F, VL and VNNI and F16C; both groups in range; `starts` empty
    /// (zero 0) or one per block of token 0.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    pub(in super::super) unsafe fn pair<
        const NIBBLE: bool,
        const FACTORS: u8,
        const Q15: bool,
        const PLANES: usize,
    >(
        weights: &Interleaved,
        group: usize,
        activations: &Q8Rows,
        starts: &[i32],
    ) -> [f32; 2 * GROUP] {
        // SAFETY: the caller's contract.
        unsafe {
            pair_tile::<1, NIBBLE, FACTORS, Q15, PLANES>(weights, group, activations, starts, [0])
                [0]
        }
    }

    /// The 16 dots of groups `group` and `group + 1` with each of `tokens` (`[token][lane]`),
    /// each lane the 8-row kernel's chain. SAFETY: AVX-512 F, VL, BW and VNNI and F16C; both
    /// groups and the tokens in range; `starts` empty (zero 0) or one per (token, block) (two
    /// with sub-scales).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    #[inline]
    pub(in super::super) unsafe fn pair_tile<
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
    ) -> [[f32; 2 * GROUP]; T] {
        let blocks = weights.blocks_per_row;
        let stride = weights.stride;
        assert!((group + 2) * GROUP <= weights.num_rows.next_multiple_of(GROUP));
        let weight_bytes = if NIBBLE { 128 + 32 * PLANES } else { 256 };
        let submin = FACTORS == SUBMIN_FACTORS;
        let sub = FACTORS == SUB_FACTORS || submin;
        // Sub-mins: the sub-scales after the scales and mins, and `starts` are the half sums.
        let sub_at = if submin { 32 } else { 16 };
        // Plain loops, not `array::from_fn`: a closure would not inherit the target features.
        let mut aq = [std::ptr::null::<u8>(); T];
        // Q15: the `lo` plane (for Q8 rows, unused).
        let mut alo = [std::ptr::null::<u8>(); T];
        let mut ad: [&[f32]; T] = [&[]; T];
        let mut sa: [&[f32]; T] = [&[]; T];
        for i in 0..T {
            assert!(tokens[i] < activations.num_rows());
            aq[i] = activations.row_qs(tokens[i]).as_ptr() as *const u8;
            alo[i] = if Q15 {
                activations.row_lo(tokens[i]).as_ptr() as *const u8
            } else {
                aq[i]
            };
            ad[i] = activations.row_scales(tokens[i]);
            sa[i] = activations.row_sums(tokens[i]);
            assert!(ad[i].len() >= blocks && sa[i].len() >= blocks);
        }
        let has_zero = !starts.is_empty();
        // SAFETY: both groups' records hold `blocks * stride` bytes (asserted above); the
        // activation rows hold `blocks` blocks of 32 bytes, scales and sums.
        unsafe {
            let first = weights.data.as_ptr().add(group * blocks * stride);
            let second = first.add(blocks * stride);
            // K-quants: both groups' `d` and `dmin` per super-block.
            let super_bytes = blocks / SUPER_BLOCKS * SUPER_BYTES;
            let supers0 = weights.supers.as_ptr().add(group * super_bytes);
            let supers1 = supers0.add(super_bytes);
            let mut acc = [_mm512_setzero_ps(); T];
            let low = _mm512_set1_epi8(0x0F);
            let ahead = crate::linear::cpu::prefetch::distance();
            for b in 0..blocks {
                let (r0, r1) = (first.add(b * stride), second.add(b * stride));
                if ahead > 0 {
                    crate::linear::cpu::prefetch::lines(r0, ahead, stride);
                    crate::linear::cpu::prefetch::lines(r1, ahead, stride);
                }
                let mut w = [_mm512_setzero_si512(); 8];
                if NIBBLE {
                    for k in 0..4 {
                        let x = join_bytes(r0.add(32 * k), r1.add(32 * k));
                        w[k] = _mm512_and_si512(x, low);
                        // A 32-bit shift then the nibble mask: the same bytes as the 8-row
                        // kernel's 16-bit shift (AVX-512F has no 16-bit shift).
                        w[k + 4] = _mm512_and_si512(_mm512_srli_epi32::<4>(x), low);
                    }
                    // The planes: both groups' masks side by side, as their bytes are.
                    for p in 0..PLANES {
                        let add = _mm512_set1_epi8(16 << p);
                        let (m0, m1) = (
                            r0.add(128 + 32 * p) as *const u32,
                            r1.add(128 + 32 * p) as *const u32,
                        );
                        for (r, w) in w.iter_mut().enumerate() {
                            let mask = m0.add(r).read_unaligned() as u64
                                | (m1.add(r).read_unaligned() as u64) << 32;
                            *w = _mm512_mask_add_epi8(*w, _cvtu64_mask64(mask), *w, add);
                        }
                    }
                } else {
                    for (k, slot) in w.iter_mut().enumerate() {
                        *slot = join_bytes(r0.add(32 * k), r1.add(32 * k));
                    }
                }
                let (f0, f1) = (r0.add(weight_bytes), r1.add(weight_bytes));
                let (d, m) = match FACTORS {
                    // No mins: the slot holds the sub-scales.
                    SUB_FACTORS => (_mm512_cvtph_ps(join_halves(f0, f1)), _mm512_setzero_ps()),
                    HALF_FACTORS | SUBMIN_FACTORS => (
                        _mm512_cvtph_ps(join_halves(f0, f1)),
                        _mm512_cvtph_ps(join_halves(f0.add(16), f1.add(16))),
                    ),
                    KQUANT_FACTORS => {
                        // `d * sc` and `-(dmin * m)`: the repacked rows' f32 values.
                        let at = b / SUPER_BLOCKS * SUPER_BYTES;
                        let (s0, s1) = (supers0.add(at), supers1.add(at));
                        let d = _mm512_cvtph_ps(join_halves(s0, s1));
                        let dmin = _mm512_cvtph_ps(join_halves(s0.add(16), s1.add(16)));
                        let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(join_sub_scales(f0, f1)));
                        let mins = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(join_sub_scales(
                            f0.add(GROUP),
                            f1.add(GROUP),
                        )));
                        let negative = _mm512_castsi512_ps(_mm512_set1_epi32(i32::MIN));
                        (
                            _mm512_mul_ps(d, sc),
                            _mm512_castsi512_ps(_mm512_xor_si512(
                                _mm512_castps_si512(_mm512_mul_ps(dmin, mins)),
                                _mm512_castps_si512(negative),
                            )),
                        )
                    }
                    _ => (
                        _mm512_castsi512_ps(join_bytes(f0, f1)),
                        _mm512_castsi512_ps(join_bytes(f0.add(32), f1.add(32))),
                    ),
                };
                for i in 0..T {
                    let a = aq[i].add(b * 32) as *const i32;
                    if sub {
                        // Each half from its own start; then s0 * first + s1 * second.
                        let lanes = |at: usize| {
                            _mm512_cvtepi8_epi32(join_sub_scales(f0.add(at), f1.add(at)))
                        };
                        let subs = [lanes(sub_at), lanes(sub_at + 8)];
                        let mut halves = if has_zero && !submin {
                            [
                                _mm512_set1_epi32(
                                    *starts.get_unchecked(2 * (tokens[i] * blocks + b)),
                                ),
                                _mm512_set1_epi32(
                                    *starts.get_unchecked(2 * (tokens[i] * blocks + b) + 1),
                                ),
                            ]
                        } else {
                            [_mm512_setzero_si512(); 2]
                        };
                        if Q15 {
                            let high = half_dots(&w, a);
                            let low = half_dots(&w, alo[i].add(b * 32) as *const i32);
                            for h in 0..2 {
                                halves[h] = _mm512_add_epi32(
                                    _mm512_add_epi32(halves[h], _mm512_slli_epi32::<7>(high[h])),
                                    low[h],
                                );
                            }
                        } else {
                            let dots = half_dots(&w, a);
                            for h in 0..2 {
                                halves[h] = _mm512_add_epi32(halves[h], dots[h]);
                            }
                        }
                        let integer = _mm512_add_epi32(
                            _mm512_mullo_epi32(halves[0], subs[0]),
                            _mm512_mullo_epi32(halves[1], subs[1]),
                        );
                        let da = _mm512_set1_ps(*ad[i].get_unchecked(b));
                        let scaled =
                            _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(integer));
                        let term = if submin {
                            // `+ (-dmin) * d_a * (m0 sum0 + m1 sum1)`, the sums from `starts`.
                            let at = 2 * (tokens[i] * blocks + b);
                            let min_integer = _mm512_add_epi32(
                                _mm512_mullo_epi32(
                                    lanes(sub_at + 16),
                                    _mm512_set1_epi32(*starts.get_unchecked(at)),
                                ),
                                _mm512_mullo_epi32(
                                    lanes(sub_at + 24),
                                    _mm512_set1_epi32(*starts.get_unchecked(at + 1)),
                                ),
                            );
                            _mm512_add_ps(
                                scaled,
                                _mm512_mul_ps(
                                    _mm512_mul_ps(m, da),
                                    _mm512_cvtepi32_ps(min_integer),
                                ),
                            )
                        } else {
                            _mm512_add_ps(
                                scaled,
                                _mm512_mul_ps(m, _mm512_set1_ps(*sa[i].get_unchecked(b))),
                            )
                        };
                        acc[i] = _mm512_add_ps(acc[i], term);
                        continue;
                    }
                    let mut integer = if has_zero {
                        _mm512_set1_epi32(*starts.get_unchecked(tokens[i] * blocks + b))
                    } else {
                        _mm512_setzero_si512()
                    };
                    if Q15 {
                        // 128 (u . hi), exact, then the `lo` dots on top.
                        let high = block_dots(_mm512_setzero_si512(), &w, a);
                        integer = _mm512_add_epi32(integer, _mm512_slli_epi32::<7>(high));
                        integer = block_dots(integer, &w, alo[i].add(b * 32) as *const i32);
                    } else {
                        integer = block_dots(integer, &w, a);
                    }
                    // The 8-row kernel's chain: d * d_a * integer + min * s_a, then the sum.
                    let scaled = _mm512_mul_ps(
                        _mm512_mul_ps(d, _mm512_set1_ps(*ad[i].get_unchecked(b))),
                        _mm512_cvtepi32_ps(integer),
                    );
                    let term = _mm512_add_ps(
                        scaled,
                        _mm512_mul_ps(m, _mm512_set1_ps(*sa[i].get_unchecked(b))),
                    );
                    acc[i] = _mm512_add_ps(acc[i], term);
                }
            }
            let mut out = [[0f32; 2 * GROUP]; T];
            for i in 0..T {
                _mm512_storeu_ps(out[i].as_mut_ptr(), acc[i]);
            }
            out
        }
    }

    /// One block's dots of the weight steps `w` (16 rows) with the activation dwords at `a`,
    /// the halves apart (steps 0..4, then 4..8). SAFETY: AVX-512 VNNI; `a` readable for 32
    /// bytes.
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn half_dots(w: &[__m512i; 8], a: *const i32) -> [__m512i; 2] {
        let mut halves = [_mm512_setzero_si512(); 2];
        for (k, weights_k) in w.iter().enumerate() {
            // SAFETY: `a` holds 8 dwords (the caller's contract).
            let dword = unsafe { a.add(k).read_unaligned() };
            halves[k / 4] =
                _mm512_dpbusd_epi32(halves[k / 4], *weights_k, _mm512_set1_epi32(dword));
        }
        halves
    }

    /// The 8 bytes at `first` then the 8 at `second` (the two groups' sub-scales, or their
    /// K-quant scales or mins), as 16 bytes. SAFETY: both readable for 8 bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn join_sub_scales(first: *const u8, second: *const u8) -> __m128i {
        unsafe {
            _mm_unpacklo_epi64(
                _mm_loadl_epi64(first as *const __m128i),
                _mm_loadl_epi64(second as *const __m128i),
            )
        }
    }

    /// `acc` plus one block's dots of the eight weight steps `w` (16 rows) with the
    /// activation dwords at `a` (32 bytes). SAFETY: AVX-512 VNNI; `a` readable for 32 bytes.
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn block_dots(mut acc: __m512i, w: &[__m512i; 8], a: *const i32) -> __m512i {
        for (k, weights_k) in w.iter().enumerate() {
            // SAFETY: `a` holds 8 dwords (the caller's contract).
            let dword = unsafe { a.add(k).read_unaligned() };
            acc = _mm512_dpbusd_epi32(acc, *weights_k, _mm512_set1_epi32(dword));
        }
        acc
    }

    /// 32 bytes at `low` and 32 at `high` as one 512-bit vector. SAFETY: AVX-512F (inlined
    /// into a caller that has it); both pointers readable for 32 bytes.
    #[inline(always)]
    unsafe fn join_bytes(low: *const u8, high: *const u8) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(low as *const __m256i)),
                _mm256_loadu_si256(high as *const __m256i),
            )
        }
    }

    /// 16 bytes at `low` and 16 at `high` as one 256-bit vector (eight f16 factors of each
    /// group). SAFETY: AVX2 (inlined into a caller that has it); both pointers readable for
    /// 16 bytes.
    #[inline(always)]
    unsafe fn join_halves(low: *const u8, high: *const u8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe {
            _mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_loadu_si128(low as *const __m128i)),
                _mm_loadu_si128(high as *const __m128i),
            )
        }
    }
}
