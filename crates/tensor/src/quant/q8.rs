//! Activations quantized on the fly to 8-bit integers, for integer dot products with
//! quantized weights (see [`super::repack`]).
//!
//! Every row of `row_len` values (a multiple of [`Q8_BLOCK`]) is split into blocks of 32;
//! block `b` stores `qs[i] = round_ties_even(x[i] / d)` with `d = max|x| / 127` (an f32
//! scale, not rounded to f16 as llama.cpp's Q8_1 does), and `sum = d * sum(qs)`, which the
//! weight formats with an offset or a minimum need. A block of zeros has `d = 0`.

/// Values per activation block.
pub const Q8_BLOCK: usize = 32;

/// `num_rows` rows of quantized activations, row-major: `qs` is `[num_rows, row_len]`,
/// `scales` and `sums` are `[num_rows, row_len / 32]`.
#[derive(Debug, Clone, Default)]
pub struct Q8Rows {
    num_rows: usize,
    row_len: usize,
    qs: Vec<i8>,
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
        if row_len == 0 || !row_len.is_multiple_of(Q8_BLOCK) {
            return Err(Q8Error::RowLength { row_len });
        }
        if !x.len().is_multiple_of(row_len) {
            return Err(Q8Error::Shape {
                len: x.len(),
                row_len,
            });
        }
        let num_blocks = x.len() / Q8_BLOCK;
        self.num_rows = x.len() / row_len;
        self.row_len = row_len;
        self.qs.resize(x.len(), 0);
        self.scales.resize(num_blocks, 0.0);
        self.sums.resize(num_blocks, 0.0);
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
        self.scales.resize(num_rows * row_len / Q8_BLOCK, 0.0);
        self.sums.resize(num_rows * row_len / Q8_BLOCK, 0.0);
        Ok(())
    }

    /// The buffers `(qs, scales, sums)`, for filling after [`Q8Rows::reset`].
    pub fn parts_mut(&mut self) -> (&mut [i8], &mut [f32], &mut [f32]) {
        (&mut self.qs, &mut self.scales, &mut self.sums)
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
    /// Every row's quantized values, row after row.
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
    /// Row `row` decoded back to f32 (`qs * d`), into `out` (`row_len` values).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        for ((out, qs), &d) in out
            .chunks_exact_mut(Q8_BLOCK)
            .zip(self.row_qs(row).chunks_exact(Q8_BLOCK))
            .zip(self.row_scales(row))
        {
            for (value, &q) in out.iter_mut().zip(qs) {
                *value = q as f32 * d;
            }
        }
    }
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
