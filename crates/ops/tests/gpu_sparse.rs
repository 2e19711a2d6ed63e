//! GPU tests of Quest sparse decode's device kernels against the CPU oracle (ignored
//! without `--include-ignored`: they need a GPU): the key summaries after every step of
//! prefill chunks, decode steps, padding slots and reused pages equal the CPU
//! `KeySummaries` exactly (f32, bf16, f16 pools); the device-selected page tables equal the
//! CPU `QuestSelector`'s exactly, with both kernel sets (`PAGODA_CUDA_SPARSE_SELECT`), on
//! random batches (head dims, GQA groups, budgets, windows, page sizes 16 and 32, contexts
//! around `min_context`, multi-row requests, tied scores, a request of the most pages the
//! device handles); and the gathered decode over the selected table, and the streaming decode
//! launched right after the selection (programmatic on Hopper), match the CPU decode over the
//! CPU-selected table.

#[path = "gpu_common/mod.rs"]
mod common;
#[path = "gpu_sparse/pools.rs"]
mod pools;

use common::*;
use half::{bf16, f16};
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_kv::{PageId, PageTable, PageTableRequest, Slot};
use pagoda_ops::attention::{
    plan_step, step_attention, DecodeSelector, KvSlice, QueryBatch, QuestSelector, SparseAttention,
    SplitKvChunking, StepAttentionConfig, StepWorkspace,
};
use pagoda_ops::cuda::{
    self as ops, sparse_summaries_len, DevicePageTable, MergeMode, PagedDecodeKernel,
    PagedDecodePlan, PagedDecodeWorkspace, PagedKv, PlanCapacity, PlanPolicy, PoolLayout, Queries,
    SparseSelectKernels, SparseSelectPlan, SparseSelectWorkspace, StreamTiling, SPARSE_MAX_PAGES,
};
use pools::{cpu_layout, device_slots, Pools};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Runs the device update for one step (the pool uploaded as the host holds it).
fn device_update<T: TestFloat>(
    gpu: &Gpu,
    pools: &Pools,
    slots: &[Option<Slot>],
    summaries: &mut DeviceBuffer<T>,
) {
    let k = upload::<T>(gpu, &pools.k);
    let slots = gpu
        .upload(&device_slots(slots, pools.layout.page_size))
        .unwrap();
    ops::sparse_summaries_update(gpu, &k, &pools.layout, &slots, summaries).unwrap();
}

/// The device summaries equal the CPU's on every page in `pages`.
fn assert_summaries<T: TestFloat>(
    what: &str,
    gpu: &Gpu,
    pools: &Pools,
    device: &DeviceBuffer<T>,
    pages: &[usize],
) {
    let device = download::<T>(gpu, device);
    let (heads, d) = (pools.layout.num_kv_heads, pools.layout.head_dim);
    for &page in pages {
        for head in 0..heads {
            let at = (page * heads + head) * 2 * d;
            let (min, max) = (&device[at..at + d], &device[at + d..at + 2 * d]);
            assert_eq!(
                min,
                pools.summaries.min(page, head),
                "{what}: min of page {page} head {head}"
            );
            assert_eq!(
                max,
                pools.summaries.max(page, head),
                "{what}: max of page {page} head {head}"
            );
        }
    }
}

