//! DeepSeek configurations: DeepSeek-V2-Lite's published `config.json` (transcribed) against
//! the `deepseek-v2-lite` preset, the tiny fixtures' `config.json` against their GGUF (llama.cpp's
//! `deepseek2` keys: one configuration whichever file it comes from), and the errors that name
//! a field.

use std::path::PathBuf;

use pagoda_models::config::{ExpertScoring, GroupScoring, ModelConfig, RopeStyle, TopKWeights};
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::gguf_model::config_from_gguf;
use pagoda_models::hf::config_from_hf_json;
use pagoda_models::random::preset;

const DEEPSEEK_V2_LITE: &str = r#"{
  "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000,
  "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
  "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
  "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16,
  "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
  "pretraining_tp": 1, "q_lora_rank": null, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                   "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                   "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
  "seq_aux": true, "tie_word_embeddings": false, "topk_group": 1, "topk_method": "greedy",
  "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true,
  "v_head_dim": 128, "vocab_size": 102400
}"#;

fn edited(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let mut value: serde_json::Value = serde_json::from_str(DEEPSEEK_V2_LITE).unwrap();
    edit(value.as_object_mut().unwrap());
    value.to_string()
}

/// An edit of the V2-Lite config.
type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, serde_json::Value>)>;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny")
        .join(path)
}

#[test]
fn deepseek_v2_lite_config_is_the_preset() {
    let parsed = config_from_hf_json(DEEPSEEK_V2_LITE).unwrap();
    assert_eq!(parsed, preset("deepseek-v2-lite").unwrap());
    let mla = parsed.mla.as_ref().unwrap();
    // One latent row of 512 + 64 per token; the query head is 128 + 64.
    assert_eq!((parsed.num_kv_heads, parsed.head_dim), (1, 576));
    assert_eq!(mla.q_head_dim(), 192);
    // mscale == mscale_all_dim: the rotation is unscaled, the softmax scale grows by
    // (0.1 * 0.707 * ln 40 + 1)^2.
    assert_eq!(mla.rope_scale(), 1.0);
    let m = 0.1f32 * 0.707 * 40f32.ln() + 1.0;
    assert!((mla.softmax_scale() - m * m / 192f32.sqrt()).abs() < 1e-7);
}

/// transformers 5 writes `rope_theta` only inside `rope_parameters` (with the YaRN fields),
/// and V3's `rope_interleave: false` rotates the stored halves.
#[test]
fn transformers_5_rope_parameters_and_rope_interleave_are_read() {
    let v2 = config_from_hf_json(&edited(|c| {
        let mut parameters = c.remove("rope_scaling").unwrap();
        parameters["rope_theta"] = 20000.0.into();
        c.remove("rope_theta");
        c.insert("rope_parameters".into(), parameters);
    }))
    .unwrap();
    assert_eq!(v2.rope_theta, 20000.0);
    assert_eq!(v2.mla.as_ref().unwrap().yarn.unwrap().factor, 40.0);
    assert_eq!(v2.rope_style, RopeStyle::Interleaved);
    let v3 = |interleave: serde_json::Value| {
        config_from_hf_json(&edited(|c| {
            c.insert("model_type".into(), "deepseek_v3".into());
            c.insert("rope_interleave".into(), interleave);
        }))
        .unwrap()
        .rope_style
    };
    assert_eq!(v3(true.into()), RopeStyle::Interleaved);
    assert_eq!(v3(serde_json::Value::Null), RopeStyle::Interleaved);
    assert_eq!(v3(false.into()), RopeStyle::Halves);
}

