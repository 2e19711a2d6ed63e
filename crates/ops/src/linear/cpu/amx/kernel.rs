//! The AMX tiling loops: activations straight from the Q8 rows (tile A: 16 tokens x one
//! 32-value block), weights from the interleaved records (tile B: the block's eight 4-byte
//! groups of 16 weight rows), one `TDPBSUD` per 16 tokens x 16 rows x block, and the f32
//! combine of [`crate::linear::cpu::interleaved`] (see the parent module docs for the layout).

use pagoda_tensor::quant::q8::Q8Rows;
use rayon::prelude::*;

use super::tiles::{
    CTile, TileConfig, TileUnit, MAX_COLSB, MAX_ROWS, SLOTS, TILE_A, TILE_B, TILE_C,
};
use crate::linear::cpu::interleaved::{Interleaved, GROUP};

/// Weight rows per B and C tile (one i32 column each): two interleaved groups.
pub const TILE_ROWS: usize = MAX_COLSB / 4;
/// Tokens per A and C tile.
pub const TILE_TOKENS: usize = MAX_ROWS;
/// Values per block: the K of one tile dot.
const BLOCK: usize = 32;
/// Rows of a B tile: the block's 4-byte groups.
const B_ROWS: usize = BLOCK / 4;
/// Bytes of one B tile (16 weight rows of one block).
const B_TILE: usize = B_ROWS * MAX_COLSB;

/// The tile configuration: per slot, C 16 x 64 bytes, A 16 x 32, B 8 x 64.
pub fn config() -> TileConfig {
    let mut config = TileConfig::default();
    for slot in 0..SLOTS {
        config.rows[TILE_C[slot]] = TILE_TOKENS as u8;
        config.colsb[TILE_C[slot]] = MAX_COLSB as u16;
        config.rows[TILE_A[slot]] = TILE_TOKENS as u8;
        config.colsb[TILE_A[slot]] = BLOCK as u16;
        config.rows[TILE_B[slot]] = B_ROWS as u8;
        config.colsb[TILE_B[slot]] = MAX_COLSB as u16;
    }
    config
}

/// The activations as the tiles read them, built once per matmul: A tiles load the Q8 rows in
/// place (16 tokens at a row stride of `row_len` bytes), the last partial tile from a copy
/// padded with zero tokens; and per tile of 16 tokens and block, the tokens' factors.
pub struct Activations<'a> {
    q8: &'a Q8Rows,
    tiles: usize,
    tail: Vec<i8>,
    /// Q15 rows: the `lo` plane's padded last tile (empty for Q8 rows).
    tail_lo: Vec<i8>,
    factors: Vec<TokenFactors>,
    /// Whether the weights have a zero point (else every start is 0).
    starts: bool,
}

/// One block's factors for the 16 tokens of a tile (zeros past the last token).
#[derive(Clone, Copy, Default)]
struct TokenFactors {
    scales: [f32; TILE_TOKENS],
    sums: [f32; TILE_TOKENS],
    /// The exact integer start of each dot, `-zero * sum(qa)`.
    starts: [i32; TILE_TOKENS],
}

