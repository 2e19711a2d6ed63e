//! The fused (sorting-free) sampler, the choice between it and the reference sampler, and the
//! process-wide counters proving which path ran.
//!
//! Stream history (same seed, different tokens across these changes; the distribution is the
//! chain's throughout):
//! - v2: the Gumbel noise is computed in vectorised f32 from the full 32-bit word (see
//!   `gumbel`; previously f64 libm logs), and the rejection weights use a vectorised f64 `exp`
//!   within a few ulp of libm (previously libm), so a token can differ from v1 where two
//!   scores or a cumulative sum differ by rounding. Philox layout and purposes are unchanged.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use super::chain::{ChainOutcome, SamplingChain};
use super::gumbel::gumbel_argmax;
use super::params::{InvalidSamplingParam, SamplingParams};
use super::philox::{draw_block, key_from_seed, open_uniform_f64_from_u64, DrawPurpose};
use super::reference::{inverse_cdf, Sampler};
use super::rejection::{
    sample_filtered, RejectionOutcome, RejectionScratch, DEFAULT_MAX_REJECTION_ROUNDS,
};

/// Name of the environment variable selecting the sampler (`fused` or `reference`).
pub const SAMPLER_ENV_VAR: &str = "PAGODA_SAMPLER";

static FUSED_DRAWS: AtomicU64 = AtomicU64::new(0);
static GREEDY_DRAWS: AtomicU64 = AtomicU64::new(0);
static GUMBEL_DRAWS: AtomicU64 = AtomicU64::new(0);
static REJECTION_DRAWS: AtomicU64 = AtomicU64::new(0);
static REJECTION_ROUNDS: AtomicU64 = AtomicU64::new(0);
static FALLBACKS: AtomicU64 = AtomicU64::new(0);
static REFERENCE_DRAWS: AtomicU64 = AtomicU64::new(0);

/// A snapshot of the process-wide sampling counters (monotone; subtract two snapshots to
/// measure a region). Every [`FusedSampler::sample`] call counts in `fused_draws` and in
/// exactly one of `greedy_draws`, `gumbel_draws`, `rejection_draws`, `fallbacks`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SamplingCounters {
    /// Calls to [`FusedSampler::sample`].
    pub fused_draws: u64,
    /// Fused calls that took the greedy branch (argmax, no randomness).
    pub greedy_draws: u64,
    /// Fused calls answered by Gumbel-max (no filter active).
    pub gumbel_draws: u64,
    /// Fused calls answered by dual-pivot rejection.
    pub rejection_draws: u64,
    /// Rejection rounds spent, accepted and fallen-back calls together.
    pub rejection_rounds: u64,
    /// Fused calls that fell back to the reference chain (round cap or ambiguous test).
    pub fallbacks: u64,
    /// Calls to the reference sampler through [`AnySampler`].
    pub reference_draws: u64,
}

impl std::ops::Sub for SamplingCounters {
    type Output = SamplingCounters;
    /// Field-wise difference (saturating), for "since" measurements.
    fn sub(self, earlier: SamplingCounters) -> SamplingCounters {
        SamplingCounters {
            fused_draws: self.fused_draws.saturating_sub(earlier.fused_draws),
            greedy_draws: self.greedy_draws.saturating_sub(earlier.greedy_draws),
            gumbel_draws: self.gumbel_draws.saturating_sub(earlier.gumbel_draws),
            rejection_draws: self.rejection_draws.saturating_sub(earlier.rejection_draws),
            rejection_rounds: self
                .rejection_rounds
                .saturating_sub(earlier.rejection_rounds),
            fallbacks: self.fallbacks.saturating_sub(earlier.fallbacks),
            reference_draws: self.reference_draws.saturating_sub(earlier.reference_draws),
        }
    }
}

/// The current values of the process-wide sampling counters (relaxed loads; for metrics).
pub fn sampling_counters() -> SamplingCounters {
    SamplingCounters {
        fused_draws: FUSED_DRAWS.load(Ordering::Relaxed),
        greedy_draws: GREEDY_DRAWS.load(Ordering::Relaxed),
        gumbel_draws: GUMBEL_DRAWS.load(Ordering::Relaxed),
        rejection_draws: REJECTION_DRAWS.load(Ordering::Relaxed),
        rejection_rounds: REJECTION_ROUNDS.load(Ordering::Relaxed),
        fallbacks: FALLBACKS.load(Ordering::Relaxed),
        reference_draws: REFERENCE_DRAWS.load(Ordering::Relaxed),
    }
}

