//! End-to-end parity of the default model (SmolLM2-135M-Instruct Q4_1) with independent
//! references recorded on the same file (`tests/data/smollm2/`, copied from the project's
//! shared reference outputs):
//!
//! - exact mode (weights dequantized to f32, f32 activations and KV) against Hugging Face
//!   transformers in float32: top-20 logprobs at the last prompt position within 1e-3, and the
//!   same greedy ids, generated through the engine's real decode loop (split-KV decode);
//! - exact mode greedy ids against llama.cpp run on the same weights dequantized to F32;
//! - the default (as-stored) mode against llama.cpp's own Q4_1 run: logprobs within 0.4 at
//!   every generated position, teacher-forced on llama.cpp's sequence (matched prefixes).
//!
//! The tests skip (with a message) when the model file is missing; `scripts/test.sh` fetches it.

use std::path::PathBuf;

use pagoda_engine::{load_model, Engine, EngineConfig, LoadOptions, LoadedModel, ModelSource};
use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision};
use pagoda_ops::attention::AttentionPath;
use pagoda_ops::sampling::{log_softmax, SamplingParams};
use serde_json::Value;

#[path = "../../models/tests/common/logprob_parity.rs"]
mod logprob_parity;
use logprob_parity::ParityStats;

fn model_path() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "skipping: {} is missing (run scripts/fetch-model.sh)",
            path.display()
        );
        None
    }
}

fn reference(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/smollm2")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn load(precision: WeightPrecision) -> Option<LoadedModel> {
    let path = model_path()?;
    Some(
        load_model(
            &ModelSource::Gguf(path),
            LoadOptions::cpu(precision),
            &mut |_, _| {},
        )
        .unwrap(),
    )
}

/// Runs `tokens` through the model in one prefill and returns the log-softmax at every position.
fn teacher_forced_logprobs(
    model: &Model,
    tokens: &[u32],
    policy: AttentionPolicy,
) -> Vec<Vec<f32>> {
    let page_size = 16;
    let num_pages = tokens.len().div_ceil(page_size);
    let mut pool = BlockPool::new(num_pages, page_size).unwrap();
    let mut table = BlockTable::new();
    let slots = table.append_slots(&mut pool, tokens.len()).unwrap();
    let page_table = PageTable::from_block_tables(&[&table], &pool).unwrap();
    let mut kv = KvCache::new(
        model.config().num_layers,
        model.kv_layout(num_pages, page_size),
    );
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let logits_for: Vec<usize> = (0..tokens.len()).collect();
    let batch = ForwardBatch {
        tokens,
        positions: &positions,
        slots: &slots,
        qo_indptr: &[0, tokens.len() as u32],
        page_table: &page_table,
        logits_for: &logits_for,
        sparse: &[],
    };
    let output = model.forward(&batch, &mut kv, policy).unwrap();
    let vocab = model.config().vocab_size;
    output.logits.chunks(vocab).map(log_softmax).collect()
}

/// Greedy generation through the engine (prefill, then split-KV batched decode).
fn greedy(engine: &mut Engine, prompt: &[u32], max_new_tokens: usize, stop: &[u32]) -> Vec<u32> {
    engine
        .add_request(
            prompt.to_vec(),
            SamplingParams::greedy(),
            max_new_tokens,
            stop.to_vec(),
            false,
        )
        .unwrap();
    let mut out = Vec::new();
    while engine.num_running() > 0 {
        for event in engine.step().unwrap() {
            out.push(event.token);
        }
    }
    out
}

fn engine_config(attention: AttentionPolicy) -> EngineConfig {
    EngineConfig {
        page_size: 16,
        num_pages: 128,
        max_batch_tokens: 512,
        max_context: 2048,
        attention,
        sampler: pagoda_ops::sampling::SamplerKind::DEFAULT,
        cuda_graphs: true,
        paged_decode: Default::default(),
        kv_types: Default::default(),
    }
}

