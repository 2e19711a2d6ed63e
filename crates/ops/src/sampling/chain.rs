//! The canonical sampling chain (stages 1-4; stage 5, the draw, lives in the `Sampler`).
//!
//! Every sampler of pagoda, this sort-based reference and the later fast ones, must sample
//! from exactly the distribution [`SamplingChain::run`] describes; [`effective_distribution`]
//! exposes it as a dense probability vector for tests.

use super::params::SamplingParams;
use super::penalties::apply_penalties_with_scratch;

/// What the chain decided for one row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ChainOutcome<'a> {
    /// The token is fixed, no randomness is consumed: the greedy branch (`temperature == 0` or
    /// `top_k == 1`; argmax of the penalised logits, lowest id on ties), or a row with no
    /// finite logit (token 0 by convention, as the greedy argmax returns for such a row).
    Greedy {
        /// The chosen token id.
        token: u32,
    },
    /// Draw from the categorical distribution proportional to `weights`.
    Categorical(Categorical<'a>),
}

/// The support that survived the filters, with its tempered draw weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Categorical<'a> {
    /// Surviving token ids, in ascending id order (the inverse-CDF walk follows this order).
    pub tokens: &'a [u32],
    /// Unnormalised draw weight of each surviving token, `exp((z - z_max) / temperature)` with
    /// `z` the penalised logit. Finite and `>= 0`; the most probable token has weight 1, so the
    /// sum is `>= 1`. A weight can be exactly 0 only when tempering underflows it in f64.
    pub weights: &'a [f64],
    /// Sum of `weights` (in the order listed).
    pub total_weight: f64,
    /// The support is exactly `{i : penalised_logit[i] >= min_kept_logit}`: every filter is a
    /// threshold on the untempered probability (ties kept), so a fast sampler can reproduce
    /// the support with one comparison per token.
    pub min_kept_logit: f32,
}

/// Reusable buffers for the chain: one per sequence (or per worker), so a decode step
/// allocates nothing once the buffers have grown to the vocabulary size.
#[derive(Debug, Default, Clone)]
pub struct SamplingChain {
    penalized_logits: Vec<f32>,
    penalty_window: Vec<u32>,
    order_keys: Vec<u64>,
    tokens: Vec<u32>,
    weights: Vec<f64>,
}

impl SamplingChain {
    /// Empty buffers; they grow on first use.
    pub fn new() -> Self {
        SamplingChain::default()
    }

    /// The penalised (and sanitised) logits of the last [`run`](Self::run), one per token.
    pub fn penalized_logits(&self) -> &[f32] {
        &self.penalized_logits
    }

    /// Stage 1 only: sanitises (NaN -> `-inf`, `+inf` -> `f32::MAX`) and penalises one row into
    /// the chain's buffer and returns it (length = `logits.len()`). [`run`](Self::run) starts
    /// with exactly this call, so every sampler that calls it sees the same `z` as the chain.
    pub fn prepare_logits(
        &mut self,
        logits: &[f32],
        history: &[u32],
        params: &SamplingParams,
    ) -> &[f32] {
        self.penalized_logits.clear();
        self.penalized_logits
            .extend(logits.iter().map(|&logit| sanitize_logit(logit)));
        apply_penalties_with_scratch(
            &mut self.penalized_logits,
            history,
            params,
            &mut self.penalty_window,
        );
        &self.penalized_logits
    }

    /// Runs stages 1-4 of the chain documented in [`crate::sampling`] on one row.
    ///
    /// `logits`: one row, length = vocabulary size. `history`: the sequence's tokens so far,
    /// oldest first (prompt included; ids outside the row are ignored). `params` must have
    /// passed [`SamplingParams::validate`]. NaN logits are treated as `-inf` (never drawn) and
    /// `+inf` as `f32::MAX` (certain, shared evenly among all such tokens).
    pub fn run<'a>(
        &'a mut self,
        logits: &[f32],
        history: &[u32],
        params: &SamplingParams,
    ) -> ChainOutcome<'a> {
        // Stage 1: sanitise, then penalise the raw logits.
        self.prepare_logits(logits, history, params);
        let z = &self.penalized_logits;

        // Stage 2: greedy consumes no randomness.
        let argmax_token = argmax(z);
        let z_max = z
            .get(argmax_token as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY);
        if params.is_greedy() || z_max == f32::NEG_INFINITY {
            return ChainOutcome::Greedy {
                token: argmax_token,
            };
        }
        let z_max = z_max as f64;
        // Probability of token i relative to the most probable one, untempered: p_i / p_max.
        let relative = |token: u32| (z[token as usize] as f64 - z_max).exp();

        // Stage 3: filters on the untempered distribution. Each keeps an upper set in the order
        // of z (ties included), so applying them in sequence is an intersection.
        let tokens = &mut self.tokens;
        tokens.clear();
        let top_k_active = params.top_k > 0;
        let top_p_active = params.top_p < 1.0;
        let min_p_active = params.min_p > 0.0;
        if !(top_k_active || top_p_active || min_p_active) {
            tokens
                .extend((0..z.len() as u32).filter(|&token| z[token as usize] > f32::NEG_INFINITY));
        } else {
            let keys = &mut self.order_keys;
            keys.clear();
            keys.extend(
                (0..z.len() as u32)
                    .filter(|&token| z[token as usize] > f32::NEG_INFINITY)
                    .map(|token| order_key(z[token as usize], token)),
            );
            // Top-k: keep z >= the k-th largest z (ties at the boundary all kept).
            if top_k_active && params.top_k < keys.len() {
                let (_, kth, _) = keys.select_nth_unstable(params.top_k - 1);
                let top_k_min_logit = z[key_token(*kth) as usize];
                keys.retain(|&key| z[key_token(key) as usize] >= top_k_min_logit);
            }
            // Top-p is measured against the mass that survived top-k (llama.cpp renormalises
            // over the top-k set before top-p): Z_k = sum of p_i / p_max over the top-k set.
            let top_k_mass: f64 = if top_p_active {
                keys.iter().map(|&key| relative(key_token(key))).sum()
            } else {
                0.0
            };
            // Min-p: keep p_i >= min_p * p_max. Applying it before top-p is only a shortcut: for
            // a token that passes min-p every more probable token passes too, so the mass above
            // it (all top-p looks at) is unchanged.
            if min_p_active {
                let min_p = params.min_p as f64;
                keys.retain(|&key| relative(key_token(key)) >= min_p);
            }
            if top_p_active {
                let mass_target = params.top_p as f64 * top_k_mass;
                let kept = top_p_kept_prefix(keys, &relative, mass_target);
                keys.truncate(kept);
            }
            tokens.extend(keys.iter().map(|&key| key_token(key)));
            tokens.sort_unstable();
        }

        // Stage 4: temperature on the survivors only.
        let inverse_temperature = 1.0 / params.temperature as f64;
        self.weights.clear();
        self.weights.extend(
            tokens
                .iter()
                .map(|&token| ((z[token as usize] as f64 - z_max) * inverse_temperature).exp()),
        );
        let min_kept_logit = tokens
            .iter()
            .map(|&token| z[token as usize])
            .fold(f32::INFINITY, f32::min);
        ChainOutcome::Categorical(Categorical {
            tokens,
            weights: &self.weights,
            total_weight: self.weights.iter().sum(),
            min_kept_logit,
        })
    }
}

