//! Cascade decode on CUDA: the shared level on tensor cores (`cascade_shared_attention`, a
//! build of the streaming prefill in `prefill_stream.cu`), the unique level as the fused
//! paged decode over each request's own pages, and the fused decode's separate merge over
//! both, as [`CascadePlan`] lays them out.

use super::cascade_plan::{CascadeCapacity, CascadePlan};
use super::gathered::check_decode_io;
use super::paged_decode::{paged_decode_beside, PagedDecodeWorkspace};
use super::prefill_stream::{PrefillStreamTiling, STREAM_PREFILL_HEAD_DIMS};
use super::{DevicePageTable, PagedKv, PoolLayout, Queries};
use pagoda_cuda::{
    ptr, to_u32, view, view_mut, CudaError, DType, DeviceBuffer, DeviceRead, DeviceWrite, Element,
    Gpu, KernelArg, KernelSpec, LaunchDims, PinnedBuffer,
};

/// The shared level's tilings: 64 or 128 query rows a CTA, 64-key tiles, two stages.
pub const CASCADE_TILINGS: [PrefillStreamTiling; 2] = [
    PrefillStreamTiling::new(64, 64, 2),
    PrefillStreamTiling::new(128, 64, 2),
];

/// The shared level's build of the streaming prefill at `head_dim` and `tiling` (one of
/// [`CASCADE_TILINGS`]).
pub fn specialize_cascade_shared(
    dtype: DType,
    head_dim: usize,
    tiling: PrefillStreamTiling,
) -> Result<KernelSpec, CudaError> {
    if !CASCADE_TILINGS.contains(&tiling) {
        return Err(CudaError::invalid(format!(
            "cascade shared level: no tiling {tiling}"
        )));
    }
    let mut spec = super::specialize_prefill_stream(dtype, head_dim, tiling)?;
    spec.entry = "cascade_shared_attention";
    spec.params.push(("CASCADE", 1));
    Ok(spec)
}

/// Why cascade decode cannot run on this geometry (`None`: it can): bf16 pools and queries,
/// a head size of the streaming prefill, whole GQA groups of at most 128 query heads.
pub fn cascade_unsupported(
    dtype: DType,
    layout: &PoolLayout,
    num_q_heads: usize,
) -> Option<String> {
    if dtype != DType::BF16 {
        return Some(format!("{dtype} (bf16 only)"));
    }
    if !STREAM_PREFILL_HEAD_DIMS.contains(&layout.head_dim) {
        return Some(format!(
            "head_dim {} (one of {STREAM_PREFILL_HEAD_DIMS:?})",
            layout.head_dim
        ));
    }
    let kv = layout.num_kv_heads.max(1);
    if !num_q_heads.is_multiple_of(kv) || num_q_heads / kv > 128 || num_q_heads < kv {
        return Some(format!("{num_q_heads} query heads over {kv} KV heads"));
    }
    super::paged_decode_unsupported(dtype, layout, num_q_heads)
}

/// Device memory of cascade steps for one capacity, allocated once: the shared level's
/// encoded plan and the unique level's suffix page table (its four CSR arrays), with the
/// pinned host staging they are uploaded from.
pub struct CascadeWorkspace {
    plan: DeviceBuffer<u32>,
    /// The suffix table: indptr, indices, last_page_len, first_page_offset.
    suffix: [DeviceBuffer<u32>; 4],
    staging: PinnedBuffer<u32>,
    capacity: CascadeCapacity,
    num_requests: usize,
    /// One past the largest partial slot the staged plan writes.
    slots: usize,
    tiling: PrefillStreamTiling,
}

impl CascadeWorkspace {
    /// Room for plans of `capacity` over at most `max_requests` requests and `max_pages` page
    /// indices in all.
    pub fn new(
        gpu: &Gpu,
        capacity: CascadeCapacity,
        max_requests: usize,
        max_pages: usize,
    ) -> Result<Self, CudaError> {
        let lengths = [
            max_requests + 1,
            max_pages.max(1),
            max_requests.max(1),
            max_requests.max(1),
        ];
        let suffix = [
            gpu.zeros(lengths[0])?,
            gpu.zeros(lengths[1])?,
            gpu.zeros(lengths[2])?,
            gpu.zeros(lengths[3])?,
        ];
        let staging = gpu.alloc_pinned(capacity.encoded_len() + lengths.iter().sum::<usize>())?;
        Ok(CascadeWorkspace {
            plan: gpu.zeros(capacity.encoded_len())?,
            suffix,
            staging,
            capacity,
            num_requests: 0,
            slots: 0,
            tiling: CASCADE_TILINGS[0],
        })
    }

    /// The shared level's capacity.
    pub fn capacity(&self) -> CascadeCapacity {
        self.capacity
    }

    /// Chooses the shared level's tiling (its rows must be the plan's
    /// [`CascadeGeometry::rows`](super::CascadeGeometry)).
    pub fn set_tiling(&mut self, tiling: PrefillStreamTiling) {
        self.tiling = tiling;
    }

