//! AMX-INT8 tiles for the multi-row (prefill) integer matmul, bit-identical to the
//! interleaved VNNI kernel ([`crate::linear::cpu::interleaved`], the `vnni8` set) and so to the
//! scalar kernel.
//!
//! Each (weight row, token) pair of those kernels keeps one exact integer per 32-value block
//! and folds it into an f32 sum: per block `acc += d * d_a * integer + min * s_a`, blocks in
//! order, no fused multiply-add. A tile dot with K = 32 gives exactly those integers for 16
//! rows x 16 tokens at once:
//!
//! - Tile A (signed): the block's activations of 16 tokens, loaded in place from the Q8 rows
//!   (row stride = the row length); the last partial tile from a zero-padded copy.
//! - Tile B (unsigned): the block of 16 weight rows (two interleaved groups) in the VNNI tile
//!   layout, row `g` holding each weight row's values `4 g .. 4 g + 4`: the interleaved
//!   records already hold them that way, so building B is a nibble split per task of 16 rows.
//! - `TDPBSUD` then gives C (16 tokens x 16 rows, i32) = `sum qa * u` per (token, row); the
//!   integer start `-zero * sum(qa)` is added exactly, and the f32 step runs in the scalar
//!   kernel's order, one 16-row vector per token.
//!
//! The next block's dots are issued before this block's combine, into the other of two C
//! buffers, so they run while the combine does (Q8 rows alternate two slots of tile
//! registers). Q15 activation rows ([`pagoda_tensor::quant::q8`]) take two dots per block, the
//! `hi` plane's in slot 0 and the `lo` plane's in slot 1, and the f32 step forms the block
//! integer `128 c_hi + c_lo` (exact) before the same chain.
//!
//! The tile instructions are `#[inline(always)]` wrappers whose shapes were checked once at
//! `LDTILECFG`, and the per-dot code is a plain function inlined into the AVX-512 kernel: a
//! closure there stayed an out-of-line call with a shape check per dot; inlining it cut the
//! AMX `gate_up` time by 10-38% in six alternating rounds on the Xeon host (same bits).
//!
//! Decode and batches below [`AMX_MIN_TOKENS`] run the interleaved VNNI kernel, with the same
//! bits, so a request's logits do not depend on the batch it ran in.
//!
//! [`TileBackend::Emulated`] runs the same loops on a plain-Rust model of the tile
//! registers ([`tiles::EmulatedTiles`]), so the layout, the edge tiles and the combine are
//! tested on any CPU; [`TileBackend::Hardware`] differs only in the instruction wrappers
//! (`hardware.rs`, the only unsafe code here). Hardware use needs CPUID `amx_tile` and
//! `amx_int8` and the Linux tile-data permission ([`is_available`]).
//!
//! `PAGODA_CPU_AMX_TILES=auto|hardware|emulated` ([`backend`]) says where the `amx` set's
//! tiles run: `auto` on the hardware where it is available (else the set is not offered);
//! `emulated` on the tile model on any CPU with AVX-512 VNNI, so that the `amx` set's
//! dispatch, thresholds and bits are tested end to end on machines without AMX (slow: for
//! tests, not serving).

use std::sync::atomic::{AtomicU64, Ordering};

use pagoda_tensor::quant::q8::Q8Rows;

use crate::linear::cpu::interleaved::Interleaved;

pub mod bf16;
pub(crate) mod detect;
mod hardware;
mod kernel;
pub mod tiles;

pub use detect::{backend, is_available, TileBackend, TILES_ENV_VAR};

/// Fewest activation rows (tokens) for which the `amx` set uses the AMX tiles; fewer rows
/// (decode, small batches) run the interleaved VNNI kernel, which gives the same bits.
/// Measured on the GPU machine's host (Xeon, 2 threads, the default model's shapes) with the
/// inlined tile code: AMX is 0.5-1.4x `vnni8` at 16 tokens, 0.6-1.6x at 32 (below 1 for the
/// smaller shapes), 1.1-1.9x at 64 (0.7-1.1x for `[192 x 576]`) and 1.1-2.5x at 128. End
/// to end, 64 against 128: pp96 +19-33% and pp64 -6% to +12% in four alternating rounds; 32
/// made pp32 12-29% slower
/// (`docs/benchmark_results/cpu-prefetch-epyc-h200host-2026-12-01.md`; 128 before:
/// `cpu-amx-blocks-h200host-2026-11-30.md`).
pub const AMX_MIN_TOKENS: usize = 64;

/// Why [`matmul`] did not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmxError {
    /// The hardware backend was asked for on a CPU or OS without AMX-INT8.
    #[error("AMX-INT8 is not available (needs CPUID amx_tile + amx_int8 and Linux XTILEDATA permission)")]
    NotAvailable,
    /// The weights have sub-scales (Q6_K, Q3_K), which these tiles do not take: the interleaved
    /// VNNI kernel runs them.
    #[error("weights with sub-scales (Q6_K, Q3_K) have no AMX kernel")]
    SubScales,
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

static HARDWARE_MATMULS: AtomicU64 = AtomicU64::new(0);
static EMULATED_MATMULS: AtomicU64 = AtomicU64::new(0);

/// How many matmuls have run on the emulated AMX-INT8 tiles in this process (for tests that
/// check the dispatch where the hardware is missing).
pub fn emulated_matmul_count() -> u64 {
    EMULATED_MATMULS.load(Ordering::Relaxed)
}

/// How many matmuls have run on the hardware AMX tiles in this process (for metrics and for
/// tests that check the dispatch).
pub fn hardware_matmul_count() -> u64 {
    HARDWARE_MATMULS.load(Ordering::Relaxed)
}

/// `y[t, r] = dot(weights[r], activations[t])` (`y` is `[num_tokens, out_features]`,
/// overwritten), bit-identical to [`crate::linear::cpu::interleaved::matmul`]. Weight rows are split
/// into tasks of 16 (one A tile) run in parallel. Fails, writing nothing, on weights with sub-scales, a shape mismatch
/// or when `backend` is [`TileBackend::Hardware`] and [`is_available`] is false.
pub fn matmul(
    backend: TileBackend,
    weights: &Interleaved,
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
    if weights.has_sub_scales() {
        return Err(AmxError::SubScales);
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
                 (bit-identical to vnni8, which runs fewer tokens)"
            )
        });
        HARDWARE_MATMULS.fetch_add(1, Ordering::Relaxed);
    } else {
        EMULATED_MATMULS.fetch_add(1, Ordering::Relaxed);
    }
    if n == 0 || num_tokens == 0 || weights.blocks_per_row() == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let starts = crate::linear::cpu::interleaved::block_starts(weights, activations);
    let prepared = kernel::Activations::new(activations, &starts);
    crate::linear::cpu::tasks::by_row_tasks(n, num_tokens, kernel::TILE_ROWS, y, |range| {
        let chunk = range.start / kernel::TILE_ROWS;
        let mut local = vec![0f32; range.len() * num_tokens];
        match backend {
            TileBackend::Emulated => kernel::with_weight_tiles(|weight_tiles| {
                kernel::row_chunk(
                    &mut tiles::EmulatedTiles::default(),
                    weights,
                    &prepared,
                    weight_tiles,
                    chunk,
                    &mut local,
                )
            }),
            TileBackend::Hardware => hardware::row_chunk(weights, &prepared, chunk, &mut local),
        }
        local
    });
    Ok(())
}
