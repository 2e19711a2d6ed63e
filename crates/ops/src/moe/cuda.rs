//! Mixture-of-experts on the device, the CPU's [`route_with`](super::route_with) and expert
//! mix side by side with it: [`moe_route`] (each row's top-k experts and weights, then each
//! expert's routed entries in row order and the tiles of the expert matmuls, in one launch: a
//! warp a row, the last CTA to finish lists the entries), [`moe_experts`] (the SiLU-gated
//! expert MLP of every routed entry, on CUDA cores) and [`moe_combine`] (each row's experts
//! summed in ascending expert index into the residual stream); for decode steps
//! [`moe_gate_up_with`] and [`moe_down_combine`] by [`MoePath`] (a warp per row and expert,
//! the down projection and the combine in one launch); [`moe_quant_gate_up`] and
//! [`moe_quant_down`] over experts kept in their GGUF blocks ([`QuantExperts`]).
//!
//! Plan on the device, no host round trip: every launch's grid depends on the step's row
//! count only, the tile list is read by the matmul CTAs (those past its end return), so a
//! decode step's MoE layers are captured in its CUDA graph like the dense MLP. The buffers
//! live in one [`MoeWorkspace`] allocated for the largest step.
//!
//! Batch invariance: a row's choice reads its own logits; each routed entry's dot products
//! run in one order whatever shares its tile; the combine's order is the expert index. A
//! row's bits do not depend on its batch.

use pagoda_cuda::{
    check_len, check_min_len, ptr, to_u32, CudaError, DType, DeviceBuffer, DeviceRead, DeviceWrite,
    Element, Gpu, KernelArg, KernelSource, KernelSpec, LaunchDims,
};

use super::{GroupLimit, GroupScore, Renormalize, Router, Scoring};

mod mma;
mod quant;
mod rows;
mod tiles;
use crate::cuda_dtypes::{check_float, FLOAT_DTYPES};
pub use mma::{moe_down_mma, moe_gate_up_mma, moe_mma_launches, MOE_MMA_MIN_ROWS};
pub use quant::{
    moe_quant_dense_decodes, moe_quant_dequantize, moe_quant_down, moe_quant_down_combine,
    moe_quant_gate_up, moe_quant_launches, specialize_moe_quant, MoeQ8, MoeQuantEntry,
    QuantExperts, MOE_QUANT_DENSE_MIN_ROWS,
};
pub use rows::{moe_down_combine, moe_gate_up_with, MoePath, MOE_PER_ROW_MAX_ROWS};
pub use tiles::{moe_down, moe_experts, moe_gate_up};

/// The CUDA source of the router and the CSR lists (one entry point).
pub(crate) static ROUTE: KernelSource =
    KernelSource::new("moe_route.cu", include_str!("cuda/moe_route.cu"));

/// The CUDA source of the expert matmuls and the combine.
pub(crate) static EXPERTS: KernelSource = KernelSource::new(
    "moe_experts.cu",
    concat!(
        include_str!("cuda/moe_common.cu"),
        include_str!("cuda/moe_experts.cu")
    ),
);

/// The CUDA source of the per-row expert matmuls ([`MoePath::PerRow`]).
pub(crate) static ROWS: KernelSource = KernelSource::new(
    "moe_rows.cu",
    concat!(
        include_str!("cuda/moe_common.cu"),
        include_str!("cuda/moe_rows.cu")
    ),
);

/// The CUDA source of the expert matmuls on tensor cores ([`MoePath::TensorCore`], bf16).
pub(crate) static MMA: KernelSource = KernelSource::new(
    "moe_mma.cu",
    concat!(
        include_str!("cuda/moe_common.cu"),
        include_str!("../attention/cuda/tensor_core.cu"),
        include_str!("cuda/moe_mma.cu")
    ),
);

/// Routed entries per tile of the expert matmuls (`TILE_ROWS` in both sources).
pub const MOE_TILE_ROWS: usize = 8;
/// Most experts a layer may have (the router keeps one word per expert and warp in shared
/// memory).
pub const MOE_MAX_EXPERTS: usize = 512;
/// Most experts a row may be routed to.
pub const MOE_MAX_TOP_K: usize = 32;
/// Most groups a group-limited router may cut its experts into (one lane per group).
pub const MOE_MAX_GROUPS: usize = 32;
/// Output columns per CTA of the expert matmuls (`WARPS * ROWS`).
const COLUMNS_PER_CTA: usize = 32;
/// Threads of a router CTA (`WARPS * 32` in `moe_route.cu`).
const ROUTE_THREADS: u32 = 256;
/// Rows a router CTA routes (`WARPS`, a warp a row).
const ROUTE_ROWS_PER_CTA: usize = 8;

