//! Batched GPU sampling from logits: greedy argmax, Gumbel-max and sorting-free dual-pivot
//! rejection for top-k / top-p / min-p; the GPU port of `pagoda_ops::sampling::FusedSampler`.
//!
//! One call of [`sample_rows`] samples every row of a `[rows, vocab]` f32 logit matrix (the
//! logits already penalised) with per-row parameters read from device memory
//! ([`SamplingRowParams`], 8 u32 words per row), with no host synchronisation: the launches
//! depend only on `(rows, vocab, splits)` and the options, every parameter (temperature,
//! filters, seed, step) is read on the device, so a CUDA graph captured once replays with new
//! logits and parameters in the same buffers. Every row is split over `splits` CTAs
//! (grid `splits x rows`); the last CTA of a row to finish a pass (an atomic ticket) reduces
//! the row's partials and writes its state for the next launch.
//!
//! 1. `sampling_row_max`: per-split maximum and lowest index; the row's last CTA sets up its
//!    filter state (min-p's exact f32 threshold, the top-k select pending).
//! 2. `sampling_top_k_digit` x 4 (only with top-k rows): an exact radix select of the k-th
//!    largest logit, 8 bits per launch, from per-row histograms; a row whose k-th largest is
//!    the smallest logit of its bin is done early (usually after three).
//!    Skipped when the launch has no filtered rows ([`SamplingOptions::gumbel_max`]):
//!    `sampling_gumbel` then finds every row's maximum, keeps each split's few Gumbel
//!    candidates by approximate scores that need no maximum, and `sampling_finish` scores
//!    them exactly.
//! 3. `sampling_gumbel` (only with unfiltered rows): the split's best Gumbel-max score
//!    `(z - z_max) * (1/T) + g` with `g` the Gumbel noise of Philox word `i` of
//!    `(seed, step, Gumbel)` (ties to the lowest id, so the token does not depend on the
//!    split); the noise is first computed with fast logarithms, and exactly only for the few
//!    ids whose approximate score is within its error bound of the best.
//!    `sampling_pass` (only with filtered rows): the top-k mass (f32 weights) and the
//!    proposal's per-segment masses (f64), then (last CTA) the first candidate by an
//!    inverse-CDF walk.
//! 4. `sampling_round` x a few (only with filtered rows): the masses above the two pivots of
//!    dual-pivot rejection, the verdicts and the next candidate.
//! 5. `sampling_finish` (one 1024-thread CTA per row): greedy and Gumbel tokens, and every
//!    filtered row the fast rounds did not finish drawn by the exact kernel (f64 weights,
//!    pagoda_ops' algorithm step for step, at most `max_rejection_rounds` rounds, then the
//!    counted exact fallback). The fast path leaves to it every decision within a relative
//!    2e-5 of its boundary, so it only ever returns the exact kernel's token.
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
//!   `exp_f64`. The distribution is exact in every case. These are the exact kernel's
//!   tokens; the fast path returns the exact kernel's token for every row it finishes (each
//!   decision it cannot make with certainty goes to the exact kernel), so the same holds.

mod cluster;
mod entries;
mod mask;
mod params;
mod splits;

pub use params::{
    decode_row_stats, default_fast_rounds, encode_row_params, filter_splits, plan_sampling,
    sampling_splits, FilteredSampling, RowPath, RowSamplingStats, SamplingMix, SamplingOptions,
    SamplingPlan, SamplingRowParams, SamplingShapes, SamplingTotals, DEFAULT_MAX_REJECTION_ROUNDS,
    LIST_CAPACITY, MAX_SAMPLING_ROWS, MAX_SAMPLING_SPLITS, SAMPLING_PARAM_WORDS,
    SAMPLING_TOTALS_WORDS,
};

pub use cluster::{specialize_cluster, ClusterShape, SmBudget};
pub use entries::{specializations, specialize_sampling, SamplingEntry};

/// The hash of the sampling kernels' source, for the tuning table's key (split counts are
/// tuned against it).
pub(crate) fn tuned_sources_hash() -> u64 {
    entries::SAMPLING.source_hash()
}
pub use mask::apply_token_masks;

