//! The default model: one step over prebuilt contexts at, below and above the threshold in
//! many batch compositions, auto's routing against the rule, and the rows across the
//! threshold in different chunkings.

use std::path::PathBuf;

use pagoda_kv::{BlockPool, BlockTable};
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::gguf_model::config_from_gguf;
use pagoda_models::llama::{AttentionPolicy, KvCache, Model, WeightPrecision};
use pagoda_ops::attention::AttentionPath;

use super::{assert_runs_equal, policies, sequence, step, Requests, Work, PAGE_SIZE, THRESHOLD};
/// The default model, or `None` (with a SKIP line) when the file is missing.
fn default_model() -> Option<Model> {
    if !pagoda_ops::linear::batch_invariant() {
        eprintln!(
            "SKIP: prefills run on the AMX-BF16 tiles, which are not batch-invariant \
             (PAGODA_CPU_AMX_PREFILL=int8 runs these tests)"
        );
        return None;
    }
    let file = default_model_file()?;
    let config = config_from_gguf(&file).unwrap();
    Some(Model::load(config, &file, WeightPrecision::AsStored).unwrap())
}

pub(super) fn default_model_file() -> Option<GgufFile> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("SKIP: {} is missing", path.display());
        return None;
    }
    Some(GgufFile::open(&path).unwrap())
}

/// The default model's prebuilt requests (indices into `Requests::tables`).
const LONG: usize = 0;
const LONG_FORK: usize = 1;
const CROSS: usize = 2;
const SHORT: usize = 3;
const FRESH: usize = 4;
const SHORT_2: usize = 5;
const EMPTY: usize = 6;
const BELOW: usize = 7;
const AT: usize = 8;
const ABOVE: usize = 9;

/// Tokens of the long context: a whole number of pages, at least 1000 past the threshold.
const LONG_TOKENS: usize = {
    let tokens = (THRESHOLD + 1000).div_ceil(PAGE_SIZE) * PAGE_SIZE;
    if tokens < 1504 {
        1504
    } else {
        tokens
    }
};

/// The cross request's shared prefix: whole pages, 50 to 65 tokens short of the threshold
/// (none when the threshold is below 50), so its 100-token chunk has rows on both sides.
const CROSS_PREFIX: usize = THRESHOLD.saturating_sub(50) / PAGE_SIZE * PAGE_SIZE;

/// The default model over prebuilt contexts in one pool: `LONG` has `LONG_TOKENS` tokens
/// (prefilled once), `LONG_FORK` shares all of them, `CROSS` the first `CROSS_PREFIX`;
/// `BELOW`, `AT` and `ABOVE` have `T - 2`, `T - 1` and `T` tokens (the long context's whole
/// pages, then their own tokens), so their decode rows see `T - 1`, `T` and `T + 1`; `SHORT`
/// and `SHORT_2` have short contexts (at most 30 and 20 tokens, and below `T / 2`); `FRESH`
/// and `EMPTY` are empty. Every step reuses the cache: a step writes its new tokens' K/V
/// before any layer reads them, and each step runs on a clone of the tables.
fn default_model_contexts() -> Option<(Model, KvCache, Requests)> {
    let model = default_model()?;
    let vocab = model.config().vocab_size;
    let num_pages = LONG_TOKENS / PAGE_SIZE + 96;
    let mut kv = KvCache::new(
        model.config().num_layers,
        model.kv_layout(num_pages, PAGE_SIZE),
    );
    let mut base = Requests {
        pool: BlockPool::new(num_pages, PAGE_SIZE).unwrap(),
        tables: vec![BlockTable::new()],
    };
    let gather = AttentionPolicy::Force(AttentionPath::Gather);
    for chunk in sequence(1, LONG_TOKENS, vocab).chunks(376) {
        step(
            &model,
            &mut kv,
            &mut base,
            &[(LONG, chunk.to_vec())],
            gather,
        );
    }
    let pool = &mut base.pool;
    let fork = base.tables[LONG].fork(pool).unwrap();
    let cross = base.tables[LONG].share_prefix(pool, CROSS_PREFIX).unwrap();
    base.tables.extend([fork, cross]);
    base.tables.extend(vec![BlockTable::new(); 4]);
    let mut own: Vec<Work> = vec![
        (SHORT, sequence(3, 30.min(THRESHOLD / 2), vocab)),
        (SHORT_2, sequence(5, 20.min(THRESHOLD / 3), vocab)),
    ];
    for (request, context) in [
        (BELOW, THRESHOLD.saturating_sub(2)),
        (AT, THRESHOLD.saturating_sub(1)),
        (ABOVE, THRESHOLD),
    ] {
        assert_eq!(base.tables.len(), request);
        let shared = context / PAGE_SIZE * PAGE_SIZE;
        let table = base.tables[LONG]
            .share_prefix(&mut base.pool, shared)
            .unwrap();
        base.tables.push(table);
        own.push((request, sequence(request, context - shared, vocab)));
    }
    own.retain(|(_, tokens)| !tokens.is_empty());
    if !own.is_empty() {
        step(&model, &mut kv, &mut base, &own, gather);
    }
    Some((model, kv, base))
}

