//! Sampling on the device at the end of a step ([`CudaRunner::forward_sampled`](super::CudaRunner::forward_sampled)): the logits
//! stay in device memory, `pagoda_ops::cuda::sample_rows` draws one token per row from them,
//! and only the token ids come back (4 bytes per row instead of `4 * vocab`).
//!
//! Rows the caller wants on the host (a `None` parameter: penalties, log-probabilities, the
//! reference sampler) get their logits row downloaded instead, in the same step. This keeps
//! the entry per row rather than all-or-nothing: one request asking for log-probabilities
//! does not pull the whole batch back to the CPU, and a request's path never depends on the
//! other requests of the step (its random stream must not either).
//!
//! The step itself is unchanged (same staging, same graphs); the sampler runs eagerly on the
//! stream after it: one pinned upload of the row parameters, the sampler's launches per
//! contiguous run of device rows (only the stages its rows need: see `SamplingMix`), a 72-byte copy of the sampler's running totals next to the tokens,
//! and one download of both (the step's only synchronisation, as before).

use pagoda_cuda::{
    view, view_mut, CudaError, DeviceBuffer, DeviceRead, DeviceWrite, Gpu, GpuEvent, PinnedBuffer,
};
use pagoda_ops::cuda::{
    apply_token_masks, sample_rows_with, SamplingMix, SamplingOptions, SamplingRowParams,
    SamplingTotals, SamplingWorkspace, MAX_SAMPLING_ROWS, SAMPLING_PARAM_WORDS,
    SAMPLING_TOTALS_WORDS,
};

use pagoda_models::llama::ForwardBatch;
use pagoda_models::llama_cuda::{HostFloat, SamplingKernels};
use pagoda_ops::cuda::TuningTable;
use pagoda_ops::tuned_choices::{load_current, ChoiceFamily};

use super::{GpuCache, TypedRunner};

/// What one logits row of a [`CudaRunner::forward_sampled`](super::CudaRunner::forward_sampled)
/// step gave back.
#[derive(Debug, Clone, PartialEq)]
pub enum SampledRow {
    /// The token drawn on the device with the row's [`SamplingRowParams`].
    Token(u32),
    /// The row's raw f32 logits, `[vocab_size]`, downloaded because its parameters were
    /// `None` (the caller samples it on the host).
    Logits(Vec<f32>),
}

impl SampledRow {
    /// The device-drawn token, if the row was sampled on the device.
    pub fn token(&self) -> Option<u32> {
        match self {
            SampledRow::Token(token) => Some(*token),
            SampledRow::Logits(_) => None,
        }
    }

    /// The downloaded logits, if the row was left to the host.
    pub fn logits(&self) -> Option<&[f32]> {
        match self {
            SampledRow::Token(_) => None,
            SampledRow::Logits(logits) => Some(logits),
        }
    }
}

/// Structured output's token masks of one step's device rows: mask `m` is `words` u32
/// words of `bits` (bit `v % 32` of word `v / 32` set when token `v` is allowed) for logits
/// row `rows[m]`. Computed on the host while the step's forward runs, and handed over just
/// before the sampler is launched (see [`MaskSource`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenMasks {
    /// Words per mask: `ceil(vocab_size / 32)` (shorter masks are padded with zero words).
    pub words: usize,
    /// The logits row of each mask.
    pub rows: Vec<u32>,
    /// `rows.len() * words` words.
    pub bits: Vec<u32>,
}

/// Where a sampled step gets its token masks: called once, after the forward is enqueued
/// and before the sampler runs, so the host computes the masks while the GPU runs the
/// forward.
pub type MaskSource<'a> = &'a dyn Fn() -> TokenMasks;