impl<'a> Activations<'a> {
    /// Prepares `q8`; `starts` from [`crate::linear::cpu::interleaved::block_starts`] for the
    /// weights (empty when their zero is 0).
    pub fn new(q8: &'a Q8Rows, starts: &[i32]) -> Activations<'a> {
        let tokens = q8.num_rows();
        let blocks = q8.blocks_per_row();
        let tiles = tokens.div_ceil(TILE_TOKENS);
        let full = tokens / TILE_TOKENS * TILE_TOKENS;
        let padded = |plane: &[i8]| {
            let mut tail = plane[full * q8.row_len()..].to_vec();
            tail.resize(TILE_TOKENS * q8.row_len(), 0);
            tail
        };
        let (mut tail, mut tail_lo) = (Vec::new(), Vec::new());
        if full < tokens {
            tail = padded(q8.qs());
            if q8.is_q15() {
                tail_lo = padded(q8.lo());
            }
        }
        let mut factors = vec![TokenFactors::default(); tiles * blocks];
        // One task per token tile.
        factors
            .par_chunks_mut(blocks)
            .enumerate()
            .for_each(|(tile, factors)| {
                for n in 0..TILE_TOKENS.min(tokens - tile * TILE_TOKENS) {
                    let t = tile * TILE_TOKENS + n;
                    let (scales, sums) = (q8.row_scales(t), q8.row_sums(t));
                    for (b, factors) in factors.iter_mut().enumerate() {
                        factors.scales[n] = scales[b];
                        factors.sums[n] = sums[b];
                        factors.starts[n] = starts.get(t * blocks + b).copied().unwrap_or(0);
                    }
                }
            });
        Activations {
            q8,
            tiles,
            tail,
            tail_lo,
            factors,
            starts: !starts.is_empty(),
        }
    }

    /// The bytes tile `tile`'s A loads start at (token `16 tile`, block 0), row stride
    /// `row_len`; at least 16 rows. `lo`: the Q15 rows' `lo` plane instead of `qs`.
    fn tile_source(&self, tile: usize, lo: bool) -> &[u8] {
        let row_len = self.q8.row_len();
        let start = tile * TILE_TOKENS;
        let (plane, tail) = if lo {
            (self.q8.lo(), &self.tail_lo)
        } else {
            (self.q8.qs(), &self.tail)
        };
        if start + TILE_TOKENS <= self.q8.num_rows() {
            bytemuck::cast_slice(&plane[start * row_len..])
        } else {
            bytemuck::cast_slice(tail)
        }
    }
}

/// One chunk of 16 weight rows as B tiles: per block, 8 rows of 64 bytes (row `g` holding the
/// 4 values of group `g` of each weight row), and the rows' scales and mins (zeros for rows
/// past the matrix).
pub struct WeightTiles {
    bytes: Vec<u8>,
    scales: Vec<[f32; TILE_ROWS]>,
    mins: Vec<[f32; TILE_ROWS]>,
}

impl WeightTiles {
    /// Tiles for no weights yet ([`WeightTiles::fill`] sizes them).
    const fn empty() -> WeightTiles {
        WeightTiles {
            bytes: Vec::new(),
            scales: Vec::new(),
            mins: Vec::new(),
        }
    }

