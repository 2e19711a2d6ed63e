//! GPU tests of the fused split-KV paged decode: the seed's correctness matrix against the
//! gather decode (head_dim x GQA x page x context x batch, bf16 and f16 KV), f32 against an
//! f64 host reference at every chunk size, both merge modes, the generic merge, and CUDA
//! graph replay with a new plan (ignored without `--include-ignored`: they need a GPU).
//! `PAGODA_DECODE_MATRIX=quick` runs a subset of the matrix.

#[path = "gpu_common/mod.rs"]
mod common;

use common::decode_batch::{peak_error, Batch};
use common::*;
use half::{bf16, f16};
use pagoda_cuda::{whole, DeviceBuffer, Gpu};
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, MergeMode, PagedDecodeKernel, PagedDecodePlan,
    PagedDecodeWorkspace, PagedKv, Partials, PlanCapacity, PlanPolicy, PoolLayout, Queries,
    StreamTiling,
};

const NUM_KV_HEADS: usize = 2;

/// The inputs every fused run of a test case shares.
#[derive(Clone, Copy)]
struct Case<'a> {
    gpu: &'a Gpu,
    batch: &'a Batch,
    table: &'a DevicePageTable<'a>,
    num_q_heads: usize,
    layout: &'a PoolLayout,
    scale: f32,
}

/// Runs the fused decode with `policy` and `merge` and returns the output.
fn fused<T: TestFloat>(
    case: &Case<'_>,
    q: &DeviceBuffer<T>,
    pools: (&DeviceBuffer<T>, &DeviceBuffer<T>),
    policy: PlanPolicy,
    (kernel, merge): (PagedDecodeKernel, MergeMode),
) -> (Vec<f32>, PagedDecodePlan) {
    let Case {
        gpu,
        batch,
        table,
        num_q_heads,
        layout,
        scale,
    } = *case;
    let b = batch.num_requests();
    let mut capacity = PlanCapacity::for_batch(b, NUM_KV_HEADS, policy.target_ctas);
    if policy.pages_per_chunk.is_some() {
        capacity.max_chunks = batch.indices.len() + b;
    }
    let plan = PagedDecodePlan::new(&batch.indptr, NUM_KV_HEADS, policy, capacity).unwrap();
    let mut workspace =
        PagedDecodeWorkspace::new(gpu, capacity, num_q_heads, NUM_KV_HEADS, layout.head_dim)
            .unwrap();
    workspace.upload_plan(gpu, &plan).unwrap();
    workspace.set_kernel(kernel);
    let mut out = poisoned::<T>(gpu, b * num_q_heads * layout.head_dim);
    // Twice: the in-kernel merge must leave its semaphores at zero for the next launch.
    for _ in 0..2 {
        ops::paged_decode_attention(
            gpu,
            &Queries::new(q, num_q_heads, num_q_heads * layout.head_dim),
            &PagedKv::new(pools.0, pools.1, *layout, *table),
            &mut workspace,
            merge,
            scale,
            &mut out,
        )
        .unwrap();
    }
    (download(gpu, &out), plan)
}

/// The (kernel, merge) pairs the matrix runs for `T` at `head_dim`: tensor cores (both
/// kernels, every streaming tiling) for bf16 only.
fn paths<T: TestFloat>(head_dim: usize) -> Vec<(PagedDecodeKernel, MergeMode)> {
    let mut kernels = vec![PagedDecodeKernel::CudaCore];
    if T::NAME == "bf16" {
        kernels.push(PagedDecodeKernel::TensorCore);
        let tilings = StreamTiling::ALL.into_iter().filter(|t| t.fits(head_dim));
        kernels.extend(tilings.map(PagedDecodeKernel::Streaming));
    }
    kernels
        .into_iter()
        .flat_map(|k| [(k, MergeMode::InKernel), (k, MergeMode::Separate)])
        .collect()
}

