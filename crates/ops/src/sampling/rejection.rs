//! Sorting-free top-k / top-p / min-p: dual-pivot rejection sampling (FlashInfer's design,
//! on the CPU, in logit space).
//!
//! Every filter of the chain keeps an upper set of the penalised logits `z`, so the support is
//! `S = {i : z_i >= L}` for one threshold `L` and "does value `v` pass the filters" is
//! monotone in `v`:
//! - top-k passes at `v` iff `count(z_j > v) < k` (ties at the boundary kept);
//! - top-p passes at `v` iff `mass(z_j > v) < top_p * Z_k`, masses `exp(z_j - z_max)` in f64,
//!   `Z_k` the mass of the top-k set (all finite tokens without top-k): exactly the chain's
//!   "strictly more probable mass below the target" rule, renormalised over the top-k set;
//! - min-p passes at `v` iff `exp(v - z_max) >= min_p` in f64; it is folded into the starting
//!   bracket as an exact f32 threshold ([`min_p_threshold`]).
//!
//! The proposal `{z > low}` (which always contains `S`) is compacted once into id-ordered
//! arrays of tokens, logits and weights, and compacted again whenever `low` rises, so rounds
//! cost the proposal's size, not the vocabulary's. Each round draws a candidate by inverse CDF
//! (id order) from the TEMPERED weights of the proposal, then counts and sums above the
//! candidate (`pivot0`) and above `pivot1`, the midpoint of the f32 bit-order between `pivot0`
//! and `high` (a value known to pass). The candidate is accepted iff `pivot0` passes: a draw
//! from a superset conditioned on landing in `S` is an exact draw from `S`, whatever the
//! earlier rounds did. Otherwise `low` moves to `pivot1` (if it fails) or to `pivot0` with
//! `high = pivot1`. The bit distance between `pivot0` and `high` at least halves per failing
//! round, so a row needs at most 33 rounds; [`DEFAULT_MAX_REJECTION_ROUNDS`] bounds it anyway
//! and the caller falls back to the reference chain (counted).
//!
//! Top-k: the k-th largest logit is found by a streaming select (one pass with a rising floor,
//! see `kth_largest`; no sort) and folded into the bracket like min-p, so
//! top-k alone is one direct inverse-CDF draw over `{z >= z_(k)}` and top-k with top-p gets
//! its exact `Z_k`; the rounds then only test top-p. (Measured on the CPU, FlashInfer's
//! count-based top-k rounds cost more than the select.)
//!
//! Weights: the candidates are drawn with canonical f32 weights ([`draw_weight`], relative
//! error below 3e-6 where the weight exceeds 1e-9 of the largest), summed in f64, the same
//! bits on the GPU; the filters' masses stay f64 (`exp_f64`), so the support is the chain's.
//!
//! Exactness against the chain's f64 sums: the chain sums masses in its sort order, this code
//! in id order. When a top-p test lands within `4 * V * eps * Z` of its target (where the two
//! summation orders could disagree), the candidate test is declared ambiguous and the caller
//! falls back to the reference chain, so the support always equals the chain's.

use super::params::SamplingParams;
use super::philox::{draw_block, open_uniform_f64_from_u64, DrawPurpose};
#[cfg(doc)]
use super::weights::draw_weight;
use super::weights::{exp_weights, fill_draw_weights};

/// Round cap of the dual-pivot loop. The halving argument bounds a row at 33 rounds (32 failing
/// ones plus the accepting one), so the cap is only reached through ambiguous pivot tests.
pub const DEFAULT_MAX_REJECTION_ROUNDS: u32 = 34;

/// Reusable per-sampler buffers of the rejection path (grow to the vocabulary size once).
#[derive(Debug, Default, Clone)]
pub(crate) struct RejectionScratch {
    /// Token ids of the proposal `{z > low}`, ascending.
    tokens: Vec<u32>,
    /// Their logits.
    logits: Vec<f32>,
    /// Their tempered draw weights, canonical f32 ([`draw_weight`]) held as f64.
    draw_weights: Vec<f64>,
    /// Their untempered masses `exp(z - z_max)` in f64 (top-p only).
    filter_weights: Vec<f64>,
    /// Values at or above the running floor of the top-k select.
    select_buffer: Vec<f32>,
}

