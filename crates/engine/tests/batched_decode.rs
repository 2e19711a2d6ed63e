//! Several sequences decoding together in one batched forward over the CSR page table give the
//! same results as each sequence run alone (the oracle), on both attention paths, including
//! when requests join and leave mid-flight and when pages are recycled between requests.

mod common;

use std::path::PathBuf;

use pagoda_engine::{load_model, Engine, LoadOptions, ModelSource};
use pagoda_models::llama::{AttentionPolicy, WeightPrecision};
use pagoda_ops::attention::AttentionPath;
use pagoda_ops::linear::cpu::amx::{self, AMX_MIN_TOKENS};
use pagoda_ops::linear::CpuKernels;
use pagoda_ops::sampling::SamplingParams;

fn engine(
    path: AttentionPath,
    num_pages: usize,
    max_batch_tokens: usize,
) -> Option<(Engine, pagoda_models::tokenizer::Tokenizer)> {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.is_file() {
        eprintln!(
            "skipping: {} is missing (run scripts/fetch-model.sh)",
            model.display()
        );
        return None;
    }
    let loaded = load_model(
        &ModelSource::Gguf(model),
        LoadOptions::cpu(WeightPrecision::AsStored),
        &mut |_, _| {},
    )
    .unwrap();
    let config = common::engine_config(
        num_pages,
        max_batch_tokens,
        1024,
        AttentionPolicy::Force(path),
    );
    Some((Engine::new(loaded.model, config).unwrap(), loaded.tokenizer))
}

/// Each shorter than the AMX tiles' threshold, together longer: run together, the prompts'
/// rows go through the prefill tiles of the `amx` set; alone (or chunked), through the
/// one-row kernels, so the comparisons below check that the two give the same bits.
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away beyond the mountains and the sea, there lived a",
    "1, 2, 3, 4, 5, 6, 7, 8,",
];

/// Encodes [`PROMPTS`] and checks the lengths straddle the tiles' threshold as documented.
fn encoded_prompts(tokenizer: &pagoda_models::tokenizer::Tokenizer) -> Vec<Vec<u32>> {
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| tokenizer.encode(p, true).unwrap())
        .collect();
    let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    assert!(
        lengths.iter().all(|&n| n < AMX_MIN_TOKENS)
            && lengths.iter().sum::<usize>() >= AMX_MIN_TOKENS + 8,
        "prompt lengths {lengths:?} must each be below {AMX_MIN_TOKENS} and together above"
    );
    prompts
}

/// The matmuls run on AMX tiles so far (INT8 or, opted in, BF16; hardware or emulated).
fn tile_matmuls() -> u64 {
    amx::hardware_matmul_count()
        + amx::emulated_matmul_count()
        + amx::bf16::matmul_count()
        + amx::bf16::emulated_matmul_count()
}

/// With the `amx` set selected, asserts that tiles ran since `before`.
fn assert_tiles_ran_with_the_amx_set(before: u64) {
    if CpuKernels::selected() == CpuKernels::Amx {
        assert!(
            tile_matmuls() > before,
            "the amx set is selected but no prefill ran on its tiles"
        );
    }
}

/// Runs every prompt to completion, `concurrent` at a time; returns (tokens, logprobs) per prompt.
fn run(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    concurrent: usize,
    max_new_tokens: usize,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut results: Vec<(Vec<u32>, Vec<Vec<f32>>)> = vec![(Vec::new(), Vec::new()); prompts.len()];
    let mut ids = Vec::new();
    let mut next = 0;
    while next < prompts.len() || engine.num_running() > 0 {
        while next < prompts.len() && engine.num_running() < concurrent {
            // Different lengths per request so they join and finish at different steps.
            let n = max_new_tokens + next * 3;
            let id = engine
                .add_request(
                    prompts[next].clone(),
                    SamplingParams::greedy(),
                    n,
                    Vec::new(),
                    true,
                )
                .unwrap();
            ids.push((id, next));
            next += 1;
        }
        for event in engine.step().unwrap() {
            let index = ids.iter().find(|(id, _)| *id == event.request).unwrap().1;
            results[index].0.push(event.token);
            results[index].1.push(event.logprobs.unwrap());
        }
    }
    results
}