/// Checks the per-row parameters of a sampled step before anything runs: one entry per
/// `logits_for` row, at most [`MAX_SAMPLING_ROWS`], every record within the sampler's ranges.
/// Errors name the row and the field.
pub(super) fn validate_rows(
    batch: &ForwardBatch<'_>,
    rows: &[Option<SamplingRowParams>],
) -> Result<(), CudaError> {
    if rows.len() != batch.logits_for.len() {
        return Err(CudaError::invalid(format!(
            "forward_sampled: {} sampling rows for {} logits rows (one entry per logits_for row)",
            rows.len(),
            batch.logits_for.len()
        )));
    }
    if rows.len() > MAX_SAMPLING_ROWS {
        return Err(CudaError::invalid(format!(
            "forward_sampled: {} rows exceed the sampler's {MAX_SAMPLING_ROWS} per step",
            rows.len()
        )));
    }
    for (row, params) in rows.iter().enumerate() {
        if let Some(params) = params {
            params
                .validate()
                .map_err(|error| CudaError::invalid(format!("sampling row {row}: {error}")))?;
        }
    }
    Ok(())
}

/// What a step hands back (see `TypedRunner::forward_in`).
pub(super) enum Output<'a> {
    /// The logits rows, downloaded.
    Logits,
    /// The rows drawn by the device sampler.
    Sampled(DeviceSampling<'a>),
    /// The rows' final-normed hidden states (embeddings).
    Hidden,
}

/// The rows of one sampled step and where the results go (`out` is cleared and gets one
/// [`SampledRow`] per row).
pub(super) struct DeviceSampling<'a> {
    pub(super) rows: &'a [Option<SamplingRowParams>],
    pub(super) out: &'a mut Vec<SampledRow>,
    /// The token masks of constrained device rows.
    pub(super) masks: Option<MaskSource<'a>>,
}

/// The device-side sampler state of a prepared cache, allocated on the first sampled step
/// for up to `max_batch_tokens` rows of the model's vocabulary.
pub(super) struct DeviceSampler {
    workspace: SamplingWorkspace,
    /// `[max_rows, 8]` pinned parameter words, uploaded once per step.
    staging: PinnedBuffer<u32>,
    /// `[max_rows, 8]` parameter words on the device.
    params: DeviceBuffer<u32>,
    /// The sampler's running totals (`SAMPLING_TOTALS_WORDS`), then `[max_rows]` tokens:
    /// both come back in one download.
    readback: DeviceBuffer<u32>,
    /// Totals at the previous step (the counters add the difference).
    last_totals: SamplingTotals,
    /// The paths configured when the sampler was made.
    switches: SamplingKernels,
    /// Token masks: pinned `[rows..., bits...]` words and their device copy, allocated at
    /// the first masked step (`max_rows * (1 + words)` words).
    mask_staging: Option<(PinnedBuffer<u32>, DeviceBuffer<u32>)>,
    /// The tuning table's sampler split counts (none: the rules; tokens do not change).
    tuned: Option<TuningTable>,
    /// Launches on tuned and on rule split counts since [`Self::take_split_sources`].
    split_sources: (u64, u64),
}

/// Logs the device sampler's paths once per process.
fn log_switches_once(switches: &SamplingKernels) {
    let on_off = |on: bool| if on { "on" } else { "off" };
    static LOGGED: std::sync::Once = std::sync::Once::new();
    LOGGED.call_once(|| {
        tracing::info!(
            "GPU sampling: filtered rows on the {} path (PAGODA_GPU_SAMPLING_FILTERED=fast|exact); \
             row maxima in the Gumbel kernel when no row is filtered: {} \
             (PAGODA_GPU_SAMPLING_GUMBEL_MAX=on|off); top-k rows' rounds on their id list: {} \
             (PAGODA_GPU_SAMPLING_LIST_ROUNDS=on|off); top-p launches without top-k \
             in one cluster kernel per row: {} (PAGODA_GPU_SAMPLING_CLUSTER=on|off), waiting \
             rows prefetched into L2: {} (PAGODA_GPU_SAMPLING_PREFETCH=on|off)",
            switches.filtered.name(),
            on_off(switches.gumbel_max),
            on_off(switches.list_rounds),
            on_off(switches.cluster),
            on_off(switches.cluster_prefetch)
        )
    });
}

