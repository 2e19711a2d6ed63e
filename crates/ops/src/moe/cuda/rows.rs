//! The expert MLP of a MoE step by [`MoePath`]: [`MoePath::Tiled`] runs `moe_experts.cu`'s
//! tiles of an expert's routed entries ([`moe_gate_up`], [`moe_down`], then [`moe_combine`]);
//! [`MoePath::PerRow`] runs `moe_rows.cu`'s warps per (row, expert) (`moe_gate_up_rows`, then
//! `moe_down_combine`, the down projection and the combine in one launch). Both give the same
//! bits: every dot product runs in the same lane split and order and the combine in the same
//! expert order, so a row's result does not depend on the path, its batch or the run.
//! [`MoePath::TensorCore`] (bf16, `moe_mma.cu`) runs the tiled path's matmuls on tensor cores:
//! the same sums in another f32 order, the same bits run to run.

use pagoda_cuda::{
    check_len, ptr, to_u32, CudaError, DType, DeviceBuffer, DeviceRead, DeviceWrite, Element, Gpu,
    KernelArg, LaunchDims,
};

use super::mma::{mma_dtype, moe_down_mma, moe_gate_up_mma, MOE_MMA_MIN_ROWS};
use super::{moe_combine, moe_down, moe_gate_up, specialize_moe, MoeEntry, MoeWorkspace};

/// Most rows a step runs through [`MoePath::PerRow`] in [`MoePath::for_rows`]: up to here a
/// step's rows hit mostly distinct experts (4 rows of top-8 over 128 experts: 29 of 32 on
/// average), so reading an expert once per row costs little against wide launches and a
/// launch saved; at 8 rows (52 of 64) the tiles' sharing starts to count.
pub const MOE_PER_ROW_MAX_ROWS: usize = 4;

/// Warps of a `moe_rows.cu` CTA (`WARPS`).
const ROWS_WARPS: usize = 8;
/// Output columns per warp in `moe_rows.cu` (`ROWS`).
const COLUMNS_PER_WARP: usize = 4;

/// How a step's routed entries run through their experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoePath {
    /// Tiles of up to [`MOE_TILE_ROWS`](super::MOE_TILE_ROWS) of an expert's entries (each
    /// expert's weights read once per tile), the f32 outputs, then the combine: three launches.
    Tiled,
    /// A warp per (row, expert, 4 columns): each expert's weights read once per row routed to
    /// it; the down projection and the combine in one launch, no f32 outputs in between.
    PerRow,
    /// [`Tiled`](Self::Tiled)'s launches with the matmuls on tensor cores (bf16 only), over
    /// groups of four of an expert's tiles (each expert's weights read once per 32 entries).
    TensorCore,
}

impl MoePath {
    /// The path for a step of `num_rows` rows: [`PerRow`](Self::PerRow) up to
    /// [`MOE_PER_ROW_MAX_ROWS`], [`Tiled`](Self::Tiled) above. A function of the row count
    /// only, so a decode bucket's graph holds one path.
    pub fn for_rows(num_rows: usize) -> MoePath {
        if num_rows <= MOE_PER_ROW_MAX_ROWS {
            MoePath::PerRow
        } else {
            MoePath::Tiled
        }
    }

    /// The path for a step of `num_rows` rows of `dtype` activations: [`for_rows`]'s, with
    /// [`TensorCore`](Self::TensorCore) in place of [`Tiled`](Self::Tiled) from
    /// [`MOE_MMA_MIN_ROWS`] rows on where `tensor_cores` (`PAGODA_CUDA_MOE_MMA`) and `dtype`
    /// is bf16. A function of the row count only for a given model and setting.
    ///
    /// [`for_rows`]: Self::for_rows
    pub fn choose(num_rows: usize, dtype: DType, tensor_cores: bool) -> MoePath {
        match MoePath::for_rows(num_rows) {
            MoePath::Tiled if tensor_cores && mma_dtype(dtype) && num_rows >= MOE_MMA_MIN_ROWS => {
                MoePath::TensorCore
            }
            path => path,
        }
    }
}

/// Column groups of a `moe_rows.cu` CTA: enough that the warps all have an (expert, group)
/// pair at top-k below the warp count (Mixtral's top-2: 4 groups); one from top-8 on.
fn col_groups(top_k: usize) -> usize {
    (ROWS_WARPS / top_k).max(1)
}

