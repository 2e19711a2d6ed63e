//! `pagoda bench sampling`: the fused (sorting-free) sampler against the sort-based reference
//! sampler, per vocabulary size and filter configuration.
//!
//! Logit rows are standard-normal times 2.5 (a real model's spread is of that order), several
//! distinct rows per configuration visited round-robin so no cache holds one row between
//! draws; every repetition times `draws` calls per sampler, the arms interleaved, and the
//! median per draw is reported. The process-wide sampling counters, read around each arm,
//! prove which path ran (Gumbel, rejection, fallback, reference).
//!
//! `--device cuda` runs the GPU benchmark instead (`bench_sampling_gpu.rs`): batched
//! GPU sampling from logits, CUDA-graph replayed, against the FlashInfer anchors.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use pagoda_ops::sampling::{
    sampling_counters, AnySampler, SamplerKind, SamplingCounters, SamplingParams,
};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use serde::Serialize;

use super::stats::Summary;

/// Vocabulary sizes measured on the CPU when `--vocab` is not given.
pub const CPU_VOCAB_SIZES: [usize; 3] = [49152, 128256, 151936];

/// Where `pagoda bench sampling` runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SamplingDevice {
    /// The CPU samplers, fused against the sort-based reference, one row per call.
    #[default]
    Cpu,
    /// The batched GPU sampler, graph-replayed, against the FlashInfer anchors.
    Cuda,
}

/// A switch flag's value.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnOff {
    /// Enabled.
    #[default]
    On,
    /// Disabled.
    Off,
}

/// Which filtered-row paths `pagoda bench sampling --device cuda` times.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FilteredArms {
    /// The multi-CTA fast path (the default in `generate` / `serve`).
    Fast,
    /// The single-CTA exact kernel.
    Exact,
    /// Both, one after the other per cell.
    #[default]
    Both,
}

/// Flags of `pagoda bench sampling`.
#[derive(Args, Debug)]
pub struct BenchSamplingArgs {
    /// The samplers to time: cpu (fused vs reference) or cuda (the GPU sampler, anchors'
    /// method and numbers).
    #[arg(long, value_enum, default_value_t = SamplingDevice::Cpu)]
    pub device: SamplingDevice,
    /// Vocabulary sizes (comma-separated; default 49152,128256,151936 on the CPU,
    /// 128256,151936 on CUDA).
    #[arg(long = "vocab", value_delimiter = ',')]
    pub vocab_sizes: Vec<usize>,
    /// CPU: repetitions of every measurement (the median is reported).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// CPU: sample calls per repetition and arm.
    #[arg(short = 'n', long = "draws", default_value_t = 64)]
    pub draws: usize,
    /// CPU: distinct logit rows per configuration, visited round-robin.
    #[arg(long = "rows", default_value_t = 8)]
    pub rows: usize,
    /// CUDA: rows sampled per call (comma-separated).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1,16,64"
    )]
    pub batch: Vec<usize>,
    /// CUDA: graph replays per case (the median and minimum per call are reported).
    #[arg(long, default_value_t = 100)]
    pub replays: usize,
    /// CUDA: the filtered rows' path to time: fast (multi-CTA), exact (one CTA per row, f64),
    /// or both side by side.
    #[arg(long, value_enum, default_value_t = FilteredArms::Both)]
    pub filtered: FilteredArms,
    /// CUDA: round launches of the fast filtered path (default: by batch size).
    #[arg(long = "fast-rounds")]
    pub fast_rounds: Option<u32>,
    /// CUDA: find the row maxima in the Gumbel kernel when no row is filtered (on, as in
    /// `generate` / `serve`) or in their own pass (off).
    #[arg(long = "gumbel-max", value_enum, default_value_t = OnOff::On)]
    pub gumbel_max: OnOff,
    /// CUDA: run the rounds of top-k rows (k <= 512) with top-p on their id list (on, as in
    /// `generate` / `serve`) or as round launches over the whole row (off).
    #[arg(long = "list-rounds", value_enum, default_value_t = OnOff::On)]
    pub list_rounds: OnOff,
    /// CUDA: run top-p launches without top-k rows in one cluster kernel per row (on, as in
    /// `generate` / `serve`; compute capability 9.0+) or through the multi-launch pipeline (off).
    #[arg(long = "cluster", value_enum, default_value_t = OnOff::On)]
    pub cluster: OnOff,
    /// CUDA: the cluster kernel's CTA shape, threads x CTAs per SM (512x3, 1024x1, 384x4,
    /// 512x4, 256x5 or 256x6; default: the sampler's, 512x3).
    #[arg(long = "cluster-shape")]
    pub cluster_shape: Option<pagoda_ops::cuda::ClusterShape>,
    /// CUDA: when the cluster kernel has more rows than fit on the GPU at once, resident rows
    /// ask L2 for the waiting rows' logits (on, as in `generate` / `serve`) or not (off).
    #[arg(long = "prefetch", value_enum, default_value_t = OnOff::On)]
    pub prefetch: OnOff,
    /// CUDA: CTAs per row of the filtered pipeline (default: the sampler's choice).
    #[arg(long = "filter-splits")]
    pub filter_splits: Option<usize>,
    /// CUDA: CTAs per row of the split kernels (maxima, Gumbel-max; default: the sampler's).
    #[arg(long = "splits")]
    pub splits: Option<usize>,
    /// CUDA: the configurations to time (comma-separated; default all).
    #[arg(long = "configurations", value_enum, value_delimiter = ',')]
    pub configurations: Vec<super::bench_sampling_anchors::Configuration>,
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

