//! GPU tests of the tensor-core prefill attention (`ops::prefill_attention_mma`, bf16) against
//! a naive f64 CPU reference and against the per-token `ops::prefill_attention` on the same
//! ragged batches (ignored without `--include-ignored`: they need a GPU).

#[path = "gpu_common/mod.rs"]
mod common;

use common::prefill_batch::*;
use common::*;
use half::bf16;
use pagoda_cuda::{view, view_mut, DeviceRead};
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, PagedKv, PoolLayout, PrefillStreamTiling, Queries,
};

/// bf16 inputs and outputs, f32 accumulation, bf16 probabilities: error bound relative to
/// `1 + |expected|` (outputs are convex combinations of values in `[-1, 1]`).
const TOLERANCE: f32 = 2e-2;

#[test]
#[ignore = "needs a GPU"]
fn mma_prefill_matches_reference_and_per_token_kernel() {
    let gpu = gpu();
    let mut seed = 300;
    let kernels = std::iter::once(Kernel::Mma).chain(PrefillStreamTiling::ALL.map(Kernel::Stream));
    for kernel in kernels {
        for head_dim in [64, 128] {
            for group in [1, 3, 4, 8] {
                for page_size in [16, 32] {
                    seed += 1;
                    check_against_oracles::<bf16>(
                        &gpu,
                        kernel,
                        (head_dim, group, page_size),
                        seed,
                        TOLERANCE,
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn mma_prefill_head_dim_256_and_every_group() {
    let gpu = gpu();
    for (head_dim, group, page_size) in [
        (256, 1, 16),
        (256, 8, 32),
        (256, 3, 1),
        (64, 2, 16),
        (64, 5, 32),
        (64, 6, 16),
        (64, 7, 16),
        (128, 5, 1),
        (128, 7, 32),
    ] {
        let seed = 700 + head_dim as u64 + group as u64 + page_size as u64;
        check_against_oracles::<bf16>(
            &gpu,
            Kernel::Mma,
            (head_dim, group, page_size),
            seed,
            TOLERANCE,
        );
        if head_dim != 256 {
            let kernel = Kernel::Stream(PrefillStreamTiling::DEFAULT);
            let shape = (head_dim, group, page_size);
            check_against_oracles::<bf16>(&gpu, kernel, shape, seed + 1, TOLERANCE);
        }
    }
}

/// Rows before `qo_indptr[0]` and after `qo_indptr[B]` are zeros, `q_len > seq_len` is NaN,
/// a page id past the pool is skipped, an empty request is harmless.
#[test]
#[ignore = "needs a GPU"]
fn mma_prefill_edge_rows() {
    let gpu = gpu();
    for (head_dim, group) in [(64, 4), (128, 3)] {
        let stream = [
            PrefillStreamTiling::DEFAULT,
            PrefillStreamTiling::new(64, 32, 2),
        ];
        for kernel in std::iter::once(Kernel::Mma).chain(stream.map(Kernel::Stream)) {
            check_edge_rows::<bf16>(&gpu, kernel, (head_dim, group, 4), (2, 70), TOLERANCE);
        }
    }
}

/// q, pools and out that are not 16-byte (or 4-byte) aligned take the scalar load/store
/// paths and give bit-identical results.
#[test]
#[ignore = "needs a GPU"]
fn mma_prefill_misaligned_views_match() {
    let gpu = gpu();
    let mut rng = rng(11);
    let shapes = [shape(90, 90, 0, false), shape(200, 17, 6, true)];
    let batch = Batch::new::<bf16>(&mut rng, (16, 2, 64), 6, &shapes, (0, 0));
    let device = Bf16Batch::upload(&gpu, &batch);
    let aligned = device.run(&gpu, &batch, 0.1, Kernel::Mma);
    let shifted = |values: &[f32]| {
        let mut padded = vec![0.5];
        padded.extend_from_slice(values);
        upload::<bf16>(&gpu, &padded)
    };
    let (qkv, k_pool, v_pool) = (
        shifted(&batch.qkv),
        shifted(&batch.k_pool),
        shifted(&batch.v_pool),
    );
    let len = batch.num_rows() * batch.row_elems();
    let mut out = poisoned::<bf16>(&gpu, len + 1);
    {
        let q = view(&qkv, 1..qkv.len()).unwrap();
        let k = view(&k_pool, 1..k_pool.len()).unwrap();
        let v = view(&v_pool, 1..v_pool.len()).unwrap();
        let mut out_view = view_mut(&mut out, 1..len + 1).unwrap();
        device.launch(
            &gpu,
            &batch,
            (Kernel::Mma, 0.1),
            (&q, &k, &v),
            &mut out_view,
        );
    }
    let misaligned = download(&gpu, &out);
    assert_eq!(&misaligned[1..], &aligned[..], "misaligned views");
    // The streaming kernel needs 16-byte aligned views: on these it runs the WMMA kernel.
    let mut out = poisoned::<bf16>(&gpu, len + 1);
    {
        let q = view(&qkv, 1..qkv.len()).unwrap();
        let k = view(&k_pool, 1..k_pool.len()).unwrap();
        let v = view(&v_pool, 1..v_pool.len()).unwrap();
        let mut out_view = view_mut(&mut out, 1..len + 1).unwrap();
        let stream = Kernel::Stream(PrefillStreamTiling::DEFAULT);
        device.launch(&gpu, &batch, (stream, 0.1), (&q, &k, &v), &mut out_view);
    }
    assert_eq!(
        &download(&gpu, &out)[1..],
        &aligned[..],
        "stream falls back"
    );
}

/// The launch replays from a CUDA graph with the same result.
#[test]
#[ignore = "needs a GPU"]
fn mma_prefill_replays_from_a_graph() {
    let gpu = gpu();
    check_graph_replay::<bf16>(&gpu, Kernel::Mma, 128);
    check_graph_replay::<bf16>(&gpu, Kernel::Stream(PrefillStreamTiling::DEFAULT), 128);
}

#[test]
#[ignore = "needs a GPU"]
fn mma_prefill_rejects_bad_input() {
    let gpu = gpu();
    let layout = PoolLayout {
        num_pages: 2,
        page_size: 4,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let arrays = [vec![0u32, 1], vec![0], vec![1], vec![0]].map(|a| gpu.upload(&a).unwrap());
    let table = DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
    let qo = gpu.upload(&[0u32, 1]).unwrap();
    let run = |num_q_heads: usize, q_len: usize, out_len: usize, layout: PoolLayout| {
        let pool = gpu.zeros::<bf16>(layout.pool_len()).unwrap();
        let q = gpu.zeros::<bf16>(q_len).unwrap();
        let mut out = gpu.zeros::<bf16>(out_len).unwrap();
        let row = num_q_heads * layout.head_dim;
        ops::prefill_attention_mma(
            &gpu,
            &Queries::new(&q, num_q_heads, row),
            &PagedKv::new(&pool, &pool, layout, table),
            &qo,
            1.0,
            &mut out,
        )
        .unwrap_err()
        .to_string()
    };
    let odd = PoolLayout {
        head_dim: 96,
        ..layout
    };
    assert!(run(4, 4 * 96, 4 * 96, odd).contains("head_dim 96"));
    assert!(run(3, 3 * 64, 3 * 64, layout).contains("num_q_heads 3"));
    assert!(run(4, 4 * 64 - 1, 4 * 64, layout).contains("q"));
    assert!(run(4, 4 * 64, 4 * 64 + 1, layout).contains("out"));
    // f32 is refused with a message pointing at the tiled kernel.
    let pool = gpu.zeros::<f32>(layout.pool_len()).unwrap();
    let q = gpu.zeros::<f32>(4 * 64).unwrap();
    let mut out = gpu.zeros::<f32>(4 * 64).unwrap();
    let error = ops::prefill_attention_mma(
        &gpu,
        &Queries::new(&q, 4, 4 * 64),
        &PagedKv::new(&pool, &pool, layout, table),
        &qo,
        1.0,
        &mut out,
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("bf16 only"), "{error}");
}
