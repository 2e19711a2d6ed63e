//! The GPU runner: a [`CudaModel`]'s weights with the KV pools and step buffers they run in
//! ([`CudaRunner`]), beside the CPU runner of `backend.rs`. Each step stages its inputs
//! (token ids, positions, slots, the CSR page table, the rows that need logits) in pinned host
//! memory and uploads them asynchronously into the fixed device buffers (`staging.rs`),
//! queues the model's kernels ([`GpuModel::run`]) eagerly or replays a decode graph captured
//! per batch-size bucket (`step.rs`), and downloads the logits, or samples the rows the engine
//! hands it on the device and downloads only their tokens (`sampling.rs`): one
//! synchronization per step.

use half::bf16;
use pagoda_cuda::{CudaError, Gpu, GraphCache, PinnedBuffer};
use pagoda_models::config::ModelConfig;
use pagoda_models::llama::ForwardBatch;
use pagoda_models::llama_cuda::{GpuModel, StepBuffers};
use pagoda_ops::cuda::PoolLayout;

use crate::counters::EngineCounters;
use std::sync::Arc;

pub use pagoda_models::llama_cuda::{
    CudaCacheOptions, CudaModel, DType, PagedDecodeMode, SamplingRowParams,
};
pub use sampling::{MaskSource, SampledRow, TokenMasks};
pub use warmup::{WarmupReport, WARMUP_STAGES};

mod announce;
mod buckets;
mod cascade;
mod latent;
mod pieces;
mod sampling;
mod staging;
mod step;
mod warmup;

/// The KV pools (one K and one V per layer), the step buffers, the pinned staging of the
/// step inputs and the captured decode graphs.
struct GpuCache<T> {
    options: CudaCacheOptions,
    layout: PoolLayout,
    buffers: StepBuffers<T>,
    staging: Staging,
    /// Decode graphs by padded batch size; they replay `buffers`' addresses.
    graphs: GraphCache<usize>,
    /// Piecewise graphs of prefill and mixed steps by token bucket.
    pieces: pieces::PieceGraphs,
    /// The device sampler of `forward_sampled`, allocated on its first step.
    sampler: Option<sampling::DeviceSampler>,
}

/// Page-locked host copies of the step inputs, uploaded asynchronously before the step.
struct Staging {
    words: PinnedBuffer<u32>,
    slots: PinnedBuffer<i32>,
}

/// A model on the GPU with its KV cache and step buffers, ready to run steps.
pub struct CudaRunner {
    inner: Inner,
}

enum Inner {
    Bf16(TypedRunner<bf16>),
    F32(TypedRunner<f32>),
}

/// The runner of a model in element type `T`.
struct TypedRunner<T> {
    model: GpuModel<T>,
    cache: Option<GpuCache<T>>,
    /// Only the CUDA runner's counters move here (graphs, attention paths, GPU time, the
    /// device sampler's rows); the engine adds them to its own after each step.
    counters: EngineCounters,
}

impl<T> TypedRunner<T> {
    fn new(model: GpuModel<T>) -> Self {
        TypedRunner {
            model,
            cache: None,
            counters: EngineCounters::default(),
        }
    }
}

/// `$body` on the typed runner of `$runner`, whatever its element type.
macro_rules! typed {
    ($runner:expr, $typed:ident => $body:expr) => {
        match $runner {
            Inner::Bf16($typed) => $body,
            Inner::F32($typed) => $body,
        }
    };
}

impl CudaRunner {
    /// Allocates the KV pools and the step buffers of `options` for `model` (the cache starts
    /// empty). Kernels compile at their first launch and decode graphs are captured at
    /// their first use unless [`warm_up`](Self::warm_up) runs first.
    pub fn new(model: CudaModel, options: CudaCacheOptions) -> Result<CudaRunner, CudaError> {
        let mut runner = CudaRunner {
            inner: match model {
                CudaModel::Bf16(model) => Inner::Bf16(TypedRunner::new(model)),
                CudaModel::F32(model) => Inner::F32(TypedRunner::new(model)),
            },
        };
        runner.prepare(options)?;
        Ok(runner)
    }

