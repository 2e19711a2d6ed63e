//! Sparse decode through page indirection (Quest): per page and KV head, the elementwise
//! minimum and maximum of the page's keys ([`KeySummaries`], kept up to date by the KV
//! append), and a selector ([`QuestSelector`]) that scores every page of a long decode row
//! by the upper bound of `q·k` those summaries give and writes a SHORTER page table over the
//! same pool: the first page (attention sink), the last pages covering the recent window and
//! the best-scoring pages within a token budget. The dense decode
//! ([`step_attention`](crate::attention::step_attention)) then runs on that table unchanged.
//!
//! The bound: for a key `k` with `min <= k <= max` elementwise,
//! `q·k <= Σ_d max(q_d * min_d, q_d * max_d)`. A page's score is that bound summed over the
//! query heads of each GQA group and over the KV heads (one page list per request serves
//! every KV head, so the decode keeps its page granularity and its bits: a request whose
//! every page is kept gets exactly the dense table).
//!
//! Selection is per request, from its own query and pages only, so a row's output does not
//! depend on its batch. Kept pages stay in ascending order; the first page keeps its
//! `first_page_offset` and the last page its `last_page_len`, so the shorter table obeys every
//! [`PageTable`] invariant.

use std::sync::atomic::{AtomicU64, Ordering};

use pagoda_kv::{PageTable, Slot};

pub use super::sparse_params::SparseAttention;
use crate::attention::{validate, AttentionError, KvLayout, KvSlice, PagedKv, QueryBatch};

/// Per page and KV head, the elementwise minimum and maximum of the keys written to the page
/// (one layer): `[num_pages, num_kv_heads, 2, head_dim]` f32, minimum first. A page's entry
/// restarts when its row 0 is written (a page freed and handed to another request is always
/// written from row 0 first), so the summaries are reused with the pages and need no
/// separate freeing.
#[derive(Clone, Debug, PartialEq)]
pub struct KeySummaries {
    num_pages: usize,
    num_kv_heads: usize,
    head_dim: usize,
    data: Vec<f32>,
}

impl KeySummaries {
    /// Empty summaries (every bound `+inf`/`-inf` inverted: min `+inf`, max `-inf`) for a pool
    /// of `layout`.
    pub fn new(layout: &KvLayout) -> KeySummaries {
        let per_page = layout.num_kv_heads * 2 * layout.head_dim;
        let mut data = vec![0.0; layout.num_pages * per_page];
        for entry in data.chunks_exact_mut(layout.head_dim) {
            entry.fill(f32::INFINITY);
        }
        for (index, entry) in data.chunks_exact_mut(layout.head_dim).enumerate() {
            if index % 2 == 1 {
                entry.fill(f32::NEG_INFINITY);
            }
        }
        KeySummaries {
            num_pages: layout.num_pages,
            num_kv_heads: layout.num_kv_heads,
            head_dim: layout.head_dim,
            data,
        }
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }

    /// `[head_dim]` minimum of `page`'s keys for `kv_head`.
    pub fn min(&self, page: usize, kv_head: usize) -> &[f32] {
        let start = self.offset(page, kv_head);
        &self.data[start..start + self.head_dim]
    }

    /// `[head_dim]` maximum of `page`'s keys for `kv_head`.
    pub fn max(&self, page: usize, kv_head: usize) -> &[f32] {
        let start = self.offset(page, kv_head) + self.head_dim;
        &self.data[start..start + self.head_dim]
    }

    fn offset(&self, page: usize, kv_head: usize) -> usize {
        (page * self.num_kv_heads + kv_head) * 2 * self.head_dim
    }