fn summaries_case<T: TestFloat>(gpu: &Gpu, layout: PoolLayout, seed: u64) {
    let what = format!("{} {layout:?}", T::NAME);
    let mut rng = rng(seed);
    let mut pools = Pools::new(layout);
    let mut device = poisoned::<T>(gpu, sparse_summaries_len(&layout));
    let page_size = layout.page_size;
    // Three requests on disjoint pages; prefill chunks of all three in one step (with padding
    // slots between them), then decode steps, then request 0's pages reused from row 0.
    let mut lens = [0usize; 3];
    let pages_of = |request: usize, token: usize| request * 20 + token / page_size;
    let mut touched = std::collections::BTreeSet::new();
    for step in 0..24 {
        let mut slots = Vec::new();
        for (request, len) in lens.iter_mut().enumerate() {
            let chunk = if step < 4 {
                rng.random_range(1..=3 * page_size)
            } else {
                1
            };
            let chunk = chunk.min(20 * page_size - *len);
            for token in *len..*len + chunk {
                let page = pages_of(request, token);
                slots.push(Some(Slot {
                    page: PageId(page as u32),
                    offset: (token % page_size) as u32,
                }));
            }
            *len += chunk;
            if rng.random_bool(0.3) {
                slots.push(None);
            }
        }
        if step == 12 {
            // Request 0 finishes; a new one takes its pages, written from row 0 (two pages'
            // worth in one step, shorter than what the pages held).
            let reuse: Vec<Option<Slot>> = (0..page_size + 3)
                .map(|token| {
                    Some(Slot {
                        page: PageId(pages_of(0, token) as u32),
                        offset: (token % page_size) as u32,
                    })
                })
                .collect();
            lens[0] = page_size + 3;
            // The other requests' tokens of this step stay (rows are written in order: a
            // page never has a hole, which the device's recompute relies on).
            let others = slots
                .into_iter()
                .filter(|slot| slot.is_none_or(|s| s.page.index() >= pages_of(1, 0)));
            slots = reuse.into_iter().chain(others).collect();
        }
        // The pages this step writes.
        touched.extend(slots.iter().flatten().map(|slot| slot.page.index()));
        pools.write::<T>(&mut rng, &slots);
        device_update(gpu, &pools, &slots, &mut device);
        let pages: Vec<usize> = touched.iter().copied().collect();
        assert_summaries(&format!("{what} step {step}"), gpu, &pools, &device, &pages);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn summaries_match_the_cpu_fold() {
    let gpu = gpu();
    for (index, (head_dim, heads, page_size)) in
        [(32, 1, 16), (64, 2, 32), (128, 4, 16), (256, 2, 16)]
            .into_iter()
            .enumerate()
    {
        let layout = PoolLayout {
            num_pages: 64,
            page_size,
            num_kv_heads: heads,
            head_dim,
        };
        let seed = 100 + index as u64;
        summaries_case::<f32>(&gpu, layout, seed);
        summaries_case::<bf16>(&gpu, layout, seed);
        summaries_case::<f16>(&gpu, layout, seed);
    }
}

/// One selection case: requests of `lens` tokens (`rows` query rows each) over shuffled pages.
struct SelectCase {
    layout: PoolLayout,
    n_rep: usize,
    lens: Vec<usize>,
    rows: Vec<u32>,
    params: Vec<Option<SparseAttention>>,
}

/// What a selection case leaves for the decode check.
struct Selected<T> {
    pools: Pools,
    /// The selected table (the device's, equal to the CPU's).
    table: PageTable,
    /// The query rows (rounded through `T`).
    q: Vec<f32>,
    /// The full table, host and device.
    full: PageTable,
    full_device: [DeviceBuffer<u32>; 4],
    workspace: SparseSelectWorkspace,
    /// The device-selected page ids.
    out: DeviceBuffer<u32>,
    /// The device summaries and the query rows (in fused QKV rows of `stride`).
    summaries: DeviceBuffer<T>,
    q_device: DeviceBuffer<T>,
    stride: usize,
}

/// Builds the pools, runs the CPU and the device selection and asserts the tables are equal.
fn select_case<T: TestFloat>(gpu: &Gpu, case: &SelectCase, seed: u64) -> Selected<T> {
    let layout = case.layout;
    let what = format!(
        "{} {layout:?} n_rep {} lens {:?}",
        T::NAME,
        case.n_rep,
        case.lens
    );
    let mut rng = rng(seed);
    let page_size = layout.page_size;
    let mut free: Vec<u32> = (0..layout.num_pages as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.random_range(0..=i));
    }
    let mut pools = Pools::new(layout);
    let mut owned = Vec::new();
    // Everything written, in order: the device summaries are built from it as one step.
    let mut step = Vec::new();
    for &len in &case.lens {
        let pages: Vec<PageId> = (0..len.div_ceil(page_size))
            .map(|_| PageId(free.pop().unwrap()))
            .collect();
        let slots: Vec<Option<Slot>> = (0..len)
            .map(|t| {
                Some(Slot {
                    page: pages[t / page_size],
                    offset: (t % page_size) as u32,
                })
            })
            .collect();
        pools.write::<T>(&mut rng, &slots);
        step.extend(slots);
        // Ties: every fifth full middle page repeats the one before it.
        for i in (2..pages.len().saturating_sub(1)).step_by(5) {
            step.extend(pools.copy_page(pages[i - 1].index(), pages[i].index(), page_size));
        }
        owned.push(pages);
    }
    let requests: Vec<PageTableRequest<'_>> = owned
        .iter()
        .zip(&case.lens)
        .map(|(pages, &num_tokens)| PageTableRequest {
            pages,
            num_tokens,
            logical_start: 0,
        })
        .collect();
    let table = PageTable::build(&requests, layout.num_pages, page_size).unwrap();
    let mut qo_indptr = vec![0u32];
    for &rows in &case.rows {
        qo_indptr.push(qo_indptr.last().unwrap() + rows);
    }
    let num_q_heads = layout.num_kv_heads * case.n_rep;
    let q_row = num_q_heads * layout.head_dim;
    let total_rows = *qo_indptr.last().unwrap() as usize;
    let q = round::<T>(&random_vec(&mut rng, total_rows * q_row, 1.0));
    // CPU.
    let cpu_kv = pagoda_ops::attention::PagedKv {
        k_pool: KvSlice::F32(&pools.k),
        v_pool: KvSlice::F32(&pools.v),
        layout: cpu_layout(&layout),
        page_table: &table,
    };
    let queries = QueryBatch {
        q: &q,
        qo_indptr: &qo_indptr,
        num_q_heads,
    };
    let selector = QuestSelector {
        summaries: &pools.summaries,
        params: &case.params,
    };
    let mut expected = PageTable::default();
    let stats = selector.select(&cpu_kv, &queries, &mut expected).unwrap();
    // Device: summaries from the pool, then the plan and the selection. Queries in a fused
    // QKV row (stride past the heads).
    let k = upload::<T>(gpu, &pools.k);
    let step = gpu.upload(&device_slots(&step, page_size)).unwrap();
    let mut summaries = poisoned::<T>(gpu, sparse_summaries_len(&layout));
    ops::sparse_summaries_update(gpu, &k, &layout, &step, &mut summaries).unwrap();
    let stride = q_row + 2 * layout.token_stride();
    let mut fused = vec![0.0f32; total_rows * stride];
    for row in 0..total_rows {
        fused[row * stride..row * stride + q_row]
            .copy_from_slice(&q[row * q_row..(row + 1) * q_row]);
    }
    let q_device = upload::<T>(gpu, &fused);
    let plan = SparseSelectPlan::new(
        &table,
        &qo_indptr,
        &case.params,
        page_size,
        SPARSE_MAX_PAGES,
    )
    .unwrap();
    assert_eq!(plan.stats, stats, "{what}: stats");
    let max_pages = plan.max_sparse_pages.max(1);
    let mut workspace = SparseSelectWorkspace::new(gpu, case.lens.len(), max_pages).unwrap();
    workspace.upload(gpu, &plan).unwrap();
    let full = [
        gpu.upload(&table.indptr).unwrap(),
        gpu.upload(&table.indices).unwrap(),
        gpu.upload(&table.last_page_len).unwrap(),
        gpu.upload(&table.first_page_offset).unwrap(),
    ];
    let device_table = DevicePageTable::new(&full[0], &full[1], &full[2], &full[3]).unwrap();
    // A decode step's update: each request's last row (its window's, never scored).
    let last_slots: Vec<i32> = (0..table.num_requests())
        .filter(|&r| table.indptr[r + 1] > table.indptr[r] && table.last_page_len[r] > 0)
        .map(|r| {
            let page = table.indices[table.indptr[r + 1] as usize - 1] as usize;
            (page * page_size + table.last_page_len[r] as usize - 1) as i32
        })
        .collect();
    let last_slots = (!last_slots.is_empty()).then(|| gpu.upload(&last_slots).unwrap());
    // Both kernel sets (PAGODA_CUDA_SPARSE_SELECT) keep the CPU's pages; radix also with the
    // scores beside a step's update (programmatic on Hopper).
    let mut last = None;
    // The looped scores also run at one CTA slot: every CTA takes its most rounds.
    let sets = [
        (SparseSelectKernels::Bitwise, false, None),
        (SparseSelectKernels::Radix, false, None),
        (SparseSelectKernels::Radix, false, Some(1)),
        (SparseSelectKernels::Radix, true, None),
    ];
    for (kernels, after_update, score_ctas) in sets {
        workspace.set_kernels(kernels);
        workspace.set_after_update(after_update);
        workspace.set_score_ctas(score_ctas);
        if let (true, Some(slots)) = (after_update, &last_slots) {
            ops::sparse_summaries_update(gpu, &k, &layout, slots, &mut summaries).unwrap();
        }
        let mut out = poisoned::<u32>(gpu, plan.selected_pages().max(1));
        ops::sparse_select(
            gpu,
            &Queries::new(&q_device, num_q_heads, stride),
            &summaries,
            &layout,
            &device_table,
            &mut workspace,
            &mut out,
        )
        .unwrap();
        let mut indices = gpu.download(&out).unwrap();
        indices.truncate(plan.selected_pages());
        let table = plan.table(&table, indices);
        let set = format!("{kernels:?}, after update {after_update}, CTAs {score_ctas:?}");
        assert_eq!(table, expected, "{what}: selected table ({set})");
        last = Some((table, out));
    }
    let (selected, out) = last.unwrap();
    Selected {
        pools,
        table: selected,
        q,
        full: table,
        full_device: full,
        workspace,
        out,
        summaries,
        q_device,
        stride,
    }
}

fn random_case(
    rng: &mut ChaCha8Rng,
    head_dim: usize,
    (heads, n_rep): (usize, usize),
) -> SelectCase {
    let page_size = if rng.random_bool(0.5) { 16 } else { 32 };
    let num_requests = rng.random_range(1..=5);
    let mut lens: Vec<usize> = Vec::new();
    let mut rows = Vec::new();
    let mut params = Vec::new();
    for _ in 0..num_requests {
        let len = rng.random_range(1..=3000);
        lens.push(len);
        rows.push(if rng.random_bool(0.15) {
            len.min(3) as u32
        } else {
            1
        });
        params.push(if rng.random_bool(0.1) {
            None
        } else {
            let budget = rng.random_range(16..=1024);
            let window = rng.random_range(0..=budget.min(256));
            let min_context = rng.random_range(0..=2000);
            Some(SparseAttention::new(budget, window, min_context).unwrap())
        });
    }
    let pages: usize = lens.iter().map(|len| len.div_ceil(page_size)).sum();
    SelectCase {
        layout: PoolLayout {
            num_pages: pages + 8,
            page_size,
            num_kv_heads: heads,
            head_dim,
        },
        n_rep,
        lens,
        rows,
        params,
    }
}

#[test]
#[ignore = "needs a GPU"]
fn selection_matches_the_quest_selector() {
    let gpu = gpu();
    let mut rng = rng(38);
    // head_dim 96 takes the scores' scalar path in bf16 (slices of 12) and 16-byte loads in
    // f32; 20 KV heads put 3 pages (60 pairs) in a CTA, 1 KV head 64 pages.
    for head_dim in [64, 96, 128] {
        for group in [(2, 1), (2, 4), (1, 8), (4, 2), (8, 4), (20, 1)] {
            for seed in 0..3u64 {
                let case = random_case(&mut rng, head_dim, group);
                select_case::<bf16>(&gpu, &case, seed);
                select_case::<f32>(&gpu, &case, seed + 1000);
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn selection_handles_the_longest_request() {
    let gpu = gpu();
    let page_size = 16;
    let len = SPARSE_MAX_PAGES * page_size;
    let case = SelectCase {
        layout: PoolLayout {
            num_pages: SPARSE_MAX_PAGES + 20,
            page_size,
            num_kv_heads: 1,
            head_dim: 32,
        },
        n_rep: 2,
        lens: vec![len, 200],
        rows: vec![1, 1],
        params: vec![Some(SparseAttention::new(2048, 128, 1024).unwrap()); 2],
    };
    let selected = select_case::<bf16>(&gpu, &case, 7);
    assert_eq!(selected.table.seq_lens[0], 2048);
}

#[test]
#[ignore = "needs a GPU"]
fn decode_over_the_selected_table_matches_the_cpu() {
    let gpu = gpu();
    let (heads, n_rep, head_dim) = (2, 4, 128);
    let case = SelectCase {
        layout: PoolLayout {
            num_pages: 400,
            page_size: 16,
            num_kv_heads: heads,
            head_dim,
        },
        n_rep,
        lens: vec![2500, 900, 1500],
        rows: vec![1, 1, 1],
        params: vec![Some(SparseAttention::new(512, 64, 1000).unwrap()); 3],
    };
    let run = select_case::<bf16>(&gpu, &case, 11);
    let (pools, selected, q, full) = (&run.pools, &run.table, &run.q, &run.full);
    assert!(
        selected.indices.len() < full.indices.len(),
        "nothing was dropped"
    );
    let layout = case.layout;
    let num_q_heads = heads * n_rep;
    let scale = 1.0 / (head_dim as f32).sqrt();
    // CPU: the step decode over the selected table (f32).
    let kv = pagoda_ops::attention::PagedKv {
        k_pool: KvSlice::F32(&pools.k),
        v_pool: KvSlice::F32(&pools.v),
        layout: cpu_layout(&layout),
        page_table: selected,
    };
    let qo_indptr: Vec<u32> = (0..=selected.num_requests() as u32).collect();
    let config = StepAttentionConfig {
        chunking: SplitKvChunking::new(heads, 64),
        min_split_kv_tokens: 16,
    };
    let plan = plan_step(&kv, &qo_indptr, num_q_heads, &config).unwrap();
    let queries = QueryBatch {
        q,
        qo_indptr: &qo_indptr,
        num_q_heads,
    };
    let mut expected = vec![0.0; q.len()];
    let mut workspace = StepWorkspace::default();
    step_attention(&kv, &queries, &plan, scale, &mut workspace, &mut expected).unwrap();
    // Device: the gathered decode over the selected table as the device holds it.
    let [indptr, indices, last, first] = &run.full_device;
    let full_table = DevicePageTable::new(indptr, indices, last, first).unwrap();
    let device_table = run.workspace.selected_table(&full_table, &run.out).unwrap();
    let (k, v) = (
        upload::<bf16>(&gpu, &pools.k),
        upload::<bf16>(&gpu, &pools.v),
    );
    let q_device = upload::<bf16>(&gpu, q);
    let kv = PagedKv::new(&k, &v, layout, device_table);
    let b = selected.num_requests();
    let mut decode =
        ops::DecodeWorkspace::new(&gpu, &layout, num_q_heads, b, selected.indices.len()).unwrap();
    let mut out = poisoned::<bf16>(&gpu, q.len());
    let queries = Queries::new(&q_device, num_q_heads, num_q_heads * head_dim);
    ops::decode_attention_gathered(&gpu, &queries, &kv, &mut decode, 1, scale, &mut out).unwrap();
    let actual = download::<bf16>(&gpu, &out);
    assert_close("sparse decode", &actual, &expected, bf16::TOLERANCE);

    // As a step runs it: the radix selection into poisoned ids, then the streaming decode
    // right after it (programmatic on Hopper, so it must wait for the ids it reads).
    let policy = PlanPolicy {
        target_ctas: 264,
        pages_per_chunk: None,
        min_pages_per_chunk: 4,
        resident_ctas: None,
    };
    let mut capacity = PlanCapacity::for_batch(b, heads, 264);
    capacity.max_chunks += b * 64;
    let plan = PagedDecodePlan::new(&selected.indptr, heads, policy, capacity).unwrap();
    let mut fused =
        PagedDecodeWorkspace::new(&gpu, capacity, num_q_heads, heads, head_dim).unwrap();
    fused.set_kernel(PagedDecodeKernel::Streaming(StreamTiling::ALL[0]));
    fused.upload_plan(&gpu, &plan).unwrap();
    let mut select = run.workspace;
    select.set_kernels(SparseSelectKernels::Radix);
    let mut ids = poisoned::<u32>(&gpu, selected.indices.len());
    let mut out = poisoned::<bf16>(&gpu, q.len());
    let step_q = Queries::new(&run.q_device, num_q_heads, run.stride);
    let summaries = &run.summaries;
    ops::sparse_select(
        &gpu,
        &step_q,
        summaries,
        &layout,
        &full_table,
        &mut select,
        &mut ids,
    )
    .unwrap();
    let table = select.selected_table(&full_table, &ids).unwrap();
    let kv = PagedKv::new(&k, &v, layout, table);
    let merge = MergeMode::Separate;
    ops::sparse_decode(&gpu, &queries, &kv, &mut fused, merge, scale, &mut out).unwrap();
    let actual = download::<bf16>(&gpu, &out);
    assert_close(
        "sparse decode after the selection",
        &actual,
        &expected,
        bf16::TOLERANCE,
    );
}
