//! The MoE experts on tensor cores (`MoePath::TensorCore`: `moe_gate_up_mma`, `moe_down_mma`,
//! then `moe_combine`; bf16 only) against a float64 loop over the CPU's routing (the
//! intermediates rounded through bf16 as the device stores them), within 2e-2 relative to
//! 1 + |value| (`gpu_moe`'s bf16 bound: a rounding tie of an intermediate broken the other
//! way moves an output by one bf16 ulp of it times a down weight), and against the CUDA-core
//! tiles (`MoePath::Tiled`) within the same bound; at 1 to 512 rows (row counts that are not
//! multiples of the 8-entry tiles or the 32-entry groups, experts with no rows, one expert
//! kept out of every row, crowded routings where each picked expert holds every row), hidden
//! and intermediate sizes that are not multiples of the 32-value steps or the 64-column CTAs.
//! The same inputs give the same bits run to run; a row alone gives its batch's bits.
//! Ignored without `--include-ignored`: they need the GPU machine.

#[path = "gpu_common/mod.rs"]
mod common;

use common::*;
use half::bf16;
use pagoda_cuda::Gpu;
use pagoda_ops::cuda::{self as ops, DeviceRouter, MoePath, MoeWorkspace};
use pagoda_ops::moe::{route_with, Renormalize, Router, Scoring};

/// The most rows a case runs.
const MAX_ROWS: usize = 512;
/// bf16's bound (`gpu_moe`'s).
const TOLERANCE: f32 = 2e-2;

/// (experts, top-k, hidden, inter): Qwen3-30B-A3B's router at a small width, a DeepSeek-like
/// top-6 of 64, Mixtral's top-2 of 8 with sizes off the 32-value step and 64-column CTA.
const SHAPES: [(usize, usize, usize, usize); 3] =
    [(128, 8, 256, 96), (64, 6, 200, 72), (8, 2, 136, 40)];

/// A case: the layer's weights on the host (`[E, inter, hidden]` twice, `[E, hidden,
/// inter]`, rounded to bf16) and the device.
struct Layer {
    router: Router<'static>,
    hidden: usize,
    inter: usize,
    host: [Vec<f32>; 3],
    device: [pagoda_cuda::DeviceBuffer<bf16>; 3],
}

fn layer(
    gpu: &Gpu,
    seed: u64,
    (experts, top_k, hidden, inter): (usize, usize, usize, usize),
) -> Layer {
    let mut rng = rng(seed);
    let len = experts * hidden * inter;
    let host = [0.3, 0.3, 0.2].map(|scale| round::<bf16>(&random_vec(&mut rng, len, scale)));
    let device = [0, 1, 2].map(|i| upload::<bf16>(gpu, &host[i]));
    let router = Router {
        num_experts: experts,
        top_k,
        scoring: Scoring::Softmax,
        renormalize: Renormalize::Yes,
        group_limit: None,
        selection_bias: None,
        scale: 1.0,
    };
    Layer {
        router,
        hidden,
        inter,
        host,
        device,
    }
}

/// The float64 `x += Σ w · down(silu(gate(h)) * up(h))` over `route_with`'s routing, in
/// ascending expert index, the intermediates rounded through bf16.
fn reference(layer: &Layer, normed: &[f32], logits: &[f32], residual: &[f32]) -> Vec<f32> {
    let (hidden, inter, top_k) = (layer.hidden, layer.inter, layer.router.top_k);
    let routing = route_with(logits, &layer.router);
    let [gate, up, down] = &layer.host;
    let dot =
        |a: &[f32], b: &[f32]| -> f64 { a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum() };
    let mut out = residual.to_vec();
    for (row, x) in normed.chunks_exact(hidden).enumerate() {
        let mut picks: Vec<(usize, f32)> = (0..top_k)
            .map(|j| {
                (
                    routing.experts[row * top_k + j] as usize,
                    routing.weights[row * top_k + j],
                )
            })
            .collect();
        picks.sort_by_key(|p| p.0);
        let mut mix = vec![0f64; hidden];
        for (e, w) in picks {
            let act: Vec<f32> = (0..inter)
                .map(|j| {
                    let rows = (e * inter + j) * hidden..(e * inter + j + 1) * hidden;
                    let (g, u) = (dot(x, &gate[rows.clone()]), dot(x, &up[rows]));
                    bf16::from_f32((g / (1.0 + (-g).exp()) * u) as f32).to_f32()
                })
                .collect();
            for (h, m) in mix.iter_mut().enumerate() {
                *m += w as f64
                    * dot(
                        &act,
                        &down[(e * hidden + h) * inter..(e * hidden + h + 1) * inter],
                    );
            }
        }
        for (h, m) in mix.iter().enumerate() {
            out[row * hidden + h] = (out[row * hidden + h] as f64 + m) as f32;
        }
    }
    out
}