/// How a filtered draw ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RejectionOutcome {
    /// The candidate of round `rounds` (1-based) was accepted.
    Accepted { token: u32, rounds: u32 },
    /// No decision within the cap, an ambiguous test, or a threshold that did not converge:
    /// the caller must sample through the reference chain. `rounds` were spent.
    Fallback { rounds: u32 },
}

/// Result of a filter test at one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Pass,
    Fail,
    Ambiguous,
}

/// Monotone map of f32 to u32 (unsigned order = float order; `-0.0` and `+0.0` equal).
fn ordered_bits(value: f32) -> u32 {
    let bits = (value + 0.0).to_bits();
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// Inverse of [`ordered_bits`].
fn from_ordered_bits(ordered: u32) -> f32 {
    if ordered & 0x8000_0000 != 0 {
        f32::from_bits(ordered & 0x7FFF_FFFF)
    } else {
        f32::from_bits(!ordered)
    }
}

/// The largest f32 below `value` (`value > -inf`, not NaN).
fn next_down(value: f32) -> f32 {
    from_ordered_bits(ordered_bits(value) - 1)
}

/// The largest f32 `t` with `exp(t - z_max) >= min_p` false for every f32 below it, i.e. the
/// smallest f32 passing the chain's min-p test (`min_p` in `(0, 1]`, `z_max` finite), found
/// from `z_max + ln(min_p)` by ulp steps. `None` if the steps do not settle (never seen).
pub(crate) fn min_p_threshold(z_max: f32, min_p: f32) -> Option<f32> {
    let z_max64 = z_max as f64;
    let min_p = min_p as f64;
    let passes = |value: f32| (value as f64 - z_max64).exp() >= min_p;
    let mut threshold = ((z_max64 + min_p.ln()) as f32).max(-f32::MAX).min(z_max);
    for _ in 0..64 {
        if passes(threshold) {
            break;
        }
        threshold = from_ordered_bits(ordered_bits(threshold) + 1);
    }
    if !passes(threshold) {
        return None;
    }
    for _ in 0..64 {
        let below = next_down(threshold);
        if below == f32::NEG_INFINITY || !passes(below) {
            return Some(threshold);
        }
        threshold = below;
    }
    None
}

/// The k-th largest finite value of `z` (ties counted, as the chain's top-k). `None` when at
/// most `k` values are finite (top-k keeps everything). `k >= 1`.
///
/// One streaming pass with a rising floor: values `>= floor` are appended to `buffer`; when it
/// holds more than its capacity, a selection finds its k-th largest, which becomes the floor,
/// and only values `>= floor` are kept (every dropped value has `k` values at or above it, so
/// the top-k multiset is untouched). On a row in random order the floor quickly reaches the
/// top few per mille and the pass costs one comparison per element; on any order it is O(V)
/// (each selection costs the buffer's size and frees at least half of it, the capacity
/// doubling when ties keep it full).
fn kth_largest(z: &[f32], k: usize, buffer: &mut Vec<f32>) -> Option<f32> {
    let mut capacity = (4 * k).max(1024);
    let mut floor = -f32::MAX;
    let mut selected = false;
    buffer.clear();
    for chunk in z.chunks(64) {
        for &value in chunk {
            if value >= floor {
                buffer.push(value);
            }
        }
        if buffer.len() > capacity {
            let (_, &mut kth, _) = buffer.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            floor = kth;
            selected = true;
            buffer.retain(|&value| value >= floor);
            if buffer.len() > capacity / 2 {
                capacity *= 2;
            }
        }
    }
    if !selected && buffer.len() <= k {
        return None;
    }
    let (_, &mut kth, _) = buffer.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    Some(kth)
}

/// A filtered (non-greedy) draw over the penalised row `z` by dual-pivot rejection; see the
/// module documentation. `z_max` is the row maximum (finite); `params` validated and not
/// greedy; at least one filter active. Draw `(key, step)`; round `r` (0-based) uses block `r`
/// of purpose [`DrawPurpose::RejectionRound`].
pub(crate) fn sample_filtered(
    z: &[f32],
    z_max: f32,
    params: &SamplingParams,
    key: [u32; 2],
    step: u64,
    max_rounds: u32,
    scratch: &mut RejectionScratch,
) -> RejectionOutcome {
    let vocab = z.len();
    let z_max64 = z_max as f64;
    let top_p_active = params.top_p < 1.0;
    let top_k_active = params.top_k > 0 && params.top_k < vocab;

    // Exclusive lower bound of the proposal: candidates are {z > low}.
    let mut low = f32::NEG_INFINITY;
    if params.min_p > 0.0 {
        match min_p_threshold(z_max, params.min_p) {
            Some(threshold) => low = next_down(threshold),
            None => return RejectionOutcome::Fallback { rounds: 0 },
        }
    }
    // Top-k: fold the exact k-th largest logit into the bracket (top-p's Z_k needs the set).
    let mut top_k_threshold = f32::NEG_INFINITY;
    if top_k_active {
        if let Some(kth) = kth_largest(z, params.top_k, &mut scratch.select_buffer) {
            top_k_threshold = kth;
            low = low.max(next_down(kth));
        }
    }

    // The proposal {z > low}, compacted (ascending ids), with its weights.
    let RejectionScratch {
        tokens,
        logits,
        draw_weights,
        filter_weights,
        ..
    } = scratch;
    tokens.clear();
    logits.clear();
    for (index, &value) in z.iter().enumerate() {
        if value > low {
            tokens.push(index as u32);
            logits.push(value);
        }
    }
    filter_weights.clear();
    fill_draw_weights(logits, z_max, 1.0 / params.temperature, draw_weights);
    let mut proposal_mass = 0.0f64;
    let mut top_k_mass = 0.0f64;
    if top_p_active {
        exp_weights(logits, z_max64, 1.0, filter_weights);
    }
    if top_p_active && (low < top_k_threshold || low == f32::NEG_INFINITY) {
        // Every token of the top-k set (all finite tokens without top-k) is in the proposal.
        // Both sums in id order, in one loop: two independent chains of dependent adds run
        // side by side (each is latency-bound alone), with the same bits as two loops.
        for ((&value, &draw), &filter) in logits
            .iter()
            .zip(draw_weights.iter())
            .zip(filter_weights.iter())
        {
            proposal_mass += draw;
            if value >= top_k_threshold {
                top_k_mass += filter;
            }
        }
    } else {
        proposal_mass = draw_weights.iter().sum();
        if top_p_active {
            // Min-p cut deeper than top-k: the top-k set reaches below the proposal.
            top_k_mass = z
                .iter()
                .filter(|&&value| value >= top_k_threshold && value > f32::NEG_INFINITY)
                .map(|&value| (value as f64 - z_max64).exp())
                .sum();
        }
    }
    let mass_target = params.top_p as f64 * top_k_mass;
    // Summation order (4 V eps) plus the difference between `exp_f64` and libm's `exp` per
    // term (a few ulp each, bounded by 64 eps in total).
    let margin = (4.0 * vocab as f64 + 64.0) * f64::EPSILON * top_k_mass;
    // The chain's "strictly more probable mass below the target" test at a value whose
    // more-probable mass is `mass_above`.
    let verdict = |mass_above: f64| -> Verdict {
        if !top_p_active {
            return Verdict::Pass;
        }
        if (mass_above - mass_target).abs() <= margin {
            return Verdict::Ambiguous;
        }
        if mass_above >= mass_target {
            Verdict::Fail
        } else {
            Verdict::Pass
        }
    };

    let mut high = z_max;
    for round in 0..max_rounds {
        // Inverse-CDF candidate over the proposal in id order; the same additions in the same
        // order as `proposal_mass`, so the walk always ends inside the proposal.
        let block = draw_block(key, step, DrawPurpose::RejectionRound, round);
        let uniform = open_uniform_f64_from_u64(block[0], block[1]);
        let target = uniform * proposal_mass;
        let mut cumulative = 0.0f64;
        let mut candidate = None;
        let mut last_positive = None;
        for (position, &weight) in draw_weights.iter().enumerate() {
            if weight > 0.0 {
                cumulative += weight;
                last_positive = Some(position);
                if cumulative > target {
                    candidate = Some(position);
                    break;
                }
            }
        }
        let Some(candidate) = candidate.or(last_positive) else {
            return RejectionOutcome::Fallback { rounds: round + 1 };
        };
        let pivot0 = logits[candidate];
        let accepted = RejectionOutcome::Accepted {
            token: tokens[candidate],
            rounds: round + 1,
        };
        if !top_p_active || pivot0 >= high {
            return accepted;
        }
        let (low_bits, high_bits) = (ordered_bits(pivot0), ordered_bits(high));
        let pivot1 = from_ordered_bits(low_bits + (high_bits - low_bits) / 2);
        let (mut mass0, mut mass1) = (0.0f64, 0.0f64);
        for (&value, &weight) in logits.iter().zip(filter_weights.iter()) {
            if value > pivot0 {
                mass0 += weight;
                if value > pivot1 {
                    mass1 += weight;
                }
            }
        }
        match verdict(mass0) {
            Verdict::Pass => return accepted,
            Verdict::Ambiguous => return RejectionOutcome::Fallback { rounds: round + 1 },
            Verdict::Fail => match verdict(mass1) {
                Verdict::Fail => low = pivot1,
                pivot1_verdict => {
                    low = pivot0;
                    if pivot1_verdict == Verdict::Pass {
                        high = pivot1;
                    }
                }
            },
        }
        // Shrink the proposal to {z > low}, keeping id order; its mass is re-summed in the
        // order the next walk uses, as the kept weights move.
        let mut kept = 0;
        proposal_mass = 0.0;
        for position in 0..logits.len() {
            if logits[position] > low {
                tokens[kept] = tokens[position];
                logits[kept] = logits[position];
                draw_weights[kept] = draw_weights[position];
                proposal_mass += draw_weights[position];
                if let Some(&weight) = filter_weights.get(position) {
                    filter_weights[kept] = weight;
                }
                kept += 1;
            }
        }
        tokens.truncate(kept);
        logits.truncate(kept);
        draw_weights.truncate(kept);
        filter_weights.truncate(kept);
    }
    RejectionOutcome::Fallback { rounds: max_rounds }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `kth_largest` against a full sort, on random, sorted, tied and masked rows.
    #[test]
    fn kth_largest_matches_sorting() {
        let mut state = 99u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut buffer = Vec::new();
        for trial in 0..300usize {
            let length = 1 + (next() % 6000) as usize;
            let mut row: Vec<f32> = (0..length)
                .map(|_| ((next() % 2001) as f32 - 1000.0) / [1.0, 100.0, 1e4][trial % 3])
                .collect();
            match trial % 5 {
                1 => row.sort_by(|a, b| a.total_cmp(b)),
                2 => row
                    .iter_mut()
                    .for_each(|value| *value = value.round() / 1e3),
                3 => {
                    for index in (0..length).step_by(3) {
                        row[index] = f32::NEG_INFINITY;
                    }
                }
                _ => {}
            }
            let k = 1 + (next() % 300) as usize;
            let mut finite: Vec<f32> = row.iter().copied().filter(|v| v.is_finite()).collect();
            finite.sort_by(|a, b| b.total_cmp(a));
            let expected = if finite.len() <= k {
                None
            } else {
                Some(finite[k - 1])
            };
            assert_eq!(kth_largest(&row, k, &mut buffer), expected, "trial {trial}");
        }
        assert_eq!(kth_largest(&[2.0; 5000], 40, &mut buffer), Some(2.0));
    }
}