/// Which path one sample call took; each is announced once per process at INFO.
#[derive(Debug, Clone, Copy)]
enum SamplingPath {
    FusedGreedy = 0,
    FusedGumbel = 1,
    FusedRejection = 2,
    FusedFallback = 3,
    Reference = 4,
}

fn announce(path: SamplingPath) {
    static ANNOUNCED: [Once; 5] = [const { Once::new() }; 5];
    ANNOUNCED[path as usize].call_once(|| {
        let description = match path {
            SamplingPath::FusedGreedy => "fused sampler, greedy argmax (no randomness)",
            SamplingPath::FusedGumbel => "fused sampler, Gumbel-max with Philox-4x32-10",
            SamplingPath::FusedRejection => {
                "fused sampler, dual-pivot rejection (top-k/top-p/min-p, no sort)"
            }
            SamplingPath::FusedFallback => {
                "fused sampler fell back to the reference chain (round cap or ambiguous test)"
            }
            SamplingPath::Reference => "reference sampler (sort-based chain, ChaCha20)",
        };
        tracing::info!("sampling path: {description}");
    });
}

/// The sorting-free sampler of one request. Same distribution as the reference
/// [`Sampler`] ([`effective_distribution`](super::effective_distribution): the same support,
/// and inside it the rejection path's canonical f32 draw weights, within 3e-6 of the f64
/// ones), different random stream.
///
/// Stream contract: the sampler counts its calls (`step`, starting at 0, advanced by every
/// call, greedy included); every random number of call `step` is a pure function of
/// `(seed, step, purpose, element)` through Philox-4x32-10 (see [`super::philox`]), so the
/// token is independent of batch composition, row order and thread count. Greedy calls
/// (`temperature == 0` or `top_k == 1`, or a row with no finite logit) take the argmax and
/// consume no randomness. No filter active: Gumbel-max. Any filter active: dual-pivot
/// rejection, falling back (counted) to the reference chain drawn with a Philox uniform.
#[derive(Debug, Clone)]
pub struct FusedSampler {
    params: SamplingParams,
    seed: u64,
    key: [u32; 2],
    step: u64,
    max_rejection_rounds: u32,
    chain: SamplingChain,
    scratch: RejectionScratch,
}

