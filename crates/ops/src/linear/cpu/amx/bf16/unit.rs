//! The tile operations of the BF16 prefill kernel, on the hardware (`TDPBF16PS`) and as a
//! plain-Rust model of the Intel SDM pseudo-code.
//!
//! The registers are fixed: C `tmm0..tmm3` (f32 accumulators, `[token][row]`, C `c` holds
//! token tile `c / 2` and weight-row tile `c % 2`), A `tmm4`, `tmm5` (the two token tiles'
//! activations, 16 tokens x 32 bf16), B `tmm6`, `tmm7` (the two row tiles' weights in the
//! pair layout: row `k` holds `(w[r][2k], w[r][2k + 1])` of each of 16 weight rows `r`).
//! Every tile is 16 rows x 64 bytes ([`config`]), so there are no edge shapes.
//!
//! `TDPBF16PS c, a, b` as modelled: for each token `m`, pair `k` and row `n`,
//! `C[m][n] += A[m][2k] * B[k][2n]`, then `+= A[m][2k + 1] * B[k][2n + 1]`, each product
//! exact in f32 (8-bit significands) and each sum rounded to nearest even, bf16 denormal
//! inputs read as zero and denormal results flushed to zero. The hardware may round in
//! another order; the tests compare it with this model within a bound, not bit for bit.

use super::super::tiles::{span, TileConfig, MAX_COLSB, MAX_ROWS, NUM_TILES};

/// C registers (token tile `c / 2`, row tile `c % 2`).
pub const C_TILES: usize = 4;
/// The A register of token tile `j` is `A_FIRST + j`.
pub const A_FIRST: usize = 4;
/// The B register of row tile `h` is `B_FIRST + h`.
pub const B_FIRST: usize = 6;

/// Every tile 16 rows x 64 bytes.
pub fn config() -> TileConfig {
    TileConfig {
        rows: [MAX_ROWS as u8; NUM_TILES],
        colsb: [MAX_COLSB as u16; NUM_TILES],
    }
}

/// A C tile in memory: 16 tokens x 16 f32, row stride 64 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[repr(C, align(64))]
pub struct FTile(pub [[f32; 16]; 16]);

/// The BF16 kernel's tile operations (fixed registers, see the module docs). Used by one
/// thread from [`Bf16Unit::configure`] to [`Bf16Unit::release`].
pub trait Bf16Unit {
    /// `LDTILECFG` of [`config`].
    fn configure(&mut self);
    /// `TILEZERO` of C `c` (`c < C_TILES`).
    fn zero(&mut self, c: usize);
    /// `TILELOADD` of register `t` (A or B: `A_FIRST <= t < 8`): 16 rows of 64 bytes at
    /// `stride`. Panics if `src` is shorter than that span.
    fn load(&mut self, t: usize, src: &[u8], stride: usize);
    /// `TDPBF16PS` of C `c` with A `A_FIRST + c / 2` and B `B_FIRST + c % 2`.
    fn dot(&mut self, c: usize);
    /// `TILESTORED` of C `c` into `dst`.
    fn store(&mut self, c: usize, dst: &mut FTile);
    /// `TILERELEASE`.
    fn release(&mut self);
}

/// The tile registers in memory.
#[derive(Debug, Clone)]
pub struct EmulatedBf16 {
    tiles: Box<[[[u8; MAX_COLSB]; MAX_ROWS]; NUM_TILES]>,
    configured: bool,
}

impl Default for EmulatedBf16 {
    fn default() -> EmulatedBf16 {
        EmulatedBf16 {
            tiles: Box::new([[[0; MAX_COLSB]; MAX_ROWS]; NUM_TILES]),
            configured: false,
        }
    }
}

/// A bf16 value as f32, denormals read as zero (the instruction's DAZ).
fn widen(bits: u16) -> f32 {
    let bits = if bits & 0x7F80 == 0 {
        bits & 0x8000
    } else {
        bits
    };
    f32::from_bits(u32::from(bits) << 16)
}