    /// Folds the keys just written at `slots` of `k_pool` into their pages' summaries, read
    /// back from the pool (so an f16 or q8_0 pool is summarized as stored). Slots in the order
    /// the append wrote them; a slot at row 0 restarts its page's entry.
    pub fn update(
        &mut self,
        k_pool: KvSlice<'_>,
        layout: &KvLayout,
        slots: &[Slot],
    ) -> Result<(), AttentionError> {
        if layout.num_pages != self.num_pages
            || layout.num_kv_heads != self.num_kv_heads
            || layout.head_dim != self.head_dim
        {
            return Err(AttentionError::Geometry(format!(
                "key summaries of {} pages x {} KV heads x {} dims for a pool of {} x {} x {}",
                self.num_pages,
                self.num_kv_heads,
                self.head_dim,
                layout.num_pages,
                layout.num_kv_heads,
                layout.head_dim
            )));
        }
        validate::length(
            "k_pool [num_pages, page_size, num_kv_heads, head_dim]",
            layout.pool_len(),
            k_pool.len(),
        )?;
        let head_dim = self.head_dim;
        let mut scratch = vec![0.0f32; head_dim];
        for slot in slots {
            let (page, row) = (slot.page.index(), slot.offset as usize);
            if page >= layout.num_pages || row >= layout.page_size {
                return Err(AttentionError::Geometry(format!(
                    "slot (page {page}, row {row}) outside a pool of {} pages of {}",
                    layout.num_pages, layout.page_size
                )));
            }
            for kv_head in 0..self.num_kv_heads {
                let key = k_pool.row(
                    layout.head_offset(page, row, kv_head),
                    head_dim,
                    &mut scratch,
                );
                let start = self.offset(page, kv_head);
                let (min, max) = self.data[start..start + 2 * head_dim].split_at_mut(head_dim);
                if row == 0 {
                    min.copy_from_slice(key);
                    max.copy_from_slice(key);
                } else {
                    for ((low, high), &value) in min.iter_mut().zip(max.iter_mut()).zip(key) {
                        *low = low.min(value);
                        *high = high.max(value);
                    }
                }
            }
        }
        Ok(())
    }

    /// The upper bound of `q·k` over the keys of `page` for `kv_head`, summed over the query
    /// heads `q_group [n_rep, head_dim]` of its GQA group (in order). Each head's bound
    /// `sum_d max(q_d * min_d, q_d * max_d)` is summed in the order the device's octet sums it
    /// ([`octet_order_bound`]), so the CUDA selection scores bit for bit as this one does.
    pub fn group_bound(&self, page: usize, kv_head: usize, q_group: &[f32]) -> f32 {
        let (min, max) = (self.min(page, kv_head), self.max(page, kv_head));
        q_group
            .chunks_exact(self.head_dim)
            .map(|q| octet_order_bound(q, min, max))
            .sum()
    }
}

/// One query head's bound `sum_d max(q_d * min_d, q_d * max_d)`, summed as the device's octet
/// of 8 lanes sums it: lane `l` adds the terms of the slice of `ceil(head_dim / 8)`
/// consecutive dimensions from `l * ceil(head_dim / 8)` in order (from -0.0), then the lanes
/// fold in halves (lane `l` adds lane `l + 4`, then `l + 2`, then `l + 1`: the xor butterfly
/// of `__shfl_xor_sync` over 8 lanes).
pub fn octet_order_bound(q: &[f32], min: &[f32], max: &[f32]) -> f32 {
    let slice = q.len().div_ceil(8).max(1);
    let mut lanes = [-0.0f32; 8];
    let slices = q
        .chunks(slice)
        .zip(min.chunks(slice))
        .zip(max.chunks(slice));
    for (lane, ((q, low), high)) in lanes.iter_mut().zip(slices) {
        for ((&q, &low), &high) in q.iter().zip(low).zip(high) {
            *lane += (q * low).max(q * high);
        }
    }
    for width in [4, 2, 1] {
        for lane in 0..width {
            lanes[lane] += lanes[lane + width];
        }
    }
    lanes[0]
}

/// What one selector call (one layer of one step) did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SparseStepStats {
    /// Requests whose page list was shortened.
    pub sparse_requests: u64,
    /// Pages those requests could see.
    pub pages_scanned: u64,
    /// Pages kept for them.
    pub pages_kept: u64,
}

/// Process-wide totals of the selectors, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SparseDecodeCounts {
    /// Selector calls (one layer of one step) that shortened at least one request's pages.
    pub steps: u64,
    /// Pages scored by them.
    pub pages_scanned: u64,
    /// Pages they kept.
    pub pages_kept: u64,
    /// Requests a CUDA step left dense because they are longer than the device selection
    /// handles ([`SPARSE_MAX_PAGES`](crate::cuda::SPARSE_MAX_PAGES) pages), once a step.
    pub dense_past_limit: u64,
}

