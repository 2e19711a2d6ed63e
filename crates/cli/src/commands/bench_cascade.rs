//! `pagoda bench cascade`: cascade decode against the plain fused decode at the op level,
//! timed as `pagoda bench attention` times (bf16 pools of random contents, R rotating input
//! sets captured in one CUDA graph, replays timed with CUDA events, median replay / R).
//!
//! A case is B requests behind one shared prefix of S tokens, each with U tokens of its own
//! (FlashInfer's cascade anchor: S 4096, U 256, B 16 and 64, page 16, Llama-3.1-8B heads;
//! `shared/anchors/gpu/bench_anchors.py` times FlashInfer's on the same inputs). Every set
//! draws its shared and own pages at random from the pool. The plain path is the built-in
//! heuristic's fused decode over each request's whole page list; the cascade path runs the
//! shared level (tensor-core tiles of the members' query heads over the prefix, read once)
//! and the fused decode over the own pages, merged together. The floor is the KV bytes the
//! cascade must read (the prefix once, the own pages) at the H200's copy rate.

use anyhow::{bail, Result};
use clap::Args;
use half::bf16;
use pagoda_cuda::{DeviceBuffer, Gpu};
use pagoda_kv::PageTable;
use pagoda_ops::attention::CascadeRule;
use pagoda_ops::cuda::{
    self as ops, CascadeCapacity, CascadeGeometry, CascadePlan, CascadeWorkspace,
    PagedDecodeWorkspace, PagedKv, PoolLayout, PrefillStreamTiling, Queries,
};
use rand::Rng;
use serde::Serialize;

use super::decode_rig::{
    device_table, push_request, time_replays, upload_table, warm_capture, Geometry, Rig, L2_BYTES,
};

/// The H200's measured device copy rate (anchors, table A), bytes per microsecond.
const COPY_BYTES_PER_US: f64 = 4203e3;

/// Flags of `pagoda bench cascade`.
#[derive(Args, Debug)]
pub struct BenchCascadeArgs {
    /// Requests per decode step (comma-separated).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "16,64"
    )]
    pub batch: Vec<usize>,
    /// Tokens of the shared prefix (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    pub shared: Vec<usize>,
    /// Tokens of each request's own part (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "256")]
    pub unique: Vec<usize>,
    /// Query rows of a shared-level tile, 64 or 128 (default: 64 when the batch's query
    /// heads per KV head fit, else 128).
    #[arg(long)]
    pub rows: Option<usize>,
    /// The shared level's CTA target in waves of one CTA per SM.
    #[arg(long, default_value_t = 2)]
    pub shared_waves: usize,
    /// The shortest key chunk of the shared level, in keys.
    #[arg(long, default_value_t = 256)]
    pub min_chunk_keys: usize,
    /// Most shared-level chunks (partials to merge) per request.
    #[arg(long, default_value_t = 16)]
    pub max_slots: usize,
    /// Heads and page size.
    #[command(flatten)]
    pub heads: Geometry,
    /// Graph replays per case (the median is reported).
    #[arg(short = 'n', long, default_value_t = 50)]
    pub replays: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct CaseResult {
    batch: usize,
    shared: usize,
    unique: usize,
    rotating_sets: usize,
    floor_us: f64,
    plain_us: f64,
    cascade_us: f64,
    speedup: f64,
    shared_items: usize,
    rows: usize,
}

/// One rotating set: the step's page table (host and device) and its queries.
struct Set {
    table: PageTable,
    arrays: [DeviceBuffer<u32>; 4],
    q: DeviceBuffer<bf16>,
}

