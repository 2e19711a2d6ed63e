//! [`super::silu_mul_polynomial`] on 4 NEON lanes (aarch64), operation for operation as
//! [`super::exp_portable`] and the gated product: the clamps by compare and select (a NaN
//! input takes the bound, as the portable `if x > LOW { x } else { LOW }`), `FRINTN` for
//! `round_ties_even`, `FMLA` for `mul_add`, `FCVTZS` on the (integral) exponent, `FNEG` for
//! `-g` (the sign bit, zeros and NaN included), IEEE `FDIV`. Hence the portable bits at every
//! position; the `len % 4` tail runs the portable loop.

use std::arch::aarch64::*;

use super::{silu_mul_portable, C1, C2, HIGH, LOW, POLY};

/// 4 lanes of [`super::exp_portable`].
#[inline]
#[target_feature(enable = "neon")]
fn exp4(x: float32x4_t) -> float32x4_t {
    let (low, high) = (vdupq_n_f32(LOW), vdupq_n_f32(HIGH));
    let x = vbslq_f32(vcgtq_f32(x, low), x, low);
    let x = vbslq_f32(vcltq_f32(x, high), x, high);
    let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(std::f32::consts::LOG2_E)));
    let r = vfmaq_f32(x, n, vdupq_n_f32(-C1));
    let r = vfmaq_f32(r, n, vdupq_n_f32(-C2));
    let mut p = vdupq_n_f32(POLY[0]);
    for &coefficient in &POLY[1..] {
        p = vfmaq_f32(vdupq_n_f32(coefficient), p, r);
    }
    let y = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0));
    let exponent = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)));
    vmulq_f32(y, vreinterpretq_f32_s32(exponent))
}

/// `gate[i] = gate[i] / (1 + e^-gate[i]) * up[i]`, four lanes at a time.
///
/// # Safety
/// NEON.
#[target_feature(enable = "neon")]
pub(super) unsafe fn silu_mul_neon(gate: &mut [f32], up: &[f32]) {
    let len = gate.len().min(up.len());
    let full = len / 4 * 4;
    for i in (0..full).step_by(4) {
        // SAFETY: i + 4 <= full <= both lengths.
        unsafe {
            let g = vld1q_f32(gate.as_ptr().add(i));
            let u = vld1q_f32(up.as_ptr().add(i));
            let e = exp4(vnegq_f32(g));
            let value = vmulq_f32(vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0), e)), u);
            vst1q_f32(gate.as_mut_ptr().add(i), value);
        }
    }
    silu_mul_portable(&mut gate[full..len], &up[full..len]);
}