/// Runs the gather decode (the reference path) and returns the output.
fn gathered<T: TestFloat>(
    case: &Case<'_>,
    q: &DeviceBuffer<T>,
    pools: (&DeviceBuffer<T>, &DeviceBuffer<T>),
) -> Vec<f32> {
    let Case {
        gpu,
        batch,
        table,
        num_q_heads,
        layout,
        scale,
    } = *case;
    let b = batch.num_requests();
    let mut workspace =
        ops::DecodeWorkspace::<T>::new(gpu, layout, num_q_heads, b, batch.indices.len()).unwrap();
    let splits = ops::decode_splits(b, NUM_KV_HEADS, gpu.info().sm_count as usize);
    let mut out = poisoned::<T>(gpu, b * num_q_heads * layout.head_dim);
    ops::decode_attention_gathered(
        gpu,
        &Queries::new(q, num_q_heads, num_q_heads * layout.head_dim),
        &PagedKv::new(pools.0, pools.1, *layout, *table),
        &mut workspace,
        splits,
        scale,
        &mut out,
    )
    .unwrap();
    download(gpu, &out)
}

/// The matrix for one KV dtype; returns (configurations, worst error).
fn matrix<T: TestFloat>(gpu: &Gpu, quick: bool) -> (usize, f32) {
    let sm = gpu.info().sm_count as usize;
    let (contexts, batches): (&[usize], &[usize]) = if quick {
        (&[512, 4096], &[1, 8])
    } else {
        (&[512, 4096, 16384, 32768], &[1, 4, 8, 64])
    };
    let mut configs = 0;
    let mut worst = 0f32;
    for head_dim in [64, 128, 256] {
        for page_size in [16, 32, 64] {
            let mut rng = rng((head_dim * 131 + page_size) as u64);
            // A 32 MB pool per side, shared by every case of this geometry.
            let page_elems = page_size * NUM_KV_HEADS * head_dim;
            let layout = PoolLayout {
                num_pages: (16 << 20) / page_elems,
                page_size,
                num_kv_heads: NUM_KV_HEADS,
                head_dim,
            };
            let k_pool = upload::<T>(gpu, &random_vec(&mut rng, layout.pool_len(), 1.0));
            let v_pool = upload::<T>(gpu, &random_vec(&mut rng, layout.pool_len(), 1.0));
            let pools = (&k_pool, &v_pool);
            for group in [1, 4, 8] {
                let num_q_heads = NUM_KV_HEADS * group;
                let scale = 1.0 / (head_dim as f32).sqrt();
                for &context in contexts {
                    for &b in batches {
                        let batch =
                            Batch::new(&mut rng, b, context, page_size, layout.num_pages, b == 8);
                        let arrays = batch.upload(gpu);
                        let table =
                            DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3])
                                .unwrap();
                        let q = upload::<T>(
                            gpu,
                            &random_vec(&mut rng, b * num_q_heads * head_dim, 2.0),
                        );
                        let case = Case {
                            gpu,
                            batch: &batch,
                            table: &table,
                            num_q_heads,
                            layout: &layout,
                            scale,
                        };
                        let expected = gathered(&case, &q, pools);
                        let searched = PlanPolicy {
                            target_ctas: 2 * sm,
                            pages_per_chunk: None,
                            min_pages_per_chunk: 1,
                            resident_ctas: None,
                        };
                        let forced = PlanPolicy {
                            target_ctas: 1,
                            pages_per_chunk: Some(1),
                            min_pages_per_chunk: 1,
                            resident_ctas: None,
                        };
                        // The forced merge (one page per chunk) on the smaller cases.
                        let policies: &[PlanPolicy] = if b * context <= 65536 {
                            &[searched, forced]
                        } else {
                            &[searched]
                        };
                        for &policy in policies {
                            for path in paths::<T>(head_dim) {
                                let (actual, plan) = fused(&case, &q, pools, policy, path);
                                let error = peak_error(&actual, &expected);
                                worst = worst.max(error);
                                assert!(
                                    error <= 2e-2,
                                    "{} D{head_dim} GQA{group} page{page_size} L{context} B{b} \
                                     {path:?} {} chunks of {} pages: error {error:e}",
                                    T::NAME,
                                    plan.num_chunks(),
                                    plan.pages_per_chunk
                                );
                            }
                        }
                        configs += 1;
                    }
                }
            }
        }
    }
    (configs, worst)
}

#[test]
#[ignore = "needs a GPU"]
fn fused_decode_matches_gather_over_the_matrix() {
    let gpu = gpu();
    let quick = std::env::var("PAGODA_DECODE_MATRIX").ok().as_deref() == Some("quick");
    let started = std::time::Instant::now();
    let (bf16_configs, bf16_worst) = matrix::<bf16>(&gpu, quick);
    let (f16_configs, f16_worst) = matrix::<f16>(&gpu, quick);
    println!(
        "decode matrix: bf16 {bf16_configs} configurations, worst {bf16_worst:.2e}; \
         f16 {f16_configs}, worst {f16_worst:.2e} (tolerance 2e-2 of the peak; {:.1} s)",
        started.elapsed().as_secs_f64()
    );
}

