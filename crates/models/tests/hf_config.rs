//! `config.json` / `generation_config.json` parsing against hand-checked expectations: real
//! configs of released checkpoints (copied from their HF repositories) and error cases.

use pagoda_models::config::{Architecture, Llama3RopeScaling, ModelConfig, RopeStyle};
use pagoda_models::hf::{config_from_hf_json, generation_defaults_from_json, GenerationDefaults};

const SMOLLM2_135M: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576,
  "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": true,
  "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9,
  "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05, "rope_interleaved": false, "rope_scaling": null, "rope_theta": 100000,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
  "use_cache": true, "vocab_size": 49152
}"#;

const LLAMA_31_8B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256
}"#;

/// Llama-3.2-1B as transformers 5 writes it: RoPE settings under `rope_parameters`.
const LLAMA_32_1B_TRANSFORMERS5: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
  "tie_word_embeddings": true, "vocab_size": 128256
}"#;

const QWEN25_7B: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
  "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
  "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
  "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 131072, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 152064
}"#;

const QWEN3_06B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
  "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
}"#;

const MISTRAL_7B_V03: &str = r#"{
  "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "head_dim": null, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
  "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "vocab_size": 32768
}"#;

/// A config with the fields every test below overrides.
fn config(
    architecture: Architecture,
    hidden_size: usize,
    num_layers: usize,
    heads: (usize, usize, usize),
) -> ModelConfig {
    let (num_attention_heads, num_kv_heads, head_dim) = heads;
    ModelConfig {
        architecture,
        hidden_size,
        num_layers,
        num_attention_heads,
        num_kv_heads,
        head_dim,
        intermediate_size: 0,
        vocab_size: 0,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_dim: head_dim,
        rope_style: RopeStyle::Halves,
        rope_scaling: None,
        max_position_embeddings: 0,
        tie_word_embeddings: false,
        moe: None,
        mla: None,
    }
}

#[test]
fn smollm2_135m() {
    let expected = ModelConfig {
        intermediate_size: 1536,
        vocab_size: 49152,
        rope_theta: 100_000.0,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        ..config(Architecture::Llama, 576, 30, (9, 3, 64))
    };
    assert_eq!(config_from_hf_json(SMOLLM2_135M).unwrap(), expected);
}

#[test]
fn llama_31_8b_with_llama3_scaling() {
    let expected = ModelConfig {
        intermediate_size: 14336,
        vocab_size: 128256,
        rope_theta: 500_000.0,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        max_position_embeddings: 131072,
        ..config(Architecture::Llama, 4096, 32, (32, 8, 128))
    };
    assert_eq!(config_from_hf_json(LLAMA_31_8B).unwrap(), expected);
}

#[test]
fn transformers5_rope_parameters() {
    let expected = ModelConfig {
        intermediate_size: 8192,
        vocab_size: 128256,
        rope_theta: 500_000.0,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        max_position_embeddings: 131072,
        tie_word_embeddings: true,
        ..config(Architecture::Llama, 2048, 16, (32, 8, 64))
    };
    assert_eq!(
        config_from_hf_json(LLAMA_32_1B_TRANSFORMERS5).unwrap(),
        expected
    );
}

#[test]
fn qwen25_7b() {
    let expected = ModelConfig {
        intermediate_size: 18944,
        vocab_size: 152064,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        max_position_embeddings: 32768,
        ..config(Architecture::Qwen2, 3584, 28, (28, 4, 128))
    };
    assert_eq!(config_from_hf_json(QWEN25_7B).unwrap(), expected);
}

#[test]
fn qwen3_head_dim_differs_from_hidden_over_heads() {
    let expected = ModelConfig {
        intermediate_size: 3072,
        vocab_size: 151936,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        max_position_embeddings: 40960,
        tie_word_embeddings: true,
        ..config(Architecture::Qwen3, 1024, 28, (16, 8, 128))
    };
    assert_eq!(config_from_hf_json(QWEN3_06B).unwrap(), expected);
}

#[test]
fn mistral_with_null_head_dim() {
    let expected = ModelConfig {
        intermediate_size: 14336,
        vocab_size: 32768,
        rope_theta: 1_000_000.0,
        max_position_embeddings: 32768,
        ..config(Architecture::Llama, 4096, 32, (32, 8, 128))
    };
    assert_eq!(config_from_hf_json(MISTRAL_7B_V03).unwrap(), expected);
}

#[test]
fn defaults_when_optional_fields_are_absent() {
    // No model_type (architectures instead), no kv heads, no head_dim, no rope_theta, no
    // tie flag, no eps, no max positions: transformers' LlamaConfig defaults apply.
    let json = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}"#;
    let expected = ModelConfig {
        intermediate_size: 128,
        vocab_size: 256,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 2048,
        ..config(Architecture::Llama, 64, 2, (4, 4, 16))
    };
    assert_eq!(config_from_hf_json(json).unwrap(), expected);
}

