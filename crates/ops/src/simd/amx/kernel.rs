//! The AMX tiling loops: activation panels (tile B), weight tiles (tile A), one `TDPBUSD`
//! per 16 weight rows x 2 tokens x step, and the f32 combine in the VNNI kernels' order
//! (see the parent module docs for the layout).

use pagoda_tensor::quant::q8::Q8Rows;
use pagoda_tensor::quant::repack::{QuantWidth, RepackedRows, RowFactors};
use rayon::prelude::*;

use super::tiles::{TileConfig, TileUnit, MAX_COLSB, MAX_ROWS, TILE_A, TILE_B, TILE_C};
// VNNI's `horizontal_sum` order: `(v0 + v4) + (v2 + v6)` plus `(v1 + v5) + (v3 + v7)`.
use crate::simd::f32_tile::reduce_lanes as horizontal_sum;

/// Weight rows per A and C tile.
pub const TILE_ROWS: usize = MAX_ROWS;
/// Tokens per B and C tile.
pub const TOKENS_PER_TILE: usize = 2;
/// i32 lanes per (row, token) pair and step, as in the 256-bit VNNI kernels.
pub const LANES: usize = 8;
/// Values per Q8 / repacked block.
const BLOCK: usize = 32;
/// Bytes per `TDPBUSD` group.
const GROUP: usize = 4;
/// Bytes of one B panel row: 2 tokens x 8 lanes x 4 bytes.
const PANEL_ROW: usize = TOKENS_PER_TILE * LANES * GROUP;

/// How the VNNI kernel the result must match walks a row: one block per step
/// (`tile_vnni`, `decode_vnni_bytes`) or two (`tile_vnni_pairs`: nibble weights with an even
/// block count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Blocks per step: 1 or 2.
    pub blocks: usize,
}

impl StepShape {
    /// The shape the VNNI tiles use for `weights`.
    pub fn for_weights(weights: &RepackedRows) -> StepShape {
        let pairs =
            weights.width() == QuantWidth::Nibble && weights.blocks_per_row().is_multiple_of(2);
        StepShape {
            blocks: if pairs { 2 } else { 1 },
        }
    }

    /// Values (bytes of A per row) per step: 32 or 64.
    pub fn values(self) -> usize {
        self.blocks * BLOCK
    }

    /// 4-byte groups per step (rows of B): 8 or 16.
    pub fn groups(self) -> usize {
        self.values() / GROUP
    }

    /// The lane group `group` of a step feeds. One block: lane `g`. Two blocks: lane
    /// `g % 4` for the first block's groups and `4 + g % 4` for the second's (VNNI's low
    /// nibbles meet the activations' first half and high nibbles the second half, both
    /// into the same lane).
    pub fn lane_of_group(self, group: usize) -> usize {
        if self.blocks == 1 {
            group
        } else {
            4 * (group / 8) + group % 4
        }
    }

    /// The block (within the step) whose factors lane `lane` uses.
    pub fn block_of_lane(self, lane: usize) -> usize {
        if self.blocks == 1 {
            0
        } else {
            lane / 4
        }
    }

    /// The tile configuration: C 16 x 64 bytes, A 16 x `values`, B `groups` x 64.
    pub fn config(self) -> TileConfig {
        let mut config = TileConfig::default();
        config.rows[TILE_C] = TILE_ROWS as u8;
        config.colsb[TILE_C] = MAX_COLSB as u16;
        config.rows[TILE_A] = TILE_ROWS as u8;
        config.colsb[TILE_A] = self.values() as u16;
        config.rows[TILE_B] = self.groups() as u8;
        config.colsb[TILE_B] = PANEL_ROW as u16;
        config
    }
}

/// The activations in the B-tile layout, built once per matmul: for each pair of tokens and
/// step, `groups` rows of 64 bytes (column `8 j + lane` of row `g` holds token `j`'s group
/// `g` when `g` feeds `lane`, else zeros; a missing second token is zeros), and each
/// token's per-lane start `-zero * sum(qa)` per step.
pub struct ActivationPanels {
    shape: StepShape,
    steps: usize,
    panels: Vec<u8>,
    zero_start: Vec<[i32; LANES]>,
}

