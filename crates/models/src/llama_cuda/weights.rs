//! Uploading a model's weights to the GPU: float tensors converted on the host, quantized GGUF
//! matrices kept in their blocks (`PAGODA_CUDA_QUANT_WEIGHTS`, [`Matrix::Quantized`]) or
//! dequantized on the device, Q/K/V and gate/up stacked into one matrix each.

use std::sync::Arc;

use pagoda_cuda::{view_mut, CudaError, DeviceBuffer, DeviceRead, Gpu};
use pagoda_ops::cuda::{self as ops, QuantFormat, RopeStyle as GpuRopeStyle};
use pagoda_tensor::GgmlType;
use rayon::prelude::*;

use super::experts::load_experts;
use super::matrix::{Matrix, QuantMatrix, QuantPart};
use super::mla_weights::load_mla;
use super::{GpuLayer, GpuMlp, GpuModel, GqaWeights, HostFloat, LayerAttention};
use crate::config::{ModelConfig, RopeStyle};
use crate::llama::LoadError;
use crate::weight_plan::{
    gpu_keeps_blocks, AttentionPlan, GqaPlan, MlpPlan, ModelPlan, TensorSpec,
};
use crate::weights::TensorSource;

fn gpu_error(context: &str) -> impl Fn(CudaError) -> LoadError + '_ {
    move |e| LoadError(format!("{context}: {e}"))
}