/// f32 pools against the f64 reference at every chunk size, both merges: the result does
/// not depend on the split. Also runs f32, f16, f32 at one geometry (the kernel cache must
/// key on the dtype).
#[test]
#[ignore = "needs a GPU"]
fn fused_decode_matches_f64_reference_at_every_chunk_size() {
    let gpu = gpu();
    for (head_dim, group, page_size) in [(128, 4, 16), (64, 8, 32), (256, 1, 64), (32, 3, 16)] {
        let mut rng = rng((head_dim + group) as u64);
        let layout = PoolLayout {
            num_pages: 300,
            page_size,
            num_kv_heads: NUM_KV_HEADS,
            head_dim,
        };
        let num_q_heads = NUM_KV_HEADS * group;
        let k = random_vec(&mut rng, layout.pool_len(), 1.0);
        let v = random_vec(&mut rng, layout.pool_len(), 1.0);
        let batch = Batch::new(&mut rng, 5, 700, page_size, layout.num_pages, true);
        let q = random_vec(&mut rng, 5 * num_q_heads * head_dim, 2.0);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let expected = batch.reference(&layout, num_q_heads, &q, &k, &v, scale);
        let arrays = batch.upload(&gpu);
        let table = DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
        let case = Case {
            gpu: &gpu,
            batch: &batch,
            table: &table,
            num_q_heads,
            layout: &layout,
            scale,
        };
        let (k32, v32, q32) = (
            upload::<f32>(&gpu, &k),
            upload::<f32>(&gpu, &v),
            upload::<f32>(&gpu, &q),
        );
        let (k16, v16, q16) = (
            upload::<f16>(&gpu, &k),
            upload::<f16>(&gpu, &v),
            upload::<f16>(&gpu, &q),
        );
        let expected_bf16 = batch.reference(
            &layout,
            num_q_heads,
            &round::<bf16>(&q),
            &round::<bf16>(&k),
            &round::<bf16>(&v),
            scale,
        );
        let (kb, vb, qb) = (
            upload::<bf16>(&gpu, &k),
            upload::<bf16>(&gpu, &v),
            upload::<bf16>(&gpu, &q),
        );
        for ppc in [
            None,
            Some(1),
            Some(2),
            Some(3),
            Some(4),
            Some(7),
            Some(16),
            Some(64),
        ] {
            let policy = PlanPolicy {
                target_ctas: 264,
                pages_per_chunk: ppc,
                min_pages_per_chunk: 1,
                resident_ctas: None,
            };
            for merge in [MergeMode::InKernel, MergeMode::Separate] {
                let (actual, _) = fused(
                    &case,
                    &q32,
                    (&k32, &v32),
                    policy,
                    (PagedDecodeKernel::CudaCore, merge),
                );
                let error = peak_error(&actual, &expected);
                assert!(
                    error <= 2e-5,
                    "f32 D{head_dim} G{group} ppc {ppc:?} {merge:?}: {error:e}"
                );
                let (half, _) = fused(
                    &case,
                    &q16,
                    (&k16, &v16),
                    policy,
                    (PagedDecodeKernel::CudaCore, merge),
                );
                let error = peak_error(&half, &expected);
                assert!(
                    error <= 2e-2,
                    "f16 D{head_dim} G{group} ppc {ppc:?} {merge:?}: {error:e}"
                );
                if !ops::PAGED_DECODE_MMA_HEAD_DIMS.contains(&head_dim) {
                    continue;
                }
                let (tensor, _) = fused(
                    &case,
                    &qb,
                    (&kb, &vb),
                    policy,
                    (PagedDecodeKernel::TensorCore, merge),
                );
                let error = peak_error(&tensor, &expected_bf16);
                assert!(
                    error <= 2e-2,
                    "bf16 tensor cores D{head_dim} G{group} ppc {ppc:?} {merge:?}: {error:e}"
                );
                for tiling in StreamTiling::ALL.into_iter().filter(|t| t.fits(head_dim)) {
                    let kernel = PagedDecodeKernel::Streaming(tiling);
                    let (streamed, _) = fused(&case, &qb, (&kb, &vb), policy, (kernel, merge));
                    let error = peak_error(&streamed, &expected_bf16);
                    assert!(
                        error <= 2e-2,
                        "bf16 {tiling} D{head_dim} G{group} ppc {ppc:?} {merge:?}: {error:e}"
                    );
                }
            }
        }
        // The empty last request reads as zeros.
        let (actual, _) = fused(
            &case,
            &q32,
            (&k32, &v32),
            PlanPolicy {
                target_ctas: 1,
                pages_per_chunk: Some(1),
                min_pages_per_chunk: 1,
                resident_ctas: None,
            },
            (PagedDecodeKernel::CudaCore, MergeMode::InKernel),
        );
        let row = num_q_heads * head_dim;
        assert!(actual[4 * row..].iter().all(|&x| x == 0.0));
    }
}