impl ActivationPanels {
    /// Lays out `activations` for `weights` (same blocks per row; checked by the caller).
    pub fn new(weights: &RepackedRows, activations: &Q8Rows) -> ActivationPanels {
        let shape = StepShape::for_weights(weights);
        let steps = weights.blocks_per_row() / shape.blocks;
        let num_tokens = activations.num_rows();
        let pairs = num_tokens.div_ceil(TOKENS_PER_TILE);
        let panel_bytes = shape.groups() * PANEL_ROW;
        let mut panels = vec![0u8; pairs * steps * panel_bytes];
        let mut zero_start = vec![[0i32; LANES]; num_tokens * steps];
        let zero = weights.zero();
        // One pair's panels (all steps) and its tokens' starts; pairs are independent.
        let fill = |(pair, (pair_panels, starts)): (usize, (&mut [u8], &mut [[i32; LANES]]))| {
            for (j, token_starts) in starts.chunks_exact_mut(steps).enumerate() {
                let qa = activations.row_qs(pair * TOKENS_PER_TILE + j);
                for (step, start) in token_starts.iter_mut().enumerate() {
                    let panel = &mut pair_panels[step * panel_bytes..][..panel_bytes];
                    for g in 0..shape.groups() {
                        let lane = shape.lane_of_group(g);
                        let bytes = &qa[step * shape.values() + GROUP * g..][..GROUP];
                        let at = g * PANEL_ROW + (LANES * j + lane) * GROUP;
                        for (dst, &src) in panel[at..at + GROUP].iter_mut().zip(bytes) {
                            *dst = src as u8;
                        }
                        let sum: i32 = bytes.iter().map(|&a| a as i32).sum();
                        start[lane] -= zero * sum;
                    }
                }
            }
        };
        let pair_bytes = steps * panel_bytes;
        let pair_starts = TOKENS_PER_TILE * steps;
        if pairs >= 2 * PAIRS_PER_PASS {
            panels
                .par_chunks_mut(pair_bytes)
                .zip(zero_start.par_chunks_mut(pair_starts))
                .enumerate()
                .for_each(fill);
        } else {
            panels
                .chunks_mut(pair_bytes)
                .zip(zero_start.chunks_mut(pair_starts))
                .enumerate()
                .for_each(fill);
        }
        ActivationPanels {
            shape,
            steps,
            panels,
            zero_start,
        }
    }

    fn panel(&self, pair: usize, step: usize) -> &[u8] {
        let panel_bytes = self.shape.groups() * PANEL_ROW;
        &self.panels[(pair * self.steps + step) * panel_bytes..][..panel_bytes]
    }
}

/// Token pairs (B tiles) per pass over the steps: 16 tokens, so the f32 accumulators of a
/// pass (16 rows x 16 tokens x 8 lanes, 16 KiB) stay in L1.
const PAIRS_PER_PASS: usize = 8;

