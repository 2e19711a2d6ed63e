//! `pagoda bench attention`: the decode attention kernels at the op level, measured the way
//! the peer anchors were (`shared/anchors/gpu-anchors.md`, table B): bf16 KV pools with
//! random contents, every request's pages drawn at random from a large pool; each case
//! captured in one CUDA graph together with R rotating input sets (different page tables and
//! queries, at least 4x the L2 in all, R <= 32); the graph replayed many times, each replay
//! timed with CUDA events; reported: median replay time / R. The floor is the KV bytes at
//! the H200's measured copy rate (4203 GB/s).
//!
//! Paths: `gather` (copy the pages, then attend: the baseline), `fused` (split-KV over the
//! page table on CUDA cores, merged in the same launch), `fused-separate` (merged by a second
//! launch), `fused-mma` and `fused-mma-separate` (the same on tensor cores).

use anyhow::{bail, Context, Result};
use clap::Args;
use half::bf16;
use pagoda_cuda::{view_mut, DeviceBuffer, Gpu};
use pagoda_ops::cuda::{
    self as ops, DecodeWorkspace, DevicePageTable, MergeMode, PagedDecodeKernel, PagedDecodePlan,
    PagedDecodeWorkspace, PagedKv, PlanCapacity, PlanPolicy, PoolLayout, Queries,
};
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// The H200's measured device copy rate (anchors, table A), bytes per microsecond.
const COPY_BYTES_PER_US: f64 = 4203e3;
/// The L2 of an H200; rotating inputs add up to at least four times this.
const L2_BYTES: usize = 60 << 20;

/// Flags of `pagoda bench attention`.
#[derive(Args, Debug)]
pub struct BenchAttentionArgs {
    /// Requests per decode step (comma-separated).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1,4,16,64"
    )]
    pub batch: Vec<usize>,
    /// Tokens of context per request (comma-separated).
    #[arg(
        short = 'l',
        long = "context",
        value_delimiter = ',',
        default_value = "1024,4096,16384,32768"
    )]
    pub context: Vec<usize>,
    /// Paths to time: gather, fused, fused-separate, fused-mma, fused-mma-separate.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gather,fused-separate,fused-mma,fused-mma-separate"
    )]
    pub paths: Vec<String>,
    /// Query heads (Llama-3.1-8B: 32).
    #[arg(long, default_value_t = 32)]
    pub q_heads: usize,
    /// KV heads (Llama-3.1-8B: 8).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Elements per head.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Tokens per page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// CTAs the fused plan aims for (default: twice the SM count).
    #[arg(long)]
    pub target_ctas: Option<usize>,
    /// The smallest chunk the plan's search may choose, in keys (the model uses 64).
    #[arg(long, default_value_t = 64)]
    pub min_chunk_keys: usize,
    /// A fixed fused chunk size in pages (default: the plan's search).
    #[arg(long)]
    pub pages_per_chunk: Option<usize>,
    /// Graph replays per case (the median is reported).
    #[arg(short = 'n', long, default_value_t = 50)]
    pub replays: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct PathResult {
    path: String,
    median_us: f64,
    min_us: f64,
    gb_per_s: f64,
    percent_of_copy: f64,
}

#[derive(Serialize)]
struct CaseResult {
    batch: usize,
    context: usize,
    kv_mb: f64,
    floor_us: f64,
    rotating_sets: usize,
    chunks: usize,
    pages_per_chunk: usize,
    paths: Vec<PathResult>,
}

/// One rotating input set: a page table and queries.
struct InputSet {
    arrays: [DeviceBuffer<u32>; 4],
    q: DeviceBuffer<bf16>,
}

