//! GPU tests of cascade decode (the shared level on tensor cores, the fused decode over the
//! suffix table, the merge over both) on random shared-prefix batches with nested groups,
//! requests sharing nothing, groups of one and twins whose every page is shared: against an
//! f64 reference and the plain fused decode of the same batch, at head sizes 64 and 128,
//! GQA groups 1 to 8 and both shared tilings; and a CUDA graph captured for one plan
//! replaying another (ignored without `--include-ignored`: they need a GPU).

mod cascade_common;
#[path = "gpu_common/mod.rs"]
mod common;

use cascade_common::{shared_batch, SharedBatch};
use common::decode_batch::{peak_error, Batch};
use common::*;
use half::bf16;
use pagoda_cuda::{DeviceBuffer, DeviceRead, Gpu};
use pagoda_ops::attention::CascadeRule;
use pagoda_ops::cuda::{
    self as ops, CascadeCapacity, CascadeGeometry, CascadePlan, CascadeWorkspace, DevicePageTable,
    MergeMode, PagedDecodeKernel, PagedDecodePlan, PagedDecodeWorkspace, PagedKv, PlanCapacity,
    PlanPolicy, PoolLayout, PrefillStreamTiling, Queries, StreamTiling,
};

const PAGE: usize = 16;
/// Pool pages (a prime: the batch's page ids are scattered below it).
const POOL_PAGES: u64 = 4099;

struct Setup {
    layout: PoolLayout,
    q_heads: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    k_pool: DeviceBuffer<bf16>,
    v_pool: DeviceBuffer<bf16>,
}

fn setup(gpu: &Gpu, seed: u64, head_dim: usize, q_heads: usize, kv_heads: usize) -> Setup {
    let layout = PoolLayout {
        num_pages: POOL_PAGES as usize,
        page_size: PAGE,
        num_kv_heads: kv_heads,
        head_dim,
    };
    let mut rng = rng(seed);
    let k = round::<bf16>(&random_vec(&mut rng, layout.pool_len(), 1.0));
    let v = round::<bf16>(&random_vec(&mut rng, layout.pool_len(), 1.0));
    Setup {
        k_pool: upload(gpu, &k),
        v_pool: upload(gpu, &v),
        layout,
        q_heads,
        k,
        v,
    }
}

fn capacity(b: usize, kv_heads: usize) -> (PlanPolicy, PlanCapacity, CascadeCapacity) {
    let policy = PlanPolicy {
        target_ctas: 264,
        pages_per_chunk: None,
        min_pages_per_chunk: 4,
        resident_ctas: None,
    };
    let mut plan = PlanCapacity::for_batch(b, kv_heads, 264);
    plan.max_chunks += b * 64;
    let shared = CascadeCapacity {
        max_items: 2048,
        max_members: 8192,
    };
    (policy, plan, shared)
}

fn oracle_batch(shared: &SharedBatch) -> Batch {
    let table = shared.table(PAGE);
    Batch {
        indptr: table.indptr,
        indices: table.indices,
        last_page_len: table.last_page_len,
        first_page_offset: table.first_page_offset,
    }
}

