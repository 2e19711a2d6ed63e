//! Batched GPU sampling from logits: greedy argmax, Gumbel-max and sorting-free dual-pivot
//! rejection for top-k / top-p / min-p; the GPU port of `pagoda_ops::sampling::FusedSampler`.
//!
//! One call of [`sample_rows`] samples every row of a `[rows, vocab]` f32 logit matrix (the
//! logits already penalised) with per-row parameters read from device memory
//! ([`SamplingRowParams`], 8 u32 words per row), in four launches and no host
//! synchronisation: the grid depends only on `(rows, vocab, splits)`, every parameter
//! (temperature, filters, seed, step) is read on the device, so a CUDA graph captured once
//! replays with new logits and parameters in the same buffers.
//!
//! 1. `sampling_row_max` (grid `splits x rows`): per-split maximum and lowest index.
//! 2. `sampling_gumbel` (grid `splits x rows`, unfiltered rows only): the split's best
//!    `(z - z_max) * (1/T) + g` with `g` the Gumbel noise of Philox word `i` of
//!    `(seed, step, Gumbel)`; ties to the lowest id, so the token does not depend on the split.
//! 3. `sampling_filtered` (one 1024-thread CTA per filtered row): dual-pivot rejection in logit
//!    space with f64 weights computed on the fly (no probability array, no sort); top-k folded
//!    in by an exact radix select, min-p by its exact f32 threshold; at most
//!    `max_rejection_rounds` rounds, then (or on an ambiguous top-p test) the counted exact
//!    fallback: the chain's support threshold by bisection of the f32 bit order, and an
//!    inverse-CDF draw with the `(seed, step, Fallback)` uniform.
//! 4. `sampling_finalize` (one warp per row): greedy and Gumbel tokens, per-row stats.
//!
//! Per-row stats (`{path, rounds}`) and running totals (device atomics) stay in the
//! [`SamplingWorkspace`]; nothing is read back inside a step.
//!
//! # Same tokens as the CPU `FusedSampler`
//!
//! - Greedy rows: always the same token (argmax, lowest id on ties, 0 without a finite logit).
//! - Gumbel rows: always the same token. The noise (`gumbel_noise`, `ln_f32`), `1/T` (f64
//!   division rounded to f32) and the score are ported operation for operation with explicit
//!   round-to-nearest intrinsics (no FMA contraction), so every score is bit-identical.
//! - Filtered rows: the same token except when an f64 sum lands within a few ulps of a
//!   decision boundary (probability of order `vocab * 2^-52` per draw): the GPU sums weights
//!   in warp/tree order, the CPU in id order, so (a) the inverse-CDF walk can pick the
//!   neighbouring token when the uniform target lies within rounding of a cumulative sum,
//!   (b) a top-p test within the ambiguity margin on one side only sends one of them to the
//!   fallback; (c) the min-p threshold uses CUDA's `exp`/`log` where the CPU uses libm
//!   (differs only if a logit sits within an ulp of the threshold); (d) the fallbacks draw with
//!   the same uniform over the same support, but the CPU weights use libm `exp`, the GPU
//!   `exp_f64`. The distribution is exact in every case.

mod params;

pub use params::{
    decode_row_stats, encode_row_params, plan_sampling, sampling_splits, RowPath, RowSamplingStats,
    SamplingOptions, SamplingPlan, SamplingRowParams, SamplingShapes, SamplingTotals,
    DEFAULT_MAX_REJECTION_ROUNDS, MAX_SAMPLING_ROWS, MAX_SAMPLING_SPLITS, SAMPLING_PARAM_WORDS,
    SAMPLING_TOTALS_WORDS,
};

use super::SAMPLING;
use crate::error::CudaError;
use crate::key::{DType, KernelSpec};
use crate::memory::{ptr, DeviceRead, DeviceWrite, KernelArg, LaunchDims};
use crate::{DeviceBuffer, Gpu};

/// The entry points of the sampling kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplingEntry {
    /// `sampling_row_max`: per-split row maxima.
    RowMax,
    /// `sampling_gumbel`: per-split Gumbel-max partials of unfiltered rows.
    Gumbel,
    /// `sampling_filtered`: dual-pivot rejection of filtered rows.
    Filtered,
    /// `sampling_finalize`: greedy / Gumbel tokens and stats.
    Finalize,
}

