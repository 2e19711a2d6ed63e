//! GPU tests of DeepSeek's latent attention (MLA) on CUDA against the CPU op
//! (`pagoda_ops::attention::mla_attention`): the absorbed decode (CUDA cores in f32 and bf16,
//! tensor cores in bf16) over heads 16 and 128, contexts 1 to 4096, pages of 16 and 1 token,
//! uneven page tables, batches 1/3/8, split and unsplit; the causal prefill; the latent append
//! bit for bit; CUDA graph replay with new plans (ignored without `--include-ignored`: they
//! need a GPU).

#[path = "gpu_common/mod.rs"]
mod common;

use common::decode_batch::peak_error;
use common::*;
use half::bf16;
use pagoda_cuda::{whole, Gpu};
use pagoda_kv::PageTable;
use pagoda_ops::attention::{mla_attention, KvLayout, LatentKv};
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, LatentPool, MlaDecodeWorkspace, MlaKernel, NewLatent,
    PagedDecodePlan, PlanCapacity, PlanPolicy, PoolLayout, Queries,
};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const LATENT: usize = 512;
const ROPE: usize = 64;
const ROW: usize = LATENT + ROPE;
/// Pool rows of every test pool (pages of `page_size` rows).
const POOL_ROWS: usize = 1 << 16;

/// DeepSeek's softmax scale for qk_nope 128 + qk_rope 64.
fn scale() -> f32 {
    1.0 / 192f32.sqrt()
}

/// A CSR page table over `num_pages` pages for requests of `lens` visible tokens: with
/// `uneven`, odd requests start mid-page and read a descending run of pages; other pages are
/// drawn at random.
fn page_table(rng: &mut ChaCha8Rng, lens: &[usize], page_size: usize, uneven: bool) -> PageTable {
    let num_pages = POOL_ROWS / page_size;
    let mut table = PageTable {
        indices: Vec::new(),
        indptr: vec![0],
        last_page_len: Vec::new(),
        first_page_offset: Vec::new(),
        seq_lens: Vec::new(),
        rope_offsets: Vec::new(),
    };
    for (r, &len) in lens.iter().enumerate() {
        let fpo = if uneven && r % 2 == 1 && len > 0 && page_size > 1 {
            rng.random_range(1..page_size)
        } else {
            0
        };
        let pages = if len == 0 {
            0
        } else {
            (fpo + len).div_ceil(page_size)
        };
        let start = rng.random_range(0..num_pages);
        for p in 0..pages {
            let page = if uneven && r % 2 == 1 {
                (start + num_pages - p % num_pages) % num_pages
            } else {
                rng.random_range(0..num_pages)
            };
            table.indices.push(page as u32);
        }
        table.indptr.push(table.indices.len() as u32);
        let last = if pages == 0 {
            0
        } else {
            fpo + len - (pages - 1) * page_size
        };
        table.last_page_len.push(last as u32);
        table.first_page_offset.push(fpo as u32);
        table.seq_lens.push(len as u32);
        table.rope_offsets.push((fpo + len) as u32);
    }
    table
}

fn pool_layout(page_size: usize) -> PoolLayout {
    PoolLayout {
        num_pages: POOL_ROWS / page_size,
        page_size,
        num_kv_heads: 1,
        head_dim: ROW,
    }
}

/// The CPU op on `pool` (f32 values, already rounded to the GPU's dtype).
fn reference(
    table: &PageTable,
    page_size: usize,
    pool: &[f32],
    q: &[f32],
    qo_indptr: &[u32],
    num_heads: usize,
) -> Vec<f32> {
    let layout = KvLayout {
        num_pages: POOL_ROWS / page_size,
        page_size,
        num_kv_heads: 1,
        head_dim: ROW,
    };
    let kv = LatentKv {
        pool: pool.into(),
        layout,
        page_table: table,
    };
    let tokens = *qo_indptr.last().unwrap() as usize;
    let mut out = vec![0f32; tokens * num_heads * LATENT];
    mla_attention(&kv, q, qo_indptr, num_heads, LATENT, scale(), &mut out).unwrap();
    out
}

