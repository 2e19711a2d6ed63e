//! Batch invariance of the forward pass: a request's logits are bit-identical whatever other
//! requests share its step (long and short decodes, prefill chunks, in any order), however its
//! prompt was chunked, under every attention policy (auto, split-KV, gather). The oracle is the
//! request run alone: the model's own output, compared bit for bit.
//!
//! - A tiny random llama (f32 weights) runs whole schedules end to end: a 1500-token prompt
//!   (page size 16) prefilled whole, or in ragged chunks including a one-token chunk next to
//!   other requests, then decoded with neighbours joining and leaving.
//! - The default model (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, skipped when missing) runs
//!   one step over prebuilt long contexts in many batch compositions.
//! - The linear layers: a row of `Weight::matmul` must not depend on how many rows share the
//!   call (the T = 1 decode kernels against the T > 1 prefill kernels), for Q4_1, Q8_0 and F32.

use std::path::PathBuf;

use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::config::{Architecture, ModelConfig, RopeStyle};
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::gguf_model::config_from_gguf;
use pagoda_models::llama::{
    AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision, AUTO_MIN_SPLIT_KV_TOKENS,
};
use pagoda_models::random::RandomWeights;
use pagoda_ops::attention::AttentionPath;
use pagoda_ops::linear::Weight;
use pagoda_tensor::GgmlType;

const PAGE_SIZE: usize = 16;

const POLICIES: [AttentionPolicy; 3] = [
    AttentionPolicy::Auto,
    AttentionPolicy::Force(AttentionPath::SplitKv),
    AttentionPolicy::Force(AttentionPath::Gather),
];

/// The model's requests: block tables over one pool, and the tokens each has been fed.
#[derive(Clone)]
struct Requests {
    pool: BlockPool,
    tables: Vec<BlockTable>,
}

/// What one request contributes to a step: its index and its new tokens.
type Work = (usize, Vec<u32>);

/// Per work item: the logits of each of its new tokens, keyed by position.
type StepLogits = Vec<Vec<(usize, Vec<f32>)>>;

/// Runs one step over `work`; returns the logits of every new token and the output's
/// `(attention_path, split_kv_requests, gather_requests)`.
fn step(
    model: &Model,
    kv: &mut KvCache,
    requests: &mut Requests,
    work: &[Work],
    policy: AttentionPolicy,
) -> (StepLogits, (AttentionPath, usize, usize)) {
    let (mut tokens, mut positions, mut slots, mut qo_indptr) =
        (Vec::new(), Vec::new(), Vec::new(), vec![0u32]);
    let mut first_positions = Vec::new();
    for (request, new_tokens) in work {
        let table = &mut requests.tables[*request];
        let first = table.num_tokens();
        first_positions.push(first);
        slots.extend(
            table
                .append_slots(&mut requests.pool, new_tokens.len())
                .unwrap(),
        );
        tokens.extend_from_slice(new_tokens);
        positions.extend((first..first + new_tokens.len()).map(|p| p as u32));
        qo_indptr.push(tokens.len() as u32);
    }
    let tables: Vec<&BlockTable> = work.iter().map(|(r, _)| &requests.tables[*r]).collect();
    let page_table = PageTable::from_block_tables(&tables, &requests.pool).unwrap();
    let logits_for: Vec<usize> = (0..tokens.len()).collect();
    let batch = ForwardBatch {
        tokens: &tokens,
        positions: &positions,
        slots: &slots,
        qo_indptr: &qo_indptr,
        page_table: &page_table,
        logits_for: &logits_for,
    };
    let output = model.forward(&batch, kv, policy).unwrap();
    let vocab = model.config().vocab_size;
    let mut rows = output.logits.chunks(vocab);
    let per_request = work
        .iter()
        .zip(&first_positions)
        .map(|((_, new_tokens), &first)| {
            (first..first + new_tokens.len())
                .map(|position| (position, rows.next().unwrap().to_vec()))
                .collect()
        })
        .collect();
    let meta = (
        output.attention_path,
        output.split_kv_requests,
        output.gather_requests,
    );
    (per_request, meta)
}

fn assert_bits_equal(expected: &[f32], actual: &[f32], context: &str) {
    let differing = expected
        .iter()
        .zip(actual)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert!(
        expected.len() == actual.len() && differing == 0,
        "{context}: {differing} of {} logits differ in bits",
        expected.len()
    );
}

fn tiny_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 64,
        num_layers: 2,
        num_attention_heads: 6,
        num_kv_heads: 2,
        head_dim: 16,
        intermediate_size: 96,
        vocab_size: 97,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_dim: 16,
        rope_style: RopeStyle::Halves,
        rope_scaling: None,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
    }
}

