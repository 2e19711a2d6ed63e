//! Activations quantized on the fly to 8-bit integers, for integer dot products with
//! quantized weights (see [`super::repack`]).
//!
//! Every row of `row_len` values (a multiple of [`Q8_BLOCK`]) is split into blocks of 32;
//! block `b` stores `qs[i] = round_ties_even(x[i] / d)` with `d = max|x| / 127` (an f32
//! scale, not rounded to f16 as llama.cpp's Q8_1 does), and `sum = d * sum(qs)`, which the
//! weight formats with an offset or a minimum need. A block of zeros has `d = 0`.
//!
//! **Q15** rows ([`Q8Rows::reset_q15`], [`quantize_block_q15`]) keep 128 times finer steps
//! for the same integer kernels: `d = max|x| / 16256` and `q = round_ties_even(x / d)` in
//! `[-16256, 16256]`, stored as two i8 planes, `hi = (q + 64) >> 7` in `[-127, 127]` (in
//! `qs`) and `lo = q - 128 hi` in `[-64, 63]` (in the `lo` plane), so a block's integer dot is
//! `128 * dot(w, hi) + dot(w, lo)`, exact in i32, and everything after it is the Q8 recipe.

/// Values per activation block.
pub const Q8_BLOCK: usize = 32;

/// The largest Q15 magnitude: `127 * 128`, so `hi` stays within an i8's `[-127, 127]`.
pub const Q15_MAX: i32 = 127 * 128;

/// `num_rows` rows of quantized activations, row-major: `qs` is `[num_rows, row_len]`,
/// `scales` and `sums` are `[num_rows, row_len / 32]`; Q15 rows add the `lo` plane, shaped
/// as `qs` (empty for Q8 rows).
#[derive(Debug, Clone, Default)]
pub struct Q8Rows {
    num_rows: usize,
    row_len: usize,
    qs: Vec<i8>,
    lo: Vec<i8>,
    q15: bool,
    scales: Vec<f32>,
    sums: Vec<f32>,
}

/// Why activations could not be quantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Q8Error {
    /// The row length is not a positive multiple of 32.
    #[error("activation row length {row_len} is not a positive multiple of {Q8_BLOCK}")]
    RowLength {
        /// The offending row length.
        row_len: usize,
    },
    /// The input is not a whole number of rows.
    #[error("{len} activation values are not a whole number of rows of {row_len}")]
    Shape {
        /// Values given.
        len: usize,
        /// Values per row.
        row_len: usize,
    },
}

impl Q8Rows {
    /// Quantizes `x` (`[num_rows, row_len]` row-major f32) block by block. Non-finite inputs
    /// give unspecified (but memory-safe) values.
    pub fn quantize(x: &[f32], row_len: usize) -> Result<Q8Rows, Q8Error> {
        let mut rows = Q8Rows::default();
        rows.quantize_into(x, row_len)?;
        Ok(rows)
    }

    /// Like [`Q8Rows::quantize`], reusing this value's buffers.
    pub fn quantize_into(&mut self, x: &[f32], row_len: usize) -> Result<(), Q8Error> {
        self.reset(rows_of(x, row_len)?, row_len)?;
        for (((xs, qs), scale), sum) in x
            .chunks_exact(Q8_BLOCK)
            .zip(self.qs.chunks_exact_mut(Q8_BLOCK))
            .zip(self.scales.iter_mut())
            .zip(self.sums.iter_mut())
        {
            let xs: &[f32; Q8_BLOCK] = xs.try_into().unwrap();
            let qs: &mut [i8; Q8_BLOCK] = qs.try_into().unwrap();
            (*scale, *sum) = quantize_block(xs, qs);
        }
        Ok(())
    }

    /// Quantizes `x` (`[num_rows, row_len]` row-major f32) into Q15 rows (see the module
    /// docs) block by block: [`quantize_block_q15`], the portable reference.
    pub fn quantize_q15(x: &[f32], row_len: usize) -> Result<Q8Rows, Q8Error> {
        let mut rows = Q8Rows::default();
        rows.reset_q15(rows_of(x, row_len)?, row_len)?;
        let (hi, lo, scales, sums) = rows.parts_mut();
        for ((((xs, hi), lo), scale), sum) in x
            .chunks_exact(Q8_BLOCK)
            .zip(hi.chunks_exact_mut(Q8_BLOCK))
            .zip(lo.chunks_exact_mut(Q8_BLOCK))
            .zip(scales.iter_mut())
            .zip(sums.iter_mut())
        {
            (*scale, *sum) = quantize_block_q15(
                xs.try_into().unwrap(),
                hi.try_into().unwrap(),
                lo.try_into().unwrap(),
            );
        }
        Ok(rows)
    }

