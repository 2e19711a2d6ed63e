//! The llama family forward pass on an NVIDIA GPU (pagoda-cuda kernels and cuBLASLt GEMMs),
//! over a paged KV cache in device memory. The CPU [`Model`](crate::llama::Model) is its
//! reference: same batch contract ([`ForwardBatch`]), same numbers up to the dtype.
//!
//! Weights are held in bf16 (default) or f32 ([`GpuDType`]); GGUF quantized tensors are
//! uploaded as blocks and dequantized on the device at load. Q/K/V and gate/up are fused into
//! one matrix each, so a layer runs four GEMMs; the residual adds ride on the GEMMs
//! (`beta = 1`) into an f32 residual stream (only GEMM inputs are rounded to bf16). Per-step inputs (token ids, positions, slots, the CSR page table) go into
//! device buffers allocated once at their maximum size, so a step allocates nothing.
//!
//! Supported now: the llama architecture (Llama 2/3, SmolLM2, Mistral). Qwen2's q/k/v bias
//! and Qwen3's q/k norms are refused with a clear error until their kernels land.

use std::sync::Arc;

use half::bf16;
use pagoda_cuda::ops::{self, DevicePageTable, PoolLayout, QuantFormat, RopeStyle as GpuRopeStyle};
use pagoda_cuda::{view, view_mut, CudaError, DeviceBuffer, DeviceRead, Element, Gpu};
use pagoda_tensor::GgmlType;

use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::llama::{ForwardBatch, LoadError};
use crate::weights::{names, TensorSource};

/// Element type of weights, activations and the KV cache on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuDType {
    /// bfloat16 storage, f32 accumulation (the default).
    Bf16,
    /// f32 everywhere (parity checks against the CPU's exact mode).
    F32,
}

impl std::fmt::Display for GpuDType {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            GpuDType::Bf16 => "bf16",
            GpuDType::F32 => "f32",
        })
    }
}

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
    wo: DeviceBuffer<T>,
    ffn_norm: DeviceBuffer<T>,
    /// `[2 * intermediate, hidden]`: gate then up.
    w_gate_up: DeviceBuffer<T>,
    w_down: DeviceBuffer<T>,
}

/// The KV pools (one K and one V per layer) and the step buffers.
struct GpuCache<T> {
    options: CudaCacheOptions,
    layout: PoolLayout,
    k_pools: Vec<DeviceBuffer<T>>,
    v_pools: Vec<DeviceBuffer<T>>,
    scratch: Scratch<T>,
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
}

