//! `pagoda bench attention --mla`: DeepSeek's absorbed latent-attention decode at the op level
//! (`pagoda_ops::cuda::mla_decode`), measured as the other attention paths are: a bf16 latent
//! pool (one row of `kv_lora_rank + qk_rope_head_dim` = 512 + 64 values per token) with random
//! contents, every request's pages drawn at random from a pool of at least 1 GB more than any
//! case; R rotating input sets (page tables and absorbed queries, at least 4x the L2 in all,
//! R <= 32) captured in one CUDA graph; the median replay time / R reported, with the
//! latent-cache bytes read per call (visible tokens x 1152 bytes) over that time.
//!
//! Paths: `mla` (CUDA cores), `mla-mma` (tensor cores: the heads are the MMA rows; two
//! tiles of 32 rows in flight, two CTAs per SM) and `mla-mma3` (three tiles, one CTA per SM),
//! each with its chunks merged by the generic log-sum-exp merge.

use anyhow::{bail, Result};
use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, LatentPool, MlaDecodeWorkspace, MlaKernel, PagedDecodePlan,
    PlanCapacity, PlanPolicy, PoolLayout, Queries, MLA_MMA_STAGES, MLA_ROPE_DIM,
};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::bench_attention::{BenchAttentionArgs, DEFAULT_PATHS};
use super::decode_rig::{random_pool, warm_capture, L2_BYTES};

/// DeepSeek-V2/V3's latent width.
const LATENT_DIM: usize = 512;
const ROW_DIM: usize = LATENT_DIM + MLA_ROPE_DIM;
/// The H200's measured device copy rate (anchors, table A), bytes per microsecond.
const COPY_BYTES_PER_US: f64 = 4203e3;

/// The kernel of an MLA path name.
pub fn mla_kernel(path: &str) -> Result<MlaKernel> {
    match path {
        "mla" => Ok(MlaKernel::CudaCore),
        "mla-mma" => Ok(MlaKernel::TensorCore {
            stages: MLA_MMA_STAGES,
        }),
        "mla-mma3" => Ok(MlaKernel::TensorCore { stages: 3 }),
        _ => bail!(
            "unknown MLA path `{path}`: use mla (CUDA cores), mla-mma (tensor cores, 2 stages) \
             or mla-mma3 (3 stages)"
        ),
    }
}

#[derive(Serialize)]
struct MlaPathResult {
    path: String,
    median_us: f64,
    min_us: f64,
    gb_per_s: f64,
    percent_of_copy: f64,
    chunks: usize,
    pages_per_chunk: usize,
}

#[derive(Serialize)]
struct MlaCaseResult {
    batch: usize,
    context: usize,
    cache_mb: f64,
    floor_us: f64,
    rotating_sets: usize,
    paths: Vec<MlaPathResult>,
}

/// One rotating input set: a page table and absorbed queries `[B, heads, 576]`.
struct InputSet {
    arrays: [DeviceBuffer<u32>; 4],
    q: DeviceBuffer<bf16>,
}

/// Runs the MLA decode cases of `args` over `paths` (`mla`, `mla-mma`).
/// Runs `pagoda bench attention --mla`: the MLA paths (`mla`, `mla-mma` by default).
pub fn run_args(args: &BenchAttentionArgs) -> Result<()> {
    if args.batch.contains(&0) || args.context.contains(&0) || args.replays == 0 {
        bail!("--batch, --context and --replays must be at least 1");
    }
    if args.prefill {
        bail!("--mla times the decode only");
    }
    let paths: Vec<String> = if args.paths.join(",") == DEFAULT_PATHS {
        vec!["mla".into(), "mla-mma".into()]
    } else {
        args.paths.clone()
    };
    run(args, &paths)
}

