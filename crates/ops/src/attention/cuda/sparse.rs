//! Quest sparse decode on the device, the ops-level half: the key summaries kept up to date
//! after a step's KV append ([`sparse_summaries_update`]) and the per-request page selection
//! that writes a shorter CSR page table ([`sparse_select`]) for the fused decode to run on
//! unchanged. The semantics are the CPU's ([`KeySummaries`](crate::attention::KeySummaries),
//! [`QuestSelector`](crate::attention::QuestSelector)) exactly: the same bounds, the same
//! scores to the bit, the same pages kept, ties included.
//!
//! Summaries are stored in the pool's dtype: a min or max of pool values is a pool value, so
//! nothing is lost against the CPU's f32, and a bf16 pool's summaries take half the memory
//! and half the bandwidth the selection reads every step (at page 16 a bf16 summary is 1/16
//! of the page's K and V). e4m3 pools are not covered yet.
//!
//! Selection is two launches: `sparse_page_scores` (the query row staged in shared memory, an
//! octet of 8 lanes per (page, KV head) pair sweeping its min and max in 16-byte loads, the
//! lanes and heads folded in the CPU's order, so scores agree to the bit) then
//! `sparse_select_pages`, one CTA of 1024 threads per request holding the scores in registers,
//! which finds the keep-th best bit by bit from the top (block counts by
//! `__syncthreads_count`, stopping as soon as exactly `keep` pages lie at or above the prefix)
//! and writes the kept pages in page order after one block scan.
//! [`SparseSelectKernels::Radix`] (`PAGODA_CUDA_SPARSE_SELECT=radix`, not yet measured on a
//! GPU) swaps in `sparse_page_scores_ahead` (an octet's two pairs loaded before the staging,
//! at three CTAs an SM, where each lane's slice is one or two vectors) and
//! `sparse_select_pages_radix` (a byte-at-a-time radix select over one shared histogram a
//! pass); the same pages either way. Fixed grids (from the workspace's capacity) and no host
//! round trip: graph-capturable once the plan is uploaded.
//! [`sparse_page_scores`] alone is public for the benchmark's breakdown.

use super::gathered::{DevicePageTable, PoolLayout, Queries};
use super::paged_decode::{paged_decode_launch, Follows, PagedDecodeWorkspace};
pub use super::sparse_plan::{
    SparseSelectPlan, SPARSE_DENSE, SPARSE_MAX_PAGES, SPARSE_REQUEST_WORDS,
};
use super::{MergeMode, PagedKv};
use pagoda_cuda::{
    check_len, check_min_len, ptr, to_u32, whole, CudaError, DType, DeviceBuffer, DeviceRead,
    DeviceWrite, Element, Gpu, KernelArg, KernelSource, KernelSpec, LaunchDims, PinnedBuffer,
};

/// The summaries' update and the page scores (typed by the pool's dtype).
static SPARSE_SUMMARY: KernelSource =
    KernelSource::new("sparse_summary.cu", include_str!("sparse_summary.cu"));
/// The per-request page selection.
static SPARSE_SELECT: KernelSource =
    KernelSource::new("sparse_select.cu", include_str!("sparse_select.cu"));

/// Threads of a `sparse_page_scores` CTA (32 octets of 8 lanes).
const SCORE_THREADS: u32 = 256;
/// (page, KV head) pairs a `sparse_page_scores` CTA aims at: two per octet (the most
/// `sparse_page_scores_ahead` takes, the kernel's `2 * SCORE_OCTETS`).
const SCORE_PAIRS: usize = 64;
/// 16-byte vectors of a lane's slice `sparse_page_scores_ahead` takes (its `SCORE_CHUNK`).
const SCORE_AHEAD_VECTORS: usize = 2;
/// (page, KV head) pairs and pages a `sparse_page_scores_ahead` CTA holds at most (its
/// shared `s_group` and `s_page`: `SCORE_MAX_PAIRS`, `SCORE_MAX_CTA_PAGES`).
const SCORE_MAX_PAIRS: usize = 512;
const SCORE_MAX_CTA_PAGES: usize = 64;
/// `sparse_page_scores_ahead` CTAs an SM holds (its `SCORE_MIN_CTAS`).
const SCORE_MIN_CTAS: usize = 3;
/// Threads of a `sparse_select_pages` CTA.
const SELECT_THREADS: u32 = 1024;
/// Threads of a `sparse_summaries_update` CTA (a summary element each).
const SUMMARY_THREADS: usize = 256;
/// Most KV heads the page scores handle (their shared-memory groups).
pub const SPARSE_MAX_KV_HEADS: usize = 256;
/// Largest head_dim the page scores handle (8 lanes x `SCORE_MAX_SLICE`).
pub const SPARSE_MAX_HEAD_DIM: usize = 256;
/// Most bytes of one query row (all heads) the page scores stage in shared memory (with
/// their static shared memory, under the 48 KiB a launch gets without opting in).
pub const SPARSE_MAX_QUERY_BYTES: usize = 40 * 1024;

