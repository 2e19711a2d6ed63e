//! The llama family on an NVIDIA GPU (pagoda-cuda kernels and cuBLASLt GEMMs): the weights
//! in device memory ([`CudaModel`]) and the layer sequence of one step over the device step
//! buffers ([`GpuModel::run`], the CUDA steps of [`crate::decoder`]). The CPU
//! [`Model`](crate::llama::Model) is its reference: same batch contract ([`ForwardBatch`](crate::llama::ForwardBatch)),
//! same numbers up to the dtype. The GPU runner of `pagoda-engine` owns the KV pools and
//! step buffers ([`StepBuffers`]), stages each step's inputs, replays decode graphs and
//! samples on the device.
//!
//! Weights are held in bf16 (default) or f32 ([`DType`]); GGUF quantized matrices stay in
//! their blocks (`matrix.rs`: multiplied in place for a few rows, decoded into a scratch for
//! the GEMM of more; `PAGODA_CUDA_QUANT_WEIGHTS=off` dequantizes them at load instead). Q/K/V
//! and gate/up are fused into one matrix each, so a layer runs four GEMMs; the residual adds
//! ride on the GEMMs (`beta = 1`) into an f32 residual stream (only GEMM inputs are rounded to
//! bf16).
//!
//! Layout: this file holds the types and the public [`CudaModel`]; `weights.rs` uploads the
//! weights; `matrix.rs` holds a weight matrix and the linear layer over it; `buffers.rs` sizes the step buffers; `layers.rs` queues one step's kernels;
//! `pieces.rs` runs a step as piecewise graphs (everything but attention and the LM head);
//! `decode_path.rs` picks the decode attention (and loads the tuning table);
//! `prefill_path.rs` picks the streaming prefill's tiling; `cascade_path.rs` and
//! `sparse_path.rs` hold cascade and sparse decode steps; `kernels.rs` holds the configured
//! kernel choices; `experts.rs` holds the mixture-of-experts blocks.
//!
//! Architectures: llama (Llama 2/3, SmolLM2, Mistral), Qwen2 (q/k/v bias, added after the
//! QKV GEMM), Qwen3 (per-head q/k RMSNorm before RoPE), the mixture-of-experts Qwen3-MoE
//! and Mixtral (`experts.rs`, ADR 0010: router, expert lists and grouped expert MLP on the
//! device), and DeepSeek-V2/V3 (`mla_weights.rs`, `layers/mla.rs`, `mla_decode.rs`; ADR
//! 0009): latent attention with the dense leading layers and the expert layers (group-limited
//! routing, selection bias and shared experts on the device router of `experts.rs`).

use std::sync::Arc;

use half::bf16;
use pagoda_cuda::{DeviceBuffer, Element, Gpu};
use pagoda_ops::cuda::{self as ops, RopeStyle as GpuRopeStyle};

use crate::config::ModelConfig;
use crate::llama::LoadError;
use crate::weights::TensorSource;
use matrix::Matrix;

pub use buffers::{Attention, MlaScratch, Scratch, StepBuffers, StepShape};
pub use cascade_path::{CascadeLevels, CASCADE_SLOTS, CUDA_AUTO_CASCADE_RULE};
pub use decode_path::{FusedDecode, PagedDecodeMode, VariantSource, PAGED_DECODE_ENV_VAR};
pub use experts::MoeBuffers;
pub use kernels::{CudaKernels, DecodeKernelChoice, SamplingKernels};
pub use matrix::QuantScratch;
pub use mla_decode::MlaDecode;
pub use pagoda_ops::cuda::SamplingRowParams;
pub use pieces::Pieces;
pub use prefill_path::PrefillChoice;
pub use sparse_path::{sparse_grid_code, sparse_grid_pages, sparse_unsupported, SparseDecode};
pub use upload::KeepOnDevice;

mod buffers;
mod cascade_path;
mod decode_path;
mod experts;
mod kernels;
mod layers;
mod matrix;
mod mla_decode;
mod mla_weights;
mod pieces;
mod prefill_path;
mod sparse_path;
mod upload;
mod weights;

/// Element type of weights, activations and the KV cache on the GPU: [`DType::BF16`] (bf16
/// storage, f32 accumulation; the default) or [`DType::F32`] (f32 everywhere, for parity
/// checks against the CPU's exact mode).
pub use pagoda_tensor::DType;

/// Sizes of the KV pool and the step buffers ([`StepBuffers::new`]).
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
    /// The kernel choices, resolved from the configuration by the caller.
    pub kernels: CudaKernels,
}

/// A model's weights resident on the GPU, in the dtype it runs in.
pub enum CudaModel {
    /// bf16 weights and activations (f32 accumulation).
    Bf16(GpuModel<bf16>),
    /// f32 everywhere.
    F32(GpuModel<f32>),
}

