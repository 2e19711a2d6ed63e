//! Dequantization of GGML block formats to `f32`, and quantized-row dot products.
//!
//! Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Every decoder is
//! bit-exact with ggml's scalar `dequantize_row_*` (checked against gguf-py's numpy
//! implementation in `tests/dequantize.rs`). The per-block decoders live in [`blocks`].

pub mod blocks;
mod dot;
pub mod q8;
pub mod repack;

use crate::{GgmlType, UnsupportedType};

/// Decodes `out.len()` values stored as `ty` in `src` into `out` (GGML order: one row or
/// several consecutive rows; every value of `out` is written).
///
/// Returns [`UnsupportedType`] for types [`GgmlType::is_dequantizable`] rejects, before
/// looking at the lengths. `src` must hold exactly `ty.bytes_for(out.len())` bytes (callers
/// validate; this panics on a length mismatch because that is a bug in the caller, never
/// bad input).
#[inline]
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), UnsupportedType> {
    if !ty.is_dequantizable() {
        return Err(UnsupportedType { ty });
    }
    check_lengths(ty, src.len(), out.len());
    match ty {
        GgmlType::F32 => {
            for (value, bytes) in out.iter_mut().zip(src.chunks_exact(4)) {
                *value = f32::from_le_bytes(bytes.try_into().unwrap());
            }
        }
        GgmlType::F16 => {
            for (value, bytes) in out.iter_mut().zip(src.chunks_exact(2)) {
                *value = blocks::f16_at(bytes, 0);
            }
        }
        GgmlType::BF16 => {
            for (value, bytes) in out.iter_mut().zip(src.chunks_exact(2)) {
                *value = bf16_to_f32([bytes[0], bytes[1]]);
            }
        }
        GgmlType::Q8_0 => decode_blocks(src, out, blocks::q8_0),
        GgmlType::Q4_0 => decode_blocks(src, out, blocks::q4_0),
        GgmlType::Q4_1 => decode_blocks(src, out, blocks::q4_1),
        GgmlType::Q5_0 => decode_blocks(src, out, blocks::q5_0),
        GgmlType::Q5_1 => decode_blocks(src, out, blocks::q5_1),
        GgmlType::Q2K => decode_blocks(src, out, blocks::q2_k),
        GgmlType::Q3K => decode_blocks(src, out, blocks::q3_k),
        GgmlType::Q4K => decode_blocks(src, out, blocks::q4_k),
        GgmlType::Q5K => decode_blocks(src, out, blocks::q5_k),
        GgmlType::Q6K => decode_blocks(src, out, blocks::q6_k),
        _ => unreachable!("is_dequantizable() admitted {ty}"),
    }
    Ok(())
}

/// Dot product of one stored row with `x`: `sum_i dequantize(row)[i] * x[i]`.
///
/// No heap allocation: each block is decoded in registers and multiplied straight into
/// 16 or 32 accumulator lanes (see the `dot` submodule). Each value is decoded exactly as
/// [`dequantize`] does, so the result equals the dot product of the dequantized row up to float summation order
/// (it is not bit-identical to a sequential sum). This is the CPU matmul's inner loop.
///
/// Panics if `ty` is not [`GgmlType::is_dequantizable`] or `row.len() !=
/// ty.bytes_for(x.len())`: weight types and shapes are validated once at load time, so
/// either is a caller bug.
#[inline(always)]
pub fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    assert!(ty.is_dequantizable(), "dot_row: {}", UnsupportedType { ty });
    check_lengths(ty, row.len(), x.len());
    match ty {
        GgmlType::F32 => dot_plain::<4>(row, x, f32::from_le_bytes),
        GgmlType::F16 => dot_plain::<2>(row, x, |b| blocks::f16_bits_to_f32(u16::from_le_bytes(b))),
        GgmlType::BF16 => dot_plain::<2>(row, x, bf16_to_f32),
        GgmlType::Q8_0 => dot::q8_0(row, x),
        GgmlType::Q4_0 => dot::q4_0(row, x),
        GgmlType::Q4_1 => dot::q4_1(row, x),
        GgmlType::Q5_0 => dot::q5_0(row, x),
        GgmlType::Q5_1 => dot::q5_1(row, x),
        GgmlType::Q2K => dot::decoded::<{ blocks::Q2_K_BYTES }>(row, x, blocks::q2_k),
        GgmlType::Q3K => dot::decoded::<{ blocks::Q3_K_BYTES }>(row, x, blocks::q3_k),
        GgmlType::Q4K => dot::q4_k(row, x),
        GgmlType::Q5K => dot::q5_k(row, x),
        GgmlType::Q6K => dot::q6_k(row, x),
        _ => unreachable!("is_dequantizable() admitted {ty}"),
    }
}

/// `bf16` is the top half of an `f32`.
#[inline(always)]
fn bf16_to_f32(bytes: [u8; 2]) -> f32 {
    f32::from_bits((u16::from_le_bytes(bytes) as u32) << 16)
}

#[inline(always)]
fn check_lengths(ty: GgmlType, num_bytes: usize, num_values: usize) {
    let expected = ty.bytes_for(num_values);
    assert!(
        expected == Some(num_bytes),
        "{ty}: {num_values} values need {expected:?} bytes (a whole number of {}-value \
         blocks), got {num_bytes}",
        ty.block_size().unwrap_or(0)
    );
}

#[inline(always)]
fn decode_blocks<const BYTES: usize, const VALUES: usize>(
    src: &[u8],
    out: &mut [f32],
    decode: impl Fn(&[u8; BYTES], &mut [f32; VALUES]),
) {
    for (block, values) in src.chunks_exact(BYTES).zip(out.chunks_exact_mut(VALUES)) {
        decode(block.try_into().unwrap(), values.try_into().unwrap());
    }
}

const LANES: usize = 16;

/// Dot product for the one-value-per-element formats: 16 values decoded per step into
/// registers, 16 accumulator lanes, and a scalar tail.
#[inline(always)]
fn dot_plain<const BYTES: usize>(
    row: &[u8],
    x: &[f32],
    decode: impl Fn([u8; BYTES]) -> f32,
) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut row_chunks = row.chunks_exact(BYTES * LANES);
    let mut x_chunks = x.chunks_exact(LANES);
    for (bytes, xs) in (&mut row_chunks).zip(&mut x_chunks) {
        let values: [f32; LANES] = std::array::from_fn(|lane| {
            decode(
                bytes[lane * BYTES..lane * BYTES + BYTES]
                    .try_into()
                    .unwrap(),
            )
        });
        for lane in 0..LANES {
            lanes[lane] += values[lane] * xs[lane];
        }
    }
    let mut tail = 0f32;
    for (bytes, &v) in row_chunks
        .remainder()
        .chunks_exact(BYTES)
        .zip(x_chunks.remainder())
    {
        tail += decode(bytes.try_into().unwrap()) * v;
    }
    lanes.iter().sum::<f32>() + tail
}