impl CudaModel {
    /// Uploads the model's weights to `gpu` in `dtype` (quantized tensors are dequantized
    /// there). `progress(done, total)` is called per layer. [`prepare`](Self::prepare) must
    /// size the KV cache before the first forward.
    pub fn load(
        config: ModelConfig,
        source: &dyn TensorSource,
        gpu: Arc<Gpu>,
        dtype: GpuDType,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel, LoadError> {
        config.validate().map_err(LoadError)?;
        if config.architecture != Architecture::Llama {
            return Err(LoadError(format!(
                "the CUDA backend runs the llama architecture for now, not {}; use --device cpu",
                config.architecture.name()
            )));
        }
        if !ops::SUPPORTED_HEAD_DIMS.contains(&config.head_dim) {
            return Err(LoadError(format!(
                "the CUDA attention kernels support head_dim {:?}, not {}",
                ops::SUPPORTED_HEAD_DIMS,
                config.head_dim
            )));
        }
        let inner = match dtype {
            GpuDType::Bf16 => Inner::Bf16(GpuLlama::load(&config, source, gpu, progress)?),
            GpuDType::F32 => Inner::F32(GpuLlama::load(&config, source, gpu, progress)?),
        };
        Ok(CudaModel { config, inner })
    }

    /// Allocates (or reallocates) the KV pools and the step buffers; the cache starts empty.
    pub fn prepare(&mut self, options: CudaCacheOptions) -> Result<(), String> {
        match &mut self.inner {
            Inner::Bf16(model) => model.prepare(options),
            Inner::F32(model) => model.prepare(options),
        }
        .map_err(|e| format!("allocating the GPU KV cache: {e}"))
    }

    /// Bytes of the KV pools (0 before [`prepare`](Self::prepare)).
    pub fn kv_bytes(&self) -> usize {
        let element = match self.inner {
            Inner::Bf16(_) => 2,
            Inner::F32(_) => 4,
        };
        let pool = match &self.inner {
            Inner::Bf16(model) => model.cache.as_ref().map_or(0, |c| c.layout.pool_len()),
            Inner::F32(model) => model.cache.as_ref().map_or(0, |c| c.layout.pool_len()),
        };
        2 * self.config.num_layers * pool * element
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> usize {
        match &self.inner {
            Inner::Bf16(model) => model.weight_elements() * 2,
            Inner::F32(model) => model.weight_elements() * 4,
        }
    }

    /// The device the model lives on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        match &self.inner {
            Inner::Bf16(model) => &model.gpu,
            Inner::F32(model) => &model.gpu,
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The dtype the model runs in.
    pub fn dtype(&self) -> GpuDType {
        match self.inner {
            Inner::Bf16(_) => GpuDType::Bf16,
            Inner::F32(_) => GpuDType::F32,
        }
    }

    /// Runs one ragged batch (the contract of [`crate::llama::Model::forward`]): appends the
    /// new tokens' K/V to the device cache and returns the f32 logits of `batch.logits_for`,
    /// `[logits_for.len(), vocab_size]`, copied to the host.
    pub fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, String> {
        match &mut self.inner {
            Inner::Bf16(model) => model.forward(batch),
            Inner::F32(model) => model.forward(batch),
        }
        .map_err(|e| e.to_string())
    }
}

fn gpu_error(context: &str) -> impl Fn(CudaError) -> LoadError + '_ {
    move |e| LoadError(format!("{context}: {e}"))
}

impl<T: HostFloat> GpuLlama<T> {
    fn load(
        config: &ModelConfig,
        source: &dyn TensorSource,
        gpu: Arc<Gpu>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, LoadError> {
        let c = config;
        let q_dim = c.num_attention_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        let g = &gpu;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let n = |suffix: &str| names::layer(i, suffix);
            for optional in [names::ATTN_Q_BIAS, names::ATTN_Q_NORM] {
                if source.tensor(&n(optional)).is_some() {
                    return Err(LoadError(format!(
                        "tensor {} needs a kernel the CUDA backend lacks yet; use --device cpu",
                        n(optional)
                    )));
                }
            }
            let wqkv = stacked::<T>(
                g,
                source,
                &[
                    (n(names::ATTN_Q), q_dim),
                    (n(names::ATTN_K), kv_dim),
                    (n(names::ATTN_V), kv_dim),
                ],
                c.hidden_size,
            )?;
            let w_gate_up = stacked::<T>(
                g,
                source,
                &[
                    (n(names::FFN_GATE), c.intermediate_size),
                    (n(names::FFN_UP), c.intermediate_size),
                ],
                c.hidden_size,
            )?;
            layers.push(GpuLayer {
                attn_norm: upload_tensor(g, source, &n(names::ATTN_NORM), &[c.hidden_size])?,
                wqkv,
                wo: upload_tensor(g, source, &n(names::ATTN_OUTPUT), &[c.hidden_size, q_dim])?,
                ffn_norm: upload_tensor(g, source, &n(names::FFN_NORM), &[c.hidden_size])?,
                w_gate_up,
                w_down: upload_tensor(
                    g,
                    source,
                    &n(names::FFN_DOWN),
                    &[c.hidden_size, c.intermediate_size],
                )?,
            });
            progress(i + 1, c.num_layers + 1);
        }
        let embedding = upload_tensor(
            g,
            source,
            names::TOKEN_EMBEDDING,
            &[c.vocab_size, c.hidden_size],
        )?;
        let lm_head = if c.tie_word_embeddings && source.tensor(names::OUTPUT).is_none() {
            None
        } else {
            Some(upload_tensor(
                g,
                source,
                names::OUTPUT,
                &[c.vocab_size, c.hidden_size],
            )?)
        };
        let output_norm = upload_tensor(g, source, names::OUTPUT_NORM, &[c.hidden_size])?;
        let inv_freq = upload_inv_freq(g, source, c)?;
        let rope_style = match c.rope_style {
            RopeStyle::Interleaved => GpuRopeStyle::Interleaved,
            RopeStyle::Halves => GpuRopeStyle::Halves,
        };
        progress(c.num_layers + 1, c.num_layers + 1);
        Ok(GpuLlama {
            gpu,
            config: c.clone(),
            embedding,
            lm_head,
            output_norm,
            inv_freq,
            rope_style,
            layers,
            cache: None,
        })
    }

