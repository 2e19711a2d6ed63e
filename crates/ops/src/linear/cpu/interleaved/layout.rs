//! The [`Interleaved`] records: building them from repacked rows, and reading them back
//! (see the parent module docs for the layout).

use pagoda_tensor::quant::blocks::f16_bits_to_f32;
use pagoda_tensor::quant::repack::{QuantWidth, RepackedRows, RowFactors, SUPER_BLOCKS};
use rayon::prelude::*;

use super::{planes, GROUP};
#[cfg(target_arch = "x86_64")]
use super::{F32_FACTORS, HALF_FACTORS, KQUANT_FACTORS, SUBMIN_FACTORS, SUB_FACTORS};

/// Weights in the row-interleaved layout (see the module docs).
#[derive(Debug, Clone)]
pub struct Interleaved {
    pub(super) nibble: bool,
    pub(super) half: bool,
    /// Whether the min slots hold sub-scales (see the module docs).
    pub(super) sub: bool,
    /// Whether the blocks also have sub-mins (Q2_K): the record keeps its mins and adds the
    /// sub-scales and sub-mins after them.
    pub(super) submin: bool,
    /// Whether the factors are the K-quants' stored ones (see the module docs).
    pub(super) kquant: bool,
    /// Bit planes after the nibble steps (0, or 1-2 for values of 5-6 bits, [`planes`]).
    pub(super) planes: usize,
    pub(super) zero: i32,
    pub(super) num_rows: usize,
    pub(super) blocks_per_row: usize,
    /// Bytes of one (group, block): weights, then 8 scales and 8 mins.
    pub(super) stride: usize,
    pub(super) data: Vec<u8>,
    /// K-quants: per (group, super-block) the rows' `d` then `dmin`, f16 bits
    /// ([`SUPER_BYTES`]); empty otherwise.
    pub(super) supers: Vec<u8>,
}

/// Bytes per (group, super-block) of [`Interleaved`]'s K-quant `d` and `dmin`.
pub const SUPER_BYTES: usize = 4 * GROUP;

impl Interleaved {
    /// The interleaved copy of `weights`.
    pub fn new(weights: &RepackedRows) -> Interleaved {
        Interleaved::with_high_bits(weights, planes::HighBits::selected())
    }

