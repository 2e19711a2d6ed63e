//! Weights repacked at load for integer dot products with [`Q8Rows`] activations.
//!
//! Every stored format that has one scale per 32 values is rewritten as blocks of 32
//! unsigned integers `u` with a scale `d` and a `min`, such that the weight value is
//! `d * (u - zero) + min` with a per-format constant `zero`, bit-exactly the value ggml's
//! `dequantize_row_*` gives:
//!
//! | stored | width | `u` | `zero` | `min` | factors |
//! | --- | --- | --- | --- | --- | --- |
//! | Q4_0 | nibble | `q` (0..16) | 8 | 0 | f16 |
//! | Q4_1 | nibble | `q` | 0 | `m` | f16 |
//! | Q5_0 | byte | 5-bit `q` | 16 | 0 | f16 |
//! | Q5_1 | byte | 5-bit `q` | 0 | `m` | f16 |
//! | Q8_0 | byte | `q + 128` | 128 | 0 | f16 |
//! | Q3_K | byte | 3-bit `q + 4` of one sub-block | 4 | 0 | f16 `d`, sub-scales |
//! | Q6_K | byte | 6-bit `q` of one sub-block | 32 | 0 | f16 `d`, sub-scales |
//! | Q2_K | byte | 2-bit `q` of one sub-block | 0 | `-dmin` (f16) | f16 `d`, sub-scales, sub-mins |
//! | Q4_K | nibble | `q` of one sub-block | 0 | `-(dmin * min)`, `d = d * scale` | f32 |
//! | Q5_K | byte | 5-bit `q` of one sub-block | 0 | as Q4_K | f32 |
//!
//! So the dot product with activations `a = d_a * qa` (block sums `s_a = d_a * sum(qa)`) is
//! `sum_b d_w d_a ((u - zero) . qa) + min_w s_a`: an unsigned-by-signed integer dot per
//! block (what `vpdpbusd` computes) minus the exact integer `zero * sum(qa)`. Nibble blocks
//! keep 16 bytes (`u[j] | u[j + 16] << 4`, the Q4_0 order), byte blocks 32. Scales and mins
//! live in their own arrays; formats whose min is always 0 (Q4_0, Q8_0) keep no mins array.
//! Where the stored factors are IEEE halves (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) they stay halves
//! ([`RowFactors::Half`]), so a repacked Q4_1 row is exactly as many bytes as the stored one
//! (decode streams the weights from memory: bytes are time); the K-quants' products
//! `d * scale` are not halves in general and are kept as f32 ([`RowFactors::Single`]).
//!
//! Q6_K and Q3_K have one signed scale per 16 values (8 bits; 6 bits minus 32) under the
//! super-block's f16 `d`: their blocks of 32 are bytes `u` (6 or 3 bits) with `zero` 32 or
//! 4, the scale `d` (f16 bits, no mins) and the two integer **sub-scales** `s0, s1` of the
//! block's halves ([`RepackedRows::sub_scales`]). The value is `(d * s) * (u - zero)`, as
//! ggml computes it, and the block's integer part
//! becomes `s0 (u - zero) . qa[0..16] + s1 (u - zero) . qa[16..32]`, still exact in i32
//! (also for Q15 rows: at most `2 * 16 * 32 * 128 * 16256 < 2^31`), so the float chain after
//! it is unchanged.
//!
//! Q2_K also has a 4-bit min per 16 values (`y = (d * sc) * q - dmin * m`): its blocks keep
//! `d` and `-dmin` (f16) with the sub-scales `sc` and the **sub-mins** `m`
//! ([`RepackedRows::sub_mins`]), and the block's float step takes a second exact integer,
//! `m0 sum(qa[..16]) + m1 sum(qa[16..])`: `total += d * d_a * integer + (-dmin) * d_a *
//! min_integer` ([`dot_scalar`]).

use super::blocks::{
    f16_at, f16_bits_to_f32, q3_k_scales, q3_k_values, q5_values, scale_min_k4, Q2_K_BYTES,
    Q3_K_BYTES, Q4_0_BYTES, Q4_1_BYTES, Q4_K_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q5_K_BYTES, Q6_K_BYTES,
    Q8_0_BYTES, QK, QK_K,
};
use crate::GgmlType;

