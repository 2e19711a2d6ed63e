//! The chain against an O(V^2) brute-force oracle written straight from the definitions of
//! the filters, on random rows with ties and masks, on rows whose top-p nucleus outgrows the
//! sort window, and on a large vocabulary; plus an exact replay of the `Sampler`'s draws.

use pagoda_ops::sampling::{
    effective_distribution, inverse_cdf, uniform_f64, ChainOutcome, Sampler, SamplingChain,
    SamplingParams,
};
use rand::{Rng, SeedableRng};
use rand_chacha::{ChaCha20Rng, ChaCha8Rng};

const NEG_INF: f32 = f32::NEG_INFINITY;

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        ..SamplingParams::greedy()
    }
}

fn normalized(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

fn assert_matches_brute_force(name: &str, logits: &[f32], sampling_params: &SamplingParams) {
    let actual = effective_distribution(logits, &[], sampling_params);
    let expected = brute_force_distribution(logits, sampling_params);
    for (token, (a, e)) in actual.iter().zip(&expected).enumerate() {
        assert!(
            (a - e).abs() <= 1e-12 && ((*a == 0.0) == (*e == 0.0)),
            "{name}: token {token}: got {a}, expected {e}; {sampling_params:?}"
        );
    }
    // The support is exactly {z >= min_kept_logit} (no history here, so z = logits).
    if let ChainOutcome::Categorical(categorical) =
        SamplingChain::new().run(logits, &[], sampling_params)
    {
        let threshold_support: Vec<u32> = (0..logits.len() as u32)
            .filter(|&token| logits[token as usize] >= categorical.min_kept_logit)
            .collect();
        assert_eq!(categorical.tokens, &threshold_support[..], "{name}");
    }
}

/// The chain written straight from its definitions, O(V^2), with normalised probabilities.
fn brute_force_distribution(logits: &[f32], sampling_params: &SamplingParams) -> Vec<f64> {
    let finite: Vec<bool> = logits.iter().map(|l| l.is_finite()).collect();
    let max = logits
        .iter()
        .filter(|l| l.is_finite())
        .fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    let unnormalized: Vec<f64> = logits
        .iter()
        .map(|&l| {
            if l.is_finite() {
                (l as f64 - max).exp()
            } else {
                0.0
            }
        })
        .collect();
    let total: f64 = unnormalized.iter().sum();
    let p: Vec<f64> = unnormalized.iter().map(|u| u / total).collect();
    let vocab = logits.len();
    if sampling_params.is_greedy() {
        let mut one_hot = vec![0.0; vocab];
        let naive_argmax =
            (0..vocab).fold(0, |best, i| if logits[i] > logits[best] { i } else { best });
        one_hot[naive_argmax] = 1.0;
        return one_hot;
    }
    let k = sampling_params.top_k;
    let in_top_k: Vec<bool> = (0..vocab)
        .map(|i| {
            finite[i] && (k == 0 || (0..vocab).filter(|&j| finite[j] && p[j] > p[i]).count() < k)
        })
        .collect();
    let top_k_mass: f64 = (0..vocab).filter(|&i| in_top_k[i]).map(|i| p[i]).sum();
    let p_max = p.iter().cloned().fold(0.0, f64::max);
    let kept: Vec<bool> = (0..vocab)
        .map(|i| {
            let mass_above: f64 = (0..vocab)
                .filter(|&j| in_top_k[j] && p[j] > p[i])
                .map(|j| p[j])
                .sum();
            in_top_k[i]
                && (sampling_params.top_p >= 1.0
                    || mass_above < sampling_params.top_p as f64 * top_k_mass)
                && p[i] >= sampling_params.min_p as f64 * p_max
        })
        .collect();
    let weights: Vec<f64> = (0..vocab)
        .map(|i| {
            if kept[i] {
                p[i].powf(1.0 / sampling_params.temperature as f64)
            } else {
                0.0
            }
        })
        .collect();
    normalized(&weights)
}

#[test]
fn matches_brute_force_oracle_on_random_rows_with_ties_and_masks() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for case in 0..400 {
        let vocab = rng.random_range(1..40usize);
        // Quantised logits so that ties are frequent; some masked.
        let logits: Vec<f32> = (0..vocab)
            .map(|_| {
                if rng.random_bool(0.15) {
                    NEG_INF
                } else {
                    (rng.random_range(-12i32..12) as f32) * 0.25
                }
            })
            .collect();
        if logits.iter().all(|l| !l.is_finite()) {
            continue;
        }
        let sampling_params = SamplingParams {
            temperature: [0.3f32, 0.8, 1.0, 1.7][rng.random_range(0..4)],
            top_k: [0usize, 1, 2, 3, 5, 50][rng.random_range(0..6)],
            top_p: if rng.random_bool(0.5) {
                1.0
            } else {
                rng.random_range(0.05f32..1.0)
            },
            min_p: if rng.random_bool(0.5) {
                0.0
            } else {
                rng.random_range(0.0f32..1.0)
            },
            ..SamplingParams::greedy()
        };
        assert_matches_brute_force(
            &format!("case {case}: {logits:?}"),
            &logits,
            &sampling_params,
        );
    }
}