impl DeviceSampler {
    fn new(
        gpu: &Gpu,
        max_rows: usize,
        vocab: usize,
        switches: SamplingKernels,
    ) -> Result<Self, CudaError> {
        let max_rows = max_rows.clamp(1, MAX_SAMPLING_ROWS);
        log_switches_once(&switches);
        let tuned = load_current(gpu).filter(|table| {
            [ChoiceFamily::SamplingSplits, ChoiceFamily::FilterSplits]
                .iter()
                .any(|&family| table.count_choices(family) > 0)
        });
        static TUNED: std::sync::Once = std::sync::Once::new();
        TUNED.call_once(|| match &tuned {
            Some(table) => tracing::info!(
                "GPU sampling: split counts from the tuning table where it has the rows' bucket \
                 ({} Gumbel/row-maximum and {} filtered buckets tuned), the built-in rules \
                 elsewhere",
                table.count_choices(ChoiceFamily::SamplingSplits),
                table.count_choices(ChoiceFamily::FilterSplits)
            ),
            None => tracing::info!(
                "GPU sampling: split counts from the built-in rules (no sampler rows tuned: \
                 `pagoda tune --kernels sampling`)"
            ),
        });
        Ok(DeviceSampler {
            workspace: SamplingWorkspace::new(gpu, max_rows, vocab)?,
            staging: gpu.alloc_pinned(max_rows * SAMPLING_PARAM_WORDS)?,
            params: gpu.zeros(max_rows * SAMPLING_PARAM_WORDS)?,
            readback: gpu.zeros(SAMPLING_TOTALS_WORDS + max_rows)?,
            last_totals: SamplingTotals::default(),
            switches,
            mask_staging: None,
            tuned,
            split_sources: (0, 0),
        })
    }

    /// The tuned (Gumbel, filtered) split counts of `rows` x `vocab` logits, `None`: the rule.
    fn splits_for(&mut self, rows: usize, vocab: usize) -> (Option<usize>, Option<usize>) {
        use ChoiceFamily::{FilterSplits, SamplingSplits};
        let tuned = |family| self.tuned.as_ref()?.tuned_splits(family, rows, vocab);
        let splits = (tuned(SamplingSplits), tuned(FilterSplits));
        if splits == (None, None) {
            self.split_sources.1 += 1;
        } else {
            self.split_sources.0 += 1;
        }
        splits
    }

    /// Launches on tuned and on rule split counts since the last call.
    pub(super) fn take_split_sources(&mut self) -> (u64, u64) {
        std::mem::take(&mut self.split_sources)
    }

    /// Uploads `masks` and applies them to the rows of `logits` (`[rows, vocab]`). The
    /// pinned words stay unchanged until the step's download synchronises the stream.
    fn apply_masks(
        &mut self,
        gpu: &Gpu,
        logits: &mut impl DeviceWrite<f32>,
        vocab: usize,
        masks: &TokenMasks,
    ) -> Result<(), CudaError> {
        let count = masks.rows.len();
        let words = vocab.div_ceil(32);
        let max_rows = self.workspace.max_rows();
        if count == 0 {
            return Ok(());
        }
        if count > max_rows || masks.words != words || masks.bits.len() != count * words {
            return Err(CudaError::invalid(format!(
                "token masks: {count} masks of {} words ({} in all) for at most {max_rows} rows \
                 of {words} words",
                masks.words,
                masks.bits.len()
            )));
        }
        let rows_in_range = logits.len() / vocab.max(1);
        if let Some(&row) = masks
            .rows
            .iter()
            .find(|&&row| row as usize >= rows_in_range)
        {
            return Err(CudaError::invalid(format!(
                "token masks: row {row} is outside the step's {rows_in_range} logits rows"
            )));
        }
        if self.mask_staging.is_none() {
            let len = max_rows * (1 + words);
            self.mask_staging = Some((gpu.alloc_pinned(len)?, gpu.zeros(len)?));
        }
        let Some((staging, device)) = self.mask_staging.as_mut() else {
            return Err(CudaError::invalid("mask staging missing"));
        };
        let used = count * (1 + words);
        let host = &mut staging.as_mut_slice()?[..used];
        host[..count].copy_from_slice(&masks.rows);
        host[count..].copy_from_slice(&masks.bits);
        gpu.upload_pinned_range(staging, 0..used, &mut view_mut(device, 0..used)?)?;
        apply_token_masks(
            gpu,
            logits,
            vocab,
            &view(device, count..used)?,
            &view(device, 0..count)?,
        )
    }

