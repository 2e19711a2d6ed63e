//! `pagoda bench moe`: one mixture-of-experts block of a decode step at the op level, split
//! into the launches the CUDA model runs (`llama_cuda/experts.rs`): the router GEMM (f32
//! logits; the small-batch GEMV where it applies, as with `PAGODA_CUDA_GEMV` on), `moe_route`,
//! `moe_gate_up`, `moe_down`, the shared experts' dense MLP (GEMM, SiLU-mul, GEMM) and
//! `moe_combine` (up to `MOE_PER_ROW_MAX_ROWS` rows the per-row path: `moe_gate_up_rows`, and
//! `moe_down_combine` for `moe_down` and `moe_combine`; bf16 from `MOE_MMA_MIN_ROWS` rows the
//! tensor-core path, as with `PAGODA_CUDA_MOE_MMA` on); then the whole block. Each stage is
//! captured in its own CUDA graph over `--sets` rotating input sets (so routings; the experts
//! rotate over as many copies as fit in 32 GB, at most one a set; the router stage over copies
//! of 4x the L2), replayed `--replays` times, each timed with CUDA events: the median / calls.
//!
//! The routing is the device's own (read back after the warm run): the weight bytes a stage
//! reads are the distinct experts the set's rows hit times an expert's bytes (gate and up for
//! `gate_up`, down for `down`), the whole router and the shared experts; the floor is those
//! bytes at `--copy-tb-s` (2.98 TB/s: the H100's measured copy rate; activations left out).
//! On the GPU machine: `pagoda bench moe [--shape mixtral-8x7b|deepseek-v2-lite] [--json]`.

use anyhow::{anyhow, bail, Result};
use clap::Args;
use half::bf16;
use pagoda_cuda::{view, view_mut, CudaError, DeviceBuffer, DeviceRead, DeviceWrite, Element, Gpu};
use pagoda_models::llama_cuda::HostFloat;
use pagoda_ops::cuda::{self as ops, DeviceRouter, MoeWorkspace};
use serde::Serialize;

use super::bench_moe_table::{print_rows, BatchResult, StageResult};
use super::decode_rig::{random_fill, time_replays, warm_capture, L2_BYTES};

/// The weight copies of all sets together stay under this many bytes.
const WEIGHT_BUDGET: usize = 32_000_000_000;

/// Flags of `pagoda bench moe`.
#[derive(Args, Debug)]
pub struct BenchMoeArgs {
    /// The MoE block of a built-in architecture: qwen3-30b-a3b (hidden 2048, 128 experts of
    /// 768, top-8), mixtral-8x7b (4096, 8 of 14336, top-2), deepseek-v2-lite (2048, 64 of 1408,
    /// top-6, 2 shared experts) or any other MoE preset of `--random-weights`; the flags below
    /// override its numbers.
    #[arg(long, default_value = "qwen3-30b-a3b")]
    pub shape: String,
    /// Rows (tokens) per step (comma-separated).
    #[arg(
        short = 'b',
        long = "batch",
        value_delimiter = ',',
        default_value = "1,8,64,256"
    )]
    pub batch: Vec<usize>,
    /// The model's hidden size.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// An expert's intermediate size.
    #[arg(long)]
    pub inter: Option<usize>,
    /// Routed experts.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts each row is routed to.
    #[arg(long = "top-k")]
    pub top_k: Option<usize>,
    /// Shared experts (each of `--inter`), run as one dense MLP beside the routed ones.
    #[arg(long)]
    pub shared_experts: Option<usize>,
    /// Weights and activations: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Graph replays per stage (the median is reported).
    #[arg(short = 'n', long, default_value_t = 50)]
    pub replays: usize,
    /// Rotating input sets per graph (activations and routings; weight copies rotate too).
    #[arg(long, default_value_t = 8)]
    pub sets: usize,
    /// The device copy rate of the floor, TB/s (2.98: the H100's measured copy rate).
    #[arg(long = "copy-tb-s", default_value_t = 2.98)]
    pub copy_tb_s: f64,
    /// The experts' path: auto (the model's with `PAGODA_CUDA_MOE_MMA` on, `MoePath::choose`:
    /// per row up to 4 rows, tiled above, tensor cores from 32 bf16 rows), tiled, per-row or
    /// tensor-core (bf16) at every batch (the same sums; per-row and tiled the same bits); or
    /// quant: the experts in GGUF blocks of `--moe-type` (`bench_moe_quant.rs`).
    #[arg(long = "moe-path", default_value = "auto")]
    pub moe_path: String,
    /// The blocks of `--moe-path quant`: q4_k_m (Q4_K gate/up, Q6_K down), q8_0, q4_0, q4_k,
    /// q5_k or q6_k.
    #[arg(long = "moe-type", default_value = "q4_k_m")]
    pub moe_type: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The block measured, resolved from the preset and the flags.
