//! Host-side pure logic of GPU sampling: the per-row parameter record, its validation and
//! encoding, the split choice, launch planning and the decoding of the device counters.
//! Everything here runs on the CPU (unit-tested without a GPU).

use super::cluster::{cluster_fits, ClusterShape};
use pagoda_cuda::CudaError;

pub use super::splits::{filter_splits, sampling_splits};

/// Words (u32) of one [`SamplingRowParams`] record in device memory.
pub const SAMPLING_PARAM_WORDS: usize = 8;

/// Largest number of CTAs the Gumbel / row-max kernels split one row into.
pub const MAX_SAMPLING_SPLITS: usize = 128;

/// Default round cap of the dual-pivot loop; equal to pagoda-ops'
/// `DEFAULT_MAX_REJECTION_ROUNDS` (a GPU test checks it), so the GPU and the CPU fall back on
/// the same rows.
pub const DEFAULT_MAX_REJECTION_ROUNDS: u32 = 34;

/// Largest rows per launch (the split kernels put rows on grid y).
pub const MAX_SAMPLING_ROWS: usize = 65535;

/// One row's sampling parameters as the kernels read them (`#[repr(C)]`, 8 u32 words, see
/// [`SamplingRowParams::to_words`]). Semantics are those of `pagoda_ops::sampling`'s canonical
/// chain applied to already penalised logits: greedy when `temperature == 0` or `top_k == 1`
/// (argmax, lowest id on ties, no randomness); filters on the untempered distribution
/// (`top_k` 0 = off, `>= vocab` keeps all; `top_p` 1 = off, measured over the top-k set
/// renormalised; `min_p` 0 = off); temperature last. Randomness is Philox-4x32-10 keyed by
/// `seed`, counter `(index, step, purpose)`, exactly as `FusedSampler` at call number `step`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct SamplingRowParams {
    /// Divisor of the surviving logits; `0.0` = greedy. Finite, in `[0, 100]`.
    pub temperature: f32,
    /// Top-k (0 = off, 1 = greedy).
    pub top_k: u32,
    /// Top-p in `(0, 1]` (1 = off).
    pub top_p: f32,
    /// Min-p in `[0, 1]` (0 = off).
    pub min_p: f32,
    /// Low 32 bits of the request seed (Philox key word 0).
    pub seed_low: u32,
    /// High 32 bits of the request seed (Philox key word 1).
    pub seed_high: u32,
    /// Low 32 bits of the request's sample-call number.
    pub step_low: u32,
    /// High 32 bits of the request's sample-call number.
    pub step_high: u32,
}

impl SamplingRowParams {
    /// The same row drawn `offset` sample calls later (a guessed row of speculative
    /// decoding draws at the step plain decoding would give it).
    pub fn at_later_step(self, offset: u64) -> Self {
        let step = ((self.step_high as u64) << 32 | self.step_low as u64) + offset;
        SamplingRowParams {
            step_low: step as u32,
            step_high: (step >> 32) as u32,
            ..self
        }
    }

    /// A validated record (see [`validate`](Self::validate)) for call `step` of a request
    /// seeded `seed`. `top_k` above `u32::MAX` should be passed as 0 (off).
    pub fn new(
        temperature: f32,
        top_k: u32,
        top_p: f32,
        min_p: f32,
        seed: u64,
        step: u64,
    ) -> Result<Self, CudaError> {
        let params = SamplingRowParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed_low: seed as u32,
            seed_high: (seed >> 32) as u32,
            step_low: step as u32,
            step_high: (step >> 32) as u32,
        };
        params.validate()?;
        Ok(params)
    }

    /// Greedy decoding (temperature 0, filters off, seed 0, step 0).
    pub fn greedy() -> Self {
        SamplingRowParams {
            top_p: 1.0,
            ..SamplingRowParams::default()
        }
    }

    /// The 64-bit seed.
    pub fn seed(&self) -> u64 {
        ((self.seed_high as u64) << 32) | self.seed_low as u64
    }

    /// The 64-bit step.
    pub fn step(&self) -> u64 {
        ((self.step_high as u64) << 32) | self.step_low as u64
    }

    /// The same record at another step.
    pub fn with_step(self, step: u64) -> Self {
        SamplingRowParams {
            step_low: step as u32,
            step_high: (step >> 32) as u32,
            ..self
        }
    }

    /// Checks the ranges of `pagoda_ops::SamplingParams::validate` (temperature finite in
    /// `[0, 100]`, top_p in `(0, 1]`, min_p in `[0, 1]`); the error names the field and value.
    /// (The kernels never read out of bounds on any bits, but only validated records have the
    /// documented meaning.)
    pub fn validate(&self) -> Result<(), CudaError> {
        let temperature = self.temperature;
        if !temperature.is_finite() || !(0.0..=100.0).contains(&temperature) {
            return Err(CudaError::invalid(format!(
                "sampling temperature must be finite and in [0, 100], got {temperature}"
            )));
        }
        let top_p = self.top_p;
        if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
            return Err(CudaError::invalid(format!(
                "sampling top_p must be in (0, 1] (1 disables it), got {top_p}"
            )));
        }
        let min_p = self.min_p;
        if !min_p.is_finite() || !(0.0..=1.0).contains(&min_p) {
            return Err(CudaError::invalid(format!(
                "sampling min_p must be in [0, 1] (0 disables it), got {min_p}"
            )));
        }
        Ok(())
    }

    /// The record as the kernels read it: `[temperature bits, top_k, top_p bits, min_p bits,
    /// seed_low, seed_high, step_low, step_high]`.
    pub fn to_words(&self) -> [u32; SAMPLING_PARAM_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.seed_low,
            self.seed_high,
            self.step_low,
            self.step_high,
        ]
    }
}

