//! Fused dot products: each block is decoded in registers and multiplied straight into
//! 16 (32-value formats) or 32 (K-quants) accumulator lanes, with no intermediate buffer,
//! which LLVM turns into straight-line SIMD. Values are decoded exactly as in [`super::blocks`];
//! only the summation order differs from a sequential dot of the dequantized row.

use super::blocks::{
    f16_at, q5_values, scale_min_k4, Q4_0_BYTES, Q4_1_BYTES, Q4_K_BYTES, Q5_0_BYTES, Q5_1_BYTES,
    Q5_K_BYTES, Q6_K_BYTES, Q8_0_BYTES, QK, QK_K,
};

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
#[inline(always)]
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
#[inline(always)]
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

/// `row` holds whole Q5_0 blocks for `x.len()` values (checked by the caller).
#[inline(always)]
pub fn q5_0(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; HALF];
    for (block, xs) in row.chunks_exact(Q5_0_BYTES).zip(x.chunks_exact(QK)) {
        let xs: &[f32; QK] = xs.try_into().unwrap();
        let d = f16_at(block, 0);
        let q = q5_values(&block[2..6], &block[6..]);
        for j in 0..HALF {
            let low = (q[j] as i32 - 16) as f32 * d;
            let high = (q[HALF + j] as i32 - 16) as f32 * d;
            lanes[j] += low * xs[j] + high * xs[HALF + j];
        }
    }
    lanes_sum(&lanes)
}

/// `row` holds whole Q5_1 blocks for `x.len()` values (checked by the caller).
#[inline(always)]
pub fn q5_1(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; HALF];
    for (block, xs) in row.chunks_exact(Q5_1_BYTES).zip(x.chunks_exact(QK)) {
        let xs: &[f32; QK] = xs.try_into().unwrap();
        let (d, m) = (f16_at(block, 0), f16_at(block, 2));
        let q = q5_values(&block[4..8], &block[8..]);
        for j in 0..HALF {
            let low = q[j] as f32 * d + m;
            let high = q[HALF + j] as f32 * d + m;
            lanes[j] += low * xs[j] + high * xs[HALF + j];
        }
    }
    lanes_sum(&lanes)
}

/// `row` holds whole Q4_1 blocks for `x.len()` values (checked by the caller).
#[inline(always)]
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

/// Accumulates `(scale * q - min) * x` for 64 values: 32 low nibbles (scale/min `low`)
/// and 32 high nibbles (scale/min `high`), into 32 lanes. Shared by Q4_K and Q5_K.
#[inline(always)]
fn k_chunk(
    lanes: &mut [f32; 32],
    quants_low: &[u8; 32],
    quants_high: &[u8; 32],
    (scale_low, min_low): (f32, f32),
    (scale_high, min_high): (f32, f32),
    xs: &[f32; 64],
) {
    for l in 0..32 {
        let low = scale_low * quants_low[l] as f32 - min_low;
        let high = scale_high * quants_high[l] as f32 - min_high;
        lanes[l] += low * xs[l] + high * xs[32 + l];
    }
}

/// `row` holds whole Q4_K super-blocks for `x.len()` values (checked by the caller).
#[inline(always)]
pub fn q4_k(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 32];
    for (block, xs) in row.chunks_exact(Q4_K_BYTES).zip(x.chunks_exact(QK_K)) {
        let d = f16_at(block, 0);
        let dmin = f16_at(block, 2);
        let scales: &[u8; 12] = block[4..16].try_into().unwrap();
        for (chunk, (q, xs)) in block[16..]
            .chunks_exact(32)
            .zip(xs.chunks_exact(64))
            .enumerate()
        {
            let q: &[u8; 32] = q.try_into().unwrap();
            let low: [u8; 32] = std::array::from_fn(|l| q[l] & 0x0F);
            let high: [u8; 32] = std::array::from_fn(|l| q[l] >> 4);
            let (sl, ml) = scale_min_k4(2 * chunk, scales);
            let (sh, mh) = scale_min_k4(2 * chunk + 1, scales);
            k_chunk(
                &mut lanes,
                &low,
                &high,
                (d * sl as f32, dmin * ml as f32),
                (d * sh as f32, dmin * mh as f32),
                xs.try_into().unwrap(),
            );
        }
    }
    lanes_sum(&lanes[..16].try_into().unwrap()) + lanes_sum(&lanes[16..].try_into().unwrap())
}