/// Pool dtypes the sparse kernels are built for.
pub const SPARSE_DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The entry points of the sparse decode kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SparseEntry {
    /// `sparse_summaries_update`.
    Summaries,
    /// `sparse_page_scores`.
    Scores,
    /// `sparse_page_scores_ahead` (see [`sparse_select_entries`]).
    ScoresAhead,
    /// `sparse_select_pages` (untyped).
    Select,
    /// `sparse_select_pages_radix` (untyped).
    SelectRadix,
}

/// Which selection kernels run (`PAGODA_CUDA_SPARSE_SELECT`); both keep the same pages, the
/// CPU's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SparseSelectKernels {
    /// `sparse_page_scores` (the query row and page ids staged before any summary load) and
    /// `sparse_select_pages` (the keep-th best found bit by bit): round 3, the fallback.
    Bitwise,
    /// `sparse_page_scores_ahead` where the shape allows ([`sparse_select_entries`]), launched
    /// beside the step's summaries update ([`SparseSelectWorkspace::set_after_update`]), and
    /// `sparse_select_pages_radix`: 1.3-1.5x faster sparse attention than [`Self::Bitwise`]
    /// on the H100 at 32K (`docs/benchmark_results/sparse-cuda-h100-2026-12-07b.md`).
    #[default]
    Radix,
}

impl SparseSelectKernels {
    /// The setting's word (`bitwise` or `radix`); `None` for any other.
    pub fn parse(word: &str) -> Option<Self> {
        match word {
            "bitwise" => Some(SparseSelectKernels::Bitwise),
            "radix" => Some(SparseSelectKernels::Radix),
            _ => None,
        }
    }
}

/// The specialisation of `entry` for a pool of `dtype` (ignored by [`SparseEntry::Select`]).
pub fn specialize_sparse(entry: SparseEntry, dtype: DType) -> Result<KernelSpec, CudaError> {
    if matches!(entry, SparseEntry::Select | SparseEntry::SelectRadix) {
        return Ok(KernelSpec {
            source: &SPARSE_SELECT,
            entry: if entry == SparseEntry::Select {
                "sparse_select_pages"
            } else {
                "sparse_select_pages_radix"
            },
            params: vec![("MAX_PAGES", SPARSE_MAX_PAGES as i64)],
            dtypes: vec![],
        });
    }
    if !SPARSE_DTYPES.contains(&dtype) {
        return Err(CudaError::invalid(format!(
            "sparse decode: pool dtype {dtype:?} is not supported (one of {SPARSE_DTYPES:?})"
        )));
    }
    Ok(KernelSpec {
        source: &SPARSE_SUMMARY,
        entry: match entry {
            SparseEntry::Summaries => "sparse_summaries_update",
            SparseEntry::ScoresAhead => "sparse_page_scores_ahead",
            _ => "sparse_page_scores",
        },
        params: vec![],
        dtypes: vec![("T", dtype)],
    })
}

