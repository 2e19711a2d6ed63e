//! The activation quantizer of the NEON sets (`neon_dotprod`, `neon`): [`quantize_block`]
//! (and [`quantize_block_q15`]) eight 4-lane registers per 32-value block, with the scalar
//! function's exact operations, so the same bytes, scales and sums for every input, NaN and
//! infinities included (`tests/linear_neon_kernels.rs` checks it on random and edge rows):
//!
//! - `amax`: `FMAXNM` of `|x|` across the block, then `max(0)`: like the scalar
//!   `fold(0, f32::max)`, a NaN lane yields the other operand, and `max` of the rest in any
//!   order is exact;
//! - `d = amax / limit` and `1 / d` (or 0) in scalar f32, as the scalar code;
//! - per value `x * (1 / d)`, `FRINTN` (round to nearest, ties to even: `round_ties_even`),
//!   the clamp to `[-limit, limit]` (`FMAX`/`FMIN`, a NaN stays NaN as with `f32::clamp`),
//!   `FCVTZS` (exact on integers; NaN gives 0, as Rust's `as i32`);
//! - Q15: `hi = (q + 64) >> 7`, `lo = q - 128 hi`; narrowing moves to bytes (every value is
//!   in range), the integers summed exactly.
//!
//! [`quantize_block`]: pagoda_tensor::quant::q8::quantize_block
//! [`quantize_block_q15`]: pagoda_tensor::quant::q8::quantize_block_q15

use std::arch::aarch64::*;

use pagoda_tensor::quant::q8::{Q15_MAX, Q8_BLOCK};

/// Registers of four values per block.
const REGISTERS: usize = Q8_BLOCK / 4;

/// Quantizes whole blocks of `x` into `qs` (Q8, or with `Q15` the `hi` plane, `lo` the `lo`
/// plane), one scale and one `d * sum(q)` per block.
///
/// # Safety
/// NEON. Panics unless `x`, `qs` (and with `Q15` `lo`) hold the same whole blocks and
/// `scales`, `sums` one entry per block.
#[target_feature(enable = "neon")]
pub(super) unsafe fn quantize_slice<const Q15: bool>(
    x: &[f32],
    qs: &mut [i8],
    lo: &mut [i8],
    scales: &mut [f32],
    sums: &mut [f32],
) {
    let blocks = x.len() / Q8_BLOCK;
    assert!(x.len().is_multiple_of(Q8_BLOCK) && qs.len() == x.len());
    assert!(scales.len() == blocks && sums.len() == blocks);
    assert!(!Q15 || lo.len() == x.len());
    let limit = if Q15 { Q15_MAX as f32 } else { 127.0 };
    let (low, high) = (vdupq_n_f32(-limit), vdupq_n_f32(limit));
    for block in 0..blocks {
        let at = block * Q8_BLOCK;
        // SAFETY: block `block` of `x`, `qs` (and `lo`) holds 32 values (asserted above).
        unsafe {
            let src = x.as_ptr().add(at);
            let mut values = [vdupq_n_f32(0.0); REGISTERS];
            for (j, value) in values.iter_mut().enumerate() {
                *value = vld1q_f32(src.add(4 * j));
            }
            let mut amax = vabsq_f32(values[0]);
            for value in &values[1..] {
                amax = vmaxnmq_f32(amax, vabsq_f32(*value));
            }
            let amax = vmaxnmvq_f32(amax).max(0.0);
            let d = amax / limit;
            let inverse = vdupq_n_f32(if d > 0.0 { 1.0 / d } else { 0.0 });
            let mut ints = [vdupq_n_s32(0); REGISTERS];
            let mut total = vdupq_n_s32(0);
            for (int, value) in ints.iter_mut().zip(values) {
                let rounded = vrndnq_f32(vmulq_f32(value, inverse));
                *int = vcvtq_s32_f32(vminq_f32(vmaxq_f32(rounded, low), high));
                total = vaddq_s32(total, *int);
            }
            let total = vaddvq_s32(total);
            if Q15 {
                let mut highs = ints;
                let mut lows = ints;
                for i in 0..REGISTERS {
                    highs[i] = vshrq_n_s32::<7>(vaddq_s32(ints[i], vdupq_n_s32(64)));
                    lows[i] = vsubq_s32(ints[i], vshlq_n_s32::<7>(highs[i]));
                }
                store_bytes(&highs, qs.as_mut_ptr().add(at));
                store_bytes(&lows, lo.as_mut_ptr().add(at));
            } else {
                store_bytes(&ints, qs.as_mut_ptr().add(at));
            }
            scales[block] = d;
            sums[block] = d * total as f32;
        }
    }
}

/// Stores 32 i32 (each in i8 range) as bytes, in order.
///
/// # Safety
/// NEON; `out` has room for 32 bytes.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn store_bytes(ints: &[int32x4_t; REGISTERS], out: *mut i8) {
    for half in 0..2 {
        let i = 4 * half;
        let low = vcombine_s16(vmovn_s32(ints[i]), vmovn_s32(ints[i + 1]));
        let high = vcombine_s16(vmovn_s32(ints[i + 2]), vmovn_s32(ints[i + 3]));
        // SAFETY: `out` has room for 32 bytes.
        unsafe {
            vst1q_s8(
                out.add(16 * half),
                vcombine_s8(vmovn_s16(low), vmovn_s16(high)),
            )
        };
    }
}
