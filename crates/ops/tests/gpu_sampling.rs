//! GPU sampling tests (ignored without `--include-ignored`: they need a GPU). Oracles:
//! `pagoda_ops::sampling::effective_distribution` (the exact distribution, chi-square with
//! `PAGODA_SAMPLING_DRAWS` draws, default 1e6, p = 1e-6) and the CPU `FusedSampler` (token
//! equality for the same logits, seed and step).

#[path = "gpu_common/mod.rs"]
mod common;

use common::sampling::*;
use common::*;
use pagoda_ops::cuda::{
    self as ops, RowPath, SamplingMix, SamplingOptions, SamplingRowParams, SamplingWorkspace,
};
use pagoda_ops::sampling::{argmax, SamplingParams};

const LARGE_VOCABS: [usize; 2] = [128_256, 151_936];

/// Filter configurations of the issue: top-k, top-p, min-p, top-k + top-p.
fn filters(temperature: f32, seed: u64) -> Vec<(&'static str, SamplingParams)> {
    vec![
        ("top-k 50", chain_params(temperature, 50, 1.0, 0.0, seed)),
        ("top-p 0.9", chain_params(temperature, 0, 0.9, 0.0, seed)),
        ("min-p 0.05", chain_params(temperature, 0, 1.0, 0.05, seed)),
        (
            "top-k 50 + top-p 0.9",
            chain_params(temperature, 50, 0.9, 0.0, seed),
        ),
    ]
}

