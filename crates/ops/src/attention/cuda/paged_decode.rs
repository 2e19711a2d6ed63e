//! The fused split-KV paged decode (`paged_decode.cu`): attends one query per request
//! straight from the paged pools (no gather), split into chunks by a [`PagedDecodePlan`],
//! with the chunks merged by log-sum-exp either inside the same launch (the last chunk of a
//! request merges) or by the generic [`merge_attention_partials`].

use super::decode_plan::{PagedDecodePlan, PlanCapacity};
use super::gathered::SUPPORTED_HEAD_DIMS;
use super::gathered::{check_decode_io, PagedKv, PoolLayout, Queries};
use super::kv_fp8::KvScales;
use super::paged_decode_merge::{merge_partials_launch, specialize_merge, Partials};
use super::stream_tiling::StreamTiling;
pub use super::stream_tiling::{
    MAX_DECODE_GROUP, PAGED_DECODE_HEAD_DIMS, PAGED_DECODE_MMA_HEAD_DIMS,
};
use super::{PAGED_DECODE, PAGED_DECODE_MMA, PAGED_DECODE_STREAM};
use crate::cuda_dtypes::check_float;
use pagoda_cuda::{
    ptr, to_u32, whole, CudaError, DType, DeviceBuffer, DeviceRead, DeviceWrite, Element, Gpu,
    KernelArg, KernelSpec, LaunchDims,
};

/// Threads per CTA of the partial kernel (`THREADS` in `paged_decode.cu`).
const PARTIAL_THREADS: usize = 128;

/// Dynamic shared memory of the partial kernel, as `SMEM_BYTES` in `paged_decode.cu`
/// computes it (the kernel traps when launched with less): the K/V pipeline
/// (`STAGES` tiles of about `TILE_BYTES` per side), the cross-warp merge, or the merge
/// weights, whichever is largest.
pub(super) fn partial_shared_bytes(element_bytes: usize, head_dim: usize, group: usize) -> usize {
    const VEC: usize = 8;
    const TILE_BYTES: usize = 8192;
    const STAGES: usize = 4;
    const MERGE_BLOCK: usize = 256;
    let keys_per_pass = PARTIAL_THREADS / (head_dim / VEC);
    let row = head_dim * element_bytes;
    let tile_keys = if row * keys_per_pass >= TILE_BYTES {
        keys_per_pass
    } else {
        TILE_BYTES / row
    };
    let pipeline = STAGES * 2 * tile_keys * row;
    let merge = PARTIAL_THREADS / 32 * group * (head_dim + 2) * 4;
    let weights = group * (MERGE_BLOCK + 3) * 4;
    pipeline.max(merge).max(weights)
}

/// The entry points of `paged_decode.cu` and `paged_decode_mma.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PagedDecodeEntry {
    /// `paged_decode_partial`: one CTA per (chunk, KV head), CUDA cores.
    Partial,
    /// `paged_decode_partial_mma`: the same on tensor cores (bf16) with `stages` pipeline
    /// stages (2 or 3).
    PartialMma { stages: usize },
    /// `paged_decode_partial_stream`: tensor cores with the softmax in registers
    /// (`paged_decode_stream.cu`), tiled as `tiling` says.
    PartialStream(StreamTiling),
    /// `merge_attention_partials`: the generic merge over `o_indptr`.
    Merge,
}

/// Which partial kernel computes the chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PagedDecodeKernel {
    /// CUDA cores: every dtype, head_dim 32/64/128/256, GQA group 1..=8.
    CudaCore,
    /// Tensor cores (WMMA bf16, f32 accumulation): bf16 KV, head_dim 64/128/256.
    TensorCore,
    /// Tensor cores with raw MMA and the softmax in registers, only K/V in shared memory
    /// (`paged_decode_stream.cu`): bf16 KV, head_dim 64/128/256.
    Streaming(StreamTiling),
}

/// Pipeline stages of the tensor-core kernel by head size: K/V tiles of 64 keys, so two
/// stages keep two CTAs per SM at head_dim 128 (`PAGODA_PAGED_DECODE_STAGES=2|3` overrides;
/// read once, not per launch).
pub fn mma_decode_stages(head_dim: usize) -> usize {
    static OVERRIDE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced =
        OVERRIDE.get_or_init(
            || match pagoda_config::global().word("PAGODA_PAGED_DECODE_STAGES") {
                "2" => Some(2),
                "3" => Some(3),
                _ => None,
            },
        );
    forced.unwrap_or(if head_dim <= 64 { 3 } else { 2 })
}

