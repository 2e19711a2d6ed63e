//! One-token matmuls on f32 activations (the decode step of weights that keep f32 activations,
//! `ffn_down` under the default kernels), eight weight rows at a time in AVX-512 registers.
//!
//! The [`super::f32_tile`] recipe gives every row one 8-lane accumulator chain (a fused
//! multiply-add per 8 values, in order). The AVX2 tile streams two rows, so two dependent
//! chains bound it by the FMA latency, and it decodes each block through a stack buffer.
//! Here one 512-bit register holds the 8-lane accumulators of two rows side by side (row
//! `2p` in lanes 0..8, row `2p + 1` in lanes 8..16), four registers carry eight rows, and each
//! block of both rows is decoded straight into one register: the nibbles or bytes of the two
//! rows are interleaved 8 values each, widened to 32-bit lanes, converted and scaled exactly
//! as [`pagoda_tensor::quant::dequantize`] writes them. Every lane therefore runs the
//! recipe's chain, value for value, and the result equals the AVX2 tile's bit for bit (tests
//! compare `to_bits`).
//!
//! `PAGODA_CPU_F32_DECODE=auto|avx512|avx2` (unset or empty: `auto`, AVX-512 where the CPU
//! has AVX-512 F/BW/DQ/VL, measured faster: see
//! `docs/benchmark_results/cpu-f32-decode-epyc-2026-11-30.md`); `avx2` keeps the two-row
//! tile. Logged once at INFO; [`wide_matmul_count`] counts the matmuls that ran here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use pagoda_tensor::GgmlType;

/// The environment variable that selects the one-token f32 kernel.
pub const F32_DECODE_ENV_VAR: &str = "PAGODA_CPU_F32_DECODE";

/// Rows one call of [`rows8`] dots with the activation row.
pub const WIDE_ROWS: usize = 8;

/// The one-token f32 kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum F32Decode {
    /// The two-row [`super::f32_tile::quantized_tile`] (AVX2+FMA, else portable).
    Avx2,
    /// Eight rows in 512-bit register pairs ([`rows8`]) for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K weights;
    /// other types take the two-row tile.
    Avx512,
}

impl F32Decode {
    /// Lower-case name, as [`F32_DECODE_ENV_VAR`] spells it.
    pub fn name(self) -> &'static str {
        match self {
            F32Decode::Avx2 => "avx2",
            F32Decode::Avx512 => "avx512",
        }
    }

    /// Whether this CPU runs the kernel.
    pub fn is_supported(self) -> bool {
        match self {
            F32Decode::Avx2 => true,
            F32Decode::Avx512 => has_avx512(),
        }
    }

    /// Parses an [`F32_DECODE_ENV_VAR`] value (ASCII case and surrounding spaces ignored):
    /// `auto` or empty give `Ok(None)`; anything but `avx512` and `avx2` is an error naming
    /// the value and the accepted ones.
    pub fn parse(text: &str) -> Result<Option<F32Decode>, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(None),
            "avx512" => Ok(Some(F32Decode::Avx512)),
            "avx2" => Ok(Some(F32Decode::Avx2)),
            _ => Err(format!(
                "{F32_DECODE_ENV_VAR}={text:?} is not one of auto, avx512, avx2"
            )),
        }
    }

    /// The process-wide kernel: [`F32_DECODE_ENV_VAR`] read once (unset: `auto`, AVX-512 when
    /// supported), validated against the CPU (an unsupported or unknown value falls back to
    /// `auto` with a warning) and logged once at INFO.
    pub fn selected() -> F32Decode {
        static SELECTED: OnceLock<F32Decode> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let best = if has_avx512() {
                F32Decode::Avx512
            } else {
                F32Decode::Avx2
            };
            let requested = std::env::var(F32_DECODE_ENV_VAR).unwrap_or_default();
            let kernel = match F32Decode::parse(&requested) {
                Ok(None) => best,
                Ok(Some(kernel)) if kernel.is_supported() => kernel,
                Ok(Some(kernel)) => {
                    tracing::warn!(
                        "{F32_DECODE_ENV_VAR}={}: this CPU lacks it, using auto",
                        kernel.name()
                    );
                    best
                }
                Err(message) => {
                    tracing::warn!("{message}; using auto");
                    best
                }
            };
            tracing::info!(
                "CPU one-token f32 matmuls: {} ({F32_DECODE_ENV_VAR}=auto|avx512|avx2)",
                kernel.name()
            );
            kernel
        })
    }
}

