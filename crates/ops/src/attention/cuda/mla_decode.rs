//! The MLA decode launcher (`mla_decode_partial` on CUDA cores, `mla_decode_partial_mma` on
//! tensor cores) with its workspace; the plan is the fused decode's [`PagedDecodePlan`] over
//! the head tiles, the merge its [`merge_attention_partials`] at `head_dim = latent_dim`.

use super::decode_plan::{PagedDecodePlan, PlanCapacity};
use super::gathered::Queries;
use super::mla::{
    check_query_rows, cuda_core_shared_bytes, mla_head_tiles, specialize_mla, LatentPool, MlaEntry,
    MlaKernel, CC_THREADS, MLA_HEAD_TILE,
};
use super::paged_decode_merge::{merge_attention_partials, Partials};
use pagoda_cuda::{
    check_len, ptr, to_u32, whole, CudaError, DeviceBuffer, DeviceRead, DeviceWrite, Element, Gpu,
    KernelArg, LaunchDims,
};

/// Threads of the tensor-core kernel (`mla_decode_mma.cu`).
const MMA_THREADS: u32 = 256;

/// Device memory of the MLA decode for one plan capacity, allocated once: the encoded plan
/// and the partials `[max_chunks, num_heads, latent_dim]` f32 with their log-sum-exps.
pub struct MlaDecodeWorkspace {
    plan: DeviceBuffer<u32>,
    partial_out: DeviceBuffer<f32>,
    partial_lse: DeviceBuffer<f32>,
    capacity: PlanCapacity,
    num_heads: usize,
    latent_dim: usize,
    num_requests: usize,
    grid_chunks: usize,
    kernel: MlaKernel,
}

impl MlaDecodeWorkspace {
    /// Room for plans of `capacity` (made over [`mla_head_tiles`] "KV heads") for
    /// `num_heads` query heads of `latent_dim`.
    pub fn new(
        gpu: &Gpu,
        capacity: PlanCapacity,
        num_heads: usize,
        latent_dim: usize,
    ) -> Result<Self, CudaError> {
        let rows = capacity.max_chunks * num_heads;
        Ok(MlaDecodeWorkspace {
            plan: gpu.zeros(capacity.encoded_len())?,
            partial_out: gpu.alloc(rows.max(1) * latent_dim)?,
            partial_lse: gpu.alloc(rows.max(1))?,
            capacity,
            num_heads,
            latent_dim,
            num_requests: 0,
            grid_chunks: capacity.max_chunks,
            kernel: MlaKernel::CudaCore,
        })
    }

    /// The plan capacity.
    pub fn capacity(&self) -> PlanCapacity {
        self.capacity
    }

    /// Chooses the partial kernel of the next launches (default: CUDA cores); the
    /// tensor-core kernel needs a bf16 pool (checked at launch).
    pub fn set_kernel(&mut self, kernel: MlaKernel) {
        self.kernel = kernel;
    }

    /// Sets the grid width in chunks (default: the capacity's `max_chunks`; chunks beyond
    /// the plan exit at once). A launch serves plans of at most this many chunks.
    pub fn set_grid_chunks(&mut self, grid_chunks: usize) -> Result<(), CudaError> {
        if grid_chunks == 0 || grid_chunks > self.capacity.max_chunks {
            return Err(CudaError::invalid(format!(
                "MLA decode grid of {grid_chunks} chunks is outside 1..={}",
                self.capacity.max_chunks
            )));
        }
        self.grid_chunks = grid_chunks;
        Ok(())
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        (self.plan.len() + self.partial_out.len() + self.partial_lse.len()) * 4
    }

    /// The encoded plan's device buffer, for callers that stage it themselves (pinned
    /// uploads); `capacity().encoded_len()` words.
    pub fn plan_buffer_mut(&mut self) -> &mut DeviceBuffer<u32> {
        &mut self.plan
    }

    /// Uploads `plan` (synchronously, from pageable memory: not inside a graph capture).
    pub fn upload_plan(&mut self, gpu: &Gpu, plan: &PagedDecodePlan) -> Result<(), CudaError> {
        let words = plan.encode(self.capacity)?;
        gpu.upload_into(&words, &mut self.plan)
    }
}

