//! Sparse decode on CUDA (Quest page selection, `--sparse-attention`), the same choice as the
//! CPU's (`crate::llama::step::sparse`): per layer, the key summaries (min and max of each
//! page's keys per KV head) follow the KV append on the device, and a decode step whose
//! requests ask for it scores their pages from the summaries and writes a shorter page list
//! (`ops::sparse_select`), on which the fused decode then runs unchanged. The host knows the
//! shortened table's row pointer and lengths before the step (the budget fixes how many pages
//! a request keeps, not which), so the decode's plan is staged as usual and the step replays
//! from a graph keyed by its grid; the device writes only the page ids, no host round trip.
//!
//! Needs the fused decode and a pool in the model's dtype: not over an fp8 KV cache, not in
//! deterministic mode (every row then runs the prefill kernel), not with the gather decode, not
//! on a latent (MLA) cache. The engine refuses `--sparse-attention` at start there
//! ([`sparse_unsupported`]).

use pagoda_cuda::{CudaError, DeviceBuffer, DeviceRead, DeviceViewMut, Gpu};
use pagoda_kv::PageTable;
use pagoda_ops::attention::{SparseAttention, SparseStepStats};
use pagoda_ops::cuda::{
    self as ops, DevicePageTable, PagedKv, PoolLayout, Queries, SparseSelectPlan,
    SparseSelectWorkspace,
};

use super::decode_path::{launch_workspace, FusedDecode};
use super::{CudaCacheOptions, HostFloat, PagedDecodeMode};
use crate::config::ModelConfig;

/// Why sparse decode cannot run on this CUDA setup (`None`: it can): the reasons are the
/// switches that exclude it, so a refusal names the way out.
pub fn sparse_unsupported(
    c: &ModelConfig,
    options: &CudaCacheOptions,
    dtype: pagoda_cuda::DType,
) -> Option<String> {
    let k = &options.kernels;
    if c.mla.is_some() {
        Some("a latent attention (MLA) model".into())
    } else if k.kv_fp8 {
        Some("an fp8 KV cache (-ctk fp8; use bf16)".into())
    } else if k.deterministic {
        Some("--deterministic".into())
    } else if options.paged_decode == PagedDecodeMode::Gather {
        Some("--paged-decode gather".into())
    } else if c.head_dim > ops::SPARSE_MAX_HEAD_DIM {
        Some(format!(
            "head_dim {} (at most {})",
            c.head_dim,
            ops::SPARSE_MAX_HEAD_DIM
        ))
    } else if c.num_kv_heads > ops::SPARSE_MAX_KV_HEADS {
        Some(format!(
            "{} KV heads (at most {})",
            c.num_kv_heads,
            ops::SPARSE_MAX_KV_HEADS
        ))
    } else if !ops::SPARSE_DTYPES.contains(&dtype) {
        Some(format!("{dtype} activations"))
    } else if c.num_attention_heads * c.head_dim * dtype.size_bytes() > ops::SPARSE_MAX_QUERY_BYTES
    {
        Some(format!(
            "a query row of {} heads x {} (at most {} bytes)",
            c.num_attention_heads,
            c.head_dim,
            ops::SPARSE_MAX_QUERY_BYTES
        ))
    } else {
        None
    }
}

/// The grid a sparse step's selection covers for a longest shortened request of `pages`
/// pages: from 64, the next of the powers of two and the midpoints `3 * 2^k` between them (at
/// most a third of the grid idle, against half with powers alone), capped at `max_pages`; a
/// few graphs cover every length.
pub fn sparse_grid_pages(pages: usize, max_pages: usize) -> usize {
    let pages = pages.max(64);
    let power = pages.next_power_of_two();
    let midpoint = power / 4 * 3;
    (if pages <= midpoint { midpoint } else { power }).min(max_pages)
}

/// A code of `grid` below 32, distinct for the grids [`sparse_grid_pages`] returns under one
/// `max_pages`: `2 log2` for a power of two, one more for a midpoint `3 * 2^k`, and 31 for a
/// grid capped at `max_pages` that is neither (there is only one such grid).
pub fn sparse_grid_code(grid: usize) -> usize {
    if grid.is_power_of_two() {
        2 * grid.trailing_zeros() as usize
    } else if grid.is_multiple_of(3) && (grid / 3).is_power_of_two() {
        2 * (grid / 3 * 2).trailing_zeros() as usize + 1
    } else {
        31
    }
}