/// Runs the CPU benchmark of `pagoda bench sampling` (`--device cuda` runs
/// `bench_sampling_gpu`'s instead).
pub fn run(mut args: BenchSamplingArgs) -> Result<()> {
    if args.vocab_sizes.is_empty() {
        args.vocab_sizes = CPU_VOCAB_SIZES.to_vec();
    }
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

fn arm_result(times: Vec<f64>, counters: SamplingCounters) -> ArmResult {
    // NaN only without repetitions, which `run` refuses.
    let summary = Summary::of(&times).unwrap_or(Summary {
        median: f64::NAN,
        min: f64::NAN,
        max: f64::NAN,
    });
    ArmResult {
        median_us_per_draw: summary.median,
        min_us_per_draw: summary.min,
        max_us_per_draw: summary.max,
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

/// The median (the mean of the middle two for an even count) and the minimum of `times`
/// (see [`super::stats`]); NaN for both when there are none. The GPU benches share it (and
/// pass `&mut`, from when it sorted in place; `times` is left as it was).
pub fn median_and_min(times: &mut [f64]) -> (f64, f64) {
    Summary::of(times).map_or((f64::NAN, f64::NAN), |s| (s.median, s.min))
}

/// `num_rows` rows of `vocab` logits, standard normal times `scale` (Box-Muller over one
/// ChaCha8 stream per row, seeded by `seed` and the row: deterministic whatever the thread
/// count), row after row. Generated in parallel.
pub fn randn_rows(num_rows: usize, vocab: usize, scale: f64, seed: u64) -> Vec<f32> {
    let mut data = vec![0.0f32; num_rows * vocab];
    data.par_chunks_mut(vocab.max(1))
        .enumerate()
        .for_each(|(row, values)| {
            let row_seed = seed ^ (row as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(row_seed);
            let mut unit = || ((rng.random::<u64>() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            for pair in values.chunks_mut(2) {
                let radius = (-2.0 * unit().ln()).sqrt() * scale;
                let angle = std::f64::consts::TAU * unit();
                pair[0] = (radius * angle.cos()) as f32;
                if let Some(second) = pair.get_mut(1) {
                    *second = (radius * angle.sin()) as f32;
                }
            }
        });
    data
}

/// Checks on the host that the canonical chain `params` (penalties ignored; filters on the
/// untempered distribution) may draw `token` from `logits` (finite values): the argmax
/// (lowest id on ties) for a greedy chain; otherwise inside the top-k set (fewer than
/// `top_k` logits strictly above it), at or above the min-p threshold
/// `max + ln(min_p)` (1e-4 slack), and inside the nucleus (the top-k set's probability
/// strictly above the token, renormalised, below `top_p`, 1e-6 slack). Each test is exact for
/// one active filter and a necessary condition when several are. The error says which.
pub fn check_token(params: &SamplingParams, logits: &[f32], token: u32) -> Result<(), String> {
    let index = token as usize;
    let Some(&value) = logits.get(index) else {
        return Err(format!("token {token} >= vocab {}", logits.len()));
    };
    if !value.is_finite() {
        return Err(format!("token {token} has logit {value}"));
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if params.is_greedy() {
        let argmax = logits.iter().position(|&l| l == max).unwrap_or(0);
        if index != argmax {
            return Err(format!(
                "greedy token {token} (logit {value}) is not the argmax {argmax} (logit {max})"
            ));
        }
        return Ok(());
    }
    let top_k = match params.top_k {
        0 => logits.len(),
        k => k.min(logits.len()),
    };
    let above = logits.iter().filter(|&&l| l > value).count();
    if above >= top_k {
        return Err(format!(
            "token {token} has {above} logits above it: outside top-k {top_k}"
        ));
    }
    let threshold = max as f64 + (params.min_p as f64).ln();
    if params.min_p > 0.0 && (value as f64) < threshold - 1e-4 {
        return Err(format!(
            "token {token} logit {value} is below the min-p {} threshold {threshold:.5}",
            params.min_p
        ));
    }
    if params.top_p < 1.0 {
        let kth_largest = if top_k < logits.len() {
            let mut sorted = logits.to_vec();
            sorted.select_nth_unstable_by(top_k - 1, |a, b| b.total_cmp(a));
            sorted[top_k - 1]
        } else {
            f32::NEG_INFINITY
        };
        let (mut mass_above, mut mass) = (0.0f64, 0.0f64);
        for &logit in logits.iter().filter(|&&l| l >= kth_largest) {
            let weight = (logit as f64 - max as f64).exp();
            mass += weight;
            if logit > value {
                mass_above += weight;
            }
        }
        if mass_above / mass >= params.top_p as f64 + 1e-6 {
            return Err(format!(
                "token {token}: {:.6} of the mass lies above it, outside top-p {}",
                mass_above / mass,
                params.top_p
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            top_k,
            top_p,
            min_p,
            ..SamplingParams::unfiltered(1.0)
        }
    }

    // Logits 0, 1, 2, 3: probabilities 0.032, 0.087, 0.237, 0.644 (by hand: e^i / 31.19).
    const ROW: [f32; 4] = [0.0, 1.0, 2.0, 3.0];

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Mass above token 1 is 0.881 < 0.9; above token 0 it is 0.968.
        assert!(check_token(&chain(0, 0.9, 0.0), &ROW, 1).is_ok());
        let error = check_token(&chain(0, 0.9, 0.0), &ROW, 0).unwrap_err();
        assert!(error.contains("top-p"), "{error}");
        assert!(check_token(&chain(0, 0.85, 0.0), &ROW, 1).is_err());
        assert!(check_token(&chain(0, 0.85, 0.0), &ROW, 2).is_ok());
        assert!(check_token(&chain(0, 0.5, 0.0), &ROW, 3).is_ok());
    }

    #[test]
    fn top_k_then_top_p_over_the_renormalised_set() {
        assert!(check_token(&chain(2, 1.0, 0.0), &ROW, 2).is_ok());
        assert!(check_token(&chain(2, 1.0, 0.0), &ROW, 1)
            .unwrap_err()
            .contains("top-k"));
        // Within the top 2: p(3) = 20.09 / 27.48 = 0.731.
        assert!(check_token(&chain(2, 0.7, 0.0), &ROW, 2).is_err());
        assert!(check_token(&chain(2, 0.75, 0.0), &ROW, 2).is_ok());
        // Ties at the top-k boundary are all kept.
        assert!(check_token(&chain(2, 1.0, 0.0), &[2.0, 2.0, 2.0], 2).is_ok());
    }

    #[test]
    fn min_p_is_relative_to_the_top_token() {
        // p / p_max = e^(l - 3): 0.368 for token 2, 0.135 for token 1.
        assert!(check_token(&chain(0, 1.0, 0.3), &ROW, 2).is_ok());
        assert!(check_token(&chain(0, 1.0, 0.3), &ROW, 1)
            .unwrap_err()
            .contains("min-p"));
    }

    #[test]
    fn greedy_is_the_lowest_argmax_and_ids_are_bounded() {
        let greedy = SamplingParams::greedy();
        assert!(check_token(&greedy, &[1.0, 5.0, 5.0], 1).is_ok());
        assert!(check_token(&greedy, &[1.0, 5.0, 5.0], 2).is_err());
        assert!(check_token(&greedy, &ROW, 4)
            .unwrap_err()
            .contains(">= vocab"));
        assert!(check_token(&chain(0, 1.0, 0.0), &ROW, 0).is_ok());
    }

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median_and_min(&mut [3.0, 1.0, 2.0]), (2.0, 1.0));
        assert_eq!(median_and_min(&mut [4.0, 1.0, 3.0, 2.0]), (2.5, 1.0));
        assert!(median_and_min(&mut []).0.is_nan());
    }

    #[test]
    fn randn_rows_are_deterministic_normal_with_the_scale() {
        let data = randn_rows(4, 50_001, 3.0, 7);
        assert_eq!(data, randn_rows(4, 50_001, 3.0, 7));
        assert_ne!(data[..50_001], data[50_001..100_002]);
        let n = data.len() as f64;
        let mean = data.iter().map(|&x| x as f64).sum::<f64>() / n;
        let variance = data.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        // Standard errors: mean 3 / sqrt(2e5) = 0.0067, variance 9 * sqrt(2 / 2e5) = 0.03.
        assert!(mean.abs() < 0.04, "mean {mean}");
        assert!((variance - 9.0).abs() < 0.2, "variance {variance}");
        let within_one_sigma = data.iter().filter(|&&x| x.abs() < 3.0).count() as f64 / n;
        assert!(
            (within_one_sigma - 0.6827).abs() < 0.01,
            "{within_one_sigma}"
        );
    }
}
