//! The forward pass of every architecture against an independent float64 numpy forward
//! (`scripts/fixtures/tiny_models.py`) on tiny random models: llama with llama3 RoPE scaling
//! (HF layout in bf16, and the same weights as a llama.cpp-layout GGUF with permuted q/k rows
//! and `rope_freqs`), Qwen2 with q/k/v biases and tied embeddings, Qwen3 with q/k norms and a
//! head_dim that differs from hidden/heads; the mixture-of-experts Qwen3-MoE (a dense layer
//! among MoE layers, unnormalised top-k weights; and as llama.cpp's GGUF with stacked experts)
//! and Mixtral (bf16). Logits at every position, prefill in one pass and
//! token by token (split-KV decode), must agree with the oracle.

use std::path::PathBuf;

use pagoda_engine::{load_model, LoadOptions, ModelSource};
use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision};
use pagoda_ops::attention::AttentionPath;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/data/tiny")
        .join(name)
}

fn expected(dir: &str) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(dir).join("expected.json")).unwrap())
            .unwrap();
    let tokens = json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect();
    let logits = json["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    p.as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_f64().unwrap() as f32)
                        .collect()
                })
                .collect()
        })
        .collect();
    (tokens, logits)
}

/// Logits at every position: either one prefill of the whole sequence, or one token per step.
fn logits(
    model: &Model,
    tokens: &[u32],
    one_at_a_time: bool,
    path: AttentionPath,
) -> Vec<Vec<f32>> {
    let page_size = 4; // small pages so even these short sequences span several
    let num_pages = tokens.len().div_ceil(page_size) + 2;
    let mut pool = BlockPool::new(num_pages, page_size).unwrap();
    // Burn a page so physical pages are not in sequence order.
    let _burned = pool.allocate().unwrap();
    let mut table = BlockTable::new();
    let mut kv = KvCache::new(
        model.config().num_layers,
        model.kv_layout(num_pages, page_size),
    );
    let vocab = model.config().vocab_size;
    let chunk_len = if one_at_a_time { 1 } else { tokens.len() };
    let chunks: Vec<std::ops::Range<usize>> = (0..tokens.len())
        .step_by(chunk_len)
        .map(|i| i..(i + chunk_len).min(tokens.len()))
        .collect();
    let mut out = Vec::new();
    for chunk in chunks {
        let slots = table.append_slots(&mut pool, chunk.len()).unwrap();
        let page_table = PageTable::from_block_tables(&[&table], &pool).unwrap();
        let positions: Vec<u32> = chunk.clone().map(|p| p as u32).collect();
        let logits_for: Vec<usize> = (0..chunk.len()).collect();
        let batch = ForwardBatch {
            tokens: &tokens[chunk.clone()],
            positions: &positions,
            slots: &slots,
            qo_indptr: &[0, chunk.len() as u32],
            page_table: &page_table,
            logits_for: &logits_for,
            sparse: &[],
        };
        let output = model
            .forward(&batch, &mut kv, AttentionPolicy::Force(path))
            .unwrap();
        if one_at_a_time {
            assert_eq!(output.attention_path, path);
        }
        out.extend(output.logits.chunks(vocab).map(|r| r.to_vec()));
    }
    out
}

fn check(source: ModelSource, oracle_dir: &str, tolerance: f32) {
    let runs = [
        (false, AttentionPath::Gather),
        (true, AttentionPath::SplitKv),
        (true, AttentionPath::Gather),
    ];
    check_runs(source, oracle_dir, tolerance, &runs);
}

/// [`check`] over the given (token by token, attention path) runs.
fn check_runs(
    source: ModelSource,
    oracle_dir: &str,
    tolerance: f32,
    runs: &[(bool, AttentionPath)],
) {
    let loaded = load_model(
        &source,
        LoadOptions::cpu(WeightPrecision::AsStored),
        &mut |_, _| {},
    )
    .unwrap();
    let (sequences, expected) = expected(oracle_dir);
    let mut worst = 0f32;
    for (tokens, expected) in sequences.iter().zip(&expected) {
        for &(one_at_a_time, path) in runs {
            let got = logits(loaded.model.as_cpu().unwrap(), tokens, one_at_a_time, path);
            assert_eq!(got.len(), expected.len());
            for (position, (g, e)) in got.iter().zip(expected).enumerate() {
                for (token, (a, b)) in g.iter().zip(e).enumerate() {
                    let diff = (a - b).abs();
                    worst = worst.max(diff);
                    assert!(
                        diff < tolerance,
                        "{}: position {position} token {token}: {a} vs oracle {b} (one_at_a_time {one_at_a_time}, {path:?})",
                        source.path().display()
                    );
                }
            }
        }
    }
    eprintln!(
        "{}: worst logit difference {worst:.2e}",
        source.path().display()
    );
}