/// Cascade decode of `shared`, and the plain fused decode of the same batch.
fn run(
    gpu: &Gpu,
    s: &Setup,
    shared: &SharedBatch,
    (rows, kernel): (usize, PagedDecodeKernel),
    q: &DeviceBuffer<bf16>,
) -> (Vec<f32>, Vec<f32>, CascadePlan) {
    let table = shared.table(PAGE);
    let b = table.num_requests();
    let d = s.layout.head_dim;
    let kv_heads = s.layout.num_kv_heads;
    let (policy, plan_capacity, shared_capacity) = capacity(b, kv_heads);
    let geometry = CascadeGeometry {
        page_size: PAGE,
        num_kv_heads: kv_heads,
        group: s.q_heads / kv_heads,
        rows,
        target_ctas: 264,
        min_chunk_tokens: 64,
        max_slots: 16,
    };
    let plan = CascadePlan::new(
        &table,
        &geometry,
        &CascadeRule::ANY,
        (policy, plan_capacity),
        shared_capacity,
    )
    .unwrap()
    .expect("the batch shares pages");
    let arrays = oracle_batch(shared).upload(gpu);
    let device_table =
        DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
    let kv = PagedKv::new(&s.k_pool, &s.v_pool, s.layout, device_table);
    let queries = Queries::new(q, s.q_heads, s.q_heads * d);
    let mut decode = PagedDecodeWorkspace::new(gpu, plan_capacity, s.q_heads, kv_heads, d).unwrap();
    decode.set_kernel(kernel);
    // Plain fused decode first (its plan over the full table).
    let plain_plan = PagedDecodePlan::new(&table.indptr, kv_heads, policy, plan_capacity).unwrap();
    decode.upload_plan(gpu, &plain_plan).unwrap();
    let mut out = poisoned::<bf16>(gpu, b * s.q_heads * d);
    ops::paged_decode_attention(
        gpu,
        &queries,
        &kv,
        &mut decode,
        MergeMode::Separate,
        0.1,
        &mut out,
    )
    .unwrap();
    let plain = download(gpu, &out);
    // Cascade.
    decode.upload_plan(gpu, &plan.decode).unwrap();
    let mut cascade = CascadeWorkspace::new(gpu, shared_capacity, b, table.indices.len()).unwrap();
    cascade.set_tiling(PrefillStreamTiling::new(rows, 64, 2));
    cascade.stage(gpu, &plan).unwrap();
    let mut out = poisoned::<bf16>(gpu, b * s.q_heads * d);
    ops::cascade_decode_attention(gpu, &queries, &kv, (&cascade, &mut decode), 0.1, &mut out)
        .unwrap();
    (download(gpu, &out), plain, plan)
}

#[test]
#[ignore = "needs a GPU"]
fn cascade_matches_the_reference_and_the_plain_decode() {
    let gpu = gpu();
    let mut rng = rng(36);
    let streaming = PagedDecodeKernel::Streaming(StreamTiling::ALL[0]);
    let cases = [
        // (head_dim, q_heads, kv_heads, rows, kernel, batch)
        (128, 32, 8, 64, streaming, 24),
        (128, 32, 8, 128, PagedDecodeKernel::CudaCore, 40),
        (64, 8, 8, 64, streaming, 33),
        (128, 16, 2, 128, streaming, 17),
        (64, 12, 4, 64, PagedDecodeKernel::CudaCore, 9),
    ];
    for (index, &(d, q_heads, kv_heads, rows, kernel, b)) in cases.iter().enumerate() {
        let s = setup(&gpu, index as u64, d, q_heads, kv_heads);
        let shared = shared_batch(&mut rng, b, (24, 6), (PAGE, POOL_PAGES), index % 2 == 0);
        let q_host = round::<bf16>(&random_vec(&mut rng, shared.lists.len() * q_heads * d, 1.0));
        let q = upload::<bf16>(&gpu, &q_host);
        let (cascade, plain, plan) = run(&gpu, &s, &shared, (rows, kernel), &q);
        let expected =
            oracle_batch(&shared).reference(&s.layout, q_heads, &q_host, &s.k, &s.v, 0.1);
        let what =
            format!("case {index}: D{d} {q_heads}/{kv_heads} heads, {rows} rows, {kernel:?}");
        let error = peak_error(&cascade, &expected);
        assert!(error <= 2e-2, "{what}: cascade against f64: {error:e}");
        let error = peak_error(&plain, &expected);
        assert!(error <= 2e-2, "{what}: plain against f64: {error:e}");
        let error = peak_error(&cascade, &plain);
        assert!(error <= 2e-2, "{what}: cascade against plain: {error:e}");
        assert!(plan.stats.saved_token_reads > 0, "{what}: nothing shared");
    }
}

/// The fixed device buffers a captured graph reads: the full table, the queries, the output
/// and both workspaces, refilled per batch.
struct Fixed {
    arrays: [DeviceBuffer<u32>; 4],
    q: DeviceBuffer<bf16>,
    out: DeviceBuffer<bf16>,
    decode: PagedDecodeWorkspace,
    cascade: CascadeWorkspace,
}