#[test]
#[ignore = "needs a GPU"]
fn gumbel_rows_follow_the_exact_distribution() {
    let gpu = gpu();
    let draws = draws();
    for (name, row) in shape_rows() {
        for temperature in [0.5f32, 1.0, 2.0] {
            let params = chain_params(temperature, 0, 1.0, 0.0, 11);
            let totals = check_against_chain(
                &gpu,
                &format!("gumbel {name} T={temperature}"),
                &row,
                &params,
                draws,
            );
            assert_eq!(
                totals.gumbel, draws,
                "{name}: every row takes the Gumbel path"
            );
        }
    }
    for vocab in LARGE_VOCABS {
        let row = large_row(vocab, vocab as u64);
        for temperature in [0.5f32, 1.0] {
            let params = chain_params(temperature, 0, 1.0, 0.0, 12);
            check_against_chain(
                &gpu,
                &format!("gumbel V={vocab} T={temperature}"),
                &row,
                &params,
                draws,
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn filtered_rows_follow_the_exact_distribution() {
    let gpu = gpu();
    let draws = draws();
    let mut rng = rng(5);
    let row = random_vec(&mut rng, 1000, 3.0);
    for temperature in [0.5f32, 1.0, 2.0] {
        for (name, params) in filters(temperature, 21) {
            let totals = check_against_chain(
                &gpu,
                &format!("{name} V=1000 T={temperature}"),
                &row,
                &params,
                draws,
            );
            println!(
                "  rounds/draw {:.2}, fallbacks {}",
                totals.rejection_rounds as f64 / draws as f64,
                totals.fallback
            );
            assert_eq!(totals.rejection + totals.fallback, draws);
        }
    }
    for (name, row) in shape_rows() {
        let params = chain_params(1.0, 8, 0.8, 0.02, 22);
        check_against_chain(
            &gpu,
            &format!("top-k 8 + top-p 0.8 + min-p 0.02 {name}"),
            &row,
            &params,
            draws,
        );
    }
    for vocab in LARGE_VOCABS {
        let row = large_row(vocab, 3 * vocab as u64);
        for (name, params) in filters(1.0, 23) {
            let totals =
                check_against_chain(&gpu, &format!("{name} V={vocab} T=1"), &row, &params, draws);
            println!(
                "  rounds/draw {:.2}, fallbacks {}",
                totals.rejection_rounds as f64 / draws as f64,
                totals.fallback
            );
        }
    }
}

/// Top-p rows without top-k launched as `generate` and `serve` launch them (the launch's own
/// mix): on compute capability 9.0+ they take the cluster kernel, with many more rows per
/// launch than clusters fit on the GPU (so later rows are prefetched into L2).
#[test]
#[ignore = "needs a GPU"]
fn cluster_rows_follow_the_exact_distribution() {
    let gpu = gpu();
    let draws = draws();
    let clusters = gpu.info().compute_capability.0 >= 9;
    for vocab in LARGE_VOCABS {
        let row = large_row(vocab, 3 * vocab as u64);
        for temperature in [0.7f32, 1.0, 1.5] {
            for (name, params) in [
                ("top-p 0.9", chain_params(temperature, 0, 0.9, 0.0, 41)),
                (
                    "top-p 0.8 + min-p 0.02",
                    chain_params(temperature, 0, 0.8, 0.02, 42),
                ),
            ] {
                let options = SamplingOptions {
                    mix: SamplingMix::of(&[row_params(&params, 0)], vocab),
                    ..SamplingOptions::default()
                };
                let what = format!("{name} V={vocab} T={temperature}, launch mix");
                let totals = check_against_chain_with(&gpu, &what, &row, &params, draws, options);
                println!(
                    "  cluster rows {}, prefetched {}, exact {}",
                    totals.cluster_rows, totals.prefetched_rows, totals.filtered_exact
                );
                assert_eq!(totals.rejection + totals.fallback, draws, "{what}");
                if clusters {
                    assert_eq!(totals.cluster_rows + totals.filtered_exact, draws, "{what}");
                    assert!(totals.cluster_rows * 100 >= draws * 99, "{what}");
                    assert!(totals.prefetched_rows > 0, "{what}");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_logit_100_above_the_rest_wins_every_draw() {
    let gpu = gpu();
    let draws = draws();
    for vocab in [4096usize, 151_936] {
        let mut rng = rng(vocab as u64);
        let mut row = random_vec(&mut rng, vocab, 1.0);
        let winner = vocab / 3 + 1;
        row[winner] = 101.0;
        for params in [
            chain_params(1.0, 0, 1.0, 0.0, 31),
            chain_params(2.0, 0, 1.0, 0.0, 32),
            chain_params(1.0, 0, 0.9, 0.0, 33),
            chain_params(1.5, 40, 0.95, 0.0, 34),
        ] {
            let (counts, _) = draw_counts(&gpu, &row, &params, draws, SamplingOptions::default());
            println!(
                "V={vocab} {params:?}: winner drawn {} of {draws}",
                counts[winner]
            );
            assert_eq!(counts[winner], draws, "V={vocab}: another token was drawn");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn masked_tokens_are_never_drawn() {
    let gpu = gpu();
    let mut rng = rng(41);
    let vocab = 151_936;
    let mut row = random_vec(&mut rng, vocab, 2.0);
    for (index, value) in row.iter_mut().enumerate() {
        if index % 2 == 1 {
            *value = if index % 6 == 1 {
                f32::NAN
            } else {
                f32::NEG_INFINITY
            };
        }
    }
    for params in [
        chain_params(2.0, 0, 1.0, 0.0, 42),
        chain_params(2.0, 0, 0.99, 0.0, 43),
        chain_params(2.0, 5000, 1.0, 0.0, 44),
        chain_params(2.0, 0, 1.0, 0.001, 45),
    ] {
        let (counts, _) = draw_counts(&gpu, &row, &params, 200_000, SamplingOptions::default());
        let masked: u64 = counts.iter().skip(1).step_by(2).sum();
        assert_eq!(masked, 0, "{params:?}: masked tokens drawn");
    }
    // A row with no finite logit gives token 0 without randomness, as the CPU chain.
    let dead = vec![f32::NEG_INFINITY; 300];
    for params in [
        chain_params(1.0, 0, 1.0, 0.0, 1),
        chain_params(1.0, 10, 0.5, 0.1, 2),
    ] {
        assert_eq!(
            gpu_tokens(&gpu, &dead, &params, 8, SamplingOptions::default()),
            vec![0; 8]
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn greedy_rows_take_the_argmax() {
    let gpu = gpu();
    let mut rng = rng(51);
    for vocab in [7usize, 1000, 151_936] {
        let mut row = random_vec(&mut rng, vocab, 3.0);
        // Ties: the lowest id must win.
        let top = vocab / 2;
        row[top] = 9.0;
        row[vocab - 1] = 9.0;
        for params in [
            chain_params(0.0, 0, 1.0, 0.0, 1),
            chain_params(1.3, 1, 0.7, 0.1, 2),
        ] {
            let tokens = gpu_tokens(&gpu, &row, &params, 4, SamplingOptions::default());
            assert_eq!(tokens, vec![argmax(&row); 4], "V={vocab} {params:?}");
            assert_eq!(tokens[0] as usize, top.min(vocab - 1));
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn tokens_do_not_depend_on_batch_position_or_split() {
    let gpu = gpu();
    for vocab in [1000usize, 151_936] {
        let (rows, params) = mixed_batch(vocab);
        let reference = sample_batch(&gpu, &rows, &params, SamplingOptions::default());
        for splits in [1usize, 2, 8, 64, 128] {
            let options = SamplingOptions {
                num_splits: Some(splits),
                ..SamplingOptions::default()
            };
            assert_eq!(
                sample_batch(&gpu, &rows, &params, options),
                reference,
                "V={vocab} splits {splits}"
            );
        }
        let reversed: Vec<u32> = {
            let rows: Vec<Vec<f32>> = rows.iter().rev().cloned().collect();
            let params: Vec<SamplingRowParams> = params.iter().rev().copied().collect();
            let mut tokens = sample_batch(&gpu, &rows, &params, SamplingOptions::default());
            tokens.reverse();
            tokens
        };
        assert_eq!(reversed, reference, "V={vocab}: reversed batch");
        for index in [0usize, 5, 17, 36] {
            let alone = sample_batch(
                &gpu,
                &rows[index..=index],
                &params[index..=index],
                SamplingOptions::default(),
            );
            assert_eq!(alone[0], reference[index], "V={vocab}: row {index} alone");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_tokens_equal_the_cpu_fused_sampler() {
    let gpu = gpu();
    assert_eq!(
        ops::DEFAULT_MAX_REJECTION_ROUNDS,
        pagoda_ops::sampling::DEFAULT_MAX_REJECTION_ROUNDS
    );
    for (vocab, steps) in [(1000usize, 20_000u64), (32_768, 4000), (151_936, 1000)] {
        let row = large_row(vocab, 71 + vocab as u64);
        let mut configs = vec![
            ("unfiltered T=0.5", chain_params(0.5, 0, 1.0, 0.0, 72)),
            ("unfiltered T=1", chain_params(1.0, 0, 1.0, 0.0, 73)),
            (
                "unfiltered T=2",
                chain_params(2.0, 0, 1.0, 0.0, u64::MAX - 3),
            ),
        ];
        configs.extend(filters(0.8, 74));
        configs.push((
            "top-k 40 + top-p 0.95 + min-p 0.05 T=0.8",
            chain_params(0.8, 40, 0.95, 0.05, 75),
        ));
        for (name, params) in configs {
            let cpu = cpu_tokens(&row, &params, steps, None);
            let gpu_side = gpu_tokens(&gpu, &row, &params, steps, SamplingOptions::default());
            let matches = cpu.iter().zip(&gpu_side).filter(|(a, b)| a == b).count();
            println!("V={vocab} {name}: {matches}/{steps} tokens equal to FusedSampler");
            let first = cpu.iter().zip(&gpu_side).position(|(a, b)| a != b);
            assert_eq!(
                matches as u64, steps,
                "V={vocab} {name}: first difference at step {first:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn the_exact_fallback_matches_the_cpu_and_the_distribution() {
    let gpu = gpu();
    let no_rounds = SamplingOptions {
        max_rejection_rounds: 0,
        ..SamplingOptions::default()
    };
    for vocab in [1000usize, 151_936] {
        let row = large_row(vocab, 81 + vocab as u64);
        for (name, params) in filters(0.9, 82) {
            let cpu = cpu_tokens(&row, &params, 2000, Some(0));
            let gpu_side = gpu_tokens(&gpu, &row, &params, 2000, no_rounds);
            let matches = cpu.iter().zip(&gpu_side).filter(|(a, b)| a == b).count();
            println!("fallback V={vocab} {name}: {matches}/2000 equal to FusedSampler(cap 0)");
            assert_eq!(matches, 2000, "fallback V={vocab} {name}");
            let draws = draws() / 5;
            let (counts, totals) = draw_counts(&gpu, &row, &params, draws, no_rounds);
            assert_eq!(totals.fallback, draws, "every row counted as a fallback");
            let probabilities = pagoda_ops::sampling::effective_distribution(&row, &[], &params);
            assert_distribution(
                &format!("fallback V={vocab} {name}"),
                &counts,
                &probabilities,
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn stats_and_totals_count_every_row() {
    let gpu = gpu();
    let vocab = 1000;
    let (rows, params) = mixed_batch(vocab);
    let flat: Vec<f32> = rows.concat();
    let logits = gpu.upload(&flat).unwrap();
    let params_d = gpu
        .upload(&ops::encode_row_params(&params).unwrap())
        .unwrap();
    let mut workspace = SamplingWorkspace::new(&gpu, rows.len(), vocab).unwrap();
    let mut tokens = poisoned::<u32>(&gpu, rows.len());
    for _ in 0..3 {
        ops::sample_rows(&gpu, &logits, vocab, &params_d, &mut workspace, &mut tokens).unwrap();
    }
    let stats = workspace.read_row_stats(&gpu, rows.len()).unwrap();
    let totals = workspace.read_totals(&gpu).unwrap();
    let count = |path: RowPath| stats.iter().filter(|s| s.path == path).count() as u64;
    assert_eq!(totals.greedy, 3 * count(RowPath::Greedy));
    assert_eq!(totals.gumbel, 3 * count(RowPath::Gumbel));
    assert_eq!(totals.rejection, 3 * count(RowPath::Rejection));
    assert_eq!(totals.fallback, 3 * count(RowPath::Fallback));
    let rounds: u64 = stats.iter().map(|s| s.rounds as u64).sum();
    assert_eq!(totals.rejection_rounds, 3 * rounds);
    for (index, (stat, record)) in stats.iter().zip(&params).enumerate() {
        let expected = match index % 6 {
            0 => RowPath::Greedy,
            1 => RowPath::Gumbel,
            _ => RowPath::Rejection,
        };
        assert_eq!(stat.path, expected, "row {index} {record:?}");
        assert!(expected != RowPath::Rejection || (1..=34).contains(&stat.rounds));
    }
    println!("mixed batch stats: {totals:?}");
    workspace.reset_totals(&gpu).unwrap();
    assert_eq!(workspace.read_totals(&gpu).unwrap(), Default::default());
}

#[test]
#[ignore = "needs a GPU"]
fn a_captured_graph_replays_with_new_steps() {
    let gpu = gpu();
    let vocab = 151_936;
    let (rows, params) = mixed_batch(vocab);
    let flat: Vec<f32> = rows.concat();
    let logits = gpu.upload(&flat).unwrap();
    let mut params_d = gpu
        .upload(&ops::encode_row_params(&params).unwrap())
        .unwrap();
    let mut workspace = SamplingWorkspace::new(&gpu, rows.len(), vocab).unwrap();
    let mut tokens = poisoned::<u32>(&gpu, rows.len());
    // Compile and load the kernels before capturing.
    ops::sample_rows(&gpu, &logits, vocab, &params_d, &mut workspace, &mut tokens).unwrap();
    let graph = gpu
        .capture(|gpu| {
            ops::sample_rows(gpu, &logits, vocab, &params_d, &mut workspace, &mut tokens)
        })
        .expect("capture");
    for step in [3u64, 99, 12345] {
        let moved: Vec<SamplingRowParams> = params
            .iter()
            .map(|p| p.with_step(p.step() + step))
            .collect();
        gpu.upload_into(&ops::encode_row_params(&moved).unwrap(), &mut params_d)
            .unwrap();
        graph.launch().unwrap();
        let replayed = gpu.download(&tokens).unwrap();
        let direct = sample_batch(&gpu, &rows, &moved, SamplingOptions::default());
        assert_eq!(replayed, direct, "graph replay at step offset {step}");
    }
}