/// [`moe_gate_up`]'s result by `path`: `workspace.act[p] = silu(gate_e(x[row_p])) *
/// up_e(x[row_p])` for every routed position `p` of expert `e`, the same bits either way.
/// `x` is `[num_rows, hidden]`; `gate` and `up` `[num_experts, inter, hidden]`.
pub fn moe_gate_up_with<T: Element>(
    gpu: &Gpu,
    path: MoePath,
    x: &impl DeviceRead<T>,
    [gate, up]: [&DeviceBuffer<T>; 2],
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    match path {
        MoePath::Tiled => return moe_gate_up(gpu, x, [gate, up], workspace, num_rows),
        MoePath::TensorCore => return moe_gate_up_mma(gpu, x, [gate, up], workspace, num_rows),
        MoePath::PerRow => {}
    }
    workspace.check_rows(num_rows)?;
    let w = &*workspace;
    let (experts, top_k, hidden, inter) = (w.num_experts, w.top_k, w.hidden, w.inter);
    check_len("moe x [rows, hidden]", num_rows * hidden, x.len())?;
    for (what, weights) in [("gate", gate), ("up", up)] {
        let what = format!("moe {what} [experts, inter, hidden]");
        check_len(&what, experts * inter * hidden, weights.len())?;
    }
    if !x.device_ptr().is_multiple_of(16) {
        return Err(CudaError::invalid(
            "the expert matmuls need a 16-byte aligned x",
        ));
    }
    if num_rows == 0 {
        return Ok(());
    }
    let groups = col_groups(top_k);
    let spec = specialize_moe(MoeEntry::GateUpRows, T::DTYPE)?;
    let args = [
        ptr(x),
        ptr(gate),
        ptr(up),
        ptr(&w.experts),
        ptr(&w.entry_slots),
        ptr(&w.act),
        KernelArg::U32(top_k as u32),
        KernelArg::U32(to_u32("hidden", hidden)?),
        KernelArg::U32(to_u32("inter", inter)?),
        KernelArg::U32(groups as u32),
    ];
    let grid = (
        to_u32("moe CTAs", inter.div_ceil(groups * COLUMNS_PER_WARP))?,
        to_u32("moe rows", num_rows)?,
    );
    // SAFETY: arguments match `moe_gate_up_rows`; lengths and x's alignment validated (the
    // workspace's buffers hold max_rows >= num_rows rows, hidden a multiple of 16 bytes,
    // checked when it was made), the routing written for these rows by `moe_route`.
    unsafe {
        gpu.launch(
            &spec,
            LaunchDims::new(grid, (ROWS_WARPS * 32) as u32),
            &args,
        )
    }
}

/// `x[row] += Σ weight · down_e(workspace.act[entry])` over each row's routed entries in
/// ascending expert index, `+ shared[row]` after them where given (`[num_rows, hidden]` f32,
/// the shared experts' output): [`moe_down`] and [`moe_combine`]'s result by `path`, the same
/// bits either way. `down` is `[num_experts, hidden, inter]`; `x` `[num_rows, hidden]`, the f32
/// residual stream; the intermediates and routing are [`moe_gate_up_with`]'s and
/// [`moe_route`](super::moe_route)'s for these rows. [`MoePath::Tiled`] leaves the expert
/// outputs in `workspace.out` (so does [`MoePath::TensorCore`]); [`MoePath::PerRow`] does not
/// write it.
pub fn moe_down_combine<T: Element>(
    gpu: &Gpu,
    path: MoePath,
    down: &DeviceBuffer<T>,
    workspace: &mut MoeWorkspace<T>,
    shared: Option<&impl DeviceRead<f32>>,
    x: &mut impl DeviceWrite<f32>,
    num_rows: usize,
) -> Result<(), CudaError> {
    match path {
        MoePath::Tiled => {
            moe_down(gpu, down, workspace, num_rows)?;
            return moe_combine(gpu, workspace, shared, x, num_rows);
        }
        MoePath::TensorCore => {
            moe_down_mma(gpu, down, workspace, num_rows)?;
            return moe_combine(gpu, workspace, shared, x, num_rows);
        }
        MoePath::PerRow => {}
    }
    workspace.check_rows(num_rows)?;
    let w = &*workspace;
    let (experts, top_k, hidden, inter) = (w.num_experts, w.top_k, w.hidden, w.inter);
    check_len(
        "moe down [experts, hidden, inter]",
        experts * hidden * inter,
        down.len(),
    )?;
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
    let groups = col_groups(top_k);
    let spec = specialize_moe(MoeEntry::DownCombine, T::DTYPE)?;
    let args = [
        ptr(&w.act),
        ptr(down),
        ptr(&w.experts),
        ptr(&w.weights),
        ptr(&w.entry_slots),
        shared.map_or(KernelArg::Ptr(0), ptr),
        ptr(x),
        KernelArg::U32(top_k as u32),
        KernelArg::U32(to_u32("hidden", hidden)?),
        KernelArg::U32(to_u32("inter", inter)?),
        KernelArg::U32(groups as u32),
    ];
    let grid = (
        to_u32("moe CTAs", hidden.div_ceil(groups * COLUMNS_PER_WARP))?,
        to_u32("moe rows", num_rows)?,
    );
    // SAFETY: arguments match `moe_down_combine`; lengths validated (the workspace's
    // intermediates and routing hold max_rows >= num_rows rows, inter a multiple of 16 bytes,
    // checked when it was made), written for these rows by `moe_route` and
    // `moe_gate_up_with`.
    unsafe {
        gpu.launch(
            &spec,
            LaunchDims::new(grid, (ROWS_WARPS * 32) as u32),
            &args,
        )
    }
}
