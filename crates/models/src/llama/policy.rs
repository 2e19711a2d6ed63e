//! How a forward pass routes attention: the auto threshold between gather and split-KV, and
//! the split-KV chunk size.

use pagoda_ops::attention::{AttentionPath, CascadeRule, DEFAULT_CHUNK_TOKENS};

/// The environment variable that overrides the split-KV chunk size (a positive number of
/// tokens; for measurement: a row's bits depend on it).
pub const SPLIT_KV_CHUNK_ENV_VAR: &str = "PAGODA_SPLIT_KV_CHUNK_TOKENS";

/// Visible tokens per split-KV chunk in `config`: the [`SPLIT_KV_CHUNK_ENV_VAR`] setting
/// when it holds a number, else [`DEFAULT_CHUNK_TOKENS`]. The engine resolves it once and
/// sets it on the model ([`Model::set_split_kv_chunk_tokens`](super::Model::set_split_kv_chunk_tokens)).
pub fn split_kv_chunk_tokens(config: &pagoda_config::Config) -> usize {
    config
        .number(SPLIT_KV_CHUNK_ENV_VAR)
        .map_or(DEFAULT_CHUNK_TOKENS, |tokens| tokens as usize)
}

/// The environment variable of cascade attention on the CPU: `off`, `on` (any two decode
/// rows sharing a whole split-KV chunk of leading pages read it once) or `auto`
/// ([`AUTO_CASCADE_RULE`]).
pub const CASCADE_ENV_VAR: &str = "PAGODA_CASCADE_ATTENTION";

/// `auto`'s rule: a group's shared chunks run as cascade items when it saves at least 1024
/// token reads per layer (`(members - 1) * shared tokens`: 2 rows behind 1024 shared
/// tokens, 5 behind 256). Measured on the 2-core Xeon, default model, f32 KV
/// (`docs/benchmark_results/cpu-cascade-attention-xeon-2026-12-06.md`): 1.35x at 16 rows
/// behind 256 tokens, 2.0-2.3x at 4 behind 1024, 1.4-2.1x at 4 behind 4096, 2.6x at 16 behind
/// 4096; 2 rows behind 256 (256 reads saved) was within the machine's noise, so it is left
/// out.
pub const AUTO_CASCADE_RULE: CascadeRule = CascadeRule {
    min_members: 2,
    min_shared_tokens: 256,
    min_saved_tokens: 1024,
};

/// Cascade attention's rule in `config` ([`CASCADE_ENV_VAR`]): `None` for off. Outputs are
/// the same bits whatever it says (`pagoda_ops::attention::StepAttentionPlan::with_cascade`),
/// so it is a speed choice only and holds in the reproducible default.
pub fn cascade_rule(config: &pagoda_config::Config) -> Option<CascadeRule> {
    match config.word(CASCADE_ENV_VAR) {
        "on" => Some(CascadeRule::ANY),
        "auto" => Some(AUTO_CASCADE_RULE),
        _ => None,
    }
}

/// Auto's threshold, in visible tokens: a query row that sees at least this many tokens runs
/// split-KV, a shorter one gather. One page (16 tokens at the default page size).
///
/// Measured on the 2-core AMD EPYC dev machine (AVX-512 split-KV kernel, default model,
/// `docs/benchmark_results/cpu-split-kv-threshold-epyc-2026-11-30.md`): forced split-KV is at
/// least as fast as gather at every depth, 1 and 2 threads (decode tg64: 1.00x at depth 0,
/// 1.02-1.04x at 16, 1.2x / 1.06x at 128, 1.41x / 1.18x at 511; prefill 32/128/512 tokens:
/// 1.01-1.14x), so the threshold is not set by speed. It is not 0 because rows that short
/// gain nothing measurable, and because the quantized-activation path turns the two paths'
/// float differences (6e-5 logprob with f32 activations) into up to ~1 logprob of Q8 rounding
/// noise: the llama.cpp parity prompts under auto stay inside their top-5 bound of 0.6 at 16
/// (worst 0.5625, as at 512: 0.5608) but not at 0 (0.660). Was 512 while split-KV was scalar.
/// With the row-tiled kernel and 256-token chunks, auto gives 0.562; that statistic moves
/// 0.48-0.82 under rounding-only changes
/// (`docs/benchmark_results/cpu-parity-noise-epyc-2026-12-01.md`).
pub const AUTO_MIN_SPLIT_KV_TOKENS: usize = 16;

/// How a forward pass picks the attention path of each query row.
///
/// BATCH-INVARIANT: the path and the split-KV chunking of a row depend only on that row's own
/// visible length (and on fixed configuration: the chunk size, which does not change within
/// a process), never on the other requests of the step or
/// on whether they prefill or decode. A request's logits are therefore bit-identical alone
/// or batched, and a token gets the same K/V whether it was computed in a prefill chunk, a
/// one-token chunk, a recompute after preemption or a decode step (the linear layers must
/// keep rows independent too). A step may mix gather rows and split-KV rows; each row is
/// computed by exactly one of them. See `pagoda_ops::attention::plan_step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPolicy {
    /// Split-KV for rows that see at least [`AUTO_MIN_SPLIT_KV_TOKENS`] tokens (long
    /// contexts, where spreading one row's KV over the cores pays), gather for shorter rows.
    Auto,
    /// Every row on this path: `Force(Gather)` never splits; `Force(SplitKv)` runs every row
    /// (prefill rows included, short ones as a single chunk) through split-KV.
    Force(AttentionPath),
}

impl AttentionPolicy {
    /// The smallest visible length routed to split-KV (`usize::MAX`: none).
    pub fn min_split_kv_tokens(self) -> usize {
        match self {
            AttentionPolicy::Auto => AUTO_MIN_SPLIT_KV_TOKENS,
            AttentionPolicy::Force(AttentionPath::SplitKv) => 0,
            AttentionPolicy::Force(AttentionPath::Gather) => usize::MAX,
        }
    }
}
