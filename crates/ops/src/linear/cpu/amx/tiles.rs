//! The tile operations the AMX kernel uses, and a plain-Rust model of them.
//!
//! [`TileUnit`] is the whole interface between the kernel loops and the tile registers:
//! configure, zero C, load A and B, one `TDPBSUD`, store C, release. The kernel uses two
//! slots of fixed registers, so one slot's dot can run while the other's result is combined:
//! [`TILE_C`] (`tmm0`, `tmm3`: i32 accumulators), [`TILE_A`] (`tmm1`, `tmm5`: signed
//! bytes) and [`TILE_B`] (`tmm2`, `tmm4`: unsigned bytes). [`EmulatedTiles`] follows the semantics of
//! the Intel SDM pseudo-code (palette 1: 8 tiles of at most 16 rows x 64 bytes):
//!
//! - `TILELOADD t, [base + stride * r]`: rows `r < rows[t]` get `colsb[t]` bytes from
//!   `base + r * stride`; the rest of each row and the rows past `rows[t]` are zeroed.
//! - `TDPBSUD c, a, b`: `C[m][n] += sum_k sum_{i<4} sext(A[m][4k + i]) * zext(B[k][4n + i])`
//!   for `m < rows[c]`, `n < colsb[c] / 4`, `k < colsb[a] / 4`, wrapping i32; the bytes of C
//!   past `colsb[c]` and its rows past `rows[c]` are zeroed. The shapes must agree
//!   (`rows[a] == rows[c]`, `colsb[b] == colsb[c]`, `colsb[a] == 4 * rows[b]`), or the
//!   instruction faults (#UD): here a panic.
//! - `TILESTORED [base + stride * r], t`: rows `r < rows[t]`, `colsb[t]` bytes each.
//!
//! A wrong shape or a slice too short for the configured tile panics in both models before
//! any memory is touched.

/// The accumulator tiles of the two slots (`tmm0`, `tmm3`): 16 rows x 16 i32.
pub const TILE_C: [usize; SLOTS] = [0, 3];
/// The signed-byte tiles of the two slots (`tmm1`, `tmm5`): activation rows (tokens).
pub const TILE_A: [usize; SLOTS] = [1, 5];
/// The unsigned-byte tiles of the two slots (`tmm2`, `tmm4`): weights in the VNNI tile
/// layout (one 4-byte group of each weight row per tile row).
pub const TILE_B: [usize; SLOTS] = [2, 4];
/// Slots: (C, B) register pairs sharing the A tile.
pub const SLOTS: usize = 2;
/// Tile registers of palette 1.
pub const NUM_TILES: usize = 8;
/// Most rows of a tile.
pub const MAX_ROWS: usize = 16;
/// Most bytes of a tile row.
pub const MAX_COLSB: usize = 64;

/// A palette-1 tile configuration: rows and bytes per row of each tile (0 = unused).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileConfig {
    /// Rows of each tile, at most [`MAX_ROWS`].
    pub rows: [u8; NUM_TILES],
    /// Bytes per row of each tile, at most [`MAX_COLSB`].
    pub colsb: [u16; NUM_TILES],
}

impl TileConfig {
    /// The 64-byte memory image `LDTILECFG` reads: palette 1, start row 0, `colsb` as
    /// little-endian u16 at byte 16 + 2 t, `rows` at byte 48 + t.
    pub fn to_bytes(&self) -> [u8; 64] {
        let mut bytes = [0u8; 64];
        bytes[0] = 1;
        for t in 0..NUM_TILES {
            bytes[16 + 2 * t..18 + 2 * t].copy_from_slice(&self.colsb[t].to_le_bytes());
            bytes[48 + t] = self.rows[t];
        }
        bytes
    }

    /// Rows and bytes per row of tile `tile`. Panics if a limit is exceeded or the tile is
    /// unused (a load or store of it would fault).
    pub fn shape(&self, tile: usize) -> (usize, usize) {
        let (rows, colsb) = (self.rows[tile] as usize, self.colsb[tile] as usize);
        assert!(
            (1..=MAX_ROWS).contains(&rows) && (1..=MAX_COLSB).contains(&colsb),
            "tile {tile} is configured as {rows} rows x {colsb} bytes"
        );
        (rows, colsb)
    }

    /// Panics unless `TDPBSUD c, a, b` is valid for these shapes.
    pub fn check_dot(&self, c: usize, a: usize, b: usize) {
        let (c_rows, c_colsb) = self.shape(c);
        let (a_rows, a_colsb) = self.shape(a);
        let (b_rows, b_colsb) = self.shape(b);
        assert!(
            a_rows == c_rows && b_colsb == c_colsb && a_colsb == 4 * b_rows && c_colsb % 4 == 0,
            "TDPBSUD shapes: C {c_rows}x{c_colsb}, A {a_rows}x{a_colsb}, B {b_rows}x{b_colsb}"
        );
    }
}