fn run(args: &BenchAttentionArgs, paths: &[String]) -> Result<()> {
    let kernels = paths
        .iter()
        .map(|p| mla_kernel(p))
        .collect::<Result<Vec<_>>>()?;
    let (heads, page_size) = (args.heads.q_heads, args.heads.page_size);
    let row_bytes = ROW_DIM * 2;
    let probe = PoolLayout {
        num_pages: 1,
        page_size,
        num_kv_heads: 1,
        head_dim: ROW_DIM,
    };
    if let Some(reason) = ops::mla_unsupported(pagoda_cuda::DType::BF16, &probe, heads, LATENT_DIM)
    {
        bail!("the MLA decode does not support this shape: {reason}");
    }
    let gpu = Gpu::new(0).map_err(|e| anyhow::anyhow!("this command needs a CUDA GPU: {e}"))?;
    let sm = gpu.info().sm_count as usize;
    let largest = args
        .batch
        .iter()
        .flat_map(|&b| args.context.iter().map(move |&l| b * l * row_bytes))
        .max()
        .unwrap_or(0);
    let page_bytes = page_size * row_bytes;
    let layout = PoolLayout {
        num_pages: (largest + (1 << 30)).div_ceil(page_bytes),
        ..probe
    };
    eprintln!(
        "latent pool: {} pages of {page_size} tokens ({:.1} GB), {heads} heads of {LATENT_DIM} + {MLA_ROPE_DIM}",
        layout.num_pages,
        (layout.num_pages * page_bytes) as f64 / 1e9
    );
    let pool = random_pool(&gpu, layout.pool_len(), 3)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let scale = 1.0 / 192f32.sqrt();
    let tiles = ops::mla_head_tiles(heads);
    let mut results = Vec::new();
    for &b in &args.batch {
        for &l in &args.context {
            let bytes = b * l * row_bytes;
            let q_len = b * heads * ROW_DIM;
            let sets = (4 * L2_BYTES).div_ceil(bytes + 2 * q_len).clamp(1, 32);
            let pages = l.div_ceil(page_size);
            let indptr: Vec<u32> = (0..=b).map(|r| (r * pages) as u32).collect();
            let last = vec![(l - (pages - 1) * page_size) as u32; b];
            let mut inputs = Vec::with_capacity(sets);
            for _ in 0..sets {
                let indices: Vec<u32> = (0..b * pages)
                    .map(|_| rng.random_range(0..layout.num_pages) as u32)
                    .collect();
                let q: Vec<bf16> = (0..q_len)
                    .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)))
                    .collect();
                inputs.push(InputSet {
                    arrays: [
                        gpu.upload(&indptr)?,
                        gpu.upload(&indices)?,
                        gpu.upload(&last)?,
                        gpu.zeros(b)?,
                    ],
                    q: gpu.upload(&q)?,
                });
            }
            let floor_us = bytes as f64 / COPY_BYTES_PER_US;
            let mut case_paths = Vec::new();
            for (name, &kernel) in paths.iter().zip(&kernels) {
                let policy = PlanPolicy {
                    target_ctas: args.target_ctas.unwrap_or(2 * sm),
                    pages_per_chunk: args.pages_per_chunk,
                    min_pages_per_chunk: args.min_chunk_keys.div_ceil(page_size).max(1),
                    // CTAs an SM holds: two of the CUDA-core kernel or the 2-stage MMA one.
                    resident_ctas: args.target_ctas.is_none().then_some(match kernel {
                        MlaKernel::TensorCore { stages: 3 } => sm,
                        _ => 2 * sm,
                    }),
                };
                let mut capacity = PlanCapacity::for_batch(b, tiles, policy.target_ctas);
                if let Some(fixed) = policy.pages_per_chunk {
                    capacity.max_chunks = capacity.max_chunks.max(b * pages.div_ceil(fixed));
                }
                let plan = PagedDecodePlan::new(&indptr, tiles, policy, capacity)?;
                let mut workspace = MlaDecodeWorkspace::new(&gpu, capacity, heads, LATENT_DIM)?;
                workspace.upload_plan(&gpu, &plan)?;
                workspace.set_kernel(kernel);
                let mut out = gpu.zeros::<bf16>(b * heads * LATENT_DIM)?;
                let mut record = |gpu: &Gpu| -> Result<(), pagoda_cuda::CudaError> {
                    for set in &inputs {
                        let [a, i, lp, f] = &set.arrays;
                        let table = DevicePageTable::new(a, i, lp, f)?;
                        let kv = LatentPool::new(&pool, layout, table, LATENT_DIM);
                        let queries = Queries::new(&set.q, heads, heads * ROW_DIM);
                        ops::mla_decode(gpu, &queries, &kv, &mut workspace, scale, &mut out)?;
                    }
                    Ok(())
                };
                let graph = warm_capture(&gpu, &mut record)?;
                let mut times = Vec::with_capacity(args.replays);
                for _ in 0..args.replays {
                    let start = gpu.record_event()?;
                    graph.launch()?;
                    let end = gpu.record_event()?;
                    times.push(start.elapsed_ms(&end)? as f64 * 1e3 / sets as f64);
                }
                let (median_us, min_us) = super::bench_sampling::median_and_min(&mut times);
                case_paths.push(MlaPathResult {
                    path: name.clone(),
                    median_us,
                    min_us,
                    gb_per_s: bytes as f64 / median_us / 1e3,
                    percent_of_copy: 100.0 * floor_us / median_us,
                    chunks: plan.num_chunks(),
                    pages_per_chunk: plan.pages_per_chunk,
                });
            }
            let case = MlaCaseResult {
                batch: b,
                context: l,
                cache_mb: bytes as f64 / 1e6,
                floor_us,
                rotating_sets: sets,
                paths: case_paths,
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

fn print_row(case: &MlaCaseResult, header: bool) {
    if header {
        let names: Vec<String> = case
            .paths
            .iter()
            .map(|p| {
                format!(
                    "{:>12} {:>6} {:>5} {:>6}",
                    format!("{} us", p.path),
                    "GB/s",
                    "%",
                    "chunks"
                )
            })
            .collect();
        println!(
            "{:>4} {:>6} {:>9} {:>8} {:>3} {}",
            "B",
            "L",
            "cache MB",
            "floor us",
            "R",
            names.join(" ")
        );
    }
    let cells: Vec<String> = case
        .paths
        .iter()
        .map(|p| {
            format!(
                "{:>12.1} {:>6.0} {:>5.0} {:>6}",
                p.median_us, p.gb_per_s, p.percent_of_copy, p.chunks
            )
        })
        .collect();
    println!(
        "{:>4} {:>6} {:>9.1} {:>8.1} {:>3} {}",
        case.batch,
        case.context,
        case.cache_mb,
        case.floor_us,
        case.rotating_sets,
        cells.join(" ")
    );
}
