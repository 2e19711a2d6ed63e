//! SiLU's `e^-x` as a vector polynomial: Cephes' `expf` recipe (round `x log2(e)` to the
//! nearest integer `n`, reduce `r = x - n ln 2` in two fused steps, a degree-5 polynomial,
//! scale by `2^n`), with the input clamped to `[-87, 88]` so `2^n` stays a normal float.
//! About 1 ulp from libm's `expf`; the gated product `g / (1 + e) * u` is then computed as
//! before.
//!
//! The AVX-512 (16 lanes, masked tail), AVX2 (8 lanes), NEON (4 lanes, aarch64:
//! `silu/neon.rs`) and portable versions run the same operations per element (fused
//! multiply-adds as `f32::mul_add`), so they give the same bits, whatever the slice length or
//! an element's position: prefill and decode agree.
//!
//! `PAGODA_CPU_SILU=auto|polynomial|libm` (unset or empty: `auto` = `polynomial`; `libm`, the
//! scalar `expf` formula, is the reference). The polynomial cuts SiLU from 20 to 6 ms per
//! pp512 on the EPYC (+3-5% prefill) and from 33-46 to 6-7 ms on the Xeon host (pp512
//! +3-25% in the same call, decode +1-33%; `cpu-silu-polynomial-epyc-2026-12-01.md`,
//! `cpu-q15-ffn-down-epyc-h200host-2026-12-01.md`). Its ~1 ulp differences, amplified
//! through the Q8 activation rounding of 30 layers, move single llama.cpp parity entries
//! (worst rank 1-4 entry 0.578 -> 0.792 on gather) but not the bulk the parity bounds hold
//! (95th percentile 0.28-0.30, mean 0.096-0.100). Logged once at INFO;
//! [`silu_polynomial_calls`] counts the calls that ran the polynomial.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::kernel_choice::{choose_from_env, KernelChoice};

/// The environment variable that selects how SiLU computes `e^-x`.
pub const SILU_ENV_VAR: &str = "PAGODA_CPU_SILU";

/// How SiLU computes `e^-x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SiluPath {
    /// The vector polynomial of this module (AVX-512, AVX2, NEON or portable: the same
    /// bits).
    Polynomial,
    /// libm's `expf`, one element at a time: the reference.
    Libm,
}

impl SiluPath {
    /// Lower-case name, as [`SILU_ENV_VAR`] spells it.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(self)
    }

    /// Parses a [`SILU_ENV_VAR`] value (ASCII case and surrounding spaces ignored): `auto`
    /// or empty give `Ok(None)`; anything but `polynomial` and `libm` is an error naming the
    /// value and the accepted ones.
    pub fn parse(text: &str) -> Result<Option<SiluPath>, crate::UnknownChoice> {
        crate::kernel_choice::parse(text)
    }

    /// The process-wide path: [`SILU_ENV_VAR`] read once (unset: `auto`, the polynomial: see
    /// the module docs), logged once at INFO.
    pub fn selected() -> SiluPath {
        static SELECTED: OnceLock<SiluPath> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let path = choose_from_env::<SiluPath>();
            tracing::info!(
                "CPU SiLU: {} ({SILU_ENV_VAR}=auto|polynomial|libm; {})",
                path.name(),
                match (path, vector_width()) {
                    (SiluPath::Libm, _) => "scalar expf",
                    (_, 16) => "16 lanes",
                    (_, 8) => "8 lanes",
                    (_, 4) => "4 NEON lanes",
                    _ => "portable",
                }
            );
            path
        })
    }
}

impl KernelChoice for SiluPath {
    const ENV_VAR: &'static str = SILU_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] = &[
        ("polynomial", SiluPath::Polynomial),
        ("libm", SiluPath::Libm),
    ];
    fn choice_supported(self) -> bool {
        true
    }
    fn auto_choice() -> Self {
        SiluPath::Polynomial
    }
}

static POLYNOMIAL_CALLS: AtomicU64 = AtomicU64::new(0);