/// The entry points of the MoE sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeEntry {
    /// `moe_route`: the router and the CSR lists (f32 logits; dtype-free).
    Route,
    /// `moe_gate_up`, activations and weights in the model's dtype.
    GateUp,
    /// `moe_down`, activations and weights in the model's dtype.
    Down,
    /// `moe_combine` (f32; dtype-free).
    Combine,
    /// `moe_gate_up_rows` ([`MoePath::PerRow`]), activations and weights in the model's dtype.
    GateUpRows,
    /// `moe_down_combine` ([`MoePath::PerRow`]), activations and weights in the model's dtype.
    DownCombine,
    /// `moe_gate_up_mma` ([`MoePath::TensorCore`]), bf16 only.
    GateUpMma,
    /// `moe_down_mma` ([`MoePath::TensorCore`]), bf16 only.
    DownMma,
}

/// The specialisation of `entry` for `dtype` (the dtype-free entries are f32 whatever
/// `dtype` is).
pub fn specialize_moe(entry: MoeEntry, dtype: DType) -> Result<KernelSpec, CudaError> {
    check_float("moe", dtype)?;
    if matches!(entry, MoeEntry::GateUpMma | MoeEntry::DownMma) && !mma::mma_dtype(dtype) {
        return Err(CudaError::invalid(format!(
            "the MoE tensor-core kernels take bf16, not {dtype}"
        )));
    }
    let indexed = |t| vec![("T", t), ("IDS_T", DType::U32)];
    let (source, name, dtypes) = match entry {
        MoeEntry::Route => (&ROUTE, "moe_route", indexed(DType::F32)),
        MoeEntry::GateUp => (&EXPERTS, "moe_gate_up", indexed(dtype)),
        MoeEntry::Down => (&EXPERTS, "moe_down", indexed(dtype)),
        MoeEntry::Combine => (&EXPERTS, "moe_combine", indexed(DType::F32)),
        MoeEntry::GateUpRows => (&ROWS, "moe_gate_up_rows", indexed(dtype)),
        MoeEntry::DownCombine => (&ROWS, "moe_down_combine", indexed(dtype)),
        MoeEntry::GateUpMma => (&MMA, "moe_gate_up_mma", indexed(dtype)),
        MoeEntry::DownMma => (&MMA, "moe_down_mma", indexed(dtype)),
    };
    Ok(KernelSpec {
        source,
        entry: name,
        params: vec![],
        dtypes,
    })
}

/// Every specialisation the MoE launchers can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for entry in [MoeEntry::Route, MoeEntry::Combine] {
        specs.push(specialize_moe(entry, DType::F32)?);
    }
    for &dtype in &FLOAT_DTYPES {
        let entries = [
            MoeEntry::GateUp,
            MoeEntry::Down,
            MoeEntry::GateUpRows,
            MoeEntry::DownCombine,
        ];
        for entry in entries {
            specs.push(specialize_moe(entry, dtype)?);
        }
        if mma::mma_dtype(dtype) {
            for entry in [MoeEntry::GateUpMma, MoeEntry::DownMma] {
                specs.push(specialize_moe(entry, dtype)?);
            }
        }
    }
    specs.extend(quant::specializations()?);
    Ok(specs)
}

/// A router the device runs: [`Router`] with its group limit (DeepSeek); the selection bias
/// is a device buffer handed to [`moe_route`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceRouter {
    /// Experts per row of logits, at most [`MOE_MAX_EXPERTS`].
    pub num_experts: usize,
    /// Experts each row is routed to, `1..=min(num_experts, MOE_MAX_TOP_K)`.
    pub top_k: usize,
    /// How logits become scores.
    pub scoring: Scoring,
    /// Whether the picked weights are divided by their sum.
    pub renormalize: Renormalize,
    /// Every picked weight is multiplied by it.
    pub scale: f32,
    /// Group-limited routing, if any: at most [`MOE_MAX_GROUPS`] groups.
    pub group_limit: Option<GroupLimit>,
}