    /// Rebuilds the tiles for chunk `chunk` of `weights` in place, reusing the buffers. Every
    /// byte and factor of the chunk's rows is written; in a partial last chunk the lanes of
    /// the missing rows keep whatever they held, which only reaches C columns that are never
    /// read. Inlined into the hardware kernel's AVX-512 function.
    #[inline(always)]
    fn fill(&mut self, weights: &Interleaved, chunk: usize) {
        let blocks = weights.blocks_per_row();
        let tiles = self;
        if tiles.bytes.len() != blocks * B_TILE {
            tiles.bytes.clear();
            tiles.bytes.resize(blocks * B_TILE, 0);
            tiles.scales.clear();
            tiles.scales.resize(blocks, [0f32; TILE_ROWS]);
            tiles.mins.clear();
            tiles.mins.resize(blocks, [0f32; TILE_ROWS]);
        }
        let (mut scales, mut mins) = ([0f32; GROUP], [0f32; GROUP]);
        const HALF: usize = GROUP * 4;
        for half in 0..TILE_ROWS / GROUP {
            let group = chunk * (TILE_ROWS / GROUP) + half;
            if group * GROUP >= weights.num_rows() {
                break;
            }
            for block in 0..blocks {
                let tile = &mut tiles.bytes[block * B_TILE..(block + 1) * B_TILE];
                let stored = weights.block_weights(group, block);
                let planes = weights.planes();
                let masks = if planes > 0 {
                    weights.block_planes(group, block)
                } else {
                    [[0; GROUP]; 2]
                };
                for (step, bytes) in stored.chunks_exact(HALF).enumerate() {
                    let at = step * MAX_COLSB + half * HALF;
                    #[cfg(target_arch = "x86_64")]
                    if weights.is_nibble() && vector_split() {
                        let high = at + 4 * MAX_COLSB;
                        let tile = tile.as_mut_ptr();
                        // SAFETY: the CPU has the features (`vector_split`); `bytes` holds
                        // HALF = 32 bytes, and `tile` 32 at `at` and at `high` (both rows of
                        // this B tile, `high + 32 <= B_TILE`).
                        unsafe {
                            x86::split_nibbles(
                                bytes.as_ptr(),
                                tile.add(at),
                                tile.add(high),
                                [masks[0][step], masks[1][step]],
                                [masks[0][step + 4], masks[1][step + 4]],
                                planes,
                            )
                        };
                        continue;
                    }
                    if weights.is_nibble() {
                        // Low nibbles are values 4 step + j, high nibbles 16 + 4 step + j.
                        let high = at + 4 * MAX_COLSB;
                        for (j, &byte) in bytes.iter().enumerate() {
                            tile[at + j] = byte & 0x0F;
                            tile[high + j] = byte >> 4;
                        }
                        // Values of 5-6 bits: the higher bits from the planes.
                        for (p, masks) in masks.iter().enumerate().take(planes) {
                            for j in 0..HALF {
                                tile[at + j] |= (((masks[step] >> j) & 1) as u8) << (4 + p);
                                tile[high + j] |= (((masks[step + 4] >> j) & 1) as u8) << (4 + p);
                            }
                        }
                    } else {
                        tile[at..at + HALF].copy_from_slice(bytes);
                    }
                }
                weights.block_factors(group, block, &mut scales, &mut mins);
                tiles.scales[block][half * GROUP..(half + 1) * GROUP].copy_from_slice(&scales);
                tiles.mins[block][half * GROUP..(half + 1) * GROUP].copy_from_slice(&mins);
            }
        }
    }
}

std::thread_local! {
    /// Each thread's B tiles, rebuilt per chunk ([`WeightTiles::fill`]) without allocating.
    static WEIGHT_TILES: std::cell::RefCell<WeightTiles> =
        const { std::cell::RefCell::new(WeightTiles::empty()) };
}

/// Runs `f` with this thread's B-tile buffers for [`row_chunk`]. Call it outside the
/// kernel's `#[target_feature]` function (a closure inside one is compiled without them).
pub fn with_weight_tiles<R>(f: impl FnOnce(&mut WeightTiles) -> R) -> R {
    WEIGHT_TILES.with_borrow_mut(f)
}

/// Whether [`WeightTiles::fill`] splits nibbles with [`x86::split_nibbles`] (AVX2 and
/// AVX-512BW/VL, which every CPU that runs the interleaved kernels has), the same bytes as
/// its scalar loop.
#[cfg(target_arch = "x86_64")]
fn vector_split() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    })
}

/// Dots of chunk `chunk`'s weight rows (rows `16 chunk ..`, at most 16) with every token,
/// into `out` token-major, `[num_tokens, rows]`, through `unit` (configured here and released at the
/// end). Per token tile, the blocks alternate between the two tile slots, so the dot of block
/// `b + 1` is issued before block `b`'s combine. Every (row, token) pair runs the interleaved
/// kernels' chain: per block `acc += d * d_a * integer + min * s_a`, no fused multiply-add.
/// `tiles` are the thread's B-tile buffers ([`with_weight_tiles`]), rebuilt for this chunk.
#[inline(always)]
pub fn row_chunk<U: TileUnit>(
    unit: &mut U,
    weights: &Interleaved,
    activations: &Activations,
    tiles: &mut WeightTiles,
    chunk: usize,
    out: &mut [f32],
) {
    let blocks = weights.blocks_per_row();
    assert!(chunk * TILE_ROWS < weights.num_rows(), "chunk out of range");
    let rows = TILE_ROWS.min(weights.num_rows() - chunk * TILE_ROWS);
    let tokens = activations.q8.num_rows();
    assert!(
        rows * tokens == out.len() && blocks == activations.q8.blocks_per_row(),
        "out must be [num_tokens, rows]"
    );
    let row_len = activations.q8.row_len();
    tiles.fill(weights, chunk);
    tile_rows(unit, weights, activations, tiles, rows, row_len, out)
}