static STEPS: AtomicU64 = AtomicU64::new(0);
static PAGES_SCANNED: AtomicU64 = AtomicU64::new(0);
static PAGES_KEPT: AtomicU64 = AtomicU64::new(0);
static DENSE_PAST_LIMIT: AtomicU64 = AtomicU64::new(0);

/// The process-wide [`SparseDecodeCounts`].
pub fn sparse_decode_counts() -> SparseDecodeCounts {
    SparseDecodeCounts {
        steps: STEPS.load(Ordering::Relaxed),
        pages_scanned: PAGES_SCANNED.load(Ordering::Relaxed),
        pages_kept: PAGES_KEPT.load(Ordering::Relaxed),
        dense_past_limit: DENSE_PAST_LIMIT.load(Ordering::Relaxed),
    }
}

/// Adds `requests` to [`SparseDecodeCounts::dense_past_limit`] (a CUDA step's requests too
/// long for the device selection).
pub fn record_sparse_dense_past_limit(requests: u64) {
    DENSE_PAST_LIMIT.fetch_add(requests, Ordering::Relaxed);
}

/// Adds `layers` selector calls that each did `stats` to the [`SparseDecodeCounts`] (the
/// CPU selector records each of its calls; a CUDA step records its layers at once, since
/// every layer of a step shortens the same requests to the same number of pages). Calls
/// that shortened nothing are not counted.
pub fn record_sparse_layers(stats: &SparseStepStats, layers: u64) {
    if stats.sparse_requests > 0 && layers > 0 {
        STEPS.fetch_add(layers, Ordering::Relaxed);
        PAGES_SCANNED.fetch_add(stats.pages_scanned * layers, Ordering::Relaxed);
        PAGES_KEPT.fetch_add(stats.pages_kept * layers, Ordering::Relaxed);
    }
}

/// A decode-time KV selector: from one layer's paged KV and the step's queries, the page
/// table the decode then runs on unchanged (each request's own pages, or a shorter list of
/// them, in CSR). Quest ([`QuestSelector`]) selects pages; a token-granular selector
/// (DeepSeek-V3.2's indexer) fits the same interface over a page-size-1 view of its pool.
pub trait DecodeSelector {
    /// Writes the shorter table into `out` (its allocations are reused).
    fn select(
        &self,
        kv: &PagedKv<'_>,
        queries: &QueryBatch<'_>,
        out: &mut PageTable,
    ) -> Result<SparseStepStats, AttentionError>;
}

/// Quest's page selection (see the module docs) with per-request settings: `params[r]`
/// `None` keeps request `r` dense; an empty `params` keeps every request dense. Only decode
/// rows (one query) with at least `min_context` visible tokens and more than `budget` are
/// shortened.
#[derive(Clone, Copy, Debug)]
pub struct QuestSelector<'a> {
    /// The layer's key summaries.
    pub summaries: &'a KeySummaries,
    /// `[B]` (or empty): each request's settings.
    pub params: &'a [Option<SparseAttention>],
}