#[derive(Clone, Debug, Serialize)]
struct Shape {
    name: String,
    dtype: &'static str,
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
    shared_experts: usize,
    /// Whether the router takes a selection bias (zeros here; DeepSeek-V3).
    #[serde(skip)]
    selection_bias: bool,
    #[serde(skip)]
    router: DeviceRouter,
    /// `--moe-path`: auto, tiled, per-row or tensor-core.
    moe_path: &'static str,
}

impl Shape {
    /// The experts' path at `b` rows (`--moe-path`).
    fn path(&self, b: usize) -> ops::MoePath {
        match self.moe_path {
            "tiled" => ops::MoePath::Tiled,
            "per-row" => ops::MoePath::PerRow,
            "tensor-core" => ops::MoePath::TensorCore,
            _ => ops::MoePath::choose(b, self.dtype(), true),
        }
    }

    /// The activations' dtype.
    fn dtype(&self) -> pagoda_cuda::DType {
        match self.dtype {
            "bf16" => pagoda_cuda::DType::BF16,
            _ => pagoda_cuda::DType::F32,
        }
    }

    /// Whether the path at `b` rows runs the down projection and the combine as two launches
    /// (tiled and tensor cores; per row: one).
    fn separate_down(&self, b: usize) -> bool {
        self.path(b) != ops::MoePath::PerRow
    }

    /// The shared experts' width (their intermediates side by side).
    fn shared_width(&self) -> usize {
        self.shared_experts * self.inter
    }

    /// Bytes of one copy of the layer's weights at `element` bytes a value.
    fn layer_bytes(&self, element: usize) -> usize {
        let (h, i, e) = (self.hidden, self.inter, self.experts);
        (e * h + 3 * e * i * h + 3 * self.shared_width() * h) * element
    }
}

/// The stages timed, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Router,
    Route,
    GateUp,
    Down,
    Shared,
    Combine,
    DownCombine,
    Block,
}

impl Stage {
    /// The stage's name in the table and the JSON.
    fn name(self) -> &'static str {
        match self {
            Stage::Router => "router",
            Stage::Route => "route",
            Stage::GateUp => "gate_up",
            Stage::Down => "down",
            Stage::Shared => "shared",
            Stage::Combine => "combine",
            Stage::DownCombine => "down+combine",
            Stage::Block => "block",
        }
    }
}

#[derive(Serialize)]
struct Report {
    shape: Shape,
    copy_tb_s: f64,
    results: Vec<BatchResult>,
}

/// Runs `pagoda bench moe`.
pub fn run(args: BenchMoeArgs) -> Result<()> {
    let shape = resolve(&args)?;
    let gpu = Gpu::new(0).map_err(|e| anyhow!("this command needs a CUDA GPU: {e}"))?;
    let dtype = shape.dtype;
    match dtype {
        "bf16" => run_typed::<bf16>(&args, shape, gpu),
        _ => run_typed::<f32>(&args, shape, gpu),
    }
}

