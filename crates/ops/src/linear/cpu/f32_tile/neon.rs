//! The recipe of [`super`] in NEON registers (aarch64; every aarch64 Linux CPU has NEON and
//! its fused multiply-add): each 8-lane accumulator is two 4-lane registers (lanes 0..4 and
//! 4..8), advanced with `FMLA` (one rounding, as `_mm256_fmadd_ps`), then reduced by
//! [`reduce_lanes`] and finished by [`finish`]. So every lane runs the fused chain of the
//! AVX2+FMA tiles value for value: the same bits as those, and as the fused scalar oracle
//! (`f32::mul_add` per lane; `tests/linear_neon_f32.rs`). A `tile::<2, 4>` (the prefill shape)
//! keeps 16 independent chains in flight, a `tile::<2, 1>` (decode) four.

use std::arch::aarch64::*;

use pagoda_tensor::GgmlType;

use super::{decode_range, finish, reduce_lanes, DECODE_CHUNK, LANES};

/// One 8-lane accumulator: lanes 0..4 and 4..8.
type Acc = [float32x4_t; 2];

/// Step 1 over values `from..to` (multiples of [`LANES`]) of every slice.
///
/// # Safety
/// NEON; every slice holds at least `to` values.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn accumulate<const R: usize, const T: usize>(
    acc: &mut [[Acc; T]; R],
    weights: [&[f32]; R],
    activations: [&[f32]; T],
    from: usize,
    to: usize,
) {
    let mut w = [std::ptr::null::<f32>(); R];
    for r in 0..R {
        w[r] = weights[r].as_ptr();
    }
    let mut x = [std::ptr::null::<f32>(); T];
    for t in 0..T {
        x[t] = activations[t].as_ptr();
    }
    let mut i = from;
    while i < to {
        // SAFETY: i + LANES <= to <= every slice's length.
        unsafe {
            let mut wv = [[vdupq_n_f32(0.0); 2]; R];
            for r in 0..R {
                let at = w[r].add(i);
                wv[r] = [vld1q_f32(at), vld1q_f32(at.add(4))];
            }
            for t in 0..T {
                let at = x[t].add(i);
                let xv = [vld1q_f32(at), vld1q_f32(at.add(4))];
                for r in 0..R {
                    acc[r][t][0] = vfmaq_f32(acc[r][t][0], wv[r][0], xv[0]);
                    acc[r][t][1] = vfmaq_f32(acc[r][t][1], wv[r][1], xv[1]);
                }
            }
        }
        i += LANES;
    }
}

/// Step 2: each accumulator's eight lanes reduced in the recipe's order.
#[inline]
#[target_feature(enable = "neon")]
fn sums<const R: usize, const T: usize>(acc: &[[Acc; T]; R]) -> [[f32; T]; R] {
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let mut lanes = [0f32; LANES];
            // SAFETY: `lanes` has room for 8 floats.
            unsafe {
                vst1q_f32(lanes.as_mut_ptr(), acc[r][t][0]);
                vst1q_f32(lanes.as_mut_ptr().add(4), acc[r][t][1]);
            }
            out[r][t] = reduce_lanes(&lanes);
        }
    }
    out
}

/// A zeroed accumulator per (row, token).
#[inline]
#[target_feature(enable = "neon")]
fn zeros<const R: usize, const T: usize>() -> [[Acc; T]; R] {
    [[[vdupq_n_f32(0.0); 2]; T]; R]
}

/// See [`super::tile`].
///
/// # Safety
/// NEON; all slices have one length.
#[target_feature(enable = "neon")]
pub(super) unsafe fn tile<const R: usize, const T: usize>(
    weights: [&[f32]; R],
    activations: [&[f32]; T],
) -> [[f32; T]; R] {
    let k = activations.first().map_or(0, |x| x.len());
    let full = k / LANES * LANES;
    let mut acc = zeros::<R, T>();
    // SAFETY: every slice holds k >= full values.
    unsafe { accumulate(&mut acc, weights, activations, 0, full) };
    finish(&sums(&acc), weights, activations, full)
}

