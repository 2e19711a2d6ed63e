//! `pagoda bench kernels`: the CPU kernels at the op level, each kernel set (or attention
//! kernel) this CPU runs side by side on the same inputs.
//!
//! - `matmul`: `Weight::matmul` of random weights in each stored format and shape, for each
//!   kernel set (`amx`, `vnni8`, `vnni`, `avx2`, `neon_dotprod`, `neon`, `scalar`, `f32`), at
//!   several token counts; the `f32` column is headed `f32 (NEON tiles)` where the f32 tiles
//!   run NEON (aarch64).
//! - `attention`: one decode row of the default model's geometry over the paged cache at
//!   several depths, on each chunk kernel (`avx512`, `avx2`, `neon`, `scalar`).
//!
//! Inputs rotate over copies (weights over [`COPIES`], the KV pool over 30 layer copies, as a
//! decode step reads them) so that no call finds the previous one's data in cache; each
//! figure is the median of `--rounds` timed calls after one warm-up call. The AMX tiles'
//! prefill choice is process-wide: run once with `PAGODA_CPU_AMX_PREFILL=bf16` to time the
//! BF16 tiles instead of INT8.

use anyhow::{bail, Result};
use clap::Args;
use pagoda_kv::{PageId, PageTable, PageTableRequest};
use pagoda_ops::attention::{
    plan_step, step_attention, AttentionKernel, KvLayout, PagedKv, QueryBatch, SplitKvChunking,
    StepAttentionConfig, StepWorkspace, DEFAULT_CHUNK_TOKENS,
};
use pagoda_ops::linear::{CpuKernels, Weight};
use pagoda_tensor::GgmlType;
use rand::{Rng, SeedableRng};

/// Weight copies the matmul rotates over.
const COPIES: usize = 4;
/// Layer copies of the KV pool the attention rotates over (a decode step's reads).
const LAYERS: usize = 30;

/// Flags of `pagoda bench kernels`.
#[derive(Args, Debug)]
pub struct BenchKernelsArgs {
    /// Ops to time: matmul, attention.
    #[arg(long, value_delimiter = ',', default_value = "matmul,attention")]
    pub ops: Vec<String>,
    /// Stored weight formats (GGML names).
    #[arg(long, value_delimiter = ',', default_value = "Q4_1,Q8_0,Q4_K,Q6_K")]
    pub types: Vec<String>,
    /// Matmul shapes `ROWSxCOLS` (out x in features; default: the default model's q, k/v,
    /// gate and down projections).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "576x576,192x576,1536x576,576x1536"
    )]
    pub shapes: Vec<String>,
    /// Activation rows (tokens) per matmul.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    pub tokens: Vec<usize>,
    /// Kernel sets to time (default: every set this CPU runs).
    #[arg(long, value_delimiter = ',')]
    pub kernels: Vec<String>,
    /// Visible tokens of the attention's decode row.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
    pub depths: Vec<usize>,
    /// Timed calls per figure (the median is reported).
    #[arg(long, default_value_t = 9)]
    pub rounds: usize,
}

/// Runs `pagoda bench kernels`.
pub fn run(args: BenchKernelsArgs) -> Result<()> {
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    for op in &args.ops {
        match op.as_str() {
            "matmul" => matmul(&args)?,
            "attention" => attention(&args)?,
            other => bail!("--ops: {other:?} is not one of matmul, attention"),
        }
    }
    Ok(())
}

/// Median milliseconds of `rounds` calls of `f(round)` after one warm-up call (the mean of
/// the two middle calls for an even count; NaN for no rounds, which `run` refuses).
fn median_ms(rounds: usize, f: &mut dyn FnMut(usize)) -> f64 {
    f(rounds);
    let times: Vec<f64> = (0..rounds)
        .map(|round| {
            let start = std::time::Instant::now();
            f(round);
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    super::stats::median(&times).unwrap_or(f64::NAN)
}

fn parse_type(name: &str) -> Result<GgmlType> {
    let all = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];
    all.into_iter()
        .find(|ty| ty.name().eq_ignore_ascii_case(name.trim()))
        .ok_or_else(|| {
            let names: Vec<String> = all.iter().map(|ty| ty.name()).collect();
            anyhow::anyhow!("--types: {name:?} is not one of {}", names.join(", "))
        })
}

fn parse_shape(text: &str) -> Result<(usize, usize)> {
    let parsed = text
        .split_once('x')
        .and_then(|(rows, cols)| Some((rows.trim().parse().ok()?, cols.trim().parse().ok()?)));
    match parsed {
        Some((rows, cols)) if rows > 0 && cols > 0 => Ok((rows, cols)),
        _ => bail!("--shapes: {text:?} is not ROWSxCOLS (e.g. 576x1536)"),
    }
}

/// Byte offsets of the f16 scale fields in one block of `ty` (the rest of a block is any
/// bytes: quants, packed sub-scales).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        _ => &[0],
    }
}