/// The shape of `args`, validated on the host (before any GPU is opened).
fn resolve(args: &BenchMoeArgs) -> Result<Shape> {
    if args.batch.is_empty() || args.batch.contains(&0) || args.replays == 0 || args.sets == 0 {
        bail!("--batch, --replays and --sets must be at least 1");
    }
    if !(args.copy_tb_s > 0.0 && args.copy_tb_s.is_finite()) {
        bail!(
            "--copy-tb-s must be a positive rate, not {}",
            args.copy_tb_s
        );
    }
    let (dtype, element) = match args.dtype.as_str() {
        "bf16" => ("bf16", 2),
        "f32" => ("f32", 4),
        other => bail!("--dtype takes bf16 or f32, not `{other}`"),
    };
    let config = pagoda_models::random::preset(&args.shape);
    let Some((config, moe)) = config.and_then(|c| c.moe.clone().map(|moe| (c, moe))) else {
        bail!(
            "unknown MoE shape `{}`: use qwen3-30b-a3b, mixtral-8x7b, deepseek-v2-lite or \
             another preset with experts",
            args.shape
        );
    };
    let mut router = moe.router();
    router.num_experts = args.experts.unwrap_or(router.num_experts);
    router.top_k = args.top_k.unwrap_or(router.top_k);
    let (experts, top_k) = (router.num_experts, router.top_k);
    if experts == 0 || top_k == 0 || top_k > experts {
        bail!("--top-k must be 1..=--experts (have top-{top_k} of {experts} experts)");
    }
    let router = DeviceRouter::from_router(&router).map_err(|e| anyhow!("{e}"))?;
    let shape = Shape {
        name: args.shape.to_lowercase(),
        dtype,
        hidden: args.hidden.unwrap_or(config.hidden_size),
        inter: args.inter.unwrap_or(moe.expert_intermediate_size),
        experts,
        top_k,
        shared_experts: args.shared_experts.unwrap_or(moe.num_shared_experts),
        selection_bias: moe.selection_bias,
        router,
        moe_path: match args.moe_path.as_str() {
            "auto" => "auto",
            "tiled" => "tiled",
            "per-row" => "per-row",
            "tensor-core" if dtype == "bf16" => "tensor-core",
            "tensor-core" => bail!("--moe-path tensor-core needs --dtype bf16"),
            other => bail!("--moe-path takes auto, tiled, per-row, tensor-core, quant: {other}?"),
        },
    };
    let piece = 16 / element;
    for (flag, value) in [("--hidden", shape.hidden), ("--inter", shape.inter)] {
        if value == 0 || !value.is_multiple_of(piece) {
            bail!("{flag} must be a positive multiple of {piece} for {dtype}, not {value}");
        }
    }
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let tiles = (max_batch * top_k).div_ceil(ops::MOE_TILE_ROWS) + experts;
    if tiles > 65_535 {
        bail!("{max_batch} rows of top-{top_k} need {tiles} expert tiles, more than 65535");
    }
    Ok(shape)
}

/// One full copy of the layer's expert weights (the routers are apart: [`Block::routers`]).
struct Weights<T> {
    /// `[experts, inter, hidden]` each.
    gate: DeviceBuffer<T>,
    up: DeviceBuffer<T>,
    /// `[experts, hidden, inter]`.
    down: DeviceBuffer<T>,
    /// The shared experts: gate and up stacked (`[2 * width, hidden]`), down (`[hidden,
    /// width]`).
    shared: Option<[DeviceBuffer<T>; 2]>,
}

/// One rotating input set: its activations, logits and routing, and the weight copy it reads.
struct Set<T> {
    /// `[max_batch, hidden]`.
    x: DeviceBuffer<T>,
    /// `[max_batch, experts]`.
    logits: DeviceBuffer<f32>,
    workspace: MoeWorkspace<T>,
    copy: usize,
}

/// The shared experts' activations (one for all sets).
struct SharedScratch<T> {
    gate_up: DeviceBuffer<T>,
    act: DeviceBuffer<T>,
    out: DeviceBuffer<f32>,
}

/// Everything the graphs use.
struct Block<T> {
    shape: Shape,
    weights: Vec<Weights<T>>,
    sets: Vec<Set<T>>,
    bias: Option<DeviceBuffer<f32>>,
    shared: Option<SharedScratch<T>>,
    /// `[router_copies, experts, hidden]`: copies of the router (a few MB at most, so many
    /// more of them than of the experts rotate through the router stage's graph).
    routers: DeviceBuffer<T>,
    router_copies: usize,
    /// `[max_batch, hidden]` f32: the residual stream the combine adds to.
    residual: DeviceBuffer<f32>,
}