/// See [`super::quantized_tile`]: the block formats one block of every row at a time (the
/// scalar block decoders, which the compiler vectorises with NEON, inlined here); other
/// types [`DECODE_CHUNK`] values at a time through [`decode_range`].
///
/// # Safety
/// NEON; every row holds exactly `ty.bytes_for(x.len())` bytes of a dequantizable `ty`.
#[target_feature(enable = "neon")]
pub(super) unsafe fn quantized_tile<const R: usize>(
    ty: GgmlType,
    rows: [&[u8]; R],
    x: &[f32],
) -> [f32; R] {
    // SAFETY (all arms): NEON is enabled here; row lengths were checked by the caller.
    unsafe {
        match ty {
            GgmlType::Q8_0 => return by_blocks_q8_0(rows, x),
            GgmlType::Q4_0 => return by_blocks_q4_0(rows, x),
            GgmlType::Q4_1 => return by_blocks_q4_1(rows, x),
            GgmlType::Q5_0 => return by_blocks_q5_0(rows, x),
            GgmlType::Q5_1 => return by_blocks_q5_1(rows, x),
            GgmlType::Q4K => return by_blocks_q4_k(rows, x),
            GgmlType::Q5K => return by_blocks_q5_k(rows, x),
            GgmlType::Q6K => return by_blocks_q6_k(rows, x),
            _ => {}
        }
    }
    let k = x.len();
    let full = k / LANES * LANES;
    let mut acc = zeros::<R, 1>();
    let mut buffer = [[0f32; DECODE_CHUNK]; R];
    let mut out = [0f32; R];
    for start in (0..k).step_by(DECODE_CHUNK) {
        let end = (start + DECODE_CHUNK).min(k);
        for (row, values) in rows.iter().zip(buffer.iter_mut()) {
            decode_range(ty, row, start, end, &mut values[..end - start]);
        }
        let weights: [&[f32]; R] = std::array::from_fn(|r| &buffer[r][..end - start]);
        let chunk_full = full.min(end) - start;
        // SAFETY: every slice holds end - start >= chunk_full values.
        unsafe { accumulate(&mut acc, weights, [&x[start..end]], 0, chunk_full) };
        if end == k {
            let local = finish(&sums(&acc), weights, [&x[start..end]], chunk_full);
            out = std::array::from_fn(|r| local[r][0]);
        }
    }
    out
}

/// `$name::<R>(rows, x)`: `out[r] = dot(decode(rows[r]), x)` one block (`$values` values, a
/// multiple of [`LANES`]) at a time with the block decoder `$decode` (a direct call, so it
/// inlines). SAFETY (caller): NEON; every row holds `x.len() / $values` blocks of `$bytes`
/// bytes and `x.len()` is a multiple of `$values`.
macro_rules! by_blocks_fn {
    ($name:ident, $decode:path, $bytes:expr, $values:expr) => {
        #[target_feature(enable = "neon")]
        unsafe fn $name<const R: usize>(rows: [&[u8]; R], x: &[f32]) -> [f32; R] {
            const BYTES: usize = $bytes;
            const VALUES: usize = $values;
            let mut acc = zeros::<R, 1>();
            let mut values = [[0f32; VALUES]; R];
            for (block, xs) in x.chunks_exact(VALUES).enumerate() {
                for r in 0..R {
                    let bytes: &[u8; BYTES] = rows[r][block * BYTES..(block + 1) * BYTES]
                        .try_into()
                        .unwrap();
                    $decode(bytes, &mut values[r]);
                }
                let mut weights: [&[f32]; R] = [&[]; R];
                for r in 0..R {
                    weights[r] = &values[r];
                }
                // SAFETY: every slice holds VALUES values, a multiple of LANES.
                unsafe { accumulate(&mut acc, weights, [xs], 0, VALUES) };
            }
            let sums = sums(&acc);
            std::array::from_fn(|r| sums[r][0])
        }
    };
}

use pagoda_tensor::quant::blocks as b;
by_blocks_fn!(by_blocks_q8_0, b::q8_0, b::Q8_0_BYTES, b::QK);
by_blocks_fn!(by_blocks_q4_0, b::q4_0, b::Q4_0_BYTES, b::QK);
by_blocks_fn!(by_blocks_q4_1, b::q4_1, b::Q4_1_BYTES, b::QK);
by_blocks_fn!(by_blocks_q5_0, b::q5_0, b::Q5_0_BYTES, b::QK);
by_blocks_fn!(by_blocks_q5_1, b::q5_1, b::Q5_1_BYTES, b::QK);
by_blocks_fn!(by_blocks_q4_k, b::q4_k, b::Q4_K_BYTES, b::QK_K);
by_blocks_fn!(by_blocks_q5_k, b::q5_k, b::Q5_K_BYTES, b::QK_K);
by_blocks_fn!(by_blocks_q6_k, b::q6_k, b::Q6_K_BYTES, b::QK_K);
