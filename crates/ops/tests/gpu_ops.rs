//! GPU tests of what the op harness (`backend_ops.rs`, which compares every op's values on
//! every backend with the CPU reference) does not check: the device report, the kernel
//! registry, argmax, the GEMM's plan cache, the strided batched GEMM, graph replay, pinned
//! copies and occupancy. Ignored without `--include-ignored`: they need the GPU machine.
//! Outputs are poisoned with NaN before every launch.

#[path = "gpu_common/mod.rs"]
mod common;

use common::*;
use half::bf16;
use pagoda_cuda::{available, DeviceRead, Gpu, GraphCache};
use pagoda_ops::cuda as ops;

#[test]
#[ignore = "needs a GPU"]
fn available_reports_the_device() {
    let gpu = gpu();
    let info = available().expect("available");
    println!("{info}");
    assert!(info.sm_count > 0 && info.total_memory_bytes > 0 && info.l2_cache_bytes > 0);
    assert_eq!(gpu.info().compute_capability, info.compute_capability);
}

/// The CPU RMSNorm of `x` (`[rows, weight.len()]`).
fn rms_norm_reference(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    pagoda_ops::norm::rms_norm(x, weight, eps, &mut out);
    out
}

/// Registry: one geometry at two dtypes in one process; both results are checked and two
/// distinct kernels are loaded.
#[test]
#[ignore = "needs a GPU"]
fn registry_serves_two_dtypes_of_one_geometry() {
    let gpu = gpu();
    let before = gpu.loaded_kernels();
    let mut rng = rng(2);
    let x = random_vec(&mut rng, 4 * 256, 1.0);
    let up = random_vec(&mut rng, 4 * 256, 1.0);
    for round_trip in 0..2 {
        for is_bf16 in [false, true] {
            let (actual, expected, tolerance) = if is_bf16 {
                let (g, u) = (round::<bf16>(&x), round::<bf16>(&up));
                let mut out = poisoned::<bf16>(&gpu, g.len());
                ops::silu_mul(
                    &gpu,
                    &upload::<bf16>(&gpu, &g),
                    &upload::<bf16>(&gpu, &u),
                    &mut out,
                    256,
                    (256, 256),
                )
                .unwrap();
                (
                    download(&gpu, &out),
                    silu_reference(&g, &u),
                    bf16::TOLERANCE,
                )
            } else {
                let mut out = poisoned::<f32>(&gpu, x.len());
                ops::silu_mul(
                    &gpu,
                    &gpu.upload(&x).unwrap(),
                    &gpu.upload(&up).unwrap(),
                    &mut out,
                    256,
                    (256, 256),
                )
                .unwrap();
                (
                    download(&gpu, &out),
                    silu_reference(&x, &up),
                    f32::TOLERANCE,
                )
            };
            assert_close(
                &format!("silu_mul bf16={is_bf16} pass {round_trip}"),
                &actual,
                &expected,
                tolerance,
            );
        }
    }
    assert_eq!(
        gpu.loaded_kernels() - before,
        2,
        "one kernel per dtype, reused on the second pass"
    );
}

/// The CPU SiLU-and-multiply.
fn silu_reference(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    pagoda_ops::activation::silu_mul(gate, up, &mut out);
    out
}

#[test]
#[ignore = "needs a GPU"]
fn argmax_picks_the_first_maximum() {
    let gpu = gpu();
    let mut rng = rng(4);
    let cols = 49_152;
    let mut logits = random_vec(&mut rng, 4 * cols, 10.0);
    logits[cols + 100] = 50.0; // row 1: tie, the first index wins
    logits[cols + 40_000] = 50.0;
    logits[2 * cols + 7] = f32::NAN; // row 2: NaN never wins
    for value in &mut logits[3 * cols..] {
        *value = f32::NEG_INFINITY; // row 3: all -inf gives 0
    }
    let mut ids = poisoned::<u32>(&gpu, 4);
    ops::argmax_rows(&gpu, &gpu.upload(&logits).unwrap(), &mut ids, cols).unwrap();
    let expected: Vec<u32> = logits
        .chunks(cols)
        .map(|row| {
            let mut best = (0u32, f32::NEG_INFINITY);
            for (index, &value) in row.iter().enumerate() {
                if value > best.1 {
                    best = (index as u32, value);
                }
            }
            best.0
        })
        .collect();
    assert_eq!(expected[1], 100);
    assert_eq!(gpu.download(&ids).unwrap(), expected);
}