/// The generic merge: two levels merged in one pass equal the same partials merged in two
/// regroupings (associativity), -inf partials are skipped, empty groups give zeros / -inf.
#[test]
#[ignore = "needs a GPU"]
fn merge_is_associative_and_skips_empty_partials() {
    let gpu = gpu();
    let mut rng = rng(5);
    let (heads, d) = (3, 64);
    let n = 6;
    let partial = random_vec(&mut rng, n * heads * d, 1.0);
    let mut lse = random_vec(&mut rng, n * heads, 4.0);
    lse[2 * heads + 1] = f32::NEG_INFINITY;
    let partial_d = gpu.upload(&partial).unwrap();
    let lse_d = gpu.upload(&lse).unwrap();
    // Host oracle: rows {0..4}, {4..4} (empty), {4..6}.
    let groups = [(0usize, 4usize), (4, 4), (4, 6)];
    let mut expected = vec![0f32; groups.len() * heads * d];
    for (o, &(lo, hi)) in groups.iter().enumerate() {
        for h in 0..heads {
            let finite: Vec<usize> = (lo..hi)
                .filter(|&c| lse[c * heads + h].is_finite())
                .collect();
            if finite.is_empty() {
                continue;
            }
            let m = finite
                .iter()
                .map(|&c| lse[c * heads + h] as f64)
                .fold(f64::MIN, f64::max);
            let w: Vec<f64> = finite
                .iter()
                .map(|&c| (lse[c * heads + h] as f64 - m).exp2())
                .collect();
            let total: f64 = w.iter().sum();
            for dim in 0..d {
                expected[(o * heads + h) * d + dim] = finite
                    .iter()
                    .zip(&w)
                    .map(|(&c, &wc)| wc / total * partial[(c * heads + h) * d + dim] as f64)
                    .sum::<f64>() as f32;
            }
        }
    }
    let o_indptr = gpu.upload(&[0u32, 4, 4, 6]).unwrap();
    let mut out = poisoned::<f32>(&gpu, groups.len() * heads * d);
    let mut lse_out = gpu.alloc::<f32>(groups.len() * heads).unwrap();
    ops::merge_attention_partials(
        &gpu,
        &Partials {
            out: whole(&partial_d),
            lse: whole(&lse_d),
            o_indptr: whole(&o_indptr),
            num_heads: heads,
            head_dim: d,
        },
        false,
        &mut out,
        Some(&mut lse_out),
    )
    .unwrap();
    assert_close("one-level merge", &download(&gpu, &out), &expected, 1e-5);
    let lse_one = gpu.download(&lse_out).unwrap();
    assert!(lse_one[heads..2 * heads]
        .iter()
        .all(|l| *l == f32::NEG_INFINITY));
    // Regrouped: {0,1} {2,3} then merge the two results with {4,5} untouched.
    let pairs = gpu.upload(&[0u32, 2, 4]).unwrap();
    let mut first = gpu.alloc::<f32>(2 * heads * d).unwrap();
    let mut first_lse = gpu.alloc::<f32>(2 * heads).unwrap();
    ops::merge_attention_partials(
        &gpu,
        &Partials {
            out: whole(&partial_d),
            lse: whole(&lse_d),
            o_indptr: whole(&pairs),
            num_heads: heads,
            head_dim: d,
        },
        false,
        &mut first,
        Some(&mut first_lse),
    )
    .unwrap();
    let all = gpu.upload(&[0u32, 2]).unwrap();
    let mut second = poisoned::<f32>(&gpu, heads * d);
    ops::merge_attention_partials(
        &gpu,
        &Partials {
            out: whole(&first),
            lse: whole(&first_lse),
            o_indptr: whole(&all),
            num_heads: heads,
            head_dim: d,
        },
        false,
        &mut second,
        None,
    )
    .unwrap();
    assert_close(
        "two-level merge",
        &download(&gpu, &second),
        &expected[..heads * d],
        1e-5,
    );
    // Mismatched shapes are errors.
    let bad = gpu.upload(&[0u32, 1]).unwrap();
    assert!(ops::merge_attention_partials(
        &gpu,
        &Partials {
            out: whole(&partial_d),
            lse: whole(&lse_d),
            o_indptr: whole(&bad),
            num_heads: heads,
            head_dim: d + 1,
        },
        false,
        &mut second,
        None,
    )
    .is_err());
}