/// Calls of `silu_mul_in_place` that ran the polynomial, since the process started.
pub fn silu_polynomial_calls() -> u64 {
    POLYNOMIAL_CALLS.load(Ordering::Relaxed)
}

/// Counts one call for [`silu_polynomial_calls`].
pub(super) fn count_call() {
    POLYNOMIAL_CALLS.fetch_add(1, Ordering::Relaxed);
}

/// Input range of the polynomial: `2^n` stays a normal float.
const LOW: f32 = -87.0;
const HIGH: f32 = 88.0;
/// `ln 2` in two parts (Cephes): `C1` exact in few bits, `C2` the rest.
const C1: f32 = 0.693_359_4;
const C2: f32 = -2.121_944_4e-4;
/// Cephes `expf` coefficients, highest degree first: `e^r = 1 + r + r^2 P(r)`.
const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5, // Cephes 5.0000001201e-1, which rounds to 0.5 in f32
];

/// Lanes of the vector path this CPU runs (16, 8, 4 with NEON, or 1 for the portable loop).
fn vector_width() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDTH: OnceLock<usize> = OnceLock::new();
        *WIDTH.get_or_init(|| {
            if is_x86_feature_detected!("avx512f") {
                16
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                8
            } else {
                1
            }
        })
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            4
        } else {
            1
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        1
    }
}

