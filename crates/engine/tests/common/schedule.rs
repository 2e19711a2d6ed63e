//! The CPU-against-GPU harness of the CUDA forward tests (`cuda_forward.rs`,
//! `cuda_fp8_weights.rs`, `cuda_moe.rs`, `cuda_moe_quant.rs`, `cuda_mla.rs`): ragged schedules
//! over scattered pages and their error measures.

#![allow(dead_code)]

use pagoda_engine::cuda_runner::CudaCacheOptions;
use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model};

pub const PAGE_SIZE: usize = 16;
pub const NUM_PAGES: usize = 64;

pub fn cache_options() -> CudaCacheOptions {
    CudaCacheOptions {
        num_pages: NUM_PAGES,
        page_size: PAGE_SIZE,
        max_batch_tokens: 256,
        max_batch_requests: 8,
        max_context: NUM_PAGES * PAGE_SIZE,
        cuda_graphs: true,
        paged_decode: Default::default(),
        kernels: Default::default(),
    }
}

/// One step of a schedule: for each request, how many new tokens it runs.
pub type Schedule = Vec<Vec<usize>>;

/// Runs `schedule` over `prompts` (each request's tokens fed in order; once a request's prompt
/// is used up it feeds `next(request, step)`), calling `forward` per step, and returns every
/// step's logits (the last token of each request per step).
pub fn run_schedule(
    prompts: &[Vec<u32>],
    schedule: &Schedule,
    forward: &mut dyn FnMut(&ForwardBatch<'_>) -> Vec<f32>,
) -> Vec<Vec<f32>> {
    let mut pool = BlockPool::new(NUM_PAGES, PAGE_SIZE).unwrap();
    // Burn pages so physical pages are scattered.
    let _burned: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
    let mut tables: Vec<BlockTable> = prompts.iter().map(|_| BlockTable::new()).collect();
    let mut fed = vec![0usize; prompts.len()];
    let mut steps = Vec::new();
    for step in schedule {
        let (mut tokens, mut positions, mut slots, mut qo_indptr, mut logits_for) =
            (vec![], vec![], vec![], vec![0u32], vec![]);
        let mut active = Vec::new();
        for (request, &count) in step.iter().enumerate() {
            if count == 0 {
                continue;
            }
            let new_slots = tables[request].append_slots(&mut pool, count).unwrap();
            slots.extend(new_slots);
            for i in 0..count {
                let position = fed[request] + i;
                let prompt = &prompts[request];
                tokens.push(prompt[position % prompt.len()]);
                positions.push(position as u32);
            }
            fed[request] += count;
            qo_indptr.push(tokens.len() as u32);
            logits_for.push(tokens.len() - 1);
            active.push(request);
        }
        let table_refs: Vec<&BlockTable> = active.iter().map(|&r| &tables[r]).collect();
        let page_table = PageTable::from_block_tables(&table_refs, &pool).unwrap();
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            qo_indptr: &qo_indptr,
            page_table: &page_table,
            logits_for: &logits_for,
            sparse: &[],
        };
        steps.push(forward(&batch));
    }
    steps
}

pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    row.iter().map(|&v| v as f64 - max - sum.ln()).collect()
}

/// The first of a row's largest values.
pub fn argmax(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .unwrap()
}

/// What one device run gave against the oracle: the largest relative logit error (by each
/// row's peak), the largest top-10 log-probability error, the rows whose greedy id differs,
/// and of those the ones where the oracle's top two are further apart than twice the row's
/// largest error (a mismatch that rounding cannot explain).
#[derive(Debug, Default)]
pub struct Errors {
    pub relative: f64,
    pub logprob: f64,
    pub greedy_mismatches: usize,
    pub clear_greedy_mismatches: usize,
}