/// Every specialisation of the sparse decode kernels.
pub(super) fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = vec![
        specialize_sparse(SparseEntry::Select, DType::U32)?,
        specialize_sparse(SparseEntry::SelectRadix, DType::U32)?,
    ];
    for dtype in SPARSE_DTYPES {
        specs.push(specialize_sparse(SparseEntry::Summaries, dtype)?);
        specs.push(specialize_sparse(SparseEntry::Scores, dtype)?);
        specs.push(specialize_sparse(SparseEntry::ScoresAhead, dtype)?);
    }
    Ok(specs)
}

/// The page-scores and selection entries `kernels` run for a pool of `head_dim`,
/// `num_kv_heads` and `dtype`. With [`SparseSelectKernels::Radix`], the scores load ahead
/// ([`SparseEntry::ScoresAhead`]) where each lane's slice (`ceil(head_dim / 8)` values) is one
/// or two whole 16-byte vectors and a CTA's pairs (`pages_per_cta * num_kv_heads`) are at most
/// `SCORE_PAIRS`; elsewhere they are [`SparseEntry::Scores`].
pub fn sparse_select_entries(
    kernels: SparseSelectKernels,
    head_dim: usize,
    num_kv_heads: usize,
    dtype: DType,
) -> (SparseEntry, SparseEntry) {
    if kernels == SparseSelectKernels::Bitwise {
        return (SparseEntry::Scores, SparseEntry::Select);
    }
    let slice_bytes = head_dim.div_ceil(8) * dtype.size_bytes();
    let whole = head_dim.is_multiple_of(8) && slice_bytes.is_multiple_of(16);
    let ahead = whole && slice_bytes / 16 <= SCORE_AHEAD_VECTORS && num_kv_heads <= SCORE_PAIRS;
    let scores = if ahead {
        SparseEntry::ScoresAhead
    } else {
        SparseEntry::Scores
    };
    (scores, SparseEntry::SelectRadix)
}

/// Elements of one layer's summaries: `[num_pages, num_kv_heads, 2, head_dim]`.
pub fn sparse_summaries_len(layout: &PoolLayout) -> usize {
    layout.num_pages * layout.num_kv_heads * 2 * layout.head_dim
}

/// After a step's KV append: every page a slot of `slots` (the append's, `page * page_size +
/// row`; negative or out-of-pool slots are padding, skipped) wrote gets its summaries entry
/// recomputed from `k_pool` rows `0..=` the highest row the step wrote to it. That is the
/// CPU's fold (whose entry restarts at row 0) wherever rows `0..=` that row were all written
/// since the page's last row 0, which holds for the KV append: a page fills from row 0 up and
/// belongs to one request through a step (a step that wrote row 5 of a page and then restarted
/// it at row 0 would differ; no append does that). One CTA per slot;
/// only the last writer of a page writes, so a prefill chunk's many rows of one page do not
/// race. Pages no slot wrote keep their entries.
pub fn sparse_summaries_update<T: Element>(
    gpu: &Gpu,
    k_pool: &impl DeviceRead<T>,
    layout: &PoolLayout,
    slots: &impl DeviceRead<i32>,
    summaries: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let spec = specialize_sparse(SparseEntry::Summaries, T::DTYPE)?;
    layout.validate()?;
    check_len("sparse k_pool", layout.pool_len(), k_pool.len())?;
    check_len(
        "sparse summaries [num_pages, num_kv_heads, 2, head_dim]",
        sparse_summaries_len(layout),
        summaries.len(),
    )?;
    let num_slots = slots.len();
    if num_slots == 0 {
        return Ok(());
    }
    let args = [
        ptr(k_pool),
        ptr(slots),
        KernelArg::U32(to_u32("sparse step slots", num_slots)?),
        ptr(summaries),
        KernelArg::U32(to_u32("page_size", layout.page_size)?),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(to_u32("head_dim", layout.head_dim)?),
        KernelArg::I64((layout.num_pages * layout.page_size) as i64),
    ];
    let columns = (layout.num_kv_heads * layout.head_dim).div_ceil(SUMMARY_THREADS);
    let grid = (
        to_u32("sparse step slots", num_slots)?,
        to_u32("sparse summary columns", columns)?,
    );
    // SAFETY: arguments match `sparse_summaries_update`; pool and summaries extents checked,
    // slots outside the pool skipped by the kernel, elements past the row by the kernel.
    unsafe { gpu.launch(&spec, LaunchDims::new(grid, SUMMARY_THREADS as u32), &args) }
}