mod scalar;
pub use scalar::dot_scalar;

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
    /// Bits each value `u` uses (4 for nibbles; 5, 6 or 8 for bytes).
    value_bits: u32,
    zero: i32,
    num_rows: usize,
    blocks_per_row: usize,
    qs: Vec<u8>,
    factors: Factors,
    /// Per block, the integer scales of its two 16-value halves (Q3_K, Q6_K, Q2_K), or empty.
    sub_scales: Vec<[i8; 2]>,
    /// Per block, the integer mins of its two halves (Q2_K), or empty.
    sub_mins: Vec<[u8; 2]>,
    /// The K-quants' factors as stored (Q4_K, Q5_K), or `None` (boxed: most formats have
    /// none, and the rows are a variant of the weight storage enum).
    super_factors: Option<Box<SuperFactors>>,
}

/// The factors of the K-quants (Q4_K, Q5_K) as stored, kept beside their f32 products for
/// layouts that rebuild the products in registers from fewer bytes: per super-block (8
/// blocks of a row) the f16 `d` and `dmin`, per block the 6-bit scale `sc` and min `m`.
/// `d * sc` and `-(dmin * m)` in f32 are exactly the block's [`RowFactors::Single`] scale and
/// min.
#[derive(Debug, Clone, Default)]
pub struct SuperFactors {
    /// `d` per super-block (f16 bits), `[num_rows, blocks_per_row / 8]`.
    pub d: Vec<u16>,
    /// `dmin` per super-block (f16 bits), shaped as `d`.
    pub dmin: Vec<u16>,
    /// `sc` per block, `[num_rows, blocks_per_row]`.
    pub scales: Vec<u8>,
    /// `m` per block, shaped as `scales`.
    pub mins: Vec<u8>,
}

/// Blocks per K-quant super-block.
pub const SUPER_BLOCKS: usize = QK_K / QK;

/// One row's [`SuperFactors`].
#[derive(Debug, Clone, Copy)]
pub struct RowSuperFactors<'a> {
    /// `d` per super-block (f16 bits).
    pub d: &'a [u16],
    /// `dmin` per super-block (f16 bits).
    pub dmin: &'a [u16],
    /// `sc` per block.
    pub scales: &'a [u8],
    /// `m` per block.
    pub mins: &'a [u8],
}

/// Per-block scales and mins of every row (`mins` empty for formats whose min is 0).
#[derive(Debug, Clone)]
enum Factors {
    Half { scales: Vec<u16>, mins: Vec<u16> },
    Single { scales: Vec<f32>, mins: Vec<f32> },
}

/// One row's per-block scales and mins, as stored: IEEE half bits or f32. `mins` is empty
/// when the format has no mins (every min is 0).
#[derive(Debug, Clone, Copy)]
pub enum RowFactors<'a> {
    /// Half-precision bits (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
    Half {
        /// `d` of each block.
        scales: &'a [u16],
        /// `min` of each block, or empty.
        mins: &'a [u16],
    },
    /// f32 values (Q4_K, Q5_K).
    Single {
        /// `d` of each block.
        scales: &'a [f32],
        /// `min` of each block, or empty.
        mins: &'a [f32],
    },
}

impl RowFactors<'_> {
    /// The scale `d` of block `block`, widened exactly to f32.
    #[inline]
    pub fn scale(&self, block: usize) -> f32 {
        match self {
            RowFactors::Half { scales, .. } => f16_bits_to_f32(scales[block]),
            RowFactors::Single { scales, .. } => scales[block],
        }
    }
    /// The min of block `block` (0 for formats without mins), widened exactly to f32.
    #[inline]
    pub fn min(&self, block: usize) -> f32 {
        match self {
            RowFactors::Half { mins, .. } => mins.get(block).map_or(0.0, |&m| f16_bits_to_f32(m)),
            RowFactors::Single { mins, .. } => mins.get(block).copied().unwrap_or(0.0),
        }
    }
    /// Whether the format has per-block mins.
    pub fn has_mins(&self) -> bool {
        match self {
            RowFactors::Half { mins, .. } => !mins.is_empty(),
            RowFactors::Single { mins, .. } => !mins.is_empty(),
        }
    }
}

