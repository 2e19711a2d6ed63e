//! `pagoda bench sampling`: the fused (sorting-free) sampler against the sort-based reference
//! sampler, per vocabulary size and filter configuration.
//!
//! Logit rows are standard-normal times 2.5 (a real model's spread is of that order), several
//! distinct rows per configuration visited round-robin so no cache holds one row between
//! draws; every repetition times `draws` calls per sampler, the arms interleaved, and the
//! median per draw is reported. The process-wide sampling counters, read around each arm,
//! prove which path ran (Gumbel, rejection, fallback, reference).

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use pagoda_ops::sampling::{
    sampling_counters, AnySampler, SamplerKind, SamplingCounters, SamplingParams,
};
use serde::Serialize;

/// Flags of `pagoda bench sampling`.
#[derive(Args, Debug)]
pub struct BenchSamplingArgs {
    /// Vocabulary sizes (comma-separated).
    #[arg(
        long = "vocab",
        value_delimiter = ',',
        default_value = "49152,128256,151936"
    )]
    pub vocab_sizes: Vec<usize>,
    /// Repetitions of every measurement (the median is reported).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Sample calls per repetition and arm.
    #[arg(short = 'n', long = "draws", default_value_t = 64)]
    pub draws: usize,
    /// Distinct logit rows per configuration, visited round-robin.
    #[arg(long = "rows", default_value_t = 8)]
    pub rows: usize,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct ArmResult {
    median_us_per_draw: f64,
    min_us_per_draw: f64,
    max_us_per_draw: f64,
    gumbel_draws: u64,
    rejection_draws: u64,
    rejection_rounds: u64,
    fallbacks: u64,
    reference_draws: u64,
}

#[derive(Serialize)]
struct CaseResult {
    vocab: usize,
    configuration: String,
    fused: ArmResult,
    reference: ArmResult,
    /// Reference time over fused time (> 1: fused is faster).
    speedup: f64,
}

/// The filter configurations measured: (name, params without seed). "default chain" is the
/// CLI's default sampling (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, no penalties).
fn configurations() -> Vec<(&'static str, SamplingParams)> {
    let temperature = 0.8;
    let plain = SamplingParams::unfiltered(temperature);
    vec![
        ("temperature 0.8", plain),
        ("top-k 50", SamplingParams { top_k: 50, ..plain }),
        (
            "top-p 0.9",
            SamplingParams {
                top_p: 0.9,
                ..plain
            },
        ),
        (
            "top-k 50 + top-p 0.9",
            SamplingParams {
                top_k: 50,
                top_p: 0.9,
                ..plain
            },
        ),
        (
            "min-p 0.05",
            SamplingParams {
                min_p: 0.05,
                ..plain
            },
        ),
        (
            "default chain",
            SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                ..plain
            },
        ),
    ]
}

/// Runs `pagoda bench sampling`.
pub fn run(args: BenchSamplingArgs) -> Result<()> {
    if args.repetitions == 0 || args.draws == 0 || args.rows == 0 {
        bail!("--repetitions, --draws and --rows must be at least 1");
    }
    if let Some(&bad) = args.vocab_sizes.iter().find(|&&v| v < 2) {
        bail!("vocabulary size {bad} is too small (at least 2)");
    }
    let mut results = Vec::new();
    for &vocab in &args.vocab_sizes {
        let rows: Vec<Vec<f32>> = (0..args.rows)
            .map(|row| normal_row(vocab, 0x5EED + row as u64))
            .collect();
        for (name, params) in configurations() {
            results.push(measure(vocab, name, params, &rows, &args)?);
        }
    }
    print_report(&results, args.json)
}

