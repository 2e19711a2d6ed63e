//! The AMX tiling loops: activation panels (tile B), weight tiles (tile A), one `TDPBUSD`
//! per 16 weight rows x 16 tokens x 32-value block, and the f32 combine of
//! [`crate::simd::interleaved`] (see the parent module docs for the layout).

use pagoda_tensor::quant::q8::Q8Rows;
use rayon::prelude::*;

use super::tiles::{
    CTile, TileConfig, TileUnit, MAX_COLSB, MAX_ROWS, SLOTS, TILE_A, TILE_B, TILE_C,
};
use crate::simd::interleaved::{Interleaved, GROUP};

/// Weight rows per A and C tile: two interleaved groups.
pub const TILE_ROWS: usize = MAX_ROWS;
/// Tokens per B and C tile (one i32 column each).
pub const TILE_TOKENS: usize = MAX_COLSB / 4;
/// Values per block: the K of one tile dot.
const BLOCK: usize = 32;
/// Rows of a B tile: the block's 4-byte groups.
const B_ROWS: usize = BLOCK / 4;
/// Bytes of one B tile (a token tile's block).
const PANEL: usize = B_ROWS * MAX_COLSB;
/// Bytes of one A tile (16 rows of one block).
const A_TILE: usize = TILE_ROWS * BLOCK;

/// The tile configuration: per slot, C 16 x 64 bytes, A 16 x 32, B 8 x 64.
pub fn config() -> TileConfig {
    let mut config = TileConfig::default();
    for slot in 0..SLOTS {
        config.rows[TILE_C[slot]] = TILE_ROWS as u8;
        config.colsb[TILE_C[slot]] = MAX_COLSB as u16;
        config.rows[TILE_A[slot]] = TILE_ROWS as u8;
        config.colsb[TILE_A[slot]] = BLOCK as u16;
        config.rows[TILE_B[slot]] = B_ROWS as u8;
        config.colsb[TILE_B[slot]] = MAX_COLSB as u16;
    }
    config
}

/// The activations in the B-tile layout, built once per matmul. For each tile of 16 tokens
/// and block: 8 rows of 64 bytes, row `g` column `4 n .. 4 n + 4` holding token `n`'s bytes
/// `4 g .. 4 g + 4` of the block (zeros past the last token); and the tokens' factors.
pub struct ActivationPanels {
    tiles: usize,
    blocks: usize,
    bytes: Vec<u8>,
    factors: Vec<TokenFactors>,
}

/// One block's factors for the 16 tokens of a tile (zeros past the last token).
#[derive(Clone, Copy, Default)]
struct TokenFactors {
    scales: [f32; TILE_TOKENS],
    sums: [f32; TILE_TOKENS],
    /// The exact integer start of each dot, `-zero * sum(qa)`.
    starts: [i32; TILE_TOKENS],
}

impl ActivationPanels {
    /// Lays out `activations` for weights whose zero is `zero`.
    pub fn new(zero: i32, activations: &Q8Rows) -> ActivationPanels {
        let tokens = activations.num_rows();
        let blocks = activations.blocks_per_row();
        let tiles = tokens.div_ceil(TILE_TOKENS);
        let mut bytes = vec![0u8; tiles * blocks * PANEL];
        let mut factors = vec![TokenFactors::default(); tiles * blocks];
        // One task per token tile.
        let fill = |(tile, (bytes, factors)): (usize, (&mut [u8], &mut [TokenFactors]))| {
            for n in 0..TILE_TOKENS.min(tokens - tile * TILE_TOKENS) {
                let t = tile * TILE_TOKENS + n;
                let qa = activations.row_qs(t);
                let (scales, sums) = (activations.row_scales(t), activations.row_sums(t));
                for (b, (panel, factors)) in bytes
                    .chunks_exact_mut(PANEL)
                    .zip(factors.iter_mut())
                    .enumerate()
                {
                    let block = &qa[b * BLOCK..(b + 1) * BLOCK];
                    for (g, group) in block.chunks_exact(4).enumerate() {
                        for (i, &q) in group.iter().enumerate() {
                            panel[g * MAX_COLSB + 4 * n + i] = q as u8;
                        }
                    }
                    factors.scales[n] = scales[b];
                    factors.sums[n] = sums[b];
                    factors.starts[n] = -zero * block.iter().map(|&q| q as i32).sum::<i32>();
                }
            }
        };
        bytes
            .par_chunks_mut(blocks * PANEL)
            .zip(factors.par_chunks_mut(blocks))
            .enumerate()
            .for_each(fill);
        ActivationPanels {
            tiles,
            blocks,
            bytes,
            factors,
        }
    }

