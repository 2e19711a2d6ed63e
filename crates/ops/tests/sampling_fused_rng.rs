//! Philox-4x32 against the Random123 known-answer vectors, the open-interval uniforms at
//! their extreme inputs, Gumbel pruning equivalence, and the fused sampler's determinism:
//! the same seed gives the same tokens whatever the batch order or thread.

use pagoda_ops::sampling::philox::{
    draw_block, draw_counter, key_from_seed, open_uniform_f32, open_uniform_f64_from_u32,
    open_uniform_f64_from_u64, philox4x32_10, philox4x32_rounds, DrawPurpose,
};
use pagoda_ops::sampling::{gumbel_argmax, gumbel_noise, FusedSampler, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One known answer: (rounds, counter, key, expected output).
type KnownAnswer = (u32, [u32; 4], [u32; 2], [u32; 4]);

/// Random123 `examples/kat_vectors` lines `philox4x32 R ctr[4] key[2] -> out[4]`.
const KAT: [KnownAnswer; 6] = [
    (
        10,
        [0, 0, 0, 0],
        [0, 0],
        [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
    ),
    (
        10,
        [u32::MAX; 4],
        [u32::MAX; 2],
        [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
    ),
    (
        10,
        [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
        [0xa4093822, 0x299f31d0],
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
    ),
    (
        7,
        [0, 0, 0, 0],
        [0, 0],
        [0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48],
    ),
    (
        7,
        [u32::MAX; 4],
        [u32::MAX; 2],
        [0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662],
    ),
    (
        7,
        [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
        [0xa4093822, 0x299f31d0],
        [0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a],
    ),
];

#[test]
fn philox_matches_random123_known_answers() {
    for (rounds, counter, key, expected) in KAT {
        assert_eq!(
            philox4x32_rounds(counter, key, rounds),
            expected,
            "philox4x32-{rounds} ctr {counter:08x?} key {key:08x?}"
        );
        if rounds == 10 {
            assert_eq!(philox4x32_10(counter, key), expected);
        }
    }
}

#[test]
fn counter_layout_and_key_split() {
    assert_eq!(
        key_from_seed(0x0123_4567_89ab_cdef),
        [0x89ab_cdef, 0x0123_4567]
    );
    assert_eq!(
        draw_counter(0x0000_0005_0000_0007, DrawPurpose::RejectionRound, 3),
        [3, 7, 5, DrawPurpose::RejectionRound as u32]
    );
    let key = key_from_seed(42);
    // Different purposes, steps and indices give different blocks.
    let gumbel = draw_block(key, 9, DrawPurpose::Gumbel, 0);
    assert_ne!(gumbel, draw_block(key, 9, DrawPurpose::RejectionRound, 0));
    assert_ne!(gumbel, draw_block(key, 10, DrawPurpose::Gumbel, 0));
    assert_ne!(gumbel, draw_block(key, 9, DrawPurpose::Gumbel, 1));
    assert_eq!(gumbel, draw_block(key, 9, DrawPurpose::Gumbel, 0));
}

#[test]
fn uniforms_stay_strictly_inside_the_unit_interval_at_the_extremes() {
    let f64_from_u32 = [
        open_uniform_f64_from_u32(0),
        open_uniform_f64_from_u32(u32::MAX),
    ];
    assert_eq!(f64_from_u32[0], 2f64.powi(-33));
    assert_eq!(f64_from_u32[1], 1.0 - 2f64.powi(-33));
    let f64_from_u64 = [
        open_uniform_f64_from_u64(0, 0),
        open_uniform_f64_from_u64(u32::MAX, u32::MAX),
    ];
    assert_eq!(f64_from_u64[0], 2f64.powi(-53));
    assert_eq!(f64_from_u64[1], 1.0 - 2f64.powi(-53));
    let f32_values = [open_uniform_f32(0), open_uniform_f32(u32::MAX)];
    assert_eq!(f32_values[0], 2f32.powi(-24));
    assert_eq!(f32_values[1], 1.0 - 2f32.powi(-24));
    for u in f64_from_u32.into_iter().chain(f64_from_u64) {
        assert!(u > 0.0 && u < 1.0 && (-(-u.ln()).ln()).is_finite(), "{u}");
    }
    for u in f32_values {
        assert!(u > 0.0 && u < 1.0 && (-(-u.ln()).ln()).is_finite(), "{u}");
    }
    // The pitfall the f32 form avoids: the 24-bit construction rounds to exactly 1.0.
    let buggy = ((u32::MAX >> 8) as f32 + 0.5) * 2f32.powi(-24);
    assert_eq!(buggy, 1.0);
    // Gumbel noise is finite and monotone at both ends.
    assert!(gumbel_noise(0).is_finite() && gumbel_noise(u32::MAX).is_finite());
    assert!(
        gumbel_noise(0) < gumbel_noise(1) && gumbel_noise(u32::MAX - 1) < gumbel_noise(u32::MAX)
    );
    assert!(gumbel_noise(u32::MAX) < 23.0 && gumbel_noise(0) > -3.2);
}

#[test]
fn pruned_gumbel_argmax_equals_the_full_pass() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for trial in 0..200u64 {
        let vocab = rng.random_range(1..3000usize);
        let spread = [0.5f32, 5.0, 40.0][trial as usize % 3];
        let mut z: Vec<f32> = (0..vocab)
            .map(|_| rng.random_range(-spread..spread))
            .collect();
        for _ in 0..vocab / 7 {
            let masked = rng.random_range(0..vocab);
            z[masked] = f32::NEG_INFINITY;
        }
        let z_max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if z_max == f32::NEG_INFINITY {
            continue;
        }
        let inverse_temperature = [1.0, 1.0 / 0.3, 1.0 / 1.7][trial as usize % 3];
        let key = key_from_seed(trial * 7919);
        for step in 0..5 {
            let full = gumbel_argmax(&z, z_max, inverse_temperature, key, step, false);
            let pruned = gumbel_argmax(&z, z_max, inverse_temperature, key, step, true);
            assert_eq!(full, pruned, "trial {trial} step {step}");
            assert!(z[full.unwrap() as usize] > f32::NEG_INFINITY);
        }
    }
}

fn request_params() -> Vec<SamplingParams> {
    let base = |temperature: f32| SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        ..SamplingParams::unfiltered(temperature)
    };
    vec![
        SamplingParams {
            seed: Some(1),
            ..base(1.0)
        },
        SamplingParams {
            seed: Some(2),
            top_k: 20,
            ..base(0.7)
        },
        SamplingParams {
            seed: Some(3),
            top_p: 0.8,
            ..base(1.3)
        },
        SamplingParams {
            seed: Some(4),
            min_p: 0.1,
            ..base(1.0)
        },
        SamplingParams {
            seed: Some(5),
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            ..base(0.9)
        },
        SamplingParams {
            seed: Some(6),
            ..SamplingParams::greedy()
        },
    ]
}

/// Row of request `request` at decode step `step` (depends on nothing else).
fn row(request: usize, step: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64((request * 1000 + step) as u64);
    (0..500).map(|_| rng.random_range(-4.0f32..4.0)).collect()
}

/// Decodes `steps` tokens for each request, visiting requests in `order` at every step.
fn decode(order: &[usize], steps: usize) -> Vec<Vec<u32>> {
    let params = request_params();
    let mut samplers: Vec<FusedSampler> = params
        .iter()
        .map(|&p| FusedSampler::new(p).unwrap())
        .collect();
    let mut histories = vec![Vec::new(); params.len()];
    for step in 0..steps {
        for &request in order {
            let token = samplers[request].sample(&row(request, step), &histories[request]);
            histories[request].push(token);
        }
    }
    histories
}

#[test]
fn same_seed_same_tokens_whatever_the_batch_order_or_thread() {
    let steps = 60;
    let forward = decode(&[0, 1, 2, 3, 4, 5], steps);
    let reversed = decode(&[5, 4, 3, 2, 1, 0], steps);
    assert_eq!(forward, reversed);
    // One thread per request, each with a fresh sampler.
    let threaded: Vec<Vec<u32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = request_params()
            .into_iter()
            .enumerate()
            .map(|(request, params)| {
                scope.spawn(move || {
                    let mut sampler = FusedSampler::new(params).unwrap();
                    let mut history = Vec::new();
                    for step in 0..steps {
                        let token = sampler.sample(&row(request, step), &history);
                        history.push(token);
                    }
                    history
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(forward, threaded);
    // The streams are not degenerate: stochastic requests do not repeat one token.
    for history in &forward[..5] {
        let distinct: std::collections::HashSet<_> = history.iter().collect();
        assert!(distinct.len() > 5, "{history:?}");
    }
    // A different seed changes the stream.
    let mut other = FusedSampler::new(SamplingParams {
        seed: Some(99),
        ..request_params()[0]
    })
    .unwrap();
    let mut history = Vec::new();
    for step in 0..steps {
        let token = other.sample(&row(0, step), &history);
        history.push(token);
    }
    assert_ne!(history, forward[0]);
}

/// The vectorised, chunked `gumbel_argmax` against a plain scalar loop over the documented
/// definition (score `(z - z_max) * (1/T)` in f32 plus `gumbel_noise` of word `i % 4` of block
/// `i / 4`; lowest index on ties; `-inf` never wins), on ragged lengths, masked entries and
/// rows of ties.
#[test]
fn gumbel_argmax_equals_a_scalar_loop_over_its_definition() {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for trial in 0..300u64 {
        let vocab = rng.random_range(1..700usize);
        let mut z: Vec<f32> = match trial % 3 {
            0 => (0..vocab).map(|_| rng.random_range(-6.0f32..6.0)).collect(),
            1 => (0..vocab).map(|_| rng.random_range(0..3) as f32).collect(),
            _ => vec![1.5; vocab],
        };
        for _ in 0..vocab / 5 {
            let masked = rng.random_range(0..vocab);
            z[masked] = f32::NEG_INFINITY;
        }
        let z_max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if z_max == f32::NEG_INFINITY {
            continue;
        }
        let inverse_temperature = [1.0f64, 1.0 / 0.3, 1.0 / 1.7][trial as usize % 3];
        let key = key_from_seed(trial);
        for step in 0..3 {
            let mut expected: Option<(u32, f32)> = None;
            for (index, &logit) in z.iter().enumerate() {
                if logit == f32::NEG_INFINITY {
                    continue;
                }
                let word =
                    draw_block(key, step, DrawPurpose::Gumbel, (index / 4) as u32)[index % 4];
                let score = (logit - z_max) * inverse_temperature as f32 + gumbel_noise(word);
                if expected.is_none_or(|(_, best)| score > best) {
                    expected = Some((index as u32, score));
                }
            }
            for prune in [false, true] {
                let actual = gumbel_argmax(&z, z_max, inverse_temperature, key, step, prune);
                assert_eq!(
                    actual,
                    expected.map(|(token, _)| token),
                    "trial {trial} step {step}"
                );
            }
        }
    }
}
