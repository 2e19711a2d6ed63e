//! The device MoE's expert paths against each other at real models' shapes (scaled down):
//! `MoePath::PerRow` (`moe_gate_up_rows`, then `moe_down_combine`: a warp per row and expert)
//! gives bit for bit the f32 residual of `MoePath::Tiled` (`moe_gate_up`, `moe_down` and
//! `moe_combine` over tiles of an expert's entries, which `gpu_moe` checks against a float64
//! loop over the CPU's routing), at rows 1, 3, 8, 64 and 256, with and without shared experts,
//! routings spread over the experts and crowded (every row the same logits, so each picked
//! expert holds every row, tiles of 8 over 256 rows); a row's per-row bits are the same alone
//! and in its batch. Ignored without `--include-ignored`: they need the GPU machine.

#[path = "gpu_common/mod.rs"]
mod common;

use common::*;
use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, DeviceRouter, MoePath, MoeWorkspace};
use pagoda_ops::moe::{Renormalize, Router, Scoring};

/// The most rows a case runs.
const MAX_ROWS: usize = 256;

/// A MoE block's shape: its name, router, hidden and expert intermediate size.
struct Shape {
    name: &'static str,
    router: Router<'static>,
    hidden: usize,
    inter: usize,
}

/// Qwen3-30B-A3B (128 experts, top-8), DeepSeek-V2-Lite (64, top-6, unnormalised weights)
/// and Mixtral (8, top-2) routers, hidden and intermediate sizes cut by 4 (Mixtral's by 4 and
/// 32) so a layer stays small.
fn shapes() -> Vec<Shape> {
    let router = |num_experts, top_k, renormalize| Router {
        num_experts,
        top_k,
        scoring: Scoring::Softmax,
        renormalize,
        group_limit: None,
        selection_bias: None,
        scale: 1.0,
    };
    vec![
        Shape {
            name: "qwen3-30b-a3b / 4",
            router: router(128, 8, Renormalize::Yes),
            hidden: 512,
            inter: 192,
        },
        Shape {
            name: "deepseek-v2-lite / 4",
            router: router(64, 6, Renormalize::No),
            hidden: 512,
            inter: 352,
        },
        Shape {
            name: "mixtral-8x7b / 4, 32",
            router: router(8, 2, Renormalize::Yes),
            hidden: 1024,
            inter: 448,
        },
    ]
}

/// One case's inputs: normed activations `[rows, hidden]`, logits `[rows, experts]`, the
/// residual `[rows, hidden]` and the shared experts' output `[rows, hidden]` if any.
struct Inputs {
    normed: Vec<f32>,
    logits: Vec<f32>,
    residual: Vec<f32>,
    shared: Option<Vec<f32>>,
}

impl Inputs {
    /// Row `row` alone.
    fn row(&self, row: usize, hidden: usize, experts: usize) -> Inputs {
        let one = |v: &[f32], w: usize| v[row * w..(row + 1) * w].to_vec();
        Inputs {
            normed: one(&self.normed, hidden),
            logits: one(&self.logits, experts),
            residual: one(&self.residual, hidden),
            shared: self.shared.as_ref().map(|s| one(s, hidden)),
        }
    }
}

/// The residual after the block's routed experts through `path`: route, gate/up, down and
/// combine on the device.
fn block<T: TestFloat>(
    gpu: &Gpu,
    shape: &Shape,
    weights: &[DeviceBuffer<T>; 3],
    inputs: &Inputs,
    path: MoePath,
) -> Vec<f32> {
    let router = DeviceRouter::from_router(&shape.router).unwrap();
    let (hidden, inter) = (shape.hidden, shape.inter);
    let rows = inputs.residual.len() / hidden;
    let mut workspace = MoeWorkspace::<T>::new(gpu, &router, MAX_ROWS, hidden, inter).unwrap();
    let logits = gpu.upload(&inputs.logits).unwrap();
    ops::moe_route(gpu, &logits, &router, None, &mut workspace, rows).unwrap();
    let normed = upload::<T>(gpu, &inputs.normed);
    let [gate, up, down] = weights;
    ops::moe_gate_up_with(gpu, path, &normed, [gate, up], &mut workspace, rows).unwrap();
    let mut x = gpu.upload(&inputs.residual).unwrap();
    let shared = inputs.shared.as_ref().map(|s| gpu.upload(s).unwrap());
    ops::moe_down_combine(
        gpu,
        path,
        down,
        &mut workspace,
        shared.as_ref(),
        &mut x,
        rows,
    )
    .unwrap();
    gpu.download(&x).unwrap()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn check_paths<T: TestFloat>() {
    let gpu = gpu();
    for (s, shape) in shapes().iter().enumerate() {
        let (experts, hidden, inter) = (shape.router.num_experts, shape.hidden, shape.inter);
        let mut rng = rng(91 + s as u64);
        let len = experts * hidden * inter;
        let weights =
            [0.3, 0.3, 0.2].map(|scale| upload::<T>(&gpu, &random_vec(&mut rng, len, scale)));
        for rows in [1usize, 3, 8, 64, 256] {
            for crowded in [false, true] {
                let mut logits = random_vec(&mut rng, rows * experts, 2.0);
                if crowded {
                    let first = logits[..experts].to_vec();
                    logits
                        .chunks_exact_mut(experts)
                        .for_each(|row| row.copy_from_slice(&first));
                }
                let shared_out = random_vec(&mut rng, rows * hidden, 0.5);
                for with_shared in [false, true] {
                    let inputs = Inputs {
                        normed: round::<T>(&random_vec(&mut rng, rows * hidden, 1.0)),
                        logits: logits.clone(),
                        residual: random_vec(&mut rng, rows * hidden, 1.0),
                        shared: with_shared.then(|| shared_out.clone()),
                    };
                    let what = format!(
                        "{} {}: {rows} rows crowded {crowded} shared {with_shared}",
                        T::NAME,
                        shape.name
                    );
                    let tiled = block(&gpu, shape, &weights, &inputs, MoePath::Tiled);
                    let per_row = block(&gpu, shape, &weights, &inputs, MoePath::PerRow);
                    assert!(tiled.iter().all(|v| v.is_finite()), "{what}: not finite");
                    assert!(
                        same_bits(&per_row, &tiled),
                        "{what}: per row differs from tiled"
                    );
                    for row in [0, rows - 1] {
                        let alone = inputs.row(row, hidden, experts);
                        let alone = block(&gpu, shape, &weights, &alone, MoePath::PerRow);
                        let batched = &per_row[row * hidden..(row + 1) * hidden];
                        assert!(
                            same_bits(&alone, batched),
                            "{what}: row {row} alone differs"
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn the_per_row_path_equals_the_tiled_path_bit_for_bit_in_bf16() {
    check_paths::<bf16>();
}

#[test]
#[ignore = "needs a GPU"]
fn the_per_row_path_equals_the_tiled_path_bit_for_bit_in_f32() {
    check_paths::<f32>();
}

/// The path a step takes is a function of its row count: per row up to `MOE_PER_ROW_MAX_ROWS`.
#[test]
fn the_per_row_path_serves_the_small_steps() {
    assert_eq!(MoePath::for_rows(1), MoePath::PerRow);
    assert_eq!(
        MoePath::for_rows(ops::MOE_PER_ROW_MAX_ROWS),
        MoePath::PerRow
    );
    assert_eq!(
        MoePath::for_rows(ops::MOE_PER_ROW_MAX_ROWS + 1),
        MoePath::Tiled
    );
}