    fn weight_elements(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.len()
                    + l.wqkv.len()
                    + l.wo.len()
                    + l.ffn_norm.len()
                    + l.w_gate_up.len()
                    + l.w_down.len()
            })
            .sum();
        layers
            + self.embedding.len()
            + self.lm_head.as_ref().map_or(0, |h| h.len())
            + self.output_norm.len()
    }

    fn prepare(&mut self, options: CudaCacheOptions) -> Result<(), CudaError> {
        let c = &self.config;
        let layout = PoolLayout {
            num_pages: options.num_pages,
            page_size: options.page_size,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        layout.validate()?;
        // Free the old cache before allocating the new one.
        self.cache = None;
        let gpu = &*self.gpu;
        let mut k_pools = Vec::with_capacity(c.num_layers);
        let mut v_pools = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            k_pools.push(gpu.zeros(layout.pool_len())?);
            v_pools.push(gpu.zeros(layout.pool_len())?);
        }
        let scratch = Scratch::new(gpu, c, &options)?;
        self.cache = Some(GpuCache {
            options,
            layout,
            k_pools,
            v_pools,
            scratch,
        });
        Ok(())
    }

    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>, CudaError> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let Some(cache) = self.cache.as_mut() else {
            return Err(CudaError::invalid(
                "the KV cache is not allocated: call prepare first",
            ));
        };
        let options = cache.options;
        let layout = cache.layout;
        let num_tokens = batch.tokens.len();
        let num_requests = batch.qo_indptr.len().saturating_sub(1);
        let num_logits = batch.logits_for.len();
        let table = batch.page_table;
        if num_tokens == 0 || num_tokens > options.max_batch_tokens {
            return Err(CudaError::invalid(format!(
                "a step of {num_tokens} tokens (at most {} per step)",
                options.max_batch_tokens
            )));
        }
        if num_requests > options.max_batch_requests || num_logits > num_tokens {
            return Err(CudaError::invalid(format!(
                "a step of {num_requests} requests / {num_logits} logit rows exceeds the buffers"
            )));
        }
        if batch.positions.len() != num_tokens || batch.slots.len() != num_tokens {
            return Err(CudaError::invalid(
                "tokens, positions and slots differ in length",
            ));
        }
        if let Some(&token) = batch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(CudaError::invalid(format!(
                "token {token} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        if let Some(&row) = batch.logits_for.iter().find(|&&t| t >= num_tokens) {
            return Err(CudaError::invalid(format!(
                "logits requested for token {row} of {num_tokens}"
            )));
        }
        if table.indices.len() > cache.scratch.page_indices.len() {
            return Err(CudaError::invalid("the page table is larger than the pool"));
        }
        let (hidden, q_dim, kv_dim) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        let qkv_dim = q_dim + 2 * kv_dim;
        let inter = c.intermediate_size;
        let page_size = layout.page_size;

        // Host inputs into the fixed device buffers.
        let s = &mut cache.scratch;
        let slots: Vec<i32> = batch
            .slots
            .iter()
            .map(|slot| slot.physical_index(page_size) as i32)
            .collect();
        let logits_rows: Vec<u32> = batch.logits_for.iter().map(|&t| t as u32).collect();
        upload_prefix(gpu, batch.tokens, &mut s.tokens)?;
        upload_prefix(gpu, batch.positions, &mut s.positions)?;
        upload_prefix(gpu, &slots, &mut s.slots)?;
        upload_prefix(gpu, batch.qo_indptr, &mut s.qo_indptr)?;
        upload_prefix(gpu, &table.indptr, &mut s.page_indptr)?;
        upload_prefix(gpu, &table.indices, &mut s.page_indices)?;
        upload_prefix(gpu, &table.last_page_len, &mut s.last_page_len)?;
        upload_prefix(gpu, &table.first_page_offset, &mut s.first_page_offset)?;
        upload_prefix(gpu, &logits_rows, &mut s.logits_rows)?;

        let tokens = view(&s.tokens, 0..num_tokens)?;
        let positions = view(&s.positions, 0..num_tokens)?;
        let slots = view(&s.slots, 0..num_tokens)?;
        let qo_indptr = view(&s.qo_indptr, 0..num_requests + 1)?;
        let page_indptr = view(&s.page_indptr, 0..num_requests + 1)?;
        let page_indices = view(&s.page_indices, 0..table.indices.len().max(1))?;
        let last_page_len = view(&s.last_page_len, 0..num_requests)?;
        let first_page_offset = view(&s.first_page_offset, 0..num_requests)?;
        let page_table = DevicePageTable::new(
            &page_indptr,
            &page_indices,
            &last_page_len,
            &first_page_offset,
        )?;

        let mut x = view_mut(&mut s.x, 0..num_tokens * hidden)?;
        let mut normed = view_mut(&mut s.normed, 0..num_tokens * hidden)?;
        let mut qkv = view_mut(&mut s.qkv, 0..num_tokens * qkv_dim)?;
        let mut attn = view_mut(&mut s.attn, 0..num_tokens * q_dim)?;
        let mut gate_up = view_mut(&mut s.gate_up, 0..num_tokens * 2 * inter)?;
        let mut act = view_mut(&mut s.act, 0..num_tokens * inter)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();

        ops::embedding_gather(gpu, &self.embedding, &tokens, &mut x, c.vocab_size, hidden)?;
        for ((layer, k_pool), v_pool) in self
            .layers
            .iter()
            .zip(&mut cache.k_pools)
            .zip(&mut cache.v_pools)
        {
            ops::rms_norm(gpu, &x, &layer.attn_norm, &mut normed, c.rms_norm_eps)?;
            gpu.gemm(
                &normed,
                &layer.wqkv,
                &mut qkv,
                (num_tokens, qkv_dim, hidden),
                0.0,
            )?;
            {
                let mut q = view_mut(&mut qkv, 0..num_tokens * qkv_dim)?;
                ops::rope(
                    gpu,
                    &mut q,
                    &positions,
                    &self.inv_freq,
                    (c.num_attention_heads, c.head_dim, qkv_dim),
                    self.rope_style,
                )?;
            }
            {
                let mut k = view_mut(&mut qkv, q_dim..num_tokens * qkv_dim)?;
                ops::rope(
                    gpu,
                    &mut k,
                    &positions,
                    &self.inv_freq,
                    (c.num_kv_heads, c.head_dim, qkv_dim),
                    self.rope_style,
                )?;
            }
            {
                let k_new = view(&qkv, q_dim..num_tokens * qkv_dim)?;
                let v_new = view(&qkv, q_dim + kv_dim..num_tokens * qkv_dim)?;
                ops::kv_append(
                    gpu,
                    k_pool,
                    v_pool,
                    &layout,
                    &k_new,
                    &v_new,
                    &slots,
                    (qkv_dim, qkv_dim),
                )?;
            }
            ops::prefill_attention(
                gpu,
                &qkv,
                (c.num_attention_heads, qkv_dim),
                &*k_pool,
                &*v_pool,
                &layout,
                &page_table,
                &qo_indptr,
                scale,
                &mut attn,
            )?;
            // x += attn · Wo^T (the residual add rides on the GEMM).
            gpu.gemm(&attn, &layer.wo, &mut x, (num_tokens, hidden, q_dim), 1.0)?;
            ops::rms_norm(gpu, &x, &layer.ffn_norm, &mut normed, c.rms_norm_eps)?;
            gpu.gemm(
                &normed,
                &layer.w_gate_up,
                &mut gate_up,
                (num_tokens, 2 * inter, hidden),
                0.0,
            )?;
            {
                let gate = view(&gate_up, 0..num_tokens * 2 * inter)?;
                let up = view(&gate_up, inter..num_tokens * 2 * inter)?;
                ops::silu_mul(gpu, &gate, &up, &mut act, inter, (2 * inter, 2 * inter))?;
            }
            gpu.gemm(
                &act,
                &layer.w_down,
                &mut x,
                (num_tokens, hidden, inter),
                1.0,
            )?;
        }

        if num_logits == 0 {
            // A prefill chunk that samples nothing: the KV is written, no logits needed.
            return Ok(Vec::new());
        }
        // Only the rows that need logits go through the final norm and the LM head.
        let rows = view(&s.logits_rows, 0..num_logits)?;
        let mut selected = view_mut(&mut s.selected, 0..num_logits * hidden)?;
        ops::embedding_gather(gpu, &x, &rows, &mut selected, num_tokens, hidden)?;
        let mut selected_normed = view_mut(&mut s.selected_normed, 0..num_logits * hidden)?;
        ops::rms_norm(
            gpu,
            &selected,
            &self.output_norm,
            &mut selected_normed,
            c.rms_norm_eps,
        )?;
        let mut logits = view_mut(&mut s.logits, 0..num_logits * c.vocab_size)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        gpu.gemm(
            &selected_normed,
            head,
            &mut logits,
            (num_logits, c.vocab_size, hidden),
            0.0,
        )?;
        gpu.download(&logits)
    }
}