    /// Reallocates the KV pools and the step buffers; the cache starts empty and the decode
    /// graphs are captured again (by the next warm-up, or at first use).
    pub fn prepare(&mut self, options: CudaCacheOptions) -> Result<(), CudaError> {
        typed!(&mut self.inner, runner => runner.prepare(options))
    }

    /// Bytes of the KV pools.
    pub fn kv_bytes(&self) -> usize {
        typed!(&self.inner, runner => runner.cache.as_ref().map_or(0, |c| c.buffers.kv_bytes()))
    }

    /// Bytes of sparse decode's key summaries, or why this runner cannot run sparse decode
    /// (its setup, in words naming the switch to change).
    pub fn sparse_summaries(&self) -> Result<usize, String> {
        typed!(&self.inner, runner => runner.sparse_summaries())
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> usize {
        typed!(&self.inner, runner => runner.model.weight_bytes())
    }

    /// The device the model lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        typed!(&self.inner, runner => runner.model.gpu())
    }

    /// What the steps did since load: graph replays and captures, eager steps, which
    /// attention path each step took, and the device sampler's rows.
    pub fn counters(&self) -> &EngineCounters {
        typed!(&self.inner, runner => &runner.counters)
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        typed!(&self.inner, runner => runner.model.config())
    }

    /// The dtype the model runs in.
    pub fn dtype(&self) -> DType {
        match self.inner {
            Inner::Bf16(_) => DType::BF16,
            Inner::F32(_) => DType::F32,
        }
    }

    /// Runs one ragged batch (the contract of `pagoda_models::llama::Model::forward`):
    /// appends the new tokens' K/V to the device cache and returns the f32 logits of
    /// `batch.logits_for`, `[logits_for.len(), vocab_size]`, copied to the host.
    pub fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, CudaError> {
        typed!(&mut self.inner, runner => runner.forward(batch))
    }

    /// Runs one ragged batch like [`forward`](Self::forward) but returns the hidden states
    /// after the final norm instead of logits: `[logits_for.len(), hidden_size]` f32 (the
    /// contract of `pagoda_models::llama::Model::final_hidden`; embeddings).
    pub fn final_hidden(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, CudaError> {
        typed!(&mut self.inner, runner => runner.final_hidden(batch))
    }

    /// Runs one ragged batch like [`forward`](Self::forward), then samples on the device:
    /// `rows` has one entry per `batch.logits_for` row, in order. A `Some(params)` row is
    /// drawn by the GPU sampler (`pagoda_ops::cuda::sample_rows`; the same token as
    /// `pagoda_ops::sampling::FusedSampler` at call number `params.step()` of a request
    /// seeded `params.seed()`, on the raw logits: the caller must leave rows that need
    /// penalties on the host) and comes back as [`SampledRow::Token`]; a `None` row comes
    /// back as [`SampledRow::Logits`] (its `[vocab_size]` f32 logits) for the host to sample.
    /// Only token ids and the `None` rows cross to the host. Errors (bad row count, a record
    /// outside the sampler's ranges: the message names the row) are returned before the
    /// step runs. The device sampler's workspace (`max_batch_tokens` rows x vocab) is
    /// allocated on the first call.
    pub fn forward_sampled(
        &mut self,
        batch: &ForwardBatch<'_>,
        rows: &[Option<SamplingRowParams>],
    ) -> Result<Vec<SampledRow>, CudaError> {
        typed!(&mut self.inner, runner => runner.forward_sampled(batch, rows, None))
    }

    /// [`forward_sampled`](Self::forward_sampled) with structured output's token masks:
    /// `masks` is called once the forward is enqueued, and its masks are applied to their
    /// rows' logits on the device before the sampler runs (disallowed tokens are never
    /// drawn).
    pub fn forward_sampled_masked(
        &mut self,
        batch: &ForwardBatch<'_>,
        rows: &[Option<SamplingRowParams>],
        masks: Option<MaskSource<'_>>,
    ) -> Result<Vec<SampledRow>, CudaError> {
        typed!(&mut self.inner, runner => runner.forward_sampled(batch, rows, masks))
    }
}
