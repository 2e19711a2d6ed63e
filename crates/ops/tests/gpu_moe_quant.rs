//! The device MoE over experts kept in their GGUF blocks (`PAGODA_CUDA_MOE_QUANT`:
//! `moe_quant_gate_up`, `moe_quant_down`, then `moe_combine`) on the routing of `moe_route`:
//! - against a float64 loop over the dequantized blocks (`pagoda_tensor::quant::dequantize`)
//!   with the activations quantized as the CPU's `Q8Rows` (the GPU's quantizer rounds
//!   identically) and the intermediates rounded to the dtype then quantized again, on the
//!   routing the device chose: within 5e-3 (f32) or 2e-2 (bf16) of the block's largest output;
//! - against the experts dequantized at load (`moe_gate_up_with` and `moe_down_combine`,
//!   `MoePath::Tiled`, x not quantized): within 5e-2 of the largest output (the q8 activations'
//!   error, as the dense quantized path's);
//! - a row alone gives its batched bits (alone: the per-entry kernels of steps of up to
//!   `MOE_PER_ROW_MAX_ROWS` rows, `moe_quant_*_rows`; batched from 8 rows: the tiles).
//!
//! Rows 1, 3, 8, 64 and 256; top-8 over 128 experts and top-2 over 8; routings spread and
//! crowded (every row the same logits: the picked experts hold every row, the others none);
//! formats Q4_K gate/up with Q6_K down (a Q4_K_M file), Q8_0, Q4_0, Q5_K, Q6_K alone, and a
//! gate/up of two formats (Q4_1 gate, Q5_0 up, Q5_1 down). Ignored without
//! `--include-ignored`: they need the GPU machine.

#[path = "common/mod.rs"]
mod common;
#[path = "gpu_common/mod.rs"]
mod gpu_common;

use common::random_rows;
use gpu_common::*;
use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, DeviceRouter, MoePath, MoeQ8, MoeWorkspace, QuantExperts};
use pagoda_ops::moe::{Renormalize, Router, Scoring};
use pagoda_tensor::quant::{self, q8::Q8Rows};
use pagoda_tensor::GgmlType;

const MAX_ROWS: usize = 256;

/// A block's shape: experts, top-k, hidden, inter.
const SHAPES: [(usize, usize, usize, usize); 2] = [(128, 8, 512, 256), (8, 2, 256, 512)];

/// Gate, up and down formats.
const FORMATS: [[GgmlType; 3]; 6] = [
    [GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q6K],
    [GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0],
    [GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q4_0],
    [GgmlType::Q5K, GgmlType::Q5K, GgmlType::Q5K],
    [GgmlType::Q6K, GgmlType::Q6K, GgmlType::Q6K],
    [GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1],
];

fn format(ty: GgmlType) -> ops::QuantFormat {
    match ty {
        GgmlType::Q4_0 => ops::QuantFormat::Q4_0,
        GgmlType::Q4_1 => ops::QuantFormat::Q4_1,
        GgmlType::Q5_0 => ops::QuantFormat::Q5_0,
        GgmlType::Q5_1 => ops::QuantFormat::Q5_1,
        GgmlType::Q8_0 => ops::QuantFormat::Q8_0,
        GgmlType::Q4K => ops::QuantFormat::Q4K,
        GgmlType::Q5K => ops::QuantFormat::Q5K,
        GgmlType::Q6K => ops::QuantFormat::Q6K,
        other => panic!("{other} is not an in-place format"),
    }
}

/// One projection: its blocks on the device, dequantized on the host and on the device.
struct Projection<T> {
    quant: QuantExperts,
    values: Vec<f32>,
    dense: DeviceBuffer<T>,
}

fn projection<T: TestFloat>(
    gpu: &Gpu,
    ty: GgmlType,
    [experts, rows, cols]: [usize; 3],
    seed: u64,
) -> Projection<T> {
    let bytes = random_rows(ty, experts * rows, cols, &mut rng(seed), false);
    let mut values = vec![0f32; experts * rows * cols];
    quant::dequantize(ty, &bytes, &mut values).unwrap();
    let mut dense = poisoned::<T>(gpu, values.len());
    ops::dequantize(gpu, format(ty), &gpu.upload(&bytes).unwrap(), &mut dense).unwrap();
    Projection {
        quant: QuantExperts::upload(gpu, format(ty), &bytes, [experts, rows, cols]).unwrap(),
        values,
        dense,
    }
}

