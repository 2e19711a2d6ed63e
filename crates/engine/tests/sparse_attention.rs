//! Sparse decode (Quest page selection, `--sparse-attention`) through the engine on the
//! default model (SmolLM2-135M-Instruct Q4_1): with a budget that covers the whole context
//! the tokens and log-probabilities are the dense engine's bits; with a small budget on a
//! long passkey prompt (a number hidden in filler text, asked for at the end, greedy) the
//! answer dense decode gets right stays right, while the selector really drops pages (its
//! counters move and the log-probabilities differ from dense decode's).

mod common;

use common::{default_model, engine_config};
use pagoda_engine::{Engine, EngineSettings, RequestId};
use pagoda_models::llama::AttentionPolicy;
use pagoda_ops::attention::{sparse_decode_counts, SparseAttention};
use pagoda_ops::sampling::SamplingParams;

const NUM_PAGES: usize = 300;
const CONTEXT: usize = 3072;
const NEW_TOKENS: usize = 8;
const PASSKEY: &str = "68253";

/// A passkey prompt of about `filler_before + filler_after` filler sentences (~18 tokens
/// each) with the key between them.
fn passkey_prompt(filler_before: usize, filler_after: usize) -> String {
    let filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. \
                  There and back again. ";
    format!(
        "There is an important pass key hidden inside a lot of irrelevant text. Find it and \
         memorize it.\n{}The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key.\n\
         {}What is the pass key? The pass key is",
        filler.repeat(filler_before),
        filler.repeat(filler_after)
    )
}

fn engine(
    sparse: Option<SparseAttention>,
) -> Option<(Engine, pagoda_models::tokenizer::Tokenizer)> {
    let loaded = default_model()?;
    let config = engine_config(NUM_PAGES, 512, CONTEXT, AttentionPolicy::Auto);
    let settings = EngineSettings {
        sparse_attention: sparse,
        ..EngineSettings::from_config(pagoda_config::global())
    };
    let engine = Engine::with_settings(loaded.model, config, settings).unwrap();
    Some((engine, loaded.tokenizer))
}

type Trace = (Vec<u32>, Vec<Vec<u32>>);

/// One engine step: each event's token and log-probability bits appended to the trace of
/// its request (`ids` maps request ids to trace indices).
fn step_into(engine: &mut Engine, ids: &[(RequestId, usize)], traces: &mut [Trace]) {
    for event in engine.step().unwrap() {
        let index = ids.iter().find(|(id, _)| *id == event.request).unwrap().1;
        traces[index].0.push(event.token);
        let bits = event
            .logprobs
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        traces[index].1.push(bits);
    }
}

/// Greedy runs of `prompt`, one per entry of `settings` (each request's sparse settings; the
/// engine's default is replaced), the first alone and the rest together after it, so they
/// reuse its prompt pages from the prefix cache: tokens and the bits of each log-softmax row.
fn run(engine: &mut Engine, prompt: &[u32], settings: &[Option<SparseAttention>]) -> Vec<Trace> {
    let mut results: Vec<Trace> = vec![(Vec::new(), Vec::new()); settings.len()];
    for group in [0..1, 1..settings.len()] {
        let ids: Vec<(RequestId, usize)> = group
            .map(|index| {
                let id = engine
                    .add_request(
                        prompt.to_vec(),
                        SamplingParams::greedy(),
                        NEW_TOKENS,
                        Vec::new(),
                        true,
                    )
                    .unwrap();
                engine.set_sparse_attention(id, settings[index]).unwrap();
                (id, index)
            })
            .collect();
        while engine.num_running() > 0 {
            step_into(engine, &ids, &mut results);
        }
    }
    results
}

