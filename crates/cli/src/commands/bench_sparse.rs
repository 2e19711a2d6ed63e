//! `pagoda bench sparse`: Quest sparse decode against the dense fused decode at the op level,
//! timed as `pagoda bench attention` times (bf16 pools of random contents, R rotating input
//! sets captured in one CUDA graph, replays timed with CUDA events, median replay / R).
//!
//! A case is B requests of L tokens each, pages drawn at random from the pool, decoding one
//! token. Dense: the built-in heuristic's fused decode over every page. Sparse, what a CUDA
//! sparse step runs in each layer: the summaries' update for the step's B new tokens, the
//! page scores and the selection (keep the first page, the last `window` tokens and the best
//! pages within `budget` tokens), then the same fused decode over the shortened table with its
//! own plan. The breakdown times growing prefixes of the step: the summaries' update alone
//! (`update us`), then with the page scores (their difference: `scores us`), then with the
//! selection (`select us`, the difference again); `sparse us` is the whole step. The
//! summaries of the whole pool are computed once before timing (the step keeps them as it
//! appends).

use anyhow::{bail, Result};
use clap::Args;
use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_kv::PageTable;
use pagoda_models::llama_cuda::sparse_grid_pages;
use pagoda_ops::attention::SparseAttention;
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, PagedDecodePlan, PagedDecodeWorkspace, PagedKv, Queries,
    SparseSelectKernels, SparseSelectPlan, SparseSelectWorkspace, SPARSE_MAX_PAGES,
};
use rand::Rng;
use serde::Serialize;

use super::decode_rig::{
    device_table, push_request, time_replays, upload_table, warm_capture, Geometry, Rig, L2_BYTES,
};

/// Flags of `pagoda bench sparse`.
#[derive(Args, Debug)]
pub struct BenchSparseArgs {
    /// Requests per decode step (comma-separated).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1,4"
    )]
    pub batch: Vec<usize>,
    /// Tokens of each request's context (comma-separated).
    #[arg(
        short = 'c',
        long = "context",
        value_delimiter = ',',
        default_value = "32768,65536"
    )]
    pub context: Vec<usize>,
    /// Tokens sparse decode keeps per request (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    pub budget: Vec<usize>,
    /// Most recent tokens always kept.
    #[arg(long, default_value_t = 256)]
    pub window: usize,
    /// Heads and page size.
    #[command(flatten)]
    pub heads: Geometry,
    /// The page scores' and selection's kernels: bitwise or radix (default:
    /// $PAGODA_CUDA_SPARSE_SELECT, else radix).
    #[arg(long, value_parser = ["bitwise", "radix"])]
    pub select: Option<String>,
    /// CTAs the radix page scores' grid aims at (0: one round of pages a CTA, the unlooped
    /// grid; default: 3 per SM).
    #[arg(long)]
    pub score_ctas: Option<usize>,
    /// Graph replays per case (the median is reported).
    #[arg(short = 'n', long, default_value_t = 50)]
    pub replays: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct CaseResult {
    /// The selection's kernels (`bitwise` or `radix`).
    select: &'static str,
    batch: usize,
    context: usize,
    budget: usize,
    rotating_sets: usize,
    kept_pages: usize,
    dense_us: f64,
    update_us: f64,
    scores_us: f64,
    select_us: f64,
    sparse_us: f64,
    speedup: f64,
}

/// One rotating set: the full page table (host and device), the queries and the slots of
/// the step's new tokens (each request's last).
struct Set {
    table: PageTable,
    arrays: [DeviceBuffer<u32>; 4],
    q: DeviceBuffer<bf16>,
    slots: DeviceBuffer<i32>,
}