impl<T: HostFloat> GpuModel<T> {
    pub(super) fn load(
        config: &ModelConfig,
        source: &dyn TensorSource,
        gpu: Arc<Gpu>,
        keep_quantized: bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, LoadError> {
        let c = config;
        let plan = ModelPlan::new(c, source)?;
        let g = &gpu;
        let upload = |spec: &TensorSpec| upload_tensor::<T>(g, source, &spec.name, &spec.shape);
        let optional = |spec: &Option<TensorSpec>| spec.as_ref().map(upload).transpose();
        let matrix = |parts: &[&TensorSpec]| matrix::<T>(g, source, parts, keep_quantized);
        let upload_f32 =
            |spec: &TensorSpec| upload_tensor::<f32>(g, source, &spec.name, &spec.shape);
        let mut layers = Vec::with_capacity(c.num_layers);
        for (i, l) in plan.layers.iter().enumerate() {
            let mlp = match &l.mlp {
                MlpPlan::Dense { gate, up, down } => GpuMlp::Dense {
                    w_gate_up: matrix(&[gate, up])?,
                    w_down: matrix(&[down])?,
                },
                MlpPlan::Experts(experts) => GpuMlp::Experts(Box::new(load_experts(
                    experts,
                    &upload,
                    &upload_f32,
                    &matrix,
                )?)),
            };
            let attention = match &l.attention {
                AttentionPlan::Gqa(a) => LayerAttention::Gqa(GqaWeights {
                    wqkv: matrix(&[&a.q, &a.k, &a.v])?,
                    qkv_bias: qkv_bias::<T>(g, source, a)?,
                    q_norm: optional(&a.q_norm)?,
                    k_norm: optional(&a.k_norm)?,
                    wo: matrix(&[&a.attn_output])?,
                }),
                AttentionPlan::Mla(a) => {
                    LayerAttention::Mla(load_mla::<T>(g, source, a, c, keep_quantized)?)
                }
            };
            layers.push(GpuLayer {
                attn_norm: upload(&l.attn_norm)?,
                attention,
                ffn_norm: upload(&l.ffn_norm)?,
                mlp,
            });
            progress(i + 1, c.num_layers + 1);
        }
        let embedding = matrix(&[&plan.embedding])?;
        let lm_head = plan.lm_head.as_ref().map(|h| matrix(&[h])).transpose()?;
        let output_norm = upload(&plan.output_norm)?;
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

    /// The model's matrices: every layer's attention and MLP matrices (a MoE layer's router
    /// and shared experts; its stacked experts are buffers), the embedding and the LM head.
    pub(super) fn matrices(&self) -> impl Iterator<Item = &Matrix<T>> {
        let layers = self.layers.iter().flat_map(|l| {
            let mut matrices = match &l.attention {
                LayerAttention::Gqa(a) => vec![&a.wqkv, &a.wo],
                LayerAttention::Mla(a) => a.matrices(),
            };
            match &l.mlp {
                GpuMlp::Dense { w_gate_up, w_down } => matrices.extend([w_gate_up, w_down]),
                GpuMlp::Experts(experts) => matrices.extend(experts.matrices()),
            }
            matrices
        });
        layers.chain([&self.embedding]).chain(self.lm_head.as_ref())
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let vectors: usize = self
            .layers
            .iter()
            .map(|l| {
                let attention = match &l.attention {
                    LayerAttention::Gqa(a) => {
                        a.qkv_bias.as_ref().map_or(0, |b| b.len())
                            + a.q_norm.as_ref().map_or(0, |b| b.len())
                            + a.k_norm.as_ref().map_or(0, |b| b.len())
                    }
                    LayerAttention::Mla(a) => a.dense_elements(),
                };
                l.attn_norm.len() + attention + l.ffn_norm.len()
            })
            .sum::<usize>()
            + self.output_norm.len();
        let matrices: usize = self.matrices().map(Matrix::bytes).sum();
        let experts: usize = self
            .layers
            .iter()
            .map(|l| match &l.mlp {
                GpuMlp::Experts(experts) => experts.expert_bytes() + experts.bias_bytes(),
                GpuMlp::Dense { .. } => 0,
            })
            .sum();
        vectors * std::mem::size_of::<T>() + matrices + experts
    }

    /// The expected bytes of the experts a step of `rows` rows leaves idle, under uniform
    /// routing: a layer of `E` experts, `k` per row, leaves each idle with probability
    /// `(1 - k/E)^rows` (0 for a dense model).
    pub(super) fn idle_expert_bytes(&self, rows: usize) -> f64 {
        let Some(moe) = &self.config.moe else {
            return 0.0;
        };
        let idle_share =
            (1.0 - moe.experts_per_token as f64 / moe.num_experts as f64).powi(rows as i32);
        let experts: usize = self
            .layers
            .iter()
            .map(|l| match &l.mlp {
                GpuMlp::Experts(experts) => experts.expert_bytes(),
                GpuMlp::Dense { .. } => 0,
            })
            .sum();
        experts as f64 * idle_share
    }

    /// The largest dense copy a quantized matrix decodes into (0: none is quantized): what
    /// [`super::StepBuffers::new`] sizes its scratch for.
    pub fn largest_quantized(&self) -> usize {
        self.matrices()
            .map(Matrix::quantized_values)
            .max()
            .unwrap_or(0)
    }

    /// `(format, matrices)` of the quantized matrices' parts, for the load log.
    pub(super) fn quantized_formats(&self) -> Vec<(QuantFormat, usize)> {
        let mut counts: Vec<(QuantFormat, usize)> = Vec::new();
        for format in self.matrices().flat_map(Matrix::formats) {
            match counts.iter_mut().find(|(f, _)| *f == format) {
                Some((_, n)) => *n += 1,
                None => counts.push((format, 1)),
            }
        }
        counts
    }
}

/// The GPU's in-place format of a GGUF type, if it has one (the types of
/// [`crate::weight_plan::GPU_IN_PLACE_FORMATS`]).
fn quant_format(ty: GgmlType) -> Option<QuantFormat> {
    Some(match ty {
        GgmlType::Q4_0 => QuantFormat::Q4_0,
        GgmlType::Q4_1 => QuantFormat::Q4_1,
        GgmlType::Q5_0 => QuantFormat::Q5_0,
        GgmlType::Q5_1 => QuantFormat::Q5_1,
        GgmlType::Q8_0 => QuantFormat::Q8_0,
        GgmlType::Q4K => QuantFormat::Q4K,
        GgmlType::Q5K => QuantFormat::Q5K,
        GgmlType::Q6K => QuantFormat::Q6K,
        _ => return None,
    })
}

/// `parts` stacked into one matrix: kept in their blocks when `keep_quantized` and every part
/// is in a format the GPU multiplies in place (consecutive parts of one format share a
/// buffer), else dense in `T`.
pub(super) fn matrix<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    parts: &[&TensorSpec],
    keep_quantized: bool,
) -> Result<Matrix<T>, LoadError> {
    let cols = parts[0].cols();
    let raws = parts
        .iter()
        .map(|spec| {
            let raw = source.tensor(&spec.name).ok_or_else(|| {
                LoadError(format!(
                    "tensor {} is missing from the model file",
                    spec.name
                ))
            })?;
            Ok((spec, raw))
        })
        .collect::<Result<Vec<_>, LoadError>>()?;
    let formats: Option<Vec<QuantFormat>> = raws
        .iter()
        .map(|(spec, raw)| {
            quant_format(raw.ty)
                .filter(|_| raw.shape == spec.shape && spec.shape.len() == 2)
                .filter(|_| gpu_keeps_blocks(raw.ty, cols))
        })
        .collect();
    let Some(formats) = formats.filter(|_| keep_quantized) else {
        return stacked::<T>(gpu, source, parts).map(Matrix::Dense);
    };
    let mut quantized = QuantMatrix {
        parts: Vec::new(),
        cols,
    };
    let mut i = 0;
    while i < raws.len() {
        let format = formats[i];
        let mut bytes = Vec::new();
        let mut rows = 0;
        while i < raws.len() && formats[i] == format {
            bytes.extend_from_slice(&raws[i].1.data);
            rows += raws[i].0.rows();
            i += 1;
        }
        if bytes.len() != rows * format.row_bytes(cols) {
            return Err(LoadError(format!(
                "tensor {}: {} bytes of {format} blocks for [{rows}, {cols}]",
                raws[i - 1].0.name,
                bytes.len()
            )));
        }
        bytes.resize(bytes.len() + ops::QUANT_PADDING, 0);
        let blocks = gpu.upload(&bytes).map_err(gpu_error(&raws[i - 1].0.name))?;
        quantized.parts.push(QuantPart {
            format,
            rows,
            blocks,
        });
    }
    Ok(Matrix::Quantized(quantized))
}

/// The q, k and v biases stacked like the fused QKV rows, or `None` when the layer has
/// none; a missing part of a layer that has some is zero.
fn qkv_bias<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    layer: &GqaPlan,
) -> Result<Option<DeviceBuffer<T>>, LoadError> {
    let parts = [
        (&layer.q_bias, layer.q.rows()),
        (&layer.k_bias, layer.k.rows()),
        (&layer.v_bias, layer.v.rows()),
    ];
    if parts.iter().all(|(bias, _)| bias.is_none()) {
        return Ok(None);
    }
    let total: usize = parts.iter().map(|(_, len)| len).sum();
    let mut bias = gpu.zeros::<T>(total).map_err(gpu_error("qkv bias"))?;
    let mut offset = 0;
    for (part, len) in parts {
        if let Some(spec) = part {
            let mut slot =
                view_mut(&mut bias, offset..offset + len).map_err(gpu_error(&spec.name))?;
            upload_tensor_into(gpu, source, &spec.name, &spec.shape, &mut slot)?;
        }
        offset += len;
    }
    Ok(Some(bias))
}

/// Uploads one float or quantized tensor as `T`, checking its shape.
pub(super) fn upload_tensor<T: HostFloat>(
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
        ty if quant_format(ty).is_some() => quant_format(ty),
        // No GPU dequantizer: decoded on the CPU (bit-exact) and uploaded as floats.
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q2K | GgmlType::Q3K => None,
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
    parts: &[&TensorSpec],
) -> Result<DeviceBuffer<T>, LoadError> {
    let cols = parts[0].cols();
    let total_rows: usize = parts.iter().map(|spec| spec.rows()).sum();
    let mut out = gpu
        .alloc::<T>(total_rows * cols)
        .map_err(gpu_error("weights"))?;
    let mut row = 0;
    for spec in parts {
        let rows = spec.rows();
        let mut part =
            view_mut(&mut out, row * cols..(row + rows) * cols).map_err(gpu_error(&spec.name))?;
        upload_tensor_into(gpu, source, &spec.name, &spec.shape, &mut part)?;
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