    fn panel(&self, tile: usize, block: usize) -> &[u8] {
        &self.bytes[(tile * self.blocks + block) * PANEL..][..PANEL]
    }
}

/// One chunk of 16 weight rows, unpacked for the A tiles: per block, 16 rows of 32 values
/// (row stride 32), and the rows' scales and mins (zeros for rows past the matrix).
struct WeightTiles {
    values: Vec<u8>,
    scales: Vec<[f32; TILE_ROWS]>,
    mins: Vec<[f32; TILE_ROWS]>,
}

impl WeightTiles {
    fn new(weights: &Interleaved, chunk: usize) -> WeightTiles {
        let blocks = weights.blocks_per_row();
        let mut tiles = WeightTiles {
            values: vec![0u8; blocks * A_TILE],
            scales: vec![[0f32; TILE_ROWS]; blocks],
            mins: vec![[0f32; TILE_ROWS]; blocks],
        };
        let (mut scales, mut mins) = ([0f32; GROUP], [0f32; GROUP]);
        for half in 0..TILE_ROWS / GROUP {
            let group = chunk * (TILE_ROWS / GROUP) + half;
            if group * GROUP >= weights.num_rows() {
                break;
            }
            for block in 0..blocks {
                let values: &mut [u8; GROUP * BLOCK] = (&mut tiles.values
                    [block * A_TILE + half * GROUP * BLOCK..][..GROUP * BLOCK])
                    .try_into()
                    .unwrap();
                weights.unpack_block(group, block, values, &mut scales, &mut mins);
                tiles.scales[block][half * GROUP..(half + 1) * GROUP].copy_from_slice(&scales);
                tiles.mins[block][half * GROUP..(half + 1) * GROUP].copy_from_slice(&mins);
            }
        }
        tiles
    }
}

/// Dots of chunk `chunk`'s weight rows (rows `16 chunk ..`, at most 16) with every token,
/// into `out` as `[rows, num_tokens]`, through `unit` (configured here and released at the
/// end). Per token tile, the blocks alternate between the two tile slots, so the dot of block
/// `b + 1` is issued before block `b`'s combine. Every (row, token) pair runs the interleaved
/// kernels' chain: per block `acc += d * d_a * integer + min * s_a`, no fused multiply-add.
#[inline(always)]
pub fn row_chunk<U: TileUnit>(
    unit: &mut U,
    weights: &Interleaved,
    panels: &ActivationPanels,
    chunk: usize,
    out: &mut [f32],
) {
    let blocks = panels.blocks;
    assert!(chunk * TILE_ROWS < weights.num_rows(), "chunk out of range");
    let rows = TILE_ROWS.min(weights.num_rows() - chunk * TILE_ROWS);
    let tokens = out.len() / rows;
    assert!(
        rows * tokens == out.len() && tokens.div_ceil(TILE_TOKENS) == panels.tiles,
        "out must be [rows, num_tokens]"
    );
    let w = WeightTiles::new(weights, chunk);
    let mut c: [CTile; SLOTS] = [CTile::default(), CTile::default()];
    unit.configure(&config());
    let issue = |unit: &mut U, c: &mut [CTile; SLOTS], tile: usize, block: usize| {
        let slot = block % SLOTS;
        unit.zero_c(slot);
        unit.load_a(slot, &w.values[block * A_TILE..][..A_TILE], BLOCK);
        unit.load_b(slot, panels.panel(tile, block), MAX_COLSB);
        unit.dot_busd(slot);
        unit.store_c(slot, &mut c[slot]);
    };
    for tile in 0..panels.tiles {
        let mut acc = [[0f32; TILE_TOKENS]; TILE_ROWS];
        issue(unit, &mut c, tile, 0);
        for block in 0..blocks {
            if block + 1 < blocks {
                issue(unit, &mut c, tile, block + 1);
            }
            let tokens = &panels.factors[tile * blocks + block];
            let step = Step {
                c: &c[block % SLOTS],
                d: &w.scales[block],
                min: &w.mins[block],
                da: &tokens.scales,
                sa: &tokens.sums,
                start: &tokens.starts,
            };
            #[cfg(target_arch = "x86_64")]
            if U::AVX512 {
                // SAFETY: a unit that sets AVX512 exists only on CPUs with AVX-512F.
                unsafe { x86::combine(&mut acc, &step) };
                continue;
            }
            combine(&mut acc, &step);
        }
        let first = tile * TILE_TOKENS;
        let count = TILE_TOKENS.min(tokens - first);
        for (m, row) in acc.iter().take(rows).enumerate() {
            out[m * tokens + first..][..count].copy_from_slice(&row[..count]);
        }
    }
    unit.release();
}