/// Runs `pagoda bench cascade`.
pub fn run(args: &BenchCascadeArgs) -> Result<()> {
    let all = [&args.batch, &args.shared, &args.unique];
    if all.iter().any(|list| list.contains(&0)) || args.replays == 0 {
        bail!("--batch, --shared, --unique and --replays must be at least 1");
    }
    if let Some(rows) = args.rows.filter(|r| ![64, 128].contains(r)) {
        bail!("--rows {rows}: use 64 or 128");
    }
    let geometry = args.heads;
    let page = args.heads.page_size;
    let largest = (args.batch.iter().max().copied().unwrap_or(1))
        * (args.shared.iter().max().copied().unwrap_or(0)
            + args.unique.iter().max().copied().unwrap_or(0));
    let mut rig = Rig::new(geometry, geometry.kv_bytes(1, largest) * 2)?;
    let (_, _, layout) = rig.pools();
    if let Some(reason) =
        ops::cascade_unsupported(pagoda_cuda::DType::BF16, &layout, args.heads.q_heads)
    {
        bail!("cascade decode does not support this shape: {reason}");
    }
    let mut results = Vec::new();
    for &b in &args.batch {
        for &s in &args.shared {
            for &u in &args.unique {
                let shared_pages = s / page;
                if shared_pages == 0 {
                    bail!("--shared {s} is less than a page of {page} tokens");
                }
                let result = case(&mut rig, args, (b, shared_pages * page, u))?;
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

/// Times one (B, S, U) case on both paths.
fn case(
    rig: &mut Rig,
    args: &BenchCascadeArgs,
    (b, s, u): (usize, usize, usize),
) -> Result<CaseResult> {
    let g = rig.geometry;
    let page = g.page_size;
    let cascade_bytes = g.kv_bytes(1, s) + g.kv_bytes(b, u);
    let q_bytes = b * g.q_heads * g.head_dim * 2;
    let sets_count = (4 * L2_BYTES).div_ceil(cascade_bytes + q_bytes).clamp(1, 8);
    let sets = (0..sets_count)
        .map(|_| make_set(rig, b, s, u))
        .collect::<Result<Vec<_>>>()?;
    let gpu = &rig.gpu;
    let (k_pool, v_pool, layout) = rig.pools();
    let scale = 1.0 / (g.head_dim as f32).sqrt();
    let group = g.q_heads / g.kv_heads;
    let rows = args.rows.unwrap_or(if b * group <= 64 { 64 } else { 128 });
    // The plain fused decode (the built-in heuristic's variant and plan).
    let (variant, policy, mut capacity, mut plain) = rig.plain_decode(b, &sets[0].table.indptr)?;
    let mut out = gpu.zeros::<bf16>(b * g.q_heads * g.head_dim)?;
    let kv_of = |set| kv_of(set, (k_pool, v_pool, layout));
    let mut record_plain = |gpu: &Gpu| {
        for set in &sets {
            let queries = Queries::new(&set.q, g.q_heads, g.q_heads * g.head_dim);
            let kv = kv_of(set)?;
            ops::paged_decode_attention(
                gpu,
                &queries,
                &kv,
                &mut plain,
                variant.merge,
                scale,
                &mut out,
            )?;
        }
        Ok(())
    };
    let graph = warm_capture(gpu, &mut record_plain)?;
    let mut times = time_replays(gpu, &graph, args.replays, sets.len())?;
    let (plain_us, _) = super::bench_sampling::median_and_min(&mut times);
    // Cascade: one plan per set (the page ids differ), the same fused-decode plan shape.
    capacity.max_chunks += b * 64;
    let cascade_geometry = CascadeGeometry {
        page_size: page,
        num_kv_heads: g.kv_heads,
        group,
        rows,
        target_ctas: args.shared_waves * rig.sm_count(),
        min_chunk_tokens: args.min_chunk_keys,
        max_slots: args.max_slots,
    };
    let shared_capacity =
        CascadeCapacity::for_batch(b, g.kv_heads, cascade_geometry.target_ctas, args.max_slots);
    let mut decode = PagedDecodeWorkspace::new(gpu, capacity, g.q_heads, g.kv_heads, g.head_dim)?;
    decode.set_kernel(variant.kernel);
    let mut levels = Vec::with_capacity(sets.len());
    let mut items = 0;
    for set in &sets {
        let plan = CascadePlan::new(
            &set.table,
            &cascade_geometry,
            &CascadeRule::ANY,
            (policy, capacity),
            shared_capacity,
        )?
        .ok_or_else(|| anyhow::anyhow!("the case shares no page"))?;
        decode.upload_plan(gpu, &plan.decode)?;
        let mut workspace =
            CascadeWorkspace::new(gpu, shared_capacity, b, set.table.indices.len())?;
        workspace.set_tiling(PrefillStreamTiling::new(rows, 64, 2));
        workspace.stage(gpu, &plan)?;
        gpu.synchronize()?;
        items = plan.items.len();
        levels.push(workspace);
    }
    let mut record_cascade = |gpu: &Gpu| {
        for (set, workspace) in sets.iter().zip(&levels) {
            let queries = Queries::new(&set.q, g.q_heads, g.q_heads * g.head_dim);
            let kv = kv_of(set)?;
            let both = (workspace, &mut decode);
            ops::cascade_decode_attention(gpu, &queries, &kv, both, scale, &mut out)?;
        }
        Ok(())
    };
    let cascade_graph = warm_capture(gpu, &mut record_cascade)?;
    let mut times = time_replays(gpu, &cascade_graph, args.replays, sets.len())?;
    let (cascade_us, _) = super::bench_sampling::median_and_min(&mut times);
    Ok(CaseResult {
        batch: b,
        shared: s,
        unique: u,
        rotating_sets: sets.len(),
        floor_us: cascade_bytes as f64 / COPY_BYTES_PER_US,
        plain_us,
        cascade_us,
        speedup: plain_us / cascade_us,
        shared_items: items,
        rows,
    })
}

/// The paged KV of `set` over the pools.
fn kv_of<'a>(
    set: &'a Set,
    (k_pool, v_pool, layout): (&'a DeviceBuffer<bf16>, &'a DeviceBuffer<bf16>, PoolLayout),
) -> Result<PagedKv<'a, bf16>, pagoda_cuda::CudaError> {
    Ok(PagedKv::new(
        k_pool,
        v_pool,
        layout,
        device_table(&set.arrays)?,
    ))
}

/// A set of `b` requests behind `s` shared tokens with `u` of their own each, pages drawn at
/// random from the rig's pool (the shared ones once for all).
fn make_set(rig: &mut Rig, b: usize, s: usize, u: usize) -> Result<Set> {
    let g = rig.geometry;
    let (_, _, layout) = rig.pools();
    let page = g.page_size;
    let num_pages = layout.num_pages;
    let rng = rig.rng();
    let shared: Vec<u32> = (0..s / page)
        .map(|_| rng.random_range(0..num_pages) as u32)
        .collect();
    let own_pages = u.div_ceil(page);
    let mut table = PageTable {
        indptr: vec![0],
        ..PageTable::default()
    };
    for _ in 0..b {
        let own: Vec<u32> = (0..own_pages)
            .map(|_| rng.random_range(0..num_pages) as u32)
            .collect();
        push_request(&mut table, shared.iter().copied().chain(own), s + u, page);
    }
    let q: Vec<bf16> = (0..b * g.q_heads * g.head_dim)
        .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)))
        .collect();
    let gpu = &rig.gpu;
    Ok(Set {
        arrays: upload_table(gpu, &table)?,
        q: gpu.upload(&q)?,
        table,
    })
}

fn print_row(case: &CaseResult, header: bool) {
    if header {
        println!(
            "{:>4} {:>6} {:>5} {:>2} {:>8} {:>9} {:>10} {:>7} {:>5} {:>4}",
            "B",
            "shared",
            "own",
            "R",
            "floor us",
            "plain us",
            "cascade us",
            "speedup",
            "items",
            "rows"
        );
    }
    println!(
        "{:>4} {:>6} {:>5} {:>2} {:>8.1} {:>9.1} {:>10.1} {:>6.2}x {:>5} {:>4}",
        case.batch,
        case.shared,
        case.unique,
        case.rotating_sets,
        case.floor_us,
        case.plain_us,
        case.cascade_us,
        case.speedup,
        case.shared_items,
        case.rows
    );
}
