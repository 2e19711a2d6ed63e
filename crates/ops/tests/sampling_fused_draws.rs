//! Statistical tests of the `FusedSampler` against the exact `effective_distribution` of the
//! canonical chain: Pearson chi-square (1e6 draws on small vocabularies, fewer on a 128256-token
//! row), support equality (zero-mass and `-inf` tokens never drawn), a separated winner drawn
//! on every one of 1e6 draws, the counted fallback path, and the power of the test itself.

#[path = "common/chi_square.rs"]
mod chi_square;

use std::time::Instant;

use pagoda_ops::sampling::{effective_distribution, FusedSampler, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DRAWS: usize = 1_000_000;
/// Upper-tail standard normal quantile at p = 1e-4.
const Z_AT_ONE_IN_TEN_THOUSAND: f64 = 3.7190;

/// The chi-square quantile with `degrees_of_freedom` at the test's tail probability.
fn chi_square_critical_value(degrees_of_freedom: f64) -> f64 {
    chi_square::critical_value(degrees_of_freedom, Z_AT_ONE_IN_TEN_THOUSAND)
}

/// Pearson statistic and degrees of freedom, cells pooled until each expects >= 5 draws.
fn chi_square(name: &str, counts: &[u64], probabilities: &[f64]) -> (f64, f64) {
    chi_square::statistic(name, counts, probabilities, 5.0)
}

fn draw_counts(
    logits: &[f32],
    history: &[u32],
    params: SamplingParams,
    draws: usize,
    max_rounds: Option<u32>,
) -> Vec<u64> {
    let mut sampler = FusedSampler::new(params).unwrap();
    if let Some(rounds) = max_rounds {
        sampler.set_max_rejection_rounds(rounds);
    }
    let mut counts = vec![0u64; logits.len()];
    for _ in 0..draws {
        counts[sampler.sample(logits, history) as usize] += 1;
    }
    counts
}

/// Chi-square of `draws` fused draws against `expected` (the effective distribution of
/// `params`, or another one for the power test). Returns (statistic, critical value).
fn fit(
    name: &str,
    logits: &[f32],
    history: &[u32],
    params: SamplingParams,
    expected: &[f64],
    draws: usize,
    max_rounds: Option<u32>,
) -> (f64, f64) {
    let started = Instant::now();
    let counts = draw_counts(logits, history, params, draws, max_rounds);
    let (statistic, degrees_of_freedom) = chi_square(name, &counts, expected);
    let critical = chi_square_critical_value(degrees_of_freedom.max(1.0));
    let support = expected.iter().filter(|&&p| p > 0.0).count();
    println!(
        "{name}: support {support}, chi2 {statistic:.1} on {degrees_of_freedom} dof \
         (critical {critical:.1}), {draws} draws, {:?}",
        started.elapsed()
    );
    (statistic, critical)
}

fn assert_fits(name: &str, logits: &[f32], history: &[u32], params: SamplingParams, draws: usize) {
    let expected = effective_distribution(logits, history, &params);
    let (statistic, critical) = fit(name, logits, history, params, &expected, draws, None);
    assert!(
        statistic < critical,
        "{name}: chi2 {statistic} >= {critical}"
    );
}

fn random_row(seed: u64, vocab: usize, low: f32, high: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..vocab).map(|_| rng.random_range(low..high)).collect()
}

/// Standard-normal logits times `scale` (Box-Muller), like a real model's row.
fn normal_row(seed: u64, vocab: usize, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..vocab)
        .map(|_| {
            let u1: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
            let u2: f64 = rng.random();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32 * scale
        })
        .collect()
}

fn shapes() -> Vec<(&'static str, Vec<f32>)> {
    let mut peaked = random_row(1, 64, -1.0, 1.0);
    peaked[17] += 6.0;
    let flat = vec![0.0f32; 64];
    let mut bimodal = random_row(2, 96, -2.0, 0.0);
    bimodal[10..14].fill(3.0);
    bimodal[60..64].fill(2.5);
    let mut masked = random_row(3, 80, -2.0, 2.0);
    for token in (0..80).step_by(3) {
        masked[token] = f32::NEG_INFINITY;
    }
    vec![
        ("peaked", peaked),
        ("flat", flat),
        ("bimodal", bimodal),
        ("masked", masked),
    ]
}

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: Some(seed),
        ..SamplingParams::greedy()
    }
}