/// One block's inputs to the f32 step of 16 rows x 16 tokens.
struct Step<'a> {
    /// The tile dot's integers, `[row][token]`.
    c: &'a CTile,
    /// The rows' scales and mins.
    d: &'a [f32; TILE_ROWS],
    min: &'a [f32; TILE_ROWS],
    /// The tokens' scales, sums and integer starts.
    da: &'a [f32; TILE_TOKENS],
    sa: &'a [f32; TILE_TOKENS],
    start: &'a [i32; TILE_TOKENS],
}

/// One block's f32 step: `acc[m][n] += d[m] * d_a[n] * (c[m][n] + start[n]) + min[m] * s_a[n]`,
/// in that order (the oracle of [`x86::combine`]).
#[inline(always)]
fn combine(acc: &mut [[f32; TILE_TOKENS]; TILE_ROWS], step: &Step) {
    for (m, acc) in acc.iter_mut().enumerate() {
        let (dm, mm) = (step.d[m], step.min[m]);
        for n in 0..TILE_TOKENS {
            let integer = step.c.0[m][n].wrapping_add(step.start[n]) as f32;
            acc[n] += dm * step.da[n] * integer + mm * step.sa[n];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`super::combine`] with one AVX-512 vector of 16 tokens per row: the same operations
    /// in the same order, so the same bits. SAFETY: AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn combine(acc: &mut [[f32; TILE_TOKENS]; TILE_ROWS], step: &Step) {
        // SAFETY: every pointer is to a 16-lane array of the loaded type.
        unsafe {
            let da = _mm512_loadu_ps(step.da.as_ptr());
            let sa = _mm512_loadu_ps(step.sa.as_ptr());
            let start = _mm512_loadu_si512(step.start.as_ptr() as *const __m512i);
            for (m, acc) in acc.iter_mut().enumerate() {
                let ints = _mm512_loadu_si512(step.c.0[m].as_ptr() as *const __m512i);
                let integer = _mm512_cvtepi32_ps(_mm512_add_epi32(ints, start));
                let scaled = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(step.d[m]), da), integer);
                let term = _mm512_add_ps(scaled, _mm512_mul_ps(_mm512_set1_ps(step.min[m]), sa));
                let sum = _mm512_add_ps(_mm512_loadu_ps(acc.as_ptr()), term);
                _mm512_storeu_ps(acc.as_mut_ptr(), sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 step equals the portable one bit for bit, with extreme integers, starts,
    /// signs and magnitudes.
    #[test]
    fn the_vector_step_equals_the_portable_step() {
        #[cfg(target_arch = "x86_64")]
        {
            if !is_x86_feature_detected!("avx512f") {
                return;
            }
            let mut state = 0x9E37_79B9_7F4A_7C15u64;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            for round in 0..50 {
                let mut c = CTile::default();
                for row in &mut c.0 {
                    for value in row.iter_mut() {
                        *value = (next() as i32) >> (next() % 24);
                    }
                }
                let float = |bits: u64| f32::from_bits(0x3000_0000 + (bits % 0x1800_0000) as u32);
                let signed = |bits: u64| {
                    if bits & 1 == 1 {
                        -float(bits >> 1)
                    } else {
                        float(bits >> 1)
                    }
                };
                let d: [f32; 16] = std::array::from_fn(|_| signed(next()));
                let min: [f32; 16] = std::array::from_fn(|_| signed(next()));
                let da: [f32; 16] = std::array::from_fn(|_| float(next()));
                let sa: [f32; 16] = std::array::from_fn(|_| signed(next()));
                let start: [i32; 16] = std::array::from_fn(|_| (next() % 100_000) as i32 - 50_000);
                let step = Step {
                    c: &c,
                    d: &d,
                    min: &min,
                    da: &da,
                    sa: &sa,
                    start: &start,
                };
                let mut want = [[round as f32 * 0.37; 16]; 16];
                let mut got = want;
                combine(&mut want, &step);
                // SAFETY: AVX-512F checked above.
                unsafe { x86::combine(&mut got, &step) };
                for (w, g) in want.iter().flatten().zip(got.iter().flatten()) {
                    assert_eq!(w.to_bits(), g.to_bits(), "round {round}: {w} vs {g}");
                }
            }
        }
    }

    #[test]
    fn the_configuration_is_a_valid_dot_in_both_slots() {
        let config = config();
        for slot in 0..SLOTS {
            config.check_dot(TILE_C[slot], TILE_A[slot], TILE_B[slot]);
        }
    }
}
