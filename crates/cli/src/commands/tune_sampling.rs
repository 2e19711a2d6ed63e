//! `pagoda tune --kernels sampling`: how many CTAs share one row of logits in the GPU
//! samplers, per rows bucket (powers of two) at the model's vocabulary.
//!
//! Two families, each tuned on the configuration that runs it: plain sampling at
//! temperature 1 (the Gumbel-max kernel's `num_splits`) and top-p 0.9 (the filtered
//! pipeline's `filter_splits`). Every candidate split count (powers of two up to the most
//! that keep 1,024 logits a split, or 512 for the filtered pipeline, and at most
//! `MAX_SAMPLING_SPLITS`) is captured in one CUDA graph over rotating logits sets of at least
//! 4x the L2 and raced in alternating rounds with the built-in rule (candidate 0), which a
//! winner must beat by 1% to be stored. Split counts never change the drawn tokens; the
//! race checks it (every candidate's tokens equal the rule's).

use anyhow::{Context, Result};
use pagoda_cuda::{CapturedGraph, DeviceBuffer, Gpu};
use pagoda_ops::cuda::{
    encode_row_params, filter_splits, sample_rows_with, sampling_splits, SamplingMix,
    SamplingOptions, SamplingRowParams, SamplingWorkspace, TuningTable, MAX_SAMPLING_SPLITS,
};
use pagoda_ops::tuned_choices::{row_bucket, ChoiceFamily, TunedChoice};

use super::bench_sampling::randn_rows;
use super::bench_sampling_gpu::{rotating_sets, LOGIT_SCALE};
use super::decode_rig::{time_replays, warm_capture};
use super::tune_race::{race, winner_label, Timed};

/// One candidate's graph over the rotating sets, and its tokens (checked against the rule's).
struct SplitGraph {
    graph: CapturedGraph,
    sets: usize,
    tokens: Vec<DeviceBuffer<u32>>,
}

impl Timed for SplitGraph {
    fn time(&self, gpu: &Gpu, count: usize) -> Result<Vec<f64>> {
        time_replays(gpu, &self.graph, count, self.sets)
    }
}

/// The candidate split counts of `family` for `rows` rows of `vocab` logits: the rule's
/// first, then every other power of two within the family's limits.
pub fn split_candidates(
    family: ChoiceFamily,
    rows: usize,
    vocab: usize,
    sm_count: usize,
) -> Vec<usize> {
    let (rule, logits_per_split) = match family {
        ChoiceFamily::FilterSplits => (filter_splits(rows, vocab, sm_count), 512),
        _ => (sampling_splits(rows, vocab, sm_count), 1024),
    };
    let limit = (vocab / logits_per_split).clamp(1, MAX_SAMPLING_SPLITS);
    let cap = 1usize << limit.ilog2();
    let others = (0..=cap.ilog2())
        .map(|e| 1usize << e)
        .filter(|&s| s != rule);
    std::iter::once(rule).chain(others).collect()
}

