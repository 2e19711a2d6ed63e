//! Cascade decode steps on CUDA (`PAGODA_CASCADE_ATTENTION`): when a decode step's requests
//! share leading pages (the prefix cache's), the shared pages are attended once per group
//! on tensor cores and each request's own pages by the fused decode, merged together
//! (`ops::cascade_decode_attention`; the plan in `ops::CascadePlan`). A step cascades when the
//! rule finds a group whose level pays; otherwise it runs the plain fused decode. The levels'
//! plans live in fixed buffers, so cascade steps replay from their own CUDA graphs.
//!
//! Not in deterministic mode (every decode row then runs the prefill kernel) nor over an fp8
//! KV cache (the shared level reads bf16).

use pagoda_cuda::{CudaError, DType, Gpu};
use pagoda_kv::PageTable;
use pagoda_ops::attention::{CascadeRule, CascadeStats};
use pagoda_ops::cuda::{
    self as ops, CascadeCapacity, CascadeGeometry, CascadePlan, CascadeWorkspace, PagedKv,
    PlanCapacity, PlanPolicy, PrefillStreamTiling, Queries,
};

/// Most shared-level partials one request merges (key chunks over all its levels).
pub const CASCADE_SLOTS: usize = 16;

/// The shortest shared key chunk, in tokens.
const MIN_CHUNK_TOKENS: usize = 256;

/// The rule `auto` applies on CUDA: a level cascades when two or more requests share 256+
/// tokens of it (`pagoda bench cascade` on the H100: never slower than the plain fused
/// decode from there; see `docs/benchmark_results/cascade-*.md`).
pub const CUDA_AUTO_CASCADE_RULE: CascadeRule = CascadeRule {
    min_members: 2,
    min_shared_tokens: 256,
    min_saved_tokens: 256,
};

/// The shared level's workspace, its rule and the step's staged plan.
pub struct CascadeLevels {
    workspace: CascadeWorkspace,
    rule: CascadeRule,
    page_size: usize,
    num_kv_heads: usize,
    group: usize,
    sm_count: usize,
    /// The plan of the step being staged ([`Self::plan`] to [`Self::stage`]).
    pending: Option<CascadePlan>,
}

impl CascadeLevels {
    /// The levels for steps of up to `max_requests` requests and `max_pages` page indices,
    /// or `None` when `rule` is off or the geometry cannot cascade (logged once).
    pub fn new(
        gpu: &Gpu,
        rule: Option<CascadeRule>,
        (dtype, layout, num_q_heads): (DType, &ops::PoolLayout, usize),
        (max_requests, max_pages): (usize, usize),
    ) -> Result<Option<Self>, CudaError> {
        let Some(rule) = rule else {
            tracing::info!("CUDA cascade attention: off");
            return Ok(None);
        };
        if let Some(reason) = ops::cascade_unsupported(dtype, layout, num_q_heads) {
            tracing::info!("CUDA cascade attention: unavailable ({reason}); plain fused decode");
            return Ok(None);
        }
        let sm_count = gpu.info().sm_count.max(1) as usize;
        let kv_heads = layout.num_kv_heads;
        let capacity =
            CascadeCapacity::for_batch(max_requests, kv_heads, 2 * sm_count, CASCADE_SLOTS);
        tracing::info!(
            "CUDA cascade attention: on (decode steps whose {}+ requests share {}+ tokens of a \
             prefix attend to it once per group on tensor cores; not batch-invariant, off in \
             deterministic mode)",
            rule.min_members.max(2),
            rule.min_shared_tokens
        );
        Ok(Some(CascadeLevels {
            workspace: CascadeWorkspace::new(gpu, capacity, max_requests, max_pages)?,
            rule,
            page_size: layout.page_size,
            num_kv_heads: kv_heads,
            group: num_q_heads / kv_heads,
            sm_count,
            pending: None,
        }))
    }

    /// Decode-plan chunks a cascade step of `requests` rows needs beyond the plain plan's
    /// (its requests' shared slots).
    pub fn extra_chunks(requests: usize) -> usize {
        requests * CASCADE_SLOTS
    }

    /// Plans a decode step over `table` (real requests; padded with empty ones to `rows`)
    /// whose fused decode has `policy` and a grid of `grid_chunks` (the plain grid and the
    /// shared slots, [`Self::extra_chunks`]): the shared level's
    /// tile rows and what it shares when the rule finds a level that pays (the plan is kept
    /// for [`Self::stage`]), else `None` (plain fused decode).
    pub fn plan(
        &mut self,
        table: &PageTable,
        rows: usize,
        (policy, grid_chunks, max_requests): (PlanPolicy, usize, usize),
    ) -> Result<Option<(usize, CascadeStats)>, CudaError> {
        self.pending = None;
        let real = table.num_requests();
        let mut padded = table.clone();
        let pages = padded.indices.len() as u32;
        padded.indptr.resize(rows + 1, pages);
        padded.last_page_len.resize(rows, 0);
        padded.first_page_offset.resize(rows, 0);
        padded.seq_lens.resize(rows, 0);
        padded.rope_offsets.resize(rows, 0);
        let tile_rows = if real * self.group <= 64 { 64 } else { 128 };
        let geometry = CascadeGeometry {
            page_size: self.page_size,
            num_kv_heads: self.num_kv_heads,
            group: self.group,
            rows: tile_rows,
            target_ctas: 2 * self.sm_count,
            min_chunk_tokens: MIN_CHUNK_TOKENS,
            max_slots: CASCADE_SLOTS,
        };
        let capacity = PlanCapacity {
            max_chunks: grid_chunks,
            max_requests,
        };
        let sizes = (policy, capacity);
        let capacity = self.workspace.capacity();
        let plan = CascadePlan::new(&padded, &geometry, &self.rule, sizes, capacity)?;
        Ok(plan.map(|plan| {
            let stats = plan.stats;
            self.pending = Some(plan);
            (tile_rows, stats)
        }))
    }

    /// The decode plan of the pending cascade (for the fused decode's staging).
    pub fn pending(&self) -> Option<&CascadePlan> {
        self.pending.as_ref()
    }

    /// Queues the pending plan's shared level and suffix table for upload, its tiles of
    /// `rows` rows.
    pub fn stage(&mut self, gpu: &Gpu, rows: usize) -> Result<(), CudaError> {
        let plan = self
            .pending
            .as_ref()
            .ok_or_else(|| CudaError::invalid("a cascade step without its plan"))?;
        self.workspace.stage(gpu, plan)?;
        self.workspace
            .set_tiling(PrefillStreamTiling::new(rows, 64, 2));
        Ok(())
    }

    /// The shared level's workspace, for the launch.
    pub fn workspace(&self) -> &CascadeWorkspace {
        &self.workspace
    }
}

/// Runs a cascade step's attention: `queries` (one row per request of `kv`'s table) over the
/// staged levels, the fused decode's workspace sized for `grid_chunks` chunks.
pub(super) fn cascade_decode<T: pagoda_cuda::Element>(
    fused: &mut super::FusedDecode,
    gpu: &Gpu,
    (queries, kv): (&Queries<'_, T>, &PagedKv<'_, T>),
    (grid_chunks, kernel, scale): (usize, ops::PagedDecodeKernel, f32),
    out: &mut impl pagoda_cuda::DeviceWrite<T>,
) -> Result<(), CudaError> {
    let (levels, workspace) = fused.cascade_parts()?;
    workspace.set_grid_chunks(grid_chunks)?;
    workspace.set_kernel(kernel);
    let both = (levels.workspace(), workspace);
    ops::cascade_decode_attention(gpu, queries, kv, both, scale, out)
}
