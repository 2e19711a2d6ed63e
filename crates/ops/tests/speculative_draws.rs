//! Speculative verification against the target's exact distribution: the tokens
//! `verify_guess` emits (the guess when accepted, the residual draw otherwise) follow `p`
//! exactly, whatever the drafter's `q`, by Pearson chi-square; its acceptance rate is
//! `sum min(p, q)` (the maximal coupling); a token 100 logits ahead is emitted every time; the
//! test has the power to reject a wrong residual. Drafters chosen to stress it: uniform, mass
//! where `p` has none, `q = p`, one-hot on an unlikely token; at temperatures 0.5, 1 and 1.7,
//! with each filter.
//!
//! Draws per case: `PAGODA_SPEC_DRAWS` (default 20,000 so CI stays short; the report's full
//! run used 1,000,000: `PAGODA_SPEC_DRAWS=1000000 cargo test --release -p pagoda-ops --test
//! speculative_draws`).

#[path = "common/chi_square.rs"]
mod chi_square;

use pagoda_ops::sampling::philox::key_from_seed;
use pagoda_ops::sampling::speculative::{verify_guess, Verdict};
use pagoda_ops::sampling::{effective_distribution, inverse_cdf, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Upper-tail standard normal quantile at p = 1e-4.
const Z_AT_ONE_IN_TEN_THOUSAND: f64 = 3.7190;

fn draws() -> usize {
    std::env::var("PAGODA_SPEC_DRAWS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(20_000)
}

/// The chi-square quantile at p = 1e-4 with `degrees_of_freedom`.
fn chi_square_critical_value(degrees_of_freedom: f64) -> f64 {
    chi_square::critical_value(degrees_of_freedom, Z_AT_ONE_IN_TEN_THOUSAND)
}

/// Pearson statistic and its critical value, cells pooled until each expects >= 5 draws.
fn chi_square(name: &str, counts: &[u64], probabilities: &[f64]) -> (f64, f64) {
    let (statistic, dof) = chi_square::statistic(name, counts, probabilities, 5.0);
    (statistic, chi_square_critical_value(dof.max(1.0)))
}

/// The drafters: `(name, q)`, `None` for a deterministic guess of `unlikely`.
fn drafters(p: &[f64], unlikely: u32) -> Vec<(&'static str, Option<Vec<f32>>)> {
    let v = p.len();
    let uniform = vec![1.0 / v as f32; v];
    // All of q's mass where p has the least (none, when a filter cut it).
    let mut order: Vec<usize> = (0..v).collect();
    order.sort_by(|&a, &b| p[a].total_cmp(&p[b]));
    let mut elsewhere = vec![0.0f32; v];
    for &i in &order[..v / 4] {
        elsewhere[i] = 4.0 / v as f32;
    }
    let same: Vec<f32> = p.iter().map(|&x| x as f32).collect();
    let mut one_hot = vec![0.0f32; v];
    one_hot[unlikely as usize] = 1.0;
    vec![
        ("uniform q", Some(uniform)),
        ("q where p is not", Some(elsewhere)),
        ("q = p", Some(same)),
        ("q one-hot on an unlikely token", Some(one_hot)),
        ("n-gram guess of an unlikely token", None),
    ]
}

/// Emitted-token counts and acceptances of `n` verifications of guesses drawn from `q`.
fn emit(p: &[f64], q: Option<&[f32]>, unlikely: u32, n: usize, seed: u64) -> (Vec<u64>, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let weights: Option<Vec<f64>> = q.map(|q| q.iter().map(|&x| x as f64).collect());
    let key = key_from_seed(seed);
    let mut counts = vec![0u64; p.len()];
    let mut accepted = 0;
    for step in 0..n as u64 {
        let guess = match &weights {
            Some(weights) => inverse_cdf(weights, rng.random::<f64>()).unwrap() as u32,
            None => unlikely,
        };
        let token = match verify_guess(p, q, guess, key, step) {
            Verdict::Accepted => {
                accepted += 1;
                guess
            }
            Verdict::Rejected { token } => token,
        };
        counts[token as usize] += 1;
    }
    (counts, accepted)
}

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        ..SamplingParams::unfiltered(temperature)
    }
}

