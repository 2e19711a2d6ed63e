//! Helpers of the GPU sampling tests: logit row shapes, batched draws over many steps, the
//! pooled chi-square test against `pagoda_ops::sampling::effective_distribution`, and the
//! CPU `FusedSampler` oracle.

use pagoda_cuda::Gpu;
use pagoda_ops::cuda::{
    self as ops, SamplingOptions, SamplingRowParams, SamplingTotals, SamplingWorkspace,
};
use pagoda_ops::sampling::{effective_distribution, FusedSampler, SamplingParams};
use rand::Rng;

use super::{poisoned, random_vec, rng};

/// Draws per goodness-of-fit test: `PAGODA_SAMPLING_DRAWS`, default 1,000,000.
pub fn draws() -> u64 {
    std::env::var("PAGODA_SAMPLING_DRAWS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(1_000_000)
}

/// Chain parameters (penalties off) with `seed`.
pub fn chain_params(
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    seed: u64,
) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: Some(seed),
        ..SamplingParams::greedy()
    }
}

/// The GPU record of `params` at `step`.
pub fn row_params(params: &SamplingParams, step: u64) -> SamplingRowParams {
    SamplingRowParams::new(
        params.temperature,
        params.top_k.min(u32::MAX as usize) as u32,
        params.top_p,
        params.min_p,
        params.seed.expect("tests seed every request"),
        step,
    )
    .expect("valid params")
}

/// Small rows of distinct shapes (name, logits).
pub fn shape_rows() -> Vec<(&'static str, Vec<f32>)> {
    let mut rng = super::rng(17);
    let peaked: Vec<f32> = (0..64)
        .map(|i| if i == 5 { 4.0 } else { -0.3 * i as f32 })
        .collect();
    let flat = vec![0.25f32; 80];
    let bimodal: Vec<f32> = (0..96)
        .map(|i| {
            let i = i as f32;
            (-(i - 20.0).powi(2) / 40.0).max(0.5 - (i - 70.0).powi(2) / 40.0)
        })
        .collect();
    let masked: Vec<f32> = (0..72)
        .map(|i| match i {
            10 => f32::NAN,
            _ if i % 3 == 0 => f32::NEG_INFINITY,
            _ => rng.random_range(-2.0f32..2.0),
        })
        .collect();
    let wide = super::random_vec(&mut rng, 4096, 4.0);
    vec![
        ("peaked", peaked),
        ("flat", flat),
        ("bimodal", bimodal),
        ("masked", masked),
        ("random4096", wide),
    ]
}

/// A large-vocabulary row: uniform in `[-6, 6)` plus 10 peaks at 8..10 (an LLM-like head).
pub fn large_row(vocab: usize, seed: u64) -> Vec<f32> {
    let mut rng = super::rng(seed);
    let mut row = super::random_vec(&mut rng, vocab, 6.0);
    for peak in 0..10 {
        let token = rng.random_range(0..vocab);
        row[token] = 8.0 + 0.2 * peak as f32;
    }
    row
}

/// Rows per launch for a vocabulary: about 1 GiB of replicated logits, at most 16384.
pub fn rows_per_launch(vocab: usize) -> usize {
    ((1usize << 28) / vocab).clamp(1, 16_384)
}

/// Samples `draws` tokens from one logit `row` with `params` at steps `0..draws` (one launch
/// covers up to [`rows_per_launch`] steps: the row replicated, one step per row). Returns
/// the token counts and the workspace totals of the whole run.
pub fn draw_counts(
    gpu: &Gpu,
    row: &[f32],
    params: &SamplingParams,
    draws: u64,
    options: SamplingOptions,
) -> (Vec<u64>, SamplingTotals) {
    let vocab = row.len();
    let rows = rows_per_launch(vocab).min(draws as usize).max(1);
    let replicated: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let logits = gpu.upload(&replicated).expect("upload logits");
    let mut workspace = SamplingWorkspace::new(gpu, rows, vocab).expect("workspace");
    let mut tokens = gpu.alloc::<u32>(rows).expect("tokens");
    let mut counts = vec![0u64; vocab];
    let mut start = 0u64;
    while start < draws {
        let n = (draws - start).min(rows as u64) as usize;
        let records: Vec<SamplingRowParams> = (0..n as u64)
            .map(|offset| row_params(params, start + offset))
            .collect();
        let words = ops::encode_row_params(&records).expect("encode");
        let params_d = gpu.upload(&words).expect("upload params");
        let logits_view = logits.view(0..n * vocab).expect("view");
        let mut tokens_view = tokens.view_mut(0..n).expect("view");
        ops::sample_rows_with(
            gpu,
            &logits_view,
            vocab,
            &params_d,
            &mut workspace,
            &mut tokens_view,
            options,
        )
        .expect("sample_rows");
        for token in gpu.download(&tokens_view).expect("download") {
            assert!(
                (token as usize) < vocab,
                "token {token} outside vocab {vocab}"
            );
            counts[token as usize] += 1;
        }
        start += n as u64;
    }
    (counts, workspace.read_totals(gpu).expect("totals"))
}