fn engine_for(loaded: LoadedModel, path: AttentionPath) -> (Engine, Vec<u32>) {
    let stop = loaded.tokenizer.end_of_generation_ids();
    let config = engine_config(AttentionPolicy::Force(path));
    (Engine::new(loaded.model, config).unwrap(), stop)
}

#[test]
fn exact_mode_matches_transformers_f32_top20_and_greedy_ids() {
    let Some(loaded) = load(WeightPrecision::F32) else {
        return;
    };
    let reference = reference("logits_transformers_f32.json");
    let model = loaded.model.as_cpu().unwrap();
    let mut worst = 0f32;
    let mut prompts = Vec::new();
    for prompt in reference["prompts"].as_array().unwrap() {
        let name = prompt["name"].as_str().unwrap();
        let prompt_ids = ids(&prompt["prompt_ids_llamacpp"]);
        let logprobs = teacher_forced_logprobs(
            model,
            &prompt_ids,
            AttentionPolicy::Force(AttentionPath::Gather),
        );
        let last = logprobs.last().unwrap();
        for entry in prompt["top20"].as_array().unwrap() {
            let id = entry["id"].as_u64().unwrap() as usize;
            let expected = entry["logprob"].as_f64().unwrap() as f32;
            let diff = (last[id] - expected).abs();
            worst = worst.max(diff);
            assert!(
                diff < 1e-3,
                "{name}: token {id} logprob {} vs transformers {expected}",
                last[id]
            );
        }
        prompts.push((name.to_string(), prompt_ids, ids(&prompt["greedy_ids"])));
    }
    eprintln!("exact mode vs transformers f32: worst top-20 logprob difference {worst:.2e}");

    let (mut engine, stop) = engine_for(loaded, AttentionPath::SplitKv);
    for (name, prompt_ids, expected) in prompts {
        let got = greedy(&mut engine, &prompt_ids, expected.len(), &stop);
        assert_eq!(
            got, expected,
            "{name}: greedy ids differ from transformers f32"
        );
    }
    assert!(
        engine.counters().steps_split_kv > 0,
        "the split-KV decode path never ran"
    );
}

#[test]
fn exact_mode_greedy_matches_llama_cpp_on_f32_weights() {
    let Some(loaded) = load(WeightPrecision::F32) else {
        return;
    };
    let reference = reference("greedy_llamacpp_f32dequant.json");
    let (mut engine, stop) = engine_for(loaded, AttentionPath::Gather);
    for prompt in reference["prompts"].as_array().unwrap() {
        let name = prompt["name"].as_str().unwrap();
        let expected = ids(&prompt["generated_ids"]);
        let got = greedy(
            &mut engine,
            &ids(&prompt["prompt_ids"]),
            expected.len(),
            &stop,
        );
        assert_eq!(
            got, expected,
            "{name}: greedy ids differ from llama.cpp on F32 weights"
        );
    }
    assert!(engine.counters().steps_split_kv == 0 && engine.counters().steps_gather > 0);
}