/// The residual after the routed experts through `path` on the device.
fn device(
    gpu: &Gpu,
    layer: &Layer,
    path: MoePath,
    normed: &[f32],
    logits: &[f32],
    residual: &[f32],
) -> Vec<f32> {
    let router = DeviceRouter::from_router(&layer.router).unwrap();
    let (hidden, inter) = (layer.hidden, layer.inter);
    let rows = residual.len() / hidden;
    let mut workspace = MoeWorkspace::<bf16>::new(gpu, &router, MAX_ROWS, hidden, inter).unwrap();
    let logits = gpu.upload(logits).unwrap();
    ops::moe_route(gpu, &logits, &router, None, &mut workspace, rows).unwrap();
    let normed = upload::<bf16>(gpu, normed);
    let [gate, up, down] = &layer.device;
    ops::moe_gate_up_with(gpu, path, &normed, [gate, up], &mut workspace, rows).unwrap();
    let mut x = gpu.upload(residual).unwrap();
    let none: Option<&pagoda_cuda::DeviceBuffer<f32>> = None;
    ops::moe_down_combine(gpu, path, down, &mut workspace, none, &mut x, rows).unwrap();
    gpu.download(&x).unwrap()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Logits for `rows` rows: random, with expert 3 kept out of every row (`starved`), or
/// every row the first row's (`crowded`).
fn logits(
    rng: &mut rand_chacha::ChaCha8Rng,
    rows: usize,
    experts: usize,
    variant: usize,
) -> Vec<f32> {
    let mut logits = random_vec(rng, rows * experts, 2.0);
    match variant {
        1 => logits
            .chunks_exact_mut(experts)
            .for_each(|row| row[3 % experts] = -1e4),
        2 => {
            let first = logits[..experts].to_vec();
            logits
                .chunks_exact_mut(experts)
                .for_each(|row| row.copy_from_slice(&first));
        }
        _ => {}
    }
    logits
}

#[test]
#[ignore = "needs a GPU"]
fn tensor_core_experts_match_a_float64_loop_and_the_tiles_in_bf16() {
    let gpu = gpu();
    let launches = ops::moe_mma_launches();
    for (s, &shape) in SHAPES.iter().enumerate() {
        let layer = layer(&gpu, 301 + s as u64, shape);
        let (experts, hidden) = (shape.0, shape.2);
        let mut rng = rng(17 + s as u64);
        for rows in [1usize, 5, 31, 32, 33, 64, 100, 257, 512] {
            for variant in 0..3 {
                let what = format!(
                    "{experts} experts top-{} {rows} rows variant {variant}",
                    shape.1
                );
                let logits = logits(&mut rng, rows, experts, variant);
                let normed = round::<bf16>(&random_vec(&mut rng, rows * hidden, 1.0));
                let residual = random_vec(&mut rng, rows * hidden, 1.0);
                let mma = device(
                    &gpu,
                    &layer,
                    MoePath::TensorCore,
                    &normed,
                    &logits,
                    &residual,
                );
                let want = reference(&layer, &normed, &logits, &residual);
                assert_close(&format!("{what}: tensor cores"), &mma, &want, TOLERANCE);
                let tiled = device(&gpu, &layer, MoePath::Tiled, &normed, &logits, &residual);
                assert_close(
                    &format!("{what}: against the tiles"),
                    &mma,
                    &tiled,
                    TOLERANCE,
                );
                let again = device(
                    &gpu,
                    &layer,
                    MoePath::TensorCore,
                    &normed,
                    &logits,
                    &residual,
                );
                assert!(same_bits(&mma, &again), "{what}: a second run differs");
            }
        }
    }
    assert!(
        ops::moe_mma_launches() > launches,
        "the launches are counted"
    );
}

/// Each output is its own entry's mma chain, so a row alone gives its batch's bits (as the
/// CUDA-core paths do): true of the tensor cores measured, not a PTX guarantee.
#[test]
#[ignore = "needs a GPU"]
fn a_row_alone_gives_its_batch_bits_on_tensor_cores() {
    let gpu = gpu();
    let shape = SHAPES[0];
    let layer = layer(&gpu, 11, shape);
    let (experts, hidden) = (shape.0, shape.2);
    let mut rng = rng(5);
    let rows = 300;
    let logits = logits(&mut rng, rows, experts, 0);
    let normed = round::<bf16>(&random_vec(&mut rng, rows * hidden, 1.0));
    let residual = random_vec(&mut rng, rows * hidden, 1.0);
    let batch = device(
        &gpu,
        &layer,
        MoePath::TensorCore,
        &normed,
        &logits,
        &residual,
    );
    for row in [0, 150, rows - 1] {
        let one = |v: &[f32], w: usize| v[row * w..(row + 1) * w].to_vec();
        let alone = device(
            &gpu,
            &layer,
            MoePath::TensorCore,
            &one(&normed, hidden),
            &one(&logits, experts),
            &one(&residual, hidden),
        );
        assert!(
            same_bits(&alone, &one(&batch, hidden)),
            "row {row} alone differs"
        );
    }
}

/// The model's choice: per row up to 4 rows, the tiles below `MOE_MMA_MIN_ROWS`, tensor cores
/// from there where on and bf16.
#[test]
fn tensor_cores_serve_the_large_bf16_steps() {
    use pagoda_cuda::DType;
    let min = ops::MOE_MMA_MIN_ROWS;
    assert_eq!(MoePath::choose(1, DType::BF16, true), MoePath::PerRow);
    assert_eq!(MoePath::choose(min - 1, DType::BF16, true), MoePath::Tiled);
    assert_eq!(MoePath::choose(min, DType::BF16, true), MoePath::TensorCore);
    assert_eq!(
        MoePath::choose(4096, DType::BF16, true),
        MoePath::TensorCore
    );
    assert_eq!(MoePath::choose(min, DType::BF16, false), MoePath::Tiled);
    assert_eq!(MoePath::choose(min, DType::F32, true), MoePath::Tiled);
    assert_eq!(MoePath::choose(min, DType::F16, true), MoePath::Tiled);
    assert!(ops::specialize_moe(ops::MoeEntry::GateUpMma, DType::F32).is_err());
    assert!(ops::specialize_moe(ops::MoeEntry::DownMma, DType::BF16).is_ok());
}