    /// Samples the rows of `logits` (`[rows.len(), vocab]` on the device) whose parameters
    /// are `Some`, downloads the logits of the others, and waits for the stream. Returns
    /// the rows, what the sampler's totals gained in this call, and an event recorded when
    /// the tokens were drawn (before the download).
    fn sample(
        &mut self,
        gpu: &Gpu,
        logits: &impl DeviceRead<f32>,
        vocab: usize,
        rows: &[Option<SamplingRowParams>],
    ) -> Result<(Vec<SampledRow>, SamplingTotals, GpuEvent), CudaError> {
        let num_rows = rows.len();
        if num_rows > self.workspace.max_rows() || logits.len() != num_rows * vocab {
            return Err(CudaError::invalid(format!(
                "device sampling of {num_rows} rows x vocab {vocab} ({} logits) exceeds its \
                 workspace of {} rows",
                logits.len(),
                self.workspace.max_rows()
            )));
        }
        let words = &mut self.staging.as_mut_slice()?[..num_rows * SAMPLING_PARAM_WORDS];
        for (record, params) in words.chunks_exact_mut(SAMPLING_PARAM_WORDS).zip(rows) {
            // Host rows are not launched; greedy words keep the buffer well-formed anyway.
            record.copy_from_slice(&params.unwrap_or_else(SamplingRowParams::greedy).to_words());
        }
        let param_words = num_rows * SAMPLING_PARAM_WORDS;
        // The pinned words stay unchanged until the download below synchronises the stream.
        gpu.upload_pinned_range(
            &self.staging,
            0..param_words,
            &mut view_mut(&mut self.params, 0..param_words)?,
        )?;
        let device_runs = runs(rows, true);
        for run in &device_runs {
            let (num_splits, filter_splits) = self.splits_for(run.len(), vocab);
            let options = SamplingOptions {
                num_splits,
                filter_splits,
                filtered: self.switches.filtered,
                gumbel_max: self.switches.gumbel_max,
                list_rounds: self.switches.list_rounds,
                cluster: self.switches.cluster,
                cluster_prefetch: self.switches.cluster_prefetch,
                mix: SamplingMix::of(rows[run.clone()].iter().flatten(), vocab),
                ..SamplingOptions::default()
            };
            sample_rows_with(
                gpu,
                &view(logits, run.start * vocab..run.end * vocab)?,
                vocab,
                &view(
                    &self.params,
                    run.start * SAMPLING_PARAM_WORDS..run.end * SAMPLING_PARAM_WORDS,
                )?,
                &mut self.workspace,
                &mut view_mut(
                    &mut self.readback,
                    SAMPLING_TOTALS_WORDS + run.start..SAMPLING_TOTALS_WORDS + run.end,
                )?,
                options,
            )?;
        }
        gpu.copy(
            self.workspace.totals(),
            &mut view_mut(&mut self.readback, 0..SAMPLING_TOTALS_WORDS)?,
        )?;
        let drawn = gpu.record_event()?;
        let readback = gpu.download(&view(&self.readback, 0..SAMPLING_TOTALS_WORDS + num_rows)?)?;
        let totals = SamplingTotals::from_words(&readback[..SAMPLING_TOTALS_WORDS])?;
        let gained = totals_difference(totals, self.last_totals);
        self.last_totals = totals;
        let tokens = &readback[SAMPLING_TOTALS_WORDS..];
        let mut sampled: Vec<SampledRow> = rows
            .iter()
            .zip(tokens)
            .map(|(params, &token)| match params {
                Some(_) => SampledRow::Token(token),
                None => SampledRow::Logits(Vec::new()),
            })
            .collect();
        for run in runs(rows, false) {
            let host = gpu.download(&view(logits, run.start * vocab..run.end * vocab)?)?;
            for (row, chunk) in run.zip(host.chunks_exact(vocab)) {
                sampled[row] = SampledRow::Logits(chunk.to_vec());
            }
        }
        Ok((sampled, gained, drawn))
    }
}

