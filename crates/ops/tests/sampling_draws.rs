//! Statistical tests of the reference `Sampler`: its draws against the exact
//! `effective_distribution` (Pearson chi-square), zero-mass tokens never drawn, a separated
//! winner always drawn, and seed reproducibility.

#[path = "common/chi_square.rs"]
mod chi_square;

use std::time::Instant;

use pagoda_ops::sampling::{effective_distribution, Sampler, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DRAWS: usize = 200_000;
/// Upper-tail standard normal quantile at p = 1e-6: a correct sampler fails one check in a
/// million, a wrong one (see `chi_square_has_power_against_a_wrong_temperature`) fails always.
const Z_AT_ONE_IN_A_MILLION: f64 = 4.7534;

/// The chi-square quantile with `degrees_of_freedom` at the test's tail probability.
fn chi_square_critical_value(degrees_of_freedom: f64) -> f64 {
    chi_square::critical_value(degrees_of_freedom, Z_AT_ONE_IN_A_MILLION)
}

/// Pearson statistic and degrees of freedom, cells pooled until each expects >= 10 draws.
fn chi_square(name: &str, counts: &[u64], probabilities: &[f64]) -> (f64, f64) {
    chi_square::statistic(name, counts, probabilities, 10.0)
}

fn draw_counts(logits: &[f32], history: &[u32], params: SamplingParams, draws: usize) -> Vec<u64> {
    let mut sampler = Sampler::new(params).unwrap();
    let mut counts = vec![0u64; logits.len()];
    for _ in 0..draws {
        counts[sampler.sample(logits, history) as usize] += 1;
    }
    counts
}

/// Draws `draws` tokens and checks them against the effective distribution.
fn assert_goodness_of_fit(
    name: &str,
    logits: &[f32],
    history: &[u32],
    params: SamplingParams,
    draws: usize,
) {
    let started = Instant::now();
    let probabilities = effective_distribution(logits, history, &params);
    let counts = draw_counts(logits, history, params, draws);
    let (statistic, degrees_of_freedom) = chi_square(name, &counts, &probabilities);
    let support = probabilities.iter().filter(|&&p| p > 0.0).count();
    println!(
        "{name}: support {support}, chi2 {statistic:.1} on {degrees_of_freedom} dof, {:?}",
        started.elapsed()
    );
    if degrees_of_freedom >= 1.0 {
        let critical = chi_square_critical_value(degrees_of_freedom);
        assert!(
            statistic < critical,
            "{name}: chi2 {statistic} >= {critical} ({degrees_of_freedom} dof)"
        );
    }
}

fn random_row(seed: u64, vocab: usize, low: f32, high: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..vocab).map(|_| rng.random_range(low..high)).collect()
}

/// The test rows: (name, logits).
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

fn seeded(params: SamplingParams, seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        ..params
    }
}

#[test]
fn unfiltered_draws_fit_at_several_temperatures() {
    let mut seed = 100;
    for (shape, logits) in shapes() {
        for temperature in [0.5f32, 1.0, 1.5] {
            seed += 1;
            let params = seeded(SamplingParams::unfiltered(temperature), seed);
            assert_goodness_of_fit(
                &format!("{shape} T={temperature}"),
                &logits,
                &[],
                params,
                DRAWS,
            );
        }
    }
    // A 4096-token row (no filter: the whole row is the support). Fewer draws (each costs
    // ~40x a small row); pooling keeps every bin at >= 10 expected.
    let large = random_row(4, 4096, -3.0, 3.0);
    assert_goodness_of_fit(
        "large T=1",
        &large,
        &[],
        seeded(SamplingParams::unfiltered(1.0), 7),
        60_000,
    );
}

