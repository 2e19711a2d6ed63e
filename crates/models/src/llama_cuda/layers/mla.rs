//! CUDA's steps of DeepSeek's latent attention block ([`MlaStep`]; the CPU's are in
//! `llama/step/mla.rs`), over the GPU layout of `mla_weights.rs`. Per step of `T` tokens,
//! `H` heads:
//!
//! - `q [T, H, rope + nope]` (each head rope first), from `normed` directly or through
//!   `q_a`, its RMSNorm and `q_b`; the latent rows `[T, latent + rope]` (after the absorbed
//!   queries in the `qkv` buffer) from `kv_a`, their latent part RMSNormed in place.
//! - RoPE on q's heads and the rows' keys, then `mla_append` of the rows into the layer's
//!   latent pool.
//! - The absorbed queries `[T, H, latent + rope]` (in `qkv`): one strided batched GEMM of q's
//!   heads by `k_absorb`.
//! - Attention into `attn` `[T, H, latent]`: `mla_decode` (split-KV, the plan staged by
//!   [`MlaDecode`]) for a decode step, `mla_prefill` (causal, ragged, absorbed) otherwise.
//! - `values [T, H, v]`: one strided batched GEMM of the heads' latents by `v_up`; then the
//!   output projection, its residual add riding on the GEMM.

use pagoda_cuda::{view, view_mut, CudaError, DeviceRead, DeviceViewMut, GemmBatch};
use pagoda_ops::cuda::{self as ops, LatentPool, NewLatent, Queries};

use super::super::matrix::Linear;
use super::super::mla_weights::{MlaQueryWeights, MlaWeights};
use super::super::{GpuLayer, HostFloat, LayerAttention, MlaDecode, MlaScratch};
use super::GpuStep;
use crate::config::{MlaConfig, ModelConfig};
use crate::decoder::MlaStep;

/// A latent attention step's own buffers: views of [`MlaScratch`] cut to the step, and the
/// decode's workspace.
pub(in crate::llama_cuda) struct MlaStepBuffers<'a, T> {
    q_compressed: Option<DeviceViewMut<'a, T>>,
    q: DeviceViewMut<'a, T>,
    values: DeviceViewMut<'a, T>,
    decode: &'a mut Option<MlaDecode>,
}

impl<'a, T: HostFloat> MlaStepBuffers<'a, T> {
    /// The buffers of a step of `num_tokens` tokens for `config`'s latent attention (`None`
    /// for a model without one).
    pub(in crate::llama_cuda) fn new(
        config: &ModelConfig,
        scratch: Option<&'a mut MlaScratch<T>>,
        decode: &'a mut Option<MlaDecode>,
        num_tokens: usize,
    ) -> Result<Option<Self>, CudaError> {
        let Some(m) = &config.mla else {
            return Ok(None);
        };
        let scratch = scratch
            .ok_or_else(|| CudaError::invalid("a latent attention step without its scratch"))?;
        let heads = config.num_attention_heads;
        let q_compressed = match (&mut scratch.q_compressed, m.q_lora_rank) {
            (Some(buffer), Some(rank)) => Some(view_mut(buffer, 0..num_tokens * rank)?),
            _ => None,
        };
        Ok(Some(MlaStepBuffers {
            q_compressed,
            q: view_mut(&mut scratch.q, 0..num_tokens * heads * m.q_head_dim())?,
            values: view_mut(&mut scratch.values, 0..num_tokens * heads * m.v_head_dim)?,
            decode,
        }))
    }
}

/// The widths a latent attention step works with.
#[derive(Clone, Copy)]
struct LatentDims {
    heads: usize,
    hidden: usize,
    /// `kv_lora_rank`.
    latent: usize,
    rope: usize,
    /// A query head, `rope + nope`.
    q_head: usize,
    /// A latent row (and absorbed query head), `latent + rope`.
    row: usize,
    v: usize,
    /// The softmax scale with YaRN's correction.
    scale: f32,
}

fn latent_dims(c: &ModelConfig) -> Result<LatentDims, CudaError> {
    let m = c
        .mla
        .as_ref()
        .ok_or_else(|| CudaError::invalid("a latent attention step ran on a model without one"))?;
    Ok(LatentDims {
        heads: c.num_attention_heads,
        hidden: c.hidden_size,
        latent: m.kv_lora_rank,
        rope: m.qk_rope_head_dim,
        q_head: m.q_head_dim(),
        row: m.latent_row(),
        v: m.v_head_dim,
        scale: m.softmax_scale(),
    })
}

fn latent_weights<T>(layer: &GpuLayer<T>) -> Result<&MlaWeights<T>, CudaError> {
    match &layer.attention {
        LayerAttention::Mla(weights) => Ok(weights),
        LayerAttention::Gqa(_) => Err(CudaError::invalid(
            "a latent attention step ran on a grouped-query layer",
        )),
    }
}

fn missing_buffers() -> CudaError {
    CudaError::invalid("a latent attention step without its buffers")
}

/// `[heads]` products, one per head over its columns of a `[T, heads, width]` buffer, into
/// a `[T, heads, out_width]` one.
fn per_head(heads: usize, width: usize, out_width: usize) -> GemmBatch {
    GemmBatch {
        batch: heads,
        activations_row_stride: heads * width,
        activations_batch_stride: width,
        out_row_stride: heads * out_width,
        out_batch_stride: out_width,
    }
}

