//! The aarch64 kernels of the per-row integer tiles (NEON, with `SDOT` where the CPU has the
//! dotprod extension); see [`super`].
//!
//! Every (row, token) pair of a tile runs exactly [`dot_scalar`]'s chain, so the result equals
//! the scalar kernel bit for bit whatever `R` and `T` are:
//!
//! - the block's integer part, exact: `u - zero` fits an i8 for every repacked format (at
//!   most -128..127, Q8_0), so it is a signed-by-signed dot of 32 bytes, into four i32 lanes
//!   with `SDOT` (`vdotq_s32`) or, without dotprod, `SMULL`/`SMULL2` (i16 products, exact)
//!   and `SADALP` (pairwise widening adds); the lanes are summed with `ADDV` (integers: any
//!   order gives the same value). With sub-scales (Q3_K, Q6_K, Q2_K) each 16-value half is
//!   summed apart and times its sub-scale, `wrapping_add`ed as the scalar kernel does; Q2_K's
//!   min integer sums each half's activation bytes (`SADDLV`);
//! - then the scalar kernel's float step, unfused and blocks in order:
//!   `total += d * d_a * integer + min * s_a` (Q2_K: `+ min * d_a * min_integer`), with the
//!   half factors widened by `FCVT` (exact, as `f16_bits_to_f32`; only a signalling NaN
//!   would come out quieted).
//!
//! One activation block loaded feeds `R` rows and one weight block `T` tokens, as on x86.
//! Where the CPU also has i8mm, the even tiles of weights without sub-scales (the prefill
//! tiles) run [`tile_smmla`]: `SMMLA` gives four pairs' block integers in one vector, and the
//! same float step runs lane by lane.

use super::*;
use pagoda_tensor::quant::blocks::QK;
use pagoda_tensor::quant::repack::RowFactors;
use std::arch::aarch64::*;