/// Gumbel-max path (no filter): `shape` at T = 0.3, 1.0, 1.7, 1e6 draws each.
fn unfiltered_fits(shape_index: usize) {
    let (shape, logits) = &shapes()[shape_index];
    for (offset, temperature) in [0.3f32, 1.0, 1.7].into_iter().enumerate() {
        let p = params(
            temperature,
            0,
            1.0,
            0.0,
            100 + 10 * shape_index as u64 + offset as u64,
        );
        assert_fits(
            &format!("gumbel {shape} T={temperature}"),
            logits,
            &[],
            p,
            DRAWS,
        );
    }
}

#[test]
fn unfiltered_peaked_fits() {
    unfiltered_fits(0);
}

#[test]
fn unfiltered_flat_fits() {
    unfiltered_fits(1);
}

#[test]
fn unfiltered_bimodal_fits() {
    unfiltered_fits(2);
}

#[test]
fn unfiltered_masked_fits() {
    unfiltered_fits(3);
}

/// Rejection path: top-k, top-p, min-p and combinations on the bimodal (ties at the filter
/// boundaries) and masked rows, with penalties from a history, 1e6 draws each.
fn filtered_fits(shape_index: usize) {
    let (shape, logits) = &shapes()[shape_index];
    let history: Vec<u32> = vec![10, 11, 11, 60, 5, 5, 5, 7];
    let filters = [
        ("top_k 6 T=0.3", params(0.3, 6, 1.0, 0.0, 1)),
        ("top_k 30 T=1.7", params(1.7, 30, 1.0, 0.0, 2)),
        ("top_p 0.8 T=1.0", params(1.0, 0, 0.8, 0.0, 3)),
        ("top_p 0.97 T=0.3", params(0.3, 0, 0.97, 0.0, 4)),
        ("min_p 0.1 T=1.7", params(1.7, 0, 1.0, 0.1, 5)),
        ("top_k 20 top_p 0.9 T=1.0", params(1.0, 20, 0.9, 0.0, 6)),
        (
            "top_k 40 top_p 0.95 min_p 0.05 T=0.8",
            params(0.8, 40, 0.95, 0.05, 7),
        ),
    ];
    for (name, filter) in &filters {
        let mut p = *filter;
        p.repetition_penalty = 1.2;
        p.frequency_penalty = 0.1;
        assert_fits(&format!("{shape} {name}"), logits, &history, p, DRAWS);
    }
}

/// Rejection path on the bimodal row (ties at the filter boundaries), with penalties from a
/// history: top-k, top-p, min-p and combinations, 1e6 draws each.
#[test]
fn filtered_bimodal_fits() {
    filtered_fits(2);
}

/// As `filtered_bimodal_fits` on the row with `-inf` entries.
#[test]
fn filtered_masked_fits() {
    filtered_fits(3);
}

/// A 128256-token row (Llama-3 vocabulary). Each draw costs ~V work (milliseconds in the test
/// profile), so far fewer draws than 1e6 (800-2000 per configuration): a coarse fit (pooled
/// bins expect >= 5 draws), plus support checks; the 1e6-draw fits run on small rows.
#[test]
fn large_vocabulary_draws_fit() {
    let logits = normal_row(9, 128_256, 2.5);
    let configurations = [
        ("large gumbel T=1.0", params(1.0, 0, 1.0, 0.0, 11), 800),
        ("large top_k 50 T=1.0", params(1.0, 50, 1.0, 0.0, 12), 2000),
        ("large top_p 0.9 T=0.7", params(0.7, 0, 0.9, 0.0, 13), 1000),
        (
            "large min_p 0.05 T=1.0",
            params(1.0, 0, 1.0, 0.05, 14),
            2000,
        ),
        (
            "large top_k 50 top_p 0.9 T=1.3",
            params(1.3, 50, 0.9, 0.0, 15),
            2000,
        ),
    ];
    for (name, p, draws) in configurations {
        assert_fits(name, &logits, &[], p, draws);
    }
}

/// The cap fallback (cap 0: every filtered call; cap 1: most) still samples exactly.
#[test]
fn fallback_path_is_exact() {
    let (_, bimodal) = &shapes()[2];
    for cap in [0u32, 1] {
        let p = params(1.0, 8, 0.9, 0.0, 21 + cap as u64);
        let expected = effective_distribution(bimodal, &[], &p);
        let (statistic, critical) = fit(
            &format!("cap {cap}"),
            bimodal,
            &[],
            p,
            &expected,
            200_000,
            Some(cap),
        );
        assert!(
            statistic < critical,
            "cap {cap}: chi2 {statistic} >= {critical}"
        );
    }
}