/// [`row_chunk`]'s tile loops over the chunk's B tiles `w` (`rows` weight rows).
#[inline(always)]
fn tile_rows<U: TileUnit>(
    unit: &mut U,
    weights: &Interleaved,
    activations: &Activations,
    w: &WeightTiles,
    rows: usize,
    row_len: usize,
    out: &mut [f32],
) {
    let blocks = weights.blocks_per_row();
    let tokens = activations.q8.num_rows();
    unit.configure(&config());
    let q15 = activations.q8.is_q15();
    // The tile dots of one block in memory, `[Q8 or hi, lo]`, for blocks of each parity: the
    // next block's dots are issued before this block's combine reads its own.
    let mut c = [[CTile::default(); 2]; 2];
    for tile in 0..activations.tiles {
        let source = activations.tile_source(tile, false);
        let lo = if q15 {
            activations.tile_source(tile, true)
        } else {
            &[]
        };
        let mut acc = [[0f32; TILE_ROWS]; TILE_TOKENS];
        let sources = BlockSources {
            hi: source,
            lo,
            row_len,
            weights: &w.bytes,
        };
        issue_block(unit, &sources, 0, &mut c[0]);
        for block in 0..blocks {
            let (even, odd) = c.split_at_mut(1);
            let (current, next) = if block % 2 == 0 {
                (&even[0], &mut odd[0])
            } else {
                (&odd[0], &mut even[0])
            };
            if block + 1 < blocks {
                issue_block(unit, &sources, block + 1, next);
            }
            let tokens = &activations.factors[tile * blocks + block];
            let lo = q15.then_some(&current[1]);
            step::<U>(
                &mut acc,
                &current[0],
                lo,
                w,
                block,
                tokens,
                activations.starts,
            );
        }
        let first = tile * TILE_TOKENS;
        for (n, values) in acc.iter().take(tokens - first).enumerate() {
            out[(first + n) * rows..][..rows].copy_from_slice(&values[..rows]);
        }
    }
    unit.release();
}

/// Where one token tile's A loads and the chunk's B loads read.
struct BlockSources<'a> {
    /// The tile's Q8 rows (Q15 rows: the `hi` plane), 16 rows at stride `row_len`.
    hi: &'a [u8],
    /// Q15 rows: the `lo` plane's (empty for Q8 rows).
    lo: &'a [u8],
    row_len: usize,
    /// The chunk's B tiles ([`WeightTiles::bytes`]).
    weights: &'a [u8],
}

/// The tile dots of block `block` into `c`: Q8 rows one dot (slot of the block's parity, so
/// consecutive blocks use different registers), Q15 rows the `hi` dot in slot 0 and the `lo`
/// dot in slot 1.
#[inline(always)]
fn issue_block<U: TileUnit>(
    unit: &mut U,
    sources: &BlockSources,
    block: usize,
    c: &mut [CTile; 2],
) {
    let b = &sources.weights[block * B_TILE..(block + 1) * B_TILE];
    let (at, stride) = (block * BLOCK, sources.row_len);
    if sources.lo.is_empty() {
        let slot = block % SLOTS;
        issue(unit, slot, &sources.hi[at..], stride, b, &mut c[0]);
    } else {
        issue(unit, 0, &sources.hi[at..], stride, b, &mut c[0]);
        issue(unit, 1, &sources.lo[at..], stride, b, &mut c[1]);
    }
}

