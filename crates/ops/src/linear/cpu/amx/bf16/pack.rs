//! The BF16 kernel's inputs: activation rows rounded to bf16, and a chunk of 32 weight rows
//! dequantized (the interleaved kernels' values, `(u - zero) * d + min`) and rounded to bf16
//! in the B-tile pair layout. A scalar version of each (the oracle, and the path on CPUs
//! without AVX-512 BF16) and an AVX-512 one, with the same bits.
//!
//! The B buffer of a chunk: per block (32 values of `k`), two tiles of 1024 bytes (weight
//! rows `0..16` and `16..32` of the chunk), tile row `p` holding the pairs
//! `(w[r][2p], w[r][2p + 1])` of its 16 rows `r` (4 bytes each).

use crate::linear::cpu::interleaved::{Interleaved, GROUP};

/// Weight rows per chunk (two B tiles).
pub const CHUNK_ROWS: usize = 32;
/// Bytes of one B tile (16 pair rows of 64 bytes).
pub const B_TILE: usize = 1024;
/// Tokens per pass (two A tiles); activation rows are padded to a multiple.
pub const PASS_TOKENS: usize = 32;

/// One cache line: the unit of the tile buffers, so that every 64-byte tile row is one line
/// (a tile load of rows that straddle lines measured slower on the Xeon host).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Line(pub [u8; 64]);

// SAFETY: 64 bytes of plain data with no padding (size 64 = alignment 64), any bit pattern
// valid.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; `Line` is `Copy` and `'static`.
unsafe impl bytemuck::Pod for Line {}

/// A 64-byte-aligned byte buffer of whole lines, reused across matmuls.
#[derive(Default)]
pub struct TileBuffer(Vec<Line>);

impl TileBuffer {
    /// An empty buffer.
    pub const fn new() -> TileBuffer {
        TileBuffer(Vec::new())
    }

    /// Resizes to `bytes` (a multiple of 64), zeroing new lines.
    fn resize(&mut self, bytes: usize) {
        assert!(bytes.is_multiple_of(64));
        self.0.resize(bytes / 64, Line([0; 64]));
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.0)
    }

    /// The bytes as bf16 values.
    pub fn as_u16(&self) -> &[u16] {
        bytemuck::cast_slice(&self.0)
    }

    fn as_u16_mut(&mut self) -> &mut [u16] {
        bytemuck::cast_slice_mut(&mut self.0)
    }
}

/// `value` rounded to bf16 as `VCVTNE2PS2BF16` does for normal values, zeros and infinities:
/// to nearest, ties to even. Denormal inputs become signed zero and NaNs stay (quiet) NaNs.
pub fn to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    if value.is_subnormal() {
        return ((bits >> 16) as u16) & 0x8000;
    }
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

