//! DeepSeek-V3.2 (sparse attention) without transformers: a released-style `config.json` and
//! the errors that name a field, and the `deepseek-v32-tiny` random model end to end:
//! - with `index_topk` at least the sequence length it is bit for bit the same weights run
//!   as V3 (dense MLA, no indexer), and with `index_topk` 5 the rows that see at most 5
//!   tokens still are while the later rows are not (they attend sparsely);
//! - a request's logits are bit-identical alone (one prefill, then decodes) and batched with
//!   others in mixed prefill/decode steps;
//! - a q8_0 latent cache of its 64-value rows runs (index keys quantized with the latents).
//!
//! The model against transformers is `crates/engine/tests/hf_cuda_parity.rs` on
//! `scripts/fixtures/hf_random_checkpoint.py`'s `deepseek_v32` checkpoint.

use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::config::{IndexerConfig, ModelConfig};
use pagoda_models::hf::config_from_hf_json;
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision};
use pagoda_models::random::{preset, RandomWeights};
use pagoda_ops::attention::{KvLayout, KvType};

/// DeepSeek-V3.2-Exp's `config.json` as released (its FP8 `quantization_config` included).
const DEEPSEEK_V32_EXP: &str = r#"{
  "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
  "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
  "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
  "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
  "max_position_embeddings": 163840, "model_type": "deepseek_v32",
  "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
  "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
  "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
  "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                          "quant_method": "fp8", "scale_fmt": "ue8m0",
                          "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                   "type": "yarn"},
  "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
  "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16", "transformers_version": "4.44.2", "use_cache": true,
  "v_head_dim": 128, "vocab_size": 129280
}"#;

fn edited(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let mut value: serde_json::Value = serde_json::from_str(DEEPSEEK_V32_EXP).unwrap();
    edit(value.as_object_mut().unwrap());
    value.to_string()
}

/// An edit of the V3.2-Exp config.
type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, serde_json::Value>)>;

#[test]
fn the_released_v32_config_has_its_indexer_in_the_cache_row() {
    let config = config_from_hf_json(DEEPSEEK_V32_EXP).unwrap();
    let mla = config.mla.as_ref().unwrap();
    assert_eq!(
        mla.indexer,
        Some(IndexerConfig {
            num_heads: 64,
            head_dim: 128,
            top_k: 2048,
        })
    );
    // The latent row (512 + 64) then the 128-value index key: 704 = 22 q8_0 blocks.
    assert_eq!((mla.latent_row(), mla.cache_row()), (576, 704));
    assert_eq!((config.num_kv_heads, config.head_dim), (1, 704));
    assert_eq!(mla.q_lora_rank, Some(1536));
    let moe = config.moe.as_ref().unwrap();
    assert_eq!(moe.dense_layers, [0, 1, 2]);
    assert!(moe.selection_bias);
    KvType::Q8_0.check_head_dim(config.head_dim).unwrap();
    // transformers 5's spelling: `rope_parameters` and `mlp_layer_types` (which wins over
    // first_k_dense_replace).
    let v5 = edited(|m| {
        let scaling = m.remove("rope_scaling").unwrap();
        let mut parameters = scaling.as_object().unwrap().clone();
        parameters.remove("type");
        parameters.insert("rope_type".into(), "yarn".into());
        parameters.insert("rope_theta".into(), m.remove("rope_theta").unwrap());
        m.insert("rope_parameters".into(), parameters.into());
        let kinds: Vec<&str> = (0..61)
            .map(|layer| if layer < 3 { "dense" } else { "sparse" })
            .collect();
        m.insert("mlp_layer_types".into(), serde_json::json!(kinds));
        m.insert("first_k_dense_replace".into(), 7.into());
    });
    assert_eq!(config_from_hf_json(&v5).unwrap(), config);
}