#[test]
fn emitted_tokens_follow_the_target_distribution_for_every_drafter() {
    let n = draws();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let logits: Vec<f32> = (0..64).map(|_| rng.random_range(-4.0..4.0)).collect();
    let filters = [
        ("no filter", 0, 1.0, 0.0),
        ("top_k 10", 10, 1.0, 0.0),
        ("top_p 0.8", 0, 0.8, 0.0),
        ("min_p 0.05", 0, 1.0, 0.05),
    ];
    let mut cases = 0;
    for temperature in [0.5, 1.0, 1.7] {
        for (filter, top_k, top_p, min_p) in filters {
            let p = effective_distribution(&logits, &[], &params(temperature, top_k, top_p, min_p));
            // The least likely token with mass (or without, when filtered out).
            let unlikely = (0..p.len())
                .filter(|&i| p[i] > 0.0)
                .min_by(|&a, &b| p[a].total_cmp(&p[b]))
                .unwrap() as u32;
            for (drafter, q) in drafters(&p, unlikely) {
                let name = format!("T={temperature} {filter}, {drafter}");
                let (counts, accepted) = emit(&p, q.as_deref(), unlikely, n, 1000 + cases);
                let (statistic, critical) = chi_square(&name, &counts, &p);
                assert!(
                    statistic < critical,
                    "{name}: chi-square {statistic:.1} above {critical:.1}"
                );
                // Acceptance is the maximal coupling's sum min(p, q), within 5 sigma.
                let coupling: f64 = match &q {
                    Some(q) => p.iter().zip(q).map(|(&a, &b)| a.min(b as f64)).sum(),
                    None => p[unlikely as usize],
                };
                let rate = accepted as f64 / n as f64;
                println!(
                    "{name}: chi-square {statistic:.1} (critical {critical:.1}), acceptance \
                     {rate:.4} (sum min(p, q) {coupling:.4})"
                );
                let sigma = (coupling * (1.0 - coupling) / n as f64).sqrt().max(1e-9);
                assert!(
                    (rate - coupling).abs() <= 5.0 * sigma + 1e-6,
                    "{name}: acceptance {rate:.5}, expected {coupling:.5}"
                );
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 3 * 4 * 5);
}

#[test]
fn a_token_a_hundred_logits_ahead_is_emitted_every_time() {
    let n = draws() / 4;
    let mut logits = vec![0.0f32; 4096];
    logits[1234] = 100.0;
    let p = effective_distribution(&logits, &[], &params(1.0, 0, 1.0, 0.0));
    for (drafter, q) in drafters(&p, 7) {
        let (counts, _) = emit(&p, q.as_deref(), 7, n, 99);
        assert_eq!(counts[1234], n as u64, "{drafter}");
    }
}

#[test]
fn chi_square_rejects_resampling_from_p_instead_of_the_residual() {
    // The classic mistake: on rejection draw from p, not from max(0, p - q).
    let n = draws();
    let p = effective_distribution(
        &[2.0, 1.0, 0.5, 0.0, -0.5, -1.0],
        &[],
        &params(0.7, 0, 1.0, 0.0),
    );
    let q: Vec<f64> = effective_distribution(
        &[1.4, 1.3, 0.2, 0.6, -0.3, -0.8],
        &[],
        &params(0.7, 0, 1.0, 0.0),
    );
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let mut counts = vec![0u64; p.len()];
    for _ in 0..n {
        let guess = inverse_cdf(&q, rng.random::<f64>()).unwrap();
        let token = if rng.random::<f64>() * q[guess] <= p[guess] {
            guess
        } else {
            inverse_cdf(&p, rng.random::<f64>()).unwrap()
        };
        counts[token] += 1;
    }
    let (statistic, critical) = chi_square("wrong residual", &counts, &p);
    println!("wrong residual: chi-square {statistic:.1} (critical {critical:.1})");
    assert!(
        statistic > critical,
        "the wrong rule passed: {statistic:.1} <= {critical:.1}"
    );
    // And the right rule on the same pair passes.
    let q32: Vec<f32> = q.iter().map(|&x| x as f32).collect();
    let (counts, _) = emit(&p, Some(&q32), 0, n, 23);
    let (statistic, critical) = chi_square("right residual", &counts, &p);
    assert!(statistic < critical, "{statistic:.1} >= {critical:.1}");
}