    /// The interleaved copy of `weights`, values of 5 or 6 bits laid out as `high_bits`
    /// says.
    pub fn with_high_bits(weights: &RepackedRows, high_bits: planes::HighBits) -> Interleaved {
        let bits = weights.value_bits() as usize;
        // Byte blocks of at most 4 bits (Q3_K) always become nibbles; of 5-6 bits, nibbles
        // and planes when `high_bits` says so.
        let (pack, planes) = match (weights.width(), bits) {
            (QuantWidth::Byte, ..=4) => (true, 0),
            (QuantWidth::Byte, 5..=6) if high_bits == planes::HighBits::Planes => (true, bits - 4),
            _ => (false, 0),
        };
        let nibble = weights.width() == QuantWidth::Nibble || pack;
        let half = weights.has_half_factors();
        let sub = weights.has_sub_scales();
        assert!(!sub || half, "sub-scales come with half factors");
        let submin = weights.has_sub_mins();
        let kquant = weights.row_super_factors(0).is_some();
        let block_bytes = weights.width().bytes_per_block();
        // Bytes of weights per record: 8 rows' values, then the planes' 8 masks each.
        let weight_bytes = if pack {
            GROUP * 16 + planes * 32
        } else {
            GROUP * block_bytes
        };
        let factor_bytes = if kquant {
            1
        } else if half {
            2
        } else {
            4
        };
        // Sub-mins: the scales and mins, then 8 + 8 sub-scales and 8 + 8 sub-mins.
        let stride = weight_bytes + 2 * GROUP * factor_bytes + if submin { 4 * GROUP } else { 0 };
        let (num_rows, blocks) = (weights.num_rows(), weights.blocks_per_row());
        let groups = num_rows.div_ceil(GROUP);
        let mut data = vec![0u8; groups * blocks * stride];
        let supers_per_row = if kquant { blocks / SUPER_BLOCKS } else { 0 };
        let mut supers = vec![0u8; groups * supers_per_row * SUPER_BYTES];
        if kquant {
            // Per (group, super-block): 8 `d`, then 8 `dmin`.
            supers
                .par_chunks_mut(supers_per_row * SUPER_BYTES)
                .enumerate()
                .for_each(|(group, out)| {
                    for lane in 0..GROUP.min(num_rows - group * GROUP) {
                        let f = weights.row_super_factors(group * GROUP + lane).unwrap();
                        for (s, out) in out.chunks_exact_mut(SUPER_BYTES).enumerate() {
                            out[2 * lane..2 * lane + 2].copy_from_slice(&f.d[s].to_le_bytes());
                            let at = 2 * GROUP + 2 * lane;
                            out[at..at + 2].copy_from_slice(&f.dmin[s].to_le_bytes());
                        }
                    }
                });
        }
        // One group per task: a large model interleaves its rows on every thread at load.
        data.par_chunks_mut(blocks * stride)
            .enumerate()
            .for_each(|(group, records)| {
                for lane in 0..GROUP.min(num_rows - group * GROUP) {
                    let row = group * GROUP + lane;
                    let qs = weights.row_qs(row);
                    let factors = weights.row_factors(row);
                    let subs = weights.sub_scales(row);
                    let sub_mins = weights.sub_mins(row);
                    let stored = weights.row_super_factors(row);
                    for (block, record) in records.chunks_exact_mut(stride).enumerate() {
                        if pack {
                            // The low nibbles as the Q4 layout holds them; planes below.
                            let u = weights.block_values(row, block);
                            for step in 0..4 {
                                for j in 0..4 {
                                    let (low, high) = (u[4 * step + j], u[16 + 4 * step + j]);
                                    record[step * 32 + lane * 4 + j] = (low & 0x0F) | (high << 4);
                                }
                            }
                        } else {
                            let bytes = &qs[block * block_bytes..(block + 1) * block_bytes];
                            for (step, chunk) in bytes.chunks_exact(4).enumerate() {
                                let at = step * 32 + lane * 4;
                                record[at..at + 4].copy_from_slice(chunk);
                            }
                        }
                        if let Some(f) = &stored {
                            let at = weight_bytes + lane;
                            record[at] = f.scales[block];
                            record[at + GROUP] = f.mins[block];
                            continue;
                        }
                        let (scale, min) = raw_factors(&factors, block);
                        let scale_at = weight_bytes + lane * factor_bytes;
                        let min_at = scale_at + GROUP * factor_bytes;
                        record[scale_at..scale_at + factor_bytes]
                            .copy_from_slice(&scale[..factor_bytes]);
                        if submin {
                            record[min_at..min_at + factor_bytes]
                                .copy_from_slice(&min[..factor_bytes]);
                            let at = weight_bytes + 2 * GROUP * factor_bytes + lane;
                            let ([s0, s1], [m0, m1]) = (subs[block], sub_mins[block]);
                            record[at] = s0 as u8;
                            record[at + GROUP] = s1 as u8;
                            record[at + 2 * GROUP] = m0;
                            record[at + 3 * GROUP] = m1;
                        } else if sub {
                            let [s0, s1] = subs[block];
                            let at = weight_bytes + GROUP * factor_bytes + lane;
                            record[at] = s0 as u8;
                            record[at + GROUP] = s1 as u8;
                        } else {
                            record[min_at..min_at + factor_bytes]
                                .copy_from_slice(&min[..factor_bytes]);
                        }
                    }
                }
                if planes > 0 {
                    let lanes = GROUP.min(num_rows - group * GROUP);
                    for (block, record) in records.chunks_exact_mut(stride).enumerate() {
                        let mut values = [[0u8; 32]; GROUP];
                        for (lane, values) in values.iter_mut().enumerate().take(lanes) {
                            *values = weights.block_values(group * GROUP + lane, block);
                        }
                        let masks = planes::masks(&values, planes);
                        for (p, masks) in masks.iter().enumerate().take(planes) {
                            for (r, mask) in masks.iter().enumerate() {
                                let at = GROUP * 16 + p * 32 + 4 * r;
                                record[at..at + 4].copy_from_slice(&mask.to_le_bytes());
                            }
                        }
                    }
                }
            });
        Interleaved {
            nibble,
            half,
            sub,
            submin,
            kquant,
            planes,
            zero: weights.zero(),
            num_rows,
            blocks_per_row: blocks,
            stride,
            data,
            supers,
        }
    }

