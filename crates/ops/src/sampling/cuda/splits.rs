//! How many CTAs share one row of logits: the split kernels' count (row maxima, Gumbel-max)
//! and the filtered pipeline's. Neither changes the sampled tokens.

use super::params::MAX_SAMPLING_SPLITS;

/// Splits per row of the Gumbel / row-max kernels for `rows` rows of `vocab` logits on a GPU
/// of `sm_count` SMs: the smallest power of two giving at least two CTAs per SM in all,
/// capped at [`MAX_SAMPLING_SPLITS`] and so that every split keeps at least 1024 logits.
/// Past 64 rows (speculative verification samples B x (K+1) rows) at least eight CTAs per SM,
/// splits keeping 8192 logits or more: one CTA per row left the H200 waiting on a tail of
/// long CTAs (80-576 rows of 128256 logits: 1.10-1.28x faster, `pagoda bench sampling
/// --splits`, `docs/benchmark_results/spec-draft-cpu-h200-2026-12-04.md`). The sampled
/// tokens do not depend on it.
pub fn sampling_splits(rows: usize, vocab: usize, sm_count: usize) -> usize {
    let smallest = |wanted: usize, logits_per_split: usize| {
        let limit = (vocab / logits_per_split).clamp(1, MAX_SAMPLING_SPLITS);
        let cap = 1usize << limit.ilog2();
        let mut splits = 1;
        while splits < cap && rows.max(1) * splits < wanted {
            splits *= 2;
        }
        splits
    };
    let splits = smallest(2 * sm_count.max(1), 1024);
    if rows > 64 {
        splits.max(smallest(8 * sm_count.max(1), 8192))
    } else {
        splits
    }
}

/// Splits per row of the filtered pipeline (`sampling_pass`, `sampling_round`, the top-k
/// digits) for `rows` rows of `vocab` logits on `sm_count` SMs: the power of two nearest (in
/// log scale) to `sm_count / sqrt(rows)`, at most [`MAX_SAMPLING_SPLITS`] and at least 512
/// logits each. Measured on the H200 (`pagoda bench sampling --device cuda --filter-splits
/// 8|16|32|64|128`, top-p, top-k + top-p and min-p at V 128256 and 151936): the best split was
/// 128 at batch 1, 32 at batch 16 (10-19% faster than 64) and 16 at batch 64 (top-p 3-7%
/// faster than 8, min-p 11-15% slower); checked at batch 4 and 32. More rows want more
/// logits per CTA, but the rows left after the first round still want many SMs.
pub fn filter_splits(rows: usize, vocab: usize, sm_count: usize) -> usize {
    let limit = (vocab / 512).clamp(1, MAX_SAMPLING_SPLITS);
    let cap = 1usize << limit.ilog2();
    let target = sm_count.max(1) as f64 / (rows.max(1) as f64).sqrt();
    let exponent = target.log2().round().clamp(0.0, 31.0) as u32;
    (1usize << exponent).min(cap)
}