/// Runs `pagoda bench attention`.
pub fn run(args: BenchAttentionArgs) -> Result<()> {
    if args.batch.contains(&0) || args.context.contains(&0) || args.replays == 0 {
        bail!("--batch, --context and --replays must be at least 1");
    }
    for path in &args.paths {
        if !matches!(
            path.as_str(),
            "gather" | "fused" | "fused-separate" | "fused-mma" | "fused-mma-separate"
        ) {
            bail!(
                "unknown path `{path}`: use gather, fused, fused-separate, fused-mma or \
                 fused-mma-separate"
            );
        }
    }
    let gpu = Gpu::new(0).context("pagoda bench attention needs a CUDA GPU")?;
    let layout_for = |num_pages| PoolLayout {
        num_pages,
        page_size: args.page_size,
        num_kv_heads: args.kv_heads,
        head_dim: args.head_dim,
    };
    if let Some(reason) =
        ops::paged_decode_unsupported(pagoda_cuda::DType::BF16, &layout_for(1), args.q_heads)
    {
        bail!("the fused decode does not support this shape: {reason}");
    }
    let page_bytes = args.page_size * args.kv_heads * args.head_dim * 2;
    let kv_bytes = |b: usize, l: usize| b * l.div_ceil(args.page_size) * page_bytes * 2;
    let largest = args
        .batch
        .iter()
        .flat_map(|&b| args.context.iter().map(move |&l| kv_bytes(b, l)))
        .max()
        .unwrap_or(0);
    // A pool larger than any one case (per side), at least 1 GB, so pages rarely repeat.
    let pool_pages = (largest / 2 + (1 << 30)).div_ceil(page_bytes);
    let layout = layout_for(pool_pages);
    eprintln!(
        "pool: {pool_pages} pages of {} tokens ({:.1} GB for K and V)",
        args.page_size,
        2.0 * (pool_pages * page_bytes) as f64 / 1e9
    );
    let k_pool = random_pool(&gpu, layout.pool_len(), 1)?;
    let v_pool = random_pool(&gpu, layout.pool_len(), 2)?;
    let sm = gpu.info().sm_count as usize;
    let target_ctas = args.target_ctas.unwrap_or(2 * sm);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut results = Vec::new();
    for &b in &args.batch {
        for &l in &args.context {
            let bytes = kv_bytes(b, l);
            let sets = (4 * L2_BYTES).div_ceil(bytes).clamp(1, 32);
            let pages = l.div_ceil(args.page_size);
            let indptr: Vec<u32> = (0..=b).map(|r| (r * pages) as u32).collect();
            let last = vec![(l - (pages - 1) * args.page_size) as u32; b];
            let inputs: Vec<InputSet> = (0..sets)
                .map(|_| {
                    let indices: Vec<u32> = (0..b * pages)
                        .map(|_| rng.random_range(0..pool_pages) as u32)
                        .collect();
                    let q: Vec<bf16> = (0..b * args.q_heads * args.head_dim)
                        .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)))
                        .collect();
                    Ok(InputSet {
                        arrays: [
                            gpu.upload(&indptr)?,
                            gpu.upload(&indices)?,
                            gpu.upload(&last)?,
                            gpu.zeros(b)?,
                        ],
                        q: gpu.upload(&q)?,
                    })
                })
                .collect::<Result<_, pagoda_cuda::CudaError>>()?;
            let policy = PlanPolicy {
                target_ctas,
                pages_per_chunk: args.pages_per_chunk,
                min_pages_per_chunk: args.min_chunk_keys.div_ceil(args.page_size),
            };
            let mut capacity = PlanCapacity::for_batch(b, args.kv_heads, target_ctas);
            if let Some(fixed) = args.pages_per_chunk {
                capacity.max_chunks = capacity.max_chunks.max(b * pages.div_ceil(fixed));
            }
            let plan = PagedDecodePlan::new(&indptr, args.kv_heads, policy, capacity)?;
            let mut fused = PagedDecodeWorkspace::new(
                &gpu,
                capacity,
                args.q_heads,
                args.kv_heads,
                args.head_dim,
            )?;
            fused.upload_plan(&gpu, &plan)?;
            let mut out = gpu.zeros::<bf16>(b * args.q_heads * args.head_dim)?;
            let scale = 1.0 / (args.head_dim as f32).sqrt();
            let floor_us = bytes as f64 / COPY_BYTES_PER_US;
            let mut paths = Vec::new();
            for path in &args.paths {
                let mut gather = if path == "gather" {
                    Some(DecodeWorkspace::<bf16>::new(
                        &gpu,
                        &layout,
                        args.q_heads,
                        b,
                        b * pages,
                    )?)
                } else {
                    None
                };
                let splits = ops::decode_splits(b, args.kv_heads, sm);
                fused.set_kernel(if path.starts_with("fused-mma") {
                    PagedDecodeKernel::TensorCore
                } else {
                    PagedDecodeKernel::CudaCore
                });
                let mut record = |gpu: &Gpu| -> Result<(), pagoda_cuda::CudaError> {
                    for set in &inputs {
                        let [a, i, lp, f] = &set.arrays;
                        let table = DevicePageTable::new(a, i, lp, f)?;
                        let queries =
                            Queries::new(&set.q, args.q_heads, args.q_heads * args.head_dim);
                        let kv = PagedKv::new(&k_pool, &v_pool, layout, table);
                        match (path.as_str(), gather.as_mut()) {
                            ("gather", Some(workspace)) => ops::decode_attention_gathered(
                                gpu, &queries, &kv, workspace, splits, scale, &mut out,
                            )?,
                            (other, _) => ops::paged_decode_attention(
                                gpu,
                                &queries,
                                &kv,
                                &mut fused,
                                if other.ends_with("separate") {
                                    MergeMode::Separate
                                } else {
                                    MergeMode::InKernel
                                },
                                scale,
                                &mut out,
                            )?,
                        }
                    }
                    Ok(())
                };
                // Warm up (compiles the kernels outside the capture), then capture.
                record(&gpu)?;
                gpu.synchronize()?;
                let graph = gpu.capture(&mut record)?;
                graph.launch()?;
                gpu.synchronize()?;
                let mut times = Vec::with_capacity(args.replays);
                for _ in 0..args.replays {
                    let start = gpu.record_event()?;
                    graph.launch()?;
                    let end = gpu.record_event()?;
                    times.push(start.elapsed_ms(&end)? as f64 * 1e3 / sets as f64);
                }
                let (median_us, min_us) = super::bench_sampling::median_and_min(&mut times);
                paths.push(PathResult {
                    path: path.clone(),
                    median_us,
                    min_us,
                    gb_per_s: bytes as f64 / median_us / 1e3,
                    percent_of_copy: 100.0 * floor_us / median_us,
                });
            }
            let case = CaseResult {
                batch: b,
                context: l,
                kv_mb: bytes as f64 / 1e6,
                floor_us,
                rotating_sets: sets,
                chunks: plan.num_chunks(),
                pages_per_chunk: plan.pages_per_chunk,
                paths,
            };
            if !args.json {
                print_row(&case, results.is_empty());
            }
            results.push(case);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    Ok(())
}