impl DeviceRouter {
    /// The device form of `router`, or why the device declines it (too many experts or
    /// groups, top-k out of range, a group limit that does not fit).
    pub fn from_router(router: &Router<'_>) -> Result<DeviceRouter, CudaError> {
        let device = DeviceRouter {
            num_experts: router.num_experts,
            top_k: router.top_k,
            scoring: router.scoring,
            renormalize: router.renormalize,
            scale: router.scale,
            group_limit: router.group_limit,
        };
        device.check()?;
        Ok(device)
    }

    fn check(&self) -> Result<(), CudaError> {
        let (experts, top_k) = (self.num_experts, self.top_k);
        if experts == 0 || experts > MOE_MAX_EXPERTS || top_k == 0 || top_k > experts {
            return Err(CudaError::invalid(format!(
                "the device router takes 1..={MOE_MAX_EXPERTS} experts and top-k 1..=experts \
                 (have {experts} experts, top-{top_k})"
            )));
        }
        if top_k > MOE_MAX_TOP_K {
            return Err(CudaError::invalid(format!(
                "the device router routes a row to at most {MOE_MAX_TOP_K} experts, not {top_k}"
            )));
        }
        if let Some(limit) = self.group_limit {
            let GroupLimit {
                num_groups,
                groups_per_row,
                score,
            } = limit;
            let fits = (1..=MOE_MAX_GROUPS).contains(&num_groups)
                && experts.is_multiple_of(num_groups)
                && (1..=num_groups).contains(&groups_per_row)
                && groups_per_row * (experts / num_groups) >= top_k;
            if !fits {
                return Err(CudaError::invalid(format!(
                    "the device router takes 1..={MOE_MAX_GROUPS} groups that divide the \
                     experts, of which a row's keep at least top-k experts (have {limit:?} for \
                     {experts} experts, top-{top_k})"
                )));
            }
            if score == GroupScore::TopTwoSum && self.scoring != Scoring::Sigmoid {
                return Err(CudaError::invalid(
                    "top-two group scores need sigmoid scoring",
                ));
            }
        }
        Ok(())
    }

    /// The kernel's group arguments: groups, groups kept per row, the score (0: no limit,
    /// 1: max, 2: top-two sum).
    fn group_args(&self) -> [KernelArg; 3] {
        let (groups, kept, score) = match self.group_limit {
            None => (1, 1, 0),
            Some(limit) => (
                limit.num_groups as u32,
                limit.groups_per_row as u32,
                match limit.score {
                    GroupScore::Max => 1,
                    GroupScore::TopTwoSum => 2,
                },
            ),
        };
        [
            KernelArg::U32(groups),
            KernelArg::U32(kept),
            KernelArg::U32(score),
        ]
    }
}

/// A MoE layer's device buffers for steps of up to `max_rows` rows (allocated once; the
/// addresses a captured graph holds). Entries are routed (row, expert) pairs, `rows * top_k`
/// of a step; the routing is plain data, laid out as [`ExpertRouting`](super::ExpertRouting).
pub struct MoeWorkspace<T> {
    /// `[max_rows * top_k]`: each row's experts, best first (ties: the lower index).
    pub experts: DeviceBuffer<u32>,
    /// `[max_rows * top_k]`: the weight of each entry of `experts`.
    pub weights: DeviceBuffer<f32>,
    /// `[num_experts + 1]`: expert `e`'s entries are positions `expert_offsets[e]..
    /// expert_offsets[e + 1]` of the routed order.
    pub expert_offsets: DeviceBuffer<u32>,
    /// `[max_rows * top_k]`: the row of each routed position, ascending within an expert.
    pub expert_rows: DeviceBuffer<u32>,
    /// `[max_rows * top_k]`: the weight of each routed position.
    pub expert_weights: DeviceBuffer<f32>,
    /// `[max_rows * top_k]`: each entry's routed position.
    pub entry_slots: DeviceBuffer<u32>,
    /// `[num_experts + 1]`: expert `e`'s matmul tiles are `tile_offsets[e]..tile_offsets[e + 1]`.
    pub tile_offsets: DeviceBuffer<u32>,
    /// `[max tiles]`: each tile's expert.
    pub tile_experts: DeviceBuffer<u32>,
    /// `[max tiles]`: each tile's first routed position.
    pub tile_starts: DeviceBuffer<u32>,
    /// `[max_rows * top_k, inter]`: the gated intermediates in routed order.
    pub act: DeviceBuffer<T>,
    /// `[max_rows * top_k, hidden]`: the expert outputs in routed order (f32).
    pub out: DeviceBuffer<f32>,
    /// `[1]`: the router's CTAs done so far (zero between launches; `moe_route.cu`).
    route_done: DeviceBuffer<u32>,
    max_rows: usize,
    num_experts: usize,
    top_k: usize,
    hidden: usize,
    inter: usize,
}