impl<T: HostFloat> Scratch<T> {
    fn new(gpu: &Gpu, c: &ModelConfig, o: &CudaCacheOptions) -> Result<Self, CudaError> {
        let tokens = o.max_batch_tokens.max(1);
        let requests = o.max_batch_requests.max(1);
        let q_dim = c.num_attention_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        // Shared prefix pages appear once per request that holds them.
        let table_pages =
            o.num_pages.max(1) + requests * o.max_context.div_ceil(o.page_size.max(1));
        Ok(Scratch {
            x: gpu.zeros(tokens * c.hidden_size)?,
            normed: gpu.zeros(tokens * c.hidden_size)?,
            qkv: gpu.zeros(tokens * (q_dim + 2 * kv_dim))?,
            attn: gpu.zeros(tokens * q_dim)?,
            gate_up: gpu.zeros(tokens * 2 * c.intermediate_size)?,
            act: gpu.zeros(tokens * c.intermediate_size)?,
            selected: gpu.zeros(tokens * c.hidden_size)?,
            selected_normed: gpu.zeros(tokens * c.hidden_size)?,
            logits: gpu.zeros(tokens * c.vocab_size)?,
            tokens: gpu.zeros(tokens)?,
            positions: gpu.zeros(tokens)?,
            slots: gpu.zeros(tokens)?,
            qo_indptr: gpu.zeros(requests + 1)?,
            page_indptr: gpu.zeros(requests + 1)?,
            page_indices: gpu.zeros(table_pages)?,
            last_page_len: gpu.zeros(requests)?,
            first_page_offset: gpu.zeros(requests)?,
            logits_rows: gpu.zeros(tokens)?,
        })
    }
}

