//! The routed experts' matmuls over the routing's tiles (`moe_experts.cu`, and through
//! [`TileKernels`] `moe_mma.cu`'s tensor-core kernels, which take the same arguments): the
//! gate/up launch (SiLU x up fused) and the down launch of [`moe_experts`].

use pagoda_cuda::{
    check_len, ptr, to_u32, CudaError, DeviceBuffer, DeviceRead, Element, Gpu, LaunchDims,
};

use super::{max_tiles, specialize_moe, MoeEntry, MoeWorkspace, COLUMNS_PER_CTA};

/// The routed entries' expert outputs, for the routing [`moe_route`](super::moe_route) left in `workspace`:
/// `workspace.out[p] = down_e(silu(gate_e(x[row_p])) * up_e(x[row_p]))` for every routed
/// position `p` of expert `e` (the intermediates rounded to `T` in `workspace.act`, as the
/// dense MLP's). `x` is `[num_rows, hidden]`; `gate` and `up` are `[num_experts, inter,
/// hidden]`, `down` `[num_experts, hidden, inter]`.
pub fn moe_experts<T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<T>,
    [gate, up, down]: [&DeviceBuffer<T>; 3],
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    moe_gate_up(gpu, x, [gate, up], workspace, num_rows)?;
    moe_down(gpu, down, workspace, num_rows)
}

/// The first half of [`moe_experts`] (one launch): `workspace.act[p] = silu(gate_e(x[row_p]))
/// * up_e(x[row_p])` for every routed position `p` of expert `e`. Its own function so that
/// `pagoda bench moe` can time it alone.
pub fn moe_gate_up<T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<T>,
    weights: [&DeviceBuffer<T>; 2],
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    gate_up_tiles(gpu, x, weights, workspace, num_rows, CUDA_CORE_TILES)
}

/// The tiled expert kernels of a launch: the CUDA-core tiles ([`CUDA_CORE_TILES`]) or the
/// tensor-core ones (`mma.rs`), which take the same arguments and tile list with their own
/// entries, CTA width and threads.
#[derive(Clone, Copy, Debug)]
pub(super) struct TileKernels {
    pub gate_up: MoeEntry,
    pub down: MoeEntry,
    /// Output columns a CTA.
    pub columns: usize,
    /// Threads a CTA.
    pub threads: u32,
}

/// `moe_experts.cu`'s CUDA-core tiles.
const CUDA_CORE_TILES: TileKernels = TileKernels {
    gate_up: MoeEntry::GateUp,
    down: MoeEntry::Down,
    columns: COLUMNS_PER_CTA,
    threads: 256,
};

/// [`moe_gate_up`] with `kernels`.
pub(super) fn gate_up_tiles<T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<T>,
    [gate, up]: [&DeviceBuffer<T>; 2],
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
    kernels: TileKernels,
) -> Result<(), CudaError> {
    workspace.check_rows(num_rows)?;
    let w = &*workspace;
    let (experts, hidden, inter) = (w.num_experts, w.hidden, w.inter);
    check_len("moe x [rows, hidden]", num_rows * hidden, x.len())?;
    check_len(
        "moe gate [experts, inter, hidden]",
        experts * inter * hidden,
        gate.len(),
    )?;
    check_len(
        "moe up [experts, inter, hidden]",
        experts * inter * hidden,
        up.len(),
    )?;
    if !x.device_ptr().is_multiple_of(16) {
        return Err(CudaError::invalid(
            "the expert matmuls need a 16-byte aligned x",
        ));
    }
    if num_rows == 0 {
        return Ok(());
    }
    let tiles = to_u32("moe tiles", max_tiles(num_rows * w.top_k, experts))?;
    let spec = specialize_moe(kernels.gate_up, T::DTYPE)?;
    let mut args = vec![ptr(x), ptr(gate), ptr(up)];
    args.extend([
        ptr(&w.expert_offsets),
        ptr(&w.expert_rows),
        ptr(&w.tile_offsets),
        ptr(&w.tile_experts),
        ptr(&w.tile_starts),
    ]);
    args.push(ptr(&w.act));
    args.extend(w.dims()?);
    let grid = (to_u32("moe CTAs", inter.div_ceil(kernels.columns))?, tiles);
    // SAFETY: arguments match `moe_gate_up` (`moe_gate_up_mma`'s are the same); lengths and alignment validated, the tile list
    // was written by `moe_route` for at most `tiles` tiles.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, kernels.threads), &args) }
}

/// The second half of [`moe_experts`] (one launch): `workspace.out[p] = down_e(act[p])`.
pub fn moe_down<T: Element>(
    gpu: &Gpu,
    down: &DeviceBuffer<T>,
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    down_tiles(gpu, down, workspace, num_rows, CUDA_CORE_TILES)
}

/// [`moe_down`] with `kernels`.
pub(super) fn down_tiles<T: Element>(
    gpu: &Gpu,
    down: &DeviceBuffer<T>,
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
    kernels: TileKernels,
) -> Result<(), CudaError> {
    workspace.check_rows(num_rows)?;
    let w = &*workspace;
    let (experts, hidden, inter) = (w.num_experts, w.hidden, w.inter);
    check_len(
        "moe down [experts, hidden, inter]",
        experts * hidden * inter,
        down.len(),
    )?;
    if num_rows == 0 {
        return Ok(());
    }
    let tiles = to_u32("moe tiles", max_tiles(num_rows * w.top_k, experts))?;
    let spec = specialize_moe(kernels.down, T::DTYPE)?;
    let mut args = vec![ptr(&w.act), ptr(down), ptr(&w.expert_offsets)];
    args.extend([
        ptr(&w.tile_offsets),
        ptr(&w.tile_experts),
        ptr(&w.tile_starts),
        ptr(&w.out),
    ]);
    args.extend(w.dims()?);
    let grid = (to_u32("moe CTAs", hidden.div_ceil(kernels.columns))?, tiles);
    // SAFETY: arguments match `moe_down` (`moe_down_mma`'s are the same); the lengths validated, the intermediates and the
    // tile list written for these rows by `moe_gate_up` and `moe_route`.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, kernels.threads), &args) }
}
