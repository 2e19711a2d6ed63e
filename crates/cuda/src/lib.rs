//! pagoda's CUDA driver layer: everything that talks to the driver, LLM-agnostic. The
//! model's kernels and their launchers live with their ops in `pagoda-ops` (`<op>/cuda.rs`).
//!
//! - [`available`] checks that `libcuda`, `libnvrtc` and `libcublasLt` can be opened
//!   *before* anything touches CUDA (cudarc panics on a missing library), then reports the
//!   device ([`DeviceInfo`]); `--device auto` falls back to the CPU on its error.
//! - [`Gpu`]: a context with its own created stream (graph capture needs a non-default
//!   stream), device and pinned buffers, events, occupancy queries, the kernel registry, the
//!   cuBLASLt GEMM ([`Gpu::gemm`], strided batched [`Gpu::gemm_batched`]) with plans
//!   cached per shape, and CUDA-graph capture
//!   ([`Gpu::begin_capture`], [`GraphCache`]).
//! - The kernel registry: CUDA C++ sources (a [`KernelSource`] each, embedded by the op
//!   that owns them, after the shared `prelude.cuh`) are specialised by
//!   `-D` defines derived from a [`KernelKey`] (see [`key`]), compiled by NVRTC for the
//!   device's exact architecture (a cubin for `sm_90a` on Hopper; PTX with
//!   `PAGODA_KERNEL_FORMAT=ptx`) and memoised in memory and on disk ([`kernel_cache_dir`]),
//!   keyed by GPU, driver, NVRTC version and source hash. [`Gpu::prepare_all`] compiles a
//!   list of kernels on several threads ahead of their first launch (the warm-up).
//! - Launch plumbing for the launchers in `pagoda-ops`: typed device views ([`DeviceRead`],
//!   [`KernelArg`], [`LaunchDims`]) and argument checks ([`check_len`], [`to_u32`]).
//!
//! Built without the `cuda` feature, the same API exists but every constructor returns
//! [`CudaError::NotCompiled`]; the gate is this module boundary (`real` or `stub`).

mod error;
pub mod key;
mod loads;
mod memory;

#[cfg(feature = "cuda")]
mod real;
#[cfg(feature = "cuda")]
use real as backend;

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
use stub as backend;

pub use backend::{
    available, compile_for_arch, nvrtc_version, CapturedGraph, DeviceBuffer, Element, GemmPlanKey,
    Gpu, GpuEvent, GraphCache, PinnedBuffer,
};
pub use error::{check_len, check_min_len, to_u32, CudaError};
pub use key::{
    cache_root, cuda_include_dirs, kernel_cache_dir, tuning_table_path, Arch, DType, KernelKey,
    KernelSource, KernelSpec,
};
pub use loads::{KernelLoads, Prepared};
pub use memory::{
    ptr, view, view_mut, whole, DeviceRead, DeviceView, DeviceViewMut, DeviceWrite, KernelArg,
    LaunchDims,
};

/// The layout of a strided batched GEMM ([`Gpu::gemm_batched`]): `batch` products whose
/// operands sit at fixed offsets of one buffer each, rows strided (a per-head product over
/// the heads of a `[tokens, heads, width]` activation, say). Weights are `[batch, n, k]`,
/// contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmBatch {
    /// Products.
    pub batch: usize,
    /// Elements from one activation row to the next (`>= k`).
    pub activations_row_stride: usize,
    /// Elements from one product's activations to the next's.
    pub activations_batch_stride: usize,
    /// Elements from one output row to the next (`>= n`).
    pub out_row_stride: usize,
    /// Elements from one product's output to the next's.
    pub out_batch_stride: usize,
}

impl GemmBatch {
    /// Elements a `[m, k]` activation operand of every product spans (0 for `m == 0`).
    pub fn activations_len(&self, m: usize, k: usize) -> usize {
        span(
            self.batch,
            self.activations_batch_stride,
            m,
            self.activations_row_stride,
            k,
        )
    }

    /// Elements a `[m, n]` output of every product spans (0 for `m == 0`).
    pub fn out_len(&self, m: usize, n: usize) -> usize {
        span(self.batch, self.out_batch_stride, m, self.out_row_stride, n)
    }
}

fn span(batch: usize, batch_stride: usize, rows: usize, row_stride: usize, width: usize) -> usize {
    if batch == 0 || rows == 0 {
        return 0;
    }
    (batch - 1) * batch_stride + (rows - 1) * row_stride + width
}

/// What [`available`] found: the device pagoda would run on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// L2 cache bytes.
    pub l2_cache_bytes: u64,
    /// Shared memory of one SM, bytes (228 KiB on compute capability 9.0 and 10.0, 100 KiB
    /// on 8.6, 8.9 and 12.x).
    pub shared_memory_per_sm: u32,
    /// Total device memory bytes.
    pub total_memory_bytes: u64,
    /// Free device memory bytes when queried.
    pub free_memory_bytes: u64,
    /// The architecture kernels are compiled for.
    pub arch: Arch,
    /// NVRTC `(major, minor)`.
    pub nvrtc_version: (i32, i32),
    /// The driver's CUDA version (`cuDriverGetVersion`: 1000 x major + 10 x minor).
    pub driver_version: i32,
}

impl DeviceInfo {
    /// Whether kernels may launch programmatically ([`LaunchDims::programmatic`],
    /// `griddepcontrol`): compute capability 9.0 and up.
    pub fn programmatic_launches(&self) -> bool {
        self.compute_capability.0 >= 9
    }

    /// The GPU and driver, as the kernel cache keys a machine's cubins:
    /// `NVIDIA H200 sm_90 driver 13000`.
    pub fn platform(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!(
            "{} sm_{major}{minor} driver {}",
            self.name, self.driver_version
        )
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "cuda:{} {} (sm_{}{}, {} SMs, {} MiB L2, {:.1} GiB, kernels {} via NVRTC {}.{}, driver {})",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.sm_count,
            self.l2_cache_bytes >> 20,
            self.total_memory_bytes as f64 / (1u64 << 30) as f64,
            self.arch.0,
            self.nvrtc_version.0,
            self.nvrtc_version.1,
            self.driver_version
        )
    }
}