/// [`Errors`] of `got` against `expected`, rows of `vocab` logits.
pub fn measure(expected: &[Vec<f32>], got: &[Vec<f32>], vocab: usize) -> Errors {
    let mut errors = Errors::default();
    for (step, (e, g)) in expected.iter().zip(got).enumerate() {
        assert_eq!(e.len(), g.len(), "step {step}");
        assert!(
            g.iter().all(|v| v.is_finite()),
            "non-finite logits at step {step}"
        );
        for (e_row, g_row) in e.chunks(vocab).zip(g.chunks(vocab)) {
            let peak = e_row.iter().fold(0f32, |a, &b| a.max(b.abs())) as f64;
            let diff = e_row
                .iter()
                .zip(g_row)
                .fold(0f64, |a, (&x, &y)| a.max((x as f64 - y as f64).abs()));
            errors.relative = errors.relative.max(diff / peak.max(1e-6));
            let (le, lg) = (log_softmax(e_row), log_softmax(g_row));
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| le[b].total_cmp(&le[a]));
            for &i in &order[..10] {
                errors.logprob = errors.logprob.max((le[i] - lg[i]).abs());
            }
            if argmax(e_row) != argmax(g_row) {
                errors.greedy_mismatches += 1;
                let margin = (e_row[order[0]] - e_row[order[1]]) as f64;
                errors.clear_greedy_mismatches += usize::from(margin > 2.0 * diff);
            }
        }
    }
    errors
}

/// (max relative logit error, max logprob error over each row's top 10) of `got` against
/// `expected`: [`measure`]'s first two.
pub fn errors(expected: &[Vec<f32>], got: &[Vec<f32>], vocab: usize) -> (f64, f64) {
    let e = measure(expected, got, vocab);
    (e.relative, e.logprob)
}

/// Three prompts of `vocab` ids and a schedule of ragged prefill chunks mixed with decode
/// tokens (four mixed steps; five steps carry prefill chunks), then batched decode of 3 (graph
/// bucket 4), 2 and 1 rows: 10 decode-only steps, 15 in all.
pub fn ragged_workload(vocab: usize) -> (Vec<Vec<u32>>, Schedule) {
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|r| {
            (0..80)
                .map(|i| ((i * 31 + r * 7 + 3) % vocab) as u32)
                .collect()
        })
        .collect();
    // Steps 2 to 5 are mixed: one or two one-token rows first, then chunks. With graphs on,
    // steps 1 and 2 fall in the 48-token piecewise bucket, steps 3 to 5 in the 32-token one,
    // both captured by the warm-up (every step replays).
    let mut schedule: Schedule = vec![
        vec![37, 5, 0],
        vec![1, 20, 19],
        vec![1, 1, 30],
        vec![1, 1, 20],
        vec![1, 1, 18],
        vec![1, 1, 1],
    ];
    schedule.extend((0..6).map(|_| vec![1, 1, 1]));
    schedule.extend([vec![1, 0, 1], vec![0, 1, 0], vec![1, 1, 1]]);
    (prompts, schedule)
}

/// Three prompts of 48 ids; prefill chunks, mixed steps, then batched decode of 3, 2 and 1
/// rows (the MoE tests' workload).
pub fn short_workload(vocab: usize) -> (Vec<Vec<u32>>, Schedule) {
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|r| {
            (0..48)
                .map(|i| ((i * 37 + r * 11 + 5) % vocab) as u32)
                .collect()
        })
        .collect();
    let mut schedule: Schedule = vec![vec![21, 4, 0], vec![1, 17, 30], vec![1, 1, 9]];
    schedule.extend((0..6).map(|_| vec![1, 1, 1]));
    schedule.extend([vec![1, 0, 1], vec![0, 1, 0], vec![1, 1, 1]]);
    (prompts, schedule)
}

/// The CPU model's logits (the oracle) over `ragged_workload`.
pub fn cpu_logits(cpu: &Model, prompts: &[Vec<u32>], schedule: &Schedule) -> Vec<Vec<f32>> {
    let mut kv = KvCache::new(cpu.config().num_layers, cpu.kv_layout(NUM_PAGES, PAGE_SIZE));
    run_schedule(prompts, schedule, &mut |batch| {
        cpu.forward(batch, &mut kv, AttentionPolicy::Auto)
            .unwrap()
            .logits
    })
}