/// A C tile in memory: 16 rows of 16 i32 (row stride 64 bytes), as `TILESTORED` writes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct CTile(pub [[i32; MAX_COLSB / 4]; MAX_ROWS]);

/// Bytes a tile of `rows` x `colsb` spans in memory with row stride `stride`.
pub fn span(rows: usize, colsb: usize, stride: usize) -> usize {
    (rows - 1) * stride + colsb
}

/// The tile operations of the AMX kernel (see the module docs for the semantics). A unit is
/// used by one thread from [`TileUnit::configure`] to [`TileUnit::release`]. `slot` (0 or 1)
/// picks the C and B registers ([`TILE_C`], [`TILE_B`]); a slot out of range panics.
pub trait TileUnit {
    /// Whether the kernel may run its f32 step with AVX-512F (true only for units that exist
    /// on CPUs with it).
    const AVX512: bool;
    /// `LDTILECFG`.
    fn configure(&mut self, config: &TileConfig);
    /// `TILEZERO` of the slot's C.
    fn zero_c(&mut self, slot: usize);
    /// `TILELOADD` of the slot's A. Panics if `src` is shorter than the tile spans.
    fn load_a(&mut self, slot: usize, src: &[u8], stride: usize);
    /// `TILELOADD` of the slot's B. Panics if `src` is shorter than the tile spans.
    fn load_b(&mut self, slot: usize, src: &[u8], stride: usize);
    /// `TDPBSUD` of the slot: its C += its A (signed) x its B (unsigned).
    fn dot_bsud(&mut self, slot: usize);
    /// `TILESTORED` of the slot's C into `dst` (row stride 64 bytes; rows and bytes past
    /// the configured shape are left as they were).
    fn store_c(&mut self, slot: usize, dst: &mut CTile);
    /// `TILERELEASE`.
    fn release(&mut self);
}

/// The tile registers in memory, with exactly the semantics of the instructions.
#[derive(Debug, Clone)]
pub struct EmulatedTiles {
    config: Option<TileConfig>,
    registers: [[u8; MAX_ROWS * MAX_COLSB]; NUM_TILES],
}

impl Default for EmulatedTiles {
    fn default() -> Self {
        EmulatedTiles {
            config: None,
            registers: [[0; MAX_ROWS * MAX_COLSB]; NUM_TILES],
        }
    }
}

impl EmulatedTiles {
    fn config(&self) -> &TileConfig {
        self.config
            .as_ref()
            .expect("tile instruction before LDTILECFG")
    }

    /// Register `tile`'s 1024 bytes (row `r` at `64 r`), for tests.
    pub fn register(&self, tile: usize) -> &[u8; MAX_ROWS * MAX_COLSB] {
        &self.registers[tile]
    }

    fn load(&mut self, tile: usize, src: &[u8], stride: usize) {
        let (rows, colsb) = self.config().shape(tile);
        assert!(
            src.len() >= span(rows, colsb, stride),
            "tile load of {rows}x{colsb} with stride {stride} needs {} bytes, got {}",
            span(rows, colsb, stride),
            src.len()
        );
        let register = &mut self.registers[tile];
        register.fill(0);
        for r in 0..rows {
            register[r * MAX_COLSB..r * MAX_COLSB + colsb]
                .copy_from_slice(&src[r * stride..r * stride + colsb]);
        }
    }
}

/// B rows widened to i32: `[k][i][n]` is byte `i` of column `n` in row `k`.
type Widened = [[[i32; 16]; 4]; MAX_ROWS];