/// Whether [`rows8`] handles weights of type `ty`.
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q8_0
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
    )
}

static WIDE_MATMULS: AtomicU64 = AtomicU64::new(0);

/// How many one-token matmuls have run on [`rows8`] in this process (metrics, and tests that
/// check the dispatch).
pub fn wide_matmul_count() -> u64 {
    WIDE_MATMULS.load(Ordering::Relaxed)
}

/// Counts one matmul for [`wide_matmul_count`].
pub(crate) fn count_wide_matmul() {
    WIDE_MATMULS.fetch_add(1, Ordering::Relaxed);
}

fn has_avx512() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `out[r] = dot(decode(rows[r]), x)` for eight stored rows of type `ty` by the
/// [`super::f32_tile`] recipe (fused multiply-adds), bit-identical to
/// `quantized_tile(ty, [rows[r]], x)[0]` on an AVX2+FMA CPU. `None` when the CPU lacks
/// AVX-512 or [`supports`] is false for `ty`.
///
/// Panics if a row does not hold exactly `ty.bytes_for(x.len())` bytes (weights are
/// validated at load; a caller bug).
pub fn rows8(
    ty: GgmlType,
    rows: [&[u8]; WIDE_ROWS],
    ahead: [&[u8]; WIDE_ROWS],
    x: &[f32],
) -> Option<[f32; WIDE_ROWS]> {
    if !supports(ty) || !has_avx512() {
        return None;
    }
    assert!(
        rows.iter()
            .all(|row| ty.bytes_for(x.len()) == Some(row.len())),
        "rows8: {ty} rows must hold {} values",
        x.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512 F/BW/DQ/VL, AVX2, FMA and F16C were detected; every row holds
        // x.len() / 32 whole blocks of `ty` (checked above; the block types have k % 32 == 0).
        unsafe {
            return Some(match ty {
                GgmlType::Q4_0 => x86::rows8::<x86::Q4_0>(rows, ahead, x),
                GgmlType::Q4_1 => x86::rows8::<x86::Q4_1>(rows, ahead, x),
                GgmlType::Q4K => x86::rows8::<x86::Q4K>(rows, ahead, x),
                GgmlType::Q5K => x86::rows8::<x86::Q5K>(rows, ahead, x),
                GgmlType::Q6K => x86::rows8::<x86::Q6K>(rows, ahead, x),
                _ => x86::rows8::<x86::Q8_0>(rows, ahead, x),
            });
        }
    }
    #[allow(unreachable_code)]
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use pagoda_tensor::quant::blocks::{
        f16_at, scale_min_k4, Q4_0_BYTES, Q4_1_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES,
        Q8_0_BYTES, QK, QK_K,
    };

    use super::WIDE_ROWS;
    use crate::simd::f32_tile::reduce_lanes;

    /// A block format decoded for two rows at once, 32 values at a time: `decode(a, b, c)`
    /// gives the four registers of values `32c + 8i..32c + 8i + 8` (`i = 0..4`) of block `a`
    /// (lanes 0..8) and of block `b` (lanes 8..16), each value exactly as
    /// `pagoda_tensor::quant::blocks` decodes it.
    pub(super) trait PairBlock {
        const BYTES: usize;
        /// Values per block: 32, or 256 for the K-quants.
        const VALUES: usize;
        /// SAFETY (caller): AVX-512 F/BW/DQ/VL and F16C; `a` and `b` each point at
        /// `BYTES` readable bytes; `c < VALUES / 32`.
        unsafe fn decode(a: *const u8, b: *const u8, c: usize) -> [__m512; 4];
    }

    /// Lanes 0..8 hold `a`, lanes 8..16 hold `b`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    fn pair(a: f32, b: f32) -> __m512 {
        _mm512_insertf32x8::<1>(_mm512_set1_ps(a), _mm256_set1_ps(b))
    }

    /// Bytes `at..at + 8` of `a` (lanes 0..8) and of `b` (lanes 8..16), zero-extended to 32
    /// bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    unsafe fn bytes8(a: *const u8, b: *const u8, at: usize) -> __m512i {
        // SAFETY (caller): 8 readable bytes at a + at and b + at.
        unsafe {
            let qa = _mm_loadl_epi64(a.add(at) as *const __m128i);
            let qb = _mm_loadl_epi64(b.add(at) as *const __m128i);
            _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(qa, qb))
        }
    }

    /// Lanes 0..8 from lane `low` of `v`, lanes 8..16 from lane `high`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    unsafe fn halves(v: __m128, low: i32, high: i32) -> __m512 {
        let index = _mm512_setr_epi32(
            low, low, low, low, low, low, low, low, high, high, high, high, high, high, high, high,
        );
        _mm512_permutexvar_ps(index, _mm512_zextps128_ps512(v))
    }

    /// The f16 at `a` and the one at `b` as f32 in lanes 0 and 1 (`vcvtph2ps`, exact).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    unsafe fn two_halves_f16(a: *const u8, b: *const u8) -> __m128 {
        // SAFETY (caller): two readable bytes at each pointer.
        let (a, b) = unsafe {
            (
                std::ptr::read_unaligned(a as *const u16) as u32,
                std::ptr::read_unaligned(b as *const u16) as u32,
            )
        };
        _mm_cvtph_ps(_mm_setr_epi32((a | (b << 16)) as i32, 0, 0, 0))
    }

    /// The 16 nibble bytes at `a` and at `b` as four registers of 32-bit nibbles: values
    /// `8c..8c + 8` of each block (low nibbles are values 0..16, high nibbles 16..32).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
    unsafe fn nibbles(a: *const u8, b: *const u8) -> [__m512i; 4] {
        // SAFETY (caller): 16 readable bytes at each pointer.
        let (qa, qb) = unsafe {
            (
                _mm_loadu_si128(a as *const __m128i),
                _mm_loadu_si128(b as *const __m128i),
            )
        };
        let first = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(qa, qb));
        let second = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(qa, qb));
        let mask = _mm512_set1_epi32(0x0F);
        [
            _mm512_and_si512(first, mask),
            _mm512_and_si512(second, mask),
            _mm512_srli_epi32::<4>(first),
            _mm512_srli_epi32::<4>(second),
        ]
    }

    /// `block_q4_0 { f16 d; u8 qs[16]; }`: `(nibble - 8) * d`.
    pub(super) struct Q4_0;
    impl PairBlock for Q4_0 {
        const BYTES: usize = Q4_0_BYTES;
        const VALUES: usize = QK;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
        unsafe fn decode(a: *const u8, b: *const u8, _: usize) -> [__m512; 4] {
            // SAFETY (caller): BYTES readable bytes at each pointer.
            unsafe {
                let d = halves(two_halves_f16(a, b), 0, 1);
                let eight = _mm512_set1_epi32(8);
                nibbles(a.add(2), b.add(2))
                    .map(|q| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, eight)), d))
            }
        }
    }

    /// `block_q4_1 { f16 d; f16 m; u8 qs[16]; }`: `nibble * d + m` (multiply rounded, then
    /// add).
    pub(super) struct Q4_1;
    impl PairBlock for Q4_1 {
        const BYTES: usize = Q4_1_BYTES;
        const VALUES: usize = QK;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
        unsafe fn decode(a: *const u8, b: *const u8, _: usize) -> [__m512; 4] {
            // SAFETY (caller): BYTES readable bytes at each pointer.
            unsafe {
                let scales = halves(two_halves_f16(a, b), 0, 1);
                let mins = halves(two_halves_f16(a.add(2), b.add(2)), 0, 1);
                nibbles(a.add(4), b.add(4))
                    .map(|q| _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), scales), mins))
            }
        }
    }

    /// `block_q8_0 { f16 d; i8 qs[32]; }`: `q * d`.
    pub(super) struct Q8_0;
    impl PairBlock for Q8_0 {
        const BYTES: usize = Q8_0_BYTES;
        const VALUES: usize = QK;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
        unsafe fn decode(a: *const u8, b: *const u8, _: usize) -> [__m512; 4] {
            // SAFETY (caller): BYTES readable bytes at each pointer.
            unsafe {
                let d = halves(two_halves_f16(a, b), 0, 1);
                std::array::from_fn(|c| {
                    let qa = _mm_loadl_epi64(a.add(2 + 8 * c) as *const __m128i);
                    let qb = _mm_loadl_epi64(b.add(2 + 8 * c) as *const __m128i);
                    let q = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(qa, qb));
                    _mm512_mul_ps(_mm512_cvtepi32_ps(q), d)
                })
            }
        }
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

    /// `block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }` (with `FIFTH`,
    /// `block_q5_K`, `qh[32]` before `qs`): sub-block `c` is `(d * scale) * q - dmin * min`,
    /// `q` the low (`c` even) or high nibbles of `qs[32 (c / 2)..][..32]`, with bit `c` of
    /// `qh[l]` as its fifth bit for Q5_K.
    pub(super) struct KQuant<const FIFTH: bool>;
    pub(super) type Q4K = KQuant<false>;
    pub(super) type Q5K = KQuant<true>;
    impl<const FIFTH: bool> PairBlock for KQuant<FIFTH> {
        const BYTES: usize = if FIFTH { Q5_K_BYTES } else { Q4_K_BYTES };
        const VALUES: usize = QK_K;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
        unsafe fn decode(a: *const u8, b: *const u8, c: usize) -> [__m512; 4] {
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
                let mask = _mm512_set1_epi32(0x0F);
                let shift = _mm_cvtsi32_si128(c as i32);
                std::array::from_fn(|i| {
                    let packed = bytes8(a, b, qs + 8 * i);
                    let mut q = if c.is_multiple_of(2) {
                        _mm512_and_si512(packed, mask)
                    } else {
                        _mm512_srli_epi32::<4>(packed)
                    };
                    if FIFTH {
                        let high = _mm512_srl_epi32(bytes8(a, b, 16 + 8 * i), shift);
                        let bit =
                            _mm512_slli_epi32::<4>(_mm512_and_si512(high, _mm512_set1_epi32(1)));
                        q = _mm512_or_si512(q, bit);
                    }
                    _mm512_sub_ps(_mm512_mul_ps(scales, _mm512_cvtepi32_ps(q)), mins)
                })
            }
        }
    }

    /// `block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }`: chunk `c` is values
    /// `128 h + 32 k + l` (`h = c / 4`, `k = c % 4`, `l = 0..32`): the low (`k < 2`) or high
    /// nibble of `ql[64 h + 32 (k % 2) + l]`, bits `2k, 2k + 1` of `qh[32 h + l]` above them,
    /// minus 32, times `d * scales[8 h + 2 k + l / 16]` (one rounding, then the product).
    pub(super) struct Q6K;
    impl PairBlock for Q6K {
        const BYTES: usize = Q6_K_BYTES;
        const VALUES: usize = QK_K;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,f16c")]
        unsafe fn decode(a: *const u8, b: *const u8, c: usize) -> [__m512; 4] {
            // SAFETY (caller): BYTES readable bytes at each pointer, c < 8.
            unsafe {
                let (h, k) = (c / 4, c % 4);
                let (block_a, block_b) = (
                    std::slice::from_raw_parts(a, Q6_K_BYTES),
                    std::slice::from_raw_parts(b, Q6_K_BYTES),
                );
                let scale = |block: &[u8], s: usize| {
                    f16_at(block, 208) * (block[192 + 8 * h + 2 * k + s] as i8) as f32
                };
                let scales = [
                    pair(scale(block_a, 0), scale(block_b, 0)),
                    pair(scale(block_a, 1), scale(block_b, 1)),
                ];
                let ql = 64 * h + 32 * (k % 2);
                let qh = 128 + 32 * h;
                let mask = _mm512_set1_epi32(0x0F);
                let shift = _mm_cvtsi32_si128(2 * k as i32);
                let three = _mm512_set1_epi32(3);
                let offset = _mm512_set1_epi32(32);
                std::array::from_fn(|i| {
                    let packed = bytes8(a, b, ql + 8 * i);
                    let low = if k < 2 {
                        _mm512_and_si512(packed, mask)
                    } else {
                        _mm512_srli_epi32::<4>(packed)
                    };
                    let high =
                        _mm512_and_si512(_mm512_srl_epi32(bytes8(a, b, qh + 8 * i), shift), three);
                    let q = _mm512_sub_epi32(
                        _mm512_or_si512(low, _mm512_slli_epi32::<4>(high)),
                        offset,
                    );
                    _mm512_mul_ps(scales[i / 2], _mm512_cvtepi32_ps(q))
                })
            }
        }
    }

    /// See [`super::rows8`]. SAFETY (caller): AVX-512 F/BW/DQ/VL, AVX2, FMA, F16C; every row
    /// holds `x.len() / 32` blocks of `B::BYTES` bytes and `x.len() % 32 == 0`.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn rows8<B: PairBlock>(
        rows: [&[u8]; WIDE_ROWS],
        ahead: [&[u8]; WIDE_ROWS],
        x: &[f32],
    ) -> [f32; WIDE_ROWS] {
        const PAIRS: usize = WIDE_ROWS / 2;
        let mut acc = [_mm512_setzero_ps(); PAIRS];
        let row = rows.map(|r| r.as_ptr());
        let ahead = ahead.map(|r| r.as_ptr());
        const CHUNK: usize = 32;
        for block in 0..x.len() / B::VALUES {
            let offset = block * B::BYTES;
            for c in 0..B::VALUES / CHUNK {
                // SAFETY: the chunk lies inside x, and every row holds this block's bytes.
                unsafe {
                    for r in ahead {
                        _mm_prefetch::<_MM_HINT_T0>(
                            r.add(offset + c * B::BYTES * CHUNK / B::VALUES) as *const i8,
                        );
                    }
                    let xs = x.as_ptr().add(block * B::VALUES + c * CHUNK);
                    let xv: [__m512; 4] = std::array::from_fn(|i| {
                        _mm512_broadcast_f32x8(_mm256_loadu_ps(xs.add(8 * i)))
                    });
                    for p in 0..PAIRS {
                        let w = B::decode(row[2 * p].add(offset), row[2 * p + 1].add(offset), c);
                        for i in 0..4 {
                            acc[p] = _mm512_fmadd_ps(w[i], xv[i], acc[p]);
                        }
                    }
                }
            }
        }
        let mut out = [0f32; WIDE_ROWS];
        for p in 0..PAIRS {
            let mut lanes = [0f32; 16];
            // SAFETY: lanes has room for 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc[p]) };
            out[2 * p] = reduce_lanes(lanes[..8].try_into().unwrap());
            out[2 * p + 1] = reduce_lanes(lanes[8..].try_into().unwrap());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::f32_tile::quantized_tile;

    /// Deterministic bytes (an LCG), with every block's f16 scales replaced by sane values.
    fn rows_of(ty: GgmlType, k: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as u32
        };
        let values = ty.block_size().unwrap();
        let block_bytes = ty.bytes_for(values).unwrap();
        // Offsets of the block's f16 scales.
        let halves: &[usize] = match ty {
            GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[0],
        };
        (0..WIDE_ROWS)
            .map(|_| {
                let mut row: Vec<u8> = (0..ty.bytes_for(k).unwrap())
                    .map(|_| next() as u8)
                    .collect();
                for block in row.chunks_exact_mut(block_bytes) {
                    for &at in halves {
                        // Scales in +-[2^-14, 0.06]: normal halves, both signs, and now and
                        // then a subnormal half (exact in f32 too).
                        let magnitude = (next() % 4000) as f32 * 1.5e-5;
                        let value = if next() % 2 == 0 {
                            magnitude
                        } else {
                            -magnitude
                        };
                        let bits = if next() % 17 == 0 {
                            (next() % 0x3FF) as u16
                        } else {
                            half::f16::from_f32(value).to_bits()
                        };
                        block[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                    }
                }
                row
            })
            .collect()
    }

    #[test]
    fn rows8_equals_the_two_row_tile_bit_for_bit_and_the_f64_dot() {
        let types = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ];
        for ty in types {
            let block = ty.block_size().unwrap();
            for (seed, k) in [32usize, 64, 544, 576, 1536]
                .into_iter()
                .filter(|k| k % block == 0)
                .chain([256, 2048])
                .enumerate()
            {
                let rows = rows_of(ty, k, seed as u64 + 1);
                let x: Vec<f32> = (0..k)
                    .map(|i| ((i * 37 + seed * 11) % 101) as f32 / 25.0 - 2.0)
                    .collect();
                let refs: [&[u8]; WIDE_ROWS] = std::array::from_fn(|r| &rows[r][..]);
                let Some(got) = rows8(ty, refs, refs, &x) else {
                    assert!(!F32Decode::Avx512.is_supported(), "rows8 refused {ty}");
                    println!("no AVX-512 here: rows8 untested");
                    return;
                };
                for r in 0..WIDE_ROWS {
                    let want = quantized_tile(ty, [refs[r]], &x)[0];
                    assert_eq!(got[r].to_bits(), want.to_bits(), "{ty} k={k} row {r}");
                    let mut decoded = vec![0f32; k];
                    pagoda_tensor::quant::dequantize(ty, refs[r], &mut decoded).unwrap();
                    let (exact, scale) =
                        decoded.iter().zip(&x).fold((0f64, 0f64), |acc, (w, x)| {
                            let p = *w as f64 * *x as f64;
                            (acc.0 + p, acc.1 + p.abs())
                        });
                    assert!(
                        (got[r] as f64 - exact).abs() <= 1e-5 * scale.max(1e-6),
                        "{ty} k={k} row {r}: {} vs f64 {exact}",
                        got[r]
                    );
                }
            }
        }
    }

    #[test]
    fn other_types_and_the_switch() {
        assert!(rows8(
            GgmlType::F16,
            [&[][..]; WIDE_ROWS],
            [&[][..]; WIDE_ROWS],
            &[]
        )
        .is_none());
        assert!(!supports(GgmlType::F32));
        assert_eq!(F32Decode::parse(" AVX512 "), Ok(Some(F32Decode::Avx512)));
        assert_eq!(F32Decode::parse("avx2"), Ok(Some(F32Decode::Avx2)));
        assert_eq!(F32Decode::parse(""), Ok(None));
        assert_eq!(F32Decode::parse("auto"), Ok(None));
        let error = F32Decode::parse("sse").unwrap_err();
        assert!(
            error.contains(F32_DECODE_ENV_VAR) && error.contains("avx512"),
            "{error}"
        );
    }
}
