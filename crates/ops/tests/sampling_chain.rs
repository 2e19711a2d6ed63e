//! Deterministic tests of the canonical sampling chain: hand-computed distributions, a
//! brute-force O(V^2) oracle written straight from the definitions, penalties, validation,
//! greedy, the inverse CDF and the log-probability helpers.

use pagoda_ops::sampling::{
    apply_penalties, effective_distribution, inverse_cdf, log_softmax, top_logprobs, uniform_f64,
    Sampler, SamplingParams,
};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

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

fn assert_distribution(actual: &[f64], expected: &[f64], tolerance: f64) {
    assert_eq!(actual.len(), expected.len());
    for (token, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= tolerance,
            "token {token}: got {a}, expected {e}\nactual {actual:?}\nexpected {expected:?}"
        );
    }
}

fn normalized(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// A 4-token row whose untempered probabilities are exactly 0.5, 0.25, 0.15, 0.10.
fn four_token_row() -> Vec<f32> {
    [0.5f64, 0.25, 0.15, 0.10]
        .iter()
        .map(|p| p.ln() as f32)
        .collect()
}

#[test]
fn hand_computed_distributions_on_a_four_token_row() {
    let row = four_token_row();
    let tolerance = 1e-6; // f32 logits of ln(p)
    let cases: Vec<(&str, SamplingParams, Vec<f64>)> = vec![
        (
            "no filters T=1",
            params(1.0, 0, 1.0, 0.0),
            vec![0.5, 0.25, 0.15, 0.10],
        ),
        // p^(1/T) = p^2 = .25, .0625, .0225, .01
        (
            "no filters T=0.5",
            params(0.5, 0, 1.0, 0.0),
            normalized(&[0.25, 0.0625, 0.0225, 0.01]),
        ),
        (
            "top_k 2",
            params(1.0, 2, 1.0, 0.0),
            vec![2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0],
        ),
        // masses above tokens: 0, .5, .75, .9 ; keep if < .7
        (
            "top_p 0.7",
            params(1.0, 0, 0.7, 0.0),
            vec![2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0],
        ),
        // keep if mass above < .8: tokens 0, 1, 2
        (
            "top_p 0.8",
            params(1.0, 0, 0.8, 0.0),
            normalized(&[0.5, 0.25, 0.15, 0.0]),
        ),
        // top-k 3 renormalises to Z=.9: masses above / .9 = 0, .556, .833 -> token 2 dropped
        // (a joint, un-renormalised test would keep it: .75 < .8)
        (
            "top_k 3 + top_p 0.8",
            params(1.0, 3, 0.8, 0.0),
            vec![2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0],
        ),
        // min-p .29: keep p >= .145 ; min-p .31: keep p >= .155 (.3 would sit on p2 = .15)
        (
            "min_p 0.29",
            params(1.0, 0, 1.0, 0.29),
            normalized(&[0.5, 0.25, 0.15, 0.0]),
        ),
        (
            "min_p 0.31",
            params(1.0, 0, 1.0, 0.31),
            vec![2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0],
        ),
        // Filters on the UNtempered row: top_p .8 keeps {0,1,2}, then T=0.5 squares them.
        // Filtering the tempered row (.725,.181,.065,.029) would have kept only {0,1}.
        (
            "top_p 0.8 at T=0.5",
            params(0.5, 0, 0.8, 0.0),
            normalized(&[0.25, 0.0625, 0.0225, 0.0]),
        ),
        // min-p .29 keeps {0,1,2} untempered; tempered at T=0.5 p2/p0 = .09 < .29 would drop 2.
        (
            "min_p 0.29 at T=0.5",
            params(0.5, 0, 1.0, 0.29),
            normalized(&[0.25, 0.0625, 0.0225, 0.0]),
        ),
        // T=2 on {0,1}: sqrt weights
        (
            "top_k 2 at T=2",
            params(2.0, 2, 1.0, 0.0),
            normalized(&[0.5f64.sqrt(), 0.25f64.sqrt(), 0.0, 0.0]),
        ),
        ("greedy", SamplingParams::greedy(), vec![1.0, 0.0, 0.0, 0.0]),
        (
            "top_k 1 is greedy",
            params(1.0, 1, 1.0, 0.0),
            vec![1.0, 0.0, 0.0, 0.0],
        ),
        // Defaults: top-k 40 (off for V=4), top-p .95 keeps all (mass above token 3 = .9),
        // min-p .05 keeps p >= .025: all; T=0.8 -> p^1.25
        (
            "defaults",
            SamplingParams::default(),
            normalized(&[
                0.5f64.powf(1.25),
                0.25f64.powf(1.25),
                0.15f64.powf(1.25),
                0.1f64.powf(1.25),
            ]),
        ),
    ];
    for (name, sampling_params, expected) in cases {
        sampling_params.validate().unwrap();
        let actual = effective_distribution(&row, &[], &sampling_params);
        println!("{name}: {actual:?}");
        assert_distribution(&actual, &expected, tolerance);
    }
}

#[test]
fn ties_masks_and_degenerate_rows() {
    let e = std::f64::consts::E;
    // top-k 2 on [2, 1, 1, 0]: the tie at the boundary is kept whole.
    let tied = [2.0f32, 1.0, 1.0, 0.0];
    let actual = effective_distribution(&tied, &[], &params(1.0, 2, 1.0, 0.0));
    assert_distribution(&actual, &normalized(&[e * e, e, e, 0.0]), 1e-12);
    // top-p keeps the whole tie group at its boundary: masses above: 0, p0, p0 (tie), ...
    let actual = effective_distribution(&tied, &[], &params(1.0, 0, 0.6, 0.0));
    let p0 = e * e / (e * e + 2.0 * e + 1.0);
    assert!(p0 < 0.6);
    assert_distribution(&actual, &normalized(&[e * e, e, e, 0.0]), 1e-12);
    // Greedy ties: lowest id wins.
    let flat = [1.0f32, 3.0, 3.0, 0.0];
    assert_distribution(
        &effective_distribution(&flat, &[], &SamplingParams::greedy()),
        &[0.0, 1.0, 0.0, 0.0],
        0.0,
    );
    // -inf and NaN are never in the support.
    let masked = [0.0f32, NEG_INF, 0.0, f32::NAN];
    let actual = effective_distribution(&masked, &[], &params(1.3, 0, 1.0, 0.0));
    assert_distribution(&actual, &[0.5, 0.0, 0.5, 0.0], 1e-15);
    // +inf is certain (treated as f32::MAX), shared between such tokens.
    let infinite = [0.0f32, f32::INFINITY, 5.0, f32::INFINITY];
    let actual = effective_distribution(&infinite, &[], &params(0.7, 0, 0.9, 0.1));
    assert_distribution(&actual, &[0.0, 0.5, 0.0, 0.5], 1e-15);
    // An all-masked row degenerates to token 0, greedy or not; an empty row to nothing.
    let all_masked = [NEG_INF; 3];
    for sampling_params in [SamplingParams::default(), SamplingParams::greedy()] {
        assert_eq!(
            effective_distribution(&all_masked, &[], &sampling_params),
            vec![1.0, 0.0, 0.0]
        );
        assert!(effective_distribution(&[], &[], &sampling_params).is_empty());
        let mut sampler = Sampler::new(SamplingParams {
            seed: Some(1),
            ..sampling_params
        })
        .unwrap();
        assert_eq!(sampler.sample(&all_masked, &[]), 0);
    }
}

#[test]
fn penalties_match_hand_computed_logits() {
    let mut logits = [2.0f32, -1.0, 0.5, 3.0, NEG_INF, 1.0];
    // Window = last 6 tokens: [1, 1, 3, 3, 3, 2] (the leading 0 and 5 fall outside; 99 is out
    // of the row and ignored).
    let history = [0u32, 5, 99, 1, 1, 3, 3, 3, 2];
    let sampling_params = SamplingParams {
        repetition_penalty: 2.0,
        frequency_penalty: 0.5,
        presence_penalty: 0.25,
        penalty_last_n: 7, // includes the 99
        ..SamplingParams::greedy()
    };
    apply_penalties(&mut logits, &history, &sampling_params);
    // token 1: count 2, -1 * 2 - (2 * .5 + .25) = -3.25
    // token 2: count 1, .5 / 2 - (.5 + .25) = -.5
    // token 3: count 3, 3 / 2 - (1.5 + .25) = -.25
    assert_eq!(logits, [2.0, -3.25, -0.5, -0.25, NEG_INF, 1.0]);

    // penalty_last_n = 0 and neutral values change nothing.
    for neutral in [
        SamplingParams {
            penalty_last_n: 0,
            ..sampling_params
        },
        SamplingParams::greedy(),
    ] {
        let mut unchanged = [2.0f32, -1.0, 0.5];
        apply_penalties(&mut unchanged, &[0, 1, 2, 2], &neutral);
        assert_eq!(unchanged, [2.0, -1.0, 0.5]);
    }

    // The chain penalises before greedy: raw argmax is 3, penalised argmax is 0.
    let raw = [2.0f32, -1.0, 0.5, 3.0, NEG_INF, 1.0];
    let distribution = effective_distribution(&raw, &history, &sampling_params);
    assert_eq!(distribution, vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    // And before the filters: penalised [2, -3.25, -.5, -.25, -inf, 1], top-k 2 keeps {0, 5}.
    let filtered = SamplingParams {
        temperature: 1.0,
        top_k: 2,
        ..sampling_params
    };
    let distribution = effective_distribution(&raw, &history, &filtered);
    let e = std::f64::consts::E;
    assert_distribution(
        &distribution,
        &normalized(&[e * e, 0.0, 0.0, 0.0, 0.0, e]),
        1e-12,
    );
}

#[test]
fn greedy_ignores_seed_and_matches_argmax() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut samplers: Vec<Sampler> = [1u64, 2, 99]
        .iter()
        .map(|&seed| {
            Sampler::new(SamplingParams {
                seed: Some(seed),
                ..SamplingParams::greedy()
            })
            .unwrap()
        })
        .collect();
    samplers.push(
        Sampler::new(SamplingParams {
            top_k: 1,
            temperature: 1.0,
            ..SamplingParams::default()
        })
        .unwrap(),
    );
    for _ in 0..200 {
        let logits: Vec<f32> = (0..300).map(|_| rng.random_range(-5.0f32..5.0)).collect();
        let naive = logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                if v > bv {
                    (i, v)
                } else {
                    (bi, bv)
                }
            })
            .0 as u32;
        for sampler in &mut samplers {
            assert_eq!(sampler.sample(&logits, &[]), naive);
        }
    }
}