/// The C rows of one `TDPBSUD`: `c` = `start` + A x B for `(rows, columns, k groups)`
/// (see [`EmulatedTiles`]'s `dot_bsud`); bytes outside the shape stay as `c` holds them.
#[inline(always)]
fn dot_rows(
    a: &[u8; MAX_ROWS * MAX_COLSB],
    start: &[u8; MAX_ROWS * MAX_COLSB],
    widened: &Widened,
    (rows, columns, k_groups): (usize, usize, usize),
    c: &mut [u8; MAX_ROWS * MAX_COLSB],
) {
    let inputs = a.chunks_exact(MAX_COLSB).zip(start.chunks_exact(MAX_COLSB));
    for ((a_row, start_row), c_row) in inputs.zip(c.chunks_exact_mut(MAX_COLSB)).take(rows) {
        let mut sums = [0i32; 16];
        for (sum, bytes) in sums.iter_mut().zip(start_row.chunks_exact(4)) {
            *sum = i32::from_le_bytes(bytes.try_into().unwrap());
        }
        for (group, w) in a_row.chunks_exact(4).zip(widened).take(k_groups) {
            let s = [0, 1, 2, 3].map(|i| group[i] as i8 as i32);
            // One multiply-add per lane and byte, the lanes innermost (what vectorizes).
            for (n, sum) in sums.iter_mut().enumerate() {
                let dot = s[0]
                    .wrapping_mul(w[0][n])
                    .wrapping_add(s[1].wrapping_mul(w[1][n]))
                    .wrapping_add(s[2].wrapping_mul(w[2][n]))
                    .wrapping_add(s[3].wrapping_mul(w[3][n]));
                *sum = sum.wrapping_add(dot);
            }
        }
        for (bytes, sum) in c_row.chunks_exact_mut(4).zip(sums).take(columns) {
            bytes.copy_from_slice(&sum.to_le_bytes());
        }
    }
}

/// [`dot_rows`] compiled for AVX2 (eight i32 lanes per multiply): the emulator runs the
/// invariance tests' prefills on CPUs without AMX, and SSE2 has no 32-bit vector multiply.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_rows_avx2(
    a: &[u8; MAX_ROWS * MAX_COLSB],
    start: &[u8; MAX_ROWS * MAX_COLSB],
    widened: &Widened,
    shape: (usize, usize, usize),
    c: &mut [u8; MAX_ROWS * MAX_COLSB],
) {
    dot_rows(a, start, widened, shape, c)
}

impl TileUnit for EmulatedTiles {
    // The emulator runs the portable step, the oracle of the vector one.
    const AVX512: bool = false;

    fn configure(&mut self, config: &TileConfig) {
        for t in 0..NUM_TILES {
            assert!(
                config.rows[t] as usize <= MAX_ROWS && config.colsb[t] as usize <= MAX_COLSB,
                "tile {t} exceeds palette 1"
            );
        }
        self.config = Some(*config);
        // LDTILECFG zeroes every tile.
        for register in &mut self.registers {
            register.fill(0);
        }
    }

    fn zero_c(&mut self, slot: usize) {
        self.config().shape(TILE_C[slot]);
        self.registers[TILE_C[slot]].fill(0);
    }

    fn load_a(&mut self, slot: usize, src: &[u8], stride: usize) {
        self.load(TILE_A[slot], src, stride);
    }

    fn load_b(&mut self, slot: usize, src: &[u8], stride: usize) {
        self.load(TILE_B[slot], src, stride);
    }

