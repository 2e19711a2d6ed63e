//! `pagoda bench moe --moe-path quant`: the routed experts of one MoE block kept in GGUF blocks
//! (`PAGODA_CUDA_MOE_QUANT`, `ops::moe_quant_gate_up`, `ops::moe_quant_down_combine`) after
//! `moe_route`, in bf16, at each `--batch`: random blocks in the `--moe-type` mix (q4_k_m:
//! Q4_K gate/up, Q6_K down; or q8_0, q4_0, q4_k, q5_k, q6_k for all three), random logits
//! (the router GEMM and the shared experts are left out: `pagoda bench moe` times those).
//! Captured in a CUDA graph over `--sets` rotating input sets (weights copied until the sets
//! read at least 4x the L2), replayed `--replays` times: the median replay time per set,
//! against the bytes of the distinct experts the routing hit at `--copy-tb-s`.

use anyhow::{anyhow, bail, Result};
use half::bf16;
use pagoda_cuda::{view, view_mut, DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, DeviceRouter, MoeQ8, MoeWorkspace, QuantExperts, QuantFormat};

use super::bench_moe::BenchMoeArgs;
use super::bench_quant_gemv::random_blocks;
use super::decode_rig::{random_fill, time_replays, warm_capture, L2_BYTES};

/// The gate, up and down formats of `--moe-type`.
fn formats(moe_type: &str) -> Result<[QuantFormat; 3]> {
    let one = |f| [f, f, f];
    Ok(match moe_type {
        "q4_k_m" => [QuantFormat::Q4K, QuantFormat::Q4K, QuantFormat::Q6K],
        "q8_0" => one(QuantFormat::Q8_0),
        "q4_0" => one(QuantFormat::Q4_0),
        "q4_k" => one(QuantFormat::Q4K),
        "q5_k" => one(QuantFormat::Q5K),
        "q6_k" => one(QuantFormat::Q6K),
        other => bail!("--moe-type takes q4_k_m, q8_0, q4_0, q4_k, q5_k or q6_k, not {other}"),
    })
}

/// One rotating input set.
struct Set {
    x: DeviceBuffer<bf16>,
    logits: DeviceBuffer<f32>,
    workspace: MoeWorkspace<bf16>,
    q8: MoeQ8,
    residual: DeviceBuffer<f32>,
    copy: usize,
}

