//! Uploading a model's weights to the GPU: float tensors converted on the host, quantized GGUF
//! matrices kept in their blocks (`PAGODA_CUDA_QUANT_WEIGHTS`, [`Matrix::Quantized`]) or
//! dequantized on the device, Q/K/V and gate/up stacked into one matrix each.

use std::sync::Arc;

use pagoda_cuda::{view_mut, CudaError, DeviceBuffer, DeviceRead, Gpu};
use pagoda_ops::cuda::{QuantFormat, RopeStyle as GpuRopeStyle};

use super::experts::{load_experts, QuantFrom};
use super::matrix::Matrix;
use super::mla_weights::load_mla;
use super::upload::{matrix, upload_tensor, upload_tensor_into, KeepOnDevice};
use super::{GpuLayer, GpuMlp, GpuModel, GqaWeights, HostFloat, LayerAttention};
use crate::config::{ModelConfig, RopeStyle};
use crate::llama::LoadError;
use crate::weight_plan::{AttentionPlan, GqaPlan, MlpPlan, ModelPlan, TensorSpec};
use crate::weights::TensorSource;

fn gpu_error(context: &str) -> impl Fn(CudaError) -> LoadError + '_ {
    move |e| LoadError(format!("{context}: {e}"))
}

impl<T: HostFloat> GpuModel<T> {
    pub(super) fn load(
        config: &ModelConfig,
        source: &dyn TensorSource,
        gpu: Arc<Gpu>,
        keep: KeepOnDevice,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, LoadError> {
        let c = config;
        let plan = ModelPlan::new(c, source)?;
        let g = &gpu;
        let upload = |spec: &TensorSpec| upload_tensor::<T>(g, source, &spec.name, &spec.shape);
        let optional = |spec: &Option<TensorSpec>| spec.as_ref().map(upload).transpose();
        let matrix = |parts: &[&TensorSpec]| matrix::<T>(g, source, parts, keep);
        let upload_f32 =
            |spec: &TensorSpec| upload_tensor::<f32>(g, source, &spec.name, &spec.shape);
        let quantized = |spec: &TensorSpec| super::upload::quant_experts(g, source, spec);
        let quantized: Option<QuantFrom<'_>> =
            (keep.gguf_blocks && keep.moe_experts).then_some(&quantized);
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
                    quantized,
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
                    LayerAttention::Mla(load_mla::<T>(g, source, a, c, keep.gguf_blocks)?)
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
        // The gather reads dense rows or GGUF blocks, never FP8 codes.
        let no_fp8 = KeepOnDevice { fp8: false, ..keep };
        let embedding = super::upload::matrix::<T>(g, source, &[&plan.embedding], no_fp8)?;
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

    /// Bytes of FP8 codes kept on the device.
    pub fn fp8_bytes(&self) -> usize {
        self.matrices().map(Matrix::fp8_bytes).sum()
    }

    /// The largest dense copy a quantized matrix decodes into (0: none is quantized): what
    /// [`super::StepBuffers::new`] sizes its scratch for.
    pub fn largest_quantized(&self) -> usize {
        self.matrices()
            .map(Matrix::quantized_values)
            .max()
            .unwrap_or(0)
    }

    /// Matrices of two quantized parts of one of `QUANT_PAIRS` (a Q4_K_M QKV whose v is
    /// Q6_K), which `PAGODA_CUDA_QUANT_PAIR` multiplies in one launch.
    pub fn quant_pair_matrices(&self) -> usize {
        self.matrices()
            .filter(|m| match m {
                Matrix::Quantized(q) => match &q.parts[..] {
                    [a, b] => pagoda_ops::cuda::QUANT_PAIRS.contains(&(a.format, b.format)),
                    _ => false,
                },
                Matrix::Dense(_) | Matrix::Fp8(_) => false,
            })
            .count()
    }

    /// `(layers, bytes, formats)` of the expert layers whose stacked experts stay in their
    /// blocks (`PAGODA_CUDA_MOE_QUANT`; formats as `gate/up/down`, each once), for the load
    /// log.
    pub(super) fn quantized_experts(&self) -> (usize, usize, Vec<String>) {
        let (mut layers, mut bytes, mut formats) = (0, 0, Vec::new());
        for l in &self.layers {
            if let GpuMlp::Experts(experts) = &l.mlp {
                if let Some([g, u, d]) = experts.quantized_formats() {
                    layers += 1;
                    bytes += experts.expert_bytes();
                    let name = format!("{g}/{u}/{d}");
                    if !formats.contains(&name) {
                        formats.push(name);
                    }
                }
            }
        }
        (layers, bytes, formats)
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