/// Times both arms, interleaved per repetition, with one warm-up call each.
fn measure(
    vocab: usize,
    name: &str,
    params: SamplingParams,
    rows: &[Vec<f32>],
    args: &BenchSamplingArgs,
) -> Result<CaseResult> {
    let params = SamplingParams {
        seed: Some(42),
        ..params
    };
    let mut times = [Vec::new(), Vec::new()];
    let mut counters = [SamplingCounters::default(); 2];
    let kinds = [SamplerKind::Fused, SamplerKind::Reference];
    let mut samplers = Vec::new();
    for kind in kinds {
        let mut sampler = AnySampler::new(params, kind).map_err(anyhow::Error::msg)?;
        sampler.sample(&rows[0], &[]);
        samplers.push(sampler);
    }
    let mut checksum = 0u64;
    let mut next_row = 0usize;
    for _ in 0..args.repetitions {
        for (arm, sampler) in samplers.iter_mut().enumerate() {
            let before = sampling_counters();
            let started = Instant::now();
            for _ in 0..args.draws {
                checksum = checksum.wrapping_add(sampler.sample(&rows[next_row], &[]) as u64);
                next_row = (next_row + 1) % rows.len();
            }
            times[arm].push(started.elapsed().as_secs_f64() * 1e6 / args.draws as f64);
            let delta = sampling_counters() - before;
            counters[arm] = add(counters[arm], delta);
        }
    }
    std::hint::black_box(checksum);
    let [fused_times, reference_times] = times;
    let fused = arm_result(fused_times, counters[0]);
    let reference = arm_result(reference_times, counters[1]);
    Ok(CaseResult {
        vocab,
        configuration: name.to_string(),
        speedup: reference.median_us_per_draw / fused.median_us_per_draw,
        fused,
        reference,
    })
}

fn add(a: SamplingCounters, b: SamplingCounters) -> SamplingCounters {
    SamplingCounters {
        fused_draws: a.fused_draws + b.fused_draws,
        greedy_draws: a.greedy_draws + b.greedy_draws,
        gumbel_draws: a.gumbel_draws + b.gumbel_draws,
        rejection_draws: a.rejection_draws + b.rejection_draws,
        rejection_rounds: a.rejection_rounds + b.rejection_rounds,
        fallbacks: a.fallbacks + b.fallbacks,
        reference_draws: a.reference_draws + b.reference_draws,
    }
}

fn arm_result(mut times: Vec<f64>, counters: SamplingCounters) -> ArmResult {
    times.sort_by(|a, b| a.total_cmp(b));
    let median = if times.len() % 2 == 1 {
        times[times.len() / 2]
    } else {
        (times[times.len() / 2 - 1] + times[times.len() / 2]) / 2.0
    };
    ArmResult {
        median_us_per_draw: median,
        min_us_per_draw: times[0],
        max_us_per_draw: times[times.len() - 1],
        gumbel_draws: counters.gumbel_draws,
        rejection_draws: counters.rejection_draws,
        rejection_rounds: counters.rejection_rounds,
        fallbacks: counters.fallbacks,
        reference_draws: counters.reference_draws,
    }
}

fn print_report(results: &[CaseResult], json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(results)?);
        return Ok(());
    }
    println!(
        "threads: 1 (per-row sampling) | load: {}",
        std::fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|_| "unknown".into())
    );
    println!(
        "| vocab | configuration | fused us/draw (min-max) | reference us/draw (min-max) | \
         speedup | fused path: gumbel/rejection/rounds/fallbacks | reference draws |"
    );
    println!("| ---: | --- | ---: | ---: | ---: | --- | ---: |");
    for r in results {
        println!(
            "| {} | {} | {:.1} ({:.1}-{:.1}) | {:.1} ({:.1}-{:.1}) | {:.2}x | {}/{}/{}/{} | {} |",
            r.vocab,
            r.configuration,
            r.fused.median_us_per_draw,
            r.fused.min_us_per_draw,
            r.fused.max_us_per_draw,
            r.reference.median_us_per_draw,
            r.reference.min_us_per_draw,
            r.reference.max_us_per_draw,
            r.speedup,
            r.fused.gumbel_draws,
            r.fused.rejection_draws,
            r.fused.rejection_rounds,
            r.fused.fallbacks,
            r.reference.reference_draws,
        );
    }
    Ok(())
}

/// Standard-normal logits times 2.5 (Box-Muller over a xorshift stream; deterministic).
fn normal_row(vocab: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next_unit = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..vocab)
        .map(|_| {
            let radius = (-2.0 * next_unit().ln()).sqrt();
            let angle = std::f64::consts::TAU * next_unit();
            (radius * angle.cos() * 2.5) as f32
        })
        .collect()
}