/// Runs `pagoda bench moe --moe-path quant`.
pub fn run(args: &BenchMoeArgs) -> Result<()> {
    if args.batch.is_empty() || args.batch.contains(&0) || args.replays == 0 || args.sets == 0 {
        bail!("--batch, --replays and --sets must be at least 1");
    }
    if args.dtype != "bf16" {
        bail!(
            "--moe-path quant runs in bf16 (the model's quantized path), not {}",
            args.dtype
        );
    }
    let kinds = formats(&args.moe_type)?;
    let config = pagoda_models::random::preset(&args.shape);
    let Some((config, moe)) = config.and_then(|c| c.moe.clone().map(|moe| (c, moe))) else {
        bail!("unknown MoE shape `{}`", args.shape);
    };
    let mut router = moe.router();
    router.num_experts = args.experts.unwrap_or(router.num_experts);
    router.top_k = args.top_k.unwrap_or(router.top_k);
    let router = DeviceRouter::from_router(&router).map_err(|e| anyhow!("{e}"))?;
    let (e, k) = (router.num_experts, router.top_k);
    let h = args.hidden.unwrap_or(config.hidden_size);
    let i = args.inter.unwrap_or(moe.expert_intermediate_size);
    for (format, cols) in [(kinds[0], h), (kinds[1], h), (kinds[2], i)] {
        if !cols.is_multiple_of(format.block_values()) {
            bail!("{format} rows of {cols} values are not whole blocks (hidden {h}, inter {i})");
        }
    }
    let expert_bytes = [kinds[0].row_bytes(h) * i, kinds[1].row_bytes(h) * i]
        .map(|b| b as f64)
        .into_iter()
        .sum::<f64>()
        + (kinds[2].row_bytes(i) * h) as f64;
    let layer_bytes = expert_bytes * e as f64;
    let copies = ((4 * L2_BYTES) as f64 / layer_bytes).ceil() as usize;
    let copies = copies.clamp(1, args.sets);
    let gpu = Gpu::new(0).map_err(|e| anyhow!("this command needs a CUDA GPU: {e}"))?;
    eprintln!(
        "moe {} quantized ({} gate, {} up, {} down): hidden {h}, {e} experts of {i}, top-{k}; \
         {} sets, {copies} weight copies of {:.2} GB",
        args.shape,
        kinds[0],
        kinds[1],
        kinds[2],
        args.sets,
        layer_bytes / 1e9
    );
    let mut seed = 300;
    let mut weights = Vec::with_capacity(copies);
    for _ in 0..copies {
        let mut projection = |format: QuantFormat, rows: usize, cols: usize| {
            seed += 1;
            let blocks = e * rows * cols / format.block_values();
            let mut bytes = random_blocks(format, blocks, seed);
            bytes.truncate(blocks * format.block_bytes());
            QuantExperts::upload(&gpu, format, &bytes, [e, rows, cols])
        };
        weights.push([
            projection(kinds[0], i, h)?,
            projection(kinds[1], i, h)?,
            projection(kinds[2], h, i)?,
        ]);
    }
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let mut sets = Vec::with_capacity(args.sets);
    for s in 0..args.sets {
        let workspace = MoeWorkspace::new(&gpu, &router, max_batch, h, i)?;
        sets.push(Set {
            x: random_fill(&gpu, max_batch * h, 400 + s as u64)?,
            logits: random_fill(&gpu, max_batch * e, 500 + s as u64)?,
            q8: MoeQ8::new(&gpu, &workspace)?,
            workspace,
            residual: gpu.zeros(max_batch * h)?,
            copy: s % copies,
        });
    }
    println!("| batch | median us | min us | distinct experts | weight MB | GB/s | x floor |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for &b in &args.batch {
        let mut record = |gpu: &Gpu| -> Result<(), pagoda_cuda::CudaError> {
            for set in sets.iter_mut() {
                let [gate, up, down] = &weights[set.copy];
                let logits = view(&set.logits, 0..b * e)?;
                ops::moe_route(gpu, &logits, &router, None, &mut set.workspace, b)?;
                let x = view(&set.x, 0..b * h)?;
                let (q8, workspace) = (&mut set.q8, &mut set.workspace);
                ops::moe_quant_gate_up(gpu, &x, [gate, up], q8, workspace, b)?;
                let mut residual = view_mut(&mut set.residual, 0..b * h)?;
                let none: Option<&DeviceBuffer<f32>> = None;
                ops::moe_quant_down_combine(gpu, down, q8, workspace, none, &mut residual, b)?;
            }
            Ok(())
        };
        let graph = warm_capture(&gpu, &mut record)?;
        let mut times = time_replays(&gpu, &graph, args.replays, sets.len())?;
        let (median, min) = super::bench_sampling::median_and_min(&mut times);
        let mut distinct = 0usize;
        for set in &sets {
            let offsets = gpu.download(&set.workspace.expert_offsets)?;
            distinct += offsets.windows(2).filter(|o| o[1] > o[0]).count();
        }
        let mean_distinct = distinct as f64 / sets.len() as f64;
        let bytes = mean_distinct * expert_bytes;
        let floor_us = bytes / (args.copy_tb_s * 1e6);
        println!(
            "| {b} | {median:.1} | {min:.1} | {mean_distinct:.1} | {:.1} | {:.0} | {:.2} |",
            bytes / 1e6,
            bytes / median / 1e3,
            median / floor_us
        );
    }
    Ok(())
}
