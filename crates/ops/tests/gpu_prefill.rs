//! GPU tests of the query-tiled prefill attention (`ops::prefill_attention_tiled`) against a
//! naive f64 CPU reference and against the per-token `ops::prefill_attention` on the same
//! inputs (ignored without `--include-ignored`: they need a GPU).

#[path = "gpu_common/mod.rs"]
mod common;

use common::prefill_batch::*;
use common::*;
use half::bf16;
use pagoda_cuda::DeviceBuffer;
use pagoda_ops::cuda::{self as ops, DevicePageTable, PagedKv, PoolLayout, Queries};

fn tolerance<T: TestFloat>() -> f32 {
    if T::NAME == "f32" {
        1e-5
    } else {
        2e-2
    }
}

#[test]
#[ignore = "needs a GPU"]
fn tiled_prefill_matches_reference_and_per_token_kernel() {
    let gpu = gpu();
    let mut seed = 100;
    for head_dim in [64, 128, 256] {
        for group in [1, 4, 8] {
            for page_size in [16, 32] {
                seed += 1;
                check_against_oracles::<f32>(
                    &gpu,
                    Kernel::Tiled,
                    (head_dim, group, page_size),
                    seed,
                    tolerance::<f32>(),
                );
                check_against_oracles::<bf16>(
                    &gpu,
                    Kernel::Tiled,
                    (head_dim, group, page_size),
                    seed + 1000,
                    tolerance::<bf16>(),
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn tiled_prefill_other_head_dims_and_odd_groups() {
    let gpu = gpu();
    for (head_dim, group, page_size) in [(32, 3, 16), (96, 2, 32), (64, 3, 16), (128, 5, 1)] {
        let seed = 500 + head_dim as u64 + group as u64;
        check_against_oracles::<f32>(
            &gpu,
            Kernel::Tiled,
            (head_dim, group, page_size),
            seed,
            tolerance::<f32>(),
        );
        check_against_oracles::<bf16>(
            &gpu,
            Kernel::Tiled,
            (head_dim, group, page_size),
            seed + 1000,
            tolerance::<bf16>(),
        );
    }
}

/// Rows before `qo_indptr[0]` and after `qo_indptr[B]` are zeros, `q_len > seq_len` is NaN,
/// a page id past the pool is skipped, an empty request is harmless.
#[test]
#[ignore = "needs a GPU"]
fn tiled_prefill_edge_rows() {
    let gpu = gpu();
    check_edge_rows::<f32>(&gpu, Kernel::Tiled, (64, 4, 4), (2, 3), 1e-5);
}

/// The launch replays from a CUDA graph with the same result.
#[test]
#[ignore = "needs a GPU"]
fn tiled_prefill_replays_from_a_graph() {
    let gpu = gpu();
    check_graph_replay::<bf16>(&gpu, Kernel::Tiled, 128);
}

#[test]
#[ignore = "needs a GPU"]
fn tiled_prefill_rejects_bad_geometry() {
    let gpu = gpu();
    let layout = PoolLayout {
        num_pages: 2,
        page_size: 4,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let pool = gpu.zeros::<f32>(layout.pool_len()).unwrap();
    let arrays = [vec![0u32, 1], vec![0], vec![1], vec![0]].map(|a| gpu.upload(&a).unwrap());
    let table = DevicePageTable::new(&arrays[0], &arrays[1], &arrays[2], &arrays[3]).unwrap();
    let qo = gpu.upload(&[0u32, 1]).unwrap();
    let run = |num_q_heads: usize,
               q_len: usize,
               out_len: usize,
               layout: PoolLayout,
               qo: &DeviceBuffer<u32>| {
        let q = gpu.zeros::<f32>(q_len).unwrap();
        let mut out = gpu.zeros::<f32>(out_len).unwrap();
        let row = num_q_heads * layout.head_dim;
        ops::prefill_attention_tiled(
            &gpu,
            &Queries::new(&q, num_q_heads, row),
            &PagedKv::new(&pool, &pool, layout, table),
            qo,
            1.0,
            &mut out,
        )
        .unwrap_err()
        .to_string()
    };
    let odd = PoolLayout {
        head_dim: 48,
        ..layout
    };
    assert!(run(4, 4 * 48, 4 * 48, odd, &qo).contains("head_dim 48"));
    assert!(run(3, 3 * 64, 3 * 64, layout, &qo).contains("num_q_heads 3"));
    assert!(run(4, 4 * 64 - 1, 4 * 64, layout, &qo).contains("q"));
    assert!(run(4, 4 * 64, 4 * 64 + 1, layout, &qo).contains("out"));
    let long_qo = gpu.upload(&[0u32, 1, 1]).unwrap();
    assert!(run(4, 4 * 64, 4 * 64, layout, &long_qo).contains("qo_indptr"));
}
