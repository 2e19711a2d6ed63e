//! Integer dot-product tiles: `R` repacked weight rows by `T` rows of Q8 activations.
//!
//! Per 32-value block each (row, token) pair takes one unsigned-by-signed integer dot of 32
//! bytes into 8 i32 lanes (`vpdpbusd` with AVX-512 VNNI on 256-bit registers; `vpmaddubsw` +
//! `vpmaddwd` with AVX2), converted to f32 and accumulated with the product of the two block
//! scales; formats with an offset (`zero`: Q4_0, Q8_0) start each block's integer sum at
//! `-zero * sum(qa)` (computed once per activation block), so the integer part is exactly
//! `sum (u - zero) qa`; the min term `sum_b min_w s_a` is a short f32 dot per pair. Each weight block
//! loaded feeds `T` dots and each activation block `R`, so decode (`T = 1`) streams several
//! rows past one activation vector and prefill reuses both.
//!
//! The result equals [`pagoda_tensor::quant::repack::dot_scalar`] up to f32 rounding (the
//! integer parts are exact; the order of the float sums differs).
//!
//! Byte weights at one token (decode with VNNI) take `x86::decode_vnni_bytes`: two blocks per
//! 512-bit step, weight factors widened 8 at a time, software prefetch; its per-pair chain is
//! the 256-bit kernel's step for step, so the bits are the same. Nibble weights at one token
//! (`x86::tile_vnni_pairs` with `T = 1`) prefetch the same bytes 16 rows on and those rows'
//! factors; a prefetch changes no value.
//!
//! Weights with sub-scales (Q6_K, Q3_K: bytes, half factors) multiply each block's integer lanes
//! by the sub-scale of the half each lane covers (`vpmulld`) before the conversion; they run
//! the byte tiles (`tile_vnni` also at one token) or the AVX2 ones. Q2_K also has sub-mins:
//! per block the lanes of `m_h * (sum of 4 activation bytes)` (exact, adding up to
//! `m0 sum(qa[..16]) + m1 sum(qa[16..])`) go through a second `fma(integer * s_a, -dmin, acc)`
//! in the same accumulator, and there is no min term at the end.
//!
//! Batch invariance: every (row, token) pair of a tile runs the same chain whatever `R` and
//! `T` are (its own accumulator, blocks in order, `fma(integer * s_a, s_w, acc)`, the same
//! horizontal sum, then the min term), so `tile::<4, 4>` and `tile::<1, 1>` agree bit for
//! bit; keep it so (`tests/linear_batch_invariance.rs` checks it through `Weight::matmul`).

use pagoda_tensor::quant::q8::Q8Rows;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use pagoda_tensor::quant::repack::QuantWidth;
#[cfg(target_arch = "x86_64")]
use pagoda_tensor::quant::repack::RowFactors;
use pagoda_tensor::quant::repack::{dot_scalar, RepackedRows};

/// An instruction set for the integer tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntIsa {
    /// AVX-512 VNNI (+VL) `vpdpbusd` on 256-bit vectors.
    Vnni,
    /// AVX2 `vpmaddubsw`/`vpmaddwd`.
    Avx2,
    /// Portable scalar code ([`dot_scalar`]).
    Scalar,
    /// AMX-INT8 tiles for prefills over interleaved weights ([`crate::linear::cpu::amx`],
    /// bit-identical to the interleaved VNNI kernel); decode and these per-row tiles run VNNI.
    Amx,
    /// aarch64 NEON with the dotprod extension: `SDOT` (`vdotq_s32`), bit-identical to
    /// [`dot_scalar`] (`neon::tile_sdot`); the even prefill tiles (`2 x 2` to `4 x 4`,
    /// weights without sub-scales) on `SMMLA` where the CPU also has i8mm
    /// (`neon::tile_smmla`, the same bits).
    NeonDot,
    /// aarch64 NEON without dotprod (Cortex-A53, A72): `SMULL` + `SADALP`, bit-identical to
    /// [`dot_scalar`] (`neon::tile_smull`).
    Neon,
}