/// Absorbed MLA decode: one query per request (`q` row `r`, `row_stride` apart, `num_heads`
/// heads of `latent_dim + rope_dim`) against its rows of the latent pool, split as the plan
/// in `workspace` says (uploaded for this page table), the chunks merged by log-sum-exp.
/// `out` is `[B, num_heads, latent_dim]`, fully overwritten (zeros for a request with nothing
/// visible). `scale` is the softmax scale (DeepSeek's, with its YaRN correction).
pub fn mla_decode<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &LatentPool<'_, T>,
    workspace: &mut MlaDecodeWorkspace,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let num_heads = queries.num_heads;
    kv.check(num_heads)?;
    let (layout, table, latent_dim) = (&kv.layout, &kv.page_table, kv.latent_dim);
    let rope_dim = layout.head_dim - latent_dim;
    let num_requests = table.num_requests();
    let capacity = workspace.capacity;
    if num_requests > capacity.max_requests
        || num_heads != workspace.num_heads
        || latent_dim != workspace.latent_dim
    {
        return Err(CudaError::invalid(format!(
            "an MLA decode of {num_requests} requests x {num_heads} heads x {latent_dim} does \
             not fit its workspace ({capacity:?}, {} heads x {})",
            workspace.num_heads, workspace.latent_dim
        )));
    }
    check_len(
        "mla decode out [B, num_heads, latent_dim]",
        num_requests * num_heads * latent_dim,
        out.len(),
    )?;
    check_query_rows(queries, num_requests, layout.head_dim)?;
    let (spec, threads, shared_bytes) = match workspace.kernel {
        MlaKernel::CudaCore => (
            specialize_mla(MlaEntry::DecodePartial, T::DTYPE, latent_dim, rope_dim)?,
            CC_THREADS,
            cuda_core_shared_bytes(std::mem::size_of::<T>(), layout.head_dim),
        ),
        MlaKernel::TensorCore { stages } => (
            specialize_mla(
                MlaEntry::DecodePartialMma { stages },
                T::DTYPE,
                latent_dim,
                rope_dim,
            )?,
            MMA_THREADS,
            mma_shared_bytes(layout.head_dim, stages),
        ),
    };
    workspace.num_requests = num_requests;
    let args = [
        ptr(&queries.data),
        ptr(&kv.pool),
        ptr(&table.indptr),
        ptr(&table.indices),
        ptr(&table.last_page_len),
        ptr(&table.first_page_offset),
        ptr(&workspace.plan),
        ptr(out),
        ptr(&workspace.partial_out),
        ptr(&workspace.partial_lse),
        KernelArg::U32(to_u32("num_requests", num_requests)?),
        KernelArg::U32(to_u32("max_chunks", capacity.max_chunks)?),
        KernelArg::U32(to_u32("num_heads", num_heads)?),
        KernelArg::U32(layout.page_size.trailing_zeros()),
        KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
        KernelArg::U32(to_u32("q_row_stride", queries.row_stride)?),
        KernelArg::F32(scale * std::f32::consts::LOG2_E),
    ];
    let grid = workspace.grid_chunks * mla_head_tiles(num_heads);
    let dims = LaunchDims {
        shared_mem_bytes: shared_bytes as u32,
        prefer_shared: matches!(workspace.kernel, MlaKernel::TensorCore { .. }),
        ..LaunchDims::new((to_u32("MLA decode grid", grid)?, 1), threads)
    };
    // SAFETY: arguments match `mla_decode_partial(_mma)`; the plan buffer holds the
    // capacity's encoded length and the partials max_chunks x num_heads rows; pool, q and
    // out extents validated above.
    unsafe { gpu.launch(&spec, dims, &args)? };
    let offset = capacity.o_indptr_offset();
    let partials = Partials {
        out: whole(&workspace.partial_out),
        lse: whole(&workspace.partial_lse),
        o_indptr: workspace.plan.view(offset..offset + num_requests + 1)?,
        num_heads,
        head_dim: latent_dim,
    };
    merge_attention_partials(gpu, &partials, true, out, None)
}

/// Dynamic shared memory of the tensor-core kernel (`SMEM_BYTES` in `mla_decode_mma.cu`).
pub(super) fn mma_shared_bytes(row_dim: usize, stages: usize) -> usize {
    let pitch = (row_dim + 8) * 2;
    let keys = 32;
    let heads = MLA_HEAD_TILE;
    let pipeline = stages * keys * pitch;
    let query = heads * pitch;
    let scores = 2 * heads * keys * 4;
    let probabilities = heads * (keys + 8) * 2;
    let rows = 3 * heads * 4;
    pipeline + query + scores + probabilities + rows
}
