//! DeepSeek presets of [`super::preset`] (their tensors: `hf::deepseek_layer_tensors`).

use crate::config::{
    Architecture, ExpertGroupLimit, ExpertScoring, GroupScoring, IndexerConfig, MlaConfig,
    ModelConfig, MoeConfig, RopeStyle, TopKWeights, YarnScaling,
};

/// A DeepSeek model of `mla`'s latent attention (the cache shapes follow from it).
fn deepseek(base: ModelConfig, mla: MlaConfig, moe: MoeConfig) -> ModelConfig {
    ModelConfig {
        num_kv_heads: 1,
        head_dim: mla.cache_row(),
        rope_dim: mla.qk_rope_head_dim,
        rope_style: RopeStyle::Interleaved,
        moe: Some(moe),
        mla: Some(mla),
        ..base
    }
}

/// A tiny DeepSeek shell: hidden 64, 3 layers (the first dense), 4 heads.
fn tiny_base() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::DeepSeek2,
        hidden_size: 64,
        num_layers: 3,
        num_attention_heads: 4,
        num_kv_heads: 1,
        head_dim: 0,
        intermediate_size: 96,
        vocab_size: 512,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_dim: 0,
        rope_style: RopeStyle::Interleaved,
        rope_scaling: None,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
        moe: None,
        mla: None,
    }
}

/// The DeepSeek preset `name` (lowercase), if it is one.
pub(super) fn preset(name: &str) -> Option<ModelConfig> {
    Some(match name {
        // DeepSeek-V2-Lite: 15.7B parameters, 2.4B active per token.
        "deepseek-v2-lite" => deepseek(
            ModelConfig {
                hidden_size: 2048,
                num_layers: 27,
                num_attention_heads: 16,
                intermediate_size: 10944,
                vocab_size: 102400,
                max_position_embeddings: 163840,
                ..tiny_base()
            },
            MlaConfig {
                q_lora_rank: None,
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                yarn: Some(YarnScaling {
                    factor: 40.0,
                    original_max_position_embeddings: 4096,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: 0.707,
                    mscale_all_dim: 0.707,
                }),
                indexer: None,
            },
            MoeConfig {
                num_experts: 64,
                experts_per_token: 6,
                expert_intermediate_size: 1408,
                top_k_weights: TopKWeights::Softmax,
                dense_layers: vec![0],
                num_shared_experts: 2,
                ..MoeConfig::default()
            },
        ),
        // Tests, V2-style: no query compression, softmax with group-limited greedy routing,
        // an unnormalised scaled top-k, YaRN with a rope scale other than 1.
        "deepseek-v2-tiny" => deepseek(
            tiny_base(),
            MlaConfig {
                q_lora_rank: None,
                kv_lora_rank: 32,
                qk_nope_head_dim: 16,
                qk_rope_head_dim: 8,
                v_head_dim: 16,
                yarn: Some(YarnScaling {
                    factor: 4.0,
                    original_max_position_embeddings: 32,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: 1.0,
                    mscale_all_dim: 0.8,
                }),
                indexer: None,
            },
            MoeConfig {
                num_experts: 8,
                experts_per_token: 2,
                expert_intermediate_size: 32,
                top_k_weights: TopKWeights::Softmax,
                dense_layers: vec![0],
                routed_scaling_factor: 1.5,
                group_limit: Some(ExpertGroupLimit {
                    num_groups: 4,
                    groups_per_token: 2,
                    score: GroupScoring::Max,
                }),
                num_shared_experts: 1,
                ..MoeConfig::default()
            },
        ),
        // Tests, V3-style: query compression, sigmoid scores with the selection bias and
        // top-two group scores (`noaux_tc`), normalised then scaled.
        "deepseek-v3-tiny" => deepseek(tiny_base(), v3_tiny_mla(None), v3_tiny_moe()),
        // Tests, V3.2-style: deepseek-v3-tiny's shapes with the sparse-attention indexer (8
        // heads of 24, top 5 tokens: rows past 5 tokens attend sparsely; a cache row of 64
        // fits q8_0) and YaRN with a rope scale other than 1.
        "deepseek-v32-tiny" => {
            let indexer = IndexerConfig {
                num_heads: 8,
                head_dim: 24,
                top_k: 5,
            };
            let mla = MlaConfig {
                yarn: Some(YarnScaling {
                    factor: 4.0,
                    original_max_position_embeddings: 32,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: 1.0,
                    mscale_all_dim: 0.8,
                }),
                ..v3_tiny_mla(Some(indexer))
            };
            deepseek(tiny_base(), mla, v3_tiny_moe())
        }
        // Tests of the CUDA latent attention: the MLA kernels' row (512 + 64) and a head
        // tile of 16 heads, small elsewhere; every MLP dense (`dense_layers` lists every
        // layer), query compression, YaRN with a rope scale other than 1.
        "deepseek-mla-dense-tiny" => deepseek(
            ModelConfig {
                hidden_size: 128,
                num_layers: 2,
                num_attention_heads: 16,
                intermediate_size: 256,
                ..tiny_base()
            },
            MlaConfig {
                q_lora_rank: Some(64),
                kv_lora_rank: 512,
                qk_nope_head_dim: 32,
                qk_rope_head_dim: 64,
                v_head_dim: 32,
                yarn: Some(YarnScaling {
                    factor: 4.0,
                    original_max_position_embeddings: 64,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: 1.0,
                    mscale_all_dim: 0.8,
                }),
                indexer: None,
            },
            MoeConfig {
                num_experts: 2,
                experts_per_token: 1,
                expert_intermediate_size: 32,
                dense_layers: vec![0, 1],
                ..MoeConfig::default()
            },
        ),
        _ => return None,
    })
}

