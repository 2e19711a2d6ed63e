//! The default (as-stored) CPU forward of the default model against llama.cpp's own run on
//! the same Q4_1 file (llama-server, `--no-repack`, 1 thread, greedy, top-5 logprobs per
//! generated position; extracted by `scripts/fixtures/smollm2_llamacpp_top5.py` into
//! `tests/data/smollm2/llamacpp_q4_1_top5.json`): teacher-forced on llama.cpp's sequence,
//! every top-5 logprob llama.cpp reported is compared with pagoda's logprob of that token.
//!
//! Runs with whatever kernel set the process selects (`PAGODA_CPU_KERNELS`, default: the
//! default), so `PAGODA_CPU_KERNELS=f32 cargo test ...` and `=auto` measure both sets. The
//! full distribution is printed (worst, mean, how many entries are past 0.4), not only the
//! first violation. Skips when the model file is missing.

use std::path::PathBuf;

use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::gguf_model::config_from_gguf;
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision};
use pagoda_ops::attention::AttentionPath;
use pagoda_ops::sampling::log_softmax;
use serde_json::Value;

fn load_model() -> Option<Model> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!(
            "skipping: {} is missing (run scripts/fetch-model.sh)",
            path.display()
        );
        return None;
    }
    let file = GgufFile::open(&path).unwrap();
    let config = config_from_gguf(&file).unwrap();
    Some(Model::load(config, &file, WeightPrecision::AsStored).unwrap())
}

/// One prefill over `tokens`; the log-softmax at every position.
fn teacher_forced_logprobs(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
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
    };
    let output = model
        .forward(
            &batch,
            &mut kv,
            AttentionPolicy::Force(AttentionPath::Gather),
        )
        .unwrap();
    let vocab = model.config().vocab_size;
    output.logits.chunks(vocab).map(log_softmax).collect()
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Bounds, in logprob (nats), on |pagoda - llama.cpp| over every top-5 entry llama.cpp
/// reported (6 prompts x 32 positions x 5):
///
/// - the token llama.cpp chose (rank 0): 0.4, the issue's "quantized mode within 0.4
///   logprob of llama.cpp" applied verbatim;
/// - ranks 1-4: 0.6. These are tokens llama.cpp itself gives a few percent or less, whose
///   logprobs move most under any activation rounding: llama.cpp's own Q8_1 path is up to
///   0.555 away from exact math on these very entries (`exact_mode` references), so a bound
///   at 0.4 there would fail exact math itself. 0.6 is the engine parity test's bound;
/// - the mean over all entries: 0.15 (exact math: 0.09).
#[test]
fn quantized_forward_logprobs_within_tolerance_of_llama_cpp() {
    let Some(model) = load_model() else {
        return;
    };
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/smollm2/llamacpp_q4_1_top5.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (mut worst_chosen, mut worst_any, mut sum, mut count) = (0f32, 0f32, 0f64, 0usize);
    let mut diffs = Vec::new();
    let mut violations = Vec::new();
    let mut past_0_4 = 0;
    for prompt in reference["prompts"].as_array().unwrap() {
        let name = prompt["name"].as_str().unwrap();
        let prompt_ids = ids(&prompt["prompt_ids"]);
        let mut tokens = prompt_ids.clone();
        tokens.extend(ids(&prompt["generated_ids"]));
        let logprobs = teacher_forced_logprobs(&model, &tokens);
        for (step, top5) in prompt["top5"].as_array().unwrap().iter().enumerate() {
            // Generated position `step` is predicted from the prompt and `step` generated tokens.
            let row = &logprobs[prompt_ids.len() - 1 + step];
            for (rank, entry) in top5.as_array().unwrap().iter().enumerate() {
                let id = entry[0].as_u64().unwrap() as usize;
                let expected = entry[1].as_f64().unwrap() as f32;
                let diff = (row[id] - expected).abs();
                let bound = if rank == 0 { 0.4 } else { 0.6 };
                if diff >= bound {
                    violations.push(format!(
                        "{name} step {step} rank {rank}: token {id} {} vs llama.cpp {expected}",
                        row[id]
                    ));
                }
                if rank == 0 {
                    worst_chosen = worst_chosen.max(diff);
                }
                past_0_4 += usize::from(diff >= 0.4);
                worst_any = worst_any.max(diff);
                sum += diff as f64;
                count += 1;
                diffs.push(diff);
            }
        }
    }
    let mean = sum / count as f64;
    diffs.sort_by(f32::total_cmp);
    let p99 = diffs[(diffs.len() * 99 / 100).min(diffs.len() - 1)];
    eprintln!(
        "kernels {} vs llama.cpp Q4_1: chosen-token worst {worst_chosen:.3}, top-5 worst \
         {worst_any:.3}, 99th percentile {p99:.3}, mean {mean:.3}, {past_0_4} of {count} \
         entries at 0.4 or more",
        pagoda_ops::linear::cpu_kernels_name()
    );
    assert!(violations.is_empty(), "past the bounds: {violations:#?}");
    assert!(mean < 0.15, "mean top-5 logprob difference {mean}");
}