/// Sparse decode's device state: the summaries per layer, the selection's workspace and
/// output, and the step's plan.
pub struct SparseDecode<T> {
    /// Per layer, `[num_pages, num_kv_heads, 2, head_dim]` in the pool's dtype.
    summaries: Vec<DeviceBuffer<T>>,
    workspace: SparseSelectWorkspace,
    /// The selected page ids (each layer rewrites them before its decode).
    indices: DeviceBuffer<u32>,
    /// The plan of the step being staged ([`Self::plan`] to [`Self::stage`]).
    pending: Option<SparseSelectPlan>,
    page_size: usize,
}

impl<T: HostFloat> SparseDecode<T> {
    /// The state for `options` when they ask for sparse decode and the setup runs it (else
    /// `None`; the engine refuses the flag where it cannot run), for page tables of up to
    /// `max_indices` page ids.
    pub fn new(
        gpu: &Gpu,
        c: &ModelConfig,
        options: &CudaCacheOptions,
        layout: &PoolLayout,
        max_indices: usize,
    ) -> Result<Option<Self>, CudaError> {
        if !options.kernels.sparse_decode || sparse_unsupported(c, options, T::DTYPE).is_some() {
            return Ok(None);
        }
        // The kernels compile now (or load from the disk cache): the summaries' update runs
        // in every step, decode graphs captured at start-up included.
        let kernels = options.kernels.sparse_select;
        let (scores, select) =
            ops::sparse_select_entries(kernels, layout.head_dim, layout.num_kv_heads, T::DTYPE);
        for entry in [ops::SparseEntry::Summaries, scores, select] {
            gpu.prepare(&ops::specialize_sparse(entry, T::DTYPE)?)?;
        }
        tracing::info!(
            "CUDA sparse decode: page scores {scores:?}, selection {select:?} \
             (PAGODA_CUDA_SPARSE_SELECT={kernels:?})"
        );
        let summaries = (0..c.num_layers)
            .map(|_| gpu.zeros(ops::sparse_summaries_len(layout)))
            .collect::<Result<Vec<_>, _>>()?;
        let pages = options.max_context.div_ceil(layout.page_size.max(1)) + 1;
        let max_pages = pages.min(ops::SPARSE_MAX_PAGES);
        let requests = options.max_batch_requests.max(1);
        let mut workspace = SparseSelectWorkspace::new(gpu, requests, max_pages)?;
        workspace.set_kernels(kernels);
        // Each layer's selection follows its summaries' update ([`Self::update`] after the
        // append), which writes only the step's window pages, or a mixed step's prefill
        // attention: neither writes what the scores read.
        workspace.set_after_update(true);
        Ok(Some(SparseDecode {
            summaries,
            workspace,
            indices: gpu.zeros(max_indices.max(1))?,
            pending: None,
            page_size: layout.page_size,
        }))
    }

    /// Bytes of the summaries (what sparse decode adds to the KV cache).
    pub fn bytes(&self) -> usize {
        self.summaries.iter().map(|s| s.len()).sum::<usize>() * std::mem::size_of::<T>()
    }

    /// Plans a decode step over the leading requests of `table` that `qo_indptr` covers (one
    /// query row each; a mixed step's decode rows) with each request's settings `params`
    /// (requests past the selection's pages decode densely), padded to `rows` requests: the
    /// selection's grid pages, what it does to a layer and the longest shortened context,
    /// or `None` when no request is shortened (the plain fused decode runs).
    pub fn plan(
        &mut self,
        table: &PageTable,
        qo_indptr: &[u32],
        params: &[Option<SparseAttention>],
        rows: usize,
    ) -> Result<Option<(usize, SparseStepStats, usize)>, CudaError> {
        self.pending = None;
        if params.iter().all(Option::is_none) {
            return Ok(None);
        }
        let max_pages = self.workspace.max_pages();
        let mut plan = SparseSelectPlan::new(table, qo_indptr, params, self.page_size, max_pages)?;
        if plan.dense_past_limit > 0 {
            pagoda_ops::attention::record_sparse_dense_past_limit(plan.dense_past_limit as u64);
            static LOGGED: std::sync::Once = std::sync::Once::new();
            LOGGED.call_once(|| {
                tracing::warn!(
                    "CUDA sparse decode: requests past {max_pages} pages ({} tokens) decode \
                     densely (the device selection's limit)",
                    max_pages * self.page_size
                )
            });
        }
        if plan.stats.sparse_requests == 0 {
            return Ok(None);
        }
        plan.pad_to(rows);
        let grid = sparse_grid_pages(plan.max_sparse_pages, self.workspace.max_pages());
        let context = plan.seq_lens.iter().max().map_or(0, |&l| l as usize);
        let stats = plan.stats;
        self.pending = Some(plan);
        Ok(Some((grid, stats, context)))
    }