/// The signed values `u - zero` of block `block` of a row starting at `qs`, as the two
/// 16-value halves (values 0..16 and 16..32). SAFETY (caller): the row holds the block.
#[inline(always)]
unsafe fn signed_block<const NIBBLE: bool>(
    qs: *const u8,
    block: usize,
    zero: uint8x16_t,
) -> [int8x16_t; 2] {
    unsafe {
        let (low, high) = if NIBBLE {
            // Byte `j` holds value `j` (low nibble) and value `j + 16` (high nibble).
            let packed = vld1q_u8(qs.add(block * QK / 2));
            (vandq_u8(packed, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(packed))
        } else {
            let at = qs.add(block * QK);
            (vld1q_u8(at), vld1q_u8(at.add(QK / 2)))
        };
        // Wrapping byte subtraction: `u - zero` lies in -128..127, so the i8 is exact.
        [
            vreinterpretq_s8_u8(vsubq_u8(low, zero)),
            vreinterpretq_s8_u8(vsubq_u8(high, zero)),
        ]
    }
}

/// The four i32 lanes of `w . a` over one 16-byte half, with `SDOT`: lane `i` adds the
/// products of bytes `4 i .. 4 i + 4` to `start`'s. Inline assembly, since `vdotq_s32` is not
/// stable Rust yet (`stdarch_neon_dotprod`); the instruction is the one it emits.
/// SAFETY: NEON + dotprod.
#[target_feature(enable = "neon,dotprod")]
#[inline]
unsafe fn half_sdot(start: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    let mut lanes = start;
    // SAFETY: a register-only instruction the caller's CPU has.
    unsafe {
        std::arch::asm!(
            "sdot {lanes:v}.4s, {w:v}.16b, {a:v}.16b",
            lanes = inout(vreg) lanes,
            w = in(vreg) w,
            a = in(vreg) a,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    lanes
}

/// The four i32 lanes of `w . a` over one 16-byte half, without dotprod: the 16 products as
/// i16 (`SMULL`, `SMULL2`; at most 128 * 128 in magnitude, exact), pairwise-added into i32
/// lanes (`SADALP`). SAFETY: NEON.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn half_smull(start: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    let low = vmull_s8(vget_low_s8(w), vget_low_s8(a));
    let high = vmull_high_s8(w, a);
    vpadalq_s16(vpadalq_s16(start, low), high)
}

/// One half's integer lanes with the kernel `DOT` names (`SDOT` when true).
/// SAFETY (caller): NEON, and dotprod when `DOT`.
#[inline(always)]
unsafe fn half_dot<const DOT: bool>(start: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    unsafe {
        if DOT {
            half_sdot(start, w, a)
        } else {
            half_smull(start, w, a)
        }
    }
}

/// The half at `pointer` widened to f32 (`LDR Hn`, `FCVT`; base ARMv8, exact).
/// SAFETY (caller): `pointer` points at two readable bytes.
#[inline(always)]
unsafe fn load_half(pointer: *const u16) -> f32 {
    let value: f32;
    // SAFETY: reads the two bytes the caller vouches for; registers only otherwise.
    unsafe {
        std::arch::asm!(
            "ldr {half:h}, [{pointer}]",
            "fcvt {value:s}, {half:h}",
            pointer = in(reg) pointer,
            half = out(vreg) _,
            value = lateout(vreg) value,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    value
}

/// One row's per-block factors as raw pointers: half bits when `HALF`, else f32; `mins` is
/// null when the format has none (every min 0).
#[derive(Clone, Copy)]
struct FactorPointers {
    scales: *const u8,
    mins: *const u8,
}

impl FactorPointers {
    fn of(factors: RowFactors<'_>) -> FactorPointers {
        let pointer = |empty: bool, at: *const u8| if empty { std::ptr::null() } else { at };
        match factors {
            RowFactors::Half { scales, mins } => FactorPointers {
                scales: scales.as_ptr() as *const u8,
                mins: pointer(mins.is_empty(), mins.as_ptr() as *const u8),
            },
            RowFactors::Single { scales, mins } => FactorPointers {
                scales: scales.as_ptr() as *const u8,
                mins: pointer(mins.is_empty(), mins.as_ptr() as *const u8),
            },
        }
    }

    /// Block `block`'s scale and min, widened exactly (the min 0 without mins).
    /// SAFETY (caller): `block` is in the row; `HALF` matches the factors' kind.
    #[inline(always)]
    unsafe fn get<const HALF: bool>(self, block: usize) -> (f32, f32) {
        // SAFETY: as the caller vouches.
        unsafe {
            let read = |base: *const u8| {
                if HALF {
                    load_half((base as *const u16).add(block))
                } else {
                    *(base as *const f32).add(block)
                }
            };
            let min = if self.mins.is_null() {
                0.0
            } else {
                read(self.mins)
            };
            (read(self.scales), min)
        }
    }
}

/// The tile (see [`super::tile`]) with `SDOT`.
/// SAFETY (caller): NEON and dotprod; indices in range; `NIBBLE`, `HALF` and `SUB` as the
/// rows are.
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn tile_sdot<
    const R: usize,
    const T: usize,
    const NIBBLE: bool,
    const HALF: bool,
    const SUB: bool,
>(
    weights: &RepackedRows,
    rows: [usize; R],
    activations: &Q8Rows,
    tokens: [usize; T],
) -> [[f32; T]; R] {
    unsafe { tile_with::<R, T, NIBBLE, HALF, SUB, true>(weights, rows, activations, tokens) }
}

/// The tile (see [`super::tile`]) with `SMULL` + `SADALP`.
/// SAFETY (caller): NEON; indices in range; `NIBBLE`, `HALF` and `SUB` as the rows are.
#[target_feature(enable = "neon")]
pub(super) unsafe fn tile_smull<
    const R: usize,
    const T: usize,
    const NIBBLE: bool,
    const HALF: bool,
    const SUB: bool,
>(
    weights: &RepackedRows,
    rows: [usize; R],
    activations: &Q8Rows,
    tokens: [usize; T],
) -> [[f32; T]; R] {
    unsafe { tile_with::<R, T, NIBBLE, HALF, SUB, false>(weights, rows, activations, tokens) }
}

/// The body of both kernels. SAFETY (caller): as [`tile_sdot`] (`DOT`) or [`tile_smull`].
#[inline(always)]
unsafe fn tile_with<
    const R: usize,
    const T: usize,
    const NIBBLE: bool,
    const HALF: bool,
    const SUB: bool,
    const DOT: bool,
>(
    weights: &RepackedRows,
    rows: [usize; R],
    activations: &Q8Rows,
    tokens: [usize; T],
) -> [[f32; T]; R] {
    // SAFETY: the caller's features and indices (see `tile_sdot`, `tile_smull`); every row
    // slice holds `blocks` blocks of values, factors, sub-scales and sub-mins, every
    // activation row `blocks` blocks of 32 bytes, scales and sums.
    unsafe {
        let blocks = weights.blocks_per_row();
        let zero = vdupq_n_u8(weights.zero() as u8);
        let qs: [*const u8; R] = rows.map(|r| weights.row_qs(r).as_ptr());
        let factors = rows.map(|r| FactorPointers::of(weights.row_factors(r)));
        let subs = rows.map(|r| weights.sub_scales(r).as_ptr());
        let sub_mins = rows.map(|r| weights.sub_mins(r).as_ptr());
        let has_sub_mins = weights.has_sub_mins();
        let qa: [*const i8; T] = tokens.map(|t| activations.row_qs(t).as_ptr());
        let da = tokens.map(|t| activations.row_scales(t).as_ptr());
        let sa = tokens.map(|t| activations.row_sums(t).as_ptr());
        let mut total = [[0f32; T]; R];
        for block in 0..blocks {
            let a: [[int8x16_t; 2]; T] = qa.map(|row| {
                let at = row.add(block * QK);
                [vld1q_s8(at), vld1q_s8(at.add(QK / 2))]
            });
            let d_a: [f32; T] = da.map(|scales| *scales.add(block));
            let s_a: [f32; T] = sa.map(|sums| *sums.add(block));
            // Q2_K's `sum(qa[..16])`, `sum(qa[16..])` per token (at most 2048 in magnitude).
            let half_sums: [[i32; 2]; T] = if SUB && has_sub_mins {
                a.map(|[low, high]| [vaddlvq_s8(low) as i32, vaddlvq_s8(high) as i32])
            } else {
                [[0; 2]; T]
            };
            for r in 0..R {
                let w = signed_block::<NIBBLE>(qs[r], block, zero);
                let (d, min) = factors[r].get::<HALF>(block);
                for t in 0..T {
                    let start = vdupq_n_s32(0);
                    let integer = if SUB {
                        let [s0, s1] = *subs[r].add(block);
                        let low = vaddvq_s32(half_dot::<DOT>(start, w[0], a[t][0]));
                        let high = vaddvq_s32(half_dot::<DOT>(start, w[1], a[t][1]));
                        (s0 as i32 * low).wrapping_add(s1 as i32 * high)
                    } else {
                        let lanes = half_dot::<DOT>(start, w[0], a[t][0]);
                        vaddvq_s32(half_dot::<DOT>(lanes, w[1], a[t][1]))
                    };
                    let scale = d * d_a[t] * integer as f32;
                    total[r][t] += if SUB && has_sub_mins {
                        let [m0, m1] = *sub_mins[r].add(block);
                        let [low, high] = half_sums[t];
                        let min_integer = m0 as i32 * low + m1 as i32 * high;
                        scale + min * d_a[t] * min_integer as f32
                    } else {
                        scale + min * s_a[t]
                    };
                }
            }
        }
        total
    }
}

/// Whether this CPU has the i8mm extension (`SMMLA`), detected once.
pub(super) fn has_i8mm() -> bool {
    use std::sync::OnceLock;
    static I8MM: OnceLock<bool> = OnceLock::new();
    *I8MM.get_or_init(|| std::arch::is_aarch64_feature_detected!("i8mm"))
}

/// `acc += a * b^T` on 2 x 8 signed byte matrices (`a`: two rows of 8 bytes, `b` likewise):
/// lanes `[a0.b0, a0.b1, a1.b0, a1.b1]`, exact. Inline assembly, since `vmmlaq_s32` is not
/// stable Rust yet. SAFETY: NEON + i8mm.
#[target_feature(enable = "neon,i8mm")]
#[inline]
unsafe fn smmla(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut lanes = acc;
    // SAFETY: a register-only instruction the caller's CPU has.
    unsafe {
        std::arch::asm!(
            "smmla {lanes:v}.4s, {a:v}.16b, {b:v}.16b",
            lanes = inout(vreg) lanes,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    lanes
}

/// Two 32-byte blocks (halves `[low, high]` each) as the four 2 x 8 operands of `SMMLA`:
/// operand `c` holds bytes `8 c .. 8 c + 8` of the first block, then of the second.
/// SAFETY (caller): NEON.
#[inline(always)]
unsafe fn pair_operands(first: [int8x16_t; 2], second: [int8x16_t; 2]) -> [int8x16_t; 4] {
    // SAFETY: register-only NEON instructions.
    unsafe {
        let mut out = [vdupq_n_s8(0); 4];
        for h in 0..2 {
            let (x, y) = (
                vreinterpretq_s64_s8(first[h]),
                vreinterpretq_s64_s8(second[h]),
            );
            out[2 * h] = vreinterpretq_s8_s64(vzip1q_s64(x, y));
            out[2 * h + 1] = vreinterpretq_s8_s64(vzip2q_s64(x, y));
        }
        out
    }
}

/// The tile (see [`super::tile`]) with `SMMLA` (i8mm) for weights without sub-scales and even
/// `R` and `T` (the prefill tiles): each 2 rows x 2 tokens of a block take four `SMMLA` into
/// one vector whose lanes are the four pairs' exact block integers (no horizontal sums),
/// then the scalar kernel's float step lane by lane (`FMUL`, `FADD`, unfused, blocks in
/// order): the same bits as [`dot_scalar`].
/// SAFETY (caller): NEON and i8mm; indices in range; `R` and `T` even; no sub-scales;
/// `NIBBLE` and `HALF` as the rows are.
#[target_feature(enable = "neon,i8mm")]
pub(super) unsafe fn tile_smmla<
    const R: usize,
    const T: usize,
    const NIBBLE: bool,
    const HALF: bool,
>(
    weights: &RepackedRows,
    rows: [usize; R],
    activations: &Q8Rows,
    tokens: [usize; T],
) -> [[f32; T]; R] {
    debug_assert!(R.is_multiple_of(2) && T.is_multiple_of(2) && !weights.has_sub_scales());
    // SAFETY: as `tile_with`; the caller vouches for i8mm and the shapes.
    unsafe {
        let blocks = weights.blocks_per_row();
        let zero = vdupq_n_u8(weights.zero() as u8);
        let qs: [*const u8; R] = rows.map(|r| weights.row_qs(r).as_ptr());
        let factors = rows.map(|r| FactorPointers::of(weights.row_factors(r)));
        let qa: [*const i8; T] = tokens.map(|t| activations.row_qs(t).as_ptr());
        let da = tokens.map(|t| activations.row_scales(t).as_ptr());
        let sa = tokens.map(|t| activations.row_sums(t).as_ptr());
        // Lanes of pair (row pair i, token pair j): rows 2i, 2i, 2i+1, 2i+1 by tokens 2j,
        // 2j+1, 2j, 2j+1. Up to 4 x 4 tiles: at most 2 x 2 vectors.
        let mut total = [[vdupq_n_f32(0.0); 2]; 2];
        for block in 0..blocks {
            let mut b = [[vdupq_n_s8(0); 4]; 2];
            let (mut d_a, mut s_a) = ([vdupq_n_f32(0.0); 2], [vdupq_n_f32(0.0); 2]);
            for j in 0..T / 2 {
                let load = |t: usize| {
                    let at = qa[t].add(block * QK);
                    [vld1q_s8(at), vld1q_s8(at.add(QK / 2))]
                };
                b[j] = pair_operands(load(2 * j), load(2 * j + 1));
                let (t0, t1) = (2 * j, 2 * j + 1);
                let lanes = |values: [*const f32; T]| {
                    let (x, y) = (*values[t0].add(block), *values[t1].add(block));
                    vld1q_f32([x, y, x, y].as_ptr())
                };
                (d_a[j], s_a[j]) = (lanes(da), lanes(sa));
            }
            for i in 0..R / 2 {
                let a = pair_operands(
                    signed_block::<NIBBLE>(qs[2 * i], block, zero),
                    signed_block::<NIBBLE>(qs[2 * i + 1], block, zero),
                );
                let (d0, min0) = factors[2 * i].get::<HALF>(block);
                let (d1, min1) = factors[2 * i + 1].get::<HALF>(block);
                let d = vld1q_f32([d0, d0, d1, d1].as_ptr());
                let min = vld1q_f32([min0, min0, min1, min1].as_ptr());
                for j in 0..T / 2 {
                    let mut integer = vdupq_n_s32(0);
                    for c in 0..4 {
                        integer = smmla(integer, a[c], b[j][c]);
                    }
                    let scale = vmulq_f32(vmulq_f32(d, d_a[j]), vcvtq_f32_s32(integer));
                    let step = vaddq_f32(scale, vmulq_f32(min, s_a[j]));
                    total[i][j] = vaddq_f32(total[i][j], step);
                }
            }
        }
        let mut out = [[0f32; T]; R];
        for i in 0..R / 2 {
            for j in 0..T / 2 {
                let mut lanes = [0f32; 4];
                vst1q_f32(lanes.as_mut_ptr(), total[i][j]);
                out[2 * i][2 * j] = lanes[0];
                out[2 * i][2 * j + 1] = lanes[1];
                out[2 * i + 1][2 * j] = lanes[2];
                out[2 * i + 1][2 * j + 1] = lanes[3];
            }
        }
        out
    }
}