    /// Writes `plan`'s shared level and suffix table into the pinned staging and queues
    /// their uploads on the stream (so a graph replayed after them reads them; the staging
    /// is rewritten by the next call, after the stream has passed these copies in the step's
    /// order). The fused decode's plan (`plan.decode`) goes to its own workspace.
    pub fn stage(&mut self, gpu: &Gpu, plan: &CascadePlan) -> Result<(), CudaError> {
        let suffix = &plan.suffix;
        let arrays = [
            &suffix.indptr,
            &suffix.indices,
            &suffix.last_page_len,
            &suffix.first_page_offset,
        ];
        if arrays
            .iter()
            .zip(&self.suffix)
            .any(|(a, d)| a.len() > d.len())
        {
            return Err(CudaError::invalid(format!(
                "cascade suffix table of {} requests / {} pages exceeds its workspace",
                suffix.last_page_len.len(),
                suffix.indices.len()
            )));
        }
        let words = self.staging.as_mut_slice()?;
        let plan_len = self.capacity.encoded_len();
        plan.encode_into(self.capacity, &mut words[..plan_len])?;
        let mut at = plan_len;
        let mut ranges = Vec::with_capacity(4);
        for array in arrays {
            words[at..at + array.len()].copy_from_slice(array);
            ranges.push(at..at + array.len());
            at += array.len();
        }
        gpu.upload_pinned_range(&self.staging, 0..plan_len, &mut self.plan)?;
        for (range, buffer) in ranges.into_iter().zip(&mut self.suffix) {
            let mut target = view_mut(buffer, 0..range.len())?;
            gpu.upload_pinned_range(&self.staging, range, &mut target)?;
        }
        self.num_requests = suffix.last_page_len.len();
        self.slots = plan.decode.num_chunks();
        Ok(())
    }

    /// The suffix page table of `num_requests` requests, as staged.
    pub fn suffix_table(&self, num_requests: usize) -> Result<DevicePageTable<'_>, CudaError> {
        let [indptr, indices, last_page_len, first_page_offset] = &self.suffix;
        Ok(DevicePageTable {
            indptr: view(indptr, 0..num_requests + 1)?,
            indices: pagoda_cuda::whole(indices),
            last_page_len: view(last_page_len, 0..num_requests)?,
            first_page_offset: view(first_page_offset, 0..num_requests)?,
        })
    }
}

/// Cascade decode: one query per request (`queries` row `r`), against `kv`'s pools, in the
/// levels the uploaded plans say (the shared level's in `cascade`, the fused decode's with the
/// reserved slots in `decode`, both made by one [`CascadePlan`] for `kv`'s page table). The
/// shared level reads `kv`'s page indices; the unique level reads `cascade`'s suffix table.
/// `out` is `[B, num_q_heads, head_dim]`, fully overwritten. Launch sizes are the
/// capacities', so the three launches replay from a CUDA graph with new plans in the same
/// buffers.
pub fn cascade_decode_attention<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    (cascade, decode): (&CascadeWorkspace, &mut PagedDecodeWorkspace),
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let layout = kv.layout;
    layout.validate()?;
    let num_q_heads = queries.num_heads;
    if let Some(reason) = cascade_unsupported(T::DTYPE, &layout, num_q_heads) {
        return Err(CudaError::invalid(format!(
            "cascade decode does not support {reason}"
        )));
    }
    let num_requests = kv.page_table.num_requests();
    check_decode_io(
        &layout,
        (kv.k_pool.len(), kv.v_pool.len()),
        (queries.data.len(), num_q_heads, queries.row_stride),
        num_requests,
        out.len(),
    )?;
    if num_requests != cascade.num_requests {
        return Err(CudaError::invalid(format!(
            "cascade decode of {num_requests} requests with a plan for {}",
            cascade.num_requests
        )));
    }
    if cascade.slots > decode.capacity().max_chunks {
        return Err(CudaError::invalid(format!(
            "cascade plan of {} slots for a decode workspace of {} chunks",
            cascade.slots,
            decode.capacity().max_chunks
        )));
    }
    let tiling = cascade.tiling;
    let spec = specialize_cascade_shared(T::DTYPE, layout.head_dim, tiling)?;
    let (partial_out, partial_lse) = decode.partials();
    let num_indices = kv.page_table.indices.len();
    let args = [
        ptr(&queries.data),
        ptr(&kv.k_pool),
        ptr(&kv.v_pool),
        ptr(&kv.page_table.indices),
        ptr(&cascade.plan),
        ptr(partial_out),
        ptr(partial_lse),
        KernelArg::U32(to_u32("max_items", cascade.capacity.max_items)?),
        KernelArg::U32(to_u32("num_indices", num_indices)?),
        KernelArg::U32(to_u32("num_q_heads", num_q_heads)?),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(to_u32("page_size", layout.page_size)?),
        KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
        KernelArg::U32(to_u32("q_row_stride", queries.row_stride)?),
        KernelArg::F32(scale * std::f32::consts::LOG2_E),
    ];
    let dims = LaunchDims {
        shared_mem_bytes: tiling.shared_bytes(layout.head_dim) as u32,
        prefer_shared: true,
        ..LaunchDims::new(
            (
                to_u32("cascade items", cascade.capacity.max_items.max(1))?,
                to_u32("num_kv_heads", layout.num_kv_heads)?,
            ),
            128,
        )
    };
    // SAFETY: arguments match `cascade_shared_attention` (prefill_stream.cu with CASCADE):
    // the plan buffer holds the capacity's encoded length, and the planner gave every member
    // a slot below the decode plan's chunk count, which the decode workspace's partials hold
    // (max_chunks x num_q_heads rows, checked above); q, pools and out extents were checked
    // above.
    unsafe { gpu.launch(&spec, dims, &args)? };
    let suffix = PagedKv {
        k_pool: kv.k_pool,
        v_pool: kv.v_pool,
        layout,
        page_table: cascade.suffix_table(num_requests)?,
    };
    // The unique level does not read the shared one: launched beside it (programmatically,
    // on compute capability 9.0+), its merge after both.
    paged_decode_beside(gpu, queries, &suffix, decode, scale, out)
}
