//! GPU sampling tests of the launch paths (ignored without `--include-ignored`: they need a GPU;
//! elsewhere): the fast filtered pipeline against the exact kernel and the CPU `FusedSampler`
//! on rows of many shapes, the cluster kernel against the exact kernel, and the Gumbel
//! launches without a row-maximum pass. The
//! distribution tests are in `gpu_sampling.rs`.

#[path = "gpu_common/mod.rs"]
mod common;

use common::sampling::*;
use common::*;
use pagoda_ops::cuda::{
    ClusterShape, FilteredSampling, SamplingMix, SamplingOptions, SamplingRowParams,
};

/// Filtered rows of many shapes: temperatures 0.1 to 3, top-p 0.3 to 0.999, top-k, min-p and
/// their combinations, on logits of several spreads.
fn filtered_batch(vocab: usize, rows: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<SamplingRowParams>) {
    let mut rng = rng(seed);
    let temperatures = [0.1f32, 0.5, 0.8, 1.0, 1.7, 3.0];
    let top_ps = [0.3f32, 0.7, 0.9, 0.95, 0.999];
    let mut logits = Vec::new();
    let mut params = Vec::new();
    for index in 0..rows {
        logits.push(random_vec(
            &mut rng,
            vocab,
            [0.5f32, 2.0, 3.0, 8.0][index % 4],
        ));
        let temperature = temperatures[index % temperatures.len()];
        let top_p = top_ps[(index / 2) % top_ps.len()];
        let chain = match index % 5 {
            0 => chain_params(temperature, 0, top_p, 0.0, index as u64),
            1 => chain_params(temperature, 50, top_p, 0.0, index as u64),
            2 => chain_params(temperature, 0, 1.0, 0.02, index as u64),
            3 => chain_params(temperature, 200, 1.0, 0.0, index as u64),
            _ => chain_params(temperature, 40, top_p, 0.05, index as u64),
        };
        params.push(row_params(&chain, 977 * index as u64 + 3));
    }
    (logits, params)
}

