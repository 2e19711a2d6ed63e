//! Weights repacked at load for integer dot products with [`Q8Rows`] activations.
//!
//! Every stored format that has one scale per 32 values is rewritten as blocks of 32
//! unsigned integers `u` with an f32 scale `d` and an f32 `min`, such that the weight value
//! is `d * (u - zero) + min` with a per-format constant `zero`, bit-exactly the value ggml's
//! `dequantize_row_*` gives:
//!
//! | stored | width | `u` | `zero` | `min` |
//! | --- | --- | --- | --- | --- |
//! | Q4_0 | nibble | `q` (0..16) | 8 | 0 |
//! | Q4_1 | nibble | `q` | 0 | `m` |
//! | Q8_0 | byte | `q + 128` | 128 | 0 |
//! | Q4_K | nibble | `q` of one sub-block | 0 | `-(dmin * min)`, `d = d * scale` |
//! | Q5_K | byte | 5-bit `q` of one sub-block | 0 | as Q4_K |
//!
//! So the dot product with activations `a = d_a * qa` (block sums `s_a = d_a * sum(qa)`) is
//! `sum_b d_w d_a ((u - zero) . qa) + min_w s_a`: an unsigned-by-signed integer dot per
//! block (what `vpdpbusd` computes) minus the exact integer `zero * sum(qa)`. Nibble blocks keep 16 bytes (`u[j] | u[j + 16] << 4`, the
//! Q4_0 order), byte blocks 32. Scales and mins live in their own arrays; formats whose
//! min is always 0 (Q4_0, Q8_0) keep no mins array. Q6_K (one scale
//! per 16 values) has no repacked form: [`repack`] returns `None` for it.

use super::blocks::{
    f16_at, scale_min_k4, Q4_0_BYTES, Q4_1_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q8_0_BYTES, QK, QK_K,
};
use super::q8::Q8Rows;
use crate::GgmlType;

/// How many bits each repacked value takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantWidth {
    /// 4-bit values, 16 bytes per block.
    Nibble,
    /// 8-bit values, 32 bytes per block.
    Byte,
}

impl QuantWidth {
    /// Bytes of `u` per 32-value block.
    pub fn bytes_per_block(self) -> usize {
        match self {
            QuantWidth::Nibble => QK / 2,
            QuantWidth::Byte => QK,
        }
    }
}

/// A matrix `[num_rows, blocks_per_row * 32]` in the repacked layout (see the module docs).
#[derive(Debug, Clone)]
pub struct RepackedRows {
    width: QuantWidth,
    zero: i32,
    num_rows: usize,
    blocks_per_row: usize,
    qs: Vec<u8>,
    scales: Vec<f32>,
    mins: Vec<f32>,
}

/// Repacks `num_rows` stored rows of `row_len` values of type `ty` (`bytes` holds exactly
/// `num_rows * ty.bytes_for(row_len)` bytes). Returns `None` when `ty` has no repacked form
/// (F32, F16, BF16, Q6_K, anything not dequantizable) or the byte count does not match.
pub fn repack(ty: GgmlType, num_rows: usize, row_len: usize, bytes: &[u8]) -> Option<RepackedRows> {
    let (width, zero) = match ty {
        GgmlType::Q4_0 => (QuantWidth::Nibble, 8),
        GgmlType::Q4_1 | GgmlType::Q4K => (QuantWidth::Nibble, 0),
        GgmlType::Q8_0 => (QuantWidth::Byte, 128),
        GgmlType::Q5K => (QuantWidth::Byte, 0),
        _ => return None,
    };
    let row_bytes = ty.bytes_for(row_len)?;
    if row_bytes.checked_mul(num_rows)? != bytes.len() || !row_len.is_multiple_of(QK) {
        return None;
    }
    let blocks = num_rows * (row_len / QK);
    let mut out = RepackedRows {
        width,
        zero,
        num_rows,
        blocks_per_row: row_len / QK,
        qs: Vec::with_capacity(blocks * width.bytes_per_block()),
        scales: Vec::with_capacity(blocks),
        mins: Vec::with_capacity(blocks),
    };
    let has_mins = zero == 0;
    let mut push = |u: &[u8; QK], d: f32, min: f32| {
        match width {
            QuantWidth::Nibble => out
                .qs
                .extend((0..QK / 2).map(|j| u[j] | (u[j + QK / 2] << 4))),
            QuantWidth::Byte => out.qs.extend_from_slice(u),
        }
        out.scales.push(d);
        if has_mins {
            out.mins.push(min);
        }
    };
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let size = if ty == GgmlType::Q4_0 {
                Q4_0_BYTES
            } else {
                Q4_1_BYTES
            };
            for block in bytes.chunks_exact(size) {
                let d = f16_at(block, 0);
                let (min, qs) = if ty == GgmlType::Q4_0 {
                    (0.0, &block[2..])
                } else {
                    (f16_at(block, 2), &block[4..])
                };
                let u: [u8; QK] = std::array::from_fn(|i| {
                    let q = qs[i % (QK / 2)];
                    if i < QK / 2 {
                        q & 0x0F
                    } else {
                        q >> 4
                    }
                });
                push(&u, d, min);
            }
        }
        GgmlType::Q8_0 => {
            for block in bytes.chunks_exact(Q8_0_BYTES) {
                let d = f16_at(block, 0);
                let u: [u8; QK] = std::array::from_fn(|i| block[2 + i] ^ 0x80);
                push(&u, d, 0.0);
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let (size, qs_at) = if ty == GgmlType::Q4K {
                (Q4_K_BYTES, 16)
            } else {
                (Q5_K_BYTES, 48)
            };
            for block in bytes.chunks_exact(size) {
                let d = f16_at(block, 0);
                let dmin = f16_at(block, 2);
                let scales: &[u8; 12] = block[4..16].try_into().unwrap();
                for sub in 0..QK_K / QK {
                    let chunk = &block[qs_at + 32 * (sub / 2)..qs_at + 32 * (sub / 2) + 32];
                    let u: [u8; QK] = std::array::from_fn(|l| {
                        let low4 = if sub % 2 == 0 {
                            chunk[l] & 0x0F
                        } else {
                            chunk[l] >> 4
                        };
                        if ty == GgmlType::Q5K {
                            low4 | (((block[16 + l] >> sub) & 1) << 4)
                        } else {
                            low4
                        }
                    });
                    let (scale, min) = scale_min_k4(sub, scales);
                    push(&u, d * scale as f32, -(dmin * min as f32));
                }
            }
        }
        _ => unreachable!("checked above"),
    }
    Some(out)
}