    fn dot_bsud(&mut self, slot: usize) {
        let config = *self.config();
        let (tile_c, tile_a, tile_b) = (TILE_C[slot], TILE_A[slot], TILE_B[slot]);
        config.check_dot(tile_c, tile_a, tile_b);
        let (c_rows, c_colsb) = config.shape(tile_c);
        let (_, a_colsb) = config.shape(tile_a);
        let (a, b) = (&self.registers[tile_a], &self.registers[tile_b]);
        // Integer sums wrap, so any order gives the instruction's result; this one keeps the
        // 16 sums of a C row in vectors. Each B row is widened once per dot; lanes past the
        // configured columns were zeroed by the load and are not stored.
        let k_groups = a_colsb / 4;
        let mut widened: Widened = [[[0i32; 16]; 4]; MAX_ROWS];
        for (k, widened) in widened.iter_mut().enumerate().take(k_groups) {
            for (i, lanes) in widened.iter_mut().enumerate() {
                for (n, lane) in lanes.iter_mut().enumerate() {
                    *lane = b[k * MAX_COLSB + 4 * n + i] as i32;
                }
            }
        }
        let mut c = [0u8; MAX_ROWS * MAX_COLSB];
        let start = &self.registers[tile_c];
        let shape = (c_rows, c_colsb / 4, k_groups);
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present; `dot_rows_avx2` only compiles the same safe code for it.
            unsafe { dot_rows_avx2(a, start, &widened, shape, &mut c) };
            self.registers[tile_c] = c;
            return;
        }
        dot_rows(a, start, &widened, shape, &mut c);
        self.registers[tile_c] = c;
    }

    fn store_c(&mut self, slot: usize, dst: &mut CTile) {
        let tile_c = TILE_C[slot];
        let (rows, colsb) = self.config().shape(tile_c);
        for (r, row) in dst.0.iter_mut().take(rows).enumerate() {
            let bytes = &self.registers[tile_c][r * MAX_COLSB..r * MAX_COLSB + colsb];
            for (value, lane) in row.iter_mut().zip(bytes.chunks_exact(4)) {
                *value = i32::from_le_bytes(lane.try_into().unwrap());
            }
        }
    }

    fn release(&mut self) {
        *self = EmulatedTiles::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(c: (u8, u16), a: (u8, u16), b: (u8, u16)) -> TileConfig {
        let mut config = TileConfig::default();
        for (t, (rows, colsb)) in [(TILE_C[0], c), (TILE_A[0], a), (TILE_B[0], b)] {
            config.rows[t] = rows;
            config.colsb[t] = colsb;
        }
        config
    }

    #[test]
    fn config_image_matches_the_ldtilecfg_layout() {
        let bytes = config((16, 64), (3, 32), (8, 64)).to_bytes();
        assert_eq!(bytes[0], 1, "palette");
        assert_eq!(bytes[1], 0, "start row");
        assert_eq!(&bytes[16..22], &[64, 0, 32, 0, 64, 0]);
        assert_eq!(&bytes[48..51], &[16, 3, 8]);
        assert!(bytes[22..48].iter().all(|&b| b == 0) && bytes[51..].iter().all(|&b| b == 0));
    }

    /// `TDPBSUD` against a naive i64 dot, with extreme bytes (A 0x80 is -128 signed, B 255 is
    /// +255 unsigned), edge shapes and a non-zero start in C.
    #[test]
    fn dot_follows_the_signed_by_unsigned_rule() {
        let (m_rows, k_groups, n_cols) = (5usize, 3usize, 7usize);
        let mut tiles = EmulatedTiles::default();
        tiles.configure(&config(
            (m_rows as u8, 4 * n_cols as u16),
            (m_rows as u8, 4 * k_groups as u16),
            (k_groups as u8, 4 * n_cols as u16),
        ));
        let a_stride = 4 * k_groups + 5;
        let a: Vec<u8> = (0..m_rows * a_stride)
            .map(|i| [255u8, 0, 1, 128, 77][i % 5].wrapping_add(i as u8 / 7))
            .collect();
        let b_stride = 4 * n_cols;
        let b: Vec<u8> = (0..k_groups * b_stride)
            .map(|i| [0x80u8, 0x7F, 0xFF, 3][i % 4].wrapping_add(i as u8 / 9))
            .collect();
        // Start C at known values: load them through the A path is not possible, so run a
        // first dot and then a second one: C = 2 * product.
        tiles.zero_c(0);
        tiles.load_a(0, &a, a_stride);
        tiles.load_b(0, &b, b_stride);
        tiles.dot_bsud(0);
        tiles.dot_bsud(0);
        let mut c = CTile::default();
        tiles.store_c(0, &mut c);
        for m in 0..m_rows {
            for n in 0..n_cols {
                let mut want = 0i64;
                for k in 0..k_groups {
                    for i in 0..4 {
                        want += a[m * a_stride + 4 * k + i] as i8 as i64
                            * b[k * b_stride + 4 * n + i] as i64;
                    }
                }
                assert_eq!(c.0[m][n] as i64, 2 * want, "m{m} n{n}");
            }
            // Bytes past colsb are zero.
            assert!(tiles.register(TILE_C[0])[m * 64 + 4 * n_cols..(m + 1) * 64]
                .iter()
                .all(|&x| x == 0));
        }
        assert!(tiles.register(TILE_C[0])[m_rows * 64..]
            .iter()
            .all(|&x| x == 0));
    }

    #[test]
    fn load_zeroes_past_the_configured_shape_and_rejects_short_slices() {
        let mut tiles = EmulatedTiles::default();
        tiles.configure(&config((2, 8), (2, 8), (2, 8)));
        let src: Vec<u8> = (1..=40).collect();
        tiles.load_a(0, &src, 20);
        let register = tiles.register(TILE_A[0]);
        assert_eq!(&register[..8], &src[..8]);
        assert_eq!(&register[64..72], &src[20..28]);
        assert!(register[8..64].iter().all(|&x| x == 0));
        assert!(register[72..].iter().all(|&x| x == 0));
        let short = std::panic::catch_unwind(move || {
            let mut tiles = tiles;
            tiles.load_b(0, &[0u8; 27], 20);
        });
        assert!(
            short.is_err(),
            "a 27-byte slice cannot hold 2 rows of 8 at stride 20"
        );
    }

    #[test]
    #[should_panic(expected = "TDPBSUD shapes")]
    fn mismatched_shapes_fault() {
        let mut tiles = EmulatedTiles::default();
        tiles.configure(&config((16, 64), (16, 32), (4, 64)));
        tiles.dot_bsud(0);
    }
}
