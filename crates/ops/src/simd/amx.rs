//! AMX-INT8 tiles for the multi-row (prefill) integer matmul, bit-identical to the VNNI tiles.
//!
//! The VNNI kernels of [`super::int_dot`] do not keep one integer per 32-value block: each
//! (weight row, token) pair has eight i32 lanes per step, each lane the dot of one or two
//! 4-byte groups, and the float combine is lane-wise (`acc[l] = fma(f32(int[l]) * d_a[l],
//! d_w[l], acc[l])`, then a fixed horizontal sum and the min term). A per-block integer sum
//! would round differently, so this path produces exactly those eight lane integers:
//!
//! - A step is one block (32 values; 8 groups of 4 bytes; lane `l` = group `l`) or, for
//!   nibble weights with an even block count (the VNNI "pairs" kernel), two blocks (16
//!   groups; lane `l < 4` = groups `l` and `l + 4` of the first block, lane `4 + l` = the
//!   same groups of the second).
//! - Tile A (`tmm1`, unsigned): 16 weight rows x the step's bytes (`u` in value order,
//!   nibbles unpacked), zero rows past the last weight row.
//! - Tile B (`tmm2`, signed): the activations of two tokens in the VNNI tile layout, one
//!   4-byte group per tile row, 16 columns = 2 tokens x 8 lanes; column `(token, lane)` holds
//!   the token's bytes of group `g` only when `g` feeds that lane, zero otherwise.
//! - `TDPBUSD tmm0, tmm1, tmm2` then gives, in C (`tmm0`, 16 x 16 i32), row `m`, columns
//!   `8 j .. 8 j + 8`: the eight lane sums `sum u * qa` of weight row `m` and token `j`. The
//!   offset `-zero * sum(qa)` of each lane (what VNNI starts its lanes at) is added as an
//!   exact integer, and the float combine runs in VNNI's order with VNNI's operations.
//!
//! Only one of the eight groups of a B row is non-zero per column, so a tile dot does 1/8
//! useful work: the lane-exact combine needs 8 integers per (row, token, block), and a C
//! tile holds 256. The gain over VNNI is therefore in the integer part only (one
//! instruction per 16 rows x 2 tokens x step instead of 32 `vpdpbusd`); the f32 combine is
//! the same work. A per-block combine (the scalar kernel's order) would let one tile dot
//! cover 16 x 16 x 64 useful bytes, but would give other bits than VNNI, and so break
//! batch invariance between AMX prefill and VNNI decode: a numerics decision, not taken here.
//!
//! [`TileBackend::Emulated`] runs the same loops on a plain-Rust model of the tile
//! registers ([`tiles::EmulatedTiles`]), so the layout, the edge tiles and the combine are
//! tested on any CPU; [`TileBackend::Hardware`] differs only in the instruction wrappers
//! (`hardware.rs`, the only unsafe code here). Hardware use needs CPUID `amx_tile` and
//! `amx_int8` and the Linux tile-data permission ([`is_available`]).

use std::sync::atomic::{AtomicU64, Ordering};

use pagoda_tensor::quant::q8::Q8Rows;
use pagoda_tensor::quant::repack::RepackedRows;
use rayon::prelude::*;

mod hardware;
mod kernel;
pub mod tiles;

/// Fewest activation rows (tokens) for which `auto` and `amx` use the AMX tiles; fewer rows
/// (decode) run the VNNI tiles, which give the same bits. Provisional: to be measured on
/// an AMX machine.
pub const AMX_MIN_TOKENS: usize = 16;

/// Where the tile instructions run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileBackend {
    /// The plain-Rust tile model ([`tiles::EmulatedTiles`]); runs on any CPU.
    Emulated,
    /// `ldtilecfg`/`tileloadd`/`tdpbusd`/`tilestored` on the CPU; needs [`is_available`].
    Hardware,
}