impl DecodeSelector for QuestSelector<'_> {
    fn select(
        &self,
        kv: &PagedKv<'_>,
        queries: &QueryBatch<'_>,
        out: &mut PageTable,
    ) -> Result<SparseStepStats, AttentionError> {
        let table = kv.page_table;
        let num_requests = table.num_requests();
        let n_rep = validate::geometry(&kv.layout, queries.num_q_heads)?;
        if queries.qo_indptr.len() != num_requests + 1 {
            return Err(AttentionError::Indptr {
                what: "qo_indptr",
                reason: format!(
                    "{} entries for {num_requests} requests",
                    queries.qo_indptr.len()
                ),
            });
        }
        if !self.params.is_empty() && self.params.len() != num_requests {
            return Err(AttentionError::Geometry(format!(
                "{} sparse-attention settings for {num_requests} requests",
                self.params.len()
            )));
        }
        let head_dim = kv.layout.head_dim;
        let q_row = queries.num_q_heads * head_dim;
        out.clone_from(table);
        out.indices.clear();
        out.indptr.truncate(1);
        let mut stats = SparseStepStats::default();
        let mut kept = Vec::new();
        for request in 0..num_requests {
            let pages =
                &table.indices[table.indptr[request] as usize..table.indptr[request + 1] as usize];
            let (first, last) = (
                queries.qo_indptr[request] as usize,
                queries.qo_indptr[request + 1] as usize,
            );
            let params = self.params.get(request).copied().flatten();
            let seq_len = table.seq_lens[request] as usize;
            let applies = params.is_some_and(|p| {
                last == first + 1 && seq_len >= p.min_context && seq_len > p.budget
            });
            let query = queries.q.get(first * q_row..(first + 1) * q_row);
            match (params, query) {
                (Some(params), Some(query)) if applies => {
                    let scores = |page: u32| {
                        (0..kv.layout.num_kv_heads)
                            .map(|kv_head| {
                                let group = &query
                                    [kv_head * n_rep * head_dim..(kv_head + 1) * n_rep * head_dim];
                                self.summaries.group_bound(page as usize, kv_head, group)
                            })
                            .sum::<f32>()
                    };
                    let geometry = RequestPages {
                        num_pages: pages.len(),
                        page_size: kv.layout.page_size,
                        first_page_offset: table.first_page_offset[request] as usize,
                        last_page_len: table.last_page_len[request] as usize,
                    };
                    let page_scores: Vec<f32> = pages.iter().map(|&page| scores(page)).collect();
                    select_pages(&geometry, &params, &page_scores, &mut kept);
                    stats.sparse_requests += 1;
                    stats.pages_scanned += pages.len() as u64;
                    stats.pages_kept += kept.len() as u64;
                    out.indices.extend(kept.iter().map(|&i| pages[i]));
                    out.seq_lens[request] = geometry.tokens(&kept) as u32;
                }
                _ => out.indices.extend_from_slice(pages),
            }
            out.indptr.push(out.indices.len() as u32);
        }
        record_sparse_layers(&stats, 1);
        Ok(stats)
    }
}

/// One request's page geometry, for the token counts of a selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestPages {
    /// Pages of the request (at least 1).
    pub num_pages: usize,
    /// Rows per page.
    pub page_size: usize,
    /// Invisible rows at the start of the first page.
    pub first_page_offset: usize,
    /// Rows of the last page.
    pub last_page_len: usize,
}

impl RequestPages {
    /// Visible tokens of page `index`.
    pub fn page_tokens(&self, index: usize) -> usize {
        let end = if index + 1 == self.num_pages {
            self.last_page_len
        } else {
            self.page_size
        };
        let start = if index == 0 {
            self.first_page_offset
        } else {
            0
        };
        end.saturating_sub(start)
    }

    /// Visible tokens of the pages `kept`.
    pub fn tokens(&self, kept: &[usize]) -> usize {
        kept.iter().map(|&index| self.page_tokens(index)).sum()
    }
}

/// The window of a request of at least one page: its first page (the last pages until they
/// cover `params.window` tokens, never the sink) and the tokens the sink and the window keep.
pub(crate) fn window_of(pages: &RequestPages, params: &SparseAttention) -> (usize, usize) {
    let n = pages.num_pages;
    let mut window_start = n - 1;
    let mut window_tokens = pages.page_tokens(n - 1);
    while window_start > 1 && window_tokens < params.window {
        window_start -= 1;
        window_tokens += pages.page_tokens(window_start);
    }
    let fixed = if window_start == 0 {
        window_tokens
    } else {
        pages.page_tokens(0) + window_tokens
    };
    (window_start, fixed)
}

/// Quest's choice over one request's pages (indices into its page list, ascending, into
/// `kept`): page 0 (the sink), the last pages whose tokens cover `params.window` (at least the
/// last page, which holds the query's own token), then the middle pages by descending
/// `scores` (ties: the earlier page) while the kept tokens stay within `params.budget`. The
/// sink and the window are kept even where they alone exceed the budget.
pub fn select_pages(
    pages: &RequestPages,
    params: &SparseAttention,
    scores: &[f32],
    kept: &mut Vec<usize>,
) {
    kept.clear();
    if pages.num_pages == 0 {
        return;
    }
    let (window_start, fixed) = window_of(pages, params);
    let mut middle: Vec<usize> = (1..window_start).collect();
    middle.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut room = params.budget.saturating_sub(fixed);
    let mut chosen = Vec::new();
    for index in middle {
        let tokens = pages.page_tokens(index);
        if tokens > room {
            break;
        }
        room -= tokens;
        chosen.push(index);
    }
    chosen.sort_unstable();
    if window_start > 0 {
        kept.push(0);
    }
    kept.extend(chosen);
    kept.extend(window_start..pages.num_pages);
}