#[test]
fn validate_rejects_bad_params_naming_the_field() {
    assert!(SamplingParams::default().validate().is_ok());
    assert!(SamplingParams::greedy().validate().is_ok());
    let base = SamplingParams::default();
    let bad: Vec<(&str, SamplingParams)> = vec![
        (
            "temperature",
            SamplingParams {
                temperature: -0.1,
                ..base
            },
        ),
        (
            "temperature",
            SamplingParams {
                temperature: f32::NAN,
                ..base
            },
        ),
        (
            "temperature",
            SamplingParams {
                temperature: 1e6,
                ..base
            },
        ),
        ("top_p", SamplingParams { top_p: 0.0, ..base }),
        ("top_p", SamplingParams { top_p: 1.5, ..base }),
        (
            "top_p",
            SamplingParams {
                top_p: f32::NAN,
                ..base
            },
        ),
        (
            "min_p",
            SamplingParams {
                min_p: -0.1,
                ..base
            },
        ),
        ("min_p", SamplingParams { min_p: 1.1, ..base }),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: 0.0,
                ..base
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: -1.0,
                ..base
            },
        ),
        (
            "repetition_penalty",
            SamplingParams {
                repetition_penalty: f32::INFINITY,
                ..base
            },
        ),
        (
            "frequency_penalty",
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..base
            },
        ),
        (
            "frequency_penalty",
            SamplingParams {
                frequency_penalty: 1e3,
                ..base
            },
        ),
        (
            "presence_penalty",
            SamplingParams {
                presence_penalty: f32::NEG_INFINITY,
                ..base
            },
        ),
    ];
    for (field, sampling_params) in bad {
        let error = sampling_params.validate().expect_err(field);
        assert_eq!(error.field, field, "{error}");
        assert!(error.to_string().starts_with(field), "{field}: {error}");
        let error = Sampler::new(sampling_params).expect_err(field);
        assert_eq!(error.field, field, "{error}");
    }
}

