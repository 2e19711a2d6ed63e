//! DeepSeek's latent attention weights on the GPU (ADR 0009), loaded from the same
//! [`MlaPlan`] as the CPU's, laid out for the absorbed form the CUDA step runs:
//!
//! - The query projection (`q`, or `q_b` after `q_a` and its norm) with each head's rows
//!   reordered to `[rope | nope]`, so RoPE rotates the first `qk_rope_head_dim` values of
//!   every head in place (`ops::rope` turns the head's leading dims).
//! - `k_absorb` `[heads, latent + rope, rope + nope]`: per head the key up-projection
//!   `W_UK_h^T` (`[latent, nope]`, absorbing the query into latent space) and an identity
//!   over the rope dims, so one strided batched GEMM writes the absorbed query row `[W_UK_h^T
//!   q_nope_h, q_rope_h]` the MLA kernels read.
//! - `v_up` `[heads, v_head_dim, latent]`: the value up-projection per head.
//! - YaRN's rotation scale (`MlaConfig::rope_scale`, 1 in every released config) is folded into
//!   the rope rows of the query projection and of `kv_a` (RoPE is linear).
//!
//! The reordered and absorbed matrices are built on the host in f32 and uploaded dense; `q_a`,
//! `kv_a` (when its rope scale is 1) and the output projection load as the dense layers do,
//! GGUF blocks kept.

use pagoda_cuda::{DeviceBuffer, DeviceRead, Gpu};
use pagoda_ops::cuda::{mla_unsupported, PoolLayout};

use super::upload::{matrix, upload_tensor, KeepOnDevice};
use super::{HostFloat, Matrix};
use crate::config::{MlaConfig, ModelConfig};
use crate::llama::LoadError;
use crate::weight_plan::{KvUpPlan, MlaPlan, MlaQueryPlan, TensorSpec};
use crate::weights::TensorSource;

/// The query projection of a latent attention layer, its heads' rows in `[rope | nope]`
/// order.
pub(super) enum MlaQueryWeights<T> {
    /// `[heads * (rope + nope), hidden]`.
    Direct(Matrix<T>),
    /// `q_a` `[q_lora_rank, hidden]`, its RMSNorm `[q_lora_rank]`, `q_b` `[heads * (rope +
    /// nope), q_lora_rank]`.
    Compressed {
        q_a: Matrix<T>,
        q_a_norm: DeviceBuffer<T>,
        q_b: Matrix<T>,
    },
}

/// A latent attention layer's weights on the GPU.
pub(super) struct MlaWeights<T> {
    pub query: MlaQueryWeights<T>,
    /// `[latent + rope, hidden]`: the latent then the shared RoPE key.
    pub kv_a: Matrix<T>,
    /// `[latent]`.
    pub kv_a_norm: DeviceBuffer<T>,
    /// `[heads, latent + rope, rope + nope]` (see the module docs).
    pub k_absorb: DeviceBuffer<T>,
    /// `[heads, v_head_dim, latent]`.
    pub v_up: DeviceBuffer<T>,
    /// `[hidden, heads * v_head_dim]`.
    pub wo: Matrix<T>,
}

impl<T: HostFloat> MlaWeights<T> {
    /// The layer's matrices (the query's and the projections).
    pub fn matrices(&self) -> Vec<&Matrix<T>> {
        let mut matrices = match &self.query {
            MlaQueryWeights::Direct(q) => vec![q],
            MlaQueryWeights::Compressed { q_a, q_b, .. } => vec![q_a, q_b],
        };
        matrices.extend([&self.kv_a, &self.wo]);
        matrices
    }

    /// Elements of the layer's vectors and per-head matrices (held in `T`).
    pub fn dense_elements(&self) -> usize {
        let q_a_norm = match &self.query {
            MlaQueryWeights::Compressed { q_a_norm, .. } => q_a_norm.len(),
            MlaQueryWeights::Direct(_) => 0,
        };
        q_a_norm + self.kv_a_norm.len() + self.k_absorb.len() + self.v_up.len()
    }
}