/// Validates every record and concatenates their words (`rows.len() * 8` u32, upload them
/// as the `params` of [`sample_rows`](super::sample_rows)); the error names the row.
pub fn encode_row_params(rows: &[SamplingRowParams]) -> Result<Vec<u32>, CudaError> {
    let mut words = Vec::with_capacity(rows.len() * SAMPLING_PARAM_WORDS);
    for (row, params) in rows.iter().enumerate() {
        params
            .validate()
            .map_err(|error| CudaError::invalid(format!("sampling row {row}: {error}")))?;
        words.extend_from_slice(&params.to_words());
    }
    Ok(words)
}

/// How filtered rows (top-k / top-p / min-p) are drawn. Both give the same tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FilteredSampling {
    /// The multi-CTA pipeline (every row split over many CTAs, f32 weights, a few round
    /// launches); a row it cannot decide with certainty goes to the exact kernel.
    Fast,
    /// One 1024-thread CTA per row with f64 weights (the oracle).
    Exact,
}

impl FilteredSampling {
    /// Parses `fast` / `exact` (the `PAGODA_GPU_SAMPLING_FILTERED` values).
    pub fn parse(value: &str) -> Result<Self, CudaError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "fast" => Ok(FilteredSampling::Fast),
            "exact" => Ok(FilteredSampling::Exact),
            other => Err(CudaError::invalid(format!(
                "filtered GPU sampling must be `fast` or `exact`, got `{other}`"
            ))),
        }
    }

    /// The name `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            FilteredSampling::Fast => "fast",
            FilteredSampling::Exact => "exact",
        }
    }
}

/// Which kinds of rows a launch holds, so stages nobody needs are not launched. A row of a
/// kind the mix leaves out is still sampled correctly, on the slower single-CTA path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SamplingMix {
    /// Some row is sampled by Gumbel-max (temperature > 0, no filter).
    pub gumbel: bool,
    /// Some row has a filter (top-k, top-p or min-p).
    pub filtered: bool,
    /// Some filtered row has top-k.
    pub top_k: bool,
    /// Some filtered row has top-p. Only such rows can need the round launches: a row
    /// without top-p accepts its first candidate.
    pub top_p: bool,
    /// Some row has top-p without a top-k of at most [`LIST_CAPACITY`]. With the list rounds
    /// on, only such rows need the round launches (a listed row's rounds run on its list).
    /// A launch that needs none has no round launches; a row that still needs rounds (a list
    /// that overflowed on ties, fewer than k finite logits) is drawn by the exact kernel, with
    /// the same token.
    pub unlisted_top_p: bool,
}

/// Ids of a row's list and threads of `sampling_list_rounds` (`LIST_CAPACITY`,
/// `LIST_THREADS` in the kernels).
pub const LIST_CAPACITY: usize = 512;

impl SamplingMix {
    /// No stage launched (a launch of greedy rows only).
    pub const NONE: SamplingMix = SamplingMix {
        gumbel: false,
        filtered: false,
        top_k: false,
        top_p: false,
        unlisted_top_p: false,
    };