/// Dynamic shared memory of the tensor-core kernel, as `SMEM_BYTES` in
/// `paged_decode_mma.cu` computes it.
fn mma_shared_bytes(head_dim: usize, group: usize, stages: usize) -> usize {
    let align = |bytes: usize| bytes.div_ceil(128) * 128;
    let pitch = head_dim + 8;
    let side = align(64 * pitch * 2);
    let off_q = 2 * stages * side;
    let off_s = off_q + align(16 * pitch * 2);
    let off_p = off_s + 4 * align(16 * 20 * 4);
    let off_factor = off_p + 4 * align(16 * 24 * 2);
    let main = off_factor + 4 * 16 * 4;
    let epilogue = 4 * 16 * (head_dim + 4) * 4 + 2 * 4 * 16 * 4;
    let weights = group * (256 + 3) * 4;
    main.max(epilogue).max(weights)
}

/// Where the chunks of a request are merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MergeMode {
    /// The last chunk of each (request, KV head) to finish merges: one launch.
    InKernel,
    /// A second launch of [`merge_attention_partials`].
    Separate,
}

/// The specialisation of `entry` for `dtype` (KV, query and output), `head_dim` and `group`
/// (query heads per KV head; the merge ignores it and uses 1). The merge also serves MLA's
/// latent widths ([`super::MLA_LATENT_DIMS`]), from a source without the partial kernels.
pub fn specialize_paged_decode(
    entry: PagedDecodeEntry,
    dtype: DType,
    head_dim: usize,
    group: usize,
) -> Result<KernelSpec, CudaError> {
    if dtype != DType::F16 {
        check_float("paged decode", dtype)?;
    }
    if entry == PagedDecodeEntry::Merge {
        return specialize_merge(dtype, head_dim);
    }
    if !PAGED_DECODE_HEAD_DIMS.contains(&head_dim) {
        return Err(CudaError::invalid(format!(
            "paged decode head_dim {head_dim} is not supported (one of {PAGED_DECODE_HEAD_DIMS:?})"
        )));
    }
    if group == 0 || group > MAX_DECODE_GROUP {
        return Err(CudaError::invalid(format!(
            "paged decode GQA group {group} is outside 1..={MAX_DECODE_GROUP}"
        )));
    }
    let (name, group) = match entry {
        PagedDecodeEntry::Partial => ("paged_decode_partial", group),
        PagedDecodeEntry::PartialMma { stages } => {
            if dtype != DType::BF16
                || !PAGED_DECODE_MMA_HEAD_DIMS.contains(&head_dim)
                || !(2..=3).contains(&stages)
            {
                return Err(CudaError::invalid(format!(
                    "the tensor-core paged decode runs bf16 at head_dim {PAGED_DECODE_MMA_HEAD_DIMS:?} \
                     with 2 or 3 stages, not {dtype} at {head_dim} with {stages}"
                )));
            }
            return Ok(KernelSpec {
                source: &PAGED_DECODE_MMA,
                entry: "paged_decode_partial_mma",
                params: vec![
                    ("HEAD_DIM", head_dim as i64),
                    ("GROUP", group as i64),
                    ("STAGES", stages as i64),
                ],
                dtypes: vec![("T", dtype)],
            });
        }
        PagedDecodeEntry::PartialStream(tiling) => {
            if dtype != DType::BF16 || !tiling.fits(head_dim) {
                return Err(CudaError::invalid(format!(
                    "the streaming paged decode runs bf16 at head_dim {PAGED_DECODE_MMA_HEAD_DIMS:?} \
                     with a tiling of {:?} that fits shared memory, not {dtype} at {head_dim} \
                     with {tiling:?}",
                    StreamTiling::ALL
                )));
            }
            return Ok(KernelSpec {
                source: &PAGED_DECODE_STREAM,
                entry: "paged_decode_partial_stream",
                params: vec![
                    ("HEAD_DIM", head_dim as i64),
                    ("GROUP", group as i64),
                    ("KEYS_PER_WARP", tiling.keys_per_warp as i64),
                    ("STAGES", tiling.stages as i64),
                ],
                dtypes: vec![("T", dtype)],
            });
        }
        PagedDecodeEntry::Merge => return specialize_merge(dtype, head_dim),
    };
    Ok(KernelSpec {
        source: &PAGED_DECODE,
        entry: name,
        params: vec![("HEAD_DIM", head_dim as i64), ("GROUP", group as i64)],
        dtypes: vec![("T", dtype)],
    })
}

