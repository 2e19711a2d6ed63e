//! [`MoePath::TensorCore`](super::MoePath::TensorCore): `moe_mma.cu`'s `moe_gate_up_mma` and
//! `moe_down_mma`, the tiled expert matmuls ([`moe_gate_up`](super::moe_gate_up),
//! [`moe_down`](super::moe_down)) as bf16 mma.sync over groups of four routing tiles of an
//! expert (up to 32 entries a CTA), for steps of [`MOE_MMA_MIN_ROWS`] rows or more; the
//! combine is [`moe_combine`](super::moe_combine)'s. The same f32 sums as the CUDA-core tiles
//! in another order (a few bf16 ulps of the intermediates, f32 noise in the outputs), the same
//! bits run to run (no atomics).

use std::sync::atomic::{AtomicU64, Ordering};

use pagoda_cuda::{CudaError, DType, DeviceBuffer, DeviceRead, Element, Gpu};

use super::tiles::{down_tiles, gate_up_tiles, TileKernels};
use super::{MoeEntry, MoeWorkspace};

/// The fewest rows a step runs through the tensor-core expert kernels in
/// [`MoePath::choose`](super::MoePath::choose): from here on a step's experts mostly hold
/// several entries (32 rows of top-8 over 128 experts: 2 on average, at 64 rows 4), so the
/// CUDA-core tiles' FMAs, not the weight bytes, set their time (608 us at 64 rows and 1809 us
/// at 256, 4.5x the byte floor, Qwen3-30B-A3B's shape on the H100).
pub const MOE_MMA_MIN_ROWS: usize = 32;

/// `moe_mma.cu`'s kernels: 64 output columns a CTA (`CTA_COLS`), 128 threads (`WARPS * 32`).
const MMA_TILES: TileKernels = TileKernels {
    gate_up: MoeEntry::GateUpMma,
    down: MoeEntry::DownMma,
    columns: 64,
    threads: 128,
};

static MMA_LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many expert matmuls (gate/up or down launches) have run on tensor cores in this
/// process.
pub fn moe_mma_launches() -> u64 {
    MMA_LAUNCHES.load(Ordering::Relaxed)
}

/// Counts a launch that ran (`num_rows` > 0), logging the first.
fn count_launch(num_rows: usize) {
    if num_rows == 0 {
        return;
    }
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
    weights: [&DeviceBuffer<T>; 2],
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    gate_up_tiles(gpu, x, weights, workspace, num_rows, MMA_TILES)?;
    count_launch(num_rows);
    Ok(())
}

/// [`moe_down`](super::moe_down) on tensor cores (bf16 only): `workspace.out[p] =
/// down_e(act[p])`.
pub fn moe_down_mma<T: Element>(
    gpu: &Gpu,
    down: &DeviceBuffer<T>,
    workspace: &mut MoeWorkspace<T>,
    num_rows: usize,
) -> Result<(), CudaError> {
    down_tiles(gpu, down, workspace, num_rows, MMA_TILES)?;
    count_launch(num_rows);
    Ok(())
}