#[test]
fn min_p_is_active_on_a_large_vocabulary() {
    // Vocab 49152: logits spread over [-10, 0]; min-p .05 keeps z >= ln(.05) ~ -2.996.
    let vocab = 49152;
    let logits: Vec<f32> = (0..vocab)
        .map(|i| -10.0 * (i as f32) / vocab as f32)
        .collect();
    let expected_kept = logits.iter().filter(|&&l| (l as f64).exp() >= 0.05).count();
    assert!(expected_kept > 1000 && expected_kept < vocab / 2);
    for temperature in [0.5f32, 1.0, 2.0] {
        let distribution = effective_distribution(&logits, &[], &params(temperature, 0, 1.0, 0.05));
        let kept = distribution.iter().filter(|&&p| p > 0.0).count();
        assert_eq!(kept, expected_kept, "temperature {temperature}");
    }
    // Combined with top-k 40: the 40 largest logits are tokens 0..40 (strictly decreasing).
    let top_k_only = SamplingParams {
        top_p: 1.0,
        ..SamplingParams::default()
    };
    let distribution = effective_distribution(&logits, &[], &top_k_only);
    assert!(distribution[..40].iter().all(|&p| p > 0.0));
    assert!(distribution[40..].iter().all(|&p| p == 0.0));
    // Defaults add top-p .95 over those 40 nearly equal tokens: keep token i while the mass
    // of tokens 0..i is < .95 of the top-40 mass.
    let top_40: Vec<f64> = logits[..40].iter().map(|&l| (l as f64).exp()).collect();
    let top_40_mass: f64 = top_40.iter().sum();
    let expected_kept = (0..40)
        .filter(|&i| top_40[..i].iter().sum::<f64>() < 0.95 * top_40_mass)
        .count();
    assert!(expected_kept < 40);
    let distribution = effective_distribution(&logits, &[], &SamplingParams::default());
    assert_eq!(
        distribution.iter().filter(|&&p| p > 0.0).count(),
        expected_kept
    );
}

#[test]
fn top_p_nucleus_larger_than_the_sort_window_matches_brute_force() {
    // 3000 tokens on 40 logit levels (about 75 tokens per tie group): nuclei of hundreds to
    // thousands of tokens make the sorted window grow (256 -> 1024 -> 3000), and tie groups
    // straddle its boundaries.
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let logits: Vec<f32> = (0..3000)
        .map(|_| rng.random_range(-40i32..0) as f32 * 0.05)
        .collect();
    for top_p in [0.3f32, 0.62, 0.9, 0.999] {
        for (top_k, min_p) in [(0usize, 0.0f32), (2000, 0.0), (0, 0.2)] {
            let sampling_params = params(1.0, top_k, top_p, min_p);
            let name = format!("top_p {top_p} top_k {top_k} min_p {min_p}");
            assert_matches_brute_force(&name, &logits, &sampling_params);
            let kept = effective_distribution(&logits, &[], &sampling_params)
                .iter()
                .filter(|&&p| p > 0.0)
                .count();
            println!("{name}: {kept} kept");
        }
    }
}

#[test]
fn sampler_draws_are_the_inverse_cdf_of_the_effective_distribution() {
    // Replays the documented RNG contract by hand: ChaCha20 seeded with the seed, one 53-bit
    // uniform per non-greedy step, inverse CDF in ascending id order. Alternating rows of
    // different sizes and a changing history also exercise the reused buffers.
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let rows: Vec<Vec<f32>> = [50usize, 7, 300, 1]
        .iter()
        .map(|&vocab| (0..vocab).map(|_| rng.random_range(-4.0f32..4.0)).collect())
        .collect();
    let sampling_params = SamplingParams {
        seed: Some(2024),
        repetition_penalty: 1.2,
        presence_penalty: 0.3,
        penalty_last_n: 5,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(sampling_params).unwrap();
    let mut replay_rng = ChaCha20Rng::seed_from_u64(2024);
    let mut history: Vec<u32> = Vec::new();
    for step in 0..2000 {
        let row = &rows[step % rows.len()];
        let distribution = effective_distribution(row, &history, &sampling_params);
        let expected = inverse_cdf(&distribution, uniform_f64(&mut replay_rng)).unwrap() as u32;
        let token = sampler.sample(row, &history);
        assert_eq!(token, expected, "step {step}");
        assert!(distribution[token as usize] > 0.0);
        history.push(token);
    }
}
