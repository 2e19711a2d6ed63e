//! Linear layers: `y = W x` for a batch of activation rows, with `W` stored in any supported
//! GGML format.
//!
//! Contract: `x` is `[num_tokens, in_features]` row-major f32, `W` is `[out_features,
//! in_features]` (one stored row per output feature), `y` is `[num_tokens, out_features]`
//! and is overwritten. Work is split over output rows with rayon; each worker decodes a
//! weight row at most once per call, so prefill (many tokens) amortises the decode.

use pagoda_tensor::{quant, GgmlType, UnsupportedType};
use rayon::prelude::*;

use crate::simd::{dot_2x4, dot_f32};

/// A weight matrix `[out_features, in_features]` in its storage format.
#[derive(Debug, Clone)]
pub struct Weight {
    ty: GgmlType,
    out_features: usize,
    in_features: usize,
    storage: Storage,
    row_bytes: usize,
}

/// The rows as stored: f32 values are kept typed (aligned, no reinterpretation); every other
/// format keeps its raw blocks, `out_features * row_bytes` bytes.
#[derive(Debug, Clone)]
enum Storage {
    F32(Vec<f32>),
    Blocks(Vec<u8>),
}

/// Why a weight could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error(transparent)]
    Unsupported(#[from] UnsupportedType),
    #[error("weight of type {ty} has {got} bytes, expected {expected} for [{rows}, {cols}]")]
    Size {
        ty: GgmlType,
        rows: usize,
        cols: usize,
        got: usize,
        expected: usize,
    },
}

impl Weight {
    /// Wraps stored rows. Fails when the type cannot be decoded or the byte count is wrong.
    pub fn new(
        ty: GgmlType,
        out_features: usize,
        in_features: usize,
        data: Vec<u8>,
    ) -> Result<Weight, WeightError> {
        if !ty.is_dequantizable() {
            return Err(UnsupportedType { ty }.into());
        }
        let size_error = || WeightError::Size {
            ty,
            rows: out_features,
            cols: in_features,
            got: data.len(),
            expected: ty
                .bytes_for(in_features)
                .unwrap_or(0)
                .saturating_mul(out_features),
        };
        let row_bytes = ty.bytes_for(in_features).ok_or_else(size_error)?;
        if row_bytes.checked_mul(out_features) != Some(data.len()) {
            return Err(size_error());
        }
        let storage = if ty == GgmlType::F32 {
            Storage::F32(
                data.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            )
        } else {
            Storage::Blocks(data)
        };
        Ok(Weight {
            ty,
            out_features,
            in_features,
            storage,
            row_bytes,
        })
    }

    /// An f32 weight from values laid out `[out_features, in_features]`.
    pub fn from_f32(out_features: usize, in_features: usize, values: &[f32]) -> Weight {
        assert_eq!(
            values.len(),
            out_features * in_features,
            "weight shape mismatch"
        );
        Weight {
            ty: GgmlType::F32,
            out_features,
            in_features,
            storage: Storage::F32(values.to_vec()),
            row_bytes: in_features * 4,
        }
    }

    /// The same matrix dequantized to f32 (the exact mode's storage).
    pub fn to_f32(&self) -> Weight {
        if self.ty == GgmlType::F32 {
            return self.clone();
        }
        let mut values = vec![0f32; self.out_features * self.in_features];
        values
            .par_chunks_mut(self.in_features)
            .enumerate()
            .for_each(|(row, out)| self.dequantize_row(row, out));
        Weight::from_f32(self.out_features, self.in_features, &values)
    }