impl RepackedRows {
    /// Value width of the blocks.
    pub fn width(&self) -> QuantWidth {
        self.width
    }
    /// The format's offset `zero` (see the module docs).
    pub fn zero(&self) -> i32 {
        self.zero
    }
    /// Rows held.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }
    /// 32-value blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.blocks_per_row
    }
    /// Bytes held (values, scales and mins).
    pub fn size_bytes(&self) -> usize {
        self.qs.len() + 4 * (self.scales.len() + self.mins.len())
    }
    /// The packed values of row `row` (`blocks_per_row * width.bytes_per_block()` bytes).
    pub fn row_qs(&self, row: usize) -> &[u8] {
        let n = self.blocks_per_row * self.width.bytes_per_block();
        &self.qs[row * n..(row + 1) * n]
    }
    /// The per-block scales `d` of row `row`.
    pub fn row_scales(&self, row: usize) -> &[f32] {
        &self.scales[row * self.blocks_per_row..(row + 1) * self.blocks_per_row]
    }
    /// Whether the format has per-block mins (Q4_1, Q4_K, Q5_K); without them every min is 0.
    pub fn has_mins(&self) -> bool {
        !self.mins.is_empty()
    }

    /// The per-block mins of row `row`; empty when [`RepackedRows::has_mins`] is false.
    pub fn row_mins(&self, row: usize) -> &[f32] {
        if self.mins.is_empty() {
            return &[];
        }
        &self.mins[row * self.blocks_per_row..(row + 1) * self.blocks_per_row]
    }

    /// The unsigned values `u` of block `block` of row `row`.
    pub fn block_values(&self, row: usize, block: usize) -> [u8; QK] {
        let bytes = self.width.bytes_per_block();
        let qs = &self.row_qs(row)[block * bytes..(block + 1) * bytes];
        match self.width {
            QuantWidth::Byte => qs.try_into().unwrap(),
            QuantWidth::Nibble => std::array::from_fn(|i| {
                if i < QK / 2 {
                    qs[i] & 0x0F
                } else {
                    qs[i - QK / 2] >> 4
                }
            }),
        }
    }

    /// Decodes row `row` into `out` (`blocks_per_row * 32` values), bit-exactly as ggml's
    /// dequantizer of the stored format does.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let (scales, mins) = (self.row_scales(row), self.row_mins(row));
        for (block, values) in out.chunks_exact_mut(QK).enumerate() {
            let u = self.block_values(row, block);
            let (d, min) = (scales[block], mins.get(block).copied().unwrap_or(0.0));
            for (value, &u) in values.iter_mut().zip(&u) {
                *value = (u as i32 - self.zero) as f32 * d + min;
            }
        }
    }

    /// The integer part of block `block`: `sum_i (u[i] - zero) * qa[i]` with the activation
    /// values `qa` of the same block (32 of them).
    pub fn block_integer_dot(&self, row: usize, block: usize, qa: &[i8]) -> i32 {
        self.block_values(row, block)
            .iter()
            .zip(&qa[..QK])
            .map(|(&u, &a)| (u as i32 - self.zero) * a as i32)
            .sum()
    }
}

/// The scalar reference kernel: `dot(weights[row], activations[token])` computed as
/// `sum_b d_w d_a ((u - zero) . qa) + min_w s_a` block by block. Panics if the row lengths differ
/// (shapes are validated when a layer is built).
pub fn dot_scalar(weights: &RepackedRows, row: usize, activations: &Q8Rows, token: usize) -> f32 {
    assert_eq!(
        weights.blocks_per_row,
        activations.blocks_per_row(),
        "weight and activation rows differ in length"
    );
    let qa = activations.row_qs(token);
    let (da, sa) = (activations.row_scales(token), activations.row_sums(token));
    let (dw, mw) = (weights.row_scales(row), weights.row_mins(row));
    let mut total = 0f32;
    for block in 0..weights.blocks_per_row {
        let integer = weights.block_integer_dot(row, block, &qa[block * QK..(block + 1) * QK]);
        let min = mw.get(block).copied().unwrap_or(0.0);
        total += dw[block] * da[block] * integer as f32 + min * sa[block];
    }
    total
}