/// deepseek-v3-tiny's latent attention, with `indexer`.
fn v3_tiny_mla(indexer: Option<IndexerConfig>) -> MlaConfig {
    MlaConfig {
        q_lora_rank: Some(24),
        kv_lora_rank: 32,
        qk_nope_head_dim: 16,
        qk_rope_head_dim: 8,
        v_head_dim: 16,
        yarn: None,
        indexer,
    }
}

/// deepseek-v3-tiny's router and experts.
fn v3_tiny_moe() -> MoeConfig {
    MoeConfig {
        num_experts: 8,
        experts_per_token: 3,
        expert_intermediate_size: 32,
        top_k_weights: TopKWeights::Normalized,
        dense_layers: vec![0],
        scoring: ExpertScoring::Sigmoid,
        routed_scaling_factor: 2.5,
        group_limit: Some(ExpertGroupLimit {
            num_groups: 4,
            groups_per_token: 2,
            score: GroupScoring::TopTwoSum,
        }),
        selection_bias: true,
        num_shared_experts: 1,
    }
}

#[cfg(test)]
mod tests {
    use pagoda_kv::{BlockPool, BlockTable, PageTable};
    use pagoda_ops::attention::KvType;

    use super::preset;
    use crate::llama::{AttentionPolicy, ForwardBatch, Model, WeightPrecision};
    use crate::random::RandomWeights;

    /// The CUDA tests' model (`crates/engine/tests/cuda_mla.rs`) has no expert layer and runs
    /// on the CPU, their oracle.
    #[test]
    fn the_dense_mla_preset_runs_on_the_cpu() {
        let config = preset("deepseek-mla-dense-tiny").unwrap();
        assert!(!config.has_expert_layers());
        let weights = RandomWeights::new(&config, 3, 1 << 30).unwrap();
        let model = Model::load(config.clone(), &weights, WeightPrecision::F32).unwrap();
        let mut kv = model.new_kv_cache(4, 16, KvType::F32, KvType::F32).unwrap();
        let mut pool = BlockPool::new(4, 16).unwrap();
        let mut table = BlockTable::new();
        let slots = table.append_slots(&mut pool, 5).unwrap();
        let page_table = PageTable::from_block_tables(&[&table], &pool).unwrap();
        let batch = ForwardBatch {
            tokens: &[1, 2, 3, 4, 5],
            positions: &[0, 1, 2, 3, 4],
            slots: &slots,
            qo_indptr: &[0, 5],
            page_table: &page_table,
            logits_for: &[4],
            sparse: &[],
        };
        let logits = model
            .forward(&batch, &mut kv, AttentionPolicy::Auto)
            .unwrap()
            .logits;
        assert_eq!(logits.len(), config.vocab_size);
        assert!(logits.iter().all(|v| v.is_finite()));
    }
}
