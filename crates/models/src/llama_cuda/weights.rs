//! Uploading a model's weights to the GPU: float tensors converted on the host, quantized GGUF
//! tensors dequantized on the device, Q/K/V and gate/up stacked into one matrix each.

use std::sync::Arc;

use pagoda_cuda::{view_mut, CudaError, DeviceBuffer, DeviceRead, Gpu};
use pagoda_ops::cuda::{self as ops, QuantFormat, RopeStyle as GpuRopeStyle};
use pagoda_tensor::GgmlType;
use rayon::prelude::*;

use super::{GpuLayer, GpuModel, HostFloat};
use crate::config::{Architecture, ModelConfig, RopeStyle};
use crate::llama::LoadError;
use crate::weights::{names, TensorSource};

fn gpu_error(context: &str) -> impl Fn(CudaError) -> LoadError + '_ {
    move |e| LoadError(format!("{context}: {e}"))
}

impl<T: HostFloat> GpuModel<T> {
    pub(super) fn load(
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
            let qkv_bias = qkv_bias::<T>(
                g,
                source,
                &[
                    (n(names::ATTN_Q_BIAS), 0, q_dim),
                    (n(names::ATTN_K_BIAS), q_dim, kv_dim),
                    (n(names::ATTN_V_BIAS), q_dim + kv_dim, kv_dim),
                ],
            )?;
            let optional_norm = |name: String| -> Result<Option<DeviceBuffer<T>>, LoadError> {
                match source.tensor(&name) {
                    Some(_) => upload_tensor(g, source, &name, &[c.head_dim]).map(Some),
                    None => Ok(None),
                }
            };
            let q_norm = optional_norm(n(names::ATTN_Q_NORM))?;
            let k_norm = optional_norm(n(names::ATTN_K_NORM))?;
            if c.architecture == Architecture::Qwen3 && (q_norm.is_none() || k_norm.is_none()) {
                return Err(LoadError(format!(
                    "qwen3 layer {i} lacks attn_q_norm/attn_k_norm"
                )));
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
                qkv_bias,
                q_norm,
                k_norm,
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
        Ok(GpuModel {
            gpu,
            config: c.clone(),
            embedding,
            lm_head,
            output_norm,
            inv_freq,
            rope_style,
            layers,
        })
    }

    pub fn weight_elements(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.len()
                    + l.wqkv.len()
                    + l.qkv_bias.as_ref().map_or(0, |b| b.len())
                    + l.q_norm.as_ref().map_or(0, |b| b.len())
                    + l.k_norm.as_ref().map_or(0, |b| b.len())
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
}

/// The q, k and v biases stacked like the fused QKV rows (`(name, offset, len)` each), or
/// `None` when the model has none; a missing part of a model that has some is zero.
fn qkv_bias<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    parts: &[(String, usize, usize)],
) -> Result<Option<DeviceBuffer<T>>, LoadError> {
    if parts
        .iter()
        .all(|(name, _, _)| source.tensor(name).is_none())
    {
        return Ok(None);
    }
    let total: usize = parts.iter().map(|(_, _, len)| len).sum();
    let mut bias = gpu.zeros::<T>(total).map_err(gpu_error("qkv bias"))?;
    for (name, offset, len) in parts {
        if source.tensor(name).is_some() {
            let mut part = view_mut(&mut bias, *offset..offset + len).map_err(gpu_error(name))?;
            upload_tensor_into(gpu, source, name, &[*len], &mut part)?;
        }
    }
    Ok(Some(bias))
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
        // No GPU dequantizer: decoded on the CPU (bit-exact) and uploaded as floats.
        GgmlType::F32
        | GgmlType::F16
        | GgmlType::BF16
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q2K
        | GgmlType::Q3K => None,
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
        None if raw.ty == GgmlType::F32 => {
            // Random 8B weights are 32 GB of f32: convert in parallel, straight from the bytes.
            let converted: Vec<T> = raw
                .data
                .par_chunks_exact(4)
                .map(|bytes| {
                    T::from_f32(f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
                })
                .collect();
            gpu.upload_into(&converted, out).map_err(gpu_error(name))
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