/// A pooled Pearson chi-square test.
#[derive(Debug, Clone, Copy)]
pub struct ChiSquare {
    /// The statistic.
    pub statistic: f64,
    /// Degrees of freedom (bins - 1).
    pub dof: usize,
    /// Critical value at upper-tail p = 1e-6 (Wilson-Hilferty).
    pub critical: f64,
    /// Approximate upper-tail p-value of the statistic (Wilson-Hilferty + normal tail).
    pub p_value: f64,
}

/// Complementary error function (Numerical Recipes `erfcc`, relative error < 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    // The polynomial in t by Horner's rule, innermost coefficient first (a loop: written as
    // one nested expression it took rustfmt seconds, once per test binary that includes it).
    let horner = [
        -0.822_152_23,
        1.488_515_87,
        -1.135_203_98,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_68,
    ]
    .iter()
    .fold(0.170_872_77, |acc, c| c + t * acc);
    let poly = -z * z - 1.265_512_23 + t * horner;
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// Chi-square of `counts` against `probabilities`: cells of positive probability pooled in
/// id order until each bin expects at least 10 draws (a data-independent partition).
pub fn chi_square(counts: &[u64], probabilities: &[f64]) -> ChiSquare {
    let draws: u64 = counts.iter().sum();
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let (mut expected, mut observed) = (0.0f64, 0.0f64);
    for (&count, &probability) in counts.iter().zip(probabilities) {
        if probability > 0.0 {
            expected += probability * draws as f64;
            observed += count as f64;
            if expected >= 10.0 {
                bins.push((expected, observed));
                expected = 0.0;
                observed = 0.0;
            }
        }
    }
    if expected > 0.0 || observed > 0.0 {
        match bins.last_mut() {
            Some(last) => {
                last.0 += expected;
                last.1 += observed;
            }
            None => bins.push((expected, observed)),
        }
    }
    let statistic: f64 = bins.iter().map(|&(e, o)| (o - e) * (o - e) / e).sum();
    let dof = bins.len().saturating_sub(1);
    let k = dof.max(1) as f64;
    let spread = (2.0 / (9.0 * k)).sqrt();
    let critical = k * (1.0 - 2.0 / (9.0 * k) + 4.7534 * spread).powi(3);
    let z = ((statistic / k).cbrt() - (1.0 - 2.0 / (9.0 * k))) / spread;
    ChiSquare {
        statistic,
        dof,
        critical,
        p_value: 0.5 * erfc(z / std::f64::consts::SQRT_2),
    }
}

/// Asserts that no zero-probability token was drawn and that the counts pass the chi-square
/// test at p = 1e-6; prints one summary line.
pub fn assert_distribution(what: &str, counts: &[u64], probabilities: &[f64]) {
    for (token, (&count, &probability)) in counts.iter().zip(probabilities).enumerate() {
        assert!(
            probability > 0.0 || count == 0,
            "{what}: token {token} has probability 0 but was drawn {count} times"
        );
    }
    let test = chi_square(counts, probabilities);
    let support = probabilities.iter().filter(|&&p| p > 0.0).count();
    println!(
        "{what}: support {support}, chi2 {:.1}, dof {}, critical(1e-6) {:.1}, p ~ {:.3e}",
        test.statistic, test.dof, test.critical, test.p_value
    );
    if test.dof > 0 {
        assert!(
            test.statistic <= test.critical,
            "{what}: chi2 {} > critical {} (dof {})",
            test.statistic,
            test.critical,
            test.dof
        );
    }
}

/// Draws `draws` GPU tokens of `row` with `params` and checks them against the chain's exact
/// distribution; returns the totals.
pub fn check_against_chain(
    gpu: &Gpu,
    what: &str,
    row: &[f32],
    params: &SamplingParams,
    draws: u64,
) -> SamplingTotals {
    check_against_chain_with(gpu, what, row, params, draws, SamplingOptions::default())
}

