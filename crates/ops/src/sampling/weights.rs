//! The rejection sampler's weights: canonical f32 draw weights (the same bits on the CPU and
//! in the CUDA kernels) and f64 filter masses.

/// Below this argument the canonical draw weight is 0 (`e^-86 < 5e-38` of the row's largest
/// weight): the `2^k` scale of [`draw_exp`] stays a normal number.
const DRAW_EXP_MIN: f32 = -86.0;

/// The canonical draw weight `exp(x)` in f32 for `x <= 0`: `x = k ln 2 + r` (`k` rounded by
/// the 1.5 * 2^23 trick, `ln 2` split in two), a degree-7 Taylor polynomial of `exp(r)`
/// (truncation below 6e-9), times `2^k` built in the exponent bits; 0 below
/// [`DRAW_EXP_MIN`]. Within 3 ulp of the correctly rounded value (a test bounds it against
/// libm). IEEE f32 operations and fused multiply-adds only, each correctly rounded, in this
/// order on every instruction set and in the CUDA kernels (`draw_exp` in
/// `sampling_common.cu`): the CPU and the GPU get the same bits, so their inverse-CDF walks
/// differ only in the f64 summation order of these weights.
#[inline(always)]
pub(crate) fn draw_exp(x: f32) -> f32 {
    const LOG2_E: f32 = f32::from_bits(0x3FB8_AA3B);
    // ln 2 split: the high part has 12 trailing zero bits.
    const LN2_HIGH: f32 = f32::from_bits(0x3F31_7200);
    const LN2_LOW: f32 = f32::from_bits(0x35BF_BE8E);
    const ROUNDER: f32 = 12_582_912.0; // 1.5 * 2^23
                                       // 1/7!, 1/6!, ..., 1/3!, each the f32 nearest.
    const C7: f32 = f32::from_bits(0x3950_0D01);
    const C6: f32 = f32::from_bits(0x3AB6_0B61);
    const C5: f32 = f32::from_bits(0x3C08_8889);
    const C4: f32 = f32::from_bits(0x3D2A_AAAB);
    const C3: f32 = f32::from_bits(0x3E2A_AAAB);
    let below = x < DRAW_EXP_MIN;
    let x = if below { DRAW_EXP_MIN } else { x };
    let shifted = x.mul_add(LOG2_E, ROUNDER);
    let k = shifted - ROUNDER;
    let k_integer = (shifted.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let r = (-k).mul_add(LN2_HIGH, x);
    let r = (-k).mul_add(LN2_LOW, r);
    let mut p = C7.mul_add(r, C6);
    p = p.mul_add(r, C5);
    p = p.mul_add(r, C4);
    p = p.mul_add(r, C3);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    let scale = f32::from_bits(((k_integer + 127) as u32) << 23);
    if below {
        0.0
    } else {
        p * scale
    }
}

/// The canonical draw weight of `value` in a row of maximum `z_max` at inverse temperature
/// `scale` (`1 / T` in f32): [`draw_exp`] of `(value - z_max) * scale`, both in f32 (0 for
/// `-inf`).
#[inline(always)]
pub(crate) fn draw_weight(value: f32, z_max: f32, scale: f32) -> f32 {
    draw_exp((value - z_max) * scale)
}

#[inline(always)]
fn draw_weights_kernel(logits: &[f32], z_max: f32, scale: f32, out: &mut [f64]) {
    for (weight, &value) in out.iter_mut().zip(logits) {
        *weight = draw_weight(value, z_max, scale) as f64;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
fn draw_weights_avx512(logits: &[f32], z_max: f32, scale: f32, out: &mut [f64]) {
    draw_weights_kernel(logits, z_max, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn draw_weights_avx2(logits: &[f32], z_max: f32, scale: f32, out: &mut [f64]) {
    draw_weights_kernel(logits, z_max, scale, out)
}

/// `out[i] = draw_weight(logits[i], z_max, scale)` as f64 for every `i` (resized to
/// `logits.len()`); vectorised (AVX-512 or AVX2 with FMA, chosen at run time), the same bits
/// on every path.
pub(crate) fn fill_draw_weights(logits: &[f32], z_max: f32, scale: f32, out: &mut Vec<f64>) {
    out.clear();
    out.resize(logits.len(), 0.0);
    #[cfg(target_arch = "x86_64")]
    {
        if super::gumbel::has_avx512() {
            // SAFETY: the enabled features were detected.
            return unsafe { draw_weights_avx512(logits, z_max, scale, out) };
        }
        if super::gumbel::has_avx2() {
            // SAFETY: as above.
            return unsafe { draw_weights_avx2(logits, z_max, scale, out) };
        }
    }
    draw_weights_kernel(logits, z_max, scale, out)
}

/// Below this argument [`exp_f64`] is not used (its `2^k` scale would leave the normal range);
/// libm's `exp` computes those (subnormal or zero) weights instead.
const EXP_FAST_MIN: f64 = -700.0;

/// `exp(x)` in f64 for `EXP_FAST_MIN <= x <= 0`, within a few ulp of the correctly rounded
/// value (a test bounds it against libm): `x = k ln 2 + r` (Cody-Waite, `|r| <= ln 2 / 2`,
/// `k` rounded by the 1.5 * 2^52 trick), degree-13 Taylor polynomial of `exp(r)` (truncation
/// below 4e-18), times `2^k` built in the exponent bits. IEEE `+ - *` only, no fused
/// multiply-add, so every instruction set gives the same bits; branch-free so it vectorises.
#[inline(always)]
pub(crate) fn exp_f64(x: f64) -> f64 {
    const LOG2_E: f64 = std::f64::consts::LOG2_E;
    // ln 2 split: the high part has 32 trailing zero bits, so `k * LN2_HIGH` is exact.
    const LN2_HIGH: f64 = 0.693_147_180_369_123_8;
    const LN2_LOW: f64 = 1.908_214_929_270_587_7e-10;
    const ROUNDER: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    let x = if x < EXP_FAST_MIN { EXP_FAST_MIN } else { x };
    let shifted = x * LOG2_E + ROUNDER;
    let k = shifted - ROUNDER;
    let k_integer = (shifted.to_bits() as i64).wrapping_sub(ROUNDER.to_bits() as i64);
    let r = (x - k * LN2_HIGH) - k * LN2_LOW;
    let mut p = 1.0 / 6_227_020_800.0; // 1/13!
    p = p * r + 1.0 / 479_001_600.0;
    p = p * r + 1.0 / 39_916_800.0;
    p = p * r + 1.0 / 3_628_800.0;
    p = p * r + 1.0 / 362_880.0;
    p = p * r + 1.0 / 40_320.0;
    p = p * r + 1.0 / 5_040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let scale = f64::from_bits(((k_integer + 1023) as u64) << 52);
    p * scale
}

/// `out[i] = exp((logits[i] - z_max) * scale)` for every `i` (resized to `logits.len()`),
/// `z_max` the row maximum (so the arguments are `<= 0`) and `scale > 0`. Vectorised
/// ([`exp_f64`], AVX-512 or AVX2 chosen at run time); arguments below [`EXP_FAST_MIN`] are
/// recomputed with libm.
pub(crate) fn exp_weights(logits: &[f32], z_max: f64, scale: f64, out: &mut Vec<f64>) {
    out.clear();
    out.resize(logits.len(), 0.0);
    let any_below = exp_weights_dispatch(logits, z_max, scale, out);
    if any_below {
        for (weight, &value) in out.iter_mut().zip(logits) {
            let argument = (value as f64 - z_max) * scale;
            if argument < EXP_FAST_MIN {
                *weight = argument.exp();
            }
        }
    }
}

#[inline(always)]
fn exp_weights_kernel(logits: &[f32], z_max: f64, scale: f64, out: &mut [f64]) -> bool {
    let mut any_below = false;
    for (weight, &value) in out.iter_mut().zip(logits) {
        let argument = (value as f64 - z_max) * scale;
        any_below |= argument < EXP_FAST_MIN;
        *weight = exp_f64(argument);
    }
    any_below
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
fn exp_weights_avx512(logits: &[f32], z_max: f64, scale: f64, out: &mut [f64]) -> bool {
    exp_weights_kernel(logits, z_max, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_weights_avx2(logits: &[f32], z_max: f64, scale: f64, out: &mut [f64]) -> bool {
    exp_weights_kernel(logits, z_max, scale, out)
}

fn exp_weights_dispatch(logits: &[f32], z_max: f64, scale: f64, out: &mut [f64]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if super::gumbel::has_avx512() {
            // SAFETY: the enabled features were detected.
            return unsafe { exp_weights_avx512(logits, z_max, scale, out) };
        }
        if super::gumbel::has_avx2() {
            // SAFETY: as above.
            return unsafe { exp_weights_avx2(logits, z_max, scale, out) };
        }
    }
    exp_weights_kernel(logits, z_max, scale, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The next state of a xorshift64 sequence (the tests' deterministic inputs).
    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// `exp_f64` against libm (itself within 1 ulp) over `[-700, 0]`: within 4 eps relative.
    #[test]
    fn exp_f64_matches_libm() {
        let mut state = 0x1234_5678_9ABC_DEF0u64;
        let mut worst = 0.0f64;
        for index in 0..200_000u64 {
            let unit = (xorshift(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            // Dense near 0 (where the weights that matter live), sparse down to -700.
            let x = if index % 2 == 0 {
                -unit * 40.0
            } else {
                -unit * 700.0
            };
            let exact = x.exp();
            let relative = ((exp_f64(x) - exact) / exact).abs();
            worst = worst.max(relative);
        }
        assert_eq!(exp_f64(0.0), 1.0);
        assert!(
            worst <= 4.0 * f64::EPSILON,
            "worst relative error {worst:e}"
        );
        // The slow tail goes through libm.
        let mut out = Vec::new();
        exp_weights(&[0.0, -800.0, -1.0], 0.0, 1.0, &mut out);
        assert_eq!(out[1], (-800.0f64).exp());
        assert_eq!(out[2], exp_f64(-1.0));
    }

    /// `draw_exp` against libm's f64 `exp` over `[-86, 0]`: within 3 f32 ulp (relative
    /// 2^-22), 1 at 0, and 0 below the cut.
    #[test]
    fn draw_exp_is_within_three_ulp_of_libm() {
        let mut state = 0x0DDB_1A5E_5BAD_5EEDu64;
        let mut worst = 0.0f64;
        for index in 0..400_000u64 {
            let unit = (xorshift(&mut state) >> 40) as f32 / (1u32 << 24) as f32;
            let x = if index % 2 == 0 {
                -unit * 20.0
            } else {
                -unit * 86.0
            };
            let exact = (x as f64).exp();
            let relative = ((draw_exp(x) as f64 - exact) / exact).abs();
            worst = worst.max(relative);
        }
        assert!(
            worst <= 3.0 * f32::EPSILON as f64 / 2.0,
            "worst relative error {worst:e}"
        );
        assert_eq!(draw_exp(0.0), 1.0);
        assert_eq!(draw_exp(-0.0), 1.0);
        assert_eq!(draw_exp(-86.5), 0.0);
        assert_eq!(draw_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(draw_weight(f32::NEG_INFINITY, 3.0, 1.0), 0.0);
    }

    /// The vectorised weights equal the scalar ones bit for bit (the GPU computes the scalar
    /// form), on arguments spread over the whole range and at the cut.
    #[test]
    fn vectorised_draw_weights_match_the_scalar_form() {
        let mut state = 12345u64;
        let logits: Vec<f32> = (0..10_003)
            .map(|index| {
                xorshift(&mut state);
                match index % 97 {
                    0 => f32::NEG_INFINITY,
                    1 => 7.5,
                    _ => 7.5 - (state >> 40) as f32 / (1u32 << 24) as f32 * 120.0,
                }
            })
            .collect();
        for scale in [1.0f32, 1.0 / 0.7, 1.0 / 3.0, 10.0] {
            let mut out = Vec::new();
            fill_draw_weights(&logits, 7.5, scale, &mut out);
            for (&value, &weight) in logits.iter().zip(&out) {
                let scalar = draw_weight(value, 7.5, scale);
                assert_eq!(
                    weight.to_bits(),
                    (scalar as f64).to_bits(),
                    "{value} x {scale}"
                );
            }
        }
    }
}