fn sequence(seed: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104729 + i * i * 31) % vocab) as u32)
        .collect()
}

/// A schedule: per step, the work of each request as (request, first token, count) into its
/// token sequence. Returns the target's (request 0's) logits keyed by position.
fn run_schedule(
    model: &Model,
    sequences: &[Vec<u32>],
    schedule: &[Vec<(usize, usize, usize)>],
    policy: AttentionPolicy,
) -> Vec<(usize, Vec<f32>)> {
    let num_pages = 512;
    let mut kv = KvCache::new(
        model.config().num_layers,
        model.kv_layout(num_pages, PAGE_SIZE),
    );
    let mut pool = BlockPool::new(num_pages, PAGE_SIZE).unwrap();
    let _burned: Vec<_> = (0..5).map(|_| pool.allocate().unwrap()).collect();
    let mut requests = Requests {
        pool,
        tables: vec![BlockTable::new(); sequences.len()],
    };
    let mut target = Vec::new();
    for work in schedule {
        let work: Vec<Work> = work
            .iter()
            .map(|&(r, first, count)| (r, sequences[r][first..first + count].to_vec()))
            .collect();
        let (logits, _) = step(model, &mut kv, &mut requests, &work, policy);
        for ((request, _), rows) in work.iter().zip(logits) {
            if *request == 0 {
                target.extend(rows);
            }
        }
    }
    target
}

#[test]
fn tiny_model_request_is_bit_identical_alone_and_batched_end_to_end() {
    let config = tiny_config();
    let weights = RandomWeights::new(&config, 5, 1 << 30).unwrap();
    let model = Model::load(config.clone(), &weights, WeightPrecision::AsStored).unwrap();
    let vocab = config.vocab_size;
    // 0: the target, 1500-token prompt then 6 decode tokens; 1: long neighbour (1200 + decode);
    // 2: prompt crossing the auto threshold, then decodes; 3 and 4: short requests.
    let sequences: Vec<Vec<u32>> = [1506, 1210, 702, 41, 31]
        .iter()
        .enumerate()
        .map(|(seed, &len)| sequence(seed, len, vocab))
        .collect();
    let decode = |request: usize, position: usize| (request, position, 1);
    let mut alone = vec![vec![(0, 0, 1500)]];
    alone.extend((1500..1506).map(|p| vec![decode(0, p)]));
    // The same target tokens, prompt cut as 700 + 1 + 799, neighbours prefilling and
    // decoding around it, joining and leaving.
    let batched = vec![
        vec![(1, 0, 1200), (0, 0, 700), (3, 0, 39)],
        vec![(3, 39, 1), (0, 700, 1), (1, 1200, 1), (2, 0, 300)],
        vec![(2, 300, 400), (0, 701, 799), (4, 0, 30)],
        vec![decode(1, 1201), decode(0, 1500), decode(4, 30)],
        vec![decode(0, 1501)],
        vec![decode(2, 700), decode(0, 1502), decode(1, 1202)],
        vec![decode(0, 1503), decode(1, 1203)],
        vec![decode(1, 1204), decode(3, 40), decode(0, 1504)],
        vec![decode(0, 1505), decode(1, 1205), decode(2, 701)],
    ];
    for policy in POLICIES {
        let expected = run_schedule(&model, &sequences, &alone, policy);
        let got = run_schedule(&model, &sequences, &batched, policy);
        assert_eq!(expected.len(), 1506);
        assert_eq!(got.len(), 1506);
        for ((position, expected), (got_position, got)) in expected.iter().zip(&got) {
            assert_eq!(position, got_position);
            assert_bits_equal(expected, got, &format!("{policy:?}: position {position}"));
        }
    }
}

/// The default model, or `None` (with a SKIP line) when the file is missing.
fn default_model() -> Option<Model> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("SKIP: {} is missing", path.display());
        return None;
    }
    let file = GgufFile::open(&path).unwrap();
    let config = config_from_gguf(&file).unwrap();
    Some(Model::load(config, &file, WeightPrecision::AsStored).unwrap())
}