/// The GEMM's plan cache and length checks (its values: `backend_ops.rs`'s linear cases).
#[test]
#[ignore = "needs a GPU"]
fn gemm_caches_plans_and_rejects_bad_lengths() {
    let gpu = gpu();
    let (m, n, k) = (3, 64, 32);
    let x = gpu.zeros::<bf16>(m * k).unwrap();
    let w = gpu.zeros::<bf16>(n * k).unwrap();
    let (x32, w32) = (
        gpu.zeros::<f32>(m * k).unwrap(),
        gpu.zeros::<f32>(n * k).unwrap(),
    );
    for round_trip in 0..2 {
        for beta in [0.0, 1.0] {
            gpu.gemm(
                &x32,
                &w32,
                &mut poisoned::<f32>(&gpu, m * n),
                (m, n, k),
                beta,
            )
            .unwrap();
            gpu.gemm(&x, &w, &mut poisoned::<bf16>(&gpu, m * n), (m, n, k), beta)
                .unwrap();
            gpu.gemm(&x, &w, &mut poisoned::<f32>(&gpu, m * n), (m, n, k), beta)
                .unwrap();
        }
        // 3 dtype pairs x (beta 0, beta 1), reused on the second pass.
        assert_eq!(gpu.gemm_plans(), 6, "pass {round_trip}");
    }
    let mut bad = poisoned::<f32>(&gpu, 10);
    let x = gpu.zeros::<f32>(6).unwrap();
    assert!(
        gpu.gemm(&x, &x, &mut bad, (2, 5, 3), 0.0).is_err(),
        "wrong weight length is rejected"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn graph_replays_a_captured_step() {
    let gpu = gpu();
    let mut rng = rng(9);
    let (rows, dim) = (4, 256);
    let x = random_vec(&mut rng, rows * dim, 1.0);
    let weight = random_vec(&mut rng, dim, 1.0);
    let (x_d, w_d) = (gpu.upload(&x).unwrap(), gpu.upload(&weight).unwrap());
    let mut accumulator = gpu.zeros::<f32>(rows * dim).unwrap();
    let mut normed = poisoned::<f32>(&gpu, rows * dim);
    let mut graphs: GraphCache<usize> = GraphCache::new();
    // Eager warm-up inside get_or_capture runs the step once, then captures it.
    let accumulator_ptr = accumulator.device_ptr();
    let mut step = |gpu: &Gpu| -> Result<(), pagoda_cuda::CudaError> {
        let mut acc = pagoda_cuda::view_mut(&mut accumulator, 0..rows * dim)?;
        ops::add_in_place(gpu, &mut acc, &x_d)?;
        ops::rms_norm(gpu, &acc, &w_d, &mut normed, 1e-5)
    };
    graphs.get_or_capture(&gpu, rows, &mut step).unwrap();
    for _ in 0..3 {
        graphs
            .get_or_capture(&gpu, rows, &mut step)
            .unwrap()
            .launch()
            .unwrap();
    }
    assert_eq!(graphs.len(), 1);
    assert_eq!(accumulator.device_ptr(), accumulator_ptr);
    let four_x: Vec<f32> = x.iter().map(|v| 4.0 * v).collect();
    assert_close(
        "graph accumulator after warm-up + 3 replays",
        &download(&gpu, &accumulator),
        &four_x,
        1e-6,
    );
    assert_close(
        "graph rms_norm",
        &download(&gpu, &normed),
        &rms_norm_reference(&four_x, &weight, 1e-5),
        2e-5,
    );
}

#[test]
#[ignore = "needs a GPU"]
fn pinned_copies_and_event_timing() {
    let gpu = gpu();
    let mut pinned = gpu.alloc_pinned::<u32>(1 << 20).unwrap();
    for (index, value) in pinned.as_mut_slice().unwrap().iter_mut().enumerate() {
        *value = index as u32 * 3;
    }
    let mut device = poisoned::<u32>(&gpu, 1 << 20);
    let start = gpu.record_event().unwrap();
    gpu.upload_pinned(&pinned, &mut device).unwrap();
    let mut back = gpu.alloc_pinned::<u32>(1 << 20).unwrap();
    gpu.download_pinned(&device, &mut back).unwrap();
    let end = gpu.record_event().unwrap();
    end.synchronize().unwrap();
    let elapsed = start.elapsed_ms(&end).unwrap();
    assert!(elapsed >= 0.0);
    assert_eq!(back.as_slice().unwrap(), pinned.as_slice().unwrap());
    let spec = ops::specialize_norm(
        ops::NormEntry::RmsNorm,
        pagoda_cuda::DType::F32,
        pagoda_cuda::DType::F32,
    )
    .unwrap();
    let blocks = gpu.max_active_blocks_per_sm(&spec, 256, 0).unwrap();
    println!(
        "round trip of 4 MiB pinned: {elapsed:.3} ms; rms_norm blocks/SM at 256 threads: {blocks}"
    );
    assert!(blocks >= 1);
}

/// The small-batch linear kernel against an f64 host reference and against cuBLAS's GEMM,
/// every row count it takes, f32 and bf16 outputs, beta 0 and 1, a row count not a multiple
/// of its 16-row CTAs and a k not a multiple of 256; bad shapes are refused.
#[test]
#[ignore = "needs a GPU"]
fn small_batch_linear_matches_reference_and_gemm() {
    let gpu = gpu();
    let mut rng = rng(77);
    let (n, k) = (37, 264);
    let w = round::<bf16>(&random_vec(&mut rng, n * k, 1.0));
    let w_d = upload::<bf16>(&gpu, &w);
    for m in 1..=ops::GEMV_MAX_ROWS {
        let x = round::<bf16>(&random_vec(&mut rng, m * k, 1.0));
        let start = round::<bf16>(&random_vec(&mut rng, m * n, 1.0));
        let x_d = upload::<bf16>(&gpu, &x);
        assert!(ops::gemv_small_applies(&x_d, &w_d, (m, n, k)));
        for beta in [0.0f32, 1.0] {
            let expected: Vec<f32> = (0..m * n)
                .map(|e| {
                    let (i, j) = (e / n, e % n);
                    let dot: f64 = (0..k)
                        .map(|c| x[i * k + c] as f64 * w[j * k + c] as f64)
                        .sum();
                    (dot + beta as f64 * start[e] as f64) as f32
                })
                .collect();
            let what = format!("m {m} beta {beta}");
            // f32 out.
            let mut out = upload::<f32>(&gpu, &start);
            ops::gemv_small(&gpu, &x_d, &w_d, &mut out, (m, n, k), beta).unwrap();
            let got = download(&gpu, &out);
            assert_close(&format!("{what} f32 vs f64"), &got, &expected, 1e-4);
            let mut cublas = upload::<f32>(&gpu, &start);
            gpu.gemm(&x_d, &w_d, &mut cublas, (m, n, k), beta).unwrap();
            assert_close(
                &format!("{what} f32 vs cuBLAS"),
                &got,
                &download(&gpu, &cublas),
                1e-4,
            );
            // bf16 out.
            let mut out = upload::<bf16>(&gpu, &start);
            ops::gemv_small(&gpu, &x_d, &w_d, &mut out, (m, n, k), beta).unwrap();
            assert_close(
                &format!("{what} bf16 vs f64"),
                &download(&gpu, &out),
                &expected,
                1e-2,
            );
        }
    }
    // Refused: too many rows, k not a multiple of 8, f32 inputs.
    let x = upload::<bf16>(&gpu, &vec![0.0; 9 * k]);
    let mut out = poisoned::<f32>(&gpu, 9 * n);
    assert!(ops::gemv_small(&gpu, &x, &w_d, &mut out, (9, n, k), 0.0).is_err());
    let odd = upload::<bf16>(&gpu, &[0.0; 2 * 12]);
    let w12 = upload::<bf16>(&gpu, &[0.0; 3 * 12]);
    assert!(!ops::gemv_small_applies(&odd, &w12, (2, 3, 12)));
    assert!(ops::gemv_small(
        &gpu,
        &odd,
        &w12,
        &mut poisoned::<f32>(&gpu, 6),
        (2, 3, 12),
        0.0
    )
    .is_err());
}

/// The strided batched GEMM (DeepSeek's per-head up-projections) against an f64 loop over
/// the heads: activations `[m, heads, width]` of which each head's first `k` columns are its
/// product's, one `[n, k]` weight per head, an output `[m, heads, out_width]` whose columns
/// past each head's `n` keep their values; f32 and bf16 inputs, beta 0 and 1, several row
/// counts; row strides below the product's width refused.
#[test]
#[ignore = "needs a GPU"]
fn gemm_batched_matches_a_per_head_reference() {
    let gpu = gpu();
    let mut rng = rng(91);
    let (heads, width, out_width, n, k) = (4, 40, 24, 16, 32);
    let layout = pagoda_cuda::GemmBatch {
        batch: heads,
        activations_row_stride: heads * width,
        activations_batch_stride: width,
        out_row_stride: heads * out_width,
        out_batch_stride: out_width,
    };
    for m in [1, 3, 17] {
        let x = round::<bf16>(&random_vec(&mut rng, m * heads * width, 1.0));
        let w = round::<bf16>(&random_vec(&mut rng, heads * n * k, 1.0));
        let start = round::<bf16>(&random_vec(&mut rng, m * heads * out_width, 1.0));
        for beta in [0.0f32, 1.0] {
            let expected: Vec<f32> = (0..m * heads * out_width)
                .map(|e| {
                    let (t, h, j) = (
                        e / (heads * out_width),
                        e / out_width % heads,
                        e % out_width,
                    );
                    if j >= n {
                        return start[e];
                    }
                    let dot: f64 = (0..k)
                        .map(|c| {
                            x[(t * heads + h) * width + c] as f64 * w[(h * n + j) * k + c] as f64
                        })
                        .sum();
                    (dot + beta as f64 * start[e] as f64) as f32
                })
                .collect();
            let what = format!("m {m} beta {beta}");
            let mut out = upload::<f32>(&gpu, &start);
            let (x32, w32) = (upload::<f32>(&gpu, &x), upload::<f32>(&gpu, &w));
            gpu.gemm_batched(&x32, &w32, &mut out, (m, n, k), layout, beta)
                .unwrap();
            assert_close(
                &format!("{what} f32"),
                &download(&gpu, &out),
                &expected,
                1e-4,
            );
            let mut out = upload::<f32>(&gpu, &start);
            let (x16, w16) = (upload::<bf16>(&gpu, &x), upload::<bf16>(&gpu, &w));
            gpu.gemm_batched(&x16, &w16, &mut out, (m, n, k), layout, beta)
                .unwrap();
            assert_close(
                &format!("{what} bf16"),
                &download(&gpu, &out),
                &expected,
                1e-4,
            );
        }
    }
    let x = upload::<f32>(&gpu, &vec![0.0; heads * width]);
    let w = upload::<f32>(&gpu, &vec![0.0; heads * n * k]);
    let mut out = poisoned::<f32>(&gpu, heads * out_width);
    let narrow = pagoda_cuda::GemmBatch {
        activations_row_stride: k - 1,
        ..layout
    };
    assert!(gpu
        .gemm_batched(&x, &w, &mut out, (1, n, k), narrow, 0.0)
        .is_err());
}
