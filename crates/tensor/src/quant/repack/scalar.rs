//! The scalar reference dot of repacked rows: the oracle every integer kernel is tested
//! against.

use super::{RepackedRows, QK};
use crate::quant::q8::Q8Rows;

/// The scalar reference kernel: `dot(weights[row], activations[token])` computed as
/// `sum_b d_w d_a ((u - zero) . qa) + min_w s_a` block by block (with sub-mins,
/// `+ min_w d_a min_integer` for the second term) (Q15 rows: the integer is
/// `128 (u - zero) . hi + (u - zero) . lo`). Panics if the row lengths differ
/// (shapes are validated when a layer is built).
pub fn dot_scalar(weights: &RepackedRows, row: usize, activations: &Q8Rows, token: usize) -> f32 {
    assert_eq!(
        weights.blocks_per_row,
        activations.blocks_per_row(),
        "weight and activation rows differ in length"
    );
    let qa = activations.row_qs(token);
    let (da, sa) = (activations.row_scales(token), activations.row_sums(token));
    let factors = weights.row_factors(row);
    let mut total = 0f32;
    for block in 0..weights.blocks_per_row {
        let range = block * QK..(block + 1) * QK;
        let mut integer = weights.block_integer_dot(row, block, &qa[range.clone()]);
        let mut min_integer = weights.block_min_integer(row, block, &qa[range.clone()]);
        if activations.is_q15() {
            // 128 (u - zero) . hi + (u - zero) . lo: the block's Q15 integer, exact in i32.
            let lo = &activations.row_lo(token)[range];
            integer = (integer << 7).wrapping_add(weights.block_integer_dot(row, block, lo));
            min_integer = (min_integer << 7) + weights.block_min_integer(row, block, lo);
        }
        let (d, min) = (factors.scale(block), factors.min(block));
        total += if weights.has_sub_mins() {
            d * da[block] * integer as f32 + min * da[block] * min_integer as f32
        } else {
            d * da[block] * integer as f32 + min * sa[block]
        };
    }
    total
}