impl<T: HostFloat> MlaStep for GpuStep<'_, T> {
    fn mla_projection(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let w = latent_weights(layer)?;
        let d = latent_dims(&self.model.config)?;
        let (t, eps) = (self.num_tokens, MlaConfig::LATENT_NORM_EPS);
        let buffers = self.mla.as_mut().ok_or_else(missing_buffers)?;
        let mut linear = Linear {
            gpu: self.gpu,
            small: self.gemv,
            quant: &mut *self.quant,
        };
        let q_width = d.heads * d.q_head;
        match &w.query {
            MlaQueryWeights::Direct(wq) => linear.run(
                &self.normed,
                wq,
                &mut buffers.q,
                (t, q_width, d.hidden),
                0.0,
            )?,
            MlaQueryWeights::Compressed { q_a, q_a_norm, q_b } => {
                let compressed = buffers.q_compressed.as_mut().ok_or_else(missing_buffers)?;
                let rank = q_a_norm.len();
                linear.run(&self.normed, q_a, compressed, (t, rank, d.hidden), 0.0)?;
                ops::rms_norm_heads(self.gpu, compressed, q_a_norm, (t, 1, rank), eps)?;
                linear.run(&*compressed, q_b, &mut buffers.q, (t, q_width, rank), 0.0)?;
            }
        }
        let start = t * d.heads * d.row;
        let mut rows = view_mut(&mut self.qkv, start..start + t * d.row)?;
        linear.run(&self.normed, &w.kv_a, &mut rows, (t, d.row, d.hidden), 0.0)?;
        ops::rms_norm_heads(self.gpu, &mut rows, &w.kv_a_norm, (t, 1, d.row), eps)
    }

    fn mla_rope_append(&mut self, index: usize) -> Result<(), CudaError> {
        let d = latent_dims(&self.model.config)?;
        let t = self.num_tokens;
        let buffers = self.mla.as_mut().ok_or_else(missing_buffers)?;
        let (inv_freq, style) = (&self.model.inv_freq, self.model.rope_style);
        // Each query head starts with its rope dims (`mla_weights.rs`).
        let geometry = (d.heads, d.q_head, d.heads * d.q_head);
        ops::rope(
            self.gpu,
            &mut buffers.q,
            &self.positions,
            inv_freq,
            geometry,
            style,
        )?;
        let start = t * d.heads * d.row;
        let end = start + t * d.row;
        let mut keys = view_mut(&mut self.qkv, start + d.latent..end)?;
        let geometry = (1, d.rope, d.row);
        ops::rope(
            self.gpu,
            &mut keys,
            &self.positions,
            inv_freq,
            geometry,
            style,
        )?;
        let new = NewLatent {
            latent: view(&self.qkv, start..end)?,
            latent_row_stride: d.row,
            k_rope: view(&self.qkv, start + d.latent..end)?,
            rope_row_stride: d.row,
            slots: self.slots,
        };
        let pool = &mut self.k_pools[index];
        ops::mla_append(self.gpu, &new, pool, self.layout, d.latent)
    }

    fn mla_absorb(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let w = latent_weights(layer)?;
        let d = latent_dims(&self.model.config)?;
        let t = self.num_tokens;
        let buffers = self.mla.as_mut().ok_or_else(missing_buffers)?;
        let mut absorbed = view_mut(&mut self.qkv, 0..t * d.heads * d.row)?;
        let shape = (t, d.row, d.q_head);
        let batch = per_head(d.heads, d.q_head, d.row);
        let gpu = self.gpu;
        gpu.gemm_batched(&buffers.q, &w.k_absorb, &mut absorbed, shape, batch, 0.0)
    }

    fn mla_attention(&mut self, index: usize) -> Result<(), CudaError> {
        let d = latent_dims(&self.model.config)?;
        let (gpu, t) = (self.gpu, self.num_tokens);
        let requests = self.page_table.num_requests();
        let buffers = self.mla.as_mut().ok_or_else(missing_buffers)?;
        let queries = Queries::new(&self.qkv, d.heads, d.heads * d.row);
        let kv = LatentPool::new(
            &self.k_pools[index],
            *self.layout,
            self.page_table,
            d.latent,
        );
        let mut out = view_mut(&mut self.attn, 0..t * d.heads * d.latent)?;
        let planned = match buffers.decode.as_mut() {
            Some(decode) if requests == t => decode.planned(requests),
            _ => None,
        };
        match planned {
            Some(workspace) => ops::mla_decode(gpu, &queries, &kv, workspace, d.scale, &mut out),
            None => {
                let qo = &self.qo_indptr;
                ops::mla_prefill(gpu, &queries, &kv, qo, d.scale, &mut out)
            }
        }
    }

    fn mla_output(&mut self, layer: &GpuLayer<T>) -> Result<(), CudaError> {
        let w = latent_weights(layer)?;
        let d = latent_dims(&self.model.config)?;
        let t = self.num_tokens;
        let buffers = self.mla.as_mut().ok_or_else(missing_buffers)?;
        let latent = view(&self.attn, 0..t * d.heads * d.latent)?;
        let shape = (t, d.v, d.latent);
        let batch = per_head(d.heads, d.latent, d.v);
        let gpu = self.gpu;
        gpu.gemm_batched(&latent, &w.v_up, &mut buffers.values, shape, batch, 0.0)?;
        let mut linear = Linear {
            gpu,
            small: self.gemv,
            quant: &mut *self.quant,
        };
        let shape = (t, d.hidden, d.heads * d.v);
        linear.run(&buffers.values, &w.wo, &mut self.x, shape, 1.0)
    }
}