/// Runs the decode over `table` with `kernel` and `policy`; returns the output.
#[allow(clippy::too_many_arguments)]
fn decode<T: TestFloat>(
    gpu: &Gpu,
    table: &PageTable,
    page_size: usize,
    pool: &pagoda_cuda::DeviceBuffer<T>,
    q: &pagoda_cuda::DeviceBuffer<T>,
    num_heads: usize,
    policy: PlanPolicy,
    kernel: MlaKernel,
) -> Vec<f32> {
    let b = table.num_requests();
    let tiles = ops::mla_head_tiles(num_heads);
    let mut capacity = PlanCapacity::for_batch(b, tiles, policy.target_ctas);
    if policy.pages_per_chunk.is_some() {
        capacity.max_chunks = table.indices.len() + b;
    }
    let plan = PagedDecodePlan::new(&table.indptr, tiles, policy, capacity).unwrap();
    let mut workspace = MlaDecodeWorkspace::new(gpu, capacity, num_heads, LATENT).unwrap();
    workspace.upload_plan(gpu, &plan).unwrap();
    workspace.set_kernel(kernel);
    let arrays = [
        &table.indptr,
        &table.indices,
        &table.last_page_len,
        &table.first_page_offset,
    ]
    .map(|array| gpu.upload(array).unwrap());
    let device_table =
        DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
    let kv = LatentPool::new(pool, pool_layout(page_size), device_table, LATENT);
    let mut out = poisoned::<T>(gpu, b * num_heads * LATENT);
    ops::mla_decode(
        gpu,
        &Queries::new(q, num_heads, num_heads * ROW),
        &kv,
        &mut workspace,
        scale(),
        &mut out,
    )
    .unwrap();
    download(gpu, &out)
}

/// The decode matrix for one dtype and kernel against the CPU op; returns (cases, worst).
fn decode_matrix<T: TestFloat>(gpu: &Gpu, kernel: MlaKernel, tolerance: f32) -> (usize, f32) {
    let sm = gpu.info().sm_count as usize;
    let mut rng = rng(37);
    let pool_values = random_vec(&mut rng, POOL_ROWS * ROW, 1.0);
    let pool_rounded = round::<T>(&pool_values);
    let pool = upload::<T>(gpu, &pool_values);
    let (mut cases, mut worst) = (0, 0f32);
    for num_heads in [16, 128] {
        for page_size in [16, 1] {
            for context in [1, 15, 16, 17, 1000, 4096] {
                for batch in [1, 3, 8] {
                    // Lengths around the context (the first request exactly at it).
                    let lens: Vec<usize> = (0..batch)
                        .map(|r| {
                            if r == 0 {
                                context
                            } else {
                                rng.random_range(1..=context + 16)
                            }
                        })
                        .collect();
                    let table = page_table(&mut rng, &lens, page_size, true);
                    let q_values = random_vec(&mut rng, batch * num_heads * ROW, 2.0);
                    let q = upload::<T>(gpu, &q_values);
                    let qo_indptr: Vec<u32> = (0..=batch as u32).collect();
                    let expected = reference(
                        &table,
                        page_size,
                        &pool_rounded,
                        &round::<T>(&q_values),
                        &qo_indptr,
                        num_heads,
                    );
                    let searched = PlanPolicy {
                        target_ctas: 2 * sm,
                        pages_per_chunk: None,
                        min_pages_per_chunk: 1,
                        resident_ctas: None,
                    };
                    let unsplit = PlanPolicy {
                        pages_per_chunk: Some(1 << 20),
                        ..searched
                    };
                    let forced = PlanPolicy {
                        pages_per_chunk: Some(if page_size == 1 { 37 } else { 3 }),
                        ..searched
                    };
                    for (name, policy) in [
                        ("searched", searched),
                        ("unsplit", unsplit),
                        ("forced", forced),
                    ] {
                        let actual =
                            decode(gpu, &table, page_size, &pool, &q, num_heads, policy, kernel);
                        let error = peak_error(&actual, &expected);
                        worst = worst.max(error);
                        assert!(
                            error <= tolerance,
                            "{} {kernel:?} H{num_heads} page{page_size} L{context} B{batch} {name}: \
                             error {error:e} > {tolerance:e}",
                            T::NAME
                        );
                        cases += 1;
                    }
                }
            }
        }
    }
    (cases, worst)
}