    /// Storage type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Rows of the matrix.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
    /// Columns of the matrix.
    pub fn in_features(&self) -> usize {
        self.in_features
    }
    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.row_bytes * self.out_features
    }

    /// Decodes one row into `out` (`in_features` values).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        match &self.storage {
            Storage::F32(values) => {
                out.copy_from_slice(&values[row * self.in_features..(row + 1) * self.in_features])
            }
            Storage::Blocks(bytes) => {
                let bytes = &bytes[row * self.row_bytes..(row + 1) * self.row_bytes];
                quant::dequantize(self.ty, bytes, out).expect("type checked at construction")
            }
        }
    }

    /// The dot product of row `row` with `x` (`in_features` values), without decoding the row
    /// into memory first.
    #[inline]
    pub fn dot_row(&self, row: usize, x: &[f32]) -> f32 {
        match &self.storage {
            Storage::F32(values) => dot_f32(
                &values[row * self.in_features..(row + 1) * self.in_features],
                x,
            ),
            Storage::Blocks(bytes) => {
                let bytes = &bytes[row * self.row_bytes..(row + 1) * self.row_bytes];
                crate::simd::quantized_dot(self.ty, bytes, x)
            }
        }
    }

    /// `y[t, :] = W x[t, :]` for every token `t`. See the module docs for the layout.
    pub fn matmul(&self, x: &[f32], num_tokens: usize, y: &mut [f32]) {
        let (n, k) = (self.out_features, self.in_features);
        assert_eq!(
            x.len(),
            num_tokens * k,
            "x must be [num_tokens, in_features]"
        );
        assert_eq!(
            y.len(),
            num_tokens * n,
            "y must be [num_tokens, out_features]"
        );
        if num_tokens == 0 {
            return;
        }
        if num_tokens == 1 {
            // Decode: one fused decode-and-dot pass per row, written in place.
            let rows_per_task = (n / (rayon::current_num_threads() * 16)).clamp(16, 1024);
            y.par_chunks_mut(rows_per_task)
                .enumerate()
                .for_each(|(task, out)| {
                    let row_start = task * rows_per_task;
                    for (i, value) in out.iter_mut().enumerate() {
                        *value = self.dot_row(row_start + i, x);
                    }
                });
            return;
        }
        // Prefill: each task decodes a block of rows once into a local buffer and multiplies it
        // with every token, two rows by four tokens at a time (see `dot_2x4`). The block is
        // small enough to stay in L2 while the activations stream past it.
        let rows_per_task = (n / (rayon::current_num_threads() * 8)).clamp(2, 16) & !1;
        let blocks: Vec<(usize, Vec<f32>)> = (0..n)
            .step_by(rows_per_task)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|row_start| {
                let row_end = (row_start + rows_per_task).min(n);
                let rows = row_end - row_start;
                let mut decoded = vec![0f32; rows * k];
                for (r, out) in decoded.chunks_exact_mut(k).enumerate() {
                    self.dequantize_row(row_start + r, out);
                }
                let w = |r: usize| &decoded[r * k..(r + 1) * k];
                let xt = |t: usize| &x[t * k..(t + 1) * k];
                let mut local = vec![0f32; rows * num_tokens];
                let full_tokens = num_tokens / 4 * 4;
                for r in (0..rows).step_by(2) {
                    // An odd last row is paired with itself; its duplicate result is dropped.
                    let r1 = (r + 1).min(rows - 1);
                    for t in (0..full_tokens).step_by(4) {
                        let block =
                            dot_2x4([w(r), w(r1)], [xt(t), xt(t + 1), xt(t + 2), xt(t + 3)]);
                        local[r * num_tokens + t..r * num_tokens + t + 4]
                            .copy_from_slice(&block[0]);
                        if r1 != r {
                            local[r1 * num_tokens + t..r1 * num_tokens + t + 4]
                                .copy_from_slice(&block[1]);
                        }
                    }
                    for t in full_tokens..num_tokens {
                        local[r * num_tokens + t] = dot_f32(w(r), xt(t));
                        if r1 != r {
                            local[r1 * num_tokens + t] = dot_f32(w(r1), xt(t));
                        }
                    }
                }
                (row_start, local)
            })
            .collect();
        for (row_start, local) in blocks {
            let rows = local.len() / num_tokens;
            for r in 0..rows {
                for t in 0..num_tokens {
                    y[t * n + row_start + r] = local[r * num_tokens + t];
                }
            }
        }
    }
}