/// Tunes both sampler families at `vocab` for every bucket of `rows_buckets`.
pub fn tune_sampling(
    gpu: &Gpu,
    vocab: usize,
    rows_buckets: &[usize],
    (rounds, replays): (usize, usize),
    table: &mut TuningTable,
) -> Result<()> {
    let sm_count = gpu.info().sm_count as usize;
    let l2_bytes = gpu.info().l2_cache_bytes as usize;
    let max_rows = rows_buckets.iter().copied().max().unwrap_or(1);
    let mut workspace = SamplingWorkspace::new(gpu, max_rows, vocab)?;
    println!(
        "{:>4} {:>7} {:>8} {:>12} {:>10} {:>8}  winner (sampler splits)",
        "rows", "vocab", "family", "heuristic us", "tuned us", "speedup"
    );
    for &rows in rows_buckets {
        let sets = rotating_sets(rows * vocab * 4, l2_bytes);
        let host = randn_rows(sets * rows, vocab, LOGIT_SCALE, 0x7u64 ^ rows as u64);
        let logits = host
            .chunks_exact(rows * vocab)
            .map(|set| gpu.upload(set))
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("uploading {sets} sets of {rows} x {vocab} logits"))?;
        for family in [ChoiceFamily::SamplingSplits, ChoiceFamily::FilterSplits] {
            let top_p = if family == ChoiceFamily::FilterSplits {
                0.9
            } else {
                1.0
            };
            let mut params = Vec::with_capacity(sets);
            let mut mix = SamplingMix::ALL;
            for set in 0..sets {
                let row_params = (0..rows)
                    .map(|row| SamplingRowParams::new(1.0, 0, top_p, 0.0, row as u64, set as u64))
                    .collect::<Result<Vec<_>, _>>()?;
                mix = SamplingMix::of(&row_params, vocab);
                params.push(gpu.upload(&encode_row_params(&row_params)?)?);
            }
            let candidates = split_candidates(family, rows, vocab, sm_count);
            let mut graphs = Vec::with_capacity(candidates.len());
            for &splits in &candidates {
                let options = SamplingOptions {
                    num_splits: (family == ChoiceFamily::SamplingSplits).then_some(splits),
                    filter_splits: (family == ChoiceFamily::FilterSplits).then_some(splits),
                    mix,
                    ..SamplingOptions::default()
                };
                let mut tokens = (0..sets)
                    .map(|_| gpu.zeros::<u32>(rows))
                    .collect::<Result<Vec<_>, _>>()?;
                let graph = {
                    let mut record = |gpu: &Gpu| -> Result<(), pagoda_cuda::CudaError> {
                        for ((set_logits, set_params), out) in
                            logits.iter().zip(&params).zip(&mut tokens)
                        {
                            sample_rows_with(
                                gpu,
                                set_logits,
                                vocab,
                                set_params,
                                &mut workspace,
                                out,
                                options,
                            )?;
                        }
                        Ok(())
                    };
                    warm_capture(gpu, &mut record)?
                };
                graphs.push(SplitGraph {
                    graph,
                    sets,
                    tokens,
                });
            }
            // Any split count draws the same tokens: the rule's are the reference.
            let reference = graphs[0]
                .tokens
                .iter()
                .map(|t| gpu.download(t))
                .collect::<Result<Vec<_>, _>>()?;
            for (graph, &splits) in graphs.iter().zip(&candidates).skip(1) {
                for (set, (tokens, expected)) in graph.tokens.iter().zip(&reference).enumerate() {
                    anyhow::ensure!(
                        &gpu.download(tokens)? == expected,
                        "{} split count {splits} drew other tokens than the rule's \
                         ({rows} rows, set {set})",
                        family_name(family)
                    );
                }
            }
            let verdict = race(gpu, &graphs, rounds, replays)?;
            let winner = candidates[verdict.best];
            if verdict.stored {
                table.insert_choice(TunedChoice {
                    family,
                    shape: vec![row_bucket(rows), vocab],
                    dtype: "f32".into(),
                    choice: winner.to_string(),
                    tuned_us: verdict.best_us,
                    heuristic_us: verdict.heuristic_us,
                });
            }
            println!(
                "{rows:>4} {vocab:>7} {:>8} {:>12.1} {:>10.1} {:>7.3}x  {}",
                family_name(family),
                verdict.heuristic_us,
                verdict.best_us,
                verdict.heuristic_us / verdict.best_us,
                winner_label(
                    verdict.best,
                    verdict.stored,
                    format!("the rule ({})", candidates[0]),
                    format!("{winner} splits")
                )
            );
        }
    }
    Ok(())
}

fn family_name(family: ChoiceFamily) -> &'static str {
    match family {
        ChoiceFamily::SamplingSplits => "gumbel",
        ChoiceFamily::FilterSplits => "filtered",
        ChoiceFamily::Linear => "linear",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_start_with_the_rule_and_stay_within_the_limits() {
        for family in [ChoiceFamily::SamplingSplits, ChoiceFamily::FilterSplits] {
            for rows in [1, 4, 64, 256] {
                for vocab in [1000, 32_000, 128_256] {
                    let all = split_candidates(family, rows, vocab, 132);
                    let rule = match family {
                        ChoiceFamily::FilterSplits => filter_splits(rows, vocab, 132),
                        _ => sampling_splits(rows, vocab, 132),
                    };
                    assert_eq!(all[0], rule);
                    let unique: std::collections::HashSet<_> = all.iter().collect();
                    assert_eq!(unique.len(), all.len(), "{all:?}");
                    assert!(all.iter().all(|s| s.is_power_of_two()));
                    assert!(all.iter().all(|&s| s <= MAX_SAMPLING_SPLITS));
                }
            }
        }
        // 128256 logits: up to 64 Gumbel splits of 1024+ logits, 128 filtered of 512+.
        let gumbel = split_candidates(ChoiceFamily::SamplingSplits, 1, 128_256, 132);
        assert_eq!(gumbel.iter().max(), Some(&64));
        let filtered = split_candidates(ChoiceFamily::FilterSplits, 1, 128_256, 132);
        assert_eq!(filtered.iter().max(), Some(&128));
    }
}