struct Block<T> {
    router: DeviceRouter,
    hidden: usize,
    inter: usize,
    weights: [Projection<T>; 3],
}

/// The block on the device: the routing (experts, weights per row) and the residual after the
/// quantized experts (`quantized`) or the dequantized ones.
fn run<T: TestFloat>(
    gpu: &Gpu,
    block: &Block<T>,
    (normed, logits, residual): (&[f32], &[f32], &[f32]),
    quantized: bool,
) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let (hidden, inter) = (block.hidden, block.inter);
    let rows = residual.len() / hidden;
    let mut workspace =
        MoeWorkspace::<T>::new(gpu, &block.router, MAX_ROWS, hidden, inter).unwrap();
    let logits = gpu.upload(logits).unwrap();
    ops::moe_route(gpu, &logits, &block.router, None, &mut workspace, rows).unwrap();
    let normed = upload::<T>(gpu, normed);
    let mut x = gpu.upload(residual).unwrap();
    let none: Option<&DeviceBuffer<f32>> = None;
    let [g, u, d] = &block.weights;
    if quantized {
        let mut q8 = MoeQ8::new(gpu, &workspace).unwrap();
        let gate_up = [&g.quant, &u.quant];
        ops::moe_quant_gate_up(gpu, &normed, gate_up, &mut q8, &mut workspace, rows).unwrap();
        ops::moe_quant_down_combine(gpu, &d.quant, &mut q8, &mut workspace, none, &mut x, rows)
            .unwrap();
    } else {
        let (path, gate_up) = (MoePath::Tiled, [&g.dense, &u.dense]);
        ops::moe_gate_up_with(gpu, path, &normed, gate_up, &mut workspace, rows).unwrap();
        ops::moe_down_combine(gpu, path, &d.dense, &mut workspace, none, &mut x, rows).unwrap();
    }
    let top_k = block.router.top_k;
    let experts = gpu.download(&workspace.experts).unwrap()[..rows * top_k].to_vec();
    let weights = gpu.download(&workspace.weights).unwrap()[..rows * top_k].to_vec();
    (experts, weights, gpu.download(&x).unwrap())
}