/// Maximal runs of consecutive rows whose parameters are `Some` (`device == true`) or
/// `None` (`device == false`), in row order.
fn runs(rows: &[Option<SamplingRowParams>], device: bool) -> Vec<std::ops::Range<usize>> {
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for (row, params) in rows.iter().enumerate() {
        if params.is_some() != device {
            continue;
        }
        match runs.last_mut() {
            Some(run) if run.end == row => run.end = row + 1,
            _ => runs.push(row..row + 1),
        }
    }
    runs
}

/// `now - before`, field by field (saturating: a fresh workspace restarts at zero).
fn totals_difference(now: SamplingTotals, before: SamplingTotals) -> SamplingTotals {
    SamplingTotals {
        greedy: now.greedy.saturating_sub(before.greedy),
        gumbel: now.gumbel.saturating_sub(before.gumbel),
        rejection: now.rejection.saturating_sub(before.rejection),
        fallback: now.fallback.saturating_sub(before.fallback),
        rejection_rounds: now.rejection_rounds.saturating_sub(before.rejection_rounds),
        filtered_fast: now.filtered_fast.saturating_sub(before.filtered_fast),
        filtered_exact: now.filtered_exact.saturating_sub(before.filtered_exact),
        gumbel_max_rows: now.gumbel_max_rows.saturating_sub(before.gumbel_max_rows),
        list_rows: now.list_rows.saturating_sub(before.list_rows),
        cluster_rows: now.cluster_rows.saturating_sub(before.cluster_rows),
        prefetched_rows: now.prefetched_rows.saturating_sub(before.prefetched_rows),
    }
}

impl<T: HostFloat> TypedRunner<T> {
    /// Runs `batch` like `forward`, then samples on the device (see the module docs).
    pub(super) fn forward_sampled(
        &mut self,
        batch: &ForwardBatch<'_>,
        rows: &[Option<SamplingRowParams>],
        masks: Option<MaskSource<'_>>,
    ) -> Result<Vec<SampledRow>, CudaError> {
        validate_rows(batch, rows)?;
        let Some(mut cache) = self.cache.take() else {
            return Err(CudaError::invalid(
                "the KV cache is not allocated: call prepare first",
            ));
        };
        let mut out = Vec::new();
        let result = self.forward_in(
            &mut cache,
            batch,
            Output::Sampled(DeviceSampling {
                rows,
                out: &mut out,
                masks,
            }),
        );
        self.cache = Some(cache);
        result.map(|_| out)
    }