    /// Rows (without the padding of the last group).
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.data.len() + self.supers.len()
    }

    /// Blocks (of 32 values) per row.
    pub fn blocks_per_row(&self) -> usize {
        self.blocks_per_row
    }

    /// The format's zero: a stored value `u` stands for `u - zero`.
    pub fn zero(&self) -> i32 {
        self.zero
    }

    /// Whether the stored values are nibbles (two per byte) rather than bytes; with
    /// [`Interleaved::planes`], their higher bits are in planes.
    pub fn is_nibble(&self) -> bool {
        self.nibble
    }

    /// Bit planes after the nibbles (0, or 1-2 for values of 5-6 bits; see [`planes`]).
    pub fn planes(&self) -> usize {
        self.planes
    }

    /// Bytes of weights (values and planes) at the start of each record.
    #[inline]
    fn weight_bytes(&self) -> usize {
        if self.nibble {
            GROUP * 16 + self.planes * 32
        } else {
            GROUP * 32
        }
    }

    /// Groups `group..group + count` alone in the byte layout (the planes folded into the
    /// bytes, the factors as they are): what prefills run on, so the planes are unpacked once
    /// per matmul rather than once per tile of tokens. Needs the interleaved kernel's CPU
    /// features.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn groups_as_bytes(&self, group: usize, count: usize) -> Interleaved {
        assert!(self.planes > 0 && group * GROUP < self.num_rows);
        let blocks = self.blocks_per_row;
        let factor_bytes = self.stride - self.weight_bytes();
        let stride = GROUP * 32 + factor_bytes;
        let mut data = vec![0u8; count * blocks * stride];
        for (index, out) in data.chunks_exact_mut(stride).enumerate() {
            let record = self.record(group + index / blocks, index % blocks);
            // SAFETY: `matmul` checked the features; `record` holds the nibbles and planes,
            // `out` 256 bytes and more.
            unsafe { super::x86::unpack_planes(self.planes, record, out) };
            out[GROUP * 32..].copy_from_slice(&record[self.weight_bytes()..]);
        }
        let per_group = blocks / SUPER_BLOCKS * SUPER_BYTES;
        let supers = if self.kquant {
            self.supers[group * per_group..(group + count) * per_group].to_vec()
        } else {
            Vec::new()
        };
        Interleaved {
            nibble: false,
            planes: 0,
            num_rows: (count * GROUP).min(self.num_rows - group * GROUP),
            stride,
            data,
            supers,
            ..*self
        }
    }

    /// The plane masks of block `block` of group `group`: `[plane][register]` (see
    /// [`planes`]; empty without planes).
    #[inline]
    pub fn block_planes(&self, group: usize, block: usize) -> [[u32; GROUP]; 2] {
        let mut out = [[0u32; GROUP]; 2];
        let record = self.record(group, block);
        for (p, masks) in out.iter_mut().enumerate().take(self.planes) {
            for (r, mask) in masks.iter_mut().enumerate() {
                let at = GROUP * 16 + p * 32 + 4 * r;
                *mask = u32::from_le_bytes(record[at..at + 4].try_into().unwrap());
            }
        }
        out
    }

    /// The record's factor layout (`F32_FACTORS`, ...).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn factor_layout(&self) -> u8 {
        match (self.kquant, self.sub, self.half) {
            _ if self.submin => SUBMIN_FACTORS,
            (true, _, _) => KQUANT_FACTORS,
            (_, true, _) => SUB_FACTORS,
            (_, _, true) => HALF_FACTORS,
            _ => F32_FACTORS,
        }
    }

    /// Whether the blocks have sub-scales (Q6_K, Q3_K; [`Interleaved::block_sub_scales`]).
    pub fn has_sub_scales(&self) -> bool {
        self.sub
    }

    /// The sub-scales of block `block` of group `group`'s 8 rows: `[half][lane]` (zeros
    /// without sub-scales).
    #[inline]
    pub fn block_sub_scales(&self, group: usize, block: usize) -> [[i8; GROUP]; 2] {
        if !self.sub {
            return [[0; GROUP]; 2];
        }
        let record = self.record(group, block);
        let at = self.weight_bytes() + if self.submin { 4 * GROUP } else { 2 * GROUP };
        std::array::from_fn(|h| std::array::from_fn(|lane| record[at + h * GROUP + lane] as i8))
    }

    /// The sub-mins of block `block` of group `group`'s 8 rows: `[half][lane]` (zeros
    /// without sub-mins).
    #[inline]
    pub fn block_sub_mins(&self, group: usize, block: usize) -> [[u8; GROUP]; 2] {
        if !self.submin {
            return [[0; GROUP]; 2];
        }
        let record = self.record(group, block);
        let at = self.weight_bytes() + 6 * GROUP;
        std::array::from_fn(|h| std::array::from_fn(|lane| record[at + h * GROUP + lane]))
    }

    /// The weight bytes of block `block` of group `group` as stored (see the module docs):
    /// `4 k .. 4 k + 4` of step `k` for each of the 8 rows in turn, 4 steps of 32 bytes for
    /// nibbles (low nibbles values `4 k + j`, high nibbles `16 + 4 k + j`), 8 for bytes.
    /// With planes, the nibbles only ([`Interleaved::block_planes`] holds the higher bits).
    #[inline]
    pub fn block_weights(&self, group: usize, block: usize) -> &[u8] {
        let values = if self.nibble { GROUP * 16 } else { GROUP * 32 };
        &self.record(group, block)[..values]
    }

    /// The scales and mins of block `block` of group `group`'s 8 rows as f32 (a missing min
    /// is 0).
    #[inline]
    pub fn block_factors(
        &self,
        group: usize,
        block: usize,
        scales: &mut [f32; GROUP],
        mins: &mut [f32; GROUP],
    ) {
        let record = self.record(group, block);
        let factors = &record[self.weight_bytes()..];
        // Plain loops, no closure: this runs per block of every AMX chunk.
        if self.kquant {
            let supers = self.super_record(group, block / SUPER_BLOCKS);
            for lane in 0..GROUP {
                let d =
                    f16_bits_to_f32(u16::from_le_bytes([supers[2 * lane], supers[2 * lane + 1]]));
                let at = 2 * GROUP + 2 * lane;
                let dmin = f16_bits_to_f32(u16::from_le_bytes([supers[at], supers[at + 1]]));
                scales[lane] = d * factors[lane] as f32;
                mins[lane] = -(dmin * factors[GROUP + lane] as f32);
            }
        } else if self.half {
            let bits: &[[u8; 2]] = bytemuck::cast_slice(&factors[..4 * GROUP]);
            for lane in 0..GROUP {
                scales[lane] = f16_bits_to_f32(u16::from_le_bytes(bits[lane]));
                // The min slots of sub-scaled formats hold the sub-scales: no mins.
                mins[lane] = if self.sub && !self.submin {
                    0.0
                } else {
                    f16_bits_to_f32(u16::from_le_bytes(bits[GROUP + lane]))
                };
            }
        } else {
            let words: &[[u8; 4]] = bytemuck::cast_slice(&factors[..8 * GROUP]);
            for lane in 0..GROUP {
                scales[lane] = f32::from_le_bytes(words[lane]);
                mins[lane] = f32::from_le_bytes(words[GROUP + lane]);
            }
        }
    }

    /// Block `block` of group `group`'s factor layout (`F32_FACTORS`, `HALF_FACTORS`, ...),
    /// its factor bytes, and for K-quants its super-block's `d` and `dmin` ([`SUPER_BYTES`];
    /// empty otherwise): what [`Interleaved::block_factors`] decodes, for vector decoders.
    #[inline]
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn block_factor_bytes(&self, group: usize, block: usize) -> (u8, &[u8], &[u8]) {
        let factors = &self.record(group, block)[self.weight_bytes()..];
        let supers = if self.kquant {
            self.super_record(group, block / SUPER_BLOCKS)
        } else {
            &[]
        };
        (self.factor_layout(), factors, supers)
    }

    /// K-quants: group `group`'s `d` and `dmin` of super-block `index` ([`SUPER_BYTES`]).
    #[inline]
    fn super_record(&self, group: usize, index: usize) -> &[u8] {
        let per_group = self.blocks_per_row / SUPER_BLOCKS * SUPER_BYTES;
        &self.supers[group * per_group + index * SUPER_BYTES..][..SUPER_BYTES]
    }

    #[inline]
    fn record(&self, group: usize, block: usize) -> &[u8] {
        assert!(
            group * GROUP < self.num_rows && block < self.blocks_per_row,
            "group or block out of range"
        );
        &self.data[(group * self.blocks_per_row + block) * self.stride..][..self.stride]
    }

    /// Unpacks block `block` of the eight rows of group `group`: `values[32 lane + j]` is
    /// row `lane`'s stored value `j` (`u`, in value order), `scales[lane]` and `mins[lane]`
    /// its factors as f32 (a missing min is 0). The last group's padding rows come out as
    /// zeros.
    pub fn unpack_block(
        &self,
        group: usize,
        block: usize,
        values: &mut [u8; GROUP * 32],
        scales: &mut [f32; GROUP],
        mins: &mut [f32; GROUP],
    ) {
        let weights = self.block_weights(group, block);
        let masks = self.block_planes(group, block);
        // The high bits of register `r`'s byte `i`, from the planes.
        let high = |r: usize, i: usize| -> u8 {
            (0..self.planes)
                .map(|p| (((masks[p][r] >> i) & 1) as u8) << (4 + p))
                .sum()
        };
        for lane in 0..GROUP {
            let u = &mut values[32 * lane..32 * lane + 32];
            for step in 0..weights.len() / 32 {
                for j in 0..4 {
                    let (i, byte) = (lane * 4 + j, weights[step * 32 + lane * 4 + j]);
                    if self.nibble {
                        u[4 * step + j] = (byte & 0x0F) | high(step, i);
                        u[16 + 4 * step + j] = (byte >> 4) | high(step + 4, i);
                    } else {
                        u[4 * step + j] = byte;
                    }
                }
            }
        }
        self.block_factors(group, block, scales, mins);
    }

    /// Decodes row `row` into `out` (`blocks_per_row * 32` values), bit-exactly as
    /// [`RepackedRows::dequantize_row`] does: `(u - zero) * d + min` per value, or
    /// `(d * s) * (u - zero)` with sub-scales.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.num_rows, "row out of range");
        let (group, lane) = (row / GROUP, row % GROUP);
        let mut values = [0u8; GROUP * 32];
        let (mut scales, mut mins) = ([0f32; GROUP], [0f32; GROUP]);
        for (block, out) in out.chunks_exact_mut(32).enumerate() {
            self.unpack_block(group, block, &mut values, &mut scales, &mut mins);
            let (d, min) = (scales[lane], mins[lane]);
            let u = &values[32 * lane..32 * lane + 32];
            if self.submin {
                // `(d * sc) * q - dmin * m`, with `min = -dmin` (zero 0).
                let (subs, sub_mins) = (
                    self.block_sub_scales(group, block),
                    self.block_sub_mins(group, block),
                );
                for (i, (value, &u)) in out.iter_mut().zip(u).enumerate() {
                    let h = i / 16;
                    *value = (d * subs[h][lane] as f32) * u as f32 + min * sub_mins[h][lane] as f32;
                }
                continue;
            }
            if self.sub {
                let subs = self.block_sub_scales(group, block);
                for (i, (value, &u)) in out.iter_mut().zip(u).enumerate() {
                    *value = (d * subs[i / 16][lane] as f32) * (u as i32 - self.zero) as f32;
                }
                continue;
            }
            for (value, &u) in out.iter_mut().zip(u) {
                *value = (u as i32 - self.zero) as f32 * d + min;
            }
        }
    }
}

/// Block `block`'s scale and min as stored (little-endian f16 bits or f32; a missing min is
/// zero).
fn raw_factors(factors: &RowFactors<'_>, block: usize) -> ([u8; 4], [u8; 4]) {
    let widen = |bytes: &[u8]| {
        let mut out = [0u8; 4];
        out[..bytes.len()].copy_from_slice(bytes);
        out
    };
    match factors {
        RowFactors::Half { scales, mins } => (
            widen(&scales[block].to_le_bytes()),
            widen(&mins.get(block).copied().unwrap_or(0).to_le_bytes()),
        ),
        RowFactors::Single { scales, mins } => (
            scales[block].to_le_bytes(),
            mins.get(block).copied().unwrap_or(0.0).to_le_bytes(),
        ),
    }
}