#[test]
#[ignore = "needs a GPU"]
fn mla_decode_f32_matches_the_cpu_op() {
    let gpu = gpu();
    let (cases, worst) = decode_matrix::<f32>(&gpu, MlaKernel::CudaCore, 1e-5);
    println!("mla decode f32 (CUDA cores): {cases} cases, worst {worst:.2e} of the peak");
}

#[test]
#[ignore = "needs a GPU"]
fn mla_decode_bf16_cuda_cores_matches_the_cpu_op() {
    let gpu = gpu();
    let (cases, worst) = decode_matrix::<bf16>(&gpu, MlaKernel::CudaCore, 1e-2);
    println!("mla decode bf16 (CUDA cores): {cases} cases, worst {worst:.2e} of the peak");
}

#[test]
#[ignore = "needs a GPU"]
fn mla_decode_bf16_tensor_cores_matches_the_cpu_op() {
    let gpu = gpu();
    for stages in [2, 3] {
        let kernel = MlaKernel::TensorCore { stages };
        let (cases, worst) = decode_matrix::<bf16>(&gpu, kernel, 2e-2);
        println!("mla decode bf16 (tensor cores, {stages} stages): {cases} cases, worst {worst:.2e} of the peak");
    }
}

/// The causal prefill: ragged query counts (1, 5, 17, 0) over contexts of their own.
fn prefill_case<T: TestFloat>(gpu: &Gpu, num_heads: usize, page_size: usize, tolerance: f32) {
    let mut rng = rng(num_heads as u64 + page_size as u64);
    let pool_values = random_vec(&mut rng, POOL_ROWS * ROW, 1.0);
    let pool = upload::<T>(gpu, &pool_values);
    let (lens, q_lens) = ([1usize, 40, 17, 300], [1u32, 5, 17, 0]);
    let table = page_table(&mut rng, &lens, page_size, true);
    let mut qo_indptr = vec![0u32];
    for q_len in q_lens {
        qo_indptr.push(qo_indptr.last().unwrap() + q_len);
    }
    let tokens = *qo_indptr.last().unwrap() as usize;
    let q_values = random_vec(&mut rng, tokens * num_heads * ROW, 2.0);
    let expected = reference(
        &table,
        page_size,
        &round::<T>(&pool_values),
        &round::<T>(&q_values),
        &qo_indptr,
        num_heads,
    );
    let q = upload::<T>(gpu, &q_values);
    let arrays = [
        &table.indptr,
        &table.indices,
        &table.last_page_len,
        &table.first_page_offset,
    ]
    .map(|array| gpu.upload(array).unwrap());
    let device_table =
        DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
    let kv = LatentPool::new(&pool, pool_layout(page_size), device_table, LATENT);
    let qo = gpu.upload(&qo_indptr).unwrap();
    let mut out = poisoned::<T>(gpu, tokens * num_heads * LATENT);
    ops::mla_prefill(
        gpu,
        &Queries::new(&q, num_heads, num_heads * ROW),
        &kv,
        &qo,
        scale(),
        &mut out,
    )
    .unwrap();
    let actual = download(gpu, &out);
    let error = peak_error(&actual, &expected);
    assert!(
        error <= tolerance,
        "{} prefill H{num_heads} page{page_size}: error {error:e} > {tolerance:e}",
        T::NAME
    );
}

