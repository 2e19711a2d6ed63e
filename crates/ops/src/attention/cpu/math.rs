//! The scalar helpers of the CPU kernels: base-2 softmax scaling, dot products, row updates.

/// `log2(e)`: pre-multiplying the scale by it turns `exp(x)` into `exp2(x * log2(e))`.
pub(crate) const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// Dot product of two equal-length rows, with eight independent accumulators so the loop
/// vectorizes without reassociation flags.
pub(crate) fn dot(left: &[f32], right: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let left_chunks = left.chunks_exact(8);
    let right_chunks = right.chunks_exact(8);
    let tail: f32 = left_chunks
        .remainder()
        .iter()
        .zip(right_chunks.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in left_chunks.zip(right_chunks) {
        for lane in 0..8 {
            lanes[lane] += a[lane] * b[lane];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `accumulator += weight * row`, element-wise.
pub(crate) fn add_scaled(accumulator: &mut [f32], weight: f32, row: &[f32]) {
    for (target, value) in accumulator.iter_mut().zip(row) {
        *target += weight * value;
    }
}
