//! Loading the tiny HF fixtures (`tests/data/tiny/`, written by
//! `scripts/fixtures/tiny_models.py`): configs, canonical names, sharded == single file,
//! BF16 read-back against the script's recorded rounding, and bad-input errors.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pagoda_models::config::{Architecture, Llama3RopeScaling, ModelConfig, RopeStyle};
use pagoda_models::formats::safetensors::{canonical_name, SafetensorsWeights};
use pagoda_models::hf::HfModelDir;
use pagoda_models::weights::TensorSource;
use pagoda_tensor::GgmlType;

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny")
        .join(name)
}

/// A scratch directory unique to this test process and `name`, emptied first.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagoda-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Tensor names in a safetensors header, read without the loader under test.
fn header_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    header
        .keys()
        .filter(|name| *name != "__metadata__")
        .cloned()
        .collect()
}

/// A safetensors file holding one tensor of `dtype` with `shape` (zero bytes).
fn write_one_tensor(path: &Path, name: &str, dtype: &str, shape: &[usize], n_bytes: usize) {
    let header = format!(
        r#"{{"{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[0,{n_bytes}]}}}}"#
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + n_bytes, 0);
    std::fs::write(path, bytes).unwrap();
}

fn tiny_llama_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 64,
        num_layers: 2,
        num_attention_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        intermediate_size: 128,
        vocab_size: 256,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_dim: 16,
        rope_style: RopeStyle::Halves,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        }),
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        moe: None,
        mla: None,
    }
}

#[test]
fn fixture_configs() {
    let llama = HfModelDir::open(tiny("tiny-llama")).unwrap();
    assert_eq!(llama.config, tiny_llama_config());
    assert_eq!(llama.generation.eos_token_ids, vec![2, 3]);
    assert_eq!(llama.generation.temperature, Some(0.6));
    assert_eq!(llama.generation.top_p, Some(0.9));
    assert!(llama.tokenizer_path.is_some() && llama.tokenizer_config_path.is_some());

    let qwen2 = HfModelDir::open(tiny("tiny-qwen2")).unwrap();
    let expected = ModelConfig {
        architecture: Architecture::Qwen2,
        hidden_size: 32,
        intermediate_size: 64,
        head_dim: 8,
        rope_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        max_position_embeddings: 128,
        tie_word_embeddings: true,
        ..tiny_llama_config()
    };
    assert_eq!(qwen2.config, expected);
    assert_eq!(qwen2.generation.eos_token_ids, vec![2]);
    assert_eq!(qwen2.generation.top_k, Some(20));
    assert_eq!(qwen2.generation.repetition_penalty, Some(1.05));

    let qwen3 = HfModelDir::open(tiny("tiny-qwen3")).unwrap();
    let expected = ModelConfig {
        architecture: Architecture::Qwen3,
        tie_word_embeddings: false,
        head_dim: 16,
        rope_dim: 16,
        ..expected
    };
    assert_eq!(qwen3.config, expected);
    assert_eq!(qwen3.generation.max_new_tokens, Some(64));
    assert_eq!(qwen3.generation.min_p, Some(0.0));
}

#[test]
fn canonical_names_cover_every_fixture_tensor() {
    // (fixture, extra per-layer tensors beyond the 9 llama ones, has lm_head)
    for (fixture, extra_per_layer, has_output) in [
        ("tiny-llama", 0, true),
        ("tiny-qwen2", 3, false),
        ("tiny-qwen3", 2, true),
    ] {
        let model = HfModelDir::open(tiny(fixture)).unwrap();
        let stored = header_names(&tiny(fixture).join("model.safetensors"));
        assert!(
            model.weights.unmapped_names().is_empty(),
            "{fixture}: {:?}",
            model.weights.unmapped_names()
        );
        assert_eq!(model.weights.len(), stored.len(), "{fixture}");
        assert_eq!(
            stored.len(),
            2 + usize::from(has_output) + 2 * (9 + extra_per_layer),
            "{fixture}"
        );
        let names: BTreeSet<String> = model.weights.tensor_names().into_iter().collect();
        for hf_name in &stored {
            let canonical =
                canonical_name(hf_name).unwrap_or_else(|| panic!("{fixture}: {hf_name} unmapped"));
            assert!(names.contains(&canonical), "{fixture}: {canonical}");
            assert_eq!(model.weights.hf_name(&canonical), Some(hf_name.as_str()));
        }
        for layer in 0..2 {
            assert!(names.contains(&format!("blk.{layer}.attn_q.weight")));
            assert!(names.contains(&format!("blk.{layer}.ffn_down.weight")));
        }
        assert_eq!(names.contains("output.weight"), has_output, "{fixture}");
    }
    let qwen2 = SafetensorsWeights::open_dir(tiny("tiny-qwen2")).unwrap();
    let bias = qwen2.tensor("blk.1.attn_k.bias").unwrap();
    assert_eq!(
        (bias.ty, bias.shape.as_slice(), bias.data.len()),
        (GgmlType::F32, &[16usize][..], 64)
    );
    let qwen3 = SafetensorsWeights::open_dir(tiny("tiny-qwen3")).unwrap();
    let q = qwen3.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.shape, vec![64, 32]); // [heads * head_dim, hidden], row-major as stored
    assert_eq!(
        qwen3.tensor("blk.0.attn_q_norm.weight").unwrap().shape,
        vec![16]
    );
}