#[test]
fn bad_v32_fields_are_named() {
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|m| {
                m.insert("index_topk".into(), 0.into());
            }),
            "index_topk",
        ),
        (
            Box::new(|m| {
                m.remove("index_n_heads");
            }),
            "index_n_heads",
        ),
        (
            Box::new(|m| {
                m.insert("index_head_dim".into(), 32.into());
            }),
            "index_head_dim",
        ),
        (
            Box::new(|m| {
                m.insert("q_lora_rank".into(), serde_json::Value::Null);
            }),
            "q_lora_rank",
        ),
        (
            Box::new(|m| {
                m.insert(
                    "mlp_layer_types".into(),
                    serde_json::json!(["dense", "sparse"]),
                );
            }),
            "mlp_layer_types",
        ),
    ];
    for (edit, expected) in cases {
        let error = config_from_hf_json(&edited(edit)).unwrap_err().to_string();
        assert!(
            error.contains(expected),
            "expected `{expected}` in: {error}"
        );
    }
    // The same checks on a configuration built in code.
    let mut config = preset("deepseek-v32-tiny").unwrap();
    let indexer = config.mla.as_mut().unwrap().indexer.as_mut().unwrap();
    indexer.head_dim = 4;
    config.head_dim = config.mla.as_ref().unwrap().cache_row();
    let error = config.validate().unwrap_err().to_string();
    assert!(error.contains("index_head_dim (4)"), "{error}");
    config.mla.as_mut().unwrap().indexer.as_mut().unwrap().top_k = 0;
    let error = config.validate().unwrap_err().to_string();
    assert!(error.contains("index_topk (0)"), "{error}");
}

const PAGE_SIZE: usize = 4;
const NUM_PAGES: usize = 96;

/// Requests over one page pool: each request's block table.
struct Run<'m> {
    model: &'m Model,
    kv: KvCache,
    pool: BlockPool,
    tables: Vec<BlockTable>,
}

impl<'m> Run<'m> {
    fn new(model: &'m Model, requests: usize, kv_type: KvType) -> Self {
        let layout = KvLayout {
            num_pages: NUM_PAGES,
            page_size: PAGE_SIZE,
            num_kv_heads: 1,
            head_dim: model.config().head_dim,
        };
        let mut pool = BlockPool::new(NUM_PAGES, PAGE_SIZE).unwrap();
        // Burn a few pages so physical pages are not the logical ones.
        for _ in 0..3 {
            pool.allocate().unwrap();
        }
        Run {
            model,
            kv: KvCache::latent(model.config().num_layers, layout, kv_type).unwrap(),
            pool,
            tables: vec![BlockTable::new(); requests],
        }
    }

    /// One step of `work` (request, its next tokens); each request's logits, in order.
    fn step(&mut self, work: &[(usize, &[u32])]) -> Vec<Vec<Vec<f32>>> {
        let (mut tokens, mut positions, mut slots, mut qo_indptr) =
            (Vec::new(), Vec::new(), Vec::new(), vec![0u32]);
        for &(request, new_tokens) in work {
            let table = &mut self.tables[request];
            let first = table.num_tokens();
            slots.extend(
                table
                    .append_slots(&mut self.pool, new_tokens.len())
                    .unwrap(),
            );
            tokens.extend_from_slice(new_tokens);
            positions.extend((first..first + new_tokens.len()).map(|p| p as u32));
            qo_indptr.push(tokens.len() as u32);
        }
        let tables: Vec<&BlockTable> = work.iter().map(|&(r, _)| &self.tables[r]).collect();
        let page_table = PageTable::from_block_tables(&tables, &self.pool).unwrap();
        let logits_for: Vec<usize> = (0..tokens.len()).collect();
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            qo_indptr: &qo_indptr,
            page_table: &page_table,
            logits_for: &logits_for,
            sparse: &[],
        };
        let output = self
            .model
            .forward(&batch, &mut self.kv, AttentionPolicy::Auto)
            .unwrap();
        let vocab = self.model.config().vocab_size;
        let mut rows = output.logits.chunks(vocab).map(<[f32]>::to_vec);
        work.iter()
            .map(|(_, new_tokens)| rows.by_ref().take(new_tokens.len()).collect())
            .collect()
    }
}

/// `tokens` alone: a prefill of `prompt` tokens, then one decode step per token.
fn alone(model: &Model, tokens: &[u32], prompt: usize, kv_type: KvType) -> Vec<Vec<f32>> {
    let mut run = Run::new(model, 1, kv_type);
    let mut logits = run.step(&[(0, &tokens[..prompt])]).remove(0);
    for t in prompt..tokens.len() {
        logits.extend(run.step(&[(0, &tokens[t..t + 1])]).remove(0));
    }
    logits
}

fn sequence(seed: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729 + i * i * 31) % vocab) as u32)
        .collect()
}

