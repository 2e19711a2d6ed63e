//! The CPU weights of DeepSeek's multi-head latent attention block: the query path, the
//! latent down-projection with its norm, the key/value up-projections cut per head for the
//! absorbed form, and the output projection.
//!
//! The up-projections are held per head: `k_up_t[h]` `[kv_lora_rank, qk_nope_head_dim]`
//! absorbs a query head into latent space (`q_latent = W_UK_h^T q_nope`), `v_up[h]`
//! `[v_head_dim, kv_lora_rank]` takes a head's latent output to its value space. GGUF's split
//! `attn_k_b` is already `W_UK_h^T` and stays in its stored format; HF's (and older GGUF
//! files') joint `kv_b_proj` is decoded to f32 and transposed here, once.

use pagoda_ops::linear::Weight;

use super::moe::load_stacked;
use super::{fetch, load_matrix, load_vector, WeightPrecision};
use crate::config::ModelConfig;
use crate::weight_plan::{KvUpPlan, MlaPlan, MlaQueryPlan, TensorSpec};
use crate::weights::{LoadError, TensorSource};

/// The query projection of a latent attention block.
// One per layer, built once: boxing a variant would only add an indirection.
#[allow(clippy::large_enum_variant)]
pub(super) enum MlaQuery {
    /// `[num_heads * q_head_dim, hidden]`.
    Direct(Weight),
    /// `q_a` `[q_lora_rank, hidden]`, its RMSNorm, `q_b` `[num_heads * q_head_dim,
    /// q_lora_rank]`.
    Compressed {
        q_a: Weight,
        q_a_norm: Vec<f32>,
        q_b: Weight,
    },
}

/// A latent attention block's weights.
pub(super) struct MlaWeights {
    pub(super) query: MlaQuery,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub(super) kv_a: Weight,
    /// `[kv_lora_rank]`.
    pub(super) kv_a_norm: Vec<f32>,
    /// Per head `[kv_lora_rank, qk_nope_head_dim]` (f32).
    pub(super) k_up_t: Vec<Weight>,
    /// Per head `[v_head_dim, kv_lora_rank]` (f32).
    pub(super) v_up: Vec<Weight>,
    /// `[hidden, num_heads * v_head_dim]`.
    pub(super) wo: Weight,
    /// DeepSeek-V3.2's sparse-attention indexer.
    pub(super) indexer: Option<IndexerWeights>,
}

/// DeepSeek-V3.2's lightning indexer ([`crate::config::IndexerConfig`]).
pub(super) struct IndexerWeights {
    /// `[index_n_heads * index_head_dim, q_lora_rank]`: the index queries from the
    /// compressed (normed) query.
    pub(super) q_b: Weight,
    /// `[index_head_dim, hidden]`: the index key, then its LayerNorm (weight and bias).
    pub(super) k: Weight,
    pub(super) k_norm: Vec<f32>,
    pub(super) k_norm_bias: Vec<f32>,
    /// `[index_n_heads, hidden]`: each index head's weight.
    pub(super) proj: Weight,
}

impl MlaWeights {
    /// Loads the block `plan` lists.
    pub(super) fn load(
        source: &dyn TensorSource,
        plan: &MlaPlan,
        config: &ModelConfig,
        precision: WeightPrecision,
    ) -> Result<MlaWeights, LoadError> {
        let mla = config.mla.as_ref().ok_or_else(|| {
            LoadError("a latent attention layer needs the model's latent settings".into())
        })?;
        let matrix = |spec: &TensorSpec| {
            load_matrix(source, &spec.name, spec.rows(), spec.cols(), precision)
        };
        let query = match &plan.query {
            MlaQueryPlan::Direct(q) => MlaQuery::Direct(matrix(q)?),
            MlaQueryPlan::Compressed { q_a, q_a_norm, q_b } => MlaQuery::Compressed {
                q_a: matrix(q_a)?,
                q_a_norm: load_vector(source, &q_a_norm.name, q_a_norm.len())?,
                q_b: matrix(q_b)?,
            },
        };
        let (heads, latent) = (config.num_attention_heads, mla.kv_lora_rank);
        let (nope, v) = (mla.qk_nope_head_dim, mla.v_head_dim);
        let (k_up_t, v_up) = match &plan.kv_up {
            KvUpPlan::Joint(kv_b) => {
                let values = f32_values(source, kv_b)?;
                let mut k_up_t = Vec::with_capacity(heads);
                let mut v_up = Vec::with_capacity(heads);
                for head in values.chunks_exact((nope + v) * latent) {
                    let (keys, head_values) = head.split_at(nope * latent);
                    // keys `[nope, latent]` -> `[latent, nope]`.
                    let mut transposed = vec![0f32; latent * nope];
                    for (d, row) in keys.chunks_exact(latent).enumerate() {
                        for (l, &value) in row.iter().enumerate() {
                            transposed[l * nope + d] = value;
                        }
                    }
                    k_up_t.push(Weight::from_f32(latent, nope, &transposed));
                    v_up.push(Weight::from_f32(v, latent, head_values));
                }
                (k_up_t, v_up)
            }
            // Already per head and in the absorbed orientation: cut head by head, in the
            // stored format (a quantized file's heads run on the integer kernels).
            KvUpPlan::Split { k_b, v_b } => (
                load_stacked(source, k_b, &k_b.name, precision)?,
                load_stacked(source, v_b, &v_b.name, precision)?,
            ),
        };
        let vector = |spec: &TensorSpec| load_vector(source, &spec.name, spec.len());
        let indexer = match &plan.indexer {
            Some(i) => Some(IndexerWeights {
                q_b: matrix(&i.q_b)?,
                k: matrix(&i.k)?,
                k_norm: vector(&i.k_norm)?,
                k_norm_bias: vector(&i.k_norm_bias)?,
                proj: matrix(&i.proj)?,
            }),
            None => None,
        };
        Ok(MlaWeights {
            query,
            kv_a: matrix(&plan.kv_a)?,
            kv_a_norm: vector(&plan.kv_a_norm)?,
            k_up_t,
            v_up,
            wo: matrix(&plan.attn_output)?,
            indexer,
        })
    }

    /// Every matrix of the block.
    pub(super) fn weights(&self) -> Vec<&Weight> {
        let mut weights = match &self.query {
            MlaQuery::Direct(q) => vec![q],
            MlaQuery::Compressed { q_a, q_b, .. } => vec![q_a, q_b],
        };
        weights.extend([&self.kv_a, &self.wo]);
        if let Some(i) = &self.indexer {
            weights.extend([&i.q_b, &i.k, &i.proj]);
        }
        weights.extend(&self.k_up_t);
        weights.extend(&self.v_up);
        weights
    }
}

/// Every value of the tensor `spec` names, decoded to f32, after checking its shape.
fn f32_values(source: &dyn TensorSource, spec: &TensorSpec) -> Result<Vec<f32>, LoadError> {
    let raw = fetch(source, &spec.name)?;
    if raw.shape != spec.shape {
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