/// A pool of `len` bf16 values: a 32 MB block of uniform values in [-1, 1) uploaded once and
/// copied over the whole pool on the device (the timing does not depend on the values, only
/// on them being ordinary numbers).
fn random_pool(gpu: &Gpu, len: usize, seed: u64) -> Result<DeviceBuffer<bf16>> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let block_len = (16usize << 20).min(len);
    let block: Vec<bf16> = (0..block_len)
        .map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)))
        .collect();
    let block = gpu.upload(&block)?;
    let mut pool = gpu.alloc::<bf16>(len)?;
    let mut start = 0;
    while start < len {
        let end = (start + block_len).min(len);
        let mut target = view_mut(&mut pool, start..end)?;
        let source = pagoda_cuda::view(&block, 0..end - start)?;
        gpu.copy(&source, &mut target)?;
        start = end;
    }
    gpu.synchronize()?;
    Ok(pool)
}

fn print_row(case: &CaseResult, header: bool) {
    if header {
        let names: Vec<String> = case
            .paths
            .iter()
            .map(|p| format!("{:>14} {:>6} {:>5}", format!("{} us", p.path), "GB/s", "%"))
            .collect();
        println!(
            "{:>3} {:>6} {:>8} {:>8} {:>3} {:>6} {:>4} {}",
            "B",
            "L",
            "KV MB",
            "floor us",
            "R",
            "chunks",
            "ppc",
            names.join(" ")
        );
    }
    let cells: Vec<String> = case
        .paths
        .iter()
        .map(|p| {
            format!(
                "{:>14.1} {:>6.0} {:>5.0}",
                p.median_us, p.gb_per_s, p.percent_of_copy
            )
        })
        .collect();
    println!(
        "{:>3} {:>6} {:>8.1} {:>8.1} {:>3} {:>6} {:>4} {}",
        case.batch,
        case.context,
        case.kv_mb,
        case.floor_us,
        case.rotating_sets,
        case.chunks,
        case.pages_per_chunk,
        cells.join(" ")
    );
}
