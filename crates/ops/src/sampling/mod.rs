//! Token sampling: the canonical chain, its exact distribution, and the sort-based CPU
//! reference sampler that every faster sampler is tested against.
//!
//! # The canonical chain
//!
//! For one logit row `logits` (length = vocabulary size `V`), the sequence's `history` and
//! validated [`SamplingParams`]:
//!
//! 1. **Penalties** on the raw logits ([`apply_penalties`]), from the last `penalty_last_n`
//!    history tokens: repetition (positive logits divided, non-positive multiplied), then
//!    `logit -= count * frequency_penalty + (count > 0) * presence_penalty`. Call the result `z`.
//!    NaN logits count as `-inf`, `+inf` as `f32::MAX`.
//! 2. **Greedy** if `temperature == 0` or `top_k == 1`: `argmax z`, lowest id on ties, no
//!    randomness consumed. A row with no finite `z` also yields token 0 without a draw.
//! 3. **Filters on the untempered distribution** `p = softmax(z)` (never on `z / T`):
//!    - top-k: keep `p_i >= p_(k)`, the k-th largest (ties at the boundary are all kept, so
//!      the set can exceed k; this is the threshold form the rejection sampler reproduces);
//!    - top-p: over the top-k set renormalised (as llama.cpp does), keep token `i` if the mass
//!      of strictly more probable tokens is `< top_p`: the smallest most-probable set with
//!      mass `>= top_p`, its boundary tie group included; the most probable token always stays;
//!    - min-p: keep `p_i >= min_p * p_max` (computed as `exp(z_i - z_max) >= min_p` in f64, so
//!      it is active at any vocabulary size).
//!
//!    Each filter keeps an upper set of `z`, so the survivors are exactly
//!    `{i : z_i >= min_kept_logit}` (see [`Categorical`]). Disabled: `top_k == 0` (or
//!    `>= V`), `top_p == 1`, `min_p == 0`.
//! 4. **Temperature** last, on the survivors: weight `exp((z_i - z_max) / T)`.
//! 5. **Draw**: one f64 uniform in `[0, 1)` ([`uniform_f64`], 53 bits, cannot reach 1.0) from
//!    the sequence's ChaCha20 RNG, then [`inverse_cdf`] over the survivors in ascending id
//!    order, which can never return a zero-weight (or `-inf`) token.
//!
//! [`effective_distribution`] returns the exact vector stage 5 draws from. All arithmetic
//! after the penalties (which are f32, as in llama.cpp) is f64.
//!
//! # The fused sampler (sorting-free)
//!
//! [`FusedSampler`] samples from the same [`effective_distribution`] with a different
//! random stream (the same support exactly; inside it, the rejection path draws with
//! canonical f32 weights, within 3e-6 of the f64 ones, so that the GPU gets the same bits):
//! stage 1 is the chain's own [`SamplingChain::prepare_logits`]; greedy as
//! above; with no filter active, Gumbel-max ([`gumbel_argmax`]); with any filter, dual-pivot
//! rejection (the `rejection` module documents the threshold tests, including top-k + top-p
//! renormalised over the top-k set exactly as in stage 3, and the counted fallback to the
//! chain). Randomness is Philox-4x32-10 keyed by the request seed, counter
//! `(index, step, purpose)` ([`philox`]), so each token is a pure function of
//! `(seed, step, logits, history, params)`. [`SamplerKind`] / [`AnySampler`] choose between the
//! two samplers (`PAGODA_SAMPLER=fused|reference`); [`sampling_counters`] reports which path
//! ran.
//!
//! Not in the chain yet: token bias, DRY, XTC (the API layer can fold a token bias into the
//! logits before calling).

mod chain;
pub mod cuda;
mod fused;
mod gumbel;
mod logprobs;
mod params;
mod penalties;
pub mod philox;
mod reference;
mod rejection;
pub mod speculative;
mod weights;

pub use chain::{argmax, effective_distribution, Categorical, ChainOutcome, SamplingChain};
pub use fused::{
    sampling_counters, AnySampler, FusedSampler, SamplerKind, SamplingCounters, SAMPLER_ENV_VAR,
};
pub use gumbel::{gumbel_argmax, gumbel_noise};
pub use logprobs::{log_softmax, top_logprobs};
pub use params::{
    InvalidSamplingParam, SamplingParams, DEFAULT_PENALTY_LAST_N, MAX_ABS_ADDITIVE_PENALTY,
    MAX_REPETITION_PENALTY, MAX_TEMPERATURE,
};
pub use penalties::apply_penalties;
pub use reference::{inverse_cdf, uniform_f64, Sampler};
pub use rejection::DEFAULT_MAX_REJECTION_ROUNDS;
