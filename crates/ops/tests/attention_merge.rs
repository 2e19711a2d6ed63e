//! The LSE merge against a direct softmax over the concatenated scores, associativity
//! across regroupings, and `-inf`/NaN partials that must never leak.

use pagoda_ops::attention::{merge_states, AttentionError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const NUM_HEADS: usize = 3;
const HEAD_DIM: usize = 8;

/// Random scores (log2 units) and values for `num_tokens` tokens of `NUM_HEADS` heads.
struct Tokens {
    scores: Vec<Vec<f64>>,             // [head][token]
    values: Vec<Vec<[f64; HEAD_DIM]>>, // [head][token]
}

fn tokens(num_tokens: usize, seed: u64) -> Tokens {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let scores = (0..NUM_HEADS)
        .map(|_| {
            (0..num_tokens)
                .map(|_| rng.random_range(-20.0..20.0))
                .collect()
        })
        .collect();
    let values = (0..NUM_HEADS)
        .map(|_| {
            (0..num_tokens)
                .map(|_| std::array::from_fn(|_| rng.random_range(-1.0..1.0)))
                .collect()
        })
        .collect();
    Tokens { scores, values }
}

/// Exact (f64) normalized output and log2 LSE over tokens `range`, as one partial row.
fn partial(tokens: &Tokens, range: std::ops::Range<usize>) -> (Vec<f32>, Vec<f32>) {
    let mut v = Vec::new();
    let mut lse = Vec::new();
    for head in 0..NUM_HEADS {
        let scores = &tokens.scores[head][range.clone()];
        if scores.is_empty() {
            v.extend([0.0f32; HEAD_DIM]);
            lse.push(f32::NEG_INFINITY);
            continue;
        }
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp2()).collect();
        let total: f64 = weights.iter().sum();
        for dim in 0..HEAD_DIM {
            let weighted: f64 = weights
                .iter()
                .zip(&tokens.values[head][range.clone()])
                .map(|(w, v)| w * v[dim])
                .sum();
            v.push((weighted / total) as f32);
        }
        lse.push((max + total.log2()) as f32);
    }
    (v, lse)
}

/// Partials for consecutive token ranges cut at `cuts`, stacked `[N, H, D]` / `[N, H]`.
fn partials(tokens: &Tokens, cuts: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let (mut v, mut lse) = (Vec::new(), Vec::new());
    for window in cuts.windows(2) {
        let (pv, pl) = partial(tokens, window[0]..window[1]);
        v.extend(pv);
        lse.extend(pl);
    }
    (v, lse)
}

fn assert_close(what: &str, actual: &[f32], expected: &[f32], tolerance: f32) {
    assert_eq!(actual.len(), expected.len());
    for (index, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!((a - e).abs() <= tolerance, "{what}[{index}]: {a} vs {e}");
    }
}

#[test]
fn merging_chunks_equals_softmax_over_all_tokens() {
    let tokens = tokens(40, 1);
    let (full_v, full_lse) = partial(&tokens, 0..40);
    let cuts = [0, 3, 4, 17, 30, 40];
    let (v, lse) = partials(&tokens, &cuts);
    let merged = merge_states(&v, &lse, &[0, 5], NUM_HEADS, HEAD_DIM).unwrap();
    assert_close("v", &merged.v, &full_v, 1e-5);
    assert_close("lse", &merged.lse, &full_lse, 1e-4);
}