/// `rows` random stored rows of `ty`, `cols` values each, with small finite scales.
fn random_rows(ty: GgmlType, rows: usize, cols: usize, rng: &mut impl Rng) -> Vec<u8> {
    let (block, bytes) = (ty.block_size().unwrap_or(1), ty.type_size().unwrap_or(4));
    let blocks = rows * cols / block;
    let mut out: Vec<u8> = (0..blocks * bytes).map(|_| rng.random()).collect();
    for chunk in out.chunks_exact_mut(bytes) {
        for &at in scale_offsets(ty) {
            let scale = half::f16::from_f32(rng.random_range(0.001..0.02));
            chunk[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    out
}

fn kernel_sets(args: &BenchKernelsArgs) -> Result<Vec<CpuKernels>> {
    if args.kernels.is_empty() {
        return Ok([
            CpuKernels::Amx,
            CpuKernels::Vnni8,
            CpuKernels::Vnni,
            CpuKernels::Avx2,
            CpuKernels::NeonDot,
            CpuKernels::Neon,
            CpuKernels::Scalar,
            CpuKernels::F32,
        ]
        .into_iter()
        .filter(|set| set.is_supported())
        .collect());
    }
    args.kernels
        .iter()
        .map(|name| {
            let set = CpuKernels::parse(name).map_err(|e| anyhow::anyhow!("--kernels: {e}"))?;
            if !set.is_supported() {
                bail!("--kernels: this CPU does not run {}", set.name());
            }
            Ok(set)
        })
        .collect()
}

fn matmul(args: &BenchKernelsArgs) -> Result<()> {
    let types = args
        .types
        .iter()
        .map(|name| parse_type(name))
        .collect::<Result<Vec<_>>>()?;
    let shapes = args
        .shapes
        .iter()
        .map(|text| parse_shape(text))
        .collect::<Result<Vec<_>>>()?;
    let sets = kernel_sets(args)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    println!(
        "matmul: median of {} calls, weights rotated over {COPIES} copies; ms per call \
         (one token: GB/s of weights read; more: GFLOP/s)",
        args.rounds
    );
    let neon_f32 = cfg!(target_arch = "aarch64") && pagoda_ops::linear::cpu::f32_tile::fused();
    let header: Vec<String> = sets
        .iter()
        .map(|&set| match set {
            CpuKernels::F32 if neon_f32 => "f32 (NEON tiles)".to_string(),
            set => set.name().to_string(),
        })
        .collect();
    println!("| weight | shape | tokens | {} |", header.join(" | "));
    println!("| --- | --- | ---: |{}", " ---: |".repeat(sets.len()));
    for &ty in &types {
        for &(rows, cols) in &shapes {
            let block = ty.block_size().unwrap_or(1);
            if !cols.is_multiple_of(block) {
                println!("| {} | {rows}x{cols} | - | skipped: {cols} columns are not whole {block}-value blocks |", ty.name());
                continue;
            }
            let stored: Vec<Vec<u8>> = (0..COPIES)
                .map(|_| random_rows(ty, rows, cols, &mut rng))
                .collect();
            let weights: Vec<Vec<Weight>> = sets
                .iter()
                .map(|&set| {
                    stored
                        .iter()
                        .map(|bytes| Weight::with_kernels(ty, rows, cols, bytes.clone(), set))
                        .collect::<Result<Vec<_>, _>>()
                })
                .collect::<Result<Vec<_>, _>>()?;
            let weight_bytes = stored[0].len() as f64;
            for &tokens in &args.tokens {
                let xs: Vec<Vec<f32>> = (0..COPIES)
                    .map(|_| {
                        (0..tokens * cols)
                            .map(|_| rng.random_range(-2.0..2.0))
                            .collect()
                    })
                    .collect();
                let mut y = vec![0f32; tokens * rows];
                let cells: Vec<String> = weights
                    .iter()
                    .map(|copies| {
                        let ms = median_ms(args.rounds, &mut |round| {
                            let i = round % COPIES;
                            copies[i].matmul(&xs[i], tokens, &mut y)
                        });
                        let rate = if tokens == 1 {
                            weight_bytes / ms / 1e6
                        } else {
                            (2 * rows * cols * tokens) as f64 / ms / 1e6
                        };
                        format!("{ms:.3} ({rate:.1})")
                    })
                    .collect();
                println!(
                    "| {} | {rows}x{cols} | {tokens} | {} |",
                    ty.name(),
                    cells.join(" | ")
                );
            }
        }
    }
    Ok(())
}

/// One layer's K and V pools over `table`.
fn paged<'a>(
    (k_pool, v_pool): &'a (Vec<f32>, Vec<f32>),
    layout: KvLayout,
    table: &'a PageTable,
) -> PagedKv<'a> {
    PagedKv {
        k_pool: k_pool.as_slice().into(),
        v_pool: v_pool.as_slice().into(),
        layout,
        page_table: table,
    }
}

fn attention(args: &BenchKernelsArgs) -> Result<()> {
    // The default model's geometry: 9 query heads over 3 KV heads of 64.
    let (q_heads, kv_heads, head_dim, page_size) = (9usize, 3usize, 64usize, 16usize);
    let kernels: Vec<AttentionKernel> = [
        AttentionKernel::Avx512,
        AttentionKernel::Avx2,
        AttentionKernel::Neon,
        AttentionKernel::Scalar,
    ]
    .into_iter()
    .filter(|kernel| kernel.is_supported())
    .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    println!();
    println!("attention: one decode row, {q_heads} query / {kv_heads} KV heads of {head_dim}, pages of {page_size} in reverse order, {LAYERS} layer copies; ms per {LAYERS}-layer step (GB/s of K and V read), median of {} steps", args.rounds);
    let names: Vec<&str> = kernels.iter().map(|kernel| kernel.name()).collect();
    println!("| depth | {} |", names.join(" | "));
    println!("| ---: |{}", " ---: |".repeat(kernels.len()));
    for &depth in &args.depths {
        if depth == 0 {
            bail!("--depths: a depth of 0 has nothing to attend to");
        }
        let num_pages = depth.div_ceil(page_size);
        let pages: Vec<PageId> = (0..num_pages as u32).rev().map(PageId).collect();
        let table = PageTable::build(
            &[PageTableRequest {
                pages: &pages,
                num_tokens: depth,
                logical_start: 0,
            }],
            num_pages,
            page_size,
        )?;
        let layout = KvLayout {
            num_pages,
            page_size,
            num_kv_heads: kv_heads,
            head_dim,
        };
        let pool_len = num_pages * page_size * kv_heads * head_dim;
        let mut random_pool =
            || -> Vec<f32> { (0..pool_len).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let layers: Vec<(Vec<f32>, Vec<f32>)> = (0..LAYERS)
            .map(|_| (random_pool(), random_pool()))
            .collect();
        let q: Vec<f32> = (0..q_heads * head_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let qo_indptr = [0u32, 1];
        let queries = QueryBatch {
            q: &q,
            qo_indptr: &qo_indptr,
            num_q_heads: q_heads,
        };
        let config = StepAttentionConfig {
            chunking: SplitKvChunking::new(kv_heads, DEFAULT_CHUNK_TOKENS),
            min_split_kv_tokens: 0,
        };
        let plan = plan_step(
            &paged(&layers[0], layout, &table),
            &qo_indptr,
            q_heads,
            &config,
        )?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut cells = Vec::new();
        for &kernel in &kernels {
            let plan = plan.clone().with_kernel(kernel);
            let mut workspace = StepWorkspace::default();
            let mut out = vec![0f32; q_heads * head_dim];
            let ms = median_ms(args.rounds, &mut |_| {
                for layer in &layers {
                    step_attention(
                        &paged(layer, layout, &table),
                        &queries,
                        &plan,
                        scale,
                        &mut workspace,
                        &mut out,
                    )
                    .expect("a validated plan runs");
                }
            });
            let bytes = (LAYERS * 2 * depth * kv_heads * head_dim * 4) as f64;
            cells.push(format!("{ms:.3} ({:.1})", bytes / ms / 1e6));
        }
        println!("| {depth} | {} |", cells.join(" | "));
    }
    Ok(())
}