#[test]
fn sharded_and_single_file_hold_identical_tensors() {
    let single = HfModelDir::open(tiny("tiny-llama")).unwrap();
    let sharded = HfModelDir::open(tiny("tiny-llama-sharded")).unwrap();
    assert_eq!(single.config, sharded.config);
    assert_eq!(single.weights.shard_paths().len(), 1);
    assert_eq!(sharded.weights.shard_paths().len(), 2);
    assert_eq!(
        single.weights.tensor_names(),
        sharded.weights.tensor_names()
    );
    for name in single.weights.tensor_names() {
        let a = single.weights.tensor(&name).unwrap();
        let b = sharded.weights.tensor(&name).unwrap();
        assert_eq!((a.ty, &a.shape), (b.ty, &b.shape), "{name}");
        assert_eq!(a.data, b.data, "{name}");
        assert_eq!(
            a.data.len(),
            a.shape.iter().product::<usize>() * 2,
            "{name}"
        );
    }
}

#[test]
fn bf16_tensors_match_the_recorded_rounding() {
    let weights = SafetensorsWeights::open_dir(tiny("tiny-llama")).unwrap();
    let checks: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(tiny("tiny-llama/bf16_check.json")).unwrap())
            .unwrap();
    assert_eq!(checks.len(), 3);
    for (hf_name, check) in &checks {
        let tensor = weights.tensor(&canonical_name(hf_name).unwrap()).unwrap();
        assert_eq!(tensor.ty, GgmlType::BF16);
        let f32_bits = check["f32_bits"].as_array().unwrap();
        let bf16_bits = check["bf16_bits"].as_array().unwrap();
        for (index, (master, recorded)) in f32_bits.iter().zip(bf16_bits).enumerate() {
            let master = f32::from_bits(master.as_u64().unwrap() as u32);
            let recorded = recorded.as_u64().unwrap() as u16;
            let stored = u16::from_le_bytes([tensor.data[2 * index], tensor.data[2 * index + 1]]);
            assert_eq!(stored, recorded, "{hf_name}[{index}]");
            assert_eq!(
                half::bf16::from_f32(master).to_bits(),
                recorded,
                "{hf_name}[{index}] = {master}"
            );
        }
    }
    // The script planted exact ties at the start of the embedding: round half to even.
    let embedding = weights.tensor("token_embd.weight").unwrap();
    let first: Vec<u16> = embedding.data[..8]
        .chunks(2)
        .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
        .collect();
    assert_eq!(first, vec![0x3F80, 0x3F82, 0xBF80, 0x3F80]);
}

#[test]
fn expected_logits_have_the_documented_shape() {
    for fixture in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        let text = std::fs::read_to_string(tiny(fixture).join("expected.json")).unwrap();
        let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
        let tokens = expected["tokens"].as_array().unwrap();
        let logits = expected["logits"].as_array().unwrap();
        assert_eq!(tokens.len(), 2);
        for (sequence, rows) in tokens.iter().zip(logits) {
            let rows = rows.as_array().unwrap();
            assert_eq!(sequence.as_array().unwrap().len(), rows.len(), "{fixture}");
            assert!(
                rows.iter().all(|row| row.as_array().unwrap().len() == 256),
                "{fixture}"
            );
        }
    }
}