/// An RNG that always returns the same word, to drive `uniform_f64` to its extremes.
struct ConstantRng(u64);

impl RngCore for ConstantRng {
    fn next_u32(&mut self) -> u32 {
        self.0 as u32
    }
    fn next_u64(&mut self) -> u64 {
        self.0
    }
    fn fill_bytes(&mut self, destination: &mut [u8]) {
        destination.fill(self.0 as u8);
    }
}

#[test]
fn uniform_never_reaches_one_and_inverse_cdf_never_picks_zero_mass() {
    assert_eq!(uniform_f64(&mut ConstantRng(0)), 0.0);
    let largest = uniform_f64(&mut ConstantRng(u64::MAX));
    assert!(largest < 1.0);
    assert_eq!(largest, 1.0 - 2f64.powi(-53));

    let weights = [0.0, 1.0, 0.0, 2.0, 0.0];
    assert_eq!(inverse_cdf(&weights, 0.0), Some(1));
    assert_eq!(inverse_cdf(&weights, largest), Some(3));
    for step in 0..=1000 {
        let uniform = (step as f64 / 1000.0).min(largest);
        let index = inverse_cdf(&weights, uniform).unwrap();
        assert!(
            weights[index] > 0.0,
            "uniform {uniform} picked zero-weight {index}"
        );
    }
    // Rounding can leave u * total >= the running sum: still a positive-weight index.
    let awkward = [0.1, 0.2, 0.7, 0.0, 0.0];
    for uniform in [largest, 1.0 - 2f64.powi(-52), 0.9999999999999999] {
        assert!(awkward[inverse_cdf(&awkward, uniform).unwrap()] > 0.0);
    }
    assert_eq!(inverse_cdf(&[0.0, 0.0], 0.5), None);
    assert_eq!(inverse_cdf(&[], 0.5), None);
}

