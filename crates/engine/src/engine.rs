//! Requests, steps and the batched forward.

use std::collections::HashMap;

use rayon::prelude::*;

use crate::cuda_runner::{MaskSource, PagedDecodeMode, SampledRow, SamplingRowParams};
use pagoda_models::config::ModelConfig;
use pagoda_models::llama::{AttentionPolicy, ForwardBatch};
use pagoda_ops::attention::KvCacheTypes;
use pagoda_ops::sampling::SamplerKind;

use crate::backend::{device_row_params, Backend, Runner};
use crate::counters::EngineCounters;
use crate::cpu_pool::CpuThreadsMode;
use crate::speculation::VerifyRule;
use request::RequestState;
use speculate::Verified;

mod embed;
mod masks;
mod request;
mod settings;
mod sparse;
mod speculate;
mod warmup;

use pagoda_kv::CacheEvent;
use pagoda_scheduler::{SampledToken, Scheduler, SchedulerError, SchedulerStats};
pub use settings::EngineSettings;
pub use sparse::check_sparse_attention_setup;

/// Identifies a request inside one engine.
pub type RequestId = u64;

/// Engine sizing and paths.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV page.
    pub page_size: usize,
    /// Pages in the KV pool (shared by all requests).
    pub num_pages: usize,
    /// Most new tokens (prefill + decode) one step may run.
    pub max_batch_tokens: usize,
    /// Longest sequence (prompt + generated) a request may reach.
    pub max_context: usize,
    /// How each step picks its CPU attention path.
    pub attention: AttentionPolicy,
    /// Which sampler draws the tokens (the fused sort-free one or the sort-based reference).
    pub sampler: SamplerKind,
    /// On the CUDA backend, replay decode steps from CUDA graphs (`false`: launch every
    /// kernel from the host, `--enforce-eager`). Ignored on the CPU.
    pub cuda_graphs: bool,
    /// On the CUDA backend, the decode attention path (`--paged-decode`). Ignored on the CPU.
    pub paged_decode: PagedDecodeMode,
    /// Element types of the KV pools (`-ctk`/`-ctv`): f32 by default; f16 and q8_0 on the
    /// CPU only (the engine refuses them on CUDA).
    pub kv_types: KvCacheTypes,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token was sampled (it is reported, then the request ends).
    Stop,
    /// `max_new_tokens` or the context limit was reached.
    Length,
}

/// What one step produced for one request.
#[derive(Debug, Clone)]
pub struct StepEvent {
    pub request: RequestId,
    /// The sampled token.
    pub token: u32,
    /// Log-softmax of the raw logits at this position, when the request asked for them.
    pub logprobs: Option<Vec<f32>>,
    /// Set when this token ends the request.
    pub finished: Option<FinishReason>,
    /// With `finished`: why the request ended early beside its finish reason (its grammar
    /// allowed no token: the message).
    pub note: Option<String>,
}

