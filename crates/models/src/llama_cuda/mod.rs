//! The llama family forward pass on an NVIDIA GPU (pagoda-cuda kernels and cuBLASLt GEMMs),
//! over a paged KV cache in device memory. The CPU [`Model`](crate::llama::Model) is its
//! reference: same batch contract ([`ForwardBatch`]), same numbers up to the dtype.
//!
//! Weights are held in bf16 (default) or f32 ([`DType`]); GGUF quantized tensors are
//! uploaded as blocks and dequantized on the device at load. Q/K/V and gate/up are fused into
//! one matrix each, so a layer runs four GEMMs; the residual adds ride on the GEMMs
//! (`beta = 1`) into an f32 residual stream (only GEMM inputs are rounded to bf16). Per-step
//! inputs (token ids, positions, slots, the CSR page table) go into device buffers allocated
//! once at their maximum size, so a step allocates nothing.
//!
//! Layout: this file holds the types and the public [`CudaModel`]; `weights.rs` uploads the
//! weights; `step.rs` sizes the cache and runs a forward;
//! `sampling.rs` samples on the device after a step ([`CudaModel::forward_sampled`]).
//!
//! Architectures: llama (Llama 2/3, SmolLM2, Mistral), Qwen2 (q/k/v bias, added after the
//! QKV GEMM) and Qwen3 (per-head q/k RMSNorm before RoPE).

use std::sync::Arc;

use half::bf16;
use pagoda_cuda::{CudaError, DeviceBuffer, Element, Gpu, GraphCache, PinnedBuffer};
use pagoda_ops::cuda::{self as ops, DecodeWorkspace, PoolLayout, RopeStyle as GpuRopeStyle};

use crate::config::ModelConfig;
use crate::llama::{ForwardBatch, LoadError};
use crate::weights::TensorSource;

pub use decode_path::{PagedDecodeMode, PAGED_DECODE_ENV_VAR};
pub use pagoda_ops::cuda::SamplingRowParams;
pub use sampling::SampledRow;

mod decode_path;
mod layers;
mod sampling;
mod staging;
mod step;
mod weights;

/// Element type of weights, activations and the KV cache on the GPU: [`DType::BF16`] (bf16
/// storage, f32 accumulation; the default) or [`DType::F32`] (f32 everywhere, for parity
/// checks against the CPU's exact mode).
pub use pagoda_tensor::DType;

/// Sizes of the KV pool and the step buffers ([`CudaModel::prepare`]).
#[derive(Debug, Clone, Copy)]
pub struct CudaCacheOptions {
    /// Pages in the KV pool.
    pub num_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Most tokens one forward may carry (prefill chunks + decode tokens).
    pub max_batch_tokens: usize,
    /// Most requests one forward may carry.
    pub max_batch_requests: usize,
    /// Longest visible sequence (bounds the baseline decode's gather scratch).
    pub max_context: usize,
    /// Replay decode steps from CUDA graphs captured per batch-size bucket (`false`: every
    /// kernel launched from the host, as `--enforce-eager`).
    pub cuda_graphs: bool,
    /// The decode attention path (`--paged-decode`).
    pub paged_decode: PagedDecodeMode,
}