#[test]
fn log_softmax_matches_naive_and_is_stable() {
    let logits = [1.0f32, 2.0, 3.0, NEG_INF];
    let naive_total: f64 = [1.0f64, 2.0, 3.0].iter().map(|x| x.exp()).sum();
    let actual = log_softmax(&logits);
    for i in 0..3 {
        let naive = ((i as f64 + 1.0).exp() / naive_total).ln();
        assert!((actual[i] as f64 - naive).abs() < 1e-6, "{actual:?}");
    }
    assert_eq!(actual[3], NEG_INF);
    // Shift invariance at magnitudes where a naive exp overflows.
    let shifted: Vec<f32> = logits.iter().map(|l| l + 1000.0).collect();
    let shifted_result = log_softmax(&shifted);
    for i in 0..3 {
        assert!(
            (shifted_result[i] - actual[i]).abs() < 1e-4,
            "{shifted_result:?}"
        );
    }
    let total: f64 = log_softmax(&[-5000.0f32, 0.5, 7.0, 7.0])
        .iter()
        .map(|&l| (l as f64).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-6);
    assert_eq!(log_softmax(&[NEG_INF, NEG_INF]), vec![NEG_INF, NEG_INF]);
    assert!(log_softmax(&[]).is_empty());
}

#[test]
fn top_logprobs_sorted_descending_with_ties_by_id() {
    let logits = [0.0f32, 2.0, 1.0, 2.0, NEG_INF, 1.0];
    let full = log_softmax(&logits);
    let top = top_logprobs(&logits, 4);
    let ids: Vec<u32> = top.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, vec![1, 3, 2, 5]);
    for &(id, logprob) in &top {
        assert_eq!(logprob, full[id as usize]);
    }
    let all = top_logprobs(&logits, 100);
    assert_eq!(
        all.iter().map(|&(id, _)| id).collect::<Vec<_>>(),
        vec![1, 3, 2, 5, 0, 4]
    );
    assert!(top_logprobs(&logits, 0).is_empty());
}
