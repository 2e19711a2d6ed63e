//! Fused dot products for the 32-value formats: each block is decoded in registers and
//! multiplied straight into 16 accumulator lanes (no intermediate buffer), which LLVM
//! turns into straight-line SIMD. Values are decoded exactly as in [`super::blocks`];
//! only the summation order differs from a sequential dot of the dequantized row.

use super::blocks::{f16_at, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES, QK};

const HALF: usize = QK / 2;

#[inline(always)]
fn lanes_sum(lanes: &[f32; HALF]) -> f32 {
    // Pairwise, so the reduction itself vectorizes.
    let mut eight = [0f32; 8];
    for i in 0..8 {
        eight[i] = lanes[i] + lanes[i + 8];
    }
    let four = [
        eight[0] + eight[4],
        eight[1] + eight[5],
        eight[2] + eight[6],
        eight[3] + eight[7],
    ];
    (four[0] + four[2]) + (four[1] + four[3])
}

/// `row` holds whole Q8_0 blocks for `x.len()` values (checked by the caller).
#[inline]
pub fn q8_0(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; HALF];
    for (block, xs) in row.chunks_exact(Q8_0_BYTES).zip(x.chunks_exact(QK)) {
        let block: &[u8; Q8_0_BYTES] = block.try_into().unwrap();
        let xs: &[f32; QK] = xs.try_into().unwrap();
        let d = f16_at(block, 0);
        for j in 0..HALF {
            let low = (block[2 + j] as i8) as f32 * d;
            let high = (block[2 + HALF + j] as i8) as f32 * d;
            lanes[j] += low * xs[j] + high * xs[HALF + j];
        }
    }
    lanes_sum(&lanes)
}

/// `row` holds whole Q4_0 blocks for `x.len()` values (checked by the caller).
#[inline]
pub fn q4_0(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; HALF];
    for (block, xs) in row.chunks_exact(Q4_0_BYTES).zip(x.chunks_exact(QK)) {
        let block: &[u8; Q4_0_BYTES] = block.try_into().unwrap();
        let xs: &[f32; QK] = xs.try_into().unwrap();
        let d = f16_at(block, 0);
        for j in 0..HALF {
            let q = block[2 + j];
            let low = ((q & 0x0F) as i32 - 8) as f32 * d;
            let high = ((q >> 4) as i32 - 8) as f32 * d;
            lanes[j] += low * xs[j] + high * xs[HALF + j];
        }
    }
    lanes_sum(&lanes)
}

/// `row` holds whole Q4_1 blocks for `x.len()` values (checked by the caller).
#[inline]
pub fn q4_1(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; HALF];
    for (block, xs) in row.chunks_exact(Q4_1_BYTES).zip(x.chunks_exact(QK)) {
        let block: &[u8; Q4_1_BYTES] = block.try_into().unwrap();
        let xs: &[f32; QK] = xs.try_into().unwrap();
        let d = f16_at(block, 0);
        let m = f16_at(block, 2);
        for j in 0..HALF {
            let q = block[4 + j];
            let low = (q & 0x0F) as f32 * d + m;
            let high = (q >> 4) as f32 * d + m;
            lanes[j] += low * xs[j] + high * xs[HALF + j];
        }
    }
    lanes_sum(&lanes)
}
