//! [`MoePath::TensorCore`](super::MoePath::TensorCore): `moe_mma.cu`'s `moe_gate_up_mma` and
//! `moe_down_mma`, the tiled expert matmuls ([`moe_gate_up`](super::moe_gate_up),
//! [`moe_down`](super::moe_down)) as bf16 mma.sync over groups of four routing tiles of an
//! expert (up to 32 entries a CTA), for steps of [`MOE_MMA_MIN_ROWS`] rows or more; the
//! combine is [`moe_combine`](super::moe_combine)'s. The same f32 sums as the CUDA-core tiles
//! in another order (a few bf16 ulps of the intermediates, f32 noise in the outputs), the same
//! bits run to run (no atomics).

use std::sync::atomic::{AtomicU64, Ordering};

use pagoda_cuda::{
    check_len, ptr, to_u32, CudaError, DType, DeviceBuffer, DeviceRead, Element, Gpu, LaunchDims,
};

use super::{max_tiles, specialize_moe, MoeEntry, MoeWorkspace};

/// The fewest rows a step runs through the tensor-core expert kernels in
/// [`MoePath::choose`](super::MoePath::choose): from here on a step's experts mostly hold
/// several entries (32 rows of top-8 over 128 experts: 2 on average, at 64 rows 4), so the
/// CUDA-core tiles' FMAs, not the weight bytes, set their time (608 us at 64 rows and 1809 us
/// at 256, 4.5x the byte floor, Qwen3-30B-A3B's shape on the H100).
pub const MOE_MMA_MIN_ROWS: usize = 32;

/// Output columns per CTA of `moe_mma.cu` (`CTA_COLS`).
const MMA_COLUMNS_PER_CTA: usize = 64;
/// Threads per CTA of `moe_mma.cu` (`WARPS * 32`).
const MMA_THREADS: u32 = 128;

static MMA_LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many expert matmuls (gate/up or down launches) have run on tensor cores in this
/// process.
pub fn moe_mma_launches() -> u64 {
    MMA_LAUNCHES.load(Ordering::Relaxed)
}

fn count_launch() {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    LOGGED.call_once(|| {
        tracing::info!(
            "MoE experts on tensor cores (bf16 mma.sync, up to 32 routed entries a CTA) for \
             steps of {MOE_MMA_MIN_ROWS} rows or more (PAGODA_CUDA_MOE_MMA)"
        )
    });
    MMA_LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

/// Whether the tensor-core kernels take `dtype` (bf16 only).
pub(super) fn mma_dtype(dtype: DType) -> bool {
    dtype == DType::BF16
}

/// [`moe_gate_up`](super::moe_gate_up) on tensor cores (bf16 only): `workspace.act[p] =
/// silu(gate_e(x[row_p])) * up_e(x[row_p])` for every routed position `p` of expert `e`.
pub fn moe_gate_up_mma<T: Element>(
    gpu: &Gpu,
    x: &impl DeviceRead<T>,
    [gate, up]: [&DeviceBuffer<T>; 2],
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    workspace.check_rows(num_rows)?;
    let w = &*workspace;
    let (experts, hidden, inter) = (w.num_experts, w.hidden, w.inter);
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
    let tiles = to_u32("moe tiles", max_tiles(num_rows * w.top_k, experts))?;
    let spec = specialize_moe(MoeEntry::GateUpMma, T::DTYPE)?;
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
    let grid = (
        to_u32("moe CTAs", inter.div_ceil(MMA_COLUMNS_PER_CTA))?,
        tiles,
    );
    count_launch();
    // SAFETY: arguments match `moe_gate_up_mma`; lengths and alignment validated (hidden and
    // inter multiples of 8 bf16, checked when the workspace was made), the tile list written
    // by `moe_route` for at most `tiles` tiles.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, MMA_THREADS), &args) }
}

/// [`moe_down`](super::moe_down) on tensor cores (bf16 only): `workspace.out[p] =
/// down_e(act[p])`.
pub fn moe_down_mma<T: Element>(
    gpu: &Gpu,
    down: &DeviceBuffer<T>,
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
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
    let spec = specialize_moe(MoeEntry::DownMma, T::DTYPE)?;
    let mut args = vec![ptr(&w.act), ptr(down), ptr(&w.expert_offsets)];
    args.extend([
        ptr(&w.tile_offsets),
        ptr(&w.tile_experts),
        ptr(&w.tile_starts),
        ptr(&w.out),
    ]);
    args.extend(w.dims()?);
    let grid = (
        to_u32("moe CTAs", hidden.div_ceil(MMA_COLUMNS_PER_CTA))?,
        tiles,
    );
    count_launch();
    // SAFETY: arguments match `moe_down_mma`; the lengths validated, the intermediates and
    // the tile list written for these rows by the gate/up launch and `moe_route`.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, MMA_THREADS), &args) }
}
