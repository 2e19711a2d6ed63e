//! Masked sampling draws from the target distribution renormalised over the tokens the
//! grammar allows: a grammar's mask (pagoda-grammar) applied to fixed logits, then the
//! engine's samplers (the fused sampler and the reference one, with top-k and top-p as the
//! server passes them), against the exact renormalised softmax by a chi-square test.

use pagoda_grammar::{GrammarSpec, Grammars, Vocabulary};
use pagoda_ops::sampling::{AnySampler, SamplerKind, SamplingParams};

/// 16 single-byte tokens `a..p` and an end token.
fn grammars() -> Grammars {
    let mut tokens: Vec<Vec<u8>> = (b'a'..=b'p').map(|b| vec![b]).collect();
    tokens.push(b"<end>".to_vec());
    let mut special = vec![false; 16];
    special.push(true);
    Grammars::new(Vocabulary::new(tokens, &special, &[16]).unwrap()).unwrap()
}

/// Chi-square statistic of `counts` against `probabilities` (cells with p > 0).
fn chi_square(counts: &[u64], probabilities: &[f64]) -> f64 {
    let total: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(probabilities)
        .filter(|(_, &p)| p > 0.0)
        .map(|(&c, &p)| {
            let expected = p * total as f64;
            (c as f64 - expected).powi(2) / expected
        })
        .sum()
}

#[test]
fn masked_draws_follow_the_renormalised_distribution() {
    let grammars = grammars();
    // The first character of one of these words: b, d, f, h, j (5 of 17 tokens allowed).
    let spec = GrammarSpec::Choice(
        ["bad", "dog", "fig", "hen", "jam"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
    );
    let logits: Vec<f32> = (0..17).map(|i| ((i * 7 % 11) as f32) * 0.3 - 1.0).collect();
    let mut masked = logits.clone();
    grammars
        .constraint(&spec)
        .unwrap()
        .apply(&mut masked)
        .unwrap();
    let allowed: Vec<usize> = (0..17).filter(|&i| masked[i].is_finite()).collect();
    assert_eq!(allowed, vec![1, 3, 5, 7, 9]);
    let weights: Vec<f64> = (0..17)
        .map(|i| {
            if masked[i].is_finite() {
                (logits[i] as f64).exp()
            } else {
                0.0
            }
        })
        .collect();
    let sum: f64 = weights.iter().sum();
    let target: Vec<f64> = weights.iter().map(|w| w / sum).collect();
    const DRAWS: u64 = 20_000;
    for kind in [SamplerKind::Fused, SamplerKind::Reference] {
        let mut counts = vec![0u64; 17];
        for seed in 0..DRAWS {
            let params = SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: Some(seed),
                ..SamplingParams::default()
            };
            let mut sampler = AnySampler::new(params, kind).unwrap();
            counts[sampler.sample(&masked, &[]) as usize] += 1;
        }
        // Never a disallowed token.
        for (token, &count) in counts.iter().enumerate() {
            if !allowed.contains(&token) {
                assert_eq!(count, 0, "{kind:?}: disallowed token {token} drawn");
            }
        }
        // 4 degrees of freedom: P(chi2 > 23.5) = 1e-4.
        let statistic = chi_square(&counts, &target);
        assert!(
            statistic < 23.5,
            "{kind:?}: chi-square {statistic:.2} over {counts:?} against {target:?}"
        );
    }
}

#[test]
fn a_wrong_distribution_fails_the_same_test() {
    // The oracle can fail: uniform draws over the allowed tokens are far from the target.
    let target = [0.05, 0.10, 0.15, 0.30, 0.40];
    let counts = [4_000u64; 5];
    assert!(chi_square(&counts, &target) > 23.5);
}