/// An element type the GPU model runs in (`bf16`, `f32`), with the host conversion.
pub trait HostFloat: Element {
    /// `value` rounded to this type.
    fn from_f32(value: f32) -> Self;
    /// This value widened to f32.
    fn to_f32(self) -> f32;
}

impl HostFloat for f32 {
    fn from_f32(value: f32) -> Self {
        value
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl HostFloat for bf16 {
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

struct GpuLayer<T> {
    attn_norm: DeviceBuffer<T>,
    attention: LayerAttention<T>,
    ffn_norm: DeviceBuffer<T>,
    mlp: GpuMlp<T>,
}

/// A layer's attention block: grouped-query (the llama family) or DeepSeek's latent
/// attention.
// One per layer, built once: boxing a variant would only add an indirection.
#[allow(clippy::large_enum_variant)]
enum LayerAttention<T> {
    Gqa(GqaWeights<T>),
    Mla(mla_weights::MlaWeights<T>),
}

/// A grouped-query attention block's weights.
struct GqaWeights<T> {
    /// `[q_dim + 2 * kv_dim, hidden]`: Q, K and V stacked.
    wqkv: Matrix<T>,
    /// Qwen2: `[q_dim + 2 * kv_dim]`, the q, k and v biases stacked like `wqkv`'s rows.
    qkv_bias: Option<DeviceBuffer<T>>,
    /// Qwen3: per-head RMSNorm weights `[head_dim]` of q and k, applied before RoPE.
    q_norm: Option<DeviceBuffer<T>>,
    k_norm: Option<DeviceBuffer<T>>,
    wo: Matrix<T>,
}

/// A layer's MLP block.
enum GpuMlp<T> {
    /// One SiLU-gated MLP.
    Dense {
        /// `[2 * intermediate, hidden]`: gate then up.
        w_gate_up: Matrix<T>,
        w_down: Matrix<T>,
    },
    /// A router and its experts.
    Experts(Box<experts::GpuExperts<T>>),
}

/// A model's weights on the GPU in element type `T`.
pub struct GpuModel<T> {
    gpu: Arc<Gpu>,
    config: ModelConfig,
    embedding: Matrix<T>,
    lm_head: Option<Matrix<T>>,
    output_norm: DeviceBuffer<T>,
    inv_freq: DeviceBuffer<f32>,
    rope_style: GpuRopeStyle,
    layers: Vec<GpuLayer<T>>,
}

impl<T> GpuModel<T> {
    /// The device the weights live on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
}

impl CudaModel {
    /// Uploads the model's weights to `gpu` in `dtype`, quantized matrices kept in their
    /// blocks ([`CudaModel::load_with`]). `progress(done, total)` is called per layer. The
    /// engine's GPU runner sizes the KV cache and step buffers before the first step.
    pub fn load(
        config: ModelConfig,
        source: &dyn TensorSource,
        gpu: Arc<Gpu>,
        dtype: DType,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel, LoadError> {
        CudaModel::load_with(config, source, gpu, dtype, true, progress)
    }

    /// [`CudaModel::load`], with quantized matrices kept in their GGUF blocks where the GPU
    /// multiplies them in place (`keep_quantized`, `PAGODA_CUDA_QUANT_WEIGHTS`; bf16 only:
    /// f32 is the exact dtype of parity checks) or dequantized to `dtype` at load.
    pub fn load_with(
        config: ModelConfig,
        source: &dyn TensorSource,
        gpu: Arc<Gpu>,
        dtype: DType,
        keep_quantized: bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel, LoadError> {
        let keep = KeepOnDevice {
            gguf_blocks: keep_quantized,
            fp8: false,
            moe_experts: false,
        };
        CudaModel::load_keeping(config, source, gpu, dtype, keep, progress)
    }

    /// [`CudaModel::load_with`], FP8 matrices with one factor per row also kept in their
    /// bytes where `keep.fp8` (`PAGODA_CUDA_FP8_WEIGHTS`; bf16 only), and a GGUF
    /// mixture-of-experts model's stacked experts kept in their blocks where
    /// `keep.moe_experts` (`PAGODA_CUDA_MOE_QUANT`; with `keep.gguf_blocks` and bf16 only):
    /// the step buffers then need [`CudaKernels::moe_quant`] on.
    pub fn load_keeping(
        config: ModelConfig,
        source: &dyn TensorSource,
        gpu: Arc<Gpu>,
        dtype: DType,
        keep: KeepOnDevice,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel, LoadError> {
        config.validate().map_err(|e| LoadError(e.to_string()))?;
        if let Some(reason) = CudaModel::unsupported(&config) {
            return Err(LoadError(reason));
        }
        let bf16 = dtype == DType::BF16;
        let keep = KeepOnDevice {
            gguf_blocks: keep.gguf_blocks && bf16,
            fp8: keep.fp8 && bf16,
            moe_experts: keep.moe_experts,
        };
        let model = match dtype {
            DType::BF16 => CudaModel::Bf16(GpuModel::load(&config, source, gpu, keep, progress)?),
            DType::F32 => CudaModel::F32(GpuModel::load(&config, source, gpu, keep, progress)?),
            other => {
                return Err(LoadError(format!(
                    "the CUDA model runs in bf16 or f32, not {other}"
                )))
            }
        };
        let formats = match &model {
            CudaModel::Bf16(m) => m.quantized_formats(),
            CudaModel::F32(m) => m.quantized_formats(),
        };
        let gib = model.weight_bytes() as f64 / (1u64 << 30) as f64;
        let fp8 = model.fp8_bytes();
        if fp8 > 0 {
            tracing::info!(
                "CUDA weights: {fp8} bytes of FP8 (e4m3) matrices kept on the device with a \
                 factor per row, multiplied in place up to {} rows (PAGODA_CUDA_FP8_WEIGHTS)",
                ops::FP8_GEMV_MAX_ROWS
            );
        }
        if formats.is_empty() {
            tracing::info!("CUDA weights: {dtype}, {gib:.2} GiB");
        } else {
            let list: Vec<String> = formats.iter().map(|(f, n)| format!("{f} x{n}")).collect();
            tracing::info!(
                "CUDA weights: GGUF blocks kept on the device ({}), the rest {dtype}, {gib:.2} GiB \
                 (PAGODA_CUDA_QUANT_WEIGHTS)",
                list.join(", ")
            );
        }
        let (layers, bytes, formats) = match &model {
            CudaModel::Bf16(m) => m.quantized_experts(),
            CudaModel::F32(m) => m.quantized_experts(),
        };
        if layers > 0 {
            tracing::info!(
                "CUDA MoE: the stacked experts of {layers} layers stay in their GGUF blocks on the \
                 device ({}, gate/up/down), {:.2} GiB (PAGODA_CUDA_MOE_QUANT)",
                formats.join(", "),
                bytes as f64 / (1u64 << 30) as f64
            );
        }
        Ok(model)
    }

    /// Why the CUDA model declines `config`, or `None` where it runs it: host-side checks
    /// only (no device is opened), so the reason is the same on any machine. Declined: a
    /// router the device router does not take, latent attention shapes the MLA kernels do
    /// not compile for (and DeepSeek-V3.2's indexer), other attention's head dims outside
    /// the kernels'.
    pub fn unsupported(config: &ModelConfig) -> Option<String> {
        if let Some(moe) = config.moe.as_ref().filter(|_| config.has_expert_layers()) {
            if let Err(error) = experts::device_router(moe) {
                return Some(format!("{error} (use --device cpu)"));
            }
        }
        if let Some(reason) = mla_weights::mla_unsupported_config(config) {
            return Some(format!("{reason} (use --device cpu)"));
        }
        if config.mla.is_none() && !ops::SUPPORTED_HEAD_DIMS.contains(&config.head_dim) {
            return Some(format!(
                "the CUDA attention kernels support head_dim {:?}, not {}",
                ops::SUPPORTED_HEAD_DIMS,
                config.head_dim
            ));
        }
        None
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> usize {
        match self {
            CudaModel::Bf16(model) => model.weight_bytes(),
            CudaModel::F32(model) => model.weight_bytes(),
        }
    }

    /// Bytes of the FP8 matrices kept in their codes (`PAGODA_CUDA_FP8_WEIGHTS`).
    pub fn fp8_bytes(&self) -> usize {
        match self {
            CudaModel::Bf16(model) => model.fp8_bytes(),
            CudaModel::F32(model) => model.fp8_bytes(),
        }
    }

    /// Matrices of two quantized formats multiplied in one launch (`PAGODA_CUDA_QUANT_PAIR`).
    pub fn quant_pair_matrices(&self) -> usize {
        match self {
            CudaModel::Bf16(model) => model.quant_pair_matrices(),
            CudaModel::F32(model) => model.quant_pair_matrices(),
        }
    }

    /// Weight bytes a decode step of `rows` rows reads: [`CudaModel::weight_bytes`] less the
    /// experts no row is routed to, under uniform routing (as the CPU model's
    /// `step_weight_bytes`).
    pub fn step_weight_bytes(&self, rows: usize) -> f64 {
        let idle = match self {
            CudaModel::Bf16(model) => model.idle_expert_bytes(rows),
            CudaModel::F32(model) => model.idle_expert_bytes(rows),
        };
        self.weight_bytes() as f64 - idle
    }

    /// The device the model lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        match self {
            CudaModel::Bf16(model) => &model.gpu,
            CudaModel::F32(model) => &model.gpu,
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match self {
            CudaModel::Bf16(model) => &model.config,
            CudaModel::F32(model) => &model.config,
        }
    }

    /// The dtype the model runs in.
    pub fn dtype(&self) -> DType {
        match self {
            CudaModel::Bf16(_) => DType::BF16,
            CudaModel::F32(_) => DType::F32,
        }
    }
}
