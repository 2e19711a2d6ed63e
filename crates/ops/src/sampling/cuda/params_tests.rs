//! CPU unit tests of the host-side sampling logic (no GPU needed).

use super::*;

fn shapes(rows: usize, vocab: usize) -> SamplingShapes {
    SamplingShapes {
        vocab,
        logits_len: rows * vocab,
        params_len: rows * SAMPLING_PARAM_WORDS,
        tokens_len: rows,
        workspace_rows: 64,
        workspace_vocab: 151_936,
    }
}

#[test]
fn record_layout_and_words() {
    assert_eq!(
        std::mem::size_of::<SamplingRowParams>(),
        4 * SAMPLING_PARAM_WORDS
    );
    let params =
        SamplingRowParams::new(0.7, 40, 0.9, 0.05, 0x1234_5678_9ABC_DEF0, 1 << 33).unwrap();
    assert_eq!(params.seed(), 0x1234_5678_9ABC_DEF0);
    assert_eq!(params.step(), 1 << 33);
    assert_eq!(
        params.to_words(),
        [
            0.7f32.to_bits(),
            40,
            0.9f32.to_bits(),
            0.05f32.to_bits(),
            0x9ABC_DEF0,
            0x1234_5678,
            0,
            2
        ]
    );
    assert_eq!(params.with_step(5).step(), 5);
    assert_eq!(params.with_step(5).seed(), params.seed());
    // The repr(C) record is exactly its words (what a caller uploading the struct sees).
    let raw: [u32; SAMPLING_PARAM_WORDS] = unsafe { std::mem::transmute(params) };
    assert_eq!(raw, params.to_words());
    assert!(SamplingRowParams::greedy().validate().is_ok());
}

#[test]
fn validation_names_the_field() {
    let cases = [
        (f32::NAN, 1.0, 0.0, "temperature"),
        (-0.5, 1.0, 0.0, "temperature"),
        (101.0, 1.0, 0.0, "temperature"),
        (1.0, 0.0, 0.0, "top_p"),
        (1.0, 1.5, 0.0, "top_p"),
        (1.0, f32::NAN, 0.0, "top_p"),
        (1.0, 1.0, -0.1, "min_p"),
        (1.0, 1.0, 1.1, "min_p"),
    ];
    for (temperature, top_p, min_p, field) in cases {
        let error = SamplingRowParams::new(temperature, 0, top_p, min_p, 1, 0).unwrap_err();
        assert!(error.to_string().contains(field), "{error}");
    }
    let good = SamplingRowParams::new(1.0, 0, 1.0, 0.0, 1, 0).unwrap();
    let bad = SamplingRowParams { top_p: 2.0, ..good };
    let error = encode_row_params(&[good, good, bad]).unwrap_err();
    assert!(error.to_string().contains("row 2"), "{error}");
    assert_eq!(encode_row_params(&[good, good]).unwrap().len(), 16);
}

#[test]
fn splits_are_powers_of_two_within_limits() {
    for rows in [1usize, 2, 5, 16, 64, 300] {
        for vocab in [1usize, 100, 2048, 4096, 32_000, 128_256, 151_936] {
            let splits = sampling_splits(rows, vocab, 132);
            assert!(splits.is_power_of_two() && splits <= MAX_SAMPLING_SPLITS);
            assert!(
                splits == 1 || vocab / splits >= 1024,
                "{rows} {vocab} {splits}"
            );
        }
    }
    assert_eq!(sampling_splits(1, 151_936, 132), 128);
    assert_eq!(sampling_splits(1, 128_256, 132), 64);
    assert_eq!(sampling_splits(64, 151_936, 132), 8);
    // Past 64 rows, eight CTAs per SM (measured on the H200).
    assert_eq!(sampling_splits(80, 128_256, 132), 8);
    assert_eq!(sampling_splits(80, 151_936, 132), 16);
    assert_eq!(sampling_splits(144, 128_256, 132), 8);
    assert_eq!(sampling_splits(300, 151_936, 132), 4);
    assert_eq!(sampling_splits(576, 128_256, 132), 2);
    assert_eq!(sampling_splits(2000, 151_936, 132), 1);
    assert_eq!(sampling_splits(1, 4096, 132), 4);
    assert_eq!(sampling_splits(1, 100, 132), 1);
}