/// Why a geometry cannot run the fused decode (`None`: it can). The caller falls back to
/// the gather decode.
pub fn paged_decode_unsupported(
    dtype: DType,
    layout: &PoolLayout,
    num_q_heads: usize,
) -> Option<String> {
    let group = num_q_heads / layout.num_kv_heads.max(1);
    if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        Some(format!("dtype {dtype}"))
    } else if !PAGED_DECODE_HEAD_DIMS.contains(&layout.head_dim) {
        Some(format!("head_dim {}", layout.head_dim))
    } else if group == 0 || group * layout.num_kv_heads != num_q_heads || group > MAX_DECODE_GROUP {
        Some(format!(
            "{num_q_heads} query heads over {} KV heads",
            layout.num_kv_heads
        ))
    } else if !layout.page_size.is_power_of_two() {
        Some(format!(
            "page size {} (not a power of two)",
            layout.page_size
        ))
    } else if layout.num_kv_heads > 65535 {
        Some(format!("{} KV heads", layout.num_kv_heads))
    } else {
        None
    }
}

/// Why this model cannot hold an fp8 KV cache on CUDA (`None`: it can): bf16 activations,
/// a head size both the CUDA-core fp8 decode and the tiled fp8 prefill are built for,
/// grouped-query attention the fused decode serves. (The streaming tensor-core decode also
/// reads fp8, at head_dim 64, 128 and 256; the WMMA decode and the tensor-core prefills do
/// not.)
pub fn fp8_kv_unsupported(dtype: DType, layout: &PoolLayout, num_q_heads: usize) -> Option<String> {
    if dtype != DType::BF16 {
        return Some(format!("{dtype} activations (run --dtype bf16)"));
    }
    if !(PAGED_DECODE_HEAD_DIMS.contains(&layout.head_dim)
        && SUPPORTED_HEAD_DIMS.contains(&layout.head_dim))
    {
        return Some(format!("head_dim {}", layout.head_dim));
    }
    paged_decode_unsupported(dtype, layout, num_q_heads)
}

/// The fp8-pool build of `paged_decode_partial` (CUDA cores) for query/output `dtype`.
pub fn specialize_paged_decode_fp8(
    dtype: DType,
    head_dim: usize,
    group: usize,
) -> Result<KernelSpec, CudaError> {
    specialize_paged_decode_fp8_entry(PagedDecodeEntry::Partial, dtype, head_dim, group)
}

/// The fp8-pool build of `entry`: the CUDA-core partial or the streaming tensor-core partial
/// (the others do not read fp8).
pub fn specialize_paged_decode_fp8_entry(
    entry: PagedDecodeEntry,
    dtype: DType,
    head_dim: usize,
    group: usize,
) -> Result<KernelSpec, CudaError> {
    if !matches!(
        entry,
        PagedDecodeEntry::Partial | PagedDecodeEntry::PartialStream(_)
    ) {
        return Err(CudaError::invalid(format!(
            "the fp8 KV cache is read by the CUDA-core and streaming decodes, not {entry:?}"
        )));
    }
    let mut spec = specialize_paged_decode(entry, dtype, head_dim, group)?;
    spec.params.push(("KV_FP8", 1));
    Ok(spec)
}

/// Device memory of the fused decode for one plan capacity, allocated once: the encoded plan,
/// the partials `[max_chunks, num_q_heads, head_dim]` f32 and their log-sum-exps, and one
/// merge semaphore per (request, KV head) (zero between launches).
pub struct PagedDecodeWorkspace {
    plan: DeviceBuffer<u32>,
    partial_out: DeviceBuffer<f32>,
    partial_lse: DeviceBuffer<f32>,
    semaphores: DeviceBuffer<u32>,
    capacity: PlanCapacity,
    num_q_heads: usize,
    head_dim: usize,
    num_requests: usize,
    grid_chunks: usize,
    kernel: PagedDecodeKernel,
}