/// What the GPU steps did since load (the engine exports them as metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaStepCounters {
    /// Decode steps replayed from a captured CUDA graph.
    pub graph_steps: u64,
    /// Graphs captured (one per batch-size bucket used).
    pub graphs_captured: u64,
    /// Steps launched kernel by kernel from the host.
    pub eager_steps: u64,
    /// Steps whose attention ran the baseline decode (gather the pages, then attend).
    pub decode_gather_steps: u64,
    /// Steps whose attention ran the fused split-KV paged decode.
    pub decode_fused_steps: u64,
    /// Fused decode steps in which some request's chunks were merged (more than one chunk).
    pub decode_fused_merged_steps: u64,
    /// Steps whose attention ran the ragged prefill kernel (prefill or mixed batches, and
    /// decode batches whose page tables exceed the gather workspace).
    pub prefill_kernel_steps: u64,
    /// GPU time of all steps, microseconds: from the inputs' upload to the logits being
    /// ready, or to the tokens being drawn in a sampled step, timed with CUDA events (the
    /// step's wall time minus this is host time).
    pub gpu_time_us: u64,
    /// Steps run by [`CudaModel::forward_sampled`] (rows sampled on the device).
    pub sampled_steps: u64,
    /// Rows of those steps whose token was drawn on the device.
    pub sampled_device_rows: u64,
    /// Rows of those steps left to the host (their logits row was downloaded).
    pub sampled_host_rows: u64,
    /// Device-sampled rows that took the greedy argmax (the GPU sampler's own totals, as
    /// the next three).
    pub sampler_greedy_rows: u64,
    /// Device-sampled rows drawn by Gumbel-max (no filter active).
    pub sampler_gumbel_rows: u64,
    /// Device-sampled filtered rows accepted by dual-pivot rejection.
    pub sampler_rejection_rows: u64,
    /// Device-sampled filtered rows that took the counted exact fallback.
    pub sampler_fallback_rows: u64,
    /// Dual-pivot rejection rounds of the device-sampled filtered rows.
    pub sampler_rejection_rounds: u64,
    /// Device-sampled filtered rows finished by the multi-CTA fast path.
    pub sampler_filtered_fast_rows: u64,
    /// Device-sampled filtered rows drawn by the single-CTA exact kernel (fast path off, or
    /// a row it left undecided).
    pub sampler_filtered_exact_rows: u64,
    /// Device-sampled rows whose maximum the Gumbel kernel found (launches without filtered
    /// rows: no row-maximum pass).
    pub sampler_gumbel_max_rows: u64,
    /// Filtered rows whose rounds ran on their id list (`sampling_list_rounds`).
    pub sampler_list_rows: u64,
    /// Filtered rows finished by the cluster kernel (`sampling_cluster`).
    pub sampler_cluster_rows: u64,
    /// Rows of the cluster kernel whose logits a resident row asked L2 for.
    pub sampler_prefetched_rows: u64,
}

/// A model resident on the GPU, with its KV cache.
pub struct CudaModel {
    config: ModelConfig,
    inner: Inner,
}

enum Inner {
    Bf16(GpuLlama<bf16>),
    F32(GpuLlama<f32>),
}

/// Host-side conversion into a device element type.
trait HostFloat: Element {
    fn from_f32(value: f32) -> Self;
}

