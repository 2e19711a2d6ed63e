//! The x86-64 lanes of the split-KV chunk kernels (8 with AVX2+FMA, 16 with AVX-512F) and
//! their `#[target_feature]` entry points; see [`super`].

use std::arch::x86_64::*;

use super::lanes::{Lanes, EXP2_POLY};
use super::{pass_body, ChunkArgs, HeadTask, MAX_TASKS};

/// The AVX2+FMA kernel: each task's normalized partial output and LSE (log2; zeros and
/// `-inf` for an empty range), [`MAX_TASKS`] tasks per pass over the chunk.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `head_dim % 8 == 0` and `head_dim <= MAX_HEAD_DIM`;
/// the caller validated the pool, the page table and the tasks (each `query` and `v` holds
/// `head_dim` floats, each `end` is within the request's visible tokens).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn chunk_avx2(args: &ChunkArgs<'_, '_>, tasks: &mut [HeadTask<'_>]) {
    for pass in tasks.chunks_mut(MAX_TASKS) {
        // SAFETY: forwarded from this function's contract.
        unsafe { pass_body::<Ymm>(args, pass) }
    }
}

/// The AVX-512F kernel; as [`chunk_avx2`] with `head_dim % 16 == 0`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; otherwise as [`chunk_avx2`].
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn chunk_avx512(args: &ChunkArgs<'_, '_>, tasks: &mut [HeadTask<'_>]) {
    for pass in tasks.chunks_mut(MAX_TASKS) {
        // SAFETY: forwarded from this function's contract.
        unsafe { pass_body::<Zmm>(args, pass) }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Ymm(__m256);

impl Lanes for Ymm {
    const LANES: usize = 8;
    const REGISTERS: usize = 16;
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn splat(value: f32) -> Self {
        Ymm(_mm256_set1_ps(value))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load(pointer: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable floats.
        Ymm(unsafe { _mm256_loadu_ps(pointer) })
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store(self, pointer: *mut f32) {
        // SAFETY: the caller guarantees 8 writable floats.
        unsafe { _mm256_storeu_ps(pointer, self.0) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add(self, other: Self) -> Self {
        Ymm(_mm256_add_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sub(self, other: Self) -> Self {
        Ymm(_mm256_sub_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul(self, other: Self) -> Self {
        Ymm(_mm256_mul_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul_add(self, factor: Self, addend: Self) -> Self {
        Ymm(_mm256_fmadd_ps(self.0, factor.0, addend.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn max(self, other: Self) -> Self {
        // maxps returns the second operand when either is NaN.
        Ymm(_mm256_max_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce_add(self) -> f32 {
        let quad = _mm_add_ps(
            _mm256_castps256_ps128(self.0),
            _mm256_extractf128_ps::<1>(self.0),
        );
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce_max(self) -> f32 {
        let quad = _mm_max_ps(
            _mm256_castps256_ps128(self.0),
            _mm256_extractf128_ps::<1>(self.0),
        );
        let pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp2(self) -> Self {
        let x = _mm256_min_ps(
            _mm256_max_ps(self.0, _mm256_set1_ps(-126.0)),
            _mm256_set1_ps(126.0),
        );
        let whole = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let fraction = _mm256_sub_ps(x, whole);
        let mut poly = _mm256_set1_ps(EXP2_POLY[0]);
        for &coefficient in &EXP2_POLY[1..] {
            poly = _mm256_fmadd_ps(poly, fraction, _mm256_set1_ps(coefficient));
        }
        let mantissa = _mm256_fmadd_ps(poly, fraction, _mm256_set1_ps(1.0));
        let exponent = _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(whole));
        let value = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(mantissa), exponent));
        let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(self.0, _mm256_set1_ps(-126.0));
        Ymm(_mm256_andnot_ps(underflow, value))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn prefetch(pointer: *const f32) {
        // A prefetch is a hint: it never faults or reads into Rust values.
        _mm_prefetch::<_MM_HINT_T0>(pointer as *const i8)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn transpose(rows: &[*const f32], column: usize, out: *mut f32, stride: usize) {
        // SAFETY: the caller guarantees 8 row pointers with 8 readable floats at `column`
        // and 8 writable rows of `out`.
        unsafe {
            // Plain loops, not closures: a closure does not inherit `#[target_feature]`.
            let mut r = [_mm256_setzero_ps(); 8];
            for (i, row) in r.iter_mut().enumerate() {
                *row = _mm256_loadu_ps(rows[i].add(column));
            }
            // Pairs of rows interleaved, then quads, then the 128-bit halves swapped.
            let mut t = [_mm256_setzero_ps(); 8];
            for pair in 0..4 {
                t[2 * pair] = _mm256_unpacklo_ps(r[2 * pair], r[2 * pair + 1]);
                t[2 * pair + 1] = _mm256_unpackhi_ps(r[2 * pair], r[2 * pair + 1]);
            }
            let u = [
                _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
                _mm256_shuffle_ps::<0x44>(t[4], t[6]),
                _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
                _mm256_shuffle_ps::<0x44>(t[5], t[7]),
                _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
            ];
            for c in 0..4 {
                _mm256_storeu_ps(
                    out.add(c * stride),
                    _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]),
                );
                _mm256_storeu_ps(
                    out.add((c + 4) * stride),
                    _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c]),
                );
            }
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Zmm(__m512);

impl Lanes for Zmm {
    const LANES: usize = 16;
    const REGISTERS: usize = 32;
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn splat(value: f32) -> Self {
        Zmm(_mm512_set1_ps(value))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load(pointer: *const f32) -> Self {
        // SAFETY: the caller guarantees 16 readable floats.
        Zmm(unsafe { _mm512_loadu_ps(pointer) })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn store(self, pointer: *mut f32) {
        // SAFETY: the caller guarantees 16 writable floats.
        unsafe { _mm512_storeu_ps(pointer, self.0) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn add(self, other: Self) -> Self {
        Zmm(_mm512_add_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn sub(self, other: Self) -> Self {
        Zmm(_mm512_sub_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn mul(self, other: Self) -> Self {
        Zmm(_mm512_mul_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn mul_add(self, factor: Self, addend: Self) -> Self {
        Zmm(_mm512_fmadd_ps(self.0, factor.0, addend.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn max(self, other: Self) -> Self {
        Zmm(_mm512_max_ps(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn reduce_add(self) -> f32 {
        let half = _mm256_add_ps(
            _mm512_castps512_ps256(self.0),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))),
        );
        // SAFETY: this function's features include AVX2 and FMA.
        unsafe { Ymm(half).reduce_add() }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn reduce_max(self) -> f32 {
        let half = _mm256_max_ps(
            _mm512_castps512_ps256(self.0),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))),
        );
        // SAFETY: this function's features include AVX2 and FMA.
        unsafe { Ymm(half).reduce_max() }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn exp2(self) -> Self {
        let x = _mm512_min_ps(
            _mm512_max_ps(self.0, _mm512_set1_ps(-126.0)),
            _mm512_set1_ps(126.0),
        );
        let whole = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let fraction = _mm512_sub_ps(x, whole);
        let mut poly = _mm512_set1_ps(EXP2_POLY[0]);
        for &coefficient in &EXP2_POLY[1..] {
            poly = _mm512_fmadd_ps(poly, fraction, _mm512_set1_ps(coefficient));
        }
        let mantissa = _mm512_fmadd_ps(poly, fraction, _mm512_set1_ps(1.0));
        let exponent = _mm512_slli_epi32::<23>(_mm512_cvtps_epi32(whole));
        let value = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(mantissa), exponent));
        let underflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, _mm512_set1_ps(-126.0));
        Zmm(_mm512_maskz_mov_ps(!underflow, value))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn prefetch(pointer: *const f32) {
        // A prefetch is a hint: it never faults or reads into Rust values.
        _mm_prefetch::<_MM_HINT_T0>(pointer as *const i8)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn transpose(rows: &[*const f32], column: usize, out: *mut f32, stride: usize) {
        // SAFETY: the caller guarantees 16 row pointers with 16 readable floats at `column`
        // and 16 writable rows of `out`.
        unsafe {
            // Plain loops, not closures: a closure does not inherit `#[target_feature]`.
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, row) in r.iter_mut().enumerate() {
                *row = _mm512_loadu_ps(rows[i].add(column));
            }
            // Rows interleaved in pairs: t[2p] = lo(r[2p], r[2p+1]), t[2p+1] = hi.
            let mut t = [_mm512_setzero_ps(); 16];
            for pair in 0..8 {
                t[2 * pair] = _mm512_unpacklo_ps(r[2 * pair], r[2 * pair + 1]);
                t[2 * pair + 1] = _mm512_unpackhi_ps(r[2 * pair], r[2 * pair + 1]);
            }
            // u[4g + c]: rows 4g..4g+4 at columns c, c+4, c+8, c+12 (one per 128-bit lane).
            let mut u = [_mm512_setzero_ps(); 16];
            for group in 0..4 {
                for half in 0..2 {
                    let a = _mm512_castps_pd(t[4 * group + half]);
                    let b = _mm512_castps_pd(t[4 * group + 2 + half]);
                    u[4 * group + 2 * half] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
                    u[4 * group + 2 * half + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
                }
            }
            for c in 0..4 {
                let v0 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
                let v1 = _mm512_shuffle_f32x4::<0xDD>(u[c], u[4 + c]);
                let w0 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
                let w1 = _mm512_shuffle_f32x4::<0xDD>(u[8 + c], u[12 + c]);
                _mm512_storeu_ps(out.add(c * stride), _mm512_shuffle_f32x4::<0x88>(v0, w0));
                _mm512_storeu_ps(
                    out.add((c + 8) * stride),
                    _mm512_shuffle_f32x4::<0xDD>(v0, w0),
                );
                _mm512_storeu_ps(
                    out.add((c + 4) * stride),
                    _mm512_shuffle_f32x4::<0x88>(v1, w1),
                );
                _mm512_storeu_ps(
                    out.add((c + 12) * stride),
                    _mm512_shuffle_f32x4::<0xDD>(v1, w1),
                );
            }
        }
    }
}