/// Tiles a step of `entries` routed entries over `num_experts` experts may need at most.
fn max_tiles(entries: usize, num_experts: usize) -> usize {
    entries.div_ceil(MOE_TILE_ROWS) + num_experts
}

impl<T: Element> MoeWorkspace<T> {
    /// Buffers for steps of up to `max_rows` rows through `router`, experts of `hidden`
    /// inputs and outputs and `inter` intermediates.
    pub fn new(
        gpu: &Gpu,
        router: &DeviceRouter,
        max_rows: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Self, CudaError> {
        router.check()?;
        let piece = 16 / std::mem::size_of::<T>();
        if hidden == 0
            || inter == 0
            || !hidden.is_multiple_of(piece)
            || !inter.is_multiple_of(piece)
        {
            return Err(CudaError::invalid(format!(
                "the expert matmuls need hidden and inter multiples of {piece} (have {hidden}, \
                 {inter})"
            )));
        }
        let (experts, top_k) = (router.num_experts, router.top_k);
        let entries = max_rows.max(1) * top_k;
        let tiles = max_tiles(entries, experts);
        if tiles > 65_535 {
            return Err(CudaError::invalid(format!(
                "{max_rows} rows of top-{top_k} need {tiles} expert tiles, more than a grid's \
                 65535"
            )));
        }
        Ok(MoeWorkspace {
            experts: gpu.zeros(entries)?,
            weights: gpu.zeros(entries)?,
            expert_offsets: gpu.zeros(experts + 1)?,
            expert_rows: gpu.zeros(entries)?,
            expert_weights: gpu.zeros(entries)?,
            entry_slots: gpu.zeros(entries)?,
            tile_offsets: gpu.zeros(experts + 1)?,
            tile_experts: gpu.zeros(tiles)?,
            tile_starts: gpu.zeros(tiles)?,
            act: gpu.zeros(entries * inter)?,
            out: gpu.zeros(entries * hidden)?,
            route_done: gpu.zeros(1)?,
            max_rows: max_rows.max(1),
            num_experts: experts,
            top_k,
            hidden,
            inter,
        })
    }

    /// The expert matmuls' dimension arguments: experts, hidden, inter.
    fn dims(&self) -> Result<[KernelArg; 3], CudaError> {
        Ok([
            KernelArg::U32(self.num_experts as u32),
            KernelArg::U32(to_u32("hidden", self.hidden)?),
            KernelArg::U32(to_u32("inter", self.inter)?),
        ])
    }

    /// The per-entry kernels' dimension arguments: top-k, hidden, inter.
    fn row_dims(&self) -> Result<[KernelArg; 3], CudaError> {
        Ok([
            KernelArg::U32(self.top_k as u32),
            KernelArg::U32(to_u32("hidden", self.hidden)?),
            KernelArg::U32(to_u32("inter", self.inter)?),
        ])
    }

    fn check_rows(&self, num_rows: usize) -> Result<(), CudaError> {
        if num_rows > self.max_rows {
            return Err(CudaError::invalid(format!(
                "a MoE step of {num_rows} rows in a workspace of {}",
                self.max_rows
            )));
        }
        Ok(())
    }
}

/// Routes the `num_rows` rows of `logits` (`[num_rows, num_experts]` f32) with `router` (and
/// `bias`, `[num_experts]`, the sigmoid router's selection bias), as
/// [`route_with`](super::route_with) does: the same experts in the same order (ties: the lower
/// index; NaN last; group limits, group ties to the lower group), weights within an ulp or two
/// (f32 `expf`; the sigmoid router's selection scores use it too, so two experts or groups
/// whose scores differ by an ulp or two may order otherwise than on the CPU). Then lists each expert's
/// entries in row order and the matmul tiles, into `workspace`.
pub fn moe_route<T: Element>(
    gpu: &Gpu,
    logits: &impl DeviceRead<f32>,
    router: &DeviceRouter,
    bias: Option<&DeviceBuffer<f32>>,
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    router.check()?;
    workspace.check_rows(num_rows)?;
    let (experts, top_k) = (router.num_experts, router.top_k);
    if (experts, top_k) != (workspace.num_experts, workspace.top_k) {
        return Err(CudaError::invalid(
            "a MoE workspace sized for another router",
        ));
    }
    check_min_len(
        "moe logits [rows, experts]",
        num_rows * experts,
        logits.len(),
    )?;
    if let Some(bias) = bias {
        if router.scoring != Scoring::Sigmoid {
            return Err(CudaError::invalid("a selection bias needs sigmoid scoring"));
        }
        check_len("moe selection bias", experts, bias.len())?;
    }
    if num_rows == 0 {
        return Ok(());
    }
    let spec = specialize_moe(MoeEntry::Route, DType::F32)?;
    let w = &*workspace;
    let [groups, kept, group_score] = router.group_args();
    let args = [
        ptr(logits),
        bias.map_or(KernelArg::Ptr(0), ptr),
        KernelArg::U32(to_u32("moe rows", num_rows)?),
        KernelArg::U32(experts as u32),
        KernelArg::U32(top_k as u32),
        KernelArg::U32(match router.scoring {
            Scoring::Softmax => 0,
            Scoring::Sigmoid => 1,
        }),
        KernelArg::U32((router.renormalize == Renormalize::Yes) as u32),
        KernelArg::F32(router.scale),
        groups,
        kept,
        group_score,
        ptr(&w.experts),
        ptr(&w.weights),
        ptr(&w.expert_offsets),
        ptr(&w.expert_rows),
        ptr(&w.expert_weights),
        ptr(&w.entry_slots),
        ptr(&w.tile_offsets),
        ptr(&w.tile_experts),
        ptr(&w.tile_starts),
        ptr(&w.route_done),
    ];
    let grid = (
        to_u32("moe route CTAs", num_rows.div_ceil(ROUTE_ROWS_PER_CTA))?,
        1,
    );
    // SAFETY: arguments match `moe_route`; the logits and bias hold num_rows rows and
    // num_experts values, the workspace max_rows * top_k entries, the most tiles those
    // entries need and a zero counter (the kernel leaves it zero).
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, ROUTE_THREADS), &args) }
}