/// The device side of a [`SparseSelectPlan`]: its per-request words and row pointer, and the
/// scores scratch, sized for `max_requests` requests of up to `max_pages` pages (the grids
/// are fixed by them, so a captured graph replays with new plans).
pub struct SparseSelectWorkspace {
    requests: DeviceBuffer<u32>,
    indptr: DeviceBuffer<u32>,
    scores: DeviceBuffer<f32>,
    /// Pinned host staging of the per-request words and the row pointer, uploaded from.
    staging: PinnedBuffer<u32>,
    max_requests: usize,
    max_pages: usize,
    /// Pages the next launch's grid covers (at most `max_pages`; see [`Self::set_grid_pages`]).
    grid_pages: usize,
    /// The last upload's requests, selected pages and longest shortened request.
    uploaded: Option<(usize, usize, usize)>,
    /// The kernels [`sparse_select`] launches.
    kernels: SparseSelectKernels,
    /// Whether the kernel launched just before [`sparse_select`] writes nothing the scores
    /// read ([`Self::set_after_update`]).
    after_update: bool,
    /// CTAs the looped scores' grid aims at ([`Self::set_score_ctas`]; `None`: the GPU's).
    score_ctas: Option<usize>,
}

impl SparseSelectWorkspace {
    /// Buffers for up to `max_requests` requests of up to `max_pages` (`1..=`
    /// [`SPARSE_MAX_PAGES`]) pages each.
    pub fn new(gpu: &Gpu, max_requests: usize, max_pages: usize) -> Result<Self, CudaError> {
        if max_requests == 0 || max_pages == 0 || max_pages > SPARSE_MAX_PAGES {
            return Err(CudaError::invalid(format!(
                "sparse select workspace: {max_requests} requests of {max_pages} pages \
                 (need >= 1 and pages <= {SPARSE_MAX_PAGES})"
            )));
        }
        Ok(SparseSelectWorkspace {
            requests: gpu.zeros(max_requests * SPARSE_REQUEST_WORDS)?,
            indptr: gpu.zeros(max_requests + 1)?,
            scores: gpu.zeros(max_requests * max_pages)?,
            staging: gpu.alloc_pinned(max_requests * (SPARSE_REQUEST_WORDS + 1) + 1)?,
            max_requests,
            max_pages,
            grid_pages: max_pages,
            uploaded: None,
            kernels: SparseSelectKernels::default(),
            after_update: false,
            score_ctas: None,
        })
    }

    /// Sets the kernels the next launches run (the default until set:
    /// [`SparseSelectKernels::Bitwise`]).
    pub fn set_kernels(&mut self, kernels: SparseSelectKernels) {
        self.kernels = kernels;
    }

    /// Declares that the kernel launched just before each [`sparse_select`] (or
    /// [`sparse_page_scores`]) on this workspace writes nothing the scores read: in a step,
    /// the [`sparse_summaries_update`] of the step's own slots (they lie in the shortened
    /// requests' windows, never scored) or a mixed step's prefill attention. With
    /// [`SparseSelectKernels::Radix`] on compute capability 9.0 and up, the scores then
    /// launch programmatically and run beside that kernel. A caller whose update wrote
    /// scored pages (a whole pool's summaries, say) must leave this off.
    pub fn set_after_update(&mut self, after_update: bool) {
        self.after_update = after_update;
    }

    /// Sets the CTAs the [`SparseEntry::ScoresAhead`] grid aims at (see
    /// [`score_pages_per_cta`]); `None` (the default): `SCORE_MIN_CTAS` per SM of the GPU.
    /// Tests pin a few to run many rounds a CTA, the benchmark `usize::MAX` for one.
    pub fn set_score_ctas(&mut self, ctas: Option<usize>) {
        self.score_ctas = ctas;
    }

    /// The kernels the launches run.
    pub fn kernels(&self) -> SparseSelectKernels {
        self.kernels
    }

