//! Mixture-of-experts configurations: the `config.json` of released Qwen3-MoE and Mixtral
//! checkpoints (copied from their HF repositories) against the random-weight presets of the
//! same shapes, transformers' rules for dense layers, and the errors that name a field.

use pagoda_models::config::{Architecture, TopKWeights};
use pagoda_models::hf::config_from_hf_json;
use pagoda_models::random::preset;

const QWEN3_30B_A3B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
}"#;

const MIXTRAL_8X7B: &str = r#"{
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
  "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000
}"#;

fn edited(
    json: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> String {
    let mut value: serde_json::Value = serde_json::from_str(json).unwrap();
    edit(value.as_object_mut().unwrap());
    value.to_string()
}

#[test]
fn released_configs_are_the_presets() {
    assert_eq!(
        config_from_hf_json(QWEN3_30B_A3B).unwrap(),
        preset("qwen3-30b-a3b").unwrap()
    );
    assert_eq!(
        config_from_hf_json(MIXTRAL_8X7B).unwrap(),
        preset("mixtral-8x7b").unwrap()
    );
    // The class name alone is enough.
    let by_class = edited(MIXTRAL_8X7B, |map| {
        map.remove("model_type");
    });
    assert_eq!(
        config_from_hf_json(&by_class).unwrap().architecture,
        Architecture::Mixtral
    );
}

#[test]
fn qwen3_moe_dense_layers_follow_transformers() {
    // transformers' Qwen3MoeSparseMoeBlock: layer i is sparse unless it is in
    // mlp_only_layers or (i + 1) % decoder_sparse_step != 0.
    let json = edited(QWEN3_30B_A3B, |map| {
        map.insert("num_hidden_layers".into(), 6.into());
        map.insert("decoder_sparse_step".into(), 2.into());
        map.insert("mlp_only_layers".into(), serde_json::json!([3]));
        map.remove("norm_topk_prob");
    });
    let config = config_from_hf_json(&json).unwrap();
    let moe = config.moe.as_ref().unwrap();
    assert_eq!(moe.dense_layers, [0, 2, 3, 4]);
    assert!(config.is_moe_layer(1) && config.is_moe_layer(5) && !config.is_moe_layer(3));
    // transformers' default for norm_topk_prob is false.
    assert_eq!(moe.top_k_weights, TopKWeights::Softmax);
}

#[test]
fn transformers_5_spelling_of_the_expert_count_is_read() {
    // transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`.
    let json = edited(QWEN3_30B_A3B, |map| {
        let count = map.remove("num_experts").unwrap();
        map.insert("num_local_experts".into(), count);
    });
    assert_eq!(
        config_from_hf_json(&json).unwrap(),
        preset("qwen3-30b-a3b").unwrap()
    );
    let json = edited(QWEN3_30B_A3B, |map| {
        map.remove("num_experts");
    });
    let error = config_from_hf_json(&json).unwrap_err().to_string();
    assert!(error.contains("`num_experts` is missing"), "{error}");
}

#[test]
fn moe_config_errors_name_the_field() {
    let cases: [(&str, serde_json::Value, &str); 5] = [
        ("decoder_sparse_step", 0.into(), "decoder_sparse_step"),
        (
            "mlp_only_layers",
            serde_json::json!([48]),
            "mlp_only_layers",
        ),
        (
            "mlp_only_layers",
            serde_json::json!("all"),
            "mlp_only_layers",
        ),
        ("num_experts_per_tok", 200.into(), "num_experts_per_tok"),
        ("num_experts", 0.into(), "num_experts"),
    ];
    for (key, value, needle) in cases {
        let json = edited(QWEN3_30B_A3B, |map| {
            map.insert(key.into(), value.clone());
        });
        let error = config_from_hf_json(&json).unwrap_err().to_string();
        assert!(error.contains(needle), "{key} = {value}: {error}");
    }
    let json = edited(MIXTRAL_8X7B, |map| {
        map.remove("num_local_experts");
    });
    let error = config_from_hf_json(&json).unwrap_err().to_string();
    assert!(error.contains("num_local_experts"), "{error}");
}