impl IntIsa {
    /// Whether this CPU can run the set.
    pub fn is_supported(self) -> bool {
        match self {
            IntIsa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            IntIsa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            IntIsa::Amx => IntIsa::Vnni.is_supported() && super::amx::detect::backend().is_some(),
            #[cfg(target_arch = "x86_64")]
            IntIsa::Vnni => {
                IntIsa::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            IntIsa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            IntIsa::NeonDot => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            #[cfg(target_arch = "x86_64")]
            IntIsa::Neon | IntIsa::NeonDot => false,
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Whether this is one of the aarch64 sets ([`IntIsa::Neon`], [`IntIsa::NeonDot`]).
    pub fn is_neon(self) -> bool {
        matches!(self, IntIsa::Neon | IntIsa::NeonDot)
    }
}

/// Counts one matmul (or shared decode region) on `isa`'s SIMD kernels: for the NEON sets
/// [`neon_matmul_count`], for the x86 ones (which prefetch) the prefetch counter; the scalar
/// kernel counts nowhere.
pub(crate) fn count_simd_matmul(isa: IntIsa) {
    if isa.is_neon() {
        NEON_MATMULS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    } else if isa != IntIsa::Scalar {
        crate::linear::cpu::prefetch::count_matmul();
    }
}

static NEON_MATMULS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Integer matmuls (or shared decode regions) run on a NEON kernel set (`neon`,
/// `neon_dotprod`) since the process started.
pub fn neon_matmul_count() -> u64 {
    NEON_MATMULS.load(std::sync::atomic::Ordering::Relaxed)
}

/// `out[r][t] = dot(weights[rows[r]], activations[tokens[t]])` for an `R x T` tile.
///
/// Panics if a row or token index is out of range or the two row lengths differ (callers
/// validate shapes once per matmul). An `isa` the CPU lacks runs the scalar kernel;
/// [`IntIsa::Amx`] runs the VNNI kernels (the AMX tiles are whole matmuls over interleaved
/// weights, [`crate::linear::cpu::amx::matmul`]).
pub fn tile<const R: usize, const T: usize>(
    isa: IntIsa,
    weights: &RepackedRows,
    rows: [usize; R],
    activations: &Q8Rows,
    tokens: [usize; T],
) -> [[f32; T]; R] {
    let isa = if isa == IntIsa::Amx {
        IntIsa::Vnni
    } else {
        isa
    };
    assert_eq!(weights.blocks_per_row(), activations.blocks_per_row());
    assert!(
        rows.iter().all(|&r| r < weights.num_rows()),
        "row out of range"
    );
    assert!(
        tokens.iter().all(|&t| t < activations.num_rows()),
        "token out of range"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if isa != IntIsa::Scalar && supported(isa) {
            let nibble = weights.width() == QuantWidth::Nibble;
            let half = weights.has_half_factors();
            let pairs = nibble && weights.blocks_per_row().is_multiple_of(2);
            if weights.has_sub_scales() {
                assert!(
                    !nibble && half,
                    "sub-scales come with byte values, half factors"
                );
                // SAFETY: as below; the rows hold byte blocks with half factors and
                // sub-scales (and with sub-mins, Q2_K, a sub-min pair per block).
                return unsafe {
                    match (isa == IntIsa::Vnni, weights.has_sub_mins()) {
                        (true, false) => x86::tile_vnni::<R, T, false, true, true, false>(
                            weights,
                            rows,
                            activations,
                            tokens,
                        ),
                        (true, true) => x86::tile_vnni::<R, T, false, true, true, true>(
                            weights,
                            rows,
                            activations,
                            tokens,
                        ),
                        (false, false) => x86::tile_avx2::<R, T, false, true, true, false>(
                            weights,
                            rows,
                            activations,
                            tokens,
                        ),
                        (false, true) => x86::tile_avx2::<R, T, false, true, true, true>(
                            weights,
                            rows,
                            activations,
                            tokens,
                        ),
                    }
                };
            }
            macro_rules! run {
                ($half:literal) => {
                    // SAFETY: the CPU has the features (checked above); indices were checked,
                    // and every row slice holds `blocks_per_row` blocks of the layout
                    // `width` names, with factors of the kind `half` names.
                    unsafe {
                        match (isa, nibble) {
                            (IntIsa::Vnni, true) if pairs => x86::tile_vnni_pairs::<R, T, $half>(
                                weights,
                                rows,
                                activations,
                                tokens,
                            ),
                            (IntIsa::Vnni, true) => {
                                x86::tile_vnni::<R, T, true, $half, false, false>(
                                    weights,
                                    rows,
                                    activations,
                                    tokens,
                                )
                            }
                            (IntIsa::Vnni, false) if T == 1 => {
                                let dots = x86::decode_vnni_bytes::<R, $half>(
                                    weights,
                                    rows,
                                    activations,
                                    tokens[0],
                                );
                                std::array::from_fn(|r| std::array::from_fn(|_| dots[r]))
                            }
                            (IntIsa::Vnni, false) => {
                                x86::tile_vnni::<R, T, false, $half, false, false>(
                                    weights,
                                    rows,
                                    activations,
                                    tokens,
                                )
                            }
                            (_, true) => x86::tile_avx2::<R, T, true, $half, false, false>(
                                weights,
                                rows,
                                activations,
                                tokens,
                            ),
                            (_, false) => x86::tile_avx2::<R, T, false, $half, false, false>(
                                weights,
                                rows,
                                activations,
                                tokens,
                            ),
                        }
                    }
                };
            }
            return if half { run!(true) } else { run!(false) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if isa.is_neon() && supported(isa) && !activations.is_q15() {
            let nibble = weights.width() == QuantWidth::Nibble;
            let half = weights.has_half_factors();
            let sub = weights.has_sub_scales();
            macro_rules! run {
                ($kernel:ident) => {
                    // SAFETY: the CPU has the features (checked above); indices were checked,
                    // and every row slice holds `blocks_per_row` blocks of the layout `width`
                    // names, with factors of the kind `half` names and sub-scales where
                    // `has_sub_scales` says (they come with byte values and half factors).
                    unsafe {
                        match (nibble, half, sub) {
                            (true, true, false) => neon::$kernel::<R, T, true, true, false>(
                                weights,
                                rows,
                                activations,
                                tokens,
                            ),
                            (true, false, false) => neon::$kernel::<R, T, true, false, false>(
                                weights,
                                rows,
                                activations,
                                tokens,
                            ),
                            (false, true, false) => neon::$kernel::<R, T, false, true, false>(
                                weights,
                                rows,
                                activations,
                                tokens,
                            ),
                            (false, false, false) => neon::$kernel::<R, T, false, false, false>(
                                weights,
                                rows,
                                activations,
                                tokens,
                            ),
                            (false, true, true) => neon::$kernel::<R, T, false, true, true>(
                                weights,
                                rows,
                                activations,
                                tokens,
                            ),
                            (_, _, true) => {
                                unreachable!("sub-scales come with byte values, half factors")
                            }
                        }
                    }
                };
            }
            if isa == IntIsa::NeonDot
                && !sub
                && R.is_multiple_of(2)
                && T.is_multiple_of(2)
                && R <= 4
                && T <= 4
                && neon::has_i8mm()
            {
                // SAFETY: the CPU has i8mm (checked); R and T even and at most 4; no
                // sub-scales; the rows as above.
                return unsafe {
                    match (nibble, half) {
                        (true, true) => {
                            neon::tile_smmla::<R, T, true, true>(weights, rows, activations, tokens)
                        }
                        (true, false) => neon::tile_smmla::<R, T, true, false>(
                            weights,
                            rows,
                            activations,
                            tokens,
                        ),
                        (false, true) => neon::tile_smmla::<R, T, false, true>(
                            weights,
                            rows,
                            activations,
                            tokens,
                        ),
                        (false, false) => neon::tile_smmla::<R, T, false, false>(
                            weights,
                            rows,
                            activations,
                            tokens,
                        ),
                    }
                };
            }
            return if isa == IntIsa::NeonDot {
                run!(tile_sdot)
            } else {
                run!(tile_smull)
            };
        }
    }
    let _ = isa;
    std::array::from_fn(|r| {
        std::array::from_fn(|t| dot_scalar(weights, rows[r], activations, tokens[t]))
    })
}

/// Cached [`IntIsa::is_supported`].
#[cfg(target_arch = "x86_64")]
fn supported(isa: IntIsa) -> bool {
    use std::sync::OnceLock;
    static VNNI: OnceLock<bool> = OnceLock::new();
    static AVX2: OnceLock<bool> = OnceLock::new();
    match isa {
        IntIsa::Vnni => *VNNI.get_or_init(|| IntIsa::Vnni.is_supported()),
        IntIsa::Avx2 => *AVX2.get_or_init(|| IntIsa::Avx2.is_supported()),
        IntIsa::Scalar => true,
        IntIsa::Amx => supported(IntIsa::Vnni),
        IntIsa::Neon | IntIsa::NeonDot => false,
    }
}

/// Cached [`IntIsa::is_supported`].
#[cfg(target_arch = "aarch64")]
fn supported(isa: IntIsa) -> bool {
    use std::sync::OnceLock;
    static NEON: OnceLock<bool> = OnceLock::new();
    static NEON_DOT: OnceLock<bool> = OnceLock::new();
    match isa {
        IntIsa::Neon => *NEON.get_or_init(|| IntIsa::Neon.is_supported()),
        IntIsa::NeonDot => *NEON_DOT.get_or_init(|| IntIsa::NeonDot.is_supported()),
        IntIsa::Scalar => true,
        IntIsa::Vnni | IntIsa::Avx2 | IntIsa::Amx => false,
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(target_arch = "aarch64")]
mod neon;