use cluster::{launch_cluster, ClusterLaunch};

use pagoda_cuda::{
    ptr, CudaError, DeviceBuffer, DeviceRead, DeviceWrite, Gpu, KernelArg, LaunchDims,
};

/// Words of one row's filter state (`FILTER_STATE_WORDS` in the kernels).
const FILTER_STATE_WORDS: usize = 16;
/// Segments (warps) per split CTA (`SEGMENTS` in the kernels).
const SEGMENTS: usize = 8;
/// Bins of a top-k digit (`TOP_K_BINS` in the kernels).
const TOP_K_BINS: usize = 256;
/// The shifts of the top-k radix select's 8-bit digit launches, most significant first; the
/// first digit (bits 24-31) is counted by `sampling_row_max` in its pass over the row. A
/// 12-bit digit (4096 bins) measured about 2.7x slower per launch at batch 64, so 12/10/10
/// or 8/12/12 digits cost more than 8-bit ones, of which the early stop usually spares the
/// last.
const TOP_K_SHIFTS: [u32; 3] = [16, 8, 0];
/// Threads of a split CTA and of a finish CTA.
const SPLIT_THREADS: u32 = 256;
const FINISH_THREADS: u32 = 1024;
/// Launch flags (`FLAG_*` in the kernels).
const FLAG_FAST: u32 = 1;
const FLAG_TOP_K: u32 = 2;
const FLAG_GUMBEL: u32 = 4;
const FLAG_GUMBEL_MAX: u32 = 8;
/// Candidate ids a split of `sampling_gumbel` keeps with `FLAG_GUMBEL_MAX`
/// (`GUMBEL_SPLIT_KEPT` in the kernels).
const GUMBEL_SPLIT_KEPT: usize = 8;

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
    /// `[max_rows, FILTER_STATE_WORDS]` filter state.
    state: DeviceBuffer<u32>,
    /// `[max_rows]` arrival tickets of the last-CTA reductions (zero between launches).
    arrive: DeviceBuffer<u32>,
    /// `[max_rows, TOP_K_BINS]` top-k digit histograms (zero between launches).
    histogram: DeviceBuffer<u32>,
    /// `[max_rows, MAX_SAMPLING_SPLITS, 2]` f64 (as u32 pairs) per-split masses.
    split_mass: DeviceBuffer<u32>,
    /// `[max_rows, MAX_SAMPLING_SPLITS * SEGMENTS]` f64 (as u32 pairs) per-segment masses.
    segment_draw0: DeviceBuffer<u32>,
    segment_draw1: DeviceBuffer<u32>,
    /// `[max_rows, MAX_SAMPLING_SPLITS, GUMBEL_SPLIT_KEPT]` Gumbel candidate ids and
    /// `[max_rows, MAX_SAMPLING_SPLITS]` their counts (`FLAG_GUMBEL_MAX`).
    gumbel_ids: DeviceBuffer<u32>,
    gumbel_count: DeviceBuffer<u32>,
    /// `[max_rows, LIST_CAPACITY]` ids of short proposals and `[max_rows]` their counts
    /// (zero between launches).
    list_ids: DeviceBuffer<u32>,
    list_count: DeviceBuffer<u32>,
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
            state: gpu.zeros(max_rows * FILTER_STATE_WORDS)?,
            arrive: gpu.zeros(max_rows)?,
            histogram: gpu.zeros(max_rows * TOP_K_BINS)?,
            split_mass: gpu.zeros(max_rows * MAX_SAMPLING_SPLITS * 2 * 2)?,
            segment_draw0: gpu.zeros(max_rows * MAX_SAMPLING_SPLITS * SEGMENTS * 2)?,
            segment_draw1: gpu.zeros(max_rows * MAX_SAMPLING_SPLITS * SEGMENTS * 2)?,
            gumbel_ids: gpu.zeros(partials * GUMBEL_SPLIT_KEPT)?,
            gumbel_count: gpu.zeros(partials)?,
            list_ids: gpu.alloc(max_rows * LIST_CAPACITY)?,
            list_count: gpu.zeros(max_rows)?,
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
        4 * (4 * self.partial_max.len()
            + self.row_stats.len()
            + self.totals.len()
            + self.state.len()
            + self.arrive.len()
            + self.histogram.len()
            + self.split_mass.len()
            + self.segment_draw0.len()
            + self.segment_draw1.len()
            + self.gumbel_ids.len()
            + self.gumbel_count.len()
            + self.list_ids.len()
            + self.list_count.len())
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
    let mix = options.mix;
    let fast = options.filtered == FilteredSampling::Fast && mix.filtered;
    // Top-p launches without top-k rows: one cluster per row runs the row maximum and the
    // whole fast path.
    let cluster = options.runs_cluster(vocab, gpu.info().compute_capability);
    let mut flags = 0;
    if fast {
        flags |= FLAG_FAST;
        if mix.top_k {
            flags |= FLAG_TOP_K;
        }
    }
    if mix.gumbel {
        flags |= FLAG_GUMBEL;
    }
    // Only greedy and Gumbel rows: the Gumbel kernel finds the row maxima, no row-max pass.
    let gumbel_max = mix.gumbel && !mix.filtered && options.gumbel_max;
    if gumbel_max {
        flags |= FLAG_GUMBEL_MAX;
    }
    let vocab_len = vocab;
    let vocab = KernelArg::U32(vocab as u32);
    let splits_arg = KernelArg::U32(splits);
    let flags_arg = KernelArg::U32(flags);
    let max_rounds = KernelArg::U32(options.max_rejection_rounds);
    let split_grid = LaunchDims::new((splits, rows), SPLIT_THREADS);
    let filter_splits = plan.filter_splits as u32;
    let filter_splits_arg = KernelArg::U32(filter_splits);
    let filter_grid = LaunchDims::new((filter_splits, rows), SPLIT_THREADS);
    let ws = &*workspace;
    if cluster {
        launch_cluster(
            gpu,
            ClusterLaunch {
                logits,
                params,
                tokens_out: &mut *tokens_out,
                workspace: ws,
            },
            vocab_len,
            (rows, flags),
            &options,
        )?;
    } else if !gumbel_max {
        let row_max = [
            ptr(logits),
            ptr(params),
            vocab,
            splits_arg,
            flags_arg,
            ptr(&ws.partial_max),
            ptr(&ws.partial_index),
            ptr(&ws.state),
            ptr(&ws.arrive),
            ptr(&ws.histogram),
        ];
        // SAFETY (every launch below): the arguments match the kernel's signature in
        // kernels/sampling_*.cu; lengths were validated by `plan_sampling` (logits rows x
        // vocab, params rows x 8, tokens rows) and the workspace holds max_rows >= rows rows of
        // every per-row array with MAX_SAMPLING_SPLITS >= splits splits.
        unsafe {
            gpu.launch(
                &specialize_sampling(SamplingEntry::RowMax),
                split_grid,
                &row_max,
            )?;
        }
    }
    if flags & FLAG_TOP_K != 0 {
        for shift in TOP_K_SHIFTS {
            let digit = [
                ptr(logits),
                ptr(params),
                vocab,
                filter_splits_arg,
                KernelArg::U32(shift),
                ptr(&ws.state),
                ptr(&ws.histogram),
                ptr(&ws.arrive),
            ];
            // SAFETY: as above.
            unsafe {
                gpu.launch(
                    &specialize_sampling(SamplingEntry::TopKDigit),
                    filter_grid,
                    &digit,
                )?;
            }
        }
    }
    if flags & FLAG_GUMBEL != 0 {
        let gumbel = [
            ptr(logits),
            ptr(params),
            vocab,
            splits_arg,
            flags_arg,
            ptr(&ws.state),
            ptr(&ws.partial_score),
            ptr(&ws.partial_id),
            ptr(&ws.partial_max),
            ptr(&ws.partial_index),
            ptr(&ws.gumbel_ids),
            ptr(&ws.gumbel_count),
        ];
        // SAFETY: as above.
        unsafe {
            gpu.launch(
                &specialize_sampling(SamplingEntry::Gumbel),
                split_grid,
                &gumbel,
            )?;
        }
    }
    // Only rows with a top-k threshold fill lists, so lists exist only with FLAG_TOP_K; the
    // list kernel then reads them (and zeroes their counts).
    let listed = fast && flags & FLAG_TOP_K != 0 && options.list_rounds;
    if fast && !cluster {
        let mut pass = vec![
            ptr(logits),
            ptr(params),
            vocab,
            filter_splits_arg,
            max_rounds,
            ptr(&ws.state),
            ptr(&ws.split_mass),
            ptr(&ws.segment_draw0),
            ptr(&ws.arrive),
            ptr(tokens_out),
            ptr(&ws.row_stats),
            ptr(&ws.totals),
        ];
        let entry = if listed {
            pass.extend([ptr(&ws.list_ids), ptr(&ws.list_count)]);
            SamplingEntry::PassListed
        } else {
            SamplingEntry::Pass
        };
        // SAFETY: as above; list_ids holds max_rows x LIST_CAPACITY ids.
        unsafe {
            gpu.launch(&specialize_sampling(entry), filter_grid, &pass)?;
        }
    }
    if listed {
        let list = [
            ptr(logits),
            ptr(params),
            vocab,
            max_rounds,
            ptr(&ws.state),
            ptr(&ws.list_ids),
            ptr(&ws.list_count),
            ptr(tokens_out),
            ptr(&ws.row_stats),
            ptr(&ws.totals),
        ];
        // SAFETY: as above.
        unsafe {
            gpu.launch(
                &specialize_sampling(SamplingEntry::ListRounds),
                LaunchDims::new((rows, 1), LIST_CAPACITY as u32),
                &list,
            )?;
        }
    }
    if fast && !cluster {
        // Only top-p rows can need round launches, and with the lists only those off them
        // (see SamplingMix).
        let rounds = if mix.top_p && (mix.unlisted_top_p || !listed) {
            options
                .fast_rounds
                .unwrap_or_else(|| default_fast_rounds(plan.rows))
        } else {
            0
        };
        let round = [
            ptr(logits),
            ptr(params),
            vocab,
            filter_splits_arg,
            max_rounds,
            ptr(&ws.state),
            ptr(&ws.split_mass),
            ptr(&ws.segment_draw0),
            ptr(&ws.segment_draw1),
            ptr(&ws.arrive),
            ptr(tokens_out),
            ptr(&ws.row_stats),
            ptr(&ws.totals),
        ];
        for _ in 0..rounds {
            // SAFETY: as above.
            unsafe {
                gpu.launch(
                    &specialize_sampling(SamplingEntry::Round),
                    filter_grid,
                    &round,
                )?;
            }
        }
    }
    let finish = [
        ptr(logits),
        ptr(params),
        vocab,
        splits_arg,
        flags_arg,
        max_rounds,
        ptr(&ws.partial_score),
        ptr(&ws.partial_id),
        ptr(&ws.partial_max),
        ptr(&ws.partial_index),
        ptr(&ws.gumbel_ids),
        ptr(&ws.gumbel_count),
        ptr(&ws.state),
        ptr(tokens_out),
        ptr(&ws.row_stats),
        ptr(&ws.totals),
    ];
    // SAFETY: as above.
    unsafe {
        gpu.launch(
            &specialize_sampling(SamplingEntry::Finish),
            LaunchDims {
                // After the cluster kernel (compute capability 9.0+), a programmatic launch:
                // the driver readies it while the cluster kernel's last CTAs finish, and it
                // waits for them (`griddepcontrol.wait`). 0.1-0.3 us per call on the H200.
                programmatic: cluster,
                ..LaunchDims::new((rows, 1), FINISH_THREADS)
            },
            &finish,
        )
    }
}
