//! DeepSeek's router (`pagoda_ops::moe::route_with`) against a straightforward float64
//! transcription of DeepSeek's gate (`MoEGate` of its V2/V3 modelling code): scores,
//! selection scores, group scores, masked top-k by repeated argmax, weights.

use pagoda_ops::moe::{route_with, GroupLimit, GroupScore, Renormalize, Router, Scoring};

/// One row's picks and weights, the slow way.
fn reference(logits: &[f32], router: &Router<'_>) -> (Vec<u32>, Vec<f64>) {
    let n = router.num_experts;
    let logits: Vec<f64> = logits.iter().map(|&l| l as f64).collect();
    let scores: Vec<f64> = match router.scoring {
        Scoring::Softmax => {
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            logits.iter().map(|l| (l - max).exp() / total).collect()
        }
        Scoring::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let mut choice: Vec<f64> = (0..n)
        .map(|e| scores[e] + router.selection_bias.map_or(0.0, |b| b[e] as f64))
        .collect();
    if let Some(limit) = router.group_limit {
        let size = n / limit.num_groups;
        let group_scores: Vec<f64> = (0..limit.num_groups)
            .map(|g| {
                let mut members: Vec<f64> = choice[g * size..(g + 1) * size].to_vec();
                members.sort_by(|a, b| b.total_cmp(a));
                match limit.score {
                    GroupScore::Max => members[0],
                    GroupScore::TopTwoSum => members.iter().take(2).sum(),
                }
            })
            .collect();
        let kept = argmax_k(&group_scores, limit.groups_per_row);
        for e in 0..n {
            if !kept.contains(&(e / size)) {
                choice[e] = f64::NEG_INFINITY;
            }
        }
    }
    let picked = argmax_k(&choice, router.top_k);
    let mut weights: Vec<f64> = picked.iter().map(|&e| scores[e]).collect();
    if router.renormalize == Renormalize::Yes {
        let sum: f64 = weights.iter().sum::<f64>();
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= router.scale as f64);
    (picked.iter().map(|&e| e as u32).collect(), weights)
}

/// The `k` best indices by repeated argmax (the first maximum wins).
fn argmax_k(values: &[f64], k: usize) -> Vec<usize> {
    let mut taken = vec![false; values.len()];
    (0..k)
        .map(|_| {
            let mut best = None;
            for (i, &v) in values.iter().enumerate() {
                if !taken[i] && best.is_none_or(|b: usize| v > values[b]) {
                    best = Some(i);
                }
            }
            let best = best.unwrap();
            taken[best] = true;
            best
        })
        .collect()
}

/// Deterministic pseudo-random logits in [-3, 3).
fn logits(rows: usize, experts: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..rows * experts)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 6.0 - 3.0
        })
        .collect()
}