impl HostFloat for f32 {
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl HostFloat for bf16 {
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

struct GpuLayer<T> {
    attn_norm: DeviceBuffer<T>,
    /// `[q_dim + 2 * kv_dim, hidden]`: Q, K and V stacked.
    wqkv: DeviceBuffer<T>,
    /// Qwen2: `[q_dim + 2 * kv_dim]`, the q, k and v biases stacked like `wqkv`'s rows.
    qkv_bias: Option<DeviceBuffer<T>>,
    /// Qwen3: per-head RMSNorm weights `[head_dim]` of q and k, applied before RoPE.
    q_norm: Option<DeviceBuffer<T>>,
    k_norm: Option<DeviceBuffer<T>>,
    wo: DeviceBuffer<T>,
    ffn_norm: DeviceBuffer<T>,
    /// `[2 * intermediate, hidden]`: gate then up.
    w_gate_up: DeviceBuffer<T>,
    w_down: DeviceBuffer<T>,
}

/// The KV pools (one K and one V per layer), the step buffers, the pinned staging of the
/// step inputs and the captured decode graphs.
struct GpuCache<T> {
    options: CudaCacheOptions,
    layout: PoolLayout,
    buffers: StepBuffers<T>,
    staging: Staging,
    /// Decode graphs by padded batch size; they replay `buffers`' addresses.
    graphs: GraphCache<usize>,
    /// The device sampler of `forward_sampled`, allocated on its first step.
    sampler: Option<sampling::DeviceSampler>,
}

/// Device memory a step reads and writes (the addresses a captured graph holds).
struct StepBuffers<T> {
    k_pools: Vec<DeviceBuffer<T>>,
    v_pools: Vec<DeviceBuffer<T>>,
    scratch: Scratch<T>,
    /// The gather decode's workspace (absent when every decode step runs fused).
    decode: Option<DecodeWorkspace<T>>,
    /// The fused decode (absent when the mode or the geometry selects gather).
    fused: Option<decode_path::FusedDecode>,
}

/// Page-locked host copies of the step inputs, uploaded asynchronously before the step.
struct Staging {
    words: PinnedBuffer<u32>,
    slots: PinnedBuffer<i32>,
}

/// Per-step buffers, allocated once at their maximum sizes.
struct Scratch<T> {
    /// The residual stream, always f32: rounding it to bf16 after each of the 2 * num_layers
    /// adds is what moves a bf16 model furthest from f32 (0.2 logprob on SmolLM2).
    x: DeviceBuffer<f32>,
    normed: DeviceBuffer<T>,
    qkv: DeviceBuffer<T>,
    attn: DeviceBuffer<T>,
    gate_up: DeviceBuffer<T>,
    act: DeviceBuffer<T>,
    selected: DeviceBuffer<f32>,
    selected_normed: DeviceBuffer<T>,
    logits: DeviceBuffer<f32>,
    tokens: DeviceBuffer<u32>,
    positions: DeviceBuffer<u32>,
    slots: DeviceBuffer<i32>,
    qo_indptr: DeviceBuffer<u32>,
    page_indptr: DeviceBuffer<u32>,
    page_indices: DeviceBuffer<u32>,
    last_page_len: DeviceBuffer<u32>,
    first_page_offset: DeviceBuffer<u32>,
    logits_rows: DeviceBuffer<u32>,
}

struct GpuLlama<T> {
    gpu: Arc<Gpu>,
    config: ModelConfig,
    embedding: DeviceBuffer<T>,
    lm_head: Option<DeviceBuffer<T>>,
    output_norm: DeviceBuffer<T>,
    inv_freq: DeviceBuffer<f32>,
    rope_style: GpuRopeStyle,
    layers: Vec<GpuLayer<T>>,
    cache: Option<GpuCache<T>>,
    counters: CudaStepCounters,
}

impl CudaModel {
    /// Uploads the model's weights to `gpu` in `dtype` (quantized tensors are dequantized
    /// there). `progress(done, total)` is called per layer. [`prepare`](Self::prepare) must
    /// size the KV cache before the first forward.
    pub fn load(
        config: ModelConfig,
        source: &dyn TensorSource,
        gpu: Arc<Gpu>,
        dtype: DType,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel, LoadError> {
        config.validate().map_err(|e| LoadError(e.to_string()))?;
        if !ops::SUPPORTED_HEAD_DIMS.contains(&config.head_dim) {
            return Err(LoadError(format!(
                "the CUDA attention kernels support head_dim {:?}, not {}",
                ops::SUPPORTED_HEAD_DIMS,
                config.head_dim
            )));
        }
        let inner = match dtype {
            DType::BF16 => Inner::Bf16(GpuLlama::load(&config, source, gpu, progress)?),
            DType::F32 => Inner::F32(GpuLlama::load(&config, source, gpu, progress)?),
            other => {
                return Err(LoadError(format!(
                    "the CUDA model runs in bf16 or f32, not {other}"
                )))
            }
        };
        Ok(CudaModel { config, inner })
    }

    /// Allocates (or reallocates) the KV pools and the step buffers; the cache starts empty.
    pub fn prepare(&mut self, options: CudaCacheOptions) -> Result<(), CudaError> {
        match &mut self.inner {
            Inner::Bf16(model) => model.prepare(options),
            Inner::F32(model) => model.prepare(options),
        }
    }

    /// Bytes of the KV pools (0 before [`prepare`](Self::prepare)).
    pub fn kv_bytes(&self) -> usize {
        let element = self.dtype().size_bytes();
        let pool = match &self.inner {
            Inner::Bf16(model) => model.cache.as_ref().map_or(0, |c| c.layout.pool_len()),
            Inner::F32(model) => model.cache.as_ref().map_or(0, |c| c.layout.pool_len()),
        };
        2 * self.config.num_layers * pool * element
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> usize {
        match &self.inner {
            Inner::Bf16(model) => model.weight_elements() * DType::BF16.size_bytes(),
            Inner::F32(model) => model.weight_elements() * DType::F32.size_bytes(),
        }
    }

    /// The device the model lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        match &self.inner {
            Inner::Bf16(model) => &model.gpu,
            Inner::F32(model) => &model.gpu,
        }
    }

    /// What the steps did since load: graph replays and captures, eager steps, and which
    /// attention path each step took.
    pub fn counters(&self) -> CudaStepCounters {
        match &self.inner {
            Inner::Bf16(model) => model.counters,
            Inner::F32(model) => model.counters,
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The dtype the model runs in.
    pub fn dtype(&self) -> DType {
        match self.inner {
            Inner::Bf16(_) => DType::BF16,
            Inner::F32(_) => DType::F32,
        }
    }

    /// Runs one ragged batch (the contract of [`crate::llama::Model::forward`]): appends the
    /// new tokens' K/V to the device cache and returns the f32 logits of `batch.logits_for`,
    /// `[logits_for.len(), vocab_size]`, copied to the host.
    pub fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, CudaError> {
        match &mut self.inner {
            Inner::Bf16(model) => model.forward(batch),
            Inner::F32(model) => model.forward(batch),
        }
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
        match &mut self.inner {
            Inner::Bf16(model) => model.forward_sampled(batch, rows),
            Inner::F32(model) => model.forward_sampled(batch, rows),
        }
    }
}