fn check(path: AttentionPath) {
    let Some((mut engine, tokenizer)) = engine(path, 256, 512) else {
        return;
    };
    let prompts = encoded_prompts(&tokenizer);
    // Batched first, with the prefix cache cold: the prompts prefill together (through the
    // `amx` set's tiles); run alone afterwards, only their uncached last pages prefill.
    let before = tile_matmuls();
    let batched = run(&mut engine, &prompts, 4, 12);
    assert_tiles_ran_with_the_amx_set(before);
    let alone = run(&mut engine, &prompts, 1, 12);
    let mut worst = 0f32;
    for (i, ((ids_a, lp_a), (ids_b, lp_b))) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(
            ids_a, ids_b,
            "prompt {i}: batched greedy ids differ from running alone ({path:?})"
        );
        for (a, b) in lp_a.iter().zip(lp_b) {
            for (x, y) in a.iter().zip(b) {
                worst = worst.max((x - y).abs());
            }
        }
    }
    eprintln!("{path:?}: worst logprob difference batched vs alone {worst:.2e}");
    assert!(
        worst < 1e-3,
        "batched logprobs differ from single by {worst}"
    );
    assert_eq!(
        engine.pages_used(),
        0,
        "finished requests must return every page"
    );
}

#[test]
fn batched_decode_equals_single_on_split_kv() {
    check(AttentionPath::SplitKv);
}

#[test]
fn batched_decode_equals_single_on_gather() {
    check(AttentionPath::Gather);
}

#[test]
fn chunked_prefill_equals_whole_prefill() {
    // A token budget of 5 forces long prompts through several prefill chunks mixed with the
    // other requests' decode tokens.
    let Some((mut chunked, tokenizer)) = engine(AttentionPath::SplitKv, 256, 5) else {
        return;
    };
    let Some((mut whole, _)) = engine(AttentionPath::SplitKv, 256, 512) else {
        return;
    };
    let prompts = encoded_prompts(&tokenizer);
    let a = run(&mut chunked, &prompts, 4, 6);
    let before = tile_matmuls();
    let b = run(&mut whole, &prompts, 4, 6);
    assert_tiles_ran_with_the_amx_set(before);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            x.0, y.0,
            "prompt {i}: chunked prefill changed the greedy ids"
        );
    }
}

#[test]
fn bad_requests_are_refused_clearly() {
    let Some((mut engine, _)) = engine(AttentionPath::SplitKv, 8, 512) else {
        return;
    };
    assert!(engine
        .add_request(Vec::new(), SamplingParams::greedy(), 4, Vec::new(), false)
        .unwrap_err()
        .to_string()
        .contains("empty"));
    let err = engine
        .add_request(
            vec![1; 1000],
            SamplingParams::greedy(),
            100,
            Vec::new(),
            false,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("1000") && err.to_string().contains("1024"),
        "{err}"
    );
    let err = engine
        .add_request(
            vec![999_999],
            SamplingParams::greedy(),
            4,
            Vec::new(),
            false,
        )
        .unwrap_err();
    assert!(err.to_string().contains("999999"), "{err}");
    let bad = SamplingParams {
        temperature: -1.0,
        ..SamplingParams::default()
    };
    assert!(engine
        .add_request(vec![1, 2], bad, 4, Vec::new(), false)
        .is_err());
}

#[test]
fn requests_wait_for_pages_instead_of_failing_when_the_pool_is_tight() {
    // 5 pages of 16 tokens: two 32-token prompts fill four pages, and both need a new page at
    // their first decode token. Only one can have it; the other waits until the first
    // finishes and frees its pages, then completes with the same tokens as when run alone.
    // (Prefilled together, the prompts' 64 rows take the `amx` set's tiles; alone, not.)
    let Some((mut tight, tokenizer)) = engine(AttentionPath::Gather, 5, 512) else {
        return;
    };
    let Some((mut roomy, _)) = engine(AttentionPath::Gather, 64, 512) else {
        return;
    };
    let text =
        "The history of the printing press is often told as the story of a single inventor, \
                but the movable type had a long history before Gutenberg, in China and in \
                Korea, where printers cast metal type two centuries earlier.";
    let base = tokenizer.encode(text, true).unwrap();
    assert!(base.len() >= 33, "{} tokens", base.len());
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| base[i..i + 32].to_vec()).collect();
    let alone = run(&mut roomy, &prompts, 1, 8);
    let squeezed = run(&mut tight, &prompts, 2, 8);
    for (i, (a, b)) in alone.iter().zip(&squeezed).enumerate() {
        assert_eq!(a.0, b.0, "prompt {i}: tokens differ when waiting for pages");
    }
    assert_eq!(tight.pages_used(), 0);
}

/// Re-runs this file's other tests under every CPU kernel configuration this machine can
/// run (the `amx` set on emulated tiles where it lacks them) and prints which ran.
#[test]
fn under_every_cpu_configuration() {
    pagoda_testkit::rerun_under_every_cpu_configuration("under_every_cpu_configuration");
}