fn check_against_reference(logits: &[f32], router: &Router<'_>) {
    let routing = route_with(logits, router);
    for (r, row) in logits.chunks_exact(router.num_experts).enumerate() {
        let (experts, weights) = reference(row, router);
        let k = router.top_k;
        assert_eq!(routing.experts[r * k..(r + 1) * k], experts, "row {r}");
        for (got, want) in routing.weights[r * k..(r + 1) * k].iter().zip(&weights) {
            assert!(
                (*got as f64 - want).abs() < 1e-6 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
    }
}

#[test]
fn deepseek_v2_softmax_group_max_and_scaling_match_the_reference() {
    for (renormalize, scale) in [(Renormalize::No, 16.0), (Renormalize::Yes, 1.0)] {
        let router = Router {
            num_experts: 16,
            top_k: 3,
            scoring: Scoring::Softmax,
            renormalize,
            group_limit: Some(GroupLimit {
                num_groups: 4,
                groups_per_row: 2,
                score: GroupScore::Max,
            }),
            selection_bias: None,
            scale,
        };
        check_against_reference(&logits(40, 16, 1), &router);
    }
}

#[test]
fn deepseek_v3_sigmoid_bias_and_top_two_groups_match_the_reference() {
    let bias: Vec<f32> = (0..16).map(|e| ((e * 5) % 7) as f32 * 0.1 - 0.3).collect();
    let router = Router {
        num_experts: 16,
        top_k: 4,
        scoring: Scoring::Sigmoid,
        renormalize: Renormalize::Yes,
        group_limit: Some(GroupLimit {
            num_groups: 8,
            groups_per_row: 3,
            score: GroupScore::TopTwoSum,
        }),
        selection_bias: Some(&bias),
        scale: 2.5,
    };
    check_against_reference(&logits(40, 16, 2), &router);
    // Without groups or bias, plain sigmoid top-k.
    let plain = Router {
        group_limit: None,
        selection_bias: None,
        renormalize: Renormalize::No,
        scale: 1.0,
        ..router
    };
    check_against_reference(&logits(40, 16, 3), &plain);
}

#[test]
fn the_bias_chooses_but_does_not_weigh() {
    // Expert 0 has the higher score, expert 1 the bias that makes it chosen.
    let bias = [0.0, 1.0, 0.0];
    let router = Router {
        num_experts: 3,
        top_k: 1,
        scoring: Scoring::Sigmoid,
        renormalize: Renormalize::No,
        group_limit: None,
        selection_bias: Some(&bias),
        scale: 1.0,
    };
    let routing = route_with(&[2.0, 0.0, -1.0], &router);
    assert_eq!(routing.experts, [1]);
    assert!(
        (routing.weights[0] - 0.5).abs() < 1e-7,
        "{:?}",
        routing.weights
    );
}

#[test]
fn a_group_limit_excludes_the_best_expert_of_a_weak_group() {
    // Groups {0,1}, {2,3}: expert 0 is the single best, but group 1's top two sum higher.
    let router = Router {
        num_experts: 4,
        top_k: 2,
        scoring: Scoring::Sigmoid,
        renormalize: Renormalize::Yes,
        group_limit: Some(GroupLimit {
            num_groups: 2,
            groups_per_row: 1,
            score: GroupScore::TopTwoSum,
        }),
        selection_bias: None,
        scale: 1.0,
    };
    let routing = route_with(&[3.0, -3.0, 2.0, 2.0], &router);
    assert_eq!(routing.experts, [2, 3]);
    assert_eq!(routing.rows_of(0).0, &[] as &[u32]);
    // With max scores group 0 wins instead.
    let max = Router {
        group_limit: Some(GroupLimit {
            score: GroupScore::Max,
            ..router.group_limit.unwrap()
        }),
        ..router
    };
    assert_eq!(route_with(&[3.0, -3.0, 2.0, 2.0], &max).experts, [0, 1]);
}

#[test]
fn tied_groups_and_experts_go_to_the_lower_index() {
    let router = Router {
        num_experts: 6,
        top_k: 2,
        scoring: Scoring::Softmax,
        renormalize: Renormalize::Yes,
        group_limit: Some(GroupLimit {
            num_groups: 3,
            groups_per_row: 1,
            score: GroupScore::Max,
        }),
        selection_bias: None,
        scale: 1.0,
    };
    // Every group ties: group 0 is kept, its two experts tie too.
    let routing = route_with(&[1.0; 6], &router);
    assert_eq!(routing.experts, [0, 1]);
    assert_eq!(routing.weights, [0.5, 0.5]);
    // Every row to the same experts: those are full, the others empty.
    let rows: Vec<f32> = (0..5)
        .flat_map(|_| [0.0, 0.0, 5.0, 4.0, 0.0, 0.0])
        .collect();
    let routing = route_with(&rows, &router);
    assert_eq!(routing.rows_of(2).0, [0, 1, 2, 3, 4]);
    assert_eq!(routing.rows_of(3).0, [0, 1, 2, 3, 4]);
    for expert in [0, 1, 4, 5] {
        assert!(routing.rows_of(expert).0.is_empty());
    }
}