/// Dots of weight rows `row_start .. row_start + out.len() / num_tokens` (at most 16) with
/// every token, into `out` as `[rows, num_tokens]`, through `unit` (configured here and
/// released at the end). The rows are unpacked once into a zero-padded 16-row A buffer;
/// then for each pass of up to 16 tokens and each step: one A load, and per token pair a
/// B load, a `TDPBUSD` into a zeroed C and a C store. Every (row, token) pair runs VNNI's
/// chain: per step `acc[l] = fma(f32(int[l]) * d_a, d_w, acc[l])`, then the horizontal
/// sum, then `+ min_term`.
#[inline(always)]
pub fn row_chunk<U: TileUnit>(
    unit: &mut U,
    weights: &RepackedRows,
    activations: &Q8Rows,
    panels: &ActivationPanels,
    row_start: usize,
    out: &mut [f32],
) {
    let num_tokens = activations.num_rows();
    let rows = out.len() / num_tokens;
    assert!(rows <= TILE_ROWS && row_start + rows <= weights.num_rows());
    let shape = panels.shape;
    let values = shape.values();
    let blocks = weights.blocks_per_row();
    let row_values = blocks * BLOCK;
    let factors: Vec<RowFactors> = (0..rows)
        .map(|m| weights.row_factors(row_start + m))
        .collect();
    let mut a_rows = vec![0u8; TILE_ROWS * row_values];
    let mut scales = vec![0f32; rows * blocks];
    for m in 0..rows {
        for block in 0..blocks {
            let u = weights.block_values(row_start + m, block);
            a_rows[m * row_values + block * BLOCK..][..BLOCK].copy_from_slice(&u);
            scales[m * blocks + block] = factors[m].scale(block);
        }
    }
    let pairs = num_tokens.div_ceil(TOKENS_PER_TILE);
    let mut acc = [[0f32; LANES]; TILE_ROWS * PAIRS_PER_PASS * TOKENS_PER_TILE];
    let mut c_tile = [0u8; TILE_ROWS * MAX_COLSB];
    let a_span = (TILE_ROWS - 1) * row_values + values;
    unit.configure(&shape.config());
    for first_pair in (0..pairs).step_by(PAIRS_PER_PASS) {
        let pass_pairs = PAIRS_PER_PASS.min(pairs - first_pair);
        let first_token = first_pair * TOKENS_PER_TILE;
        let pass_tokens = (pass_pairs * TOKENS_PER_TILE).min(num_tokens - first_token);
        let pass_acc = &mut acc[..rows * pass_tokens];
        pass_acc.fill([0.0; LANES]);
        for step in 0..panels.steps {
            let first_block = step * shape.blocks;
            unit.load_a(&a_rows[step * values..][..a_span], row_values);
            let dw: [[f32; LANES]; TILE_ROWS] = std::array::from_fn(|m| {
                std::array::from_fn(|lane| {
                    if m < rows {
                        scales[m * blocks + first_block + shape.block_of_lane(lane)]
                    } else {
                        0.0
                    }
                })
            });
            for pair in first_pair..first_pair + pass_pairs {
                unit.zero_c();
                unit.load_b(panels.panel(pair, step), PANEL_ROW);
                unit.dot_busd();
                unit.store_c(&mut c_tile, MAX_COLSB);
                for j in 0..TOKENS_PER_TILE.min(num_tokens - pair * TOKENS_PER_TILE) {
                    let t = pair * TOKENS_PER_TILE + j;
                    let token_scales = activations.row_scales(t);
                    let da: [f32; LANES] = std::array::from_fn(|lane| {
                        token_scales[first_block + shape.block_of_lane(lane)]
                    });
                    let start = &panels.zero_start[t * panels.steps + step];
                    for m in 0..rows {
                        let at = m * MAX_COLSB + LANES * GROUP * j;
                        let lanes = &c_tile[at..at + LANES * GROUP];
                        let acc = &mut pass_acc[m * pass_tokens + t - first_token];
                        for lane in 0..LANES {
                            let sum = i32::from_le_bytes(
                                lanes[GROUP * lane..GROUP * lane + GROUP]
                                    .try_into()
                                    .unwrap(),
                            );
                            let integer = sum.wrapping_add(start[lane]) as f32;
                            acc[lane] = (integer * da[lane]).mul_add(dw[m][lane], acc[lane]);
                        }
                    }
                }
            }
        }
        for m in 0..rows {
            for i in 0..pass_tokens {
                let t = first_token + i;
                let min_term = min_term(&factors[m], activations.row_sums(t));
                out[m * num_tokens + t] = horizontal_sum(&pass_acc[m * pass_tokens + i]) + min_term;
            }
        }
    }
    unit.release();
}

/// VNNI's `min_term`: `sum_b min_b s_a[b]` in 8 lanes of fused multiply-adds over the
/// blocks in order, the horizontal sum, then the leftover blocks one by one; 0 for formats
/// without mins.
#[inline(always)]
fn min_term(factors: &RowFactors, sums: &[f32]) -> f32 {
    if !factors.has_mins() {
        return 0.0;
    }
    let n = sums.len();
    let mut acc = [0f32; LANES];
    let mut b = 0;
    while b + LANES <= n {
        for lane in 0..LANES {
            acc[lane] = factors.min(b + lane).mul_add(sums[b + lane], acc[lane]);
        }
        b += LANES;
    }
    let mut total = horizontal_sum(&acc);
    while b < n {
        total = factors.min(b).mul_add(sums[b], total);
        b += 1;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each lane is fed by exactly the groups the VNNI kernels put in it: one block, group
    /// `l`; two blocks, groups `l` and `l + 4` of the first block (lanes 0..4) or the second.
    #[test]
    fn lanes_cover_the_vnni_groups() {
        let single = StepShape { blocks: 1 };
        assert_eq!(
            (0..8).map(|g| single.lane_of_group(g)).collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>()
        );
        let pairs = StepShape { blocks: 2 };
        for lane in 0..LANES {
            let groups: Vec<usize> = (0..16)
                .filter(|&g| pairs.lane_of_group(g) == lane)
                .collect();
            let block = lane / 4;
            let first = 8 * block + lane % 4;
            assert_eq!(groups, vec![first, first + 4], "lane {lane}");
            assert_eq!(pairs.block_of_lane(lane), block);
        }
        for shape in [single, pairs] {
            let config = shape.config();
            config.check_dot(TILE_C, TILE_A, TILE_B);
        }
    }
}