impl SamplingEntry {
    /// Every entry, in launch order.
    pub const ALL: [SamplingEntry; 4] = [
        SamplingEntry::RowMax,
        SamplingEntry::Gumbel,
        SamplingEntry::Filtered,
        SamplingEntry::Finalize,
    ];
}

/// The specialisation of `entry` (f32 logits, u32 ids and parameter words).
pub fn specialize_sampling(entry: SamplingEntry) -> KernelSpec {
    let name = match entry {
        SamplingEntry::RowMax => "sampling_row_max",
        SamplingEntry::Gumbel => "sampling_gumbel",
        SamplingEntry::Filtered => "sampling_filtered",
        SamplingEntry::Finalize => "sampling_finalize",
    };
    KernelSpec {
        source: &SAMPLING,
        entry: name,
        params: vec![],
        dtypes: vec![("LOGITS_T", DType::F32), ("IDS_T", DType::U32)],
    }
}

/// Device scratch of [`sample_rows`], allocated once for at most `max_rows` rows of at most
/// `vocab` logits: per-split partials, the per-row stats of the last launch and the running
/// totals.
pub struct SamplingWorkspace {
    partial_max: DeviceBuffer<f32>,
    partial_index: DeviceBuffer<u32>,
    partial_score: DeviceBuffer<f32>,
    partial_id: DeviceBuffer<u32>,
    row_stats: DeviceBuffer<u32>,
    totals: DeviceBuffer<u32>,
    max_rows: usize,
    vocab: usize,
}

impl SamplingWorkspace {
    /// Room for launches of at most `max_rows` rows (`1..=MAX_SAMPLING_ROWS`) of at most
    /// `vocab` logits; totals start at zero.
    pub fn new(gpu: &Gpu, max_rows: usize, vocab: usize) -> Result<Self, CudaError> {
        if max_rows == 0 || max_rows > MAX_SAMPLING_ROWS || vocab == 0 || vocab >= u32::MAX as usize
        {
            return Err(CudaError::invalid(format!(
                "sampling workspace: max_rows {max_rows} must be in 1..={MAX_SAMPLING_ROWS} and \
                 vocab {vocab} in 1..u32::MAX"
            )));
        }
        let partials = max_rows * MAX_SAMPLING_SPLITS;
        Ok(SamplingWorkspace {
            partial_max: gpu.alloc(partials)?,
            partial_index: gpu.alloc(partials)?,
            partial_score: gpu.alloc(partials)?,
            partial_id: gpu.alloc(partials)?,
            row_stats: gpu.zeros(2 * max_rows)?,
            totals: gpu.zeros(SAMPLING_TOTALS_WORDS)?,
            max_rows,
            vocab,
        })
    }

    /// Rows a launch may have.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Largest vocabulary a launch may have.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        4 * (4 * self.partial_max.len() + self.row_stats.len() + self.totals.len())
    }

    /// `[max_rows, 2]` u32: `{path code, rounds}` of each row of the last launch (rows beyond
    /// it keep older values). Decode with [`decode_row_stats`].
    pub fn row_stats(&self) -> &DeviceBuffer<u32> {
        &self.row_stats
    }

    /// The [`SAMPLING_TOTALS_WORDS`] words of the running totals (decode with
    /// [`SamplingTotals::from_words`]).
    pub fn totals(&self) -> &DeviceBuffer<u32> {
        &self.totals
    }

    /// Downloads (synchronously: off the hot path) the stats of the first `rows` rows.
    pub fn read_row_stats(
        &self,
        gpu: &Gpu,
        rows: usize,
    ) -> Result<Vec<RowSamplingStats>, CudaError> {
        if rows > self.max_rows {
            return Err(CudaError::invalid(format!(
                "sampling stats: {rows} rows > workspace {}",
                self.max_rows
            )));
        }
        let words = gpu.download(&self.row_stats)?;
        decode_row_stats(&words[..2 * rows])
    }

    /// Downloads (synchronously: off the hot path) the running totals.
    pub fn read_totals(&self, gpu: &Gpu) -> Result<SamplingTotals, CudaError> {
        SamplingTotals::from_words(&gpu.download(&self.totals)?)
    }

    /// Sets the running totals back to zero (enqueued on the stream).
    pub fn reset_totals(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        gpu.fill_bytes(&mut self.totals, 0)
    }
}