    /// Sets the pages the next [`sparse_select`] launches cover per request (`1..=` the
    /// workspace's pages): its grid and its scores' stride. A captured launch keeps it, so a
    /// graph of a step whose longest shortened request has `pages` pages replays for any
    /// other step up to that length. Errors: 0 or past the workspace.
    pub fn set_grid_pages(&mut self, pages: usize) -> Result<(), CudaError> {
        if pages == 0 || pages > self.max_pages {
            return Err(CudaError::invalid(format!(
                "sparse select: a grid of {pages} pages (the workspace holds 1..={})",
                self.max_pages
            )));
        }
        self.grid_pages = pages;
        Ok(())
    }

    /// Pages a request may hold ([`Self::new`]'s `max_pages`).
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// Writes `plan` into the pinned staging and queues its uploads on the stream (outside
    /// any graph; a graph replayed after them reads them). The staging is rewritten by the
    /// next call, after the stream has passed these copies in the step's order.
    pub fn upload(&mut self, gpu: &Gpu, plan: &SparseSelectPlan) -> Result<(), CudaError> {
        let b = plan.num_requests();
        if b > self.max_requests || plan.max_sparse_pages > self.max_pages {
            return Err(CudaError::invalid(format!(
                "sparse select: a plan of {b} requests and {} pages exceeds the workspace's {} \
                 and {}",
                plan.max_sparse_pages, self.max_requests, self.max_pages
            )));
        }
        let words = b * SPARSE_REQUEST_WORDS;
        let staging = self.staging.as_mut_slice()?;
        staging[..words].copy_from_slice(&plan.requests);
        staging[words..words + b + 1].copy_from_slice(&plan.indptr);
        let requests = &mut self.requests.view_mut(0..words)?;
        gpu.upload_pinned_range(&self.staging, 0..words, requests)?;
        let indptr = &mut self.indptr.view_mut(0..b + 1)?;
        gpu.upload_pinned_range(&self.staging, words..words + b + 1, indptr)?;
        self.uploaded = Some((b, plan.selected_pages(), plan.max_sparse_pages));
        Ok(())
    }

    /// The selected table's row pointer on the device (`[B + 1]` of the last upload), for
    /// its [`DevicePageTable`].
    pub fn indptr(&self) -> &DeviceBuffer<u32> {
        &self.indptr
    }

    /// The selected table on the device, for the decode: the uploaded row pointer,
    /// `out_indices` (what [`sparse_select`] wrote) and `full`'s last-page lengths and
    /// first-page offsets (the selection keeps both end pages, so they are unchanged).
    pub fn selected_table<'a>(
        &'a self,
        full: &DevicePageTable<'a>,
        out_indices: &'a impl DeviceRead<u32>,
    ) -> Result<DevicePageTable<'a>, CudaError> {
        let b = full.num_requests();
        Ok(DevicePageTable {
            indptr: self.indptr.view(0..b + 1)?,
            indices: whole(out_indices),
            last_page_len: full.last_page_len,
            first_page_offset: full.first_page_offset,
        })
    }
}