impl PagedDecodeWorkspace {
    /// Room for plans of `capacity` over `num_q_heads` x `head_dim` and `num_kv_heads`.
    pub fn new(
        gpu: &Gpu,
        capacity: PlanCapacity,
        num_q_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self, CudaError> {
        let rows = capacity.max_chunks * num_q_heads;
        Ok(PagedDecodeWorkspace {
            plan: gpu.zeros(capacity.encoded_len())?,
            partial_out: gpu.alloc(rows.max(1) * head_dim)?,
            partial_lse: gpu.alloc(rows.max(1))?,
            semaphores: gpu.zeros((capacity.max_requests * num_kv_heads).max(1))?,
            capacity,
            num_q_heads,
            head_dim,
            num_requests: 0,
            grid_chunks: capacity.max_chunks,
            kernel: PagedDecodeKernel::CudaCore,
        })
    }

    /// The plan capacity.
    pub fn capacity(&self) -> PlanCapacity {
        self.capacity
    }

    /// Sets the partial kernel's grid width (default: the capacity's `max_chunks`): a
    /// launch serves plans of at most `grid_chunks` chunks (chunks beyond the plan exit at
    /// once, so a graph captured for a small batch bucket launches a narrower grid).
    pub fn set_grid_chunks(&mut self, grid_chunks: usize) -> Result<(), CudaError> {
        if grid_chunks == 0 || grid_chunks > self.capacity.max_chunks {
            return Err(CudaError::invalid(format!(
                "decode grid of {grid_chunks} chunks is outside 1..={}",
                self.capacity.max_chunks
            )));
        }
        self.grid_chunks = grid_chunks;
        Ok(())
    }

    /// Chooses the partial kernel of the next launches (default: CUDA cores). The tensor-core
    /// kernel needs bf16 and one of [`PAGED_DECODE_MMA_HEAD_DIMS`] (checked at launch).
    pub fn set_kernel(&mut self, kernel: PagedDecodeKernel) {
        self.kernel = kernel;
    }

    /// The partial kernel of the next launches.
    pub fn kernel(&self) -> PagedDecodeKernel {
        self.kernel
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        (self.plan.len() + self.partial_out.len() + self.partial_lse.len() + self.semaphores.len())
            * 4
    }

    /// Uploads `plan` (synchronously, from pageable memory: not inside a graph capture).
    pub fn upload_plan(&mut self, gpu: &Gpu, plan: &PagedDecodePlan) -> Result<(), CudaError> {
        let words = plan.encode(self.capacity)?;
        gpu.upload_into(&words, &mut self.plan)
    }

    /// The encoded plan's device buffer, for callers that stage it themselves (pinned
    /// uploads before a graph replay); `capacity().encoded_len()` words.
    pub fn plan_buffer_mut(&mut self) -> &mut DeviceBuffer<u32> {
        &mut self.plan
    }

    /// The partial outputs and log-sum-exps (`[max_chunks, num_q_heads, head_dim]`,
    /// `[max_chunks, num_q_heads]`), e.g. for a caller's own merge.
    pub fn partials(&self) -> (&DeviceBuffer<f32>, &DeviceBuffer<f32>) {
        (&self.partial_out, &self.partial_lse)
    }

    /// Requests of the last launch (for [`Self::o_indptr`]).
    pub fn o_indptr(&self) -> Result<pagoda_cuda::DeviceView<'_, u32>, CudaError> {
        let offset = self.capacity.o_indptr_offset();
        self.plan.view(offset..offset + self.num_requests + 1)
    }
}

/// Fused decode: one query per request (`q` row `r`, `q_row_stride` apart, `num_q_heads`
/// heads) against its pages in `k_pool`/`v_pool`, split as the plan in `workspace` says
/// (uploaded for this page table; the grid is the capacity's `max_chunks`, so the launch
/// replays from a CUDA graph with a new plan and table in the same buffers). `out` is
/// `[B, num_q_heads, head_dim]`, fully overwritten (zeros for a request with no visible
/// token). `scale` is the softmax scale. The plan must have at most the workspace's grid
/// width of chunks ([`PagedDecodeWorkspace::set_grid_chunks`]): chunks beyond it would not
/// run.
pub fn paged_decode_attention<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    workspace: &mut PagedDecodeWorkspace,
    merge: MergeMode,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let launch = (merge, scale, Follows::Any);
    paged_decode_launch(gpu, queries, kv, None, workspace, launch, out)
}