/// `x` quantized to q8 rows of `width` and decoded back.
fn q8_values(x: &[f32], width: usize) -> Vec<f32> {
    let q = Q8Rows::quantize(x, width).unwrap();
    let mut out = vec![0f32; x.len()];
    for (row, chunk) in out.chunks_exact_mut(width).enumerate() {
        q.dequantize_row(row, chunk);
    }
    out
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// The float64 block over the dequantized blocks on the device's routing.
fn reference<T: TestFloat>(
    block: &Block<T>,
    (normed, residual): (&[f32], &[f32]),
    (experts, weights): (&[u32], &[f32]),
) -> Vec<f32> {
    let (hidden, inter, top_k) = (block.hidden, block.inter, block.router.top_k);
    let xq = q8_values(normed, hidden);
    let [g, u, d] = &block.weights;
    let mut out = residual.to_vec();
    for (row, x) in xq.chunks_exact(hidden).enumerate() {
        let mut sum = 0f64;
        let mut delta = vec![0f64; hidden];
        for j in 0..top_k {
            let (e, w) = (experts[row * top_k + j] as usize, weights[row * top_k + j]);
            let act: Vec<f32> = (0..inter)
                .map(|c| {
                    let at = (e * inter + c) * hidden;
                    let gv = dot(x, &g.values[at..at + hidden]);
                    let uv = dot(x, &u.values[at..at + hidden]);
                    round::<T>(&[(gv / (1.0 + (-gv).exp()) * uv) as f32])[0]
                })
                .collect();
            let act = q8_values(&act, inter);
            for (h, value) in delta.iter_mut().enumerate() {
                let at = (e * hidden + h) * inter;
                *value += w as f64 * dot(&act, &d.values[at..at + inter]);
            }
            sum += w as f64;
        }
        assert!(sum.is_finite());
        for (h, value) in delta.iter().enumerate() {
            out[row * hidden + h] = (residual[row * hidden + h] as f64 + value) as f32;
        }
    }
    out
}

/// The largest |a - b| over the largest |b - residual| (the block's output scale).
fn scaled_error(actual: &[f32], expected: &[f32], residual: &[f32]) -> f64 {
    let scale = expected
        .iter()
        .zip(residual)
        .map(|(&e, &r)| (e as f64 - r as f64).abs())
        .fold(1e-30, f64::max);
    let worst = actual
        .iter()
        .zip(expected)
        .map(|(&a, &e)| (a as f64 - e as f64).abs())
        .fold(0.0, f64::max);
    assert!(worst.is_finite(), "not finite");
    worst / scale
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn check<T: TestFloat>(tolerance: f64) {
    let gpu = gpu();
    let launches = ops::moe_quant_launches();
    for (s, &(experts, top_k, hidden, inter)) in SHAPES.iter().enumerate() {
        let router = DeviceRouter::from_router(&Router {
            num_experts: experts,
            top_k,
            scoring: Scoring::Softmax,
            renormalize: Renormalize::Yes,
            group_limit: None,
            selection_bias: None,
            scale: 1.0,
        })
        .unwrap();
        for (f, tys) in FORMATS.iter().enumerate() {
            let seed = 700 + 10 * s as u64 + 3 * f as u64;
            let block = Block::<T> {
                router,
                hidden,
                inter,
                weights: [
                    projection(&gpu, tys[0], [experts, inter, hidden], seed),
                    projection(&gpu, tys[1], [experts, inter, hidden], seed + 1),
                    projection(&gpu, tys[2], [experts, hidden, inter], seed + 2),
                ],
            };
            let mut rng = rng(seed);
            for rows in [1usize, 3, 8, 64, 256] {
                for crowded in [false, true] {
                    let mut logits = random_vec(&mut rng, rows * experts, 2.0);
                    if crowded {
                        let first = logits[..experts].to_vec();
                        logits
                            .chunks_exact_mut(experts)
                            .for_each(|row| row.copy_from_slice(&first));
                    }
                    let normed = round::<T>(&random_vec(&mut rng, rows * hidden, 1.0));
                    let residual = random_vec(&mut rng, rows * hidden, 1.0);
                    let what = format!(
                        "{} {experts} experts top-{top_k} {tys:?}: {rows} rows crowded {crowded}",
                        T::NAME
                    );
                    let inputs = (&normed[..], &logits[..], &residual[..]);
                    let (picked, weights, quantized) = run(&gpu, &block, inputs, true);
                    let (_, _, dense) = run(&gpu, &block, inputs, false);
                    let expected = reference(&block, (&normed, &residual), (&picked, &weights));
                    let error = scaled_error(&quantized, &expected, &residual);
                    assert!(error <= tolerance, "{what}: {error:e} from the f64 loop");
                    let error = scaled_error(&quantized, &dense, &residual);
                    assert!(
                        error <= 5e-2,
                        "{what}: {error:e} from the dequantized experts"
                    );
                    for row in [0, rows - 1] {
                        let one = |v: &[f32], w: usize| v[row * w..(row + 1) * w].to_vec();
                        let (n, l, r) = (
                            one(&normed, hidden),
                            one(&logits, experts),
                            one(&residual, hidden),
                        );
                        let (_, _, alone) = run(&gpu, &block, (&n, &l, &r), true);
                        let batched = &quantized[row * hidden..(row + 1) * hidden];
                        assert!(
                            same_bits(&alone, batched),
                            "{what}: row {row} alone differs"
                        );
                    }
                }
            }
        }
    }
    assert!(
        ops::moe_quant_launches() > launches,
        "no quantized expert launch counted"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn quantized_experts_match_a_float64_loop_and_the_dequantized_experts_in_bf16() {
    check::<bf16>(2e-2);
}

#[test]
#[ignore = "needs a GPU"]
fn quantized_experts_match_a_float64_loop_and_the_dequantized_experts_in_f32() {
    check::<f32>(5e-3);
}

/// Rows of a format's partial block are refused at upload.
#[test]
#[ignore = "needs a GPU"]
fn experts_of_partial_blocks_are_refused() {
    let gpu = gpu();
    let bytes = vec![0u8; 144 * 3];
    let error = QuantExperts::upload(&gpu, ops::QuantFormat::Q4K, &bytes, [3, 2, 384]);
    assert!(error.is_err());
}
