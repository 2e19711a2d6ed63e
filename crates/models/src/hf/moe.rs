//! The mixture-of-experts fields of a `config.json`: Qwen3-MoE's and Mixtral's, with
//! transformers' defaults and rules.

use super::{Fields, HfError};
use crate::config::{Architecture, MoeConfig, TopKWeights};

/// The mixture-of-experts settings of a Qwen3-MoE or Mixtral `config.json` (transformers'
/// defaults where a field is absent); `None` for a dense architecture.
pub(super) fn moe_of(
    fields: &Fields<'_>,
    architecture: Architecture,
    num_layers: usize,
) -> Result<Option<MoeConfig>, HfError> {
    let positive = |key: &str| -> Result<usize, HfError> {
        match fields.required_usize(key)? {
            0 => Err(fields.error(key, "must be positive")),
            value => Ok(value),
        }
    };
    // transformers 5 writes either model's expert count as `num_local_experts` (its
    // attribute map aliases Qwen3-MoE's `num_experts`); released Qwen3-MoE configs say
    // `num_experts`.
    let num_experts = |key: &str, alias: &str| match fields.usize(alias)? {
        Some(_) if fields.get(key).is_none() => positive(alias),
        _ => positive(key),
    };
    let moe = match architecture {
        Architecture::Llama
        | Architecture::Qwen2
        | Architecture::Qwen3
        | Architecture::DeepSeek2 => return Ok(None),
        // Mixtral: every layer sparse, the top-k always renormalised, `intermediate_size`
        // is the experts' width.
        Architecture::Mixtral => MoeConfig {
            num_experts: num_experts("num_local_experts", "num_experts")?,
            experts_per_token: positive("num_experts_per_tok")?,
            expert_intermediate_size: positive("intermediate_size")?,
            top_k_weights: TopKWeights::Normalized,
            dense_layers: Vec::new(),
            ..MoeConfig::default()
        },
        // Qwen3-MoE: layer `i` is sparse unless listed in `mlp_only_layers` or
        // `(i + 1) % decoder_sparse_step != 0`.
        Architecture::Qwen3Moe => {
            let sparse_step = fields.usize("decoder_sparse_step")?.unwrap_or(1);
            if sparse_step == 0 {
                return Err(fields.error("decoder_sparse_step", "must be positive"));
            }
            let mlp_only_layers = fields.usize_list("mlp_only_layers")?;
            if let Some(layer) = mlp_only_layers.iter().find(|&&l| l >= num_layers) {
                return Err(fields.error(
                    "mlp_only_layers",
                    &format!("names layer {layer}, but the model has {num_layers} layers"),
                ));
            }
            MoeConfig {
                num_experts: num_experts("num_experts", "num_local_experts")?,
                experts_per_token: positive("num_experts_per_tok")?,
                expert_intermediate_size: positive("moe_intermediate_size")?,
                top_k_weights: match fields.bool("norm_topk_prob")?.unwrap_or(false) {
                    true => TopKWeights::Normalized,
                    false => TopKWeights::Softmax,
                },
                dense_layers: (0..num_layers)
                    .filter(|&layer| {
                        mlp_only_layers.contains(&layer) || (layer + 1) % sparse_step != 0
                    })
                    .collect(),
                ..MoeConfig::default()
            }
        }
    };
    if moe.experts_per_token > moe.num_experts {
        return Err(fields.error(
            "num_experts_per_tok",
            &format!(
                "is {}, more than the {} experts",
                moe.experts_per_token, moe.num_experts
            ),
        ));
    }
    Ok(Some(moe))
}