/// Denormal f32 results flushed to (signed) zero.
fn flush(value: f32) -> f32 {
    if value.is_subnormal() {
        0.0f32.copysign(value)
    } else {
        value
    }
}

impl EmulatedBf16 {
    fn check(&self) {
        assert!(self.configured, "tile instruction before LDTILECFG");
    }

    fn bf16(&self, t: usize, row: usize, index: usize) -> u16 {
        let bytes = &self.tiles[t][row];
        u16::from_le_bytes([bytes[2 * index], bytes[2 * index + 1]])
    }

    fn f32_at(&self, t: usize, row: usize, col: usize) -> f32 {
        let bytes = &self.tiles[t][row];
        f32::from_le_bytes(bytes[4 * col..4 * col + 4].try_into().unwrap())
    }
}

impl Bf16Unit for EmulatedBf16 {
    fn configure(&mut self) {
        config().check_dot(0, A_FIRST, B_FIRST);
        self.configured = true;
    }

    fn zero(&mut self, c: usize) {
        self.check();
        assert!(c < C_TILES, "C tile {c} out of range");
        self.tiles[c] = [[0; MAX_COLSB]; MAX_ROWS];
    }

    fn load(&mut self, t: usize, src: &[u8], stride: usize) {
        self.check();
        assert!(
            (A_FIRST..NUM_TILES).contains(&t),
            "tile {t} is not an A or B tile"
        );
        assert!(
            src.len() >= span(MAX_ROWS, MAX_COLSB, stride),
            "tile source too short"
        );
        for (r, row) in self.tiles[t].iter_mut().enumerate() {
            row.copy_from_slice(&src[r * stride..r * stride + MAX_COLSB]);
        }
    }

    fn dot(&mut self, c: usize) {
        self.check();
        assert!(c < C_TILES, "C tile {c} out of range");
        let (a, b) = (A_FIRST + c / 2, B_FIRST + c % 2);
        let mut out = [[0f32; 16]; 16];
        for (m, out) in out.iter_mut().enumerate() {
            for (n, out) in out.iter_mut().enumerate() {
                let mut acc = self.f32_at(c, m, n);
                for k in 0..MAX_ROWS {
                    for i in 0..2 {
                        let product =
                            widen(self.bf16(a, m, 2 * k + i)) * widen(self.bf16(b, k, 2 * n + i));
                        acc = flush(acc + product);
                    }
                }
                *out = acc;
            }
        }
        for (row, values) in self.tiles[c].iter_mut().zip(out) {
            for (bytes, value) in row.chunks_exact_mut(4).zip(values) {
                bytes.copy_from_slice(&value.to_le_bytes());
            }
        }
    }

    fn store(&mut self, c: usize, dst: &mut FTile) {
        self.check();
        assert!(c < C_TILES, "C tile {c} out of range");
        for (m, row) in dst.0.iter_mut().enumerate() {
            for (n, value) in row.iter_mut().enumerate() {
                *value = self.f32_at(c, m, n);
            }
        }
    }

    fn release(&mut self) {
        self.configured = false;
    }
}

/// The hardware tiles; exist only where [`super::is_available`] is true.
// Off x86-64 the unit is never built (`new` gives `None`): its state goes unread.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct HardwareBf16 {
    configured: bool,
}