/// Errors the caller can act on.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_new_tokens must be at least 1")]
    NoNewTokens,
    #[error("a prompt of {prompt} tokens plus {max_new_tokens} new tokens exceeds the context size of {context} tokens; shorten the prompt, ask for fewer tokens, or raise the context size")]
    ContextOverflow {
        prompt: usize,
        max_new_tokens: usize,
        context: usize,
    },
    #[error("token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("this request needs {needed} KV-cache pages for its prompt and max_tokens {max_new_tokens}, more than the {total} pages of the whole pool; ask for fewer tokens (max_tokens), or give the server more KV pages (--kv-pages or --kv-memory-fraction)")]
    TooLargeForPool {
        needed: usize,
        max_new_tokens: usize,
        total: usize,
    },
    #[error("the KV cache is full: {needed} pages needed, {free} free of {total}; raise the KV pool size")]
    OutOfPages {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error("invalid sampling parameters: {0}")]
    Sampling(#[from] pagoda_ops::sampling::InvalidSamplingParam),
    #[error("the scheduler's configuration: {0}")]
    Scheduler(#[from] pagoda_scheduler::SchedulerError),
    #[error("allocating the GPU KV cache and step buffers: {0}")]
    Device(#[from] pagoda_cuda::CudaError),
    #[error("warming up the GPU: {0}")]
    Warmup(pagoda_cuda::CudaError),
    #[error("{0}")]
    KvCacheType(String),
    #[error("{0}")]
    SparseAttention(String),
    #[error("internal error (please report): {0}")]
    Internal(String),
}

/// A CPU inference engine over one model: a [`Scheduler`] (continuous batching, chunked
/// prefill, preemption by recompute, prefix caching) driving one batched forward per step.
pub struct Engine {
    runner: Runner,
    config: EngineConfig,
    scheduler: Scheduler,
    requests: HashMap<RequestId, RequestState>,
    next_id: RequestId,
    counters: EngineCounters,
    /// The CUDA runner's totals when the engine last added them to `counters`.
    runner_counted: EngineCounters,
    /// The switches it was made with.
    settings: EngineSettings,
    /// Speculation's proposer, when it is on.
    proposer: Option<Box<dyn crate::speculation::Proposer>>,
    /// When speculation pays, from the steps measured so far.
    policy: crate::speculation::SpeculationPolicy,
    /// This step's speculation decision: (decoding requests, whether they speculate).
    spec_decision: Option<(usize, bool)>,
}

impl Engine {
    /// The GPU sampler's record of each logits row of a step (`ids`: the sampling requests,
    /// `drafts`: how many guesses each carries), or `None` when nothing is sampled on the
    /// device this step: a CPU backend, the reference sampler, or no row eligible (see
    /// [`device_row_params`]). The rows of a request with guesses are verified on the host.
    fn device_rows(
        &self,
        ids: &[RequestId],
        drafts: &[usize],
    ) -> Option<Vec<Option<SamplingRowParams>>> {
        if !self.runner.is_cuda() || self.config.sampler != SamplerKind::Fused {
            return None;
        }
        let leviathan = self.settings.speculation.rule == VerifyRule::Leviathan;
        let mut rows = Vec::with_capacity(ids.len());
        for (id, &draft) in ids.iter().zip(drafts) {
            let params = self.requests.get(id).and_then(|state| {
                // The device sampler takes no logit biases and keeps no distributions, and
                // the Leviathan rule needs the target's distributions: those rows sample on
                // the host. Constrained rows sample there with their token masks unless
                // `PAGODA_CUDA_DEVICE_MASKS` is off.
                let needs_p = draft > 0 && leviathan && !state.sampler.params().is_greedy();
                // (A constrained row with guesses needs a mask per guess: the host's.)
                let host_constrained =
                    state.constraint.is_some() && (!self.settings.device_masks || draft > 0);
                if !state.logit_bias.is_empty()
                    || state.draws_q.is_some()
                    || needs_p
                    || host_constrained
                {
                    return None;
                }
                device_row_params(&state.sampler, state.want_logprobs)
            });
            // A guessed row draws at the step it would have in plain decoding: the invariant
            // rule then only compares the drawn tokens with the guesses.
            rows.extend((0..=draft).map(|offset| params.map(|p| p.at_later_step(offset as u64))));
        }
        rows.iter().any(Option::is_some).then_some(rows)
    }

    /// An engine with a zeroed KV pool sized by `config`, its switches from the process's
    /// configuration ([`EngineSettings::from_config`] of `pagoda_config::global()`); the CLI
    /// passes the resolved configuration's settings with [`Engine::with_settings`].
    pub fn new(model: impl Into<Backend>, config: EngineConfig) -> Result<Engine, EngineError> {
        let settings = EngineSettings::from_config(pagoda_config::global());
        Self::with_settings(model, config, settings)
    }

    /// An engine with prefix caching forced on or off (the other switches as [`Engine::new`]).
    pub fn with_prefix_caching(
        model: impl Into<Backend>,
        config: EngineConfig,
        prefix_caching: bool,
    ) -> Result<Engine, EngineError> {
        let settings = EngineSettings {
            prefix_caching,
            ..EngineSettings::from_config(pagoda_config::global())
        };
        Self::with_settings(model, config, settings)
    }

    /// The model's configuration.
    pub fn model_config(&self) -> &ModelConfig {
        self.runner.config()
    }

    /// Whether the model runs on a CUDA GPU.
    pub fn is_cuda(&self) -> bool {
        self.runner.is_cuda()
    }

    /// Whether a request's outputs do not depend on the rest of its batch: on the CPU unless
    /// a batch-dependent kernel was chosen (`pagoda_ops::linear::batch_invariant`), on CUDA
    /// only in deterministic mode.
    pub fn batch_invariant(&self) -> bool {
        if self.is_cuda() {
            self.settings.cuda_kernels.deterministic
        } else {
            pagoda_ops::linear::batch_invariant()
        }
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.scheduler.config().prefix_caching
    }

    /// Bytes held by the KV pools.
    pub fn kv_bytes(&self) -> usize {
        self.runner.kv_bytes()
    }

    /// How CPU steps pick their thread pool (`None` on the GPU). Set from
    /// `PAGODA_CPU_ADAPTIVE_THREADS` when the engine is made.
    pub fn cpu_threads_mode(&self) -> Option<CpuThreadsMode> {
        self.runner.cpu_threads_mode()
    }

    /// Changes how CPU steps pick their thread pool (ignored on the GPU). Logits do not
    /// depend on it: only speed does.
    pub fn set_cpu_threads_mode(&mut self, mode: CpuThreadsMode) {
        self.runner.set_cpu_threads_mode(mode);
    }

    /// Adds what the CUDA runner counted since the last call to the engine's counters.
    fn absorb_runner_counters(&mut self) {
        if let Some(now) = self.runner.cuda_counters() {
            self.counters.add_difference(now, &self.runner_counted);
            self.runner_counted = now.clone();
        }
    }

    /// What has run so far.
    pub fn counters(&self) -> &EngineCounters {
        &self.counters
    }

    /// The scheduler's gauges and counters (pages free/used/cached/evictable, queue length,
    /// running count, prefix-hit tokens, preemptions).
    pub fn scheduler_stats(&self) -> SchedulerStats {
        self.scheduler.stats()
    }

    /// Pages held by requests (cached pages no request holds are not counted: they are
    /// reclaimed on demand).
    pub fn pages_used(&self) -> usize {
        self.scheduler.stats().pages_used
    }

    /// Pages on the free list.
    pub fn pages_free(&self) -> usize {
        self.scheduler.stats().pages_free
    }

    /// Starts (or stops) recording the prefix cache's changes for a KV-aware router outside
    /// the engine (NVIDIA Dynamo's KV events); [`take_kv_events`](Self::take_kv_events)
    /// drains them.
    pub fn record_kv_events(&mut self, on: bool) {
        self.scheduler.record_cache_events(on);
    }

    /// The prefix cache's changes since the last call, oldest first.
    pub fn take_kv_events(&mut self) -> Vec<CacheEvent> {
        self.scheduler.take_cache_events()
    }

    /// Pages registered in the prefix cache (shared with requests or evictable).
    pub fn pages_cached(&self) -> usize {
        self.scheduler.stats().pages_cached
    }

    /// Requests not yet finished (waiting or running).
    pub fn num_running(&self) -> usize {
        self.scheduler.num_unfinished()
    }

    /// Requests waiting for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.scheduler.stats().num_waiting
    }

    /// The seed a request's sampler uses (reported so runs can be replayed).
    pub fn seed_of(&self, id: RequestId) -> Option<u64> {
        self.requests.get(&id).map(|r| r.sampler.seed())
    }

    /// Runs one step: the scheduler's plan (every running decode, prefill chunks, newly
    /// admitted requests, under the token budget; preempting the youngest request when pages
    /// run out) in one batched forward. Returns one event per request that sampled a token
    /// this step (a request still prefilling a long prompt samples nothing until its last
    /// chunk; a preempted request samples nothing until it is recomputed).
    pub fn step(&mut self) -> Result<Vec<StepEvent>, EngineError> {
        let internal = |e: SchedulerError| EngineError::Internal(e.to_string());
        let step_started = std::time::Instant::now();
        self.propose_drafts();
        let plan = self.scheduler.schedule().map_err(internal)?;
        let scheduled = step_started.elapsed();
        if plan.is_empty() {
            self.scheduler.postprocess(&[]).map_err(internal)?;
            if self.scheduler.num_unfinished() == 0 {
                return Ok(Vec::new());
            }
            let stats = self.scheduler.stats();
            return Err(EngineError::OutOfPages {
                needed: 1,
                free: stats.pages_free,
                total: stats.pages_total,
            });
        }
        let tokens = plan.flat_tokens();
        let positions = plan.flat_positions();
        let slots = plan.flat_slots();
        let qo_indptr = plan.qo_indptr();
        let logits_for = plan.logits_for();
        let ids = plan.sampling_ids();
        let sparse = self.step_sparse(&plan);
        let drafts: Vec<usize> = plan
            .sequences
            .iter()
            .filter(|s| s.samples)
            .map(|s| s.draft)
            .collect();
        let device_rows = self.device_rows(&ids, &drafts);
        let rows_of: Vec<usize> = drafts
            .iter()
            .scan(0, |next, &draft| {
                let row = *next;
                *next += 1 + draft;
                Some(row)
            })
            .collect();
        let mut step_masks = self.take_constraints(&ids, &rows_of, device_rows.as_deref());
        let beside = self.settings.masks_beside && !step_masks.is_empty();
        let attention = self.config.attention;
        let runner = &mut self.runner;
        let output = plan
            .page_table()
            .map_err(|e| e.to_string())
            .and_then(|page_table| {
                let batch = ForwardBatch {
                    tokens: &tokens,
                    positions: &positions,
                    slots: &slots,
                    qo_indptr: &qo_indptr,
                    page_table: &page_table,
                    logits_for: &logits_for,
                    sparse: &sparse,
                };
                let rows = device_rows.as_deref();
                if !beside {
                    // Masks now (device rows need theirs before the sampler), or at sampling.
                    let masks = step_masks.on_device().then(|| step_masks.compute());
                    let source = || masks.clone().unwrap_or_default();
                    let source: Option<MaskSource> = masks.is_some().then_some(&source);
                    return runner.forward(&batch, attention, rows, source);
                }
                let on_device = step_masks.on_device();
                let masks = &mut step_masks;
                std::thread::scope(|scope| {
                    let (sender, receiver) = std::sync::mpsc::channel();
                    let worker = scope.spawn(move || {
                        let _ = sender.send(masks.compute());
                    });
                    let source = || receiver.recv().unwrap_or_default();
                    let source: Option<MaskSource> = on_device.then_some(&source);
                    let output = runner.forward(&batch, attention, rows, source);
                    worker
                        .join()
                        .map_err(|_| "the token-mask thread panicked".to_string())?;
                    output
                })
            });
        let constrained_step = !step_masks.is_empty();
        self.restore_constraints(step_masks);
        let output = match output {
            Ok(output) => output,
            Err(error) => {
                // The plan's KV is not written: drop its requests so nothing reads it.
                for sequence in &plan.sequences {
                    self.cancel(sequence.id);
                }
                self.scheduler.postprocess(&[]).map_err(internal)?;
                return Err(EngineError::Internal(error));
            }
        };
        self.counters.requests_split_kv += output.split_kv_requests as u64;
        self.counters.requests_gather += output.gather_requests as u64;
        match output.attention_path {
            Some(path) => {
                self.counters.record(path, tokens.len());
                if let Some(pools) = self.runner.cpu_pool_counters() {
                    self.counters.copy_cpu_pools(&pools);
                }
            }
            None => {
                self.counters.steps_cuda += 1;
                self.counters.tokens_forwarded += tokens.len() as u64;
                self.absorb_runner_counters();
            }
        }
        let logits = output.logits;
        let device_sampled = output.sampled;
        let forwarded = step_started.elapsed();

        // Sample, then let the scheduler append and finish.
        let vocab_size = self.runner.config().vocab_size;
        // Each request's sampler owns its random stream, so rows sample in parallel with the
        // same tokens as in order (128K-vocabulary rows cost ~0.1 ms each on one thread).
        if let Some(id) = ids.iter().find(|id| !self.requests.contains_key(id)) {
            return Err(EngineError::Internal(format!("request {id} has no state")));
        }
        let states: Vec<RequestState> = ids
            .iter()
            .filter_map(|id| self.requests.remove(id))
            .collect();
        // Each sampling sequence's logits rows: its last row, or with a draft one row per
        // guess more (verified in order, see `speculate.rs`).
        let mut rows = Vec::with_capacity(states.len());
        let mut next_row = 0;
        for sequence in plan.sequences.iter().filter(|s| s.samples) {
            let draft = &sequence.tokens[sequence.tokens.len() - sequence.draft..];
            rows.push((next_row, draft));
            next_row += 1 + sequence.draft;
        }
        let rule = self.settings.speculation.rule;
        let drawing = std::time::Instant::now();
        // Rows drawn on the device leave the host only their grammars to advance (about a
        // microsecond each): one thread does them faster than waking the pool (on the H100
        // host 16 such rows took 116 us through rayon, 273 us with grammars).
        let host_work = match device_sampled.as_ref() {
            Some(rows) => rows.iter().any(|r| matches!(r, SampledRow::Logits(_))),
            None => true,
        };
        let draw = |(mut state, (row, draft)): (RequestState, (usize, &[u32]))| {
            // Requests wanting log-probabilities are never sampled on the device; guessed
            // rows are verified on the host.
            let verified = match device_sampled.as_ref().map(|rows| &rows[row]) {
                Some(SampledRow::Token(_)) => {
                    let downloaded = device_sampled.as_ref().expect("matched above");
                    let drawn: Vec<u32> = downloaded[row..=row + draft.len()]
                        .iter()
                        .filter_map(SampledRow::token)
                        .collect();
                    state.accept_device_draws(&drawn, draft)
                }
                Some(SampledRow::Logits(_)) => {
                    let downloaded = device_sampled.as_ref().expect("matched above");
                    let rows: Vec<&[f32]> = downloaded[row..=row + draft.len()]
                        .iter()
                        .map(|r| match r {
                            SampledRow::Logits(values) => &values[..],
                            SampledRow::Token(_) => &[],
                        })
                        .collect();
                    state.verify(&rows, draft, rule)
                }
                None => {
                    let rows: Vec<&[f32]> = logits
                        [row * vocab_size..(row + 1 + draft.len()) * vocab_size]
                        .chunks_exact(vocab_size)
                        .collect();
                    state.verify(&rows, draft, rule)
                }
            };
            (state, verified)
        };
        let drawn: Vec<(RequestState, Verified)> = if host_work {
            states.into_par_iter().zip(rows).map(draw).collect()
        } else {
            states.into_iter().zip(rows).map(draw).collect()
        };
        let draw_us = drawing.elapsed().as_micros() as u64;
        if constrained_step {
            self.counters.structured_mask_accept_us += draw_us;
            self.counters.draw_constrained_us += draw_us;
        } else {
            self.counters.draw_free_us += draw_us;
        }
        let on_device: usize = drawn
            .iter()
            .filter(|(_, v)| v.on_device)
            .map(|(_, v)| v.tokens.len())
            .sum();
        self.counters.sampled_tokens_gpu += on_device as u64;
        let emitted: usize = drawn.iter().map(|(_, v)| v.tokens.len()).sum();
        self.counters.sampled_tokens_cpu += (emitted - on_device) as u64;
        let mut sampled = Vec::with_capacity(drawn.len());
        let mut outputs = Vec::with_capacity(drawn.len());
        for (id, ((state, verified), sequence)) in ids.into_iter().zip(
            drawn
                .into_iter()
                .zip(plan.sequences.iter().filter(|s| s.samples)),
        ) {
            self.count_verification(sequence.draft, &verified);
            let token = *verified.tokens.last().expect("verification emits a token");
            sampled.push(SampledToken {
                id,
                token,
                stop: state.stop_tokens.contains(&token) || state.constraint_finished(),
                accepted: verified.tokens.len() - 1,
            });
            outputs.push(verified);
            self.requests.insert(id, state);
        }
        let sampled_at = step_started.elapsed();
        let finished = self.scheduler.postprocess(&sampled).map_err(internal)?;
        tracing::trace!(
            target: "pagoda::step",
            "step of {} tokens: schedule {:?}, forward {:?}, sample {:?}, postprocess {:?}",
            tokens.len(),
            scheduled,
            forwarded - scheduled,
            sampled_at - forwarded,
            step_started.elapsed() - sampled_at
        );
        let mut events = Vec::with_capacity(emitted);
        for (sample, verified) in sampled.into_iter().zip(outputs) {
            let finished = finished
                .iter()
                .find(|f| f.id == sample.id)
                .map(|f| match f.reason {
                    pagoda_scheduler::FinishReason::Stop => FinishReason::Stop,
                    pagoda_scheduler::FinishReason::Length => FinishReason::Length,
                });
            let note = finished
                .and_then(|_| self.requests.remove(&sample.id))
                .and_then(|state| state.constraint_error);
            let last = verified.tokens.len() - 1;
            for (index, (token, logprobs)) in verified
                .tokens
                .into_iter()
                .zip(verified.logprobs)
                .enumerate()
            {
                events.push(StepEvent {
                    request: sample.id,
                    token,
                    logprobs,
                    finished: if index == last { finished } else { None },
                    note: if index == last { note.clone() } else { None },
                });
            }
        }
        let step_us = step_started.elapsed().as_micros() as u64;
        if constrained_step {
            self.counters.steps_constrained += 1;
            self.counters.step_constrained_us += step_us;
        } else {
            self.counters.steps_free += 1;
            self.counters.step_free_us += step_us;
        }
        self.record_speculation_step(&plan, step_started.elapsed(), emitted);
        let stats = self.scheduler.stats();
        self.counters.prefix_hit_tokens = stats.prefix_hit_tokens;
        self.counters.preemptions = stats.preemptions;
        self.counters.prefix_waits = stats.prefix_waits;
        Ok(events)
    }
}