/// Writes the selected page ids of the uploaded plan into `out_indices` (at least the plan's
/// [`selected_pages`](SparseSelectPlan::selected_pages)): per request of `table` (the full
/// table the plan was made from, device side), its kept pages in page order. `queries` hold
/// the step's rows (a shortened request's one row is the plan's), `summaries` the layer's
/// (see [`sparse_summaries_update`]). Two launches: [`sparse_page_scores`], then the
/// per-request selection.
pub fn sparse_select<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    summaries: &impl DeviceRead<T>,
    layout: &PoolLayout,
    table: &DevicePageTable<'_>,
    workspace: &mut SparseSelectWorkspace,
    out_indices: &mut impl DeviceWrite<u32>,
) -> Result<(), CudaError> {
    let (_, select) = sparse_select_entries(
        workspace.kernels,
        layout.head_dim,
        layout.num_kv_heads,
        T::DTYPE,
    );
    let select_spec = specialize_sparse(select, T::DTYPE)?;
    let b = table.num_requests();
    if let Some((_, selected, _)) = workspace.uploaded {
        check_min_len("sparse select out_indices", selected, out_indices.len())?;
    }
    sparse_page_scores(gpu, queries, summaries, layout, table, workspace)?;
    if b == 0 {
        return Ok(());
    }
    let select_args = [
        ptr(&table.indptr),
        ptr(&table.indices),
        ptr(&workspace.requests),
        ptr(&workspace.scores),
        KernelArg::U32(to_u32("sparse grid pages", workspace.grid_pages)?),
        ptr(&workspace.indptr),
        ptr(out_indices),
    ];
    let b32 = to_u32("sparse requests", b)?;
    // The radix selection waits for the scores (`griddepcontrol.wait`) before it reads them:
    // launched programmatically, its prologue overlaps their tail.
    let dims = LaunchDims {
        programmatic: workspace.kernels == SparseSelectKernels::Radix
            && gpu.info().programmatic_launches(),
        ..LaunchDims::new((b32, 1), SELECT_THREADS)
    };
    // SAFETY: arguments match `sparse_select_pages`; writes are clamped to the uploaded row
    // pointer, whose total fits out_indices (checked above); the plan matches the table
    // (checked by sparse_page_scores).
    unsafe { gpu.launch(&select_spec, dims, &select_args) }
}

/// The first half of [`sparse_select`]: every middle page's score of the uploaded plan's
/// shortened requests into the workspace's scratch (public so the benchmark can time the
/// halves apart).
pub fn sparse_page_scores<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    summaries: &impl DeviceRead<T>,
    layout: &PoolLayout,
    table: &DevicePageTable<'_>,
    workspace: &mut SparseSelectWorkspace,
) -> Result<(), CudaError> {
    let (scores, _) = sparse_select_entries(
        workspace.kernels,
        layout.head_dim,
        layout.num_kv_heads,
        T::DTYPE,
    );
    let scores_spec = specialize_sparse(scores, T::DTYPE)?;
    layout.validate()?;
    let b = table.num_requests();
    let Some((uploaded, _, longest)) = workspace.uploaded else {
        return Err(CudaError::invalid("sparse select: no plan uploaded"));
    };
    if uploaded != b {
        return Err(CudaError::invalid(format!(
            "sparse select: the uploaded plan has {uploaded} requests, the table {b}"
        )));
    }
    let n_rep = queries.num_heads / layout.num_kv_heads;
    if n_rep == 0 || n_rep * layout.num_kv_heads != queries.num_heads {
        return Err(CudaError::invalid(format!(
            "sparse select: {} query heads are not a multiple of {} KV heads",
            queries.num_heads, layout.num_kv_heads
        )));
    }
    let query_bytes = queries.num_heads * layout.head_dim * std::mem::size_of::<T>();
    if layout.head_dim > SPARSE_MAX_HEAD_DIM
        || layout.num_kv_heads > SPARSE_MAX_KV_HEADS
        || query_bytes > SPARSE_MAX_QUERY_BYTES
    {
        return Err(CudaError::invalid(format!(
            "sparse select: head_dim {}, {} KV heads and a {query_bytes}-byte query row, at most \
             {SPARSE_MAX_HEAD_DIM}, {SPARSE_MAX_KV_HEADS} and {SPARSE_MAX_QUERY_BYTES}",
            layout.head_dim, layout.num_kv_heads
        )));
    }
    if queries.row_stride < queries.num_heads * layout.head_dim {
        return Err(CudaError::invalid(
            "sparse select: query row_stride too small",
        ));
    }
    check_min_len(
        "sparse select q",
        queries.num_heads * layout.head_dim,
        queries.data.len(),
    )?;
    check_len(
        "sparse summaries [num_pages, num_kv_heads, 2, head_dim]",
        sparse_summaries_len(layout),
        summaries.len(),
    )?;
    if b == 0 {
        return Ok(());
    }
    // The query row of each shortened request lives on the device: the kernel trusts the
    // plan's rows to lie in `queries` (the plan is built from the same step's qo_indptr).
    if longest > workspace.grid_pages {
        return Err(CudaError::invalid(format!(
            "sparse select: a request of {longest} pages on a grid of {}",
            workspace.grid_pages
        )));
    }
    let max_pages = to_u32("sparse grid pages", workspace.grid_pages)?;
    let slots = workspace
        .score_ctas
        .unwrap_or(gpu.info().sm_count as usize * SCORE_MIN_CTAS);
    let pages_per_cta = score_pages_per_cta(
        scores,
        layout.num_kv_heads,
        (b, workspace.grid_pages),
        slots,
    );
    let score_args = [
        ptr(&queries.data),
        KernelArg::U32(to_u32("q row stride", queries.row_stride)?),
        ptr(summaries),
        ptr(&table.indptr),
        ptr(&table.indices),
        ptr(&workspace.requests),
        ptr(&workspace.scores),
        KernelArg::U32(max_pages),
        KernelArg::U32(to_u32("num_pages", layout.num_pages)?),
        KernelArg::U32(to_u32("num_kv_heads", layout.num_kv_heads)?),
        KernelArg::U32(to_u32("n_rep", n_rep)?),
        KernelArg::U32(to_u32("head_dim", layout.head_dim)?),
        KernelArg::U32(to_u32("sparse pages per CTA", pages_per_cta)?),
    ];
    let score_grid = (
        max_pages.div_ceil(pages_per_cta as u32),
        to_u32("sparse requests", b)?,
    );
    let dims = LaunchDims {
        shared_mem_bytes: to_u32("sparse query bytes", query_bytes.next_multiple_of(16))?,
        // Beside the step's summaries update, which writes no page scored here.
        programmatic: workspace.after_update
            && workspace.kernels == SparseSelectKernels::Radix
            && gpu.info().programmatic_launches(),
        ..LaunchDims::new(score_grid, SCORE_THREADS)
    };
    // SAFETY: arguments match `sparse_page_scores`; scores hold max_requests * max_pages,
    // written at r * grid_pages + p with p < grid_pages <= max_pages and r < b <=
    // max_requests; the query row fits the dynamic shared memory (checked), KV heads times
    // pages per CTA the shared groups and pages per CTA the staged ids (at most
    // SCORE_MAX_PAIRS and SCORE_MAX_CTA_PAGES by score_pages_per_cta).
    unsafe { gpu.launch(&scores_spec, dims, &score_args) }
}

