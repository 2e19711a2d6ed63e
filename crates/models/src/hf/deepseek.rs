//! The fields of a DeepSeek-V2/V3/V3.2 `config.json` (`deepseek_v2`, `deepseek_v3`,
//! `deepseek_v32`): latent attention, YaRN, the router with shared experts, group limits and
//! V3's bias, and V3.2's sparse-attention indexer.

use std::path::Path;

use super::{rope_scaling_section, Fields, HfError};
use crate::config::{
    Architecture, ExpertGroupLimit, ExpertScoring, GroupScoring, IndexerConfig, MlaConfig,
    ModelConfig, MoeConfig, RopeStyle, TopKWeights, YarnScaling,
};
use crate::weights::names;

/// The whole configuration of a DeepSeek checkpoint. Shapes are required (no silent fall
/// back to the 236B model's defaults); routing fields take transformers' per-version
/// defaults (V2: softmax, greedy; V3: sigmoid, `noaux_tc`).
pub(super) fn deepseek_config(fields: &Fields<'_>, path: &Path) -> Result<ModelConfig, HfError> {
    let v32 = matches!(fields.str("model_type")?, Some("deepseek_v32"))
        || first_architecture(fields) == Some("DeepseekV32ForCausalLM");
    let v3 = v32
        || matches!(fields.str("model_type")?, Some("deepseek_v3"))
        || first_architecture(fields) == Some("DeepseekV3ForCausalLM");
    let positive = |key: &str| -> Result<usize, HfError> {
        match fields.required_usize(key)? {
            0 => Err(fields.error(key, "must be positive")),
            value => Ok(value),
        }
    };
    let num_layers = positive("num_hidden_layers")?;
    let mla = MlaConfig {
        q_lora_rank: fields.usize("q_lora_rank")?.filter(|&rank| rank > 0),
        kv_lora_rank: positive("kv_lora_rank")?,
        qk_nope_head_dim: positive("qk_nope_head_dim")?,
        qk_rope_head_dim: positive("qk_rope_head_dim")?,
        v_head_dim: positive("v_head_dim")?,
        yarn: yarn_of(fields)?,
        indexer: if v32 {
            Some(indexer_of(fields, &positive)?)
        } else {
            None
        },
    };
    let scoring =
        match fields
            .str("scoring_func")?
            .unwrap_or(if v3 { "sigmoid" } else { "softmax" })
        {
            "softmax" => ExpertScoring::Softmax,
            "sigmoid" => ExpertScoring::Sigmoid,
            other => {
                return Err(fields.error(
                    "scoring_func",
                    &format!("is `{other}`; only softmax and sigmoid are supported"),
                ))
            }
        };
    let topk_method = fields
        .str("topk_method")?
        .unwrap_or(if v3 { "noaux_tc" } else { "greedy" });
    let groups = |score| -> Result<Option<ExpertGroupLimit>, HfError> {
        let num_groups = fields.usize("n_group")?.unwrap_or(1);
        Ok((num_groups > 1).then_some(()).map(|_| ExpertGroupLimit {
            num_groups,
            groups_per_token: fields
                .usize("topk_group")
                .ok()
                .flatten()
                .unwrap_or(num_groups),
            score,
        }))
    };
    let (group_limit, selection_bias) = match topk_method {
        "greedy" => (None, false),
        "group_limited_greedy" => (groups(GroupScoring::Max)?, false),
        "noaux_tc" if scoring == ExpertScoring::Sigmoid => (groups(GroupScoring::TopTwoSum)?, true),
        "noaux_tc" => {
            return Err(fields.error(
                "topk_method",
                "is `noaux_tc`, which needs scoring_func `sigmoid`",
            ))
        }
        other => {
            return Err(fields.error(
                "topk_method",
                &format!("is `{other}`; supported: greedy, group_limited_greedy, noaux_tc"),
            ))
        }
    };
    let first_dense = fields.usize("first_k_dense_replace")?.unwrap_or(0);
    let layer_freq = fields.usize("moe_layer_freq")?.unwrap_or(1);
    if layer_freq == 0 {
        return Err(fields.error("moe_layer_freq", "must be positive"));
    }
    let layer_types = mlp_layer_types(fields, num_layers)?;
    let moe = MoeConfig {
        num_experts: positive("n_routed_experts")?,
        experts_per_token: positive("num_experts_per_tok")?,
        expert_intermediate_size: positive("moe_intermediate_size")?,
        top_k_weights: match fields.bool("norm_topk_prob")?.unwrap_or(false) {
            true => TopKWeights::Normalized,
            false => TopKWeights::Softmax,
        },
        // DeepSeek's rule: layer `i` is MoE when `i >= first_k_dense_replace` and
        // `i % moe_layer_freq == 0`.
        dense_layers: match layer_types {
            Some(sparse) => (0..num_layers).filter(|&layer| !sparse[layer]).collect(),
            None => (0..num_layers)
                .filter(|&layer| layer < first_dense || !layer.is_multiple_of(layer_freq))
                .collect(),
        },
        scoring,
        // Applied after any renormalisation, as V3's gate and llama.cpp do. V2's remote code
        // skips it when it renormalises; no released V2 config combines the two
        // (`norm_topk_prob: false` throughout).
        routed_scaling_factor: fields.f32("routed_scaling_factor")?.unwrap_or(1.0),
        group_limit,
        selection_bias,
        num_shared_experts: fields.usize("n_shared_experts")?.unwrap_or(0),
    };
    let config = ModelConfig {
        architecture: Architecture::DeepSeek2,
        hidden_size: positive("hidden_size")?,
        num_layers,
        num_attention_heads: positive("num_attention_heads")?,
        // One latent row per token: the cache is one "head" of kv_lora_rank + rope values
        // (and V3.2's indexer key).
        num_kv_heads: 1,
        head_dim: mla.cache_row(),
        intermediate_size: positive("intermediate_size")?,
        vocab_size: positive("vocab_size")?,
        rms_norm_eps: fields.f32("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta: rope_theta(fields)?,
        rope_dim: mla.qk_rope_head_dim,
        // DeepSeek's rotary dims are interleaved pairs: HF's V2 rotates them as complex
        // numbers, its V3 (`rope_interleave`, default true) and DeepSeek's own code
        // de-interleave before rotate-half, which gives the same scores. transformers' V3
        // with `rope_interleave: false` applies rotate-half to the rows as stored.
        rope_style: match v3 && fields.bool("rope_interleave")? == Some(false) {
            true => RopeStyle::Halves,
            false => RopeStyle::Interleaved,
        },
        rope_scaling: None,
        max_position_embeddings: fields.usize("max_position_embeddings")?.unwrap_or(2048),
        tie_word_embeddings: fields.bool("tie_word_embeddings")?.unwrap_or(false),
        moe: Some(moe),
        mla: Some(mla),
    };
    config
        .validate()
        .map_err(|message| HfError::new(path, format!("invalid config: {message}")))?;
    Ok(config)
}

/// V3.2's indexer fields (`index_n_heads`, `index_head_dim`, `index_topk`), required: the
/// config class's defaults are the 671B model's.
fn indexer_of(
    fields: &Fields<'_>,
    positive: &dyn Fn(&str) -> Result<usize, HfError>,
) -> Result<IndexerConfig, HfError> {
    let indexer = IndexerConfig {
        num_heads: positive("index_n_heads")?,
        head_dim: positive("index_head_dim")?,
        top_k: positive("index_topk")?,
    };
    let rope = fields.required_usize("qk_rope_head_dim")?;
    if indexer.head_dim < rope {
        return Err(fields.error(
            "index_head_dim",
            &format!("({}) must be at least qk_rope_head_dim ({rope}): the indexer rotates its first qk_rope_head_dim dims", indexer.head_dim),
        ));
    }
    if fields.usize("q_lora_rank")?.is_none_or(|rank| rank == 0) {
        return Err(fields.error(
            "q_lora_rank",
            "must be positive for deepseek_v32: the indexer's query reads the compressed query",
        ));
    }
    Ok(indexer)
}

/// transformers 5's `mlp_layer_types` (`"dense"` or `"sparse"` per layer), which overrides
/// `first_k_dense_replace` and `moe_layer_freq` where present: `true` marks a MoE layer.
fn mlp_layer_types(fields: &Fields<'_>, num_layers: usize) -> Result<Option<Vec<bool>>, HfError> {
    let Some(value) = fields.get("mlp_layer_types").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let wrong = || {
        fields.error(
            "mlp_layer_types",
            &format!("must list `dense` or `sparse` for each of the {num_layers} layers"),
        )
    };
    let list = value
        .as_array()
        .filter(|list| list.len() == num_layers)
        .ok_or_else(wrong)?;
    list.iter()
        .map(|kind| match kind.as_str() {
            Some("dense") => Ok(false),
            Some("sparse") => Ok(true),
            _ => Err(wrong()),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// `rope_theta`, or transformers 5's `rope_parameters.rope_theta`; 10000 without either.
fn rope_theta(fields: &Fields<'_>) -> Result<f32, HfError> {
    if let Some(theta) = fields.f32("rope_theta")? {
        return Ok(theta);
    }
    let Some(map) = fields.object("rope_parameters")? else {
        return Ok(10_000.0);
    };
    let parameters = Fields {
        map,
        path: fields.path,
        prefix: "rope_parameters.",
    };
    Ok(parameters.f32("rope_theta")?.unwrap_or(10_000.0))
}

fn first_architecture<'a>(fields: &'a Fields<'_>) -> Option<&'a str> {
    fields.get("architectures")?.as_array()?.first()?.as_str()
}

/// `rope_scaling` (or transformers 5's `rope_parameters`) of type `yarn`, with DeepSeek's
/// defaults; `None` without scaling.
fn yarn_of(fields: &Fields<'_>) -> Result<Option<YarnScaling>, HfError> {
    rope_scaling_section(fields, |scaling, rope_type| match rope_type {
        "yarn" => Ok(YarnScaling {
            factor: scaling.required_f32("factor")?,
            original_max_position_embeddings: u32::try_from(
                scaling
                    .usize("original_max_position_embeddings")?
                    .unwrap_or(4096),
            )
            .map_err(|_| {
                scaling.error(
                    "original_max_position_embeddings",
                    "does not fit in 32 bits",
                )
            })?,
            beta_fast: scaling.f32("beta_fast")?.unwrap_or(32.0),
            beta_slow: scaling.f32("beta_slow")?.unwrap_or(1.0),
            mscale: scaling.f32("mscale")?.unwrap_or(1.0),
            mscale_all_dim: scaling.f32("mscale_all_dim")?.unwrap_or(0.0),
        }),
        other => Err(scaling.error(
            "rope_type",
            &format!("is `{other}`; DeepSeek models support `default` and `yarn` RoPE scaling"),
        )),
    })
}

/// The attention and MLP tensors of DeepSeek layer `layer` (HF's layout under canonical
/// names: the joint `attn_kv_b`), with their row-major shapes.
pub(crate) fn deepseek_layer_tensors(
    config: &ModelConfig,
    layer: usize,
) -> Vec<(String, Vec<usize>)> {
    let (Some(mla), Some(moe)) = (&config.mla, &config.moe) else {
        return Vec::new();
    };
    let (hidden, heads) = (config.hidden_size, config.num_attention_heads);
    let q_rows = heads * mla.q_head_dim();
    let n = |suffix: &str| names::layer(layer, suffix);
    let mut shapes = vec![(n(names::ATTN_NORM), vec![hidden])];
    match mla.q_lora_rank {
        None => shapes.push((n(names::ATTN_Q), vec![q_rows, hidden])),
        Some(rank) => shapes.extend([
            (n(names::ATTN_Q_A), vec![rank, hidden]),
            (n(names::ATTN_Q_A_NORM), vec![rank]),
            (n(names::ATTN_Q_B), vec![q_rows, rank]),
        ]),
    }
    let latent = mla.kv_lora_rank;
    shapes.extend([
        (n(names::ATTN_KV_A_MQA), vec![mla.latent_row(), hidden]),
        (n(names::ATTN_KV_A_NORM), vec![latent]),
        (
            n(names::ATTN_KV_B),
            vec![heads * (mla.qk_nope_head_dim + mla.v_head_dim), latent],
        ),
        (n(names::ATTN_OUTPUT), vec![hidden, heads * mla.v_head_dim]),
        (n(names::FFN_NORM), vec![hidden]),
    ]);
    if let (Some(indexer), Some(rank)) = (mla.indexer, mla.q_lora_rank) {
        let (index_heads, dim) = (indexer.num_heads, indexer.head_dim);
        shapes.extend([
            (n(names::INDEXER_ATTN_Q_B), vec![index_heads * dim, rank]),
            (n(names::INDEXER_ATTN_K), vec![dim, hidden]),
            (n(names::INDEXER_K_NORM), vec![dim]),
            (n(names::INDEXER_K_NORM_BIAS), vec![dim]),
            (n(names::INDEXER_PROJ), vec![index_heads, hidden]),
        ]);
    }
    if moe.is_moe_layer(layer) {
        let (experts, width) = (moe.num_experts, moe.expert_intermediate_size);
        shapes.extend([
            (n(names::FFN_GATE_INP), vec![experts, hidden]),
            (n(names::FFN_GATE_EXPS), vec![experts, width, hidden]),
            (n(names::FFN_UP_EXPS), vec![experts, width, hidden]),
            (n(names::FFN_DOWN_EXPS), vec![experts, hidden, width]),
        ]);
        if moe.selection_bias {
            shapes.push((n(names::FFN_EXP_PROBS_B), vec![experts]));
        }
        let shared = moe.num_shared_experts * width;
        if shared > 0 {
            shapes.extend([
                (n(names::FFN_GATE_SHEXP), vec![shared, hidden]),
                (n(names::FFN_UP_SHEXP), vec![shared, hidden]),
                (n(names::FFN_DOWN_SHEXP), vec![hidden, shared]),
            ]);
        }
    } else {
        let width = config.intermediate_size;
        shapes.extend([
            (n(names::FFN_GATE), vec![width, hidden]),
            (n(names::FFN_UP), vec![width, hidden]),
            (n(names::FFN_DOWN), vec![hidden, width]),
        ]);
    }
    shapes
}