#[test]
fn tiny_llama_hf_bf16_with_llama3_scaling_matches_oracle() {
    check(
        ModelSource::HfDir(fixture("tiny-llama")),
        "tiny-llama",
        1e-4,
    );
}

#[test]
fn tiny_llama_sharded_matches_oracle() {
    // The sharded copy has no tokenizer; load its weights with the unsharded tokenizer.
    let hf = pagoda_models::hf::HfModelDir::open(fixture("tiny-llama-sharded")).unwrap();
    let model = Model::load(hf.config.clone(), &hf.weights, WeightPrecision::AsStored).unwrap();
    let (sequences, expected) = expected("tiny-llama");
    let got = logits(&model, &sequences[1], false, AttentionPath::Gather);
    for (g, e) in got.iter().zip(&expected[1]) {
        for (a, b) in g.iter().zip(e) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}

#[test]
fn tiny_llama_gguf_llama_cpp_layout_matches_oracle() {
    check(
        ModelSource::Gguf(fixture("tiny-llama-f32.gguf")),
        "tiny-llama",
        1e-4,
    );
}

#[test]
fn tiny_qwen2_biases_and_tied_embeddings_match_oracle() {
    check(
        ModelSource::HfDir(fixture("tiny-qwen2")),
        "tiny-qwen2",
        1e-4,
    );
}

#[test]
fn tiny_qwen3_qk_norm_matches_oracle() {
    check(
        ModelSource::HfDir(fixture("tiny-qwen3")),
        "tiny-qwen3",
        1e-4,
    );
}

#[test]
fn tiny_qwen3_moe_with_a_dense_layer_and_softmax_weights_matches_oracle() {
    check(
        ModelSource::HfDir(fixture("tiny-qwen3-moe")),
        "tiny-qwen3-moe",
        1e-4,
    );
}

#[test]
fn tiny_qwen3_moe_gguf_with_a_dense_layer_matches_oracle() {
    // The dense layer has no router in the file; `expert_weights_norm = false` keeps the
    // softmax weights unnormalised.
    check(
        ModelSource::Gguf(fixture("tiny-qwen3-moe/model.gguf")),
        "tiny-qwen3-moe",
        1e-4,
    );
}

#[test]
fn tiny_mixtral_bf16_matches_oracle() {
    check(
        ModelSource::HfDir(fixture("tiny-mixtral")),
        "tiny-mixtral",
        1e-4,
    );
}

#[test]
fn tiny_qwen3_moe_gguf_stacked_experts_match_oracle() {
    check(
        ModelSource::Gguf(fixture("tiny-qwen3-moe-gguf/model.gguf")),
        "tiny-qwen3-moe-gguf",
        1e-4,
    );
}

/// Latent attention has one path (absorbed, over the latent cache): a prefill in one pass
/// and token by token.
const MLA_RUNS: [(bool, AttentionPath); 2] = [
    (false, AttentionPath::Gather),
    (true, AttentionPath::Gather),
];

#[test]
fn tiny_deepseek_v2_matches_oracle_from_safetensors_and_gguf() {
    // No query compression, softmax group-limited routing, shared expert, YaRN; the GGUF in
    // llama.cpp's layouts after (split attn_k_b/attn_v_b) and before (joint attn_kv_b) its
    // MLA change.
    for source in [
        ModelSource::HfDir(fixture("tiny-deepseek-v2")),
        ModelSource::Gguf(fixture("tiny-deepseek-v2/model.gguf")),
        ModelSource::Gguf(fixture("tiny-deepseek-v2/model-kv-b.gguf")),
    ] {
        check_runs(source, "tiny-deepseek-v2", 1e-4, &MLA_RUNS);
    }
}

#[test]
fn tiny_deepseek_v3_matches_oracle_from_safetensors_and_gguf() {
    // q_lora, sigmoid routing with the selection bias and top-two group scores.
    for source in [
        ModelSource::HfDir(fixture("tiny-deepseek-v3")),
        ModelSource::Gguf(fixture("tiny-deepseek-v3/model.gguf")),
    ] {
        check_runs(source, "tiny-deepseek-v3", 1e-4, &MLA_RUNS);
    }
}

#[test]
fn tiny_deepseek_v3_with_block_scaled_fp8_weights_matches_oracle() {
    // DeepSeek-V3's release format: every projection F8_E4M3 with `_scale_inv` block
    // factors (16 x 16 here, partial blocks included); the oracle runs on the dequantized
    // weights in float64.
    let source = ModelSource::HfDir(fixture("tiny-deepseek-v3-fp8"));
    check_runs(source, "tiny-deepseek-v3-fp8", 1e-4, &MLA_RUNS);
}

/// `preset` on CUDA through `load_backend`: the error (every test machine has either no GPU
/// or the reason checked before the device opens).
fn cuda_load_error(preset: &str) -> String {
    let config = pagoda_models::random::preset(preset).unwrap();
    let weights = pagoda_models::random::RandomWeights::new(&config, 1, 1 << 30).unwrap();
    let options = LoadOptions {
        precision: WeightPrecision::AsStored,
        device: pagoda_engine::Device::Cuda {
            dtype: pagoda_models::llama_cuda::DType::BF16,
        },
    };
    match pagoda_engine::load_backend(config, &weights, options, &mut |_, _| {}) {
        Ok(_) => panic!("{preset} loaded on CUDA"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn deepseek_models_with_experts_pass_the_cuda_checks_where_the_kernels_fit() {
    use pagoda_models::config::{ExpertGroupLimit, ExpertScoring, GroupScoring, TopKWeights};
    use pagoda_models::llama_cuda::CudaModel;
    // V2-Lite: 64 experts, top-6, one group, two shared experts, the dense first layer.
    let lite = pagoda_models::random::preset("deepseek-v2-lite").unwrap();
    assert!(lite.has_expert_layers());
    assert_eq!(CudaModel::unsupported(&lite), None);
    // V3's router on V2-Lite's attention: 256 experts in 8 groups, the best 4 groups by their
    // top-two sum, top-8 by sigmoid plus selection bias.
    let moe = lite.moe.clone().unwrap();
    let v3_router = pagoda_models::config::MoeConfig {
        num_experts: 256,
        experts_per_token: 8,
        top_k_weights: TopKWeights::Normalized,
        scoring: ExpertScoring::Sigmoid,
        routed_scaling_factor: 2.5,
        group_limit: Some(ExpertGroupLimit {
            num_groups: 8,
            groups_per_token: 4,
            score: GroupScoring::TopTwoSum,
        }),
        selection_bias: true,
        num_shared_experts: 1,
        ..moe
    };
    let v3 = pagoda_models::config::ModelConfig {
        moe: Some(v3_router.clone()),
        ..lite.clone()
    };
    assert_eq!(CudaModel::unsupported(&v3), None);
    // More groups than the device router's lanes: declined, in one line, naming the groups.
    let many_groups = pagoda_models::config::ModelConfig {
        moe: Some(pagoda_models::config::MoeConfig {
            group_limit: Some(ExpertGroupLimit {
                num_groups: 64,
                groups_per_token: 4,
                score: GroupScoring::TopTwoSum,
            }),
            ..v3_router
        }),
        ..lite
    };
    let reason = CudaModel::unsupported(&many_groups).expect("64 groups declined");
    assert!(
        reason.contains("groups") && !reason.contains('\n'),
        "{reason}"
    );
}

#[test]
fn deepseek_models_the_cuda_kernels_do_not_fit_are_declined_in_one_line() {
    // The tiny presets' latent row (32 + 8) is not the MLA kernels' (512 + 64): declined for
    // the attention, not for their (group-limited) experts.
    for preset in ["deepseek-v2-tiny", "deepseek-v3-tiny"] {
        let message = cuda_load_error(preset);
        assert!(
            message.contains("the CUDA latent attention kernels do not support"),
            "{preset}: {message}"
        );
        assert!(!message.contains('\n'), "{message}");
    }
    let message = cuda_load_error("deepseek-v32-tiny");
    assert!(
        message.contains("indexer runs on the CPU for now"),
        "{message}"
    );
    assert!(!message.contains('\n'), "{message}");
}