/// `x[row] += Σ weight · workspace.out[entry]` over each row's routed entries in ascending
/// expert index, `+ shared[row]` after them where given (the shared experts' output, `[num_rows,
/// hidden]` f32): the CPU's order of summation. `x` is `[num_rows, hidden]`, the f32 residual
/// stream.
pub fn moe_combine<T: Element>(
    gpu: &Gpu,
    workspace: &MoeWorkspace<T>,
    shared: Option<&impl DeviceRead<f32>>,
    x: &mut impl DeviceWrite<f32>,
    num_rows: usize,
) -> Result<(), CudaError> {
    workspace.check_rows(num_rows)?;
    let (top_k, hidden) = (workspace.top_k, workspace.hidden);
    check_len("moe residual [rows, hidden]", num_rows * hidden, x.len())?;
    if let Some(shared) = shared {
        check_len(
            "moe shared experts [rows, hidden]",
            num_rows * hidden,
            shared.len(),
        )?;
    }
    if num_rows == 0 {
        return Ok(());
    }
    let spec = specialize_moe(MoeEntry::Combine, DType::F32)?;
    let args = [
        ptr(&workspace.experts),
        ptr(&workspace.weights),
        ptr(&workspace.entry_slots),
        ptr(&workspace.out),
        shared.map_or(KernelArg::Ptr(0), ptr),
        ptr(x),
        KernelArg::U32(top_k as u32),
        KernelArg::U32(to_u32("hidden", hidden)?),
    ];
    let grid = (to_u32("moe rows", num_rows)?, 1);
    // SAFETY: arguments match `moe_combine`; lengths validated, the routing written by
    // `moe_route` and the outputs by `moe_experts` for these rows.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, 256), &args) }
}