/// One tile dot in `slot`: C = 0, A from `a` (16 rows at `a_stride`), B from `b`, `TDPBSUD`,
/// C stored to `c`.
#[inline(always)]
fn issue<U: TileUnit>(
    unit: &mut U,
    slot: usize,
    a: &[u8],
    a_stride: usize,
    b: &[u8],
    c: &mut CTile,
) {
    unit.zero_c(slot);
    unit.load_a(slot, a, a_stride);
    unit.load_b(slot, b, MAX_COLSB);
    unit.dot_bsud(slot);
    unit.store_c(slot, c);
}

/// Block `block`'s f32 step on the tile dot `c` (Q15: `c` of the `hi` plane and `lo` of the
/// `lo` plane), on the AVX-512 combine where the unit runs on such a CPU.
#[inline(always)]
// `U` picks the x86 combine only.
#[cfg_attr(
    not(target_arch = "x86_64"),
    allow(clippy::extra_unused_type_parameters)
)]
fn step<U: TileUnit>(
    acc: &mut [[f32; TILE_ROWS]; TILE_TOKENS],
    c: &CTile,
    lo: Option<&CTile>,
    w: &WeightTiles,
    block: usize,
    tokens: &TokenFactors,
    starts: bool,
) {
    let step = Step {
        c,
        lo,
        starts,
        d: &w.scales[block],
        min: &w.mins[block],
        da: &tokens.scales,
        sa: &tokens.sums,
        start: &tokens.starts,
    };
    #[cfg(target_arch = "x86_64")]
    if U::AVX512 {
        // SAFETY: a unit that sets AVX512 exists only on CPUs with AVX-512F.
        unsafe { x86::combine(acc, &step) };
        return;
    }
    combine(acc, &step);
}

/// One block's inputs to the f32 step of 16 tokens x 16 rows.
struct Step<'a> {
    /// The tile dot's integers, `[token][row]` (Q15 rows: of the `hi` plane).
    c: &'a CTile,
    /// Q15 rows: the `lo` plane's tile dot; the block integer is `128 c + lo`, exact.
    lo: Option<&'a CTile>,
    /// The rows' scales and mins.
    d: &'a [f32; TILE_ROWS],
    min: &'a [f32; TILE_ROWS],
    /// Whether any start is non-zero (adding a zero start is exact, so skipping it keeps the
    /// bits).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    starts: bool,
    /// The tokens' scales, sums and integer starts.
    da: &'a [f32; TILE_TOKENS],
    sa: &'a [f32; TILE_TOKENS],
    start: &'a [i32; TILE_TOKENS],
}

/// One block's f32 step: `acc[n][r] += d[r] * d_a[n] * (c[n][r] + start[n]) + min[r] * s_a[n]`
/// (Q15: `128 c[n][r] + lo[n][r]` for `c[n][r]`), in that order (the oracle of
/// [`x86::combine`]).
#[inline(always)]
fn combine(acc: &mut [[f32; TILE_ROWS]; TILE_TOKENS], step: &Step) {
    for (n, acc) in acc.iter_mut().enumerate() {
        let (da, sa, start) = (step.da[n], step.sa[n], step.start[n]);
        for r in 0..TILE_ROWS {
            let dot = match step.lo {
                Some(lo) => (step.c.0[n][r] << 7).wrapping_add(lo.0[n][r]),
                None => step.c.0[n][r],
            };
            let integer = dot.wrapping_add(start) as f32;
            acc[r] += step.d[r] * da * integer + step.min[r] * sa;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

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
                // Every other pair of rounds without a zero point: all starts 0, skipped.
                let start: [i32; 16] = std::array::from_fn(|_| {
                    let start = (next() % 100_000) as i32 - 50_000;
                    if round % 4 < 2 {
                        start
                    } else {
                        0
                    }
                });
                let mut lo = CTile::default();
                for row in &mut lo.0 {
                    for value in row.iter_mut() {
                        *value = (next() % 128) as i32 - 64;
                    }
                }
                let step = Step {
                    c: &c,
                    lo: (round % 2 == 1).then_some(&lo),
                    starts: start.iter().any(|&start| start != 0),
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