/// How many tokens survive top-p, with `keys` (the candidates, any order) rearranged so
/// that `keys[..kept]` are the survivors: walking tokens by decreasing probability (then
/// id), a tie group is kept while the mass strictly above it is `< mass_target` (in units of
/// `p_max`); the first group is always kept. Equivalently: the smallest most-probable prefix
/// with mass `>= top_p`, extended to its whole boundary tie group.
///
/// Only a window of the most probable candidates is sorted (selected in O(n), grown 4x while
/// the walk runs off its end), so the usual small nucleus costs no full-vocabulary sort. The
/// walk only stops at a group start inside the window, where every earlier group is complete,
/// and it visits the same tokens in the same order whatever the window: the result is exact.
fn top_p_kept_prefix(keys: &mut [u64], relative: &impl Fn(u32) -> f64, mass_target: f64) -> usize {
    const INITIAL_WINDOW: usize = 256;
    let mut window = INITIAL_WINDOW.min(keys.len());
    loop {
        if window < keys.len() {
            keys.select_nth_unstable(window - 1);
        }
        keys[..window].sort_unstable();
        let mut mass_above = 0.0f64;
        let mut group_start = 0;
        while group_start < window {
            if group_start > 0 && mass_above >= mass_target {
                return group_start;
            }
            let group_order = keys[group_start] >> 32;
            let mut group_end = group_start;
            while group_end < window && keys[group_end] >> 32 == group_order {
                mass_above += relative(key_token(keys[group_end]));
                group_end += 1;
            }
            group_start = group_end;
        }
        if window == keys.len() {
            return window;
        }
        window = window.saturating_mul(4).min(keys.len());
    }
}

/// A sort key whose ascending order is descending `logit`, then ascending `token` (the walk
/// order of top-p). Tokens with equal logits (`-0.0 == +0.0` included) share the high 32 bits.
fn order_key(logit: f32, token: u32) -> u64 {
    // `+ 0.0` turns -0.0 into +0.0 so equal floats have equal bits.
    let bits = (logit + 0.0).to_bits();
    // Flip so that unsigned order is float order: negatives reversed, positives above them.
    let ascending = if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    ((!ascending as u64) << 32) | token as u64
}

/// The token id stored in the low 32 bits of an [`order_key`].
fn key_token(key: u64) -> u32 {
    key as u32
}

/// Index of the largest logit, lowest id on ties; NaN never wins; a row with no value above
/// `-inf` (or an empty row) returns 0.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best_token = 0u32;
    let mut best_logit = f32::NEG_INFINITY;
    for (token, &logit) in logits.iter().enumerate() {
        if logit > best_logit {
            best_logit = logit;
            best_token = token as u32;
        }
    }
    best_token
}

/// The exact probability vector (length = `logits.len()`, sums to 1 up to rounding) that the
/// chain samples from for this row, history and params: one-hot on the greedy token in the
/// greedy branch, otherwise the normalised tempered weights on the surviving support and 0
/// elsewhere. An empty row gives an empty vector. This is the oracle for every sampler.
pub fn effective_distribution(
    logits: &[f32],
    history: &[u32],
    params: &SamplingParams,
) -> Vec<f64> {
    let mut distribution = vec![0.0f64; logits.len()];
    if logits.is_empty() {
        return distribution;
    }
    match SamplingChain::new().run(logits, history, params) {
        ChainOutcome::Greedy { token } => distribution[token as usize] = 1.0,
        ChainOutcome::Categorical(categorical) => {
            for (&token, &weight) in categorical.tokens.iter().zip(categorical.weights) {
                distribution[token as usize] = weight / categorical.total_weight;
            }
        }
    }
    distribution
}

/// NaN becomes `-inf` (masked) and `+inf` becomes `f32::MAX`, so everything downstream works
/// on values where `x - max` is never NaN.
pub(crate) fn sanitize_logit(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::NEG_INFINITY
    } else if logit == f32::INFINITY {
        f32::MAX
    } else {
        logit
    }
}