    /// Every stage launched.
    pub const ALL: SamplingMix = SamplingMix {
        gumbel: true,
        filtered: true,
        top_k: true,
        top_p: true,
        unlisted_top_p: true,
    };

    /// The mix of `rows` for a vocabulary of `vocab` (the kernels' own row classification,
    /// except that a row without any finite logit, greedy on the device, counts as its
    /// parameters say).
    pub fn of<'a>(
        rows: impl IntoIterator<Item = &'a SamplingRowParams>,
        vocab: usize,
    ) -> SamplingMix {
        let mut mix = SamplingMix::NONE;
        for row in rows {
            // NaN counts as greedy, as on the device.
            let positive = row.temperature > 0.0;
            let greedy = !positive || row.temperature.is_infinite() || row.top_k == 1;
            if greedy {
                continue;
            }
            let top_k = row.top_k > 0 && (row.top_k as usize) < vocab;
            if top_k || row.top_p < 1.0 || row.min_p > 0.0 {
                mix.filtered = true;
                mix.top_k |= top_k;
                // NaN top-p counts as off, as on the device.
                let listed = top_k && row.top_k as usize <= LIST_CAPACITY;
                mix.top_p |= row.top_p < 1.0;
                mix.unlisted_top_p |= row.top_p < 1.0 && !listed;
            } else {
                mix.gumbel = true;
            }
        }
        mix
    }
}

/// Round launches of the fast filtered pipeline for a launch of `rows` rows: a row needing
/// more rounds goes to the exact kernel (same token, about 0.2 ms for the launch). An empty
/// round launch costs about 1 us in a graph. Measured on the H200 (`pagoda bench sampling
/// --device cuda --configurations top-p --fast-rounds 1|2|3`, top-p 0.9 at T = 1, randn x 3
/// logits): 1.06-1.12 rounds per row; with two launches no row of batch 1 or 16 needed the
/// exact kernel, and one of the 2048 rows of batch 64 at V 128256 did. Two launches take 1.1
/// us off a batch-1 call (21.0 -> 19.8 us at V 128256), against an expected 0.1 us of exact
/// draws; the expected cost grows with the batch, so from 5 rows on there are three.
pub fn default_fast_rounds(rows: usize) -> u32 {
    if rows <= 4 {
        2
    } else {
        3
    }
}

/// Launch options of [`sample_rows_with`](super::sample_rows_with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplingOptions {
    /// CTAs per row of the split kernels; `None` = [`sampling_splits`]. Any value in
    /// `1..=MAX_SAMPLING_SPLITS` gives the same tokens.
    pub num_splits: Option<usize>,
    /// CTAs per row of the filtered pipeline; `None` = [`filter_splits`]. Any value in
    /// `1..=MAX_SAMPLING_SPLITS` gives the same tokens.
    pub filter_splits: Option<usize>,
    /// Round cap of the dual-pivot loop (0 sends every filtered row to the exact fallback).
    pub max_rejection_rounds: u32,
    /// The filtered rows' path.
    pub filtered: FilteredSampling,
    /// Round launches of the fast path when some row can need them (see [`SamplingMix`]);
    /// `None` = [`default_fast_rounds`].
    pub fast_rounds: Option<u32>,
    /// The stages launched (see [`SamplingMix`]).
    pub mix: SamplingMix,
    /// Launches without filtered rows skip the row-maximum pass: the Gumbel kernel finds
    /// each row's maximum and keeps its splits' few candidates, which the finish kernel
    /// scores exactly. Same tokens either way.
    pub gumbel_max: bool,
    /// Rows with a top-k of at most 512 and top-p run their rounds in one CTA over the list
    /// of their proposal's ids (`sampling_list_rounds`) instead of round launches over the
    /// whole row. Same tokens either way.
    pub list_rounds: bool,
    /// Launches with top-p rows and no top-k rows run the row maxima and the whole fast
    /// filtered path in one kernel, a thread-block cluster per row (`sampling_cluster`; on
    /// GPUs of compute capability 9.0 and later, else ignored). Same tokens either way.
    pub cluster: bool,
    /// The cluster kernel's CTA shape. Same tokens for every shape.
    pub cluster_shape: ClusterShape,
    /// When a launch has more top-p rows than clusters fit on the GPU at once, each resident
    /// row asks L2 for a waiting row's logits once its own pass is done (counted in
    /// [`SamplingTotals::prefetched_rows`]). Same tokens either way.
    pub cluster_prefetch: bool,
}

