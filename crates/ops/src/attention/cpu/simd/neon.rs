//! The aarch64 lanes of the split-KV chunk kernel (4 f32 lanes, NEON: every aarch64 Linux
//! CPU has it) and its `#[target_feature]` entry point; see [`super`]. The recipe is the x86
//! kernels' (fused multiply-adds in the same order per lane, the same `exp2` polynomial),
//! so the results differ from them and from the scalar kernel by float rounding only.

use std::arch::aarch64::*;

use super::lanes::{Lanes, EXP2_POLY};
use super::{pass_body, ChunkArgs, HeadTask, MAX_TASKS};

/// The NEON kernel; as the x86 ones (`super::x86::chunk_avx2`) with `head_dim % 4 == 0`.
///
/// # Safety
/// The CPU must support NEON; `head_dim % 4 == 0` and `head_dim <= MAX_HEAD_DIM`; the caller
/// validated the pool, the page table and the tasks.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn chunk_neon(args: &ChunkArgs<'_, '_>, tasks: &mut [HeadTask<'_>]) {
    for pass in tasks.chunks_mut(MAX_TASKS) {
        // SAFETY: forwarded from this function's contract.
        unsafe { pass_body::<Neon>(args, pass) }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Neon(float32x4_t);

impl Lanes for Neon {
    const LANES: usize = 4;
    /// NEON has 32 vector registers, but with 4 lanes a tile of 32 tokens takes 8 of them per
    /// head: the register blocks sized for 16 (two heads' scores, one head's values at
    /// `head_dim` 64) are the ones that fit.
    const REGISTERS: usize = 16;
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn splat(value: f32) -> Self {
        Neon(vdupq_n_f32(value))
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn load(pointer: *const f32) -> Self {
        // SAFETY: the caller guarantees 4 readable floats.
        Neon(unsafe { vld1q_f32(pointer) })
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn store(self, pointer: *mut f32) {
        // SAFETY: the caller guarantees 4 writable floats.
        unsafe { vst1q_f32(pointer, self.0) }
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn add(self, other: Self) -> Self {
        Neon(vaddq_f32(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn sub(self, other: Self) -> Self {
        Neon(vsubq_f32(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn mul(self, other: Self) -> Self {
        Neon(vmulq_f32(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn mul_add(self, factor: Self, addend: Self) -> Self {
        // FMLA: addend + self * factor, one rounding.
        Neon(vfmaq_f32(addend.0, self.0, factor.0))
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn max(self, other: Self) -> Self {
        // FMAXNM: a NaN lane yields the other operand's lane.
        Neon(vmaxnmq_f32(self.0, other.0))
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn reduce_add(self) -> f32 {
        vaddvq_f32(self.0)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn reduce_max(self) -> f32 {
        vmaxnmvq_f32(self.0)
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn exp2(self) -> Self {
        let x = vminq_f32(vmaxq_f32(self.0, vdupq_n_f32(-126.0)), vdupq_n_f32(126.0));
        // FRINTN: to nearest, ties to even, as the x86 kernels round.
        let whole = vrndnq_f32(x);
        let fraction = vsubq_f32(x, whole);
        let mut poly = vdupq_n_f32(EXP2_POLY[0]);
        for &coefficient in &EXP2_POLY[1..] {
            poly = vfmaq_f32(vdupq_n_f32(coefficient), poly, fraction);
        }
        let mantissa = vfmaq_f32(vdupq_n_f32(1.0), poly, fraction);
        // `whole` is an integer already: the conversion is exact.
        let exponent = vshlq_n_s32::<23>(vcvtq_s32_f32(whole));
        let value = vaddq_s32(vreinterpretq_s32_f32(mantissa), exponent);
        // Lanes below -126 (and -inf) give 0; a NaN lane compares false and stays.
        let underflow = vcltq_f32(self.0, vdupq_n_f32(-126.0));
        Neon(vreinterpretq_f32_u32(vbicq_u32(
            vreinterpretq_u32_s32(value),
            underflow,
        )))
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn transpose(rows: &[*const f32], column: usize, out: *mut f32, stride: usize) {
        // SAFETY: the caller guarantees 4 row pointers with 4 readable floats at `column`
        // and 4 writable rows of `out`.
        unsafe {
            let r: [float32x4_t; 4] = [
                vld1q_f32(rows[0].add(column)),
                vld1q_f32(rows[1].add(column)),
                vld1q_f32(rows[2].add(column)),
                vld1q_f32(rows[3].add(column)),
            ];
            // Pairs of rows interleaved (TRN1/TRN2 on 32 bits), then on 64 bits.
            let t0 = vreinterpretq_f64_f32(vtrn1q_f32(r[0], r[1]));
            let t1 = vreinterpretq_f64_f32(vtrn2q_f32(r[0], r[1]));
            let t2 = vreinterpretq_f64_f32(vtrn1q_f32(r[2], r[3]));
            let t3 = vreinterpretq_f64_f32(vtrn2q_f32(r[2], r[3]));
            vst1q_f32(out, vreinterpretq_f32_f64(vtrn1q_f64(t0, t2)));
            vst1q_f32(out.add(stride), vreinterpretq_f32_f64(vtrn1q_f64(t1, t3)));
            vst1q_f32(
                out.add(2 * stride),
                vreinterpretq_f32_f64(vtrn2q_f64(t0, t2)),
            );
            vst1q_f32(
                out.add(3 * stride),
                vreinterpretq_f32_f64(vtrn2q_f64(t1, t3)),
            );
        }
    }
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn prefetch(pointer: *const f32) {
        // SAFETY: PRFM is a hint; it never faults, whatever the address.
        unsafe {
            std::arch::asm!(
                "prfm pldl1keep, [{pointer}]",
                pointer = in(reg) pointer,
                options(nostack, readonly, preserves_flags)
            )
        }
    }
}