/// Runs `pagoda bench sparse`.
pub fn run(args: &BenchSparseArgs) -> Result<()> {
    let all = [&args.batch, &args.context, &args.budget];
    if all.iter().any(|list| list.contains(&0)) || args.replays == 0 {
        bail!("--batch, --context, --budget and --replays must be at least 1");
    }
    let word = match &args.select {
        Some(word) => word.clone(),
        None => pagoda_config::global()
            .word("PAGODA_CUDA_SPARSE_SELECT")
            .to_string(),
    };
    let kernels = SparseSelectKernels::parse(&word)
        .ok_or_else(|| anyhow::anyhow!("--select {word}: bitwise or radix"))?;
    let g = args.heads;
    let largest = args.batch.iter().max().copied().unwrap_or(1)
        * args.context.iter().max().copied().unwrap_or(1);
    let mut rig = Rig::new(g, g.kv_bytes(1, largest) * 4)?;
    let (k_pool, _, layout) = rig.pools();
    // The whole pool's summaries: one slot on each page's last row recomputes the page.
    let gpu = &rig.gpu;
    let every_page: Vec<i32> = (0..layout.num_pages)
        .map(|p| (p * layout.page_size + layout.page_size - 1) as i32)
        .collect();
    let mut summaries = gpu.zeros::<bf16>(ops::sparse_summaries_len(&layout))?;
    ops::sparse_summaries_update(
        gpu,
        k_pool,
        &layout,
        &gpu.upload(&every_page)?,
        &mut summaries,
    )?;
    gpu.synchronize()?;
    let mut results = Vec::new();
    for &b in &args.batch {
        for &l in &args.context {
            for &budget in &args.budget {
                let params = SparseAttention::new(budget, args.window.min(budget), 0)
                    .map_err(anyhow::Error::msg)?;
                if l <= budget {
                    bail!("--context {l} must exceed --budget {budget}");
                }
                let result = case(&mut rig, args, &mut summaries, kernels, (b, l, params))?;
                if !args.json {
                    print_row(&result, results.is_empty());
                }
                results.push(result);
            }
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    Ok(())
}

/// Times one (B, L, budget) case on both paths.
fn case(
    rig: &mut Rig,
    args: &BenchSparseArgs,
    summaries: &mut DeviceBuffer<bf16>,
    kernels: SparseSelectKernels,
    (b, l, params): (usize, usize, SparseAttention),
) -> Result<CaseResult> {
    let g = rig.geometry;
    let page = g.page_size;
    // Rotate enough sets that the sparse path's reads (kept pages, summaries) pass the L2.
    let summary_bytes = b * l.div_ceil(page) * g.kv_heads * 2 * g.head_dim * 2;
    let sparse_bytes = g.kv_bytes(b, params.budget) + summary_bytes;
    let sets_count = (4 * L2_BYTES).div_ceil(sparse_bytes).clamp(1, 8);
    let sets = (0..sets_count)
        .map(|_| make_set(rig, b, l))
        .collect::<Result<Vec<_>>>()?;
    let gpu = &rig.gpu;
    let (k_pool, v_pool, layout) = rig.pools();
    let scale = 1.0 / (g.head_dim as f32).sqrt();
    let (variant, policy, capacity, mut dense) = rig.plain_decode(b, &sets[0].table.indptr)?;
    let mut out = gpu.zeros::<bf16>(b * g.q_heads * g.head_dim)?;
    let mut record_dense = |gpu: &Gpu| {
        for set in &sets {
            let kv = PagedKv::new(k_pool, v_pool, layout, table_of(set)?);
            let merge = variant.merge;
            ops::paged_decode_attention(
                gpu,
                &queries_of(set, g),
                &kv,
                &mut dense,
                merge,
                scale,
                &mut out,
            )?;
        }
        Ok(())
    };
    let graph = warm_capture(gpu, &mut record_dense)?;
    let mut times = time_replays(gpu, &graph, args.replays, sets.len())?;
    let (dense_us, _) = super::bench_sampling::median_and_min(&mut times);
    // Sparse: every set has the same lengths, so one plan serves them all.
    let qo: Vec<u32> = (0..=b as u32).collect();
    let settings = vec![Some(params); b];
    let max_pages = (l.div_ceil(page) + 1).min(SPARSE_MAX_PAGES);
    let plan = SparseSelectPlan::new(&sets[0].table, &qo, &settings, page, max_pages)?;
    if plan.dense_past_limit > 0 {
        bail!("--context {l}: past the device selection's {SPARSE_MAX_PAGES} pages");
    }
    let mut select = SparseSelectWorkspace::new(gpu, b, max_pages)?;
    select.set_kernels(kernels);
    select.set_score_ctas(args.score_ctas.map(|n| if n == 0 { usize::MAX } else { n }));
    // As in a step: each set's selection follows its update of the last tokens' pages.
    select.set_after_update(true);
    select.upload(gpu, &plan)?;
    select.set_grid_pages(sparse_grid_pages(plan.max_sparse_pages, max_pages))?;
    let mut indices = gpu.zeros::<u32>(plan.selected_pages().max(1))?;
    let sparse_plan = PagedDecodePlan::new(&plan.indptr, g.kv_heads, policy, capacity)?;
    let mut decode = PagedDecodeWorkspace::new(gpu, capacity, g.q_heads, g.kv_heads, g.head_dim)?;
    decode.upload_plan(gpu, &sparse_plan)?;
    decode.set_kernel(variant.kernel);
    // The step's summaries' update rewrites what the pool's already hold (same rows).
    let step_summaries = summaries;
    let mut record_sparse = |gpu: &Gpu, upto: Stage| {
        for set in &sets {
            let full = table_of(set)?;
            ops::sparse_summaries_update(gpu, k_pool, &layout, &set.slots, step_summaries)?;
            let q = queries_of(set, g);
            let summaries = &*step_summaries;
            match upto {
                Stage::Update => continue,
                Stage::Scores => {
                    ops::sparse_page_scores(gpu, &q, summaries, &layout, &full, &mut select)?;
                    continue;
                }
                _ => {
                    let out = &mut indices;
                    ops::sparse_select(gpu, &q, summaries, &layout, &full, &mut select, out)?;
                }
            }
            if upto == Stage::Decode {
                let table = select.selected_table(&full, &indices)?;
                let kv = PagedKv::new(k_pool, v_pool, layout, table);
                // As the model's path: right after the selection, programmatically.
                let merge = variant.merge;
                ops::sparse_decode(gpu, &q, &kv, &mut decode, merge, scale, &mut out)?;
            }
        }
        Ok(())
    };
    let mut medians = [0.0; 4];
    for (median, upto) in medians.iter_mut().zip(Stage::ALL) {
        let graph = warm_capture(gpu, &mut |gpu| record_sparse(gpu, upto))?;
        let mut times = time_replays(gpu, &graph, args.replays, sets.len())?;
        *median = super::bench_sampling::median_and_min(&mut times).0;
    }
    let [update_us, with_scores, with_select, sparse_us] = medians;
    Ok(CaseResult {
        select: match kernels {
            SparseSelectKernels::Bitwise => "bitwise",
            SparseSelectKernels::Radix => "radix",
        },
        batch: b,
        context: l,
        budget: params.budget,
        rotating_sets: sets.len(),
        kept_pages: plan.selected_pages(),
        dense_us,
        update_us,
        scores_us: with_scores - update_us,
        select_us: with_select - with_scores,
        sparse_us,
        speedup: dense_us / sparse_us,
    })
}

/// How much of the sparse step a timed graph records (each stage includes those before).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Update,
    Scores,
    Select,
    Decode,
}

impl Stage {
    const ALL: [Stage; 4] = [Stage::Update, Stage::Scores, Stage::Select, Stage::Decode];
}

/// The queries of `set` (one row a request).
fn queries_of(set: &Set, g: Geometry) -> Queries<'_, bf16> {
    Queries::new(&set.q, g.q_heads, g.q_heads * g.head_dim)
}