impl SamplingOptions {
    /// Whether a launch with these options over `vocab`-logit rows on a GPU of compute
    /// capability `compute_capability` runs `sampling_cluster` (see
    /// [`SamplingOptions::cluster`]): the fast path, top-p rows and no top-k rows (min-p alone
    /// needs no rounds and measured faster on the pipeline), clusters on the GPU, and a slice
    /// that fits in shared memory.
    pub fn runs_cluster(&self, vocab: usize, compute_capability: (u32, u32)) -> bool {
        self.cluster
            && self.filtered == FilteredSampling::Fast
            && self.mix.filtered
            && self.mix.top_p
            && !self.mix.top_k
            && compute_capability.0 >= 9
            && cluster_fits(vocab)
    }
}

impl Default for SamplingOptions {
    /// Automatic splits, [`DEFAULT_MAX_REJECTION_ROUNDS`], the fast filtered path with the
    /// default round launches, every stage launched.
    fn default() -> Self {
        SamplingOptions {
            num_splits: None,
            filter_splits: None,
            max_rejection_rounds: DEFAULT_MAX_REJECTION_ROUNDS,
            filtered: FilteredSampling::Fast,
            fast_rounds: None,
            mix: SamplingMix::ALL,
            gumbel_max: true,
            list_rounds: true,
            cluster: true,
            cluster_shape: ClusterShape::DEFAULT,
            cluster_prefetch: true,
        }
    }
}

/// The checked geometry of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplingPlan {
    /// Rows sampled (`tokens_out.len()`).
    pub rows: usize,
    /// Splits per row of the row-max and Gumbel kernels.
    pub num_splits: usize,
    /// Splits per row of the filtered pipeline ([`filter_splits`]).
    pub filter_splits: usize,
}

/// The lengths a launch was given, for [`plan_sampling`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplingShapes {
    /// Logits per row.
    pub vocab: usize,
    /// Elements of `logits` (must be `rows * vocab`).
    pub logits_len: usize,
    /// Words of `params` (must be `rows * 8`).
    pub params_len: usize,
    /// Elements of `tokens_out` (= rows).
    pub tokens_len: usize,
    /// Rows the workspace holds.
    pub workspace_rows: usize,
    /// Vocabulary the workspace was made for (an upper bound).
    pub workspace_vocab: usize,
}

/// Checks the shapes of a launch and picks the splits; every error names what is wrong.
pub fn plan_sampling(
    shapes: SamplingShapes,
    options: SamplingOptions,
    sm_count: usize,
) -> Result<SamplingPlan, CudaError> {
    let SamplingShapes {
        vocab,
        logits_len,
        params_len,
        tokens_len: rows,
        workspace_rows,
        workspace_vocab,
    } = shapes;
    if vocab == 0 || vocab >= u32::MAX as usize {
        return Err(CudaError::invalid(format!(
            "sampling vocab {vocab} must be in 1..u32::MAX"
        )));
    }
    if rows > MAX_SAMPLING_ROWS {
        return Err(CudaError::invalid(format!(
            "sampling {rows} rows > {MAX_SAMPLING_ROWS} per launch"
        )));
    }
    if rows > workspace_rows || vocab > workspace_vocab {
        return Err(CudaError::invalid(format!(
            "sampling {rows} rows x vocab {vocab} exceeds its workspace \
             ({workspace_rows} rows x vocab {workspace_vocab})"
        )));
    }
    if rows.checked_mul(vocab) != Some(logits_len) {
        return Err(CudaError::invalid(format!(
            "sampling logits have {logits_len} elements, expected rows {rows} x vocab {vocab}"
        )));
    }
    if rows * SAMPLING_PARAM_WORDS != params_len {
        return Err(CudaError::invalid(format!(
            "sampling params have {params_len} words, expected rows {rows} x {SAMPLING_PARAM_WORDS}"
        )));
    }
    let checked = |name: &str, splits: usize| {
        if (1..=MAX_SAMPLING_SPLITS).contains(&splits) {
            Ok(splits)
        } else {
            Err(CudaError::invalid(format!(
                "sampling {name} {splits} is outside 1..={MAX_SAMPLING_SPLITS}"
            )))
        }
    };
    let num_splits = match options.num_splits {
        Some(splits) => checked("num_splits", splits)?,
        None => sampling_splits(rows, vocab, sm_count),
    };
    let filter_splits = match options.filter_splits {
        Some(splits) => checked("filter_splits", splits)?,
        None => filter_splits(rows, vocab, sm_count),
    };
    Ok(SamplingPlan {
        rows,
        num_splits,
        filter_splits,
    })
}