#[test]
#[ignore = "needs a GPU"]
fn the_fast_filtered_path_draws_the_exact_kernels_tokens() {
    let gpu = gpu();
    let exact = SamplingOptions {
        filtered: FilteredSampling::Exact,
        ..SamplingOptions::default()
    };
    for (vocab, rows, batches) in [
        (1000usize, 64usize, 20u64),
        (32_768, 64, 4),
        (151_936, 16, 4),
    ] {
        let (mut fast_rows, mut exact_rows, mut equal, mut total) = (0u64, 0u64, 0usize, 0usize);
        for batch in 0..batches {
            let (logits, params) = filtered_batch(vocab, rows, 1000 * batch + vocab as u64);
            let (fast_tokens, totals) =
                sample_batch_with_totals(&gpu, &logits, &params, SamplingOptions::default());
            let exact_tokens = sample_batch(&gpu, &logits, &params, exact);
            equal += fast_tokens
                .iter()
                .zip(&exact_tokens)
                .filter(|(a, b)| a == b)
                .count();
            total += rows;
            let first = fast_tokens
                .iter()
                .zip(&exact_tokens)
                .position(|(a, b)| a != b);
            assert_eq!(
                fast_tokens,
                exact_tokens,
                "V={vocab} batch {batch}: first difference at row {first:?} ({:?})",
                first.map(|row| params[row])
            );
            // Which path finished the rows.
            fast_rows += totals.filtered_fast;
            exact_rows += totals.filtered_exact;
            assert_eq!(totals.filtered_fast + totals.filtered_exact, rows as u64);
        }
        println!(
            "V={vocab}: {equal}/{total} tokens equal; fast path finished {fast_rows}, exact \
             kernel {exact_rows}"
        );
        assert!(
            fast_rows * 10 >= 9 * total as u64,
            "V={vocab}: the fast path finished only {fast_rows} of {total} rows"
        );
    }
    // Without round launches or list rounds, or with stages left out of the mix, every row
    // still gets the same token (on the slower paths).
    let (logits, params) = filtered_batch(32_768, 40, 7);
    let reference = sample_batch(&gpu, &logits, &params, exact);
    let none = SamplingMix::NONE;
    for options in [
        SamplingOptions {
            fast_rounds: Some(0),
            ..SamplingOptions::default()
        },
        SamplingOptions {
            list_rounds: false,
            ..SamplingOptions::default()
        },
        SamplingOptions {
            cluster: false,
            mix: SamplingMix {
                top_k: false,
                ..SamplingMix::ALL
            },
            ..SamplingOptions::default()
        },
        SamplingOptions {
            mix: none,
            ..SamplingOptions::default()
        },
        SamplingOptions {
            mix: SamplingMix {
                top_k: false,
                ..SamplingMix::ALL
            },
            ..SamplingOptions::default()
        },
        // No round launches: the unlisted top-p rows go to the exact kernel.
        SamplingOptions {
            mix: SamplingMix {
                unlisted_top_p: false,
                ..SamplingMix::ALL
            },
            ..SamplingOptions::default()
        },
    ] {
        assert_eq!(
            sample_batch(&gpu, &logits, &params, options),
            reference,
            "{options:?}"
        );
    }
    let (logits, params) = mixed_batch(32_768);
    assert_eq!(
        sample_batch(
            &gpu,
            &logits,
            &params,
            SamplingOptions {
                mix: none,
                ..SamplingOptions::default()
            }
        ),
        sample_batch(&gpu, &logits, &params, SamplingOptions::default()),
        "mixed batch, nothing in the mix"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn gumbel_rows_without_a_row_max_pass_draw_the_same_tokens() {
    let gpu = gpu();
    // No filtered row: the launch's mix leaves the filtered stages out, as forward_sampled's.
    let unfiltered = SamplingMix {
        filtered: false,
        top_k: false,
        ..SamplingMix::ALL
    };
    let on = SamplingOptions {
        mix: unfiltered,
        ..SamplingOptions::default()
    };
    let off = SamplingOptions {
        gumbel_max: false,
        ..on
    };
    for vocab in [1000usize, 151_936] {
        let mut rng = rng(91 + vocab as u64);
        let mut rows = Vec::new();
        let mut params = Vec::new();
        for index in 0..24u64 {
            let mut row = random_vec(&mut rng, vocab, [0.5f32, 3.0, 8.0][index as usize % 3]);
            match index % 8 {
                // Huge logits: the approximate scores' error bound keeps many candidates
                // per split, which overflows into the finish kernel's whole-row scan.
                5 => row.iter_mut().for_each(|v| *v += 1.0e6),
                // Half the ids masked (NaN or -inf), and a row with no finite logit.
                6 => row.iter_mut().enumerate().for_each(|(i, v)| {
                    if i % 2 == 1 {
                        *v = if i % 6 == 1 {
                            f32::NAN
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                }),
                7 if index == 7 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                _ => {}
            }
            rows.push(row);
            let temperature = [0.0f32, 0.05, 0.7, 1.0, 2.5][index as usize % 5];
            params.push(row_params(
                &chain_params(temperature, 0, 1.0, 0.0, index),
                31 * index + 5,
            ));
        }
        let (fused, totals) = sample_batch_with_totals(&gpu, &rows, &params, on);
        assert_eq!(
            totals.gumbel_max_rows,
            rows.len() as u64,
            "V={vocab}: {totals:?}"
        );
        assert_eq!(fused, sample_batch(&gpu, &rows, &params, off), "V={vocab}");
        for (index, (row, record)) in rows.iter().zip(&params).enumerate() {
            let chain = chain_params(record.temperature, 0, 1.0, 0.0, index as u64);
            let mut sampler = pagoda_ops::sampling::FusedSampler::new(chain).unwrap();
            for _ in 0..31 * index as u64 + 5 {
                sampler.sample(row, &[]);
            }
            assert_eq!(
                fused[index],
                sampler.sample(row, &[]),
                "V={vocab} row {index}: GPU vs CPU FusedSampler"
            );
        }
    }
}

/// Rows without top-k (top-p, min-p, both, at several temperatures) among greedy and Gumbel
/// rows, with masked ids, a row with one finite logit and one with none: the launch that runs
/// them in the cluster kernel draws the exact kernel's tokens, in every shape, and the cluster
/// finishes most filtered rows. Launched with a mix that leaves the Gumbel rows out (no Gumbel
/// partials), the Gumbel rows are still drawn right, by `sampling_finish`'s scan of the row.
#[test]
#[ignore = "needs a GPU"]
fn the_cluster_kernel_draws_the_exact_kernels_tokens() {
    let gpu = gpu();
    if gpu.info().compute_capability.0 < 9 {
        println!("SKIP: no thread-block clusters on this GPU");
        return;
    }
    let no_top_k = SamplingMix {
        top_k: false,
        ..SamplingMix::ALL
    };
    let exact = SamplingOptions {
        filtered: FilteredSampling::Exact,
        mix: no_top_k,
        ..SamplingOptions::default()
    };
    let clustered = SamplingOptions {
        mix: no_top_k,
        ..SamplingOptions::default()
    };
    let temperatures = [0.1f32, 0.5, 1.0, 1.0, 1.7, 3.0];
    let top_ps = [0.3f32, 0.7, 0.9, 0.95, 0.999];
    for (vocab, rows, batches) in [
        (1000usize, 64usize, 10u64),
        (32_768, 64, 3),
        // 64 rows: more CTAs than SMs, so in every shape but 1024x1 each CTA holds part of
        // its slice in shared memory and reads the rest from global memory
        // (`ClusterShape::held`).
        (151_936, 64, 3),
    ] {
        let (mut cluster_rows, mut filtered_rows) = (0u64, 0u64);
        for batch in 0..batches {
            let mut rng = rng(7000 + 31 * batch + vocab as u64);
            let mut logits = Vec::new();
            let mut params = Vec::new();
            for index in 0..rows {
                let mut row = random_vec(&mut rng, vocab, [0.5f32, 2.0, 3.0, 8.0][index % 4]);
                match index % 11 {
                    // Half the ids masked.
                    7 => row
                        .iter_mut()
                        .step_by(2)
                        .for_each(|v| *v = f32::NEG_INFINITY),
                    // One finite logit.
                    8 => row.iter_mut().skip(1).for_each(|v| *v = f32::NAN),
                    // No finite logit.
                    9 if batch == 0 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                    _ => {}
                }
                logits.push(row);
                let temperature = temperatures[index % temperatures.len()];
                let top_p = top_ps[(index / 2) % top_ps.len()];
                let chain = match index % 6 {
                    0 => chain_params(0.0, 0, 1.0, 0.0, index as u64),
                    1 => chain_params(temperature, 0, 1.0, 0.0, index as u64),
                    2 | 3 => chain_params(temperature, 0, top_p, 0.0, index as u64),
                    4 => chain_params(temperature, 0, 1.0, 0.05, index as u64),
                    _ => chain_params(temperature, 0, top_p, 0.02, index as u64),
                };
                filtered_rows += (index % 6 >= 2) as u64;
                params.push(row_params(&chain, 31 * index as u64 + batch));
            }
            let reference = sample_batch(&gpu, &logits, &params, exact);
            // Every shape, then the default without Gumbel rows in the mix.
            let runs = ClusterShape::CANDIDATES
                .iter()
                .map(|&shape| (shape, true))
                .chain([(ClusterShape::DEFAULT, false)]);
            for (cluster_shape, gumbel) in runs {
                let options = SamplingOptions {
                    cluster_shape,
                    mix: SamplingMix {
                        gumbel,
                        ..clustered.mix
                    },
                    ..clustered
                };
                let (tokens, totals) = sample_batch_with_totals(&gpu, &logits, &params, options);
                let first = tokens.iter().zip(&reference).position(|(a, b)| a != b);
                assert_eq!(
                    tokens,
                    reference,
                    "V={vocab} batch {batch} shape {cluster_shape}, Gumbel in the mix {gumbel}: \
                     first difference at row {first:?} ({:?})",
                    first.map(|row| params[row])
                );
                // Every row counted once, on its path.
                assert_eq!(
                    totals.greedy + totals.gumbel + totals.rejection,
                    rows as u64,
                    "V={vocab} batch {batch} shape {cluster_shape}, Gumbel in the mix {gumbel}"
                );
                if cluster_shape == ClusterShape::DEFAULT && gumbel {
                    cluster_rows += totals.cluster_rows;
                }
            }
        }
        println!("V={vocab}: the cluster kernel finished {cluster_rows} of {filtered_rows} filtered rows");
        assert!(
            cluster_rows * 10 >= 8 * filtered_rows,
            "V={vocab}: the cluster kernel finished only {cluster_rows} of {filtered_rows} rows"
        );
    }
}