impl FusedSampler {
    /// Validates `params` (the error names the bad field); the seed is `params.seed`, or one
    /// drawn from OS entropy when it is `None` (as the reference sampler does).
    pub fn new(params: SamplingParams) -> Result<Self, InvalidSamplingParam> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(rand::random::<u64>);
        Ok(FusedSampler {
            params,
            seed,
            key: key_from_seed(seed),
            step: 0,
            max_rejection_rounds: DEFAULT_MAX_REJECTION_ROUNDS,
            chain: SamplingChain::new(),
            scratch: RejectionScratch::default(),
        })
    }

    /// The parameters this sampler was built with (`seed` as given, possibly `None`).
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed actually used (the Philox key); a sampler built with `seed: Some(seed())`
    /// replays the same tokens.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Number of `sample` calls so far: the `step` of the next call.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Records that the token of the current step was drawn elsewhere from this same stream
    /// (the GPU sampler, with this sampler's seed and [`Self::step`]): the next call uses the
    /// following step, exactly as if this sampler had drawn it.
    pub fn record_external_draw(&mut self) {
        self.step += 1;
    }

    /// The Philox key of [`Self::seed`].
    pub fn key(&self) -> [u32; 2] {
        self.key
    }

    /// The sampler a drafter draws its guesses with under the Leviathan rule: the same
    /// parameters and step, seeded by the first block of this seed's `Drafter` purpose, so
    /// its draws are independent of this sampler's and of verification's.
    pub fn drafter(&self) -> FusedSampler {
        let block = draw_block(self.key, 0, DrawPurpose::Drafter, 0);
        let seed = ((block[1] as u64) << 32) | block[0] as u64;
        FusedSampler {
            seed,
            key: key_from_seed(seed),
            ..self.clone()
        }
    }

    /// Lowers (or raises) the rejection round cap, default
    /// [`DEFAULT_MAX_REJECTION_ROUNDS`]; `0` sends every filtered call to the fallback. For
    /// tests of the fallback path; the distribution is exact at any cap.
    pub fn set_max_rejection_rounds(&mut self, rounds: u32) {
        self.max_rejection_rounds = rounds;
    }

    /// Samples the next token from one logit row (length = vocabulary size) given the
    /// sequence's `history` (oldest first, penalties read it), following the canonical chain.
    /// Never returns a token with zero probability in the effective distribution; a row with no
    /// finite logit returns 0 (an empty row too: callers must not pass one).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let step = self.step;
        self.step += 1;
        FUSED_DRAWS.fetch_add(1, Ordering::Relaxed);
        let z = self.chain.prepare_logits(logits, history, &self.params);
        let argmax_token = row_argmax(z);
        let z_max = z
            .get(argmax_token as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY);
        if self.params.is_greedy() || z_max == f32::NEG_INFINITY {
            GREEDY_DRAWS.fetch_add(1, Ordering::Relaxed);
            announce(SamplingPath::FusedGreedy);
            return argmax_token;
        }
        let params = &self.params;
        let filtered = (params.top_k > 0 && params.top_k < z.len())
            || params.top_p < 1.0
            || params.min_p > 0.0;
        if !filtered {
            GUMBEL_DRAWS.fetch_add(1, Ordering::Relaxed);
            announce(SamplingPath::FusedGumbel);
            let inverse_temperature = 1.0 / params.temperature as f64;
            return gumbel_argmax(z, z_max, inverse_temperature, self.key, step, true)
                .unwrap_or(argmax_token);
        }
        let outcome = sample_filtered(
            z,
            z_max,
            params,
            self.key,
            step,
            self.max_rejection_rounds,
            &mut self.scratch,
        );
        match outcome {
            RejectionOutcome::Accepted { token, rounds } => {
                REJECTION_DRAWS.fetch_add(1, Ordering::Relaxed);
                REJECTION_ROUNDS.fetch_add(rounds as u64, Ordering::Relaxed);
                announce(SamplingPath::FusedRejection);
                token
            }
            RejectionOutcome::Fallback { rounds } => {
                FALLBACKS.fetch_add(1, Ordering::Relaxed);
                REJECTION_ROUNDS.fetch_add(rounds as u64, Ordering::Relaxed);
                announce(SamplingPath::FusedFallback);
                self.fallback(logits, history, step)
            }
        }
    }

    /// The reference chain's categorical, drawn with the Philox uniform of `(step, Fallback)`.
    fn fallback(&mut self, logits: &[f32], history: &[u32], step: u64) -> u32 {
        let block = draw_block(self.key, step, DrawPurpose::Fallback, 0);
        let uniform = open_uniform_f64_from_u64(block[0], block[1]);
        match self.chain.run(logits, history, &self.params) {
            ChainOutcome::Greedy { token } => token,
            ChainOutcome::Categorical(categorical) => {
                match inverse_cdf(categorical.weights, uniform) {
                    Some(index) => categorical.tokens[index],
                    None => categorical.tokens.first().copied().unwrap_or(0),
                }
            }
        }
    }
}

/// Which sampler implementation a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SamplerKind {
    /// [`FusedSampler`]: Philox, Gumbel-max, dual-pivot rejection; never sorts.
    Fused,
    /// The sort-based reference [`Sampler`] (ChaCha20 stream).
    Reference,
}

impl SamplerKind {
    /// The kind used when [`SAMPLER_ENV_VAR`] is unset or empty: the fused sampler, chosen by
    /// measurement (`pagoda bench sampling`: 2.4x to 8x faster than the reference on every
    /// configuration at vocabularies 49152 and 151936, about 3x on the CLI's default chain;
    /// `docs/benchmark_results/sampling-cpu-2026-11-29.md`).
    pub const DEFAULT: SamplerKind = SamplerKind::Fused;

    /// The [`SAMPLER_ENV_VAR`] setting of `config` (`PAGODA_SAMPLER` or `--sampler`, checked
    /// when `config` was resolved; unset gives [`SamplerKind::DEFAULT`]).
    pub fn from_config(config: &pagoda_config::Config) -> SamplerKind {
        config
            .word(SAMPLER_ENV_VAR)
            .parse()
            .unwrap_or(SamplerKind::DEFAULT)
    }
}