impl Fixed {
    fn stage(&mut self, gpu: &Gpu, plan: &CascadePlan, batch: &SharedBatch, q_host: &[f32]) {
        let table = batch.table(PAGE);
        self.decode.upload_plan(gpu, &plan.decode).unwrap();
        self.cascade.stage(gpu, plan).unwrap();
        let mut indices = table.indices.clone();
        indices.resize(self.arrays[1].len(), 0);
        let [indptr, device_indices, last, _] = &mut self.arrays;
        gpu.upload_into(&table.indptr, indptr).unwrap();
        gpu.upload_into(&indices, device_indices).unwrap();
        gpu.upload_into(&table.last_page_len, last).unwrap();
        let host: Vec<bf16> = q_host.iter().map(|&x| bf16::from_f32(x)).collect();
        gpu.upload_into(&host, &mut self.q).unwrap();
    }

    fn record(&mut self, gpu: &Gpu, s: &Setup) -> Result<(), pagoda_cuda::CudaError> {
        let [indptr, indices, last, fpo] = &self.arrays;
        let table = DevicePageTable::new(indptr, indices, last, fpo)?;
        let kv = PagedKv::new(&s.k_pool, &s.v_pool, s.layout, table);
        let d = s.layout.head_dim;
        let queries = Queries::new(&self.q, s.q_heads, s.q_heads * d);
        let levels = (&self.cascade, &mut self.decode);
        ops::cascade_decode_attention(gpu, &queries, &kv, levels, 0.1, &mut self.out)
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_graph_captured_for_one_plan_replays_another() {
    let gpu = gpu();
    let mut rng = rng(37);
    let (d, q_heads, kv_heads, b) = (128, 32, 8, 20);
    let s = setup(&gpu, 9, d, q_heads, kv_heads);
    let (policy, plan_capacity, shared_capacity) = capacity(b, kv_heads);
    let geometry = CascadeGeometry {
        page_size: PAGE,
        num_kv_heads: kv_heads,
        group: q_heads / kv_heads,
        rows: 64,
        target_ctas: 264,
        min_chunk_tokens: 64,
        max_slots: 16,
    };
    let batches: Vec<SharedBatch> = (0..2)
        .map(|_| shared_batch(&mut rng, b, (24, 6), (PAGE, POOL_PAGES), false))
        .collect();
    let plans: Vec<CascadePlan> = batches
        .iter()
        .map(|batch| {
            let rule = &CascadeRule::ANY;
            let sizes = (policy, plan_capacity);
            CascadePlan::new(&batch.table(PAGE), &geometry, rule, sizes, shared_capacity)
                .unwrap()
                .expect("the batch shares pages")
        })
        .collect();
    let pages = batches
        .iter()
        .map(|x| x.lists.iter().map(Vec::len).sum::<usize>())
        .max()
        .unwrap();
    let mut fixed = Fixed {
        arrays: [
            gpu.zeros(b + 1).unwrap(),
            gpu.zeros(pages).unwrap(),
            gpu.zeros(b).unwrap(),
            gpu.zeros(b).unwrap(),
        ],
        q: gpu.zeros(b * q_heads * d).unwrap(),
        out: poisoned::<bf16>(&gpu, b * q_heads * d),
        decode: PagedDecodeWorkspace::new(&gpu, plan_capacity, q_heads, kv_heads, d).unwrap(),
        cascade: CascadeWorkspace::new(&gpu, shared_capacity, b, pages).unwrap(),
    };
    fixed
        .decode
        .set_kernel(PagedDecodeKernel::Streaming(StreamTiling::ALL[0]));
    let queries: Vec<Vec<f32>> = (0..2)
        .map(|_| round::<bf16>(&random_vec(&mut rng, b * q_heads * d, 1.0)))
        .collect();
    fixed.stage(&gpu, &plans[0], &batches[0], &queries[0]);
    fixed.record(&gpu, &s).unwrap(); // compiles the kernels outside the capture
    gpu.synchronize().unwrap();
    let graph = gpu.capture(|gpu| fixed.record(gpu, &s)).unwrap();
    for (index, batch) in batches.iter().enumerate() {
        fixed.stage(&gpu, &plans[index], batch, &queries[index]);
        gpu.fill_bytes(&mut fixed.out, 0xFF).unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let actual = download(&gpu, &fixed.out);
        let expected =
            oracle_batch(batch).reference(&s.layout, q_heads, &queries[index], &s.k, &s.v, 0.1);
        let error = peak_error(&actual, &expected);
        assert!(error <= 2e-2, "replay {index}: {error:e}");
    }
}