#[test]
fn sparse_decode_with_a_covering_budget_is_dense_decode_and_a_small_budget_finds_the_key() {
    let default = SparseAttention::new(256, 32, 512).unwrap();
    let Some((mut engine, tokenizer)) = engine(Some(default)) else {
        return;
    };
    assert!(engine.sparse_attention_available());
    // About 1.3K tokens, the key at a third of the way.
    let prompt = tokenizer.encode(&passkey_prompt(20, 40), true).unwrap();
    assert!(
        prompt.len() > 1000 && prompt.len() + NEW_TOKENS < CONTEXT,
        "{}",
        prompt.len()
    );
    let covering = SparseAttention::new(CONTEXT, 64, 0).unwrap();
    let before = sparse_decode_counts();
    let traces = run(&mut engine, &prompt, &[None, Some(covering), Some(default)]);
    let after = sparse_decode_counts();
    let [dense, full, small] = [&traces[0], &traces[1], &traces[2]];
    let dense_text = tokenizer.decode(&dense.0);
    assert!(
        dense_text.contains(PASSKEY),
        "dense decode misses the key: {dense_text:?}"
    );
    // A budget covering the whole context: dense decode's bits.
    assert_eq!(full, dense);
    // 256 of ~1300 tokens: the key is still found, and the selector really dropped pages.
    let small_text = tokenizer.decode(&small.0);
    assert!(
        small_text.contains(PASSKEY),
        "sparse decode misses the key: {small_text:?}"
    );
    assert_ne!(
        small.1, dense.1,
        "a 256-token budget must change the numbers"
    );
    let (scanned, kept) = (
        after.pages_scanned - before.pages_scanned,
        after.pages_kept - before.pages_kept,
    );
    assert!(
        after.steps > before.steps && kept > 0 && kept * 3 < scanned,
        "{kept} of {scanned}"
    );
}

#[test]
fn a_request_may_turn_sparse_decode_off_and_an_engine_without_it_refuses_settings() {
    let Some((mut dense, _)) = engine(None) else {
        return;
    };
    let id = dense
        .add_request(
            vec![1, 2, 3],
            SamplingParams::greedy(),
            2,
            Vec::new(),
            false,
        )
        .unwrap();
    assert!(!dense.sparse_attention_available());
    assert!(dense.set_sparse_attention(id, None).is_ok());
    let error = dense
        .set_sparse_attention(id, Some(SparseAttention::default()))
        .unwrap_err();
    assert!(error.to_string().contains("--sparse-attention"), "{error}");
}

/// The quality table of `docs/benchmark_results/sparse-quality-cpu-2026-12-06.md`: passkey
/// retrieval at depths 10/50/90% of prompts of about 2K, 3K and 4K tokens, dense decode and
/// budgets 512 and 1024 (window 64, min-context 1024), greedy; per prompt the dense request
/// first, then the sparse ones on its cached prompt pages.
/// `cargo test -p pagoda-engine --test sparse_attention -- --ignored --nocapture`
#[test]
#[ignore = "the quality table (minutes of CPU)"]
fn passkey_quality_table() {
    let Some(loaded) = default_model() else {
        return;
    };
    let config = engine_config(400, 512, 4600, AttentionPolicy::Auto);
    let settings = EngineSettings {
        sparse_attention: Some(SparseAttention::default()),
        ..EngineSettings::from_config(pagoda_config::global())
    };
    let mut engine = Engine::with_settings(loaded.model, config, settings).unwrap();
    let tokenizer = loaded.tokenizer;
    let budgets = [
        None,
        Some(SparseAttention::new(512, 64, 1024).unwrap()),
        Some(SparseAttention::new(1024, 64, 1024).unwrap()),
    ];
    println!("| prompt tokens | depth | dense | budget 512 | budget 1024 |");
    println!("|---|---|---|---|---|");
    for sentences in [90, 135, 180] {
        for depth in [10, 50, 90] {
            let before = sentences * depth / 100;
            let prompt = tokenizer
                .encode(&passkey_prompt(before, sentences - before), true)
                .unwrap();
            let cells: Vec<String> = run(&mut engine, &prompt, &budgets)
                .iter()
                .map(|(tokens, _)| {
                    let text = tokenizer.decode(tokens);
                    let mark = if text.contains(PASSKEY) { "yes" } else { "no" };
                    format!("{mark} (`{}`)", text.trim().replace('\n', " "))
                })
                .collect();
            println!("| {} | {depth}% | {} |", prompt.len(), cells.join(" | "));
        }
    }
}

/// Per request (seeded sampling, sparse decode on): tokens and log-probability bits.
type Seeded = Vec<Trace>;