#[test]
fn the_tiny_fixtures_read_the_same_from_config_json_and_gguf() {
    for (name, gguf) in [
        ("tiny-deepseek-v2", "model.gguf"),
        ("tiny-deepseek-v2", "model-kv-b.gguf"),
        ("tiny-deepseek-v3", "model.gguf"),
    ] {
        let json = std::fs::read_to_string(fixture(&format!("{name}/config.json"))).unwrap();
        let hf = config_from_hf_json(&json).unwrap();
        let file = GgufFile::open(fixture(&format!("{name}/{gguf}"))).unwrap();
        let gguf = config_from_gguf(&file).unwrap();
        // llama.cpp stores `0.1 * mscale_all_dim`; compare YaRN to f32 rounding, the rest
        // exactly.
        let (hf_yarn, gguf_yarn) = (
            hf.mla.as_ref().unwrap().yarn,
            gguf.mla.as_ref().unwrap().yarn,
        );
        assert_eq!(hf_yarn.is_some(), gguf_yarn.is_some(), "{name}");
        if let (Some(a), Some(b)) = (hf_yarn, gguf_yarn) {
            assert!(
                (a.mscale - b.mscale).abs() < 1e-6
                    && (a.mscale_all_dim - b.mscale_all_dim).abs() < 1e-6
            );
            assert_eq!(
                (a.factor, a.original_max_position_embeddings),
                (b.factor, b.original_max_position_embeddings)
            );
        }
        let without_yarn = |mut config: ModelConfig| {
            config.mla.as_mut().unwrap().yarn = None;
            config
        };
        assert_eq!(without_yarn(hf.clone()), without_yarn(gguf), "{name}");
    }
    let v2 = config_from_hf_json(
        &std::fs::read_to_string(fixture("tiny-deepseek-v2/config.json")).unwrap(),
    )
    .unwrap();
    let moe = v2.moe.unwrap();
    assert_eq!(moe.scoring, ExpertScoring::Softmax);
    assert_eq!(moe.group_limit.unwrap().score, GroupScoring::Max);
    assert_eq!(
        (moe.top_k_weights, moe.routed_scaling_factor),
        (TopKWeights::Softmax, 1.5)
    );
    assert!(!moe.selection_bias && v2.mla.unwrap().q_lora_rank.is_none());
    let v3 = config_from_hf_json(
        &std::fs::read_to_string(fixture("tiny-deepseek-v3/config.json")).unwrap(),
    )
    .unwrap();
    let moe = v3.moe.unwrap();
    assert_eq!(moe.scoring, ExpertScoring::Sigmoid);
    assert_eq!(moe.group_limit.unwrap().score, GroupScoring::TopTwoSum);
    assert!(moe.selection_bias && moe.top_k_weights == TopKWeights::Normalized);
    assert_eq!(v3.mla.unwrap().q_lora_rank, Some(24));
    assert_eq!(moe.dense_layers, [0]);
}

#[test]
fn bad_deepseek_fields_are_named() {
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|m| {
                m.remove("kv_lora_rank");
            }),
            "kv_lora_rank",
        ),
        (
            Box::new(|m| {
                m.insert("topk_method".into(), "noaux_tc".into());
            }),
            "needs scoring_func",
        ),
        (
            Box::new(|m| {
                m.insert("topk_method".into(), "random".into());
            }),
            "topk_method",
        ),
        (
            Box::new(|m| {
                m.insert("scoring_func".into(), "sqrtsoftplus".into());
            }),
            "scoring_func",
        ),
        (
            Box::new(|m| {
                m.insert("topk_method".into(), "group_limited_greedy".into());
                m.insert("n_group".into(), 5.into());
            }),
            "n_group 5 must divide",
        ),
        (
            Box::new(|m| {
                m.insert(
                    "rope_scaling".into(),
                    serde_json::json!({"type": "linear", "factor": 2.0}),
                );
            }),
            "`yarn`",
        ),
        (
            Box::new(|m| {
                m.insert("routed_scaling_factor".into(), 0.into());
            }),
            "routed_scaling_factor",
        ),
    ];
    for (edit, expected) in cases {
        let error = config_from_hf_json(&edited(edit)).unwrap_err().to_string();
        assert!(
            error.contains(expected),
            "expected `{expected}` in: {error}"
        );
    }
}