/// [`paged_decode_attention`] with the separate merge, launched programmatically after a
/// kernel it does not depend on (cascade's shared level, which lets it start at once) when
/// the partial kernel is the streaming one on compute capability 9.0+: its grid then waits
/// for that kernel before it completes, so the merge reads both.
pub(super) fn paged_decode_beside<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    workspace: &mut PagedDecodeWorkspace,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let launch = (MergeMode::Separate, scale, Follows::Independent);
    paged_decode_launch(gpu, queries, kv, None, workspace, launch, out)
}

/// What the kernel launched just before a fused decode wrote that the decode reads: on
/// compute capability 9.0+ with the streaming kernel (bf16 pools), all but `Any` launch it
/// programmatically.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Follows {
    /// Anything: an ordinary launch.
    Any,
    /// Nothing (cascade's shared level): the grid waits for it before it completes.
    Independent,
    /// Only the page ids (a sparse selection): the grid waits for it before reading them.
    Selection,
}

/// [`paged_decode_attention`] over an e4m3 cache: the same contract, with K and V read as
/// `scale * e4m3(byte)`. The workspace's kernel must be CUDA cores or streaming.
pub fn paged_decode_attention_fp8<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    (kv, scales): (&PagedKv<'_, u8>, &KvScales<'_>),
    workspace: &mut PagedDecodeWorkspace,
    merge: MergeMode,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let launch = (merge, scale, Follows::Any);
    paged_decode_launch(gpu, queries, kv, Some(scales), workspace, launch, out)
}