/// The device page table of `set`.
fn table_of(set: &Set) -> Result<DevicePageTable<'_>, pagoda_cuda::CudaError> {
    device_table(&set.arrays)
}

/// A set of `b` requests of `l` tokens, pages drawn at random from the rig's pool.
fn make_set(rig: &mut Rig, b: usize, l: usize) -> Result<Set> {
    let g = rig.geometry;
    let (_, _, layout) = rig.pools();
    let page = g.page_size;
    let num_pages = layout.num_pages;
    let rng = rig.rng();
    let mut table = PageTable {
        indptr: vec![0],
        ..PageTable::default()
    };
    let mut slots = Vec::with_capacity(b);
    for _ in 0..b {
        let pages = (0..l.div_ceil(page)).map(|_| rng.random_range(0..num_pages) as u32);
        push_request(&mut table, pages, l, page);
        let last_page = *table.indices.last().unwrap_or(&0) as usize;
        slots.push((last_page * page + (l - 1) % page) as i32);
    }
    let q: Vec<bf16> = (0..b * g.q_heads * g.head_dim)
        .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)))
        .collect();
    let gpu = &rig.gpu;
    Ok(Set {
        arrays: upload_table(gpu, &table)?,
        q: gpu.upload(&q)?,
        slots: gpu.upload(&slots)?,
        table,
    })
}

fn print_row(case: &CaseResult, header: bool) {
    if header {
        println!("selection kernels: {}", case.select);
        println!(
            "{:>3} {:>7} {:>6} {:>2} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
            "B",
            "context",
            "budget",
            "R",
            "kept",
            "dense us",
            "update us",
            "scores us",
            "select us",
            "sparse us",
            "speedup"
        );
    }
    println!(
        "{:>3} {:>7} {:>6} {:>2} {:>5} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>6.2}x",
        case.batch,
        case.context,
        case.budget,
        case.rotating_sets,
        case.kept_pages,
        case.dense_us,
        case.update_us,
        case.scores_us,
        case.select_us,
        case.sparse_us,
        case.speedup
    );
}