/// The default model's step work by name.
fn default_work(name: &str, vocab: usize) -> Work {
    match name {
        "long decode" => (LONG, vec![42]),
        "long decode 2" => (LONG_FORK, vec![4242]),
        "chunk across threshold" => (CROSS, sequence(2, 100, vocab)),
        "short decode" => (SHORT, vec![7]),
        "fresh prompt" => (FRESH, sequence(4, 100, vocab)),
        "short decode 2" => (SHORT_2, vec![9]),
        "short continuation" => (SHORT_2, sequence(6, 100, vocab)),
        "one-token prompt" => (EMPTY, vec![11]),
        "decode below threshold" => (BELOW, vec![13]),
        "decode at threshold" => (AT, vec![17]),
        "decode above threshold" => (ABOVE, vec![19]),
        _ => unreachable!("{name}"),
    }
}

/// Runs each composition of `group` (names of work, the first is the target) on a clone of
/// `base` and asserts the target's logits are bit-identical across the group.
fn check_group(
    model: &Model,
    kv: &mut KvCache,
    base: &Requests,
    group: &[&[&str]],
    policy: AttentionPolicy,
) {
    let vocab = model.config().vocab_size;
    let mut expected: Option<Vec<(usize, Vec<f32>)>> = None;
    for members in group {
        let work: Vec<Work> = members
            .iter()
            .map(|name| default_work(name, vocab))
            .collect();
        let (logits, (path, split, gather)) = step(model, kv, &mut base.clone(), &work, policy);
        assert_eq!(split + gather, members.len());
        if policy == AttentionPolicy::Force(AttentionPath::Gather) {
            assert_eq!((path, split), (AttentionPath::Gather, 0));
        }
        let target = logits.into_iter().next().unwrap();
        match &expected {
            None => expected = Some(target),
            Some(expected) => {
                let context = format!("{policy:?}: {members:?} (T = {THRESHOLD})");
                assert_runs_equal(expected, &target, &context);
            }
        }
    }
}

/// Attention invariance on the real model with the matmul shapes held fixed: the target is
/// row block 0 of a step of the same token count in every composition, so only the neighbours'
/// kind (long or short decode, rows just below, at or above the threshold, prefill chunk,
/// fresh prompt) changes. Under the old batch-wide split-KV plan, `[long decode, long decode
/// 2]` and `[long decode, short decode]` chunk the target differently and this fails.
#[test]
fn default_model_target_is_bit_identical_whatever_its_neighbours() {
    let Some((model, mut kv, base)) = default_model_contexts() else {
        return;
    };
    let groups: [&[&[&str]]; 7] = [
        &[
            &["long decode", "long decode 2"],
            &["long decode", "short decode"],
            &["long decode", "one-token prompt"],
            &["long decode", "decode below threshold"],
        ],
        &[
            &["long decode", "chunk across threshold"],
            &["long decode", "fresh prompt"],
            &["long decode", "short continuation"],
        ],
        &[
            &["chunk across threshold", "long decode"],
            &["chunk across threshold", "short decode"],
            &["chunk across threshold", "one-token prompt"],
            &["chunk across threshold", "decode at threshold"],
        ],
        &[
            &["short decode", "long decode"],
            &["short decode", "short decode 2"],
            &["short decode", "one-token prompt"],
            &["short decode", "decode above threshold"],
        ],
        &[
            &["decode below threshold", "decode at threshold"],
            &["decode below threshold", "long decode"],
            &["decode below threshold", "short decode"],
            &["decode below threshold", "decode above threshold"],
        ],
        &[
            &["decode at threshold", "decode below threshold"],
            &["decode at threshold", "long decode"],
            &["decode at threshold", "one-token prompt"],
            &["decode at threshold", "decode above threshold"],
        ],
        &[
            &["decode above threshold", "decode at threshold"],
            &["decode above threshold", "decode below threshold"],
            &["decode above threshold", "short decode 2"],
            &["decode above threshold", "long decode 2"],
        ],
    ];
    for &policy in policies() {
        for group in groups {
            check_group(&model, &mut kv, &base, group, policy);
        }
    }
    check_auto_routing(&model, &mut kv, &base);
}

/// The full property on the real model: alone against batches of other sizes (needs the
/// linear layers to keep rows independent of the matmul's row count).
#[test]
fn default_model_step_is_bit_identical_alone_and_in_any_batch() {
    let Some((model, mut kv, base)) = default_model_contexts() else {
        return;
    };
    let vocab = model.config().vocab_size;
    let names = [
        "long decode",
        "chunk across threshold",
        "short decode",
        "fresh prompt",
        "decode below threshold",
        "decode at threshold",
        "decode above threshold",
    ];
    let others: [&[&str]; 4] = [
        &["long decode 2", "short decode 2", "decode at threshold"],
        &["one-token prompt", "decode above threshold"],
        &[
            "short continuation",
            "long decode 2",
            "one-token prompt",
            "decode below threshold",
        ],
        &[
            "chunk across threshold",
            "decode at threshold",
            "long decode",
        ],
    ];
    for &policy in policies() {
        for name in names {
            let request = default_work(name, vocab).0;
            let mut group: Vec<Vec<&str>> = vec![vec![name]];
            for other in others {
                let mut members = vec![name];
                members.extend(
                    other
                        .iter()
                        .filter(|other| default_work(other, vocab).0 != request),
                );
                group.push(members);
            }
            let group: Vec<&[&str]> = group.iter().map(Vec::as_slice).collect();
            check_group(&model, &mut kv, &base, &group, policy);
        }
    }
}