#[test]
fn planning_checks_every_length() {
    let options = SamplingOptions::default();
    let plan = plan_sampling(shapes(4, 1000), options, 132).unwrap();
    assert_eq!(
        plan,
        SamplingPlan {
            rows: 4,
            num_splits: 1,
            filter_splits: 1,
        }
    );
    let fixed = SamplingOptions {
        num_splits: Some(16),
        filter_splits: Some(2),
        ..options
    };
    let plan = plan_sampling(shapes(4, 1000), fixed, 132).unwrap();
    assert_eq!((plan.num_splits, plan.filter_splits), (16, 2));
    let mut bad = shapes(4, 1000);
    bad.logits_len -= 1;
    let error = plan_sampling(bad, options, 132).unwrap_err().to_string();
    assert!(error.contains("logits"), "{error}");
    let mut bad = shapes(4, 1000);
    bad.params_len = 31;
    let error = plan_sampling(bad, options, 132).unwrap_err().to_string();
    assert!(error.contains("params"), "{error}");
    let error = plan_sampling(shapes(65, 1000), options, 132)
        .unwrap_err()
        .to_string();
    assert!(error.contains("workspace"), "{error}");
    let error = plan_sampling(shapes(4, 200_000), options, 132)
        .unwrap_err()
        .to_string();
    assert!(error.contains("workspace"), "{error}");
    let error = plan_sampling(shapes(0, 0), options, 132)
        .unwrap_err()
        .to_string();
    assert!(error.contains("vocab"), "{error}");
    for splits in [0, MAX_SAMPLING_SPLITS + 1] {
        let options = SamplingOptions {
            num_splits: Some(splits),
            ..options
        };
        let error = plan_sampling(shapes(4, 1000), options, 132)
            .unwrap_err()
            .to_string();
        assert!(error.contains("num_splits"), "{error}");
        let options = SamplingOptions {
            filter_splits: Some(splits),
            ..options
        };
        let error = plan_sampling(
            shapes(4, 1000),
            SamplingOptions {
                num_splits: None,
                ..options
            },
            132,
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("filter_splits"), "{error}");
    }
    // Zero rows is a valid (empty) launch.
    assert_eq!(
        plan_sampling(shapes(0, 1000), options, 132).unwrap().rows,
        0
    );
}

#[test]
fn stats_and_totals_decode() {
    let stats = decode_row_stats(&[0, 0, 1, 0, 2, 3, 3, 34]).unwrap();
    assert_eq!(
        stats,
        vec![
            RowSamplingStats {
                path: RowPath::Greedy,
                rounds: 0
            },
            RowSamplingStats {
                path: RowPath::Gumbel,
                rounds: 0
            },
            RowSamplingStats {
                path: RowPath::Rejection,
                rounds: 3
            },
            RowSamplingStats {
                path: RowPath::Fallback,
                rounds: 34
            },
        ]
    );
    assert!(decode_row_stats(&[7, 0])
        .unwrap_err()
        .to_string()
        .contains("row 0"));
    assert!(decode_row_stats(&[0]).is_err());
    let mut words = [0u32; SAMPLING_TOTALS_WORDS];
    words[0] = 5;
    words[3] = 1; // gumbel high word
    words[8] = 9;
    let totals = SamplingTotals::from_words(&words).unwrap();
    assert_eq!(totals.greedy, 5);
    assert_eq!(totals.gumbel, 1 << 32);
    assert_eq!(totals.rejection_rounds, 9);
    assert!(SamplingTotals::from_words(&words[..3]).is_err());
}

#[test]
fn filter_splits_follow_the_measured_rule_and_keep_512_logits_each() {
    assert_eq!(filter_splits(1, 1000, 132), 1);
    assert_eq!(filter_splits(1, 151_936, 132), 128);
    assert_eq!(filter_splits(16, 128_256, 132), 32);
    assert_eq!(filter_splits(64, 151_936, 132), 16);
    assert_eq!(filter_splits(4, 128_256, 132), 64);
    assert_eq!(filter_splits(1000, 151_936, 132), 4);
    assert_eq!(filter_splits(1, 4096, 132), 8);
    for rows in [1usize, 3, 64, 500] {
        for vocab in [1usize, 999, 5000, 70_000, 1 << 20] {
            let splits = filter_splits(rows, vocab, 132);
            assert!(splits.is_power_of_two() && splits <= MAX_SAMPLING_SPLITS);
            assert!(
                splits == 1 || vocab / splits >= 512,
                "vocab {vocab}: {splits}"
            );
        }
    }
}