/// Why the CUDA model cannot run `config`'s latent attention (`None`: it can): the MLA
/// kernels' latent and rope widths and head tiles, no V3.2 indexer (the dtype is checked by
/// the loader: bf16 and f32 both run).
pub(super) fn mla_unsupported_config(config: &ModelConfig) -> Option<String> {
    let mla = config.mla.as_ref()?;
    if mla.indexer.is_some() {
        return Some("DeepSeek-V3.2's sparse-attention indexer runs on the CPU for now".into());
    }
    // The page size is checked when the cache is sized; any power of two serves here.
    let probe = PoolLayout {
        num_pages: 1,
        page_size: 16,
        num_kv_heads: 1,
        head_dim: mla.latent_row(),
    };
    mla_unsupported(
        pagoda_cuda::DType::F32,
        &probe,
        config.num_attention_heads,
        mla.kv_lora_rank,
    )
    .map(|reason| format!("the CUDA latent attention kernels do not support {reason}"))
}

/// Loads the latent attention block `plan` lists, in the GPU's layout (module docs).
pub(super) fn load_mla<T: HostFloat>(
    gpu: &Gpu,
    source: &dyn TensorSource,
    plan: &MlaPlan,
    config: &ModelConfig,
    keep_quantized: bool,
) -> Result<MlaWeights<T>, LoadError> {
    let m = config
        .mla
        .as_ref()
        .ok_or_else(|| LoadError("a latent attention layer without latent settings".into()))?;
    let heads = config.num_attention_heads;
    let scale = m.rope_scale();
    let dense = |spec: &TensorSpec| {
        matrix::<T>(
            gpu,
            source,
            &[spec],
            KeepOnDevice {
                gguf_blocks: keep_quantized,
                fp8: false,
                moe_experts: false,
            },
        )
    };
    let query_rows = |spec: &TensorSpec| {
        let values =
            head_rows_rope_first(&host_values(source, spec)?, spec.cols(), m, heads, scale);
        upload_host::<T>(gpu, &values, &spec.name).map(Matrix::Dense)
    };
    let query = match &plan.query {
        MlaQueryPlan::Direct(q) => MlaQueryWeights::Direct(query_rows(q)?),
        MlaQueryPlan::Compressed { q_a, q_a_norm, q_b } => MlaQueryWeights::Compressed {
            q_a: dense(q_a)?,
            q_a_norm: upload_tensor::<T>(gpu, source, &q_a_norm.name, &q_a_norm.shape)?,
            q_b: query_rows(q_b)?,
        },
    };
    let kv_a = if scale == 1.0 {
        dense(&plan.kv_a)?
    } else {
        let mut values = host_values(source, &plan.kv_a)?;
        let cols = plan.kv_a.cols();
        values[m.kv_lora_rank * cols..]
            .iter_mut()
            .for_each(|v| *v *= scale);
        Matrix::Dense(upload_host::<T>(gpu, &values, &plan.kv_a.name)?)
    };
    let (k_up_t, v_up) = up_projections(source, &plan.kv_up, m, heads)?;
    let k_absorb = absorbed_keys(&k_up_t, m, heads);
    Ok(MlaWeights {
        query,
        kv_a,
        kv_a_norm: upload_tensor::<T>(gpu, source, &plan.kv_a_norm.name, &plan.kv_a_norm.shape)?,
        k_absorb: upload_host::<T>(gpu, &k_absorb, "k_absorb")?,
        v_up: upload_host::<T>(gpu, &v_up, "v_up")?,
        wo: dense(&plan.attn_output)?,
    })
}

/// Every value of the tensor `spec` names, decoded to f32, after checking its shape.
fn host_values(source: &dyn TensorSource, spec: &TensorSpec) -> Result<Vec<f32>, LoadError> {
    let raw = source.tensor(&spec.name).ok_or_else(|| {
        LoadError(format!(
            "tensor {} is missing from the model file",
            spec.name
        ))
    })?;
    if raw.shape.iter().product::<usize>() != spec.len() {
        return Err(LoadError(format!(
            "tensor {} has shape {:?}, expected {:?}",
            spec.name, raw.shape, spec.shape
        )));
    }
    let mut values = vec![0f32; spec.len()];
    pagoda_tensor::quant::dequantize(raw.ty, &raw.data, &mut values)
        .map_err(|e| LoadError(format!("tensor {}: {e}", spec.name)))?;
    Ok(values)
}

fn upload_host<T: HostFloat>(
    gpu: &Gpu,
    values: &[f32],
    name: &str,
) -> Result<DeviceBuffer<T>, LoadError> {
    let converted: Vec<T> = values.iter().map(|&v| T::from_f32(v)).collect();
    gpu.upload(&converted)
        .map_err(|e| LoadError(format!("{name}: {e}")))
}