/// Auto's routing as the step output reports it, against the rule itself (a request with a
/// row that sees at least `T` tokens runs split-KV, one whose rows all see fewer runs
/// gather). First checks that the contexts really sit at the threshold.
fn check_auto_routing(model: &Model, kv: &mut KvCache, base: &Requests) {
    let vocab = model.config().vocab_size;
    let context = |name: &str| base.tables[default_work(name, vocab).0].num_tokens();
    let last_visible = |name: &str| context(name) + default_work(name, vocab).1.len();
    if THRESHOLD >= 2 {
        assert_eq!(last_visible("decode below threshold"), THRESHOLD - 1);
        assert!(last_visible("short decode") < THRESHOLD);
        // The cross chunk's first row sees fewer than `T` tokens, its last at least `T`.
        assert!(context("chunk across threshold") + 1 < THRESHOLD);
    }
    assert_eq!(last_visible("decode at threshold"), THRESHOLD.max(1));
    assert_eq!(last_visible("decode above threshold"), THRESHOLD + 1);
    assert!(last_visible("chunk across threshold") >= THRESHOLD);
    let all = [
        "long decode",
        "short decode",
        "chunk across threshold",
        "fresh prompt",
        "short continuation",
        "one-token prompt",
        "decode below threshold",
        "decode at threshold",
        "decode above threshold",
    ];
    let mut compositions: Vec<Vec<&str>> = all.iter().map(|name| vec![*name]).collect();
    compositions.push(vec![
        "decode below threshold",
        "decode at threshold",
        "decode above threshold",
    ]);
    compositions.push(vec![
        "short decode",
        "decode below threshold",
        "fresh prompt",
    ]);
    compositions.push(all.to_vec());
    for names in compositions {
        let work: Vec<Work> = names.iter().map(|name| default_work(name, vocab)).collect();
        let split = names
            .iter()
            .filter(|name| last_visible(name) >= THRESHOLD)
            .count();
        let path = if split > 0 {
            AttentionPath::SplitKv
        } else {
            AttentionPath::Gather
        };
        let expected = (path, split, names.len() - split);
        let (_, meta) = step(model, kv, &mut base.clone(), &work, AttentionPolicy::Auto);
        assert_eq!(meta, expected, "{names:?} (T = {THRESHOLD})");
    }
}

/// The rows that see `T - 1 ..= T + 2` tokens (the `BELOW` request's next 4 tokens) fed as
/// one prefill chunk, as 4 decode steps, and as 2 + 2 and 1 + 3 chunks next to neighbours:
/// each position's logits are bit-identical, so a token's K/V does not depend on whether it
/// was computed as a prefill row or a decode row on either side of the threshold.
#[test]
fn default_model_rows_across_threshold_are_bit_identical_however_chunked() {
    let Some((model, mut kv, base)) = default_model_contexts() else {
        return;
    };
    let vocab = model.config().vocab_size;
    let tokens = sequence(8, 4, vocab);
    let target = |range: std::ops::Range<usize>| (BELOW, tokens[range].to_vec());
    let schedules: [Vec<Vec<Work>>; 4] = [
        vec![vec![target(0..4)]],
        (0..4).map(|i| vec![target(i..i + 1)]).collect(),
        vec![
            vec![target(0..2), default_work("long decode", vocab)],
            vec![default_work("short decode", vocab), target(2..4)],
        ],
        vec![
            vec![default_work("decode at threshold", vocab), target(0..1)],
            vec![
                target(1..4),
                default_work("chunk across threshold", vocab),
                default_work("decode above threshold", vocab),
            ],
        ],
    ];
    for &policy in policies() {
        let mut expected: Option<Vec<(usize, Vec<f32>)>> = None;
        for (index, schedule) in schedules.iter().enumerate() {
            let mut requests = base.clone();
            let mut got = Vec::new();
            for work in schedule {
                let (logits, _) = step(&model, &mut kv, &mut requests, work, policy);
                for ((request, _), rows) in work.iter().zip(logits) {
                    if *request == BELOW {
                        got.extend(rows);
                    }
                }
            }
            match &expected {
                None => expected = Some(got),
                Some(expected) => {
                    let context = format!("{policy:?}: schedule {index} (T = {THRESHOLD})");
                    assert_runs_equal(expected, &got, &context);
                }
            }
        }
    }
}