    /// Sizes the buffers for `num_rows` rows of `row_len` values (same checks as
    /// [`Q8Rows::quantize`]) without quantizing; fill them with [`Q8Rows::parts_mut`] and
    /// [`quantize_block`] (how a caller parallelizes or vectorizes the quantization).
    pub fn reset(&mut self, num_rows: usize, row_len: usize) -> Result<(), Q8Error> {
        if row_len == 0 || !row_len.is_multiple_of(Q8_BLOCK) {
            return Err(Q8Error::RowLength { row_len });
        }
        self.num_rows = num_rows;
        self.row_len = row_len;
        self.qs.resize(num_rows * row_len, 0);
        self.lo.clear();
        self.q15 = false;
        self.scales.resize(num_rows * row_len / Q8_BLOCK, 0.0);
        self.sums.resize(num_rows * row_len / Q8_BLOCK, 0.0);
        Ok(())
    }

    /// Like [`Q8Rows::reset`], for Q15 rows (see the module docs): fill them with
    /// [`Q8Rows::parts_mut`] and [`quantize_block_q15`].
    pub fn reset_q15(&mut self, num_rows: usize, row_len: usize) -> Result<(), Q8Error> {
        self.reset(num_rows, row_len)?;
        self.lo.resize(num_rows * row_len, 0);
        self.q15 = true;
        Ok(())
    }

    /// The buffers `(qs, lo, scales, sums)`, for filling after [`Q8Rows::reset`] (`lo` is
    /// empty) or [`Q8Rows::reset_q15`] (`qs` is the `hi` plane).
    pub fn parts_mut(&mut self) -> (&mut [i8], &mut [i8], &mut [f32], &mut [f32]) {
        (&mut self.qs, &mut self.lo, &mut self.scales, &mut self.sums)
    }

    /// Whether these are Q15 rows (a `lo` plane beside `qs`).
    pub fn is_q15(&self) -> bool {
        self.q15
    }
    /// Every row's `lo` values (Q15 rows; empty for Q8 rows).
    pub fn lo(&self) -> &[i8] {
        &self.lo
    }
    /// The `lo` values of row `row` (Q15 rows only).
    pub fn row_lo(&self, row: usize) -> &[i8] {
        &self.lo[row * self.row_len..(row + 1) * self.row_len]
    }

    /// Rows held.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }
    /// Values per row.
    pub fn row_len(&self) -> usize {
        self.row_len
    }
    /// Blocks per row (`row_len / 32`).
    pub fn blocks_per_row(&self) -> usize {
        self.row_len / Q8_BLOCK
    }
    /// Every row's quantized values (Q15 rows: the `hi` plane), row after row.
    pub fn qs(&self) -> &[i8] {
        &self.qs
    }
    /// The quantized values of row `row` (`row_len` of them).
    pub fn row_qs(&self, row: usize) -> &[i8] {
        &self.qs[row * self.row_len..(row + 1) * self.row_len]
    }
    /// The per-block scales of row `row`.
    pub fn row_scales(&self, row: usize) -> &[f32] {
        let nb = self.blocks_per_row();
        &self.scales[row * nb..(row + 1) * nb]
    }
    /// The per-block `d * sum(qs)` of row `row`.
    pub fn row_sums(&self, row: usize) -> &[f32] {
        let nb = self.blocks_per_row();
        &self.sums[row * nb..(row + 1) * nb]
    }
    /// Row `row` decoded back to f32 (`q * d`, Q15 rows `(128 hi + lo) * d`), into `out`
    /// (`row_len` values).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let q15 = self.is_q15();
        for (block, (out, &d)) in out
            .chunks_exact_mut(Q8_BLOCK)
            .zip(self.row_scales(row))
            .enumerate()
        {
            for (i, value) in out.iter_mut().enumerate() {
                let at = row * self.row_len + block * Q8_BLOCK + i;
                let q = if q15 {
                    128 * self.qs[at] as i32 + self.lo[at] as i32
                } else {
                    self.qs[at] as i32
                };
                *value = q as f32 * d;
            }
        }
    }
}

