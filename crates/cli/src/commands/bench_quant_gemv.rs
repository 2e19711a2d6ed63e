//! `pagoda bench quant-gemv`: the in-place quantized linear layer (`gemv_quant`, GGUF blocks
//! multiplied by q8 activations) alone, for each layout (`groups`, `units`), format, weight
//! shape and activation row count. The weights rotate over copies filling at least 4x the L2
//! (each call reads its matrix from memory, as a decode step does); the calls over all copies
//! are captured in one CUDA graph, replayed `--replays` times, each replay timed with CUDA
//! events: the median time per call is reported with the weight bytes read per second. The
//! activations are quantized once, outside the timing (`quantize_rows_q8` is a launch of its
//! own in the model).
//!
//! On the GPU machine: `pagoda bench quant-gemv` (Q4_K and Q6_K at Llama-3.1-8B's shapes, 1,
//! 2, 4 and 8 rows, both layouts), with `--json` for the machine-readable form.

use anyhow::{anyhow, bail, Result};
use clap::Args;
use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::{self as ops, Q8Rows, QuantFormat, QuantGemvKernel, QUANT_PADDING};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::decode_rig::{random_fill, time_replays, warm_capture, L2_BYTES};

/// Flags of `pagoda bench quant-gemv`.
#[derive(Args, Debug)]
pub struct BenchQuantGemvArgs {
    /// Weight formats (GGML names: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
    #[arg(long, value_delimiter = ',', default_value = "Q4_K,Q6_K")]
    pub types: Vec<String>,
    /// Weight shapes `ROWSxCOLS` (out x in features; default: Llama-3.1-8B's fused QKV, o,
    /// fused gate/up and down projections).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "6144x4096,4096x4096,28672x4096,4096x14336"
    )]
    pub shapes: Vec<String>,
    /// Activation rows per call (1-8).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1,2,4,8"
    )]
    pub batch: Vec<usize>,
    /// Layouts: groups, units (its rule for a warp's weight rows), units1, units2, units4.
    #[arg(long, value_delimiter = ',', default_value = "groups,units")]
    pub kernels: Vec<String>,
    /// Timed graph replays per figure (the median is reported).
    #[arg(long, default_value_t = 30)]
    pub replays: usize,
    /// Print one JSON object per figure instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Figure {
    format: String,
    rows: usize,
    cols: usize,
    batch: usize,
    kernel: String,
    us: f64,
    gb_s: f64,
}

/// Runs `pagoda bench quant-gemv`.
pub fn run(args: BenchQuantGemvArgs) -> Result<()> {
    if args.replays == 0 {
        bail!("--replays must be at least 1");
    }
    let gpu = Gpu::new(0).map_err(|e| anyhow!("this command needs a CUDA GPU: {e}"))?;
    let kernels = args
        .kernels
        .iter()
        .map(|name| match name.as_str() {
            "groups" => Ok(QuantGemvKernel::Groups),
            "units" => Ok(QuantGemvKernel::UNITS),
            "units1" => Ok(QuantGemvKernel::Units { warp_rows: Some(1) }),
            "units2" => Ok(QuantGemvKernel::Units { warp_rows: Some(2) }),
            "units4" => Ok(QuantGemvKernel::Units { warp_rows: Some(4) }),
            other => {
                bail!("--kernels: {other:?} is not one of groups, units, units1, units2, units4")
            }
        })
        .collect::<Result<Vec<_>>>()?;
    if !args.json {
        println!("| format | shape | rows | kernel | us / call | GB/s |");
        println!("| --- | --- | --- | --- | --- | --- |");
    }
    for name in &args.types {
        let format = QuantFormat::ALL
            .into_iter()
            .find(|f| f.to_string().eq_ignore_ascii_case(name))
            .ok_or_else(|| anyhow!("--types: {name:?} is not a format the GPU keeps"))?;
        for shape in &args.shapes {
            let (n, k) = parse_shape(shape)?;
            if k % format.block_values() != 0 {
                bail!("{shape}: {k} is not a multiple of {format}'s block");
            }
            let bytes = n * format.row_bytes(k);
            let copies = (4 * L2_BYTES).div_ceil(bytes).max(2);
            let host = random_blocks(format, n * k / format.block_values(), 7);
            let weights = (0..copies)
                .map(|_| gpu.upload(&host))
                .collect::<Result<Vec<DeviceBuffer<u8>>, _>>()?;
            let x = random_fill::<bf16>(&gpu, 8 * k, 11)?;
            let mut q8 = Q8Rows::new(&gpu, 8, k)?;
            let mut out = gpu.zeros::<bf16>(8 * n)?;
            for &m in &args.batch {
                if !(1..=ops::QUANT_GEMV_MAX_ROWS).contains(&m) {
                    bail!("--batch: {m} is not 1..={}", ops::QUANT_GEMV_MAX_ROWS);
                }
                ops::quantize_rows_q8(&gpu, &pagoda_cuda::view(&x, 0..m * k)?, &mut q8, (m, k))?;
                for (kernel, kernel_name) in kernels.iter().zip(&args.kernels) {
                    let graph = warm_capture(&gpu, &mut |gpu: &Gpu| {
                        for w in &weights {
                            ops::gemv_quant(gpu, *kernel, format, w, &q8, &mut out, n, n, 0.0)?;
                        }
                        Ok(())
                    })?;
                    let mut times = time_replays(&gpu, &graph, args.replays, copies)?;
                    times.sort_by(f64::total_cmp);
                    let us = times[times.len() / 2];
                    let figure = Figure {
                        format: format.to_string(),
                        rows: n,
                        cols: k,
                        batch: m,
                        kernel: kernel_name.clone(),
                        us,
                        gb_s: bytes as f64 / us / 1e3,
                    };
                    if args.json {
                        println!("{}", serde_json::to_string(&figure)?);
                    } else {
                        println!(
                            "| {} | {n}x{k} | {m} | {} | {:.2} | {:.0} |",
                            figure.format, figure.kernel, figure.us, figure.gb_s
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

fn parse_shape(text: &str) -> Result<(usize, usize)> {
    let parsed = text
        .split_once('x')
        .and_then(|(rows, cols)| Some((rows.parse().ok()?, cols.parse().ok()?)));
    match parsed {
        Some((rows, cols)) if rows > 0 && cols > 0 => Ok((rows, cols)),
        _ => bail!("--shapes: {text:?} is not ROWSxCOLS"),
    }
}

/// `blocks` random blocks of `format` (then [`QUANT_PADDING`] bytes) whose f16 scales are
/// small and finite (the timing depends only on the values being ordinary numbers).
pub(super) fn random_blocks(format: QuantFormat, blocks: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let size = format.block_bytes();
    let mut out = vec![0u8; blocks * size + QUANT_PADDING];
    rng.fill(&mut out[..]);
    let scales: &[usize] = match format {
        QuantFormat::Q4_1 | QuantFormat::Q5_1 | QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q6K => &[208],
        _ => &[0],
    };
    for block in out.chunks_exact_mut(size) {
        for &at in scales {
            let scale = half::f16::from_f32(rng.random_range(0.001..0.02));
            block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    out
}