/// Why [`matmul`] did not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmxError {
    /// The hardware backend was asked for on a CPU or OS without AMX-INT8.
    #[error("AMX-INT8 is not available (needs CPUID amx_tile + amx_int8 and Linux XTILEDATA permission)")]
    NotAvailable,
    /// Weight and activation rows differ in length.
    #[error("weight rows have {weights} blocks, activation rows {activations}")]
    BlockMismatch {
        /// Blocks per weight row.
        weights: usize,
        /// Blocks per activation row.
        activations: usize,
    },
    /// `y` is not `[num_tokens, out_features]`.
    #[error("y has {got} values, expected {expected} (num_tokens x out_features)")]
    OutputSize {
        /// `y.len()`.
        got: usize,
        /// `num_tokens * out_features`.
        expected: usize,
    },
}

/// Whether this CPU and OS run AMX-INT8: CPUID leaf 7 EDX bits 24 (`amx_tile`) and 25
/// (`amx_int8`), and on Linux `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`
/// succeeding and `ARCH_GET_XCOMP_PERM` then listing the tile data. Checked (and the
/// permission requested) once per process; `false` on other targets.
pub fn is_available() -> bool {
    use std::sync::OnceLock;
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let available = hardware::detect();
        tracing::debug!("AMX-INT8 available: {available}");
        available
    })
}

static HARDWARE_MATMULS: AtomicU64 = AtomicU64::new(0);

/// How many matmuls have run on the hardware AMX tiles in this process (for metrics and for
/// tests that check the dispatch).
pub fn hardware_matmul_count() -> u64 {
    HARDWARE_MATMULS.load(Ordering::Relaxed)
}

/// `y[t, r] = dot(weights[r], activations[t])` (`y` is `[num_tokens, out_features]`,
/// overwritten), bit-identical to [`crate::linear::int_matmul::matmul`] with
/// [`super::int_dot::IntIsa::Vnni`]. Weight rows are split into tasks of 16 (one A tile) run
/// in parallel. Fails, writing nothing, on a shape mismatch or when `backend` is
/// [`TileBackend::Hardware`] and [`is_available`] is false.
pub fn matmul(
    backend: TileBackend,
    weights: &RepackedRows,
    activations: &Q8Rows,
    y: &mut [f32],
) -> Result<(), AmxError> {
    let n = weights.num_rows();
    let num_tokens = activations.num_rows();
    if weights.blocks_per_row() != activations.blocks_per_row() {
        return Err(AmxError::BlockMismatch {
            weights: weights.blocks_per_row(),
            activations: activations.blocks_per_row(),
        });
    }
    if y.len() != n * num_tokens {
        return Err(AmxError::OutputSize {
            got: y.len(),
            expected: n * num_tokens,
        });
    }
    if backend == TileBackend::Hardware {
        if !is_available() {
            return Err(AmxError::NotAvailable);
        }
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            tracing::info!(
                "AMX-INT8 tiles in use for integer matmuls of {AMX_MIN_TOKENS} or more tokens \
                 (bit-identical to VNNI; fewer tokens use VNNI)"
            )
        });
        HARDWARE_MATMULS.fetch_add(1, Ordering::Relaxed);
    }
    if n == 0 || num_tokens == 0 || weights.blocks_per_row() == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let panels = kernel::ActivationPanels::new(weights, activations);
    let chunks: Vec<(usize, Vec<f32>)> = (0..n)
        .step_by(kernel::TILE_ROWS)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|row_start| {
            let rows = kernel::TILE_ROWS.min(n - row_start);
            let mut local = vec![0f32; rows * num_tokens];
            match backend {
                TileBackend::Emulated => kernel::row_chunk(
                    &mut tiles::EmulatedTiles::default(),
                    weights,
                    activations,
                    &panels,
                    row_start,
                    &mut local,
                ),
                TileBackend::Hardware => {
                    hardware::row_chunk(weights, activations, &panels, row_start, &mut local)
                }
            }
            (row_start, local)
        })
        .collect();
    for (row_start, local) in chunks {
        let rows = local.len() / num_tokens;
        for (t, out) in y.chunks_exact_mut(n).enumerate() {
            for (r, value) in out[row_start..row_start + rows].iter_mut().enumerate() {
                *value = local[r * num_tokens + t];
            }
        }
    }
    Ok(())
}