/// [`sample_rows_with`] with the default options (automatic splits, the default round cap).
pub fn sample_rows(
    gpu: &Gpu,
    logits: &impl DeviceRead<f32>,
    vocab: usize,
    params: &impl DeviceRead<u32>,
    workspace: &mut SamplingWorkspace,
    tokens_out: &mut impl DeviceWrite<u32>,
) -> Result<(), CudaError> {
    sample_rows_with(
        gpu,
        logits,
        vocab,
        params,
        workspace,
        tokens_out,
        SamplingOptions::default(),
    )
}

/// Samples one token per row: `logits` `[rows, vocab]` f32 (penalised; NaN = masked, `+inf`
/// = `f32::MAX`), `params` `[rows, 8]` u32 ([`encode_row_params`]), `tokens_out` `[rows]`
/// u32 (`rows = tokens_out.len()`, fully overwritten). Shapes are checked on the host
/// ([`plan_sampling`]); the launches are enqueued on the GPU's stream and nothing is
/// synchronised. The workspace's row stats are overwritten and its totals accumulate.
pub fn sample_rows_with(
    gpu: &Gpu,
    logits: &impl DeviceRead<f32>,
    vocab: usize,
    params: &impl DeviceRead<u32>,
    workspace: &mut SamplingWorkspace,
    tokens_out: &mut impl DeviceWrite<u32>,
    options: SamplingOptions,
) -> Result<(), CudaError> {
    let shapes = SamplingShapes {
        vocab,
        logits_len: logits.len(),
        params_len: params.len(),
        tokens_len: tokens_out.len(),
        workspace_rows: workspace.max_rows,
        workspace_vocab: workspace.vocab,
    };
    let plan = plan_sampling(shapes, options, gpu.info().sm_count as usize)?;
    if plan.rows == 0 {
        return Ok(());
    }
    let (rows, splits) = (plan.rows as u32, plan.num_splits as u32);
    let vocab = KernelArg::U32(vocab as u32);
    let splits_arg = KernelArg::U32(splits);
    let ws = &*workspace;
    let row_max = [
        ptr(logits),
        vocab,
        splits_arg,
        ptr(&ws.partial_max),
        ptr(&ws.partial_index),
    ];
    // SAFETY: arguments match `sampling_row_max`; lengths validated by `plan_sampling`, the
    // partials hold max_rows * MAX_SAMPLING_SPLITS entries.
    unsafe {
        gpu.launch(
            &specialize_sampling(SamplingEntry::RowMax),
            LaunchDims::new((splits, rows), 256),
            &row_max,
        )?;
    }
    let gumbel = [
        ptr(logits),
        ptr(params),
        vocab,
        splits_arg,
        ptr(&ws.partial_max),
        ptr(&ws.partial_index),
        ptr(&ws.partial_score),
        ptr(&ws.partial_id),
    ];
    // SAFETY: arguments match `sampling_gumbel`; as above.
    unsafe {
        gpu.launch(
            &specialize_sampling(SamplingEntry::Gumbel),
            LaunchDims::new((splits, rows), 256),
            &gumbel,
        )?;
    }
    let filtered = [
        ptr(logits),
        ptr(params),
        vocab,
        splits_arg,
        ptr(&ws.partial_max),
        ptr(&ws.partial_index),
        KernelArg::U32(options.max_rejection_rounds),
        ptr(tokens_out),
        ptr(&ws.row_stats),
        ptr(&ws.totals),
    ];
    // SAFETY: arguments match `sampling_filtered`; tokens_out has `rows` entries, the stats
    // 2 * max_rows >= 2 * rows.
    unsafe {
        gpu.launch(
            &specialize_sampling(SamplingEntry::Filtered),
            LaunchDims::new((rows, 1), 1024),
            &filtered,
        )?;
    }
    let finalize = [
        ptr(params),
        vocab,
        splits_arg,
        ptr(&ws.partial_max),
        ptr(&ws.partial_index),
        ptr(&ws.partial_score),
        ptr(&ws.partial_id),
        ptr(tokens_out),
        ptr(&ws.row_stats),
        ptr(&ws.totals),
    ];
    // SAFETY: arguments match `sampling_finalize`; as above.
    unsafe {
        gpu.launch(
            &specialize_sampling(SamplingEntry::Finalize),
            LaunchDims::new((rows, 1), 32),
            &finalize,
        )
    }
}