/// [`paged_decode_attention`] over pools of `K` (the model's `T`, or e4m3 bytes with their
/// `fp8` scales: the CUDA-core and streaming kernels, see [`paged_decode_attention_fp8`]).
pub(super) fn paged_decode_launch<T: Element, K: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, K>,
    fp8: Option<&KvScales<'_>>,
    workspace: &mut PagedDecodeWorkspace,
    (merge, scale, follows): (MergeMode, f32, Follows),
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let (q, num_q_heads, q_row_stride) = (&queries.data, queries.num_heads, queries.row_stride);
    let PagedKv {
        k_pool,
        v_pool,
        layout,
        page_table,
    } = kv;
    layout.validate()?;
    if let Some(reason) = paged_decode_unsupported(T::DTYPE, layout, num_q_heads) {
        return Err(CudaError::invalid(format!(
            "the fused paged decode does not support {reason}"
        )));
    }
    let group = num_q_heads / layout.num_kv_heads;
    let (partial, shared_bytes) = match workspace.kernel {
        _ if fp8.is_some() || K::DTYPE != T::DTYPE => {
            let scales = fp8.ok_or_else(|| CudaError::invalid("byte KV pools without scales"))?;
            scales.check(layout, K::DTYPE)?;
            let (entry, shared) = match workspace.kernel {
                PagedDecodeKernel::CudaCore => (
                    PagedDecodeEntry::Partial,
                    partial_shared_bytes(1, layout.head_dim, group),
                ),
                PagedDecodeKernel::Streaming(tiling) => (
                    PagedDecodeEntry::PartialStream(tiling),
                    tiling.shared_bytes_fp8(layout.head_dim, group),
                ),
                PagedDecodeKernel::TensorCore => {
                    return Err(CudaError::invalid(
                        "the fp8 KV cache is read by the CUDA-core and streaming decodes, not \
                         the WMMA one",
                    ))
                }
            };
            let spec = specialize_paged_decode_fp8_entry(entry, T::DTYPE, layout.head_dim, group)?;
            (spec, shared)
        }
        PagedDecodeKernel::CudaCore => (
            specialize_paged_decode(PagedDecodeEntry::Partial, T::DTYPE, layout.head_dim, group)?,
            partial_shared_bytes(std::mem::size_of::<T>(), layout.head_dim, group),
        ),
        PagedDecodeKernel::TensorCore => {
            let stages = mma_decode_stages(layout.head_dim);
            (
                specialize_paged_decode(
                    PagedDecodeEntry::PartialMma { stages },
                    T::DTYPE,
                    layout.head_dim,
                    group,
                )?,
                mma_shared_bytes(layout.head_dim, group, stages),
            )
        }
        PagedDecodeKernel::Streaming(tiling) => (
            specialize_paged_decode(
                PagedDecodeEntry::PartialStream(tiling),
                T::DTYPE,
                layout.head_dim,
                group,
            )?,
            tiling.shared_bytes(layout.head_dim, group),
        ),
    };
    let num_requests = page_table.num_requests();
    check_decode_io(
        layout,
        (k_pool.len(), v_pool.len()),
        (q.len(), num_q_heads, q_row_stride),
        num_requests,
        out.len(),
    )?;
    let capacity = workspace.capacity;
    if num_requests > capacity.max_requests
        || num_q_heads != workspace.num_q_heads
        || layout.head_dim != workspace.head_dim
        || workspace.semaphores.len() < capacity.max_requests * layout.num_kv_heads
    {
        return Err(CudaError::invalid(format!(
            "a decode of {num_requests} requests x {num_q_heads} heads x {} does not fit its \
             workspace ({capacity:?}, {} heads x {})",
            layout.head_dim, workspace.num_q_heads, workspace.head_dim
        )));
    }
    workspace.num_requests = num_requests;
    let streaming = matches!(workspace.kernel, PagedDecodeKernel::Streaming(_));
    let hopper = gpu.info().programmatic_launches();
    // Only the streaming kernel waits for its programmatic primary (flags bit 1: first).
    let programmatic = follows != Follows::Any && streaming && hopper && fp8.is_none();
    let wait_first = programmatic && follows == Follows::Selection;
    let mut args = vec![
        ptr(q),
        ptr(k_pool),
        ptr(v_pool),
        ptr(&page_table.indptr),
        ptr(&page_table.indices),
        ptr(&page_table.last_page_len),
        ptr(&page_table.first_page_offset),
        ptr(&workspace.plan),
        ptr(out),
        ptr(&workspace.partial_out),
        ptr(&workspace.partial_lse),
        ptr(&workspace.semaphores),
        KernelArg::U32(to_u32("num_requests", num_requests)?),
        KernelArg::U32(to_u32("max_chunks", capacity.max_chunks)?),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(layout.page_size.trailing_zeros()),
        KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
        KernelArg::U32(to_u32("q_row_stride", q_row_stride)?),
        KernelArg::F32(scale * std::f32::consts::LOG2_E),
        KernelArg::U32(u32::from(merge == MergeMode::InKernel) | u32::from(wait_first) << 1),
    ];
    if let Some(scales) = fp8 {
        args.extend([ptr(&scales.k), ptr(&scales.v)]);
    }
    let grid = (
        to_u32("grid chunks", workspace.grid_chunks)?,
        layout.num_kv_heads as u32,
    );
    // SAFETY: arguments match `paged_decode_partial` / `_stream` (their fp8 builds take the two scale
    // pools last, extents checked by `KvScales::check`); the plan buffer holds the capacity's
    // encoded length, the partials max_chunks x num_q_heads rows, the semaphores
    // max_requests x num_kv_heads; pool, q and out extents validated above.
    let dims = LaunchDims {
        shared_mem_bytes: shared_bytes as u32,
        // CTAs per SM are bounded by shared memory: ask for the largest carveout.
        prefer_shared: streaming,
        programmatic,
        ..LaunchDims::new(grid, PARTIAL_THREADS as u32)
    };
    unsafe { gpu.launch(&partial, dims, &args)? };
    if merge == MergeMode::InKernel {
        return Ok(());
    }
    // After the streaming kernel (which lets its dependents launch once its CTAs leave their
    // loops) the merge launches programmatically on compute capability 9.0+ and waits for
    // the partials itself, which hides its launch behind the partial kernel's tail.
    let partials = Partials {
        out: whole(&workspace.partial_out),
        lse: whole(&workspace.partial_lse),
        o_indptr: workspace.o_indptr()?,
        num_heads: num_q_heads,
        head_dim: layout.head_dim,
    };
    merge_partials_launch(gpu, &partials, true, out, None, streaming && hopper)
}