/// Repacks `num_rows` stored rows of `row_len` values of type `ty` (`bytes` holds exactly
/// `num_rows * ty.bytes_for(row_len)` bytes). Returns `None` when `ty` has no repacked form
/// (F32, F16, BF16, anything not dequantizable) or the byte count does not match.
pub fn repack(ty: GgmlType, num_rows: usize, row_len: usize, bytes: &[u8]) -> Option<RepackedRows> {
    let (width, value_bits, zero) = match ty {
        GgmlType::Q4_0 => (QuantWidth::Nibble, 4, 8),
        GgmlType::Q4_1 | GgmlType::Q4K => (QuantWidth::Nibble, 4, 0),
        GgmlType::Q8_0 => (QuantWidth::Byte, 8, 128),
        GgmlType::Q5_0 => (QuantWidth::Byte, 5, 16),
        GgmlType::Q5_1 | GgmlType::Q5K => (QuantWidth::Byte, 5, 0),
        GgmlType::Q6K => (QuantWidth::Byte, 6, 32),
        GgmlType::Q3K => (QuantWidth::Byte, 3, 4),
        GgmlType::Q2K => (QuantWidth::Byte, 2, 0),
        _ => return None,
    };
    let row_bytes = ty.bytes_for(row_len)?;
    if row_bytes.checked_mul(num_rows)? != bytes.len() || !row_len.is_multiple_of(QK) {
        return None;
    }
    let blocks = num_rows * (row_len / QK);
    let mut out = RepackedRows {
        width,
        value_bits,
        zero,
        num_rows,
        blocks_per_row: row_len / QK,
        qs: Vec::with_capacity(blocks * width.bytes_per_block()),
        factors: match ty {
            GgmlType::Q4K | GgmlType::Q5K => Factors::Single {
                scales: Vec::with_capacity(blocks),
                mins: Vec::with_capacity(blocks),
            },
            _ => Factors::Half {
                scales: Vec::with_capacity(blocks),
                mins: Vec::with_capacity(if zero == 0 { blocks } else { 0 }),
            },
        },
        sub_scales: Vec::with_capacity(
            if matches!(ty, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q6K) {
                blocks
            } else {
                0
            },
        ),
        sub_mins: Vec::with_capacity(if ty == GgmlType::Q2K { blocks } else { 0 }),
        super_factors: None,
    };
    let mut supers = SuperFactors::default();
    let has_mins = zero == 0;
    let mut sub_scales = std::mem::take(&mut out.sub_scales);
    let mut sub_mins = std::mem::take(&mut out.sub_mins);
    let half_at =
        |block: &[u8], offset: usize| u16::from_le_bytes([block[offset], block[offset + 1]]);
    // One block: its values, then its factors (half bits or f32, whichever `factors` holds).
    let mut push = |u: &[u8; QK], d: Factor, min: Factor| {
        match width {
            QuantWidth::Nibble => out
                .qs
                .extend((0..QK / 2).map(|j| u[j] | (u[j + QK / 2] << 4))),
            QuantWidth::Byte => out.qs.extend_from_slice(u),
        }
        match (&mut out.factors, d, min) {
            (Factors::Half { scales, mins }, Factor::Half(d), Factor::Half(min)) => {
                scales.push(d);
                if has_mins {
                    mins.push(min);
                }
            }
            (Factors::Single { scales, mins }, Factor::Single(d), Factor::Single(min)) => {
                scales.push(d);
                if has_mins {
                    mins.push(min);
                }
            }
            _ => unreachable!("factor kind fixed per format"),
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
                let d = Factor::Half(half_at(block, 0));
                let (min, qs) = if ty == GgmlType::Q4_0 {
                    (Factor::Half(0), &block[2..])
                } else {
                    (Factor::Half(half_at(block, 2)), &block[4..])
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
        GgmlType::Q5_0 => {
            for block in bytes.chunks_exact(Q5_0_BYTES) {
                let u = q5_values(&block[2..6], &block[6..]);
                push(&u, Factor::Half(half_at(block, 0)), Factor::Half(0));
            }
        }
        GgmlType::Q5_1 => {
            for block in bytes.chunks_exact(Q5_1_BYTES) {
                let u = q5_values(&block[4..8], &block[8..]);
                let (d, m) = (half_at(block, 0), half_at(block, 2));
                push(&u, Factor::Half(d), Factor::Half(m));
            }
        }
        GgmlType::Q8_0 => {
            for block in bytes.chunks_exact(Q8_0_BYTES) {
                let u: [u8; QK] = std::array::from_fn(|i| block[2 + i] ^ 0x80);
                push(&u, Factor::Half(half_at(block, 0)), Factor::Half(0));
            }
        }
        GgmlType::Q6K => {
            for block in bytes.chunks_exact(Q6_K_BYTES) {
                let d = half_at(block, 208);
                let scales = &block[192..208];
                // Block `j` of the super-block: half `h = j / 4` of 128 values, quarter
                // `k = j % 4`; its values take 4 bits from `ql` and 2 from `qh`.
                for j in 0..QK_K / QK {
                    let (h, k) = (j / 4, j % 4);
                    let ql = &block[64 * h + 32 * (k % 2)..][..QK];
                    let qh = &block[128 + 32 * h..][..QK];
                    let u: [u8; QK] = std::array::from_fn(|l| {
                        ((ql[l] >> (4 * (k / 2))) & 0x0F) | (((qh[l] >> (2 * k)) & 3) << 4)
                    });
                    push(&u, Factor::Half(d), Factor::Half(0));
                    sub_scales.push([scales[2 * j] as i8, scales[2 * j + 1] as i8]);
                }
            }
        }
        GgmlType::Q2K => {
            for block in bytes.chunks_exact(Q2_K_BYTES) {
                // `-dmin`: the sign flip is exact, and `x + (-dmin * m)` is ggml's `x - ml`.
                let (d, min) = (half_at(block, 80), half_at(block, 82) ^ 0x8000);
                for b in 0..QK_K / QK {
                    let (n, j) = (b / 4, b % 4);
                    let q = &block[16 + 32 * n..16 + 32 * n + 32];
                    let u: [u8; QK] = std::array::from_fn(|l| (q[l] >> (2 * j)) & 3);
                    push(&u, Factor::Half(d), Factor::Half(min));
                    let (sc0, sc1) = (block[2 * b], block[2 * b + 1]);
                    sub_scales.push([(sc0 & 0x0F) as i8, (sc1 & 0x0F) as i8]);
                    sub_mins.push([sc0 >> 4, sc1 >> 4]);
                }
            }
        }
        GgmlType::Q3K => {
            for block in bytes.chunks_exact(Q3_K_BYTES) {
                let block: &[u8; Q3_K_BYTES] = block.try_into().unwrap();
                let d = half_at(block, 108);
                let scales = q3_k_scales(block[96..108].try_into().unwrap());
                for j in 0..QK_K / QK {
                    push(&q3_k_values(block, j), Factor::Half(d), Factor::Half(0));
                    sub_scales.push([scales[2 * j], scales[2 * j + 1]]);
                }
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
                supers.d.push(half_at(block, 0));
                supers.dmin.push(half_at(block, 2));
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
                    supers.scales.push(scale);
                    supers.mins.push(min);
                    push(
                        &u,
                        Factor::Single(d * scale as f32),
                        Factor::Single(-(dmin * min as f32)),
                    );
                }
            }
        }
        _ => unreachable!("checked above"),
    }
    out.sub_scales = sub_scales;
    out.sub_mins = sub_mins;
    if matches!(ty, GgmlType::Q4K | GgmlType::Q5K) {
        out.super_factors = Some(Box::new(supers));
    }
    Some(out)
}

/// One block's scale or min while repacking.
#[derive(Clone, Copy)]
enum Factor {
    Half(u16),
    Single(f32),
}

impl RepackedRows {
    /// Value width of the blocks.
    pub fn width(&self) -> QuantWidth {
        self.width
    }
    /// Bits each value `u` uses: 4 for nibble blocks; 3 (Q3_K), 5 (Q5_0, Q5_1, Q5_K), 6
    /// (Q6_K) or 8 (Q8_0) for byte blocks.
    pub fn value_bits(&self) -> u32 {
        self.value_bits
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
        let supers = self.super_factors.as_ref().map_or(0, |f| {
            2 * (f.d.len() + f.dmin.len()) + f.scales.len() + f.mins.len()
        });
        self.qs.len()
            + 2 * (self.sub_scales.len() + self.sub_mins.len())
            + supers
            + match &self.factors {
                Factors::Half { scales, mins } => 2 * (scales.len() + mins.len()),
                Factors::Single { scales, mins } => 4 * (scales.len() + mins.len()),
            }
    }
    /// The packed values of row `row` (`blocks_per_row * width.bytes_per_block()` bytes).
    #[inline]
    pub fn row_qs(&self, row: usize) -> &[u8] {
        let n = self.blocks_per_row * self.width.bytes_per_block();
        &self.qs[row * n..(row + 1) * n]
    }
    /// Whether the format has per-block mins (Q4_1, Q5_1, Q4_K, Q5_K); without them every min
    /// is 0.
    pub fn has_mins(&self) -> bool {
        match &self.factors {
            Factors::Half { mins, .. } => !mins.is_empty(),
            Factors::Single { mins, .. } => !mins.is_empty(),
        }
    }

    /// Whether the blocks have sub-scales (Q6_K, see the module docs).
    #[inline]
    pub fn has_sub_scales(&self) -> bool {
        !self.sub_scales.is_empty()
    }

    /// The sub-scales `[s0, s1]` of every block of row `row` (empty without sub-scales).
    #[inline]
    pub fn sub_scales(&self, row: usize) -> &[[i8; 2]] {
        if self.sub_scales.is_empty() {
            return &[];
        }
        let blocks = self.blocks_per_row;
        &self.sub_scales[row * blocks..(row + 1) * blocks]
    }

    /// Whether the blocks have sub-mins (Q2_K, see the module docs).
    #[inline]
    pub fn has_sub_mins(&self) -> bool {
        !self.sub_mins.is_empty()
    }

    /// The sub-mins `[m0, m1]` of every block of row `row` (empty without sub-mins).
    #[inline]
    pub fn sub_mins(&self, row: usize) -> &[[u8; 2]] {
        if self.sub_mins.is_empty() {
            return &[];
        }
        let blocks = self.blocks_per_row;
        &self.sub_mins[row * blocks..(row + 1) * blocks]
    }

    /// The stored K-quant factors of row `row`, `None` for other formats ([`SuperFactors`]).
    #[inline]
    pub fn row_super_factors(&self, row: usize) -> Option<RowSuperFactors<'_>> {
        let f = self.super_factors.as_ref()?;
        let (blocks, supers) = (self.blocks_per_row, self.blocks_per_row / SUPER_BLOCKS);
        Some(RowSuperFactors {
            d: &f.d[row * supers..(row + 1) * supers],
            dmin: &f.dmin[row * supers..(row + 1) * supers],
            scales: &f.scales[row * blocks..(row + 1) * blocks],
            mins: &f.mins[row * blocks..(row + 1) * blocks],
        })
    }

    /// Whether the factors are IEEE half bits ([`RowFactors::Half`]) rather than f32.
    #[inline]
    pub fn has_half_factors(&self) -> bool {
        matches!(self.factors, Factors::Half { .. })
    }

    /// The per-block scales and mins of row `row`.
    #[inline]
    pub fn row_factors(&self, row: usize) -> RowFactors<'_> {
        let blocks = self.blocks_per_row;
        let range = row * blocks..(row + 1) * blocks;
        match &self.factors {
            Factors::Half { scales, mins } => RowFactors::Half {
                scales: &scales[range.clone()],
                mins: if mins.is_empty() { &[] } else { &mins[range] },
            },
            Factors::Single { scales, mins } => RowFactors::Single {
                scales: &scales[range.clone()],
                mins: if mins.is_empty() { &[] } else { &mins[range] },
            },
        }
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
        let factors = self.row_factors(row);
        let subs = self.sub_scales(row);
        let sub_mins = self.sub_mins(row);
        for (block, values) in out.chunks_exact_mut(QK).enumerate() {
            let u = self.block_values(row, block);
            let (d, min) = (factors.scale(block), factors.min(block));
            if let (Some(sub), Some(m)) = (subs.get(block), sub_mins.get(block)) {
                // ggml's `(d * sc) * q - dmin * m`, with `min = -dmin`.
                for (i, (value, &u)) in values.iter_mut().zip(&u).enumerate() {
                    let h = i / (QK / 2);
                    *value = (d * sub[h] as f32) * u as f32 + min * m[h] as f32;
                }
                continue;
            }
            if let Some(sub) = subs.get(block) {
                // ggml's `(d * scale) * q`; no min.
                for (i, (value, &u)) in values.iter_mut().zip(&u).enumerate() {
                    *value = (d * sub[i / (QK / 2)] as f32) * (u as i32 - self.zero) as f32;
                }
                continue;
            }
            for (value, &u) in values.iter_mut().zip(&u) {
                *value = (u as i32 - self.zero) as f32 * d + min;
            }
        }
    }

    /// The min integer of block `block` (Q2_K): `m0 sum(qa[..16]) + m1 sum(qa[16..])`; 0
    /// without sub-mins.
    pub fn block_min_integer(&self, row: usize, block: usize, qa: &[i8]) -> i32 {
        let Some(&[m0, m1]) = self.sub_mins(row).get(block) else {
            return 0;
        };
        let sum = |h: usize| -> i32 {
            qa[h * QK / 2..(h + 1) * QK / 2]
                .iter()
                .map(|&q| q as i32)
                .sum()
        };
        m0 as i32 * sum(0) + m1 as i32 * sum(1)
    }

    /// The integer part of block `block`: `sum_i (u[i] - zero) * qa[i]` with the activation
    /// values `qa` of the same block (32 of them), each half times its sub-scale where the
    /// format has them.
    pub fn block_integer_dot(&self, row: usize, block: usize, qa: &[i8]) -> i32 {
        let u = self.block_values(row, block);
        let half = |h: usize| -> i32 {
            (h * QK / 2..(h + 1) * QK / 2)
                .map(|i| (u[i] as i32 - self.zero) * qa[i] as i32)
                .sum()
        };
        match self.sub_scales(row).get(block) {
            Some(&[s0, s1]) => (s0 as i32 * half(0)).wrapping_add(s1 as i32 * half(1)),
            None => half(0) + half(1),
        }
    }
}