#[test]
fn merge_is_associative_across_regroupings() {
    let tokens = tokens(60, 2);
    let cuts = [0, 7, 10, 25, 26, 44, 60];
    let (v, lse) = partials(&tokens, &cuts);
    let all_at_once = merge_states(&v, &lse, &[0, 6], NUM_HEADS, HEAD_DIM).unwrap();
    for grouping in [
        vec![0u32, 2, 4, 6],
        vec![0, 1, 5, 6],
        vec![0, 3, 6],
        vec![0, 1, 2, 3, 4, 5, 6],
    ] {
        let first = merge_states(&v, &lse, &grouping, NUM_HEADS, HEAD_DIM).unwrap();
        let groups = grouping.len() as u32 - 1;
        let second = merge_states(&first.v, &first.lse, &[0, groups], NUM_HEADS, HEAD_DIM).unwrap();
        assert_close(&format!("v {grouping:?}"), &second.v, &all_at_once.v, 1e-5);
        assert_close(
            &format!("lse {grouping:?}"),
            &second.lse,
            &all_at_once.lse,
            1e-4,
        );
    }
    // Commutative: reversing the partial order changes nothing.
    let row = NUM_HEADS * HEAD_DIM;
    let reversed_v: Vec<f32> = v.chunks(row).rev().flatten().copied().collect();
    let reversed_lse: Vec<f32> = lse.chunks(NUM_HEADS).rev().flatten().copied().collect();
    let reversed = merge_states(&reversed_v, &reversed_lse, &[0, 6], NUM_HEADS, HEAD_DIM).unwrap();
    assert_close("reversed", &reversed.v, &all_at_once.v, 1e-5);
}

#[test]
fn empty_and_nan_partials_are_skipped_and_never_leak() {
    let tokens = tokens(20, 3);
    let (v, lse) = partials(&tokens, &[0, 9, 20]);
    let clean = merge_states(&v, &lse, &[0, 2], NUM_HEADS, HEAD_DIM).unwrap();
    // Insert a -inf partial with NaN values and a NaN-LSE partial between the real ones.
    let row = NUM_HEADS * HEAD_DIM;
    let mut dirty_v = v[..row].to_vec();
    dirty_v.extend(vec![f32::NAN; 2 * row]);
    dirty_v.extend(&v[row..]);
    let mut dirty_lse = lse[..NUM_HEADS].to_vec();
    dirty_lse.extend([f32::NEG_INFINITY; NUM_HEADS]);
    dirty_lse.extend([f32::NAN; NUM_HEADS]);
    dirty_lse.extend(&lse[NUM_HEADS..]);
    // Row 0: the real partials plus the junk; row 1: junk only; row 2: no partials at all.
    let mut v_in = dirty_v.clone();
    v_in.extend(vec![f32::NAN; row]);
    let mut lse_in = dirty_lse.clone();
    lse_in.extend([f32::NEG_INFINITY; NUM_HEADS]);
    let merged = merge_states(&v_in, &lse_in, &[0, 4, 5, 5], NUM_HEADS, HEAD_DIM).unwrap();
    assert_close("row with junk", &merged.v[..row], &clean.v, 0.0);
    assert_eq!(merged.lse[..NUM_HEADS], clean.lse[..]);
    assert!(
        merged.v[row..].iter().all(|&x| x == 0.0),
        "empty rows must be zeros"
    );
    assert!(merged.lse[NUM_HEADS..]
        .iter()
        .all(|&x| x == f32::NEG_INFINITY));
    // Chaining a -inf output row into another merge is still harmless.
    let chained = merge_states(&merged.v, &merged.lse, &[0, 3], NUM_HEADS, HEAD_DIM).unwrap();
    assert_close("chained", &chained.v, &clean.v, 1e-6);
}

#[test]
fn malformed_merge_inputs_are_errors() {
    let v = vec![0.0; 2 * NUM_HEADS * HEAD_DIM];
    let lse = vec![0.0; 2 * NUM_HEADS];
    for o_indptr in [vec![0u32, 3], vec![1, 2], vec![0, 2, 1], vec![]] {
        let error = merge_states(&v, &lse, &o_indptr, NUM_HEADS, HEAD_DIM).unwrap_err();
        assert!(
            matches!(
                error,
                AttentionError::Indptr {
                    what: "o_indptr",
                    ..
                }
            ),
            "{error}"
        );
    }
    let error = merge_states(&v[1..], &lse, &[0, 2], NUM_HEADS, HEAD_DIM).unwrap_err();
    assert!(matches!(error, AttentionError::Length { .. }), "{error}");
    assert!(merge_states(&v, &lse, &[0, 2], 0, HEAD_DIM).is_err());
}