/// The default model over prebuilt contexts in one pool: request 0 has 1504 tokens (94 full
/// pages, prefilled once); 1 shares all of them, 2 their first 448 (a 100-token chunk from
/// there crosses the auto threshold); 3 and 5 have short contexts (30 and 20 tokens); 4 and
/// 6 are empty. Every step reuses the cache: a step writes its new tokens' K/V before any
/// layer reads them, and each step runs on a clone of the tables.
fn default_model_contexts() -> Option<(Model, KvCache, Requests)> {
    let model = default_model()?;
    let vocab = model.config().vocab_size;
    let num_pages = 192;
    let mut kv = KvCache::new(
        model.config().num_layers,
        model.kv_layout(num_pages, PAGE_SIZE),
    );
    let mut base = Requests {
        pool: BlockPool::new(num_pages, PAGE_SIZE).unwrap(),
        tables: vec![BlockTable::new()],
    };
    let gather = AttentionPolicy::Force(AttentionPath::Gather);
    for chunk in sequence(1, 1504, vocab).chunks(376) {
        step(&model, &mut kv, &mut base, &[(0, chunk.to_vec())], gather);
    }
    let pool = &mut base.pool;
    let long = base.tables[0].fork(pool).unwrap();
    let prefix = base.tables[0].share_prefix(pool, 448).unwrap();
    base.tables.extend([long, prefix]);
    base.tables.extend(vec![BlockTable::new(); 4]);
    let short = [(3, sequence(3, 30, vocab)), (5, sequence(5, 20, vocab))];
    step(&model, &mut kv, &mut base, &short, gather);
    Some((model, kv, base))
}

/// The default model's step work by name: request 0..=2 long, 3 and 5 short, 4 and 6 fresh.
fn default_work(name: &str, vocab: usize) -> Work {
    match name {
        "long decode" => (0, vec![42]),
        "long decode 2" => (1, vec![4242]),
        "chunk across threshold" => (2, sequence(2, 100, vocab)),
        "short decode" => (3, vec![7]),
        "fresh prompt" => (4, sequence(4, 100, vocab)),
        "short decode 2" => (5, vec![9]),
        "short continuation" => (5, sequence(6, 100, vocab)),
        "one-token prompt" => (6, vec![11]),
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
                for ((position, want), (got_position, got)) in expected.iter().zip(&target) {
                    assert_eq!(position, got_position);
                    let context = format!("{policy:?}: {members:?}, position {position}");
                    assert_bits_equal(want, got, &context);
                }
            }
        }
    }
}

/// Attention invariance on the real model with the matmul shapes held fixed: the target is
/// row block 0 of a step of the same token count in every composition, so only the neighbours'
/// kind (long or short decode, prefill chunk, fresh prompt) changes. Under the old batch-wide
/// split-KV plan, `[long decode, long decode 2]` and `[long decode, short decode]` chunk the
/// target differently and this fails.
#[test]
fn default_model_target_is_bit_identical_whatever_its_neighbours() {
    let Some((model, mut kv, base)) = default_model_contexts() else {
        return;
    };
    let groups: [&[&[&str]]; 4] = [
        &[
            &["long decode", "long decode 2"],
            &["long decode", "short decode"],
            &["long decode", "one-token prompt"],
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
        ],
        &[
            &["short decode", "long decode"],
            &["short decode", "short decode 2"],
            &["short decode", "one-token prompt"],
        ],
    ];
    for policy in POLICIES {
        for group in groups {
            check_group(&model, &mut kv, &base, group, policy);
        }
    }
    check_auto_routing(&model, &mut kv, &base);
}

/// The full property on the real model: alone against batches of other sizes. Needs the
/// linear layers to keep rows independent of the matmul's row count, which
/// `matmul_rows_do_not_depend_on_the_number_of_rows` shows they do not yet.
#[test]
fn default_model_step_is_bit_identical_alone_and_in_any_batch() {
    let Some((model, mut kv, base)) = default_model_contexts() else {
        return;
    };
    let names = [
        "long decode",
        "chunk across threshold",
        "short decode",
        "fresh prompt",
    ];
    let others: [&[&str]; 4] = [
        &["long decode 2", "short decode 2"],
        &["one-token prompt"],
        &["short continuation", "long decode 2", "one-token prompt"],
        &[],
    ];
    for policy in POLICIES {
        for name in names {
            let mut group: Vec<Vec<&str>> = vec![vec![name]];
            for other in others {
                let mut members = vec![name];
                members.extend(other.iter().filter(|o| !o.starts_with(&name[..4])));
                group.push(members);
            }
            let group: Vec<&[&str]> = group.iter().map(Vec::as_slice).collect();
            check_group(&model, &mut kv, &base, &group, policy);
        }
    }
}

/// Auto's routing as the step output reports it: each request by its own context.
fn check_auto_routing(model: &Model, kv: &mut KvCache, base: &Requests) {
    let vocab = model.config().vocab_size;
    const { assert!(448 < AUTO_MIN_SPLIT_KV_TOKENS && AUTO_MIN_SPLIT_KV_TOKENS < 548) };
    for (names, expected) in [
        (&["long decode"][..], (AttentionPath::SplitKv, 1, 0)),
        (&["short decode"][..], (AttentionPath::Gather, 0, 1)),
        (
            &["chunk across threshold"][..],
            (AttentionPath::SplitKv, 1, 0),
        ),
        (
            &[
                "short decode",
                "long decode",
                "fresh prompt",
                "chunk across threshold",
            ][..],
            (AttentionPath::SplitKv, 2, 2),
        ),
    ] {
        let work: Vec<Work> = names.iter().map(|name| default_work(name, vocab)).collect();
        let (_, meta) = step(model, kv, &mut base.clone(), &work, AttentionPolicy::Auto);
        assert_eq!(meta, expected, "{names:?}");
    }
}