impl HardwareBf16 {
    /// A unit, or `None` when this CPU/OS lacks AMX-BF16.
    pub fn new() -> Option<HardwareBf16> {
        super::is_available().then_some(HardwareBf16 { configured: false })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn check(&self) {
        assert!(self.configured, "tile instruction before LDTILECFG");
    }
}

/// One instruction per register: `$index` picks the arm; the operands follow `;`.
#[cfg(target_arch = "x86_64")]
macro_rules! per_tile {
    ($index:expr, $n0:literal => $t0:literal, $n1:literal => $t1:literal,
     $n2:literal => $t2:literal, $n3:literal => $t3:literal; $($rest:tt)*) => {
        match $index {
            $n0 => std::arch::asm!($t0, $($rest)*),
            $n1 => std::arch::asm!($t1, $($rest)*),
            $n2 => std::arch::asm!($t2, $($rest)*),
            $n3 => std::arch::asm!($t3, $($rest)*),
            other => panic!("tile {other} out of range"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
impl Bf16Unit for HardwareBf16 {
    fn configure(&mut self) {
        let config = config();
        config.check_dot(0, A_FIRST, B_FIRST);
        let image = config.to_bytes();
        // SAFETY: AMX is present and permitted (`new`); `image` is a valid palette-1
        // configuration of 64 readable bytes.
        unsafe {
            std::arch::asm!("ldtilecfg [{0}]", in(reg) image.as_ptr(), options(nostack, readonly));
        }
        self.configured = true;
    }

    #[inline(always)]
    fn zero(&mut self, c: usize) {
        self.check();
        // SAFETY: the tiles are configured; TILEZERO touches no memory.
        unsafe {
            per_tile!(c, 0 => "tilezero tmm0", 1 => "tilezero tmm1", 2 => "tilezero tmm2",
                3 => "tilezero tmm3"; options(nostack, nomem))
        };
    }

    #[inline(always)]
    fn load(&mut self, t: usize, src: &[u8], stride: usize) {
        self.check();
        assert!(
            src.len() >= span(MAX_ROWS, MAX_COLSB, stride),
            "tile source too short"
        );
        // SAFETY: the tile is configured as 16 x 64 bytes and `src` holds the span the load
        // reads (checked above).
        unsafe {
            per_tile!(t,
                4 => "tileloadd tmm4, [{base} + {stride} * 1]",
                5 => "tileloadd tmm5, [{base} + {stride} * 1]",
                6 => "tileloadd tmm6, [{base} + {stride} * 1]",
                7 => "tileloadd tmm7, [{base} + {stride} * 1]";
                base = in(reg) src.as_ptr(),
                stride = in(reg) stride,
                options(nostack, readonly)
            )
        };
    }

    #[inline(always)]
    fn dot(&mut self, c: usize) {
        self.check();
        // SAFETY: AMX-BF16 is present and permitted; all tiles are 16 x 64 bytes, a valid
        // TDPBF16PS shape.
        unsafe {
            per_tile!(c,
                0 => "tdpbf16ps tmm0, tmm4, tmm6",
                1 => "tdpbf16ps tmm1, tmm4, tmm7",
                2 => "tdpbf16ps tmm2, tmm5, tmm6",
                3 => "tdpbf16ps tmm3, tmm5, tmm7";
                options(nostack, nomem)
            )
        };
    }

    #[inline(always)]
    fn store(&mut self, c: usize, dst: &mut FTile) {
        self.check();
        // SAFETY: C is 16 rows x 64 bytes; `dst` holds 16 rows of 64 bytes at stride 64.
        unsafe {
            per_tile!(c,
                0 => "tilestored [{base} + {stride} * 1], tmm0",
                1 => "tilestored [{base} + {stride} * 1], tmm1",
                2 => "tilestored [{base} + {stride} * 1], tmm2",
                3 => "tilestored [{base} + {stride} * 1], tmm3";
                base = in(reg) dst.0.as_mut_ptr(),
                stride = in(reg) 64usize,
                options(nostack)
            )
        };
    }

    fn release(&mut self) {
        if std::mem::take(&mut self.configured) {
            // SAFETY: AMX is permitted; TILERELEASE only returns the tile state to INIT.
            unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for HardwareBf16 {
    fn drop(&mut self) {
        // A panic between configure and release must not leave the tiles configured.
        self.release();
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl Bf16Unit for HardwareBf16 {
    fn configure(&mut self) {
        unreachable!("no AMX off x86-64")
    }
    fn zero(&mut self, _: usize) {}
    fn load(&mut self, _: usize, _: &[u8], _: usize) {}
    fn dot(&mut self, _: usize) {}
    fn store(&mut self, _: usize, _: &mut FTile) {}
    fn release(&mut self) {}
}