#[test]
fn missing_config_is_named() {
    let dir = scratch("missing-config");
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        message.contains("config.json") && message.contains("cannot read"),
        "{message}"
    );
    let message = HfModelDir::open(dir.join("absent"))
        .unwrap_err()
        .to_string();
    assert!(message.contains("not a directory"), "{message}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_shard_is_named() {
    let dir = scratch("missing-shard");
    for file in [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
    ] {
        std::fs::copy(tiny("tiny-llama-sharded").join(file), dir.join(file)).unwrap();
    }
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        message.contains("model-00002-of-00002.safetensors") && message.contains("does not exist"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_weights_is_named() {
    let dir = scratch("no-weights");
    std::fs::copy(tiny("tiny-qwen2/config.json"), dir.join("config.json")).unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        message.contains("model.safetensors.index.json"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unsupported_dtype_is_named() {
    let dir = scratch("dtype");
    let path = dir.join("model.safetensors");
    write_one_tensor(&path, "model.embed_tokens.weight", "I64", &[2, 2], 32);
    let message = SafetensorsWeights::open_file(&path)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("model.embed_tokens.weight") && message.contains("I64"),
        "{message}"
    );
    // F8_E4M3 is read with its block factors (hf_fp8_weights.rs); other FP8 forms are not.
    write_one_tensor(
        &path,
        "model.layers.0.mlp.up_proj.weight",
        "F8_E5M2",
        &[4],
        4,
    );
    let message = SafetensorsWeights::open_file(&path)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("F8_E5M2") && message.contains("model.safetensors"),
        "{message}"
    );
    // A tensor pagoda does not use may have any dtype.
    write_one_tensor(
        &path,
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "I64",
        &[4],
        32,
    );
    let weights = SafetensorsWeights::open_file(&path).unwrap();
    assert!(weights.is_empty());
    assert_eq!(
        weights.unmapped_names(),
        ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn malformed_files_are_named() {
    let dir = scratch("malformed");
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        message.contains("config.json") && message.contains("malformed JSON"),
        "{message}"
    );

    std::fs::copy(tiny("tiny-llama/config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("generation_config.json"), "[]").unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(message.contains("generation_config.json"), "{message}");
    std::fs::remove_file(dir.join("generation_config.json")).unwrap();

    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": 3}"#,
    )
    .unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        message.contains("index.json") && message.contains("weight_map"),
        "{message}"
    );
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"lm_head.weight": "../x"}}"#,
    )
    .unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(message.contains("relative"), "{message}");

    // Truncated: the header promises more data than the file has.
    let bytes = std::fs::read(tiny("tiny-qwen2/model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() - 10]).unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        message.contains("model.safetensors") && message.contains("invalid safetensors"),
        "{message}"
    );
    std::fs::write(dir.join("model.safetensors"), [1u8, 2, 3]).unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(message.contains("invalid safetensors"), "{message}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn shard_missing_a_listed_tensor_is_named() {
    let dir = scratch("index-lies");
    std::fs::copy(
        tiny("tiny-llama-sharded/model-00001-of-00002.safetensors"),
        dir.join("a.safetensors"),
    )
    .unwrap();
    let index = r#"{"weight_map": {"lm_head.weight": "a.safetensors"}}"#;
    std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
    let message = SafetensorsWeights::open_dir(&dir).unwrap_err().to_string();
    assert!(
        message.contains("lm_head.weight") && message.contains("a.safetensors"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn weights_that_contradict_the_config_are_named() {
    let dir = scratch("shape-mismatch");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny("tiny-qwen2/config.json")).unwrap())
            .unwrap();
    config["intermediate_size"] = 65.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        tiny("tiny-qwen2/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        message.contains("model.layers.0.mlp.gate_proj.weight") && message.contains("65"),
        "{message}"
    );

    // Untied config over tied weights: the LM head is missing.
    config["intermediate_size"] = 64.into();
    config["tie_word_embeddings"] = false.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let message = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        message.contains("output.weight") && message.contains("missing"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fixture_tokenizer_is_byte_level() {
    let model = HfModelDir::open(tiny("tiny-qwen3")).unwrap();
    let tokenizer = tokenizers::Tokenizer::from_file(model.tokenizer_path.unwrap()).unwrap();
    assert_eq!(tokenizer.get_vocab_size(true), 256);
    let encoding = tokenizer.encode("Hello, ", false).unwrap();
    assert_eq!(encoding.get_ids(), [72, 101, 108, 108, 111, 44, 32]);
    let ids: Vec<u32> = "héllo ✓".bytes().map(u32::from).collect();
    assert_eq!(
        tokenizer.encode("héllo ✓", false).unwrap().get_ids(),
        ids.as_slice()
    );
    assert_eq!(tokenizer.decode(&ids, false).unwrap(), "héllo ✓");
}
