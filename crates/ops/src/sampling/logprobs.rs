//! Log-probabilities for the API layer (`logprobs` / `top_logprobs`).

use super::chain::sanitize_logit;

/// Numerically stable log-softmax of one logit row: `x_i - max - ln(sum_j exp(x_j - max))`,
/// accumulated in f64, returned in f32 (same length as `logits`). `-inf` (and NaN, treated as
/// masked) gives `-inf`; `+inf` is treated as `f32::MAX`. A row with no finite logit gives all
/// `-inf` (no token has probability).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits
        .iter()
        .map(|&logit| sanitize_logit(logit) as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return vec![f32::NEG_INFINITY; logits.len()];
    }
    let sum: f64 = logits
        .iter()
        .map(|&logit| (sanitize_logit(logit) as f64 - max).exp())
        .sum();
    let log_normalizer = max + sum.ln();
    logits
        .iter()
        .map(|&logit| (sanitize_logit(logit) as f64 - log_normalizer) as f32)
        .collect()
}

/// The `n` most probable tokens of one logit row as `(token id, log-probability)`, sorted by
/// log-probability descending, ties by lower id. Returns `min(n, logits.len())` entries
/// (masked tokens included, with `-inf`, if `n` reaches into them).
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let log_probabilities = log_softmax(logits);
    let order = |a: &u32, b: &u32| {
        log_probabilities[*b as usize]
            .total_cmp(&log_probabilities[*a as usize])
            .then(a.cmp(b))
    };
    let mut tokens: Vec<u32> = (0..logits.len() as u32).collect();
    let count = n.min(tokens.len());
    if count == 0 {
        return Vec::new();
    }
    if count < tokens.len() {
        tokens.select_nth_unstable_by(count - 1, order);
        tokens.truncate(count);
    }
    tokens.sort_unstable_by(order);
    tokens
        .into_iter()
        .map(|token| (token, log_probabilities[token as usize]))
        .collect()
}
