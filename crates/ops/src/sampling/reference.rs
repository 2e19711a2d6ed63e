//! Stage 5 of the chain and the per-sequence reference `Sampler`.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::chain::{ChainOutcome, SamplingChain};
use super::params::{InvalidSamplingParam, SamplingParams};

/// The sort-based reference sampler of one sequence: its parameters, its own seeded RNG and
/// the reusable chain buffers. Slow paths and tests use it as the oracle of the fast samplers.
///
/// RNG contract: the greedy branch consumes no randomness; every other call to
/// [`sample`](Self::sample) consumes exactly one [`uniform_f64`] draw (even when only one token
/// survives), so the stream position equals the number of non-greedy steps.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: ChaCha20Rng,
    chain: SamplingChain,
}

impl Sampler {
    /// Validates `params` (the error names the bad field) and seeds a ChaCha20 RNG from
    /// `params.seed`, or from OS entropy (through rand's thread RNG) when it is `None`.
    pub fn new(params: SamplingParams) -> Result<Self, InvalidSamplingParam> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(rand::random::<u64>);
        Ok(Sampler {
            params,
            seed,
            rng: ChaCha20Rng::seed_from_u64(seed),
            chain: SamplingChain::new(),
        })
    }

    /// The parameters this sampler was built with (`seed` as given, possibly `None`).
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed actually used: `params.seed` if given, otherwise the one drawn from entropy.
    /// Building a new sampler with `seed: Some(sampler.seed())` replays the same stream.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Samples the next token from one logit row (length = vocabulary size) given the
    /// sequence's `history` (oldest first), following the canonical chain. Never returns a
    /// token with zero probability in [`effective_distribution`](super::effective_distribution);
    /// a row with no finite logit returns 0 (an empty row too: callers must not pass one).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let greedy = self.params.is_greedy();
        // Drawn before looking at the row so the stream advances once per non-greedy step,
        // independent of the row's content.
        let uniform = if greedy {
            0.0
        } else {
            uniform_f64(&mut self.rng)
        };
        match self.chain.run(logits, history, &self.params) {
            ChainOutcome::Greedy { token } => token,
            ChainOutcome::Categorical(categorical) => {
                // The chain guarantees at least one positive weight (the argmax has weight 1).
                match inverse_cdf(categorical.weights, uniform) {
                    Some(index) => categorical.tokens[index],
                    None => categorical.tokens.first().copied().unwrap_or(0),
                }
            }
        }
    }
}

/// A uniform f64 in `[0, 1)`: the top 53 bits of one `u64`, times `2^-53`. Every value is
/// exactly representable, so the result is at most `1 - 2^-53` and can never round to 1.0.
pub fn uniform_f64(rng: &mut impl RngCore) -> f64 {
    const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
    (rng.next_u64() >> 11) as f64 * SCALE
}

/// Inverse-CDF selection: the first index whose cumulative weight (summed in index order)
/// exceeds `uniform * total`, where `uniform` is in `[0, 1)` and `weights` are finite and
/// `>= 0`. A zero-weight index is never returned: the comparison is strict, so the cumulative
/// sum must grow at the returned index. If rounding leaves the target at or above the final
/// sum, the last positive-weight index is returned. `None` only when no weight is positive.
pub fn inverse_cdf(weights: &[f64], uniform: f64) -> Option<usize> {
    let total: f64 = weights.iter().sum();
    let target = uniform * total;
    let mut cumulative = 0.0f64;
    let mut last_positive = None;
    for (index, &weight) in weights.iter().enumerate() {
        if weight > 0.0 {
            cumulative += weight;
            if cumulative > target {
                return Some(index);
            }
            last_positive = Some(index);
        }
    }
    last_positive
}
