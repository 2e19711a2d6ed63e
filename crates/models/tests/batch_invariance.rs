//! Batch invariance of the forward pass: a request's logits are bit-identical whatever other
//! requests share its step (long and short decodes, prefill chunks, in any order), however its
//! prompt was chunked, under every attention policy (auto, split-KV, gather). The oracle is the
//! request run alone: the model's own output, compared bit for bit.
//!
//! Everything is built around auto's threshold [`AUTO_MIN_SPLIT_KV_TOKENS`] (`T`: a row that
//! sees at least `T` tokens runs split-KV, a shorter one gather), whatever its value: rows that
//! see `T - 1`, `T` and `T + 1` tokens, as decode rows and as prefill rows, prefill chunks
//! whose rows cross `T`, and mixed batches of such rows with long and short neighbours. (For
//! `T <= 1` no row is below the threshold; those cases then run split-KV like the rest.)
//!
//! - A tiny random llama (f32 weights) runs whole schedules end to end: every request of a
//!   mixed schedule (a long prompt cut around `T`, decodes stepping across `T`, a prompt
//!   ending exactly at `T`, short requests) against the same request run alone.
//! - The default model (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, skipped when missing) runs
//!   one step over prebuilt contexts in many batch compositions, checks auto's routing row
//!   by row against the rule, and feeds the tokens across `T` in different chunkings.
//! - The linear layers: a row of `Weight::matmul` must not depend on how many rows share the
//!   call (the T = 1 decode kernels against the T > 1 prefill kernels), for Q4_1, Q8_0 and F32.

// Submodules live in `batch_invariance/` (this file is a crate root, so the paths are explicit).
#[path = "batch_invariance/default_model.rs"]
mod default_model;
#[path = "batch_invariance/matmul.rs"]
mod matmul;
#[path = "batch_invariance/tiny.rs"]
mod tiny;

use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::llama::{
    AttentionPolicy, ForwardBatch, KvCache, Model, AUTO_MIN_SPLIT_KV_TOKENS,
};
use pagoda_ops::attention::AttentionPath;

const PAGE_SIZE: usize = 16;

/// Auto's threshold in visible tokens (see the module docs).
const THRESHOLD: usize = AUTO_MIN_SPLIT_KV_TOKENS;

// The schedules below place rows at `T + 3` and long prompts at `T + 600`; the tiny model
// allows 4096 positions.
const _: () = assert!(
    THRESHOLD <= 3000,
    "rebuild the schedules for a threshold this large"
);

const POLICIES: [AttentionPolicy; 3] = [
    AttentionPolicy::Auto,
    AttentionPolicy::Force(AttentionPath::SplitKv),
    AttentionPolicy::Force(AttentionPath::Gather),
];

/// The policies the default model's tests run: all of [`POLICIES`] in the process the test
/// command started; only `Auto` (which mixes gather and split-KV rows) in the re-runs under
/// the other CPU kernel configurations (`under_every_cpu_configuration`), which are there
/// for the matmul kernels: the routes do not depend on them, and all three would take
/// minutes per configuration.
fn policies() -> &'static [AttentionPolicy] {
    if pagoda_testkit::is_rerun() {
        &POLICIES[..1]
    } else {
        &POLICIES
    }
}

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
        sparse: &[],
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

/// Asserts two runs produced the same positions with bit-identical logits.
fn assert_runs_equal(expected: &[(usize, Vec<f32>)], got: &[(usize, Vec<f32>)], context: &str) {
    assert_eq!(expected.len(), got.len(), "{context}: positions produced");
    for ((position, want), (got_position, got)) in expected.iter().zip(got) {
        assert_eq!(position, got_position, "{context}");
        assert_bits_equal(want, got, &format!("{context}, position {position}"));
    }
}

/// Chunk lengths that cut `0..total` at `cuts` (clamped to `total`; empty chunks dropped).
fn chunks_at(total: usize, cuts: &[usize]) -> Vec<usize> {
    let mut lengths = Vec::new();
    let mut start = 0;
    for &cut in cuts.iter().chain([&total]) {
        let cut = cut.min(total);
        if cut > start {
            lengths.push(cut - start);
            start = cut;
        }
    }
    lengths
}
fn sequence(seed: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104729 + i * i * 31) % vocab) as u32)
        .collect()
}

/// Re-runs the tests that depend on the matmul kernels under the configuration `auto` picks
/// on each CPU family this machine can stand in for (the `amx` set on emulated tiles where
/// it lacks them) and prints which ran; under every configuration and with every test when
/// `PAGODA_TEST_SLOW_CPU_CONFIGURATIONS=1` (several minutes per configuration here).
#[test]
fn under_every_cpu_configuration() {
    pagoda_testkit::rerun_under_each_cpus_default(
        "under_every_cpu_configuration",
        &[
            "default_model_step_is_bit_identical_alone_and_in_any_batch",
            "default_model_rows_across_threshold_are_bit_identical_however_chunked",
            "matmul::",
            "tiny::",
        ],
    );
}