/// Whether the AVX-512 conversions run on this CPU.
pub fn vector() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static VECTOR: OnceLock<bool> = OnceLock::new();
        *VECTOR.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("f16c")
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x` (`[tokens][k]`, `k` a multiple of 32) as bf16 rows into `out`, resized to
/// `[padded][k]` with `padded` the next multiple of [`PASS_TOKENS`]; padding rows are zero.
pub fn activations(x: &[f32], k: usize, out: &mut TileBuffer, use_vector: bool) {
    assert!(k > 0 && k.is_multiple_of(32) && x.len().is_multiple_of(k));
    let tokens = x.len() / k;
    let padded = tokens.div_ceil(PASS_TOKENS) * PASS_TOKENS;
    out.resize(padded * k * 2);
    let out = out.as_u16_mut();
    out[x.len()..].fill(0);
    #[cfg(target_arch = "x86_64")]
    if use_vector && vector() {
        // SAFETY: the features are present (`vector`); both slices hold `x.len()` values,
        // a multiple of 32.
        unsafe { x86::activations(x, &mut out[..x.len()]) };
        return;
    }
    let _ = use_vector;
    for (out, &value) in out.iter_mut().zip(x) {
        *out = to_bf16(value);
    }
}

/// The remainders `x - hi` rounded to bf16 into `out`, in `hi`'s layout ([`activations`]'s
/// output for the same `x`), so that `hi + lo` carries about 16 significant bits of each
/// value.
/// Non-finite remainders (of infinities, NaNs, or values that rounded to infinity) are 0.
pub fn remainders(x: &[f32], k: usize, hi: &TileBuffer, out: &mut TileBuffer, use_vector: bool) {
    let hi = hi.as_u16();
    assert!(hi.len() >= x.len() && hi.len().is_multiple_of(k) && x.len().is_multiple_of(32));
    out.resize(hi.len() * 2);
    let out = out.as_u16_mut();
    out[x.len()..].fill(0);
    #[cfg(target_arch = "x86_64")]
    if use_vector && vector() {
        // SAFETY: the features are present (`vector`); the three slices hold `x.len()`
        // values, a multiple of 32.
        unsafe { x86::remainders(x, &hi[..x.len()], &mut out[..x.len()]) };
        return;
    }
    let _ = use_vector;
    for ((out, &value), &hi) in out.iter_mut().zip(x).zip(hi) {
        let rest = value - f32::from_bits(u32::from(hi) << 16);
        *out = if rest.is_finite() { to_bf16(rest) } else { 0 };
    }
}

/// The bf16 value of row `row` (within the chunk) and column `k` in a filled B buffer.
pub fn b_value(buffer: &[u8], row: usize, k: usize) -> u16 {
    let at = (k / 32) * 2 * B_TILE
        + (row / 16) * B_TILE
        + ((k % 32) / 2) * 64
        + (row % 16) * 4
        + (k % 2) * 2;
    u16::from_le_bytes([buffer[at], buffer[at + 1]])
}

/// Fills `out` (resized to `blocks * 2 * B_TILE`) with chunk `chunk` of `weights` (rows
/// `32 chunk..`; rows past the matrix keep whatever the buffer held: they reach only C
/// columns that are never read). The weights must not have sub-scales.
pub fn weights(weights: &Interleaved, chunk: usize, out: &mut TileBuffer, use_vector: bool) {
    assert!(
        !weights.has_sub_scales(),
        "the BF16 tiles take no sub-scales"
    );
    let blocks = weights.blocks_per_row();
    out.resize(blocks * 2 * B_TILE);
    let out = out.as_bytes_mut();
    #[cfg(target_arch = "x86_64")]
    if use_vector && vector() {
        // SAFETY: the features are present (`vector`); `out` holds the chunk's tiles.
        unsafe { x86::weights(weights, chunk, out) };
        return;
    }
    let _ = use_vector;
    let mut values = [0u8; GROUP * 32];
    let (mut scales, mut mins) = ([0f32; GROUP], [0f32; GROUP]);
    for g in 0..CHUNK_ROWS / GROUP {
        let group = chunk * (CHUNK_ROWS / GROUP) + g;
        if group * GROUP >= weights.num_rows() {
            break;
        }
        for block in 0..blocks {
            weights.unpack_block(group, block, &mut values, &mut scales, &mut mins);
            for lane in 0..GROUP {
                let r = g * GROUP + lane;
                for k in 0..32 {
                    let u = values[32 * lane + k];
                    let value = (u as i32 - weights.zero()) as f32 * scales[lane] + mins[lane];
                    let at = block * 2 * B_TILE + (r / 16) * B_TILE + (k / 2) * 64 + (r % 16) * 4;
                    out[at + (k % 2) * 2..][..2].copy_from_slice(&to_bf16(value).to_le_bytes());
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::linear::cpu::interleaved::{F32_FACTORS, HALF_FACTORS, KQUANT_FACTORS};
    use std::arch::x86_64::*;

    /// [`super::activations`]' rounding, 32 values at a time. SAFETY: AVX-512F/BF16;
    /// `x.len() == out.len()`, a multiple of 32.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn activations(x: &[f32], out: &mut [u16]) {
        assert!(x.len() == out.len() && x.len().is_multiple_of(32));
        for (x, out) in x.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
            // SAFETY: 32 values at each pointer.
            unsafe {
                let lo = _mm512_loadu_ps(x.as_ptr());
                let hi = _mm512_loadu_ps(x.as_ptr().add(16));
                let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, bf);
            }
        }
    }

    /// 16 remainders `x - hi` from index `at` (0 where not finite). A function, not a
    /// closure, so that it is compiled with the caller's features.
    #[inline(always)]
    unsafe fn rest(x: &[f32], hi: &[u16], at: usize) -> __m512 {
        // SAFETY: inlined into functions with AVX-512F/BW; 16 values at `at` in each slice.
        unsafe {
            let wide =
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(hi.as_ptr().add(at) as *const __m256i));
            let value = _mm512_sub_ps(
                _mm512_loadu_ps(x.as_ptr().add(at)),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide)),
            );
            let finite = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(
                _mm512_abs_ps(value),
                _mm512_set1_ps(f32::INFINITY),
            );
            _mm512_maskz_mov_ps(finite, value)
        }
    }

    /// [`super::remainders`]' loop, 32 values at a time. SAFETY: AVX-512F/BW/BF16; the
    /// slices hold the same number of values, a multiple of 32.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn remainders(x: &[f32], hi: &[u16], out: &mut [u16]) {
        assert!(x.len() == hi.len() && x.len() == out.len() && x.len().is_multiple_of(32));
        for ((x, hi), out) in x
            .chunks_exact(32)
            .zip(hi.chunks_exact(32))
            .zip(out.chunks_exact_mut(32))
        {
            // SAFETY: 32 values at each pointer.
            unsafe {
                let (lo, high) = (rest(x, hi, 0), rest(x, hi, 16));
                let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(high, lo));
                _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, bf);
            }
        }
    }

    /// The 8 registers of block `block` of group `group`: register `s` holds each row's
    /// values `4 s .. 4 s + 4` (`[lane][4]` bytes), high bits from the planes added.
    #[inline(always)]
    unsafe fn registers(weights: &Interleaved, group: usize, block: usize) -> [__m256i; 8] {
        let stored = weights.block_weights(group, block);
        // SAFETY: inlined into functions with AVX2 and AVX-512BW/VL; `stored` holds 128
        // bytes (nibbles) or 256 (bytes).
        unsafe {
            let mut u = [_mm256_setzero_si256(); 8];
            if weights.is_nibble() {
                let low = _mm256_set1_epi8(0x0F);
                for step in 0..4 {
                    let x = _mm256_loadu_si256(stored.as_ptr().add(32 * step) as *const __m256i);
                    u[step] = _mm256_and_si256(x, low);
                    u[step + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low);
                }
                let planes = weights.planes();
                if planes > 0 {
                    let masks = weights.block_planes(group, block);
                    for (p, masks) in masks.iter().enumerate().take(planes.min(2)) {
                        let bit = _mm256_set1_epi8((1u8 << (4 + p)) as i8);
                        for (r, u) in u.iter_mut().enumerate() {
                            *u = _mm256_or_si256(*u, _mm256_maskz_mov_epi8(masks[r], bit));
                        }
                    }
                }
            } else {
                for (s, u) in u.iter_mut().enumerate() {
                    *u = _mm256_loadu_si256(stored.as_ptr().add(32 * s) as *const __m256i);
                }
            }
            u
        }
    }

    /// 16 stored values (bytes of four rows) as `(u - zero) * d + min` in f32, the multiply
    /// and the add rounded separately as in the scalar loop.
    #[inline(always)]
    unsafe fn values(bytes: __m128i, zero: __m512i, d: __m512, m: __m512) -> __m512 {
        // SAFETY: inlined into functions with AVX-512F.
        unsafe {
            let ints = _mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), zero);
            _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ints), d), m)
        }
    }

    /// 8 bytes as f32 lanes.
    #[inline(always)]
    unsafe fn byte_lanes(p: *const u8) -> __m256 {
        // SAFETY: inlined into functions with AVX2; `p` holds 8 bytes.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }

    /// [`super::weights`] with AVX-512: per register, 16 values to f32, `* d + min` (not
    /// fused, as the scalar loop), rounded to bf16, and the two groups of a tile's 16 rows
    /// interleaved into its pair rows. SAFETY: AVX2, AVX-512F/BW/VL/BF16; `out` holds the
    /// chunk's tiles.
    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn weights(weights: &Interleaved, chunk: usize, out: &mut [u8]) {
        let blocks = weights.blocks_per_row();
        assert!(out.len() >= blocks * 2 * B_TILE);
        let zero = _mm512_set1_epi32(weights.zero());
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        let first = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        let second = _mm512_add_epi32(first, _mm512_set1_epi32(4));
        let (mut scales, mut mins) = ([0f32; GROUP], [0f32; GROUP]);
        for half in 0..2 {
            for block in 0..blocks {
                let mut rows = [[_mm512_setzero_si512(); 8]; 2];
                for (g, rows) in rows.iter_mut().enumerate() {
                    let group = chunk * (CHUNK_ROWS / GROUP) + 2 * half + g;
                    if group * GROUP >= weights.num_rows() {
                        continue;
                    }
                    // SAFETY: the features are enabled; the factor bytes of each layout hold
                    // what is loaded.
                    unsafe {
                        let (d, m) = match weights.block_factor_bytes(group, block) {
                            (HALF_FACTORS, bytes, _) => (
                                _mm256_cvtph_ps(_mm_loadu_si128(bytes.as_ptr() as *const __m128i)),
                                _mm256_cvtph_ps(_mm_loadu_si128(
                                    bytes.as_ptr().add(16) as *const __m128i
                                )),
                            ),
                            (F32_FACTORS, bytes, _) => (
                                _mm256_loadu_ps(bytes.as_ptr() as *const f32),
                                _mm256_loadu_ps(bytes.as_ptr().add(32) as *const f32),
                            ),
                            (KQUANT_FACTORS, bytes, supers) => {
                                // `d * sc` and `-(dmin * m)`, as `block_factors`.
                                let d = _mm256_cvtph_ps(_mm_loadu_si128(
                                    supers.as_ptr() as *const __m128i
                                ));
                                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(
                                    supers.as_ptr().add(16) as *const __m128i,
                                ));
                                (
                                    _mm256_mul_ps(d, byte_lanes(bytes.as_ptr())),
                                    _mm256_xor_ps(
                                        _mm256_mul_ps(dmin, byte_lanes(bytes.as_ptr().add(GROUP))),
                                        _mm256_set1_ps(-0.0),
                                    ),
                                )
                            }
                            _ => {
                                weights.block_factors(group, block, &mut scales, &mut mins);
                                (
                                    _mm256_loadu_ps(scales.as_ptr()),
                                    _mm256_loadu_ps(mins.as_ptr()),
                                )
                            }
                        };
                        let (d, m) = (_mm512_castps256_ps512(d), _mm512_castps256_ps512(m));
                        let (d0, d1) = (
                            _mm512_permutexvar_ps(first, d),
                            _mm512_permutexvar_ps(second, d),
                        );
                        let (m0, m1) = (
                            _mm512_permutexvar_ps(first, m),
                            _mm512_permutexvar_ps(second, m),
                        );
                        let u = registers(weights, group, block);
                        for (s, row) in rows.iter_mut().enumerate() {
                            let lo = values(_mm256_castsi256_si128(u[s]), zero, d0, m0);
                            let hi = values(_mm256_extracti128_si256::<1>(u[s]), zero, d1, m1);
                            *row = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(
                                hi, lo,
                            ));
                        }
                    }
                }
                let tile = block * 2 * B_TILE + half * B_TILE;
                for s in 0..8 {
                    // SAFETY: two rows of 64 bytes inside the tile.
                    unsafe {
                        let dst = out.as_mut_ptr().add(tile + 2 * s * 64);
                        let pairs = _mm512_permutex2var_epi32(rows[0][s], even, rows[1][s]);
                        _mm512_storeu_si512(dst as *mut __m512i, pairs);
                        let pairs = _mm512_permutex2var_epi32(rows[0][s], odd, rows[1][s]);
                        _mm512_storeu_si512(dst.add(64) as *mut __m512i, pairs);
                    }
                }
            }
        }
    }
}