#[test]
fn filtered_draws_fit() {
    let shapes = shapes();
    let (_, bimodal) = &shapes[2];
    let (_, masked) = &shapes[3];
    let history: Vec<u32> = vec![10, 11, 11, 60, 5, 5, 5, 7];
    let filters: Vec<(&str, SamplingParams)> = vec![
        (
            "top_k 6 T=0.7",
            SamplingParams {
                top_k: 6,
                ..SamplingParams::unfiltered(0.7)
            },
        ),
        (
            "top_k 30 T=1.5",
            SamplingParams {
                top_k: 30,
                ..SamplingParams::unfiltered(1.5)
            },
        ),
        (
            "top_p 0.8 T=1.3",
            SamplingParams {
                top_p: 0.8,
                ..SamplingParams::unfiltered(1.3)
            },
        ),
        (
            "top_p 0.97 T=0.6",
            SamplingParams {
                top_p: 0.97,
                ..SamplingParams::unfiltered(0.6)
            },
        ),
        (
            "min_p 0.1 T=0.9",
            SamplingParams {
                min_p: 0.1,
                ..SamplingParams::unfiltered(0.9)
            },
        ),
        (
            "min_p 0.02 T=1.2",
            SamplingParams {
                min_p: 0.02,
                ..SamplingParams::unfiltered(1.2)
            },
        ),
        ("defaults", SamplingParams::default()),
        (
            "combined T=1.4",
            SamplingParams {
                temperature: 1.4,
                top_k: 20,
                top_p: 0.9,
                min_p: 0.03,
                ..SamplingParams::default()
            },
        ),
    ];
    let mut seed = 200;
    for (shape, logits) in [("bimodal", bimodal), ("masked", masked)] {
        for (filter, params) in &filters {
            seed += 1;
            assert_goodness_of_fit(
                &format!("{shape} {filter}"),
                logits,
                &[],
                seeded(*params, seed),
                DRAWS,
            );
        }
    }
    let penalized = SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.2,
        presence_penalty: 0.4,
        ..SamplingParams::default()
    };
    assert_goodness_of_fit(
        "bimodal defaults+penalties",
        bimodal,
        &history,
        seeded(penalized, 300),
        DRAWS,
    );
}

#[test]
fn chi_square_has_power_against_a_wrong_temperature() {
    // The same harness must reject draws at T=1.0 checked against T=1.1: if this passed, the
    // fits above would prove nothing.
    let (_, logits) = &shapes()[0];
    let counts = draw_counts(
        logits,
        &[],
        seeded(SamplingParams::unfiltered(1.0), 11),
        DRAWS,
    );
    let wrong = effective_distribution(logits, &[], &SamplingParams::unfiltered(1.1));
    let (statistic, degrees_of_freedom) = chi_square("power", &counts, &wrong);
    assert!(
        statistic > chi_square_critical_value(degrees_of_freedom),
        "chi2 {statistic}"
    );
}

#[test]
fn a_token_100_logits_above_the_rest_wins_every_draw() {
    let mut logits = random_row(5, 4096, -1.0, 1.0);
    logits[1234] = 100.0;
    for temperature in [1.0f32, 1.5] {
        let mut sampler =
            Sampler::new(seeded(SamplingParams::unfiltered(temperature), 77)).unwrap();
        for draw in 0..20_000 {
            assert_eq!(
                sampler.sample(&logits, &[]),
                1234,
                "draw {draw} at T={temperature}"
            );
        }
    }
    // Smaller vocabulary, many more draws.
    let mut small = random_row(6, 16, -1.0, 1.0);
    small[3] = 101.0;
    let mut sampler = Sampler::new(seeded(SamplingParams::unfiltered(1.5), 78)).unwrap();
    for draw in 0..1_000_000 {
        assert_eq!(sampler.sample(&small, &[]), 3, "draw {draw}");
    }
}

#[test]
fn same_seed_same_stream_and_recorded_seed_replays() {
    let (_, logits) = &shapes()[2];
    let stream = |params: SamplingParams| -> (u64, Vec<u32>) {
        let mut sampler = Sampler::new(params).unwrap();
        let tokens = (0..2000).map(|_| sampler.sample(logits, &[])).collect();
        (sampler.seed(), tokens)
    };
    let params = SamplingParams::unfiltered(1.0);
    let (seed_a, first) = stream(seeded(params, 42));
    let (_, second) = stream(seeded(params, 42));
    let (_, other) = stream(seeded(params, 43));
    assert_eq!(seed_a, 42);
    assert_eq!(first, second);
    assert_ne!(first, other);
    // An unseeded sampler reports the seed it drew; seeding with it replays the stream.
    let (drawn_seed, unseeded) = stream(params);
    let (_, replayed) = stream(seeded(params, drawn_seed));
    assert_eq!(unseeded, replayed);
}