/// Runs `requests` (prompt and seed; temperature 0.9, top-p 0.95) on a fresh engine of
/// `num_pages` pages with sparse decode on: `waves` lists which requests join at which step
/// (a later wave finds an earlier one's prompt pages cached). Returns the traces and the
/// engine's preemptions.
fn run_seeded(
    requests: &[(Vec<u32>, u64)],
    num_pages: usize,
    waves: &[(usize, Vec<usize>)],
) -> (Seeded, u64) {
    let loaded = default_model().unwrap();
    let config = engine_config(num_pages, 512, CONTEXT, AttentionPolicy::Auto);
    let settings = EngineSettings {
        sparse_attention: Some(SparseAttention::new(256, 32, 512).unwrap()),
        prefix_caching: true,
        ..EngineSettings::from_config(pagoda_config::global())
    };
    let mut engine = Engine::with_settings(loaded.model, config, settings).unwrap();
    let mut traces: Seeded = vec![(Vec::new(), Vec::new()); requests.len()];
    let mut ids: Vec<(RequestId, usize)> = Vec::new();
    let mut step = 0;
    let joined = waves.iter().map(|(_, w)| w.len()).sum::<usize>();
    while engine.num_running() + engine.num_waiting() > 0 || ids.len() < joined {
        for (at, wave) in waves {
            if *at != step {
                continue;
            }
            for &index in wave {
                let params = SamplingParams {
                    temperature: 0.9,
                    top_p: 0.95,
                    seed: Some(requests[index].1),
                    ..SamplingParams::default()
                };
                let id = engine
                    .add_request(
                        requests[index].0.clone(),
                        params,
                        NEW_TOKENS,
                        Vec::new(),
                        true,
                    )
                    .unwrap();
                ids.push((id, index));
            }
        }
        step_into(&mut engine, &ids, &mut traces);
        step += 1;
    }
    (traces, engine.counters().preemptions)
}

/// Reproducibility with sparse decode on: a seeded request gives the same tokens and
/// log-probability bits alone on a cold cache, again on a warm one (its prompt pages from
/// the prefix cache, a second wave), beside other long sparse requests that join while it
/// decodes, and in a pool so tight that requests are preempted and computed again.
#[test]
fn a_seeded_sparse_request_is_reproducible_alone_warm_under_load_and_preempted() {
    let Some((_, tokenizer)) = engine(None) else {
        return;
    };
    // Three long prompts (about 0.8K-1.3K tokens), the key at different depths, each with
    // its own seed.
    let requests: Vec<(Vec<u32>, u64)> = [(20, 40), (10, 30), (30, 10)]
        .iter()
        .enumerate()
        .map(|(i, &(before, after))| {
            let prompt = tokenizer
                .encode(&passkey_prompt(before, after), true)
                .unwrap();
            (prompt, 100 + i as u64)
        })
        .collect();
    let before = sparse_decode_counts();
    // Request 0 alone on a cold cache, then again once it has finished: its prompt pages
    // come from the prefix cache.
    let twice = [requests[0].clone(), requests[0].clone()];
    let (warm, _) = run_seeded(&twice, 400, &[(0, vec![0]), (40, vec![1])]);
    assert!(
        sparse_decode_counts().steps > before.steps,
        "sparse decode never ran"
    );
    assert_eq!(warm[1], warm[0], "request 0 on a warm cache differs");
    let mut alone: Seeded = vec![warm[0].clone()];
    for i in 1..requests.len() {
        alone.push(run_seeded(&requests, 400, &[(0, vec![i])]).0.swap_remove(i));
    }
    // Under load: the others join at different steps while request 0 decodes.
    let waves = [(0, vec![0]), (3, vec![1]), (6, vec![2])];
    let (loaded, _) = run_seeded(&requests, 400, &waves);
    // Preempted: a pool that cannot hold all three as they decode.
    let (tight, preempted) = run_seeded(&requests, TIGHT_PAGES, &[(0, vec![0, 1, 2])]);
    assert!(
        preempted > 0,
        "the pool of {TIGHT_PAGES} pages must preempt"
    );
    for (i, reference) in alone.iter().enumerate() {
        assert_eq!(&loaded[i], reference, "request {i} under load differs");
        assert_eq!(&tight[i], reference, "request {i} preempted differs");
    }
}

/// Pages of the preempting run: more than the longest request needs, fewer than the three.
const TIGHT_PAGES: usize = 100;