/// A query projection `[heads * (nope + rope), cols]` with each head's rows reordered to
/// `[rope | nope]`, the rope rows multiplied by `scale`.
fn head_rows_rope_first(
    values: &[f32],
    cols: usize,
    m: &MlaConfig,
    heads: usize,
    scale: f32,
) -> Vec<f32> {
    let (nope, rope, head) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.q_head_dim());
    let mut out = Vec::with_capacity(values.len());
    for h in 0..heads {
        let rows = &values[h * head * cols..(h + 1) * head * cols];
        let (nope_rows, rope_rows) = rows.split_at(nope * cols);
        out.extend(rope_rows.iter().map(|&v| v * scale));
        out.extend_from_slice(nope_rows);
    }
    debug_assert_eq!(out.len(), heads * (nope + rope) * cols);
    out
}

/// `(k_up_t, v_up)`: per head `W_UK_h^T` `[latent, nope]` and `W_UV_h` `[v, latent]`, each
/// stacked over the heads, from the file's joint `kv_b` or split `k_b`/`v_b`.
fn up_projections(
    source: &dyn TensorSource,
    plan: &KvUpPlan,
    m: &MlaConfig,
    heads: usize,
) -> Result<(Vec<f32>, Vec<f32>), LoadError> {
    let (latent, nope, v) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
    match plan {
        KvUpPlan::Split { k_b, v_b } => Ok((host_values(source, k_b)?, host_values(source, v_b)?)),
        KvUpPlan::Joint(kv_b) => {
            // Per head `nope` key rows then `v` value rows, each `[.., latent]`.
            let values = host_values(source, kv_b)?;
            let mut k_up_t = vec![0f32; heads * latent * nope];
            let mut v_up = Vec::with_capacity(heads * v * latent);
            for (h, head) in values.chunks_exact((nope + v) * latent).enumerate() {
                let (keys, head_values) = head.split_at(nope * latent);
                let transposed = &mut k_up_t[h * latent * nope..(h + 1) * latent * nope];
                for (d, row) in keys.chunks_exact(latent).enumerate() {
                    for (l, &value) in row.iter().enumerate() {
                        transposed[l * nope + d] = value;
                    }
                }
                v_up.extend_from_slice(head_values);
            }
            Ok((k_up_t, v_up))
        }
    }
}

/// `[heads, latent + rope, rope + nope]`: per head, over an input `[q_rope | q_nope]`, the
/// rows `[0 | W_UK_h^T]` (latent of them) then `[I | 0]` (rope of them).
fn absorbed_keys(k_up_t: &[f32], m: &MlaConfig, heads: usize) -> Vec<f32> {
    let (latent, nope, rope) = (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim);
    let cols = rope + nope;
    let per_head = (latent + rope) * cols;
    let mut out = vec![0f32; heads * per_head];
    for (h, block) in out.chunks_exact_mut(per_head).enumerate() {
        let keys = &k_up_t[h * latent * nope..(h + 1) * latent * nope];
        for (l, row) in block.chunks_exact_mut(cols).take(latent).enumerate() {
            row[rope..].copy_from_slice(&keys[l * nope..(l + 1) * nope]);
        }
        for (r, row) in block.chunks_exact_mut(cols).skip(latent).enumerate() {
            row[r] = 1.0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> MlaConfig {
        MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 3,
            qk_nope_head_dim: 2,
            qk_rope_head_dim: 2,
            v_head_dim: 1,
            yarn: None,
            indexer: None,
        }
    }

    #[test]
    fn query_heads_put_their_rope_rows_first_scaled() {
        // 2 heads of [nope 2 | rope 2] rows, 1 column: values are the row indices.
        let values: Vec<f32> = (0..8).map(|v| v as f32).collect();
        let out = head_rows_rope_first(&values, 1, &tiny(), 2, 2.0);
        assert_eq!(out, [4.0, 6.0, 0.0, 1.0, 12.0, 14.0, 4.0, 5.0]);
    }

    #[test]
    fn absorbed_keys_apply_the_key_up_projection_and_pass_the_rope_part() {
        let m = tiny();
        // One head: W_UK^T [latent 3, nope 2].
        let k_up_t = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = absorbed_keys(&k_up_t, &m, 1);
        // q = [rope 7, 8 | nope 1, 1].
        let q = [7.0, 8.0, 1.0, 1.0];
        let row: Vec<f32> = w
            .chunks_exact(4)
            .map(|r| r.iter().zip(&q).map(|(a, b)| a * b).sum())
            .collect();
        assert_eq!(row, [3.0, 7.0, 11.0, 7.0, 8.0]);
    }
}