/// The fused decode over the table [`sparse_select`] just wrote
/// ([`SparseSelectWorkspace::selected_table`]), launched right after it: with the streaming
/// kernel on compute capability 9.0+ it launches programmatically and waits for the selection
/// only before it reads the page ids, so its launch and prologue overlap the selection (whose
/// radix kernel lets it launch once the scores are in). Otherwise as
/// [`paged_decode_attention`](super::paged_decode::paged_decode_attention).
pub fn sparse_decode<T: Element>(
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    workspace: &mut PagedDecodeWorkspace,
    merge: MergeMode,
    scale: f32,
    out: &mut impl DeviceWrite<T>,
) -> Result<(), CudaError> {
    let launch = (merge, scale, Follows::Selection);
    paged_decode_launch(gpu, queries, kv, None, workspace, launch, out)
}

/// Pages a CTA of `entry` scores for `b` requests on a grid of `grid_pages`: a round of two
/// pairs an octet (a page's KV heads together, at least one page); for
/// [`SparseEntry::ScoresAhead`], as many rounds (up to its shared limits) as bring the grid
/// within `slots` CTAs, so it runs in one wave and each CTA pays its prologue once.
pub fn score_pages_per_cta(
    entry: SparseEntry,
    num_kv_heads: usize,
    (b, grid_pages): (usize, usize),
    slots: usize,
) -> usize {
    let round = (SCORE_PAIRS / num_kv_heads).max(1);
    if entry != SparseEntry::ScoresAhead {
        return round;
    }
    let most = (SCORE_MAX_PAIRS / (round * num_kv_heads)).min(SCORE_MAX_CTA_PAGES / round);
    let ctas = grid_pages.div_ceil(round) * b;
    round * ctas.div_ceil(slots.max(1)).clamp(1, most.max(1))
}