/// `e^x` by the module's recipe, one element (the oracle of the vector versions, which
/// mirror it operation for operation: `maxps`/`minps` semantics for the clamp).
#[inline(always)]
pub(crate) fn exp_portable(x: f32) -> f32 {
    let x = if x > LOW { x } else { LOW };
    let x = if x < HIGH { x } else { HIGH };
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-C1, x);
    let r = n.mul_add(-C2, r);
    let mut p = POLY[0];
    for &coefficient in &POLY[1..] {
        p = p.mul_add(r, coefficient);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `gate[i] = gate[i] / (1 + e^-gate[i]) * up[i]` with [`exp_portable`]'s `e^x`, on the
/// widest vectors the CPU has (the same bits on each).
pub(super) fn silu_mul_polynomial(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: length mismatch");
    #[cfg(target_arch = "x86_64")]
    match vector_width() {
        // SAFETY: the CPU has AVX-512F (detected in `vector_width`).
        16 => return unsafe { x86::silu_mul_avx512(gate, up) },
        // SAFETY: the CPU has AVX2 and FMA (detected in `vector_width`).
        8 => return unsafe { x86::silu_mul_avx2(gate, up) },
        _ => {}
    }
    #[cfg(target_arch = "aarch64")]
    if vector_width() == 4 {
        // SAFETY: the CPU has NEON (detected in `vector_width`).
        return unsafe { neon::silu_mul_neon(gate, up) };
    }
    silu_mul_portable(gate, up);
}

/// [`silu_mul_polynomial`] one element at a time (the oracle of the vector versions).
pub(super) fn silu_mul_portable(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp_portable(-*g)) * u;
    }
}

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// 16 lanes of [`exp_portable`]. SAFETY: AVX-512F (inlined into a caller that has it).
    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LOW)), _mm512_set1_ps(HIGH));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-C1), x);
            let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-C2), r);
            let mut p = _mm512_set1_ps(POLY[0]);
            for &coefficient in &POLY[1..] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coefficient));
            }
            let y = _mm512_add_ps(
                _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
                _mm512_set1_ps(1.0),
            );
            let exponent = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            ));
            _mm512_mul_ps(y, _mm512_castsi512_ps(exponent))
        }
    }

    /// 8 lanes of [`exp_portable`]. SAFETY: AVX2 and FMA (inlined into a caller that has
    /// them).
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LOW)), _mm256_set1_ps(HIGH));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-C1), x);
            let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-C2), r);
            let mut p = _mm256_set1_ps(POLY[0]);
            for &coefficient in &POLY[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(coefficient));
            }
            let y = _mm256_add_ps(
                _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
                _mm256_set1_ps(1.0),
            );
            let exponent = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            _mm256_mul_ps(y, _mm256_castsi256_ps(exponent))
        }
    }

    /// [`super::silu_mul_polynomial`] on 16 lanes, the tail under a mask. SAFETY: AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
        let len = gate.len().min(up.len());
        let mut i = 0;
        // SAFETY: every access is below `len` (the tail under its mask).
        unsafe {
            while i < len {
                let lanes = (len - i).min(16);
                let mask: __mmask16 = if lanes == 16 {
                    0xFFFF
                } else {
                    (1u16 << lanes) - 1
                };
                let g = _mm512_maskz_loadu_ps(mask, gate.as_ptr().add(i));
                let u = _mm512_maskz_loadu_ps(mask, up.as_ptr().add(i));
                // -g by the sign bit, as the portable `-g` (also for zeros and NaN).
                let minus = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(g),
                    _mm512_set1_epi32(i32::MIN),
                ));
                let e = exp16(minus);
                let value =
                    _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0), e)), u);
                _mm512_mask_storeu_ps(gate.as_mut_ptr().add(i), mask, value);
                i += lanes;
            }
        }
    }

    /// [`super::silu_mul_polynomial`] on 8 lanes, the tail portable (the same bits).
    /// SAFETY: AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
        let len = gate.len().min(up.len());
        let full = len / 8 * 8;
        // SAFETY: every access is below `full`.
        unsafe {
            for i in (0..full).step_by(8) {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0)));
                let value =
                    _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u);
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), value);
            }
        }
        silu_mul_portable(&mut gate[full..len], &up[full..len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs across the whole range: extremes, both zeros, tiny and huge values, the clamp
    /// edges.
    fn inputs() -> Vec<f32> {
        let mut values = vec![
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            87.0,
            -87.0,
            88.0,
            -88.0,
            87.5,
            -87.5,
            100.0,
            -100.0,
            1e30,
            -1e30,
            0.5,
            -0.5,
            0.3466,
            -0.3466,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..4000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            values.push(((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 60.0);
        }
        values
    }

    #[test]
    fn the_polynomial_is_within_a_few_ulp_of_libm() {
        let mut worst = 0f64;
        for x in inputs() {
            let x = x.clamp(-80.0, 80.0);
            let (got, want) = (exp_portable(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
    }

    #[test]
    fn every_width_gives_the_portable_bits_at_every_position() {
        let values = inputs();
        for len in [1, 7, 8, 15, 16, 17, 33, values.len()] {
            let gate: Vec<f32> = values[..len].to_vec();
            let up: Vec<f32> = values[..len].iter().rev().map(|v| v * 0.37).collect();
            let mut want = gate.clone();
            silu_mul_portable(&mut want, &up);
            let mut got = gate.clone();
            silu_mul_polynomial(&mut got, &up);
            for (index, (w, g)) in want.iter().zip(&got).enumerate() {
                assert_eq!(
                    w.to_bits(),
                    g.to_bits(),
                    "len {len} index {index}: {w} vs {g}"
                );
            }
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                let mut narrow = gate.clone();
                // SAFETY: AVX2 and FMA detected above.
                unsafe { x86::silu_mul_avx2(&mut narrow, &up) };
                assert!(want
                    .iter()
                    .zip(&narrow)
                    .all(|(w, n)| w.to_bits() == n.to_bits()));
            }
        }
    }

    #[test]
    fn parse_accepts_the_documented_values_only() {
        assert_eq!(SiluPath::parse(" Auto "), Ok(None));
        assert_eq!(SiluPath::parse("LIBM"), Ok(Some(SiluPath::Libm)));
        assert_eq!(
            SiluPath::parse("polynomial"),
            Ok(Some(SiluPath::Polynomial))
        );
        let error = SiluPath::parse("fast").unwrap_err().to_string();
        assert!(error.contains(SILU_ENV_VAR) && error.contains("fast"));
    }
}