/// Speculation keeps greedy output token for token: the exact-mode model, guessed for by
/// prompt lookup and by the as-stored (Q4_1) model as draft, gives llama.cpp's F32 greedy ids
/// on the reference prompts.
#[test]
fn exact_mode_greedy_with_speculation_matches_llama_cpp_on_f32_weights() {
    use pagoda_engine::speculation::{DraftModel, SpeculationMode, SpeculationSettings};
    use pagoda_engine::EngineSettings;
    let Some(path) = model_path() else {
        return;
    };
    let reference = reference("greedy_llamacpp_f32dequant.json");
    for mode in [SpeculationMode::Ngram, SpeculationMode::Draft] {
        let settings = |mode| EngineSettings {
            speculation: SpeculationSettings {
                mode,
                cost_policy: false,
                ..SpeculationSettings::default()
            },
            ..EngineSettings::from_config(
                &pagoda_config::Config::resolve(|_| None, Vec::new(), &[]).unwrap(),
            )
        };
        let loaded = load(WeightPrecision::F32).unwrap();
        let stop = loaded.tokenizer.end_of_generation_ids();
        let config = engine_config(AttentionPolicy::Auto);
        let mut engine =
            Engine::with_settings(loaded.model, config.clone(), settings(mode)).unwrap();
        if mode == SpeculationMode::Draft {
            let options = LoadOptions::cpu(WeightPrecision::AsStored);
            let draft = load_model(&ModelSource::Gguf(path.clone()), options, &mut |_, _| {});
            let draft_engine =
                Engine::with_settings(draft.unwrap().model, config, settings(SpeculationMode::Off))
                    .unwrap();
            let vocab = engine.model_config().vocab_size;
            engine.set_proposer(Box::new(DraftModel::new(
                draft_engine,
                Default::default(),
                0.0,
                vocab,
            )));
        }
        for prompt in reference["prompts"].as_array().unwrap() {
            let name = prompt["name"].as_str().unwrap();
            let expected = ids(&prompt["generated_ids"]);
            let got = greedy(
                &mut engine,
                &ids(&prompt["prompt_ids"]),
                expected.len(),
                &stop,
            );
            assert_eq!(got, expected, "{mode:?} {name}: greedy ids differ");
        }
        let counters = engine.counters();
        eprintln!(
            "{mode:?}: {} of {} guesses accepted",
            counters.spec_accepted, counters.spec_drafted
        );
        assert!(counters.spec_accepted > 0, "{mode:?}: no guess accepted");
    }
}

/// llama.cpp's own Q4_1 path quantizes activations to Q8_1 and keeps an f16 KV cache, which
/// moves it 0.05-0.55 logprob away from exact math on this model. pagoda's default mode is held
/// to the bounds of `logprob_parity` (the token llama.cpp chose within 0.4 at every matched
/// prefix, 95% of all entries within 0.4, the 90th percentile under 0.3, the mean under
/// 0.15, every entry under 1.0) on the gather oracle and on the default route.
#[test]
fn quantized_mode_logprobs_within_tolerance_of_llama_cpp() {
    let Some(loaded) = load(WeightPrecision::AsStored) else {
        return;
    };
    let reference = reference("greedy_llamacpp.json");
    let model = loaded.model.as_cpu().unwrap();
    let mut runs = Vec::new();
    for (route, policy) in [
        ("auto", AttentionPolicy::Auto),
        ("gather", AttentionPolicy::Force(AttentionPath::Gather)),
    ] {
        let mut stats = ParityStats::default();
        for prompt in reference["prompts"].as_array().unwrap() {
            let name = prompt["name"].as_str().unwrap();
            let prompt_ids = ids(&prompt["prompt_ids"]);
            let generated = ids(&prompt["generated_ids"]);
            let mut tokens = prompt_ids.clone();
            tokens.extend_from_slice(&generated);
            let logprobs = teacher_forced_logprobs(model, &tokens, policy);
            for (step, position) in prompt["per_position_top5"]
                .as_array()
                .unwrap()
                .iter()
                .enumerate()
            {
                // Position `step` is predicted from the prompt plus the first `step` generated
                // tokens.
                let row = &logprobs[prompt_ids.len() - 1 + step];
                for (rank, entry) in position["top5"].as_array().unwrap().iter().enumerate() {
                    let id = entry["id"].as_u64().unwrap() as usize;
                    let expected = entry["logprob"].as_f64().unwrap() as f32;
                    stats.add(
                        rank,
                        (row[id] - expected).abs(),
                        format!(
                            "{name} step {step}: token {id} logprob {} vs llama.cpp {expected}",
                            row[id]
                        ),
                    );
                }
            }
        }
        eprintln!(
            "quantized mode, attention {route}, vs llama.cpp Q4_1: {}",
            stats.summary()
        );
        runs.push((route, stats));
    }
    // Both routes are printed before either fails.
    for (route, stats) in runs {
        stats.assert_within_bounds(&format!("attention {route}"));
    }
}