/// The error for `json` must mention every one of `needles` and the file name.
fn assert_error(json: &str, needles: &[&str]) {
    let message = config_from_hf_json(json)
        .expect_err("config should be rejected")
        .to_string();
    assert!(message.contains("config.json"), "{message}");
    for needle in needles {
        assert!(
            message.contains(needle),
            "error `{message}` does not mention `{needle}`"
        );
    }
}

fn smollm_with(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let mut value: serde_json::Value = serde_json::from_str(SMOLLM2_135M).unwrap();
    edit(value.as_object_mut().unwrap());
    value.to_string()
}

#[test]
fn config_errors_name_the_field() {
    assert_error("{not json", &["malformed JSON"]);
    assert_error("[1, 2]", &["object"]);
    assert_error(
        &smollm_with(|m| {
            m.insert("model_type".into(), "gpt2".into());
        }),
        &["model_type", "gpt2"],
    );
    assert_error(
        &smollm_with(|m| {
            m.remove("model_type");
            m.insert(
                "architectures".into(),
                serde_json::json!(["GPT2LMHeadModel"]),
            );
        }),
        &["architectures", "GPT2LMHeadModel"],
    );
    assert_error(
        &smollm_with(|m| {
            m.remove("hidden_size");
        }),
        &["hidden_size", "missing"],
    );
    assert_error(
        &smollm_with(|m| {
            m.remove("num_hidden_layers");
        }),
        &["num_hidden_layers", "missing"],
    );
    assert_error(
        &smollm_with(|m| {
            m.remove("vocab_size");
        }),
        &["vocab_size", "missing"],
    );
    assert_error(
        &smollm_with(|m| {
            m.insert("hidden_size".into(), "576".into());
        }),
        &["hidden_size", "integer"],
    );
    assert_error(
        &smollm_with(|m| {
            m.insert("rope_theta".into(), "big".into());
        }),
        &["rope_theta", "number"],
    );
    assert_error(
        &smollm_with(|m| {
            m.insert("hidden_act".into(), "gelu".into());
        }),
        &["hidden_act", "gelu"],
    );
    assert_error(
        &smollm_with(|m| {
            m.insert("num_key_value_heads".into(), 4.into());
        }),
        &["num_kv_heads"],
    );
    assert_error(
        &smollm_with(|m| {
            m.insert("num_attention_heads".into(), 0.into());
        }),
        &["num_attention_heads"],
    );
    assert_error(
        &smollm_with(|m| {
            m.insert(
                "rope_scaling".into(),
                serde_json::json!({"type": "yarn", "factor": 4.0}),
            );
        }),
        &["rope_scaling.rope_type", "yarn"],
    );
    assert_error(
        &smollm_with(|m| {
            let scaling = serde_json::json!({"rope_type": "llama3", "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
            m.insert("rope_scaling".into(), scaling);
        }),
        &["rope_scaling.factor", "missing"],
    );
    // Hidden size not a multiple of the heads and no head_dim to say otherwise.
    assert_error(
        &smollm_with(|m| {
            m.insert("num_attention_heads".into(), 7.into());
        }),
        &["head_dim"],
    );
}

#[test]
fn default_rope_type_means_no_scaling() {
    let json = smollm_with(|m| {
        m.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "default"}),
        );
    });
    assert_eq!(config_from_hf_json(&json).unwrap().rope_scaling, None);
}

#[test]
fn generation_defaults() {
    let json = r#"{"bos_token_id": 128000, "do_sample": true, "eos_token_id": [128001, 128008, 128009],
                   "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0.dev0"}"#;
    let expected = GenerationDefaults {
        do_sample: Some(true),
        temperature: Some(0.6),
        top_p: Some(0.9),
        eos_token_ids: vec![128001, 128008, 128009],
        bos_token_id: Some(128000),
        ..GenerationDefaults::default()
    };
    assert_eq!(generation_defaults_from_json(json).unwrap(), expected);

    let json = r#"{"eos_token_id": 151645, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
                   "max_new_tokens": 2048, "pad_token_id": 151643}"#;
    let expected = GenerationDefaults {
        top_k: Some(20),
        min_p: Some(0.0),
        repetition_penalty: Some(1.05),
        eos_token_ids: vec![151645],
        max_new_tokens: Some(2048),
        ..GenerationDefaults::default()
    };
    assert_eq!(generation_defaults_from_json(json).unwrap(), expected);
    assert_eq!(
        generation_defaults_from_json("{}").unwrap(),
        GenerationDefaults::default()
    );

    let message = generation_defaults_from_json(r#"{"eos_token_id": [2, "x"]}"#)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("generation_config.json") && message.contains("eos_token_id"),
        "{message}"
    );
    let message = generation_defaults_from_json(r#"{"top_k": -1}"#)
        .unwrap_err()
        .to_string();
    assert!(message.contains("top_k"), "{message}");
}