#[test]
#[ignore = "needs a GPU"]
fn mla_prefill_matches_the_cpu_op() {
    let gpu = gpu();
    for num_heads in [16, 128] {
        for page_size in [16, 1] {
            prefill_case::<f32>(&gpu, num_heads, page_size, 1e-5);
            prefill_case::<bf16>(&gpu, num_heads, page_size, 1e-2);
        }
    }
}

/// The append writes exactly the host's rows (latent then RoPE key, from strided sources),
/// skips padding slots and leaves every other row alone.
fn append_case<T: TestFloat>(gpu: &Gpu) {
    let mut rng = rng(11);
    let layout = PoolLayout {
        num_pages: 64,
        page_size: 16,
        num_kv_heads: 1,
        head_dim: ROW,
    };
    let rows = layout.num_pages * layout.page_size;
    let old: Vec<T> = random_vec(&mut rng, rows * ROW, 1.0)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let tokens = 7;
    let (latent_stride, rope_stride) = (LATENT + 64, ROPE + 8);
    let latent: Vec<T> = random_vec(&mut rng, tokens * latent_stride, 3.0)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let k_rope: Vec<T> = random_vec(&mut rng, tokens * rope_stride, 3.0)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let slots: Vec<i32> = vec![5, 1023, -1, 16, 400, rows as i32, 0];
    let mut expected = old.clone();
    for (t, &slot) in slots.iter().enumerate() {
        if slot < 0 || slot as usize >= rows {
            continue;
        }
        let dst = &mut expected[slot as usize * ROW..][..ROW];
        dst[..LATENT].copy_from_slice(&latent[t * latent_stride..][..LATENT]);
        dst[LATENT..].copy_from_slice(&k_rope[t * rope_stride..][..ROPE]);
    }
    let mut pool = gpu.upload(&old).unwrap();
    let (latent_d, rope_d, slots_d) = (
        gpu.upload(&latent).unwrap(),
        gpu.upload(&k_rope).unwrap(),
        gpu.upload(&slots).unwrap(),
    );
    let new = NewLatent {
        latent: whole(&latent_d),
        latent_row_stride: latent_stride,
        k_rope: whole(&rope_d),
        rope_row_stride: rope_stride,
        slots: whole(&slots_d),
    };
    ops::mla_append(gpu, &new, &mut pool, &layout, LATENT).unwrap();
    let actual = gpu.download(&pool).unwrap();
    let bits = |values: &[T]| {
        values
            .iter()
            .map(|&v| v.to_f32().to_bits())
            .collect::<Vec<_>>()
    };
    assert!(
        bits(&actual) == bits(&expected),
        "{}: the appended pool differs from the host's",
        T::NAME
    );
}

#[test]
#[ignore = "needs a GPU"]
fn mla_append_writes_the_hosts_rows_bit_for_bit() {
    let gpu = gpu();
    append_case::<f32>(&gpu);
    append_case::<bf16>(&gpu);
}

/// The first `requests` requests of `table`.
fn leading_requests(table: &PageTable, requests: usize) -> PageTable {
    PageTable {
        indices: table.indices[..table.indptr[requests] as usize].to_vec(),
        indptr: table.indptr[..=requests].to_vec(),
        last_page_len: table.last_page_len[..requests].to_vec(),
        first_page_offset: table.first_page_offset[..requests].to_vec(),
        seq_lens: table.seq_lens[..requests].to_vec(),
        rope_offsets: table.rope_offsets[..requests].to_vec(),
    }
}

