//! `pagoda bench`: prefill and decode throughput, repeated, with median and spread.
//!
//! Prompts are pseudo-random token ids drawn afresh for every run (so no cache flatters a
//! repeat), sampling is greedy with end-of-generation ignored, and the machine load is read
//! before and after. The attention path that ran is reported from the engine's counters.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use pagoda_engine::Engine;
use pagoda_ops::sampling::SamplingParams;
use serde::Serialize;

use crate::common::{self, ModelArgs};

/// Flags of `pagoda bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to measure prefill at (comma-separated; 0 skips prefill).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "128,512"
    )]
    pub prompt_lengths: Vec<usize>,
    /// Tokens to decode per run (0 skips decode).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub decode_tokens: usize,
    /// Sequences decoding together (batched decode over the CSR page table).
    #[arg(short = 'b', long = "batch", default_value_t = 1)]
    pub batch: usize,
    /// Repetitions of every test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct TestResult {
    test: String,
    tokens_per_second: Vec<f64>,
    median: f64,
    min: f64,
    max: f64,
}

#[derive(Serialize)]
struct Report {
    model: String,
    precision: &'static str,
    threads: usize,
    attention_path: String,
    batch: usize,
    load_before: String,
    load_after: String,
    results: Vec<TestResult>,
}

/// Runs `pagoda bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if args.repetitions == 0 || args.batch == 0 {
        bail!("--repetitions and --batch must be at least 1");
    }
    if args.prompt_lengths.iter().all(|&l| l == 0) && args.decode_tokens == 0 {
        bail!("nothing to measure: give a prompt length (-p 128) or tokens to decode (-n 128)");
    }
    let load_before = load_average();
    let loaded = common::load(&args.model)?;
    let vocab = loaded.model.config().vocab_size;
    let longest_prompt = args.prompt_lengths.iter().copied().max().unwrap_or(0);
    let needed = longest_prompt.max(1) + args.decode_tokens + 1;
    let model_max = loaded.model.config().max_position_embeddings;
    if needed > model_max {
        bail!(
            "the longest test needs a context of {needed} tokens (prompt {longest_prompt} + {} decoded + 1), \
             more than the model's {model_max}; lower -p or -n",
            args.decode_tokens
        );
    }
    let ctx = match args.model.ctx_size {
        Some(requested) => {
            let ctx = common::checked_context_size(Some(requested), model_max)?;
            if ctx < needed {
                bail!("--ctx-size {ctx} is too small for the longest test, which needs {needed} tokens; raise -c or lower -p/-n");
            }
            ctx
        }
        None => needed.max(16).min(model_max),
    };
    let model_path = loaded.source.path().display().to_string();
    let mut engine = common::engine(loaded.model, &args.model, ctx, args.batch)?;
    let mut results = Vec::new();
    let mut run_index = 0u64;

    // One warm-up so first-touch page faults are not measured.
    timed_prefill(&mut engine, &random_prompt(vocab, 8, u64::MAX))?;
    for &length in args.prompt_lengths.iter().filter(|&&l| l > 0) {
        let mut rates = Vec::new();
        for _ in 0..args.repetitions {
            run_index += 1;
            let seconds = timed_prefill(&mut engine, &random_prompt(vocab, length, run_index))?;
            rates.push(length as f64 / seconds);
        }
        results.push(summarize(format!("pp{length}"), rates));
    }
    if args.decode_tokens > 0 {
        let mut rates = Vec::new();
        for _ in 0..args.repetitions {
            run_index += 1;
            let seconds = timed_decode(
                &mut engine,
                vocab,
                args.batch,
                args.decode_tokens,
                run_index,
            )?;
            rates.push((args.batch * args.decode_tokens) as f64 / seconds);
        }
        let name = if args.batch == 1 {
            format!("tg{}", args.decode_tokens)
        } else {
            format!("tg{} x{}", args.decode_tokens, args.batch)
        };
        results.push(summarize(name, rates));
    }
    let report = Report {
        model: model_path,
        precision: if args.model.exact {
            "exact (f32)"
        } else {
            "as stored"
        },
        threads: rayon::current_num_threads(),
        attention_path: engine.config().attention_path.name().to_string(),
        batch: args.batch,
        load_before,
        load_after: load_average(),
        results,
    };
    print_report(&report, args.json)
}

fn print_report(report: &Report, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
        return Ok(());
    }
    println!("model: {}", report.model);
    println!(
        "weights: {} | threads: {} | attention: {} | load before: {} | load after: {}",
        report.precision,
        report.threads,
        report.attention_path,
        report.load_before,
        report.load_after
    );
    println!("| test | tok/s (median) | min | max | runs |");
    println!("| --- | ---: | ---: | ---: | --- |");
    for r in &report.results {
        let runs: Vec<String> = r
            .tokens_per_second
            .iter()
            .map(|v| format!("{v:.1}"))
            .collect();
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {} |",
            r.test,
            r.median,
            r.min,
            r.max,
            runs.join(" ")
        );
    }
    Ok(())
}

fn summarize(test: String, mut rates: Vec<f64>) -> TestResult {
    let tokens_per_second = rates.clone();
    rates.sort_by(|a, b| a.total_cmp(b));
    let median = if rates.len() % 2 == 1 {
        rates[rates.len() / 2]
    } else {
        (rates[rates.len() / 2 - 1] + rates[rates.len() / 2]) / 2.0
    };
    TestResult {
        test,
        median,
        min: rates[0],
        max: rates[rates.len() - 1],
        tokens_per_second,
    }
}

/// Seconds to prefill `prompt` (until its first token is sampled).
fn timed_prefill(engine: &mut Engine, prompt: &[u32]) -> Result<f64> {
    engine.add_request(
        prompt.to_vec(),
        SamplingParams::greedy(),
        1,
        Vec::new(),
        false,
    )?;
    let started = Instant::now();
    while engine.num_running() > 0 {
        engine.step()?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Seconds for `batch` sequences to decode `tokens` tokens each after a one-token prompt
/// (the prefill step is excluded).
fn timed_decode(
    engine: &mut Engine,
    vocab: usize,
    batch: usize,
    tokens: usize,
    run: u64,
) -> Result<f64> {
    for b in 0..batch {
        let prompt = random_prompt(vocab, 1, run * 1000 + b as u64);
        engine.add_request(
            prompt,
            SamplingParams::greedy(),
            tokens + 1,
            Vec::new(),
            false,
        )?;
    }
    engine.step()?; // prefill (one token each) + first sampled token
    let started = Instant::now();
    while engine.num_running() > 0 {
        engine.step()?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Deterministic pseudo-random ordinary token ids (ids below 256 are avoided: they hold the
/// special and byte tokens in common vocabularies).
fn random_prompt(vocab: usize, length: usize, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let low = 256.min(vocab.saturating_sub(1));
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (low + (state as usize) % (vocab - low)) as u32
        })
        .collect()
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