fn v32_tiny(top_k: usize) -> ModelConfig {
    let mut config = preset("deepseek-v32-tiny").unwrap();
    config.mla.as_mut().unwrap().indexer.as_mut().unwrap().top_k = top_k;
    config
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|row| row.iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn v32_is_v3_where_no_row_sees_more_than_index_topk() {
    let sparse = v32_tiny(5);
    let weights = RandomWeights::new(&sparse, 11, 1 << 30).unwrap();
    let load = |config: ModelConfig| Model::load(config, &weights, WeightPrecision::F32).unwrap();
    let mut dense_config = sparse.clone();
    dense_config.mla.as_mut().unwrap().indexer = None;
    dense_config.head_dim = dense_config.mla.as_ref().unwrap().cache_row();
    let (v3, v32_dense, v32_sparse) = (
        load(dense_config),
        load(v32_tiny(10_000)),
        load(sparse.clone()),
    );
    let tokens = sequence(3, 40, sparse.vocab_size);
    let v3_logits = alone(&v3, &tokens, 23, KvType::F32);
    // index_topk above every row's visible count: the dense model's bits.
    assert_eq!(
        bits(&alone(&v32_dense, &tokens, 23, KvType::F32)),
        bits(&v3_logits)
    );
    // index_topk 5: the first 5 positions (and everything they depend on) are dense; each
    // later one attends to 5 of its tokens and differs.
    let sparse_logits = alone(&v32_sparse, &tokens, 23, KvType::F32);
    assert_eq!(bits(&sparse_logits[..5]), bits(&v3_logits[..5]));
    for (position, (s, d)) in sparse_logits.iter().zip(&v3_logits).enumerate().skip(5) {
        let diff = s.iter().zip(d).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff > 1e-4,
            "position {position}: sparse equals dense ({diff})"
        );
    }
    let before = pagoda_ops::attention::sparse_selection_counts();
    alone(&v32_sparse, &tokens[..8], 8, KvType::F32);
    let after = pagoda_ops::attention::sparse_selection_counts();
    // One prefill, every layer: rows 5, 6, 7 (seeing 6, 7 and 8 tokens) keep 5 each.
    let layers = sparse.num_layers as u64;
    assert!(after.0 - before.0 >= layers);
    assert!(after.1 - before.1 >= 3 * layers);
}

#[test]
fn v32_requests_are_bit_identical_alone_and_batched() {
    let config = v32_tiny(5);
    let weights = RandomWeights::new(&config, 5, 1 << 30).unwrap();
    let model = Model::load(config.clone(), &weights, WeightPrecision::AsStored).unwrap();
    let vocab = config.vocab_size;
    let requests = [
        sequence(0, 37, vocab),
        sequence(1, 12, vocab),
        sequence(2, 9, vocab),
    ];
    // Batched: request 0 prefills in chunks of 4, 15 and 14 then decodes; 1 joins at the
    // second step with 10 tokens then decodes; 2 decodes across top_k from its 3rd step.
    let schedule: Vec<Vec<(usize, std::ops::Range<usize>)>> = vec![
        vec![(0, 0..4), (2, 0..3)],
        vec![(1, 0..10), (0, 4..19), (2, 3..4)],
        vec![(2, 4..5), (0, 19..33), (1, 10..11)],
        vec![(1, 11..12), (2, 5..6), (0, 33..34)],
        vec![(0, 34..35), (2, 6..7)],
        vec![(2, 7..8), (0, 35..36)],
        vec![(0, 36..37), (2, 8..9)],
    ];
    let mut run = Run::new(&model, requests.len(), KvType::F32);
    let mut batched = vec![Vec::new(); requests.len()];
    for step in &schedule {
        let work: Vec<(usize, &[u32])> = step
            .iter()
            .map(|(r, range)| (*r, &requests[*r][range.clone()]))
            .collect();
        for ((request, _), logits) in step.iter().zip(run.step(&work)) {
            batched[*request].extend(logits);
        }
    }
    for (r, tokens) in requests.iter().enumerate() {
        let expected = alone(&model, tokens, (tokens.len() / 2).max(1), KvType::F32);
        assert_eq!(bits(&batched[r]), bits(&expected), "request {r}");
    }
}

#[test]
fn v32_runs_on_a_q8_0_latent_cache() {
    let config = v32_tiny(5);
    assert_eq!(config.head_dim, 64);
    let weights = RandomWeights::new(&config, 7, 1 << 30).unwrap();
    let model = Model::load(config.clone(), &weights, WeightPrecision::F32).unwrap();
    let tokens = sequence(4, 20, config.vocab_size);
    let q8 = alone(&model, &tokens, 12, KvType::Q8_0);
    assert_eq!(q8.len(), tokens.len());
    assert!(q8.iter().flatten().all(|v| v.is_finite()));
}