/// A CUDA graph of the decode (tensor cores, then the merge) captured once replays with new
/// plans, page tables and queries written into the same buffers, as the model's graphs do:
/// a bucket of 4 rows whose grid (the bucket's, narrower than the workspace's capacity) is
/// fixed at capture, its trailing padding requests with no pages (zeros out), the plans made
/// within the bucket's grid (chunks past a plan's exit at once).
#[test]
#[ignore = "needs a GPU"]
fn mla_decode_replays_from_a_graph_with_new_plans() {
    let gpu = gpu();
    let mut rng = rng(12);
    let (num_heads, page_size, b) = (16, 16, 4);
    let pool_values = random_vec(&mut rng, POOL_ROWS * ROW, 1.0);
    let pool = upload::<bf16>(&gpu, &pool_values);
    let tiles = ops::mla_head_tiles(num_heads);
    let capacity = PlanCapacity::for_batch(8, tiles, 264);
    let bucket = PlanCapacity {
        max_chunks: PlanCapacity::for_batch(b, tiles, 264).max_chunks,
        ..capacity
    };
    let mut workspace = MlaDecodeWorkspace::new(&gpu, capacity, num_heads, LATENT).unwrap();
    workspace.set_kernel(MlaKernel::TensorCore { stages: 2 });
    workspace.set_grid_chunks(bucket.max_chunks).unwrap();
    let max_pages = b * 4096 / page_size + b;
    let mut indptr = gpu.zeros::<u32>(b + 1).unwrap();
    let mut indices = gpu.zeros::<u32>(max_pages).unwrap();
    let mut last = gpu.zeros::<u32>(b).unwrap();
    let mut first = gpu.zeros::<u32>(b).unwrap();
    let mut q_d = gpu.zeros::<bf16>(b * num_heads * ROW).unwrap();
    let mut out = gpu.zeros::<bf16>(b * num_heads * LATENT).unwrap();
    let graph = {
        let table = DevicePageTable::new(&indptr, &indices, &last, &first).unwrap();
        let kv = LatentPool::new(&pool, pool_layout(page_size), table, LATENT);
        let queries = Queries::new(&q_d, num_heads, num_heads * ROW);
        gpu.capture(|gpu| ops::mla_decode(gpu, &queries, &kv, &mut workspace, scale(), &mut out))
            .unwrap()
    };
    let replays = [
        [100usize, 3000, 17, 0],
        [1, 4000, 640, 5],
        [2048, 16, 0, 0],
        [33, 0, 0, 0],
    ];
    for (replay, lens) in replays.into_iter().enumerate() {
        let table = page_table(&mut rng, &lens, page_size, replay % 2 == 0);
        let policy = PlanPolicy {
            target_ctas: 264,
            pages_per_chunk: None,
            min_pages_per_chunk: 1,
            resident_ctas: None,
        };
        let plan = PagedDecodePlan::new(&table.indptr, tiles, policy, bucket).unwrap();
        workspace.upload_plan(&gpu, &plan).unwrap();
        let mut padded = table.indices.clone();
        padded.resize(max_pages, 0);
        gpu.upload_into(&table.indptr, &mut indptr).unwrap();
        gpu.upload_into(&padded, &mut indices).unwrap();
        gpu.upload_into(&table.last_page_len, &mut last).unwrap();
        gpu.upload_into(&table.first_page_offset, &mut first)
            .unwrap();
        let q = round::<bf16>(&random_vec(&mut rng, b * num_heads * ROW, 2.0));
        let q_host: Vec<bf16> = q.iter().map(|&x| bf16::from_f32(x)).collect();
        gpu.upload_into(&q_host, &mut q_d).unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        // The real requests against the CPU op; the padding requests' rows are zeros.
        let real = lens.iter().take_while(|&&len| len > 0).count();
        let qo_indptr: Vec<u32> = (0..=real as u32).collect();
        let mut expected = reference(
            &leading_requests(&table, real),
            page_size,
            &round::<bf16>(&pool_values),
            &q[..real * num_heads * ROW],
            &qo_indptr,
            num_heads,
        );
        expected.resize(b * num_heads * LATENT, 0.0);
        let error = peak_error(&download(&gpu, &out), &expected);
        assert!(
            error <= 2e-2,
            "replay {replay} ({lens:?}, {} chunks): {error:e}",
            plan.num_chunks()
        );
    }
}