/// `row` holds whole Q5_K super-blocks for `x.len()` values (checked by the caller).
#[inline(always)]
pub fn q5_k(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 32];
    for (block, xs) in row.chunks_exact(Q5_K_BYTES).zip(x.chunks_exact(QK_K)) {
        let d = f16_at(block, 0);
        let dmin = f16_at(block, 2);
        let scales: &[u8; 12] = block[4..16].try_into().unwrap();
        let qh: &[u8; 32] = block[16..48].try_into().unwrap();
        for (chunk, (q, xs)) in block[48..]
            .chunks_exact(32)
            .zip(xs.chunks_exact(64))
            .enumerate()
        {
            let q: &[u8; 32] = q.try_into().unwrap();
            let (shift_low, shift_high) = (2 * chunk, 2 * chunk + 1);
            let low: [u8; 32] =
                std::array::from_fn(|l| (q[l] & 0x0F) | (((qh[l] >> shift_low) & 1) << 4));
            let high: [u8; 32] =
                std::array::from_fn(|l| (q[l] >> 4) | (((qh[l] >> shift_high) & 1) << 4));
            let (sl, ml) = scale_min_k4(2 * chunk, scales);
            let (sh, mh) = scale_min_k4(2 * chunk + 1, scales);
            k_chunk(
                &mut lanes,
                &low,
                &high,
                (d * sl as f32, dmin * ml as f32),
                (d * sh as f32, dmin * mh as f32),
                xs.try_into().unwrap(),
            );
        }
    }
    lanes_sum(&lanes[..16].try_into().unwrap()) + lanes_sum(&lanes[16..].try_into().unwrap())
}

/// `row` holds whole Q6_K super-blocks for `x.len()` values (checked by the caller).
#[inline(always)]
pub fn q6_k(row: &[u8], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 32];
    for (block, xs) in row.chunks_exact(Q6_K_BYTES).zip(x.chunks_exact(QK_K)) {
        let d = f16_at(block, 208);
        for half in 0..2 {
            let ql: &[u8; 64] = block[64 * half..64 * half + 64].try_into().unwrap();
            let qh: &[u8; 32] = block[128 + 32 * half..160 + 32 * half].try_into().unwrap();
            let sc = &block[192 + 8 * half..200 + 8 * half];
            let xs: &[f32; 128] = xs[128 * half..128 * half + 128].try_into().unwrap();
            // Scale of value l + 32 * k is sc[l / 16 + 2 * k].
            let scale = |k: usize, l: usize| d * (sc[l / 16 + 2 * k] as i8) as f32;
            for l in 0..32 {
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                lanes[l] += scale(0, l) * q1 as f32 * xs[l]
                    + scale(1, l) * q2 as f32 * xs[l + 32]
                    + scale(2, l) * q3 as f32 * xs[l + 64]
                    + scale(3, l) * q4 as f32 * xs[l + 96];
            }
        }
    }
    lanes_sum(&lanes[..16].try_into().unwrap()) + lanes_sum(&lanes[16..].try_into().unwrap())
}

/// Any super-block format: each block decoded by `decode` into 256 values, then
/// multiplied into 32 lanes (the low-bit K-quants, Q2_K and Q3_K, which no hot path runs in
/// f32 often enough to fuse).
#[inline(always)]
pub fn decoded<const BYTES: usize>(
    row: &[u8],
    x: &[f32],
    decode: impl Fn(&[u8; BYTES], &mut [f32; QK_K]),
) -> f32 {
    let mut lanes = [0f32; 32];
    let mut values = [0f32; QK_K];
    for (block, xs) in row.chunks_exact(BYTES).zip(x.chunks_exact(QK_K)) {
        decode(block.try_into().unwrap(), &mut values);
        for (v, x) in values.chunks_exact(32).zip(xs.chunks_exact(32)) {
            for l in 0..32 {
                lanes[l] += v[l] * x[l];
            }
        }
    }
    lanes_sum(&lanes[..16].try_into().unwrap()) + lanes_sum(&lanes[16..].try_into().unwrap())
}