    /// Uploads the planned step's selection and returns its table's row pointer (padded),
    /// for the fused decode's plan.
    pub fn stage(&mut self, gpu: &Gpu) -> Result<&[u32], CudaError> {
        let plan = self
            .pending
            .as_ref()
            .ok_or_else(|| CudaError::invalid("a sparse step without its plan"))?;
        self.workspace.upload(gpu, plan)?;
        Ok(&plan.indptr)
    }

    /// After layer `layer`'s KV append of `slots` into `k_pool`: the summaries of the pages
    /// the step wrote.
    pub fn update(
        &mut self,
        gpu: &Gpu,
        layer: usize,
        k_pool: &DeviceBuffer<T>,
        layout: &PoolLayout,
        slots: &pagoda_cuda::DeviceView<'_, i32>,
    ) -> Result<(), CudaError> {
        let summaries = &mut self.summaries[layer];
        ops::sparse_summaries_update(gpu, k_pool, layout, slots, summaries)
    }

    /// Layer `layer`'s selection for the staged step over `table` (the full one) on a grid
    /// of `grid_pages`, then its shortened table for the decode.
    pub fn select<'a>(
        &'a mut self,
        gpu: &Gpu,
        layer: usize,
        queries: &Queries<'_, T>,
        (layout, grid_pages): (&PoolLayout, usize),
        table: &DevicePageTable<'a>,
    ) -> Result<DevicePageTable<'a>, CudaError> {
        let SparseDecode {
            summaries,
            workspace,
            indices,
            ..
        } = self;
        workspace.set_grid_pages(grid_pages)?;
        let summaries = &summaries[layer];
        ops::sparse_select(gpu, queries, summaries, layout, table, workspace, indices)?;
        workspace.selected_table(table, indices)
    }
}

/// The fused decode over `kv`, whose page ids a selection just wrote: it follows the
/// selection programmatically (`ops::sparse_decode`; after the bitwise kernels, which let no
/// dependent launch early, that is at their completion).
pub(super) fn decode_selected<T: HostFloat>(
    fused: &mut Option<FusedDecode>,
    gpu: &Gpu,
    queries: &Queries<'_, T>,
    kv: &PagedKv<'_, T>,
    (grid_chunks, variant, scale): (usize, ops::DecodeVariant, f32),
    out: &mut DeviceViewMut<'_, T>,
) -> Result<(), CudaError> {
    let workspace = launch_workspace(fused, grid_chunks, variant.kernel)?;
    ops::sparse_decode(gpu, queries, kv, workspace, variant.merge, scale, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_the_pages_within_a_third_and_their_codes_are_distinct() {
        for max_pages in [8192, 5000, 96, 64] {
            let mut by_code = std::collections::HashMap::new();
            for pages in 1..=max_pages {
                let grid = sparse_grid_pages(pages, max_pages);
                assert!(grid >= pages && grid <= max_pages, "{pages} -> {grid}");
                if pages >= 64 && grid < max_pages {
                    assert!(
                        3 * (grid - pages) <= grid,
                        "{pages} -> {grid}: over a third idle"
                    );
                }
                let code = sparse_grid_code(grid);
                assert!(code < 32);
                assert_eq!(*by_code.entry(code).or_insert(grid), grid, "code {code}");
            }
        }
        // 32K tokens at page 16 are 2049 pages with the decoded token: a grid of 3072.
        assert_eq!(sparse_grid_pages(2049, 8192), 3072);
        assert_eq!(sparse_grid_pages(2048, 8192), 2048);
        assert_eq!(sparse_grid_pages(10, 8192), 64);
    }
}
