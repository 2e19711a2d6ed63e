//! Stage 1 of the chain: repetition, frequency and presence penalties on the raw logits.

use super::params::SamplingParams;

/// Applies the three penalties in place to `logits` (one row, length = vocabulary size), from
/// the last `params.penalty_last_n` tokens of `history` (oldest first).
///
/// For every distinct token `t` occurring `count > 0` times in that window, in f32 exactly as
/// llama.cpp's `llama_sampler_penalties_apply` does:
/// 1. repetition: `logit /= repetition_penalty` if `logit > 0`, else `logit *= repetition_penalty`;
/// 2. then `logit -= count * frequency_penalty + presence_penalty` (the OpenAI rule).
///
/// Tokens never seen are untouched; `-inf` stays `-inf`. History ids outside the row
/// (`>= logits.len()`) have no logit to penalise and are ignored.
pub fn apply_penalties(logits: &mut [f32], history: &[u32], params: &SamplingParams) {
    let mut window_scratch = Vec::new();
    apply_penalties_with_scratch(logits, history, params, &mut window_scratch);
}

/// [`apply_penalties`] with a caller-owned scratch buffer (reused across decode steps so the
/// per-step path allocates nothing once the buffer has grown to the window size).
pub(crate) fn apply_penalties_with_scratch(
    logits: &mut [f32],
    history: &[u32],
    params: &SamplingParams,
    window_scratch: &mut Vec<u32>,
) {
    if !params.has_penalties() {
        return;
    }
    let window_start = history.len().saturating_sub(params.penalty_last_n);
    window_scratch.clear();
    window_scratch.extend_from_slice(&history[window_start..]);
    // Sorting groups equal ids into runs: each run is one distinct token and its count.
    window_scratch.sort_unstable();
    let mut run_start = 0;
    while run_start < window_scratch.len() {
        let token = window_scratch[run_start];
        let mut run_end = run_start + 1;
        while run_end < window_scratch.len() && window_scratch[run_end] == token {
            run_end += 1;
        }
        let count = run_end - run_start;
        if let Some(logit) = logits.get_mut(token as usize) {
            *logit = penalized_logit(*logit, count, params);
        }
        run_start = run_end;
    }
}

/// The penalty rule for one token seen `count > 0` times (see [`apply_penalties`]).
fn penalized_logit(logit: f32, count: usize, params: &SamplingParams) -> f32 {
    let repeated = if logit <= 0.0 {
        logit * params.repetition_penalty
    } else {
        logit / params.repetition_penalty
    };
    repeated - (count as f32 * params.frequency_penalty + params.presence_penalty)
}