/// The number of rows of `row_len` values in `x`, or why `x` is not such rows.
fn rows_of(x: &[f32], row_len: usize) -> Result<usize, Q8Error> {
    if row_len == 0 || !row_len.is_multiple_of(Q8_BLOCK) {
        return Err(Q8Error::RowLength { row_len });
    }
    if !x.len().is_multiple_of(row_len) {
        return Err(Q8Error::Shape {
            len: x.len(),
            row_len,
        });
    }
    Ok(x.len() / row_len)
}

/// One block: returns `(d, d * sum(qs))` and writes `qs`. Written so LLVM vectorizes it.
#[inline(always)]
pub fn quantize_block(xs: &[f32; Q8_BLOCK], qs: &mut [i8; Q8_BLOCK]) -> (f32, f32) {
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut total = 0i32;
    for (q, &x) in qs.iter_mut().zip(xs) {
        let v = (x * inverse).round_ties_even().clamp(-127.0, 127.0) as i32;
        *q = v as i8;
        total += v;
    }
    (d, d * total as f32)
}

/// One Q15 block (see the module docs): returns `(d, d * sum(q))` and writes the `hi` and `lo`
/// planes, with [`quantize_block`]'s operations at `16256` in place of `127`.
#[inline(always)]
pub fn quantize_block_q15(
    xs: &[f32; Q8_BLOCK],
    hi: &mut [i8; Q8_BLOCK],
    lo: &mut [i8; Q8_BLOCK],
) -> (f32, f32) {
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / Q15_MAX as f32;
    let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
    let limit = Q15_MAX as f32;
    let mut total = 0i32;
    for ((h, l), &x) in hi.iter_mut().zip(lo.iter_mut()).zip(xs) {
        let q = (x * inverse).round_ties_even().clamp(-limit, limit) as i32;
        let high = (q + 64) >> 7;
        *h = high as i8;
        *l = (q - (high << 7)) as i8;
        total += q;
    }
    (d, d * total as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q15 rows decode to within half a step (`d / 2`, `d = max|x| / 16256`) of the input, the
    /// planes stay in `[-127, 127]` and `[-64, 63]`, and the sum is `d` times the integers'.
    #[test]
    fn q15_rows_are_128_times_finer_than_q8() {
        let mut state = 7u32;
        let x: Vec<f32> = (0..64 * 5)
            .map(|i| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let unit = (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                // Wide ranges, a zero block and exact extremes.
                match i / 64 {
                    0 => unit * 1e-3,
                    1 => unit * 40.0,
                    2 => 0.0,
                    3 => {
                        if i % 2 == 0 {
                            3.0
                        } else {
                            -3.0
                        }
                    }
                    _ => unit * (i as f32).exp2().min(1e6),
                }
            })
            .collect();
        let q15 = Q8Rows::quantize_q15(&x, 64).unwrap();
        let q8 = Q8Rows::quantize(&x, 64).unwrap();
        assert!(q15.is_q15() && !q8.is_q15());
        let (mut fine, mut coarse) = (vec![0f32; 64], vec![0f32; 64]);
        for row in 0..5 {
            q15.dequantize_row(row, &mut fine);
            q8.dequantize_row(row, &mut coarse);
            for (block, xs) in x[row * 64..(row + 1) * 64].chunks_exact(32).enumerate() {
                let d = q15.row_scales(row)[block];
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(d, amax / Q15_MAX as f32);
                let mut total = 0i32;
                for i in 0..32 {
                    let at = block * 32 + i;
                    let (hi, lo) = (q15.row_qs(row)[at] as i32, q15.row_lo(row)[at] as i32);
                    assert!((-127..=127).contains(&hi) && (-64..=63).contains(&lo));
                    total += 128 * hi + lo;
                    let err = (fine[at] - xs[i]).abs();
                    assert!(
                        err <= d * 0.5 * (1.0 + 1e-5),
                        "row {row} value {at}: {err} vs {d}"
                    );
                }
                assert_eq!(q15.row_sums(row)[block], d * total as f32);
            }
            let err = |values: &[f32]| {
                values
                    .iter()
                    .zip(&x[row * 64..])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max)
            };
            assert!(
                err(&fine) * 100.0 <= err(&coarse).max(f32::MIN_POSITIVE),
                "row {row}"
            );
        }
        assert_eq!(
            Q8Rows::quantize_q15(&x[..40], 40).unwrap_err(),
            Q8Error::RowLength { row_len: 40 }
        );
    }
}