/// Deterministic pseudo-random values in [-1, 1).
fn values(seed: u64, count: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Q4_1 / Q8_0 blocks of 32 built by hand from pseudo-random scales and quants.
fn synthetic_weight(ty: GgmlType, rows: usize, cols: usize) -> Weight {
    let blocks = rows * cols / 32;
    let randoms = values(rows as u64 + (ty == GgmlType::Q8_0) as u64, blocks * 34);
    let f16 = |value: f32| half::f16::from_f32(value).to_bits().to_le_bytes();
    let mut bytes = Vec::new();
    for block in 0..blocks {
        let r = &randoms[block * 34..(block + 1) * 34];
        match ty {
            GgmlType::Q8_0 => {
                bytes.extend(f16(0.01 + 0.01 * r[0].abs()));
                bytes.extend(r[2..34].iter().map(|v| ((v * 127.0) as i8) as u8));
            }
            GgmlType::Q4_1 => {
                bytes.extend(f16(0.02 + 0.02 * r[0].abs()));
                bytes.extend(f16(-0.1 * r[1].abs()));
                bytes.extend(r[2..18].iter().map(|v| (v.abs() * 255.0) as u8));
            }
            _ => unreachable!(),
        }
    }
    Weight::new(ty, rows, cols, bytes).unwrap()
}

/// `true` when every row of `matmul` over T rows equals `matmul` of that row alone, for every
/// T checked; prints the first mismatch.
fn rows_independent_of_batch(name: &str, weight: &Weight) -> bool {
    let (rows, cols) = (weight.out_features(), weight.in_features());
    let x = values(11, 67 * cols);
    let single: Vec<Vec<f32>> = x
        .chunks(cols)
        .map(|row| {
            let mut y = vec![0.0; rows];
            weight.matmul(row, 1, &mut y);
            y
        })
        .collect();
    for num_tokens in [2, 3, 4, 5, 8, 13, 16, 33, 67] {
        let mut y = vec![0.0; num_tokens * rows];
        weight.matmul(&x[..num_tokens * cols], num_tokens, &mut y);
        for (token, got) in y.chunks(rows).enumerate() {
            let differing = got
                .iter()
                .zip(&single[token])
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            if differing > 0 {
                eprintln!(
                    "{name} ({:?}, [{rows}, {cols}]): row {token} of a {num_tokens}-row matmul differs from the 1-row matmul in {differing} of {rows} outputs",
                    weight.ty()
                );
                return false;
            }
        }
    }
    eprintln!("{name} ({:?}): rows independent of the batch", weight.ty());
    true
}

/// Fails today: the T = 1 and T > 1 kernels (and the 4-row f32 tiles) sum in different
/// orders. Un-ignore once the linear kernels keep rows independent of the row count.
#[test]
fn matmul_rows_do_not_depend_on_the_number_of_rows() {
    let mut weights = vec![
        ("synthetic", synthetic_weight(GgmlType::Q4_1, 96, 576)),
        ("synthetic", synthetic_weight(GgmlType::Q8_0, 96, 576)),
    ];
    let f32_weight = weights[0].1.to_f32();
    weights.push(("synthetic", f32_weight));
    if let Some(file) = default_model_file() {
        for name in [
            "blk.0.attn_q.weight",
            "blk.0.ffn_down.weight",
            "token_embd.weight",
        ] {
            let info = file.tensor(name).unwrap();
            let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
            let rows_kept = rows.min(512);
            let row_bytes = file.tensor_data(info).len() / rows;
            let bytes = file.tensor_data(info)[..rows_kept * row_bytes].to_vec();
            let weight = Weight::new(info.ty, rows_kept, cols, bytes).unwrap();
            let as_f32 = weight.to_f32();
            weights.push((name, weight));
            weights.push((name, as_f32));
        }
    }
    let failures: Vec<String> = weights
        .iter()
        .filter(|(name, weight)| !rows_independent_of_batch(name, weight))
        .map(|(name, weight)| format!("{name} {:?}", weight.ty()))
        .collect();
    assert!(
        failures.is_empty(),
        "matmul rows depend on the batch size for: {failures:?}"
    );
}

fn default_model_file() -> Option<GgufFile> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    path.exists().then(|| GgufFile::open(&path).unwrap())
}