    /// The tail of a sampled step (called by `forward_in` once the step is enqueued): samples
    /// the first `num_logits` rows of the step's logits, fills `request.out`, and counts.
    pub(super) fn sample_on_device(
        &mut self,
        gpu: &Gpu,
        cache: &mut GpuCache<T>,
        num_logits: usize,
        request: DeviceSampling<'_>,
    ) -> Result<GpuEvent, CudaError> {
        let vocab = self.model.config().vocab_size;
        if request.rows.len() != num_logits {
            return Err(CudaError::invalid(format!(
                "device sampling: {} rows for {num_logits} logits rows",
                request.rows.len()
            )));
        }
        if cache.sampler.is_none() {
            cache.sampler = Some(DeviceSampler::new(
                gpu,
                cache.options.max_batch_tokens,
                vocab,
                cache.options.kernels.sampling,
            )?);
        }
        let Some(sampler) = cache.sampler.as_mut() else {
            return Err(CudaError::invalid("device sampler missing"));
        };
        if let Some(source) = request.masks {
            // The forward is enqueued: the host's masks are (nearly) done by now.
            let waited = std::time::Instant::now();
            let masks = source();
            self.counters.structured_mask_wait_us += waited.elapsed().as_micros() as u64;
            let mut logits = view_mut(&mut cache.buffers.scratch.logits, 0..num_logits * vocab)?;
            sampler.apply_masks(gpu, &mut logits, vocab, &masks)?;
            self.counters.cuda_masked_rows += masks.rows.len() as u64;
        }
        let logits = view(&cache.buffers.scratch.logits, 0..num_logits * vocab)?;
        let (rows, gained, drawn) = sampler.sample(gpu, &logits, vocab, request.rows)?;
        let (tuned, rules) = sampler.take_split_sources();
        self.counters.gpu_sampler_splits_tuned += tuned;
        self.counters.gpu_sampler_splits_rules += rules;
        let device_rows = rows.iter().filter(|row| row.token().is_some()).count() as u64;
        let counters = &mut self.counters;
        counters.steps_cuda_sampled += 1;
        counters.cuda_sampled_rows_device += device_rows;
        counters.cuda_sampled_rows_host += rows.len() as u64 - device_rows;
        counters.gpu_sampler_greedy += gained.greedy;
        counters.gpu_sampler_gumbel += gained.gumbel;
        counters.gpu_sampler_rejection += gained.rejection;
        counters.gpu_sampler_fallbacks += gained.fallback;
        counters.gpu_sampler_rejection_rounds += gained.rejection_rounds;
        counters.gpu_sampler_filtered_fast += gained.filtered_fast;
        counters.gpu_sampler_filtered_exact += gained.filtered_exact;
        counters.gpu_sampler_gumbel_max += gained.gumbel_max_rows;
        counters.gpu_sampler_list_rows += gained.list_rows;
        counters.gpu_sampler_cluster_rows += gained.cluster_rows;
        counters.gpu_sampler_prefetched_rows += gained.prefetched_rows;
        *request.out = rows;
        Ok(drawn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_device_and_host_rows() {
        let some = Some(SamplingRowParams::greedy());
        let rows = [some, some, None, some, None, None, some];
        assert_eq!(runs(&rows, true), vec![0..2, 3..4, 6..7]);
        assert_eq!(runs(&rows, false), vec![2..3, 4..6]);
        assert!(runs(&[], true).is_empty());
        assert_eq!(runs(&[None, None], false), vec![0..2]);
        assert!(runs(&[None, None], true).is_empty());
    }

    #[test]
    fn rows_are_checked_against_the_batch_and_the_ranges() {
        let table = pagoda_kv::PageTable {
            indptr: vec![0],
            ..Default::default()
        };
        let batch = ForwardBatch {
            tokens: &[1, 2, 3],
            positions: &[0, 1, 2],
            slots: &[],
            qo_indptr: &[0, 3],
            page_table: &table,
            logits_for: &[1, 2],
            sparse: &[],
        };
        let greedy = Some(SamplingRowParams::greedy());
        assert!(validate_rows(&batch, &[greedy, None]).is_ok());
        let error = validate_rows(&batch, &[greedy]).unwrap_err().to_string();
        assert!(
            error.contains("1 sampling rows for 2 logits rows"),
            "{error}"
        );
        let hot = SamplingRowParams {
            temperature: f32::NAN,
            ..SamplingRowParams::greedy()
        };
        let error = validate_rows(&batch, &[None, Some(hot)])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("row 1") && error.contains("temperature"),
            "{error}"
        );
    }

    #[test]
    fn totals_difference_is_per_field_and_saturating() {
        let before = SamplingTotals {
            greedy: 5,
            gumbel: 2,
            rejection: 1,
            fallback: 0,
            rejection_rounds: 9,
            filtered_fast: 1,
            filtered_exact: 0,
            gumbel_max_rows: 1,
            list_rows: 2,
            cluster_rows: 2,
            prefetched_rows: 3,
        };
        let now = SamplingTotals {
            greedy: 7,
            gumbel: 2,
            rejection: 4,
            fallback: 1,
            rejection_rounds: 20,
            filtered_fast: 3,
            filtered_exact: 1,
            gumbel_max_rows: 4,
            list_rows: 7,
            cluster_rows: 2,
            prefetched_rows: 3,
        };
        let gained = totals_difference(now, before);
        assert_eq!(
            gained,
            SamplingTotals {
                greedy: 2,
                gumbel: 0,
                rejection: 3,
                fallback: 1,
                rejection_rounds: 11,
                filtered_fast: 2,
                filtered_exact: 1,
                gumbel_max_rows: 3,
                list_rows: 5,
                cluster_rows: 0,
                prefetched_rows: 0,
            }
        );
        assert_eq!(
            totals_difference(SamplingTotals::default(), before),
            SamplingTotals::default()
        );
    }
}