impl std::str::FromStr for SamplerKind {
    type Err = String;
    /// Parses `fused` or `reference` (ASCII case and surrounding spaces ignored).
    fn from_str(text: &str) -> Result<SamplerKind, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "fused" => Ok(SamplerKind::Fused),
            "reference" => Ok(SamplerKind::Reference),
            _ => Err(format!(
                "unknown sampler `{text}`; expected `fused` or `reference`"
            )),
        }
    }
}

impl fmt::Display for SamplerKind {
    /// `fused` or `reference` (the spelling [`SamplerKind::from_config`] accepts).
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            SamplerKind::Fused => "fused",
            SamplerKind::Reference => "reference",
        })
    }
}

/// One request's sampler, either kind, behind one API (enum dispatch, no allocation).
// The reference variant carries ChaCha20's state inline; one sampler lives per request and is
// not moved per step, so boxing it would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum AnySampler {
    /// The fused sampler.
    Fused(FusedSampler),
    /// The reference sampler.
    Reference(Sampler),
}

impl AnySampler {
    /// Builds the sampler of `kind` for `params` (validated; the error names the bad field).
    pub fn new(params: SamplingParams, kind: SamplerKind) -> Result<Self, InvalidSamplingParam> {
        Ok(match kind {
            SamplerKind::Fused => AnySampler::Fused(FusedSampler::new(params)?),
            SamplerKind::Reference => AnySampler::Reference(Sampler::new(params)?),
        })
    }

    /// Which kind this is.
    pub fn kind(&self) -> SamplerKind {
        match self {
            AnySampler::Fused(_) => SamplerKind::Fused,
            AnySampler::Reference(_) => SamplerKind::Reference,
        }
    }

    /// Samples the next token; see [`FusedSampler::sample`] and [`Sampler::sample`]. Reference
    /// calls are counted in [`SamplingCounters::reference_draws`].
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        match self {
            AnySampler::Fused(sampler) => sampler.sample(logits, history),
            AnySampler::Reference(sampler) => {
                REFERENCE_DRAWS.fetch_add(1, Ordering::Relaxed);
                announce(SamplingPath::Reference);
                sampler.sample(logits, history)
            }
        }
    }

    /// The seed actually used (replayable with `seed: Some(seed())` and the same kind).
    pub fn seed(&self) -> u64 {
        match self {
            AnySampler::Fused(sampler) => sampler.seed(),
            AnySampler::Reference(sampler) => sampler.seed(),
        }
    }

    /// The parameters the sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        match self {
            AnySampler::Fused(sampler) => sampler.params(),
            AnySampler::Reference(sampler) => sampler.params(),
        }
    }
}

/// Index of the largest value of a sanitised row (no NaN), lowest index on ties; 0 for a row
/// with nothing above `-inf` (or an empty one): the chain's `argmax` on such rows (a test
/// compares them). One vectorisable maximum pass (16 vertical lanes), then a scan for its
/// first occurrence.
fn row_argmax(z: &[f32]) -> u32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut groups = z.chunks_exact(16);
    for group in &mut groups {
        for lane in 0..16 {
            lanes[lane] = if group[lane] > lanes[lane] {
                group[lane]
            } else {
                lanes[lane]
            };
        }
    }
    let mut maximum = f32::NEG_INFINITY;
    for value in lanes.into_iter().chain(groups.remainder().iter().copied()) {
        maximum = if value > maximum { value } else { maximum };
    }
    if maximum == f32::NEG_INFINITY {
        return 0;
    }
    z.iter().position(|&value| value == maximum).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::argmax;

    /// `row_argmax` against the chain's scalar `argmax` on ragged rows with ties, masks,
    /// signed zeros and empty / all-masked rows.
    #[test]
    fn row_argmax_matches_the_chain() {
        let mut state = 7u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for trial in 0..2000usize {
            let length = (next() % 300) as usize;
            let row: Vec<f32> = (0..length)
                .map(|_| match next() % 6 {
                    0 => f32::NEG_INFINITY,
                    1 => -0.0,
                    2 => 0.0,
                    _ => (next() % 9) as f32 - [4.0, 40.0][trial % 2],
                })
                .collect();
            assert_eq!(row_argmax(&row), argmax(&row), "trial {trial}: {row:?}");
        }
        assert_eq!(row_argmax(&[]), 0);
        assert_eq!(row_argmax(&[f32::NEG_INFINITY; 40]), 0);
    }
}