/// The chi-square check can fail: draws at T = 1.0 against the T = 1.15 distribution, and
/// top-p draws against the distribution without top-p, are rejected.
#[test]
fn chi_square_has_power() {
    let (_, peaked) = &shapes()[0];
    let drawn = params(1.0, 0, 1.0, 0.0, 31);
    let wrong = effective_distribution(peaked, &[], &params(1.15, 0, 1.0, 0.0, 0));
    let (statistic, critical) = fit(
        "wrong temperature",
        peaked,
        &[],
        drawn,
        &wrong,
        200_000,
        None,
    );
    assert!(
        statistic > critical,
        "wrong temperature accepted: {statistic} < {critical}"
    );

    let (_, bimodal) = &shapes()[2];
    let drawn = params(1.0, 0, 0.9, 0.0, 32);
    let mut wrong = effective_distribution(bimodal, &[], &params(1.0, 0, 1.0, 0.0, 0));
    // Make the wrong distribution share the support so only the weights differ.
    let right = effective_distribution(bimodal, &[], &drawn);
    for (w, r) in wrong.iter_mut().zip(&right) {
        if *r == 0.0 {
            *w = 0.0;
        }
    }
    let total: f64 = wrong.iter().sum();
    wrong.iter_mut().for_each(|w| *w /= total);
    let (statistic, critical) = fit(
        "wrong renormalisation",
        bimodal,
        &[],
        drawn,
        &right,
        200_000,
        None,
    );
    assert!(statistic < critical);
    let tempered = params(0.8, 0, 0.9, 0.0, 33);
    let (statistic, critical) = fit(
        "top-p at T=0.8 vs T=1",
        bimodal,
        &[],
        tempered,
        &right,
        200_000,
        None,
    );
    assert!(
        statistic > critical,
        "wrong temperature accepted: {statistic} < {critical}"
    );
}

/// Support equality: over 200k draws per configuration, every drawn token has positive mass
/// and, on rows whose support is small, every token of the support is drawn at least once.
#[test]
fn support_equals_the_chain_support() {
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    for trial in 0..12u64 {
        // Few distinct values: many ties at every filter boundary.
        let mut logits: Vec<f32> = (0..200)
            .map(|_| rng.random_range(0..8) as f32 * 0.5)
            .collect();
        for token in (0..200).step_by(5) {
            logits[token] = f32::NEG_INFINITY;
        }
        let p = params(
            [0.3f32, 1.0, 1.7][trial as usize % 3],
            [0, 5, 30][(trial as usize / 3) % 3],
            [1.0f32, 0.5, 0.9, 0.99][trial as usize % 4],
            [0.0f32, 0.2][trial as usize % 2],
            1000 + trial,
        );
        let expected = effective_distribution(&logits, &[], &p);
        let counts = draw_counts(&logits, &[], p, 200_000, None);
        for (token, (&count, &probability)) in counts.iter().zip(&expected).enumerate() {
            assert!(
                !(count > 0 && probability == 0.0),
                "trial {trial}: token {token} (logit {}) outside the support drawn {count} times; {p:?}",
                logits[token]
            );
            if probability > 1e-3 {
                assert!(
                    count > 0,
                    "trial {trial}: token {token} (p = {probability}) never drawn"
                );
            }
        }
    }
}

/// One logit 100 above the rest (vocabulary 4096, so the Gumbel noise of 4095 losers is tried
/// every draw) wins every one of 1e6 draws, unfiltered and filtered.
#[test]
fn separated_winner_wins_every_draw() {
    let mut logits = random_row(41, 4096, -1.0, 1.0);
    logits[1234] = 100.0;
    logits[7] = f32::NEG_INFINITY;
    for (name, p, draws) in [
        ("gumbel", params(1.0, 0, 1.0, 0.0, 51), DRAWS),
        ("gumbel T=1.7", params(1.7, 0, 1.0, 0.0, 52), DRAWS / 4),
        ("top_k 50", params(1.0, 50, 1.0, 0.0, 53), DRAWS / 10),
        (
            "top_p 0.999999",
            params(1.0, 0, 0.999_999, 0.0, 54),
            DRAWS / 10,
        ),
    ] {
        let mut sampler = FusedSampler::new(p).unwrap();
        for draw in 0..draws {
            let token = sampler.sample(&logits, &[]);
            assert_eq!(token, 1234, "{name}: draw {draw} returned {token}");
        }
    }
}
