//! The CPU-against-GPU harness of the CUDA forward tests (`cuda_forward.rs`,
//! `cuda_fp8_weights.rs`, `cuda_moe_quant.rs`): ragged schedules over scattered pages and
//! their error measures.

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

/// (max relative logit error, max logprob error over each row's top 10) of `got` against
/// `expected`, rows of `vocab` logits.
pub fn errors(expected: &[Vec<f32>], got: &[Vec<f32>], vocab: usize) -> (f64, f64) {
    let mut worst_relative = 0f64;
    let mut worst_logprob = 0f64;
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
            worst_relative = worst_relative.max(diff / peak.max(1e-6));
            let (le, lg) = (log_softmax(e_row), log_softmax(g_row));
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| le[b].total_cmp(&le[a]));
            for &i in &order[..10] {
                worst_logprob = worst_logprob.max((le[i] - lg[i]).abs());
            }
        }
    }
    (worst_relative, worst_logprob)
}

/// Compares CPU and GPU on one geometry; returns (max relative logit error in f32, max
/// logprob error in bf16 over each row's top 10).
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

/// The CPU model's logits (the oracle) over `ragged_workload`.
pub fn cpu_logits(cpu: &Model, prompts: &[Vec<u32>], schedule: &Schedule) -> Vec<Vec<f32>> {
    let mut kv = KvCache::new(cpu.config().num_layers, cpu.kv_layout(NUM_PAGES, PAGE_SIZE));
    run_schedule(prompts, schedule, &mut |batch| {
        cpu.forward(batch, &mut kv, AttentionPolicy::Auto)
            .unwrap()
            .logits
    })
}
