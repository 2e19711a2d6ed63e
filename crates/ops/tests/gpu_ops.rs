//! GPU op tests against the ops crate's CPU implementations (`pagoda_ops::norm`,
//! `activation`, `rope`, `linear`, and `pagoda_tensor`'s dequantizers), ignored without
//! `--include-ignored`: they need the GPU machine. Outputs are poisoned with NaN before every
//! launch.

#[path = "gpu_common/mod.rs"]
mod common;

use common::*;
use half::bf16;
use pagoda_cuda::{available, DeviceRead, Gpu, GraphCache};
use pagoda_ops::cuda::{self as ops, QuantFormat, RopeStyle};
use pagoda_ops::linear::Weight;
use pagoda_ops::rope::{Rope, RopePairing};
use pagoda_tensor::GgmlType;
use rand::Rng;

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

fn check_norms<T: TestFloat>(gpu: &Gpu) {
    let mut rng = rng(1);
    for (rows, dim) in [(1, 64), (7, 576), (3, 4096)] {
        let x = round::<T>(&random_vec(&mut rng, rows * dim, 2.0));
        let residual = round::<T>(&random_vec(&mut rng, rows * dim, 2.0));
        let weight = round::<T>(&random_vec(&mut rng, dim, 1.5));
        let (x_d, w_d) = (upload::<T>(gpu, &x), upload::<T>(gpu, &weight));
        let mut out = poisoned::<T>(gpu, rows * dim);
        ops::rms_norm(gpu, &x_d, &w_d, &mut out, 1e-5).unwrap();
        let what = format!("rms_norm {} [{rows}, {dim}]", T::NAME);
        assert_close(
            &what,
            &download(gpu, &out),
            &rms_norm_reference(&x, &weight, 1e-5),
            T::TOLERANCE,
        );

        let mut residual_d = upload::<T>(gpu, &residual);
        let mut out = poisoned::<T>(gpu, rows * dim);
        ops::add_rms_norm(gpu, &mut residual_d, &x_d, &w_d, &mut out, 1e-6).unwrap();
        let sum = round::<T>(
            &residual
                .iter()
                .zip(&x)
                .map(|(a, b)| a + b)
                .collect::<Vec<_>>(),
        );
        let what = format!("add_rms_norm {} [{rows}, {dim}]", T::NAME);
        assert_close(
            &format!("{what} residual"),
            &download(gpu, &residual_d),
            &sum,
            T::TOLERANCE,
        );
        assert_close(
            &what,
            &download(gpu, &out),
            &rms_norm_reference(&sum, &weight, 1e-6),
            T::TOLERANCE,
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn rms_norm_matches_reference() {
    let gpu = gpu();
    check_norms::<f32>(&gpu);
    check_norms::<bf16>(&gpu);
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

fn check_elementwise<T: TestFloat>(gpu: &Gpu) {
    let mut rng = rng(3);
    // silu_mul on a fused [gate | up] buffer: strides 2 * width.
    let (tokens, width) = (5, 300);
    let fused = round::<T>(&random_vec(&mut rng, tokens * 2 * width, 4.0));
    let fused_d = upload::<T>(gpu, &fused);
    let gate = fused_d.view(0..fused.len()).unwrap();
    let up = fused_d.view(width..fused.len()).unwrap();
    let mut out = poisoned::<T>(gpu, tokens * width);
    ops::silu_mul(gpu, &gate, &up, &mut out, width, (2 * width, 2 * width)).unwrap();
    let expected: Vec<f32> = (0..tokens)
        .flat_map(|t| {
            let row = &fused[t * 2 * width..(t + 1) * 2 * width];
            silu_reference(&row[..width], &row[width..])
        })
        .collect();
    assert_close(
        &format!("silu_mul fused {}", T::NAME),
        &download(gpu, &out),
        &expected,
        T::TOLERANCE,
    );

    let a = round::<T>(&random_vec(&mut rng, 1000, 3.0));
    let b = round::<T>(&random_vec(&mut rng, 1000, 3.0));
    let mut a_d = upload::<T>(gpu, &a);
    ops::add_in_place(gpu, &mut a_d, &upload::<T>(gpu, &b)).unwrap();
    let mut sum = a.clone();
    pagoda_ops::activation::add_in_place(&mut sum, &b);
    assert_close(
        &format!("add_in_place {}", T::NAME),
        &download(gpu, &a_d),
        &sum,
        T::TOLERANCE,
    );
}

#[test]
#[ignore = "needs a GPU"]
fn elementwise_ops_match_reference() {
    let gpu = gpu();
    check_elementwise::<f32>(&gpu);
    check_elementwise::<bf16>(&gpu);
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

fn check_embedding<TTable: TestFloat, T: TestFloat>(gpu: &Gpu) {
    let mut rng = rng(5);
    let (vocab, hidden) = (300, 96);
    let table = round::<TTable>(&random_vec(&mut rng, vocab * hidden, 1.0));
    let ids: Vec<u32> = vec![0, 299, 17, 17, 5, 400];
    let mut out = poisoned::<T>(gpu, ids.len() * hidden);
    ops::embedding_gather(
        gpu,
        &upload::<TTable>(gpu, &table),
        &gpu.upload(&ids).unwrap(),
        &mut out,
        vocab,
        hidden,
    )
    .unwrap();
    let actual = download(gpu, &out);
    for (t, &id) in ids.iter().enumerate() {
        let row = &actual[t * hidden..(t + 1) * hidden];
        if id as usize >= vocab {
            assert!(
                row.iter().all(|v| v.is_nan()),
                "out-of-vocab id gives a NaN row"
            );
        } else {
            let expected = round::<T>(&table[id as usize * hidden..(id as usize + 1) * hidden]);
            assert_eq!(
                row,
                &expected[..],
                "embedding {}->{} token {t}",
                TTable::NAME,
                T::NAME
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn embedding_gather_copies_rows() {
    let gpu = gpu();
    check_embedding::<f32, f32>(&gpu);
    check_embedding::<f32, bf16>(&gpu);
    check_embedding::<bf16, bf16>(&gpu);
    check_embedding::<bf16, f32>(&gpu);
}

/// The CPU RoPE ([`pagoda_ops::rope::Rope`] at `theta`, `rope_dim`) of the first
/// `num_heads` heads of each token row of `x` (rows `row_stride` apart).
fn rope_reference(
    x: &[f32],
    positions: &[u32],
    rope: &Rope,
    geometry: (usize, usize, usize),
) -> Vec<f32> {
    let (num_heads, head_dim, row_stride) = geometry;
    let mut out = x.to_vec();
    for (t, &position) in positions.iter().enumerate() {
        let heads = &mut out[t * row_stride..t * row_stride + num_heads * head_dim];
        rope.apply(heads, &[position], num_heads, head_dim);
    }
    out
}

fn check_rope<T: TestFloat>(gpu: &Gpu) {
    let mut rng = rng(6);
    for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
        for (num_heads, head_dim, rope_dim, row_stride) in [
            (3, 64, 64, 3 * 64),
            (2, 64, 32, 5 * 64),
            (4, 128, 128, 4 * 128),
        ] {
            let tokens = 9;
            let x = round::<T>(&random_vec(&mut rng, tokens * row_stride, 2.0));
            let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..8192)).collect();
            let pairing = match style {
                RopeStyle::Interleaved => RopePairing::Interleaved,
                RopeStyle::Halves => RopePairing::Halves,
            };
            let rope = Rope::new(10000.0, rope_dim, None, pairing);
            let inv_freq = rope.inverse_frequencies().to_vec();
            let mut x_d = upload::<T>(gpu, &x);
            let geometry = (num_heads, head_dim, row_stride);
            ops::rope(
                gpu,
                &mut x_d,
                &gpu.upload(&positions).unwrap(),
                &gpu.upload(&inv_freq).unwrap(),
                geometry,
                style,
            )
            .unwrap();
            let expected = rope_reference(&x, &positions, &rope, geometry);
            // Angles up to ~8000 rad: f32 argument rounding dominates, so 1e-3 for f32.
            let tolerance = T::TOLERANCE.max(1e-3);
            assert_close(
                &format!("rope {style:?} {} {geometry:?}", T::NAME),
                &download(gpu, &x_d),
                &expected,
                tolerance,
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn rope_matches_reference() {
    let gpu = gpu();
    check_rope::<f32>(&gpu);
    check_rope::<bf16>(&gpu);
}

/// Random quantized blocks with finite f16 scales, in `format`'s byte layout.
fn random_blocks(
    rng: &mut rand_chacha::ChaCha8Rng,
    format: QuantFormat,
    num_blocks: usize,
) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..num_blocks * format.block_bytes())
        .map(|_| rng.random())
        .collect();
    let half_offsets: &[usize] = match format {
        QuantFormat::Q4_0 | QuantFormat::Q8_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q6K => &[208],
    };
    for block in bytes.chunks_mut(format.block_bytes()) {
        for &offset in half_offsets {
            let value = half::f16::from_f32(rng.random_range(-0.05..0.05));
            block[offset..offset + 2].copy_from_slice(&value.to_bits().to_le_bytes());
        }
    }
    bytes
}

fn check_dequant<T: TestFloat>(gpu: &Gpu) {
    let mut rng = rng(7);
    for format in QuantFormat::ALL {
        let num_blocks = 37;
        let bytes = random_blocks(&mut rng, format, num_blocks);
        let ty = match format {
            QuantFormat::Q4_0 => GgmlType::Q4_0,
            QuantFormat::Q4_1 => GgmlType::Q4_1,
            QuantFormat::Q8_0 => GgmlType::Q8_0,
            QuantFormat::Q4K => GgmlType::Q4K,
            QuantFormat::Q5K => GgmlType::Q5K,
            QuantFormat::Q6K => GgmlType::Q6K,
        };
        let num_values = num_blocks * format.block_values();
        let mut reference = vec![0f32; num_values];
        pagoda_tensor::quant::dequantize(ty, &bytes, &mut reference).unwrap();
        let mut out = poisoned::<T>(gpu, num_values);
        ops::dequantize(gpu, format, &gpu.upload(&bytes).unwrap(), &mut out).unwrap();
        let expected: Vec<u32> = round::<T>(&reference).iter().map(|v| v.to_bits()).collect();
        let actual: Vec<u32> = download(gpu, &out).iter().map(|v| v.to_bits()).collect();
        let mismatch = actual.iter().zip(&expected).position(|(a, e)| a != e);
        assert!(
            mismatch.is_none(),
            "dequant {format:?} -> {} differs at {mismatch:?}",
            T::NAME
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn dequantize_is_bit_exact() {
    let gpu = gpu();
    check_dequant::<f32>(&gpu);
    check_dequant::<bf16>(&gpu);
}

/// The CPU linear layer (f32 weights `[n, k]`) on `x` (`[m, k]`).
fn gemm_reference(x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize)) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    Weight::from_f32(n, k, w).matmul(x, m, &mut out);
    out
}

fn check_gemm<TIn: TestFloat, TOut: TestFloat>(gpu: &Gpu, tolerance: f32) {
    let mut rng = rng(8);
    for shape in [(1, 576, 576), (7, 1536, 576), (33, 200, 64)] {
        let (m, n, k) = shape;
        let x = round::<TIn>(&random_vec(&mut rng, m * k, 1.0));
        let w = round::<TIn>(&random_vec(&mut rng, n * k, 0.1));
        let (x_d, w_d) = (upload::<TIn>(gpu, &x), upload::<TIn>(gpu, &w));
        let mut out = poisoned::<TOut>(gpu, m * n);
        gpu.gemm(&x_d, &w_d, &mut out, shape, 0.0).unwrap();
        let expected = gemm_reference(&x, &w, shape);
        let what = format!("gemm {}->{} {shape:?}", TIn::NAME, TOut::NAME);
        assert_close(&what, &download(gpu, &out), &expected, tolerance);
        // beta = 1 accumulates into the output (the residual fusion).
        gpu.gemm(&x_d, &w_d, &mut out, shape, 1.0).unwrap();
        let doubled: Vec<f32> = expected.iter().map(|v| 2.0 * v).collect();
        assert_close(
            &format!("{what} beta=1"),
            &download(gpu, &out),
            &doubled,
            tolerance * 2.0,
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gemm_matches_reference_and_caches_plans() {
    let gpu = gpu();
    check_gemm::<f32, f32>(&gpu, 1e-4);
    check_gemm::<bf16, bf16>(&gpu, bf16::TOLERANCE);
    check_gemm::<bf16, f32>(&gpu, 1e-4);
    // 3 shapes x 3 dtype pairs x (beta 0, beta 1).
    assert_eq!(gpu.gemm_plans(), 18);
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