/// [`check_against_chain`] with the launches' `options`.
pub fn check_against_chain_with(
    gpu: &Gpu,
    what: &str,
    row: &[f32],
    params: &SamplingParams,
    draws: u64,
    options: SamplingOptions,
) -> SamplingTotals {
    let (counts, totals) = draw_counts(gpu, row, params, draws, options);
    let probabilities = effective_distribution(row, &[], params);
    assert_distribution(what, &counts, &probabilities);
    totals
}

/// The CPU `FusedSampler`'s tokens for `steps` calls on the same row (steps `0..steps`).
pub fn cpu_tokens(
    row: &[f32],
    params: &SamplingParams,
    steps: u64,
    max_rounds: Option<u32>,
) -> Vec<u32> {
    let mut sampler = FusedSampler::new(*params).expect("valid params");
    if let Some(rounds) = max_rounds {
        sampler.set_max_rejection_rounds(rounds);
    }
    (0..steps).map(|_| sampler.sample(row, &[])).collect()
}

/// The GPU's tokens for steps `0..steps` of the same row (one launch per
/// [`rows_per_launch`] steps).
pub fn gpu_tokens(
    gpu: &Gpu,
    row: &[f32],
    params: &SamplingParams,
    steps: u64,
    options: SamplingOptions,
) -> Vec<u32> {
    let vocab = row.len();
    let rows = rows_per_launch(vocab).min(steps as usize).max(1);
    let replicated: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let logits = gpu.upload(&replicated).expect("upload logits");
    let mut workspace = SamplingWorkspace::new(gpu, rows, vocab).expect("workspace");
    let mut out = Vec::with_capacity(steps as usize);
    let mut start = 0u64;
    while start < steps {
        let n = (steps - start).min(rows as u64) as usize;
        let records: Vec<SamplingRowParams> = (0..n as u64)
            .map(|offset| row_params(params, start + offset))
            .collect();
        let params_d = gpu
            .upload(&ops::encode_row_params(&records).unwrap())
            .unwrap();
        let mut tokens = gpu.alloc::<u32>(n).unwrap();
        let logits_view = logits.view(0..n * vocab).unwrap();
        ops::sample_rows_with(
            gpu,
            &logits_view,
            vocab,
            &params_d,
            &mut workspace,
            &mut tokens,
            options,
        )
        .unwrap();
        out.extend(gpu.download(&tokens).unwrap());
        start += n as u64;
    }
    out
}

/// A mixed batch: greedy, Gumbel and filtered rows with different logits, seeds and steps.
pub fn mixed_batch(vocab: usize) -> (Vec<Vec<f32>>, Vec<SamplingRowParams>) {
    let mut rng = rng(61 + vocab as u64);
    let mut rows = Vec::new();
    let mut params = Vec::new();
    for index in 0..37u64 {
        rows.push(random_vec(&mut rng, vocab, 2.0 + (index % 5) as f32));
        let chain = match index % 6 {
            0 => chain_params(0.0, 0, 1.0, 0.0, index),
            1 => chain_params(0.8, 0, 1.0, 0.0, index),
            2 => chain_params(1.0, 40, 1.0, 0.0, index),
            3 => chain_params(0.7, 0, 0.9, 0.0, index),
            4 => chain_params(1.2, 0, 1.0, 0.05, index),
            _ => chain_params(1.0, 50, 0.9, 0.0, index),
        };
        params.push(row_params(&chain, 1000 * index + 7));
    }
    (rows, params)
}

/// The tokens of one launch (see [`sample_batch_with_totals`]).
pub fn sample_batch(
    gpu: &Gpu,
    rows: &[Vec<f32>],
    params: &[SamplingRowParams],
    options: SamplingOptions,
) -> Vec<u32> {
    sample_batch_with_totals(gpu, rows, params, options).0
}

/// One launch over `rows` with `options` (a fresh workspace): the tokens and the totals.
pub fn sample_batch_with_totals(
    gpu: &Gpu,
    rows: &[Vec<f32>],
    params: &[SamplingRowParams],
    options: SamplingOptions,
) -> (Vec<u32>, SamplingTotals) {
    let vocab = rows[0].len();
    let logits = gpu.upload(&rows.concat()).unwrap();
    let params_d = gpu
        .upload(&ops::encode_row_params(params).unwrap())
        .unwrap();
    let mut workspace = SamplingWorkspace::new(gpu, rows.len(), vocab).unwrap();
    let mut tokens = poisoned::<u32>(gpu, rows.len());
    ops::sample_rows_with(
        gpu,
        &logits,
        vocab,
        &params_d,
        &mut workspace,
        &mut tokens,
        options,
    )
    .unwrap();
    (
        gpu.download(&tokens).unwrap(),
        workspace.read_totals(gpu).unwrap(),
    )
}
