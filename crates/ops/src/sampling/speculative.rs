//! Distribution-preserving verification of one guessed token (speculative sampling:
//! Leviathan, Kalman and Matias 2023; Chen et al. 2023).
//!
//! A drafter drew `guess` from its distribution `q`; the target would sample from `p` (the
//! chain's [`effective_distribution`](super::effective_distribution): penalties, filters and
//! temperature applied). Accept the guess with probability `min(1, p(guess) / q(guess))`;
//! otherwise emit one token from the residual `normalize(max(0, p - q))`. Then
//! `P(emit x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x)`, because the residual's
//! normaliser is exactly the rejection probability. A deterministic drafter (n-gram) is the
//! case `q = one-hot(guess)`: accept with probability `p(guess)`, else draw from `p` with the
//! guess removed.
//!
//! Randomness comes from the Philox purposes reserved for speculation, at the request's
//! seed and the sampler step of the position: the acceptance uniform from
//! `(step, SpeculativeAccept)`, the residual's exponential race (Gumbel-max over
//! `ln r_i`: no softmax, no sort) from `(step, SpeculativeResidual)`; so a seed gives the
//! same tokens and the drafter's own noise (`Drafter`) never correlates with either.

use super::gumbel::gumbel_noise;
use super::philox::{draw_block, open_uniform_f64_from_u64, DrawPurpose};

/// What verification decided at one position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The guess stands.
    Accepted,
    /// The guess is rejected; `token` (drawn from the residual) is emitted instead and the
    /// chain stops.
    Rejected { token: u32 },
}

/// Verifies `guess` against the target distribution `p` (length V, sums to 1), drawn from
/// `q` (length V; `None`: the guess was deterministic, `q = one-hot(guess)`), with the
/// Philox key of the request and the sampler step of this position. A guess outside `p`'s
/// support is never accepted (even where `q` underflowed to 0).
pub fn verify_guess(p: &[f64], q: Option<&[f32]>, guess: u32, key: [u32; 2], step: u64) -> Verdict {
    let index = guess as usize;
    let p_guess = p.get(index).copied().unwrap_or(0.0);
    let q_guess = match q {
        Some(q) => q.get(index).copied().unwrap_or(0.0) as f64,
        None => 1.0,
    };
    let block = draw_block(key, step, DrawPurpose::SpeculativeAccept, 0);
    let uniform = open_uniform_f64_from_u64(block[0], block[1]);
    if p_guess > 0.0 && uniform * q_guess <= p_guess {
        return Verdict::Accepted;
    }
    let residual = |i: usize| -> f64 {
        let q_i = match q {
            Some(q) => q[i] as f64,
            None => f64::from(u8::from(i == index)),
        };
        (p[i] - q_i).max(0.0)
    };
    let token = exponential_race(p.len(), residual, key, step)
        // The residual underflowed (p == q up to rounding, where rejection is all but
        // impossible): a draw from p itself keeps the support right.
        .or_else(|| exponential_race(p.len(), |i| p[i], key, step))
        .unwrap_or(guess);
    Verdict::Rejected { token }
}

/// A draw from `weights(0..len)` (unnormalised, non-negative) by the exponential race
/// `argmax_i ln w_i + G_i`, `G_i` the Gumbel noise of word `i` of `(step,
/// SpeculativeResidual)`; `None` when every weight is zero.
fn exponential_race(
    len: usize,
    weights: impl Fn(usize) -> f64,
    key: [u32; 2],
    step: u64,
) -> Option<u32> {
    let mut best: Option<(f64, u32)> = None;
    for block_index in 0..len.div_ceil(4) {
        let words = draw_block(
            key,
            step,
            DrawPurpose::SpeculativeResidual,
            block_index as u32,
        );
        for (lane, &word) in words.iter().enumerate() {
            let i = block_index * 4 + lane;
            if i >= len {
                break;
            }
            let weight = weights(i);
            if weight <= 0.0 {
                continue;
            }
            let score = weight.ln() + gumbel_noise(word) as f64;
            if best.is_none_or(|(top, _)| score > top) {
                best = Some((score, i as u32));
            }
        }
    }
    best.map(|(_, token)| token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::philox::key_from_seed;

    #[test]
    fn a_guess_outside_the_support_is_never_accepted() {
        let p = [0.5, 0.5, 0.0];
        // q underflowed to 0 at the guess: the ratio would be infinite.
        let q = [0.5, 0.5, 0.0f32];
        for step in 0..1000 {
            let verdict = verify_guess(&p, Some(&q), 2, key_from_seed(7), step);
            assert!(matches!(verdict, Verdict::Rejected { token } if token < 2));
        }
    }

    #[test]
    fn a_guess_where_p_covers_q_is_always_accepted() {
        let p = [0.2, 0.8];
        let q = [0.5, 0.5f32];
        for step in 0..1000 {
            assert_eq!(
                verify_guess(&p, Some(&q), 1, key_from_seed(3), step),
                Verdict::Accepted
            );
        }
    }

    #[test]
    fn the_same_seed_and_step_give_the_same_verdict() {
        let p = [0.1, 0.2, 0.3, 0.4];
        let verdicts = |seed| -> Vec<Verdict> {
            (0..200)
                .map(|step| verify_guess(&p, None, 0, key_from_seed(seed), step))
                .collect()
        };
        assert_eq!(verdicts(11), verdicts(11));
        assert_ne!(verdicts(11), verdicts(12));
    }
}
