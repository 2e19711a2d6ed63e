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
//! launch), `fused-mma` and `fused-mma-separate` (the same on WMMA tensor cores),
//! `stream-64x3` ... (the streaming tensor-core kernel, tiles of 64 or 128 keys in 2 to 6
//! stages; `-separate` merges by a second launch), `tuned` (what `pagoda tune`'s table, or the
//! built-in heuristic where it has no row, runs for the case).
//!
//! With `--mla`, `pagoda bench` runs DeepSeek's latent-attention decode instead
//! (`bench_attention_mla`), paths
//! `mla` and `mla-mma`.

use anyhow::{bail, Result};
use clap::Args;
use pagoda_ops::cuda::{
    DecodeVariant, MergeMode, PagedDecodeKernel, PrefillKernel, PrefillStreamTiling, StreamTiling,
};
use serde::Serialize;

use super::decode_rig::{DecodePath, Geometry, QueryRows, Rig};

/// The H200's measured device copy rate (anchors, table A), bytes per microsecond.
const COPY_BYTES_PER_US: f64 = 4203e3;

/// The decode paths timed when `--paths` is not given.
pub(super) const DEFAULT_PATHS: &str = "gather,fused-mma-separate,stream-64x3-separate,tuned";

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
    /// Paths to time: gather, tuned (the tuning table's choice for each case, else the
    /// built-in heuristic), fused, fused-mma, stream-64x3, stream-64x2, stream-64x4,
    /// stream-64x6, stream-128x3, each fused one also with `-separate`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = DEFAULT_PATHS
    )]
    pub paths: Vec<String>,
    /// Heads and page size.
    #[command(flatten)]
    pub heads: Geometry,
    /// CTAs the fused plan aims for (default: `--waves`, or the tuned variant's).
    #[arg(long)]
    pub target_ctas: Option<usize>,
    /// The named paths' CTA target in waves of one CTA per SM (0: the plan fitted to the
    /// kernel's resident CTAs, the streaming kernels' default).
    #[arg(long, default_value_t = 0)]
    pub waves: usize,
    /// The smallest chunk the plan's search may choose, in keys (the model uses 64).
    #[arg(long, default_value_t = 64)]
    pub min_chunk_keys: usize,
    /// A fixed fused chunk size in pages (default: the plan's search).
    #[arg(long)]
    pub pages_per_chunk: Option<usize>,
    /// Graph replays per case (the median is reported).
    #[arg(short = 'n', long, default_value_t = 50)]
    pub replays: usize,
    /// Time the prefill attention instead: every token of every request queries its prompt
    /// (causal), paths `prefill-stream` and `prefill-mma` (tensor cores, the default pair),
    /// `prefill-stream-RxKxS` (a streaming tiling: R rows, K-key tiles, S stages) and
    /// `prefill-tiled`.
    #[arg(long)]
    pub prefill: bool,
    /// Time DeepSeek's absorbed MLA decode instead: a bf16 latent pool of 512 + 64 values per
    /// token, `--q-heads` heads (DeepSeek-V2-Lite: 16), paths `mla` (CUDA cores),
    /// `mla-mma` (tensor cores, the default pair with `mla`) and `mla-mma3` (3 stages);
    /// `--kv-heads` and `--head-dim` do not apply.
    #[arg(long)]
    pub mla: bool,
    /// KV cache dtype of the decode and prefill paths: `bf16`, or `fp8` (e4m3 with one f32
    /// scale per token and KV head, quantized from the same random pools; paths `fused`,
    /// `fused-separate` and `prefill-tiled` only; the floor counts its bytes).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "fp8"])]
    pub kv_dtype: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct PathResult {
    path: String,
    /// The fused variant run (for `tuned`: the table's or the heuristic's choice).
    variant: Option<String>,
    median_us: f64,
    min_us: f64,
    gb_per_s: f64,
    percent_of_copy: f64,
    /// Prefill: attention TFLOP/s (4 x the causal query-key pairs x heads x head_dim).
    tflops: Option<f64>,
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

/// Runs `pagoda bench attention`.
pub fn run(args: BenchAttentionArgs) -> Result<()> {
    if args.batch.contains(&0) || args.context.contains(&0) || args.replays == 0 {
        bail!("--batch, --context and --replays must be at least 1");
    }
    let paths: Vec<String> = if args.prefill && args.paths.join(",") == DEFAULT_PATHS {
        vec!["prefill-stream".into(), "prefill-mma".into()]
    } else {
        args.paths.clone()
    };
    for path in &paths {
        match (args.prefill, prefill_kernel(path)) {
            (true, Some(_)) => {}
            (true, None) => {
                let tilings = PrefillStreamTiling::ALL.map(|t| format!("prefill-stream-{t}"));
                bail!(
                    "--prefill times prefill-stream, {}, prefill-mma or prefill-tiled, not `{path}`",
                    tilings.join(", ")
                )
            }
            (false, Some(_)) => bail!("`{path}` is a prefill path: add --prefill"),
            (false, None) if path == "gather" || path == "tuned" => {}
            (false, None) => {
                fused_path(path)?;
            }
        }
    }
    let geometry = args.heads;
    let largest = args
        .batch
        .iter()
        .flat_map(|&b| args.context.iter().map(move |&l| geometry.kv_bytes(b, l)))
        .max()
        .unwrap_or(0);
    let mut rig = Rig::new(geometry, largest)?;
    if args.kv_dtype == "fp8" {
        if args.mla {
            bail!("--kv-dtype fp8 applies to the grouped-query kernels, not --mla");
        }
        rig.use_fp8()?;
    }
    let table = if paths.iter().any(|p| p == "tuned") {
        Some(super::tune::load_table(&rig.gpu)?)
    } else {
        None
    };
    let mut results = Vec::new();
    for &b in &args.batch {
        for &l in &args.context {
            let kind = if args.prefill {
                QueryRows::Prefill
            } else {
                QueryRows::Decode
            };
            let case = rig.case(b, l, kind)?;
            let floor_us = case.bytes as f64 / COPY_BYTES_PER_US;
            let mut results_of_case = Vec::new();
            let (mut chunks, mut pages_per_chunk) = (0, 0);
            for name in &paths {
                let variant = match name.as_str() {
                    "gather" => None,
                    _ if args.prefill => None,
                    "tuned" => Some(super::tune::table_variant(table.as_ref(), &geometry, b, l)),
                    other => {
                        let (kernel, merge) = fused_path(other)?;
                        Some(DecodeVariant {
                            kernel,
                            merge,
                            waves: args.waves,
                        })
                    }
                };
                let path = match (variant, prefill_kernel(name)) {
                    (_, Some(kernel)) => DecodePath::Prefill(kernel),
                    (None, None) => DecodePath::Gather,
                    (Some(variant), None) => {
                        let min_pages = args.min_chunk_keys.div_ceil(args.heads.page_size);
                        let mut policy = rig.policy(&variant, min_pages);
                        if let Some(target) = args.target_ctas {
                            (policy.target_ctas, policy.resident_ctas) = (target, None);
                        }
                        policy.pages_per_chunk = args.pages_per_chunk;
                        DecodePath::Fused(variant, policy)
                    }
                };
                let captured = rig.capture(&case, path)?;
                if captured.chunks > 0 && chunks == 0 {
                    (chunks, pages_per_chunk) = (captured.chunks, captured.pages_per_chunk);
                }
                let mut times = captured.time(&rig.gpu, args.replays)?;
                let (median_us, min_us) = super::bench_sampling::median_and_min(&mut times);
                let pairs = (b * l * (l + 1) / 2) as f64;
                let flops = 4.0 * pairs * (args.heads.q_heads * args.heads.head_dim) as f64;
                results_of_case.push(PathResult {
                    path: name.clone(),
                    variant: variant.map(|v| v.to_string()),
                    median_us,
                    min_us,
                    gb_per_s: case.bytes as f64 / median_us / 1e3,
                    percent_of_copy: 100.0 * floor_us / median_us,
                    tflops: args.prefill.then(|| flops / median_us / 1e6),
                });
            }
            let case = CaseResult {
                batch: b,
                context: l,
                kv_mb: case.bytes as f64 / 1e6,
                floor_us,
                rotating_sets: case.sets,
                chunks,
                pages_per_chunk,
                paths: results_of_case,
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

/// The prefill kernel of a `prefill-mma` or `prefill-tiled` path.
fn prefill_kernel(path: &str) -> Option<PrefillKernel> {
    match path {
        "prefill-stream" => Some(PrefillKernel::Stream(PrefillStreamTiling::DEFAULT)),
        "prefill-mma" => Some(PrefillKernel::Mma),
        "prefill-tiled" => Some(PrefillKernel::Tiled),
        _ => path
            .strip_prefix("prefill-stream-")
            .and_then(PrefillStreamTiling::parse)
            .map(PrefillKernel::Stream),
    }
}

/// The kernel and merge of a fused path's name: `fused` (CUDA cores), `fused-mma` (WMMA
/// tensor cores) or `stream-KxS` (the streaming kernel, tiles of K keys in S stages), each
/// merged in the same launch, or by a second one with `-separate`.
fn fused_path(path: &str) -> Result<(PagedDecodeKernel, MergeMode)> {
    let (name, merge) = match path.strip_suffix("-separate") {
        Some(name) => (name, MergeMode::Separate),
        None => (path, MergeMode::InKernel),
    };
    let kernel = match name {
        "fused" => PagedDecodeKernel::CudaCore,
        "fused-mma" => PagedDecodeKernel::TensorCore,
        _ => {
            let tiling = name.strip_prefix("stream-").and_then(|shape| {
                let (keys, stages) = shape.split_once('x')?;
                let (keys, stages) = (keys.parse::<usize>().ok()?, stages.parse().ok()?);
                let tiling = StreamTiling::new(keys / 4, stages);
                (keys % 4 == 0 && StreamTiling::ALL.contains(&tiling)).then_some(tiling)
            });
            let Some(tiling) = tiling else {
                let streams: Vec<String> =
                    StreamTiling::ALL.iter().map(|t| t.to_string()).collect();
                bail!(
                    "unknown path `{path}`: use gather, fused, fused-mma or one of {} \
                     (each with -separate for a second merge launch)",
                    streams.join(", ")
                );
            };
            PagedDecodeKernel::Streaming(tiling)
        }
    };
    Ok((kernel, merge))
}

fn print_row(case: &CaseResult, header: bool) {
    if header {
        let names: Vec<String> = case
            .paths
            .iter()
            .map(|p| match p.tflops {
                Some(_) => format!("{:>14} {:>7}", format!("{} us", p.path), "TFLOP/s"),
                None => format!("{:>14} {:>6} {:>5}", format!("{} us", p.path), "GB/s", "%"),
            })
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
        .map(|p| match p.tflops {
            Some(tflops) => format!("{:>14.1} {:>7.1}", p.median_us, tflops),
            None => format!(
                "{:>14.1} {:>6.0} {:>5.0}",
                p.median_us, p.gb_per_s, p.percent_of_copy
            ),
        })
        .collect();
    let tuned = case
        .paths
        .iter()
        .find(|p| p.path == "tuned")
        .and_then(|p| p.variant.as_deref())
        .map_or(String::new(), |variant| format!("  tuned: {variant}"));
    println!(
        "{:>3} {:>6} {:>8.1} {:>8.1} {:>3} {:>6} {:>4} {}{tuned}",
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