fn upload_prefix<T: Element>(
    gpu: &Gpu,
    host: &[T],
    buffer: &mut DeviceBuffer<T>,
) -> Result<(), CudaError> {
    if host.is_empty() {
        return Ok(());
    }
    if host.len() > buffer.len() {
        return Err(CudaError::invalid(format!(
            "{} step inputs exceed a buffer of {}",
            host.len(),
            buffer.len()
        )));
    }
    let mut destination = view_mut(buffer, 0..host.len())?;
    gpu.upload_into(host, &mut destination)
}

/// Uploads one float or quantized tensor as `T`, checking its shape.
fn upload_tensor<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    name: &str,
    shape: &[usize],
) -> Result<DeviceBuffer<T>, LoadError> {
    let len: usize = shape.iter().product();
    let mut out = gpu.alloc::<T>(len).map_err(gpu_error(name))?;
    upload_tensor_into(gpu, source, name, shape, &mut out)?;
    Ok(out)
}

fn upload_tensor_into<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    name: &str,
    shape: &[usize],
    out: &mut impl pagoda_cuda::DeviceWrite<T>,
) -> Result<(), LoadError> {
    let raw = source
        .tensor(name)
        .ok_or_else(|| LoadError(format!("tensor {name} is missing from the model file")))?;
    let len: usize = shape.iter().product();
    if raw.shape.iter().product::<usize>() != len || (shape.len() > 1 && raw.shape != shape) {
        return Err(LoadError(format!(
            "tensor {name} has shape {:?}, expected {shape:?}",
            raw.shape
        )));
    }
    let format = match raw.ty {
        GgmlType::Q4_0 => Some(QuantFormat::Q4_0),
        GgmlType::Q4_1 => Some(QuantFormat::Q4_1),
        GgmlType::Q8_0 => Some(QuantFormat::Q8_0),
        GgmlType::Q4K => Some(QuantFormat::Q4K),
        GgmlType::Q5K => Some(QuantFormat::Q5K),
        GgmlType::Q6K => Some(QuantFormat::Q6K),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
        other => {
            return Err(LoadError(format!(
                "tensor {name} has type {other}, which the CUDA backend cannot load yet"
            )))
        }
    };
    match format {
        Some(format) => {
            let blocks = gpu.upload(&raw.data[..]).map_err(gpu_error(name))?;
            ops::dequantize(gpu, format, &blocks, out).map_err(gpu_error(name))
        }
        None => {
            let mut values = vec![0f32; len];
            pagoda_tensor::quant::dequantize(raw.ty, &raw.data, &mut values)
                .map_err(|e| LoadError(format!("tensor {name}: {e}")))?;
            let converted: Vec<T> = values.into_iter().map(T::from_f32).collect();
            gpu.upload_into(&converted, out).map_err(gpu_error(name))
        }
    }
}

/// Several `[rows_i, cols]` matrices stacked into one `[sum rows_i, cols]` buffer.
fn stacked<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    parts: &[(String, usize)],
    cols: usize,
) -> Result<DeviceBuffer<T>, LoadError> {
    let total_rows: usize = parts.iter().map(|(_, rows)| rows).sum();
    let mut out = gpu
        .alloc::<T>(total_rows * cols)
        .map_err(gpu_error("weights"))?;
    let mut row = 0;
    for (name, rows) in parts {
        let mut part =
            view_mut(&mut out, row * cols..(row + rows) * cols).map_err(gpu_error(name))?;
        upload_tensor_into(gpu, source, name, &[*rows, cols], &mut part)?;
        row += rows;
    }
    Ok(out)
}

/// The rotation frequencies, computed exactly as the CPU model's `Rope` (llama3 scaling or
/// GGUF's `rope_freqs` factors folded in).
fn upload_inv_freq(
    gpu: &Gpu,
    source: &dyn TensorSource,
    c: &ModelConfig,
) -> Result<DeviceBuffer<f32>, LoadError> {
    let rope = crate::llama::rope_for(c, source)?;
    gpu.upload(rope.inverse_frequencies())
        .map_err(gpu_error("rope frequencies"))
}