#[test]
fn the_mix_names_the_stages_the_rows_need() {
    let row = |temperature: f32, top_k: u32, top_p: f32, min_p: f32| SamplingRowParams {
        temperature,
        top_k,
        top_p,
        min_p,
        ..SamplingRowParams::default()
    };
    let none = SamplingMix::NONE;
    assert_eq!(SamplingMix::of(&[], 1000), none);
    // Greedy rows (T 0, top-k 1) need neither stage.
    assert_eq!(
        SamplingMix::of(&[row(0.0, 0, 0.5, 0.1), row(1.0, 1, 0.5, 0.0)], 1000),
        none
    );
    assert_eq!(
        SamplingMix::of(&[row(0.7, 0, 1.0, 0.0)], 1000),
        SamplingMix {
            gumbel: true,
            ..none
        }
    );
    // top_k >= vocab keeps everything: no top-k stage, and top-p off the lists.
    assert_eq!(
        SamplingMix::of(&[row(0.7, 1000, 0.9, 0.0)], 1000),
        SamplingMix {
            filtered: true,
            top_p: true,
            unlisted_top_p: true,
            ..none
        }
    );
    // Top-k 40 + top-p rows run their rounds on their lists; min-p alone needs no rounds.
    let listed = SamplingMix {
        filtered: true,
        top_k: true,
        top_p: true,
        ..none
    };
    assert_eq!(SamplingMix::of(&[row(0.7, 40, 0.9, 0.0)], 1000), listed);
    assert_eq!(
        SamplingMix::of(&[row(0.7, 40, 0.9, 0.0), row(1.0, 0, 1.0, 0.05)], 2000),
        listed
    );
    assert_eq!(
        SamplingMix::of(&[row(0.7, 600, 0.9, 0.0)], 2000),
        SamplingMix {
            unlisted_top_p: true,
            ..listed
        }
    );
    assert_eq!(
        SamplingMix::of(&[row(1.0, 0, f32::NAN, 0.05)], 1000),
        SamplingMix {
            filtered: true,
            ..none
        }
    );
    assert_eq!(
        SamplingMix::of(
            &[
                row(0.7, 40, 1.0, 0.0),
                row(1.0, 0, 1.0, 0.0),
                row(1.0, 0, 0.9, 0.0)
            ],
            1000
        ),
        SamplingMix::ALL
    );
}

#[test]
fn two_round_launches_up_to_four_rows() {
    for (rows, launches) in [(0, 2), (1, 2), (4, 2), (5, 3), (16, 3), (64, 3)] {
        assert_eq!(default_fast_rounds(rows), launches, "{rows} rows");
    }
}

#[test]
fn the_cluster_runs_top_p_launches_without_top_k_on_clusters_only() {
    let top_p = SamplingOptions {
        mix: SamplingMix {
            top_k: false,
            ..SamplingMix::ALL
        },
        ..SamplingOptions::default()
    };
    let hopper = (9, 0);
    assert!(top_p.runs_cluster(128_256, hopper));
    assert!(top_p.runs_cluster(151_936, (10, 0)));
    // Ampere has no clusters; a top-k row, a launch without top-p rows, the exact path or
    // the switch off keep the pipeline.
    assert!(!top_p.runs_cluster(128_256, (8, 0)));
    assert!(!SamplingOptions::default().runs_cluster(128_256, hopper));
    let min_p_only = SamplingOptions {
        mix: SamplingMix {
            top_k: false,
            top_p: false,
            unlisted_top_p: false,
            ..SamplingMix::ALL
        },
        ..top_p
    };
    assert!(!min_p_only.runs_cluster(128_256, hopper));
    for off in [
        SamplingOptions {
            filtered: FilteredSampling::Exact,
            ..top_p
        },
        SamplingOptions {
            cluster: false,
            ..top_p
        },
    ] {
        assert!(!off.runs_cluster(128_256, hopper));
    }
    // A slice over 200 KiB of shared memory (8 CTAs of 51200 logits and more) does not fit.
    assert!(top_p.runs_cluster(409_600, hopper));
    assert!(!top_p.runs_cluster(409_604, hopper));
}