/// Which way a row was sampled (the first stats word of the row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowPath {
    /// Argmax: temperature 0, top_k 1 or no finite logit.
    Greedy,
    /// Gumbel-max (no filter active).
    Gumbel,
    /// Dual-pivot rejection accepted a candidate.
    Rejection,
    /// The counted exact fallback (ambiguous top-p test, round cap, or no min-p threshold).
    Fallback,
}

impl RowPath {
    fn from_code(code: u32) -> Option<RowPath> {
        Some(match code {
            0 => RowPath::Greedy,
            1 => RowPath::Gumbel,
            2 => RowPath::Rejection,
            3 => RowPath::Fallback,
            _ => return None,
        })
    }
}

/// What the kernels recorded for one row of the last launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSamplingStats {
    /// The path taken.
    pub path: RowPath,
    /// Rejection rounds used (0 for greedy and Gumbel rows).
    pub rounds: u32,
}

/// Decodes `[rows, 2]` stats words (`{path, rounds}` per row); an unknown path code is an
/// error naming the row (e.g. a row the last launch did not cover).
pub fn decode_row_stats(words: &[u32]) -> Result<Vec<RowSamplingStats>, CudaError> {
    if !words.len().is_multiple_of(2) {
        return Err(CudaError::invalid(format!(
            "sampling stats have {} words, expected 2 per row",
            words.len()
        )));
    }
    words
        .chunks_exact(2)
        .enumerate()
        .map(|(row, pair)| {
            let path = RowPath::from_code(pair[0]).ok_or_else(|| {
                CudaError::invalid(format!(
                    "sampling stats row {row}: unknown path {}",
                    pair[0]
                ))
            })?;
            Ok(RowSamplingStats {
                path,
                rounds: pair[1],
            })
        })
        .collect()
}

/// Running totals the kernels accumulate in the workspace (device atomics, never read
/// inside a step): rows per path and rejection rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SamplingTotals {
    /// Greedy rows.
    pub greedy: u64,
    /// Gumbel-max rows.
    pub gumbel: u64,
    /// Rows accepted by rejection.
    pub rejection: u64,
    /// Rows that took the exact fallback.
    pub fallback: u64,
    /// Rejection rounds over all filtered rows.
    pub rejection_rounds: u64,
    /// Filtered rows finished by the multi-CTA fast pipeline.
    pub filtered_fast: u64,
    /// Filtered rows drawn by the single-CTA exact kernel (fast path off, or a row it left).
    pub filtered_exact: u64,
    /// Rows whose maximum the Gumbel kernel found (no row-maximum pass; see
    /// [`SamplingOptions::gumbel_max`]).
    pub gumbel_max_rows: u64,
    /// Filtered rows whose rounds ran on their id list (see [`SamplingOptions::list_rounds`]).
    pub list_rows: u64,
    /// Filtered rows finished by the cluster kernel (see [`SamplingOptions::cluster`]).
    pub cluster_rows: u64,
    /// Rows of the cluster kernel whose logits a resident row asked L2 for (see
    /// [`SamplingOptions::cluster_prefetch`]).
    pub prefetched_rows: u64,
}

/// u32 words of the totals counters in the workspace (11 little-endian u64).
pub const SAMPLING_TOTALS_WORDS: usize = 22;

impl SamplingTotals {
    /// Decodes the workspace's [`SAMPLING_TOTALS_WORDS`] words.
    pub fn from_words(words: &[u32]) -> Result<Self, CudaError> {
        if words.len() != SAMPLING_TOTALS_WORDS {
            return Err(CudaError::invalid(format!(
                "sampling totals have {} words, expected {SAMPLING_TOTALS_WORDS}",
                words.len()
            )));
        }
        let counter =
            |index: usize| ((words[2 * index + 1] as u64) << 32) | words[2 * index] as u64;
        Ok(SamplingTotals {
            greedy: counter(0),
            gumbel: counter(1),
            rejection: counter(2),
            fallback: counter(3),
            rejection_rounds: counter(4),
            filtered_fast: counter(5),
            filtered_exact: counter(6),
            gumbel_max_rows: counter(7),
            list_rows: counter(8),
            cluster_rows: counter(9),
            prefetched_rows: counter(10),
        })
    }
}

#[cfg(test)]
#[path = "params_tests.rs"]
mod tests;