fn run_typed<T: HostFloat>(args: &BenchMoeArgs, shape: Shape, gpu: Gpu) -> Result<()> {
    let element = std::mem::size_of::<T>();
    let layer_bytes = shape.layer_bytes(element);
    let copies = (WEIGHT_BUDGET / layer_bytes).clamp(1, args.sets);
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    let (h, i, e) = (shape.hidden, shape.inter, shape.experts);
    let width = shape.shared_width();
    eprintln!(
        "moe {}: hidden {h}, {e} experts of {i}, top-{}, {} shared, {}; {} sets, {copies} \
         weight copies of {:.2} GB",
        shape.name,
        shape.top_k,
        shape.shared_experts,
        shape.dtype,
        args.sets,
        layer_bytes as f64 / 1e9
    );
    let mut seed = 100;
    let mut fill = |len: usize| -> Result<DeviceBuffer<T>> {
        seed += 1;
        random_fill(&gpu, len, seed)
    };
    let mut weights = Vec::with_capacity(copies);
    for _ in 0..copies {
        weights.push(Weights {
            gate: fill(e * i * h)?,
            up: fill(e * i * h)?,
            down: fill(e * h * i)?,
            shared: match width {
                0 => None,
                _ => Some([fill(2 * width * h)?, fill(h * width)?]),
            },
        });
    }
    let mut sets = Vec::with_capacity(args.sets);
    for s in 0..args.sets {
        sets.push(Set {
            x: fill(max_batch * h)?,
            logits: gpu.zeros(max_batch * e)?,
            workspace: MoeWorkspace::new(&gpu, &shape.router, max_batch, h, i)?,
            copy: s % copies,
        });
    }
    let shared = match width {
        0 => None,
        _ => Some(SharedScratch {
            gate_up: gpu.zeros(max_batch * 2 * width)?,
            act: gpu.zeros(max_batch * width)?,
            out: gpu.zeros(max_batch * h)?,
        }),
    };
    // Router copies (and calls of the router stage's graph) for 4x the L2 between two reads.
    let wanted = (4 * L2_BYTES).div_ceil(e * h * element);
    let router_copies = wanted.clamp(1, 4096).max(args.sets);
    let routers = fill(router_copies * e * h)?;
    let mut block = Block {
        routers,
        router_copies,
        bias: shape.selection_bias.then(|| gpu.zeros(e)).transpose()?,
        residual: gpu.zeros(max_batch * h)?,
        shape,
        weights,
        sets,
        shared,
    };
    let copy_bytes_per_us = args.copy_tb_s * 1e6;
    let mut results = Vec::new();
    for &b in &args.batch {
        let result = block.measure(&gpu, b, args.replays, copy_bytes_per_us)?;
        if !args.json {
            print_rows(&result, results.is_empty());
        }
        results.push(result);
    }
    if args.json {
        let report = Report {
            shape: block.shape,
            copy_tb_s: args.copy_tb_s,
            results,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// `out = a · w^T` (`w` is `[n, k]`): the small-batch GEMV where it applies, else the GEMM,
/// as the model's linear layers with `PAGODA_CUDA_GEMV` on.
fn linear<T: Element, O: Element>(
    gpu: &Gpu,
    a: &impl DeviceRead<T>,
    w: &impl DeviceRead<T>,
    out: &mut impl DeviceWrite<O>,
    shape: (usize, usize, usize),
) -> Result<(), CudaError> {
    if ops::gemv_small_applies(a, w, shape) {
        ops::gemv_small(gpu, a, w, out, shape, 0.0)
    } else {
        gpu.gemm(a, w, out, shape, 0.0)
    }
}

impl<T: HostFloat> Block<T> {
    /// The stages of this shape at `b` rows, the block last, on its path (`Shape::path`;
    /// tiled: down, then combine; per row: down+combine after the shared experts).
    fn stages(&self, b: usize) -> Vec<Stage> {
        let tiled = self.shape.separate_down(b);
        let mut stages = vec![Stage::Router, Stage::Route, Stage::GateUp];
        stages.extend(tiled.then_some(Stage::Down));
        stages.extend(self.shared.as_ref().map(|_| Stage::Shared));
        stages.push(if tiled {
            Stage::Combine
        } else {
            Stage::DownCombine
        });
        stages.push(Stage::Block);
        stages
    }

    /// Calls of `stage` in its graph: one a set, the router's one a router copy.
    fn calls(&self, stage: Stage) -> usize {
        match stage {
            Stage::Router => self.router_copies,
            _ => self.sets.len(),
        }
    }

    /// The router GEMM of set `set`'s `b` rows through router copy `copy`.
    fn router_gemm(
        &mut self,
        gpu: &Gpu,
        set: usize,
        copy: usize,
        b: usize,
    ) -> Result<(), CudaError> {
        let (h, e) = (self.shape.hidden, self.shape.experts);
        let router = view(&self.routers, copy * e * h..(copy + 1) * e * h)?;
        let set = &mut self.sets[set];
        let x = view(&set.x, 0..b * h)?;
        let mut logits = view_mut(&mut set.logits, 0..b * e)?;
        linear(gpu, &x, &router, &mut logits, (b, e, h))
    }

    /// Runs `stage` for `b` rows of every set, in order (the router stage: of every router
    /// copy, the sets in turn).
    fn record(&mut self, gpu: &Gpu, stage: Stage, b: usize) -> Result<(), CudaError> {
        if stage == Stage::Router {
            for call in 0..self.router_copies {
                self.router_gemm(gpu, call % self.sets.len(), call, b)?;
            }
            return Ok(());
        }
        for s in 0..self.sets.len() {
            if stage == Stage::Block {
                self.router_gemm(gpu, s, s % self.router_copies, b)?;
            }
            let shape = &self.shape;
            let (h, e) = (shape.hidden, shape.experts);
            let set = &mut self.sets[s];
            let w = &self.weights[set.copy];
            let x = view(&set.x, 0..b * h)?;
            let tiled = shape.separate_down(b);
            let in_block = |part: Stage| match part {
                Stage::Down | Stage::Combine => tiled,
                Stage::DownCombine => !tiled,
                _ => true,
            };
            let run = |part: Stage| part == stage || (stage == Stage::Block && in_block(part));
            if run(Stage::Route) {
                let logits = view(&set.logits, 0..b * e)?;
                let (router, bias) = (&shape.router, self.bias.as_ref());
                ops::moe_route(gpu, &logits, router, bias, &mut set.workspace, b)?;
            }
            if run(Stage::GateUp) {
                let (path, gate_up) = (shape.path(b), [&w.gate, &w.up]);
                ops::moe_gate_up_with(gpu, path, &x, gate_up, &mut set.workspace, b)?;
            }
            if run(Stage::Down) {
                if shape.path(b) == ops::MoePath::TensorCore {
                    ops::moe_down_mma(gpu, &w.down, &mut set.workspace, b)?;
                } else {
                    ops::moe_down(gpu, &w.down, &mut set.workspace, b)?;
                }
            }
            if let (Some(scratch), Some([gate_up, down])) = (&mut self.shared, &w.shared) {
                let width = shape.shared_width();
                if run(Stage::Shared) {
                    let mut gate_up_out = view_mut(&mut scratch.gate_up, 0..b * 2 * width)?;
                    linear(gpu, &x, gate_up, &mut gate_up_out, (b, 2 * width, h))?;
                    let gate = view(&scratch.gate_up, 0..b * 2 * width)?;
                    let up = view(&scratch.gate_up, width..b * 2 * width)?;
                    let mut act = view_mut(&mut scratch.act, 0..b * width)?;
                    ops::silu_mul(gpu, &gate, &up, &mut act, width, (2 * width, 2 * width))?;
                    let act = view(&scratch.act, 0..b * width)?;
                    let mut out = view_mut(&mut scratch.out, 0..b * h)?;
                    linear(gpu, &act, down, &mut out, (b, h, width))?;
                }
            }
            let shared = match &self.shared {
                Some(scratch) => Some(view(&scratch.out, 0..b * h)?),
                None => None,
            };
            let mut residual = view_mut(&mut self.residual, 0..b * h)?;
            if run(Stage::Combine) {
                ops::moe_combine(gpu, &set.workspace, shared.as_ref(), &mut residual, b)?
            }
            if run(Stage::DownCombine) {
                let (path, workspace) = (ops::MoePath::PerRow, &mut set.workspace);
                let shared = shared.as_ref();
                ops::moe_down_combine(gpu, path, &w.down, workspace, shared, &mut residual, b)?
            }
        }
        Ok(())
    }

    /// Distinct experts each set's rows hit, from the routing the device left.
    fn distinct_experts(&self, gpu: &Gpu) -> Result<Vec<usize>> {
        let mut distinct = Vec::with_capacity(self.sets.len());
        for set in &self.sets {
            let offsets = gpu.download(&set.workspace.expert_offsets)?;
            distinct.push(offsets.windows(2).filter(|o| o[1] > o[0]).count());
        }
        Ok(distinct)
    }

    /// Times every stage at `b` rows: the block first (its warm run leaves each set's routing,
    /// which the byte counts read and the later stages reuse), reported in stage order.
    fn measure(
        &mut self,
        gpu: &Gpu,
        b: usize,
        replays: usize,
        copy_bytes_per_us: f64,
    ) -> Result<BatchResult> {
        let stages = self.stages(b);
        let sets = self.sets.len();
        let mut timed = Vec::with_capacity(stages.len());
        for &stage in stages.iter().rev() {
            let graph = warm_capture(gpu, &mut |gpu: &Gpu| self.record(gpu, stage, b))?;
            let mut times = time_replays(gpu, &graph, replays, self.calls(stage))?;
            timed.push((stage, super::bench_sampling::median_and_min(&mut times)));
        }
        timed.reverse();
        let distinct = self.distinct_experts(gpu)?;
        let mean_distinct = distinct.iter().sum::<usize>() as f64 / sets as f64;
        let s = &self.shape;
        let element = std::mem::size_of::<T>() as f64;
        let expert = (s.hidden * s.inter) as f64 * element;
        let weight_bytes = |stage: Stage| -> Option<f64> {
            let router = (s.experts * s.hidden) as f64 * element;
            let shared = 3.0 * (s.shared_width() * s.hidden) as f64 * element;
            match stage {
                Stage::Router => Some(router),
                Stage::GateUp => Some(2.0 * expert * mean_distinct),
                Stage::Down | Stage::DownCombine => Some(expert * mean_distinct),
                Stage::Shared => Some(shared),
                Stage::Block => Some(router + 3.0 * expert * mean_distinct + shared),
                Stage::Route | Stage::Combine => None,
            }
        };
        if distinct.iter().sum::<usize>() as f64 * expert * 3.0 < 4.0 * L2_BYTES as f64 {
            eprintln!(
                "note: batch {b}'s sets read less than 4x the L2 of experts; the L2 may flatter"
            );
        }
        let mut stages_sum_us = 0.0;
        let results = timed
            .into_iter()
            .map(|(stage, (median_us, min_us))| {
                if stage != Stage::Block {
                    stages_sum_us += median_us;
                }
                let bytes = weight_bytes(stage);
                let floor_us = bytes.map(|bytes| bytes / copy_bytes_per_us);
                StageResult {
                    stage: stage.name(),
                    median_us,
                    min_us,
                    weight_mb: bytes.map(|bytes| bytes / 1e6),
                    gb_per_s: bytes.map(|bytes| bytes / median_us / 1e3),
                    floor_us,
                    times_floor: floor_us.map(|floor| median_us / floor),
                }
            })
            .collect();
        Ok(BatchResult {
            batch: b,
            sets,
            weight_copies: self.weights.len(),
            router_copies: self.router_copies,
            distinct_experts: mean_distinct,
            stages_sum_us,
            stages: results,
        })
    }
}
