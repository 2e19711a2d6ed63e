//! The AVX-512 pieces of the AMX kernel loops: the nibble split of the B-tile build and
//! the f32 combine (the same operations as the portable ones in [`super`]).

use super::*;
use std::arch::x86_64::*;

/// 32 bytes of nibbles at `src` split into their low nibbles at `lo` and their high
/// nibbles at `hi`, with bit `4 + p` of byte `j` set where bit `j` of `masks_lo[p]`
/// (`masks_hi[p]`) is, for the first `planes` planes: the bytes of the scalar loop in
/// [`WeightTiles::fill`]. SAFETY: AVX2 and AVX-512BW/VL; 32 bytes at each pointer.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
#[inline]
pub(super) unsafe fn split_nibbles(
    src: *const u8,
    lo: *mut u8,
    hi: *mut u8,
    masks_lo: [u32; 2],
    masks_hi: [u32; 2],
    planes: usize,
) {
    // SAFETY: the caller's pointers hold 32 bytes each.
    unsafe {
        let bytes = _mm256_loadu_si256(src as *const __m256i);
        let nibble = _mm256_set1_epi8(0x0F);
        let mut low = _mm256_and_si256(bytes, nibble);
        let mut high = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), nibble);
        for p in 0..planes.min(2) {
            let bit = _mm256_set1_epi8((1u8 << (4 + p)) as i8);
            low = _mm256_or_si256(low, _mm256_maskz_mov_epi8(masks_lo[p], bit));
            high = _mm256_or_si256(high, _mm256_maskz_mov_epi8(masks_hi[p], bit));
        }
        _mm256_storeu_si256(lo as *mut __m256i, low);
        _mm256_storeu_si256(hi as *mut __m256i, high);
    }
}

/// [`super::combine`] with one AVX-512 vector of 16 rows per token: the same operations
/// in the same order, so the same bits. SAFETY: AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn combine(acc: &mut [[f32; TILE_ROWS]; TILE_TOKENS], step: &Step) {
    // SAFETY: every pointer is to a 16-lane array of the loaded type.
    unsafe {
        let d = _mm512_loadu_ps(step.d.as_ptr());
        let min = _mm512_loadu_ps(step.min.as_ptr());
        for (n, acc) in acc.iter_mut().enumerate() {
            let mut ints = _mm512_loadu_si512(step.c.0[n].as_ptr() as *const __m512i);
            if let Some(lo) = step.lo {
                let lo = _mm512_loadu_si512(lo.0[n].as_ptr() as *const __m512i);
                ints = _mm512_add_epi32(_mm512_slli_epi32::<7>(ints), lo);
            }
            if step.starts {
                ints = _mm512_add_epi32(ints, _mm512_set1_epi32(step.start[n]));
            }
            let integer = _mm512_cvtepi32_ps(ints);
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(step.da[n]));
            let term = _mm512_add_ps(
                _mm512_mul_ps(scale, integer),
                _mm512_mul_ps(min, _mm512_set1_ps(step.sa[n])),
            );
            let sum = _mm512_add_ps(_mm512_loadu_ps(acc.as_ptr()), term);
            _mm512_storeu_ps(acc.as_mut_ptr(), sum);
        }
    }
}