/// A CUDA graph captured once replays with a new plan and page table in the same buffers.
#[test]
#[ignore = "needs a GPU"]
fn fused_decode_replays_from_a_graph_with_new_plans() {
    let gpu = gpu();
    let mut rng = rng(9);
    let layout = PoolLayout {
        num_pages: 512,
        page_size: 16,
        num_kv_heads: NUM_KV_HEADS,
        head_dim: 128,
    };
    let num_q_heads = 8;
    let k = random_vec(&mut rng, layout.pool_len(), 1.0);
    let v = random_vec(&mut rng, layout.pool_len(), 1.0);
    let (k_d, v_d) = (upload::<bf16>(&gpu, &k), upload::<bf16>(&gpu, &v));
    let b = 4;
    let max_pages = 4 * 200;
    let capacity = PlanCapacity::for_batch(b, NUM_KV_HEADS, 264);
    let mut workspace =
        PagedDecodeWorkspace::new(&gpu, capacity, num_q_heads, NUM_KV_HEADS, 128).unwrap();
    // The streaming kernel (the production default) with in-kernel merges.
    workspace.set_kernel(PagedDecodeKernel::Streaming(StreamTiling::ALL[0]));
    let mut indptr = gpu.zeros::<u32>(b + 1).unwrap();
    let mut indices = gpu.zeros::<u32>(max_pages).unwrap();
    let mut last = gpu.zeros::<u32>(b).unwrap();
    let mut first = gpu.zeros::<u32>(b).unwrap();
    let mut q_d = gpu.zeros::<bf16>(b * num_q_heads * 128).unwrap();
    let mut out = gpu.zeros::<bf16>(b * num_q_heads * 128).unwrap();
    let scale = 1.0 / (128f32).sqrt();
    let graph = {
        let table = DevicePageTable::new(&indptr, &indices, &last, &first).unwrap();
        gpu.capture(|gpu| {
            ops::paged_decode_attention(
                gpu,
                &Queries::new(&q_d, num_q_heads, num_q_heads * 128),
                &PagedKv::new(&k_d, &v_d, layout, table),
                &mut workspace,
                MergeMode::InKernel,
                scale,
                &mut out,
            )
        })
        .unwrap()
    };
    for (replay, context) in [100usize, 3000, 17, 1200].into_iter().enumerate() {
        let batch = Batch::new(&mut rng, b, context, 16, layout.num_pages, replay % 2 == 1);
        let plan = PagedDecodePlan::new(
            &batch.indptr,
            NUM_KV_HEADS,
            PlanPolicy {
                target_ctas: 264,
                pages_per_chunk: None,
                min_pages_per_chunk: 1,
                resident_ctas: None,
            },
            capacity,
        )
        .unwrap();
        workspace.upload_plan(&gpu, &plan).unwrap();
        let mut padded = batch.indices.clone();
        padded.resize(max_pages, 0);
        gpu.upload_into(&batch.indptr, &mut indptr).unwrap();
        gpu.upload_into(&padded, &mut indices).unwrap();
        gpu.upload_into(&batch.last_page_len, &mut last).unwrap();
        gpu.upload_into(&batch.first_page_offset, &mut first)
            .unwrap();
        let q = round::<bf16>(&random_vec(&mut rng, b * num_q_heads * 128, 2.0));
        gpu.upload_into(
            &q.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(),
            &mut q_d,
        )
        .unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let expected = batch.reference(
            &layout,
            num_q_heads,
            &q,
            &round::<bf16>(&k),
            &round::<bf16>(&v),
            scale,
        );
        let error = peak_error(&download(&gpu, &out), &expected);
        assert!(
            error <= 2e-2,
            "replay {replay} (context {context}, {} chunks): {error:e}",
            plan.num_chunks()
        );
    }
}
